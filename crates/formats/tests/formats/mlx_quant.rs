//! MLX affine dequantisation against a reference quantiser written here.

use kapitsa_formats::{mlx_dequantize, mlx_dequantize_rows, FormatError, GgmlType, TensorView};

/// Deterministic pseudo-random floats in [-1, 1).
fn lcg_floats(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// How scales/biases are stored.
#[derive(Clone, Copy)]
enum SbType {
    F32,
    F16,
    Bf16,
}

impl SbType {
    fn round(self, x: f32) -> f32 {
        match self {
            SbType::F32 => x,
            SbType::F16 => half::f16::from_f32(x).to_f32(),
            SbType::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }
    fn bytes(self, v: &[f32]) -> Vec<u8> {
        match self {
            SbType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            SbType::F16 => v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            SbType::Bf16 => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }
    fn dtype(self) -> GgmlType {
        match self {
            SbType::F32 => GgmlType::F32,
            SbType::F16 => GgmlType::F16,
            SbType::Bf16 => GgmlType::BF16,
        }
    }
}

struct Quantized {
    packed: Vec<u8>,
    scales: Vec<f32>,
    biases: Vec<f32>,
    /// Reference dequantised values s*q+b (with stored-precision s, b).
    expect: Vec<f32>,
}

/// MLX affine quantisation of a row-major [rows, cols] matrix, packed as a little-endian bit
/// stream per row into u32 words.
fn quantize(w: &[f32], rows: usize, cols: usize, bits: u32, gs: usize, sb: SbType) -> Quantized {
    let levels = ((1u32 << bits) - 1) as f32;
    let mut packed = Vec::new();
    let (mut scales, mut biases, mut expect) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rows {
        let row = &w[r * cols..(r + 1) * cols];
        let mut codes = Vec::with_capacity(cols);
        for g in row.chunks(gs) {
            let (lo, hi) = g
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            let s = sb.round(((hi - lo) / levels).max(1e-8));
            let b = sb.round(lo);
            scales.push(s);
            biases.push(b);
            for &x in g {
                let q = ((x - b) / s).round().clamp(0.0, levels) as u32;
                codes.push(q);
                expect.push(s * q as f32 + b);
            }
        }
        // Pack codes into a little-endian bit stream.
        let total_bits = cols * bits as usize;
        let mut bytes = vec![0u8; total_bits / 8];
        for (k, &q) in codes.iter().enumerate() {
            for bit in 0..bits as usize {
                if q >> bit & 1 == 1 {
                    let p = k * bits as usize + bit;
                    bytes[p / 8] |= 1 << (p % 8);
                }
            }
        }
        assert_eq!(bytes.len() % 4, 0);
        packed.extend(bytes);
    }
    Quantized {
        packed,
        scales,
        biases,
        expect,
    }
}

fn view<'a>(name: &'a str, dtype: GgmlType, shape: Vec<usize>, data: &'a [u8]) -> TensorView<'a> {
    TensorView {
        name,
        dtype,
        shape,
        data,
    }
}

#[test]
fn random_matrices_all_bits_and_groups() {
    let (rows, cols) = (5, 256);
    let w = lcg_floats(rows * cols, 42);
    for bits in [2u32, 3, 4, 5, 6, 8] {
        for gs in [32usize, 64, 128] {
            for sb in [SbType::F32, SbType::F16, SbType::Bf16] {
                let q = quantize(&w, rows, cols, bits, gs, sb);
                let packed_cols = cols * bits as usize / 32;
                let sbb = sb.bytes(&q.scales);
                let bbb = sb.bytes(&q.biases);
                let wt = view("w", GgmlType::I32, vec![rows, packed_cols], &q.packed);
                let st = view("s", sb.dtype(), vec![rows, cols / gs], &sbb);
                let bt = view("b", sb.dtype(), vec![rows, cols / gs], &bbb);
                let out = mlx_dequantize(&wt, &st, &bt, bits, gs).unwrap();
                assert_eq!(out.len(), rows * cols);
                for (i, (&o, &e)) in out.iter().zip(&q.expect).enumerate() {
                    assert!(
                        (o - e).abs() <= 1e-6 * e.abs().max(1.0),
                        "bits {bits} gs {gs} i {i}: {o} vs {e}"
                    );
                    // Half a step, plus what rounding s and b to f16/bf16 can add at the
                    // clamped ends of the range (<= levels * |ds| + |db| ~ one step).
                    let s = q.scales[i / gs];
                    let tol = 1.5 * s + 1e-2 * q.biases[i / gs].abs() + 1e-5;
                    assert!(
                        (o - w[i]).abs() <= tol,
                        "bits {bits} gs {gs} i {i}: {o} vs {}",
                        w[i]
                    );
                }
                if matches!(sb, SbType::F32) {
                    // With exact f32 scales the error is within half a step.
                    for (i, &o) in out.iter().enumerate() {
                        let s = q.scales[i / gs];
                        assert!(
                            (o - w[i]).abs() <= s * 0.5 + 1e-5,
                            "bits {bits} gs {gs} i {i}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn stacked_experts_and_row_ranges() {
    let (e, rows, cols, bits, gs) = (3usize, 4usize, 128usize, 4u32, 64usize);
    let w = lcg_floats(e * rows * cols, 7);
    let q = quantize(&w, e * rows, cols, bits, gs, SbType::F32);
    let sbb = SbType::F32.bytes(&q.scales);
    let bbb = SbType::F32.bytes(&q.biases);
    let wt = view("w", GgmlType::I32, vec![e, rows, cols * 4 / 32], &q.packed);
    let st = view("s", GgmlType::F32, vec![e, rows, cols / gs], &sbb);
    let bt = view("b", GgmlType::F32, vec![e, rows, cols / gs], &bbb);
    let all = mlx_dequantize(&wt, &st, &bt, bits, gs).unwrap();
    assert_eq!(all, q.expect);
    // Expert 2, rows 1..3.
    let mut part = vec![0.0f32; 2 * cols];
    mlx_dequantize_rows(&wt, &st, &bt, bits, gs, 2 * rows + 1, &mut part).unwrap();
    assert_eq!(part, all[(2 * rows + 1) * cols..(2 * rows + 3) * cols]);
    // Out-of-range rows and ragged buffers are errors.
    let mut too_many = vec![0.0f32; 2 * cols];
    assert!(mlx_dequantize_rows(&wt, &st, &bt, bits, gs, e * rows - 1, &mut too_many).is_err());
    let mut ragged = vec![0.0f32; cols + 1];
    assert!(mlx_dequantize_rows(&wt, &st, &bt, bits, gs, 0, &mut ragged).is_err());
}

#[test]
fn hand_worked_4bit_example() {
    // One row of 32 4-bit codes, group 32: codes k % 16, so the words are 0x76543210 and
    // 0xFEDCBA98 twice. scale 0.5, bias -1.0 => w_k = 0.5 * (k % 16) - 1.
    let words: [u32; 4] = [0x7654_3210, 0xFEDC_BA98, 0x7654_3210, 0xFEDC_BA98];
    let packed: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let s = half::f16::from_f32(0.5).to_le_bytes();
    let b = half::f16::from_f32(-1.0).to_le_bytes();
    let wt = view("w", GgmlType::I32, vec![1, 4], &packed);
    let st = view("s", GgmlType::F16, vec![1, 1], &s);
    let bt = view("b", GgmlType::F16, vec![1, 1], &b);
    let out = mlx_dequantize(&wt, &st, &bt, 4, 32).unwrap();
    assert_eq!(&out[..4], &[-1.0, -0.5, 0.0, 0.5]);
    assert_eq!(out[15], 6.5);
    assert_eq!(out[16], -1.0);
    assert_eq!(out[31], 6.5);
}

#[test]
fn hand_worked_8bit_example() {
    // 8-bit: word 0x04030201 holds codes 1, 2, 3, 4. Group 32 => 8 words per row.
    let mut words = [0u32; 8];
    words[0] = 0x0403_0201;
    words[7] = 0xFF00_0000;
    let packed: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let s = 2.0f32.to_le_bytes();
    let b = 0.5f32.to_le_bytes();
    let wt = view("w", GgmlType::I32, vec![1, 8], &packed);
    let st = view("s", GgmlType::F32, vec![1, 1], &s);
    let bt = view("b", GgmlType::F32, vec![1, 1], &b);
    let out = mlx_dequantize(&wt, &st, &bt, 8, 32).unwrap();
    assert_eq!(&out[..5], &[2.5, 4.5, 6.5, 8.5, 0.5]);
    assert_eq!(out[31], 2.0 * 255.0 + 0.5);
}

#[test]
fn rejects_bad_parameters_and_shapes() {
    let packed = vec![0u8; 16];
    let sb = vec![0u8; 4];
    let wt = view("w", GgmlType::I32, vec![1, 4], &packed);
    let st = view("s", GgmlType::F32, vec![1, 1], &sb);
    let bt = view("b", GgmlType::F32, vec![1, 1], &sb);
    assert!(mlx_dequantize(&wt, &st, &bt, 4, 32).is_ok());
    for bits in [0u32, 1, 7, 16] {
        let e = mlx_dequantize(&wt, &st, &bt, bits, 32).unwrap_err();
        assert!(matches!(e, FormatError::UnsupportedQuant(_)), "{e}");
        assert!(e.to_string().contains("bits"));
    }
    for gs in [0usize, 16, 48, 256] {
        assert!(matches!(
            mlx_dequantize(&wt, &st, &bt, 4, gs),
            Err(FormatError::UnsupportedQuant(_))
        ));
    }
    // Wrong scales shape (group 64 needs 64 inputs, row has 32).
    assert!(matches!(
        mlx_dequantize(&wt, &st, &bt, 4, 64),
        Err(FormatError::Shape(_))
    ));
    // Wrong weight dtype, wrong data length, rank 1, mismatched bias dtype.
    let wf = view("w", GgmlType::F32, vec![1, 4], &packed);
    assert!(mlx_dequantize(&wf, &st, &bt, 4, 32).is_err());
    let short = view("w", GgmlType::I32, vec![1, 4], &packed[..12]);
    assert!(mlx_dequantize(&short, &st, &bt, 4, 32).is_err());
    let r1 = view("w", GgmlType::I32, vec![4], &packed);
    assert!(mlx_dequantize(&r1, &st, &bt, 4, 32).is_err());
    let sb16 = vec![0u8; 2];
    let b16 = view("b", GgmlType::F16, vec![1, 1], &sb16);
    assert!(mlx_dequantize(&wt, &st, &b16, 4, 32).is_err());
    let si = view("s", GgmlType::I32, vec![1, 1], &sb);
    assert!(mlx_dequantize(&wt, &si, &si, 4, 32).is_err());
}
