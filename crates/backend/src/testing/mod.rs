//! The op suite every backend runs against the scalar reference (llama.cpp's
//! `test-backend-ops` in spirit): [`check_ops`] draws random shapes and inputs for every op of
//! [`Backend`], runs the op on both backends through the trait, reads the results back and
//! compares them by the relative error [`rel_err`] (`max|a - b| / max(max|b|, tiny)`, `b`
//! the reference) against a per-op tolerance.
//!
//! Shapes include odd sizes and tails (widths that are not multiples of 16, 32 or 256 where
//! the op allows them), 1 to 3 sequences per batch with random lengths, positions and slots
//! (not in order), and paged KV caches with blocks of 16 positions whose block tables use
//! random, non-contiguous block ids. Inputs are never zero. Everything is drawn from a small
//! fixed-seed generator ([`Rng`]), so a failure reproduces from its seed.
//!
//! The crate has no quantiser, so quantised weights are made by the caller's `quantize`
//! function (for example `kapitsa_backend_cpu::testing::quantize_weight`); it is called
//! only for the block types (F32, F16 and BF16 rows are encoded here).
//!
//! Tolerances ([`Tolerances`], defaults measured between the CPU backend's fast kernels and
//! its scalar reference, with room for a device backend's different but equally exact
//! summation orders): element-wise and row ops [`TOL_F32`]; memory ops, KV writes, column
//! splits, logit-row gathers and argmax exact (the KV inputs of the Q8_0 cache are exactly
//! representable, so any correct quantiser agrees); attention and the recurrent scans
//! [`TOL_ATTN`], [`TOL_SCAN`]; matrix products [`TOL_MATMUL`] (the SIMD and scalar dot
//! kernels quantise the activations the same way; only the float summation order differs);
//! MLPs and MoE blocks [`TOL_FFN`] (see there why looser).

use std::fmt;

use kapitsa_base::GgmlType;

use crate::{
    Act, AttnShape, Backend, Batch, BatchDesc, DType, Experts, Gating, GdnConv, GdnMixerIo,
    GdnShape, HeadOrder, HostBytes, HostWeight, KvLayer, Latent, Mamba2Conv, Mamba2Shape,
    MlpWeights, MoeWeights, RopeDesc, SeqDesc, Tensor, Weight,
};

mod mixers;
mod moe;

/// Element-wise and row ops (measured on the CPU: 0, the same code).
pub const TOL_F32: f32 = 1e-5;
/// Memory ops, KV writes, column splits, row gathers, argmax: bit-exact on every backend.
pub const TOL_EXACT: f32 = 0.0;
/// Attention (fast f32 kernels against f64 reference loops; measured on the CPU: 4e-7).
pub const TOL_ATTN: f32 = 1e-5;
/// The causal conv and the Gated DeltaNet and Mamba2 scans, the chunked Mamba2 form included
/// (measured on the CPU: 2e-7).
pub const TOL_SCAN: f32 = 1e-5;
/// Matrix products of every weight type (measured on the CPU: 1.8e-6 over 450 cases).
pub const TOL_MATMUL: f32 = 1e-4;
/// MLPs and MoE blocks: products whose inputs are the outputs of other quantised products.
/// When two backends' summation orders leave a hidden value on either side of an activation
/// quantisation boundary (Q8_0 / Q8_K codes of the next product), that code moves by one
/// step, which shows through the following product, the squared ReLU and the latent
/// projection (measured on the CPU: MLP 1e-5, MoE 6.3e-4 over 450 cases each). A wrong
/// expert, weight or row is off by far more.
pub const TOL_FFN: f32 = 2e-3;

/// The tolerances [`check_ops_with`] compares against (the `TOL_*` constants by default).
/// The ops with exact contracts (memory and copies, KV writes, column splits, logit-row
/// gathers, argmax) always use [`TOL_EXACT`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerances {
    /// Element-wise and row ops (norms, gates, RoPE, adds).
    pub f32: f32,
    /// Embedding gathers (dequantisation; exact on the CPU).
    pub dequant: f32,
    /// Attention.
    pub attention: f32,
    /// conv1d, Gated DeltaNet, Mamba2.
    pub scan: f32,
    /// matmul, matmul_many: the backend against the reference backend.
    pub matmul: f32,
    /// matmul: the backend against the exact product of the (dequantised) weights with the
    /// f32 activations, computed on the host in f64. The CPU kernels round activations to
    /// 8 bits for quantised weights (as ggml does), which alone costs ~5e-3; a backend that
    /// keeps f32 activations is held to a tighter bound by its caller.
    pub matmul_exact: f32,
    /// MLP, MoE.
    pub ffn: f32,
}

impl Default for Tolerances {
    fn default() -> Tolerances {
        Tolerances {
            f32: TOL_F32,
            dequant: TOL_EXACT,
            attention: TOL_ATTN,
            scan: TOL_SCAN,
            matmul: TOL_MATMUL,
            matmul_exact: 1e-2,
            ffn: TOL_FFN,
        }
    }
}

impl Tolerances {
    /// For a backend that keeps activations in f32 (GEMV) or f16/bf16 (tensor-core GEMM)
    /// where the CPU reference rounds them to 8 bits for quantised weights (the CUDA
    /// backend): against the reference its products differ by that rounding (~5e-3,
    /// compounding through an MLP), so the tight check is the one against the exact product
    /// (bf16 weights meet bf16-rounded activations: ~2e-3; every other type stays under 3e-4
    /// on the H200).
    pub fn unrounded_activations() -> Tolerances {
        Tolerances {
            matmul: 2e-2,
            matmul_exact: 5e-3,
            ffn: 5e-2,
            ..Tolerances::default()
        }
    }
}

/// The weight types the suite multiplies and gathers.
pub const WEIGHT_TYPES: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q4_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// The caller's weight quantiser: `x` (whole blocks of the type) to rows of that type.
pub type Quantize<'a> = &'a dyn Fn(GgmlType, &[f32]) -> Vec<u8>;

/// What one op (or op variant) of the suite measured.
#[derive(Debug, Clone, PartialEq)]
pub struct OpReport {
    /// Op name and variant (`"matmul Q4_K"`, `"attention F16"`, ...).
    pub name: String,
    /// Random cases run.
    pub cases: usize,
    /// Largest relative error seen (infinite for a NaN).
    pub worst: f32,
    /// The tolerance.
    pub tol: f32,
    /// `worst <= tol`.
    pub pass: bool,
}

impl fmt::Display for OpReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<28} {:>4} cases  worst {:>9.2e}  tol {:>8.1e}  {}",
            self.name,
            self.cases,
            self.worst,
            self.tol,
            if self.pass { "ok" } else { "FAIL" }
        )
    }
}

/// The reports as a table, one line each.
pub fn summary(reports: &[OpReport]) -> String {
    reports.iter().map(|r| format!("{r}\n")).collect()
}

/// `max|a - b| / max(max|b|, f32::MIN_POSITIVE)` (`b` the reference); infinite when the
/// lengths differ or a value is NaN.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    let scale = b.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        let d = (x - y).abs();
        if d.is_nan() {
            return f32::INFINITY;
        }
        worst = worst.max(d);
    }
    worst / scale
}

/// xorshift64* with a splitmix seed: small, fixed, good enough for test inputs.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from any seed.
    pub fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    /// Next 64 random bits.
    pub fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi` (`lo <= hi < usize::MAX`).
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.u64() % (hi - lo + 1) as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// A nonzero value, uniform in `±[0.05, 1)`.
    pub fn val(&mut self) -> f32 {
        let m = 0.05 + 0.95 * self.unit();
        if self.u64() & 1 == 0 {
            m
        } else {
            -m
        }
    }

    /// `n` values of [`Rng::val`] times `scale`.
    pub fn vals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.val() * scale).collect()
    }

    /// Fair coin.
    pub fn coin(&mut self) -> bool {
        self.u64() & 1 == 1
    }

    /// One of `xs` (not empty).
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.range(0, xs.len() - 1)]
    }

    /// Shuffle in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.range(0, i));
        }
    }
}

type R<T> = std::result::Result<T, String>;

/// One handle per backend: index 0 on the backend under test, 1 on the reference.
type Two<T> = [T; 2];

/// Runs every op on `be` and on `reference` for `cases` random cases each (a few more for
/// the ops with variants) and reports the worst relative error per op. `Err` if an op fails
/// on either backend (an op that accepts its arguments on one backend must accept them on
/// the other). The caller checks `pass` of every report.
pub fn check_ops(
    be: &dyn Backend,
    reference: &dyn Backend,
    quantize: Quantize<'_>,
    seed: u64,
    cases: usize,
) -> R<Vec<OpReport>> {
    check_ops_with(be, reference, quantize, seed, cases, &Tolerances::default())
}

/// [`check_ops`] with the caller's tolerances.
pub fn check_ops_with(
    be: &dyn Backend,
    reference: &dyn Backend,
    quantize: Quantize<'_>,
    seed: u64,
    cases: usize,
    tol: &Tolerances,
) -> R<Vec<OpReport>> {
    let mut s = Suite {
        bes: [be, reference],
        quantize,
        rng: Rng::new(seed),
        cases,
        tol: *tol,
        reports: Vec::new(),
    };
    memory(&mut s)?;
    copies(&mut s)?;
    rows(&mut s)?;
    gates(&mut s)?;
    rope(&mut s)?;
    for ty in WEIGHT_TYPES {
        matmul(&mut s, ty)?;
        embed(&mut s, ty)?;
    }
    matmul_many(&mut s)?;
    matmul_with(&mut s)?;
    for act in [Act::SwiGlu, Act::Relu2] {
        mlp(&mut s, act)?;
    }
    for sigmoid in [false, true] {
        moe::moe(&mut s, sigmoid)?;
    }
    for dt in [DType::F32, DType::F16, DType::Q8_0] {
        mixers::attention(&mut s, dt)?;
    }
    mixers::conv1d(&mut s)?;
    mixers::gdn_preamble(&mut s)?;
    mixers::gdn(&mut s)?;
    mixers::gdn_mixer(&mut s)?;
    mixers::mamba2_preamble(&mut s)?;
    mixers::mamba2(&mut s)?;
    mixers::vision(&mut s)?;
    argmax(&mut s)?;
    // last: its draws leave the other ops' random cases as they were
    normed_matmul(&mut s)?;
    for b in s.bes {
        b.synchronize().map_err(|e| format!("synchronize: {e}"))?;
    }
    Ok(s.reports)
}

struct Suite<'a> {
    bes: Two<&'a dyn Backend>,
    quantize: Quantize<'a>,
    rng: Rng,
    cases: usize,
    tol: Tolerances,
    reports: Vec<OpReport>,
}

impl Suite<'_> {
    /// Add one case's error to the report of `name`.
    fn record(&mut self, name: &str, tol: f32, err: f32) {
        let err = if err.is_nan() { f32::INFINITY } else { err };
        let i = match self.reports.iter().position(|r| r.name == name) {
            Some(i) => i,
            None => {
                self.reports.push(OpReport {
                    name: name.to_string(),
                    cases: 0,
                    worst: 0.0,
                    tol,
                    pass: true,
                });
                self.reports.len() - 1
            }
        };
        let r = &mut self.reports[i];
        r.cases += 1;
        r.worst = r.worst.max(err);
        r.pass = r.worst <= r.tol;
    }

    /// Run `f` on both backends (`f(backend, index)`, index 0 the backend under test).
    fn both(&self, op: &str, mut f: impl FnMut(&dyn Backend, usize) -> crate::Result<()>) -> R<()> {
        for (i, be) in self.bes.iter().enumerate() {
            f(*be, i).map_err(|e| {
                let who = if i == 0 { "backend" } else { "reference" };
                format!("{op} failed on the {who} ({}): {e}", be.describe())
            })?;
        }
        Ok(())
    }

    fn up(&self, v: &[f32]) -> R<Two<Tensor>> {
        let t = |i: usize| {
            self.bes[i]
                .upload_f32(v)
                .map_err(|e| format!("upload_f32: {e}"))
        };
        Ok([t(0)?, t(1)?])
    }

    /// `n` random values `±[0.05, 1) * scale` on both backends.
    fn rand(&mut self, n: usize, scale: f32) -> R<Two<Tensor>> {
        let v = self.rng.vals(n, scale);
        self.up(&v)
    }

    fn alloc(&self, dt: DType, n: usize) -> R<Two<Tensor>> {
        let t = |i: usize| self.bes[i].alloc(dt, n).map_err(|e| format!("alloc: {e}"));
        Ok([t(0)?, t(1)?])
    }

    /// A tensor of `dt` holding `bytes` on both backends.
    fn with_bytes(&self, dt: DType, n: usize, bytes: &[u8]) -> R<Two<Tensor>> {
        let mut t = self.alloc(dt, n)?;
        self.both("write_bytes", |be, i| be.write_bytes(&mut t[i], 0, bytes))?;
        Ok(t)
    }

    fn read(&self, t: &Two<Tensor>) -> R<Two<Vec<f32>>> {
        let r = |i: usize| {
            let mut v = vec![0f32; t[i].len()];
            self.bes[i]
                .read_f32(&t[i], 0, &mut v)
                .map_err(|e| format!("read_f32: {e}"))?;
            Ok::<_, String>(v)
        };
        Ok([r(0)?, r(1)?])
    }

    /// Every element of both tensors as f32 (through `read_bytes`, any dtype).
    fn read_any(&self, t: &Two<Tensor>) -> R<Two<Vec<f32>>> {
        let r = |i: usize| {
            let b = self.bes[i]
                .read_bytes(&t[i], 0, t[i].len())
                .map_err(|e| format!("read_bytes: {e}"))?;
            Ok::<_, String>(decode(t[i].dtype(), &b))
        };
        Ok([r(0)?, r(1)?])
    }

    /// Compare two f32 tensors and record the error.
    fn cmp(&mut self, name: &str, tol: f32, t: &Two<Tensor>) -> R<()> {
        let [a, b] = self.read(t)?;
        self.record(name, tol, rel_err(&a, &b));
        Ok(())
    }

    /// Compare several f32 tensors as one case (the worst of them).
    fn cmp_all(&mut self, name: &str, tol: f32, ts: &[&Two<Tensor>]) -> R<()> {
        let mut worst = 0f32;
        for t in ts {
            let [a, b] = self.read(t)?;
            worst = worst.max(rel_err(&a, &b));
        }
        self.record(name, tol, worst);
        Ok(())
    }

    fn batch(&self, d: &BatchDesc) -> R<Two<Batch>> {
        let b = |i: usize| {
            self.bes[i]
                .prepare_batch(d.clone())
                .map_err(|e| format!("prepare_batch: {e}"))
        };
        Ok([b(0)?, b(1)?])
    }

    /// A weight of `ty` and `shape` holding `vals` (quantised as `ty`) on both backends.
    fn weight(&self, name: &str, ty: GgmlType, shape: Vec<usize>, vals: &[f32]) -> R<Two<Weight>> {
        let bytes = match ty {
            GgmlType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgmlType::F16 => f16_bytes(vals),
            GgmlType::BF16 => vals
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            _ => (self.quantize)(ty, vals),
        };
        let hw = HostWeight {
            name: name.to_string(),
            dtype: ty,
            shape,
            bytes: HostBytes::from_vec(bytes),
        };
        let w = |i: usize| {
            self.bes[i]
                .upload_weight(&hw)
                .map_err(|e| format!("upload_weight {name} {ty}: {e}"))
        };
        Ok([w(0)?, w(1)?])
    }

    /// [`Suite::weight`], plus the weight's values as the backends see them (the quantised
    /// rows dequantised on the host), row-major `[rows, n_in]`.
    fn weight_exact(
        &self,
        name: &str,
        ty: GgmlType,
        shape: Vec<usize>,
        vals: &[f32],
    ) -> R<(Two<Weight>, Vec<f32>)> {
        let n_in = shape.last().copied().unwrap_or(0);
        let exact = match ty {
            GgmlType::F32 => vals.to_vec(),
            GgmlType::F16 => vals
                .iter()
                .map(|v| half::f16::from_f32(*v).to_f32())
                .collect(),
            GgmlType::BF16 => vals
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_f32())
                .collect(),
            _ => {
                let bytes = (self.quantize)(ty, vals);
                let rb = ty.row_bytes(n_in).unwrap_or(0);
                let mut out = vec![0f32; vals.len()];
                if n_in > 0 {
                    for (o, b) in out
                        .chunks_exact_mut(n_in)
                        .zip(bytes.chunks_exact(rb.max(1)))
                    {
                        kapitsa_base::quant::dequantize_row(ty, b, o)
                            .map_err(|e| format!("dequantize {ty}: {e}"))?;
                    }
                }
                out
            }
        };
        Ok((self.weight(name, ty, shape, vals)?, exact))
    }

    /// A random weight of `ty`, values `±[0.05, 1) * scale`.
    fn rand_weight(
        &mut self,
        name: &str,
        ty: GgmlType,
        shape: Vec<usize>,
        scale: f32,
    ) -> R<Two<Weight>> {
        let n = shape.iter().product();
        let v = self.rng.vals(n, scale);
        self.weight(name, ty, shape, &v)
    }
}

// ---- host encodings -------------------------------------------------------------------------

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
        .collect()
}

/// `n` (a multiple of 32) values that Q8_0 represents exactly: per block of 32 a power-of-two
/// scale `d` and nonzero integers in `-127..=127` with one `±127`, so `amax / 127 = d` and
/// every quantiser rounds to the same codes.
fn q8_exact(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n / 32 {
        let d = (2f32).powi(-(rng.range(3, 8) as i32));
        let top = rng.range(0, 31);
        for j in 0..32 {
            let q = if j == top {
                127
            } else {
                rng.range(1, 126) as i32
            };
            let q = if rng.coin() { q } else { -q };
            v.push(q as f32 * d);
        }
    }
    v
}

/// Q8_0 blocks of values (exact for [`q8_exact`] values).
fn q8_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() / 32 * 34);
    for b in v.chunks_exact(32) {
        let d = b.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(b.iter().map(|x| (x * id).round() as i8 as u8));
    }
    out
}

/// Bytes of a tensor's storage encoding as f32 values (u32 values converted).
fn decode(dt: DType, b: &[u8]) -> Vec<f32> {
    match dt {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::U32 => b
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::Q8_0 => b
            .chunks_exact(34)
            .flat_map(|blk| {
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                blk[2..].iter().map(move |&q| f32::from(q as i8) * d)
            })
            .collect(),
    }
}

/// `n` elements of valid random contents of `dt`, as bytes.
fn rand_bytes(rng: &mut Rng, dt: DType, n: usize) -> Vec<u8> {
    match dt {
        DType::F32 => rng
            .vals(n, 1.0)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => f16_bytes(&rng.vals(n, 1.0)),
        DType::Q8_0 => q8_bytes(&q8_exact(rng, n)),
        DType::U32 => (0..n)
            .flat_map(|_| (rng.u64() as u32).to_le_bytes())
            .collect(),
    }
}

// ---- batches --------------------------------------------------------------------------------

/// What a random batch looks like.
struct BatchSpec {
    /// Slots of the state tensors (sequences pick distinct ones, in random order).
    n_slots: usize,
    /// Longest sequence chunk.
    max_len: usize,
    /// Latest first position.
    max_pos0: usize,
    /// Positions per KV block (0: no block tables).
    block_size: usize,
    /// Token ids below this.
    vocab: usize,
}

/// A random batch of 1 to 3 sequences and the number of KV blocks its tables use (ids
/// `0..n_blocks` shuffled, so tables are not contiguous).
fn rand_batch(rng: &mut Rng, spec: &BatchSpec) -> (BatchDesc, usize) {
    let n_seqs = rng.range(1, spec.n_slots.min(3));
    let mut slots: Vec<usize> = (0..spec.n_slots).collect();
    rng.shuffle(&mut slots);
    let mut d = BatchDesc {
        block_size: spec.block_size,
        ..Default::default()
    };
    let mut shapes = Vec::new();
    let mut total_blocks = 0;
    for &slot in &slots[..n_seqs] {
        let len = rng.range(1, spec.max_len);
        let pos0 = rng.range(0, spec.max_pos0);
        let blocks = if spec.block_size > 0 {
            (pos0 + len).div_ceil(spec.block_size) + rng.range(0, 1)
        } else {
            0
        };
        total_blocks += blocks;
        shapes.push((slot, len, pos0, blocks));
    }
    let n_blocks = total_blocks + rng.range(0, 3);
    let mut ids: Vec<u32> = (0..n_blocks as u32).collect();
    rng.shuffle(&mut ids);
    for (slot, len, pos0, blocks) in shapes {
        let start = d.tokens.len();
        let table_start = d.block_tables.len();
        d.block_tables
            .extend(&ids[table_start..table_start + blocks]);
        for j in 0..len {
            d.tokens.push(rng.range(0, spec.vocab - 1) as u32);
            d.positions.push((pos0 + j) as u32);
        }
        d.seqs.push(SeqDesc {
            slot,
            start,
            len,
            pos0,
            table_start,
            table_len: blocks,
        });
    }
    let mut rows: Vec<u32> = (0..d.tokens.len() as u32).collect();
    rng.shuffle(&mut rows);
    rows.truncate(rng.range(0, rows.len()));
    d.logit_rows = rows;
    (d, n_blocks)
}

fn plain_batch(rng: &mut Rng, max_len: usize) -> BatchDesc {
    let spec = BatchSpec {
        n_slots: 4,
        max_len,
        max_pos0: 5000,
        block_size: 0,
        vocab: 1,
    };
    rand_batch(rng, &spec).0
}

// ---- memory ---------------------------------------------------------------------------------

/// `upload_f32` / `write_f32` / `read_f32` and `write_bytes` / `read_bytes` round trips.
fn memory(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let n = s.rng.range(1, 300);
        let v = s.rng.vals(n, 3.0);
        let mut t = s.up(&v)?;
        let off = s.rng.range(0, n - 1);
        let m = s.rng.range(0, n - off);
        let w = s.rng.vals(m, 1.0);
        s.both("write_f32", |be, i| be.write_f32(&mut t[i], off, &w))?;
        let mut want = v.clone();
        want[off..off + w.len()].copy_from_slice(&w);
        let [a, b] = s.read(&t)?;
        s.record(
            "write_f32/read_f32",
            TOL_EXACT,
            rel_err(&a, &want).max(rel_err(&b, &want)),
        );

        for dt in [DType::F32, DType::F16, DType::Q8_0, DType::U32] {
            let unit = if dt == DType::Q8_0 { 32 } else { 1 };
            let n = unit * s.rng.range(1, 12);
            let mut t = s.alloc(dt, n)?;
            let off = unit * s.rng.range(0, n / unit - 1);
            let m = unit * s.rng.range(1, (n - off) / unit);
            let bytes = rand_bytes(&mut s.rng, dt, m);
            s.both("write_bytes", |be, i| {
                be.write_bytes(&mut t[i], off, &bytes)
            })?;
            let mut ok = true;
            for (be, t) in s.bes.iter().zip(&t) {
                let got = be
                    .read_bytes(t, off, m)
                    .map_err(|e| format!("read_bytes: {e}"))?;
                let all = be
                    .read_bytes(t, 0, n)
                    .map_err(|e| format!("read_bytes: {e}"))?;
                let zeros = decode(dt, &all)
                    .iter()
                    .enumerate()
                    .all(|(j, &x)| (off..off + m).contains(&j) || x == 0.0);
                ok &= got == bytes && zeros;
            }
            s.record(
                "write_bytes/read_bytes",
                TOL_EXACT,
                if ok { 0.0 } else { 1.0 },
            );
        }
    }
    Ok(())
}

/// `copy` between tensors and `copy_within` one tensor, every dtype, checked byte for byte
/// against the host's copy.
fn copies(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        for dt in [DType::F32, DType::F16, DType::Q8_0, DType::U32] {
            let unit = if dt == DType::Q8_0 { 32 } else { 1 };
            let (ns, nd) = (unit * s.rng.range(2, 12), unit * s.rng.range(2, 12));
            let (bs, bd) = (
                rand_bytes(&mut s.rng, dt, ns),
                rand_bytes(&mut s.rng, dt, nd),
            );
            let src = s.with_bytes(dt, ns, &bs)?;
            let mut dst = s.with_bytes(dt, nd, &bd)?;
            let n = unit * s.rng.range(1, ns.min(nd) / unit);
            let so = unit * s.rng.range(0, (ns - n) / unit);
            let d_o = unit * s.rng.range(0, (nd - n) / unit);
            s.both("copy", |be, i| be.copy(&src[i], so, &mut dst[i], d_o, n))?;
            let (mut vs, mut vd) = (decode(dt, &bs), decode(dt, &bd));
            vd[d_o..d_o + n].copy_from_slice(&vs[so..so + n]);
            let [a, b] = s.read_any(&dst)?;
            let ok = a == vd && b == vd;
            s.record("copy", TOL_EXACT, if ok { 0.0 } else { 1.0 });

            // Two disjoint ranges of `src`.
            let mut t = src;
            let half = ns / unit / 2;
            let n = unit * s.rng.range(1, half);
            let (lo, hi) = (
                unit * s.rng.range(0, half - n / unit),
                unit * s.rng.range(half, ns / unit - n / unit),
            );
            let (from, to) = if s.rng.coin() { (lo, hi) } else { (hi, lo) };
            s.both("copy_within", |be, i| {
                be.copy_within(&mut t[i], from, to, n)
            })?;
            vs.copy_within(from..from + n, to);
            let [a, b] = s.read_any(&t)?;
            let ok = a == vs && b == vs;
            s.record("copy_within", TOL_EXACT, if ok { 0.0 } else { 1.0 });
        }
    }
    Ok(())
}

// ---- element-wise and row ops ---------------------------------------------------------------

/// rms_norm, add, add_bias, mul_sigmoid, split_cols, gather_logit_rows, l2_norm,
/// gated_rms_norm, gated_group_rms_norm.
fn rows(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let width = s.rng.range(1, 300);
        let n = s.rng.range(1, 9);
        let eps = s.rng.pick(&[1e-6f32, 1e-5]);
        let x = s.rng.vals(n * width, 2.0);
        let w = s.rng.vals(width, 1.0);
        let (wt, bt) = (s.up(&w)?, s.rand(width, 1.0)?);

        let mut t = s.up(&x)?;
        s.both("rms_norm", |be, i| {
            be.rms_norm(&mut t[i], width, &wt[i], eps)
        })?;
        s.cmp("rms_norm", s.tol.f32, &t)?;

        let src = s.up(&x)?;
        let mut o = s.alloc(DType::F32, n * width)?;
        s.both("rms_norm_to", |be, i| {
            be.rms_norm_to(&src[i], &mut o[i], width, &wt[i], eps)
        })?;
        s.cmp("rms_norm_to", s.tol.f32, &o)?;
        let [a, b] = s.read(&src)?;
        s.record(
            "rms_norm_to keeps x",
            0.0,
            rel_err(&a, &x).max(rel_err(&b, &x)),
        );

        let mut t = s.up(&x)?;
        let o = s.rand(n * width, 1.0)?;
        s.both("add", |be, i| be.add(&mut t[i], &o[i]))?;
        s.cmp("add", s.tol.f32, &t)?;

        let mut t = s.up(&x)?;
        s.both("add_bias", |be, i| be.add_bias(&mut t[i], &bt[i]))?;
        s.cmp("add_bias", s.tol.f32, &t)?;

        let mut t = s.up(&x)?;
        let g = s.rand(n * width, 4.0)?;
        s.both("mul_sigmoid", |be, i| be.mul_sigmoid(&mut t[i], &g[i]))?;
        s.cmp("mul_sigmoid", s.tol.f32, &t)?;

        let mut t = s.up(&x)?;
        s.both("l2_norm", |be, i| be.l2_norm(&mut t[i], width, eps, 0.7))?;
        s.cmp("l2_norm", s.tol.f32, &t)?;

        let mut t = s.up(&x)?;
        let z = s.rand(n * width, 3.0)?;
        s.both("gated_rms_norm", |be, i| {
            be.gated_rms_norm(&mut t[i], &z[i], width, &wt[i], eps)
        })?;
        s.cmp("gated_rms_norm", s.tol.f32, &t)?;

        let n_groups = s.rng.range(1, 4);
        let d_inner = n_groups * s.rng.range(1, 70);
        let mut y = s.rand(n * d_inner, 2.0)?;
        let z = s.rand(n * d_inner, 3.0)?;
        let gw = s.rand(d_inner, 1.0)?;
        s.both("gated_group_rms_norm", |be, i| {
            be.gated_group_rms_norm(&mut y[i], &z[i], d_inner, n_groups, &gw[i], eps)
        })?;
        s.cmp("gated_group_rms_norm", s.tol.f32, &y)?;

        let widths: Vec<usize> = (0..s.rng.range(1, 4)).map(|_| s.rng.range(1, 70)).collect();
        let total: usize = widths.iter().sum();
        let src = s.rand(n * total, 1.0)?;
        let mut outs = Vec::new();
        for &w in &widths {
            outs.push(s.alloc(DType::F32, n * w)?);
        }
        s.both("split_cols", |be, i| {
            let mut o: Vec<&mut Tensor> = outs.iter_mut().map(|p| &mut p[i]).collect();
            be.split_cols(&src[i], n, &widths, &mut o)
        })?;
        let [sv, _] = s.read(&src)?;
        let mut worst = 0f32;
        let mut col = 0;
        for (o, &w) in outs.iter().zip(&widths) {
            let want: Vec<f32> = (0..n)
                .flat_map(|r| sv[r * total + col..r * total + col + w].to_vec())
                .collect();
            let [a, b] = s.read(o)?;
            worst = worst.max(rel_err(&a, &want)).max(rel_err(&b, &want));
            col += w;
        }
        s.record("split_cols", TOL_EXACT, worst);

        let d = plain_batch(&mut s.rng, 6);
        let nt = d.n_tokens();
        let b = s.batch(&d)?;
        let xs = s.rand(nt * width, 1.0)?;
        let mut out = s.alloc(DType::F32, d.logit_rows.len() * width)?;
        s.both("gather_logit_rows", |be, i| {
            be.gather_logit_rows(&xs[i], width, &b[i], &mut out[i])
        })?;
        let [xv, _] = s.read(&xs)?;
        let want: Vec<f32> = d
            .logit_rows
            .iter()
            .flat_map(|&r| xv[r as usize * width..(r as usize + 1) * width].to_vec())
            .collect();
        let [a, bb] = s.read(&out)?;
        s.record(
            "gather_logit_rows",
            TOL_EXACT,
            rel_err(&a, &want).max(rel_err(&bb, &want)),
        );
    }
    Ok(())
}

/// gdn_gates and softplus_bias (inputs past the softplus threshold of 20 included).
fn gates(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let nv = s.rng.range(1, 40);
        let n = s.rng.range(1, 9);
        let bias = s.rand(nv, 1.0)?;
        let a_neg: Vec<f32> = (0..nv).map(|_| -(s.rng.unit() * 3.0 + 0.01)).collect();
        let a_neg = s.up(&a_neg)?;
        let mut beta = s.rand(n * nv, 5.0)?;
        let mut g = s.rand(n * nv, 25.0)?;
        s.both("gdn_gates", |be, i| {
            be.gdn_gates(&mut beta[i], &mut g[i], &bias[i], &a_neg[i])
        })?;
        s.cmp_all("gdn_gates", s.tol.f32, &[&beta, &g])?;

        let mut dt = s.rand(n * nv, 25.0)?;
        s.both("softplus_bias", |be, i| {
            be.softplus_bias(&mut dt[i], &bias[i])
        })?;
        s.cmp("softplus_bias", s.tol.f32, &dt)?;
    }
    Ok(())
}

/// NeoX RoPE over all or part of each head, positions up to ~5000.
fn rope(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let n_heads = s.rng.range(1, 4);
        let head_dim = 2 * s.rng.range(1, 40);
        let n_rot = if s.rng.coin() {
            head_dim
        } else {
            2 * s.rng.range(0, head_dim / 2)
        };
        let theta = s.rng.pick(&[10_000f32, 1_000_000.0]);
        let d = plain_batch(&mut s.rng, 7);
        let b = s.batch(&d)?;
        let mut x = s.rand(d.n_tokens() * n_heads * head_dim, 2.0)?;
        let desc = RopeDesc { n_rot, theta };
        s.both("rope", |be, i| {
            be.rope(&mut x[i], n_heads, head_dim, desc, &b[i])
        })?;
        s.cmp("rope", s.tol.f32, &x)?;
        // q and k of one layer in one call
        let n_kv = s.rng.range(1, 3);
        let mut k = s.rand(d.n_tokens() * n_kv * head_dim, 2.0)?;
        s.both("rope_qk", |be, i| {
            be.rope_qk(&mut x[i], &mut k[i], n_heads, n_kv, head_dim, desc, &b[i])
        })?;
        s.cmp("rope_qk q", s.tol.f32, &x)?;
        s.cmp("rope_qk k", s.tol.f32, &k)?;
    }
    Ok(())
}

// ---- matrix products ------------------------------------------------------------------------

/// A random row width for `ty`: odd sizes for the float types, whole blocks otherwise (not
/// multiples of 256 for the 32-element formats).
fn rand_n_in(rng: &mut Rng, ty: GgmlType) -> usize {
    match ty.block_size() {
        1 => rng.range(1, 300),
        256 => 256 * rng.range(1, 2),
        bs => bs * rng.range(1, 11),
    }
}

fn matmul(s: &mut Suite<'_>, ty: GgmlType) -> R<()> {
    let name = format!("matmul {ty}");
    for _ in 0..s.cases {
        let n_in = rand_n_in(&mut s.rng, ty);
        let n_out = s.rng.range(1, 70);
        let n_tok = s.rng.pick(&[1, 2, 3, 4, 5, 7, 9, 16, 21]);
        let wv = s.rng.vals(n_out * n_in, 0.5);
        let (w, exact_w) = s.weight_exact("w", ty, vec![n_out, n_in], &wv)?;
        let xv = s.rng.vals(n_tok * n_in, 1.0);
        let x = s.up(&xv)?;
        let mut y = s.alloc(DType::F32, n_tok * n_out)?;
        s.both("matmul", |be, i| be.matmul(&w[i], &x[i], n_tok, &mut y[i]))?;
        // Exact products, and the scale of their rounding: the largest L2 norm of one
        // output's terms (a sum that cancels to near zero keeps the rounding of its terms,
        // so the plain `max |ref|` denominator would inflate its relative error).
        let mut scale = 0f64;
        let exact: Vec<f32> = (0..n_tok * n_out)
            .map(|o| {
                let (t, r) = (o / n_out, o % n_out);
                let xr = &xv[t * n_in..(t + 1) * n_in];
                let wr = &exact_w[r * n_in..(r + 1) * n_in];
                let (mut sum, mut sq) = (0f64, 0f64);
                for (a, b) in xr.iter().zip(wr) {
                    let p = f64::from(*a) * f64::from(*b);
                    sum += p;
                    sq += p * p;
                }
                scale = scale.max(sq.sqrt());
                sum as f32
            })
            .collect();
        let [got, want] = s.read(&y)?;
        let scaled = |a: &[f32], b: &[f32]| {
            let d = a.iter().zip(b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            let m = b.iter().fold(scale as f32, |m, v| m.max(v.abs()));
            if m > 0.0 {
                d / m
            } else {
                d
            }
        };
        s.record(&name, s.tol.matmul, scaled(&got, &want));
        let tol = s.tol.matmul_exact;
        s.record(&format!("{name} vs exact"), tol, scaled(&got, &exact));
    }
    Ok(())
}

/// Several matrices of mixed types sharing one input (up to 6, of two types: a GPU launches
/// the products of one type together, up to 4 a launch).
fn matmul_many(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let n_in = 256 * s.rng.range(1, 2);
        let n_tok = s.rng.pick(&[1, 2, 3, 4, 6, 11]);
        let count = s.rng.range(1, 6);
        let tys = [s.rng.pick(&WEIGHT_TYPES), s.rng.pick(&WEIGHT_TYPES)];
        let mut ws = Vec::new();
        let mut ys = Vec::new();
        for _ in 0..count {
            let ty = s.rng.pick(&tys);
            let n_out = s.rng.range(1, 50);
            ws.push(s.rand_weight("w", ty, vec![n_out, n_in], 0.5)?);
            ys.push(s.alloc(DType::F32, n_tok * n_out)?);
        }
        let x = s.rand(n_tok * n_in, 1.0)?;
        s.both("matmul_many", |be, i| {
            let w: Vec<&Weight> = ws.iter().map(|p| &p[i]).collect();
            let mut y: Vec<&mut Tensor> = ys.iter_mut().map(|p| &mut p[i]).collect();
            be.matmul_many(&w, &x[i], n_tok, &mut y)
        })?;
        let refs: Vec<&Two<Tensor>> = ys.iter().collect();
        s.cmp_all("matmul_many", s.tol.matmul, &refs)?;

        // with epilogues: a bias on some, accumulation on some
        let bs: Vec<Two<Tensor>> = ys
            .iter()
            .map(|y| s.rand(y[0].len() / n_tok, 1.0))
            .collect::<R<_>>()?;
        let flags: Vec<(bool, bool)> = (0..count)
            .map(|_| (s.rng.range(0, 2) == 1, s.rng.range(0, 3) == 2))
            .collect();
        s.both("matmul_many_with", |be, i| {
            let w: Vec<&Weight> = ws.iter().map(|p| &p[i]).collect();
            let mut y: Vec<&mut Tensor> = ys.iter_mut().map(|p| &mut p[i]).collect();
            let eps: Vec<crate::Epilogue<'_>> = flags
                .iter()
                .zip(&bs)
                .map(|(&(bias, accumulate), b)| crate::Epilogue {
                    bias: bias.then_some(&b[i]),
                    accumulate,
                })
                .collect();
            be.matmul_many_with(&w, &x[i], n_tok, &mut y, &eps)
        })?;
        let refs: Vec<&Two<Tensor>> = ys.iter().collect();
        s.cmp_all("matmul_many_with", s.tol.matmul, &refs)?;
    }
    Ok(())
}

/// Products of a pre-norm's output (a device backend may keep another form of the normed
/// rows for its GEMVs, e.g. int8): `matmul_many`, `matmul_with` and `mlp` of `rms_norm_to`'s
/// rows, then the same after those rows were changed by another op, which must be what the
/// products read.
fn normed_matmul(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let n_in = 256 * s.rng.range(1, 3);
        let n_tok = s.rng.pick(&[1, 1, 2, 3]);
        let ty = s
            .rng
            .pick(&[GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0]);
        let ws = (0..s.rng.range(1, 4))
            .map(|_| {
                let n_out = s.rng.range(1, 70);
                s.rand_weight("w", ty, vec![n_out, n_in], 0.5)
            })
            .collect::<R<Vec<_>>>()?;
        let mut ys = ws
            .iter()
            .map(|w| s.alloc(DType::F32, n_tok * w[0].shape[0]))
            .collect::<R<Vec<_>>>()?;
        let mlp = rand_mlp(s, ty, Act::SwiGlu, (n_in, 256, n_in))?;
        let mut ym = s.alloc(DType::F32, n_tok * n_in)?;
        let x = s.rand(n_tok * n_in, 2.0)?;
        let nw = s.rand(n_in, 1.0)?;
        let delta = s.rand(n_tok * n_in, 1.0)?;
        let mut h = s.alloc(DType::F32, n_tok * n_in)?;
        s.both("rms_norm_to", |be, i| {
            be.rms_norm_to(&x[i], &mut h[i], n_in, &nw[i], 1e-6)
        })?;
        for changed in [false, true] {
            if changed {
                s.both("add", |be, i| be.add(&mut h[i], &delta[i]))?;
            }
            let name = match changed {
                false => "matmul of normed rows",
                true => "matmul of normed rows, changed",
            };
            s.both(name, |be, i| {
                let w: Vec<&Weight> = ws.iter().map(|p| &p[i]).collect();
                let mut y: Vec<&mut Tensor> = ys.iter_mut().map(|p| &mut p[i]).collect();
                be.matmul_many(&w, &h[i], n_tok, &mut y)?;
                be.matmul_with(w[0], &h[i], n_tok, y[0], crate::Epilogue::default())?;
                be.mlp(&mlp[i], &h[i], n_tok, &mut ym[i])
            })?;
            let mut refs: Vec<&Two<Tensor>> = ys.iter().collect();
            refs.push(&ym);
            s.cmp_all(name, s.tol.ffn, &refs)?;
        }
    }
    Ok(())
}

/// Matrix products with an epilogue: a bias, accumulation into `y`, both; GEMV and GEMM
/// token counts.
fn matmul_with(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let ty = s.rng.pick(&WEIGHT_TYPES);
        let n_in = rand_n_in(&mut s.rng, ty);
        let n_out = s.rng.range(1, 70);
        let n_tok = s.rng.pick(&[1, 2, 3, 5, 9, 16, 21]);
        let w = s.rand_weight("w", ty, vec![n_out, n_in], 0.5)?;
        let x = s.rand(n_tok * n_in, 1.0)?;
        let b = s.rand(n_out, 1.0)?;
        for (bias, accumulate) in [(true, false), (false, true), (true, true)] {
            let mut y = s.rand(n_tok * n_out, 2.0)?;
            s.both("matmul_with", |be, i| {
                let ep = crate::Epilogue {
                    bias: bias.then_some(&b[i]),
                    accumulate,
                };
                be.matmul_with(&w[i], &x[i], n_tok, &mut y[i], ep)
            })?;
            s.cmp("matmul_with", s.tol.matmul, &y)?;
        }
    }
    Ok(())
}

fn embed(s: &mut Suite<'_>, ty: GgmlType) -> R<()> {
    let name = format!("embed {ty}");
    for _ in 0..s.cases {
        let n_in = rand_n_in(&mut s.rng, ty);
        let vocab = s.rng.range(2, 40);
        let w = s.rand_weight("tok_embd", ty, vec![vocab, n_in], 1.0)?;
        let spec = BatchSpec {
            n_slots: 3,
            max_len: 8,
            max_pos0: 100,
            block_size: 0,
            vocab,
        };
        let d = rand_batch(&mut s.rng, &spec).0;
        let b = s.batch(&d)?;
        let mut out = s.alloc(DType::F32, d.n_tokens() * n_in)?;
        s.both("embed", |be, i| be.embed(&w[i], &b[i], &mut out[i]))?;
        s.cmp(&name, s.tol.dequant, &out)?;
    }
    Ok(())
}

/// A random MLP `n_in -> n_ff -> n_out` of `ty` on both backends.
fn rand_mlp(
    s: &mut Suite<'_>,
    ty: GgmlType,
    act: Act,
    (n_in, n_ff, n_out): (usize, usize, usize),
) -> R<Two<MlpWeights>> {
    let gate = match act {
        Act::SwiGlu => Some(s.rand_weight("gate", ty, vec![n_ff, n_in], 0.5)?),
        Act::Relu2 => None,
    };
    let up = s.rand_weight("up", ty, vec![n_ff, n_in], 0.5)?;
    let down = s.rand_weight("down", ty, vec![n_out, n_ff], 0.5)?;
    Ok(
        zip2(zip2(opt2(gate), up), down).map(|((gate, up), down)| MlpWeights {
            gate,
            up,
            down,
            act,
        }),
    )
}

/// A width of whole blocks of `ty` (at least one 256 super-block for the K formats).
fn rand_width(rng: &mut Rng, ty: GgmlType) -> usize {
    match ty.block_size() {
        1 => rng.range(1, 100),
        256 => 256,
        bs => bs * rng.range(1, 6),
    }
}

fn mlp(s: &mut Suite<'_>, act: Act) -> R<()> {
    let name = match act {
        Act::SwiGlu => "mlp swiglu",
        Act::Relu2 => "mlp relu2",
    };
    for _ in 0..s.cases {
        let ty = s.rng.pick(&WEIGHT_TYPES);
        let (n_in, n_ff, n_out) = (
            rand_width(&mut s.rng, ty),
            rand_width(&mut s.rng, ty),
            s.rng.range(1, 40),
        );
        let n = s.rng.pick(&[1, 2, 3, 4, 5, 9]);
        let w = rand_mlp(s, ty, act, (n_in, n_ff, n_out))?;
        let x = s.rand(n * n_in, 1.0)?;
        let mut out = s.alloc(DType::F32, n * n_out)?;
        s.both("mlp", |be, i| be.mlp(&w[i], &x[i], n, &mut out[i]))?;
        s.cmp(name, s.tol.ffn, &out)?;
        let mut y = s.rand(n * n_out, 2.0)?;
        s.both("mlp_add", |be, i| be.mlp_add(&w[i], &x[i], n, &mut y[i]))?;
        s.cmp(&format!("{name} add"), s.tol.ffn, &y)?;
    }
    Ok(())
}

/// `Some([a, b])` as `[Some(a), Some(b)]`.
fn opt2<T>(o: Option<Two<T>>) -> Two<Option<T>> {
    match o {
        Some([a, b]) => [Some(a), Some(b)],
        None => [None, None],
    }
}

/// Pair up the backends' halves of two pairs.
fn zip2<A, B>([a0, a1]: Two<A>, [b0, b1]: Two<B>) -> Two<(A, B)> {
    [(a0, b0), (a1, b1)]
}

fn argmax(s: &mut Suite<'_>) -> R<()> {
    for _ in 0..s.cases {
        let width = s.rng.range(1, 1000);
        let n = s.rng.range(1, 6);
        let v = s.rng.vals(n * width, 10.0);
        let x = s.up(&v)?;
        let want: Vec<u32> = v
            .chunks_exact(width)
            .map(|r| {
                let mut best = 0;
                for (i, &y) in r.iter().enumerate() {
                    if y > r[best] {
                        best = i;
                    }
                }
                best as u32
            })
            .collect();
        let mut ok = true;
        for (be, x) in s.bes.iter().zip(&x) {
            let got = be
                .argmax_rows(x, width)
                .map_err(|e| format!("argmax_rows: {e}"))?;
            ok &= got == want;
        }
        s.record("argmax_rows", TOL_EXACT, if ok { 0.0 } else { 1.0 });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_err_and_encodings() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(rel_err(&[1.0, 2.5], &[1.0, 2.0]), 0.25);
        assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), f32::INFINITY);
        assert_eq!(rel_err(&[f32::NAN], &[1.0]), f32::INFINITY);
        let mut rng = Rng::new(3);
        let v = q8_exact(&mut rng, 64);
        assert!(v.iter().all(|&x| x != 0.0));
        assert_eq!(decode(DType::Q8_0, &q8_bytes(&v)), v);
        let f = rng.vals(10, 1.0);
        assert_eq!(
            decode(DType::F16, &f16_bytes(&f)),
            f.iter()
                .map(|x| half::f16::from_f32(*x).to_f32())
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn random_batches_keep_the_invariants() {
        let mut rng = Rng::new(11);
        for _ in 0..200 {
            let spec = BatchSpec {
                n_slots: 4,
                max_len: 9,
                max_pos0: 40,
                block_size: 16,
                vocab: 7,
            };
            let (d, n_blocks) = rand_batch(&mut rng, &spec);
            let mut next = 0;
            let mut seen = Vec::new();
            for (i, s) in d.seqs.iter().enumerate() {
                assert_eq!(s.start, next);
                assert!(s.len >= 1 && !seen.contains(&s.slot));
                seen.push(s.slot);
                assert!(s.table_len * 16 >= s.pos0 + s.len);
                assert!(d.table(i).iter().all(|&b| (b as usize) < n_blocks));
                for j in 0..s.len {
                    assert_eq!(d.positions[s.start + j] as usize, s.pos0 + j);
                }
                next += s.len;
            }
            assert_eq!(next, d.n_tokens());
            assert!(d.tokens.iter().all(|&t| t < 7));
            assert!(d.logit_rows.iter().all(|&r| (r as usize) < next));
        }
    }
}
