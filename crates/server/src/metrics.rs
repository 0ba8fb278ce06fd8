//! Server-side metrics and the Prometheus text rendering of `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use crate::engine::EngineMetrics;

/// Upper bounds (seconds) of the time-to-first-token histogram.
const TTFT_BUCKETS: [f64; 14] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
];
/// Upper bounds (seconds) of the inter-token latency histogram.
const ITL_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// A cumulative histogram.
#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Count per bucket (not cumulative), plus one for +Inf.
    counts: Vec<u64>,
    sum: f64,
    n: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            n: 0,
        }
    }

    fn observe(&mut self, x: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| x <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += x;
        self.n += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += self.counts[i];
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.n);
    }
}

#[derive(Debug)]
struct Inner {
    /// (endpoint, status) -> count.
    requests: BTreeMap<(String, u16), u64>,
    ttft: Histogram,
    itl: Histogram,
    streams_active: i64,
}

/// Metrics the server keeps itself (the engine keeps the rest).
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            inner: Mutex::new(Inner {
                requests: BTreeMap::new(),
                ttft: Histogram::new(&TTFT_BUCKETS),
                itl: Histogram::new(&ITL_BUCKETS),
                streams_active: 0,
            }),
        }
    }
}

/// The label for a request path: the known endpoints, else `other` (bounded cardinality).
pub fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/messages" => "/v1/messages",
        "/v1/messages/count_tokens" => "/v1/messages/count_tokens",
        "/v1/responses" => "/v1/responses",
        "/v1/embeddings" => "/v1/embeddings",
        "/infill" => "/infill",
        "/api/chat" => "/api/chat",
        "/api/generate" => "/api/generate",
        "/api/embed" => "/api/embed",
        "/api/tags" => "/api/tags",
        "/api/show" => "/api/show",
        "/api/version" => "/api/version",
        "/" => "/",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        _ => "other",
    }
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Count a finished HTTP request.
    pub fn request(&self, endpoint: &str, status: u16) {
        *self
            .lock()
            .requests
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    /// Time from submission to the first generated token.
    pub fn ttft(&self, secs: f64) {
        self.lock().ttft.observe(secs);
    }

    /// `n` tokens arrived `secs` after the previous ones.
    pub fn itl(&self, secs: f64, n: usize) {
        if n == 0 {
            return;
        }
        let per = secs / n as f64;
        let mut g = self.lock();
        for _ in 0..n {
            g.itl.observe(per);
        }
    }

    /// A generation stream started (+1) or ended (-1).
    pub fn stream_delta(&self, d: i64) {
        self.lock().streams_active += d;
    }

    /// Number of requests answered with `status` on `endpoint` so far.
    pub fn count(&self, endpoint: &str, status: u16) -> u64 {
        self.lock()
            .requests
            .get(&(endpoint.to_string(), status))
            .copied()
            .unwrap_or(0)
    }

    /// The Prometheus text exposition of these metrics and the engine's.
    pub fn render(&self, e: &EngineMetrics) -> String {
        let mut out = String::new();
        let mut one = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {v}");
        };
        one(
            "kapitsa_queue_length",
            "gauge",
            "Requests waiting for a slot.",
            e.queued as u64,
        );
        one(
            "kapitsa_requests_running",
            "gauge",
            "Requests being generated.",
            e.running as u64,
        );
        one(
            "kapitsa_slots_used",
            "gauge",
            "Sequence slots in use.",
            e.slots_used as u64,
        );
        one(
            "kapitsa_slots_total",
            "gauge",
            "Sequence slots.",
            e.slots_total as u64,
        );
        one(
            "kapitsa_cache_blocks_total",
            "gauge",
            "KV cache blocks in the pool.",
            e.cache_blocks_total as u64,
        );
        one(
            "kapitsa_cache_blocks_used",
            "gauge",
            "KV cache blocks held by running sequences.",
            e.cache_blocks_used as u64,
        );
        one(
            "kapitsa_cache_blocks_cached",
            "gauge",
            "KV cache blocks holding finished sequences' prefixes for reuse (freed on demand).",
            e.cache_blocks_cached as u64,
        );
        let px = &e.prefix;
        for (name, kind, help, v) in [
            (
                "kapitsa_prefix_cache_lookups_total",
                "counter",
                "Admissions that looked up the prefix cache.",
                px.lookups,
            ),
            (
                "kapitsa_prefix_cache_hits_total",
                "counter",
                "Admissions that reused a cached prefix.",
                px.hits,
            ),
            (
                "kapitsa_prefix_cache_tokens_reused_total",
                "counter",
                "Prompt tokens not recomputed thanks to the prefix cache.",
                px.tokens_reused,
            ),
            (
                "kapitsa_prefix_cache_nodes",
                "gauge",
                "Blocks' worth of tokens in the prefix tree (memory or disk).",
                px.nodes as u64,
            ),
            (
                "kapitsa_prefix_cache_memory_blocks",
                "gauge",
                "KV blocks the prefix cache holds in memory.",
                px.blocks_in_memory as u64,
            ),
            (
                "kapitsa_prefix_cache_state_bytes",
                "gauge",
                "Bytes of recurrent-state checkpoints in memory.",
                px.state_bytes as u64,
            ),
            (
                "kapitsa_prefix_cache_disk_bytes",
                "gauge",
                "Bytes of prefix-cache files on disk.",
                px.disk_bytes,
            ),
            (
                "kapitsa_prefix_cache_disk_files",
                "gauge",
                "Prefix-cache files on disk.",
                px.disk_files as u64,
            ),
            (
                "kapitsa_prefix_cache_disk_loads_total",
                "counter",
                "Blocks and checkpoints read back from disk.",
                px.disk_loads,
            ),
            (
                "kapitsa_prefix_cache_disk_rejected_total",
                "counter",
                "Cache files ignored as damaged or foreign.",
                px.disk_rejected,
            ),
        ] {
            one(name, kind, help, v);
        }
        one(
            "kapitsa_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            e.prompt_tokens_total,
        );
        one(
            "kapitsa_generation_tokens_total",
            "counter",
            "Generated tokens.",
            e.generated_tokens_total,
        );
        one(
            "kapitsa_cached_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            e.cached_tokens_total,
        );
        one(
            "kapitsa_engine_requests_finished_total",
            "counter",
            "Requests the engine finished.",
            e.requests_finished,
        );
        one(
            "kapitsa_engine_requests_cancelled_total",
            "counter",
            "Requests cancelled (client gone, shutdown).",
            e.requests_cancelled,
        );
        one(
            "kapitsa_preemptions_total",
            "counter",
            "Sequences preempted for lack of cache space.",
            e.preemptions,
        );
        one(
            "kapitsa_engine_steps_total",
            "counter",
            "Engine steps (batched forward passes).",
            e.steps,
        );
        let g = self.lock();
        one(
            "kapitsa_streams_active",
            "gauge",
            "Generation streams the HTTP layer is reading.",
            g.streams_active.max(0) as u64,
        );
        let _ = writeln!(
            out,
            "# HELP kapitsa_http_requests_total HTTP requests by endpoint and status."
        );
        let _ = writeln!(out, "# TYPE kapitsa_http_requests_total counter");
        for ((ep, st), n) in &g.requests {
            let _ = writeln!(
                out,
                "kapitsa_http_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}"
            );
        }
        g.ttft.render(
            &mut out,
            "kapitsa_time_to_first_token_seconds",
            "Time from submission to the first generated token.",
        );
        g.itl.render(
            &mut out,
            "kapitsa_inter_token_latency_seconds",
            "Time between generated tokens.",
        );
        // Speculative decoding, labelled by proposer.
        for (name, help, get) in [
            (
                "kapitsa_spec_rounds_total",
                "Verification rounds (steps in which a sequence had proposed tokens).",
                (|c: &kapitsa_engine::spec::SpecCounters| c.rounds) as fn(&_) -> u64,
            ),
            (
                "kapitsa_spec_draft_tokens_total",
                "Proposed tokens verified.",
                |c| c.drafted,
            ),
            (
                "kapitsa_spec_accepted_tokens_total",
                "Proposed tokens accepted.",
                |c| c.accepted,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            for (label, c) in [
                ("ngram", &e.spec.ngram),
                ("draft", &e.spec.draft),
                ("dflash", &e.spec.dflash),
                ("mtp", &e.spec.mtp),
            ] {
                let _ = writeln!(out, "{name}{{proposer=\"{label}\"}} {}", get(c));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        h.observe(0.5);
        h.observe(1.5);
        h.observe(9.0);
        let mut s = String::new();
        h.render(&mut s, "x", "h");
        assert!(s.contains("x_bucket{le=\"1\"} 1\n"));
        assert!(s.contains("x_bucket{le=\"2\"} 2\n"));
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_count 3\n"));
    }
}
