//! A vectorised `exp` with the same results as ggml's CPU backend, used by softmax and SiLU.
//!
//! Token-exact agreement with llama.cpp needs the same rounding in the few places where float
//! results feed an 8-bit activation quantisation, because one flipped rounding there moves a
//! logit by a quantisation step. ggml computes `exp` in softmax and SiLU with a 16-lane
//! polynomial (ARM optimized-routines' expf: range reduction `x = n ln2 + b`, a degree-5
//! polynomial in `b`, scaling by `2^n`, max error about 1.5 ulp; ggml `ggml-cpu/vec.h`). This
//! module evaluates the same algorithm, lane for lane, with AVX-512; other CPUs use `f32::exp`.

/// `exp(x[i])` for every element, in place.
pub fn exp_inplace(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if kapitsa_base::CpuFeatures::get().avx512 {
        // SAFETY: AVX-512F and DQ are available (checked at run time).
        unsafe { x86::exp_inplace(x) };
        return;
    }
    for v in x.iter_mut() {
        *v = v.exp();
    }
}

/// SwiGLU as ggml computes it: `gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i]`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    if kapitsa_base::CpuFeatures::get().avx512 {
        // SAFETY: AVX-512F and DQ are available (checked at run time).
        unsafe { x86::swiglu(gate, up) };
        return;
    }
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// 16 lanes of exp (see the module docs for the method).
    #[target_feature(enable = "avx512f,avx512dq")]
    fn exp16(x: __m512) -> __m512 {
        let shift = _mm512_set1_ps(f32::from_bits(0x4b40_0000)); // 1.5 * 2^23
        let z = _mm512_fmadd_ps(x, _mm512_set1_ps(f32::from_bits(0x3fb8_aa3b)), shift); // log2(e)
        let n = _mm512_sub_ps(z, shift);
        // b = x - n*ln2 with ln2 split in two parts for accuracy
        let b = _mm512_fnmadd_ps(
            n,
            _mm512_set1_ps(f32::from_bits(0x35bf_be8e)),
            _mm512_fnmadd_ps(n, _mm512_set1_ps(f32::from_bits(0x3f31_7200)), x),
        );
        let u = _mm512_mul_ps(b, b);
        let p = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(
                    _mm512_set1_ps(f32::from_bits(0x3c07_2010)),
                    b,
                    _mm512_set1_ps(f32::from_bits(0x3d2b_9f17)),
                ),
                u,
                _mm512_fmadd_ps(
                    _mm512_set1_ps(f32::from_bits(0x3e2a_af33)),
                    b,
                    _mm512_set1_ps(f32::from_bits(0x3efffedb)),
                ),
            ),
            u,
            _mm512_fmadd_ps(
                _mm512_set1_ps(f32::from_bits(0x3f7f_fff6)),
                b,
                _mm512_set1_ps(1.0),
            ),
        );
        let res = _mm512_scalef_ps(p, n);
        // |n| > 192: the result over/underflows; 0 for large negative x, +inf otherwise.
        let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        if big == 0 {
            return res;
        }
        let neg = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
        let alt = _mm512_mask_blend_ps(neg, _mm512_set1_ps(f32::INFINITY), _mm512_setzero_ps());
        _mm512_mask_blend_ps(big, res, alt)
    }

    /// # Safety
    /// The CPU must support AVX-512F and DQ.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn exp_inplace(x: &mut [f32]) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside the slice.
            unsafe { _mm512_storeu_ps(p.add(i), exp16(_mm512_loadu_ps(p.add(i)))) };
            i += 16;
        }
        // ggml uses the C library's expf for the tail.
        for v in &mut x[i..] {
            *v = v.exp();
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F and DQ; `gate.len() == up.len()`.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn swiglu(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let (pg, pu) = (gate.as_mut_ptr(), up.as_ptr());
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside both slices.
            unsafe {
                let x = _mm512_loadu_ps(pg.add(i));
                let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
                let s = _mm512_div_ps(x, _mm512_add_ps(one, e));
                _mm512_storeu_ps(pg.add(i), _mm512_mul_ps(s, _mm512_loadu_ps(pu.add(i))));
            }
            i += 16;
        }
        for j in i..n {
            let g = gate[j];
            gate[j] = g / (1.0 + (-g).exp()) * up[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_and_handles_extremes() {
        let mut xs: Vec<f32> = (-2000..2000).map(|i| i as f32 * 0.05).collect();
        xs.extend([f32::NEG_INFINITY, -200.0, -104.0, 88.0, 89.0, 0.0, -0.0]);
        let mut y = xs.clone();
        exp_inplace(&mut y);
        for (&x, &v) in xs.iter().zip(&y) {
            let want = (x as f64).exp();
            if want > f32::MAX as f64 {
                assert!(v.is_infinite() && v > 0.0, "exp({x}) = {v}");
            } else if want < 1e-38 {
                assert!(v < 1e-37, "exp({x}) = {v}");
            } else {
                assert!(
                    ((v as f64 - want) / want).abs() < 4e-7,
                    "exp({x}) = {v}, want {want}"
                );
            }
        }
    }

    #[test]
    fn swiglu_matches_definition() {
        let g: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.7).collect();
        let u: Vec<f32> = (0..37).map(|i| (i as f32 * 0.3).sin()).collect();
        let mut y = g.clone();
        swiglu(&mut y, &u);
        for i in 0..37 {
            let want = g[i] as f64 / (1.0 + (-g[i] as f64).exp()) * u[i] as f64;
            assert!(
                (y[i] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()),
                "{i}"
            );
        }
    }
}
