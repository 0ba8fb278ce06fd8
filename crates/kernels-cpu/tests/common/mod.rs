//! Helpers shared by the kernel integration tests.
#![allow(dead_code)]

use kapitsa_base::GgmlType;

/// xorshift64*: deterministic, dependency-free.
pub struct Rng(pub u64);
impl Rng {
    pub fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn f32(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Roughly normal(0, 1).
    pub fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.f32()).sum::<f32>() * 1.732 - 3.464
    }
}

/// Offsets of the f16 scale fields of one block.
pub fn f16_fields(ty: GgmlType) -> &'static [usize] {
    use GgmlType as T;
    match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL | T::IQ4_XS => &[0],
        T::Q4_1 | T::Q5_1 | T::Q4_K | T::Q5_K => &[0, 2],
        T::Q2_K => &[80, 82],
        T::Q3_K => &[108],
        T::Q6_K => &[208],
        _ => &[],
    }
}
