//! Plain-loop definitions of the ops that block drafters (DFlash, DFlash2) and the vision
//! tower add to the backend: [`attention_spans`] (attention over dense K/V rows with one
//! contiguous key span per query; the vision tower's per-image attention too),
//! [`dynamic_conv`] (DFlash2's grouped dynamic causal convolution inside a block),
//! [`layer_norm`], [`gelu`] and [`rope_table`] (rotary embedding from explicit cos/sin
//! tables: multimodal positions and the vision tower's 2-D positions).
//!
//! Each is a function on host slices. The [`crate::Backend`] trait's default methods run them
//! through a host round trip ([`crate::Backend::read_f32`] / [`crate::Backend::write_f32`]), so
//! every backend has the op; the CPU backend calls them on its tensors in place. A device
//! kernel written later is checked against these.
//!
//! Numerics: f32 throughout, in the order written below (scores as dot products in eight
//! interleaved partial sums (`dot`), max, `exp(s - max)`, sum,
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
                scores.push(dot(qh, kj) * scale);
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

/// `sum a[i] * b[i]` in eight interleaved partial sums (lane `i % 8`), added pairwise at the
/// end, then the tail: a fixed order the compiler can vectorise.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let s4 = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (s4[0] + s4[2]) + (s4[1] + s4[3]) + tail
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

/// LayerNorm of each `width`-wide row of `x` in place: `(x - mean) / sqrt(var + eps) * w + b`
/// (biased variance, as `torch.nn.LayerNorm`), `w`, `b` `[width]`. Mean and variance are
/// accumulated in f64.
pub fn layer_norm(x: &mut [f32], width: usize, w: &[f32], b: &[f32], eps: f32) -> Result<()> {
    if width == 0 || !x.len().is_multiple_of(width) || w.len() != width || b.len() != width {
        return shape_err(
            "layer_norm",
            format!(
                "x of {} in rows of {width}, weight {}, bias {}",
                x.len(),
                w.len(),
                b.len()
            ),
        );
    }
    for row in x.chunks_exact_mut(width) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
        let var = row
            .iter()
            .map(|&v| (v as f64 - mean) * (v as f64 - mean))
            .sum::<f64>()
            / width as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for ((v, &wi), &bi) in row.iter_mut().zip(w).zip(b) {
            *v = ((*v as f64 - mean) * inv) as f32 * wi + bi;
        }
    }
    Ok(())
}

/// GELU in place: with `tanh_approx`, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`
/// (transformers' `gelu_pytorch_tanh`); otherwise the exact `0.5 x (1 + erf(x / sqrt 2))`
/// (`torch.nn.GELU()`). Computed in f64, rounded once.
pub fn gelu(x: &mut [f32], tanh_approx: bool) {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    for v in x.iter_mut() {
        let a = *v as f64;
        let g = if tanh_approx {
            0.5 * a * (1.0 + (SQRT_2_OVER_PI * (a + 0.044715 * a * a * a)).tanh())
        } else {
            0.5 * a * (1.0 + libm::erf(a / std::f64::consts::SQRT_2))
        };
        *v = g as f32;
    }
}

/// Rotary embedding from tables, in place on `x` `[n_tokens, n_heads * head_dim]`: with
/// `half = cos.len() / n_tokens` (`cos`, `sin` are `[n_tokens, half]`, `2 * half <=
/// head_dim`), in every head dim `i < half` pairs with dim `i + half` (NeoX's `rotate_half`)
/// and the pair of token `t` turns by the angle whose cosine and sine are `cos[t, i]`,
/// `sin[t, i]`: `(a, b) -> (a cos - b sin, b cos + a sin)`. Dims from `2 * half` on pass
/// through.
pub fn rope_table(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
) -> Result<()> {
    let (_, half) = rope_table_shape(x.len(), n_heads, head_dim, cos.len(), sin.len())?;
    for (t, xr) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for head in xr.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c[i] - b * s[i];
                head[i + half] = b * c[i] + a * s[i];
            }
        }
    }
    Ok(())
}

/// The token count and table width `(n, half)` of a [`rope_table`] call on `x_len` values in
/// rows of `n_heads * head_dim` with tables of `cos_len` and `sin_len` values, or the shape
/// error (tables of whole rows, `2 * half <= head_dim`).
pub fn rope_table_shape(
    x_len: usize,
    n_heads: usize,
    head_dim: usize,
    cos_len: usize,
    sin_len: usize,
) -> Result<(usize, usize)> {
    let row = n_heads * head_dim;
    let n = x_len.checked_div(row).unwrap_or(0);
    let bad = n == 0
        || x_len != n * row
        || cos_len != sin_len
        || !cos_len.is_multiple_of(n)
        || 2 * (cos_len / n) > head_dim;
    if bad {
        return shape_err(
            "rope_table",
            format!(
                "x of {x_len} in rows of {n_heads} x {head_dim}, tables of {cos_len} and {sin_len}"
            ),
        );
    }
    Ok((n, cos_len / n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_centres_and_scales() {
        let mut x = [1.0, 2.0, 3.0, 4.0];
        layer_norm(&mut x, 4, &[1.0, 1.0, 2.0, 1.0], &[0.0, 0.5, 0.0, 0.0], 0.0).unwrap();
        // mean 2.5, var 1.25
        let s = 1.0 / 1.25f32.sqrt();
        let want = [-1.5 * s, -0.5 * s + 0.5, 1.0 * s, 1.5 * s];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{x:?}");
        }
        assert!(layer_norm(&mut x, 3, &[1.0; 3], &[0.0; 3], 0.0).is_err());
    }

    #[test]
    fn gelu_known_values() {
        let mut x = [0.0, 1.0, -1.0, 3.0];
        gelu(&mut x, false);
        let want = [0.0, 0.841_344_7, -0.158_655_26, 2.995_95];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{x:?}");
        }
        let mut y = [1.0];
        gelu(&mut y, true);
        assert!((y[0] - 0.841_192).abs() < 1e-5, "{y:?}");
    }

    #[test]
    fn rope_table_turns_pairs() {
        // one token, one head of 6 dims, tables of 2: dims (0,2) and (1,3) turn, 4 and 5 pass
        let mut x = [1.0, 2.0, 0.0, 0.0, 7.0, 8.0];
        let (c, s) = ([0.0, 1.0], [1.0, 0.0]);
        rope_table(&mut x, 1, 6, &c, &s).unwrap();
        assert_eq!(x, [0.0, 2.0, 1.0, 0.0, 7.0, 8.0]);
        assert!(rope_table(&mut x, 1, 6, &[0.0; 4], &[0.0; 4]).is_err());
    }

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
