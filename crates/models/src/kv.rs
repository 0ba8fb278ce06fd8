//! The KV cache of attention layers, owned by the caller and borrowed by `forward`.
//!
//! Layout: for each attention layer, K and V buffers of `[n_slots, n_ctx, n_head_kv * head_dim]`
//! (slot-major, then position, then head, then dim). A sequence owns one slot; position `p` of
//! its tokens is row `p` of its slot. (Paged blocks replace the contiguous slot in the serving
//! issue; the forward pass only sees [`KvCache::layer`].)

use half::f16;
use kapitsa_kernels_cpu::attention::KvSlice;

use crate::{CausalLm, LayerKind, ModelError, Result};

/// Element type of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvType {
    /// f16, half the memory; the default (as llama.cpp's).
    #[default]
    F16,
    /// f32, exact; used by reference tests.
    F32,
}

#[derive(Debug)]
enum Buf {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl Buf {
    fn new(t: KvType, n: usize) -> Buf {
        match t {
            KvType::F32 => Buf::F32(vec![0.0; n]),
            KvType::F16 => Buf::F16(vec![f16::ZERO; n]),
        }
    }

    fn write(&mut self, at: usize, x: &[f32]) {
        match self {
            Buf::F32(b) => b[at..at + x.len()].copy_from_slice(x),
            Buf::F16(b) => {
                for (d, s) in b[at..at + x.len()].iter_mut().zip(x) {
                    *d = f16::from_f32(*s);
                }
            }
        }
    }

    fn slice(&self, range: std::ops::Range<usize>) -> KvSlice<'_> {
        match self {
            Buf::F32(b) => KvSlice::F32(&b[range]),
            Buf::F16(b) => KvSlice::F16(&b[range]),
        }
    }
}

#[derive(Debug)]
struct LayerKv {
    k: Buf,
    v: Buf,
}

/// KV storage for every attention layer of one model.
#[derive(Debug)]
pub struct KvCache {
    n_slots: usize,
    n_ctx: usize,
    kv_dim: usize,
    kv_type: KvType,
    /// Indexed by model layer; `None` for layers without attention.
    layers: Vec<Option<LayerKv>>,
}

impl KvCache {
    /// A cache for `model` with `n_slots` sequences of up to `n_ctx` tokens each.
    pub fn for_model(
        model: &dyn CausalLm,
        n_slots: usize,
        n_ctx: usize,
        kv_type: KvType,
    ) -> Result<KvCache> {
        let spec = model.spec();
        let kv_dim = spec.n_head_kv * spec.head_dim;
        let per = n_slots
            .checked_mul(n_ctx)
            .and_then(|x| x.checked_mul(kv_dim))
            .ok_or_else(|| {
                ModelError::Config(format!("cache of {n_slots} x {n_ctx} tokens is too large"))
            })?;
        let layers = spec
            .layers
            .iter()
            .map(|k| match k {
                LayerKind::Attention => Some(LayerKv {
                    k: Buf::new(kv_type, per),
                    v: Buf::new(kv_type, per),
                }),
            })
            .collect();
        Ok(KvCache {
            n_slots,
            n_ctx,
            kv_dim,
            kv_type,
            layers,
        })
    }

    /// Number of sequence slots.
    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// Tokens per slot.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Element type.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// Bytes held by the cache.
    pub fn size_bytes(&self) -> usize {
        let el = match self.kv_type {
            KvType::F32 => 4,
            KvType::F16 => 2,
        };
        self.layers.iter().flatten().count() * 2 * self.n_slots * self.n_ctx * self.kv_dim * el
    }

    fn layer_mut(&mut self, layer: usize) -> Result<&mut LayerKv> {
        self.layers
            .get_mut(layer)
            .and_then(|l| l.as_mut())
            .ok_or_else(|| ModelError::Batch(format!("layer {layer} has no KV cache")))
    }

    /// Store K and V rows (`[n, kv_dim]` each) for positions `pos0..pos0+n` of `slot`.
    pub fn write(
        &mut self,
        layer: usize,
        slot: usize,
        pos0: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let (n_ctx, kv_dim) = (self.n_ctx, self.kv_dim);
        let n = k.len() / kv_dim;
        if pos0 + n > n_ctx {
            return Err(ModelError::ContextFull {
                pos: pos0 + n - 1,
                n_ctx,
            });
        }
        let at = (slot * n_ctx + pos0) * kv_dim;
        let l = self.layer_mut(layer)?;
        l.k.write(at, k);
        l.v.write(at, v);
        Ok(())
    }

    /// K and V of `slot` for positions `0..n` (`[n, kv_dim]` each).
    pub fn layer(&self, layer: usize, slot: usize, n: usize) -> Result<(KvSlice<'_>, KvSlice<'_>)> {
        if n > self.n_ctx {
            return Err(ModelError::ContextFull {
                pos: n - 1,
                n_ctx: self.n_ctx,
            });
        }
        let l = self
            .layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| ModelError::Batch(format!("layer {layer} has no KV cache")))?;
        let at = slot * self.n_ctx * self.kv_dim;
        let r = at..at + n * self.kv_dim;
        Ok((l.k.slice(r.clone()), l.v.slice(r)))
    }

    /// Copy positions `0..n` of slot `from` into slot `to` (prefix sharing in tests and the
    /// engine's fork).
    pub fn copy_slot(&mut self, from: usize, to: usize, n: usize) {
        let (n_ctx, kv_dim) = (self.n_ctx, self.kv_dim);
        let len = n.min(n_ctx) * kv_dim;
        for l in self.layers.iter_mut().flatten() {
            for b in [&mut l.k, &mut l.v] {
                match b {
                    Buf::F32(x) => x.copy_within(
                        from * n_ctx * kv_dim..from * n_ctx * kv_dim + len,
                        to * n_ctx * kv_dim,
                    ),
                    Buf::F16(x) => x.copy_within(
                        from * n_ctx * kv_dim..from * n_ctx * kv_dim + len,
                        to * n_ctx * kv_dim,
                    ),
                }
            }
        }
    }
}
