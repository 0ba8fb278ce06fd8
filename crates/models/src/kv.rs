//! The per-sequence cache of a model, owned by the caller and borrowed by `forward`, laid out
//! from the model's layer kinds ([`crate::ModelSpec::layers`]).
//!
//! - Attention layers: **paged** K and V. Each layer has a pool of `n_blocks` blocks of
//!   `block_size` positions, `[n_blocks, block_size, n_head_kv * head_dim]` per buffer (block,
//!   then position in block, then head, then dim). A block id means the same block in every
//!   attention layer. Each sequence slot has a block table; position `p` of its tokens is row
//!   `p % block_size` of block `table[p / block_size]`. Blocks are taken from a free list when
//!   a chunk is about to be written ([`KvCache::prepare`], called by `forward`; an engine calls
//!   it earlier to know whether memory suffices) and go back when a slot is truncated or
//!   released. Blocks are reference-counted: [`KvCache::share_prefix`] lets a slot use another
//!   slot's prefix blocks without copying, and a shared block is copied before it is written
//!   (copy on write), so a slot never sees another slot's writes.
//! - Recurrent layers: per slot, an f32 conv window `[conv_kernel - 1, conv_channels]` (oldest
//!   row first) and an f32 recurrent state of `state_len` values. A recurrent state summarises
//!   every token before it, so it can only be extended, never rewound: the cache records how
//!   many tokens each slot's states hold ([`KvCache::recurrent_pos`]); a batch chunk must start
//!   exactly there, or at position 0 (which resets the states). Snapshots
//!   ([`KvCache::save_recurrent`]) let a caller go back to an earlier point.

use half::f16;
use kapitsa_base::GgmlType;
use kapitsa_kernels_cpu::attention::{KvSlice, KvView, Q8_0_BLOCK, Q8_0_BYTES};
use kapitsa_kernels_cpu::quantize_row;

use crate::{CausalLm, LayerKind, ModelError, ModelSpec, RecurrentShape, Result};

/// Positions per KV block unless the caller chooses ([`KvCache::for_model`]).
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
        match self {
            KvType::F32 => 4 * n,
            KvType::F16 => 2 * n,
            KvType::Q8_0 => n.div_ceil(Q8_0_BLOCK) * Q8_0_BYTES,
        }
    }

    /// The name the CLI uses (`f16`, `f32`, `q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
            KvType::Q8_0 => "q8_0",
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

/// Byte offset of element `i` (a multiple of 32) in Q8_0 storage.
fn q8_off(i: usize) -> usize {
    i / Q8_0_BLOCK * Q8_0_BYTES
}

/// Element storage of one layer's K or V pool, `[n_blocks, block_size, kv_dim]`, addressed
/// by element index in every variant. `Q8_0` holds bytes: element `i` (a multiple of 32)
/// starts block `i / 32` at byte `(i / 32) * 34` (layout in [`KvSlice::Q8_0`]); every range
/// the cache touches is whole rows, so it starts and ends on block boundaries.
#[derive(Debug)]
enum Buf {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Q8_0(Vec<u8>),
}

impl Buf {
    fn new(t: KvType, n: usize) -> Buf {
        match t {
            KvType::F32 => Buf::F32(vec![0.0; n]),
            KvType::F16 => Buf::F16(vec![f16::ZERO; n]),
            // All-zero bytes: scale 0, quants 0, i.e. zeros.
            KvType::Q8_0 => Buf::Q8_0(vec![0; t.row_bytes(n)]),
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
            Buf::Q8_0(b) => {
                debug_assert!(at.is_multiple_of(Q8_0_BLOCK) && x.len().is_multiple_of(Q8_0_BLOCK));
                let dst = &mut b[q8_off(at)..q8_off(at + x.len())];
                // Cannot fail: Q8_0 is a type `quantize_row` supports, and `dst` holds exactly
                // the bytes of `x.len()` elements (`x` is whole rows of `kv_dim` values, a
                // multiple of 32 as checked when the cache was made).
                quantize_row(GgmlType::Q8_0, x, dst).expect("Q8_0 rows of whole blocks");
            }
        }
    }

    fn copy_within(&mut self, src: std::ops::Range<usize>, dst: usize) {
        match self {
            Buf::F32(b) => b.copy_within(src, dst),
            Buf::F16(b) => b.copy_within(src, dst),
            Buf::Q8_0(b) => b.copy_within(q8_off(src.start)..q8_off(src.end), q8_off(dst)),
        }
    }

    /// Bytes that elements `r` occupy.
    fn byte_len(&self, r: std::ops::Range<usize>) -> usize {
        match self {
            Buf::F32(_) => 4 * r.len(),
            Buf::F16(_) => 2 * r.len(),
            Buf::Q8_0(_) => q8_off(r.end) - q8_off(r.start),
        }
    }

    /// Append elements `r` as little-endian bytes.
    fn append_bytes(&self, r: std::ops::Range<usize>, out: &mut Vec<u8>) {
        match self {
            Buf::F32(b) => b[r].iter().for_each(|x| out.extend(x.to_le_bytes())),
            Buf::F16(b) => b[r]
                .iter()
                .for_each(|x| out.extend(x.to_bits().to_le_bytes())),
            Buf::Q8_0(b) => out.extend_from_slice(&b[q8_off(r.start)..q8_off(r.end)]),
        }
    }

    /// Set elements `r` from [`Buf::append_bytes`] bytes (`bytes.len() == byte_len(r)`).
    fn set_bytes(&mut self, r: std::ops::Range<usize>, bytes: &[u8]) {
        match self {
            Buf::F32(b) => {
                for (d, c) in b[r].iter_mut().zip(bytes.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Buf::F16(b) => {
                for (d, c) in b[r].iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            Buf::Q8_0(b) => b[q8_off(r.start)..q8_off(r.end)].copy_from_slice(bytes),
        }
    }

    fn all(&self) -> KvSlice<'_> {
        match self {
            Buf::F32(b) => KvSlice::F32(b),
            Buf::F16(b) => KvSlice::F16(b),
            Buf::Q8_0(b) => KvSlice::Q8_0(b),
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

/// Cache storage for every layer of one model: paged KV for attention layers, states for
/// recurrent layers (see the module docs).
#[derive(Debug)]
pub struct KvCache {
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

impl KvCache {
    /// A cache for `model` with `n_slots` sequences of up to `n_ctx` tokens each, with blocks
    /// of [`DEFAULT_BLOCK_SIZE`] positions and enough of them for every slot to be full at
    /// once (memory use as a contiguous cache; blocks are still handed out on demand).
    pub fn for_model(
        model: &dyn CausalLm,
        n_slots: usize,
        n_ctx: usize,
        kv_type: KvType,
    ) -> Result<KvCache> {
        let n_blocks = n_slots
            .checked_mul(n_ctx.div_ceil(DEFAULT_BLOCK_SIZE))
            .ok_or_else(|| {
                ModelError::Config(format!("cache of {n_slots} x {n_ctx} tokens is too large"))
            })?;
        KvCache::paged(model, n_slots, n_ctx, n_blocks, DEFAULT_BLOCK_SIZE, kv_type)
    }

    /// A cache for `model`: `n_slots` sequences of up to `n_ctx` tokens each, sharing a pool
    /// of `n_blocks` KV blocks of `block_size` positions (`n_blocks * block_size` may be less
    /// than `n_slots * n_ctx`: [`KvCache::prepare`] then reports
    /// [`ModelError::OutOfBlocks`] when the pool runs dry, and the caller frees some).
    /// Recurrent states are allocated for every slot up front.
    pub fn paged(
        model: &dyn CausalLm,
        n_slots: usize,
        n_ctx: usize,
        n_blocks: usize,
        block_size: usize,
        kv_type: KvType,
    ) -> Result<KvCache> {
        KvCache::with_spec(model.spec(), n_slots, n_ctx, n_blocks, block_size, kv_type)
    }

    /// [`KvCache::paged`] from the model's spec alone.
    pub fn with_spec(
        spec: &ModelSpec,
        n_slots: usize,
        n_ctx: usize,
        n_blocks: usize,
        block_size: usize,
        kv_type: KvType,
    ) -> Result<KvCache> {
        let kv_dim = spec.n_head_kv * spec.head_dim;
        if block_size == 0 {
            return Err(ModelError::Config("KV block size must be >= 1".into()));
        }
        if kv_type == KvType::Q8_0
            && spec.n_attention_layers() > 0
            && !spec.head_dim.is_multiple_of(Q8_0_BLOCK)
        {
            return Err(ModelError::Config(format!(
                "a q8_0 KV cache needs a head size that is a multiple of 32 (this model's is {})",
                spec.head_dim
            )));
        }
        if n_blocks > u32::MAX as usize {
            return Err(ModelError::Config(format!(
                "{n_blocks} KV blocks is too many"
            )));
        }
        let per = n_blocks
            .checked_mul(block_size)
            .and_then(|x| x.checked_mul(kv_dim))
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "KV pool of {n_blocks} blocks x {block_size} tokens is too large"
                ))
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
            block_size,
            n_blocks,
            layers,
            tables: vec![Vec::new(); n_slots],
            refs: vec![0; n_blocks],
            free: (0..n_blocks as u32).rev().collect(),
            rec_pos: vec![0; n_slots],
        })
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
                LayerCache::Rec(r) => 4 * (r.shape.conv_len() + r.shape.state_len),
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
    /// its own (shared ones are copied first). Nothing changes on error:
    /// [`ModelError::ContextFull`] past `n_ctx`, [`ModelError::OutOfBlocks`] when the free
    /// list is too short.
    pub fn prepare(&mut self, slot: usize, pos0: usize, n: usize) -> Result<()> {
        if slot >= self.n_slots {
            return Err(ModelError::Batch(format!("slot {slot} out of range")));
        }
        if n == 0 {
            return Ok(());
        }
        if pos0 + n > self.n_ctx {
            return Err(ModelError::ContextFull {
                pos: pos0 + n - 1,
                n_ctx: self.n_ctx,
            });
        }
        if !self.has_kv() {
            return Ok(());
        }
        let needed = self.blocks_needed(slot, pos0, n);
        if needed > self.free.len() {
            return Err(ModelError::OutOfBlocks {
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
                self.copy_block(old, new);
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

    /// Pop a free block (the caller checked there is one) with reference count 1.
    fn take_block(&mut self) -> u32 {
        // Callers check `blocks_needed <= free.len()` first; an empty list here would be a
        // bookkeeping bug, and block 0 keeps the cache usable in release builds.
        debug_assert!(!self.free.is_empty());
        let b = self.free.pop().unwrap_or(0);
        self.refs[b as usize] += 1;
        b
    }

    fn copy_block(&mut self, from: u32, to: u32) {
        let len = self.block_size * self.kv_dim;
        let (src, dst) = (from as usize * len, to as usize * len);
        for l in &mut self.layers {
            if let LayerCache::Kv(kv) = l {
                kv.k.copy_within(src..src + len, dst);
                kv.v.copy_within(src..src + len, dst);
            }
        }
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
            return Err(ModelError::Batch(format!("slot {slot} out of range")));
        }
        if let Some(&b) = blocks.iter().find(|&&b| self.block_refs(b) == 0) {
            return Err(ModelError::Batch(format!("block {b} is not in use")));
        }
        self.truncate(slot, 0);
        for &b in blocks {
            self.refs[b as usize] += 1;
        }
        self.tables[slot] = blocks.to_vec();
        Ok(())
    }

    /// Bytes of the first `rows` positions of a block over every attention layer (K then V
    /// per layer, each `[rows, kv_dim]` in the cache's element format): what
    /// [`KvCache::import_block`] takes back.
    pub fn export_block(&self, block: u32, rows: usize) -> Vec<u8> {
        let (bs, kv_dim) = (self.block_size, self.kv_dim);
        let rows = rows.min(bs);
        let at = block as usize * bs * kv_dim;
        let mut out = Vec::new();
        for l in &self.layers {
            if let LayerCache::Kv(kv) = l {
                for b in [&kv.k, &kv.v] {
                    b.append_bytes(at..at + rows * kv_dim, &mut out);
                }
            }
        }
        out
    }

    /// Fill the first `rows` positions of a block from [`KvCache::export_block`] bytes of a
    /// cache with the same layout.
    pub fn import_block(&mut self, block: u32, rows: usize, bytes: &[u8]) -> Result<()> {
        let (bs, kv_dim) = (self.block_size, self.kv_dim);
        if block as usize >= self.n_blocks || rows > bs {
            return Err(ModelError::Batch(format!(
                "block {block} / {rows} rows out of range"
            )));
        }
        let at = block as usize * bs * kv_dim;
        let want: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerCache::Kv(kv) => {
                    kv.k.byte_len(at..at + rows * kv_dim) + kv.v.byte_len(at..at + rows * kv_dim)
                }
                _ => 0,
            })
            .sum();
        if bytes.len() != want {
            return Err(ModelError::Batch(format!(
                "block data has {} bytes, this cache layout needs {want}",
                bytes.len()
            )));
        }
        let mut rest = bytes;
        for l in &mut self.layers {
            if let LayerCache::Kv(kv) = l {
                for b in [&mut kv.k, &mut kv.v] {
                    let n = b.byte_len(at..at + rows * kv_dim);
                    b.set_bytes(at..at + rows * kv_dim, &rest[..n]);
                    rest = &rest[n..];
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
            return Err(ModelError::Batch(format!(
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

    /// Store K and V rows (`[n, kv_dim]` each) for positions `pos0..pos0+n` of `slot`; the
    /// range must have been made ready with [`KvCache::prepare`].
    pub fn write(
        &mut self,
        layer: usize,
        slot: usize,
        pos0: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let (bs, kv_dim) = (self.block_size, self.kv_dim);
        let n = k.len() / kv_dim;
        if pos0 + n > self.n_ctx {
            return Err(ModelError::ContextFull {
                pos: pos0 + n - 1,
                n_ctx: self.n_ctx,
            });
        }
        let table = self
            .tables
            .get(slot)
            .ok_or_else(|| ModelError::Batch(format!("slot {slot} out of range")))?;
        if table.len() * bs < pos0 + n {
            return Err(ModelError::Batch(format!(
                "slot {slot}: positions {pos0}..{} were not prepared",
                pos0 + n
            )));
        }
        let Some(LayerCache::Kv(l)) = self.layers.get_mut(layer) else {
            return Err(ModelError::Batch(format!("layer {layer} has no KV cache")));
        };
        let mut i = 0;
        while i < n {
            let p = pos0 + i;
            let b = table[p / bs] as usize;
            debug_assert!(self.refs[b] == 1, "write into a shared block");
            let rows = (bs - p % bs).min(n - i);
            let at = (b * bs + p % bs) * kv_dim;
            l.k.write(at, &k[i * kv_dim..(i + rows) * kv_dim]);
            l.v.write(at, &v[i * kv_dim..(i + rows) * kv_dim]);
            i += rows;
        }
        Ok(())
    }

    /// K and V of `slot` for positions `0..n`.
    pub fn layer(&self, layer: usize, slot: usize, n: usize) -> Result<(KvView<'_>, KvView<'_>)> {
        if n > self.n_ctx {
            return Err(ModelError::ContextFull {
                pos: n - 1,
                n_ctx: self.n_ctx,
            });
        }
        let Some(LayerCache::Kv(l)) = self.layers.get(layer) else {
            return Err(ModelError::Batch(format!("layer {layer} has no KV cache")));
        };
        let table = self
            .tables
            .get(slot)
            .ok_or_else(|| ModelError::Batch(format!("slot {slot} out of range")))?;
        let nb = n.div_ceil(self.block_size);
        if table.len() < nb {
            return Err(ModelError::Batch(format!(
                "slot {slot} holds {} positions, {n} requested",
                table.len() * self.block_size
            )));
        }
        let (table, block_size) = (&table[..nb], self.block_size);
        Ok((
            KvView {
                data: l.k.all(),
                table,
                block_size,
            },
            KvView {
                data: l.v.all(),
                table,
                block_size,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(recurrent: bool) -> ModelSpec {
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
        ModelSpec {
            arch: "test".into(),
            n_vocab: 10,
            n_ctx_train: 1000,
            layers,
            n_head_kv: 1,
            head_dim: 2,
            n_mtp_layers: 0,
        }
    }

    /// Rows `0..n` of layer 0 of `slot`, K only, as f32 values.
    fn read_k(c: &KvCache, slot: usize, n: usize) -> Vec<f32> {
        let (k, _) = c.layer(0, slot, n).unwrap();
        let KvSlice::F32(d) = k.data else {
            panic!("f32 cache")
        };
        (0..n)
            .flat_map(|p| {
                let row = k.table[p / k.block_size] as usize * k.block_size + p % k.block_size;
                d[row * 2..row * 2 + 2].to_vec()
            })
            .collect()
    }

    fn write_rows(c: &mut KvCache, slot: usize, pos0: usize, vals: &[f32]) {
        let n = vals.len() / 2;
        c.prepare(slot, pos0, n).unwrap();
        for layer in [0, 2] {
            c.write(layer, slot, pos0, vals, vals).unwrap();
        }
    }

    fn total_refs(c: &KvCache) -> usize {
        c.refs.iter().map(|&r| r as usize).sum()
    }

    #[test]
    fn blocks_are_taken_on_demand_and_returned() {
        let mut c = KvCache::with_spec(&spec(false), 3, 20, 6, 4, KvType::F32).unwrap();
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
            matches!(err, ModelError::OutOfBlocks { needed: 4, free: 3 }),
            "{err}"
        );
        assert_eq!((c.slot_blocks(1), c.n_free_blocks()), (0, 3));
        // Past n_ctx.
        assert!(matches!(
            c.prepare(1, 18, 3),
            Err(ModelError::ContextFull { .. })
        ));
        c.truncate(0, 5);
        assert_eq!((c.slot_blocks(0), c.n_free_blocks()), (2, 4));
        assert_eq!(read_k(&c, 0, 5), v[..10]);
        c.release(0);
        assert_eq!(c.n_free_blocks(), 6);
        assert_eq!(total_refs(&c), 0);
        // Writing unprepared positions is an error, not a panic.
        assert!(c.write(0, 2, 0, &[1.0, 2.0], &[1.0, 2.0]).is_err());
        assert!(c.layer(0, 2, 1).is_err());
    }

    #[test]
    fn shared_prefix_is_copied_on_write() {
        let mut c = KvCache::with_spec(&spec(false), 2, 32, 8, 4, KvType::F32).unwrap();
        let v: Vec<f32> = (0..2 * 6).map(|x| x as f32).collect();
        write_rows(&mut c, 0, 0, &v);
        c.share_prefix(0, 1, 6).unwrap();
        // Two blocks, held by both slots.
        assert_eq!((c.slot_blocks(1), c.n_free_blocks()), (2, 6));
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
        let mut c = KvCache::with_spec(&spec(true), 2, 32, 8, 4, KvType::F32).unwrap();
        c.begin_recurrent(0, 0).unwrap();
        c.recurrent_mut(3, 0).unwrap().1.fill(7.0);
        c.end_recurrent(0, 6);
        c.share_prefix(0, 1, 6).unwrap();
        assert_eq!(c.recurrent_pos(1), Some(6));
        assert_eq!(c.recurrent_mut(3, 1).unwrap().1, &[7.0; 5]);
        c.share_prefix(0, 1, 5).unwrap();
        assert_eq!(c.recurrent_pos(1), None);
        c.release(0);
        assert_eq!(c.recurrent_pos(0), None);
        assert_eq!(c.slot_state_bytes(), 4 * (9 + 5));
    }

    /// Two attention layers of 2 KV heads x 32 dims (one Q8_0 block per head).
    fn spec_q8() -> ModelSpec {
        ModelSpec {
            n_head_kv: 2,
            head_dim: 32,
            ..spec(false)
        }
    }

    /// Rows `0..n` of K and V of layer `layer` of `slot`, `[n, kv_dim]` f32 each, whatever the
    /// element type.
    fn read_rows(c: &KvCache, layer: usize, slot: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let kv_dim = c.kv_dim;
        let (k, v) = c.layer(layer, slot, n).unwrap();
        let get = |view: KvView<'_>| {
            let mut out = vec![0f32; n * kv_dim];
            for p in 0..n {
                let row = view.table[p / view.block_size] as usize * view.block_size
                    + p % view.block_size;
                view.data
                    .read(row * kv_dim, &mut out[p * kv_dim..(p + 1) * kv_dim]);
            }
            out
        };
        (get(k), get(v))
    }

    /// `n` rows of 64 values; head 1 is 100 times smaller than head 0, so a scale shared
    /// across heads would cost it ~100x the error bound checked here. (Much smaller values
    /// would make the f16 scale subnormal, which costs precision: a limit of the format.)
    fn q8_rows(n: usize, seed: f32) -> Vec<f32> {
        (0..n * 64)
            .map(|i| {
                let x = ((i as f32 + seed) * 0.618).sin() * 3.0;
                if i % 64 < 32 {
                    x
                } else {
                    x * 1e-2
                }
            })
            .collect()
    }

    /// Every value within 0.6 quantisation steps of its Q8_0 block's scale `amax / 127`
    /// (half a step from rounding, plus the f16 rounding of the scale).
    fn assert_q8_close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.chunks(32).zip(want.chunks(32)) {
            let d = w.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            for (a, b) in g.iter().zip(w) {
                assert!((a - b).abs() <= 0.6 * d, "{a} vs {b} (step {d})");
            }
        }
    }

    #[test]
    fn q8_0_rows_round_trip_per_head() {
        let mut c = KvCache::with_spec(&spec_q8(), 2, 40, 8, 4, KvType::Q8_0).unwrap();
        // 2 layers x (K + V) x 4 rows x (2 blocks of 34 bytes).
        assert_eq!(c.block_bytes(), 2 * 2 * 4 * 68);
        assert_eq!(KvType::Q8_0.row_bytes(64), 68);
        let (k, v) = (q8_rows(9, 0.0), q8_rows(9, 100.0));
        c.prepare(0, 0, 9).unwrap();
        for layer in [0, 2] {
            // Two chunks, the second starting inside a block.
            c.write(layer, 0, 0, &k[..5 * 64], &v[..5 * 64]).unwrap();
            c.write(layer, 0, 5, &k[5 * 64..], &v[5 * 64..]).unwrap();
        }
        for layer in [0, 2] {
            let (gk, gv) = read_rows(&c, layer, 0, 9);
            assert_q8_close(&gk, &k);
            assert_q8_close(&gv, &v);
        }
        // Not all-zero: the small head kept its own scale.
        let (gk, _) = read_rows(&c, 0, 0, 1);
        assert!(gk[32..].iter().any(|&x| x != 0.0));
    }

    #[test]
    fn q8_0_shared_prefix_is_copied_on_write() {
        let mut c = KvCache::with_spec(&spec_q8(), 2, 32, 8, 4, KvType::Q8_0).unwrap();
        let (k, v) = (q8_rows(6, 1.0), q8_rows(6, 2.0));
        c.prepare(0, 0, 6).unwrap();
        for layer in [0, 2] {
            c.write(layer, 0, 0, &k, &v).unwrap();
        }
        let before = read_rows(&c, 2, 0, 6);
        c.share_prefix(0, 1, 6).unwrap();
        // Slot 1 rewrites positions 5 and 6: its second block is copied first.
        let (k2, v2) = (q8_rows(2, 50.0), q8_rows(2, 60.0));
        assert_eq!(c.blocks_needed(1, 5, 2), 1);
        c.prepare(1, 5, 2).unwrap();
        for layer in [0, 2] {
            c.write(layer, 1, 5, &k2, &v2).unwrap();
        }
        assert_eq!(
            read_rows(&c, 2, 0, 6),
            before,
            "the owner's rows are untouched"
        );
        let (gk, gv) = read_rows(&c, 2, 1, 7);
        // Rows 0..5 are byte copies of the owner's, rows 5..7 the new ones.
        assert_eq!(gk[..5 * 64], before.0[..5 * 64]);
        assert_eq!(gv[..5 * 64], before.1[..5 * 64]);
        assert_q8_close(&gk[5 * 64..], &k2);
        assert_q8_close(&gv[5 * 64..], &v2);
        c.release(0);
        c.release(1);
        assert_eq!((c.n_free_blocks(), total_refs(&c)), (8, 0));
    }

    #[test]
    fn q8_0_blocks_export_and_import_as_bytes() {
        let mut a = KvCache::with_spec(&spec_q8(), 1, 32, 4, 4, KvType::Q8_0).unwrap();
        let (k, v) = (q8_rows(6, 3.0), q8_rows(6, 4.0));
        a.prepare(0, 0, 6).unwrap();
        for layer in [0, 2] {
            a.write(layer, 0, 0, &k, &v).unwrap();
        }
        let want = (read_rows(&a, 0, 0, 6), read_rows(&a, 2, 0, 6));
        let mut b = KvCache::with_spec(&spec_q8(), 1, 32, 4, 4, KvType::Q8_0).unwrap();
        let mut blocks = Vec::new();
        for (i, &blk) in a.table(0).to_vec().iter().enumerate() {
            let rows = (6 - 4 * i).min(4);
            let bytes = a.export_block(blk, rows);
            // 2 layers x (K + V) x rows x 68 bytes.
            assert_eq!(bytes.len(), 2 * 2 * rows * 68);
            let nb = b.alloc_block().unwrap();
            b.import_block(nb, rows, &bytes).unwrap();
            blocks.push(nb);
        }
        b.adopt(0, &blocks).unwrap();
        assert_eq!((read_rows(&b, 0, 0, 6), read_rows(&b, 2, 0, 6)), want);
    }

    #[test]
    fn q8_0_needs_head_dim_multiple_of_32() {
        let err = KvCache::with_spec(&spec(false), 1, 8, 2, 4, KvType::Q8_0).unwrap_err();
        assert!(
            matches!(&err, ModelError::Config(m) if m.contains("multiple of 32")),
            "{err}"
        );
        for t in [KvType::F16, KvType::F32, KvType::Q8_0] {
            assert_eq!(t.name().parse::<KvType>(), Ok(t));
        }
        assert!("q8".parse::<KvType>().is_err());
    }
}
