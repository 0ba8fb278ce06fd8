//! Kapitsa model file formats.
//!
//! - [`GgufFile`]: memory-mapped (or copied into memory, [`LoadMode`]), fully validated GGUF
//!   v2/v3 reader, plus
//!   [`GgufWriter`] for building files in memory.
//! - [`HfModelDir`]: a Hugging Face model directory (`config.json` + one or more
//!   `*.safetensors` shards, memory-mapped).
//! - [`mlx_dequantize`] and [`MlxQuantConfig`]: MLX affine-quantised weights.
//!
//! Shape convention everywhere: PyTorch order (slowest dimension first, last dimension
//! contiguous), i.e. GGUF `ne` reversed. No function in this crate panics on malformed input;
//! every failure is a [`FormatError`].

mod error;
pub mod gguf;
mod hf;
mod mlx;
mod storage;
mod tensor;

pub use error::{FormatError, Result};
pub use gguf::{GgufArray, GgufFile, GgufTensorInfo, GgufValue, GgufValueType, GgufWriter};
pub use hf::{HfModelDir, HfTensorInfo};
pub use kapitsa_base::GgmlType;
pub use mlx::{mlx_dequantize, mlx_dequantize_rows, MlxQuantConfig, MLX_BITS, MLX_GROUP_SIZES};
pub use storage::{memory_fits, LoadMode, OpenOptions};
pub use tensor::TensorView;
