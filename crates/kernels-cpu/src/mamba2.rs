//! Mamba2 selective state-space scan (the SSD layer of NVIDIA Nemotron-H) and the gated grouped
//! RMSNorm that follows it.
//!
//! # Math (all f32)
//! `n_heads` H, `head_dim` P, `d_state` N, `n_groups` G (H divisible by G); head `h` reads group
//! `g = h / (H / G)` of B and C (`repeat_interleave`). Each head carries a state
//! `S_h ∈ R^{P×N}`, zero at the start of a sequence. Per token `t` and head `h`:
//!
//! ```text
//! dA      = exp(dt[t,h] * A[h])
//! S[p][n] = S[p][n] * dA + dt[t,h] * x[t,h,p] * B[t,g,n]
//! y[t,h,p]= Σ_n S[p][n] * C[t,g,n] + D[h] * x[t,h,p]
//! ```
//!
//! `dt` is the final step size (`softplus(dt_raw + dt_bias)`, computed by the caller; the kernels
//! apply no softplus and no clamp), `A = -exp(A_log)` (negative), `x` is the conv + SiLU output.
//!
//! # Layouts (row-major f32)
//! - `x`, `y`: `[n_tok, H * P]` (token-major, then head, then head dim);
//! - `dt`: `[n_tok, H]`; `a`, `d`: `[H]`;
//! - `b`, `c`: `[n_tok, G * N]`;
//! - `state`: `[H, P, N]` (`state[(h * P + p) * N + n]`), read and updated in place;
//! - `keep` (recurrent scan only): `[n_tok, H * P * N]`, slot `t` receives the whole state after
//!   token `t` (speculative decoding commits the state of the last accepted token).
//!
//! The token count is `x.len() / (H * P)`; every other length is checked against it with
//! `assert!` (a mismatch is a programming error).
//!
//! # Variants
//! - [`mamba2_scan_scalar`]: plain loops, the reference.
//! - [`mamba2_scan`]: the same recurrence, heads split over the pool, AVX-512 over N.
//! - [`mamba2_chunked`]: the chunked state-space-duality form (chunks of [`CHUNK`] tokens, the
//!   work done as small matrix products), for prefill.
//! - [`mamba2`]: what models call; picks one of the two fast forms.
//!
//! # Numerics
//! The fast forms take decay factors below `exp(-60)` as exactly 0 ([`EXP_FLOOR`]; the terms
//! dropped are ~1e-26 of the ones kept) so that no subnormal floats reach the inner loops. The
//! chunked form forms each decay exponent `L_i - L_j` as a sum over its segment, never as a
//! difference of running sums (which cancels badly once the decay is strong). Measured against
//! the scalar reference: recurrent ~1e-6, chunked ~5e-6 (element-wise, relative above 1).

use kapitsa_base::ThreadPool;

use crate::vexp::exp_inplace;

/// Chunk length of [`mamba2_chunked`] (the last chunk of a call may be shorter).
pub const CHUNK: usize = 64;

/// Smallest token count for which [`mamba2`] uses [`mamba2_chunked`] instead of the recurrent
/// [`mamba2_scan`]. Measured on the Nemotron 3 Nano shape (H=64, P=64, N=128, G=8), 2 threads,
/// AVX-512: the two break even around 48-64 tokens; at 512 tokens the chunked form takes about
/// two thirds of the recurrent time, at 16 tokens about 1.5x.
pub const CHUNKED_MIN_TOKENS: usize = 64;

/// Dimensions of one Mamba2 layer's scan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mamba2Shape {
    /// Number of heads H.
    pub n_heads: usize,
    /// Head dimension P.
    pub head_dim: usize,
    /// State size N (per head and head dim).
    pub d_state: usize,
    /// Number of B/C groups G (`n_heads % n_groups == 0`).
    pub n_groups: usize,
}

impl Mamba2Shape {
    /// `H * P`, the width of one token row of `x` and `y`.
    pub fn d_inner(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// `H * P * N`, the number of f32 in one sequence's state.
    pub fn state_len(&self) -> usize {
        self.n_heads * self.head_dim * self.d_state
    }

    /// Checks every buffer length against the shape and returns the token count.
    #[allow(clippy::too_many_arguments)]
    fn check(
        &self,
        x: &[f32],
        dt: &[f32],
        a: &[f32],
        b: &[f32],
        c: &[f32],
        d: &[f32],
        state: &[f32],
        y: &[f32],
    ) -> usize {
        let Mamba2Shape {
            n_heads: nh,
            head_dim: np,
            d_state: ns,
            n_groups: ng,
        } = *self;
        assert!(
            nh > 0 && np > 0 && ns > 0 && ng > 0,
            "mamba2: empty shape {self:?}"
        );
        assert!(
            nh.is_multiple_of(ng),
            "mamba2: n_heads {nh} not divisible by n_groups {ng}"
        );
        let hp = nh * np;
        assert!(
            x.len().is_multiple_of(hp),
            "mamba2: x has {} values, not a multiple of H*P = {hp}",
            x.len()
        );
        let n_tok = x.len() / hp;
        assert_eq!(dt.len(), n_tok * nh, "mamba2: dt must be [n_tok, H]");
        assert_eq!(a.len(), nh, "mamba2: A must be [H]");
        assert_eq!(d.len(), nh, "mamba2: D must be [H]");
        assert_eq!(b.len(), n_tok * ng * ns, "mamba2: B must be [n_tok, G*N]");
        assert_eq!(c.len(), n_tok * ng * ns, "mamba2: C must be [n_tok, G*N]");
        assert_eq!(
            state.len(),
            self.state_len(),
            "mamba2: state must be [H, P, N]"
        );
        assert_eq!(y.len(), n_tok * hp, "mamba2: y must be [n_tok, H*P]");
        n_tok
    }
}

/// Token-by-token scan with plain loops: the reference for the other variants.
///
/// Layouts as in the [module docs](self): `x` `[t, H*P]`, `dt` `[t, H]`, `a`, `d` `[H]`, `b`, `c`
/// `[t, G*N]`, `state` `[H, P, N]` updated in place, `y` `[t, H*P]`; `keep`, if given,
/// `[t, H*P*N]` receives the state after each token.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_scan_scalar(
    shape: &Mamba2Shape,
    x: &[f32],
    dt: &[f32],
    a: &[f32],
    b: &[f32],
    c: &[f32],
    d: &[f32],
    state: &mut [f32],
    y: &mut [f32],
    mut keep: Option<&mut [f32]>,
) {
    let n_tok = shape.check(x, dt, a, b, c, d, state, y);
    let sl = shape.state_len();
    if let Some(k) = keep.as_deref() {
        assert_eq!(k.len(), n_tok * sl, "mamba2: keep must be [n_tok, H*P*N]");
    }
    let Mamba2Shape {
        n_heads: nh,
        head_dim: np,
        d_state: ns,
        n_groups: ng,
    } = *shape;
    let hpg = nh / ng;
    let hp = nh * np;
    for t in 0..n_tok {
        for h in 0..nh {
            let g = h / hpg;
            let bt = &b[(t * ng + g) * ns..(t * ng + g + 1) * ns];
            let ct = &c[(t * ng + g) * ns..(t * ng + g + 1) * ns];
            let dth = dt[t * nh + h];
            let xh = &x[t * hp + h * np..t * hp + (h + 1) * np];
            let yh = &mut y[t * hp + h * np..t * hp + (h + 1) * np];
            let sh = &mut state[h * np * ns..(h + 1) * np * ns];
            head_step_scalar(sh, xh, dth, (dth * a[h]).exp(), bt, ct, d[h], yh);
        }
        if let Some(k) = keep.as_deref_mut() {
            k[t * sl..(t + 1) * sl].copy_from_slice(state);
        }
    }
}

/// One token of one head, plain loops: `sh` `[P, N]`, `xh`, `yh` `[P]`, `bt`, `ct` `[N]`,
/// `da = exp(dt * A)`.
#[allow(clippy::too_many_arguments)]
fn head_step_scalar(
    sh: &mut [f32],
    xh: &[f32],
    dt: f32,
    da: f32,
    bt: &[f32],
    ct: &[f32],
    dh: f32,
    yh: &mut [f32],
) {
    let ns = bt.len();
    for ((row, &xv), yv) in sh.chunks_exact_mut(ns).zip(xh).zip(yh.iter_mut()) {
        let xdt = xv * dt;
        let mut acc = 0f32;
        for ((s, &bv), &cv) in row.iter_mut().zip(bt).zip(ct) {
            *s = *s * da + xdt * bv;
            acc += *s * cv;
        }
        *yv = acc + dh * xv;
    }
}

/// A raw pointer that tasks share to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: used only to write disjoint index ranges (whole heads) from different tasks, and the
// owning `&mut` borrow outlives `ThreadPool::run`, which joins all tasks before returning.
unsafe impl Send for SharedMut {}
// SAFETY: as above; no two tasks touch the same element.
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the field).
    fn ptr(&self) -> *mut f32 {
        self.0
    }
}

/// Contiguous head ranges, one per task: at most one task per thread and per head.
fn head_ranges(n_heads: usize, n_threads: usize) -> Vec<(usize, usize)> {
    let n = n_threads.clamp(1, n_heads);
    (0..n)
        .map(|i| (i * n_heads / n, (i + 1) * n_heads / n))
        .collect()
}

/// One call's inputs and outputs, shared by its tasks; each task owns a range of heads and
/// writes only their parts of `state`, `y` and `keep`.
struct Call<'a> {
    shape: Mamba2Shape,
    n_tok: usize,
    x: &'a [f32],
    dt: &'a [f32],
    a: &'a [f32],
    b: &'a [f32],
    c: &'a [f32],
    d: &'a [f32],
    /// `state`, `[H, P, N]`.
    state: SharedMut,
    /// `y`, `[n_tok, H * P]`.
    y: SharedMut,
    /// `keep` if given, `[n_tok, H * P * N]`.
    keep: Option<SharedMut>,
}

/// Token-by-token scan, the fast variant of [`mamba2_scan_scalar`] (same arguments and
/// layouts). Heads are split over `pool`; each task runs all tokens of its heads (the head's
/// state stays in cache), with AVX-512 over N when available. Results match the scalar
/// reference to rounding (the state update uses FMA), except that decay factors below
/// `exp(-60)` are taken as 0 (see [`EXP_FLOOR`]).
///
/// `keep`, if given, must be `[t, H*P*N]`; slot `i` receives the state after token `i`.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_scan(
    pool: &dyn ThreadPool,
    shape: &Mamba2Shape,
    x: &[f32],
    dt: &[f32],
    a: &[f32],
    b: &[f32],
    c: &[f32],
    d: &[f32],
    state: &mut [f32],
    y: &mut [f32],
    keep: Option<&mut [f32]>,
) {
    let n_tok = shape.check(x, dt, a, b, c, d, state, y);
    if let Some(k) = keep.as_deref() {
        assert_eq!(
            k.len(),
            n_tok * shape.state_len(),
            "mamba2: keep must be [n_tok, H*P*N]"
        );
    }
    if n_tok == 0 {
        return;
    }
    let ranges = head_ranges(shape.n_heads, pool.n_threads());
    let call = Call {
        shape: *shape,
        n_tok,
        x,
        dt,
        a,
        b,
        c,
        d,
        state: SharedMut(state.as_mut_ptr()),
        y: SharedMut(y.as_mut_ptr()),
        keep: keep.map(|k| SharedMut(k.as_mut_ptr())),
    };
    pool.run(ranges.len(), &|task| {
        let (h0, h1) = ranges[task];
        // SAFETY: heads `h0..h1` belong to this task alone (`head_ranges` is a partition);
        // all lengths were checked above; `state`, `y` and `keep` are not otherwise used
        // during `run`.
        unsafe { scan_heads(&call, h0, h1) };
    });
}

/// The recurrent scan of heads `h0..h1`, all tokens.
///
/// # Safety
/// `call`'s buffers have the lengths [`Mamba2Shape::check`] demands (and `keep`
/// `n_tok * H*P*N`), `h1 <= H`, and no other code touches heads `h0..h1` of `state`, `y` or
/// `keep` during the call.
unsafe fn scan_heads(call: &Call, h0: usize, h1: usize) {
    let Mamba2Shape {
        n_heads: nh,
        head_dim: np,
        d_state: ns,
        n_groups: ng,
    } = call.shape;
    let (n_tok, x, b, c) = (call.n_tok, call.x, call.b, call.c);
    let hpg = nh / ng;
    let hp = nh * np;
    let hs = np * ns;
    let sl = call.shape.state_len();
    #[cfg(target_arch = "x86_64")]
    let avx512 = kapitsa_base::CpuFeatures::get().avx512;
    // 64-byte aligned copies of the head state (for longer calls; for short ones the two extra
    // passes over the state cost more) and of the B/C rows: unaligned 64-byte vector accesses
    // split cache lines, and callers' buffers come from the general allocator. `ybuf` holds the
    // head's outputs for all tokens, copied to `y` after its token loop: direct stores to `y`
    // (one row stride apart) miss the cache and stall the state stores behind them.
    let copy_state = n_tok >= ALIGNED_STATE_MIN_TOKENS;
    let st_len = if copy_state { hs } else { 0 };
    with_scratch([st_len, 2 * ns, n_tok * np], |[st_buf, bc_buf, ybuf]| {
        for h in h0..h1 {
            let g = h / hpg;
            // SAFETY: head `h` is this task's (caller contract) and `(h + 1) * hs <= H * hs`.
            let sh_out =
                unsafe { std::slice::from_raw_parts_mut(call.state.ptr().add(h * hs), hs) };
            let sh = if copy_state {
                st_buf.copy_from_slice(sh_out);
                &mut *st_buf
            } else {
                &mut *sh_out
            };
            for t in 0..n_tok {
                // Rows of later tokens sit one row stride apart (a new page each): prefetch.
                if t + PREFETCH < n_tok {
                    let tp = t + PREFETCH;
                    prefetch(&x[tp * hp + h * np..tp * hp + (h + 1) * np]);
                    prefetch(&b[(tp * ng + g) * ns..(tp * ng + g + 1) * ns]);
                    prefetch(&c[(tp * ng + g) * ns..(tp * ng + g + 1) * ns]);
                }
                let (bt, ct) = bc_buf.split_at_mut(ns);
                bt.copy_from_slice(&b[(t * ng + g) * ns..(t * ng + g + 1) * ns]);
                ct.copy_from_slice(&c[(t * ng + g) * ns..(t * ng + g + 1) * ns]);
                let dth = call.dt[t * nh + h];
                let la = dth * call.a[h];
                let da = if la < EXP_FLOOR { 0.0 } else { la.exp() };
                let xh = &x[t * hp + h * np..t * hp + (h + 1) * np];
                let yh = &mut ybuf[t * np..(t + 1) * np];
                let dh = call.d[h];
                #[cfg(target_arch = "x86_64")]
                if avx512 {
                    // SAFETY: AVX-512F is available (checked at run time).
                    unsafe { x86::head_step(sh, xh, dth, da, bt, ct, dh, yh) };
                } else {
                    head_step_scalar(sh, xh, dth, da, bt, ct, dh, yh);
                }
                #[cfg(not(target_arch = "x86_64"))]
                head_step_scalar(sh, xh, dth, da, bt, ct, dh, yh);
                if let Some(kp) = call.keep {
                    // SAFETY: slot `t`, head `h` of `keep` is this task's (caller contract) and
                    // `t * sl + (h + 1) * hs <= n_tok * sl == keep.len()`.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(kp.ptr().add(t * sl + h * hs), hs)
                    };
                    dst.copy_from_slice(sh);
                }
            }
            if copy_state {
                sh_out.copy_from_slice(st_buf);
            }
            for (t, yt) in ybuf.chunks_exact(np).enumerate() {
                // SAFETY: `y[t, h, :]` is this task's (caller contract), and
                // `t * hp + (h + 1) * np <= n_tok * hp == y.len()`.
                let yo = unsafe {
                    std::slice::from_raw_parts_mut(call.y.ptr().add(t * hp + h * np), np)
                };
                yo.copy_from_slice(yt);
            }
        }
    });
}

/// Small matrix product `c = beta * c + diag(scale) · (a · b)`:
/// `c[i*ldc + j] = beta * c[i*ldc + j] + scale[i] * Σ_k a[i*rsa + k*csa] * b[k*ldb + j]` for
/// `i < m`, `j < n`, `k < kk`. `scale` defaults to all ones; with `beta == 0` the old `c` is not
/// read.
///
/// With `causal`, rows are processed in blocks of 4 and the `k` range of the block starting at
/// `i0` stops at `min(kk, i0 + 4)`: valid when `a[i][k] == 0` for every `k > i`.
#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    n: usize,
    kk: usize,
    a: &[f32],
    rsa: usize,
    csa: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    causal: bool,
    beta: f32,
    scale: Option<&[f32]>,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        kk == 0 || (m - 1) * rsa + (kk - 1) * csa < a.len(),
        "gemm: a too short"
    );
    assert!(
        kk == 0 || (kk - 1) * ldb + n <= b.len(),
        "gemm: b too short"
    );
    assert!((m - 1) * ldc + n <= c.len(), "gemm: c too short");
    assert!(n <= ldc, "gemm: rows of c overlap");
    if let Some(s) = scale {
        assert!(s.len() >= m, "gemm: scale too short");
    }
    #[cfg(target_arch = "x86_64")]
    if kapitsa_base::CpuFeatures::get().avx512 {
        // SAFETY: AVX-512F is available (checked at run time); every index the kernel touches
        // is bounded by the asserts above.
        unsafe { x86::gemm(m, n, kk, a, rsa, csa, b, ldb, c, ldc, causal, beta, scale) };
        return;
    }
    let mut acc = vec![0f32; n];
    for i in 0..m {
        let k_end = if causal { kk.min(i / 4 * 4 + 4) } else { kk };
        acc.fill(0.0);
        for k in 0..k_end {
            let aik = a[i * rsa + k * csa];
            for (s, &bv) in acc.iter_mut().zip(&b[k * ldb..k * ldb + n]) {
                *s += aik * bv;
            }
        }
        let si = scale.map_or(1.0, |s| s[i]);
        for (cv, &s) in c[i * ldc..i * ldc + n].iter_mut().zip(&acc) {
            *cv = if beta == 0.0 {
                si * s
            } else {
                beta * *cv + si * s
            };
        }
    }
}

/// Decay exponents below this are treated as `-inf` (decay exactly 0) by the fast forms.
/// `exp(-60) ≈ 9e-27`: what is dropped is far below f32 resolution of the terms kept (the
/// diagonal term has decay 1), and it keeps subnormal floats (slow on x86: every operation on
/// them takes a microcode assist) out of the matrix products.
pub const EXP_FLOOR: f32 = -60.0;

/// `exp` in place, with arguments below [`EXP_FLOOR`] giving exactly 0.
fn exp_flushed(v: &mut [f32]) {
    for e in v.iter_mut() {
        *e = if *e < EXP_FLOOR {
            f32::NEG_INFINITY
        } else {
            *e
        };
    }
    exp_inplace(v);
}

/// Token count from which [`mamba2_scan`] runs each head on an aligned copy of its state.
const ALIGNED_STATE_MIN_TOKENS: usize = 32;

/// How many tokens ahead the row loops prefetch their strided inputs.
const PREFETCH: usize = 4;

/// Hints the CPU to bring every cache line of `s` into L1 (no effect on results).
#[inline]
fn prefetch(s: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for k in (0..s.len()).step_by(16) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: `k < s.len()`, so the address is inside the slice; a prefetch never faults
        // and has no architectural effect.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(s.as_ptr().add(k).cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

/// Runs `f` on scratch buffers of the given lengths, each starting 64-byte aligned (when the
/// allocator allows), carved from a per-thread cache that is kept between calls (fresh
/// allocations of this size are zeroed pages from the OS on every call). The contents are
/// arbitrary: callers write before they read.
fn with_scratch<const K: usize>(lens: [usize; K], f: impl FnOnce([&mut [f32]; K])) {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let total: usize = lens.iter().map(|l| l.next_multiple_of(16)).sum::<usize>() + 16;
    fn carve<'a, const K: usize>(buf: &'a mut [f32], lens: &[usize; K]) -> [&'a mut [f32]; K] {
        let off = buf.as_ptr().align_offset(64);
        // `align_offset` may decline (usize::MAX); unaligned buffers are still correct.
        let mut rest = &mut buf[if off < 16 { off } else { 0 }..];
        std::array::from_fn(|i| {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(lens[i].next_multiple_of(16));
            rest = tail;
            &mut part[..lens[i]]
        })
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut cache) => {
            if cache.len() < total {
                cache.resize(total, 0.0);
            }
            f(carve(&mut cache[..total], &lens));
        }
        // Only reachable if a task re-entered the kernel on this thread.
        Err(_) => f(carve(&mut vec![0f32; total], &lens)),
    });
}

/// Chunked (state-space-duality) scan for prefill: the same results as [`mamba2_scan`] to f32
/// tolerance, with the final state written back to `state`. Same arguments and layouts
/// (no `keep`: intermediate states are never formed).
///
/// Per chunk of `q <= `[`CHUNK`] tokens, with `S` the state entering the chunk,
/// `a_s = dt_s * A`, `L_i = Σ_{s<=i} a_s` (within the chunk) and `u_j = dt_j x_j`:
///
/// ```text
/// y_i = Σ_{j<=i} (C_i·B_j) exp(L_i - L_j) u_j  +  exp(L_i) S C_i  +  D x_i
/// S'  = exp(L_last) S + Σ_j exp(L_last - L_j) u_j ⊗ B_j
/// ```
///
/// The decays are formed only for `j <= i` (masked before the exponential, so they never
/// overflow). `C·Bᵀ` is computed once per group and chunk and shared by the group's heads;
/// every sum is a small register-blocked matrix product.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_chunked(
    pool: &dyn ThreadPool,
    shape: &Mamba2Shape,
    x: &[f32],
    dt: &[f32],
    a: &[f32],
    b: &[f32],
    c: &[f32],
    d: &[f32],
    state: &mut [f32],
    y: &mut [f32],
) {
    let n_tok = shape.check(x, dt, a, b, c, d, state, y);
    if n_tok == 0 {
        return;
    }
    let ranges = head_ranges(shape.n_heads, pool.n_threads());
    let call = Call {
        shape: *shape,
        n_tok,
        x,
        dt,
        a,
        b,
        c,
        d,
        state: SharedMut(state.as_mut_ptr()),
        y: SharedMut(y.as_mut_ptr()),
        keep: None,
    };
    pool.run(ranges.len(), &|task| {
        let (h0, h1) = ranges[task];
        // SAFETY: heads `h0..h1` belong to this task alone (`head_ranges` is a partition);
        // all lengths were checked above; `state` and `y` are not otherwise used during `run`.
        unsafe { chunked_heads(&call, h0, h1) };
    });
}

/// Work buffers of [`chunked_heads`] for one group of heads and one chunk of `q` tokens
/// (`k` indexes the group's heads in the task, `q` is at most [`CHUNK`]).
struct ChunkBufs<'a> {
    /// States of the group's heads, transposed: `[k, N, P]`.
    sts: &'a mut [f32],
    /// B of the chunk, transposed: `[N, q]`.
    bt: &'a mut [f32],
    /// C of the chunk: `[q, N]`.
    cq: &'a mut [f32],
    /// `C_i · B_j`: `[q, q]`.
    cb: &'a mut [f32],
    /// `(C_i · B_j) exp(L_i - L_j)` for `j <= i`, else 0: `[q, q]`.
    w: &'a mut [f32],
    /// x of the chunk for the group's heads: `[q, k * P]`.
    xs: &'a mut [f32],
    /// Outputs without the D term, same layout as `xs`.
    ys: &'a mut [f32],
    /// `u_j = dt_j x_j` of one head: `[q, P]`.
    u: &'a mut [f32],
    /// `exp(L_last - L_j) u_j`: `[q, P]`.
    v: &'a mut [f32],
    /// `a_s = dt_s A`: `[q]`.
    la: &'a mut [f32],
    /// `Σ_{j<s<=i} a_s` for the row `i` being built: `[q]`.
    seg: &'a mut [f32],
    /// `exp(L_i)`: `[q]`.
    el: &'a mut [f32],
    /// `exp(L_last - L_j)`: `[q]`.
    ev: &'a mut [f32],
}

/// The chunked scan of heads `h0..h1`, all tokens; heads are taken one group at a time, so
/// the group's `C · Bᵀ` and its gathered rows serve all its heads.
///
/// # Safety
/// `call`'s buffers have the lengths [`Mamba2Shape::check`] demands, `h1 <= H`, and no other
/// code touches heads `h0..h1` of `state` or `y` during the call.
unsafe fn chunked_heads(call: &Call, h0: usize, h1: usize) {
    let Mamba2Shape {
        n_heads: nh,
        head_dim: np,
        d_state: ns,
        n_groups: ng,
    } = call.shape;
    let (n_tok, x, b, c) = (call.n_tok, call.x, call.b, call.c);
    let hpg = nh / ng;
    let hp = nh * np;
    let gn = ng * ns;
    let hs = np * ns;
    let qm = CHUNK.min(n_tok);
    let gh = hpg.min(h1 - h0); // most heads of one group in this task
    let (gx, q2) = (qm * gh * np, qm * qm);
    let lens = [
        gh * hs,
        ns * qm,
        qm * ns,
        q2,
        q2,
        gx,
        gx,
        qm * np,
        qm * np,
        qm,
        qm,
        qm,
        qm,
    ];
    with_scratch(
        lens,
        |[sts, bt, cq, cb, w, xs, ys, u, v, la, seg, el, ev]| {
            let mut bufs = ChunkBufs {
                sts,
                bt,
                cq,
                cb,
                w,
                xs,
                ys,
                u,
                v,
                la,
                seg,
                el,
                ev,
            };
            let bf = &mut bufs;
            let mut h = h0;
            while h < h1 {
                let g = h / hpg;
                let he = h1.min((g + 1) * hpg);
                let xw = (he - h) * np; // width of the group's part of an x / y row
                                        // SAFETY: heads `h..he` are this task's (caller contract) and `he * hs <= H * hs`.
                let so = unsafe {
                    std::slice::from_raw_parts_mut(call.state.ptr().add(h * hs), (he - h) * hs)
                };
                // [P, N] -> [N, P]
                for (src, dst) in so.chunks_exact(hs).zip(bf.sts.chunks_exact_mut(hs)) {
                    for (p, row) in src.chunks_exact(ns).enumerate() {
                        for (n, &sv) in row.iter().enumerate() {
                            dst[n * np + p] = sv;
                        }
                    }
                }
                let mut t0 = 0;
                while t0 < n_tok {
                    let q = CHUNK.min(n_tok - t0);
                    // Gather the chunk's B (transposed), C and x rows; they sit one row stride
                    // apart in the inputs, so they are prefetched a few rows ahead.
                    for j in 0..q {
                        if j + PREFETCH < q {
                            let tp = t0 + j + PREFETCH;
                            let r = tp * gn + g * ns;
                            prefetch(&b[r..r + ns]);
                            prefetch(&c[r..r + ns]);
                            prefetch(&x[tp * hp + h * np..tp * hp + h * np + xw]);
                        }
                        let r = (t0 + j) * gn + g * ns;
                        for (n, &bv) in b[r..r + ns].iter().enumerate() {
                            bf.bt[n * q + j] = bv;
                        }
                        bf.cq[j * ns..(j + 1) * ns].copy_from_slice(&c[r..r + ns]);
                        let xr = (t0 + j) * hp + h * np;
                        bf.xs[j * xw..(j + 1) * xw].copy_from_slice(&x[xr..xr + xw]);
                    }
                    gemm(q, q, ns, bf.cq, ns, 1, bf.bt, q, bf.cb, q, false, 0.0, None);
                    for (k, hh) in (h..he).enumerate() {
                        head_chunk(call, bf, k, hh, t0, q, xw);
                    }
                    // y = chunk output + D x, for the group's heads.
                    for i in 0..q {
                        // SAFETY: `y[t0 + i, h..he, :]` is this task's (caller contract), and
                        // `(t0 + i) * hp + h * np + xw <= n_tok * hp == y.len()`.
                        let yo = unsafe {
                            std::slice::from_raw_parts_mut(
                                call.y.ptr().add((t0 + i) * hp + h * np),
                                xw,
                            )
                        };
                        let yr = &bf.ys[i * xw..(i + 1) * xw];
                        let xr = &bf.xs[i * xw..(i + 1) * xw];
                        for (k, ((o, yv), xv)) in yo
                            .chunks_exact_mut(np)
                            .zip(yr.chunks_exact(np))
                            .zip(xr.chunks_exact(np))
                            .enumerate()
                        {
                            let dh = call.d[h + k];
                            for ((o, &yv), &xv) in o.iter_mut().zip(yv).zip(xv) {
                                *o = yv + dh * xv;
                            }
                        }
                    }
                    t0 += q;
                }
                // [N, P] -> [P, N]
                for (dst, src) in so.chunks_exact_mut(hs).zip(bf.sts.chunks_exact(hs)) {
                    for (p, row) in dst.chunks_exact_mut(ns).enumerate() {
                        for (n, sv) in row.iter_mut().enumerate() {
                            *sv = src[n * np + p];
                        }
                    }
                }
                h = he;
            }
        },
    );
}

/// One head (`hh`, the `k`-th of its group in `bf`) and one chunk (tokens `t0..t0 + q`, already
/// gathered into `bf`): writes the head's columns of `bf.ys` and advances its state in
/// `bf.sts` (transposed, `[N, P]`).
fn head_chunk(
    call: &Call,
    bf: &mut ChunkBufs,
    k: usize,
    hh: usize,
    t0: usize,
    q: usize,
    xw: usize,
) {
    let Mamba2Shape {
        n_heads: nh,
        head_dim: np,
        d_state: ns,
        ..
    } = call.shape;
    let hs = np * ns;
    let st = &mut bf.sts[k * hs..(k + 1) * hs];
    let (la, seg, el, ev) = (
        &mut bf.la[..q],
        &mut bf.seg[..q],
        &mut bf.el[..q],
        &mut bf.ev[..q],
    );
    // Log decays a_s and L_i (as exp(L_i) in `el`); dt-scaled inputs u_j.
    let mut acc = 0f32;
    for (i, (ai, ei)) in la.iter_mut().zip(el.iter_mut()).enumerate() {
        *ai = call.dt[(t0 + i) * nh + hh] * call.a[hh];
        acc += *ai;
        *ei = acc;
    }
    exp_flushed(el);
    for j in 0..q {
        let dtj = call.dt[(t0 + j) * nh + hh];
        let xj = &bf.xs[j * xw + k * np..j * xw + (k + 1) * np];
        for (uv, &xv) in bf.u[j * np..(j + 1) * np].iter_mut().zip(xj) {
            *uv = dtj * xv;
        }
    }
    // W[i][j] = (C_i·B_j) exp(L_i - L_j) for j <= i, else 0. The exponent is summed over the
    // segment, Σ_{j<s<=i} a_s (kept in `seg`, updated from one row to the next), not taken as
    // a difference of running sums (which loses digits once |L| is large); it is masked to
    // -inf above the diagonal (exp -> 0) up to the next multiple of 16, so the vector exp
    // covers whole lanes.
    for i in 0..q {
        for sv in &mut seg[..i] {
            *sv += la[i];
        }
        seg[i] = 0.0;
        let wi = &mut bf.w[i * q..(i + 1) * q];
        let len = (i + 1).next_multiple_of(16).min(q);
        wi[..=i].copy_from_slice(&seg[..=i]);
        wi[i + 1..len].fill(f32::NEG_INFINITY);
        exp_flushed(&mut wi[..len]);
        for (wv, &cbv) in wi[..len].iter_mut().zip(&bf.cb[i * q..i * q + len]) {
            *wv *= cbv;
        }
        wi[len..].fill(0.0);
    }
    // Inter-chunk term exp(L_i) (C_i · S) (S read transposed, [N, P]), then the intra-chunk
    // term on top, into the head's columns of `ys`.
    let yk = &mut bf.ys[k * np..];
    let (cq, u) = (&*bf.cq, &*bf.u);
    gemm(q, np, ns, cq, ns, 1, st, np, yk, xw, false, 0.0, Some(el));
    gemm(q, np, q, bf.w, q, 1, u, np, yk, xw, true, 1.0, None);
    // S' = exp(L_last) S + Σ_j B_j ⊗ exp(L_last - L_j) u_j (transposed); the exponents are
    // again segment sums.
    let mut tail = 0f32;
    for (e, &aj) in ev.iter_mut().zip(la.iter()).rev() {
        *e = tail;
        tail += aj;
    }
    exp_flushed(ev);
    for (j, &e) in ev.iter().enumerate() {
        for (vv, &uv) in bf.v[j * np..(j + 1) * np]
            .iter_mut()
            .zip(&u[j * np..(j + 1) * np])
        {
            *vv = e * uv;
        }
    }
    gemm(
        ns,
        np,
        q,
        bf.bt,
        q,
        1,
        bf.v,
        np,
        st,
        np,
        false,
        el[q - 1],
        None,
    );
}

/// The scan models call: [`mamba2_chunked`] when `keep` is `None` and the call has at least
/// [`CHUNKED_MIN_TOKENS`] tokens, [`mamba2_scan`] otherwise. Arguments and layouts as in
/// [`mamba2_scan`].
#[allow(clippy::too_many_arguments)]
pub fn mamba2(
    pool: &dyn ThreadPool,
    shape: &Mamba2Shape,
    x: &[f32],
    dt: &[f32],
    a: &[f32],
    b: &[f32],
    c: &[f32],
    d: &[f32],
    state: &mut [f32],
    y: &mut [f32],
    keep: Option<&mut [f32]>,
) {
    let n_tok = x.len() / shape.d_inner().max(1);
    if keep.is_none() && n_tok >= CHUNKED_MIN_TOKENS {
        mamba2_chunked(pool, shape, x, dt, a, b, c, d, state, y);
    } else {
        mamba2_scan(pool, shape, x, dt, a, b, c, d, state, y, keep);
    }
}

/// Gated grouped RMSNorm of Mamba2 (`MambaRMSNormGated` with `norm_before_gate = False`):
/// for each token row of `x` (`[n_tok, d_inner]`, updated in place) and the matching row of `z`
/// (same shape), `v = x * silu(z)`, then each of the `n_groups` consecutive groups of
/// `d_inner / n_groups` values is normalised, `v / sqrt(mean(v²) + eps)`, and multiplied by
/// `w` (`[d_inner]`). The gate is applied before the norm.
///
/// SiLU is computed as ggml's SwiGLU ([`crate::vexp::swiglu`]) and the norm as
/// [`crate::ops::rms_norm`] (sum of squares in f64).
pub fn gated_group_rms_norm(
    x: &mut [f32],
    z: &[f32],
    d_inner: usize,
    n_groups: usize,
    w: &[f32],
    eps: f32,
) {
    assert!(
        d_inner > 0 && n_groups > 0 && d_inner.is_multiple_of(n_groups),
        "gated_group_rms_norm: d_inner {d_inner} not divisible into {n_groups} groups"
    );
    assert_eq!(
        x.len() % d_inner,
        0,
        "gated_group_rms_norm: x must be [n, d_inner]"
    );
    assert_eq!(z.len(), x.len(), "gated_group_rms_norm: z must match x");
    assert_eq!(
        w.len(),
        d_inner,
        "gated_group_rms_norm: w must be [d_inner]"
    );
    let gs = d_inner / n_groups;
    let mut gate = vec![0f32; d_inner];
    for (row, zr) in x.chunks_exact_mut(d_inner).zip(z.chunks_exact(d_inner)) {
        gate.copy_from_slice(zr);
        crate::vexp::swiglu(&mut gate, row);
        for (grp, wg) in gate.chunks_exact_mut(gs).zip(w.chunks_exact(gs)) {
            crate::ops::rms_norm(grp, gs, wg, eps, 0.0);
        }
        row.copy_from_slice(&gate);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Mask with the low `n` lanes set (`n <= 16`).
    fn tail_mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            (1u16 << n) - 1
        }
    }

    /// AVX-512 twin of `head_step_scalar`: one token of one head. `sh` `[P, N]`, `xh`, `yh`
    /// `[P]`, `bt`, `ct` `[N]`, `da = exp(dt * A)`. The state update is
    /// `fma(dt*x, B, S*dA)`; each `C` dot product is one 16-lane accumulator reduced at the
    /// end. Rows go four at a time (independent accumulators, shared B/C loads).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub fn head_step(
        sh: &mut [f32],
        xh: &[f32],
        dt: f32,
        da: f32,
        bt: &[f32],
        ct: &[f32],
        dh: f32,
        yh: &mut [f32],
    ) {
        let ns = bt.len();
        let np = xh.len();
        assert!(ct.len() == ns && sh.len() == np * ns && yh.len() == np);
        let mut p = 0;
        while p + 4 <= np {
            // SAFETY: rows p..p+4 are inside `sh`, `xh` and `yh`; N matches `bt`/`ct`.
            unsafe { rows::<4>(sh, p, xh, dt, da, bt, ct, dh, yh) };
            p += 4;
        }
        while p < np {
            // SAFETY: row p is inside `sh`, `xh` and `yh`; N matches `bt`/`ct`.
            unsafe { rows::<1>(sh, p, xh, dt, da, bt, ct, dh, yh) };
            p += 1;
        }
    }

    /// Rows `p..p + R` of [`head_step`].
    ///
    /// # Safety
    /// AVX-512F must be available; `(p + R) * bt.len() <= sh.len()`, `p + R <= xh.len()`,
    /// `p + R <= yh.len()` and `ct.len() == bt.len()`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const R: usize>(
        sh: &mut [f32],
        p: usize,
        xh: &[f32],
        dt: f32,
        da: f32,
        bt: &[f32],
        ct: &[f32],
        dh: f32,
        yh: &mut [f32],
    ) {
        let ns = bt.len();
        let (pb, pc) = (bt.as_ptr(), ct.as_ptr());
        // SAFETY: row p starts inside `sh` (caller contract).
        let ps = unsafe { sh.as_mut_ptr().add(p * ns) };
        let vda = _mm512_set1_ps(da);
        let mut vx = [_mm512_setzero_ps(); R];
        for (r, v) in vx.iter_mut().enumerate() {
            *v = _mm512_set1_ps(xh[p + r] * dt);
        }
        let mut acc = [_mm512_setzero_ps(); R];
        let mut i = 0;
        while i + 16 <= ns {
            // SAFETY: lanes i..i + 16 are inside `bt`, `ct` and each of the R rows (caller
            // contract).
            unsafe {
                let bv = _mm512_loadu_ps(pb.add(i));
                let cv = _mm512_loadu_ps(pc.add(i));
                for r in 0..R {
                    let pr = ps.add(r * ns + i);
                    let s = _mm512_fmadd_ps(vx[r], bv, _mm512_mul_ps(_mm512_loadu_ps(pr), vda));
                    _mm512_storeu_ps(pr, s);
                    acc[r] = _mm512_fmadd_ps(s, cv, acc[r]);
                }
            }
            i += 16;
        }
        if i < ns {
            let m = tail_mask(ns - i);
            // SAFETY: the mask selects lanes i..ns, inside `bt`, `ct` and each of the R rows
            // (caller contract); masked-off lanes are neither read nor written.
            unsafe {
                let bv = _mm512_maskz_loadu_ps(m, pb.add(i));
                let cv = _mm512_maskz_loadu_ps(m, pc.add(i));
                for r in 0..R {
                    let pr = ps.add(r * ns + i);
                    let s = _mm512_fmadd_ps(
                        vx[r],
                        bv,
                        _mm512_mul_ps(_mm512_maskz_loadu_ps(m, pr), vda),
                    );
                    _mm512_mask_storeu_ps(pr, m, s);
                    acc[r] = _mm512_fmadd_ps(s, cv, acc[r]);
                }
            }
        }
        for (r, &a) in acc.iter().enumerate() {
            yh[p + r] = _mm512_reduce_add_ps(a) + dh * xh[p + r];
        }
    }

    /// Register-blocked `MR x (16 * NV)` tile of `c = beta * c + diag(scale) (a · b)` over
    /// `kk` steps of `k`; the last of the `NV` column vectors uses lane mask `last`.
    ///
    /// # Safety
    /// AVX-512F must be available. For `r < MR`, `k < kk`, `v < NV` and every lane `l`
    /// selected (all lanes, or `last` for `v == NV - 1`): `a + r*rsa + k*csa`,
    /// `b + k*ldb + 16*v + l` and `c + r*ldc + 16*v + l` are valid (`c` for writing, and no
    /// other reference to those `c` elements is live).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<const MR: usize, const NV: usize>(
        kk: usize,
        a: *const f32,
        rsa: usize,
        csa: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        last: __mmask16,
        beta: f32,
        scale: [f32; 4],
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        for k in 0..kk {
            let mut bv = [_mm512_setzero_ps(); NV];
            for (v, bvv) in bv.iter_mut().enumerate() {
                let m = if v + 1 == NV { last } else { 0xffff };
                // SAFETY: the selected lanes of row k of the tile are valid (caller contract).
                *bvv = unsafe { _mm512_maskz_loadu_ps(m, b.add(k * ldb + 16 * v)) };
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                // SAFETY: a + r*rsa + k*csa is valid (caller contract).
                let av = _mm512_set1_ps(unsafe { *a.add(r * rsa + k * csa) });
                for (accv, &bvv) in accr.iter_mut().zip(&bv) {
                    *accv = _mm512_fmadd_ps(av, bvv, *accv);
                }
            }
        }
        let vbeta = _mm512_set1_ps(beta);
        for (r, accr) in acc.iter().enumerate() {
            let vs = _mm512_set1_ps(scale[r]);
            for (v, &accv) in accr.iter().enumerate() {
                let m = if v + 1 == NV { last } else { 0xffff };
                let prod = _mm512_mul_ps(vs, accv);
                // SAFETY: the selected lanes of row r of the tile are valid (caller contract).
                unsafe {
                    let p = c.add(r * ldc + 16 * v);
                    let out = if beta == 0.0 {
                        prod
                    } else {
                        _mm512_fmadd_ps(vbeta, _mm512_maskz_loadu_ps(m, p), prod)
                    };
                    _mm512_mask_storeu_ps(p, m, out);
                }
            }
        }
    }

    /// AVX-512 `super::gemm` (same contract): tiles of 4 rows by up to 64 columns.
    ///
    /// # Safety
    /// AVX-512F must be available, and the bounds `super::gemm` asserts must hold.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn gemm(
        m: usize,
        n: usize,
        kk: usize,
        a: &[f32],
        rsa: usize,
        csa: usize,
        b: &[f32],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        causal: bool,
        beta: f32,
        scale: Option<&[f32]>,
    ) {
        let (pa, pb, pc) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        let mut i0 = 0;
        while i0 < m {
            let mr = (m - i0).min(4);
            let k_end = if causal { kk.min(i0 + 4) } else { kk };
            let mut sc = [1f32; 4];
            if let Some(s) = scale {
                sc[..mr].copy_from_slice(&s[i0..i0 + mr]);
            }
            let mut j0 = 0;
            while j0 < n {
                let cols = (n - j0).min(64);
                let nv = cols.div_ceil(16);
                let last = tail_mask(cols - 16 * (nv - 1));
                // SAFETY: rows i0..i0+mr < m, columns j0..j0+cols <= n and k < k_end <= kk are
                // inside `a`, `b` and `c` by the caller's bounds; `c` is exclusively borrowed.
                unsafe {
                    let ta = pa.add(i0 * rsa);
                    let tb = pb.add(j0);
                    let tc = pc.add(i0 * ldc + j0);
                    macro_rules! go {
                        ($mr:literal, $nv:literal) => {
                            tile::<$mr, $nv>(k_end, ta, rsa, csa, tb, ldb, tc, ldc, last, beta, sc)
                        };
                    }
                    match (mr, nv) {
                        (4, 4) => go!(4, 4),
                        (4, 3) => go!(4, 3),
                        (4, 2) => go!(4, 2),
                        (4, 1) => go!(4, 1),
                        (3, 4) => go!(3, 4),
                        (3, 3) => go!(3, 3),
                        (3, 2) => go!(3, 2),
                        (3, 1) => go!(3, 1),
                        (2, 4) => go!(2, 4),
                        (2, 3) => go!(2, 3),
                        (2, 2) => go!(2, 2),
                        (2, 1) => go!(2, 1),
                        (1, 4) => go!(1, 4),
                        (1, 3) => go!(1, 3),
                        (1, 2) => go!(1, 2),
                        _ => go!(1, 1),
                    }
                }
                j0 += 64;
            }
            i0 += 4;
        }
    }
}
