//! AVX-512 dot products (F/BW/VL/DQ), each also instantiated with VNNI (`vpdpbusd` for
//! u8 x i8 sums, `vpdpwssd` for the i16 x scale accumulation). Integer parts are exact; only the
//! float accumulation order differs from the scalar twins.
//!
//! The kernel bodies are written once in macros and instantiated per feature set, so that every
//! helper is inlined into a function compiled with the same target features. Every kernel
//! processes `min(w blocks, x blocks)` whole blocks and reads only inside its slices; every
//! `unsafe fn` here requires the features of its level, which [`kernel`]'s caller
//! (`DotKernel`) guarantees by runtime detection.

use super::SimdLevel;
use kapitsa_base::GgmlType;

type DotFn = unsafe fn(&[u8], &[u8]) -> f32;
type Dot4Fn = unsafe fn(&[u8], [&[u8]; 4]) -> [f32; 4];

/// An AVX-512 kernel: its level, the 1-row form and (for the quantised formats) the 4-row form.
pub(super) type Chosen = (SimdLevel, DotFn, Option<Dot4Fn>);

/// The AVX-512 kernel for `ty` at the best level `<= max`.
#[cfg(target_arch = "x86_64")]
pub(super) fn kernel(ty: GgmlType, max: SimdLevel, _bf16: bool) -> Option<Chosen> {
    use imp::*;
    use GgmlType as T;
    if max < SimdLevel::Avx512 {
        return None;
    }
    let vnni = max >= SimdLevel::Avx512Vnni;
    let plain: Option<(DotFn, Option<Dot4Fn>)> = match ty {
        T::F32 => Some((f32_f32, Some(f32_f32_x4))),
        T::F16 => Some((f16_f16, None)),
        T::BF16 => Some((bf16_bf16, None)),
        _ => None,
    };
    if let Some((f, f4)) = plain {
        return Some((SimdLevel::Avx512, f, f4));
    }
    macro_rules! pick {
        ($one:ident, $four:ident) => {
            if vnni {
                (
                    SimdLevel::Avx512Vnni,
                    vn::$one as DotFn,
                    Some(vn::$four as Dot4Fn),
                )
            } else {
                (
                    SimdLevel::Avx512,
                    bw::$one as DotFn,
                    Some(bw::$four as Dot4Fn),
                )
            }
        };
    }
    Some(match ty {
        T::Q8_0 => pick!(q8_0_q8_0, q8_0_q8_0_x4),
        T::Q4_0 => pick!(q4_0_q8_0, q4_0_q8_0_x4),
        T::Q5_0 => pick!(q5_0_q8_0, q5_0_q8_0_x4),
        T::IQ4_NL => pick!(iq4_nl_q8_0, iq4_nl_q8_0_x4),
        T::MXFP4 => pick!(mxfp4_q8_0, mxfp4_q8_0_x4),
        T::Q4_K => pick!(q4_k_q8_k, q4_k_q8_k_x4),
        T::Q5_K => pick!(q5_k_q8_k, q5_k_q8_k_x4),
        T::Q6_K => pick!(q6_k_q8_k, q6_k_q8_k_x4),
        _ => return None,
    })
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn kernel(_ty: GgmlType, _max: SimdLevel, _bf16: bool) -> Option<Chosen> {
    None
}

/// Helpers the AVX-512 GEMM kernels share with the dot products.
#[cfg(target_arch = "x86_64")]
pub(super) use imp::{
    hsum_epi32, k4_scales, ld512, prefetch_ahead, q5_0_plus16, q6k_sidx, reduce_lanes8, sb_pack,
    sb_reduce8, vpdpwssd,
};
/// The super-block-order K-format dot kernels (see `dot_sb`).
#[cfg(target_arch = "x86_64")]
pub(super) use imp::{q4_k_sb, q5_k_sb, q6_k_sb};

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    use crate::quant::blocks::{e8m0_to_f32_half, KVALUES_IQ4NL, KVALUES_MXFP4};
    use crate::quant::dot_avx2::{e8m0x8, f16c, f16x8, ld128, ld256, nibbles32, yd};

    /// Loads 64 bytes from `p[o..o + 64]`.
    ///
    /// # Safety
    /// `o + 64 <= p.len()`; AVX-512F.
    #[inline(always)]
    pub(in crate::quant) unsafe fn ld512(p: &[u8], o: usize) -> __m512i {
        debug_assert!(o + 64 <= p.len());
        // SAFETY: caller guarantees the 64 bytes are inside `p`; the load is unaligned.
        unsafe { _mm512_loadu_si512(p.as_ptr().add(o).cast()) }
    }

    /// How far ahead of the block being read the kernels prefetch weights into L2
    /// (`PF_FAR`) and into L1 (`PF_NEAR`, from L2 by then). Rows of a matrix are contiguous, so
    /// this runs ahead across rows too. The hardware prefetcher alone does not keep one
    /// streaming GEMV fed on this VM. Measured on the 1.5B's decode, 1 thread: no software
    /// prefetch 9.1 t/s; L1 only at 1, 2, 3, 4 KiB: 10.8, 11.3, 11.7, 11.4; and on a GEMV of
    /// the 151936 x 1536 Q6_K head (`gemm_bench`, 1 thread): L1 at 3 KiB 20.9 ms, L2 at 4-32
    /// KiB 16.4-17.1 ms, L2 at 6 KiB plus L1 at 1 KiB 15.9 ms, which also gave the 1.5B's
    /// decode +5-9% and left the MoE files unchanged.
    const PF_FAR: usize = 6144;
    const PF_NEAR: usize = 1024;

    /// Whether the 32-element formats' dot kernels prefetch their weights ([`prefetch_ahead`]):
    /// not on AMD Zen 4 (`CpuFeatures::zen4`), where it made them slower: decode of the synthetic Nemotron 3 Nano (Q8_0 head, Q5_0
    /// experts) on a 2-core EPYC went from 34.5-35.1 to 46.0-46.7 t/s without it, while the K
    /// formats' kernels there still gain from theirs (BENCHMARKS.md). `KAPITSA_Q8_PREFETCH=1`
    /// or `0` overrides. A hint only: results are the same either way.
    pub(in crate::quant) fn q8_prefetch() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| match std::env::var("KAPITSA_Q8_PREFETCH").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => !kapitsa_base::CpuFeatures::get().zen4,
        })
    }

    /// Prefetches each cache line that starts within `PF_FAR..PF_FAR + len` bytes after `p`
    /// into L2, and the line `PF_FAR - PF_NEAR` bytes before each into L1: called once per
    /// `len` bytes of a weight stream, this asks for every line exactly once at each level.
    /// A hint: it never faults (the address may be past the end of the weights), and it
    /// changes no result.
    #[inline(always)]
    pub(in crate::quant) fn prefetch_ahead(p: *const u8, len: usize) {
        let a = (p as usize).wrapping_add(PF_FAR);
        let mut l = a.next_multiple_of(64);
        while l < a.wrapping_add(len) {
            // SAFETY: prefetching is a hint that never dereferences or faults, whatever the
            // address; SSE is baseline on x86-64.
            unsafe {
                _mm_prefetch::<_MM_HINT_T1>(l as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(l.wrapping_sub(PF_FAR - PF_NEAR) as *const i8);
            }
            l += 64;
        }
    }

    /// `acc` + pairwise i16 products as 16 x i32, as one `vpdpwssd` instruction. Inline
    /// assembly because LLVM's generic x86-64 tuning splits the intrinsic into `vpmaddwd` +
    /// `vpaddd`: two uops instead of one on the port pair the GEMM and the decode GEMV of the
    /// K formats saturate (the same exact integers).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(in crate::quant) fn vpdpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        let mut r = acc;
        // SAFETY: one register-only AVX-512 VNNI instruction (no memory, stack or flags use);
        // this function is compiled with, and only callable from code that has, that feature.
        unsafe {
            std::arch::asm!(
                "vpdpwssd {r}, {a}, {b}",
                r = inout(zmm_reg) r,
                a = in(zmm_reg) a,
                b = in(zmm_reg) b,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
        r
    }

    /// A Q5_0 block's 32 values plus 16, as unsigned bytes (0..31): the nibble with the
    /// block's 5th bit (`qh` bit `i` belongs to element `i`) as bit 4.
    ///
    /// # Safety
    /// Requires AVX-512F/BW/VL and AVX2; `b` is one whole 22-byte block.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn q5_0_plus16(b: &[u8]) -> __m256i {
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        // SAFETY: the quants are bytes 6..22 of the block (caller).
        let q = nibbles32(unsafe { ld128(b, 6) });
        // q | (high bit & 0x10)
        _mm256_ternarylogic_epi32::<0xF8>(q, _mm256_movm_epi8(qh), _mm256_set1_epi8(0x10))
    }

    /// The Q4_K/Q5_K 12-byte scale field as 16 bytes: 8 scales then 8 mins (6 bits each).
    #[inline(always)]
    pub(in crate::quant) fn k4_scales(s: &[u8]) -> [u32; 4] {
        const M1: u32 = 0x3f3f_3f3f;
        const M2: u32 = 0x0f0f_0f0f;
        const M3: u32 = 0x0303_0303;
        let a = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let b = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
        let c = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
        // scales 0..4 = a & 63; scales 4..8 = low nibbles of c | top bits of a;
        // mins 0..4 = b & 63; mins 4..8 = high nibbles of c | top bits of b.
        [
            a & M1,
            (c & M2) | (((a >> 6) & M3) << 4),
            b & M1,
            ((c >> 4) & M2) | (((b >> 6) & M3) << 4),
        ]
    }

    /// The 8-lane fold of 16 lane sums: lane `l` = lanes `l` and `l + 8` (exact integers).
    /// ggml's AVX2 K-format kernels keep 8 lanes, lane `l` holding bytes `4l..4l+4` of every
    /// 32-byte chunk; our 512-bit kernels hold the chunk pairs' halves in lanes `l` and `l + 8`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2")]
    pub(in crate::quant) fn fold8(v: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
    }

    /// Two blocks of a 32-element format into ggml's 8-lane chain, first block first:
    /// `acc = fma(d_lo, lanes_lo, acc)`, then `fma(d_hi, lanes_hi, acc)`, where `p` holds the
    /// two blocks' exact lane sums (lanes 0..8 and 8..16, lane `l` the bytes `4l..4l+4`) and
    /// `d` their scale products (`ggml_vec_dot_q8_0_q8_0` and relatives, AVX2 path).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(in crate::quant) fn chain2(d: __m512, p: __m512i, acc: __m256) -> __m256 {
        let pf = _mm512_cvtepi32_ps(p);
        let acc = _mm256_fmadd_ps(_mm512_castps512_ps256(d), _mm512_castps512_ps256(pf), acc);
        _mm256_fmadd_ps(
            _mm512_extractf32x8_ps::<1>(d),
            _mm512_extractf32x8_ps::<1>(pf),
            acc,
        )
    }

    /// Sum of 8 i32 lanes (exact).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::quant) fn hsum_epi32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)))
    }

    /// ggml's reduction of its 4-lane Q4_K mins accumulator: `(m0 + m2) + (m1 + m3)`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::quant) fn hsum4(m: __m128) -> f32 {
        let s = _mm_add_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// `_mm512_permutexvar_epi16` indices spreading Q6_K's 16 scales (as i16) over its four
    /// 64-element pieces: 128-bit lane `k` of piece `p` (16 elements) gets scale `4p + k`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::quant) fn q6k_sidx() -> [__m512i; 4] {
        std::array::from_fn(|p| {
            let g = 4 * p as i64;
            let lane = |k: i64| (g + k) * 0x0001_0001_0001_0001;
            _mm512_set_epi64(
                lane(3),
                lane(3),
                lane(2),
                lane(2),
                lane(1),
                lane(1),
                lane(0),
                lane(0),
            )
        })
    }

    /// One super-block's integers for the super-block order, packed for [`sb_reduce8`]: the
    /// 8-lane fold of the main lane sums `sumi` (`T` is the sum of lanes 0..8) and the 8 lanes
    /// `m` of the min / offset term (`M` is the sum of lanes 8..16).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(in crate::quant) fn sb_pack(sumi: __m512i, m: __m256i) -> __m512i {
        let s8 = _mm256_add_epi32(
            _mm512_castsi512_si256(sumi),
            _mm512_extracti64x4_epi64::<1>(sumi),
        );
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(s8), m)
    }

    /// The first two levels of a transposing add tree over 8 vectors of i32: per 128-bit
    /// lane `L`, `p` = [sum of lane L of u0, of u1, of u2, of u3] and `q` the same of u4..u7.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::quant) fn reduce_lanes8(u: &[__m512i; 8]) -> (__m512i, __m512i) {
        let h = |a: __m512i, b: __m512i| {
            _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
        };
        let g = |a: __m512i, b: __m512i| {
            _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
        };
        (
            g(h(u[0], u[1]), h(u[2], u[3])),
            g(h(u[4], u[5]), h(u[6], u[7])),
        )
    }

    /// The integers `T` and `M` of 8 packed super-blocks ([`sb_pack`]), lane `j` from `u[j]`:
    /// one transposing add tree (integer sums are exact in any order).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(in crate::quant) fn sb_reduce8(u: &[__m512i; 8]) -> (__m256i, __m256i) {
        // Lanes 0, 1 of each 128-bit lane hold T parts, lanes 2, 3 M parts.
        let (p, q) = reduce_lanes8(u);
        // [T0..4, M0..4, T4..8, M4..8]
        let r = _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0x88>(p, q),
            _mm512_shuffle_i32x4::<0xDD>(p, q),
        );
        let ti = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0);
        let mi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
        (
            _mm512_castsi512_si256(_mm512_permutexvar_epi32(ti, r)),
            _mm512_castsi512_si256(_mm512_permutexvar_epi32(mi, r)),
        )
    }

    /// Up to 8 super-blocks of one row awaiting their reduction in the super-block order:
    /// `u` from `sb_pack`, `f` the scale products `(d * yd, dmin * yd)`.
    #[derive(Clone, Copy)]
    struct SbBatch {
        u: [__m512i; 8],
        f: [(f32, f32); 8],
    }

    impl Default for SbBatch {
        fn default() -> Self {
            // SAFETY: all-zero bits are a valid `__m512i` (plain integer lanes) and f32 pair.
            unsafe { std::mem::zeroed() }
        }
    }

    macro_rules! avx512_kernels {
        ($m:ident, $feat:literal, $bdot:path, $wacc:path, $ggml_chain:literal) => {
            pub(super) mod $m {
                use super::*;
                use $bdot as bdot;
                use $wacc as wacc;

                /// The kernels sum in ggml's order (`ggml_vec_dot_*` of its AVX2 build): the
                /// K formats in 8 lanes with ggml's mins/offset steps, the 32-element formats
                /// in one 8-lane chain per row ([`chain2`]). Otherwise (the VNNI kernels, and
                /// the VNNI GEMM that reproduces them) the K formats keep 16 lanes and the
                /// 32-element formats two 16-lane accumulators of block pairs: fewer
                /// operations per block, and no serial chain (measured 10-28% faster). The
                /// plain AVX-512 level is the one `CpuBackend::llama_cpp_compatible` uses.
                const GGML_CHAIN: bool = $ggml_chain;

                #[inline]
                #[target_feature(enable = $feat)]
                fn join(lo: __m256i, hi: __m256i) -> __m512i {
                    _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
                }

                /// Signed weights prepared for `bdot`: |w| and the lanes where w < 0.
                #[inline]
                #[target_feature(enable = $feat)]
                fn sprep(w: __m512i) -> (__m512i, __mmask64) {
                    (_mm512_abs_epi8(w), _mm512_movepi8_mask(w))
                }

                /// Signed i8 x i8 dot in groups of 4, from `sprep(w)` (x must not be -128 where
                /// w < 0; our activation quantisers never produce -128).
                #[inline]
                #[target_feature(enable = $feat)]
                fn sdot(aw: __m512i, neg: __mmask64, x: __m512i) -> __m512i {
                    bdot(aw, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x))
                }

                /// Weights prepared for [`wdot`]: signed ones as `sprep` makes them;
                /// unsigned ones (`U16`: the format's values plus 16, 0..31) as they are.
                #[inline]
                #[target_feature(enable = $feat)]
                fn wprep<const U16: bool>(w: __m512i) -> (__m512i, __mmask64) {
                    if U16 {
                        (w, 0)
                    } else {
                        sprep(w)
                    }
                }

                /// The lane sums `sum4(w * x)` from [`wprep`]'s weights: for `U16`,
                /// `sum4(u * x) - sum4(16 * x)` with `u = w + 16` (exact: the same integers
                /// as the signed form, without its sign juggling).
                #[inline]
                #[target_feature(enable = $feat)]
                fn wdot<const U16: bool>(aw: __m512i, neg: __mmask64, x: __m512i) -> __m512i {
                    if U16 {
                        _mm512_sub_epi32(bdot(aw, x), bdot(_mm512_set1_epi8(16), x))
                    } else {
                        sdot(aw, neg, x)
                    }
                }

                /// `T` activation rows against one weight row of a 32-element format, two
                /// blocks per step; `decode` gives a block's 32 signed values (`U16`: its
                /// values plus 16, unsigned), `scale` one
                /// block's weight scale, `scales8` those of 8 consecutive blocks. The work for
                /// each activation row is exactly the same sequence of operations whatever `T`
                /// is, so results are bit-identical between the 1-row and multi-row forms.
                ///
                /// # Safety
                /// Requires the features of this module; `decode` reads only inside its block.
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn q8_family<const T: usize, const U16: bool>(
                    w: &[u8],
                    xs: [&[u8]; T],
                    ts: usize,
                    decode: impl Fn(&[u8]) -> __m256i,
                    scale: impl Fn(&[u8]) -> f32,
                    scales8: impl Fn(&[u8]) -> __m256,
                ) -> [f32; T] {
                    let nb = xs.iter().fold(w.len() / ts, |m, x| m.min(x.len() / 34));
                    let mut acc = [[_mm512_setzero_ps(); 2]; T];
                    let mut chain = [_mm256_setzero_ps(); T];
                    // lanes 0..8 <- scale 2j, lanes 8..16 <- scale 2j + 1
                    let idx: [__m512i; 4] = std::array::from_fn(|j| {
                        join(_mm256_set1_epi32(2 * j as i32), _mm256_set1_epi32(2 * j as i32 + 1))
                    });
                    let prefetch = q8_prefetch();
                    let mut i = 0;
                    while i + 8 <= nb {
                        if prefetch {
                            prefetch_ahead(w[i * ts..].as_ptr(), 8 * ts);
                        }
                        let dw = scales8(&w[i * ts..(i + 8) * ts]);
                        // (explicit loops, not `array::from_fn`: its closure is not always inlined
                        // into this target-feature function)
                        let mut wv = [(_mm512_setzero_si512(), 0 as __mmask64); 4];
                        for (j, v) in wv.iter_mut().enumerate() {
                            let k = i + 2 * j;
                            *v = wprep::<U16>(join(decode(&w[k * ts..(k + 1) * ts]), decode(&w[(k + 1) * ts..(k + 2) * ts])));
                        }
                        for (t, (x, a)) in xs.iter().zip(acc.iter_mut()).enumerate() {
                            let d = _mm512_castps256_ps512(_mm256_mul_ps(dw, f16x8(&x[i * 34..(i + 8) * 34], 34, 0)));
                            for (j, ix) in idx.iter().enumerate() {
                                let k = i + 2 * j;
                                // SAFETY: qs is bytes 2..34 of the Q8_0 blocks k, k + 1 < nb.
                                let xv = unsafe { join(ld256(x, k * 34 + 2), ld256(x, k * 34 + 36)) };
                                let p = wdot::<U16>(wv[j].0, wv[j].1, xv);
                                let dk = _mm512_permutexvar_ps(*ix, d);
                                if GGML_CHAIN {
                                    chain[t] = chain2(dk, p, chain[t]);
                                } else {
                                    a[j & 1] = _mm512_fmadd_ps(dk, _mm512_cvtepi32_ps(p), a[j & 1]);
                                }
                            }
                        }
                        i += 8;
                    }
                    // The last `nb % 8` blocks: pairs as in the loop above, continuing its
                    // alternation of the two accumulators (pair p of the row goes to
                    // `a[p & 1]`); an odd last block is a pair whose second half is zero, which
                    // adds exactly 0 to its lanes. (The tiled GEMM pads the row to a whole
                    // group with zero blocks and gets the same operations.)
                    let mut pair = 0;
                    while i < nb {
                        let two = i + 1 < nb;
                        let b0 = &w[i * ts..(i + 1) * ts];
                        let (w1, s1) = if two {
                            let b1 = &w[(i + 1) * ts..(i + 2) * ts];
                            (decode(b1), scale(b1))
                        } else {
                            (_mm256_setzero_si256(), 0.0)
                        };
                        // (U16: the padding half's lanes meet x = 0 and are 0 either way)
                        let (aw, neg) = wprep::<U16>(join(decode(b0), w1));
                        let s0 = scale(b0);
                        for (t, (x, a)) in xs.iter().zip(acc.iter_mut()).enumerate() {
                            // SAFETY: qs is bytes 2..34 of the Q8_0 blocks i (and i + 1 if
                            // `two`), both < nb.
                            let (x0, x1) = unsafe {
                                (ld256(x, i * 34 + 2), if two { ld256(x, i * 34 + 36) } else { _mm256_setzero_si256() })
                            };
                            let d1 = if two { s1 * f16c(x, i * 34 + 34) } else { 0.0 };
                            let dk = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(s0 * f16c(x, i * 34))), _mm256_set1_ps(d1), 1);
                            let p = wdot::<U16>(aw, neg, join(x0, x1));
                            if GGML_CHAIN {
                                chain[t] = chain2(dk, p, chain[t]);
                            } else {
                                a[pair & 1] = _mm512_fmadd_ps(dk, _mm512_cvtepi32_ps(p), a[pair & 1]);
                            }
                        }
                        i += 2;
                        pair += 1;
                    }
                    std::array::from_fn(|t| {
                        if GGML_CHAIN {
                            crate::quant::dot_avx2::hsum_ps(chain[t])
                        } else {
                            _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]))
                        }
                    })
                }

                #[inline]
                #[target_feature(enable = $feat)]
                fn table(t: &[i8; 16]) -> __m256i {
                    // SAFETY: `t` is exactly 16 bytes.
                    let v = unsafe { _mm_loadu_si128(t.as_ptr().cast()) };
                    _mm256_set_m128i(v, v)
                }

                /// Defines the 1-row and 4-row entry points of a 32-element format.
                macro_rules! q8_entry {
                    ($one:ident, $four:ident, $u16:literal, $ts:expr, |$b:ident| $decode:expr, $scale:expr, $scales8:expr) => {
                        /// # Safety
                        /// Requires the features of this module.
                        #[target_feature(enable = $feat)]
                        pub(crate) unsafe fn $one(w: &[u8], x: &[u8]) -> f32 {
                            // SAFETY: features present; the decoder's loads are inside its block
                            // (see the SAFETY note at the invocations).
                            unsafe { q8_family::<1, $u16>(w, [x], $ts, |$b: &[u8]| $decode, $scale, $scales8)[0] }
                        }

                        /// # Safety
                        /// Requires the features of this module.
                        #[target_feature(enable = $feat)]
                        pub(crate) unsafe fn $four(w: &[u8], xs: [&[u8]; 4]) -> [f32; 4] {
                            // SAFETY: as in the 1-row form.
                            unsafe { q8_family::<4, $u16>(w, xs, $ts, |$b: &[u8]| $decode, $scale, $scales8) }
                        }
                    };
                }

                // SAFETY (each decoder): `ld128`/`ld256` read the quant bytes inside the block
                // (Q8_0 qs at 2..34, Q4_0/IQ4_NL qs at 2..18, Q5_0 qs at 6..22, MXFP4 at 1..17).
                q8_entry!(q8_0_q8_0, q8_0_q8_0_x4, false, 34, |b| ld256(b, 2),
                    |b: &[u8]| f16c(b, 0), |bl: &[u8]| f16x8(bl, 34, 0));
                q8_entry!(q4_0_q8_0, q4_0_q8_0_x4, false, 18,
                    |b| _mm256_sub_epi8(nibbles32(ld128(b, 2)), _mm256_set1_epi8(8)),
                    |b: &[u8]| f16c(b, 0), |bl: &[u8]| f16x8(bl, 18, 0));
                q8_entry!(q5_0_q8_0, q5_0_q8_0_x4, true, 22,
                    |b| q5_0_plus16(b),
                    |b: &[u8]| f16c(b, 0), |bl: &[u8]| f16x8(bl, 22, 0));
                q8_entry!(iq4_nl_q8_0, iq4_nl_q8_0_x4, false, 18,
                    |b| _mm256_shuffle_epi8(table(&KVALUES_IQ4NL), nibbles32(ld128(b, 2))),
                    |b: &[u8]| f16c(b, 0), |bl: &[u8]| f16x8(bl, 18, 0));
                q8_entry!(mxfp4_q8_0, mxfp4_q8_0_x4, false, 17,
                    |b| _mm256_shuffle_epi8(table(&KVALUES_MXFP4), nibbles32(ld128(b, 1))),
                    |b: &[u8]| e8m0_to_f32_half(b[0]), |bl: &[u8]| e8m0x8(bl));

                /// Reduces the first `n` packed super-blocks of `b` to their integers
                /// ([`sb_reduce8`]) and continues the f32 chain `acc` over them in order:
                /// `acc = fma(f.0, T, acc)`, then, for Q4_K/Q5_K, `acc = fma(-f.1, M, acc)`; for
                /// Q6_K (`q6`) the integer is `T - 32 M` and there is no second step.
                #[inline]
                #[target_feature(enable = $feat)]
                fn sb_flush(b: &SbBatch, n: usize, q6: bool, acc: &mut f32) {
                    let (t, m) = sb_reduce8(&b.u);
                    let (mut tv, mut mv) = ([0i32; 8], [0i32; 8]);
                    // SAFETY: `tv` and `mv` hold 8 i32 each.
                    unsafe {
                        _mm256_storeu_si256(tv.as_mut_ptr().cast(), t);
                        _mm256_storeu_si256(mv.as_mut_ptr().cast(), m);
                    }
                    for (j, &(f, fm)) in b.f[..n].iter().enumerate() {
                        if q6 {
                            *acc = f.mul_add((tv[j] - 32 * mv[j]) as f32, *acc);
                        } else {
                            *acc = f.mul_add(tv[j] as f32, *acc);
                            *acc = (-fm).mul_add(mv[j] as f32, *acc);
                        }
                    }
                }

                /// A Q4_K/Q5_K block decoded for the integer part: the unsigned quants of each
                /// 64-element chunk `c` (`wv[c]`), the chunk's two sub-block scales as i16 pairs
                /// (`sv[c]`), the mins as i16 multipliers of the Q8_K `bsums`, and the scales.
                #[derive(Clone, Copy)]
                struct K45W {
                    wv: [__m512i; 4],
                    sv: [__m512i; 4],
                    mins2: __m256i,
                    d: f32,
                    dmin: f32,
                }

                /// Shuffle masks picking scale 2c (low 256) and 2c+1 (high 256) as i16.
                #[inline]
                #[target_feature(enable = $feat)]
                fn k45_smask() -> [__m512i; 4] {
                    std::array::from_fn(|c| {
                        let lo = (((4 * c + 1) << 8) | (4 * c)) as i16;
                        let hi = (((4 * c + 3) << 8) | (4 * c + 2)) as i16;
                        join(_mm256_set1_epi16(lo), _mm256_set1_epi16(hi))
                    })
                }

                /// Decodes one Q4_K (`Q5`: Q5_K) block `b`.
                ///
                /// # Safety
                /// Requires the features of this module; `b` holds one whole block.
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn k45_decode<const Q5: bool>(b: &[u8], smask: &[__m512i; 4]) -> K45W {
                    // Q4_K: nibbles at 16..144; Q5_K: qh at 16..48, nibbles at 48..176.
                    let qs_off = if Q5 { 48 } else { 16 };
                    let m4 = _mm512_set1_epi8(0xF);
                    let one = _mm256_set1_epi8(1);
                    let u = k4_scales(&b[4..16]);
                    let sm = _mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32);
                    let sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm));
                    let mins2 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
                    // SAFETY: qh (Q5_K only) is bytes 16..48 of the block.
                    let mut qh = if Q5 { unsafe { ld256(b, 16) } } else { _mm256_setzero_si256() };
                    let mut wv = [_mm512_setzero_si512(); 4];
                    let mut sv = [_mm512_setzero_si512(); 4];
                    for c in 0..4 {
                        // SAFETY: nibbles at qs_off + 32c + 32 <= the block size.
                        let q = unsafe { ld256(b, qs_off + 32 * c) };
                        let mut v = _mm512_and_si512(join(q, _mm256_srli_epi16(q, 4)), m4);
                        if Q5 {
                            let hlo = _mm256_slli_epi16(_mm256_and_si256(qh, one), 4);
                            let hhi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4);
                            qh = _mm256_srli_epi16(qh, 2);
                            v = _mm512_or_si512(v, join(hlo, hhi));
                        }
                        wv[c] = v;
                        sv[c] = _mm512_shuffle_epi8(sc16, smask[c]);
                    }
                    K45W { wv, sv, mins2, d: f16c(b, 0), dmin: f16c(b, 2) }
                }

                /// The exact integer lanes of one decoded block against one Q8_K block `y`:
                /// the scaled main lane sums and the 8 lanes of `bsums x mins`.
                ///
                /// # Safety
                /// Requires the features of this module; `y` holds one whole Q8_K block.
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn k45_ints(kw: &K45W, y: &[u8]) -> (__m512i, __m256i) {
                    // SAFETY: bsums are bytes 260..292 of the Q8_K block.
                    let prod_m = _mm256_madd_epi16(unsafe { ld256(y, 260) }, kw.mins2);
                    let mut sumi = _mm512_setzero_si512();
                    for c in 0..4 {
                        // SAFETY: q8 at 4 + 64c + 64 <= 260.
                        let yv = unsafe { ld512(y, 4 + 64 * c) };
                        sumi = wacc(sumi, _mm512_maddubs_epi16(kw.wv[c], yv), kw.sv[c]);
                    }
                    (sumi, prod_m)
                }

                /// Q4_K / Q5_K (`Q5`) share everything but the 5th bit. `T` activation rows; per row the
                /// operation sequence does not depend on `T` (bit-identical results). `SB`: the
                /// float part in the super-block order of `dot_sb` (the same lane integers, summed
                /// per super-block, then one f32 chain) instead of ggml's per-lane order.
                ///
                /// # Safety
                /// Requires the features of this module.
                #[inline]
                #[target_feature(enable = $feat)]
                pub(in crate::quant) unsafe fn k45<const T: usize, const Q5: bool, const SB: bool>(w: &[u8], xs: [&[u8]; T]) -> [f32; T] {
                    // Q4_K: nibbles at 16..144; Q5_K: qh at 16..48, nibbles at 48..176.
                    let ts = if Q5 { 176 } else { 144 };
                    let nb = xs.iter().fold(w.len() / ts, |m, x| m.min(x.len() / 292));
                    // GGML_CHAIN: ggml's AVX2 order (8 lanes); otherwise 16 lanes and an
                    // 8-lane mins accumulator (fewer operations per block).
                    let mut acc = [_mm256_setzero_ps(); T];
                    let mut acc_m = [_mm_setzero_ps(); T];
                    let mut summs = [0f32; T];
                    let mut acc16 = [_mm512_setzero_ps(); T];
                    let mut acc_m8 = [_mm256_setzero_ps(); T];
                    let mut sb = [0f32; T];
                    let mut sbb = [SbBatch::default(); T];
                    let mut sbn = 0;
                    let smask = k45_smask();
                    for i in 0..nb {
                        let b = &w[i * ts..(i + 1) * ts];
                        prefetch_ahead(b.as_ptr(), ts);
                        // SAFETY: features present; `b` is one block.
                        let kw = unsafe { k45_decode::<Q5>(b, &smask) };
                        let (d, dmin) = (kw.d, kw.dmin);
                        for t in 0..T {
                            let y = &xs[t][i * 292..(i + 1) * 292];
                            // SAFETY: features present; `y` is one Q8_K block.
                            let (sumi, prod_m) = unsafe { k45_ints(&kw, y) };
                            let yd = yd(y);
                            if SB {
                                sbb[t].u[sbn] = sb_pack(sumi, prod_m);
                                sbb[t].f[sbn] = (d * yd, dmin * yd);
                                continue;
                            }
                            if !GGML_CHAIN {
                                acc16[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * yd), _mm512_cvtepi32_ps(sumi), acc16[t]);
                                acc_m8[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * yd), _mm256_cvtepi32_ps(prod_m), acc_m8[t]);
                                continue;
                            }
                            // ggml's AVX2 order: 8 lanes (lane l = our lanes l and l + 8).
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * yd), _mm256_cvtepi32_ps(fold8(sumi)), acc[t]);
                            if Q5 {
                                // Q5_K: one scalar chain of the whole mins term.
                                summs[t] = (-(dmin * yd)).mul_add(hsum_epi32(prod_m) as f32, summs[t]);
                            } else {
                                // Q4_K: 4 lanes, lane k = our lanes 2k and 2k + 1.
                                let p4 = _mm_hadd_epi32(_mm256_castsi256_si128(prod_m), _mm256_extracti128_si256::<1>(prod_m));
                                acc_m[t] = _mm_fmadd_ps(_mm_set1_ps(-(dmin * yd)), _mm_cvtepi32_ps(p4), acc_m[t]);
                            }
                        }
                        if SB {
                            sbn += 1;
                            if sbn == 8 || i + 1 == nb {
                                for t in 0..T {
                                    sb_flush(&sbb[t], sbn, false, &mut sb[t]);
                                }
                                sbn = 0;
                            }
                        }
                    }
                    if SB {
                        return sb;
                    }
                    std::array::from_fn(|t| {
                        if !GGML_CHAIN {
                            return _mm512_reduce_add_ps(acc16[t]) - crate::quant::dot_avx2::hsum_ps(acc_m8[t]);
                        }
                        let main = crate::quant::dot_avx2::hsum_ps(acc[t]);
                        if Q5 { main + summs[t] } else { main + hsum4(acc_m[t]) }
                    })
                }

                /// A Q6_K block decoded for the integer part: the unsigned 6-bit quants of each
                /// 64-element piece, the scales as i16 multipliers per piece, the 16 scales as
                /// i16 (for the `- 32` offset via the `bsums`) and `d`.
                #[derive(Clone, Copy)]
                struct Q6W {
                    wv: [__m512i; 4],
                    sv: [__m512i; 4],
                    sc16: __m256i,
                    d: f32,
                }

                /// Decodes one Q6_K block `b`.
                ///
                /// # Safety
                /// Requires the features of this module; `b` holds one whole block.
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn q6k_decode(b: &[u8], sidx: &[__m512i; 4]) -> Q6W {
                    let m4 = _mm512_set1_epi8(0xF);
                    let m30 = _mm512_set1_epi8(0x30);
                    // SAFETY: scales are bytes 192..208 of the block.
                    let sc8 = unsafe { ld128(b, 192) };
                    let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
                    // values of elements 64p .. 64p + 64 (p = 2h + k), unsigned 0..63
                    // Per-16-bit-lane shifts bringing the high bits of elements 0..32 / 32..64
                    // (of each 128-element half) and of 64..96 / 96..128 to bits 0..2.
                    let s01 = join(_mm256_set1_epi16(0), _mm256_set1_epi16(2));
                    let s23 = join(_mm256_set1_epi16(4), _mm256_set1_epi16(6));
                    let mut wv = [_mm512_setzero_si512(); 4];
                    for h in 0..2 {
                        // SAFETY: ql at 64h..64h+64, qh at 128+32h..+32 inside 210 bytes.
                        let (ql, qh) = unsafe { (ld512(b, 64 * h), ld256(b, 128 + 32 * h)) };
                        let qh2 = _mm512_broadcast_i64x4(qh);
                        // low 4 bits | (2 high bits << 4): `a | (b & 0x30)`.
                        let h01 = _mm512_slli_epi16::<4>(_mm512_srlv_epi16(qh2, s01));
                        let h23 = _mm512_slli_epi16::<4>(_mm512_srlv_epi16(qh2, s23));
                        wv[2 * h] = _mm512_ternarylogic_epi32::<0xF8>(_mm512_and_si512(ql, m4), h01, m30);
                        wv[2 * h + 1] = _mm512_ternarylogic_epi32::<0xF8>(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                            h23,
                            m30,
                        );
                    }
                    let mut sv = [_mm512_setzero_si512(); 4];
                    for (p, v) in sv.iter_mut().enumerate() {
                        *v = _mm512_permutexvar_epi16(sidx[p], sc16);
                    }
                    Q6W { wv, sv, sc16: _mm512_castsi512_si256(sc16), d: f16c(b, 208) }
                }

                /// The exact integer lanes of one decoded Q6_K block against one Q8_K block:
                /// the scaled sums of the unsigned quants and the 8 lanes of `bsums x scales`
                /// (the `- 32` offset is `-32` times their sum).
                ///
                /// # Safety
                /// Requires the features of this module; `y` holds one whole Q8_K block.
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn q6k_ints(qw: &Q6W, y: &[u8]) -> (__m512i, __m256i) {
                    // SAFETY: bsums are bytes 260..292 of the Q8_K block.
                    let offs = _mm256_madd_epi16(unsafe { ld256(y, 260) }, qw.sc16);
                    let mut sumi = _mm512_setzero_si512();
                    for p in 0..4 {
                        // SAFETY: q8 at 4 + 64p + 64 <= 260.
                        let yv = unsafe { ld512(y, 4 + 64 * p) };
                        sumi = wacc(sumi, _mm512_maddubs_epi16(qw.wv[p], yv), qw.sv[p]);
                    }
                    (sumi, offs)
                }

                /// Q6_K against `T` Q8_K rows; per row the operation sequence does not depend
                /// on `T` (bit-identical results). `SB` as in `k45`.
                ///
                /// # Safety
                /// Requires the features of this module.
                #[inline]
                #[target_feature(enable = $feat)]
                pub(in crate::quant) unsafe fn q6k<const T: usize, const SB: bool>(w: &[u8], xs: [&[u8]; T]) -> [f32; T] {
                    let nb = xs.iter().fold(w.len() / 210, |m, x| m.min(x.len() / 292));
                    let sidx = q6k_sidx();
                    let mut acc = [_mm256_setzero_ps(); T];
                    let mut acc16 = [_mm512_setzero_ps(); T];
                    let mut acc_o = [_mm256_setzero_ps(); T];
                    let mut sb = [0f32; T];
                    let mut sbb = [SbBatch::default(); T];
                    let mut sbn = 0;
                    for i in 0..nb {
                        let b = &w[i * 210..(i + 1) * 210];
                        prefetch_ahead(b.as_ptr(), 210);
                        // SAFETY: features present; `b` is one block.
                        let qw = unsafe { q6k_decode(b, &sidx) };
                        let d = qw.d;
                        for t in 0..T {
                            let y = &xs[t][i * 292..(i + 1) * 292];
                            // SAFETY: features present; `y` is one Q8_K block.
                            let (sumi, offs) = unsafe { q6k_ints(&qw, y) };
                            let dd = d * yd(y);
                            if SB {
                                sbb[t].u[sbn] = sb_pack(sumi, offs);
                                sbb[t].f[sbn] = (dd, 0.0);
                                continue;
                            }
                            if !GGML_CHAIN {
                                acc16[t] = _mm512_fmadd_ps(_mm512_set1_ps(dd), _mm512_cvtepi32_ps(sumi), acc16[t]);
                                acc_o[t] = _mm256_fmadd_ps(_mm256_set1_ps(-32.0 * dd), _mm256_cvtepi32_ps(offs), acc_o[t]);
                                continue;
                            }
                            // ggml's AVX2 order: 8 integer lanes (the offset term in
                            // the lanes of its bsums), one FMA.
                            let li = _mm256_sub_epi32(fold8(sumi), _mm256_slli_epi32::<5>(offs));
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(li), acc[t]);
                        }
                        if SB {
                            sbn += 1;
                            if sbn == 8 || i + 1 == nb {
                                for t in 0..T {
                                    sb_flush(&sbb[t], sbn, true, &mut sb[t]);
                                }
                                sbn = 0;
                            }
                        }
                    }
                    if SB {
                        return sb;
                    }
                    std::array::from_fn(|t| {
                        if GGML_CHAIN {
                            crate::quant::dot_avx2::hsum_ps(acc[t])
                        } else {
                            _mm512_reduce_add_ps(acc16[t]) + crate::quant::dot_avx2::hsum_ps(acc_o[t])
                        }
                    })
                }

                /// # Safety
                /// Requires the features of this module.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
                    // SAFETY: features present; Q4_K nibbles at 16..144.
                    unsafe { k45::<1, false, false>(w, [x])[0] }
                }

                /// # Safety
                /// Requires the features of this module.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn q4_k_q8_k_x4(w: &[u8], xs: [&[u8]; 4]) -> [f32; 4] {
                    // SAFETY: features present; Q4_K nibbles at 16..144.
                    unsafe { k45::<4, false, false>(w, xs) }
                }

                /// # Safety
                /// Requires the features of this module.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn q5_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
                    // SAFETY: features present; Q5_K qh at 16..48, nibbles at 48..176.
                    unsafe { k45::<1, true, false>(w, [x])[0] }
                }

                /// # Safety
                /// Requires the features of this module.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn q5_k_q8_k_x4(w: &[u8], xs: [&[u8]; 4]) -> [f32; 4] {
                    // SAFETY: features present; Q5_K qh at 16..48, nibbles at 48..176.
                    unsafe { k45::<4, true, false>(w, xs) }
                }

                /// # Safety
                /// Requires the features of this module.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn q6_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
                    // SAFETY: features present.
                    unsafe { q6k::<1, false>(w, [x])[0] }
                }

                /// # Safety
                /// Requires the features of this module.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn q6_k_q8_k_x4(w: &[u8], xs: [&[u8]; 4]) -> [f32; 4] {
                    // SAFETY: features present.
                    unsafe { q6k::<4, false>(w, xs) }
                }
            }
        };
    }

    /// u8 x i8 products summed in groups of 4 to 16 x i32 (`vpdpbusd` from zero).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    fn bdot_vnni(a: __m512i, b: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b)
    }

    /// acc + pairwise i16 products as 16 x i32 (`vpdpwssd`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    fn wacc_vnni(acc: __m512i, p: __m512i, s: __m512i) -> __m512i {
        _mm512_dpwssd_epi32(acc, p, s)
    }

    /// u8 x i8 products summed in groups of 4 to 16 x i32 (`vpmaddubsw` + `vpmaddwd`; the i16
    /// pair sums cannot saturate for our operands: |u8| <= 128, |i8| <= 127).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    fn bdot_bw(a: __m512i, b: __m512i) -> __m512i {
        _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1))
    }

    /// acc + pairwise i16 products as 16 x i32 (`vpmaddwd` + `vpaddd`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    fn wacc_bw(acc: __m512i, p: __m512i, s: __m512i) -> __m512i {
        _mm512_add_epi32(acc, _mm512_madd_epi16(p, s))
    }

    /// Q4_K in the super-block order of `dot_sb` (AVX-512 VNNI).
    ///
    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ, VNNI and AVX2/FMA/F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn q4_k_sb(w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: features present.
        unsafe { vn::k45::<1, false, true>(w, [x])[0] }
    }

    /// Q5_K in the super-block order of `dot_sb` (AVX-512 VNNI).
    ///
    /// # Safety
    /// As [`q4_k_sb`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn q5_k_sb(w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: features present.
        unsafe { vn::k45::<1, true, true>(w, [x])[0] }
    }

    /// Q6_K in the super-block order of `dot_sb` (AVX-512 VNNI).
    ///
    /// # Safety
    /// As [`q4_k_sb`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn q6_k_sb(w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: features present.
        unsafe { vn::q6k::<1, true>(w, [x])[0] }
    }

    avx512_kernels!(
        vn,
        "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
        super::bdot_vnni,
        super::wacc_vnni,
        false
    );
    avx512_kernels!(
        bw,
        "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c",
        super::bdot_bw,
        super::wacc_bw,
        true
    );

    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ and AVX2/FMA/F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn f32_f32(w: &[u8], x: &[u8]) -> f32 {
        f32_rows::<1>(w, [x])[0]
    }

    /// [`f32_f32`] of one weight row against four activation rows (each weight vector
    /// loaded once for all four); every result bit-identical to `f32_f32`.
    ///
    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ and AVX2/FMA/F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn f32_f32_x4(w: &[u8], xs: [&[u8]; 4]) -> [f32; 4] {
        f32_rows::<4>(w, xs)
    }

    /// The f32 dot product of `w` with each of the `NT` rows `xs`: per row, four interleaved
    /// 16-lane FMA chains, one 16-lane chain for the rest of the whole vectors, an f64 tail.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    fn f32_rows<const NT: usize>(w: &[u8], xs: [&[u8]; NT]) -> [f32; NT] {
        let n = xs.iter().fold(w.len() / 4, |m, x| m.min(x.len() / 4));
        let mut acc = [[_mm512_setzero_ps(); 4]; NT];
        let mut i = 0;
        // SAFETY: each load reads 16 f32 (64 bytes) at element `o` with `o + 16 <= n`.
        unsafe {
            while i + 64 <= n {
                for k in 0..4 {
                    let o = 4 * (i + 16 * k);
                    let wv = _mm512_castsi512_ps(ld512(w, o));
                    for (a, x) in acc.iter_mut().zip(xs) {
                        a[k] = _mm512_fmadd_ps(wv, _mm512_castsi512_ps(ld512(x, o)), a[k]);
                    }
                }
                i += 64;
            }
            while i + 16 <= n {
                let o = 4 * i;
                let wv = _mm512_castsi512_ps(ld512(w, o));
                for (a, x) in acc.iter_mut().zip(xs) {
                    a[0] = _mm512_fmadd_ps(wv, _mm512_castsi512_ps(ld512(x, o)), a[0]);
                }
                i += 16;
            }
        }
        let mut out = [0f32; NT];
        for ((o, a), x) in out.iter_mut().zip(acc).zip(xs) {
            let v = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
            let mut s = f64::from(_mm512_reduce_add_ps(v));
            for j in i..n {
                let p = f32::from_le_bytes([w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]]);
                let q = f32::from_le_bytes([x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]]);
                s += f64::from(p * q);
            }
            *o = s as f32;
        }
        out
    }

    /// Shared f16/bf16 loop: `cvt` widens 16 packed halves to f32.
    ///
    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ and AVX2/FMA/F16C.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn half16(
        w: &[u8],
        x: &[u8],
        cvt: impl Fn(__m256i) -> __m512,
        one: impl Fn(&[u8], usize) -> f32,
    ) -> f32 {
        let n = (w.len() / 2).min(x.len() / 2);
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: each load reads 16 halves (32 bytes) at element `o` with `o + 16 <= n`.
        unsafe {
            while i + 64 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let o = 2 * (i + 16 * k);
                    *a = _mm512_fmadd_ps(cvt(ld256(w, o)), cvt(ld256(x, o)), *a);
                }
                i += 64;
            }
            while i + 16 <= n {
                let o = 2 * i;
                acc[0] = _mm512_fmadd_ps(cvt(ld256(w, o)), cvt(ld256(x, o)), acc[0]);
                i += 16;
            }
        }
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut s = f64::from(_mm512_reduce_add_ps(v));
        for j in i..n {
            s += f64::from(one(w, 2 * j) * one(x, 2 * j));
        }
        s as f32
    }

    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ and AVX2/FMA/F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn f16_f16(w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: features present.
        unsafe { half16(w, x, |v| _mm512_cvtph_ps(v), f16c) }
    }

    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ and AVX2/FMA/F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn bf16_bf16(w: &[u8], x: &[u8]) -> f32 {
        let cvt = |v: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
        let one = |p: &[u8], o: usize| {
            crate::quant::blocks::bf16_bits_to_f32(u16::from_le_bytes([p[o], p[o + 1]]))
        };
        // SAFETY: features present.
        unsafe { half16(w, x, cvt, one) }
    }
}
