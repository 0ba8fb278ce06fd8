//! Softmax attention blocks: GQA with optional q/k/v biases (Qwen2), optional per-head RMSNorm
//! on q and k (Qwen3, Qwen3.5), NeoX RoPE over all or the first `n_rot` dims of each head (or
//! none: Nemotron-H), and an optional sigmoid output gate whose values are interleaved with the
//! query heads in the q projection (Qwen3.5/3.6 gated attention).
//!
//! Layouts: activations are row-major `[n_tokens, width]` f32 over the whole batch; the q
//! projection output is `[n_tokens, n_head * head_dim]`, or with a gate
//! `[n_tokens, n_head, 2 * head_dim]` holding `[q_h | gate_h]` per head.

use kapitsa_backend::{AttnShape, Backend, Batch, Epilogue, KvLayer, RopeDesc, Tensor};

use crate::layers::{check_matrix, check_vec, tensor, upload_opt, ForwardCtx};
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
    pub rope: Option<RopeDesc>,
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

    /// Upload the weights to `be`.
    pub fn upload(&self, be: &dyn Backend) -> Result<DeviceAttention> {
        Ok(DeviceAttention {
            wq: self.wq.upload(be)?,
            wk: self.wk.upload(be)?,
            wv: self.wv.upload(be)?,
            wo: self.wo.upload(be)?,
            bq: upload_opt(be, &self.bq)?,
            bk: upload_opt(be, &self.bk)?,
            bv: upload_opt(be, &self.bv)?,
            q_norm: upload_opt(be, &self.q_norm)?,
            k_norm: upload_opt(be, &self.k_norm)?,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            rope: self.rope,
            gated: self.gated,
            eps: self.eps,
        })
    }
}

/// An [`Attention`] block uploaded to a backend (same fields, weights on its device).
#[derive(Debug)]
pub struct DeviceAttention {
    wq: kapitsa_backend::Weight,
    wk: kapitsa_backend::Weight,
    wv: kapitsa_backend::Weight,
    wo: kapitsa_backend::Weight,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    pub(crate) rope: Option<RopeDesc>,
    gated: bool,
    eps: f32,
}

impl DeviceAttention {
    /// The kernel shape.
    pub fn shape(&self) -> AttnShape {
        AttnShape {
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    /// `x[n, d] += attention(h[n, d])` (the residual stream) for cache layer `layer`: projections, biases, q/k
    /// norms, RoPE, writing K and V into the paged cache, attention over the whole batch,
    /// the output gate and the output projection.
    pub fn forward(
        &self,
        cx: &mut ForwardCtx<'_>,
        layer: usize,
        h: &Tensor,
        x: &mut Tensor,
    ) -> Result<()> {
        let be = cx.be;
        let batch = cx.batch;
        let n = batch.n_tokens();
        let hd = self.head_dim;
        let (q_dim, kv_dim) = (self.n_head * hd, self.n_head_kv * hd);
        let mut q = tensor(be, n * q_dim)?;
        let mut gate = None;
        let mut k = tensor(be, n * kv_dim)?;
        let mut v = tensor(be, n * kv_dim)?;
        let ws = [&self.wq, &self.wk, &self.wv];
        if self.gated {
            // Per head `[q_h | gate_h]`: rows of 2 * head_dim split into q and gate.
            let mut qg = tensor(be, n * 2 * q_dim)?;
            be.matmul_many(&ws, h, n, &mut [&mut qg, &mut k, &mut v])?;
            let mut g = tensor(be, n * q_dim)?;
            be.split_cols(&qg, n * self.n_head, &[hd, hd], &mut [&mut q, &mut g])?;
            gate = Some(g);
            if let Some(b) = &self.bq {
                be.add_bias(&mut q, b)?;
            }
            for (t, b) in [(&mut k, &self.bk), (&mut v, &self.bv)] {
                if let Some(b) = b {
                    be.add_bias(t, b)?;
                }
            }
        } else {
            // the biases in the products' epilogues
            fn ep(b: &Option<Tensor>) -> Epilogue<'_> {
                Epilogue {
                    bias: b.as_ref(),
                    accumulate: false,
                }
            }
            let eps = [ep(&self.bq), ep(&self.bk), ep(&self.bv)];
            be.matmul_many_with(&ws, h, n, &mut [&mut q, &mut k, &mut v], &eps)?;
        }
        if let Some(w) = &self.q_norm {
            be.rms_norm(&mut q, hd, w, self.eps)?;
        }
        if let Some(w) = &self.k_norm {
            be.rms_norm(&mut k, hd, w, self.eps)?;
        }
        if let (Some(_), Some((cos, sin))) = (self.rope, cx.rope_tables) {
            be.rope_table(&mut q, self.n_head, hd, cos, sin)?;
            be.rope_table(&mut k, self.n_head_kv, hd, cos, sin)?;
        } else if let Some(rope) = self.rope {
            be.rope_qk(
                &mut q,
                &mut k,
                self.n_head,
                self.n_head_kv,
                hd,
                rope,
                cx.dev_batch,
            )?;
        }
        // (the decoder checked that the positions written are prepared and unshared)
        {
            let (kc, vc) = cx.cache.kv_tensors_mut(layer)?;
            let dst = KvLayer {
                k: kc,
                v: vc,
                kv_dim,
            };
            be.kv_write(&k, &v, dst, cx.dev_batch)?;
        }
        let mut att = tensor(be, n * q_dim)?;
        let (kc, vc) = cx.cache.kv_tensors(layer)?;
        be.attention(self.shape(), &q, kc, vc, cx.dev_batch, &mut att)?;
        self.output_add(be, &mut att, gate.as_ref(), n, x)
    }

    /// Width of a K (or V) row: `n_head_kv * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Width of a query row (without the gate): `n_head * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// The K and V rows (`[n, kv_dim]` each) of `n` normed inputs `h` `[n, d]`: projections,
    /// biases, the k norm and RoPE at the positions of `batch` (`n` tokens). For attention
    /// over dense K/V ([`Backend::attention_spans`]) outside the paged cache (MTP heads).
    pub fn keys_values(
        &self,
        be: &dyn Backend,
        h: &Tensor,
        n: usize,
        batch: &Batch,
    ) -> Result<(Tensor, Tensor)> {
        let hd = self.head_dim;
        let mut k = tensor(be, n * self.kv_dim())?;
        let mut v = tensor(be, n * self.kv_dim())?;
        fn ep(b: &Option<Tensor>) -> Epilogue<'_> {
            Epilogue {
                bias: b.as_ref(),
                accumulate: false,
            }
        }
        be.matmul_many_with(
            &[&self.wk, &self.wv],
            h,
            n,
            &mut [&mut k, &mut v],
            &[ep(&self.bk), ep(&self.bv)],
        )?;
        if let Some(w) = &self.k_norm {
            be.rms_norm(&mut k, hd, w, self.eps)?;
        }
        if let Some(rope) = self.rope {
            be.rope(&mut k, self.n_head_kv, hd, rope, batch)?;
        }
        Ok((k, v))
    }

    /// The query rows (`[n, q_dim]`) of `n` normed inputs `h` and, when gated, the output
    /// gate (`[n, q_dim]`): projection, bias, the q norm and RoPE at the positions of
    /// `batch`. The companion of [`DeviceAttention::keys_values`].
    pub fn queries(
        &self,
        be: &dyn Backend,
        h: &Tensor,
        n: usize,
        batch: &Batch,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (hd, q_dim) = (self.head_dim, self.q_dim());
        let mut q = tensor(be, n * q_dim)?;
        let mut gate = None;
        if self.gated {
            let mut qg = tensor(be, n * 2 * q_dim)?;
            be.matmul(&self.wq, h, n, &mut qg)?;
            let mut g = tensor(be, n * q_dim)?;
            be.split_cols(&qg, n * self.n_head, &[hd, hd], &mut [&mut q, &mut g])?;
            gate = Some(g);
            if let Some(b) = &self.bq {
                be.add_bias(&mut q, b)?;
            }
        } else {
            let ep = Epilogue {
                bias: self.bq.as_ref(),
                accumulate: false,
            };
            be.matmul_with(&self.wq, h, n, &mut q, ep)?;
        }
        if let Some(w) = &self.q_norm {
            be.rms_norm(&mut q, hd, w, self.eps)?;
        }
        if let Some(rope) = self.rope {
            be.rope(&mut q, self.n_head, hd, rope, batch)?;
        }
        Ok((q, gate))
    }

    /// `x[n, d] += Wo · (att ⊙ sigmoid(gate))` (the gate only when given): the attention
    /// output `att` `[n, q_dim]` (overwritten) into the residual stream.
    pub fn output_add(
        &self,
        be: &dyn Backend,
        att: &mut Tensor,
        gate: Option<&Tensor>,
        n: usize,
        x: &mut Tensor,
    ) -> Result<()> {
        if let Some(g) = gate {
            be.mul_sigmoid(att, g)?;
        }
        // the residual connection in the output projection's epilogue
        let ep = Epilogue {
            bias: None,
            accumulate: true,
        };
        be.matmul_with(&self.wo, att, n, x, ep)?;
        Ok(())
    }
}
