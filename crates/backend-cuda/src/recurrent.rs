//! Recurrent mixers on the GPU (launches of kernels/recurrent.cu): causal conv1d with carried
//! state, the Gated DeltaNet recurrence and the Mamba2 scan; the CUDA twin of the CPU
//! backend's src/recurrent.rs. One launch covers every sequence of the batch (grid z or y =
//! sequence); slots, starts and lengths come from the batch arrays in device memory. States
//! are f32 `[n_slots, ...]` tensors read and updated in place at each sequence's slot (slots
//! checked against the state size on the host).
//!
//! The token-sequential forms serve decode and short prompts. A batch whose longest sequence
//! has at least [`CHUNK_MIN`] tokens runs the Gated DeltaNet in its chunked form
//! (flash-linear-attention's WY form, three launches: kernels/recurrent.cu `gdn_chunk_*_f32`).
//! Mamba2's chunked (SSD) form (`mamba2_chunk_*_f32`) is written but opt-in
//! ([`mamba2_chunked`]) until it has passed on a GPU.

use cudarc::driver::{CudaSlice, LaunchConfig};
use kapitsa_backend::{
    shape_err, Batch, GdnConv, GdnMixerIo, GdnShape, HeadOrder, Mamba2Conv, Mamba2Shape, Result,
    Tensor,
};

use crate::batch::{BatchMeta, DevBatch};
use crate::device::{dev_err, grid_yz, u32_arg};
use crate::launch::KernelLaunch;
use crate::CudaBackend;

/// Largest conv kernel width (kernels/recurrent.cu `CONV_MAXK`).
const CONV_MAXK: usize = 8;
/// Largest Gated DeltaNet key head width (8 warps of 32 rows).
const GDN_MAX_DK: usize = 256;
/// Tokens per chunk of the chunked Gated DeltaNet (kernels/recurrent.cu `GDN_CT`).
const GDN_CT: usize = 64;
/// Largest dk and dv of the chunked form (`GDN_CD`).
const GDN_CD: usize = 128;
/// Longest sequence from which a batch takes the chunked Gated DeltaNet and the chunked
/// Mamba2 scan (`KAPITSA_GDN_CHUNK_MIN` and `KAPITSA_MAMBA2_CHUNK_MIN` override it; 0 turns
/// the chunked form off).
pub(crate) const CHUNK_MIN: usize = 64;
/// Most warps of the fused Gated DeltaNet mixer (kernels/recurrent.cu
/// `GDN_FUSED_MAX_WARPS`): ceil(dk / 32) * ceil(dv / 32).
const GDN_FUSED_MAX_WARPS: usize = 16;
/// Per-(sequence, k head) counters of the fused mixer's conv-state readers.
pub(crate) const GDN_COUNTERS: usize = 4096;

/// Floats of dynamic shared memory of the fused mixer (kernels/recurrent.cu
/// `gdn_fused_smem`: the conv windows, q, k and v of a token, the two partial-sum arrays and
/// a reduction scratch).
fn gdn_fused_smem(dk: usize, dv: usize, k: usize) -> usize {
    let (rg, cg) = (dk.div_ceil(32), dv.div_ceil(32));
    (k - 1) * (2 * dk + dv) + 2 * dk + dv + 2 * rg * cg * 32 + 64
}

env_switch! {
    /// Whether the Gated DeltaNet mixer runs as one launch where it can
    /// (`KAPITSA_GDN_FUSED=0`: the preamble, the recurrence and the gated norm, for
    /// measurements).
    fn gdn_fused_on = "KAPITSA_GDN_FUSED"
}

/// Warps (head dims) per block of the Mamba2 kernel (kernels/recurrent.cu `M2_WARPS`).
const M2_WARPS: usize = 4;
/// Largest Mamba2 state size (8 per lane).
const M2_MAX_N: usize = 256;

/// The smallest longest sequence for a chunked form from the environment variable `var`
/// (else `default`; 0: never).
fn chunk_min(var: &str, default: usize, cell: &'static std::sync::OnceLock<usize>) -> usize {
    *cell.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    })
}

/// Whether a batch takes the chunked Gated DeltaNet (where the heads allow it): its longest
/// sequence has at least `KAPITSA_GDN_CHUNK_MIN` tokens ([`CHUNK_MIN`] by default, 0: never).
/// Part of a recorded batch's layout.
pub(crate) fn gdn_chunked(m: &BatchMeta) -> bool {
    static CELL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let min = chunk_min("KAPITSA_GDN_CHUNK_MIN", CHUNK_MIN, &CELL);
    min > 0 && m.max_len >= min
}

/// Whether a batch takes the chunked Mamba2 scan (where d_state allows it): as
/// [`gdn_chunked`] with `KAPITSA_MAMBA2_CHUNK_MIN` ([`CHUNK_MIN`] by default, 0: never).
pub(crate) fn mamba2_chunked(m: &BatchMeta) -> bool {
    static CELL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let min = chunk_min("KAPITSA_MAMBA2_CHUNK_MIN", CHUNK_MIN, &CELL);
    min > 0 && m.max_len >= min
}

/// Dynamic shared memory of the chunked Gated DeltaNet kernels (kernels/recurrent.cu: rows of
/// `GDN_CD + 4` floats, chunk matrices of `GDN_CT + 4`): (prep, state, out).
pub(crate) const fn gdn_chunk_smem() -> (usize, usize, usize) {
    let (ct, ld, ald) = (GDN_CT, GDN_CD + 4, GDN_CT + 4);
    (
        // q, k rows; A; G (f64); beta
        4 * (2 * ct * ld + ct * ald) + 8 * ct + 4 * ct,
        // two buffers of W and k rows; partial sums; V; two buffers of end decays
        4 * (4 * ct * ld + 4 * ct * 32 + ct * 33 + 2 * (ct + 4)),
        // q rows; q.k; state columns; V columns; exp(G)
        4 * (ct * ld + ct * ald + GDN_CD * 36 + ct * 36 + ct),
    )
}

/// Dynamic shared memory of the chunked Mamba2 kernels (kernels/recurrent.cu): (prep, state,
/// out).
pub(crate) const fn mamba2_chunk_smem() -> (usize, usize, usize) {
    let (ct, ld) = (GDN_CT, GDN_CD + 4);
    let buf = ct * ld + ct * 32 + ct + ct + 4; // `M2C_BUF`
    (
        // C and B rows; L (f64)
        4 * (2 * ct * ld) + 8 * ct,
        // two buffers of B rows, x columns, dt and decays
        4 * 2 * buf,
        // as gdn_chunk_out_f32
        gdn_chunk_smem().2,
    )
}

/// The device buffers of one `gdn` call (lengths checked against the batch).
struct GdnIo<'a> {
    q: &'a CudaSlice<f32>,
    k: &'a CudaSlice<f32>,
    v: &'a CudaSlice<f32>,
    g: &'a CudaSlice<f32>,
    beta: &'a CudaSlice<f32>,
    state: &'a mut CudaSlice<f32>,
    out: &'a mut CudaSlice<f32>,
}

/// The device buffers of one `mamba2` call (lengths checked against the batch).
struct Mamba2Io<'a> {
    x: &'a CudaSlice<f32>,
    dt: &'a CudaSlice<f32>,
    a: &'a CudaSlice<f32>,
    b: &'a CudaSlice<f32>,
    c: &'a CudaSlice<f32>,
    d: &'a CudaSlice<f32>,
    state: &'a mut CudaSlice<f32>,
    y: &'a mut CudaSlice<f32>,
}

/// Number of state slots of `state` (`per` values each), checking the batch's slots fit.
fn n_slots(op: &'static str, state: &Tensor, per: usize, db: &DevBatch) -> Result<usize> {
    if per == 0 {
        return Ok(u32::MAX as usize);
    }
    if !state.len().is_multiple_of(per) {
        return shape_err(
            op,
            format!("a state of {} values is not slots of {per}", state.len()),
        );
    }
    let n = state.len() / per;
    if db.n_seqs > 0 && db.max_slot >= n {
        return shape_err(
            op,
            format!("slot {} of a state with {n} slots", db.max_slot),
        );
    }
    Ok(n)
}

/// A Gated DeltaNet shape as the kernels' arguments: n_k_heads, n_v_heads, dk, dv, and the
/// value-head order (0 grouped, 1 tiled).
fn gdn_dims(op: &'static str, s: GdnShape) -> Result<[u32; 5]> {
    Ok([
        u32_arg(op, "k heads", s.n_k_heads)?,
        u32_arg(op, "v heads", s.n_v_heads)?,
        u32_arg(op, "dk", s.dk)?,
        u32_arg(op, "dv", s.dv)?,
        match s.order {
            HeadOrder::Grouped => 0,
            HeadOrder::Tiled => 1,
        },
    ])
}

/// The batch's sequence count as a grid dimension (y or z: at most 65535), or a shape error.
/// Tokens per block of the conv kernels (kernels/recurrent.cu `CONV_CHUNK`): grid.z of
/// `conv1d_causal_f32` and the preambles is [`conv_chunks`].
const CONV_CHUNK: usize = 16;

/// The conv kernels' token chunks: enough for the longest sequence (at most all tokens).
fn conv_chunks(op: &'static str, db: &DevBatch) -> Result<u32> {
    grid_yz(op, "token chunks", db.n_tokens.div_ceil(CONV_CHUNK).max(1))
}

fn grid_seqs(op: &'static str, db: &DevBatch) -> Result<u32> {
    grid_yz(op, "sequences", db.n_seqs)
}

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn conv1d_causal_impl(
        &self,
        x: &Tensor,
        channels: usize,
        k: usize,
        w: &Tensor,
        bias: Option<&Tensor>,
        silu: bool,
        conv_state: &mut Tensor,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "conv1d_causal";
        let db = self.dev_batch(batch, OP)?;
        if k == 0 || k > CONV_MAXK {
            return shape_err(OP, format!("kernel width {k} (1..={CONV_MAXK})"));
        }
        let n = db.n_tokens;
        let xb = self.f32_len(x, n * channels, OP, "x")?;
        let wb = self.f32_len(w, channels * k, OP, "w")?;
        let bb = match bias {
            Some(b) => Some(self.f32_len(b, channels, OP, "bias")?),
            None => None,
        };
        let slots = n_slots(OP, conv_state, (k - 1) * channels, db)?;
        let sb = self.buf_mut::<f32>(conv_state, OP, "conv_state")?;
        let ob = self.f32_len_mut(out, n * channels, OP, "out")?;
        if n == 0 || channels == 0 || db.n_seqs == 0 {
            return Ok(());
        }
        let (c, kk, si, ns, nseq) = (
            u32_arg(OP, "channels", channels)?,
            u32_arg(OP, "k", k)?,
            u32::from(silu),
            u32_arg(OP, "slots", slots)?,
            grid_seqs(OP, db)?,
        );
        let seqs = db.seqs();
        let mut b = self.stream.kernel(&self.k.conv1d_causal_f32);
        b.arg(xb).arg(wb);
        b.arg(bb);
        b.arg(sb)
            .arg(ob)
            .arg(&seqs)
            .arg(&c)
            .arg(&kk)
            .arg(&si)
            .arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (channels.div_ceil(128) as u32, nseq, conv_chunks(OP, db)?),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: conv1d_causal_f32(const float* x, const float* w, const float* bias (or
        // null), float* state, float* out, const uint32_t* seqs, uint32_t C, uint32_t K,
        // uint32_t silu, uint32_t n_slots), grid (channel blocks, sequences, token chunks
        // covering the longest sequence): x and out hold
        // n_tokens * C floats, w C * K, bias C, state n_slots * (K - 1) * C; the sequences tile
        // the tokens (prepare_batch) and slots are checked on host and device.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    /// [`kapitsa_backend::Backend::gdn_preamble`] in one launch (kernels/recurrent.cu
    /// `gdn_preamble_f32`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gdn_preamble_impl(
        &self,
        shape: GdnShape,
        w: &GdnConv<'_>,
        qkv: &Tensor,
        conv_state: &mut Tensor,
        batch: &Batch,
        beta: &mut Tensor,
        g: &mut Tensor,
        qkv_out: [&mut Tensor; 3],
    ) -> Result<()> {
        const OP: &str = "gdn_preamble";
        let db = self.dev_batch(batch, OP)?;
        let GdnShape {
            n_k_heads: nk,
            n_v_heads: nv,
            dk,
            dv,
            ..
        } = shape;
        let width = dk.max(dv);
        if nk == 0 || nv == 0 || dk == 0 || dv == 0 || width > 1024 {
            return shape_err(OP, format!("{shape:?} (head widths at most 1024)"));
        }
        if w.k == 0 || w.k > CONV_MAXK {
            return shape_err(OP, format!("kernel width {} (1..={CONV_MAXK})", w.k));
        }
        let n = db.n_tokens;
        let (kd, vd) = (nk * dk, nv * dv);
        let c = 2 * kd + vd;
        let xb = self.f32_len(qkv, n * c, OP, "qkv")?;
        let wb = self.f32_len(w.w, c * w.k, OP, "conv weights")?;
        let dtb = self.f32_len(w.dt_bias, nv, OP, "dt_bias")?;
        let anb = self.f32_len(w.a_neg, nv, OP, "a_neg")?;
        let slots = n_slots(OP, conv_state, (w.k - 1) * c, db)?;
        let sb = self.buf_mut::<f32>(conv_state, OP, "conv_state")?;
        let bb = self.f32_len_mut(beta, n * nv, OP, "beta")?;
        let gb = self.f32_len_mut(g, n * nv, OP, "g")?;
        let [q, k, v] = qkv_out;
        let qb = self.f32_len_mut(q, n * kd, OP, "q")?;
        let kb = self.f32_len_mut(k, n * kd, OP, "k")?;
        let vb = self.f32_len_mut(v, n * vd, OP, "v")?;
        if n == 0 || db.n_seqs == 0 {
            return Ok(());
        }
        let units = 2 * nk + nv + 1;
        let [nka, nva, dka, dva, _] = gdn_dims(OP, shape)?;
        let (kk, ns, nseq) = (
            u32_arg(OP, "k", w.k)?,
            u32_arg(OP, "slots", slots)?,
            grid_seqs(OP, db)?,
        );
        u32_arg(OP, "channels", c)?;
        let qscale = 1.0 / (dk as f32).sqrt();
        let seqs = db.seqs();
        let mut b = self.stream.kernel(&self.k.gdn_preamble_f32);
        b.arg(xb)
            .arg(wb)
            .arg(sb)
            .arg(qb)
            .arg(kb)
            .arg(vb)
            .arg(bb)
            .arg(gb);
        b.arg(dtb).arg(anb).arg(&seqs);
        b.arg(&nka).arg(&nva).arg(&dka).arg(&dva).arg(&kk);
        b.arg(&w.l2_eps).arg(&qscale).arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (u32_arg(OP, "units", units)?, nseq, conv_chunks(OP, db)?),
            block_dim: (32 * width.div_ceil(32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: gdn_preamble_f32(const float* qkv, const float* w, float* state, float* q,
        // float* k, float* v, float* beta, float* g, const float* dt_bias, const float* a_neg,
        // const uint32_t* seqs, uint32_t nk, nv, dk, dv, K, float l2_eps, float qscale,
        // uint32_t n_slots), grid (2 nk + nv + 1 units, sequences, token chunks covering the
        // longest sequence), 32 * ceil(max(dk, dv) / 32)
        // <= 1024 threads: qkv holds n_tokens * C floats (C = 2 nk dk + nv dv), w C * K, state
        // n_slots * (K - 1) * C, q and k n_tokens * nk * dk, v n_tokens * nv * dv, beta and g
        // n_tokens * nv, dt_bias and a_neg nv (all checked); K <= CONV_MAXK; the sequences
        // tile the tokens (prepare_batch) and slots are checked on host and device.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    /// [`kapitsa_backend::Backend::gdn_mixer`]: the preamble, the recurrence and the gated
    /// norm in one launch (kernels/recurrent.cu `gdn_fused_f32`, one block per value head
    /// and sequence) where the batch takes the token-sequential form and the heads fit
    /// [`GDN_FUSED_MAX_WARPS`] warps; otherwise the three ops.
    pub(crate) fn gdn_mixer_impl(
        &self,
        shape: GdnShape,
        w: &GdnConv<'_>,
        (norm, eps): (&Tensor, f32),
        io: GdnMixerIo<'_>,
        batch: &Batch,
    ) -> Result<()> {
        const OP: &str = "gdn_mixer";
        let db = self.dev_batch(batch, OP)?;
        let GdnShape {
            n_k_heads: nk,
            n_v_heads: nv,
            dk,
            dv,
            ..
        } = shape;
        let warps = dk.div_ceil(32) * dv.div_ceil(32);
        let smem = 4 * gdn_fused_smem(dk, dv, w.k);
        let fused = gdn_fused_on()
            && nk > 0
            && nv.is_multiple_of(nk)
            && dk > 0
            && dv > 0
            && warps <= GDN_FUSED_MAX_WARPS
            && (1..=CONV_MAXK).contains(&w.k)
            && smem <= 48 * 1024
            && db.n_seqs * nk <= GDN_COUNTERS
            && !(dk <= GDN_CD && dv <= GDN_CD && gdn_chunked(db));
        if !fused {
            return kapitsa_backend::gdn_mixer_composed(self, shape, w, (norm, eps), io, batch);
        }
        let n = db.n_tokens;
        let (kd, vd) = (nk * dk, nv * dv);
        let c = 2 * kd + vd;
        let xb = self.f32_len(io.qkv, n * c, OP, "qkv")?;
        let zb = self.f32_len(io.z, n * vd, OP, "z")?;
        let bb = self.f32_len(io.beta, n * nv, OP, "beta")?;
        let gb = self.f32_len(io.g, n * nv, OP, "g")?;
        let wb = self.f32_len(w.w, c * w.k, OP, "conv weights")?;
        let dtb = self.f32_len(w.dt_bias, nv, OP, "dt_bias")?;
        let anb = self.f32_len(w.a_neg, nv, OP, "a_neg")?;
        let nwb = self.f32_len(norm, dv, OP, "norm")?;
        let conv_slots = n_slots(OP, io.conv_state, (w.k - 1) * c, db)?;
        let state_slots = n_slots(OP, io.state, shape.state_len(), db)?;
        let csb = self.buf_mut::<f32>(io.conv_state, OP, "conv_state")?;
        let sb = self.buf_mut::<f32>(io.state, OP, "state")?;
        let ob = self.f32_len_mut(io.out, n * vd, OP, "out")?;
        if n == 0 || nv == 0 || db.n_seqs == 0 {
            return Ok(());
        }
        let [nka, nva, dka, dva, ord] = gdn_dims(OP, shape)?;
        let (kk, ns, nseq) = (
            u32_arg(OP, "k", w.k)?,
            u32_arg(OP, "slots", conv_slots.min(state_slots))?,
            grid_yz(OP, "sequences", db.n_seqs)?,
        );
        u32_arg(OP, "channels", c)?;
        let (qscale, l2_eps) = (1.0 / (dk as f32).sqrt(), w.l2_eps);
        let seqs = db.seqs();
        let mut b = self.stream.kernel(&self.k.gdn_fused_f32);
        b.arg(xb)
            .arg(zb)
            .arg(bb)
            .arg(gb)
            .arg(wb)
            .arg(dtb)
            .arg(anb)
            .arg(nwb);
        b.arg(csb).arg(sb).arg(ob).arg(&self.gdn_counts).arg(&seqs);
        b.arg(&nka).arg(&nva).arg(&dka).arg(&dva).arg(&kk).arg(&ord);
        b.arg(&l2_eps).arg(&qscale).arg(&eps).arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (nva, nseq, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: u32_arg(OP, "shared memory", smem)?,
        };
        // SAFETY: gdn_fused_f32(const float* qkv, z, b, a, conv weights, dt_bias, a_neg, norm,
        // float* conv_state, float* state, float* out, uint32_t* counts, const uint32_t* seqs,
        // uint32_t nk, nv, dk, dv, K, order, float l2_eps, qscale, eps, uint32_t n_slots),
        // grid (nv, sequences), 32 * ceil(dk / 32) * ceil(dv / 32) <= 512 threads,
        // gdn_fused_smem floats of dynamic shared memory (<= 48 KiB): qkv holds n_tokens * C
        // floats (C = 2 nk dk + nv dv), z and out n_tokens * nv * dv, b and a n_tokens * nv,
        // the conv weights C * K, dt_bias and a_neg nv, norm dv, the conv state and the state
        // at least n_slots slots (all checked); nk divides nv, K <= CONV_MAXK; counts holds
        // GDN_COUNTERS >= sequences * nk zeros (allocated zeroed; each launch's last reader
        // of a k head sets its counter back to zero); the sequences tile the tokens
        // (prepare_batch) and slots are checked on host and device.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gdn_impl(
        &self,
        shape: GdnShape,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        state: &mut Tensor,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "gdn";
        let db = self.dev_batch(batch, OP)?;
        let GdnShape {
            n_k_heads: nk,
            n_v_heads: nv,
            dk,
            dv,
            ..
        } = shape;
        if nk == 0 || !nv.is_multiple_of(nk) || dk == 0 || dk > GDN_MAX_DK || dv == 0 {
            return shape_err(OP, format!("{shape:?} (dk at most {GDN_MAX_DK})"));
        }
        let n = db.n_tokens;
        let qb = self.f32_len(q, n * nk * dk, OP, "q")?;
        let kb = self.f32_len(k, n * nk * dk, OP, "k")?;
        let vb = self.f32_len(v, n * nv * dv, OP, "v")?;
        let gb = self.f32_len(g, n * nv, OP, "g")?;
        let bb = self.f32_len(beta, n * nv, OP, "beta")?;
        let slots = n_slots(OP, state, shape.state_len(), db)?;
        let sb = self.buf_mut::<f32>(state, OP, "state")?;
        let ob = self.f32_len_mut(out, n * nv * dv, OP, "out")?;
        if n == 0 || nv == 0 || db.n_seqs == 0 {
            return Ok(());
        }
        let [nka, nva, dka, dva, ord] = gdn_dims(OP, shape)?;
        let (ns, nseq) = (u32_arg(OP, "slots", slots)?, grid_seqs(OP, db)?);
        if nva > 65535 {
            return shape_err(OP, format!("{nv} heads (at most 65535)"));
        }
        let seqs = db.seqs();
        if dk <= GDN_CD && dv <= GDN_CD && gdn_chunked(db) {
            let io = GdnIo {
                q: qb,
                k: kb,
                v: vb,
                g: gb,
                beta: bb,
                state: sb,
                out: ob,
            };
            let dims = [nka, nva, dka, dva, ord, ns];
            return self.gdn_chunked(io, db, dims, nseq);
        }
        let mut b = self.stream.kernel(&self.k.gdn_recurrent_f32);
        b.arg(qb)
            .arg(kb)
            .arg(vb)
            .arg(gb)
            .arg(bb)
            .arg(sb)
            .arg(ob)
            .arg(&seqs);
        b.arg(&nka).arg(&nva).arg(&dka).arg(&dva).arg(&ord).arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (dv.div_ceil(32) as u32, nva, nseq),
            block_dim: (32 * dk.div_ceil(32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: gdn_recurrent_f32(const float* q, k, v, g, beta, float* state, float* out,
        // const uint32_t* seqs, uint32_t n_k_heads, n_v_heads, dk, dv, order, n_slots), grid
        // (column tiles, value heads, sequences), 32 * ceil(dk / 32) <= 256 threads: every
        // buffer length was checked against the shape and the batch's token count; slots are
        // checked on host and device.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    /// The chunked Gated DeltaNet over the batch `db` (kernels/recurrent.cu `gdn_chunk_*_f32`):
    /// `dims` = the kernels' (n_k_heads, n_v_heads, dk, dv, order, n_slots) arguments, dk and
    /// dv at most [`GDN_CD`], buffers checked by the caller.
    fn gdn_chunked(&self, io: GdnIo<'_>, db: &DevBatch, dims: [u32; 6], nseq: u32) -> Result<()> {
        const OP: &str = "gdn";
        let [nka, nva, dka, dva, ord, ns] = dims;
        let (n, nv, dk, dv) = (db.n_tokens, nva as usize, dka as usize, dva as usize);
        let ids = n.div_ceil(GDN_CT) + db.n_seqs;
        let mut ge = self.scratch::<f32>(n * nv)?;
        let mut gl = self.scratch::<f32>(n * nv)?;
        let mut wb = self.scratch::<f32>(n * nv * dk)?;
        let mut ub = self.scratch::<f32>(n * nv * dv)?;
        let mut ab = self.scratch::<f32>(n * nv * GDN_CT)?;
        let mut hb = self.scratch::<f32>(ids * nv * dk * dv)?;
        let chunks = u32_arg(OP, "chunks", db.max_len.div_ceil(GDN_CT))?;
        let seqs = db.seqs();
        let (prep_smem, state_smem, out_smem) = gdn_chunk_smem();
        let mut b = self.stream.kernel(&self.k.gdn_chunk_prep_f32);
        b.arg(io.q)
            .arg(io.k)
            .arg(io.v)
            .arg(io.g)
            .arg(io.beta)
            .arg(&seqs);
        b.arg(&nka).arg(&nva).arg(&dka).arg(&dva).arg(&ord).arg(&ns);
        b.arg(&mut ge)
            .arg(&mut gl)
            .arg(&mut wb)
            .arg(&mut ub)
            .arg(&mut ab);
        let cfg = LaunchConfig {
            grid_dim: (chunks, nva, nseq),
            block_dim: (256, 1, 1),
            shared_mem_bytes: prep_smem as u32,
        };
        // SAFETY: gdn_chunk_prep_f32(const float* q, k, v, g, beta, const uint32_t* seqs,
        // uint32_t n_k_heads, n_v_heads, dk, dv, order, n_slots, float* ge, gl, wb, ub, ab), grid
        // (chunks of the longest sequence, value heads, sequences), 256 threads, its shared
        // memory (configured at load): q, k hold n_tokens * n_k * dk floats, v n_tokens * n_v
        // * dv, g and beta n_tokens * n_v (checked by the caller); ge, gl, wb, ub and ab were
        // allocated above for n_tokens tokens; dk, dv <= GDN_CD; slots checked on host and
        // device.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        let mut b = self.stream.kernel(&self.k.gdn_chunk_state_f32);
        b.arg(io.k).arg(&ge).arg(&gl).arg(&wb).arg(&mut ub);
        b.arg(io.state).arg(&mut hb);
        b.arg(&seqs);
        b.arg(&nka).arg(&nva).arg(&dka).arg(&dva).arg(&ord).arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (dv.div_ceil(32) as u32, nva, nseq),
            block_dim: (128, 1, 1),
            shared_mem_bytes: state_smem as u32,
        };
        // SAFETY: gdn_chunk_state_f32(const float* k, ge, gl, wb, float* ub, state, hb, const
        // uint32_t* seqs, uint32_t n_k_heads, n_v_heads, dk, dv, order, n_slots), grid (column
        // blocks of 32, value heads, sequences), 128 threads, its shared
        // memory: hb holds ceil(n_tokens / GDN_CT) + n_seqs chunk states (the largest id the
        // kernel forms is below that), the rest as above; state n_slots * n_v * dk * dv.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        let mut b = self.stream.kernel(&self.k.gdn_chunk_out_f32);
        b.arg(io.q)
            .arg(&ge)
            .arg(&ab)
            .arg(&ub)
            .arg(&hb)
            .arg(io.out)
            .arg(&seqs);
        b.arg(&nka).arg(&nva).arg(&dka).arg(&dva).arg(&ord).arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (chunks, nva, nseq),
            block_dim: (256, 1, 1),
            shared_mem_bytes: out_smem as u32,
        };
        // SAFETY: gdn_chunk_out_f32(const float* q, ge, ab, ub, hb, float* out, const
        // uint32_t* seqs, uint32_t n_k_heads, n_v_heads, dk, dv, order, n_slots), grid as the
        // prep kernel's, 256 threads, its shared memory: out holds n_tokens * n_v * dv floats,
        // the rest as above.
        unsafe { b.launch(cfg) }.map_err(dev_err)
    }

    /// [`kapitsa_backend::Backend::mamba2_preamble`] in one launch (kernels/recurrent.cu
    /// `mamba2_preamble_f32`).
    pub(crate) fn mamba2_preamble_impl(
        &self,
        shape: Mamba2Shape,
        w: &Mamba2Conv<'_>,
        proj: &Tensor,
        conv_state: &mut Tensor,
        batch: &Batch,
        outs: [&mut Tensor; 5],
    ) -> Result<()> {
        const OP: &str = "mamba2_preamble";
        let db = self.dev_batch(batch, OP)?;
        let (di, nh) = (shape.d_inner(), shape.n_heads);
        let gn = shape.n_groups * shape.d_state;
        let cd = di + 2 * gn;
        if w.k == 0 || w.k > CONV_MAXK {
            return shape_err(OP, format!("kernel width {} (1..={CONV_MAXK})", w.k));
        }
        let n = db.n_tokens;
        let pb = self.f32_len(proj, n * (di + cd + nh), OP, "proj")?;
        let wb = self.f32_len(w.w, cd * w.k, OP, "conv weights")?;
        let bb = match w.bias {
            Some(b) => Some(self.f32_len(b, cd, OP, "conv bias")?),
            None => None,
        };
        let dtb = self.f32_len(w.dt_bias, nh, OP, "dt_bias")?;
        let slots = n_slots(OP, conv_state, (w.k - 1) * cd, db)?;
        let sb = self.buf_mut::<f32>(conv_state, OP, "conv_state")?;
        let [z, x, b, c, dt] = outs;
        let zb = self.f32_len_mut(z, n * di, OP, "z")?;
        let xb = self.f32_len_mut(x, n * di, OP, "x")?;
        let bmb = self.f32_len_mut(b, n * gn, OP, "b")?;
        let cmb = self.f32_len_mut(c, n * gn, OP, "c")?;
        let dtob = self.f32_len_mut(dt, n * nh, OP, "dt")?;
        if n == 0 || db.n_seqs == 0 {
            return Ok(());
        }
        const THREADS: usize = 128;
        let blocks = cd.div_ceil(THREADS) + di.div_ceil(THREADS) + 1;
        let (dia, gna, nha, kk, ns, nseq) = (
            u32_arg(OP, "d_inner", di)?,
            u32_arg(OP, "groups * d_state", gn)?,
            u32_arg(OP, "heads", nh)?,
            u32_arg(OP, "k", w.k)?,
            u32_arg(OP, "slots", slots)?,
            grid_seqs(OP, db)?,
        );
        u32_arg(OP, "proj width", di + cd + nh)?;
        let seqs = db.seqs();
        let mut l = self.stream.kernel(&self.k.mamba2_preamble_f32);
        l.arg(pb).arg(wb);
        l.arg(bb);
        l.arg(dtb)
            .arg(sb)
            .arg(zb)
            .arg(xb)
            .arg(bmb)
            .arg(cmb)
            .arg(dtob)
            .arg(&seqs);
        l.arg(&dia).arg(&gna).arg(&nha).arg(&kk).arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (u32_arg(OP, "blocks", blocks)?, nseq, conv_chunks(OP, db)?),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: mamba2_preamble_f32(const float* proj, const float* w, const float* bias (or
        // null), const float* dt_bias, float* state, float* z, float* x, float* b, float* c,
        // float* dt, const uint32_t* seqs, uint32_t di, gn, nh, K, n_slots), grid
        // (ceil(cd / 128) + ceil(di / 128) + 1 blocks, sequences, token chunks covering the
        // longest sequence) of 128 threads: proj holds
        // n_tokens * (di + cd + nh) floats, w cd * K, bias cd, dt_bias nh, state
        // n_slots * (K - 1) * cd, z and x n_tokens * di, b and c n_tokens * gn, dt
        // n_tokens * nh (all checked); K <= CONV_MAXK; the sequences tile the tokens and slots
        // are checked on host and device.
        unsafe { l.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mamba2_impl(
        &self,
        shape: Mamba2Shape,
        x: &Tensor,
        dt: &Tensor,
        a: &Tensor,
        b_in: &Tensor,
        c_in: &Tensor,
        d: &Tensor,
        state: &mut Tensor,
        batch: &Batch,
        y: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "mamba2";
        let db = self.dev_batch(batch, OP)?;
        let Mamba2Shape {
            n_heads: h,
            head_dim: p,
            d_state: ns_,
            n_groups: g,
        } = shape;
        if g == 0 || !h.is_multiple_of(g) || p == 0 || ns_ == 0 || ns_ > M2_MAX_N {
            return shape_err(OP, format!("{shape:?} (d_state at most {M2_MAX_N})"));
        }
        let n = db.n_tokens;
        let xb = self.f32_len(x, n * h * p, OP, "x")?;
        let dtb = self.f32_len(dt, n * h, OP, "dt")?;
        let ab = self.f32_len(a, h, OP, "a")?;
        let bb = self.f32_len(b_in, n * g * ns_, OP, "b")?;
        let cb = self.f32_len(c_in, n * g * ns_, OP, "c")?;
        let db_ = self.f32_len(d, h, OP, "d")?;
        let slots = n_slots(OP, state, shape.state_len(), db)?;
        let sb = self.buf_mut::<f32>(state, OP, "state")?;
        let yb = self.f32_len_mut(y, n * h * p, OP, "y")?;
        if n == 0 || h == 0 || db.n_seqs == 0 {
            return Ok(());
        }
        let (ha, pa, na, ga, sl, nseq) = (
            u32_arg(OP, "heads", h)?,
            u32_arg(OP, "head_dim", p)?,
            u32_arg(OP, "d_state", ns_)?,
            u32_arg(OP, "groups", g)?,
            u32_arg(OP, "slots", slots)?,
            grid_seqs(OP, db)?,
        );
        if ha > 65535 {
            return shape_err(OP, format!("{h} heads (at most 65535)"));
        }
        let seqs = db.seqs();
        if ns_ <= GDN_CD && mamba2_chunked(db) {
            let io = Mamba2Io {
                x: xb,
                dt: dtb,
                a: ab,
                b: bb,
                c: cb,
                d: db_,
                state: sb,
                y: yb,
            };
            return self.mamba2_chunked(io, db, [ha, pa, na, ga, sl], nseq);
        }
        let mut b = self.stream.kernel(&self.k.mamba2_recurrent_f32);
        b.arg(xb)
            .arg(dtb)
            .arg(ab)
            .arg(bb)
            .arg(cb)
            .arg(db_)
            .arg(sb)
            .arg(yb)
            .arg(&seqs);
        b.arg(&ha).arg(&pa).arg(&na).arg(&ga).arg(&sl);
        let cfg = LaunchConfig {
            grid_dim: (p.div_ceil(M2_WARPS) as u32, ha, nseq),
            block_dim: (32 * M2_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: mamba2_recurrent_f32(const float* x, dt, a, b, c, d, float* state,
        // float* y, const uint32_t* seqs, uint32_t n_heads, head_dim, d_state, n_groups,
        // n_slots), grid (head-dim blocks of 4, heads, sequences), 128 threads: every buffer
        // length was checked against the shape and token count, d_state <= 256 fits the
        // kernel's shared arrays; slots are checked on host and device.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    /// The chunked Mamba2 scan over the batch `db` (kernels/recurrent.cu
    /// `mamba2_chunk_*_f32`): `dims` = the kernels' (n_heads, head_dim, d_state, n_groups,
    /// n_slots) arguments, d_state at most [`GDN_CD`], buffers checked by the caller.
    fn mamba2_chunked(
        &self,
        io: Mamba2Io<'_>,
        db: &DevBatch,
        dims: [u32; 5],
        nseq: u32,
    ) -> Result<()> {
        const OP: &str = "mamba2";
        let [ha, pa, na, ga, sl] = dims;
        let (n, h, p, ns_) = (db.n_tokens, ha as usize, pa as usize, na as usize);
        let ids = n.div_ceil(GDN_CT) + db.n_seqs;
        let mut ge = self.scratch::<f32>(n * h)?;
        let mut gl = self.scratch::<f32>(n * h)?;
        let mut mb = self.scratch::<f32>(n * h * GDN_CT)?;
        let mut hb = self.scratch::<f32>(ids * h * p * ns_)?;
        let chunks = u32_arg(OP, "chunks", db.max_len.div_ceil(GDN_CT))?;
        let seqs = db.seqs();
        let (prep_smem, state_smem, out_smem) = mamba2_chunk_smem();
        let mut b = self.stream.kernel(&self.k.mamba2_chunk_prep_f32);
        b.arg(io.dt).arg(io.a).arg(io.b).arg(io.c).arg(&seqs);
        b.arg(&ha).arg(&na).arg(&ga).arg(&sl);
        b.arg(&mut ge).arg(&mut gl).arg(&mut mb);
        let cfg = LaunchConfig {
            grid_dim: (chunks, ha, nseq),
            block_dim: (256, 1, 1),
            shared_mem_bytes: prep_smem as u32,
        };
        // SAFETY: mamba2_chunk_prep_f32(const float* dt, a, b, c, const uint32_t* seqs,
        // uint32_t n_heads, d_state, n_groups, n_slots, float* ge, gl, mb), grid (chunks of
        // the longest sequence, heads, sequences), 256 threads, its shared memory (configured
        // at load): dt holds n_tokens * H floats, a H, b and c n_tokens * G * N (checked by the
        // caller); ge, gl and mb were allocated above for n_tokens tokens; N <= GDN_CD; slots
        // checked on host and device.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        let mut b = self.stream.kernel(&self.k.mamba2_chunk_state_f32);
        b.arg(io.x)
            .arg(io.dt)
            .arg(io.b)
            .arg(&ge)
            .arg(&gl)
            .arg(io.state);
        b.arg(&mut hb).arg(&seqs);
        b.arg(&ha).arg(&pa).arg(&na).arg(&ga).arg(&sl);
        let cfg = LaunchConfig {
            grid_dim: (p.div_ceil(32) as u32, ha, nseq),
            block_dim: (128, 1, 1),
            shared_mem_bytes: state_smem as u32,
        };
        // SAFETY: mamba2_chunk_state_f32(const float* x, dt, b, ge, gl, float* state, hb,
        // const uint32_t* seqs, uint32_t n_heads, head_dim, d_state, n_groups, n_slots), grid
        // (head-dim blocks of 32, heads, sequences), 128 threads, its shared memory: x holds
        // n_tokens * H * P floats, state n_slots * H * P * N (checked by the caller), hb
        // ceil(n_tokens / GDN_CT) + n_seqs chunk states (the largest id the kernel forms is
        // below that), the rest as above.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        let mut b = self.stream.kernel(&self.k.mamba2_chunk_out_f32);
        b.arg(io.x)
            .arg(io.dt)
            .arg(io.c)
            .arg(io.d)
            .arg(&ge)
            .arg(&mb)
            .arg(&hb);
        b.arg(io.y).arg(&seqs);
        b.arg(&ha).arg(&pa).arg(&na).arg(&ga).arg(&sl);
        let cfg = LaunchConfig {
            grid_dim: (chunks, ha, nseq),
            block_dim: (256, 1, 1),
            shared_mem_bytes: out_smem as u32,
        };
        // SAFETY: mamba2_chunk_out_f32(const float* x, dt, c, d, ge, mb, hb, float* y, const
        // uint32_t* seqs, uint32_t n_heads, head_dim, d_state, n_groups, n_slots), grid as the
        // prep kernel's, 256 threads, its shared memory: d holds H floats, y n_tokens * H * P,
        // the rest as above.
        unsafe { b.launch(cfg) }.map_err(dev_err)
    }
}
