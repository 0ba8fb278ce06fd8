//! The *block order* of the 32-element formats Q8_0 and Q5_0 (against Q8_0 activations), used
//! at [`SimdLevel::Amx`](super::SimdLevel::Amx) so that the AMX tile GEMM
//! (`crate::gemm_amx_blk`), the row-group decode GEMV (`gemv_blk`) and the per-row dot kernel
//! give bit-identical results for every batch size: a sequence's logits never depend on what
//! else is in the batch.
//!
//! The other levels keep ggml's order (several float lanes per row, summed at the end), which
//! tile hardware cannot reproduce. This order defines, for weight row `w` and activation row
//! `x` of `nb` blocks of 32 elements:
//!
//! ```text
//! acc = 0f32
//! for each block b, in order:
//!     T = sum_i w_i * q_i            exact i32: w_i the signed weight values (Q8_0: the quants;
//!                                    Q5_0: the 5-bit value - 16), q_i the Q8_0 activation quants
//!     acc = fma(d_w * d_x, T as f32, acc)
//! result = acc
//! ```
//!
//! `d_w` and `d_x` are the blocks' f16 scales widened to f32; their product is one f32
//! multiply (exact: two 11-bit significands) and `fma` one fused multiply-add (one rounding).
//! `T` fits in 19 bits, so `T as f32` is exact. The integers are the ones ggml's scalar code
//! forms; only the float accumulation differs from ggml (tested to 1e-5 of `sum |w x|` against
//! the ggml-order scalar twins).
//!
//! [`decode`] gives the signed values and scale of one block; the scalar twin [`dot_scalar`]
//! and the SIMD and tile kernels all take their integers from the same definitions.

use kapitsa_base::GgmlType;

use super::blocks::{f16_at, u32_at};
use super::SimdLevel;

/// Elements of a block.
pub(crate) const QK: usize = 32;
/// Bytes of one Q8_0 activation block (f16 scale, 32 signed quants).
pub(crate) const XB: usize = 34;

/// Bytes of one block of `ty` if it has a block order (Q8_0, Q5_0), else `None`.
pub(crate) fn block_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q8_0 => Some(34),
        GgmlType::Q5_0 => Some(22),
        _ => None,
    }
}

/// One block of `ty` (`b`: exactly its bytes) as its f32 scale and 32 signed values (Q8_0: the
/// quants; Q5_0: `(low nibble | qh bit << 4) - 16`, element `j < 16` from the low nibble of
/// byte `j`, element `j + 16` from its high nibble). `ty` must be one [`block_bytes`] accepts
/// (anything else gives a zero block).
pub(crate) fn decode(ty: GgmlType, b: &[u8]) -> (f32, [i8; QK]) {
    let mut v = [0i8; QK];
    match ty {
        GgmlType::Q8_0 => {
            for (o, &q) in v.iter_mut().zip(&b[2..34]) {
                *o = q as i8;
            }
        }
        GgmlType::Q5_0 => {
            let qh = u32_at(b, 2);
            for j in 0..16 {
                let lo = b[6 + j] & 0xF;
                let hi = b[6 + j] >> 4;
                let h0 = ((qh >> j) & 1) as u8;
                let h1 = ((qh >> (j + 16)) & 1) as u8;
                v[j] = (lo | h0 << 4) as i8 - 16;
                v[j + 16] = (hi | h1 << 4) as i8 - 16;
            }
        }
        _ => return (0.0, v),
    }
    (f16_at(b, 0), v)
}

/// The block-order dot kernel for `ty` (Q8_0, Q5_0), chosen at [`SimdLevel::Amx`]: the
/// row-group GEMV of `gemv_blk` on one row, so that the dot product and the GEMV are one code.
pub(super) fn kernel(ty: GgmlType) -> Option<super::dot_avx512::Chosen> {
    let f: super::DotFn = match ty {
        GgmlType::Q8_0 => dot_via_gemv::<false>,
        GgmlType::Q5_0 => dot_via_gemv::<true>,
        _ => return None,
    };
    super::gemv_blk::kernel(ty)?;
    Some((SimdLevel::Amx, f, None))
}

/// One row of the block-order GEMV (Q5_0 if `Q5`, else Q8_0).
///
/// # Safety
/// The CPU has the features of `gemv_blk`'s kernels (AVX-512 VNNI: implied by
/// [`SimdLevel::Amx`], the only level that selects this).
unsafe fn dot_via_gemv<const Q5: bool>(w: &[u8], x: &[u8]) -> f32 {
    let ty = if Q5 { GgmlType::Q5_0 } else { GgmlType::Q8_0 };
    let mut out = [0f32];
    match super::gemv_blk::kernel(ty) {
        // SAFETY: the caller's contract gives the kernel's CPU features; it reads inside `w`
        // and `x` only.
        Some(g) => unsafe { g(w, w.len(), x, &mut out) },
        None => out[0] = dot_scalar(ty, w, x),
    }
    out[0]
}

/// Scalar twin of the block order (the reference every kernel of this order is tested against
/// bit for bit): `w` holds `nb` blocks of `ty`, `x` `nb` Q8_0 blocks.
pub(crate) fn dot_scalar(ty: GgmlType, w: &[u8], x: &[u8]) -> f32 {
    let Some(bb) = block_bytes(ty) else {
        return 0.0;
    };
    let mut acc = 0f32;
    for (b, y) in w.chunks_exact(bb).zip(x.chunks_exact(XB)) {
        let (d, v) = decode(ty, b);
        let t: i32 = v
            .iter()
            .zip(&y[2..XB])
            .map(|(&a, &q)| i32::from(a) * i32::from(q as i8))
            .sum();
        acc = (d * f16_at(y, 0)).mul_add(t as f32, acc);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_row;

    fn next(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    #[test]
    fn decoded_values_match_dequantisation() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
            let bb = block_bytes(ty).unwrap();
            for _ in 0..50 {
                let mut b: Vec<u8> = (0..bb).map(|_| next(&mut s) as u8).collect();
                let h = half::f16::from_f32((next(&mut s) % 1000) as f32 * 1e-4 - 0.05);
                b[0..2].copy_from_slice(&h.to_bits().to_le_bytes());
                let mut want = vec![0f32; QK];
                dequantize_row(ty, &b, &mut want).unwrap();
                let (d, v) = decode(ty, &b);
                for j in 0..QK {
                    assert_eq!(d * f32::from(v[j]), want[j], "{ty:?} element {j}");
                }
            }
        }
    }

    #[test]
    fn scalar_twin_is_close_to_the_ggml_order() {
        let mut s = 0x1234_5678_9ABC_DEF1u64;
        for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
            let bb = block_bytes(ty).unwrap();
            for nb in [1usize, 3, 28, 97] {
                let mut w: Vec<u8> = (0..bb * nb).map(|_| next(&mut s) as u8).collect();
                let mut x: Vec<u8> = (0..XB * nb).map(|_| next(&mut s) as u8).collect();
                for b in 0..nb {
                    let h = half::f16::from_f32(0.001 + (next(&mut s) % 100) as f32 * 1e-4);
                    w[b * bb..b * bb + 2].copy_from_slice(&h.to_bits().to_le_bytes());
                    x[b * XB..b * XB + 2].copy_from_slice(&h.to_bits().to_le_bytes());
                }
                let got = dot_scalar(ty, &w, &x);
                let k = crate::quant::DotKernel::scalar(ty).unwrap();
                let want = k.dot(&w, &x);
                let mut mag = 0f32;
                for b in 0..nb {
                    let (d, v) = decode(ty, &w[b * bb..(b + 1) * bb]);
                    let dx = f16_at(&x[b * XB..], 0);
                    for j in 0..QK {
                        mag +=
                            (d * f32::from(v[j]) * dx * f32::from(x[b * XB + 2 + j] as i8)).abs();
                    }
                }
                assert!(
                    (got - want).abs() <= 1e-5 * mag,
                    "{ty:?} nb={nb}: {got} vs {want}"
                );
            }
        }
    }
}
