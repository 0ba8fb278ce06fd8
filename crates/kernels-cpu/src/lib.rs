//! Kapitsa CPU kernels: scalar references and SIMD variants (AVX2, AVX-512) of the ops the
//! models need. [`quant`] holds the ggml block formats (dequantisation, activation quantisation,
//! dot products); [`matmul`](mod@matmul) the quantised matrix-vector / matrix-matrix driver and
//! row gathers.

pub mod attention;
pub mod conv;
pub mod gdn;
mod gemm;
mod gemm_amx;
mod gemm_amx_blk;
pub mod mamba2;
pub mod matmul;
pub mod ops;
pub mod quant;
pub mod vexp;

pub use matmul::{
    dequantize_rows, gemv_batch_with, get_rows, matmul, matmul_dot_with, matmul_many_with,
    matmul_scalar, matmul_with, QMatrix,
};
pub use quant::{
    dequantize_row, quantize_row, vec_dot, vec_dot_type, vec_dot_with, DotKernel, KernelError,
    SimdLevel,
};
