//! Prefill GEMM driver: `y = x · Wᵀ` for many tokens with the micro-kernels of
//! [`crate::quant::gemm_avx512`], bit-identical to one
//! [`DotKernel::dot`](crate::quant::DotKernel::dot) per output.
//!
//! Steps of one call (layouts in `quant/gemm_avx512.rs`):
//! 1. Quantise every activation row (as the dot path does) and pack it into *tiles* of
//!    [`TILE`] tokens, one tile group per 256 input elements. A row of a 32-element format
//!    whose block count is not a multiple of 8 ends in a partial group, padded with all-zero
//!    blocks (here and in the weights), which add exactly 0: the dot kernels do those blocks
//!    with the same operations. Parallel over tiles.
//! 2. Output rows are split into tasks (contiguous row ranges). A task decodes a *panel* of
//!    rows into weight records (each weight block is decoded once per call), then for every
//!    tile runs the micro-kernel row by row over chunks of [`kc`] groups (a chunk of the tile
//!    stays in L1 while every row of the panel meets it; the panel's records stay in L2), and
//!    finally reduces each (row, token) accumulator to its output. A call of at most one tile
//!    on a format with register-decoding kernels (`GemmKernel::direct`: the 32-element
//!    formats, decode steps) skips the records and streams the raw rows.
//!
//! Buffers live in thread-locals and are reused across calls (no allocation per call once
//! warm). Results depend neither on the thread count nor on the tiling: every (row, token)
//! output sees the same operation sequence as the dot kernel.

use std::cell::RefCell;

use kapitsa_base::ThreadPool;

use crate::matmul::{QMatrix, SharedMut};
use crate::quant::gemm_avx512::{Acc, Fin, GemmKernel, KernFn, GROUP, TILE};
use crate::quant::{self, KernelError};

/// Bytes of weight records a task keeps per panel (sized for the 2 MiB L2 next to the tiles).
const PANEL_BYTES: usize = 768 * 1024;
/// Bytes of one tile chunk (kept in the 48 KiB L1 while the panel's rows pass over it).
const CHUNK_BYTES: usize = 24 * 1024;

/// Groups per tile chunk for `gk`.
fn kc(gk: &GemmKernel) -> usize {
    (CHUNK_BYTES / gk.act).max(1)
}

/// 64 bytes, 64-aligned: the unit of the reusable buffers (so vector loads never split lines).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A reusable, 64-byte-aligned byte buffer.
#[derive(Default)]
pub(crate) struct Buf(Vec<Line>);

impl Buf {
    /// The first `n` bytes, growing the buffer if needed (contents are left as they were).
    pub(crate) fn bytes(&mut self, n: usize) -> &mut [u8] {
        let lines = n.div_ceil(64);
        if self.0.len() < lines {
            self.0.resize(lines, Line([0; 64]));
        }
        // SAFETY: `Line` is 64 plain bytes without padding, the vector holds at least `n`
        // bytes, and the returned borrow is tied to `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), n) }
    }
}

thread_local! {
    /// The calling thread's packed activations.
    static TILES: RefCell<Buf> = RefCell::new(Buf::default());
    /// A worker's weight records, accumulators and quantisation row.
    static WORK: RefCell<Buf> = RefCell::new(Buf::default());
}

/// Runs `f` with this thread's buffer `key` (or a fresh one if it is already borrowed, which
/// only re-entrant use could cause).
pub(crate) fn with_buf<R>(
    key: &'static std::thread::LocalKey<RefCell<Buf>>,
    f: impl FnOnce(&mut Buf) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut b) => f(&mut b),
        Err(_) => f(&mut Buf::default()),
    })
}

/// Runs `f` on `0..n` cut into one contiguous range per thread (inline when there is one
/// thread or one item).
pub(crate) fn for_thread_ranges(
    pool: &dyn ThreadPool,
    n: usize,
    f: &(dyn Fn(std::ops::Range<usize>) + Sync),
) {
    let n_thr = pool.n_threads();
    if n_thr > 1 && n > 1 {
        let per = n.div_ceil(n_thr);
        pool.run(n.div_ceil(per), &|task| {
            f(task * per..((task + 1) * per).min(n))
        });
    } else {
        f(0..n);
    }
}

/// Runs tasks `0..n_tasks` on the pool (inline when there is one thread or one task).
pub(crate) fn run_tasks(pool: &dyn ThreadPool, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    if n_tasks == 1 || pool.n_threads() == 1 {
        (0..n_tasks).for_each(f);
    } else {
        pool.run(n_tasks, f);
    }
}

/// Tokens per task below which a call is not split by tokens (each token task decodes every
/// weight row once, so it needs enough tokens to amortise that).
const TASK_TOKENS: usize = 128;

/// Everything one call's tasks share: the operands, derived sizes and the output pointers.
struct Ctx<'a> {
    gk: &'a GemmKernel,
    w: &'a QMatrix<'a>,
    x: &'a [f32],
    n_tok: usize,
    dot_ty: kapitsa_base::GgmlType,
    /// Bytes of one quantised activation row and of one weight row.
    xrb: usize,
    wrb: usize,
    /// Groups per row, the last one possibly partial (padded); raw activation / weight bytes
    /// of that many groups (at least `xrb` / `wrb`).
    ng: usize,
    xg: usize,
    wg: usize,
    tile_bytes: usize,
    /// The packed tiles (`n_tiles * tile_bytes` bytes, owned by the caller's thread-local).
    buf: SharedMut<u8>,
    /// `y`, `[n_tok, n_out]`.
    y: SharedMut<f32>,
}

impl Ctx<'_> {
    /// Quantises the tokens of `tiles` and packs them (padding slots and the padding of a
    /// partial last group get all-zero blocks).
    ///
    /// # Safety
    /// No other thread accesses these tiles during the call.
    unsafe fn pack_tiles(&self, tiles: std::ops::Range<usize>) {
        with_buf(&WORK, |wb| {
            let row = wb.bytes(self.xg);
            for tile in tiles {
                // SAFETY: tile `tile` is inside `buf` and accessed by this call only (caller's
                // contract).
                let tb = unsafe {
                    std::slice::from_raw_parts_mut(
                        self.buf.ptr().add(tile * self.tile_bytes),
                        self.tile_bytes,
                    )
                };
                // Slots past the micro-kernel's width are never read.
                let n_real = TILE.min(self.n_tok - tile * TILE);
                let width = if n_real == 1 && self.gk.direct.is_some() && self.n_tok == 1 {
                    1
                } else {
                    n_real.next_multiple_of(2)
                };
                for slot in 0..width {
                    let t = tile * TILE + slot;
                    if t < self.n_tok {
                        let n_in = self.w.n_in;
                        quant::act::quantize_act(
                            self.dot_ty,
                            &self.x[t * n_in..(t + 1) * n_in],
                            &mut row[..self.xrb],
                        );
                        row[self.xrb..].fill(0);
                    } else {
                        row.fill(0);
                    }
                    (self.gk.pack)(row, slot, tb);
                }
            }
        })
    }

    /// `y[t, r]` for every token (at most one tile) and the weight rows `rows`, with the
    /// kernels `direct` that decode raw weight groups in registers (no records). They read a
    /// partial last group of whole block pairs in place.
    ///
    /// # Safety
    /// `n_tok <= TILE`; tile 0 is packed and not written during the call; no other thread
    /// writes `y` at the rows `rows`.
    unsafe fn compute_direct(&self, direct: &[KernFn; 5], rows: std::ops::Range<usize>) {
        let gk = self.gk;
        let n_out = self.w.n_out;
        let n_real = self.n_tok;
        let kern = direct[if n_real == 1 { 0 } else { n_real.div_ceil(2) }];
        let pad = self.wg > self.wrb;
        let full = if pad { self.ng - 1 } else { self.ng };
        // A partial last group of whole block pairs is read in place (the kernels stop at its
        // end); an odd last block needs the zero-padded copy.
        let bb = gk.w_group / 8;
        let even_tail = pad && (self.wrb - full * gk.w_group).is_multiple_of(2 * bb);
        // SAFETY: tile 0 is inside `buf`, packed, and only read now (caller's contract).
        let tb =
            unsafe { std::slice::from_raw_parts(self.buf.ptr() as *const u8, self.tile_bytes) };
        with_buf(&WORK, |wb| {
            let acc_bytes = std::mem::size_of::<Acc>();
            let work = wb.bytes(acc_bytes + gk.w_group);
            let (acc_raw, padded) = work.split_at_mut(acc_bytes);
            // SAFETY: `acc_raw` starts at the buffer's 64-aligned start and holds one `Acc`
            // (plain f32 arrays, any bit pattern valid).
            let acc = unsafe { &mut *acc_raw.as_mut_ptr().cast::<Acc>() };
            for r in rows {
                let raw = &self.w.data[r * self.wrb..(r + 1) * self.wrb];
                let mut out = [0f32; TILE];
                let fin = Fin {
                    out: &mut out[..n_real],
                };
                let (w_full, act_full) = (&raw[..full * gk.w_group], &tb[..full * gk.act]);
                // Each call: the kernel was chosen for an available level (`matmul_with`);
                // the weight slice holds whole groups (or whole block pairs: `even_tail`)
                // and the tile slice as many (padded) tile groups; `fin` has n_real <= 8
                // slots.
                if even_tail {
                    // SAFETY: as above.
                    unsafe { kern(raw, tb, acc, true, Some(fin)) };
                } else if pad {
                    if full > 0 {
                        // SAFETY: as above.
                        unsafe { kern(w_full, act_full, acc, true, None) };
                    }
                    // The partial last group, padded with all-zero blocks.
                    let rem = &raw[full * gk.w_group..];
                    padded[..rem.len()].copy_from_slice(rem);
                    padded[rem.len()..].fill(0);
                    let act_last = &tb[full * gk.act..(full + 1) * gk.act];
                    // SAFETY: as above.
                    unsafe { kern(padded, act_last, acc, full == 0, Some(fin)) };
                } else {
                    // SAFETY: as above.
                    unsafe { kern(w_full, act_full, acc, true, Some(fin)) };
                }
                for (k, v) in out[..n_real].iter().enumerate() {
                    // SAFETY: element (k, r) is this call's alone (caller's contract);
                    // k < n_tok and r < n_out, so it is inside `y`.
                    unsafe { *self.y.ptr().add(k * n_out + r) = *v };
                }
            }
        })
    }

    /// `y[t, r]` for the tokens of `tiles` and the weight rows `rows`: panels of rows are
    /// decoded into records once, then every tile meets the panel row by row.
    ///
    /// # Safety
    /// The tiles `tiles` are packed and not written during the call; no other thread writes
    /// `y` at (token of `tiles`, row of `rows`).
    unsafe fn compute(&self, tiles: std::ops::Range<usize>, rows: std::ops::Range<usize>) {
        let gk = self.gk;
        if let (Some(direct), true) = (&gk.direct, self.n_tok <= TILE) {
            // SAFETY: one tile (`n_tok <= TILE`); the rest is this function's contract.
            return unsafe { self.compute_direct(direct, rows) };
        }
        let (ng, n_out) = (self.ng, self.w.n_out);
        let rec_row = ng * gk.rec;
        let pr = (PANEL_BYTES / rec_row).clamp(1, rows.len().max(1));
        let kc = kc(gk);
        with_buf(&WORK, |wb| {
            let acc_bytes = pr * std::mem::size_of::<Acc>();
            let pad = self.wg > self.wrb;
            let work = wb.bytes(acc_bytes + pr * rec_row + if pad { gk.w_group } else { 0 });
            let (acc_raw, rest) = work.split_at_mut(acc_bytes);
            let (recs, padded) = rest.split_at_mut(pr * rec_row);
            // SAFETY: `acc_raw` starts at the buffer's 64-aligned start and holds `pr` `Acc`s
            // (plain f32 arrays, any bit pattern valid).
            let accs =
                unsafe { std::slice::from_raw_parts_mut(acc_raw.as_mut_ptr().cast::<Acc>(), pr) };
            let mut r0 = rows.start;
            while r0 < rows.end {
                let r1 = (r0 + pr).min(rows.end);
                for r in r0..r1 {
                    let i = r - r0;
                    let raw = &self.w.data[r * self.wrb..(r + 1) * self.wrb];
                    let rec = &mut recs[i * rec_row..(i + 1) * rec_row];
                    let full = if pad { self.ng - 1 } else { self.ng };
                    let (rec_full, rec_last) = rec.split_at_mut(full * gk.rec);
                    // SAFETY: the kernel was chosen for an available level (`matmul_with`);
                    // `rec_full` holds `full` records for the `full` raw groups (`rec_last`
                    // holds the one record of the padded group).
                    unsafe { (gk.decode)(&raw[..full * gk.w_group], rec_full) };
                    if pad {
                        // The partial last group, padded with all-zero blocks.
                        let rem = &raw[full * gk.w_group..];
                        padded[..rem.len()].copy_from_slice(rem);
                        padded[rem.len()..].fill(0);
                        // SAFETY: as above (`padded` is one raw group).
                        unsafe { (gk.decode)(padded, rec_last) };
                    }
                }
                for tile in tiles.clone() {
                    let t0 = tile * TILE;
                    let n_real = TILE.min(self.n_tok - t0);
                    let kern = gk.kern[n_real.div_ceil(2) - 1];
                    // SAFETY: the tile is packed and only read now (caller's contract); it is
                    // inside `buf`.
                    let tb = unsafe {
                        std::slice::from_raw_parts(
                            (self.buf.ptr() as *const u8).add(tile * self.tile_bytes),
                            self.tile_bytes,
                        )
                    };
                    // Row `r`'s last (or only) chunk: the kernel reduces in registers to
                    // `out`, which goes to column `r` of `y`.
                    let last = |r: usize, rec: &[u8], chunk: &[u8], acc: &mut Acc, init: bool| {
                        let mut out = [0f32; TILE];
                        let fin = Fin {
                            out: &mut out[..n_real],
                        };
                        // SAFETY: level available (as above); `rec` and `chunk` hold the same
                        // number of groups; `fin` has n_real <= 8 slots.
                        unsafe { kern(rec, chunk, acc, init, Some(fin)) };
                        for (k, v) in out[..n_real].iter().enumerate() {
                            // SAFETY: element (t0 + k, r) is this call's alone (caller's
                            // contract); t0 + k < n_tok and r < n_out, so it is inside `y`.
                            unsafe { *self.y.ptr().add((t0 + k) * n_out + r) = *v };
                        }
                    };
                    if ng <= kc {
                        // One chunk: accumulators never leave the registers.
                        for r in r0..r1 {
                            let i = r - r0;
                            last(
                                r,
                                &recs[i * rec_row..(i + 1) * rec_row],
                                tb,
                                &mut accs[0],
                                true,
                            );
                        }
                        continue;
                    }
                    let mut k0 = 0;
                    while k0 < ng {
                        let k1 = (k0 + kc).min(ng);
                        let chunk = &tb[k0 * gk.act..k1 * gk.act];
                        for (i, acc) in accs[..r1 - r0].iter_mut().enumerate() {
                            let rec = &recs[i * rec_row + k0 * gk.rec..i * rec_row + k1 * gk.rec];
                            if k1 == ng {
                                last(r0 + i, rec, chunk, acc, k0 == 0);
                            } else {
                                // SAFETY: level available (as above); `rec` holds k1 - k0
                                // records and `chunk` as many tile groups.
                                unsafe { kern(rec, chunk, acc, k0 == 0, None) };
                            }
                        }
                        k0 = k1;
                    }
                }
                r0 = r1;
            }
        })
    }
}

/// `ys[i][t, r] = dot(ws[i][r], x[t])` for `t < n_tok`: one or more weight matrices of the
/// same type and width multiplied by the same activations, with the GEMM kernel `gk`. Shapes
/// were validated by the caller (`matmul_impl` / `matmul_many_impl`): `x` is `[n_tok, n_in]`,
/// `ys[i]` is `[n_tok, ws[i].n_out]`, every `ws[i]` has `gk`'s type and `n_in` columns, `n_in`
/// is a valid row length for that type (a multiple of 256 for the K formats), and
/// `n_in >= 256`.
///
/// One pool round per call, whatever the number of matrices (the activations are quantised
/// and packed once for all of them): long batches are split by tokens (each task packs its
/// own tiles, then computes every row of every matrix for them), short ones are packed here
/// and split by rows of each matrix.
pub(crate) fn gemm(
    gk: &GemmKernel,
    pool: &dyn ThreadPool,
    ws: &[QMatrix<'_>],
    x: &[f32],
    n_tok: usize,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    const OP: &str = "matmul";
    let Some(w0) = ws.first() else {
        return Ok(());
    };
    quant::check_len(OP, "outputs", ws.len(), ys.len())?;
    let n_in = w0.n_in;
    let dot_ty = quant::vec_dot_type(w0.dtype)?;
    let xrb = quant::row_bytes(OP, dot_ty, n_in)?;
    let wrb = quant::row_bytes(OP, w0.dtype, n_in)?;
    let ng = n_in.div_ceil(GROUP);
    let (xg, wg) = (ng * gk.x_group, ng * gk.w_group);
    let n_tiles = n_tok.div_ceil(TILE);
    let tile_bytes = ng * gk.act;
    let total = n_tiles
        .checked_mul(tile_bytes)
        .ok_or(KernelError::Overflow { op: OP })?;

    with_buf(&TILES, |tiles| {
        let buf = SharedMut(tiles.bytes(total).as_mut_ptr());
        let ctxs: Vec<Ctx<'_>> = ws
            .iter()
            .zip(ys.iter_mut())
            .map(|(w, y)| Ctx {
                gk,
                w,
                x,
                n_tok,
                dot_ty,
                xrb,
                wrb,
                ng,
                xg,
                wg,
                tile_bytes,
                buf,
                y: SharedMut(y.as_mut_ptr()),
            })
            .collect();
        let n_thr = pool.n_threads();
        let tok_tasks = (n_tok / TASK_TOKENS).min(2 * n_thr);
        if n_thr > 1 && tok_tasks >= 2 {
            let per = n_tiles.div_ceil(tok_tasks);
            let n_tasks = n_tiles.div_ceil(per);
            pool.run(n_tasks, &|task| {
                let tiles = task * per..((task + 1) * per).min(n_tiles);
                // SAFETY: task `task` alone packs, then reads, the tiles `tiles`, and alone
                // writes those tokens' rows of every `y`; `buf` and the `ys` outlive `run`.
                unsafe {
                    ctxs[0].pack_tiles(tiles.clone());
                    for ctx in &ctxs {
                        ctx.compute(tiles.clone(), 0..ctx.w.n_out);
                    }
                }
            });
        } else {
            // SAFETY: nothing else runs yet.
            unsafe { ctxs[0].pack_tiles(0..n_tiles) };
            // (matrix, rows) of every task: each matrix split as a lone call would be.
            let mut tasks = Vec::new();
            for (i, ctx) in ctxs.iter().enumerate() {
                let n_out = ctx.w.n_out;
                if n_out == 0 {
                    continue;
                }
                let n_tasks = (n_thr * 4).min(n_out.div_ceil(8)).max(1);
                let per = n_out.div_ceil(n_tasks);
                tasks.extend(
                    (0..n_out.div_ceil(per)).map(|t| (i, t * per..((t + 1) * per).min(n_out))),
                );
            }
            let row_task = |task: usize| {
                let (i, rows) = tasks[task].clone();
                // SAFETY: the tiles were packed above and are only read now; task `task`
                // alone writes the columns `rows` of matrix `i`'s `y`, which outlives `run`.
                unsafe { ctxs[i].compute(0..n_tiles, rows) };
            };
            if tasks.len() <= 1 || n_thr == 1 {
                (0..tasks.len()).for_each(row_task);
            } else {
                pool.run(tasks.len(), &row_task);
            }
        }
        Ok(())
    })
}
