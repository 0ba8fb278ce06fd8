//! The generic pre-norm residual decoder every supported architecture is an instance of:
//! `x = embed(tokens)`, then for each block `x = x + op(rmsnorm(x))`, then the final norm and the
//! output projection on the rows whose logits are asked for.
//!
//! A Qwen layer is two blocks with the same layer index (mixer, then FFN); a Nemotron-H layer is
//! one block (a mixer or an FFN). The cache is indexed by layer; the layer kinds of
//! [`ModelSpec`] follow from the blocks' ops.
//!
//! Activations are row-major `[n_tokens, n_embd]` f32 tensors over the whole batch on the
//! backend's device; attention and the recurrent mixers work per sequence inside their ops
//! (block tables and slots come with the batch). Only the requested logits rows come back to
//! the host.

use std::sync::{Arc, Mutex};

use kapitsa_backend::{Backend, Batch, BatchDesc, SeqDesc, Tensor};

use crate::layers::attention::{Attention, DeviceAttention};
use crate::layers::ffn::{DeviceFfn, Ffn};
use crate::layers::gdn::{DeviceGdn, GatedDeltaNet};
use crate::layers::mamba2::{DeviceMamba2, Mamba2};
use crate::layers::recorded::{self, Recordings};
use crate::layers::{check_matrix, check_vec, tensor, ForwardCtx};
use crate::{BatchInputs, KvCache, LayerKind, Logits, ModelError, ModelSpec, Result, Weight};

/// What a block computes.
// Blocks are few (two per layer), so variant size differences do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum BlockOp {
    /// Softmax attention (KV cache).
    Attention(Attention),
    /// Gated DeltaNet (recurrent state).
    Gdn(GatedDeltaNet),
    /// Mamba2 (recurrent state).
    Mamba2(Mamba2),
    /// MLP or MoE (no state).
    Ffn(Ffn),
}

/// One residual block: `x += op(rmsnorm(x, norm))`.
#[derive(Debug)]
pub struct Block {
    /// Model layer (cache index) this block belongs to.
    pub layer: usize,
    /// Pre-norm weight `[n_embd]` (already including any `1 + w` offset).
    pub norm: Vec<f32>,
    /// The op.
    pub op: BlockOp,
}

/// Everything but the blocks.
pub struct DecoderParts {
    /// Architecture name (GGUF spelling).
    pub arch: String,
    /// Training context.
    pub n_ctx_train: usize,
    /// Number of model layers (cache entries); blocks refer to `0..n_layer`.
    pub n_layer: usize,
    /// RMSNorm epsilon of the block and final norms.
    pub rms_eps: f32,
    /// Embedding `[n_vocab, n_embd]`.
    pub tok_embd: Weight,
    /// Final norm `[n_embd]`.
    pub out_norm: Vec<f32>,
    /// Output projection `[n_vocab, n_embd]`; `None` when tied to the embedding.
    pub output: Option<Weight>,
}

/// A block's op uploaded to the backend.
#[derive(Debug)]
enum DeviceOp {
    Attention(DeviceAttention),
    Gdn(DeviceGdn),
    Mamba2(DeviceMamba2),
    Ffn(DeviceFfn),
}

/// A [`Block`] uploaded to the backend.
#[derive(Debug)]
struct DeviceBlock {
    layer: usize,
    norm: Tensor,
    op: DeviceOp,
}

/// A whole model, its weights on the backend's device.
pub struct Decoder {
    spec: ModelSpec,
    backend: Arc<dyn Backend>,
    n_embd: usize,
    rms_eps: f32,
    tok_embd: kapitsa_backend::Weight,
    blocks: Vec<DeviceBlock>,
    out_norm: Tensor,
    /// `None` when tied to the embedding.
    output: Option<kapitsa_backend::Weight>,
    /// Recorded decode steps (layers/recorded.rs). Every forward pass holds this lock from
    /// start to end: passes from several threads (the engine, the embeddings endpoint) must
    /// not interleave their ops on a device backend's one stream, least of all while a step
    /// is being recorded.
    recordings: Mutex<Recordings>,
}

impl Decoder {
    /// Assemble and check a model.
    pub fn new(p: DecoderParts, blocks: Vec<Block>, backend: Arc<dyn Backend>) -> Result<Decoder> {
        let [n_vocab, d] = p.tok_embd.shape[..] else {
            return Err(ModelError::BadShape {
                name: p.tok_embd.name.clone(),
                got: p.tok_embd.shape.clone(),
                want: vec![0, 0],
            });
        };
        if n_vocab == 0 || d == 0 {
            return Err(ModelError::Config(format!(
                "{}: zero-sized embedding",
                p.arch
            )));
        }
        if p.rms_eps.is_nan() || p.rms_eps <= 0.0 {
            return Err(ModelError::Config(format!(
                "{}: rms_eps must be positive",
                p.arch
            )));
        }
        match &p.output {
            Some(o) => check_matrix(o, [n_vocab, d])?,
            None => check_matrix(&p.tok_embd, [n_vocab, d])?,
        }
        check_vec("output_norm", &p.out_norm, d)?;

        let mut layers = vec![LayerKind::Stateless; p.n_layer];
        let mut attn_dims: Option<(usize, usize)> = None;
        for b in &blocks {
            if b.layer >= p.n_layer {
                return Err(ModelError::Config(format!(
                    "block of layer {} in a {}-layer model",
                    b.layer, p.n_layer
                )));
            }
            check_vec(&format!("layer {} norm", b.layer), &b.norm, d)?;
            let kind = match &b.op {
                BlockOp::Attention(a) => {
                    a.validate(d, b.layer)?;
                    let dims = (a.n_head_kv, a.head_dim);
                    if attn_dims.is_some_and(|x| x != dims) {
                        return Err(ModelError::Config(
                            "attention layers disagree on KV heads / head_dim".into(),
                        ));
                    }
                    attn_dims = Some(dims);
                    Some(LayerKind::Attention)
                }
                BlockOp::Gdn(g) => {
                    g.validate(d, b.layer)?;
                    Some(LayerKind::Recurrent(g.recurrent_shape()))
                }
                BlockOp::Mamba2(m) => {
                    m.validate(d, b.layer)?;
                    Some(LayerKind::Recurrent(m.recurrent_shape()))
                }
                BlockOp::Ffn(f) => {
                    f.validate(d)?;
                    None
                }
            };
            if let Some(kind) = kind {
                if layers[b.layer] != LayerKind::Stateless {
                    return Err(ModelError::Config(format!(
                        "layer {} has two mixers",
                        b.layer
                    )));
                }
                layers[b.layer] = kind;
            }
        }
        let (n_head_kv, head_dim) = attn_dims.unwrap_or((0, 0));
        let be = &*backend;
        let blocks = blocks
            .iter()
            .map(|b| {
                Ok(DeviceBlock {
                    layer: b.layer,
                    norm: be.upload_f32(&b.norm)?,
                    op: match &b.op {
                        BlockOp::Attention(a) => DeviceOp::Attention(a.upload(be)?),
                        BlockOp::Gdn(g) => DeviceOp::Gdn(g.upload(be)?),
                        BlockOp::Mamba2(m) => DeviceOp::Mamba2(m.upload(be)?),
                        BlockOp::Ffn(f) => DeviceOp::Ffn(f.upload(be)?),
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // A tied embedding is also the output head: it needs the matrix kernels too.
        let tok_embd = match &p.output {
            Some(_) => p.tok_embd.upload_embedding(be)?,
            None => p.tok_embd.upload(be)?,
        };
        let output = p.output.as_ref().map(|o| o.upload(be)).transpose()?;
        let out_norm = be.upload_f32(&p.out_norm)?;
        let spec = ModelSpec {
            arch: p.arch,
            n_vocab,
            n_embd: d,
            n_ctx_train: p.n_ctx_train,
            layers,
            n_head_kv,
            head_dim,
            n_mtp_layers: 0,
            mrope: None,
        };
        Ok(Decoder {
            spec,
            backend,
            n_embd: d,
            rms_eps: p.rms_eps,
            tok_embd,
            blocks,
            out_norm,
            output,
            recordings: Mutex::new(Recordings::default()),
        })
    }

    /// The static spec.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Record that the model carries `n` MTP layers (see [`ModelSpec::n_mtp_layers`]).
    pub fn set_mtp_layers(&mut self, n: usize) {
        self.spec.n_mtp_layers = n;
    }

    /// Take multimodal positions with these rotary sections (see [`ModelSpec::mrope`]).
    pub fn set_mrope(&mut self, sections: [usize; 3]) {
        self.spec.mrope = Some(sections);
    }

    /// The backend the weights live on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// See [`crate::CausalLm::step_kernels`].
    pub fn step_kernels(&self) -> Option<usize> {
        self.recordings.lock().ok()?.last_kernels()
    }

    /// Forward pass over a batch (see [`crate::CausalLm::forward`]).
    pub fn forward(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits> {
        self.run(batch, cache, false)
    }

    /// Forward pass returning final-norm hidden rows (see
    /// [`crate::CausalLm::forward_hidden`]).
    pub fn forward_hidden(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits> {
        self.run(batch, cache, true)
    }

    /// The pass; `hidden`: stop after the final norm (rows `n_embd` wide) instead of
    /// applying the output head.
    fn run(&self, batch: &BatchInputs, cache: &mut KvCache, hidden: bool) -> Result<Logits> {
        batch.validate(cache.n_slots())?;
        let mut recordings = self
            .recordings
            .lock()
            .map_err(|_| ModelError::Batch("an earlier forward pass panicked".into()))?;
        let be = &*self.backend;
        let n_vocab = self.spec.n_vocab;
        for c in &batch.seqs {
            let last = batch.positions[c.start + c.len - 1] as usize;
            if last >= cache.n_ctx() {
                return Err(kapitsa_cache::CacheError::ContextFull {
                    pos: last,
                    n_ctx: cache.n_ctx(),
                }
                .into());
            }
        }
        if let Some(&bad) = batch
            .tap_layers
            .iter()
            .find(|&&l| l >= self.spec.layers.len())
        {
            return Err(ModelError::Batch(format!(
                "tap of layer {bad} in a {}-layer model",
                self.spec.layers.len()
            )));
        }
        if let Some(&bad) = batch.tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(ModelError::Batch(format!(
                "token id {bad} out of range (vocab {n_vocab})"
            )));
        }
        if !batch.mrope.is_empty() && self.spec.mrope.is_none() {
            return Err(ModelError::Batch(format!(
                "the {} model takes no multimodal positions",
                self.spec.arch
            )));
        }
        if let Some(e) = batch
            .embeds
            .iter()
            .find(|e| e.rows.end * self.n_embd > e.data.len())
        {
            return Err(ModelError::Batch(format!(
                "embedding rows {:?} beyond {} values of rows of {}",
                e.rows,
                e.data.len(),
                self.n_embd
            )));
        }
        for c in &batch.seqs {
            cache.prepare(c.slot, batch.positions[c.start] as usize, c.len)?;
        }
        if cache.has_recurrent() {
            // Check every chunk first so a bad one leaves the others' states untouched.
            for c in &batch.seqs {
                let pos0 = batch.positions[c.start] as usize;
                if pos0 != 0 && cache.recurrent_pos(c.slot) != Some(pos0) {
                    // begin_recurrent produces the descriptive error.
                    cache.begin_recurrent(c.slot, pos0)?;
                }
            }
            for c in &batch.seqs {
                cache.begin_recurrent(c.slot, batch.positions[c.start] as usize)?;
            }
        }

        let mut desc = BatchDesc {
            tokens: batch.tokens.clone(),
            positions: batch.positions.clone(),
            seqs: Vec::with_capacity(batch.seqs.len()),
            block_tables: Vec::new(),
            block_size: if cache.has_kv() {
                cache.block_size()
            } else {
                0
            },
            logit_rows: batch.logit_rows.iter().map(|&r| r as u32).collect(),
        };
        for c in &batch.seqs {
            let table = if cache.has_kv() {
                cache.table(c.slot)
            } else {
                &[]
            };
            desc.seqs.push(SeqDesc {
                slot: c.slot,
                start: c.start,
                len: c.len,
                pos0: batch.positions[c.start] as usize,
                table_start: desc.block_tables.len(),
                table_len: table.len(),
            });
            desc.block_tables.extend_from_slice(table);
        }
        if cache.has_kv() {
            for c in &batch.seqs {
                cache.check_writable(c.slot, batch.positions[c.start] as usize, c.len)?;
            }
        }

        let rows = &batch.logit_rows;
        let width = if hidden { self.n_embd } else { n_vocab };
        let argmax_only: &[bool] = if hidden { &[] } else { &batch.argmax_rows };
        let mut data = Vec::new();
        let mut argmax = Vec::new();
        let mut read = |t: &Tensor| -> Result<()> {
            (data, argmax) = read_rows(be, t, width, argmax_only)?;
            Ok(())
        };
        // A step is recorded unless an op reads back to the host (an MoE routed there); for
        // models with recurrent layers or MoE blocks unless `recorded::hybrids_on` is off.
        let taps = &batch.tap_layers;
        let has_moe = || {
            self.blocks
                .iter()
                .any(|b| matches!(b.op, DeviceOp::Ffn(DeviceFfn::Moe(_))))
        };
        let record = !hidden
            && taps.is_empty()
            && batch.embeds.is_empty()
            && batch.mrope.is_empty()
            && recorded::recordable(be, batch)
            && (recorded::hybrids_on() || (!cache.has_recurrent() && !has_moe()))
            && !self.blocks.iter().any(|b| match &b.op {
                DeviceOp::Ffn(DeviceFfn::Moe(w)) => be.moe_reads_back(w, batch.n_tokens()),
                _ => false,
            });
        let mut done = false;
        if record {
            let table_capacity = if cache.has_kv() {
                cache.n_ctx().div_ceil(cache.block_size())
            } else {
                0
            };
            done = recordings.step(
                be,
                cache.id(),
                desc.clone(),
                table_capacity,
                n_vocab,
                |dev_batch, logits| self.run_step(batch, dev_batch, cache, logits, false, None),
                &mut read,
            )?;
        }
        let (n, d) = (batch.n_tokens(), self.n_embd);
        let mut tap_data = Vec::new();
        if !done {
            let dev_batch = be.prepare_batch(desc)?;
            let mut out = tensor(be, rows.len() * width)?;
            // taps as `[n_taps, n_tokens, n_embd]` on the device, transposed on the host
            let mut tap_buf = if taps.is_empty() {
                None
            } else {
                Some(tensor(be, taps.len() * n * d)?)
            };
            self.run_step(batch, &dev_batch, cache, &mut out, hidden, tap_buf.as_mut())?;
            if !rows.is_empty() {
                read(&out)?;
            }
            if let Some(t) = &tap_buf {
                let mut by_layer = vec![0f32; taps.len() * n * d];
                be.read_f32(t, 0, &mut by_layer)?;
                tap_data = vec![0f32; taps.len() * n * d];
                for (l, layer) in by_layer.chunks_exact(n * d).enumerate() {
                    for (i, row) in layer.chunks_exact(d).enumerate() {
                        let at = (i * taps.len() + l) * d;
                        tap_data[at..at + d].copy_from_slice(row);
                    }
                }
            }
        }
        if cache.has_recurrent() {
            for c in &batch.seqs {
                let end = batch.positions[c.start + c.len - 1] as usize + 1;
                cache.end_recurrent(c.slot, end);
            }
        }
        Ok(Logits {
            n_vocab: width,
            rows: rows.clone(),
            data,
            argmax,
            taps: tap_data,
            tap_width: taps.len() * d,
        })
    }

    /// See [`crate::CausalLm::embed_tokens`].
    pub fn embed_tokens(&self, tokens: &[u32], out: &mut Tensor) -> Result<()> {
        let n_vocab = self.spec.n_vocab;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(ModelError::Batch(format!(
                "token id {bad} out of range (vocab {n_vocab})"
            )));
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let _pass = self
            .recordings
            .lock()
            .map_err(|_| ModelError::Batch("an earlier forward pass panicked".into()))?;
        let be = &*self.backend;
        let desc = BatchDesc {
            tokens: tokens.to_vec(),
            positions: (0..tokens.len() as u32).collect(),
            seqs: vec![SeqDesc {
                slot: 0,
                start: 0,
                len: tokens.len(),
                pos0: 0,
                table_start: 0,
                table_len: 0,
            }],
            block_tables: Vec::new(),
            block_size: 0,
            logit_rows: Vec::new(),
        };
        let dev_batch = be.prepare_batch(desc)?;
        Ok(be.embed(&self.tok_embd, &dev_batch, out)?)
    }

    /// See [`crate::CausalLm::output_head`].
    pub fn output_head(&self, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
        let _pass = self
            .recordings
            .lock()
            .map_err(|_| ModelError::Batch("an earlier forward pass panicked".into()))?;
        let out_w = self.output.as_ref().unwrap_or(&self.tok_embd);
        Ok(self.backend.matmul(out_w, x, n, out)?)
    }

    /// The rotary tables of multimodal positions `pos` (`None` when there are none), on the
    /// backend: the attention layers' rotary dims and base with [`ModelSpec::mrope`]'s
    /// sections ([`crate::mrope::text_tables`]).
    fn rope_tables(&self, pos: &[[u32; 3]]) -> Result<Option<(Tensor, Tensor)>> {
        let Some(sections) = self.spec.mrope.filter(|_| !pos.is_empty()) else {
            return Ok(None);
        };
        let rope = self.blocks.iter().find_map(|b| match &b.op {
            DeviceOp::Attention(a) => a.rope,
            _ => None,
        });
        let Some(rope) = rope else {
            return Ok(None);
        };
        let (cos, sin) = crate::mrope::text_tables(pos, rope.n_rot, rope.theta, sections);
        let be = &*self.backend;
        Ok(Some((be.upload_f32(&cos)?, be.upload_f32(&sin)?)))
    }

    /// A step's device work: embedding, every block, and for the batch's logit rows the
    /// logits into `out` (`[rows, n_vocab]`), or with `hidden` the final-norm hidden states
    /// (`[rows, n_embd]`); `out` is untouched when no row is asked for. Queues ops only
    /// (nothing is read back), so it can be recorded.
    fn run_step(
        &self,
        batch: &BatchInputs,
        dev_batch: &Batch,
        cache: &mut KvCache,
        out: &mut Tensor,
        hidden: bool,
        mut taps: Option<&mut Tensor>,
    ) -> Result<()> {
        let be = &*self.backend;
        let n = batch.n_tokens();
        let d = self.n_embd;
        let mut x = tensor(be, n * d)?;
        be.embed(&self.tok_embd, dev_batch, &mut x)?;
        for e in &batch.embeds {
            be.write_f32(
                &mut x,
                e.start * d,
                &e.data[e.rows.start * d..e.rows.end * d],
            )?;
        }
        let rope_tables = self.rope_tables(&batch.mrope)?;
        let mut h = tensor(be, n * d)?;
        let mut cx = ForwardCtx {
            be,
            batch,
            dev_batch,
            cache,
            rope_tables: rope_tables.as_ref(),
        };
        for (i, b) in self.blocks.iter().enumerate() {
            // x += op(rmsnorm(x)): each op adds into x itself (in its last product's epilogue);
            // an FFN block's norm is its own op's (an MoE's router computes it)
            if !matches!(b.op, DeviceOp::Ffn(_)) {
                be.rms_norm_to(&x, &mut h, d, &b.norm, self.rms_eps)?;
            }
            match &b.op {
                DeviceOp::Attention(a) => a.forward(&mut cx, b.layer, &h, &mut x)?,
                DeviceOp::Gdn(g) => g.forward(&mut cx, b.layer, &h, &mut x)?,
                DeviceOp::Mamba2(m) => m.forward(&mut cx, b.layer, &h, &mut x)?,
                DeviceOp::Ffn(f) => {
                    f.forward_norm_add(be, (&b.norm, self.rms_eps), &mut h, n, &mut x)?
                }
            }
            // after the last block of a layer, x is that layer's output
            let layer_done = self
                .blocks
                .get(i + 1)
                .is_none_or(|next| next.layer != b.layer);
            if let (true, Some(t)) = (layer_done, taps.as_deref_mut()) {
                for (slot, _) in batch
                    .tap_layers
                    .iter()
                    .enumerate()
                    .filter(|(_, &l)| l == b.layer)
                {
                    be.copy(&x, 0, t, slot * n * d, n * d)?;
                }
            }
        }
        let rows = batch.logit_rows.len();
        if rows > 0 && hidden {
            be.gather_logit_rows(&x, d, dev_batch, out)?;
            be.rms_norm(out, d, &self.out_norm, self.rms_eps)?;
        } else if rows > 0 {
            let mut hr = tensor(be, rows * d)?;
            be.gather_logit_rows(&x, d, dev_batch, &mut hr)?;
            be.rms_norm(&mut hr, d, &self.out_norm, self.rms_eps)?;
            let out_w = self.output.as_ref().unwrap_or(&self.tok_embd);
            be.matmul(out_w, &hr, rows, out)?;
        }
        Ok(())
    }
}

/// The logit rows of `t` (`[rows, width]` on the backend) for the host: every row when
/// `argmax_only` is empty or all false; otherwise each row's argmax is computed by the
/// backend ([`Backend::argmax_rows`]) and only the rows not marked come back, runs of
/// consecutive ones in one read. Returns `(values of the rows returned, per row its argmax
/// where marked)` ([`Logits::data`], [`Logits::argmax`]).
fn read_rows(
    be: &dyn Backend,
    t: &Tensor,
    width: usize,
    argmax_only: &[bool],
) -> Result<(Vec<f32>, Vec<Option<u32>>)> {
    let n = t.len() / width.max(1);
    if !argmax_only.iter().any(|&a| a) {
        let mut data = vec![0f32; n * width];
        be.read_f32(t, 0, &mut data)?;
        return Ok((data, Vec::new()));
    }
    let ids = be.argmax_rows(t, width)?;
    let full = argmax_only.iter().filter(|&&a| !a).count();
    let mut data = vec![0f32; full * width];
    let (mut r, mut at) = (0, 0);
    while r < n {
        if argmax_only.get(r).copied().unwrap_or(false) {
            r += 1;
            continue;
        }
        let end = (r..n)
            .find(|&e| argmax_only.get(e).copied().unwrap_or(false))
            .unwrap_or(n);
        let len = (end - r) * width;
        be.read_f32(t, r * width, &mut data[at..at + len])?;
        at += len;
        r = end;
    }
    let argmax = argmax_only
        .iter()
        .zip(ids)
        .map(|(&a, id)| a.then_some(id))
        .collect();
    Ok((data, argmax))
}
