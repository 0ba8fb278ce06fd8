//! The tiled GEMM (`matmul` with `n_tok >= GEMM_MIN_TOKENS`; a single tile of a 32-element
//! format runs kernels that decode the raw weights in registers) against the per-row dot
//! path, bit for bit (`f32::to_bits`), for every weight type and SIMD level this CPU has, on
//! random shapes including odd row / token counts, K splits that leave tail blocks, and
//! activation rows that are all zero or of extreme magnitude. Two references: an independent
//! loop (quantise each token, one `DotKernel::dot` per output) and the previous driver,
//! `matmul_dot_with` (per-row `dot` / fused `dot4`).

use kapitsa_base::pool::{RayonPool, SerialPool};
use kapitsa_base::{GgmlType, ThreadPool};
use kapitsa_kernels_cpu::matmul::{AMX_MIN_TOKENS, GEMM_MIN_TOKENS};
use kapitsa_kernels_cpu::quant::WEIGHT_TYPES;
use kapitsa_kernels_cpu::{
    matmul_dot_with, matmul_with, quantize_row, vec_dot_type, DotKernel, QMatrix, SimdLevel,
};

mod common;
use common::{f16_fields, Rng};

/// Random valid blocks (arbitrary quants, small finite f16 scales) or plain floats.
fn random_matrix(ty: GgmlType, n_out: usize, n_in: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = ty.row_bytes(n_in).unwrap();
    let mut out: Vec<u8> = (0..rb * n_out).map(|_| rng.u64() as u8).collect();
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    match ty {
        GgmlType::F32 => out
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&(rng.normal() * 0.05).to_le_bytes())),
        GgmlType::F16 => out
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&f16(rng.normal() * 0.05))),
        GgmlType::BF16 => out.chunks_exact_mut(2).for_each(|c| {
            c.copy_from_slice(&(((rng.normal() * 0.05).to_bits() >> 16) as u16).to_le_bytes())
        }),
        _ => {
            for b in out.chunks_exact_mut(ty.type_size()) {
                for &o in f16_fields(ty) {
                    b[o..o + 2].copy_from_slice(&f16(rng.normal() * 0.002));
                }
                if ty == GgmlType::MXFP4 {
                    b[0] = 118 + (rng.u64() % 6) as u8;
                }
            }
        }
    }
    out
}

/// Activations: mostly normal rows of varying scale, plus an all-zero row, a row of huge
/// values and a row with one outlier.
fn random_x(n_tok: usize, n_in: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x = Vec::with_capacity(n_tok * n_in);
    for t in 0..n_tok {
        let scale = match t % 7 {
            3 => 0.0,
            5 => 3.0e4,
            _ => 0.05 + 4.0 * rng.f32(),
        };
        for i in 0..n_in {
            let mut v = rng.normal() * scale;
            if t % 7 == 6 && i == n_in / 2 {
                v = 1.0e3;
            }
            x.push(v);
        }
    }
    x
}

/// The per-row dot path: quantise each token, one `DotKernel::dot` per output.
fn per_row(level: SimdLevel, w: &QMatrix<'_>, x: &[f32], n_tok: usize) -> Vec<f32> {
    let k = DotKernel::with_level(w.dtype, level).unwrap();
    let dt = vec_dot_type(w.dtype).unwrap();
    let rb = w.dtype.row_bytes(w.n_in).unwrap();
    let mut y = vec![0f32; n_tok * w.n_out];
    let mut q = vec![0u8; dt.row_bytes(w.n_in).unwrap()];
    for t in 0..n_tok {
        quantize_row(dt, &x[t * w.n_in..(t + 1) * w.n_in], &mut q).unwrap();
        for r in 0..w.n_out {
            y[t * w.n_out + r] = k.dot(&w.data[r * rb..(r + 1) * rb], &q);
        }
    }
    y
}

fn assert_bitwise(
    ty: GgmlType,
    level: SimdLevel,
    what: &str,
    got: &[f32],
    want: &[f32],
    n_out: usize,
) {
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            a.to_bits() == b.to_bits(),
            "{ty} {level:?} {what}: token {} row {}: gemm {a:e} ({:#x}) vs dot {b:e} ({:#x})",
            i / n_out,
            i % n_out,
            a.to_bits(),
            b.to_bits()
        );
    }
}

#[test]
fn gemm_equals_per_row_dot_bitwise_for_every_type_and_level() {
    let mut rng = Rng(2024);
    let pool2 = RayonPool::new(2).unwrap();
    let pools: [&dyn ThreadPool; 2] = [&SerialPool, &pool2];
    for ty in WEIGHT_TYPES {
        let bs = ty.block_size().max(32);
        // (n_out, n_in in blocks of `bs`, n_tok): whole and partial groups of 256, odd counts.
        let shapes: &[(usize, usize, usize)] = if bs == 256 {
            &[
                (1, 1, 4),
                (7, 2, 5),
                (33, 3, 9),
                (70, 1, 17),
                (19, 6, 31),
                (5, 9, 8),
                // 2-8 tokens: the multi-token row-group GEMV at the AMX level.
                (9, 2, 2),
                (17, 1, 3),
                (40, 5, 7),
                (130, 2, 6),
            ]
        } else {
            // Single tiles (4-8 tokens: the kernels that decode raw weights in registers),
            // with whole and partial last groups (28 blocks = 896 wide, odd block counts),
            // and batches below GEMM_MIN_TOKENS (the per-row path).
            &[
                (1, 8, 4),
                (7, 11, 5),
                (33, 19, 9),
                (70, 8, 17),
                (19, 84, 13),
                (3, 7, 6),
                (9, 58, 11),
                (13, 8, 1),
                (21, 28, 4),
                (5, 3, 8),
                (17, 13, 2),
                (8, 28, 7),
                (6, 16, 5),
                (11, 29, 6),
            ]
        };
        for &(n_out, blocks, n_tok) in shapes {
            let n_in = bs * blocks;
            let data = random_matrix(ty, n_out, n_in, &mut rng);
            let w = QMatrix::new(ty, n_out, n_in, &data).unwrap();
            let x = random_x(n_tok, n_in, &mut rng);
            for level in SimdLevel::available() {
                let want = per_row(level, &w, &x, n_tok);
                for pool in pools {
                    let mut got = vec![f32::NAN; n_tok * n_out];
                    matmul_with(level, pool, &w, &x, n_tok, &mut got).unwrap();
                    let what = format!("{n_out}x{n_in} n_tok={n_tok} threads={}", pool.n_threads());
                    assert_bitwise(ty, level, &what, &got, &want, n_out);
                    // and the previous driver (per-row dot / dot4 tiles) itself
                    let mut old = vec![f32::NAN; n_tok * n_out];
                    matmul_dot_with(level, pool, &w, &x, n_tok, &mut old).unwrap();
                    assert_bitwise(
                        ty,
                        level,
                        &format!("{what} vs matmul_dot_with"),
                        &got,
                        &old,
                        n_out,
                    );
                }
            }
        }
    }
}

#[test]
fn gemm_equals_per_row_dot_on_model_shapes() {
    // Shapes of the real and synthetic models (row counts cut down): K = 1536, 2048, 2688
    // (32-element formats: 84 blocks, a 4-block tail), 896 (Qwen2.5-0.5B: 28 blocks), 8960 (35 super-blocks, several tile
    // chunks), with 512-token-like tails (n_tok = 67).
    let mut rng = Rng(7);
    let pool2 = RayonPool::new(2).unwrap();
    let level = SimdLevel::detect();
    for (ty, n_in) in [
        (GgmlType::Q4_K, 1536),
        (GgmlType::Q6_K, 8960),
        (GgmlType::Q5_K, 2048),
        (GgmlType::Q8_0, 2688),
        (GgmlType::Q5_0, 1856),
        (GgmlType::Q5_0, 896),
        (GgmlType::Q8_0, 896),
        (GgmlType::Q4_0, 4096),
        (GgmlType::IQ4_NL, 2048),
        (GgmlType::MXFP4, 2880),
    ] {
        let (n_out, n_tok) = (45, 67);
        let data = random_matrix(ty, n_out, n_in, &mut rng);
        let w = QMatrix::new(ty, n_out, n_in, &data).unwrap();
        let x = random_x(n_tok, n_in, &mut rng);
        let want = per_row(level, &w, &x, n_tok);
        let mut got = vec![f32::NAN; n_tok * n_out];
        matmul_with(level, &pool2, &w, &x, n_tok, &mut got).unwrap();
        assert_bitwise(ty, level, &format!("{n_out}x{n_in}"), &got, &want, n_out);
    }
}

#[test]
fn gemm_long_batches_split_by_tokens_equal_per_row_dot() {
    // >= 256 tokens with 2 threads takes the token-split schedule (each task packs its own
    // tiles); an odd count leaves a padded last tile.
    let mut rng = Rng(11);
    let pool2 = RayonPool::new(2).unwrap();
    let level = SimdLevel::detect();
    for (ty, n_in, n_tok) in [
        (GgmlType::Q4_K, 512, 301),
        (GgmlType::Q6_K, 2304, 517),
        (GgmlType::Q8_0, 352, 263),
        (GgmlType::Q5_0, 256, 1029),
    ] {
        let n_out = 21;
        let data = random_matrix(ty, n_out, n_in, &mut rng);
        let w = QMatrix::new(ty, n_out, n_in, &data).unwrap();
        let x = random_x(n_tok, n_in, &mut rng);
        let want = per_row(level, &w, &x, n_tok);
        let mut got = vec![f32::NAN; n_tok * n_out];
        matmul_with(level, &pool2, &w, &x, n_tok, &mut got).unwrap();
        assert_bitwise(
            ty,
            level,
            &format!("{n_out}x{n_in} n_tok={n_tok}"),
            &got,
            &want,
            n_out,
        );
    }
}

#[test]
fn amx_tile_gemm_equals_per_row_dot() {
    // Batches of at least `AMX_MIN_TOKENS` take the AMX tile GEMM at `SimdLevel::Amx`: odd
    // row counts (partial row blocks of 16), odd token counts (a partial token tile, an odd
    // tile count), one to 35 super-blocks (several activation chunks at 35 x 700 tokens).
    if !SimdLevel::Amx.is_available() {
        return;
    }
    let mut rng = Rng(29);
    let pool2 = RayonPool::new(2).unwrap();
    let pools: [&dyn ThreadPool; 2] = [&SerialPool, &pool2];
    let level = SimdLevel::Amx;
    let mut cases = Vec::new();
    for (ty, n_out, nb, n_tok) in [
        (GgmlType::Q4_K, 19, 1, AMX_MIN_TOKENS),
        (GgmlType::Q5_K, 33, 3, 97),
        (GgmlType::Q6_K, 70, 6, 130),
        (GgmlType::Q4_K, 5, 35, 700),
        (GgmlType::Q6_K, 17, 2, 81),
    ] {
        cases.push((ty, n_out, 256 * nb, n_tok));
    }
    // The 32-element formats take their tile GEMM (`gemm_amx_blk`) from 2 tokens: Q8_0 row
    // blocks of 16 rows read in place and partial ones decoded, one and several token tiles,
    // several activation chunks (152 blocks x 200 tokens), one block.
    for (ty, n_out, nb, n_tok) in [
        (GgmlType::Q8_0, 35, 28, 2),
        (GgmlType::Q5_0, 35, 28, 3),
        (GgmlType::Q8_0, 16, 1, 16),
        (GgmlType::Q5_0, 7, 3, 17),
        (GgmlType::Q8_0, 48, 152, 200),
        (GgmlType::Q5_0, 21, 152, 200),
        (GgmlType::Q8_0, 33, 29, 45),
    ] {
        cases.push((ty, n_out, 32 * nb, n_tok));
    }
    for (ty, n_out, n_in, n_tok) in cases {
        let data = random_matrix(ty, n_out, n_in, &mut rng);
        let w = QMatrix::new(ty, n_out, n_in, &data).unwrap();
        let x = random_x(n_tok, n_in, &mut rng);
        let want = per_row(level, &w, &x, n_tok);
        for pool in pools {
            let mut got = vec![f32::NAN; n_tok * n_out];
            matmul_with(level, pool, &w, &x, n_tok, &mut got).unwrap();
            let what = format!("{n_out}x{n_in} n_tok={n_tok} threads={}", pool.n_threads());
            assert_bitwise(ty, level, &what, &got, &want, n_out);
        }
    }
}

/// `matmul_many_with` (matrices sharing the input: one packing and pool round per type and
/// width) gives every output bit for bit as a lone `matmul_with` does: mixed types and widths
/// (which must be grouped, not mixed), both GEMM drivers (row split and token split), the
/// AMX and per-row dot fallbacks, 1 and 2 threads.
#[test]
fn matmul_many_equals_one_matmul_per_matrix() {
    use kapitsa_kernels_cpu::matmul_many_with;
    let mut rng = Rng(77);
    let pool2 = RayonPool::new(2).unwrap();
    let pools: [&dyn ThreadPool; 2] = [&SerialPool, &pool2];
    let n_in = 512;
    // (type, n_out): a K-format pair, a 32-element format between them, a different width.
    let mats: Vec<(GgmlType, usize, usize)> = vec![
        (GgmlType::Q4_K, 40, n_in),
        (GgmlType::Q8_0, 24, n_in),
        (GgmlType::Q4_K, 9, n_in),
        (GgmlType::Q6_K, 16, n_in),
        (GgmlType::Q4_K, 8, 2 * n_in),
        (GgmlType::Q8_0, 3, n_in),
    ];
    let data: Vec<Vec<u8>> = mats
        .iter()
        .map(|&(ty, n_out, k)| random_matrix(ty, n_out, k, &mut rng))
        .collect();
    for level in SimdLevel::available() {
        for &n_tok in &[1usize, GEMM_MIN_TOKENS, 13, 40, AMX_MIN_TOKENS + 3, 300] {
            for pool in pools {
                // Matrices of width `n_in` only (they share `x`); the wide one gets its own x.
                for wide in [false, true] {
                    let sel: Vec<usize> = (0..mats.len())
                        .filter(|&i| (mats[i].2 != n_in) == wide)
                        .collect();
                    let k = mats[sel[0]].2;
                    let x = random_x(n_tok, k, &mut rng);
                    let ws: Vec<QMatrix<'_>> = sel
                        .iter()
                        .map(|&i| QMatrix::new(mats[i].0, mats[i].1, k, &data[i]).unwrap())
                        .collect();
                    let mut got: Vec<Vec<f32>> =
                        ws.iter().map(|w| vec![f32::NAN; n_tok * w.n_out]).collect();
                    let mut outs: Vec<&mut [f32]> =
                        got.iter_mut().map(|v| v.as_mut_slice()).collect();
                    matmul_many_with(level, pool, &ws, &x, n_tok, &mut outs).unwrap();
                    for (w, g) in ws.iter().zip(&got) {
                        let mut want = vec![0f32; n_tok * w.n_out];
                        matmul_with(level, pool, w, &x, n_tok, &mut want).unwrap();
                        let what = format!("matmul_many n_tok={n_tok} n_out={}", w.n_out);
                        assert_bitwise(w.dtype, level, &what, g, &want, w.n_out);
                    }
                }
            }
        }
    }
    // One output buffer per matrix.
    let w = QMatrix::new(GgmlType::Q8_0, 3, n_in, &data[5]).unwrap();
    let x = vec![0f32; n_in];
    assert!(matmul_many_with(SimdLevel::Scalar, &SerialPool, &[w], &x, 1, &mut []).is_err());
}
