//! Handles on memory a backend owns: [`Tensor`] (activations, caches, recurrent states, small
//! f32 parameters) and [`Weight`] (an uploaded, possibly repacked, model matrix).
//!
//! A handle is opaque: it holds the backend's own buffer type behind `dyn Any`, and only the
//! backend that made it can read it (others answer [`BackendError::ForeignHandle`]). Where the
//! memory lives is the backend's business: host memory for the CPU backend, device memory
//! (HBM) for CUDA. The host reaches a tensor's contents only through the backend's
//! `read_*`/`write_*` calls, which for a device copy over the bus.

use std::any::Any;
use std::sync::Arc;

use kapitsa_base::GgmlType;

use crate::{BackendError, Result};

/// Element type of a [`Tensor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float (activations, recurrent states, parameters).
    F32,
    /// IEEE half (the default KV cache type).
    F16,
    /// ggml Q8_0 blocks: every 32 elements are an f16 scale and 32 `i8` quants, 34 bytes
    /// (the 8-bit KV cache). Lengths and offsets are in elements and must be multiples of 32.
    Q8_0,
    /// 32-bit unsigned integers (token ids, sampled ids).
    U32,
}

/// Elements per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per Q8_0 block: f16 scale + 32 `i8` quants.
pub const Q8_0_BYTES: usize = 34;

impl DType {
    /// Bytes that `n` elements occupy (for Q8_0, `n` rounded up to whole blocks).
    pub fn bytes(self, n: usize) -> usize {
        match self {
            DType::F32 | DType::U32 => 4 * n,
            DType::F16 => 2 * n,
            DType::Q8_0 => n.div_ceil(Q8_0_BLOCK) * Q8_0_BYTES,
        }
    }

    /// Whether element offset `i` can start or end a byte range (Q8_0: block boundaries).
    pub fn is_boundary(self, i: usize) -> bool {
        self != DType::Q8_0 || i.is_multiple_of(Q8_0_BLOCK)
    }
}

/// A backend-owned buffer of `len` elements of `dtype`, flat (shapes are given to each op).
pub struct Tensor {
    dtype: DType,
    len: usize,
    buf: Box<dyn Any + Send + Sync>,
}

impl Tensor {
    /// Wrap a backend's buffer (for backend implementations).
    pub fn from_parts(dtype: DType, len: usize, buf: Box<dyn Any + Send + Sync>) -> Tensor {
        Tensor { dtype, len, buf }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes it occupies.
    pub fn n_bytes(&self) -> usize {
        self.dtype.bytes(self.len)
    }

    /// The backend's buffer, if it is a `T` (for backend implementations).
    pub fn buf<T: 'static>(&self) -> Option<&T> {
        self.buf.downcast_ref()
    }

    /// See [`Tensor::buf`].
    pub fn buf_mut<T: 'static>(&mut self) -> Option<&mut T> {
        self.buf.downcast_mut()
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({:?} x {})", self.dtype, self.len)
    }
}

/// Read-only bytes kept alive by an owner (a memory map, a file read into memory, an owned
/// conversion), shared between the model source and the CPU backend's weights without a copy.
#[derive(Clone)]
pub struct HostBytes {
    /// Keeps the memory behind `ptr` alive (only held, never read).
    #[allow(dead_code)]
    owner: Arc<dyn Any + Send + Sync>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: `HostBytes` is a read-only view of memory that `owner` keeps alive and never
// mutates (see `HostBytes::new`); sharing or sending a read-only view between threads is sound.
unsafe impl Send for HostBytes {}
// SAFETY: as for `Send`: only shared reads happen through it.
unsafe impl Sync for HostBytes {}

impl HostBytes {
    /// A view of `bytes`, which `owner` keeps alive.
    ///
    /// # Safety
    /// `bytes` must stay valid and unchanged for as long as `owner` (or any clone of it) is
    /// alive: it must point into memory that `owner` owns and never mutates (a read-only
    /// memory map, an immutable `Vec`, ...).
    pub unsafe fn new(owner: Arc<dyn Any + Send + Sync>, bytes: &[u8]) -> HostBytes {
        HostBytes {
            owner,
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        }
    }

    /// Bytes owned by this handle.
    pub fn from_vec(v: Vec<u8>) -> HostBytes {
        let owner: Arc<Vec<u8>> = Arc::new(v);
        let (ptr, len) = (owner.as_ptr(), owner.len());
        HostBytes { owner, ptr, len }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `new`'s contract (or `from_vec`, whose `Vec` the owner holds and never
        // mutates) keeps `ptr..ptr+len` valid and unchanged while `self.owner` lives, and
        // `self` holds a clone of it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBytes({} bytes)", self.len)
    }
}

/// A weight as the model source hands it to [`crate::Backend::upload_weight`]: ggml-typed
/// rows in host memory. `shape` is slowest dim first (PyTorch order); the last dim is the
/// row (`n_in`): `[n_out, n_in]` for a matrix, `[n_expert, n_out, n_in]` for stacked experts.
#[derive(Debug, Clone)]
pub struct HostWeight {
    /// Name in the source file (for errors).
    pub name: String,
    /// Element type of the rows.
    pub dtype: GgmlType,
    /// Shape, slowest dim first.
    pub shape: Vec<usize>,
    /// The rows, `dtype.row_bytes(n_in)` bytes each.
    pub bytes: HostBytes,
}

/// An uploaded model weight: `shape` as in [`HostWeight`], memory owned by the backend that
/// made it (the CPU backend keeps the host bytes, CUDA copies them to the device and may
/// repack them).
pub struct Weight {
    /// Name in the source file.
    pub name: String,
    /// Element type as stored in the file (a backend may keep a repacked copy).
    pub dtype: GgmlType,
    /// Shape, slowest dim first.
    pub shape: Vec<usize>,
    buf: Box<dyn Any + Send + Sync>,
}

impl Weight {
    /// Wrap a backend's buffer (for backend implementations).
    pub fn from_parts(
        name: String,
        dtype: GgmlType,
        shape: Vec<usize>,
        buf: Box<dyn Any + Send + Sync>,
    ) -> Weight {
        Weight {
            name,
            dtype,
            shape,
            buf,
        }
    }

    /// The backend's buffer, if it is a `T` (for backend implementations).
    pub fn buf<T: 'static>(&self) -> Option<&T> {
        self.buf.downcast_ref()
    }

    /// `[n_out, n_in]` of a 2-D weight, or a shape error naming `op`.
    pub fn dims2(&self, op: &'static str) -> Result<(usize, usize)> {
        match self.shape[..] {
            [n_out, n_in] => Ok((n_out, n_in)),
            _ => Err(BackendError::Shape {
                op,
                msg: format!("'{}' is not 2-D: {:?}", self.name, self.shape),
            }),
        }
    }

    /// `[n_expert, n_out, n_in]` of a 3-D weight, or a shape error naming `op`.
    pub fn dims3(&self, op: &'static str) -> Result<(usize, usize, usize)> {
        match self.shape[..] {
            [e, n_out, n_in] => Ok((e, n_out, n_in)),
            _ => Err(BackendError::Shape {
                op,
                msg: format!("'{}' is not 3-D: {:?}", self.name, self.shape),
            }),
        }
    }
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weight({} {} {:?})", self.name, self.dtype, self.shape)
    }
}
