//! The routed mixture of experts on the GPU (`Backend::moe`, `moe_add`, `norm_moe_add`): the
//! CUDA twin of the MoE half of the CPU backend's src/ffn.rs (the dense MLP and the matmul
//! entry points are in ffn.rs).
//!
//! MoE: the router logits are a matmul, the scores and top-k run on the device
//! (kernels/ffn.cu `moe_topk_warp_f32`, one warp per token; `moe_topk_f32` past 512
//! experts); up to 16 tokens an f32 router's product and the routing are one launch
//! (`moe_router_topk_f32`: the last block of each token routes it). Up to 16 tokens
//! ([`MOE_ROUTED_MAX_TOKENS`]) the experts run routed on the device ([`CudaBackend::moe_experts`]: one GEMV launch for every (token, slot)
//! pair's gate/up with SwiGLU, one for its down projection, the expert rows chosen by the ids
//! in device memory), so the op never waits for the host and decode steps record. More tokens
//! take the tiled form ([`CudaBackend::moe_tiled`]): the ids come back to the host (one
//! synchronisation), which sorts the pairs by expert into tiles (16 or 64 pairs for the
//! tensor-core GEMM, which reads the tokens' rows and writes the pairs' rows of
//! `ye [n * top_k, d]` through row maps; 8 for the grouped GEMV, whose sorted rows are
//! gathered and scattered). Experts uploaded one by one take the per-expert form
//! ([`CudaBackend::moe_grouped`]: each used expert's rows gathered, run through its MLP and
//! scattered). `moe_finish_f32` then sums each
//! token's rows in top-k order with their weights, adds the (gated) shared expert and, for
//! `moe_add`, the residual, in one kernel (latent MoE: the sum is projected back up first).
//! Up to [`MOE_SUM_MAX_TOKENS`] tokens, where the down rows are short (8 chunks or fewer:
//! Qwen3.6's), the routed down projections and that sum are one launch instead
//! (kernels/matmul.cu `gemv_id_sum_<ty>`, [`SumTo`]); the fused router then computes the
//! shared expert's gate as one more row.

use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig};
use kapitsa_backend::{
    shape_err, Act, BackendError, Experts, Gating, MoeWeights, Result, Tensor, Weight,
};

use crate::device::{dev_err, grid_yz, row_threads, u32_arg};
use crate::ffn::{ExpertMats, Mat};
use crate::launch::KernelLaunch;
use crate::matmul::{
    fuse_on, CudaWeight, GemvEpilogue, GemvPart, GemvRoute, MoeSum, SharedPairs, GEMM_GRP_TILES,
};
use crate::CudaBackend;

/// The input rows of [`CudaBackend::moe_rows`].
enum MoeIn<'a> {
    /// Given rows `[n, d]`, with their int8 form where it came with them
    /// (matmul/gemv.rs `x8_mode`).
    Rows(&'a CudaSlice<f32>, Option<&'a CudaSlice<u8>>),
    /// The pre-norm of the output's own rows (`norm_moe_add`): the fused router computes
    /// `h = rms_norm(out) * nw` into `h` (`[n, d]`) and `h8` (int8 rows), which the rest of
    /// the block reads.
    Norm {
        nw: &'a CudaSlice<f32>,
        eps: f32,
        h: &'a mut CudaSlice<f32>,
        h8: Option<&'a mut CudaSlice<u8>>,
    },
}

impl CudaBackend {
    /// The matrices of experts `which` of `w.experts` for expert inputs/outputs of width `de`
    /// (every expert's weights are checked, whichever are built).
    fn expert_mats<'a>(
        &self,
        w: &'a MoeWeights,
        de: usize,
        op: &'static str,
        which: Range<usize>,
    ) -> Result<Vec<ExpertMats<'a>>> {
        let n_exp = w.n_expert();
        let i = w.n_ff;
        let stack = |wt: &'a Weight, rows: usize, cols: usize| -> Result<&'a CudaWeight> {
            let (e, r, c) = wt.dims3(op)?;
            if (e, r, c) != (n_exp, rows, cols) {
                return shape_err(
                    op,
                    format!(
                        "'{}' is {:?}, expected [{n_exp}, {rows}, {cols}]",
                        wt.name, wt.shape
                    ),
                );
            }
            let m = self.dev_weight(wt, op)?;
            if m.n_experts() != n_exp {
                return shape_err(
                    op,
                    format!(
                        "'{}' was not uploaded as a stack of {n_exp} experts",
                        wt.name
                    ),
                );
            }
            Ok(m)
        };
        let mat = |w: &'a CudaWeight, e: usize, rows: Range<usize>| Mat { w, e, rows };
        match &w.experts {
            Experts::Stacked { gate, up, down } => {
                let up = stack(up, i, de)?;
                let down = stack(down, de, i)?;
                let gate = match gate {
                    Some(g) => Some(stack(g, i, de)?),
                    None => None,
                };
                Ok(which
                    .map(|e| ExpertMats {
                        gate: gate.map(|g| mat(g, e, 0..i)),
                        up: mat(up, e, 0..i),
                        down: mat(down, e, 0..de),
                    })
                    .collect())
            }
            Experts::FusedGateUp { gate_up, down } => {
                let gu = stack(gate_up, 2 * i, de)?;
                let down = stack(down, de, i)?;
                Ok(which
                    .map(|e| ExpertMats {
                        gate: Some(mat(gu, e, 0..i)),
                        up: mat(gu, e, i..2 * i),
                        down: mat(down, e, 0..de),
                    })
                    .collect())
            }
            Experts::PerExpert(v) => {
                if v.len() != n_exp {
                    return shape_err(op, format!("{} experts for a router of {n_exp}", v.len()));
                }
                v.get(which.clone())
                    .ok_or_else(|| BackendError::Shape {
                        op,
                        msg: format!("experts {which:?} of {n_exp}"),
                    })?
                    .iter()
                    .map(|m| {
                        let (mats, n_in, n_ff, n_out) = self.mlp_mats(m, op)?;
                        if (n_in, n_ff, n_out) != (de, i, de) {
                            return shape_err(op, format!("expert MLP {n_in} -> {n_ff} -> {n_out}, expected {de} -> {i} -> {de}"));
                        }
                        Ok(mats)
                    })
                    .collect()
            }
        }
    }

    /// Expert 0's matrices when the routed form takes `w` (its experts are stacks of all
    /// experts whose rows the GEMV kernels take: the kernel adds `expert id * rows per
    /// expert`; per-expert uploads cannot be indexed so), else `None`. Shape errors as in
    /// [`Self::expert_mats`].
    fn routed_mats<'a>(
        &self,
        w: &'a MoeWeights,
        de: usize,
        op: &'static str,
    ) -> Result<Option<ExpertMats<'a>>> {
        if matches!(w.experts, Experts::PerExpert(_)) || w.n_expert() < 2 {
            return Ok(None);
        }
        // (expert_mats checked that the stacks hold every expert)
        Ok(self.expert_mats(w, de, op, 0..1)?.pop().filter(|m| {
            [Some(&m.up), Some(&m.down), m.gate.as_ref()]
                .into_iter()
                .flatten()
                .all(|x| x.w.gemv_ok())
        }))
    }

    /// `out = moe(x)`, or `out += moe(x)` with `accumulate` (`moe_add`).
    pub(crate) fn moe_impl(
        &self,
        w: &MoeWeights,
        x: &Tensor,
        n: usize,
        out: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "moe";
        let (_, d) = w.router.dims2(OP)?;
        let xb = self.f32_len(x, n * d, OP, "x")?;
        // x's rows in int8 where its pre-norm wrote them
        let x8 = self.x8_rows(x, d);
        let ob = self.f32_len_mut(out, n * d, OP, "out")?;
        self.moe_rows(w, MoeIn::Rows(xb, x8), n, ob, accumulate)
    }

    /// [`kapitsa_backend::Backend::norm_moe_add`]: `h = rms_norm(y)`, then `y += moe(h)`; the
    /// norm inside the fused router where it takes it ([`Self::router_norms`]), else by
    /// `rms_norm_to` first.
    pub(crate) fn norm_moe_add_impl(
        &self,
        w: &MoeWeights,
        (norm, eps): (&Tensor, f32),
        h: &mut Tensor,
        n: usize,
        y: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "norm_moe_add";
        let (_, d) = w.router.dims2(OP)?;
        if norm.len() != d {
            return shape_err(OP, format!("a norm of {} for width {d}", norm.len()));
        }
        if !self.router_norms(w, n)? {
            self.rms_norm_to_impl(y, h, d, norm, eps)?;
            return self.moe_impl(w, h, n, y, true);
        }
        let nw = self.f32_len(norm, d, OP, "norm")?;
        let with_x8 = crate::matmul::x8_from_norm(n, d);
        let yb = self.f32_len_mut(y, n * d, OP, "y")?;
        if with_x8 {
            let (hb, h8) = self.f32_with_x8_mut(h, n, d, OP, "h")?;
            let input = MoeIn::Norm {
                nw,
                eps,
                h: hb,
                h8: Some(h8),
            };
            self.moe_rows(w, input, n, yb, true)?;
            self.x8_written(h);
            return Ok(());
        }
        let hb = self.f32_len_mut(h, n * d, OP, "h")?;
        let input = MoeIn::Norm {
            nw,
            eps,
            h: hb,
            h8: None,
        };
        self.moe_rows(w, input, n, yb, true)
    }

    /// Whether the fused router takes `w` over `n` tokens (`moe_router_topk_f32`: an f32
    /// router, warp top-k, a decode's token count).
    fn router_fuses(&self, w: &MoeWeights, n: usize) -> Result<bool> {
        const OP: &str = "moe";
        let (n_exp, d) = w.router.dims2(OP)?;
        let router = self.matrix(&w.router, OP)?;
        Ok(router.f32_rows().is_some()
            && n_exp <= TOPK_WARP_MAX_EXPERTS
            && w.top_k <= 32
            && topk_warp_on()
            && n <= MOE_ROUTED_MAX_TOKENS
            && d.is_multiple_of(4)
            && router_fused_on())
    }

    /// Whether `norm_moe_add` of `w` over `n` tokens computes the pre-norm in the fused
    /// router (its widths: a multiple of 128, at least 256; only with `KAPITSA_MOE_PRENORM=1`,
    /// see [`prenorm_on`]).
    fn router_norms(&self, w: &MoeWeights, n: usize) -> Result<bool> {
        let (_, d) = w.router.dims2("norm_moe_add")?;
        Ok(d.is_multiple_of(128) && d >= 256 && prenorm_on() && self.router_fuses(w, n)?)
    }

    /// `out = moe(x)` (or `+=` with `accumulate`) on device rows: `x` given, or (with
    /// [`MoeIn::Norm`], `accumulate`, [`Self::router_norms`]) the pre-norm of `out` itself,
    /// written by the fused router.
    fn moe_rows(
        &self,
        w: &MoeWeights,
        mut x: MoeIn<'_>,
        n: usize,
        ob: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "moe";
        let (n_exp, d) = w.router.dims2(OP)?;
        let k = w.top_k;
        if k == 0 || k > n_exp {
            return shape_err(OP, format!("top_k {k} of {n_exp} experts"));
        }
        let router = self.matrix(&w.router, OP)?;
        if ob.len() < n * d {
            return shape_err(
                OP,
                format!("out has {} floats, [{n}, {d}] needs more", ob.len()),
            );
        }
        let latent = match &w.latent {
            Some(l) => {
                let (ld, ldin) = l.down.dims2(OP)?;
                let (lu, luin) = l.up.dims2(OP)?;
                if ldin != d || lu != d || luin != ld {
                    return shape_err(
                        OP,
                        format!(
                            "latent down {:?} / up {:?} for width {d}",
                            l.down.shape, l.up.shape
                        ),
                    );
                }
                Some((self.matrix(&l.down, OP)?, self.matrix(&l.up, OP)?, ld))
            }
            None => None,
        };
        let de = latent.as_ref().map_or(d, |l| l.2);
        // the stacked matrices of the routed and tiled forms, or every expert's for the
        // per-expert form
        let small = n <= MOE_ROUTED_MAX_TOKENS;
        let routed = match (small && routed_on()) || (!small && tiled_on()) {
            true => self.routed_mats(w, de, OP)?,
            false => None,
        };
        let grouped = match routed {
            Some(_) => Vec::new(),
            None => self.expert_mats(w, de, OP, 0..w.n_expert())?,
        };
        let shared = match &w.shared {
            Some(s) => {
                let (m, n_in, n_ff, n_out) = self.mlp_mats(s, OP)?;
                if (n_in, n_out) != (d, d) {
                    return shape_err(
                        OP,
                        format!("shared expert {n_in} -> {n_out}, expected {d} -> {d}"),
                    );
                }
                Some((m, n_ff, s.act))
            }
            None => None,
        };
        let sgate = match &w.shared_gate {
            Some(g) => Some(self.f32_len(g, d, OP, "shared_gate")?),
            None => None,
        };
        let (gating, bias) = match &w.gating {
            Gating::Softmax => (0u32, None),
            Gating::Sigmoid { bias } => (
                1u32,
                match bias {
                    Some(b) => Some(self.f32_len(b, n_exp, OP, "router bias")?),
                    None => None,
                },
            ),
        };
        if n == 0 {
            return Ok(());
        }

        // router and top-k on the device
        let mut ids = self.scratch::<u32>(n * k)?;
        let mut wts = self.scratch::<f32>(n * k)?;
        let (ne, ka, nt) = (
            u32_arg(OP, "experts", n_exp)?,
            u32_arg(OP, "top_k", k)?,
            u32_arg(OP, "tokens", n)?,
        );
        let (norm, scale) = (u32::from(w.norm_topk), w.scale);
        let warp = n_exp <= TOPK_WARP_MAX_EXPERTS && k <= 32 && topk_warp_on();
        let mut logits = self.scratch::<f32>(n * n_exp)?;
        let fused_router = self.router_fuses(w, n)?;
        // the kernel's pre-norm contract (the caller chose it by `router_norms`)
        if let MoeIn::Norm { .. } = &x {
            if !(fused_router && accumulate && d.is_multiple_of(128) && d >= 256) {
                return shape_err(OP, "a pre-norm where the fused router does not compute it");
            }
        }
        // decode's routed down projections and weighted sum in one launch (the fused router
        // computes the shared expert's gate for it)
        let gated = shared.is_some() && sgate.is_some();
        let sum_down = n <= MOE_SUM_MAX_TOKENS
            && latent.is_none()
            && routed
                .as_ref()
                .is_some_and(|m| m.down.w.id_sum_rows().is_some())
            && (!gated || fused_router)
            && id_sum_on();
        let mut g_out = match sum_down && gated {
            true => Some(self.scratch::<f32>(n)?),
            false => None,
        };
        match (router.f32_rows(), &mut x) {
            (Some((rw, ld)), x) if fused_router => {
                // the router product and the routing in one launch (and the pre-norm: the
                // router reads the residual rows `ob` and writes h, h8)
                let (xin, nw, eps, hout, h8) = match x {
                    MoeIn::Rows(xb, _) => (&**xb, None, 0.0f32, None, None),
                    MoeIn::Norm { nw, eps, h, h8 } => {
                        (&*ob, Some(*nw), *eps, Some(&mut **h), h8.as_deref_mut())
                    }
                };
                let da = u32_arg(OP, "width", d)?;
                let rows = ne + u32::from(g_out.is_some());
                let mut b = self.stream.kernel(&self.k.moe_router_topk_f32);
                b.arg(rw).arg(&ld).arg(xin).arg(&da);
                b.arg(&ne).arg(&ka).arg(&gating);
                b.arg(bias);
                b.arg(&norm).arg(&scale).arg(&mut logits);
                b.arg(&self.router_counts).arg(&mut ids).arg(&mut wts);
                b.arg(sgate.filter(|_| g_out.is_some())).arg(g_out.as_mut());
                b.arg(nw).arg(&eps).arg(hout).arg(h8);
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(ROUTER_WARPS), nt, 1),
                    block_dim: (32 * ROUTER_WARPS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: moe_router_topk_f32(const float* w, uint64_t ld, const float* x,
                // uint32_t d, uint32_t n_exp, uint32_t k, uint32_t gating, const float* bias (or
                // null), uint32_t norm_topk, float scale, float* logits, uint32_t* counts,
                // uint32_t* ids, float* weights, const float* sgate (or null), float* gout,
                // const float* nw (or null), float eps, float* hout (or null), uint8_t* h8 (or
                // null)), grid (ceil((n_exp + gate row) / 4), n), 128 threads: w is the
                // router's f32 image of n_exp rows of ld >= d floats, 16-byte aligned rows
                // (f32_rows); x holds n * d floats (checked: the given rows, or out), d a
                // multiple of 4 (checked); logits n * n_exp, ids and weights n * k; counts
                // holds MOE_ROUTED_MAX_TOKENS >= n zeros (allocated zeroed, and every launch's
                // last block of a token sets its counter back to zero); n_exp <= 512 and k <=
                // 32 (warp), bias n_exp; with the gate row, sgate holds d floats (checked, a
                // device allocation: 16-byte aligned) and gout n; with nw (d floats, checked),
                // d is a multiple of 128 and >= 256 (router_norms), hout holds n * d floats and
                // h8 (or null) n * x8_row_bytes(d) bytes (norm_moe_add_impl's checked tensors).
                unsafe { b.launch(cfg) }.map_err(dev_err)?;
            }
            (_, MoeIn::Norm { .. }) => {
                return shape_err(OP, "a pre-norm without the fused router");
            }
            (_, MoeIn::Rows(xb, _)) => {
                self.matmul_dev(router, xb, n, &mut logits)?;
                let smem = u32_arg(OP, "experts", (n_exp * 9).div_ceil(4) * 4)?;
                if smem > 48 * 1024 {
                    return Err(BackendError::Unsupported {
                        op: OP,
                        what: format!(
                            "{n_exp} experts (routing table over 48 KiB of shared memory)"
                        ),
                    });
                }
                // one warp per token where the scores fit its registers
                let f = match warp {
                    true => &self.k.moe_topk_warp_f32,
                    false => &self.k.moe_topk_f32,
                };
                let mut b = self.stream.kernel(f);
                b.arg(&logits).arg(&ne).arg(&ka).arg(&gating);
                b.arg(bias);
                b.arg(&norm).arg(&scale).arg(&mut ids).arg(&mut wts);
                let cfg = LaunchConfig {
                    grid_dim: (nt, 1, 1),
                    block_dim: (if warp { 32 } else { row_threads(n_exp) }, 1, 1),
                    shared_mem_bytes: if warp { 0 } else { smem },
                };
                // SAFETY: moe_topk_f32 / moe_topk_warp_f32(const float* logits, uint32_t n_exp,
                // uint32_t k, uint32_t gating, const float* bias (or null), uint32_t norm_topk,
                // float scale, uint32_t* ids, float* weights), one block per token (the block
                // kernel with n_exp * 9 bytes of dynamic shared memory; the warp kernel 32
                // threads, n_exp <= 32 * TOPK_VPL and k <= 32): logits hold n * n_exp floats,
                // bias n_exp, ids and weights n * k entries, k <= n_exp.
                unsafe { b.launch(cfg) }.map_err(dev_err)?;
            }
        }
        // the block's input rows (the pre-norm's, now written) and their int8 form where it
        // came with them (the experts' inputs unless a latent projection comes first)
        let (xb, x8): (&CudaSlice<f32>, Option<&CudaSlice<u8>>) = match x {
            MoeIn::Rows(xb, x8) => (xb, x8),
            MoeIn::Norm { h, h8, .. } => (h, h8.map(|v| &*v)),
        };
        // expert inputs (projected into the latent space when there is one)
        let x_lat = match &latent {
            Some((down, _, ld)) => {
                let mut xl = self.scratch::<f32>(n * ld)?;
                self.matmul_dev(down, xb, n, &mut xl)?;
                Some(xl)
            }
            None => None,
        };
        let xe = x_lat.as_ref().unwrap_or(xb);
        // the shared expert rides in the routed launches (its rows after the pairs' in ye)
        // where it is a twin of the routed experts: same activation, sizes and formats
        let fold = match (&routed, &shared) {
            (Some(m), Some((s, s_ff, s_act))) if small && latent.is_none() && shared_fold_on() => {
                let same = |a: &Mat<'_>, b: &Mat<'_>| {
                    a.w.dtype() == b.w.dtype() && b.w.n_experts() == 1 && b.w.gemv_ok()
                };
                let gates = match (&m.gate, &s.gate) {
                    (Some(a), Some(b)) => same(a, b),
                    (None, None) => true,
                    _ => false,
                };
                (*s_act == w.act && *s_ff == w.n_ff && gates && same(&m.up, &s.up))
                    && same(&m.down, &s.down)
            }
            _ => false,
        };
        // the shared expert's output where it does not ride in the routed launches (gated
        // per token by the final kernel)
        let sh = match &shared {
            Some((m, n_ff, act)) if !fold => {
                let mut sh = self.scratch::<f32>(n * d)?;
                self.mlp_dev(m, *act, *n_ff, n, (xb, x8), &mut sh)?;
                Some(sh)
            }
            _ => None,
        };
        let n_sh = if fold { n } else { 0 };
        let ye_rows = if sum_down && routed.is_some() {
            1
        } else {
            n * k + n_sh
        };
        let mut ye = self.scratch::<f32>(ye_rows * de)?;
        match &routed {
            Some(m) if small => {
                let ids_v = ids.slice(0..n * k);
                let route = |x_div, x0| GemvRoute {
                    ids: &ids_v,
                    n_pairs: n * k,
                    x_div,
                    tiles: false,
                    shared: fold.then_some(SharedPairs {
                        tokens: n,
                        x0,
                        twins: &[],
                    }),
                };
                let io = (xe, x8.filter(|_| latent.is_none()), &mut ye);
                let sh_mats = match (fold, &shared) {
                    (true, Some((s, _, _))) => Some(s),
                    _ => None,
                };
                let (r_in, r_down) = (route(k, 0), route(1, n * k));
                let sum = sum_down.then_some(SumTo {
                    out: &mut *ob,
                    accumulate,
                    n,
                    k,
                    weights: &wts,
                    gate: g_out.as_ref(),
                    sh: sh.as_ref(),
                });
                let summed = sum.is_some();
                self.moe_experts(m, w.act, w.n_ff, n * k, io, &r_in, &r_down, sh_mats, sum)?;
                if summed {
                    return Ok(());
                }
            }
            Some(m) => self.moe_tiled(m, w.act, w.n_ff, n, k, xe, &ids, &mut ye)?,
            None => self.moe_grouped(&grouped, w.act, w.n_ff, n, k, xe, &ids, &mut ye)?,
        }

        let sh_view = match (&sh, fold) {
            (Some(sh), _) => Some(sh.as_view()),
            (None, true) => Some(ye.slice(n * k * de..)),
            (None, false) => None,
        };
        let Some((_, up, _)) = &latent else {
            // weighted sum in top-k order, the gated shared expert and the residual add in
            // one kernel
            let fin = MoeFinish {
                sh: sh_view.as_ref(),
                x: xb,
                gate: sgate,
                accumulate,
            };
            return self.moe_finish(&ye, &wts, n, k, d, &fin, ob);
        };
        // the weighted sum in the latent space, projected back up; then the shared expert
        let mut routed_lat = self.scratch::<f32>(n * de)?;
        let plain = MoeFinish {
            sh: None,
            x: xb,
            gate: None,
            accumulate: false,
        };
        self.moe_finish(&ye, &wts, n, k, de, &plain, &mut routed_lat)?;
        let mut sum = if accumulate {
            Some(self.scratch::<f32>(n * d)?)
        } else {
            None
        };
        let dst: &mut CudaSlice<f32> = match sum.as_mut() {
            Some(s) => s,
            None => &mut *ob,
        };
        self.matmul_dev(up, &routed_lat, n, dst)?;
        if let Some(sh) = &sh {
            let da = u32_arg(OP, "width", d)?;
            let mut b = self.stream.kernel(&self.k.moe_shared_add_f32);
            b.arg(&mut *dst).arg(sh).arg(xb);
            b.arg(sgate);
            b.arg(&da).arg(&da);
            let cfg = LaunchConfig {
                grid_dim: (nt, 1, 1),
                block_dim: (row_threads(d), 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: moe_shared_add_f32(float* out, const float* sh, const float* x,
            // const float* gate (or null), uint32_t d, uint32_t dx), one block per token: out,
            // sh and x hold n * d floats, gate d.
            unsafe { b.launch(cfg) }.map_err(dev_err)?;
        }
        if let Some(s) = &sum {
            self.add_dev(ob, s, n * d)?;
        }
        Ok(())
    }

    /// `out [n, d]` (= or +=, `fin.accumulate`) the weighted sum of `ye [n * k, d]` with `w
    /// [n, k]` plus the gated shared expert of `fin` (kernels/ffn.cu `moe_finish_f32`).
    #[allow(clippy::too_many_arguments)]
    fn moe_finish(
        &self,
        ye: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        n: usize,
        k: usize,
        d: usize,
        fin: &MoeFinish<'_>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        const OP: &str = "moe";
        if n == 0 || d == 0 {
            return Ok(());
        }
        const THREADS: usize = 256;
        let (ka, da, acc) = (
            u32_arg(OP, "top_k", k)?,
            u32_arg(OP, "width", d)?,
            u32::from(fin.accumulate),
        );
        let mut b = self.stream.kernel(&self.k.moe_finish_f32);
        b.arg(ye).arg(w).arg(&ka).arg(&da);
        b.arg(fin.sh);
        b.arg(fin.x);
        b.arg(fin.gate);
        b.arg(&da).arg(&acc).arg(out);
        let cfg = LaunchConfig {
            grid_dim: (
                u32_arg(OP, "column blocks", d.div_ceil(THREADS))?,
                grid_yz(OP, "tokens", n)?,
                1,
            ),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: moe_finish_f32(const float* ye, const float* w, uint32_t k, uint32_t d,
        // const float* sh (or null), const float* x, const float* gate (or null), uint32_t dx,
        // uint32_t accumulate, float* out), grid (ceil(d / 256), n): ye holds n * k * d floats
        // (every pair's row written by the expert products), w n * k, sh and out n * d, x n * d
        // (dx = d: the shared expert's input is the block's input), gate d (callers' buffers
        // of those sizes).
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    /// Whether `moe` of `w` over `n` tokens reads the routing back (see
    /// [`kapitsa_backend::Backend::moe_reads_back`]): not where the routed form takes it.
    pub(crate) fn moe_reads_back_impl(&self, w: &MoeWeights, n: usize) -> bool {
        const OP: &str = "moe";
        if n > MOE_ROUTED_MAX_TOKENS || !routed_on() {
            return true;
        }
        let de = match &w.latent {
            Some(l) => match l.down.dims2(OP) {
                Ok((ld, _)) => ld,
                Err(_) => return true,
            },
            None => match w.router.dims2(OP) {
                Ok((_, d)) => d,
                Err(_) => return true,
            },
        };
        !matches!(self.routed_mats(w, de, OP), Ok(Some(_)))
    }

    /// The stacked experts on the device (kernels/matmul.cu `gemv_id_<ty>`, or
    /// `gemv_grp_<ty>` for tiles): row q of `ye` (`[rows, de]`) = the MLP of the expert
    /// `r_in` gives it on `xe`'s row (`r_in.x_div` = top_k: token rows; tiles: x row q), with
    /// `r_down` (x_div 1) routing its hidden row q through the down projection. `m` is any
    /// expert's matrices of stacks that [`Self::routed_mats`] accepted (the kernel adds
    /// `expert * rows per expert`). Device buffers; with tiles `xe` holds 7 rows more; `xe8`
    /// the int8 form of `xe`'s rows where it came with them (matmul/gemv.rs `x8_mode`).
    /// `shared` (with `r_in.shared` and `r_down.shared` of `tokens` pairs, `x0` 0 and `rows`):
    /// the shared expert's matrices, twins of `m`'s, run for every token in the same
    /// launches into `ye` rows `rows ..  rows + tokens` (`ye` holds them).
    /// With `sum` (routed pairs only), the down projections and the MoE's weighted sum run
    /// as one launch into `sum.out` instead (kernels/matmul.cu `gemv_id_sum_<ty>`; the shared
    /// expert's down projection rides in it) and `ye` is not written.
    #[allow(clippy::too_many_arguments)]
    fn moe_experts(
        &self,
        m: &ExpertMats<'_>,
        act: Act,
        n_ff: usize,
        rows: usize,
        (xe, xe8, ye): (&CudaSlice<f32>, Option<&CudaSlice<u8>>, &mut CudaSlice<f32>),
        r_in: &GemvRoute<'_>,
        r_down: &GemvRoute<'_>,
        shared: Option<&ExpertMats<'_>>,
        sum: Option<SumTo<'_>>,
    ) -> Result<()> {
        const OP: &str = "moe";
        // the shared expert's pairs ride after the routed ones (r_in.shared gives their count)
        let n_sh = r_in.shared.map_or(0, |s| s.tokens);
        let np = rows + n_sh;
        // the tiles read 7 hidden rows past the last one (their results dropped)
        let pad = if r_down.tiles { 7 } else { 0 };
        let mut h = self.scratch::<f32>((np + pad) * n_ff)?;
        let mut u = self.scratch::<f32>((np + pad) * n_ff)?;
        // the shared expert's matrices: the twins of the routed products
        let sh_gate = shared.and_then(|s| s.gate.as_ref()).map(|x| x.w);
        let sh_up = shared.map(|s| s.up.w);
        let sh_down = shared.map(|s| s.down.w);
        // one routed launch; the route's shared pairs run the twins of its products
        let launch = |ps: &[(&CudaWeight, usize, usize)],
                      ys: Vec<&mut CudaSlice<f32>>,
                      (x, x8): (&CudaSlice<f32>, Option<&CudaSlice<u8>>),
                      route: &GemvRoute<'_>,
                      twins: &[Option<&CudaWeight>],
                      glu: bool|
         -> Result<()> {
            let tw: Vec<&CudaWeight> = twins.iter().flatten().copied().collect();
            let mut r = GemvRoute {
                ids: route.ids,
                n_pairs: route.n_pairs,
                x_div: route.x_div,
                tiles: route.tiles,
                shared: None,
            };
            if let Some(s) = route.shared {
                if tw.len() != ps.len() {
                    return shape_err(OP, "a shared expert without a twin of every product");
                }
                r.shared = Some(SharedPairs { twins: &tw, ..s });
            }
            self.routed_launch(ps, ys, (x, x8), &r, glu)
        };
        let per_token = r_in;
        match (act, &m.gate) {
            (Act::SwiGlu, Some(gate)) => {
                let (g, up) = (part(gate, n_ff), part(&m.up, n_ff));
                if gate.w.dtype() == m.up.w.dtype() && fuse_on() {
                    // gate and up in one launch, silu(gate) * up in its epilogue
                    let tw = [sh_gate, sh_up];
                    launch(
                        &[g, up],
                        vec![&mut h, &mut u],
                        (xe, xe8),
                        per_token,
                        &tw,
                        true,
                    )?;
                } else {
                    launch(&[g], vec![&mut h], (xe, xe8), per_token, &[sh_gate], false)?;
                    launch(&[up], vec![&mut u], (xe, xe8), per_token, &[sh_up], false)?;
                    self.silu_mul_dev(&mut h, &u, np * n_ff)?;
                }
            }
            (Act::Relu2, None) => {
                launch(
                    &[part(&m.up, n_ff)],
                    vec![&mut h],
                    (xe, xe8),
                    per_token,
                    &[sh_up],
                    false,
                )?;
                self.relu2_dev(&mut h, np * n_ff)?;
            }
            (Act::SwiGlu, None) => return shape_err(OP, "a SwiGLU expert without a gate"),
            (Act::Relu2, Some(_)) => return shape_err(OP, "a squared-ReLU expert with a gate"),
        }
        let de = m.down.rows.len();
        let Some(s) = sum else {
            return launch(
                &[part(&m.down, de)],
                vec![ye],
                (&h, None),
                r_down,
                &[sh_down],
                false,
            );
        };
        if r_down.tiles {
            return shape_err(OP, "the routed down sum with tiles");
        }
        let (w, row0, n_rows) = part(&m.down, de);
        let mut yv = s.out.as_view_mut();
        let mut dp = GemvPart {
            w,
            row0,
            n_rows,
            y: &mut yv,
            ep: GemvEpilogue {
                bias: None,
                accumulate: s.accumulate,
            },
        };
        let wv = s.weights.as_view();
        let gv = s.gate.map(|g| g.as_view());
        let shv = s.sh.map(|v| v.as_view());
        let x0 = r_down.shared.map_or(0, |p| p.x0);
        let msum = MoeSum {
            n_tok: s.n,
            top_k: s.k,
            weights: &wv,
            gate: gv.as_ref(),
            twin: sh_down.map(|t| (t, x0)),
            sh: shv.as_ref(),
        };
        self.mm
            .gemv_id_sum(&self.stream, &mut dp, &h.as_view(), r_down.ids, &msum)
    }

    /// One `gemv_id` launch of the products `ps` (weight, first row within an expert, rows)
    /// into `ys` (`[n_pairs, rows]` each).
    fn routed_launch(
        &self,
        ps: &[(&CudaWeight, usize, usize)],
        ys: Vec<&mut CudaSlice<f32>>,
        (x, x8): (&CudaSlice<f32>, Option<&CudaSlice<u8>>),
        route: &GemvRoute<'_>,
        glu: bool,
    ) -> Result<()> {
        let mut views: Vec<_> = ys.into_iter().map(|y| y.as_view_mut()).collect();
        let mut parts = expert_parts(ps, &mut views);
        self.mm
            .gemv_id(&self.stream, &mut parts, &x.as_view(), x8, route, glu)
    }

    /// The `[n * k]` routed ids brought back to the host (one synchronisation) and the
    /// (token, slot) pairs q = t * k + j grouped by expert: `(order, starts)` with `order`
    /// the pairs sorted by expert (ascending q within one) and expert e's run
    /// `order[starts[e] .. starts[e + 1]]`.
    fn group_pairs(
        &self,
        ids: &CudaSlice<u32>,
        np: usize,
        n_exp: usize,
    ) -> Result<(Vec<u32>, Vec<usize>)> {
        let mut ids_h = vec![0u32; np];
        self.stream
            .memcpy_dtoh(&ids.slice(0..np), &mut ids_h[..])
            .map_err(dev_err)?;
        self.stream.synchronize().map_err(dev_err)?;
        sort_pairs(&ids_h, n_exp)
    }

    /// The tiled experts (prompts): the pairs are grouped by expert on the host
    /// ([`Self::group_pairs`]), each expert's run cut into tiles ([`push_tiles`]: 16 or 64
    /// pairs for the tensor-core kernels, 8 for the grouped GEMV) and run through the stacked
    /// experts: on tensor cores ([`Self::moe_experts_mma`]: gate/up in one launch, the
    /// activation, down) reading the tokens' rows of `xe` and writing the pairs' rows of `ye`
    /// through row maps; else the sorted rows of `xe` gathered, run through
    /// [`Self::moe_experts`] on `gemv_grp_<ty>` and scattered into `ye`. A handful of
    /// launches a layer whatever the expert count. Shapes as in [`Self::moe_experts`]
    /// (`xe [n, de]`, `ids [n * k]`, `ye [n * k, de]`).
    #[allow(clippy::too_many_arguments)]
    fn moe_tiled(
        &self,
        m: &ExpertMats<'_>,
        act: Act,
        n_ff: usize,
        n: usize,
        k: usize,
        xe: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        ye: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let np = n * k;
        let n_exp = m.up.w.n_experts();
        let de = m.down.rows.len();
        let (order, starts) = self.group_pairs(ids, np, n_exp)?;
        // tensor cores where the format has the kernels, tiles of 16 or 64 pairs by the mean
        // pairs per used expert; else the grouped GEMV's tiles of 8
        let mma = mma_on()
            && [Some(&m.up), Some(&m.down), m.gate.as_ref()]
                .into_iter()
                .flatten()
                .all(|x| self.mm.gemm_grp_ok(x.w));
        let used = starts.windows(2).filter(|r| r[1] > r[0]).count().max(1);
        let tile = match (mma, mma_tile()) {
            (false, _) => 8,
            (true, Some(t)) => t,
            (true, None) if np >= 24 * used => GEMM_GRP_TILES[1],
            (true, None) => GEMM_GRP_TILES[0],
        };
        // order, then (tensor cores) each sorted pair's token, then the tiles (expert, first
        // sorted row, count), in one upload
        let mut table = order;
        if mma {
            let k32 = k as u32;
            table.extend_from_within(..np);
            table[np..].iter_mut().for_each(|q| *q /= k32);
        }
        let maps_len = table.len();
        let n_tiles = push_tiles(&starts, tile, &mut table);
        let mut table_d = self.scratch::<u32>(table.len())?;
        self.stream
            .memcpy_htod(&table[..], &mut table_d)
            .map_err(dev_err)?;
        let order_d = table_d.slice(0..np);
        let tiles_d = table_d.slice(maps_len..);
        if mma {
            // the tokens' rows read and the pairs' rows written in place: no gather or
            // scatter
            let toks_d = table_d.slice(np..2 * np);
            let tl = (&tiles_d, n_tiles, tile);
            let rows = MmaRows {
                tokens: n,
                toks: &toks_d,
                order: &order_d,
            };
            return self.moe_experts_mma(m, act, n_ff, np, (xe, ye), tl, &rows);
        }
        // (the grouped GEMV reads 7 rows past a tile's last)
        let mut xg = self.scratch::<f32>((np + 7) * de)?;
        self.gather_rows_dev(xe, n, &order_d, k, np, de, &mut xg)?;
        let mut yg = self.scratch::<f32>(np * de)?;
        let route = GemvRoute {
            ids: &tiles_d,
            n_pairs: n_tiles,
            x_div: 1,
            tiles: true,
            shared: None,
        };
        self.moe_experts(
            m,
            act,
            n_ff,
            np,
            (&xg, None, &mut yg),
            &route,
            &route,
            None,
            None,
        )?;
        self.scatter_rows_dev(&yg, &order_d, np, de, ye, np)
    }

    /// [`Self::moe_experts`] over tiles on tensor cores (kernels/matmul.cu
    /// `gemm_grp_<ty>_<bn>`): gate and up in one launch, the activation, down. `tiles` is
    /// (the tiles, their count, pairs per tile) over the `pairs` (token, slot) pairs sorted
    /// by expert; `xe [rows.tokens, de]` and `ye [pairs, de]` (device) in token and pair
    /// order, read and written through `rows`' maps; the hidden rows in sorted order.
    #[allow(clippy::too_many_arguments)]
    fn moe_experts_mma(
        &self,
        m: &ExpertMats<'_>,
        act: Act,
        n_ff: usize,
        pairs: usize,
        (xe, ye): (&CudaSlice<f32>, &mut CudaSlice<f32>),
        tl: (&CudaView<'_, u32>, usize, usize),
        rows: &MmaRows<'_, '_>,
    ) -> Result<()> {
        const OP: &str = "moe";
        let launch = |ps: &[(&CudaWeight, usize, usize)],
                      ys: Vec<&mut CudaSlice<f32>>,
                      (x, x_rows): (&CudaSlice<f32>, usize),
                      maps: [Option<&CudaView<'_, u32>>; 2]|
         -> Result<()> {
            let mut views: Vec<_> = ys.into_iter().map(|y| y.as_view_mut()).collect();
            let mut parts = expert_parts(ps, &mut views);
            let xv = x.as_view();
            self.mm
                .gemm_grp(&self.stream, &mut parts, &xv, x_rows, tl, maps)
        };
        let xin = (xe, rows.tokens);
        let in_maps = [Some(rows.toks), None];
        let mut h = self.scratch::<f32>(pairs * n_ff)?;
        match (act, &m.gate) {
            (Act::SwiGlu, Some(gate)) => {
                let mut u = self.scratch::<f32>(pairs * n_ff)?;
                let (g, up) = (part(gate, n_ff), part(&m.up, n_ff));
                if gate.w.dtype() == m.up.w.dtype() {
                    launch(&[g, up], vec![&mut h, &mut u], xin, in_maps)?;
                } else {
                    launch(&[g], vec![&mut h], xin, in_maps)?;
                    launch(&[up], vec![&mut u], xin, in_maps)?;
                }
                self.silu_mul_dev(&mut h, &u, pairs * n_ff)?;
            }
            (Act::Relu2, None) => {
                launch(&[part(&m.up, n_ff)], vec![&mut h], xin, in_maps)?;
                self.relu2_dev(&mut h, pairs * n_ff)?;
            }
            (Act::SwiGlu, None) => return shape_err(OP, "a SwiGLU expert without a gate"),
            (Act::Relu2, Some(_)) => return shape_err(OP, "a squared-ReLU expert with a gate"),
        }
        let de = m.down.rows.len();
        launch(
            &[part(&m.down, de)],
            vec![ye],
            (&h, pairs),
            [None, Some(rows.order)],
        )
    }

    /// The per-expert form (experts uploaded one by one, or `KAPITSA_MOE_TILED=0`): the
    /// pairs grouped on the host ([`Self::group_pairs`]); each used expert's pairs are
    /// gathered from `xe`, run through its MLP and scattered into `ye` (shapes as in
    /// [`Self::moe_tiled`]).
    #[allow(clippy::too_many_arguments)]
    fn moe_grouped(
        &self,
        mats: &[ExpertMats<'_>],
        act: Act,
        n_ff: usize,
        n: usize,
        k: usize,
        xe: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        ye: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let de = mats.first().map_or(0, |m| m.down.rows.len());
        let (order, counts) = self.group_pairs(ids, n * k, mats.len())?;
        let mut order_d = self.scratch::<u32>(n * k)?;
        self.stream
            .memcpy_htod(&order[..], &mut order_d)
            .map_err(dev_err)?;
        for (e, mats) in mats.iter().enumerate() {
            let (a, b) = (counts[e], counts[e + 1]);
            if a == b {
                continue;
            }
            let cnt = b - a;
            let idx = order_d.slice(a..b);
            let mut xg = self.scratch::<f32>(cnt * de)?;
            self.gather_rows_dev(xe, n, &idx, k, cnt, de, &mut xg)?;
            let mut yg = self.scratch::<f32>(cnt * de)?;
            self.mlp_dev(mats, act, n_ff, cnt, (&xg, None), &mut yg)?;
            self.scatter_rows_dev(&yg, &idx, cnt, de, ye, n * k)?;
        }
        Ok(())
    }
}

/// The row maps of the tensor-core MoE ([`CudaBackend::moe_experts_mma`]): the expert
/// inputs have `tokens` rows; sorted pair s reads row `toks[s]` (its token) and its output
/// goes to row `order[s]` (its pair index); device arrays of the pairs' count.
struct MmaRows<'a, 'b> {
    tokens: usize,
    toks: &'a CudaView<'b, u32>,
    order: &'a CudaView<'b, u32>,
}

/// The (token, slot) pairs q of routed expert ids `ids` grouped by expert: `(order, starts)`,
/// `order` the pairs sorted by expert (ascending q within one), expert e's run
/// `order[starts[e] .. starts[e + 1]]`. An id not below `n_exp` is a device error (the top-k
/// kernel wrote something it cannot have).
fn sort_pairs(ids: &[u32], n_exp: usize) -> Result<(Vec<u32>, Vec<usize>)> {
    let mut starts = vec![0usize; n_exp + 1];
    for &e in ids {
        if e as usize >= n_exp {
            return Err(BackendError::Device(format!(
                "moe: routed to expert {e} of {n_exp}"
            )));
        }
        starts[e as usize + 1] += 1;
    }
    for e in 0..n_exp {
        starts[e + 1] += starts[e];
    }
    let mut fill = starts.clone();
    let mut order = vec![0u32; ids.len()];
    for (q, &e) in ids.iter().enumerate() {
        order[fill[e as usize]] = q as u32;
        fill[e as usize] += 1;
    }
    Ok((order, starts))
}

/// Appends to `table` the tiles of the sorted runs `starts` ([`sort_pairs`]): every expert's
/// run cut into pieces of at most `tile` pairs, each as (expert, first sorted row, count).
/// Returns the number of tiles.
fn push_tiles(starts: &[usize], tile: usize, table: &mut Vec<u32>) -> usize {
    let mut n_tiles = 0;
    for (e, run) in starts.windows(2).enumerate() {
        let mut f = run[0];
        while f < run[1] {
            let c = (run[1] - f).min(tile.max(1));
            table.extend([e as u32, f as u32, c as u32]);
            f += c;
            n_tiles += 1;
        }
    }
    n_tiles
}

/// The products `ps` (weight, first row within an expert, rows) into `views` (one each), no
/// epilogues: the parts of a routed or grouped launch.
fn expert_parts<'a, 'y>(
    ps: &[(&'a CudaWeight, usize, usize)],
    views: &'a mut [CudaViewMut<'y, f32>],
) -> Vec<GemvPart<'a, 'y>> {
    ps.iter()
        .zip(views.iter_mut())
        .map(|(&(w, row0, n_rows), y)| GemvPart {
            w,
            row0,
            n_rows,
            y,
            ep: GemvEpilogue::default(),
        })
        .collect()
}

/// A product of expert MLP operand `mat`: (its stack, first row within an expert, rows).
fn part<'a>(mat: &Mat<'a>, n_rows: usize) -> (&'a CudaWeight, usize, usize) {
    (mat.w, mat.rows.start, n_rows)
}

/// Where [`CudaBackend::moe_experts`] sums the routed experts straight into the MoE's
/// output: `out [n, d]` (= or +=) the weighted sum (weights `[n, k]`) plus the shared
/// expert times its gate (`[n]`, 1 without; its output `sh [n, d]` when computed apart).
struct SumTo<'a> {
    out: &'a mut CudaSlice<f32>,
    accumulate: bool,
    n: usize,
    k: usize,
    weights: &'a CudaSlice<f32>,
    gate: Option<&'a CudaSlice<f32>>,
    sh: Option<&'a CudaSlice<f32>>,
}

/// Most tokens whose routed down projections and weighted sum run as one launch
/// ([`SumTo`]): each token's blocks stream its experts' rows, which pays for decode but not
/// for a batch of 16 (measured on an H100: 16 streams 665 t/s with it, 681 without).
const MOE_SUM_MAX_TOKENS: usize = 4;

/// The tail of [`CudaBackend::moe_finish`]: the shared expert's output `[n, d]` and its gate
/// (`[d]`, over the block input `x [n, d]`), and whether to add into the output.
struct MoeFinish<'a> {
    sh: Option<&'a CudaView<'a, f32>>,
    x: &'a CudaSlice<f32>,
    gate: Option<&'a CudaSlice<f32>>,
    accumulate: bool,
}

/// Largest token count whose MoE runs routed on the device ([`CudaBackend::moe_experts`]):
/// every (token, slot) pair streams its own expert's rows, which pays while few tokens share
/// experts and keeps the op free of host round trips (recordable); larger batches group the
/// tokens by expert ([`CudaBackend::moe_tiled`]). The recorded steps' limit
/// (`MAX_RECORDED_TOKENS`, 16).
const MOE_ROUTED_MAX_TOKENS: usize = 16;

env_switch! {
    /// Whether the routed form is on (`KAPITSA_MOE_ROUTED=0` turns it off, for measurements).
    fn routed_on = "KAPITSA_MOE_ROUTED"
}

env_switch! {
    /// Whether the tiled form runs on tensor cores where the format allows
    /// (`KAPITSA_MOE_MMA=0`: the grouped GEMV's tiles, for measurements).
    fn mma_on = "KAPITSA_MOE_MMA"
}

/// Pairs per tensor-core tile forced by `KAPITSA_MOE_TILE` (16 or 64; unset: chosen by the
/// mean pairs per used expert), for measurements.
fn mma_tile() -> Option<usize> {
    static CELL: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *CELL.get_or_init(|| {
        let v = std::env::var("KAPITSA_MOE_TILE").ok()?.parse().ok()?;
        GEMM_GRP_TILES.contains(&v).then_some(v)
    })
}

/// Most experts the one-warp top-k takes (kernels/ffn.cu `32 * TOPK_VPL`).
const TOPK_WARP_MAX_EXPERTS: usize = 512;

/// Expert rows per block of the fused router (kernels/ffn.cu `ROUTER_WARPS`).
const ROUTER_WARPS: u32 = 4;

/// Whether `norm_moe_add` computes its pre-norm in the fused router (`KAPITSA_MOE_PRENORM=1`;
/// off otherwise: an `rms_norm_to` launch first). One launch fewer per MoE layer, but the
/// router's warps then read the row twice and its last block waits for the norm's writers: on
/// an H100 the router went from ~9 to 15 us a launch and tg128 lost 1.3% (Qwen3.6, 306.9 to
/// 303.0 t/s) and Qwen3-30B-A3B 1.3% (257.1 to 253.9; BENCHMARKS.md, stop 45).
fn prenorm_on() -> bool {
    static CELL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CELL.get_or_init(|| std::env::var("KAPITSA_MOE_PRENORM").is_ok_and(|v| v == "1"))
}

/// Per-token counters of the fused router's blocks (kernels/ffn.cu `moe_router_topk_f32`):
/// one per token of a routed launch.
pub(crate) const ROUTER_COUNTERS: usize = MOE_ROUTED_MAX_TOKENS;

env_switch! {
    /// Whether decode's routed down projections and the MoE's weighted sum (and shared
    /// expert, residual) are one launch (`gemv_id_sum_<ty>`; `KAPITSA_MOE_DOWN_SUM=0`: the
    /// down launch and `moe_finish_f32`, for measurements).
    fn id_sum_on = "KAPITSA_MOE_DOWN_SUM"
}

env_switch! {
    /// Whether a shared expert that is a twin of the routed ones (activation, sizes,
    /// formats) runs in the routed launches for up to [`MOE_ROUTED_MAX_TOKENS`] tokens
    /// (`KAPITSA_MOE_SHARED_FOLD=0`: its own MLP launches, for measurements).
    fn shared_fold_on = "KAPITSA_MOE_SHARED_FOLD"
}

env_switch! {
    /// Whether an f32 router's product and the routing run in one launch for up to
    /// [`MOE_ROUTED_MAX_TOKENS`] tokens (`KAPITSA_MOE_ROUTER_FUSED=0`: the router GEMV and
    /// the top-k kernel, for measurements).
    fn router_fused_on = "KAPITSA_MOE_ROUTER_FUSED"
}

env_switch! {
    /// Whether routing may take the one-warp top-k (`KAPITSA_TOPK_WARP=0`: the block kernel
    /// always, for measurements).
    fn topk_warp_on = "KAPITSA_TOPK_WARP"
}

env_switch! {
    /// Whether larger batches take the tiled form (`KAPITSA_MOE_TILED=0`: the per-expert form,
    /// for measurements).
    fn tiled_on = "KAPITSA_MOE_TILED"
}

#[cfg(test)]
mod tests {
    use super::{push_tiles, sort_pairs};

    #[test]
    fn pairs_sort_by_expert_keeping_their_order() {
        // 4 tokens x top-2 over 3 experts
        let ids = [2, 0, 0, 1, 2, 1, 0, 2];
        let (order, starts) = sort_pairs(&ids, 3).expect("valid ids");
        assert_eq!(starts, vec![0, 3, 5, 8]);
        assert_eq!(order, vec![1, 2, 6, 3, 5, 0, 4, 7]);
        for e in 0..3 {
            assert!(order[starts[e]..starts[e + 1]]
                .iter()
                .all(|&q| ids[q as usize] == e as u32));
        }
        assert!(sort_pairs(&[0, 3], 3).is_err(), "an id past the experts");
        assert_eq!(sort_pairs(&[], 2).expect("empty").1, vec![0, 0, 0]);
    }

    #[test]
    fn tiles_cover_every_run_in_pieces_of_at_most_the_tile() {
        // runs of 0, 17, 16, 1 and 40 pairs
        let starts = [0usize, 0, 17, 33, 34, 74];
        for tile in [8usize, 16, 64] {
            let mut table = vec![9u32; 5]; // whatever came before is kept
            let n = push_tiles(&starts, tile, &mut table);
            assert_eq!(&table[..5], &[9; 5]);
            let tiles: Vec<&[u32]> = table[5..].chunks(3).collect();
            assert_eq!(tiles.len(), n);
            let mut next = 0u32;
            for t in &tiles {
                let (e, f, c) = (t[0] as usize, t[1], t[2]);
                assert!(c >= 1 && c as usize <= tile);
                assert_eq!(f, next, "tiles follow each other");
                assert!(f as usize >= starts[e] && (f + c) as usize <= starts[e + 1]);
                next = f + c;
            }
            assert_eq!(next, 74, "every pair in a tile");
            let expect: usize = starts
                .windows(2)
                .map(|r| (r[1] - r[0]).div_ceil(tile))
                .sum();
            assert_eq!(n, expect);
        }
    }
}
