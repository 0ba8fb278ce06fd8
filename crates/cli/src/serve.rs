//! The `serve` subcommand: the OpenAI- and Anthropic-compatible HTTP server.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use kapitsa_engine::{DeviceChoice, EngineConfig, EngineHandle, OpenOptions, PrefixCacheConfig};
use kapitsa_models::KvType;
use kapitsa_server::images::ImageConfig;
use kapitsa_server::{ServedModel, Server, ServerConfig};

/// `kapitsa serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Model: a GGUF file, or a Hugging Face / MLX model directory.
    #[arg(short, long)]
    model: PathBuf,
    #[command(flatten)]
    spec: crate::spec_args::SpecArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 = any free port; the chosen address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require this API key (as `Authorization: Bearer KEY` or `x-api-key: KEY`) on every
    /// endpoint except /health and /metrics.
    #[arg(long)]
    api_key: Option<String>,
    /// Sequences generated at once (cache slots). 16 fills one AMX token tile: a decode step of
    /// 16 sequences costs ~1.3x one of 8 on the 32-element formats' tile GEMM.
    #[arg(long, default_value_t = 16)]
    max_running: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Context per sequence in tokens (0 = the model's training context, capped by what a
    /// quarter of the available memory holds; stderr says the value and why).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    ctx: usize,
    /// Requests waiting for a slot before new ones get 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
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
    /// Model name clients use in `model` (default: the file or directory name, without
    /// `.gguf`).
    #[arg(long)]
    model_name: Option<String>,
    /// Another name for the model, listed in /v1/models (repeatable).
    #[arg(long = "alias", value_name = "NAME")]
    aliases: Vec<String>,
    /// Refuse requests naming a model other than --model-name or an --alias (404); by
    /// default any name is served by the one model.
    #[arg(long)]
    strict_model_name: bool,
    /// Largest request body (bytes; KiB/MiB/GiB or K/M/G suffixes accepted). Images sent
    /// inline count here as base64 (a third larger than the file).
    #[arg(long, default_value = "64MiB", value_parser = crate::commands::parse_size)]
    max_body_bytes: usize,
    /// Most images per request (vision-language models).
    #[arg(long, default_value_t = kapitsa_server::images::DEFAULT_MAX_IMAGES)]
    max_images: usize,
    /// Largest image file accepted (encoded bytes; KiB/MiB/GiB suffixes accepted).
    #[arg(long, default_value = "20MiB", value_parser = crate::commands::parse_size)]
    max_image_bytes: usize,
    /// Largest image accepted, in pixels (width x height as the file declares it; refused
    /// before decoding).
    #[arg(long, default_value_t = 40_000_000)]
    max_image_pixels: u64,
    /// Fetch http:// and https:// image URLs given in requests (off by default: clients must
    /// send images inline as data: URLs or base64). Enabling it lets any client make the
    /// server fetch any address it can reach, internal ones included.
    #[arg(long)]
    allow_image_urls: bool,
    /// Seconds a fetch of an image URL may take in all (with --allow-image-urls).
    #[arg(long, default_value_t = kapitsa_server::images::DEFAULT_URL_TIMEOUT.as_secs())]
    image_url_timeout: u64,
    /// KV cache element type: f16, f32 or q8_0 (8-bit blocks, about half of f16's memory;
    /// needs a head size that is a multiple of 32).
    #[arg(long, default_value = "f16")]
    kv_type: String,
    /// How the weights are held: auto (a copy in memory when it fits in half the available
    /// RAM, else a memory map), mmap or memory.
    #[arg(long, value_enum, default_value_t = crate::commands::LoadModeArg::Auto)]
    load_mode: crate::commands::LoadModeArg,
    /// Token positions in the KV block pool shared by all sequences (0 = two contexts, at
    /// least 65536 and at most every sequence full at once, capped at a quarter of the
    /// available memory, and at least one context).
    /// When the pool runs dry, kept prefixes are evicted, then the newest sequences are
    /// preempted and recomputed later.
    #[arg(long, default_value_t = 0)]
    cache_tokens: usize,
    /// Token positions per KV block.
    #[arg(long, default_value_t = kapitsa_models::DEFAULT_BLOCK_SIZE)]
    kv_block_size: usize,
    /// Turn off prefix caching (every prompt is computed from scratch).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Memory for recurrent-state checkpoints of hybrid models (Qwen3.5/3.6, Nemotron-H).
    #[arg(long, default_value = "1GiB", value_parser = crate::commands::parse_size)]
    cache_state_mem: usize,
    /// Hybrid models: also checkpoint every this many prompt tokens.
    #[arg(long, default_value_t = 1024)]
    cache_checkpoint_every: usize,
    /// Disk tier of the prefix cache: evicted blocks and checkpoints go here and are found
    /// again after a restart (files of other models or layouts are ignored).
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Size budget of --cache-dir.
    #[arg(long, default_value = "8GiB", value_parser = crate::commands::parse_size)]
    cache_disk_size: usize,
    /// Use this Jinja chat template instead of the model's own.
    #[arg(long, value_name = "FILE")]
    chat_template_file: Option<PathBuf>,
    /// The vision tower of a GGUF model: llama.cpp's mmproj GGUF (requests may then carry
    /// images; an HF model directory carries its own tower).
    #[arg(long, value_name = "FILE")]
    mmproj: Option<PathBuf>,
    /// On SIGINT/SIGTERM, seconds the requests in flight may go on before they are cancelled.
    #[arg(long, default_value_t = 10)]
    shutdown_grace: u64,
}

/// Smallest default KV pool, in token positions (see `serve`).
const DEFAULT_POOL_TOKENS: usize = 65536;

/// `kapitsa serve`.
pub fn serve(a: ServeArgs) -> Result<()> {
    let Ok(kv_type) = a.kv_type.parse::<KvType>() else {
        bail!("unknown --kv-type '{}' (use f16, f32 or q8_0)", a.kv_type);
    };
    if a.max_running == 0 {
        bail!("--max-running must be >= 1");
    }
    if a.max_batch_tokens < a.max_running {
        bail!("--max-batch-tokens must be >= --max-running");
    }
    if a.kv_block_size == 0 {
        bail!("--kv-block-size must be >= 1");
    }
    let opened = crate::commands::open_with_bar(
        &a.model,
        OpenOptions {
            device: a.device,
            threads: a.threads,
            load_mode: a.load_mode.into(),
            gpu_memory: a.gpu_memory,
            chat_template_file: a.chat_template_file.as_deref(),
            mmproj: a.mmproj.as_deref(),
            ..OpenOptions::default()
        },
    )?;
    let mut served = ServedModel::from_opened(&opened, a.model_name.clone())?;
    served.aliases = a.aliases.clone();
    served.strict_name = a.strict_model_name;
    let spec = opened.model.spec();
    let token_bytes =
        2 * spec.n_attention_layers() * kv_type.row_bytes(spec.n_head_kv * spec.head_dim);
    let kv_mem = kv_memory(&opened, a.max_running, a.max_batch_tokens);
    if let (Some((_, why)), true) = (&kv_mem, opened.backend.memory().is_some()) {
        eprintln!("kapitsa: GPU memory for the KV cache: {why}");
    }
    let n_ctx = if a.ctx == 0 {
        let (n, why) = default_context(
            spec.n_ctx_train,
            token_bytes,
            kv_mem.as_ref(),
            a.kv_block_size,
        );
        eprintln!("kapitsa: context {n} tokens ({why}; --ctx-size sets it)");
        n
    } else {
        a.ctx
    };
    let full = a.max_running.saturating_mul(n_ctx);
    let pool = if a.cache_tokens == 0 {
        let fits = kv_mem
            .as_ref()
            .map(|(m, _)| m / token_bytes.max(1))
            .unwrap_or(full);
        // Blocks are shared and handed out on demand, so the pool need not hold every slot
        // full: two contexts, at least DEFAULT_POOL_TOKENS (what 16 slots of 4096 held).
        let enough = (2 * n_ctx).max(DEFAULT_POOL_TOKENS);
        full.min(enough).min(fits.max(n_ctx))
    } else if a.cache_tokens < n_ctx {
        bail!(
            "--cache-tokens ({}) must be >= the context ({n_ctx})",
            a.cache_tokens
        );
    } else {
        a.cache_tokens
    };
    let prefix = if a.no_prefix_cache {
        if a.cache_dir.is_some() {
            bail!("--cache-dir needs the prefix cache (drop --no-prefix-cache)");
        }
        None
    } else {
        Some(PrefixCacheConfig {
            model_id: opened.identity.clone(),
            state_bytes: a.cache_state_mem,
            checkpoint_every: a.cache_checkpoint_every.max(1),
            disk: a.cache_dir.clone().map(|d| (d, a.cache_disk_size as u64)),
        })
    };
    if opened.vision.is_some() {
        eprintln!(
            "kapitsa: images on (vision tower; at most {} per request, {} bytes and {} pixels each; image URLs {})",
            a.max_images,
            a.max_image_bytes,
            a.max_image_pixels,
            if a.allow_image_urls { "fetched" } else { "off (--allow-image-urls)" }
        );
    }
    if served.template.is_none() {
        eprintln!(
            "note: the model has no chat template; the chat endpoints answer 400 (use --chat-template-file)"
        );
    }
    let engine = EngineHandle::start(
        opened.model.clone(),
        served.tokenizer.clone(),
        EngineConfig {
            max_running: a.max_running,
            max_batch_tokens: a.max_batch_tokens,
            n_ctx,
            max_queue: a.max_queue,
            kv_type,
            kv_pool_tokens: Some(pool),
            kv_block_size: a.kv_block_size,
            prefix_cache: prefix,
            spec: a.spec.config(&opened, a.load_mode.into())?,
            vision: opened.vision.clone(),
        },
    )
    .context("starting the engine")?;
    let cfg = ServerConfig {
        api_key: a.api_key.clone(),
        max_body_bytes: a.max_body_bytes,
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
        images: ImageConfig {
            max_images: a.max_images,
            limits: kapitsa_image::Limits {
                max_bytes: a.max_image_bytes,
                max_pixels: a.max_image_pixels,
            },
            allow_urls: a.allow_image_urls,
            url_timeout: Duration::from_secs(a.image_url_timeout.max(1)),
        },
        ..ServerConfig::default()
    };
    let name = served.name.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("listening on {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        eprintln!(
            "kapitsa: serving '{name}' ({} arch, context {n_ctx}, {} slots, KV pool {pool} tokens = {:.0} MiB) on http://{addr}",
            opened.arch,
            a.max_running,
            (pool * token_bytes) as f64 / (1u64 << 20) as f64
        );
        Server::new(Arc::new(engine), served, cfg)
            .run(listener, async {
                kapitsa_server::shutdown_signal().await;
                eprintln!("kapitsa: shutting down");
            })
            .await
            .context("serving")?;
        eprintln!("kapitsa: stopped");
        anyhow::Ok(())
    })
}

/// Bytes the KV cache may take, and how that was worked out (for stderr). On a GPU: what
/// the backend may still allocate once the weights are in (under `--gpu-memory` when set),
/// less every slot's recurrent states and a reserve for a step's activations (1 GiB plus 128
/// bytes per batch token and model dimension), 90% of the rest. On the CPU: a quarter of the
/// host's available memory. `None` when neither is known.
fn kv_memory(
    opened: &kapitsa_engine::OpenedModel,
    max_running: usize,
    max_batch_tokens: usize,
) -> Option<(usize, String)> {
    use kapitsa_backend::gib;
    let spec = opened.model.spec();
    let Some(m) = opened.backend.memory() else {
        let mem = available_memory()?;
        return Some((
            mem / 4,
            format!("a quarter of the {} of available memory", gib(mem)),
        ));
    };
    let states = max_running.saturating_mul(spec.cache_layout().slot_state_bytes());
    let activations = max_batch_tokens.saturating_mul(spec.n_embd);
    Some(gpu_kv_memory(&m, states, activations, max_running))
}

/// [`kv_memory`] on a GPU whose memory `m` reports: what the backend may still allocate, less
/// `states` bytes of recurrent states and a reserve for activations (1 GiB plus 128 bytes
/// per one of `activations`, the batch tokens times the model dimension), 90% of the rest;
/// and the reason, for stderr.
fn gpu_kv_memory(
    m: &kapitsa_backend::DeviceMemory,
    states: usize,
    activations: usize,
    max_running: usize,
) -> (usize, String) {
    use kapitsa_backend::gib;
    let reserve = (1usize << 30).saturating_add(activations.saturating_mul(128));
    let left = m.available.saturating_sub(states).saturating_sub(reserve);
    let kv = left / 10 * 9;
    let budget = match m.budget {
        Some(b) => format!(" of --gpu-memory {}", gib(b)),
        None => String::new(),
    };
    (
        kv,
        format!(
            "{} of the {} the GPU has left{budget} after the weights, less {} of recurrent states for {max_running} slots and {} for activations",
            gib(kv),
            gib(m.available),
            gib(states),
            gib(reserve)
        ),
    )
}

/// Context used when none is given: the model's training context (4096 when the model does
/// not say), capped by what `kv_mem` ([`kv_memory`]: bytes for the KV cache and where they
/// come from) holds at `token_bytes` of KV cache per token (rounded down to whole blocks of
/// `block` tokens, at least 2048); and the reason, for stderr.
fn default_context(
    n_ctx_train: usize,
    token_bytes: usize,
    kv_mem: Option<&(usize, String)>,
    block: usize,
) -> (usize, String) {
    const UNKNOWN: usize = 4096;
    const FLOOR: usize = 2048;
    let (train, mut why) = if n_ctx_train == 0 {
        (
            UNKNOWN,
            format!("the model does not give its training context: {UNKNOWN}"),
        )
    } else {
        (n_ctx_train, "the model's training context".to_string())
    };
    let Some((mem, whence)) = kv_mem else {
        return (train, why);
    };
    let fits = mem / token_bytes.max(1);
    let fits = (fits / block.max(1)) * block.max(1);
    if fits < train {
        let n = fits.max(FLOOR.min(train));
        why = format!(
            "the training context of {train} capped by memory: {whence} holds {n} tokens of KV cache at {token_bytes} bytes each"
        );
        return (n, why);
    }
    (train, why)
}

/// `MemAvailable` from /proc/meminfo, in bytes (None where that file does not exist).
fn available_memory() -> Option<usize> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_context_is_the_training_context_within_memory() {
        // Qwen2.5-Coder-0.5B: 32K context, 12 KiB of f16 KV per token.
        let mem = |b: usize| (b, "test memory".to_string());
        let (n, why) = default_context(32768, 12288, Some(&mem(4 << 30)), 16);
        assert_eq!(n, 32768, "{why}");
        assert!(why.contains("training context"));
        // 256 MiB holds 21845 tokens, rounded down to blocks.
        let (n, why) = default_context(32768, 12288, Some(&mem(1 << 28)), 16);
        assert_eq!(n, 21840, "{why}");
        assert!(why.contains("capped by memory") && why.contains("test memory"));
        assert_eq!(default_context(0, 12288, None, 16).0, 4096);
        assert_eq!(
            default_context(32768, 12288, Some(&mem(1 << 18)), 16).0,
            2048
        );
    }

    #[test]
    fn gpu_kv_memory_leaves_the_states_and_a_reserve() {
        const G: usize = 1 << 30;
        let m = kapitsa_backend::DeviceMemory {
            available: 10 * G,
            budget: Some(24 * G),
            ..Default::default()
        };
        // 2 GiB of states, 1 GiB + 512 x 2048 x 128 bytes (128 MiB) of reserve: 90% of the rest
        let (kv, why) = gpu_kv_memory(&m, 2 * G, 512 * 2048, 16);
        assert_eq!(kv, (10 * G - 2 * G - G - (128 << 20)) / 10 * 9);
        assert!(
            why.contains("--gpu-memory 24.0 GiB") && why.contains("16 slots"),
            "{why}"
        );
        // nothing left: no KV memory, no panic
        let small = kapitsa_backend::DeviceMemory {
            available: G / 2,
            ..m
        };
        assert_eq!(gpu_kv_memory(&small, 2 * G, 512 * 2048, 16).0, 0);
    }
}
