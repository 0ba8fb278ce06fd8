//! The per-sequence cache storage of a model, owned by the engine and borrowed by `forward`,
//! laid out from the model's [`CacheLayout`] and allocated through its backend, so the
//! memory lives on the backend's device (host memory for the CPU, HBM for CUDA).
//!
//! - Attention layers: **paged** K and V. Each layer has a pool of `n_blocks` blocks of
//!   `block_size` positions, one [`Tensor`] `[n_blocks, block_size, n_head_kv * head_dim]`
//!   per buffer (block, then position in block, then head, then dim) of the cache type. A
//!   block id means the same block in every attention layer. Each sequence slot has a block
//!   table (host memory; the model passes it to the backend with each batch); position `p`
//!   of its tokens is row `p % block_size` of block `table[p / block_size]`. Blocks are
//!   taken from a free list when a chunk is about to be written ([`KvCache::prepare`],
//!   called by `forward`; an engine calls it earlier to know whether memory suffices) and go
//!   back when a slot is truncated or released. Blocks are reference-counted:
//!   [`KvCache::share_prefix`] lets a slot use another slot's prefix blocks without copying,
//!   and a shared block is copied on the device before it is written (copy on write), so a
//!   slot never sees another slot's writes.
//! - Recurrent layers: per layer, an f32 tensor of conv windows `[n_slots, conv_kernel - 1,
//!   conv_channels]` (oldest row first) and one of recurrent states `[n_slots, state_len]`.
//!   A recurrent state summarises every token before it, so it can only be extended, never
//!   rewound: the cache records how many tokens each slot's states hold
//!   ([`KvCache::recurrent_pos`]); a batch chunk must start exactly there, or at position 0
//!   (which resets the states). Snapshots ([`KvCache::save_recurrent`], copied to host
//!   memory) let a caller go back to an earlier point.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kapitsa_backend::{Backend, DType, Tensor, Q8_0_BLOCK};

use crate::{CacheError, CacheLayout, LayerKind, RecurrentShape, Result};

/// Positions per KV block unless the caller chooses ([`KvCache::new`]).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Element type of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvType {
    /// f16, half the memory; the default (as llama.cpp's).
    #[default]
    F16,
    /// f32, exact; used by reference tests.
    F32,
    /// ggml Q8_0 blocks (as llama.cpp's `-ctk q8_0 -ctv q8_0`): every 32 values of a head
    /// are an f16 scale `d = amax / 127` and 32 `i8` quants rounded to nearest, 34 bytes
    /// (8.5 bits per value, 53% of f16). Needs `head_dim % 32 == 0`.
    Q8_0,
}

impl KvType {
    /// Bytes of `n` consecutive elements starting at an element index that is a multiple of
    /// 32 (exact for Q8_0 when `n` is a multiple of 32, as whole cache rows are).
    pub fn row_bytes(self, n: usize) -> usize {
        self.dtype().bytes(n)
    }

    /// The name the CLI uses (`f16`, `f32`, `q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// The tensor element type that stores it.
    pub fn dtype(self) -> DType {
        match self {
            KvType::F16 => DType::F16,
            KvType::F32 => DType::F32,
            KvType::Q8_0 => DType::Q8_0,
        }
    }
}

impl std::str::FromStr for KvType {
    type Err = String;

    /// Parses [`KvType::name`].
    fn from_str(s: &str) -> std::result::Result<KvType, String> {
        match s {
            "f16" => Ok(KvType::F16),
            "f32" => Ok(KvType::F32),
            "q8_0" => Ok(KvType::Q8_0),
            other => Err(format!(
                "unknown KV cache type '{other}' (use f16, f32 or q8_0)"
            )),
        }
    }
}

#[derive(Debug)]
struct LayerKv {
    k: Tensor,
    v: Tensor,
}

#[derive(Debug)]
struct LayerRec {
    shape: RecurrentShape,
    /// `[n_slots, conv_len]` f32.
    conv: Tensor,
    /// `[n_slots, state_len]` f32.
    state: Tensor,
}

#[derive(Debug)]
enum LayerCache {
    None,
    Kv(LayerKv),
    Rec(LayerRec),
}

/// Marks a slot whose recurrent states are unusable (a forward pass over it failed midway).
const REC_INVALID: usize = usize::MAX;

/// The recurrent states of one slot at one point of its sequence ([`KvCache::save_recurrent`]),
/// copied to host memory.
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

/// Ids of caches (see [`KvCache::id`]).
static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

/// Cache storage for every layer of one model: paged KV for attention layers, states for
/// recurrent layers (see the module docs).
pub struct KvCache {
    /// Unique per cache (recordings of steps hold its tensors' device addresses).
    id: u64,
    backend: Arc<dyn Backend>,
    n_slots: usize,
    n_ctx: usize,
    kv_dim: usize,
    kv_type: KvType,
    block_size: usize,
    n_blocks: usize,
    /// Indexed by model layer.
    layers: Vec<LayerCache>,
    /// Per slot: block ids, in position order.
    tables: Vec<Vec<u32>>,
    /// Per block: how many slot tables hold it (0 = free).
    refs: Vec<u32>,
    /// Free block ids; popped from the end (so the lowest ids go first).
    free: Vec<u32>,
    /// Per slot: tokens the recurrent states hold (`REC_INVALID` after a failed pass).
    rec_pos: Vec<usize>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("device", &self.backend.device())
            .field("n_slots", &self.n_slots)
            .field("n_ctx", &self.n_ctx)
            .field("kv_type", &self.kv_type)
            .field("block_size", &self.block_size)
            .field("n_blocks", &self.n_blocks)
            .finish()
    }
}

impl KvCache {
    /// A cache with `n_slots` sequences of up to `n_ctx` tokens each, with blocks of
    /// [`DEFAULT_BLOCK_SIZE`] positions and enough of them for every slot to be full at
    /// once (memory use as a contiguous cache; blocks are still handed out on demand).
    pub fn full(
        backend: Arc<dyn Backend>,
        layout: &CacheLayout,
        n_slots: usize,
        n_ctx: usize,
        kv_type: KvType,
    ) -> Result<KvCache> {
        let n_blocks = n_slots
            .checked_mul(n_ctx.div_ceil(DEFAULT_BLOCK_SIZE))
            .ok_or_else(|| {
                CacheError::Config(format!("cache of {n_slots} x {n_ctx} tokens is too large"))
            })?;
        KvCache::new(
            backend,
            layout,
            n_slots,
            n_ctx,
            n_blocks,
            DEFAULT_BLOCK_SIZE,
            kv_type,
        )
    }

    /// A cache of `layout` on `backend`: `n_slots` sequences of up to `n_ctx` tokens each,
    /// sharing a pool of `n_blocks` KV blocks of `block_size` positions (`n_blocks *
    /// block_size` may be less than `n_slots * n_ctx`: [`KvCache::prepare`] then reports
    /// [`CacheError::OutOfBlocks`] when the pool runs dry, and the caller frees some).
    /// Recurrent states are allocated for every slot up front.
    pub fn new(
        backend: Arc<dyn Backend>,
        layout: &CacheLayout,
        n_slots: usize,
        n_ctx: usize,
        n_blocks: usize,
        block_size: usize,
        kv_type: KvType,
    ) -> Result<KvCache> {
        let kv_dim = layout.n_head_kv * layout.head_dim;
        if block_size == 0 {
            return Err(CacheError::Config("KV block size must be >= 1".into()));
        }
        if kv_type == KvType::Q8_0
            && layout.n_attention_layers() > 0
            && !layout.head_dim.is_multiple_of(Q8_0_BLOCK)
        {
            return Err(CacheError::Config(format!(
                "a q8_0 KV cache needs a head size that is a multiple of 32 (this model's is {})",
                layout.head_dim
            )));
        }
        if n_blocks > u32::MAX as usize {
            return Err(CacheError::Config(format!(
                "{n_blocks} KV blocks is too many"
            )));
        }
        let per = n_blocks
            .checked_mul(block_size)
            .and_then(|x| x.checked_mul(kv_dim))
            .ok_or_else(|| {
                CacheError::Config(format!(
                    "KV pool of {n_blocks} blocks x {block_size} tokens is too large"
                ))
            })?;
        let too_large =
            || CacheError::Config(format!("recurrent state for {n_slots} slots is too large"));
        let be = &*backend;
        let layers = layout
            .layers
            .iter()
            .map(|k| match k {
                LayerKind::Attention => Ok(LayerCache::Kv(LayerKv {
                    k: be.alloc(kv_type.dtype(), per)?,
                    v: be.alloc(kv_type.dtype(), per)?,
                })),
                LayerKind::Recurrent(shape) => Ok(LayerCache::Rec(LayerRec {
                    shape: *shape,
                    conv: be.alloc(
                        DType::F32,
                        n_slots
                            .checked_mul(shape.conv_len())
                            .ok_or_else(too_large)?,
                    )?,
                    state: be.alloc(
                        DType::F32,
                        n_slots.checked_mul(shape.state_len).ok_or_else(too_large)?,
                    )?,
                })),
                LayerKind::Stateless => Ok(LayerCache::None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            backend,
            n_slots,
            n_ctx,
            kv_dim,
            kv_type,
            block_size,
            n_blocks,
            layers,
            tables: vec![Vec::new(); n_slots],
            refs: vec![0; n_blocks],
            free: (0..n_blocks as u32).rev().collect(),
            rec_pos: vec![0; n_slots],
        })
    }

    /// An id no other cache of this process has: a model that recorded steps against this
    /// cache's storage (device addresses) checks it before replaying them.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The backend the storage lives on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Number of sequence slots.
    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// Most tokens one slot can hold.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Element type.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// Positions per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Values of one cached position of one attention layer (`n_head_kv * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// KV blocks in the pool.
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    /// KV blocks not held by any slot.
    pub fn n_free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Whether the model has attention layers (only then do blocks matter).
    pub fn has_kv(&self) -> bool {
        self.layers.iter().any(|l| matches!(l, LayerCache::Kv(_)))
    }

    /// Bytes of one KV block over all attention layers (K and V).
    pub fn block_bytes(&self) -> usize {
        let n_kv = self
            .layers
            .iter()
            .filter(|l| matches!(l, LayerCache::Kv(_)))
            .count();
        2 * n_kv * self.block_size * self.kv_type.row_bytes(self.kv_dim)
    }

    /// Bytes of the recurrent states of one slot.
    pub fn slot_state_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Rec(r) => r.shape.bytes(),
                _ => 0,
            })
            .sum()
    }

    /// Bytes held by the cache.
    pub fn size_bytes(&self) -> usize {
        self.n_blocks * self.block_bytes() + self.n_slots * self.slot_state_bytes()
    }

    /// Blocks in `slot`'s table.
    pub fn slot_blocks(&self, slot: usize) -> usize {
        self.tables.get(slot).map_or(0, Vec::len)
    }

    /// Free blocks [`KvCache::prepare`]`(slot, pos0, n)` would take: blocks for positions
    /// past the table's end, plus copies of shared blocks in `pos0..pos0 + n`.
    pub fn blocks_needed(&self, slot: usize, pos0: usize, n: usize) -> usize {
        if !self.has_kv() || n == 0 {
            return 0;
        }
        let Some(t) = self.tables.get(slot) else {
            return 0;
        };
        let bs = self.block_size;
        let want = (pos0 + n).div_ceil(bs);
        let grow = want.saturating_sub(t.len());
        let cow = (pos0 / bs..want.min(t.len()))
            .filter(|&b| self.refs[t[b] as usize] > 1)
            .count();
        grow + cow
    }

    /// Make `slot` ready for writing positions `pos0..pos0 + n`: its table covers positions
    /// `0..pos0 + n` (new blocks from the free list) and every block in the written range is
    /// its own (shared ones are copied first, on the device). Nothing changes on a checked
    /// error: [`CacheError::ContextFull`] past `n_ctx`, [`CacheError::OutOfBlocks`] when the
    /// free list is too short. A device error while copying leaves the table consistent
    /// (the block keeps being shared) and is returned.
    pub fn prepare(&mut self, slot: usize, pos0: usize, n: usize) -> Result<()> {
        if slot >= self.n_slots {
            return Err(CacheError::Batch(format!("slot {slot} out of range")));
        }
        if n == 0 {
            return Ok(());
        }
        if pos0 + n > self.n_ctx {
            return Err(CacheError::ContextFull {
                pos: pos0 + n - 1,
                n_ctx: self.n_ctx,
            });
        }
        if !self.has_kv() {
            return Ok(());
        }
        let needed = self.blocks_needed(slot, pos0, n);
        if needed > self.free.len() {
            return Err(CacheError::OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        let bs = self.block_size;
        let want = (pos0 + n).div_ceil(bs);
        for b in pos0 / bs..want.min(self.tables[slot].len()) {
            let old = self.tables[slot][b];
            if self.refs[old as usize] > 1 {
                let new = self.take_block();
                if let Err(e) = self.copy_block(old, new) {
                    self.drop_block(new);
                    return Err(e);
                }
                self.refs[old as usize] -= 1;
                self.tables[slot][b] = new;
            }
        }
        while self.tables[slot].len() < want {
            let new = self.take_block();
            self.tables[slot].push(new);
        }
        Ok(())
    }

    /// Whether `slot` may be written at positions `pos0..pos0 + n`: inside the context, its
    /// table covers them and the blocks holding them are its own ([`KvCache::prepare`] makes
    /// this so). Models check it before writing K and V.
    pub fn check_writable(&self, slot: usize, pos0: usize, n: usize) -> Result<()> {
        if pos0 + n > self.n_ctx {
            return Err(CacheError::ContextFull {
                pos: (pos0 + n).saturating_sub(1),
                n_ctx: self.n_ctx,
            });
        }
        let table = self
            .tables
            .get(slot)
            .ok_or_else(|| CacheError::Batch(format!("slot {slot} out of range")))?;
        let bs = self.block_size;
        if n == 0 || !self.has_kv() {
            return Ok(());
        }
        if table.len() * bs < pos0 + n {
            return Err(CacheError::Batch(format!(
                "slot {slot}: positions {pos0}..{} were not prepared",
                pos0 + n
            )));
        }
        if let Some(&b) = table[pos0 / bs..(pos0 + n).div_ceil(bs)]
            .iter()
            .find(|&&b| self.refs[b as usize] != 1)
        {
            return Err(CacheError::Batch(format!(
                "slot {slot}: block {b} is shared and cannot be written (prepare first)"
            )));
        }
        Ok(())
    }

    /// Pop a free block (the caller checked there is one) with reference count 1.
    fn take_block(&mut self) -> u32 {
        // Callers check `blocks_needed <= free.len()` first; an empty list here would be a
        // bookkeeping bug, and block 0 keeps the cache usable in release builds.
        debug_assert!(!self.free.is_empty());
        let b = self.free.pop().unwrap_or(0);
        self.refs[b as usize] += 1;
        b
    }

    fn copy_block(&mut self, from: u32, to: u32) -> Result<()> {
        let len = self.block_size * self.kv_dim;
        let (src, dst) = (from as usize * len, to as usize * len);
        for l in &mut self.layers {
            if let LayerCache::Kv(kv) = l {
                self.backend.copy_within(&mut kv.k, src, dst, len)?;
                self.backend.copy_within(&mut kv.v, src, dst, len)?;
            }
        }
        Ok(())
    }

    fn drop_block(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0);
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.free.push(b);
        }
    }

    /// Keep only the blocks of `slot` that hold positions `0..n`; the others go back to the
    /// pool (when no other slot shares them). Recurrent states are not touched.
    pub fn truncate(&mut self, slot: usize, n: usize) {
        let Some(t) = self.tables.get_mut(slot) else {
            return;
        };
        let keep = n.div_ceil(self.block_size);
        if t.len() <= keep {
            return;
        }
        let gone: Vec<u32> = t.drain(keep..).collect();
        for b in gone {
            self.drop_block(b);
        }
    }

    /// Give back every block of `slot` and mark its recurrent states unusable: the slot
    /// holds nothing.
    pub fn release(&mut self, slot: usize) {
        self.truncate(slot, 0);
        if let Some(p) = self.rec_pos.get_mut(slot) {
            *p = if self.layers.iter().any(|l| matches!(l, LayerCache::Rec(_))) {
                REC_INVALID
            } else {
                0
            };
        }
    }

    /// Block ids of `slot`, in position order.
    pub fn table(&self, slot: usize) -> &[u32] {
        self.tables.get(slot).map_or(&[], Vec::as_slice)
    }

    /// How many holders a block has (slot tables plus [`KvCache::retain_block`] calls).
    pub fn block_refs(&self, block: u32) -> u32 {
        self.refs.get(block as usize).copied().unwrap_or(0)
    }

    /// Add a holder to a block in use (a prefix cache keeping it after its slot lets go).
    pub fn retain_block(&mut self, block: u32) {
        if let Some(r) = self.refs.get_mut(block as usize).filter(|r| **r > 0) {
            *r += 1;
        }
    }

    /// Remove a holder from a block; the block is free when none is left.
    pub fn release_block(&mut self, block: u32) {
        if self.refs.get(block as usize).is_some_and(|&r| r > 0) {
            self.drop_block(block);
        }
    }

    /// Take a free block for the caller (one holder: the caller), or `None` when none is free.
    pub fn alloc_block(&mut self) -> Option<u32> {
        if self.free.is_empty() {
            return None;
        }
        Some(self.take_block())
    }

    /// Make `slot` hold `blocks` (in position order) by reference: its own blocks go back
    /// first. The recurrent states are not touched.
    pub fn adopt(&mut self, slot: usize, blocks: &[u32]) -> Result<()> {
        if slot >= self.n_slots {
            return Err(CacheError::Batch(format!("slot {slot} out of range")));
        }
        if let Some(&b) = blocks.iter().find(|&&b| self.block_refs(b) == 0) {
            return Err(CacheError::Batch(format!("block {b} is not in use")));
        }
        self.truncate(slot, 0);
        for &b in blocks {
            self.refs[b as usize] += 1;
        }
        self.tables[slot] = blocks.to_vec();
        Ok(())
    }

    /// Bytes of the first `rows` positions of a block over every attention layer (K then V
    /// per layer, each `[rows, kv_dim]` in the cache's element format, copied from the
    /// device): what [`KvCache::import_block`] takes back.
    pub fn export_block(&self, block: u32, rows: usize) -> Result<Vec<u8>> {
        let (bs, kv_dim) = (self.block_size, self.kv_dim);
        if block as usize >= self.n_blocks {
            return Err(CacheError::Batch(format!("block {block} out of range")));
        }
        let rows = rows.min(bs);
        let at = block as usize * bs * kv_dim;
        let mut out = Vec::new();
        for l in &self.layers {
            if let LayerCache::Kv(kv) = l {
                for b in [&kv.k, &kv.v] {
                    out.extend(self.backend.read_bytes(b, at, rows * kv_dim)?);
                }
            }
        }
        Ok(out)
    }

    /// Fill the first `rows` positions of a block from [`KvCache::export_block`] bytes of a
    /// cache with the same layout.
    pub fn import_block(&mut self, block: u32, rows: usize, bytes: &[u8]) -> Result<()> {
        let (bs, kv_dim) = (self.block_size, self.kv_dim);
        if block as usize >= self.n_blocks || rows > bs {
            return Err(CacheError::Batch(format!(
                "block {block} / {rows} rows out of range"
            )));
        }
        let at = block as usize * bs * kv_dim;
        let per = self.kv_type.row_bytes(rows * kv_dim);
        let n_kv = self
            .layers
            .iter()
            .filter(|l| matches!(l, LayerCache::Kv(_)))
            .count();
        let want = 2 * n_kv * per;
        if bytes.len() != want {
            return Err(CacheError::Batch(format!(
                "block data has {} bytes, this cache layout needs {want}",
                bytes.len()
            )));
        }
        let mut rest = bytes;
        for l in &mut self.layers {
            if let LayerCache::Kv(kv) = l {
                for b in [&mut kv.k, &mut kv.v] {
                    self.backend.write_bytes(b, at, &rest[..per])?;
                    rest = &rest[per..];
                }
            }
        }
        Ok(())
    }

    /// Make `to` hold positions `0..n` of `from` (prefix sharing): `to` gives back its blocks
    /// and takes `from`'s first blocks by reference, no copy (the first write into a shared
    /// block copies it). Recurrent states are copied when `from`'s hold exactly `n` tokens;
    /// otherwise `to`'s are marked unusable.
    pub fn share_prefix(&mut self, from: usize, to: usize, n: usize) -> Result<()> {
        if from >= self.n_slots || to >= self.n_slots {
            return Err(CacheError::Batch(format!(
                "slot {} out of range",
                from.max(to)
            )));
        }
        if from == to {
            return Ok(());
        }
        if self.has_recurrent() {
            match self.save_recurrent(from).filter(|s| s.pos == n) {
                Some(snap) => self.restore_recurrent(to, &snap)?,
                None => self.rec_pos[to] = REC_INVALID,
            }
        }
        self.truncate(to, 0);
        let nb = n.div_ceil(self.block_size).min(self.tables[from].len());
        let shared: Vec<u32> = self.tables[from][..nb].to_vec();
        for &b in &shared {
            self.refs[b as usize] += 1;
        }
        self.tables[to] = shared;
        Ok(())
    }

    /// Whether any layer keeps recurrent state (such a cache cannot be rewound).
    pub fn has_recurrent(&self) -> bool {
        self.layers.iter().any(|l| matches!(l, LayerCache::Rec(_)))
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
            return Err(CacheError::Batch(format!("slot {slot} out of range")));
        }
        if !self.has_recurrent() {
            return Ok(());
        }
        if pos0 == 0 {
            self.rec_pos[slot] = REC_INVALID;
            for l in &mut self.layers {
                if let LayerCache::Rec(r) = l {
                    let (c, s) = (r.shape.conv_len(), r.shape.state_len);
                    self.backend
                        .write_f32(&mut r.conv, slot * c, &vec![0.0; c])?;
                    self.backend
                        .write_f32(&mut r.state, slot * s, &vec![0.0; s])?;
                }
            }
        } else if self.rec_pos[slot] != pos0 {
            return Err(CacheError::Batch(match self.recurrent_pos(slot) {
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

    /// The K and V block tensors of attention layer `layer` (`[n_blocks, block_size,
    /// kv_dim]` of the cache type, on the backend's device).
    pub fn kv_tensors(&self, layer: usize) -> Result<(&Tensor, &Tensor)> {
        match self.layers.get(layer) {
            Some(LayerCache::Kv(l)) => Ok((&l.k, &l.v)),
            _ => Err(CacheError::Batch(format!("layer {layer} has no KV cache"))),
        }
    }

    /// [`KvCache::kv_tensors`], mutable (for writing new rows).
    pub fn kv_tensors_mut(&mut self, layer: usize) -> Result<(&mut Tensor, &mut Tensor)> {
        match self.layers.get_mut(layer) {
            Some(LayerCache::Kv(l)) => Ok((&mut l.k, &mut l.v)),
            _ => Err(CacheError::Batch(format!("layer {layer} has no KV cache"))),
        }
    }

    /// The conv windows `[n_slots, conv_len]` and recurrent states `[n_slots, state_len]`
    /// (f32, on the backend's device) of recurrent layer `layer`, mutable.
    pub fn recurrent_tensors_mut(&mut self, layer: usize) -> Result<(&mut Tensor, &mut Tensor)> {
        match self.layers.get_mut(layer) {
            Some(LayerCache::Rec(r)) => Ok((&mut r.conv, &mut r.state)),
            _ => Err(CacheError::Batch(format!(
                "layer {layer} has no recurrent state"
            ))),
        }
    }

    /// Copy of the recurrent states of `slot` in host memory (to resume from later with
    /// [`KvCache::restore_recurrent`]), or `None` when they are unusable or could not be
    /// read from the device (a cache then simply has no checkpoint there).
    pub fn save_recurrent(&self, slot: usize) -> Option<RecurrentSnapshot> {
        let pos = self.recurrent_pos(slot)?;
        let mut layers = Vec::new();
        for l in &self.layers {
            if let LayerCache::Rec(r) = l {
                let (c, s) = (r.shape.conv_len(), r.shape.state_len);
                let mut conv = vec![0f32; c];
                let mut state = vec![0f32; s];
                self.backend.read_f32(&r.conv, slot * c, &mut conv).ok()?;
                self.backend.read_f32(&r.state, slot * s, &mut state).ok()?;
                layers.push((conv, state));
            }
        }
        Some(RecurrentSnapshot { pos, layers })
    }

    /// Put a snapshot back into `slot` (any slot of a cache for the same model). The caller
    /// must also make the KV rows `0..snap.pos` of that slot valid (they are not part of the
    /// snapshot).
    pub fn restore_recurrent(&mut self, slot: usize, snap: &RecurrentSnapshot) -> Result<()> {
        if slot >= self.n_slots {
            return Err(CacheError::Batch(format!("slot {slot} out of range")));
        }
        let fits = {
            let mut it = snap.layers.iter();
            let ok = self.layers.iter().all(|l| match l {
                LayerCache::Rec(r) => it.next().is_some_and(|(a, b)| {
                    a.len() == r.shape.conv_len() && b.len() == r.shape.state_len
                }),
                _ => true,
            });
            ok && it.next().is_none()
        };
        if !fits {
            return Err(CacheError::Batch(
                "recurrent snapshot does not fit this cache".into(),
            ));
        }
        self.rec_pos[slot] = REC_INVALID;
        let mut it = snap.layers.iter();
        for l in &mut self.layers {
            let LayerCache::Rec(r) = l else { continue };
            if let Some((sc, ss)) = it.next() {
                let (c, s) = (r.shape.conv_len(), r.shape.state_len);
                self.backend.write_f32(&mut r.conv, slot * c, sc)?;
                self.backend.write_f32(&mut r.state, slot * s, ss)?;
            }
        }
        self.rec_pos[slot] = snap.pos;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kapitsa_backend_cpu::CpuBackend;

    fn backend() -> Arc<dyn Backend> {
        Arc::new(CpuBackend::new(Box::new(kapitsa_base::pool::SerialPool)))
    }

    fn layout(recurrent: bool) -> CacheLayout {
        let mut layers = vec![
            LayerKind::Attention,
            LayerKind::Stateless,
            LayerKind::Attention,
        ];
        if recurrent {
            layers.push(LayerKind::Recurrent(RecurrentShape {
                conv_channels: 3,
                conv_kernel: 4,
                state_len: 5,
            }));
        }
        CacheLayout {
            layers,
            n_head_kv: 1,
            head_dim: 2,
        }
    }

    fn cache(recurrent: bool, slots: usize, n_ctx: usize, blocks: usize, bs: usize) -> KvCache {
        KvCache::new(
            backend(),
            &layout(recurrent),
            slots,
            n_ctx,
            blocks,
            bs,
            KvType::F32,
        )
        .unwrap()
    }

    /// Element offset of position `p` of `slot` in a layer's block tensor.
    fn row_at(c: &KvCache, slot: usize, p: usize) -> usize {
        let bs = c.block_size();
        (c.table(slot)[p / bs] as usize * bs + p % bs) * c.kv_dim()
    }

    /// Rows `0..n` of layer 0 of `slot`, K only.
    fn read_k(c: &KvCache, slot: usize, n: usize) -> Vec<f32> {
        let (k, _) = c.kv_tensors(0).unwrap();
        let mut out = vec![0f32; n * 2];
        for p in 0..n {
            c.backend()
                .read_f32(k, row_at(c, slot, p), &mut out[p * 2..p * 2 + 2])
                .unwrap();
        }
        out
    }

    /// Prepare and write K = V = `vals` (rows of 2) at `pos0..` of `slot` in both layers.
    fn write_rows(c: &mut KvCache, slot: usize, pos0: usize, vals: &[f32]) {
        let n = vals.len() / 2;
        c.prepare(slot, pos0, n).unwrap();
        c.check_writable(slot, pos0, n).unwrap();
        let be = c.backend().clone();
        let at: Vec<usize> = (0..n).map(|i| row_at(c, slot, pos0 + i)).collect();
        for layer in [0, 2] {
            let (k, v) = c.kv_tensors_mut(layer).unwrap();
            for (i, &a) in at.iter().enumerate() {
                be.write_f32(k, a, &vals[i * 2..i * 2 + 2]).unwrap();
                be.write_f32(v, a, &vals[i * 2..i * 2 + 2]).unwrap();
            }
        }
    }

    fn total_refs(c: &KvCache) -> usize {
        c.refs.iter().map(|&r| r as usize).sum()
    }

    #[test]
    fn blocks_are_taken_on_demand_and_returned() {
        let mut c = cache(false, 3, 20, 6, 4);
        assert_eq!((c.n_blocks(), c.n_free_blocks()), (6, 6));
        assert_eq!(c.block_bytes(), 2 * 2 * 4 * 2 * 4);
        let v: Vec<f32> = (0..2 * 9).map(|x| x as f32).collect();
        write_rows(&mut c, 0, 0, &v);
        assert_eq!((c.slot_blocks(0), c.n_free_blocks()), (3, 3));
        assert_eq!(read_k(&c, 0, 9), v);
        // Growing by one row inside the last block takes nothing.
        assert_eq!(c.blocks_needed(0, 9, 3), 0);
        write_rows(&mut c, 0, 9, &[100.0, 101.0, 102.0, 103.0, 104.0, 105.0]);
        assert_eq!(c.n_free_blocks(), 3);
        // Out of blocks: nothing changes.
        let err = c.prepare(1, 0, 16).unwrap_err();
        assert!(
            matches!(err, CacheError::OutOfBlocks { needed: 4, free: 3 }),
            "{err}"
        );
        assert_eq!((c.slot_blocks(1), c.n_free_blocks()), (0, 3));
        // Past n_ctx.
        assert!(matches!(
            c.prepare(1, 18, 3),
            Err(CacheError::ContextFull { .. })
        ));
        c.truncate(0, 5);
        assert_eq!((c.slot_blocks(0), c.n_free_blocks()), (2, 4));
        assert_eq!(read_k(&c, 0, 5), v[..10]);
        c.release(0);
        assert_eq!(c.n_free_blocks(), 6);
        assert_eq!(total_refs(&c), 0);
        // Writing unprepared positions is refused.
        assert!(c.check_writable(2, 0, 1).is_err());
        assert!(c.kv_tensors(1).is_err());
    }

    #[test]
    fn shared_prefix_is_copied_on_write() {
        let mut c = cache(false, 2, 32, 8, 4);
        let v: Vec<f32> = (0..2 * 6).map(|x| x as f32).collect();
        write_rows(&mut c, 0, 0, &v);
        c.share_prefix(0, 1, 6).unwrap();
        // Two blocks, held by both slots; neither may write there before preparing.
        assert_eq!((c.slot_blocks(1), c.n_free_blocks()), (2, 6));
        assert!(c.check_writable(1, 5, 1).is_err());
        assert_eq!(read_k(&c, 1, 6), v);
        // Slot 1 diverges inside the second block: that block is copied, the first stays
        // shared.
        assert_eq!(c.blocks_needed(1, 5, 2), 1);
        write_rows(&mut c, 1, 5, &[-1.0, -2.0, -3.0, -4.0]);
        assert_eq!(c.n_free_blocks(), 5);
        assert_eq!(read_k(&c, 0, 6), v, "the owner's rows are untouched");
        let mut want1 = v[..10].to_vec();
        want1.extend([-1.0, -2.0, -3.0, -4.0]);
        assert_eq!(read_k(&c, 1, 7), want1);
        // The owner writes into its (now private) second block without a copy.
        assert_eq!(c.blocks_needed(0, 6, 1), 0);
        // The first block is shared: writing there copies it.
        assert_eq!(c.blocks_needed(0, 0, 1), 1);
        c.release(0);
        assert_eq!(
            read_k(&c, 1, 7),
            want1,
            "releasing the owner keeps shared blocks"
        );
        c.release(1);
        assert_eq!((c.n_free_blocks(), total_refs(&c)), (8, 0));
    }

    #[test]
    fn share_prefix_copies_recurrent_state_only_at_its_end() {
        let mut c = cache(true, 2, 32, 8, 4);
        let be = c.backend().clone();
        c.begin_recurrent(0, 0).unwrap();
        let (_, st) = c.recurrent_tensors_mut(3).unwrap();
        be.write_f32(st, 0, &[7.0; 5]).unwrap();
        c.end_recurrent(0, 6);
        c.share_prefix(0, 1, 6).unwrap();
        assert_eq!(c.recurrent_pos(1), Some(6));
        let snap = c.save_recurrent(1).unwrap();
        assert_eq!(snap.layers, vec![(vec![0.0; 9], vec![7.0; 5])]);
        c.share_prefix(0, 1, 5).unwrap();
        assert_eq!(c.recurrent_pos(1), None);
        c.release(0);
        assert_eq!(c.recurrent_pos(0), None);
        assert_eq!(c.slot_state_bytes(), 4 * (9 + 5));
        // Starting over at position 0 clears the states.
        c.begin_recurrent(1, 0).unwrap();
        c.end_recurrent(1, 0);
        let snap = c.save_recurrent(1).unwrap();
        assert_eq!(snap.layers, vec![(vec![0.0; 9], vec![0.0; 5])]);
        // A snapshot of another shape is refused and changes nothing.
        let bad = RecurrentSnapshot {
            pos: 3,
            layers: vec![(vec![0.0; 9], vec![0.0; 4])],
        };
        assert!(c.restore_recurrent(1, &bad).is_err());
        assert_eq!(c.recurrent_pos(1), Some(0));
    }

    #[test]
    fn blocks_export_and_import_as_bytes() {
        let mut a = cache(false, 1, 32, 4, 4);
        let v: Vec<f32> = (0..2 * 6).map(|x| x as f32 * 0.5).collect();
        write_rows(&mut a, 0, 0, &v);
        let mut b = cache(false, 1, 32, 4, 4);
        let mut blocks = Vec::new();
        for (i, &blk) in a.table(0).to_vec().iter().enumerate() {
            let rows = (6 - 4 * i).min(4);
            let bytes = a.export_block(blk, rows).unwrap();
            // 2 layers x (K + V) x rows x 2 f32.
            assert_eq!(bytes.len(), 2 * 2 * rows * 8);
            let nb = b.alloc_block().unwrap();
            assert!(b.import_block(nb, rows, &bytes[1..]).is_err());
            b.import_block(nb, rows, &bytes).unwrap();
            blocks.push(nb);
        }
        b.adopt(0, &blocks).unwrap();
        assert_eq!(read_k(&b, 0, 6), v);
    }

    #[test]
    fn q8_0_needs_head_dim_multiple_of_32() {
        let err = KvCache::new(backend(), &layout(false), 1, 8, 2, 4, KvType::Q8_0).unwrap_err();
        assert!(
            matches!(&err, CacheError::Config(m) if m.contains("multiple of 32")),
            "{err}"
        );
        let q8 = CacheLayout {
            n_head_kv: 2,
            head_dim: 32,
            ..layout(false)
        };
        let c = KvCache::new(backend(), &q8, 2, 40, 8, 4, KvType::Q8_0).unwrap();
        // 2 layers x (K + V) x 4 rows x (2 blocks of 34 bytes).
        assert_eq!(c.block_bytes(), 2 * 2 * 4 * 68);
        for t in [KvType::F16, KvType::F32, KvType::Q8_0] {
            assert_eq!(t.name().parse::<KvType>(), Ok(t));
        }
        assert!("q8".parse::<KvType>().is_err());
    }
}
