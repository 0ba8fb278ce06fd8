//! Qwen2 / Qwen2.5 (dense): GQA attention with q/k/v biases, NeoX RoPE, SwiGLU.
//!
//! HF `Qwen2ForCausalLM` (transformers `models/qwen2/modeling_qwen2.py`), GGUF arch `qwen2`
//! (llama.cpp `src/models/qwen2.cpp`). GGUF stores the same matrices as HF (no permutation).

use std::sync::Arc;

use kapitsa_backend::Backend;

use crate::config::Hparams;
use crate::layers::dense::{AttnWeights, DenseConfig, DenseLayer, DenseModel, MlpWeights};
use crate::{BatchInputs, CausalLm, KvCache, Logits, ModelSource, ModelSpec, Result};

/// Tensor names of layer `i` (and the globals with `i = None`): `(HF name, GGUF name)`.
pub(crate) fn tensor_name(src: &ModelSource, hf: &str, gguf: &str) -> String {
    if src.gguf().is_some() {
        gguf.to_string()
    } else {
        hf.to_string()
    }
}

/// Read the dense hyper-parameters shared by Qwen2 and Qwen3.
pub(crate) fn dense_config(src: &ModelSource, arch: &str) -> Result<DenseConfig> {
    let hp = Hparams::new(src, arch);
    let n_embd = hp.usize("embedding_length", "hidden_size")?;
    let n_head = hp.usize("attention.head_count", "num_attention_heads")?;
    let n_head_kv = hp
        .usize_opt("attention.head_count_kv", "num_key_value_heads")?
        .unwrap_or(n_head);
    let head_dim = hp
        .usize_opt("attention.key_length", "head_dim")?
        .unwrap_or(n_embd.checked_div(n_head).unwrap_or(0));
    let emb = src.weight(&tensor_name(
        src,
        "model.embed_tokens.weight",
        "token_embd.weight",
    ))?;
    let n_vocab = emb.shape.first().copied().unwrap_or(0);
    Ok(DenseConfig {
        arch: arch.to_string(),
        n_vocab,
        n_embd,
        n_layer: hp.usize("block_count", "num_hidden_layers")?,
        n_head,
        n_head_kv,
        head_dim,
        n_ff: hp.usize("feed_forward_length", "intermediate_size")?,
        rms_eps: hp
            .f32_opt("attention.layer_norm_rms_epsilon", "rms_norm_eps")?
            .unwrap_or(1e-6),
        rope_theta: hp.rope_theta(10000.0)?,
        n_ctx_train: hp
            .usize_opt("context_length", "max_position_embeddings")?
            .unwrap_or(4096),
    })
}

/// Load the weights of a dense Qwen2/Qwen3 model; `qkv_bias` and `qk_norm` select the
/// per-architecture tensors.
pub(crate) fn load_dense(
    src: &ModelSource,
    cfg: DenseConfig,
    backend: Arc<dyn Backend>,
    qkv_bias: bool,
    qk_norm: bool,
) -> Result<DenseModel> {
    let name = |hf: String, gguf: String| tensor_name(src, &hf, &gguf);
    let tok_embd = src.weight(&name(
        "model.embed_tokens.weight".into(),
        "token_embd.weight".into(),
    ))?;
    let out_norm = src
        .weight(&name(
            "model.norm.weight".into(),
            "output_norm.weight".into(),
        ))?
        .to_f32()?;
    let output = src.weight_opt(&name("lm_head.weight".into(), "output.weight".into()))?;
    let mut layers = Vec::with_capacity(cfg.n_layer);
    for i in 0..cfg.n_layer {
        let hf = |s: &str| format!("model.layers.{i}.{s}");
        let gg = |s: &str| format!("blk.{i}.{s}");
        let w = |h: &str, g: &str| src.weight(&name(hf(h), gg(g)));
        let v = |h: &str, g: &str, len: usize| -> Result<Vec<f32>> {
            w(h, g)?.expect_shape(&[len])?.to_f32()
        };
        let ov = |h: &str, g: &str, len: usize, on: bool| -> Result<Option<Vec<f32>>> {
            if on {
                v(h, g, len).map(Some)
            } else {
                Ok(None)
            }
        };
        let (d, hd) = (cfg.n_embd, cfg.head_dim);
        let (q_dim, kv_dim) = (cfg.n_head * hd, cfg.n_head_kv * hd);
        layers.push(DenseLayer {
            attn_norm: v("input_layernorm.weight", "attn_norm.weight", d)?,
            attn: AttnWeights {
                wq: w("self_attn.q_proj.weight", "attn_q.weight")?,
                wk: w("self_attn.k_proj.weight", "attn_k.weight")?,
                wv: w("self_attn.v_proj.weight", "attn_v.weight")?,
                wo: w("self_attn.o_proj.weight", "attn_output.weight")?,
                bq: ov("self_attn.q_proj.bias", "attn_q.bias", q_dim, qkv_bias)?,
                bk: ov("self_attn.k_proj.bias", "attn_k.bias", kv_dim, qkv_bias)?,
                bv: ov("self_attn.v_proj.bias", "attn_v.bias", kv_dim, qkv_bias)?,
                q_norm: ov("self_attn.q_norm.weight", "attn_q_norm.weight", hd, qk_norm)?,
                k_norm: ov("self_attn.k_norm.weight", "attn_k_norm.weight", hd, qk_norm)?,
            },
            ffn_norm: v("post_attention_layernorm.weight", "ffn_norm.weight", d)?,
            mlp: MlpWeights {
                gate: w("mlp.gate_proj.weight", "ffn_gate.weight")?,
                up: w("mlp.up_proj.weight", "ffn_up.weight")?,
                down: w("mlp.down_proj.weight", "ffn_down.weight")?,
            },
        });
    }
    DenseModel::new(cfg, backend, tok_embd, layers, out_norm, output)
}

/// A loaded Qwen2 model.
pub struct Qwen2 {
    inner: DenseModel,
}

impl Qwen2 {
    /// Load from a GGUF file (arch `qwen2`) or an HF directory (`model_type` `qwen2`).
    pub fn load(src: &ModelSource, backend: Arc<dyn Backend>) -> Result<Qwen2> {
        let cfg = dense_config(src, "qwen2")?;
        Ok(Qwen2 {
            inner: load_dense(src, cfg, backend, true, false)?,
        })
    }
}

impl CausalLm for Qwen2 {
    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }
    fn forward(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits> {
        self.inner.forward(batch, cache)
    }
}
