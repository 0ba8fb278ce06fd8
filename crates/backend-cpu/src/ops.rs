//! Element-wise and row ops on host f32 tensors: the embedding gather, norms, residual and
//! bias adds, gates, column splits, RoPE, the Gated DeltaNet / Mamba2 gate arithmetic and the
//! argmax of sampling. Each computes exactly what the model layers computed before the
//! backend seam (`layers/decoder.rs`, `attention.rs`, `gdn.rs`, `mamba2.rs`), with the same
//! kernels of `kapitsa_kernels_cpu::ops`. Layouts are row-major `[rows, width]`; every length
//! is checked before a kernel runs.

use kapitsa_backend::{
    check_len, shape_err, BackendError, Batch, Result, RopeDesc, Tensor, Weight,
};
use kapitsa_kernels_cpu::ops::{self as kops, Rope};
use kapitsa_kernels_cpu::KernelError;

use crate::buffers::{desc, f32s, f32s_len, f32s_mut, f32s_mut_len, matrix, mul};
use crate::kernel_err;

/// `1 / (1 + exp(-x))` (as the model layers computed it).
#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, linear above 20 (as torch's `softplus`).
#[inline]
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Rows of a tensor of `len` values in rows of `width` (`width > 0`, `len` a multiple).
pub(crate) fn rows_of(op: &'static str, what: &str, len: usize, width: usize) -> Result<usize> {
    if width == 0 || !len.is_multiple_of(width) {
        return shape_err(
            op,
            format!("{what} has {len} values, not whole rows of {width}"),
        );
    }
    Ok(len / width)
}

/// `out[i, :] = dequant(w[tokens[i], :])`, out `[n_tokens, n_in]`.
pub(crate) fn embed(w: &Weight, batch: &Batch, out: &mut Tensor) -> Result<()> {
    const OP: &str = "embed";
    let b = desc(OP, batch)?;
    let m = matrix(OP, w)?;
    let out = f32s_mut_len(OP, "out", out, mul(OP, b.n_tokens(), m.n_in)?)?;
    if let Some(&bad) = b.tokens.iter().find(|&&t| t as usize >= m.n_out) {
        return shape_err(
            OP,
            format!(
                "token id {bad} out of range ('{}' has {} rows)",
                w.name, m.n_out
            ),
        );
    }
    kapitsa_kernels_cpu::matmul::get_rows(&m, &b.tokens, out).map_err(|e| match e {
        KernelError::UnsupportedType { .. } => BackendError::Unsupported {
            op: OP,
            what: format!("type {} of '{}'", w.dtype, w.name),
        },
        e => kernel_err(e),
    })
}

/// RMSNorm of each `width`-wide row in place: `x / sqrt(mean(x^2) + eps) * w`.
pub(crate) fn rms_norm(x: &mut Tensor, width: usize, w: &Tensor, eps: f32) -> Result<()> {
    const OP: &str = "rms_norm";
    let w = f32s_len(OP, "w", w, width)?;
    let x = f32s_mut(OP, "x", x)?;
    rows_of(OP, "x", x.len(), width)?;
    kops::rms_norm(x, width, w, eps, 0.0);
    Ok(())
}

/// `y += x`.
pub(crate) fn add(y: &mut Tensor, x: &Tensor) -> Result<()> {
    const OP: &str = "add";
    let x = f32s(OP, "x", x)?;
    let y = f32s_mut_len(OP, "y", y, x.len())?;
    kops::add_inplace(y, x);
    Ok(())
}

/// Add the row `b` to every row of `x`.
pub(crate) fn add_bias(x: &mut Tensor, b: &Tensor) -> Result<()> {
    const OP: &str = "add_bias";
    let b = f32s(OP, "b", b)?;
    let x = f32s_mut(OP, "x", x)?;
    rows_of(OP, "x", x.len(), b.len())?;
    for row in x.chunks_exact_mut(b.len()) {
        kops::add_inplace(row, b);
    }
    Ok(())
}

/// `x = x * sigmoid(gate)`.
pub(crate) fn mul_sigmoid(x: &mut Tensor, gate: &Tensor) -> Result<()> {
    const OP: &str = "mul_sigmoid";
    let g = f32s(OP, "gate", gate)?;
    let x = f32s_mut_len(OP, "x", x, g.len())?;
    for (a, &gv) in x.iter_mut().zip(g) {
        *a *= sigmoid(gv);
    }
    Ok(())
}

/// Split each row of `src` into column blocks of `widths`.
pub(crate) fn split_cols(
    src: &Tensor,
    rows: usize,
    widths: &[usize],
    outs: &mut [&mut Tensor],
) -> Result<()> {
    const OP: &str = "split_cols";
    check_len(OP, "outs", outs.len(), widths.len())?;
    let total = widths
        .iter()
        .try_fold(0usize, |a, &w| a.checked_add(w))
        .ok_or_else(|| BackendError::Shape {
            op: OP,
            msg: "widths overflow".into(),
        })?;
    let src = f32s_len(OP, "src", src, mul(OP, rows, total)?)?;
    let mut col = 0;
    for (out, &w) in outs.iter_mut().zip(widths) {
        let o = f32s_mut_len(OP, "out", out, mul(OP, rows, w)?)?;
        if w > 0 {
            for (r, dst) in o.chunks_exact_mut(w).enumerate() {
                let s = r * total + col;
                dst.copy_from_slice(&src[s..s + w]);
            }
        }
        col += w;
    }
    Ok(())
}

/// `out[i, :] = x[logit_rows[i], :]`.
pub(crate) fn gather_logit_rows(
    x: &Tensor,
    width: usize,
    batch: &Batch,
    out: &mut Tensor,
) -> Result<()> {
    const OP: &str = "gather_logit_rows";
    let b = desc(OP, batch)?;
    let x = f32s_len(OP, "x", x, mul(OP, b.n_tokens(), width)?)?;
    let out = f32s_mut_len(OP, "out", out, mul(OP, b.logit_rows.len(), width)?)?;
    // `prepare_batch` checked every row is below `n_tokens`.
    for (i, &r) in b.logit_rows.iter().enumerate() {
        let r = r as usize;
        out[i * width..(i + 1) * width].copy_from_slice(&x[r * width..(r + 1) * width]);
    }
    Ok(())
}

/// NeoX RoPE in place on `x [n_tokens, n_heads * head_dim]`, each token at its position:
/// `Rope::new(n_rot, theta)`, its `table(p)` and `apply_neox` (ggml's angles and FMA form).
pub(crate) fn rope(
    x: &mut Tensor,
    n_heads: usize,
    head_dim: usize,
    rope: RopeDesc,
    batch: &Batch,
) -> Result<()> {
    const OP: &str = "rope";
    let b = desc(OP, batch)?;
    if head_dim == 0 || rope.n_rot > head_dim || !rope.n_rot.is_multiple_of(2) {
        return shape_err(
            OP,
            format!("{} rotary dims do not fit head_dim {head_dim}", rope.n_rot),
        );
    }
    let w = mul(OP, n_heads, head_dim)?;
    let x = f32s_mut_len(OP, "x", x, mul(OP, b.n_tokens(), w)?)?;
    if w == 0 {
        return Ok(());
    }
    let r = Rope::new(rope.n_rot, rope.theta);
    let mut cs = vec![(0f32, 0f32); r.n_pairs()];
    for (row, &p) in x.chunks_exact_mut(w).zip(&b.positions) {
        r.table(p, &mut cs);
        r.apply_neox(row, head_dim, &cs);
    }
    Ok(())
}

/// L2 normalisation of each `width`-wide row, times `scale`.
pub(crate) fn l2_norm(x: &mut Tensor, width: usize, eps: f32, scale: f32) -> Result<()> {
    const OP: &str = "l2_norm";
    let x = f32s_mut(OP, "x", x)?;
    rows_of(OP, "x", x.len(), width)?;
    kapitsa_kernels_cpu::gdn::l2_norm_rows(x, width, eps, scale);
    Ok(())
}

/// Gated DeltaNet gates: `beta = sigmoid(beta)`, `g = a_neg * softplus(g + dt_bias)`, rows
/// of `n_v = dt_bias.len()` heads.
pub(crate) fn gdn_gates(
    beta: &mut Tensor,
    g: &mut Tensor,
    dt_bias: &Tensor,
    a_neg: &Tensor,
) -> Result<()> {
    const OP: &str = "gdn_gates";
    let dt_bias = f32s(OP, "dt_bias", dt_bias)?;
    let nv = dt_bias.len();
    let a_neg = f32s_len(OP, "a_neg", a_neg, nv)?;
    let g = f32s_mut(OP, "g", g)?;
    rows_of(OP, "g", g.len(), nv)?;
    let beta = f32s_mut_len(OP, "beta", beta, g.len())?;
    for v in beta.iter_mut() {
        *v = sigmoid(*v);
    }
    for row in g.chunks_exact_mut(nv) {
        for ((gv, &bias), &an) in row.iter_mut().zip(dt_bias).zip(a_neg) {
            *gv = an * softplus(*gv + bias);
        }
    }
    Ok(())
}

/// `dt = softplus(dt + bias)` in rows of `bias.len()`.
pub(crate) fn softplus_bias(dt: &mut Tensor, bias: &Tensor) -> Result<()> {
    const OP: &str = "softplus_bias";
    let bias = f32s(OP, "bias", bias)?;
    let dt = f32s_mut(OP, "dt", dt)?;
    rows_of(OP, "dt", dt.len(), bias.len())?;
    for row in dt.chunks_exact_mut(bias.len()) {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v = softplus(*v + b);
        }
    }
    Ok(())
}

/// `x = rmsnorm(x) * w * silu(z)` per `width`-wide row.
pub(crate) fn gated_rms_norm(
    x: &mut Tensor,
    z: &Tensor,
    width: usize,
    w: &Tensor,
    eps: f32,
) -> Result<()> {
    const OP: &str = "gated_rms_norm";
    let w = f32s_len(OP, "w", w, width)?;
    let z = f32s(OP, "z", z)?;
    let x = f32s_mut_len(OP, "x", x, z.len())?;
    rows_of(OP, "x", x.len(), width)?;
    kapitsa_kernels_cpu::gdn::gated_rms_norm(x, z, width, w, eps);
    Ok(())
}

/// Mamba2's grouped gated norm: `y = y * silu(z)`, RMSNorm per group, times `w`.
pub(crate) fn gated_group_rms_norm(
    y: &mut Tensor,
    z: &Tensor,
    d_inner: usize,
    n_groups: usize,
    w: &Tensor,
    eps: f32,
) -> Result<()> {
    const OP: &str = "gated_group_rms_norm";
    if n_groups == 0 || d_inner == 0 || !d_inner.is_multiple_of(n_groups) {
        return shape_err(
            OP,
            format!("d_inner {d_inner} does not split into {n_groups} groups"),
        );
    }
    let w = f32s_len(OP, "w", w, d_inner)?;
    let z = f32s(OP, "z", z)?;
    let y = f32s_mut_len(OP, "y", y, z.len())?;
    rows_of(OP, "y", y.len(), d_inner)?;
    kapitsa_kernels_cpu::mamba2::gated_group_rms_norm(y, z, d_inner, n_groups, w, eps);
    Ok(())
}

/// Index of the largest value of each row (first on ties).
pub(crate) fn argmax_rows(x: &Tensor, width: usize) -> Result<Vec<u32>> {
    const OP: &str = "argmax_rows";
    let x = f32s(OP, "x", x)?;
    rows_of(OP, "x", x.len(), width)?;
    if width > u32::MAX as usize {
        return shape_err(OP, format!("rows of {width} values do not fit u32 indices"));
    }
    Ok(x.chunks_exact(width)
        .map(|r| kops::argmax(r) as u32)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffers::{alloc, host_f32, prepare_batch};
    use kapitsa_backend::{BatchDesc, DType, SeqDesc};

    fn t(v: &[f32]) -> Tensor {
        let mut t = alloc(DType::F32, v.len()).unwrap();
        crate::buffers::write_f32(&mut t, 0, v).unwrap();
        t
    }

    fn batch(positions: &[u32]) -> Batch {
        let n = positions.len();
        prepare_batch(BatchDesc {
            tokens: vec![0; n],
            positions: positions.to_vec(),
            seqs: vec![SeqDesc {
                slot: 0,
                start: 0,
                len: n,
                pos0: positions[0] as usize,
                table_start: 0,
                table_len: 0,
            }],
            ..Default::default()
        })
        .unwrap()
    }

    /// RoPE is the NeoX rotation of pairs `(i, i + n_rot/2)` by `p * theta^(-2i/n_rot)`.
    #[test]
    fn rope_rotates_neox_pairs() {
        let (hd, n_rot, theta) = (6usize, 4usize, 10_000f32);
        let vals: Vec<f32> = (0..2 * 2 * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut x = t(&vals);
        let b = batch(&[5, 6]);
        rope(&mut x, 2, hd, RopeDesc { n_rot, theta }, &b).unwrap();
        let got = host_f32(&x).unwrap();
        for tok in 0..2 {
            let p = 5.0 + tok as f64;
            for h in 0..2 {
                let base = (tok * 2 + h) * hd;
                for i in 0..n_rot / 2 {
                    let ang = p * (theta as f64).powf(-2.0 * i as f64 / n_rot as f64);
                    let (x0, x1) = (vals[base + i] as f64, vals[base + i + n_rot / 2] as f64);
                    let want0 = x0 * ang.cos() - x1 * ang.sin();
                    let want1 = x0 * ang.sin() + x1 * ang.cos();
                    assert!((got[base + i] as f64 - want0).abs() < 1e-5);
                    assert!((got[base + i + n_rot / 2] as f64 - want1).abs() < 1e-5);
                }
                // Dims past n_rot pass through.
                for i in n_rot..hd {
                    assert_eq!(got[base + i], vals[base + i]);
                }
            }
        }
    }

    /// The gates follow the formulas of the model code.
    #[test]
    fn gdn_gates_and_softplus_follow_the_formulas() {
        let (bv, gv) = (vec![0.3, -1.2, 2.0, 0.5], vec![-0.4, 25.0, 1.5, -3.0]);
        let (dtb, an) = (vec![0.1, -0.2], vec![-0.5, -2.0]);
        let (mut beta, mut g) = (t(&bv), t(&gv));
        gdn_gates(&mut beta, &mut g, &t(&dtb), &t(&an)).unwrap();
        for i in 0..4 {
            let sb = 1.0 / (1.0 + (-bv[i] as f64).exp());
            assert!((host_f32(&beta).unwrap()[i] as f64 - sb).abs() < 1e-6);
            let a = gv[i] as f64 + dtb[i % 2] as f64;
            let sp = if a > 20.0 { a } else { a.exp().ln_1p() };
            let want = an[i % 2] as f64 * sp;
            assert!(
                (host_f32(&g).unwrap()[i] as f64 - want).abs() < 1e-5 * want.abs().max(1.0),
                "{i}"
            );
        }
        let mut dt = t(&gv);
        softplus_bias(&mut dt, &t(&dtb)).unwrap();
        assert_eq!(host_f32(&dt).unwrap()[1], 25.0 - 0.2);
        // Mismatched lengths are shape errors, not panics.
        let mut g3 = t(&[1.0, 2.0, 3.0]);
        assert!(matches!(
            gdn_gates(&mut beta, &mut g3, &t(&dtb), &t(&an)),
            Err(BackendError::Shape { .. })
        ));
    }

    #[test]
    fn split_cols_and_rows_ops() {
        let src = t(&[1., 2., 3., 4., 5., 6., 7., 8., 9., 10.]);
        let (mut a, mut b) = (alloc(DType::F32, 4).unwrap(), alloc(DType::F32, 6).unwrap());
        split_cols(&src, 2, &[2, 3], &mut [&mut a, &mut b]).unwrap();
        assert_eq!(host_f32(&a).unwrap(), &[1., 2., 6., 7.]);
        assert_eq!(host_f32(&b).unwrap(), &[3., 4., 5., 8., 9., 10.]);
        assert!(split_cols(&src, 2, &[2, 2], &mut [&mut a, &mut b]).is_err());
        let mut x = t(&[1., 2., 3., 4.]);
        add_bias(&mut x, &t(&[10., 20.])).unwrap();
        assert_eq!(host_f32(&x).unwrap(), &[11., 22., 13., 24.]);
        assert_eq!(
            argmax_rows(&t(&[1., 3., 3., 0., -1., -2.]), 3).unwrap(),
            vec![1, 0]
        );
        let mut y = t(&[1.0, -2.0]);
        mul_sigmoid(&mut y, &t(&[0.0, 100.0])).unwrap();
        assert_eq!(host_f32(&y).unwrap(), &[0.5, -2.0]);
    }
}
