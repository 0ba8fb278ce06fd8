//! The flat batch a forward pass consumes and the logits it returns.

use std::ops::Range;
use std::sync::Arc;

use crate::{ModelError, Result};

/// Input embedding rows given directly instead of looked up from the tokens (an image's
/// features from the vision tower): row `rows.start + i` of `data` replaces the embedding of
/// flat token `start + i`.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedRows {
    /// Flat index of the first token replaced.
    pub start: usize,
    /// Host rows `[n, n_embd]` row-major f32 (shared: an image's rows may feed several
    /// prefill chunks).
    pub data: Arc<Vec<f32>>,
    /// The rows of `data` used, in row units.
    pub rows: Range<usize>,
}

/// The new tokens of one sequence inside a [`BatchInputs`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqChunk {
    /// Cache slot of the sequence (`< KvCache::n_slots()`).
    pub slot: usize,
    /// First index of this sequence's tokens in the flat arrays.
    pub start: usize,
    /// Number of new tokens (>= 1).
    pub len: usize,
}

/// A step's input: several sequences, each with one or more new tokens (prefill chunks,
/// decode steps and speculative verification all look the same).
///
/// Invariants (checked by [`BatchInputs::validate`]): `tokens.len() == positions.len()`; the
/// chunks tile `0..tokens.len()` in order; within a chunk positions are consecutive
/// (`p, p+1, ...`), and position `p` means the slot already holds positions `0..p`;
/// every `logit_rows` entry is `< tokens.len()`; `mrope` is empty or one triple per token;
/// `embeds` lie inside the batch.
#[derive(Debug, Clone, Default)]
pub struct BatchInputs {
    /// Token ids, `[n_tokens]`.
    pub tokens: Vec<u32>,
    /// Position of each token in its sequence, `[n_tokens]`.
    pub positions: Vec<u32>,
    /// Per-sequence chunks.
    pub seqs: Vec<SeqChunk>,
    /// Flat token indices whose logits are wanted, in output order.
    pub logit_rows: Vec<usize>,
    /// Per entry of `logit_rows`, whether only that row's argmax is wanted (greedy sampling
    /// with nothing applied to the logits first): the backend computes it and the row's
    /// values never leave the device ([`Logits::argmax`]). Empty (the default): every row in
    /// full. Ignored by hidden-state passes.
    pub argmax_rows: Vec<bool>,
    /// Layers whose output is returned for every token of the batch in [`Logits::taps`]
    /// (block drafters such as DFlash read these): id `l` is the residual stream after
    /// decoder layer `l`, before the final norm (transformers' `hidden_states[l + 1]`), each
    /// `< n_layer`. Empty (the default) costs nothing.
    pub tap_layers: Vec<usize>,
    /// Embedding rows that replace the token table's (image features); empty: none. A batch
    /// with any is not recorded.
    pub embeds: Vec<EmbedRows>,
    /// Multimodal rotary positions (M-RoPE), `[n_tokens]` of (temporal, height, width);
    /// empty: every token's rotary position is its position. Only for models with
    /// multimodal rotary sections ([`crate::ModelSpec::mrope`]).
    pub mrope: Vec<[u32; 3]>,
}

impl BatchInputs {
    /// A batch with one sequence: `tokens` at positions `start_pos..`, logits for the rows in
    /// `logit_rows`.
    pub fn single(slot: usize, tokens: &[u32], start_pos: u32, logit_rows: Vec<usize>) -> Self {
        let mut b = BatchInputs::default();
        b.push_seq(slot, tokens, start_pos, false);
        b.logit_rows = logit_rows;
        b
    }

    /// Append a sequence chunk; with `want_last` its last token's logits are requested.
    pub fn push_seq(&mut self, slot: usize, tokens: &[u32], start_pos: u32, want_last: bool) {
        let start = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((0..tokens.len() as u32).map(|i| start_pos + i));
        self.seqs.push(SeqChunk {
            slot,
            start,
            len: tokens.len(),
        });
        if want_last && !tokens.is_empty() {
            self.logit_rows.push(start + tokens.len() - 1);
        }
    }

    /// Number of tokens in the batch.
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Check the invariants listed on the type.
    pub fn validate(&self, n_slots: usize) -> Result<()> {
        let bad = |m: String| Err(ModelError::Batch(m));
        if self.tokens.len() != self.positions.len() {
            return bad(format!(
                "{} tokens but {} positions",
                self.tokens.len(),
                self.positions.len()
            ));
        }
        let mut next = 0;
        let mut seen = vec![false; n_slots];
        for c in &self.seqs {
            if c.start != next || c.len == 0 {
                return bad(format!(
                    "sequence chunks must tile the batch (chunk at {} len {})",
                    c.start, c.len
                ));
            }
            if c.slot >= n_slots {
                return bad(format!("slot {} out of range ({} slots)", c.slot, n_slots));
            }
            if std::mem::replace(&mut seen[c.slot], true) {
                return bad(format!("slot {} appears twice in one batch", c.slot));
            }
            let p = &self.positions[c.start..c.start + c.len];
            if p.windows(2).any(|w| w[1] != w[0] + 1) {
                return bad(format!("positions of slot {} are not consecutive", c.slot));
            }
            next += c.len;
        }
        if next != self.tokens.len() {
            return bad(format!(
                "chunks cover {next} of {} tokens",
                self.tokens.len()
            ));
        }
        if let Some(r) = self.logit_rows.iter().find(|&&r| r >= self.tokens.len()) {
            return bad(format!("logit row {r} out of range"));
        }
        if !self.argmax_rows.is_empty() && self.argmax_rows.len() != self.logit_rows.len() {
            return bad(format!(
                "{} argmax flags for {} logit rows",
                self.argmax_rows.len(),
                self.logit_rows.len()
            ));
        }
        if !self.mrope.is_empty() && self.mrope.len() != self.tokens.len() {
            return bad(format!(
                "{} multimodal positions for {} tokens",
                self.mrope.len(),
                self.tokens.len()
            ));
        }
        for e in &self.embeds {
            if e.rows.start > e.rows.end || e.start + e.rows.len() > self.tokens.len() {
                return bad(format!(
                    "embedding rows {:?} at token {} outside the batch of {}",
                    e.rows,
                    e.start,
                    self.tokens.len()
                ));
            }
        }
        Ok(())
    }
}

/// Logits for the requested rows: `data` is `[n, n_vocab]` row-major f32 for the `n` rows
/// returned in full (every row, unless [`BatchInputs::argmax_rows`] asked for some rows'
/// argmax only); with [`BatchInputs::tap_layers`], also the tapped hidden states of every
/// token.
#[derive(Debug, Clone, Default)]
pub struct Logits {
    /// Vocabulary size (row width).
    pub n_vocab: usize,
    /// The flat token index of each row (copied from `BatchInputs::logit_rows`).
    pub rows: Vec<usize>,
    /// Row-major values of the rows returned in full, in row order.
    pub data: Vec<f32>,
    /// Per row, its argmax where only that was asked for (`None`: the row is in `data`);
    /// empty when every row is returned in full.
    pub argmax: Vec<Option<u32>>,
    /// Tapped hidden states, `[n_tokens, tap_width]` row-major f32: per token of the batch
    /// (flat order), the outputs of the layers in `BatchInputs::tap_layers`, concatenated in
    /// request order. Empty without taps.
    pub taps: Vec<f32>,
    /// Width of a [`Logits::taps`] row: `tap_layers.len() * n_embd` (0 without taps).
    pub tap_width: usize,
}

/// One row of a step's [`Logits`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LogitRow<'a> {
    /// The row's values (`[n_vocab]`).
    Values(&'a [f32]),
    /// Only the row's argmax (lowest index among equal maxima; NaN never wins), computed
    /// by the backend.
    Argmax(u32),
}

impl Logits {
    /// Row `i` (the `i`-th requested token): its argmax when only that was asked for, else
    /// its values.
    pub fn get(&self, i: usize) -> LogitRow<'_> {
        if let Some(&Some(t)) = self.argmax.get(i) {
            return LogitRow::Argmax(t);
        }
        // rows returned in full before row i
        let k = match self.argmax.is_empty() {
            true => i,
            false => self.argmax[..i.min(self.argmax.len())]
                .iter()
                .filter(|a| a.is_none())
                .count(),
        };
        LogitRow::Values(&self.data[k * self.n_vocab..(k + 1) * self.n_vocab])
    }

    /// The values of row `i` (the `i`-th requested token), which must have been returned in
    /// full (see [`Logits::get`]); an argmax-only row gives an empty slice.
    pub fn row(&self, i: usize) -> &[f32] {
        match self.get(i) {
            LogitRow::Values(v) => v,
            LogitRow::Argmax(_) => &[],
        }
    }

    /// The tapped hidden states of flat tokens `tokens` (`[tokens.len(), tap_width]`), or
    /// `None` when nothing was tapped or the range is outside the batch.
    pub fn tap_rows(&self, tokens: std::ops::Range<usize>) -> Option<&[f32]> {
        if self.tap_width == 0 || tokens.start > tokens.end {
            return None;
        }
        self.taps
            .get(tokens.start * self.tap_width..tokens.end * self.tap_width)
    }
}
