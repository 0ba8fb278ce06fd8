//! The op suite's cases for attention (with `kv_write`) and the recurrent mixers (conv1d,
//! Gated DeltaNet, Mamba2): paged caches and state slots with random prior contents.

use super::*;

/// `kv_write` then `attention` over a paged cache of `dt` with random prior contents: random
/// shapes, then for f16 caches the decode shapes of the GPU's grouped split kernel (head size
/// 128 and 256, 8 and 16 query heads per KV head, contexts of several 256-position chunks).
pub(super) fn attention(s: &mut Suite<'_>, dt: DType) -> R<()> {
    for _ in 0..s.cases {
        let head_dim = match dt {
            DType::Q8_0 => s.rng.pick(&[32, 64, 128]),
            // (64, 128, 256: the GPU's tensor-core kernel for f16 caches)
            _ => s.rng.pick(&[4, 8, 12, 16, 24, 40, 64, 72, 128, 256]),
        };
        let n_head_kv = s.rng.range(1, 3);
        // query heads per KV head: 8 spans two of the GPU's 4-head blocks; 16, two of its
        // 8-head groups of the split kernel
        let n_head = n_head_kv * s.rng.pick(&[1, 2, 3, 8, 16]);
        let spec = BatchSpec {
            n_slots: 4,
            // (16 and more: the tiled kernels; 37: a partial second query tile)
            max_len: s.rng.pick(&[1, 4, 9, 20, 37]),
            // (past 256: several chunks of the GPU's split kernel)
            max_pos0: s.rng.pick(&[40, 40, 700]),
            block_size: 16,
            vocab: 1,
        };
        attention_case(s, dt, (n_head, n_head_kv, head_dim), &spec)?;
    }
    if dt == DType::F16 {
        for (n_head, n_head_kv, head_dim) in [(16, 2, 256), (16, 2, 128), (16, 1, 128), (6, 2, 128)]
        {
            let spec = BatchSpec {
                n_slots: 4,
                max_len: 2,
                max_pos0: 900,
                block_size: 16,
                vocab: 1,
            };
            attention_case(s, dt, (n_head, n_head_kv, head_dim), &spec)?;
        }
    }
    Ok(())
}

/// One case of [`attention`]: `(n_head, n_head_kv, head_dim)` over a random batch of `spec`.
fn attention_case(
    s: &mut Suite<'_>,
    dt: DType,
    (n_head, n_head_kv, head_dim): (usize, usize, usize),
    spec: &BatchSpec,
) -> R<()> {
    let (kv_name, at_name) = (format!("kv_write {dt:?}"), format!("attention {dt:?}"));
    let kv_dim = n_head_kv * head_dim;
    let (d, n_blocks) = rand_batch(&mut s.rng, spec);
    let b = s.batch(&d)?;
    let nt = d.n_tokens();
    let cache_len = n_blocks * 16 * kv_dim;
    let (kb, vb) = (
        rand_bytes(&mut s.rng, dt, cache_len),
        rand_bytes(&mut s.rng, dt, cache_len),
    );
    let mut kc = s.with_bytes(dt, cache_len, &kb)?;
    let mut vc = s.with_bytes(dt, cache_len, &vb)?;
    let new_rows = |rng: &mut Rng| match dt {
        DType::Q8_0 => q8_exact(rng, nt * kv_dim),
        _ => rng.vals(nt * kv_dim, 1.0),
    };
    let (kv, vv) = (new_rows(&mut s.rng), new_rows(&mut s.rng));
    let (k, v) = (s.up(&kv)?, s.up(&vv)?);
    s.both("kv_write", |be, i| {
        let cache = KvLayer {
            k: &mut kc[i],
            v: &mut vc[i],
            kv_dim,
        };
        be.kv_write(&k[i], &v[i], cache, &b[i])
    })?;
    let [ka, kb] = s.read_any(&kc)?;
    let [va, vb] = s.read_any(&vc)?;
    s.record(
        &kv_name,
        TOL_EXACT,
        rel_err(&ka, &kb).max(rel_err(&va, &vb)),
    );

    let q = s.rand(nt * n_head * head_dim, 1.0)?;
    let mut out = s.alloc(DType::F32, nt * n_head * head_dim)?;
    let shape = AttnShape {
        n_head,
        n_head_kv,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
    };
    s.both("attention", |be, i| {
        be.attention(shape, &q[i], &kc[i], &vc[i], &b[i], &mut out[i])
    })?;
    s.cmp(&at_name, s.tol.attention, &out)?;
    Ok(())
}

/// A batch of sequences over `n_slots` recurrent slots (no KV blocks).
fn state_batch(s: &mut Suite<'_>, n_slots: usize, max_len: usize) -> BatchDesc {
    let spec = BatchSpec {
        n_slots,
        max_len,
        max_pos0: 50,
        block_size: 0,
        vocab: 1,
    };
    rand_batch(&mut s.rng, &spec).0
}

pub(super) fn conv1d(s: &mut Suite<'_>) -> R<()> {
    const SLOTS: usize = 5;
    for _ in 0..s.cases {
        let c = s.rng.range(1, 80);
        let k = s.rng.range(1, 4);
        let silu = s.rng.coin();
        let d = state_batch(s, SLOTS, 9);
        let b = s.batch(&d)?;
        let nt = d.n_tokens();
        let x = s.rand(nt * c, 1.0)?;
        let w = s.rand(c * k, 0.7)?;
        let bias = if s.rng.coin() {
            Some(s.rand(c, 0.5)?)
        } else {
            None
        };
        let mut st = s.rand(SLOTS * (k - 1) * c, 1.0)?;
        let mut out = s.alloc(DType::F32, nt * c)?;
        s.both("conv1d_causal", |be, i| {
            be.conv1d_causal(
                &x[i],
                c,
                k,
                &w[i],
                bias.as_ref().map(|t| &t[i]),
                silu,
                &mut st[i],
                &b[i],
                &mut out[i],
            )
        })?;
        s.cmp_all("conv1d_causal", s.tol.scan, &[&out, &st])?;
    }
    Ok(())
}

/// Random conv weights and gate parameters of a Gated DeltaNet layer, on both backends.
struct GdnParams {
    k: usize,
    w: Two<Tensor>,
    dt_bias: Two<Tensor>,
    a_neg: Two<Tensor>,
}

impl GdnParams {
    /// Conv weights `[channels, k]`, dt_bias and a_neg `[n_v_heads]`.
    fn new(s: &mut Suite<'_>, channels: usize, k: usize, n_v_heads: usize) -> R<GdnParams> {
        let w = s.rand(channels * k, 0.7)?;
        let dt_bias = s.rand(n_v_heads, 0.5)?;
        let a_neg: Vec<f32> = (0..n_v_heads).map(|_| -(0.1 + s.rng.unit())).collect();
        let a_neg = s.up(&a_neg)?;
        Ok(GdnParams {
            k,
            w,
            dt_bias,
            a_neg,
        })
    }

    /// Backend `i`'s view (q/k L2 eps 1e-6).
    fn conv(&self, i: usize) -> GdnConv<'_> {
        GdnConv {
            k: self.k,
            w: &self.w[i],
            dt_bias: &self.dt_bias[i],
            a_neg: &self.a_neg[i],
            l2_eps: 1e-6,
        }
    }
}

/// `gdn_preamble` (the fused conv + split + L2 norms + gates of a device backend against the
/// reference's composition of those ops).
pub(super) fn gdn_preamble(s: &mut Suite<'_>) -> R<()> {
    const SLOTS: usize = 4;
    for _ in 0..s.cases {
        let n_k_heads = s.rng.range(1, 3);
        let n_v_heads = n_k_heads * s.rng.range(1, 3);
        let (dk, dv) = (s.rng.range(2, 70), s.rng.range(2, 140));
        let shape = GdnShape {
            n_k_heads,
            n_v_heads,
            dk,
            dv,
            order: HeadOrder::Grouped,
        };
        let k = s.rng.range(1, 5);
        let c = 2 * n_k_heads * dk + n_v_heads * dv;
        let max_len = s.rng.pick(&[1, 3, 9]);
        let d = state_batch(s, SLOTS, max_len);
        let b = s.batch(&d)?;
        let nt = d.n_tokens();
        let qkv = s.rand(nt * c, 1.0)?;
        let params = GdnParams::new(s, c, k, n_v_heads)?;
        // projections past the softplus threshold of 20 included
        let mut gv = s.rng.vals(nt * n_v_heads, 3.0);
        if let Some(x) = gv.first_mut() {
            *x = 25.0;
        }
        let mut g = s.up(&gv)?;
        let mut beta = s.rand(nt * n_v_heads, 3.0)?;
        let mut st = s.rand(SLOTS * k.saturating_sub(1) * c, 1.0)?;
        let mut q = s.alloc(DType::F32, nt * n_k_heads * dk)?;
        let mut kk = s.alloc(DType::F32, nt * n_k_heads * dk)?;
        let mut v = s.alloc(DType::F32, nt * n_v_heads * dv)?;
        s.both("gdn_preamble", |be, i| {
            let conv = params.conv(i);
            be.gdn_preamble(
                shape,
                &conv,
                &qkv[i],
                &mut st[i],
                &b[i],
                &mut beta[i],
                &mut g[i],
                [&mut q[i], &mut kk[i], &mut v[i]],
            )
        })?;
        s.cmp_all("gdn_preamble", s.tol.scan, &[&q, &kk, &v, &st, &beta, &g])?;
    }
    Ok(())
}

/// `gdn_mixer` (a device backend's one-launch preamble + recurrence + gated norm against the
/// reference's composition of those ops): the production heads (16 k heads of 128 shared by
/// pairs of value heads, tiled) first, then odd widths, orders and head ratios; sequences of
/// up to 17 tokens (the token-sequential form).
pub(super) fn gdn_mixer(s: &mut Suite<'_>) -> R<()> {
    const SLOTS: usize = 4;
    for case in 0..s.cases {
        let (n_k_heads, ratio, dk, dv, order) = match case {
            0 => (4, 2, 128, 128, HeadOrder::Tiled),
            _ => (
                s.rng.range(1, 3),
                s.rng.range(1, 3),
                s.rng.range(2, 130),
                s.rng.range(2, 130),
                match s.rng.coin() {
                    true => HeadOrder::Grouped,
                    false => HeadOrder::Tiled,
                },
            ),
        };
        let n_v_heads = n_k_heads * ratio;
        let shape = GdnShape {
            n_k_heads,
            n_v_heads,
            dk,
            dv,
            order,
        };
        let k = s.rng.range(1, 4);
        let (kd, vd) = (n_k_heads * dk, n_v_heads * dv);
        let c = 2 * kd + vd;
        let max_len = s.rng.pick(&[1, 1, 3, 17]);
        let d = state_batch(s, SLOTS, max_len);
        let b = s.batch(&d)?;
        let nt = d.n_tokens();
        let qkv = s.rand(nt * c, 1.0)?;
        let z = s.rand(nt * vd, 1.5)?;
        let params = GdnParams::new(s, c, k, n_v_heads)?;
        let norm: Vec<f32> = (0..dv).map(|_| 0.5 + s.rng.unit()).collect();
        let norm = s.up(&norm)?;
        let mut g = s.rand(nt * n_v_heads, 3.0)?;
        let mut beta = s.rand(nt * n_v_heads, 3.0)?;
        let mut cst = s.rand(SLOTS * (k - 1) * c, 1.0)?;
        let mut st = s.rand(SLOTS * shape.state_len(), 0.3)?;
        let mut out = s.alloc(DType::F32, nt * vd)?;
        s.both("gdn_mixer", |be, i| {
            let conv = params.conv(i);
            let io = GdnMixerIo {
                qkv: &qkv[i],
                z: &z[i],
                beta: &mut beta[i],
                g: &mut g[i],
                conv_state: &mut cst[i],
                state: &mut st[i],
                out: &mut out[i],
            };
            be.gdn_mixer(shape, &conv, (&norm[i], 1e-6), io, &b[i])
        })?;
        s.cmp_all("gdn_mixer", s.tol.scan, &[&out, &cst, &st])?;
    }
    Ok(())
}

/// Unit-norm rows of `w` values (times `scale`), as the model's L2 norm leaves q and k.
fn unit_rows(rng: &mut Rng, n: usize, w: usize, scale: f32) -> Vec<f32> {
    let mut v = rng.vals(n * w, 1.0);
    for r in v.chunks_exact_mut(w) {
        let norm = r.iter().map(|x| x * x).sum::<f32>().sqrt();
        r.iter_mut().for_each(|x| *x *= scale / norm);
    }
    v
}

/// The Gated DeltaNet recurrence: short sequences (the token-sequential kernels), then
/// batches with a sequence of 64 to 200 tokens and heads up to 128 wide (a device backend's
/// chunked form, reported as `gdn chunked`).
pub(super) fn gdn(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let (dk, dv) = (s.rng.range(2, 40), s.rng.range(2, 70));
        let max_len = s.rng.pick(&[1, 3, 12]);
        gdn_case(s, "gdn", [dk, dv], max_len, None)?;
    }
    for i in 0..s.cases {
        // the production head width, then odd ones
        let (dk, dv) = match i {
            0 => (128, 128),
            _ => (s.rng.range(2, 128), s.rng.range(2, 128)),
        };
        let long = s.rng.range(64, 200);
        gdn_case(s, "gdn chunked", [dk, dv], 40, Some(long))?;
    }
    Ok(())
}

/// One `gdn` case: random sequences of up to `max_len` tokens, the first one `long` tokens
/// when given.
fn gdn_case(
    s: &mut Suite<'_>,
    name: &str,
    [dk, dv]: [usize; 2],
    max_len: usize,
    long: Option<usize>,
) -> R<()> {
    const SLOTS: usize = 4;
    let n_k_heads = s.rng.range(1, 2);
    let n_v_heads = n_k_heads * s.rng.range(1, 3);
    let order = if s.rng.coin() {
        HeadOrder::Grouped
    } else {
        HeadOrder::Tiled
    };
    let shape = GdnShape {
        n_k_heads,
        n_v_heads,
        dk,
        dv,
        order,
    };
    let mut d = state_batch(s, SLOTS, max_len);
    if let Some(len) = long {
        lengthen_first(&mut d, len);
    }
    let b = s.batch(&d)?;
    let nt = d.n_tokens();
    let qv = unit_rows(&mut s.rng, nt * n_k_heads, dk, 1.0 / (dk as f32).sqrt());
    let kv = unit_rows(&mut s.rng, nt * n_k_heads, dk, 1.0);
    let (q, k) = (s.up(&qv)?, s.up(&kv)?);
    let v = s.rand(nt * n_v_heads * dv, 1.0)?;
    // log decays from -0.001 to -12 (mostly weak; a random model's A reaches 16, and summed
    // over a chunk such decays lose precision in f32), betas up to 1
    let g: Vec<f32> = (0..nt * n_v_heads)
        .map(|_| -(0.001 + 12.0 * s.rng.unit().powi(3)))
        .collect();
    let beta: Vec<f32> = (0..nt * n_v_heads)
        .map(|_| 0.05 + 0.95 * s.rng.unit())
        .collect();
    let (g, beta) = (s.up(&g)?, s.up(&beta)?);
    let mut st = s.rand(SLOTS * shape.state_len(), 0.3)?;
    let mut out = s.alloc(DType::F32, nt * n_v_heads * dv)?;
    s.both(name, |be, i| {
        be.gdn(
            shape,
            &q[i],
            &k[i],
            &v[i],
            &g[i],
            &beta[i],
            &mut st[i],
            &b[i],
            &mut out[i],
        )
    })?;
    s.cmp_all(name, s.tol.scan, &[&out, &st])
}

/// Make the first sequence of the state batch `d` (no block tables) `len` tokens long,
/// shifting the others; the logit rows become each sequence's last token.
fn lengthen_first(d: &mut BatchDesc, len: usize) {
    let Some(first) = d.seqs.first().copied() else {
        return;
    };
    let extra = len.saturating_sub(first.len);
    let tok = d.tokens[first.start];
    d.tokens
        .splice(first.start..first.start, std::iter::repeat_n(tok, extra));
    let p0 = first.pos0;
    d.positions.splice(
        first.start..first.start + first.len,
        (0..first.len + extra).map(|j| (p0 + j) as u32),
    );
    d.seqs[0].len += extra;
    for sq in d.seqs.iter_mut().skip(1) {
        sq.start += extra;
    }
    d.logit_rows = d
        .seqs
        .iter()
        .map(|q| (q.start + q.len - 1) as u32)
        .collect();
}

/// `mamba2_preamble` (the fused split + softplus + conv of a device backend against the
/// reference's composition of those ops).
pub(super) fn mamba2_preamble(s: &mut Suite<'_>) -> R<()> {
    const SLOTS: usize = 4;
    for _ in 0..s.cases {
        let n_groups = s.rng.range(1, 3);
        let shape = Mamba2Shape {
            n_heads: n_groups * s.rng.range(1, 4),
            head_dim: s.rng.range(1, 40),
            d_state: s.rng.range(1, 40),
            n_groups,
        };
        let (di, nh) = (shape.d_inner(), shape.n_heads);
        let gn = n_groups * shape.d_state;
        let cd = di + 2 * gn;
        let k = s.rng.range(1, 5);
        let max_len = s.rng.pick(&[1, 3, 9]);
        let d = state_batch(s, SLOTS, max_len);
        let b = s.batch(&d)?;
        let nt = d.n_tokens();
        let mut pv = s.rng.vals(nt * (di + cd + nh), 1.0);
        // a step size past the softplus threshold of 20
        if let Some(x) = pv.get_mut(di + cd) {
            *x = 25.0;
        }
        let proj = s.up(&pv)?;
        let w = s.rand(cd * k, 0.7)?;
        let bias = if s.rng.coin() {
            Some(s.rand(cd, 0.5)?)
        } else {
            None
        };
        let dt_bias = s.rand(nh, 0.5)?;
        let mut st = s.rand(SLOTS * (k - 1) * cd, 1.0)?;
        let mut z = s.alloc(DType::F32, nt * di)?;
        let mut x = s.alloc(DType::F32, nt * di)?;
        let mut bm = s.alloc(DType::F32, nt * gn)?;
        let mut cm = s.alloc(DType::F32, nt * gn)?;
        let mut dt = s.alloc(DType::F32, nt * nh)?;
        s.both("mamba2_preamble", |be, i| {
            let conv = Mamba2Conv {
                k,
                w: &w[i],
                bias: bias.as_ref().map(|t| &t[i]),
                dt_bias: &dt_bias[i],
            };
            be.mamba2_preamble(
                shape,
                &conv,
                &proj[i],
                &mut st[i],
                &b[i],
                [&mut z[i], &mut x[i], &mut bm[i], &mut cm[i], &mut dt[i]],
            )
        })?;
        s.cmp_all("mamba2_preamble", s.tol.scan, &[&z, &x, &bm, &cm, &dt, &st])?;
    }
    Ok(())
}

/// The Mamba2 scan: short and 80-token sequences (the CPU's chunked form from 64 tokens),
/// then batches with a sequence of 64 to 200 tokens at up to the production head sizes
/// (reported as `mamba2 chunked`: a device backend's chunked form where it takes them).
pub(super) fn mamba2(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let n_groups = s.rng.range(1, 2);
        let shape = Mamba2Shape {
            n_heads: n_groups * s.rng.range(1, 3),
            head_dim: s.rng.range(1, 20),
            d_state: s.rng.range(1, 40),
            n_groups,
        };
        let max_len = s.rng.pick(&[1, 5, 12, 80]);
        mamba2_case(s, "mamba2", shape, max_len, None)?;
    }
    for i in 0..s.cases {
        let n_groups = s.rng.range(1, 2);
        // Nemotron 3's head (64 x 128), then odd sizes
        let (head_dim, d_state) = match i {
            0 => (64, 128),
            _ => (s.rng.range(1, 70), s.rng.range(1, 128)),
        };
        let shape = Mamba2Shape {
            n_heads: n_groups * s.rng.range(1, 2),
            head_dim,
            d_state,
            n_groups,
        };
        let long = s.rng.range(64, 200);
        mamba2_case(s, "mamba2 chunked", shape, 40, Some(long))?;
    }
    Ok(())
}

/// One `mamba2` case: random sequences of up to `max_len` tokens, the first one `long` tokens
/// when given.
fn mamba2_case(
    s: &mut Suite<'_>,
    name: &str,
    shape: Mamba2Shape,
    max_len: usize,
    long: Option<usize>,
) -> R<()> {
    const SLOTS: usize = 4;
    let (n_heads, head_dim, d_state, n_groups) =
        (shape.n_heads, shape.head_dim, shape.d_state, shape.n_groups);
    let mut d = state_batch(s, SLOTS, max_len);
    if let Some(len) = long {
        lengthen_first(&mut d, len);
    }
    let b = s.batch(&d)?;
    let nt = d.n_tokens();
    let di = n_heads * head_dim;
    let gn = n_groups * d_state;
    let x = s.rand(nt * di, 1.0)?;
    // step sizes after softplus (0.13 to 2.1) and A from -0.37 to -2.7: per-token log decays
    // down to about -6, summed over a chunk to hundreds (where an f32 sum loses digits)
    let dt: Vec<f32> = (0..nt * n_heads)
        .map(|_| (s.rng.val() * 2.0).exp().ln_1p())
        .collect();
    let a: Vec<f32> = (0..n_heads).map(|_| -(s.rng.val().exp())).collect();
    let (dt, a) = (s.up(&dt)?, s.up(&a)?);
    let bm = s.rand(nt * gn, 1.0)?;
    let cm = s.rand(nt * gn, 1.0)?;
    let dd = s.rand(n_heads, 1.0)?;
    let mut st = s.rand(SLOTS * shape.state_len(), 0.3)?;
    let mut y = s.alloc(DType::F32, nt * di)?;
    s.both(name, |be, i| {
        be.mamba2(
            shape, &x[i], &dt[i], &a[i], &bm[i], &cm[i], &dd[i], &mut st[i], &b[i], &mut y[i],
        )
    })?;
    s.cmp_all(name, s.tol.scan, &[&y, &st])
}

/// The vision tower's ops: `layer_norm`, `gelu` (both forms), `rope_table` and the
/// non-causal per-image `attention_spans` (full spans over each image's rows).
pub(super) fn vision(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let n = s.rng.range(1, 40);
        let width = s.rng.range(1, 300);
        let w = s.rand(width, 1.5)?;
        let b = s.rand(width, 0.5)?;
        let mut x = s.rand(n * width, 4.0)?;
        s.both("layer_norm", |be, i| {
            be.layer_norm(&mut x[i], width, &w[i], &b[i], 1e-6)
        })?;
        s.cmp("layer_norm", s.tol.f32, &x)?;
        for tanh in [false, true] {
            let mut g = s.rand(n * width, 6.0)?;
            let name = if tanh { "gelu tanh" } else { "gelu" };
            s.both(name, |be, i| be.gelu(&mut g[i], tanh))?;
            s.cmp(name, s.tol.f32, &g)?;
        }
        // a rotary table over all or part of each head
        let (heads, head_dim) = (s.rng.range(1, 5), 2 * s.rng.range(1, 40));
        let half = s.rng.range(1, head_dim / 2);
        let angles: Vec<f32> = s.rng.vals(n * half, 50.0);
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let (cos, sin) = (s.up(&cos)?, s.up(&sin)?);
        let mut q = s.rand(n * heads * head_dim, 2.0)?;
        s.both("rope_table", |be, i| {
            be.rope_table(&mut q[i], heads, head_dim, &cos[i], &sin[i])
        })?;
        s.cmp("rope_table", s.tol.f32, &q)?;
        // attention within images: every row of an image sees all of that image's rows
        let shape = AttnShape {
            n_head: heads,
            n_head_kv: heads,
            head_dim,
            scale: (head_dim as f32).powf(-0.5),
        };
        let mut spans = Vec::with_capacity(n);
        let mut at = 0;
        while at < n {
            let len = s.rng.range(1, n - at);
            spans.extend((0..len).map(|_| (at as u32, (at + len) as u32)));
            at += len;
        }
        let dim = heads * head_dim;
        let (k, v) = (s.rand(n * dim, 2.0)?, s.rand(n * dim, 1.0)?);
        let mut out = s.alloc(DType::F32, n * dim)?;
        s.both("attention_spans", |be, i| {
            be.attention_spans(shape, &q[i], &k[i], &v[i], &spans, &mut out[i])
        })?;
        s.cmp("attention_spans", s.tol.attention, &out)?;
    }
    Ok(())
}
