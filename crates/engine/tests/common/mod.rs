//! Helpers shared by the engine's integration tests.

#![allow(dead_code)]

use std::sync::Arc;

use kapitsa_backend::Backend;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_base::pool::RayonPool;
use kapitsa_engine::loader::tokenizer_for;
use kapitsa_engine::{EngineConfig, EngineHandle, Event, FinishReason, Request, Timing, Usage};
use kapitsa_models::{load_model, CausalLm, KvType, LoadOptions};
use kapitsa_text::Tokenizer;

/// The tiny fixture `name` (`tests/fixtures/tiny/<name>`) on a 2-thread CPU backend, with
/// its tokenizer.
pub fn load_tiny(name: &str) -> (Arc<dyn CausalLm>, Arc<Tokenizer>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(Box::new(
        RayonPool::new(2).expect("thread pool"),
    )));
    let m = load_model(&dir.join(name), backend, &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let tok = tokenizer_for(&m.source).unwrap();
    (m.model, Arc::new(tok))
}

/// The end of a request that finished normally.
#[derive(Debug, Clone)]
pub struct Finished {
    /// All text events concatenated.
    pub text: String,
    /// All generated tokens.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Token counts.
    pub usage: Usage,
    /// Prompt and generation time.
    pub timing: Timing,
}

/// Submit `req` and wait for its end. Panics on an error event or a stream that closes
/// without one.
pub fn run_to_end(h: &EngineHandle, req: Request) -> Finished {
    let mut s = h.submit(req).unwrap();
    let (mut text, mut toks) = (String::new(), Vec::new());
    while let Some(ev) = s.blocking_recv() {
        match ev {
            Event::Text {
                text: t, tokens, ..
            } => {
                text.push_str(&t);
                toks.extend(tokens);
            }
            Event::Done {
                finish,
                usage,
                timing,
            } => {
                return Finished {
                    text,
                    tokens: toks,
                    finish,
                    usage,
                    timing,
                }
            }
            Event::Error(e) => panic!("request failed: {e}"),
            Event::Admitted { .. } => {}
        }
    }
    panic!("stream closed without an end")
}

/// Submit `req` and wait for its end: (generated tokens, cached prompt tokens). Panics on an
/// error event or a stream that closes without one.
pub fn run_request(h: &EngineHandle, req: Request) -> (Vec<u32>, usize) {
    let f = run_to_end(h, req);
    (f.tokens, f.usage.cached_tokens)
}

/// An engine that runs each request alone and from scratch: one slot of `n_ctx` tokens, no
/// prefix cache (nothing is reused between requests), `chunk` prompt tokens per forward
/// pass. What a request gives here is the reference the batching and prefix-cache tests
/// compare with.
pub fn solo_engine(
    model: &Arc<dyn CausalLm>,
    tok: &Arc<Tokenizer>,
    n_ctx: usize,
    chunk: usize,
    kv_type: KvType,
) -> EngineHandle {
    let mut cfg = EngineConfig::single_sequence(n_ctx, kv_type, None);
    cfg.max_batch_tokens = chunk;
    EngineHandle::start(model.clone(), tok.clone(), cfg).unwrap()
}

/// `req` alone, from scratch (see [`solo_engine`]).
pub fn solo(
    model: &Arc<dyn CausalLm>,
    tok: &Arc<Tokenizer>,
    req: &Request,
    n_ctx: usize,
    chunk: usize,
    kv_type: KvType,
) -> Finished {
    let h = solo_engine(model, tok, n_ctx, chunk, kv_type);
    let f = run_to_end(&h, req.clone());
    assert_eq!(f.usage.cached_tokens, 0, "a solo run reuses nothing");
    h.shutdown();
    f
}
