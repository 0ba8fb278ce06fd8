//! The *super-block order* of the K-format dot products (Q4_K, Q5_K, Q6_K against Q8_K), used
//! at [`SimdLevel::Amx`] so that the AMX tile GEMM (`crate::gemm_amx`) and the per-row dot
//! kernels give bit-identical results.
//!
//! ggml's order (the other levels) keeps 16 float lanes per row and mixes sub-block scales
//! into each lane; tile hardware computes whole integer dot products and cannot reproduce that.
//! This order instead defines, for weight row `w` and activation row `x` of `nb` super-blocks:
//!
//! ```text
//! acc = 0f32
//! for each super-block s:
//!     T = sum_i w'_i * q_i              exact i32: w'_i = sub-block scale * quant
//!                                       (Q6_K: scale * (quant - 32)), q_i the Q8_K quants
//!     acc = fma(d_w * d_x, T as f32, acc)
//!     M = sum_j m_j * B_j               Q4_K/Q5_K only: exact i32, m_j the sub-block mins,
//!                                       B_j the sum of the 32 activation quants of sub-block j
//!     acc = fma(-(dmin_w * d_x), M as f32, acc)
//! result = acc
//! ```
//!
//! `d_w`, `dmin_w` are the block's f16 scales widened to f32, `d_x` the Q8_K scale; `*` is one
//! f32 multiply and `fma` one fused multiply-add (one rounding). The integers are the same ones
//! ggml's scalar code forms, only the float accumulation differs (tested to 1e-5 of
//! `sum |w x|` against the ggml-order scalar twins).
//!
//! [`weights`] gives the `w'`, `m_j` and scales of one block; the scalar twins here, the
//! AVX-512 VNNI kernels (`dot_avx512`, `SB` forms) and the tile GEMM all take their integers
//! from the same definitions.

use kapitsa_base::GgmlType;

use super::blocks::{f16_at, scale_min_k4};
use super::dequant::q6k_values;
use super::SimdLevel;

/// Elements of a super-block.
pub(crate) const QK: usize = 256;

/// One K-format block in integer form: `w[i]` = sub-block scale x quant (Q6_K: x (quant - 32)),
/// `mins[j]` the sub-block mins (Q4_K/Q5_K; zero for Q6_K), `d` and `dmin` the f32 scales
/// (`dmin` is 0 for Q6_K).
pub(crate) struct SbBlock {
    pub(crate) w: [i16; QK],
    pub(crate) mins: [u8; 8],
    pub(crate) d: f32,
    pub(crate) dmin: f32,
}

/// Bytes of one block of the K format `ty` (Q4_K, Q5_K or Q6_K).
pub(crate) fn block_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_K => Some(144),
        GgmlType::Q5_K => Some(176),
        GgmlType::Q6_K => Some(210),
        _ => None,
    }
}

/// Decodes one block of `ty` (`b`: exactly its bytes) into [`SbBlock`]. `ty` must be one of
/// the formats [`block_bytes`] accepts (anything else gives an all-zero block).
pub(crate) fn weights(ty: GgmlType, b: &[u8]) -> SbBlock {
    let mut out = SbBlock {
        w: [0; QK],
        mins: [0; 8],
        d: 0.0,
        dmin: 0.0,
    };
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (sc, mn) = scale_min_k4(&b[4..16]);
            out.mins = mn;
            out.d = f16_at(b, 0);
            out.dmin = f16_at(b, 2);
            let q5 = ty == GgmlType::Q5_K;
            let qs = if q5 { &b[48..176] } else { &b[16..144] };
            for c in 0..4 {
                for l in 0..32 {
                    let (mut lo, mut hi) = (qs[32 * c + l] & 0xF, qs[32 * c + l] >> 4);
                    if q5 {
                        // Q5_K: bit 2c (2c + 1) of qh[l] is the 5th bit of element l of
                        // sub-block 2c (2c + 1).
                        let h = b[16 + l];
                        lo |= ((h >> (2 * c)) & 1) << 4;
                        hi |= ((h >> (2 * c + 1)) & 1) << 4;
                    }
                    out.w[64 * c + l] = i16::from(sc[2 * c]) * i16::from(lo);
                    out.w[64 * c + 32 + l] = i16::from(sc[2 * c + 1]) * i16::from(hi);
                }
            }
        }
        GgmlType::Q6_K => {
            let v = q6k_values(b);
            out.d = f16_at(b, 208);
            for (i, o) in out.w.iter_mut().enumerate() {
                *o = i16::from(b[192 + i / 16] as i8) * i16::from(v[i]);
            }
        }
        _ => {}
    }
    out
}

/// The super-block-order AVX-512 VNNI kernel for `ty` (Q4_K, Q5_K, Q6_K), or `None`,
/// reported at `level` (the caller's cap: [`SimdLevel::Avx512Vnni`] or [`SimdLevel::Amx`],
/// the levels that use this order; the kernel itself needs only AVX-512 VNNI).
#[cfg(target_arch = "x86_64")]
pub(super) fn kernel(ty: GgmlType, level: SimdLevel) -> Option<super::dot_avx512::Chosen> {
    use super::dot_avx512 as k;
    let f: super::DotFn = match ty {
        GgmlType::Q4_K => k::q4_k_sb,
        GgmlType::Q5_K => k::q5_k_sb,
        GgmlType::Q6_K => k::q6_k_sb,
        _ => return None,
    };
    Some((level.min(SimdLevel::Amx), f, None))
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn kernel(_ty: GgmlType, _level: SimdLevel) -> Option<super::dot_avx512::Chosen> {
    None
}

/// Scalar twin of the super-block order (the reference the SIMD and tile kernels are tested
/// against bit for bit): `w` holds `nb` blocks of `ty`, `x` `nb` Q8_K blocks.
#[cfg(test)]
pub(crate) fn dot_scalar(ty: GgmlType, w: &[u8], x: &[u8]) -> f32 {
    let Some(bb) = block_bytes(ty) else {
        return 0.0;
    };
    let mut acc = 0f32;
    for (b, y) in w.chunks_exact(bb).zip(x.chunks_exact(292)) {
        let blk = weights(ty, b);
        let dx = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let t: i32 = (0..QK)
            .map(|i| i32::from(blk.w[i]) * i32::from(y[4 + i] as i8))
            .sum();
        acc = (blk.d * dx).mul_add(t as f32, acc);
        if ty != GgmlType::Q6_K {
            let m: i32 = (0..8)
                .map(|j| {
                    let bs = |o: usize| i32::from(super::blocks::i16_at(y, o));
                    let bj = bs(260 + 4 * j) + bs(262 + 4 * j);
                    i32::from(blk.mins[j]) * bj
                })
                .sum();
            acc = (-(blk.dmin * dx)).mul_add(m as f32, acc);
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{act::quantize_act, DotKernel};

    fn next(s: &mut u64) -> u64 {
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        s.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// `nb` random blocks of `ty` with sane f16 scales.
    fn blocks(ty: GgmlType, nb: usize, s: &mut u64) -> Vec<u8> {
        let bb = block_bytes(ty).unwrap();
        let mut w: Vec<u8> = (0..nb * bb).map(|_| next(s) as u8).collect();
        for b in w.chunks_exact_mut(bb) {
            let (od, om) = if ty == GgmlType::Q6_K {
                (208, None)
            } else {
                (0, Some(2))
            };
            let d = half::f16::from_f32(((next(s) % 1000) as f32 + 1.0) * 1e-5);
            b[od..od + 2].copy_from_slice(&d.to_le_bytes());
            if let Some(o) = om {
                let m = half::f16::from_f32(((next(s) % 1000) as f32) * 1e-5);
                b[o..o + 2].copy_from_slice(&m.to_le_bytes());
            }
        }
        w
    }

    fn act(n: usize, s: &mut u64) -> Vec<u8> {
        let x: Vec<f32> = (0..n)
            .map(|_| ((next(s) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0)
            .collect();
        let mut q = vec![0u8; n / 256 * 292];
        quantize_act(GgmlType::Q8_K, &x, &mut q);
        q
    }

    #[test]
    fn integer_weights_match_dequantisation() {
        let mut s = 5u64;
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            let w = blocks(ty, 4, &mut s);
            let mut deq = vec![0f32; 4 * QK];
            crate::quant::dequantize_row(ty, &w, &mut deq).unwrap();
            for (k, b) in w.chunks_exact(block_bytes(ty).unwrap()).enumerate() {
                let blk = weights(ty, b);
                for i in 0..QK {
                    let m = if ty == GgmlType::Q6_K {
                        0.0
                    } else {
                        blk.dmin * f32::from(blk.mins[i / 32])
                    };
                    let want = blk.d * f32::from(blk.w[i]) - m;
                    let got = deq[k * QK + i];
                    assert!(
                        (want - got).abs() <= 1e-6 * want.abs().max(1e-3),
                        "{ty:?} {i}"
                    );
                }
            }
        }
    }

    /// At every level of this order (AVX-512 VNNI, AMX) the dot kernel is the scalar twin's
    /// bits.
    #[test]
    fn simd_equals_scalar_twin_bitwise_and_ggml_order_closely() {
        let mut s = 17u64;
        let levels = [SimdLevel::Avx512Vnni, SimdLevel::Amx].into_iter();
        for (level, ty) in levels
            .filter(|l| l.is_available())
            .flat_map(|l| [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K].map(|t| (l, t)))
        {
            let k = DotKernel::with_level(ty, level).unwrap();
            assert_eq!(k.level(), level);
            assert!(crate::quant::sb_order(ty, level));
            let ggml = DotKernel::scalar(ty).unwrap();
            for nb in [1, 2, 5, 35] {
                let w = blocks(ty, nb, &mut s);
                let x = act(nb * QK, &mut s);
                let want = dot_scalar(ty, &w, &x);
                let got = k.dot(&w, &x);
                assert_eq!(want.to_bits(), got.to_bits(), "{ty:?} nb {nb}");
                // The ggml order: the same integers, another float order.
                let mut deq = vec![0f32; nb * QK];
                crate::quant::dequantize_row(ty, &w, &mut deq).unwrap();
                let mut xd = vec![0f32; nb * QK];
                crate::quant::dequantize_row(GgmlType::Q8_K, &x, &mut xd).unwrap();
                let mag: f32 = deq.iter().zip(&xd).map(|(a, b)| (a * b).abs()).sum();
                let g = ggml.dot(&w, &x);
                assert!((g - got).abs() <= 1e-5 * mag, "{ty:?} {g} {got} {mag}");
            }
        }
    }
}
