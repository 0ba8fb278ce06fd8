//! Plain-loop definitions of the ops that block drafters (DFlash, DFlash2) add to the backend:
//! [`attention_spans`] (attention over dense K/V rows with one contiguous key span per query)
//! and [`dynamic_conv`] (DFlash2's grouped dynamic causal convolution inside a block).
//!
//! Each is a function on host slices. The [`crate::Backend`] trait's default methods run them
//! through a host round trip ([`crate::Backend::read_f32`] / [`crate::Backend::write_f32`]), so
//! every backend has the op; the CPU backend calls them on its tensors in place. A device
//! kernel written later is checked against these.
//!
//! Numerics: f32 throughout, in the order written below (scores, max, `exp(s - max)`, sum,
//! weighted sum of V divided by the sum; conv taps summed from tap 0 up, the static kernel
//! before the dynamic coefficient, as the PyPI `dflash` reference does).

use crate::{shape_err, AttnShape, Result};

/// Attention of `q` `[n_q, n_head * head_dim]` over the key/value rows of `k`, `v`
/// (`[n_keys, n_head_kv * head_dim]`, only the first `n_keys` rows are read): query row `i`
/// attends to key rows `spans[i].0 .. spans[i].1` (an empty span gives a zero output row).
/// Query head `h` reads KV head `h / (n_head / n_head_kv)` (grouped, as transformers'
/// `repeat_kv`). Output `out` `[n_q, n_head * head_dim]`.
pub fn attention_spans(
    shape: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    spans: &[(u32, u32)],
    out: &mut [f32],
) -> Result<()> {
    const OP: &str = "attention_spans";
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim: hd,
        scale,
    } = shape;
    if n_head == 0 || n_head_kv == 0 || hd == 0 || !n_head.is_multiple_of(n_head_kv) {
        return shape_err(
            OP,
            format!("{n_head} heads over {n_head_kv} KV heads of {hd}"),
        );
    }
    let (q_dim, kv_dim) = (n_head * hd, n_head_kv * hd);
    let n_q = spans.len();
    if q.len() != n_q * q_dim || out.len() != n_q * q_dim {
        return shape_err(
            OP,
            format!(
                "{n_q} spans but q has {} and out {} elements (rows of {q_dim})",
                q.len(),
                out.len()
            ),
        );
    }
    let n_keys = (k.len() / kv_dim).min(v.len() / kv_dim);
    if let Some(&(lo, hi)) = spans
        .iter()
        .find(|&&(lo, hi)| lo > hi || hi as usize > n_keys)
    {
        return shape_err(OP, format!("span {lo}..{hi} outside {n_keys} key rows"));
    }
    let group = n_head / n_head_kv;
    let mut scores = Vec::new();
    for (i, &(lo, hi)) in spans.iter().enumerate() {
        let (lo, hi) = (lo as usize, hi as usize);
        for h in 0..n_head {
            let qh = &q[i * q_dim + h * hd..i * q_dim + (h + 1) * hd];
            let kvh = h / group;
            let o = &mut out[i * q_dim + h * hd..i * q_dim + (h + 1) * hd];
            o.fill(0.0);
            if lo == hi {
                continue;
            }
            scores.clear();
            for j in lo..hi {
                let kj = &k[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
                let dot: f32 = qh.iter().zip(kj).map(|(a, b)| a * b).sum();
                scores.push(dot * scale);
            }
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            for (j, &p) in (lo..hi).zip(scores.iter()) {
                let vj = &v[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
                for (od, &vd) in o.iter_mut().zip(vj) {
                    *od += p * vd;
                }
            }
            for od in o.iter_mut() {
                *od /= sum;
            }
        }
    }
    Ok(())
}

/// Grouped dynamic causal convolution over blocks of `block_len` consecutive rows of `x`
/// `[n, width]` (the last block may be shorter): with `k = base.len() / width` taps and
/// `g = width / group` groups,
/// `out[i, c] = Σ_{t < k} (base[t, c] + dynamic[i, t * g + c / group]) * x[i - t, c]`,
/// where rows before the start of row `i`'s block count as zero. `base` is `[k, width]`,
/// `dynamic` `[n, k * g]` (the per-row coefficients, one per tap and channel group).
pub fn dynamic_conv(
    x: &[f32],
    width: usize,
    base: &[f32],
    dynamic: &[f32],
    group: usize,
    block_len: usize,
    out: &mut [f32],
) -> Result<()> {
    const OP: &str = "dynamic_conv";
    if width == 0 || group == 0 || !width.is_multiple_of(group) || block_len == 0 {
        return shape_err(
            OP,
            format!("width {width}, group {group}, block {block_len}"),
        );
    }
    if base.is_empty() || !base.len().is_multiple_of(width) || !x.len().is_multiple_of(width) {
        return shape_err(
            OP,
            format!(
                "base ({}) and x ({}) must be rows of {width}",
                base.len(),
                x.len()
            ),
        );
    }
    let (n, taps, groups) = (x.len() / width, base.len() / width, width / group);
    if dynamic.len() != n * taps * groups || out.len() != x.len() {
        return shape_err(
            OP,
            format!(
                "{n} rows: dynamic has {} elements (want {}), out {} (want {})",
                dynamic.len(),
                n * taps * groups,
                out.len(),
                x.len()
            ),
        );
    }
    for i in 0..n {
        let in_block = i % block_len;
        let d = &dynamic[i * taps * groups..(i + 1) * taps * groups];
        let o = &mut out[i * width..(i + 1) * width];
        o.fill(0.0);
        for t in 0..taps.min(in_block + 1) {
            let xr = &x[(i - t) * width..(i - t + 1) * width];
            let br = &base[t * width..(t + 1) * width];
            for c in 0..width {
                o[c] += br[c] * xr[c];
                o[c] += d[t * groups + c / group] * xr[c];
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n_head: usize, n_head_kv: usize, hd: usize) -> AttnShape {
        AttnShape {
            n_head,
            n_head_kv,
            head_dim: hd,
            scale: 1.0,
        }
    }

    #[test]
    fn one_key_returns_its_value_and_equal_scores_average() {
        // 2 query heads sharing 1 KV head of width 2; keys 0 and 1 are equal, so a span over
        // both averages their values; a span over key 2 alone returns its value.
        let k = [1.0, 0.0, 1.0, 0.0, 0.0, 3.0];
        let v = [2.0, 4.0, 6.0, 8.0, -1.0, 5.0];
        let q = [0.5, 0.5, 1.0, -1.0, 0.3, 0.2, 0.1, 0.0];
        let mut out = [9.0; 8];
        attention_spans(shape(2, 1, 2), &q, &k, &v, &[(0, 2), (2, 3)], &mut out).unwrap();
        assert_eq!(out, [4.0, 6.0, 4.0, 6.0, -1.0, 5.0, -1.0, 5.0]);
    }

    #[test]
    fn softmax_weights_follow_the_scores() {
        let k = [0.0, (2f32).ln()];
        let v = [1.0, 4.0];
        let mut out = [0.0];
        // scores 0 and ln 2: weights 1/3 and 2/3
        attention_spans(shape(1, 1, 1), &[1.0], &k, &v, &[(0, 2)], &mut out).unwrap();
        assert!((out[0] - 3.0).abs() < 1e-6, "{out:?}");
        let mut out = [7.0];
        attention_spans(shape(1, 1, 1), &[1.0], &k, &v, &[(1, 1)], &mut out).unwrap();
        assert_eq!(out, [0.0]);
        assert!(attention_spans(shape(1, 1, 1), &[1.0], &k, &v, &[(0, 3)], &mut out).is_err());
    }

    #[test]
    fn conv_is_causal_per_block() {
        // width 2, one group of 2, two taps, blocks of 2 rows.
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let base = [1.0, 1.0, 10.0, 100.0];
        let dynamic = [0.5, 0.0, 0.0, 1.0, 0.0, 0.0];
        let mut out = [0.0; 6];
        dynamic_conv(&x, 2, &base, &dynamic, 2, 2, &mut out).unwrap();
        // row 0: (1 + 0.5) * x0; row 1: 1 * x1 + (10 | 100 + 1) * x0; row 2 starts a block.
        assert_eq!(out, [1.5, 3.0, 3.0 + 11.0, 4.0 + 202.0, 5.0, 6.0]);
    }
}
