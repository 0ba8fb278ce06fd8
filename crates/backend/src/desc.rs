//! Op descriptors: the shapes and parameters ops take, device-neutral (no kernel types).

use crate::{Tensor, Weight};

/// Shape of an attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    /// Query heads.
    pub n_head: usize,
    /// KV heads (divides `n_head`).
    pub n_head_kv: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f32,
}

/// NeoX-style rotary embedding over the first `n_rot` (even) dims of each head: dim `i` pairs
/// with dim `i + n_rot/2`; the angle of pair `i` at position `p` is `p * theta^(-2i/n_rot)`,
/// computed as ggml computes it (repeated f32 multiplication of `p` by `theta^(-2/n_rot)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeDesc {
    /// Rotated dims at the start of each head (even, `<= head_dim`).
    pub n_rot: usize,
    /// Frequency base.
    pub theta: f32,
}

/// How Gated DeltaNet value heads map to key heads when `n_v_heads > n_k_heads`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadOrder {
    /// HF / MLX: consecutive value heads share a key head, `kh = h / (n_v / n_k)`.
    Grouped,
    /// GGUF (llama.cpp repeats the key heads): `kh = h % n_k`.
    Tiled,
}

/// Head counts and widths of one Gated DeltaNet layer. The state of one sequence is
/// `[n_v_heads, dk, dv]` f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnShape {
    /// Query/key heads (divides `n_v_heads`).
    pub n_k_heads: usize,
    /// Value heads (one state each).
    pub n_v_heads: usize,
    /// Query/key head width (state rows).
    pub dk: usize,
    /// Value head width (state columns).
    pub dv: usize,
    /// Value-to-key head mapping.
    pub order: HeadOrder,
}

impl GdnShape {
    /// f32 values of one sequence's state.
    pub fn state_len(&self) -> usize {
        self.n_v_heads * self.dk * self.dv
    }
}

/// The weights of a Gated DeltaNet layer's per-token preamble ([`crate::Backend::gdn_preamble`]),
/// device tensors: the causal conv over the q | k | v channels and the gate parameters.
#[derive(Clone, Copy, Debug)]
pub struct GdnConv<'a> {
    /// Conv kernel width (taps per channel).
    pub k: usize,
    /// Conv weights `[2 * n_k_heads * dk + n_v_heads * dv, k]` (tap `k - 1` multiplies the
    /// current token).
    pub w: &'a crate::Tensor,
    /// `[n_v_heads]`: added to `a` before the softplus.
    pub dt_bias: &'a crate::Tensor,
    /// `[n_v_heads]`: `-exp(A_log)`.
    pub a_neg: &'a crate::Tensor,
    /// Epsilon of the q/k L2 norms (added to the sum of squares).
    pub l2_eps: f32,
}

/// The tensors a Gated DeltaNet mixer ([`crate::Backend::gdn_mixer`]) reads and writes, all
/// on the backend's device (kd = n_k_heads * dk, vd = n_v_heads * dv).
#[derive(Debug)]
pub struct GdnMixerIo<'a> {
    /// The input projection's q | k | v columns `[n_tokens, 2 kd + vd]`.
    pub qkv: &'a crate::Tensor,
    /// The output gate's projection `[n_tokens, vd]`.
    pub z: &'a crate::Tensor,
    /// The projection `b` `[n_tokens, n_v_heads]` on entry; unspecified after.
    pub beta: &'a mut crate::Tensor,
    /// The projection `a` `[n_tokens, n_v_heads]` on entry; unspecified after.
    pub g: &'a mut crate::Tensor,
    /// Conv windows `[n_slots, k - 1, 2 kd + vd]`, read and updated.
    pub conv_state: &'a mut crate::Tensor,
    /// Recurrent states `[n_slots, n_v_heads, dk, dv]`, read and updated.
    pub state: &'a mut crate::Tensor,
    /// The gated-normed output `[n_tokens, vd]`.
    pub out: &'a mut crate::Tensor,
}

/// The weights of a Mamba2 layer's per-token preamble ([`crate::Backend::mamba2_preamble`]),
/// device tensors.
#[derive(Clone, Copy, Debug)]
pub struct Mamba2Conv<'a> {
    /// Conv kernel width (taps per channel).
    pub k: usize,
    /// Conv weights `[H * P + 2 * G * N, k]` over the x | B | C channels (tap `k - 1`
    /// multiplies the current token).
    pub w: &'a crate::Tensor,
    /// Conv bias `[H * P + 2 * G * N]`, if any.
    pub bias: Option<&'a crate::Tensor>,
    /// `[H]`: added to the step sizes before the softplus.
    pub dt_bias: &'a crate::Tensor,
}

/// Dimensions of one Mamba2 layer's scan. The state of one sequence is
/// `[n_heads, head_dim, d_state]` f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mamba2Shape {
    /// Heads H.
    pub n_heads: usize,
    /// Head dimension P.
    pub head_dim: usize,
    /// State size N.
    pub d_state: usize,
    /// B/C groups G (divides H).
    pub n_groups: usize,
}

impl Mamba2Shape {
    /// `H * P`.
    pub fn d_inner(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// f32 values of one sequence's state, `H * P * N`.
    pub fn state_len(&self) -> usize {
        self.d_inner() * self.d_state
    }
}

/// One sequence of a step's batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqDesc {
    /// Cache slot (index into the recurrent state tensors).
    pub slot: usize,
    /// First flat token index of the sequence in the batch.
    pub start: usize,
    /// Number of new tokens (>= 1).
    pub len: usize,
    /// Position of its first new token (the slot holds positions `0..pos0`).
    pub pos0: usize,
    /// Its block table: `block_tables[table_start..table_start + table_len]`.
    pub table_start: usize,
    /// See `table_start`.
    pub table_len: usize,
}

/// The host description of a step's batch, which [`crate::Backend::prepare_batch`] turns
/// into a [`Batch`] (uploaded once per step for device backends).
///
/// Invariants (the model checks them before building one): sequences tile `0..tokens.len()`
/// in order; within a sequence positions are consecutive from `pos0`; each sequence's block
/// table covers positions `0..pos0 + len` in blocks of `block_size` (attention models only);
/// `logit_rows` are flat token indices.
#[derive(Debug, Clone, Default)]
pub struct BatchDesc {
    /// Token ids `[n_tokens]`.
    pub tokens: Vec<u32>,
    /// Position of each token `[n_tokens]`.
    pub positions: Vec<u32>,
    /// The sequences.
    pub seqs: Vec<SeqDesc>,
    /// Every sequence's block table, concatenated.
    pub block_tables: Vec<u32>,
    /// Positions per KV block (0 when the model has no attention layer).
    pub block_size: usize,
    /// Flat token indices whose logits are wanted, in output order.
    pub logit_rows: Vec<u32>,
}

impl BatchDesc {
    /// Number of tokens.
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The block table of sequence `i`.
    pub fn table(&self, i: usize) -> &[u32] {
        let s = &self.seqs[i];
        &self.block_tables[s.table_start..s.table_start + s.table_len]
    }
}

/// A step's batch as the backend holds it: the host description plus the backend's own
/// copy (device arrays for CUDA).
pub struct Batch {
    desc: BatchDesc,
    dev: Box<dyn std::any::Any + Send + Sync>,
}

impl Batch {
    /// Wrap a backend's copy (for backend implementations).
    pub fn from_parts(desc: BatchDesc, dev: Box<dyn std::any::Any + Send + Sync>) -> Batch {
        Batch { desc, dev }
    }

    /// The host description.
    pub fn desc(&self) -> &BatchDesc {
        &self.desc
    }

    /// The backend's copy, if it is a `T`.
    pub fn dev<T: 'static>(&self) -> Option<&T> {
        self.dev.downcast_ref()
    }

    /// The backend's copy mutably, and the host description to replace (for backends
    /// rewriting a batch in place: [`crate::Backend::refill_batch`]).
    pub fn parts_mut<T: 'static>(&mut self) -> Option<(&mut BatchDesc, &mut T)> {
        let dev = self.dev.downcast_mut()?;
        Some((&mut self.desc, dev))
    }
}

/// A step's device work recorded once ([`crate::Backend::begin_recording`] ..
/// [`crate::Backend::end_recording`]: a CUDA graph) and replayed by
/// [`crate::Backend::replay`] with the contents of the batch it was recorded with, rewritten
/// by [`crate::Backend::refill_batch`]. Opaque; only the backend that made it can replay it.
pub struct Recording {
    rec: Box<dyn std::any::Any + Send>,
    n_kernels: usize,
}

impl Recording {
    /// Wrap a backend's recording of `n_kernels` kernel launches (for backend
    /// implementations).
    pub fn from_parts(rec: Box<dyn std::any::Any + Send>, n_kernels: usize) -> Recording {
        Recording { rec, n_kernels }
    }

    /// Kernel launches one replay makes.
    pub fn n_kernels(&self) -> usize {
        self.n_kernels
    }

    /// The backend's recording, if it is a `T`.
    pub fn get<T: 'static>(&self) -> Option<&T> {
        self.rec.downcast_ref()
    }
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recording({} kernels)", self.n_kernels)
    }
}

/// One attention layer's paged K and V storage: each `[n_blocks, block_size, kv_dim]` of
/// the cache type (block, then position in block, then head, then dim).
pub struct KvLayer<'a> {
    /// K blocks.
    pub k: &'a mut Tensor,
    /// V blocks.
    pub v: &'a mut Tensor,
    /// `n_head_kv * head_dim`.
    pub kv_dim: usize,
}

/// What a matrix product does with its result before storing it
/// ([`crate::Backend::matmul_with`]): `y = (accumulate ? y : 0) + ((x @ w^T) + bias)`, each
/// step rounded to f32 in that order, so it equals the product followed by
/// [`crate::Backend::add_bias`] and [`crate::Backend::add`] bit for bit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Epilogue<'a> {
    /// Added to every row (`[n_out]`, device memory of the backend).
    pub bias: Option<&'a Tensor>,
    /// Add into `y` (a residual connection) instead of overwriting it.
    pub accumulate: bool,
}

/// Activation of an MLP or an expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// `down(silu(gate x) * up x)`.
    SwiGlu,
    /// `down(relu(up x)^2)` (Nemotron-H).
    Relu2,
}

/// A dense MLP's weights. `gate` is present for SwiGLU, absent for squared ReLU.
#[derive(Debug)]
pub struct MlpWeights {
    /// `[n_ff, n_in]` (SwiGLU only).
    pub gate: Option<Weight>,
    /// `[n_ff, n_in]`.
    pub up: Weight,
    /// `[n_out, n_ff]`.
    pub down: Weight,
    /// Activation.
    pub act: Act,
}

impl MlpWeights {
    /// `n_ff`, the hidden width.
    pub fn n_ff(&self) -> usize {
        self.up.shape.first().copied().unwrap_or(0)
    }
}

/// How router logits become expert scores.
#[derive(Debug)]
pub enum Gating {
    /// `softmax(logits)`; selection and weights both use the probabilities (Qwen).
    Softmax,
    /// `sigmoid(logits)`; experts are selected by `score + bias` but weighted by `score`
    /// (Nemotron-H's `e_score_correction_bias`).
    Sigmoid {
        /// Selection-only bias `[n_expert]` f32.
        bias: Option<Tensor>,
    },
}

/// Storage of the routed experts' weights.
#[derive(Debug)]
pub enum Experts {
    /// Stacked 3-D tensors (GGUF `ffn_*_exps`, MLX `switch_mlp`): gate and up `[E, I, n_in]`
    /// (gate absent for squared-ReLU experts), down `[E, n_out, I]`.
    Stacked {
        /// `[E, I, n_in]`.
        gate: Option<Weight>,
        /// `[E, I, n_in]`.
        up: Weight,
        /// `[E, n_out, I]`.
        down: Weight,
    },
    /// HF fused layout: `gate_up [E, 2I, n_in]` (rows `0..I` gate, `I..2I` up), down
    /// `[E, n_out, I]`.
    FusedGateUp {
        /// `[E, 2I, n_in]`.
        gate_up: Weight,
        /// `[E, n_out, I]`.
        down: Weight,
    },
    /// One 2-D MLP per expert (HF `experts.{e}.*`).
    PerExpert(Vec<MlpWeights>),
}

impl Experts {
    /// Number of experts.
    pub fn count(&self) -> usize {
        match self {
            Experts::Stacked { up, .. } => up.shape.first().copied().unwrap_or(0),
            Experts::FusedGateUp { gate_up, .. } => gate_up.shape.first().copied().unwrap_or(0),
            Experts::PerExpert(v) => v.len(),
        }
    }
}

/// Latent MoE (Nemotron 3 Super): experts run in a smaller space; `down` projects the block
/// input into it before the experts and `up` projects the combined expert output back.
#[derive(Debug)]
pub struct Latent {
    /// `[latent, n_embd]`.
    pub down: Weight,
    /// `[n_embd, latent]`.
    pub up: Weight,
}

/// A routed mixture-of-experts block with an optional (optionally gated) shared expert.
///
/// Semantics (the reference the backends implement): `logits = x router^T`; scores by
/// [`Gating`]; each token picks the `top_k` experts of highest selection score (ties to the
/// lower index), weights `score * norm * scale` with `norm = 1/sum(picked scores)` when
/// `norm_topk` (sigmoid: `1/(sum + 1e-20)`), else 1; the routed output is the weighted sum of
/// the picked experts' MLPs in top-k order (in the latent space, then projected back by
/// `latent.up`, when `latent` is set); plus the shared expert's output, multiplied per token
/// by `sigmoid(x . shared_gate)` when that gate is set.
#[derive(Debug)]
pub struct MoeWeights {
    /// Router `[n_expert, n_embd]`.
    pub router: Weight,
    /// Score function and selection bias.
    pub gating: Gating,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the selected weights to sum to 1.
    pub norm_topk: bool,
    /// Multiplier of the routed weights (Nemotron's `routed_scaling_factor`; 1 otherwise).
    pub scale: f32,
    /// Routed experts.
    pub experts: Experts,
    /// Expert intermediate size.
    pub n_ff: usize,
    /// Expert activation.
    pub act: Act,
    /// Always-on expert.
    pub shared: Option<MlpWeights>,
    /// Sigmoid gate of the shared expert `[n_embd]` f32.
    pub shared_gate: Option<Tensor>,
    /// Latent projections (Nemotron 3 Super).
    pub latent: Option<Latent>,
}

impl MoeWeights {
    /// Number of routed experts.
    pub fn n_expert(&self) -> usize {
        self.router.shape.first().copied().unwrap_or(0)
    }
}
