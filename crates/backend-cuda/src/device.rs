//! The driver side of the backend: finding a usable GPU without panicking, making the context
//! and stream, loading the embedded cubins into [`Kernels`], mapping driver errors to
//! [`BackendError`], and launch-shape helpers.
//!
//! Contract: nothing here panics on a machine without a driver or a GPU. cudarc resolves
//! every driver symbol lazily and *panics* when `libcuda` is missing, so every entry point
//! checks [`cudarc::driver::sys::is_culib_present`] first and wraps the first driver calls in
//! `catch_unwind` as a second guard.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{
    result, sys, CudaContext, CudaFunction, CudaModule, DriverError, LaunchConfig,
};
use cudarc::nvrtc::Ptx;
use kapitsa_backend::BackendError;

/// The kernels compiled by build.rs: (file stem of `kernels/<stem>.cu`, sm_90a cubin bytes).
/// A blob is empty when the crate was built with `KAPITSA_SKIP_KERNELS=1` and no nvcc.
mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}
pub(crate) use embedded::KERNELS;

/// The answer when the binary carries no kernels.
pub(crate) const NO_KERNELS: &str = "this binary was built without CUDA kernels \
    (KAPITSA_SKIP_KERNELS=1 and no nvcc at build time); run scripts/install-nvcc.sh and rebuild \
    with `--features cuda`";

/// A driver error as a backend error (`OutOfMemory` for allocation failures).
pub(crate) fn dev_err(e: DriverError) -> BackendError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        BackendError::OutOfMemory(format!("{e}"))
    } else {
        BackendError::Device(format!("{e}"))
    }
}

/// `Unavailable` unless the driver library can be loaded.
fn check_driver() -> Result<(), BackendError> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library by its usual names
    // and drops the handle; it has no preconditions.
    let present = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    if present {
        Ok(())
    } else {
        Err(BackendError::Unavailable(
            "no CUDA driver found (libcuda.so could not be loaded)".into(),
        ))
    }
}

/// `Unavailable` unless every kernel blob is present.
pub(crate) fn check_kernels() -> Result<(), BackendError> {
    if KERNELS.is_empty() || KERNELS.iter().any(|(_, b)| b.is_empty()) {
        return Err(BackendError::Unavailable(NO_KERNELS.into()));
    }
    Ok(())
}

/// Runs `f` (the first driver calls), turning a cudarc panic (missing library or symbol)
/// into `Unavailable`.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, DriverError>) -> Result<T, BackendError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(BackendError::Unavailable(format!("{what}: {e}"))),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("driver library panicked");
            let first = msg.lines().next().unwrap_or(msg);
            Err(BackendError::Unavailable(format!("{what}: {first}")))
        }
    }
}

/// Facts about one device, read without creating a context.
pub(crate) struct DeviceInfo {
    pub(crate) ordinal: usize,
    pub(crate) name: String,
    pub(crate) total_mem: usize,
    pub(crate) cc: (i32, i32),
    pub(crate) count: usize,
}

impl DeviceInfo {
    /// `"cuda:0 NVIDIA H200 (141 GB, sm_90)"`.
    pub(crate) fn describe(&self) -> String {
        format!(
            "cuda:{} {} ({} GB, sm_{}{})",
            self.ordinal,
            self.name,
            (self.total_mem as f64 / 1e9).round() as u64,
            self.cc.0,
            self.cc.1
        )
    }
}

/// Driver present, device `ordinal` exists, and its name, memory and compute capability.
pub(crate) fn device_info(ordinal: usize) -> Result<DeviceInfo, BackendError> {
    check_driver()?;
    let count = guarded("CUDA driver", || {
        result::init()?;
        result::device::get_count()
    })?
    .max(0) as usize;
    if count == 0 {
        return Err(BackendError::Unavailable("no CUDA device found".into()));
    }
    if ordinal >= count {
        return Err(BackendError::Unavailable(format!(
            "cuda:{ordinal}: there are only {count} CUDA device(s)"
        )));
    }
    guarded("CUDA device query", || {
        let dev = result::device::get(ordinal as i32)?;
        let name = result::device::get_name(dev)?;
        // SAFETY: `dev` is a valid device handle from `device::get` after `init`.
        let total_mem = unsafe { result::device::total_mem(dev) }?;
        // SAFETY: as above; the attributes are plain integer queries.
        let major = unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
        }?;
        // SAFETY: as above.
        let minor = unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )
        }?;
        Ok(DeviceInfo {
            ordinal,
            name,
            total_mem,
            cc: (major, minor),
            count,
        })
    })
}

/// `Unavailable` unless the device can run the sm_90a cubins.
pub(crate) fn check_arch(info: &DeviceInfo) -> Result<(), BackendError> {
    if info.cc != (9, 0) {
        return Err(BackendError::Unavailable(format!(
            "{}: the kernels are built for sm_90a (H100/H200), this GPU is sm_{}{}",
            info.describe(),
            info.cc.0,
            info.cc.1
        )));
    }
    Ok(())
}

/// The primary context of `ordinal` (guarded against cudarc panics).
pub(crate) fn make_context(ordinal: usize) -> Result<Arc<CudaContext>, BackendError> {
    guarded("CUDA context", || CudaContext::new(ordinal))
}

/// The memory pool the backend's stream-ordered allocations come from, and the budget it
/// enforces.
pub(crate) struct Pool {
    /// The pool (the device's default pool, or one made for a budget); null where the device
    /// has no stream-ordered allocator.
    pub(crate) pool: sys::CUmemoryPool,
    /// Whether `pool` was made here (then it is the device's current pool until drop).
    made: bool,
    /// Device memory in use before the backend's first allocation (context, libraries, other
    /// processes).
    pub(crate) base: usize,
    /// The budget (`--gpu-memory`): the most the device may hold for this process.
    pub(crate) budget: Option<usize>,
}

// SAFETY: a CUmemoryPool handle is a driver object usable from any thread of the process; the
// backend only reads its attributes and (in drop) destroys it once.
unsafe impl Send for Pool {}
// SAFETY: as above: attribute reads are thread-safe driver calls.
unsafe impl Sync for Pool {}

/// Bytes of device memory in use (`total - free`) and the device's size, with `ctx` current.
pub(crate) fn mem_in_use(ctx: &Arc<CudaContext>) -> Result<(usize, usize), BackendError> {
    ctx.bind_to_thread().map_err(dev_err)?;
    let (free, total) = result::mem_get_info().map_err(dev_err)?;
    Ok((total.saturating_sub(free), total))
}

/// The pool the backend allocates from. Freed device memory stays in it instead of going back
/// to the driver at every synchronisation (release threshold: never), so the stream-ordered
/// allocator serves the per-step activations from its cache (the backend's caching
/// allocator). With a `budget` (bytes the device may hold for this process), a pool of at
/// most `budget` minus what is in use now is made and set as the device's current pool, so
/// every allocation of the backend beyond it fails with `OutOfMemory`.
pub(crate) fn make_pool(
    ctx: &Arc<CudaContext>,
    budget: Option<usize>,
) -> Result<Pool, BackendError> {
    let (base, _) = mem_in_use(ctx)?;
    if !ctx.has_async_alloc() {
        if budget.is_some() {
            return Err(BackendError::Unavailable(
                "this GPU or driver has no stream-ordered allocator, so --gpu-memory cannot be \
                 enforced"
                    .into(),
            ));
        }
        return Ok(Pool {
            pool: std::ptr::null_mut(),
            made: false,
            base,
            budget,
        });
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let made = match budget {
        None => {
            // SAFETY: `pool` is a valid out-pointer; the device handle comes from a live context.
            unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
                .result()
                .map_err(dev_err)?;
            false
        }
        Some(b) => {
            const GRAIN: usize = 2 << 20;
            let room = b.saturating_sub(base) / GRAIN * GRAIN;
            if room == 0 {
                return Err(BackendError::Setting(format!(
                    "--gpu-memory {} leaves nothing for the model: the device already holds {} \
                     (the CUDA context and libraries, and any other process)",
                    kapitsa_backend::gib(b),
                    kapitsa_backend::gib(base)
                )));
            }
            // SAFETY: CUmemPoolProps is a plain C struct for which all-zero bytes are valid
            // (null pointers, zero enums and sizes); the fields that matter are set below.
            let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
            props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = ctx.cu_device();
            props.maxSize = room;
            // SAFETY: `pool` is a valid out-pointer and `props` a fully initialised props
            // struct that outlives the call.
            unsafe { sys::cuMemPoolCreate(&mut pool, &props) }
                .result()
                .map_err(dev_err)?;
            // SAFETY: `pool` was just created for this device; making it the current pool
            // routes the stream-ordered allocations of this device to it.
            unsafe { sys::cuDeviceSetMemPool(ctx.cu_device(), pool) }
                .result()
                .map_err(dev_err)?;
            true
        }
    };
    let mut threshold = u64::MAX;
    // SAFETY: `pool` is a live pool of this device; the release threshold attribute takes a
    // pointer to a u64, which `threshold` is.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(dev_err)?;
    Ok(Pool {
        pool,
        made,
        base,
        budget,
    })
}

impl Pool {
    /// A u64 attribute of the pool (0 without a pool).
    pub(crate) fn attr(&self, a: sys::CUmemPool_attribute) -> Result<usize, BackendError> {
        if self.pool.is_null() {
            return Ok(0);
        }
        let mut v = 0u64;
        // SAFETY: `self.pool` is a live pool; the memory attributes take a pointer to a u64.
        unsafe { sys::cuMemPoolGetAttribute(self.pool, a, (&mut v as *mut u64).cast()) }
            .result()
            .map_err(dev_err)?;
        Ok(usize::try_from(v).unwrap_or(usize::MAX))
    }

    /// A u64 attribute of the device's graph memory (the allocations made inside recorded
    /// steps, which the driver keeps apart from the pools). `ctx` must be current.
    pub(crate) fn graph_attr(
        ctx: &Arc<CudaContext>,
        a: sys::CUgraphMem_attribute,
    ) -> Result<usize, BackendError> {
        let mut v = 0u64;
        // SAFETY: the device handle comes from a live context; the reserved-memory attributes
        // take a pointer to a u64.
        unsafe {
            sys::cuDeviceGetGraphMemAttribute(ctx.cu_device(), a, (&mut v as *mut u64).cast())
        }
        .result()
        .map_err(dev_err)?;
        Ok(usize::try_from(v).unwrap_or(usize::MAX))
    }

    /// Give the device its default pool back and destroy a pool made for a budget (its
    /// memory is released once the last allocation from it is freed). `ctx` must be current.
    pub(crate) fn release(&mut self, ctx: &Arc<CudaContext>) {
        if !self.made {
            return;
        }
        self.made = false;
        let mut default: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointer, live context's device; `self.pool` was made here and is
        // destroyed once (made is cleared first). Errors are ignored: this runs in drop.
        unsafe {
            if sys::cuDeviceGetDefaultMemPool(&mut default, ctx.cu_device())
                .result()
                .is_ok()
            {
                let _ = sys::cuDeviceSetMemPool(ctx.cu_device(), default).result();
            }
            let _ = sys::cuMemPoolDestroy(self.pool).result();
        }
    }
}

/// Load cubin `stem` of the embedded table.
fn load_module(ctx: &Arc<CudaContext>, stem: &str) -> Result<Arc<CudaModule>, BackendError> {
    let bytes = KERNELS
        .iter()
        .find(|(s, _)| *s == stem)
        .map(|(_, b)| *b)
        .filter(|b| !b.is_empty())
        .ok_or_else(|| BackendError::Unavailable(NO_KERNELS.into()))?;
    let m = ctx
        .load_module(Ptx::from_binary(bytes.to_vec()))
        .map_err(|e| BackendError::Unavailable(format!("loading the {stem} kernels: {e}")))?;
    crate::prof::note_module(&m);
    Ok(m)
}

/// Declares [`Kernels`]: one `CudaFunction` field per `extern "C"` kernel, grouped by the
/// cubin (kernels/<module>.cu) that holds it.
macro_rules! kernel_table {
    ($($module:literal => [$($name:ident),* $(,)?]),* $(,)?) => {
        /// The backend's own kernels (all but the matmul ones), loaded from the embedded
        /// cubins. Field names are the kernels' `extern "C"` names.
        pub(crate) struct Kernels {
            $($(pub(crate) $name: CudaFunction,)*)*
        }

        impl Kernels {
            /// Load every kernel (an `Unavailable` error names the first one missing).
            pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, BackendError> {
                $(
                    let m = load_module(ctx, $module)?;
                    $(
                        let $name = m.load_function(stringify!($name)).map_err(|e| {
                            BackendError::Unavailable(format!(
                                "kernel {} in {}.cu: {e}", stringify!($name), $module
                            ))
                        })?;
                    )*
                )*
                let k = Kernels { $($($name,)*)* };
                k.configure()?;
                Ok(k)
            }
        }
    };
}

kernel_table! {
    "ops" => [
        add_f32, add_bias_f32, mul_sigmoid_f32, silu_mul_f32, relu2_f32, split_cols_f32,
        gather_rows_f32, scatter_rows_f32, rms_norm_f32, rms_norm_to_f32, rms_norm_to_x8_f32, l2_norm_f32,
        gated_rms_norm_f32,
        gated_group_rms_norm_f32, rope_neox_f32, rope_neox_qk_f32, gdn_gates_f32, softplus_bias_f32,
        argmax_rows_f32, layer_norm_f32, gelu_f32, rope_table_f32,
    ],
    "attention" => [
        kv_write_f32, kv_write_f16, kv_write_q8_0,
        attn_split_f32_2, attn_split_f32_4, attn_split_f32_8,
        attn_split_f16_2, attn_split_f16_4, attn_split_f16_8,
        attn_split_q8_0_2, attn_split_q8_0_4, attn_split_q8_0_8,
        attn_split_gqa_f16_4, attn_split_gqa_f16_8,
        attn_combine,
        attn_tile_f32_8, attn_tile_f32_16, attn_tile_f32_32,
        attn_tile_f16_8, attn_tile_f16_16, attn_tile_f16_32,
        attn_tile_q8_0_8, attn_tile_q8_0_16, attn_tile_q8_0_32,
        attn_mma_f16_64, attn_mma_f16_128, attn_mma_f16_256,
    ],
    "recurrent" => [
        conv1d_causal_f32, gdn_preamble_f32, gdn_recurrent_f32, gdn_fused_f32, gdn_chunk_prep_f32,
        gdn_chunk_state_f32,
        gdn_chunk_out_f32, mamba2_preamble_f32, mamba2_recurrent_f32, mamba2_chunk_prep_f32,
        mamba2_chunk_state_f32, mamba2_chunk_out_f32,
    ],
    "ffn" => [
        moe_topk_f32, moe_topk_warp_f32, moe_router_topk_f32, moe_finish_f32, moe_shared_add_f32,
    ],
}

/// Dynamic shared memory the tiled attention kernels may use (head_dim 256 needs ~84 KB).
pub(crate) const TILE_SMEM_MAX: u32 = 96 * 1024;

/// Dynamic shared memory of the tensor-core attention for head_dim `d` (kernels/attention.cu
/// `attn_mma_smem`): the queries split in two f16 terms for 4 warps, a K tile and a
/// transposed V tile of 32 positions, 32 row indices.
pub(crate) const fn attn_mma_smem(d: usize) -> usize {
    2 * (2 * 4 * 16 * (d + 8) + 32 * (d + 8) + d * (32 + 8)) + 8 * 32
}

impl Kernels {
    /// Per-kernel attributes: the tiled attention kernels (scalar and tensor-core) and the
    /// chunked scans (Gated DeltaNet, Mamba2) may use more than the default 48 KB of dynamic
    /// shared memory.
    fn configure(&self) -> Result<(), BackendError> {
        let tile = TILE_SMEM_MAX as usize;
        let (prep, state, out) = crate::recurrent::gdn_chunk_smem();
        let (m_prep, m_state, m_out) = crate::recurrent::mamba2_chunk_smem();
        for (f, bytes) in [
            (&self.attn_tile_f32_8, tile),
            (&self.attn_tile_f32_16, tile),
            (&self.attn_tile_f32_32, tile),
            (&self.attn_tile_f16_8, tile),
            (&self.attn_tile_f16_16, tile),
            (&self.attn_tile_f16_32, tile),
            (&self.attn_tile_q8_0_8, tile),
            (&self.attn_tile_q8_0_16, tile),
            (&self.attn_tile_q8_0_32, tile),
            (&self.attn_mma_f16_64, attn_mma_smem(64)),
            (&self.attn_mma_f16_128, attn_mma_smem(128)),
            (&self.attn_mma_f16_256, attn_mma_smem(256)),
            (&self.gdn_chunk_prep_f32, prep),
            (&self.gdn_chunk_state_f32, state),
            (&self.gdn_chunk_out_f32, out),
            (&self.mamba2_chunk_prep_f32, m_prep),
            (&self.mamba2_chunk_state_f32, m_state),
            (&self.mamba2_chunk_out_f32, m_out),
        ] {
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| {
                BackendError::Unavailable(format!(
                    "setting a kernel's shared memory to {bytes} bytes: {e}"
                ))
            })?;
        }
        Ok(())
    }
}

/// Threads per block of the element-wise kernels.
pub(crate) const ELEM_THREADS: u32 = 256;

/// A 1-D grid-stride launch over `n` elements (the grid is capped; kernels loop).
pub(crate) fn elem_cfg(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(ELEM_THREADS as u64).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ELEM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads for a one-block-per-row kernel over rows of `width`: a multiple of 32, at most 256.
pub(crate) fn row_threads(width: usize) -> u32 {
    (width.div_ceil(32) * 32).clamp(32, 256) as u32
}

/// A grid's y or z extent `n` (the hardware takes at most 65535), or a shape error naming
/// `what` (a plural: "sequences", "expert tiles").
pub(crate) fn grid_yz(op: &'static str, what: &str, n: usize) -> Result<u32, BackendError> {
    match u32::try_from(n) {
        Ok(v) if v <= 65_535 => Ok(v),
        _ => Err(BackendError::Shape {
            op,
            msg: format!("{n} {what} (at most 65535)"),
        }),
    }
}

/// `v` as a kernel's `uint32_t` argument, or a shape error naming `op` and `what`.
pub(crate) fn u32_arg(op: &'static str, what: &str, v: usize) -> Result<u32, BackendError> {
    u32::try_from(v).map_err(|_| BackendError::Shape {
        op,
        msg: format!("{what} = {v} does not fit the kernels' 32-bit indices"),
    })
}
