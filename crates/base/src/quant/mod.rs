//! The ggml block formats as bytes: block layouts and helpers ([`blocks`]) and scalar
//! dequantisation, bit-exact with ggml ([`dequant`], [`dequantize_row`]). Device-neutral:
//! the model loader uses it for small parameter tensors, the CPU kernels build on it, and the
//! CUDA kernels mirror it.

pub mod blocks;
pub mod dequant;

use crate::GgmlType;

/// Why a row could not be dequantised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// No dequantisation for this type (integer and f64 tensors).
    #[error("cannot dequantise {0:?}")]
    UnsupportedType(GgmlType),
    /// `src` does not hold exactly the bytes of `n` elements (or `n` is not whole blocks).
    #[error("{ty:?}: {got} bytes do not hold {n} elements")]
    BadLength {
        /// Type.
        ty: GgmlType,
        /// Elements asked for.
        n: usize,
        /// Bytes given.
        got: usize,
    },
}

/// Whether [`dequantize_row`] handles `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    !matches!(
        ty,
        GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64 | GgmlType::F64
    )
}

/// Dequantise one row: `src` holds exactly the bytes of `dst.len()` elements of `ty`.
/// Bit-exact with ggml's `dequantize_row_*`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), DequantError> {
    if !can_dequantize(ty) {
        return Err(DequantError::UnsupportedType(ty));
    }
    let n = dst.len();
    let want = n
        .is_multiple_of(ty.block_size())
        .then(|| ty.row_bytes(n))
        .flatten();
    if want != Some(src.len()) {
        return Err(DequantError::BadLength {
            ty,
            n,
            got: src.len(),
        });
    }
    dequant::dequantize_blocks(ty, src, dst);
    Ok(())
}
