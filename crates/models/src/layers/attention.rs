//! Softmax attention blocks: GQA with optional q/k/v biases (Qwen2), optional per-head RMSNorm
//! on q and k (Qwen3, Qwen3.5), NeoX RoPE over all or the first `n_rot` dims of each head (or
//! none: Nemotron-H), and an optional sigmoid output gate whose values are interleaved with the
//! query heads in the q projection (Qwen3.5/3.6 gated attention).
//!
//! Layouts: activations are row-major `[n_tokens, width]` f32 over the whole batch; the q
//! projection output is `[n_tokens, n_head * head_dim]`, or with a gate
//! `[n_tokens, n_head, 2 * head_dim]` holding `[q_h | gate_h]` per head.

use kapitsa_kernels_cpu::attention::AttnShape;
use kapitsa_kernels_cpu::ops::Rope;

use crate::layers::{check_matrix, check_vec, sigmoid, Step};
use crate::{ModelError, Result, Weight};

/// Weights and shape of one attention block.
#[derive(Debug)]
pub struct Attention {
    /// `[n_head * head_dim (* 2 when gated), n_embd]`.
    pub wq: Weight,
    /// `[n_head_kv * head_dim, n_embd]`.
    pub wk: Weight,
    /// `[n_head_kv * head_dim, n_embd]`.
    pub wv: Weight,
    /// `[n_embd, n_head * head_dim]`.
    pub wo: Weight,
    /// Optional biases of q, k, v (Qwen2).
    pub bq: Option<Vec<f32>>,
    /// See `bq`.
    pub bk: Option<Vec<f32>>,
    /// See `bq`.
    pub bv: Option<Vec<f32>>,
    /// Optional per-head RMSNorm weights `[head_dim]` on q and k, applied before RoPE.
    pub q_norm: Option<Vec<f32>>,
    /// See `q_norm`.
    pub k_norm: Option<Vec<f32>>,
    /// Query heads.
    pub n_head: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// RoPE over the first `rope.n_rot` dims of each head; `None` for no positional encoding.
    pub rope: Option<Rope>,
    /// The q projection carries a sigmoid output gate per head (see the module docs).
    pub gated: bool,
    /// RMSNorm epsilon of the q/k norms.
    pub eps: f32,
}

impl Attention {
    fn q_width(&self) -> usize {
        self.n_head * self.head_dim * if self.gated { 2 } else { 1 }
    }

    /// Check every shape against the model width `d`.
    pub fn validate(&self, d: usize, layer: usize) -> Result<()> {
        let hd = self.head_dim;
        if self.n_head == 0 || self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err(ModelError::Config(format!(
                "layer {layer}: {} query heads is not a multiple of {} KV heads",
                self.n_head, self.n_head_kv
            )));
        }
        if let Some(r) = &self.rope {
            if r.n_rot > hd || !r.n_rot.is_multiple_of(2) {
                return Err(ModelError::Config(format!(
                    "layer {layer}: {} rotary dims do not fit head_dim {hd}",
                    r.n_rot
                )));
            }
        }
        let (q_dim, kv_dim) = (self.n_head * hd, self.n_head_kv * hd);
        check_matrix(&self.wq, [self.q_width(), d])?;
        check_matrix(&self.wk, [kv_dim, d])?;
        check_matrix(&self.wv, [kv_dim, d])?;
        check_matrix(&self.wo, [d, q_dim])?;
        for (n, b, len) in [
            ("bq", &self.bq, q_dim),
            ("bk", &self.bk, kv_dim),
            ("bv", &self.bv, kv_dim),
            ("q_norm", &self.q_norm, hd),
            ("k_norm", &self.k_norm, hd),
        ] {
            if let Some(b) = b {
                check_vec(&format!("layer {layer} {n}"), b, len)?;
            }
        }
        Ok(())
    }

    /// The kernel shape.
    pub fn shape(&self) -> AttnShape {
        AttnShape {
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    /// `out[n, d] = attention(h[n, d])` for cache layer `layer`.
    pub fn forward(
        &self,
        st: &mut Step<'_>,
        layer: usize,
        h: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let be = st.be;
        let batch = st.batch;
        let n = batch.n_tokens();
        let hd = self.head_dim;
        let (q_dim, kv_dim) = (self.n_head * hd, self.n_head_kv * hd);
        let mut q = vec![0f32; n * q_dim];
        let mut gate = Vec::new();
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let ws = [self.wq.matrix()?, self.wk.matrix()?, self.wv.matrix()?];
        if self.gated {
            let mut qg = vec![0f32; n * 2 * q_dim];
            be.matmul_many(&ws, h, n, &mut [&mut qg, &mut k, &mut v], false)?;
            gate = vec![0f32; n * q_dim];
            for ((src, qd), gd) in qg
                .chunks_exact(2 * hd)
                .zip(q.chunks_exact_mut(hd))
                .zip(gate.chunks_exact_mut(hd))
            {
                qd.copy_from_slice(&src[..hd]);
                gd.copy_from_slice(&src[hd..]);
            }
        } else {
            be.matmul_many(&ws, h, n, &mut [&mut q, &mut k, &mut v], false)?;
        }
        add_bias(&mut q, self.bq.as_deref());
        add_bias(&mut k, self.bk.as_deref());
        add_bias(&mut v, self.bv.as_deref());
        if let Some(w) = &self.q_norm {
            be.rms_norm(&mut q, hd, w, self.eps, 0.0);
        }
        if let Some(w) = &self.k_norm {
            be.rms_norm(&mut k, hd, w, self.eps, 0.0);
        }
        if let Some(rope) = &self.rope {
            let np = rope.n_pairs();
            let mut cs = vec![(0f32, 0f32); np];
            for (t, &p) in batch.positions.iter().enumerate() {
                rope.table(p, &mut cs);
                rope.apply_neox(&mut q[t * q_dim..(t + 1) * q_dim], hd, &cs);
                rope.apply_neox(&mut k[t * kv_dim..(t + 1) * kv_dim], hd, &cs);
            }
        }
        for c in &batch.seqs {
            let r = c.start..c.start + c.len;
            let pos0 = batch.positions[c.start] as usize;
            st.cache.write(
                layer,
                c.slot,
                pos0,
                &k[r.start * kv_dim..r.end * kv_dim],
                &v[r.start * kv_dim..r.end * kv_dim],
            )?;
        }
        let mut att = vec![0f32; n * q_dim];
        for c in &batch.seqs {
            let r = c.start..c.start + c.len;
            let n_ctx = batch.positions[r.end - 1] as usize + 1;
            let (ks, vs) = st.cache.layer(layer, c.slot, n_ctx)?;
            be.attention(
                self.shape(),
                &q[r.start * q_dim..r.end * q_dim],
                &batch.positions[r.clone()],
                ks,
                vs,
                &mut att[r.start * q_dim..r.end * q_dim],
            );
        }
        if self.gated {
            for (a, g) in att.iter_mut().zip(&gate) {
                *a *= sigmoid(*g);
            }
        }
        be.matmul(&self.wo.matrix()?, &att, n, out)?;
        Ok(())
    }
}

/// Add a bias row to every row of `x`.
pub fn add_bias(x: &mut [f32], b: Option<&[f32]>) {
    if let Some(b) = b {
        for row in x.chunks_exact_mut(b.len()) {
            kapitsa_kernels_cpu::ops::add_inplace(row, b);
        }
    }
}
