//! Every SIMD dot kernel against its scalar twin on random data, and the scalar twins against a
//! dequantise-then-f64 reference.

use kapitsa_base::GgmlType;
use kapitsa_kernels_cpu::quant::WEIGHT_TYPES;
use kapitsa_kernels_cpu::{
    dequantize_row, quantize_row, vec_dot_type, vec_dot_with, DotKernel, SimdLevel,
};

mod common;
use common::{f16_fields, Rng};

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// A random but valid weight row of `n` elements (finite scales, arbitrary quants).
fn random_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    match ty {
        GgmlType::F32 => (0..n).for_each(|_| out.extend_from_slice(&rng.normal().to_le_bytes())),
        GgmlType::F16 => (0..n).for_each(|_| out.extend_from_slice(&f16_bytes(rng.normal()))),
        GgmlType::BF16 => (0..n).for_each(|_| {
            out.extend_from_slice(&((rng.normal().to_bits() >> 16) as u16).to_le_bytes())
        }),
        _ => {
            let ts = ty.type_size();
            for _ in 0..n / ty.block_size() {
                let mut b: Vec<u8> = (0..ts).map(|_| rng.u64() as u8).collect();
                for &o in f16_fields(ty) {
                    b[o..o + 2].copy_from_slice(&f16_bytes(rng.normal() * 0.02));
                }
                if ty == GgmlType::MXFP4 {
                    b[0] = 118 + (rng.u64() % 12) as u8;
                }
                out.extend_from_slice(&b);
            }
        }
    }
    out
}

fn random_x(n: usize, rng: &mut Rng) -> Vec<f32> {
    let scale = 0.1 + 4.0 * rng.f32();
    (0..n).map(|_| rng.normal() * scale).collect()
}

fn quantized_x(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let dt = vec_dot_type(ty).unwrap();
    let mut q = vec![0u8; dt.row_bytes(x.len()).unwrap()];
    quantize_row(dt, x, &mut q).unwrap();
    q
}

/// Sum of |w_i * x_i| over the dequantised operands: the scale of float rounding error.
fn abs_scale(ty: GgmlType, w: &[u8], xq: &[u8], n: usize) -> f64 {
    let mut wf = vec![0f32; n];
    let mut xf = vec![0f32; n];
    dequantize_row(ty, w, &mut wf).unwrap();
    dequantize_row(vec_dot_type(ty).unwrap(), xq, &mut xf).unwrap();
    wf.iter()
        .zip(&xf)
        .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
        .sum()
}

fn exact_dot(ty: GgmlType, w: &[u8], xq: &[u8], n: usize) -> f64 {
    let mut wf = vec![0f32; n];
    let mut xf = vec![0f32; n];
    dequantize_row(ty, w, &mut wf).unwrap();
    dequantize_row(vec_dot_type(ty).unwrap(), xq, &mut xf).unwrap();
    wf.iter()
        .zip(&xf)
        .map(|(a, b)| f64::from(*a) * f64::from(*b))
        .sum()
}

fn lengths(ty: GgmlType) -> Vec<usize> {
    let bs = ty.block_size();
    if bs == 1 {
        vec![1, 7, 8, 31, 32, 33, 64, 100, 255, 1024, 1536, 4099]
    } else {
        [1usize, 2, 3, 5, 7, 8, 13, 36, 65]
            .iter()
            .map(|b| b * bs)
            .chain([4096usize, 8960].into_iter().filter(|n| n % bs == 0))
            .collect()
    }
}

#[test]
fn simd_kernels_match_scalar_twins() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let levels = SimdLevel::available();
    eprintln!("available levels: {levels:?}");
    for ty in WEIGHT_TYPES {
        let scalar = DotKernel::scalar(ty).unwrap();
        for &level in levels.iter().skip(1) {
            let k = DotKernel::with_level(ty, level).unwrap();
            if k.level() == SimdLevel::Scalar {
                continue;
            }
            for n in lengths(ty) {
                for _ in 0..3 {
                    let w = random_row(ty, n, &mut rng);
                    let xq = quantized_x(ty, &random_x(n, &mut rng));
                    let a = scalar.dot(&w, &xq);
                    let b = k.dot(&w, &xq);
                    let tol = 1e-5 * abs_scale(ty, &w, &xq, n) + 1e-30;
                    assert!(
                        (f64::from(a) - f64::from(b)).abs() <= tol,
                        "{ty} {:?} n={n}: scalar {a} simd {b} tol {tol}",
                        k.level()
                    );
                }
            }
        }
    }
}

#[test]
fn dot4_is_bitwise_four_dots() {
    let mut rng = Rng(0xD074);
    for ty in WEIGHT_TYPES {
        for level in SimdLevel::available() {
            let k = DotKernel::with_level(ty, level).unwrap();
            for n in lengths(ty) {
                let w = random_row(ty, n, &mut rng);
                let xs: Vec<Vec<u8>> = (0..4)
                    .map(|_| quantized_x(ty, &random_x(n, &mut rng)))
                    .collect();
                let got = k.dot4(&w, [&xs[0], &xs[1], &xs[2], &xs[3]]);
                for t in 0..4 {
                    let one = k.dot(&w, &xs[t]);
                    assert_eq!(
                        got[t].to_bits(),
                        one.to_bits(),
                        "{ty} {level:?} n={n} row {t}"
                    );
                }
            }
        }
    }
}

#[test]
fn scalar_twins_match_dequantised_f64_dot() {
    let mut rng = Rng(12345);
    for ty in WEIGHT_TYPES {
        for n in lengths(ty) {
            let w = random_row(ty, n, &mut rng);
            let xq = quantized_x(ty, &random_x(n, &mut rng));
            let got = vec_dot_with(SimdLevel::Scalar, ty, n, &w, &xq).unwrap();
            let want = exact_dot(ty, &w, &xq, n);
            // Q8_1 stores s = f16(d * sum(q)), so the min term carries an f16 rounding.
            let rel = if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                2e-3
            } else {
                2e-6
            };
            let tol = rel * abs_scale(ty, &w, &xq, n) + 1e-30;
            assert!(
                (f64::from(got) - want).abs() <= tol,
                "{ty} n={n}: {got} vs {want} (tol {tol})"
            );
        }
    }
}

#[test]
fn simd_levels_report_fast_paths() {
    let best = SimdLevel::detect();
    for ty in WEIGHT_TYPES {
        let k = DotKernel::new(ty).unwrap();
        eprintln!("{ty}: {:?}", k.level());
        if best >= SimdLevel::Avx2 && matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::Q8_0)
        {
            assert!(k.level() >= SimdLevel::Avx2, "{ty} has no SIMD path");
        }
    }
}

#[test]
fn vec_dot_rejects_bad_sizes() {
    let w = vec![0u8; 144];
    let x = vec![0u8; 292];
    assert!(vec_dot_with(SimdLevel::Scalar, GgmlType::Q4_K, 256, &w, &x).is_ok());
    assert!(vec_dot_with(SimdLevel::Scalar, GgmlType::Q4_K, 255, &w, &x).is_err());
    assert!(vec_dot_with(SimdLevel::Scalar, GgmlType::Q4_K, 256, &w[..143], &x).is_err());
    assert!(vec_dot_with(SimdLevel::Scalar, GgmlType::Q4_K, 256, &w, &x[..291]).is_err());
    assert!(vec_dot_with(SimdLevel::Scalar, GgmlType::I32, 256, &w, &x).is_err());
    let mut d = vec![0f32; 255];
    assert!(dequantize_row(GgmlType::Q4_K, &w, &mut d).is_err());
    let mut q = vec![0u8; 33];
    assert!(quantize_row(GgmlType::Q8_0, &[0.0; 32], &mut q).is_err());
    assert!(quantize_row(GgmlType::Q4_K, &[0.0; 256], &mut [0u8; 144]).is_err());
}
