//! Random values and random quantised blocks of a chosen standard deviation.
//!
//! Quantised weights are not produced by quantising floats: each block gets random codes and a
//! scale chosen so the dequantised values are zero-mean with the target standard deviation
//! (per block `d` jittered by U(0.75, 1.25)), which costs a few random bytes per block.
//!
//! | type  | codes                   | scale                                               | zero mean by              |
//! |-------|-------------------------|-----------------------------------------------------|---------------------------|
//! | Q4_K  | nibbles U{0..15}        | 6-bit `sc` U{32..63}, `m = sc`, `dmin = 7.5 d`        | `d sc 7.5 = dmin m`       |
//! | Q6_K  | 6-bit U{0..63} - 32     | int8 `sc` = ±U{32..63}                              | random sign of `sc`       |
//! | Q5_0  | 5-bit U{0..31} - 16     | `d` with a random sign                              | random sign of `d`        |
//! | Q8_0  | int8 U{-127..127}       | `d`                                                 | symmetric codes           |
//! | F16/F32 | U(-a, a), a = sqrt(3) std |                                                  |                           |

use half::f16;
use kapitsa_base::GgmlType;

use crate::SynthError;

/// wyrand: a small, fast, statistically decent generator (not cryptographic).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed (any value).
    pub fn new(seed: u64) -> Rng {
        Rng(splitmix(seed))
    }

    /// Next 64 random bits.
    #[inline(always)]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = u128::from(self.0) * u128::from(self.0 ^ 0xe703_7ed1_a0b4_28db);
        ((t >> 64) as u64) ^ (t as u64)
    }

    /// Uniform in [0, 1).
    #[inline(always)]
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in [lo, hi).
    #[inline(always)]
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 1.0) * (1.0 / (1u64 << 53) as f64);
        let u2 = (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    /// Fill `out` with random bytes.
    #[inline]
    pub fn fill(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let b = self.next_u64().to_le_bytes();
            rest.copy_from_slice(&b[..rest.len()]);
        }
    }
}

/// splitmix64 finaliser, used to derive independent stream seeds.
pub fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Seed of stream `(a, b)` under `seed`.
pub fn stream_seed(seed: u64, a: u64, b: u64) -> u64 {
    splitmix(
        splitmix(seed ^ 0x5eed)
            ^ splitmix(a.wrapping_mul(0x1000_0000_01b3) ^ 0xa5a5)
            ^ b.rotate_left(29),
    )
}

/// RMS of a 6-bit scale drawn uniformly from 32..=63: sqrt(47.5^2 + (32^2 - 1) / 12).
const RMS_SC: f32 = 48.389_05;
/// RMS of a uniform nibble minus its mean 7.5: sqrt((16^2 - 1) / 12).
const Q4_UNIT: f32 = 4.609_772;
/// RMS of a uniform 6-bit code minus 32: sqrt((64^2 - 1) / 12 + 0.25).
const Q6_UNIT: f32 = 18.479_72;
/// RMS of a uniform 5-bit code minus 16: sqrt((32^2 - 1) / 12 + 0.25).
const Q5_UNIT: f32 = 9.246_62;
/// RMS of a uniform int8 code in -127..=127: sqrt(127 * 128 / 3).
const Q8_UNIT: f32 = 73.611_59;

#[inline(always)]
fn put_f16(out: &mut [u8], x: f32) {
    out[..2].copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
}

#[inline(always)]
fn jitter(rng: &mut Rng) -> f32 {
    rng.uniform(0.75, 1.25)
}

fn q4_k_block(rng: &mut Rng, std: f32, b: &mut [u8]) {
    let r = rng.next_u64();
    let mut sc = [0u8; 8];
    for (j, s) in sc.iter_mut().enumerate() {
        *s = 32 + ((r >> (5 * j)) & 31) as u8;
    }
    let d = f16::from_f32(std / (Q4_UNIT * RMS_SC) * jitter(rng)).to_f32();
    put_f16(&mut b[0..2], d);
    put_f16(&mut b[2..4], 7.5 * d);
    let m = sc;
    let s = &mut b[4..16];
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
    }
    for j in 4..8 {
        s[j + 4] = (sc[j] & 15) | ((m[j] & 15) << 4);
    }
    rng.fill(&mut b[16..144]);
}

fn q6_k_block(rng: &mut Rng, std: f32, b: &mut [u8]) {
    rng.fill(&mut b[0..192]);
    let r = rng.next_u64();
    let signs = rng.next_u64();
    for j in 0..16 {
        let mag = 32 + ((r >> (4 * j)) & 15) as i32 * 2 + ((signs >> (16 + j)) & 1) as i32;
        let v = if (signs >> j) & 1 == 1 { -mag } else { mag };
        b[192 + j] = v as i8 as u8;
    }
    let d = std / (Q6_UNIT * RMS_SC) * jitter(rng);
    put_f16(&mut b[208..210], d);
}

fn q5_0_block(rng: &mut Rng, std: f32, b: &mut [u8]) {
    let sign = if rng.next_u64() & 1 == 1 { -1.0 } else { 1.0 };
    put_f16(&mut b[0..2], sign * std / Q5_UNIT * jitter(rng));
    rng.fill(&mut b[2..22]);
}

fn q8_0_block(rng: &mut Rng, std: f32, b: &mut [u8]) {
    put_f16(&mut b[0..2], std / Q8_UNIT * jitter(rng));
    for q in b[2..34].iter_mut() {
        // Uniform over the 255 codes -127..=127 (-128 is avoided, as ggml's quantiser does).
        *q = (((rng.next_u64() >> 32) % 255) as i32 - 127) as i8 as u8;
    }
}

/// Fill `out` with `out.len() / row_bytes` rows of `n` elements of `ty`, zero-mean with standard
/// deviation `std`. `zero_row(i)` (row index within `out`) makes a row exactly zero.
pub fn fill_rows(
    ty: GgmlType,
    n: usize,
    std: f32,
    rng: &mut Rng,
    out: &mut [u8],
    zero_row: &dyn Fn(usize) -> bool,
) -> Result<(), SynthError> {
    let row_bytes = ty
        .row_bytes(n)
        .ok_or_else(|| SynthError::Internal(format!("{n} elements are not whole {ty} blocks")))?;
    let block: fn(&mut Rng, f32, &mut [u8]) = match ty {
        GgmlType::Q4_K => q4_k_block,
        GgmlType::Q6_K => q6_k_block,
        GgmlType::Q5_0 => q5_0_block,
        GgmlType::Q8_0 => q8_0_block,
        GgmlType::F16 => |rng, std, b| {
            let a = std * 3f32.sqrt();
            put_f16(b, rng.uniform(-a, a));
        },
        GgmlType::F32 => |rng, std, b| {
            let a = std * 3f32.sqrt();
            b.copy_from_slice(&rng.uniform(-a, a).to_le_bytes());
        },
        other => {
            return Err(SynthError::Internal(format!(
                "no random-block generator for {other}"
            )))
        }
    };
    let ts = ty.type_size();
    for (i, row) in out.chunks_exact_mut(row_bytes).enumerate() {
        if zero_row(i) {
            row.fill(0);
            continue;
        }
        for b in row.chunks_exact_mut(ts) {
            block(rng, std, b);
        }
    }
    Ok(())
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
