//! Gated DeltaNet mixer (Qwen3.5/3.6 linear-attention layers).
//!
//! Per token: `qkv = x W_qkv^T` (`[q (n_k*dk) | k (n_k*dk) | v (n_v*dv)]`), a depthwise causal
//! conv1d (kernel `conv_k`, no bias) over those channels with SiLU, L2-normalised q (scaled by
//! `1/sqrt(dk)`) and k, `beta = sigmoid(x W_b^T)`, log decay
//! `g = -exp(A_log) * softplus(x W_a^T + dt_bias)`, the delta-rule recurrence per value head
//! (kernel [`kapitsa_kernels_cpu::gdn`]), an RMSNorm per value head gated by `silu(z)` with
//! `z = x W_z^T`, and the output projection.
//!
//! The value-head → key-head pairing differs by file format (HF/MLX grouped, GGUF tiled); it is
//! a parameter of the kernel ([`HeadOrder`]), so no weights are permuted.
//!
//! References: transformers `Qwen3_5MoeGatedDeltaNet`; llama.cpp `build_layer_attn_linear`.

use kapitsa_kernels_cpu::gdn::{gated_rms_norm, l2_norm_rows, GdnShape, HeadOrder};

use crate::layers::{check_matrix, check_vec, sigmoid, Step};
use crate::{ModelError, RecurrentShape, Result, Weight};

/// Weights and shape of one Gated DeltaNet mixer.
#[derive(Debug)]
pub struct GatedDeltaNet {
    /// `[2 * n_k * dk + n_v * dv, n_embd]`.
    pub w_qkv: Weight,
    /// `[n_v * dv, n_embd]`.
    pub w_z: Weight,
    /// `[n_v, n_embd]` (beta logits).
    pub w_b: Weight,
    /// `[n_v, n_embd]` (decay logits).
    pub w_a: Weight,
    /// Conv weights `[conv_dim, conv_k]` (the last column multiplies the current token).
    pub conv_w: Vec<f32>,
    /// Conv kernel width.
    pub conv_k: usize,
    /// `[n_v]`.
    pub dt_bias: Vec<f32>,
    /// `-exp(A_log)`, `[n_v]`.
    pub a_neg: Vec<f32>,
    /// Gated norm weight `[dv]` (plain `w`, shared by all heads).
    pub norm: Vec<f32>,
    /// `[n_embd, n_v * dv]`.
    pub w_out: Weight,
    /// Head counts, dims and the value→key head order.
    pub shape: GdnShape,
    /// Epsilon of the gated norm.
    pub eps: f32,
    /// Epsilon of the q/k L2 norms.
    pub l2_eps: f32,
}

impl GatedDeltaNet {
    fn key_dim(&self) -> usize {
        self.shape.n_k_heads * self.shape.dk
    }

    fn value_dim(&self) -> usize {
        self.shape.n_v_heads * self.shape.dv
    }

    fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Cache state this mixer needs per sequence.
    pub fn recurrent_shape(&self) -> RecurrentShape {
        let s = &self.shape;
        RecurrentShape {
            conv_channels: self.conv_dim(),
            conv_kernel: self.conv_k,
            state_len: s.n_v_heads * s.dk * s.dv,
        }
    }

    /// Check shapes against the model width `d`.
    pub fn validate(&self, d: usize, layer: usize) -> Result<()> {
        let s = &self.shape;
        if s.n_k_heads == 0
            || s.n_v_heads == 0
            || !s.n_v_heads.is_multiple_of(s.n_k_heads)
            || s.dk == 0
            || s.dv == 0
            || self.conv_k == 0
        {
            return Err(ModelError::Config(format!(
                "layer {layer}: bad Gated DeltaNet shape ({} key heads, {} value heads, \
                 dk {}, dv {}, conv {})",
                s.n_k_heads, s.n_v_heads, s.dk, s.dv, self.conv_k
            )));
        }
        let (nv, vd) = (s.n_v_heads, self.value_dim());
        check_matrix(&self.w_qkv, [self.conv_dim(), d])?;
        check_matrix(&self.w_z, [vd, d])?;
        check_matrix(&self.w_b, [nv, d])?;
        check_matrix(&self.w_a, [nv, d])?;
        check_matrix(&self.w_out, [d, vd])?;
        check_vec(
            &format!("layer {layer} conv1d"),
            &self.conv_w,
            self.conv_dim() * self.conv_k,
        )?;
        check_vec(&format!("layer {layer} dt_bias"), &self.dt_bias, nv)?;
        check_vec(&format!("layer {layer} A"), &self.a_neg, nv)?;
        check_vec(&format!("layer {layer} ssm_norm"), &self.norm, s.dv)?;
        Ok(())
    }

    /// `out[n, d] = gdn(h[n, d])`, updating the recurrent states of cache layer `layer`.
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
        let s = &self.shape;
        let (kd, vd, cd, nv) = (
            self.key_dim(),
            self.value_dim(),
            self.conv_dim(),
            s.n_v_heads,
        );

        let mut qkv = vec![0f32; n * cd];
        let mut z = vec![0f32; n * vd];
        let mut b = vec![0f32; n * nv];
        let mut a = vec![0f32; n * nv];
        be.matmul_many(
            &[
                self.w_qkv.matrix()?,
                self.w_z.matrix()?,
                self.w_b.matrix()?,
                self.w_a.matrix()?,
            ],
            h,
            n,
            &mut [&mut qkv, &mut z, &mut b, &mut a],
            false,
        )?;

        // beta and log decay for every token.
        for v in b.iter_mut() {
            *v = sigmoid(*v);
        }
        for row in a.chunks_exact_mut(nv) {
            for ((g, &bias), &an) in row.iter_mut().zip(&self.dt_bias).zip(&self.a_neg) {
                *g = an * softplus(*g + bias);
            }
        }

        let mut o = vec![0f32; n * vd];
        let mut conv = Vec::new();
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for c in &batch.seqs {
            let t = c.len;
            let r = c.start..c.start + t;
            let (conv_state, state) = st.cache.recurrent_mut(layer, c.slot)?;
            conv.resize(t * cd, 0.0);
            be.conv1d_causal(
                &qkv[r.start * cd..r.end * cd],
                t,
                cd,
                self.conv_k,
                &self.conv_w,
                None,
                conv_state,
                true,
                &mut conv,
            );
            q.clear();
            k.clear();
            v.clear();
            for row in conv.chunks_exact(cd) {
                q.extend_from_slice(&row[..kd]);
                k.extend_from_slice(&row[kd..2 * kd]);
                v.extend_from_slice(&row[2 * kd..]);
            }
            l2_norm_rows(&mut q, s.dk, self.l2_eps, 1.0 / (s.dk as f32).sqrt());
            l2_norm_rows(&mut k, s.dk, self.l2_eps, 1.0);
            be.gdn(
                s,
                &q,
                &k,
                &v,
                &a[r.start * nv..r.end * nv],
                &b[r.start * nv..r.end * nv],
                state,
                &mut o[r.start * vd..r.end * vd],
                None,
            );
        }
        gated_rms_norm(&mut o, &z, s.dv, &self.norm, self.eps);
        be.matmul(&self.w_out.matrix()?, &o, n, out)?;
        Ok(())
    }
}

/// `ln(1 + e^x)`, linear above 20 (as torch's `softplus`).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The head order a file format stores Gated DeltaNet value heads in.
pub fn head_order(gguf: bool) -> HeadOrder {
    if gguf {
        HeadOrder::Tiled
    } else {
        HeadOrder::Grouped
    }
}
