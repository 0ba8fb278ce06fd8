//! The device-neutral backend seam: the narrow, model-shaped op set models run on, as a trait
//! ([`Backend`]), with its own handles ([`Tensor`], [`Weight`], [`Batch`]), op descriptors
//! ([`desc`]) and error type ([`BackendError`]). Implementations live in their own crates:
//! `kapitsa-backend-cpu` (host memory, SIMD kernels) and `kapitsa-backend-cuda` (device
//! memory, CUDA kernels). Models, the cache, the engine and the server see only this crate.
//!
//! # Contract
//! - **Memory.** Weights are uploaded once at load ([`Backend::upload_weight`]; a backend may
//!   repack them). Activations, the KV cache and recurrent states are [`Tensor`]s the backend
//!   allocates; they live on its device. Per step only what the host asks for comes back
//!   ([`Backend::read_f32`] of the logits rows, or sampled ids).
//! - **Layouts.** Activations are row-major `[n_tokens, width]` f32 over the whole batch.
//!   Shapes are given to each op; tensors are flat.
//! - **Batch invariance.** Every op computes each token's (each sequence's) result with the
//!   same operation sequence whatever else is in the batch, so a sequence gives the same
//!   numbers batched as alone. A backend may choose kernels by matrix shape, never by
//!   batch composition (the CPU backend's llama.cpp-compatible mode is the documented
//!   exception, see its crate).
//! - **Errors.** Every op is fallible: bad arguments are [`BackendError::Shape`], a device
//!   fault is [`BackendError::Device`]. Nothing panics on bad input.
//! - **Aliasing.** An op's `&mut` output never aliases its inputs (Rust enforces it).
//! - **References.** Every op has a scalar reference on the CPU (the CPU backend at
//!   `SimdLevel::Scalar`); [`testing`] holds the suite every backend runs against it.

pub mod desc;
pub mod device;
pub mod error;
pub mod reference;
pub mod tensor;
pub mod testing;

pub use desc::{
    Act, AttnShape, Batch, BatchDesc, Epilogue, Experts, Gating, GdnConv, GdnMixerIo, GdnShape,
    HeadOrder, KvLayer, Latent, Mamba2Conv, Mamba2Shape, MlpWeights, MoeWeights, Recording,
    RopeDesc, SeqDesc,
};
pub use device::{gib, Device, DeviceChoice, DeviceMemory};
pub use error::{check_len, shape_err, BackendError, Result};
pub use tensor::{DType, HostBytes, HostWeight, Tensor, Weight, Q8_0_BLOCK, Q8_0_BYTES};

/// [`Backend::gdn_mixer`] as its definition composes it: `gdn_preamble`, `gdn`,
/// `gated_rms_norm`. The trait's default, and the fallback of a backend whose fused path does
/// not take a shape or batch.
pub fn gdn_mixer_composed<B: Backend + ?Sized>(
    be: &B,
    shape: GdnShape,
    w: &GdnConv<'_>,
    (norm, eps): (&Tensor, f32),
    io: GdnMixerIo<'_>,
    batch: &Batch,
) -> Result<()> {
    let (kd, vd) = (shape.n_k_heads * shape.dk, shape.n_v_heads * shape.dv);
    let n = batch.desc().n_tokens();
    let mut q = be.alloc_scratch(DType::F32, n * kd)?;
    let mut k = be.alloc_scratch(DType::F32, n * kd)?;
    let mut v = be.alloc_scratch(DType::F32, n * vd)?;
    let GdnMixerIo {
        qkv,
        z,
        beta,
        g,
        conv_state,
        state,
        out,
    } = io;
    be.gdn_preamble(
        shape,
        w,
        qkv,
        conv_state,
        batch,
        beta,
        g,
        [&mut q, &mut k, &mut v],
    )?;
    be.gdn(shape, &q, &k, &v, g, beta, state, batch, out)?;
    be.gated_rms_norm(out, z, shape.dv, norm, eps)
}

/// [`Backend::matmul_with`] as its definition composes it: `matmul`, then `add_bias`, then
/// `add` (through scratch when accumulating). The trait's default, and the fallback of a
/// backend whose fused path does not take a shape.
pub fn matmul_with_composed<B: Backend + ?Sized>(
    be: &B,
    w: &Weight,
    x: &Tensor,
    n_tok: usize,
    y: &mut Tensor,
    ep: Epilogue<'_>,
) -> Result<()> {
    if !ep.accumulate {
        be.matmul(w, x, n_tok, y)?;
        if let Some(b) = ep.bias {
            be.add_bias(y, b)?;
        }
        return Ok(());
    }
    let mut t = be.alloc_scratch(DType::F32, y.len())?;
    be.matmul(w, x, n_tok, &mut t)?;
    if let Some(b) = ep.bias {
        be.add_bias(&mut t, b)?;
    }
    be.add(y, &t)
}

/// A host copy of a whole f32 tensor (the host fallbacks of the drafter ops).
fn read_all<B: Backend + ?Sized>(be: &B, t: &Tensor) -> Result<Vec<f32>> {
    let mut h = vec![0f32; t.len()];
    be.read_f32(t, 0, &mut h)?;
    Ok(h)
}

/// The ops a model forward pass needs. All activations are row-major f32 tensors; every
/// length is checked against the shapes given.
pub trait Backend: Send + Sync {
    // ---- identity and memory -------------------------------------------------------------

    /// Short description for logs (`"cpu avx512 vnni bf16, 2 threads"`, `"cuda:0 NVIDIA H200"`).
    fn describe(&self) -> String;

    /// The device this backend computes on.
    fn device(&self) -> Device;

    /// The device's memory and this backend's share of it (GPU backends); `None` for the CPU
    /// backend, whose memory is the host's.
    fn memory(&self) -> Option<DeviceMemory> {
        None
    }

    /// Upload a model weight for matrix products (a 2-D matrix or 3-D stacked experts).
    /// Errors ([`BackendError::Unsupported`]) when the backend has no matrix kernel for its
    /// type, so a bad file fails at load, not at the first step.
    fn upload_weight(&self, w: &HostWeight) -> Result<Weight>;

    /// Upload an embedding table `[n_vocab, n_embd]` used only by [`Backend::embed`] (row
    /// gathers); its type needs dequantisation only. Defaults to [`Backend::upload_weight`].
    fn upload_embedding(&self, w: &HostWeight) -> Result<Weight> {
        self.upload_weight(w)
    }

    /// A new tensor of `len` elements, zero-filled.
    fn alloc(&self, dtype: DType, len: usize) -> Result<Tensor>;

    /// A new tensor of `len` elements whose contents are unspecified (a device backend may
    /// skip the zero fill): only for an op's output that the op writes completely, such as
    /// the activations of a forward pass. Defaults to [`Backend::alloc`].
    fn alloc_scratch(&self, dtype: DType, len: usize) -> Result<Tensor> {
        self.alloc(dtype, len)
    }

    /// A new f32 tensor holding `data` (parameters: norms, biases, conv weights, ...).
    fn upload_f32(&self, data: &[f32]) -> Result<Tensor> {
        let mut t = self.alloc(DType::F32, data.len())?;
        self.write_f32(&mut t, 0, data)?;
        Ok(t)
    }

    /// `dst[offset..offset + src.len()] = src` (an f32 tensor).
    fn write_f32(&self, dst: &mut Tensor, offset: usize, src: &[f32]) -> Result<()>;

    /// `dst = src[offset..offset + dst.len()]` (an f32 tensor). Waits for the work queued
    /// before it.
    fn read_f32(&self, src: &Tensor, offset: usize, dst: &mut [f32]) -> Result<()>;

    /// Raw bytes of elements `offset..offset + n` of `src` in its storage encoding (f16 and
    /// f32 little-endian, Q8_0 blocks; offsets on Q8_0 block boundaries): what the cache's
    /// disk tier and recurrent snapshots keep.
    fn read_bytes(&self, src: &Tensor, offset: usize, n: usize) -> Result<Vec<u8>>;

    /// Set elements `offset..` of `dst` from [`Backend::read_bytes`] bytes.
    fn write_bytes(&self, dst: &mut Tensor, offset: usize, bytes: &[u8]) -> Result<()>;

    /// `dst[dst_off..dst_off + n] = src[src_off..src_off + n]` (same dtype; Q8_0 offsets on
    /// block boundaries).
    fn copy(
        &self,
        src: &Tensor,
        src_off: usize,
        dst: &mut Tensor,
        dst_off: usize,
        n: usize,
    ) -> Result<()>;

    /// Copy elements `src..src + n` of `t` to `dst..dst + n` inside the same tensor (ranges
    /// must not overlap): copy-on-write of KV blocks, recurrent state slots.
    fn copy_within(&self, t: &mut Tensor, src: usize, dst: usize, n: usize) -> Result<()>;

    /// Upload a step's batch description (once per forward pass).
    fn prepare_batch(&self, desc: BatchDesc) -> Result<Batch>;

    // ---- recorded steps (CUDA graphs) ----------------------------------------------------
    //
    // A decode step queues hundreds of small ops; a device backend can record them once and
    // replay the recording with one launch. The caller (the model) records a step with
    // `begin_recording`, the ops of the step, `end_recording`; later steps of the same shape
    // rewrite the batch with `refill_batch` and call `replay`. While recording, ops are
    // queued into the recording and not run, so nothing may be read back to the host, and
    // every tensor an op reads or writes must outlive the recording (tensors allocated and
    // dropped between begin and end are the recording's own scratch). Per-step values reach
    // the kernels only through the batch arrays, so a replay computes exactly what running
    // the ops again on the refilled batch would.

    /// Whether this backend can record steps (`false`: the four methods below are not
    /// available and the caller runs every step op by op).
    fn can_record(&self) -> bool {
        false
    }

    /// [`Backend::prepare_batch`] for a batch that will be recorded: the device arrays get
    /// room for block tables of up to `table_capacity` blocks per sequence, so
    /// [`Backend::refill_batch`] can take the longer tables of later steps.
    fn prepare_batch_for_recording(&self, desc: BatchDesc, table_capacity: usize) -> Result<Batch> {
        let _ = table_capacity;
        self.prepare_batch(desc)
    }

    /// Rewrite `batch` (made by [`Backend::prepare_batch_for_recording`]) in place with a
    /// later step's `desc`, keeping every device address. `Ok(false)` (and `batch`
    /// unchanged) when `desc` does not fit what was recorded with it: another number of
    /// tokens, sequences or logit rows, a sequence of more tokens, tables past the capacity,
    /// or a context longer than the recorded attention split covers. Then record again.
    fn refill_batch(&self, batch: &mut Batch, desc: BatchDesc) -> Result<bool> {
        let _ = (batch, desc);
        Ok(false)
    }

    /// Start recording the ops queued from now on (see above).
    fn begin_recording(&self) -> Result<()> {
        Err(BackendError::Unsupported {
            op: "begin_recording",
            what: "recording on this backend".into(),
        })
    }

    /// Stop recording and return the recording. After an error in between, call this anyway
    /// (and drop the result) so the backend leaves recording mode.
    fn end_recording(&self) -> Result<Recording> {
        Err(BackendError::Unsupported {
            op: "end_recording",
            what: "recording on this backend".into(),
        })
    }

    /// Queue a recording (its ops run on the current contents of the batch it was recorded
    /// with).
    fn replay(&self, rec: &Recording) -> Result<()> {
        let _ = rec;
        Err(BackendError::Unsupported {
            op: "replay",
            what: "recording on this backend".into(),
        })
    }

    /// Wait until every queued op has finished (device backends); surfaces asynchronous
    /// device errors.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    // ---- matrix products -----------------------------------------------------------------

    /// `y[n_tok, n_out] = x[n_tok, n_in] @ w^T` for a 2-D weight `[n_out, n_in]`.
    fn matmul(&self, w: &Weight, x: &Tensor, n_tok: usize, y: &mut Tensor) -> Result<()>;

    /// [`Backend::matmul`] with an epilogue (a bias, accumulation into `y`; see
    /// [`Epilogue`]): one kernel on a device backend instead of three. The default composes
    /// `matmul`, `add_bias` and `add`, which defines the result.
    fn matmul_with(
        &self,
        w: &Weight,
        x: &Tensor,
        n_tok: usize,
        y: &mut Tensor,
        ep: Epilogue<'_>,
    ) -> Result<()> {
        matmul_with_composed(self, w, x, n_tok, y, ep)
    }

    /// `ys[i] = x @ ws[i]^T` for several matrices sharing the input (attention's q, k, v; the
    /// Gated DeltaNet in-projections); each output exactly as [`Backend::matmul`] computes it.
    fn matmul_many(
        &self,
        ws: &[&Weight],
        x: &Tensor,
        n_tok: usize,
        ys: &mut [&mut Tensor],
    ) -> Result<()> {
        if ws.len() != ys.len() {
            return shape_err(
                "matmul_many",
                format!("{} weights, {} outputs", ws.len(), ys.len()),
            );
        }
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            self.matmul(w, x, n_tok, y)?;
        }
        Ok(())
    }

    /// [`Backend::matmul_many`] with an epilogue per matrix (`eps.len() == ws.len()`; see
    /// [`Epilogue`]). The default runs `matmul_many` and then the biases (one `matmul_with`
    /// per matrix when one accumulates), which defines the result.
    fn matmul_many_with(
        &self,
        ws: &[&Weight],
        x: &Tensor,
        n_tok: usize,
        ys: &mut [&mut Tensor],
        eps: &[Epilogue<'_>],
    ) -> Result<()> {
        if eps.len() != ws.len() {
            return shape_err(
                "matmul_many_with",
                format!("{} weights, {} epilogues", ws.len(), eps.len()),
            );
        }
        if eps.iter().any(|e| e.accumulate) {
            if ys.len() != ws.len() {
                return shape_err(
                    "matmul_many_with",
                    format!("{} weights, {} outputs", ws.len(), ys.len()),
                );
            }
            for ((w, y), ep) in ws.iter().zip(ys.iter_mut()).zip(eps) {
                self.matmul_with(w, x, n_tok, y, *ep)?;
            }
            return Ok(());
        }
        self.matmul_many(ws, x, n_tok, ys)?;
        for (y, ep) in ys.iter_mut().zip(eps) {
            if let Some(b) = ep.bias {
                self.add_bias(y, b)?;
            }
        }
        Ok(())
    }

    /// Embedding gather: `out[i, :] = dequant(w[batch.tokens[i], :])`, out `[n_tokens, n_in]`.
    fn embed(&self, w: &Weight, batch: &Batch, out: &mut Tensor) -> Result<()>;

    /// A dense MLP: `out[n, n_out] = mlp(x[n, n_in])` (see [`MlpWeights`]).
    fn mlp(&self, w: &MlpWeights, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()>;

    /// `y += mlp(x)` (a residual MLP block; see [`Backend::mlp`]). The default computes the
    /// MLP into scratch and adds it, which defines the result.
    fn mlp_add(&self, w: &MlpWeights, x: &Tensor, n: usize, y: &mut Tensor) -> Result<()> {
        let mut t = self.alloc_scratch(DType::F32, y.len())?;
        self.mlp(w, x, n, &mut t)?;
        self.add(y, &t)
    }

    /// A routed mixture of experts with its shared expert: `out[n, d] = moe(x[n, d])`
    /// (semantics on [`MoeWeights`]): router, top-k, grouping tokens by expert, the expert
    /// MLPs and the weighted combination all happen inside.
    fn moe(&self, w: &MoeWeights, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()>;

    /// `y += moe(x)` (a residual MoE block; see [`Backend::moe`]). The default computes the
    /// MoE into scratch and adds it, which defines the result.
    fn moe_add(&self, w: &MoeWeights, x: &Tensor, n: usize, y: &mut Tensor) -> Result<()> {
        let mut t = self.alloc_scratch(DType::F32, y.len())?;
        self.moe(w, x, n, &mut t)?;
        self.add(y, &t)
    }

    /// A residual MoE block with its pre-norm: `h = rms_norm(y)` (weights `norm.0 [d]`, eps
    /// `norm.1`, as [`Backend::rms_norm_to`]; `h` as long as `y`, left holding the normed
    /// rows), then `y += moe(h)` ([`Backend::moe_add`]). The default is those two ops, which
    /// defines the result; a device backend computes the norm inside the MoE's router.
    fn norm_moe_add(
        &self,
        w: &MoeWeights,
        (norm, eps): (&Tensor, f32),
        h: &mut Tensor,
        n: usize,
        y: &mut Tensor,
    ) -> Result<()> {
        self.rms_norm_to(y, h, norm.len(), norm, eps)?;
        self.moe_add(w, h, n, y)
    }

    /// Whether [`Backend::moe`] of `w` over `n` tokens reads results back to the host mid-op
    /// (routing grouped there); a step containing such an op cannot be recorded. Backends
    /// that do not record never need to say.
    fn moe_reads_back(&self, w: &MoeWeights, n: usize) -> bool {
        let _ = (w, n);
        false
    }

    // ---- element-wise and row ops --------------------------------------------------------

    /// RMSNorm of each `width`-wide row of `x` in place with weight `w[width]`:
    /// `x = x / sqrt(mean(x^2) + eps) * w`.
    fn rms_norm(&self, x: &mut Tensor, width: usize, w: &Tensor, eps: f32) -> Result<()>;

    /// [`Backend::rms_norm`] of `x` into `out` (same length), `x` unchanged: the pre-norm of
    /// a residual block. The default copies, then normalises in place.
    fn rms_norm_to(
        &self,
        x: &Tensor,
        out: &mut Tensor,
        width: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()> {
        if x.len() != out.len() {
            return shape_err(
                "rms_norm_to",
                format!("x has {} elements, out {}", x.len(), out.len()),
            );
        }
        self.copy(x, 0, out, 0, x.len())?;
        self.rms_norm(out, width, w, eps)
    }

    /// `y += x` (same length).
    fn add(&self, y: &mut Tensor, x: &Tensor) -> Result<()>;

    /// Add the row `b[width]` to every `width`-wide row of `x`.
    fn add_bias(&self, x: &mut Tensor, b: &Tensor) -> Result<()>;

    /// `x = x * sigmoid(gate)` element-wise (same length).
    fn mul_sigmoid(&self, x: &mut Tensor, gate: &Tensor) -> Result<()>;

    /// Split each row of `src` (`rows` rows of `sum(widths)` values) into `outs[i]`, rows of
    /// `widths[i]` values: `src = [a | b | c]` per row becomes `a`, `b`, `c`.
    fn split_cols(
        &self,
        src: &Tensor,
        rows: usize,
        widths: &[usize],
        outs: &mut [&mut Tensor],
    ) -> Result<()>;

    /// Copy rows `batch.logit_rows` (of `width` values) of `x` into `out`
    /// `[logit_rows.len(), width]`.
    fn gather_logit_rows(
        &self,
        x: &Tensor,
        width: usize,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()>;

    /// NeoX RoPE in place on `x` `[n_tokens, n_heads * head_dim]` at each token's position.
    fn rope(
        &self,
        x: &mut Tensor,
        n_heads: usize,
        head_dim: usize,
        rope: RopeDesc,
        batch: &Batch,
    ) -> Result<()>;

    /// [`Backend::rope`] on an attention layer's q `[n_tokens, n_head * head_dim]` and k
    /// `[n_tokens, n_head_kv * head_dim]`, both in place (a backend may do both in one pass;
    /// the result is that of the two calls).
    #[allow(clippy::too_many_arguments)]
    fn rope_qk(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        rope: RopeDesc,
        batch: &Batch,
    ) -> Result<()> {
        self.rope(q, n_head, head_dim, rope, batch)?;
        self.rope(k, n_head_kv, head_dim, rope, batch)
    }

    /// L2 normalisation of each `width`-wide row in place, then `* scale`:
    /// `x = x / sqrt(sum(x^2) + eps) * scale` (Gated DeltaNet's q and k; as
    /// transformers' `l2norm`, `rsqrt(sum + eps)`).
    fn l2_norm(&self, x: &mut Tensor, width: usize, eps: f32, scale: f32) -> Result<()>;

    /// Gated DeltaNet gates in place, rows of `n_v` heads: `beta = sigmoid(beta)`,
    /// `g = a_neg * softplus(g + dt_bias)` (`softplus` linear above 20).
    fn gdn_gates(
        &self,
        beta: &mut Tensor,
        g: &mut Tensor,
        dt_bias: &Tensor,
        a_neg: &Tensor,
    ) -> Result<()>;

    /// `dt = softplus(dt + bias)` in place, rows of `bias.len()` (Mamba2's step sizes).
    fn softplus_bias(&self, dt: &mut Tensor, bias: &Tensor) -> Result<()>;

    /// Gated RMSNorm per `width`-wide row: `x = rmsnorm(x) * w * silu(z)` (Gated DeltaNet's
    /// output norm; `w[width]` shared by all heads).
    fn gated_rms_norm(
        &self,
        x: &mut Tensor,
        z: &Tensor,
        width: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()>;

    /// Mamba2's grouped gated norm on rows of `d_inner`: `y = y * silu(z)`, then RMSNorm
    /// over each of `n_groups` equal groups of a row, times `w[d_inner]`.
    fn gated_group_rms_norm(
        &self,
        y: &mut Tensor,
        z: &Tensor,
        d_inner: usize,
        n_groups: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()>;

    // ---- attention and recurrent mixers (whole batch, per-sequence state) -----------------

    /// Write the new K and V rows (`[n_tokens, kv_dim]` f32) into the paged cache at each
    /// token's position (block `table[p / block_size]`, row `p % block_size`), converting
    /// to the cache type (quantise-on-write for Q8_0).
    fn kv_write(&self, k: &Tensor, v: &Tensor, cache: KvLayer<'_>, batch: &Batch) -> Result<()>;

    /// Causal attention of every sequence's new queries `q[n_tokens, n_head * head_dim]`
    /// over its cached positions `0..=pos` (paged K/V `[n_blocks, block_size, kv_dim]`
    /// through the block tables), into `out[n_tokens, n_head * head_dim]`.
    fn attention(
        &self,
        shape: AttnShape,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()>;

    /// Depthwise causal conv1d per sequence over `x[n_tokens, channels]` with kernel
    /// `w[channels, k]` (the last column multiplies the current token), optional bias, and
    /// optional SiLU; each sequence's window of its last `k - 1` input rows is
    /// `conv_state[slot]` (`[n_slots, (k - 1) * channels]`, oldest row first), read and
    /// updated.
    #[allow(clippy::too_many_arguments)]
    fn conv1d_causal(
        &self,
        x: &Tensor,
        channels: usize,
        k: usize,
        w: &Tensor,
        bias: Option<&Tensor>,
        silu: bool,
        conv_state: &mut Tensor,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()>;

    /// Gated DeltaNet recurrence per sequence: `q, k [n_tokens, n_k_heads * dk]`,
    /// `v [n_tokens, n_v_heads * dv]`, `g, beta [n_tokens, n_v_heads]`, state
    /// `[n_slots, n_v_heads, dk, dv]` (read and updated at each sequence's slot), out
    /// `[n_tokens, n_v_heads * dv]`. Per head and token: `S = S * exp(g)`,
    /// `S += k ⊗ beta (v - S^T k)`, `o = S^T q`.
    #[allow(clippy::too_many_arguments)]
    fn gdn(
        &self,
        shape: GdnShape,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        state: &mut Tensor,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()>;

    /// A Gated DeltaNet layer's per-token preamble, between its input projections and
    /// [`Backend::gdn`]: from `qkv [n_tokens, 2 kd + vd]` (kd = n_k_heads * dk, vd =
    /// n_v_heads * dv; q | k | v columns) the causal conv with SiLU (no bias; `conv_state`
    /// `[n_slots, w.k - 1, 2 kd + vd]` read and updated as [`Backend::conv1d_causal`] does),
    /// split into `q, k [n_tokens, kd]` and `v [n_tokens, vd]`, q and k L2-normalised per head
    /// (eps `w.l2_eps`; q also scaled by `1 / sqrt(dk)`); and the gates in place, `beta`
    /// and `g` `[n_tokens, n_v_heads]` holding the projections `b` and `a` on entry:
    /// `beta = sigmoid(b)`, `g = a_neg * softplus(a + dt_bias)` (as [`Backend::gdn_gates`]).
    /// The default is those five ops, which defines the result; a device backend fuses them.
    #[allow(clippy::too_many_arguments)]
    fn gdn_preamble(
        &self,
        shape: GdnShape,
        w: &GdnConv<'_>,
        qkv: &Tensor,
        conv_state: &mut Tensor,
        batch: &Batch,
        beta: &mut Tensor,
        g: &mut Tensor,
        qkv_out: [&mut Tensor; 3],
    ) -> Result<()> {
        let (kd, vd) = (shape.n_k_heads * shape.dk, shape.n_v_heads * shape.dv);
        let n = batch.desc().n_tokens();
        self.gdn_gates(beta, g, w.dt_bias, w.a_neg)?;
        let mut conv = self.alloc_scratch(DType::F32, n * (2 * kd + vd))?;
        self.conv1d_causal(
            qkv,
            2 * kd + vd,
            w.k,
            w.w,
            None,
            true,
            conv_state,
            batch,
            &mut conv,
        )?;
        let [q, k, v] = qkv_out;
        self.split_cols(&conv, n, &[kd, kd, vd], &mut [&mut *q, &mut *k, &mut *v])?;
        self.l2_norm(q, shape.dk, w.l2_eps, 1.0 / (shape.dk as f32).sqrt())?;
        self.l2_norm(k, shape.dk, w.l2_eps, 1.0)
    }

    /// A Gated DeltaNet layer's mixer, between its input projections and its output
    /// projection: [`Backend::gdn_preamble`] (conv weights and gate parameters `w`),
    /// [`Backend::gdn`], then [`Backend::gated_rms_norm`] of the output over each head's `dv`
    /// values with `z`, weights `norm [dv]` and `eps`. Tensors in `io` (shapes there). The
    /// default is those three ops, which defines the result; a device backend fuses them.
    fn gdn_mixer(
        &self,
        shape: GdnShape,
        w: &GdnConv<'_>,
        norm: (&Tensor, f32),
        io: GdnMixerIo<'_>,
        batch: &Batch,
    ) -> Result<()> {
        gdn_mixer_composed(self, shape, w, norm, io, batch)
    }

    /// A Mamba2 layer's per-token preamble, between its input projection and
    /// [`Backend::mamba2`]: `proj [n_tokens, di + cd + H]` (di = H * P, cd = di + 2 G N; the
    /// z | xBC | dt columns) becomes `z [n_tokens, di]`, the causal conv of xBC with SiLU
    /// (bias `w.bias`; `conv_state [n_slots, w.k - 1, cd]` read and updated as
    /// [`Backend::conv1d_causal`] does) split into `x [n_tokens, di]`, `b, c [n_tokens, G N]`,
    /// and `dt = softplus(dt + dt_bias)` `[n_tokens, H]`. Outputs in the order z, x, b, c, dt.
    /// The default is those ops (split_cols, softplus_bias, conv1d_causal, split_cols), which
    /// defines the result; a device backend fuses them.
    #[allow(clippy::too_many_arguments)]
    fn mamba2_preamble(
        &self,
        shape: Mamba2Shape,
        w: &Mamba2Conv<'_>,
        proj: &Tensor,
        conv_state: &mut Tensor,
        batch: &Batch,
        outs: [&mut Tensor; 5],
    ) -> Result<()> {
        let (di, nh) = (shape.d_inner(), shape.n_heads);
        let gn = shape.n_groups * shape.d_state;
        let cd = di + 2 * gn;
        let n = batch.desc().n_tokens();
        let [z, x, b, c, dt] = outs;
        let mut xbc = self.alloc_scratch(DType::F32, n * cd)?;
        self.split_cols(proj, n, &[di, cd, nh], &mut [&mut *z, &mut xbc, &mut *dt])?;
        self.softplus_bias(dt, w.dt_bias)?;
        let mut conv = self.alloc_scratch(DType::F32, n * cd)?;
        self.conv1d_causal(
            &xbc, cd, w.k, w.w, w.bias, true, conv_state, batch, &mut conv,
        )?;
        self.split_cols(&conv, n, &[di, gn, gn], &mut [x, b, c])
    }

    /// Mamba2 SSD scan per sequence: `x [n_tokens, H * P]`, `dt [n_tokens, H]` (after
    /// softplus), `a [H]` (`-exp(A_log)`), `b, c [n_tokens, G * N]`, `d [H]`, state
    /// `[n_slots, H, P, N]`, `y [n_tokens, H * P]`:
    /// `h = h * exp(dt a) + dt x ⊗ B`, `y = h C + D x`.
    #[allow(clippy::too_many_arguments)]
    fn mamba2(
        &self,
        shape: Mamba2Shape,
        x: &Tensor,
        dt: &Tensor,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        d: &Tensor,
        state: &mut Tensor,
        batch: &Batch,
        y: &mut Tensor,
    ) -> Result<()>;

    // ---- block drafters (DFlash, DFlash2) -------------------------------------------------

    /// Attention over dense K/V rows (not the paged cache) with one contiguous key span per
    /// query: query row `i` of `q` `[spans.len(), n_head * head_dim]` attends to rows
    /// `spans[i].0 .. spans[i].1` of `k`, `v` (`[rows, n_head_kv * head_dim]` f32; rows past
    /// the largest span end are not read), into `out` `[spans.len(), n_head * head_dim]`.
    /// Causal, non-causal and sliding-window masks are all spans. Definition:
    /// [`reference::attention_spans`]; the default runs it through a host round trip.
    fn attention_spans(
        &self,
        shape: AttnShape,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        spans: &[(u32, u32)],
        out: &mut Tensor,
    ) -> Result<()> {
        let (q_h, mut out_h) = (read_all(self, q)?, vec![0f32; out.len()]);
        let keys = spans.iter().map(|s| s.1 as usize).max().unwrap_or(0);
        let kv_dim = shape.n_head_kv * shape.head_dim;
        let rows = |t: &Tensor| -> Result<Vec<f32>> {
            let n = keys.checked_mul(kv_dim).filter(|&n| n <= t.len());
            let Some(n) = n else {
                return shape_err(
                    "attention_spans",
                    format!("{keys} key rows of {kv_dim} exceed a tensor of {}", t.len()),
                );
            };
            let mut h = vec![0f32; n];
            self.read_f32(t, 0, &mut h)?;
            Ok(h)
        };
        let (k_h, v_h) = (rows(k)?, rows(v)?);
        reference::attention_spans(shape, &q_h, &k_h, &v_h, spans, &mut out_h)?;
        self.write_f32(out, 0, &out_h)
    }

    /// DFlash2's grouped dynamic causal convolution over blocks of `block_len` rows of `x`
    /// `[n, width]` with the static kernel `base` `[taps, width]` and per-row coefficients
    /// `dynamic` `[n, taps * width / group]`, into `out` `[n, width]`. Definition:
    /// [`reference::dynamic_conv`]; the default runs it through a host round trip.
    #[allow(clippy::too_many_arguments)]
    fn dynamic_conv(
        &self,
        x: &Tensor,
        width: usize,
        base: &Tensor,
        dynamic: &Tensor,
        group: usize,
        block_len: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        let (x_h, base_h, dyn_h) = (
            read_all(self, x)?,
            read_all(self, base)?,
            read_all(self, dynamic)?,
        );
        let mut out_h = vec![0f32; out.len()];
        reference::dynamic_conv(&x_h, width, &base_h, &dyn_h, group, block_len, &mut out_h)?;
        self.write_f32(out, 0, &out_h)
    }

    // ---- the vision tower and multimodal positions ---------------------------------------

    /// LayerNorm of each `width`-wide row of `x` in place with weight `w` and bias `b`
    /// (`[width]`). Definition: [`reference::layer_norm`]; the default runs it through a host
    /// round trip.
    fn layer_norm(
        &self,
        x: &mut Tensor,
        width: usize,
        w: &Tensor,
        b: &Tensor,
        eps: f32,
    ) -> Result<()> {
        let (mut x_h, w_h, b_h) = (read_all(self, x)?, read_all(self, w)?, read_all(self, b)?);
        reference::layer_norm(&mut x_h, width, &w_h, &b_h, eps)?;
        self.write_f32(x, 0, &x_h)
    }

    /// GELU in place (`tanh_approx`: the tanh form). Definition: [`reference::gelu`]; the
    /// default runs it through a host round trip.
    fn gelu(&self, x: &mut Tensor, tanh_approx: bool) -> Result<()> {
        let mut x_h = read_all(self, x)?;
        reference::gelu(&mut x_h, tanh_approx);
        self.write_f32(x, 0, &x_h)
    }

    /// Rotary embedding from per-token tables `cos`, `sin` (`[n_tokens, half]`, f32) on `x`
    /// `[n_tokens, n_heads * head_dim]` in place (NeoX pairs `i`, `i + half`): multimodal
    /// positions (M-RoPE) and the vision tower's 2-D positions. Definition:
    /// [`reference::rope_table`]; the default runs it through a host round trip.
    fn rope_table(
        &self,
        x: &mut Tensor,
        n_heads: usize,
        head_dim: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<()> {
        let (mut x_h, c_h, s_h) = (
            read_all(self, x)?,
            read_all(self, cos)?,
            read_all(self, sin)?,
        );
        reference::rope_table(&mut x_h, n_heads, head_dim, &c_h, &s_h)?;
        self.write_f32(x, 0, &x_h)
    }

    // ---- sampling helpers ----------------------------------------------------------------

    /// Index of the largest value of each `width`-wide row of `x` (lowest index on ties),
    /// `[rows]`.
    fn argmax_rows(&self, x: &Tensor, width: usize) -> Result<Vec<u32>>;
}
