//! The engine service on the tiny real-weight fixtures (tests/fixtures/tiny): concurrent
//! requests give exactly what each gives alone (one slot, no prefix cache), cancellation, queue limits,
//! validation, shutdown with requests in flight, failing batches, and consistent metrics.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kapitsa_backend::Backend;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_base::pool::RayonPool;
use kapitsa_engine::loader::tokenizer_for;
use kapitsa_engine::{
    EngineConfig, EngineHandle, EngineMetrics, Event, FinishReason, Request, RequestStream,
    SamplingParams, SubmitError, Usage,
};
use kapitsa_models::{
    load_model, BatchInputs, CausalLm, KvCache, KvType, LoadOptions, Logits, ModelError, ModelSpec,
};
use kapitsa_text::Tokenizer;

mod common;

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

/// What a stream delivered.
#[derive(Debug, Clone, PartialEq)]
struct Collected {
    text: String,
    tokens: Vec<u32>,
    n_text_events: usize,
    logprobs: Vec<kapitsa_engine::TokenLogprob>,
    end: End,
}

#[derive(Debug, Clone, PartialEq)]
enum End {
    Done(FinishReason, Usage),
    Error(String),
    /// The stream closed without `Done` / `Error` (cancelled).
    Closed,
}

fn collect(mut s: RequestStream) -> Collected {
    let mut c = Collected {
        text: String::new(),
        tokens: Vec::new(),
        n_text_events: 0,
        logprobs: Vec::new(),
        end: End::Closed,
    };
    while let Some(ev) = s.blocking_recv() {
        match ev {
            Event::Text {
                text,
                tokens,
                logprobs,
            } => {
                assert!(
                    matches!(c.end, End::Closed),
                    "text after the end of the stream"
                );
                c.text.push_str(&text);
                c.tokens.extend(tokens);
                c.logprobs.extend(logprobs);
                c.n_text_events += 1;
            }
            Event::Done { finish, usage, .. } => {
                assert_eq!(c.end, End::Closed, "two ends");
                c.end = End::Done(finish, usage);
            }
            Event::Error(m) => {
                assert_eq!(c.end, End::Closed, "two ends");
                c.end = End::Error(m);
            }
            Event::Admitted { .. } => panic!("Admitted sent to a plain submit"),
        }
    }
    c
}

/// Poll the metrics until `f` holds (the engine publishes them after each step).
fn wait_metrics(h: &EngineHandle, what: &str, f: impl Fn(&EngineMetrics) -> bool) -> EngineMetrics {
    let t0 = Instant::now();
    loop {
        let m = h.metrics();
        if f(&m) {
            return m;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {m:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn assert_idle(h: &EngineHandle) -> EngineMetrics {
    wait_metrics(h, "engine idle", |m| {
        m.slots_used == 0 && m.queued == 0 && m.running == 0 && m.cache_blocks_used == 0
    })
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

/// `req` alone (a one-slot engine without prefix cache, `chunk` prompt tokens per pass).
fn solo(
    model: &Arc<dyn CausalLm>,
    tok: &Arc<Tokenizer>,
    req: &Request,
    n_ctx: usize,
    chunk: usize,
) -> common::Finished {
    common::solo(model, tok, req, n_ctx, chunk, KvType::F32)
}

/// The 16 requests of the equivalence test: lengths from 2 to 150 (several longer than the
/// batch budget), the last six extending the prompts of the first six (prefix reuse), some
/// sampled, one running into the context limit; stop strings are added after a first solo
/// run.
fn requests() -> Vec<Request> {
    let lens = [
        2, 7, 12, 20, 35, 50, 64, 80, 100, 130, 5, 9, 17, 33, 70, 150,
    ];
    let mut out: Vec<Request> = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let mut p = if i >= 10 {
            out[i - 10].prompt.clone()
        } else {
            Vec::new()
        };
        p.extend(prompt(len - p.len(), i as u32));
        let mut r = Request::greedy(p, 6 + (i * 5) % 17);
        if i % 5 == 1 {
            r.sampling = SamplingParams {
                seed: 1000 + i as u64,
                ..SamplingParams::default()
            };
        }
        if i == 15 {
            // 150-token prompt in a 256-token context: fills it.
            r.max_tokens = 200;
            r.ignore_eos = true;
        }
        out.push(r);
    }
    out
}

/// Run the 16 requests concurrently and compare with solo runs. `pool`: KV pool positions
/// (`None`: every slot full at once).
fn check_equivalence(name: &str, solo_chunk: Option<usize>, pool: Option<usize>) {
    let (model, tok) = load(name);
    let n_ctx = 256;
    let max_batch_tokens = 32;
    let chunk = solo_chunk.unwrap_or(max_batch_tokens);
    let mut reqs = requests();
    // Stop strings from the unconstrained solo text of some requests.
    for (i, r) in reqs.iter_mut().enumerate() {
        if i % 3 == 2 {
            let out = solo(&model, &tok, r, n_ctx, chunk);
            let chars: Vec<char> = out.text.chars().collect();
            if chars.len() >= 6 {
                let at = chars.len() / 2;
                r.stop = vec![chars[at..at + 2].iter().collect(), "\u{1}never".into()];
            }
        }
    }
    let want: Vec<_> = reqs
        .iter()
        .map(|r| solo(&model, &tok, r, n_ctx, chunk))
        .collect();
    assert!(
        want.iter().any(|w| w.finish == FinishReason::StopString),
        "{name}: some stop string hit"
    );
    assert!(
        want.iter().any(|w| w.finish == FinishReason::ContextFull),
        "{name}: the context limit is exercised"
    );

    let h = EngineHandle::start(
        model.clone(),
        tok.clone(),
        EngineConfig {
            max_running: 5,
            max_batch_tokens,
            n_ctx,
            max_queue: 64,
            kv_type: KvType::F32,
            kv_pool_tokens: pool,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let streams: Vec<_> = reqs.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
    let threads: Vec<_> = streams
        .into_iter()
        .map(|s| std::thread::spawn(move || collect(s)))
        .collect();
    let got: Vec<Collected> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut mismatches = Vec::new();
    let (mut n_prompt, mut n_gen, mut n_cached) = (0u64, 0u64, 0u64);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let End::Done(finish, usage) = &g.end else {
            panic!("{name} request {i}: {:?}", g.end);
        };
        if g.tokens != w.tokens || g.text != w.text || *finish != w.finish {
            mismatches.push(format!(
                "request {i} (prompt {}): engine {:?} {:?} {:?}, solo {:?} {:?} {:?}",
                reqs[i].prompt.len(),
                g.tokens,
                g.text,
                finish,
                w.tokens,
                w.text,
                w.finish
            ));
        }
        assert_eq!(usage.prompt_tokens, reqs[i].prompt.len());
        assert_eq!(usage.completion_tokens, g.tokens.len());
        assert!(usage.cached_tokens < reqs[i].prompt.len());
        assert!(g.logprobs.is_empty());
        n_prompt += usage.prompt_tokens as u64;
        n_gen += usage.completion_tokens as u64;
        n_cached += usage.cached_tokens as u64;
    }
    assert!(mismatches.is_empty(), "{name}:\n{}", mismatches.join("\n"));
    let m = assert_idle(&h);
    assert_eq!(m.requests_finished, 16);
    assert_eq!(m.requests_cancelled, 0);
    assert_eq!(m.prompt_tokens_total, n_prompt);
    assert_eq!(m.generated_tokens_total, n_gen);
    assert_eq!(m.cached_tokens_total, n_cached);
    assert_eq!(m.slots_total, 5);
    assert!(m.steps > 0);
    if pool.is_some() {
        assert!(
            m.preemptions > 0,
            "{name}: the small pool forced preemptions"
        );
    }
    assert_eq!(
        m.cache_blocks_total,
        pool.unwrap_or(5 * n_ctx)
            .div_ceil(kapitsa_models::DEFAULT_BLOCK_SIZE)
    );
    eprintln!("{name}: {m:?}");
    h.shutdown();
}

/// A solo run's greedy tokens equal a plain loop written here against the model (the prompt
/// in one pass, then one token per pass, argmax): the reference the other tests compare with
/// is itself checked, with the prompt in 16-token chunks.
#[test]
fn solo_greedy_equals_a_plain_forward_loop() {
    fn argmax(row: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        best as u32
    }
    for name in ["qwen2-a", "qwen35moe-a", "nemotronh-moe-a"] {
        let (model, tok) = load(name);
        let p = prompt(40, 7);
        let n = 10;
        let mut kv = kapitsa_models::new_cache(&*model, 1, 256, KvType::F32).unwrap();
        let rows = vec![p.len() - 1];
        let out = model
            .forward(&BatchInputs::single(0, &p, 0, rows), &mut kv)
            .unwrap();
        let mut row = out.row(0).to_vec();
        let mut want = Vec::new();
        for i in 0..n {
            let t = argmax(&row);
            want.push(t);
            if i + 1 < n {
                let pos = (p.len() + i) as u32;
                let out = model
                    .forward(&BatchInputs::single(0, &[t], pos, vec![0]), &mut kv)
                    .unwrap();
                row = out.row(0).to_vec();
            }
        }
        let mut r = Request::greedy(p.clone(), n);
        r.ignore_eos = true;
        let got = solo(&model, &tok, &r, 256, 16);
        assert_eq!(got.tokens, want, "{name}");
        assert_eq!(got.finish, FinishReason::Length, "{name}");
        assert_eq!(got.usage.completion_tokens, n, "{name}");
        assert!(
            got.timing.prompt > Duration::ZERO,
            "{name}: {:?}",
            got.timing
        );
        assert!(
            got.timing.generation > Duration::ZERO,
            "{name}: {:?}",
            got.timing
        );
    }
}

/// One slot whose pool is one context, the prefix cache on, and prompts ending inside the
/// context's last block: the sequence still decodes to the end of its context (the block it
/// shares with the cache is copied on its first write), the first time and from the cache.
#[test]
fn lone_sequence_fills_its_context_with_the_prefix_cache() {
    let (model, tok) = load("qwen2-a");
    for (n_ctx, len) in [(6, 3), (32, 20), (64, 60), (64, 40)] {
        let cfg = EngineConfig::single_sequence(
            n_ctx,
            KvType::F32,
            Some(kapitsa_engine::PrefixCacheConfig::default()),
        );
        let h = EngineHandle::start(model.clone(), tok.clone(), cfg).unwrap();
        let mut r = Request::greedy(prompt(len, 3), 100);
        r.ignore_eos = true;
        let a = common::run_to_end(&h, r.clone());
        assert_eq!(a.finish, FinishReason::ContextFull, "{n_ctx} {len}");
        assert_eq!(a.usage.completion_tokens, n_ctx - len, "{n_ctx} {len}");
        let b = common::run_to_end(&h, r);
        assert_eq!(b.usage.cached_tokens, len - 1, "{n_ctx} {len}");
        assert_eq!(b.tokens, a.tokens, "{n_ctx} {len}");
        assert_eq!(b.finish, FinishReason::ContextFull, "{n_ctx} {len}");
        h.shutdown();
    }
}

#[test]
fn concurrent_requests_match_solo_generate_qwen2() {
    check_equivalence("qwen2-a", None, None);
}

#[test]
fn concurrent_requests_match_solo_generate_qwen35moe() {
    check_equivalence("qwen35moe-a", None, None);
}

#[test]
fn concurrent_requests_match_solo_generate_nemotronh_moe() {
    check_equivalence("nemotronh-moe-a", None, None);
}

/// A KV pool of one context plus two blocks for five running sequences: memory runs out,
/// kept prefixes are evicted and the newest sequences preempted and recomputed, and every
/// output is still the solo one.
#[test]
fn small_kv_pool_preempts_and_still_matches_solo_qwen2() {
    check_equivalence("qwen2-a", None, Some(256 + 32));
}

#[test]
fn small_kv_pool_preempts_and_still_matches_solo_qwen35moe() {
    check_equivalence("qwen35moe-a", None, Some(256 + 32));
}

#[test]
fn handles_and_streams_can_move_between_threads() {
    fn send_sync<T: Send + Sync + Clone>() {}
    fn send<T: Send>() {}
    send_sync::<EngineHandle>();
    send::<RequestStream>();
    send::<Event>();
}

fn start(model: Arc<dyn CausalLm>, tok: Arc<Tokenizer>, max_running: usize) -> EngineHandle {
    EngineHandle::start(
        model,
        tok,
        EngineConfig {
            max_running,
            max_batch_tokens: 64,
            n_ctx: 256,
            max_queue: 4,
            kv_type: KvType::F32,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

/// A request that runs until cancelled (for the tests of cancellation and shutdown).
fn endless(seed: u32) -> Request {
    let mut r = Request::greedy(prompt(10, seed), 240);
    r.ignore_eos = true;
    r
}

#[test]
fn prefix_of_a_finished_request_is_reused() {
    let (model, tok) = load("qwen2-a");
    let h = start(model.clone(), tok.clone(), 2);
    let first = Request::greedy(prompt(50, 1), 4);
    let a = collect(h.submit(first.clone()).unwrap());
    let mut second = first.clone();
    second.prompt.extend(prompt(5, 2));
    let b = collect(h.submit(second.clone()).unwrap());
    let End::Done(_, ua) = a.end else { panic!() };
    let End::Done(_, ub) = b.end else { panic!() };
    assert_eq!(ua.cached_tokens, 0);
    assert_eq!(ub.cached_tokens, 50, "the whole first prompt is reused");
    let w = solo(&model, &tok, &second, 256, 64);
    assert_eq!(b.tokens, w.tokens);
    // The same prompt again: all but the last token.
    let c = collect(h.submit(second.clone()).unwrap());
    let End::Done(_, uc) = c.end else { panic!() };
    assert_eq!(uc.cached_tokens, 54);
    assert_eq!(c.tokens, w.tokens);
    let m = assert_idle(&h);
    assert_eq!(m.cached_tokens_total, 104);
}

/// `submit_announced`: `Admitted` comes first, with the prefix-cache hit `Done` reports.
#[test]
fn announced_requests_start_with_admitted() {
    let (model, tok) = load("qwen2-a");
    let h = start(model, tok, 2);
    let first = Request::greedy(prompt(40, 3), 3);
    collect(h.submit(first.clone()).unwrap());
    let mut s = h.submit_announced(first).unwrap();
    let Some(Event::Admitted { cached_tokens }) = s.blocking_recv() else {
        panic!("the first event is not Admitted")
    };
    assert_eq!(
        cached_tokens, 39,
        "all but the last prompt token are reused"
    );
    let mut n_admitted = 0;
    let mut done = None;
    while let Some(ev) = s.blocking_recv() {
        match ev {
            Event::Admitted { .. } => n_admitted += 1,
            Event::Done { usage, .. } => done = Some(usage),
            _ => {}
        }
    }
    assert_eq!(n_admitted, 0, "Admitted is sent once");
    assert_eq!(done.map(|u| u.cached_tokens), Some(39));
}

#[test]
fn logprobs_are_reported_per_token() {
    let (model, tok) = load("qwen2-a");
    let h = start(model, tok, 2);
    let mut r = Request::greedy(prompt(12, 3), 8);
    r.ignore_eos = true;
    r.top_logprobs = Some(5);
    let c = collect(h.submit(r.clone()).unwrap());
    assert_eq!(c.tokens.len(), 8);
    assert_eq!(c.logprobs.len(), 8);
    for (t, lp) in c.tokens.iter().zip(&c.logprobs) {
        assert_eq!(lp.id, *t);
        assert_eq!(lp.top.len(), 5);
        // Greedy: the sampled token is the most likely one.
        assert_eq!(lp.top[0].0, *t);
        assert_eq!(lp.top[0].1, lp.logprob);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(lp.logprob <= 0.0);
        let mass: f32 = lp.top.iter().map(|x| x.1.exp()).sum();
        assert!(mass <= 1.0 + 1e-4);
    }
    r.top_logprobs = Some(0);
    let c = collect(h.submit(r).unwrap());
    assert_eq!(c.logprobs.len(), 8);
    assert!(c.logprobs.iter().all(|l| l.top.is_empty()));
}

#[test]
fn cancellation_frees_the_slot() {
    let (model, tok) = load("qwen2-a");
    let h = start(model, tok, 2);
    // Dropping the stream.
    let mut s = h.submit(endless(1)).unwrap();
    assert!(matches!(s.blocking_recv(), Some(Event::Text { .. })));
    wait_metrics(&h, "one slot used", |m| m.slots_used == 1);
    drop(s);
    let m = wait_metrics(&h, "dropped stream cancels", |m| m.requests_cancelled == 1);
    assert_eq!(m.requests_finished, 0);
    assert_idle(&h);
    // Explicit cancel: the stream ends without Done.
    let mut s = h.submit(endless(2)).unwrap();
    assert!(matches!(s.blocking_recv(), Some(Event::Text { .. })));
    h.cancel(s.id());
    let c = collect(s);
    assert_eq!(c.end, End::Closed);
    assert!(c.tokens.len() < 240);
    let m = assert_idle(&h);
    assert_eq!(m.requests_cancelled, 2);
    // Cancelling a request that waits for a slot.
    let a = h.submit(endless(3)).unwrap();
    let b = h.submit(endless(4)).unwrap();
    let mut c = h.submit(endless(5)).unwrap();
    wait_metrics(&h, "two running", |m| m.running == 2 && m.queued == 1);
    h.cancel(c.id());
    assert_eq!(c.blocking_recv(), None);
    wait_metrics(&h, "queue empty", |m| m.queued == 0);
    drop((a, b));
    let m = assert_idle(&h);
    assert_eq!(m.requests_cancelled, 5);
    // The engine still works.
    let c = collect(h.submit(Request::greedy(prompt(5, 9), 3)).unwrap());
    assert!(matches!(c.end, End::Done(..)));
    h.cancel(12345); // unknown id: nothing happens
    assert_idle(&h);
}

#[test]
fn queue_full_is_refused() {
    let (model, tok) = load("qwen2-a");
    let h = start(model, tok, 1); // one slot, max_queue 4
    let running = h.submit(endless(1)).unwrap();
    wait_metrics(&h, "first running", |m| m.running == 1);
    let waiting: Vec<_> = (0..4).map(|i| h.submit(endless(10 + i)).unwrap()).collect();
    assert_eq!(h.metrics().queued, 4);
    assert_eq!(h.submit(endless(20)).unwrap_err(), SubmitError::QueueFull);
    drop(waiting);
    wait_metrics(&h, "queue drained", |m| m.queued == 0);
    let s = h.submit(endless(21)).unwrap();
    drop((running, s));
    assert_idle(&h);
}

#[test]
fn invalid_requests_are_refused() {
    let (model, tok) = load("qwen2-a");
    let h = EngineHandle::start(
        model.clone(),
        tok.clone(),
        EngineConfig {
            n_ctx: 64,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(h.n_ctx(), 64);
    let bad = |r: Request| match h.submit(r) {
        Err(SubmitError::BadRequest(m)) => m,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        h.submit(Request::greedy(prompt(64, 1), 4)).unwrap_err(),
        SubmitError::PromptTooLong {
            n_prompt: 64,
            n_ctx: 64
        }
    );
    assert!(h.submit(Request::greedy(prompt(63, 1), 4)).is_ok());
    bad(Request::greedy(vec![], 4));
    bad(Request::greedy(vec![1, 400], 4));
    bad(Request::greedy(vec![1, 2], 0));
    let mut r = Request::greedy(vec![1, 2], 4);
    r.sampling.temperature = -1.0;
    assert!(bad(r.clone()).contains("temperature"));
    r.sampling = SamplingParams {
        top_p: 0.0,
        ..Default::default()
    };
    assert!(bad(r.clone()).contains("top_p"));
    r.sampling = SamplingParams::greedy();
    r.top_logprobs = Some(21);
    bad(r);
    // Engine configuration.
    for cfg in [
        EngineConfig {
            max_running: 0,
            ..Default::default()
        },
        EngineConfig {
            max_running: 8,
            max_batch_tokens: 4,
            ..Default::default()
        },
        EngineConfig {
            n_ctx: 1,
            ..Default::default()
        },
    ] {
        assert!(EngineHandle::start(model.clone(), tok.clone(), cfg).is_err());
    }
    assert_idle(&h);
}

#[test]
fn shutdown_ends_every_stream() {
    let (model, tok) = load("qwen35moe-a");
    let h = start(model, tok, 2);
    let mut streams: Vec<_> = (0..4).map(|i| h.submit(endless(i)).unwrap()).collect();
    // The first one is streaming.
    let first = streams[0].blocking_recv();
    assert!(matches!(first, Some(Event::Text { .. })), "{first:?}");
    let h2 = h.clone();
    h2.shutdown();
    for s in streams.drain(..) {
        let c = collect(s);
        assert_eq!(
            c.end,
            End::Error("server shutting down".into()),
            "every stream ends with an error"
        );
    }
    assert_eq!(
        h.submit(Request::greedy(vec![1, 2], 2)).unwrap_err(),
        SubmitError::ShutDown
    );
    h.shutdown(); // idempotent
    let m = h.metrics();
    assert_eq!((m.running, m.slots_used, m.queued), (0, 0, 0), "{m:?}");
}

#[test]
fn dropping_the_last_handle_shuts_down() {
    let (model, tok) = load("qwen2-a");
    let h = start(model, tok, 1);
    let a = h.submit(endless(1)).unwrap();
    let b = h.submit(endless(2)).unwrap();
    drop(h);
    for s in [a, b] {
        assert_eq!(collect(s).end, End::Error("server shutting down".into()));
    }
}

// ---------------------------------------------------------------------------------------------
// Failing batches

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// Return an error before touching the cache.
    ErrBefore,
    /// Run the batch (the cache is updated), then return an error.
    ErrAfter,
    /// Panic.
    Panic,
}

/// A model that fails every batch holding a sequence that starts with `POISON` at position 0.
struct Faulty {
    inner: Arc<dyn CausalLm>,
    fault: Fault,
    failures: AtomicUsize,
}

const POISON: u32 = 396;

impl CausalLm for Faulty {
    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }

    fn backend(&self) -> &Arc<dyn kapitsa_backend::Backend> {
        self.inner.backend()
    }

    fn forward(&self, batch: &BatchInputs, cache: &mut KvCache) -> kapitsa_models::Result<Logits> {
        let poisoned = batch
            .seqs
            .iter()
            .any(|c| batch.positions[c.start] == 0 && batch.tokens[c.start] == POISON);
        if !poisoned {
            return self.inner.forward(batch, cache);
        }
        self.failures.fetch_add(1, Ordering::SeqCst);
        match self.fault {
            Fault::ErrBefore => Err(ModelError::Batch("poisoned".into())),
            Fault::ErrAfter => {
                self.inner.forward(batch, cache)?;
                Err(ModelError::Batch("poisoned".into()))
            }
            Fault::Panic => panic!("poisoned batch"),
        }
    }
}

fn check_faults(name: &str, fault: Fault) {
    let (inner, tok) = load(name);
    let faulty = Arc::new(Faulty {
        inner: inner.clone(),
        fault,
        failures: AtomicUsize::new(0),
    });
    let h = EngineHandle::start(
        faulty.clone(),
        tok.clone(),
        EngineConfig {
            max_running: 3,
            // Everything in one step: the good requests share batches with the bad one.
            max_batch_tokens: 256,
            n_ctx: 256,
            max_queue: 8,
            kv_type: KvType::F32,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let good: Vec<Request> = (0..2)
        .map(|i| {
            let mut r = Request::greedy(prompt(20 + 10 * i, 50 + i as u32), 12);
            r.ignore_eos = true;
            r
        })
        .collect();
    // Get the good ones decoding first, so that the failure hits them mid-sequence.
    let mut streams: Vec<_> = good.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
    let mut firsts = Vec::new();
    for s in &mut streams {
        firsts.push(s.blocking_recv().unwrap());
    }
    let mut bad = prompt(8, 9);
    bad[0] = POISON;
    let b = collect(h.submit(Request::greedy(bad, 4)).unwrap());
    let End::Error(msg) = &b.end else {
        panic!("{name}: {:?}", b.end)
    };
    assert!(msg.contains("poisoned"), "{msg}");
    assert!(faulty.failures.load(Ordering::SeqCst) >= 1);
    for ((s, first), r) in streams.into_iter().zip(firsts).zip(&good) {
        let mut c = collect(s);
        if let Event::Text { text, tokens, .. } = first {
            c.tokens.splice(0..0, tokens);
            c.text.insert_str(0, &text);
        }
        let w = solo(&inner, &tok, r, 256, 256);
        assert!(matches!(c.end, End::Done(..)), "{name}: {:?}", c.end);
        assert_eq!(c.tokens, w.tokens, "{name}: a good request is unaffected");
    }
    let m = assert_idle(&h);
    assert_eq!(m.requests_finished, 2);
    // Only a pass that ran and then failed leaves the good sequences' recurrent states
    // unusable: then they are recomputed, otherwise rerun alone.
    let recurrent = inner.spec().n_recurrent_layers() > 0;
    let recomputed = fault == Fault::ErrAfter && recurrent;
    assert_eq!(m.preemptions > 0, recomputed, "{name}: {m:?}");
    // The engine keeps working.
    let c = collect(h.submit(good[0].clone()).unwrap());
    assert_eq!(c.tokens, solo(&inner, &tok, &good[0], 256, 256).tokens);
    h.shutdown();
}

#[test]
fn model_error_fails_only_the_culprit() {
    check_faults("qwen2-a", Fault::ErrBefore);
    check_faults("qwen2-a", Fault::ErrAfter);
    check_faults("qwen35moe-a", Fault::ErrBefore);
}

#[test]
fn recurrent_state_lost_in_a_failed_batch_is_recomputed() {
    check_faults("qwen35moe-a", Fault::ErrAfter);
    check_faults("nemotronh-moe-a", Fault::ErrAfter);
}

#[test]
fn panic_in_forward_fails_only_the_culprit() {
    check_faults("qwen2-a", Fault::Panic);
}

// ---------------------------------------------------------------------------------------------
// Argmax-only logit rows

/// A model that counts the logit rows it was asked for, in full and argmax only.
struct Spy {
    inner: Arc<dyn CausalLm>,
    full: AtomicUsize,
    argmax: AtomicUsize,
}

impl CausalLm for Spy {
    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }

    fn backend(&self) -> &Arc<dyn kapitsa_backend::Backend> {
        self.inner.backend()
    }

    fn forward(&self, batch: &BatchInputs, cache: &mut KvCache) -> kapitsa_models::Result<Logits> {
        let n_argmax = batch.argmax_rows.iter().filter(|&&a| a).count();
        self.argmax.fetch_add(n_argmax, Ordering::SeqCst);
        self.full
            .fetch_add(batch.logit_rows.len() - n_argmax, Ordering::SeqCst);
        self.inner.forward(batch, cache)
    }
}

/// Plain greedy requests take their tokens from argmax-only rows (the logits stay on the
/// backend) and give the same tokens as with every row in full (a request with logprobs);
/// sampling, penalties, a logit bias and logprobs need the rows in full.
#[test]
fn plain_greedy_requests_ask_for_argmax_rows_only() {
    let (inner, tok) = load("qwen35moe-a");
    let spy = Arc::new(Spy {
        inner,
        full: AtomicUsize::new(0),
        argmax: AtomicUsize::new(0),
    });
    let h = start(spy.clone(), tok, 2);
    let counts = |r: Request| {
        spy.full.store(0, Ordering::SeqCst);
        spy.argmax.store(0, Ordering::SeqCst);
        let c = collect(h.submit(r).unwrap());
        (
            c,
            spy.full.load(Ordering::SeqCst),
            spy.argmax.load(Ordering::SeqCst),
        )
    };
    let mut greedy = Request::greedy(prompt(20, 5), 8);
    greedy.ignore_eos = true;
    let (plain, full, argmax) = counts(greedy.clone());
    assert_eq!(
        (full, argmax),
        (0, 8),
        "plain greedy: rows in full, argmax only"
    );
    let mut lp = greedy.clone();
    lp.top_logprobs = Some(1);
    let (with_lp, full, argmax) = counts(lp);
    assert_eq!((full, argmax), (8, 0), "greedy with logprobs");
    assert_eq!(
        plain.tokens, with_lp.tokens,
        "argmax rows change the tokens"
    );
    let mut variants = Vec::new();
    let mut r = greedy.clone();
    r.sampling.repetition_penalty = 1.1;
    variants.push(("repetition penalty", r));
    let mut r = greedy.clone();
    r.sampling.logit_bias = vec![(3, 1.0)];
    variants.push(("logit bias", r));
    let mut r = greedy.clone();
    r.sampling = SamplingParams::default();
    variants.push(("sampled", r));
    for (what, r) in variants {
        let (_, full, argmax) = counts(r);
        assert_eq!((full, argmax), (8, 0), "{what}");
    }
}
