//! Multi-token GEMV for Q4_K and Q6_K in the super-block order of `dot_sb`, with 16 weight
//! rows in the 16 lanes of a vector: the few-token path (speculative verification, batched
//! decode) at [`SimdLevel::Avx512Vnni`](super::SimdLevel) and above.
//!
//! Every output is bit-identical to the per-row dot kernel of that order (per super-block the
//! exact integers `T`, `M`, then one f32 chain per (row, token): `acc = fma(d·yd, T, acc)`,
//! `acc = fma(-(dmin·yd), M, acc)`; Q6_K: `acc = fma(d·yd, T - 32·M, acc)`). What differs from
//! `gemv_sb` (8 rows, each row's 16 lanes holding partial sums that a transposing add tree
//! then reduces per super-block and token) is the layout:
//!
//! * **Rows in lanes.** A *panel* of 16 rows is repacked, a few super-blocks at a time, into
//!   a record ([`VPB`] vectors per super-block): for every group of 4 elements (a *quad*) one
//!   vector holding the 16 rows' 4 unsigned quants, then per sub-block its 16 rows' scales
//!   as i32 (and, Q4_K, the mins of sub-blocks 2i and 2i + 1 as one i16 pair; Q6_K the
//!   scales of its 16-element sub-blocks 2i and 2i + 1 as one i16 pair), then `d`
//!   (and `dmin`) as 16 f32.
//! * **Activations broadcast.** Each quad vector meets a token's 4 activation quants as one
//!   `vpdpbusd` with the 4 bytes broadcast, so lane `r` accumulates row `r`'s sub-block sum
//!   directly: no reduction. Per sub-block, lane-wise `T += S_j * sum_j` (`vpmulld`, exact:
//!   |sum_j| <= 32·15·128) and per super-block `M` by `vpdpwssd` of the mins (scales) pairs
//!   with the broadcast pairs of Q8_K `bsums` (Q4_K: the two 16-element sums of each
//!   sub-block added on the scalar side first). The f32 chain then runs lane-wise, 16 rows
//!   at once.
//! * **Cost.** Per (16 rows, token, super-block) 64 `vpdpbusd`, 8 (Q6_K 16) multiplies and
//!   adds, 4 (Q6_K 8) `vpdpwssd` and ~6 float operations: ~6-7 vector operations per (row, token,
//!   super-block) against ~16 in `gemv_sb`, whose reduction dominates once the weights are
//!   shared by several tokens. The repack (gathers, once per call and panel) costs about a
//!   token's worth, so `gemv_sb` stays the path for fewer tokens (see [`kernel`]).
//!
//! Layouts: `w` is `n` consecutive weight rows of `rb` bytes (whole blocks), each `xs[t]` a
//! Q8_K row of the same width prepared by `gemv_sb::prepare` (Q4_K: the middle 32-byte chunks
//! of each 128-element half swapped; Q6_K: plain), `outs[t]` the `n` results of token `t`.

use kapitsa_base::GgmlType;

use super::gemv_sb::GemvMultiFn;

/// The rows-in-lanes multi-token GEMV for `ty` (Q4_K, Q6_K on x86-64) and the smallest token
/// count it should take (below it `gemv_sb`'s multi-token kernel is as fast: the repack costs
/// about a token's worth; Q6_K's, which also assembles the 6-bit quants, more), or `None`.
/// Same contract as [`GemvMultiFn`]; callers use it only where the super-block order applies
/// (`SimdLevel::Avx512Vnni` and up, which imply the AVX-512 VNNI features it needs). Both
/// kernels compute every output with the same operations, so the threshold never changes
/// results.
///
/// Q4_K's threshold depends on the CPU: on AMD (Zen 4, whose 512-bit shuffles the repack
/// leans on run at half rate) a 4-token pass of the 1.5B cost 2.25 one-token steps with
/// this kernel and 1.76 with `gemv_sb`'s, 8 tokens 3.22 against 3.87 (`kapitsa bench
/// --verify-cost`, 2 threads), so it starts at 6 there; 4 elsewhere (measured on the AMX
/// Xeon, where the crossover is lower).
pub(crate) fn kernel(ty: GgmlType) -> Option<(GemvMultiFn, usize)> {
    #[cfg(target_arch = "x86_64")]
    {
        match ty {
            GgmlType::Q4_K => Some((imp::multi::<false>, if is_amd() { 6 } else { 4 })),
            GgmlType::Q6_K => Some((imp::multi::<true>, 6)),
            _ => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        None
    }
}

/// Whether the CPU's vendor is AMD (CPUID leaf 0), read once.
#[cfg(target_arch = "x86_64")]
fn is_amd() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMD.get_or_init(|| {
        let r = std::arch::x86_64::__cpuid(0);
        let mut v = [0u8; 12];
        v[0..4].copy_from_slice(&r.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&r.edx.to_le_bytes());
        v[8..12].copy_from_slice(&r.ecx.to_le_bytes());
        &v == b"AuthenticAMD"
    })
}

/// Vectors of one super-block's record: 64 quad vectors, 16 i32 scale vectors (Q4_K: 8),
/// 8 i16-pair vectors (Q4_K: mins, Q6_K: scales), `d`, `dmin` (Q4_K only).
const VPB: usize = 90;

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;
    use std::cell::UnsafeCell;

    use super::VPB;
    use crate::quant::dot_avx512::vpdpwssd;

    /// Rows of a panel (the lanes).
    const P: usize = 16;
    /// Tokens per pass over a record chunk (their chains interleave to hide latency).
    const NT: usize = 4;
    /// Tokens whose f32 chains one panel keeps (an array of vectors): a token block. A
    /// panel's repacked chunk serves all of them, so prefill batches pay the repack once per
    /// 256 tokens (measured best of 64, 128, 256, 512 on the 1.5B's shapes); the task's raw
    /// rows are read again (from L2/L3) per block.
    const MT: usize = 256;
    /// Super-blocks per repacked chunk (4 x 90 x 64 bytes = 23 KiB, inside L1).
    const CHB: usize = 4;
    /// Record offsets: quads, i32 scales, i16 pairs, `d`, `dmin`.
    const R_SC: usize = 64;
    const R_PAIR: usize = 80;
    const R_D: usize = 88;
    const R_DMIN: usize = 89;

    thread_local! {
        /// The repacked chunk of the current panel, kept per thread.
        static REC: UnsafeCell<[__m512i; CHB * VPB]> =
            // SAFETY: all-zero bits are valid `__m512i` values (plain integer lanes).
            const { UnsafeCell::new(unsafe { std::mem::zeroed() }) };
    }

    /// Byte offset in a prepared Q8_K block of the 4 activation quants of quad `g` (elements
    /// `4g..4g + 4` of the sub-block order the records use). Q6_K: plain layout. Q4_K: quad
    /// `g = 16c + 8h + k` is element `64c + 32h + 4k` (`h` = high nibble), and `prepare`
    /// swapped the middle chunks of each 128-element half.
    const fn x_offset(q6: bool, g: usize) -> usize {
        if q6 {
            return 4 + 4 * g;
        }
        let (c, h, k) = (g / 16, (g / 8) % 2, g % 8);
        4 + (c / 2) * 128 + 64 * h + (c % 2) * 32 + 4 * k
    }

    /// [`x_offset`] of every quad, at compile time.
    const fn x_offsets(q6: bool) -> [usize; 64] {
        let mut t = [0; 64];
        let mut g = 0;
        while g < 64 {
            t[g] = x_offset(q6, g);
            g += 1;
        }
        t
    }

    /// Permute indices of [`transpose16`]'s rounds (lane bit 3, 2, 1, 0): for the first and
    /// the second vector of each pair.
    const fn swap_idx(h: usize) -> [[i32; P]; 2] {
        let mut t = [[0i32; P]; 2];
        let mut c = 0;
        while c < P {
            if c & h == 0 {
                t[0][c] = c as i32;
                t[1][c] = (c ^ h) as i32;
            } else {
                t[0][c] = (16 + (c ^ h)) as i32;
                t[1][c] = (16 + c) as i32;
            }
            c += 1;
        }
        t
    }

    /// The rounds' indices, at compile time.
    const SWAP: [[[i32; P]; 2]; 4] = [swap_idx(8), swap_idx(4), swap_idx(2), swap_idx(1)];

    /// One round of [`transpose16`] on the rows `rows` (those with bit `h` clear).
    #[inline(always)]
    fn swap_round(m: &mut [__m512i; P], k: usize, rows: &[usize]) {
        let h = 8 >> k;
        // SAFETY: this module calls it only from `#[target_feature]` functions with AVX-512F
        // (`repack`), into which it is inlined; the index arrays are 16 i32 each (unaligned
        // loads).
        unsafe {
            let lo = _mm512_loadu_si512(SWAP[k][0].as_ptr().cast());
            let hi = _mm512_loadu_si512(SWAP[k][1].as_ptr().cast());
            for &r in rows {
                let (a, b) = (m[r], m[r | h]);
                m[r] = _mm512_permutex2var_epi32(a, lo, b);
                m[r | h] = _mm512_permutex2var_epi32(a, hi, b);
            }
        }
    }

    /// `m[r]` lane `c` to `m[c]` lane `r` (a 16 x 16 transpose of dwords): four rounds of
    /// two-source permutes, each swapping one bit of the row and lane indices.
    #[inline(always)]
    fn transpose16(m: &mut [__m512i; P]) {
        swap_round(m, 0, &[0, 1, 2, 3, 4, 5, 6, 7]);
        swap_round(m, 1, &[0, 1, 2, 3, 8, 9, 10, 11]);
        swap_round(m, 2, &[0, 1, 4, 5, 8, 9, 12, 13]);
        swap_round(m, 3, &[0, 2, 4, 6, 8, 10, 12, 14]);
    }

    /// [`transpose16`] of a matrix whose lanes 4..16 are not needed: only `m[0..4]` are
    /// valid afterwards (20 permutes instead of 64).
    #[inline(always)]
    fn transpose16x4(m: &mut [__m512i; P]) {
        // SAFETY: as in `swap_round`.
        unsafe {
            let lo = _mm512_loadu_si512(SWAP[0][0].as_ptr().cast());
            for r in 0..8 {
                m[r] = _mm512_permutex2var_epi32(m[r], lo, m[r | 8]);
            }
            let lo = _mm512_loadu_si512(SWAP[1][0].as_ptr().cast());
            for r in 0..4 {
                m[r] = _mm512_permutex2var_epi32(m[r], lo, m[r | 4]);
            }
        }
        swap_round(m, 2, &[0, 1]);
        swap_round(m, 3, &[0, 2]);
    }

    /// Loads 16 (`N4`: 4) dwords of each panel row at byte `at` (rows past `nr`: zeros) and
    /// transposes them: `out[i]` lane `r` = row `r`'s dword `i` (`N4`: `i < 4` only).
    #[inline(always)]
    fn rows_dwords<const N4: bool>(g: &[u8], rb: usize, nr: usize, at: usize) -> [__m512i; P] {
        let n = if N4 { 16 } else { 64 };
        // SAFETY: as in `swap_round`.
        let mut m = [unsafe { _mm512_setzero_si512() }; P];
        for (r, mr) in m.iter_mut().enumerate().take(nr) {
            let b = &g[r * rb + at..r * rb + at + n];
            // SAFETY: `b` is 64 (`N4`: 16) readable bytes; unaligned loads; AVX-512F as
            // above.
            *mr = unsafe {
                if N4 {
                    _mm512_castsi128_si512(_mm_loadu_si128(b.as_ptr().cast()))
                } else {
                    _mm512_loadu_si512(b.as_ptr().cast())
                }
            };
        }
        if N4 {
            transpose16x4(&mut m);
        } else {
            transpose16(&mut m);
        }
        m
    }

    /// Repacks super-block `s` of the panel (rows `g[r * rb..]`, `nr` of them; lanes past
    /// `nr` get zeros) into `rec` (`VPB` vectors).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    fn repack<const Q6: bool>(g: &[u8], rb: usize, nr: usize, s: usize, rec: &mut [__m512i]) {
        let ts = if Q6 { 210 } else { 144 };
        let at = s * ts;
        let m4 = _mm512_set1_epi8(0x0F);
        if !Q6 {
            // Quant dword i (bytes 16 + 4i): low nibbles are quad 16c + k, high nibbles quad
            // 16c + 8 + k (c = i / 8, k = i % 8).
            for half in 0..2 {
                let q = rows_dwords::<false>(g, rb, nr, at + 16 + 64 * half);
                for (j, v) in q.into_iter().enumerate() {
                    let i = 16 * half + j;
                    let (c, k) = (i / 8, i % 8);
                    rec[16 * c + k] = _mm512_and_si512(v, m4);
                    rec[16 * c + 8 + k] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                }
            }
            // Scales and mins (`blocks::scale_min_k4`), lane-wise on the three scale dwords.
            let hd = rows_dwords::<true>(g, rb, nr, at);
            let (dd, a, b, c) = (hd[0], hd[1], hd[2], hd[3]);
            let m1 = _mm512_set1_epi32(0x3f3f_3f3f);
            let m2 = _mm512_set1_epi32(0x0f0f_0f0f);
            let m3 = _mm512_set1_epi32(0x0303_0303);
            let top = |v: __m512i| {
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(v), m3))
            };
            let sc = [
                _mm512_and_si512(a, m1),
                _mm512_or_si512(_mm512_and_si512(c, m2), top(a)),
            ];
            let mn = [
                _mm512_and_si512(b, m1),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(c), m2), top(b)),
            ];
            let ff = _mm512_set1_epi32(0xFF);
            let mut m8 = [_mm512_setzero_si512(); 8];
            for j in 0..8 {
                let sh = _mm512_set1_epi32(8 * (j as i32 % 4));
                rec[R_SC + j] = _mm512_and_si512(_mm512_srlv_epi32(sc[j / 4], sh), ff);
                m8[j] = _mm512_and_si512(_mm512_srlv_epi32(mn[j / 4], sh), ff);
            }
            // the mins of sub-blocks 2i and 2i + 1 as one i16 pair (vectors 4..8 unused)
            for i in 0..4 {
                rec[R_PAIR + i] =
                    _mm512_or_si512(m8[2 * i], _mm512_slli_epi32::<16>(m8[2 * i + 1]));
            }
            rec[R_D] = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)));
            rec[R_DMIN] =
                _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<
                    16,
                >(dd))));
        } else {
            // Each row's 256 unsigned 6-bit quants (`dequant::q6k_values` plus 32), as four
            // vectors: per half n, elements 128n + 0..64 from the low nibbles and
            // 128n + 64..128 from the high nibbles of `ql[64n..64n + 64]`, bits 4..6 from `qh`
            // (bit pairs 0, 1 / 2, 3 / 4, 5 / 6, 7 for the four 32-element quarters).
            let halves = |lo: i16, hi: i16| {
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
                    _mm256_set1_epi16(hi),
                )
            };
            let (sl, sr) = (halves(4, 2), halves(0, 2));
            let m30 = _mm512_set1_epi8(0x30);
            // Row r's four vectors go to rec[16k + r], then each block of 16 is transposed.
            let mut dw = [0u32; P];
            for r in nr..P {
                for k in 0..4 {
                    rec[16 * k + r] = _mm512_setzero_si512();
                }
            }
            for r in 0..nr {
                let b = &g[r * rb + at..r * rb + at + ts];
                for n in 0..2 {
                    let ql = &b[64 * n..64 * n + 64];
                    let qh = &b[128 + 32 * n..128 + 32 * n + 32];
                    // SAFETY: `ql` is 64 and `qh` 32 readable bytes; unaligned loads.
                    let (vl, vh) = unsafe {
                        (
                            _mm512_loadu_si512(ql.as_ptr().cast()),
                            _mm512_broadcast_i64x4(_mm256_loadu_si256(qh.as_ptr().cast())),
                        )
                    };
                    rec[16 * (2 * n) + r] = _mm512_or_si512(
                        _mm512_and_si512(vl, m4),
                        _mm512_and_si512(_mm512_sllv_epi16(vh, sl), m30),
                    );
                    rec[16 * (2 * n + 1) + r] = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(vl), m4),
                        _mm512_and_si512(_mm512_srlv_epi16(vh, sr), m30),
                    );
                }
                // d: the high half of the dword at 206 (the block ends at 210).
                dw[r] = u32::from_le_bytes([b[206], b[207], b[208], b[209]]);
            }
            for k in 0..4 {
                let mut m: [__m512i; P] = std::array::from_fn(|r| rec[16 * k + r]);
                transpose16(&mut m);
                for (i, v) in m.into_iter().enumerate() {
                    rec[16 * k + i] = v;
                }
            }
            // The 16 signed scales (bytes 192..208), sign-extended, and as i16 pairs.
            let sd = rows_dwords::<true>(g, rb, nr, at + 192);
            for j in 0..16 {
                let up = _mm512_set1_epi32(24 - 8 * (j as i32 % 4));
                rec[R_SC + j] = _mm512_srai_epi32::<24>(_mm512_sllv_epi32(sd[j / 4], up));
            }
            let lo16 = _mm512_set1_epi32(0xFFFF);
            for i in 0..8 {
                rec[R_PAIR + i] = _mm512_or_si512(
                    _mm512_and_si512(rec[R_SC + 2 * i], lo16),
                    _mm512_slli_epi32::<16>(rec[R_SC + 2 * i + 1]),
                );
            }
            // SAFETY: `dw` is 16 u32; an unaligned load.
            let dv = unsafe { _mm512_loadu_si512(dw.as_ptr().cast()) };
            rec[R_D] =
                _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<
                    16,
                >(dv))));
        }
    }

    /// `NTG` tokens (`xs`, super-blocks `s0..s0 + n` at record `rec`) added to their f32
    /// chains `acc` (16 rows in the lanes).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    fn pass<const Q6: bool, const NTG: usize>(
        rec: &[__m512i],
        s0: usize,
        n: usize,
        xs: [&[u8]; NTG],
        acc: &mut [__m512; NTG],
    ) {
        let xo = const { [x_offsets(false), x_offsets(true)] };
        let xo = &xo[Q6 as usize];
        // Quads per sub-block and sub-blocks per super-block.
        let (sq, ns) = if Q6 { (4, 16) } else { (8, 8) };
        let z = _mm512_setzero_si512();
        assert!(xs.iter().all(|x| x.len() >= (s0 + n) * 292));
        for b in 0..n {
            let r = &rec[b * VPB..(b + 1) * VPB];
            // Token k's block s0 + b (292 bytes, inside xs[k]: checked above).
            let mut yp = [std::ptr::null::<u8>(); NTG];
            for (p, x) in yp.iter_mut().zip(xs) {
                // SAFETY: (s0 + b + 1) * 292 <= x.len() (checked before the loop).
                *p = unsafe { x.as_ptr().add((s0 + b) * 292) };
            }
            // 4 bytes of token k's block at `o` in every lane.
            let bcast = |k: usize, o: usize| {
                // SAFETY: `o` is an `x_offset` (at most 256) or a `bsums` offset (at most
                // 288), so o + 4 <= 292, the length of the block at `yp[k]`; unaligned read.
                let v = unsafe { yp[k].add(o).cast::<i32>().read_unaligned() };
                _mm512_set1_epi32(v)
            };
            // Q4_K: the bsums of sub-blocks 2i and 2i + 1 (each the sum of two 16-element
            // bsums, |.| <= 32 * 128) as one i16 pair, in every lane.
            let bs_pair = |k: usize, i: usize| {
                let bs = |l: usize| {
                    // SAFETY: l < 16, and the 16 i16 bsums are bytes 260..292 of the block at
                    // `yp[k]`; unaligned read.
                    i32::from(unsafe { yp[k].add(260 + 2 * l).cast::<i16>().read_unaligned() })
                };
                let (lo, hi) = (bs(4 * i) + bs(4 * i + 1), bs(4 * i + 2) + bs(4 * i + 3));
                _mm512_set1_epi32((lo & 0xFFFF) | (hi << 16))
            };
            let mut t = [z; NTG];
            // Two sub-blocks at a time: 2 x NTG independent `vpdpbusd` chains.
            for jp in 0..ns / 2 {
                let (j0, j1) = (2 * jp, 2 * jp + 1);
                let mut a0 = [z; NTG];
                let mut a1 = [z; NTG];
                for q in 0..sq {
                    let (g0, g1) = (j0 * sq + q, j1 * sq + q);
                    let (w0, w1) = (r[g0], r[g1]);
                    for k in 0..NTG {
                        a0[k] = _mm512_dpbusd_epi32(a0[k], w0, bcast(k, xo[g0]));
                        a1[k] = _mm512_dpbusd_epi32(a1[k], w1, bcast(k, xo[g1]));
                    }
                }
                for k in 0..NTG {
                    t[k] = _mm512_add_epi32(t[k], _mm512_mullo_epi32(a0[k], r[R_SC + j0]));
                    t[k] = _mm512_add_epi32(t[k], _mm512_mullo_epi32(a1[k], r[R_SC + j1]));
                }
            }
            let d = _mm512_castsi512_ps(r[R_D]);
            for k in 0..NTG {
                let mut m = z;
                if Q6 {
                    // the scales of 16-element sub-blocks 2i, 2i + 1 against their bsums
                    for i in 0..8 {
                        m = vpdpwssd(m, r[R_PAIR + i], bcast(k, 260 + 4 * i));
                    }
                } else {
                    // the mins of sub-blocks 2i, 2i + 1 against their 32-element bsums
                    for i in 0..4 {
                        m = vpdpwssd(m, r[R_PAIR + i], bs_pair(k, i));
                    }
                }
                // SAFETY: the block's `d` (f32) is its first 4 bytes.
                let yd = _mm512_set1_ps(unsafe { yp[k].cast::<f32>().read_unaligned() });
                let dy = _mm512_mul_ps(d, yd);
                if Q6 {
                    let iv = _mm512_sub_epi32(t[k], _mm512_slli_epi32::<5>(m));
                    acc[k] = _mm512_fmadd_ps(dy, _mm512_cvtepi32_ps(iv), acc[k]);
                } else {
                    acc[k] = _mm512_fmadd_ps(dy, _mm512_cvtepi32_ps(t[k]), acc[k]);
                    let dmy = _mm512_mul_ps(_mm512_castsi512_ps(r[R_DMIN]), yd);
                    acc[k] = _mm512_fnmadd_ps(dmy, _mm512_cvtepi32_ps(m), acc[k]);
                }
            }
        }
    }

    /// [`pass`] over the first `N` tokens of `x` (at least `N`), their chains in `a[..N]`;
    /// returns `N`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    fn pass_n<const Q6: bool, const N: usize>(
        rec: &[__m512i],
        s0: usize,
        cn: usize,
        x: &[&[u8]],
        a: &mut [__m512],
    ) -> usize {
        let mut c: [__m512; N] = std::array::from_fn(|k| a[k]);
        pass::<Q6, N>(rec, s0, cn, std::array::from_fn(|k| x[k]), &mut c);
        a[..N].copy_from_slice(&c);
        N
    }

    /// The kernel of [`super::kernel`] (`Q6`: Q6_K, else Q4_K).
    ///
    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ, VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn multi<const Q6: bool>(
        w: &[u8],
        rb: usize,
        xs: &[&[u8]],
        outs: &mut [&mut [f32]],
    ) {
        let ts: usize = if Q6 { 210 } else { 144 };
        if xs.len() != outs.len() || rb == 0 {
            return;
        }
        let n = outs.iter().fold(w.len() / rb, |m, o| m.min(o.len()));
        // The row-group kernels' shared limit on row size (gather offsets are i32).
        if i32::try_from(P * rb + ts).is_err() {
            for o in outs.iter_mut() {
                o.fill(0.0);
            }
            return;
        }
        // rows 0..n are all stored below; only the rows past the weights are zeroed here
        for o in outs.iter_mut() {
            o[n..].fill(0.0);
        }
        let nb = xs.iter().fold(rb / ts, |m, x| m.min(x.len() / 292));
        // SAFETY: the cell lives as long as this thread; this function is its only user and
        // never re-enters itself, so no other reference to it exists during the call.
        let rec = unsafe { &mut *REC.with(|c| c.get()) };
        for (xc, oc) in xs.chunks(MT).zip(outs.chunks_mut(MT)) {
            let mut r0 = 0;
            while r0 < n {
                let nr = (n - r0).min(P);
                let g = &w[r0 * rb..(r0 + nr) * rb];
                let mut acc = [_mm512_setzero_ps(); MT];
                let mut s0 = 0;
                while s0 < nb {
                    let cn = (nb - s0).min(CHB);
                    for b in 0..cn {
                        // The lines of the super-block a chunk ahead (of this panel, or of the
                        // next panel's first chunk), so the 16 row streams come from memory
                        // while this chunk is computed.
                        let ahead = s0 + b + CHB;
                        let (pr, ps) = if ahead < nb {
                            (r0, ahead)
                        } else {
                            (r0 + P, ahead - nb)
                        };
                        if ps < nb {
                            for r in pr..(pr + P).min(n) {
                                let a = r * rb + ps * ts;
                                let mut l = a & !63;
                                while l < a + ts {
                                    // (A prefetch hint never faults, whatever the address;
                                    // `wrapping_add`: no pointer arithmetic.)
                                    _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(l).cast());
                                    l += 64;
                                }
                            }
                        }
                        repack::<Q6>(g, rb, nr, s0 + b, &mut rec[b * VPB..(b + 1) * VPB]);
                    }
                    // Passes of at most NT tokens, as even as possible (a lone token's two
                    // chains would wait on `vpdpbusd` latency).
                    let passes = xc.len().div_ceil(NT);
                    let mut t0 = 0;
                    for p in 0..passes {
                        let rec = &rec[..cn * VPB];
                        let a = &mut acc[t0..];
                        let len = (xc.len() - t0) / (passes - p);
                        let x = &xc[t0..t0 + len];
                        let step = match x.len() {
                            1 => pass_n::<Q6, 1>(rec, s0, cn, x, a),
                            2 => pass_n::<Q6, 2>(rec, s0, cn, x, a),
                            3 => pass_n::<Q6, 3>(rec, s0, cn, x, a),
                            _ => pass_n::<Q6, NT>(rec, s0, cn, x, a),
                        };
                        t0 += step;
                    }
                    s0 += cn;
                }
                // the first nr lanes, stored straight into each token's output
                let keep: __mmask16 = if nr >= P { !0 } else { (1u16 << nr) - 1 };
                for (o, a) in oc.iter_mut().zip(acc) {
                    let dst = &mut o[r0..r0 + nr];
                    // SAFETY: `dst` holds nr <= 16 f32 and the mask writes only lanes < nr.
                    unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), keep, a) };
                }
                r0 += nr;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dot_sb, gemv_sb, quantize_row, SimdLevel};

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
        let fields: &[usize] = if ty == GgmlType::Q6_K {
            &[208]
        } else {
            &[0, 2]
        };
        for b in w.chunks_exact_mut(ty.type_size()) {
            for &o in fields {
                let v = ((rng(seed) % 2000) as f32 - 1000.0) * 1e-6;
                b[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        w
    }

    /// A random Q8_K row (with a few extreme activations, so the quants reach +-127).
    fn q8k_row(n_in: usize, seed: &mut u64) -> Vec<u8> {
        let xf: Vec<f32> = (0..n_in)
            .map(|i| {
                let v = (rng(seed) % 20001) as f32 / 1e4 - 1.0;
                if i % 97 == 5 {
                    v * 50.0
                } else {
                    v
                }
            })
            .collect();
        let mut q = vec![0u8; GgmlType::Q8_K.row_bytes(n_in).unwrap()];
        quantize_row(GgmlType::Q8_K, &xf, &mut q).unwrap();
        q
    }

    /// Every (token, row) output equals the scalar twin of the super-block order bit for
    /// bit: 1 to 17 tokens (every pass remainder, more than one group of 16), row counts
    /// around the 16-row panels, widths of 1 to 35 super-blocks (around the 4-block chunks).
    #[test]
    fn rows_in_lanes_equal_scalar_twin_bitwise() {
        if !SimdLevel::Avx512Vnni.is_available() {
            eprintln!("skipped: no AVX-512 VNNI on this CPU");
            return;
        }
        let mut seed = 0x5DEE_CE66_D1CE_4E5Bu64;
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
            let f = kernel(ty).unwrap().0;
            for (n_in, rows) in [(256, 17), (1024, 16), (1280, 5), (8960, 33), (1536, 31)] {
                let rb = ty.row_bytes(n_in).unwrap();
                let w = weights(ty, rows, n_in, &mut seed);
                for n_tok in [1, 2, 3, 4, 5, 7, 9, 16, 17, 70, 131] {
                    let xq: Vec<Vec<u8>> = (0..n_tok).map(|_| q8k_row(n_in, &mut seed)).collect();
                    let xp: Vec<Vec<u8>> = xq
                        .iter()
                        .map(|q| {
                            let mut p = q.clone();
                            gemv_sb::prepare(ty, &mut p);
                            p
                        })
                        .collect();
                    let xs: Vec<&[u8]> = xp.iter().map(|p| p.as_slice()).collect();
                    // (3 outputs past the weights' rows: zeroed, not left as they were)
                    let mut got = vec![vec![f32::NAN; rows + 3]; n_tok];
                    let mut outs: Vec<&mut [f32]> =
                        got.iter_mut().map(|g| g.as_mut_slice()).collect();
                    // SAFETY: AVX-512 VNNI (checked above) gives the kernel's features.
                    unsafe { f(&w, rb, &xs, &mut outs) };
                    for (t, g) in got.iter().enumerate() {
                        assert!(g[rows..].iter().all(|&v| v == 0.0), "tail of token {t}");
                        for (r, wr) in w.chunks_exact(rb).enumerate() {
                            let e = dot_sb::dot_scalar(ty, wr, &xq[t]);
                            assert_eq!(
                                g[r].to_bits(),
                                e.to_bits(),
                                "{ty:?} n_in {n_in} token {t}/{n_tok} row {r}/{rows}: {} vs {e}",
                                g[r]
                            );
                        }
                    }
                }
            }
        }
    }
}
