//! GPU tests of the CUDA backend: the op suite of `kapitsa_backend::testing` against the CPU
//! backend's scalar reference, the self-consistency invariants (a sequence computed in pieces
//! equals it computed at once; a sequence batched with others equals it alone; bit for bit
//! where the same kernel runs, because every kernel's per-token work depends only on that
//! token's own position), and the error contract.
//!
//! They need a GPU and run only with `KAPITSA_GPU_TESTS=1` (built with `--features cuda`);
//! without it each test prints a note and passes. With it set, a machine where no GPU works
//! fails. `KAPITSA_GPU_CASES` sets the random cases per op (default 8).
#![cfg(feature = "cuda")]

use kapitsa_backend::testing::{check_ops_with, summary, Rng, Tolerances};
use kapitsa_backend::{
    AttnShape, Backend, BackendError, Batch, BatchDesc, DType, GdnShape, HeadOrder, KvLayer,
    Mamba2Shape, SeqDesc, Tensor,
};
use kapitsa_backend_cpu::testing::{quantize_weight, reference};
use kapitsa_backend_cuda::CudaBackend;
use kapitsa_base::pool::RayonPool;
use kapitsa_base::GgmlType;

/// The backend on GPU 0, or `None` (with a note) when the GPU tests are not requested.
fn gpu() -> Option<CudaBackend> {
    if std::env::var("KAPITSA_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set KAPITSA_GPU_TESTS=1 (and build with --features cuda) to run the GPU tests");
        return None;
    }
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => panic!("KAPITSA_GPU_TESTS=1 but no GPU is usable: {e}"),
    }
}

fn quantize(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    quantize_weight(ty, x).expect("a type the suite quantises")
}

#[test]
fn ops_match_the_scalar_reference() {
    let Some(cuda) = gpu() else { return };
    let re = reference(Box::new(RayonPool::new(4).expect("pool"))).expect("reference");
    let cases = std::env::var("KAPITSA_GPU_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    for seed in [1u64, 2] {
        let tol = Tolerances::unrounded_activations();
        let reports = check_ops_with(&cuda, &re, &quantize, seed, cases, &tol)
            .unwrap_or_else(|e| panic!("{}: {e}", cuda.describe()));
        let table = summary(&reports);
        println!(
            "{} (seed {seed}, {cases} cases per op)\n{table}",
            cuda.describe()
        );
        assert!(
            reports.iter().all(|r| r.pass),
            "ops out of tolerance\n{table}"
        );
    }
}

// ---- helpers ------------------------------------------------------------------------------------

fn up(be: &dyn Backend, v: &[f32]) -> Tensor {
    be.upload_f32(v).expect("upload")
}

fn read(be: &dyn Backend, t: &Tensor) -> Vec<f32> {
    let mut v = vec![0f32; t.len()];
    be.read_f32(t, 0, &mut v).expect("read");
    v
}

/// One sequence (slot `slot`) of tokens `pos0..pos0 + len`, block table `table`.
fn seq_batch(
    be: &dyn Backend,
    pos0: usize,
    len: usize,
    slot: usize,
    table: &[u32],
    bs: usize,
) -> Batch {
    batch_of(be, &[(pos0, len, slot)], &[table.to_vec()], bs)
}

/// Several sequences `(pos0, len, slot)` with their tables.
fn batch_of(
    be: &dyn Backend,
    seqs: &[(usize, usize, usize)],
    tables: &[Vec<u32>],
    bs: usize,
) -> Batch {
    let mut d = BatchDesc {
        block_size: bs,
        ..Default::default()
    };
    for (&(pos0, len, slot), table) in seqs.iter().zip(tables) {
        let start = d.tokens.len();
        let table_start = d.block_tables.len();
        d.block_tables.extend(table);
        for j in 0..len {
            d.tokens.push(0);
            d.positions.push((pos0 + j) as u32);
        }
        d.seqs.push(SeqDesc {
            slot,
            start,
            len,
            pos0,
            table_start,
            table_len: table.len(),
        });
    }
    be.prepare_batch(d).expect("prepare_batch")
}

/// Rows `a..b` (of `w` values) of `v`.
fn rows(v: &[f32], w: usize, a: usize, b: usize) -> &[f32] {
    &v[a * w..b * w]
}

// ---- invariants ---------------------------------------------------------------------------------

/// Attention of one sequence computed at once, in pieces (prefill chunks and single-token
/// decode steps) and batched with another sequence: the same bits, for every cache type.
#[test]
fn attention_pieces_and_batches_match_bitwise() {
    let Some(be) = gpu() else { return };
    let mut rng = Rng::new(7);
    let (n_head, n_head_kv, head_dim, bs) = (4, 2, 64, 16);
    let kv_dim = n_head_kv * head_dim;
    let n: usize = 600; // three attention chunks of 256 positions
    let table: Vec<u32> = (0..n.div_ceil(bs) as u32).rev().collect();
    let n_blocks = 2 * table.len() + 1;
    let shape = AttnShape {
        n_head,
        n_head_kv,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
    };
    let q = rng.vals(n * n_head * head_dim, 1.0);
    let k = rng.vals(n * kv_dim, 1.0);
    let v = rng.vals(n * kv_dim, 1.0);
    for dt in [DType::F32, DType::F16, DType::Q8_0] {
        let run = |pieces: &[usize]| -> Vec<f32> {
            let mut kc = be.alloc(dt, n_blocks * bs * kv_dim).expect("alloc");
            let mut vc = be.alloc(dt, n_blocks * bs * kv_dim).expect("alloc");
            let mut out = Vec::new();
            let mut p = 0;
            for &len in pieces {
                let b = seq_batch(&be, p, len, 0, &table, bs);
                let (kt, vt) = (
                    up(&be, rows(&k, kv_dim, p, p + len)),
                    up(&be, rows(&v, kv_dim, p, p + len)),
                );
                let cache = KvLayer {
                    k: &mut kc,
                    v: &mut vc,
                    kv_dim,
                };
                be.kv_write(&kt, &vt, cache, &b).expect("kv_write");
                let qt = up(&be, rows(&q, n_head * head_dim, p, p + len));
                let mut o = be
                    .alloc(DType::F32, len * n_head * head_dim)
                    .expect("alloc");
                be.attention(shape, &qt, &kc, &vc, &b, &mut o)
                    .expect("attention");
                out.extend(read(&be, &o));
                p += len;
            }
            out
        };
        let whole = run(&[n]);
        assert!(whole.iter().all(|x| x.is_finite()));
        // prefill chunks (at least 16 tokens: the tiled kernel) give the same bits
        let pieces = [100, 37, 200, 263];
        assert_eq!(
            run(&pieces),
            whole,
            "{dt:?}: prefill chunks differ from the whole"
        );
        // decode steps and short chunks take the split kernel: equal to rounding
        let mixed = run(&[100, 1, 1, 7, 229, 1, 261]);
        let scale = whole.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = mixed
            .iter()
            .zip(&whole)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= 1e-5 * scale,
            "{dt:?}: decode steps differ from the whole by {worst}"
        );
        // a short sequence (split kernel throughout) at once and token by token: same bits
        let short = 12;
        let at_once = run(&[short]);
        assert_eq!(
            run(&[1; 12]),
            at_once,
            "{dt:?}: decode steps differ from a short chunk"
        );

        // the same sequence next to another one (different slot, table and length)
        let mut kc = be.alloc(dt, 4 * n_blocks * bs * kv_dim).expect("alloc");
        let mut vc = be.alloc(dt, 4 * n_blocks * bs * kv_dim).expect("alloc");
        let other_len: usize = 300;
        let other_table: Vec<u32> = (0..other_len.div_ceil(bs) as u32)
            .map(|i| n_blocks as u32 + 2 * i)
            .collect();
        let b = batch_of(
            &be,
            &[(0, other_len, 1), (0, n, 0)],
            &[other_table, table.clone()],
            bs,
        );
        let ko = rng.vals(other_len * kv_dim, 1.0);
        let vo = rng.vals(other_len * kv_dim, 1.0);
        let qo = rng.vals(other_len * n_head * head_dim, 1.0);
        let kt = up(&be, &[ko, k.clone()].concat());
        let vt = up(&be, &[vo, v.clone()].concat());
        let cache = KvLayer {
            k: &mut kc,
            v: &mut vc,
            kv_dim,
        };
        be.kv_write(&kt, &vt, cache, &b).expect("kv_write");
        let qt = up(&be, &[qo, q.clone()].concat());
        let mut o = be
            .alloc(DType::F32, (other_len + n) * n_head * head_dim)
            .expect("alloc");
        be.attention(shape, &qt, &kc, &vc, &b, &mut o)
            .expect("attention");
        let got = read(&be, &o);
        assert_eq!(
            &got[other_len * n_head * head_dim..],
            &whole[..],
            "{dt:?}: batched differs from alone"
        );
    }
}

/// The recurrent mixers (conv1d, Gated DeltaNet, Mamba2) over one sequence at once and in
/// pieces: the same outputs and final states, bit for bit.
#[test]
fn recurrent_pieces_match_bitwise() {
    let Some(be) = gpu() else { return };
    let mut rng = Rng::new(9);
    let n = 70;
    let pieces = [1usize, 30, 1, 1, 37];
    let slots = 3;
    let slot = 2;

    // conv1d
    let (c, k) = (96, 4);
    let x = rng.vals(n * c, 1.0);
    let w = up(&be, &rng.vals(c * k, 0.7));
    let bias = up(&be, &rng.vals(c, 0.5));
    let st0 = rng.vals(slots * (k - 1) * c, 1.0);
    // gdn
    let gs = GdnShape {
        n_k_heads: 2,
        n_v_heads: 4,
        dk: 128,
        dv: 96,
        order: HeadOrder::Tiled,
    };
    let q = rng.vals(n * gs.n_k_heads * gs.dk, 0.05);
    let kk = rng.vals(n * gs.n_k_heads * gs.dk, 0.05);
    let v = rng.vals(n * gs.n_v_heads * gs.dv, 1.0);
    let g: Vec<f32> = (0..n * gs.n_v_heads)
        .map(|_| -(0.01 + rng.unit()))
        .collect();
    let beta: Vec<f32> = (0..n * gs.n_v_heads)
        .map(|_| 0.05 + 0.9 * rng.unit())
        .collect();
    let gst0 = rng.vals(slots * gs.state_len(), 0.3);
    // mamba2
    let ms = Mamba2Shape {
        n_heads: 4,
        head_dim: 24,
        d_state: 128,
        n_groups: 2,
    };
    let mx = rng.vals(n * ms.d_inner(), 1.0);
    let mdt: Vec<f32> = (0..n * ms.n_heads).map(|_| 0.01 + rng.unit()).collect();
    let ma = up(
        &be,
        &(0..ms.n_heads)
            .map(|_| -(0.1 + rng.unit()))
            .collect::<Vec<_>>(),
    );
    let mb = rng.vals(n * ms.n_groups * ms.d_state, 1.0);
    let mc = rng.vals(n * ms.n_groups * ms.d_state, 1.0);
    let md = up(&be, &rng.vals(ms.n_heads, 1.0));
    let mst0 = rng.vals(slots * ms.state_len(), 0.3);

    let run = |pieces: &[usize]| -> [Vec<f32>; 6] {
        let mut cst = up(&be, &st0);
        let mut gst = up(&be, &gst0);
        let mut mst = up(&be, &mst0);
        let (mut co, mut go, mut mo) = (Vec::new(), Vec::new(), Vec::new());
        let mut p = 0;
        for &len in pieces {
            let b = seq_batch(&be, p, len, slot, &[], 0);
            let xt = up(&be, rows(&x, c, p, p + len));
            let mut o = be.alloc(DType::F32, len * c).expect("alloc");
            be.conv1d_causal(&xt, c, k, &w, Some(&bias), true, &mut cst, &b, &mut o)
                .expect("conv1d");
            co.extend(read(&be, &o));

            let qk = gs.n_k_heads * gs.dk;
            let (qt, kt) = (
                up(&be, rows(&q, qk, p, p + len)),
                up(&be, rows(&kk, qk, p, p + len)),
            );
            let vt = up(&be, rows(&v, gs.n_v_heads * gs.dv, p, p + len));
            let (gt, bt) = (
                up(&be, rows(&g, gs.n_v_heads, p, p + len)),
                up(&be, rows(&beta, gs.n_v_heads, p, p + len)),
            );
            let mut o = be
                .alloc(DType::F32, len * gs.n_v_heads * gs.dv)
                .expect("alloc");
            be.gdn(gs, &qt, &kt, &vt, &gt, &bt, &mut gst, &b, &mut o)
                .expect("gdn");
            go.extend(read(&be, &o));

            let gn = ms.n_groups * ms.d_state;
            let xt = up(&be, rows(&mx, ms.d_inner(), p, p + len));
            let dtt = up(&be, rows(&mdt, ms.n_heads, p, p + len));
            let (bt, ct) = (
                up(&be, rows(&mb, gn, p, p + len)),
                up(&be, rows(&mc, gn, p, p + len)),
            );
            let mut o = be.alloc(DType::F32, len * ms.d_inner()).expect("alloc");
            be.mamba2(ms, &xt, &dtt, &ma, &bt, &ct, &md, &mut mst, &b, &mut o)
                .expect("mamba2");
            mo.extend(read(&be, &o));
            p += len;
        }
        [
            co,
            read(&be, &cst),
            go,
            read(&be, &gst),
            mo,
            read(&be, &mst),
        ]
    };
    let whole = run(&[n]);
    let split = run(&pieces);
    let names = [
        "conv out",
        "conv state",
        "gdn out",
        "gdn state",
        "mamba2 out",
        "mamba2 state",
    ];
    for ((a, b), name) in split.iter().zip(&whole).zip(names) {
        assert!(b.iter().all(|x| x.is_finite()), "{name}");
        assert_eq!(a, b, "{name}: pieces differ from the whole");
    }
    // the untouched slots keep their states
    let per = (k - 1) * c;
    assert_eq!(&whole[1][..slot * per], &st0[..slot * per]);
}

// ---- errors -------------------------------------------------------------------------------------

#[test]
fn bad_arguments_are_errors_not_panics() {
    let Some(be) = gpu() else { return };
    let cpu = reference(Box::new(RayonPool::new(1).expect("pool"))).expect("reference");
    let mut y = up(&be, &[1.0, 2.0, 3.0]);
    let short = up(&be, &[1.0]);
    assert!(matches!(
        be.add(&mut y, &short),
        Err(BackendError::Shape { .. })
    ));
    let foreign = up(&cpu, &[1.0, 2.0, 3.0]);
    assert!(matches!(
        be.add(&mut y, &foreign),
        Err(BackendError::ForeignHandle { .. })
    ));
    let mut q8 = be.alloc(DType::Q8_0, 64).expect("alloc");
    assert!(matches!(
        be.copy_within(&mut q8, 0, 16, 32),
        Err(BackendError::Shape { .. })
    ));
    assert!(be
        .read_bytes(&q8, 0, 64)
        .expect("read")
        .iter()
        .all(|&b| b == 0));
    // a block table that does not cover the positions
    let bad = BatchDesc {
        tokens: vec![0; 3],
        positions: vec![30, 31, 32],
        seqs: vec![SeqDesc {
            slot: 0,
            start: 0,
            len: 3,
            pos0: 30,
            table_start: 0,
            table_len: 2,
        }],
        block_tables: vec![0, 1],
        block_size: 16,
        logit_rows: vec![2],
    };
    assert!(matches!(
        be.prepare_batch(bad),
        Err(BackendError::Shape { .. })
    ));
    // a block id past the cache
    let b = seq_batch(&be, 0, 2, 0, &[5], 16);
    let (kt, vt) = (up(&be, &[0.5; 64]), up(&be, &[0.5; 64]));
    let mut kc = be.alloc(DType::F16, 2 * 16 * 32).expect("alloc");
    let mut vc = be.alloc(DType::F16, 2 * 16 * 32).expect("alloc");
    let cache = KvLayer {
        k: &mut kc,
        v: &mut vc,
        kv_dim: 32,
    };
    assert!(matches!(
        be.kv_write(&kt, &vt, cache, &b),
        Err(BackendError::Shape { .. })
    ));
    be.synchronize()
        .expect("no device error after refused calls");
}
