//! `response_format` (`json_object`, `json_schema`) over HTTP with the real engine and the tiny
//! random-weight Qwen2 fixture: replies are valid JSON under the schema (streaming or not),
//! bad schemas are 400s naming `response_format`, `text` stays unconstrained, and a template
//! with reasoning gives plain JSON content.

mod common;

use std::sync::Arc;

use common::{cfg, load_tiny, repo, tiny, Resp, TestServer};
use kapitsa_engine::{EngineConfig, EngineHandle};
use kapitsa_models::KvType;
use serde_json::{json, Value};

async fn start(template: Option<&str>) -> TestServer {
    let tpl = template.map(|t| repo().join("tests/fixtures/templates").join(t));
    let (loaded, served) = load_tiny(&tiny(), tpl.as_deref());
    // `..default()`: settings added later keep their defaults here.
    #[allow(clippy::needless_update)]
    let ecfg = EngineConfig {
        max_running: 4,
        max_batch_tokens: 64,
        n_ctx: 512,
        max_queue: 16,
        kv_type: KvType::F32,
        ..EngineConfig::default()
    };
    let engine =
        EngineHandle::start(loaded.model.clone(), served.tokenizer.clone(), ecfg).expect("engine");
    TestServer::start(Arc::new(engine), served, cfg()).await
}

/// Every valid instance is short, so even a random model finishes it within the budget.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 5},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["C", "F"]},
            "rain": {"type": "boolean"}
        },
        "required": ["city", "days", "unit", "rain"],
        "additionalProperties": false
    })
}

/// Check a reply against [`schema`] by hand.
fn check(content: &str) {
    let v: Value =
        serde_json::from_str(content).unwrap_or_else(|e| panic!("not JSON: {content:?}: {e}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["city", "days", "rain", "unit"], "{v}");
    let city = o["city"].as_str().unwrap();
    assert!((1..=5).contains(&city.chars().count()), "{v}");
    assert!(
        o["days"].as_i64().is_some_and(|d| (1..=7).contains(&d)),
        "{v}"
    );
    assert!(o["unit"] == "C" || o["unit"] == "F", "{v}");
    assert!(o["rain"].is_boolean(), "{v}");
}

fn body(rf: Value, seed: u64) -> Value {
    json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather as JSON, please."}],
        "max_tokens": 300,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": seed,
        "response_format": rf,
    })
}

fn json_schema_format() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "weather", "strict": true, "schema": schema()}})
}

fn stream_text(r: &Resp) -> (String, Value) {
    assert_eq!(r.status, 200, "{}", r.text());
    let mut text = String::new();
    let mut finish = Value::Null;
    for c in r.sse_json() {
        assert!(c.get("error").is_none(), "{c}");
        if let Some(ch) = c["choices"].get(0) {
            assert!(ch["delta"].get("reasoning_content").is_none(), "{c}");
            text.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            if !ch["finish_reason"].is_null() {
                finish = ch["finish_reason"].clone();
            }
        }
    }
    (text, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_replies_validate_streaming_or_not() {
    let s = start(None).await;
    let mut b = body(json_schema_format(), 11);
    b["n"] = json!(4);
    let r = s.post("/v1/chat/completions", &b).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for c in choices {
        assert_eq!(c["finish_reason"], "stop", "{c}");
        assert!(c["message"].get("reasoning_content").is_none());
        check(c["message"]["content"].as_str().unwrap());
    }
    // Streaming: same seed, same JSON (choice 0 samples with `seed`).
    let mut b = body(json_schema_format(), 11);
    b["stream"] = json!(true);
    let (text, finish) = stream_text(&s.post("/v1/chat/completions", &b).await);
    assert_eq!(finish, "stop");
    assert_eq!(text, choices[0]["message"]["content"].as_str().unwrap());
    // Greedy, with logprobs: still valid, and every alternative reported is finite.
    let mut b = body(json_schema_format(), 1);
    b["temperature"] = json!(0);
    b["logprobs"] = json!(true);
    b["top_logprobs"] = json!(5);
    let r = s.post("/v1/chat/completions", &b).await;
    let v = r.json();
    check(v["choices"][0]["message"]["content"].as_str().unwrap());
    for e in v["choices"][0]["logprobs"]["content"].as_array().unwrap() {
        assert!(e["logprob"].is_f64(), "{e}");
        for t in e["top_logprobs"].as_array().unwrap() {
            assert!(t["logprob"].is_f64(), "{t}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_object_replies_are_objects() {
    let s = start(None).await;
    let mut finished = 0;
    for seed in 0..4 {
        let r = s
            .post(
                "/v1/chat/completions",
                &body(json!({"type": "json_object"}), seed),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let c = &v["choices"][0];
        let content = c["message"]["content"].as_str().unwrap();
        assert!(content.trim_start().starts_with('{'), "{content:?}");
        if c["finish_reason"] == "stop" {
            finished += 1;
            let o: Value = serde_json::from_str(content)
                .unwrap_or_else(|e| panic!("not JSON: {content:?}: {e}"));
            assert!(o.is_object());
        } else {
            // A free-form object may run out of tokens; nothing else may stop it.
            assert_eq!(c["finish_reason"], "length", "{c}");
        }
    }
    assert!(finished > 0, "no json_object reply finished");
    let mut b = body(json!({"type": "json_object"}), 3);
    b["stream"] = json!(true);
    let (text, _) = stream_text(&s.post("/v1/chat/completions", &b).await);
    assert!(text.trim_start().starts_with('{'), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_response_formats_are_400() {
    let s = start(None).await;
    for rf in [
        // Rejected by the engine's schema compiler.
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/none"}}}),
        // Compiles but admits no value (was a 500 from the first generation step).
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
        // Rejected while reading the request.
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}),
        json!({"type": "json_schema"}),
        json!({"type": "xml"}),
        json!("json_object"),
    ] {
        let r = s.post("/v1/chat/completions", &body(rf.clone(), 1)).await;
        assert_eq!(r.status, 400, "{rf}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert_eq!(e["error"]["param"], "response_format", "{e}");
        assert!(!e["error"]["message"].as_str().unwrap().is_empty());
    }
    // Streaming requests are refused the same way, before the stream starts.
    let mut b = body(
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}),
        1,
    );
    b["stream"] = json!(true);
    let r = s.post("/v1/chat/completions", &b).await;
    assert_eq!(r.status, 400, "{}", r.text());
    // `text` is unconstrained and the server still works.
    let r = s
        .post("/v1/chat/completions", &body(json!({"type": "text"}), 1))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_templates_give_plain_json_content() {
    // The Qwen3 template has <think> support: with a constraint the whole reply is the
    // JSON (thinking switched off in the template), returned as `content`.
    let s = start(Some("qwen3.jinja")).await;
    for stream in [false, true] {
        let mut b = body(json_schema_format(), 5);
        b["stream"] = json!(stream);
        let r = s.post("/v1/chat/completions", &b).await;
        let content = if stream {
            let (text, finish) = stream_text(&r);
            assert_eq!(finish, "stop");
            text
        } else {
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            assert!(
                v["choices"][0]["message"]
                    .get("reasoning_content")
                    .is_none(),
                "{v}"
            );
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        check(&content);
    }
    // Thinking is switched off in the prompt: the template adds an empty think block, so the
    // prompt is longer than the same conversation without a constraint...
    let prompt_tokens = |b: Value| {
        let s = &s;
        async move {
            let r = s.post("/v1/chat/completions", &b).await;
            assert_eq!(r.status, 200, "{}", r.text());
            r.json()["usage"]["prompt_tokens"].as_u64().unwrap()
        }
    };
    let plain = prompt_tokens(body(json!({"type": "text"}), 5)).await;
    let constrained = prompt_tokens(body(json_schema_format(), 5)).await;
    assert!(constrained > plain, "{constrained} vs {plain}");
    // ... unless the request asks for thinking itself.
    let mut b = body(json_schema_format(), 5);
    b["chat_template_kwargs"] = json!({"enable_thinking": true});
    assert_eq!(prompt_tokens(b).await, plain);
}

/// `response_format` on `/v1/completions` constrains every completion as in chat (it was
/// silently ignored), and a bad one is a 400 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_honour_response_format() {
    let s = start(None).await;
    let b = json!({
        "model": "tiny",
        "prompt": ["Weather as JSON:", "Some JSON:"],
        "max_tokens": 300,
        "temperature": 1.0,
        "seed": 5,
        "response_format": json_schema_format(),
    });
    let r = s.post("/v1/completions", &b).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for c in choices {
        assert_eq!(c["finish_reason"], "stop", "{c}");
        check(c["text"].as_str().unwrap());
    }
    let mut bad = b.clone();
    bad["response_format"] =
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}});
    let r = s.post("/v1/completions", &bad).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "response_format");
    bad["response_format"] = json!({"type": "yaml"});
    let r = s.post("/v1/completions", &bad).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "response_format");
}
