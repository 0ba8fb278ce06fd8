//! Generation: opening a model ([`open`]), sampling, stop conditions, and the engine service
//! that runs every request (the CLI's `run`/`chat` and the server alike) through one
//! scheduler and one decode loop ([`service`]).

pub mod device;
pub mod embed;
pub mod loader;
pub mod open;
pub mod reply;
pub mod rng;
pub mod sampler;
pub mod scheduler;
pub mod service;
pub mod spec;
pub mod stop;
pub mod structured;

pub use device::{Device, DeviceChoice};
pub use kapitsa_models::{KvType, LoadMode};
pub use open::{make_backend, open_draft_model, open_model, OpenOptions, OpenedModel};
pub use reply::{ParsedReply, ReplyEvent, ReplyFormat, ReplyParser, ToolCall, ToolCallFormat};
pub use sampler::{Dist, Sampler, SamplingParams};
pub use scheduler::{FinishReason, Scheduler, SchedulerConfig, SeqId, StepPlan};
pub use service::{
    image_cache_id, EngineConfig, EngineHandle, EngineMetrics, Event, ImageInput,
    PrefixCacheConfig, Request, RequestStream, SubmitError, Timing, TokenLogprob, Usage,
    VisionInfo,
};
pub use spec::{SpecConfig, SpecMetrics, SpecMode, SpecRequest};
pub use stop::StopChecker;
pub use structured::{Constraint, ConstraintMatcher, StructuredEnv, StructuredError};

/// Errors of the engine: opening a model, bad requests, model failures.
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
    /// The device cannot be used (or a `--device` value is not one): a one-line message.
    #[error("{0}")]
    Device(String),
    /// Opening a model failed; `context` says what was being done and names the path.
    #[error("{context}: {source}")]
    Open {
        /// What was being done (`loading model.gguf`).
        context: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Result of engine operations.
pub type Result<T> = std::result::Result<T, EngineError>;
