//! The op suite of `kapitsa_backend::testing` on the CPU backend: the fast kernels (every
//! available SIMD level, and the llama.cpp-compatible mode) against the scalar reference;
//! plus the error contract (bad lengths are shape errors, another backend's handles are
//! refused).

use kapitsa_backend::testing::{check_ops, summary, OpReport};
use kapitsa_backend::{
    AttnShape, Backend, BackendError, BatchDesc, DType, GdnShape, HeadOrder, HostBytes, HostWeight,
    KvLayer, RopeDesc, SeqDesc, Tensor, Weight,
};
use kapitsa_backend_cpu::testing::{quantize_weight, reference};
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_base::pool::RayonPool;
use kapitsa_base::{GgmlType, ThreadPool};
use kapitsa_kernels_cpu::SimdLevel;

fn pool() -> Box<dyn ThreadPool + Send> {
    Box::new(RayonPool::new(2).expect("pool"))
}

fn quantize(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    quantize_weight(ty, x).expect("a type the suite quantises")
}

/// Run the suite of `be` against the scalar reference; panic with the table on a failure.
fn suite(be: &CpuBackend, seed: u64, cases: usize) -> Vec<OpReport> {
    let re = reference(pool()).unwrap();
    let reports = check_ops(be, &re, &quantize, seed, cases)
        .unwrap_or_else(|e| panic!("{}: {e}", be.describe()));
    let table = summary(&reports);
    println!("{}\n{table}", be.describe());
    assert!(
        reports.iter().all(|r| r.pass),
        "{}: ops out of tolerance\n{table}",
        be.describe()
    );
    reports
}

#[test]
fn fast_kernels_match_the_scalar_reference() {
    let reports = suite(&CpuBackend::new(pool()), 1, 20);
    // Every trait op is covered.
    for op in [
        "write_f32/read_f32",
        "write_bytes/read_bytes",
        "copy",
        "copy_within",
        "rms_norm",
        "add",
        "add_bias",
        "mul_sigmoid",
        "split_cols",
        "gather_logit_rows",
        "l2_norm",
        "gated_rms_norm",
        "gated_group_rms_norm",
        "gdn_gates",
        "softplus_bias",
        "rope",
        "matmul q4_K",
        "matmul_many",
        "embed q6_K",
        "mlp swiglu",
        "mlp relu2",
        "moe softmax",
        "moe sigmoid",
        "moe softmax add",
        "kv_write Q8_0",
        "attention F16",
        "conv1d_causal",
        "gdn_preamble",
        "gdn",
        "mamba2_preamble",
        "mamba2",
        "argmax_rows",
    ] {
        assert!(
            reports.iter().any(|r| r.name == op && r.cases > 0),
            "{op} not covered"
        );
    }
}

#[test]
fn every_simd_level_matches_the_scalar_reference() {
    for level in SimdLevel::available() {
        if level == SimdLevel::Scalar {
            continue;
        }
        let be = CpuBackend::with_level(pool(), level).unwrap();
        suite(&be, 100 + level as u64, 6);
    }
}

#[test]
fn llama_cpp_mode_matches_the_scalar_reference() {
    match CpuBackend::llama_cpp_compatible(pool()) {
        Ok(be) => {
            suite(&be, 7, 4);
        }
        Err(e) => println!("skipped: {e}"),
    }
}

/// The scalar reference against itself is exact (the suite's own sanity); its products
/// against the host's exact f64 product stay within the activation rounding.
#[test]
fn the_reference_is_deterministic() {
    let re = reference(pool()).unwrap();
    let reports = suite(&re, 3, 2);
    let (exact, between): (Vec<_>, Vec<_>) =
        reports.iter().partition(|r| r.name.ends_with("vs exact"));
    assert!(
        between.iter().all(|r| r.worst == 0.0),
        "{}",
        summary(&reports)
    );
    assert!(!exact.is_empty() && exact.iter().all(|r| r.pass));
}

// ---- errors ---------------------------------------------------------------------------------

fn is_shape<T>(r: kapitsa_backend::Result<T>) -> bool {
    matches!(r, Err(BackendError::Shape { .. }))
}

fn is_foreign<T>(r: kapitsa_backend::Result<T>) -> bool {
    matches!(r, Err(BackendError::ForeignHandle { .. }))
}

fn weight(be: &CpuBackend, ty: GgmlType, shape: Vec<usize>) -> Weight {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.1).sin()).collect();
    be.upload_weight(&HostWeight {
        name: "w".into(),
        dtype: ty,
        shape,
        bytes: HostBytes::from_vec(quantize(ty, &v)),
    })
    .unwrap()
}

/// A pass of 2..=16 tokens (speculative verification, batched decode) or more (prefill
/// chunks) gives every token exactly what a one-token pass gives it, at every level, through
/// `matmul` and `matmul_many`: the formats of the real models (Q4_K, Q6_K; Q8_0 and Q5_0 for
/// 896-wide matrices), row counts around the kernels' 8- and 16-row groups.
#[test]
fn passes_of_any_size_equal_one_token_passes_bitwise() {
    for level in SimdLevel::available() {
        let be = CpuBackend::with_level(pool(), level).unwrap();
        for (ty, n_in, n_out) in [
            (GgmlType::Q4_K, 512, 37),
            (GgmlType::Q6_K, 768, 21),
            (GgmlType::Q8_0, 896, 19),
            (GgmlType::Q5_0, 896, 40),
        ] {
            let w = weight(&be, ty, vec![n_out, n_in]);
            let w2 = weight(&be, ty, vec![9, n_in]);
            let n_max = 40;
            let xv: Vec<f32> = (0..n_max * n_in)
                .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 2.0)
                .collect();
            let one = |w: &Weight, rows: usize, t: usize| {
                let x = be.upload_f32(&xv[t * n_in..(t + 1) * n_in]).unwrap();
                let mut y = be.alloc(DType::F32, rows).unwrap();
                be.matmul(w, &x, 1, &mut y).unwrap();
                kapitsa_backend_cpu::host_f32(&y).unwrap().to_vec()
            };
            let ones: Vec<Vec<f32>> = (0..n_max).map(|t| one(&w, n_out, t)).collect();
            let ones2: Vec<Vec<f32>> = (0..n_max).map(|t| one(&w2, 9, t)).collect();
            for n in (2..=17).chain([24, n_max]) {
                let x = be.upload_f32(&xv[..n * n_in]).unwrap();
                let mut y = be.alloc(DType::F32, n * n_out).unwrap();
                be.matmul(&w, &x, n, &mut y).unwrap();
                let mut a = be.alloc(DType::F32, n * n_out).unwrap();
                let mut b = be.alloc(DType::F32, n * 9).unwrap();
                be.matmul_many(&[&w, &w2], &x, n, &mut [&mut a, &mut b])
                    .unwrap();
                let (y, a, b) = (
                    kapitsa_backend_cpu::host_f32(&y).unwrap(),
                    kapitsa_backend_cpu::host_f32(&a).unwrap(),
                    kapitsa_backend_cpu::host_f32(&b).unwrap(),
                );
                for t in 0..n {
                    for (what, got, want) in [
                        ("matmul", &y[t * n_out..(t + 1) * n_out], &ones[t]),
                        ("matmul_many[0]", &a[t * n_out..(t + 1) * n_out], &ones[t]),
                        ("matmul_many[1]", &b[t * 9..(t + 1) * 9], &ones2[t]),
                    ] {
                        assert!(
                            got.iter()
                                .zip(want)
                                .all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{level:?} {ty} {what}, {n} tokens, token {t}"
                        );
                    }
                }
            }
        }
    }
}

fn one_seq(n: usize, block_size: usize, table: Vec<u32>) -> BatchDesc {
    BatchDesc {
        tokens: vec![1; n],
        positions: (0..n as u32).collect(),
        seqs: vec![SeqDesc {
            slot: 1,
            start: 0,
            len: n,
            pos0: 0,
            table_start: 0,
            table_len: table.len(),
        }],
        block_tables: table,
        block_size,
        logit_rows: vec![n as u32 - 1],
    }
}

#[test]
fn wrong_lengths_are_shape_errors() {
    let be = CpuBackend::new(pool());
    let f = |n: usize| be.upload_f32(&vec![0.5; n]).unwrap();
    let w = weight(&be, GgmlType::Q8_0, vec![8, 64]);
    // matmul: x of 2 tokens is 128 values, y 16.
    assert!(is_shape(be.matmul(&w, &f(127), 2, &mut f(16))));
    assert!(is_shape(be.matmul(&w, &f(128), 2, &mut f(17))));
    be.matmul(&w, &f(128), 2, &mut f(16)).unwrap();
    let w3 = weight(&be, GgmlType::Q8_0, vec![2, 8, 64]);
    assert!(is_shape(be.matmul(&w3, &f(128), 2, &mut f(16))));
    assert!(is_shape(be.matmul_many(
        &[&w, &w],
        &f(64),
        1,
        &mut [&mut f(8)]
    )));
    // Row ops.
    assert!(is_shape(be.rms_norm(&mut f(10), 4, &f(4), 1e-6)));
    assert!(is_shape(be.rms_norm(&mut f(8), 4, &f(3), 1e-6)));
    assert!(is_shape(be.add(&mut f(8), &f(7))));
    assert!(is_shape(be.add_bias(&mut f(8), &f(3))));
    assert!(is_shape(be.mul_sigmoid(&mut f(8), &f(9))));
    assert!(is_shape(be.l2_norm(&mut f(8), 0, 1e-6, 1.0)));
    assert!(is_shape(be.gated_rms_norm(
        &mut f(8),
        &f(8),
        3,
        &f(3),
        1e-6
    )));
    assert!(is_shape(be.gated_group_rms_norm(
        &mut f(12),
        &f(12),
        6,
        4,
        &f(6),
        1e-6
    )));
    assert!(is_shape(be.softplus_bias(&mut f(7), &f(2))));
    assert!(is_shape(be.argmax_rows(&f(7), 2)));
    assert!(is_shape(be.split_cols(
        &f(10),
        2,
        &[2, 2],
        &mut [&mut f(4), &mut f(4)]
    )));
    // A wrong dtype is a shape error too.
    let mut h = be.alloc(DType::F16, 8).unwrap();
    assert!(is_shape(be.add(&mut h, &f(8))));
    assert!(is_shape(be.write_f32(&mut h, 0, &[1.0])));
    // Memory ops out of range.
    assert!(is_shape(be.write_f32(&mut f(4), 3, &[1.0, 2.0])));
    assert!(is_shape(be.read_f32(&f(4), 2, &mut [0.0; 3])));
    assert!(is_shape(be.read_bytes(&f(4), 0, 5)));
    let mut q = be.alloc(DType::Q8_0, 64).unwrap();
    assert!(is_shape(be.read_bytes(&q, 1, 32)));
    assert!(is_shape(be.copy_within(&mut q, 0, 32, 64)));
    assert!(is_shape(be.copy(&f(4), 0, &mut q, 0, 4)));
    assert!(is_shape(be.alloc(DType::Q8_0, 40)));

    // Batches that break the invariants.
    let mut bad = one_seq(3, 16, vec![0]);
    bad.positions[2] = 7;
    assert!(is_shape(be.prepare_batch(bad)));
    assert!(is_shape(be.prepare_batch(one_seq(20, 16, vec![0]))));
    let mut bad = one_seq(3, 16, vec![0]);
    bad.logit_rows = vec![3];
    assert!(is_shape(be.prepare_batch(bad)));

    // Attention ops: a block id past the cache, a cache of partial blocks, a bad slot.
    let batch = be.prepare_batch(one_seq(3, 16, vec![5])).unwrap();
    let (kv_dim, n_blocks) = (32, 2);
    let mut kc = be.alloc(DType::Q8_0, n_blocks * 16 * kv_dim).unwrap();
    let mut vc = be.alloc(DType::Q8_0, n_blocks * 16 * kv_dim).unwrap();
    let cache = KvLayer {
        k: &mut kc,
        v: &mut vc,
        kv_dim,
    };
    assert!(is_shape(be.kv_write(&f(3 * 32), &f(3 * 32), cache, &batch)));
    let shape = AttnShape {
        n_head: 2,
        n_head_kv: 1,
        head_dim: 32,
        scale: 0.2,
    };
    assert!(is_shape(be.attention(
        shape,
        &f(3 * 64),
        &kc,
        &vc,
        &batch,
        &mut f(3 * 64)
    )));
    let ok_batch = be.prepare_batch(one_seq(3, 16, vec![1])).unwrap();
    let cache = KvLayer {
        k: &mut kc,
        v: &mut vc,
        kv_dim,
    };
    be.kv_write(&f(3 * 32), &f(3 * 32), cache, &ok_batch)
        .unwrap();
    be.attention(shape, &f(3 * 64), &kc, &vc, &ok_batch, &mut f(3 * 64))
        .unwrap();
    // Q8_0 heads must be whole blocks.
    let odd = AttnShape {
        n_head: 2,
        n_head_kv: 2,
        head_dim: 16,
        scale: 0.2,
    };
    assert!(is_shape(be.attention(
        odd,
        &f(3 * 32),
        &kc,
        &vc,
        &ok_batch,
        &mut f(3 * 32)
    )));
    let rope = RopeDesc {
        n_rot: 5,
        theta: 1e4,
    };
    assert!(is_shape(be.rope(&mut f(3 * 8), 1, 8, rope, &ok_batch)));
    // Recurrent ops: slot 1 of a state with one slot.
    let gs = GdnShape {
        n_k_heads: 1,
        n_v_heads: 1,
        dk: 4,
        dv: 4,
        order: HeadOrder::Grouped,
    };
    let mut st = f(16);
    assert!(is_shape(be.gdn(
        gs,
        &f(12),
        &f(12),
        &f(12),
        &f(3),
        &f(3),
        &mut st,
        &ok_batch,
        &mut f(12)
    )));
    let mut st2 = f(32);
    be.gdn(
        gs,
        &f(12),
        &f(12),
        &f(12),
        &f(3),
        &f(3),
        &mut st2,
        &ok_batch,
        &mut f(12),
    )
    .unwrap();
    assert!(is_shape(be.conv1d_causal(
        &f(3 * 5),
        5,
        3,
        &f(15),
        None,
        true,
        &mut f(10),
        &ok_batch,
        &mut f(15)
    )));
    // Embedding: a token id past the vocabulary.
    let emb = weight(&be, GgmlType::F16, vec![1, 8]);
    assert!(is_shape(be.embed(&emb, &ok_batch, &mut f(3 * 8))));
    // Weights: bytes that do not hold the shape, a shape of partial blocks.
    let bad_w = HostWeight {
        name: "bad".into(),
        dtype: GgmlType::Q8_0,
        shape: vec![2, 32],
        bytes: HostBytes::from_vec(vec![0; 67]),
    };
    assert!(is_shape(be.upload_weight(&bad_w)));
    let bad_w = HostWeight {
        shape: vec![2, 31],
        ..bad_w
    };
    assert!(is_shape(be.upload_weight(&bad_w)));
}

/// A handle of another backend: a tensor, weight or batch whose buffer is not the CPU's.
#[test]
fn foreign_handles_are_refused() {
    let be = CpuBackend::new(pool());
    let foreign = || Tensor::from_parts(DType::F32, 8, Box::new(0u8));
    let mine = be.upload_f32(&[1.0; 8]).unwrap();
    assert!(is_foreign(be.add(&mut foreign(), &mine)));
    assert!(is_foreign(
        be.add(&mut be.upload_f32(&[1.0; 8]).unwrap(), &foreign())
    ));
    assert!(is_foreign(be.read_f32(&foreign(), 0, &mut [0.0; 8])));
    assert!(is_foreign(be.read_bytes(&foreign(), 0, 8)));
    let w = Weight::from_parts("w".into(), GgmlType::F32, vec![8, 8], Box::new(0u8));
    assert!(is_foreign(be.matmul(
        &w,
        &mine,
        1,
        &mut be.upload_f32(&[0.0; 8]).unwrap()
    )));
    let b = kapitsa_backend::Batch::from_parts(one_seq(1, 0, vec![]), Box::new(0u8));
    assert!(is_foreign(be.argmax_rows(&foreign(), 8)));
    assert!(is_foreign(be.gather_logit_rows(
        &mine,
        8,
        &b,
        &mut be.upload_f32(&[0.0; 8]).unwrap()
    )));
}

/// Unsupported weight types are refused at upload: a matrix needs a dot kernel, an
/// embedding dequantisation.
#[test]
fn unsupported_types() {
    let be = CpuBackend::new(pool());
    let w = HostWeight {
        name: "ints".into(),
        dtype: GgmlType::I32,
        shape: vec![2, 4],
        bytes: HostBytes::from_vec(vec![0; 32]),
    };
    assert!(matches!(
        be.upload_weight(&w),
        Err(BackendError::Unsupported { .. })
    ));
    assert!(matches!(
        be.upload_embedding(&w),
        Err(BackendError::Unsupported { .. })
    ));
    // Q8_K rows can be gathered but not multiplied: an embedding, not a matrix.
    let q8k = HostWeight {
        name: "q8k".into(),
        dtype: GgmlType::Q8_K,
        shape: vec![2, 256],
        bytes: HostBytes::from_vec(vec![0; 2 * 292]),
    };
    assert!(matches!(
        be.upload_weight(&q8k),
        Err(BackendError::Unsupported { .. })
    ));
    let w = be.upload_embedding(&q8k).unwrap();
    let batch = be.prepare_batch(one_seq(1, 0, vec![])).unwrap();
    let mut out = be.alloc(DType::F32, 256).unwrap();
    be.embed(&w, &batch, &mut out).unwrap();
}
