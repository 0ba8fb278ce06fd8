//! The CUDA backend: [`kapitsa_backend::Backend`] on an NVIDIA GPU (kernels built for sm_90a:
//! H100/H200), behind the cargo feature `cuda`.
//!
//! # Building
//! Without the feature this crate needs no CUDA at all: it exports the same [`CudaBackend`],
//! whose constructor answers [`BackendError::Unavailable`], and [`probe`]. With `cuda`,
//! build.rs compiles `kernels/*.cu` with nvcc (`$NVCC`, `PATH`, or what
//! `scripts/install-nvcc.sh` installs) into cubins embedded in the binary, and cudarc loads
//! the driver, cuBLAS and nothing else at run time (`dlopen`; nothing links against CUDA).
//!
//! # Contract
//! - **Memory.** Tensors, weights and batch arrays live in device memory (HBM); the host sees
//!   them only through `read_*`/`write_*`, which copy over the bus and (reads) wait for the
//!   queued work. src/buffers.rs documents the layouts (the same byte encodings as the CPU
//!   backend: f32, f16, Q8_0 34-byte blocks, u32).
//! - **Ordering.** Every op is queued on one non-default stream of the backend, in call order;
//!   ops return once queued (not finished), except those that bring results to the host
//!   (`read_*`, `argmax_rows`, and `moe`, which reads the routing back). Device faults of
//!   queued work surface at the next synchronising call as [`BackendError::Device`].
//! - **Per-step values** (positions, slots, sequence ranges, block tables, logit rows) are
//!   read by the kernels from the batch arrays uploaded by `prepare_batch`, not passed as
//!   launch arguments, so a later CUDA graph can replay a step with new batch contents.
//! - **Errors.** Lengths and shapes are checked on the host before any launch ([`BackendError::Shape`]);
//!   handles of another backend are [`BackendError::ForeignHandle`]; no GPU, no driver or a
//!   binary without kernels is a one-line [`BackendError::Unavailable`], never a panic.
//!
//! Files mirror the CPU backend's: `ops`, `attention`, `recurrent`, `ffn`, `buffers` (with
//! their kernels in `kernels/<same name>.cu`); `matmul` holds the quantised matrix kernels'
//! interface and `device` the driver plumbing.

use std::sync::Arc;

use kapitsa_backend::{Backend, BackendError};

/// Declares `fn $name() -> bool`: whether the environment switch `$var` is on (anything but
/// `0`; unset: on), read once. The backend's A/B switches for measurements.
#[cfg(feature = "cuda")]
macro_rules! env_switch {
    ($(#[$doc:meta])* $vis:vis fn $name:ident = $var:literal) => {
        $(#[$doc])*
        $vis fn $name() -> bool {
            static CELL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            *CELL.get_or_init(|| std::env::var($var).map_or(true, |v| v != "0"))
        }
    };
}

#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
mod batch;
#[cfg(feature = "cuda")]
mod buffers;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod ffn;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod matmul;
#[cfg(feature = "cuda")]
mod moe;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod prof;
#[cfg(feature = "cuda")]
mod recurrent;

/// The answer of a build without the `cuda` feature.
pub const NOT_BUILT: &str = "this kapitsa was built without CUDA support (cargo feature `cuda`)";

/// The CUDA backend on GPU `ordinal`, or a one-line [`BackendError::Unavailable`] saying why
/// it cannot run (no driver, no such device, a build without the `cuda` feature or without
/// kernels). The engine chooses devices at run time through this, with no `cfg` of its own.
///
/// `budget` (`--gpu-memory`, bytes): the most device memory the process may hold on that GPU,
/// the CUDA context included; the backend's allocations beyond it fail with `OutOfMemory`
/// ([`kapitsa_backend::DeviceMemory`] reports the figures).
pub fn open(ordinal: usize, budget: Option<usize>) -> Result<Arc<dyn Backend>, BackendError> {
    #[cfg(feature = "cuda")]
    {
        Ok(Arc::new(CudaBackend::with_budget(ordinal, budget)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, budget);
        Err(BackendError::Unavailable(NOT_BUILT.into()))
    }
}

/// One line describing GPU 0 (`"cuda:0 NVIDIA H200 (141 GB, sm_90)"`, plus the device count
/// when there are several), or a one-line [`BackendError::Unavailable`] saying why no GPU is
/// usable (no driver, no device, another architecture, a build without CUDA or kernels).
/// Creates no context.
pub fn probe() -> Result<String, BackendError> {
    #[cfg(feature = "cuda")]
    {
        device::check_kernels()?;
        let info = device::device_info(0)?;
        device::check_arch(&info)?;
        let mut s = info.describe();
        if info.count > 1 {
            s.push_str(&format!(", {} devices", info.count));
        }
        Ok(s)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(BackendError::Unavailable(NOT_BUILT.into()))
    }
}

#[cfg(feature = "cuda")]
pub use imp::CudaBackend;

#[cfg(feature = "cuda")]
mod imp {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    use cudarc::cublas::CudaBlas;
    use cudarc::driver::{CudaContext, CudaStream};
    use kapitsa_backend::{
        AttnShape, Backend, BackendError, Batch, BatchDesc, DType, Device, DeviceMemory, Epilogue,
        GdnConv, GdnMixerIo, GdnShape, HostWeight, KvLayer, Mamba2Conv, Mamba2Shape, MlpWeights,
        MoeWeights, Recording, Result, RopeDesc, Tensor, Weight,
    };

    use crate::device::{self, dev_err, DeviceInfo, Kernels, KERNELS};
    use crate::matmul::MatmulKernels;

    /// Ids of backend instances (weights and batches remember which backend made them).
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);

    /// The CUDA backend on one GPU: a context, one non-default stream every op is queued on,
    /// the kernels loaded from the embedded cubins, the matmul kernels and a cuBLAS handle on
    /// that stream.
    pub struct CudaBackend {
        pub(crate) id: u64,
        pub(crate) info: DeviceInfo,
        pub(crate) stream: Arc<CudaStream>,
        pub(crate) blas: CudaBlas,
        pub(crate) k: Kernels,
        pub(crate) mm: MatmulKernels,
        pub(crate) ctx: Arc<CudaContext>,
        /// In-graph kernel timing (`KAPITSA_CUDA_PROF=1`, src/prof.rs).
        pub(crate) prof: Option<crate::prof::Prof>,
        /// The memory pool every allocation comes from, with the budget it enforces.
        pub(crate) pool: device::Pool,
        /// Page-locked host memory that large reads (logits rows) are copied through; grown on
        /// demand (src/buffers.rs `read_f32_impl`).
        pub(crate) staging: std::sync::Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
        /// Zeroed per-token block counters of the fused MoE router (src/moe.rs
        /// `ROUTER_COUNTERS`); each launch leaves them zero again.
        pub(crate) router_counts: cudarc::driver::CudaSlice<u32>,
        /// Zeroed per-(sequence, k head) counters of the fused Gated DeltaNet mixer
        /// (src/recurrent.rs `GDN_COUNTERS`); each launch leaves them zero again.
        pub(crate) gdn_counts: cudarc::driver::CudaSlice<u32>,
    }

    impl Drop for CudaBackend {
        fn drop(&mut self) {
            if let Some(p) = &self.prof {
                let r = p.report();
                if !r.is_empty() {
                    eprint!("{r}");
                }
            }
            if self.ctx.bind_to_thread().is_ok() {
                self.pool.release(&self.ctx);
            }
        }
    }

    impl CudaBackend {
        /// The backend on GPU `ordinal`. A one-line [`BackendError::Unavailable`] when there
        /// is no usable GPU: no driver library, no such device, not sm_90 (the cubins are
        /// built for sm_90a), no cuBLAS library, or a binary built without kernels.
        pub fn new(ordinal: usize) -> Result<CudaBackend> {
            Self::with_budget(ordinal, None)
        }

        /// [`CudaBackend::new`] with a memory budget: `budget` bytes are the most the device
        /// may hold for this process (the context and libraries included); the backend's
        /// allocations come from a pool of what is left of it (see [`crate::open`]).
        pub fn with_budget(ordinal: usize, budget: Option<usize>) -> Result<CudaBackend> {
            device::check_kernels()?;
            let info = device::device_info(ordinal)?;
            device::check_arch(&info)?;
            let ctx = device::make_context(ordinal)?;
            // SAFETY: no device buffer exists yet, and every buffer of this backend is used
            // on its one stream only, so cudarc's cross-stream event tracking is not needed.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(dev_err)?;
            let k = Kernels::load(&ctx)?;
            let mm = MatmulKernels::load(&ctx, KERNELS)?;
            let blas = make_blas(&stream)?;
            // after the context, modules and cuBLAS, so the budget's base counts them
            let pool = device::make_pool(&ctx, budget)?;
            let prof = match crate::prof::prof_on() {
                true => Some(crate::prof::Prof::new(&stream)?),
                false => None,
            };
            let router_counts = stream
                .alloc_zeros::<u32>(crate::moe::ROUTER_COUNTERS)
                .map_err(dev_err)?;
            let gdn_counts = stream
                .alloc_zeros::<u32>(crate::recurrent::GDN_COUNTERS)
                .map_err(dev_err)?;
            Ok(CudaBackend {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                info,
                stream,
                blas,
                k,
                mm,
                ctx,
                prof,
                pool,
                staging: std::sync::Mutex::new(None),
                router_counts,
                gdn_counts,
            })
        }
    }

    /// A cuBLAS handle on `stream`, or `Unavailable` when the library cannot be loaded.
    fn make_blas(stream: &Arc<CudaStream>) -> Result<CudaBlas> {
        let unavailable = |why: String| {
            BackendError::Unavailable(format!(
                "cuBLAS is not usable ({why}); put the CUDA 13 library directory \
                 (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH"
            ))
        };
        // SAFETY: `is_culib_present` only tries to dlopen the library by its usual names.
        let present =
            catch_unwind(|| unsafe { cudarc::cublas::sys::is_culib_present() }).unwrap_or(false);
        if !present {
            return Err(unavailable("libcublas.so not found".into()));
        }
        match catch_unwind(AssertUnwindSafe(|| CudaBlas::new(stream.clone()))) {
            Ok(Ok(b)) => Ok(b),
            Ok(Err(e)) => Err(unavailable(format!("{e}"))),
            Err(_) => Err(unavailable("a cuBLAS symbol is missing".into())),
        }
    }

    impl Backend for CudaBackend {
        fn describe(&self) -> String {
            self.info.describe()
        }

        fn device(&self) -> Device {
            Device::Cuda(self.info.ordinal)
        }

        fn memory(&self) -> Option<DeviceMemory> {
            self.memory_impl().ok()
        }

        fn upload_weight(&self, w: &HostWeight) -> Result<Weight> {
            self.upload_weight_impl(w)
        }

        fn alloc(&self, dtype: DType, len: usize) -> Result<Tensor> {
            self.alloc_tensor(dtype, len)
        }

        fn alloc_scratch(&self, dtype: DType, len: usize) -> Result<Tensor> {
            self.alloc_scratch_tensor(dtype, len)
        }

        fn write_f32(&self, dst: &mut Tensor, offset: usize, src: &[f32]) -> Result<()> {
            self.write_f32_impl(dst, offset, src)
        }

        fn read_f32(&self, src: &Tensor, offset: usize, dst: &mut [f32]) -> Result<()> {
            self.read_f32_impl(src, offset, dst)
        }

        fn read_bytes(&self, src: &Tensor, offset: usize, n: usize) -> Result<Vec<u8>> {
            self.read_bytes_impl(src, offset, n)
        }

        fn write_bytes(&self, dst: &mut Tensor, offset: usize, bytes: &[u8]) -> Result<()> {
            self.write_bytes_impl(dst, offset, bytes)
        }

        fn copy(
            &self,
            src: &Tensor,
            src_off: usize,
            dst: &mut Tensor,
            dst_off: usize,
            n: usize,
        ) -> Result<()> {
            self.copy_impl(src, src_off, dst, dst_off, n)
        }

        fn copy_within(&self, t: &mut Tensor, src: usize, dst: usize, n: usize) -> Result<()> {
            self.copy_within_impl(t, src, dst, n)
        }

        fn prepare_batch(&self, desc: BatchDesc) -> Result<Batch> {
            self.prepare_batch_impl(desc)
        }

        fn can_record(&self) -> bool {
            self.can_record_impl()
        }

        fn prepare_batch_for_recording(
            &self,
            desc: BatchDesc,
            table_capacity: usize,
        ) -> Result<Batch> {
            self.prepare_batch_for_recording_impl(desc, table_capacity)
        }

        fn refill_batch(&self, batch: &mut Batch, desc: BatchDesc) -> Result<bool> {
            self.refill_batch_impl(batch, desc)
        }

        fn begin_recording(&self) -> Result<()> {
            self.begin_recording_impl()
        }

        fn end_recording(&self) -> Result<Recording> {
            self.end_recording_impl()
        }

        fn replay(&self, rec: &Recording) -> Result<()> {
            self.replay_impl(rec)
        }

        fn synchronize(&self) -> Result<()> {
            self.stream.synchronize().map_err(dev_err)?;
            self.ctx.check_err().map_err(dev_err)
        }

        fn matmul(&self, w: &Weight, x: &Tensor, n_tok: usize, y: &mut Tensor) -> Result<()> {
            self.matmul_impl(w, x, n_tok, y)
        }

        fn matmul_with(
            &self,
            w: &Weight,
            x: &Tensor,
            n_tok: usize,
            y: &mut Tensor,
            ep: Epilogue<'_>,
        ) -> Result<()> {
            self.matmul_with_impl(w, x, n_tok, y, ep)
        }

        fn matmul_many(
            &self,
            ws: &[&Weight],
            x: &Tensor,
            n_tok: usize,
            ys: &mut [&mut Tensor],
        ) -> Result<()> {
            // the products of one format in shared launches (no epilogues)
            let eps = vec![Epilogue::default(); ws.len()];
            if !crate::ffn::matmul_many_on() && ws.len() == ys.len() {
                for ((w, y), ep) in ws.iter().zip(ys.iter_mut()).zip(&eps) {
                    self.matmul_with_impl(w, x, n_tok, y, *ep)?;
                }
                return Ok(());
            }
            self.matmul_many_with_impl(ws, x, n_tok, ys, &eps)
        }

        fn matmul_many_with(
            &self,
            ws: &[&Weight],
            x: &Tensor,
            n_tok: usize,
            ys: &mut [&mut Tensor],
            eps: &[Epilogue<'_>],
        ) -> Result<()> {
            self.matmul_many_with_impl(ws, x, n_tok, ys, eps)
        }

        fn embed(&self, w: &Weight, batch: &Batch, out: &mut Tensor) -> Result<()> {
            self.embed_impl(w, batch, out)
        }

        fn mlp(&self, w: &MlpWeights, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
            self.mlp_impl(w, x, n, out)
        }

        fn mlp_add(&self, w: &MlpWeights, x: &Tensor, n: usize, y: &mut Tensor) -> Result<()> {
            self.mlp_add_impl(w, x, n, y)
        }

        fn moe(&self, w: &MoeWeights, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
            self.moe_impl(w, x, n, out, false)
        }

        fn moe_add(&self, w: &MoeWeights, x: &Tensor, n: usize, y: &mut Tensor) -> Result<()> {
            self.moe_impl(w, x, n, y, true)
        }

        fn norm_moe_add(
            &self,
            w: &MoeWeights,
            norm: (&Tensor, f32),
            h: &mut Tensor,
            n: usize,
            y: &mut Tensor,
        ) -> Result<()> {
            self.norm_moe_add_impl(w, norm, h, n, y)
        }

        fn moe_reads_back(&self, w: &MoeWeights, n: usize) -> bool {
            self.moe_reads_back_impl(w, n)
        }

        fn rms_norm(&self, x: &mut Tensor, width: usize, w: &Tensor, eps: f32) -> Result<()> {
            self.rms_norm_impl(x, width, w, eps)
        }

        fn rms_norm_to(
            &self,
            x: &Tensor,
            out: &mut Tensor,
            width: usize,
            w: &Tensor,
            eps: f32,
        ) -> Result<()> {
            self.rms_norm_to_impl(x, out, width, w, eps)
        }

        fn add(&self, y: &mut Tensor, x: &Tensor) -> Result<()> {
            self.add_impl(y, x)
        }

        fn add_bias(&self, x: &mut Tensor, b: &Tensor) -> Result<()> {
            self.add_bias_impl(x, b)
        }

        fn mul_sigmoid(&self, x: &mut Tensor, gate: &Tensor) -> Result<()> {
            self.mul_sigmoid_impl(x, gate)
        }

        fn split_cols(
            &self,
            src: &Tensor,
            rows: usize,
            widths: &[usize],
            outs: &mut [&mut Tensor],
        ) -> Result<()> {
            self.split_cols_impl(src, rows, widths, outs)
        }

        fn gather_logit_rows(
            &self,
            x: &Tensor,
            width: usize,
            batch: &Batch,
            out: &mut Tensor,
        ) -> Result<()> {
            self.gather_logit_rows_impl(x, width, batch, out)
        }

        fn rope(
            &self,
            x: &mut Tensor,
            n_heads: usize,
            head_dim: usize,
            rope: RopeDesc,
            batch: &Batch,
        ) -> Result<()> {
            self.rope_impl(x, n_heads, head_dim, rope, batch)
        }

        fn rope_qk(
            &self,
            q: &mut Tensor,
            k: &mut Tensor,
            n_head: usize,
            n_head_kv: usize,
            head_dim: usize,
            rope: RopeDesc,
            batch: &Batch,
        ) -> Result<()> {
            self.rope_qk_impl(q, k, n_head, n_head_kv, head_dim, rope, batch)
        }

        fn l2_norm(&self, x: &mut Tensor, width: usize, eps: f32, scale: f32) -> Result<()> {
            self.l2_norm_impl(x, width, eps, scale)
        }

        fn layer_norm(
            &self,
            x: &mut Tensor,
            width: usize,
            w: &Tensor,
            b: &Tensor,
            eps: f32,
        ) -> Result<()> {
            self.layer_norm_impl(x, width, w, b, eps)
        }

        fn gelu(&self, x: &mut Tensor, tanh_approx: bool) -> Result<()> {
            self.gelu_impl(x, tanh_approx)
        }

        fn rope_table(
            &self,
            x: &mut Tensor,
            n_heads: usize,
            head_dim: usize,
            cos: &Tensor,
            sin: &Tensor,
        ) -> Result<()> {
            self.rope_table_impl(x, n_heads, head_dim, cos, sin)
        }

        fn gdn_gates(
            &self,
            beta: &mut Tensor,
            g: &mut Tensor,
            dt_bias: &Tensor,
            a_neg: &Tensor,
        ) -> Result<()> {
            self.gdn_gates_impl(beta, g, dt_bias, a_neg)
        }

        fn softplus_bias(&self, dt: &mut Tensor, bias: &Tensor) -> Result<()> {
            self.softplus_bias_impl(dt, bias)
        }

        fn gated_rms_norm(
            &self,
            x: &mut Tensor,
            z: &Tensor,
            width: usize,
            w: &Tensor,
            eps: f32,
        ) -> Result<()> {
            self.gated_rms_norm_impl(x, z, width, w, eps)
        }

        fn gated_group_rms_norm(
            &self,
            y: &mut Tensor,
            z: &Tensor,
            d_inner: usize,
            n_groups: usize,
            w: &Tensor,
            eps: f32,
        ) -> Result<()> {
            self.gated_group_rms_norm_impl(y, z, d_inner, n_groups, w, eps)
        }

        fn kv_write(
            &self,
            k: &Tensor,
            v: &Tensor,
            cache: KvLayer<'_>,
            batch: &Batch,
        ) -> Result<()> {
            self.kv_write_impl(k, v, cache, batch)
        }

        fn attention(
            &self,
            shape: AttnShape,
            q: &Tensor,
            k_cache: &Tensor,
            v_cache: &Tensor,
            batch: &Batch,
            out: &mut Tensor,
        ) -> Result<()> {
            self.attention_impl(shape, q, k_cache, v_cache, batch, out)
        }

        fn conv1d_causal(
            &self,
            x: &Tensor,
            channels: usize,
            k: usize,
            w: &Tensor,
            bias: Option<&Tensor>,
            silu: bool,
            conv_state: &mut Tensor,
            batch: &Batch,
            out: &mut Tensor,
        ) -> Result<()> {
            self.conv1d_causal_impl(x, channels, k, w, bias, silu, conv_state, batch, out)
        }

        fn gdn_preamble(
            &self,
            shape: GdnShape,
            w: &GdnConv<'_>,
            qkv: &Tensor,
            conv_state: &mut Tensor,
            batch: &Batch,
            beta: &mut Tensor,
            g: &mut Tensor,
            qkv_out: [&mut Tensor; 3],
        ) -> Result<()> {
            self.gdn_preamble_impl(shape, w, qkv, conv_state, batch, beta, g, qkv_out)
        }

        fn gdn_mixer(
            &self,
            shape: GdnShape,
            w: &GdnConv<'_>,
            norm: (&Tensor, f32),
            io: GdnMixerIo<'_>,
            batch: &Batch,
        ) -> Result<()> {
            self.gdn_mixer_impl(shape, w, norm, io, batch)
        }

        fn gdn(
            &self,
            shape: GdnShape,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            g: &Tensor,
            beta: &Tensor,
            state: &mut Tensor,
            batch: &Batch,
            out: &mut Tensor,
        ) -> Result<()> {
            self.gdn_impl(shape, q, k, v, g, beta, state, batch, out)
        }

        fn mamba2_preamble(
            &self,
            shape: Mamba2Shape,
            w: &Mamba2Conv<'_>,
            proj: &Tensor,
            conv_state: &mut Tensor,
            batch: &Batch,
            outs: [&mut Tensor; 5],
        ) -> Result<()> {
            self.mamba2_preamble_impl(shape, w, proj, conv_state, batch, outs)
        }

        fn mamba2(
            &self,
            shape: Mamba2Shape,
            x: &Tensor,
            dt: &Tensor,
            a: &Tensor,
            b: &Tensor,
            c: &Tensor,
            d: &Tensor,
            state: &mut Tensor,
            batch: &Batch,
            y: &mut Tensor,
        ) -> Result<()> {
            self.mamba2_impl(shape, x, dt, a, b, c, d, state, batch, y)
        }

        fn argmax_rows(&self, x: &Tensor, width: usize) -> Result<Vec<u32>> {
            self.argmax_rows_impl(x, width)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a usable GPU the backend answers `Unavailable` in one line; on a
    /// GPU machine (with the feature) it opens.
    #[test]
    fn open_is_unavailable_or_works() {
        match open(0, None) {
            Ok(b) => {
                assert!(b.describe().starts_with("cuda:0 "), "{}", b.describe());
            }
            Err(e) => {
                let msg = e.to_string();
                println!("CudaBackend::new(0): {msg}");
                assert!(matches!(e, BackendError::Unavailable(_)), "{e:?}");
                assert!(
                    !msg.is_empty() && !msg.contains('\n'),
                    "not one line: {msg:?}"
                );
                if !cfg!(feature = "cuda") {
                    assert_eq!(msg, NOT_BUILT);
                }
            }
        }
    }

    #[test]
    fn probe_is_one_line() {
        let line = match probe() {
            Ok(s) => s,
            Err(e) => {
                assert!(matches!(e, BackendError::Unavailable(_)), "{e:?}");
                e.to_string()
            }
        };
        assert!(!line.is_empty() && !line.contains('\n'), "{line:?}");
    }

    #[test]
    fn a_missing_ordinal_is_unavailable() {
        let e = open(4096, None).err().expect("no machine has 4097 GPUs");
        assert!(matches!(e, BackendError::Unavailable(_)), "{e:?}");
        assert!(!e.to_string().contains('\n'));
    }
}
