//! The draft-model proposer: a small model with the target's vocabulary, its own cache (one
//! slot per engine slot), run greedily.
//!
//! Each draft slot remembers the tokens its cache holds. To propose `k` tokens after a
//! sequence `h` (`h` = prompt and output so far, its last token not yet in the target's
//! cache), [`DraftRunner::propose`]:
//! 1. keeps the longest common prefix of the slot's tokens and `h` (at most `len(h) - 1`:
//!    the last token always runs, its logits give the first proposal) and drops the rest,
//!    which also rewinds rejected proposals of the previous round (the draft model has only
//!    attention layers, so rewinding is dropping KV rows);
//! 2. runs the missing tokens of `h` (a new prompt, or the tokens accepted since the last
//!    round), in chunks of at most [`CATCH_UP_CHUNK`] tokens per pass, all sequences in one
//!    batch; the argmax of the last row is the first proposal;
//! 3. feeds each proposal back, one token per sequence and pass, `k - 1` times.
//!
//! Proposals are greedy (the proposal puts all its mass on one token), so verification is
//! exact at any temperature ([`crate::Sampler::verify`]). A failed pass drops the slots it
//! touched (they catch up from scratch next time) and returns the error; the engine then
//! decodes without proposals for that step.

use std::sync::Arc;

use kapitsa_models::{BatchInputs, CausalLm, KvCache, KvType, ModelError};

use crate::sampler::argmax;

/// Most tokens of catch-up per sequence and pass.
pub const CATCH_UP_CHUNK: usize = 512;

/// A draft model with its cache (module docs).
pub struct DraftRunner {
    model: Arc<dyn CausalLm>,
    cache: KvCache,
    /// Per slot: the tokens its cache holds.
    held: Vec<Vec<u32>>,
}

impl std::fmt::Debug for DraftRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftRunner")
            .field("arch", &self.model.spec().arch)
            .field("n_slots", &self.held.len())
            .finish()
    }
}

/// What one sequence asks of [`DraftRunner::propose`].
#[derive(Debug, Clone, Copy)]
pub struct DraftAsk<'a> {
    /// The engine slot (the draft cache has one per engine slot).
    pub slot: usize,
    /// Prompt and output so far (non-empty).
    pub history: &'a [u32],
    /// Proposals wanted (>= 1).
    pub k: usize,
}

impl DraftRunner {
    /// A runner for `model` drafting for `target`: `n_slots` slots of `n_ctx` positions. The
    /// draft model must share the target's vocabulary size and have no recurrent layers.
    pub fn new(
        model: Arc<dyn CausalLm>,
        target: &dyn CausalLm,
        n_slots: usize,
        n_ctx: usize,
        kv_type: KvType,
    ) -> Result<DraftRunner, ModelError> {
        let (d, t) = (model.spec(), target.spec());
        if d.n_vocab != t.n_vocab {
            return Err(ModelError::Config(format!(
                "the draft model's vocabulary ({} tokens) differs from the model's ({})",
                d.n_vocab, t.n_vocab
            )));
        }
        if d.n_recurrent_layers() > 0 {
            return Err(ModelError::Config(format!(
                "draft model ({}) has recurrent layers; a draft model must be attention-only \
                 (qwen2, qwen3, qwen3moe)",
                d.arch
            )));
        }
        let cache = kapitsa_models::new_cache(&*model, n_slots, n_ctx, kv_type)?;
        Ok(DraftRunner {
            model,
            cache,
            held: vec![Vec::new(); n_slots],
        })
    }

    /// The draft model.
    pub fn model(&self) -> &Arc<dyn CausalLm> {
        &self.model
    }

    /// Forget what `slot` holds.
    pub fn clear(&mut self, slot: usize) {
        if let Some(h) = self.held.get_mut(slot) {
            h.clear();
        }
        self.cache.truncate(slot, 0);
    }

    /// Up to `k` greedy proposals for each ask (module docs), in ask order. Fewer when the
    /// context ends first. Every ask needs its own slot.
    pub fn propose(&mut self, asks: &[DraftAsk<'_>]) -> Result<Vec<Vec<u32>>, ModelError> {
        let r = self.propose_inner(asks);
        if r.is_err() {
            for a in asks {
                self.clear(a.slot);
            }
        }
        r
    }

    fn propose_inner(&mut self, asks: &[DraftAsk<'_>]) -> Result<Vec<Vec<u32>>, ModelError> {
        let n_ctx = self.cache.n_ctx();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); asks.len()];
        // Proposals each ask can take: position len(h) - 1 + k must stay inside the context.
        let want: Vec<usize> = asks
            .iter()
            .map(|a| a.k.min((n_ctx + 1).saturating_sub(a.history.len())))
            .collect();
        // 1. keep the common prefix
        for a in asks {
            let Some(held) = self.held.get_mut(a.slot) else {
                return Err(ModelError::Batch(format!(
                    "draft slot {} out of range",
                    a.slot
                )));
            };
            if a.history.is_empty() {
                return Err(ModelError::Batch("empty history".into()));
            }
            let keep = held
                .iter()
                .zip(a.history)
                .take_while(|(x, y)| x == y)
                .count()
                .min(a.history.len() - 1);
            held.truncate(keep);
            self.cache.truncate(a.slot, keep);
        }
        // 2. catch up, in chunks
        loop {
            let mut batch = BatchInputs::default();
            let mut rows: Vec<usize> = Vec::new(); // ask index per logit row
            for (i, a) in asks.iter().enumerate() {
                if want[i] == 0 {
                    continue;
                }
                let held = self.held[a.slot].len();
                if held >= a.history.len() {
                    continue;
                }
                let n = (a.history.len() - held).min(CATCH_UP_CHUNK);
                let last = held + n == a.history.len();
                self.cache.prepare(a.slot, held, n)?;
                batch.push_seq(a.slot, &a.history[held..held + n], held as u32, last);
                if last {
                    rows.push(i);
                }
            }
            if batch.n_tokens() == 0 {
                break;
            }
            batch.argmax_rows = vec![true; batch.logit_rows.len()];
            let logits = self.model.forward(&batch, &mut self.cache)?;
            for c in &batch.seqs {
                let toks = &batch.tokens[c.start..c.start + c.len];
                self.held[c.slot].extend_from_slice(toks);
            }
            for (r, &i) in rows.iter().enumerate() {
                out[i].push(row_argmax(&logits, r));
            }
        }
        // 3. feed the proposals back
        loop {
            let mut batch = BatchInputs::default();
            let mut rows: Vec<usize> = Vec::new();
            for (i, a) in asks.iter().enumerate() {
                if out[i].is_empty() || out[i].len() >= want[i] {
                    continue;
                }
                let pos = self.held[a.slot].len();
                let Some(&t) = out[i].last() else { continue };
                self.cache.prepare(a.slot, pos, 1)?;
                batch.push_seq(a.slot, &[t], pos as u32, true);
                rows.push(i);
            }
            if batch.n_tokens() == 0 {
                break;
            }
            batch.argmax_rows = vec![true; batch.logit_rows.len()];
            let logits = self.model.forward(&batch, &mut self.cache)?;
            for (r, &i) in rows.iter().enumerate() {
                let slot = asks[i].slot;
                if let Some(&t) = out[i].last() {
                    self.held[slot].push(t);
                }
                out[i].push(row_argmax(&logits, r));
            }
        }
        for (o, &w) in out.iter_mut().zip(&want) {
            o.truncate(w);
        }
        Ok(out)
    }
}

/// The greedy token of logit row `r` (computed by the backend when the batch asked for it).
fn row_argmax(logits: &kapitsa_models::Logits, r: usize) -> u32 {
    match logits.get(r) {
        kapitsa_models::LogitRow::Argmax(t) => t,
        kapitsa_models::LogitRow::Values(v) => argmax(v) as u32,
    }
}
