//! The expert-grouped GEMM on tensor cores (kernels/matmul.cu `gemm_grp_<ty>_<bn>`): a
//! prompt's MoE products over tiles of up to `bn` pairs of one expert, the tensor-core twin of
//! the grouped GEMV (`gemv_grp_<ty>`, [`MatmulKernels::gemv_id`] with tiles).
//!
//! # Contract
//! - x is `[x_rows, n_in]` f32, rounded to f16 once per launch (`cvt_f32_f16`) for the
//!   kernel; tile i is `tiles[3i .. 3i + 3]` = (expert, first sorted row, count <= bn) in
//!   device memory; sorted row s reads x row `xmap[s]` and writes row `ymap[s]` of each
//!   part's y (`[y rows, n_rows]`; only those rows are written), each map the identity where
//!   not given (the (token, slot) pairs sorted by expert in x and y).
//! - Weights are dequantised exactly and rounded to f16, x is rounded to f16, products
//!   accumulate in f32 (as the per-expert path's cuBLAS GEMM over `dequant_<ty>_f16` tiles);
//!   quantised formats only ([`MatmulKernels::gemm_grp_ok`]).

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, DevicePtr, LaunchConfig};
use kapitsa_backend::{shape_err, BackendError, Result};

use super::{i32_arg, GemvPart, MatmulKernels};
use crate::device::{dev_err, grid_yz};
use crate::launch::{host_arg, KernelLaunch};

/// Weight rows per block (kernels/matmul.cu `GEMM_BM`).
const GEMM_BM: usize = 64;

/// Pairs per tile of the two kernels of each format (`gemm_grp_<ty>_16`, `_64`).
pub(crate) const GEMM_GRP_TILES: [usize; 2] = [16, 64];

/// kernels/matmul.cu `GemmGrpPart`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemmGrpPart {
    w: u64,
    off1: u64,
    off2: u64,
    off3: u64,
    stride: u64,
    row0: u64,
    rpe: u64,
    y: u64,
    n_rows: i32,
    ldy: i32,
    block0: i32,
    unused: i32,
}

/// kernels/matmul.cu `GemmGrpArgs`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemmGrpArgs {
    part: [GemmGrpPart; 2],
    x: u64,
    tiles: u64,
    xmap: u64,
    ymap: u64,
    n_parts: i32,
    n_in: i32,
    n_exp: i32,
    unused: i32,
}

host_arg!(GemmGrpArgs);

impl MatmulKernels {
    /// Whether the grouped tensor-core GEMM takes stacks of `w`'s format.
    pub(crate) fn gemm_grp_ok(&self, w: &super::CudaWeight) -> bool {
        self.gemm_grp[w.fmt.id()].is_some() && w.gemv_ok()
    }

    /// The grouped GEMM (module doc): `parts` (one or two, of one format, `n_in` and expert
    /// count; rows `row0 + e * n_out + r` of expert e, no epilogues) of the tiles' rows of x
    /// into each part's y, in one launch of the `bn`-pair kernel ([`GEMM_GRP_TILES`]), the
    /// rows mapped by `maps` (x map, y map; `None`: the identity). Views checked by the
    /// caller: y lengths cover the rows the tiles write, the tiles' sorted rows are below
    /// the maps' lengths and the x map's values below `rows` (x's rows; x's length is
    /// checked here).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_grp(
        &self,
        stream: &Arc<CudaStream>,
        parts: &mut [GemvPart<'_, '_>],
        x: &CudaView<'_, f32>,
        rows: usize,
        (tiles, n_tiles, bn): (&CudaView<'_, u32>, usize, usize),
        maps: [Option<&CudaView<'_, u32>>; 2],
    ) -> Result<()> {
        const OP: &str = "moe";
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let (fmt, n_in, n_exp) = (first.w.fmt, first.w.n_in, first.w.n_exp);
        let Some(kernels) = &self.gemm_grp[fmt.id()] else {
            return shape_err(OP, format!("no grouped GEMM for {:?}", first.w.dtype));
        };
        let Some(ki) = GEMM_GRP_TILES.iter().position(|&t| t == bn) else {
            return shape_err(OP, format!("grouped GEMM tiles of {bn} pairs"));
        };
        if parts.len() > 2
            || parts.iter().any(|p| {
                p.w.fmt != fmt
                    || p.w.n_in != n_in
                    || p.w.n_exp != n_exp
                    || !p.w.gemv_ok()
                    || p.ep.bias.is_some()
                    || p.ep.accumulate
            })
        {
            return shape_err(OP, "grouped GEMM parts of different formats or widths");
        }
        if tiles.len() < 3 * n_tiles || x.len() < rows * n_in || !n_in.is_multiple_of(8) {
            return shape_err(
                OP,
                "grouped GEMM: fewer tiles or x rows than asked for, or n_in not a multiple of 8",
            );
        }
        if n_tiles == 0 || rows == 0 {
            return Ok(());
        }
        // x rounded to f16 once (each row block of the kernel would otherwise convert it)
        // SAFETY: the conversion below writes all rows * n_in elements before the kernel reads
        // them, on this stream (device memory has no Rust validity invariant).
        let mut x16 = unsafe { stream.alloc::<u16>(rows * n_in) }.map_err(dev_err)?;
        let n64 = (rows * n_in) as u64;
        let mut c = stream.kernel(&self.cvt_f16);
        c.arg(x).arg(&mut x16).arg(&n64);
        // SAFETY: cvt_f32_f16(const float* x, __half* out, uint64_t n): x holds >= n floats,
        // out n halves (both checked or allocated above); any 1-D grid.
        unsafe { c.launch(self.elem_cfg(rows * n_in)) }.map_err(dev_err)?;
        let (xp, _xs) = x16.device_ptr(stream);
        let (tp, _ts) = tiles.device_ptr(stream);
        let [xm, ym] = maps.map(|m| m.map(|v| v.device_ptr(stream)));
        let mut args = GemmGrpArgs {
            x: xp,
            tiles: tp,
            xmap: xm.as_ref().map_or(0, |m| m.0),
            ymap: ym.as_ref().map_or(0, |m| m.0),
            n_parts: parts.len() as i32,
            n_in: i32_arg(OP, "n_in", n_in)?,
            n_exp: i32_arg(OP, "experts", n_exp)?,
            ..GemmGrpArgs::default()
        };
        let mut blocks = 0usize;
        for (i, p) in parts.iter_mut().enumerate() {
            let w = p.w;
            let (yp, _ys) = {
                use cudarc::driver::DevicePtrMut;
                p.y.device_ptr_mut(stream)
            };
            args.part[i] = GemmGrpPart {
                w: w.buf.device_ptr(stream).0,
                off1: w.off[0],
                off2: w.off[1],
                off3: w.off[2],
                stride: w.stride,
                row0: p.row0 as u64,
                rpe: w.n_out as u64,
                y: yp,
                n_rows: i32_arg(OP, "rows", p.n_rows)?,
                ldy: i32_arg(OP, "rows", p.n_rows)?,
                block0: i32_arg(OP, "blocks", blocks)?,
                unused: 0,
            };
            blocks += p.n_rows.div_ceil(GEMM_BM);
        }
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(blocks).map_err(|_| BackendError::Shape {
                    op: OP,
                    msg: format!("{blocks} GEMM blocks"),
                })?,
                grid_yz(OP, "expert tiles", n_tiles)?,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.kernel(&kernels[ki]);
        b.arg(&args);
        // SAFETY: gemm_grp_<ty>_<bn>(GemmGrpArgs) with every part's weight image, plane
        // offsets and stride from `upload`; rows row0 + e * n_out + r (r < n_rows; e < n_exp,
        // the kernel skips tiles of other experts) exist when row0 + n_rows <= n_out (the
        // caller's contract); x holds rows * n_in halves (a fresh allocation: 16-byte aligned,
        // n_in a multiple of 8, checked) and the rows the tiles read (through the x map) are
        // below rows, the maps cover the tiles' sorted rows (the caller's contract), n_in a
        // multiple of the chunk (checked); tiles hold
        // 3 * n_tiles u32 (checked) with counts <= bn (the caller's); each y holds the rows
        // the tiles write (through the y map) of n_rows floats (the caller's); grid (row blocks of 64, n_tiles), 128 threads,
        // static shared memory only.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }
}
