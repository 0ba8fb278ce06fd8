//! Causal multi-head attention over a per-sequence KV cache (GQA-aware), for prefill and decode.
//!
//! Layouts (row-major):
//! - `q`: `[n_tok, n_head, head_dim]` f32, the new tokens of ONE sequence, token `i` at
//!   position `pos[i]`;
//! - `k`, `v`: [`KvView`]s: the cache rows of that sequence, one row `[n_head_kv, head_dim]`
//!   (f32, f16 or Q8_0 blocks, see [`KvSlice`]) per position, stored in fixed-size blocks located by a block table (paged
//!   KV) or in one contiguous run ([`KvView::contiguous`]); every position `0..=max(pos)`
//!   must already hold the keys/values (the caller writes the new tokens' K/V before
//!   calling);
//! - `out`: `[n_tok, n_head, head_dim]` f32.
//!
//! Query head `h` reads KV head `h / (n_head / n_head_kv)`; token `i` attends to positions
//! `0..=pos[i]`. Work is split by KV head: each task gathers its K/V columns into f32 once
//! (following the block table) and serves every query head of its group and every query
//! token.

use half::f16;
use kapitsa_base::ThreadPool;
use std::cell::RefCell;
use std::sync::Mutex;

use half::slice::HalfFloatSliceExt;

use crate::ops::{axpy, dot_f32};

/// Borrowed K or V cache storage (elements of one layer).
#[derive(Debug, Clone, Copy)]
pub enum KvSlice<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements (the default cache type: half the memory, like llama.cpp's default).
    F16(&'a [f16]),
    /// ggml Q8_0 blocks of [`Q8_0_BLOCK`] elements, [`Q8_0_BYTES`] bytes each: an f16 scale
    /// `d` (little-endian), then 32 `i8` quants; element `i` is `quant[i % 32] * d` of block
    /// `i / 32` (byte offset `(i / 32) * 34 + 2 + i % 32`). Reads must start and end on a
    /// block boundary, so a cache row's heads must be multiples of 32 long (each block then
    /// lies inside one head: the quantisation is per head).
    Q8_0(&'a [u8]),
}

/// Elements per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per Q8_0 block: f16 scale + 32 `i8` quants.
pub const Q8_0_BYTES: usize = 34;

impl KvSlice<'_> {
    /// Elements held (whole Q8_0 blocks only).
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
            KvSlice::Q8_0(s) => s.len() / Q8_0_BYTES * Q8_0_BLOCK,
        }
    }

    /// Whether no element is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Convert `dst.len()` elements starting at element `src` to f32.
    ///
    /// # Panics
    /// If `src + dst.len()` is past the end, or, for Q8_0, if `src` or `dst.len()` is not a
    /// multiple of 32 (a caller bug: cache rows are made of whole blocks).
    pub fn read(&self, src: usize, dst: &mut [f32]) {
        let n = dst.len();
        match self {
            KvSlice::F32(s) => dst.copy_from_slice(&s[src..src + n]),
            // exact conversion, vectorised (F16C) where the CPU has it
            KvSlice::F16(s) => f16_to_f32(&s[src..src + n], dst),
            KvSlice::Q8_0(s) => {
                assert!(
                    src.is_multiple_of(Q8_0_BLOCK) && n.is_multiple_of(Q8_0_BLOCK),
                    "Q8_0 KV reads must cover whole blocks (start {src}, length {n})"
                );
                let b0 = src / Q8_0_BLOCK * Q8_0_BYTES;
                let bytes = &s[b0..b0 + n / Q8_0_BLOCK * Q8_0_BYTES];
                for (o, b) in dst
                    .chunks_exact_mut(Q8_0_BLOCK)
                    .zip(bytes.chunks_exact(Q8_0_BYTES))
                {
                    let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                    for (y, &q) in o.iter_mut().zip(&b[2..]) {
                        *y = f32::from(q as i8) * d;
                    }
                }
            }
        }
    }
}

/// `dst[i] = src[i]` widened to f32 (exact) for `i < dst.len()` (`src` at least as long):
/// 16 at a time with AVX-512 where the CPU has it, else `half`'s conversion (which calls a
/// function per 8 elements). At long contexts this gather is ~10% of a batched decode step
/// either way (measured: no speed change from this version): it is bound by reading the
/// cache, which only a layout that needs no gather would avoid.
fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if kapitsa_base::CpuFeatures::get().avx512 {
        // SAFETY: AVX-512F is present (checked).
        unsafe { x86::f16_to_f32(src, dst) };
        return;
    }
    src[..dst.len()].convert_to_f32_slice(dst);
}

/// The block table of a contiguous view: one block, id 0.
const ONE_BLOCK: [u32; 1] = [0];

/// The K or V rows of one sequence in one layer.
///
/// `data` holds whole blocks: `[n_blocks, block_size, n_head_kv, head_dim]`. Position `p`
/// of the sequence is row `p % block_size` of block `table[p / block_size]`.
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    /// Every block of the layer.
    pub data: KvSlice<'a>,
    /// Block ids of the sequence, in position order.
    pub table: &'a [u32],
    /// Positions per block (>= 1).
    pub block_size: usize,
}

impl<'a> KvView<'a> {
    /// Rows stored contiguously: position `p` is row `p` of `data`.
    pub fn contiguous(data: KvSlice<'a>) -> KvView<'a> {
        KvView {
            data,
            table: &ONE_BLOCK,
            block_size: usize::MAX,
        }
    }

    /// Whether positions `0..n` (rows of `stride` elements) are inside `data`.
    fn holds(&self, n: usize, stride: usize) -> bool {
        if n == 0 {
            return true;
        }
        let bs = self.block_size.max(1);
        let nb = (n - 1) / bs + 1;
        nb <= self.table.len()
            && self.table[..nb].iter().enumerate().all(|(i, &b)| {
                let rows = (n - i * bs).min(bs);
                (b as usize)
                    .checked_mul(bs)
                    .and_then(|r| r.checked_add(rows))
                    .and_then(|r| r.checked_mul(stride))
                    .is_some_and(|end| end <= self.data.len())
            })
    }

    /// Copy column block `[0..n, kvh, :]` to `dst` (`[n, head_dim]`) as f32.
    fn gather_head(
        &self,
        n: usize,
        n_head_kv: usize,
        head_dim: usize,
        kvh: usize,
        dst: &mut [f32],
    ) {
        let stride = n_head_kv * head_dim;
        let bs = self.block_size.max(1);
        let mut j = 0;
        for &b in self.table {
            if j >= n {
                break;
            }
            let rows = (n - j).min(bs);
            let base = b as usize * bs;
            for r in 0..rows {
                let src = (base + r) * stride + kvh * head_dim;
                self.data
                    .read(src, &mut dst[(j + r) * head_dim..(j + r + 1) * head_dim]);
            }
            j += rows;
        }
    }
}

/// How a dot product of [`attention_with`] is summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SumOrder {
    /// One 16-lane FMA chain, then the `_mm512_reduce_add_ps` tree (tinyBLAS's order).
    #[default]
    OneChain,
    /// `ggml_vec_dot_f32`'s AVX-512 order: four 16-lane accumulators, chunk `c` of 16
    /// elements into accumulator `c % 4`, folded `(0 + 2) + (1 + 3)` and reduced; elements
    /// past the last whole 64 fused in one by one (where the length is a multiple of 16 those
    /// are whole chunks padded with zeros, as llama.cpp's padded KV length gives).
    Ggml4Acc,
}

/// The summation orders of [`attention_with`]: the scores `q · k` (over the head dims) and
/// the outputs `p · v` (over the positions). The default, [`SumOrder::OneChain`] for both,
/// does not depend on the batch, so a token's outputs never depend on what shares its
/// forward pass. llama.cpp's CPU backend instead picks by the batch (`ggml_compute_forward_mul_mat`
/// sends its `f32` products to tinyBLAS only for 2 or more query tokens and only if the
/// operand is contiguous): scores always in [`SumOrder::Ggml4Acc`], `p · v` in
/// [`SumOrder::OneChain`] for a batch of several tokens and [`SumOrder::Ggml4Acc`] for one.
/// Only for reproducing llama.cpp bit for bit (AVX-512 path; the portable fallback ignores it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttnOrder {
    /// Order of the scores.
    pub scores: SumOrder,
    /// Order of the outputs.
    pub pv: SumOrder,
}

/// Shape parameters of one [`attention`] call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub n_head: usize,
    /// KV heads (divides `n_head`).
    pub n_head_kv: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f32,
}

thread_local! {
    /// Per-worker buffers of [`attention`]: the gathered K and V columns of one KV head.
    static GATHER: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Causal attention for one sequence; see the module docs for layouts.
///
/// # Panics
/// Never on valid shapes; shapes are checked with `assert!` at entry because a mismatch is a
/// programming error in the model code, not bad user input.
pub fn attention(
    pool: &dyn ThreadPool,
    shape: AttnShape,
    q: &[f32],
    pos: &[u32],
    k: KvView<'_>,
    v: KvView<'_>,
    out: &mut [f32],
) {
    attention_with(pool, shape, AttnOrder::default(), q, pos, k, v, out)
}

/// [`attention`] with the dot products summed in `order`.
#[allow(clippy::too_many_arguments)]
pub fn attention_with(
    pool: &dyn ThreadPool,
    shape: AttnShape,
    order: AttnOrder,
    q: &[f32],
    pos: &[u32],
    k: KvView<'_>,
    v: KvView<'_>,
    out: &mut [f32],
) {
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim,
        ..
    } = shape;
    let n_tok = pos.len();
    assert!(n_head_kv > 0 && n_head % n_head_kv == 0);
    assert_eq!(q.len(), n_tok * n_head * head_dim);
    assert_eq!(out.len(), q.len());
    let n_ctx = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
    assert!(k.holds(n_ctx, n_head_kv * head_dim) && v.holds(n_ctx, n_head_kv * head_dim));
    let group = n_head / n_head_kv;

    let results: Vec<Mutex<Vec<f32>>> = (0..n_head_kv).map(|_| Mutex::new(Vec::new())).collect();
    pool.run(n_head_kv, &|kvh| {
        // The gathered K/V columns live in this worker's scratch, reused across calls (a
        // fresh multi-MiB allocation per call and head costs page faults at every token).
        // The buffers are taken out for the task (no borrow is held while computing).
        let (mut kf, mut vf) =
            GATHER.with_borrow_mut(|(a, b)| (std::mem::take(a), std::mem::take(b)));
        kf.resize(n_ctx * head_dim, 0.0);
        vf.resize(n_ctx * head_dim, 0.0);
        k.gather_head(n_ctx, n_head_kv, head_dim, kvh, &mut kf);
        v.gather_head(n_ctx, n_head_kv, head_dim, kvh, &mut vf);
        let res = head_task(&kf, &vf, q, pos, kvh, shape, order);
        GATHER.with_borrow_mut(|g| *g = (kf, vf));
        // A poisoned lock can only come from a panic in another task, which already aborts
        // the whole `run`; recover the data either way.
        *results[kvh].lock().unwrap_or_else(|e| e.into_inner()) = res;
    });
    for (kvh, r) in results.into_iter().enumerate() {
        let res = r.into_inner().unwrap_or_else(|e| e.into_inner());
        for i in 0..n_tok {
            for g in 0..group {
                let h = kvh * group + g;
                out[(i * n_head + h) * head_dim..(i * n_head + h + 1) * head_dim].copy_from_slice(
                    &res[(i * group + g) * head_dim..(i * group + g + 1) * head_dim],
                );
            }
        }
    }
}

/// One KV head's share of [`attention`]: `kf`/`vf` its gathered K/V columns
/// (`[n_ctx, head_dim]` f32); returns `[n_tok, group, head_dim]`.
fn head_task(
    kf: &[f32],
    vf: &[f32],
    q: &[f32],
    pos: &[u32],
    kvh: usize,
    shape: AttnShape,
    order: AttnOrder,
) -> Vec<f32> {
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim,
        scale,
    } = shape;
    let n_tok = pos.len();
    let n_ctx = kf.len() / head_dim;
    let group = n_head / n_head_kv;
    // [n_tok, group, head_dim]
    let mut res = vec![0f32; n_tok * group * head_dim];
    #[cfg(target_arch = "x86_64")]
    if kapitsa_base::CpuFeatures::get().avx512 && head_dim % 16 == 0 {
        // SAFETY: AVX-512F/DQ available (checked); shapes checked at entry.
        unsafe {
            x86::head_group(
                kf, vf, q, pos, kvh, group, n_head, head_dim, scale, order, &mut res,
            )
        };
        return res;
    }
    let mut scores = vec![0f32; n_ctx];
    for (i, &p) in pos.iter().enumerate() {
        let n = p as usize + 1;
        for g in 0..group {
            let h = kvh * group + g;
            let qh = &q[(i * n_head + h) * head_dim..(i * n_head + h + 1) * head_dim];
            let s = &mut scores[..n];
            for (j, sj) in s.iter_mut().enumerate() {
                *sj = dot_f32(qh, &kf[j * head_dim..(j + 1) * head_dim]) * scale;
            }
            crate::ops::softmax(s);
            let o = &mut res[(i * group + g) * head_dim..(i * group + g + 1) * head_dim];
            for (j, &pj) in s.iter().enumerate() {
                axpy(pj, &vf[j * head_dim..(j + 1) * head_dim], o);
            }
        }
    }
    res
}

/// AVX-512 attention of one KV head group, with ggml's operation order (see
/// [`crate::vexp`] for why it matters): each score is one 16-lane FMA accumulation over the
/// head dims reduced at the end; softmax uses the vectorised exp on 16-position chunks,
/// sums chunk totals in f64 and scales by `(f32)(1/sum)`; each output dim is one 16-lane FMA
/// accumulation over positions (zero-padded to a multiple of 16) reduced at the end.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    /// [`super::f16_to_f32`] with `vcvtph2ps`: 16 elements per instruction, the tail one by
    /// one (the same exact conversion).
    #[target_feature(enable = "avx512f")]
    pub(super) fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        let src = &src[..dst.len()];
        let mut d = dst.chunks_exact_mut(16);
        let mut s = src.chunks_exact(16);
        for (o, i) in (&mut d).zip(&mut s) {
            // SAFETY: `i` is 16 f16 (32 readable bytes), `o` 16 writable f32; unaligned.
            unsafe {
                let h = _mm256_loadu_si256(i.as_ptr().cast());
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_cvtph_ps(h));
            }
        }
        for (o, i) in d.into_remainder().iter_mut().zip(s.remainder()) {
            *o = i.to_f32();
        }
    }

    #[target_feature(enable = "avx512f")]
    fn dot_one_acc(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = _mm512_setzero_ps();
        for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
            // SAFETY: both chunks hold exactly 16 f32.
            unsafe {
                acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(x.as_ptr()),
                    _mm512_loadu_ps(y.as_ptr()),
                    acc,
                )
            };
        }
        _mm512_reduce_add_ps(acc)
    }

    /// `ggml_vec_dot_f32` with AVX-512 ([`super::SumOrder::Ggml4Acc`]): accumulator `j`
    /// takes elements `64i + 16j..64i + 16j + 16`; then `a0 + a2`, `a1 + a3`, their sum, the
    /// reduction tree, and the leftover elements fused in one at a time. With `pad16`, a
    /// length that is a multiple of 16 counts as zero padded to a multiple of 64: its last
    /// whole chunks go to their accumulators (adding zeros changes no sum).
    #[target_feature(enable = "avx512f,fma")]
    fn dot_ggml4(a: &[f32], b: &[f32], pad16: bool) -> f32 {
        let n = a.len().min(b.len());
        let np = if pad16 { n / 16 * 16 } else { n / 64 * 64 };
        let mut acc = [_mm512_setzero_ps(); 4];
        for c in 0..np / 16 {
            // SAFETY: 16c + 16 <= np <= n, both slices hold n f32.
            unsafe {
                acc[c % 4] = _mm512_fmadd_ps(
                    _mm512_loadu_ps(a.as_ptr().add(16 * c)),
                    _mm512_loadu_ps(b.as_ptr().add(16 * c)),
                    acc[c % 4],
                )
            };
        }
        let s02 = _mm512_add_ps(acc[0], acc[2]);
        let s13 = _mm512_add_ps(acc[1], acc[3]);
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(s02, s13));
        for i in np..n {
            s = a[i].mul_add(b[i], s);
        }
        s
    }

    /// Four [`dot_one_acc`]s of `rows[k]` with `b` at once: four independent accumulator
    /// chains (the loads of `b` shared), each the same operation sequence as `dot_one_acc`,
    /// so each result is bit-identical to it. One chain alone waits on its FMA latency;
    /// four keep the FMA units busy.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn dot_four(rows: [&[f32]; 4], b: &[f32]) -> [f32; 4] {
        let n = b.len() / 16 * 16;
        let mut acc = [_mm512_setzero_ps(); 4];
        for o in (0..n).step_by(16) {
            // SAFETY: `o + 16 <= n <= b.len()`, and every row is at least as long as `b`
            // (asserted by the callers' shapes: rows and `b` have the same length).
            unsafe {
                let y = _mm512_loadu_ps(b.as_ptr().add(o));
                for (a, r) in acc.iter_mut().zip(rows) {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(r.as_ptr().add(o)), y, *a);
                }
            }
        }
        acc.map(|a| _mm512_reduce_add_ps(a))
    }

    /// Sixteen horizontal sums at once. Lane `4q + k` of the result is the sum of the 16
    /// lanes of `v[4k + q]`, added in exactly the tree `_mm512_reduce_add_ps` uses (lanes
    /// `i` and `i + 8`, then `i` and `i + 4`, `i` and `i + 2`, `i` and `i + 1`), so each
    /// sum is bit-identical to reducing that vector alone; about 1 shuffle + 1 add per sum
    /// instead of ~8 operations.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn reduce16(v: &[__m512; 16]) -> __m512 {
        // t[m]: lanes 0-7 the 8-lane partials of v[2m], lanes 8-15 those of v[2m + 1]
        let mut t = [_mm512_setzero_ps(); 8];
        for m in 0..8 {
            t[m] = fold_f32x4::<0b01_00_01_00, 0b11_10_11_10>(v[2 * m], v[2 * m + 1]);
        }
        // u[m]: 128-bit chunk q holds the 4-lane partials of v[4m + q]
        let mut u = [_mm512_setzero_ps(); 4];
        for m in 0..4 {
            u[m] = fold_f32x4::<0b10_00_10_00, 0b11_01_11_01>(t[2 * m], t[2 * m + 1]);
        }
        // w[m]: chunk q holds the 2-lane partials of v[8m + q] (lanes 0-1) and
        // v[8m + 4 + q] (lanes 2-3)
        let w0 = fold_ps::<0b01_00_01_00, 0b11_10_11_10>(u[0], u[1]);
        let w1 = fold_ps::<0b01_00_01_00, 0b11_10_11_10>(u[2], u[3]);
        fold_ps::<0b10_00_10_00, 0b11_01_11_01>(w0, w1)
    }

    /// One step of [`reduce16`]: `shuffle_f32x4(a, b, LO) + shuffle_f32x4(a, b, HI)`
    /// (128-bit chunks of `a` and `b` paired by the two selections).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold_f32x4<const LO: i32, const HI: i32>(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<LO>(a, b),
            _mm512_shuffle_f32x4::<HI>(a, b),
        )
    }

    /// One step of [`reduce16`] inside each 128-bit chunk: `shuffle_ps(a, b, LO) +
    /// shuffle_ps(a, b, HI)`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold_ps<const LO: i32, const HI: i32>(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_ps::<LO>(a, b), _mm512_shuffle_ps::<HI>(a, b))
    }

    /// The 16 dot products of 4 rows `a[k]` with 4 rows `b[q]`, each the operation sequence
    /// of [`dot_one_acc`] (one 16-lane FMA chain, then the reduction tree): lane `4q + k`
    /// of the result is `a[k] · b[q]`. Row `a[k]` runs over its first `len[k]` elements
    /// (multiples of 16): the chains run together up to the shortest, then each row's four
    /// chains continue alone to its own length, so every chain is exactly its own.
    ///
    /// # Safety
    /// AVX-512F; every `a[k]` is readable for `len[k]` f32 and every `b[q]` for
    /// `max(len)` f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn dots_4x4(a: [*const f32; 4], len: [usize; 4], b: [*const f32; 4]) -> __m512 {
        let mut acc = [_mm512_setzero_ps(); 16];
        let common = len.iter().copied().min().unwrap_or(0);
        let mut o = 0;
        while o < common {
            // SAFETY: o + 16 <= len[k] for every k and <= max(len) (caller's contract).
            unsafe {
                let mut bv = [_mm512_setzero_ps(); 4];
                for q in 0..4 {
                    bv[q] = _mm512_loadu_ps(b[q].add(o));
                }
                for k in 0..4 {
                    let av = _mm512_loadu_ps(a[k].add(o));
                    for q in 0..4 {
                        acc[4 * k + q] = _mm512_fmadd_ps(av, bv[q], acc[4 * k + q]);
                    }
                }
            }
            o += 16;
        }
        for k in 0..4 {
            let mut o = common;
            while o < len[k] {
                // SAFETY: as above, o + 16 <= len[k] <= max(len).
                unsafe {
                    let av = _mm512_loadu_ps(a[k].add(o));
                    for q in 0..4 {
                        acc[4 * k + q] =
                            _mm512_fmadd_ps(av, _mm512_loadu_ps(b[q].add(o)), acc[4 * k + q]);
                    }
                }
                o += 16;
            }
        }
        reduce16(&acc)
    }

    /// Query tokens per block: their scores and probabilities (`group` rows each) stay in
    /// memory together, so every K row and every row of `Vᵀ` is read once per block instead
    /// of once per query row.
    const QB: usize = 16;
    /// Keys per score block (one block of K rows, 32 KiB at head_dim 256, stays in L1).
    const KB: usize = 32;
    /// Output dims per block (that many rows of `Vᵀ` stay in L2).
    const DB: usize = 16;

    /// # Safety
    /// AVX-512F and DQ must be available; `head_dim % 16 == 0`; `kf`/`vf` hold
    /// `max(pos)+1` rows of `head_dim`; `q` and `res` as in [`super::attention`].
    ///
    /// Every score, probability and output is computed by exactly the operations of the
    /// one-row-at-a-time form ([`head_group_rowwise`], kept for the tests); only the loop
    /// order is blocked (queries x keys for the scores, queries x output dims for `P·V`),
    /// with 4 x 4 register tiles ([`dots_4x4`]) inside the blocks.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn head_group(
        kf: &[f32],
        vf: &[f32],
        q: &[f32],
        pos: &[u32],
        kvh: usize,
        group: usize,
        n_head: usize,
        head_dim: usize,
        scale: f32,
        order: super::AttnOrder,
        res: &mut [f32],
    ) {
        let n_ctx = kf.len() / head_dim;
        let n_pad = n_ctx.div_ceil(16) * 16;
        // This worker's buffers, reused across calls (taken out while computing).
        let (mut vt, mut p) = BUFS.with_borrow_mut(|(a, b)| (std::mem::take(a), std::mem::take(b)));
        // V transposed and zero padded: vt[d][j]
        vt.resize(head_dim * n_pad, 0.0);
        for d in 0..head_dim {
            vt[d * n_pad + n_ctx..(d + 1) * n_pad].fill(0.0);
        }
        for j in 0..n_ctx {
            for d in 0..head_dim {
                vt[d * n_pad + j] = vf[j * head_dim + d];
            }
        }
        // Probabilities of the block's rows, row (i - i0) * group + g; every entry a row
        // reads is written first.
        p.resize(QB.min(pos.len()) * group * n_pad, 0.0);
        blocked(
            &vt, &mut p, kf, q, pos, kvh, group, n_head, head_dim, scale, order, res,
        );
        BUFS.with_borrow_mut(|b| *b = (vt, p));
    }

    thread_local! {
        /// `Vᵀ` and the probabilities of [`head_group`].
        static BUFS: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
            const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }

    /// The body of [`head_group`] over its buffers: `vt` is `Vᵀ` (`[head_dim, n_pad]`, zero
    /// padded), `p` room for `QB * group` rows of `n_pad` probabilities.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn blocked(
        vt: &[f32],
        p: &mut [f32],
        kf: &[f32],
        q: &[f32],
        pos: &[u32],
        kvh: usize,
        group: usize,
        n_head: usize,
        head_dim: usize,
        scale: f32,
        order: super::AttnOrder,
        res: &mut [f32],
    ) {
        let n_ctx = kf.len() / head_dim;
        let n_pad = n_ctx.div_ceil(16) * 16;
        let krow = |j: usize| &kf[j * head_dim..(j + 1) * head_dim];
        let vrow = |d: usize| &vt[d * n_pad..(d + 1) * n_pad];
        let mut lanes = [0f32; 16];
        for i0 in (0..pos.len()).step_by(QB) {
            let i1 = (i0 + QB).min(pos.len());
            let nr = (i1 - i0) * group;
            // row r of the block: token i0 + r / group, query head kvh * group + r % group
            let n_of = |r: usize| pos[i0 + r / group] as usize + 1;
            let m_of = |r: usize| n_of(r).div_ceil(16) * 16;
            let q_of = |r: usize| {
                let (i, h) = (i0 + r / group, kvh * group + r % group);
                &q[(i * n_head + h) * head_dim..(i * n_head + h + 1) * head_dim]
            };
            let quads = nr / 4 * 4;
            // 1. scores, keys outer; rows in fours (the last nr % 4 one at a time)
            if order.scores == super::SumOrder::Ggml4Acc {
                for r in 0..nr {
                    for j in 0..n_of(r) {
                        p[r * n_pad + j] = dot_ggml4(q_of(r), krow(j), false) * scale;
                    }
                }
            } else {
                for j0 in (0..n_ctx).step_by(KB) {
                    let j1 = (j0 + KB).min(n_ctx);
                    for r in (0..quads).step_by(4) {
                        // keys any of the four rows needs; the others' extra scores are
                        // overwritten by the softmax's padding and never read
                        let je = j1.min((r..r + 4).map(n_of).max().unwrap_or(0));
                        let a: [*const f32; 4] = std::array::from_fn(|k| q_of(r + k).as_ptr());
                        let mut j = j0;
                        while j + 4 <= je {
                            let b: [*const f32; 4] = std::array::from_fn(|c| krow(j + c).as_ptr());
                            // SAFETY: query rows and K rows hold head_dim f32 each.
                            let z = unsafe { dots_4x4(a, [head_dim; 4], b) };
                            // SAFETY: `lanes` holds 16 f32.
                            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), z) };
                            for k in 0..4 {
                                for c in 0..4 {
                                    p[(r + k) * n_pad + j + c] = lanes[4 * c + k] * scale;
                                }
                            }
                            j += 4;
                        }
                        for j in j..je {
                            for k in 0..4 {
                                p[(r + k) * n_pad + j] = dot_one_acc(q_of(r + k), krow(j)) * scale;
                            }
                        }
                    }
                    for r in quads..nr {
                        let je = j1.min(n_of(r));
                        let qh = q_of(r);
                        let mut j = j0;
                        while j + 4 <= je {
                            let s4 = dot_four([krow(j), krow(j + 1), krow(j + 2), krow(j + 3)], qh);
                            for (k, v) in s4.iter().enumerate() {
                                p[r * n_pad + j + k] = v * scale;
                            }
                            j += 4;
                        }
                        for j in j..je {
                            p[r * n_pad + j] = dot_one_acc(qh, krow(j)) * scale;
                        }
                    }
                }
            }
            // 2. softmax of each row
            for r in 0..nr {
                let (n, m) = (n_of(r), m_of(r));
                let pr = &mut p[r * n_pad..r * n_pad + m];
                let max = pr[..n].iter().fold(f32::NEG_INFINITY, |a, &s| a.max(s));
                for v in pr[..n].iter_mut() {
                    *v -= max;
                }
                for v in &mut pr[n..m] {
                    *v = f32::NEG_INFINITY;
                }
                crate::vexp::exp_inplace(pr);
                let mut sum = 0f64;
                for c in pr.chunks_exact(16) {
                    // SAFETY: the chunk holds exactly 16 f32.
                    sum += _mm512_reduce_add_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) }) as f64;
                }
                let inv = (1.0 / sum) as f32;
                for v in pr.iter_mut() {
                    *v *= inv;
                }
            }
            // 3. P·V, output dims outer; rows in fours, each over its own padded length
            if order.pv == super::SumOrder::Ggml4Acc {
                for r in 0..nr {
                    let m = m_of(r);
                    let o = ((i0 + r / group) * group + r % group) * head_dim;
                    let pr = &p[r * n_pad..r * n_pad + m];
                    for d in 0..head_dim {
                        res[o + d] = dot_ggml4(&vrow(d)[..m], pr, true);
                    }
                }
                continue;
            }
            for d0 in (0..head_dim).step_by(DB) {
                let d1 = (d0 + DB).min(head_dim);
                for r in (0..quads).step_by(4) {
                    let a: [*const f32; 4] = std::array::from_fn(|k| p[(r + k) * n_pad..].as_ptr());
                    let len: [usize; 4] = std::array::from_fn(|k| m_of(r + k));
                    for d in (d0..d1).step_by(4) {
                        let b: [*const f32; 4] = std::array::from_fn(|c| vrow(d + c).as_ptr());
                        // SAFETY: p row r + k holds n_pad >= len[k] f32 from its start, and
                        // every Vᵀ row n_pad >= max(len); d + 3 < head_dim (head_dim and DB
                        // are multiples of 16).
                        let z = unsafe { dots_4x4(a, len, b) };
                        // SAFETY: `lanes` holds 16 f32.
                        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), z) };
                        for k in 0..4 {
                            let (i, g) = (i0 + (r + k) / group, (r + k) % group);
                            let o = (i * group + g) * head_dim;
                            for c in 0..4 {
                                res[o + d + c] = lanes[4 * c + k];
                            }
                        }
                    }
                }
                for r in quads..nr {
                    let m = m_of(r);
                    let (i, g) = (i0 + r / group, r % group);
                    let o = (i * group + g) * head_dim;
                    let pr = &p[r * n_pad..r * n_pad + m];
                    let mut d = d0;
                    while d + 4 <= d1 {
                        let o4 = dot_four(
                            [
                                &vrow(d)[..m],
                                &vrow(d + 1)[..m],
                                &vrow(d + 2)[..m],
                                &vrow(d + 3)[..m],
                            ],
                            pr,
                        );
                        res[o + d..o + d + 4].copy_from_slice(&o4);
                        d += 4;
                    }
                    for d in d..d1 {
                        res[o + d] = dot_one_acc(&vrow(d)[..m], pr);
                    }
                }
            }
        }
    }

    /// [`head_group`] one query row at a time (the order the blocked form must reproduce
    /// bit for bit).
    ///
    /// # Safety
    /// AVX-512F and DQ must be available; `head_dim % 16 == 0`; `kf`/`vf` hold
    /// `max(pos)+1` rows of `head_dim`; `q` and `res` as in [`super::attention`].
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn head_group_rowwise(
        kf: &[f32],
        vf: &[f32],
        q: &[f32],
        pos: &[u32],
        kvh: usize,
        group: usize,
        n_head: usize,
        head_dim: usize,
        scale: f32,
        res: &mut [f32],
    ) {
        let n_ctx = kf.len() / head_dim;
        let n_pad = n_ctx.div_ceil(16) * 16;
        // V transposed and zero padded: vt[d][j]
        let mut vt = vec![0f32; head_dim * n_pad];
        for j in 0..n_ctx {
            for d in 0..head_dim {
                vt[d * n_pad + j] = vf[j * head_dim + d];
            }
        }
        let mut p = vec![0f32; n_pad];
        for (i, &ps) in pos.iter().enumerate() {
            let n = ps as usize + 1;
            let m = n.div_ceil(16) * 16;
            for g in 0..group {
                let h = kvh * group + g;
                let qh = &q[(i * n_head + h) * head_dim..(i * n_head + h + 1) * head_dim];
                let mut max = f32::NEG_INFINITY;
                for j in 0..n {
                    let s = dot_one_acc(qh, &kf[j * head_dim..(j + 1) * head_dim]) * scale;
                    p[j] = s;
                    max = max.max(s);
                }
                for v in &mut p[..m] {
                    *v -= max;
                }
                for v in &mut p[n..m] {
                    *v = f32::NEG_INFINITY;
                }
                crate::vexp::exp_inplace(&mut p[..m]);
                let mut sum = 0f64;
                for c in p[..m].chunks_exact(16) {
                    // SAFETY: the chunk holds exactly 16 f32.
                    sum += _mm512_reduce_add_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) }) as f64;
                }
                let inv = (1.0 / sum) as f32;
                for v in &mut p[..m] {
                    *v *= inv;
                }
                let o = &mut res[(i * group + g) * head_dim..(i * group + g + 1) * head_dim];
                for (d, od) in o.iter_mut().enumerate() {
                    *od = dot_one_acc(&vt[d * n_pad..d * n_pad + m], &p[..m]);
                }
            }
        }
    }
}

/// Scalar reference of [`attention`]: straightforward f64 loops, no task split.
pub fn attention_reference(
    shape: AttnShape,
    q: &[f32],
    pos: &[u32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
) {
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim,
        scale,
    } = shape;
    let group = n_head / n_head_kv;
    for (i, &p) in pos.iter().enumerate() {
        for h in 0..n_head {
            let kvh = h / group;
            let qh = &q[(i * n_head + h) * head_dim..][..head_dim];
            let n = p as usize + 1;
            let mut s: Vec<f64> = (0..n)
                .map(|j| {
                    let kj = &k[(j * n_head_kv + kvh) * head_dim..][..head_dim];
                    qh.iter()
                        .zip(kj)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut sum = 0.0;
            for x in s.iter_mut() {
                *x = (*x - m).exp();
                sum += *x;
            }
            for d in 0..head_dim {
                let mut acc = 0.0;
                for (j, sj) in s.iter().enumerate() {
                    acc += sj / sum * v[(j * n_head_kv + kvh) * head_dim + d] as f64;
                }
                out[(i * n_head + h) * head_dim + d] = acc as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kapitsa_base::pool::{RayonPool, SerialPool};

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// A test case: the shape, random K, V (`[n_ctx, n_head_kv, head_dim]`) and Q
    /// (`[n_tok, n_head, head_dim]`) from seeds `seed..seed + 3`, and the positions of the
    /// last `n_tok` of `n_ctx` tokens.
    #[allow(clippy::type_complexity)]
    fn case(
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        n_ctx: usize,
        n_tok: usize,
        seed: u64,
    ) -> (AttnShape, Vec<f32>, Vec<f32>, Vec<f32>, Vec<u32>) {
        let shape = AttnShape {
            n_head,
            n_head_kv,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        let k = rnd(n_ctx * n_head_kv * head_dim, seed);
        let v = rnd(n_ctx * n_head_kv * head_dim, seed + 1);
        let q = rnd(n_tok * n_head * head_dim, seed + 2);
        let pos: Vec<u32> = ((n_ctx - n_tok) as u32..n_ctx as u32).collect();
        (shape, k, v, q, pos)
    }

    #[test]
    fn f16_to_f32_matches_half_for_every_value() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        // Every bit pattern, with tails of 0..15 elements after the 16-wide part.
        for len in [65536usize, 65535, 17, 16, 15, 1, 0] {
            let src = &all[all.len() - len..];
            let mut got = vec![0f32; len];
            super::f16_to_f32(src, &mut got);
            for (h, g) in src.iter().zip(&got) {
                let want = h.to_f32();
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "{:#06x}: {g} vs {want}",
                    h.to_bits()
                );
            }
        }
    }

    #[test]
    fn matches_reference_gqa_prefill_and_decode() {
        let pool = RayonPool::new(2).unwrap();
        for &(n_head, n_head_kv, head_dim, n_ctx, n_tok) in &[
            (4usize, 2usize, 16usize, 9usize, 9usize),
            (6, 1, 32, 40, 1),
            (3, 3, 8, 17, 5),
            (8, 2, 64, 70, 3),
        ] {
            let (shape, k, v, q, pos) = case(n_head, n_head_kv, head_dim, n_ctx, n_tok, 1);
            let mut want = vec![0f32; q.len()];
            attention_reference(shape, &q, &pos, &k, &v, &mut want);
            let mut got = vec![0f32; q.len()];
            attention(
                &pool,
                shape,
                &q,
                &pos,
                KvView::contiguous(KvSlice::F32(&k)),
                KvView::contiguous(KvSlice::F32(&v)),
                &mut got,
            );
            let mut got1 = vec![0f32; q.len()];
            attention(
                &SerialPool,
                shape,
                &q,
                &pos,
                KvView::contiguous(KvSlice::F32(&k)),
                KvView::contiguous(KvSlice::F32(&v)),
                &mut got1,
            );
            assert_eq!(got, got1, "thread count changed the result");
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
            // f16 cache: same up to f16 rounding of K and V.
            let kh: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
            let vh: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            attention(
                &pool,
                shape,
                &q,
                &pos,
                KvView::contiguous(KvSlice::F16(&kh)),
                KvView::contiguous(KvSlice::F16(&vh)),
                &mut got,
            );
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 5e-3, "{a} vs {b}");
            }
        }
    }

    /// Scalar emulation of one output row in llama.cpp's orders ([`AttnOrder`]): scores
    /// `q · k` in `ggml_vec_dot_f32`'s four accumulators, then scaled; softmax with ggml's
    /// vectorised `exp` over 16-position chunks summed in f64; outputs in `pv`'s order over
    /// the positions zero padded to 16.
    #[cfg(target_arch = "x86_64")]
    fn ggml_row(qh: &[f32], k: &[&[f32]], v: &[&[f32]], scale: f32, pv: SumOrder) -> Vec<f32> {
        fn reduce16(mut a: [f32; 16]) -> f32 {
            let mut w = 16;
            while w > 1 {
                w /= 2;
                for l in 0..w {
                    a[l] += a[l + w];
                }
            }
            a[0]
        }
        // `padded`: the length counts as zero padded to a multiple of 64 (llama.cpp's KV
        // length is a multiple of 256); otherwise elements past the last 64 are leftovers.
        fn dot(a: &[f32], b: &[f32], order: SumOrder, padded: bool) -> f32 {
            let mut acc = [[0f32; 16]; 4];
            let chunks = if padded || order == SumOrder::OneChain {
                a.len() / 16
            } else {
                a.len() / 64 * 4
            };
            for c in 0..chunks {
                let j = if order == SumOrder::Ggml4Acc {
                    c % 4
                } else {
                    0
                };
                for l in 0..16 {
                    acc[j][l] = a[16 * c + l].mul_add(b[16 * c + l], acc[j][l]);
                }
            }
            let mut f = [0f32; 16];
            for l in 0..16 {
                f[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
            }
            let mut s = if order == SumOrder::Ggml4Acc {
                reduce16(f)
            } else {
                reduce16(acc[0])
            };
            for i in 16 * chunks..a.len() {
                s = a[i].mul_add(b[i], s);
            }
            s
        }
        let n = k.len();
        let m = n.div_ceil(16) * 16;
        let mut p: Vec<f32> = k
            .iter()
            .map(|kr| dot(qh, kr, SumOrder::Ggml4Acc, false) * scale)
            .collect();
        let max = p.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        p.iter_mut().for_each(|x| *x -= max);
        p.resize(m, f32::NEG_INFINITY);
        crate::vexp::exp_inplace(&mut p);
        let sum: f64 = p
            .chunks(16)
            .map(|c| reduce16(c.try_into().unwrap()) as f64)
            .sum();
        let inv = (1.0 / sum) as f32;
        p.iter_mut().for_each(|x| *x *= inv);
        (0..qh.len())
            .map(|d| {
                let col: Vec<f32> = (0..m).map(|j| if j < n { v[j][d] } else { 0.0 }).collect();
                dot(&col, &p, pv, true)
            })
            .collect()
    }

    /// [`attention_with`] in llama.cpp's orders equals the scalar emulation bit for bit,
    /// for a prompt-like batch (`p · v` in one chain) and one decode token (four
    /// accumulators), GQA groups of 1 and 3, head dims with and without leftovers past 64.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn llama_cpp_orders_match_scalar_emulation_bitwise() {
        if !kapitsa_base::CpuFeatures::get().avx512 {
            return;
        }
        for &(n_head, n_head_kv, head_dim, n_ctx, n_tok, pv) in &[
            (
                6usize,
                2usize,
                128usize,
                37usize,
                37usize,
                SumOrder::OneChain,
            ),
            (6, 2, 128, 70, 1, SumOrder::Ggml4Acc),
            (2, 2, 80, 19, 5, SumOrder::OneChain),
            (3, 1, 64, 200, 1, SumOrder::Ggml4Acc),
        ] {
            let (shape, k, v, q, pos) = case(n_head, n_head_kv, head_dim, n_ctx, n_tok, 11);
            let order = AttnOrder {
                scores: SumOrder::Ggml4Acc,
                pv,
            };
            let mut got = vec![0f32; q.len()];
            attention_with(
                &SerialPool,
                shape,
                order,
                &q,
                &pos,
                KvView::contiguous(KvSlice::F32(&k)),
                KvView::contiguous(KvSlice::F32(&v)),
                &mut got,
            );
            let group = n_head / n_head_kv;
            for (i, &p) in pos.iter().enumerate() {
                for h in 0..n_head {
                    let kvh = h / group;
                    let row = |x: &[f32], j: usize| -> Vec<f32> {
                        x[(j * n_head_kv + kvh) * head_dim..][..head_dim].to_vec()
                    };
                    let ks: Vec<Vec<f32>> = (0..=p as usize).map(|j| row(&k, j)).collect();
                    let vs: Vec<Vec<f32>> = (0..=p as usize).map(|j| row(&v, j)).collect();
                    let kr: Vec<&[f32]> = ks.iter().map(|r| &r[..]).collect();
                    let vr: Vec<&[f32]> = vs.iter().map(|r| &r[..]).collect();
                    let qh = &q[(i * n_head + h) * head_dim..][..head_dim];
                    let want = ggml_row(qh, &kr, &vr, shape.scale, pv);
                    let o = &got[(i * n_head + h) * head_dim..][..head_dim];
                    for (a, b) in o.iter().zip(&want) {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{a} vs {b} ({head_dim}, {n_tok}, {pv:?})"
                        );
                    }
                }
            }
        }
    }

    /// The blocked AVX-512 head-group kernel equals its one-row-at-a-time twin bit for bit:
    /// several query blocks (n_tok > 16), partial key and dim blocks, causal rows of
    /// different lengths, GQA groups of 1 and 8.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn blocked_head_group_equals_rowwise_bitwise() {
        if !kapitsa_base::CpuFeatures::get().avx512 {
            return;
        }
        for &(group, n_head_kv, head_dim, n_ctx, n_tok) in &[
            (8usize, 2usize, 64usize, 203usize, 37usize),
            (1, 1, 16, 40, 40),
            (8, 1, 256, 75, 1),
            (4, 2, 48, 18, 17),
            // groups that are not multiples of 4: register tiles span two query tokens
            // of different causal lengths
            (6, 2, 128, 300, 45),
            (7, 2, 64, 90, 19),
            (3, 1, 32, 33, 33),
        ] {
            let n_head = group * n_head_kv;
            let kf = rnd(n_ctx * head_dim, 21);
            let vf = rnd(n_ctx * head_dim, 22);
            let q = rnd(n_tok * n_head * head_dim, 23);
            let pos: Vec<u32> = ((n_ctx - n_tok) as u32..n_ctx as u32).collect();
            for kvh in 0..n_head_kv {
                let mut want = vec![0f32; n_tok * group * head_dim];
                let mut got = want.clone();
                // SAFETY: AVX-512F/DQ checked above (DQ comes with every AVX-512 CPU this
                // engine dispatches to); head_dim % 16 == 0; kf/vf hold n_ctx rows.
                unsafe {
                    x86::head_group_rowwise(
                        &kf, &vf, &q, &pos, kvh, group, n_head, head_dim, 0.2, &mut want,
                    );
                    x86::head_group(
                        &kf,
                        &vf,
                        &q,
                        &pos,
                        kvh,
                        group,
                        n_head,
                        head_dim,
                        0.2,
                        AttnOrder::default(),
                        &mut got,
                    );
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "group {group} head_dim {head_dim} n_ctx {n_ctx}"
                );
            }
        }
    }

    /// `reduce16` gives each vector's sum bit for bit as `_mm512_reduce_add_ps`, on values
    /// whose sums depend on the addition order (mixed magnitudes and cancellations).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn reduce16_equals_reduce_add_bitwise() {
        use std::arch::x86_64::*;
        if !kapitsa_base::CpuFeatures::get().avx512 {
            return;
        }
        let mut diff_orders = 0;
        for seed in 0..2000u64 {
            let x = rnd(256, seed);
            let x: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, v)| v * [1.0, 1e4, 1e-3, 3e7][(i * 7 + seed as usize) % 4])
                .collect();
            // SAFETY: AVX-512F checked above; every load reads 16 f32 inside `x`.
            let (got, want) = unsafe {
                let v: [__m512; 16] =
                    std::array::from_fn(|k| _mm512_loadu_ps(x[16 * k..].as_ptr()));
                let mut got = [0f32; 16];
                _mm512_storeu_ps(got.as_mut_ptr(), x86::reduce16(&v));
                let want: [f32; 16] = std::array::from_fn(|k| _mm512_reduce_add_ps(v[k]));
                (got, want)
            };
            for q in 0..4 {
                for k in 0..4 {
                    assert_eq!(
                        got[4 * q + k].to_bits(),
                        want[4 * k + q].to_bits(),
                        "seed {seed}"
                    );
                }
            }
            // the data must be able to tell summation orders apart
            let seq: f32 = x[..16].iter().sum();
            diff_orders += usize::from(seq.to_bits() != want[0].to_bits());
        }
        assert!(diff_orders > 100, "{diff_orders}");
    }

    /// Rows scattered over shuffled blocks of a bigger pool give bit-identical results to the
    /// same rows stored contiguously, for f32 and f16 and block sizes that do and do not
    /// divide the context.
    #[test]
    fn paged_equals_contiguous() {
        let pool = RayonPool::new(2).unwrap();
        let (n_head, n_head_kv, head_dim, n_ctx, n_tok) = (4usize, 2usize, 32usize, 37usize, 4);
        let stride = n_head_kv * head_dim;
        let shape = AttnShape {
            n_head,
            n_head_kv,
            head_dim,
            scale: 0.3,
        };
        let k = rnd(n_ctx * stride, 11);
        let v = rnd(n_ctx * stride, 12);
        let q = rnd(n_tok * n_head * head_dim, 13);
        let pos: Vec<u32> = ((n_ctx - n_tok) as u32..n_ctx as u32).collect();
        let mut want = vec![0f32; q.len()];
        attention(
            &pool,
            shape,
            &q,
            &pos,
            KvView::contiguous(KvSlice::F32(&k)),
            KvView::contiguous(KvSlice::F32(&v)),
            &mut want,
        );
        for bs in [1usize, 5, 16, 37, 64] {
            let nb = n_ctx.div_ceil(bs);
            let n_pool = nb + 3;
            // Block i of the sequence goes to pool block (7 i + 2) mod n_pool (a permutation:
            // 7 and n_pool are coprime for these sizes or fall back to reversal).
            let mut table: Vec<u32> = (0..nb).map(|i| ((7 * i + 2) % n_pool) as u32).collect();
            let mut seen = table.clone();
            seen.sort_unstable();
            seen.dedup();
            if seen.len() != nb {
                table = (0..nb).rev().map(|i| i as u32).collect();
            }
            let mut kp = vec![f32::NAN; n_pool * bs * stride];
            let mut vp = vec![f32::NAN; n_pool * bs * stride];
            for p in 0..n_ctx {
                let row = table[p / bs] as usize * bs + p % bs;
                kp[row * stride..(row + 1) * stride]
                    .copy_from_slice(&k[p * stride..(p + 1) * stride]);
                vp[row * stride..(row + 1) * stride]
                    .copy_from_slice(&v[p * stride..(p + 1) * stride]);
            }
            let view = |d| KvView {
                data: KvSlice::F32(d),
                table: &table,
                block_size: bs,
            };
            let mut got = vec![0f32; q.len()];
            attention(&pool, shape, &q, &pos, view(&kp), view(&vp), &mut got);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "block size {bs}"
            );
            let kh: Vec<f16> = kp.iter().map(|&x| f16::from_f32(x)).collect();
            let vh: Vec<f16> = vp.iter().map(|&x| f16::from_f32(x)).collect();
            let hview = |d| KvView {
                data: KvSlice::F16(d),
                table: &table,
                block_size: bs,
            };
            attention(&pool, shape, &q, &pos, hview(&kh), hview(&vh), &mut got);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 5e-3, "f16, block size {bs}: {a} vs {b}");
            }
        }
    }

    /// Rows quantised to Q8_0 blocks the way the KV cache stores them.
    fn q8(x: &[f32]) -> Vec<u8> {
        let mut b = vec![0u8; x.len() / Q8_0_BLOCK * Q8_0_BYTES];
        crate::quantize_row(kapitsa_base::GgmlType::Q8_0, x, &mut b).unwrap();
        b
    }

    /// A Q8_0 cache: `read` decodes exactly what was stored (the attention on it equals the
    /// attention on its decoded f32 values to float noise), and the quantisation costs at
    /// most 2e-2 absolute on outputs of unit-range K, V and Q (measured: ~5e-3), paged or
    /// not.
    #[test]
    fn q8_0_cache_matches_f32_within_tolerance() {
        let pool = RayonPool::new(2).unwrap();
        for &(n_head, n_head_kv, head_dim, n_ctx, n_tok) in &[
            (4usize, 2usize, 32usize, 9usize, 9usize),
            (6, 1, 64, 40, 1),
            (8, 2, 128, 70, 3),
        ] {
            let stride = n_head_kv * head_dim;
            let shape = AttnShape {
                n_head,
                n_head_kv,
                head_dim,
                scale: 1.0 / (head_dim as f32).sqrt(),
            };
            let k = rnd(n_ctx * stride, 21);
            let v = rnd(n_ctx * stride, 22);
            let q = rnd(n_tok * n_head * head_dim, 23);
            let pos: Vec<u32> = ((n_ctx - n_tok) as u32..n_ctx as u32).collect();
            let mut want = vec![0f32; q.len()];
            attention_reference(shape, &q, &pos, &k, &v, &mut want);
            let (kq, vq) = (q8(&k), q8(&v));
            let (kqs, vqs) = (KvSlice::Q8_0(&kq), KvSlice::Q8_0(&vq));
            assert_eq!(kqs.len(), k.len());
            // Decoded values are within half a quantisation step (plus the f16 rounding of
            // the scale) of the originals.
            let mut kd = vec![0f32; k.len()];
            kqs.read(0, &mut kd);
            for (bo, bd) in k.chunks(Q8_0_BLOCK).zip(kd.chunks(Q8_0_BLOCK)) {
                let d = bo.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
                for (a, b) in bo.iter().zip(bd) {
                    assert!((a - b).abs() <= 0.6 * d, "{a} vs {b} (d {d})");
                }
            }
            let mut vd = vec![0f32; v.len()];
            vqs.read(0, &mut vd);
            let mut want_dec = vec![0f32; q.len()];
            attention_reference(shape, &q, &pos, &kd, &vd, &mut want_dec);
            let mut got = vec![0f32; q.len()];
            attention(
                &pool,
                shape,
                &q,
                &pos,
                KvView::contiguous(kqs),
                KvView::contiguous(vqs),
                &mut got,
            );
            let mut max_q = 0f32;
            for ((a, b), c) in got.iter().zip(&want_dec).zip(&want) {
                assert!((a - b).abs() < 1e-5, "decoded: {a} vs {b}");
                max_q = max_q.max((a - c).abs());
            }
            println!(
                "q8_0 {n_head}/{n_head_kv} x {head_dim}, {n_ctx} positions: max|d| {max_q:.2e}"
            );
            assert!(max_q < 2e-2, "q8_0 vs f32: max|d| {max_q}");

            // Paged: blocks of 5 positions in reverse order in a bigger pool.
            let bs = 5;
            let nb = n_ctx.div_ceil(bs);
            let table: Vec<u32> = (0..nb).rev().map(|i| i as u32 + 1).collect();
            let mut kp = vec![0f32; (nb + 1) * bs * stride];
            let mut vp = kp.clone();
            for p in 0..n_ctx {
                let row = table[p / bs] as usize * bs + p % bs;
                kp[row * stride..(row + 1) * stride]
                    .copy_from_slice(&k[p * stride..(p + 1) * stride]);
                vp[row * stride..(row + 1) * stride]
                    .copy_from_slice(&v[p * stride..(p + 1) * stride]);
            }
            let (kpq, vpq) = (q8(&kp), q8(&vp));
            let view = |d| KvView {
                data: KvSlice::Q8_0(d),
                table: &table,
                block_size: bs,
            };
            let mut paged = vec![0f32; q.len()];
            attention(&pool, shape, &q, &pos, view(&kpq), view(&vpq), &mut paged);
            assert!(
                paged
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "paged q8_0 differs from contiguous"
            );
        }
    }

    #[test]
    #[should_panic(expected = "whole blocks")]
    fn q8_0_read_off_block_boundary_is_caught() {
        let b = q8(&rnd(64, 5));
        let mut dst = [0f32; 32];
        KvSlice::Q8_0(&b).read(16, &mut dst);
    }

    #[test]
    #[should_panic]
    fn table_too_short_is_caught() {
        let k = vec![0f32; 64];
        let table = [0u32];
        let view = KvView {
            data: KvSlice::F32(&k),
            table: &table,
            block_size: 2,
        };
        let q = vec![0f32; 8];
        let mut out = vec![0f32; 8];
        let shape = AttnShape {
            n_head: 1,
            n_head_kv: 1,
            head_dim: 8,
            scale: 1.0,
        };
        // Position 2 needs a second block.
        attention(&SerialPool, shape, &q, &[2], view, view, &mut out);
    }
}
