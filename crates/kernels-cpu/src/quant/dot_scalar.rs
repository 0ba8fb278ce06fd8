//! Scalar dot products of a weight row with a quantised activation row, following the integer
//! and float semantics of ggml's generic `ggml_vec_dot_*` (`ggml-cpu/quants.c`, `vec.c`).
//!
//! Integer parts are exact (i32 sums of products of the stored quants, times the per-sub-block
//! integer scales); the float part is, per block, `d_w * d_x * isum` (+ the min/offset term),
//! accumulated in f32. F32/F16/BF16 accumulate f32 products in f64 as ggml's scalar path does.
//! Each function takes whole blocks: `w` holds `nb` weight blocks, `x` the matching `nb`
//! activation blocks (extra trailing bytes of either are ignored).

use super::blocks::*;
use super::dequant::{q5_values, q6k_values};

#[inline(always)]
fn i8s(b: &[u8]) -> &[i8] {
    // SAFETY: u8 and i8 have identical size, alignment and validity; the length is unchanged.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<i8>(), b.len()) }
}

pub(crate) fn f32_f32(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f64;
    for (a, b) in w.chunks_exact(4).zip(x.chunks_exact(4)) {
        s += f64::from(f32_at(a, 0) * f32_at(b, 0));
    }
    s as f32
}

pub(crate) fn f16_f16(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f64;
    for (a, b) in w.chunks_exact(2).zip(x.chunks_exact(2)) {
        s += f64::from(f16_at(a, 0) * f16_at(b, 0));
    }
    s as f32
}

pub(crate) fn bf16_bf16(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f64;
    for (a, b) in w.chunks_exact(2).zip(x.chunks_exact(2)) {
        s += f64::from(bf16_bits_to_f32(u16_at(a, 0)) * bf16_bits_to_f32(u16_at(b, 0)));
    }
    s as f32
}

/// Sum of `w[j] * x[j]` over a block of 32 small signed values.
#[inline(always)]
fn isum32(w: impl Fn(usize) -> i32, x: &[i8]) -> i32 {
    (0..32).map(|j| w(j) * i32::from(x[j])).sum()
}

pub(crate) fn q4_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(18).zip(x.chunks_exact(34)) {
        let qs = &b[2..18];
        let q8 = i8s(&y[2..34]);
        let isum = isum32(
            |j| i32::from(if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 }) - 8,
            q8,
        );
        s += isum as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    s
}

pub(crate) fn q4_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(20).zip(x.chunks_exact(36)) {
        let qs = &b[4..20];
        let q8 = i8s(&y[4..36]);
        let isum = isum32(
            |j| i32::from(if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 }),
            q8,
        );
        s += (f16_at(b, 0) * f16_at(y, 0)) * isum as f32 + f16_at(b, 2) * f16_at(y, 2);
    }
    s
}

pub(crate) fn q5_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(22).zip(x.chunks_exact(34)) {
        let v = q5_values(u32_at(b, 2), &b[6..22]);
        let isum = isum32(|j| i32::from(v[j]) - 16, i8s(&y[2..34]));
        s += isum as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    s
}

pub(crate) fn q5_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(24).zip(x.chunks_exact(36)) {
        let v = q5_values(u32_at(b, 4), &b[8..24]);
        let isum = isum32(|j| i32::from(v[j]), i8s(&y[4..36]));
        s += (f16_at(b, 0) * f16_at(y, 0)) * isum as f32 + f16_at(b, 2) * f16_at(y, 2);
    }
    s
}

pub(crate) fn q8_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(34).zip(x.chunks_exact(34)) {
        let qw = i8s(&b[2..34]);
        let isum = isum32(|j| i32::from(qw[j]), i8s(&y[2..34]));
        s += isum as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    s
}

pub(crate) fn iq4_nl_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(18).zip(x.chunks_exact(34)) {
        let qs = &b[2..18];
        let isum = isum32(
            |j| {
                let n = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
                i32::from(KVALUES_IQ4NL[usize::from(n)])
            },
            i8s(&y[2..34]),
        );
        s += (f16_at(b, 0) * f16_at(y, 0)) * isum as f32;
    }
    s
}

pub(crate) fn mxfp4_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(17).zip(x.chunks_exact(34)) {
        let qs = &b[1..17];
        let isum = isum32(
            |j| {
                let n = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
                i32::from(KVALUES_MXFP4[usize::from(n)])
            },
            i8s(&y[2..34]),
        );
        s += (e8m0_to_f32_half(b[0]) * f16_at(y, 0)) * isum as f32;
    }
    s
}

/// Q8_K block accessors: (d, qs, bsums).
#[inline(always)]
fn q8k(y: &[u8]) -> (f32, &[i8], [i32; 16]) {
    let mut bs = [0i32; 16];
    for (g, o) in bs.iter_mut().enumerate() {
        *o = i32::from(i16_at(y, 260 + 2 * g));
    }
    (f32_at(y, 0), i8s(&y[4..260]), bs)
}

pub(crate) fn q2_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(84).zip(x.chunks_exact(292)) {
        let (yd, q8, bsums) = q8k(y);
        let scales = &b[0..16];
        let qs = &b[16..80];
        let msum: i32 = (0..16).map(|g| bsums[g] * i32::from(scales[g] >> 4)).sum();
        let mut isum = 0i32;
        let mut g = 0;
        for half in 0..2 {
            let q = &qs[half * 32..half * 32 + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let mut t = 0i32;
                    for l in 0..16 {
                        let v = i32::from((q[part * 16 + l] >> shift) & 3);
                        t += v * i32::from(q8[g * 16 + l]);
                    }
                    isum += i32::from(scales[g] & 0xF) * t;
                    g += 1;
                }
            }
        }
        let dall = yd * f16_at(b, 80);
        let dmin = yd * f16_at(b, 82);
        s += dall * isum as f32 - dmin * msum as f32;
    }
    s
}

pub(crate) fn q3_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(110).zip(x.chunks_exact(292)) {
        let (yd, q8, _) = q8k(y);
        let hm = &b[0..32];
        let qs = &b[32..96];
        let scales = scales_q3k(&b[96..108]);
        let mut isum = 0i32;
        let mut g = 0;
        let mut m = 1u8;
        for half in 0..2 {
            let q = &qs[half * 32..half * 32 + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let mut t = 0i32;
                    for l in 0..16 {
                        let i = part * 16 + l;
                        let v = i32::from((q[i] >> shift) & 3) - if hm[i] & m != 0 { 0 } else { 4 };
                        t += v * i32::from(q8[g * 16 + l]);
                    }
                    isum += i32::from(scales[g]) * t;
                    g += 1;
                }
                m <<= 1;
            }
        }
        s += (f16_at(b, 108) * yd) * isum as f32;
    }
    s
}

pub(crate) fn q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(144).zip(x.chunks_exact(292)) {
        let (yd, q8, bsums) = q8k(y);
        let (sc, mn) = scale_min_k4(&b[4..16]);
        let qs = &b[16..144];
        let msum: i32 = (0..16).map(|g| bsums[g] * i32::from(mn[g / 2])).sum();
        let mut isum = 0i32;
        for c in 0..4 {
            let q = &qs[c * 32..c * 32 + 32];
            let (mut s1, mut s2) = (0i32, 0i32);
            for l in 0..32 {
                s1 += i32::from(q[l] & 0xF) * i32::from(q8[c * 64 + l]);
                s2 += i32::from(q[l] >> 4) * i32::from(q8[c * 64 + 32 + l]);
            }
            isum += i32::from(sc[2 * c]) * s1 + i32::from(sc[2 * c + 1]) * s2;
        }
        let d = f16_at(b, 0) * yd;
        let dmin = f16_at(b, 2) * yd;
        s += d * isum as f32 - dmin * msum as f32;
    }
    s
}

pub(crate) fn q5_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(176).zip(x.chunks_exact(292)) {
        let (yd, q8, bsums) = q8k(y);
        let (sc, mn) = scale_min_k4(&b[4..16]);
        let qh = &b[16..48];
        let qs = &b[48..176];
        let msum: i32 = (0..16).map(|g| bsums[g] * i32::from(mn[g / 2])).sum();
        let mut isum = 0i32;
        for c in 0..4 {
            let q = &qs[c * 32..c * 32 + 32];
            let (mut s1, mut s2) = (0i32, 0i32);
            for l in 0..32 {
                let v1 = (q[l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4);
                let v2 = (q[l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
                s1 += i32::from(v1) * i32::from(q8[c * 64 + l]);
                s2 += i32::from(v2) * i32::from(q8[c * 64 + 32 + l]);
            }
            isum += i32::from(sc[2 * c]) * s1 + i32::from(sc[2 * c + 1]) * s2;
        }
        let d = f16_at(b, 0) * yd;
        let dmin = f16_at(b, 2) * yd;
        s += d * isum as f32 - dmin * msum as f32;
    }
    s
}

pub(crate) fn q6_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(210).zip(x.chunks_exact(292)) {
        let (yd, q8, _) = q8k(y);
        let v = q6k_values(b);
        let mut isum = 0i32;
        for g in 0..16 {
            let t: i32 = (0..16)
                .map(|l| i32::from(v[g * 16 + l]) * i32::from(q8[g * 16 + l]))
                .sum();
            isum += i32::from(b[192 + g] as i8) * t;
        }
        s += (f16_at(b, 208) * yd) * isum as f32;
    }
    s
}

pub(crate) fn iq4_xs_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (b, y) in w.chunks_exact(136).zip(x.chunks_exact(292)) {
        let (yd, q8, _) = q8k(y);
        let scales_h = u16_at(b, 2);
        let mut isum = 0i32;
        for ib in 0..8 {
            let qs = &b[8 + ib * 16..8 + ib * 16 + 16];
            let t = isum32(
                |j| {
                    let n = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
                    i32::from(KVALUES_IQ4NL[usize::from(n)])
                },
                &q8[ib * 32..ib * 32 + 32],
            );
            isum += iq4xs_scale(scales_h, &b[4..8], ib) * t;
        }
        s += (f16_at(b, 0) * yd) * isum as f32;
    }
    s
}
