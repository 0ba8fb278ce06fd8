//! GPU tests of the quantised matrix products and the embedding gather (src/matmul.rs,
//! kernels/matmul.cu) against the scalar CPU backend, through the `Backend` trait.
//!
//! They need a GPU: run them with
//! `KAPITSA_GPU_TESTS=1 cargo test -p kapitsa-backend-cuda --features cuda --release --test gpu_matmul -- --nocapture --test-threads 1`.
//! Without `KAPITSA_GPU_TESTS=1` every test prints "skipped: KAPITSA_GPU_TESTS not set" and
//! passes.
//!
//! Two references per product (errors are `max |gpu - ref| / max |ref|`, the denominator
//! floored at the L2 norm of one output's terms, see `rel_err`):
//! - `exact`: an f64 dot product of the exactly dequantised weights (the CPU backend's
//!   embedding gather, i.e. kernels-cpu `dequantize_row`) with the f32 activations. The GEMV
//!   computes the same thing in f32, so it must agree to ~1e-6 relative; the tensor-core GEMM
//!   rounds weights and activations to f16 first.
//! - `cpu`: the scalar CPU backend's matmul (kernels-cpu `matmul_scalar`), which rounds the
//!   activations to the weight type's dot type first (Q8_0 / Q8_K blocks for the quantised
//!   types, f16 / bf16 for F16 / BF16 weights), so it differs from both GPU paths by that
//!   rounding; printed, and checked against a tolerance derived from it.
#![cfg(feature = "cuda")]

use kapitsa_backend::{Backend, BatchDesc, DType, HostBytes, HostWeight, SeqDesc, Tensor, Weight};
use kapitsa_backend_cpu::testing::{quantize_weight, reference};
use kapitsa_backend_cuda::CudaBackend;
use kapitsa_base::pool::SerialPool;
use kapitsa_base::GgmlType;

/// The GPU backend, or `None` (after printing why) when GPU tests are not enabled.
fn gpu() -> Option<CudaBackend> {
    if std::env::var("KAPITSA_GPU_TESTS").as_deref() != Ok("1") {
        println!("skipped: KAPITSA_GPU_TESTS not set");
        return None;
    }
    Some(CudaBackend::new(0).expect("KAPITSA_GPU_TESTS=1 but no usable GPU"))
}

fn cpu() -> impl Backend {
    reference(Box::new(SerialPool)).expect("scalar CPU backend")
}

/// xorshift64*: deterministic test values.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn sym(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const TYPES: [GgmlType; 9] = [
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

/// Token counts: every GEMV kernel size class, a two-launch GEMV (13), cuBLAS (17, 64, 300).
const TOKENS: [usize; 9] = [1, 2, 3, 5, 8, 13, 17, 64, 300];

fn is_k(ty: GgmlType) -> bool {
    ty.block_size() == 256
}

fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Row widths to test for a type: whole blocks, several chunk counts per lane (K formats:
/// 64-element chunks, 4 per block), and for the float types widths that are not multiples of
/// the GEMV chunk (which then take cuBLAS at every token count).
fn widths(ty: GgmlType) -> Vec<usize> {
    if is_k(ty) {
        vec![256, 768, 2560]
    } else if is_float(ty) {
        vec![20, 37, 96, 1056]
    } else {
        vec![32, 96, 1056]
    }
}

fn host_weight(ty: GgmlType, shape: Vec<usize>, bytes: Vec<u8>) -> HostWeight {
    HostWeight {
        name: format!("test_{ty}"),
        dtype: ty,
        shape,
        bytes: HostBytes::from_vec(bytes),
    }
}

/// Random weights `[n_out, n_in]` of `ty` (values in [-1, 1) quantised by the CPU backend's
/// test quantiser).
fn random_weight(ty: GgmlType, n_out: usize, n_in: usize, seed: u64) -> HostWeight {
    let mut rng = Rng::new(seed);
    let vals: Vec<f32> = (0..n_out * n_in).map(|_| rng.sym()).collect();
    let bytes = quantize_weight(ty, &vals).expect("quantise");
    host_weight(ty, vec![n_out, n_in], bytes)
}

/// A one-sequence batch of these token ids.
fn batch_desc(tokens: Vec<u32>) -> BatchDesc {
    let n = tokens.len();
    BatchDesc {
        tokens,
        positions: (0..n as u32).collect(),
        seqs: vec![SeqDesc {
            slot: 0,
            start: 0,
            len: n,
            pos0: 0,
            table_start: 0,
            table_len: 0,
        }],
        ..Default::default()
    }
}

fn read(b: &dyn Backend, t: &Tensor) -> Vec<f32> {
    let mut v = vec![0.0f32; t.len()];
    b.read_f32(t, 0, &mut v).expect("read");
    v
}

/// `out[i, :] = dequant(w[ids[i], :])` on backend `b`.
fn embed(b: &dyn Backend, w: &Weight, ids: &[u32], n_in: usize) -> Vec<f32> {
    let batch = b.prepare_batch(batch_desc(ids.to_vec())).expect("batch");
    let mut out = b.alloc(DType::F32, ids.len() * n_in).expect("alloc");
    b.embed(w, &batch, &mut out).expect("embed");
    read(b, &out)
}

/// `y = x @ w^T` on backend `b`.
fn matmul(b: &dyn Backend, w: &Weight, x: &[f32], n_tok: usize, n_out: usize) -> Vec<f32> {
    let xt = b.upload_f32(x).expect("upload x");
    let mut y = b.alloc(DType::F32, n_tok * n_out).expect("alloc y");
    b.matmul(w, &xt, n_tok, &mut y).expect("matmul");
    read(b, &y)
}

/// An f64 reference product: `y = x @ deq^T` for dequantised rows `deq [n_out, n_in]`, and
/// the largest L2 norm of one output's terms, `max_(t, r) |x[t] * deq[r]|_2`.
struct Exact {
    y: Vec<f64>,
    terms: f64,
}

fn exact_matmul(deq: &[f32], x: &[f32], n_tok: usize, n_out: usize, n_in: usize) -> Exact {
    let mut y = vec![0.0f64; n_tok * n_out];
    let mut terms = 0.0f64;
    for t in 0..n_tok {
        let xr = &x[t * n_in..(t + 1) * n_in];
        for r in 0..n_out {
            let wr = &deq[r * n_in..(r + 1) * n_in];
            let (mut s, mut s2) = (0.0f64, 0.0f64);
            for (a, b) in wr.iter().zip(xr) {
                let p = f64::from(*a) * f64::from(*b);
                s += p;
                s2 += p * p;
            }
            y[t * n_out + r] = s;
            terms = terms.max(s2.sqrt());
        }
    }
    Exact { y, terms }
}

/// `max |a - b| / max(max |b|, terms)`: the largest error relative to the largest reference
/// output, floored at the L2 norm of an output's terms (the scale rounding errors of a dot
/// product grow with), so a few outputs that happen to be near zero (n_out = 1) do not make
/// the ratio meaningless.
fn rel_err(a: &[f32], b: impl Iterator<Item = f64> + Clone, terms: f64) -> f64 {
    let scale = b
        .clone()
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(terms)
        .max(1e-30);
    let err = a
        .iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((f64::from(*x) - y).abs()));
    err / scale
}

/// Tolerances `(vs exact, vs the CPU reference)` for a type and path.
///
/// GEMV (`n_tok <= 16`, rows of whole chunks): f32 accumulation of the exact weights against f32
/// activations (the biased-float decoding loses at most a bit or two, see quant.cuh), so 2e-5
/// against the f64 exact product. The CPU reference rounds the activations: to Q8_0/Q8_K blocks
/// (each value to 1/127 of its block's absolute maximum, so up to ~0.4% per element, random in
/// sign; the sum of n such errors relative to the largest output stays below ~1e-2 for these
/// sizes), to bf16 (2^-9 relative per element) or f16 (2^-12); F32 is the same product in f64
/// (1e-5).
///
/// cuBLAS (`n_tok > 16`, or float rows of partial chunks): F32 in full f32 (1e-5 both ways);
/// F16/BF16 round x exactly as the CPU reference does and sum exact products in f32 (1e-4 vs
/// cpu); quantised weights are rounded to f16 (2^-12 relative per element) and x too, so ~1e-3
/// against exact (asserted 4e-3) and the q8 tolerance against cpu.
fn tolerances(ty: GgmlType, gemv: bool) -> (f64, f64) {
    let q8 = 2e-2;
    match (ty, gemv) {
        (GgmlType::F32, _) => (1e-5, 1e-5),
        (GgmlType::F16, true) => (2e-5, 4e-3),
        (GgmlType::BF16, true) => (2e-5, 2e-2),
        (GgmlType::F16, false) => (4e-3, 1e-4),
        (GgmlType::BF16, false) => (2e-2, 1e-4),
        (_, true) => (2e-5, q8),
        (_, false) => (4e-3, q8),
    }
}

/// Whether the GPU takes the GEMV kernels for this type, width and token count (mirrors
/// src/matmul.rs: `n_tok <= GEMV_SPLIT_MAX_TOKENS` (16) and rows of whole chunks).
fn takes_gemv(ty: GgmlType, n_in: usize, n_tok: usize) -> bool {
    let chunk = match ty {
        GgmlType::F32 => 4,
        GgmlType::F16 | GgmlType::BF16 => 8,
        _ => 16,
    };
    n_tok <= 16 && n_in.is_multiple_of(chunk)
}

#[test]
fn matmul_matches_the_references_for_every_type() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut failures = Vec::new();
    for ty in TYPES {
        for n_in in widths(ty) {
            // 20011 rows: more row groups than one wave of GEMV blocks (the grid-stride rounds)
            for n_out in [1usize, 7, 257, 4099, 20011] {
                let seed = (ty as u64) << 32 ^ (n_in as u64) << 16 ^ n_out as u64;
                let hw = random_weight(ty, n_out, n_in, seed);
                let wg = g.upload_weight(&hw).expect("gpu upload");
                let wc = c.upload_weight(&hw).expect("cpu upload");
                let ids: Vec<u32> = (0..n_out as u32).collect();
                let deq = embed(&c, &wc, &ids, n_in);
                for n_tok in TOKENS {
                    // bound the scalar reference's work on the largest shapes
                    if n_out * n_in * n_tok > 40_000_000 {
                        continue;
                    }
                    let mut rng = Rng::new(seed ^ n_tok as u64);
                    // a small positive mean, as activations after SwiGLU have
                    let x: Vec<f32> = (0..n_tok * n_in).map(|_| 0.1 + rng.sym()).collect();
                    let yg = matmul(&g, &wg, &x, n_tok, n_out);
                    let yc = matmul(&c, &wc, &x, n_tok, n_out);
                    let ye = exact_matmul(&deq, &x, n_tok, n_out, n_in);
                    let e_exact = rel_err(&yg, ye.y.iter().copied(), ye.terms);
                    let e_cpu = rel_err(&yg, yc.iter().map(|v| f64::from(*v)), ye.terms);
                    let gemv = takes_gemv(ty, n_in, n_tok);
                    let (t_exact, t_cpu) = tolerances(ty, gemv);
                    let ok =
                        e_exact <= t_exact && e_cpu <= t_cpu && yg.iter().all(|v| v.is_finite());
                    println!(
                        "{:5} {:>4} x {:>4} n_tok {:>3} {}: vs exact {e_exact:.2e} (tol {t_exact:.0e}), \
                         vs cpu {e_cpu:.2e} (tol {t_cpu:.0e}){}",
                        ty.to_string(),
                        n_out,
                        n_in,
                        n_tok,
                        if gemv { "gemv " } else { "cublas" },
                        if ok { "" } else { "  FAIL" }
                    );
                    if !ok {
                        failures.push(format!("{ty} {n_out}x{n_in} n_tok {n_tok}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "out of tolerance: {failures:?}");
}

#[test]
fn embed_is_exact_for_every_type() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for ty in TYPES {
        for n_in in widths(ty) {
            let n_out = 301;
            let hw = random_weight(ty, n_out, n_in, 0xE3BED ^ ty as u64 ^ (n_in as u64) << 20);
            let wg = g.upload_weight(&hw).expect("gpu upload");
            let wc = c.upload_weight(&hw).expect("cpu upload");
            let mut rng = Rng::new(ty as u64 + n_in as u64);
            let mut ids: Vec<u32> = (0..37).map(|_| rng.below(n_out) as u32).collect();
            ids.extend([0, n_out as u32 - 1, 5, 5]);
            let eg = embed(&g, &wg, &ids, n_in);
            let ec = embed(&c, &wc, &ids, n_in);
            let bad = eg
                .iter()
                .zip(&ec)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            println!(
                "embed {ty:5} n_in {n_in:>4}: {}",
                if bad.is_none() {
                    "bit-exact"
                } else {
                    "MISMATCH"
                }
            );
            if let Some(i) = bad {
                panic!(
                    "{ty} n_in {n_in}: element {i} (row {}, col {}): gpu {} cpu {}",
                    i / n_in,
                    i % n_in,
                    eg[i],
                    ec[i]
                );
            }
        }
    }
}

/// `matmul_rows` on a 3-D expert stack (the MoE entry point), for the GEMV and cuBLAS paths.
#[test]
fn matmul_rows_of_one_expert() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::F16,
    ] {
        let (n_exp, n_out, n_in) = (3usize, 257usize, 512usize);
        let mut rng = Rng::new(0x3E ^ ty as u64);
        let vals: Vec<f32> = (0..n_exp * n_out * n_in).map(|_| rng.sym()).collect();
        let bytes = quantize_weight(ty, &vals).expect("quantise");
        let rb = ty.row_bytes(n_in).expect("whole blocks");
        let stack = host_weight(ty, vec![n_exp, n_out, n_in], bytes.clone());
        let (e, rows) = (1usize, 5usize..200);
        // the reference: expert e's rows as a 2-D matrix on the CPU
        let sub = bytes[(e * n_out + rows.start) * rb..(e * n_out + rows.end) * rb].to_vec();
        let sub_w = c
            .upload_weight(&host_weight(ty, vec![rows.len(), n_in], sub))
            .expect("cpu upload");
        let ids: Vec<u32> = (0..rows.len() as u32).collect();
        let deq = embed(&c, &sub_w, &ids, n_in);
        for n_tok in [1usize, 3, 8, 11, 17] {
            let x: Vec<f32> = (0..n_tok * n_in).map(|_| rng.sym()).collect();
            let y = g
                .debug_matmul_rows(&stack, e, rows.clone(), &x, n_tok)
                .expect("matmul_rows");
            let ye = exact_matmul(&deq, &x, n_tok, rows.len(), n_in);
            let err = rel_err(&y, ye.y.iter().copied(), ye.terms);
            let tol = tolerances(ty, takes_gemv(ty, n_in, n_tok)).0;
            println!("matmul_rows {ty:5} expert {e} rows {rows:?} n_tok {n_tok:>2}: vs exact {err:.2e} (tol {tol:.0e})");
            assert!(err <= tol, "{ty} n_tok {n_tok}: {err:e}");
        }
    }
}

/// The fused GEMV launches (src/matmul/gemv.rs) against f64 references of the exactly
/// dequantised weights: q/k/v-like products of one format in one launch (`matmul_many_with`,
/// with a bias and accumulation), and the SwiGLU MLP whose gate/up pair runs in one launch
/// with `silu(g) * u` in the epilogue (`mlp_add`). Widths up to 4096 make the K split (2 warps
/// per row group) happen; 9 tokens make two launches.
#[test]
fn fused_gemv_launches_match_exact_products() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut failures = Vec::new();
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::F16,
    ] {
        for (n_in, n_ff, n_tok) in [
            (256usize, 300usize, 1usize),
            (4096, 520, 1),
            (1536, 1000, 2),
            (4096, 64, 9),
        ] {
            let seed = (ty as u64) << 40 ^ (n_in as u64) << 20 ^ n_ff as u64 ^ (n_tok as u64) << 56;
            let mut rng = Rng::new(seed);
            let x: Vec<f32> = (0..n_tok * n_in).map(|_| 0.1 + rng.sym()).collect();
            let deq = |hw: &HostWeight, rows: usize, cols: usize| {
                let wc = c.upload_weight(hw).expect("cpu upload");
                embed(&c, &wc, &(0..rows as u32).collect::<Vec<_>>(), cols)
            };
            // three products of one format in one launch, with epilogues
            let outs = [n_ff, 7, 129];
            let hws: Vec<HostWeight> = outs
                .iter()
                .enumerate()
                .map(|(i, &n)| random_weight(ty, n, n_in, seed ^ i as u64))
                .collect();
            let ws: Vec<Weight> = hws
                .iter()
                .map(|h| g.upload_weight(h).expect("gpu upload"))
                .collect();
            let bias: Vec<f32> = (0..129).map(|_| rng.sym()).collect();
            let y0: Vec<f32> = (0..n_tok * 129).map(|_| rng.sym()).collect();
            let xt = g.upload_f32(&x).expect("x");
            // one bias per product (exact lengths), the first values of `bias`
            let bt7 = g.upload_f32(&bias[..7]).expect("bias");
            let bt = g.upload_f32(&bias).expect("bias");
            let mut ys: Vec<Tensor> = outs
                .iter()
                .map(|&n| g.alloc(DType::F32, n_tok * n).expect("y"))
                .collect();
            g.write_f32(&mut ys[2], 0, &y0).expect("y0");
            let bias_eps = [None, Some(&bt7), Some(&bt)];
            let eps: Vec<kapitsa_backend::Epilogue<'_>> = (0..3)
                .map(|i| kapitsa_backend::Epilogue {
                    bias: bias_eps[i],
                    accumulate: i == 2,
                })
                .collect();
            {
                let wr: Vec<&Weight> = ws.iter().collect();
                let mut yr: Vec<&mut Tensor> = ys.iter_mut().collect();
                g.matmul_many_with(&wr, &xt, n_tok, &mut yr, &eps)
                    .expect("matmul_many_with");
            }
            for (i, &n_out) in outs.iter().enumerate() {
                let e = exact_matmul(&deq(&hws[i], n_out, n_in), &x, n_tok, n_out, n_in);
                let want: Vec<f64> =
                    e.y.iter()
                        .enumerate()
                        .map(|(k, v)| {
                            let r = k % n_out;
                            let b = if i > 0 { f64::from(bias[r]) } else { 0.0 };
                            let a = if i == 2 { f64::from(y0[k]) } else { 0.0 };
                            a + (v + b)
                        })
                        .collect();
                let err = rel_err(&read(&g, &ys[i]), want.iter().copied(), e.terms);
                let ok = err <= 2e-5;
                println!("matmul_many_with {ty:5} part {i} {n_out:>4} x {n_in:>4} n_tok {n_tok}: {err:.2e}{}", if ok { "" } else { "  FAIL" });
                if !ok {
                    failures.push(format!("many {ty} {i} {n_in} {n_tok}"));
                }
            }
            // the SwiGLU MLP: gate/up fused, down with accumulation
            let n_out = 96;
            let hg = random_weight(ty, n_ff, n_in, seed ^ 11);
            let hu = random_weight(ty, n_ff, n_in, seed ^ 12);
            let hd = random_weight(GgmlType::F32, n_out, n_ff, seed ^ 13);
            let mw = kapitsa_backend::MlpWeights {
                gate: Some(g.upload_weight(&hg).expect("gate")),
                up: g.upload_weight(&hu).expect("up"),
                down: g.upload_weight(&hd).expect("down"),
                act: kapitsa_backend::Act::SwiGlu,
            };
            let yinit: Vec<f32> = (0..n_tok * n_out).map(|_| rng.sym()).collect();
            let mut yt = g.upload_f32(&yinit).expect("y");
            g.mlp_add(&mw, &xt, n_tok, &mut yt).expect("mlp_add");
            let gx = exact_matmul(&deq(&hg, n_ff, n_in), &x, n_tok, n_ff, n_in);
            let ux = exact_matmul(&deq(&hu, n_ff, n_in), &x, n_tok, n_ff, n_in);
            let h: Vec<f64> =
                gx.y.iter()
                    .zip(&ux.y)
                    .map(|(gv, uv)| gv / (1.0 + (-gv).exp()) * uv)
                    .collect();
            let dd = deq(&hd, n_out, n_ff);
            let mut want = vec![0.0f64; n_tok * n_out];
            let mut scale = 0.0f64;
            for t in 0..n_tok {
                for r in 0..n_out {
                    let s: f64 = (0..n_ff)
                        .map(|k| f64::from(dd[r * n_ff + k]) * h[t * n_ff + k])
                        .sum();
                    scale = scale.max(s.abs());
                    want[t * n_out + r] = f64::from(yinit[t * n_out + r]) + s;
                }
            }
            let err = rel_err(&read(&g, &yt), want.iter().copied(), scale);
            // f32 rounding of gate/up (~1e-6 relative) passes through silu * up and down
            let ok = err <= 1e-4;
            println!(
                "mlp_add swiglu {ty:5} {n_ff:>4} x {n_in:>4} n_tok {n_tok}: {err:.2e}{}",
                if ok { "" } else { "  FAIL" }
            );
            if !ok {
                failures.push(format!("mlp {ty} {n_in} {n_ff} {n_tok}"));
            }
        }
    }
    assert!(failures.is_empty(), "out of tolerance: {failures:?}");
}

/// Wrong shapes are errors, not crashes.
#[test]
fn bad_arguments_are_errors() {
    let Some(g) = gpu() else { return };
    // a K-format row of partial blocks
    let bad = host_weight(GgmlType::Q4_K, vec![4, 128], vec![0u8; 4 * 72]);
    assert!(g.upload_weight(&bad).is_err());
    // an unsupported type
    let q2 = host_weight(GgmlType::Q2_K, vec![1, 256], vec![0u8; 84]);
    assert!(g.upload_weight(&q2).is_err());
    // a byte count that does not match the shape
    let short = host_weight(GgmlType::Q8_0, vec![2, 32], vec![0u8; 34]);
    assert!(g.upload_weight(&short).is_err());
    // x too short for n_tok
    let w = g
        .upload_weight(&random_weight(GgmlType::Q8_0, 8, 64, 1))
        .expect("upload");
    let x = g.upload_f32(&[0.0; 64]).expect("x");
    let mut y = g.alloc(DType::F32, 16).expect("y");
    assert!(g.matmul(&w, &x, 2, &mut y).is_err());
    g.synchronize().expect("the device is still healthy");
}

/// GEMV bandwidth at one token on the two shapes that matter most for decode (printed, not
/// asserted): the 151936 x 1536 Q6_K output head and an 8960 x 1536 Q4_K FFN matrix. Weight
/// bytes are random (any bits are valid blocks for timing). CUDA events around each call,
/// median of 20 after 5 warm-up calls.
#[test]
fn gemv_bandwidth() {
    let Some(g) = gpu() else { return };
    let shapes = [
        (GgmlType::Q6_K, 151_936usize, 1536usize, 1usize),
        (GgmlType::Q4_K, 8960, 1536, 1),
        (GgmlType::Q4_K, 1536, 8960, 1),
        (GgmlType::Q8_0, 8960, 1536, 1),
        (GgmlType::Q6_K, 151_936, 1536, 8),
        (GgmlType::Q4_K, 8960, 1536, 8),
    ];
    for (ty, n_out, n_in, n_tok) in shapes {
        let rb = ty.row_bytes(n_in).expect("whole blocks");
        let mut bytes = vec![0u8; n_out * rb];
        let mut rng = Rng::new(7);
        for c in bytes.chunks_mut(8) {
            let v = rng.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
        // keep the scales finite (f16 exponent bits below all-ones) so no NaN work is timed
        fix_scales(ty, &mut bytes);
        let w = host_weight(ty, vec![n_out, n_in], bytes);
        let mut us = g.debug_time_matmul(&w, n_tok, 5, 20).expect("timing");
        us.sort_by(f32::total_cmp);
        let med = f64::from(us[us.len() / 2]);
        let gbs = (n_out * rb) as f64 / (med * 1e-6) / 1e9;
        println!(
            "gemv {ty:5} {n_out:>6} x {n_in:>4} n_tok {n_tok}: median {med:8.2} us, {gbs:7.1} GB/s of weights \
             (min {:.2} us, max {:.2} us)",
            us[0],
            us[us.len() - 1]
        );
    }
}

/// Clear the top exponent bit of every f16 scale of random blocks (Q4_K: d, dmin; Q6_K: d;
/// Q8_0: d) so they are finite.
fn fix_scales(ty: GgmlType, bytes: &mut [u8]) {
    let (ts, offs): (usize, &[usize]) = match ty {
        GgmlType::Q4_K => (144, &[1, 3]),
        GgmlType::Q6_K => (210, &[209]),
        GgmlType::Q8_0 => (34, &[1]),
        _ => return,
    };
    for blk in bytes.chunks_exact_mut(ts) {
        for &o in offs {
            blk[o] &= 0x3F;
        }
    }
}
