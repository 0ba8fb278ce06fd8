//! Quantised matrix multiplication `y = x · Wᵀ` (ggml `mul_mat` semantics) and row gathers.
//!
//! Layouts: `W` is `n_out` rows of `n_in` elements in a ggml block format ([`QMatrix`]); `x` is
//! row-major `[n_tok, n_in]` f32; `y` is row-major `[n_tok, n_out]` f32. As in ggml, each
//! activation row is first quantised to [`vec_dot_type`](crate::quant::vec_dot_type) of the
//! weight type, then every output is one [`DotKernel::dot`].
//!
//! Two drivers give bit-identical results (every output is the same operation sequence as one
//! `DotKernel::dot`), so which one runs never changes numerics:
//!
//! * Prefill, `n_tok >= GEMM_MIN_TOKENS`, weight types with a tiled GEMM at the chosen SIMD
//!   level (AVX-512: Q4_K, Q5_K, Q6_K; with VNNI also Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4): the
//!   GEMM of `crate::gemm` (weights decoded once per call, 8-token micro-kernels; the K
//!   formats at [`SimdLevel::Avx512Vnni`] and up in the super-block order); at
//!   [`SimdLevel::Amx`] the K formats take the tile GEMM of `crate::gemm_amx` instead from
//!   [`AMX_MIN_TOKENS`], and Q8_0 and Q5_0 take the tile GEMM of `crate::gemm_amx_blk` from 2
//!   tokens. For the 32-element formats a call with a single tile (a batched decode step, a
//!   speculative verification) runs kernels that decode the raw weights in registers instead
//!   of into records, from [`GEMM_DIRECT_MIN_TOKENS`] tokens.
//! * Otherwise ([`matmul_dot_with`]): outputs are cut into tiles of (a chunk of weight rows) x
//!   (a block of up to [`TOK_BLOCK`] tokens); each tile is one pool task, looping rows outer
//!   and tokens inner, so a weight row is streamed from memory once per token block and then
//!   stays in L1 while it meets every activation row of the block (which stay in L2).
//! * Decode (`n_tok == 1`, [`gemv_batch_with`]): a pure GEMV split over row chunks
//!   (shrinking through the round, whole 16-row groups); where the kernel has a
//!   row-group GEMV (the K formats from [`SimdLevel::Avx512Vnni`], Q8_0 and Q5_0 at
//!   [`SimdLevel::Amx`]), each chunk is one call of it. Several matrices (an MoE layer's
//!   experts, attention's q, k and v) can share one pool round, each with its own input of
//!   one or a few tokens.
//! * A few tokens (2 to [`GEMV_MULTI_MAX_TOKENS`]: batched decode, speculative
//!   verification) on the K formats from [`SimdLevel::Avx512Vnni`]: the same rounds on the
//!   multi-token row-group GEMVs (`quant::gemv_sb`, and from 4 (Q4_K) or 6 (Q6_K) tokens the
//!   rows-in-lanes `quant::gemv_sb_lanes`), which read each weight block from memory once
//!   for all the tokens (before the GEMMs and the per-row dot kernels).
//! * Prefill batches (more than [`GEMV_MULTI_MAX_TOKENS`]) of Q4_K and Q6_K at
//!   [`SimdLevel::Avx512Vnni`]: the same rounds on the rows-in-lanes kernel, all tokens in one
//!   call per row chunk (it repacks a 16-row panel once per 256 tokens). It replaced the
//!   AVX-512 GEMM (`kern_k_sb`) there: measured on an AMD EPYC (Zen 4, 2 threads) 1.5x on the
//!   1.5B's Q4_K/Q6_K shapes at 512 tokens (`examples/gemm_bench`), pp512 of the whole 1.5B
//!   1.5x. The AMX level keeps `kern_k_sb` below its tile GEMM (not measured on an AMX
//!   machine yet). `KAPITSA_LANES_GEMM=0` turns it off (for A/B runs).
//!
//! At a given level every one of these paths computes each output with the same operation
//! sequence, so a sequence's results never depend on how many tokens share its pass
//! (speculative verification of k tokens == k one-token steps, bit for bit).
//! Results do not depend on the thread count.

use std::ops::Range;

use kapitsa_base::pool::SerialPool;
use kapitsa_base::{GgmlType, ThreadPool};

use crate::quant::{self, check_len, DotKernel, KernelError, SimdLevel};

/// Tokens per tile for prefill: the quantised activations of a tile (`TOK_BLOCK` rows) should
/// fit in L2 next to the weight chunk.
pub const TOK_BLOCK: usize = 32;

/// Smallest token count that takes the tiled GEMM (`crate::gemm`) where the weight type and
/// SIMD level have one; below it the per-row dot kernels are as fast (no packing).
pub const GEMM_MIN_TOKENS: usize = 4;

/// Smallest token count that takes the GEMM where it has kernels that decode the raw weights
/// in registers (the 32-element formats at [`SimdLevel::Avx512Vnni`]): measured on the
/// 0.5B's 896-wide Q5_0/Q8_0 shapes, one thread, 2 and 3 tokens ran 1.4-1.6x faster there
/// than on the per-row dot kernels (which decode each weight row once per token).
pub const GEMM_DIRECT_MIN_TOKENS: usize = 2;

/// Smallest token count that takes the AMX tile GEMM (`crate::gemm_amx`) at
/// [`SimdLevel::Amx`]: it decodes every weight block into two byte planes per call, which
/// smaller batches do not amortise. Measured on the 1.5B's FFN shapes, one thread: the tile
/// GEMM is 6x slower than the AVX-512 GEMM at 4 tokens, about even at 64, 1.3x faster at 96
/// and 1.7x at 256. Below it the same order runs on the AVX-512 GEMM (`kern_k_sb`).
pub const AMX_MIN_TOKENS: usize = 80;

/// Chunking of a decode GEMV round (`gemv_chunks`): each chunk takes about
/// `1 / (GEMV_CHUNK_FACTOR * threads)` of the weight bytes not yet given to a chunk, so chunks
/// shrink as the round goes on (guided self-scheduling by "factoring"). Tasks are claimed
/// dynamically and in order, so the long first chunks stream long runs and the short last ones
/// leave a thread that finishes early only a short wait for the other.
pub const GEMV_CHUNK_FACTOR: usize = 4;

/// Smallest chunk of a decode GEMV round, in weight bytes (about 10 µs of one core's read
/// bandwidth here), before rounding up to whole 16-row groups.
pub const GEMV_MIN_CHUNK_BYTES: usize = 64 << 10;

/// Largest chunk of a decode GEMV round, in weight bytes: bounds what the other threads wait
/// for when a thread is descheduled in the middle of a chunk (the output head alone is
/// 200-400 MB on the production-shaped files).
pub const GEMV_MAX_CHUNK_BYTES: usize = 4 << 20;

/// Weight bytes a product of several tokens without a multi-token kernel meets all its tokens
/// on before moving on ([`gemv_batch_with`]): small enough to stay in L2 (and mostly L1).
pub const GEMV_PIECE_BYTES: usize = 32 << 10;

/// Largest token count that takes the multi-token row-group GEMVs (the K formats from
/// [`SimdLevel::Avx512Vnni`]: every weight block read from memory once for all tokens)
/// instead of the AVX-512 GEMM: batched decode steps of a few sequences, the experts that
/// meet a few tokens of a batch, speculative verification. Measured on the 1.5B's shapes, one
/// thread, AVX-512 VNNI without AMX: at 8 to 16 tokens the rows-in-lanes GEMV ran 1.5-2x the
/// AVX-512 GEMM (Q4_K) and 1.2-1.5x (Q6_K).
pub const GEMV_MULTI_MAX_TOKENS: usize = 16;

/// [`GEMM_DIRECT_MIN_TOKENS`] where `gk` decodes raw weights in registers, else
/// [`GEMM_MIN_TOKENS`].
fn gemm_min_tokens(gk: &crate::quant::gemm_avx512::GemmKernel) -> usize {
    if gk.direct.is_some() {
        GEMM_DIRECT_MIN_TOKENS
    } else {
        GEMM_MIN_TOKENS
    }
}

/// A borrowed 2-D weight matrix in a ggml block format.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    /// Element type of the stored rows.
    pub dtype: GgmlType,
    /// Number of rows (output features).
    pub n_out: usize,
    /// Elements per row (input features); a multiple of the type's block size.
    pub n_in: usize,
    /// `n_out` rows of `dtype.row_bytes(n_in)` bytes each, densely packed.
    pub data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// Validates the shape against `data` and returns the matrix.
    pub fn new(
        dtype: GgmlType,
        n_out: usize,
        n_in: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        let m = QMatrix {
            dtype,
            n_out,
            n_in,
            data,
        };
        m.check("QMatrix::new")?;
        Ok(m)
    }

    /// Checks `data.len()` and the block multiple; returns the bytes per row.
    fn check(&self, op: &'static str) -> Result<usize, KernelError> {
        let rb = quant::row_bytes(op, self.dtype, self.n_in)?;
        let total = rb
            .checked_mul(self.n_out)
            .ok_or(KernelError::Overflow { op })?;
        if self.data.len() != total {
            return Err(KernelError::BadLength {
                op,
                what: "weight data",
                expected: total,
                got: self.data.len(),
            });
        }
        Ok(rb)
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> Option<usize> {
        self.dtype.row_bytes(self.n_in)
    }

    /// Checks that `x` holds `n_tok` rows of `n_in` and `y` `n_tok` rows of `n_out`.
    fn check_tokens(
        &self,
        op: &'static str,
        n_tok: usize,
        x: usize,
        y: usize,
    ) -> Result<(), KernelError> {
        let n_x = n_tok
            .checked_mul(self.n_in)
            .ok_or(KernelError::Overflow { op })?;
        let n_y = n_tok
            .checked_mul(self.n_out)
            .ok_or(KernelError::Overflow { op })?;
        check_len(op, "x", n_x, x)?;
        check_len(op, "y", n_y, y)
    }

    /// The bytes of row `r`, if in range.
    pub fn row(&self, r: usize) -> Option<&'a [u8]> {
        let rb = self.row_bytes()?;
        self.data
            .get(r.checked_mul(rb)?..r.checked_add(1)?.checked_mul(rb)?)
    }
}

/// A raw pointer that tasks share to write disjoint parts of one output buffer.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub(crate) *mut T);
// SAFETY: used only to write disjoint index ranges from different tasks (see each use), and the
// owning `&mut` borrow outlives `ThreadPool::run`, which joins all tasks before returning.
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above; no two tasks touch the same element.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the field).
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }
}

/// `y[t, r] = dot(W[r, :], x[t, :])` for `t < n_tok`, `r < w.n_out`, with the fastest kernels
/// of this CPU. `x` is `[n_tok, n_in]`, `y` is `[n_tok, n_out]` (overwritten).
pub fn matmul(
    pool: &dyn ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_with(SimdLevel::detect(), pool, w, x, n_tok, y)
}

/// [`matmul`] using only the scalar twins (the test reference).
pub fn matmul_scalar(
    pool: &dyn ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_with(SimdLevel::Scalar, pool, w, x, n_tok, y)
}

/// [`matmul`] with kernels of at most `level` (errors if the CPU lacks `level`). Batches of at
/// least [`GEMM_MIN_TOKENS`] tokens take the tiled GEMM where the weight type and level have
/// one (bit-identical to [`matmul_dot_with`]); everything else takes [`matmul_dot_with`].
pub fn matmul_with(
    level: SimdLevel,
    pool: &dyn ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_impl(level, pool, w, x, n_tok, y, true)
}

/// [`matmul_with`] always on the per-row dot kernels (one [`DotKernel::dot`] per output, fused
/// 4-token `dot4` where available; a single token still takes the row-group GEMV): the
/// baseline the tiled GEMMs and the multi-token GEMV are measured and tested against.
pub fn matmul_dot_with(
    level: SimdLevel,
    pool: &dyn ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_impl(level, pool, w, x, n_tok, y, false)
}

/// `ys[i] = x · ws[i]ᵀ` for several weight matrices multiplied by the same activations (an
/// MLP's gate and up projections, attention's q, k and v), each output exactly as
/// [`matmul_with`] computes it. One token, or up to [`GEMV_MULTI_MAX_TOKENS`] where every
/// matrix has the multi-token GEMV, is one round of [`gemv_batch_with`]. Where the batch takes
/// the AVX-512 GEMM, the matrices of one type and width are done together: the activations
/// are quantised and packed once for them and all their products run in one pool round.
/// Everything else is one [`matmul_with`] per matrix. `x` is `[n_tok, n_in]`, `ys[i]` is
/// `[n_tok, ws[i].n_out]`.
pub fn matmul_many_with(
    level: SimdLevel,
    pool: &dyn ThreadPool,
    ws: &[QMatrix<'_>],
    x: &[f32],
    n_tok: usize,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    const OP: &str = "matmul";
    check_len(OP, "outputs", ws.len(), ys.len())?;
    // One token, or a few where every matrix has the multi-token row-group GEMV: one round
    // of batched GEMVs for all the matrices.
    let few = ws.iter().all(|w| {
        DotKernel::with_level(w.dtype, level).is_ok_and(|k| {
            n_tok <= GEMV_MULTI_MAX_TOKENS && k.has_gemv_multi() || lanes_gemm(&k, n_tok)
        })
    });
    if n_tok == 1 || few {
        return gemv_batch_with(level, pool, ws, &vec![x; ws.len()], ys);
    }
    let mut done = vec![false; ws.len()];
    for i in 0..ws.len() {
        if done[i] {
            continue;
        }
        let w0 = &ws[i];
        let kernel = DotKernel::with_level(w0.dtype, level)?;
        let amx = n_tok >= AMX_MIN_TOKENS
            && kernel.level() == SimdLevel::Amx
            && crate::gemm_amx::supports(w0.dtype);
        // (A few tokens on the multi-token GEMV, in a batch with other types: one
        // `matmul_impl` per matrix.)
        let multi = n_tok <= GEMV_MULTI_MAX_TOKENS && kernel.has_gemv_multi();
        let gk = (!amx && !multi && w0.n_in >= crate::quant::gemm_avx512::GROUP)
            .then(|| crate::quant::gemm_avx512::kernel(w0.dtype, kernel.level()))
            .flatten()
            .filter(|gk| n_tok >= gemm_min_tokens(gk));
        let Some(gk) = gk else {
            matmul_impl(level, pool, w0, x, n_tok, ys[i], true)?;
            done[i] = true;
            continue;
        };
        // This matrix and the later ones of its type and width.
        let idx: Vec<usize> = (i..ws.len())
            .filter(|&j| !done[j] && ws[j].dtype == w0.dtype && ws[j].n_in == w0.n_in)
            .collect();
        for &j in &idx {
            let w = &ws[j];
            w.check(OP)?;
            w.check_tokens(OP, n_tok, x.len(), ys[j].len())?;
            done[j] = true;
        }
        let group: Vec<QMatrix<'_>> = idx.iter().map(|&j| ws[j]).collect();
        let mut outs: Vec<&mut [f32]> = Vec::with_capacity(idx.len());
        // Disjoint mutable borrows of the chosen outputs, in `idx` order.
        let mut rest: &mut [&mut [f32]] = ys;
        let mut base = 0;
        for &j in &idx {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(j - base + 1);
            outs.push(&mut *head[j - base]);
            rest = tail;
            base = j + 1;
        }
        crate::gemm::gemm(&gk, pool, &group, x, n_tok, &mut outs)?;
    }
    Ok(())
}

/// `ys[i] = xs[i] · ws[i]ᵀ` for a few tokens each (`xs[i]` is `[m_i, ws[i].n_in]`, `ys[i]`
/// is `[m_i, ws[i].n_out]`, overwritten, for any `m_i`, read off the lengths): several decode
/// GEMVs in one pool round, such as the gate and up projections of every active expert of an
/// MoE layer, or attention's q, k and v. Every output is exactly what [`matmul_dot_with`]
/// (and so [`matmul_with`]) computes for that matrix and those tokens (the same kernel on the
/// same quantised rows).
///
/// Inputs passed as the same slice (same address and length) for matrices of the same width
/// are quantised once per activation format. The rows of all matrices are cut into chunks
/// that shrink through the round (`gemv_chunks`: whole 16-row groups where the kernel has a
/// row-group GEMV), and all chunks are tasks of a single pool round, so a batch of small
/// matrices pays one fork-join instead of one per matrix, and an idle thread only waits for
/// the last, short chunk of the whole batch. A chunk meets its product's tokens on the
/// multi-token row-group GEMVs where the kernel has them (passes of
/// [`GEMV_MULTI_MAX_TOKENS`] tokens, each weight block read from memory once per pass); on
/// the AMX block tile GEMM for Q8_0 and Q5_0 at [`SimdLevel::Amx`] (as [`matmul_with`] does
/// for 2 tokens and more); otherwise token by token over pieces of [`GEMV_PIECE_BYTES`], so
/// the weights are read from memory once and from L1/L2 for the other tokens.
pub fn gemv_batch_with(
    level: SimdLevel,
    pool: &dyn ThreadPool,
    ws: &[QMatrix<'_>],
    xs: &[&[f32]],
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    const OP: &str = "gemv_batch";
    check_len(OP, "inputs", ws.len(), xs.len())?;
    check_len(OP, "outputs", ws.len(), ys.len())?;
    /// A product of the batch: its kernel, bytes per row, its token count, whether the
    /// (one- or multi-token) row-group GEMV applies, and its quantised input rows.
    struct Job {
        kernel: DotKernel,
        rb: usize,
        m: usize,
        gemv: bool,
        multi: bool,
        /// Several tokens on the AMX block tile GEMM (what `matmul_with` runs for them).
        tile: bool,
        xq: usize,
    }
    // Quantised inputs (`m` rows of `xrb` bytes each), keyed by (address, length, row width,
    // activation format, weight type whose row-group GEMV layout they were prepared for,
    // whether they are needed at all: the tile GEMM quantises its own).
    type Key = (usize, usize, usize, GgmlType, Option<GgmlType>, bool);
    let mut keys: Vec<Key> = Vec::new();
    let mut xqs: Vec<(Vec<u8>, usize)> = Vec::new();
    let mut jobs = Vec::with_capacity(ws.len());
    for ((w, x), y) in ws.iter().zip(xs).zip(ys.iter_mut()) {
        let rb = w.check(OP)?;
        let kernel = DotKernel::with_level(w.dtype, level)?;
        let m = match (w.n_in, w.n_out) {
            (0, 0) => 0,
            (0, n_out) => y.len() / n_out,
            (n_in, _) => x.len() / n_in,
        };
        w.check_tokens(OP, m, x.len(), y.len())?;
        if w.n_in == 0 {
            // No products to sum (and no input to quantise).
            y.fill(0.0);
        }
        // The row-group kernels address 8 rows with i32 offsets: rows of up to 128 MiB.
        let gemv = kernel.has_gemv() && rb <= i32::MAX as usize / 16;
        let multi = gemv && m > 1 && kernel.has_gemv_multi();
        // (The block-order tile GEMM gathers 16 rows' scales with i32 offsets.)
        let tile = m > 1
            && !multi
            && kernel.level() == SimdLevel::Amx
            && crate::gemm_amx_blk::supports(w.dtype)
            && rb <= i32::MAX as usize / 16;
        let key = (
            x.as_ptr() as usize,
            x.len(),
            w.n_in,
            kernel.dot_type(),
            gemv.then_some(w.dtype),
            tile,
        );
        let xq = match keys.iter().position(|k| *k == key) {
            Some(p) => p,
            None => {
                let xrb = quant::row_bytes(OP, kernel.dot_type(), w.n_in)?;
                // (The tile GEMM quantises its own input.)
                let mut q = vec![0u8; if tile { 0 } else { xrb * m }];
                let quantize = |xr: &[f32], qr: &mut [u8]| {
                    quant::act::quantize_act(kernel.dot_type(), xr, qr);
                    if gemv {
                        kernel.prepare_gemv(qr);
                    }
                };
                if xrb > 0 && m >= QUANT_PARALLEL_MIN_TOKENS && pool.n_threads() > 1 {
                    // A prefill batch: its rows quantised in parallel, whole rows per task.
                    let per = m.div_ceil(pool.n_threads());
                    let qp = SharedMut(q.as_mut_ptr());
                    pool.run(m.div_ceil(per), &|task| {
                        let (t0, t1) = (task * per, ((task + 1) * per).min(m));
                        // SAFETY: rows t0..t1 of `q` (m rows of xrb bytes) belong to this task
                        // only; `q` outlives the pool round.
                        let qs = unsafe {
                            std::slice::from_raw_parts_mut(qp.ptr().add(t0 * xrb), (t1 - t0) * xrb)
                        };
                        let xs = &x[t0 * w.n_in..t1 * w.n_in];
                        for (xr, qr) in xs.chunks_exact(w.n_in).zip(qs.chunks_exact_mut(xrb)) {
                            quantize(xr, qr);
                        }
                    });
                } else if xrb > 0 {
                    for (xr, qr) in x.chunks_exact(w.n_in).zip(q.chunks_exact_mut(xrb)) {
                        quantize(xr, qr);
                    }
                }
                keys.push(key);
                xqs.push((q, xrb));
                xqs.len() - 1
            }
        };
        jobs.push(Job {
            kernel,
            rb,
            m,
            gemv,
            multi,
            tile,
            xq,
        });
    }

    let tasks = gemv_chunks(
        ws.iter().zip(&jobs).map(|(w, job)| {
            let rows = if w.n_in == 0 || job.m == 0 {
                0
            } else {
                w.n_out
            };
            (rows, job.rb, job.gemv)
        }),
        pool.n_threads(),
    );
    let outs: Vec<SharedMut<f32>> = ys.iter_mut().map(|y| SharedMut(y.as_mut_ptr())).collect();
    // The first error of a task (the tile GEMM's; none is expected for checked shapes).
    let failed = std::sync::Mutex::new(None::<KernelError>);
    let run = |t: usize| {
        let (i, r0, r1) = tasks[t];
        let (w, job) = (&ws[i], &jobs[i]);
        let (xq, xrb) = (&xqs[job.xq].0, xqs[job.xq].1);
        let out = |tok: usize, lo: usize, hi: usize| {
            // SAFETY: rows lo..hi (within r0..r1) of token `tok` of output `i` belong to this
            // task only (the chunks of a matrix are disjoint row ranges, and the tokens' rows
            // of an output do not overlap); tok * n_out + hi <= m * n_out = ys[i].len()
            // (checked above), and `ys` outlives `run`. Each call below asks for distinct
            // (token, rows), or for the same ones only after the earlier slice is dropped.
            unsafe {
                std::slice::from_raw_parts_mut(outs[i].ptr().add(tok * w.n_out + lo), hi - lo)
            }
        };
        let rb = job.rb;
        if job.tile {
            // The chunk's rows as a matrix of their own, on one thread; its `[m, rows]`
            // output then goes to the tokens' rows.
            let sub = QMatrix {
                dtype: w.dtype,
                n_out: r1 - r0,
                n_in: w.n_in,
                data: &w.data[r0 * rb..r1 * rb],
            };
            let mut tmp = vec![0f32; job.m * (r1 - r0)];
            match crate::gemm_amx_blk::gemm(&SerialPool, &sub, xs[i], job.m, &mut tmp) {
                Ok(()) => {
                    for (tok, t) in tmp.chunks_exact(r1 - r0).enumerate() {
                        out(tok, r0, r1).copy_from_slice(t);
                    }
                }
                Err(e) => {
                    let mut slot = failed.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert(e);
                }
            }
            return;
        }
        if job.multi && job.m > GEMV_MULTI_MAX_TOKENS && job.kernel.has_gemv_lanes() {
            // A prefill batch on the rows-in-lanes kernel: all tokens in one call (it blocks
            // them itself).
            let xr: Vec<&[u8]> = xq.chunks_exact(xrb).take(job.m).collect();
            let mut os: Vec<&mut [f32]> = (0..job.m).map(|t| out(t, r0, r1)).collect();
            job.kernel
                .gemv_multi(&w.data[r0 * rb..r1 * rb], rb, &xr, &mut os);
            return;
        }
        if job.multi {
            let mut xr: [&[u8]; GEMV_MULTI_MAX_TOKENS] = [&[]; GEMV_MULTI_MAX_TOKENS];
            let mut os: [&mut [f32]; GEMV_MULTI_MAX_TOKENS] = Default::default();
            for t0 in (0..job.m).step_by(GEMV_MULTI_MAX_TOKENS) {
                let p = (job.m - t0).min(GEMV_MULTI_MAX_TOKENS);
                for j in 0..p {
                    xr[j] = &xq[(t0 + j) * xrb..(t0 + j + 1) * xrb];
                    os[j] = out(t0 + j, r0, r1);
                }
                job.kernel
                    .gemv_multi(&w.data[r0 * rb..r1 * rb], rb, &xr[..p], &mut os[..p]);
            }
            return;
        }
        // Token by token over pieces of the chunk that stay in L1/L2 meanwhile.
        let piece = if job.m > 1 {
            GEMV_PIECE_BYTES.div_ceil(rb.max(1)).next_multiple_of(16)
        } else {
            r1 - r0
        };
        let mut a = r0;
        while a < r1 {
            let b = (a + piece).min(r1);
            for tok in 0..job.m {
                let xt = &xq[tok * xrb..(tok + 1) * xrb];
                let o = out(tok, a, b);
                if job.gemv {
                    job.kernel.gemv(&w.data[a * rb..b * rb], rb, xt, o);
                } else {
                    for (r, o) in (a..b).zip(o.iter_mut()) {
                        *o = job.kernel.dot(&w.data[r * rb..(r + 1) * rb], xt);
                    }
                }
            }
            a = b;
        }
    };
    pool.run(tasks.len(), &run);
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Token count from which a [`gemv_batch_with`] round quantises its activation rows on all
/// threads (below it one thread does, as the pool round costs more than the work).
const QUANT_PARALLEL_MIN_TOKENS: usize = 32;

/// Whether `n_tok` tokens (more than [`GEMV_MULTI_MAX_TOKENS`]) take the rows-in-lanes kernel
/// of the K formats as their GEMM (`gemv_sb_lanes`, at [`SimdLevel::Avx512Vnni`] only: the
/// AMX level keeps its measured paths until this one is measured there): in the super-block
/// order it needs about 7 vector operations per (row, token, super-block) against about 14
/// for the AVX-512 GEMM's `kern_k_sb`, whose per-token lane reduction dominates.
fn lanes_gemm(kernel: &DotKernel, n_tok: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KAPITSA_LANES_GEMM").map_or(true, |v| v != "0"))
        && n_tok > GEMV_MULTI_MAX_TOKENS
        && kernel.has_gemv_lanes()
        && kernel.level() == SimdLevel::Avx512Vnni
}

/// Row chunks `(matrix, first row, end row)` of one decode round over matrices given as
/// `(rows, bytes per row, whole 16-row groups)`, in the order tasks are claimed. Each chunk
/// takes about `1 / (GEMV_CHUNK_FACTOR * n_threads)` of the bytes still unassigned, clamped to
/// [`GEMV_MIN_CHUNK_BYTES`]..=[`GEMV_MAX_CHUNK_BYTES`], never less than one row, and rounded
/// up to whole 16-row groups where the row-group GEMV applies; a matrix's last chunk takes
/// what is left of it. Matrices without rows give no chunk. Together the chunks cover every
/// row of every matrix exactly once.
fn gemv_chunks(
    mats: impl Iterator<Item = (usize, usize, bool)> + Clone,
    n_threads: usize,
) -> Vec<(usize, usize, usize)> {
    let mut left: usize = mats
        .clone()
        .map(|(n, rb, _)| n.saturating_mul(rb))
        .fold(0, usize::saturating_add);
    let div = GEMV_CHUNK_FACTOR * n_threads.max(1);
    let mut tasks = Vec::new();
    for (i, (n_out, rb, group16)) in mats.enumerate() {
        let mut r = 0;
        while r < n_out {
            let bytes = (left / div).clamp(GEMV_MIN_CHUNK_BYTES, GEMV_MAX_CHUNK_BYTES);
            let mut rows = bytes.div_ceil(rb.max(1)).max(1);
            if group16 {
                rows = rows.next_multiple_of(16);
            }
            let end = r.saturating_add(rows).min(n_out);
            tasks.push((i, r, end));
            left = left.saturating_sub((end - r).saturating_mul(rb));
            r = end;
        }
    }
    tasks
}

fn matmul_impl(
    level: SimdLevel,
    pool: &dyn ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
    allow_gemm: bool,
) -> Result<(), KernelError> {
    const OP: &str = "matmul";
    let rb = w.check(OP)?;
    let (n_in, n_out) = (w.n_in, w.n_out);
    w.check_tokens(OP, n_tok, x.len(), y.len())?;
    let kernel = DotKernel::with_level(w.dtype, level)?;
    if n_tok == 0 || n_out == 0 {
        return Ok(());
    }
    if n_in == 0 {
        y.fill(0.0);
        return Ok(());
    }
    if n_tok == 1 {
        return gemv_batch_with(level, pool, std::slice::from_ref(w), &[x], &mut [y]);
    }
    // (The row-group kernels address 8 rows with i32 offsets: rows of up to 128 MiB.)
    let multi = allow_gemm
        && (n_tok <= GEMV_MULTI_MAX_TOKENS && kernel.has_gemv_multi()
            || lanes_gemm(&kernel, n_tok))
        && rb <= i32::MAX as usize / 16;
    if multi {
        // A few tokens on the multi-token row-group GEMV: each weight block decoded once for
        // all of them.
        return gemv_batch_with(level, pool, std::slice::from_ref(w), &[x], &mut [y]);
    }
    // (The block-order tile GEMM gathers the 16 rows' scales with i32 offsets.)
    if allow_gemm
        && n_tok >= 2
        && kernel.level() == SimdLevel::Amx
        && crate::gemm_amx_blk::supports(w.dtype)
        && rb <= i32::MAX as usize / 16
    {
        return crate::gemm_amx_blk::gemm(pool, w, x, n_tok, y);
    }
    if allow_gemm
        && n_tok >= AMX_MIN_TOKENS
        && kernel.level() == SimdLevel::Amx
        && crate::gemm_amx::supports(w.dtype)
    {
        return crate::gemm_amx::gemm(pool, w, x, n_tok, y);
    }
    if allow_gemm && n_in >= crate::quant::gemm_avx512::GROUP {
        if let Some(gk) = crate::quant::gemm_avx512::kernel(w.dtype, kernel.level())
            .filter(|gk| n_tok >= gemm_min_tokens(gk))
        {
            return crate::gemm::gemm(&gk, pool, std::slice::from_ref(w), x, n_tok, &mut [y]);
        }
    }

    // 1. Quantise every activation row once.
    let dot_ty = kernel.dot_type();
    let xrb = quant::row_bytes(OP, dot_ty, n_in)?;
    let mut xq = vec![
        0u8;
        n_tok
            .checked_mul(xrb)
            .ok_or(KernelError::Overflow { op: OP })?
    ];
    if pool.n_threads() == 1 {
        for (xr, qr) in x.chunks_exact(n_in).zip(xq.chunks_exact_mut(xrb)) {
            quant::act::quantize_act(dot_ty, xr, qr);
        }
    } else {
        let per = n_tok.div_ceil(pool.n_threads());
        let n_tasks = n_tok.div_ceil(per);
        let qp = SharedMut(xq.as_mut_ptr());
        pool.run(n_tasks, &|task| {
            let t0 = task * per;
            let t1 = (t0 + per).min(n_tok);
            for t in t0..t1 {
                // SAFETY: task `task` alone writes rows t0..t1 of `xq` (disjoint ranges); `xq`
                // has n_tok * xrb bytes and outlives `run`.
                let qr = unsafe { std::slice::from_raw_parts_mut(qp.ptr().add(t * xrb), xrb) };
                quant::act::quantize_act(dot_ty, &x[t * n_in..(t + 1) * n_in], qr);
            }
        });
    }

    // 2. Tiles of (row chunk) x (token block).
    let n_tb = n_tok.div_ceil(TOK_BLOCK);
    let row_chunks = (pool.n_threads() * 4).div_ceil(n_tb).clamp(1, n_out);
    let chunk = n_out.div_ceil(row_chunks).max(1);
    let row_chunks = n_out.div_ceil(chunk);
    let yp = SharedMut(y.as_mut_ptr());
    let xq = &xq;
    let tile = |task: usize| {
        let (rc, tb) = (task % row_chunks, task / row_chunks);
        let rows = rc * chunk..((rc + 1) * chunk).min(n_out);
        let toks = tb * TOK_BLOCK..((tb + 1) * TOK_BLOCK).min(n_tok);
        let xrow = |t: usize| &xq[t * xrb..(t + 1) * xrb];
        for r in rows {
            let wr = &w.data[r * rb..(r + 1) * rb];
            let mut t = toks.start;
            if kernel.has_dot4() {
                // Fused 4-token kernel: decodes the weight row once per 4 tokens; each result
                // is bit-identical to `dot`, so batching never changes outputs.
                while t + 4 <= toks.end {
                    let v = kernel.dot4(wr, [xrow(t), xrow(t + 1), xrow(t + 2), xrow(t + 3)]);
                    for (k, vk) in v.into_iter().enumerate() {
                        // SAFETY: element (t + k, r) belongs to this tile only; t + k < n_tok,
                        // r < n_out, so the index is inside `y`, which outlives `run`.
                        unsafe { *yp.ptr().add((t + k) * n_out + r) = vk };
                    }
                    t += 4;
                }
            }
            for t in t..toks.end {
                let v = kernel.dot(wr, xrow(t));
                // SAFETY: element (t, r) belongs to exactly one tile (this one); t < n_tok and
                // r < n_out so the index is inside `y`, which outlives `run`.
                unsafe { *yp.ptr().add(t * n_out + r) = v };
            }
        }
    };
    let n_tasks = row_chunks * n_tb;
    if n_tasks == 1 || pool.n_threads() == 1 {
        (0..n_tasks).for_each(tile);
    } else {
        pool.run(n_tasks, &tile);
    }
    Ok(())
}

/// Embedding lookup: `out[i, :] = dequantize(W[ids[i], :])`; `out` is `[ids.len(), n_in]`.
/// Errors (before writing anything) if any id is `>= n_out`.
pub fn get_rows(w: &QMatrix<'_>, ids: &[u32], out: &mut [f32]) -> Result<(), KernelError> {
    const OP: &str = "get_rows";
    let rb = w.check(OP)?;
    let n = ids
        .len()
        .checked_mul(w.n_in)
        .ok_or(KernelError::Overflow { op: OP })?;
    check_len(OP, "out", n, out.len())?;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= w.n_out) {
        return Err(KernelError::RowOutOfRange {
            op: OP,
            id: u64::from(bad),
            n_rows: w.n_out,
        });
    }
    if w.n_in == 0 {
        return Ok(());
    }
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(w.n_in)) {
        let r = id as usize;
        quant::dequantize_row(w.dtype, &w.data[r * rb..(r + 1) * rb], o)?;
    }
    Ok(())
}

/// Dequantises rows `rows` of `w` into `out` (`[rows.len(), n_in]`).
pub fn dequantize_rows(
    w: &QMatrix<'_>,
    rows: Range<usize>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "dequantize_rows";
    let rb = w.check(OP)?;
    if rows.start > rows.end || rows.end > w.n_out {
        return Err(KernelError::RowOutOfRange {
            op: OP,
            id: rows.end as u64,
            n_rows: w.n_out,
        });
    }
    let n = rows
        .len()
        .checked_mul(w.n_in)
        .ok_or(KernelError::Overflow { op: OP })?;
    check_len(OP, "out", n, out.len())?;
    if w.n_in == 0 {
        return Ok(());
    }
    quant::dequantize_row(w.dtype, &w.data[rows.start * rb..rows.end * rb], out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunks of a round cover every row of every matrix once, in order; they start on
    /// 16-row groups where asked; none is longer than the largest chunk (plus the rounding
    /// to whole rows and groups); only a matrix's last chunk is shorter than the smallest;
    /// and they shrink through the round.
    #[test]
    fn gemv_chunks_cover_every_row_once_and_shrink() {
        let cases: Vec<Vec<(usize, usize, bool)>> = vec![
            vec![(248_320, 1680, true)],
            vec![(512, 1152, true); 16],
            vec![
                (2048, 1152, true),
                (0, 1152, true),
                (33, 8192, false),
                (1, 3, false),
            ],
            vec![(7, 100, true), (100_000, 17, false)],
            vec![],
        ];
        for mats in cases {
            for threads in [1, 2, 3, 8] {
                let tasks = gemv_chunks(mats.iter().copied(), threads);
                let mut next = (0usize, 0usize);
                let mut prev_bytes = usize::MAX;
                for (k, &(i, r0, r1)) in tasks.iter().enumerate() {
                    let (n_out, rb, g16) = mats[i];
                    while next.0 < i {
                        assert_eq!(next.1, mats[next.0].0, "matrix {} not finished", next.0);
                        next = (next.0 + 1, 0);
                    }
                    assert_eq!((i, r0), next, "task {k} of {mats:?} at {threads} threads");
                    assert!(r0 < r1 && r1 <= n_out);
                    if g16 {
                        assert_eq!(r0 % 16, 0);
                    }
                    let bytes = (r1 - r0) * rb;
                    let max_rows = GEMV_MAX_CHUNK_BYTES.div_ceil(rb).next_multiple_of(16);
                    assert!(r1 - r0 <= max_rows);
                    if r1 < n_out {
                        assert!(bytes >= GEMV_MIN_CHUNK_BYTES);
                        // Shrinking: never longer than the previous full chunk, up to the
                        // rounding to whole rows / groups.
                        assert!(bytes <= prev_bytes.saturating_add(16 * rb), "{tasks:?}");
                        prev_bytes = bytes;
                    }
                    next = (i, r1);
                }
                while next.0 < mats.len() {
                    assert_eq!(next.1, mats[next.0].0, "matrix {} not covered", next.0);
                    next = (next.0 + 1, 0);
                }
                // The output head: far more than one chunk per thread, and the last chunks
                // are the smallest allowed.
                if mats.len() == 1 && mats[0].0 == 248_320 {
                    assert!(tasks.len() > 8 * threads);
                    let (_, r0, r1) = tasks[tasks.len() - 2];
                    assert!((r1 - r0) * 1680 < 2 * GEMV_MIN_CHUNK_BYTES);
                }
            }
        }
    }
}
