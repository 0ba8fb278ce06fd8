//! The GEMV launches (kernels/matmul.cu `gemv_<ty>_<nt>`): one product, several products of
//! one format over the same activations in one launch (q/k/v), and the gate/up pair of a
//! SwiGLU MLP with `silu(gate) * up` in the epilogue.
//!
//! # Contract
//! - Every launch takes a [`GemvArgs`] by value, the `#[repr(C)]` twin of the kernel's
//!   `GemvArgs` (same field order and types; change both together).
//! - x is `[n_tok, n_in]` f32, 16-byte aligned; each part's y is `[n_tok, n_rows]` (row stride
//!   `n_rows`); launches take up to [`GEMV_MAX_TOKENS`] tokens, more are split.
//! - The parts of one launch share the format and `n_in` (the callers check it and fall back to
//!   one launch per product otherwise). Results are the same as one launch per product up to
//!   the order of the final f32 additions (the K split may differ).
//! - Rows of fewer than 32 chunks (an MoE's down projections) give each row group fewer lanes
//!   and a warp several row groups (`GemvArgs::lpr`), so no lane idles
//!   (`KAPITSA_GEMV_LPR=0`: 32 lanes a row group always).
//! - `KAPITSA_GEMV_PREFETCH=0` issues the weight loads after the PDL wait instead of before,
//!   `KAPITSA_GEMV_FUSE=0` turns the multi-product and gate/up launches off, and
//!   `KAPITSA_GEMV_XS=0` the one-token kernels with x staged in shared memory (`2`: for every
//!   one-token launch; default: launches of more blocks than fit at once) (for measurements).
//! - Int8 activations (`gemv_x8_<ty>`, `gemv_id_x8_<ty>`: Q4_K, Q6_K; one-token and routed
//!   launches): the activations quantised to int8 per 32 elements (as llama.cpp's CUDA
//!   backend does with q8_1) and each 4 weights cost one `__dp4a`. The quantisation is free
//!   where the rows come from a pre-norm: `rms_norm_to` writes their int8 form beside them
//!   (src/buffers.rs `X8Rows`) and the launches take it as `x8`. A launch of its own
//!   (`quantize_x8_f32`) costs more than the cheaper inner loop saves at decode sizes
//!   (BENCHMARKS.md, 2026-12-06). `KAPITSA_GEMV_X8` ([`x8_mode`]): `norm` (the default) the
//!   int8 kernels where the norm wrote the rows, `1` every launch of those formats
//!   (quantising where needed), `0` never.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig,
};
use kapitsa_backend::{shape_err, Result};

use super::{
    i32_arg, CudaWeight, Fmt, GemvEpilogue, MatmulKernels, GEMV_MAX_TOKENS, GEMV_ROWS, GEMV_WARPS,
};
use crate::device::{dev_err, grid_yz};
use crate::launch::{host_arg, KernelLaunch};

/// Most products of one launch (kernels/matmul.cu `GEMV_MAX_PARTS`).
pub(crate) const GEMV_MAX_PARTS: usize = 4;

/// kernels/matmul.cu `GEMV_PREFETCH`, `GEMV_GLU`.
const FLAG_PREFETCH: i32 = 1;
const FLAG_GLU: i32 = 2;

env_switch! {
    /// Whether the GEMV loads its first weights before the PDL wait (`KAPITSA_GEMV_PREFETCH`).
    fn prefetch_on = "KAPITSA_GEMV_PREFETCH"
}

/// When one-token launches take the staged-activation kernels `gemv_<ty>_1xs`
/// (`KAPITSA_GEMV_XS`): `0` never, `2` always, else (the default) when the row-group blocks
/// do not all fit on the GPU at once (the staging is then paid once per resident block for
/// several rounds; a launch of one round is latency-bound and does better without it).
fn xs_mode() -> u8 {
    static CELL: OnceLock<u8> = OnceLock::new();
    *CELL.get_or_init(|| match std::env::var("KAPITSA_GEMV_XS").as_deref() {
        Ok("0") => 0,
        Ok("2") => 2,
        _ => 1,
    })
}

/// Most dynamic shared memory a `gemv_<ty>_1xs` launch takes (the kernels' attribute is
/// raised to it at load); wider rows take the other kernels.
pub(crate) const XS_MAX_SMEM: usize = 96 * 1024;

/// Shared memory of an SM a kernel's blocks can have, and what each block reserves (sm_90).
const SM_SMEM: usize = 228 * 1024;
const BLOCK_SMEM_RESERVED: usize = 1024 + 128;

/// Bytes of the staged activations of a row of `n_in` elements (kernels/matmul.cu
/// `gemv_xs_idx`: 4 floats of padding after every 64).
fn xs_bytes(n_in: usize) -> usize {
    4 * (n_in + 4 * n_in.div_ceil(64))
}

/// Which one-token and routed launches of the formats that have int8-activation kernels
/// take them (`KAPITSA_GEMV_X8`, see the module's contract).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum X8Mode {
    /// Never (`0`).
    Off,
    /// Every launch whose rows a pre-norm wrote in int8 (`norm`, the default).
    Norm,
    /// Every launch, quantising the rows first where no int8 form came with them (`1`).
    Always,
}

impl X8Mode {
    fn parse(v: Option<&str>) -> X8Mode {
        match v {
            Some("0") => X8Mode::Off,
            Some("1") => X8Mode::Always,
            _ => X8Mode::Norm,
        }
    }

    /// Whether a launch takes the int8 kernel, given whether its rows came with their int8
    /// form.
    fn takes(self, given: bool) -> bool {
        match self {
            X8Mode::Off => false,
            X8Mode::Norm => given,
            X8Mode::Always => true,
        }
    }
}

/// The process's [`X8Mode`] (`KAPITSA_GEMV_X8`, read once).
pub(crate) fn x8_mode() -> X8Mode {
    static CELL: OnceLock<X8Mode> = OnceLock::new();
    *CELL.get_or_init(|| X8Mode::parse(std::env::var("KAPITSA_GEMV_X8").ok().as_deref()))
}

/// Most rows a pre-norm writes in int8 as well: the routed launches' token limit (one-token
/// launches need one).
const X8_NORM_MAX_ROWS: usize = 16;

/// Whether `rms_norm_to` of `rows` rows of `width` writes their int8 form too: a mode that
/// reads it, rows the GEMVs can take, and a width of whole 32-element blocks.
pub(crate) fn x8_from_norm(rows: usize, width: usize) -> bool {
    x8_mode() != X8Mode::Off && rows <= X8_NORM_MAX_ROWS && width.is_multiple_of(32)
}

/// Whether a grid of `blocks` 128-thread blocks fits `sms` multiprocessors in one wave at 5
/// blocks per SM but not at 4 (where `gemv_id5_q4_k` pays).
fn one_wave_at_5_only(blocks: usize, sms: usize) -> bool {
    blocks > 4 * sms && blocks <= 5 * sms
}

env_switch! {
    /// Whether routed Q4_K launches whose grid fits the GPU in one wave at 5 blocks per SM but
    /// not at 4 take `gemv_id5_q4_k` (registers for 5 blocks per SM, a few spilled: a decode's
    /// 9 pairs of Qwen3.6's 2048-wide rows; tg128 +1-4% on an H100; on Qwen3-30B-A3B's
    /// 768-block launches, two waves either way, it lost 3%, so those keep `gemv_id_q4_k`).
    /// `KAPITSA_GEMV_ID5=0`: `gemv_id_q4_k` always.
    fn id5_on = "KAPITSA_GEMV_ID5"
}

/// Bytes of one activation row of `n_in` elements in the int8 layout of kernels/matmul.cu
/// `gemv_chunk_x8` (quants, a scale per 32, a sum per 16): common.cuh `gemv_x8_row_bytes`.
pub(crate) fn x8_row_bytes(n_in: usize) -> usize {
    n_in + n_in / 8 + n_in / 4
}

env_switch! {
    /// Whether products are fused into one launch (`KAPITSA_GEMV_FUSE`).
    pub(crate) fn fuse_on = "KAPITSA_GEMV_FUSE"
}

/// kernels/matmul.cu `GemvPart`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PartArgs {
    w: u64,
    off1: u64,
    off2: u64,
    off3: u64,
    stride: u64,
    row0: u64,
    y: u64,
    bias: u64,
    n_rows: i32,
    ldy: i32,
    accumulate: i32,
    block0: i32,
}

impl PartArgs {
    /// The kernel's view of part `p`: its weight image, rows, y from token `t0` (row stride
    /// `n_rows`), epilogue, and its first block `block0`.
    fn of(
        op: &'static str,
        stream: &Arc<CudaStream>,
        p: &mut GemvPart<'_, '_>,
        t0: usize,
        block0: usize,
    ) -> Result<PartArgs> {
        let w = p.w;
        Ok(PartArgs {
            w: w.buf.device_ptr(stream).0,
            off1: w.off[0],
            off2: w.off[1],
            off3: w.off[2],
            stride: w.stride,
            row0: p.row0 as u64,
            y: p.y.device_ptr_mut(stream).0 + (t0 * p.n_rows * 4) as u64,
            bias: p.ep.bias.map_or(0, |b| b.device_ptr(stream).0),
            n_rows: i32_arg(op, "rows", p.n_rows)?,
            ldy: i32_arg(op, "rows", p.n_rows)?,
            accumulate: i32::from(p.ep.accumulate),
            block0: i32_arg(op, "blocks", block0)?,
        })
    }
}

/// kernels/matmul.cu `GemvArgs`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct GemvArgs {
    part: [PartArgs; GEMV_MAX_PARTS],
    x: u64,
    n_parts: i32,
    n_in: i32,
    ksplit: i32,
    flags: i32,
    vblocks: i32,
    lpr: i32,
}

host_arg!(GemvArgs);

/// kernels/matmul.cu `GemvIdArgs`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemvIdArgs {
    ids: u64,
    rpe: [u64; GEMV_MAX_PARTS],
    x_div: i32,
    n_exp: i32,
    n_routed: i32,
    shared_part: i32,
    shared_x0: i32,
    unused: i32,
}

host_arg!(GemvIdArgs);

/// kernels/matmul.cu `GemvSumArgs`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemvSumArgs {
    w: u64,
    g: u64,
    sh: u64,
    k: i32,
    shared: i32,
}

host_arg!(GemvSumArgs);

/// Threads of a `gemv_id_sum_<ty>` block (kernels/matmul.cu `GEMV_SUM_WARPS` warps).
const GEMV_SUM_THREADS: u32 = 8 * 32;

env_switch! {
    /// Whether Q4_K/Q6_K down rows of 9 to 16 chunks take `gemv_id_sum4_<ty>`
    /// (`KAPITSA_MOE_DOWN_SUM4=0`: the down launch and the combining kernel, as before).
    pub(crate) fn sum4_on = "KAPITSA_MOE_DOWN_SUM4"
}

/// The combination [`MatmulKernels::gemv_id_sum`] applies (all device buffers).
pub(crate) struct MoeSum<'a> {
    /// Tokens.
    pub(crate) n_tok: usize,
    /// Routed experts per token: pair `t * top_k + j` is token t's slot j.
    pub(crate) top_k: usize,
    /// The routing weights `[n_tok, top_k]`.
    pub(crate) weights: &'a CudaView<'a, f32>,
    /// The shared expert's gate per token `[n_tok]` (1 without).
    pub(crate) gate: Option<&'a CudaView<'a, f32>>,
    /// The shared expert's down projection riding in the launch: a 2-D twin of the routed
    /// stack (format, width, at least its rows) whose pair for token t reads x row `x0 + t`.
    pub(crate) twin: Option<(&'a CudaWeight, usize)>,
    /// A shared expert's output computed apart, `[n_tok, n_rows]`, added times g.
    pub(crate) sh: Option<&'a CudaView<'a, f32>>,
}

/// One product of a launch: rows `row0 .. row0 + n_rows` of `w` (global row index, experts
/// stacked) into `y` (`[n_tok, n_rows]`), with an epilogue.
pub(crate) struct GemvPart<'a, 'y> {
    pub(crate) w: &'a CudaWeight,
    pub(crate) row0: usize,
    pub(crate) n_rows: usize,
    pub(crate) y: &'a mut CudaViewMut<'y, f32>,
    pub(crate) ep: GemvEpilogue<'a>,
}

/// Row-group warps the GEMV of `groups` row groups of `n_chunks` chunks spreads over K:
/// split (2 or 4 warps per row group, at most `max`) while the grid is under about two waves
/// of `warps_per_sm` warps per SM and every lane still gets a chunk.
pub(super) fn ksplit(
    groups: usize,
    n_chunks: usize,
    sms: usize,
    warps_per_sm: usize,
    max: usize,
) -> usize {
    let target = 2 * sms * warps_per_sm;
    let mut g = 1;
    while g < max && groups * g < target && n_chunks >= 32 * 2 * g {
        g *= 2;
    }
    g
}

/// Lanes per row group (kernels/matmul.cu `GemvArgs::lpr`) for rows of `n_chunks` chunks
/// against `nt` tokens: 32 where rows have that many chunks, else the power of two that
/// covers them (at least the `nt * GEMV_ROWS` sums a sub-group keeps), so no lane idles.
fn lanes_per_row(n_chunks: usize, nt: usize) -> usize {
    if !lpr_on() {
        return 32;
    }
    n_chunks
        .next_power_of_two()
        .clamp((nt * GEMV_ROWS).next_power_of_two(), 32)
}

env_switch! {
    /// Whether rows of few chunks share a warp ([`lanes_per_row`]; `KAPITSA_GEMV_LPR=0`:
    /// one row group a warp always, for measurements).
    fn lpr_on = "KAPITSA_GEMV_LPR"
}

/// The routing of an expert-routed GEMV ([`MatmulKernels::gemv_id`]).
pub(crate) struct GemvRoute<'a> {
    /// Expert id of each pair `[n_pairs]` (device); ids `>= n_exp` leave the pair's rows
    /// unwritten. With `tiles`: `n_pairs` tiles of 3 u32 each instead (see there).
    pub(crate) ids: &'a CudaView<'a, u32>,
    /// Pairs, or tiles (grid rows).
    pub(crate) n_pairs: usize,
    /// Pair q reads x row `q / x_div` (1 with `tiles`).
    pub(crate) x_div: usize,
    /// The expert-grouped form (kernels/matmul.cu `gemv_grp_<ty>`): x and y rows are pairs
    /// sorted by expert, and tile i = `ids[3i .. 3i + 3]` = (expert, first row, count <= 8)
    /// runs that expert on those rows; x holds 7 rows past the last tile's.
    pub(crate) tiles: bool,
    /// A shared expert riding in the launch (not with `tiles`): `tokens` more pairs after
    /// the routed ones, pair `n_pairs + t` running the twins of the parts on x row `x0 + t`
    /// into the parts' y at row `n_pairs + t`.
    pub(crate) shared: Option<SharedPairs<'a>>,
}

/// The shared-expert pairs of a routed launch ([`GemvRoute::shared`]).
#[derive(Clone, Copy)]
pub(crate) struct SharedPairs<'a> {
    /// Pairs (one per token).
    pub(crate) tokens: usize,
    /// The x row of the first one.
    pub(crate) x0: usize,
    /// One 2-D matrix per part (same format and width as the parts, at least their rows),
    /// its rows from 0.
    pub(crate) twins: &'a [&'a CudaWeight],
}

impl MatmulKernels {
    /// `rows` rows of `x` (`[rows, n_in]` f32, n_in a multiple of 32) quantised into a new
    /// device buffer of int8 rows (kernels/matmul.cu `quantize_x8_f32`), for the
    /// `gemv_x8` kernels. The buffer is stream-ordered: freed after the launches queued
    /// before it is dropped.
    fn quantize_x8(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaView<'_, f32>,
        rows: usize,
        n_in: usize,
    ) -> Result<cudarc::driver::CudaSlice<u8>> {
        const OP: &str = "matmul";
        if !n_in.is_multiple_of(32) || x.len() < rows * n_in {
            return shape_err(
                OP,
                "int8 activations: n_in not a multiple of 32, or x too short",
            );
        }
        // SAFETY: the kernel below writes every byte of the `rows` rows before any read.
        let mut q =
            unsafe { stream.alloc::<u8>((rows * x8_row_bytes(n_in)).max(1)) }.map_err(dev_err)?;
        let threads = rows * n_in; // one warp per 32 elements
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(256).clamp(1, 1 << 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ni, nr) = (i32_arg(OP, "n_in", n_in)?, i32_arg(OP, "rows", rows)?);
        let mut b = stream.kernel(&self.quantize_x8);
        b.arg(x).arg(&mut q).arg(&ni).arg(&nr);
        // SAFETY: quantize_x8_f32(const float* x, uint8_t* out, int n_in, int n_tok): x holds
        // rows * n_in floats (checked), out rows * x8_row_bytes(n_in) bytes (allocated above),
        // n_in a multiple of 32 (checked); the grid-stride loop covers every warp.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(q)
    }

    /// The int8 rows a launch over `rows` rows of `x` reads where [`x8_mode`] takes the int8
    /// kernel: `given` (the rows' int8 form that came with them), else (mode `1`) those rows
    /// quantised into `own`; `None`: the f32 kernel.
    fn x8_input<'a>(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaView<'_, f32>,
        given: Option<&'a CudaSlice<u8>>,
        rows: usize,
        n_in: usize,
        own: &'a mut Option<CudaSlice<u8>>,
    ) -> Result<Option<&'a CudaSlice<u8>>> {
        if !x8_mode().takes(given.is_some()) {
            return Ok(None);
        }
        Ok(Some(match given {
            Some(q) => q,
            None => own.insert(self.quantize_x8(stream, x, rows, n_in)?),
        }))
    }

    /// The expert-routed GEMV (kernels/matmul.cu `gemv_id_<ty>`): for every pair q,
    /// `parts[p].y[q, r] = x[q / x_div, :] . W_p[ids[q] * rows_per_expert_p + row0_p + r, :]`
    /// (or, with `glu`, `silu(gate) * up` into part 0's y). `parts` as in
    /// [`Self::gemv_parts`], each y `[n_pairs, n_rows]`, its weight a stack of experts
    /// (`n_experts() > 1` or not: rows per expert are its `n_out`), all of one expert count;
    /// no epilogues. x `[n_pairs / x_div (rounded up), n_in]`, 16-byte aligned. With
    /// `route.shared`, the shared expert's pairs follow (see [`GemvRoute::shared`]): each y
    /// then holds `n_pairs + tokens` rows and x row `x0 + tokens - 1` exists. `x8`: the int8
    /// form of x's rows (every row read, `x8_row_bytes(n_in)` bytes each) where it came with
    /// them (see [`x8_mode`]). Views checked by the caller.
    pub(crate) fn gemv_id(
        &self,
        stream: &Arc<CudaStream>,
        parts: &mut [GemvPart<'_, '_>],
        x: &CudaView<'_, f32>,
        x8: Option<&CudaSlice<u8>>,
        route: &GemvRoute<'_>,
        glu: bool,
    ) -> Result<()> {
        const OP: &str = "moe";
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let (fmt, n_in, n_exp) = (first.w.fmt, first.w.n_in, first.w.n_exp);
        let twins: &[&CudaWeight] = route.shared.map_or(&[], |s| s.twins);
        let twins_ok = route.shared.is_none()
            || (!route.tiles
                && twins.len() == parts.len()
                && twins
                    .iter()
                    .zip(parts.iter())
                    .all(|(t, p)| t.n_exp == 1 && t.n_out >= p.n_rows && t.gemv_ok()));
        if parts.len() + twins.len() > GEMV_MAX_PARTS
            || !twins_ok
            || parts
                .iter()
                .map(|p| p.w)
                .chain(twins.iter().copied())
                .any(|w| w.fmt != fmt || w.n_in != n_in)
            || parts.iter().any(|p| p.w.n_exp != n_exp || !p.w.gemv_ok())
            || (glu && (parts.len() != 2 || parts[0].n_rows != parts[1].n_rows))
            || parts.iter().any(|p| p.ep.bias.is_some() || p.ep.accumulate)
        {
            return shape_err(
                OP,
                "routed GEMV parts of different formats, widths or expert counts",
            );
        }
        let n_shared = route.shared.map_or(0, |s| s.tokens);
        if route.n_pairs + n_shared == 0 {
            return Ok(());
        }
        let per_row = if route.tiles { 3 } else { 1 };
        if route.x_div == 0
            || (route.tiles && route.x_div != 1)
            || route.ids.len() < route.n_pairs * per_row
        {
            return shape_err(OP, "routed GEMV: no x divisor or too few ids");
        }
        let (xp, _sync) = x.device_ptr(stream);
        if xp % 16 != 0 {
            return shape_err(OP, "x must start 16-byte aligned for the GEMV kernels");
        }
        let n_chunks = n_in / fmt.chunk();
        let grid_pairs = route.n_pairs + n_shared;
        // the routed parts' row groups (their twins take the same blocks)
        let groups: Vec<usize> = parts.iter().map(|p| p.n_rows.div_ceil(GEMV_ROWS)).collect();
        // the split as for one token's launch; the pairs multiply the grid
        let (g, warp_groups) = if glu {
            let g = ksplit(groups[0] * grid_pairs, n_chunks, self.sms, 16, 2);
            (g, GEMV_WARPS / 2 / g)
        } else {
            let total: usize = groups.iter().sum();
            let g = ksplit(total * grid_pairs, n_chunks, self.sms, 16, GEMV_WARPS);
            (g, GEMV_WARPS / g)
        };
        // lanes per row group: every lane busy on rows of few chunks (the down projections)
        let lpr = if route.tiles || g > 1 {
            32
        } else {
            lanes_per_row(n_chunks, 1)
        };
        let per_block = warp_groups * (32 / lpr);
        // int8 activations: the rows' int8 form where it came with them, else (mode `1`)
        // the x rows the pairs read, quantised
        let mut own_x8 = None;
        let x8 = match &self.gemv_id_x8[fmt.id()] {
            Some(f) if !route.tiles => {
                let shared_rows = route.shared.map_or(0, |s| s.x0 + s.tokens);
                let rows = route.n_pairs.div_ceil(route.x_div).max(shared_rows);
                self.x8_input(stream, x, x8, rows, n_in, &mut own_x8)?
                    .map(|q| (f, q))
            }
            _ => None,
        };
        let xq = x8.as_ref().map(|(_, q)| q.device_ptr(stream).0);
        let mut args = GemvArgs {
            n_parts: parts.len() as i32,
            n_in: i32_arg(OP, "n_in", n_in)?,
            ksplit: g as i32,
            flags: if glu { FLAG_GLU } else { 0 },
            x: xq.unwrap_or(xp),
            lpr: lpr as i32,
            ..GemvArgs::default()
        };
        let (ids_p, _ids_sync) = route.ids.device_ptr(stream);
        let mut ida = GemvIdArgs {
            ids: ids_p,
            x_div: i32_arg(OP, "top_k", route.x_div)?,
            n_exp: i32_arg(OP, "experts", n_exp)?,
            n_routed: match route.shared {
                Some(_) => i32_arg(OP, "routed pairs", route.n_pairs)?,
                None => i32::MAX,
            },
            shared_part: parts.len() as i32,
            shared_x0: i32_arg(OP, "shared x row", route.shared.map_or(0, |s| s.x0))?,
            ..GemvIdArgs::default()
        };
        let mut blocks = 0usize;
        for (i, p) in parts.iter_mut().enumerate() {
            args.part[i] = PartArgs::of(OP, stream, p, 0, blocks)?;
            ida.rpe[i] = p.w.n_out as u64;
            if !glu || i == 0 {
                blocks += groups[i].div_ceil(per_block);
            }
        }
        // the shared twins: their part's rows and y, their own weight; never picked by block
        // (block0 past the grid), by pair instead
        for (i, t) in twins.iter().enumerate() {
            let mut pa = args.part[i];
            pa.w = t.buf.device_ptr(stream).0;
            (pa.off1, pa.off2, pa.off3) = (t.off[0], t.off[1], t.off[2]);
            pa.stride = t.stride;
            pa.row0 = 0;
            pa.block0 = i32_arg(OP, "blocks", blocks)?;
            args.part[parts.len() + i] = pa;
            ida.rpe[parts.len() + i] = t.n_out as u64;
        }
        args.n_parts = (parts.len() + twins.len()) as i32;
        args.vblocks = i32_arg(OP, "blocks", blocks)?;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(blocks).map_err(|_| kapitsa_backend::BackendError::Shape {
                    op: OP,
                    msg: format!("{blocks} GEMV blocks"),
                })?,
                grid_yz(OP, "routed pairs or tiles", grid_pairs)?,
                1,
            ),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // the 5-blocks-per-SM Q4_K kernel where that fits the grid in one wave and 4 do not
        // (a decode's 9 pairs of Qwen3.6's 2048-wide rows); its spills cost more elsewhere
        let one_wave = one_wave_at_5_only(blocks * grid_pairs, self.sms);
        let five = fmt == Fmt::Q4K && one_wave && id5_on();
        let f = match (&x8, route.tiles) {
            (Some(_), _) if five => &self.gemv_id5_x8_q4_k,
            (Some((f, _)), _) => *f,
            (None, true) => &self.gemv_grp[fmt.id()],
            (None, false) if five => &self.gemv_id5_q4_k,
            (None, false) => &self.gemv_id[fmt.id()],
        };
        let mut b = stream.kernel(f);
        b.arg(&args).arg(&ida);
        // SAFETY: gemv_id_<ty>(GemvArgs, GemvIdArgs) (or gemv_id_x8_<ty> with x the int8 rows
        // of every x row the pairs read, `quantize_x8`'s or the caller's `x8`; or
        // gemv_grp_<ty> with ids the
        // tiles, x and y rows the sorted pairs, x 7 rows longer: the caller's contract, y
        // written only at the tiles' rows): every part's weight image,
        // plane offsets and stride come from `upload`; rows row0 + e * n_out + r (r < n_rows, e < n_exp, the
        // kernel skips other ids) exist when row0 + n_rows <= n_out (the caller's contract);
        // each y holds n_pairs * n_rows floats, x holds the rows q / x_div < n_pairs / x_div
        // rounded up (the caller's contract), 16-byte aligned (checked), n_in a multiple of the
        // chunk (checked); ids hold n_pairs u32 (checked); no bias, no accumulate (checked);
        // grid (blocks, n_pairs + shared pairs) and ksplit follow the kernel's launch
        // contract. Shared pairs (route.shared): each twin is a 2-D matrix of the parts'
        // format and width with at least their rows (checked), y holds n_pairs + tokens rows
        // and x the rows x0 .. x0 + tokens (the caller's contract).
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    /// An MoE's routed down projections and their weighted sum in one launch
    /// (kernels/matmul.cu `gemv_id_sum_<ty>`): `down.y[t, r]` (= or +=, `down.ep.accumulate`)
    /// `sum_j weights[t, j] (x[t k + j, :] . W[ids[t k + j] * rows per expert + row0 + r, :])`
    /// plus the shared expert's terms of `sum` (see [`MoeSum`]), for t < `sum.n_tok`,
    /// r < `down.n_rows`. `down.w` is the experts' stack (rows per expert: its `n_out`), its y
    /// `[n_tok, n_rows]`; x `[rows, n_in]` f32 (the pairs' hidden rows, then the shared
    /// ones), 16-byte aligned; ids `[n_tok * top_k]`. Ids `>= n_exp` add nothing.
    pub(crate) fn gemv_id_sum(
        &self,
        stream: &Arc<CudaStream>,
        down: &mut GemvPart<'_, '_>,
        x: &CudaView<'_, f32>,
        ids: &CudaView<'_, u32>,
        sum: &MoeSum<'_>,
    ) -> Result<()> {
        const OP: &str = "moe";
        let w = down.w;
        let (n, k) = (sum.n_tok, sum.top_k);
        if n == 0 {
            return Ok(());
        }
        let pairs = n * k;
        let x_rows = match sum.twin {
            Some((_, x0)) => pairs.max(x0 + n),
            None => pairs,
        };
        let twin_ok = sum.twin.is_none_or(|(t, _)| {
            t.fmt == w.fmt && t.n_in == w.n_in && t.n_exp == 1 && t.n_out >= down.n_rows
        });
        let gate_ok = sum.gate.is_none_or(|g| g.len() >= n);
        if !w.gemv_ok()
            || !twin_ok
            || !gate_ok
            || down.ep.bias.is_some()
            || down.row0 + down.n_rows > w.n_out
            || ids.len() < pairs
            || sum.weights.len() < pairs
            || x.len() < x_rows * w.n_in
            || down.y.len() < n * down.n_rows
            || sum.sh.is_some_and(|sh| sh.len() < n * down.n_rows)
        {
            return shape_err(
                OP,
                "routed down projection and sum: operands of other formats or sizes",
            );
        }
        let (xp, _sync) = x.device_ptr(stream);
        if xp % 16 != 0 {
            return shape_err(OP, "x must start 16-byte aligned for the GEMV kernels");
        }
        let (r, f) = match (w.id_sum_rows(), &self.gemv_id_sum4[w.fmt.id()]) {
            (Some(1), _) => (1, &self.gemv_id_sum[w.fmt.id()]),
            (Some(4), Some(f)) => (4, f),
            _ => return shape_err(OP, "routed down projection and sum: rows it does not take"),
        };
        let lpr = lanes_per_row(w.n_in / w.fmt.chunk(), 1);
        let rows_per_block = (32 / lpr) * r;
        let blocks = down.n_rows.div_ceil(rows_per_block);
        let mut args = GemvArgs {
            n_parts: 1 + i32::from(sum.twin.is_some()),
            n_in: i32_arg(OP, "n_in", w.n_in)?,
            ksplit: 1,
            x: xp,
            vblocks: i32_arg(OP, "blocks", blocks)?,
            lpr: lpr as i32,
            ..GemvArgs::default()
        };
        args.part[0] = PartArgs::of(OP, stream, down, 0, 0)?;
        let (ids_p, _ids_sync) = ids.device_ptr(stream);
        let mut ida = GemvIdArgs {
            ids: ids_p,
            x_div: 1,
            n_exp: i32_arg(OP, "experts", w.n_exp)?,
            n_routed: i32_arg(OP, "routed pairs", pairs)?,
            shared_part: 1,
            ..GemvIdArgs::default()
        };
        ida.rpe[0] = w.n_out as u64;
        if let Some((t, x0)) = sum.twin {
            let mut pa = args.part[0];
            pa.w = t.buf.device_ptr(stream).0;
            (pa.off1, pa.off2, pa.off3) = (t.off[0], t.off[1], t.off[2]);
            pa.stride = t.stride;
            pa.row0 = 0;
            args.part[1] = pa;
            ida.rpe[1] = t.n_out as u64;
            ida.shared_x0 = i32_arg(OP, "shared x row", x0)?;
        }
        let (wp, _w_sync) = sum.weights.device_ptr(stream);
        let mut sa = GemvSumArgs {
            w: wp,
            k: i32_arg(OP, "top_k", k)?,
            shared: i32::from(sum.twin.is_some()),
            ..GemvSumArgs::default()
        };
        let _gate_sync = sum.gate.map(|g| {
            let (p, s) = g.device_ptr(stream);
            sa.g = p;
            s
        });
        let _sh_sync = sum.sh.map(|sh| {
            let (p, s) = sh.device_ptr(stream);
            sa.sh = p;
            s
        });
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(blocks).map_err(|_| kapitsa_backend::BackendError::Shape {
                    op: OP,
                    msg: format!("{blocks} GEMV blocks"),
                })?,
                grid_yz(OP, "tokens", n)?,
                1,
            ),
            block_dim: (GEMV_SUM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.kernel(f);
        b.arg(&args).arg(&ida).arg(&sa);
        // SAFETY: gemv_id_sum[4]_<ty>(GemvArgs, GemvIdArgs, GemvSumArgs), grid (blocks, n), 256
        // threads: the stack's and the twin's images, plane offsets and strides come from
        // `upload`; rows e * n_out + row0 + r (e < n_exp: the kernel skips other ids, r <
        // n_rows, row0 + n_rows <= n_out checked) and the twin's rows r < n_rows <= its n_out
        // (checked) exist; x holds the x_rows rows the pairs read (checked), 16-byte aligned
        // (checked), n_in a multiple of the chunk (gemv_ok); ids and weights hold n * k
        // entries, y and sh n * n_rows floats, g n (checked); blocks cover n_rows with
        // rows_per_block = 32 / lpr row groups of the kernel's r rows, as it maps them.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    /// The products `parts` (at most [`GEMV_MAX_PARTS`], one format and `n_in`) of `x`
    /// (`[n_tok, n_in]`) in launches of up to [`GEMV_MAX_TOKENS`] tokens. With `glu`, exactly
    /// two parts (gate, up) of equal row counts without epilogues: part 0's y receives
    /// `silu(gate . x) * (up . x)` and part 1's y is not written. `x8`: the int8 form of x's
    /// rows (`x8_row_bytes(n_in)` bytes each) where it came with them (see [`x8_mode`]).
    /// Views checked by the caller (lengths, rows inside the weights, the x alignment is
    /// checked here).
    pub(crate) fn gemv_parts(
        &self,
        stream: &Arc<CudaStream>,
        parts: &mut [GemvPart<'_, '_>],
        x: &CudaView<'_, f32>,
        x8: Option<&CudaSlice<u8>>,
        n_tok: usize,
        glu: bool,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let (fmt, n_in) = (first.w.fmt, first.w.n_in);
        if parts.len() > GEMV_MAX_PARTS
            || parts.iter().any(|p| p.w.fmt != fmt || p.w.n_in != n_in)
            || (glu && (parts.len() != 2 || parts[0].n_rows != parts[1].n_rows))
        {
            return shape_err(OP, "GEMV parts of different formats, widths or row counts");
        }
        let (xp, _sync) = x.device_ptr(stream);
        if xp % 16 != 0 {
            return shape_err(OP, "x must start 16-byte aligned for the GEMV kernels");
        }
        let n_chunks = n_in / fmt.chunk();
        let flags = if prefetch_on() { FLAG_PREFETCH } else { 0 } | if glu { FLAG_GLU } else { 0 };
        let mut t0 = 0;
        while t0 < n_tok {
            let nt = (n_tok - t0).min(GEMV_MAX_TOKENS);
            // one token: x staged in shared memory, a grid of resident blocks
            let smem = xs_bytes(n_in);
            let groups: Vec<usize> = parts.iter().map(|p| p.n_rows.div_ceil(GEMV_ROWS)).collect();
            // the K split (from one matrix's row groups for the gate/up pair, so each matrix
            // gets the split a launch of its own would), and the row groups one block holds
            let (g, warp_groups) = if glu {
                let g = ksplit(groups[0], n_chunks, self.sms, 16, 2);
                (g, GEMV_WARPS / 2 / g)
            } else {
                let total = groups.iter().sum();
                let g = ksplit(total, n_chunks, self.sms, 16, GEMV_WARPS);
                (g, GEMV_WARPS / g)
            };
            // rows of few chunks: several row groups a warp, every lane busy
            let lpr = if g == 1 {
                lanes_per_row(n_chunks, nt)
            } else {
                32
            };
            let per_block = warp_groups * (32 / lpr);
            let mut args = GemvArgs {
                n_parts: parts.len() as i32,
                n_in: i32_arg(OP, "n_in", n_in)?,
                ksplit: g as i32,
                flags,
                x: xp + (t0 * n_in * 4) as u64,
                lpr: lpr as i32,
                ..GemvArgs::default()
            };
            let mut blocks = 0usize;
            for (i, p) in parts.iter_mut().enumerate() {
                args.part[i] = PartArgs::of(OP, stream, p, t0, blocks)?;
                if !glu || i == 0 {
                    blocks += groups[i].div_ceil(per_block);
                }
            }
            args.vblocks = i32_arg(OP, "blocks", blocks)?;
            // the staged kernel: at most the blocks that fit at once (4 by registers)
            let resident = self.sms * (SM_SMEM / (smem + BLOCK_SMEM_RESERVED)).clamp(1, 4);
            let xs = nt == 1
                && smem <= XS_MAX_SMEM
                && match xs_mode() {
                    0 => false,
                    2 => true,
                    _ => blocks > resident,
                };
            let grid = if xs { blocks.min(resident) } else { blocks };
            let cfg = LaunchConfig {
                grid_dim: (grid as u32, 1, 1),
                block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: if xs { smem as u32 } else { 0 },
            };
            // int8 activations for one token where the format has the kernel: the row's int8
            // form where it came with it, else (mode `1`) the row quantised
            let mut own_x8 = None;
            let x8 = match &self.gemv_x8[fmt.id()] {
                Some(f) if n_tok == 1 => self
                    .x8_input(stream, x, x8, 1, n_in, &mut own_x8)?
                    .map(|q| (f, q)),
                _ => None,
            };
            let (f, grid, smem) = match &x8 {
                Some((f, q)) => {
                    args.x = q.device_ptr(stream).0;
                    (*f, blocks, 0)
                }
                None if xs => (&self.gemv_xs[fmt.id()], grid, smem as u32),
                None => (&self.gemv[fmt.id() * GEMV_MAX_TOKENS + nt - 1], grid, 0),
            };
            let cfg = LaunchConfig {
                grid_dim: (grid as u32, 1, 1),
                shared_mem_bytes: smem,
                ..cfg
            };
            let mut b = stream.kernel(f);
            b.arg(&args);
            // SAFETY: gemv_<ty>_<nt>[xs](GemvArgs), or gemv_x8_<ty>(GemvArgs) with x the one
            // int8 row (that layout's size for n_in) of `quantize_x8` or the caller's `x8`:
            // every part's weight
            // image, plane offsets and stride come from `upload`, its rows row0 .. row0 + n_rows exist and its y
            // holds n_tok * n_rows floats from token 0 (the caller's contract; the offsets
            // above stay inside for tokens t0 .. t0 + nt), its bias is null or holds n_rows
            // floats; x holds n_tok * n_in floats, 16-byte aligned (checked), n_in a multiple
            // of the chunk; the parts share fmt and n_in (checked); block0, ksplit and the
            // grid follow the kernel's launch contract (kernels/matmul.cu), the xs kernel's
            // dynamic shared memory is the staged row's size (<= its raised limit).
            unsafe { b.launch(cfg) }.map_err(dev_err)?;
            t0 += nt;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_per_row_cover_the_chunks_and_fit_the_sums() {
        for nt in 1..=GEMV_MAX_TOKENS {
            for n_chunks in 1..=100 {
                let lpr = lanes_per_row(n_chunks, nt);
                assert!(
                    lpr.is_power_of_two() && lpr <= 32,
                    "{n_chunks} chunks, {nt}: {lpr}"
                );
                // every chunk has a lane where rows have fewer than 32
                assert!(lpr >= n_chunks.min(32), "{n_chunks} chunks, {nt}: {lpr}");
                // the kernel keeps 32 / lpr sub-groups' nt * R sums in 32 floats a warp
                assert!(
                    (32 / lpr) * nt * GEMV_ROWS <= 32,
                    "{n_chunks} chunks, {nt}: {lpr}"
                );
            }
        }
        // the 512-wide down projection of Q4_K (8 chunks of 64): 4 row groups a warp
        assert_eq!(lanes_per_row(8, 1), 8);
        assert_eq!(lanes_per_row(32, 1), 32);
    }

    #[test]
    fn int8_modes_pick_the_launches() {
        assert_eq!(X8Mode::parse(None), X8Mode::Norm);
        assert_eq!(X8Mode::parse(Some("norm")), X8Mode::Norm);
        assert_eq!(X8Mode::parse(Some("0")), X8Mode::Off);
        assert_eq!(X8Mode::parse(Some("1")), X8Mode::Always);
        assert!(!X8Mode::Off.takes(true));
        assert!(X8Mode::Norm.takes(true));
        assert!(!X8Mode::Norm.takes(false));
        assert!(X8Mode::Always.takes(false));
    }

    #[test]
    fn the_five_block_routed_kernel_only_where_it_makes_one_wave() {
        // an H100: Qwen3.6's decode gate/up (9 pairs x 64 blocks) fits at 5 an SM, not at 4
        assert!(one_wave_at_5_only(576, 132));
        // fits at 4 already; two waves either way (Qwen3-30B-A3B: 8 pairs x 96 blocks)
        assert!(!one_wave_at_5_only(528, 132));
        assert!(!one_wave_at_5_only(768, 132));
        assert!(one_wave_at_5_only(660, 132));
        assert!(!one_wave_at_5_only(661, 132));
    }
}
