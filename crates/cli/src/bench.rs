//! `kapitsa bench`: prompt-processing and decode throughput, measured the way llama.cpp's
//! `llama-bench` measures them, so the two can be compared on the same GGUF file.
//!
//! - `ppP` (prompt processing): one forward pass over `P` random tokens, logits for the last row
//!   only; tokens/s = `P / time`.
//! - `tgN` (text generation): `N` sequential single-token forward passes (random tokens, not
//!   sampled, as llama-bench); tokens/s = `N / time`.
//! - `@ dD`: before each timed run the cache is filled with `D` random tokens (not timed).
//!
//! Each test runs once as a warm-up (for `tg`, one decode step, as llama-bench), then `-r`
//! times; the table shows the mean ± sample standard deviation of the per-run tokens/s. Token
//! ids come from a fixed-seed generator, within the vocabulary.
//!
//! `--membw` instead measures memory bandwidth (read-only and copy), the bound of decode speed.
//!
//! The model is opened like every other command's ([`kapitsa_engine::open_model`]); the timed
//! runs call its forward pass directly, not the engine, to measure raw passes as llama-bench
//! does.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kapitsa_base::CpuFeatures;
use kapitsa_engine::{DeviceChoice, OpenOptions};
use kapitsa_models::{BatchInputs, CausalLm, KvCache, KvType, ModelSource};

/// Output format.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A markdown table like llama-bench's.
    Md,
    /// A JSON array with one object per test (llama-bench's `-o json` field names).
    Json,
}

/// `kapitsa bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Model: a GGUF file, or a Hugging Face / MLX model directory.
    #[arg(short, long, required_unless_present = "membw")]
    model: Option<PathBuf>,
    /// Prompt lengths of the pp tests (comma-separated or repeated; 0 = no pp test).
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_values_t = [512])]
    n_prompt: Vec<usize>,
    /// Token counts of the tg tests (comma-separated or repeated; 0 = no tg test).
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_values_t = [128])]
    n_gen: Vec<usize>,
    /// Tokens already in the cache before each test (comma-separated or repeated).
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_values_t = [0])]
    n_depth: Vec<usize>,
    /// Sequences decoded at once in the tg tests, each in its own cache slot with its own
    /// depth (llama-batched-bench's `-npl`); t/s counts the tokens of all of them.
    #[arg(long, default_value_t = 1, value_name = "N")]
    sequences: usize,
    /// Compute threads (0 = one per core).
    #[arg(short, long, default_value_t = 0)]
    threads: usize,
    /// Device: auto (a usable GPU, else the CPU), cpu, cuda (= cuda:0) or cuda:N.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// GPU memory budget (bytes; KiB/MiB/GiB suffixes accepted): the most the GPU may hold
    /// for this process, its CUDA context included; the model must fit in it, and the KV
    /// cache is sized from what it leaves. Ignored on the CPU.
    #[arg(long, value_name = "SIZE", value_parser = crate::commands::parse_size)]
    gpu_memory: Option<usize>,
    /// How the weights are held: auto (a copy in memory when it fits in half the available
    /// RAM, else a memory map), mmap or memory.
    #[arg(long, value_enum, default_value_t = crate::commands::LoadModeArg::Auto)]
    load_mode: crate::commands::LoadModeArg,
    /// Timed runs per test.
    #[arg(short, long = "repetitions", default_value_t = 5)]
    repetitions: usize,
    /// Output format on stdout.
    #[arg(short, long, value_enum, default_value = "md")]
    output: Format,
    /// KV cache element type: f16, f32 or q8_0 (8-bit blocks, about half of f16's memory;
    /// needs a head size that is a multiple of 32).
    #[arg(long, default_value = "f16")]
    kv_type: String,
    /// Skip the warm-up run of each test.
    #[arg(long)]
    no_warmup: bool,
    /// Measure memory bandwidth (read-only and copy) with -t threads instead of a model.
    #[arg(long, conflicts_with = "model")]
    membw: bool,
    /// Size of each --membw buffer in MiB (keep it well above the last-level cache).
    #[arg(long, default_value_t = 1024, value_name = "MIB")]
    membw_mib: usize,
    /// Instead of pp/tg: generate through the engine over the prompts of FILE (JSON lines,
    /// `{"prompt": TEXT}` or `{"chat": TEXT}`, optional `"max_tokens"`; default the first
    /// -n), greedy, with the --spec options; reports generated tokens/s and acceptance.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["membw", "verify_cost"])]
    prompts: Option<PathBuf>,
    /// Instead of pp/tg: the time of one forward pass over K new tokens (verifying K - 1
    /// proposals) relative to a one-token step, for each K (comma-separated), at the first
    /// -d depth, over the first -n passes.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "K",
        conflicts_with = "membw"
    )]
    verify_cost: Vec<usize>,
    #[command(flatten)]
    spec: crate::spec_args::SpecArgs,
}

/// Tokens per forward pass when filling the cache to a depth.
const FILL_CHUNK: usize = 512;

/// One test: `n_prompt` xor `n_gen` is non-zero.
#[derive(Clone, Copy)]
struct Test {
    n_prompt: usize,
    n_gen: usize,
    n_depth: usize,
    /// Sequences decoding at once (tg tests; 1 for pp tests).
    n_seqs: usize,
}

impl Test {
    fn name(&self) -> String {
        let base = if self.n_prompt > 0 {
            format!("pp{}", self.n_prompt)
        } else if self.n_seqs > 1 {
            format!("tg{} x{}", self.n_gen, self.n_seqs)
        } else {
            format!("tg{}", self.n_gen)
        };
        if self.n_depth > 0 {
            format!("{base} @ d{}", self.n_depth)
        } else {
            base
        }
    }

    /// Tokens each timed run processes (all sequences').
    fn n_tokens(&self) -> usize {
        self.n_prompt + self.n_gen * self.n_seqs
    }

    /// Cache positions a sequence of the test needs.
    fn n_ctx(&self) -> usize {
        self.n_depth + self.n_prompt + self.n_gen
    }
}

/// Static facts about the model file, for the table.
struct ModelInfo {
    filename: String,
    model_type: String,
    size: u64,
    n_params: u64,
    /// Weight bytes one decode step reads (GGUF only): every tensor, but of expert tensors
    /// only the routed share (`expert_used_count / expert_count`) and of the token embedding
    /// only one row (unless it doubles as the output head).
    decode_bytes: Option<u64>,
}

/// The tests of the arguments, llama-bench's order: per depth, the pp tests, then the tg tests.
fn tests(a: &BenchArgs) -> Vec<Test> {
    let mut out = Vec::new();
    for &d in &a.n_depth {
        for &p in a.n_prompt.iter().filter(|&&p| p > 0) {
            out.push(Test {
                n_prompt: p,
                n_gen: 0,
                n_depth: d,
                n_seqs: 1,
            });
        }
        for &n in a.n_gen.iter().filter(|&&n| n > 0) {
            out.push(Test {
                n_prompt: 0,
                n_gen: n,
                n_depth: d,
                n_seqs: a.sequences,
            });
        }
    }
    out
}

fn kv_type(s: &str) -> Result<KvType> {
    s.parse::<KvType>()
        .map_err(|_| anyhow::anyhow!("unknown --kv-type '{s}' (use f16, f32 or q8_0)"))
}

/// Run `kapitsa bench`.
pub fn bench(a: BenchArgs) -> Result<()> {
    if a.membw {
        return membw_cmd(&a);
    }
    let Some(path) = a.model.clone() else {
        bail!("give a model with -m FILE (or --membw)");
    };
    // Reject bad arguments before the slow load.
    if a.repetitions == 0 {
        bail!("-r/--repetitions must be >= 1");
    }
    if a.sequences == 0 {
        bail!("--sequences must be >= 1");
    }
    let kvt = kv_type(&a.kv_type)?;
    let tests = tests(&a);
    if tests.is_empty() {
        bail!("nothing to measure: every -p and -n value is 0");
    }
    if !path.exists() {
        bail!("model {} does not exist", path.display());
    }

    let opened = crate::commands::open_with_bar(
        &path,
        OpenOptions {
            device: a.device,
            threads: a.threads,
            load_mode: a.load_mode.into(),
            gpu_memory: a.gpu_memory,
            ..OpenOptions::default()
        },
    )?;
    // The CPU backend's pool: `-t`, or one thread per core (as `cpu_pool` counts them).
    let n_threads = match a.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let model = &*opened.model;
    let spec = model.spec();
    let info = model_info(&path, &opened.source, &opened.arch);
    let backend = match opened.backend.device() {
        kapitsa_backend::Device::Cpu => format!("CPU ({})", CpuFeatures::get().describe()),
        _ => format!("CUDA ({})", opened.backend.describe()),
    };
    let first_n = a.n_gen.first().copied().unwrap_or(128).max(1);
    if let Some(file) = &a.prompts {
        let cfg = a.spec.config(&opened, a.load_mode.into())?;
        let r = crate::bench_spec::generate(&opened, file, first_n, kvt, cfg)?;
        match a.output {
            Format::Md => {
                println!("| model | backend | spec | prompts | tokens | t/s |");
                println!("| --- | --- | --- | ---: | ---: | ---: |");
                println!(
                    "| {} | {backend} | {} | {} | {} | {:.2} |",
                    info.filename,
                    r.mode,
                    r.prompts,
                    r.tokens,
                    r.tokens_per_sec()
                );
                if let Some(line) = crate::spec_args::summary(&r.metrics) {
                    println!("\n{line}");
                }
            }
            Format::Json => {
                let v = r.json(&info.filename, &backend);
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
        }
        return Ok(());
    }
    if !a.verify_cost.is_empty() {
        let depth = a.n_depth.first().copied().unwrap_or(0);
        let rows = crate::bench_spec::verify_cost(&opened, &a.verify_cost, depth, first_n, kvt)?;
        match a.output {
            Format::Md => {
                println!("| model | backend | depth | k | ms/pass | cost vs 1 token |");
                println!("| --- | --- | ---: | ---: | ---: | ---: |");
                for (k, ms, rel) in &rows {
                    println!(
                        "| {} | {backend} | {depth} | {k} | {ms:.2} | {rel:.2} |",
                        info.filename
                    );
                }
            }
            Format::Json => {
                let v: Vec<serde_json::Value> = rows
                    .iter()
                    .map(|(k, ms, rel)| {
                        serde_json::json!({
                            "model_filename": info.filename, "backends": backend,
                            "test": format!("verify{k}"), "n_depth": depth, "k": k,
                            "ms_per_pass": ms, "verify_cost": rel,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
        }
        return Ok(());
    }

    let max_ctx = tests.iter().map(Test::n_ctx).max().unwrap_or(1);
    if max_ctx > spec.n_ctx_train {
        bail!(
            "the tests need {max_ctx} cache positions (depth + tokens) but the model's context is {}",
            spec.n_ctx_train
        );
    }
    let mut cache = kapitsa_models::new_cache(model, a.sequences, max_ctx, kvt)?;
    // Recurrent state (conv windows + SSM/delta-rule states): read and written every step.
    let state_bytes = kapitsa_models::new_cache(model, 1, 0, kvt)?.size_bytes() as u64;
    eprintln!(
        "bench: {} ({}, {} layers, vocab {}) on {}; cache {} positions ({:.1} MiB)",
        info.filename,
        opened.arch,
        spec.layers.len(),
        spec.n_vocab,
        opened.backend.describe(),
        max_ctx,
        cache.size_bytes() as f64 / (1 << 20) as f64
    );
    if let Some(m) = opened.backend.memory() {
        eprintln!("bench: GPU memory after load: {}", gpu_memory_line(&m));
    }

    let mut rng = Rng(0x6b61_7069_7473_6131); // fixed seed
    let n_vocab = spec.n_vocab;
    let mut results = Vec::new();
    for t in &tests {
        let name = t.name();
        if !a.no_warmup {
            eprintln!("bench: {name}: warm-up");
            let warm = if t.n_prompt > 0 {
                *t
            } else {
                Test { n_gen: 1, ..*t }
            };
            run_once(model, &mut cache, &warm, &mut rng, n_vocab)?;
        }
        let mut samples_ns = Vec::with_capacity(a.repetitions);
        for r in 0..a.repetitions {
            let ns = run_once(model, &mut cache, t, &mut rng, n_vocab)?;
            eprintln!(
                "bench: {name}: run {}/{}: {:.1} ms, {:.2} t/s",
                r + 1,
                a.repetitions,
                ns as f64 / 1e6,
                t.n_tokens() as f64 * 1e9 / ns as f64
            );
            samples_ns.push(ns);
        }
        let kernels = model.step_kernels().filter(|_| t.n_gen > 0);
        if let Some(k) = kernels {
            eprintln!("bench: {name}: {k} kernel launches/step (one recorded step)");
        }
        let mem = opened.backend.memory();
        if let Some(m) = &mem {
            eprintln!("bench: {name}: GPU memory: {}", gpu_memory_line(m));
        }
        results.push((*t, samples_ns, kernels, mem));
    }

    match a.output {
        Format::Md => print!("{}", markdown(&info, &backend, n_threads, &results)),
        Format::Json => {
            let arr: Vec<serde_json::Value> = results
                .iter()
                .map(|(t, s, k, m)| {
                    let mut e =
                        json_entry(&info, &backend, n_threads, &a.kv_type, state_bytes, t, s);
                    if let Some(k) = k {
                        e["launches_per_step"] = serde_json::json!(k);
                    }
                    if let Some(m) = m {
                        // the process's peak: the context's base plus the pool's high-water mark
                        e["gpu_mem_peak_bytes"] = serde_json::json!(m.base + m.peak);
                        e["gpu_mem_pool_peak_bytes"] = serde_json::json!(m.peak);
                        e["gpu_mem_base_bytes"] = serde_json::json!(m.base);
                        e["gpu_mem_budget_bytes"] = serde_json::json!(m.budget);
                    }
                    e
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&arr)?);
        }
    }
    Ok(())
}

/// `m` for stderr: the process's peak so far (the context's base plus the pool's high-water
/// mark), what is in use now, and the budget.
fn gpu_memory_line(m: &kapitsa_backend::DeviceMemory) -> String {
    use kapitsa_backend::gib;
    let budget = match m.budget {
        Some(b) => format!(", budget {}", gib(b)),
        None => String::new(),
    };
    format!(
        "peak {} ({} allocated at most + {} context and libraries), {} in use now, {} of {} free{budget}",
        gib(m.base + m.peak),
        gib(m.peak),
        gib(m.base),
        gib(m.used),
        gib(m.free),
        gib(m.total)
    )
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

/// One timed run of `t` (the depth fill before it is not timed); returns nanoseconds.
fn run_once(
    model: &dyn CausalLm,
    cache: &mut KvCache,
    t: &Test,
    rng: &mut Rng,
    n_vocab: usize,
) -> Result<u64> {
    // Position 0 starts the sequence afresh (attention rows are overwritten, recurrent states
    // reset), so no explicit clear is needed.
    let mut pos = 0;
    while pos < t.n_depth {
        let len = FILL_CHUNK.min(t.n_depth - pos);
        for slot in 0..t.n_seqs {
            let toks = rng.tokens(len, n_vocab);
            model.forward(
                &BatchInputs::single(slot, &toks, pos as u32, vec![len - 1]),
                cache,
            )?;
        }
        pos += len;
    }
    if t.n_prompt == 0 && t.n_seqs > 1 {
        // every sequence's next token in one batch per step
        let toks = rng.tokens(t.n_gen * t.n_seqs, n_vocab);
        let start = Instant::now();
        for (i, step) in toks.chunks_exact(t.n_seqs).enumerate() {
            let mut b = BatchInputs::default();
            for (slot, tok) in step.iter().enumerate() {
                b.push_seq(slot, std::slice::from_ref(tok), (pos + i) as u32, true);
            }
            let out = model.forward(&b, cache)?;
            std::hint::black_box(&out);
        }
        return Ok((start.elapsed().as_nanos() as u64).max(1));
    }
    if t.n_prompt > 0 {
        let toks = rng.tokens(t.n_prompt, n_vocab);
        let batch = BatchInputs::single(0, &toks, pos as u32, vec![t.n_prompt - 1]);
        let start = Instant::now();
        let out = model.forward(&batch, cache)?;
        let ns = start.elapsed().as_nanos() as u64;
        std::hint::black_box(&out);
        Ok(ns.max(1))
    } else {
        let toks = rng.tokens(t.n_gen, n_vocab);
        let start = Instant::now();
        for (i, tok) in toks.iter().enumerate() {
            let out = model.forward(
                &BatchInputs::single(0, std::slice::from_ref(tok), (pos + i) as u32, vec![0]),
                cache,
            )?;
            std::hint::black_box(&out);
        }
        Ok((start.elapsed().as_nanos() as u64).max(1))
    }
}

/// SplitMix64: a fixed-seed source of token ids.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn tokens(&mut self, n: usize, n_vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next() % n_vocab as u64) as u32)
            .collect()
    }
}

/// llama.cpp's name of a `general.file_type` value.
fn ftype_name(ft: u32) -> String {
    match ft {
        0 => "all F32".into(),
        1 => "F16".into(),
        2 => "Q4_0".into(),
        3 => "Q4_1".into(),
        7 => "Q8_0".into(),
        8 => "Q5_0".into(),
        9 => "Q5_1".into(),
        10 => "Q2_K - Medium".into(),
        11 => "Q3_K - Small".into(),
        12 => "Q3_K - Medium".into(),
        13 => "Q3_K - Large".into(),
        14 => "Q4_K - Small".into(),
        15 => "Q4_K - Medium".into(),
        16 => "Q5_K - Small".into(),
        17 => "Q5_K - Medium".into(),
        18 => "Q6_K".into(),
        32 => "BF16".into(),
        other => format!("ftype {other}"),
    }
}

fn model_info(path: &Path, src: &ModelSource, arch: &str) -> ModelInfo {
    let filename = file_name(path);
    let (mut size, mut n_params) = (0u64, 0u64);
    let mut decode_bytes = None;
    let mut ftype = String::from("safetensors");
    let mut label = None;
    if let Some(g) = src.gguf() {
        let infos = g.tensor_infos();
        let n_layer = g
            .get_u32(&format!("{arch}.block_count"))
            .map_or(usize::MAX, |n| n as usize);
        let n_expert = g.get_u32(&format!("{arch}.expert_count")).unwrap_or(0) as u64;
        let n_used = g.get_u32(&format!("{arch}.expert_used_count")).unwrap_or(0) as u64;
        let tied = !infos.iter().any(|t| t.name == "output.weight");
        let mut dec = 0u64;
        for t in infos {
            size += t.n_bytes as u64;
            n_params += t.n_elements() as u64;
            let b = t.n_bytes as u64;
            let layer = t
                .name
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<usize>().ok());
            dec += if layer.is_some_and(|l| l >= n_layer) {
                0 // MTP / next-token layers: not run by forward
            } else if t.name.contains("_exps.") && n_expert > 0 {
                b * n_used / n_expert
            } else if t.name == "token_embd.weight" && !tied {
                b / t.shape.first().copied().unwrap_or(1).max(1) as u64
            } else {
                b
            };
        }
        decode_bytes = Some(dec);
        if let Ok(ft) = g.get_u32("general.file_type") {
            ftype = ftype_name(ft);
        }
        label = g.get_str("general.size_label").ok().map(str::to_string);
    } else if let Some(h) = src.hf() {
        for n in h.tensor_names() {
            if let Some(t) = h.tensor(n) {
                size += t.data.len() as u64;
                n_params += t.shape.iter().product::<usize>() as u64;
            }
        }
    }
    let label = label.unwrap_or_else(|| {
        let p = n_params as f64;
        if p >= 1e9 {
            format!("{:.1}B", p / 1e9)
        } else {
            format!("{:.0}M", p / 1e6)
        }
    });
    ModelInfo {
        filename,
        model_type: format!("{arch} {label} {ftype}"),
        size,
        n_params,
        decode_bytes,
    }
}

/// Mean and sample standard deviation.
fn mean_std(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    if x.len() < 2 {
        return (mean, 0.0);
    }
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

fn samples_ts(t: &Test, ns: &[u64]) -> Vec<f64> {
    ns.iter()
        .map(|&n| t.n_tokens() as f64 * 1e9 / n as f64)
        .collect()
}

fn fmt_size(bytes: u64) -> String {
    let gib = bytes as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.2} GiB")
    } else {
        format!("{:.2} MiB", bytes as f64 / (1 << 20) as f64)
    }
}

fn fmt_params(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2} B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2} M", n / 1e6)
    } else {
        format!("{:.2} K", n / 1e3)
    }
}

/// A test's outcome: the test, its runs' nanoseconds, the kernel launches of a recorded
/// decode step (GPU) and the GPU memory after it.
type TestResult = (
    Test,
    Vec<u64>,
    Option<usize>,
    Option<kapitsa_backend::DeviceMemory>,
);

/// The llama-bench style table.
fn markdown(info: &ModelInfo, backend: &str, threads: usize, results: &[TestResult]) -> String {
    let head = [
        "model", "size", "params", "backend", "threads", "test", "t/s",
    ];
    let right = [false, true, true, false, true, true, true];
    let mut rows: Vec<[String; 7]> = Vec::new();
    for (t, ns, ..) in results {
        let (m, s) = mean_std(&samples_ts(t, ns));
        rows.push([
            info.model_type.clone(),
            fmt_size(info.size),
            fmt_params(info.n_params),
            backend.to_string(),
            threads.to_string(),
            t.name(),
            format!("{m:.2} ± {s:.2}"),
        ]);
    }
    let width: Vec<usize> = (0..7)
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([head[i].len(), 5])
                .max()
                .unwrap_or(5)
        })
        .collect();
    let line = |cells: &[String]| {
        let mut s = String::from("|");
        for (i, c) in cells.iter().enumerate() {
            let pad = width[i] - c.chars().count();
            if right[i] {
                s.push_str(&format!(" {}{c} |", " ".repeat(pad)));
            } else {
                s.push_str(&format!(" {c}{} |", " ".repeat(pad)));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(&head.map(String::from));
    out.push('|');
    for (i, w) in width.iter().enumerate() {
        if right[i] {
            out.push_str(&format!(" {}: |", "-".repeat(w - 1)));
        } else {
            out.push_str(&format!(" {} |", "-".repeat(*w)));
        }
    }
    out.push('\n');
    for r in &rows {
        out.push_str(&line(r));
    }
    out
}

fn json_entry(
    info: &ModelInfo,
    backend: &str,
    threads: usize,
    kv: &str,
    state_bytes: u64,
    t: &Test,
    ns: &[u64],
) -> serde_json::Value {
    let ts = samples_ts(t, ns);
    let (avg_ts, std_ts) = mean_std(&ts);
    let ns_f: Vec<f64> = ns.iter().map(|&n| n as f64).collect();
    let (avg_ns, std_ns) = mean_std(&ns_f);
    serde_json::json!({
        "build": concat!("kapitsa ", env!("CARGO_PKG_VERSION")),
        "model_filename": info.filename,
        "model_type": info.model_type,
        "model_size": info.size,
        "model_n_params": info.n_params,
        "backends": backend,
        "n_threads": threads,
        "type_k": kv,
        "type_v": kv,
        "n_prompt": t.n_prompt,
        "n_gen": t.n_gen,
        "n_depth": t.n_depth,
        "n_sequences": t.n_seqs,
        "test": t.name(),
        "avg_ns": avg_ns.round() as u64,
        "stddev_ns": std_ns.round() as u64,
        "avg_ts": avg_ts,
        "stddev_ts": std_ts,
        "samples_ns": ns,
        "samples_ts": ts,
        "decode_weight_bytes_per_token": info.decode_bytes,
        "recurrent_state_bytes": state_bytes,
    })
}

// ---------------------------------------------------------------------------------------------
// Memory bandwidth
// ---------------------------------------------------------------------------------------------

/// Sum of `x` with eight independent accumulators (vectorises; bound by memory reads).
fn read_sum(x: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(c[i]);
        }
    }
    let tail: u64 = chunks.remainder().iter().fold(0, |a, &b| a.wrapping_add(b));
    acc.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

/// Sum of the first word of every 64-byte line of `x`: reads every cache line with an eighth of
/// the instructions of [`read_sum`] (the hardware still moves whole lines).
fn read_lines(x: &[u64]) -> u64 {
    x.chunks_exact(8).fold(0u64, |a, c| a.wrapping_add(c[0]))
}

/// Split `len` into `n` near-equal ranges.
fn ranges(len: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    (0..n).map(|i| len * i / n..len * (i + 1) / n).collect()
}

/// Best-of-`reps` read-only and copy bandwidth in bytes/s over `bytes`-sized buffers with
/// `threads` threads. Read is the faster of [`read_sum`] and [`read_lines`] (either can be the
/// faster one, depending on the core); copy counts bytes read + bytes written (STREAM's
/// convention).
fn membw(threads: usize, bytes: usize, reps: usize) -> (f64, f64) {
    let n = (bytes / 8).max(8 * threads);
    let mut src = vec![0u64; n];
    let mut dst = vec![0u64; n];
    // Touch every page (in parallel, so first-touch placement matches the threads).
    std::thread::scope(|s| {
        let mut rest_s: &mut [u64] = &mut src;
        let mut rest_d: &mut [u64] = &mut dst;
        for r in ranges(n, threads) {
            let (a, b) = std::mem::take(&mut rest_s).split_at_mut(r.len());
            let (c, d) = std::mem::take(&mut rest_d).split_at_mut(r.len());
            rest_s = b;
            rest_d = d;
            let base = r.start as u64;
            s.spawn(move || {
                for (i, v) in a.iter_mut().enumerate() {
                    *v = base + i as u64;
                }
                c.fill(1);
            });
        }
    });
    let mut best_read = f64::INFINITY;
    let mut best_copy = f64::INFINITY;
    for _ in 0..reps {
        for kernel in [read_sum as fn(&[u64]) -> u64, read_lines] {
            let start = Instant::now();
            let total = std::thread::scope(|s| {
                let hs: Vec<_> = ranges(n, threads)
                    .into_iter()
                    .map(|r| {
                        let part = &src[r];
                        s.spawn(move || kernel(part))
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap_or(0))
                    .fold(0u64, u64::wrapping_add)
            });
            best_read = best_read.min(start.elapsed().as_secs_f64());
            std::hint::black_box(total);
        }

        let start = Instant::now();
        std::thread::scope(|s| {
            let mut rest: &mut [u64] = &mut dst;
            for r in ranges(n, threads) {
                let (a, b) = std::mem::take(&mut rest).split_at_mut(r.len());
                rest = b;
                let part = &src[r];
                s.spawn(move || a.copy_from_slice(part));
            }
        });
        best_copy = best_copy.min(start.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    let b = (n * 8) as f64;
    (b / best_read, 2.0 * b / best_copy)
}

fn membw_cmd(a: &BenchArgs) -> Result<()> {
    if a.repetitions == 0 {
        bail!("-r/--repetitions must be >= 1");
    }
    if a.membw_mib == 0 {
        bail!("--membw-mib must be >= 1");
    }
    let bytes = a
        .membw_mib
        .checked_mul(1 << 20)
        .context("--membw-mib is too large")?;
    let threads = if a.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        a.threads
    };
    eprintln!(
        "bench: memory bandwidth, {threads} threads, 2 x {} MiB buffers, best of {}",
        a.membw_mib, a.repetitions
    );
    let (read, copy) = membw(threads, bytes, a.repetitions);
    match a.output {
        Format::Md => {
            println!("| test | threads | buffer | GB/s |");
            println!("| ---- | ------: | -----: | ---: |");
            println!(
                "| read | {threads} | {} MiB | {:.2} |",
                a.membw_mib,
                read / 1e9
            );
            println!(
                "| copy | {threads} | {} MiB | {:.2} |",
                a.membw_mib,
                copy / 1e9
            );
        }
        Format::Json => {
            let v = serde_json::json!({
                "n_threads": threads,
                "buffer_bytes": bytes,
                "repetitions": a.repetitions,
                "read_bytes_per_sec": read,
                "copy_bytes_per_sec": copy,
            });
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_names_and_stats() {
        let t = Test {
            n_prompt: 512,
            n_gen: 0,
            n_depth: 0,
            n_seqs: 1,
        };
        assert_eq!(t.name(), "pp512");
        let t = Test {
            n_prompt: 0,
            n_gen: 128,
            n_depth: 4096,
            n_seqs: 1,
        };
        assert_eq!(t.name(), "tg128 @ d4096");
        assert_eq!(t.n_ctx(), 4224);
        let t = Test {
            n_prompt: 0,
            n_gen: 128,
            n_depth: 512,
            n_seqs: 16,
        };
        assert_eq!(t.name(), "tg128 x16 @ d512");
        assert_eq!((t.n_ctx(), t.n_tokens()), (640, 2048));
        let (m, s) = mean_std(&[1.0, 2.0, 3.0]);
        assert!((m - 2.0).abs() < 1e-12 && (s - 1.0).abs() < 1e-12);
        assert_eq!(mean_std(&[5.0]), (5.0, 0.0));
    }

    #[test]
    fn tokens_are_in_vocab_and_reproducible() {
        let a = Rng(7).tokens(1000, 13);
        assert!(a.iter().all(|&t| t < 13));
        assert_eq!(a, Rng(7).tokens(1000, 13));
    }

    #[test]
    fn bandwidth_is_positive() {
        let (r, c) = membw(2, 1 << 20, 2);
        assert!(r > 0.0 && c > 0.0 && r.is_finite() && c.is_finite());
        assert_eq!(read_sum(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), 55);
        assert_eq!(read_lines(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), 1);
    }
}
