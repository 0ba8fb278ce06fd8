//! AVX2 (+FMA, F16C) dot products. Integer parts are exact (same sums as the scalar twins);
//! only the float accumulation order differs.
//!
//! Every kernel processes `nb = min(w blocks, x blocks)` whole blocks and reads only inside
//! its slices. Every `unsafe fn` here requires AVX2, FMA and F16C; they are only reachable
//! through [`kernel`], whose result `DotKernel` calls only after runtime detection.

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use kapitsa_base::GgmlType;

/// A dot kernel (see `DotKernel`).
type DotFn = unsafe fn(&[u8], &[u8]) -> f32;
/// A 4-row dot kernel (see `DotKernel::dot4`).
type Dot4Fn = unsafe fn(&[u8], [&[u8]; 4]) -> [f32; 4];

/// The AVX2 kernel for `ty` (1-row form and, where fused, 4-row form), if there is one.
#[cfg(target_arch = "x86_64")]
pub(super) fn kernel(ty: GgmlType) -> Option<(DotFn, Option<Dot4Fn>)> {
    use GgmlType as T;
    Some(match ty {
        T::F32 => (f32_f32, None),
        T::F16 => (f16_f16, None),
        T::BF16 => (bf16_bf16, None),
        T::Q4_0 => (q4_0_q8_0, Some(q4_0_q8_0_x4)),
        T::Q5_0 => (q5_0_q8_0, Some(q5_0_q8_0_x4)),
        T::Q8_0 => (q8_0_q8_0, Some(q8_0_q8_0_x4)),
        T::IQ4_NL => (iq4_nl_q8_0, Some(iq4_nl_q8_0_x4)),
        T::MXFP4 => (mxfp4_q8_0, Some(mxfp4_q8_0_x4)),
        T::Q4_K => (q4_k_q8_k, Some(q4_k_q8_k_x4)),
        T::Q5_K => (q5_k_q8_k, None),
        T::Q6_K => (q6_k_q8_k, Some(q6_k_q8_k_x4)),
        T::IQ4_XS => (iq4_xs_q8_k, None),
        _ => return None,
    })
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn kernel(_ty: GgmlType) -> Option<(DotFn, Option<Dot4Fn>)> {
    None
}

#[cfg(target_arch = "x86_64")]
pub(super) use imp::*;

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::*;
    use crate::quant::blocks::{
        bf16_bits_to_f32, e8m0_to_f32_half, scale_min_k4, KVALUES_IQ4NL, KVALUES_MXFP4,
    };

    /// f16 bits at `p[o..o + 2]` to f32 (exact), branch-free.
    ///
    /// Deliberately neither `vcvtph2ps` (LLVM lowers the scalar form to a `vpinsrw` into a
    /// free register, which can create a false dependency on a loop accumulator) nor a float
    /// rebias multiply of the raw bits (LLVM SLP-vectorises it with junk lanes that can be
    /// subnormal, and subnormal operands cost a ~150-cycle microcode assist). Normal numbers
    /// rebias the exponent by adding 112 << 23 (Inf/NaN by twice that); subnormals and zero are
    /// `mantissa * 2^-24`, computed from an integer, so no float operand is ever subnormal.
    #[inline(always)]
    pub(crate) fn f16c(p: &[u8], o: usize) -> f32 {
        let h = u32::from(u16::from_le_bytes([p[o], p[o + 1]]));
        let sign = (h & 0x8000) << 16;
        let em = h & 0x7fff;
        let norm = (em << 13) + (112 << 23) + if em >= 0x7c00 { 112 << 23 } else { 0 };
        let sub = (em as f32 * (1.0 / 16_777_216.0)).to_bits();
        f32::from_bits(if em < 0x400 { sub } else { norm } | sign)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn hsum_ps(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Loads 32 bytes from `p[o..o + 32]`.
    ///
    /// # Safety
    /// `o + 32 <= p.len()`.
    #[inline(always)]
    pub(crate) unsafe fn ld256(p: &[u8], o: usize) -> __m256i {
        debug_assert!(o + 32 <= p.len());
        // SAFETY: caller guarantees the 32 bytes are inside `p`; the load is unaligned.
        unsafe { _mm256_loadu_si256(p.as_ptr().add(o).cast()) }
    }

    /// Loads 16 bytes from `p[o..o + 16]`.
    ///
    /// # Safety
    /// `o + 16 <= p.len()`.
    #[inline(always)]
    pub(crate) unsafe fn ld128(p: &[u8], o: usize) -> __m128i {
        debug_assert!(o + 16 <= p.len());
        // SAFETY: caller guarantees the 16 bytes are inside `p`; the load is unaligned.
        unsafe { _mm_loadu_si128(p.as_ptr().add(o).cast()) }
    }

    /// 16 packed bytes -> 32 nibbles: low nibbles in bytes 0..16, high nibbles in 16..32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn nibbles32(v: __m128i) -> __m256i {
        let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
        _mm256_and_si256(both, _mm256_set1_epi8(0xF))
    }

    /// Byte `i` of the result is 0xFF if bit `i` of `bits` is set, else 0.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn bits_to_bytes(bits: u32) -> __m256i {
        let v = _mm256_set1_epi32(bits as i32);
        let shuf = _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        );
        let bytes = _mm256_shuffle_epi8(v, shuf);
        let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn table16(t: &[i8; 16]) -> __m256i {
        // SAFETY: `t` is exactly 16 bytes.
        let v = unsafe { _mm_loadu_si128(t.as_ptr().cast()) };
        _mm256_set_m128i(v, v)
    }

    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn f32_f32(w: &[u8], x: &[u8]) -> f32 {
        let n = (w.len() / 4).min(x.len() / 4);
        let (wp, xp) = (w.as_ptr().cast::<f32>(), x.as_ptr().cast::<f32>());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads 8 f32 at `i + 8k < n`, inside both slices (unaligned loads).
        unsafe {
            while i + 32 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let o = i + 8 * k;
                    *a =
                        _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(
                    _mm256_loadu_ps(wp.add(i)),
                    _mm256_loadu_ps(xp.add(i)),
                    acc[0],
                );
                i += 8;
            }
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = f64::from(hsum_ps(v));
        for j in i..n {
            s += f64::from(
                f32::from_le_bytes([w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]])
                    * f32::from_le_bytes([x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]]),
            );
        }
        s as f32
    }

    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn f16_f16(w: &[u8], x: &[u8]) -> f32 {
        let n = (w.len() / 2).min(x.len() / 2);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: each `ld128` reads 8 halves at element `o`, with `o + 8 <= n`.
        unsafe {
            while i + 32 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let o = 2 * (i + 8 * k);
                    *a = _mm256_fmadd_ps(
                        _mm256_cvtph_ps(ld128(w, o)),
                        _mm256_cvtph_ps(ld128(x, o)),
                        *a,
                    );
                }
                i += 32;
            }
            while i + 8 <= n {
                let o = 2 * i;
                acc[0] = _mm256_fmadd_ps(
                    _mm256_cvtph_ps(ld128(w, o)),
                    _mm256_cvtph_ps(ld128(x, o)),
                    acc[0],
                );
                i += 8;
            }
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = f64::from(hsum_ps(v));
        for j in i..n {
            s += f64::from(f16c(w, 2 * j) * f16c(x, 2 * j));
        }
        s as f32
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn bf16x8(v: __m128i) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
    }

    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn bf16_bf16(w: &[u8], x: &[u8]) -> f32 {
        let n = (w.len() / 2).min(x.len() / 2);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: each `ld128` reads 8 bf16 at element `o`, with `o + 8 <= n`.
        unsafe {
            while i + 32 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let o = 2 * (i + 8 * k);
                    *a = _mm256_fmadd_ps(bf16x8(ld128(w, o)), bf16x8(ld128(x, o)), *a);
                }
                i += 32;
            }
            while i + 8 <= n {
                let o = 2 * i;
                acc[0] = _mm256_fmadd_ps(bf16x8(ld128(w, o)), bf16x8(ld128(x, o)), acc[0]);
                i += 8;
            }
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = f64::from(hsum_ps(v));
        for j in i..n {
            let a = bf16_bits_to_f32(u16::from_le_bytes([w[2 * j], w[2 * j + 1]]));
            let b = bf16_bits_to_f32(u16::from_le_bytes([x[2 * j], x[2 * j + 1]]));
            s += f64::from(a * b);
        }
        s as f32
    }

    /// The f16 fields at byte `off` of 8 consecutive `ts`-byte blocks in `bl`, widened.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn f16x8(bl: &[u8], ts: usize, off: usize) -> __m256 {
        let h = |k: usize| i16::from_le_bytes([bl[k * ts + off], bl[k * ts + off + 1]]);
        _mm256_cvtph_ps(_mm_set_epi16(
            h(7),
            h(6),
            h(5),
            h(4),
            h(3),
            h(2),
            h(1),
            h(0),
        ))
    }

    /// The E8M0 half-scales of 8 consecutive MXFP4 blocks in `bl`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn e8m0x8(bl: &[u8]) -> __m256 {
        let e: [f32; 8] = std::array::from_fn(|k| e8m0_to_f32_half(bl[k * 17]));
        // SAFETY: `e` is 8 f32.
        unsafe { _mm256_loadu_ps(e.as_ptr()) }
    }

    /// Shared loop of the 32-element formats: one weight row against `T` Q8_0 rows.
    /// `decode(block)` gives the 32 signed weight values (element order), `scale(block)` the
    /// weight scale as f32 and `scales8(8 blocks)` the weight scales of 8 consecutive blocks
    /// (vector conversion: scalar f16 conversions would dominate a 32-element block). Each
    /// activation row sees the same operation sequence whatever `T` is (bit-identical results).
    ///
    /// # Safety
    /// Requires AVX2, FMA and F16C; `decode` may read anywhere inside the block it is given.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0_family<const T: usize>(
        w: &[u8],
        xs: [&[u8]; T],
        ts: usize,
        decode: impl Fn(&[u8]) -> __m256i,
        scale: impl Fn(&[u8]) -> f32,
        scales8: impl Fn(&[u8]) -> __m256,
    ) -> [f32; T] {
        let nb = xs.iter().fold(w.len() / ts, |m, x| m.min(x.len() / 34));
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        let mut i = 0;
        while i + 8 <= nb {
            let dw = scales8(&w[i * ts..(i + 8) * ts]);
            let mut d = [_mm256_setzero_ps(); T];
            for (dt, x) in d.iter_mut().zip(xs.iter()) {
                *dt = _mm256_mul_ps(dw, f16x8(&x[i * 34..(i + 8) * 34], 34, 0));
            }
            for k in 0..8 {
                let wv = decode(&w[(i + k) * ts..(i + k + 1) * ts]);
                let aw = _mm256_sign_epi8(wv, wv);
                let kk = _mm256_set1_epi32(k as i32);
                for t in 0..T {
                    // SAFETY: qs is bytes 2..34 of the 34-byte Q8_0 block i + k < nb.
                    let yv = unsafe { ld256(xs[t], (i + k) * 34 + 2) };
                    let p = dot_i8_prepared(aw, wv, yv);
                    let dk = _mm256_permutevar8x32_ps(d[t], kk);
                    acc[t][k & 1] = _mm256_fmadd_ps(dk, _mm256_cvtepi32_ps(p), acc[t][k & 1]);
                }
            }
            i += 8;
        }
        while i < nb {
            let b = &w[i * ts..(i + 1) * ts];
            let wv = decode(b);
            let aw = _mm256_sign_epi8(wv, wv);
            for t in 0..T {
                let y = &xs[t][i * 34..(i + 1) * 34];
                // SAFETY: qs is bytes 2..34 of the block.
                let p = dot_i8_prepared(aw, wv, unsafe { ld256(y, 2) });
                let d = _mm256_set1_ps(scale(b) * f16c(y, 0));
                acc[t][0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[t][0]);
            }
            i += 1;
        }
        let mut out = [0f32; T];
        for (o, a) in out.iter_mut().zip(acc.iter()) {
            *o = hsum_ps(_mm256_add_ps(a[0], a[1]));
        }
        out
    }

    /// Signed int8 x signed int8 dot, summed to 8 x i32, with `aw = |w|` precomputed. `x`
    /// must not contain -128 where `w` is negative (our activation quantisers never produce
    /// -128); pair sums fit i16 (|w| <= 128, |x| <= 127).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_i8_prepared(aw: __m256i, w: __m256i, x: __m256i) -> __m256i {
        let sx = _mm256_sign_epi8(x, w);
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1))
    }

    /// Defines the 1-row and 4-row entry points of a 32-element format.
    macro_rules! q8_entry {
        ($one:ident, $four:ident, $ts:expr, $decode:expr, $scale:expr, $scales8:expr) => {
            /// # Safety
            /// Requires AVX2, FMA and F16C.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(crate) unsafe fn $one(w: &[u8], x: &[u8]) -> f32 {
                // SAFETY: features present (caller); the decoder's loads are inside its block
                // (see the note at the invocations).
                unsafe { q8_0_family::<1>(w, [x], $ts, $decode, $scale, $scales8)[0] }
            }

            /// # Safety
            /// Requires AVX2, FMA and F16C.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(crate) unsafe fn $four(w: &[u8], xs: [&[u8]; 4]) -> [f32; 4] {
                // SAFETY: as in the 1-row form.
                unsafe { q8_0_family::<4>(w, xs, $ts, $decode, $scale, $scales8) }
            }
        };
    }

    // Decoder loads: Q8_0 qs at 2..34, Q4_0/IQ4_NL qs at 2..18, Q5_0 qs at 6..22, MXFP4 qs at
    // 1..17 -- all inside the block slice the decoder is given.
    q8_entry!(
        q8_0_q8_0,
        q8_0_q8_0_x4,
        34,
        |b: &[u8]| ld256(b, 2),
        |b: &[u8]| f16c(b, 0),
        |bl: &[u8]| { f16x8(bl, 34, 0) }
    );
    q8_entry!(
        q4_0_q8_0,
        q4_0_q8_0_x4,
        18,
        |b: &[u8]| _mm256_sub_epi8(nibbles32(ld128(b, 2)), _mm256_set1_epi8(8)),
        |b: &[u8]| f16c(b, 0),
        |bl: &[u8]| f16x8(bl, 18, 0)
    );
    q8_entry!(
        q5_0_q8_0,
        q5_0_q8_0_x4,
        22,
        |b: &[u8]| {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let q = nibbles32(ld128(b, 6));
            // nibble | 0xF0 where the 5th bit is clear == nibble - 16 as i8.
            _mm256_or_si256(
                q,
                _mm256_andnot_si256(bits_to_bytes(qh), _mm256_set1_epi8(0xF0u8 as i8)),
            )
        },
        |b: &[u8]| f16c(b, 0),
        |bl: &[u8]| f16x8(bl, 22, 0)
    );
    q8_entry!(
        iq4_nl_q8_0,
        iq4_nl_q8_0_x4,
        18,
        |b: &[u8]| _mm256_shuffle_epi8(table16(&KVALUES_IQ4NL), nibbles32(ld128(b, 2))),
        |b: &[u8]| f16c(b, 0),
        |bl: &[u8]| f16x8(bl, 18, 0)
    );
    q8_entry!(
        mxfp4_q8_0,
        mxfp4_q8_0_x4,
        17,
        |b: &[u8]| _mm256_shuffle_epi8(table16(&KVALUES_MXFP4), nibbles32(ld128(b, 1))),
        |b: &[u8]| e8m0_to_f32_half(b[0]),
        |bl: &[u8]| e8m0x8(bl)
    );

    /// Q8_K block: `(d, mins-weighted bsums helper input)`; returns bsums as i32.
    #[inline(always)]
    pub(crate) fn bsums(y: &[u8]) -> [i32; 16] {
        let mut o = [0i32; 16];
        for (g, v) in o.iter_mut().enumerate() {
            *v = i32::from(i16::from_le_bytes([y[260 + 2 * g], y[261 + 2 * g]]));
        }
        o
    }

    #[inline(always)]
    pub(crate) fn yd(y: &[u8]) -> f32 {
        f32::from_le_bytes([y[0], y[1], y[2], y[3]])
    }

    /// Q4_K against `T` Q8_K rows; per row the operation sequence does not depend on `T`.
    ///
    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4k<const T: usize>(w: &[u8], xs: [&[u8]; T]) -> [f32; T] {
        let nb = xs.iter().fold(w.len() / 144, |m, x| m.min(x.len() / 292));
        let m4 = _mm256_set1_epi8(0xF);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut summ = [0.0f32; T];
        for i in 0..nb {
            let b = &w[i * 144..(i + 1) * 144];
            let (sc, mn) = scale_min_k4(&b[4..16]);
            let mut sumi = [_mm256_setzero_si256(); T];
            for c in 0..4 {
                // SAFETY: 16 + 32c + 32 <= 144.
                let q4 = unsafe { ld256(b, 16 + 32 * c) };
                let lo = _mm256_and_si256(q4, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
                let (slo, shi) = (
                    _mm256_set1_epi16(i16::from(sc[2 * c])),
                    _mm256_set1_epi16(i16::from(sc[2 * c + 1])),
                );
                for t in 0..T {
                    let y = &xs[t][i * 292..(i + 1) * 292];
                    // SAFETY: 4 + 64c + 64 <= 260 <= 292.
                    let (ylo, yhi) = unsafe { (ld256(y, 4 + 64 * c), ld256(y, 36 + 64 * c)) };
                    let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ylo), slo);
                    let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, yhi), shi);
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(plo, phi));
                }
            }
            let (d, dmin) = (f16c(b, 0), f16c(b, 2));
            for t in 0..T {
                let y = &xs[t][i * 292..(i + 1) * 292];
                let bs = bsums(y);
                let msum: i32 = (0..8)
                    .map(|j| i32::from(mn[j]) * (bs[2 * j] + bs[2 * j + 1]))
                    .sum();
                let yd = yd(y);
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(d * yd), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
                summ[t] += (dmin * yd) * msum as f32;
            }
        }
        let mut out = [0f32; T];
        for t in 0..T {
            out[t] = hsum_ps(acc[t]) - summ[t];
        }
        out
    }

    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: features present (caller).
        unsafe { q4k::<1>(w, [x])[0] }
    }

    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn q4_k_q8_k_x4(w: &[u8], xs: [&[u8]; 4]) -> [f32; 4] {
        // SAFETY: features present (caller).
        unsafe { q4k::<4>(w, xs) }
    }

    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn q5_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
        let nb = (w.len() / 176).min(x.len() / 292);
        let m4 = _mm256_set1_epi8(0xF);
        let one = _mm256_set1_epi8(1);
        let mut acc = _mm256_setzero_ps();
        let mut summ = 0.0f32;
        for i in 0..nb {
            let b = &w[i * 176..(i + 1) * 176];
            let y = &x[i * 292..(i + 1) * 292];
            let (sc, mn) = scale_min_k4(&b[4..16]);
            let bs = bsums(y);
            let msum: i32 = (0..8)
                .map(|j| i32::from(mn[j]) * (bs[2 * j] + bs[2 * j + 1]))
                .sum();
            let mut sumi = _mm256_setzero_si256();
            // SAFETY: qh is bytes 16..48 of the 176-byte block.
            let mut qh = unsafe { ld256(b, 16) };
            for c in 0..4 {
                // SAFETY: 48 + 32c + 32 <= 176 and 36 + 64c + 32 <= 260.
                let (q5, ylo, yhi) = unsafe {
                    (
                        ld256(b, 48 + 32 * c),
                        ld256(y, 4 + 64 * c),
                        ld256(y, 36 + 64 * c),
                    )
                };
                let hlo = _mm256_slli_epi16(_mm256_and_si256(qh, one), 4);
                let hhi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4);
                qh = _mm256_srli_epi16(qh, 2);
                let lo = _mm256_or_si256(_mm256_and_si256(q5, m4), hlo);
                let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q5, 4), m4), hhi);
                let plo = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(lo, ylo),
                    _mm256_set1_epi16(i16::from(sc[2 * c])),
                );
                let phi = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(hi, yhi),
                    _mm256_set1_epi16(i16::from(sc[2 * c + 1])),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(plo, phi));
            }
            let yd = yd(y);
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(f16c(b, 0) * yd),
                _mm256_cvtepi32_ps(sumi),
                acc,
            );
            summ += (f16c(b, 2) * yd) * msum as f32;
        }
        hsum_ps(acc) - summ
    }

    /// Q6_K against `T` Q8_K rows; per row the operation sequence does not depend on `T`.
    ///
    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6k<const T: usize>(w: &[u8], xs: [&[u8]; T]) -> [f32; T] {
        let nb = xs.iter().fold(w.len() / 210, |m, x| m.min(x.len() / 292));
        let m4 = _mm256_set1_epi8(0xF);
        let m2 = _mm256_set1_epi8(3);
        let mut acc = [_mm256_setzero_ps(); T];
        for i in 0..nb {
            let b = &w[i * 210..(i + 1) * 210];
            let sc: [i8; 16] = std::array::from_fn(|g| b[192 + g] as i8);
            let mut sumi = [_mm256_setzero_si256(); T];
            for h in 0..2 {
                // SAFETY: ql at 64h..64h+64 and qh at 128+32h..+32 are inside the 210 bytes.
                let (ql0, ql1, qh) = unsafe {
                    (
                        ld256(b, 64 * h),
                        ld256(b, 64 * h + 32),
                        ld256(b, 128 + 32 * h),
                    )
                };
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4),
                    ),
                ];
                for (k, qk) in q.iter().enumerate() {
                    let g = 8 * h + 2 * k;
                    let s16 = _mm256_set_m128i(
                        _mm_set1_epi16(i16::from(sc[g + 1])),
                        _mm_set1_epi16(i16::from(sc[g])),
                    );
                    for t in 0..T {
                        // SAFETY: q8 offset 4 + 128h + 32k + 32 <= 260.
                        let yv =
                            unsafe { ld256(&xs[t][i * 292..(i + 1) * 292], 4 + 128 * h + 32 * k) };
                        sumi[t] = _mm256_add_epi32(
                            sumi[t],
                            _mm256_madd_epi16(_mm256_maddubs_epi16(*qk, yv), s16),
                        );
                    }
                }
            }
            let dw = f16c(b, 208);
            for t in 0..T {
                let y = &xs[t][i * 292..(i + 1) * 292];
                let bs = bsums(y);
                // The stored values are q + 32; subtract 32 * sum(sc * bsums).
                let offs: i32 = (0..16).map(|g| i32::from(sc[g]) * bs[g]).sum();
                let si =
                    _mm256_sub_epi32(sumi[t], _mm256_setr_epi32(32 * offs, 0, 0, 0, 0, 0, 0, 0));
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(dw * yd(y)), _mm256_cvtepi32_ps(si), acc[t]);
            }
        }
        let mut out = [0f32; T];
        for t in 0..T {
            out[t] = hsum_ps(acc[t]);
        }
        out
    }

    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn q6_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: features present (caller).
        unsafe { q6k::<1>(w, [x])[0] }
    }

    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn q6_k_q8_k_x4(w: &[u8], xs: [&[u8]; 4]) -> [f32; 4] {
        // SAFETY: features present (caller).
        unsafe { q6k::<4>(w, xs) }
    }

    /// # Safety
    /// Requires AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn iq4_xs_q8_k(w: &[u8], x: &[u8]) -> f32 {
        let nb = (w.len() / 136).min(x.len() / 292);
        let t = table16(&KVALUES_IQ4NL);
        let mut acc = _mm256_setzero_ps();
        for i in 0..nb {
            let b = &w[i * 136..(i + 1) * 136];
            let y = &x[i * 292..(i + 1) * 292];
            let scales_h = u16::from_le_bytes([b[2], b[3]]);
            let mut sumi = _mm256_setzero_si256();
            for ib in 0..8 {
                let ls = crate::quant::blocks::iq4xs_scale(scales_h, &b[4..8], ib);
                // SAFETY: qs at 8 + 16ib + 16 <= 136; q8 at 4 + 32ib + 32 <= 260.
                let (q, yv) = unsafe { (ld128(b, 8 + 16 * ib), ld256(y, 4 + 32 * ib)) };
                let v = _mm256_shuffle_epi8(t, nibbles32(q));
                let p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(yv, v));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16(ls as i16)));
            }
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(f16c(b, 0) * yd(y)),
                _mm256_cvtepi32_ps(sumi),
                acc,
            );
        }
        hsum_ps(acc)
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    #[test]
    fn software_f16_conversion_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = super::imp::f16c(&h.to_le_bytes(), 0);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#x}: {got} vs {want}"
            );
        }
    }
}
