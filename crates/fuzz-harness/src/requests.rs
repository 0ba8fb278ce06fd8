//! Targets over HTTP requests: OpenAI and Anthropic request bodies (and the model id of
//! `/v1/models/{id}`) through the server's router, with the tiny Qwen2 fixture's tokenizer, the
//! Qwen2.5 chat template (tools, tool calls) and an engine that answers every request at once. Besides not panicking,
//! every answer must be a success or a 4xx in the API's own error shape (a 500 from this
//! engine, which never fails, is a server bug).

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Request as HttpRequest, StatusCode};
use axum::Router;
use kapitsa_server::engine::{
    Engine, EngineMetrics, Event, EventStream, FinishReason, RecvFuture, Request, SubmitError,
    Timing, Usage,
};
use kapitsa_server::{router, ServedModel, Server, ServerConfig};
use kapitsa_text::Tokenizer;
use tower::ServiceExt;

/// An engine that ends every request at once with `Done` (after a piece of JSON text).
struct InstantEngine;

/// The events of one [`InstantEngine`] request, last first.
struct InstantStream(Vec<Event>);

impl EventStream for InstantStream {
    fn recv(&mut self) -> RecvFuture<'_> {
        let ev = self.0.pop();
        Box::pin(async move { ev })
    }
}

impl Engine for InstantEngine {
    fn submit(&self, req: Request) -> Result<Box<dyn EventStream>, SubmitError> {
        let done = Event::Done {
            finish: FinishReason::StopString,
            usage: Usage {
                prompt_tokens: req.prompt.len(),
                completion_tokens: 0,
                cached_tokens: 0,
            },
            timing: Timing::default(),
        };
        let text = Event::Text {
            text: "{\"a\": 1}".into(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
        };
        Ok(Box::new(InstantStream(vec![done, text])))
    }

    fn metrics(&self) -> EngineMetrics {
        EngineMetrics::default()
    }

    fn n_ctx(&self) -> usize {
        4096
    }

    fn max_queue(&self) -> usize {
        64
    }

    fn shutdown(&self) {}
}

/// The router and the runtime to drive it, made once (with the server, whose life is the
/// state's: a dropped server reads as shutting down).
fn app() -> Option<&'static (tokio::runtime::Runtime, Router, Server)> {
    static APP: OnceLock<Option<(tokio::runtime::Runtime, Router, Server)>> = OnceLock::new();
    APP.get_or_init(|| {
        let dir = crate::fixtures().join("tiny/qwen2-a");
        let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
        let cfg: serde_json::Value = serde_json::from_str(&cfg).ok()?;
        let tok =
            Tokenizer::from_tokenizer_json(&dir.join("tokenizer.json"), Some(&cfg), None).ok()?;
        // Qwen2.5's own template: it has tools and a tool-call format.
        let template =
            std::fs::read_to_string(crate::fixtures().join("templates/qwen2.5.jinja")).ok()?;
        let served = ServedModel::new("tiny".into(), Arc::new(tok), Some(&template)).ok()?;
        let server = Server::new(Arc::new(InstantEngine), served, ServerConfig::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        Some((rt, router(server.state()), server))
    })
    .as_ref()
}

/// Send one request and check the answer's shape; whether it succeeded (2xx).
fn send(method: &str, uri: &str, body: &[u8], anthropic: bool) -> bool {
    let Some((rt, app, _)) = app() else {
        return false;
    };
    let Ok(req) = HttpRequest::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body.to_vec()))
    else {
        return false;
    };
    let app = app.clone();
    let (status, bytes) = rt.block_on(async move {
        let Ok(resp) = app.oneshot(req).await;
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20).await;
        (status, bytes)
    });
    let Ok(bytes) = bytes else {
        panic!("{uri}: the body of a {status} answer could not be read");
    };
    assert_ne!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{uri}: 500 for a request: {}",
        String::from_utf8_lossy(&bytes)
    );
    if status.is_client_error() {
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("{uri}: a {status} answer is not JSON ({e}): {bytes:?}"));
        let message = if anthropic {
            assert_eq!(v["type"], "error", "{uri}: {v}");
            &v["error"]["message"]
        } else {
            &v["error"]["message"]
        };
        assert!(
            message.as_str().is_some_and(|m| !m.is_empty()),
            "{uri}: {status} without an error message: {v}"
        );
    }
    if !status.is_success() && std::env::var_os("KAPITSA_FUZZ_DEBUG").is_some() {
        eprintln!("{uri}: {status}: {}", String::from_utf8_lossy(&bytes));
    }
    status.is_success()
}

/// Percent-encode every byte, so that any bytes can be a URL path segment.
fn percent_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("%{b:02X}")).collect()
}

/// `openai_request`: byte 0 picks `/v1/chat/completions`, `/v1/completions` or the model id
/// of `GET /v1/models/{id}`; the rest is the body (or the id).
pub fn openai_request(data: &[u8]) -> bool {
    let Some((&pick, rest)) = data.split_first() else {
        return false;
    };
    match pick % 3 {
        0 => send("POST", "/v1/chat/completions", rest, false),
        1 => send("POST", "/v1/completions", rest, false),
        _ => send(
            "GET",
            &format!("/v1/models/{}", percent_encode(rest)),
            b"",
            false,
        ),
    }
}

/// `anthropic_request`: byte 0 picks `/v1/messages` or `/v1/messages/count_tokens`; the rest is
/// the body.
pub fn anthropic_request(data: &[u8]) -> bool {
    let Some((&pick, rest)) = data.split_first() else {
        return false;
    };
    match pick % 2 {
        0 => send("POST", "/v1/messages", rest, true),
        _ => send("POST", "/v1/messages/count_tokens", rest, true),
    }
}
