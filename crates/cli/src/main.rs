//! `kapitsa`: run, chat with, inspect and probe models from the command line.

mod bench;
mod bench_spec;
mod commands;
mod inspect;
mod selftest;
mod serve;
mod spec_args;
mod synth;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Kapitsa: a specialised LLM inference engine.
#[derive(Parser)]
#[command(name = "kapitsa", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt, streaming it to stdout.
    Run(commands::RunArgs),
    /// Interactive multi-turn chat using the model's chat template.
    Chat(commands::ChatArgs),
    /// Print the metadata and tensor table of a GGUF file or a safetensors/MLX directory.
    Inspect(inspect::InspectArgs),
    /// Write the logits of every prompt position to a file (raw little-endian f32
    /// [n_prompt_tokens, n_vocab]); prints the prompt token ids on stdout.
    Logits(commands::LogitsArgs),
    /// Measure prompt-processing and decode speed like llama.cpp's llama-bench.
    Bench(bench::BenchArgs),
    /// Write a production-shaped GGUF with random weights (benchmarks, smoke tests).
    Synth(synth::SynthArgs),
    /// Serve the model over HTTP (OpenAI- and Anthropic-compatible API).
    Serve(serve::ServeArgs),
    /// Check a backend: every op against the CPU scalar reference, then the tiny reference
    /// checkpoints on that device (what scripts/test-gpu.sh runs on a GPU).
    Selftest(selftest::SelftestArgs),
}

fn main() -> ExitCode {
    keep_large_buffers();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Run(a) => commands::run(a),
        Cmd::Chat(a) => commands::chat(a),
        Cmd::Inspect(a) => inspect::inspect(a),
        Cmd::Logits(a) => commands::logits(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Synth(a) => synth::synth(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Selftest(a) => selftest::selftest(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// Tells glibc's allocator to keep freed memory of up to 256 MiB and to serve blocks of up to
/// 64 MiB from its heap. By default blocks above ~128 KiB (the forward pass's per-layer
/// activations of a long batch) are fresh `mmap`s, so every layer of every step faults in and
/// zeroes new pages: a 512-token prefill of Qwen3.6-L8 took ~255k page faults, ~53k with
/// this (`perf stat -e page-faults kapitsa bench -p 512 -n 0`). Memory stays in the process
/// up to the peak a step needs, as other allocators keep it.
fn keep_large_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::ffi::c_int;
        extern "C" {
            fn mallopt(param: c_int, value: c_int) -> c_int;
        }
        // glibc's <malloc.h>.
        const M_TRIM_THRESHOLD: c_int = -1;
        const M_MMAP_THRESHOLD: c_int = -3;
        // SAFETY: mallopt only sets allocator tunables (it returns 0 on a value it rejects,
        // which changes nothing); it runs once, before any other thread exists.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 64 << 20);
            mallopt(M_TRIM_THRESHOLD, 256 << 20);
        }
    }
}

/// The error and its causes on one line, skipping a cause whose text the message already
/// contains (several library errors print their source in their own message).
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if out.contains(&c) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&c);
    }
    out.replace('\n', " ")
}
