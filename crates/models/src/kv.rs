//! The per-sequence cache of a model, owned by the caller and borrowed by `forward`, laid out
//! from the model's layer kinds ([`crate::ModelSpec::layers`]).
//!
//! - Attention layers: K and V buffers of `[n_slots, n_ctx, n_head_kv * head_dim]` (slot-major,
//!   then position, then head, then dim). A sequence owns one slot; position `p` of its tokens
//!   is row `p` of its slot. (Paged blocks replace the contiguous slot in the serving issue; the
//!   forward pass only sees [`KvCache::layer`].)
//! - Recurrent layers: per slot, an f32 conv window `[conv_kernel - 1, conv_channels]` (oldest
//!   row first) and an f32 recurrent state of `state_len` values. A recurrent state summarises
//!   every token before it, so it can only be extended, never rewound: the cache records how
//!   many tokens each slot's states hold ([`KvCache::recurrent_pos`]); a batch chunk must start
//!   exactly there, or at position 0 (which resets the states). Snapshots
//!   ([`KvCache::save_recurrent`]) let a caller go back to an earlier point.

use half::f16;
use kapitsa_kernels_cpu::attention::KvSlice;

use crate::{CausalLm, LayerKind, ModelError, RecurrentShape, Result};

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

#[derive(Debug)]
struct LayerRec {
    shape: RecurrentShape,
    /// `[n_slots, conv_len]`.
    conv: Vec<f32>,
    /// `[n_slots, state_len]`.
    state: Vec<f32>,
}

#[derive(Debug)]
enum LayerCache {
    None,
    Kv(LayerKv),
    Rec(LayerRec),
}

/// Marks a slot whose recurrent states are unusable (a forward pass over it failed midway).
const REC_INVALID: usize = usize::MAX;

/// The recurrent states of one slot at one point of its sequence ([`KvCache::save_recurrent`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RecurrentSnapshot {
    /// Tokens the states summarise.
    pub pos: usize,
    /// Per recurrent layer (in layer order): conv window, then recurrent state.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl RecurrentSnapshot {
    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(c, s)| 4 * (c.len() + s.len()))
            .sum()
    }
}

/// Cache storage for every layer of one model: KV for attention layers, states for recurrent
/// layers.
#[derive(Debug)]
pub struct KvCache {
    n_slots: usize,
    n_ctx: usize,
    kv_dim: usize,
    kv_type: KvType,
    /// Indexed by model layer.
    layers: Vec<LayerCache>,
    /// Per slot: tokens the recurrent states hold (`REC_INVALID` after a failed pass).
    rec_pos: Vec<usize>,
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
        let too_large =
            || ModelError::Config(format!("recurrent state for {n_slots} slots is too large"));
        let layers = spec
            .layers
            .iter()
            .map(|k| match k {
                LayerKind::Attention => Ok(LayerCache::Kv(LayerKv {
                    k: Buf::new(kv_type, per),
                    v: Buf::new(kv_type, per),
                })),
                LayerKind::Recurrent(shape) => Ok(LayerCache::Rec(LayerRec {
                    shape: *shape,
                    conv: vec![
                        0.0;
                        n_slots
                            .checked_mul(shape.conv_len())
                            .ok_or_else(too_large)?
                    ],
                    state: vec![0.0; n_slots.checked_mul(shape.state_len).ok_or_else(too_large)?],
                })),
                LayerKind::Stateless => Ok(LayerCache::None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            n_slots,
            n_ctx,
            kv_dim,
            kv_type,
            layers,
            rec_pos: vec![0; n_slots],
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
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::None => 0,
                LayerCache::Kv(_) => 2 * self.n_slots * self.n_ctx * self.kv_dim * el,
                LayerCache::Rec(r) => 4 * (r.conv.len() + r.state.len()),
            })
            .sum()
    }

    /// Whether any layer keeps recurrent state (such a cache cannot be rewound).
    pub fn has_recurrent(&self) -> bool {
        self.layers.iter().any(|l| matches!(l, LayerCache::Rec(_)))
    }

    fn layer_mut(&mut self, layer: usize) -> Result<&mut LayerKv> {
        match self.layers.get_mut(layer) {
            Some(LayerCache::Kv(l)) => Ok(l),
            _ => Err(ModelError::Batch(format!("layer {layer} has no KV cache"))),
        }
    }

    /// Tokens the recurrent states of `slot` summarise, or `None` when they are unusable
    /// (a forward pass failed midway; only a restart at position 0 is possible).
    pub fn recurrent_pos(&self, slot: usize) -> Option<usize> {
        self.rec_pos
            .get(slot)
            .copied()
            .filter(|&p| p != REC_INVALID)
    }

    /// Called by models before a chunk of `slot` starting at `pos0` runs through the
    /// recurrent layers: position 0 clears the states; any other start must equal
    /// [`KvCache::recurrent_pos`]. The slot is marked unusable until
    /// [`KvCache::end_recurrent`] confirms the pass completed.
    pub fn begin_recurrent(&mut self, slot: usize, pos0: usize) -> Result<()> {
        if slot >= self.n_slots {
            return Err(ModelError::Batch(format!("slot {slot} out of range")));
        }
        if !self.has_recurrent() {
            return Ok(());
        }
        if pos0 == 0 {
            for l in &mut self.layers {
                if let LayerCache::Rec(r) = l {
                    let (c, s) = (r.shape.conv_len(), r.shape.state_len);
                    r.conv[slot * c..(slot + 1) * c].fill(0.0);
                    r.state[slot * s..(slot + 1) * s].fill(0.0);
                }
            }
        } else if self.rec_pos[slot] != pos0 {
            return Err(ModelError::Batch(match self.recurrent_pos(slot) {
                Some(p) => format!(
                    "slot {slot}: recurrent state holds {p} tokens, a chunk cannot start at \
                     position {pos0} (recurrent state cannot be rewound)"
                ),
                None => format!(
                    "slot {slot}: recurrent state is invalid after a failed pass; restart at \
                     position 0"
                ),
            }));
        }
        self.rec_pos[slot] = REC_INVALID;
        Ok(())
    }

    /// Called by models after a chunk completed: the states of `slot` now hold `pos` tokens.
    pub fn end_recurrent(&mut self, slot: usize, pos: usize) {
        if let Some(p) = self.rec_pos.get_mut(slot) {
            *p = pos;
        }
    }

    /// Conv window (`[conv_kernel - 1, conv_channels]`) and recurrent state of `slot` in
    /// recurrent layer `layer`, mutable.
    pub fn recurrent_mut(&mut self, layer: usize, slot: usize) -> Result<(&mut [f32], &mut [f32])> {
        match self.layers.get_mut(layer) {
            Some(LayerCache::Rec(r)) if slot < self.n_slots => {
                let (c, s) = (r.shape.conv_len(), r.shape.state_len);
                Ok((
                    &mut r.conv[slot * c..(slot + 1) * c],
                    &mut r.state[slot * s..(slot + 1) * s],
                ))
            }
            _ => Err(ModelError::Batch(format!(
                "layer {layer} slot {slot} has no recurrent state"
            ))),
        }
    }

    /// Copy of the recurrent states of `slot` (to resume from later with
    /// [`KvCache::restore_recurrent`]), or `None` when they are unusable.
    pub fn save_recurrent(&self, slot: usize) -> Option<RecurrentSnapshot> {
        let pos = self.recurrent_pos(slot)?;
        let layers = self
            .layers
            .iter()
            .filter_map(|l| match l {
                LayerCache::Rec(r) => {
                    let (c, s) = (r.shape.conv_len(), r.shape.state_len);
                    Some((
                        r.conv[slot * c..(slot + 1) * c].to_vec(),
                        r.state[slot * s..(slot + 1) * s].to_vec(),
                    ))
                }
                _ => None,
            })
            .collect();
        Some(RecurrentSnapshot { pos, layers })
    }

    /// Put a snapshot back into `slot` (any slot of a cache for the same model). The caller
    /// must also make the KV rows `0..snap.pos` of that slot valid (they are not part of the
    /// snapshot).
    pub fn restore_recurrent(&mut self, slot: usize, snap: &RecurrentSnapshot) -> Result<()> {
        if slot >= self.n_slots {
            return Err(ModelError::Batch(format!("slot {slot} out of range")));
        }
        let mut it = snap.layers.iter();
        for l in &mut self.layers {
            if let LayerCache::Rec(r) = l {
                let (c, s) = (r.shape.conv_len(), r.shape.state_len);
                let Some((sc, ss)) = it.next().filter(|(a, b)| a.len() == c && b.len() == s) else {
                    return Err(ModelError::Batch(
                        "recurrent snapshot does not fit this cache".into(),
                    ));
                };
                r.conv[slot * c..(slot + 1) * c].copy_from_slice(sc);
                r.state[slot * s..(slot + 1) * s].copy_from_slice(ss);
            }
        }
        if it.next().is_some() {
            return Err(ModelError::Batch(
                "recurrent snapshot does not fit this cache".into(),
            ));
        }
        self.rec_pos[slot] = snap.pos;
        Ok(())
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
        let Some(LayerCache::Kv(l)) = self.layers.get(layer) else {
            return Err(ModelError::Batch(format!("layer {layer} has no KV cache")));
        };
        let at = slot * self.n_ctx * self.kv_dim;
        let r = at..at + n * self.kv_dim;
        Ok((l.k.slice(r.clone()), l.v.slice(r)))
    }

    /// Copy positions `0..n` of slot `from` into slot `to` (prefix sharing in tests and the
    /// engine's fork). Recurrent states are copied too when they hold exactly `n` tokens;
    /// otherwise `to`'s states are marked unusable.
    pub fn copy_slot(&mut self, from: usize, to: usize, n: usize) {
        let (n_ctx, kv_dim) = (self.n_ctx, self.kv_dim);
        let len = n.min(n_ctx) * kv_dim;
        if self.has_recurrent() {
            match self.save_recurrent(from).filter(|s| s.pos == n) {
                Some(snap) if self.restore_recurrent(to, &snap).is_ok() => {}
                _ => {
                    if let Some(p) = self.rec_pos.get_mut(to) {
                        *p = REC_INVALID;
                    }
                }
            }
        }
        for l in self.layers.iter_mut().filter_map(|l| match l {
            LayerCache::Kv(kv) => Some(kv),
            _ => None,
        }) {
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
