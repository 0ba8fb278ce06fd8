//! The prefix cache on the tiny fixtures (an attention-only Qwen2, the hybrid Qwen3.5 MoE with
//! Gated DeltaNet layers, the hybrid Nemotron-H with Mamba2 layers): greedy output with a cache
//! hit equals output computed from scratch, for hits inside a block, exactly at a checkpoint,
//! between checkpoints, after eviction to disk, after a restart, and with damaged or foreign
//! cache files; and the cache gives every block back.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kapitsa_engine::{
    EngineConfig, EngineHandle, EngineMetrics, Event, PrefixCacheConfig, Request,
};
use kapitsa_models::{CausalLm, KvType};
use kapitsa_text::Tokenizer;

mod common;

const N_CTX: usize = 512;
const N_GEN: usize = 12;

fn load(name: &str) -> (Arc<dyn CausalLm>, Arc<Tokenizer>) {
    common::load_tiny(name)
}

/// Deterministic prompt tokens outside the fixtures' special ids.
fn prompt(len: usize, seed: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(777);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(1103515245).wrapping_add(12345);
            (x >> 16) % 397
        })
        .collect()
}

fn request(p: &[u32]) -> Request {
    let mut r = Request::greedy(p.to_vec(), N_GEN);
    r.ignore_eos = true;
    r
}

/// Greedy tokens of `p` computed from scratch (a one-slot engine without prefix cache).
fn scratch(model: &Arc<dyn CausalLm>, tok: &Arc<Tokenizer>, p: &[u32]) -> Vec<u32> {
    common::solo(model, tok, &request(p), N_CTX, 32, KvType::F32).tokens
}

/// Run `p` on the engine: (generated tokens, cached prompt tokens).
fn run(h: &EngineHandle, p: &[u32]) -> (Vec<u32>, usize) {
    common::run_request(h, request(p))
}

fn engine(
    model: &Arc<dyn CausalLm>,
    tok: &Arc<Tokenizer>,
    pool: Option<usize>,
    prefix: PrefixCacheConfig,
) -> EngineHandle {
    EngineHandle::start(
        model.clone(),
        tok.clone(),
        EngineConfig {
            max_running: 2,
            max_batch_tokens: 32,
            n_ctx: N_CTX,
            kv_type: KvType::F32,
            kv_pool_tokens: pool,
            prefix_cache: Some(prefix),
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn idle(h: &EngineHandle) -> EngineMetrics {
    let t0 = Instant::now();
    loop {
        let m = h.metrics();
        if m.running == 0 && m.queued == 0 && m.cache_blocks_used == 0 {
            return m;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "not idle: {m:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn prefix_cfg(model_id: &str, disk: Option<PathBuf>) -> PrefixCacheConfig {
    PrefixCacheConfig {
        model_id: model_id.into(),
        checkpoint_every: 24,
        disk: disk.map(|d| (d, 64 << 20)),
        ..PrefixCacheConfig::default()
    }
}

/// The multi-turn scenarios in memory.
fn check_hits(name: &str) {
    let (model, tok) = load(name);
    let recurrent = model.spec().n_recurrent_layers() > 0;
    let h = engine(&model, &tok, None, prefix_cfg(name, None));
    let p1 = prompt(70, 1);
    let (out1, c1) = run(&h, &p1);
    assert_eq!(c1, 0);
    assert_eq!(out1, scratch(&model, &tok, &p1), "{name}: first turn");

    // Next turn: the whole previous exchange plus new tokens. Everything computed before is
    // reused (the last generated token was never run through the model): a hit exactly at
    // the end-of-generation checkpoint, inside a block (81 = 5 * 16 + 1).
    let mut p2 = p1.clone();
    p2.extend(&out1);
    p2.extend(prompt(20, 2));
    let (out2, c2) = run(&h, &p2);
    assert_eq!(c2, p1.len() + N_GEN - 1, "{name}: turn 2 cached");
    assert_eq!(out2, scratch(&model, &tok, &p2), "{name}: turn 2");

    // The previous prompt plus other tokens: exactly at the prompt-end checkpoint (70,
    // inside a block), which a template that drops the previous answer also hits.
    let mut p3 = p1.clone();
    p3.extend(prompt(10, 3));
    let (out3, c3) = run(&h, &p3);
    assert_eq!(c3, p1.len(), "{name}: turn 3 cached");
    assert_eq!(out3, scratch(&model, &tok, &p3), "{name}: turn 3");

    // A prompt that diverges at 50, inside the fourth block. Attention-only: the 50 matching
    // tokens are reused (the block is shared, then copied before the write at 50). Hybrid:
    // the deepest checkpoint below 50 is at 48 (every 24 tokens: the prefill chunks stop
    // there), between the checkpoints at 48 and 64 (the last block boundary before the
    // prompt end).
    let mut p4 = p1[..50].to_vec();
    p4.extend(prompt(30, 4));
    let (out4, c4) = run(&h, &p4);
    assert_eq!(c4, if recurrent { 48 } else { 50 }, "{name}: turn 4 cached");
    assert_eq!(out4, scratch(&model, &tok, &p4), "{name}: turn 4");

    // The previous prompt with its last token changed (as when the next turn's text
    // re-tokenises the boundary differently). Attention-only: 69 tokens reused. Hybrid: the
    // prompt-end checkpoint is one token too deep, the one at the last block boundary before
    // it (64) is used.
    let mut p5 = p1[..69].to_vec();
    p5.push((p1[69] + 1) % 64 + 5);
    p5.extend(prompt(12, 5));
    let (out5, c5) = run(&h, &p5);
    assert_eq!(c5, if recurrent { 64 } else { 69 }, "{name}: turn 5 cached");
    assert_eq!(out5, scratch(&model, &tok, &p5), "{name}: turn 5");

    let m = idle(&h);
    assert_eq!(m.prefix.lookups, 5);
    assert_eq!(m.prefix.hits, 4);
    assert_eq!(m.prefix.tokens_reused as usize, c2 + c3 + c4 + c5);
    assert!(m.cache_blocks_cached > 0);
    if recurrent {
        assert!(m.prefix.state_bytes > 0);
    }
    h.shutdown();
}

#[test]
fn hits_equal_scratch_qwen2() {
    check_hits("qwen2-a");
}

#[test]
fn hits_equal_scratch_qwen35moe() {
    check_hits("qwen35moe-a");
}

#[test]
fn hits_equal_scratch_nemotronh() {
    check_hits("nemotronh-moe-a");
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kapitsa-prefix-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Files under `dir` (recursively) with the given extension.
fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == ext) {
                out.push(p);
            }
        }
    }
    out
}

/// Eviction to disk under a small pool, a restart, a foreign fingerprint, damaged files.
fn check_disk(name: &str) {
    let (model, tok) = load(name);
    let dir = temp_dir(name);
    let pool = Some(N_CTX); // 32 blocks of 16
    let p1 = prompt(70, 1);
    let out1 = scratch(&model, &tok, &p1);
    let mut p2 = p1.clone();
    p2.extend(&out1);
    p2.extend(prompt(20, 2));
    let want2 = scratch(&model, &tok, &p2);
    let mut p3 = p1.clone();
    p3.extend(prompt(10, 3));
    let want3 = scratch(&model, &tok, &p3);
    {
        let h = engine(&model, &tok, pool, prefix_cfg(name, Some(dir.clone())));
        assert_eq!(run(&h, &p1), (out1.clone(), 0));
        // Unrelated work fills the pool: the first exchange's blocks go to disk.
        for seed in 10..14 {
            let f = prompt(150, seed);
            let (got, _) = run(&h, &f);
            assert_eq!(got, scratch(&model, &tok, &f), "{name}: filler {seed}");
        }
        let m = idle(&h);
        assert!(m.prefix.disk_files > 0, "{name}: nothing spilled: {m:?}");
        let (got2, c2) = run(&h, &p2);
        assert_eq!(
            c2,
            p1.len() + N_GEN - 1,
            "{name}: hit after eviction to disk"
        );
        assert_eq!(got2, want2, "{name}: turn 2 after eviction");
        let m = idle(&h);
        assert!(m.prefix.disk_loads > 0, "{name}: {m:?}");
        h.shutdown();
    }
    {
        // A restart finds the files.
        let h = engine(&model, &tok, pool, prefix_cfg(name, Some(dir.clone())));
        let (got3, c3) = run(&h, &p3);
        assert_eq!(c3, p1.len(), "{name}: hit after a restart");
        assert_eq!(got3, want3, "{name}: turn 3 after a restart");
        assert!(idle(&h).prefix.disk_loads > 0);
        h.shutdown();
    }
    {
        // Another model (or layout) never sees these files.
        let h = engine(
            &model,
            &tok,
            pool,
            prefix_cfg("another-model", Some(dir.clone())),
        );
        assert_eq!(run(&h, &p3), (want3.clone(), 0));
        h.shutdown();
    }
    // Damage every file: flip a byte in the middle, truncate some.
    let all: Vec<PathBuf> = files(&dir, "kv")
        .into_iter()
        .chain(files(&dir, "st"))
        .collect();
    assert!(!all.is_empty());
    for (i, f) in all.iter().enumerate() {
        let mut b = std::fs::read(f).unwrap();
        if i % 3 == 0 {
            b.truncate(b.len() / 2);
        } else {
            let mid = b.len() / 2;
            b[mid] ^= 0x5a;
        }
        std::fs::write(f, b).unwrap();
    }
    {
        let h = engine(&model, &tok, pool, prefix_cfg(name, Some(dir.clone())));
        let (got2, _) = run(&h, &p2);
        assert_eq!(got2, want2, "{name}: damaged files never change the output");
        let m = idle(&h);
        assert!(m.prefix.disk_rejected > 0, "{name}: damage detected: {m:?}");
        h.shutdown();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn disk_tier_and_restart_qwen2() {
    check_disk("qwen2-a");
}

#[test]
fn disk_tier_and_restart_qwen35moe() {
    check_disk("qwen35moe-a");
}

#[test]
fn disk_tier_and_restart_nemotronh() {
    check_disk("nemotronh-moe-a");
}

/// Many concurrent requests sharing prefixes, some cancelled, through a small pool, small
/// snapshot memory and a small disk budget: every output equals scratch, and afterwards no
/// block is held by anyone but the cache, the memory and disk budgets hold, and the files on
/// disk are exactly the ones the cache knows.
fn check_stress(name: &str) {
    let (model, tok) = load(name);
    let dir = temp_dir(&format!("stress-{name}"));
    let disk_budget: u64 = 2 << 20;
    let state_budget = 256 << 10;
    let h = EngineHandle::start(
        model.clone(),
        tok.clone(),
        EngineConfig {
            max_running: 4,
            max_batch_tokens: 48,
            n_ctx: N_CTX,
            kv_type: KvType::F32,
            kv_pool_tokens: Some(N_CTX + 64),
            prefix_cache: Some(PrefixCacheConfig {
                model_id: name.into(),
                state_bytes: state_budget,
                checkpoint_every: 40,
                disk: Some((dir.clone(), disk_budget)),
            }),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let bases: Vec<Vec<u32>> = (0..4)
        .map(|s| prompt(60 + 25 * s as usize, 100 + s))
        .collect();
    let mut reqs = Vec::new();
    for i in 0..40u32 {
        let base = &bases[(i % 4) as usize];
        let keep = (i as usize * 37) % base.len();
        let mut p = base[..keep].to_vec();
        p.extend(prompt(5 + (i as usize * 13) % 60, 500 + i));
        reqs.push(p);
    }
    let mut handles = Vec::new();
    for (i, p) in reqs.iter().enumerate() {
        let s = h.submit(request(p)).unwrap();
        handles.push((i, s));
        if i % 8 == 7 {
            // Wait for this wave, cancelling one of it mid-way.
            for (j, mut s) in handles.drain(..) {
                if j % 8 == 3 {
                    h.cancel(s.id());
                    while s.blocking_recv().is_some() {}
                    continue;
                }
                let mut toks = Vec::new();
                while let Some(ev) = s.blocking_recv() {
                    match ev {
                        Event::Text { tokens, .. } => toks.extend(tokens),
                        Event::Done { .. } => break,
                        Event::Error(e) => panic!("{name} request {j}: {e}"),
                        Event::Admitted { .. } => {}
                    }
                }
                assert_eq!(toks, scratch(&model, &tok, &reqs[j]), "{name}: request {j}");
            }
        }
    }
    let m = idle(&h);
    eprintln!("{name}: {m:?}");
    // One lookup per admission: every finished request was admitted, a cancelled one maybe
    // not, a preempted one once more.
    assert!(m.prefix.lookups >= m.requests_finished);
    assert!(m.prefix.lookups <= m.requests_finished + m.requests_cancelled + m.preemptions);
    assert_eq!(m.prefix.tokens_reused, m.cached_tokens_total);
    assert!(m.prefix.hits >= 5, "{name}: {m:?}");
    assert_eq!(m.cache_blocks_used, 0);
    assert_eq!(
        m.cache_blocks_cached, m.prefix.blocks_in_memory,
        "{name}: every block in use belongs to the cache"
    );
    assert!(m.prefix.state_bytes <= state_budget, "{name}: {m:?}");
    assert!(m.prefix.disk_bytes <= disk_budget, "{name}: {m:?}");
    let on_disk = files(&dir, "kv").len() + files(&dir, "st").len();
    assert_eq!(
        on_disk, m.prefix.disk_files,
        "{name}: files match the index"
    );
    assert_eq!(files(&dir, "tmp").len(), 0);
    h.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stress_budgets_hold_and_nothing_leaks_qwen35moe() {
    check_stress("qwen35moe-a");
}

#[test]
fn stress_budgets_hold_and_nothing_leaks_qwen2() {
    check_stress("qwen2-a");
}

/// Without a prefix cache nothing is reused and every block goes back to the pool.
#[test]
fn without_prefix_cache_nothing_is_reused() {
    let (model, tok) = load("qwen2-a");
    let h = EngineHandle::start(
        model.clone(),
        tok.clone(),
        EngineConfig {
            max_running: 2,
            max_batch_tokens: 32,
            n_ctx: N_CTX,
            kv_type: KvType::F32,
            prefix_cache: None,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let p = prompt(70, 1);
    let want = scratch(&model, &tok, &p);
    assert_eq!(run(&h, &p), (want.clone(), 0));
    assert_eq!(run(&h, &p), (want, 0));
    let m = idle(&h);
    assert_eq!((m.cache_blocks_cached, m.prefix.lookups), (0, 0));
    h.shutdown();
}
