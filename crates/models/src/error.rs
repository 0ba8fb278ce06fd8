//! Errors of model loading and forward passes.

use kapitsa_base::GgmlType;

/// Everything that can go wrong loading or running a model. Messages are one line and name the
/// problem (file, tensor, key).
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model file could not be read or is malformed.
    #[error(transparent)]
    Format(#[from] kapitsa_formats::FormatError),
    /// A backend op failed.
    #[error(transparent)]
    Backend(#[from] kapitsa_backend::BackendError),
    /// A cache operation failed (bad slot, out of blocks, context full, device copy).
    #[error(transparent)]
    Cache(#[from] kapitsa_cache::CacheError),
    /// No architecture in the registry handles this model.
    #[error("unsupported architecture '{0}' (supported: {1})")]
    UnsupportedArch(String, String),
    /// A tensor the architecture needs is absent.
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    /// A tensor has an unexpected shape.
    #[error("tensor '{name}' has shape {got:?}, expected {want:?}")]
    BadShape {
        /// Tensor name.
        name: String,
        /// Shape found.
        got: Vec<usize>,
        /// Shape expected.
        want: Vec<usize>,
    },
    /// A tensor uses a type this engine cannot compute with.
    #[error("tensor '{0}' has unsupported type {1}")]
    UnsupportedType(String, GgmlType),
    /// A hyper-parameter is missing or invalid.
    #[error("bad model config: {0}")]
    Config(String),
    /// The batch is malformed (token/position counts, slot ids, logit rows).
    #[error("bad batch: {0}")]
    Batch(String),
}

/// Result of model operations.
pub type Result<T> = std::result::Result<T, ModelError>;
