//! Drafting with a model's own multi-token-prediction (MTP) head: Qwen3.5 / Qwen3.6 `mtp.*`
//! and Nemotron 3 `mtp.layers.{0,1}.*` (GGUF: the `nextn.*` block after the trunk).
//!
//! References: vLLM `model_executor/models/qwen3_5_mtp.py` and `nemotron_h_mtp.py` (the
//! module and the chained reuse of its single layer), llama.cpp `src/models/qwen35moe.cpp`
//! (`graph_mtp`). Checked against a PyTorch evaluation of the same formulas
//! (`tools/gen_mtp_fixtures.py`, the decoder layer being transformers' own class) by
//! `crates/models/tests/mtp.rs`. The engine contract: docs/mtp.md.
//!
//! # Math (per sequence)
//! A **row** at position `p` reads the trunk's hidden state `h_p` of the token at `p` (taps of
//! the last trunk layer, [`MtpDrafter::tap_layers`], put through the trunk's final norm
//! here) and the token `x_{p+1}` after it, and predicts `x_{p+2}`:
//! ```text
//! u    = Wfc · [ rmsnorm(embed(x_{p+1}), enorm) | rmsnorm(h_p, hnorm) ]   embedding first
//! u   += Attn(rmsnorm(u, attn_norm))     at RoPE position p, causal over the sequence's rows
//! u   += FFN(rmsnorm(u, ffn_norm))       the head's MoE (or MLP)
//! d_p  = rmsnorm(u, head_norm);   logits_p = lm_head(d_p)    (the target's LM head)
//! ```
//! Committed rows keep their attention K/V in the [`MtpState`]. Drafting after an anchor
//! `x_P` (the last committed token) starts from the row at `P - 1`, which read the anchor:
//! draft 1 is the argmax of its logits; draft `i + 1` comes from a transient row at
//! `P + i - 1` made of the previous row's `d` (in place of a trunk hidden state, which the
//! drafts do not have) and draft `i`: the single MTP layer is chained (vLLM reuses it
//! per step; `d` is the post-`head_norm` hidden, as vLLM feeds it back).
//!
//! Only a row whose output is wanted runs the whole layer: appending `m` committed rows
//! computes K/V for all of them and the attention output, FFN and `d` for the last one.
//!
//! # Where it runs
//! Every product, norm, RoPE and the attention are [`Backend`] ops on the target's backend
//! (the head's weights are uploaded there by [`MtpDrafter::for_model`]); the embedding rows
//! and the LM head are the target's ([`CausalLm::embed_tokens`], [`CausalLm::output_head`]).
//! Logits rows come to the host for the argmax.

use std::sync::Arc;

use kapitsa_backend::{AttnShape, Backend, DType, Epilogue, Tensor};

use crate::dflash::{argmax, sample, softmax, Draft, Sampling};
use crate::layers::attention::DeviceAttention;
use crate::layers::decoder::{Block, BlockOp};
use crate::layers::ffn::DeviceFfn;
use crate::layers::{check_positions, check_vec, positions_batch, tensor};
use crate::{CausalLm, ModelError, Result, Weight};

/// The most tokens one [`MtpDrafter::draft`] chains (engines use 1–4; acceptance falls
/// geometrically with depth).
pub const MAX_DRAFT: usize = 16;

/// A model's MTP head as loaded (host weights), lent by [`CausalLm::mtp_parts`] to
/// [`MtpDrafter::for_model`]. Norm weights include any `1 + w` offset.
pub struct MtpParts<'a> {
    /// `[n_embd, 2 n_embd]`: input columns `0..n_embd` take the normed embedding of the next
    /// token, `n_embd..` the normed hidden state (Qwen `mtp.fc`, Nemotron `eh_proj`, GGUF
    /// `nextn.eh_proj`).
    pub fc: &'a Weight,
    /// Norm of the next token's embedding (`pre_fc_norm_embedding` / `enorm`).
    pub embed_norm: &'a [f32],
    /// Norm of the hidden state (`pre_fc_norm_hidden` / `hnorm`).
    pub hidden_norm: &'a [f32],
    /// The trunk's final norm, applied to the tapped hidden state (the head reads the
    /// trunk's hidden after its final norm).
    pub trunk_norm: &'a [f32],
    /// The attention block, then the FFN block (each with its pre-norm).
    pub blocks: &'a [Block],
    /// Norm before the LM head (`mtp.norm` / `final_layernorm` / `shared_head_norm`).
    pub head_norm: &'a [f32],
    /// RMSNorm epsilon of the head's norms.
    pub eps: f32,
}

/// A loaded MTP drafter for one target model, its weights on the target's backend.
pub struct MtpDrafter {
    backend: Arc<dyn Backend>,
    n_embd: usize,
    n_vocab: usize,
    eps: f32,
    /// `Wfc[:, :n_embd]` and `Wfc[:, n_embd:]` (the concatenation as two products).
    fc_embed: kapitsa_backend::Weight,
    fc_hidden: kapitsa_backend::Weight,
    embed_norm: Tensor,
    hidden_norm: Tensor,
    trunk_norm: Tensor,
    attn_norm: Tensor,
    attn: DeviceAttention,
    ffn_norm: Tensor,
    ffn: DeviceFfn,
    head_norm: Tensor,
    /// `[n_layer - 1]`: the trunk layer whose output the rows read.
    taps: Vec<usize>,
}

/// The output of a sequence's last row: `d` (`[n_embd]` on the backend), the row's
/// position and the token it read.
struct LastRow {
    pos: u32,
    next_token: u32,
    hidden: Tensor,
}

/// One sequence's MTP context: the attention K and V of its committed rows
/// (`[capacity, kv_dim]` f32 on the backend), their positions (strictly increasing) and the
/// output of the last row appended. Made by [`MtpDrafter::new_state`].
pub struct MtpState {
    k: Option<Tensor>,
    v: Option<Tensor>,
    positions: Vec<u32>,
    capacity: usize,
    last: Option<LastRow>,
}

impl MtpState {
    /// Rows held.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// The position after the last row (0 when empty): the smallest position the next
    /// [`MtpDrafter::append_context`] may start at, and the anchor position
    /// [`MtpDrafter::draft`] expects.
    pub fn next_pos(&self) -> u32 {
        self.positions.last().map_or(0, |p| p + 1)
    }

    /// Drop the rows at positions `>= n_pos`. The row at `p` read the token at `p + 1`: when
    /// the sequence is cut back to its first `n` tokens, call `truncate(n - 1)`. Drafting
    /// needs a new [`MtpDrafter::append_context`] when the last row was dropped.
    pub fn truncate(&mut self, n_pos: u32) {
        let keep = self.positions.partition_point(|&p| p < n_pos);
        self.positions.truncate(keep);
        if self.last.as_ref().is_some_and(|l| l.pos >= n_pos) {
            self.last = None;
        }
    }

    /// Drop all rows (the tensors are kept for reuse).
    pub fn clear(&mut self) {
        self.positions.clear();
        self.last = None;
    }
}

/// A vector of `len` values uploaded as f32, its length checked.
fn upload_vec(be: &dyn Backend, name: &str, v: &[f32], len: usize) -> Result<Tensor> {
    check_vec(name, v, len)?;
    Ok(be.upload_f32(v)?)
}

impl MtpDrafter {
    /// The drafter of `target`'s own MTP head, uploaded to the target's backend. Errors when
    /// the target has no MTP head ([`CausalLm::mtp_parts`]: an architecture without one, or
    /// a file without its weights), or when the head's shapes do not fit the target.
    pub fn for_model(target: &dyn CausalLm) -> Result<MtpDrafter> {
        let spec = target.spec();
        let parts = target.mtp_parts().ok_or_else(|| {
            ModelError::Config(format!(
                "the {} model has no MTP head (no multi-token-prediction weights in its file)",
                spec.arch
            ))
        })?;
        let be = target.backend().clone();
        let d = spec.n_embd;
        let [attn_block, ffn_block] = parts.blocks else {
            return Err(ModelError::Config(format!(
                "MTP head: {} blocks (expected attention + FFN)",
                parts.blocks.len()
            )));
        };
        let (BlockOp::Attention(attn), BlockOp::Ffn(ffn)) = (&attn_block.op, &ffn_block.op) else {
            return Err(ModelError::Config(
                "MTP head: expected an attention block then an FFN block".into(),
            ));
        };
        attn.validate(d, attn_block.layer)?;
        ffn.validate(d)?;
        if parts.fc.shape != [d, 2 * d] {
            return Err(ModelError::BadShape {
                name: parts.fc.name.clone(),
                got: parts.fc.shape.clone(),
                want: vec![d, 2 * d],
            });
        }
        if parts.eps.is_nan() || parts.eps <= 0.0 {
            return Err(ModelError::Config(
                "MTP head: rms_eps must be positive".into(),
            ));
        }
        let n_layer = spec.layers.len();
        let tap = n_layer
            .checked_sub(1)
            .ok_or_else(|| ModelError::Config("MTP head on a model without layers".into()))?;
        let (fc_e, fc_h) = parts.fc.split_cols(d)?;
        let b = &*be;
        Ok(MtpDrafter {
            n_embd: d,
            n_vocab: spec.n_vocab,
            eps: parts.eps,
            fc_embed: fc_e.upload(b)?,
            fc_hidden: fc_h.upload(b)?,
            embed_norm: upload_vec(b, "MTP embedding norm", parts.embed_norm, d)?,
            hidden_norm: upload_vec(b, "MTP hidden norm", parts.hidden_norm, d)?,
            trunk_norm: upload_vec(b, "output_norm", parts.trunk_norm, d)?,
            attn_norm: upload_vec(b, "MTP attention norm", &attn_block.norm, d)?,
            attn: attn.upload(b)?,
            ffn_norm: upload_vec(b, "MTP FFN norm", &ffn_block.norm, d)?,
            ffn: ffn.upload(b)?,
            head_norm: upload_vec(b, "MTP head norm", parts.head_norm, d)?,
            taps: vec![tap],
            backend: be,
        })
    }

    /// The target layer to tap ([`crate::BatchInputs::tap_layers`]) for
    /// [`MtpDrafter::append_context`]: the last one (its output before the final norm).
    pub fn tap_layers(&self) -> &[usize] {
        &self.taps
    }

    /// Width of one row of taps (`n_embd`).
    pub fn tap_width(&self) -> usize {
        self.n_embd
    }

    /// The most tokens one draft gives ([`MAX_DRAFT`]).
    pub fn max_draft(&self) -> usize {
        MAX_DRAFT
    }

    /// An empty context for one sequence.
    pub fn new_state(&self) -> MtpState {
        MtpState {
            k: None,
            v: None,
            positions: Vec::new(),
            capacity: 0,
            last: None,
        }
    }

    /// Make room for `rows` K/V rows, keeping the rows held.
    fn reserve(&self, state: &mut MtpState, rows: usize) -> Result<()> {
        if rows <= state.capacity && state.k.is_some() && state.v.is_some() {
            return Ok(());
        }
        let be = &*self.backend;
        let kv = self.attn.kv_dim();
        let cap = rows.max(2 * state.capacity).max(64);
        let held = state.len() * kv;
        let grow = |old: Option<&Tensor>| -> Result<Tensor> {
            let mut t = be.alloc(DType::F32, cap * kv)?;
            if let Some(o) = old.filter(|_| held > 0) {
                be.copy(o, 0, &mut t, 0, held)?;
            }
            Ok(t)
        };
        let k = grow(state.k.as_ref())?;
        let v = grow(state.v.as_ref())?;
        state.k = Some(k);
        state.v = Some(v);
        state.capacity = cap;
        Ok(())
    }

    /// Add committed rows: `taps` `[m, tap_width()]` are the target's taps
    /// ([`crate::Logits::taps`] with [`MtpDrafter::tap_layers`]) of the tokens at positions
    /// `start_pos .. start_pos + m`, and `next_tokens` the `m` tokens after them (the
    /// sequence's tokens at `start_pos + 1 ..= start_pos + m`: the last one is the token
    /// sampled after the chunk). `start_pos` must be at least [`MtpState::next_pos`] (a gap,
    /// e.g. a prefix restored without taps, is allowed: the head sees less context). Runs
    /// the whole layer for the last row only; its output is what [`MtpDrafter::draft`]
    /// starts from.
    pub fn append_context(
        &self,
        target: &dyn CausalLm,
        state: &mut MtpState,
        taps: &[f32],
        next_tokens: &[u32],
        start_pos: u32,
    ) -> Result<()> {
        let d = self.n_embd;
        if taps.is_empty() && next_tokens.is_empty() {
            return Ok(());
        }
        if !taps.len().is_multiple_of(d) || taps.len() / d != next_tokens.len() {
            return Err(ModelError::Batch(format!(
                "{} tap values for {} next tokens (rows of {d})",
                taps.len(),
                next_tokens.len()
            )));
        }
        if start_pos < state.next_pos() {
            return Err(ModelError::Batch(format!(
                "MTP rows at position {start_pos} but the head holds up to {}",
                state.next_pos()
            )));
        }
        self.check_tokens(next_tokens)?;
        let m = next_tokens.len();
        check_positions(start_pos, m)?;
        let be = &*self.backend;
        let kv = self.attn.kv_dim();
        // u = fc · [enorm(embed(x_{p+1})) | hnorm(trunk_norm(h_p))]
        let mut h = be.upload_f32(taps)?;
        be.rms_norm(&mut h, d, &self.trunk_norm, self.eps)?;
        let mut u = self.fuse(target, &h, next_tokens)?;
        // K/V of every row
        let mut x = tensor(be, m * d)?;
        be.rms_norm_to(&u, &mut x, d, &self.attn_norm, self.eps)?;
        let batch = positions_batch(be, vec![0; m], start_pos)?;
        let (k, v) = self.attn.keys_values(be, &x, m, &batch)?;
        let n_ctx = state.len();
        self.reserve(state, n_ctx + m)?;
        let (Some(ks), Some(vs)) = (state.k.as_mut(), state.v.as_mut()) else {
            return Err(ModelError::Batch("MTP state without K/V storage".into()));
        };
        be.copy(&k, 0, ks, n_ctx * kv, m * kv)?;
        be.copy(&v, 0, vs, n_ctx * kv, m * kv)?;
        state.positions.extend((0..m as u32).map(|i| start_pos + i));
        // the whole layer for the last row
        let last_pos = start_pos + (m as u32 - 1);
        if m > 1 {
            let mut u1 = tensor(be, d)?;
            let mut x1 = tensor(be, d)?;
            be.copy(&u, (m - 1) * d, &mut u1, 0, d)?;
            be.copy(&x, (m - 1) * d, &mut x1, 0, d)?;
            u = u1;
            x = x1;
        }
        let hidden = self.finish_row(state, &mut u, &x, last_pos, state.len())?;
        state.last = Some(LastRow {
            pos: last_pos,
            next_token: next_tokens[m - 1],
            hidden,
        });
        Ok(())
    }

    /// Draft `n` tokens (`1 ..= max_draft()`) after `anchor`, the last committed token, at
    /// `anchor_pos`: the state's last row must be the one at `anchor_pos - 1` that read the
    /// anchor ([`MtpDrafter::append_context`]). Greedy: the argmax of each step's logits,
    /// chained through the MTP layer. `state` is borrowed mutably for the chained rows'
    /// transient K/V; its context is unchanged. [`Draft::candidates`] is empty.
    pub fn draft(
        &self,
        target: &dyn CausalLm,
        state: &mut MtpState,
        anchor: u32,
        anchor_pos: u32,
        n: usize,
    ) -> Result<Draft> {
        self.draft_with(target, state, anchor, anchor_pos, n, None)
    }

    /// [`MtpDrafter::draft`] sampled at `sampling.temperature > 0`: each step's token is
    /// drawn from `softmax(logits / T)` over the full vocabulary (for top-k / top-p, sample
    /// from [`Draft::logits`] in the engine's sampler and draft one step at a time instead).
    pub fn draft_sampled(
        &self,
        target: &dyn CausalLm,
        state: &mut MtpState,
        anchor: u32,
        anchor_pos: u32,
        n: usize,
        sampling: Sampling<'_>,
    ) -> Result<Draft> {
        let t = sampling.temperature;
        if t.is_nan() || t <= 0.0 {
            return Err(ModelError::Batch(format!(
                "sampling temperature {t} (use draft() for greedy)"
            )));
        }
        self.draft_with(target, state, anchor, anchor_pos, n, Some(sampling))
    }

    fn draft_with(
        &self,
        target: &dyn CausalLm,
        state: &mut MtpState,
        anchor: u32,
        anchor_pos: u32,
        n: usize,
        mut sampling: Option<Sampling<'_>>,
    ) -> Result<Draft> {
        if n == 0 || n > MAX_DRAFT {
            return Err(ModelError::Batch(format!(
                "draft of {n} tokens (1 ..= {MAX_DRAFT})"
            )));
        }
        let Some(last) = state.last.as_ref() else {
            return Err(ModelError::Batch(
                "no MTP row to draft from: append the committed rows first".into(),
            ));
        };
        if last.pos.checked_add(1) != Some(anchor_pos) || last.next_token != anchor {
            return Err(ModelError::Batch(format!(
                "anchor {anchor} at position {anchor_pos}, but the last MTP row is at {} and \
                 read token {} (append the rows up to the anchor first)",
                last.pos, last.next_token
            )));
        }
        check_positions(anchor_pos, n)?;
        let be = &*self.backend;
        let (d, v) = (self.n_embd, self.n_vocab);
        let mut prev = tensor(be, d)?;
        be.copy(&last.hidden, 0, &mut prev, 0, d)?;
        let n_ctx = state.len();
        self.reserve(state, n_ctx + n)?;
        let mut tokens = Vec::with_capacity(n);
        let mut logits = vec![0f32; n * v];
        let mut out = tensor(be, v)?;
        for i in 0..n {
            if i > 0 {
                // the transient row at anchor_pos + i - 1: (d of the previous row, draft i)
                let pos = anchor_pos + (i as u32 - 1);
                prev = self.transient_row(target, state, &prev, tokens[i - 1], pos, n_ctx + i)?;
            }
            target.output_head(&prev, 1, &mut out)?;
            let row = &mut logits[i * v..(i + 1) * v];
            be.read_f32(&out, 0, row)?;
            let t = match sampling.as_mut() {
                None => argmax(row),
                Some(s) => sample(&softmax(row, s.temperature), (s.uniform)()),
            };
            tokens.push(t);
        }
        Ok(Draft {
            tokens,
            logits,
            n_vocab: v,
            candidates: Vec::new(),
        })
    }

    /// One chained row: `u = fc · [enorm(embed(token)) | hnorm(prev)]` at `pos`, its K/V at
    /// row `at - 1` of the state (beyond the committed rows), then the layer; returns `d`.
    fn transient_row(
        &self,
        target: &dyn CausalLm,
        state: &mut MtpState,
        prev: &Tensor,
        token: u32,
        pos: u32,
        at: usize,
    ) -> Result<Tensor> {
        let be = &*self.backend;
        let d = self.n_embd;
        let kv = self.attn.kv_dim();
        let mut u = self.fuse(target, prev, &[token])?;
        let mut x = tensor(be, d)?;
        be.rms_norm_to(&u, &mut x, d, &self.attn_norm, self.eps)?;
        let batch = positions_batch(be, vec![0], pos)?;
        let (k, v) = self.attn.keys_values(be, &x, 1, &batch)?;
        let (Some(ks), Some(vs)) = (state.k.as_mut(), state.v.as_mut()) else {
            return Err(ModelError::Batch("MTP state without K/V storage".into()));
        };
        be.copy(&k, 0, ks, (at - 1) * kv, kv)?;
        be.copy(&v, 0, vs, (at - 1) * kv, kv)?;
        self.finish_row(state, &mut u, &x, pos, at)
    }

    /// `fc · [enorm(embed(tokens)) | hnorm(hidden)]` for `tokens.len()` rows; `hidden`
    /// `[rows, n_embd]` is already through the trunk's final norm (or is a chained `d`).
    fn fuse(&self, target: &dyn CausalLm, hidden: &Tensor, tokens: &[u32]) -> Result<Tensor> {
        let be = &*self.backend;
        let (d, m) = (self.n_embd, tokens.len());
        let mut e = tensor(be, m * d)?;
        target.embed_tokens(tokens, &mut e)?;
        be.rms_norm(&mut e, d, &self.embed_norm, self.eps)?;
        let mut hh = tensor(be, m * d)?;
        be.rms_norm_to(hidden, &mut hh, d, &self.hidden_norm, self.eps)?;
        let mut u = tensor(be, m * d)?;
        be.matmul(&self.fc_embed, &e, m, &mut u)?;
        let acc = Epilogue {
            bias: None,
            accumulate: true,
        };
        be.matmul_with(&self.fc_hidden, &hh, m, &mut u, acc)?;
        Ok(u)
    }

    /// The rest of the layer for one row whose K/V are already at row `keys - 1` of the
    /// state: attention over rows `0 .. keys` (the causal span: every row held is at an
    /// earlier position), the FFN block and the head norm. `u` is the row's input (updated
    /// in place), `x` its attention pre-norm; returns `d` `[n_embd]`.
    fn finish_row(
        &self,
        state: &MtpState,
        u: &mut Tensor,
        x: &Tensor,
        pos: u32,
        keys: usize,
    ) -> Result<Tensor> {
        let be = &*self.backend;
        let d = self.n_embd;
        let (Some(ks), Some(vs)) = (state.k.as_ref(), state.v.as_ref()) else {
            return Err(ModelError::Batch("MTP state without K/V storage".into()));
        };
        let batch = positions_batch(be, vec![0], pos)?;
        let (q, gate) = self.attn.queries(be, x, 1, &batch)?;
        let shape: AttnShape = self.attn.shape();
        let mut att = tensor(be, self.attn.q_dim())?;
        be.attention_spans(shape, &q, ks, vs, &[(0, keys as u32)], &mut att)?;
        self.attn.output_add(be, &mut att, gate.as_ref(), 1, u)?;
        let mut hn = tensor(be, d)?;
        be.rms_norm_to(u, &mut hn, d, &self.ffn_norm, self.eps)?;
        self.ffn.forward_add(be, &hn, 1, u)?;
        let mut out = tensor(be, d)?;
        be.rms_norm_to(u, &mut out, d, &self.head_norm, self.eps)?;
        Ok(out)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        match tokens.iter().find(|&&t| t as usize >= self.n_vocab) {
            Some(t) => Err(ModelError::Batch(format!(
                "token {t} outside the vocabulary ({})",
                self.n_vocab
            ))),
            None => Ok(()),
        }
    }
}
