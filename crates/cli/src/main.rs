//! `kapitsa`: run, chat with, inspect and probe models from the command line.

mod bench;
mod commands;
mod inspect;
mod serve;
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Run(a) => commands::run(a),
        Cmd::Chat(a) => commands::chat(a),
        Cmd::Inspect(a) => inspect::inspect(a),
        Cmd::Logits(a) => commands::logits(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Synth(a) => synth::synth(a),
        Cmd::Serve(a) => serve::serve(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
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
