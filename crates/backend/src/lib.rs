//! The narrow, model-shaped op set models run on, as a trait, and its CPU implementation.
//!
//! Ops work on host f32 slices (row-major) and borrowed weight matrices. This is enough for the
//! CPU; a device backend will add buffer handles behind the same op names (see DESIGN.md §4).

use kapitsa_base::{CpuFeatures, ThreadPool};
use kapitsa_kernels_cpu::attention::{self, AttnShape, KvView};
use kapitsa_kernels_cpu::conv;
use kapitsa_kernels_cpu::gdn::{self, GdnShape};
use kapitsa_kernels_cpu::mamba2::{self, Mamba2Shape};
use kapitsa_kernels_cpu::matmul::{self, QMatrix};
use kapitsa_kernels_cpu::ops;
use kapitsa_kernels_cpu::{KernelError, SimdLevel};

/// Errors from backend ops: shape or type problems found at an op boundary.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A kernel refused its arguments.
    #[error("kernel error: {0}")]
    Kernel(#[from] kapitsa_kernels_cpu::KernelError),
}

/// Result of a backend op.
pub type Result<T> = std::result::Result<T, BackendError>;

/// One buffer (`what`: "inputs" or "outputs") per matrix of a multi-matrix call `op`.
fn check_count(op: &'static str, what: &'static str, n_w: usize, n: usize) -> Result<()> {
    if n_w != n {
        return Err(KernelError::BadLength {
            op,
            what,
            expected: n_w,
            got: n,
        }
        .into());
    }
    Ok(())
}

/// The ops a model forward pass needs. All activations are row-major f32.
pub trait Backend: Send + Sync {
    /// Short description for logs (`"cpu avx512 vnni bf16, 2 threads"`).
    fn describe(&self) -> String;

    /// `y[n_tok, w.n_out] = x[n_tok, w.n_in] @ w^T`.
    fn matmul(&self, w: &QMatrix<'_>, x: &[f32], n_tok: usize, y: &mut [f32]) -> Result<()>;

    /// [`Backend::matmul`] for weights that calls meet with few tokens: a routed expert (a
    /// small share of the batch) or the output head (logits of a few rows): the backend may
    /// use kernels suited to small batches. Every call on the same weights must still compute
    /// the same operation sequence per output (batch invariance), so the choice may depend on
    /// the matrix, never on `n_tok`.
    fn matmul_small_batch(
        &self,
        w: &QMatrix<'_>,
        x: &[f32],
        n_tok: usize,
        y: &mut [f32],
    ) -> Result<()> {
        self.matmul(w, x, n_tok, y)
    }

    /// `ys[i][n_tok, ws[i].n_out] = x @ ws[i]^T` for several matrices sharing the input (an
    /// MLP's gate and up, attention's q, k and v): each output exactly as
    /// [`Backend::matmul`] computes it (with `small_batch`, as
    /// [`Backend::matmul_small_batch`] does); a backend may share the input's preparation and
    /// run the products together.
    fn matmul_many(
        &self,
        ws: &[QMatrix<'_>],
        x: &[f32],
        n_tok: usize,
        ys: &mut [&mut [f32]],
        small_batch: bool,
    ) -> Result<()> {
        check_count("matmul_many", "outputs", ws.len(), ys.len())?;
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            if small_batch {
                self.matmul_small_batch(w, x, n_tok, y)?;
            } else {
                self.matmul(w, x, n_tok, y)?;
            }
        }
        Ok(())
    }

    /// `ys[i][m_i, ws[i].n_out] = xs[i][m_i, ws[i].n_in] @ ws[i]ᵀ` for a few tokens each
    /// (`m_i` read off the input's length): several decode products with their own inputs
    /// (the gate and up, then the down projections of every active expert of an MoE layer).
    /// Each output exactly as [`Backend::matmul_small_batch`] computes it for those tokens; a
    /// backend may run them together (one fork-join, inputs given as the same slice quantised
    /// once).
    fn gemv_batch(&self, ws: &[QMatrix<'_>], xs: &[&[f32]], ys: &mut [&mut [f32]]) -> Result<()> {
        check_count("gemv_batch", "inputs", ws.len(), xs.len())?;
        check_count("gemv_batch", "outputs", ws.len(), ys.len())?;
        for ((w, x), y) in ws.iter().zip(xs).zip(ys.iter_mut()) {
            let m = match (w.n_in, w.n_out) {
                (0, 0) => 0,
                (0, n_out) => y.len() / n_out,
                (n_in, _) => x.len() / n_in,
            };
            self.matmul_small_batch(w, x, m, y)?;
        }
        Ok(())
    }

    /// Embedding gather: `out[i, :] = dequant(w[ids[i], :])`, out `[ids.len(), w.n_in]`.
    fn get_rows(&self, w: &QMatrix<'_>, ids: &[u32], out: &mut [f32]) -> Result<()>;

    /// RMSNorm of each `n`-wide row of `x` in place, weight `w[n] + w_offset`.
    fn rms_norm(&self, x: &mut [f32], n: usize, w: &[f32], eps: f32, w_offset: f32);

    /// Causal attention of one sequence's new tokens over its cache (see
    /// [`kapitsa_kernels_cpu::attention`] for layouts).
    fn attention(
        &self,
        shape: AttnShape,
        q: &[f32],
        pos: &[u32],
        k: KvView<'_>,
        v: KvView<'_>,
        out: &mut [f32],
    );

    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut [f32], up: &[f32]);

    /// Depthwise causal conv1d of `t` rows of `c` channels with a carried window of the last
    /// `k - 1` input rows (see [`kapitsa_kernels_cpu::conv::conv1d_causal`]).
    #[allow(clippy::too_many_arguments)]
    fn conv1d_causal(
        &self,
        x: &[f32],
        t: usize,
        c: usize,
        k: usize,
        w: &[f32],
        bias: Option<&[f32]>,
        state: &mut [f32],
        silu: bool,
        out: &mut [f32],
    );

    /// Gated DeltaNet recurrence over one sequence's tokens (see
    /// [`kapitsa_kernels_cpu::gdn::gdn`]); `keep` receives the state after every position.
    #[allow(clippy::too_many_arguments)]
    fn gdn(
        &self,
        shape: &GdnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        state: &mut [f32],
        out: &mut [f32],
        keep: Option<&mut [f32]>,
    );

    /// Mamba2 SSD scan over one sequence's tokens (see
    /// [`kapitsa_kernels_cpu::mamba2::mamba2`]); `keep` receives the state after every position.
    #[allow(clippy::too_many_arguments)]
    fn mamba2(
        &self,
        shape: &Mamba2Shape,
        x: &[f32],
        dt: &[f32],
        a: &[f32],
        b: &[f32],
        c: &[f32],
        d: &[f32],
        state: &mut [f32],
        y: &mut [f32],
        keep: Option<&mut [f32]>,
    );
}

/// `KAPITSA_NUMERICS`: whether it asks for llama.cpp-compatible numerics.
fn numerics_setting(v: Option<&str>) -> std::result::Result<bool, KernelError> {
    match v {
        None | Some("") | Some("default") => Ok(false),
        Some("llama.cpp") => Ok(true),
        Some(other) => Err(KernelError::BadSetting {
            name: "KAPITSA_NUMERICS",
            value: other.to_string(),
            expected: "'default' or 'llama.cpp'",
        }),
    }
}

/// The CPU backend: kernels from `kapitsa-kernels-cpu` on a thread pool.
pub struct CpuBackend {
    pool: Box<dyn ThreadPool + Send>,
    /// The most capable kernel level the matrix multiplications may use.
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
    /// the CPU lacks `level`. `SimdLevel::Avx512Vnni` on an AMX machine keeps ggml's exact
    /// summation order for the K formats (what llama.cpp's CPU backend computes), at the cost
    /// of the tile GEMM.
    pub fn with_level(
        pool: Box<dyn ThreadPool + Send>,
        level: SimdLevel,
    ) -> std::result::Result<CpuBackend, KernelError> {
        if !level.is_available() {
            return Err(KernelError::SimdUnavailable(level));
        }
        Ok(CpuBackend {
            pool,
            level,
            llama_compat: false,
        })
    }

    /// The CPU backend the CLI and the server run: [`CpuBackend::new`], or
    /// [`CpuBackend::llama_cpp_compatible`] when the environment variable `KAPITSA_NUMERICS`
    /// is `llama.cpp` (`default` or unset: the fast kernels). Errors on another value, or on
    /// `llama.cpp` without AVX-512.
    pub fn from_env(
        pool: Box<dyn ThreadPool + Send>,
    ) -> std::result::Result<CpuBackend, KernelError> {
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
    /// keep a faster order for those), and attention's dot products summed the
    /// way llama.cpp sums them for the size of the call ([`attention::AttnOrder`]). The latter
    /// makes a sequence's results depend on how its tokens are chunked (one token or
    /// several), so this is a reference mode for parity checks, not the default.
    /// Needs AVX-512 (ggml's AVX-512 build is the reference).
    pub fn llama_cpp_compatible(
        pool: Box<dyn ThreadPool + Send>,
    ) -> std::result::Result<CpuBackend, KernelError> {
        let level = SimdLevel::detect().min(SimdLevel::Avx512);
        if level < SimdLevel::Avx512 {
            return Err(KernelError::SimdUnavailable(SimdLevel::Avx512));
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

    fn matmul(&self, w: &QMatrix<'_>, x: &[f32], n_tok: usize, y: &mut [f32]) -> Result<()> {
        Ok(matmul::matmul_with(
            self.level,
            &*self.pool,
            w,
            x,
            n_tok,
            y,
        )?)
    }

    // `matmul_small_batch` keeps the trait's default (the same kernels as `matmul`). Routed
    // experts and the output head used to stay below the AMX level, whose super-block-order
    // decode kernels were the slower ones; since the row-group GEMV (`gemv_sb`) they are the
    // faster ones (Qwen3.6-L8, 2 threads: pp512 +5%, decode unchanged within noise).

    fn matmul_many(
        &self,
        ws: &[QMatrix<'_>],
        x: &[f32],
        n_tok: usize,
        ys: &mut [&mut [f32]],
        // Small batches take the same kernels (see `matmul_small_batch` above).
        _small_batch: bool,
    ) -> Result<()> {
        Ok(matmul::matmul_many_with(
            self.level,
            &*self.pool,
            ws,
            x,
            n_tok,
            ys,
        )?)
    }

    fn gemv_batch(&self, ws: &[QMatrix<'_>], xs: &[&[f32]], ys: &mut [&mut [f32]]) -> Result<()> {
        Ok(matmul::gemv_batch_with(
            self.level,
            &*self.pool,
            ws,
            xs,
            ys,
        )?)
    }

    fn get_rows(&self, w: &QMatrix<'_>, ids: &[u32], out: &mut [f32]) -> Result<()> {
        Ok(matmul::get_rows(w, ids, out)?)
    }

    fn rms_norm(&self, x: &mut [f32], n: usize, w: &[f32], eps: f32, w_offset: f32) {
        ops::rms_norm(x, n, w, eps, w_offset)
    }

    fn attention(
        &self,
        shape: AttnShape,
        q: &[f32],
        pos: &[u32],
        k: KvView<'_>,
        v: KvView<'_>,
        out: &mut [f32],
    ) {
        use attention::{AttnOrder, SumOrder};
        let order = match (self.llama_compat, pos.len()) {
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
        attention::attention_with(&*self.pool, shape, order, q, pos, k, v, out)
    }

    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) {
        ops::silu_mul(gate, up)
    }

    fn conv1d_causal(
        &self,
        x: &[f32],
        t: usize,
        c: usize,
        k: usize,
        w: &[f32],
        bias: Option<&[f32]>,
        state: &mut [f32],
        silu: bool,
        out: &mut [f32],
    ) {
        conv::conv1d_causal(&*self.pool, x, t, c, k, w, bias, state, silu, out)
    }

    fn gdn(
        &self,
        shape: &GdnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        state: &mut [f32],
        out: &mut [f32],
        keep: Option<&mut [f32]>,
    ) {
        gdn::gdn(&*self.pool, shape, q, k, v, g, beta, state, out, keep)
    }

    fn mamba2(
        &self,
        shape: &Mamba2Shape,
        x: &[f32],
        dt: &[f32],
        a: &[f32],
        b: &[f32],
        c: &[f32],
        d: &[f32],
        state: &mut [f32],
        y: &mut [f32],
        keep: Option<&mut [f32]>,
    ) {
        mamba2::mamba2(&*self.pool, shape, x, dt, a, b, c, d, state, y, keep)
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
        let e = numerics_setting(Some("ggml")).unwrap_err().to_string();
        assert!(
            e.contains("KAPITSA_NUMERICS") && e.contains("'ggml'"),
            "{e}"
        );
    }
}
