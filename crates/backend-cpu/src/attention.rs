//! Paged KV writes and causal attention on host memory.
//!
//! Cache layout (each of K and V): `[n_blocks, block_size, kv_dim]` of the cache type (F32,
//! F16 or Q8_0 blocks, see [`katt::KvSlice`]); position `p` of a sequence is row
//! `p % block_size` of block `table[p / block_size]` of its block table. [`kv_write`]
//! converts rows as the old model cache did (`f32` copy, `half::f16::from_f32`,
//! `quantize_row(Q8_0)`); [`attention`] runs `kapitsa_kernels_cpu::attention::attention_with`
//! per sequence over a [`KvView`] of its block table (`n_ctx = last position + 1`), with
//! llama.cpp's summation orders in the llama.cpp-compatible mode. The scalar reference
//! gathers each sequence's rows to f32 and runs `attention_reference` (f64 loops).

use kapitsa_backend::{check_len, shape_err, AttnShape, Batch, BatchDesc, KvLayer, Result, Tensor};
use kapitsa_base::GgmlType;
use kapitsa_kernels_cpu::attention::{self as katt, AttnOrder, KvView, SumOrder};

use crate::buffers::{buf_mut, desc, f32s_len, f32s_mut_len, kv_slice, mul, HostBuf};
use crate::{kernel_err, CpuBackend};

/// Checks a paged cache tensor of `len` elements against rows of `kv_dim` in blocks of
/// `block_size`; returns its number of blocks.
fn n_blocks(
    op: &'static str,
    what: &str,
    len: usize,
    block_size: usize,
    kv_dim: usize,
) -> Result<usize> {
    let per = mul(op, block_size, kv_dim)?;
    if per == 0 || !len.is_multiple_of(per) {
        return shape_err(
            op,
            format!("{what} has {len} elements, not whole blocks of {block_size} x {kv_dim}"),
        );
    }
    Ok(len / per)
}

/// Checks that the first `n_pos.div_ceil(block_size)` entries of every sequence's block
/// table name blocks below `n_blocks` (`prepare_batch` checked the tables cover the
/// positions).
fn check_tables(op: &'static str, b: &BatchDesc, n_blocks: usize) -> Result<()> {
    for (i, s) in b.seqs.iter().enumerate() {
        let nb = (s.pos0 + s.len).div_ceil(b.block_size);
        if let Some(&bad) = b.table(i)[..nb].iter().find(|&&id| id as usize >= n_blocks) {
            return shape_err(
                op,
                format!("sequence {i}: block {bad} out of range ({n_blocks} blocks)"),
            );
        }
    }
    Ok(())
}

/// Write the new K and V rows into the paged cache at each token's position.
pub(crate) fn kv_write(k: &Tensor, v: &Tensor, cache: KvLayer<'_>, batch: &Batch) -> Result<()> {
    const OP: &str = "kv_write";
    let b = desc(OP, batch)?;
    let kv_dim = cache.kv_dim;
    let n = mul(OP, b.n_tokens(), kv_dim)?;
    let k = f32s_len(OP, "k", k, n)?;
    let v = f32s_len(OP, "v", v, n)?;
    if b.block_size == 0 {
        return shape_err(OP, "the batch has no KV blocks (block_size 0)");
    }
    let (ct, cl) = (cache.k.dtype(), cache.k.len());
    if cache.v.dtype() != ct {
        return shape_err(
            OP,
            format!("K cache is {ct:?}, V cache {:?}", cache.v.dtype()),
        );
    }
    check_len(OP, "V cache", cache.v.len(), cl)?;
    if !ct.is_boundary(kv_dim) {
        return shape_err(
            OP,
            format!("Q8_0 rows of {kv_dim} values (not whole blocks)"),
        );
    }
    let nb = n_blocks(OP, "K cache", cl, b.block_size, kv_dim)?;
    check_tables(OP, b, nb)?;
    let kb = buf_mut(OP, "K cache", cache.k)?;
    let vb = buf_mut(OP, "V cache", cache.v)?;
    let bs = b.block_size;
    for (i, s) in b.seqs.iter().enumerate() {
        let table = b.table(i);
        for j in 0..s.len {
            let p = s.pos0 + j;
            let at = (table[p / bs] as usize * bs + p % bs) * kv_dim;
            let t = s.start + j;
            write_row(kb, at, &k[t * kv_dim..(t + 1) * kv_dim])?;
            write_row(vb, at, &v[t * kv_dim..(t + 1) * kv_dim])?;
        }
    }
    Ok(())
}

/// Store `x` at element `at` of a cache buffer, converting to its type (`at` and `x.len()`
/// whole Q8_0 blocks, checked by the caller; the range inside the buffer, likewise).
fn write_row(buf: &mut HostBuf, at: usize, x: &[f32]) -> Result<()> {
    match buf {
        HostBuf::F32(b) => b[at..at + x.len()].copy_from_slice(x),
        HostBuf::F16(b) => {
            for (d, s) in b[at..at + x.len()].iter_mut().zip(x) {
                *d = half::f16::from_f32(*s);
            }
        }
        HostBuf::Q8_0(b) => {
            let off = |i: usize| i / katt::Q8_0_BLOCK * katt::Q8_0_BYTES;
            kapitsa_kernels_cpu::quantize_row(
                GgmlType::Q8_0,
                x,
                &mut b[off(at)..off(at + x.len())],
            )
            .map_err(kernel_err)?;
        }
        HostBuf::U32(_) => return shape_err("kv_write", "a U32 tensor is not a KV cache"),
    }
    Ok(())
}

/// Causal attention of every sequence's new queries over its cached positions.
pub(crate) fn attention(
    be: &CpuBackend,
    shape: AttnShape,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    batch: &Batch,
    out: &mut Tensor,
) -> Result<()> {
    const OP: &str = "attention";
    let b = desc(OP, batch)?;
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim,
        scale,
    } = shape;
    if n_head_kv == 0 || head_dim == 0 || !n_head.is_multiple_of(n_head_kv) {
        return shape_err(
            OP,
            format!("{n_head} query heads, {n_head_kv} KV heads of {head_dim} dims"),
        );
    }
    let q_dim = mul(OP, n_head, head_dim)?;
    let kv_dim = mul(OP, n_head_kv, head_dim)?;
    let n = mul(OP, b.n_tokens(), q_dim)?;
    let q = f32s_len(OP, "q", q, n)?;
    let out = f32s_mut_len(OP, "out", out, n)?;
    if b.block_size == 0 {
        return shape_err(OP, "the batch has no KV blocks (block_size 0)");
    }
    let ks = kv_slice(OP, "K cache", k_cache)?;
    let vs = kv_slice(OP, "V cache", v_cache)?;
    for (what, t) in [("K cache", k_cache), ("V cache", v_cache)] {
        // Q8_0 reads go head by head: each head must be whole blocks.
        if !t.dtype().is_boundary(head_dim) {
            return shape_err(OP, format!("{what}: Q8_0 heads of {head_dim} values"));
        }
    }
    let nb = n_blocks(OP, "K cache", k_cache.len(), b.block_size, kv_dim)?;
    check_len(OP, "V cache", v_cache.len(), k_cache.len())?;
    check_tables(OP, b, nb)?;
    let kshape = katt::AttnShape {
        n_head,
        n_head_kv,
        head_dim,
        scale,
    };
    for (i, s) in b.seqs.iter().enumerate() {
        let r = s.start..s.start + s.len;
        let n_ctx = s.pos0 + s.len;
        let table = &b.table(i)[..n_ctx.div_ceil(b.block_size)];
        let view = |data| KvView {
            data,
            table,
            block_size: b.block_size,
        };
        let (qs, os) = (
            &q[r.start * q_dim..r.end * q_dim],
            &mut out[r.start * q_dim..r.end * q_dim],
        );
        let pos = &b.positions[r];
        if be.scalar() {
            let kf = gather(view(ks), n_ctx, kv_dim);
            let vf = gather(view(vs), n_ctx, kv_dim);
            katt::attention_reference(kshape, qs, pos, &kf, &vf, os);
        } else {
            let order = match (be.llama_compat, pos.len()) {
                (false, _) => AttnOrder::default(),
                (true, 1) => AttnOrder {
                    scores: SumOrder::Ggml4Acc,
                    pv: SumOrder::Ggml4Acc,
                },
                (true, _) => AttnOrder {
                    scores: SumOrder::Ggml4Acc,
                    pv: SumOrder::OneChain,
                },
            };
            katt::attention_with(be.pool(), kshape, order, qs, pos, view(ks), view(vs), os);
        }
    }
    Ok(())
}

/// Positions `0..n_ctx` of a view as contiguous f32 rows `[n_ctx, kv_dim]` (the scalar
/// reference's input). The view's blocks were checked to lie inside its data.
fn gather(view: KvView<'_>, n_ctx: usize, kv_dim: usize) -> Vec<f32> {
    let mut out = vec![0f32; n_ctx * kv_dim];
    let bs = view.block_size;
    for (p, row) in out.chunks_exact_mut(kv_dim).enumerate() {
        let at = (view.table[p / bs] as usize * bs + p % bs) * kv_dim;
        view.data.read(at, row);
    }
    out
}
