//! Errors of the CPU kernels.

use kapitsa_base::GgmlType;

/// Why a kernel refused its arguments. Kernels validate sizes once at the public boundary and
/// never panic on bad input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The operation does not support this element type.
    #[error("{op}: unsupported type {ty}")]
    UnsupportedType {
        /// Operation name.
        op: &'static str,
        /// The offending type.
        ty: GgmlType,
    },
    /// A row length is not a multiple of the type's block size.
    #[error("{op}: {n} elements is not a multiple of the {ty} block size {block}")]
    NotBlockMultiple {
        /// Operation name.
        op: &'static str,
        /// Element type.
        ty: GgmlType,
        /// Row length in elements.
        n: usize,
        /// Block size of `ty`.
        block: usize,
    },
    /// A buffer has the wrong length.
    #[error("{op}: {what} has length {got}, expected {expected}")]
    BadLength {
        /// Operation name.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// Expected length (elements or bytes, as the argument is typed).
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// A shape computation overflowed `usize`.
    #[error("{op}: size overflow")]
    Overflow {
        /// Operation name.
        op: &'static str,
    },
    /// A row index (token id) is out of range.
    #[error("{op}: row id {id} out of range (tensor has {n_rows} rows)")]
    RowOutOfRange {
        /// Operation name.
        op: &'static str,
        /// The offending id.
        id: u64,
        /// Rows in the tensor.
        n_rows: usize,
    },
    /// A SIMD level was requested explicitly that the running CPU does not support.
    #[error("SIMD level {0:?} is not available on this CPU")]
    SimdUnavailable(super::SimdLevel),
    /// A setting (environment variable) has a value we do not know.
    #[error("{name} must be {expected}, not '{value}'")]
    BadSetting {
        /// The setting's name.
        name: &'static str,
        /// The value given.
        value: String,
        /// The values accepted.
        expected: &'static str,
    },
}
