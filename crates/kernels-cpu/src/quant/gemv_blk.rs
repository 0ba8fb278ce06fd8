//! Decode GEMV for Q8_0 and Q5_0 in the block order of `dot_blk`: the single-token path at
//! [`SimdLevel::Amx`](super::SimdLevel::Amx), and (with one output) its per-row dot product.
//!
//! Every output is bit-identical to the scalar twin `dot_blk::dot_scalar` for its row: per
//! block `b` the exact integer `T_b = sum_i w_i q_i`, then one f32 chain per row,
//! `acc = fma(d_w * d_x, T_b as f32, acc)`, blocks in order, starting from 0. What differs is
//! how the work is laid out:
//!
//! * **Sixteen rows at a time.** The 16 rows of a group are read side by side, block by block.
//!   Per block, each row's 32 products go through one `vpdpbusd` (two rows per 512-bit vector,
//!   8 lane sums each), one transposing add tree reduces the 16 rows' lane sums to one vector
//!   of the 16 `T_b`, and the 16 rows' chains run in the 16 lanes of one vector (the same
//!   multiply and FMA per block as the scalar twin, lane by lane). The integers are exact
//!   however they are summed, so only the chain fixes the result, and it is the twin's.
//! * **Unsigned weights, corrected exactly.** `vpdpbusd` multiplies unsigned by signed bytes.
//!   Q8_0 weights are fed as `w + 128` (the sign bit flipped), Q5_0 weights as their 5-bit
//!   value `w + 16` (0..31); each row's lane sums start from `-128` (`-16`) times the
//!   activation block's lane sums, so the tree yields `T_b` itself (all in i32, exact).
//! * **Scales by scalar loads.** The 16 rows' f16 `d_w` of block `b` (at the same offset of
//!   every row) are read as 16 u16 into a small array and widened with one `vcvtph2ps`. (A
//!   dword gather was several times slower on this VM.)
//! * **Prefetch by groups.** Each block step requests one block column's share (16 blocks'
//!   bytes) of the next row group into L2, a linear sweep one group ahead of the group being
//!   read side by side. Measured on one core (151936 x 896 Q8_0): an L1 prefetch on top changed
//!   nothing, two groups ahead was no better, and without software prefetch it took ~30% longer.
//! * **Partial groups** (the last `n % 16` rows, or a single-row dot product) compute only the
//!   vectors holding real rows; the other lanes are never stored.
//!
//! Layouts: `w` is `n` consecutive weight rows of `rb` bytes, `nb` whole blocks each (Q8_0:
//! 34-byte blocks, f16 `d` then 32 i8 quants; Q5_0: 22-byte blocks, f16 `d`, u32 `qh`, 16
//! bytes of nibbles; see `dot_blk::decode`); `x` one plain Q8_0 activation row of `nb` 34-byte
//! blocks (f16 scale, 32 i8 quants), not rearranged; `out` the `n` results.

use kapitsa_base::GgmlType;

use super::gemv_sb::GemvFn;

/// The block-order GEMV for `ty` (Q8_0, Q5_0 on x86-64), else None.
///
/// The function computes `out[r] = dot_blk::dot_scalar(ty, &w[r * rb..(r + 1) * rb], x)` for
/// every `r < out.len()`, bit for bit, with `x` a plain Q8_0 row. Reads only inside `w` and
/// `x`; rows past the end of `w` are not computed and give 0; blocks past the end of `x` are
/// not summed (as the twin's `zip`). Callers must only call it on CPUs with AVX-512F/BW/VL/DQ,
/// VNNI, AVX2, FMA and F16C (implied by `SimdLevel::Amx`).
pub(crate) fn kernel(ty: GgmlType) -> Option<GemvFn> {
    #[cfg(target_arch = "x86_64")]
    {
        match ty {
            GgmlType::Q8_0 => Some(imp::rows::<0> as GemvFn),
            GgmlType::Q5_0 => Some(imp::rows::<1> as GemvFn),
            _ => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    use crate::quant::dot_avx512::reduce_lanes8;
    use crate::quant::dot_blk::XB;

    /// Rows whose chains share one vector.
    const R: usize = 16;

    /// The rows of the 8 vectors fed to [`reduce16`]: vector `k` holds row `PAIR[k].0` in its
    /// low 256 bits and row `PAIR[k].1` in its high 256 bits, so that the tree's output lanes
    /// come out in row order.
    const PAIR: [(usize, usize); 8] = [
        (0, 4),
        (1, 5),
        (2, 6),
        (3, 7),
        (8, 12),
        (9, 13),
        (10, 14),
        (11, 15),
    ];

    /// Loads 32 bytes of `p` at `o` (bounds-checked).
    #[inline(always)]
    fn ld256(p: &[u8], o: usize) -> __m256i {
        let s = &p[o..o + 32];
        // SAFETY: `s` is 32 readable bytes; the load is unaligned; AVX is baseline for the
        // callers (all are `#[target_feature]` functions of this module).
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    /// Loads 16 bytes of `p` at `o` (bounds-checked).
    #[inline(always)]
    fn ld128(p: &[u8], o: usize) -> __m128i {
        let s = &p[o..o + 16];
        // SAFETY: `s` is 16 readable bytes; the load is unaligned; SSE2 is baseline on x86-64.
        unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
    }

    /// Requests every cache line that starts in `a..a + len` (an address as an integer) with
    /// prefetch hint `H`. A hint: it never dereferences or faults, whatever the address (past
    /// the end of the weights, too), and changes no result.
    #[inline(always)]
    fn prefetch_range<const H: i32>(a: usize, len: usize) {
        let end = a.wrapping_add(len);
        let mut l = a.wrapping_add(63) & !63;
        while l < end {
            // SAFETY: prefetching is a hint that never dereferences or faults; SSE is baseline
            // on x86-64.
            unsafe { _mm_prefetch::<H>(l as *const i8) };
            l += 64;
        }
    }

    /// Two Q8_0 blocks (`a`, `b`: 34 bytes each) as unsigned weights `w + 128` (the quants with
    /// the sign bit flipped): `a`'s 32 in the low 256 bits, `b`'s in the high.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2")]
    fn q8_pair(a: &[u8], b: &[u8]) -> __m512i {
        let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld256(a, 2)), ld256(b, 2));
        _mm512_xor_si512(z, _mm512_set1_epi8(0x80u8 as i8))
    }

    /// Two Q5_0 blocks (`a`, `b`: 22 bytes each) as unsigned weights `w + 16` (the 5-bit values
    /// 0..31, element `j < 16` from the low nibble of quant byte `j`, element `j + 16` from its
    /// high nibble, bit 4 from bit `j` (`j + 16`) of `qh`): `a`'s 32 in the low 256 bits, `b`'s
    /// in the high. `shift` holds 0 in 128-bit lanes 0 and 2, 4 in lanes 1 and 3 (as i16).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2")]
    fn q5_pair(a: &[u8], b: &[u8], shift: __m512i) -> __m512i {
        let qa = _mm256_broadcastsi128_si256(ld128(a, 6));
        let qb = _mm256_broadcastsi128_si256(ld128(b, 6));
        // [qs_a, qs_a >> 4, qs_b, qs_b >> 4] & 0xF: the nibbles in element order.
        let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qa), qb);
        let nib = _mm512_and_si512(_mm512_srlv_epi16(z, shift), _mm512_set1_epi8(0xF));
        let qh = |p: &[u8]| u64::from(u32::from_le_bytes([p[2], p[3], p[4], p[5]]));
        let k: __mmask64 = qh(a) | qh(b) << 32;
        // nib | 0x10 where the element's qh bit is set (bit 4 of `nib` is clear).
        _mm512_mask_add_epi8(nib, k, nib, _mm512_set1_epi8(0x10))
    }

    /// The transposing add tree: lane `l` of the result is the sum of the 8 i32 lanes row `l`
    /// occupies in `u` (placed as [`PAIR`] says). Exact (i32 adds of exact integers).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2")]
    fn reduce16(u: &[__m512i; 8]) -> __m512i {
        // Per 128-bit lane L: [sum_L u0, sum_L u1, sum_L u2, sum_L u3] (p: u0..u3, q: u4..u7).
        let (p, q) = reduce_lanes8(u);
        // Lanes 0, 1 of p: rows 0..4; 2, 3: rows 4..8; of q: rows 8..12, 12..16.
        _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0x88>(p, q),
            _mm512_shuffle_i32x4::<0xDD>(p, q),
        )
    }

    /// Per-call constants of [`rows`].
    struct Consts {
        /// The bias the unsigned weights carry, as bytes: 128 (Q8_0), 16 (Q5_0).
        bias: __m512i,
        /// Q5_0 nibble shifts for [`q5_pair`].
        shift: __m512i,
    }

    /// The 16 lanes' chains over the `nb` blocks of one row group (`rows`: 16 whole weight
    /// rows; with `FULL` false only the first `nr` are used, the rest are repeats whose lanes
    /// hold garbage). Returns the accumulators, lane `r` the result of row `r`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    fn group<const K: u8, const FULL: bool>(
        rows: &[&[u8]; R],
        nr: usize,
        nb: usize,
        x: &[u8],
        k: &Consts,
        ahead: usize,
    ) -> __m512 {
        let bb: usize = if K == 0 { 34 } else { 22 };
        let col = R * bb;
        let zero = _mm512_setzero_si512();
        let base = rows[0].as_ptr() as usize;
        let mut acc = _mm512_setzero_ps();
        for b in 0..nb {
            // The group `ahead` bytes on, one block column's share per block (into L2).
            prefetch_range::<_MM_HINT_T1>(base.wrapping_add(ahead + b * col), col);
            let y = &x[b * XB..(b + 1) * XB];
            let yq = _mm512_broadcast_i64x4(ld256(y, 2));
            // -bias times the activation lane sums: every row's starting lane sums.
            let c = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, k.bias, yq));
            let blk = |r: usize| &rows[r][b * bb..(b + 1) * bb];
            let mut u = [zero; 8];
            for (uk, &(lo, hi)) in u.iter_mut().zip(&PAIR) {
                if !FULL && lo >= nr {
                    continue;
                }
                let v = if K == 0 {
                    q8_pair(blk(lo), blk(hi))
                } else {
                    q5_pair(blk(lo), blk(hi), k.shift)
                };
                *uk = _mm512_dpbusd_epi32(c, v, yq);
            }
            let t = reduce16(&u);
            let mut dbits = [0u16; R];
            for (r, d) in dbits.iter_mut().enumerate().take(if FULL { R } else { nr }) {
                let bl = blk(r);
                *d = u16::from_le_bytes([bl[0], bl[1]]);
            }
            // SAFETY: `dbits` is 32 readable bytes; the load is unaligned.
            let dw = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(dbits.as_ptr().cast()) });
            let dx = _mm512_cvtph_ps(_mm256_set1_epi16(i16::from_le_bytes([y[0], y[1]])));
            acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(t), acc);
        }
        acc
    }

    /// The kernel behind [`super::kernel`]: `K` = 0 (Q8_0), 1 (Q5_0).
    ///
    /// # Safety
    /// Requires AVX-512F/BW/VL/DQ, VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows<const K: u8>(w: &[u8], rb: usize, x: &[u8], out: &mut [f32]) {
        let bb: usize = if K == 0 { 34 } else { 22 };
        if rb == 0 {
            out.fill(0.0);
            return;
        }
        let nb = (rb / bb).min(x.len() / XB);
        let n = out.len().min(w.len() / rb);
        // rows 0..n are all stored below; only outputs past the weights' rows are zeroed here
        out[n..].fill(0.0);
        // Q5_0: 0 in 128-bit lanes 0 and 2, 4 in lanes 1 and 3 (per i16).
        let s4 = 0x0004_0004_0004_0004;
        let k = Consts {
            bias: _mm512_set1_epi8(if K == 0 { 0x80u8 as i8 } else { 16 }),
            shift: _mm512_setr_epi64(0, 0, s4, s4, 0, 0, s4, s4),
        };
        // Prefetch distance: one group.
        let ahead = R * rb;
        let mut r0 = 0;
        while r0 < n {
            let nr = (n - r0).min(R);
            let g = &w[r0 * rb..(r0 + nr) * rb];
            // Rows past `nr` repeat the group's last row (never stored).
            let mut rows: [&[u8]; R] = [g; R];
            for (r, row) in rows.iter_mut().enumerate() {
                let r = r.min(nr - 1);
                *row = &g[r * rb..(r + 1) * rb];
            }
            let acc = if nr == R {
                group::<K, true>(&rows, nr, nb, x, &k, ahead)
            } else {
                group::<K, false>(&rows, nr, nb, x, &k, ahead)
            };
            // the first nr lanes, stored straight into the output
            let keep: __mmask16 = if nr >= R { !0 } else { (1u16 << nr) - 1 };
            let dst = &mut out[r0..r0 + nr];
            // SAFETY: `dst` holds nr <= 16 f32 and the mask writes only lanes < nr.
            unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), keep, acc) };
            r0 += nr;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dot_blk::{block_bytes, dot_scalar, XB};

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    fn features() -> bool {
        is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    /// `rows` random weight rows of `nb` blocks of `ty`: random bytes, scales with |d| in
    /// 1e-4..0.05 of both signs.
    fn weights(ty: GgmlType, rows: usize, nb: usize, seed: &mut u64) -> Vec<u8> {
        let bb = block_bytes(ty).unwrap();
        let mut w: Vec<u8> = (0..rows * nb * bb).map(|_| rng(seed) as u8).collect();
        for b in w.chunks_exact_mut(bb) {
            let m = 1e-4 + (rng(seed) % 10_000) as f32 * (0.05 - 1e-4) / 10_000.0;
            let d = if rng(seed) & 1 == 0 { m } else { -m };
            b[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        }
        w
    }

    /// One Q8_0 activation row of `nb` blocks: random quants (all of -128..127), positive
    /// scales as a quantiser's.
    fn activations(nb: usize, seed: &mut u64) -> Vec<u8> {
        let mut x: Vec<u8> = (0..nb * XB).map(|_| rng(seed) as u8).collect();
        for b in x.chunks_exact_mut(XB) {
            let d = 1e-3 + (rng(seed) % 10_000) as f32 * 1e-6;
            b[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        }
        x
    }

    #[test]
    fn gemv_equals_scalar_twin_bitwise() {
        if !features() {
            eprintln!("skipped: no AVX-512 VNNI on this CPU");
            return;
        }
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
            let f = kernel(ty).unwrap();
            let bb = block_bytes(ty).unwrap();
            for nb in [1usize, 2, 3, 28, 29, 152] {
                let rb = nb * bb;
                for rows in [1usize, 2, 7, 8, 15, 16, 17, 33, 40] {
                    let w = weights(ty, rows, nb, &mut seed);
                    let x = activations(nb, &mut seed);
                    let mut got = vec![f32::NAN; rows];
                    // SAFETY: the CPU has the kernel's features (checked above).
                    unsafe { f(&w, rb, &x, &mut got) };
                    for (r, g) in got.iter().enumerate() {
                        let e = dot_scalar(ty, &w[r * rb..(r + 1) * rb], &x);
                        assert_eq!(
                            g.to_bits(),
                            e.to_bits(),
                            "{ty:?} nb {nb} row {r}/{rows}: {g} vs {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rows_past_the_weights_give_zero() {
        if !features() {
            eprintln!("skipped: no AVX-512 VNNI on this CPU");
            return;
        }
        let mut seed = 0x1234_5678_9ABC_DEF1u64;
        for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
            let f = kernel(ty).unwrap();
            let bb = block_bytes(ty).unwrap();
            let nb = 3;
            let rb = nb * bb;
            for (rows, asked) in [(0usize, 5usize), (3, 20), (16, 17), (17, 40)] {
                let w = weights(ty, rows, nb, &mut seed);
                let x = activations(nb, &mut seed);
                let mut got = vec![f32::NAN; asked];
                // SAFETY: the CPU has the kernel's features (checked above).
                unsafe { f(&w, rb, &x, &mut got) };
                for (r, g) in got.iter().enumerate() {
                    let e = if r < rows {
                        dot_scalar(ty, &w[r * rb..(r + 1) * rb], &x)
                    } else {
                        0.0
                    };
                    assert_eq!(g.to_bits(), e.to_bits(), "{ty:?} row {r}/{rows} of {asked}");
                }
            }
        }
    }
}
