//! Device memory of the CUDA backend: tensors, uploaded weights and the per-step batch
//! arrays, and the host<->device copies. The CUDA twin of the CPU backend's src/buffers.rs.
//!
//! # Layouts (all in device memory, HBM)
//! - A [`Tensor`] holds a `CudaSlice` whose element type follows its [`DType`]: `f32` (F32),
//!   `u16` (F16 bits), `u8` (Q8_0 bytes: 34-byte blocks, f16 scale then 32 `i8`, as on the
//!   CPU) and `u32` (U32). Element counts are the tensor's; a zero-length tensor still owns a
//!   one-element allocation (the driver rejects empty ones). Fresh tensors are zero-filled.
//! - Allocations come from the device's stream-ordered memory pool (`device::make_pool`: the
//!   default pool, or with a `--gpu-memory` budget one capped at what the budget leaves),
//!   whose release threshold is raised at start, so freed activations are reused without
//!   driver calls: the pool is the caching allocator.
//! - A [`Batch`] holds a [`DevBatch`]: one `u32` array uploaded once per step,
//!   `[tokens | positions | token->sequence | sequence records (6 u32 each: slot, start, len,
//!   pos0, table_start, table_len) | block tables | logit rows | attention query tiles
//!   ((sequence, first row) pairs) | the split attention's tokens]` (kernels/common.cuh
//!   `SEQ_*`; empty parts hold one padding entry).
//!   Kernels read every per-step value from it, never from launch arguments, except the
//!   counts that set the grid.
//! - A [`Weight`] holds a [`DevWeight`]: the matmul module's [`CudaWeight`], a 2-D matrix or a
//!   3-D stack of expert matrices.
//!
//! Every handle is checked to belong to this backend (its stream, or its owner id) before
//! use; another backend's handle is [`BackendError::ForeignHandle`].

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};
use kapitsa_backend::{
    shape_err, BackendError, Batch, DType, DeviceMemory, HostWeight, Result, Tensor, Weight,
    Q8_0_BLOCK, Q8_0_BYTES,
};

use crate::batch::DevBatch;
use crate::device::{self, dev_err};
use crate::matmul::CudaWeight;

/// Reads of at least this many floats go through the backend's page-locked staging buffer.
const PINNED_READ_MIN: usize = 1 << 14;
use crate::CudaBackend;

/// A device element type and the tensor dtype it stores.
pub(crate) trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + 'static {
    /// The tensor dtype whose buffers use this element type.
    const DTYPE: DType;
}
impl Elem for f32 {
    const DTYPE: DType = DType::F32;
}
impl Elem for u16 {
    const DTYPE: DType = DType::F16;
}
impl Elem for u8 {
    const DTYPE: DType = DType::Q8_0;
}
impl Elem for u32 {
    const DTYPE: DType = DType::U32;
}

/// Device storage elements of `n` tensor elements of `dtype` (bytes for Q8_0).
fn storage_len(dtype: DType, n: usize) -> usize {
    match dtype {
        DType::Q8_0 => dtype.bytes(n),
        _ => n,
    }
}

/// A tensor's device storage: its elements, and for f32 activation rows the int8 copy the
/// pre-norm may write beside them ([`X8Rows`]). Every mutable access to the elements goes
/// through [`CudaBackend::buf_mut`], which marks that copy stale.
pub(crate) struct DevBuf<T> {
    /// The elements (see the module's layouts).
    data: CudaSlice<T>,
    /// The int8 rows of `data`, where a kernel wrote them with it.
    x8: Option<X8Rows>,
}

impl<T> DevBuf<T> {
    fn new(data: CudaSlice<T>) -> DevBuf<T> {
        DevBuf { data, x8: None }
    }
}

/// The int8 form of an f32 tensor's rows (kernels/matmul.cu's x8 layout: per row
/// `gemv_x8_row_bytes(width)` bytes, rows back to back), for the int8-activation GEMVs: the
/// RMS norm writes it with its output (ops.cu `rms_norm_to_x8_f32`), so a GEMV reading those
/// rows needs no quantisation launch of its own.
pub(crate) struct X8Rows {
    buf: CudaSlice<u8>,
    /// Row width in elements (the GEMV's `n_in`).
    width: usize,
    /// Whether `buf` holds the tensor's current values (cleared by every mutable access).
    valid: bool,
}

/// An uploaded weight, in device memory.
pub(crate) struct DevWeight {
    /// Id of the backend that uploaded it.
    pub(crate) owner: u64,
    /// The device copy: a matrix or a stack of expert matrices.
    pub(crate) w: CudaWeight,
}

impl CudaBackend {
    // ---- handles ---------------------------------------------------------------------------

    /// Whether `s` was allocated on this backend's stream.
    fn owns<T>(&self, s: &CudaSlice<T>) -> bool {
        s.stream().cu_stream() == self.stream.cu_stream()
    }

    /// The device buffer of `t`, which must be of `T`'s dtype and belong to this backend.
    pub(crate) fn buf<'a, T: Elem>(
        &self,
        t: &'a Tensor,
        op: &'static str,
        what: &'static str,
    ) -> Result<&'a CudaSlice<T>> {
        if t.dtype() != T::DTYPE {
            return shape_err(
                op,
                format!("{what} is {:?}, expected {:?}", t.dtype(), T::DTYPE),
            );
        }
        match t.buf::<DevBuf<T>>() {
            Some(s) if self.owns(&s.data) => Ok(&s.data),
            _ => Err(BackendError::ForeignHandle { op, what }),
        }
    }

    /// Mutable twin of [`CudaBackend::buf`].
    pub(crate) fn buf_mut<'a, T: Elem>(
        &self,
        t: &'a mut Tensor,
        op: &'static str,
        what: &'static str,
    ) -> Result<&'a mut CudaSlice<T>> {
        if t.dtype() != T::DTYPE {
            return shape_err(
                op,
                format!("{what} is {:?}, expected {:?}", t.dtype(), T::DTYPE),
            );
        }
        Ok(&mut self.dev_buf_mut::<T>(t, op, what)?.data)
    }

    /// The storage of `t` (dtype checked by the callers), its int8 rows marked stale: the
    /// one mutable way in.
    fn dev_buf_mut<'a, T: Elem>(
        &self,
        t: &'a mut Tensor,
        op: &'static str,
        what: &'static str,
    ) -> Result<&'a mut DevBuf<T>> {
        let stream = self.stream.cu_stream();
        match t.buf_mut::<DevBuf<T>>() {
            Some(s) if s.data.stream().cu_stream() == stream => {
                if let Some(x8) = s.x8.as_mut() {
                    x8.valid = false;
                }
                Ok(s)
            }
            _ => Err(BackendError::ForeignHandle { op, what }),
        }
    }

    /// The int8 rows of the f32 tensor `t` (`x8_row_bytes(width)` bytes a row), where the
    /// last write of `t` produced them for rows of `width` elements; `None` otherwise.
    pub(crate) fn x8_rows<'a>(&self, t: &'a Tensor, width: usize) -> Option<&'a CudaSlice<u8>> {
        let b = t.buf::<DevBuf<f32>>()?;
        match &b.x8 {
            Some(x) if x.valid && x.width == width && self.owns(&b.data) => Some(&x.buf),
            _ => None,
        }
    }

    /// The f32 elements of `t` (`rows * width` of them, checked) and a buffer for their int8
    /// rows (allocated on first use, kept with the tensor), for a kernel that writes both;
    /// the int8 rows count as current only after [`CudaBackend::x8_written`].
    pub(crate) fn f32_with_x8_mut<'a>(
        &self,
        t: &'a mut Tensor,
        rows: usize,
        width: usize,
        op: &'static str,
        what: &'static str,
    ) -> Result<(&'a mut CudaSlice<f32>, &'a mut CudaSlice<u8>)> {
        kapitsa_backend::check_len(op, what, t.len(), rows * width)?;
        if t.dtype() != DType::F32 {
            return shape_err(op, format!("{what} is {:?}, expected F32", t.dtype()));
        }
        let bytes = rows * crate::matmul::x8_row_bytes(width);
        let b = self.dev_buf_mut::<f32>(t, op, what)?;
        if b.x8.as_ref().is_some_and(|x| x.buf.len() < bytes) {
            b.x8 = None;
        }
        let x = match b.x8 {
            Some(ref mut x) => x,
            None => b.x8.insert(X8Rows {
                buf: self.scratch::<u8>(bytes)?,
                width,
                valid: false,
            }),
        };
        x.width = width;
        Ok((&mut b.data, &mut x.buf))
    }

    /// Mark the int8 rows of `t` that [`CudaBackend::f32_with_x8_mut`] handed out as written
    /// (the kernel that wrote them is queued).
    pub(crate) fn x8_written(&self, t: &mut Tensor) {
        if let Some(x) = t.buf_mut::<DevBuf<f32>>().and_then(|b| b.x8.as_mut()) {
            x.valid = true;
        }
    }

    /// An f32 tensor's buffer after checking its length.
    pub(crate) fn f32_len<'a>(
        &self,
        t: &'a Tensor,
        want: usize,
        op: &'static str,
        what: &'static str,
    ) -> Result<&'a CudaSlice<f32>> {
        kapitsa_backend::check_len(op, what, t.len(), want)?;
        self.buf(t, op, what)
    }

    /// Mutable twin of [`CudaBackend::f32_len`].
    pub(crate) fn f32_len_mut<'a>(
        &self,
        t: &'a mut Tensor,
        want: usize,
        op: &'static str,
        what: &'static str,
    ) -> Result<&'a mut CudaSlice<f32>> {
        kapitsa_backend::check_len(op, what, t.len(), want)?;
        self.buf_mut(t, op, what)
    }

    /// The batch's device arrays.
    pub(crate) fn dev_batch<'a>(&self, b: &'a Batch, op: &'static str) -> Result<&'a DevBatch> {
        match b.dev::<DevBatch>() {
            Some(d) if d.owner == self.id => Ok(d),
            _ => Err(BackendError::ForeignHandle { op, what: "batch" }),
        }
    }

    /// The device copy of a weight (a matrix or an expert stack).
    pub(crate) fn dev_weight<'a>(&self, w: &'a Weight, op: &'static str) -> Result<&'a CudaWeight> {
        match w.buf::<DevWeight>() {
            Some(d) if d.owner == self.id => Ok(&d.w),
            _ => Err(BackendError::ForeignHandle { op, what: "weight" }),
        }
    }

    /// The matrix of a 2-D weight.
    pub(crate) fn matrix<'a>(&self, w: &'a Weight, op: &'static str) -> Result<&'a CudaWeight> {
        let m = self.dev_weight(w, op)?;
        if w.shape.len() != 2 || m.n_experts() != 1 {
            return shape_err(op, format!("'{}' is not 2-D: {:?}", w.name, w.shape));
        }
        Ok(m)
    }

    // ---- allocation --------------------------------------------------------------------------

    /// [`kapitsa_backend::Backend::memory`]: the driver's free and total bytes and this
    /// backend's pool (used now, reserved high-water mark), with the budget's cap.
    pub(crate) fn memory_impl(&self) -> Result<DeviceMemory> {
        use cudarc::driver::sys::CUgraphMem_attribute as G;
        use cudarc::driver::sys::CUmemPool_attribute as A;
        let (in_use, total) = device::mem_in_use(&self.ctx)?;
        let free = total.saturating_sub(in_use);
        // the recorded steps' allocations live in the device's graph memory, beside the pool
        let graph = device::Pool::graph_attr(&self.ctx, G::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?;
        let graph_peak =
            device::Pool::graph_attr(&self.ctx, G::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?;
        let used = self.pool.attr(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)? + graph;
        let reserved = self.pool.attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)? + graph;
        // (the two high-water marks may fall at different times: their sum bounds the peak)
        let peak = self.pool.attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)? + graph_peak;
        // the pool's cached free blocks are available to this backend, not to the driver
        let mut available = free + reserved.saturating_sub(used);
        if let Some(b) = self.pool.budget {
            available = available.min(b.saturating_sub(self.pool.base).saturating_sub(used));
        }
        Ok(DeviceMemory {
            total,
            free,
            available,
            used,
            peak,
            base: self.pool.base,
            budget: self.pool.budget,
        })
    }

    /// A zero-filled device buffer of `n` elements (one element when `n == 0`).
    pub(crate) fn zeros<T: Elem>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(dev_err)
    }

    /// A device buffer of `n` elements whose contents are unspecified: only for scratch that
    /// the next kernel overwrites completely.
    pub(crate) fn scratch<T: Elem>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: the memory is unset, not invalid: every caller writes all `n` elements on
        // the stream before any read (device memory has no Rust validity invariant).
        unsafe { self.stream.alloc::<T>(n.max(1)) }.map_err(dev_err)
    }

    /// A new tensor of `len` elements of `dtype`, zero-filled.
    pub(crate) fn alloc_tensor(&self, dtype: DType, len: usize) -> Result<Tensor> {
        if dtype == DType::Q8_0 && !len.is_multiple_of(Q8_0_BLOCK) {
            return shape_err(
                "alloc",
                format!("a Q8_0 tensor of {len} elements (not whole blocks)"),
            );
        }
        let n = storage_len(dtype, len);
        let buf: Box<dyn std::any::Any + Send + Sync> = match dtype {
            DType::F32 => Box::new(DevBuf::new(self.zeros::<f32>(n)?)),
            DType::F16 => Box::new(DevBuf::new(self.zeros::<u16>(n)?)),
            DType::Q8_0 => Box::new(DevBuf::new(self.zeros::<u8>(n)?)),
            DType::U32 => Box::new(DevBuf::new(self.zeros::<u32>(n)?)),
        };
        Ok(Tensor::from_parts(dtype, len, buf))
    }

    /// A new tensor of `len` elements of `dtype` whose contents are unspecified (no memset
    /// launch): [`kapitsa_backend::Backend::alloc_scratch`].
    pub(crate) fn alloc_scratch_tensor(&self, dtype: DType, len: usize) -> Result<Tensor> {
        if dtype == DType::Q8_0 && !len.is_multiple_of(Q8_0_BLOCK) {
            return shape_err(
                "alloc_scratch",
                format!("a Q8_0 tensor of {len} elements (not whole blocks)"),
            );
        }
        let n = storage_len(dtype, len);
        let buf: Box<dyn std::any::Any + Send + Sync> = match dtype {
            DType::F32 => Box::new(DevBuf::new(self.scratch::<f32>(n)?)),
            DType::F16 => Box::new(DevBuf::new(self.scratch::<u16>(n)?)),
            DType::Q8_0 => Box::new(DevBuf::new(self.scratch::<u8>(n)?)),
            DType::U32 => Box::new(DevBuf::new(self.scratch::<u32>(n)?)),
        };
        Ok(Tensor::from_parts(dtype, len, buf))
    }

    // ---- byte views (any dtype) ----------------------------------------------------------------

    /// Byte range of elements `off..off + n` of `t`, checked against its length and (Q8_0)
    /// block boundaries.
    fn byte_range(t: &Tensor, off: usize, n: usize, op: &'static str) -> Result<(usize, usize)> {
        let end = off.checked_add(n).filter(|&e| e <= t.len());
        let Some(end) = end else {
            return shape_err(
                op,
                format!("elements {off}..{off}+{n} of a tensor of {}", t.len()),
            );
        };
        let d = t.dtype();
        if !d.is_boundary(off) || !d.is_boundary(end) {
            return shape_err(
                op,
                format!("Q8_0 range {off}..{end} is not on 32-element blocks"),
            );
        }
        Ok((d.bytes(off), d.bytes(end)))
    }

    /// The whole buffer of `t` as bytes.
    fn bytes_of<'a>(
        &self,
        t: &'a Tensor,
        op: &'static str,
        what: &'static str,
    ) -> Result<CudaView<'a, u8>> {
        fn view<'a, T: Elem>(s: &'a CudaSlice<T>) -> Option<CudaView<'a, u8>> {
            // SAFETY: any device bytes are valid `u8`s; the length is the slice's byte size.
            unsafe { s.transmute::<u8>(s.num_bytes()) }
        }
        let v = match t.dtype() {
            DType::F32 => view(self.buf::<f32>(t, op, what)?),
            DType::F16 => view(self.buf::<u16>(t, op, what)?),
            DType::Q8_0 => view(self.buf::<u8>(t, op, what)?),
            DType::U32 => view(self.buf::<u32>(t, op, what)?),
        };
        v.ok_or_else(|| BackendError::Device(format!("{op}: byte view of {what}")))
    }

    /// Mutable twin of `bytes_of`.
    fn bytes_of_mut<'a>(
        &self,
        t: &'a mut Tensor,
        op: &'static str,
        what: &'static str,
    ) -> Result<CudaViewMut<'a, u8>> {
        fn view<'a, T: Elem>(s: &'a mut CudaSlice<T>) -> Option<CudaViewMut<'a, u8>> {
            let n = s.num_bytes();
            // SAFETY: any bytes written through the view are valid values of `T` (f32, u16,
            // u8 and u32 have no invalid bit patterns); the length is the slice's byte size.
            unsafe { s.transmute_mut::<u8>(n) }
        }
        let v = match t.dtype() {
            DType::F32 => view(self.buf_mut::<f32>(t, op, what)?),
            DType::F16 => view(self.buf_mut::<u16>(t, op, what)?),
            DType::Q8_0 => view(self.buf_mut::<u8>(t, op, what)?),
            DType::U32 => view(self.buf_mut::<u32>(t, op, what)?),
        };
        v.ok_or_else(|| BackendError::Device(format!("{op}: byte view of {what}")))
    }

    // ---- copies ----------------------------------------------------------------------------------

    pub(crate) fn write_f32_impl(
        &self,
        dst: &mut Tensor,
        offset: usize,
        src: &[f32],
    ) -> Result<()> {
        const OP: &str = "write_f32";
        let (a, b) = Self::byte_range(dst, offset, src.len(), OP)?;
        let s = self.buf_mut::<f32>(dst, OP, "dst")?;
        if src.is_empty() {
            return Ok(());
        }
        let mut v = s.slice_mut(a / 4..b / 4);
        self.stream.memcpy_htod(src, &mut v).map_err(dev_err)
    }

    pub(crate) fn read_f32_impl(&self, src: &Tensor, offset: usize, dst: &mut [f32]) -> Result<()> {
        const OP: &str = "read_f32";
        let (a, b) = Self::byte_range(src, offset, dst.len(), OP)?;
        let s = self.buf::<f32>(src, OP, "src")?;
        if dst.is_empty() {
            return Ok(());
        }
        let src = s.slice(a / 4..b / 4);
        if dst.len() < PINNED_READ_MIN {
            self.stream.memcpy_dtoh(&src, dst).map_err(dev_err)?;
            return self.stream.synchronize().map_err(dev_err);
        }
        // through the page-locked staging buffer: a copy into pageable memory is staged by
        // the driver in small pieces at a fraction of the link's rate (logits rows are MBs)
        let mut staging = self
            .staging
            .lock()
            .map_err(|_| BackendError::Device("read_f32: staging buffer poisoned".into()))?;
        if staging.as_ref().is_none_or(|p| p.len() < dst.len()) {
            *staging = None; // free the old buffer first
                             // SAFETY: the memory is unset until the copy below fills the part that is read;
                             // flags 0: cached (not write-combined) host memory, which the host reads back.
            let p = unsafe {
                self.ctx
                    .alloc_pinned_with_flags::<f32>(dst.len().next_power_of_two(), 0)
            }
            .map_err(dev_err)?;
            *staging = Some(p);
        }
        let Some(pinned) = staging.as_mut() else {
            return Err(BackendError::Device("read_f32: no staging buffer".into()));
        };
        // (a plain slice of the page-locked memory: the driver sees it is pinned; the copy
        // takes exactly dst.len() elements)
        let host = pinned.as_mut_slice().map_err(dev_err)?;
        let Some(part) = host.get_mut(..dst.len()) else {
            return Err(BackendError::Device(
                "read_f32: staging buffer too short".into(),
            ));
        };
        self.stream.memcpy_dtoh(&src, part).map_err(dev_err)?;
        self.stream.synchronize().map_err(dev_err)?;
        dst.copy_from_slice(part);
        Ok(())
    }

    pub(crate) fn read_bytes_impl(&self, src: &Tensor, offset: usize, n: usize) -> Result<Vec<u8>> {
        const OP: &str = "read_bytes";
        let (a, b) = Self::byte_range(src, offset, n, OP)?;
        let v = self.bytes_of(src, OP, "src")?;
        let mut out = vec![0u8; b - a];
        if a < b {
            self.stream
                .memcpy_dtoh(&v.slice(a..b), &mut out[..])
                .map_err(dev_err)?;
            self.stream.synchronize().map_err(dev_err)?;
        }
        Ok(out)
    }

    pub(crate) fn write_bytes_impl(
        &self,
        dst: &mut Tensor,
        offset: usize,
        bytes: &[u8],
    ) -> Result<()> {
        const OP: &str = "write_bytes";
        let n = match dst.dtype() {
            DType::F32 | DType::U32 if bytes.len().is_multiple_of(4) => bytes.len() / 4,
            DType::F16 if bytes.len().is_multiple_of(2) => bytes.len() / 2,
            DType::Q8_0 if bytes.len().is_multiple_of(Q8_0_BYTES) => {
                bytes.len() / Q8_0_BYTES * Q8_0_BLOCK
            }
            d => {
                return shape_err(
                    OP,
                    format!("{} bytes are not whole {d:?} elements", bytes.len()),
                )
            }
        };
        let (a, b) = Self::byte_range(dst, offset, n, OP)?;
        let mut v = self.bytes_of_mut(dst, OP, "dst")?;
        if a == b {
            return Ok(());
        }
        let mut part = v.slice_mut(a..b);
        self.stream.memcpy_htod(bytes, &mut part).map_err(dev_err)
    }

    pub(crate) fn copy_impl(
        &self,
        src: &Tensor,
        src_off: usize,
        dst: &mut Tensor,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "copy";
        if src.dtype() != dst.dtype() {
            return shape_err(OP, format!("{:?} into {:?}", src.dtype(), dst.dtype()));
        }
        let (sa, sb) = Self::byte_range(src, src_off, n, OP)?;
        let (da, db) = Self::byte_range(dst, dst_off, n, OP)?;
        let s = self.bytes_of(src, OP, "src")?;
        let mut d = self.bytes_of_mut(dst, OP, "dst")?;
        if sa == sb {
            return Ok(());
        }
        let mut dpart = d.slice_mut(da..db);
        self.stream
            .memcpy_dtod(&s.slice(sa..sb), &mut dpart)
            .map_err(dev_err)
    }

    pub(crate) fn copy_within_impl(
        &self,
        t: &mut Tensor,
        src: usize,
        dst: usize,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "copy_within";
        let (sa, sb) = Self::byte_range(t, src, n, OP)?;
        let (da, db) = Self::byte_range(t, dst, n, OP)?;
        if sa == sb {
            return Ok(());
        }
        if sa < db && da < sb {
            return shape_err(OP, format!("ranges {src}..+{n} and {dst}..+{n} overlap"));
        }
        let mut v = self.bytes_of_mut(t, OP, "tensor")?;
        let len = sb - sa;
        if sa < da {
            let (lo, mut hi) = v.split_at_mut(da);
            let mut d = hi.slice_mut(0..len);
            self.stream
                .memcpy_dtod(&lo.slice(sa..sb), &mut d)
                .map_err(dev_err)
        } else {
            let (mut lo, hi) = v.split_at_mut(sa);
            let mut d = lo.slice_mut(da..db);
            self.stream
                .memcpy_dtod(&hi.slice(0..len), &mut d)
                .map_err(dev_err)
        }
    }

    // ---- weights and batches --------------------------------------------------------------------

    pub(crate) fn upload_weight_impl(&self, w: &HostWeight) -> Result<Weight> {
        // 2-D matrices and 3-D expert stacks alike (the matmul module checks the shape)
        let dw = self.mm.upload(&self.stream, w)?;
        Ok(Weight::from_parts(
            w.name.clone(),
            w.dtype,
            w.shape.clone(),
            Box::new(DevWeight {
                owner: self.id,
                w: dw,
            }),
        ))
    }
}
