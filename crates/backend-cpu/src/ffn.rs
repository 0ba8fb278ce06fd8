//! Matrix products and the feed-forward blocks on host memory: `matmul`, `matmul_many`, a
//! dense MLP (SwiGLU or squared ReLU) and a routed mixture of experts.
//!
//! The MLP and MoE execution moved here unchanged from the model layer (`layers/ffn.rs`
//! before the backend seam), so the numbers are the same. MoE execution: the router runs once
//! for the whole batch; every token picks `top_k` experts; the (token, slot) pairs are
//! grouped by expert so each active expert's weights are read once per step, over a gathered
//! `[m, d]` block of its tokens; inactive experts cost nothing. Experts meeting at most
//! [`SMALL_GROUP`] pairs (and the shared expert of a step of at most that many tokens) run as
//! two batched GEMV rounds; larger groups as one MLP each. Expert outputs are combined per
//! token in top-k slot order, weighted by the routing weights. Semantics on
//! [`MoeWeights`].
//!
//! Layouts: activations row-major `[n, width]` f32 (host); weights `[n_out, n_in]` rows of
//! their ggml type, stacked experts `[E, rows, n_in]`.
//!
//! References: transformers `Qwen3_5MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`,
//! `NemotronHMoE` / `NemotronHTopkRouter`; llama.cpp `build_moe_ffn`.

use std::cell::RefCell;

use kapitsa_backend::{
    check_len, shape_err, Act, BackendError, Experts, Gating, MlpWeights, MoeWeights, Result,
    Tensor, Weight,
};
use kapitsa_kernels_cpu::matmul::{self as kmm, QMatrix};
use kapitsa_kernels_cpu::ops as kops;

use crate::buffers::{expert_matrix, f32s_len, f32s_mut_len, matrix, mul};
use crate::ops::sigmoid;
use crate::{kernel_err, CpuBackend};

// ---- matrix products ------------------------------------------------------------------------

/// `Unsupported` unless the CPU has a dot kernel for `w`'s type.
fn check_dot_type(op: &'static str, w: &Weight) -> Result<()> {
    kapitsa_kernels_cpu::quant::vec_dot_type(w.dtype)
        .map(|_| ())
        .map_err(|_| BackendError::Unsupported {
            op,
            what: format!("matrix type {} of '{}'", w.dtype, w.name),
        })
}

/// `y[n, n_out] = x[n, n_in] @ w^T` at the backend's level.
fn mm(be: &CpuBackend, w: &QMatrix<'_>, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
    kmm::matmul_with(be.level, be.pool(), w, x, n, y).map_err(kernel_err)
}

/// Several products sharing `x`, each exactly as [`mm`] computes it.
fn mm_many(
    be: &CpuBackend,
    ws: &[QMatrix<'_>],
    x: &[f32],
    n: usize,
    ys: &mut [&mut [f32]],
) -> Result<()> {
    kmm::matmul_many_with(be.level, be.pool(), ws, x, n, ys).map_err(kernel_err)
}

/// A few tokens each through several matrices in one pool round, each as [`mm`] computes it.
fn gemv_batch(
    be: &CpuBackend,
    ws: &[QMatrix<'_>],
    xs: &[&[f32]],
    ys: &mut [&mut [f32]],
) -> Result<()> {
    kmm::gemv_batch_with(be.level, be.pool(), ws, xs, ys).map_err(kernel_err)
}

/// `Backend::matmul`.
pub(crate) fn matmul(
    be: &CpuBackend,
    w: &Weight,
    x: &Tensor,
    n_tok: usize,
    y: &mut Tensor,
) -> Result<()> {
    const OP: &str = "matmul";
    let m = matrix(OP, w)?;
    check_dot_type(OP, w)?;
    let x = f32s_len(OP, "x", x, mul(OP, n_tok, m.n_in)?)?;
    let y = f32s_mut_len(OP, "y", y, mul(OP, n_tok, m.n_out)?)?;
    if n_tok == 0 {
        return Ok(());
    }
    mm(be, &m, x, n_tok, y)
}

/// `Backend::matmul_many` (one `matmul_many_with` call, as attention's q, k, v and the Gated
/// DeltaNet in-projections ran before the seam).
pub(crate) fn matmul_many(
    be: &CpuBackend,
    ws: &[&Weight],
    x: &Tensor,
    n_tok: usize,
    ys: &mut [&mut Tensor],
) -> Result<()> {
    const OP: &str = "matmul_many";
    check_len(OP, "outputs", ys.len(), ws.len())?;
    let mats = ws
        .iter()
        .map(|w| {
            check_dot_type(OP, w)?;
            matrix(OP, w)
        })
        .collect::<Result<Vec<_>>>()?;
    let Some(n_in) = mats.first().map(|m| m.n_in) else {
        return Ok(());
    };
    if let Some(m) = mats.iter().find(|m| m.n_in != n_in) {
        return shape_err(OP, format!("matrices of {} and {n_in} inputs", m.n_in));
    }
    let x = f32s_len(OP, "x", x, mul(OP, n_tok, n_in)?)?;
    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(ys.len());
    for (y, m) in ys.iter_mut().zip(&mats) {
        outs.push(f32s_mut_len(OP, "y", y, mul(OP, n_tok, m.n_out)?)?);
    }
    if n_tok == 0 {
        return Ok(());
    }
    mm_many(be, &mats, x, n_tok, &mut outs)
}

// ---- scratch --------------------------------------------------------------------------------

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

// ---- dense MLP ------------------------------------------------------------------------------

/// Largest number of (token, slot) pairs of an MoE expert (and of tokens of a step, for the
/// shared expert) that run in the batched GEMV rounds of `Moe::run_small_groups`; larger
/// groups (prefill) take one `run_mlp` each, on the GEMMs.
const SMALL_GROUP: usize = 4;

/// Borrowed matrices of one MLP or expert.
#[derive(Clone, Copy)]
struct MlpMats<'a> {
    gate: Option<QMatrix<'a>>,
    up: QMatrix<'a>,
    down: QMatrix<'a>,
    act: Act,
}

fn no_gate(op: &'static str) -> BackendError {
    BackendError::Shape {
        op,
        msg: "SwiGLU MLP without a gate projection".into(),
    }
}

/// Checks an MLP's shapes and types and returns its matrices and `(n_in, n_out)`.
fn mlp_mats<'a>(op: &'static str, w: &'a MlpWeights) -> Result<(MlpMats<'a>, usize, usize)> {
    let up = matrix(op, &w.up)?;
    let down = matrix(op, &w.down)?;
    check_dot_type(op, &w.up)?;
    check_dot_type(op, &w.down)?;
    let (n_ff, n_in) = (up.n_out, up.n_in);
    if down.n_in != n_ff {
        return shape_err(
            op,
            format!(
                "'{}' has {} inputs, '{}' {n_ff} outputs",
                w.down.name, down.n_in, w.up.name
            ),
        );
    }
    let gate = match (&w.gate, w.act) {
        (Some(g), Act::SwiGlu) => {
            check_dot_type(op, g)?;
            let gm = matrix(op, g)?;
            if (gm.n_out, gm.n_in) != (n_ff, n_in) {
                return shape_err(
                    op,
                    format!("'{}' is {:?}, expected [{n_ff}, {n_in}]", g.name, g.shape),
                );
            }
            Some(gm)
        }
        (None, Act::Relu2) => None,
        _ => {
            return shape_err(
                op,
                format!(
                    "MLP '{}': gate projection does not match activation {:?}",
                    w.up.name, w.act
                ),
            )
        }
    };
    Ok((
        MlpMats {
            gate,
            up,
            down,
            act: w.act,
        },
        n_in,
        down.n_out,
    ))
}

/// `Backend::mlp`: `out[n, n_out] = mlp(x[n, n_in])`.
pub(crate) fn mlp(
    be: &CpuBackend,
    w: &MlpWeights,
    x: &Tensor,
    n: usize,
    out: &mut Tensor,
) -> Result<()> {
    const OP: &str = "mlp";
    let (m, n_in, n_out) = mlp_mats(OP, w)?;
    let x = f32s_len(OP, "x", x, mul(OP, n, n_in)?)?;
    let out = f32s_mut_len(OP, "out", out, mul(OP, n, n_out)?)?;
    if n == 0 {
        return Ok(());
    }
    with_scratch(|sc| run_mlp(be, &m, x, n, out, sc))
}

/// One MLP over borrowed matrices (dense layers and single experts alike). Gate and up share
/// their input, so they run as one `matmul_many` call.
fn run_mlp(
    be: &CpuBackend,
    m: &MlpMats<'_>,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    sc: &mut Scratch,
) -> Result<()> {
    let n_ff = m.up.n_out;
    let u = grown(&mut sc.u, n * n_ff);
    let gv = grown(&mut sc.g, if m.act == Act::SwiGlu { n * n_ff } else { 0 });
    match (m.act, &m.gate) {
        (Act::SwiGlu, Some(g)) => {
            let ws = [*g, m.up];
            let mut ys = [&mut *gv, &mut *u];
            mm_many(be, &ws, x, n, &mut ys)?;
        }
        (Act::Relu2, _) => mm(be, &m.up, x, n, u)?,
        (Act::SwiGlu, None) => return Err(no_gate("mlp")),
    }
    activate(be, m.act, gv, u);
    mm(be, &m.down, hidden(m.act, gv, u), n, out)?;
    Ok(())
}

/// The activation of an MLP in place, on the gate (`g`) and up (`u`) projections' outputs:
/// SwiGLU leaves `silu(g) * u` in `g`; squared ReLU leaves `relu(u)^2` in `u` (`g` unused).
fn activate(be: &CpuBackend, act: Act, g: &mut [f32], u: &mut [f32]) {
    match act {
        Act::SwiGlu if be.scalar() => kops::silu_mul_scalar(g, u),
        Act::SwiGlu => kops::silu_mul(g, u),
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

// ---- mixture of experts ---------------------------------------------------------------------

/// A checked [`MoeWeights`] with its host parameters.
struct Moe<'a> {
    w: &'a MoeWeights,
    /// Model width.
    d: usize,
    /// Width the experts run in (`d`, or the latent width).
    d_exp: usize,
    n_exp: usize,
    /// Sigmoid gating's selection bias `[n_exp]`.
    bias: Option<&'a [f32]>,
    /// The shared expert and its gate `[d]`.
    shared: Option<MlpMats<'a>>,
    shared_gate: Option<&'a [f32]>,
    /// Latent projections (down, up).
    latent: Option<(QMatrix<'a>, QMatrix<'a>)>,
}

/// Checks the routed experts' storage against `n_exp` experts of `n_ff` hidden units from and
/// to width `d_exp`.
fn check_experts(op: &'static str, m: &MoeWeights, d_exp: usize, n_exp: usize) -> Result<()> {
    let (n_ff, act) = (m.n_ff, m.act);
    let want3 = |w: &Weight, want: [usize; 3]| -> Result<()> {
        check_dot_type(op, w)?;
        if w.dims3(op)? != (want[0], want[1], want[2]) {
            return shape_err(
                op,
                format!("'{}' is {:?}, expected {want:?}", w.name, w.shape),
            );
        }
        Ok(())
    };
    match &m.experts {
        Experts::Stacked { gate, up, down } => {
            want3(up, [n_exp, n_ff, d_exp])?;
            want3(down, [n_exp, d_exp, n_ff])?;
            match (gate, act) {
                (Some(g), Act::SwiGlu) => want3(g, [n_exp, n_ff, d_exp]),
                (None, Act::Relu2) => Ok(()),
                _ => shape_err(
                    op,
                    format!(
                        "experts '{}': gate projection does not match activation {act:?}",
                        up.name
                    ),
                ),
            }
        }
        Experts::FusedGateUp { gate_up, down } => {
            if act != Act::SwiGlu {
                return shape_err(op, "fused gate_up experts need a SwiGLU activation");
            }
            want3(gate_up, [n_exp, 2 * n_ff, d_exp])?;
            want3(down, [n_exp, d_exp, n_ff])
        }
        Experts::PerExpert(v) => {
            check_len(op, "experts", v.len(), n_exp)?;
            for e in v {
                if e.act != act {
                    return shape_err(op, "experts disagree on activation");
                }
                let (mats, n_in, n_out) = mlp_mats(op, e)?;
                if (n_in, n_out, mats.up.n_out) != (d_exp, d_exp, n_ff) {
                    return shape_err(
                        op,
                        format!(
                            "expert '{}' maps {n_in} -> {n_out} through {}, expected \
                             {d_exp} -> {d_exp} through {n_ff}",
                            e.up.name, mats.up.n_out
                        ),
                    );
                }
            }
            Ok(())
        }
    }
}

impl<'a> Moe<'a> {
    /// Checks every shape of `w` (what the model's validation checks, so no kernel can
    /// refuse its arguments later).
    fn new(op: &'static str, w: &'a MoeWeights) -> Result<Moe<'a>> {
        check_dot_type(op, &w.router)?;
        let (n_exp, d) = w.router.dims2(op)?;
        if w.top_k == 0 || w.top_k > n_exp {
            return shape_err(op, format!("top-k {} must be in 1..={n_exp}", w.top_k));
        }
        check_len(op, "experts", w.experts.count(), n_exp)?;
        let latent = match &w.latent {
            Some(l) => {
                check_dot_type(op, &l.down)?;
                check_dot_type(op, &l.up)?;
                let (dm, um) = (matrix(op, &l.down)?, matrix(op, &l.up)?);
                if dm.n_in != d || (um.n_out, um.n_in) != (d, dm.n_out) {
                    return shape_err(
                        op,
                        format!(
                            "latent projections {:?} and {:?} do not fit width {d}",
                            l.down.shape, l.up.shape
                        ),
                    );
                }
                Some((dm, um))
            }
            None => None,
        };
        let d_exp = latent.map_or(d, |(dm, _)| dm.n_out);
        check_experts(op, w, d_exp, n_exp)?;
        let bias = match &w.gating {
            Gating::Sigmoid { bias: Some(b) } => Some(f32s_len(op, "selection bias", b, n_exp)?),
            _ => None,
        };
        let shared = match &w.shared {
            Some(s) => {
                let (m, n_in, n_out) = mlp_mats(op, s)?;
                if (n_in, n_out) != (d, d) {
                    return shape_err(
                        op,
                        format!("shared expert maps {n_in} -> {n_out}, expected {d} -> {d}"),
                    );
                }
                Some(m)
            }
            None => None,
        };
        let shared_gate = match &w.shared_gate {
            Some(g) => Some(f32s_len(op, "shared expert gate", g, d)?),
            None => None,
        };
        Ok(Moe {
            w,
            d,
            d_exp,
            n_exp,
            bias,
            shared,
            shared_gate,
            latent,
        })
    }

    /// Matrices of expert `e`.
    fn mats(&self, e: usize) -> Result<MlpMats<'a>> {
        const OP: &str = "moe";
        let (n_ff, act) = (self.w.n_ff, self.w.act);
        let d_exp = self.d_exp;
        Ok(match &self.w.experts {
            Experts::Stacked { gate, up, down } => MlpMats {
                gate: gate
                    .as_ref()
                    .map(|g| expert_matrix(OP, g, e, 0..n_ff))
                    .transpose()?,
                up: expert_matrix(OP, up, e, 0..n_ff)?,
                down: expert_matrix(OP, down, e, 0..d_exp)?,
                act,
            },
            Experts::FusedGateUp { gate_up, down } => MlpMats {
                gate: Some(expert_matrix(OP, gate_up, e, 0..n_ff)?),
                up: expert_matrix(OP, gate_up, e, n_ff..2 * n_ff)?,
                down: expert_matrix(OP, down, e, 0..d_exp)?,
                act,
            },
            Experts::PerExpert(v) => {
                let m = v.get(e).ok_or_else(|| BackendError::Shape {
                    op: OP,
                    msg: format!("expert {e} out of range"),
                })?;
                mlp_mats(OP, m)?.0
            }
        })
    }

    /// Route every token: `(expert, weight)` for each of its `top_k` slots, `[n, top_k]`.
    fn route(&self, be: &CpuBackend, x: &[f32], n: usize) -> Result<Vec<(usize, f32)>> {
        let n_exp = self.n_exp;
        let mut logits = vec![0f32; n * n_exp];
        mm(be, &matrix("moe", &self.w.router)?, x, n, &mut logits)?;
        let k = self.w.top_k;
        let mut sel = Vec::with_capacity(n * k);
        let mut order: Vec<usize> = Vec::with_capacity(n_exp);
        let mut choice = vec![0f32; n_exp];
        for row in logits.chunks_exact_mut(n_exp) {
            match &self.w.gating {
                Gating::Softmax => {
                    kops::softmax(row);
                    choice.copy_from_slice(row);
                }
                Gating::Sigmoid { .. } => {
                    for (i, v) in row.iter_mut().enumerate() {
                        *v = sigmoid(*v);
                        choice[i] = *v + self.bias.map_or(0.0, |b| b[i]);
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
            let norm = if self.w.norm_topk {
                match self.w.gating {
                    Gating::Softmax => 1.0 / sum,
                    Gating::Sigmoid { .. } => 1.0 / (sum + 1e-20),
                }
            } else {
                1.0
            };
            for &e in picked {
                sel.push((e, row[e] * norm * self.w.scale));
            }
        }
        Ok(sel)
    }

    /// `out[n, d] = moe(x[n, d])` on the caller's scratch.
    fn forward_with(
        &self,
        be: &CpuBackend,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        sc: &mut Scratch,
    ) -> Result<()> {
        let d = self.d;
        let k = self.w.top_k;
        let sel = self.route(be, x, n)?;

        let latent_x;
        let (xe, d_exp) = match &self.latent {
            Some((down, _)) => {
                let ld = down.n_out;
                let mut v = vec![0f32; n * ld];
                mm(be, down, x, n, &mut v)?;
                latent_x = v;
                (&latent_x[..], ld)
            }
            None => (x, d),
        };

        // Group (token, slot) pairs by expert.
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); self.n_exp];
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
                run_mlp(be, &self.mats(e)?, xin, m, yout, sc)?;
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
            if let Some((_, up)) = &self.latent {
                mm(be, up, &routed_buf[..n * d_exp], n, out)?;
            }
            sc.routed = routed_buf;

            // The shared expert (unless it ran with the routed ones), gated per token.
            if let Some(sh) = &self.shared {
                if !shared_batched {
                    run_mlp(be, sh, x, n, shared_out, sc)?;
                }
                for t in 0..n {
                    let xt = &x[t * d..(t + 1) * d];
                    let g = match self.shared_gate {
                        Some(w) if be.scalar() => sigmoid(kops::dot_f32_scalar(xt, w)),
                        Some(w) => sigmoid(kops::dot_f32(xt, w)),
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
            Ok::<(), BackendError>(())
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
    /// ([`gemv_batch`]): every gate and up projection, then every down projection.
    /// Expert `e`'s output for pair `i` goes to row `i` of `slot_out` (`[n * top_k, d_exp]`):
    /// straight there for an expert of one pair, through `yout` otherwise (the inputs of an
    /// expert of several pairs are gathered in `xin`). The same products and activations as
    /// one [`run_mlp`] per expert, so the same results.
    #[allow(clippy::too_many_arguments)]
    fn run_small_groups(
        &self,
        be: &CpuBackend,
        xe: &[f32],
        d_exp: usize,
        groups: &[(usize, &[usize])],
        slot_out: &mut [f32],
        shared: Option<(&MlpMats<'_>, &[f32], &mut [f32])>,
        (xin, yout): (&mut Vec<f32>, &mut Vec<f32>),
        sc: &mut Scratch,
    ) -> Result<()> {
        const OP: &str = "moe";
        let (n_ff, act, k) = (self.w.n_ff, self.w.act, self.w.top_k);
        let mats = groups
            .iter()
            .map(|&(e, _)| self.mats(e))
            .collect::<Result<Vec<_>>>()?;
        // Rows of each group, and of the groups of several pairs together.
        let n_rows: usize = groups.iter().map(|(_, p)| p.len()).sum();
        let n_multi: usize = groups.iter().map(|(_, p)| p.len()).filter(|&m| m > 1).sum();
        let g = grown(&mut sc.g, n_rows * n_ff);
        let u = grown(&mut sc.u, n_rows * n_ff);
        // The shared expert's tokens and width.
        let (sh_n, sh_ff) = match &shared {
            Some((m, x, _)) => (x.len() / m.up.n_in.max(1), m.up.n_out),
            None => (0, 0),
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
                    (Act::SwiGlu, None) => return Err(no_gate(OP)),
                    (Act::Relu2, _) => {}
                }
                ws.push(m.up);
                xs.push(xt);
                ys.push(uq);
            }
            if let Some((sm, x, _)) = &shared {
                match (sm.act, &sm.gate) {
                    (Act::SwiGlu, Some(gm)) => {
                        ws.push(*gm);
                        xs.push(x);
                        ys.push(&mut *sg);
                    }
                    (Act::SwiGlu, None) => return Err(no_gate(OP)),
                    (Act::Relu2, _) => {}
                }
                ws.push(sm.up);
                xs.push(x);
                ys.push(&mut *su);
            }
            gemv_batch(be, &ws, &xs, &mut ys)?;
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
        if let Some((sm, ..)) = &shared {
            activate(be, sm.act, sg, su);
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
                    rows.get_mut(i)
                        .and_then(Option::take)
                        .ok_or_else(|| BackendError::Shape {
                            op: OP,
                            msg: format!("expert pair {i} listed twice or out of range"),
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
            if let Some((sm, _, out)) = shared {
                ws.push(sm.down);
                xs.push(hidden(sm.act, sg, su));
                ys.push(out);
            }
            gemv_batch(be, &ws, &xs, &mut ys)?;
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
                .ok_or_else(|| BackendError::Shape {
                    op: OP,
                    msg: format!("expert pair {i} out of range"),
                })?;
            if let Some(y) = ys.next() {
                dst.copy_from_slice(y);
            }
        }
        Ok(())
    }
}

/// `Backend::moe`: `out[n, d] = moe(x[n, d])`.
pub(crate) fn moe(
    be: &CpuBackend,
    w: &MoeWeights,
    x: &Tensor,
    n: usize,
    out: &mut Tensor,
) -> Result<()> {
    const OP: &str = "moe";
    let m = Moe::new(OP, w)?;
    let x = f32s_len(OP, "x", x, mul(OP, n, m.d)?)?;
    let out = f32s_mut_len(OP, "out", out, mul(OP, n, m.d)?)?;
    if n == 0 {
        return Ok(());
    }
    with_scratch(|sc| m.forward_with(be, x, n, out, sc))
}

/// The routing of `x[n, d]` (`(expert, weight)` per token and slot), for tests.
#[cfg(test)]
fn route(be: &CpuBackend, w: &MoeWeights, x: &Tensor, n: usize) -> Result<Vec<(usize, f32)>> {
    let m = Moe::new("moe", w)?;
    m.route(be, crate::buffers::f32s("moe", "x", x)?, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kapitsa_backend::{Backend, DType, HostBytes, HostWeight};
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
    fn weight(be: &CpuBackend, ty: GgmlType, shape: Vec<usize>, rng: &mut Rng) -> Weight {
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
        be.upload_weight(&HostWeight {
            name: "w".into(),
            dtype: ty,
            shape,
            bytes: HostBytes::from_vec(b),
        })
        .unwrap()
    }

    fn f32_weight(be: &CpuBackend, shape: Vec<usize>, v: &[f32]) -> Weight {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        be.upload_weight(&HostWeight {
            name: "router".into(),
            dtype: GgmlType::F32,
            shape,
            bytes: HostBytes::from_vec(bytes),
        })
        .unwrap()
    }

    fn moe_weights(
        be: &CpuBackend,
        ty: GgmlType,
        d: usize,
        n_ff: usize,
        n_exp: usize,
        k: usize,
        rng: &mut Rng,
    ) -> MoeWeights {
        let router: Vec<f32> = (0..n_exp * d).map(|_| rng.f32()).collect();
        let shared_gate: Vec<f32> = (0..d).map(|_| rng.f32() * 0.1).collect();
        MoeWeights {
            router: f32_weight(be, vec![n_exp, d], &router),
            gating: Gating::Softmax,
            top_k: k,
            norm_topk: true,
            scale: 1.0,
            experts: Experts::Stacked {
                gate: Some(weight(be, ty, vec![n_exp, n_ff, d], rng)),
                up: weight(be, ty, vec![n_exp, n_ff, d], rng),
                down: weight(be, ty, vec![n_exp, d, n_ff], rng),
            },
            n_ff,
            act: Act::SwiGlu,
            shared: Some(MlpWeights {
                gate: Some(weight(be, ty, vec![n_ff, d], rng)),
                up: weight(be, ty, vec![n_ff, d], rng),
                down: weight(be, ty, vec![d, n_ff], rng),
                act: Act::SwiGlu,
            }),
            shared_gate: Some(be.upload_f32(&shared_gate).unwrap()),
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
            let m = moe_weights(&be, ty, d, n_ff, 8, 2, &mut rng);
            let mut sizes = Vec::new();
            for n in [2, 3, 4, 7, 12] {
                let xv: Vec<f32> = (0..n * d).map(|_| rng.f32()).collect();
                let x = be.upload_f32(&xv).unwrap();
                let mut out = be.alloc(DType::F32, n * d).unwrap();
                be.moe(&m, &x, n, &mut out).unwrap();
                let out = crate::host_f32(&out).unwrap();
                // Which group sizes this batch makes (8 experts, 2 per token).
                let sel = route(&be, &m, &x, n).unwrap();
                let mut count = [0usize; 8];
                for &(e, _) in &sel {
                    count[e] += 1;
                }
                sizes.extend(count);
                for t in 0..n {
                    let x1 = be.upload_f32(&xv[t * d..(t + 1) * d]).unwrap();
                    let mut one = be.alloc(DType::F32, d).unwrap();
                    be.moe(&m, &x1, 1, &mut one).unwrap();
                    let one = crate::host_f32(&one).unwrap();
                    let row = &out[t * d..(t + 1) * d];
                    assert!(
                        row.iter().zip(one).all(|(a, b)| a.to_bits() == b.to_bits()),
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

    /// A bad descriptor is a shape error, not a panic.
    #[test]
    fn moe_rejects_bad_descriptors() {
        let be = CpuBackend::new(Box::new(RayonPool::new(1).unwrap()));
        let mut rng = Rng(5);
        let mut m = moe_weights(&be, GgmlType::Q8_0, 64, 32, 4, 2, &mut rng);
        let x = be.upload_f32(&vec![0.5; 64]).unwrap();
        let mut out = be.alloc(DType::F32, 64).unwrap();
        m.top_k = 5;
        assert!(matches!(
            be.moe(&m, &x, 1, &mut out),
            Err(BackendError::Shape { .. })
        ));
        m.top_k = 2;
        m.shared_gate = Some(be.upload_f32(&[1.0; 3]).unwrap());
        assert!(matches!(
            be.moe(&m, &x, 1, &mut out),
            Err(BackendError::Shape { .. })
        ));
        m.shared_gate = None;
        be.moe(&m, &x, 1, &mut out).unwrap();
        assert!(matches!(
            be.moe(&m, &x, 2, &mut out),
            Err(BackendError::Shape { .. })
        ));
    }
}
