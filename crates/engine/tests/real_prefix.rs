//! The prefix cache on the real Qwen2.5-Coder-0.5B/1.5B-Instruct Q4_K_M files: a three-turn
//! chat (turn N+1 = turn N's prompt and answer plus a new user message) and a prompt sharing
//! only part of a block; greedy output with cache hits equals output computed from scratch,
//! also after the blocks were evicted to disk and after a restart.
//!
//! Needs the weights: `KAPITSA_MODELS` must name the folder `scripts/fetch-weights.sh` fills.
//! Without it the test is skipped, except under CI (`CI` set), where it fails.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kapitsa_engine::{
    open_model, EngineConfig, EngineHandle, OpenOptions, PrefixCacheConfig, Request,
};
use kapitsa_models::{CausalLm, KvType};
use kapitsa_text::Tokenizer;

mod common;

const N_CTX: usize = 1024;
const N_GEN: usize = 16;

fn model_path(file: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("KAPITSA_MODELS").map(PathBuf::from);
    let p = dir.map(|d| d.join(file)).filter(|p| p.exists());
    if p.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI: {file} not found under KAPITSA_MODELS"
        );
        eprintln!("skipping: {file} not found (set KAPITSA_MODELS)");
    }
    p
}

/// Prompt ids of the committed llama.cpp fixture (tokenised chat prompts).
fn fixture_ids(model: &str, prompt: &str) -> Vec<u32> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/real")
        .join(format!("{model}.json"));
    let fx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let p = fx["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == prompt)
        .unwrap_or_else(|| panic!("no prompt {prompt}"));
    p["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn request(p: &[u32]) -> Request {
    let mut r = Request::greedy(p.to_vec(), N_GEN);
    r.ignore_eos = true;
    r
}

/// Greedy tokens of `p` computed from scratch (a one-slot engine without prefix cache).
fn scratch(model: &Arc<dyn CausalLm>, tok: &Arc<Tokenizer>, p: &[u32]) -> Vec<u32> {
    common::solo(model, tok, &request(p), N_CTX, 512, KvType::F16).tokens
}

fn run(h: &EngineHandle, p: &[u32]) -> (Vec<u32>, usize) {
    common::run_request(h, request(p))
}

fn check(name: &str, file: &str) {
    let Some(path) = model_path(file) else { return };
    let m = open_model(&path, &OpenOptions::default()).unwrap();
    let (model, tok) = (m.model.clone(), m.tokenizer.clone());
    let dir =
        std::env::temp_dir().join(format!("kapitsa-real-prefix-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let start = |pool: Option<usize>| {
        EngineHandle::start(
            model.clone(),
            tok.clone(),
            EngineConfig {
                max_running: 2,
                max_batch_tokens: 512,
                n_ctx: N_CTX,
                kv_pool_tokens: pool,
                prefix_cache: Some(PrefixCacheConfig {
                    model_id: m.identity.clone(),
                    disk: Some((dir.clone(), 1 << 30)),
                    ..PrefixCacheConfig::default()
                }),
                ..EngineConfig::default()
            },
        )
        .unwrap()
    };

    // Three turns of a chat: each prompt is the previous prompt, its answer and a new
    // message (here: the ids of other fixture prompts).
    let mut turns = vec![fixture_ids(name, "chat_multiturn")];
    let h = start(None);
    let mut answers = Vec::new();
    for t in 0..3 {
        let p = turns[t].clone();
        let (got, cached) = run(&h, &p);
        let want = scratch(&model, &tok, &p);
        assert_eq!(got, want, "{name}: turn {t}");
        if t > 0 {
            let prev = turns[t - 1].len() + N_GEN - 1;
            assert_eq!(
                cached, prev,
                "{name}: turn {t} reuses the previous exchange"
            );
        }
        println!(
            "{name}: turn {t}: {} prompt tokens, {cached} cached",
            p.len()
        );
        let mut next = p.clone();
        next.extend(&got);
        next.extend(fixture_ids(
            name,
            ["chat_sql", "chat_bugfix", "code_rust"][t],
        ));
        turns.push(next);
        answers.push(got);
    }
    // Divergence inside a block: the first turn's prompt up to 37 tokens, then other tokens.
    let mut p = turns[0][..37].to_vec();
    p.extend(fixture_ids(name, "code_c"));
    let (got, cached) = run(&h, &p);
    assert_eq!(cached, 37, "{name}: hit inside a block");
    assert_eq!(
        got,
        scratch(&model, &tok, &p),
        "{name}: divergence inside a block"
    );
    h.shutdown();

    // After a restart (the shutdown wrote the cache to disk), with a pool of one context so
    // blocks also cycle between disk and memory.
    let h = start(Some(N_CTX));
    let (got, cached) = run(&h, &turns[3]);
    assert_eq!(
        cached,
        turns[2].len() + N_GEN - 1,
        "{name}: hit after a restart"
    );
    assert_eq!(
        got,
        scratch(&model, &tok, &turns[3]),
        "{name}: after a restart"
    );
    let m = h.metrics();
    assert!(m.prefix.disk_loads > 0, "{name}: {m:?}");
    h.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn qwen2_5_coder_0_5b_prefix_cache_hits_equal_scratch() {
    check(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    );
}

#[test]
fn qwen2_5_coder_1_5b_prefix_cache_hits_equal_scratch() {
    check(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    );
}
