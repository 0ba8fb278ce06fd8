//! The backend's own error type: every op returns it, so a device fault becomes an error of
//! the requests in that step instead of a panic.

/// Errors of backend ops and memory operations.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// An op was called with arguments that do not fit together (lengths, shapes, dtypes).
    /// A programming error in the caller, reported instead of panicking.
    #[error("{op}: {msg}")]
    Shape {
        /// The op.
        op: &'static str,
        /// What did not fit.
        msg: String,
    },
    /// A tensor or weight of a type the op or the backend does not support.
    #[error("{op}: unsupported {what}")]
    Unsupported {
        /// The op.
        op: &'static str,
        /// What is unsupported (a type, a shape class).
        what: String,
    },
    /// A handle made by another backend (a CUDA tensor given to the CPU backend, ...).
    #[error("{op}: {what} belongs to another backend")]
    ForeignHandle {
        /// The op.
        op: &'static str,
        /// Which argument.
        what: &'static str,
    },
    /// Device memory ran out.
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    /// The device reported an error (a failed launch, a lost context, ...).
    #[error("device error: {0}")]
    Device(String),
    /// The device is not usable: no driver, no GPU, a binary built without kernels.
    #[error("{0}")]
    Unavailable(String),
    /// A CPU kernel refused its arguments.
    #[error("kernel error: {0}")]
    Kernel(String),
    /// A bad setting (environment variable, option value).
    #[error("{0}")]
    Setting(String),
}

/// Result of a backend op.
pub type Result<T> = std::result::Result<T, BackendError>;

/// Shorthand for a [`BackendError::Shape`].
pub fn shape_err<T>(op: &'static str, msg: impl Into<String>) -> Result<T> {
    Err(BackendError::Shape {
        op,
        msg: msg.into(),
    })
}

/// `Err(Shape)` unless `got == want` (a buffer length check).
pub fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return shape_err(op, format!("{what} has {got} elements, expected {want}"));
    }
    Ok(())
}
