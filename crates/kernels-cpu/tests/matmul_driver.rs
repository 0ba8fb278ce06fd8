//! Matmul driver: against a plain f32 reference, against the scalar driver, thread-count
//! invariance, row gathers and argument validation. Plus an `#[ignore]`d GEMV bandwidth probe.

use kapitsa_base::pool::{RayonPool, SerialPool};
use kapitsa_base::{GgmlType, ThreadPool};
use kapitsa_kernels_cpu::quant::WEIGHT_TYPES;
use kapitsa_kernels_cpu::{
    dequantize_row, dequantize_rows, gemv_batch_with, get_rows, matmul, matmul_many_with,
    matmul_scalar, matmul_with, quantize_row, vec_dot_type, vec_dot_with, QMatrix, SimdLevel,
};

mod common;
use common::{f16_fields, Rng};

fn random_matrix(ty: GgmlType, n_out: usize, n_in: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..n_out {
        match ty {
            GgmlType::F32 => {
                (0..n_in).for_each(|_| out.extend_from_slice(&(rng.normal() * 0.05).to_le_bytes()))
            }
            GgmlType::F16 => (0..n_in).for_each(|_| {
                out.extend_from_slice(
                    &half::f16::from_f32(rng.normal() * 0.05)
                        .to_bits()
                        .to_le_bytes(),
                )
            }),
            GgmlType::BF16 => (0..n_in).for_each(|_| {
                out.extend_from_slice(
                    &(((rng.normal() * 0.05).to_bits() >> 16) as u16).to_le_bytes(),
                )
            }),
            _ => {
                for _ in 0..n_in / ty.block_size() {
                    let mut b: Vec<u8> = (0..ty.type_size()).map(|_| rng.u64() as u8).collect();
                    for &o in f16_fields(ty) {
                        b[o..o + 2].copy_from_slice(
                            &half::f16::from_f32(rng.normal() * 0.002)
                                .to_bits()
                                .to_le_bytes(),
                        );
                    }
                    if ty == GgmlType::MXFP4 {
                        b[0] = 118 + (rng.u64() % 6) as u8;
                    }
                    out.extend_from_slice(&b);
                }
            }
        }
    }
    out
}

/// y_ref[t, r] = sum_i W[r, i] * xq[t, i] in f64, with both operands dequantised: the exact
/// value the quantised kernels approximate only by float rounding.
fn reference(w: &QMatrix<'_>, x: &[f32], n_tok: usize) -> (Vec<f64>, Vec<f64>) {
    let mut wf = vec![0f32; w.n_out * w.n_in];
    dequantize_rows(w, 0..w.n_out, &mut wf).unwrap();
    let dt = vec_dot_type(w.dtype).unwrap();
    let mut xf = vec![0f32; x.len()];
    for (xr, o) in x.chunks_exact(w.n_in).zip(xf.chunks_exact_mut(w.n_in)) {
        let mut q = vec![0u8; dt.row_bytes(w.n_in).unwrap()];
        quantize_row(dt, xr, &mut q).unwrap();
        dequantize_row(dt, &q, o).unwrap();
    }
    let mut y = vec![0f64; n_tok * w.n_out];
    let mut scale = vec![0f64; n_tok * w.n_out];
    for t in 0..n_tok {
        for r in 0..w.n_out {
            let (a, b) = (
                &wf[r * w.n_in..(r + 1) * w.n_in],
                &xf[t * w.n_in..(t + 1) * w.n_in],
            );
            y[t * w.n_out + r] = a
                .iter()
                .zip(b)
                .map(|(p, q)| f64::from(*p) * f64::from(*q))
                .sum();
            scale[t * w.n_out + r] = a
                .iter()
                .zip(b)
                .map(|(p, q)| (f64::from(*p) * f64::from(*q)).abs())
                .sum();
        }
    }
    (y, scale)
}

/// The unquantised f32 product (activations not quantised), in f64.
fn f32_reference(w: &QMatrix<'_>, x: &[f32], n_tok: usize) -> Vec<f64> {
    let mut wf = vec![0f32; w.n_out * w.n_in];
    dequantize_rows(w, 0..w.n_out, &mut wf).unwrap();
    let mut y = vec![0f64; n_tok * w.n_out];
    for t in 0..n_tok {
        for r in 0..w.n_out {
            y[t * w.n_out + r] = wf[r * w.n_in..(r + 1) * w.n_in]
                .iter()
                .zip(&x[t * w.n_in..(t + 1) * w.n_in])
                .map(|(p, q)| f64::from(*p) * f64::from(*q))
                .sum();
        }
    }
    y
}

#[test]
fn matmul_matches_references_for_every_type() {
    let mut rng = Rng(77);
    let pool2 = RayonPool::new(2).unwrap();
    for ty in WEIGHT_TYPES {
        let bs = ty.block_size().max(32);
        for &(n_out, in_blocks, n_tok) in &[
            (1usize, 1usize, 1usize),
            (7, 3, 1),
            (33, 2, 5),
            (64, 4, 37),
            (5, 1, 70),
        ] {
            let n_in = bs * in_blocks;
            let data = random_matrix(ty, n_out, n_in, &mut rng);
            let w = QMatrix::new(ty, n_out, n_in, &data).unwrap();
            let x: Vec<f32> = (0..n_tok * n_in).map(|_| rng.normal()).collect();
            let mut y_fast = vec![f32::NAN; n_tok * n_out];
            let mut y_fast1 = vec![f32::NAN; n_tok * n_out];
            let mut y_scalar = vec![f32::NAN; n_tok * n_out];
            matmul(&pool2, &w, &x, n_tok, &mut y_fast).unwrap();
            matmul(&SerialPool, &w, &x, n_tok, &mut y_fast1).unwrap();
            matmul_scalar(&pool2, &w, &x, n_tok, &mut y_scalar).unwrap();
            // Thread count never changes results.
            assert!(
                y_fast
                    .iter()
                    .zip(&y_fast1)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ty}: 1 vs 2 threads"
            );
            let (y_ref, scale) = reference(&w, &x, n_tok);
            let y_f32 = f32_reference(&w, &x, n_tok);
            let rel_q = if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                2e-3
            } else {
                1e-5
            };
            for i in 0..y_ref.len() {
                let tol = rel_q * scale[i] + 1e-30;
                let (f, s) = (f64::from(y_fast[i]), f64::from(y_scalar[i]));
                assert!(
                    (f - s).abs() <= 2.0 * tol,
                    "{ty} {n_out}x{n_in} t={n_tok} i={i}: fast {f} scalar {s}"
                );
                assert!(
                    (s - y_ref[i]).abs() <= tol,
                    "{ty} i={i}: scalar {s} vs quantised ref {}",
                    y_ref[i]
                );
                // Against the unquantised product: activation quantisation error bound
                // (Q8: 1/254 of the block max per element; f16/bf16 rounding otherwise).
                let act_rel = match vec_dot_type(ty).unwrap() {
                    GgmlType::F32 => 1e-5,
                    GgmlType::F16 => 1e-3,
                    GgmlType::BF16 => 8e-3,
                    _ => 0.05,
                };
                assert!(
                    (s - y_f32[i]).abs() <= act_rel * scale[i] * 4.0 + 1e-6,
                    "{ty} i={i}: scalar {s} vs f32 ref {}",
                    y_f32[i]
                );
            }
        }
    }
}

#[test]
fn every_available_level_agrees_and_is_thread_invariant() {
    let mut rng = Rng(5);
    let pool2 = RayonPool::new(2).unwrap();
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::F16,
    ] {
        let (n_out, n_in, n_tok) = (96, 512, 9);
        let data = random_matrix(ty, n_out, n_in, &mut rng);
        let w = QMatrix::new(ty, n_out, n_in, &data).unwrap();
        let x: Vec<f32> = (0..n_tok * n_in).map(|_| rng.normal()).collect();
        let mut base = vec![0f32; n_tok * n_out];
        matmul_scalar(&SerialPool, &w, &x, n_tok, &mut base).unwrap();
        for level in SimdLevel::available() {
            let mut a = vec![0f32; n_tok * n_out];
            let mut b = vec![0f32; n_tok * n_out];
            matmul_with(level, &SerialPool, &w, &x, n_tok, &mut a).unwrap();
            matmul_with(level, &pool2, &w, &x, n_tok, &mut b).unwrap();
            assert_eq!(a, b, "{ty} {level:?}: thread variance");
            for (p, q) in a.iter().zip(&base) {
                assert!(
                    (p - q).abs() <= 1e-4 * (1.0 + q.abs()),
                    "{ty} {level:?}: {p} vs {q}"
                );
            }
        }
    }
}

#[test]
fn batched_tokens_equal_single_token_results_bitwise() {
    // prefill in one chunk == token-by-token decode: the fused multi-token kernels must give
    // exactly the single-token results.
    let mut rng = Rng(31);
    let pool2 = RayonPool::new(2).unwrap();
    for ty in WEIGHT_TYPES {
        let bs = ty.block_size().max(32);
        let (n_out, n_in, n_tok) = (19, 3 * bs, 41);
        let data = random_matrix(ty, n_out, n_in, &mut rng);
        let w = QMatrix::new(ty, n_out, n_in, &data).unwrap();
        let x: Vec<f32> = (0..n_tok * n_in).map(|_| rng.normal()).collect();
        for level in SimdLevel::available() {
            let mut all = vec![0f32; n_tok * n_out];
            matmul_with(level, &pool2, &w, &x, n_tok, &mut all).unwrap();
            for t in 0..n_tok {
                let mut one = vec![0f32; n_out];
                matmul_with(
                    level,
                    &SerialPool,
                    &w,
                    &x[t * n_in..(t + 1) * n_in],
                    1,
                    &mut one,
                )
                .unwrap();
                let row = &all[t * n_out..(t + 1) * n_out];
                assert!(
                    row.iter()
                        .zip(&one)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty} {level:?} token {t}: batched {row:?} vs single {one:?}"
                );
            }
        }
    }
}

/// Speculative verification and batched decode: a pass of 1, 2..=16 and 17+ tokens (every
/// driver: one-token GEMV, multi-token GEMV, register-decoding and record GEMMs, per-row dot)
/// gives each token exactly its one-token result, at every level, for the formats of the real
/// models (K formats, and Q8_0 / Q5_0 for 896-wide matrices with a partial last group); also
/// through `matmul_many_with` with two matrices.
#[test]
fn every_batch_size_equals_single_tokens_bitwise() {
    let mut rng = Rng(77);
    let pool2 = RayonPool::new(2).unwrap();
    let types = [
        (GgmlType::Q4_K, 2 * 256),
        (GgmlType::Q5_K, 256),
        (GgmlType::Q6_K, 3 * 256),
        (GgmlType::Q8_0, 896),
        (GgmlType::Q5_0, 896),
    ];
    for (ty, n_in) in types {
        let n_out = 37;
        let (d0, d1) = (
            random_matrix(ty, n_out, n_in, &mut rng),
            random_matrix(ty, 9, n_in, &mut rng),
        );
        let w = QMatrix::new(ty, n_out, n_in, &d0).unwrap();
        let w2 = QMatrix::new(ty, 9, n_in, &d1).unwrap();
        let n_max = 33;
        let x: Vec<f32> = (0..n_max * n_in).map(|_| rng.normal()).collect();
        for level in SimdLevel::available() {
            let single = |w: &QMatrix<'_>, t: usize| {
                let mut one = vec![0f32; w.n_out];
                matmul_with(
                    level,
                    &SerialPool,
                    w,
                    &x[t * n_in..(t + 1) * n_in],
                    1,
                    &mut one,
                )
                .unwrap();
                one
            };
            let ones: Vec<Vec<f32>> = (0..n_max).map(|t| single(&w, t)).collect();
            let ones2: Vec<Vec<f32>> = (0..n_max).map(|t| single(&w2, t)).collect();
            for n_tok in (2..=17).chain([24, 33]) {
                let xs = &x[..n_tok * n_in];
                let mut all = vec![f32::NAN; n_tok * n_out];
                matmul_with(level, &pool2, &w, xs, n_tok, &mut all).unwrap();
                let (mut a, mut b) = (vec![f32::NAN; n_tok * n_out], vec![f32::NAN; n_tok * 9]);
                matmul_many_with(level, &pool2, &[w, w2], xs, n_tok, &mut [&mut a, &mut b])
                    .unwrap();
                for t in 0..n_tok {
                    for (what, got, want) in [
                        ("matmul", &all[t * n_out..(t + 1) * n_out], &ones[t]),
                        ("many[0]", &a[t * n_out..(t + 1) * n_out], &ones[t]),
                        ("many[1]", &b[t * 9..(t + 1) * 9], &ones2[t]),
                    ] {
                        assert!(
                            got.iter()
                                .zip(want)
                                .all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{ty} {level:?} {what} n_tok {n_tok} token {t}: {got:?} vs {want:?}"
                        );
                    }
                }
            }
        }
    }
}

/// `gemv_batch_with` (several one-token products in one pool round, shared inputs quantised
/// once) gives every output bit for bit as one per-row dot kernel on the quantised input:
/// mixed types (row-group GEMV kernels and per-row ones), widths, inputs shared by several
/// matrices (also across weight types whose GEMVs lay the input out differently) and inputs
/// of their own, matrices of one row and of many chunks, every level, 1 and 2 threads.
#[test]
fn gemv_batch_equals_per_row_dot_bitwise() {
    let mut rng = Rng(404);
    let pool2 = RayonPool::new(2).unwrap();
    let spin2 = kapitsa_base::pool::SpinPool::new(2).unwrap();
    let pools: [&dyn ThreadPool; 3] = [&SerialPool, &pool2, &spin2];
    // (type, n_out, n_in, input). Inputs (tokens x width): 0 and 1 are 1 x 512, 2 is 1 x 768,
    // 3 is 2 x 512, 4 is 3 x 768, 5 is 5 x 512 (a pass of 4 tokens and one of 1), 6 is 4 x 256.
    // Products of several tokens meet the multi-token GEMV (K formats), the AMX tile GEMM
    // (Q8_0, Q5_0) or go token by token (the rest, and every type below the AMX level); some
    // inputs are shared across types whose GEMVs lay them out differently.
    let mats: [(GgmlType, usize, usize, usize); 21] = [
        (GgmlType::Q4_K, 300, 512, 0),
        (GgmlType::Q6_K, 17, 512, 0),
        (GgmlType::Q5_K, 33, 512, 0),
        (GgmlType::Q8_0, 64, 512, 0),
        (GgmlType::Q4_K, 1, 512, 1),
        (GgmlType::Q5_0, 48, 768, 2),
        (GgmlType::F16, 5, 512, 1),
        (GgmlType::Q4_K, 2000, 768, 2),
        (GgmlType::F32, 3, 768, 2),
        (GgmlType::Q4_K, 100, 512, 3),
        (GgmlType::Q6_K, 40, 512, 3),
        (GgmlType::Q8_0, 3000, 512, 3),
        (GgmlType::Q5_K, 64, 768, 4),
        (GgmlType::Q5_0, 80, 768, 4),
        (GgmlType::F32, 7, 768, 4),
        (GgmlType::Q4_K, 1500, 512, 5),
        (GgmlType::Q6_K, 33, 512, 5),
        (GgmlType::Q5_0, 20, 512, 5),
        (GgmlType::Q4_K, 48, 256, 6),
        // Inputs shared by products of other widths (so other token counts): input 2 as
        // 2 x 384, input 6 as 2 x 512.
        (GgmlType::Q8_0, 40, 384, 2),
        (GgmlType::Q4_K, 16, 512, 6),
    ];
    let data: Vec<Vec<u8>> = mats
        .iter()
        .map(|&(ty, n_out, n_in, _)| random_matrix(ty, n_out, n_in, &mut rng))
        .collect();
    let inputs: Vec<Vec<f32>> = [512usize, 512, 768, 2 * 512, 3 * 768, 5 * 512, 4 * 256]
        .iter()
        .map(|&n| (0..n).map(|_| rng.normal()).collect())
        .collect();
    let ws: Vec<QMatrix<'_>> = mats
        .iter()
        .zip(&data)
        .map(|(&(ty, n_out, n_in, _), d)| QMatrix::new(ty, n_out, n_in, d).unwrap())
        .collect();
    let xs: Vec<&[f32]> = mats.iter().map(|m| inputs[m.3].as_slice()).collect();
    for level in SimdLevel::available() {
        // The reference: one dot per row and token on the quantised input.
        let want: Vec<Vec<f32>> = ws
            .iter()
            .zip(&xs)
            .map(|(w, x)| {
                let dt = vec_dot_type(w.dtype).unwrap();
                let mut q = vec![0u8; dt.row_bytes(w.n_in).unwrap()];
                x.chunks_exact(w.n_in)
                    .flat_map(|xt| {
                        quantize_row(dt, xt, &mut q).unwrap();
                        (0..w.n_out)
                            .map(|r| {
                                vec_dot_with(level, w.dtype, w.n_in, w.row(r).unwrap(), &q).unwrap()
                            })
                            .collect::<Vec<f32>>()
                    })
                    .collect()
            })
            .collect();
        for pool in pools {
            let mut got: Vec<Vec<f32>> = want.iter().map(|w| vec![f32::NAN; w.len()]).collect();
            let mut ys: Vec<&mut [f32]> = got.iter_mut().map(|v| v.as_mut_slice()).collect();
            gemv_batch_with(level, pool, &ws, &xs, &mut ys).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{:?} {level:?} {} threads, matrix {i}: {g:?} vs {w:?}",
                    mats[i].0,
                    pool.n_threads()
                );
            }
        }
    }
    // Bad arguments: counts and lengths.
    let x = &xs[..1];
    let mut y = vec![0f32; 300];
    assert!(gemv_batch_with(SimdLevel::Scalar, &SerialPool, &ws[..1], &[], &mut [&mut y]).is_err());
    assert!(gemv_batch_with(SimdLevel::Scalar, &SerialPool, &ws[..1], x, &mut []).is_err());
    assert!(gemv_batch_with(
        SimdLevel::Scalar,
        &SerialPool,
        &ws[..1],
        x,
        &mut [&mut y[1..]]
    )
    .is_err());
    assert!(gemv_batch_with(
        SimdLevel::Scalar,
        &SerialPool,
        &ws[..1],
        &[&xs[0][1..]],
        &mut [&mut y]
    )
    .is_err());
    assert!(gemv_batch_with(SimdLevel::Scalar, &SerialPool, &ws[..1], x, &mut [&mut y]).is_ok());
    // Two tokens of input need two tokens of output.
    let x2 = &xs[9..10];
    assert!(gemv_batch_with(SimdLevel::Scalar, &SerialPool, &ws[..1], x2, &mut [&mut y]).is_err());
    let mut y2 = vec![0f32; 600];
    assert!(gemv_batch_with(SimdLevel::Scalar, &SerialPool, &ws[..1], x2, &mut [&mut y2]).is_ok());
}

#[test]
fn get_rows_dequantises_and_checks_ids() {
    let mut rng = Rng(9);
    for ty in [
        GgmlType::Q5_0,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::F16,
        GgmlType::F32,
    ] {
        let (n_out, n_in) = (10, 256);
        let data = random_matrix(ty, n_out, n_in, &mut rng);
        let w = QMatrix::new(ty, n_out, n_in, &data).unwrap();
        let ids = [3u32, 0, 9, 3];
        let mut out = vec![0f32; ids.len() * n_in];
        get_rows(&w, &ids, &mut out).unwrap();
        let rb = ty.row_bytes(n_in).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            let mut want = vec![0f32; n_in];
            dequantize_row(
                ty,
                &data[id as usize * rb..(id as usize + 1) * rb],
                &mut want,
            )
            .unwrap();
            assert_eq!(&out[i * n_in..(i + 1) * n_in], &want[..]);
        }
        assert!(get_rows(&w, &[10], &mut vec![0f32; n_in]).is_err());
        assert!(get_rows(&w, &[1], &mut vec![0f32; n_in - 1]).is_err());
    }
}

#[test]
fn matmul_rejects_bad_shapes() {
    let data = vec![0u8; 144 * 2];
    assert!(QMatrix::new(GgmlType::Q4_K, 2, 256, &data).is_ok());
    assert!(QMatrix::new(GgmlType::Q4_K, 3, 256, &data).is_err());
    assert!(QMatrix::new(GgmlType::Q4_K, 2, 200, &data).is_err());
    let w = QMatrix {
        dtype: GgmlType::Q4_K,
        n_out: 2,
        n_in: 256,
        data: &data,
    };
    let x = vec![0f32; 256 * 3];
    let mut y = vec![0f32; 2 * 3];
    assert!(matmul(&SerialPool, &w, &x, 3, &mut y).is_ok());
    assert!(matmul(&SerialPool, &w, &x, 2, &mut y).is_err());
    assert!(matmul(&SerialPool, &w, &x[1..], 3, &mut y).is_err());
    assert!(matmul(&SerialPool, &w, &x, 3, &mut y[1..]).is_err());
    let bad = QMatrix {
        dtype: GgmlType::Q4_K,
        n_out: 3,
        n_in: 256,
        data: &data,
    };
    assert!(matmul(&SerialPool, &bad, &x, 3, &mut [0f32; 9]).is_err());
    let int = QMatrix {
        dtype: GgmlType::I32,
        n_out: 1,
        n_in: 2,
        data: &data[..8],
    };
    assert!(matmul(&SerialPool, &int, &x[..2], 1, &mut y[..1]).is_err());
}

fn bench_one(
    pool: &dyn ThreadPool,
    ty: GgmlType,
    n_out: usize,
    n_in: usize,
    n_tok: usize,
    level: SimdLevel,
) {
    let mut rng = Rng(1);
    let data = random_matrix(ty, n_out, n_in, &mut rng);
    let w = QMatrix::new(ty, n_out, n_in, &data).unwrap();
    let x: Vec<f32> = (0..n_tok * n_in).map(|_| rng.normal()).collect();
    let mut y = vec![0f32; n_tok * n_out];
    matmul_with(level, pool, &w, &x, n_tok, &mut y).unwrap();
    // Best of N: the machine is shared, the minimum is the least disturbed run.
    let iters = if n_tok == 1 { 200 } else { 5 };
    let mut dt = f64::INFINITY;
    for _ in 0..iters {
        let t = std::time::Instant::now();
        matmul_with(level, pool, &w, &x, n_tok, &mut y).unwrap();
        dt = dt.min(t.elapsed().as_secs_f64());
    }
    let gbs = data.len() as f64 / dt / 1e9;
    let gflops = 2.0 * (n_out * n_in * n_tok) as f64 / dt / 1e9;
    eprintln!(
        "{ty:>6} {n_out}x{n_in} n_tok={n_tok:<4} {level:?} threads={}: {:.3} ms, weights {:.1} GB/s, {:.1} GFLOP/s",
        pool.n_threads(),
        dt * 1e3,
        gbs,
        gflops
    );
}

/// Kernel-only comparison of the levels for a few types, in cache, interleaved to share noise.
#[test]
#[ignore]
fn bench_levels_in_cache() {
    for _round in 0..3 {
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
        ] {
            for level in SimdLevel::available().into_iter().skip(1) {
                bench_one(&SerialPool, ty, 256, 1536, 1, level);
                bench_one(&SerialPool, ty, 256, 1536, 32, level);
            }
        }
    }
}

/// Rough timings; run with `cargo test --release -p kapitsa-kernels-cpu --test matmul_driver --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn bench_gemv_bandwidth() {
    let pool1 = SerialPool;
    let pool2 = RayonPool::new(2).unwrap();
    let best = SimdLevel::detect();
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::IQ4_NL,
        GgmlType::F16,
    ] {
        bench_one(&pool1, ty, 8960, 1536, 1, best);
        bench_one(&pool2, ty, 8960, 1536, 1, best);
    }
    for level in SimdLevel::available() {
        bench_one(&pool2, GgmlType::Q4_K, 8960, 1536, 1, level);
        bench_one(&pool2, GgmlType::Q4_K, 1536, 8960, 1, level);
    }
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
        for level in SimdLevel::available().into_iter().skip(1) {
            bench_one(&pool2, ty, 1536, 1536, 128, level);
        }
    }
    // In-cache compute rate of the kernels, one thread.
    for level in SimdLevel::available().into_iter().skip(1) {
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
            GgmlType::IQ4_NL,
        ] {
            bench_one(&pool1, ty, 256, 1536, 1, level);
        }
    }
}
