//! Mamba2 mixer (NVIDIA Nemotron-H).
//!
//! Per token: `[z (d_inner) | xBC (d_inner + 2 G N) | dt (H)] = x W_in^T`; a depthwise causal
//! conv1d with bias and SiLU over xBC; split into x, B, C; `dt = softplus(dt + dt_bias)` (no
//! clamp, as llama.cpp; transformers clamps at `time_step_min` in its chunked form only, which
//! real inputs do not reach); the SSD scan per head with `A = -exp(A_log)` and the `D` skip
//! (kernel [`kapitsa_kernels_cpu::mamba2`]); an RMSNorm per group of `d_inner / G` channels
//! applied to `y * silu(z)` (gate before norm); the output projection.
//!
//! References: transformers `NemotronHMamba2Mixer`, `NemotronHRMSNormGated`; llama.cpp
//! `build_mamba2_layer`.

use kapitsa_kernels_cpu::mamba2::{gated_group_rms_norm, Mamba2Shape};

use crate::layers::gdn::softplus;
use crate::layers::{check_matrix, check_vec, Step};
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

    /// `out[n, d] = mamba2(h[n, d])`, updating the recurrent states of cache layer `layer`.
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
        let (di, cd, nh) = (self.d_inner(), self.conv_dim(), s.n_heads);
        let gn = s.n_groups * s.d_state;
        let w = di + cd + nh;
        let mut proj = vec![0f32; n * w];
        be.matmul(&self.w_in.matrix()?, h, n, &mut proj)?;
        let mut z = Vec::with_capacity(n * di);
        let mut xbc = Vec::with_capacity(n * cd);
        let mut dt = Vec::with_capacity(n * nh);
        for row in proj.chunks_exact(w) {
            z.extend_from_slice(&row[..di]);
            xbc.extend_from_slice(&row[di..di + cd]);
            for (v, &b) in row[di + cd..].iter().zip(&self.dt_bias) {
                dt.push(softplus(v + b));
            }
        }
        let mut y = vec![0f32; n * di];
        let mut conv = Vec::new();
        let (mut x, mut bm, mut cm) = (Vec::new(), Vec::new(), Vec::new());
        for c in &batch.seqs {
            let t = c.len;
            let r = c.start..c.start + t;
            let (conv_state, state) = st.cache.recurrent_mut(layer, c.slot)?;
            conv.resize(t * cd, 0.0);
            be.conv1d_causal(
                &xbc[r.start * cd..r.end * cd],
                t,
                cd,
                self.conv_k,
                &self.conv_w,
                self.conv_b.as_deref(),
                conv_state,
                true,
                &mut conv,
            );
            x.clear();
            bm.clear();
            cm.clear();
            for row in conv.chunks_exact(cd) {
                x.extend_from_slice(&row[..di]);
                bm.extend_from_slice(&row[di..di + gn]);
                cm.extend_from_slice(&row[di + gn..]);
            }
            be.mamba2(
                s,
                &x,
                &dt[r.start * nh..r.end * nh],
                &self.a_neg,
                &bm,
                &cm,
                &self.d,
                state,
                &mut y[r.start * di..r.end * di],
                None,
            );
        }
        gated_group_rms_norm(&mut y, &z, di, s.n_groups, &self.norm, self.eps);
        be.matmul(&self.w_out.matrix()?, &y, n, out)?;
        Ok(())
    }
}
