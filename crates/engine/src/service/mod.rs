//! The engine service: one engine thread owning the model's cache and a
//! [`Scheduler`](crate::Scheduler), driven through a cloneable [`EngineHandle`] (continuous
//! batching of many requests). It is the only decode loop: the server runs many sequences
//! through it, `kapitsa run` and `kapitsa chat` one at a time
//! ([`EngineConfig::single_sequence`]), so every decoding feature is written once.
//!
//! Flow: [`EngineHandle::submit`] validates a [`Request`] and queues it; the engine thread
//! admits it into a free cache slot when one is available, runs its prompt in chunks mixed into
//! the decode steps of the other sequences, then streams [`Event::Text`] pieces and one final
//! [`Event::Done`] (or [`Event::Error`]) through the [`RequestStream`]. Dropping the stream or
//! calling [`EngineHandle::cancel`] cancels the request; its slot is freed at the next step.
//!
//! The engine loop: wait for a message when there is no work, else drain new requests and
//! cancellations without blocking; drop requests whose stream was dropped; ask the scheduler
//! for a [`StepPlan`](crate::StepPlan) (decodes first, then prefill chunks, within
//! `max_batch_tokens`); run it as one [`BatchInputs`](kapitsa_models::BatchInputs); for each
//! sequence that got logits: sample with the request's own seeded [`Sampler`] (from the
//! request's own history, so a request gives the same tokens and text batched as alone),
//! stop at an end-of-generation token unless `ignore_eos`, detokenise incrementally, hold
//! back text that may start a stop string and cut at one, send the text that became final;
//! report to the scheduler; publish the metrics.
//!
//! - **Timing.** [`Event::Done`] carries the request's [`Timing`]: prompt time from its
//!   admission into a slot (queueing excluded) to the pass that produced its first logits,
//!   generation time from there to the end.
//!
//! - **Log-probabilities** are the log-softmax of the raw logits: the model's distribution at
//!   temperature 1, before penalties and truncation (what OpenAI reports). For a request with
//!   a [`Request::constraint`] they are taken after the grammar mask, i.e. they are the
//!   log-probabilities of the constrained distribution (disallowed tokens never appear).
//! - **Constraints** ([`crate::structured`]): compiled in [`EngineHandle::submit`] (on the
//!   caller's thread; the per-model token trie is built there on first use), so the engine
//!   thread only computes masks. Before sampling, every token the grammar does not allow gets
//!   `-inf`; the sampled token advances the grammar. An end-of-generation token ends a
//!   constrained request even with `ignore_eos` (the grammar allows nothing after it). A
//!   constraint failure while generating ends that request with [`Event::Error`].
//! - **Failures.** When a forward pass fails (error or panic), each sequence of the batch is
//!   rerun alone: those that fail alone get [`Event::Error`], the others go on. A sequence
//!   whose recurrent state the failed pass already consumed cannot be rerun from where it
//!   was: it is preempted and recomputed from its first token (once; if that happens again
//!   it fails). Panics elsewhere in the engine thread end every request with an error and
//!   stop the engine (later submissions get [`SubmitError::ShutDown`]).
//! - **Queueing.** Requests are admitted first-come first-served as slots free up; the
//!   engine does not time-slice (see [`crate::scheduler`] for the policy it could use).
//! - **Blocking.** [`EngineHandle::shutdown`] (and dropping the last handle) waits for the
//!   step in progress; from async code call it in `spawn_blocking`. Everything else returns
//!   at once.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kapitsa_models::mrope::ImageSpan;
pub use kapitsa_models::vision::VisionInfo;
use kapitsa_models::vision::VisionTower;
use kapitsa_models::{CausalLm, KvType};
use kapitsa_text::Tokenizer;
use tokio::sync::mpsc as tmpsc;

use crate::spec::{SpecConfig, SpecMetrics, SpecRequest, SpecState};
use crate::structured::{Constraint, ConstraintMatcher, LazyStructuredEnv};
use crate::{EngineError, FinishReason, Sampler, SamplingParams};

/// The refusal of images by a model without a vision tower.
pub const NO_VISION: &str = "this model has no vision tower: it cannot take images";

/// Most alternatives [`Request::top_logprobs`] may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Settings of the engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences decoding at once (= cache slots); default 16.
    pub max_running: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks); default 512. Must be
    /// `>= max_running` so that every running sequence can decode in each step.
    pub max_batch_tokens: usize,
    /// Context (cache positions) per sequence; default 4096.
    pub n_ctx: usize,
    /// Requests waiting for a slot before [`SubmitError::QueueFull`]; default 64.
    pub max_queue: usize,
    /// Element type of the KV cache.
    pub kv_type: KvType,
    /// Positions in the shared KV block pool, over all sequences (rounded up to whole
    /// blocks). `None` (default): `max_running * n_ctx`, every sequence can be full at once.
    /// Smaller pools serve more sequences per byte: when the pool runs dry the scheduler
    /// evicts kept prefixes, then preempts the newest sequences (they are recomputed later).
    /// Must be `>= n_ctx`. With the prefix cache, the pool has at least one block more than a
    /// context: a sequence whose prompt ends inside a block shares that block with the cache
    /// and copies it when it writes its first generated token, so a lone sequence that fills
    /// its context needs one block beyond it (at that moment the shared block cannot be
    /// evicted).
    pub kv_pool_tokens: Option<usize>,
    /// Positions per KV block; default [`kapitsa_models::DEFAULT_BLOCK_SIZE`].
    pub kv_block_size: usize,
    /// Prefix caching across requests (see [`kapitsa_cache::prefix`]); default on.
    pub prefix_cache: Option<PrefixCacheConfig>,
    /// Speculative decoding ([`crate::spec`]); default off.
    pub spec: SpecConfig,
    /// The model's vision tower (requests with images need one); default none.
    pub vision: Option<Arc<dyn VisionTower>>,
}

impl EngineConfig {
    /// One sequence at a time in a context of `n_ctx` tokens (what `kapitsa run` and
    /// `kapitsa chat` use): one slot whose pool holds one full context (plus the block
    /// `kv_pool_tokens` explains), 512-token prefill chunks, room for one waiting request, and
    /// `prefix_cache` (with one, a chat's next turn resumes from the previous turn's tokens).
    pub fn single_sequence(
        n_ctx: usize,
        kv_type: KvType,
        prefix_cache: Option<PrefixCacheConfig>,
    ) -> EngineConfig {
        EngineConfig {
            max_running: 1,
            max_batch_tokens: 512,
            n_ctx,
            max_queue: 1,
            kv_type,
            kv_pool_tokens: None,
            kv_block_size: kapitsa_models::DEFAULT_BLOCK_SIZE,
            prefix_cache,
            spec: SpecConfig::default(),
            vision: None,
        }
    }
}

/// Settings of the prefix cache.
#[derive(Debug, Clone)]
pub struct PrefixCacheConfig {
    /// Identifies the model file (cache files of another model are ignored); see
    /// [`crate::loader::model_identity`].
    pub model_id: String,
    /// Most bytes of recurrent-state checkpoints kept in memory; default 1 GiB.
    pub state_bytes: usize,
    /// For recurrent models, also checkpoint every this many prompt tokens (at the end of
    /// the prefill chunk that crosses the mark); default 1024.
    pub checkpoint_every: usize,
    /// Disk tier: folder and size budget in bytes.
    pub disk: Option<(std::path::PathBuf, u64)>,
}

impl Default for PrefixCacheConfig {
    fn default() -> Self {
        PrefixCacheConfig {
            model_id: String::new(),
            state_bytes: 1 << 30,
            checkpoint_every: 1024,
            disk: None,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 16,
            max_batch_tokens: 512,
            n_ctx: 4096,
            max_queue: 64,
            kv_type: KvType::default(),
            kv_pool_tokens: None,
            kv_block_size: kapitsa_models::DEFAULT_BLOCK_SIZE,
            prefix_cache: Some(PrefixCacheConfig::default()),
            spec: SpecConfig::default(),
            vision: None,
        }
    }
}

/// One generation request, in tokens.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids: non-empty, in the vocabulary, shorter than the context.
    pub prompt: Vec<u32>,
    /// Sampling settings (the seed makes sampled output reproducible).
    pub sampling: SamplingParams,
    /// Maximum new tokens (>= 1).
    pub max_tokens: usize,
    /// Stop strings: generation ends when one appears; it is not part of the text.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
    /// `None`: no log-probabilities; `Some(n)`: the log-probability of each sampled token plus
    /// the `n` (<= [`MAX_TOP_LOGPROBS`]) most likely alternatives.
    pub top_logprobs: Option<usize>,
    /// Constrained decoding: the output must match this (JSON schema, ...). Invalid ones are
    /// refused by [`EngineHandle::submit`] with [`SubmitError::InvalidConstraint`].
    pub constraint: Option<Constraint>,
    /// Speculative decoding for this request (default: the engine's [`SpecConfig`]). A mode
    /// the engine cannot run is refused by [`EngineHandle::submit`].
    pub spec: SpecRequest,
    /// Images, in prompt order: the prompt holds one image token ([`VisionInfo::tokens`]
    /// `.image`, where the chat template put `<|image_pad|>`) per image, which the engine
    /// widens to the image's token count. Only for models with a vision tower
    /// ([`EngineHandle::vision`]); a request with images speculates with nothing.
    pub images: Vec<ImageInput>,
}

/// An image of a [`Request`], preprocessed for the model's vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageInput {
    /// Patches `[grid[0] * grid[1] * grid[2], patch_dim]` row-major f32, in the image
    /// processor's order.
    pub values: Vec<f32>,
    /// Patch grid (temporal, height, width).
    pub grid: [usize; 3],
    /// Hash of the image's content: the prefix cache keys the image's tokens by it, so a
    /// later request with the same image at the same place reuses them.
    pub hash: u64,
}

impl Request {
    /// Greedy generation of up to `max_tokens` after `prompt`, no stop strings, no logprobs.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt,
            sampling: SamplingParams::greedy(),
            max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            top_logprobs: None,
            constraint: None,
            spec: SpecRequest::default(),
            images: Vec::new(),
        }
    }
}

/// Log-probability of one generated token.
///
/// Values are the log-softmax of the model's raw logits (temperature 1, before penalties,
/// top-k/top-p/min-p and temperature), i.e. the model's own distribution, as OpenAI reports.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The sampled token.
    pub id: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first
    /// (`top_logprobs` of them).
    pub top: Vec<(u32, f32)>,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (the end-of-generation token that ended the request is not counted;
    /// the token that completed a stop string is).
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V were reused from a cache slot instead of computed.
    pub cached_tokens: usize,
}

/// Where the time of a finished request went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timing {
    /// From admission into a cache slot to the forward pass that gave the prompt's last
    /// logits (the prompt tokens reused from the cache cost nothing here).
    pub prompt: std::time::Duration,
    /// From there to the end: sampling every token and the decode passes between them.
    pub generation: std::time::Duration,
}

/// What a [`RequestStream`] delivers: any number of `Text`, then exactly one `Done` or `Error`
/// (and, for a request submitted with [`EngineHandle::submit_announced`], one `Admitted`
/// before any `Text`).
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The request got a cache slot for the first time (only sent to requests submitted with
    /// [`EngineHandle::submit_announced`]); its prompt is computed from here on.
    Admitted {
        /// Prompt tokens reused from the prefix cache (as [`Usage::cached_tokens`]).
        cached_tokens: usize,
    },
    /// Generated text that is final.
    Text {
        /// The text piece: stop strings (and text that might start one) are held back, and a
        /// stop string and everything after it is never sent.
        text: String,
        /// The tokens generated since the previous `Text` (their text may be partly held
        /// back or cut); all `tokens` of a request concatenated are its completion tokens.
        tokens: Vec<u32>,
        /// One entry per token of `tokens` when the request asked for logprobs, else empty.
        logprobs: Vec<TokenLogprob>,
    },
    /// The request finished normally.
    Done {
        /// Why.
        finish: FinishReason,
        /// Token counts.
        usage: Usage,
        /// Prompt and generation time.
        timing: Timing,
    },
    /// The request failed (model error, engine panic, shutdown); nothing follows.
    Error(String),
}

/// The prefix-cache id of token `j` of an image with content hash `hash`: an id past the
/// vocabulary (`>= n_vocab`), so no text token equals it, that depends on the image and the
/// token's place in it. The model never sees it (the engine feeds the image's rows there).
pub fn image_cache_id(hash: u64, j: usize, n_vocab: usize) -> u32 {
    // splitmix64 of the hash and the index
    let mut z = hash ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let room = (u32::MAX as u64) - n_vocab as u64;
    (n_vocab as u64 + z % room.max(1)) as u32
}

/// Why [`EngineHandle::submit`] refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// `max_queue` requests are already waiting.
    #[error("too many requests are waiting; try again later")]
    QueueFull,
    /// The prompt does not leave room for a generated token.
    #[error("prompt of {n_prompt} tokens does not fit the context of {n_ctx} tokens")]
    PromptTooLong {
        /// Prompt tokens.
        n_prompt: usize,
        /// Context per sequence.
        n_ctx: usize,
    },
    /// Invalid parameters (sampling, tokens outside the vocabulary, empty prompt, ...).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The [`Request::constraint`] does not compile (bad JSON schema or grammar), or the
    /// model cannot be constrained.
    #[error("{0}")]
    InvalidConstraint(String),
    /// The engine is shutting down or has stopped.
    #[error("the engine is shutting down")]
    ShutDown,
}

/// The events of one request. Dropping it cancels the request.
#[derive(Debug)]
pub struct RequestStream {
    id: u64,
    rx: tmpsc::UnboundedReceiver<Event>,
}

impl RequestStream {
    /// The request's id (for [`EngineHandle::cancel`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event; `None` after the last one (`Done` / `Error`), or if the engine died.
    pub async fn recv(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// The next event, blocking the thread (not for use inside an async runtime).
    pub fn blocking_recv(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }
}

/// Counters of the engine (a snapshot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineMetrics {
    /// Requests accepted but not holding a slot (new or preempted).
    pub queued: usize,
    /// Sequences holding a slot (prefilling or decoding).
    pub running: usize,
    /// Cache slots (= `max_running`).
    pub slots_total: usize,
    /// Slots owned by a running sequence.
    pub slots_used: usize,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens_total: u64,
    /// Tokens generated.
    pub generated_tokens_total: u64,
    /// Prompt tokens reused from cache slots.
    pub cached_tokens_total: u64,
    /// Requests that ended with `Done`.
    pub requests_finished: u64,
    /// Requests cancelled (explicitly or by dropping the stream).
    pub requests_cancelled: u64,
    /// Sequences pushed back to the queue to be recomputed later.
    pub preemptions: u64,
    /// KV blocks in the pool.
    pub cache_blocks_total: usize,
    /// KV blocks held by running sequences.
    pub cache_blocks_used: usize,
    /// KV blocks held by finished sequences' kept prefixes (freed when the pool runs dry).
    pub cache_blocks_cached: usize,
    /// Prefix cache counters.
    pub prefix: kapitsa_cache::prefix::PrefixStats,
    /// Forward passes run.
    pub steps: u64,
    /// Speculative decoding counters, per proposer.
    pub spec: SpecMetrics,
}

/// A message to the engine thread.
enum Msg {
    Submit(Box<Submitted>),
    Cancel(u64),
    Shutdown,
}

/// A validated request on its way to the engine thread.
struct Submitted {
    id: u64,
    req: Request,
    /// Send [`Event::Admitted`] at the first admission.
    announce: bool,
    sampler: Sampler,
    /// `req.constraint`, compiled.
    constraint: Option<ConstraintMatcher>,
    /// `req.spec` resolved against the engine's settings (`None`: no speculation).
    spec: Option<SpecState>,
    /// Where `req.images` sit in the widened prompt (same order).
    spans: Vec<ImageSpan>,
    tx: tmpsc::UnboundedSender<Event>,
}

/// State shared by the handles and the engine thread.
struct Shared {
    /// Requests accepted and not holding a slot (checked against `max_queue`).
    queued: AtomicUsize,
    metrics: Mutex<EngineMetrics>,
    shutting_down: AtomicBool,
}

/// The handles' side.
struct Inner {
    tx: Mutex<Option<mpsc::Sender<Msg>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    n_ctx: usize,
    n_vocab: usize,
    max_queue: usize,
    /// The engine's speculative-decoding settings (requests are checked against them).
    spec: SpecConfig,
    /// What the vision tower takes (`None`: no tower).
    vision: Option<VisionInfo>,
    /// Token trie and grammar compiler, built at the first constrained request.
    structured: LazyStructuredEnv,
}

impl Inner {
    fn shutdown(&self) {
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        if let Some(tx) = self.tx.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(Msg::Shutdown);
        }
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A handle to the engine thread; cheap to clone, `Send + Sync`. The engine shuts down when
/// [`EngineHandle::shutdown`] is called or the last handle is dropped.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("n_ctx", &self.inner.n_ctx)
            .finish_non_exhaustive()
    }
}

impl EngineHandle {
    /// Allocate the cache (`max_running` slots of `n_ctx` tokens) and start the engine thread.
    pub fn start(
        model: Arc<dyn CausalLm>,
        tok: Arc<Tokenizer>,
        cfg: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        let bad = |m: String| Err(EngineError::BadRequest(m));
        if cfg.max_running == 0 {
            return bad("max_running must be >= 1".into());
        }
        if cfg.max_batch_tokens < cfg.max_running {
            return bad(format!(
                "max_batch_tokens ({}) must be >= max_running ({})",
                cfg.max_batch_tokens, cfg.max_running
            ));
        }
        if cfg.n_ctx < 2 {
            return bad("n_ctx must be >= 2".into());
        }
        let n_vocab = model.spec().n_vocab;
        let shared = Arc::new(Shared {
            queued: AtomicUsize::new(0),
            metrics: Mutex::new(EngineMetrics {
                slots_total: cfg.max_running,
                ..Default::default()
            }),
            shutting_down: AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::channel();
        let tok_for_constraints = tok.clone();
        let engine = engine::Engine::new(model, tok, &cfg, rx, shared.clone())?;
        let thread = std::thread::Builder::new()
            .name("kapitsa-engine".into())
            .spawn(move || engine.run())
            .map_err(|e| EngineError::BadRequest(format!("cannot start engine thread: {e}")))?;
        Ok(EngineHandle {
            inner: Arc::new(Inner {
                tx: Mutex::new(Some(tx)),
                thread: Mutex::new(Some(thread)),
                shared,
                next_id: AtomicU64::new(1),
                n_ctx: cfg.n_ctx,
                n_vocab,
                max_queue: cfg.max_queue,
                spec: cfg.spec.clone(),
                vision: cfg.vision.as_deref().map(|v| v.info()),
                structured: LazyStructuredEnv::new(tok_for_constraints, n_vocab),
            }),
        })
    }

    /// Validate `req` (prompt non-empty, in the vocabulary and shorter than the context,
    /// `max_tokens >= 1`, sampling parameters, `top_logprobs`), compile its constraint (which
    /// blocks this thread: ~1 ms, plus 1-2 s to build the token trie at the first
    /// constrained request of a 150k-token vocabulary) and queue it.
    pub fn submit(&self, req: Request) -> Result<RequestStream, SubmitError> {
        self.submit_with(req, false)
    }

    /// [`EngineHandle::submit`], and the stream starts with [`Event::Admitted`] once the
    /// request gets a cache slot (a server uses it to report the prefix-cache hit before the
    /// first token, and to know that the prompt is being computed).
    pub fn submit_announced(&self, req: Request) -> Result<RequestStream, SubmitError> {
        self.submit_with(req, true)
    }

    /// What the model's vision tower takes (`None`: the model has none and requests with
    /// images are refused).
    pub fn vision(&self) -> Option<VisionInfo> {
        self.inner.vision
    }

    /// Widen each image token of `req.prompt` to its image's token count (ids past the
    /// vocabulary derived from the image's hash, the prefix-cache key of its tokens): the
    /// images' spans in the widened prompt.
    fn place_images(&self, req: &mut Request) -> Result<Vec<ImageSpan>, SubmitError> {
        if req.images.is_empty() {
            return Ok(Vec::new());
        }
        let bad = |m: String| Err(SubmitError::BadRequest(m));
        let Some(v) = self.inner.vision else {
            return bad(NO_VISION.into());
        };
        let n_marks = req.prompt.iter().filter(|&&t| t == v.tokens.image).count();
        if n_marks != req.images.len() {
            return bad(format!(
                "the prompt has {n_marks} image placeholders for {} images",
                req.images.len()
            ));
        }
        let mut images = req.images.iter();
        let mut prompt = Vec::with_capacity(req.prompt.len());
        let mut spans = Vec::with_capacity(req.images.len());
        for &t in &req.prompt {
            if t != v.tokens.image {
                prompt.push(t);
                continue;
            }
            let Some(img) = images.next() else {
                return bad("more image placeholders than images".into());
            };
            if let Err(e) = v.check_patches(img.values.len(), img.grid) {
                return bad(format!(
                    "an image's patches do not fit the vision tower: {e}"
                ));
            }
            if v.frames {
                prompt.push(v.tokens.start);
            }
            let span = ImageSpan {
                start: prompt.len(),
                grid: v.token_grid(img.grid),
            };
            prompt.extend((0..span.len()).map(|j| image_cache_id(img.hash, j, self.inner.n_vocab)));
            spans.push(span);
            if v.frames {
                prompt.push(v.tokens.end);
            }
        }
        req.prompt = prompt;
        Ok(spans)
    }

    fn submit_with(&self, mut req: Request, announce: bool) -> Result<RequestStream, SubmitError> {
        let inner = &self.inner;
        if inner.shared.shutting_down.load(Ordering::SeqCst) {
            return Err(SubmitError::ShutDown);
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::BadRequest("empty prompt".into()));
        }
        if !req.images.is_empty() && inner.vision.is_none() {
            return Err(SubmitError::BadRequest(NO_VISION.into()));
        }
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= inner.n_vocab) {
            return Err(SubmitError::BadRequest(format!(
                "prompt token {t} is outside the vocabulary ({})",
                inner.n_vocab
            )));
        }
        let spans = self.place_images(&mut req)?;
        if req.prompt.len() >= inner.n_ctx {
            return Err(SubmitError::PromptTooLong {
                n_prompt: req.prompt.len(),
                n_ctx: inner.n_ctx,
            });
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::BadRequest("max_tokens must be >= 1".into()));
        }
        if let Some(n) = req.top_logprobs {
            if n > MAX_TOP_LOGPROBS {
                return Err(SubmitError::BadRequest(format!(
                    "top_logprobs must be <= {MAX_TOP_LOGPROBS}"
                )));
            }
        }
        let sampler = Sampler::new(req.sampling.clone()).map_err(|e| match e {
            EngineError::BadRequest(m) => SubmitError::BadRequest(m),
            e => SubmitError::BadRequest(e.to_string()),
        })?;
        // Images: no proposer sees their tokens (they are not text).
        let spec = if spans.is_empty() {
            self.spec_state(&req.spec)?
        } else {
            None
        };
        let constraint = match &req.constraint {
            Some(c) => Some(
                inner
                    .structured
                    .compile(c)
                    .map_err(|e| SubmitError::InvalidConstraint(e.to_string()))?,
            ),
            None => None,
        };
        // Reserve a place in the queue.
        let q = &inner.shared.queued;
        let mut cur = q.load(Ordering::SeqCst);
        loop {
            if cur >= inner.max_queue {
                return Err(SubmitError::QueueFull);
            }
            match q.compare_exchange(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => break,
                Err(c) => cur = c,
            }
        }
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = tmpsc::unbounded_channel();
        let msg = Msg::Submit(Box::new(Submitted {
            id,
            req,
            announce,
            sampler,
            constraint,
            spec,
            spans,
            tx: etx,
        }));
        let sent = match &*inner.tx.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(tx) => tx.send(msg).is_ok(),
            None => false,
        };
        if !sent {
            q.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShutDown);
        }
        Ok(RequestStream { id, rx: erx })
    }

    /// The controller for a request's speculative settings, or the error that refuses it.
    fn spec_state(&self, r: &SpecRequest) -> Result<Option<SpecState>, SubmitError> {
        let cfg = &self.inner.spec;
        let mode = r.mode.unwrap_or(cfg.mode);
        if mode == crate::spec::SpecMode::Off {
            return Ok(None);
        }
        cfg.check_mode(mode).map_err(SubmitError::BadRequest)?;
        let max = r.max_draft.unwrap_or(cfg.max_draft(mode));
        Ok(Some(SpecState::new(mode, max.min(crate::spec::MAX_DRAFT))))
    }

    /// Cancel request `id` (no effect if it already ended). Its stream ends without `Done`.
    pub fn cancel(&self, id: u64) {
        if let Some(tx) = &*self.inner.tx.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = tx.send(Msg::Cancel(id));
        }
    }

    /// A snapshot of the counters (updated after every step).
    pub fn metrics(&self) -> EngineMetrics {
        let mut m = *self
            .inner
            .shared
            .metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        m.queued = self.inner.shared.queued.load(Ordering::SeqCst);
        m
    }

    /// Context per sequence.
    pub fn n_ctx(&self) -> usize {
        self.inner.n_ctx
    }

    /// Most requests that can wait for a slot at once ([`EngineConfig::max_queue`]); every
    /// request is queued at submission, so a group larger than this can never be accepted.
    pub fn max_queue(&self) -> usize {
        self.inner.max_queue
    }

    /// Stop accepting requests, end every request in flight (with `Event::Error("server
    /// shutting down")`, or `Done` if it had just finished) and join the engine thread. The
    /// step running when this is called completes first. Idempotent.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

mod engine;

/// The log-softmax of `row` (raw logits, temperature 1) at `id`, and the `n` best tokens.
fn token_logprob(row: &[f32], id: u32, n: usize) -> TokenLogprob {
    let max = row
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| ((x - max) as f64).exp())
        .sum();
    let lse = max as f64 + sum.ln();
    let lp = |x: f32| (x as f64 - lse) as f32;
    let mut idx: Vec<u32> = (0..row.len() as u32)
        .filter(|&i| !row[i as usize].is_nan())
        .collect();
    let by = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    let n = n.min(idx.len());
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by);
    }
    idx.truncate(n);
    idx.sort_unstable_by(by);
    TokenLogprob {
        id,
        logprob: row.get(id as usize).map_or(f32::NEG_INFINITY, |&x| lp(x)),
        top: idx.into_iter().map(|i| (i, lp(row[i as usize]))).collect(),
    }
}
