//! Qwen3 MoE (`qwen3_moe`, GGUF `qwen3moe`; e.g. Qwen3-30B-A3B): Qwen3 attention (plain per-head
//! q/k RMSNorm, full NeoX RoPE) and in every layer a routed SwiGLU MoE (softmax router, top-k,
//! renormalised when `norm_topk_prob`), no shared expert.
//!
//! References: transformers `models/qwen3_moe/modeling_qwen3_moe.py`; llama.cpp
//! `src/models/qwen3moe.cpp`. GGUF names the MoE pre-norm `ffn_norm`.

use std::sync::Arc;

use kapitsa_backend::Backend;

use crate::common::{
    attention_block, ffn_block, load_globals, load_qwen_moe, n_experts, AttnOptions, CommonHparams,
    Names,
};
use crate::config::Hparams;
use crate::layers::decoder::Decoder;
use crate::layers::ffn::Ffn;
use crate::{
    BatchInputs, CausalLm, KvCache, Logits, ModelError, ModelSource, ModelSpec, Result, Tensor,
};

/// A loaded Qwen3 MoE model.
pub struct Qwen3Moe {
    inner: Decoder,
}

impl Qwen3Moe {
    /// Load from a GGUF file (arch `qwen3moe`) or an HF/MLX directory (`model_type`
    /// `qwen3_moe`).
    pub fn load(src: &ModelSource, backend: Arc<dyn Backend>) -> Result<Qwen3Moe> {
        let arch = "qwen3moe";
        let c = CommonHparams::read(src, arch)?;
        let hp = Hparams::new(src, arch);
        let n_expert = n_experts(&hp)?;
        let top_k = hp.usize("expert_used_count", "num_experts_per_tok")?;
        let n_ff = hp.usize("expert_feed_forward_length", "moe_intermediate_size")?;
        // GGUF qwen3moe always renormalises (llama.cpp hard-codes it); HF has the flag.
        let norm_topk = hp.hf_bool("norm_topk_prob").unwrap_or(true);
        if !hp.is_gguf() {
            let sparse_step = hp.usize_opt("", "decoder_sparse_step")?.unwrap_or(1);
            let dense_layers = src
                .hf()
                .and_then(|h| h.config().get("mlp_only_layers").cloned())
                .and_then(|v| v.as_array().map(|a| a.len()))
                .unwrap_or(0);
            if sparse_step != 1 || dense_layers != 0 {
                return Err(ModelError::Config(
                    "qwen3_moe with dense layers (decoder_sparse_step / mlp_only_layers) is \
                     not supported"
                        .into(),
                ));
            }
        }
        let names = Names::detect(src)?;
        let parts = load_globals(src, &names, arch, &c, 0.0)?;
        let opts = AttnOptions {
            qkv_bias: false,
            qk_norm: Some(0.0),
            n_rot: c.head_dim,
            gated: false,
        };
        let mut blocks = Vec::with_capacity(2 * c.n_layer);
        for i in 0..c.n_layer {
            blocks.push(attention_block(src, &names, i, &c, &opts, 0.0)?);
            let moe = load_qwen_moe(src, &names, i, n_expert, top_k, n_ff, norm_topk)?;
            blocks.push(ffn_block(
                src,
                &names,
                i,
                &c,
                "ffn_norm.weight",
                0.0,
                Ffn::Moe(moe),
            )?);
        }
        Ok(Qwen3Moe {
            inner: Decoder::new(parts, blocks, backend)?,
        })
    }
}

impl CausalLm for Qwen3Moe {
    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }
    fn backend(&self) -> &Arc<dyn Backend> {
        self.inner.backend()
    }
    fn forward(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits> {
        self.inner.forward(batch, cache)
    }

    fn step_kernels(&self) -> Option<usize> {
        self.inner.step_kernels()
    }

    fn forward_hidden(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits> {
        self.inner.forward_hidden(batch, cache)
    }

    fn embed_tokens(&self, tokens: &[u32], out: &mut Tensor) -> Result<()> {
        self.inner.embed_tokens(tokens, out)
    }

    fn output_head(&self, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
        self.inner.output_head(x, n, out)
    }
}
