//! Host storage behind the CPU backend's handles, and the memory ops on it.
//!
//! - A [`Tensor`] holds a private host buffer: `Vec<f32>` (F32), `Vec<half::f16>` (F16),
//!   `Vec<u8>` of Q8_0 blocks (Q8_0: element `i`, a multiple of 32, starts block `i / 32` at
//!   byte `(i / 32) * 34`, the layout of [`KvSlice::Q8_0`]) or `Vec<u32>` (U32). The vector
//!   holds exactly the tensor's `len` elements (`DType::bytes(len)` bytes for Q8_0, whose
//!   lengths are whole blocks).
//! - A [`Weight`] keeps the caller's [`HostBytes`] (no copy: a memory-mapped file stays
//!   mapped); ops view it as a `QMatrix` per call ([`matrix`], [`expert_matrix`]).
//! - A [`Batch`] is its host [`BatchDesc`], checked once by [`prepare_batch`].
//!
//! Byte encodings (for [`read_bytes`] / [`write_bytes`]): f32, f16 and u32 little-endian,
//! Q8_0 blocks as stored.

use half::f16;
use kapitsa_backend::{
    check_len, shape_err, BackendError, Batch, BatchDesc, DType, HostBytes, HostWeight, Result,
    Tensor, Weight, Q8_0_BLOCK, Q8_0_BYTES,
};
use kapitsa_kernels_cpu::attention::KvSlice;
use kapitsa_kernels_cpu::matmul::QMatrix;

/// The host buffer of a CPU tensor (see the module docs).
pub(crate) enum HostBuf {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Q8_0(Vec<u8>),
    U32(Vec<u32>),
}

/// The CPU backend's buffer of a weight: the caller's bytes, `dtype.row_bytes(n_in)` per
/// row, rows in shape order.
pub(crate) struct CpuWeight {
    bytes: HostBytes,
}

/// Marks a [`Batch`] made by the CPU backend (it keeps nothing but the host description).
pub(crate) struct CpuBatch;

/// Byte offset of element `i` (a multiple of 32) in Q8_0 storage.
fn q8_off(i: usize) -> usize {
    i / Q8_0_BLOCK * Q8_0_BYTES
}

/// The f32 values of a CPU tensor (`None` for another dtype or another backend's tensor).
pub fn host_f32(t: &Tensor) -> Option<&[f32]> {
    match t.buf::<HostBuf>()? {
        HostBuf::F32(v) => Some(v),
        _ => None,
    }
}

/// See [`host_f32`].
pub fn host_f32_mut(t: &mut Tensor) -> Option<&mut [f32]> {
    match t.buf_mut::<HostBuf>()? {
        HostBuf::F32(v) => Some(v),
        _ => None,
    }
}

/// The f16 values of a CPU tensor.
pub fn host_f16(t: &Tensor) -> Option<&[f16]> {
    match t.buf::<HostBuf>()? {
        HostBuf::F16(v) => Some(v),
        _ => None,
    }
}

/// The Q8_0 blocks of a CPU tensor (`34` bytes per 32 elements).
pub fn host_q8_0(t: &Tensor) -> Option<&[u8]> {
    match t.buf::<HostBuf>()? {
        HostBuf::Q8_0(v) => Some(v),
        _ => None,
    }
}

/// The u32 values of a CPU tensor.
pub fn host_u32(t: &Tensor) -> Option<&[u32]> {
    match t.buf::<HostBuf>()? {
        HostBuf::U32(v) => Some(v),
        _ => None,
    }
}

/// The host buffer of `t`, or [`BackendError::ForeignHandle`].
pub(crate) fn buf<'a>(op: &'static str, what: &'static str, t: &'a Tensor) -> Result<&'a HostBuf> {
    t.buf::<HostBuf>()
        .ok_or(BackendError::ForeignHandle { op, what })
}

/// See [`buf`].
pub(crate) fn buf_mut<'a>(
    op: &'static str,
    what: &'static str,
    t: &'a mut Tensor,
) -> Result<&'a mut HostBuf> {
    t.buf_mut::<HostBuf>()
        .ok_or(BackendError::ForeignHandle { op, what })
}

fn not_f32<T>(op: &'static str, what: &str, t: DType) -> Result<T> {
    shape_err(op, format!("{what} is a {t:?} tensor, expected F32"))
}

/// The f32 values of `t`: a shape error for another dtype, a foreign-handle error for
/// another backend's tensor.
pub(crate) fn f32s<'a>(op: &'static str, what: &'static str, t: &'a Tensor) -> Result<&'a [f32]> {
    match buf(op, what, t)? {
        HostBuf::F32(v) => Ok(v),
        _ => not_f32(op, what, t.dtype()),
    }
}

/// See [`f32s`].
pub(crate) fn f32s_mut<'a>(
    op: &'static str,
    what: &'static str,
    t: &'a mut Tensor,
) -> Result<&'a mut [f32]> {
    let dt = t.dtype();
    match buf_mut(op, what, t)? {
        HostBuf::F32(v) => Ok(v),
        _ => not_f32(op, what, dt),
    }
}

/// [`f32s`] with a length check: `t` must hold exactly `len` values.
pub(crate) fn f32s_len<'a>(
    op: &'static str,
    what: &'static str,
    t: &'a Tensor,
    len: usize,
) -> Result<&'a [f32]> {
    let v = f32s(op, what, t)?;
    check_len(op, what, v.len(), len)?;
    Ok(v)
}

/// [`f32s_mut`] with a length check.
pub(crate) fn f32s_mut_len<'a>(
    op: &'static str,
    what: &'static str,
    t: &'a mut Tensor,
    len: usize,
) -> Result<&'a mut [f32]> {
    let v = f32s_mut(op, what, t)?;
    check_len(op, what, v.len(), len)?;
    Ok(v)
}

/// A KV cache tensor as the attention kernels borrow it (F32, F16 or Q8_0).
pub(crate) fn kv_slice<'a>(
    op: &'static str,
    what: &'static str,
    t: &'a Tensor,
) -> Result<KvSlice<'a>> {
    match buf(op, what, t)? {
        HostBuf::F32(v) => Ok(KvSlice::F32(v)),
        HostBuf::F16(v) => Ok(KvSlice::F16(v)),
        HostBuf::Q8_0(v) => Ok(KvSlice::Q8_0(v)),
        HostBuf::U32(_) => shape_err(op, format!("{what} is a U32 tensor, not a KV cache")),
    }
}

/// `a * b`, or a shape error naming `op` on overflow.
pub(crate) fn mul(op: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| BackendError::Shape {
        op,
        msg: format!("{a} x {b} overflows"),
    })
}

// ---- weights --------------------------------------------------------------------------------

/// Keep a model weight's host bytes as a [`Weight`] (no copy). The shape must be 2-D
/// `[n_out, n_in]` or 3-D `[n_expert, n_out, n_in]` with rows of whole blocks, the bytes
/// exactly the rows, and the type one the CPU kernels can multiply (a dot kernel exists) or
/// at least dequantise (embedding gathers; matrix products then fail in the op).
/// [`upload`] of a matrix: its type needs a dot-product kernel.
pub(crate) fn upload_weight(w: &HostWeight) -> Result<Weight> {
    if kapitsa_kernels_cpu::quant::vec_dot_type(w.dtype).is_err() {
        return Err(BackendError::Unsupported {
            op: "upload_weight",
            what: format!("matrix type {} of '{}'", w.dtype, w.name),
        });
    }
    upload(w)
}

/// [`upload`] of an embedding table: its type needs dequantisation only.
pub(crate) fn upload_embedding(w: &HostWeight) -> Result<Weight> {
    if !kapitsa_base::quant::can_dequantize(w.dtype) {
        return Err(BackendError::Unsupported {
            op: "upload_embedding",
            what: format!("type {} of '{}'", w.dtype, w.name),
        });
    }
    upload(w)
}

/// Keep a weight's host bytes (no copy) after checking its shape and byte length.
fn upload(w: &HostWeight) -> Result<Weight> {
    const OP: &str = "upload_weight";
    if !(2..=3).contains(&w.shape.len()) {
        return shape_err(
            OP,
            format!("'{}' has shape {:?}, expected 2-D or 3-D", w.name, w.shape),
        );
    }
    let n_in = w.shape[w.shape.len() - 1];
    let rows = w.shape[..w.shape.len() - 1]
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d));
    let supported = kapitsa_kernels_cpu::quant::vec_dot_type(w.dtype).is_ok()
        || kapitsa_base::quant::can_dequantize(w.dtype);
    if !supported {
        return Err(BackendError::Unsupported {
            op: OP,
            what: format!("type {} of '{}'", w.dtype, w.name),
        });
    }
    let rb = kapitsa_kernels_cpu::quant::row_bytes(OP, w.dtype, n_in).map_err(|e| {
        BackendError::Shape {
            op: OP,
            msg: format!("'{}': {e}", w.name),
        }
    })?;
    let want = rows.and_then(|r| r.checked_mul(rb));
    if want != Some(w.bytes.len()) {
        return shape_err(
            OP,
            format!(
                "'{}': {} bytes do not hold {:?} of {}",
                w.name,
                w.bytes.len(),
                w.shape,
                w.dtype
            ),
        );
    }
    Ok(Weight::from_parts(
        w.name.clone(),
        w.dtype,
        w.shape.clone(),
        Box::new(CpuWeight {
            bytes: w.bytes.clone(),
        }),
    ))
}

/// The bytes of a CPU weight.
pub(crate) fn weight_bytes<'a>(op: &'static str, w: &'a Weight) -> Result<&'a [u8]> {
    w.buf::<CpuWeight>()
        .map(|c| c.bytes.as_slice())
        .ok_or(BackendError::ForeignHandle { op, what: "weight" })
}

/// A 2-D weight `[n_out, n_in]` as a kernel matrix.
pub(crate) fn matrix<'a>(op: &'static str, w: &'a Weight) -> Result<QMatrix<'a>> {
    let (n_out, n_in) = w.dims2(op)?;
    Ok(QMatrix {
        dtype: w.dtype,
        n_out,
        n_in,
        data: weight_bytes(op, w)?,
    })
}

/// Rows `rows` of expert `e` of a 3-D weight `[n_expert, n_rows, n_in]` (stacked experts)
/// as a matrix `[rows.len(), n_in]`; the bytes are a sub-slice of the weight's.
pub(crate) fn expert_matrix<'a>(
    op: &'static str,
    w: &'a Weight,
    e: usize,
    rows: std::ops::Range<usize>,
) -> Result<QMatrix<'a>> {
    let (n_exp, n_rows, n_in) = w.dims3(op)?;
    if e >= n_exp || rows.start > rows.end || rows.end > n_rows {
        return shape_err(
            op,
            format!(
                "expert {e} rows {rows:?} out of range for '{}' {:?}",
                w.name, w.shape
            ),
        );
    }
    let bad = || BackendError::Shape {
        op,
        msg: format!("'{}' {:?} of {}: bad row size", w.name, w.shape, w.dtype),
    };
    let rb = w.dtype.row_bytes(n_in).ok_or_else(bad)?;
    let first = e * n_rows + rows.start;
    let data = weight_bytes(op, w)?
        .get(first * rb..(first + rows.len()) * rb)
        .ok_or_else(bad)?;
    Ok(QMatrix {
        dtype: w.dtype,
        n_out: rows.len(),
        n_in,
        data,
    })
}

// ---- tensors --------------------------------------------------------------------------------

/// A zero-filled vector of `n` elements, or [`BackendError::OutOfMemory`].
fn zeros<T: Clone>(n: usize, zero: T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        BackendError::OutOfMemory(format!(
            "{n} elements of {} bytes",
            std::mem::size_of::<T>()
        ))
    })?;
    v.resize(n, zero);
    Ok(v)
}

/// A new zero-filled host tensor (Q8_0: `len` a multiple of 32; all-zero bytes are blocks of
/// scale 0, i.e. zeros).
pub(crate) fn alloc(dtype: DType, len: usize) -> Result<Tensor> {
    if !dtype.is_boundary(len) {
        return shape_err(
            "alloc",
            format!("a Q8_0 tensor of {len} elements (not whole blocks)"),
        );
    }
    let buf = match dtype {
        DType::F32 => HostBuf::F32(zeros(len, 0f32)?),
        DType::F16 => HostBuf::F16(zeros(len, f16::ZERO)?),
        DType::Q8_0 => HostBuf::Q8_0(zeros(q8_off(len), 0u8)?),
        DType::U32 => HostBuf::U32(zeros(len, 0u32)?),
    };
    Ok(Tensor::from_parts(dtype, len, Box::new(buf)))
}

/// Elements `off..off + n` of a tensor of `len` elements of `dtype`, checked: inside the
/// tensor and, for Q8_0, on block boundaries.
fn range(
    op: &'static str,
    what: &str,
    dtype: DType,
    len: usize,
    off: usize,
    n: usize,
) -> Result<std::ops::Range<usize>> {
    let end = off.checked_add(n).filter(|&e| e <= len);
    let Some(end) = end else {
        return shape_err(
            op,
            format!("{what}: elements {off}..{off}+{n} out of range (length {len})"),
        );
    };
    if !dtype.is_boundary(off) || !dtype.is_boundary(end) {
        return shape_err(
            op,
            format!("{what}: Q8_0 range {off}..{end} is not on block boundaries"),
        );
    }
    Ok(off..end)
}

/// `dst[offset..offset + src.len()] = src`.
pub(crate) fn write_f32(dst: &mut Tensor, offset: usize, src: &[f32]) -> Result<()> {
    const OP: &str = "write_f32";
    let d = f32s_mut(OP, "dst", dst)?;
    let r = range(OP, "dst", DType::F32, d.len(), offset, src.len())?;
    d[r].copy_from_slice(src);
    Ok(())
}

/// `dst = src[offset..offset + dst.len()]`.
pub(crate) fn read_f32(src: &Tensor, offset: usize, dst: &mut [f32]) -> Result<()> {
    const OP: &str = "read_f32";
    let s = f32s(OP, "src", src)?;
    let r = range(OP, "src", DType::F32, s.len(), offset, dst.len())?;
    dst.copy_from_slice(&s[r]);
    Ok(())
}

/// Elements `offset..offset + n` of `src` in their byte encoding (see the module docs).
pub(crate) fn read_bytes(src: &Tensor, offset: usize, n: usize) -> Result<Vec<u8>> {
    const OP: &str = "read_bytes";
    let b = buf(OP, "src", src)?;
    let r = range(OP, "src", src.dtype(), src.len(), offset, n)?;
    let mut out = Vec::with_capacity(src.dtype().bytes(n));
    match b {
        HostBuf::F32(v) => v[r].iter().for_each(|x| out.extend(x.to_le_bytes())),
        HostBuf::F16(v) => v[r]
            .iter()
            .for_each(|x| out.extend(x.to_bits().to_le_bytes())),
        HostBuf::Q8_0(v) => out.extend_from_slice(&v[q8_off(r.start)..q8_off(r.end)]),
        HostBuf::U32(v) => v[r].iter().for_each(|x| out.extend(x.to_le_bytes())),
    }
    Ok(out)
}

/// Set elements `offset..` of `dst` from [`read_bytes`] bytes (whole elements, whole Q8_0
/// blocks).
pub(crate) fn write_bytes(dst: &mut Tensor, offset: usize, bytes: &[u8]) -> Result<()> {
    const OP: &str = "write_bytes";
    let dtype = dst.dtype();
    let (unit_bytes, unit_elems) = match dtype {
        DType::F32 | DType::U32 => (4, 1),
        DType::F16 => (2, 1),
        DType::Q8_0 => (Q8_0_BYTES, Q8_0_BLOCK),
    };
    if !bytes.len().is_multiple_of(unit_bytes) {
        return shape_err(
            OP,
            format!("{} bytes are not whole {dtype:?} elements", bytes.len()),
        );
    }
    let n = bytes.len() / unit_bytes * unit_elems;
    let len = dst.len();
    let r = range(OP, "dst", dtype, len, offset, n)?;
    match buf_mut(OP, "dst", dst)? {
        HostBuf::F32(v) => {
            for (d, c) in v[r].iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        HostBuf::F16(v) => {
            for (d, c) in v[r].iter_mut().zip(bytes.chunks_exact(2)) {
                *d = f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        HostBuf::Q8_0(v) => v[q8_off(r.start)..q8_off(r.end)].copy_from_slice(bytes),
        HostBuf::U32(v) => {
            for (d, c) in v[r].iter_mut().zip(bytes.chunks_exact(4)) {
                *d = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
    Ok(())
}

/// `dst[dst_off..dst_off + n] = src[src_off..src_off + n]` (same dtype).
pub(crate) fn copy(
    src: &Tensor,
    src_off: usize,
    dst: &mut Tensor,
    dst_off: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "copy";
    if src.dtype() != dst.dtype() {
        return shape_err(
            OP,
            format!("src is {:?}, dst is {:?}", src.dtype(), dst.dtype()),
        );
    }
    let (dtype, dst_len) = (dst.dtype(), dst.len());
    let rs = range(OP, "src", dtype, src.len(), src_off, n)?;
    let rd = range(OP, "dst", dtype, dst_len, dst_off, n)?;
    match (buf(OP, "src", src)?, buf_mut(OP, "dst", dst)?) {
        (HostBuf::F32(s), HostBuf::F32(d)) => d[rd].copy_from_slice(&s[rs]),
        (HostBuf::F16(s), HostBuf::F16(d)) => d[rd].copy_from_slice(&s[rs]),
        (HostBuf::U32(s), HostBuf::U32(d)) => d[rd].copy_from_slice(&s[rs]),
        (HostBuf::Q8_0(s), HostBuf::Q8_0(d)) => d[q8_off(rd.start)..q8_off(rd.end)]
            .copy_from_slice(&s[q8_off(rs.start)..q8_off(rs.end)]),
        // The buffer variant always follows the tensor's dtype (made only by `alloc`).
        _ => return shape_err(OP, "buffer types differ"),
    }
    Ok(())
}

/// Copy elements `src..src + n` of `t` to `dst..dst + n` (ranges must not overlap).
pub(crate) fn copy_within(t: &mut Tensor, src: usize, dst: usize, n: usize) -> Result<()> {
    const OP: &str = "copy_within";
    let (dtype, len) = (t.dtype(), t.len());
    let rs = range(OP, "src", dtype, len, src, n)?;
    let rd = range(OP, "dst", dtype, len, dst, n)?;
    if n > 0 && rs.start < rd.end && rd.start < rs.end {
        return shape_err(OP, format!("ranges {rs:?} and {rd:?} overlap"));
    }
    match buf_mut(OP, "t", t)? {
        HostBuf::F32(v) => v.copy_within(rs, rd.start),
        HostBuf::F16(v) => v.copy_within(rs, rd.start),
        HostBuf::U32(v) => v.copy_within(rs, rd.start),
        HostBuf::Q8_0(v) => v.copy_within(q8_off(rs.start)..q8_off(rs.end), q8_off(rd.start)),
    }
    Ok(())
}

// ---- batches --------------------------------------------------------------------------------

/// Check a batch description's invariants (see [`BatchDesc`]) and keep it. Also refuses a
/// slot that appears twice (two sequences would update the same recurrent state).
pub(crate) fn prepare_batch(desc: BatchDesc) -> Result<Batch> {
    const OP: &str = "prepare_batch";
    let n = desc.tokens.len();
    check_len(OP, "positions", desc.positions.len(), n)?;
    let mut next = 0usize;
    let mut slots: Vec<usize> = Vec::with_capacity(desc.seqs.len());
    for (i, s) in desc.seqs.iter().enumerate() {
        if s.start != next || s.len == 0 || s.len > n - next {
            return shape_err(
                OP,
                format!(
                    "sequence {i} (start {}, len {}) does not continue the tiling of {n} \
                     tokens at {next}",
                    s.start, s.len
                ),
            );
        }
        let p = &desc.positions[s.start..s.start + s.len];
        if p.iter()
            .enumerate()
            .any(|(j, &q)| Some(q as usize) != s.pos0.checked_add(j))
        {
            return shape_err(
                OP,
                format!(
                    "positions of sequence {i} are not consecutive from {}",
                    s.pos0
                ),
            );
        }
        let table_end = s.table_start.checked_add(s.table_len);
        if table_end.is_none_or(|e| e > desc.block_tables.len()) {
            return shape_err(OP, format!("block table of sequence {i} out of range"));
        }
        if desc.block_size > 0 {
            let covered = s.table_len.checked_mul(desc.block_size);
            if covered.is_none_or(|c| c < s.pos0.saturating_add(s.len)) {
                return shape_err(
                    OP,
                    format!(
                        "block table of sequence {i} ({} blocks of {}) does not cover \
                         positions 0..{}",
                        s.table_len,
                        desc.block_size,
                        s.pos0 + s.len
                    ),
                );
            }
        }
        if slots.contains(&s.slot) {
            return shape_err(OP, format!("slot {} appears twice", s.slot));
        }
        slots.push(s.slot);
        next += s.len;
    }
    if next != n {
        return shape_err(OP, format!("sequences cover {next} of {n} tokens"));
    }
    if let Some(r) = desc.logit_rows.iter().find(|&&r| r as usize >= n) {
        return shape_err(OP, format!("logit row {r} out of range ({n} tokens)"));
    }
    Ok(Batch::from_parts(desc, Box::new(CpuBatch)))
}

/// The host description of a CPU batch.
pub(crate) fn desc<'a>(op: &'static str, b: &'a Batch) -> Result<&'a BatchDesc> {
    b.dev::<CpuBatch>()
        .map(|_| b.desc())
        .ok_or(BackendError::ForeignHandle { op, what: "batch" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_every_dtype() {
        for dt in [DType::F32, DType::F16, DType::Q8_0, DType::U32] {
            let mut t = alloc(dt, 96).unwrap();
            assert!(read_bytes(&t, 0, 96).unwrap().iter().all(|&b| b == 0));
            let bytes: Vec<u8> = (0..dt.bytes(64)).map(|i| (i * 7 % 251) as u8).collect();
            write_bytes(&mut t, 32, &bytes).unwrap();
            assert_eq!(read_bytes(&t, 32, 64).unwrap(), bytes, "{dt:?}");
            copy_within(&mut t, 32, 0, 32).unwrap();
            assert_eq!(read_bytes(&t, 0, 32).unwrap(), bytes[..dt.bytes(32)]);
            assert!(copy_within(&mut t, 0, 16, 32).is_err());
        }
        let mut q = alloc(DType::Q8_0, 64).unwrap();
        assert!(read_bytes(&q, 16, 32).is_err());
        assert!(write_bytes(&mut q, 0, &[0; 33]).is_err());
        assert!(alloc(DType::Q8_0, 33).is_err());
    }
}
