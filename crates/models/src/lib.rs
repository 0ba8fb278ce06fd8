//! Model registry and one file per architecture.
//!
//! A model is a pure function of its weights, a batch and a borrowed cache
//! ([`CausalLm::forward`]); the engine owns the batch and the cache (DESIGN.md §4).

pub mod batch;
pub mod common;
pub mod config;
pub mod dflash;
pub mod error;
pub mod layers;
pub mod mrope;
pub mod mtp;
pub mod nemotron_h;
pub mod nemotron_vision;
pub mod qwen2;
pub mod qwen3;
pub mod qwen35;
pub mod qwen35_vision;
pub mod qwen3moe;
pub mod registry;
pub mod source;
pub mod vision;

use std::sync::Arc;

pub use batch::{BatchInputs, EmbedRows, LogitRow, Logits, SeqChunk};
pub use error::{ModelError, Result};
pub use kapitsa_backend::{Backend, Tensor};
pub use kapitsa_cache::{
    CacheLayout, KvCache, KvType, LayerKind, RecurrentShape, RecurrentSnapshot, DEFAULT_BLOCK_SIZE,
};
pub use kapitsa_formats::LoadMode;
pub use registry::{load_model, LoadOptions, LoadedModel};
pub use source::{ModelSource, Weight};

/// Static facts about a loaded model that the engine and cache need.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// Architecture name as GGUF spells it (`"qwen2"`, `"qwen3"`).
    pub arch: String,
    /// Rows of the logits (`n_vocab`).
    pub n_vocab: usize,
    /// Width of the hidden state (`n_embd`): of [`CausalLm::forward_hidden`] rows, of each
    /// tapped layer ([`BatchInputs::tap_layers`]) and of [`CausalLm::embed_tokens`] rows.
    pub n_embd: usize,
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
    /// Multimodal rotary sections (temporal, height, width frequency slots, interleaved as
    /// Qwen3.5 does) when the model takes [`BatchInputs::mrope`] positions; `None`: plain
    /// positions only.
    pub mrope: Option<[usize; 3]>,
}

impl ModelSpec {
    /// Number of layers that need a KV cache.
    pub fn n_attention_layers(&self) -> usize {
        LayerKind::count_attention(&self.layers)
    }

    /// Number of layers with recurrent state.
    pub fn n_recurrent_layers(&self) -> usize {
        LayerKind::count_recurrent(&self.layers)
    }

    /// What the cache needs to lay out its storage.
    pub fn cache_layout(&self) -> CacheLayout {
        CacheLayout {
            layers: self.layers.clone(),
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
        }
    }
}

/// A causal language model.
pub trait CausalLm: Send + Sync {
    /// Static description (vocab, layer kinds, cache dims).
    fn spec(&self) -> &ModelSpec;

    /// The backend the model's weights live on (caches for it must be allocated there).
    fn backend(&self) -> &Arc<dyn Backend>;

    /// Run the batch: append every sequence's new tokens to its cache slot and return logits
    /// for the rows `batch.logit_rows` asks for. `cache` must have been made for this model
    /// ([`new_cache`]).
    fn forward(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits>;

    /// Kernel launches of the most recently replayed recorded step (`None`: this model's
    /// steps are not recorded on its backend, or none was yet). For benchmarks.
    fn step_kernels(&self) -> Option<usize> {
        None
    }

    /// [`CausalLm::forward`] without the output head: for the rows `batch.logit_rows` asks
    /// for, the hidden state after the final norm (what `transformers` calls the last hidden
    /// state of the base model), as a [`Logits`] whose rows are `n_embd` wide. For embeddings.
    /// The cache is written as by `forward`. Default: an error (the model cannot).
    fn forward_hidden(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits> {
        let _ = (batch, cache);
        Err(not_supported(self.spec(), "hidden states"))
    }

    /// The input embedding rows of `tokens` (no scaling), into `out` `[tokens.len(),
    /// n_embd]` f32 on the model's backend. For drafters that share the target's embedding
    /// (DFlash). Default: an error (the model cannot).
    fn embed_tokens(&self, tokens: &[u32], out: &mut Tensor) -> Result<()> {
        let _ = (tokens, out);
        Err(not_supported(self.spec(), "embedding rows"))
    }

    /// The output projection alone (no final norm) on `n` hidden rows `x` `[n, n_embd]`,
    /// into `out` `[n, n_vocab]` f32 on the model's backend. For drafters that share the
    /// target's LM head (DFlash). Default: an error (the model cannot).
    fn output_head(&self, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
        let _ = (x, n, out);
        Err(not_supported(self.spec(), "its output head"))
    }

    /// The model's own multi-token-prediction head as loaded (host weights), for
    /// [`mtp::MtpDrafter::for_model`]; `None` (the default) when the architecture has none
    /// or the file carries no MTP weights.
    fn mtp_parts(&self) -> Option<mtp::MtpParts<'_>> {
        None
    }
}

/// The error of a [`CausalLm`] method a model does not implement.
fn not_supported(spec: &ModelSpec, what: &str) -> ModelError {
    ModelError::Config(format!("the {} model does not give {what}", spec.arch))
}

/// A cache for `model` on its backend: `n_slots` sequences of up to `n_ctx` tokens, with
/// enough KV blocks for every slot to be full at once.
pub fn new_cache(
    model: &dyn CausalLm,
    n_slots: usize,
    n_ctx: usize,
    kv_type: KvType,
) -> Result<KvCache> {
    Ok(KvCache::full(
        model.backend().clone(),
        &model.spec().cache_layout(),
        n_slots,
        n_ctx,
        kv_type,
    )?)
}
