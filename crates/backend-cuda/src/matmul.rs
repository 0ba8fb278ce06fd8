//! Quantised matrix products and the embedding gather on the GPU: the host side of
//! kernels/matmul.cu (kernels) and kernels/quant.cuh (device layouts and decoders).
//!
//! # Contract
//! - **Weights** ([`CudaWeight`]) are `[n_out, n_in]` matrices or `[E, n_out, n_in]` expert
//!   stacks of ggml rows (F32, F16, BF16, Q8_0, Q5_0, Q4_0, Q4_K, Q5_K, Q6_K) in device memory.
//!   F32/F16/BF16/Q4_K/Q5_K keep the GGUF bytes; Q8_0/Q4_0/Q5_0/Q6_K, whose blocks are only
//!   2-byte aligned, are split at upload into planes of their fields (same bits, no
//!   requantisation; quant.cuh documents the planes) so every kernel load is a 16-byte load.
//!   Quantised rows need whole blocks (`n_in % 32`, K formats `n_in % 256`), float rows any
//!   `n_in >= 1`; other types and partial blocks are [`BackendError::Unsupported`] at upload.
//! - **Products** `y[t, r] = sum_k x[t, k] W[r, k]`, x `[n_tok, n_in]` and y `[n_tok, rows]`
//!   row-major f32 in device memory, accumulated in f32:
//!   - `n_tok <= 16` ([`GEMV_SPLIT_MAX_TOKENS`]): the GEMV kernels (launches of up to 8
//!     tokens), weights dequantised in registers, activations read as f32 (no rounding of x);
//!   - more tokens: cuBLAS. F32 weights: `cublasSgemm` under `CUBLAS_PEDANTIC_MATH` (no TF32),
//!     full f32. F16/BF16 weights: `cublasGemmEx` on the weights as stored, x rounded to
//!     f16/bf16 (as the CPU reference rounds it), f32 output and compute. Quantised weights:
//!     tiles of rows dequantised exactly and rounded to f16 into a scratch buffer, x rounded to
//!     f16, `cublasGemmEx` f16 x f16 -> f32 on the tensor cores.
//!
//!   The two paths round differently (the GEMV keeps x in f32), so a token's result can
//!   differ in the last bits between a small and a large batch.
//! - **Embedding gather** `out[i, :] = dequant(W[ids[i], :])`: bit-identical to kernels-cpu
//!   `dequantize_row`; an id `>= n_out` gives a zero row (callers check ids on the host).
//! - **Streams.** Everything is queued on the given stream, which must be the stream `blas` is
//!   bound to; the f16 scratch buffers are reused by the next call, so all calls must go to
//!   that one stream (or be ordered with it). Calls return once queued.
//! - **Errors.** Lengths are checked on the host ([`BackendError::Shape`]); buffers may be
//!   longer than needed (only the leading elements are used). Driver and cuBLAS errors are
//!   [`BackendError::Device`] (allocation failures [`BackendError::OutOfMemory`]).

#![cfg(feature = "cuda")]

use std::borrow::Cow;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut,
    DevicePtr, DevicePtrMut, LaunchConfig,
};
use cudarc::nvrtc::Ptx;
use kapitsa_backend::{shape_err, BackendError, HostWeight, Result};
use kapitsa_base::GgmlType;

use crate::device::dev_err;
use crate::launch::KernelLaunch;

mod gemm_grp;
mod gemv;
pub(crate) use gemm_grp::GEMM_GRP_TILES;
pub(crate) use gemv::{
    fuse_on, x8_from_norm, x8_row_bytes, GemvPart, GemvRoute, MoeSum, SharedPairs, GEMV_MAX_PARTS,
};

/// The GEMV kernels' epilogue: a bias added to every row, accumulation into `y`.
#[derive(Clone, Copy, Default)]
pub(crate) struct GemvEpilogue<'a> {
    /// `[n_rows]` device floats.
    pub(crate) bias: Option<&'a CudaSlice<f32>>,
    pub(crate) accumulate: bool,
}

/// Largest token count of one GEMV launch (`gemv_<ty>_1` .. `gemv_<ty>_8`).
pub(crate) const GEMV_MAX_TOKENS: usize = 8;

/// Largest token count that takes the GEMV kernels, in launches of up to [`GEMV_MAX_TOKENS`]
/// tokens (each re-reads the weights: cheaper than dequantising them for cuBLAS up to a few
/// launches; a first guess, to be tuned on the H200).
pub(crate) const GEMV_SPLIT_MAX_TOKENS: usize = 16;

/// Rows per GEMV row group (kernels/matmul.cu `GemvTune::R`; change both together).
const GEMV_ROWS: usize = 4;

/// Warps per GEMV block (kernels/matmul.cu `GEMV_WARPS`).
const GEMV_WARPS: usize = 4;

/// Elements of one dequantised f16 weight tile for the tensor-core GEMM (64 MiB of scratch).
const GEMM_TILE_ELEMS: usize = 1 << 25;

/// Threads per block of the element-wise kernels (dequant, gather, cvt).
const ELEM_THREADS: u32 = 256;

/// The module stem of the kernels (kernels/matmul.cu).
const MODULE: &str = "matmul";

// ---- formats ------------------------------------------------------------------------------------

/// A weight format the kernels support, in kernels/quant.cuh `KQ_*` id order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fmt {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q5_0,
    Q4_0,
    Q4K,
    Q5K,
    Q6K,
}

impl Fmt {
    const ALL: [Fmt; 9] = [
        Fmt::F32,
        Fmt::F16,
        Fmt::Bf16,
        Fmt::Q8_0,
        Fmt::Q5_0,
        Fmt::Q4_0,
        Fmt::Q4K,
        Fmt::Q5K,
        Fmt::Q6K,
    ];

    fn of(t: GgmlType) -> Option<Fmt> {
        Some(match t {
            GgmlType::F32 => Fmt::F32,
            GgmlType::F16 => Fmt::F16,
            GgmlType::BF16 => Fmt::Bf16,
            GgmlType::Q8_0 => Fmt::Q8_0,
            GgmlType::Q5_0 => Fmt::Q5_0,
            GgmlType::Q4_0 => Fmt::Q4_0,
            GgmlType::Q4_K => Fmt::Q4K,
            GgmlType::Q5_K => Fmt::Q5K,
            GgmlType::Q6_K => Fmt::Q6K,
            _ => return None,
        })
    }

    /// Whether the format has the int8-activation GEMVs (`gemv_x8_<fmt>`: Q4_K, Q6_K).
    fn x8(self) -> bool {
        matches!(self, Fmt::Q4K | Fmt::Q6K)
    }

    /// kernels/quant.cuh `KQ_*`.
    fn id(self) -> usize {
        self as usize
    }

    /// The kernel name part (`gemv_<name>_<nt>`, `dequant_<name>_f32`).
    fn name(self) -> &'static str {
        match self {
            Fmt::F32 => "f32",
            Fmt::F16 => "f16",
            Fmt::Bf16 => "bf16",
            Fmt::Q8_0 => "q8_0",
            Fmt::Q5_0 => "q5_0",
            Fmt::Q4_0 => "q4_0",
            Fmt::Q4K => "q4_k",
            Fmt::Q5K => "q5_k",
            Fmt::Q6K => "q6_k",
        }
    }

    /// Elements of one GEMV/dequant chunk (quant.cuh `KqFmt<T>::CE`).
    fn chunk(self) -> usize {
        match self {
            Fmt::F32 => 4,
            Fmt::F16 | Fmt::Bf16 => 8,
            Fmt::Q8_0 => 16,
            Fmt::Q5_0 | Fmt::Q4_0 => 32,
            Fmt::Q4K | Fmt::Q5K | Fmt::Q6K => 64,
        }
    }

    fn is_float(self) -> bool {
        matches!(self, Fmt::F32 | Fmt::F16 | Fmt::Bf16)
    }

    /// The planes of a planar device layout: (byte offset in the GGUF block, bytes) of each
    /// field, plane 0 first (quant.cuh "Device layouts"); `None` for the GGUF layout.
    fn planes(self) -> Option<&'static [(usize, usize)]> {
        match self {
            Fmt::Q8_0 => Some(&[(2, 32), (0, 2)]),
            Fmt::Q4_0 => Some(&[(2, 16), (0, 2)]),
            Fmt::Q5_0 => Some(&[(6, 16), (2, 4), (0, 2)]),
            Fmt::Q6K => Some(&[(0, 128), (128, 64), (192, 16), (208, 2)]),
            _ => None,
        }
    }
}

/// The device image of `n_rows` GGUF rows of `n_in` elements (`bytes`, exactly
/// `n_rows * row_bytes`) of a format: the bytes themselves for the GGUF layouts, else the
/// planes (each starting at a 256-byte boundary). Returns (image, offsets of planes 1..3,
/// kernel `stride`: bytes per row for the GGUF layouts, blocks per row for the planar ones).
fn device_image(
    fmt: Fmt,
    ty: GgmlType,
    bytes: &[u8],
    n_rows: usize,
    n_in: usize,
) -> (Cow<'_, [u8]>, [u64; 3], u64) {
    let ts = ty.type_size();
    let nb = n_in / ty.block_size();
    let Some(planes) = fmt.planes() else {
        return (Cow::Borrowed(bytes), [0; 3], (nb * ts) as u64);
    };
    let n_blocks = n_rows * nb;
    let mut offs = [0usize; 4];
    let mut end = 0usize;
    for (p, &(_, len)) in planes.iter().enumerate() {
        offs[p] = end;
        end = (end + n_blocks * len).next_multiple_of(256);
    }
    let mut img = vec![0u8; end];
    for (b, blk) in bytes.chunks_exact(ts).take(n_blocks).enumerate() {
        for (p, &(src, len)) in planes.iter().enumerate() {
            let dst = offs[p] + b * len;
            img[dst..dst + len].copy_from_slice(&blk[src..src + len]);
        }
    }
    (
        Cow::Owned(img),
        [offs[1] as u64, offs[2] as u64, offs[3] as u64],
        nb as u64,
    )
}

// ---- weights ------------------------------------------------------------------------------------

/// A weight matrix (or expert stack) in device memory, in the layout of kernels/quant.cuh.
pub(crate) struct CudaWeight {
    name: String,
    dtype: GgmlType,
    fmt: Fmt,
    n_exp: usize,
    n_out: usize,
    n_in: usize,
    /// The device image (GGUF bytes or planes), on the upload stream.
    buf: CudaSlice<u8>,
    /// Byte offsets of planes 1..3 in `buf` (planar formats).
    off: [u64; 3],
    /// Kernel stride: bytes per row (GGUF layouts) or blocks per row (planar).
    stride: u64,
}

// Accessors for the rest of the crate (the MoE path will need them).
#[allow(dead_code)]
impl CudaWeight {
    /// The ggml type of the rows.
    pub(crate) fn dtype(&self) -> GgmlType {
        self.dtype
    }

    /// Number of experts (1 for a 2-D matrix).
    pub(crate) fn n_experts(&self) -> usize {
        self.n_exp
    }

    /// Rows per expert (output features).
    pub(crate) fn n_out(&self) -> usize {
        self.n_out
    }

    /// Elements per row (input features).
    pub(crate) fn n_in(&self) -> usize {
        self.n_in
    }

    /// An F32 matrix's device image (the GGUF rows unchanged, `[rows, n_in]`) and its row
    /// stride in floats, when every row starts 16-byte aligned; `None` for other formats.
    pub(crate) fn f32_rows(&self) -> Option<(&CudaSlice<u8>, u64)> {
        (self.fmt == Fmt::F32 && self.stride.is_multiple_of(16))
            .then_some((&self.buf, self.stride / 4))
    }
}

impl CudaWeight {
    /// Bytes of one row in the GGUF layout (F32/F16/BF16 rows for cuBLAS).
    fn row_bytes(&self) -> usize {
        self.n_in * self.dtype.type_size() / self.dtype.block_size()
    }

    /// Whether the GEMV kernels take this matrix (rows of whole chunks; always true for the
    /// quantised formats).
    pub(crate) fn gemv_ok(&self) -> bool {
        self.n_in.is_multiple_of(self.fmt.chunk())
    }

    /// Rows per lane group of the `gemv_id_sum` kernel this expert stack's down projection
    /// takes (kernels/matmul.cu), `None` where it does not pay. Rows of at most 8 chunks take
    /// `gemv_id_sum_<ty>` (1 row: a block holds 4 rows, one per 8 lanes, and a decode's grid
    /// stays near one wave); Q4_K/Q6_K rows of 9 to 16 chunks `gemv_id_sum4_<ty>` (4 rows,
    /// `KAPITSA_MOE_DOWN_SUM4=0`: neither). Measured on an H100: Qwen3.6's 512-wide rows (8
    /// chunks) gain 2% with 1 row; Qwen3-30B-A3B's 768-wide rows (12 chunks) lose 4% with 1
    /// row (2 rows a block) and gained 3% with 4 (stop 44, call Y2).
    pub(crate) fn id_sum_rows(&self) -> Option<usize> {
        let chunks = self.n_in / self.fmt.chunk();
        match self.gemv_ok() {
            true if chunks <= 8 => Some(1),
            true if chunks <= 16 && self.fmt.x8() && gemv::sum4_on() => Some(4),
            _ => None,
        }
    }

    /// Whether products of `ws` over `n_tok` tokens can share one GEMV launch
    /// ([`MatmulKernels::gemv_parts`]): fusing on, 1 ..= [`GEMV_SPLIT_MAX_TOKENS`] tokens,
    /// at most [`GEMV_MAX_PARTS`] matrices of one format and width, rows of whole chunks.
    pub(crate) fn can_share_gemv(ws: &[&CudaWeight], n_tok: usize) -> bool {
        let Some(first) = ws.first() else {
            return false;
        };
        fuse_on()
            && (1..=GEMV_SPLIT_MAX_TOKENS).contains(&n_tok)
            && ws.len() <= GEMV_MAX_PARTS
            && ws
                .iter()
                .all(|w| w.gemv_ok() && w.fmt == first.fmt && w.n_in == first.n_in)
    }
}

// ---- kernels ------------------------------------------------------------------------------------

/// The f16 scratch buffers of the tensor-core GEMM, grown on demand.
#[derive(Default)]
struct Scratch {
    /// A dequantised weight tile `[rows, n_in]` (f16 bits).
    w16: Option<CudaSlice<u16>>,
    /// The activations rounded to f16/bf16 `[n_tok, n_in]`.
    x16: Option<CudaSlice<u16>>,
}

/// `slot`, reallocated on `stream` when it holds fewer than `n` elements.
fn grow<'a>(
    slot: &'a mut Option<CudaSlice<u16>>,
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<&'a mut CudaSlice<u16>> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        // SAFETY: the memory is unset, not invalid: every user writes the elements it reads
        // first, on this stream (device memory has no Rust validity invariant).
        *slot = Some(unsafe { stream.alloc::<u16>(n.max(1)) }.map_err(dev_err)?);
    }
    slot.as_mut()
        .ok_or_else(|| BackendError::Device("matmul scratch allocation vanished".into()))
}

fn blas_err(e: blas_result::CublasError) -> BackendError {
    BackendError::Device(format!("cuBLAS: {e:?}"))
}

/// `i32` kernel argument, or a shape error naming what overflowed.
fn i32_arg(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| BackendError::Shape {
        op,
        msg: format!("{what} = {v} exceeds the kernels' 32-bit range"),
    })
}

/// `a * b`, or a shape error.
fn mul(op: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| BackendError::Shape {
        op,
        msg: format!("{a} * {b} overflows"),
    })
}

/// The kernels of kernels/matmul.cu and the scratch buffers of the GEMM path.
pub(crate) struct MatmulKernels {
    /// `gemv_<fmt>_<nt>` at `fmt.id() * GEMV_MAX_TOKENS + nt - 1`.
    gemv: Vec<CudaFunction>,
    /// `gemv_<fmt>_1xs` by `fmt.id()`.
    gemv_xs: Vec<CudaFunction>,
    /// `gemv_id_<fmt>` (expert-routed) by `fmt.id()`.
    gemv_id: Vec<CudaFunction>,
    /// `gemv_id_sum_<fmt>` (routed down projections and the MoE's weighted sum) by `fmt.id()`.
    gemv_id_sum: Vec<CudaFunction>,
    /// `gemv_id_sum4_<fmt>` (the same, 4 rows per lane group) by `fmt.id()` (Q4_K, Q6_K).
    gemv_id_sum4: Vec<Option<CudaFunction>>,
    /// `gemv_id5_q4_k`: `gemv_id_q4_k` compiled for 5 blocks per SM (the default;
    /// `KAPITSA_GEMV_ID5=0`: `gemv_id_q4_k`).
    gemv_id5_q4_k: CudaFunction,
    /// `gemv_id5_x8_q4_k`: the same for `gemv_id_x8_q4_k`.
    gemv_id5_x8_q4_k: CudaFunction,
    /// `gemv_grp_<fmt>` (expert-grouped, tiles of up to 8 sorted pairs) by `fmt.id()`.
    gemv_grp: Vec<CudaFunction>,
    /// `gemm_grp_<fmt>_16` / `_64` (expert-grouped on tensor cores) by `fmt.id()` (`None`
    /// for the float formats).
    gemm_grp: Vec<Option<[CudaFunction; 2]>>,
    /// `gemv_x8_<fmt>` / `gemv_id_x8_<fmt>` (int8 activations) by `fmt.id()`, where the
    /// format has them ([`Fmt::x8`]).
    gemv_x8: Vec<Option<CudaFunction>>,
    gemv_id_x8: Vec<Option<CudaFunction>>,
    /// `quantize_x8_f32`: activations to the x8 rows those take.
    quantize_x8: CudaFunction,
    /// `dequant_<fmt>_f32` / `_f16` by `fmt.id()` (`None` for the float formats).
    dequant_f32: Vec<Option<CudaFunction>>,
    dequant_f16: Vec<Option<CudaFunction>>,
    /// `gather_f32`, `gather_f16`, `gather_bf16`.
    gather: [CudaFunction; 3],
    cvt_f16: CudaFunction,
    cvt_bf16: CudaFunction,
    /// Multiprocessors of the device (grid sizing).
    sms: usize,
    scratch: Mutex<Scratch>,
    _module: Arc<CudaModule>,
}

impl MatmulKernels {
    /// Load the kernels of `cubins`' `"matmul"` entry (the embedded `(file stem, cubin)`
    /// table) into `ctx`. `Unavailable` when the cubin is missing or empty (a build without
    /// kernels) or does not load.
    pub(crate) fn load(ctx: &Arc<CudaContext>, cubins: &[(&str, &[u8])]) -> Result<Self> {
        let bytes = cubins
            .iter()
            .find(|(s, _)| *s == MODULE)
            .map(|(_, b)| *b)
            .filter(|b| !b.is_empty())
            .ok_or_else(|| {
                BackendError::Unavailable(format!("no {MODULE} kernels in this binary"))
            })?;
        let module = ctx
            .load_module(Ptx::from_binary(bytes.to_vec()))
            .map_err(|e| BackendError::Unavailable(format!("loading the {MODULE} kernels: {e}")))?;
        crate::prof::note_module(&module);
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| BackendError::Unavailable(format!("{MODULE} kernel {name}: {e}")))
        };
        let mut gemv = Vec::with_capacity(Fmt::ALL.len() * GEMV_MAX_TOKENS);
        let mut gemv_xs = Vec::with_capacity(Fmt::ALL.len());
        let mut gemv_id = Vec::with_capacity(Fmt::ALL.len());
        let mut gemv_id_sum = Vec::with_capacity(Fmt::ALL.len());
        let mut gemv_id_sum4 = Vec::with_capacity(Fmt::ALL.len());
        let mut gemv_grp = Vec::with_capacity(Fmt::ALL.len());
        let mut gemm_grp = Vec::with_capacity(Fmt::ALL.len());
        let mut gemv_x8 = Vec::with_capacity(Fmt::ALL.len());
        let mut gemv_id_x8 = Vec::with_capacity(Fmt::ALL.len());
        let mut dequant_f32 = Vec::with_capacity(Fmt::ALL.len());
        let mut dequant_f16 = Vec::with_capacity(Fmt::ALL.len());
        for fmt in Fmt::ALL {
            for nt in 1..=GEMV_MAX_TOKENS {
                gemv.push(f(&format!("gemv_{}_{nt}", fmt.name()))?);
            }
            let xs = f(&format!("gemv_{}_1xs", fmt.name()))?;
            xs.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                gemv::XS_MAX_SMEM as i32,
            )
            .map_err(|e| BackendError::Unavailable(format!("{MODULE} kernel attribute: {e}")))?;
            gemv_xs.push(xs);
            gemv_id.push(f(&format!("gemv_id_{}", fmt.name()))?);
            gemv_id_sum.push(f(&format!("gemv_id_sum_{}", fmt.name()))?);
            gemv_id_sum4.push(match fmt.x8() {
                true => Some(f(&format!("gemv_id_sum4_{}", fmt.name()))?),
                false => None,
            });
            gemv_grp.push(f(&format!("gemv_grp_{}", fmt.name()))?);
            if fmt.x8() {
                gemv_x8.push(Some(f(&format!("gemv_x8_{}", fmt.name()))?));
                gemv_id_x8.push(Some(f(&format!("gemv_id_x8_{}", fmt.name()))?));
            } else {
                gemv_x8.push(None);
                gemv_id_x8.push(None);
            }
            if fmt.is_float() {
                dequant_f32.push(None);
                dequant_f16.push(None);
                gemm_grp.push(None);
            } else {
                let [a, b] = gemm_grp::GEMM_GRP_TILES;
                gemm_grp.push(Some([
                    f(&format!("gemm_grp_{}_{a}", fmt.name()))?,
                    f(&format!("gemm_grp_{}_{b}", fmt.name()))?,
                ]));
                dequant_f32.push(Some(f(&format!("dequant_{}_f32", fmt.name()))?));
                dequant_f16.push(Some(f(&format!("dequant_{}_f16", fmt.name()))?));
            }
        }
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(dev_err)?;
        Ok(MatmulKernels {
            gemv,
            gemv_xs,
            gemv_id,
            gemv_id_sum,
            gemv_id_sum4,
            gemv_id5_q4_k: f("gemv_id5_q4_k")?,
            gemv_id5_x8_q4_k: f("gemv_id5_x8_q4_k")?,
            gemv_grp,
            gemm_grp,
            gemv_x8,
            gemv_id_x8,
            quantize_x8: f("quantize_x8_f32")?,
            dequant_f32,
            dequant_f16,
            gather: [f("gather_f32")?, f("gather_f16")?, f("gather_bf16")?],
            cvt_f16: f("cvt_f32_f16")?,
            cvt_bf16: f("cvt_f32_bf16")?,
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            scratch: Mutex::new(Scratch::default()),
            _module: module,
        })
    }

    /// Copy a 2-D `[n_out, n_in]` or 3-D `[E, n_out, n_in]` weight to the device (queued on
    /// `stream`; the host bytes may be dropped on return). `Unsupported` for other types and
    /// for rows of partial blocks, `Shape` for a byte count that does not match the shape.
    pub(crate) fn upload(&self, stream: &Arc<CudaStream>, w: &HostWeight) -> Result<CudaWeight> {
        const OP: &str = "upload_weight";
        let fmt = Fmt::of(w.dtype).ok_or_else(|| BackendError::Unsupported {
            op: OP,
            what: format!("weight type {} ('{}') on CUDA", w.dtype, w.name),
        })?;
        let (n_exp, n_out, n_in) = match w.shape[..] {
            [n_out, n_in] => (1, n_out, n_in),
            [e, n_out, n_in] => (e, n_out, n_in),
            _ => {
                return shape_err(
                    OP,
                    format!("'{}' is neither 2-D nor 3-D: {:?}", w.name, w.shape),
                )
            }
        };
        if n_exp == 0 || n_out == 0 || n_in == 0 {
            return shape_err(OP, format!("'{}' is empty: {:?}", w.name, w.shape));
        }
        let Some(row_bytes) = w.dtype.row_bytes(n_in) else {
            return Err(BackendError::Unsupported {
                op: OP,
                what: format!(
                    "'{}': rows of {n_in} elements are not whole {}-element {} blocks",
                    w.name,
                    w.dtype.block_size(),
                    w.dtype
                ),
            });
        };
        let n_rows = mul(OP, n_exp, n_out)?;
        let want = mul(OP, n_rows, row_bytes)?;
        if w.bytes.len() != want {
            return shape_err(
                OP,
                format!(
                    "'{}' has {} bytes, shape {:?} needs {want}",
                    w.name,
                    w.bytes.len(),
                    w.shape
                ),
            );
        }
        i32_arg(OP, "n_in", n_in)?;
        i32_arg(OP, "rows", n_rows)?;
        let (img, off, stride) = device_image(fmt, w.dtype, w.bytes.as_slice(), n_rows, n_in);
        let buf = stream.clone_htod(img.as_ref()).map_err(dev_err)?;
        Ok(CudaWeight {
            name: w.name.clone(),
            dtype: w.dtype,
            fmt,
            n_exp,
            n_out,
            n_in,
            buf,
            off,
            stride,
        })
    }

    /// `y[n_tok, n_out] = x[n_tok, n_in] @ w^T` for a 2-D weight (device buffers of at least
    /// those lengths; only the leading elements are used or written). `n_tok == 0` does
    /// nothing.
    pub(crate) fn matmul(
        &self,
        stream: &Arc<CudaStream>,
        blas: &CudaBlas,
        w: &CudaWeight,
        x: &CudaSlice<f32>,
        n_tok: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if w.n_exp != 1 {
            return shape_err(
                "matmul",
                format!(
                    "'{}' is a stack of {} experts (use matmul_rows)",
                    w.name, w.n_exp
                ),
            );
        }
        let rows = 0..w.n_out;
        self.matmul_rows(
            stream,
            blas,
            w,
            0,
            rows,
            &x.as_view(),
            n_tok,
            &mut y.as_view_mut(),
        )
    }

    /// `y = (ep.accumulate ? y : 0) + (x @ w^T + ep.bias)` through the GEMV kernels' epilogue,
    /// for a 2-D weight at most [`GEMV_SPLIT_MAX_TOKENS`] tokens the GEMV takes; `Ok(false)`
    /// (nothing queued) otherwise, and the caller composes the ops. Buffers as in `matmul`,
    /// the bias `[n_out]`; `x8` the int8 form of x's rows where it came with them
    /// ([`gemv::x8_mode`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_epilogue(
        &self,
        stream: &Arc<CudaStream>,
        w: &CudaWeight,
        x: &CudaSlice<f32>,
        x8: Option<&CudaSlice<u8>>,
        n_tok: usize,
        y: &mut CudaSlice<f32>,
        ep: GemvEpilogue<'_>,
    ) -> Result<bool> {
        const OP: &str = "matmul_with";
        if w.n_exp != 1 || n_tok == 0 || n_tok > GEMV_SPLIT_MAX_TOKENS || !w.gemv_ok() {
            return Ok(false);
        }
        let (n_rows, n_in) = (w.n_out, w.n_in);
        if x.len() < mul(OP, n_tok, n_in)? || y.len() < mul(OP, n_tok, n_rows)? {
            return shape_err(
                OP,
                format!("x or y too short for [{n_tok}, {n_in}] -> [{n_tok}, {n_rows}]"),
            );
        }
        if ep.bias.is_some_and(|b| b.len() < n_rows) {
            return shape_err(OP, format!("the bias has fewer than {n_rows} elements"));
        }
        i32_arg(OP, "n_tok * n_in", n_tok * n_in)?;
        i32_arg(OP, "n_tok * rows", n_tok * n_rows)?;
        let (x, mut y) = (x.as_view(), y.as_view_mut());
        self.gemv_tokens(stream, w, 0, n_rows, (&x, x8), n_tok, &mut y, ep)?;
        Ok(true)
    }

    /// Rows `rows` of expert `expert` (0 for a 2-D weight): `y[t, i] = x[t, :] .
    /// W[expert, rows.start + i, :]`, x `[n_tok, n_in]`, y `[n_tok, rows.len()]` (row stride
    /// `rows.len()`), views of at least those lengths. x must start 16-byte aligned (any
    /// whole-buffer view and any offset that is a multiple of 4 elements). Empty rows or
    /// `n_tok == 0` do nothing.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_rows(
        &self,
        stream: &Arc<CudaStream>,
        blas: &CudaBlas,
        w: &CudaWeight,
        expert: usize,
        rows: Range<usize>,
        x: &CudaView<'_, f32>,
        n_tok: usize,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const OP: &str = "matmul";
        if expert >= w.n_exp {
            return shape_err(
                OP,
                format!("expert {expert} of '{}' with {} experts", w.name, w.n_exp),
            );
        }
        if rows.start > rows.end || rows.end > w.n_out {
            return shape_err(
                OP,
                format!("rows {rows:?} of '{}' with {} rows", w.name, w.n_out),
            );
        }
        let n_rows = rows.len();
        if n_rows == 0 || n_tok == 0 {
            return Ok(());
        }
        let nx = mul(OP, n_tok, w.n_in)?;
        let ny = mul(OP, n_tok, n_rows)?;
        if x.len() < nx {
            return shape_err(
                OP,
                format!(
                    "x has {} elements, [{n_tok}, {}] needs {nx}",
                    x.len(),
                    w.n_in
                ),
            );
        }
        if y.len() < ny {
            return shape_err(
                OP,
                format!("y has {} elements, [{n_tok}, {n_rows}] needs {ny}", y.len()),
            );
        }
        i32_arg(OP, "n_tok * n_in", nx)?;
        i32_arg(OP, "n_tok * rows", ny)?;
        let row0 = expert * w.n_out + rows.start;
        if n_tok > GEMV_SPLIT_MAX_TOKENS || !w.gemv_ok() {
            return self.gemm(stream, blas, w, row0, n_rows, x, n_tok, y);
        }
        self.gemv_tokens(
            stream,
            w,
            row0,
            n_rows,
            (x, None),
            n_tok,
            y,
            GemvEpilogue::default(),
        )
    }

    /// The GEMV over `n_tok` tokens in launches of up to [`GEMV_MAX_TOKENS`] (views checked
    /// by the caller); x with its rows' int8 form where that came with them.
    #[allow(clippy::too_many_arguments)]
    fn gemv_tokens(
        &self,
        stream: &Arc<CudaStream>,
        w: &CudaWeight,
        row0: usize,
        n_rows: usize,
        (x, x8): (&CudaView<'_, f32>, Option<&CudaSlice<u8>>),
        n_tok: usize,
        y: &mut CudaViewMut<'_, f32>,
        ep: GemvEpilogue<'_>,
    ) -> Result<()> {
        let mut parts = [GemvPart {
            w,
            row0,
            n_rows,
            y,
            ep,
        }];
        self.gemv_parts(stream, &mut parts, x, x8, n_tok, false)
    }

    /// `out[i, :] = dequant(w[ids[i], :])` for `i < n` (2-D weight; `ids` and `out` device
    /// buffers of at least `n` and `n * n_in` elements). Ids `>= n_out` give zero rows.
    pub(crate) fn embed(
        &self,
        stream: &Arc<CudaStream>,
        w: &CudaWeight,
        ids: &CudaSlice<u32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        const OP: &str = "embed";
        if w.n_exp != 1 {
            return shape_err(
                OP,
                format!("'{}' is a stack of {} experts", w.name, w.n_exp),
            );
        }
        if ids.len() < n {
            return shape_err(OP, format!("{} ids for {n} rows", ids.len()));
        }
        let total = mul(OP, n, w.n_in)?;
        if out.len() < total {
            return shape_err(
                OP,
                format!(
                    "out has {} elements, [{n}, {}] needs {total}",
                    out.len(),
                    w.n_in
                ),
            );
        }
        if n == 0 {
            return Ok(());
        }
        let n_rows = i32_arg(OP, "rows", n)?;
        let n_in = i32_arg(OP, "n_in", w.n_in)?;
        let row0 = 0u64;
        let n_src = w.n_out as u64;
        if w.fmt.is_float() {
            let f = &self.gather[w.fmt.id()];
            let cfg = self.elem_cfg(total);
            let mut b = stream.kernel(f);
            b.arg(&w.buf)
                .arg(ids)
                .arg(&row0)
                .arg(&n_src)
                .arg(&n_rows)
                .arg(&n_in)
                .arg(out);
            // SAFETY: gather_<ty>(w, ids, row0, n_src_rows, n_rows, n_in, out): `w` holds n_out
            // rows of n_in elements, every id is bounds-checked against n_src_rows = n_out in
            // the kernel, `ids` holds >= n entries and `out` >= n * n_in floats (checked above).
            unsafe { b.launch(cfg) }.map_err(dev_err)?;
        } else {
            let f = self.dequant_fn(&self.dequant_f32, w)?;
            let cfg = self.elem_cfg(total / w.fmt.chunk());
            let mut b = stream.kernel(f);
            b.arg(&w.buf)
                .arg(&w.off[0])
                .arg(&w.off[1])
                .arg(&w.off[2])
                .arg(&w.stride)
                .arg(ids)
                .arg(&row0)
                .arg(&n_src)
                .arg(&n_rows)
                .arg(&n_in)
                .arg(out);
            // SAFETY: dequant_<ty>_f32(w, off1..3, stride, ids, row0, n_src_rows, n_rows, n_in,
            // out): the image and its plane offsets/stride come from `upload`; ids are checked
            // against n_src_rows = n_out in the kernel; `ids` holds >= n entries and `out`
            // >= n * n_in floats (checked above); n_in is a multiple of the chunk.
            unsafe { b.launch(cfg) }.map_err(dev_err)?;
        }
        Ok(())
    }

    // ---- internals --------------------------------------------------------------------------

    /// A grid-stride launch of `n` work items (one thread each).
    fn elem_cfg(&self, n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(ELEM_THREADS as usize).clamp(1, self.sms * 32);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (ELEM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn dequant_fn<'a>(
        &self,
        table: &'a [Option<CudaFunction>],
        w: &CudaWeight,
    ) -> Result<&'a CudaFunction> {
        table[w.fmt.id()]
            .as_ref()
            .ok_or_else(|| BackendError::Unsupported {
                op: "matmul",
                what: format!("dequantising {} rows", w.dtype),
            })
    }

    /// Round `x[..n]` to f16 (`bf16 == false`) or bf16 into the x16 scratch buffer.
    fn convert_x<'s>(
        &self,
        stream: &Arc<CudaStream>,
        slot: &'s mut Option<CudaSlice<u16>>,
        x: &CudaView<'_, f32>,
        n: usize,
        bf16: bool,
    ) -> Result<&'s mut CudaSlice<u16>> {
        let x16 = grow(slot, stream, n)?;
        let f = if bf16 { &self.cvt_bf16 } else { &self.cvt_f16 };
        let n64 = n as u64;
        let mut b = stream.kernel(f);
        b.arg(x).arg(&mut *x16).arg(&n64);
        // SAFETY: cvt_f32_<ty>(x, out, n): x holds >= n floats (checked by the caller), out
        // >= n 16-bit values (grown above).
        unsafe { b.launch(self.elem_cfg(n)) }.map_err(dev_err)?;
        Ok(x16)
    }

    /// The cuBLAS path (more than [`GEMV_SPLIT_MAX_TOKENS`] tokens, or float rows of partial
    /// chunks).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        stream: &Arc<CudaStream>,
        blas: &CudaBlas,
        w: &CudaWeight,
        row0: usize,
        n_rows: usize,
        x: &CudaView<'_, f32>,
        n_tok: usize,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let n_in = w.n_in;
        let k = i32_arg(OP, "n_in", n_in)?;
        let n = i32_arg(OP, "n_tok", n_tok)?;
        let ldy = i32_arg(OP, "rows", n_rows)?;
        let handle = *blas.handle();
        let alpha = 1.0f32;
        let beta = 0.0f32;
        let (wp, _w_sync) = w.buf.device_ptr(stream);
        let (yp, _y_sync) = y.device_ptr_mut(stream);
        let w_rows = wp + (row0 * w.row_bytes()) as u64;
        if w.fmt == Fmt::F32 {
            let (xp, _x_sync) = x.device_ptr(stream);
            set_math(handle, blas_sys::cublasMath_t::CUBLAS_PEDANTIC_MATH)?;
            // SAFETY: column-major y^T [n_rows, n_tok] (ld n_rows) = W_rows [n_rows, n_in]
            // (row-major, i.e. column-major [n_in, n_rows] transposed, ld n_in) x x^T
            // [n_in, n_tok] (row-major x, ld n_in): every pointer is a live device buffer of
            // at least those sizes (weights from `upload`, x and y checked by the caller).
            let r = unsafe {
                blas_result::sgemm(
                    handle,
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    ldy,
                    n,
                    k,
                    &alpha,
                    w_rows as *const f32,
                    k,
                    xp as *const f32,
                    k,
                    &beta,
                    yp as *mut f32,
                    ldy,
                )
            };
            let restore = set_math(handle, blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH);
            r.map_err(blas_err)?;
            return restore;
        }

        let mut guard = self
            .scratch
            .lock()
            .map_err(|_| BackendError::Device("matmul scratch lock poisoned".into()))?;
        let scratch = &mut *guard;
        let nx = n_tok * n_in;
        set_math(handle, blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH)?;
        if matches!(w.fmt, Fmt::F16 | Fmt::Bf16) {
            let bf16 = w.fmt == Fmt::Bf16;
            let x16 = self.convert_x(stream, &mut scratch.x16, x, nx, bf16)?;
            let (xp, _x_sync) = x16.device_ptr(stream);
            let ty = if bf16 {
                blas_sys::cudaDataType::CUDA_R_16BF
            } else {
                blas_sys::cudaDataType::CUDA_R_16F
            };
            // SAFETY: as the sgemm above, with W_rows and x^T in `ty` (x rounded into the
            // scratch buffer of >= n_tok * n_in elements) and y in f32.
            return unsafe { gemm_ex(handle, ldy, n, k, w_rows, xp, ty, yp, ldy) };
        }

        // quantised: dequantise tiles of rows into f16, then f16 x f16 -> f32
        let dequant = self.dequant_fn(&self.dequant_f16, w)?;
        let tile = (GEMM_TILE_ELEMS / n_in).clamp(1, n_rows);
        let x16 = self.convert_x(stream, &mut scratch.x16, x, nx, false)?;
        let (xp, _x_sync) = x16.device_ptr(stream);
        let w16 = grow(&mut scratch.w16, stream, tile * n_in)?;
        let null_ids = 0u64;
        let n_src = (w.n_exp * w.n_out) as u64;
        let mut r0 = 0;
        while r0 < n_rows {
            let tr = tile.min(n_rows - r0);
            let tr_i = tr as i32;
            let tile_row0 = (row0 + r0) as u64;
            {
                let mut b = stream.kernel(dequant);
                b.arg(&w.buf)
                    .arg(&w.off[0])
                    .arg(&w.off[1])
                    .arg(&w.off[2])
                    .arg(&w.stride)
                    .arg(&null_ids)
                    .arg(&tile_row0)
                    .arg(&n_src)
                    .arg(&tr_i)
                    .arg(&k)
                    .arg(&mut *w16);
                // SAFETY: dequant_<ty>_f16 with no ids: rows tile_row0 .. + tr exist (the
                // caller checked row0 + n_rows against the weight), the scratch holds
                // tile * n_in >= tr * n_in halves, n_in is a multiple of the chunk.
                unsafe { b.launch(self.elem_cfg(tr * n_in / w.fmt.chunk())) }.map_err(dev_err)?;
            }
            let (w16p, _w16_sync) = w16.device_ptr(stream);
            // SAFETY: as the sgemm above, for the tile: W16 [tr, n_in] f16 (scratch), x^T f16
            // (scratch), y^T rows r0 .. r0 + tr (pointer offset r0 floats, ld n_rows).
            unsafe {
                gemm_ex(
                    handle,
                    tr_i,
                    n,
                    k,
                    w16p,
                    xp,
                    blas_sys::cudaDataType::CUDA_R_16F,
                    yp + (r0 * 4) as u64,
                    ldy,
                )
            }?;
            r0 += tr;
        }
        Ok(())
    }
}

/// Set the cuBLAS math mode of `handle`.
fn set_math(handle: blas_sys::cublasHandle_t, mode: blas_sys::cublasMath_t) -> Result<()> {
    // SAFETY: `handle` is the live handle of the backend's `CudaBlas` (borrowed by the caller
    // for the duration of the call); setting the math mode is a host-side setting.
    unsafe { blas_sys::cublasSetMathMode(handle, mode) }
        .result()
        .map_err(blas_err)
}

/// `cublasGemmEx`: column-major `c [m, n]` (ld `ldc`, f32) = `a^T` (`a`: `[m, k]`
/// row-major of `ty`, i.e. column-major `[k, m]`, ld k) x `b` (column-major `[k, n]` of `ty`,
/// ld k), f32 compute.
///
/// # Safety
/// `a`, `b`, `c` must be live device buffers of at least `m * k`, `k * n` elements of `ty`
/// and `(n - 1) * ldc + m` floats, on the stream the handle is bound to.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_ex(
    handle: blas_sys::cublasHandle_t,
    m: i32,
    n: i32,
    k: i32,
    a: u64,
    b: u64,
    ty: blas_sys::cudaDataType,
    c: u64,
    ldc: i32,
) -> Result<()> {
    let alpha = 1.0f32;
    let beta = 0.0f32;
    // SAFETY: the caller's contract; alpha and beta are host f32 scalars, as
    // CUBLAS_COMPUTE_32F with the default (host) pointer mode reads them.
    unsafe {
        blas_result::gemm_ex(
            handle,
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            m,
            n,
            k,
            (&alpha) as *const f32 as *const c_void,
            a as *const c_void,
            ty,
            k,
            b as *const c_void,
            ty,
            k,
            (&beta) as *const f32 as *const c_void,
            c as *mut c_void,
            blas_sys::cudaDataType::CUDA_R_32F,
            ldc,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(blas_err)
}

/// Test and benchmark hooks for tests/gpu_matmul.rs (not part of the backend API; hidden from
/// the docs). They upload their own copies of the weight and synchronise the stream.
impl crate::CudaBackend {
    /// [`MatmulKernels::matmul_rows`] of `w` (uploaded as one device matrix, so a 3-D weight
    /// stays a stack) for host activations `x [n_tok, n_in]`; returns `y [n_tok, rows.len()]`.
    #[doc(hidden)]
    pub fn debug_matmul_rows(
        &self,
        w: &HostWeight,
        expert: usize,
        rows: Range<usize>,
        x: &[f32],
        n_tok: usize,
    ) -> Result<Vec<f32>> {
        let cw = self.mm.upload(&self.stream, w)?;
        let xd = self.stream.clone_htod(x).map_err(dev_err)?;
        let ny = mul("debug_matmul_rows", n_tok, rows.len())?;
        let mut yd = self.stream.alloc_zeros::<f32>(ny.max(1)).map_err(dev_err)?;
        self.mm.matmul_rows(
            &self.stream,
            &self.blas,
            &cw,
            expert,
            rows,
            &xd.as_view(),
            n_tok,
            &mut yd.as_view_mut(),
        )?;
        let mut y = self.stream.clone_dtoh(&yd).map_err(dev_err)?;
        self.stream.synchronize().map_err(dev_err)?;
        y.truncate(ny);
        Ok(y)
    }

    /// Microseconds of each of `reps` calls of [`MatmulKernels::matmul`] of `w` at `n_tok`
    /// tokens (zero activations), each bracketed by CUDA events, after `warmup` calls.
    #[doc(hidden)]
    pub fn debug_time_matmul(
        &self,
        w: &HostWeight,
        n_tok: usize,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<f32>> {
        const OP: &str = "debug_time_matmul";
        let cw = self.mm.upload(&self.stream, w)?;
        let xd = self
            .stream
            .alloc_zeros::<f32>(mul(OP, n_tok, cw.n_in)?.max(1))
            .map_err(dev_err)?;
        let mut yd = self
            .stream
            .alloc_zeros::<f32>(mul(OP, n_tok, cw.n_out)?.max(1))
            .map_err(dev_err)?;
        for _ in 0..warmup {
            self.mm
                .matmul(&self.stream, &self.blas, &cw, &xd, n_tok, &mut yd)?;
        }
        let ev = || {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(dev_err)
        };
        let (start, end) = (ev()?, ev()?);
        let mut us = Vec::with_capacity(reps);
        for _ in 0..reps {
            start.record(&self.stream).map_err(dev_err)?;
            self.mm
                .matmul(&self.stream, &self.blas, &cw, &xd, n_tok, &mut yd)?;
            end.record(&self.stream).map_err(dev_err)?;
            us.push(start.elapsed_ms(&end).map_err(dev_err)? * 1000.0);
        }
        self.stream.synchronize().map_err(dev_err)?;
        Ok(us)
    }
}

/// CPU checks of the device layouts and the kernels' index arithmetic: a line-by-line Rust
/// mirror of kernels/quant.cuh's loaders and decoders (`emu_*`) is run over the planar /
/// GGUF images `device_image` builds and compared with the scalar CPU backend: `exact4`
/// bit-exactly with its embedding gather (`dequantize_row`), the GEMV's biased-float sums
/// with an f64 dot product of the dequantised rows. No GPU needed.
#[cfg(test)]
mod tests;
