//! Qwen2 / Qwen2.5 (dense): GQA attention with q/k/v biases, NeoX RoPE, SwiGLU.
//!
//! HF `Qwen2ForCausalLM` (transformers `models/qwen2/modeling_qwen2.py`), GGUF arch `qwen2`
//! (llama.cpp `src/models/qwen2.cpp`). GGUF stores the same matrices as HF (no permutation).

use std::sync::Arc;

use kapitsa_backend::Backend;

use crate::common::{
    attention_block, ffn_block, load_globals, load_swiglu, AttnOptions, CommonHparams, Names,
};
use crate::layers::decoder::Decoder;
use crate::layers::ffn::Ffn;
use crate::{BatchInputs, CausalLm, KvCache, Logits, ModelSource, ModelSpec, Result, Tensor};

/// Build a dense Qwen2/Qwen3 decoder: per layer an attention block (`qkv_bias`, `qk_norm`
/// select the per-architecture tensors) and a SwiGLU MLP block.
pub(crate) fn load_dense(
    src: &ModelSource,
    arch: &str,
    backend: Arc<dyn Backend>,
    qkv_bias: bool,
    qk_norm: bool,
) -> Result<Decoder> {
    let c = CommonHparams::read(src, arch)?;
    let names = Names::detect(src)?;
    let parts = load_globals(src, &names, arch, &c, 0.0)?;
    let opts = AttnOptions {
        qkv_bias,
        qk_norm: qk_norm.then_some(0.0),
        n_rot: c.head_dim,
        gated: false,
    };
    let mut blocks = Vec::with_capacity(2 * c.n_layer);
    for i in 0..c.n_layer {
        blocks.push(attention_block(src, &names, i, &c, &opts, 0.0)?);
        let mlp = Ffn::Mlp(load_swiglu(src, &names, i, "mlp", "")?);
        blocks.push(ffn_block(src, &names, i, &c, "ffn_norm.weight", 0.0, mlp)?);
    }
    Decoder::new(parts, blocks, backend)
}

/// A loaded Qwen2 model.
pub struct Qwen2 {
    inner: Decoder,
}

impl Qwen2 {
    /// Load from a GGUF file (arch `qwen2`) or an HF directory (`model_type` `qwen2`).
    pub fn load(src: &ModelSource, backend: Arc<dyn Backend>) -> Result<Qwen2> {
        Ok(Qwen2 {
            inner: load_dense(src, "qwen2", backend, true, false)?,
        })
    }
}

impl CausalLm for Qwen2 {
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
