//! Generation: sampling, stop conditions and the prefill/decode loop.

pub mod generate;
pub mod loader;
pub mod reply;
pub mod rng;
pub mod sampler;
pub mod scheduler;
pub mod service;
pub mod stop;
pub mod structured;

pub use generate::{generate, FinishReason, GenerateOutput, GenerateRequest};
pub use reply::{ParsedReply, ReplyEvent, ReplyFormat, ReplyParser, ToolCall, ToolCallFormat};
pub use sampler::{Sampler, SamplingParams};
pub use scheduler::{Scheduler, SchedulerConfig, SeqId, StepPlan};
pub use service::{
    EngineConfig, EngineHandle, EngineMetrics, Event, PrefixCacheConfig, Request, RequestStream,
    SubmitError, TokenLogprob, Usage,
};
pub use stop::StopChecker;
pub use structured::{Constraint, ConstraintMatcher, StructuredEnv, StructuredError};

/// Errors of a generation.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model failed.
    #[error(transparent)]
    Model(#[from] kapitsa_models::ModelError),
    /// Cache storage could not be made or used.
    #[error(transparent)]
    Cache(#[from] kapitsa_cache::CacheError),
    /// The backend (device) failed.
    #[error(transparent)]
    Backend(#[from] kapitsa_backend::BackendError),
    /// Tokenisation or detokenisation failed.
    #[error(transparent)]
    Text(#[from] kapitsa_text::TextError),
    /// The request is invalid.
    #[error("bad request: {0}")]
    BadRequest(String),
}

/// Result of engine operations.
pub type Result<T> = std::result::Result<T, EngineError>;
