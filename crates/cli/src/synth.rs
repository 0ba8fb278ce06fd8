//! The `synth` subcommand: write a production-shaped GGUF with random weights (see
//! `kapitsa-synth`).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kapitsa_synth::{presets, QuantMix, SynthOptions};

/// Options of `kapitsa synth`.
#[derive(Args)]
#[command(after_help = presets_help())]
pub struct SynthArgs {
    /// Model preset (listed below).
    #[arg(long)]
    preset: String,
    /// Layer count (default: the production count). Qwen3.6: a multiple of 4; Nemotron: a
    /// prefix of the block pattern holding every block kind; Qwen3 MoE and dense presets: any.
    #[arg(long)]
    layers: Option<usize>,
    /// Tensor type mix: q4_k_m (llama-quantize's choices), q8_0 or f16.
    #[arg(long, default_value = "q4_k_m")]
    quant: String,
    /// GGUF file whose tokenizer.* metadata is copied (padded to the preset's vocabulary): a
    /// model, or a vocab-only file such as llama.cpp's models/ggml-vocab-qwen2.gguf.
    #[arg(long, value_name = "FILE.gguf")]
    tokenizer_from: Option<PathBuf>,
    /// Size the vocabulary to the tokenizer instead of the preset (needed when the tokenizer
    /// is larger than the preset's vocabulary).
    #[arg(long)]
    vocab_from_tokenizer: bool,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output file (written to OUT.partial, then renamed).
    #[arg(short, long, value_name = "OUT.gguf")]
    output: PathBuf,
    /// Divide widths (hidden, FFN, heads, experts, vocabulary) by this; for tests.
    #[arg(long, default_value_t = 1, hide = true)]
    width_divisor: usize,
}

fn presets_help() -> String {
    let mut s = String::from("Presets:\n");
    for p in presets() {
        s.push_str(&format!("  {:<28} {}\n", p.name, p.about));
    }
    s
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{bytes} B")
    }
}

/// Run `kapitsa synth`.
pub fn synth(a: SynthArgs) -> Result<()> {
    let opts = SynthOptions {
        preset: a.preset,
        layers: a.layers,
        quant: QuantMix::parse(&a.quant)?,
        tokenizer_from: a.tokenizer_from,
        vocab_from_tokenizer: a.vocab_from_tokenizer,
        seed: a.seed,
        width_divisor: a.width_divisor,
    };
    let prepared = kapitsa_synth::prepare(&opts)?;
    let plan = &prepared.plan;
    eprintln!(
        "synth: {} ({}), {} layers [{}], vocab {}, {}, seed {}",
        prepared.preset.name,
        prepared.preset.family.arch(),
        plan.pattern.len(),
        plan.pattern,
        plan.dims.n_vocab,
        opts.quant.name(),
        opts.seed,
    );
    for n in &prepared.notes {
        eprintln!("synth: note: {n}");
    }

    let tty = std::io::stderr().is_terminal();
    let bar = if tty {
        let pb = ProgressBar::new(0);
        pb.set_style(
            ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .expect("valid template"),
        );
        Some(pb)
    } else {
        None
    };
    // Without a terminal: one line per 10%.
    let last_decile = AtomicU64::new(0);
    let progress = |done: u64, total: u64| {
        if let Some(pb) = &bar {
            pb.set_length(total);
            pb.set_position(done);
        } else if let Some(decile) = (done * 10).checked_div(total) {
            if decile > last_decile.swap(decile, Ordering::Relaxed) {
                eprintln!(
                    "synth: {} / {} ({}%)",
                    human(done),
                    human(total),
                    done * 100 / total
                );
            }
        }
    };
    let report = prepared.write(&a.output, &progress);
    if let Some(pb) = &bar {
        pb.finish_and_clear();
    }
    let report = report?;

    println!(
        "wrote {} ({} bytes = {}, {} tensors, {:.3} B parameters) in {:.1} s",
        report.path.display(),
        report.bytes,
        human(report.bytes),
        report.n_tensors,
        report.n_params as f64 / 1e9,
        report.seconds
    );
    println!("tensor types:");
    for (ty, n, bytes) in &report.histogram {
        println!(
            "  {:<7} {:>5} tensors {:>12}",
            ty.to_string(),
            n,
            human(*bytes)
        );
    }
    Ok(())
}
