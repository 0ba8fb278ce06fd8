//! The speculative-decoding parts of `kapitsa bench`:
//!
//! - `--prompts FILE`: generation through the engine (the one decode loop, with `--spec`,
//!   `--draft-model`, `--spec-max`) over a prompt set, greedy, one request at a time; reports
//!   generated tokens/s over the set and, per proposer, rounds, proposed and accepted tokens
//!   and the mean tokens per round. FILE holds one JSON object per line: `{"prompt": TEXT}`
//!   (raw text, special tokens parsed) or `{"chat": TEXT}` (a user message, through the chat
//!   template), with an optional `"max_tokens"` (default: the first `-n`).
//! - `--verify-cost K,...`: the cost of one forward pass over `K` new tokens of one sequence
//!   (what verifying `K - 1` proposals takes) relative to a one-token decode step, at depth
//!   `-d` (the first value), `-n` steps per run (first value): what speculation can gain at a
//!   given acceptance.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kapitsa_engine::{
    EngineConfig, EngineHandle, Event, OpenedModel, Request, SamplingParams, SpecConfig,
};
use kapitsa_models::{BatchInputs, KvType};

/// One prompt of a `--prompts` file.
struct Prompt {
    tokens: Vec<u32>,
    max_tokens: usize,
}

fn read_prompts(path: &Path, opened: &OpenedModel, default_max: usize) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the prompt file {}", path.display()))?;
    let template = opened.chat_template()?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let where_ = || format!("{} line {}", path.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(line).with_context(where_)?;
        let max_tokens = v
            .get("max_tokens")
            .and_then(|m| m.as_u64())
            .map_or(default_max, |m| m as usize);
        let raw = if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
            p.to_string()
        } else if let Some(c) = v.get("chat").and_then(|c| c.as_str()) {
            let Some(t) = &template else {
                bail!("{}: \"chat\" needs a model with a chat template", where_());
            };
            let msgs = serde_json::json!([{"role": "user", "content": c}]);
            t.render(&msgs, None, true, None)?
        } else {
            bail!(
                "{}: expected {{\"prompt\": ...}} or {{\"chat\": ...}}",
                where_()
            );
        };
        let tokens = opened.tokenizer.encode(&raw, true, true)?;
        if tokens.is_empty() {
            bail!("{}: empty prompt", where_());
        }
        out.push(Prompt { tokens, max_tokens });
    }
    if out.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(out)
}

/// What `--prompts` measured.
pub struct GenResult {
    /// Prompts run.
    pub prompts: usize,
    /// Tokens generated over all prompts.
    pub tokens: usize,
    /// Generation seconds over all prompts (prompt processing excluded).
    pub gen_secs: f64,
    /// The engine's counters at the end.
    pub metrics: kapitsa_engine::EngineMetrics,
    /// The speculative mode.
    pub mode: String,
}

impl GenResult {
    /// Generated tokens per second of generation time.
    pub fn tokens_per_sec(&self) -> f64 {
        self.tokens as f64 / self.gen_secs.max(1e-9)
    }

    /// The JSON object `bench -o json` prints.
    pub fn json(&self, filename: &str, backend: &str) -> serde_json::Value {
        let c = |c: &kapitsa_engine::spec::SpecCounters| {
            serde_json::json!({
                "rounds": c.rounds,
                "drafted": c.drafted,
                "accepted": c.accepted,
                "acceptance": c.acceptance(),
                "mean_accepted_length": c.mean_accepted_length(),
            })
        };
        serde_json::json!({
            "build": concat!("kapitsa ", env!("CARGO_PKG_VERSION")),
            "model_filename": filename,
            "backends": backend,
            "test": "gen",
            "spec": self.mode,
            "prompts": self.prompts,
            "n_gen": self.tokens,
            "gen_seconds": self.gen_secs,
            "avg_ts": self.tokens_per_sec(),
            "proposers": {
                "ngram": c(&self.metrics.spec.ngram),
                "draft": c(&self.metrics.spec.draft),
                "dflash": c(&self.metrics.spec.dflash),
                "mtp": c(&self.metrics.spec.mtp),
            },
        })
    }
}

/// Run the prompt set through an engine with `spec` (greedy, one request at a time; the prefix
/// cache is off so every prompt is computed).
pub fn generate(
    opened: &OpenedModel,
    path: &Path,
    default_max: usize,
    kv_type: KvType,
    spec: SpecConfig,
) -> Result<GenResult> {
    let prompts = read_prompts(path, opened, default_max)?;
    let n_ctx = prompts
        .iter()
        .map(|p| p.tokens.len() + p.max_tokens + 1)
        .max()
        .unwrap_or(2);
    let mode = spec.mode.name().to_string();
    let mut cfg = EngineConfig::single_sequence(n_ctx, kv_type, None);
    cfg.spec = spec;
    let engine = EngineHandle::start(opened.model.clone(), opened.tokenizer.clone(), cfg)
        .context("starting the engine")?;
    let (mut tokens, mut gen_secs) = (0, 0.0);
    for (i, p) in prompts.iter().enumerate() {
        let req = Request {
            prompt: p.tokens.clone(),
            sampling: SamplingParams::greedy(),
            max_tokens: p.max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            top_logprobs: None,
            constraint: None,
            spec: Default::default(),
            images: Vec::new(),
        };
        let start = Instant::now();
        let mut s = engine.submit(req)?;
        loop {
            match s.blocking_recv() {
                Some(Event::Done { usage, timing, .. }) => {
                    tokens += usage.completion_tokens;
                    gen_secs += timing.generation.as_secs_f64();
                    eprintln!(
                        "bench: prompt {}/{}: {} + {} tokens, {:.1} s",
                        i + 1,
                        prompts.len(),
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        start.elapsed().as_secs_f64()
                    );
                    break;
                }
                Some(Event::Error(e)) => bail!("prompt {}: {e}", i + 1),
                Some(_) => {}
                None => bail!("the engine stopped"),
            }
        }
    }
    let metrics = engine.metrics();
    engine.shutdown();
    Ok(GenResult {
        prompts: prompts.len(),
        tokens,
        gen_secs,
        metrics,
        mode,
    })
}

/// `--verify-cost`: for each `k`, the mean time of a `k`-token pass (logits for every row, as
/// verification takes them) over `steps` passes after filling the cache to `depth` (each pass
/// appends its `k` tokens), and its ratio to the `k = 1` pass. Returns `(k, ms per pass, cost relative to k = 1)`.
pub fn verify_cost(
    opened: &OpenedModel,
    ks: &[usize],
    depth: usize,
    steps: usize,
    kv_type: KvType,
) -> Result<Vec<(usize, f64, f64)>> {
    let model = &*opened.model;
    let n_vocab = model.spec().n_vocab as u64;
    let kmax = ks.iter().copied().max().unwrap_or(1);
    let mut cache =
        kapitsa_models::new_cache(model, 1, depth.max(1) + (steps + 1) * kmax, kv_type)?;
    let mut x = 0x5eed_u64;
    let mut toks = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % n_vocab) as u32
            })
            .collect()
    };
    let mut fill = |cache: &mut kapitsa_models::KvCache| -> Result<()> {
        let mut pos = 0;
        while pos < depth.max(1) {
            let n = 512.min(depth.max(1) - pos);
            let t = toks(n);
            model.forward(&BatchInputs::single(0, &t, pos as u32, vec![n - 1]), cache)?;
            pos += n;
        }
        Ok(())
    };
    let mut out: Vec<(usize, f64, f64)> = Vec::new();
    let mut base = None;
    let mut ks: Vec<usize> = ks.to_vec();
    if !ks.contains(&1) {
        ks.insert(0, 1);
    }
    for &k in &ks {
        // Recurrent states cannot be cut back: every k starts from a fresh fill.
        fill(&mut cache)?;
        let mut pos = depth.max(1);
        let mut t = 0.0;
        for s in 0..steps + 1 {
            let tk: Vec<u32> = (0..k)
                .map(|i| ((pos + i) as u64 % n_vocab) as u32)
                .collect();
            let batch = BatchInputs::single(0, &tk, pos as u32, (0..k).collect());
            let start = Instant::now();
            std::hint::black_box(model.forward(&batch, &mut cache)?);
            if s > 0 {
                t += start.elapsed().as_secs_f64(); // the first pass is a warm-up
            }
            pos += k;
        }
        let ms = 1e3 * t / steps as f64;
        let b = *base.get_or_insert(ms);
        eprintln!(
            "bench: verify k={k}: {ms:.2} ms per pass ({:.2}x one token)",
            ms / b
        );
        out.push((k, ms, ms / b));
    }
    Ok(out)
}
