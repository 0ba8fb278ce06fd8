//! Quantised block formats: dequantisation, activation quantisation and dot products, with the
//! semantics of ggml (llama.cpp's CPU backend).
//!
//! * [`dequantize_row`]: weight row bytes to f32, bit-exact with ggml `dequantize_row_*`.
//! * [`vec_dot_type`] / [`quantize_row`]: the activation format ggml pairs with each weight
//!   type and the exact x86 quantiser llama.cpp runs (see [`act`] for the rounding analysis).
//! * [`vec_dot`] / [`DotKernel`]: dot product of a weight row with a quantised activation row;
//!   a scalar twin for every type and AVX2 / AVX-512 variants chosen once at runtime.
//!   [`DotKernel::dot4`] multiplies one weight row with 4 activation rows, decoding the weights
//!   once (prefill), with results bit-identical to 4 [`DotKernel::dot`] calls.
//!
//! SIMD coverage (others use the scalar twin):
//!
//! | weight type                          | AVX2 | AVX2 dot4 | AVX-512 (+VNNI) | AVX-512 dot4 |
//! |--------------------------------------|------|-----------|-----------------|--------------|
//! | Q4_K, Q6_K                           | yes  | yes       | yes             | yes          |
//! | Q5_K                                 | yes  | -         | yes             | yes          |
//! | Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4      | yes  | yes       | yes             | yes          |
//! | IQ4_XS                               | yes  | -         | (AVX2)          | -            |
//! | F32, F16, BF16                       | yes  | -         | yes (no VNNI)   | -            |
//! | Q4_1, Q5_1, Q2_K, Q3_K               | -    | -         | -               | -            |
//!
//! Integer parts of every SIMD kernel are exact (same i32 sums as the scalar twin); only the
//! float accumulation order differs (tested to 1e-5 of sum |w x|).
//!
//! Prefill GEMM (`gemm_avx512`, driven by `crate::gemm`): tiled micro-kernels bit-identical to
//! the AVX-512 dot kernels for Q4_K, Q5_K, Q6_K (AVX-512; from VNNI up in the super-block
//! order) and Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4 (VNNI); `matmul` uses them for batches of 4+
//! tokens (the 32-element formats: 2+, on kernels that decode the raw weights in registers
//! for batches of up to 8). Activation quantisation
//! to Q8_0 / Q8_K has byte-identical AVX-512 versions (`act_avx512`).
//!
//! At [`SimdLevel::Avx512Vnni`] and [`SimdLevel::Amx`] the K formats use the super-block order
//! of `dot_sb` instead (the only order AMX tiles can reproduce, and one whose exact integer
//! per super-block lets few-token passes share each weight read): VNNI dot kernels, the
//! row-group GEMV of `gemv_sb` for one token ([`DotKernel`]'s `gemv`, 8 rows per vector
//! chain) and its multi-token form for a few, the rows-in-lanes GEMV of `gemv_sb_lanes`
//! (Q4_K from 4 tokens, Q6_K from 6: 16 rows in the lanes, activations broadcast, no
//! reduction), which for Q4_K and Q6_K at [`SimdLevel::Avx512Vnni`] is also the prefill GEMM
//! of larger batches (blocks of 256 tokens per repacked panel; `matmul`'s `lanes_gemm`), the
//! AVX-512 GEMM in that order (`kern_k_sb`) for the other larger batches and, at
//! [`SimdLevel::Amx`] only, the tile GEMM (`crate::gemm_amx`) for batches of
//! `AMX_MIN_TOKENS`+; all bit-identical to each other and to the scalar twin
//! `dot_sb::dot_scalar`, so a level's results never depend on the batch (speculative
//! verification of k tokens gives each exactly its one-token-step result).
//!
//! The same holds for Q8_0 and Q5_0 with the block order of `dot_blk` (one f32 chain per
//! row, one FMA per 32-element block): at [`SimdLevel::Amx`] their dot kernel is the
//! row-group GEMV of `gemv_blk` run on one row, single-token products take that GEMV, and
//! every batch of 2+ tokens takes the tile GEMM of `crate::gemm_amx_blk`, so a sequence's
//! results never depend on the batch it shares a step with.
//!
//! Block layouts are documented in [`blocks`].

pub mod act;
mod act_avx512;
pub use kapitsa_base::quant::blocks;
use kapitsa_base::quant::dequant;
mod dot_avx2;
mod dot_avx512;
pub(crate) mod dot_blk;
pub(crate) mod dot_sb;
mod dot_scalar;
mod error;
pub(crate) mod gemm_avx512;
mod gemv_blk;
mod gemv_sb;
mod gemv_sb_lanes;

pub use error::KernelError;
use kapitsa_base::{CpuFeatures, GgmlType};

/// SIMD instruction-set level a kernel is compiled for, ordered from least to most capable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust, no intrinsics.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ (plus AVX2).
    Avx512,
    /// AVX-512 plus VNNI (`vpdpbusd`) and, where used, BF16 (checked separately). The K
    /// formats (Q4_K, Q5_K, Q6_K) use the super-block order of `dot_sb` from this level up
    /// (its multi-token GEMV makes passes of a few tokens cheap).
    Avx512Vnni,
    /// AVX-512 VNNI plus AMX-INT8 tiles. The K formats keep the super-block order (their
    /// large batches run on the tiles) and Q8_0, Q5_0 switch to the block order of `dot_blk`
    /// (their GEMMs run on the tiles); every other type uses its AVX-512 VNNI kernels.
    Amx,
}

impl SimdLevel {
    /// The best level the running CPU supports (honours `KAPITSA_CPU`, see [`CpuFeatures`]).
    pub fn detect() -> SimdLevel {
        let f = CpuFeatures::get();
        if f.avx512 && f.avx512_vnni && f.amx_int8 {
            SimdLevel::Amx
        } else if f.avx512 && f.avx512_vnni {
            SimdLevel::Avx512Vnni
        } else if f.avx512 {
            SimdLevel::Avx512
        } else if f.avx2 {
            SimdLevel::Avx2
        } else {
            SimdLevel::Scalar
        }
    }

    /// Whether kernels of this level may run on this CPU.
    pub fn is_available(self) -> bool {
        self <= SimdLevel::detect()
    }

    /// Every level the running CPU supports, lowest first (for tests and benchmarks).
    pub fn available() -> Vec<SimdLevel> {
        [
            SimdLevel::Scalar,
            SimdLevel::Avx2,
            SimdLevel::Avx512,
            SimdLevel::Avx512Vnni,
            SimdLevel::Amx,
        ]
        .into_iter()
        .filter(|l| l.is_available())
        .collect()
    }
}

/// Weight types this module can dequantise and multiply.
pub const WEIGHT_TYPES: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

fn is_supported(ty: GgmlType) -> bool {
    !matches!(
        ty,
        GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64 | GgmlType::F64
    )
}

/// Bytes of a row of `n` elements of `ty`, or a typed error.
pub fn row_bytes(op: &'static str, ty: GgmlType, n: usize) -> Result<usize, KernelError> {
    if !n.is_multiple_of(ty.block_size()) {
        return Err(KernelError::NotBlockMultiple {
            op,
            ty,
            n,
            block: ty.block_size(),
        });
    }
    ty.row_bytes(n).ok_or(KernelError::Overflow { op })
}

/// Error unless `expected == got` (the length of `what` in `op`).
pub(crate) fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), KernelError> {
    if expected != got {
        return Err(KernelError::BadLength {
            op,
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// Dequantises one row: `src` holds exactly the bytes of `dst.len()` elements of `ty`.
/// Supports every weight type in [`WEIGHT_TYPES`] plus Q8_0/Q8_1/Q8_K. Bit-exact with ggml.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    const OP: &str = "dequantize_row";
    if !is_supported(ty) {
        return Err(KernelError::UnsupportedType { op: OP, ty });
    }
    check_len(OP, "src", row_bytes(OP, ty, dst.len())?, src.len())?;
    dequant::dequantize_blocks(ty, src, dst);
    Ok(())
}

/// The activation format ggml pairs with weight type `ty` (`type_traits_cpu[ty].vec_dot_type`):
/// Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants and IQ4_XS,
/// and the weight's own type for F32/F16/BF16 (activations are rounded to f16/bf16).
pub fn vec_dot_type(ty: GgmlType) -> Result<GgmlType, KernelError> {
    use GgmlType as T;
    Ok(match ty {
        T::F32 => T::F32,
        T::F16 => T::F16,
        T::BF16 => T::BF16,
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL | T::MXFP4 => T::Q8_0,
        T::Q4_1 | T::Q5_1 => T::Q8_1,
        T::Q2_K | T::Q3_K | T::Q4_K | T::Q5_K | T::Q6_K | T::IQ4_XS => T::Q8_K,
        _ => {
            return Err(KernelError::UnsupportedType {
                op: "vec_dot_type",
                ty,
            })
        }
    })
}

/// Quantises an f32 activation row to `ty_dot` (F32, F16, BF16, Q8_0, Q8_1 or Q8_K), exactly as
/// llama.cpp's x86 CPU backend does. `dst` must hold exactly the row bytes of `x.len()` elements.
pub fn quantize_row(ty_dot: GgmlType, x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    const OP: &str = "quantize_row";
    use GgmlType as T;
    if !matches!(
        ty_dot,
        T::F32 | T::F16 | T::BF16 | T::Q8_0 | T::Q8_1 | T::Q8_K
    ) {
        return Err(KernelError::UnsupportedType { op: OP, ty: ty_dot });
    }
    check_len(OP, "dst", row_bytes(OP, ty_dot, x.len())?, dst.len())?;
    act::quantize_act(ty_dot, x, dst);
    Ok(())
}

/// A dot-product kernel: `unsafe` only because SIMD variants need their CPU features; every
/// kernel handles `min(w blocks, x blocks)` blocks and never reads out of bounds.
type DotFn = unsafe fn(&[u8], &[u8]) -> f32;
/// A 4-row kernel: one weight row against 4 activation rows, each result bit-identical to the
/// 1-row kernel's (same operation sequence per row; the weight row is decoded once).
type Dot4Fn = unsafe fn(&[u8], [&[u8]; 4]) -> [f32; 4];

/// A dot-product kernel for one weight type, chosen for a SIMD level the CPU supports.
///
/// `dot(w, x)` multiplies `w` (whole blocks of the weight type) with `x` (the same number of
/// elements in [`vec_dot_type`] format). Construct once, call many times.
#[derive(Clone, Copy)]
pub struct DotKernel {
    ty: GgmlType,
    dot_ty: GgmlType,
    level: SimdLevel,
    f: DotFn,
    f4: Option<Dot4Fn>,
    gemv: Option<gemv_sb::GemvFn>,
    gemv_multi: Option<gemv_sb::GemvMultiFn>,
    /// The rows-in-lanes multi-token GEMV (`gemv_sb_lanes`) and the token count from which it
    /// takes over from `gemv_multi`.
    gemv_lanes: Option<(gemv_sb::GemvMultiFn, usize)>,
}

impl std::fmt::Debug for DotKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DotKernel")
            .field("ty", &self.ty)
            .field("level", &self.level)
            .finish()
    }
}

impl DotKernel {
    /// The fastest kernel for `ty` on this CPU.
    pub fn new(ty: GgmlType) -> Result<DotKernel, KernelError> {
        Self::with_level(ty, SimdLevel::detect())
    }

    /// The scalar twin for `ty`.
    pub fn scalar(ty: GgmlType) -> Result<DotKernel, KernelError> {
        Self::with_level(ty, SimdLevel::Scalar)
    }

    /// The best kernel for `ty` using at most `max_level` (errors if the CPU lacks `max_level`).
    pub fn with_level(ty: GgmlType, max_level: SimdLevel) -> Result<DotKernel, KernelError> {
        if !max_level.is_available() {
            return Err(KernelError::SimdUnavailable(max_level));
        }
        let dot_ty = vec_dot_type(ty)?;
        let mut chosen: Option<(SimdLevel, DotFn, Option<Dot4Fn>)> = None;
        if max_level >= SimdLevel::Avx512Vnni {
            chosen = dot_sb::kernel(ty, max_level);
        }
        if chosen.is_none() && max_level >= SimdLevel::Amx {
            chosen = dot_blk::kernel(ty);
        }
        if chosen.is_none() && max_level >= SimdLevel::Avx512 {
            chosen = dot_avx512::kernel(ty, max_level, CpuFeatures::get().avx512_bf16);
        }
        if chosen.is_none() && max_level >= SimdLevel::Avx2 {
            chosen = dot_avx2::kernel(ty).map(|(f, f4)| (SimdLevel::Avx2, f, f4));
        }
        let (level, f, f4) = match chosen {
            Some(c) => c,
            None => (
                SimdLevel::Scalar,
                scalar_kernel(ty).ok_or(KernelError::UnsupportedType { op: "vec_dot", ty })?,
                None,
            ),
        };
        // The row-group GEMVs exist for the super-block and block orders only.
        let (gemv, gemv_multi, gemv_lanes) = if sb_order(ty, level) {
            match gemv_sb::kernels(ty) {
                Some((g, m)) => (Some(g), Some(m), gemv_sb_lanes::kernel(ty)),
                None => (None, None, None),
            }
        } else if level == SimdLevel::Amx {
            (gemv_blk::kernel(ty), None, None)
        } else {
            (None, None, None)
        };
        Ok(DotKernel {
            ty,
            dot_ty,
            level,
            f,
            f4,
            gemv,
            gemv_multi,
            gemv_lanes,
        })
    }

    /// Weight type.
    pub fn weight_type(&self) -> GgmlType {
        self.ty
    }

    /// Activation type ([`vec_dot_type`] of the weight type).
    pub fn dot_type(&self) -> GgmlType {
        self.dot_ty
    }

    /// SIMD level of the implementation actually chosen.
    pub fn level(&self) -> SimdLevel {
        self.level
    }

    /// Dot product of whole blocks; lengths are the caller's contract (checked in debug builds;
    /// a mismatch in release gives a partial sum, never an out-of-bounds access).
    #[inline]
    pub fn dot(&self, w: &[u8], x: &[u8]) -> f32 {
        debug_assert_eq!(
            w.len() / self.ty.type_size() * self.ty.block_size(),
            x.len() / self.dot_ty.type_size() * self.dot_ty.block_size()
        );
        // SAFETY: `f` was selected for a level `<= SimdLevel::detect()` (checked in
        // `with_level`), so its target features are present; every kernel bounds its reads by
        // the slice lengths.
        unsafe { (self.f)(w, x) }
    }

    /// Whether [`DotKernel::dot4`] has a fused 4-row implementation (else it loops).
    pub fn has_dot4(&self) -> bool {
        self.f4.is_some()
    }

    /// `[dot(w, xs[0]), .., dot(w, xs[3])]`, bit-identical to four [`DotKernel::dot`] calls but
    /// decoding the weight row once where a fused kernel exists (prefill).
    #[inline]
    pub fn dot4(&self, w: &[u8], xs: [&[u8]; 4]) -> [f32; 4] {
        match self.f4 {
            // SAFETY: as in `dot`: `f4` was selected with `f` for an available level, and
            // kernels bound their reads by the slice lengths.
            Some(f4) => unsafe { f4(w, xs) },
            None => xs.map(|x| self.dot(w, x)),
        }
    }

    /// Whether [`DotKernel::gemv`] has a row-group kernel (else it loops over [`DotKernel::dot`]).
    pub(crate) fn has_gemv(&self) -> bool {
        self.gemv.is_some()
    }

    /// Rearranges a quantised activation row (`x`, [`DotKernel::dot_type`] format) for
    /// [`DotKernel::gemv`]; a no-op unless [`DotKernel::has_gemv`].
    pub(crate) fn prepare_gemv(&self, x: &mut [u8]) {
        if self.gemv.is_some() {
            gemv_sb::prepare(self.ty, x);
        }
    }

    /// Whether [`DotKernel::gemv_multi`] has the rows-in-lanes kernel, which takes any number
    /// of tokens (prefill batches too).
    pub(crate) fn has_gemv_lanes(&self) -> bool {
        self.gemv_lanes.is_some()
    }

    /// Whether [`DotKernel::gemv_multi`] has a multi-token row-group kernel.
    pub(crate) fn has_gemv_multi(&self) -> bool {
        self.gemv_multi.is_some()
    }

    /// `outs[t][r] = dot(w[r * rb..(r + 1) * rb], xs[t])` for every token `t` and every
    /// `r < outs[t].len()` (one output slice per input, all of one length), each weight block
    /// read once for all tokens (the rows-in-lanes kernel where it exists and there are
    /// enough tokens, else `gemv_sb`'s); bit-identical to [`DotKernel::dot`] on the unprepared
    /// rows. Every `xs[t]` must have gone through [`DotKernel::prepare_gemv`]. `w` holds at
    /// least that many rows of `rb` bytes.
    pub(crate) fn gemv_multi(&self, w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
        let lanes = self
            .gemv_lanes
            .filter(|&(_, min)| xs.len() >= min)
            .map(|(f, _)| f);
        match lanes.or(self.gemv_multi) {
            // SAFETY: as in `gemv`: only set at `SimdLevel::Avx512Vnni` and above, checked
            // available.
            Some(g) => unsafe { g(w, rb, xs, outs) },
            None => {
                for (x, out) in xs.iter().zip(outs.iter_mut()) {
                    self.gemv(w, rb, x, out);
                }
            }
        }
    }

    /// `out[r] = dot(w[r * rb..(r + 1) * rb], x)` for every `r < out.len()`, bit-identical to
    /// [`DotKernel::dot`] on the unprepared row. `x` must have gone through
    /// [`DotKernel::prepare_gemv`]. `w` holds at least `out.len()` rows of `rb` bytes.
    pub(crate) fn gemv(&self, w: &[u8], rb: usize, x: &[u8], out: &mut [f32]) {
        match self.gemv {
            // SAFETY: `gemv` is only set at `SimdLevel::Avx512Vnni` (the super-block order)
            // or `SimdLevel::Amx`, which `with_level` checked are available (both imply the
            // AVX-512 VNNI, AVX2, FMA and F16C features the kernels need); the kernels bound
            // their reads by the slice lengths.
            Some(g) => unsafe { g(w, rb, x, out) },
            None => {
                for (r, o) in out.iter_mut().enumerate() {
                    *o = self.dot(&w[r * rb..(r + 1) * rb], x);
                }
            }
        }
    }
}

/// Whether products of weight type `ty` at kernel level `level` use the super-block order of
/// `dot_sb` (the K formats at [`SimdLevel::Avx512Vnni`] and [`SimdLevel::Amx`], on x86-64):
/// then every driver at that level (dot, row-group GEMVs, AVX-512 and tile GEMMs) computes
/// that order.
pub(crate) fn sb_order(ty: GgmlType, level: SimdLevel) -> bool {
    cfg!(target_arch = "x86_64")
        && level >= SimdLevel::Avx512Vnni
        && dot_sb::block_bytes(ty).is_some()
}

fn scalar_kernel(ty: GgmlType) -> Option<DotFn> {
    use dot_scalar as s;
    use GgmlType as T;
    Some(match ty {
        T::F32 => s::f32_f32,
        T::F16 => s::f16_f16,
        T::BF16 => s::bf16_bf16,
        T::Q4_0 => s::q4_0_q8_0,
        T::Q4_1 => s::q4_1_q8_1,
        T::Q5_0 => s::q5_0_q8_0,
        T::Q5_1 => s::q5_1_q8_1,
        T::Q8_0 => s::q8_0_q8_0,
        T::Q2_K => s::q2_k_q8_k,
        T::Q3_K => s::q3_k_q8_k,
        T::Q4_K => s::q4_k_q8_k,
        T::Q5_K => s::q5_k_q8_k,
        T::Q6_K => s::q6_k_q8_k,
        T::IQ4_NL => s::iq4_nl_q8_0,
        T::IQ4_XS => s::iq4_xs_q8_k,
        T::MXFP4 => s::mxfp4_q8_0,
        _ => return None,
    })
}

/// Dot product of a weight row of `n` elements of `ty` with an activation row already quantised
/// to [`vec_dot_type`]`(ty)`, using the fastest kernel for this CPU. Prefer [`DotKernel`] in
/// loops (this re-selects the kernel each call).
pub fn vec_dot(ty: GgmlType, n: usize, w_row: &[u8], x_q: &[u8]) -> Result<f32, KernelError> {
    vec_dot_with(SimdLevel::detect(), ty, n, w_row, x_q)
}

/// [`vec_dot`] restricted to kernels of at most `level` (`SimdLevel::Scalar` gives the twin).
pub fn vec_dot_with(
    level: SimdLevel,
    ty: GgmlType,
    n: usize,
    w_row: &[u8],
    x_q: &[u8],
) -> Result<f32, KernelError> {
    const OP: &str = "vec_dot";
    let k = DotKernel::with_level(ty, level)?;
    check_len(OP, "w_row", row_bytes(OP, ty, n)?, w_row.len())?;
    check_len(OP, "x_q", row_bytes(OP, k.dot_ty, n)?, x_q.len())?;
    Ok(k.dot(w_row, x_q))
}
