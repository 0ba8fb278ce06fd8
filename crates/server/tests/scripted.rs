//! The HTTP layer over a scripted engine that replies with fixed text: reasoning and tool-call
//! parsing, both APIs' streaming shapes, cancellation on disconnect, shutdown, and the error
//! paths that a real tiny model cannot trigger on demand.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{cfg, send_request, template, tiny, wait_until, TestServer};
use kapitsa_engine::loader::tokenizer_for;
use kapitsa_models::ModelSource;
use kapitsa_server::engine::{
    Engine, EngineMetrics, Event, EventStream, FinishReason, RecvFuture, Request, SubmitError,
    TokenLogprob, Usage,
};
use kapitsa_server::{ServedModel, ServerConfig};
use kapitsa_text::Tokenizer;
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;

#[derive(Default)]
struct Counts {
    running: usize,
    cancelled: usize,
    finished: usize,
    requests: Vec<Request>,
}

/// Replies with `reply` cut into 3-character tokens, one every `delay`.
struct Scripted {
    reply: String,
    delay: Duration,
    n_ctx: usize,
    max_queue: usize,
    fail: bool,
    /// Wait this long before the first token (a long prefill).
    prefill: Duration,
    counts: Arc<Mutex<Counts>>,
}

impl Scripted {
    fn new(reply: &str) -> Scripted {
        Scripted {
            reply: reply.to_string(),
            delay: Duration::ZERO,
            n_ctx: 4096,
            max_queue: 64,
            fail: false,
            prefill: Duration::ZERO,
            counts: Arc::default(),
        }
    }

    fn slow(mut self, delay: Duration) -> Scripted {
        self.delay = delay;
        self
    }
}

impl Scripted {
    fn submit_with(
        &self,
        req: Request,
        announce: Option<usize>,
    ) -> Result<Box<dyn EventStream>, SubmitError> {
        if req.prompt.len() >= self.n_ctx {
            return Err(SubmitError::PromptTooLong {
                n_prompt: req.prompt.len(),
                n_ctx: self.n_ctx,
            });
        }
        {
            let mut c = self.counts.lock().unwrap();
            if c.running >= self.max_queue {
                return Err(SubmitError::QueueFull);
            }
            c.running += 1;
            c.requests.push(req.clone());
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let (mut text, mut finish) = (self.reply.clone(), FinishReason::EndOfGeneration);
        if let Some(at) = req.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(at);
            finish = FinishReason::StopString;
        }
        let mut pieces: VecDeque<String> = text
            .chars()
            .collect::<Vec<_>>()
            .chunks(3)
            .map(|c| c.iter().collect())
            .collect();
        if pieces.len() > req.max_tokens {
            pieces.truncate(req.max_tokens);
            finish = FinishReason::Length;
        }
        let (delay, fail, n_prompt) = (self.delay, self.fail, req.prompt.len());
        let prefill = self.prefill;
        tokio::spawn(async move {
            if let Some(cached_tokens) = announce {
                let _ = tx.send(Event::Admitted { cached_tokens });
            }
            tokio::time::sleep(prefill).await;
            let mut n = 0;
            while let Some(p) = pieces.pop_front() {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let id = 10 + n as u32;
                let logprobs = match req.top_logprobs {
                    Some(k) => vec![TokenLogprob {
                        id,
                        logprob: -0.5,
                        top: (0..k as u32).map(|i| (id + i, -0.5 - i as f32)).collect(),
                    }],
                    None => Vec::new(),
                };
                let ev = Event::Text {
                    text: p,
                    tokens: vec![id],
                    logprobs,
                };
                if tx.send(ev).is_err() {
                    return;
                }
                n += 1;
            }
            let last = if fail {
                Event::Error("the model exploded".into())
            } else {
                Event::Done {
                    finish,
                    usage: Usage {
                        prompt_tokens: n_prompt,
                        completion_tokens: n,
                        cached_tokens: 0,
                    },
                    timing: Default::default(),
                }
            };
            let _ = tx.send(last);
        });
        Ok(Box::new(Stream {
            rx,
            counts: self.counts.clone(),
            ended: false,
        }))
    }
}

struct Stream {
    rx: mpsc::UnboundedReceiver<Event>,
    counts: Arc<Mutex<Counts>>,
    ended: bool,
}

impl EventStream for Stream {
    fn recv(&mut self) -> RecvFuture<'_> {
        Box::pin(async move {
            let ev = self.rx.recv().await;
            if !matches!(ev, Some(Event::Text { .. } | Event::Admitted { .. })) {
                self.ended = true;
            }
            ev
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap();
        c.running -= 1;
        if self.ended {
            c.finished += 1;
        } else {
            c.cancelled += 1;
        }
    }
}

impl Engine for Scripted {
    fn submit(&self, req: Request) -> Result<Box<dyn EventStream>, SubmitError> {
        self.submit_with(req, None)
    }

    /// Announced with 7 cached tokens.
    fn submit_announced(&self, req: Request) -> Result<Box<dyn EventStream>, SubmitError> {
        self.submit_with(req, Some(7))
    }

    fn metrics(&self) -> EngineMetrics {
        let c = self.counts.lock().unwrap();
        EngineMetrics {
            running: c.running,
            slots_total: 4,
            slots_used: c.running,
            requests_cancelled: c.cancelled as u64,
            requests_finished: c.finished as u64,
            ..Default::default()
        }
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    fn shutdown(&self) {}
}

fn tokenizer() -> Arc<Tokenizer> {
    let src = ModelSource::open(&tiny()).expect("fixture");
    Arc::new(tokenizer_for(&src).expect("tokenizer"))
}

/// A server over `engine` whose model uses the fixture template `tmpl`.
async fn server_with(
    engine: Scripted,
    tmpl: &str,
    cfg: ServerConfig,
) -> (TestServer, Arc<Mutex<Counts>>) {
    let counts = engine.counts.clone();
    let model = ServedModel::new("m".into(), tokenizer(), Some(&template(tmpl))).expect("model");
    (
        TestServer::start(Arc::new(engine), model, cfg).await,
        counts,
    )
}

async fn server(reply: &str, tmpl: &str) -> (TestServer, Arc<Mutex<Counts>>) {
    server_with(Scripted::new(reply), tmpl, cfg()).await
}

fn last_prompt(counts: &Mutex<Counts>) -> String {
    let c = counts.lock().unwrap();
    let req = c.requests.last().expect("a request");
    tokenizer().decode(&req.prompt, false).unwrap()
}

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}\n</tool_call>";

fn weather_tool() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_tool_call() {
    let (s, counts) = server(CALL, "qwen2.5.jinja").await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "Weather in Bern?"}], "tools": weather_tool()});
    let r = s.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["content"], Value::Null);
    let call = &c["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Bern"}));
    let prompt = last_prompt(&counts);
    assert!(
        prompt.contains("<tools>") && prompt.contains("get_weather"),
        "{prompt}"
    );

    // Round trip: the call and its result go back into the prompt.
    let body = json!({"model": "m", "tools": weather_tool(), "messages": [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
    ]});
    let r = s.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let prompt = last_prompt(&counts);
    assert!(
        prompt.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}\n</tool_call>"),
        "{prompt}"
    );
    assert!(
        prompt.contains("<tool_response>\nsunny, 21 C\n</tool_response>"),
        "{prompt}"
    );

    // tool_choice "none" hides the tools.
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": weather_tool(), "tool_choice": "none"});
    assert_eq!(s.post("/v1/chat/completions", &body).await.status, 200);
    assert!(!last_prompt(&counts).contains("get_weather"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_tool_call_streaming() {
    let reply = format!("Let me check.\n{CALL}");
    let (s, _) = server(&reply, "qwen2.5.jinja").await;
    let body = json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Weather in Bern?"}], "tools": weather_tool()});
    let r = s.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = r.sse();
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks = r.sse_json();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut finish = Value::Null;
    for c in &chunks {
        assert!(c["usage"].is_null() || c["choices"].as_array().unwrap().is_empty());
        let Some(ch) = c["choices"].get(0) else {
            continue;
        };
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(t) = ch["delta"]["content"].as_str() {
            content.push_str(t);
        }
        if let Some(tc) = ch["delta"]["tool_calls"].as_array() {
            calls.extend(tc.iter().cloned());
        }
        if !ch["finish_reason"].is_null() {
            finish = ch["finish_reason"].clone();
        }
    }
    assert_eq!(content, "Let me check.");
    assert!(!content.contains("<tool_call"));
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Bern\"}");
    assert_eq!(finish, "tool_calls");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        usage["completion_tokens"],
        reply.chars().count().div_ceil(3)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_reasoning() {
    let (s, _) = server(
        "<think>\nLet me think.\n</think>\n\nHello there.",
        "qwen3.jinja",
    )
    .await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let v = s.post("/v1/chat/completions", &body).await.json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "Let me think.");
    assert_eq!(m["content"], "Hello there.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let body =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let chunks = s.post("/v1/chat/completions", &body).await.sse_json();
    let (mut reasoning, mut content) = (String::new(), String::new());
    for c in &chunks {
        let d = &c["choices"][0]["delta"];
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(d["content"].as_str().unwrap_or(""));
    }
    assert_eq!(reasoning, "Let me think.");
    assert_eq!(content, "Hello there.");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_n_seeds_logprobs_and_lengths() {
    let (s, counts) = server("abcdefghijkl", "qwen2.5.jinja").await;
    let body = json!({"model": "m", "n": 3, "seed": 100, "max_tokens": 2, "logprobs": true, "top_logprobs": 2,
        "messages": [{"role": "user", "content": "hi"}]});
    let v = s.post("/v1/chat/completions", &body).await.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], "abcdef");
        assert_eq!(c["finish_reason"], "length");
        let lp = c["logprobs"]["content"].as_array().unwrap();
        assert_eq!(lp.len(), 2);
        assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 2);
        assert!(lp[0]["token"].is_string() && lp[0]["bytes"].is_array());
    }
    assert_eq!(v["usage"]["completion_tokens"], 6);
    let seeds: Vec<u64> = counts
        .lock()
        .unwrap()
        .requests
        .iter()
        .map(|r| r.sampling.seed)
        .collect();
    assert_eq!(seeds, vec![100, 101, 102]);
    let r = counts.lock().unwrap().requests[0].clone();
    assert_eq!(r.max_tokens, 2);
    assert_eq!(r.top_logprobs, Some(2));

    // Streaming with n = 2: every choice gets its text and its finish reason.
    let body = json!({"model": "m", "n": 2, "stream": true, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]});
    let chunks = s.post("/v1/chat/completions", &body).await.sse_json();
    let mut text = [String::new(), String::new()];
    let mut finish = [Value::Null, Value::Null];
    for c in &chunks {
        let ch = &c["choices"][0];
        let i = ch["index"].as_u64().unwrap() as usize;
        text[i].push_str(ch["delta"]["content"].as_str().unwrap_or(""));
        if !ch["finish_reason"].is_null() {
            finish[i] = ch["finish_reason"].clone();
        }
    }
    assert_eq!(text, ["abcdef", "abcdef"]);
    assert_eq!(finish, [json!("length"), json!("length")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_features_are_400() {
    let (s, _) = server("x", "qwen2.5.jinja").await;
    let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    // (`response_format` json_object / json_schema are supported: tests/structured.rs;
    // tool_choice `required` and named functions: tests/tool_choice.rs.)
    for (k, v) in [
        (
            "tool_choice",
            json!({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}),
        ),
        (
            "tool_choice",
            json!({"type": "custom", "custom": {"name": "get_weather"}}),
        ),
    ] {
        let mut b = with(k, v);
        b["tools"] = weather_tool();
        let r = s.post("/v1/chat/completions", &b).await;
        assert_eq!(r.status, 400, "{k}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(e["error"]["param"], k);
        assert!(e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not supported"));
    }
    let r = s
        .post(
            "/v1/chat/completions",
            &with("response_format", json!({"type": "text"})),
        )
        .await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_errors() {
    // Queue full -> 429 in both formats.
    let mut e = Scripted::new("x");
    e.max_queue = 0;
    let (s, _) = server_with(e, "qwen2.5.jinja", cfg()).await;
    let r = s
        .post(
            "/v1/chat/completions",
            &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    let r = s.post("/v1/messages", &json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(r.status, 429);
    assert_eq!(
        r.json(),
        json!({"type": "error", "error": {"type": "rate_limit_error", "message": r.json()["error"]["message"]}})
    );

    // A failing generation -> 500, or an error chunk when streaming.
    let mut e = Scripted::new("abc");
    e.fail = true;
    let (s, _) = server_with(e, "qwen2.5.jinja", cfg()).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let r = s.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["type"], "server_error");
    let mut sb = body.clone();
    sb["stream"] = true.into();
    let chunks = s.post("/v1/chat/completions", &sb).await.sse_json();
    assert_eq!(chunks.last().unwrap()["error"]["type"], "server_error");
    let r = s.post("/v1/messages", &json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["type"], "api_error");
    let ev = s
        .post("/v1/messages", &json!({"model": "m", "max_tokens": 5, "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .await
        .sse();
    let last = ev.last().unwrap();
    assert_eq!(last.0.as_deref(), Some("error"));
    assert!(last.1.contains("api_error"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_thinking_and_tool_use() {
    let reply = format!("<think>\nI should call the tool.\n</think>\n\nChecking.\n{CALL}");
    let (s, _) = server(&reply, "qwen3.jinja").await;
    let tools = json!([{"name": "get_weather", "description": "Current weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let body = json!({"model": "m", "max_tokens": 200, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": tools, "messages": [{"role": "user", "content": "Weather in Bern?"}]});
    let r = s.post("/v1/messages", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(v["stop_reason"], "tool_use");
    let content = v["content"].as_array().unwrap();
    assert_eq!(content[0]["type"], "thinking");
    assert_eq!(content[0]["thinking"], "I should call the tool.");
    assert_eq!(content[1], json!({"type": "text", "text": "Checking."}));
    assert_eq!(content[2]["type"], "tool_use");
    assert_eq!(content[2]["name"], "get_weather");
    assert_eq!(content[2]["input"], json!({"city": "Bern"}));
    assert!(content[2]["id"].as_str().unwrap().starts_with("toolu_"));
    assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        v["usage"]["output_tokens"],
        reply.chars().count().div_ceil(3)
    );

    let mut sb = body.clone();
    sb["stream"] = true.into();
    let r = s.post("/v1/messages", &sb).await;
    assert_eq!(r.status, 200);
    let events = r.sse();
    // Event names with runs of deltas collapsed.
    let mut names: Vec<String> = Vec::new();
    for (name, data) in &events {
        let name = name.clone().expect("every event is named");
        let d: Value = serde_json::from_str(data).unwrap();
        assert_eq!(d["type"], name.as_str());
        let label = match name.as_str() {
            "content_block_start" => format!(
                "start:{}:{}",
                d["index"],
                d["content_block"]["type"].as_str().unwrap()
            ),
            "content_block_delta" => format!(
                "delta:{}:{}",
                d["index"],
                d["delta"]["type"].as_str().unwrap()
            ),
            "content_block_stop" => format!("stop:{}", d["index"]),
            other => other.to_string(),
        };
        if names.last() != Some(&label) {
            names.push(label);
        }
    }
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "start:0:thinking",
            "delta:0:thinking_delta",
            "stop:0",
            "start:1:text",
            "delta:1:text_delta",
            "stop:1",
            "start:2:tool_use",
            "delta:2:input_json_delta",
            "stop:2",
            "message_delta",
            "message_stop",
        ]
    );
    let data: Vec<Value> = events
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = data
        .iter()
        .filter(|d| d["delta"]["type"] == "text_delta")
        .map(|d| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Checking.");
    let json_delta = data
        .iter()
        .find(|d| d["delta"]["type"] == "input_json_delta")
        .unwrap();
    let input: Value =
        serde_json::from_str(json_delta["delta"]["partial_json"].as_str().unwrap()).unwrap();
    assert_eq!(input, json!({"city": "Bern"}));
    let md = data.iter().find(|d| d["type"] == "message_delta").unwrap();
    assert_eq!(md["delta"]["stop_reason"], "tool_use");
    assert!(md["usage"]["output_tokens"].as_u64().unwrap() > 0);
    assert_eq!(data[0]["message"]["content"], json!([]));
}

/// Claude Code's request shape: the billing-header block is not in the prompt, `system`
/// messages inside `messages` are rendered in place (Qwen2.5) or merged into the system prompt
/// (Qwen3.5's template refuses them later on), `adaptive` thinking is accepted; while the
/// prompt is computed the stream sends `ping`s, and `message_start` reports the prefix-cache
/// hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_claude_code_shape() {
    let body = json!({
        "model": "claude-opus-4-8",
        "max_tokens": 32000,
        "stream": true,
        "thinking": {"type": "adaptive"},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=9f3e1;"},
            {"type": "text", "text": "You are Claude Code, a CLI for coding.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"}, {"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "The user switched to plan mode."},
        ],
        "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}],
        "metadata": {"user_id": "u"},
    });
    for tmpl in ["qwen2.5.jinja", "qwen3.5.jinja"] {
        let engine = Scripted::new("Done.");
        let mut engine = engine.slow(Duration::from_millis(10));
        engine.prefill = Duration::from_millis(450);
        let c = ServerConfig {
            ping_every: Duration::from_millis(100),
            ..cfg()
        };
        let (s, counts) = server_with(engine, tmpl, c).await;
        let r = s.post("/v1/messages", &body).await;
        assert_eq!(r.status, 200, "{tmpl}: {}", r.text());
        let events = r.sse();
        let names: Vec<&str> = events.iter().map(|e| e.0.as_deref().unwrap()).collect();
        assert_eq!(names[0], "message_start", "{tmpl}: {names:?}");
        let start: Value = serde_json::from_str(&events[0].1).unwrap();
        assert_eq!(start["message"]["usage"]["cache_read_input_tokens"], 7);
        let first_block = names
            .iter()
            .position(|n| *n == "content_block_start")
            .unwrap();
        let pings = names[..first_block]
            .iter()
            .filter(|n| **n == "ping")
            .count();
        assert!(pings >= 3, "{tmpl}: pings while prefilling: {names:?}");
        assert_eq!(names.last(), Some(&"message_stop"));
        let prompt = last_prompt(&counts);
        assert!(!prompt.contains("billing"), "{tmpl}: {prompt}");
        assert!(prompt.contains("You are Claude Code"), "{tmpl}: {prompt}");
        assert!(
            prompt.contains("The user switched to plan mode."),
            "{tmpl}: {prompt}"
        );
        // count_tokens takes the same shape.
        let r = s.post("/v1/messages/count_tokens", &body).await;
        assert_eq!(r.status, 200, "{tmpl}: {}", r.text());
        let n = r.json()["input_tokens"].as_u64().unwrap() as usize;
        assert_eq!(n, tokenizer().encode(&prompt, true, true).unwrap().len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_history_and_stop_sequences() {
    let (s, counts) = server("one two STOP three", "qwen2.5.jinja").await;
    let body = json!({"model": "m", "max_tokens": 50, "stop_sequences": ["STOP"],
    "system": "Be brief.",
    "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Bern"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]});
    let r = s.post("/v1/messages", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], "STOP");
    assert_eq!(v["content"], json!([{"type": "text", "text": "one two"}]));
    let prompt = last_prompt(&counts);
    assert!(
        prompt.starts_with("<|im_start|>system\nBe brief.\n\n# Tools"),
        "{prompt}"
    );
    assert!(
        prompt.contains("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}"),
        "{prompt}"
    );
    assert!(
        prompt.contains("<tool_response>\nsunny\n</tool_response>"),
        "{prompt}"
    );

    let r = s
        .post(
            "/v1/messages/count_tokens",
            &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert!(r.json()["input_tokens"].as_u64().unwrap() > 3);

    let r = s.post("/v1/messages", &json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(r.json()["stop_reason"], "max_tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_cancels_the_request() {
    let reply = "word ".repeat(400);
    let engine = Scripted::new(&reply).slow(Duration::from_millis(10));
    let (s, counts) = server_with(engine, "qwen2.5.jinja", cfg()).await;
    for path in ["/v1/chat/completions", "/v1/messages", "/v1/completions"] {
        let body = match path {
            "/v1/completions" => {
                json!({"model": "m", "prompt": "hi", "max_tokens": 1000, "stream": true})
            }
            _ => {
                json!({"model": "m", "max_tokens": 1000, "stream": true, "messages": [{"role": "user", "content": "hi"}]})
            }
        };
        let before = counts.lock().unwrap().cancelled;
        let mut sock = send_request(s.addr, "POST", path, &[], body.to_string().as_bytes()).await;
        let mut buf = vec![0u8; 4096];
        let mut got = Vec::new();
        while !String::from_utf8_lossy(&got).contains("data:") {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(s.metric("kapitsa_slots_used").await, 1.0);
        drop(sock);
        let c2 = counts.clone();
        let freed = wait_until(Duration::from_secs(10), || {
            let c = c2.clone();
            async move {
                let c = c.lock().unwrap();
                c.running == 0 && c.cancelled == before + 1
            }
        })
        .await;
        assert!(freed, "{path}: the request was not cancelled");
        assert_eq!(s.metric("kapitsa_slots_used").await, 0.0);
        assert_eq!(s.metric("kapitsa_streams_active").await, 0.0);
    }
    assert!(s.metric("kapitsa_engine_requests_cancelled_total").await >= 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_streams_finish() {
    let engine = Scripted::new(&"ab ".repeat(20)).slow(Duration::from_millis(20));
    let (mut s, counts) = server_with(engine, "qwen2.5.jinja", cfg()).await;
    let addr = s.addr;
    let body =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let client = tokio::spawn(async move {
        common::request(
            addr,
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string().as_bytes(),
        )
        .await
    });
    let c2 = counts.clone();
    assert!(
        wait_until(Duration::from_secs(5), || {
            let c = c2.clone();
            async move { c.lock().unwrap().running == 1 }
        })
        .await
    );
    s.begin_shutdown();
    let r = client.await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.sse().last().unwrap().1, "[DONE]");
    let content: String = r
        .sse_json()
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(content, "ab ".repeat(20).trim());
    s.shutdown(Duration::from_secs(10)).await.unwrap();
    assert_eq!(counts.lock().unwrap().cancelled, 0);
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_streams_after_the_grace_period() {
    let engine = Scripted::new(&"ab ".repeat(500)).slow(Duration::from_millis(20));
    let mut c = cfg();
    c.shutdown_grace = Duration::from_millis(300);
    let (mut s, counts) = server_with(engine, "qwen2.5.jinja", c).await;
    let addr = s.addr;
    let body =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let client = tokio::spawn(async move {
        common::request(
            addr,
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string().as_bytes(),
        )
        .await
    });
    let c2 = counts.clone();
    assert!(
        wait_until(Duration::from_secs(5), || {
            let c = c2.clone();
            async move { c.lock().unwrap().running == 1 }
        })
        .await
    );
    s.begin_shutdown();
    let t0 = std::time::Instant::now();
    let r = client.await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5));
    let chunks = r.sse_json();
    let last = chunks.last().unwrap();
    assert_eq!(last["error"]["code"], "service_unavailable", "{last}");
    s.shutdown(Duration::from_secs(5)).await.unwrap();
    let c2 = counts.clone();
    assert!(
        wait_until(Duration::from_secs(5), || {
            let c = c2.clone();
            async move { c.lock().unwrap().cancelled == 1 }
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_echo_logprobs_and_stream() {
    let (s, counts) = server("xyz123", "qwen2.5.jinja").await;
    let body = json!({"model": "m", "prompt": "abc", "echo": true, "logprobs": 2, "max_tokens": 5});
    let v = s.post("/v1/completions", &body).await.json();
    assert_eq!(v["object"], "text_completion");
    let c = &v["choices"][0];
    assert_eq!(c["text"], "abcxyz123");
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["logprobs"]["tokens"].as_array().unwrap().len(), 2);
    assert_eq!(c["logprobs"]["text_offset"][0], 3);
    assert_eq!(
        c["logprobs"]["top_logprobs"][0].as_object().unwrap().len(),
        2
    );
    // Default max_tokens of completions is 16.
    let v = s
        .post(
            "/v1/completions",
            &json!({"model": "m", "prompt": ["a", "b"], "n": 2}),
        )
        .await
        .json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 4);
    assert_eq!(
        counts.lock().unwrap().requests.last().unwrap().max_tokens,
        16
    );
    let r = s.post("/v1/completions", &json!({"model": "m", "prompt": [1, 2, 3], "stream": true, "stream_options": {"include_usage": true}})).await;
    let chunks = r.sse_json();
    let text: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"]
                .get(0)
                .and_then(|x| x["text"].as_str())
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, "xyz123");
    assert_eq!(chunks.last().unwrap()["usage"]["prompt_tokens"], 3);
    assert_eq!(r.sse().last().unwrap().1, "[DONE]");
}

/// `/v1/responses` as Codex CLI uses it: reasoning, text and a tool call come back as output
/// items, streamed event by event; the history (function calls and outputs) reaches the
/// prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_codex_shape() {
    let reply = format!("<think>\nI should call the tool.\n</think>\n\nChecking.\n{CALL}");
    let (s, counts) = server(&reply, "qwen3.jinja").await;
    let body = json!({
        "model": "gpt-5-codex",
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Bern?"}]},
            {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": "{\"city\": \"Basel\"}"},
            {"type": "function_call_output", "call_id": "call_9", "output": "rain"},
        ],
        "tools": [
            {"type": "function", "name": "get_weather", "description": "Current weather", "strict": false,
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
            {"type": "web_search"},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": false,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": false,
        "include": ["reasoning.encrypted_content"],
    });
    let r = s.post("/v1/responses", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    let out = v["output"].as_array().unwrap();
    let types: Vec<&str> = out.iter().map(|o| o["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["reasoning", "message", "function_call"]);
    assert_eq!(out[0]["content"][0]["text"], "I should call the tool.");
    assert_eq!(out[0]["summary"][0]["text"], "I should call the tool.");
    assert_eq!(out[1]["content"][0]["text"], "Checking.");
    assert_eq!(out[2]["name"], "get_weather");
    let args: Value = serde_json::from_str(out[2]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Bern"}));
    assert!(out[2]["call_id"].as_str().unwrap().starts_with("call_"));
    assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        v["usage"]["output_tokens"],
        reply.chars().count().div_ceil(3)
    );
    let prompt = last_prompt(&counts);
    assert!(prompt.contains("You are a coding agent."), "{prompt}");
    assert!(prompt.contains("\"city\": \"Basel\""), "{prompt}");
    assert!(prompt.contains("rain"), "{prompt}");
    assert!(!prompt.contains("web_search"), "{prompt}");

    let mut sb = body.clone();
    sb["stream"] = true.into();
    let r = s.post("/v1/responses", &sb).await;
    assert_eq!(r.status, 200);
    let events = r.sse();
    // Event names, runs collapsed (the summary deltas, which alternate with the reasoning
    // deltas, are counted apart).
    let mut names: Vec<String> = Vec::new();
    let mut n_summary_deltas = 0;
    for (i, (name, data)) in events.iter().enumerate() {
        let name = name.clone().expect("every event is named");
        let d: Value = serde_json::from_str(data).unwrap();
        assert_eq!(d["type"], name.as_str());
        assert_eq!(d["sequence_number"], i, "{name}");
        if name == "response.reasoning_summary_text.delta" {
            n_summary_deltas += 1;
            continue;
        }
        if names.last() != Some(&name) {
            names.push(name);
        }
    }
    assert!(n_summary_deltas > 0);
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_summary_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.reasoning_summary_text.done",
            "response.reasoning_summary_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let data: Vec<Value> = events
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = data
        .iter()
        .filter(|d| d["type"] == "response.output_text.delta")
        .map(|d| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Checking.");
    let done = data.last().unwrap();
    assert_eq!(done["response"]["status"], "completed");
    assert_eq!(done["response"]["output"].as_array().unwrap().len(), 3);
    assert_eq!(done["response"]["output"][2]["type"], "function_call");
    assert_eq!(
        done["response"]["usage"]["output_tokens"],
        v["usage"]["output_tokens"]
    );

    // Cut by max_output_tokens: incomplete.
    let mut b = body.clone();
    b["max_output_tokens"] = 2.into();
    let v = s.post("/v1/responses", &b).await.json();
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    b["stream"] = true.into();
    let r = s.post("/v1/responses", &b).await;
    let last = r.sse().last().unwrap().clone();
    assert_eq!(last.0.as_deref(), Some("response.incomplete"));

    // Stateless: previous_response_id is a clear 400.
    let r = s
        .post(
            "/v1/responses",
            &json!({"model": "m", "input": "hi", "previous_response_id": "resp_1"}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "previous_response_id");
}

/// The tiny tokenizer with Qwen2.5-Coder's FIM and repository tokens added (ids 400..404).
fn fim_tokenizer() -> Arc<Tokenizer> {
    let path = tiny().join("tokenizer.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let names = [
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|repo_name|>",
        "<|file_sep|>",
    ];
    let added = v["added_tokens"].as_array_mut().unwrap();
    for (i, n) in names.iter().enumerate() {
        added.push(
            json!({"id": 400 + i, "content": n, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}),
        );
    }
    let cfg = json!({"eos_token": "<|im_end|>"});
    Arc::new(
        Tokenizer::from_tokenizer_json_bytes(v.to_string().as_bytes(), Some(&cfg), None).unwrap(),
    )
}

/// Fill-in-the-middle: `suffix` on `/v1/completions` (the openai SDK, Continue) and llama.cpp's
/// `/infill` (llama.vscode, with repository files) build the prompt from the FIM tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fill_in_the_middle() {
    let engine = Scripted::new("x + y");
    let counts = engine.counts.clone();
    let tok = fim_tokenizer();
    let model =
        ServedModel::new("m".into(), tok.clone(), Some(&template("qwen2.5.jinja"))).unwrap();
    let s = TestServer::start(Arc::new(engine), model, cfg()).await;
    let prompt_of = |counts: &Mutex<Counts>| {
        let c = counts.lock().unwrap();
        c.requests.last().unwrap().clone()
    };
    let r = s
        .post(
            "/v1/completions",
            &json!({"model": "m", "prompt": "def add(x, y):\n    return ", "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 16}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["text"], "x + y");
    let req = prompt_of(&counts);
    assert_eq!(req.prompt[0], 400, "starts with <|fim_prefix|>");
    assert_eq!(
        tok.decode(&req.prompt, false).unwrap(),
        "<|fim_prefix|>def add(x, y):\n    return <|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>"
    );
    assert!(req.stop.contains(&"<|file_sep|>".to_string()));

    // llama.vscode's /infill with repository files, streamed and not.
    let body = json!({
        "input_prefix": "def add(x, y):\n    return ",
        "input_suffix": "\n",
        "input_extra": [{"filename": "util.py", "text": "ONE = 1\n"}],
        "prompt": "",
        "n_predict": 32,
        "cache_prompt": true,
        "t_max_prompt_ms": 500,
        "samplers": ["top_k", "top_p", "infill"],
    });
    let r = s.post("/infill", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["content"], "x + y");
    assert_eq!(v["stop"], true);
    assert_eq!(v["stop_type"], "eos");
    assert_eq!(
        tok.decode(&prompt_of(&counts).prompt, false).unwrap(),
        "<|repo_name|>myproject\n<|file_sep|>util.py\nONE = 1\n<|fim_prefix|>def add(x, y):\n    return <|fim_suffix|>\n<|fim_middle|>"
    );
    let mut sb = body.clone();
    sb["stream"] = true.into();
    let r = s.post("/infill", &sb).await;
    let chunks = r.sse_json();
    let text: String = chunks
        .iter()
        .map(|c| c["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, "x + y");
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["stop"] == false));
    assert_eq!(chunks.last().unwrap()["stop"], true);
    // Bad input: 400 naming the field.
    for (bad, param) in [
        (json!({"input_prefix": 5}), "input_prefix"),
        (
            json!({"input_extra": [{"filename": "a"}]}),
            "input_extra[0].text",
        ),
        (json!({"input_extra": "x"}), "input_extra"),
        (json!({"n_predict": -2}), "n_predict"),
    ] {
        let r = s.post("/infill", &bad).await;
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.json()["error"]["param"], param, "{bad}");
    }
    let r = s
        .post(
            "/v1/completions",
            &json!({"model": "m", "prompt": [1, 2], "suffix": "x"}),
        )
        .await;
    assert_eq!(r.json()["error"]["param"], "prompt");
}

/// A model without FIM tokens: a clear 400 from `/infill`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infill_needs_fim_tokens() {
    let (s, _) = server("x", "qwen2.5.jinja").await;
    let r = s
        .post(
            "/infill",
            &json!({"input_prefix": "a", "input_suffix": "b"}),
        )
        .await;
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["param"], "input_suffix");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("fill-in-the-middle"));
}

/// A long prefill: the Responses stream repeats `response.in_progress` so that clients with a
/// stream idle timeout (Codex CLI) keep it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_keep_alive_while_prefilling() {
    let mut engine = Scripted::new("Done.");
    engine.prefill = Duration::from_millis(450);
    let c = ServerConfig {
        ping_every: Duration::from_millis(100),
        ..cfg()
    };
    let (s, _) = server_with(engine, "qwen2.5.jinja", c).await;
    let r = s
        .post(
            "/v1/responses",
            &json!({"model": "m", "input": "hi", "stream": true}),
        )
        .await;
    let names: Vec<String> = r.sse().into_iter().map(|e| e.0.unwrap()).collect();
    let first_item = names
        .iter()
        .position(|n| n == "response.output_item.added")
        .unwrap();
    let alive = names[..first_item]
        .iter()
        .filter(|n| *n == "response.in_progress")
        .count();
    assert!(alive >= 3, "{names:?}");
    assert_eq!(names.last().map(String::as_str), Some("response.completed"));
}
