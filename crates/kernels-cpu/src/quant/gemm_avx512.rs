//! AVX-512 GEMM micro-kernels for prefill: one weight row against a tile of up to [`TILE`]
//! tokens, with results bit-identical to the AVX-512 dot products of the same level.
//!
//! Why they are bit-identical: the dot kernels (`dot_avx512.rs`) compute, per weight block and
//! activation row, exact integer lane sums and then a fixed sequence of f32 operations per lane
//! (a multiply of two scales, a convert, a fused multiply-add into a per-row accumulator) and a
//! fixed reduction at the end. Integer sums are exact, so any instruction sequence giving the
//! same per-lane integers is interchangeable; the f32 operations here are the same operations
//! on the same lane values in the same order, only scheduled across (row, token) pairs. What
//! the GEMM gains: each weight block is decoded once per row and call (into a *record*, below)
//! instead of once per 4 tokens, activations are repacked once per call into the layout the
//! micro-kernel streams, scale products are vectorised across tokens, and 8 tokens share every
//! weight register load.
//!
//! The unit of work is a *group* of 256 elements: one super-block of the K formats, 8 blocks of
//! the 32-element formats (the dot kernels' main loop step). Layouts, per group:
//!
//! K formats (Q4_K, Q5_K, Q6_K; activations Q8_K). The dot kernel's integer lane `L` (16 x i32)
//! of a super-block is `sum_c S_c[L] * D_c(L)` over the four 64-element chunks `c`, where
//! `D_c(L)` is the dot product of elements `64c + 4L .. 64c + 4L + 4` and `S_c[L]` that
//! sub-block's scale; the dot kernel gets it as `vpmaddubsw` + `vpdpwssd` per chunk.
//! * AVX-512 (no VNNI), weight record [`REC_K`] = 576 bytes: `W[c]` (64 unsigned quants of
//!   chunk `c`, as the dot kernel holds them in a register) at `64c`, `S[c]` (32 x i16) at
//!   `256 + 64c`, `M` (16 x i16 multipliers of the Q8_K `bsums`: Q4_K/Q5_K mins, Q6_K scales)
//!   at 512, `d: f32` at 544, `dm: f32` (`dmin`; Q6_K: unused) at 548. Activation tile
//!   [`ACT_K`] = 2624 bytes: `qs[t]` (256 x i8) at `256t`, `bsums[t]` (16 x i16) at
//!   `2048 + 32t`, `d[t]: f32` at `2304 + 4t`, and per token pair `p` the 16 lanes
//!   `[d[2p] x 8, d[2p+1] x 8]` at `2368 + 64p`.
//! * AVX-512 VNNI: fewer uops. Each `D_c(L)` fits in i16 (|D| <= 4 * 63 * 127), so
//!   `vpdpbusd` computes the `D` of two chunks in two registers, `vpackssdw` packs them as i16
//!   pairs and one `vpdpwssd` applies both chunks' scales: 8 integer uops per token and
//!   super-block (4 `vpdpbusd`, 2 packs, `vpmaddwd`, `vpdpwssd`) instead of 4 `vpmaddubsw` +
//!   4 `vpdpwssd` (11 once LLVM splits `vpdpwssd`), same lane integers; measured 1.27x on the
//!   whole GEMM. The `d * yd` of the tile's 8 tokens are one multiply per super-block, read by
//!   the FMAs as embedded-broadcast operands. For the pack to pair `D_0(L)` with
//!   `D_1(L)` the elements are permuted, in the weights and identically in the activations:
//!   `unpacklo_epi32(X_0, X_1)`, `unpackhi_epi32(X_0, X_1)`, `unpacklo_epi32(X_2, X_3)`,
//!   `unpackhi_epi32(X_2, X_3)` of the four chunks `X_c`. Weight record [`REC_KV`] = 448 bytes:
//!   the permuted quants at 0, the scales of chunks 0/1 interleaved as i16 pairs at 256 and of
//!   chunks 2/3 at 320, `M` at 384, `d` at 416, `dm` at 420. Activation tile [`ACT_KV`] = 2624
//!   bytes: permuted `qs[t]` at `256t`, the rest as in the AVX-512 layout.
//!
//! 32-element formats (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4; activations Q8_0; VNNI only):
//! * weight record, [`REC_Q`] = 512 bytes: for block pair `j` (blocks `2j`, `2j + 1`) the 64
//!   signed quants plus 128 (as u8) at `64j`, and `[dw[2j] x 8, dw[2j+1] x 8]` at `256 + 64j`.
//! * activation tile, [`ACT_Q`] = 6144 bytes: `qs[t]` (the 8 blocks' 256 quants) at `256t`,
//!   `-128 * (sum of each 4 quants)` as 16 x i32 per block pair at `2048 + 256t + 64j`, and
//!   `[dx[2j] x 8, dx[2j+1] x 8]` at `4096 + 256t + 64j`.
//!   `vpdpbusd(-128 * sum4(x), w + 128, x) = sum4(w * x)`, the dot kernels' lane sums (they
//!   negate `x` where `w < 0`, which is the same product because activations are never -128).
//!   A row whose block count is not a multiple of 8 ends in a partial group: the driver pads
//!   it (weights and activations) with all-zero blocks, whose products are exactly 0, and the
//!   dot kernels do the same blocks as pairs continuing the main loop (see `q8_family`).

use kapitsa_base::GgmlType;

use super::SimdLevel;

/// One 16-lane f32 accumulator (a plain `__m512` where it exists).
#[cfg(target_arch = "x86_64")]
pub(crate) type AccVec = std::arch::x86_64::__m512;
/// One 16-lane f32 accumulator (a plain `__m512` where it exists).
#[cfg(not(target_arch = "x86_64"))]
pub(crate) type AccVec = [f32; 16];

/// Tokens per activation tile (the micro-kernel width).
pub(crate) const TILE: usize = 8;
/// Elements per group.
pub(crate) const GROUP: usize = 256;
/// Bytes of a K-format weight record.
pub(crate) const REC_K: usize = 576;
/// Bytes of a K-format activation tile group.
pub(crate) const ACT_K: usize = 2624;
/// Bytes of a K-format weight record (VNNI layout).
pub(crate) const REC_KV: usize = 448;
/// Bytes of a K-format activation tile group (VNNI layout).
pub(crate) const ACT_KV: usize = 2624;
/// Bytes of a 32-element-format weight record.
pub(crate) const REC_Q: usize = 512;
/// Bytes of a 32-element-format activation tile group.
pub(crate) const ACT_Q: usize = 6144;

/// f32 accumulators of one weight row against one tile: 16 vectors of 16 lanes. K formats use
/// `v[t]` for token `t`'s main sum and `v[8 + p]` for token pair `p`'s bsums term (lanes 0..8
/// token `2p`, 8..16 token `2p + 1`); the 32-element formats use `v[2t]` and `v[2t + 1]`.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Acc(pub(crate) [AccVec; 16]);

/// Decodes whole groups of one raw weight row (`w`: `n` groups) into `n` records (`rec`).
pub(crate) type DecodeFn = unsafe fn(w: &[u8], rec: &mut [u8]);
/// Where a micro-kernel puts a row's final sums: those of the first `out.len()` tokens of the
/// tile go to `out`.
pub(crate) struct Fin<'a> {
    /// One output per real token of the tile (at most [`TILE`]).
    pub(crate) out: &'a mut [f32],
}

/// Adds `n` groups of one row (`rec`: `n` records) times a tile (`act`: `n` tile groups) to the
/// accumulators: starting from zero if `init`, else from `acc`; then either stores them in
/// `acc` (`fin` is `None`) or, at the row's last chunk, reduces them in registers to the final
/// sums in `fin.out` (`acc` is then left as it was).
pub(crate) type KernFn =
    unsafe fn(rec: &[u8], act: &[u8], acc: &mut Acc, init: bool, fin: Option<Fin<'_>>);

/// The GEMM pieces for one weight type at one SIMD level.
#[derive(Clone, Copy)]
pub(crate) struct GemmKernel {
    /// Raw weight bytes per group.
    pub(crate) w_group: usize,
    /// Raw activation bytes per group (in the `vec_dot_type` format).
    pub(crate) x_group: usize,
    /// Bytes of one weight record.
    pub(crate) rec: usize,
    /// Bytes of one activation tile group.
    pub(crate) act: usize,
    /// Weight rows to records.
    pub(crate) decode: DecodeFn,
    /// Packs one token's raw activation groups (`n` groups) into slot `slot` of `n` tile
    /// groups.
    pub(crate) pack: fn(x: &[u8], slot: usize, tile: &mut [u8]),
    /// Micro-kernels for tiles of 2, 4, 6 and 8 tokens (index `T / 2 - 1`).
    pub(crate) kern: [KernFn; 4],
    /// The same micro-kernels reading raw weight groups (`w_group` bytes each) instead of
    /// records, decoding them in registers, for tiles of 1, 2, 4, 6 and 8 tokens (index
    /// `T.div_ceil(2)`): for calls with a single tile (batched decode steps), where a record
    /// would be written and read back only once. Same operations per output. (Single tokens
    /// stay on the per-row dot kernels: with these, Nemotron-L8's decode measured 10-20%
    /// slower.)
    pub(crate) direct: Option<[KernFn; 5]>,
}

/// The GEMM kernel reproducing `level`'s dot product for `ty`, if there is one.
#[cfg(target_arch = "x86_64")]
pub(crate) fn kernel(ty: GgmlType, level: SimdLevel) -> Option<GemmKernel> {
    use imp::*;
    use GgmlType as T;
    macro_rules! kfam {
        (bw, $q5:literal, $q6:literal) => {
            GemmKernel {
                w_group: ty.type_size(),
                x_group: 292,
                rec: REC_K,
                act: ACT_K,
                decode: if $q6 {
                    bw::decode_q6k
                } else {
                    bw::decode_k45::<$q5>
                },
                pack: pack_q8k,
                kern: [
                    bw::kern_k::<2, $q5, $q6>,
                    bw::kern_k::<4, $q5, $q6>,
                    bw::kern_k::<6, $q5, $q6>,
                    bw::kern_k::<8, $q5, $q6>,
                ],
                direct: None,
            }
        };
        (vn, $q5:literal, $q6:literal) => {
            GemmKernel {
                w_group: ty.type_size(),
                x_group: 292,
                rec: REC_KV,
                act: ACT_KV,
                decode: if $q6 {
                    vnk::decode_q6k
                } else {
                    vnk::decode_k45::<$q5>
                },
                pack: pack_q8k_v,
                kern: [
                    vnk::kern_k::<2, $q5, $q6>,
                    vnk::kern_k::<4, $q5, $q6>,
                    vnk::kern_k::<6, $q5, $q6>,
                    vnk::kern_k::<8, $q5, $q6>,
                ],
                direct: None,
            }
        };
    }
    macro_rules! qfam {
        ($decode:ident, $kern:ident, $direct:ident) => {
            GemmKernel {
                w_group: 8 * ty.type_size(),
                x_group: 8 * 34,
                rec: REC_Q,
                act: ACT_Q,
                decode: vnq::$decode,
                pack: pack_q8_0,
                kern: [
                    vnq::$kern::<2>,
                    vnq::$kern::<4>,
                    vnq::$kern::<6>,
                    vnq::$kern::<8>,
                ],
                direct: Some([
                    vnq::$direct::<1>,
                    vnq::$direct::<2>,
                    vnq::$direct::<4>,
                    vnq::$direct::<6>,
                    vnq::$direct::<8>,
                ]),
            }
        };
    }
    macro_rules! kfam_sb {
        ($q5:literal, $q6:literal) => {
            GemmKernel {
                kern: [
                    kern_k_sb::<2, $q6>,
                    kern_k_sb::<4, $q6>,
                    kern_k_sb::<6, $q6>,
                    kern_k_sb::<8, $q6>,
                ],
                ..kfam!(vn, $q5, $q6)
            }
        };
    }
    match level {
        // The super-block order (`dot_sb`): at the AMX level for batches below the tile
        // GEMM's threshold.
        SimdLevel::Amx => Some(match ty {
            T::Q4_K => kfam_sb!(false, false),
            T::Q5_K => kfam_sb!(true, false),
            T::Q6_K => kfam_sb!(false, true),
            _ => return None,
        }),
        SimdLevel::Avx512Vnni => Some(match ty {
            // The K formats: the super-block order here too (every batch size).
            T::Q4_K => kfam_sb!(false, false),
            T::Q5_K => kfam_sb!(true, false),
            T::Q6_K => kfam_sb!(false, true),
            T::Q8_0 => qfam!(decode_q8_0, kern_q8_0, direct_q8_0),
            T::Q4_0 => qfam!(decode_q4_0, kern_q4_0, direct_q4_0),
            T::Q5_0 => qfam!(decode_q5_0, kern_q5_0, direct_q5_0),
            T::IQ4_NL => qfam!(decode_iq4_nl, kern_iq4_nl, direct_iq4_nl),
            T::MXFP4 => qfam!(decode_mxfp4, kern_mxfp4, direct_mxfp4),
            _ => return None,
        }),
        SimdLevel::Avx512 => Some(match ty {
            T::Q4_K => kfam!(bw, false, false),
            T::Q5_K => kfam!(bw, true, false),
            T::Q6_K => kfam!(bw, false, true),
            _ => return None,
        }),
        _ => None,
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn kernel(_ty: GgmlType, _level: SimdLevel) -> Option<GemmKernel> {
    None
}

/// Packs one token's Q8_K row (`x`: whole 292-byte blocks) into slot `slot` of the K-format
/// tile groups `tile` (one group per block).
fn pack_q8k(x: &[u8], slot: usize, tile: &mut [u8]) {
    for (b, g) in x.chunks_exact(292).zip(tile.chunks_exact_mut(ACT_K)) {
        g[256 * slot..256 * slot + 256].copy_from_slice(&b[4..260]);
        g[2048 + 32 * slot..2048 + 32 * slot + 32].copy_from_slice(&b[260..292]);
        g[2304 + 4 * slot..2304 + 4 * slot + 4].copy_from_slice(&b[0..4]);
        let o = 2368 + 64 * (slot / 2) + 32 * (slot % 2);
        for k in 0..8 {
            g[o + 4 * k..o + 4 * k + 4].copy_from_slice(&b[0..4]);
        }
    }
}

/// Packs one token's Q8_K row into slot `slot` of the VNNI-layout K-format tile groups: the
/// quants permuted as the weights are (see the module docs), the rest as [`pack_q8k`].
fn pack_q8k_v(x: &[u8], slot: usize, tile: &mut [u8]) {
    for (b, g) in x.chunks_exact(292).zip(tile.chunks_exact_mut(ACT_KV)) {
        let qs = &b[4..260];
        let out = &mut g[256 * slot..256 * slot + 256];
        // Segment `seg` (pair `seg / 2` of chunks, unpack lo/hi `seg % 2`), dword `l`:
        // chunk `2 * pair + l % 2`, dword `4 * (l / 4) + 2 * (seg % 2) + (l / 2) % 2`.
        for seg in 0..4 {
            for l in 0..16 {
                let c = 2 * (seg / 2) + l % 2;
                let dw = 4 * (l / 4) + 2 * (seg % 2) + (l / 2) % 2;
                let src = 64 * c + 4 * dw;
                out[64 * seg + 4 * l..64 * seg + 4 * l + 4].copy_from_slice(&qs[src..src + 4]);
            }
        }
        g[2048 + 32 * slot..2048 + 32 * slot + 32].copy_from_slice(&b[260..292]);
        g[2304 + 4 * slot..2304 + 4 * slot + 4].copy_from_slice(&b[0..4]);
        let o = 2368 + 64 * (slot / 2) + 32 * (slot % 2);
        for k in 0..8 {
            g[o + 4 * k..o + 4 * k + 4].copy_from_slice(&b[0..4]);
        }
    }
}

/// Packs one token's Q8_0 row (`x`: groups of 8 blocks of 34 bytes) into slot `slot` of the
/// 32-element-format tile groups `tile`.
fn pack_q8_0(x: &[u8], slot: usize, tile: &mut [u8]) {
    for (gx, g) in x.chunks_exact(8 * 34).zip(tile.chunks_exact_mut(ACT_Q)) {
        for k in 0..8 {
            let b = &gx[34 * k..34 * k + 34];
            g[256 * slot + 32 * k..256 * slot + 32 * k + 32].copy_from_slice(&b[2..34]);
            // d as f32 (exact widening), 8 copies in half `k % 2` of pair `k / 2`.
            let d = super::blocks::f16_at(b, 0).to_le_bytes();
            let o = 4096 + 256 * slot + 64 * (k / 2) + 32 * (k % 2);
            for l in 0..8 {
                g[o + 4 * l..o + 4 * l + 4].copy_from_slice(&d);
                // -128 * (sum of quants 4l..4l+4 of this block)
                let s: i32 = b[2 + 4 * l..6 + 4 * l]
                    .iter()
                    .map(|&q| i32::from(q as i8))
                    .sum();
                let c = 2048 + 256 * slot + 64 * (k / 2) + 32 * (k % 2) + 4 * l;
                g[c..c + 4].copy_from_slice(&(-128 * s).to_le_bytes());
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    use super::{Acc, AccVec, Fin, ACT_K, ACT_KV, ACT_Q, REC_K, REC_KV, REC_Q};
    use crate::quant::blocks::{KVALUES_IQ4NL, KVALUES_MXFP4};
    use crate::quant::dot_avx2::{f16c, hsum_ps, ld128, ld256, nibbles32};
    use crate::quant::dot_avx512::{
        hsum_epi32, k4_scales, ld512, prefetch_ahead, q5_0_plus16, q6k_sidx, sb_pack, sb_reduce8,
        vpdpwssd,
    };

    pub(super) use super::{pack_q8_0, pack_q8k, pack_q8k_v};

    /// Loads 64 bytes at `p + o`.
    ///
    /// # Safety
    /// The 64 bytes must be readable; AVX-512F.
    #[inline(always)]
    unsafe fn ldp(p: *const u8, o: usize) -> __m512i {
        // SAFETY: the caller guarantees `p + o .. p + o + 64` is readable; the load is unaligned.
        unsafe { _mm512_loadu_si512(p.add(o).cast()) }
    }

    /// Reads an f32 at `p + o`.
    ///
    /// # Safety
    /// The 4 bytes must be readable.
    #[inline(always)]
    unsafe fn f32p(p: *const u8, o: usize) -> f32 {
        // SAFETY: the caller guarantees the 4 bytes are readable; the read is unaligned.
        unsafe { p.add(o).cast::<f32>().read_unaligned() }
    }

    macro_rules! gemm_kernels {
        ($m:ident, $feat:literal, $wacc:path) => {
            pub(super) mod $m {
                use super::*;
                use $wacc as wacc;

                #[inline]
                #[target_feature(enable = $feat)]
                fn join(lo: __m256i, hi: __m256i) -> __m512i {
                    _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
                }

                /// Q4_K (`Q5 = false`) / Q5_K rows to records: the values `k45` in
                /// `dot_avx512.rs` computes in registers, stored.
                ///
                /// # Safety
                /// Requires the features of this module; `rec` holds `w.len() / ts` records.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn decode_k45<const Q5: bool>(w: &[u8], rec: &mut [u8]) {
                    let (ts, qs_off) = if Q5 { (176, 48) } else { (144, 16) };
                    let m4 = _mm512_set1_epi8(0xF);
                    let one = _mm256_set1_epi8(1);
                    let smask: [__m512i; 4] = std::array::from_fn(|c| {
                        let lo = (((4 * c + 1) << 8) | (4 * c)) as i16;
                        let hi = (((4 * c + 3) << 8) | (4 * c + 2)) as i16;
                        join(_mm256_set1_epi16(lo), _mm256_set1_epi16(hi))
                    });
                    for (b, r) in w.chunks_exact(ts).zip(rec.chunks_exact_mut(REC_K)) {
                        let u = k4_scales(&b[4..16]);
                        let sm = _mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32);
                        let sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm));
                        let mins2 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
                        let mut qh = if Q5 {
                            // SAFETY: qh (Q5_K only) is bytes 16..48 of the block.
                            unsafe { ld256(b, 16) }
                        } else {
                            _mm256_setzero_si256()
                        };
                        let rp = r.as_mut_ptr();
                        for c in 0..4 {
                            // SAFETY: nibbles at qs_off + 32c + 32 <= ts.
                            let q = unsafe { ld256(b, qs_off + 32 * c) };
                            let mut v = _mm512_and_si512(join(q, _mm256_srli_epi16(q, 4)), m4);
                            if Q5 {
                                let hlo = _mm256_slli_epi16(_mm256_and_si256(qh, one), 4);
                                let hhi = _mm256_slli_epi16(
                                    _mm256_and_si256(_mm256_srli_epi16(qh, 1), one),
                                    4,
                                );
                                qh = _mm256_srli_epi16(qh, 2);
                                v = _mm512_or_si512(v, join(hlo, hhi));
                            }
                            // SAFETY: `r` is REC_K = 576 bytes; W[c] at 64c, S[c] at 256 + 64c.
                            unsafe {
                                _mm512_storeu_si512(rp.add(64 * c).cast(), v);
                                _mm512_storeu_si512(
                                    rp.add(256 + 64 * c).cast(),
                                    _mm512_shuffle_epi8(sc16, smask[c]),
                                );
                            }
                        }
                        // SAFETY: M at 512..544 of the 576-byte record.
                        unsafe { _mm256_storeu_si256(rp.add(512).cast(), mins2) };
                        r[544..548].copy_from_slice(&f16c(b, 0).to_le_bytes());
                        r[548..552].copy_from_slice(&f16c(b, 2).to_le_bytes());
                    }
                }

                /// Q6_K rows to records (the values `q6k` in `dot_avx512.rs` computes).
                ///
                /// # Safety
                /// Requires the features of this module; `rec` holds `w.len() / 210` records.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn decode_q6k(w: &[u8], rec: &mut [u8]) {
                    let m4 = _mm512_set1_epi8(0xF);
                    let m2 = _mm512_set1_epi8(3);
                    let sidx = q6k_sidx();
                    for (b, r) in w.chunks_exact(210).zip(rec.chunks_exact_mut(REC_K)) {
                        // SAFETY: scales are bytes 192..208 of the block.
                        let sc8 = unsafe { ld128(b, 192) };
                        let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
                        let rp = r.as_mut_ptr();
                        for h in 0..2 {
                            // SAFETY: ql at 64h..64h+64, qh at 128+32h..+32 inside 210 bytes.
                            let (ql, qh) = unsafe { (ld512(b, 64 * h), ld256(b, 128 + 32 * h)) };
                            let h01 = join(qh, _mm256_srli_epi16(qh, 2));
                            let h23 = join(_mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6));
                            let lo = _mm512_or_si512(
                                _mm512_and_si512(ql, m4),
                                _mm512_slli_epi16(_mm512_and_si512(h01, m2), 4),
                            );
                            let hi = _mm512_or_si512(
                                _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                _mm512_slli_epi16(_mm512_and_si512(h23, m2), 4),
                            );
                            // SAFETY: W[2h], W[2h + 1] at 128h, 128h + 64 of the 576-byte record.
                            unsafe {
                                _mm512_storeu_si512(rp.add(128 * h).cast(), lo);
                                _mm512_storeu_si512(rp.add(128 * h + 64).cast(), hi);
                            }
                        }
                        for (p, ix) in sidx.iter().enumerate() {
                            // SAFETY: S[p] at 256 + 64p of the record.
                            unsafe {
                                _mm512_storeu_si512(
                                    rp.add(256 + 64 * p).cast(),
                                    _mm512_permutexvar_epi16(*ix, sc16),
                                )
                            };
                        }
                        // SAFETY: M at 512..544 of the record.
                        unsafe {
                            _mm256_storeu_si256(rp.add(512).cast(), _mm512_castsi512_si256(sc16))
                        };
                        let d = f16c(b, 208).to_le_bytes();
                        r[544..548].copy_from_slice(&d);
                        r[548..552].copy_from_slice(&d);
                    }
                }

                /// K formats: `acc += rec (n groups of one row) x act (n tile groups)` for `T`
                /// tokens (even, <= 8). Per token and group this is exactly the dot kernel's
                /// step in ggml's AVX2 order (see [`k_pair_step`]).
                ///
                /// # Safety
                /// Requires the features of this module; `rec.len() == n * REC_K` and
                /// `act.len() >= n * ACT_K`.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn kern_k<const T: usize, const Q5: bool, const Q6: bool>(
                    rec: &[u8],
                    act: &[u8],
                    acc: &mut Acc,
                    init: bool,
                    fin: Option<Fin<'_>>,
                ) {
                    let n = rec.len() / REC_K;
                    assert!(act.len() >= n * ACT_K && T <= 8 && T.is_multiple_of(2));
                    let mut st = KState::default();
                    if !init {
                        st.load(acc);
                    }
                    for g in 0..n {
                        // SAFETY: record `g` is bytes g*REC_K..(g+1)*REC_K of `rec` and tile group `g` bytes
                        // g*ACT_K..(g+1)*ACT_K of `act` (checked above); every load below reads inside them at
                        // the offsets of the module docs' layouts; the features are this function's.
                        unsafe {
                            let r = rec.as_ptr().add(g * REC_K);
                            let x = act.as_ptr().add(g * ACT_K);
                            let w: [__m512i; 4] = [ldp(r, 0), ldp(r, 64), ldp(r, 128), ldp(r, 192)];
                            let s: [__m512i; 4] =
                                [ldp(r, 256), ldp(r, 320), ldp(r, 384), ldp(r, 448)];
                            let mm = _mm512_broadcast_i64x4(_mm256_loadu_si256(r.add(512).cast()));
                            let (d, dm) = (f32p(r, 544), f32p(r, 548));
                            let sumi = |t: usize| {
                                let mut v = _mm512_madd_epi16(
                                    _mm512_maddubs_epi16(w[0], ldp(x, 256 * t)),
                                    s[0],
                                );
                                for c in 1..4 {
                                    let yv = ldp(x, 256 * t + 64 * c);
                                    v = wacc(v, _mm512_maddubs_epi16(w[c], yv), s[c]);
                                }
                                v
                            };
                            for p in 0..T / 2 {
                                k_pair_step::<Q5, Q6>(
                                    &mut st,
                                    p,
                                    sumi(2 * p),
                                    sumi(2 * p + 1),
                                    x,
                                    mm,
                                    d,
                                    dm,
                                );
                            }
                        }
                    }
                    // SAFETY: features present.
                    unsafe { st.end::<T, Q5, Q6>(acc, fin) };
                }
            }
        };
    }

    /// `fma(v, splat(*s), acc)` with the splat as an embedded-broadcast memory operand of the
    /// FMA (LLVM would instead multiply scalars and broadcast through port 5). The same fused
    /// operation as `_mm512_fmadd_ps(_mm512_set1_ps(*s), v, acc)`, bit for bit.
    ///
    /// # Safety
    /// `s` points to a readable f32; AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn fma_bcast(v: __m512, s: *const f32, acc: __m512) -> __m512 {
        let mut a = acc;
        // SAFETY: reads 4 bytes at `s` (caller's contract); no stack or flags use.
        unsafe {
            std::arch::asm!(
                "vfmadd231ps {a}, {v}, dword ptr [{s}]{{1to16}}",
                a = inout(zmm_reg) a,
                v = in(zmm_reg) v,
                s = in(reg) s,
                options(pure, readonly, nostack, preserves_flags)
            );
        }
        a
    }

    /// acc + pairwise i16 products as 16 x i32 (`vpmaddwd` + `vpaddd`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    fn wacc_bw(acc: __m512i, p: __m512i, s: __m512i) -> __m512i {
        _mm512_add_epi32(acc, _mm512_madd_epi16(p, s))
    }

    gemm_kernels!(
        bw,
        "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c",
        super::wacc_bw
    );

    /// End of a VNNI K-format kernel call: store the accumulators (`fin` is `None`) or reduce
    /// them in registers, `out[t] = reduce(a[t]) -/+ hsum(m[t])`, the VNNI dot kernels' final
    /// step (Q4_K/Q5_K subtract the mins term, Q6_K adds the offset term; token `t`'s `m` is
    /// half `t % 2` of `m[t / 2]`).
    ///
    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ, AVX2, FMA, F16C.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn end_k<const T: usize, const Q6: bool>(
        a: &[__m512; T],
        m: &[__m512; 4],
        acc: &mut Acc,
        fin: Option<Fin<'_>>,
    ) {
        match fin {
            Some(f) => {
                for (t, o) in f.out.iter_mut().take(T).enumerate() {
                    let mt = if t % 2 == 0 {
                        _mm512_castps512_ps256(m[t / 2])
                    } else {
                        _mm512_extractf32x8_ps::<1>(m[t / 2])
                    };
                    let main = _mm512_reduce_add_ps(a[t]);
                    *o = if Q6 {
                        main + hsum_ps(mt)
                    } else {
                        main - hsum_ps(mt)
                    };
                }
            }
            None => {
                acc.0[..T].copy_from_slice(a);
                acc.0[8..8 + T / 2].copy_from_slice(&m[..T / 2]);
            }
        }
    }

    /// Start of a K-format kernel call that continues a row: the accumulators as
    /// [`end_k`] stored them.
    #[inline(always)]
    pub(super) fn load_k<const T: usize>(a: &mut [__m512; T], m: &mut [__m512; 4], acc: &Acc) {
        a.copy_from_slice(&acc.0[..T]);
        m[..T / 2].copy_from_slice(&acc.0[8..8 + T / 2]);
    }

    /// The running f32 state of one row's K-format chains in a GEMM tile, in ggml's AVX2 order
    /// (`ggml_vec_dot_q{4,5,6}_K_q8_K`): token pair `p`'s 8-lane main accumulators in `a[p]`
    /// (token `2p` in lanes 0..8, `2p + 1` in lanes 8..16); for Q4_K the 4-lane mins
    /// accumulators in the even lanes of `m[p]` (lane `2k` of each half is ggml's lane `k`;
    /// the odd lanes carry junk that is never read); for Q5_K one scalar mins chain per token.
    #[derive(Clone, Copy)]
    pub(super) struct KState {
        a: [__m512; 4],
        m: [__m512; 4],
        summs: [f32; 8],
    }

    impl Default for KState {
        fn default() -> Self {
            // SAFETY: all-zero bits are a valid `__m512` (0.0 in every lane).
            unsafe { std::mem::zeroed() }
        }
    }

    impl KState {
        /// Continue a row: the state as [`KState::end`] stored it.
        #[inline(always)]
        pub(super) fn load(&mut self, acc: &Acc) {
            self.a.copy_from_slice(&acc.0[..4]);
            self.m.copy_from_slice(&acc.0[8..12]);
            // SAFETY: `AccVec` is 16 f32 and `summs` 8.
            let v: [f32; 16] = unsafe { std::mem::transmute(acc.0[4]) };
            self.summs.copy_from_slice(&v[..8]);
        }

        /// End of a K-format kernel call: store the state (`fin` is `None`) or finish each
        /// token's sum as ggml does: `hsum8(acc) + ((m0 + m2) + (m1 + m3))` (Q4_K),
        /// `hsum8(acc) + summs` (Q5_K), `hsum8(acc)` (Q6_K).
        ///
        /// # Safety
        /// Requires AVX-512F/BW/VL/DQ, AVX2, FMA, F16C.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
        pub(super) unsafe fn end<const T: usize, const Q5: bool, const Q6: bool>(
            &self,
            acc: &mut Acc,
            fin: Option<Fin<'_>>,
        ) {
            match fin {
                Some(f) => {
                    for (t, o) in f.out.iter_mut().take(T).enumerate() {
                        let half = |v: __m512| {
                            if t % 2 == 0 {
                                _mm512_castps512_ps256(v)
                            } else {
                                _mm512_extractf32x8_ps::<1>(v)
                            }
                        };
                        let main = hsum_ps(half(self.a[t / 2]));
                        *o = if Q6 {
                            main
                        } else if Q5 {
                            main + self.summs[t]
                        } else {
                            let mut e = [0f32; 8];
                            // SAFETY: `e` holds 8 f32.
                            unsafe { _mm256_storeu_ps(e.as_mut_ptr(), half(self.m[t / 2])) };
                            main + ((e[0] + e[4]) + (e[2] + e[6]))
                        };
                    }
                }
                None => {
                    acc.0[..4].copy_from_slice(&self.a);
                    acc.0[8..12].copy_from_slice(&self.m);
                    let mut v = [0f32; 16];
                    v[..8].copy_from_slice(&self.summs);
                    // SAFETY: `AccVec` is 16 f32.
                    acc.0[4] = unsafe { std::mem::transmute::<[f32; 16], AccVec>(v) };
                }
            }
        }
    }

    /// One super-block of a K-format row for token pair `p` (tokens `2p`, `2p + 1`), given
    /// their 16-lane integer sums `s0`, `s1` (the dot kernel's lanes): ggml's 8 lanes are
    /// lanes `l` and `l + 8` added; Q6_K subtracts `32 x` the scales-weighted bsums per lane;
    /// then `acc = fma(d * yd, lanes, acc)`. The mins term (Q4_K/Q5_K, from the tile's bsums
    /// and the record's mins `mm`): Q4_K keeps 4 lanes per token (pairs of our 8 lanes
    /// added), `m = fma(-(dmin * yd), lanes, m)`; Q5_K one scalar chain of the lanes' total.
    ///
    /// # Safety
    /// Requires the features below; `x` points to a whole tile group (K layout) and
    /// `p < 4`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn k_pair_step<const Q5: bool, const Q6: bool>(
        st: &mut KState,
        p: usize,
        s0: __m512i,
        s1: __m512i,
        x: *const u8,
        mm: __m512i,
        d: f32,
        dm: f32,
    ) {
        let mut li = _mm512_add_epi32(
            _mm512_shuffle_i64x2::<0b01_00_01_00>(s0, s1),
            _mm512_shuffle_i64x2::<0b11_10_11_10>(s0, s1),
        );
        // SAFETY: the pair's bsums (64 bytes at 2048 + 64p) and yd pair (64 bytes at
        // 2368 + 64p) are inside the tile group (caller).
        let (prod, yd2) = unsafe {
            (
                _mm512_madd_epi16(ldp(x, 2048 + 64 * p), mm),
                _mm512_loadu_ps(x.add(2368 + 64 * p).cast()),
            )
        };
        if Q6 {
            li = _mm512_sub_epi32(li, _mm512_slli_epi32::<5>(prod));
        }
        let dy = _mm512_mul_ps(_mm512_set1_ps(d), yd2);
        st.a[p] = _mm512_fmadd_ps(dy, _mm512_cvtepi32_ps(li), st.a[p]);
        if Q6 {
            return;
        }
        if Q5 {
            let (m0, m1) = (
                hsum_epi32(_mm512_castsi512_si256(prod)),
                hsum_epi32(_mm512_extracti64x4_epi64::<1>(prod)),
            );
            // SAFETY: the tokens' yd at 2304 + 4t inside the tile group (caller).
            let (y0, y1) = unsafe { (f32p(x, 2304 + 8 * p), f32p(x, 2308 + 8 * p)) };
            st.summs[2 * p] = (-(dm * y0)).mul_add(m0 as f32, st.summs[2 * p]);
            st.summs[2 * p + 1] = (-(dm * y1)).mul_add(m1 as f32, st.summs[2 * p + 1]);
        } else {
            let pe = _mm512_add_epi32(prod, _mm512_srli_epi64::<32>(prod));
            let f = _mm512_mul_ps(_mm512_set1_ps(dm), yd2);
            st.m[p] = _mm512_fnmadd_ps(f, _mm512_cvtepi32_ps(pe), st.m[p]);
        }
    }

    /// K formats with VNNI (layout in the module docs).
    pub(super) mod vnk {
        use super::*;

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        fn join(lo: __m256i, hi: __m256i) -> __m512i {
            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
        }

        /// Stores one super-block's record from the dot kernel's per-chunk quants `w[c]` and
        /// scales `s[c]` (permuted / interleaved as the module docs say), `M`, `d` and `dm`.
        ///
        /// # Safety
        /// Requires the features of this module; `r.len() >= REC_KV`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        unsafe fn store_rec(
            r: &mut [u8],
            w: [__m512i; 4],
            s: [__m512i; 4],
            m: __m256i,
            d: f32,
            dm: f32,
        ) {
            assert!(r.len() >= REC_KV);
            let rp = r.as_mut_ptr();
            let odd = 0xAAAA_AAAAu32;
            // SAFETY: offsets + 64 <= 384 and M at 384..416 are inside the 448-byte record.
            unsafe {
                _mm512_storeu_si512(rp.cast(), _mm512_unpacklo_epi32(w[0], w[1]));
                _mm512_storeu_si512(rp.add(64).cast(), _mm512_unpackhi_epi32(w[0], w[1]));
                _mm512_storeu_si512(rp.add(128).cast(), _mm512_unpacklo_epi32(w[2], w[3]));
                _mm512_storeu_si512(rp.add(192).cast(), _mm512_unpackhi_epi32(w[2], w[3]));
                _mm512_storeu_si512(rp.add(256).cast(), _mm512_mask_blend_epi16(odd, s[0], s[1]));
                _mm512_storeu_si512(rp.add(320).cast(), _mm512_mask_blend_epi16(odd, s[2], s[3]));
                _mm256_storeu_si256(rp.add(384).cast(), m);
            }
            r[416..420].copy_from_slice(&d.to_le_bytes());
            r[420..424].copy_from_slice(&dm.to_le_bytes());
        }

        /// Q4_K (`Q5 = false`) / Q5_K rows to records (values as `k45` in `dot_avx512.rs`).
        ///
        /// # Safety
        /// Requires the features of this module; `rec` holds `w.len() / ts` records.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        pub(crate) unsafe fn decode_k45<const Q5: bool>(w: &[u8], rec: &mut [u8]) {
            let (ts, qs_off) = if Q5 { (176, 48) } else { (144, 16) };
            let m4 = _mm512_set1_epi8(0xF);
            let one = _mm256_set1_epi8(1);
            let smask: [__m512i; 4] = std::array::from_fn(|c| {
                let lo = (((4 * c + 1) << 8) | (4 * c)) as i16;
                let hi = (((4 * c + 3) << 8) | (4 * c + 2)) as i16;
                join(_mm256_set1_epi16(lo), _mm256_set1_epi16(hi))
            });
            for (b, r) in w.chunks_exact(ts).zip(rec.chunks_exact_mut(REC_KV)) {
                let u = k4_scales(&b[4..16]);
                let sm = _mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32);
                let sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm));
                let mins2 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
                let mut qh = if Q5 {
                    // SAFETY: qh (Q5_K only) is bytes 16..48 of the block.
                    unsafe { ld256(b, 16) }
                } else {
                    _mm256_setzero_si256()
                };
                let mut wv = [_mm512_setzero_si512(); 4];
                let mut sv = [_mm512_setzero_si512(); 4];
                for c in 0..4 {
                    // SAFETY: nibbles at qs_off + 32c + 32 <= ts.
                    let q = unsafe { ld256(b, qs_off + 32 * c) };
                    let mut v = _mm512_and_si512(join(q, _mm256_srli_epi16(q, 4)), m4);
                    if Q5 {
                        let hlo = _mm256_slli_epi16(_mm256_and_si256(qh, one), 4);
                        let hhi =
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4);
                        qh = _mm256_srli_epi16(qh, 2);
                        v = _mm512_or_si512(v, join(hlo, hhi));
                    }
                    wv[c] = v;
                    sv[c] = _mm512_shuffle_epi8(sc16, smask[c]);
                }
                // SAFETY: features present; `r` is one 448-byte record.
                unsafe { store_rec(r, wv, sv, mins2, f16c(b, 0), f16c(b, 2)) };
            }
        }

        /// Q6_K rows to records (values as `q6k` in `dot_avx512.rs`).
        ///
        /// # Safety
        /// Requires the features of this module; `rec` holds `w.len() / 210` records.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        pub(crate) unsafe fn decode_q6k(w: &[u8], rec: &mut [u8]) {
            let m4 = _mm512_set1_epi8(0xF);
            let m2 = _mm512_set1_epi8(3);
            let sidx = q6k_sidx();
            for (b, r) in w.chunks_exact(210).zip(rec.chunks_exact_mut(REC_KV)) {
                // SAFETY: scales are bytes 192..208 of the block.
                let sc8 = unsafe { ld128(b, 192) };
                let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
                let mut wv = [_mm512_setzero_si512(); 4];
                for h in 0..2 {
                    // SAFETY: ql at 64h..64h+64, qh at 128+32h..+32 inside 210 bytes.
                    let (ql, qh) = unsafe { (ld512(b, 64 * h), ld256(b, 128 + 32 * h)) };
                    let h01 = join(qh, _mm256_srli_epi16(qh, 2));
                    let h23 = join(_mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6));
                    wv[2 * h] = _mm512_or_si512(
                        _mm512_and_si512(ql, m4),
                        _mm512_slli_epi16(_mm512_and_si512(h01, m2), 4),
                    );
                    wv[2 * h + 1] = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                        _mm512_slli_epi16(_mm512_and_si512(h23, m2), 4),
                    );
                }
                let sv: [__m512i; 4] =
                    std::array::from_fn(|p| _mm512_permutexvar_epi16(sidx[p], sc16));
                let d = f16c(b, 208);
                // SAFETY: features present; `r` is one 448-byte record.
                unsafe { store_rec(r, wv, sv, _mm512_castsi512_si256(sc16), d, d) };
            }
        }

        /// Token `t`'s exact lane integers of one super-block, as the dot kernel forms them
        /// (VNNI layout): `w` the record's permuted quants, `s01` / `s23` its scale pairs, `x`
        /// the tile group.
        ///
        /// # Safety
        /// Requires the features of this module; `x` points to a whole tile group and `t < 8`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        pub(in crate::quant) unsafe fn lane_ints(
            w: &[__m512i; 4],
            s01: __m512i,
            s23: __m512i,
            x: *const u8,
            t: usize,
        ) -> __m512i {
            let zero = _mm512_setzero_si512();
            // SAFETY: token t's quants are 256 bytes at 256t inside the group (caller).
            let y = |k: usize| unsafe { ldp(x, 256 * t + 64 * k) };
            let p01 = _mm512_packs_epi32(
                _mm512_dpbusd_epi32(zero, w[0], y(0)),
                _mm512_dpbusd_epi32(zero, w[1], y(1)),
            );
            let p23 = _mm512_packs_epi32(
                _mm512_dpbusd_epi32(zero, w[2], y(2)),
                _mm512_dpbusd_epi32(zero, w[3], y(3)),
            );
            vpdpwssd(_mm512_madd_epi16(p01, s01), p23, s23)
        }

        /// K formats, VNNI: `acc += rec x act` for `T` tokens (even, <= 8); per token and
        /// super-block the same lane integers and f32 steps as the VNNI dot kernel (16 lanes,
        /// not ggml's order; `Q5` is unused: Q4_K and Q5_K share the f32 steps here).
        ///
        /// # Safety
        /// Requires the features of this module; `rec.len() == n * REC_KV` and
        /// `act.len() >= n * ACT_KV`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        pub(crate) unsafe fn kern_k<const T: usize, const Q5: bool, const Q6: bool>(
            rec: &[u8],
            act: &[u8],
            acc: &mut Acc,
            init: bool,
            fin: Option<Fin<'_>>,
        ) {
            let n = rec.len() / REC_KV;
            assert!(act.len() >= n * ACT_KV && T <= 8 && T.is_multiple_of(2));
            let mut a = [_mm512_setzero_ps(); T];
            let mut m = [_mm512_setzero_ps(); 4];
            if !init {
                load_k(&mut a, &mut m, acc);
            }
            let neg32 = _mm512_set1_ps(-32.0);
            for g in 0..n {
                // SAFETY: record `g` is bytes g*REC_KV..(g+1)*REC_KV of `rec` and tile group `g` bytes
                // g*ACT_KV..(g+1)*ACT_KV of `act` (checked above); every load below reads inside them at
                // the offsets of the module docs' layouts; `dy` is 8 f32 and t < T <= 8; the features are
                // this function's.
                unsafe {
                    let r = rec.as_ptr().add(g * REC_KV);
                    let x = act.as_ptr().add(g * ACT_KV);
                    let w: [__m512i; 4] = [ldp(r, 0), ldp(r, 64), ldp(r, 128), ldp(r, 192)];
                    let (s01, s23) = (ldp(r, 256), ldp(r, 320));
                    let mm = _mm512_broadcast_i64x4(_mm256_loadu_si256(r.add(384).cast()));
                    let (d, dm) = (f32p(r, 416), f32p(r, 420));
                    let dv = _mm512_set1_ps(d);
                    // d * yd of the 8 tokens (the dot kernel's scalar products), read back by the FMAs
                    // as broadcast memory operands: one multiply per block, not per token.
                    let mut dy = [0f32; 8];
                    let yd8 = _mm256_loadu_ps(x.add(2304).cast());
                    _mm256_storeu_ps(
                        dy.as_mut_ptr(),
                        _mm256_mul_ps(_mm512_castps512_ps256(dv), yd8),
                    );
                    for (t, at) in a.iter_mut().enumerate() {
                        let sumi = lane_ints(&w, s01, s23, x, t);
                        *at = fma_bcast(_mm512_cvtepi32_ps(sumi), dy.as_ptr().add(t), *at);
                    }
                    for (p, mp) in m.iter_mut().take(T / 2).enumerate() {
                        let yd2 = _mm512_loadu_ps(x.add(2368 + 64 * p).cast());
                        let f = if Q6 {
                            _mm512_mul_ps(neg32, _mm512_mul_ps(dv, yd2))
                        } else {
                            _mm512_mul_ps(_mm512_set1_ps(dm), yd2)
                        };
                        let prod = _mm512_madd_epi16(ldp(x, 2048 + 64 * p), mm);
                        *mp = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(prod), *mp);
                    }
                }
            }
            // SAFETY: features present.
            unsafe { end_k::<T, Q6>(&a, &m, acc, fin) };
        }
    }

    /// K formats, VNNI, in the super-block order of `dot_sb` (the AMX level's order, for
    /// batches too small for the tile GEMM): the same records, tiles and lane integers as
    /// `vnk::kern_k`; per super-block each token's lanes are summed to `T` and `M` (one
    /// transposing add tree for the tile) and the f32 chains of the `T` tokens run in lanes
    /// `0..T` of `acc.0[0]`: `acc = fma(d * yd, T, acc)`, then `acc = fma(-(dmin * yd), M,
    /// acc)` (Q6_K: `acc = fma(d * yd, T - 32 M, acc)`), as the dot kernel does per row.
    ///
    /// # Safety
    /// As `vnk::kern_k`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn kern_k_sb<const T: usize, const Q6: bool>(
        rec: &[u8],
        act: &[u8],
        acc: &mut Acc,
        init: bool,
        fin: Option<Fin<'_>>,
    ) {
        let n = rec.len() / REC_KV;
        assert!(act.len() >= n * ACT_KV && T <= 8 && T.is_multiple_of(2));
        let mut a = if init {
            _mm256_setzero_ps()
        } else {
            _mm512_castps512_ps256(acc.0[0])
        };
        let zero = _mm512_setzero_si512();
        for g in 0..n {
            // SAFETY: as in `vnk::kern_k`: record `g` and tile group `g` are inside `rec` and
            // `act` (checked above) and every load reads inside them at the offsets of the
            // module docs' layouts; the features are this function's.
            unsafe {
                let r = rec.as_ptr().add(g * REC_KV);
                let x = act.as_ptr().add(g * ACT_KV);
                let w: [__m512i; 4] = [ldp(r, 0), ldp(r, 64), ldp(r, 128), ldp(r, 192)];
                let (s01, s23) = (ldp(r, 256), ldp(r, 320));
                let mm = _mm512_broadcast_i64x4(_mm256_loadu_si256(r.add(384).cast()));
                let (d, dm) = (f32p(r, 416), f32p(r, 420));
                // Per token: [8-lane fold of the main lanes | its 8 lanes of the bsums term].
                let mut u = [zero; 8];
                for p in 0..T / 2 {
                    let prod = _mm512_madd_epi16(ldp(x, 2048 + 64 * p), mm);
                    for k in 0..2 {
                        let t = 2 * p + k;
                        let m8 = if k == 0 {
                            _mm512_castsi512_si256(prod)
                        } else {
                            _mm512_extracti64x4_epi64::<1>(prod)
                        };
                        u[t] = sb_pack(vnk::lane_ints(&w, s01, s23, x, t), m8);
                    }
                }
                let (tv, mv) = sb_reduce8(&u);
                let yd8 = _mm256_loadu_ps(x.add(2304).cast());
                let dy = _mm256_mul_ps(_mm256_set1_ps(d), yd8);
                if Q6 {
                    let t6 = _mm256_sub_epi32(tv, _mm256_slli_epi32::<5>(mv));
                    a = _mm256_fmadd_ps(dy, _mm256_cvtepi32_ps(t6), a);
                } else {
                    a = _mm256_fmadd_ps(dy, _mm256_cvtepi32_ps(tv), a);
                    let dmy = _mm256_mul_ps(_mm256_set1_ps(dm), yd8);
                    a = _mm256_fnmadd_ps(dmy, _mm256_cvtepi32_ps(mv), a);
                }
            }
        }
        match fin {
            Some(f) => {
                let mut v = [0f32; 8];
                // SAFETY: `v` holds 8 f32.
                unsafe { _mm256_storeu_ps(v.as_mut_ptr(), a) };
                for (o, x) in f.out.iter_mut().zip(v) {
                    *o = x;
                }
            }
            None => acc.0[0] = _mm512_castps256_ps512(a),
        }
    }

    /// The 32-element formats (AVX-512 VNNI only: the `w + 128` trick needs `vpdpbusd`).
    pub(super) mod vnq {
        use super::*;
        use crate::quant::dot_avx2::{e8m0x8, f16x8};

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        fn join(lo: __m256i, hi: __m256i) -> __m512i {
            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
        }

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        fn table(t: &[i8; 16]) -> __m256i {
            // SAFETY: `t` is exactly 16 bytes.
            let v = unsafe { _mm_loadu_si128(t.as_ptr().cast()) };
            _mm256_set_m128i(v, v)
        }

        /// Rows of a 32-element format (`ts`-byte blocks, whole groups of 8) to records.
        /// `decode(block)` gives its 32 signed values, `scales8(8 blocks)` their scales (the
        /// same functions the dot kernels use).
        ///
        /// # Safety
        /// Requires the features of this module; `decode` reads only inside its block.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        unsafe fn decode_q(
            w: &[u8],
            rec: &mut [u8],
            ts: usize,
            decode: impl Fn(&[u8]) -> __m256i,
            scales8: impl Fn(&[u8]) -> __m256,
        ) {
            let bias = _mm512_set1_epi8(0x80u8 as i8);
            let idx: [__m512i; 4] = std::array::from_fn(|j| {
                join(
                    _mm256_set1_epi32(2 * j as i32),
                    _mm256_set1_epi32(2 * j as i32 + 1),
                )
            });
            for (gw, r) in w.chunks_exact(8 * ts).zip(rec.chunks_exact_mut(REC_Q)) {
                let dw = _mm512_castps256_ps512(scales8(gw));
                let rp = r.as_mut_ptr();
                for (j, ix) in idx.iter().enumerate() {
                    let v = join(
                        decode(&gw[2 * j * ts..(2 * j + 1) * ts]),
                        decode(&gw[(2 * j + 1) * ts..(2 * j + 2) * ts]),
                    );
                    // SAFETY: W'[j] at 64j and DW[j] at 256 + 64j of the 512-byte record.
                    unsafe {
                        _mm512_storeu_si512(rp.add(64 * j).cast(), _mm512_xor_si512(v, bias));
                        _mm512_storeu_ps(
                            rp.add(256 + 64 * j).cast(),
                            _mm512_permutexvar_ps(*ix, dw),
                        );
                    }
                }
            }
        }

        /// 32-element formats: `acc += rec x act` for `T` tokens; per token, group and block
        /// pair `j` exactly the dot kernels' step `a[j & 1] = fma(dw * dx, cvt(sum4(w * x)),
        /// a[j & 1])`, token `t` using `acc.0[2t]` and `acc.0[2t + 1]`. With `fin`, the dot
        /// kernels' end: `reduce(a0 + a1)`. `n` groups, the last with only its first
        /// `last_pairs` block pairs (the rest of a padded group: zero weights against zero
        /// activations, whose steps `fma(0, 0, a)` leave `a` exactly as it was, since `a` is
        /// never -0); `pair(g, j)` gives group `g`'s block pair `j` as the record holds it:
        /// `(w + 128, [dw[2j] x 8, dw[2j+1] x 8])`.
        ///
        /// # Safety
        /// Requires the features of this module; `act.len() >= n * ACT_Q`.
        #[inline(always)]
        unsafe fn kern_q_with<const T: usize>(
            n: usize,
            last_pairs: usize,
            mut pair: impl FnMut(usize, usize) -> (__m512i, __m512),
            act: &[u8],
            acc: &mut Acc,
            init: bool,
            fin: Option<Fin<'_>>,
        ) {
            assert!(act.len() >= n * ACT_Q && T <= 8);
            // SAFETY: always inlined into this module's kernels, which have its features
            // (caller); tile group `g` is bytes g*ACT_Q..(g+1)*ACT_Q of `act` (checked above)
            // and every load below reads inside it at the offsets of the module docs' layout.
            unsafe {
                let mut a = [[_mm512_setzero_ps(); 2]; T];
                if !init {
                    for (t, at) in a.iter_mut().enumerate() {
                        *at = [acc.0[2 * t], acc.0[2 * t + 1]];
                    }
                }
                for g in 0..n {
                    let x = act.as_ptr().add(g * ACT_Q);
                    for j in 0..if g + 1 == n { last_pairs } else { 4 } {
                        let (wj, dwj) = pair(g, j);
                        for (t, at) in a.iter_mut().enumerate() {
                            let o = 256 * t + 64 * j;
                            let p = _mm512_dpbusd_epi32(ldp(x, 2048 + o), wj, ldp(x, o));
                            let dk = _mm512_mul_ps(dwj, _mm512_loadu_ps(x.add(4096 + o).cast()));
                            at[j & 1] = _mm512_fmadd_ps(dk, _mm512_cvtepi32_ps(p), at[j & 1]);
                        }
                    }
                }
                let Some(f) = fin else {
                    for (t, at) in a.iter().enumerate() {
                        acc.0[2 * t..2 * t + 2].copy_from_slice(at);
                    }
                    return;
                };
                for (t, o) in f.out.iter_mut().take(T).enumerate() {
                    *o = _mm512_reduce_add_ps(_mm512_add_ps(a[t][0], a[t][1]));
                }
            }
        }

        /// [`kern_q_with`] over records (`rec`: `n * REC_Q` bytes).
        ///
        /// # Safety
        /// Requires the features of this module; `rec.len() == n * REC_Q`,
        /// `act.len() >= n * ACT_Q`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        unsafe fn kern_q<const T: usize>(
            rec: &[u8],
            act: &[u8],
            acc: &mut Acc,
            init: bool,
            fin: Option<Fin<'_>>,
        ) {
            let n = rec.len() / REC_Q;
            let pair = |g: usize, j: usize| {
                // SAFETY: record `g` is bytes g*REC_Q..(g+1)*REC_Q of `rec` (g < n); W'[j] is
                // at 64j and DW[j] at 256 + 64j of it.
                unsafe {
                    let r = rec.as_ptr().add(g * REC_Q);
                    (ldp(r, 64 * j), _mm512_loadu_ps(r.add(256 + 64 * j).cast()))
                }
            };
            // SAFETY: features present; `act` as the caller guarantees.
            unsafe { kern_q_with::<T>(n, 4, pair, act, acc, init, fin) }
        }

        /// [`kern_q_with`] over raw weights (`w`: whole groups of 8 `ts`-byte blocks, then
        /// possibly a partial group of an even number of blocks, whose tile group is padded),
        /// decoding each block pair in registers exactly as `decode_q` writes it into a
        /// record.
        ///
        /// # Safety
        /// Requires the features of this module; `w.len()` is a multiple of `2 * ts`,
        /// `act.len() >= n * ACT_Q` for the `n` groups `w` starts; `decode` reads only inside
        /// its block.
        #[inline]
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        unsafe fn direct_q<const T: usize>(
            w: &[u8],
            act: &[u8],
            acc: &mut Acc,
            init: bool,
            fin: Option<Fin<'_>>,
            ts: usize,
            decode: impl Fn(&[u8]) -> __m256i,
            scales8: impl Fn(&[u8]) -> __m256,
        ) {
            let pairs = w.len() / (2 * ts);
            let (n, last_pairs) = (pairs.div_ceil(4), (pairs - 1) % 4 + 1);
            let bias = _mm512_set1_epi8(0x80u8 as i8);
            let idx: [__m512i; 4] = std::array::from_fn(|j| {
                join(
                    _mm256_set1_epi32(2 * j as i32),
                    _mm256_set1_epi32(2 * j as i32 + 1),
                )
            });
            let mut dw = _mm512_setzero_ps();
            let pair = |g: usize, j: usize| {
                let gw = &w[g * 8 * ts..((g + 1) * 8 * ts).min(w.len())];
                if j == 0 {
                    prefetch_ahead(gw.as_ptr(), 8 * ts);
                    dw = if gw.len() == 8 * ts {
                        _mm512_castps256_ps512(scales8(gw))
                    } else {
                        // A partial group: its blocks' scales, zero for the absent ones.
                        let mut full = [0u8; 8 * 34];
                        full[..gw.len()].copy_from_slice(gw);
                        _mm512_castps256_ps512(scales8(&full[..8 * ts]))
                    };
                }
                let v = join(
                    decode(&gw[2 * j * ts..(2 * j + 1) * ts]),
                    decode(&gw[(2 * j + 1) * ts..(2 * j + 2) * ts]),
                );
                (_mm512_xor_si512(v, bias), _mm512_permutexvar_ps(idx[j], dw))
            };
            if pairs == 0 {
                // SAFETY: features present; no group is read.
                return unsafe { kern_q_with::<T>(0, 4, pair, act, acc, init, fin) };
            }
            // SAFETY: features present; `act` as the caller guarantees.
            unsafe { kern_q_with::<T>(n, last_pairs, pair, act, acc, init, fin) }
        }

        /// Defines `decode_*` and `kern_*` of one 32-element format.
        macro_rules! q_entry {
            ($dec:ident, $kern:ident, $direct:ident, $ts:expr, |$b:ident| $decode:expr, $scales8:expr) => {
                /// # Safety
                /// Requires the features of this module; see `decode_q`.
                #[target_feature(
                    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"
                )]
                pub(crate) unsafe fn $dec(w: &[u8], rec: &mut [u8]) {
                    // SAFETY: features present; the decoder reads inside its block.
                    unsafe { decode_q(w, rec, $ts, |$b: &[u8]| $decode, $scales8) }
                }

                /// # Safety
                /// Requires the features of this module; see `kern_q`.
                #[target_feature(
                    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"
                )]
                pub(crate) unsafe fn $kern<const T: usize>(
                    rec: &[u8],
                    act: &[u8],
                    acc: &mut Acc,
                    init: bool,
                    fin: Option<Fin<'_>>,
                ) {
                    // SAFETY: features present; the layouts are `kern_q`'s.
                    unsafe { kern_q::<T>(rec, act, acc, init, fin) }
                }

                /// # Safety
                /// Requires the features of this module; see `direct_q` (`w`: whole raw
                /// groups).
                #[target_feature(
                    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"
                )]
                pub(crate) unsafe fn $direct<const T: usize>(
                    w: &[u8],
                    act: &[u8],
                    acc: &mut Acc,
                    init: bool,
                    fin: Option<Fin<'_>>,
                ) {
                    // SAFETY: features present; the decoder reads inside its block.
                    unsafe {
                        direct_q::<T>(w, act, acc, init, fin, $ts, |$b: &[u8]| $decode, $scales8)
                    }
                }
            };
        }

        // SAFETY (each decoder): `ld128`/`ld256` read the quant bytes inside the block (Q8_0 qs
        // at 2..34, Q4_0/IQ4_NL qs at 2..18, Q5_0 qs at 6..22, MXFP4 at 1..17).
        q_entry!(
            decode_q8_0,
            kern_q8_0,
            direct_q8_0,
            34,
            |b| ld256(b, 2),
            |bl: &[u8]| f16x8(bl, 34, 0)
        );
        q_entry!(
            decode_q4_0,
            kern_q4_0,
            direct_q4_0,
            18,
            |b| _mm256_sub_epi8(nibbles32(ld128(b, 2)), _mm256_set1_epi8(8)),
            |bl: &[u8]| f16x8(bl, 18, 0)
        );
        q_entry!(
            decode_q5_0,
            kern_q5_0,
            direct_q5_0,
            22,
            |b| _mm256_sub_epi8(q5_0_plus16(b), _mm256_set1_epi8(16)),
            |bl: &[u8]| f16x8(bl, 22, 0)
        );
        q_entry!(
            decode_iq4_nl,
            kern_iq4_nl,
            direct_iq4_nl,
            18,
            |b| _mm256_shuffle_epi8(table(&KVALUES_IQ4NL), nibbles32(ld128(b, 2))),
            |bl: &[u8]| f16x8(bl, 18, 0)
        );
        q_entry!(
            decode_mxfp4,
            kern_mxfp4,
            direct_mxfp4,
            17,
            |b| _mm256_shuffle_epi8(table(&KVALUES_MXFP4), nibbles32(ld128(b, 1))),
            |bl: &[u8]| e8m0x8(bl)
        );
    }
}
