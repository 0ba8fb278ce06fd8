//! Hand-derived vectors: blocks packed by hand from the block definitions (ggml-common.h,
//! architectures.md §4.4), with the expected values written from the format description,
//! independent of the library's unpacking code.

#![allow(clippy::needless_range_loop)]

use kapitsa_base::GgmlType;
use kapitsa_kernels_cpu::{dequantize_row, quantize_row, vec_dot_with, SimdLevel};

const IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

fn h(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

fn deq(ty: GgmlType, b: &[u8]) -> Vec<f32> {
    let n = b.len() / ty.type_size() * ty.block_size();
    let mut y = vec![0f32; n];
    dequantize_row(ty, b, &mut y).expect("dequantize");
    y
}

#[test]
fn q4_0_by_hand() {
    // d = 0.5; byte j = j (low nibble) | (15 - j) << 4
    let mut b = h(0.5).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = deq(GgmlType::Q4_0, &b);
    for j in 0..16 {
        assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(y[j + 16], (7.0 - j as f32) * 0.5);
    }
}

#[test]
fn q4_1_by_hand() {
    let mut b = h(0.25).to_vec();
    b.extend(h(-1.0));
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = deq(GgmlType::Q4_1, &b);
    for j in 0..16 {
        assert_eq!(y[j], j as f32 * 0.25 - 1.0);
        assert_eq!(y[j + 16], (15 - j) as f32 * 0.25 - 1.0);
    }
}

#[test]
fn q5_0_and_q5_1_by_hand() {
    // 5th bit of element i is bit i of qh; choose qh = 0xA5A5_0F0F.
    let qh: u32 = 0xA5A5_0F0F;
    let nib = |j: usize| (j as u8 * 7) & 15;
    let qs: Vec<u8> = (0..16).map(|j| nib(j) | (nib(j + 16) << 4)).collect();
    let val = |i: usize| i32::from(nib(i)) + 16 * ((qh >> i) & 1) as i32;
    let mut b0 = h(2.0).to_vec();
    b0.extend(qh.to_le_bytes());
    b0.extend(&qs);
    let y = deq(GgmlType::Q5_0, &b0);
    for i in 0..32 {
        assert_eq!(y[i], (val(i) - 16) as f32 * 2.0, "q5_0 {i}");
    }
    let mut b1 = h(0.5).to_vec();
    b1.extend(h(3.0));
    b1.extend(qh.to_le_bytes());
    b1.extend(&qs);
    let y = deq(GgmlType::Q5_1, &b1);
    for i in 0..32 {
        assert_eq!(y[i], val(i) as f32 * 0.5 + 3.0, "q5_1 {i}");
    }
}

#[test]
fn q8_0_iq4_nl_mxfp4_by_hand() {
    let mut b = h(2.0).to_vec();
    b.extend((0..32).map(|j| (j as i8 - 16) as u8));
    let y = deq(GgmlType::Q8_0, &b);
    (0..32).for_each(|j| assert_eq!(y[j], 2.0 * (j as f32 - 16.0)));

    let mut b = h(0.5).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = deq(GgmlType::IQ4_NL, &b);
    for j in 0..16 {
        assert_eq!(y[j], 0.5 * f32::from(IQ4NL[j]));
        assert_eq!(y[j + 16], 0.5 * f32::from(IQ4NL[15 - j]));
    }

    // MXFP4: E2M1 codes 0..15 = +-{0, .5, 1, 1.5, 2, 3, 4, 6}; E8M0 scale 2^(e - 127).
    let e2m1 = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for (e, scale) in [(127u8, 1.0f32), (130, 8.0), (120, 1.0 / 128.0)] {
        let mut b = vec![e];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(GgmlType::MXFP4, &b);
        let fp4 = |c: usize| if c < 8 { e2m1[c] } else { -e2m1[c - 8] };
        for j in 0..16 {
            assert_eq!(y[j], fp4(j) * scale, "mxfp4 e={e} {j}");
            assert_eq!(y[j + 16], fp4(15 - j) * scale, "mxfp4 e={e} {}", j + 16);
        }
    }
}

/// Packs 8 six-bit scales and mins the Q4_K/Q5_K way.
fn pack_k4(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
    }
    s
}

const SC: [u8; 8] = [1, 2, 3, 63, 17, 33, 50, 63];
const MN: [u8; 8] = [0, 5, 9, 62, 16, 20, 40, 63];

#[test]
fn q4_k_by_hand() {
    let (d, dmin) = (0.5f32, 0.25f32);
    let q = |e: usize| ((e * 5 + e / 7) % 16) as u8; // 4-bit value of element e
    let mut b = h(d).to_vec();
    b.extend(h(dmin));
    b.extend(pack_k4(SC, MN));
    // chunk c (64 elements) = 32 bytes: low nibble -> element 64c + l, high -> 64c + 32 + l
    for c in 0..4 {
        b.extend((0..32).map(|l| q(64 * c + l) | (q(64 * c + 32 + l) << 4)));
    }
    assert_eq!(b.len(), 144);
    let y = deq(GgmlType::Q4_K, &b);
    for e in 0..256 {
        let sb = e / 32;
        let want = (d * f32::from(SC[sb])) * f32::from(q(e)) - dmin * f32::from(MN[sb]);
        assert_eq!(y[e], want, "q4_K {e}");
    }
}

#[test]
fn q5_k_by_hand() {
    let (d, dmin) = (0.125f32, 1.5f32);
    let q = |e: usize| ((e * 11 + 3) % 32) as u8; // 5-bit value
    let mut b = h(d).to_vec();
    b.extend(h(dmin));
    b.extend(pack_k4(SC, MN));
    // qh[l] bit s = 5th bit of element 32s + l
    b.extend((0..32).map(|l| (0..8).fold(0u8, |acc, s| acc | ((q(32 * s + l) >> 4) << s))));
    for c in 0..4 {
        b.extend((0..32).map(|l| (q(64 * c + l) & 15) | ((q(64 * c + 32 + l) & 15) << 4)));
    }
    assert_eq!(b.len(), 176);
    let y = deq(GgmlType::Q5_K, &b);
    for e in 0..256 {
        let sb = e / 32;
        let want = (d * f32::from(SC[sb])) * f32::from(q(e)) - dmin * f32::from(MN[sb]);
        assert_eq!(y[e], want, "q5_K {e}");
    }
}

#[test]
fn q6_k_by_hand() {
    let d = 0.5f32;
    let q = |e: usize| ((e * 13 + 5) % 64) as u8; // stored 6-bit value; weight = q - 32
    let sc: [i8; 16] = std::array::from_fn(|g| (g as i32 * 9 - 70) as i8);
    // per 128-element half: ql[l] = lo4(e=l) | lo4(e=l+64) << 4, ql[l+32] = lo4(l+32) | lo4(l+96) << 4,
    // qh[l] = hi2(l) | hi2(l+32) << 2 | hi2(l+64) << 4 | hi2(l+96) << 6
    let mut ql = vec![0u8; 128];
    let mut qh = vec![0u8; 64];
    for half in 0..2 {
        let e0 = 128 * half;
        for l in 0..32 {
            ql[64 * half + l] = (q(e0 + l) & 15) | ((q(e0 + l + 64) & 15) << 4);
            ql[64 * half + l + 32] = (q(e0 + l + 32) & 15) | ((q(e0 + l + 96) & 15) << 4);
            qh[32 * half + l] = (q(e0 + l) >> 4)
                | ((q(e0 + l + 32) >> 4) << 2)
                | ((q(e0 + l + 64) >> 4) << 4)
                | ((q(e0 + l + 96) >> 4) << 6);
        }
    }
    let mut b = ql;
    b.extend(qh);
    b.extend(sc.iter().map(|&s| s as u8));
    b.extend(h(d));
    assert_eq!(b.len(), 210);
    let y = deq(GgmlType::Q6_K, &b);
    for e in 0..256 {
        let want = (d * f32::from(sc[e / 16])) * (i32::from(q(e)) - 32) as f32;
        assert_eq!(y[e], want, "q6_K {e}");
    }
}

#[test]
fn iq4_xs_by_hand() {
    let d = 0.25f32;
    let ls: [u8; 8] = [0, 5, 31, 32, 33, 47, 60, 63]; // 6-bit scales; weight scale = ls - 32
    let scales_h: u16 = (0..8).fold(0, |acc, ib| acc | (u16::from(ls[ib] >> 4) << (2 * ib)));
    let scales_l: Vec<u8> = (0..4)
        .map(|k| (ls[2 * k] & 15) | ((ls[2 * k + 1] & 15) << 4))
        .collect();
    let q = |e: usize| ((e * 3 + e / 32) % 16) as u8;
    let mut b = h(d).to_vec();
    b.extend(scales_h.to_le_bytes());
    b.extend(&scales_l);
    for ib in 0..8 {
        b.extend((0..16).map(|j| q(32 * ib + j) | (q(32 * ib + 16 + j) << 4)));
    }
    assert_eq!(b.len(), 136);
    let y = deq(GgmlType::IQ4_XS, &b);
    for e in 0..256 {
        let dl = d * (i32::from(ls[e / 32]) - 32) as f32;
        assert_eq!(y[e], dl * f32::from(IQ4NL[usize::from(q(e))]), "iq4_xs {e}");
    }
}

#[test]
fn q2_k_by_hand() {
    // scales[16]: low nibble scale, high nibble min, for 16-element groups; qs[64]: element
    // 128h + 32s + 16p + l is bits 2s..2s+2 of qs[32h + 16p + l].
    let (d, dmin) = (0.5f32, 0.125f32);
    let sc: [u8; 16] = std::array::from_fn(|g| ((g as u8 * 3) % 16) | ((15 - g as u8) << 4));
    let q = |e: usize| ((e * 7 + e / 16) % 4) as u8;
    let mut qs = [0u8; 64];
    for e in 0..256 {
        let (hh, s, rest) = (e / 128, (e % 128) / 32, e % 32);
        qs[32 * hh + rest] |= q(e) << (2 * s);
    }
    let mut b = sc.to_vec();
    b.extend(qs);
    b.extend(h(d));
    b.extend(h(dmin));
    let y = deq(GgmlType::Q2_K, &b);
    for e in 0..256 {
        let g = e / 16;
        let want = (d * f32::from(sc[g] & 15)) * f32::from(q(e)) - dmin * f32::from(sc[g] >> 4);
        assert_eq!(y[e], want, "q2_K {e}");
    }
}

#[test]
fn q3_k_by_hand() {
    // value = 2 low bits (as Q2_K) minus 4 unless hmask bit set; hmask[l] bit (4h + s) is for
    // element 128h + 32s + l. 16 six-bit scales (minus 32): low 4 bits in nibbles of bytes
    // 0..8 (scales 0..8 low nibbles, 8..16 high nibbles), top 2 bits in bytes 8..12.
    let d = 0.25f32;
    let sc6: [u8; 16] = std::array::from_fn(|g| (g as u8 * 13 + 1) % 64);
    let mut scales = [0u8; 12];
    for g in 0..16 {
        if g < 8 {
            scales[g] |= sc6[g] & 15;
        } else {
            scales[g - 8] |= (sc6[g] & 15) << 4;
        }
        scales[8 + g % 4] |= (sc6[g] >> 4) << (2 * (g / 4));
    }
    let lo = |e: usize| ((e * 5 + 1) % 4) as u8;
    let hb = |e: usize| (e * 3 / 7) % 2 == 1;
    let mut qs = [0u8; 64];
    let mut hm = [0u8; 32];
    for e in 0..256 {
        let (hh, s, rest) = (e / 128, (e % 128) / 32, e % 32);
        qs[32 * hh + rest] |= lo(e) << (2 * s);
        if hb(e) {
            hm[rest] |= 1 << (4 * hh + s);
        }
    }
    let mut b = hm.to_vec();
    b.extend(qs);
    b.extend(scales);
    b.extend(h(d));
    let y = deq(GgmlType::Q3_K, &b);
    for e in 0..256 {
        let v = i32::from(lo(e)) - if hb(e) { 0 } else { 4 };
        let want = (d * (i32::from(sc6[e / 16]) - 32) as f32) * v as f32;
        assert_eq!(y[e], want, "q3_K {e}");
    }
}

#[test]
fn plain_types_by_hand() {
    let v = [1.5f32, -2.25, 0.0, 65504.0];
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(deq(GgmlType::F32, &b), v);
    let b: Vec<u8> = v.iter().flat_map(|&x| h(x)).collect();
    assert_eq!(deq(GgmlType::F16, &b), v);
    let b: Vec<u8> = v
        .iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect();
    // bf16 keeps the top 16 bits: 65504 = 0x477FE000 truncates to 0x477F = 65280.
    assert_eq!(deq(GgmlType::BF16, &b), [1.5, -2.25, 0.0, 65280.0]);
}

#[test]
fn q8_0_activation_rounding_is_x86_simd() {
    // amax = 127 -> d = 1, id = 127/127 = 1; ties go to even (x86 _mm256_round_ps), not away
    // from zero (roundf in quantize_row_q8_0_ref).
    let mut x = [0f32; 32];
    x[..6].copy_from_slice(&[127.0, 2.5, -3.5, 0.5, -0.5, 1.5]);
    let mut q = [0u8; 34];
    quantize_row(GgmlType::Q8_0, &x, &mut q).unwrap();
    assert_eq!(&q[0..2], &h(1.0));
    let got: Vec<i8> = q[2..8].iter().map(|&b| b as i8).collect();
    assert_eq!(got, [127, 2, -4, 0, 0, 2]);
    // Q8_K: signed max -127 -> iscale = 1, d = 1; nearest_int also ties to even.
    let mut xk = [0f32; 256];
    xk[..5].copy_from_slice(&[-127.0, 2.5, -3.5, 0.5, 126.5]);
    let mut qk = [0u8; 292];
    quantize_row(GgmlType::Q8_K, &xk, &mut qk).unwrap();
    assert_eq!(f32::from_le_bytes([qk[0], qk[1], qk[2], qk[3]]), 1.0);
    let got: Vec<i8> = qk[4..9].iter().map(|&b| b as i8).collect();
    assert_eq!(got, [-127, 2, -4, 0, 126]);
    let bsum0 = i16::from_le_bytes([qk[260], qk[261]]);
    assert_eq!(bsum0, -127 + 2 - 4 + 126);
}

#[test]
fn q4_k_dot_by_hand() {
    // One Q4_K block with all nibbles = 1, scales SC, mins MN, d = 1, dmin = 1, against a Q8_K
    // block with all quants = 2, d = 0.5: each sub-block sums to 32 * 1 * 2 = 64, so
    // dot = 0.5 * (64 * sum(SC) - 2 * 32 * sum(MN)) (bsums = 16 * 2 per 16-group).
    let mut w = h(1.0).to_vec();
    w.extend(h(1.0));
    w.extend(pack_k4(SC, MN));
    w.extend([0x11u8; 128]);
    let mut x = 0.5f32.to_le_bytes().to_vec();
    x.extend([2u8; 256]);
    for _ in 0..16 {
        x.extend(32i16.to_le_bytes());
    }
    let sum_sc: i32 = SC.iter().map(|&s| i32::from(s)).sum();
    let sum_mn: i32 = MN.iter().map(|&s| i32::from(s)).sum();
    let want = 0.5 * (64 * sum_sc - 64 * sum_mn) as f32;
    for level in SimdLevel::available() {
        let got = vec_dot_with(level, GgmlType::Q4_K, 256, &w, &x).unwrap();
        assert_eq!(got, want, "{level:?}");
    }
}
