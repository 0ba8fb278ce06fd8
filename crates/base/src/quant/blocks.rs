//! Block layouts of the ggml quantisation formats (`ggml-common.h`) and small helpers to read
//! their fields. Every multi-byte field is little-endian, blocks are packed (no padding).
//!
//! | type    | elems | bytes | layout (byte offsets)                                                    |
//! |---------|-------|-------|--------------------------------------------------------------------------|
//! | Q4_0    | 32    | 18    | `d: f16 @0`, `qs[16] @2`                                                  |
//! | Q4_1    | 32    | 20    | `d: f16 @0`, `m: f16 @2`, `qs[16] @4`                                     |
//! | Q5_0    | 32    | 22    | `d: f16 @0`, `qh: u32 @2`, `qs[16] @6`                                    |
//! | Q5_1    | 32    | 24    | `d: f16 @0`, `m: f16 @2`, `qh: u32 @4`, `qs[16] @8`                       |
//! | Q8_0    | 32    | 34    | `d: f16 @0`, `qs: i8[32] @2`                                              |
//! | Q8_1    | 32    | 36    | `d: f16 @0`, `s: f16 @2` (= d * sum(qs)), `qs: i8[32] @4`                 |
//! | IQ4_NL  | 32    | 18    | `d: f16 @0`, `qs[16] @2` (indices into [`KVALUES_IQ4NL`])                 |
//! | MXFP4   | 32    | 17    | `e: u8 (E8M0) @0`, `qs[16] @1` (indices into [`KVALUES_MXFP4`])           |
//! | Q2_K    | 256   | 84    | `scales[16] @0` (lo nibble scale, hi nibble min), `qs[64] @16`, `d @80`, `dmin @82` |
//! | Q3_K    | 256   | 110   | `hmask[32] @0`, `qs[64] @32`, `scales[12] @96` (16 x 6 bit), `d @108`     |
//! | Q4_K    | 256   | 144   | `d @0`, `dmin @2`, `scales[12] @4` (8 x 6-bit scale + min), `qs[128] @16` |
//! | Q5_K    | 256   | 176   | `d @0`, `dmin @2`, `scales[12] @4`, `qh[32] @16`, `qs[128] @48`           |
//! | Q6_K    | 256   | 210   | `ql[128] @0`, `qh[64] @128`, `scales: i8[16] @192`, `d @208`              |
//! | IQ4_XS  | 256   | 136   | `d @0`, `scales_h: u16 @2`, `scales_l[4] @4`, `qs[128] @8`                |
//! | Q8_K    | 256   | 292   | `d: f32 @0`, `qs: i8[256] @4`, `bsums: i16[16] @260` (sums of 16 quants)  |
//!
//! For the 32-element nibble formats (Q4_0, Q4_1, Q5_x, IQ4_NL, MXFP4) the low nibble of `qs[j]`
//! is element `j` and the high nibble element `j + 16`. For Q4_K/Q5_K each 64-element chunk uses
//! 32 bytes: low nibbles are the first 32 elements, high nibbles the next 32.

/// Elements per block of the 32-element formats.
pub const QK: usize = 32;
/// Elements per super-block of the K formats.
pub const QK_K: usize = 256;

/// Non-linear 4-bit code book of IQ4_NL and IQ4_XS (ggml `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// E2M1 (FP4) values doubled, as ggml stores them (`kvalues_mxfp4`); the block scale is
/// halved to compensate (see [`e8m0_to_f32_half`]).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Reads a little-endian f16 at byte offset `o` and widens it (exact).
#[inline(always)]
pub fn f16_at(b: &[u8], o: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32()
}

/// Reads a little-endian u16 at byte offset `o`.
#[inline(always)]
pub fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

/// Reads a little-endian u32 at byte offset `o`.
#[inline(always)]
pub fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// Reads a little-endian f32 at byte offset `o`.
#[inline(always)]
pub fn f32_at(b: &[u8], o: usize) -> f32 {
    f32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// Reads a little-endian i16 at byte offset `o`.
#[inline(always)]
pub fn i16_at(b: &[u8], o: usize) -> i16 {
    i16::from_le_bytes([b[o], b[o + 1]])
}

/// `2^(e - 128)`: an E8M0 scale times one half (ggml `ggml_e8m0_to_fp32_half`). `e` of 0 and 1
/// give the subnormals 2^-128 and 2^-127.
#[inline(always)]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits: u32 = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// Unpacks the 12-byte Q4_K/Q5_K scale field into 8 six-bit scales and 8 six-bit mins
/// (ggml `get_scale_min_k4` for `j = 0..8`).
///
/// Bytes 0..4 hold scales 0..4 (low 6 bits), bytes 4..8 mins 0..4 (low 6 bits); bytes 8..12 hold
/// the low 4 bits of scale `4 + i` (low nibble) and min `4 + i` (high nibble), whose top 2 bits are
/// the top 2 bits of bytes `i` (scale) and `i + 4` (min).
#[inline(always)]
pub fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
    }
    for j in 4..8 {
        sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    (sc, mn)
}

/// Unpacks the 12-byte Q3_K scale field into 16 signed scales (6-bit value minus 32).
///
/// Bytes 0..8: low nibbles are the low 4 bits of scales 0..8, high nibbles of scales 8..16.
/// Bytes 8..12: 2-bit pairs; byte `8 + i` bits `2k..2k+2` are the top bits of scale `4k + i`.
#[inline(always)]
pub fn scales_q3k(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + (j % 4)] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// IQ4_XS 6-bit scale of sub-block `ib` (0..8), minus 32.
#[inline(always)]
pub fn iq4xs_scale(scales_h: u16, scales_l: &[u8], ib: usize) -> i32 {
    let lo = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
    let hi = ((scales_h >> (2 * ib)) & 3) as u8;
    i32::from(lo | (hi << 4)) - 32
}

/// ggml `nearest_int`: round to nearest, ties to even, via the 1.5 * 2^23 trick. Valid for
/// `|f| <= 4194303`.
#[inline(always)]
pub fn nearest_int(f: f32) -> i32 {
    let v = f + 12_582_912.0f32;
    ((v.to_bits() & 0x007f_ffff) as i32) - 0x0040_0000
}

/// f32 -> bf16 bits, round to nearest even, NaN kept quiet (ggml `ggml_compute_fp32_to_bf16`).
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// bf16 bits -> f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}
