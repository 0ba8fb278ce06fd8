//! Model registry and one file per architecture.
//!
//! A model is a pure function of its weights, a batch and a borrowed cache
//! ([`CausalLm::forward`]); the engine owns the batch and the cache (DESIGN.md §4).

pub mod batch;
pub mod common;
pub mod config;
pub mod error;
pub mod kv;
pub mod layers;
pub mod nemotron_h;
pub mod qwen2;
pub mod qwen3;
pub mod qwen35;
pub mod qwen3moe;
pub mod registry;
pub mod source;

pub use batch::{BatchInputs, Logits, SeqChunk};
pub use error::{ModelError, Result};
pub use kapitsa_formats::LoadMode;
pub use kv::{KvCache, KvType, RecurrentSnapshot, DEFAULT_BLOCK_SIZE};
pub use registry::{load_model, LoadOptions, LoadedModel};
pub use source::{ModelSource, Weight};

/// What kind of mixer a layer has; the cache layout is derived from this list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Softmax attention with a KV cache.
    Attention,
    /// A recurrent mixer (Gated DeltaNet, Mamba2) with fixed-size per-sequence state.
    Recurrent(RecurrentShape),
    /// No per-sequence state (a block that is only an MLP or MoE).
    Stateless,
}

/// Per-sequence state of one recurrent layer, all f32: a causal-conv window of the last
/// `conv_kernel - 1` input rows of `conv_channels` values, and `state_len` values of the
/// recurrent (SSM / delta-rule) state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecurrentShape {
    /// Channels the causal conv1d runs over.
    pub conv_channels: usize,
    /// Conv kernel width (the state keeps `conv_kernel - 1` rows).
    pub conv_kernel: usize,
    /// Values of the recurrent state (e.g. heads x dk x dv).
    pub state_len: usize,
}

impl RecurrentShape {
    /// Values of the conv window: `(conv_kernel - 1) * conv_channels`.
    pub fn conv_len(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.conv_channels
    }
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
    /// Multi-token-prediction layers loaded with the model (kept for speculative decoding;
    /// `forward` does not run them).
    pub n_mtp_layers: usize,
}

impl ModelSpec {
    /// Number of layers that need a KV cache.
    pub fn n_attention_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count()
    }

    /// Number of layers with recurrent state.
    pub fn n_recurrent_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|k| matches!(k, LayerKind::Recurrent(_)))
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
