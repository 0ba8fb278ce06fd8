//! Cache storage and management. The storage ([`KvCache`], paged KV blocks plus per-slot
//! recurrent states) is laid out from a model's [`CacheLayout`] and allocated through its
//! backend, so it lives on the backend's device; [`SlotCache`] decides which sequence owns
//! which slot, which tokens each slot holds, and when its KV blocks go back to the pool.
//!
//! Two reuse modes:
//! - without a prefix cache, a slot keeps the tokens of its last sequence and a new sequence
//!   placed in that slot reuses their common prefix ([`SlotCache::reusable_prefix`]);
//! - with a [`prefix::PrefixCache`] ([`SlotCache::enable_prefix_cache`]), a slot's blocks
//!   (and recurrent checkpoints) go into a shared tree when its sequence ends
//!   ([`SlotCache::retire`]) or reaches a checkpoint ([`SlotCache::checkpoint`]), and any new
//!   sequence in any slot resumes from the longest cached prefix ([`SlotCache::admit`]).

mod disk;
mod error;
mod kv;
mod layout;
pub mod prefix;

use std::sync::Arc;

pub use error::{CacheError, Result};
use kapitsa_backend::Backend;
pub use kv::{KvCache, KvType, RecurrentSnapshot, DEFAULT_BLOCK_SIZE};
pub use layout::{CacheLayout, LayerKind, RecurrentShape};
use prefix::{PrefixCache, PrefixConfig, PrefixStats};

/// A KV cache plus slot bookkeeping: free list and the tokens each slot holds.
pub struct SlotCache {
    kv: KvCache,
    /// Tokens whose K/V are stored in each slot (positions `0..len`); `None` when free.
    slots: Vec<Option<Vec<u32>>>,
    prefix: Option<PrefixCache>,
}

impl SlotCache {
    /// `n_slots` sequences of up to `n_ctx` tokens of a model with `layout`, on `backend`,
    /// with enough KV blocks for every slot to be full at once.
    pub fn new(
        backend: Arc<dyn Backend>,
        layout: &CacheLayout,
        n_slots: usize,
        n_ctx: usize,
        kv_type: KvType,
    ) -> Result<SlotCache> {
        Ok(SlotCache::from_kv(KvCache::full(
            backend, layout, n_slots, n_ctx, kv_type,
        )?))
    }

    /// `n_slots` sequences of up to `n_ctx` tokens sharing a pool of `n_blocks` KV blocks of
    /// `block_size` positions. The pool must hold at least one full-context sequence.
    #[allow(clippy::too_many_arguments)]
    pub fn paged(
        backend: Arc<dyn Backend>,
        layout: &CacheLayout,
        n_slots: usize,
        n_ctx: usize,
        n_blocks: usize,
        block_size: usize,
        kv_type: KvType,
    ) -> Result<SlotCache> {
        if block_size == 0 || n_blocks.saturating_mul(block_size) < n_ctx {
            return Err(CacheError::Config(format!(
                "a KV pool of {n_blocks} blocks x {block_size} positions cannot hold one \
                 sequence of {n_ctx} tokens"
            )));
        }
        Ok(SlotCache::from_kv(KvCache::new(
            backend, layout, n_slots, n_ctx, n_blocks, block_size, kv_type,
        )?))
    }

    /// Slot bookkeeping over existing storage.
    pub fn from_kv(kv: KvCache) -> SlotCache {
        let n = kv.n_slots();
        SlotCache {
            kv,
            slots: vec![None; n],
            prefix: None,
        }
    }

    /// Share KV blocks and checkpoints between sequences through a prefix tree (see the
    /// crate docs); with `cfg.disk` set, reopen the files of an earlier run.
    pub fn enable_prefix_cache(&mut self, cfg: &PrefixConfig) -> std::io::Result<()> {
        self.prefix = Some(PrefixCache::new(&self.kv, cfg)?);
        Ok(())
    }

    /// Counters of the prefix cache (zero without one).
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix
            .as_ref()
            .map(PrefixCache::stats)
            .unwrap_or_default()
    }

    /// Put `slot` to work on `tokens`: resume from the longest reusable prefix (the prefix
    /// cache's, or the slot's own kept tokens without one) and take memory for the next
    /// `min(tokens.len() - reused, max_new)` positions. Returns the tokens reused, or `None`
    /// (the slot then holds nothing) when the pool is short.
    pub fn admit(&mut self, slot: usize, tokens: &[u32], max_new: usize) -> Option<usize> {
        let reused = match &mut self.prefix {
            Some(p) => {
                self.kv.release(slot);
                p.attach(&mut self.kv, slot, tokens)
            }
            None => self.reusable_prefix(slot, tokens),
        };
        self.set_tokens(slot, tokens[..reused].to_vec());
        let end = reused + (tokens.len() - reused).min(max_new);
        if self.reserve(slot, reused, end) {
            if let Some(p) = &mut self.prefix {
                p.record_admission(reused);
            }
            Some(reused)
        } else {
            self.discard(slot);
            None
        }
    }

    /// Record what `slot` holds now in the prefix cache (with its recurrent states, when
    /// they hold exactly its tokens), without letting go of it. No-op without a prefix cache.
    pub fn checkpoint(&mut self, slot: usize) {
        let Some(p) = &mut self.prefix else { return };
        let tokens = match self.slots.get(slot) {
            Some(Some(t)) if !t.is_empty() => t.clone(),
            _ => return,
        };
        let state = self
            .kv
            .has_recurrent()
            .then(|| self.kv.save_recurrent(slot))
            .flatten()
            .filter(|s| s.pos == tokens.len());
        p.insert(&mut self.kv, slot, &tokens, state);
    }

    /// The sequence in `slot` is over: with a prefix cache its contents move into it and the
    /// slot is emptied; without one the slot keeps them for reuse.
    pub fn retire(&mut self, slot: usize) {
        if self.prefix.is_some() {
            self.checkpoint(slot);
            self.discard(slot);
        }
    }

    /// Drop what `slot` holds without caching it (its contents are not trustworthy).
    pub fn discard(&mut self, slot: usize) {
        if let Some(Some(t)) = self.slots.get_mut(slot) {
            t.clear();
        }
        self.kv.release(slot);
    }

    /// Write the prefix cache's memory contents to its disk tier (see
    /// [`PrefixCache::persist`]); returns the entries written.
    pub fn persist(&mut self) -> usize {
        match &mut self.prefix {
            Some(p) => p.persist(&self.kv),
            None => 0,
        }
    }

    /// Give one block held only by the prefix cache back to the pool (least recently used;
    /// spilled to disk with a disk tier). `false` when there is none.
    pub fn evict_cached(&mut self) -> bool {
        match &mut self.prefix {
            Some(p) => p.evict_one(&mut self.kv, &[]),
            None => false,
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
        if let Some(p) = &self.prefix {
            return p.reusable(prompt);
        }
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

    /// Forget what `slot` holds from position `n` on (tokens and KV blocks): speculative
    /// tokens that were rejected. Recurrent states are not touched (they cannot drop
    /// positions; the engine restores a copy and recomputes).
    pub fn rewind(&mut self, slot: usize, n: usize) {
        if let Some(Some(t)) = self.slots.get_mut(slot) {
            t.truncate(n);
        }
        self.kv.truncate(slot, n);
    }

    /// Get `slot` ready to compute positions `start..end`: what it holds past `start` is
    /// dropped (tokens and KV blocks), and KV blocks for `start..end` are taken from the pool.
    /// `false` (and only the drop done) when the pool has too few free blocks.
    pub fn reserve(&mut self, slot: usize, start: usize, end: usize) -> bool {
        if let Some(Some(t)) = self.slots.get_mut(slot) {
            t.truncate(start);
        }
        self.kv.truncate(slot, start);
        self.kv
            .prepare(slot, start, end.saturating_sub(start))
            .is_ok()
    }

    /// Free the memory `slot` holds: into the prefix cache when there is one
    /// ([`SlotCache::retire`]), dropped otherwise. The slot stays claimed.
    pub fn evict(&mut self, slot: usize) {
        if self.prefix.is_some() {
            self.retire(slot);
        } else {
            self.discard(slot);
        }
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
