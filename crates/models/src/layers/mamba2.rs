//! Mamba2 mixer (NVIDIA Nemotron-H).
//!
//! Per token: `[z (d_inner) | xBC (d_inner + 2 G N) | dt (H)] = x W_in^T`; a depthwise causal
//! conv1d with bias and SiLU over xBC; split into x, B, C; `dt = softplus(dt + dt_bias)` (no
//! clamp, as llama.cpp; transformers clamps at `time_step_min` in its chunked form only, which
//! real inputs do not reach); the SSD scan per head with `A = -exp(A_log)` and the `D` skip
//! ([`Backend::mamba2`]); an RMSNorm per group of `d_inner / G` channels
//! applied to `y * silu(z)` (gate before norm); the output projection.
//!
//! References: transformers `NemotronHMamba2Mixer`, `NemotronHRMSNormGated`; llama.cpp
//! `build_mamba2_layer`.

use kapitsa_backend::{Backend, Epilogue, Mamba2Conv, Mamba2Shape, Tensor};

use crate::layers::{check_matrix, check_vec, tensor, upload_opt, ForwardCtx};
use crate::{ModelError, RecurrentShape, Result, Weight};

/// Weights and shape of one Mamba2 mixer.
#[derive(Debug)]
pub struct Mamba2 {
    /// `[2 d_inner + 2 G N + H, n_embd]`.
    pub w_in: Weight,
    /// Conv weights `[conv_dim, conv_k]`, `conv_dim = d_inner + 2 G N`.
    pub conv_w: Vec<f32>,
    /// Conv bias `[conv_dim]`.
    pub conv_b: Option<Vec<f32>>,
    /// Conv kernel width.
    pub conv_k: usize,
    /// `[H]`.
    pub dt_bias: Vec<f32>,
    /// `-exp(A_log)`, `[H]`.
    pub a_neg: Vec<f32>,
    /// Skip `[H]`.
    pub d: Vec<f32>,
    /// Gated norm weight `[d_inner]`.
    pub norm: Vec<f32>,
    /// `[n_embd, d_inner]`.
    pub w_out: Weight,
    /// Heads, head dim, state size, groups.
    pub shape: Mamba2Shape,
    /// Epsilon of the gated norm.
    pub eps: f32,
}

impl Mamba2 {
    fn d_inner(&self) -> usize {
        self.shape.n_heads * self.shape.head_dim
    }

    fn conv_dim(&self) -> usize {
        self.d_inner() + 2 * self.shape.n_groups * self.shape.d_state
    }

    /// Cache state this mixer needs per sequence.
    pub fn recurrent_shape(&self) -> RecurrentShape {
        RecurrentShape {
            conv_channels: self.conv_dim(),
            conv_kernel: self.conv_k,
            state_len: self.d_inner() * self.shape.d_state,
        }
    }

    /// Check shapes against the model width `d`.
    pub fn validate(&self, d: usize, layer: usize) -> Result<()> {
        let s = &self.shape;
        if s.n_heads == 0
            || s.head_dim == 0
            || s.d_state == 0
            || s.n_groups == 0
            || !s.n_heads.is_multiple_of(s.n_groups)
            || self.conv_k == 0
        {
            return Err(ModelError::Config(format!(
                "layer {layer}: bad Mamba2 shape ({} heads x {}, state {}, {} groups, conv {})",
                s.n_heads, s.head_dim, s.d_state, s.n_groups, self.conv_k
            )));
        }
        let (di, cd, h) = (self.d_inner(), self.conv_dim(), s.n_heads);
        check_matrix(&self.w_in, [di + cd + h, d])?;
        check_matrix(&self.w_out, [d, di])?;
        check_vec(
            &format!("layer {layer} conv1d"),
            &self.conv_w,
            cd * self.conv_k,
        )?;
        if let Some(b) = &self.conv_b {
            check_vec(&format!("layer {layer} conv1d bias"), b, cd)?;
        }
        check_vec(&format!("layer {layer} dt_bias"), &self.dt_bias, h)?;
        check_vec(&format!("layer {layer} A"), &self.a_neg, h)?;
        check_vec(&format!("layer {layer} D"), &self.d, h)?;
        check_vec(&format!("layer {layer} ssm_norm"), &self.norm, di)?;
        Ok(())
    }

    /// Upload the weights to `be`.
    pub fn upload(&self, be: &dyn Backend) -> Result<DeviceMamba2> {
        Ok(DeviceMamba2 {
            w_in: self.w_in.upload(be)?,
            conv_w: be.upload_f32(&self.conv_w)?,
            conv_b: upload_opt(be, &self.conv_b)?,
            conv_k: self.conv_k,
            dt_bias: be.upload_f32(&self.dt_bias)?,
            a_neg: be.upload_f32(&self.a_neg)?,
            d: be.upload_f32(&self.d)?,
            norm: be.upload_f32(&self.norm)?,
            w_out: self.w_out.upload(be)?,
            shape: self.shape,
            eps: self.eps,
        })
    }
}

/// A [`Mamba2`] mixer uploaded to a backend (same fields, weights on its device).
#[derive(Debug)]
pub struct DeviceMamba2 {
    w_in: kapitsa_backend::Weight,
    conv_w: Tensor,
    conv_b: Option<Tensor>,
    conv_k: usize,
    dt_bias: Tensor,
    a_neg: Tensor,
    d: Tensor,
    norm: Tensor,
    w_out: kapitsa_backend::Weight,
    shape: Mamba2Shape,
    eps: f32,
}

impl DeviceMamba2 {
    /// `residual[n, d] += mamba2(h[n, d])`, updating the recurrent states of cache layer
    /// `layer`.
    pub fn forward(
        &self,
        cx: &mut ForwardCtx<'_>,
        layer: usize,
        h: &Tensor,
        residual: &mut Tensor,
    ) -> Result<()> {
        let be = cx.be;
        let n = cx.batch.n_tokens();
        let s = &self.shape;
        let (di, nh) = (s.d_inner(), s.n_heads);
        let gn = s.n_groups * s.d_state;
        let cd = di + 2 * gn;
        let mut proj = tensor(be, n * (di + cd + nh))?;
        be.matmul(&self.w_in, h, n, &mut proj)?;
        let mut z = tensor(be, n * di)?;
        let mut dt = tensor(be, n * nh)?;
        let mut x = tensor(be, n * di)?;
        let mut bm = tensor(be, n * gn)?;
        let mut cm = tensor(be, n * gn)?;
        let (conv_state, state) = cx.cache.recurrent_tensors_mut(layer)?;
        // split, softplus(dt + bias), conv + SiLU of xBC and its split, in one op
        let conv = Mamba2Conv {
            k: self.conv_k,
            w: &self.conv_w,
            bias: self.conv_b.as_ref(),
            dt_bias: &self.dt_bias,
        };
        be.mamba2_preamble(
            *s,
            &conv,
            &proj,
            conv_state,
            cx.dev_batch,
            [&mut z, &mut x, &mut bm, &mut cm, &mut dt],
        )?;
        let mut y = tensor(be, n * di)?;
        be.mamba2(
            *s,
            &x,
            &dt,
            &self.a_neg,
            &bm,
            &cm,
            &self.d,
            state,
            cx.dev_batch,
            &mut y,
        )?;
        be.gated_group_rms_norm(&mut y, &z, di, s.n_groups, &self.norm, self.eps)?;
        // the residual connection in the output projection's epilogue
        let ep = Epilogue {
            bias: None,
            accumulate: true,
        };
        be.matmul_with(&self.w_out, &y, n, residual, ep)?;
        Ok(())
    }
}
