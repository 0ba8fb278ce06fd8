//! Gated DeltaNet mixer (Qwen3.5/3.6 linear-attention layers).
//!
//! Per token: `qkv = x W_qkv^T` (`[q (n_k*dk) | k (n_k*dk) | v (n_v*dv)]`), a depthwise causal
//! conv1d (kernel `conv_k`, no bias) over those channels with SiLU, L2-normalised q (scaled by
//! `1/sqrt(dk)`) and k, `beta = sigmoid(x W_b^T)`, log decay
//! `g = -exp(A_log) * softplus(x W_a^T + dt_bias)`, the delta-rule recurrence per value head
//! ([`Backend::gdn`]), an RMSNorm per value head gated by `silu(z)` with
//! `z = x W_z^T`, and the output projection.
//!
//! The value-head → key-head pairing differs by file format (HF/MLX grouped, GGUF tiled); it is
//! a parameter of the op ([`HeadOrder`]), so no weights are permuted.
//!
//! References: transformers `Qwen3_5MoeGatedDeltaNet`; llama.cpp `build_layer_attn_linear`.

use kapitsa_backend::{Backend, Epilogue, GdnConv, GdnMixerIo, GdnShape, HeadOrder, Tensor};

use crate::layers::{check_matrix, check_vec, tensor, ForwardCtx};
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

    /// Upload the weights to `be`.
    pub fn upload(&self, be: &dyn Backend) -> Result<DeviceGdn> {
        Ok(DeviceGdn {
            w_qkv: self.w_qkv.upload(be)?,
            w_z: self.w_z.upload(be)?,
            w_b: self.w_b.upload(be)?,
            w_a: self.w_a.upload(be)?,
            conv_w: be.upload_f32(&self.conv_w)?,
            conv_k: self.conv_k,
            dt_bias: be.upload_f32(&self.dt_bias)?,
            a_neg: be.upload_f32(&self.a_neg)?,
            norm: be.upload_f32(&self.norm)?,
            w_out: self.w_out.upload(be)?,
            shape: self.shape,
            eps: self.eps,
            l2_eps: self.l2_eps,
        })
    }
}

/// A [`GatedDeltaNet`] mixer uploaded to a backend (same fields, weights on its device).
#[derive(Debug)]
pub struct DeviceGdn {
    w_qkv: kapitsa_backend::Weight,
    w_z: kapitsa_backend::Weight,
    w_b: kapitsa_backend::Weight,
    w_a: kapitsa_backend::Weight,
    conv_w: Tensor,
    conv_k: usize,
    dt_bias: Tensor,
    a_neg: Tensor,
    norm: Tensor,
    w_out: kapitsa_backend::Weight,
    shape: GdnShape,
    eps: f32,
    l2_eps: f32,
}

impl DeviceGdn {
    /// `x[n, d] += gdn(h[n, d])` (the residual stream), updating the recurrent states of cache layer `layer`.
    pub fn forward(
        &self,
        cx: &mut ForwardCtx<'_>,
        layer: usize,
        h: &Tensor,
        x: &mut Tensor,
    ) -> Result<()> {
        let be = cx.be;
        let n = cx.batch.n_tokens();
        let s = &self.shape;
        let (kd, vd, nv) = (s.n_k_heads * s.dk, s.n_v_heads * s.dv, s.n_v_heads);
        let cd = 2 * kd + vd;
        let mut qkv = tensor(be, n * cd)?;
        let mut z = tensor(be, n * vd)?;
        let mut beta = tensor(be, n * nv)?;
        let mut g = tensor(be, n * nv)?;
        be.matmul_many(
            &[&self.w_qkv, &self.w_z, &self.w_b, &self.w_a],
            h,
            n,
            &mut [&mut qkv, &mut z, &mut beta, &mut g],
        )?;
        // conv + SiLU, split, q/k L2 norms, the gates beta = sigmoid(b),
        // g = -exp(A_log) * softplus(a + dt_bias), the recurrence and the gated norm, in one op
        let (conv_state, state) = cx.cache.recurrent_tensors_mut(layer)?;
        let conv = GdnConv {
            k: self.conv_k,
            w: &self.conv_w,
            dt_bias: &self.dt_bias,
            a_neg: &self.a_neg,
            l2_eps: self.l2_eps,
        };
        let mut o = tensor(be, n * vd)?;
        let io = GdnMixerIo {
            qkv: &qkv,
            z: &z,
            beta: &mut beta,
            g: &mut g,
            conv_state,
            state,
            out: &mut o,
        };
        be.gdn_mixer(*s, &conv, (&self.norm, self.eps), io, cx.dev_batch)?;
        // the residual connection in the output projection's epilogue
        let ep = Epilogue {
            bias: None,
            accumulate: true,
        };
        be.matmul_with(&self.w_out, &o, n, x, ep)?;
        Ok(())
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
