//! `kapitsa inspect`: metadata and tensor table of a model file or directory.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use kapitsa_formats::{GgufFile, GgufValue, HfModelDir};

/// `kapitsa inspect`.
#[derive(Args)]
pub struct InspectArgs {
    /// A GGUF file, or a directory with config.json and safetensors (HF or MLX).
    path: PathBuf,
    /// Print every element of long arrays instead of the first few.
    #[arg(long)]
    full: bool,
    /// Skip the tensor table.
    #[arg(long)]
    no_tensors: bool,
}

/// Run the subcommand.
pub fn inspect(a: InspectArgs) -> Result<()> {
    if a.path.is_dir() {
        let h =
            HfModelDir::open(&a.path).with_context(|| format!("opening {}", a.path.display()))?;
        println!("format: safetensors directory");
        println!(
            "config.json:\n{}",
            serde_json::to_string_pretty(h.config())?
        );
        if let Some(q) = h.mlx_quantization() {
            println!("mlx quantization: {q:?}");
        }
        if !a.no_tensors {
            let mut names = h.tensor_names();
            names.sort();
            println!("\n{} tensors:", names.len());
            for n in names {
                if let Some(t) = h.tensor(n) {
                    println!("  {:<60} {:<6} {:?}", n, t.dtype.name(), t.shape);
                }
            }
        }
        return Ok(());
    }
    let g = GgufFile::open(&a.path).with_context(|| format!("opening {}", a.path.display()))?;
    println!(
        "format: GGUF v{} (alignment {})",
        g.version(),
        g.alignment()
    );
    println!("\n{} metadata keys:", g.metadata().len());
    for (k, v) in g.metadata() {
        println!("  {k} = {}", show(v, a.full));
    }
    if !a.no_tensors {
        let infos = g.tensor_infos();
        let total: usize = infos.iter().map(|t| t.n_bytes).sum();
        println!(
            "\n{} tensors, {:.2} MiB:",
            infos.len(),
            total as f64 / (1 << 20) as f64
        );
        for t in infos {
            println!(
                "  {:<40} {:<7} {:<22} {:>12} bytes",
                t.name,
                t.dtype.name(),
                format!("{:?}", t.shape),
                t.n_bytes
            );
        }
    }
    Ok(())
}

fn show(v: &GgufValue, full: bool) -> String {
    match v {
        GgufValue::String(s) => {
            if s.len() > 200 && !full {
                let cut: String = s.chars().take(200).collect();
                format!("{cut:?}... ({} bytes)", s.len())
            } else {
                format!("{s:?}")
            }
        }
        GgufValue::Array(a) => crate::inspect::show_array(a, full),
        other => format!("{other:?}"),
    }
}

fn show_array(a: &kapitsa_formats::GgufArray, full: bool) -> String {
    let s = format!("{a:?}");
    if full || s.len() <= 200 {
        s
    } else {
        let cut: String = s.chars().take(200).collect();
        format!("{cut}... ({} elements)", a.len())
    }
}
