//! Cache management: which sequence owns which cache slot, which tokens each slot holds, and
//! when its KV blocks go back to the pool. The storage itself ([`kapitsa_models::KvCache`],
//! paged KV blocks plus per-slot recurrent states) is laid out from the model's layer kinds;
//! this crate decides who uses it.

use kapitsa_models::{CausalLm, KvCache, KvType, ModelError, Result};

/// A KV cache plus slot bookkeeping: free list and the tokens each slot holds.
pub struct SlotCache {
    kv: KvCache,
    /// Tokens whose K/V are stored in each slot (positions `0..len`); `None` when free.
    slots: Vec<Option<Vec<u32>>>,
}

impl SlotCache {
    /// `n_slots` sequences of up to `n_ctx` tokens for `model`, with enough KV blocks for
    /// every slot to be full at once.
    pub fn new(
        model: &dyn CausalLm,
        n_slots: usize,
        n_ctx: usize,
        kv_type: KvType,
    ) -> Result<SlotCache> {
        Ok(SlotCache::from_kv(KvCache::for_model(
            model, n_slots, n_ctx, kv_type,
        )?))
    }

    /// `n_slots` sequences of up to `n_ctx` tokens sharing a pool of `n_blocks` KV blocks of
    /// `block_size` positions. The pool must hold at least one full-context sequence.
    pub fn paged(
        model: &dyn CausalLm,
        n_slots: usize,
        n_ctx: usize,
        n_blocks: usize,
        block_size: usize,
        kv_type: KvType,
    ) -> Result<SlotCache> {
        if block_size == 0 || n_blocks.saturating_mul(block_size) < n_ctx {
            return Err(ModelError::Config(format!(
                "a KV pool of {n_blocks} blocks x {block_size} positions cannot hold one \
                 sequence of {n_ctx} tokens"
            )));
        }
        Ok(SlotCache::from_kv(KvCache::paged(
            model, n_slots, n_ctx, n_blocks, block_size, kv_type,
        )?))
    }

    fn from_kv(kv: KvCache) -> SlotCache {
        let n = kv.n_slots();
        SlotCache {
            kv,
            slots: vec![None; n],
        }
    }

    /// Claim a free slot, or `None` when all are in use.
    pub fn alloc(&mut self) -> Option<usize> {
        let i = self.slots.iter().position(|s| s.is_none())?;
        self.slots[i] = Some(Vec::new());
        Some(i)
    }

    /// Release a slot: its contents are dropped and its KV blocks go back to the pool.
    pub fn free(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
            self.kv.release(slot);
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

    /// Get `slot` ready to compute positions `start..end`: what it holds past `start` is
    /// dropped (tokens and KV blocks), and KV blocks for `start..end` are taken from the pool.
    /// `false` (and only the drop done) when the pool has too few free blocks.
    pub fn reserve(&mut self, slot: usize, start: usize, end: usize) -> bool {
        if let Some(Some(t)) = self.slots.get_mut(slot) {
            t.truncate(start);
        }
        self.kv.truncate(slot, start);
        self.kv.prepare(slot, start, end.saturating_sub(start)).is_ok()
    }

    /// Drop everything `slot` holds (tokens, KV blocks, recurrent state); the slot stays
    /// claimed.
    pub fn evict(&mut self, slot: usize) {
        if let Some(Some(t)) = self.slots.get_mut(slot) {
            t.clear();
        }
        self.kv.release(slot);
    }

    /// Whether `slot` holds KV blocks.
    pub fn holds_blocks(&self, slot: usize) -> bool {
        self.kv.slot_blocks(slot) > 0
    }

    /// KV blocks in use and in the pool.
    pub fn blocks(&self) -> (usize, usize) {
        let total = self.kv.n_blocks();
        (total - self.kv.n_free_blocks(), total)
    }

    /// The storage, for forward passes.
    pub fn kv_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    /// The storage.
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Tokens per slot.
    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx()
    }
}
