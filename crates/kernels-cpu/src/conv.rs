//! Depthwise causal 1-D convolution with a carried state (the short convolution in front of
//! Gated DeltaNet and Mamba2 mixers).
//!
//! Layouts (row-major f32):
//! - `x`: `[t, c]`, `t` new tokens of one sequence, `c` channels;
//! - `w`: `[c, k]`, tap `k - 1` multiplies the current token, tap 0 the oldest input;
//! - `bias`: optional `[c]`;
//! - `state`: `[k - 1, c]`, the last `k - 1` inputs seen before `x` (oldest row first; zeros at
//!   sequence start), updated in place to the last `k - 1` rows of `state ++ x`;
//! - `out`: `[t, c]`.
//!
//! With `xin = state ++ x` (`k - 1 + t` rows),
//! `out[r, ch] = act(bias[ch] + sum_{j = 0..k} w[ch * k + j] * xin[r + j, ch])`, summed in
//! ascending `j`, then the bias added, then the optional SiLU. Calling the kernel on pieces of a
//! sequence gives the same result as one call on the whole sequence.
//!
//! [`conv1d_causal`] vectorises over channels (16 lanes with AVX-512) and splits channel ranges
//! over the pool when the call is large enough to pay for it; [`conv1d_causal_scalar`] is the
//! plain-loop reference. Results do not depend on the thread count.

use std::marker::PhantomData;

use kapitsa_base::ThreadPool;

/// Below this many multiply-adds (`t * c * k`) the work runs as one task.
const PAR_MIN_MACS: usize = 1 << 17;

/// A raw pointer that pool tasks share to write disjoint parts of one buffer.
///
/// Every use must guarantee that no two tasks form overlapping slices; the `&mut` borrow the
/// pointer was taken from lasts as long as the wrapper (lifetime `'a`).
#[derive(Clone, Copy)]
pub(crate) struct DisjointMut<'a> {
    ptr: *mut f32,
    len: usize,
    /// Keeps the source buffer mutably borrowed while the wrapper lives.
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: the wrapper is only used to hand disjoint ranges of one `&mut [f32]` to pool tasks
// (see `slice`), so sending it to another thread cannot create aliasing `&mut`s.
unsafe impl Send for DisjointMut<'_> {}
// SAFETY: as above; concurrent tasks never form overlapping slices.
unsafe impl Sync for DisjointMut<'_> {}

impl<'a> DisjointMut<'a> {
    /// Wraps `buf`, which stays borrowed as long as the wrapper lives.
    pub(crate) fn new(buf: &'a mut [f32]) -> DisjointMut<'a> {
        DisjointMut {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _borrow: PhantomData,
        }
    }

    /// The elements `start .. start + len` (bounds-checked).
    ///
    /// # Safety
    /// No other live slice obtained from this wrapper (in this or another task) may overlap
    /// the range.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start <= self.len && len <= self.len - start);
        // SAFETY: the range is inside the buffer (checked above); exclusivity is the
        // caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

#[allow(clippy::too_many_arguments)]
fn check_shapes(
    x: &[f32],
    t: usize,
    c: usize,
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    state: &[f32],
    out: &[f32],
) {
    assert!(k >= 1, "conv1d_causal: kernel width must be >= 1");
    assert_eq!(x.len(), t * c, "conv1d_causal: x must be [t, c]");
    assert_eq!(w.len(), c * k, "conv1d_causal: w must be [c, k]");
    if let Some(b) = bias {
        assert_eq!(b.len(), c, "conv1d_causal: bias must be [c]");
    }
    assert_eq!(
        state.len(),
        (k - 1) * c,
        "conv1d_causal: state must be [k-1, c]"
    );
    assert_eq!(out.len(), t * c, "conv1d_causal: out must be [t, c]");
}

/// Plain-loop reference of [`conv1d_causal`] (same arguments without the pool).
///
/// Shapes: `x`, `out`: `[t, c]`; `w`: `[c, k]`; `bias`: `[c]`; `state`: `[k - 1, c]` (oldest
/// row first, updated in place). `silu` applies `x / (1 + exp(-x))` to each result.
///
/// # Panics
/// If a slice length does not match the shape (a programming error) or `k == 0`.
#[allow(clippy::too_many_arguments)]
pub fn conv1d_causal_scalar(
    x: &[f32],
    t: usize,
    c: usize,
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    state: &mut [f32],
    silu: bool,
    out: &mut [f32],
) {
    check_shapes(x, t, c, k, w, bias, state, out);
    let h = k - 1;
    let xin = |s: usize, ch: usize| -> f32 {
        if s < h {
            state[s * c + ch]
        } else {
            x[(s - h) * c + ch]
        }
    };
    for r in 0..t {
        for ch in 0..c {
            let mut acc = 0f32;
            for j in 0..k {
                acc += w[ch * k + j] * xin(r + j, ch);
            }
            if let Some(b) = bias {
                acc += b[ch];
            }
            out[r * c + ch] = if silu { crate::ops::silu(acc) } else { acc };
        }
    }
    // New state: rows t .. t + h of xin.
    let old = state.to_vec();
    for r in 0..h {
        let s = t + r;
        for ch in 0..c {
            state[r * c + ch] = if s < h {
                old[s * c + ch]
            } else {
                x[(s - h) * c + ch]
            };
        }
    }
}

/// Depthwise causal conv1d with carried state, vectorised over channels and split over the
/// pool by channel ranges; see the module docs for the definition.
///
/// Shapes: `x`, `out`: `[t, c]` row-major; `w`: `[c, k]`; `bias`: `[c]`; `state`: `[k - 1, c]`
/// (oldest row first), updated in place to the last `k - 1` rows of `state ++ x` (also when
/// `t < k - 1`). `silu` applies SiLU to each result. Matches [`conv1d_causal_scalar`] up to
/// FMA and vectorised-`exp` rounding (about 1e-6 relative).
///
/// # Panics
/// If a slice length does not match the shape (a programming error) or `k == 0`.
#[allow(clippy::too_many_arguments)]
pub fn conv1d_causal(
    pool: &dyn ThreadPool,
    x: &[f32],
    t: usize,
    c: usize,
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    state: &mut [f32],
    silu: bool,
    out: &mut [f32],
) {
    check_shapes(x, t, c, k, w, bias, state, out);
    if t == 0 || c == 0 {
        return;
    }
    let n_blocks = c.div_ceil(16);
    let n_tasks = if t * c * k >= PAR_MIN_MACS {
        pool.n_threads().min(n_blocks).max(1)
    } else {
        1
    };
    let per = n_blocks.div_ceil(n_tasks) * 16;
    let n_tasks = c.div_ceil(per);
    let job = ConvJob {
        x,
        t,
        c,
        k,
        w,
        bias,
        silu,
        state: DisjointMut::new(state),
        out: DisjointMut::new(out),
    };
    pool.run(n_tasks, &|task| {
        let c0 = task * per;
        let c1 = (c0 + per).min(c);
        job.run(c0, c1);
    });
}

/// Arguments of one [`conv1d_causal`] call, shared by its tasks.
struct ConvJob<'a> {
    x: &'a [f32],
    t: usize,
    c: usize,
    k: usize,
    w: &'a [f32],
    bias: Option<&'a [f32]>,
    silu: bool,
    state: DisjointMut<'a>,
    out: DisjointMut<'a>,
}

impl ConvJob<'_> {
    /// Channels `c0..c1` for every token, then their state columns.
    fn run(&self, c0: usize, c1: usize) {
        let (t, c, k) = (self.t, self.c, self.k);
        let h = k - 1;
        let nw = c1 - c0;
        // Taps transposed to [k, nw] so that each tap is contiguous over channels.
        let mut wt = vec![0f32; k * nw];
        for (ci, wr) in self.w[c0 * k..c1 * k].chunks_exact(k).enumerate() {
            for (j, &wv) in wr.iter().enumerate() {
                wt[j * nw + ci] = wv;
            }
        }
        // This task's columns of the old state, [h, nw].
        let mut hist = vec![0f32; h * nw];
        for r in 0..h {
            // SAFETY: columns c0..c1 of state row r belong to this task alone.
            let src = unsafe { self.state.slice(r * c + c0, nw) };
            hist[r * nw..(r + 1) * nw].copy_from_slice(src);
        }
        let mut rows: Vec<&[f32]> = Vec::with_capacity(k);
        let mut tmp = if self.silu {
            vec![0f32; nw]
        } else {
            Vec::new()
        };
        let bias = self.bias.map(|b| &b[c0..c1]);
        for r in 0..t {
            rows.clear();
            for s in r..r + k {
                rows.push(if s < h {
                    &hist[s * nw..(s + 1) * nw]
                } else {
                    &self.x[(s - h) * c + c0..(s - h) * c + c1]
                });
            }
            // SAFETY: columns c0..c1 of out row r belong to this task alone.
            let o = unsafe { self.out.slice(r * c + c0, nw) };
            conv_row(&rows, &wt, bias, o);
            if self.silu {
                silu_inplace(o, &mut tmp);
            }
        }
        for r in 0..h {
            let s = t + r;
            let src = if s < h {
                &hist[s * nw..(s + 1) * nw]
            } else {
                &self.x[(s - h) * c + c0..(s - h) * c + c1]
            };
            // SAFETY: columns c0..c1 of state row r belong to this task alone; `hist` is a
            // private copy, so source and destination never alias.
            unsafe { self.state.slice(r * c + c0, nw) }.copy_from_slice(src);
        }
    }
}

/// One output row: `o[ch] = bias[ch] + sum_j wt[j][ch] * rows[j][ch]`, all rows `o.len()` wide.
fn conv_row(rows: &[&[f32]], wt: &[f32], bias: Option<&[f32]>, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if kapitsa_base::CpuFeatures::get().avx512 {
        // SAFETY: AVX-512F is available (checked at run time); lengths are consistent by
        // construction in `ConvJob::run` and checked again inside.
        unsafe { x86::conv_row(rows, wt, bias, o) };
        return;
    }
    conv_row_portable(rows, wt, bias, o, 0);
}

/// Portable [`conv_row`] for channels `from..o.len()`.
fn conv_row_portable(
    rows: &[&[f32]],
    wt: &[f32],
    bias: Option<&[f32]>,
    o: &mut [f32],
    from: usize,
) {
    let nw = o.len();
    for ch in from..nw {
        let mut acc = 0f32;
        for (j, row) in rows.iter().enumerate() {
            acc += wt[j * nw + ch] * row[ch];
        }
        if let Some(b) = bias {
            acc += b[ch];
        }
        o[ch] = acc;
    }
}

/// `y = y / (1 + exp(-y))` with the vectorised exp; `tmp` is scratch of at least `y.len()`.
fn silu_inplace(y: &mut [f32], tmp: &mut [f32]) {
    let tmp = &mut tmp[..y.len()];
    for (e, &v) in tmp.iter_mut().zip(y.iter()) {
        *e = -v;
    }
    crate::vexp::exp_inplace(tmp);
    for (v, &e) in y.iter_mut().zip(tmp.iter()) {
        *v /= 1.0 + e;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// AVX-512 [`super::conv_row`]: 16 channels per vector, taps accumulated in ascending
    /// order (first product exact-rounded, the rest fused), bias added last.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn conv_row(rows: &[&[f32]], wt: &[f32], bias: Option<&[f32]>, o: &mut [f32]) {
        let nw = o.len();
        let k = rows.len();
        assert!(k >= 1 && wt.len() == k * nw && rows.iter().all(|r| r.len() == nw));
        if let Some(b) = bias {
            assert_eq!(b.len(), nw);
        }
        let full = nw / 16 * 16;
        let mut ch = 0;
        while ch < full {
            // SAFETY: ch + 16 <= nw; every row, every tap row of `wt`, `bias` and `o` hold
            // nw elements (asserted above).
            unsafe {
                let mut acc = _mm512_mul_ps(
                    _mm512_loadu_ps(wt.as_ptr().add(ch)),
                    _mm512_loadu_ps(rows[0].as_ptr().add(ch)),
                );
                for (j, row) in rows.iter().enumerate().skip(1) {
                    acc = _mm512_fmadd_ps(
                        _mm512_loadu_ps(wt.as_ptr().add(j * nw + ch)),
                        _mm512_loadu_ps(row.as_ptr().add(ch)),
                        acc,
                    );
                }
                if let Some(b) = bias {
                    acc = _mm512_add_ps(acc, _mm512_loadu_ps(b.as_ptr().add(ch)));
                }
                _mm512_storeu_ps(o.as_mut_ptr().add(ch), acc);
            }
            ch += 16;
        }
        super::conv_row_portable(rows, wt, bias, o, full);
    }
}
