//! Helpers shared by the engine's integration tests.

use kapitsa_engine::{EngineHandle, Event, Request};

/// Submit `req` and wait for its end: (generated tokens, cached prompt tokens). Panics on an
/// error event or a stream that closes without one.
pub fn run_request(h: &EngineHandle, req: Request) -> (Vec<u32>, usize) {
    let mut s = h.submit(req).unwrap();
    let mut toks = Vec::new();
    while let Some(ev) = s.blocking_recv() {
        match ev {
            Event::Text { tokens, .. } => toks.extend(tokens),
            Event::Done { usage, .. } => return (toks, usage.cached_tokens),
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
    panic!("stream closed without an end")
}
