//! Constrained decoding through the engine service on the tiny random-weight fixtures
//! (tests/fixtures/tiny): whatever a random model samples, the output under a JSON schema
//! parses and validates; logprobs are those of the constrained distribution; bad schemas are
//! refused at submission; unconstrained requests batched with constrained ones are unchanged.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kapitsa_backend::Backend;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_base::pool::RayonPool;
use kapitsa_engine::loader::tokenizer_for;
use kapitsa_engine::{
    Constraint, EngineConfig, EngineHandle, Event, FinishReason, Request, RequestStream,
    SamplingParams, StructuredEnv, SubmitError, TokenLogprob,
};
use kapitsa_models::{load_model, CausalLm, KvType, LoadOptions};
use kapitsa_text::Tokenizer;
use serde_json::{json, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

fn load(name: &str) -> (Arc<dyn CausalLm>, Arc<Tokenizer>) {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(Box::new(
        RayonPool::new(2).expect("thread pool"),
    )));
    let m = load_model(&fixtures().join(name), backend, &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let tok = tokenizer_for(&m.source).unwrap();
    (m.model, Arc::new(tok))
}

fn start(model: Arc<dyn CausalLm>, tok: Arc<Tokenizer>) -> EngineHandle {
    // `..default()`: settings added later keep their defaults here.
    #[allow(clippy::needless_update)]
    let cfg = EngineConfig {
        max_running: 4,
        max_batch_tokens: 64,
        n_ctx: 512,
        max_queue: 16,
        kv_type: KvType::F32,
        ..EngineConfig::default()
    };
    EngineHandle::start(model, tok, cfg).unwrap()
}

/// What a stream delivered.
#[derive(Debug)]
struct Out {
    text: String,
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    finish: Result<FinishReason, String>,
}

fn collect(mut s: RequestStream) -> Out {
    let mut o = Out {
        text: String::new(),
        tokens: Vec::new(),
        logprobs: Vec::new(),
        finish: Err("stream closed".into()),
    };
    while let Some(ev) = s.blocking_recv() {
        match ev {
            Event::Text {
                text,
                tokens,
                logprobs,
            } => {
                o.text.push_str(&text);
                o.tokens.extend(tokens);
                o.logprobs.extend(logprobs);
            }
            Event::Done { finish, .. } => o.finish = Ok(finish),
            Event::Error(m) => o.finish = Err(m),
            Event::Admitted { .. } => {}
        }
    }
    o
}

/// Tokens of a prompt: deterministic, outside the special ids (397..400).
fn prompt(len: usize, seed: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(1103515245).wrapping_add(12345);
            (x >> 16) % 397
        })
        .collect()
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        ..SamplingParams::default()
    }
}

/// A schema whose every valid instance is short, so a random model always finishes it.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "color", "ok"],
        "additionalProperties": false
    })
}

/// A minimal JSON-schema validator for the keywords the tests use: `type`, `enum`,
/// `properties`, `required`, `additionalProperties: false`, `items`, `minItems`/`maxItems`,
/// `minLength`/`maxLength` (in characters), `minimum`/`maximum`.
fn validate(schema: &Value, v: &Value, path: &str) -> Result<(), String> {
    let err = |m: String| Err(format!("{path}: {m} (value {v})"));
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            return err("not in enum".into());
        }
    }
    if let Some(t) = schema.get("type").and_then(Value::as_str) {
        let ok = match t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            // JSON schema: a number with no fractional part (`-0`, `1.0` included).
            "integer" => v.as_f64().is_some_and(|x| x.fract() == 0.0),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            other => return err(format!("validator does not know type {other}")),
        };
        if !ok {
            return err(format!("not of type {t}"));
        }
    }
    if let Some(s) = v.as_str() {
        let n = s.chars().count() as u64;
        if schema
            .get("minLength")
            .and_then(Value::as_u64)
            .is_some_and(|m| n < m)
        {
            return err("too short".into());
        }
        if schema
            .get("maxLength")
            .and_then(Value::as_u64)
            .is_some_and(|m| n > m)
        {
            return err("too long".into());
        }
    }
    if let Some(x) = v.as_f64() {
        if schema
            .get("minimum")
            .and_then(Value::as_f64)
            .is_some_and(|m| x < m)
        {
            return err("below minimum".into());
        }
        if schema
            .get("maximum")
            .and_then(Value::as_f64)
            .is_some_and(|m| x > m)
        {
            return err("above maximum".into());
        }
    }
    if let Some(a) = v.as_array() {
        let n = a.len() as u64;
        if schema
            .get("minItems")
            .and_then(Value::as_u64)
            .is_some_and(|m| n < m)
        {
            return err("too few items".into());
        }
        if schema
            .get("maxItems")
            .and_then(Value::as_u64)
            .is_some_and(|m| n > m)
        {
            return err("too many items".into());
        }
        if let Some(items) = schema.get("items") {
            for (i, x) in a.iter().enumerate() {
                validate(items, x, &format!("{path}[{i}]"))?;
            }
        }
    }
    if let Some(o) = v.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        for r in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let r = r.as_str().unwrap_or_default();
            if !o.contains_key(r) {
                return err(format!("missing required property {r}"));
            }
        }
        for (k, x) in o {
            match props.and_then(|p| p.get(k)) {
                Some(s) => validate(s, x, &format!("{path}.{k}"))?,
                None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return err(format!("additional property {k}"))
                }
                None => {}
            }
        }
    }
    Ok(())
}

#[test]
fn validator_rejects_what_it_should() {
    let s = person_schema();
    let good = json!({"name": "ab", "age": 3, "color": "red", "ok": true, "tags": ["x"]});
    validate(&s, &good, "$").unwrap();
    for bad in [
        json!({"name": "", "age": 3, "color": "red", "ok": true}),
        json!({"name": "abcdefg", "age": 3, "color": "red", "ok": true}),
        json!({"name": "a", "age": 121, "color": "red", "ok": true}),
        json!({"name": "a", "age": 1.5, "color": "red", "ok": true}),
        json!({"name": "a", "age": 1, "color": "pink", "ok": true}),
        json!({"name": "a", "age": 1, "color": "red"}),
        json!({"name": "a", "age": 1, "color": "red", "ok": true, "x": 1}),
        json!({"name": "a", "age": 1, "color": "red", "ok": true, "tags": ["a", "b", "c"]}),
        json!({"name": "a", "age": 1, "color": "red", "ok": true, "tags": ["abcd"]}),
        json!([1]),
    ] {
        assert!(validate(&s, &bad, "$").is_err(), "{bad}");
    }
}

#[test]
fn random_model_output_always_validates() {
    for fixture in ["qwen2-a", "qwen3-b"] {
        let (model, tok) = load(fixture);
        let h = start(model, tok);
        let schema = person_schema();
        let streams: Vec<_> = (0..12u64)
            .map(|seed| {
                let mut r = Request::greedy(prompt(12, seed as u32), 400);
                r.sampling = sampled(seed);
                r.constraint = Some(Constraint::JsonSchema(schema.clone()));
                h.submit(r).unwrap()
            })
            .collect();
        for (seed, s) in streams.into_iter().enumerate() {
            let o = collect(s);
            assert_eq!(
                o.finish,
                Ok(FinishReason::EndOfGeneration),
                "{fixture} seed {seed}: {:?}",
                o.text
            );
            let v: Value = serde_json::from_str(&o.text)
                .unwrap_or_else(|e| panic!("{fixture} seed {seed}: {:?}: {e}", o.text));
            validate(&schema, &v, "$").unwrap_or_else(|e| panic!("{fixture} seed {seed}: {e}"));
        }
        // Greedy too (a random model's argmax is its own kind of adversary).
        let mut r = Request::greedy(prompt(20, 99), 400);
        r.constraint = Some(Constraint::JsonSchema(schema.clone()));
        let o = collect(h.submit(r).unwrap());
        assert_eq!(o.finish, Ok(FinishReason::EndOfGeneration), "{:?}", o.text);
        let v: Value = serde_json::from_str(&o.text).unwrap();
        validate(&schema, &v, "$").unwrap();
        h.shutdown();
    }
}

#[test]
fn json_object_and_lark() {
    let (model, tok) = load("qwen2-a");
    let h = start(model, tok);
    let mut finished = 0;
    for seed in 0..6u64 {
        let mut r = Request::greedy(prompt(8, seed as u32 + 40), 300);
        r.sampling = sampled(seed);
        r.constraint = Some(Constraint::JsonObject);
        let o = collect(h.submit(r).unwrap());
        match o.finish {
            // A free-form object may not end within the budget; what exists must still be
            // the start of an object.
            Ok(FinishReason::Length) => {
                assert!(o.text.trim_start().starts_with('{'), "{:?}", o.text)
            }
            Ok(FinishReason::EndOfGeneration) => {
                finished += 1;
                let v: Value = serde_json::from_str(&o.text)
                    .unwrap_or_else(|e| panic!("seed {seed}: {:?}: {e}", o.text));
                assert!(v.is_object(), "{v}");
            }
            other => panic!("seed {seed}: {other:?}"),
        }
    }
    assert!(finished > 0, "no json_object reply finished");
    let mut r = Request::greedy(prompt(8, 7), 50);
    r.sampling = sampled(3);
    r.constraint = Some(Constraint::Lark(
        r#"start: "answer: " ("yes" | "no") "."  "#.into(),
    ));
    let o = collect(h.submit(r).unwrap());
    assert_eq!(o.finish, Ok(FinishReason::EndOfGeneration));
    assert!(
        o.text == "answer: yes." || o.text == "answer: no.",
        "{:?}",
        o.text
    );
}

#[test]
fn logprobs_are_of_the_constrained_distribution() {
    let (model, tok) = load("qwen2-a");
    let h = start(model, tok.clone());
    let mut r = Request::greedy(prompt(10, 5), 400);
    r.sampling = sampled(21);
    r.top_logprobs = Some(20);
    r.constraint = Some(Constraint::JsonSchema(person_schema()));
    let o = collect(h.submit(r).unwrap());
    assert_eq!(o.finish, Ok(FinishReason::EndOfGeneration), "{:?}", o.text);
    assert_eq!(o.logprobs.len(), o.tokens.len());
    // The first token must open the object (or be whitespace): every alternative reported
    // is one the grammar allows, and they are a distribution over the allowed tokens only.
    let first = &o.logprobs[0];
    assert!(!first.top.is_empty());
    for &(id, lp) in &first.top {
        let b = tok.token_bytes_ref(id).unwrap();
        assert!(b[0] == b'{' || b[0].is_ascii_whitespace(), "{b:?}");
        assert!(lp.is_finite() && lp <= 0.0);
    }
    for l in &o.logprobs {
        assert!(l.logprob.is_finite(), "{l:?}");
        let mass: f64 = l.top.iter().map(|t| (t.1 as f64).exp()).sum();
        assert!(mass <= 1.0 + 1e-4, "{mass}");
    }
    // At the enum value, the alternatives can only continue "red", "green" or "blue".
    let forced = o.logprobs.iter().filter(|l| l.top.len() == 1).count();
    assert!(forced > 0, "no position had a single allowed token");
    for l in o.logprobs.iter().filter(|l| l.top.len() == 1) {
        // The only allowed token has all the mass.
        assert!(l.logprob.abs() < 1e-4, "{l:?}");
    }
}

#[test]
fn bad_constraints_are_refused_at_submit() {
    let (model, tok) = load("qwen2-a");
    let h = start(model, tok);
    for c in [
        Constraint::JsonSchema(json!({"type": "no-such-type"})),
        Constraint::JsonSchema(json!({"properties": {"a": {"$ref": "#/$defs/nowhere"}}})),
        Constraint::JsonSchema(json!(true)),
        Constraint::Lark("start: ((".into()),
    ] {
        let mut r = Request::greedy(prompt(5, 1), 5);
        r.constraint = Some(c.clone());
        match h.submit(r) {
            Err(SubmitError::InvalidConstraint(m)) => assert!(!m.is_empty()),
            other => panic!("{c:?}: {other:?}"),
        }
    }
    // The engine is unaffected.
    let o = collect(h.submit(Request::greedy(prompt(5, 1), 3)).unwrap());
    assert!(o.finish.is_ok());
}

#[test]
fn unconstrained_requests_are_unchanged_next_to_constrained_ones() {
    let (model, tok) = load("qwen2-a");
    let h = start(model, tok);
    let plain = |seed: u32| {
        let mut r = Request::greedy(prompt(16, seed), 30);
        r.sampling = sampled(seed as u64);
        r.top_logprobs = Some(3);
        r
    };
    let alone: Vec<Out> = (0..2)
        .map(|i| collect(h.submit(plain(i)).unwrap()))
        .collect();
    let mut streams = Vec::new();
    for i in 0..2 {
        let mut c = plain(i + 100);
        c.max_tokens = 400;
        c.constraint = Some(Constraint::JsonSchema(person_schema()));
        c.ignore_eos = true;
        streams.push((None, h.submit(c).unwrap()));
        streams.push((Some(i as usize), h.submit(plain(i)).unwrap()));
    }
    for (which, s) in streams {
        let o = collect(s);
        match which {
            Some(i) => {
                assert_eq!(o.tokens, alone[i].tokens);
                // Same alternatives; values equal up to float rounding (a batch of another
                // size may sum in another order).
                for (a, b) in o.logprobs.iter().zip(&alone[i].logprobs) {
                    assert_eq!(a.id, b.id);
                    assert!((a.logprob - b.logprob).abs() < 1e-4, "{a:?} {b:?}");
                    let ids = |l: &TokenLogprob| l.top.iter().map(|t| t.0).collect::<Vec<_>>();
                    assert_eq!(ids(a), ids(b));
                }
            }
            // `ignore_eos` does not keep a constrained request going past its grammar.
            None => {
                assert_eq!(o.finish, Ok(FinishReason::EndOfGeneration), "{:?}", o.text);
                let v: Value = serde_json::from_str(&o.text).unwrap();
                validate(&person_schema(), &v, "$").unwrap();
            }
        }
    }
}

/// The trie build and per-token mask cost on the real Qwen2.5 vocabulary (151k tokens,
/// n_vocab 151936). Needs `KAPITSA_MODELS` (skipped without it, failing under CI).
#[test]
fn qwen_vocab_timings() {
    let dir = std::env::var_os("KAPITSA_MODELS").map(PathBuf::from);
    let p = dir
        .map(|d| d.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
        .filter(|p| p.exists());
    let Some(p) = p else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI: the 0.5B model is missing"
        );
        eprintln!("skipping: set KAPITSA_MODELS");
        return;
    };
    let g = kapitsa_formats::GgufFile::open(&p).unwrap();
    let tok = Arc::new(
        Tokenizer::from_gguf_vocab(&kapitsa_engine::loader::gguf_vocab(&g).unwrap()).unwrap(),
    );
    let n_vocab = 151_936;
    // The GGUF pads the vocabulary itself with 271 unused `[PAD...]` entries (no bytes).
    let padding: Vec<usize> = (0..n_vocab)
        .filter(|&i| tok.token_bytes_ref(i as u32).is_none_or(<[u8]>::is_empty))
        .collect();
    assert!(padding.len() >= 271, "{}", padding.len());
    let env = StructuredEnv::new(tok.clone(), n_vocab).unwrap();
    eprintln!(
        "structured env for {} tokens (n_vocab {n_vocab}): {:.3} s",
        tok.vocab_size(),
        env.build_time().as_secs_f64()
    );
    // Drive the schema with a fixed valid text, timing compile, mask and consume.
    let t0 = Instant::now();
    let mut m = env
        .compile(&Constraint::JsonSchema(person_schema()))
        .unwrap();
    let compile = t0.elapsed();
    let text = r#"{"name": "Ada", "age": 36, "color": "green", "tags": ["x", "yz"], "ok": true}"#;
    let ids = tok.encode(text, false, false).unwrap();
    let mut logits = vec![0.0f32; n_vocab];
    let mut mask_secs = Vec::new();
    for &t in &ids {
        logits.fill(0.0);
        let t1 = Instant::now();
        m.allowed_mask(&mut logits).unwrap();
        mask_secs.push(t1.elapsed().as_secs_f64());
        assert_eq!(
            logits[t as usize], 0.0,
            "token {t} of a valid text is masked"
        );
        assert!(padding.iter().all(|&i| logits[i] == f32::NEG_INFINITY));
        m.consume(t).unwrap();
    }
    logits.fill(0.0);
    m.allowed_mask(&mut logits).unwrap();
    for &e in env.eos_ids() {
        assert_eq!(logits[e as usize], 0.0);
    }
    mask_secs.sort_by(f64::total_cmp);
    let mean = mask_secs.iter().sum::<f64>() / mask_secs.len() as f64;
    eprintln!(
        "compile {:.2} ms; mask+apply per token over {} tokens: mean {:.3} ms, median {:.3} ms, max {:.3} ms",
        compile.as_secs_f64() * 1e3,
        mask_secs.len(),
        mean * 1e3,
        mask_secs[mask_secs.len() / 2] * 1e3,
        mask_secs[mask_secs.len() - 1] * 1e3
    );
}
