//! `kapitsa serve`: an OpenAI- and Anthropic-compatible HTTP server over the engine service.
//!
//! Endpoints (see the crate's `README.md` for the fields each one accepts and what is not
//! supported):
//!
//! | method | path | API |
//! |---|---|---|
//! | POST | `/v1/chat/completions` | OpenAI chat completions, streaming (SSE) or not |
//! | POST | `/v1/completions` | OpenAI legacy completions (text or token-id prompts) |
//! | GET | `/v1/models`, `/v1/models/{id}` | OpenAI model list |
//! | POST | `/v1/messages` | Anthropic Messages, streaming or not |
//! | POST | `/v1/messages/count_tokens` | Anthropic token counting |
//! | POST | `/v1/responses` | OpenAI Responses API, streaming or not (stateless) |
//! | POST | `/v1/embeddings` | OpenAI embeddings (pooled final hidden states) |
//! | POST, GET | `/api/chat`, `/api/generate`, `/api/embed`, `/api/show`, `/api/tags`, `/api/version`, ... | Ollama's API ([`ollama`]) |
//! | POST | `/infill` | llama.cpp's fill-in-the-middle endpoint (also `suffix` on `/v1/completions`) |
//! | GET | `/health` | `{"status": "ok"}` (503 while shutting down) |
//! | GET | `/metrics` | Prometheus text |
//!
//! With an API key set, every endpoint but `/`, `/health` and `/metrics` needs it, as
//! `Authorization: Bearer KEY` or `x-api-key: KEY`.
//!
//! The server talks to the engine through the [`engine::Engine`] trait, implemented by
//! [`kapitsa_engine::EngineHandle`]; a request of `n` choices is `n` engine requests. Chat
//! replies go through [`kapitsa_engine::ReplyParser`] (format detected from the chat template)
//! so reasoning and tool calls come back as their own fields, never as markup in the text.
//!
//! With a vision-language model (an engine with a vision tower), user messages may carry images
//! through every chat API; [`images`] turns them into the engine's `ImageInput`s.

pub mod anthropic;
pub mod embeddings;
pub mod engine;
pub mod error;
pub mod fim;
pub mod gen;
pub mod images;
pub mod metrics;
pub mod ollama;
pub mod openai;
pub mod params;
pub mod response_format;
pub mod responses;
pub mod responses_stream;
pub mod tokenize;
pub mod tool_choice;

use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kapitsa_engine::{OpenedModel, ReplyFormat};
use kapitsa_text::{ChatTemplate, Tokenizer};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::engine::Engine;
use crate::error::{Api, ApiError, ApiResult, ErrorKind};
use crate::metrics::Metrics;

/// Default request body limit: 64 MiB (room for several images sent inline as base64, which
/// grows them by a third).
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 << 20;

/// Settings of the HTTP layer.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Required API key (`None`: no authentication).
    pub api_key: Option<String>,
    /// Largest accepted request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// On shutdown, how long requests in flight may go on before they are cancelled.
    pub shutdown_grace: Duration,
    /// Anthropic streams send `event: ping` when nothing else was sent for this long
    /// (default [`anthropic::PING_EVERY`]).
    pub ping_every: Duration,
    /// Images in requests (limits, URL fetching).
    pub images: images::ImageConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            shutdown_grace: Duration::from_secs(10),
            ping_every: anthropic::PING_EVERY,
            images: images::ImageConfig::default(),
        }
    }
}

/// The served model's name, tokenizer and chat template.
pub struct ServedModel {
    /// The name clients use in `model` (and `/v1/models` lists).
    pub name: String,
    /// Tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Chat template; `None`: chat endpoints answer 400.
    pub template: Option<ChatTemplate>,
    /// Reasoning / tool-call markup of replies, from the template source.
    pub reply_format: ReplyFormat,
    /// Whether the template reads `tools` (else tool definitions cannot reach the model).
    pub template_uses_tools: bool,
    /// `created` of `/v1/models` (server start, UNIX seconds).
    pub created: u64,
    /// Further names `/v1/models` lists (`--alias`); requests naming one are served.
    pub aliases: Vec<String>,
    /// Refuse requests naming another model (404 `model_not_found`); by default any name is
    /// served by the one model, as llama.cpp's server does (`--strict-model-name`).
    pub strict_name: bool,
    /// Architecture name (`qwen2`, ...; `unknown` when not known).
    pub arch: String,
    /// The chat template's source (Ollama's `/api/show` returns it).
    pub template_source: Option<String>,
    /// Embeddings with the model's weights (`None`: `/v1/embeddings` answers 400).
    pub embed: Option<Arc<kapitsa_engine::embed::LazyEmbedder>>,
    /// How images are cut into patches for the vision tower (`None`: the tower family's
    /// defaults); only read when the engine has a tower.
    pub image_processor: Option<kapitsa_image::Processor>,
}

impl ServedModel {
    /// A model named `name` with `template_src` (the chat template's source, if any).
    pub fn new(
        name: String,
        tokenizer: Arc<Tokenizer>,
        template_src: Option<&str>,
    ) -> anyhow::Result<ServedModel> {
        let template = match template_src {
            Some(src) => Some(
                kapitsa_engine::loader::compile_chat_template(src, &tokenizer)
                    .context("compiling the chat template")?,
            ),
            None => None,
        };
        let src = template_src.unwrap_or("");
        Ok(ServedModel {
            name,
            reply_format: ReplyFormat::from_template(src),
            template_uses_tools: src.contains("tools"),
            template,
            tokenizer,
            created: gen::unix_now(),
            aliases: Vec::new(),
            strict_name: false,
            arch: "unknown".into(),
            template_source: template_src.map(str::to_string),
            embed: None,
            image_processor: None,
        })
    }

    /// Every name the model answers to: its name, then the aliases (duplicates left out).
    pub fn names(&self) -> Vec<&str> {
        let mut out = vec![self.name.as_str()];
        for a in &self.aliases {
            if !out.contains(&a.as_str()) {
                out.push(a);
            }
        }
        out
    }

    /// The model `opened` serves (opened by [`kapitsa_engine::open_model`], whose
    /// `chat_template_file` replaces the model's own template), named `name` or, by default,
    /// after its path ([`default_model_name`]). With a vision tower, the image processor is
    /// read from the checkpoint ([`images::processor_of`]) and must cut images the way the
    /// tower takes them.
    pub fn from_opened(opened: &OpenedModel, name: Option<String>) -> anyhow::Result<ServedModel> {
        let name = name.unwrap_or_else(|| default_model_name(&opened.path));
        let mut m = ServedModel::new(
            name,
            opened.tokenizer.clone(),
            opened.chat_template_source.as_deref(),
        )?;
        m.arch = opened.arch.clone();
        let pooling = kapitsa_engine::embed::Pooling::detect(&opened.source);
        m.embed = Some(Arc::new(kapitsa_engine::embed::LazyEmbedder::new(
            opened.model.clone(),
            pooling,
        )));
        if let Some(v) = &opened.vision {
            let info = v.info();
            let p = images::processor_of(opened, info.kind).map_err(anyhow::Error::msg)?;
            images::check_processor(&p, &info).map_err(anyhow::Error::msg)?;
            m.image_processor = Some(p);
        }
        Ok(m)
    }
}

/// The default model name for `path`: the file or directory name, without a `.gguf`
/// extension.
pub fn default_model_name(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    match name.strip_suffix(".gguf") {
        Some(stem) if !stem.is_empty() => stem.to_string(),
        _ => name,
    }
}

/// Everything a handler needs.
pub struct AppState {
    /// The engine.
    pub engine: Arc<dyn Engine>,
    /// The served model.
    pub model: ServedModel,
    /// Settings.
    pub cfg: ServerConfig,
    /// Server metrics.
    pub metrics: Arc<Metrics>,
    /// Turns true when requests in flight must be cancelled (shutdown grace over).
    cancel: watch::Receiver<bool>,
    /// Shutting down: no new work is accepted.
    draining: AtomicBool,
}

impl AppState {
    /// A receiver that resolves [`gen::cancelled`] on shutdown.
    pub fn cancel_rx(&self) -> watch::Receiver<bool> {
        self.cancel.clone()
    }

    /// Check the request's `model` field: required; with
    /// [`ServedModel::strict_name`], one of [`ServedModel::names`], else any name.
    pub fn check_model(&self, model: Option<&str>) -> ApiResult<()> {
        match model {
            None => Err(ApiError::bad_param(
                "model",
                "'model' is a required property",
            )),
            Some(m) if !self.model.strict_name || self.model.names().contains(&m) => Ok(()),
            Some(m) => Err(ApiError::new(
                ErrorKind::NotFound,
                format!(
                    "The model '{m}' does not exist; this server serves '{}'",
                    self.model.name
                ),
            )
            .with_param("model")
            .with_code("model_not_found")),
        }
    }

    /// Refuse new work while shutting down.
    pub fn check_open(&self) -> ApiResult<()> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ApiError::new(
                ErrorKind::Unavailable,
                "the server is shutting down",
            ));
        }
        Ok(())
    }

    /// Render a conversation with the chat template (generation prompt added).
    pub fn render(
        &self,
        messages: Vec<Value>,
        tools: Option<&Value>,
        extra: Option<&Value>,
    ) -> ApiResult<String> {
        let t = self.model.template.as_ref().ok_or_else(|| {
            ApiError::bad(
                "this model has no chat template: use /v1/completions, or start the server with --chat-template-file",
            )
        })?;
        t.render(&Value::Array(messages), tools, true, extra)
            .map_err(|e| {
                ApiError::bad(format!(
                    "the chat template failed on this conversation: {e}"
                ))
            })
    }

    /// Tokenize a rendered prompt (special tokens written in it are parsed).
    pub fn encode(&self, text: &str) -> ApiResult<Vec<u32>> {
        self.model
            .tokenizer
            .encode(text, true, true)
            .map_err(|e| ApiError::bad(format!("cannot tokenize the prompt: {e}")))
    }

    /// Check a prompt against the context; returns the room left for the reply.
    pub fn room(&self, n_prompt: usize, param: &str) -> ApiResult<usize> {
        let n_ctx = self.engine.n_ctx();
        if n_prompt == 0 {
            return Err(ApiError::bad_param(param, "the prompt is empty"));
        }
        if n_prompt >= n_ctx {
            return Err(ApiError::bad(format!(
                "This model's maximum context length is {n_ctx} tokens. However, your prompt has {n_prompt} tokens, which leaves no room for a reply."
            ))
            .with_param(param)
            .with_code("context_length_exceeded"));
        }
        Ok(n_ctx - n_prompt)
    }
}

/// The request body, or 413 / 400.
pub fn body_bytes(st: &AppState, body: Result<Bytes, BytesRejection>) -> ApiResult<Bytes> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                ErrorKind::TooLarge,
                format!(
                    "the request body is larger than the limit of {} bytes",
                    st.cfg.max_body_bytes
                ),
            )
        } else {
            ApiError::bad(format!("cannot read the request body: {r}"))
        }
    })
}

/// Which error format a path uses.
fn api_for_path(path: &str) -> Api {
    if path.starts_with("/v1/messages") {
        Api::Anthropic
    } else if path.starts_with("/api/") {
        Api::Ollama
    } else {
        Api::OpenAi
    }
}

/// The keys a request carries: `x-api-key` and `Authorization: Bearer`.
fn request_keys(req: &HttpRequest) -> Vec<&str> {
    let h = req.headers();
    let mut keys = Vec::new();
    if let Some(k) = h.get("x-api-key").and_then(|v| v.to_str().ok()) {
        keys.push(k.trim());
    }
    if let Some(auth) = h.get("authorization").and_then(|v| v.to_str().ok()) {
        if let Some((scheme, key)) = auth.trim().split_once(' ') {
            if scheme.eq_ignore_ascii_case("bearer") {
                keys.push(key.trim());
            }
        }
    }
    keys
}

/// Constant-time string equality.
fn same_key(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

async fn auth(State(st): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let path = req.uri().path();
        if path != "/health" && path != "/metrics" && path != "/" {
            let keys = request_keys(&req);
            if !keys.iter().any(|k| same_key(k, key)) {
                let msg = if !keys.is_empty() {
                    "Incorrect API key provided."
                } else {
                    "Missing API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
                };
                return ApiError::new(ErrorKind::Authentication, msg)
                    .into_response_for(api_for_path(path));
            }
        }
    }
    next.run(req).await
}

async fn count_requests(State(st): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    let ep = metrics::endpoint_label(req.uri().path());
    let r = next.run(req).await;
    st.metrics.request(ep, r.status().as_u16());
    r
}

async fn not_found(req: HttpRequest) -> Response {
    let path = req.uri().path().to_string();
    ApiError::new(
        ErrorKind::NotFound,
        format!("no route for {} {path}", req.method()),
    )
    .with_code("not_found")
    .into_response_for(api_for_path(&path))
}

/// The POST endpoints, whose bodies are JSON.
const JSON_POST_PATHS: [&str; 12] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/infill",
    "/v1/embeddings",
    "/api/chat",
    "/api/generate",
    "/api/show",
    "/api/embed",
    "/api/embeddings",
];

/// The methods a known path accepts (the `Allow` header of a 405).
fn allowed_methods(path: &str) -> &'static str {
    if JSON_POST_PATHS.contains(&path) {
        "POST"
    } else {
        "GET,HEAD"
    }
}

async fn method_not_allowed(req: HttpRequest) -> Response {
    let path = req.uri().path().to_string();
    let allow = allowed_methods(&path);
    let mut r = ApiError::new(
        ErrorKind::MethodNotAllowed,
        format!(
            "method {} is not allowed on {path} (allowed: {allow})",
            req.method()
        ),
    )
    .into_response_for(api_for_path(&path));
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// Whether a `Content-Type` value names JSON: `application/json` or `application/*+json`,
/// parameters (`charset`) allowed.
fn is_json_content_type(v: &str) -> bool {
    let mime = v
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// 415 for a POST to a JSON endpoint whose `Content-Type` is present but not JSON (a form or
/// text body: a client mistake, or a browser's cross-site form post). Without the header the
/// body is read as JSON, for raw clients that send none.
///
/// Ollama's routes and llama.cpp's `/infill` read any body as JSON, as those servers do (their
/// documented examples use `curl -d`, which sends a form content type).
async fn require_json(req: HttpRequest, next: Next) -> Response {
    let path = req.uri().path();
    let lenient = path.starts_with("/api/") || path == "/infill";
    if req.method() == Method::POST && JSON_POST_PATHS.contains(&path) && !lenient {
        if let Some(ct) = req.headers().get(header::CONTENT_TYPE) {
            if !ct.to_str().is_ok_and(is_json_content_type) {
                let shown = String::from_utf8_lossy(ct.as_bytes()).into_owned();
                return ApiError::new(
                    ErrorKind::UnsupportedMediaType,
                    format!("Content-Type '{shown}' is not supported: send the body as JSON with 'Content-Type: application/json'"),
                )
                .into_response_for(api_for_path(path));
            }
        }
    }
    next.run(req).await
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let m = st.engine.metrics();
    if st.draining.load(Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down"})),
        )
            .into_response();
    }
    Json(json!({
        "status": "ok",
        "model": st.model.name,
        "slots_total": m.slots_total,
        "slots_used": m.slots_used,
        "queued": m.queued,
    }))
    .into_response()
}

/// `GET` / `HEAD /`: 200, for clients that probe the server's root before using it.
async fn root(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"status": "ok", "model": st.model.name})).into_response()
}

async fn prometheus(State(st): State<Arc<AppState>>) -> Response {
    let text = st.metrics.render(&st.engine.metrics());
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

/// The router of all endpoints over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::responses))
        .route("/infill", post(fim::infill))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/show", post(ollama::show))
        .route("/api/embed", post(ollama::embed))
        .route("/api/embeddings", post(ollama::embeddings_legacy))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/api/version", get(ollama::version))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/health", get(health))
        .route("/", get(root))
        .route("/metrics", get(prometheus))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(middleware::from_fn(require_json))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

/// A server ready to run.
pub struct Server {
    state: Arc<AppState>,
    cancel_tx: watch::Sender<bool>,
}

impl Server {
    /// A server for `model` on `engine`.
    pub fn new(engine: Arc<dyn Engine>, model: ServedModel, cfg: ServerConfig) -> Server {
        let (cancel_tx, cancel) = watch::channel(false);
        Server {
            state: Arc::new(AppState {
                engine,
                model,
                cfg,
                metrics: Arc::new(Metrics::default()),
                cancel,
                draining: AtomicBool::new(false),
            }),
            cancel_tx,
        }
    }

    /// The shared state (metrics, engine).
    pub fn state(&self) -> Arc<AppState> {
        self.state.clone()
    }

    /// Serve on `listener` until `shutdown` resolves; then stop accepting connections, let
    /// the requests in flight finish for up to `shutdown_grace`, cancel the rest, and shut the
    /// engine down.
    pub async fn run(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let state = self.state.clone();
        let grace = state.cfg.shutdown_grace;
        let cancel_tx = self.cancel_tx;
        let st = state.clone();
        let signal = async move {
            shutdown.await;
            st.draining.store(true, Ordering::SeqCst);
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                let _ = cancel_tx.send(true);
            });
        };
        let app = router(state.clone());
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(signal)
            .await;
        let engine = state.engine.clone();
        let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
        r
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
