//! Embeddings: the model's final-norm hidden states ([`CausalLm::forward_hidden`]) pooled
//! over each input and L2-normalised.
//!
//! - **Pooling** ([`Pooling`]): `Last` (the last token's state: Qwen3-Embedding and other
//!   decoder embedding models, which are trained to end inputs with the end-of-text token) or
//!   `Mean` (the mean over every token). [`Pooling::detect`] reads what the model declares: a
//!   GGUF `<arch>.pooling_type` (llama.cpp's numbering: 3 = last token; any other value is
//!   read as mean), or `pooling_mode_lasttoken` in the sentence-transformers
//!   `1_Pooling/config.json` of an HF folder; models that declare nothing get `Mean`.
//! - **Batching.** [`Embedder::embed`] packs the inputs into forward passes of up to `n_slots`
//!   sequences and `pool_tokens` tokens (each input whole, from position 0), in a cache of its
//!   own: it runs beside the engine thread on the same weights, one pass at a time (a mutex),
//!   and never touches the generation cache.
//! - **Numerics.** The KV cache is f32, so the states equal an uncached f32 forward pass
//!   (checked against `transformers` in `tests/embed.rs`).

use std::sync::{Arc, Mutex, OnceLock};

use kapitsa_models::{BatchInputs, CausalLm, KvCache, KvType, ModelSource};

use crate::EngineError;

/// How token states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean of every token's state.
    Mean,
    /// The last token's state.
    Last,
}

impl Pooling {
    /// The pooling `source` declares (see the module doc); `Mean` when it says nothing.
    pub fn detect(source: &ModelSource) -> Pooling {
        if let Some(g) = source.gguf() {
            if let Ok(arch) = source.arch() {
                let key = format!("{arch}.pooling_type");
                if let Ok(v) = g.get_u64(&key) {
                    return if v == 3 { Pooling::Last } else { Pooling::Mean };
                }
            }
        }
        let cfg = source.path().join("1_Pooling/config.json");
        if let Ok(text) = std::fs::read_to_string(cfg) {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
                if v.get("pooling_mode_lasttoken").and_then(|x| x.as_bool()) == Some(true) {
                    return Pooling::Last;
                }
            }
        }
        Pooling::Mean
    }
}

/// Computes embeddings with a model (see the module doc).
pub struct Embedder {
    model: Arc<dyn CausalLm>,
    pooling: Pooling,
    pool_tokens: usize,
    cache: Mutex<KvCache>,
}

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder")
            .field("pooling", &self.pooling)
            .field("pool_tokens", &self.pool_tokens)
            .finish_non_exhaustive()
    }
}

/// Sequences per pass.
pub const EMBED_SLOTS: usize = 8;

impl Embedder {
    /// An embedder over `model` with its own f32 cache of `pool_tokens` positions (the
    /// longest input it takes; at least 16).
    pub fn new(
        model: Arc<dyn CausalLm>,
        pooling: Pooling,
        pool_tokens: usize,
    ) -> Result<Embedder, EngineError> {
        let pool_tokens = pool_tokens.max(16);
        let bs = kapitsa_models::DEFAULT_BLOCK_SIZE;
        let cache = KvCache::new(
            model.backend().clone(),
            &model.spec().cache_layout(),
            EMBED_SLOTS,
            pool_tokens,
            pool_tokens.div_ceil(bs) + EMBED_SLOTS,
            bs,
            KvType::F32,
        )
        .map_err(|e| EngineError::BadRequest(format!("embedding cache: {e}")))?;
        Ok(Embedder {
            model,
            pooling,
            pool_tokens,
            cache: Mutex::new(cache),
        })
    }

    /// The pooling used.
    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// The longest input, in tokens.
    pub fn max_tokens(&self) -> usize {
        self.pool_tokens
    }

    /// One L2-normalised vector per input (blocks the thread: call it off async code).
    /// Inputs must be non-empty and at most [`Embedder::max_tokens`] long.
    pub fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, EngineError> {
        let n_vocab = self.model.spec().n_vocab;
        for (i, t) in inputs.iter().enumerate() {
            if t.is_empty() {
                return Err(EngineError::BadRequest(format!("input {i} is empty")));
            }
            if t.len() > self.pool_tokens {
                return Err(EngineError::BadRequest(format!(
                    "input {i} has {} tokens; at most {} can be embedded",
                    t.len(),
                    self.pool_tokens
                )));
            }
            if let Some(&bad) = t.iter().find(|&&x| x as usize >= n_vocab) {
                return Err(EngineError::BadRequest(format!(
                    "input {i}: token {bad} is outside the vocabulary ({n_vocab})"
                )));
            }
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::with_capacity(inputs.len());
        let mut next = 0;
        while next < inputs.len() {
            // Greedy packing: as many whole inputs as fit in the slots and the pool.
            let mut end = next;
            let mut tokens = 0;
            while end < inputs.len()
                && end - next < EMBED_SLOTS
                && tokens + inputs[end].len() <= self.pool_tokens
            {
                tokens += inputs[end].len();
                end += 1;
            }
            let group = &inputs[next..end];
            let mut batch = BatchInputs::default();
            for (slot, t) in group.iter().enumerate() {
                batch.push_seq(slot, t, 0, false);
            }
            batch.logit_rows = match self.pooling {
                Pooling::Mean => (0..batch.n_tokens()).collect(),
                Pooling::Last => batch.seqs.iter().map(|c| c.start + c.len - 1).collect(),
            };
            let r = self.model.forward_hidden(&batch, &mut cache);
            for slot in 0..group.len() {
                cache.release(slot);
            }
            let hidden = r.map_err(EngineError::from)?;
            let d = hidden.n_vocab;
            if hidden.data.len() != batch.logit_rows.len() * d {
                return Err(EngineError::BadRequest(format!(
                    "the model gave {} values for {} rows of {d}",
                    hidden.data.len(),
                    batch.logit_rows.len()
                )));
            }
            let mut row = 0;
            for t in group {
                let n = if self.pooling == Pooling::Mean {
                    t.len()
                } else {
                    1
                };
                let mut v = vec![0f64; d];
                for r in row..row + n {
                    for (a, &x) in v.iter_mut().zip(hidden.row(r)) {
                        *a += f64::from(x);
                    }
                }
                row += n;
                let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
                let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
                out.push(v.iter().map(|x| (x * scale) as f32).collect());
            }
            next = end;
        }
        Ok(out)
    }
}

/// An [`Embedder`] made at first use (a server that never embeds pays nothing).
pub struct LazyEmbedder {
    model: Arc<dyn CausalLm>,
    pooling: Pooling,
    cell: OnceLock<Result<Arc<Embedder>, String>>,
}

impl std::fmt::Debug for LazyEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyEmbedder")
            .field("pooling", &self.pooling)
            .finish_non_exhaustive()
    }
}

impl LazyEmbedder {
    /// Embeddings with `model`, pooled by `pooling`.
    pub fn new(model: Arc<dyn CausalLm>, pooling: Pooling) -> LazyEmbedder {
        LazyEmbedder {
            model,
            pooling,
            cell: OnceLock::new(),
        }
    }

    /// The pooling.
    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// The embedder; the first call makes it with a cache of `max_tokens` positions (later
    /// calls return that one, or its error as text).
    pub fn get(&self, max_tokens: usize) -> Result<Arc<Embedder>, String> {
        self.cell
            .get_or_init(|| {
                Embedder::new(self.model.clone(), self.pooling, max_tokens)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
    }
}
