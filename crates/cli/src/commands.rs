//! The `run`, `chat` and `logits` subcommands.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kapitsa_backend::{Backend, CpuBackend};
use kapitsa_base::pool::RayonPool;
use kapitsa_cache::SlotCache;
use kapitsa_engine::loader::{chat_template_for, tokenizer_for};
use kapitsa_engine::{generate, GenerateRequest, SamplingParams};
use kapitsa_models::{BatchInputs, KvCache, KvType, LoadOptions, LoadedModel};
use kapitsa_text::{ChatTemplate, Tokenizer};

/// Options every model-running command shares.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Model: a GGUF file, or a Hugging Face / MLX model directory.
    #[arg(short, long)]
    model: PathBuf,
    /// Compute threads (0 = one per core).
    #[arg(short, long, default_value_t = 0)]
    threads: usize,
    /// Context size in tokens (0 = the model's training context, capped at 32768).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    ctx: usize,
    /// KV cache element type: f16 or f32.
    #[arg(long, default_value = "f16")]
    kv_type: String,
}

/// Sampling options.
#[derive(Args, Clone)]
pub struct SampleArgs {
    /// Temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Min-p (0 = off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Presence penalty (0 = off).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Frequency penalty (0 = off).
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Tokens the penalties look back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop string (repeatable); not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Do not stop at end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
}

impl SampleArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: self.repeat_last_n,
            seed: self.seed,
        }
    }
}

/// `kapitsa run`.
#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sample: SampleArgs,
    /// Raw prompt text (special tokens like <|im_start|> are parsed).
    #[arg(short, long, conflicts_with = "chat")]
    prompt: Option<String>,
    /// A user message: the model's chat template is applied first.
    #[arg(long)]
    chat: Option<String>,
    /// System prompt for --chat.
    #[arg(long, requires = "chat", conflicts_with = "prompt")]
    system: Option<String>,
    /// Maximum number of tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    n_predict: usize,
}

/// `kapitsa chat`.
#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sample: SampleArgs,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 1024)]
    n_predict: usize,
}

/// `kapitsa logits`.
#[derive(Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (special tokens parsed).
    #[arg(
        short,
        long,
        conflicts_with = "tokens",
        required_unless_present = "tokens"
    )]
    prompt: Option<String>,
    /// Comma-separated prompt token ids.
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
    /// Output file.
    #[arg(short, long)]
    out: PathBuf,
    /// Prompt tokens per forward pass.
    #[arg(long, default_value_t = 512)]
    batch: usize,
}

struct Session {
    loaded: LoadedModel,
    tok: Tokenizer,
    cache: SlotCache,
}

fn kv_type(s: &str) -> Result<KvType> {
    match s {
        "f16" => Ok(KvType::F16),
        "f32" => Ok(KvType::F32),
        other => bail!("unknown --kv-type '{other}' (use f16 or f32)"),
    }
}

fn backend(threads: usize) -> Result<Arc<dyn Backend>> {
    let pool = RayonPool::new(threads).context("starting the thread pool")?;
    Ok(Arc::new(CpuBackend::new(Box::new(pool))))
}

fn load(a: &ModelArgs) -> Result<(LoadedModel, Tokenizer)> {
    kv_type(&a.kv_type)?; // reject a bad value before the slow load
    let be = backend(a.threads)?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {bytes}/{total_bytes} ({eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(
        a.model
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let loaded = kapitsa_models::load_model(
        &a.model,
        be.clone(),
        &LoadOptions {
            progress: Some(&progress),
        },
    )
    .with_context(|| format!("loading {}", a.model.display()))?;
    bar.finish_and_clear();
    let tok = tokenizer_for(&loaded.source)
        .with_context(|| format!("building the tokenizer of {}", a.model.display()))?;
    let spec = loaded.model.spec();
    eprintln!(
        "kapitsa: {} ({} layers, vocab {}) on {}",
        loaded.arch,
        spec.layers.len(),
        spec.n_vocab,
        be.describe()
    );
    Ok((loaded, tok))
}

fn session(a: &ModelArgs) -> Result<Session> {
    let (loaded, tok) = load(a)?;
    let n_ctx = if a.ctx == 0 {
        loaded.model.spec().n_ctx_train.min(32768)
    } else {
        a.ctx
    };
    let cache = SlotCache::new(&*loaded.model, 1, n_ctx, kv_type(&a.kv_type)?)?;
    Ok(Session { loaded, tok, cache })
}

fn template(s: &Session) -> Result<ChatTemplate> {
    chat_template_for(&s.loaded.source, &s.tok)?
        .ok_or_else(|| anyhow::anyhow!("the model has no chat template; use -p with a raw prompt"))
}

/// `kapitsa run`.
pub fn run(a: RunArgs) -> Result<()> {
    a.sample.params().validate()?; // reject bad sampling options before the slow load
    let mut s = session(&a.model)?;
    let text = match (&a.prompt, &a.chat) {
        (Some(p), None) => p.clone(),
        (None, Some(c)) => {
            let mut msgs = Vec::new();
            if let Some(sys) = &a.system {
                msgs.push(serde_json::json!({"role": "system", "content": sys}));
            }
            msgs.push(serde_json::json!({"role": "user", "content": c}));
            template(&s)?.render(&serde_json::Value::Array(msgs), None, true, None)?
        }
        _ => bail!("give a prompt with -p TEXT or --chat TEXT"),
    };
    let prompt = s.tok.encode(&text, true, true)?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let req = GenerateRequest {
        prompt,
        max_tokens: a.n_predict,
        sampling: a.sample.params(),
        stop: a.sample.stop.clone(),
        ignore_eos: a.sample.ignore_eos,
        prefill_chunk: 512,
    };
    let mut stdout = std::io::stdout().lock();
    let out = generate(&*s.loaded.model, &s.tok, &mut s.cache, 0, &req, &mut |t| {
        let _ = stdout.write_all(t.as_bytes());
        let _ = stdout.flush();
    })?;
    let _ = writeln!(stdout);
    eprintln!(
        "\nprompt: {} tokens in {:.2} s ({:.1} tok/s) | generation: {} tokens in {:.2} s ({:.1} tok/s) | stop: {:?}",
        out.n_prompt,
        out.prompt_secs,
        rate(out.n_prompt - out.n_cached, out.prompt_secs),
        out.tokens.len(),
        out.gen_secs,
        rate(out.tokens.len(), out.gen_secs),
        out.finish
    );
    Ok(())
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// `kapitsa chat`.
pub fn chat(a: ChatArgs) -> Result<()> {
    a.sample.params().validate()?; // a bad option must fail the command, not each turn
    let mut s = session(&a.model)?;
    let tmpl = template(&s)?;
    let mut msgs = Vec::new();
    if let Some(sys) = &a.system {
        msgs.push(serde_json::json!({"role": "system", "content": sys}));
    }
    eprintln!(
        "chat: type a message and press Enter; /reset clears the history, /exit or Ctrl-D quits."
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        let line = line.trim_end();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                msgs.retain(|m: &serde_json::Value| m["role"] == "system");
                eprintln!("(history cleared)");
                continue;
            }
            _ => {}
        }
        msgs.push(serde_json::json!({"role": "user", "content": line}));
        let text = tmpl.render(&serde_json::Value::Array(msgs.clone()), None, true, None)?;
        let prompt = s.tok.encode(&text, true, true)?;
        let req = GenerateRequest {
            prompt,
            max_tokens: a.n_predict,
            sampling: a.sample.params(),
            stop: a.sample.stop.clone(),
            ignore_eos: false,
            prefill_chunk: 512,
        };
        let mut stdout = std::io::stdout().lock();
        let out = match generate(&*s.loaded.model, &s.tok, &mut s.cache, 0, &req, &mut |t| {
            let _ = stdout.write_all(t.as_bytes());
            let _ = stdout.flush();
        }) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("\nerror: {e}");
                msgs.pop();
                continue;
            }
        };
        let _ = writeln!(stdout);
        eprintln!(
            "[{} prompt tokens ({} reused), {} generated, {:.1} tok/s]",
            out.n_prompt,
            out.n_cached,
            out.tokens.len(),
            rate(out.tokens.len(), out.gen_secs)
        );
        msgs.push(serde_json::json!({"role": "assistant", "content": out.text}));
    }
    Ok(())
}

/// `kapitsa logits`.
pub fn logits(a: LogitsArgs) -> Result<()> {
    let (loaded, tok) = load(&a.model)?;
    let ids = match (&a.prompt, &a.tokens) {
        (Some(p), _) => tok.encode(p, true, true)?,
        (None, Some(t)) => t.clone(),
        _ => bail!("give --prompt or --tokens"),
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    if a.batch == 0 {
        bail!("--batch must be >= 1");
    }
    let model = &*loaded.model;
    let n_vocab = model.spec().n_vocab as u32;
    if let Some(t) = ids.iter().find(|&&t| t >= n_vocab) {
        bail!("token id {t} is outside the vocabulary ({n_vocab})");
    }
    let mut cache = KvCache::for_model(model, 1, ids.len(), kv_type(&a.model.kv_type)?)?;
    // Write to a temporary file next to the output and rename it on success, so a failure
    // never leaves a partial or empty logits file behind.
    // (Special files such as /dev/null or a pipe are written directly.)
    let special = a.out.exists() && !a.out.is_file();
    let tmp = if special {
        a.out.clone()
    } else {
        a.out.with_extension("partial")
    };
    let mut write = || -> Result<()> {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
        );
        let mut pos = 0;
        for chunk in ids.chunks(a.batch) {
            let rows = (0..chunk.len()).collect();
            let out =
                model.forward(&BatchInputs::single(0, chunk, pos as u32, rows), &mut cache)?;
            for v in &out.data {
                f.write_all(&v.to_le_bytes())?;
            }
            pos += chunk.len();
        }
        f.flush()
            .with_context(|| format!("writing {}", tmp.display()))?;
        if !special {
            std::fs::rename(&tmp, &a.out)
                .with_context(|| format!("writing {}", a.out.display()))?;
        }
        Ok(())
    };
    if let Err(e) = write() {
        if !special {
            let _ = std::fs::remove_file(&tmp);
        }
        return Err(e);
    }
    let s: Vec<String> = ids.iter().map(|t| t.to_string()).collect();
    println!("{}", s.join(","));
    Ok(())
}
