//! The `run`, `chat` and `logits` subcommands, and the model options and loading bar every
//! model command shares. Models are opened with [`kapitsa_engine::open_model`]; `run` and
//! `chat` generate through the engine service (one slot, the same decode loop as the server),
//! `logits` calls the model's forward pass directly.

use std::collections::VecDeque;
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kapitsa_engine::{
    open_model, DeviceChoice, EngineConfig, EngineHandle, Event, FinishReason, ImageInput,
    OpenOptions, OpenedModel, ParsedReply, PrefixCacheConfig, ReplyEvent, ReplyFormat, ReplyParser,
    Request, SamplingParams, Timing, Usage,
};
use kapitsa_models::{BatchInputs, KvType, LoadMode};
use kapitsa_text::ChatTemplate;

/// Options every model-running command shares.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Model: a GGUF file, or a Hugging Face / MLX model directory.
    #[arg(short, long)]
    model: PathBuf,
    /// Compute threads (0 = one per core).
    #[arg(short, long, default_value_t = 0)]
    threads: usize,
    /// Device: auto (a usable GPU, else the CPU), cpu, cuda (= cuda:0) or cuda:N.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// GPU memory budget (bytes; KiB/MiB/GiB suffixes accepted): the most the GPU may hold
    /// for this process, its CUDA context included; the model must fit in it, and the KV
    /// cache is sized from what it leaves. Ignored on the CPU.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    gpu_memory: Option<usize>,
    /// Context size in tokens (0 = the model's training context, capped at 32768).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    ctx: usize,
    /// KV cache element type: f16, f32 or q8_0 (8-bit blocks, about half of f16's memory;
    /// needs a head size that is a multiple of 32).
    #[arg(long, default_value = "f16")]
    kv_type: String,
    /// How the weights are held (see `LoadModeArg`).
    #[arg(long, value_enum, default_value_t = LoadModeArg::Auto)]
    load_mode: LoadModeArg,
    /// The vision tower of a GGUF model: llama.cpp's mmproj GGUF (for --image; an HF model
    /// directory carries its own tower).
    #[arg(long, value_name = "FILE")]
    mmproj: Option<PathBuf>,
}

/// How the weight files are held in memory (`--load-mode`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoadModeArg {
    /// A copy in memory when the files take at most half of the available RAM, else a
    /// memory map.
    #[default]
    Auto,
    /// Memory-map the files: instant to open, no copy; reads go through the page cache.
    Mmap,
    /// Read a private copy into memory at load (huge pages requested): slower to open,
    /// usually faster to decode.
    Memory,
}

impl From<LoadModeArg> for LoadMode {
    fn from(a: LoadModeArg) -> LoadMode {
        match a {
            LoadModeArg::Auto => LoadMode::Auto,
            LoadModeArg::Mmap => LoadMode::Mmap,
            LoadModeArg::Memory => LoadMode::Memory,
        }
    }
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
            logit_bias: Vec::new(),
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
    #[command(flatten)]
    spec: crate::spec_args::SpecArgs,
    /// Raw prompt text (special tokens like <|im_start|> are parsed).
    #[arg(short, long, conflicts_with = "chat")]
    prompt: Option<String>,
    /// A user message: the model's chat template is applied first.
    #[arg(long)]
    chat: Option<String>,
    /// System prompt for --chat.
    #[arg(long, requires = "chat", conflicts_with = "prompt")]
    system: Option<String>,
    /// An image for a vision-language model (Qwen3.5/3.6 or Nemotron omni with a vision
    /// tower; PNG, JPEG, WebP or GIF; repeatable). With --chat the images go before the
    /// message text; with a raw -p prompt, one placeholder per image is put before the prompt
    /// (Qwen `<|vision_start|><|image_pad|><|vision_end|>`, Nemotron `<image>`), unless the
    /// prompt already holds the image token (then it must hold one per image, in order).
    #[arg(long = "image", value_name = "FILE")]
    images: Vec<PathBuf>,
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
    #[command(flatten)]
    spec: crate::spec_args::SpecArgs,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 1024)]
    n_predict: usize,
    /// Tools the model may call: a JSON file holding an array of OpenAI-style tool definitions
    /// ({"type": "function", "function": {"name", "description", "parameters"}}), given to the
    /// chat template. Calls are printed as `[tool call] name({...})`; answer each with a line
    /// `/tool RESULT`.
    #[arg(long, value_name = "FILE")]
    tools: Option<PathBuf>,
    /// Turn the template's thinking mode on (sets `enable_thinking` to true; default: the
    /// template's own default).
    #[arg(long, conflicts_with = "no_think")]
    think: bool,
    /// Turn the template's thinking mode off (sets `enable_thinking` to false).
    #[arg(long)]
    no_think: bool,
    /// Print each rendered prompt to stderr, between `[prompt]` and `[/prompt]` lines, before
    /// generating the reply (for checking chat templates and the flags above).
    #[arg(long)]
    print_prompt: bool,
    /// An image for a vision-language model (Qwen3.5/3.6 with a vision tower; PNG, JPEG,
    /// WebP or GIF; repeatable): it goes with your first message, before its text (again
    /// after /reset).
    #[arg(long = "image", value_name = "FILE")]
    images: Vec<PathBuf>,
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

/// An opened model and the engine that generates with it, one sequence at a time.
struct Session {
    opened: OpenedModel,
    engine: EngineHandle,
}

fn kv_type(s: &str) -> Result<KvType> {
    s.parse::<KvType>()
        .map_err(|_| anyhow::anyhow!("unknown --kv-type '{s}' (use f16, f32 or q8_0)"))
}

/// The progress bar shown while the weights of `model` are read.
pub(crate) fn loading_bar(model: &Path) -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {bytes}/{total_bytes} ({eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(
        model
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    bar
}

/// Open `path` with a loading bar, then print the device to stderr (`device: cpu`).
pub(crate) fn open_with_bar(path: &Path, opts: OpenOptions<'_>) -> Result<OpenedModel> {
    let bar = loading_bar(path);
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let opened = open_model(
        path,
        &OpenOptions {
            progress: Some(&progress),
            ..opts
        },
    );
    bar.finish_and_clear();
    let opened = opened?;
    eprintln!("device: {}", opened.device);
    Ok(opened)
}

/// Open the model of `a` and print its description (`kapitsa: qwen2 (24 layers: ...) on
/// cpu ...`).
fn open(a: &ModelArgs) -> Result<OpenedModel> {
    kv_type(&a.kv_type)?; // reject a bad value before the slow load
    let opened = open_with_bar(
        &a.model,
        OpenOptions {
            device: a.device,
            threads: a.threads,
            load_mode: a.load_mode.into(),
            mmproj: a.mmproj.as_deref(),
            gpu_memory: a.gpu_memory,
            ..OpenOptions::default()
        },
    )?;
    eprintln!("kapitsa: {}", opened.description);
    Ok(opened)
}

/// Open the model and start the engine: one sequence of `--ctx-size` tokens, with the
/// prefix cache so that a chat's next turn resumes from the previous one.
fn session(a: &ModelArgs, spec: &crate::spec_args::SpecArgs) -> Result<Session> {
    let opened = open(a)?;
    let n_ctx = opened.context_size(a.ctx);
    let prefix = PrefixCacheConfig {
        model_id: opened.identity.clone(),
        ..PrefixCacheConfig::default()
    };
    let mut cfg = EngineConfig::single_sequence(n_ctx, kv_type(&a.kv_type)?, Some(prefix));
    cfg.spec = spec.config(&opened, a.load_mode.into())?;
    cfg.vision = opened.vision.clone();
    let engine = EngineHandle::start(opened.model.clone(), opened.tokenizer.clone(), cfg)
        .context("starting the engine")?;
    Ok(Session { opened, engine })
}

/// Read `--image` files (before the slow model load, so that a wrong path fails at once).
fn read_images(files: &[PathBuf]) -> Result<Vec<(PathBuf, Vec<u8>)>> {
    files
        .iter()
        .map(|f| {
            let bytes =
                std::fs::read(f).with_context(|| format!("reading the image {}", f.display()))?;
            Ok((f.clone(), bytes))
        })
        .collect()
}

/// Preprocess `--image` files for the session's vision tower (the checkpoint's image
/// processor settings, else Qwen3.5's defaults; the server's default limits).
fn prepare_images(s: &Session, files: &[(PathBuf, Vec<u8>)]) -> Result<Vec<ImageInput>> {
    if files.is_empty() {
        return Ok(Vec::new());
    }
    let Some(v) = s.engine.vision() else {
        bail!("this model has no vision tower: it cannot take images (--image)");
    };
    let proc =
        kapitsa_server::images::processor_of(&s.opened, v.kind).map_err(anyhow::Error::msg)?;
    kapitsa_server::images::check_processor(&proc, &v).map_err(anyhow::Error::msg)?;
    let limits = kapitsa_image::Limits::default();
    files
        .iter()
        .map(|(path, bytes)| {
            kapitsa_server::images::image_input(bytes, &proc, &limits)
                .with_context(|| format!("the image {}", path.display()))
        })
        .collect()
}

/// Content of a user message: `n` images, then `text` (a plain string without images).
fn user_content(text: &str, n: usize) -> serde_json::Value {
    use kapitsa_server::images::{content_value, Piece};
    let mut pieces = vec![Piece::Image; n];
    pieces.push(Piece::Text(text.to_string()));
    content_value(pieces)
}

fn template(s: &Session) -> Result<ChatTemplate> {
    s.opened
        .chat_template()?
        .ok_or_else(|| anyhow::anyhow!("the model has no chat template; use -p with a raw prompt"))
}

/// What a finished request reports.
struct Finished {
    finish: FinishReason,
    usage: Usage,
    timing: Timing,
}

/// Submit `req` to the session's engine and wait for its end, giving each piece of final
/// text to `on_text`.
fn generate(s: &Session, req: Request, on_text: &mut dyn FnMut(&str)) -> Result<Finished> {
    let mut stream = s.engine.submit(req)?;
    while let Some(ev) = stream.blocking_recv() {
        match ev {
            Event::Text { text, .. } => {
                if !text.is_empty() {
                    on_text(&text);
                }
            }
            Event::Done {
                finish,
                usage,
                timing,
            } => {
                return Ok(Finished {
                    finish,
                    usage,
                    timing,
                })
            }
            Event::Error(e) => bail!("{e}"),
            Event::Admitted { .. } => {}
        }
    }
    bail!("the engine stopped before the reply was complete")
}

/// `kapitsa run`.
pub fn run(a: RunArgs) -> Result<()> {
    a.sample.params().validate()?; // reject bad sampling options before the slow load
    let files = read_images(&a.images)?;
    let s = session(&a.model, &a.spec)?;
    let images = prepare_images(&s, &files)?;
    let text = match (&a.prompt, &a.chat) {
        (Some(p), None) => match s.engine.vision() {
            Some(v) => kapitsa_server::images::raw_prompt(p, images.len(), &v, &s.opened.tokenizer),
            None => p.clone(),
        },
        (None, Some(c)) => {
            let mut msgs = Vec::new();
            if let Some(sys) = &a.system {
                msgs.push(serde_json::json!({"role": "system", "content": sys}));
            }
            msgs.push(
                serde_json::json!({"role": "user", "content": user_content(c, images.len())}),
            );
            template(&s)?.render(&serde_json::Value::Array(msgs), None, true, None)?
        }
        _ => bail!("give a prompt with -p TEXT or --chat TEXT"),
    };
    let prompt = s.opened.tokenizer.encode(&text, true, true)?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    // Each image token becomes the image's tokens.
    let vision = s.engine.vision();
    let n_prompt = images.iter().fold(prompt.len(), |n, i| {
        let widened = vision.map_or(1, |v| v.prompt_tokens(i.grid));
        (n + widened).saturating_sub(1)
    });
    let req = Request {
        prompt,
        sampling: a.sample.params(),
        max_tokens: a.n_predict,
        stop: a.sample.stop.clone(),
        ignore_eos: a.sample.ignore_eos,
        top_logprobs: None,
        constraint: None,
        spec: Default::default(),
        images,
    };
    let mut stdout = std::io::stdout().lock();
    let out = if a.n_predict == 0 {
        // Nothing to generate (the engine runs requests of at least one token).
        Finished {
            finish: FinishReason::Length,
            usage: Usage {
                prompt_tokens: n_prompt,
                ..Usage::default()
            },
            timing: Timing::default(),
        }
    } else {
        generate(&s, req, &mut |t| {
            let _ = stdout.write_all(t.as_bytes());
            let _ = stdout.flush();
        })?
    };
    let _ = writeln!(stdout);
    let (u, prompt_secs, gen_secs) = (
        out.usage,
        out.timing.prompt.as_secs_f64(),
        out.timing.generation.as_secs_f64(),
    );
    eprintln!(
        "\nprompt: {} tokens in {:.2} s ({:.1} tok/s) | generation: {} tokens in {:.2} s ({:.1} tok/s) | stop: {:?}",
        u.prompt_tokens,
        prompt_secs,
        rate(u.prompt_tokens - u.cached_tokens, prompt_secs),
        u.completion_tokens,
        gen_secs,
        rate(u.completion_tokens, gen_secs),
        out.finish
    );
    if let Some(line) = crate::spec_args::summary(&s.engine.metrics()) {
        eprintln!("{line}");
    }
    Ok(())
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Read and check a `--tools` file: a JSON array of tool definitions, each with a name.
fn read_tools(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the tools file {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("the tools file {} is not valid JSON", path.display()))?;
    let Some(list) = v.as_array() else {
        bail!(
            "the tools file {} must hold a JSON array of tool definitions",
            path.display()
        );
    };
    for (i, t) in list.iter().enumerate() {
        let f = t.get("function").unwrap_or(t);
        if f.get("name").and_then(|n| n.as_str()).is_none() {
            bail!(
                "tool {} in {} has no \"name\" (expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}})",
                i + 1,
                path.display()
            );
        }
    }
    Ok(v)
}

/// The text after `/tool`, if `line` is a `/tool` command.
fn tool_result(line: &str) -> Option<&str> {
    if line == "/tool" {
        return Some("");
    }
    line.strip_prefix("/tool ").map(str::trim_start)
}

/// Tool calls of the last reply that still wait for a `/tool` answer.
#[derive(Clone, Default)]
struct PendingTools {
    /// (id, function name), in call order.
    calls: VecDeque<(String, String)>,
    /// Calls seen so far (for unique ids).
    n_seen: usize,
}

impl PendingTools {
    /// Give each tool call of `msg` (an assistant message from `ParsedReply::to_message`) an
    /// id (`call_N`, for templates that pair calls and results by id) and queue it; returns how
    /// many are now waiting.
    fn record(&mut self, msg: &mut serde_json::Value) -> usize {
        self.calls.clear();
        if let Some(calls) = msg.get_mut("tool_calls").and_then(|c| c.as_array_mut()) {
            for c in calls {
                self.n_seen += 1;
                let id = format!("call_{}", self.n_seen);
                c["id"] = id.clone().into();
                let name = c["function"]["name"].as_str().unwrap_or_default();
                self.calls.push_back((id, name.to_string()));
            }
        }
        self.calls.len()
    }

    /// The tool message answering the oldest waiting call with `result`, if one waits.
    fn answer(&mut self, result: &str) -> Option<serde_json::Value> {
        let (id, name) = self.calls.pop_front()?;
        Some(serde_json::json!({
            "role": "tool",
            "tool_call_id": id,
            "name": name,
            "content": result,
        }))
    }
}

/// Prints a streaming reply: reasoning to stderr (dimmed on a terminal, else between
/// `[thinking]` and `[/thinking]` lines), content to stdout, each tool call on its own stdout
/// line as `[tool call] name({...})`.
struct ReplyPrinter {
    stderr_tty: bool,
    in_reasoning: bool,
    /// Something was written to stdout for this reply.
    printed: bool,
    /// Stdout is at the start of a line.
    at_line_start: bool,
}

impl ReplyPrinter {
    fn new(stderr_tty: bool) -> ReplyPrinter {
        ReplyPrinter {
            stderr_tty,
            in_reasoning: false,
            printed: false,
            at_line_start: true,
        }
    }

    fn event(&mut self, e: ReplyEvent) {
        match e {
            ReplyEvent::Reasoning(t) => {
                let mut err = std::io::stderr().lock();
                if !self.in_reasoning {
                    self.in_reasoning = true;
                    let _ = if self.stderr_tty {
                        err.write_all(b"\x1b[2m")
                    } else {
                        err.write_all(b"[thinking]\n")
                    };
                }
                let _ = err.write_all(t.as_bytes());
                let _ = err.flush();
            }
            ReplyEvent::Content(t) => {
                self.end_reasoning();
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(t.as_bytes());
                let _ = out.flush();
                self.printed = true;
                self.at_line_start = t.ends_with('\n');
            }
            ReplyEvent::ToolCall(c) => {
                self.end_reasoning();
                let mut out = std::io::stdout().lock();
                if !self.at_line_start {
                    let _ = writeln!(out);
                }
                let _ = writeln!(out, "[tool call] {}({})", c.name, c.arguments_json());
                let _ = out.flush();
                self.printed = true;
                self.at_line_start = true;
            }
        }
    }

    fn end_reasoning(&mut self) {
        if self.in_reasoning {
            self.in_reasoning = false;
            if self.stderr_tty {
                eprintln!("\x1b[0m");
            } else {
                eprintln!("\n[/thinking]");
            }
        }
    }

    /// The reply failed: close the reasoning block and end a started stdout line.
    fn abort(&mut self) {
        self.end_reasoning();
        if !self.at_line_start {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out);
            let _ = out.flush();
        }
    }

    /// End of the reply: close the reasoning block and end the stdout line (a reply always
    /// ends with exactly one newline on stdout, even an empty one).
    fn finish(&mut self) {
        self.end_reasoning();
        if !self.at_line_start || !self.printed {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out);
            let _ = out.flush();
        }
    }
}

/// Everything a chat turn needs besides the session and the history.
struct ChatSetup<'a> {
    tmpl: &'a ChatTemplate,
    fmt: ReplyFormat,
    tools: Option<&'a serde_json::Value>,
    extra: Option<&'a serde_json::Value>,
    args: &'a ChatArgs,
    stderr_tty: bool,
    /// The `--image`s, given with every turn while the history holds them.
    images: Vec<ImageInput>,
}

/// Render the history, generate and print the assistant's reply.
/// `with_images`: the history holds the `--image`s (in its first user message).
fn chat_turn(
    s: &Session,
    c: &ChatSetup,
    msgs: &[serde_json::Value],
    with_images: bool,
) -> Result<(ParsedReply, Finished)> {
    let text = c.tmpl.render(
        &serde_json::Value::Array(msgs.to_vec()),
        c.tools,
        true,
        c.extra,
    )?;
    if c.args.print_prompt {
        eprintln!("[prompt]\n{text}\n[/prompt]");
    }
    let prompt = s.opened.tokenizer.encode(&text, true, true)?;
    let req = Request {
        prompt,
        sampling: c.args.sample.params(),
        max_tokens: c.args.n_predict,
        stop: c.args.sample.stop.clone(),
        ignore_eos: false,
        top_logprobs: None,
        constraint: None,
        spec: Default::default(),
        images: if with_images {
            c.images.clone()
        } else {
            Vec::new()
        },
    };
    let mut parser = ReplyParser::new(c.fmt, c.fmt.starts_in_reasoning(&text));
    if let Some(t) = c.tools {
        parser = parser.with_tools(t);
    }
    let mut printer = ReplyPrinter::new(c.stderr_tty);
    let out = generate(s, req, &mut |t| {
        for e in parser.push(t) {
            printer.event(e);
        }
    });
    let (rest, reply) = parser.finish();
    for e in rest {
        printer.event(e);
    }
    match out {
        Ok(out) => {
            printer.finish();
            Ok((reply, out))
        }
        Err(e) => {
            printer.abort();
            Err(e)
        }
    }
}

/// `kapitsa chat`.
pub fn chat(a: ChatArgs) -> Result<()> {
    a.sample.params().validate()?; // a bad option must fail the command, not each turn
    let tools = a.tools.as_deref().map(read_tools).transpose()?;
    let extra = match (a.think, a.no_think) {
        (true, _) => Some(serde_json::json!({"enable_thinking": true})),
        (_, true) => Some(serde_json::json!({"enable_thinking": false})),
        _ => None,
    };
    let files = read_images(&a.images)?;
    let s = session(&a.model, &a.spec)?;
    let images = prepare_images(&s, &files)?;
    let tmpl = template(&s)?;
    let src = s.opened.chat_template_source.clone().unwrap_or_default();
    let fmt = ReplyFormat::from_template(&src);
    if tools.is_some() && !src.contains("tools") {
        eprintln!("note: the chat template does not use tools; --tools has no effect");
    }
    if extra.is_some() && !src.contains("enable_thinking") {
        eprintln!(
            "note: the chat template has no enable_thinking switch; --think/--no-think have no effect"
        );
    }
    let setup = ChatSetup {
        tmpl: &tmpl,
        fmt,
        tools: tools.as_ref(),
        extra: extra.as_ref(),
        args: &a,
        stderr_tty: std::io::stderr().is_terminal(),
        images,
    };
    // Whether the history holds the images (they go with the first user message).
    let mut images_placed = false;
    let mut msgs = Vec::new();
    if let Some(sys) = &a.system {
        msgs.push(serde_json::json!({"role": "system", "content": sys}));
    }
    let mut pending = PendingTools::default();
    eprintln!(
        "chat: type a message and press Enter; /tool RESULT answers a tool call, /reset clears the history, /exit or Ctrl-D quits."
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
                pending.calls.clear();
                images_placed = false;
                eprintln!("(history cleared)");
                continue;
            }
            _ => {}
        }
        let saved = (msgs.len(), pending.clone(), images_placed);
        if let Some(result) = tool_result(line) {
            let Some(msg) = pending.answer(result) else {
                eprintln!(
                    "(no tool call is waiting for a result; /tool RESULT answers the model's tool calls)"
                );
                continue;
            };
            msgs.push(msg);
            if let Some((_, next)) = pending.calls.front() {
                eprintln!(
                    "({} more tool result(s) expected; next: {next})",
                    pending.calls.len()
                );
                continue;
            }
        } else {
            if !pending.calls.is_empty() {
                eprintln!("(the pending tool calls stay unanswered)");
                pending.calls.clear();
            }
            let n = if images_placed { 0 } else { setup.images.len() };
            images_placed = true;
            msgs.push(serde_json::json!({"role": "user", "content": user_content(line, n)}));
        }
        let with_images = images_placed && !setup.images.is_empty();
        let (reply, out) = match chat_turn(&s, &setup, &msgs, with_images) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("\nerror: {e}");
                msgs.truncate(saved.0);
                pending = saved.1;
                images_placed = saved.2;
                continue;
            }
        };
        eprintln!(
            "[{} prompt tokens ({} reused), {} generated, {:.1} tok/s]",
            out.usage.prompt_tokens,
            out.usage.cached_tokens,
            out.usage.completion_tokens,
            rate(
                out.usage.completion_tokens,
                out.timing.generation.as_secs_f64()
            )
        );
        let mut msg = reply.to_message();
        let n = pending.record(&mut msg);
        if n > 0 {
            eprintln!("({n} tool call(s): answer each, in order, with a line /tool RESULT)");
        }
        msgs.push(msg);
    }
    Ok(())
}

/// `kapitsa logits`.
pub fn logits(a: LogitsArgs) -> Result<()> {
    let opened = open(&a.model)?;
    let ids = match (&a.prompt, &a.tokens) {
        (Some(p), _) => opened.tokenizer.encode(p, true, true)?,
        (None, Some(t)) => t.clone(),
        _ => bail!("give --prompt or --tokens"),
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    if a.batch == 0 {
        bail!("--batch must be >= 1");
    }
    let model = &*opened.model;
    let n_vocab = model.spec().n_vocab as u32;
    if let Some(t) = ids.iter().find(|&&t| t >= n_vocab) {
        bail!("token id {t} is outside the vocabulary ({n_vocab})");
    }
    let mut cache = kapitsa_models::new_cache(model, 1, ids.len(), kv_type(&a.model.kv_type)?)?;
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

/// `4096`, `4KiB`, `4K`, `4MiB`, `1GiB` ... -> bytes.
pub(crate) fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 65536, 512KiB, 4MiB)"))?;
    let mul: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("unknown size unit in '{s}' (use KiB, MiB or GiB)")),
    };
    n.checked_mul(mul)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("'{s}' is not a usable size"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert!(parse_size("x").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("3 parsecs").is_err());
    }
    use kapitsa_engine::reply::parse_reply;

    #[test]
    fn tool_command_parsing() {
        assert_eq!(tool_result("/tool"), Some(""));
        assert_eq!(tool_result("/tool  21 C"), Some("21 C"));
        assert_eq!(tool_result("/toolbox"), None);
        assert_eq!(tool_result("tool x"), None);
    }

    /// The history the chat loop builds around a tool call renders through the real Qwen3.5
    /// template: calls get ids, results are queued in order and become tool messages.
    #[test]
    fn tool_history_renders() {
        let src = include_str!("../../../tests/fixtures/templates/qwen3.5.jinja");
        let tmpl = ChatTemplate::new(src, None, None).expect("template");
        let fmt = ReplyFormat::from_template(src);
        let raw = "Two cities.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>";
        let reply = parse_reply(fmt, true, raw);
        let mut pending = PendingTools::default();
        assert!(pending.answer("early").is_none());
        let mut msg = reply.to_message();
        assert_eq!(pending.record(&mut msg), 2);
        assert_eq!(msg["tool_calls"][1]["id"], "call_2");
        let mut msgs = vec![
            serde_json::json!({"role": "user", "content": "Weather in Bern, time in Oslo?"}),
            msg,
        ];
        msgs.extend(pending.answer("sunny"));
        assert_eq!(pending.calls.len(), 1);
        msgs.extend(pending.answer("12:00"));
        assert!(pending.answer("extra").is_none());
        assert_eq!(msgs[3]["tool_call_id"], "call_2");
        assert_eq!(msgs[3]["name"], "get_time");
        let out = tmpl
            .render(&serde_json::Value::Array(msgs), None, true, None)
            .expect("render");
        assert!(
            out.ends_with(&format!(
                "<|im_start|>assistant\n<think>\n{raw}<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
            )),
            "{out}"
        );
        // Ids stay unique across replies.
        let mut msg = reply.to_message();
        pending.record(&mut msg);
        assert_eq!(msg["tool_calls"][0]["id"], "call_3");
    }
}
