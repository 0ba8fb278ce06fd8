//! Prefill GEMM microbenchmark: GFLOP/s of `matmul` on the Qwen2.5-Coder-1.5B shapes.
//!
//! `cargo run --release -p kapitsa-kernels-cpu --example gemm_bench -- [THREADS] [N_TOK] [REPS]`
//! (defaults 2, 512, 5). Random weights (valid blocks with small f16 scales); best of `REPS`
//! timed runs after one warm-up, since the machine is shared and the minimum is the least
//! disturbed run. Not a test: nothing is asserted.
//!
//! Environment: `GEMM_TYPES=q4_K,q6_K` (weight types), `GEMM_SHAPES=512x2048,...` (`n_out x
//! n_in`; default the Qwen2.5-Coder-1.5B shapes), `GEMM_AB=1` (alternate the GEMM with the
//! per-row dot path, `matmul_dot_with`, and print both), `GEMM_QUANT=1` (time activation
//! quantisation alone), `GEMM_READ=1` (also time plain reads of the weight bytes on the
//! calling thread, to compare a decode GEMV with the bandwidth that memory gives a core),
//! `GEMM_SPLIT=512` (also time the matrix as consecutive matmuls of that many rows, as a
//! decode step's MoE experts; `n_out` must be a multiple of it).

use kapitsa_base::pool::{SerialPool, SpinPool};
use kapitsa_base::{GgmlType, ThreadPool};
use kapitsa_kernels_cpu::{matmul_dot_with, matmul_with, QMatrix, SimdLevel};

/// Wall-clock seconds `f` takes.
fn seconds(f: impl FnOnce()) -> f64 {
    let t = std::time::Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// xorshift64*.
struct Rng(u64);
impl Rng {
    fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn normal(&mut self) -> f32 {
        (0..4)
            .map(|_| (self.u64() >> 40) as f32 / (1u64 << 24) as f32)
            .sum::<f32>()
            * 1.732
            - 3.464
    }
}

/// Wrapping sum of `b` as 64-byte vectors (four accumulators): reads every byte with one
/// load per line. Falls back to a scalar word sum without AVX-512.
fn read_all(b: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn sum512(b: &[u8]) -> u64 {
            use std::arch::x86_64::*;
            let mut a = [_mm512_setzero_si512(); 4];
            for c in b.chunks_exact(256) {
                for (k, ak) in a.iter_mut().enumerate() {
                    // SAFETY: 64 readable bytes of `c` at 64k; an unaligned load.
                    let v = unsafe { _mm512_loadu_si512(c[64 * k..].as_ptr().cast()) };
                    *ak = _mm512_add_epi64(*ak, v);
                }
            }
            let s = _mm512_add_epi64(_mm512_add_epi64(a[0], a[1]), _mm512_add_epi64(a[2], a[3]));
            _mm512_reduce_add_epi64(s) as u64
        }
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F detected above.
            return unsafe { sum512(b) };
        }
    }
    // `chunks_exact(8)` yields 8-byte slices only, so the conversion cannot fail.
    b.chunks_exact(8).fold(0u64, |a, c| {
        a.wrapping_add(u64::from_le_bytes(c.try_into().expect("8 bytes")))
    })
}

/// Wrapping sum of the first byte of every 64-byte line of `b`: reads every line with few
/// instructions (the hardware still moves whole lines).
fn read_lines(b: &[u8]) -> u64 {
    b.chunks_exact(64)
        .fold(0u64, |a, c| a.wrapping_add(u64::from(c[0])))
}

/// Random blocks of `ty` with sane f16 scale fields.
fn random_weights(ty: GgmlType, n_out: usize, n_in: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = ty.row_bytes(n_in).expect("block multiple");
    let mut out: Vec<u8> = (0..rb * n_out).map(|_| rng.u64() as u8).collect();
    let f16_fields: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => {
            &[0]
        }
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    if ty.block_size() > 1 {
        for b in out.chunks_exact_mut(ty.type_size()) {
            for &o in f16_fields {
                let h = half::f16::from_f32(rng.normal() * 0.002).to_bits();
                b[o..o + 2].copy_from_slice(&h.to_le_bytes());
            }
            if ty == GgmlType::MXFP4 {
                b[0] = 118 + (rng.u64() % 6) as u8;
            }
        }
    } else {
        match ty {
            GgmlType::F32 => {
                for c in out.chunks_exact_mut(4) {
                    c.copy_from_slice(&(rng.normal() * 0.05).to_le_bytes());
                }
            }
            _ => {
                for c in out.chunks_exact_mut(2) {
                    let h = half::f16::from_f32(rng.normal() * 0.05).to_bits();
                    c.copy_from_slice(&h.to_le_bytes());
                }
            }
        }
    }
    out
}

/// CPU time of every thread of this process so far, in ns (`/proc/self/task/*/schedstat`), or
/// 0 where unavailable. With other jobs on the machine, flops per CPU-second measure the kernel
/// better than flops per wall-second (the time slices lost to others are not counted).
fn cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numeric argument"))
        .collect();
    let threads = args.first().copied().unwrap_or(2);
    let n_tok = args.get(1).copied().unwrap_or(512);
    let reps = args.get(2).copied().unwrap_or(5);
    let types: Vec<GgmlType> = match std::env::var("GEMM_TYPES") {
        Ok(s) => s
            .split(',')
            .map(|n| {
                *GgmlType::ALL
                    .iter()
                    .find(|t| t.name().eq_ignore_ascii_case(n))
                    .expect("type name")
            })
            .collect(),
        Err(_) => vec![GgmlType::Q4_K, GgmlType::Q6_K],
    };
    let pool: Box<dyn ThreadPool> = if threads == 1 {
        Box::new(SerialPool)
    } else {
        // The engine's pool (`kapitsa` runs on it), so per-call dispatch costs match.
        Box::new(SpinPool::new(threads).expect("pool"))
    };
    let level = SimdLevel::detect();
    if std::env::var("GEMM_QUANT").is_ok() {
        // Activation quantisation alone (what every prefill matmul does first).
        let mut rng = Rng(3);
        for (ty, n_in) in [
            (GgmlType::Q8_K, 1536usize),
            (GgmlType::Q8_0, 1536),
            (GgmlType::Q8_K, 8960),
        ] {
            let x: Vec<f32> = (0..n_tok * n_in).map(|_| rng.normal()).collect();
            let rb = ty.row_bytes(n_in).expect("row");
            let mut q = vec![0u8; rb];
            let mut best = f64::INFINITY;
            for _ in 0..reps {
                let t = std::time::Instant::now();
                for r in x.chunks_exact(n_in) {
                    kapitsa_kernels_cpu::quantize_row(ty, r, &mut q).expect("quantize");
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "quantize {} x {n_tok} rows of {n_in}: {:.3} ms",
                ty.name(),
                best * 1e3
            );
        }
        return;
    }
    // GEMM_SHAPES="512x2048,2048x512": other (n_out x n_in) shapes, e.g. MoE experts.
    let shapes: Vec<(usize, usize)> = match std::env::var("GEMM_SHAPES") {
        Ok(v) => v
            .split(',')
            .map(|s| {
                let (a, b) = s.split_once('x').expect("NxK");
                (a.parse().expect("n_out"), b.parse().expect("n_in"))
            })
            .collect(),
        Err(_) => vec![(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)],
    };
    let mut rng = Rng(1);
    let mut total_flop = 0.0;
    let mut total_t = 0.0;
    for ty in types {
        for &(n_out, n_in) in shapes.iter() {
            let data = random_weights(ty, n_out, n_in, &mut rng);
            let w = QMatrix::new(ty, n_out, n_in, &data).expect("matrix");
            let x: Vec<f32> = (0..n_tok * n_in).map(|_| rng.normal()).collect();
            let mut y = vec![0f32; n_tok * n_out];
            matmul_with(level, &*pool, &w, &x, n_tok, &mut y).expect("matmul");
            if std::env::var("GEMM_AB").is_ok() {
                // A/B: alternate the GEMM (A) with the per-row dot path (B); best of `reps`.
                let mut best = [f64::INFINITY; 2];
                for _ in 0..reps {
                    for (k, b) in best.iter_mut().enumerate() {
                        let t = std::time::Instant::now();
                        if k == 0 {
                            matmul_with(level, &*pool, &w, &x, n_tok, &mut y).expect("matmul");
                        } else {
                            matmul_dot_with(level, &*pool, &w, &x, n_tok, &mut y).expect("matmul");
                        }
                        *b = b.min(t.elapsed().as_secs_f64());
                    }
                }
                let flop = 2.0 * (n_out * n_in * n_tok) as f64;
                println!(
                    "{:>5} {n_out:>5}x{n_in:<5} n_tok={n_tok} threads={threads}: gemm {:7.1} GFLOP/s, dot path {:7.1} GFLOP/s, ratio {:.2}",
                    ty.name(),
                    flop / best[0] / 1e9,
                    flop / best[1] / 1e9,
                    best[1] / best[0]
                );
                continue;
            }
            let mut best = f64::INFINITY;
            let mut best_cpu = f64::INFINITY;
            for _ in 0..reps {
                let c0 = cpu_ns();
                let t = std::time::Instant::now();
                matmul_with(level, &*pool, &w, &x, n_tok, &mut y).expect("matmul");
                best = best.min(t.elapsed().as_secs_f64());
                best_cpu = best_cpu.min((cpu_ns() - c0) as f64 * 1e-9);
            }
            let flop = 2.0 * (n_out * n_in * n_tok) as f64;
            let split = std::env::var("GEMM_SPLIT")
                .ok()
                .map(|v| match v.parse::<usize>() {
                    Ok(s) if s > 0 && n_out % s == 0 => Some(s),
                    _ => {
                        eprintln!("GEMM_SPLIT={v} skipped for {n_out} rows: not a divisor");
                        None
                    }
                });
            if let Some(split) = split.flatten() {
                // The same rows as `n_out / split` consecutive matmuls of `split` rows each
                // (as a decode step's MoE experts), alternating with the whole matrix.
                let rb = ty.row_bytes(n_in).expect("row bytes");
                let parts: Vec<QMatrix<'_>> = data
                    .chunks_exact(split * rb)
                    .map(|c| QMatrix::new(ty, split, n_in, c).expect("matrix"))
                    .collect();
                let mut best_split = f64::INFINITY;
                let mut best_whole = f64::INFINITY;
                for _ in 0..reps {
                    best_split = best_split.min(seconds(|| {
                        for (p, yc) in parts.iter().zip(y.chunks_exact_mut(split * n_tok)) {
                            matmul_with(level, &*pool, p, &x, n_tok, yc).expect("matmul");
                        }
                    }));
                    best_whole = best_whole.min(seconds(|| {
                        matmul_with(level, &*pool, &w, &x, n_tok, &mut y).expect("matmul");
                    }));
                }
                let gb = data.len() as f64 / 1e9;
                println!(
                    "      in {} matmuls of {split} rows: {:.1} GB/s; whole {:.1} GB/s",
                    parts.len(),
                    gb / best_split,
                    gb / best_whole
                );
            }
            total_flop += flop;
            total_t += best;
            if std::env::var("GEMM_READ").is_ok() {
                // The same bytes read by plain loops on this thread: every byte with 64-byte
                // vector loads (what a GEMV must do), and one byte per line (the hardware
                // still moves whole lines; `kapitsa bench --membw` reports the faster).
                // The third figure reads every byte on all the pool's threads, split like a
                // GEMV's chunks, alternating with the matmul (what a decode step could reach).
                let mut best_read = [f64::INFINITY; 3];
                let mut best_mm = f64::INFINITY;
                let pieces = 8 * pool.n_threads();
                let piece = data.len().div_ceil(pieces).next_multiple_of(256);
                for _ in 0..reps {
                    for (k, b) in best_read.iter_mut().enumerate() {
                        let t = std::time::Instant::now();
                        match k {
                            0 => {
                                std::hint::black_box(read_all(&data));
                            }
                            1 => {
                                std::hint::black_box(read_lines(&data));
                            }
                            _ => pool.run(pieces, &|i| {
                                let lo = (i * piece).min(data.len());
                                let hi = ((i + 1) * piece).min(data.len());
                                std::hint::black_box(read_all(&data[lo..hi]));
                            }),
                        }
                        *b = b.min(t.elapsed().as_secs_f64());
                    }
                    best_mm = best_mm.min(seconds(|| {
                        matmul_with(level, &*pool, &w, &x, n_tok, &mut y).expect("matmul");
                    }));
                }
                let gb = data.len() as f64 / 1e9;
                println!(
                    "      weights {:.1} MB: matmul {:.1} GB/s (alternating {:.1}), read every byte {:.1} GB/s, one byte per line {:.1} GB/s, on {threads} thread(s) {:.1} GB/s",
                    gb * 1e3,
                    gb / best,
                    gb / best_mm,
                    gb / best_read[0],
                    gb / best_read[1],
                    gb / best_read[2]
                );
            }
            println!(
                "{:>5} {n_out:>5}x{n_in:<5} n_tok={n_tok} threads={threads} {level:?}: {:8.3} ms {:7.1} GFLOP/s wall, {:6.1} GFLOP/s per CPU-second",
                ty.name(),
                best * 1e3,
                flop / best / 1e9,
                flop / best_cpu / 1e9
            );
        }
    }
    println!(
        "all shapes: {:.1} GFLOP/s (sum of flops / sum of best times)",
        total_flop / total_t / 1e9
    );
}
