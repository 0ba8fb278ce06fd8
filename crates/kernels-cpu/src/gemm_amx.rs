//! Prefill GEMM on AMX-INT8 tiles for the K formats (Q4_K, Q5_K, Q6_K against Q8_K
//! activations): `y = x · Wᵀ`, bit-identical to one super-block-order dot product
//! ([`crate::quant::dot_sb`]) per output, which is what [`SimdLevel::Amx`] uses for decode.
//!
//! # How the integers are formed
//! A tile multiply `tdpbssd` sums products of signed bytes into i32, with no per-element
//! scale. The super-block order needs `T = sum_i w'_i q_i` where `w'_i` (sub-block scale x
//! quant) takes up to 13 bits, so each weight is split into two byte *planes*,
//! `w' = lo + 64 hi` with `lo = w' & 63` (0..63) and `hi = w' >> 6` (-64..63), and
//! `T = T_lo + 64 T_hi` exactly. The min term `M = sum_j m_j B_j` (Q4_K/Q5_K) is 4 `vpdpwssd`
//! per row and tile on the vector unit.
//!
//! # Layouts
//! An *activation group* holds one super-block of a *token tile* (16 tokens; padding tokens are
//! zero), [`ACT`] = 4416 bytes: the quants as `[16 tokens][256]` bytes at 0 (the tile for K-step
//! `k` is 16 rows of 64 bytes at `64k`, stride 256), the 16 Q8_K scales as f32 at 4096 and, at
//! 4160, per token the 4 i32 pairs `B_{2p} | B_{2p+1} << 16` (sums of the quants of its
//! 32-element sub-blocks). Groups are stored super-block-major (`[sb][token tile]`), so one
//! super-block of every token tile is one contiguous stream.
//! A *record* holds one super-block of a *row block* (16 weight rows; rows past `n_out` are
//! zero), [`REC`] = 8576 bytes: the `lo` plane at 0 and the `hi` plane at 4096, each as the 4
//! tiles of its K-steps in the layout `tdpbssd` wants for its second operand (tile row `r` of
//! K-step `k` holds, for each weight row `n`, elements `64k + 4r .. 64k + 4r + 4` at bytes
//! `4n .. 4n + 4`: byte `64e + 4n + i` holds element `4e + i` of row `n`), `d` as 16 f32 at
//! 8192, `dmin` as 16 f32 at 8256 and, at 8320, for each pair `p` the 16 rows'
//! `m_{2p} | m_{2p+1} << 16` of their mins.
//!
//! # One step
//! For a super-block, a record and two token tiles: four accumulator tiles are zeroed, 4
//! K-steps each load both planes' tiles and the two activation tiles and run four `tdpbssd`;
//! the 16 x 16 i32 results (row = token, lane = weight row) are stored and folded into 16
//! f32 accumulators per token with exactly the dot kernel's operations,
//! `acc = fma(d * yd, T, acc)` then `acc = fma(-(dmin * yd), M, acc)` (zero before the first
//! super-block). The tiles of the next pair are issued before a pair is folded, so the
//! vector work overlaps the tile work. The accumulators live in a contiguous per-task buffer
//! and go to `y[t, r0 .. r0 + 16]` after the last super-block: accumulating in `y` itself
//! (rows `n_out` floats apart, aliasing in the caches) made run times bimodal.
//!
//! # Blocking
//! Activations are quantised and packed once per call (in parallel over token tiles). Row
//! blocks are split into tasks. A task walks the super-blocks in chunks whose activations fit
//! in L2; for each row block and super-block of the chunk it decodes one record (each weight
//! block is decoded once per call) and, while the record sits in L1, streams every token
//! tile's group of that super-block past it.

use std::cell::RefCell;

use kapitsa_base::{GgmlType, ThreadPool};

use crate::gemm::{for_thread_ranges, run_tasks, with_buf, Buf};
use crate::matmul::{QMatrix, SharedMut};
use crate::quant::dot_sb::{self, QK};
use crate::quant::{self, KernelError};

/// Weight rows per row block (the tile height).
const ROWS: usize = 16;
/// Tokens per token tile (the tile width).
const TOKS: usize = 16;
/// Bytes of one record.
const REC: usize = 8576;
/// Bytes of one activation group.
const ACT: usize = 4416;
/// Activation bytes of one super-block chunk (kept in the 2 MiB L2 while every row block of a
/// task passes over it).
const CHUNK_BYTES: usize = 1024 * 1024;

thread_local! {
    /// The calling thread's packed activations.
    static ACTS: RefCell<Buf> = RefCell::new(Buf::default());
    /// A worker's record and quantisation row.
    static WORK: RefCell<Buf> = RefCell::new(Buf::default());
}

/// Where one super-block's results go: rows `r0 .. r0 + n_rows` of `y` (`[n_tok, n_out]`).
struct Out {
    /// The row block's accumulators, `[n_tt * 16 tokens][16 rows]` f32, 64-aligned.
    acc: *mut f32,
    y: SharedMut<f32>,
    n_out: usize,
    r0: usize,
    n_rows: usize,
    n_tok: usize,
    /// The first super-block: the accumulators start from zero (`acc` is not read).
    first: bool,
    /// The last super-block: the sums go to `y` (else back to `acc`).
    last: bool,
    /// The format has the min term (Q4_K, Q5_K).
    mins: bool,
}

/// Whether this GEMM handles weights of `ty`.
pub(crate) fn supports(ty: GgmlType) -> bool {
    dot_sb::block_bytes(ty).is_some()
}

/// Packs one token's Q8_K row (`x`: `nb` blocks of 292 bytes) into slot `t` of its token
/// tile: group `sb` is at `g[sb * stride..]`.
fn pack_token(x: &[u8], t: usize, g: &mut [u8], stride: usize) {
    for (sb, b) in x.chunks_exact(292).enumerate() {
        let grp = &mut g[sb * stride..sb * stride + ACT];
        grp[256 * t..256 * t + 256].copy_from_slice(&b[4..260]);
        grp[4096 + 4 * t..4100 + 4 * t].copy_from_slice(&b[0..4]);
        let bs = |k: usize| i32::from(i16::from_le_bytes([b[260 + 2 * k], b[261 + 2 * k]]));
        for p in 0..4 {
            let lo = bs(4 * p) + bs(4 * p + 1);
            let hi = bs(4 * p + 2) + bs(4 * p + 3);
            // Two i16 halves (|B| <= 32 * 127 fits), low half first.
            let pair = (lo as u32 & 0xFFFF) | ((hi as u32) << 16);
            let o = 4160 + 16 * t + 4 * p;
            grp[o..o + 4].copy_from_slice(&pair.to_le_bytes());
        }
    }
}

/// `y[t, r] = dot_sb(W[r], x[t])` for `t < n_tok`. Shapes were validated by the caller
/// (`matmul_impl`): `x` is `[n_tok, n_in]`, `y` is `[n_tok, n_out]`, `n_in` is a multiple of
/// 256, and the CPU has AMX-INT8 with the permission granted and AVX-512 VNNI
/// ([`quant::SimdLevel::Amx`] is available).
pub(crate) fn gemm(
    pool: &dyn ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "matmul";
    let ty = w.dtype;
    let bb = dot_sb::block_bytes(ty).ok_or(KernelError::UnsupportedType { op: OP, ty })?;
    let (n_in, n_out) = (w.n_in, w.n_out);
    let nb = n_in / QK;
    let wrb = quant::row_bytes(OP, ty, n_in)?;
    let xrb = quant::row_bytes(OP, GgmlType::Q8_K, n_in)?;
    let n_tt = n_tok.div_ceil(TOKS);
    let n_rb = n_out.div_ceil(ROWS);
    // Group (sb, tt) is at (sb * n_tt + tt) * ACT.
    let sb_bytes = n_tt * ACT;
    let total = nb
        .checked_mul(sb_bytes)
        .ok_or(KernelError::Overflow { op: OP })?;
    let n_thr = pool.n_threads();
    with_buf(&ACTS, |acts| {
        let buf = acts.bytes(total);
        let bp = SharedMut(buf.as_mut_ptr());
        let pack = |tiles: std::ops::Range<usize>| {
            with_buf(&WORK, |wb| {
                let row = wb.bytes(xrb);
                for tt in tiles {
                    for sb in 0..nb {
                        let o = sb * sb_bytes + tt * ACT;
                        // SAFETY: group (sb, tt) is inside `buf` and only this task writes the
                        // groups of tile `tt`.
                        unsafe { std::ptr::write_bytes(bp.ptr().add(o), 0, ACT) };
                    }
                    for t in tt * TOKS..(tt * TOKS + TOKS).min(n_tok) {
                        quant::act::quantize_act(GgmlType::Q8_K, &x[t * n_in..(t + 1) * n_in], row);
                        // SAFETY: the groups of tile `tt` (every `sb_bytes` from `tt * ACT`)
                        // are inside `buf` and written by this task only; the slice spans
                        // from the first to the end of the last, and `pack_token` writes only
                        // inside the groups.
                        let g = unsafe {
                            std::slice::from_raw_parts_mut(
                                bp.ptr().add(tt * ACT),
                                (nb - 1) * sb_bytes + ACT,
                            )
                        };
                        pack_token(row, t - tt * TOKS, g, sb_bytes);
                    }
                }
            })
        };
        for_thread_ranges(pool, n_tt, &pack);

        let acts: &[u8] = buf;
        let yp = SharedMut(y.as_mut_ptr());
        let kc = (CHUNK_BYTES / sb_bytes).clamp(1, nb);
        let per = n_rb.div_ceil(2 * n_thr).max(1);
        let n_tasks = n_rb.div_ceil(per);
        let mins = ty != GgmlType::Q6_K;
        let task = |task: usize| {
            let rbs = task * per..((task + 1) * per).min(n_rb);
            with_buf(&WORK, |wb| {
                // Accumulators: 16 f32 per (token, row block); one row block's at a time when
                // a single chunk covers the row, else those of every row block of the task.
                let acc_rbs = if kc >= nb { 1 } else { rbs.len() };
                let acc_rb = n_tt * TOKS * ROWS;
                let work = wb.bytes(REC + 2 * 4096 + 4 * acc_rb * acc_rbs);
                let (rec, rest) = work.split_at_mut(REC);
                let (scratch, acc_bytes) = rest.split_at_mut(2 * 4096);
                let accp = acc_bytes.as_mut_ptr().cast::<f32>();
                // SAFETY: the CPU has AMX-INT8 with the permission, and AVX-512 VNNI (caller's
                // contract).
                unsafe { imp::tile_config() };
                let mut s0 = 0;
                while s0 < nb {
                    let s1 = (s0 + kc).min(nb);
                    for (i, b) in rbs.clone().enumerate() {
                        let rows = b * ROWS..(b * ROWS + ROWS).min(n_out);
                        for sb in s0..s1 {
                            let blocks = |n: usize| {
                                let r = rows.start + n;
                                &w.data[r * wrb + sb * bb..r * wrb + (sb + 1) * bb]
                            };
                            // SAFETY: as above.
                            unsafe { imp::decode_record(ty, rows.len(), &blocks, rec, scratch) };
                            let groups = &acts[sb * sb_bytes..(sb + 1) * sb_bytes];
                            let out = Out {
                                // SAFETY: block `i % acc_rbs` of the accumulators is inside
                                // `acc_bytes` (64-aligned: the buffer and every part before
                                // it are multiples of 64 bytes).
                                acc: unsafe { accp.add((i % acc_rbs) * acc_rb) },
                                y: yp,
                                n_out,
                                r0: rows.start,
                                n_rows: rows.len(),
                                n_tok,
                                first: sb == 0,
                                last: sb + 1 == nb,
                                mins,
                            };
                            // SAFETY: as above; `rec` is one record, `groups` the `n_tt`
                            // groups of super-block `sb`; `acc` holds this row block's
                            // accumulators; this task alone writes the columns `rows` of `y`
                            // (it owns the row blocks `rbs`), and `y` outlives the call.
                            unsafe { imp::super_block(rec, groups, n_tt, &out) };
                        }
                    }
                    s0 = s1;
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
pub(crate) use imp::{load_config, tile_release, transpose16, TileCfg};

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use kapitsa_base::GgmlType;

    use super::{Out, ACT, REC, ROWS, TOKS};
    use crate::quant::blocks::{f16_at, scale_min_k4};
    use crate::quant::dot_sb::{self, QK};

    /// A 64-byte palette-1 tile configuration, as `ldtilecfg` reads it (byte 0: palette;
    /// bytes `16 + 2t`: tile `t`'s bytes per row; byte `48 + t`: its rows).
    #[repr(C, align(64))]
    pub(crate) struct TileCfg(pub(crate) [u8; 64]);

    /// Loads `cfg` as this thread's tile configuration.
    ///
    /// # Safety
    /// The CPU has AMX-TILE, this process has the permission to use tile data, and `cfg` is
    /// a valid configuration.
    pub(crate) unsafe fn load_config(cfg: &TileCfg) {
        // SAFETY: caller's contract; `cfg` is 64 readable, 64-aligned bytes.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
    }

    /// The tile configuration: palette 1, tiles 0..8 all 16 rows of 64 bytes.
    static CFG: TileCfg = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
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

    /// Releases the tile state of this thread (cheaper context switches).
    ///
    /// # Safety
    /// As [`tile_config`].
    pub(crate) unsafe fn tile_release() {
        // SAFETY: AMX present (caller); `tilerelease` touches no memory.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// 16 x 16 transpose of i32: `out[j]` lane `i` = `r[i]` lane `j`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // 1. 32-bit interleave of row pairs; 2. 64-bit interleave: u[4i + j], 128-bit lane L,
        // is column 4L + j of rows 4i .. 4i + 4; 3. gather lane L of u[j], u[4 + j], u[8 + j],
        // u[12 + j] into column 4L + j.
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        let mut c = [_mm512_setzero_si512(); 16];
        for j in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0x44>(u[j], u[4 + j]);
            let v1 = _mm512_shuffle_i32x4::<0x44>(u[8 + j], u[12 + j]);
            let v2 = _mm512_shuffle_i32x4::<0xEE>(u[j], u[4 + j]);
            let v3 = _mm512_shuffle_i32x4::<0xEE>(u[8 + j], u[12 + j]);
            c[j] = _mm512_shuffle_i32x4::<0x88>(v0, v1);
            c[4 + j] = _mm512_shuffle_i32x4::<0xDD>(v0, v1);
            c[8 + j] = _mm512_shuffle_i32x4::<0x88>(v2, v3);
            c[12 + j] = _mm512_shuffle_i32x4::<0xDD>(v2, v3);
        }
        c
    }

    /// Splits 32 weights `v` (i16 `w'`) into their planes at `lo[o..o + 32]` and
    /// `hi[o..o + 32]`: `w' & 63` and `w' >> 6`.
    ///
    /// # Safety
    /// AVX-512F/BW present; `o + 32 <= lo.len(), hi.len()`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    unsafe fn store_planes(v: __m512i, lo: &mut [u8], hi: &mut [u8], o: usize) {
        assert!(o + 32 <= lo.len() && o + 32 <= hi.len());
        let l = _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(63)));
        let h = _mm512_cvtepi16_epi8(_mm512_srai_epi16::<6>(v));
        // SAFETY: 32 bytes at `o` inside both (checked).
        unsafe {
            _mm256_storeu_si256(lo.as_mut_ptr().add(o).cast(), l);
            _mm256_storeu_si256(hi.as_mut_ptr().add(o).cast(), h);
        }
    }

    /// `w'` of one Q4_K block (`b`: 144 bytes) into its planes, vectorised; the same integers
    /// as `dot_sb::weights`. Returns `(d, dmin, mins)`.
    ///
    /// # Safety
    /// AVX-512F/BW present.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    unsafe fn planes_q4k(b: &[u8], lo: &mut [u8], hi: &mut [u8]) -> (f32, f32, [u8; 8]) {
        let b = &b[..144];
        let (sc, mins) = scale_min_k4(&b[4..16]);
        let m4 = _mm256_set1_epi8(0xF);
        for c in 0..4 {
            // SAFETY: 32 bytes at 16 + 32c <= 144 - 32.
            let q = unsafe { _mm256_loadu_si256(b[16 + 32 * c..].as_ptr().cast()) };
            let nib = [
                _mm256_and_si256(q, m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4),
            ];
            for (k, v) in nib.into_iter().enumerate() {
                let s = _mm512_set1_epi16(i16::from(sc[2 * c + k]));
                let w = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(v), s);
                // SAFETY: 64c + 32k + 32 <= 256.
                unsafe { store_planes(w, lo, hi, 64 * c + 32 * k) };
            }
        }
        (f16_at(b, 0), f16_at(b, 2), mins)
    }

    /// `w'` of one Q6_K block (`b`: 210 bytes) into its planes, vectorised; the same integers
    /// as `dot_sb::weights`. Returns `(d, 0, zero mins)`.
    ///
    /// # Safety
    /// AVX-512F/BW present.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    unsafe fn planes_q6k(b: &[u8], lo: &mut [u8], hi: &mut [u8]) -> (f32, f32, [u8; 8]) {
        let b = &b[..210];
        let m4 = _mm256_set1_epi8(0xF);
        let m2 = _mm256_set1_epi8(3);
        let bias = _mm512_set1_epi16(32);
        for h in 0..2 {
            // SAFETY: ql at 64h .. 64h + 64 and qh at 128 + 32h .. + 32, inside 210 bytes.
            let (ql0, ql1, qh) = unsafe {
                (
                    _mm256_loadu_si256(b[64 * h..].as_ptr().cast()),
                    _mm256_loadu_si256(b[64 * h + 32..].as_ptr().cast()),
                    _mm256_loadu_si256(b[128 + 32 * h..].as_ptr().cast()),
                )
            };
            // The 6-bit values of elements 128h + 32j .. + 32 (layout of `q6k_values`).
            let hb = |sh: i32| {
                let v = match sh {
                    0 => qh,
                    2 => _mm256_srli_epi16::<2>(qh),
                    4 => _mm256_srli_epi16::<4>(qh),
                    _ => _mm256_srli_epi16::<6>(qh),
                };
                _mm256_slli_epi16::<4>(_mm256_and_si256(v, m2))
            };
            let vals = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), hb(0)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), hb(2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), hb(4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), hb(6)),
            ];
            for (j, v) in vals.into_iter().enumerate() {
                let g = 8 * h + 2 * j;
                let s = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_set1_epi16(i16::from(b[192 + g] as i8))),
                    _mm256_set1_epi16(i16::from(b[193 + g] as i8)),
                );
                let w = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(v), bias), s);
                // SAFETY: 128h + 32j + 32 <= 256.
                unsafe { store_planes(w, lo, hi, 128 * h + 32 * j) };
            }
        }
        (f16_at(b, 208), 0.0, [0; 8])
    }

    /// Decodes one super-block of `n_rows <= 16` weight rows (`blocks(n)`: row `n`'s block)
    /// into `rec` (one record; rows past `n_rows` zero). `scratch`: 8192 bytes.
    ///
    /// # Safety
    /// AVX-512F/BW present; `rec.len() >= REC`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    pub(super) unsafe fn decode_record<'a>(
        ty: GgmlType,
        n_rows: usize,
        blocks: &dyn Fn(usize) -> &'a [u8],
        rec: &mut [u8],
        scratch: &mut [u8],
    ) {
        debug_assert!(rec.len() >= REC && scratch.len() >= 8192);
        // Natural layout first: scratch = lo [16][256], hi [16][256].
        let (tail_d, tail_rest) = rec[8192..REC].split_at_mut(64);
        let (tail_m, tail_p) = tail_rest.split_at_mut(64);
        tail_d.fill(0);
        tail_m.fill(0);
        tail_p.fill(0);
        for n in 0..ROWS {
            let (lo, hi) = scratch.split_at_mut(4096);
            let (lo, hi) = (
                &mut lo[256 * n..256 * n + 256],
                &mut hi[256 * n..256 * n + 256],
            );
            if n >= n_rows {
                lo.fill(0);
                hi.fill(0);
                continue;
            }
            let b = blocks(n);
            let (d, dmin, mins) = match ty {
                // SAFETY: features present; `b` is one whole block, `lo` / `hi` 256 bytes.
                GgmlType::Q4_K => unsafe { planes_q4k(b, lo, hi) },
                // SAFETY: as above.
                GgmlType::Q6_K => unsafe { planes_q6k(b, lo, hi) },
                _ => {
                    let blk = dot_sb::weights(ty, b);
                    for c in 0..QK / 32 {
                        // SAFETY: 32 i16 at element 32c of the 256-element array.
                        let v = unsafe { _mm512_loadu_si512(blk.w.as_ptr().add(32 * c).cast()) };
                        // SAFETY: the 32-byte stores at 32c are inside the 256-byte rows.
                        unsafe { store_planes(v, lo, hi, 32 * c) };
                    }
                    (blk.d, blk.dmin, blk.mins)
                }
            };
            tail_d[4 * n..4 * n + 4].copy_from_slice(&d.to_le_bytes());
            tail_m[4 * n..4 * n + 4].copy_from_slice(&dmin.to_le_bytes());
            for p in 0..4 {
                let pair = u32::from(mins[2 * p]) | (u32::from(mins[2 * p + 1]) << 16);
                let o = 64 * p + 4 * n;
                tail_p[o..o + 4].copy_from_slice(&pair.to_le_bytes());
            }
        }
        // Then per plane and K-step a 16 x 16 dword transpose: dword e of row n goes to byte
        // 64e + 4n.
        for plane in 0..2 {
            for k in 0..4 {
                let src = &scratch[4096 * plane..4096 * plane + 4096];
                // SAFETY: 64 bytes at 256n + 64k inside the 4096-byte plane.
                let r: [__m512i; 16] = std::array::from_fn(|n| unsafe {
                    _mm512_loadu_si512(src.as_ptr().add(256 * n + 64 * k).cast())
                });
                let c = transpose16(r);
                let dst = &mut rec[4096 * plane + 1024 * k..4096 * plane + 1024 * k + 1024];
                for (kr, v) in c.iter().enumerate() {
                    // SAFETY: 64 bytes at 64kr inside the 1024-byte tile.
                    unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(64 * kr).cast(), *v) };
                }
            }
        }
    }

    /// The four 16 x 16 i32 products of one super-block with two token tiles, stored to `c`:
    /// lo x tile 0 at 0, hi x tile 0 at 256, lo x tile 1 at 512, hi x tile 1 at 768 (row =
    /// token, lane = weight row).
    ///
    /// # Safety
    /// AMX-INT8 present, tiles configured by [`tile_config`]; `rec` holds one record, `a0` and
    /// `a1` one activation group each.
    #[inline(always)]
    unsafe fn products(rec: &[u8], a0: &[u8], a1: &[u8], c: &mut [i32; 1024]) {
        debug_assert!(rec.len() >= REC && a0.len() >= ACT && a1.len() >= ACT);
        // SAFETY: the weight tiles are 16 rows of 64 bytes at 1024k (lo) and 4096 + 1024k
        // (hi) with stride 64, inside `rec`; the activation tiles 16 rows of 64 bytes at 64k
        // with stride 256, inside `a0` / `a1`; the stores write 4 x 1024 bytes into `c`.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tileloadd tmm4, [{r} + {s64}*1]",
                "tileloadd tmm5, [{r} + {s64}*1 + 4096]",
                "tileloadd tmm6, [{a} + {s256}*1]",
                "tileloadd tmm7, [{b} + {s256}*1]",
                "tdpbssd tmm0, tmm6, tmm4",
                "tdpbssd tmm1, tmm6, tmm5",
                "tdpbssd tmm2, tmm7, tmm4",
                "tdpbssd tmm3, tmm7, tmm5",
                "tileloadd tmm4, [{r} + {s64}*1 + 1024]",
                "tileloadd tmm5, [{r} + {s64}*1 + 5120]",
                "tileloadd tmm6, [{a} + {s256}*1 + 64]",
                "tileloadd tmm7, [{b} + {s256}*1 + 64]",
                "tdpbssd tmm0, tmm6, tmm4",
                "tdpbssd tmm1, tmm6, tmm5",
                "tdpbssd tmm2, tmm7, tmm4",
                "tdpbssd tmm3, tmm7, tmm5",
                "tileloadd tmm4, [{r} + {s64}*1 + 2048]",
                "tileloadd tmm5, [{r} + {s64}*1 + 6144]",
                "tileloadd tmm6, [{a} + {s256}*1 + 128]",
                "tileloadd tmm7, [{b} + {s256}*1 + 128]",
                "tdpbssd tmm0, tmm6, tmm4",
                "tdpbssd tmm1, tmm6, tmm5",
                "tdpbssd tmm2, tmm7, tmm4",
                "tdpbssd tmm3, tmm7, tmm5",
                "tileloadd tmm4, [{r} + {s64}*1 + 3072]",
                "tileloadd tmm5, [{r} + {s64}*1 + 7168]",
                "tileloadd tmm6, [{a} + {s256}*1 + 192]",
                "tileloadd tmm7, [{b} + {s256}*1 + 192]",
                "tdpbssd tmm0, tmm6, tmm4",
                "tdpbssd tmm1, tmm6, tmm5",
                "tdpbssd tmm2, tmm7, tmm4",
                "tdpbssd tmm3, tmm7, tmm5",
                "tilestored [{c} + {s64}*1], tmm0",
                "tilestored [{c} + {s64}*1 + 1024], tmm1",
                "tilestored [{c} + {s64}*1 + 2048], tmm2",
                "tilestored [{c} + {s64}*1 + 3072], tmm3",
                r = in(reg) rec.as_ptr(),
                a = in(reg) a0.as_ptr(),
                b = in(reg) a1.as_ptr(),
                c = in(reg) c.as_mut_ptr(),
                s256 = in(reg) 256usize,
                s64 = in(reg) 64usize,
                options(nostack),
            );
        }
    }

    /// One super-block of one row block (`rec`) against every token tile (`groups`: `n_tt`
    /// groups), two tiles per tile pass; each tile's products (row = token, lane = weight row)
    /// are folded into the outputs of its real tokens.
    ///
    /// # Safety
    /// As [`products`]; AVX-512F/VNNI/FMA present; `groups` holds `n_tt` groups; `o.y` is
    /// valid for `[o.n_tok, o.n_out]` and its rows `o.r0 .. o.r0 + o.n_rows` are written by
    /// nobody else during the call.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")]
    pub(super) unsafe fn super_block(rec: &[u8], groups: &[u8], n_tt: usize, o: &Out) {
        // The first 64 bytes of `b`.
        let ld = |b: &[u8]| {
            assert!(b.len() >= 64);
            // SAFETY: `b` holds at least 64 bytes (checked); an unaligned load.
            unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
        };
        let dw = _mm512_castsi512_ps(ld(&rec[8192..]));
        let dm = _mm512_castsi512_ps(ld(&rec[8256..]));
        let mp: [__m512i; 4] = std::array::from_fn(|p| ld(&rec[8320 + 64 * p..]));
        let mask: __mmask16 = if o.n_rows >= 16 {
            0xFFFF
        } else {
            (1u16 << o.n_rows) - 1
        };
        // Two product buffers: the tiles of pair `i + 1` are issued before pair `i` is folded,
        // so the vector work overlaps the tile work.
        let mut c = [[0i32; 1024]; 2];
        let n_pairs = n_tt.div_ceil(2);
        let pair = |i: usize| {
            let g0 = &groups[2 * i * ACT..(2 * i + 1) * ACT];
            // An odd last tile runs with itself as the second (its copy is discarded).
            let two = 2 * i + 1 < n_tt;
            let g1 = if two {
                &groups[(2 * i + 1) * ACT..(2 * i + 2) * ACT]
            } else {
                g0
            };
            (g0, g1, two)
        };
        {
            let (g0, g1, _) = pair(0);
            // SAFETY: caller's contract.
            unsafe { products(rec, g0, g1, &mut c[0]) };
        }
        for i in 0..n_pairs {
            if i + 1 < n_pairs {
                let (g0, g1, _) = pair(i + 1);
                // SAFETY: caller's contract.
                unsafe { products(rec, g0, g1, &mut c[(i + 1) % 2]) };
            }
            let (g0, g1, two) = pair(i);
            let ci = &c[i % 2];
            for half in 0..if two { 2 } else { 1 } {
                let g = if half == 0 { g0 } else { g1 };
                let t0 = (2 * i + half) * TOKS;
                let cb = &ci[512 * half..512 * half + 512];
                let n_real = TOKS.min(o.n_tok - t0);
                for t in 0..n_real {
                    // SAFETY: token t0 + t's 16 accumulators (caller's contract).
                    let ap = unsafe { o.acc.add(16 * (t0 + t)) };
                    let mut acc = if o.first {
                        _mm512_setzero_ps()
                    } else {
                        // SAFETY: as above; 64-aligned.
                        unsafe { _mm512_load_ps(ap) }
                    };
                    // Row t of the lo (first 256 i32) and hi (next 256) products.
                    let ldi = |v: &[i32]| {
                        assert!(v.len() >= 16);
                        // SAFETY: `v` holds at least 16 i32 (checked); an unaligned load.
                        unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
                    };
                    let (lo, hi) = (ldi(&cb[16 * t..]), ldi(&cb[256 + 16 * t..]));
                    let tv = _mm512_add_epi32(lo, _mm512_slli_epi32::<6>(hi));
                    let ydv = _mm512_set1_ps(f32::from_le_bytes([
                        g[4096 + 4 * t],
                        g[4097 + 4 * t],
                        g[4098 + 4 * t],
                        g[4099 + 4 * t],
                    ]));
                    acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, ydv), _mm512_cvtepi32_ps(tv), acc);
                    if o.mins {
                        let mut m = _mm512_setzero_si512();
                        for (p, mv) in mp.iter().enumerate() {
                            let b = 4160 + 16 * t + 4 * p;
                            let bp = i32::from_le_bytes([g[b], g[b + 1], g[b + 2], g[b + 3]]);
                            m = _mm512_dpwssd_epi32(m, _mm512_set1_epi32(bp), *mv);
                        }
                        acc = _mm512_fnmadd_ps(_mm512_mul_ps(dm, ydv), _mm512_cvtepi32_ps(m), acc);
                    }
                    if o.last {
                        // SAFETY: element (t0 + t, r0 .. r0 + n_rows) of `y` (caller's
                        // contract); the mask keeps the store inside the row.
                        unsafe {
                            let yp = o.y.ptr().add((t0 + t) * o.n_out + o.r0);
                            _mm512_mask_storeu_ps(yp, mask, acc);
                        }
                    } else {
                        // SAFETY: as for the load.
                        unsafe { _mm512_store_ps(ap, acc) };
                    }
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod imp {
    use kapitsa_base::GgmlType;

    use super::Out;

    pub(super) unsafe fn tile_config() {}
    pub(crate) unsafe fn tile_release() {}
    pub(super) unsafe fn decode_record<'a>(
        _ty: GgmlType,
        _n_rows: usize,
        _blocks: &dyn Fn(usize) -> &'a [u8],
        _rec: &mut [u8],
        _scratch: &mut [u8],
    ) {
    }
    pub(super) unsafe fn super_block(_rec: &[u8], _groups: &[u8], _n_tt: usize, _o: &Out) {}
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use std::arch::x86_64::*;

    #[test]
    fn transpose16_transposes() {
        if !kapitsa_base::CpuFeatures::get().avx512 {
            return;
        }
        let m: Vec<i32> = (0..256).collect();
        // SAFETY: AVX-512F checked above; each load reads 16 i32 inside `m`.
        let r: [__m512i; 16] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_si512(m[16 * i..].as_ptr().cast()) });
        // SAFETY: AVX-512F checked above.
        let c = unsafe { super::imp::transpose16(r) };
        for (j, v) in c.iter().enumerate() {
            let mut out = [0i32; 16];
            // SAFETY: AVX-512F checked above; `out` holds 16 i32.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), *v) };
            for (i, x) in out.iter().enumerate() {
                assert_eq!(*x, (16 * i + j) as i32);
            }
        }
    }
}
