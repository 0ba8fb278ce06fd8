//! Scalar dequantisation, bit-exact with ggml's `dequantize_row_*` (`ggml-quants.c`).
//!
//! Every product is evaluated in f32 in the same order ggml writes it (e.g. Q4_K is
//! `(d * sc) * q - (dmin * m)`, Q6_K is `(d * sc) * q`), without fused multiply-add. (A
//! llama.cpp build with `-ffp-contract=fast` may fuse `a*q - m` in the `_1`/`_K` formats; the
//! gguf-py reference and the C abstract machine do not.)

use super::blocks::*;

/// Dequantises whole blocks of `ty` from `src` into `dst`. Caller guarantees
/// `src.len() == dst.len() / block_size * type_size` and a supported type.
pub fn dequantize_blocks(ty: crate::GgmlType, src: &[u8], dst: &mut [f32]) {
    use crate::GgmlType as T;
    let bs = ty.block_size();
    let ts = ty.type_size();
    debug_assert_eq!(src.len() / ts * bs, dst.len());
    let f: fn(&[u8], &mut [f32]) = match ty {
        T::F32 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            return;
        }
        T::F16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
            return;
        }
        T::BF16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
            return;
        }
        T::Q4_0 => q4_0,
        T::Q4_1 => q4_1,
        T::Q5_0 => q5_0,
        T::Q5_1 => q5_1,
        T::Q8_0 => q8_0,
        T::Q8_1 => q8_1,
        T::Q2_K => q2_k,
        T::Q3_K => q3_k,
        T::Q4_K => q4_k,
        T::Q5_K => q5_k,
        T::Q6_K => q6_k,
        T::Q8_K => q8_k,
        T::IQ4_NL => iq4_nl,
        T::IQ4_XS => iq4_xs,
        T::MXFP4 => mxfp4,
        T::I8 | T::I16 | T::I32 | T::I64 | T::F64 => {
            debug_assert!(false, "caller checks supported types");
            return;
        }
    };
    for (b, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs)) {
        f(b, y);
    }
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = (i32::from(qs[j] & 0xF) - 8) as f32 * d;
        y[j + 16] = (i32::from(qs[j] >> 4) - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = f32::from(qs[j] & 0xF) * d + m;
        y[j + 16] = f32::from(qs[j] >> 4) * d + m;
    }
}

/// The 5-bit values of a Q5_0/Q5_1 block (0..32), element order.
#[inline(always)]
pub fn q5_values(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut v = [0u8; 32];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) as u8 & 0x10;
        let h1 = (qh >> (j + 12)) as u8 & 0x10;
        v[j] = (qs[j] & 0xF) | h0;
        v[j + 16] = (qs[j] >> 4) | h1;
    }
    v
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let v = q5_values(u32_at(b, 2), &b[6..22]);
    for j in 0..32 {
        y[j] = (i32::from(v[j]) - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let v = q5_values(u32_at(b, 4), &b[8..24]);
    for j in 0..32 {
        y[j] = f32::from(v[j]) * d + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = f32::from(b[2 + j] as i8) * d;
    }
}

fn q8_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = f32::from(b[4 + j] as i8) * d;
    }
}

fn q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32_at(b, 0);
    for j in 0..QK_K {
        y[j] = d * f32::from(b[4 + j] as i8);
    }
}

fn iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * f32::from(KVALUES_IQ4NL[usize::from(qs[j] & 0xF)]);
        y[j + 16] = d * f32::from(KVALUES_IQ4NL[usize::from(qs[j] >> 4)]);
    }
}

fn mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_to_f32_half(b[0]);
    let qs = &b[1..17];
    for j in 0..16 {
        y[j] = f32::from(KVALUES_MXFP4[usize::from(qs[j] & 0xF)]) * d;
        y[j + 16] = f32::from(KVALUES_MXFP4[usize::from(qs[j] >> 4)]) * d;
    }
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    let mut is = 0;
    let mut out = 0;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * f32::from(sc & 0xF);
                let ml = dmin * f32::from(sc >> 4);
                for l in 0..16 {
                    let v = (q[part * 16 + l] >> shift) & 3;
                    y[out] = dl * f32::from(v) - ml;
                    out += 1;
                }
            }
        }
    }
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    let hm = &b[0..32];
    let qs = &b[32..96];
    let scales = scales_q3k(&b[96..108]);
    let d = f16_at(b, 108);
    let mut is = 0;
    let mut out = 0;
    let mut m: u8 = 1;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * f32::from(scales[is]);
                is += 1;
                for l in 0..16 {
                    let i = part * 16 + l;
                    let lo = ((q[i] >> shift) & 3) as i8;
                    let v = lo - if hm[i] & m != 0 { 0 } else { 4 };
                    y[out] = dl * f32::from(v);
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, mn) = scale_min_k4(&b[4..16]);
    let qs = &b[16..144];
    for c in 0..4 {
        let d1 = d * f32::from(sc[2 * c]);
        let m1 = dmin * f32::from(mn[2 * c]);
        let d2 = d * f32::from(sc[2 * c + 1]);
        let m2 = dmin * f32::from(mn[2 * c + 1]);
        let q = &qs[c * 32..c * 32 + 32];
        let yo = &mut y[c * 64..c * 64 + 64];
        for l in 0..32 {
            yo[l] = d1 * f32::from(q[l] & 0xF) - m1;
            yo[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, mn) = scale_min_k4(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        let d1 = d * f32::from(sc[2 * c]);
        let m1 = dmin * f32::from(mn[2 * c]);
        let d2 = d * f32::from(sc[2 * c + 1]);
        let m2 = dmin * f32::from(mn[2 * c + 1]);
        let q = &qs[c * 32..c * 32 + 32];
        let u1 = 1u8 << (2 * c);
        let u2 = 2u8 << (2 * c);
        let yo = &mut y[c * 64..c * 64 + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            yo[l] = d1 * f32::from((q[l] & 0xF) + h1) - m1;
            yo[l + 32] = d2 * f32::from((q[l] >> 4) + h2) - m2;
        }
    }
}

/// The 6-bit values (minus 32) of a Q6_K block, element order.
#[inline(always)]
pub fn q6k_values(b: &[u8]) -> [i8; QK_K] {
    let mut v = [0i8; QK_K];
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let o = &mut v[half * 128..half * 128 + 128];
        for l in 0..32 {
            o[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            o[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            o[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            o[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    v
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    let v = q6k_values(b);
    for (g, (yo, vo)) in y.chunks_exact_mut(16).zip(v.chunks_exact(16)).enumerate() {
        let dl = d * f32::from(b[192 + g] as i8);
        for l in 0..16 {
            yo[l] = dl * f32::from(vo[l]);
        }
    }
}

fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16_at(b, 2);
    let scales_l = &b[4..8];
    for ib in 0..8 {
        let dl = d * iq4xs_scale(scales_h, scales_l, ib) as f32;
        let qs = &b[8 + ib * 16..8 + ib * 16 + 16];
        let yo = &mut y[ib * 32..ib * 32 + 32];
        for j in 0..16 {
            yo[j] = dl * f32::from(KVALUES_IQ4NL[usize::from(qs[j] & 0xF)]);
            yo[j + 16] = dl * f32::from(KVALUES_IQ4NL[usize::from(qs[j] >> 4)]);
        }
    }
}
