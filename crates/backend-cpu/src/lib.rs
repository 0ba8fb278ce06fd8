//! The CPU backend: [`kapitsa_backend::Backend`] on host memory, with the kernels of
//! `kapitsa-kernels-cpu` on a thread pool.
//!
//! # Contract
//! - **Memory.** Every handle it makes lives in host memory: tensors are plain vectors (f32,
//!   f16, Q8_0 bytes or u32; read them in place with [`host_f32`] and its siblings), weights
//!   keep the caller's [`kapitsa_backend::HostBytes`] without a copy (a memory-mapped file
//!   stays mapped), a batch is its host description. Handles of another backend are refused
//!   ([`BackendError::ForeignHandle`]).
//! - **Numerics.** Each op computes exactly what the model code computed before the backend
//!   seam existed (the same kernels in the same order), so end-to-end results are
//!   bit-identical to earlier versions; [`CpuBackend::llama_cpp_compatible`] reproduces
//!   llama.cpp's CPU backend bit for bit for the families checked.
//! - **Reference.** At [`SimdLevel::Scalar`] ([`CpuBackend::with_level`]) the backend is the
//!   scalar reference of DESIGN.md §4: the matrix products use the scalar dot kernels, and
//!   attention, the causal conv, the Gated DeltaNet and Mamba2 scans, SwiGLU and the f32 dot
//!   products of the MoE take their plain-loop twins from `kapitsa-kernels-cpu`. Every other
//!   level uses the fast kernels (matrix kernels capped at that level).
//! - **Errors.** Every op checks its lengths before calling a kernel (the kernels `assert!`)
//!   and answers [`BackendError::Shape`]; kernel errors become [`BackendError::Kernel`].
//!
//! Files: `buffers` (host storage of the handles), `ops` (element-wise and row ops),
//! `attention` (KV writes and paged attention), `recurrent` (conv1d, Gated DeltaNet, Mamba2),
//! `ffn` (matrix products, dense MLP, mixture of experts), `testing` (the scalar reference and a
//! weight quantiser for op tests); the CUDA backend mirrors these names.

mod attention;
mod buffers;
mod ffn;
mod ops;
mod recurrent;
pub mod testing;

use kapitsa_backend::{
    shape_err, AttnShape, Backend, BackendError, Batch, BatchDesc, DType, Device, GdnShape,
    HostWeight, KvLayer, Mamba2Shape, MlpWeights, MoeWeights, Result, RopeDesc, Tensor, Weight,
};
use kapitsa_base::{CpuFeatures, ThreadPool};
use kapitsa_kernels_cpu::KernelError;

pub use buffers::{host_f16, host_f32, host_f32_mut, host_q8_0, host_u32};
/// The CPU kernel levels ([`CpuBackend::with_level`]).
pub use kapitsa_kernels_cpu::SimdLevel;

/// A kernel error as a backend error: a bad setting stays a [`BackendError::Setting`],
/// anything else is a [`BackendError::Kernel`].
pub(crate) fn kernel_err(e: KernelError) -> BackendError {
    match e {
        KernelError::BadSetting { .. } => BackendError::Setting(e.to_string()),
        _ => BackendError::Kernel(e.to_string()),
    }
}

/// `KAPITSA_NUMERICS`: whether it asks for llama.cpp-compatible numerics.
fn numerics_setting(v: Option<&str>) -> Result<bool> {
    match v {
        None | Some("") | Some("default") => Ok(false),
        Some("llama.cpp") => Ok(true),
        Some(other) => Err(kernel_err(KernelError::BadSetting {
            name: "KAPITSA_NUMERICS",
            value: other.to_string(),
            expected: "'default' or 'llama.cpp'",
        })),
    }
}

/// The CPU backend: kernels from `kapitsa-kernels-cpu` on a thread pool, tensors in host
/// memory (see the crate docs).
pub struct CpuBackend {
    pool: Box<dyn ThreadPool + Send>,
    /// The most capable kernel level the matrix multiplications may use; at
    /// [`SimdLevel::Scalar`] every op takes its scalar twin.
    level: SimdLevel,
    /// Reproduce llama.cpp's batch-dependent attention scores (see
    /// [`CpuBackend::llama_cpp_compatible`]).
    llama_compat: bool,
}

impl CpuBackend {
    /// A CPU backend running on `pool` with the fastest kernels of this CPU.
    pub fn new(pool: Box<dyn ThreadPool + Send>) -> CpuBackend {
        CpuBackend {
            pool,
            level: SimdLevel::detect(),
            llama_compat: false,
        }
    }

    /// A CPU backend whose matrix multiplications use kernels of at most `level`; errors if
    /// the CPU lacks `level`. `SimdLevel::Avx512Vnni` on an AMX machine runs what a CPU
    /// without AMX runs (the K formats in the same super-block order, without the tile GEMMs;
    /// Q8_0 and Q5_0 in the VNNI kernels' order); ggml's order is
    /// [`CpuBackend::llama_cpp_compatible`]. `SimdLevel::Scalar` is the scalar reference of
    /// every op (see the crate docs).
    pub fn with_level(pool: Box<dyn ThreadPool + Send>, level: SimdLevel) -> Result<CpuBackend> {
        if !level.is_available() {
            return Err(kernel_err(KernelError::SimdUnavailable(level)));
        }
        Ok(CpuBackend {
            pool,
            level,
            llama_compat: false,
        })
    }

    /// The CPU backend the CLI and the server run: [`CpuBackend::new`], or
    /// [`CpuBackend::llama_cpp_compatible`] when the environment variable `KAPITSA_NUMERICS`
    /// is `llama.cpp` (`default` or unset: the fast kernels). Errors on another value
    /// ([`BackendError::Setting`]), or on `llama.cpp` without AVX-512.
    pub fn from_env(pool: Box<dyn ThreadPool + Send>) -> Result<CpuBackend> {
        if numerics_setting(std::env::var("KAPITSA_NUMERICS").ok().as_deref())? {
            CpuBackend::llama_cpp_compatible(pool)
        } else {
            Ok(CpuBackend::new(pool))
        }
    }

    /// A CPU backend that computes what llama.cpp's CPU backend computes, bit for bit, for
    /// the model families we check (dense Qwen2.5; see `docs/design-notes.md`, "Bit-exact
    /// llama.cpp parity"): matrix multiplications in ggml's order (kernels capped at plain
    /// AVX-512, whose 32-element formats sum in ggml's one chain per row; the VNNI kernels
    /// keep a faster order for those), and attention's dot products summed the way llama.cpp
    /// sums them for the size of the call
    /// ([`kapitsa_kernels_cpu::attention::AttnOrder`]). The latter makes a sequence's results
    /// depend on how its tokens are chunked (one token or several), so this is a reference
    /// mode for parity checks, not the default (the documented exception to the seam's batch
    /// invariance). Needs AVX-512 (ggml's AVX-512 build is the reference).
    pub fn llama_cpp_compatible(pool: Box<dyn ThreadPool + Send>) -> Result<CpuBackend> {
        let level = SimdLevel::detect().min(SimdLevel::Avx512);
        if level < SimdLevel::Avx512 {
            return Err(kernel_err(KernelError::SimdUnavailable(SimdLevel::Avx512)));
        }
        Ok(CpuBackend {
            pool,
            level,
            llama_compat: true,
        })
    }

    /// The kernel level the matrix multiplications use at most.
    pub fn level(&self) -> SimdLevel {
        self.level
    }

    /// The pool this backend runs on.
    pub fn pool(&self) -> &dyn ThreadPool {
        &*self.pool
    }

    /// Whether this is the scalar reference (every op on its plain-loop twin).
    pub(crate) fn scalar(&self) -> bool {
        self.level == SimdLevel::Scalar
    }
}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        let mut capped = if self.level < SimdLevel::detect() {
            format!(", matmul kernels capped at {:?}", self.level)
        } else {
            String::new()
        };
        if self.llama_compat {
            capped.push_str(", llama.cpp-compatible numerics");
        }
        format!(
            "cpu {}, {} threads{capped}",
            CpuFeatures::get().describe(),
            self.pool.n_threads()
        )
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn upload_weight(&self, w: &HostWeight) -> Result<Weight> {
        buffers::upload_weight(w)
    }

    fn upload_embedding(&self, w: &HostWeight) -> Result<Weight> {
        buffers::upload_embedding(w)
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<Tensor> {
        buffers::alloc(dtype, len)
    }

    fn write_f32(&self, dst: &mut Tensor, offset: usize, src: &[f32]) -> Result<()> {
        buffers::write_f32(dst, offset, src)
    }

    fn read_f32(&self, src: &Tensor, offset: usize, dst: &mut [f32]) -> Result<()> {
        buffers::read_f32(src, offset, dst)
    }

    fn read_bytes(&self, src: &Tensor, offset: usize, n: usize) -> Result<Vec<u8>> {
        buffers::read_bytes(src, offset, n)
    }

    fn write_bytes(&self, dst: &mut Tensor, offset: usize, bytes: &[u8]) -> Result<()> {
        buffers::write_bytes(dst, offset, bytes)
    }

    fn copy(
        &self,
        src: &Tensor,
        src_off: usize,
        dst: &mut Tensor,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        buffers::copy(src, src_off, dst, dst_off, n)
    }

    fn copy_within(&self, t: &mut Tensor, src: usize, dst: usize, n: usize) -> Result<()> {
        buffers::copy_within(t, src, dst, n)
    }

    fn prepare_batch(&self, desc: BatchDesc) -> Result<Batch> {
        buffers::prepare_batch(desc)
    }

    fn matmul(&self, w: &Weight, x: &Tensor, n_tok: usize, y: &mut Tensor) -> Result<()> {
        ffn::matmul(self, w, x, n_tok, y)
    }

    fn matmul_many(
        &self,
        ws: &[&Weight],
        x: &Tensor,
        n_tok: usize,
        ys: &mut [&mut Tensor],
    ) -> Result<()> {
        ffn::matmul_many(self, ws, x, n_tok, ys)
    }

    fn embed(&self, w: &Weight, batch: &Batch, out: &mut Tensor) -> Result<()> {
        ops::embed(w, batch, out)
    }

    fn mlp(&self, w: &MlpWeights, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
        ffn::mlp(self, w, x, n, out)
    }

    fn moe(&self, w: &MoeWeights, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
        ffn::moe(self, w, x, n, out)
    }

    fn rms_norm(&self, x: &mut Tensor, width: usize, w: &Tensor, eps: f32) -> Result<()> {
        ops::rms_norm(x, width, w, eps)
    }

    fn add(&self, y: &mut Tensor, x: &Tensor) -> Result<()> {
        ops::add(y, x)
    }

    fn add_bias(&self, x: &mut Tensor, b: &Tensor) -> Result<()> {
        ops::add_bias(x, b)
    }

    fn mul_sigmoid(&self, x: &mut Tensor, gate: &Tensor) -> Result<()> {
        ops::mul_sigmoid(x, gate)
    }

    fn split_cols(
        &self,
        src: &Tensor,
        rows: usize,
        widths: &[usize],
        outs: &mut [&mut Tensor],
    ) -> Result<()> {
        ops::split_cols(src, rows, widths, outs)
    }

    fn gather_logit_rows(
        &self,
        x: &Tensor,
        width: usize,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()> {
        ops::gather_logit_rows(x, width, batch, out)
    }

    fn rope(
        &self,
        x: &mut Tensor,
        n_heads: usize,
        head_dim: usize,
        rope: RopeDesc,
        batch: &Batch,
    ) -> Result<()> {
        ops::rope(x, n_heads, head_dim, rope, batch)
    }

    fn l2_norm(&self, x: &mut Tensor, width: usize, eps: f32, scale: f32) -> Result<()> {
        ops::l2_norm(x, width, eps, scale)
    }

    fn gdn_gates(
        &self,
        beta: &mut Tensor,
        g: &mut Tensor,
        dt_bias: &Tensor,
        a_neg: &Tensor,
    ) -> Result<()> {
        ops::gdn_gates(beta, g, dt_bias, a_neg)
    }

    fn softplus_bias(&self, dt: &mut Tensor, bias: &Tensor) -> Result<()> {
        ops::softplus_bias(dt, bias)
    }

    fn gated_rms_norm(
        &self,
        x: &mut Tensor,
        z: &Tensor,
        width: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()> {
        ops::gated_rms_norm(x, z, width, w, eps)
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
        ops::gated_group_rms_norm(y, z, d_inner, n_groups, w, eps)
    }

    fn kv_write(&self, k: &Tensor, v: &Tensor, cache: KvLayer<'_>, batch: &Batch) -> Result<()> {
        attention::kv_write(k, v, cache, batch)
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
        attention::attention(self, shape, q, k_cache, v_cache, batch, out)
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
        let conv = recurrent::Conv {
            channels,
            k,
            w,
            bias,
            silu,
        };
        recurrent::conv1d_causal(self, x, &conv, conv_state, batch, out)
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
        let inp = recurrent::GdnInputs { q, k, v, g, beta };
        recurrent::gdn(self, shape, &inp, state, batch, out)
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
        let inp = recurrent::Mamba2Inputs { x, dt, a, b, c, d };
        recurrent::mamba2(self, shape, &inp, state, batch, y)
    }

    fn argmax_rows(&self, x: &Tensor, width: usize) -> Result<Vec<u32>> {
        ops::argmax_rows(x, width)
    }

    // The drafter ops run their plain-loop definitions on the tensors in place.
    fn attention_spans(
        &self,
        shape: AttnShape,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        spans: &[(u32, u32)],
        out: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "attention_spans";
        let (q, k, v) = (
            buffers::f32s(OP, "q", q)?,
            buffers::f32s(OP, "k", k)?,
            buffers::f32s(OP, "v", v)?,
        );
        let out = buffers::f32s_mut(OP, "out", out)?;
        let q_dim = shape.n_head * shape.head_dim;
        let n = spans.len();
        if q_dim == 0 || q.len() != n * q_dim || out.len() != n * q_dim || n < 8 {
            // (small or malformed: the definition, which also reports the shape error)
            return kapitsa_backend::reference::attention_spans(shape, q, k, v, spans, out);
        }
        // Query rows are independent: blocks of rows on the pool, each its own output rows
        // (a vision tower's image attends over thousands of rows).
        let rows = n.div_ceil(4 * self.pool.n_threads().max(1)).max(1);
        let outs: Vec<std::sync::Mutex<&mut [f32]>> = out
            .chunks_mut(rows * q_dim)
            .map(std::sync::Mutex::new)
            .collect();
        let failed = std::sync::Mutex::new(None);
        self.pool.run(outs.len(), &|t| {
            let (lo, hi) = (t * rows, ((t + 1) * rows).min(n));
            let r = match outs[t].lock() {
                Ok(mut o) => kapitsa_backend::reference::attention_spans(
                    shape,
                    &q[lo * q_dim..hi * q_dim],
                    k,
                    v,
                    &spans[lo..hi],
                    &mut o,
                ),
                Err(_) => shape_err(OP, "a worker panicked"),
            };
            if let (Err(e), Ok(mut f)) = (r, failed.lock()) {
                *f = Some(e);
            }
        });
        match failed.into_inner() {
            Ok(None) => Ok(()),
            Ok(Some(e)) => Err(e),
            Err(_) => shape_err(OP, "a worker panicked"),
        }
    }

    fn dynamic_conv(
        &self,
        x: &Tensor,
        width: usize,
        base: &Tensor,
        dynamic: &Tensor,
        group: usize,
        block_len: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "dynamic_conv";
        let (x, base, dynamic) = (
            buffers::f32s(OP, "x", x)?,
            buffers::f32s(OP, "base", base)?,
            buffers::f32s(OP, "dynamic", dynamic)?,
        );
        let out = buffers::f32s_mut(OP, "out", out)?;
        kapitsa_backend::reference::dynamic_conv(x, width, base, dynamic, group, block_len, out)
    }

    // The vision tower's ops too.
    fn layer_norm(
        &self,
        x: &mut Tensor,
        width: usize,
        w: &Tensor,
        b: &Tensor,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "layer_norm";
        let (w, b) = (buffers::f32s(OP, "w", w)?, buffers::f32s(OP, "b", b)?);
        let x = buffers::f32s_mut(OP, "x", x)?;
        kapitsa_backend::reference::layer_norm(x, width, w, b, eps)
    }

    fn gelu(&self, x: &mut Tensor, tanh_approx: bool) -> Result<()> {
        kapitsa_backend::reference::gelu(buffers::f32s_mut("gelu", "x", x)?, tanh_approx);
        Ok(())
    }

    fn rope_table(
        &self,
        x: &mut Tensor,
        n_heads: usize,
        head_dim: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<()> {
        const OP: &str = "rope_table";
        let (c, s) = (
            buffers::f32s(OP, "cos", cos)?,
            buffers::f32s(OP, "sin", sin)?,
        );
        let x = buffers::f32s_mut(OP, "x", x)?;
        kapitsa_backend::reference::rope_table(x, n_heads, head_dim, c, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numerics_setting_values() {
        assert!(!numerics_setting(None).unwrap());
        assert!(!numerics_setting(Some("")).unwrap());
        assert!(!numerics_setting(Some("default")).unwrap());
        assert!(numerics_setting(Some("llama.cpp")).unwrap());
        let e = numerics_setting(Some("ggml")).unwrap_err();
        assert!(matches!(e, BackendError::Setting(_)), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("KAPITSA_NUMERICS") && e.contains("'ggml'"),
            "{e}"
        );
    }
}
