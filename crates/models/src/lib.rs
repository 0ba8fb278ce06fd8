//! Model registry and one file per architecture.
//!
//! A model is a pure function of its weights, a batch and a borrowed cache
//! ([`CausalLm::forward`]); the engine owns the batch and the cache (DESIGN.md §4).

pub mod batch;
pub mod config;
pub mod error;
pub mod kv;
pub mod layers;
pub mod qwen2;
pub mod qwen3;
pub mod registry;
pub mod source;

pub use batch::{BatchInputs, Logits, SeqChunk};
pub use error::{ModelError, Result};
pub use kv::{KvCache, KvType};
pub use registry::{load_model, LoadOptions, LoadedModel};
pub use source::{ModelSource, Weight};

/// What kind of mixer a layer has; the cache layout is derived from this list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Softmax attention with a KV cache.
    Attention,
}

/// Static facts about a loaded model that the engine and cache need.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// Architecture name as GGUF spells it (`"qwen2"`, `"qwen3"`).
    pub arch: String,
    /// Rows of the logits (`n_vocab`).
    pub n_vocab: usize,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
    /// Per-layer mixer kinds, in layer order.
    pub layers: Vec<LayerKind>,
    /// KV heads of attention layers.
    pub n_head_kv: usize,
    /// Dims per attention head (K and V).
    pub head_dim: usize,
}

impl ModelSpec {
    /// Number of layers that need a KV cache.
    pub fn n_attention_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count()
    }
}

/// A causal language model.
pub trait CausalLm: Send + Sync {
    /// Static description (vocab, layer kinds, cache dims).
    fn spec(&self) -> &ModelSpec;

    /// Run the batch: append every sequence's new tokens to its cache slot and return logits
    /// for the rows `batch.logit_rows` asks for. `cache` must have been made for this model
    /// ([`KvCache::for_model`]).
    fn forward(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits>;
}
