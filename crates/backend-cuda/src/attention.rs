//! Paged KV cache writes and causal paged attention on the GPU (launches of
//! kernels/attention.cu): the CUDA twin of the CPU backend's src/attention.rs.
//!
//! One launch covers the whole batch. The cache is `[n_blocks, block_size, kv_dim]` of f32,
//! f16 or Q8_0 (per-head 32-element blocks: `head_dim % 32 == 0`); position `p` of a sequence
//! is row `p % block_size` of block `table[p / block_size]`. Block ids are checked on the host
//! against the cache size (from the batch's largest id) and again on the device.
//!
//! Attention runs as up to two launches over the whole batch, the kernel chosen per sequence
//! by its own number of new tokens (never by the rest of the batch):
//! - sequences of at least [`TILE_MIN`] tokens (prefill chunks): the tiled kernel, one block
//!   per ([`TILE_Q`] query tokens, query head), which stages K/V tiles of 32 positions in
//!   shared memory as f32 (each K/V row read once per 16 queries) with an f32 online softmax.
//!   A query's arithmetic depends only on its position, so a sequence prefilled in one chunk
//!   or in several chunks of at least [`TILE_MIN`] tokens gives the same bits;
//! - the others (decode, short speculative chunks): the split kernel (flash-decoding), which
//!   cuts each query token's context `0..=pos` into chunks of [`ATTN_SPLIT`] positions, one
//!   block per (token, query head, chunk), and a second kernel that merges the chunks in
//!   order. The chunking depends only on the token's position. For f16 caches of head size
//!   128 or 256 with several query heads per KV head, one block per (token, KV head, chunk)
//!   serves up to [`GQA_MAX`] of its query heads (`attn_split_gqa_f16_*`), reading each K/V
//!   row once for them, with 8- or 16-byte loads (a decode step at a 32K context reads the
//!   cache once instead of once per query head).
//!
//! Both compute in f32 on CUDA cores (K/V converted to f32 on load): the accuracy of the
//! scalar reference (relative error ~1e-6). For f16 caches of head size 64, 128 or 256 the
//! tiled kernel runs on tensor cores instead (`attn_mma_f16_<D>`, one block per (query tile,
//! KV head, 4 of its query heads), K/V tiles staged once for the 4 heads): the cache values
//! are exact f16 operands and the queries and probabilities are split into two f16 terms
//! (hi + lo, ~22 significant bits), so it keeps that accuracy at twice the products. The same
//! position-only dependence holds (chunk invariance).

use cudarc::driver::{CudaFunction, LaunchConfig};
use kapitsa_backend::{shape_err, AttnShape, Batch, DType, KvLayer, Result, Tensor};

use crate::batch::DevBatch;
use crate::device::{attn_mma_smem, dev_err, elem_cfg, u32_arg};
use crate::launch::KernelLaunch;
use crate::CudaBackend;

/// Positions per chunk of the split attention (kernels/attention.cu `ATTN_SPLIT`).
pub(crate) const ATTN_SPLIT: usize = 256;
/// Sequences with at least this many new tokens take the tiled kernel, the others the split
/// kernel. A choice per sequence, by its own length: the rest of the batch never changes a
/// sequence's kernel. (A tuning knob: the tiled kernel has one block per 16 queries and head,
/// so long contexts with few queries are better served by the split kernel.)
pub(crate) const TILE_MIN: usize = 16;
/// Query rows per tile of the tiled kernel (kernels/attention.cu `TILE_Q`).
pub(crate) const TILE_Q: usize = 16;
/// Cache positions per tile of the tiled kernel (kernels/attention.cu `TILE_K`).
const TILE_K: usize = 32;
/// Threads per block of the tiled kernel (kernels/attention.cu `TILE_THREADS`).
const TILE_THREADS: u32 = 128;
/// Warps per block (query heads of one KV head) of the tensor-core tiled attention
/// (kernels/attention.cu `MMA_WARPS`).
const MMA_WARPS: usize = 4;
/// Warps per block of the split attention (kernels/attention.cu `ATTN_WARPS`).
const ATTN_WARPS: u32 = 4;
/// Threads of `attn_combine` (kernels/attention.cu `COMBINE_THREADS`).
const COMBINE_THREADS: u32 = 256;
/// Query heads per block of the grouped split attention (kernels/attention.cu `GQA_MAX`).
const GQA_MAX: usize = 4;
/// Largest head dimension the kernels take (8 dims per lane).
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// Number of cache blocks of a K or V tensor, checking its shape against the batch.
fn n_blocks(op: &'static str, t: &Tensor, kv_dim: usize, db: &DevBatch) -> Result<usize> {
    let bs = db.block_size;
    if bs == 0 {
        return shape_err(op, "the batch has no KV blocks (block_size 0)");
    }
    let row = bs * kv_dim;
    if kv_dim == 0 || !t.len().is_multiple_of(row) {
        return shape_err(
            op,
            format!(
                "a cache of {} elements is not blocks of {bs} x {kv_dim}",
                t.len()
            ),
        );
    }
    let nb = t.len() / row;
    if let Some(m) = db.max_block {
        if m as usize >= nb {
            return shape_err(op, format!("block id {m} of a cache of {nb} blocks"));
        }
    }
    Ok(nb)
}

impl CudaBackend {
    pub(crate) fn kv_write_impl(
        &self,
        k: &Tensor,
        v: &Tensor,
        cache: KvLayer<'_>,
        batch: &Batch,
    ) -> Result<()> {
        const OP: &str = "kv_write";
        let db = self.dev_batch(batch, OP)?;
        let kv_dim = cache.kv_dim;
        let n = db.n_tokens;
        let kb = self.f32_len(k, n * kv_dim, OP, "k")?;
        let vb = self.f32_len(v, n * kv_dim, OP, "v")?;
        let dtype = cache.k.dtype();
        if cache.v.dtype() != dtype || cache.v.len() != cache.k.len() {
            return shape_err(OP, "K and V caches differ in type or size");
        }
        let nb = n_blocks(OP, cache.k, kv_dim, db)?;
        if dtype == DType::Q8_0 && !kv_dim.is_multiple_of(32) {
            return shape_err(
                OP,
                format!("a Q8_0 cache needs kv_dim % 32 == 0, got {kv_dim}"),
            );
        }
        if n == 0 || kv_dim == 0 {
            return Ok(());
        }
        let (nt, kd, bs, nbl) = (
            u32_arg(OP, "tokens", n)?,
            u32_arg(OP, "kv_dim", kv_dim)?,
            u32_arg(OP, "block_size", db.block_size)?,
            u32_arg(OP, "blocks", nb)?,
        );
        let (pos, tok_seq, seqs, tables) = (db.positions(), db.tok_seq(), db.seqs(), db.tables());
        let elems = n as u64 * kv_dim as u64;
        macro_rules! launch {
            ($f:expr, $ty:ty, $cfg:expr) => {{
                let kc = self.buf_mut::<$ty>(cache.k, OP, "k cache")?;
                let vc = self.buf_mut::<$ty>(cache.v, OP, "v cache")?;
                let mut b = self.stream.kernel($f);
                b.arg(kb)
                    .arg(vb)
                    .arg(kc)
                    .arg(vc)
                    .arg(&pos)
                    .arg(&tok_seq)
                    .arg(&seqs)
                    .arg(&tables);
                b.arg(&nt).arg(&kd).arg(&bs).arg(&nbl);
                // SAFETY: kv_write_*(const float* k, const float* v, T* kc, T* vc,
                // const uint32_t* positions, tok_seq, seqs, tables, uint32_t n_tokens, kv_dim,
                // block_size, n_blocks): k and v hold n_tokens * kv_dim floats, the caches
                // n_blocks * block_size * kv_dim elements, the batch arrays are the batch's
                // (validated by prepare_batch), and block ids are bound-checked on the device.
                unsafe { b.launch($cfg) }.map_err(dev_err)?;
            }};
        }
        match dtype {
            DType::F32 => launch!(&self.k.kv_write_f32, f32, elem_cfg(elems)),
            DType::F16 => launch!(&self.k.kv_write_f16, u16, elem_cfg(elems)),
            DType::Q8_0 => launch!(&self.k.kv_write_q8_0, u8, elem_cfg(elems)),
            DType::U32 => return shape_err(OP, "a U32 cache"),
        }
        Ok(())
    }

    /// The tiled-attention kernel for a cache type and head size.
    fn tile_kernel(&self, dtype: DType, head_dim: usize) -> Option<&CudaFunction> {
        let k = &self.k;
        let dpt = match head_dim {
            1..=64 => 8,
            65..=128 => 16,
            129..=MAX_HEAD_DIM => 32,
            _ => return None,
        };
        Some(match (dtype, dpt) {
            (DType::F32, 8) => &k.attn_tile_f32_8,
            (DType::F32, 16) => &k.attn_tile_f32_16,
            (DType::F32, _) => &k.attn_tile_f32_32,
            (DType::F16, 8) => &k.attn_tile_f16_8,
            (DType::F16, 16) => &k.attn_tile_f16_16,
            (DType::F16, _) => &k.attn_tile_f16_32,
            (DType::Q8_0, 8) => &k.attn_tile_q8_0_8,
            (DType::Q8_0, 16) => &k.attn_tile_q8_0_16,
            (DType::Q8_0, _) => &k.attn_tile_q8_0_32,
            (DType::U32, _) => return None,
        })
    }

    /// The split-attention kernel for a cache type and head size.
    fn attn_kernel(&self, dtype: DType, head_dim: usize) -> Option<&CudaFunction> {
        let k = &self.k;
        let ni = match head_dim {
            1..=64 => 2,
            65..=128 => 4,
            129..=MAX_HEAD_DIM => 8,
            _ => return None,
        };
        Some(match (dtype, ni) {
            (DType::F32, 2) => &k.attn_split_f32_2,
            (DType::F32, 4) => &k.attn_split_f32_4,
            (DType::F32, _) => &k.attn_split_f32_8,
            (DType::F16, 2) => &k.attn_split_f16_2,
            (DType::F16, 4) => &k.attn_split_f16_4,
            (DType::F16, _) => &k.attn_split_f16_8,
            (DType::Q8_0, 2) => &k.attn_split_q8_0_2,
            (DType::Q8_0, 4) => &k.attn_split_q8_0_4,
            (DType::Q8_0, _) => &k.attn_split_q8_0_8,
            (DType::U32, _) => return None,
        })
    }

    pub(crate) fn attention_impl(
        &self,
        shape: AttnShape,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "attention";
        let db = self.dev_batch(batch, OP)?;
        let AttnShape {
            n_head,
            n_head_kv,
            head_dim,
            scale,
        } = shape;
        if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) || head_dim == 0 {
            return shape_err(
                OP,
                format!("{n_head} heads over {n_head_kv} KV heads of {head_dim}"),
            );
        }
        let n = db.n_tokens;
        let width = n_head * head_dim;
        let qb = self.f32_len(q, n * width, OP, "q")?;
        let dtype = k_cache.dtype();
        if v_cache.dtype() != dtype || v_cache.len() != k_cache.len() {
            return shape_err(OP, "K and V caches differ in type or size");
        }
        if dtype == DType::Q8_0 && !head_dim.is_multiple_of(32) {
            return shape_err(
                OP,
                format!("a Q8_0 cache needs head_dim % 32 == 0, got {head_dim}"),
            );
        }
        let kv_dim = n_head_kv * head_dim;
        let nb = n_blocks(OP, k_cache, kv_dim, db)?;
        let (Some(fs), Some(ft)) = (
            self.attn_kernel(dtype, head_dim),
            self.tile_kernel(dtype, head_dim),
        ) else {
            return Err(kapitsa_backend::BackendError::Unsupported {
                op: OP,
                what: format!("{dtype:?} cache with head_dim {head_dim} (at most {MAX_HEAD_DIM})"),
            });
        };
        let ob = self.f32_len_mut(out, n * width, OP, "out")?;
        if n == 0 || n_head == 0 {
            return Ok(());
        }
        let n_splits = db.attn_splits();
        let (nt, nh, nhk, hd, bs, nbl, ns) = (
            u32_arg(OP, "tokens", db.n_short)?,
            u32_arg(OP, "heads", n_head)?,
            u32_arg(OP, "kv heads", n_head_kv)?,
            u32_arg(OP, "head_dim", head_dim)?,
            u32_arg(OP, "block_size", db.block_size)?,
            u32_arg(OP, "blocks", nb)?,
            u32_arg(OP, "splits", n_splits)?,
        );
        if nh > 65535 || ns > 65535 {
            return shape_err(
                OP,
                format!("{n_head} heads, {n_splits} context chunks (at most 65535)"),
            );
        }
        let (pos, tok_seq, seqs, tables) = (db.positions(), db.tok_seq(), db.seqs(), db.tables());

        // prefill chunks: the tiled kernel (on tensor cores for f16 caches of the usual head
        // sizes)
        let mma = match (dtype, head_dim) {
            (DType::F16, 64) if mma_on() => Some(&self.k.attn_mma_f16_64),
            (DType::F16, 128) if mma_on() => Some(&self.k.attn_mma_f16_128),
            (DType::F16, 256) if mma_on() => Some(&self.k.attn_mma_f16_256),
            _ => None,
        };
        if let (Some(f), true) = (mma, db.n_tiles > 0) {
            let group = n_head / n_head_kv;
            let cfg = LaunchConfig {
                grid_dim: (
                    u32_arg(OP, "tiles", db.n_tiles)?,
                    nhk,
                    u32_arg(OP, "head groups", group.div_ceil(MMA_WARPS))?,
                ),
                block_dim: (32 * MMA_WARPS as u32, 1, 1),
                shared_mem_bytes: u32_arg(OP, "shared memory", attn_mma_smem(head_dim))?,
            };
            let tiles = db.tiles();
            let kc = self.buf::<u16>(k_cache, OP, "k cache")?;
            let vc = self.buf::<u16>(v_cache, OP, "v cache")?;
            let mut b = self.stream.kernel(f);
            b.arg(qb)
                .arg(kc)
                .arg(vc)
                .arg(&tiles)
                .arg(&seqs)
                .arg(&tables);
            b.arg(&nh).arg(&nhk).arg(&scale).arg(&bs).arg(&nbl);
            b.arg(&mut *ob);
            // SAFETY: attn_mma_f16_<D>(const float* q, const __half* kc, const __half* vc,
            // const uint32_t* tiles, seqs, tables, uint32_t n_head, n_head_kv, float scale,
            // uint32_t block_size, n_blocks, float* out) with D = head_dim, grid (tiles, kv
            // heads, ceil(group / 4)), 128 threads, attn_mma_smem(D) bytes of dynamic shared
            // memory (the limit set at load): q and out hold n_tokens * n_head * D floats (16-byte
            // aligned allocations, D even), the caches n_blocks rows of block_size * kv_dim f16
            // (kv_dim a multiple of 8: 16-byte row loads), n_head a multiple of n_head_kv
            // (checked above), the tiles are prepare_batch's; block ids are bound-checked on the
            // device.
            unsafe { b.launch(cfg) }.map_err(dev_err)?;
        } else if db.n_tiles > 0 {
            let floats = TILE_Q * (head_dim + 1)
                + TILE_K * (head_dim + 1)
                + TILE_K * head_dim
                + TILE_Q * (TILE_K + 1);
            let smem = u32_arg(
                OP,
                "shared memory",
                (floats * 4).next_multiple_of(8) + TILE_K * 8,
            )?;
            if smem > crate::device::TILE_SMEM_MAX {
                return shape_err(
                    OP,
                    format!("head_dim {head_dim} needs {smem} bytes of shared memory"),
                );
            }
            let tiles = db.tiles();
            let cfg = LaunchConfig {
                grid_dim: (u32_arg(OP, "tiles", db.n_tiles)?, nh, 1),
                block_dim: (TILE_THREADS, 1, 1),
                shared_mem_bytes: smem,
            };
            macro_rules! launch {
                ($ty:ty) => {{
                    let kc = self.buf::<$ty>(k_cache, OP, "k cache")?;
                    let vc = self.buf::<$ty>(v_cache, OP, "v cache")?;
                    let mut b = self.stream.kernel(ft);
                    b.arg(qb)
                        .arg(kc)
                        .arg(vc)
                        .arg(&tiles)
                        .arg(&seqs)
                        .arg(&tables);
                    b.arg(&nh).arg(&nhk).arg(&hd).arg(&scale).arg(&bs).arg(&nbl);
                    b.arg(&mut *ob);
                    // SAFETY: attn_tile_*(const float* q, const T* kc, const T* vc,
                    // const uint32_t* tiles, seqs, tables, uint32_t n_head, n_head_kv,
                    // head_dim, float scale, uint32_t block_size, n_blocks, float* out),
                    // grid (tiles, heads), 128 threads, `smem` bytes of dynamic shared memory
                    // as the kernel lays it out (within the limit set at load): q and out hold
                    // n_tokens * n_head * head_dim floats, the caches n_blocks rows of
                    // block_size * kv_dim, the tiles are prepare_batch's (rows inside their
                    // sequences); block ids are bound-checked on the device.
                    unsafe { b.launch(cfg) }.map_err(dev_err)?;
                }};
            }
            match dtype {
                DType::F32 => launch!(f32),
                DType::F16 => launch!(u16),
                DType::Q8_0 => launch!(u8),
                DType::U32 => return shape_err(OP, "a U32 cache"),
            }
        }
        if db.n_short == 0 {
            return Ok(());
        }

        // decode and short chunks: the split kernel over the list of their tokens
        let toks = db.short_tokens();
        let mut ws = if n_splits > 1 {
            Some(self.scratch::<f32>(db.n_short * n_head * n_splits * (head_dim + 2))?)
        } else {
            None
        };
        // f16 caches with grouped query heads: the kernel that reads each K/V row once per
        // group of up to GQA_MAX query heads (grid y: KV heads x head groups)
        let group = n_head / n_head_kv;
        let gqa = match (dtype, head_dim) {
            (DType::F16, 128) if group > 1 && gqa_on() => Some(&self.k.attn_split_gqa_f16_4),
            (DType::F16, 256) if group > 1 && gqa_on() => Some(&self.k.attn_split_gqa_f16_8),
            _ => None,
        };
        let grid_y = match gqa {
            Some(_) => u32_arg(OP, "head groups", n_head_kv * group.div_ceil(GQA_MAX))?,
            None => nh,
        };
        let fs = gqa.unwrap_or(fs);
        let cfg = LaunchConfig {
            grid_dim: (nt, grid_y, ns),
            block_dim: (32 * ATTN_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        macro_rules! launch {
            ($ty:ty) => {{
                let kc = self.buf::<$ty>(k_cache, OP, "k cache")?;
                let vc = self.buf::<$ty>(v_cache, OP, "v cache")?;
                let mut b = self.stream.kernel(fs);
                b.arg(qb)
                    .arg(kc)
                    .arg(vc)
                    .arg(&pos)
                    .arg(&tok_seq)
                    .arg(&seqs)
                    .arg(&tables);
                b.arg(&nh)
                    .arg(&nhk)
                    .arg(&hd)
                    .arg(&scale)
                    .arg(&bs)
                    .arg(&nbl)
                    .arg(&toks);
                b.arg(&mut *ob);
                b.arg(ws.as_mut());
                // SAFETY: attn_split_*(const float* q, const T* kc, const T* vc,
                // const uint32_t* positions, tok_seq, seqs, tables, uint32_t n_head,
                // n_head_kv, head_dim, float scale, uint32_t block_size, n_blocks,
                // const uint32_t* toks, float* out, float* ws), grid (listed tokens, heads
                // (attn_split_gqa_f16_*: KV heads x ceil(group / GQA_MAX) head groups, for
                // head_dim == 32 * its dims per lane, an f16 cache), splits): q and out hold
                // n_tokens * n_head * head_dim floats, toks n_short
                // token indices, the caches n_blocks rows of block_size * kv_dim, ws (only
                // used with more than one split) holds n_short * n_head * n_splits *
                // (head_dim + 2) floats; the kernel variant's
                // dims per lane cover head_dim; block ids are bound-checked on the device.
                unsafe { b.launch(cfg) }.map_err(dev_err)?;
            }};
        }
        match dtype {
            DType::F32 => launch!(f32),
            DType::F16 => launch!(u16),
            DType::Q8_0 => launch!(u8),
            DType::U32 => return shape_err(OP, "a U32 cache"),
        }
        if let Some(w) = ws.as_ref() {
            let mut b = self.stream.kernel(&self.k.attn_combine);
            b.arg(w).arg(&toks).arg(&ns).arg(&nh).arg(&hd).arg(&mut *ob);
            let cfg = LaunchConfig {
                grid_dim: (nt, nh, 1),
                block_dim: (COMBINE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: attn_combine(const float* ws, const uint32_t* toks, uint32_t n_splits,
            // n_head, head_dim, float* out), grid (listed tokens, heads): ws, toks and out as
            // above.
            unsafe { b.launch(cfg) }.map_err(dev_err)?;
        }
        Ok(())
    }
}

env_switch! {
    /// Whether f16 caches with grouped query heads take the grouped split kernel
    /// (`KAPITSA_ATTN_GQA=0`: the per-head split kernel, for measurements).
    fn gqa_on = "KAPITSA_ATTN_GQA"
}

env_switch! {
    /// Whether f16 caches take the tensor-core tiled attention (`KAPITSA_ATTN_MMA=0`: the
    /// scalar tiled kernel, for measurements).
    fn mma_on = "KAPITSA_ATTN_MMA"
}
