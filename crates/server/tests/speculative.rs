//! Speculative decoding through the HTTP APIs on the tiny Qwen2 fixture: 16 concurrent chat
//! requests (streaming and not, prefix cache on) give the text of plain decoding; the
//! `speculative` extension field turns it on or off per request on the OpenAI and Anthropic
//! endpoints; bad values are 400s; /metrics counts proposals per proposer.

mod common;

use std::sync::Arc;

use common::{cfg, load_tiny, tiny, TestServer};
use kapitsa_engine::{EngineConfig, EngineHandle, SpecConfig, SpecMode};
use kapitsa_models::KvType;
use serde_json::{json, Value};

async fn start(spec: SpecConfig) -> TestServer {
    let (loaded, served) = load_tiny(&tiny(), None);
    let ecfg = EngineConfig {
        max_running: 16,
        max_batch_tokens: 128,
        n_ctx: 512,
        max_queue: 32,
        kv_type: KvType::F32,
        spec,
        ..EngineConfig::default()
    };
    let engine =
        EngineHandle::start(loaded.model.clone(), served.tokenizer.clone(), ecfg).expect("engine");
    TestServer::start(Arc::new(engine), served, cfg()).await
}

/// A prompt that repeats itself, so the n-gram proposer finds matches.
fn body(i: usize, stream: bool) -> Value {
    let line = format!("item {i}: alpha beta gamma delta; ");
    json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": line.repeat(3 + i % 4)}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": stream,
    })
}

fn content(r: &common::Resp, stream: bool) -> String {
    assert_eq!(r.status, 200, "{}", r.text());
    if stream {
        r.sse_json()
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .map(|ch| ch["delta"]["content"].as_str().unwrap_or("").to_string())
            .collect()
    } else {
        r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    }
}

async fn run_all(s: &TestServer) -> Vec<String> {
    let mut tasks = Vec::new();
    for i in 0..16 {
        let addr = s.addr;
        tasks.push(tokio::spawn(async move {
            let b = body(i, i % 2 == 1);
            let r = common::request(
                addr,
                "POST",
                "/v1/chat/completions",
                &[],
                b.to_string().as_bytes(),
            )
            .await;
            content(&r, i % 2 == 1)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_gives_the_plain_text_over_http() {
    let plain = start(SpecConfig::default()).await;
    let want = run_all(&plain).await;
    let spec = start(SpecConfig {
        mode: SpecMode::Ngram,
        max_draft: 6,
        ..SpecConfig::default()
    })
    .await;
    for round in 0..2 {
        assert_eq!(run_all(&spec).await, want, "round {round}");
    }
    assert!(spec.metric("kapitsa_prefix_cache_hits_total").await > 0.0);
    let m = spec.get("/metrics").await.text();
    let rounds: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("kapitsa_spec_rounds_total{proposer=\"ngram\"} "))
        .expect("ngram rounds in /metrics")
        .parse()
        .unwrap();
    assert!(rounds > 0.0, "{m}");
    assert!(m.contains("kapitsa_spec_accepted_tokens_total{proposer=\"draft\"} 0"));

    // Per request, on a server without speculation: on (string or object), same text.
    let mut b = body(3, false);
    b["speculative"] = "ngram".into();
    assert_eq!(
        content(&plain.post("/v1/chat/completions", &b).await, false),
        want[3]
    );
    b["speculative"] = json!({"mode": "ngram", "max_draft": 2});
    assert_eq!(
        content(&plain.post("/v1/chat/completions", &b).await, false),
        want[3]
    );
    let on = plain.get("/metrics").await.text();
    assert!(
        !on.contains("kapitsa_spec_rounds_total{proposer=\"ngram\"} 0"),
        "{on}"
    );
    // off on a speculating server
    let mut b = body(5, false);
    b["speculative"] = "off".into();
    assert_eq!(
        content(&spec.post("/v1/chat/completions", &b).await, false),
        want[5]
    );

    // Anthropic messages take the field too.
    let ab = json!({"model": "tiny", "max_tokens": 12, "temperature": 0, "speculative": "ngram",
        "messages": [{"role": "user", "content": "one two three one two three one two"}]});
    let r = plain.post("/v1/messages", &ab).await;
    assert_eq!(r.status, 200, "{}", r.text());

    // Bad values.
    for bad in [
        json!("eagle"),
        json!(3),
        json!({"mode": "x"}),
        json!({"max_draft": 999}),
        json!("draft"),
        json!("mtp"),
    ] {
        let mut b = body(0, false);
        b["speculative"] = bad.clone();
        let r = plain.post("/v1/chat/completions", &b).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(!msg.is_empty());
        let mut a = ab.clone();
        a["speculative"] = bad.clone();
        assert_eq!(plain.post("/v1/messages", &a).await.status, 400, "{bad}");
    }
}
