//! The pre-norm dense decoder used by Qwen2 and Qwen3: GQA attention with NeoX RoPE (optional
//! q/k/v biases, optional per-head q/k RMSNorm) and a SwiGLU MLP.
//!
//! References: transformers `models/qwen2/modeling_qwen2.py`, `models/qwen3/modeling_qwen3.py`;
//! llama.cpp `src/models/qwen2.cpp`, `src/models/qwen3.cpp`.
//!
//! Activations are row-major `[n_tokens, width]` f32 over the whole batch; only attention is
//! done per sequence.

use std::sync::Arc;

use kapitsa_backend::Backend;
use kapitsa_kernels_cpu::attention::AttnShape;
use kapitsa_kernels_cpu::ops::{add_inplace, Rope};

use crate::{BatchInputs, KvCache, LayerKind, Logits, ModelError, ModelSpec, Result, Weight};

/// Hyper-parameters of a dense decoder (llama.cpp names).
#[derive(Debug, Clone)]
pub struct DenseConfig {
    /// Architecture name (`qwen2`, `qwen3`).
    pub arch: String,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Decoder layers.
    pub n_layer: usize,
    /// Query heads.
    pub n_head: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// MLP intermediate size.
    pub n_ff: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// Training context length.
    pub n_ctx_train: usize,
}

impl DenseConfig {
    /// Check the values are usable.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(ModelError::Config(format!("{}: {m}", self.arch)));
        if self.n_embd == 0
            || self.n_layer == 0
            || self.n_head == 0
            || self.head_dim == 0
            || self.n_vocab == 0
        {
            return bad("zero-sized dimension");
        }
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad("n_head must be a multiple of n_head_kv");
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad("head_dim must be even for RoPE");
        }
        if self.rms_eps.is_nan()
            || self.rms_eps <= 0.0
            || self.rope_theta.is_nan()
            || self.rope_theta <= 0.0
        {
            return bad("rms_eps and rope_theta must be positive");
        }
        Ok(())
    }
}

/// Weights of one attention block.
#[derive(Debug)]
pub struct AttnWeights {
    /// `[n_head * head_dim, n_embd]`.
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
    /// Optional per-head RMSNorm weights `[head_dim]` on q and k (Qwen3).
    pub q_norm: Option<Vec<f32>>,
    /// See `q_norm`.
    pub k_norm: Option<Vec<f32>>,
}

/// Weights of one SwiGLU MLP: `down(silu(gate x) * up x)`.
#[derive(Debug)]
pub struct MlpWeights {
    /// `[n_ff, n_embd]`.
    pub gate: Weight,
    /// `[n_ff, n_embd]`.
    pub up: Weight,
    /// `[n_embd, n_ff]`.
    pub down: Weight,
}

/// One decoder layer.
#[derive(Debug)]
pub struct DenseLayer {
    /// `[n_embd]`.
    pub attn_norm: Vec<f32>,
    /// Attention weights.
    pub attn: AttnWeights,
    /// `[n_embd]`.
    pub ffn_norm: Vec<f32>,
    /// MLP weights.
    pub mlp: MlpWeights,
}

/// A whole dense decoder model.
pub struct DenseModel {
    cfg: DenseConfig,
    spec: ModelSpec,
    backend: Arc<dyn Backend>,
    tok_embd: Weight,
    layers: Vec<DenseLayer>,
    out_norm: Vec<f32>,
    /// `None` when the output projection is tied to `tok_embd`.
    output: Option<Weight>,
    rope: Rope,
}

impl DenseModel {
    /// Assemble a model; shapes are checked here once.
    pub fn new(
        cfg: DenseConfig,
        backend: Arc<dyn Backend>,
        tok_embd: Weight,
        layers: Vec<DenseLayer>,
        out_norm: Vec<f32>,
        output: Option<Weight>,
    ) -> Result<DenseModel> {
        cfg.validate()?;
        let (d, hd) = (cfg.n_embd, cfg.head_dim);
        let (q_dim, kv_dim) = (cfg.n_head * hd, cfg.n_head_kv * hd);
        let vec_len = |name: &str, v: &[f32], n: usize| -> Result<()> {
            if v.len() != n {
                return Err(ModelError::BadShape {
                    name: name.to_string(),
                    got: vec![v.len()],
                    want: vec![n],
                });
            }
            Ok(())
        };
        // Shape of a 2-D weight; `matmul`: it is used in matmuls, so its type needs a dot
        // kernel (the embedding of an untied model is only gathered).
        let shape_of = |w: &Weight, want: [usize; 2], matmul: bool| -> Result<()> {
            if matmul {
                w.check_matmul_type()?;
            }
            if w.shape != want {
                return Err(ModelError::BadShape {
                    name: w.name.clone(),
                    got: w.shape.clone(),
                    want: want.to_vec(),
                });
            }
            Ok(())
        };
        let shape = |w: &Weight, want: [usize; 2]| shape_of(w, want, true);
        shape_of(&tok_embd, [cfg.n_vocab, d], output.is_none())?;
        tok_embd.check_dequant_type()?;
        if let Some(o) = &output {
            shape(o, [cfg.n_vocab, d])?;
        }
        vec_len("output_norm", &out_norm, d)?;
        if layers.len() != cfg.n_layer {
            return Err(ModelError::Config(format!(
                "{} layers loaded, config says {}",
                layers.len(),
                cfg.n_layer
            )));
        }
        for (i, l) in layers.iter().enumerate() {
            vec_len(&format!("layer {i} attn_norm"), &l.attn_norm, d)?;
            vec_len(&format!("layer {i} ffn_norm"), &l.ffn_norm, d)?;
            shape(&l.attn.wq, [q_dim, d])?;
            shape(&l.attn.wk, [kv_dim, d])?;
            shape(&l.attn.wv, [kv_dim, d])?;
            shape(&l.attn.wo, [d, q_dim])?;
            for (n, b, len) in [
                ("bq", &l.attn.bq, q_dim),
                ("bk", &l.attn.bk, kv_dim),
                ("bv", &l.attn.bv, kv_dim),
            ] {
                if let Some(b) = b {
                    vec_len(&format!("layer {i} {n}"), b, len)?;
                }
            }
            for (n, b) in [("q_norm", &l.attn.q_norm), ("k_norm", &l.attn.k_norm)] {
                if let Some(b) = b {
                    vec_len(&format!("layer {i} {n}"), b, hd)?;
                }
            }
            shape(&l.mlp.gate, [cfg.n_ff, d])?;
            shape(&l.mlp.up, [cfg.n_ff, d])?;
            shape(&l.mlp.down, [d, cfg.n_ff])?;
        }
        let spec = ModelSpec {
            arch: cfg.arch.clone(),
            n_vocab: cfg.n_vocab,
            n_ctx_train: cfg.n_ctx_train,
            layers: vec![LayerKind::Attention; cfg.n_layer],
            n_head_kv: cfg.n_head_kv,
            head_dim: hd,
        };
        let rope = Rope::new(hd, cfg.rope_theta);
        Ok(DenseModel {
            cfg,
            spec,
            backend,
            tok_embd,
            layers,
            out_norm,
            output,
            rope,
        })
    }

    /// The static spec.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Forward pass over a batch (see [`crate::CausalLm::forward`]).
    pub fn forward(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits> {
        batch.validate(cache.n_slots())?;
        let cfg = &self.cfg;
        let be = &*self.backend;
        let n = batch.n_tokens();
        let d = cfg.n_embd;
        let hd = cfg.head_dim;
        let (q_dim, kv_dim) = (cfg.n_head * hd, cfg.n_head_kv * hd);
        for c in &batch.seqs {
            let last = batch.positions[c.start + c.len - 1] as usize;
            if last >= cache.n_ctx() {
                return Err(ModelError::ContextFull {
                    pos: last,
                    n_ctx: cache.n_ctx(),
                });
            }
        }
        if let Some(&bad) = batch.tokens.iter().find(|&&t| t as usize >= cfg.n_vocab) {
            return Err(ModelError::Batch(format!(
                "token id {bad} out of range (vocab {})",
                cfg.n_vocab
            )));
        }

        let mut x = vec![0f32; n * d];
        be.get_rows(&self.tok_embd.matrix()?, &batch.tokens, &mut x)?;

        // RoPE angles once per token, shared by all layers.
        let np = self.rope.n_pairs();
        let mut cs = vec![(0f32, 0f32); n * np];
        for (t, &p) in batch.positions.iter().enumerate() {
            self.rope.table(p, &mut cs[t * np..(t + 1) * np]);
        }
        let shape = AttnShape {
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };

        let mut h = vec![0f32; n * d];
        let mut q = vec![0f32; n * q_dim];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let mut att = vec![0f32; n * q_dim];
        let mut o = vec![0f32; n * d];
        let mut g = vec![0f32; n * cfg.n_ff];
        let mut u = vec![0f32; n * cfg.n_ff];
        for (il, l) in self.layers.iter().enumerate() {
            // attention block
            h.copy_from_slice(&x);
            be.rms_norm(&mut h, d, &l.attn_norm, cfg.rms_eps, 0.0);
            be.matmul(&l.attn.wq.matrix()?, &h, n, &mut q)?;
            be.matmul(&l.attn.wk.matrix()?, &h, n, &mut k)?;
            be.matmul(&l.attn.wv.matrix()?, &h, n, &mut v)?;
            add_bias(&mut q, l.attn.bq.as_deref());
            add_bias(&mut k, l.attn.bk.as_deref());
            add_bias(&mut v, l.attn.bv.as_deref());
            if let Some(w) = &l.attn.q_norm {
                be.rms_norm(&mut q, hd, w, cfg.rms_eps, 0.0);
            }
            if let Some(w) = &l.attn.k_norm {
                be.rms_norm(&mut k, hd, w, cfg.rms_eps, 0.0);
            }
            for t in 0..n {
                let c = &cs[t * np..(t + 1) * np];
                self.rope
                    .apply_neox(&mut q[t * q_dim..(t + 1) * q_dim], hd, c);
                self.rope
                    .apply_neox(&mut k[t * kv_dim..(t + 1) * kv_dim], hd, c);
            }
            for c in &batch.seqs {
                let r = c.start..c.start + c.len;
                let pos0 = batch.positions[c.start] as usize;
                cache.write(
                    il,
                    c.slot,
                    pos0,
                    &k[r.start * kv_dim..r.end * kv_dim],
                    &v[r.start * kv_dim..r.end * kv_dim],
                )?;
            }
            for c in &batch.seqs {
                let r = c.start..c.start + c.len;
                let n_ctx = batch.positions[r.end - 1] as usize + 1;
                let (ks, vs) = cache.layer(il, c.slot, n_ctx)?;
                be.attention(
                    shape,
                    &q[r.start * q_dim..r.end * q_dim],
                    &batch.positions[r.clone()],
                    ks,
                    vs,
                    &mut att[r.start * q_dim..r.end * q_dim],
                );
            }
            be.matmul(&l.attn.wo.matrix()?, &att, n, &mut o)?;
            add_inplace(&mut x, &o);

            // MLP block
            h.copy_from_slice(&x);
            be.rms_norm(&mut h, d, &l.ffn_norm, cfg.rms_eps, 0.0);
            be.matmul(&l.mlp.gate.matrix()?, &h, n, &mut g)?;
            be.matmul(&l.mlp.up.matrix()?, &h, n, &mut u)?;
            be.silu_mul(&mut g, &u);
            be.matmul(&l.mlp.down.matrix()?, &g, n, &mut o)?;
            add_inplace(&mut x, &o);
        }

        let rows = &batch.logit_rows;
        let mut hr = vec![0f32; rows.len() * d];
        for (i, &r) in rows.iter().enumerate() {
            hr[i * d..(i + 1) * d].copy_from_slice(&x[r * d..(r + 1) * d]);
        }
        be.rms_norm(&mut hr, d, &self.out_norm, cfg.rms_eps, 0.0);
        let out_w = self.output.as_ref().unwrap_or(&self.tok_embd);
        let mut data = vec![0f32; rows.len() * cfg.n_vocab];
        if !rows.is_empty() {
            be.matmul(&out_w.matrix()?, &hr, rows.len(), &mut data)?;
        }
        Ok(Logits {
            n_vocab: cfg.n_vocab,
            rows: rows.clone(),
            data,
        })
    }
}

fn add_bias(x: &mut [f32], b: Option<&[f32]>) {
    if let Some(b) = b {
        for row in x.chunks_exact_mut(b.len()) {
            add_inplace(row, b);
        }
    }
}
