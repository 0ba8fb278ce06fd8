//! Element-wise and row-wise f32 ops: RMSNorm, RoPE, activations, softmax, residual add.
//!
//! All tensors are row-major f32 slices. These ops are memory-light compared with the matmuls,
//! so each is written once as a plain loop the compiler vectorises; the loops are their own
//! scalar reference, and the few places where accumulation order matters accumulate in f64 like
//! ggml does (`ggml_float`).

/// Sum of `a[i] * b[i]` (`a.len() == b.len()`), with the fastest variant this CPU has.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if kapitsa_base::CpuFeatures::get().avx512 {
        // SAFETY: AVX-512F is available (checked at run time).
        return unsafe { x86::dot_avx512(a, b) };
    }
    dot_f32_scalar(a, b)
}

/// Scalar twin of [`dot_f32`]: 16 independent accumulators (vectorisable, deterministic for a
/// given length).
pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    acc.iter().sum::<f32>() + s
}

/// `y[i] += a * x[i]`, with the fastest variant this CPU has.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    if kapitsa_base::CpuFeatures::get().avx512 {
        // SAFETY: AVX-512F is available (checked at run time).
        return unsafe { x86::axpy_avx512(a, x, y) };
    }
    axpy_scalar(a, x, y)
}

/// Scalar twin of [`axpy`].
pub fn axpy_scalar(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * *xi;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// AVX-512 dot product: two 16-lane FMA accumulators, scalar tail.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `a.len() == b.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: i + 32 <= n, so every load is inside both slices.
            unsafe {
                acc0 =
                    _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm512_fmadd_ps(
                    _mm512_loadu_ps(pa.add(i + 16)),
                    _mm512_loadu_ps(pb.add(i + 16)),
                    acc1,
                );
            }
            i += 32;
        }
        if i + 16 <= n {
            // SAFETY: i + 16 <= n, so both loads are inside the slices.
            unsafe {
                acc0 =
                    _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
            }
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        while i < n {
            // SAFETY: i < n.
            s += unsafe { *pa.add(i) * *pb.add(i) };
            i += 1;
        }
        s
    }

    /// AVX-512 `y += a * x`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `x.len() == y.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy_avx512(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let va = _mm512_set1_ps(a);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside both slices.
            unsafe {
                let r = _mm512_fmadd_ps(va, _mm512_loadu_ps(px.add(i)), _mm512_loadu_ps(py.add(i)));
                _mm512_storeu_ps(py.add(i), r);
            }
            i += 16;
        }
        while i < n {
            // SAFETY: i < n.
            unsafe { *py.add(i) += a * *px.add(i) };
            i += 1;
        }
    }
}

/// RMSNorm of each row of `x` (`[n_rows, n]`) in place: `x * w / sqrt(mean(x^2) + eps)`.
/// The sum of squares is accumulated in f64 (as ggml). `w` has `n` elements; `w_offset` is
/// added to every weight (1.0 for the zero-centred `(1 + w)` norms of Qwen3.5 in HF form).
pub fn rms_norm(x: &mut [f32], n: usize, w: &[f32], eps: f32, w_offset: f32) {
    debug_assert_eq!(w.len(), n);
    debug_assert_eq!(x.len() % n, 0);
    for row in x.chunks_exact_mut(n) {
        // ggml squares in f32 and sums in f64.
        let ss: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let mean = (ss / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, &wi) in row.iter_mut().zip(w) {
            *v = (*v * scale) * (wi + w_offset);
        }
    }
}

/// Like [`rms_norm`] but writes to `out` and leaves `x` untouched.
pub fn rms_norm_to(x: &[f32], out: &mut [f32], n: usize, w: &[f32], eps: f32, w_offset: f32) {
    out.copy_from_slice(x);
    rms_norm(out, n, w, eps, w_offset);
}

/// Precomputed NeoX-style RoPE frequencies for `n_rot` rotated dims (even): `inv_freq[i] =
/// base^(-2i / n_rot)` for `i in 0..n_rot/2`.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Number of rotated dims at the start of each head (`<= head_dim`).
    pub n_rot: usize,
    inv_freq: Vec<f64>,
    theta_scale: f32,
}

impl Rope {
    /// Frequencies for `n_rot` rotated dims with base `theta`.
    pub fn new(n_rot: usize, theta: f32) -> Rope {
        let half = n_rot / 2;
        let inv_freq = (0..half)
            .map(|i| (theta as f64).powf(-2.0 * i as f64 / n_rot as f64))
            .collect();
        Rope {
            n_rot,
            inv_freq,
            theta_scale: theta.powf(-2.0 / n_rot as f32),
        }
    }

    /// Number of (cos, sin) pairs per position: `n_rot / 2`.
    pub fn n_pairs(&self) -> usize {
        self.n_rot / 2
    }

    /// Fill `cs` (`n_rot / 2` entries) with `(cos, sin)` of the angle of pair `i` at `pos`.
    ///
    /// The angles are computed as ggml does (`theta_i = pos * base^(-2i/n_rot)` by repeated
    /// f32 multiplication, then f32 `cos`/`sin`) so rotated keys and queries match llama.cpp
    /// to the last bit; the exact angles are in [`Rope::inv_freq`] for reference.
    pub fn table(&self, pos: u32, cs: &mut [(f32, f32)]) {
        debug_assert_eq!(cs.len(), self.n_pairs());
        let mut theta = pos as f32;
        for c in cs.iter_mut() {
            *c = (theta.cos(), theta.sin());
            theta *= self.theta_scale;
        }
    }

    /// Exact inverse frequency of pair `i`: `base^(-2i/n_rot)`.
    pub fn inv_freq(&self, i: usize) -> f64 {
        self.inv_freq[i]
    }

    /// Rotate every head of `x` (`[n_head, head_dim]`, one token) in place with the angles in
    /// `cs` (from [`Rope::table`]), NeoX pairing: dim `i` with dim `i + n_rot/2` for
    /// `i < n_rot/2`; dims `n_rot..head_dim` pass through.
    ///
    /// Each output is one fused multiply-add, as GCC compiles ggml's `x0*cos - x1*sin` and
    /// `x0*sin + x1*cos` (it contracts them to `fma(x0, cos, -(x1*sin))` and
    /// `fma(x0, sin, x1*cos)`; checked bit for bit against llama.cpp's graph, see
    /// `models/examples/op_diff.rs`).
    pub fn apply_neox(&self, x: &mut [f32], head_dim: usize, cs: &[(f32, f32)]) {
        debug_assert!(
            self.n_rot <= head_dim
                && x.len().is_multiple_of(head_dim)
                && cs.len() == self.n_rot / 2
        );
        #[cfg(target_arch = "x86_64")]
        if kapitsa_base::CpuFeatures::get().avx2 {
            // SAFETY: AVX2 and FMA are available (checked at run time; `avx2` implies FMA in
            // `CpuFeatures`).
            unsafe { rope_neox_fma(self.n_rot, x, head_dim, cs) };
            return;
        }
        rope_neox_body(self.n_rot, x, head_dim, cs);
    }
}

/// [`Rope::apply_neox`] compiled with FMA, so `mul_add` is one instruction.
///
/// # Safety
/// Requires AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rope_neox_fma(n_rot: usize, x: &mut [f32], head_dim: usize, cs: &[(f32, f32)]) {
    rope_neox_body(n_rot, x, head_dim, cs)
}

/// The rotation of [`Rope::apply_neox`] (`mul_add` is a library call without FMA).
#[inline(always)]
fn rope_neox_body(n_rot: usize, x: &mut [f32], head_dim: usize, cs: &[(f32, f32)]) {
    let half = n_rot / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (a, b) = head[..n_rot].split_at_mut(half);
        for ((x0, x1), &(c, s)) in a.iter_mut().zip(b.iter_mut()).zip(cs) {
            let (v0, v1) = (*x0, *x1);
            *x0 = v0.mul_add(c, -(v1 * s));
            *x1 = v0.mul_add(s, v1 * c);
        }
    }
}

/// SwiGLU: `gate[i] = silu(gate[i]) * up[i]`, computed as ggml computes it
/// ([`crate::vexp::swiglu`]).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    crate::vexp::swiglu(gate, up)
}

/// Scalar twin of [`silu_mul`].
pub fn silu_mul_scalar(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `x / (1 + exp(-x))`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// In-place softmax of one row. Max-subtracted; the sum is kept in f64.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v -= max;
    }
    crate::vexp::exp_inplace(x);
    let sum: f64 = x.iter().map(|&v| v as f64).sum();
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `y[i] += x[i]`.
pub fn add_inplace(y: &mut [f32], x: &[f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (a, b) in y.iter_mut().zip(x) {
        *a += *b;
    }
}

/// Index of the largest value (first one on ties); 0 for an empty slice. NaN never wins.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_twins_match_scalar() {
        for n in [0usize, 1, 15, 16, 17, 31, 32, 33, 64, 131, 1000] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.3).collect();
            let scale: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum::<f32>() + 1.0;
            assert!(
                (dot_f32(&a, &b) - dot_f32_scalar(&a, &b)).abs() <= 1e-5 * scale,
                "n={n}"
            );
            let mut y1 = b.clone();
            let mut y2 = b.clone();
            axpy(0.37, &a, &mut y1);
            axpy_scalar(0.37, &a, &mut y2);
            for (p, q) in y1.iter().zip(&y2) {
                assert!((p - q).abs() <= 1e-6 * (1.0 + q.abs()), "n={n}");
            }
        }
    }

    #[test]
    fn dot_matches_f64() {
        for n in [0usize, 1, 15, 16, 17, 64, 131] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.3).collect();
            let r: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot_f32(&a, &b) as f64 - r).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn rms_norm_unit() {
        let mut x = vec![3.0f32, 4.0];
        rms_norm(&mut x, 2, &[1.0, 2.0], 0.0, 0.0);
        let s = (12.5f32).sqrt();
        assert!((x[0] - 3.0 / s).abs() < 1e-6 && (x[1] - 8.0 / s).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_and_preserves_norm() {
        let rope = Rope::new(4, 10000.0);
        let mut x = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut cs = vec![(0.0, 0.0); rope.n_pairs()];
        rope.table(3, &mut cs);
        rope.apply_neox(&mut x, 6, &cs);
        // pair (0, 2) rotated by angle 3 * 1, pair (1, 3) by 3 * 10000^-0.5; dims 4,5 untouched
        let (c, s) = (3f32.cos(), 3f32.sin());
        assert!((x[0] - (1.0 * c - 3.0 * s)).abs() < 1e-5);
        assert!((x[2] - (3.0 * c + 1.0 * s)).abs() < 1e-5);
        assert_eq!(&x[4..], &[5.0, 6.0]);
        let n: f32 = x[..4].iter().map(|v| v * v).sum();
        assert!((n - 30.0).abs() < 1e-4);
    }

    #[test]
    fn rope_table_is_close_to_exact_angles() {
        let rope = Rope::new(64, 1e6);
        let mut cs = vec![(0.0, 0.0); rope.n_pairs()];
        for pos in [0u32, 1, 7, 100, 4095, 32767] {
            rope.table(pos, &mut cs);
            for (i, &(c, s)) in cs.iter().enumerate() {
                let t = pos as f64 * rope.inv_freq(i);
                // f32 angle accumulation: the error grows with the angle (ggml's method)
                let tol = 1e-6 + t.abs() * 2e-6;
                assert!(
                    (c as f64 - t.cos()).abs() < tol && (s as f64 - t.sin()).abs() < tol,
                    "pos {pos} pair {i}"
                );
            }
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0f32, 2.0, 3.0, -1e9];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] == 0.0 && x[2] > x[1]);
    }
}
