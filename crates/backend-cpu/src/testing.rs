//! Helpers for op tests of any backend against this one: the scalar reference backend and a
//! simple weight quantiser, the `quantize` function [`kapitsa_backend::testing::check_ops`]
//! takes.
//!
//! The quantiser is not llama.cpp's (no error search): per block it picks the plain min/max
//! (or absolute maximum) scale and rounds to nearest. It produces valid blocks whose values
//! follow the input, which is all an op comparison between backends needs.

use half::f16;
use kapitsa_backend::{BackendError, Result};
use kapitsa_base::{GgmlType, ThreadPool};
use kapitsa_kernels_cpu::SimdLevel;

use crate::CpuBackend;

/// The scalar reference backend (every op on its plain-loop twin) on `pool`.
pub fn reference(pool: Box<dyn ThreadPool + Send>) -> Result<CpuBackend> {
    CpuBackend::with_level(pool, SimdLevel::Scalar)
}

/// `x` (a multiple of `ty`'s block size long) as rows of `ty`: F32, F16, BF16, Q8_0, Q4_0,
/// Q5_0, Q4_K, Q5_K and Q6_K; [`BackendError::Unsupported`] for other types and a shape
/// error for a length of partial blocks.
pub fn quantize_weight(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    const OP: &str = "quantize_weight";
    let bs = ty.block_size();
    if !x.len().is_multiple_of(bs) {
        return Err(BackendError::Shape {
            op: OP,
            msg: format!("{} values are not whole {ty} blocks", x.len()),
        });
    }
    let block: fn(&[f32], &mut Vec<u8>) = match ty {
        GgmlType::F32 => |x, o| x.iter().for_each(|v| o.extend(v.to_le_bytes())),
        GgmlType::F16 => |x, o| x.iter().for_each(|v| o.extend(f16b(*v))),
        GgmlType::BF16 => |x, o| {
            x.iter()
                .for_each(|v| o.extend(half::bf16::from_f32(*v).to_le_bytes()))
        },
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
        _ => {
            return Err(BackendError::Unsupported {
                op: OP,
                what: format!("type {ty}"),
            })
        }
    };
    let mut out = Vec::with_capacity(x.len() / bs * ty.type_size());
    for b in x.chunks_exact(bs) {
        block(b, &mut out);
    }
    Ok(out)
}

/// Little-endian f16 bytes of `x`.
fn f16b(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

/// `x` as an f16 scale is stored, widened back.
fn h(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// `1 / d`, or 0 for a zero scale (every value then quantises to the zero code).
fn inv(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// `round(v)` clamped to `lo..=hi`.
fn q(v: f32, lo: i32, hi: i32) -> i32 {
    (v.round() as i32).clamp(lo, hi)
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

fn q8_0(x: &[f32], o: &mut Vec<u8>) {
    let d = h(amax(x) / 127.0);
    o.extend(f16b(d));
    o.extend(x.iter().map(|v| q(v * inv(d), -127, 127) as i8 as u8));
}

fn q4_0(x: &[f32], o: &mut Vec<u8>) {
    let d = h(amax(x) / 7.0);
    o.extend(f16b(d));
    let v: Vec<u8> = x.iter().map(|v| (q(v * inv(d), -8, 7) + 8) as u8).collect();
    o.extend((0..16).map(|j| v[j] | (v[j + 16] << 4)));
}

fn q5_0(x: &[f32], o: &mut Vec<u8>) {
    let d = h(amax(x) / 15.0);
    o.extend(f16b(d));
    let v: Vec<u8> = x
        .iter()
        .map(|v| (q(v * inv(d), -16, 15) + 16) as u8)
        .collect();
    let qh = v
        .iter()
        .enumerate()
        .fold(0u32, |a, (i, &c)| a | (u32::from(c >> 4) << i));
    o.extend(qh.to_le_bytes());
    o.extend((0..16).map(|j| (v[j] & 0xF) | ((v[j + 16] & 0xF) << 4)));
}

/// The scale/min header of a Q4_K / Q5_K super-block with `levels` codes per value: returns
/// the header bytes (d, dmin, 12 scale bytes) and each value's code.
fn k_scale_min(x: &[f32], levels: i32) -> (Vec<u8>, Vec<i32>) {
    let mut scale = [0f32; 8];
    let mut min = [0f32; 8];
    for (s, sub) in x.chunks_exact(32).enumerate() {
        let lo = sub.iter().fold(0f32, |m, &v| m.min(v));
        let hi = sub.iter().fold(lo, |m, &v| m.max(v));
        scale[s] = (hi - lo) / (levels - 1) as f32;
        min[s] = -lo;
    }
    let d = h(scale.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    let dmin = h(min.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    let sc: Vec<u8> = scale.iter().map(|&s| q(s * inv(d), 0, 63) as u8).collect();
    let mn: Vec<u8> = min.iter().map(|&m| q(m * inv(dmin), 0, 63) as u8).collect();
    let mut head = Vec::with_capacity(16);
    head.extend(f16b(d));
    head.extend(f16b(dmin));
    for j in 0..4 {
        head.push(sc[j] | ((sc[j + 4] >> 4) << 6));
    }
    for j in 0..4 {
        head.push(mn[j] | ((mn[j + 4] >> 4) << 6));
    }
    for j in 0..4 {
        head.push((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
    }
    let codes = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let (d1, m1) = (d * f32::from(sc[i / 32]), dmin * f32::from(mn[i / 32]));
            q((v + m1) * inv(d1), 0, levels - 1)
        })
        .collect();
    (head, codes)
}

fn q4_k(x: &[f32], o: &mut Vec<u8>) {
    let (head, v) = k_scale_min(x, 16);
    o.extend(head);
    for c in 0..4 {
        o.extend((0..32).map(|l| (v[c * 64 + l] | (v[c * 64 + 32 + l] << 4)) as u8));
    }
}

fn q5_k(x: &[f32], o: &mut Vec<u8>) {
    let (head, v) = k_scale_min(x, 32);
    o.extend(head);
    let mut qh = [0u8; 32];
    for c in 0..4 {
        for (l, b) in qh.iter_mut().enumerate() {
            *b |= (((v[c * 64 + l] >> 4) & 1) << (2 * c)) as u8;
            *b |= (((v[c * 64 + 32 + l] >> 4) & 1) << (2 * c + 1)) as u8;
        }
    }
    o.extend(qh);
    for c in 0..4 {
        o.extend(
            (0..32).map(|l| ((v[c * 64 + l] & 0xF) | ((v[c * 64 + 32 + l] & 0xF) << 4)) as u8),
        );
    }
}

fn q6_k(x: &[f32], o: &mut Vec<u8>) {
    let scale: Vec<f32> = x.chunks_exact(16).map(|s| amax(s) / 31.0).collect();
    let d = h(scale.iter().fold(0f32, |m, &v| m.max(v)) / 127.0);
    let sc: Vec<i8> = scale.iter().map(|&s| q(s * inv(d), 0, 127) as i8).collect();
    let v: Vec<u8> = x
        .iter()
        .enumerate()
        .map(|(i, &val)| (q(val * inv(d * f32::from(sc[i / 16])), -32, 31) + 32) as u8)
        .collect();
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for hf in 0..2 {
        let b = hf * 128;
        for l in 0..32 {
            let (v0, v1, v2, v3) = (v[b + l], v[b + l + 32], v[b + l + 64], v[b + l + 96]);
            ql[hf * 64 + l] = (v0 & 0xF) | ((v2 & 0xF) << 4);
            ql[hf * 64 + l + 32] = (v1 & 0xF) | ((v3 & 0xF) << 4);
            qh[hf * 32 + l] = (v0 >> 4) | ((v1 >> 4) << 2) | ((v2 >> 4) << 4) | ((v3 >> 4) << 6);
        }
    }
    o.extend(ql);
    o.extend(qh);
    o.extend(sc.iter().map(|&s| s as u8));
    o.extend(f16b(d));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type round-trips through the ggml dequantiser within its quantisation step.
    #[test]
    fn quantized_rows_dequantize_close_to_the_input() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i as f32 * 0.731).sin() * 2.0) + if i % 97 == 0 { 1.5 } else { 0.0 })
            .collect();
        let am = amax(&x);
        for (ty, tol) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 1e-3),
            (GgmlType::BF16, 1e-2),
            (GgmlType::Q8_0, 0.01),
            (GgmlType::Q4_0, 0.1),
            (GgmlType::Q5_0, 0.05),
            (GgmlType::Q4_K, 0.1),
            (GgmlType::Q5_K, 0.05),
            (GgmlType::Q6_K, 0.03),
        ] {
            let b = quantize_weight(ty, &x).unwrap();
            assert_eq!(b.len(), ty.row_bytes(x.len()).unwrap(), "{ty}");
            let mut y = vec![0f32; x.len()];
            kapitsa_kernels_cpu::dequantize_row(ty, &b, &mut y).unwrap();
            let err = x
                .iter()
                .zip(&y)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= tol * am, "{ty}: error {err} (amax {am})");
        }
        assert!(quantize_weight(GgmlType::Q4_K, &x[..32]).is_err());
        assert!(quantize_weight(GgmlType::Q2_K, &x).is_err());
    }
}
