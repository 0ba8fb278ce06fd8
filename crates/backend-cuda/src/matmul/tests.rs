//! Unit tests of the matmul module that need no GPU: a Rust mirror of `quant.cuh` over the
//! repacked device layouts, checked against the CPU's scalar dequantisation.

use super::*;
use kapitsa_backend::{Backend, BatchDesc, DType, HostBytes, SeqDesc};
use kapitsa_base::pool::SerialPool;

/// xorshift64*: deterministic test values.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn sym(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

const TYPES: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q4_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Random rows quantised with the CPU backend's test quantiser, and their exact
/// dequantisation by the scalar CPU backend (its embedding gather).
fn rows(ty: GgmlType, n_rows: usize, n_in: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let mut rng = Rng(seed | 1);
    let vals: Vec<f32> = (0..n_rows * n_in).map(|_| rng.sym()).collect();
    let bytes = kapitsa_backend_cpu::testing::quantize_weight(ty, &vals).expect("quantise");
    let cpu = kapitsa_backend_cpu::testing::reference(Box::new(SerialPool)).expect("cpu");
    let hw = HostWeight {
        name: "w".into(),
        dtype: ty,
        shape: vec![n_rows, n_in],
        bytes: HostBytes::from_vec(bytes.clone()),
    };
    let w = cpu.upload_weight(&hw).expect("upload");
    let n = n_rows;
    let batch = cpu
        .prepare_batch(BatchDesc {
            tokens: (0..n as u32).collect(),
            positions: (0..n as u32).collect(),
            seqs: vec![SeqDesc {
                slot: 0,
                start: 0,
                len: n,
                pos0: 0,
                table_start: 0,
                table_len: 0,
            }],
            ..Default::default()
        })
        .expect("batch");
    let mut out = cpu.alloc(DType::F32, n * n_in).expect("alloc");
    cpu.embed(&w, &batch, &mut out).expect("embed");
    let mut deq = vec![0.0f32; n * n_in];
    cpu.read_f32(&out, 0, &mut deq).expect("read");
    (bytes, deq)
}

// ---- the mirror of kernels/quant.cuh --------------------------------------------------

struct Img<'a> {
    img: &'a [u8],
    off: [u64; 3],
    stride: u64,
}

fn ld4(m: &Img<'_>, p: u64) -> u32 {
    let p = p as usize;
    u32::from_le_bytes([m.img[p], m.img[p + 1], m.img[p + 2], m.img[p + 3]])
}
fn ld16(m: &Img<'_>, p: u64) -> [u32; 4] {
    assert_eq!(p % 16, 0, "16-byte load at {p}");
    [ld4(m, p), ld4(m, p + 4), ld4(m, p + 8), ld4(m, p + 12)]
}
fn ld8(m: &Img<'_>, p: u64) -> [u32; 2] {
    assert_eq!(p % 8, 0, "8-byte load at {p}");
    [ld4(m, p), ld4(m, p + 4)]
}
fn ld2(m: &Img<'_>, p: u64) -> u32 {
    assert_eq!(p % 2, 0);
    u32::from(u16::from_le_bytes([
        m.img[p as usize],
        m.img[p as usize + 1],
    ]))
}
fn h2f(b: u32) -> f32 {
    half::f16::from_bits((b & 0xFFFF) as u16).to_f32()
}
fn ubyte(w: u32, k: usize) -> u32 {
    (w >> (8 * k)) & 0xFF
}
fn sbyte(w: u32, k: usize) -> i32 {
    ((w << (24 - 8 * k)) as i32) >> 24
}
/// __byte_perm(w, 0x3F000000, 0x7044 | k << 8)
fn bias_f(w: u32, k: usize) -> f32 {
    f32::from_bits(0x3F00_0000 | (ubyte(w, k) << 16))
}
/// __byte_perm(w, 0x4B000000, 0x7440 | k)
fn magic_f(w: u32, k: usize) -> f32 {
    f32::from_bits(0x4B00_0000 | ubyte(w, k))
}
fn spread4(nib: u32) -> u32 {
    nib.wrapping_mul(0x0020_4081) & 0x0101_0101
}
fn word8(lo: [u32; 4], hi: [u32; 4], g: usize) -> u32 {
    if g >= 4 {
        hi[g & 3]
    } else {
        lo[g & 3]
    }
}
fn scale_min_k4(s0: u32, s1: u32, s2: u32, js: usize) -> (u32, u32) {
    let k = js & 3;
    let (b0, b1, b2) = (ubyte(s0, k), ubyte(s1, k), ubyte(s2, k));
    if js < 4 {
        (b0 & 63, b1 & 63)
    } else {
        ((b2 & 15) | ((b0 >> 6) << 4), (b2 >> 4) | ((b1 >> 6) << 4))
    }
}

#[derive(Default, Clone, Copy)]
struct Raw {
    q0: [u32; 4],
    q1: [u32; 4],
    h: [u32; 4],
    qh0: [u32; 4],
    qh1: [u32; 4],
    sc: [u32; 2],
    qh: u32,
    d: u32,
}

fn nseg(f: Fmt) -> usize {
    match f {
        Fmt::Q4_0 | Fmt::Q5_0 | Fmt::Q4K | Fmt::Q5K => 2,
        Fmt::Q6K => 4,
        _ => 1,
    }
}

fn emu_load(f: Fmt, m: &Img<'_>, row: u64, j: usize) -> Raw {
    let j64 = j as u64;
    let mut r = Raw::default();
    match f {
        Fmt::F32 | Fmt::F16 | Fmt::Bf16 => r.q0 = ld16(m, row * m.stride + j64 * 16),
        Fmt::Q8_0 => {
            let blk = row * m.stride + (j64 >> 1);
            r.q0 = ld16(m, blk * 32 + (j64 & 1) * 16);
            r.d = ld2(m, m.off[0] + blk * 2);
        }
        Fmt::Q4_0 => {
            let blk = row * m.stride + j64;
            r.q0 = ld16(m, blk * 16);
            r.d = ld2(m, m.off[0] + blk * 2);
        }
        Fmt::Q5_0 => {
            let blk = row * m.stride + j64;
            r.q0 = ld16(m, blk * 16);
            r.qh = ld4(m, m.off[0] + blk * 4);
            r.d = ld2(m, m.off[1] + blk * 2);
        }
        Fmt::Q4K => {
            let blk = row * m.stride + (j64 >> 2) * 144;
            r.h = ld16(m, blk);
            r.q0 = ld16(m, blk + 16 + (j64 & 3) * 32);
            r.q1 = ld16(m, blk + 32 + (j64 & 3) * 32);
        }
        Fmt::Q5K => {
            let blk = row * m.stride + (j64 >> 2) * 176;
            r.h = ld16(m, blk);
            r.qh0 = ld16(m, blk + 16);
            r.qh1 = ld16(m, blk + 32);
            r.q0 = ld16(m, blk + 48 + (j64 & 3) * 32);
            r.q1 = ld16(m, blk + 64 + (j64 & 3) * 32);
        }
        Fmt::Q6K => {
            let blk = row * m.stride + (j64 >> 2);
            let (half, lh) = ((j64 >> 1) & 1, j64 & 1);
            let ql = blk * 128 + half * 64 + lh * 16;
            r.q0 = ld16(m, ql);
            r.q1 = ld16(m, ql + 32);
            r.qh0 = ld16(m, m.off[0] + blk * 64 + half * 32 + lh * 16);
            r.sc = ld8(m, m.off[1] + blk * 16 + half * 8);
            r.d = ld2(m, m.off[2] + blk * 2);
        }
    }
    r
}

fn emu_seg_elem(f: Fmt, j: usize, s: usize) -> usize {
    match f {
        Fmt::F32 => 4 * j,
        Fmt::F16 | Fmt::Bf16 => 8 * j,
        Fmt::Q8_0 => 16 * j,
        Fmt::Q4_0 | Fmt::Q5_0 => 32 * j + 16 * s,
        Fmt::Q4K | Fmt::Q5K => (j >> 2) * 256 + (j & 3) * 64 + s * 32,
        Fmt::Q6K => (j >> 2) * 256 + ((j >> 1) & 1) * 128 + 32 * s + (j & 1) * 16,
    }
}

/// Left shift of the values in the bytes of `emu_val4` (quant.cuh's biased-float trick).
fn val_shift(f: Fmt) -> u32 {
    match f {
        Fmt::Q4_0 | Fmt::Q4K => 3,
        Fmt::Q5_0 | Fmt::Q5K => 2,
        _ => 1,
    }
}

/// The byte-per-element values (val4) of the affine formats, shifted by `val_shift`.
fn emu_val4(f: Fmt, r: &Raw, j: usize, s: usize, g: usize) -> u32 {
    match f {
        Fmt::Q4_0 => {
            let w = r.q0[g];
            (if s == 0 { w << 3 } else { w >> 1 }) & 0x7878_7878
        }
        Fmt::Q5_0 => {
            let w = r.q0[g];
            let lo = (if s == 0 { w << 2 } else { w >> 2 }) & 0x3C3C_3C3C;
            lo | (spread4((r.qh >> (16 * s + 4 * g)) & 0xF) << 6)
        }
        Fmt::Q4K => {
            let w = word8(r.q0, r.q1, g);
            (if s == 0 { w << 3 } else { w >> 1 }) & 0x7878_7878
        }
        Fmt::Q5K => {
            let (w, hb) = (word8(r.q0, r.q1, g), word8(r.qh0, r.qh1, g));
            let bit = (j & 3) * 2 + s;
            let lo = (if s == 0 { w << 2 } else { w >> 2 }) & 0x3C3C_3C3C;
            lo | (((hb >> bit) & 0x0101_0101) << 6)
        }
        Fmt::Q6K => {
            let (q0, q1, hb) = (r.q0[g], r.q1[g], r.qh0[g]);
            match s {
                0 => ((q0 << 1) & 0x1E1E_1E1E) | ((hb << 5) & 0x6060_6060),
                1 => ((q1 << 1) & 0x1E1E_1E1E) | ((hb << 3) & 0x6060_6060),
                2 => ((q0 >> 3) & 0x1E1E_1E1E) | ((hb << 1) & 0x6060_6060),
                _ => ((q1 >> 3) & 0x1E1E_1E1E) | ((hb >> 1) & 0x6060_6060),
            }
        }
        _ => unreachable!("not an affine format"),
    }
}

/// dec4 (the GEMV's decoded floats).
fn emu_dec4(f: Fmt, r: &Raw, j: usize, s: usize, g: usize) -> [f32; 4] {
    match f {
        Fmt::F32 => r.q0.map(f32::from_bits),
        Fmt::F16 | Fmt::Bf16 => {
            let (w0, w1) = if g == 0 {
                (r.q0[0], r.q0[1])
            } else {
                (r.q0[2], r.q0[3])
            };
            if f == Fmt::F16 {
                [h2f(w0), h2f(w0 >> 16), h2f(w1), h2f(w1 >> 16)]
            } else {
                [w0 << 16, w0 & 0xFFFF_0000, w1 << 16, w1 & 0xFFFF_0000].map(f32::from_bits)
            }
        }
        Fmt::Q8_0 => {
            let u = r.q0[g] ^ 0x8080_8080;
            std::array::from_fn(|i| magic_f(u, i) - 8_388_736.0)
        }
        _ => {
            let v = emu_val4(f, r, j, s, g);
            std::array::from_fn(|i| bias_f(v, i))
        }
    }
}

/// (d1, m1) of the K formats' segment.
fn emu_scale_min(r: &Raw, j: usize, s: usize) -> (f32, f32) {
    let (sc, mn) = scale_min_k4(r.h[1], r.h[2], r.h[3], (j & 3) * 2 + s);
    (h2f(r.h[0]) * sc as f32, h2f(r.h[0] >> 16) * mn as f32)
}

fn emu_q6_dl(r: &Raw, j: usize, s: usize) -> f32 {
    let sc = sbyte(if s < 2 { r.sc[0] } else { r.sc[1] }, (j & 1) + 2 * (s & 1));
    h2f(r.d) * sc as f32
}

/// (A, B) of an affine segment, or (scale, 0).
fn emu_affine(f: Fmt, r: &Raw, j: usize, s: usize) -> (f32, f32) {
    match f {
        Fmt::F32 | Fmt::F16 | Fmt::Bf16 => (1.0, 0.0),
        Fmt::Q8_0 => (h2f(r.d), 0.0),
        Fmt::Q4_0 => (32.0 * h2f(r.d), 24.0 * h2f(r.d)),
        Fmt::Q5_0 => (64.0 * h2f(r.d), 48.0 * h2f(r.d)),
        Fmt::Q4K => {
            let (d1, m1) = emu_scale_min(r, j, s);
            (32.0 * d1, 16.0 * d1 + m1)
        }
        Fmt::Q5K => {
            let (d1, m1) = emu_scale_min(r, j, s);
            (64.0 * d1, 32.0 * d1 + m1)
        }
        Fmt::Q6K => {
            let dl = emu_q6_dl(r, j, s);
            (128.0 * dl, 96.0 * dl)
        }
    }
}

fn emu_exact4(f: Fmt, r: &Raw, j: usize, s: usize, g: usize) -> [f32; 4] {
    let ubyte = |w: u32, i: usize| ubyte(w, i) >> val_shift(f);
    match f {
        Fmt::F32 | Fmt::F16 | Fmt::Bf16 => emu_dec4(f, r, j, s, g),
        Fmt::Q8_0 => std::array::from_fn(|i| sbyte(r.q0[g], i) as f32 * h2f(r.d)),
        Fmt::Q4_0 => {
            let v = emu_val4(f, r, j, s, g);
            std::array::from_fn(|i| (ubyte(v, i) as i32 - 8) as f32 * h2f(r.d))
        }
        Fmt::Q5_0 => {
            let v = emu_val4(f, r, j, s, g);
            std::array::from_fn(|i| (ubyte(v, i) as i32 - 16) as f32 * h2f(r.d))
        }
        Fmt::Q4K | Fmt::Q5K => {
            let (d1, m1) = emu_scale_min(r, j, s);
            let v = emu_val4(f, r, j, s, g);
            std::array::from_fn(|i| d1 * ubyte(v, i) as f32 - m1)
        }
        Fmt::Q6K => {
            let dl = emu_q6_dl(r, j, s);
            let v = emu_val4(f, r, j, s, g);
            std::array::from_fn(|i| dl * (ubyte(v, i) as i32 - 32) as f32)
        }
    }
}

fn seglen(f: Fmt) -> usize {
    f.chunk() / nseg(f)
}

/// Every element of the image, in row order, through the exact decoder.
fn emu_dequant(f: Fmt, m: &Img<'_>, n_rows: usize, n_in: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n_rows * n_in];
    for r in 0..n_rows {
        for j in 0..n_in / f.chunk() {
            let raw = emu_load(f, m, r as u64, j);
            for s in 0..nseg(f) {
                for g in 0..seglen(f) / 4 {
                    let e = emu_seg_elem(f, j, s) + 4 * g;
                    out[r * n_in + e..r * n_in + e + 4]
                        .copy_from_slice(&emu_exact4(f, &raw, j, s, g));
                }
            }
        }
    }
    out
}

/// One row's GEMV result the kernel's way (f32 partial sums per segment, as the few-token
/// scheme computes them).
fn emu_gemv_row(f: Fmt, m: &Img<'_>, row: usize, x: &[f32], n_in: usize) -> f32 {
    let mut acc = 0.0f32;
    for j in 0..n_in / f.chunk() {
        let raw = emu_load(f, m, row as u64, j);
        for s in 0..nseg(f) {
            let e0 = emu_seg_elem(f, j, s);
            let (mut sf, mut sx) = (0.0f32, 0.0f32);
            for g in 0..seglen(f) / 4 {
                let d = emu_dec4(f, &raw, j, s, g);
                let xv = &x[e0 + 4 * g..e0 + 4 * g + 4];
                sx += (xv[0] + xv[1]) + (xv[2] + xv[3]);
                for i in 0..4 {
                    sf = d[i].mul_add(xv[i], sf);
                }
            }
            let (a, b) = emu_affine(f, &raw, j, s);
            acc = a.mul_add(sf, (-b).mul_add(sx, acc));
        }
    }
    acc
}

fn image_of(ty: GgmlType, bytes: &[u8], n_rows: usize, n_in: usize) -> (Vec<u8>, [u64; 3], u64) {
    let f = Fmt::of(ty).expect("supported");
    let (img, off, stride) = device_image(f, ty, bytes, n_rows, n_in);
    (img.into_owned(), off, stride)
}

#[test]
fn planar_images_keep_every_byte() {
    for ty in TYPES {
        let f = Fmt::of(ty).expect("supported");
        let (n_rows, n_in) = (3, 512);
        let rb = ty.row_bytes(n_in).expect("whole blocks");
        let bytes: Vec<u8> = (0..n_rows * rb).map(|i| (i * 7 + 3) as u8).collect();
        let (img, off, stride) = image_of(ty, &bytes, n_rows, n_in);
        match f.planes() {
            None => {
                assert_eq!(img, bytes, "{ty}");
                assert_eq!(stride as usize, rb);
            }
            Some(planes) => {
                assert_eq!(stride as usize, n_in / ty.block_size());
                let starts = [0, off[0], off[1], off[2]];
                let total: usize = planes.iter().map(|p| p.1).sum();
                assert_eq!(total, ty.type_size(), "{ty}: planes cover the block");
                for (b, blk) in bytes.chunks_exact(ty.type_size()).enumerate() {
                    for (p, &(src, len)) in planes.iter().enumerate() {
                        assert_eq!(starts[p] % 256, 0);
                        let d = starts[p] as usize + b * len;
                        assert_eq!(
                            &img[d..d + len],
                            &blk[src..src + len],
                            "{ty} block {b} plane {p}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn exact_decoder_matches_dequantize_row() {
    for ty in TYPES {
        let f = Fmt::of(ty).expect("supported");
        let (n_rows, n_in) = (5, 768);
        let (bytes, want) = rows(ty, n_rows, n_in, 0x5EED ^ ty as u64);
        let (img, off, stride) = image_of(ty, &bytes, n_rows, n_in);
        let m = Img {
            img: &img,
            off,
            stride,
        };
        let got = emu_dequant(f, &m, n_rows, n_in);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{ty} element {i}: {a} vs {b}");
        }
    }
}

#[test]
fn gemv_decoder_matches_f64_dot() {
    for ty in TYPES {
        let f = Fmt::of(ty).expect("supported");
        let (n_rows, n_in) = (7, 1024);
        let (bytes, deq) = rows(ty, n_rows, n_in, 0xD07 ^ ty as u64);
        let (img, off, stride) = image_of(ty, &bytes, n_rows, n_in);
        let m = Img {
            img: &img,
            off,
            stride,
        };
        let mut rng = Rng(0xABCD ^ ty as u64);
        // activations with a nonzero mean, the hard case for the sum(x) correction
        let x: Vec<f32> = (0..n_in).map(|_| 0.3 + rng.sym()).collect();
        let mut max_err = 0.0f64;
        let mut max_ref = 0.0f64;
        for r in 0..n_rows {
            let want: f64 = (0..n_in)
                .map(|k| f64::from(deq[r * n_in + k]) * f64::from(x[k]))
                .sum();
            let got = f64::from(emu_gemv_row(f, &m, r, &x, n_in));
            max_err = max_err.max((got - want).abs());
            max_ref = max_ref.max(want.abs());
        }
        let rel = max_err / max_ref;
        println!("{ty}: max rel err of the GEMV decoding {rel:.2e}");
        // the biased-float trick cancels 2^(7-S) sum(x) against 2^(8-S) sum(f x): with x
        // of mean 0.3 that costs a bit or two of f32, far below the weights' own
        // quantisation error (~1e-2)
        assert!(rel < 5e-6, "{ty}: {rel:e}");
    }
}

#[test]
fn ksplit_stays_in_range() {
    for (groups, chunks) in [
        (1, 1),
        (1, 1000),
        (37984, 24),
        (384, 140),
        (64, 32),
        (2240, 24),
    ] {
        let g = gemv::ksplit(groups, chunks, 132, 16, GEMV_WARPS);
        assert!([1, 2, 4].contains(&g), "{groups} {chunks}: {g}");
        assert!(g == 1 || chunks >= 32 * g, "{groups} {chunks}: {g}");
    }
    assert_eq!(gemv::ksplit(37984, 24, 132, 16, GEMV_WARPS), 1);
    assert_eq!(gemv::ksplit(384, 140, 132, 16, GEMV_WARPS), 4);
    // the gate/up pair takes half the warps per matrix: at most 2
    assert_eq!(gemv::ksplit(384, 140, 132, 16, 2), 2);
}
