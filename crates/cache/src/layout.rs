//! What the cache needs to know about a model to lay out its storage: per-layer kinds and
//! the attention and recurrent dimensions. Models describe themselves with it
//! (`ModelSpec::cache_layout` in the models crate); the cache never sees a model.

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

    /// Bytes of one sequence's state of this layer (conv window and recurrent state, f32).
    pub fn bytes(&self) -> usize {
        4 * (self.conv_len() + self.state_len)
    }
}

/// The cache layout of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheLayout {
    /// Per-layer mixer kinds, in layer order.
    pub layers: Vec<LayerKind>,
    /// KV heads of the attention layers.
    pub n_head_kv: usize,
    /// Dims per attention head (K and V).
    pub head_dim: usize,
}

impl LayerKind {
    /// How many of `layers` are attention layers.
    pub fn count_attention(layers: &[LayerKind]) -> usize {
        layers
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count()
    }

    /// How many of `layers` are recurrent layers.
    pub fn count_recurrent(layers: &[LayerKind]) -> usize {
        layers
            .iter()
            .filter(|k| matches!(k, LayerKind::Recurrent(_)))
            .count()
    }
}

impl CacheLayout {
    /// Number of attention layers.
    pub fn n_attention_layers(&self) -> usize {
        LayerKind::count_attention(&self.layers)
    }

    /// Number of recurrent layers.
    pub fn n_recurrent_layers(&self) -> usize {
        LayerKind::count_recurrent(&self.layers)
    }

    /// Bytes of one sequence's recurrent states over all layers (what each cache slot holds
    /// beside its KV blocks).
    pub fn slot_state_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|k| match k {
                LayerKind::Recurrent(r) => r.bytes(),
                _ => 0,
            })
            .sum()
    }
}
