//! Decode GEMV for the K formats (Q4_K, Q5_K, Q6_K) in the super-block order of `dot_sb`:
//! the single-token and few-token paths at [`SimdLevel::Avx512Vnni`](super::SimdLevel) and
//! [`SimdLevel::Amx`](super::SimdLevel::Amx).
//!
//! Every output is bit-identical to the per-row dot kernel of that order (`dot_sb`: per
//! super-block `s` the exact integers `T_s`, `M_s`, then one f32 chain per row,
//! `acc = fma(d·yd, T_s, acc)`, `acc = fma(-(dmin·yd), M_s, acc)`; Q6_K:
//! `acc = fma(d·yd, T_s - 32·M_s, acc)`). What differs is how the work is laid out:
//!
//! * **Eight rows at a time.** The per-row kernel ends every row with a serial scalar chain
//!   (two dependent FMAs per super-block) and a horizontal reduction. Here the integers of 8
//!   rows are reduced together by one transposing add tree per super-block, and the 8 rows'
//!   chains run in the 8 lanes of one vector (the same FMAs, lane by lane). Rows are still
//!   read in memory order, one after the other.
//! * **Activations prepared once per call** ([`prepare`]): for Q4_K/Q5_K the Q8_K quants of
//!   each 128-element half are stored in 32-element chunk order 0, 2, 1, 3, so that one
//!   64-byte load of weight nibbles meets its activations without the per-chunk lane joins.
//!   The block scale and the 16 `bsums` stay in place. Q6_K uses the plain Q8_K layout.
//! * **Scales decoded with byte shuffles, four blocks at a time** (Q4_K/Q5_K's 12-byte 6-bit
//!   scale fields of four consecutive blocks of a row, one per 128-bit lane, in one sequence
//!   of vector operations; each block then takes its lane with one shuffle, and the per-vector
//!   scale shuffle widens the bytes to i16 itself). Against one decode per block this made the
//!   Q4_K GEMV ~12% faster on data in the cache (`gemm_bench`, 256 x 8960, one core).
//! * **High bits by one variable shift** per vector: Q5_K's fifth bit and Q6_K's two high
//!   bits go from the broadcast `qh` bytes straight to bit 4 with a per-lane left or right
//!   shift, then one masked merge.
//! * **Products by `vpdpbusd`, scales once per vector pair** (`imp::pair_sums`): each vector
//!   of unsigned quants meets its activations in one `vpdpbusd` (4-product lane sums), two
//!   vectors' lane sums pack to i16 exactly, and one `vpdpwssd` multiplies them by their
//!   sub-block scales. Against `vpmaddubsw` + `vpdpwssd` per vector this is two fewer
//!   multiply-port operations and two fewer scale shuffles per super-block (one pack per pair
//!   instead): on data in the cache (`gemm_bench`, 512 x 2048, one core) Q4_K +6%, Q6_K +5%,
//!   Q5_K +2% (2048 x 512, two super-blocks per row: unchanged); from memory within noise
//!   (+2-3% medians at one thread).
//! * **Scratch kept per thread**: the packed integers waiting for their reduction (20 KiB)
//!   live in a thread-local array instead of a zeroed one per call.
//!
//! Layouts: `w` is `n` consecutive weight rows of `rb` bytes (whole blocks), `x` one prepared
//! Q8_K row of the same width (292 bytes per 256 elements), `out` the `n` results.

use kapitsa_base::GgmlType;

/// A row-range GEMV: `out[r] = dot(w[r * rb..(r + 1) * rb], x)` for `r < out.len()`, with `x`
/// prepared by [`prepare`]. Reads only inside `w` and `x`; rows past the end of `w`, blocks
/// past the end of `x` and rows of 256 MiB or more (the row-group kernels' shared limit) are not
/// computed and give 0 (callers never pass such rows).
pub(crate) type GemvFn = unsafe fn(w: &[u8], rb: usize, x: &[u8], out: &mut [f32]);

/// A row-range GEMV over a few tokens: `outs[t][r] = dot(w[r * rb..(r + 1) * rb], xs[t])` for
/// every token `t` and `r < outs[t].len()` (all `outs[t]` the same length), each weight block
/// decoded once per pass of four tokens. Otherwise as [`GemvFn`]; `xs.len() == outs.len()`,
/// any count (per group of 8 rows, the tokens four at a time: the group's weights stay in the
/// cache between the passes).
pub(crate) type GemvMultiFn = unsafe fn(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]);

/// The super-block-order GEMVs for `ty`, if it has them (Q4_K, Q5_K, Q6_K on x86-64): the
/// one-token kernel and the multi-token one. Callers must only use them where the
/// super-block order applies (`SimdLevel::Avx512Vnni` and `SimdLevel::Amx`, which imply the
/// AVX-512 VNNI features the kernels need).
pub(crate) fn kernels(ty: GgmlType) -> Option<(GemvFn, GemvMultiFn)> {
    #[cfg(target_arch = "x86_64")]
    {
        match ty {
            GgmlType::Q4_K => Some((imp::rows::<0>, imp::multi::<0>)),
            GgmlType::Q5_K => Some((imp::rows::<1>, imp::multi::<1>)),
            GgmlType::Q6_K => Some((imp::rows::<2>, imp::multi::<2>)),
            _ => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        None
    }
}

/// Rearranges a quantised Q8_K activation row (`x`: whole 292-byte blocks) in place for the
/// [`kernels`] of weight type `ty`: for Q4_K/Q5_K, in every block and each 128-element half,
/// the second and third 32-byte chunks of quants swap places. Other types: unchanged.
pub(crate) fn prepare(ty: GgmlType, x: &mut [u8]) {
    if !matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K) {
        return;
    }
    for blk in x.chunks_exact_mut(292) {
        for h in 0..2 {
            let (a, b) = blk[4 + 128 * h + 32..4 + 128 * h + 96].split_at_mut(32);
            a.swap_with_slice(b);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;
    use std::cell::UnsafeCell;

    use crate::quant::dot_avx512::{prefetch_ahead, sb_pack, sb_reduce8, vpdpwssd};

    /// Rows whose chains share one vector.
    const R: usize = 8;
    /// Super-blocks per pass over a row group (their packed integers wait in `u`, 20 KiB):
    /// enough for the widest rows of the target models (8960 elements = 35) in one pass, so
    /// each row is read start to end. With 16, the 8 rows of 8960 were read in 3 strided
    /// passes and the Q6_K GEMV took ~20% longer.
    const CH: usize = 40;

    /// Tokens per pass of the multi-token GEMV.
    const NT_MAX: usize = 4;

    thread_local! {
        /// The packed integers of a row group awaiting their reduction (20 KiB per token),
        /// kept per thread: zeroing a fresh array in every call was 1.5% of a Qwen3.6 decode
        /// step. Entries of rows past a short group's end are stale but never stored (see
        /// `rows_n`).
        static U: UnsafeCell<[[[__m512i; R]; CH]; NT_MAX]> =
            // SAFETY: all-zero bits are valid `__m512i` values (plain integer lanes).
            const { UnsafeCell::new(unsafe { std::mem::zeroed() }) };
    }

    /// Loads 64 bytes of `p` at `o` (bounds-checked).
    #[inline(always)]
    fn ld512(p: &[u8], o: usize) -> __m512i {
        let s = &p[o..o + 64];
        // SAFETY: `s` is 64 readable bytes; the load is unaligned; AVX-512F is enabled in
        // every caller (all are `#[target_feature]` functions of this module).
        unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
    }

    /// Loads 32 bytes of `p` at `o` (bounds-checked).
    #[inline(always)]
    fn ld256(p: &[u8], o: usize) -> __m256i {
        let s = &p[o..o + 32];
        // SAFETY: as `ld512`, 32 bytes; AVX is baseline for the callers.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    /// The Q4_K/Q5_K scale fields of `n` (1..=4) consecutive blocks of `row`, the first at
    /// byte `o` (blocks of `ts` bytes), decoded into one 128-bit lane each (lane `i` from block
    /// `i`; lanes past `n` are zero): the 8 sub-block scales, then the 8 mins, one byte each
    /// (6 bits), as `blocks::scale_min_k4` defines them. One decode serves four blocks.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn k4_scales_x4(row: &[u8], o: usize, n: usize, ts: usize) -> __m512i {
        // Bytes 4..20 of each block: the 12 scale bytes and 4 quant bytes (unused).
        let ld = |i: usize| {
            let s = &row[o + i * ts + 4..o + i * ts + 20];
            // SAFETY: `s` is 16 readable bytes; SSE2 is baseline.
            unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
        };
        let mut v = _mm512_castsi128_si512(ld(0));
        if n > 1 {
            v = _mm512_inserti32x4::<1>(v, ld(1));
        }
        if n > 2 {
            v = _mm512_inserti32x4::<2>(v, ld(2));
        }
        if n > 3 {
            v = _mm512_inserti32x4::<3>(v, ld(3));
        }
        let per_lane = |m: __m128i| _mm512_broadcast_i32x4(m);
        // a: scales 0..4 = s0..3, scales 4..8 from s8..11 (low nibbles), mins 0..4 = s4..7,
        // mins 4..8 from s8..11 (high nibbles); t: the bytes whose top 2 bits complete
        // scales 4..8 (s0..3) and mins 4..8 (s4..7). Byte shuffles stay inside each lane.
        let a = _mm512_shuffle_epi8(
            v,
            per_lane(_mm_setr_epi8(
                0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11,
            )),
        );
        let t = _mm512_shuffle_epi8(
            v,
            per_lane(_mm_setr_epi8(
                -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7,
            )),
        );
        let lo = _mm512_and_si512(
            a,
            per_lane(_mm_setr_epi8(
                63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0,
            )),
        );
        let hi = _mm512_and_si512(
            _mm512_srli_epi16::<4>(a),
            per_lane(_mm_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15,
            )),
        );
        // (t >> 6) << 4 per byte: a 16-bit shift by 2, keeping bits 4..6 of each byte.
        let top = _mm512_and_si512(
            _mm512_srli_epi16::<2>(t),
            per_lane(_mm_setr_epi8(
                0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30, 0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30,
            )),
        );
        _mm512_ternarylogic_epi32::<0xFE>(lo, hi, top)
    }

    /// Lane `i` (0..4) of `v` copied to all four 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn lane_bcast(v: __m512i, i: usize) -> __m512i {
        match i {
            0 => _mm512_shuffle_i32x4::<0x00>(v, v),
            1 => _mm512_shuffle_i32x4::<0x55>(v, v),
            2 => _mm512_shuffle_i32x4::<0xAA>(v, v),
            _ => _mm512_shuffle_i32x4::<0xFF>(v, v),
        }
    }

    /// Per-format constants, built once per call.
    struct Consts {
        /// Per half `h` (vectors `2h`, `2h + 1`): the scale of every 16-bit lane of their
        /// packed lane sums (see [`pair_sums`]). Q4_K/Q5_K: `_mm512_shuffle_epi8` masks taking
        /// the scales from a lane of [`k4_scales_x4`] as zero-extended i16; Q6_K:
        /// `permutexvar` indices into the 16 scales as i16.
        sidx: [__m512i; 2],
        /// Per-16-bit-lane shift counts moving each vector's high bits of the broadcast `qh`
        /// to bit 4 of every byte (Q5_K: one bit, Q6_K: bits 4..6), left or right as
        /// [`hleft`] says. A 16-bit shift carries bits across the byte boundary; only bits
        /// that came from the same byte survive the mask applied afterwards.
        hshift: [__m512i; 4],
    }

    /// Sub-blocks (low 256 bits, high 256 bits) of the Q4_K/Q5_K vectors: vector `2h` holds
    /// the low nibbles of quant bytes `64h..64h + 64`, vector `2h + 1` their high nibbles.
    const K45_SUB: [(i16, i16); 4] = [(0, 2), (1, 3), (4, 6), (5, 7)];

    /// Whether vector `c` of format `K` shifts its `qh` bits left (else right) by `hshift`:
    /// Q5_K's bit `s` goes to bit 4 (left for sub-blocks 0..4), Q6_K's pieces take bits
    /// 0..2 / 2..4 (left) and 4..6 / 6..8 (right).
    #[inline(always)]
    const fn hleft<const K: u8>(c: usize) -> bool {
        if K == 2 {
            c.is_multiple_of(2)
        } else {
            c < 2
        }
    }

    /// The sub-block (Q4_K/Q5_K: of 32 elements, 0..8; Q6_K: of 16, 0..16) whose scale
    /// multiplies 16-bit lane `i` (0..32) of half `h`'s packed lane sums ([`pair_sums`]).
    /// In 128-bit lane `l = i / 8`, lanes `i % 8 < 4` come from vector `2h`'s 32-bit lanes
    /// `4l..4l + 4`, the others from vector `2h + 1`'s; a Q4_K/Q5_K vector holds one sub-block
    /// per 256 bits ([`K45_SUB`]), a Q6_K vector one per 128 bits (piece `p`, lane `l`:
    /// sub-block `4p + l`).
    const fn lane_sub<const K: u8>(h: usize, i: usize) -> usize {
        let (l, second) = (i / 8, i % 8 >= 4);
        let c = 2 * h + second as usize;
        if K == 2 {
            4 * c + l
        } else if l < 2 {
            K45_SUB[c].0 as usize
        } else {
            K45_SUB[c].1 as usize
        }
    }

    /// [`Consts::sidx`] as i16 lanes, built at compile time: Q6_K an i16 index per lane
    /// (the [`lane_sub`]); Q4_K/Q5_K a byte-shuffle mask per lane, byte `lane_sub` of the
    /// 128-bit lane, then a zero byte (a mask byte with bit 7 set).
    const fn sidx_table<const K: u8>() -> [[i16; 32]; 2] {
        let mut t = [[0i16; 32]; 2];
        let mut h = 0;
        while h < 2 {
            let mut i = 0;
            while i < 32 {
                let sub = lane_sub::<K>(h, i) as i16;
                t[h][i] = if K == 2 {
                    sub
                } else {
                    (0x8000u16 as i16) | sub
                };
                i += 1;
            }
            h += 1;
        }
        t
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn consts<const K: u8>() -> Consts {
        let halves = |lo: i16, hi: i16| {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
                _mm256_set1_epi16(hi),
            )
        };
        // |bit position - 4|: the distance of a source bit from bit 4.
        let dist = |s: i16| (s - 4).abs();
        let sidx = std::array::from_fn(|h| {
            let idx = &const { sidx_table::<K>() }[h];
            // SAFETY: `idx` is 64 readable bytes; the load is unaligned.
            unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
        });
        if K == 2 {
            Consts {
                sidx,
                // Piece 2h: bits 0..2 (elements 0..32 of the half) and 2..4 (32..64); piece
                // 2h + 1: bits 4..6 and 6..8.
                hshift: std::array::from_fn(|p| {
                    let s = 4 * (p as i16 % 2);
                    halves(dist(s), dist(s + 2))
                }),
            }
        } else {
            Consts {
                sidx,
                // Q5_K: the 5th bit of sub-block `s` is bit `s` of `qh[l]`.
                hshift: std::array::from_fn(|c| {
                    let (a, b) = K45_SUB[c];
                    halves(dist(a), dist(b))
                }),
            }
        }
    }

    /// The lane sums of two vectors of unsigned quants (`va`, `vb`, each byte 0..63) against
    /// their activations (`ya`, `yb`, i8), packed to i16: one `vpdpbusd` per vector (each
    /// 32-bit lane the sum of 4 products, |sum| <= 4 * 63 * 128 < 2^15, so the saturating
    /// pack is exact), then per 128-bit lane `l` the 16-bit lanes `[a_4l..a_4l+4,
    /// b_4l..b_4l+4]`. Against a `vpmaddubsw` per vector, this takes one multiply-accumulate
    /// per vector plus one pack per pair, and the scales multiply once per pair.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    fn pair_sums(va: __m512i, ya: __m512i, vb: __m512i, yb: __m512i) -> __m512i {
        let z = _mm512_setzero_si512();
        _mm512_packs_epi32(
            _mm512_dpbusd_epi32(z, va, ya),
            _mm512_dpbusd_epi32(z, vb, yb),
        )
    }

    /// `qh` shifted for vector `c` of format `K` (see [`Consts::hshift`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn hbits<const K: u8>(qh: __m512i, k: &Consts, c: usize) -> __m512i {
        if hleft::<K>(c) {
            _mm512_sllv_epi16(qh, k.hshift[c])
        } else {
            _mm512_srlv_epi16(qh, k.hshift[c])
        }
    }

    /// One Q4_K (`Q5`: Q5_K) block `b` against the prepared Q8_K blocks `ys` of `NT`
    /// tokens (the weights decoded once): per token, the packed integers of `sb_pack` (`T` in
    /// the fold of the main lanes, `M` in the min lanes). `sm` is the block's lane of
    /// [`k4_scales_x4`] copied to every 128-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2")]
    fn k45_block<const Q5: bool, const NT: usize>(
        b: &[u8],
        ys: [&[u8]; NT],
        sm: __m512i,
        k: &Consts,
    ) -> [__m512i; NT] {
        // The 8 mins as i16, each twice (one per 16-element `bsums` entry).
        let mins2 = _mm256_shuffle_epi8(
            _mm512_castsi512_si256(sm),
            _mm256_setr_epi8(
                8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1, 12, -1, 12, -1, 13, -1,
                13, -1, 14, -1, 14, -1, 15, -1, 15, -1,
            ),
        );
        let mut prod_m = [_mm256_setzero_si256(); NT];
        for (pm, y) in prod_m.iter_mut().zip(ys) {
            *pm = _mm256_madd_epi16(ld256(y, 260), mins2);
        }
        let m4 = _mm512_set1_epi8(0xF);
        let qs = if Q5 { 48 } else { 16 };
        let qh2 = if Q5 {
            _mm512_broadcast_i64x4(ld256(b, 16))
        } else {
            _mm512_setzero_si512()
        };
        let bit4 = _mm512_set1_epi8(0x10);
        let mut sumi = [_mm512_setzero_si512(); NT];
        for h in 0..2 {
            let q = ld512(b, qs + 64 * h);
            let mut v = [
                _mm512_and_si512(q, m4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4),
            ];
            if Q5 {
                for (i, vi) in v.iter_mut().enumerate() {
                    // vi | (qh bit & 0x10)
                    *vi =
                        _mm512_ternarylogic_epi32::<0xF8>(*vi, hbits::<1>(qh2, k, 2 * h + i), bit4);
                }
            }
            let sc = _mm512_shuffle_epi8(sm, k.sidx[h]);
            for (st, y) in sumi.iter_mut().zip(ys) {
                let p = pair_sums(v[0], ld512(y, 4 + 128 * h), v[1], ld512(y, 68 + 128 * h));
                *st = vpdpwssd(*st, p, sc);
            }
        }
        let mut out = [_mm512_setzero_si512(); NT];
        for ((o, st), pm) in out.iter_mut().zip(sumi).zip(prod_m) {
            *o = sb_pack(st, pm);
        }
        out
    }

    /// One Q6_K block `b` against the Q8_K blocks `ys` of `NT` tokens: per token, packed `T`
    /// (of the unsigned 6-bit quants times the scales) and `M` (`bsums` times the scales; the
    /// integer is `T - 32 M`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2")]
    fn q6_block<const NT: usize>(b: &[u8], ys: [&[u8]; NT], k: &Consts) -> [__m512i; NT] {
        let s = &b[192..208];
        // SAFETY: `s` is the 16 scale bytes of the block.
        let sc8 = unsafe { _mm_loadu_si128(s.as_ptr().cast()) };
        let sc16 = _mm256_cvtepi8_epi16(sc8);
        let sc512 = _mm512_castsi256_si512(sc16);
        let mut offs = [_mm256_setzero_si256(); NT];
        for (of, y) in offs.iter_mut().zip(ys) {
            *of = _mm256_madd_epi16(ld256(y, 260), sc16);
        }
        let m4 = _mm512_set1_epi8(0xF);
        let hi2 = _mm512_set1_epi8(0x30);
        let mut sumi = [_mm512_setzero_si512(); NT];
        for h in 0..2 {
            let ql = ld512(b, 64 * h);
            let qh2 = _mm512_broadcast_i64x4(ld256(b, 128 + 32 * h));
            let v = [
                _mm512_and_si512(ql, m4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
            ];
            // vi | (qh bits & 0x30)
            let q: [__m512i; 2] = std::array::from_fn(|i| {
                _mm512_ternarylogic_epi32::<0xF8>(v[i], hbits::<2>(qh2, k, 2 * h + i), hi2)
            });
            let sc = _mm512_permutexvar_epi16(k.sidx[h], sc512);
            for (st, y) in sumi.iter_mut().zip(ys) {
                let p = pair_sums(q[0], ld512(y, 4 + 128 * h), q[1], ld512(y, 68 + 128 * h));
                *st = vpdpwssd(*st, p, sc);
            }
        }
        let mut out = [_mm512_setzero_si512(); NT];
        for ((o, st), of) in out.iter_mut().zip(sumi).zip(offs) {
            *o = sb_pack(st, of);
        }
        out
    }

    /// The one-token kernel of [`super::kernels`]: `K` = 0 (Q4_K), 1 (Q5_K), 2 (Q6_K).
    ///
    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ, VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows<const K: u8>(w: &[u8], rb: usize, x: &[u8], out: &mut [f32]) {
        rows_n::<K, 1>(w, rb, [x], [out]);
    }

    /// The multi-token kernel of [`super::kernels`]: per group of [`R`] rows, the tokens
    /// [`NT_MAX`] at a time, so the group's weights come from memory once and stay in the
    /// cache for the other passes (the group of a 8960-wide Q4_K row is 40 KiB).
    ///
    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ, VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn multi<const K: u8>(
        w: &[u8],
        rb: usize,
        xs: &[&[u8]],
        outs: &mut [&mut [f32]],
    ) {
        if xs.len() != outs.len() || rb == 0 {
            // Unequal counts: nothing (callers pass one output per input).
            return;
        }
        let n = outs.iter().fold(w.len() / rb, |m, o| m.min(o.len()));
        for o in outs.iter_mut() {
            o[n..].fill(0.0);
        }
        let mut r0 = 0;
        while r0 < n {
            let r1 = (r0 + R).min(n);
            let g = &w[r0 * rb..r1 * rb];
            for (xc, oc) in xs.chunks(NT_MAX).zip(outs.chunks_mut(NT_MAX)) {
                match (xc, oc) {
                    ([a], [p]) => rows_n::<K, 1>(g, rb, [a], [&mut p[r0..r1]]),
                    ([a, b], [p, q]) => {
                        rows_n::<K, 2>(g, rb, [a, b], [&mut p[r0..r1], &mut q[r0..r1]])
                    }
                    ([a, b, c], [p, q, r]) => rows_n::<K, 3>(
                        g,
                        rb,
                        [a, b, c],
                        [&mut p[r0..r1], &mut q[r0..r1], &mut r[r0..r1]],
                    ),
                    ([a, b, c, d], [p, q, r, t]) => rows_n::<K, 4>(
                        g,
                        rb,
                        [a, b, c, d],
                        [
                            &mut p[r0..r1],
                            &mut q[r0..r1],
                            &mut r[r0..r1],
                            &mut t[r0..r1],
                        ],
                    ),
                    _ => {}
                }
            }
            r0 = r1;
        }
    }

    /// `NT` (1..=4) tokens against the same rows: `outs[t][r] = dot(row r, xs[t])`, every
    /// weight block decoded once for all tokens; each token's outputs are exactly those of
    /// the one-token kernel (the same integers and the same f32 chain per row). Callers
    /// without the enabled features cannot call it outside `unsafe`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    fn rows_n<const K: u8, const NT: usize>(
        w: &[u8],
        rb: usize,
        xs: [&[u8]; NT],
        mut outs: [&mut [f32]; NT],
    ) {
        const { assert!(NT >= 1 && NT <= NT_MAX) };
        let ts: usize = match K {
            0 => 144,
            1 => 176,
            _ => 210,
        };
        // The row-group kernels' shared limit on row size (`matmul` takes the per-row kernels
        // for rows over 128 MiB).
        if rb == 0 || i32::try_from(R * rb + ts).is_err() {
            for o in outs.iter_mut() {
                o.fill(0.0);
            }
            return;
        }
        let nb = xs.iter().fold(rb / ts, |m, x| m.min(x.len() / 292));
        let n = outs.iter().fold(w.len() / rb, |m, o| m.min(o.len()));
        // rows 0..n are all stored below; only outputs past the weights' rows are zeroed here
        for o in outs.iter_mut() {
            o[n..].fill(0.0);
        }
        let k = consts::<K>();
        // Byte offset of a dword ending with (Q6_K) or starting with (Q4_K/Q5_K) the scales.
        let dofs = if K == 2 { 206 } else { 0 };
        // Each row-block's dword at `dofs`, stored while its integers are computed, so the
        // reduction loads 8 rows' scales with one load (instead of a gather from the rows).
        let mut dd = [[0u32; R]; CH];
        // SAFETY: the cell lives as long as this thread; this function is its only user and
        // never re-enters itself, so no other reference to it exists during the call.
        let u = unsafe { &mut *U.with(|c| c.get()) };
        let mut r0 = 0;
        while r0 < n {
            let nr = (n - r0).min(R);
            let g = &w[r0 * rb..(r0 + nr) * rb];
            let mut acc = [_mm256_setzero_ps(); NT];
            let mut j0 = 0;
            while j0 < nb {
                let jn = (nb - j0).min(CH);
                for r in 0..nr {
                    let row = &g[r * rb..(r + 1) * rb];
                    // Four blocks per step: (Q4_K/Q5_K) one scale decode per step, and each
                    // block's scale lane a constant once the step is unrolled. The prefetch
                    // stays per block: one call per four blocks asked for ~13 lines at once
                    // and made the Q6_K GEMV 2-4% slower from memory (`gemm_bench`, 2 threads).
                    let mut j = 0;
                    while j < jn {
                        let n4 = (jn - j).min(4);
                        let s0 = j0 + j;
                        let sm4 = if K != 2 {
                            k4_scales_x4(row, s0 * ts, n4, ts)
                        } else {
                            _mm512_setzero_si512()
                        };
                        // Unchecked indexing in the hot loop (bounds checks were ~10 of the
                        // ~45 instructions per block). SAFETY of every access below, for
                        // q < n4: s = s0 + q < j0 + jn <= nb, so block s of `row` ends at
                        // (s + 1) * ts <= nb * ts <= rb = row.len(), and block s of each x at
                        // (s + 1) * 292 <= nb * 292 <= x.len() (`nb` is the minimum of both);
                        // j + q < jn <= CH and r < nr <= R index inside `u`'s arrays.
                        let mut one = |q: usize| {
                            let s = s0 + q;
                            // SAFETY: see above.
                            let b = unsafe { row.get_unchecked(s * ts..(s + 1) * ts) };
                            prefetch_ahead(b.as_ptr(), ts);
                            let mut ys = [&b[..0]; NT];
                            for (y, x) in ys.iter_mut().zip(xs) {
                                // SAFETY: see above.
                                *y = unsafe { x.get_unchecked(s * 292..(s + 1) * 292) };
                            }
                            let v = match K {
                                0 => k45_block::<false, NT>(b, ys, lane_bcast(sm4, q), &k),
                                1 => k45_block::<true, NT>(b, ys, lane_bcast(sm4, q), &k),
                                _ => q6_block::<NT>(b, ys, &k),
                            };
                            for (ut, vt) in u.iter_mut().zip(v) {
                                // SAFETY: see above.
                                unsafe { *ut.get_unchecked_mut(j + q).get_unchecked_mut(r) = vt };
                            }
                            // SAFETY: see above; dofs + 4 <= ts = b.len().
                            unsafe {
                                *dd.get_unchecked_mut(j + q).get_unchecked_mut(r) =
                                    u32::from_le_bytes([
                                        *b.get_unchecked(dofs),
                                        *b.get_unchecked(dofs + 1),
                                        *b.get_unchecked(dofs + 2),
                                        *b.get_unchecked(dofs + 3),
                                    ]);
                            }
                        };
                        if n4 == 4 {
                            one(0);
                            one(1);
                            one(2);
                            one(3);
                        } else {
                            for q in 0..n4 {
                                one(q);
                            }
                        }
                        j += n4;
                    }
                }
                // Rows past `nr` hold stale integers and scales: their lanes are never stored.
                for (j, ddj) in dd.iter().enumerate().take(jn) {
                    let s = j0 + j;
                    // SAFETY: `ddj` is 8 u32 (32 bytes); an unaligned load.
                    let dw = unsafe { _mm256_loadu_si256(ddj.as_ptr().cast()) };
                    let hi16 = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32::<16>(dw)));
                    let d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dw));
                    for ((a, x), ut) in acc.iter_mut().zip(xs).zip(u.iter()) {
                        let yd = _mm256_set1_ps(f32::from_le_bytes([
                            x[s * 292],
                            x[s * 292 + 1],
                            x[s * 292 + 2],
                            x[s * 292 + 3],
                        ]));
                        let (t, m) = sb_reduce8(&ut[j]);
                        if K == 2 {
                            let f = _mm256_mul_ps(hi16, yd);
                            let iv = _mm256_sub_epi32(t, _mm256_slli_epi32::<5>(m));
                            *a = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(iv), *a);
                        } else {
                            *a = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(t), *a);
                            *a = _mm256_fnmadd_ps(
                                _mm256_mul_ps(hi16, yd),
                                _mm256_cvtepi32_ps(m),
                                *a,
                            );
                        }
                    }
                }
                j0 += jn;
            }
            // the first nr lanes, stored straight into each token's output
            let keep: __mmask8 = if nr >= R { !0 } else { (1u8 << nr) - 1 };
            for (o, a) in outs.iter_mut().zip(acc) {
                let dst = &mut o[r0..r0 + nr];
                // SAFETY: `dst` holds nr <= 8 f32 and the mask writes only lanes < nr
                // (AVX-512VL: enabled on this function).
                unsafe { _mm256_mask_storeu_ps(dst.as_mut_ptr(), keep, a) };
            }
            r0 += nr;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_row, DotKernel, SimdLevel};

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// Random blocks of `ty` with small sane f16 scales.
    fn weights(ty: GgmlType, rows: usize, n_in: usize, seed: &mut u64) -> Vec<u8> {
        let rb = ty.row_bytes(n_in).unwrap();
        let mut w: Vec<u8> = (0..rows * rb).map(|_| rng(seed) as u8).collect();
        let ts = ty.type_size();
        let fields: &[usize] = if ty == GgmlType::Q6_K {
            &[208]
        } else {
            &[0, 2]
        };
        for b in w.chunks_exact_mut(ts) {
            for &o in fields {
                let v = ((rng(seed) % 2000) as f32 - 1000.0) * 1e-6;
                b[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        w
    }

    /// A random activation row of `n_in` elements in [-1, 1], quantised to Q8_K.
    fn q8k_row(n_in: usize, seed: &mut u64) -> Vec<u8> {
        let xf: Vec<f32> = (0..n_in)
            .map(|_| (rng(seed) % 20001) as f32 / 1e4 - 1.0)
            .collect();
        let mut q = vec![0u8; GgmlType::Q8_K.row_bytes(n_in).unwrap()];
        quantize_row(GgmlType::Q8_K, &xf, &mut q).unwrap();
        q
    }

    /// Every output equals the super-block-order dot kernel's bit for bit, for row counts
    /// around the 8-row groups and widths of 1 to 35 super-blocks (every tail of the four-block
    /// scale decode; one pass: `multi_token_gemv_equals_dot_kernel_bitwise` covers two).
    #[test]
    fn gemv_equals_dot_kernel_bitwise() {
        if !SimdLevel::Avx512Vnni.is_available() {
            eprintln!("skipped: no AVX-512 VNNI on this CPU");
            return;
        }
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            let dk = DotKernel::with_level(ty, SimdLevel::Avx512Vnni).unwrap();
            assert!(dk.has_gemv() && dk.has_gemv_multi());
            let f = kernels(ty).unwrap().0;
            for n_in in [256, 1536, 4096, 4352, 8960, 11008] {
                let rb = ty.row_bytes(n_in).unwrap();
                for rows in [1, 7, 8, 9, 17, 24] {
                    let w = weights(ty, rows, n_in, &mut seed);
                    let xq = q8k_row(n_in, &mut seed);
                    let want: Vec<f32> = w.chunks_exact(rb).map(|r| dk.dot(r, &xq)).collect();
                    let mut xp = xq.clone();
                    prepare(ty, &mut xp);
                    let mut got = vec![f32::NAN; rows];
                    // SAFETY: AVX-512 VNNI (checked above) gives the kernel's features.
                    unsafe { f(&w, rb, &xp, &mut got) };
                    for (r, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            e.to_bits(),
                            "{ty:?} n_in {n_in} row {r}/{rows}: {g} vs {e}"
                        );
                    }
                }
            }
        }
    }

    /// The multi-token kernel gives every token's outputs bit for bit as the dot kernel and
    /// the scalar twin of the order, for 1 to 17 tokens (every pass size of four and its
    /// remainders), row counts around the 8-row groups and widths around the
    /// 40-super-block passes.
    #[test]
    fn multi_token_gemv_equals_dot_kernel_bitwise() {
        if !SimdLevel::Avx512Vnni.is_available() {
            eprintln!("skipped: no AVX-512 VNNI on this CPU");
            return;
        }
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            let dk = DotKernel::with_level(ty, SimdLevel::Avx512Vnni).unwrap();
            let f = kernels(ty).unwrap().1;
            for (n_in, rows) in [(256, 9), (2048, 8), (4352, 17), (11264, 3)] {
                let rb = ty.row_bytes(n_in).unwrap();
                let w = weights(ty, rows, n_in, &mut seed);
                for n_tok in (1..=10).chain([13, 16, 17]) {
                    let xq: Vec<Vec<u8>> = (0..n_tok).map(|_| q8k_row(n_in, &mut seed)).collect();
                    let xp: Vec<Vec<u8>> = xq
                        .iter()
                        .map(|q| {
                            let mut p = q.clone();
                            prepare(ty, &mut p);
                            p
                        })
                        .collect();
                    let xs: Vec<&[u8]> = xp.iter().map(|p| p.as_slice()).collect();
                    let mut got = vec![vec![f32::NAN; rows]; n_tok];
                    let mut outs: Vec<&mut [f32]> =
                        got.iter_mut().map(|g| g.as_mut_slice()).collect();
                    // SAFETY: AVX-512 VNNI (checked above) gives the kernel's features.
                    unsafe { f(&w, rb, &xs, &mut outs) };
                    for (t, g) in got.iter().enumerate() {
                        for (r, wr) in w.chunks_exact(rb).enumerate() {
                            let e = dk.dot(wr, &xq[t]);
                            let twin = crate::quant::dot_sb::dot_scalar(ty, wr, &xq[t]);
                            assert_eq!(e.to_bits(), twin.to_bits(), "{ty:?} dot vs twin");
                            assert_eq!(
                                g[r].to_bits(),
                                e.to_bits(),
                                "{ty:?} n_in {n_in} token {t}/{n_tok} row {r}: {} vs {e}",
                                g[r]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn prepare_swaps_the_middle_chunks_of_each_half() {
        let mut x: Vec<u8> = (0..292).map(|i| i as u8).collect();
        let orig = x.clone();
        prepare(GgmlType::Q4_K, &mut x);
        assert_eq!(x[..36], orig[..36]);
        assert_eq!(x[36..68], orig[68..100]);
        assert_eq!(x[68..100], orig[36..68]);
        assert_eq!(x[164..196], orig[196..228]);
        assert_eq!(x[260..], orig[260..]);
        let mut y = orig.clone();
        prepare(GgmlType::Q6_K, &mut y);
        assert_eq!(y, orig);
    }
}
