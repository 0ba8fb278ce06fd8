//! What the HTTP layer needs from an engine, as a trait: implemented by the real
//! [`EngineHandle`]; tests can put a scripted engine behind the same server.

use std::future::Future;
use std::pin::Pin;

pub use kapitsa_engine::service::{
    EngineConfig, EngineHandle, EngineMetrics, Event, ImageInput, Request, RequestStream,
    SubmitError, Timing, TokenLogprob, Usage, VisionInfo, MAX_TOP_LOGPROBS,
};
pub use kapitsa_engine::FinishReason;

/// The future of [`EventStream::recv`].
pub type RecvFuture<'a> = Pin<Box<dyn Future<Output = Option<Event>> + Send + 'a>>;

/// The events of one submitted request; dropping it cancels the request.
pub trait EventStream: Send {
    /// The next event; `None` after `Done` / `Error` or when the engine is gone.
    fn recv(&mut self) -> RecvFuture<'_>;
}

/// A generation engine.
pub trait Engine: Send + Sync + 'static {
    /// Queue a request.
    fn submit(&self, req: Request) -> Result<Box<dyn EventStream>, SubmitError>;
    /// Queue a request whose stream starts with `Event::Admitted` when it gets a cache slot
    /// (an engine that cannot tell may leave it out: callers must not wait for it).
    fn submit_announced(&self, req: Request) -> Result<Box<dyn EventStream>, SubmitError> {
        self.submit(req)
    }
    /// Counters.
    fn metrics(&self) -> EngineMetrics;
    /// Context per sequence, in tokens.
    fn n_ctx(&self) -> usize;
    /// Most requests that can be queued at once (each is queued when submitted); unbounded
    /// unless the engine says otherwise.
    fn max_queue(&self) -> usize {
        usize::MAX
    }
    /// What the model's vision tower takes (`None`: the model has none, requests with images
    /// are refused).
    fn vision(&self) -> Option<VisionInfo> {
        None
    }
    /// Stop: end every request in flight and refuse new ones (may block until the engine
    /// thread has stopped).
    fn shutdown(&self);
}

impl EventStream for RequestStream {
    fn recv(&mut self) -> RecvFuture<'_> {
        Box::pin(RequestStream::recv(self))
    }
}

impl Engine for EngineHandle {
    fn submit(&self, req: Request) -> Result<Box<dyn EventStream>, SubmitError> {
        EngineHandle::submit(self, req).map(|s| Box::new(s) as Box<dyn EventStream>)
    }

    fn submit_announced(&self, req: Request) -> Result<Box<dyn EventStream>, SubmitError> {
        EngineHandle::submit_announced(self, req).map(|s| Box::new(s) as Box<dyn EventStream>)
    }

    fn metrics(&self) -> EngineMetrics {
        EngineHandle::metrics(self)
    }

    fn n_ctx(&self) -> usize {
        EngineHandle::n_ctx(self)
    }

    fn max_queue(&self) -> usize {
        EngineHandle::max_queue(self)
    }

    fn vision(&self) -> Option<VisionInfo> {
        EngineHandle::vision(self)
    }

    fn shutdown(&self) {
        EngineHandle::shutdown(self)
    }
}
