//! Qwen3 (dense): like Qwen2 without q/k/v biases, with per-head RMSNorm on q and k before
//! RoPE and an explicit `head_dim`.
//!
//! HF `Qwen3ForCausalLM` (transformers `models/qwen3/modeling_qwen3.py`), GGUF arch `qwen3`
//! (llama.cpp `src/models/qwen3.cpp`).

use std::sync::Arc;

use kapitsa_backend::Backend;

use crate::layers::decoder::Decoder;
use crate::qwen2::load_dense;
use crate::{BatchInputs, CausalLm, KvCache, Logits, ModelSource, ModelSpec, Result, Tensor};

/// A loaded Qwen3 model.
pub struct Qwen3 {
    inner: Decoder,
}

impl Qwen3 {
    /// Load from a GGUF file (arch `qwen3`) or an HF directory (`model_type` `qwen3`).
    pub fn load(src: &ModelSource, backend: Arc<dyn Backend>) -> Result<Qwen3> {
        Ok(Qwen3 {
            inner: load_dense(src, "qwen3", backend, false, true)?,
        })
    }
}

impl CausalLm for Qwen3 {
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
