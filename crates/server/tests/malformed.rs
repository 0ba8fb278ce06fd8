//! Malformed and refused requests, one table per API (OpenAI chat, OpenAI completions,
//! Anthropic messages, Anthropic count_tokens): each class of bad request gets its documented
//! status code and error body (OpenAI `{"error": {"message", "type", "param", "code"}}`,
//! Anthropic `{"type": "error", "error": {"type", "message"}}`; see the crate README's error
//! table), and after every one of them a good request still succeeds. The real engine runs
//! the tiny `tests/fixtures/tiny/qwen2-a` model with one slot and a queue of one, so a queue-full
//! answer can be provoked on demand.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{cfg, load_tiny, parse_response, send_request, tiny, wait_until, Resp, TestServer};
use kapitsa_engine::{EngineConfig, EngineHandle};
use kapitsa_models::KvType;
use kapitsa_server::ServerConfig;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "sekret";
const N_CTX: usize = 4096;
const MAX_BODY: usize = 128 << 10;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const MESSAGES: &str = "/v1/messages";
const COUNT: &str = "/v1/messages/count_tokens";
const RESPONSES: &str = "/v1/responses";

/// One slot, one queue place, a context of 4096 and a body limit of 128 KiB, with an API key.
async fn server() -> TestServer {
    let (loaded, mut served) = load_tiny(&tiny(), None);
    // Unknown model names are 404s here (see `model_names` for the default).
    served.strict_name = true;
    let ecfg = EngineConfig {
        max_running: 1,
        max_batch_tokens: 64,
        n_ctx: N_CTX,
        max_queue: 1,
        kv_type: KvType::F32,
        ..EngineConfig::default()
    };
    let engine =
        EngineHandle::start(loaded.model.clone(), served.tokenizer.clone(), ecfg).expect("engine");
    let scfg = ServerConfig {
        api_key: Some(KEY.into()),
        max_body_bytes: MAX_BODY,
        ..cfg()
    };
    TestServer::start(Arc::new(engine), served, scfg).await
}

/// The error format of an API.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Format {
    OpenAi,
    Anthropic,
}

/// What to do around the request.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Setup {
    /// Nothing.
    None,
    /// The slot busy and the queue full.
    QueueFull,
    /// The slot busy, one queue place left.
    OnePlaceLeft,
    /// Send the body with `Transfer-Encoding: chunked` (no length announced).
    Chunked,
}

/// One bad request and the answer it must get.
struct Case {
    name: String,
    method: &'static str,
    path: &'static str,
    /// Headers besides the API key.
    headers: Vec<(&'static str, &'static str)>,
    /// The key header to send (`None`: none at all).
    auth: Option<(&'static str, &'static str)>,
    body: Vec<u8>,
    setup: Setup,
    status: u16,
    /// OpenAI `error.type` / Anthropic `error.type`.
    ty: &'static str,
    /// OpenAI `error.param`, when checked (`Some(None)`: must be null).
    param: Option<Option<&'static str>>,
    /// OpenAI `error.code`, when checked.
    code: Option<Option<&'static str>>,
    /// The `Allow` header a 405 must carry.
    allow: Option<&'static str>,
}

impl Case {
    fn new(name: impl Into<String>, path: &'static str, body: impl Into<Vec<u8>>) -> Case {
        let auth = if path.starts_with(MESSAGES) {
            ("x-api-key", KEY)
        } else {
            ("Authorization", "Bearer sekret")
        };
        Case {
            name: name.into(),
            method: "POST",
            path,
            headers: Vec::new(),
            auth: Some(auth),
            body: body.into(),
            setup: Setup::None,
            status: 400,
            ty: "invalid_request_error",
            param: None,
            code: None,
            allow: None,
        }
    }

    fn json(name: impl Into<String>, path: &'static str, body: Value) -> Case {
        Case::new(name, path, body.to_string())
    }

    fn status(mut self, status: u16, ty: &'static str) -> Case {
        self.status = status;
        self.ty = ty;
        self
    }

    fn param(mut self, p: &'static str) -> Case {
        self.param = Some(Some(p));
        self
    }

    fn code(mut self, c: &'static str) -> Case {
        self.code = Some(Some(c));
        self
    }

    fn method(mut self, m: &'static str) -> Case {
        self.method = m;
        self
    }

    fn header(mut self, k: &'static str, v: &'static str) -> Case {
        self.headers.push((k, v));
        self
    }

    fn auth(mut self, a: Option<(&'static str, &'static str)>) -> Case {
        self.auth = a;
        self
    }

    fn setup(mut self, s: Setup) -> Case {
        self.setup = s;
        self
    }

    fn allow(mut self, a: &'static str) -> Case {
        self.allow = Some(a);
        self
    }
}

fn chat_ok() -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0})
}

fn completion_ok() -> Value {
    json!({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0})
}

fn messages_ok() -> Value {
    json!({"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]})
}

fn responses_ok() -> Value {
    json!({"model": "tiny", "input": "hi", "max_output_tokens": 2, "temperature": 0})
}

fn count_ok() -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
}

/// `base` with `key` set to `v` (a JSON pointer-free, top-level edit).
fn with(base: &Value, key: &str, v: Value) -> Value {
    let mut b = base.clone();
    b[key] = v;
    b
}

/// `base` without `key`.
fn without(base: &Value, key: &str) -> Value {
    let mut b = base.clone();
    b.as_object_mut().unwrap().remove(key);
    b
}

/// A prompt far over the context (the tiny tokenizer has ~400 tokens: about one per letter).
fn long_text() -> String {
    "hello world ".repeat(N_CTX / 2)
}

/// A body over the limit.
fn huge_body(path: &'static str) -> Vec<u8> {
    let big = "x".repeat(MAX_BODY + 4096);
    let v = if path == COMPLETIONS {
        json!({"model": "tiny", "prompt": big})
    } else {
        json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": big}]})
    };
    v.to_string().into_bytes()
}

/// The classes every API shares: body, content type, size, key, route and method.
fn common_cases(path: &'static str, good: &Value, fmt: Format) -> Vec<Case> {
    let too_large = if fmt == Format::OpenAi {
        "invalid_request_error"
    } else {
        "request_too_large"
    };
    let auth_ty = if fmt == Format::OpenAi {
        "invalid_request_error"
    } else {
        "authentication_error"
    };
    let not_found = if fmt == Format::OpenAi {
        "invalid_request_error"
    } else {
        "not_found_error"
    };
    let typo: &'static str = match path {
        CHAT => "/v1/chat/completion",
        COMPLETIONS => "/v1/completion",
        MESSAGES => "/v1/messages/create",
        RESPONSES => "/v1/response",
        _ => "/v1/messages/count",
    };
    let good_s = good.to_string();
    let mut v = vec![
        Case::new("malformed JSON: cut short", path, "{\"model\": ").code("invalid_json"),
        Case::new(
            "malformed JSON: trailing garbage",
            path,
            format!("{good_s} x"),
        )
        .code("invalid_json"),
        Case::new("malformed JSON: single quotes", path, "{'model': 'tiny'}").code("invalid_json"),
        Case::new("malformed JSON: empty body", path, "").code("invalid_json"),
        Case::new(
            "malformed JSON: not UTF-8",
            path,
            b"{\"model\": \"\xff\xfe\"}".to_vec(),
        )
        .code("invalid_json"),
        Case::new(
            "malformed JSON: nested 100000 deep",
            path,
            "[".repeat(100_000),
        )
        .code("invalid_json"),
        Case::new("body is an array", path, "[1, 2]"),
        Case::new("body is a string", path, "\"hi\""),
        Case::new("body is null", path, "null"),
        Case::new("content type text/plain", path, good_s.clone())
            .header("Content-Type", "text/plain")
            .status(415, "invalid_request_error")
            .code("unsupported_media_type"),
        Case::new("content type form-urlencoded", path, good_s.clone())
            .header("Content-Type", "application/x-www-form-urlencoded")
            .status(415, "invalid_request_error")
            .code("unsupported_media_type"),
        Case::new("content type multipart", path, good_s.clone())
            .header("Content-Type", "multipart/form-data; boundary=x")
            .status(415, "invalid_request_error")
            .code("unsupported_media_type"),
        Case::json("wrong type: model", path, with(good, "model", json!(5))).param("model"),
        Case::json("missing: model", path, without(good, "model")).param("model"),
        Case::json("unknown model", path, with(good, "model", json!("gpt-4")))
            .status(404, not_found)
            .param("model")
            .code("model_not_found"),
        Case::new("body over the limit", path, huge_body(path))
            .status(413, too_large)
            .code("request_too_large"),
        Case::new("chunked body over the limit", path, huge_body(path))
            .setup(Setup::Chunked)
            .status(413, too_large)
            .code("request_too_large"),
        Case::new("no API key", path, good_s.clone())
            .auth(None)
            .status(401, auth_ty)
            .code("invalid_api_key"),
        Case::new("wrong API key (Bearer)", path, good_s.clone())
            .auth(Some(("Authorization", "Bearer wrong")))
            .status(401, auth_ty)
            .code("invalid_api_key"),
        Case::new("wrong API key (x-api-key)", path, good_s.clone())
            .auth(Some(("x-api-key", "sekre")))
            .status(401, auth_ty)
            .code("invalid_api_key"),
        Case::new("API key with the Basic scheme", path, good_s.clone())
            .auth(Some(("Authorization", "Basic sekret")))
            .status(401, auth_ty)
            .code("invalid_api_key"),
        Case::new("unknown route", typo, good_s.clone())
            .status(404, not_found)
            .code("not_found"),
    ];
    for m in ["GET", "PUT", "DELETE", "PATCH"] {
        let body = if m == "GET" {
            String::new()
        } else {
            good_s.clone()
        };
        v.push(
            Case::new(format!("wrong method {m}"), path, body)
                .method(m)
                .status(405, "invalid_request_error")
                .code("method_not_allowed")
                .allow("POST"),
        );
    }
    v
}

/// `(key, value)` sampling fields that must be refused, naming `key`.
fn bad_values(base: &Value, path: &'static str, cases: &[(&'static str, Value)]) -> Vec<Case> {
    cases
        .iter()
        .map(|(k, v)| {
            Case::json(
                format!("invalid value: {k} = {v}"),
                path,
                with(base, k, v.clone()),
            )
            .param(k)
        })
        .collect()
}

fn chat_cases() -> Vec<Case> {
    let ok = chat_ok();
    let mut v = common_cases(CHAT, &ok, Format::OpenAi);
    let msg = |m: Value| with(&ok, "messages", m);
    v.extend([
        Case::json("wrong type: messages", CHAT, msg(json!("hi"))).param("messages"),
        Case::json("wrong type: message", CHAT, msg(json!(["hi"]))).param("messages[0]"),
        Case::json(
            "wrong type: content",
            CHAT,
            msg(json!([{"role": "user", "content": 5}])),
        )
        .param("messages[0].content"),
        Case::json(
            "wrong type: content part",
            CHAT,
            msg(json!([{"role": "user", "content": [{"type": "text", "text": 5}]}])),
        )
        .param("messages[0].content[0]"),
        Case::json(
            "wrong type: role",
            CHAT,
            msg(json!([{"role": 5, "content": "hi"}])),
        )
        .param("messages[0].role"),
        Case::json(
            "unknown role",
            CHAT,
            msg(json!([{"role": "robot", "content": "hi"}])),
        )
        .param("messages[0].role"),
        Case::json(
            "wrong type: temperature",
            CHAT,
            with(&ok, "temperature", json!("hot")),
        )
        .param("temperature"),
        Case::json(
            "wrong type: max_tokens",
            CHAT,
            with(&ok, "max_tokens", json!("5")),
        )
        .param("max_tokens"),
        Case::json("wrong type: n", CHAT, with(&ok, "n", json!(1.5))).param("n"),
        Case::json(
            "wrong type: stream",
            CHAT,
            with(&ok, "stream", json!("yes")),
        )
        .param("stream"),
        Case::json(
            "wrong type: stream_options",
            CHAT,
            with(&ok, "stream_options", json!(true)),
        )
        .param("stream_options"),
        Case::json("wrong type: stop", CHAT, with(&ok, "stop", json!(5))).param("stop"),
        Case::json(
            "wrong type: stop item",
            CHAT,
            with(&ok, "stop", json!(["a", 1])),
        )
        .param("stop[1]"),
        Case::json("wrong type: seed", CHAT, with(&ok, "seed", json!("x"))).param("seed"),
        Case::json(
            "wrong type: logprobs",
            CHAT,
            with(&ok, "logprobs", json!("yes")),
        )
        .param("logprobs"),
        Case::json("wrong type: tools", CHAT, with(&ok, "tools", json!("x"))).param("tools"),
        Case::json("missing: messages", CHAT, without(&ok, "messages")).param("messages"),
        Case::json("missing: role", CHAT, msg(json!([{"content": "hi"}])))
            .param("messages[0].role"),
        Case::json(
            "missing: user content",
            CHAT,
            msg(json!([{"role": "user"}])),
        )
        .param("messages[0].content"),
        Case::json("empty messages", CHAT, msg(json!([]))).param("messages"),
        Case::json(
            "prompt longer than the context",
            CHAT,
            msg(json!([{"role": "user", "content": long_text()}])),
        )
        .param("messages")
        .code("context_length_exceeded"),
        Case::json(
            "too many stop strings",
            CHAT,
            with(&ok, "stop", json!(vec!["x"; 17])),
        )
        .param("stop"),
        Case::json(
            "top_logprobs without logprobs",
            CHAT,
            with(&ok, "top_logprobs", json!(2)),
        )
        .param("top_logprobs"),
        Case::json("queue full", CHAT, ok.clone())
            .setup(Setup::QueueFull)
            .status(429, "rate_limit_error")
            .code("rate_limit_exceeded"),
        // The queue holds one request: two choices can never fit (not "try again later").
        Case::json(
            "n = 2 with one queue place left",
            CHAT,
            with(&ok, "n", json!(2)),
        )
        .setup(Setup::OnePlaceLeft)
        .code("too_many_generations"),
        Case::json(
            "response_format admitting no value",
            CHAT,
            with(
                &ok,
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
            ),
        )
        .param("response_format"),
        Case::json(
            "queue full, streaming",
            CHAT,
            with(&ok, "stream", json!(true)),
        )
        .setup(Setup::QueueFull)
        .status(429, "rate_limit_error")
        .code("rate_limit_exceeded"),
    ]);
    v.extend(bad_values(
        &ok,
        CHAT,
        &[
            ("temperature", json!(-0.5)),
            ("temperature", json!(2.5)),
            ("top_p", json!(1.5)),
            ("top_p", json!(-0.1)),
            ("top_k", json!(-2)),
            ("min_p", json!(1.5)),
            ("n", json!(0)),
            ("n", json!(17)),
            ("max_tokens", json!(-5)),
            ("max_tokens", json!(0)),
            ("max_completion_tokens", json!(-1)),
            ("presence_penalty", json!(2.5)),
            ("frequency_penalty", json!(-2.5)),
            ("repetition_penalty", json!(0)),
            ("logit_bias", json!({"99999999": 5})),
            ("logit_bias", json!({"1": 150})),
            ("logit_bias", json!({"one": 5})),
        ],
    ));
    for k in [json!(21), json!(-1)] {
        let mut b = with(&ok, "logprobs", json!(true));
        b["top_logprobs"] = k.clone();
        v.push(
            Case::json(format!("invalid value: top_logprobs = {k}"), CHAT, b).param("top_logprobs"),
        );
    }
    v
}

fn completion_cases() -> Vec<Case> {
    let ok = completion_ok();
    let mut v = common_cases(COMPLETIONS, &ok, Format::OpenAi);
    let p = |x: Value| with(&ok, "prompt", x);
    v.extend([
        Case::json("wrong type: prompt", COMPLETIONS, p(json!(5))).param("prompt"),
        Case::json("wrong type: prompt ids", COMPLETIONS, p(json!([1.5, 2]))).param("prompt"),
        Case::json("negative token id", COMPLETIONS, p(json!([[-1]]))).param("prompt[0]"),
        Case::json("wrong type: prompt item", COMPLETIONS, p(json!(["a", {}]))).param("prompt[1]"),
        Case::json(
            "token id outside the vocabulary",
            COMPLETIONS,
            p(json!([1, 99999])),
        )
        .param("prompt"),
        Case::json(
            "wrong type: echo",
            COMPLETIONS,
            with(&ok, "echo", json!("yes")),
        )
        .param("echo"),
        Case::json(
            "wrong type: logprobs",
            COMPLETIONS,
            with(&ok, "logprobs", json!(true)),
        )
        .param("logprobs"),
        Case::json(
            "wrong type: max_tokens",
            COMPLETIONS,
            with(&ok, "max_tokens", json!([1])),
        )
        .param("max_tokens"),
        Case::json(
            "wrong type: suffix",
            COMPLETIONS,
            with(&ok, "suffix", json!(5)),
        )
        .param("suffix"),
        Case::json("missing: prompt", COMPLETIONS, without(&ok, "prompt")).param("prompt"),
        Case::json("empty prompt", COMPLETIONS, p(json!(""))).param("prompt"),
        Case::json("empty prompt list", COMPLETIONS, p(json!([]))).param("prompt"),
        Case::json(
            "prompt longer than the context",
            COMPLETIONS,
            p(json!(long_text())),
        )
        .param("prompt")
        .code("context_length_exceeded"),
        Case::json(
            "token prompt longer than the context",
            COMPLETIONS,
            p(json!(vec![5; N_CTX + 1])),
        )
        .param("prompt")
        .code("context_length_exceeded"),
        Case::json(
            "suffix on a model without FIM tokens",
            COMPLETIONS,
            with(&ok, "suffix", json!("x")),
        )
        .param("suffix"),
        Case::json(
            "best_of other than n",
            COMPLETIONS,
            with(&ok, "best_of", json!(3)),
        )
        .param("best_of"),
        Case::json("queue full", COMPLETIONS, ok.clone())
            .setup(Setup::QueueFull)
            .status(429, "rate_limit_error")
            .code("rate_limit_exceeded"),
        // The queue holds one request: more prompts can never fit, and nothing of them may
        // stay queued to refuse the good request that follows.
        Case::json(
            "two prompts with one queue place left",
            COMPLETIONS,
            p(json!(["a", "b"])),
        )
        .setup(Setup::OnePlaceLeft)
        .code("too_many_generations"),
        Case::json(
            "10,000 prompts",
            COMPLETIONS,
            p(json!(vec!["a"; 10_000])),
        )
        .code("too_many_generations"),
        Case::json(
            "response_format admitting no value",
            COMPLETIONS,
            with(
                &ok,
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
            ),
        )
        .param("response_format"),
        Case::json(
            "wrong type: response_format",
            COMPLETIONS,
            with(&ok, "response_format", json!("json")),
        )
        .param("response_format"),
    ]);
    v.extend(bad_values(
        &ok,
        COMPLETIONS,
        &[
            ("temperature", json!(-1)),
            ("top_p", json!(2)),
            ("n", json!(0)),
            ("max_tokens", json!(-1)),
            ("max_tokens", json!(0)),
            ("logprobs", json!(21)),
            ("logprobs", json!(-1)),
            ("best_of", json!(0)),
            ("presence_penalty", json!(-3)),
        ],
    ));
    v
}

fn messages_cases() -> Vec<Case> {
    let ok = messages_ok();
    let mut v = common_cases(MESSAGES, &ok, Format::Anthropic);
    v.extend(messages_body_cases(MESSAGES, &ok));
    v.extend([
        Case::json(
            "wrong type: max_tokens",
            MESSAGES,
            with(&ok, "max_tokens", json!("5")),
        ),
        Case::json(
            "wrong type: temperature",
            MESSAGES,
            with(&ok, "temperature", json!("hot")),
        ),
        Case::json(
            "wrong type: stream",
            MESSAGES,
            with(&ok, "stream", json!(1)),
        ),
        Case::json(
            "wrong type: stop_sequences",
            MESSAGES,
            with(&ok, "stop_sequences", json!([1])),
        ),
        Case::json("missing: max_tokens", MESSAGES, without(&ok, "max_tokens")),
        Case::json(
            "prompt longer than the context",
            MESSAGES,
            with(
                &ok,
                "messages",
                json!([{"role": "user", "content": long_text()}]),
            ),
        ),
        Case::json("queue full", MESSAGES, ok.clone())
            .setup(Setup::QueueFull)
            .status(429, "rate_limit_error"),
        Case::json(
            "queue full, streaming",
            MESSAGES,
            with(&ok, "stream", json!(true)),
        )
        .setup(Setup::QueueFull)
        .status(429, "rate_limit_error"),
    ]);
    for (k, val) in [
        ("temperature", json!(-0.1)),
        ("temperature", json!(1.5)),
        ("top_p", json!(1.5)),
        ("top_k", json!(-1)),
        ("max_tokens", json!(0)),
        ("max_tokens", json!(-5)),
    ] {
        v.push(Case::json(
            format!("invalid value: {k} = {val}"),
            MESSAGES,
            with(&ok, k, val),
        ));
    }
    v
}

/// Conversation errors both Anthropic endpoints share.
fn messages_body_cases(path: &'static str, ok: &Value) -> Vec<Case> {
    let msg = |m: Value| with(ok, "messages", m);
    vec![
        Case::json("wrong type: messages", path, msg(json!("hi"))),
        Case::json("wrong type: message", path, msg(json!(["hi"]))),
        Case::json(
            "wrong type: content",
            path,
            msg(json!([{"role": "user", "content": 5}])),
        ),
        Case::json(
            "wrong type: content block",
            path,
            msg(json!([{"role": "user", "content": ["hi"]}])),
        ),
        Case::json("wrong type: system", path, with(ok, "system", json!(5))),
        Case::json("wrong type: tools", path, with(ok, "tools", json!("x"))),
        Case::json(
            "wrong type: tool_choice",
            path,
            with(ok, "tool_choice", json!("auto")),
        ),
        Case::json(
            "wrong type: thinking",
            path,
            with(ok, "thinking", json!(true)),
        ),
        Case::json(
            "unknown role in messages",
            path,
            msg(json!([{"role": "robot", "content": "hi"}])),
        ),
        Case::json(
            "system message with an image",
            path,
            msg(
                json!([{"role": "system", "content": [{"type": "image", "source": {}}]}, {"role": "user", "content": "hi"}]),
            ),
        ),
        Case::json(
            "document with a PDF source",
            path,
            msg(
                json!([{"role": "user", "content": [{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="}}]}]),
            ),
        ),
        Case::json(
            "unknown thinking type",
            path,
            with(ok, "thinking", json!({"type": "sometimes"})),
        ),
        Case::json("missing: messages", path, without(ok, "messages")),
        Case::json("missing: role", path, msg(json!([{"content": "hi"}]))),
        Case::json("missing: content", path, msg(json!([{"role": "user"}]))),
        Case::json(
            "missing: block type",
            path,
            msg(json!([{"role": "user", "content": [{"text": "hi"}]}])),
        ),
        Case::json("empty messages", path, msg(json!([]))),
        Case::json(
            "image block (text-only model)",
            path,
            msg(json!([{"role": "user", "content": [{"type": "image", "source": {}}]}])),
        ),
        Case::json(
            "tool without input_schema",
            path,
            with(ok, "tools", json!([{"name": "f"}])),
        ),
    ]
}

fn count_cases() -> Vec<Case> {
    let ok = count_ok();
    let mut v = common_cases(COUNT, &ok, Format::Anthropic);
    v.extend(messages_body_cases(COUNT, &ok));
    v
}

/// Open a long streaming completion (never read); it holds the slot or a queue place until
/// the socket is dropped.
async fn hog(addr: SocketAddr) -> TcpStream {
    let body = json!({"model": "tiny", "prompt": "Once upon a time", "max_tokens": N_CTX - 16,
        "ignore_eos": true, "temperature": 0, "stream": true});
    send_request(
        addr,
        "POST",
        COMPLETIONS,
        &[("Authorization", "Bearer sekret")],
        body.to_string().as_bytes(),
    )
    .await
}

async fn gauges(s: &TestServer) -> (f64, f64) {
    (
        s.metric("kapitsa_requests_running").await,
        s.metric("kapitsa_queue_length").await,
    )
}

async fn wait_gauges(s: &TestServer, want: (f64, f64), what: &str) {
    let ok = wait_until(Duration::from_secs(30), || async move {
        gauges(s).await == want
    })
    .await;
    assert!(
        ok,
        "{what}: (running, queued) = {:?}, want {want:?}\n{}",
        gauges(s).await,
        s.get("/metrics").await.text()
    );
}

/// Fill the slot (and the queue, if `full`); returns the sockets holding them.
async fn fill(s: &TestServer, full: bool) -> Vec<TcpStream> {
    let a = hog(s.addr).await;
    wait_gauges(s, (1.0, 0.0), "the first long request should run").await;
    let mut held = vec![a];
    if full {
        held.push(hog(s.addr).await);
        wait_gauges(s, (1.0, 1.0), "the second long request should wait").await;
    }
    held
}

/// Send `body` with `Transfer-Encoding: chunked`, in 8 KiB chunks.
async fn chunked(addr: SocketAddr, c: &Case) -> Resp {
    let mut sock = TcpStream::connect(addr).await.expect("connect");
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n",
        c.method, c.path
    );
    if let Some((k, v)) = c.auth {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    sock.write_all(head.as_bytes()).await.expect("write head");
    for part in c.body.chunks(8192) {
        let mut chunk = format!("{:x}\r\n", part.len()).into_bytes();
        chunk.extend_from_slice(part);
        chunk.extend_from_slice(b"\r\n");
        // The server may answer 413 and close before taking the rest.
        if sock.write_all(&chunk).await.is_err() {
            break;
        }
    }
    let _ = sock.write_all(b"0\r\n\r\n").await;
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    let read = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "{}: chunked request timed out", c.name);
    parse_response(&raw)
}

/// Send `c` (with its setup) and return the answer.
async fn send(s: &TestServer, c: &Case) -> Resp {
    let mut headers: Vec<(&str, &str)> = c.headers.clone();
    if let Some(a) = c.auth {
        headers.push(a);
    }
    match c.setup {
        Setup::None => s.req(c.method, c.path, &headers, &c.body).await,
        Setup::Chunked => chunked(s.addr, c).await,
        Setup::QueueFull | Setup::OnePlaceLeft => {
            let full = c.setup == Setup::QueueFull;
            let held = fill(s, full).await;
            let r = s.req(c.method, c.path, &headers, &c.body).await;
            // A refused request leaves nothing queued (choices already queued are withdrawn).
            let want = (1.0, if full { 1.0 } else { 0.0 });
            wait_gauges(
                s,
                want,
                &format!("{}: the refusal left work behind", c.name),
            )
            .await;
            drop(held);
            wait_gauges(s, (0.0, 0.0), &format!("{}: after the release", c.name)).await;
            r
        }
    }
}

/// Check the status and error body of `r` against `c`.
fn check(c: &Case, fmt: Format, r: &Resp) {
    let name = &c.name;
    assert_eq!(r.status, c.status, "{name}: {}", r.text());
    let ct = r.header("content-type").unwrap_or("");
    assert!(
        ct.starts_with("application/json"),
        "{name}: content-type {ct:?}"
    );
    let v: Value = serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{name}: error body is not JSON ({e}): {}", r.text()));
    match fmt {
        Format::OpenAi => {
            let keys: Vec<&String> = v.as_object().expect("object").keys().collect();
            assert_eq!(keys, ["error"], "{name}: {v}");
            let e = v["error"].as_object().expect("error object");
            let mut ek: Vec<&str> = e.keys().map(String::as_str).collect();
            ek.sort_unstable();
            assert_eq!(ek, ["code", "message", "param", "type"], "{name}: {v}");
            assert_eq!(e["type"], c.ty, "{name}: {v}");
            assert!(
                e["message"].as_str().is_some_and(|m| !m.is_empty()),
                "{name}: {v}"
            );
            assert!(
                e["param"].is_null() || e["param"].is_string(),
                "{name}: {v}"
            );
            assert!(e["code"].is_null() || e["code"].is_string(), "{name}: {v}");
            if let Some(p) = c.param {
                assert_eq!(e["param"], json!(p), "{name}: param in {v}");
            }
            if let Some(code) = c.code {
                assert_eq!(e["code"], json!(code), "{name}: code in {v}");
            }
            if c.status == 401 {
                assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{name}");
            }
        }
        Format::Anthropic => {
            let mut keys: Vec<&str> = v
                .as_object()
                .expect("object")
                .keys()
                .map(String::as_str)
                .collect();
            keys.sort_unstable();
            assert_eq!(keys, ["error", "type"], "{name}: {v}");
            assert_eq!(v["type"], "error", "{name}: {v}");
            let e = v["error"].as_object().expect("error object");
            let mut ek: Vec<&str> = e.keys().map(String::as_str).collect();
            ek.sort_unstable();
            assert_eq!(ek, ["message", "type"], "{name}: {v}");
            assert_eq!(e["type"], c.ty, "{name}: {v}");
            assert!(
                e["message"].as_str().is_some_and(|m| !m.is_empty()),
                "{name}: {v}"
            );
        }
    }
    if let Some(allow) = c.allow {
        assert_eq!(r.header("allow"), Some(allow), "{name}: Allow header");
    }
}

/// Send a good request to `path`; it must succeed.
async fn good(s: &TestServer, path: &'static str, body: &Value, after: &str) {
    let auth = if path.starts_with(MESSAGES) {
        ("x-api-key", KEY)
    } else {
        ("Authorization", "Bearer sekret")
    };
    let r = s
        .req("POST", path, &[auth], body.to_string().as_bytes())
        .await;
    assert_eq!(
        r.status,
        200,
        "a good request after '{after}' failed: {}",
        r.text()
    );
    let v = r.json();
    let fine = match path {
        CHAT => v["choices"][0]["finish_reason"].is_string(),
        COMPLETIONS => v["choices"][0]["text"].is_string(),
        MESSAGES => v["stop_reason"].is_string(),
        RESPONSES => v["status"].is_string() && v["output"].is_array(),
        _ => v["input_tokens"].as_u64().is_some_and(|n| n > 0),
    };
    assert!(fine, "a good request after '{after}': {v}");
}

/// Run every case of a table, each followed by a good request; then the server must be idle.
async fn run_table(path: &'static str, fmt: Format, ok: Value, cases: Vec<Case>) {
    let s = server().await;
    good(&s, path, &ok, "nothing").await;
    let mut names = std::collections::HashSet::new();
    for c in &cases {
        assert!(names.insert(c.name.clone()), "duplicate case {}", c.name);
        let r = send(&s, c).await;
        check(c, fmt, &r);
        good(&s, path, &ok, &c.name).await;
    }
    wait_gauges(&s, (0.0, 0.0), "at the end").await;
    let s2 = &s;
    assert!(
        wait_until(Duration::from_secs(10), || async move {
            s2.metric("kapitsa_slots_used").await == 0.0
                && s2.metric("kapitsa_streams_active").await == 0.0
        })
        .await,
        "{}",
        s.get("/metrics").await.text()
    );
    // Every refusal was counted with its status.
    let text = s.get("/metrics").await.text();
    for c in &cases {
        let ep = kapitsa_server::metrics::endpoint_label(c.path);
        let needle = format!("endpoint=\"{ep}\",status=\"{}\"", c.status);
        assert!(text.contains(&needle), "{}: no {needle} in\n{text}", c.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_chat() {
    run_table(CHAT, Format::OpenAi, chat_ok(), chat_cases()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_completions() {
    run_table(
        COMPLETIONS,
        Format::OpenAi,
        completion_ok(),
        completion_cases(),
    )
    .await;
}

fn responses_cases() -> Vec<Case> {
    let ok = responses_ok();
    let mut v = common_cases(RESPONSES, &ok, Format::OpenAi);
    let input = |x: Value| with(&ok, "input", x);
    v.extend([
        Case::json("missing: input", RESPONSES, without(&ok, "input")).param("input"),
        Case::json("wrong type: input", RESPONSES, input(json!(5))).param("input"),
        Case::json("empty input", RESPONSES, input(json!([]))).param("input"),
        Case::json(
            "unknown item type",
            RESPONSES,
            input(json!([{"type": "hologram"}])),
        )
        .param("input[0].type"),
        Case::json(
            "item_reference (needs a store)",
            RESPONSES,
            input(json!([{"type": "item_reference", "id": "msg_1"}])),
        )
        .param("input[0].type"),
        Case::json(
            "function_call without call_id",
            RESPONSES,
            input(json!([{"type": "function_call", "name": "f", "arguments": "{}"}])),
        )
        .param("input[0].call_id"),
        Case::json(
            "image part (text-only model)",
            RESPONSES,
            input(
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            ),
        )
        .param("input[0].content[0]"),
        Case::json(
            "tool without a name",
            RESPONSES,
            with(
                &ok,
                "tools",
                json!([{"type": "function", "parameters": {}}]),
            ),
        )
        .param("tools[0].name"),
        Case::json(
            "tool schema not an object",
            RESPONSES,
            with(
                &ok,
                "tools",
                json!([{"type": "function", "name": "f", "parameters": [1]}]),
            ),
        )
        .param("tools[0].parameters"),
        Case::json(
            "unknown tool type",
            RESPONSES,
            with(&ok, "tools", json!([{"type": "teleport"}])),
        )
        .param("tools[0].type"),
        Case::json(
            "previous_response_id (stateless)",
            RESPONSES,
            with(&ok, "previous_response_id", json!("resp_1")),
        )
        .param("previous_response_id"),
        Case::json(
            "unknown text.format",
            RESPONSES,
            with(&ok, "text", json!({"format": {"type": "yaml"}})),
        )
        .param("text.format"),
        Case::json(
            "unknown reasoning.effort",
            RESPONSES,
            with(&ok, "reasoning", json!({"effort": "max"})),
        )
        .param("reasoning.effort"),
    ]);
    v.extend(bad_values(
        &ok,
        RESPONSES,
        &[
            ("temperature", json!(2.5)),
            ("top_p", json!(-1)),
            ("max_output_tokens", json!(0)),
            ("stream", json!("yes")),
            ("tool_choice", json!("sometimes")),
        ],
    ));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_responses() {
    run_table(RESPONSES, Format::OpenAi, responses_ok(), responses_cases()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages() {
    run_table(MESSAGES, Format::Anthropic, messages_ok(), messages_cases()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_count_tokens() {
    run_table(COUNT, Format::Anthropic, count_ok(), count_cases()).await;
    // Not errors, documented: counting is not limited by the context, and does not queue.
    let s = server().await;
    let long = json!({"model": "tiny", "messages": [{"role": "user", "content": long_text()}]});
    let r = s
        .req(
            "POST",
            COUNT,
            &[("x-api-key", KEY)],
            long.to_string().as_bytes(),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["input_tokens"].as_u64().unwrap() as usize > N_CTX);
    let held = fill(&s, true).await;
    good(&s, COUNT, &count_ok(), "a full queue").await;
    drop(held);
    wait_gauges(&s, (0.0, 0.0), "after the release").await;
}

/// Content types that are JSON, or no content type at all, are accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_content_types_are_accepted() {
    let s = server().await;
    let body = chat_ok().to_string();
    for ct in [
        None,
        Some("application/json"),
        Some("application/json; charset=utf-8"),
        Some("Application/JSON"),
        Some("application/vnd.api+json"),
    ] {
        // `send_request` adds `Content-Type: application/json` unless one is given, so the
        // missing-header case is written by hand.
        let r = match ct {
            Some(ct) => {
                s.req(
                    "POST",
                    CHAT,
                    &[("Authorization", "Bearer sekret"), ("Content-Type", ct)],
                    body.as_bytes(),
                )
                .await
            }
            None => {
                let mut sock = TcpStream::connect(s.addr).await.unwrap();
                let head = format!(
                    "POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer sekret\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                );
                sock.write_all(head.as_bytes()).await.unwrap();
                sock.write_all(body.as_bytes()).await.unwrap();
                let mut raw = Vec::new();
                sock.read_to_end(&mut raw).await.unwrap();
                parse_response(&raw)
            }
        };
        assert_eq!(r.status, 200, "content type {ct:?}: {}", r.text());
    }
}
