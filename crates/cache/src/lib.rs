//! Cache management: which sequence owns which cache slot, and how many of its positions are
//! filled. The storage itself ([`kapitsa_models::KvCache`]) is laid out from the model's layer
//! kinds; this crate decides who uses it. Paged blocks and prefix reuse build on this.

use kapitsa_models::{CausalLm, KvCache, KvType, Result};

/// A KV cache plus slot bookkeeping: free list and the tokens each slot holds.
pub struct SlotCache {
    kv: KvCache,
    /// Tokens whose K/V are stored in each slot (positions `0..len`); `None` when free.
    slots: Vec<Option<Vec<u32>>>,
}

impl SlotCache {
    /// `n_slots` sequences of up to `n_ctx` tokens for `model`.
    pub fn new(
        model: &dyn CausalLm,
        n_slots: usize,
        n_ctx: usize,
        kv_type: KvType,
    ) -> Result<SlotCache> {
        Ok(SlotCache {
            kv: KvCache::for_model(model, n_slots, n_ctx, kv_type)?,
            slots: vec![None; n_slots],
        })
    }

    /// Claim a free slot, or `None` when all are in use.
    pub fn alloc(&mut self) -> Option<usize> {
        let i = self.slots.iter().position(|s| s.is_none())?;
        self.slots[i] = Some(Vec::new());
        Some(i)
    }

    /// Release a slot (its contents become garbage).
    pub fn free(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
        }
    }

    /// Slots in use.
    pub fn n_used(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Tokens stored in `slot` (empty for a free slot).
    pub fn tokens(&self, slot: usize) -> &[u32] {
        self.slots
            .get(slot)
            .and_then(|s| s.as_deref())
            .unwrap_or(&[])
    }

    /// Record that `slot` now holds `tokens` (after a forward pass wrote them).
    pub fn set_tokens(&mut self, slot: usize, tokens: Vec<u32>) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = Some(tokens);
        }
    }

    /// Length of the longest common prefix of `slot`'s stored tokens and `prompt`; those
    /// positions need no recomputation. Capped at `prompt.len() - 1` so the last prompt token
    /// is always run (its logits are needed).
    ///
    /// Models with recurrent layers cannot rewind their state: there the slot is reusable
    /// only when everything it holds is a prefix of `prompt` (and the state is intact);
    /// otherwise the answer is 0 and the prompt is recomputed from the start.
    pub fn reusable_prefix(&self, slot: usize, prompt: &[u32]) -> usize {
        let have = self.tokens(slot);
        let n = have.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let n = n.min(prompt.len().saturating_sub(1));
        if self.kv.has_recurrent()
            && (n != have.len() || self.kv.recurrent_pos(slot) != Some(have.len()))
        {
            return 0;
        }
        n
    }

    /// The storage, for forward passes.
    pub fn kv_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    /// Tokens per slot.
    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx()
    }
}
