//! Batched GEMM on AMX-INT8 tiles for the 32-element formats Q8_0 and Q5_0 (against Q8_0
//! activations): `y = x · Wᵀ`, every output bit-identical to the block-order dot product of
//! [`crate::quant::dot_blk`], which [`SimdLevel::Amx`](crate::quant::SimdLevel::Amx) uses for
//! every batch size of these formats (decode GEMV included). It runs every batch of two or
//! more tokens at that level: a serving step of a few sequences as well as a 512-token prompt.
//!
//! # The products
//! One `tdpbssd` per block of 32 elements: the weight tile (A: 16 weight rows x 32 signed
//! bytes) times the activation tile (B: 8 rows of 64 bytes, VNNI layout: byte `4n + i` of
//! row `r` is element `4r + i` of token `n`) gives the 16 x 16 exact block sums `T` (row =
//! weight row, lane = token). They are stored and folded into 16 f32 accumulators per weight
//! row, lane = token, with the order's operations: `acc = fma(d_w * d_x, T, acc)`. The block
//! sums of the next two blocks are issued before two blocks are folded, so the vector work
//! overlaps the tile work. After the last block the 16 x 16 accumulators are transposed and
//! stored as rows of `y`.
//!
//! # Layouts
//! An *activation group* holds one block of a *token tile* (16 tokens; padding tokens are
//! zero), [`ACT`] = 576 bytes: the B tile at 0 and the 16 tokens' scales as f32 at 512.
//! Groups are stored tile-major (`[token tile][block]`), so one tile's blocks are one stream.
//! A *record* holds a *row block* (16 weight rows): the 16 rows' scales as f32, `[nb][16]`,
//! and, unless the A tiles are read straight from the weights (Q8_0 row blocks of 16 real
//! rows: the quants sit at byte `34b + 2` of each row, stride = the row's bytes), the signed
//! values as `[nb][16 rows][32]` (Q5_0 decoded; a partial row block zero-padded).
//!
//! # Blocking
//! Activations are quantised and packed once per call (in parallel over token tiles). Row
//! blocks are split into tasks. A task walks the token tiles in chunks whose activations fit
//! in L2; for each of its row blocks it builds the record once per chunk and streams every
//! token tile of the chunk past it.

use std::cell::RefCell;

use kapitsa_base::{GgmlType, ThreadPool};

use crate::gemm::{for_thread_ranges, run_tasks, with_buf, Buf};
use crate::matmul::{QMatrix, SharedMut};
use crate::quant::dot_blk::{self, QK, XB};
use crate::quant::{self, KernelError};

/// Weight rows per row block (the tile height).
const ROWS: usize = 16;
/// Tokens per token tile (the tile width).
const TOKS: usize = 16;
/// Bytes of one activation group.
const ACT: usize = 576;
/// Activation bytes of one chunk of token tiles (kept in the 2 MiB L2 while every row block of
/// a task passes over it).
const CHUNK_BYTES: usize = 1024 * 1024;

/// Where one row block's results go: rows `r0 .. r0 + n_rows` and tokens
/// `t0 .. t0 + n_toks` of `y` (`[n_tok, n_out]`).
struct Out {
    y: SharedMut<f32>,
    n_out: usize,
    r0: usize,
    n_rows: usize,
    t0: usize,
    n_toks: usize,
}

thread_local! {
    /// The calling thread's packed activations.
    static ACTS: RefCell<Buf> = RefCell::new(Buf::default());
    /// A worker's record and quantisation row.
    static WORK: RefCell<Buf> = RefCell::new(Buf::default());
}

/// Whether this GEMM handles weights of `ty`.
pub(crate) fn supports(ty: GgmlType) -> bool {
    dot_blk::block_bytes(ty).is_some()
}

/// Packs one token's Q8_0 row (`x`: `nb` blocks of 34 bytes) into slot `n` of its token tile
/// (`g`: the tile's `nb` groups).
fn pack_token(x: &[u8], n: usize, g: &mut [u8]) {
    for (b, grp) in x.chunks_exact(XB).zip(g.chunks_exact_mut(ACT)) {
        for r in 0..QK / 4 {
            grp[64 * r + 4 * n..64 * r + 4 * n + 4].copy_from_slice(&b[2 + 4 * r..6 + 4 * r]);
        }
        let d = quant::blocks::f16_at(b, 0);
        grp[512 + 4 * n..516 + 4 * n].copy_from_slice(&d.to_le_bytes());
    }
}

/// `y[t, r] = dot_blk(W[r], x[t])` for `t < n_tok`. Shapes were validated by the caller
/// (`matmul_impl`): `x` is `[n_tok, n_in]`, `y` is `[n_tok, n_out]`, `n_in` is a multiple of
/// 32, a row has at most `i32::MAX / 16` bytes (the scale gather's offsets), and the CPU has
/// AMX-INT8 with the permission granted and AVX-512 VNNI ([`quant::SimdLevel::Amx`] is
/// available).
pub(crate) fn gemm(
    pool: &dyn ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "matmul";
    let ty = w.dtype;
    let bb = dot_blk::block_bytes(ty).ok_or(KernelError::UnsupportedType { op: OP, ty })?;
    let (n_in, n_out) = (w.n_in, w.n_out);
    let nb = n_in / QK;
    let wrb = quant::row_bytes(OP, ty, n_in)?;
    let xrb = quant::row_bytes(OP, GgmlType::Q8_0, n_in)?;
    let n_tt = n_tok.div_ceil(TOKS);
    let n_rb = n_out.div_ceil(ROWS);
    // Group (tt, b) is at (tt * nb + b) * ACT.
    let tt_bytes = nb
        .checked_mul(ACT)
        .ok_or(KernelError::Overflow { op: OP })?;
    let total = n_tt
        .checked_mul(tt_bytes)
        .ok_or(KernelError::Overflow { op: OP })?;
    // Records: scales (64 bytes per block) and, when decoded, the values (512 per block).
    let rec_bytes = nb
        .checked_mul(64 + ROWS * QK)
        .ok_or(KernelError::Overflow { op: OP })?;
    let n_thr = pool.n_threads();
    with_buf(&ACTS, |acts| {
        let buf = acts.bytes(total);
        let bp = SharedMut(buf.as_mut_ptr());
        let pack = |tiles: std::ops::Range<usize>| {
            with_buf(&WORK, |wb| {
                let row = wb.bytes(xrb);
                for tt in tiles {
                    // SAFETY: tile `tt`'s groups are bytes `tt * tt_bytes ..` of `buf`
                    // (inside it: `total = n_tt * tt_bytes`), written by this task only.
                    let g = unsafe {
                        std::slice::from_raw_parts_mut(bp.ptr().add(tt * tt_bytes), tt_bytes)
                    };
                    g.fill(0);
                    for t in tt * TOKS..(tt * TOKS + TOKS).min(n_tok) {
                        quant::act::quantize_act(GgmlType::Q8_0, &x[t * n_in..(t + 1) * n_in], row);
                        pack_token(row, t - tt * TOKS, g);
                    }
                }
            })
        };
        for_thread_ranges(pool, n_tt, &pack);

        let acts: &[u8] = buf;
        let yp = SharedMut(y.as_mut_ptr());
        let tc = (CHUNK_BYTES / tt_bytes).clamp(1, n_tt);
        let per = n_rb.div_ceil(4 * n_thr).max(1);
        let n_tasks = n_rb.div_ceil(per);
        let task = |task: usize| {
            let rbs = task * per..((task + 1) * per).min(n_rb);
            with_buf(&WORK, |wb| {
                let rec = wb.bytes(rec_bytes);
                // SAFETY: the CPU has AMX-INT8 with the permission, and AVX-512 VNNI (caller's
                // contract).
                unsafe { imp::tile_config() };
                let mut t0 = 0;
                while t0 < n_tt {
                    let t1 = (t0 + tc).min(n_tt);
                    for b in rbs.clone() {
                        let rows = b * ROWS..(b * ROWS + ROWS).min(n_out);
                        let wrows = &w.data[rows.start * wrb..rows.end * wrb];
                        // Q8_0 row blocks of 16 rows are read in place.
                        let direct = ty == GgmlType::Q8_0 && rows.len() == ROWS;
                        // SAFETY: AVX-512 present (caller's contract); `wrows` holds
                        // `rows.len()` rows of `wrb` bytes, `rec` `rec_bytes`.
                        unsafe { imp::build_record(ty, wrows, wrb, nb, !direct, rec) };
                        let (a, a_stride) = if direct {
                            (&wrows[2..], wrb)
                        } else {
                            (&rec[64 * nb..], QK)
                        };
                        // The next row block of the task, prefetched while this one runs.
                        let next = if b + 1 < rbs.end {
                            let r1 = ((b + 2) * ROWS).min(n_out);
                            &w.data[rows.end * wrb..r1 * wrb]
                        } else {
                            &[]
                        };
                        for tt in t0..t1 {
                            let pf = if tt == t0 { next } else { &[] };
                            let o = Out {
                                y: yp,
                                n_out,
                                r0: rows.start,
                                n_rows: rows.len(),
                                t0: tt * TOKS,
                                n_toks: TOKS.min(n_tok - tt * TOKS),
                            };
                            let g = &acts[tt * tt_bytes..(tt + 1) * tt_bytes];
                            // SAFETY: AMX configured above; `a` holds the row block's A tiles
                            // (block `k` at `k * bb` in place, `k * 512` decoded; 16 rows
                            // `a_stride` apart: in place,
                            // the last row's 32 bytes of the last block end inside `wrows`;
                            // decoded, inside `rec`), `g` the tile's `nb` groups; this task
                            // alone writes the columns `rows` of `y` (it owns the row blocks
                            // `rbs`), and `y` outlives the call.
                            unsafe {
                                imp::row_block(
                                    a,
                                    a_stride,
                                    direct,
                                    bb,
                                    &rec[..64 * nb],
                                    g,
                                    nb,
                                    &o,
                                    pf,
                                )
                            };
                        }
                    }
                    t0 = t1;
                }
                // SAFETY: as above.
                unsafe { imp::tile_release() };
            })
        };
        run_tasks(pool, n_tasks, &task);
        Ok(())
    })
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use kapitsa_base::GgmlType;

    use super::{Out, ACT, QK, ROWS, TOKS};
    pub(super) use crate::gemm_amx::tile_release;
    use crate::gemm_amx::{load_config, TileCfg};

    /// The tile configuration: palette 1; tiles 0, 1 (block sums) 16 rows of 64 bytes, tiles
    /// 2, 3 (weights) 16 rows of 32 bytes, tiles 4, 5 (activations) 8 rows of 64 bytes.
    static CFG: TileCfg = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let shapes: [(u8, u8); 6] = [(16, 64), (16, 64), (16, 32), (16, 32), (8, 64), (8, 64)];
        let mut t = 0;
        while t < 6 {
            c[16 + 2 * t] = shapes[t].1;
            c[48 + t] = shapes[t].0;
            t += 1;
        }
        TileCfg(c)
    };

    /// Loads the tile configuration on this thread.
    ///
    /// # Safety
    /// The CPU has AMX-TILE and this process has the permission to use tile data.
    pub(super) unsafe fn tile_config() {
        // SAFETY: `CFG` is a valid palette-1 configuration (caller: AMX present).
        unsafe { load_config(&CFG) };
    }

    /// Builds a row block's record in `rec`: the scales of `rows.len() / wrb` rows (`w`) as
    /// `[nb][16]` f32 at 0 (missing rows 0) and, if `values`, their signed values as
    /// `[nb][16][32]` bytes at `64 * nb` (missing rows 0).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL present; `rec` holds `nb * (64 + 512)` bytes, `w` whole rows of `wrb`
    /// bytes (`nb` blocks of `ty`, Q8_0 or Q5_0).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    pub(super) unsafe fn build_record(
        ty: GgmlType,
        w: &[u8],
        wrb: usize,
        nb: usize,
        values: bool,
        rec: &mut [u8],
    ) {
        let n_rows = (w.len() / wrb).min(ROWS);
        let bb = if ty == GgmlType::Q8_0 { 34 } else { 22 };
        let (sc, vals) = rec.split_at_mut(64 * nb);
        if values && n_rows < ROWS {
            vals[..ROWS * QK * nb].fill(0);
        }
        // The scales: block b of the 16 rows in one masked dword gather (the f16 is the low
        // half of each dword; the gathered 4 bytes lie inside the block).
        let mask: __mmask16 = ((1u32 << n_rows) - 1) as __mmask16;
        let offs = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(wrb as i32),
        );
        for b in 0..nb {
            assert!(n_rows == 0 || (n_rows - 1) * wrb + b * bb + 4 <= w.len());
            // SAFETY: lanes below `n_rows` read bytes `r * wrb + b * bb .. + 4`, inside `w`
            // (checked; `wrb * 16` fits in i32: the caller takes this GEMM only for such
            // rows); masked lanes read nothing.
            let g = unsafe {
                _mm512_mask_i32gather_epi32::<1>(
                    _mm512_setzero_si512(),
                    mask,
                    offs,
                    w.as_ptr().add(b * bb).cast(),
                )
            };
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
            let dst = &mut sc[64 * b..64 * b + 64];
            // SAFETY: `dst` is 64 writable bytes.
            unsafe { _mm512_storeu_ps(dst.as_mut_ptr().cast(), d) };
        }
        if !values {
            return;
        }
        let mut r0 = 0;
        if ty == GgmlType::Q5_0 {
            // Four rows at a time: their 16 quant bytes as the 128-bit lanes of one vector,
            // split into nibbles, and reassembled as two rows of 32 values per vector
            // (qwords: low nibbles 0..8, high nibbles 0..8 of row 2i, then of row 2i + 1).
            let m4 = _mm512_set1_epi8(0xF);
            let sixteen = _mm512_set1_epi8(16);
            let pick = [
                _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11),
                _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15),
            ];
            while r0 + 4 <= n_rows {
                for b in 0..nb {
                    let blk = |i: usize| {
                        let o = (r0 + i) * wrb + b * bb;
                        &w[o..o + bb]
                    };
                    let ld = |i: usize| {
                        let q = &blk(i)[6..22];
                        // SAFETY: `q` is 16 readable bytes.
                        unsafe { _mm_loadu_si128(q.as_ptr().cast()) }
                    };
                    let qh = |i: usize| {
                        let b = blk(i);
                        u64::from(u32::from_le_bytes([b[2], b[3], b[4], b[5]]))
                    };
                    let q = _mm512_inserti32x4::<3>(
                        _mm512_inserti32x4::<2>(
                            _mm512_inserti32x4::<1>(_mm512_castsi128_si512(ld(0)), ld(1)),
                            ld(2),
                        ),
                        ld(3),
                    );
                    let lo = _mm512_and_si512(q, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
                    for (h, idx) in pick.iter().enumerate() {
                        let v = _mm512_permutex2var_epi64(lo, *idx, hi);
                        // Element j's fifth bit is bit j of its row's qh: where it is clear
                        // the value is the nibble - 16, where set the nibble.
                        let k = qh(2 * h) | qh(2 * h + 1) << 32;
                        let v = _mm512_mask_sub_epi8(v, !k, v, sixteen);
                        let o = 512 * b + 32 * (r0 + 2 * h);
                        let dst = &mut vals[o..o + 64];
                        // SAFETY: `dst` is 64 writable bytes.
                        unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), v) };
                    }
                }
                r0 += 4;
            }
        }
        for r in r0..n_rows {
            let row = &w[r * wrb..(r + 1) * wrb];
            for b in 0..nb {
                let blk = &row[b * bb..(b + 1) * bb];
                let o = 512 * b + 32 * r;
                let dst = &mut vals[o..o + 32];
                if ty == GgmlType::Q8_0 {
                    dst.copy_from_slice(&blk[2..34]);
                } else {
                    let qs = &blk[6..22];
                    // SAFETY: `qs` is 16 readable bytes.
                    let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
                    let m4 = _mm_set1_epi8(0xF);
                    let lo = _mm_and_si128(q, m4);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), m4);
                    let v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi);
                    // Element j's fifth bit is bit j of qh: where it is clear the value is
                    // the nibble - 16, where set the nibble.
                    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                    let v = _mm256_mask_sub_epi8(v, !qh, v, _mm256_set1_epi8(16));
                    // SAFETY: `dst` is 32 writable bytes.
                    unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), v) };
                }
            }
        }
    }

    /// Two blocks' sums into `c` (1024 bytes each): `a0`/`a1` the weight tiles (16 rows of
    /// 32 bytes, `a_stride` apart), `b0`/`b1` the activation tiles (8 rows of 64 bytes).
    ///
    /// # Safety
    /// AMX-INT8 present, tiles configured by [`tile_config`]; the pointers address those
    /// tiles in readable memory and `c` 2048 writable bytes.
    #[inline(always)]
    unsafe fn products(
        a0: *const u8,
        a1: *const u8,
        a_stride: usize,
        b0: *const u8,
        b1: *const u8,
        c: *mut i32,
    ) {
        // SAFETY: caller's contract.
        unsafe {
            asm!(
                "tileloadd tmm2, [{a0} + {sa}*1]",
                "tileloadd tmm4, [{b0} + {s64}*1]",
                "tilezero tmm0",
                "tdpbssd tmm0, tmm2, tmm4",
                "tileloadd tmm3, [{a1} + {sa}*1]",
                "tileloadd tmm5, [{b1} + {s64}*1]",
                "tilezero tmm1",
                "tdpbssd tmm1, tmm3, tmm5",
                "tilestored [{c} + {s64}*1], tmm0",
                "tilestored [{c} + {s64}*1 + 1024], tmm1",
                a0 = in(reg) a0,
                a1 = in(reg) a1,
                b0 = in(reg) b0,
                b1 = in(reg) b1,
                c = in(reg) c,
                sa = in(reg) a_stride,
                s64 = in(reg) 64usize,
                options(nostack),
            );
        }
    }

    /// Folds one block's sums (`c`: 16 rows of 16 i32, row = weight row, lane = token) into
    /// `acc` with the row scales `dw` (16 f32) and the token scales `dx`.
    #[inline(always)]
    fn fold(c: &[i32], dw: &[u8], dx: __m512, acc: &mut [__m512; 16]) {
        assert!(c.len() >= 256 && dw.len() >= 64);
        for (m, a) in acc.iter_mut().enumerate() {
            let d = f32::from_le_bytes([dw[4 * m], dw[4 * m + 1], dw[4 * m + 2], dw[4 * m + 3]]);
            // SAFETY: 16 i32 at 16m inside `c` (checked), an unaligned load; the caller is a
            // `#[target_feature]` function with AVX-512F and FMA, into which this is inlined.
            unsafe {
                let t = _mm512_loadu_si512(c[16 * m..].as_ptr().cast());
                let s = _mm512_mul_ps(_mm512_set1_ps(d), dx);
                *a = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(t), *a);
            }
        }
    }

    /// One row block against one token tile: the `nb` block sums, folded in order, then the
    /// 16 x 16 results transposed into `y`.
    ///
    /// # Safety
    /// As [`products`]; AVX-512F/BW/VL/DQ and FMA present; block `k`'s weight tile is at
    /// `a[k * (direct ? bb : 512)..]` with rows `a_stride` apart, inside `a`; `sc` holds the
    /// record's `[nb][16]` f32 scales, `g` the tile's `nb` activation groups; `o.y` is valid
    /// for `[n_tok, o.n_out]` and its elements (`o.t0 ..`, `o.r0 .. o.r0 + o.n_rows`) are
    /// written by nobody else during the call. `pf` (any bytes; the next row block's
    /// weights) is prefetched.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma")]
    pub(super) unsafe fn row_block(
        a: &[u8],
        a_stride: usize,
        direct: bool,
        bb: usize,
        sc: &[u8],
        g: &[u8],
        nb: usize,
        o: &Out,
        pf: &[u8],
    ) {
        let step = if direct { bb } else { ROWS * QK };
        assert!(nb > 0 && g.len() >= nb * ACT && sc.len() >= 64 * nb);
        assert!(a.len() >= (nb - 1) * step + (ROWS - 1) * a_stride + QK);
        let mut acc = [_mm512_setzero_ps(); 16];
        let mut c = [[0i32; 512]; 2];
        let n_pairs = nb.div_ceil(2);
        // `pf` (the next row block's weights) is prefetched into L2 in equal parts per pair.
        let pf_part = pf.len().div_ceil(n_pairs).next_multiple_of(64);
        // Pair `p` is blocks 2p and 2p + 1 (an odd last block runs twice; the copy is not
        // folded). Its sums are issued one pair ahead of its fold. (Plain code, no closures:
        // a call that is not inlined clobbers every vector register, spilling `acc`.)
        for p in 0..=n_pairs {
            if p < n_pairs {
                let k0 = 2 * p;
                let k1 = if k0 + 1 < nb { k0 + 1 } else { k0 };
                let cp = c[p % 2].as_mut_ptr();
                // SAFETY: caller's contract (the tiles of blocks k0, k1 < nb are inside `a`
                // and `g`, checked above); `cp` is 2048 writable bytes.
                unsafe {
                    products(
                        a[k0 * step..].as_ptr(),
                        a[k1 * step..].as_ptr(),
                        a_stride,
                        g[k0 * ACT..].as_ptr(),
                        g[k1 * ACT..].as_ptr(),
                        cp,
                    )
                };
            }
            if p == 0 {
                continue;
            }
            let q = p - 1;
            let mut l = q * pf_part;
            while l < ((q + 1) * pf_part).min(pf.len()) {
                _mm_prefetch::<_MM_HINT_T1>(pf[l..].as_ptr().cast());
                l += 64;
            }
            let cq = &c[q % 2];
            for (h, k) in (2 * q..(2 * q + 2).min(nb)).enumerate() {
                let s = &g[k * ACT + 512..k * ACT + 576];
                // SAFETY: 64 readable bytes.
                let dx = unsafe { _mm512_loadu_ps(s.as_ptr().cast()) };
                fold(
                    &cq[256 * h..256 * h + 256],
                    &sc[64 * k..64 * k + 64],
                    dx,
                    &mut acc,
                );
            }
        }
        // acc[m] lane n = y[t0 + n, r0 + m]: transpose to rows of tokens.
        let mut ai = [_mm512_setzero_si512(); 16];
        for (d, v) in ai.iter_mut().zip(acc) {
            *d = _mm512_castps_si512(v);
        }
        let rows = crate::gemm_amx::transpose16(ai);
        let mask: __mmask16 = if o.n_rows >= 16 {
            0xFFFF
        } else {
            (1u16 << o.n_rows) - 1
        };
        for (n, v) in rows.iter().enumerate().take(o.n_toks.min(TOKS)) {
            // SAFETY: element (t0 + n, r0 .. r0 + n_rows) of `y` (caller's contract); the mask
            // keeps the store inside the row.
            unsafe {
                let yp = o.y.ptr().add((o.t0 + n) * o.n_out + o.r0);
                _mm512_mask_storeu_ps(yp, mask, _mm512_castsi512_ps(*v));
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod imp {
    use kapitsa_base::GgmlType;

    use super::Out;
    pub(super) unsafe fn tile_config() {}
    pub(super) unsafe fn tile_release() {}
    pub(super) unsafe fn build_record(
        _ty: GgmlType,
        _w: &[u8],
        _wrb: usize,
        _nb: usize,
        _values: bool,
        _rec: &mut [u8],
    ) {
    }
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn row_block(
        _a: &[u8],
        _a_stride: usize,
        _direct: bool,
        _bb: usize,
        _sc: &[u8],
        _g: &[u8],
        _nb: usize,
        _o: &Out,
        _pf: &[u8],
    ) {
    }
}
