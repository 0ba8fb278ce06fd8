//! Synthetic GGUF models: the exact production shapes of named presets (Qwen3.6-35B-A3B,
//! Qwen3-30B-A3B, Nemotron 3 Nano / Super, and the dense Qwen2.5-Coder-1.5B and Qwen3-8B), random but numerically sane weights, the tensor
//! type mix `llama-quantize Q4_K_M` would choose (or all-Q8_0 / all-F16), and a real tokenizer
//! copied from another GGUF, so Kapitsa and llama.cpp load and run the same file.
//!
//! Used for benchmarks (speed depends only on shapes and types) and for "runs without NaN"
//! tests at production sizes.
//!
//! # Sane numerics
//!
//! - Weight matrices: zero-mean, std `1/sqrt(n_in)` (unit-RMS inputs give unit-RMS outputs);
//!   embeddings std 1; norms 1.
//! - Output projection: std `2/sqrt(n_embd)` (logits of std ~2), with the rows of every
//!   non-text token (control, unused, padding) zero, so greedy decoding emits plain tokens and
//!   never stops early on an end-of-generation token.
//! - Routers: softmax routers have per-expert row scales `exp(0.2 N(0,1))` and logit std 2;
//!   Nemotron's sigmoid routers logit std 1.5 plus a selection bias `exp_probs_b ~ N(0, 0.025)`:
//!   tokens spread over most experts with an uneven load, like a trained router.
//! - Recurrent mixers: `A = exp(A_log)` uniform in [1, 16] (GGUF stores `-A`), `dt_bias` the
//!   inverse softplus of `dt` log-uniform in [1e-3, 1e-1] (the Mamba initialisation), conv taps
//!   N(0, 0.5^2), Mamba `D = 1`, conv bias 0.
//!
//! # Vocabulary
//!
//! The tokenizer (`tokenizer.*` keys) is copied from a source GGUF. A tokenizer smaller than the
//! preset's vocabulary is padded with `[PAD{id}]` tokens of type UNUSED, as llama.cpp's converter
//! pads. A larger one is refused unless `vocab_from_tokenizer` is set, which sizes the model's
//! vocabulary to the tokenizer instead (the only shape then not the production one).
//! Sources that keep the production vocabulary: llama.cpp's vocab-only files (GGUFs with
//! tokenizer metadata and no tensors; in its source package, `models/ggml-vocab-qwen2.gguf`:
//! Qwen2's 151,936 tokens with pre `qwen2`, and `models/ggml-vocab-qwen35.gguf`: the same
//! count with pre `qwen35`, for the Qwen presets; `models/ggml-vocab-llama-bpe.gguf`: Llama 3's 128,256 tokens, for Nemotron's
//! 131,072) or any Qwen2.5 / Qwen3 GGUF (151,936 tokens, pre `qwen2`).
//!
//! # Layer reduction
//!
//! See [`Preset::layer_pattern`]: Qwen3.6 keeps whole `[lin, lin, lin, full]` periods, Nemotron
//! takes a prefix of its block pattern holding every block kind, Qwen3 MoE and the dense
//! presets take any count.
//!
//! # Tied embeddings
//!
//! A preset with [`Preset::tied_embeddings`] (Qwen2.5-Coder-1.5B) has no `output.weight`: its
//! `token_embd.weight` is drawn like an output head and gets the output head's Q4_K_M type.

pub mod plan;
pub mod preset;
pub mod quant;
pub mod tokenizer;
pub mod write;

use std::path::{Path, PathBuf};
use std::time::Instant;

use kapitsa_base::GgmlType;
use kapitsa_formats::GgufValue;

pub use plan::{Plan, QuantMix, TensorPlan};
pub use preset::{preset, presets, Dims, Family, Preset};

/// Everything that can go wrong; each message is one line.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// Bad options (unknown preset, bad layer count, bad tokenizer source, ...).
    #[error("{0}")]
    Usage(String),
    /// File system trouble.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Building the GGUF header failed.
    #[error("{0}")]
    Format(#[from] kapitsa_formats::FormatError),
    /// A bug.
    #[error("internal error: {0}")]
    Internal(String),
}

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// Preset name (see [`presets`]).
    pub preset: String,
    /// Layer count (`None`: production).
    pub layers: Option<usize>,
    /// Type mix.
    pub quant: QuantMix,
    /// GGUF whose `tokenizer.*` keys are copied (required).
    pub tokenizer_from: Option<PathBuf>,
    /// Size the vocabulary to the tokenizer instead of the preset.
    pub vocab_from_tokenizer: bool,
    /// Random seed.
    pub seed: u64,
    /// Test-only width divisor (1: production widths), see [`Preset::dims`].
    pub width_divisor: usize,
}

impl SynthOptions {
    /// Defaults for `preset`: production layers, Q4_K_M, seed 0, no tokenizer yet.
    pub fn new(preset: &str) -> SynthOptions {
        SynthOptions {
            preset: preset.to_string(),
            layers: None,
            quant: QuantMix::Q4KM,
            tokenizer_from: None,
            vocab_from_tokenizer: false,
            seed: 0,
            width_divisor: 1,
        }
    }
}

/// A validated plan, ready to write.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The preset.
    pub preset: Preset,
    /// The file description.
    pub plan: Plan,
    /// Tokens in the tokenizer (the rest of the vocabulary is padding).
    pub n_tokens: usize,
    /// Notes worth telling the user (approximations, padding).
    pub notes: Vec<String>,
    seed: u64,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct Report {
    /// Output path.
    pub path: PathBuf,
    /// File size in bytes.
    pub bytes: u64,
    /// Tensor count.
    pub n_tensors: usize,
    /// Parameter count.
    pub n_params: u64,
    /// Per type: (tensors, bytes).
    pub histogram: Vec<(GgmlType, usize, u64)>,
    /// Wall time of the write, seconds.
    pub seconds: f64,
}

/// Validate `opts` and build the plan (reads the tokenizer source; writes nothing).
pub fn prepare(opts: &SynthOptions) -> Result<Prepared, SynthError> {
    let preset = preset::preset(&opts.preset)?;
    let pattern = preset.layer_pattern(opts.layers)?;
    if opts.width_divisor == 0 {
        return Err(SynthError::Usage(
            "--width-divisor must be at least 1".into(),
        ));
    }
    let tok_path = opts.tokenizer_from.as_ref().ok_or_else(|| {
        SynthError::Usage(
            "no tokenizer source: pass --tokenizer-from FILE.gguf (a GGUF whose tokenizer.* \
             metadata is copied, e.g. a Qwen2.5 GGUF)"
                .into(),
        )
    })?;
    let tok = tokenizer::read(tok_path)?;
    let mut dims = preset.dims(opts.width_divisor);
    let mut notes = Vec::new();
    if opts.vocab_from_tokenizer {
        if tok.n_tokens != dims.n_vocab {
            notes.push(format!(
                "vocabulary set to the tokenizer's {} tokens (preset: {})",
                tok.n_tokens, dims.n_vocab
            ));
        }
        dims.n_vocab = tok.n_tokens;
    } else if tok.n_tokens > dims.n_vocab {
        return Err(SynthError::Usage(format!(
            "the tokenizer of {} has {} tokens, more than the {} rows of {}'s vocabulary: pass \
             --vocab-from-tokenizer to size the model's vocabulary to the tokenizer",
            tok.path.display(),
            tok.n_tokens,
            dims.n_vocab,
            preset.name
        )));
    } else if tok.n_tokens < dims.n_vocab {
        notes.push(format!(
            "tokenizer has {} tokens; padded to {} with [PAD<id>] (UNUSED) tokens",
            tok.n_tokens, dims.n_vocab
        ));
    }
    if preset.pattern_approximate {
        notes.push(format!(
            "{}: the block order is an approximation (only the counts M/E/* are public)",
            preset.name
        ));
    }
    let (tok_kvs, zero_rows) = tok.for_vocab(dims.n_vocab)?;
    let mut extra = vec![
        (
            "general.name".to_string(),
            GgufValue::String(format!("kapitsa synth {}", preset.name)),
        ),
        (
            "kapitsa.synth.preset".to_string(),
            GgufValue::String(preset.name.to_string()),
        ),
        ("kapitsa.synth.seed".to_string(), GgufValue::U64(opts.seed)),
        (
            "kapitsa.synth.layer_pattern".to_string(),
            GgufValue::String(pattern.clone()),
        ),
        (
            "kapitsa.synth.tokenizer_from".to_string(),
            GgufValue::String(
                tok.path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            ),
        ),
    ];
    if opts.width_divisor > 1 {
        extra.push((
            "kapitsa.synth.width_divisor".to_string(),
            GgufValue::U32(opts.width_divisor as u32),
        ));
    }
    let plan = plan::build(plan::PlanInput {
        preset: &preset,
        dims,
        pattern,
        mix: opts.quant,
        tokenizer: tok_kvs,
        zero_rows,
        extra,
    })?;
    Ok(Prepared {
        preset,
        plan,
        n_tokens: tok.n_tokens,
        notes,
        seed: opts.seed,
    })
}

impl Prepared {
    /// Write the file to `out` (through `OUT.partial`), reporting `(bytes_written, total)`.
    pub fn write(
        &self,
        out: &Path,
        progress: &(dyn Fn(u64, u64) + Sync),
    ) -> Result<Report, SynthError> {
        let t0 = Instant::now();
        let bytes = write::write_plan(&self.plan, out, self.seed, progress)?;
        Ok(Report {
            path: out.to_path_buf(),
            bytes,
            n_tensors: self.plan.tensors.len(),
            n_params: self.plan.n_params(),
            histogram: self.plan.type_histogram(),
            seconds: t0.elapsed().as_secs_f64(),
        })
    }
}

/// [`prepare`] then [`Prepared::write`].
pub fn synthesize(
    opts: &SynthOptions,
    out: &Path,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Report, SynthError> {
    prepare(opts)?.write(out, progress)
}
