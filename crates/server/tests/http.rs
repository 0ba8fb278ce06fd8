//! The server over the real engine and the tiny Qwen2 fixture (`tests/fixtures/tiny/qwen2-a`,
//! random weights, a plain ChatML template without tools): every endpoint streaming and not,
//! the error classes, auth, the body limit, concurrency, queue limits, cancellation on
//! disconnect and graceful shutdown, all over raw HTTP/1.1.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{cfg, load_tiny, send_request, tiny, wait_until, Resp, TestServer};
use kapitsa_engine::{EngineConfig, EngineHandle};
use kapitsa_models::KvType;
use kapitsa_server::ServerConfig;
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;

fn engine_cfg() -> EngineConfig {
    EngineConfig {
        max_running: 4,
        max_batch_tokens: 64,
        n_ctx: 512,
        max_queue: 16,
        kv_type: KvType::F32,
        ..EngineConfig::default()
    }
}

async fn start(ecfg: EngineConfig, scfg: ServerConfig) -> TestServer {
    let (loaded, mut served) = load_tiny(&tiny(), None);
    // Unknown model names are 404s here (see `model_names` for the default).
    served.strict_name = true;
    let engine =
        EngineHandle::start(loaded.model.clone(), served.tokenizer.clone(), ecfg).expect("engine");
    TestServer::start(Arc::new(engine), served, scfg).await
}

async fn default_server() -> TestServer {
    start(engine_cfg(), cfg()).await
}

fn chat_body(content: &str, max_tokens: usize) -> Value {
    json!({
        "model": "tiny",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

fn stream_content(r: &Resp) -> (String, Value, Value) {
    let mut text = String::new();
    let mut finish = Value::Null;
    let mut usage = Value::Null;
    for c in r.sse_json() {
        if let Some(ch) = c["choices"].get(0) {
            text.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            if !ch["finish_reason"].is_null() {
                finish = ch["finish_reason"].clone();
            }
        }
        if !c["usage"].is_null() {
            usage = c["usage"].clone();
        }
    }
    (text, finish, usage)
}

fn assert_openai_error(r: &Resp, status: u16, ty: &str) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let v = r.json();
    let e = &v["error"];
    assert_eq!(e["type"], ty, "{v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    e.clone()
}

fn assert_anthropic_error(r: &Resp, status: u16, ty: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], ty, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_metrics() {
    let s = default_server().await;
    let v = s.get("/v1/models").await.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(s.get("/v1/models/tiny").await.json()["id"], "tiny");
    assert_openai_error(
        &s.get("/v1/models/other").await,
        404,
        "invalid_request_error",
    );
    // A model id that is not UTF-8 once percent-decoded: the API's JSON error, not plain text.
    assert_openai_error(
        &s.get("/v1/models/%FF%FE").await,
        400,
        "invalid_request_error",
    );
    let h = s.get("/health").await;
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");
    assert_eq!(s.metric("kapitsa_slots_total").await, 4.0);
    assert_eq!(s.metric("kapitsa_queue_length").await, 0.0);
    let r = s.post("/v1/chat/completions", &chat_body("hello", 4)).await;
    assert_eq!(r.status, 200);
    let m = s.get("/metrics").await;
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    let text = m.text();
    for needle in [
        "kapitsa_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
        "kapitsa_http_requests_total{endpoint=\"/v1/models/{id}\",status=\"404\"} 1",
        "kapitsa_time_to_first_token_seconds_count 1",
        "kapitsa_inter_token_latency_seconds_bucket{le=\"+Inf\"}",
        "kapitsa_requests_running ",
        "kapitsa_slots_used ",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    // The engine publishes its counters after each step: the slot is freed shortly after
    // the reply.
    let s2 = &s;
    assert!(
        wait_until(Duration::from_secs(10), || async move {
            s2.metric("kapitsa_slots_used").await == 0.0
                && s2.metric("kapitsa_requests_running").await == 0.0
        })
        .await
    );
    assert!(s.metric("kapitsa_prompt_tokens_total").await > 0.0);
    assert!(s.metric("kapitsa_generation_tokens_total").await > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_matches_non_streaming() {
    let s = default_server().await;
    let r = s
        .post("/v1/chat/completions", &chat_body("Say something.", 24))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "tiny");
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    let content = c["message"]["content"].as_str().unwrap().to_string();
    let finish = c["finish_reason"].as_str().unwrap();
    assert!(finish == "length" || finish == "stop");
    let u = &v["usage"];
    let n_prompt = u["prompt_tokens"].as_u64().unwrap();
    assert!(n_prompt > 5);
    assert!(u["completion_tokens"].as_u64().unwrap() <= 24);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        n_prompt + u["completion_tokens"].as_u64().unwrap()
    );
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());

    let mut b = chat_body("Say something.", 24);
    b["stream"] = true.into();
    b["stream_options"] = json!({"include_usage": true});
    let r = s.post("/v1/chat/completions", &b).await;
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(r.sse().last().unwrap().1, "[DONE]");
    let chunks = r.sse_json();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let ids: std::collections::HashSet<&str> =
        chunks.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 1);
    let (text, sfinish, usage) = stream_content(&r);
    assert_eq!(text, content);
    assert_eq!(sfinish, finish);
    assert_eq!(usage["prompt_tokens"].as_u64().unwrap(), n_prompt);
    assert_eq!(usage["completion_tokens"], u["completion_tokens"]);
    // The identical second prompt reuses the cached prefix.
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{usage}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_options_n_logprobs_stop() {
    let s = default_server().await;
    let mut b = chat_body("Count.", 12);
    b["n"] = 2.into();
    b["logprobs"] = true.into();
    b["top_logprobs"] = 3.into();
    b["messages"][1]["content"] = json!([{"type": "text", "text": "Count."}]);
    let r = s.post("/v1/chat/completions", &b).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let ch = v["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 2);
    // Greedy: both choices are the same.
    assert_eq!(ch[0]["message"]["content"], ch[1]["message"]["content"]);
    let lp = ch[0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        lp.len() as u64 * 2,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for e in lp {
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 3);
        // Greedy picks the most likely token.
        assert_eq!(e["top_logprobs"][0]["token"], e["token"]);
    }
    // A stop string cuts the text.
    let full = ch[0]["message"]["content"].as_str().unwrap().to_string();
    let cut: String = full.chars().skip(3).take(2).collect();
    if cut.chars().count() == 2 && !cut.trim().is_empty() {
        let mut b = chat_body("Count.", 12);
        b["stop"] = json!([cut.clone()]);
        let v = s.post("/v1/chat/completions", &b).await.json();
        let got = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(got, &full[..full.find(&cut).unwrap()]);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    // Sampling with a seed is reproducible.
    let mut b = chat_body("Count.", 12);
    b["temperature"] = 1.0.into();
    b["seed"] = 1234.into();
    let a = s.post("/v1/chat/completions", &b).await.json();
    let c = s.post("/v1/chat/completions", &b).await.json();
    assert_eq!(a["choices"][0]["message"], c["choices"][0]["message"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_match_the_reference() {
    let s = default_server().await;
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("reference.json")).unwrap())
            .unwrap();
    let p = &reference["prompts"][0];
    let want: Vec<u32> = p["hf_greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let tok = s.state.model.tokenizer.clone();
    let want_text = tok.decode(&want, false).unwrap();
    let body = json!({"model": "tiny", "prompt": p["ids"], "max_tokens": want.len(), "temperature": 0, "ignore_eos": true, "logprobs": 1});
    let r = s.post("/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let c = &v["choices"][0];
    assert_eq!(c["text"].as_str().unwrap(), want_text);
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(
        c["logprobs"]["tokens"].as_array().unwrap().len(),
        want.len()
    );
    assert_eq!(v["usage"]["completion_tokens"], want.len());
    assert_eq!(
        v["usage"]["prompt_tokens"],
        p["ids"].as_array().unwrap().len()
    );

    let mut sb = body.clone();
    sb["stream"] = true.into();
    let r = s.post("/v1/completions", &sb).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.sse().last().unwrap().1, "[DONE]");
    let mut text = String::new();
    let mut finish = Value::Null;
    for c in r.sse_json() {
        text.push_str(c["choices"][0]["text"].as_str().unwrap());
        if !c["choices"][0]["finish_reason"].is_null() {
            finish = c["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(text, want_text);
    assert_eq!(finish, "length");

    // A text prompt, echoed.
    let v = s
        .post("/v1/completions", &json!({"model": "tiny", "prompt": "fn main() {", "max_tokens": 5, "temperature": 0, "echo": true}))
        .await
        .json();
    assert!(v["choices"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with("fn main() {"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_detokenize_and_logit_bias() {
    let s = default_server().await;
    let tok = s.state.model.tokenizer.clone();
    let text = "fn main() { println!(\"hi\"); }";
    let v = s
        .post("/tokenize", &json!({"model": "tiny", "prompt": text}))
        .await
        .json();
    let ids: Vec<u32> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, tok.encode(text, true, true).unwrap());
    assert_eq!(v["count"], ids.len());
    assert_eq!(v["max_model_len"], 512);
    let v = s.post("/detokenize", &json!({"tokens": ids})).await.json();
    assert_eq!(v["prompt"], text);
    assert_openai_error(
        &s.post("/tokenize", &json!({"text": text})).await,
        400,
        "invalid_request_error",
    );
    assert_openai_error(
        &s.post("/detokenize", &json!({"tokens": [-1]})).await,
        400,
        "invalid_request_error",
    );
    assert_openai_error(
        &s.post("/tokenize", &json!({"model": "other", "prompt": "x"}))
            .await,
        404,
        "invalid_request_error",
    );

    // Greedy first token, then the same request with that token banned: the choice moves.
    let body =
        json!({"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1});
    let first = |v: &Value| {
        v["choices"][0]["logprobs"]["tokens"][0]
            .as_str()
            .unwrap()
            .to_string()
    };
    let free = first(&s.post("/v1/completions", &body).await.json());
    let t0 = tok.encode(&free, false, false).unwrap();
    assert_eq!(t0.len(), 1, "{free:?}");
    let mut banned = body.clone();
    banned["logit_bias"] = json!({ t0[0].to_string(): -100 });
    assert_ne!(
        first(&s.post("/v1/completions", &banned).await.json()),
        free
    );
    // Steered: every generated token is one of the favoured ones.
    let favoured = tok.encode(" alpha beta gamma", false, false).unwrap();
    let mut steer = body.clone();
    steer["max_tokens"] = 12.into();
    steer["ignore_eos"] = true.into();
    steer["logit_bias"] = favoured
        .iter()
        .map(|t| (t.to_string(), json!(100)))
        .collect::<serde_json::Map<_, _>>()
        .into();
    let v = s.post("/v1/completions", &steer).await.json();
    let allowed: Vec<String> = favoured
        .iter()
        .map(|&t| tok.decode(&[t], false).unwrap())
        .collect();
    let got = v["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    assert_eq!(got.len(), 12);
    for t in got {
        assert!(
            allowed.contains(&t.as_str().unwrap().to_string()),
            "{t} not in {allowed:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages() {
    let s = default_server().await;
    let body = json!({"model": "tiny", "max_tokens": 16, "temperature": 0, "system": "Be terse.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]});
    let r = s.post("/v1/messages", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], "tiny");
    let stop = v["stop_reason"].as_str().unwrap();
    assert!(stop == "end_turn" || stop == "max_tokens", "{stop}");
    let text: String = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["text"].as_str().unwrap().to_string())
        .collect();
    let n_in = v["usage"]["input_tokens"].as_u64().unwrap();
    let counted = s
        .post(
            "/v1/messages/count_tokens",
            &json!({"model": "tiny", "system": "Be terse.", "messages": body["messages"]}),
        )
        .await
        .json();
    assert_eq!(counted["input_tokens"].as_u64().unwrap(), n_in);

    let mut sb = body.clone();
    sb["stream"] = true.into();
    let r = s.post("/v1/messages", &sb).await;
    assert_eq!(r.status, 200);
    let events = r.sse();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(&names[..2], ["message_start", "ping"]);
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    let data: Vec<Value> = events
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let stext: String = data
        .iter()
        .filter(|d| d["type"] == "content_block_delta")
        .map(|d| d["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(stext, text);
    let md = &data[data.len() - 2];
    assert_eq!(md["delta"]["stop_reason"], stop);
    assert_eq!(md["usage"]["output_tokens"], v["usage"]["output_tokens"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_classes() {
    let mut c = cfg();
    c.max_body_bytes = 2048;
    let mut e = engine_cfg();
    e.n_ctx = 64;
    let s = start(e, c).await;
    let chat = "/v1/chat/completions";
    // Malformed JSON.
    let r = s.req("POST", chat, &[], b"{\"model\": ").await;
    assert_openai_error(&r, 400, "invalid_request_error");
    let r = s.req("POST", "/v1/messages", &[], b"not json").await;
    assert_anthropic_error(&r, 400, "invalid_request_error");
    // Wrong types name the field.
    let r = s
        .post(chat, &json!({"model": "tiny", "messages": "hi"}))
        .await;
    assert_eq!(
        assert_openai_error(&r, 400, "invalid_request_error")["param"],
        "messages"
    );
    let mut b = chat_body("hi", 4);
    b["temperature"] = "hot".into();
    assert_eq!(
        assert_openai_error(&s.post(chat, &b).await, 400, "invalid_request_error")["param"],
        "temperature"
    );
    let r = s
        .post(
            chat,
            &json!({"model": "tiny", "messages": [{"role": "user", "content": 5}]}),
        )
        .await;
    assert_eq!(
        assert_openai_error(&r, 400, "invalid_request_error")["param"],
        "messages[0].content"
    );
    // Invalid sampling values.
    for (k, v) in [
        ("temperature", json!(-1)),
        ("top_p", json!(1.5)),
        ("max_tokens", json!(0)),
        ("n", json!(100)),
        ("presence_penalty", json!(9)),
    ] {
        let mut b = chat_body("hi", 4);
        b[k] = v;
        assert_eq!(
            assert_openai_error(&s.post(chat, &b).await, 400, "invalid_request_error")["param"],
            k
        );
    }
    // Unknown and missing model.
    let mut b = chat_body("hi", 4);
    b["model"] = "gpt-4".into();
    assert_eq!(
        assert_openai_error(&s.post(chat, &b).await, 404, "invalid_request_error")["code"],
        "model_not_found"
    );
    b.as_object_mut().unwrap().remove("model");
    assert_openai_error(&s.post(chat, &b).await, 400, "invalid_request_error");
    let r = s.post("/v1/messages", &json!({"model": "claude", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_anthropic_error(&r, 404, "not_found_error");
    // Anthropic: max_tokens required, temperature in [0, 1].
    let r = s
        .post(
            "/v1/messages",
            &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_anthropic_error(&r, 400, "invalid_request_error");
    let r = s.post("/v1/messages", &json!({"model": "tiny", "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_anthropic_error(&r, 400, "invalid_request_error");
    // Prompt longer than the context (64).
    let long = "hello world ".repeat(100);
    let e = assert_openai_error(
        &s.post(chat, &chat_body(&long, 4)).await,
        400,
        "invalid_request_error",
    );
    assert_eq!(e["code"], "context_length_exceeded");
    let r = s
        .post("/v1/completions", &json!({"model": "tiny", "prompt": long}))
        .await;
    assert_openai_error(&r, 400, "invalid_request_error");
    let r = s.post("/v1/messages", &json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": long}]})).await;
    assert_anthropic_error(&r, 400, "invalid_request_error");
    // Token ids outside the vocabulary.
    let r = s
        .post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": [1, 99999]}),
        )
        .await;
    assert_openai_error(&r, 400, "invalid_request_error");
    // Body too large.
    let big = json!({"model": "tiny", "messages": [{"role": "user", "content": "x".repeat(4000)}]});
    let e = assert_openai_error(&s.post(chat, &big).await, 413, "invalid_request_error");
    assert_eq!(e["code"], "request_too_large");
    assert_anthropic_error(
        &s.post("/v1/messages", &big).await,
        413,
        "request_too_large",
    );
    // Unknown route, wrong method.
    assert_openai_error(&s.get("/v1/nothing").await, 404, "invalid_request_error");
    assert_eq!(s.get(chat).await.status, 405);
    // None of this disturbed the server.
    let r = s.post(chat, &chat_body("hi", 4)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let s2 = &s;
    assert!(
        wait_until(Duration::from_secs(10), || async move {
            s2.metric("kapitsa_slots_used").await == 0.0
        })
        .await
    );
}

/// By default any model name is served; aliases are listed; `HEAD /` and `GET /` answer 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_names() {
    let (loaded, mut served) = load_tiny(&tiny(), None);
    served.aliases = vec!["claude-opus-4-8".into(), "gpt-5".into(), "tiny".into()];
    let engine = EngineHandle::start(loaded.model.clone(), served.tokenizer.clone(), engine_cfg())
        .expect("engine");
    let s = TestServer::start(Arc::new(engine), served, cfg()).await;
    let r = s.get("/v1/models").await;
    assert_eq!(r.status, 200);
    let ids: Vec<String> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["tiny", "claude-opus-4-8", "gpt-5"]);
    let mut b = chat_body("hi", 2);
    b["model"] = "some-other-model".into();
    assert_eq!(s.post("/v1/chat/completions", &b).await.status, 200);
    let r = s.post("/v1/messages", &json!({"model": "claude-haiku-4-5", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.req("HEAD", "/", &[], b"").await.status, 200);
    assert_eq!(s.get("/").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key() {
    let mut c = cfg();
    c.api_key = Some("sekret".into());
    let s = start(engine_cfg(), c).await;
    let body = chat_body("hi", 2).to_string();
    let chat = "/v1/chat/completions";
    let r = s.req("POST", chat, &[], body.as_bytes()).await;
    assert_eq!(
        assert_openai_error(&r, 401, "invalid_request_error")["code"],
        "invalid_api_key"
    );
    let r = s
        .req(
            "POST",
            chat,
            &[("Authorization", "Bearer wrong")],
            body.as_bytes(),
        )
        .await;
    assert_eq!(r.status, 401);
    let r = s
        .req(
            "POST",
            chat,
            &[("Authorization", "Bearer sekret")],
            body.as_bytes(),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = s
        .req("POST", chat, &[("x-api-key", "sekret")], body.as_bytes())
        .await;
    assert_eq!(r.status, 200);
    let mb =
        json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    let r = s
        .req(
            "POST",
            "/v1/messages",
            &[("x-api-key", "nope")],
            mb.as_bytes(),
        )
        .await;
    assert_anthropic_error(&r, 401, "authentication_error");
    let r = s
        .req(
            "POST",
            "/v1/messages",
            &[("x-api-key", "sekret")],
            mb.as_bytes(),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(s.req("GET", "/v1/models", &[], b"").await.status, 401);
    assert_eq!(s.get("/health").await.status, 200);
    assert_eq!(s.get("/metrics").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_match_a_solo_run() {
    let s = default_server().await;
    let solo = s
        .post("/v1/chat/completions", &chat_body("Tell me a story.", 20))
        .await
        .json();
    let want = solo["choices"][0]["message"]["content"].clone();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let addr = s.addr;
        tasks.push(tokio::spawn(async move {
            let body = match i % 3 {
                0 | 1 => chat_body("Tell me a story.", 20),
                // A bad request in the middle of the others.
                _ => json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 7}),
            };
            let mut body = body;
            if i % 3 == 1 {
                body["stream"] = true.into();
            }
            (i, common::request(addr, "POST", "/v1/chat/completions", &[], body.to_string().as_bytes()).await)
        }));
    }
    for t in tasks {
        let (i, r) = t.await.unwrap();
        match i % 3 {
            0 => {
                assert_eq!(r.status, 200);
                assert_eq!(r.json()["choices"][0]["message"]["content"], want);
            }
            1 => assert_eq!(Value::from(stream_content(&r).0), want, "{}", r.text()),
            _ => assert_eq!(r.status, 400),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_full_is_429() {
    let mut e = engine_cfg();
    e.max_running = 1;
    e.max_queue = 1;
    e.n_ctx = 2048;
    let s = start(e, cfg()).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let addr = s.addr;
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": true, "temperature": 0});
            common::request(addr, "POST", "/v1/completions", &[], body.to_string().as_bytes()).await
        }));
    }
    let (mut ok, mut full) = (0, 0);
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            200 => ok += 1,
            429 => {
                assert_openai_error(&r, 429, "rate_limit_error");
                full += 1;
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert!(ok >= 1 && full >= 1, "ok {ok}, 429 {full}");
    assert!(s.get("/metrics").await.text().contains("status=\"429\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnecting_client_frees_the_slot() {
    // A long reply (2000 tokens take about a second even in a release build), so the client
    // is gone well before it could finish.
    let mut e = engine_cfg();
    e.n_ctx = 2048;
    let s = start(e, cfg()).await;
    let body = json!({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut sock = send_request(
        s.addr,
        "POST",
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
    )
    .await;
    let mut buf = vec![0u8; 1024];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data:") {
        let n = sock.read(&mut buf).await.unwrap();
        assert!(n > 0, "connection closed early");
        got.extend_from_slice(&buf[..n]);
    }
    drop(sock);
    let s2 = &s;
    let freed = wait_until(Duration::from_secs(20), || async move {
        s2.metric("kapitsa_slots_used").await == 0.0
            && s2.metric("kapitsa_streams_active").await == 0.0
    })
    .await;
    assert!(freed, "{}", s.get("/metrics").await.text());
    assert_eq!(
        s.metric("kapitsa_engine_requests_cancelled_total").await,
        1.0
    );
    assert!(s.metric("kapitsa_generation_tokens_total").await < 2000.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown() {
    let mut s = default_server().await;
    let addr = s.addr;
    let body = json!({"model": "tiny", "prompt": "Once", "max_tokens": 200, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut sock = send_request(
        addr,
        "POST",
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
    )
    .await;
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains("data:") {
        let n = sock.read(&mut buf).await.unwrap();
        assert!(n > 0);
        raw.extend_from_slice(&buf[..n]);
    }
    s.begin_shutdown();
    // The stream in flight runs to its end.
    loop {
        let n = sock.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
    }
    let r = common::parse_response(&raw);
    assert_eq!(r.sse().last().unwrap().1, "[DONE]");
    let last = &r.sse_json()[r.sse_json().len() - 1];
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    s.shutdown(Duration::from_secs(20)).await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting"
    );
}

/// `/v1/embeddings` and Ollama's `/api/embed` on the real engine: unit vectors of the model's
/// width, the same alone as in a batch, base64 the same floats, `dimensions` truncating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings() {
    let s = default_server().await;
    let one = |v: &Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let r = s
        .post(
            "/v1/embeddings",
            &json!({"model": "tiny", "input": ["fn main() {}", "hello world"]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    let e0 = one(&data[0]["embedding"]);
    assert_eq!(e0.len(), 64, "the tiny model's width");
    let norm: f32 = e0.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    let alone = s
        .post(
            "/v1/embeddings",
            &json!({"model": "tiny", "input": "fn main() {}"}),
        )
        .await
        .json();
    let a0 = one(&alone["data"][0]["embedding"]);
    let diff = e0
        .iter()
        .zip(&a0)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(diff < 1e-5, "batched vs alone: {diff}");
    let b64 = s
        .post(
            "/v1/embeddings",
            &json!({"model": "tiny", "input": "fn main() {}", "encoding_format": "base64"}),
        )
        .await
        .json();
    let text = b64["data"][0]["embedding"].as_str().unwrap();
    assert_eq!(text.len(), 344, "256 bytes in base64");
    assert_eq!(
        text,
        kapitsa_server::embeddings::base64(
            &a0.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()
        )
    );
    let short = s
        .post(
            "/v1/embeddings",
            &json!({"model": "tiny", "input": "fn main() {}", "dimensions": 8}),
        )
        .await
        .json();
    let d8 = one(&short["data"][0]["embedding"]);
    assert_eq!(d8.len(), 8);
    assert!((d8.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-4);
    // Ollama's shape.
    let r = s
        .post(
            "/api/embed",
            &json!({"model": "tiny", "input": "fn main() {}"}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let oe = one(&r.json()["embeddings"][0]);
    let diff = oe
        .iter()
        .zip(&a0)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(diff < 1e-5);
    // Bad input: 400 in each API's shape.
    for (body, param) in [
        (json!({"model": "tiny"}), "input"),
        (json!({"model": "tiny", "input": []}), "input"),
        (json!({"model": "tiny", "input": ""}), "input"),
        (json!({"model": "tiny", "input": [1, 99999]}), "input"),
        (json!({"model": "tiny", "input": [{}]}), "input[0]"),
        (
            json!({"model": "tiny", "input": "x", "encoding_format": "hex"}),
            "encoding_format",
        ),
        (
            json!({"model": "tiny", "input": "x", "dimensions": 65}),
            "dimensions",
        ),
    ] {
        let r = s.post("/v1/embeddings", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{body}");
    }
    let r = s.post("/api/embed", &json!({"model": "tiny"})).await;
    assert_eq!(r.status, 400);
    assert!(r.json()["error"].is_string(), "Ollama's error shape");
}

/// Ollama's API as Open WebUI uses it: version, tags, show, chat and generate (NDJSON
/// streams, one object without streaming), errors as `{"error": "..."}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_api() {
    let s = default_server().await;
    assert!(s.get("/api/version").await.json()["version"].is_string());
    let tags = s.get("/api/tags").await.json();
    assert_eq!(tags["models"][0]["name"], "tiny");
    let show = s.post("/api/show", &json!({"model": "tiny"})).await.json();
    assert_eq!(show["model_info"]["general.architecture"], "qwen2");
    assert_eq!(show["model_info"]["qwen2.context_length"], 512);
    assert!(show["capabilities"]
        .as_array()
        .unwrap()
        .contains(&json!("completion")));

    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "options": {"temperature": 0, "num_predict": 6}});
    let r = s.post("/api/chat", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    let lines: Vec<Value> = r
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(last["done_reason"], "length");
    assert_eq!(last["eval_count"], 6);
    assert!(lines[..lines.len() - 1].iter().all(|l| l["done"] == false));
    let streamed: String = lines
        .iter()
        .map(|l| l["message"]["content"].as_str().unwrap())
        .collect();
    let mut nb = body.clone();
    nb["stream"] = false.into();
    let whole = s.post("/api/chat", &nb).await.json();
    assert_eq!(whole["done"], true);
    assert_eq!(whole["message"]["role"], "assistant");
    assert_eq!(whole["message"]["content"], streamed.as_str());

    let g = json!({"model": "tiny", "prompt": "fn main() {", "raw": true, "stream": false,
        "options": {"temperature": 0, "num_predict": 4}});
    let r = s.post("/api/generate", &g).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["response"].is_string() && v["done"] == true);
    let same = s
        .post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "fn main() {", "max_tokens": 4, "temperature": 0}),
        )
        .await
        .json();
    assert_eq!(v["response"], same["choices"][0]["text"]);
    // `curl -d` (a form content type), as Ollama's own examples send it.
    let r = s
        .req(
            "POST",
            "/api/generate",
            &[("Content-Type", "application/x-www-form-urlencoded")],
            g.to_string().as_bytes(),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Errors: Ollama's shape.
    for (path, body) in [
        ("/api/chat", json!({"model": "tiny"})),
        (
            "/api/chat",
            json!({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}),
        ),
        (
            "/api/chat",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["AA=="]}]}),
        ),
        (
            "/api/chat",
            json!({"model": "tiny", "messages": [], "format": 5}),
        ),
        (
            "/api/generate",
            json!({"model": "tiny", "prompt": "x", "options": {"temperature": "hot"}}),
        ),
        (
            "/api/generate",
            json!({"model": "tiny", "prompt": "x", "suffix": "y"}),
        ),
    ] {
        let r = s.post(path, &body).await;
        assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
        assert!(r.json()["error"].is_string(), "{path} {body}: {}", r.text());
    }
}
