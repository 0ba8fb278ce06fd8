//! Feed-forward blocks: a dense MLP (SwiGLU or squared ReLU) and a routed mixture of experts.
//!
//! MoE execution: the router runs once for the whole batch; every token picks `top_k` experts;
//! the (token, slot) pairs are grouped by expert so each active expert's weights are read once
//! per step, over a gathered `[m, d]` block of its tokens; inactive experts cost nothing. Expert
//! outputs are combined per token in top-k slot order, weighted by the routing weights.
//!
//! References: transformers `Qwen3_5MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`,
//! `NemotronHMoE` / `NemotronHTopkRouter`; llama.cpp `build_moe_ffn`.

use std::cell::RefCell;

use kapitsa_backend::Backend;
use kapitsa_kernels_cpu::matmul::QMatrix;

use crate::layers::{check_experts, check_matrix, check_vec, sigmoid};
use crate::{ModelError, Result, Weight};

/// Activation of an MLP / expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// `down(silu(gate x) * up x)`.
    SwiGlu,
    /// `down(relu(up x)^2)` (Nemotron-H).
    Relu2,
}

/// A dense MLP. `gate` is present for SwiGLU and absent for squared ReLU.
#[derive(Debug)]
pub struct Mlp {
    /// `[n_ff, n_in]` (SwiGLU only).
    pub gate: Option<Weight>,
    /// `[n_ff, n_in]`.
    pub up: Weight,
    /// `[n_out, n_ff]`.
    pub down: Weight,
    /// Activation.
    pub act: Act,
}

impl Mlp {
    /// Check shapes: input width `n_in`, output width `n_out`.
    pub fn validate(&self, n_in: usize, n_out: usize) -> Result<()> {
        let n_ff = self.up.shape.first().copied().unwrap_or(0);
        check_matrix(&self.up, [n_ff, n_in])?;
        check_matrix(&self.down, [n_out, n_ff])?;
        match (&self.gate, self.act) {
            (Some(g), Act::SwiGlu) => check_matrix(g, [n_ff, n_in]),
            (None, Act::Relu2) => Ok(()),
            _ => Err(ModelError::Config(format!(
                "MLP '{}': gate projection does not match activation {:?}",
                self.up.name, self.act
            ))),
        }
    }

    /// `out[n, n_out] = mlp(x[n, n_in])`.
    pub fn forward(&self, be: &dyn Backend, x: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        with_scratch(|sc| self.forward_with(be, x, n, out, sc))
    }

    /// [`Mlp::forward`] on the caller's scratch.
    fn forward_with(
        &self,
        be: &dyn Backend,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        sc: &mut Scratch,
    ) -> Result<()> {
        let gate = self.gate.as_ref().map(|g| g.matrix()).transpose()?;
        run_mlp(
            be,
            false,
            gate.as_ref(),
            &self.up.matrix()?,
            &self.down.matrix()?,
            self.act,
            x,
            n,
            out,
            sc,
        )
    }
}

/// Reusable buffers of the feed-forward blocks (one set per thread, grown to the largest
/// batch seen): a prefill's MoE needs tens of MiB here, which fresh allocations would fault
/// in and zero again for every layer.
#[derive(Default)]
struct Scratch {
    /// MLP intermediates `[n, n_ff]`: `u` the up projection (squared ReLU: then its
    /// activation), `g` the gate (SwiGLU: then `silu(gate) * up`).
    u: Vec<f32>,
    g: Vec<f32>,
    /// MoE: an expert's gathered inputs `[m, d]` and outputs `[m, d]` (in the batched rounds,
    /// those of all experts of several pairs, one after another), every (token, slot)
    /// pair's expert output `[n * k, d]`, the routed sum `[n, d]` (latent MoE only; otherwise
    /// it goes straight to the output), the shared expert's output `[n, d]`.
    xin: Vec<f32>,
    yout: Vec<f32>,
    slot_out: Vec<f32>,
    routed: Vec<f32>,
    shared: Vec<f32>,
    /// The shared expert's gate and up outputs `[n, n_ff_shared]` when it joins the routed
    /// experts' batched GEMVs (steps of at most `SMALL_GROUP` tokens).
    sg: Vec<f32>,
    su: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch (a fresh one if it is already in use).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|c| match c.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// The first `n` elements of `v`, grown if needed (contents unspecified: callers overwrite).
fn grown(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Largest number of (token, slot) pairs of an MoE expert (and of tokens of a step, for the
/// shared expert) that run in the batched GEMV rounds of `Moe::run_small_groups`; larger
/// groups (prefill) take one `run_mlp` each, on the GEMMs.
const SMALL_GROUP: usize = 4;

/// One MLP over borrowed matrices (dense layers and single experts alike; `expert` routes the
/// products through [`Backend::matmul_small_batch`]). Gate and up share their input, so they
/// run as one [`Backend::matmul_many`] call.
#[allow(clippy::too_many_arguments)]
fn run_mlp(
    be: &dyn Backend,
    expert: bool,
    gate: Option<&QMatrix<'_>>,
    up: &QMatrix<'_>,
    down: &QMatrix<'_>,
    act: Act,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    sc: &mut Scratch,
) -> Result<()> {
    let n_ff = up.n_out;
    let mm = |w: &QMatrix<'_>, x: &[f32], y: &mut [f32]| {
        if expert {
            be.matmul_small_batch(w, x, n, y)
        } else {
            be.matmul(w, x, n, y)
        }
    };
    let u = grown(&mut sc.u, n * n_ff);
    let gv = grown(&mut sc.g, if act == Act::SwiGlu { n * n_ff } else { 0 });
    match (act, gate) {
        (Act::SwiGlu, Some(g)) => {
            let ws = [*g, *up];
            let mut ys = [&mut *gv, &mut *u];
            be.matmul_many(&ws, x, n, &mut ys, expert)?;
        }
        (Act::Relu2, _) => mm(up, x, u)?,
        (Act::SwiGlu, None) => return Err(no_gate()),
    }
    activate(be, act, gv, u);
    mm(down, hidden(act, gv, u), out)?;
    Ok(())
}

fn no_gate() -> ModelError {
    ModelError::Config("SwiGLU MLP without a gate projection".into())
}

/// The activation of an MLP in place, on the gate (`g`) and up (`u`) projections' outputs:
/// SwiGLU leaves `silu(g) * u` in `g`; squared ReLU leaves `relu(u)^2` in `u` (`g` unused).
fn activate(be: &dyn Backend, act: Act, g: &mut [f32], u: &mut [f32]) {
    match act {
        Act::SwiGlu => be.silu_mul(g, u),
        Act::Relu2 => {
            for v in u.iter_mut() {
                let r = v.max(0.0);
                *v = r * r;
            }
        }
    }
}

/// Where [`activate`] left the down projection's input.
fn hidden<'a>(act: Act, g: &'a [f32], u: &'a [f32]) -> &'a [f32] {
    match act {
        Act::SwiGlu => g,
        Act::Relu2 => u,
    }
}

/// How router logits become expert scores.
#[derive(Debug, Clone, PartialEq)]
pub enum Gating {
    /// `softmax(logits)`; selection and weights both use the probabilities (Qwen).
    Softmax,
    /// `sigmoid(logits)`; experts are selected by `score + bias` but weighted by `score`
    /// (Nemotron-H's `e_score_correction_bias`).
    Sigmoid {
        /// Selection-only bias `[n_expert]`.
        bias: Option<Vec<f32>>,
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
    PerExpert(Vec<Mlp>),
}

/// Matrices of one expert.
struct ExpertMats<'a> {
    gate: Option<QMatrix<'a>>,
    up: QMatrix<'a>,
    down: QMatrix<'a>,
}

impl Experts {
    fn count(&self) -> usize {
        match self {
            Experts::Stacked { up, .. } => up.shape.first().copied().unwrap_or(0),
            Experts::FusedGateUp { gate_up, .. } => gate_up.shape.first().copied().unwrap_or(0),
            Experts::PerExpert(v) => v.len(),
        }
    }

    fn validate(
        &self,
        n_exp: usize,
        n_ff: usize,
        n_in: usize,
        n_out: usize,
        act: Act,
    ) -> Result<()> {
        match self {
            Experts::Stacked { gate, up, down } => {
                check_experts(up, [n_exp, n_ff, n_in])?;
                check_experts(down, [n_exp, n_out, n_ff])?;
                match (gate, act) {
                    (Some(g), Act::SwiGlu) => check_experts(g, [n_exp, n_ff, n_in]),
                    (None, Act::Relu2) => Ok(()),
                    _ => Err(ModelError::Config(format!(
                        "experts '{}': gate projection does not match activation {act:?}",
                        up.name
                    ))),
                }
            }
            Experts::FusedGateUp { gate_up, down } => {
                if act != Act::SwiGlu {
                    return Err(ModelError::Config(
                        "fused gate_up experts need a SwiGLU activation".into(),
                    ));
                }
                check_experts(gate_up, [n_exp, 2 * n_ff, n_in])?;
                check_experts(down, [n_exp, n_out, n_ff])
            }
            Experts::PerExpert(v) => {
                if v.len() != n_exp {
                    return Err(ModelError::Config(format!(
                        "{} experts loaded, router has {n_exp}",
                        v.len()
                    )));
                }
                for m in v {
                    if m.act != act {
                        return Err(ModelError::Config("experts disagree on activation".into()));
                    }
                    m.validate(n_in, n_out)?;
                    check_matrix(&m.up, [n_ff, n_in])?;
                }
                Ok(())
            }
        }
    }

    fn mats(&self, e: usize, n_ff: usize) -> Result<ExpertMats<'_>> {
        Ok(match self {
            Experts::Stacked { gate, up, down } => ExpertMats {
                gate: gate
                    .as_ref()
                    .map(|g| g.expert_matrix(e, 0..n_ff))
                    .transpose()?,
                up: up.expert_matrix(e, 0..n_ff)?,
                down: down.expert_matrix(e, 0..down.shape[1])?,
            },
            Experts::FusedGateUp { gate_up, down } => ExpertMats {
                gate: Some(gate_up.expert_matrix(e, 0..n_ff)?),
                up: gate_up.expert_matrix(e, n_ff..2 * n_ff)?,
                down: down.expert_matrix(e, 0..down.shape[1])?,
            },
            Experts::PerExpert(v) => {
                let m = &v[e];
                ExpertMats {
                    gate: m.gate.as_ref().map(|g| g.matrix()).transpose()?,
                    up: m.up.matrix()?,
                    down: m.down.matrix()?,
                }
            }
        })
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
#[derive(Debug)]
pub struct Moe {
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
    pub shared: Option<Mlp>,
    /// Sigmoid gate of the shared expert `[n_embd]` (Qwen3.5: `sigmoid(x . w)` per token).
    pub shared_gate: Option<Vec<f32>>,
    /// Latent projections (Nemotron 3 Super).
    pub latent: Option<Latent>,
}

impl Moe {
    fn n_expert(&self) -> usize {
        self.router.shape.first().copied().unwrap_or(0)
    }

    /// Check shapes against the model width `d`.
    pub fn validate(&self, d: usize) -> Result<()> {
        let n_exp = self.n_expert();
        check_matrix(&self.router, [n_exp, d])?;
        if self.top_k == 0 || self.top_k > n_exp {
            return Err(ModelError::Config(format!(
                "top-k {} must be in 1..={n_exp}",
                self.top_k
            )));
        }
        if self.experts.count() != n_exp {
            return Err(ModelError::Config(format!(
                "router has {n_exp} experts, weights have {}",
                self.experts.count()
            )));
        }
        let d_exp = match &self.latent {
            Some(l) => {
                let ld = l.down.shape.first().copied().unwrap_or(0);
                check_matrix(&l.down, [ld, d])?;
                check_matrix(&l.up, [d, ld])?;
                ld
            }
            None => d,
        };
        self.experts
            .validate(n_exp, self.n_ff, d_exp, d_exp, self.act)?;
        if let Gating::Sigmoid { bias: Some(b) } = &self.gating {
            check_vec("expert selection bias", b, n_exp)?;
        }
        if let Some(s) = &self.shared {
            s.validate(d, d)?;
        }
        if let Some(g) = &self.shared_gate {
            check_vec("shared expert gate", g, d)?;
        }
        Ok(())
    }

    /// Route every token: `(expert, weight)` for each of its `top_k` slots, `[n, top_k]`.
    pub fn route(&self, be: &dyn Backend, x: &[f32], n: usize) -> Result<Vec<(usize, f32)>> {
        let n_exp = self.n_expert();
        let mut logits = vec![0f32; n * n_exp];
        be.matmul(&self.router.matrix()?, x, n, &mut logits)?;
        let k = self.top_k;
        let mut sel = Vec::with_capacity(n * k);
        let mut order: Vec<usize> = Vec::with_capacity(n_exp);
        let mut choice = vec![0f32; n_exp];
        for row in logits.chunks_exact_mut(n_exp) {
            match &self.gating {
                Gating::Softmax => {
                    kapitsa_kernels_cpu::ops::softmax(row);
                    choice.copy_from_slice(row);
                }
                Gating::Sigmoid { bias } => {
                    for (i, v) in row.iter_mut().enumerate() {
                        *v = sigmoid(*v);
                        choice[i] = *v + bias.as_ref().map_or(0.0, |b| b[i]);
                    }
                }
            }
            order.clear();
            order.extend(0..n_exp);
            // Highest score first; ties go to the lower expert index (a total order, so
            // selecting the top k and then sorting them equals sorting everything).
            let better = |a: &usize, b: &usize| choice[*b].total_cmp(&choice[*a]).then(a.cmp(b));
            if k < n_exp {
                order.select_nth_unstable_by(k - 1, better);
            }
            order[..k].sort_by(better);
            let picked = &order[..k];
            let mut sum = 0f32;
            for &e in picked {
                sum += row[e];
            }
            let norm = if self.norm_topk {
                match self.gating {
                    Gating::Softmax => 1.0 / sum,
                    Gating::Sigmoid { .. } => 1.0 / (sum + 1e-20),
                }
            } else {
                1.0
            };
            for &e in picked {
                sel.push((e, row[e] * norm * self.scale));
            }
        }
        Ok(sel)
    }

    /// `out[n, d] = moe(x[n, d])`.
    pub fn forward(&self, be: &dyn Backend, x: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        with_scratch(|sc| self.forward_with(be, x, n, out, sc))
    }

    fn forward_with(
        &self,
        be: &dyn Backend,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        sc: &mut Scratch,
    ) -> Result<()> {
        let d = x.len() / n.max(1);
        let k = self.top_k;
        let sel = self.route(be, x, n)?;

        let latent_x;
        let (xe, d_exp) = match &self.latent {
            Some(l) => {
                let ld = l.down.shape[0];
                let mut v = vec![0f32; n * ld];
                be.matmul(&l.down.matrix()?, x, n, &mut v)?;
                latent_x = v;
                (&latent_x[..], ld)
            }
            None => (x, d),
        };

        // Group (token, slot) pairs by expert.
        let n_exp = self.n_expert();
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); n_exp];
        for (i, &(e, _)) in sel.iter().enumerate() {
            by_expert[e].push(i);
        }
        // Experts that meet at most `SMALL_GROUP` (token, slot) pairs (all of a one-token
        // step's, nearly all of a batched decode step's) and, in a step of at most that many
        // tokens, the shared expert run as batched GEMVs (`run_small_groups`); the other
        // experts one at a time.
        let small: Vec<(usize, &[usize])> = by_expert
            .iter()
            .enumerate()
            .filter(|(_, p)| (1..=SMALL_GROUP).contains(&p.len()))
            .map(|(e, p)| (e, &p[..]))
            .collect();
        let shared_batched = n <= SMALL_GROUP && self.shared.is_some();
        // Every (token, slot) pair belongs to exactly one expert, so every row is written.
        let mut slot_out = std::mem::take(&mut sc.slot_out);
        let mut xin = std::mem::take(&mut sc.xin);
        let mut yout = std::mem::take(&mut sc.yout);
        let mut shared_buf = std::mem::take(&mut sc.shared);
        let res = (|| {
            let slot_out = grown(&mut slot_out, n * k * d_exp);
            let shared_out = grown(
                &mut shared_buf,
                if self.shared.is_some() { n * d } else { 0 },
            );
            let batched_shared = match &self.shared {
                Some(sh) if shared_batched => Some((sh, x, &mut *shared_out)),
                _ => None,
            };
            if !small.is_empty() || batched_shared.is_some() {
                let bufs = (&mut xin, &mut yout);
                self.run_small_groups(be, xe, d_exp, &small, slot_out, batched_shared, bufs, sc)?;
            }
            for (e, pairs) in by_expert.iter().enumerate() {
                if pairs.len() <= SMALL_GROUP {
                    continue;
                }
                let m = pairs.len();
                let xin = grown(&mut xin, m * d_exp);
                for (row, &i) in xin.chunks_exact_mut(d_exp).zip(pairs) {
                    let t = i / k;
                    row.copy_from_slice(&xe[t * d_exp..(t + 1) * d_exp]);
                }
                let yout = grown(&mut yout, m * d_exp);
                let mats = self.experts.mats(e, self.n_ff)?;
                run_mlp(
                    be,
                    true,
                    mats.gate.as_ref(),
                    &mats.up,
                    &mats.down,
                    self.act,
                    xin,
                    m,
                    yout,
                    sc,
                )?;
                for (j, &i) in pairs.iter().enumerate() {
                    slot_out[i * d_exp..(i + 1) * d_exp]
                        .copy_from_slice(&yout[j * d_exp..(j + 1) * d_exp]);
                }
            }
            // Weighted sum over each token's slots, in slot order, from zero.
            let mut routed_buf = std::mem::take(&mut sc.routed);
            let routed = match &self.latent {
                Some(_) => grown(&mut routed_buf, n * d_exp),
                None => &mut out[..n * d_exp],
            };
            routed.fill(0.0);
            for (t, acc) in routed.chunks_exact_mut(d_exp).enumerate() {
                for s in 0..k {
                    let i = t * k + s;
                    let w = sel[i].1;
                    for (a, &y) in acc.iter_mut().zip(&slot_out[i * d_exp..(i + 1) * d_exp]) {
                        *a += w * y;
                    }
                }
            }
            if let Some(l) = &self.latent {
                be.matmul(&l.up.matrix()?, &routed_buf[..n * d_exp], n, out)?;
            }
            sc.routed = routed_buf;

            // The shared expert (unless it ran with the routed ones), gated per token.
            if let Some(sh) = &self.shared {
                if !shared_batched {
                    sh.forward_with(be, x, n, shared_out, sc)?;
                }
                for t in 0..n {
                    let g = match &self.shared_gate {
                        Some(w) => {
                            sigmoid(kapitsa_kernels_cpu::ops::dot_f32(&x[t * d..(t + 1) * d], w))
                        }
                        None => 1.0,
                    };
                    for (o, &v) in out[t * d..(t + 1) * d]
                        .iter_mut()
                        .zip(&shared_out[t * d..(t + 1) * d])
                    {
                        *o += g * v;
                    }
                }
            }
            Ok::<(), ModelError>(())
        })();
        sc.slot_out = slot_out;
        sc.xin = xin;
        sc.yout = yout;
        sc.shared = shared_buf;
        res
    }

    /// The experts of `groups` (`(expert, pairs)`: an expert and the (token, slot) pairs it
    /// meets, at most [`SMALL_GROUP`]) and optionally the shared expert of a step of at most
    /// that many tokens (`(mlp, x[n, d], out[n, d])`), as two batched GEMV rounds
    /// ([`Backend::gemv_batch`]): every gate and up projection, then every down projection.
    /// Expert `e`'s output for pair `i` goes to row `i` of `slot_out` (`[n * top_k, d_exp]`):
    /// straight there for an expert of one pair, through `yout` otherwise (the inputs of an
    /// expert of several pairs are gathered in `xin`). The same products and activations as
    /// one [`run_mlp`] per expert, so the same results.
    #[allow(clippy::too_many_arguments)]
    fn run_small_groups(
        &self,
        be: &dyn Backend,
        xe: &[f32],
        d_exp: usize,
        groups: &[(usize, &[usize])],
        slot_out: &mut [f32],
        shared: Option<(&Mlp, &[f32], &mut [f32])>,
        (xin, yout): (&mut Vec<f32>, &mut Vec<f32>),
        sc: &mut Scratch,
    ) -> Result<()> {
        let (n_ff, act, k) = (self.n_ff, self.act, self.top_k);
        let mats = groups
            .iter()
            .map(|&(e, _)| self.experts.mats(e, n_ff))
            .collect::<Result<Vec<_>>>()?;
        let sh = match &shared {
            Some((m, ..)) => Some((
                m.gate.as_ref().map(|g| g.matrix()).transpose()?,
                m.up.matrix()?,
                m.down.matrix()?,
                m.act,
            )),
            None => None,
        };
        // Rows of each group, and of the groups of several pairs together.
        let n_rows: usize = groups.iter().map(|(_, p)| p.len()).sum();
        let n_multi: usize = groups.iter().map(|(_, p)| p.len()).filter(|&m| m > 1).sum();
        let g = grown(&mut sc.g, n_rows * n_ff);
        let u = grown(&mut sc.u, n_rows * n_ff);
        // The shared expert's tokens and width.
        let (sh_n, sh_ff) = match (&sh, &shared) {
            (Some((_, up, ..)), Some((_, x, _))) => (x.len() / up.n_in.max(1), up.n_out),
            _ => (0, 0),
        };
        let sg = grown(&mut sc.sg, sh_n * sh_ff);
        let su = grown(&mut sc.su, sh_n * sh_ff);
        // The inputs of the groups of several pairs, gathered.
        let xin = grown(xin, n_multi * d_exp);
        {
            let mut rows = xin.chunks_exact_mut(d_exp);
            for &i in groups
                .iter()
                .filter(|(_, p)| p.len() > 1)
                .flat_map(|(_, p)| p.iter())
            {
                let t = i / k;
                if let Some(row) = rows.next() {
                    row.copy_from_slice(&xe[t * d_exp..(t + 1) * d_exp]);
                }
            }
        }
        let xin: &[f32] = xin;
        let mut xs_g: Vec<&[f32]> = Vec::with_capacity(groups.len());
        let mut off = 0;
        for (_, pairs) in groups {
            if let [i] = pairs[..] {
                let t = i / k;
                xs_g.push(&xe[t * d_exp..(t + 1) * d_exp]);
            } else {
                let m = pairs.len();
                xs_g.push(&xin[off * d_exp..(off + m) * d_exp]);
                off += m;
            }
        }

        // Round 1: gate and up projections.
        {
            let (mut ws, mut xs, mut ys) = (Vec::new(), Vec::new(), Vec::<&mut [f32]>::new());
            let (mut gr, mut ur) = (&mut *g, &mut *u);
            for ((m, (_, pairs)), &xt) in mats.iter().zip(groups).zip(&xs_g) {
                let len = pairs.len() * n_ff;
                let (gq, g_rest) = std::mem::take(&mut gr).split_at_mut(len);
                let (uq, u_rest) = std::mem::take(&mut ur).split_at_mut(len);
                (gr, ur) = (g_rest, u_rest);
                match (act, &m.gate) {
                    (Act::SwiGlu, Some(gm)) => {
                        ws.push(*gm);
                        xs.push(xt);
                        ys.push(gq);
                    }
                    (Act::SwiGlu, None) => return Err(no_gate()),
                    (Act::Relu2, _) => {}
                }
                ws.push(m.up);
                xs.push(xt);
                ys.push(uq);
            }
            if let (Some((gm, up, _, sact)), Some((_, x, _))) = (&sh, &shared) {
                match (sact, gm) {
                    (Act::SwiGlu, Some(gm)) => {
                        ws.push(*gm);
                        xs.push(x);
                        ys.push(&mut *sg);
                    }
                    (Act::SwiGlu, None) => return Err(no_gate()),
                    (Act::Relu2, _) => {}
                }
                ws.push(*up);
                xs.push(x);
                ys.push(&mut *su);
            }
            be.gemv_batch(&ws, &xs, &mut ys)?;
        }
        // Per expert, as `run_mlp` does (the activation kernels may treat a tail apart).
        {
            let (mut gr, mut ur) = (&mut *g, &mut *u);
            for (_, pairs) in groups {
                let len = pairs.len() * n_ff;
                let (gq, g_rest) = std::mem::take(&mut gr).split_at_mut(len);
                let (uq, u_rest) = std::mem::take(&mut ur).split_at_mut(len);
                (gr, ur) = (g_rest, u_rest);
                activate(be, act, gq, uq);
            }
        }
        if let Some((.., sact)) = &sh {
            activate(be, *sact, sg, su);
        }

        // Round 2: down projections, straight into the output rows of one-pair experts.
        let yout = grown(yout, n_multi * d_exp);
        {
            let mut rows: Vec<Option<&mut [f32]>> =
                slot_out.chunks_exact_mut(d_exp).map(Some).collect();
            let (mut ws, mut xs, mut ys) = (Vec::new(), Vec::new(), Vec::<&mut [f32]>::new());
            let mut yr = &mut *yout;
            let (mut gr, mut ur) = (&*g, &*u);
            for (m, (_, pairs)) in mats.iter().zip(groups) {
                let len = pairs.len() * n_ff;
                let (gq, g_rest) = gr.split_at(len);
                let (uq, u_rest) = ur.split_at(len);
                (gr, ur) = (g_rest, u_rest);
                let y = if let [i] = pairs[..] {
                    rows.get_mut(i).and_then(Option::take).ok_or_else(|| {
                        ModelError::Config(format!("expert pair {i} listed twice or out of range"))
                    })?
                } else {
                    let (y, rest) = std::mem::take(&mut yr).split_at_mut(pairs.len() * d_exp);
                    yr = rest;
                    y
                };
                ws.push(m.down);
                xs.push(hidden(act, gq, uq));
                ys.push(y);
            }
            if let (Some((_, _, down, sact)), Some((_, _, out))) = (&sh, shared) {
                ws.push(*down);
                xs.push(hidden(*sact, sg, su));
                ys.push(out);
            }
            be.gemv_batch(&ws, &xs, &mut ys)?;
        }
        // The outputs of the groups of several pairs, to their rows.
        let mut ys = yout.chunks_exact(d_exp);
        for &i in groups
            .iter()
            .filter(|(_, p)| p.len() > 1)
            .flat_map(|(_, p)| p.iter())
        {
            let dst = slot_out
                .get_mut(i * d_exp..(i + 1) * d_exp)
                .ok_or_else(|| ModelError::Config(format!("expert pair {i} out of range")))?;
            if let Some(y) = ys.next() {
                dst.copy_from_slice(y);
            }
        }
        Ok(())
    }
}

/// The feed-forward op of a block.
// Blocks are few (two per layer), so variant size differences do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Ffn {
    /// Dense MLP.
    Mlp(Mlp),
    /// Mixture of experts.
    Moe(Moe),
}

impl Ffn {
    /// Check shapes against the model width `d`.
    pub fn validate(&self, d: usize) -> Result<()> {
        match self {
            Ffn::Mlp(m) => m.validate(d, d),
            Ffn::Moe(m) => m.validate(d),
        }
    }

    /// `out[n, d] = ffn(x[n, d])`.
    pub fn forward(&self, be: &dyn Backend, x: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        match self {
            Ffn::Mlp(m) => m.forward(be, x, n, out),
            Ffn::Moe(m) => m.forward(be, x, n, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kapitsa_backend::CpuBackend;
    use kapitsa_base::pool::RayonPool;
    use kapitsa_base::GgmlType;

    /// xorshift64*.
    struct Rng(u64);
    impl Rng {
        fn u64(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn f32(&mut self) -> f32 {
            (self.u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// A `[rows.., n_in]` weight of `ty` with random quants and small f16 scales.
    fn weight(ty: GgmlType, shape: Vec<usize>, rng: &mut Rng) -> Weight {
        let n_in = *shape.last().unwrap();
        let rows: usize = shape.iter().rev().skip(1).product();
        let mut b: Vec<u8> = (0..ty.row_bytes(n_in).unwrap() * rows)
            .map(|_| rng.u64() as u8)
            .collect();
        let f16_at: &[usize] = match ty {
            GgmlType::Q4_K => &[0, 2],
            GgmlType::Q8_0 => &[0],
            _ => unreachable!("test types"),
        };
        for blk in b.chunks_exact_mut(ty.type_size()) {
            for &o in f16_at {
                let h = half::f16::from_f32(rng.f32() * 0.01).to_bits();
                blk[o..o + 2].copy_from_slice(&h.to_le_bytes());
            }
        }
        Weight::from_bytes("w", ty, shape, b).unwrap()
    }

    fn moe(ty: GgmlType, d: usize, n_ff: usize, n_exp: usize, k: usize, rng: &mut Rng) -> Moe {
        let router: Vec<f32> = (0..n_exp * d).map(|_| rng.f32()).collect();
        let shared_gate: Vec<f32> = (0..d).map(|_| rng.f32() * 0.1).collect();
        Moe {
            router: Weight::from_f32("router", vec![n_exp, d], &router),
            gating: Gating::Softmax,
            top_k: k,
            norm_topk: true,
            scale: 1.0,
            experts: Experts::Stacked {
                gate: Some(weight(ty, vec![n_exp, n_ff, d], rng)),
                up: weight(ty, vec![n_exp, n_ff, d], rng),
                down: weight(ty, vec![n_exp, d, n_ff], rng),
            },
            n_ff,
            act: Act::SwiGlu,
            shared: Some(Mlp {
                gate: Some(weight(ty, vec![n_ff, d], rng)),
                up: weight(ty, vec![n_ff, d], rng),
                down: weight(ty, vec![d, n_ff], rng),
                act: Act::SwiGlu,
            }),
            shared_gate: Some(shared_gate),
            latent: None,
        }
    }

    /// An MoE block over a batch of tokens gives every token exactly (bitwise) what it gives
    /// that token alone: experts meeting one pair, 2-4 pairs (the batched GEMV rounds, on the
    /// multi-token GEMV for Q4_K, token by token for Q8_0) or more (one MLP each), and the
    /// shared expert batched (up to 4 tokens) or not.
    #[test]
    fn moe_batch_rows_equal_each_token_alone_bitwise() {
        let be = CpuBackend::new(Box::new(RayonPool::new(2).unwrap()));
        let mut rng = Rng(77);
        for ty in [GgmlType::Q4_K, GgmlType::Q8_0] {
            let (d, n_ff) = (256, 256);
            let m = moe(ty, d, n_ff, 8, 2, &mut rng);
            m.validate(d).unwrap();
            let mut sizes = Vec::new();
            for n in [2, 3, 4, 7, 12] {
                let x: Vec<f32> = (0..n * d).map(|_| rng.f32()).collect();
                let mut out = vec![f32::NAN; n * d];
                m.forward(&be, &x, n, &mut out).unwrap();
                // Which group sizes this batch makes (8 experts, 2 per token).
                let sel = m.route(&be, &x, n).unwrap();
                let mut count = [0usize; 8];
                for &(e, _) in &sel {
                    count[e] += 1;
                }
                sizes.extend(count);
                for t in 0..n {
                    let mut one = vec![f32::NAN; d];
                    m.forward(&be, &x[t * d..(t + 1) * d], 1, &mut one).unwrap();
                    let row = &out[t * d..(t + 1) * d];
                    assert!(
                        row.iter()
                            .zip(&one)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty:?}, {n} tokens, token {t}: {:?} vs {:?}",
                        &row[..4],
                        &one[..4]
                    );
                }
            }
            // Groups of one, of 2-4 and of more pairs all occurred.
            assert!(sizes.contains(&1), "{sizes:?}");
            assert!(sizes.iter().any(|c| (2..=4).contains(c)), "{sizes:?}");
            assert!(sizes.iter().any(|&c| c > 4), "{sizes:?}");
        }
    }
}
