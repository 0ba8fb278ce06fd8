//! A borrowed, typed view of one tensor's bytes in a model file.

use kapitsa_base::GgmlType;

use crate::error::{FormatError, Result};

/// A zero-copy view of one tensor inside a loaded file.
///
/// Shape convention everywhere in this crate: PyTorch order (slowest dimension first, last
/// dimension contiguous), i.e. GGUF `ne` **reversed**. A GGUF 2-D weight with `ne = [n_in, n_out]`
/// has `shape == [n_out, n_in]`.
///
/// `data` is exactly the tensor's bytes: for block-quantised types, `shape[..last]` rows of
/// `dtype.row_bytes(shape[last])` bytes each, rows contiguous in row-major order. For the
/// plain types it is the little-endian elements in row-major order.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorView<'a> {
    /// Tensor name as stored in the file.
    pub name: &'a str,
    /// Element type (ggml numbering). For safetensors `U32` this is `I32`, see [`crate::HfModelDir::tensor`].
    pub dtype: GgmlType,
    /// Dimensions, PyTorch order (last = contiguous).
    pub shape: Vec<usize>,
    /// The tensor's bytes, exactly.
    pub data: &'a [u8],
}

impl TensorView<'_> {
    /// Number of elements (product of `shape`; 1 for a 0-d tensor). Saturates instead of
    /// overflowing; shapes coming from this crate's readers are validated not to overflow.
    pub fn n_elements(&self) -> usize {
        self.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d))
    }

    /// Number of dimensions.
    pub fn n_dims(&self) -> usize {
        self.shape.len()
    }

    /// Decodes an F32 / F16 / BF16 / F64 tensor into a row-major `Vec<f32>` of
    /// `n_elements()` values. Other types give [`FormatError::Shape`].
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let n = self.n_elements();
        let elem = match self.dtype {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::F64 => 8,
            other => {
                return Err(FormatError::Shape(format!(
                    "tensor '{}': cannot convert {other} to f32 (only f32/f16/bf16/f64)",
                    self.name
                )))
            }
        };
        if n.checked_mul(elem) != Some(self.data.len()) {
            return Err(FormatError::Shape(format!(
                "tensor '{}': {} bytes do not match shape {:?} of {}",
                self.name,
                self.data.len(),
                self.shape,
                self.dtype
            )));
        }
        Ok(decode_floats(self.dtype, self.data))
    }
}

/// Decodes little-endian floats of `dtype` (F32/F16/BF16/F64; anything else yields an empty
/// vector) from `bytes`; trailing bytes that do not form a whole element are ignored.
pub(crate) fn decode_floats(dtype: GgmlType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        GgmlType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        GgmlType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        GgmlType::F64 => bytes
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                f64::from_le_bytes(a) as f32
            })
            .collect(),
        _ => Vec::new(),
    }
}
