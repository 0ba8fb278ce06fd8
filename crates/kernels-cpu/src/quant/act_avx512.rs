//! AVX-512 activation quantisers for Q8_0 and Q8_K, byte-identical to the scalar ones in
//! [`act`](super::act) (same f32 operations per element; max and integer sums are exact, so
//! their order does not matter). Inputs containing NaN are not meaningful activations; for Q8_0
//! they still give the scalar result (a NaN element quantises to 0), for Q8_K the quant of a NaN
//! element depends on the NaN's payload in both versions.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Quantises whole 32-element blocks of `x` into Q8_0 blocks (34 bytes each) in `dst`, as
/// `act::quantize_q8_0_block` does.
///
/// # Safety
/// Requires AVX-512F/BW/VL/DQ and F16C; `dst.len() == x.len() / 32 * 34`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_0(x: &[f32], dst: &mut [u8]) {
    let zero = _mm512_setzero_ps();
    for (v, o) in x.chunks_exact(32).zip(dst.chunks_exact_mut(34)) {
        // SAFETY: `v` is 32 f32.
        let (v0, v1) = unsafe {
            (
                _mm512_loadu_ps(v.as_ptr()),
                _mm512_loadu_ps(v.as_ptr().add(16)),
            )
        };
        // `vmaxps a, m` returns `m` when `a` is NaN: `f32::max`'s NaN rule in the scalar fold.
        let m = _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), zero));
        let max = _mm512_reduce_max_ps(m);
        let d = max / 127.0;
        let id = if max != 0.0 { 127.0 / max } else { 0.0 };
        let idv = _mm512_set1_ps(id);
        for (k, vk) in [v0, v1].into_iter().enumerate() {
            let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(vk, idv),
            );
            // NaN -> 0 (Rust's saturating `as i32`); |r| <= 127 otherwise, so the saturating
            // narrowing equals the scalar clamp.
            let ord = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
            let q = _mm512_cvtsepi32_epi8(_mm512_maskz_cvttps_epi32(ord, r));
            // SAFETY: bytes 2 + 16k .. 18 + 16k of the 34-byte block.
            unsafe { _mm_storeu_si128(o.as_mut_ptr().add(2 + 16 * k).cast(), q) };
        }
        o[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
    }
}

/// Quantises whole 256-element blocks of `x` into Q8_K blocks (292 bytes each) in `dst`, as
/// `act::quantize_q8_k_block` does.
///
/// # Safety
/// Requires AVX-512F/BW/VL/DQ; `dst.len() == x.len() / 256 * 292`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_k(x: &[f32], dst: &mut [u8]) {
    let zero = _mm512_setzero_ps();
    for (v, o) in x.chunks_exact(256).zip(dst.chunks_exact_mut(292)) {
        // SAFETY: `v` is 256 f32.
        let vs: [__m512; 16] =
            std::array::from_fn(|k| unsafe { _mm512_loadu_ps(v.as_ptr().add(16 * k)) });
        let mut m = zero;
        for vk in vs {
            m = _mm512_max_ps(_mm512_abs_ps(vk), m);
        }
        let amax = _mm512_reduce_max_ps(m);
        if amax == 0.0 {
            o.fill(0);
            continue;
        }
        // The scalar loop keeps the first element of largest magnitude (strict `>`).
        let am = _mm512_set1_ps(amax);
        let mut max = 0.0f32;
        for (k, vk) in vs.iter().enumerate() {
            let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(*vk), am);
            if hit != 0 {
                max = v[16 * k + hit.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0f32 / max;
        let isv = _mm512_set1_ps(iscale);
        let magic = _mm512_set1_ps(12_582_912.0);
        for (k, vk) in vs.iter().enumerate() {
            // nearest_int: (f + 1.5 * 2^23) mantissa bits - 2^22, then min(127), then `as i8`.
            let t = _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(*vk, isv), magic));
            let q = _mm512_sub_epi32(
                _mm512_and_si512(t, _mm512_set1_epi32(0x007f_ffff)),
                _mm512_set1_epi32(0x0040_0000),
            );
            let q = _mm512_min_epi32(q, _mm512_set1_epi32(127));
            // SAFETY: quants 16k .. 16k + 16 at bytes 4 + 16k of the 292-byte block.
            unsafe {
                _mm_storeu_si128(
                    o.as_mut_ptr().add(4 + 16 * k).cast(),
                    _mm512_cvtepi32_epi8(q),
                )
            };
            // bsums: the sum of the 16 stored i8 quants (truncated like the stored bytes).
            let qi8 = _mm512_srai_epi32(_mm512_slli_epi32(q, 24), 24);
            let s = _mm512_reduce_add_epi32(qi8) as i16;
            o[260 + 2 * k..262 + 2 * k].copy_from_slice(&s.to_le_bytes());
        }
        o[0..4].copy_from_slice(&(1.0f32 / iscale).to_le_bytes());
    }
}
