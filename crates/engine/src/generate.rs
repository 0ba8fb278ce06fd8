//! Single-sequence generation: prefill (chunked, reusing whatever prefix the slot already
//! holds), then sample/decode until a stop condition, streaming text as it becomes final.

use std::time::Instant;

use kapitsa_cache::SlotCache;
use kapitsa_models::{BatchInputs, CausalLm};
use kapitsa_text::{IncrementalDecoder, Tokenizer};

use crate::{EngineError, Result, Sampler, SamplingParams, StopChecker};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Maximum number of new tokens.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Stop strings (not included in the output).
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Tokens per prefill forward pass (>= 1).
    pub prefill_chunk: usize,
}

impl GenerateRequest {
    /// Greedy generation of `max_tokens` after `prompt`.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            ignore_eos: false,
            prefill_chunk: 512,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// An end-of-generation token was sampled.
    EndOfGeneration,
    /// A stop string appeared.
    StopString,
    /// The cache slot is full.
    ContextFull,
}

/// Result of [`generate`].
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    /// Generated token ids (an end-of-generation token is not included).
    pub tokens: Vec<u32>,
    /// The text emitted (stop strings cut off).
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Prompt tokens.
    pub n_prompt: usize,
    /// Prompt tokens whose K/V were already in the slot.
    pub n_cached: usize,
    /// Seconds spent on the prompt.
    pub prompt_secs: f64,
    /// Seconds spent generating.
    pub gen_secs: f64,
}

/// Generate for one request in cache slot `slot`, calling `on_text` with each piece of final
/// text. The slot keeps the prompt and generated tokens for reuse by a following request.
pub fn generate(
    model: &dyn CausalLm,
    tok: &Tokenizer,
    cache: &mut SlotCache,
    slot: usize,
    req: &GenerateRequest,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput> {
    if req.prompt.is_empty() {
        return Err(EngineError::BadRequest("empty prompt".into()));
    }
    if req.prefill_chunk == 0 {
        return Err(EngineError::BadRequest("prefill chunk must be >= 1".into()));
    }
    let n_vocab = model.spec().n_vocab;
    if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(EngineError::BadRequest(format!(
            "prompt token {t} is outside the vocabulary ({n_vocab})"
        )));
    }
    let n_ctx = cache.n_ctx();
    if req.prompt.len() >= n_ctx {
        return Err(EngineError::BadRequest(format!(
            "prompt of {} tokens does not fit the context of {n_ctx} tokens",
            req.prompt.len()
        )));
    }
    let mut sampler = Sampler::new(req.sampling.clone())?;

    let t0 = Instant::now();
    let n_cached = cache.reusable_prefix(slot, &req.prompt);
    // Until the prefill succeeds the slot's contents are unknown.
    cache.set_tokens(slot, Vec::new());
    let mut logits = Vec::new();
    let mut pos = n_cached;
    for chunk in req.prompt[n_cached..].chunks(req.prefill_chunk) {
        let last = pos + chunk.len() == req.prompt.len();
        let rows = if last { vec![chunk.len() - 1] } else { vec![] };
        let out = model.forward(
            &BatchInputs::single(slot, chunk, pos as u32, rows),
            cache.kv_mut(),
        )?;
        pos += chunk.len();
        if last {
            logits = out.row(0).to_vec();
        }
    }
    let mut history = req.prompt.clone();
    cache.set_tokens(slot, history.clone());
    let prompt_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut dec = IncrementalDecoder::new();
    let mut stop = StopChecker::new(&req.stop);
    let mut text = String::new();
    let mut generated = Vec::new();
    let mut emit = |s: &str, text: &mut String| {
        if !s.is_empty() {
            on_text(s);
            text.push_str(s);
        }
    };
    let mut finish = FinishReason::Length;
    while generated.len() < req.max_tokens {
        let t = sampler.sample(&logits, &history);
        if !req.ignore_eos && tok.eog_ids().contains(&t) {
            finish = FinishReason::EndOfGeneration;
            break;
        }
        generated.push(t);
        history.push(t);
        let piece = dec.push(tok, t);
        let (out, hit) = stop.push(&piece);
        emit(&out, &mut text);
        if hit {
            finish = FinishReason::StopString;
            break;
        }
        if generated.len() == req.max_tokens {
            break;
        }
        if history.len() >= n_ctx {
            finish = FinishReason::ContextFull;
            break;
        }
        let p = history.len() - 1;
        let out = model.forward(
            &BatchInputs::single(slot, &[t], p as u32, vec![0]),
            cache.kv_mut(),
        )?;
        cache.set_tokens(slot, history.clone());
        logits = out.row(0).to_vec();
    }
    if finish != FinishReason::StopString {
        let (out, _) = stop.push(&dec.flush());
        emit(&out, &mut text);
        let rest = stop.finish();
        emit(&rest, &mut text);
    }
    Ok(GenerateOutput {
        tokens: generated,
        text,
        finish,
        n_prompt: req.prompt.len(),
        n_cached,
        prompt_secs,
        gen_secs: t1.elapsed().as_secs_f64(),
    })
}
