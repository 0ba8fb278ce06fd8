//! Activation quantisation: f32 rows to the `vec_dot_type` of a weight type, exactly as
//! llama.cpp's CPU backend does it on x86-64.
//!
//! Which ggml routine is the reference: ggml-cpu's `type_traits_cpu[..].from_float` points at
//! `quantize_row_q8_0` / `quantize_row_q8_1` / `quantize_row_q8_K` in
//! `ggml-cpu/arch/x86/quants.c`. On any x86 build with AVX or AVX2 (every llama.cpp x86 binary
//! that can run on this machine class) the Q8_0 and Q8_1 routines take the SIMD path, which
//! differs from the portable `quantize_row_q8_0_ref`:
//!
//! * reference: `d = amax/127`, `id = 1/d`, `q = roundf(x*id)` (ties away from zero);
//! * x86 SIMD:  `d = amax/127`, `id = 127/amax`, `q = _mm256_round_ps(x*id, NEAREST)`
//!   (ties to even), and for Q8_1 `s = f16(d * sum(q))`.
//!
//! `127/amax` and `1/(amax/127)` are not always the same float, and the tie rule differs, so
//! the two produce different quants for some inputs. We reproduce the **x86 SIMD** variant,
//! since that is what llama.cpp's CPU backend runs on our targets. Q8_K has no x86 SIMD
//! quantiser (`quantize_row_q8_K` calls `quantize_row_q8_K_ref`), so we reproduce the
//! reference: signed max, `iscale = -127/max`, `q = min(127, nearest_int(iscale*x))`,
//! `d = 1/iscale`, plus 16-element `bsums`. F16 activations use round-to-nearest-even (F16C
//! `vcvtps2ph` imm 0), BF16 uses ggml's round-to-nearest-even with quiet NaN.

use super::blocks::*;
use kapitsa_base::GgmlType;

/// Quantises `x` into `dst` as `ty` (one of F32, F16, BF16, Q8_0, Q8_1, Q8_K). Caller
/// guarantees `x.len()` is a multiple of the block size and `dst` has exactly the row bytes.
/// Q8_0 and Q8_K use the AVX-512 quantisers where the CPU has them (byte-identical, see
/// [`super::act_avx512`]).
pub(crate) fn quantize_act(ty: GgmlType, x: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if matches!(ty, GgmlType::Q8_0 | GgmlType::Q8_K) && kapitsa_base::CpuFeatures::get().avx512 {
        // SAFETY: AVX-512 (F/BW/VL/DQ + AVX2/FMA/F16C, which `avx512` implies) was detected;
        // the caller guarantees whole blocks and `dst` of exactly the row bytes.
        unsafe {
            if ty == GgmlType::Q8_0 {
                super::act_avx512::quantize_q8_0(x, dst);
            } else {
                super::act_avx512::quantize_q8_k(x, dst);
            }
        }
        return;
    }
    quantize_act_scalar(ty, x, dst)
}

/// [`quantize_act`] without SIMD (the reference the AVX-512 quantisers are tested against).
pub(crate) fn quantize_act_scalar(ty: GgmlType, x: &[f32], dst: &mut [u8]) {
    match ty {
        GgmlType::F32 => {
            for (o, v) in dst.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (o, v) in dst.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (o, v) in dst.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            for (o, v) in dst.chunks_exact_mut(34).zip(x.chunks_exact(QK)) {
                quantize_q8_0_block(v, o);
            }
        }
        GgmlType::Q8_1 => {
            for (o, v) in dst.chunks_exact_mut(36).zip(x.chunks_exact(QK)) {
                quantize_q8_1_block(v, o);
            }
        }
        GgmlType::Q8_K => {
            for (o, v) in dst.chunks_exact_mut(292).zip(x.chunks_exact(QK_K)) {
                quantize_q8_k_block(v, o);
            }
        }
        _ => debug_assert!(false, "not an activation type: {ty}"),
    }
}

/// Max |x| of a block, as `_mm256_max_ps` reduces it (NaN inputs are not meaningful).
#[inline(always)]
fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Shared Q8_0/Q8_1 core: returns `d` and writes the 32 quants; returns their sum too.
#[inline(always)]
fn q8_x86(x: &[f32], qs: &mut [u8]) -> (f32, i32) {
    let max = amax(x);
    let d = max / 127.0;
    let id = if max != 0.0 { 127.0 / max } else { 0.0 };
    let mut sum = 0i32;
    for (o, v) in qs.iter_mut().zip(x) {
        // Ties to even, as `_mm256_round_ps(_, _MM_ROUND_NEAREST)`; |v*id| <= 127 (+1 ulp).
        let q = (v * id).round_ties_even().clamp(-128.0, 127.0) as i32;
        sum += q;
        *o = q as i8 as u8;
    }
    (d, sum)
}

fn quantize_q8_0_block(x: &[f32], o: &mut [u8]) {
    let (d, _) = q8_x86(x, &mut o[2..34]);
    o[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
}

fn quantize_q8_1_block(x: &[f32], o: &mut [u8]) {
    let (d, sum) = q8_x86(x, &mut o[4..36]);
    o[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
    let s = d * sum as f32;
    o[2..4].copy_from_slice(&half::f16::from_f32(s).to_bits().to_le_bytes());
}

fn quantize_q8_k_block(x: &[f32], o: &mut [u8]) {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        let a = v.abs();
        if a > amax {
            amax = a;
            max = v;
        }
    }
    if amax == 0.0 {
        o.fill(0);
        return;
    }
    let iscale = -127.0f32 / max;
    for (q, &v) in o[4..260].iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8 as u8;
    }
    for g in 0..16 {
        let s: i32 = o[4 + g * 16..4 + g * 16 + 16]
            .iter()
            .map(|&q| i32::from(q as i8))
            .sum();
        o[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
    }
    o[0..4].copy_from_slice(&(1.0f32 / iscale).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*.
    fn next(s: &mut u64) -> u64 {
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        s.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    #[test]
    fn simd_quantisers_equal_scalar_bytewise() {
        if !kapitsa_base::CpuFeatures::get().avx512 {
            return;
        }
        let mut s = 99u64;
        for case in 0..400 {
            let n = 256 * (1 + case % 3);
            let scale = [1.0f32, 1e-3, 7.5, 3e4, 1e-30][case % 5];
            let mut x: Vec<f32> = (0..n)
                .map(|_| ((next(&mut s) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale)
                .collect();
            match case % 7 {
                // all zero, a block of zeros, ties of +-max, exact halves (rounding ties)
                0 => x.iter_mut().for_each(|v| *v = 0.0),
                1 => x[..256].iter_mut().for_each(|v| *v = -0.0),
                2 => {
                    x[5] = 2.0 * scale;
                    x[9] = -2.0 * scale;
                }
                3 => x
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = (i % 255) as f32 - 127.0),
                4 => x
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = ((i % 9) as f32 - 4.0) * 0.5),
                _ => {}
            }
            for ty in [GgmlType::Q8_0, GgmlType::Q8_K] {
                let rb = ty.row_bytes(n).unwrap();
                let (mut a, mut b) = (vec![0u8; rb], vec![1u8; rb]);
                quantize_act_scalar(ty, &x, &mut a);
                quantize_act(ty, &x, &mut b);
                assert_eq!(a, b, "{ty} case {case}");
            }
        }
        // Q8_0 with NaN / inf elements: NaN quantises to 0 in both.
        let mut x: Vec<f32> = (0..64).map(|i| i as f32 - 30.0).collect();
        x[3] = f32::NAN;
        x[40] = f32::INFINITY;
        let (mut a, mut b) = (vec![0u8; 68], vec![1u8; 68]);
        quantize_act_scalar(GgmlType::Q8_0, &x, &mut a);
        quantize_act(GgmlType::Q8_0, &x, &mut b);
        assert_eq!(a, b, "q8_0 with NaN/inf");
    }
}
