//! The plain AVX-512 dot kernels (the level `CpuBackend::llama_cpp_compatible` uses) compute
//! ggml's AVX2 kernels' float operations exactly (`ggml_vec_dot_*` in
//! `ggml-cpu/arch/x86/quants.c`, which llama.cpp's x86 builds run also on AVX-512 CPUs).
//! Checked bit for bit against scalar emulations written from that code:
//! - K formats: 8 f32 lanes, lane `l` holding the exact integer sum of bytes `4l..4l+4` of
//!   every 32-element chunk, one FMA per super-block and lane, ggml's mins and offset terms and
//!   its final reductions;
//! - 32-element formats: one 8-lane chain per row, `acc = fma(d_w * d_x, lanes, acc)` block
//!   after block, then `hsum_float_8`.
//!
//! The VNNI and AMX kernels keep faster orders (16 lanes, block pairs, the super-block order);
//! they are not checked here.

use kapitsa_base::GgmlType;
use kapitsa_kernels_cpu::{quantize_row, vec_dot_with, SimdLevel};

mod common;
use common::{f16_fields, Rng};

fn f16_at(b: &[u8], o: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32()
}

/// Q8_K block: `d`, the 256 quants, the 16 bsums.
fn q8k(y: &[u8]) -> (f32, Vec<i32>, Vec<i32>) {
    let d = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
    let q = y[4..260].iter().map(|&v| i32::from(v as i8)).collect();
    let bs = (0..16)
        .map(|g| i32::from(i16::from_le_bytes([y[260 + 2 * g], y[261 + 2 * g]])))
        .collect();
    (d, q, bs)
}

/// The 6-bit scales and mins of a Q4_K/Q5_K block (`get_scale_min_k4`).
fn scales_mins(s: &[u8]) -> ([i32; 8], [i32; 8]) {
    let (mut sc, mut mn) = ([0; 8], [0; 8]);
    for j in 0..8 {
        if j < 4 {
            sc[j] = i32::from(s[j] & 63);
            mn[j] = i32::from(s[j + 4] & 63);
        } else {
            sc[j] = i32::from((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
            mn[j] = i32::from((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
        }
    }
    (sc, mn)
}

/// ggml's `hsum_float_8`.
fn hsum8(a: &[f32; 8]) -> f32 {
    let r: Vec<f32> = (0..4).map(|k| a[4 + k] + a[k]).collect();
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Lane `l` of 32-element chunk `c`: bytes `4l..4l+4`.
fn lane_dot(q: &[i32], y: &[i32], c: usize, l: usize) -> i32 {
    (4 * l..4 * l + 4)
        .map(|b| q[32 * c + b] * y[32 * c + b])
        .sum()
}

/// Emulation of ggml's AVX2 `ggml_vec_dot_q4_K_q8_K` (`q5`: `..._q5_K_...`).
fn ggml_k45(w: &[u8], x: &[u8], q5: bool) -> f32 {
    let ts = if q5 { 176 } else { 144 };
    let (mut acc, mut acc_m, mut summs) = ([0f32; 8], [0f32; 4], 0f32);
    for (b, y) in w.chunks_exact(ts).zip(x.chunks_exact(292)) {
        let (yd, yq, bs) = q8k(y);
        let (sc, mn) = scales_mins(&b[4..16]);
        let qs = if q5 { &b[48..176] } else { &b[16..144] };
        let mut q = vec![0i32; 256];
        for c in 0..4 {
            for l in 0..32 {
                let (mut lo, mut hi) = (qs[32 * c + l] & 0xF, qs[32 * c + l] >> 4);
                if q5 {
                    lo |= ((b[16 + l] >> (2 * c)) & 1) << 4;
                    hi |= ((b[16 + l] >> (2 * c + 1)) & 1) << 4;
                }
                q[64 * c + l] = i32::from(lo);
                q[64 * c + 32 + l] = i32::from(hi);
            }
        }
        let d = yd * f16_at(b, 0);
        let dmin = -yd * f16_at(b, 2);
        let q8s: Vec<i32> = (0..8).map(|j| bs[2 * j] + bs[2 * j + 1]).collect();
        let prod: Vec<i32> = (0..4)
            .map(|k| mn[2 * k] * q8s[2 * k] + mn[2 * k + 1] * q8s[2 * k + 1])
            .collect();
        if q5 {
            summs = dmin.mul_add(prod.iter().sum::<i32>() as f32, summs);
        } else {
            for k in 0..4 {
                acc_m[k] = dmin.mul_add(prod[k] as f32, acc_m[k]);
            }
        }
        for (l, a) in acc.iter_mut().enumerate() {
            let s: i32 = (0..8).map(|c| sc[c] * lane_dot(&q, &yq, c, l)).sum();
            *a = d.mul_add(s as f32, *a);
        }
    }
    if q5 {
        hsum8(&acc) + summs
    } else {
        hsum8(&acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
    }
}

/// Emulation of ggml's AVX2 `ggml_vec_dot_q6_K_q8_K`.
fn ggml_q6k(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, y) in w.chunks_exact(210).zip(x.chunks_exact(292)) {
        let (yd, yq, bs) = q8k(y);
        let sc: Vec<i32> = (0..16).map(|g| i32::from(b[192 + g] as i8)).collect();
        let mut q = vec![0i32; 256];
        for h in 0..2 {
            let (ql, qh) = (&b[64 * h..64 * h + 64], &b[128 + 32 * h..160 + 32 * h]);
            for l in 0..32 {
                q[128 * h + l] = i32::from((ql[l] & 0xF) | ((qh[l] & 3) << 4));
                q[128 * h + 32 + l] = i32::from((ql[32 + l] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                q[128 * h + 64 + l] = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                q[128 * h + 96 + l] = i32::from((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        let d = yd * f16_at(b, 208);
        for (l, a) in acc.iter_mut().enumerate() {
            // chunk c's bytes 0..16 use scale 2c, bytes 16..32 scale 2c + 1
            let main: i32 = (0..8)
                .map(|c| sc[2 * c + l / 4] * lane_dot(&q, &yq, c, l))
                .sum();
            let off = 32 * (bs[2 * l] * sc[2 * l] + bs[2 * l + 1] * sc[2 * l + 1]);
            *a = d.mul_add((main - off) as f32, *a);
        }
    }
    hsum8(&acc)
}

/// The signed values of one block of a 32-element format.
fn q0_values(ty: GgmlType, b: &[u8]) -> Vec<i32> {
    match ty {
        GgmlType::Q8_0 => b[2..34].iter().map(|&v| i32::from(v as i8)).collect(),
        GgmlType::Q4_0 => {
            let q = &b[2..18];
            let lo = q.iter().map(|&v| i32::from(v & 0xF) - 8);
            lo.chain(q.iter().map(|&v| i32::from(v >> 4) - 8)).collect()
        }
        GgmlType::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let q = &b[6..22];
            (0..32)
                .map(|j| {
                    let nib = if j < 16 { q[j] & 0xF } else { q[j - 16] >> 4 };
                    i32::from(nib | (((qh >> j) & 1) as u8) << 4) - 16
                })
                .collect()
        }
        _ => unreachable!(),
    }
}

/// Emulation of ggml's AVX2 `ggml_vec_dot_q{8,4,5}_0_q8_0`.
fn ggml_q0(ty: GgmlType, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, y) in w.chunks_exact(ty.type_size()).zip(x.chunks_exact(34)) {
        let q = q0_values(ty, b);
        let yq: Vec<i32> = y[2..34].iter().map(|&v| i32::from(v as i8)).collect();
        let d = f16_at(b, 0) * f16_at(y, 0);
        for (l, a) in acc.iter_mut().enumerate() {
            *a = d.mul_add(lane_dot(&q, &yq, 0, l) as f32, *a);
        }
    }
    hsum8(&acc)
}

#[test]
fn q0_format_dots_at_avx512_compute_ggml_avx2_bits() {
    if !SimdLevel::Avx512.is_available() {
        eprintln!("skipping: no AVX-512 on this CPU");
        return;
    }
    let mut rng = Rng(0x0dd_b10c);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0] {
        // 28 blocks: Qwen2.5-0.5B's 896-wide rows (3 groups of 8 and a tail of 4)
        for nb in [1usize, 2, 3, 8, 9, 28, 33] {
            let n = 32 * nb;
            for _ in 0..4 {
                let ts = ty.type_size();
                let mut w: Vec<u8> = (0..nb * ts).map(|_| rng.u64() as u8).collect();
                for blk in w.chunks_exact_mut(ts) {
                    let v = half::f16::from_f32(rng.normal() * 0.02);
                    blk[0..2].copy_from_slice(&v.to_bits().to_le_bytes());
                }
                let scale = 0.1 + 4.0 * rng.f32();
                let x: Vec<f32> = (0..n).map(|_| rng.normal() * scale).collect();
                let mut xq = vec![0u8; nb * 34];
                quantize_row(GgmlType::Q8_0, &x, &mut xq).unwrap();
                let want = ggml_q0(ty, &w, &xq);
                let got = vec_dot_with(SimdLevel::Avx512, ty, n, &w, &xq).unwrap();
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{ty:?} {nb} blocks: {got} vs ggml {want}"
                );
            }
        }
    }
}

#[test]
fn k_format_dots_compute_ggml_avx2_bits() {
    let mut rng = Rng(0x5eed_600d);
    let levels: Vec<SimdLevel> = [SimdLevel::Avx512]
        .into_iter()
        .filter(|l| l.is_available())
        .collect();
    if levels.is_empty() {
        eprintln!("skipping: no AVX-512 on this CPU");
        return;
    }
    let mut checked = 0;
    for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        for nb in [1usize, 2, 3, 6, 9] {
            let n = 256 * nb;
            for _ in 0..4 {
                let ts = ty.type_size();
                let mut w: Vec<u8> = (0..nb * ts).map(|_| rng.u64() as u8).collect();
                for blk in w.chunks_exact_mut(ts) {
                    for &o in f16_fields(ty) {
                        let v = half::f16::from_f32(rng.normal() * 0.02);
                        blk[o..o + 2].copy_from_slice(&v.to_bits().to_le_bytes());
                    }
                }
                let scale = 0.1 + 4.0 * rng.f32();
                let x: Vec<f32> = (0..n).map(|_| rng.normal() * scale).collect();
                let mut xq = vec![0u8; nb * 292];
                quantize_row(GgmlType::Q8_K, &x, &mut xq).unwrap();
                let want = match ty {
                    GgmlType::Q6_K => ggml_q6k(&w, &xq),
                    _ => ggml_k45(&w, &xq, ty == GgmlType::Q5_K),
                };
                for &level in &levels {
                    let got = vec_dot_with(level, ty, n, &w, &xq).unwrap();
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{ty:?} {nb} blocks at {level:?}: {got} vs ggml {want}"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 0);
}
