//! The recurrent mixers' per-sequence ops on host memory: the depthwise causal conv1d with
//! its carried window, the Gated DeltaNet recurrence and the Mamba2 scan.
//!
//! Each op takes whole-batch tensors (`[n_tokens, width]` rows) and runs the kernel of
//! `kapitsa-kernels-cpu` once per sequence of the batch, on that sequence's contiguous rows
//! `start..start + len` and on its slot's state (`state[slot]`, rows of the per-sequence
//! state length), exactly as the model layers called them before the backend seam
//! (`conv::conv1d_causal`, `gdn::gdn`, `mamba2::mamba2`, no `keep` buffer). The scalar
//! reference takes the plain-loop twins (`conv1d_causal_scalar`, `gdn_recurrent_scalar`,
//! `mamba2_scan_scalar`).

use std::ops::Range;

use kapitsa_backend::{shape_err, Batch, GdnShape, HeadOrder, Mamba2Shape, Result, Tensor};
use kapitsa_kernels_cpu::{conv, gdn as kgdn, mamba2 as km2};

use crate::buffers::{desc, f32s_len, f32s_mut, f32s_mut_len, mul};
use crate::CpuBackend;

/// The kernel and parameters of a [`conv1d_causal`] call.
pub(crate) struct Conv<'a> {
    /// Channels `c` (row width of `x` and `out`).
    pub channels: usize,
    /// Kernel width (>= 1).
    pub k: usize,
    /// `[c, k]`, tap `k - 1` on the current token.
    pub w: &'a Tensor,
    /// Optional `[c]`.
    pub bias: Option<&'a Tensor>,
    /// Apply SiLU to the results.
    pub silu: bool,
}

/// The inputs of a [`gdn`] call (layouts on `Backend::gdn`).
pub(crate) struct GdnInputs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub g: &'a Tensor,
    pub beta: &'a Tensor,
}

/// The inputs of a [`mamba2`] call (layouts on `Backend::mamba2`).
pub(crate) struct Mamba2Inputs<'a> {
    pub x: &'a Tensor,
    pub dt: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
    pub d: &'a Tensor,
}

/// Values `slot * per .. (slot + 1) * per` of a per-slot state tensor of `len` values
/// (`[n_slots, per]`), checked.
fn slot_range(
    op: &'static str,
    what: &str,
    len: usize,
    per: usize,
    slot: usize,
) -> Result<Range<usize>> {
    if per > 0 && !len.is_multiple_of(per) {
        return shape_err(
            op,
            format!("{what} has {len} values, not whole slots of {per}"),
        );
    }
    let end = slot.checked_add(1).and_then(|s| s.checked_mul(per));
    match end {
        Some(e) if e <= len => Ok(e - per..e),
        _ => shape_err(
            op,
            format!(
                "{what}: slot {slot} out of range ({} slots)",
                len / per.max(1)
            ),
        ),
    }
}

/// Depthwise causal conv1d per sequence, reading and updating `conv_state[slot]`
/// (`[(k - 1), channels]` per slot, oldest row first).
pub(crate) fn conv1d_causal(
    be: &CpuBackend,
    x: &Tensor,
    cv: &Conv<'_>,
    conv_state: &mut Tensor,
    batch: &Batch,
    out: &mut Tensor,
) -> Result<()> {
    const OP: &str = "conv1d_causal";
    let b = desc(OP, batch)?;
    let (c, k) = (cv.channels, cv.k);
    if k == 0 {
        return shape_err(OP, "kernel width 0");
    }
    let n = mul(OP, b.n_tokens(), c)?;
    let x = f32s_len(OP, "x", x, n)?;
    let w = f32s_len(OP, "w", cv.w, mul(OP, c, k)?)?;
    let bias = match cv.bias {
        Some(t) => Some(f32s_len(OP, "bias", t, c)?),
        None => None,
    };
    let out = f32s_mut_len(OP, "out", out, n)?;
    let st = f32s_mut(OP, "conv_state", conv_state)?;
    let per = mul(OP, k - 1, c)?;
    let ranges = b
        .seqs
        .iter()
        .map(|s| slot_range(OP, "conv_state", st.len(), per, s.slot))
        .collect::<Result<Vec<_>>>()?;
    for (s, sr) in b.seqs.iter().zip(ranges) {
        let (t, r) = (s.len, s.start * c..(s.start + s.len) * c);
        let state = &mut st[sr];
        if be.scalar() {
            conv::conv1d_causal_scalar(
                &x[r.clone()],
                t,
                c,
                k,
                w,
                bias,
                state,
                cv.silu,
                &mut out[r],
            );
        } else {
            conv::conv1d_causal(
                be.pool(),
                &x[r.clone()],
                t,
                c,
                k,
                w,
                bias,
                state,
                cv.silu,
                &mut out[r],
            );
        }
    }
    Ok(())
}

/// The kernel's shape for `s`, checked.
fn gdn_shape(op: &'static str, s: GdnShape) -> Result<kgdn::GdnShape> {
    if s.n_k_heads == 0
        || s.n_v_heads == 0
        || s.dk == 0
        || s.dv == 0
        || !s.n_v_heads.is_multiple_of(s.n_k_heads)
    {
        return shape_err(op, format!("bad Gated DeltaNet shape {s:?}"));
    }
    Ok(kgdn::GdnShape {
        n_k_heads: s.n_k_heads,
        n_v_heads: s.n_v_heads,
        dk: s.dk,
        dv: s.dv,
        order: match s.order {
            HeadOrder::Grouped => kgdn::HeadOrder::Grouped,
            HeadOrder::Tiled => kgdn::HeadOrder::Tiled,
        },
    })
}

/// Gated DeltaNet recurrence per sequence on `state[slot]` (`[n_v_heads, dk, dv]` per slot).
pub(crate) fn gdn(
    be: &CpuBackend,
    shape: GdnShape,
    inp: &GdnInputs<'_>,
    state: &mut Tensor,
    batch: &Batch,
    out: &mut Tensor,
) -> Result<()> {
    const OP: &str = "gdn";
    let b = desc(OP, batch)?;
    let ks = gdn_shape(OP, shape)?;
    let n = b.n_tokens();
    let kd = mul(OP, shape.n_k_heads, shape.dk)?;
    let vd = mul(OP, shape.n_v_heads, shape.dv)?;
    let nv = shape.n_v_heads;
    let q = f32s_len(OP, "q", inp.q, mul(OP, n, kd)?)?;
    let k = f32s_len(OP, "k", inp.k, mul(OP, n, kd)?)?;
    let v = f32s_len(OP, "v", inp.v, mul(OP, n, vd)?)?;
    let g = f32s_len(OP, "g", inp.g, mul(OP, n, nv)?)?;
    let beta = f32s_len(OP, "beta", inp.beta, mul(OP, n, nv)?)?;
    let out = f32s_mut_len(OP, "out", out, mul(OP, n, vd)?)?;
    let st = f32s_mut(OP, "state", state)?;
    let per = mul(OP, vd, shape.dk)?;
    let ranges = b
        .seqs
        .iter()
        .map(|s| slot_range(OP, "state", st.len(), per, s.slot))
        .collect::<Result<Vec<_>>>()?;
    for (s, sr) in b.seqs.iter().zip(ranges) {
        let r = s.start..s.start + s.len;
        let rows = |w: usize| r.start * w..r.end * w;
        let (qs, kk, vs) = (&q[rows(kd)], &k[rows(kd)], &v[rows(vd)]);
        let (gs, bs) = (&g[rows(nv)], &beta[rows(nv)]);
        let (state, o) = (&mut st[sr], &mut out[rows(vd)]);
        if be.scalar() {
            kgdn::gdn_recurrent_scalar(&ks, qs, kk, vs, gs, bs, state, o, None);
        } else {
            kgdn::gdn(be.pool(), &ks, qs, kk, vs, gs, bs, state, o, None);
        }
    }
    Ok(())
}

/// Mamba2 SSD scan per sequence on `state[slot]` (`[H, P, N]` per slot).
pub(crate) fn mamba2(
    be: &CpuBackend,
    shape: Mamba2Shape,
    inp: &Mamba2Inputs<'_>,
    state: &mut Tensor,
    batch: &Batch,
    y: &mut Tensor,
) -> Result<()> {
    const OP: &str = "mamba2";
    let bd = desc(OP, batch)?;
    let Mamba2Shape {
        n_heads: nh,
        head_dim: np,
        d_state: ns,
        n_groups: ng,
    } = shape;
    if nh == 0 || np == 0 || ns == 0 || ng == 0 || !nh.is_multiple_of(ng) {
        return shape_err(OP, format!("bad Mamba2 shape {shape:?}"));
    }
    let ks = km2::Mamba2Shape {
        n_heads: nh,
        head_dim: np,
        d_state: ns,
        n_groups: ng,
    };
    let n = bd.n_tokens();
    let di = mul(OP, nh, np)?;
    let gn = mul(OP, ng, ns)?;
    let x = f32s_len(OP, "x", inp.x, mul(OP, n, di)?)?;
    let dt = f32s_len(OP, "dt", inp.dt, mul(OP, n, nh)?)?;
    let a = f32s_len(OP, "a", inp.a, nh)?;
    let b = f32s_len(OP, "b", inp.b, mul(OP, n, gn)?)?;
    let c = f32s_len(OP, "c", inp.c, mul(OP, n, gn)?)?;
    let d = f32s_len(OP, "d", inp.d, nh)?;
    let y = f32s_mut_len(OP, "y", y, mul(OP, n, di)?)?;
    let st = f32s_mut(OP, "state", state)?;
    let per = mul(OP, di, ns)?;
    let ranges = bd
        .seqs
        .iter()
        .map(|s| slot_range(OP, "state", st.len(), per, s.slot))
        .collect::<Result<Vec<_>>>()?;
    for (s, sr) in bd.seqs.iter().zip(ranges) {
        let r = s.start..s.start + s.len;
        let rows = |w: usize| r.start * w..r.end * w;
        let (xs, dts, bs, cs) = (&x[rows(di)], &dt[rows(nh)], &b[rows(gn)], &c[rows(gn)]);
        let (state, ys) = (&mut st[sr], &mut y[rows(di)]);
        if be.scalar() {
            km2::mamba2_scan_scalar(&ks, xs, dts, a, bs, cs, d, state, ys, None);
        } else {
            km2::mamba2(be.pool(), &ks, xs, dts, a, bs, cs, d, state, ys, None);
        }
    }
    Ok(())
}
