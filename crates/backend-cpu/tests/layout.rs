//! Addressing checks the op suite cannot make (its reference shares this crate's addressing
//! code): KV rows land where the block tables say, attention reads them back through the
//! tables as a hand-written softmax attention does, every per-sequence op gives a sequence
//! the same bits batched as alone (its rows, its state slot), and the embedding gathers the
//! token's dequantised row.

use kapitsa_backend::{
    AttnShape, Backend, BatchDesc, DType, GdnShape, HeadOrder, HostBytes, HostWeight, KvLayer,
    Mamba2Shape, SeqDesc, Tensor,
};
use kapitsa_backend_cpu::testing::quantize_weight;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_base::pool::RayonPool;
use kapitsa_base::GgmlType;

fn backend() -> CpuBackend {
    CpuBackend::new(Box::new(RayonPool::new(2).expect("pool")))
}

/// Deterministic nonzero test values.
fn vals(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 + seed) * 0.613).sin() * 0.9 + 0.05)
        .collect()
}

fn read(be: &CpuBackend, t: &Tensor) -> Vec<f32> {
    let mut v = vec![0f32; t.len()];
    be.read_f32(t, 0, &mut v).unwrap();
    v
}

/// Two sequences: slot 2 at positions 5..9 with blocks [3, 0], slot 0 at positions 0..3 with
/// block [2] (block size 4, blocks 1 and 4 unused).
fn two_seqs() -> BatchDesc {
    BatchDesc {
        tokens: vec![1, 2, 3, 4, 5, 6, 7],
        positions: vec![5, 6, 7, 8, 0, 1, 2],
        seqs: vec![
            SeqDesc {
                slot: 2,
                start: 0,
                len: 4,
                pos0: 5,
                table_start: 0,
                table_len: 3,
            },
            SeqDesc {
                slot: 0,
                start: 4,
                len: 3,
                pos0: 0,
                table_start: 3,
                table_len: 1,
            },
        ],
        block_tables: vec![3, 0, 4, 2],
        block_size: 4,
        logit_rows: vec![3, 6],
    }
}

/// Sequence `i` of `d` alone: its tokens, its slot and table, rows `0..len`.
fn alone(d: &BatchDesc, i: usize) -> BatchDesc {
    let s = d.seqs[i];
    let r = s.start..s.start + s.len;
    BatchDesc {
        tokens: d.tokens[r.clone()].to_vec(),
        positions: d.positions[r].to_vec(),
        seqs: vec![SeqDesc {
            start: 0,
            table_start: 0,
            ..s
        }],
        block_tables: d.table(i).to_vec(),
        block_size: d.block_size,
        logit_rows: vec![],
    }
}

#[test]
fn kv_rows_land_in_their_table_blocks() {
    let be = backend();
    let d = two_seqs();
    let batch = be.prepare_batch(d.clone()).unwrap();
    let (kv_dim, bs, n_blocks) = (3, 4, 5);
    let mut kc = be.alloc(DType::F32, n_blocks * bs * kv_dim).unwrap();
    let mut vc = be.alloc(DType::F32, n_blocks * bs * kv_dim).unwrap();
    let (k, v) = (vals(7 * kv_dim, 1.0), vals(7 * kv_dim, 2.0));
    let (kt, vt) = (be.upload_f32(&k).unwrap(), be.upload_f32(&v).unwrap());
    let cache = KvLayer {
        k: &mut kc,
        v: &mut vc,
        kv_dim,
    };
    be.kv_write(&kt, &vt, cache, &batch).unwrap();
    let (gk, gv) = (read(&be, &kc), read(&be, &vc));
    let mut want_k = vec![0f32; gk.len()];
    let mut want_v = vec![0f32; gv.len()];
    for (i, s) in d.seqs.iter().enumerate() {
        for j in 0..s.len {
            let p = s.pos0 + j;
            let row = d.table(i)[p / bs] as usize * bs + p % bs;
            let t = s.start + j;
            want_k[row * kv_dim..(row + 1) * kv_dim].copy_from_slice(&k[t * kv_dim..][..kv_dim]);
            want_v[row * kv_dim..(row + 1) * kv_dim].copy_from_slice(&v[t * kv_dim..][..kv_dim]);
        }
    }
    assert_eq!(gk, want_k);
    assert_eq!(gv, want_v);

    // F16 and Q8_0 caches hold the converted rows at the same places.
    for dt in [DType::F16, DType::Q8_0] {
        let kv_dim = 32;
        let mut kc = be.alloc(dt, n_blocks * bs * kv_dim).unwrap();
        let mut vc = be.alloc(dt, n_blocks * bs * kv_dim).unwrap();
        let k = vals(7 * kv_dim, 3.0);
        let kt = be.upload_f32(&k).unwrap();
        let cache = KvLayer {
            k: &mut kc,
            v: &mut vc,
            kv_dim,
        };
        be.kv_write(&kt, &kt, cache, &batch).unwrap();
        let bytes = be.read_bytes(&kc, 0, kc.len()).unwrap();
        let s = d.seqs[0];
        let row = d.table(0)[(s.pos0 + 3) / bs] as usize * bs + (s.pos0 + 3) % bs;
        let src = &k[3 * kv_dim..4 * kv_dim];
        let got: Vec<f32> = match dt {
            DType::F16 => bytes[row * kv_dim * 2..(row + 1) * kv_dim * 2]
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => {
                let b = &bytes[row * 34..(row + 1) * 34];
                let dd = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                b[2..].iter().map(|&q| f32::from(q as i8) * dd).collect()
            }
        };
        let step = src.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
        for (g, w) in got.iter().zip(src) {
            assert!((g - w).abs() <= 0.6 * step, "{dt:?}: {g} vs {w}");
        }
    }
}

/// Attention of every token over positions `0..=p` of its sequence, f64 softmax, GQA.
#[test]
fn attention_reads_through_the_tables() {
    let be = backend();
    let d = two_seqs();
    let batch = be.prepare_batch(d.clone()).unwrap();
    let (n_head, n_head_kv, hd, bs) = (4, 2, 8, 4);
    let kv_dim = n_head_kv * hd;
    let n = 5 * bs * kv_dim;
    let (kcv, vcv) = (vals(n, 4.0), vals(n, 5.0));
    let (kc, vc) = (be.upload_f32(&kcv).unwrap(), be.upload_f32(&vcv).unwrap());
    let q = vals(7 * n_head * hd, 6.0);
    let qt = be.upload_f32(&q).unwrap();
    let mut out = be.alloc(DType::F32, q.len()).unwrap();
    let scale = 0.3;
    let shape = AttnShape {
        n_head,
        n_head_kv,
        head_dim: hd,
        scale,
    };
    be.attention(shape, &qt, &kc, &vc, &batch, &mut out)
        .unwrap();
    let got = read(&be, &out);
    for (i, s) in d.seqs.iter().enumerate() {
        let row = |p: usize| d.table(i)[p / bs] as usize * bs + p % bs;
        for j in 0..s.len {
            let (t, p) = (s.start + j, s.pos0 + j);
            for h in 0..n_head {
                let kvh = h / (n_head / n_head_kv);
                let qh = &q[(t * n_head + h) * hd..][..hd];
                let scores: Vec<f64> = (0..=p)
                    .map(|c| {
                        let kr = &kcv[row(c) * kv_dim + kvh * hd..][..hd];
                        qh.iter()
                            .zip(kr)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for dd in 0..hd {
                    let want: f64 = (0..=p)
                        .map(|c| e[c] / sum * vcv[row(c) * kv_dim + kvh * hd + dd] as f64)
                        .sum();
                    let g = got[(t * n_head + h) * hd + dd] as f64;
                    assert!(
                        (g - want).abs() < 1e-5,
                        "token {t} head {h} dim {dd}: {g} vs {want}"
                    );
                }
            }
        }
    }
}

/// Each sequence's rows and state slot are bitwise what the sequence alone gives, for the
/// per-sequence ops (attention, conv1d, Gated DeltaNet, Mamba2).
#[test]
fn sequences_give_the_same_bits_batched_and_alone() {
    let be = backend();
    let d = two_seqs();
    let n = d.n_tokens();
    let n_slots = 3;
    // Each case: per-token input width, state length per slot, and the op on
    // (batch, token inputs, state) writing an output of `out_w` per token.
    type Run<'a> =
        Box<dyn Fn(&CpuBackend, &kapitsa_backend::Batch, &[f32], &mut Tensor, &mut Tensor) + 'a>;
    let (c, k) = (5, 4);
    let conv_w = vals(c * k, 7.0);
    let gs = GdnShape {
        n_k_heads: 1,
        n_v_heads: 2,
        dk: 3,
        dv: 4,
        order: HeadOrder::Tiled,
    };
    let ms = Mamba2Shape {
        n_heads: 2,
        head_dim: 3,
        d_state: 5,
        n_groups: 1,
    };
    let (kvd, hd) = (8, 8);
    let kv_cache = (vals(5 * 4 * kvd, 8.0), vals(5 * 4 * kvd, 9.0));
    let cases: Vec<(&str, usize, usize, usize, Run<'_>)> = vec![
        (
            "conv1d",
            c,
            (k - 1) * c,
            c,
            Box::new(|be, b, x, st, out| {
                let x = be.upload_f32(x).unwrap();
                let w = be.upload_f32(&conv_w).unwrap();
                be.conv1d_causal(&x, c, k, &w, None, true, st, b, out)
                    .unwrap();
            }),
        ),
        (
            "gdn",
            // q, k (3 each), v (8), g, beta (2 each)
            18,
            gs.state_len(),
            8,
            Box::new(|be, b, x, st, out| {
                let nt = x.len() / 18;
                let col = |a: usize, w: usize| -> Tensor {
                    let v: Vec<f32> = (0..nt)
                        .flat_map(|t| x[t * 18 + a..t * 18 + a + w].to_vec())
                        .collect();
                    be.upload_f32(&v).unwrap()
                };
                let g: Vec<f32> = read(be, &col(14, 2)).iter().map(|v| -v.abs()).collect();
                let beta: Vec<f32> = read(be, &col(16, 2)).iter().map(|v| v.abs()).collect();
                let (g, beta) = (be.upload_f32(&g).unwrap(), be.upload_f32(&beta).unwrap());
                be.gdn(
                    gs,
                    &col(0, 3),
                    &col(3, 3),
                    &col(6, 8),
                    &g,
                    &beta,
                    st,
                    b,
                    out,
                )
                .unwrap();
            }),
        ),
        (
            "mamba2",
            // x (6), dt (2), B, C (5 each)
            18,
            ms.state_len(),
            6,
            Box::new(|be, b, x, st, out| {
                let nt = x.len() / 18;
                let col = |a: usize, w: usize, f: fn(f32) -> f32| -> Tensor {
                    let v: Vec<f32> = (0..nt)
                        .flat_map(|t| x[t * 18 + a..t * 18 + a + w].iter().map(|&v| f(v)))
                        .collect();
                    be.upload_f32(&v).unwrap()
                };
                let a = be.upload_f32(&[-0.5, -1.5]).unwrap();
                let dd = be.upload_f32(&[0.3, -0.2]).unwrap();
                be.mamba2(
                    ms,
                    &col(0, 6, |v| v),
                    &col(6, 2, f32::abs),
                    &a,
                    &col(8, 5, |v| v),
                    &col(13, 5, |v| v),
                    &dd,
                    st,
                    b,
                    out,
                )
                .unwrap();
            }),
        ),
        (
            "attention",
            // q: 2 heads of 8 (one KV head); the state is unused (the cache is fixed).
            16,
            1,
            16,
            Box::new(|be, b, x, _st, out| {
                let q = be.upload_f32(x).unwrap();
                let kc = be.upload_f32(&kv_cache.0).unwrap();
                let vc = be.upload_f32(&kv_cache.1).unwrap();
                let shape = AttnShape {
                    n_head: 2,
                    n_head_kv: 1,
                    head_dim: hd,
                    scale: 0.35,
                };
                be.attention(shape, &q, &kc, &vc, b, out).unwrap();
            }),
        ),
    ];
    for (name, in_w, st_len, out_w, run) in cases {
        let x = vals(n * in_w, 10.0);
        let st0 = vals(n_slots * st_len, 11.0);
        let batch = be.prepare_batch(d.clone()).unwrap();
        let mut st = be.upload_f32(&st0).unwrap();
        let mut out = be.alloc(DType::F32, n * out_w).unwrap();
        run(&be, &batch, &x, &mut st, &mut out);
        let (all_out, all_st) = (read(&be, &out), read(&be, &st));
        for (i, s) in d.seqs.iter().enumerate() {
            let one = be.prepare_batch(alone(&d, i)).unwrap();
            let mut st1 = be.upload_f32(&st0).unwrap();
            let mut out1 = be.alloc(DType::F32, s.len * out_w).unwrap();
            let x1 = &x[s.start * in_w..(s.start + s.len) * in_w];
            run(&be, &one, x1, &mut st1, &mut out1);
            let rows = &all_out[s.start * out_w..(s.start + s.len) * out_w];
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same(rows, &read(&be, &out1)),
                "{name}: sequence {i} rows differ"
            );
            let slot = s.slot * st_len..(s.slot + 1) * st_len;
            assert!(
                same(&all_st[slot.clone()], &read(&be, &st1)[slot]),
                "{name}: sequence {i} state differs"
            );
            // Other slots untouched by the sequence alone.
            let st1 = read(&be, &st1);
            for other in (0..n_slots).filter(|&o| o != s.slot) {
                let r = other * st_len..(other + 1) * st_len;
                assert_eq!(st1[r.clone()], st0[r], "{name}: slot {other} touched");
            }
        }
    }
}

#[test]
fn embed_gathers_dequantized_rows() {
    let be = backend();
    for ty in [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::BF16] {
        let (vocab, n_in) = (9, 256);
        let v = vals(vocab * n_in, 12.0);
        let bytes = quantize_weight(ty, &v).unwrap();
        let w = be
            .upload_weight(&HostWeight {
                name: "tok_embd".into(),
                dtype: ty,
                shape: vec![vocab, n_in],
                bytes: HostBytes::from_vec(bytes.clone()),
            })
            .unwrap();
        let d = two_seqs();
        let batch = be.prepare_batch(d.clone()).unwrap();
        let mut out = be.alloc(DType::F32, d.n_tokens() * n_in).unwrap();
        be.embed(&w, &batch, &mut out).unwrap();
        let got = read(&be, &out);
        let rb = ty.row_bytes(n_in).unwrap();
        for (i, &t) in d.tokens.iter().enumerate() {
            let mut want = vec![0f32; n_in];
            let t = t as usize;
            kapitsa_kernels_cpu::dequantize_row(ty, &bytes[t * rb..(t + 1) * rb], &mut want)
                .unwrap();
            assert_eq!(got[i * n_in..(i + 1) * n_in], want[..], "{ty} token {t}");
        }
    }
}
