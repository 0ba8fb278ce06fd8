//! Opening a model: the one path from a model file or folder and a `--device` choice to a
//! model ready to run on a backend, with its tokenizer, chat template, identity and a line
//! describing it. `kapitsa run`, `chat`, `logits`, `bench` and `serve` all load through
//! [`open_model`]; the backend comes from [`make_backend`] and nowhere else.
//!
//! Order: the backend first (a bad `--device` fails at once), then a `chat_template_file`
//! (before the slow load), then the weights, the tokenizer and the identity. Every error says
//! what was being done and names the path.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kapitsa_backend::Backend;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_models::nemotron_vision::NemotronVision;
use kapitsa_models::qwen35_vision::Qwen35Vision;
use kapitsa_models::vision::VisionTower;
use kapitsa_models::{CausalLm, LoadMode, LoadOptions, ModelSource};
use kapitsa_text::{ChatTemplate, Tokenizer};

use crate::device::{Device, DeviceChoice};
use crate::loader::{chat_template_source, compile_chat_template, model_identity, tokenizer_for};
use crate::{EngineError, Result};

/// Why `auto` falls back to the CPU in this build.
const NO_GPU_REASON: &str = "this build has no CUDA support";

/// Largest context [`OpenedModel::context_size`] picks by itself (a model's training context
/// can be far larger than what a machine should allocate unasked).
pub const MAX_DEFAULT_CONTEXT: usize = 32768;

/// How to open a model.
#[derive(Clone, Copy, Default)]
pub struct OpenOptions<'a> {
    /// Device to run on (default `auto`: a usable GPU, else the CPU).
    pub device: DeviceChoice,
    /// Host compute threads of the CPU backend (0 = one per core).
    pub threads: usize,
    /// How the weight files are held (memory map, a copy in memory, or chosen by size).
    pub load_mode: LoadMode,
    /// Called with `(bytes_done, bytes_total)` while weights are read into memory (a progress
    /// bar).
    pub progress: Option<&'a dyn Fn(u64, u64)>,
    /// A Jinja chat template file used instead of the model's own template.
    pub chat_template_file: Option<&'a Path>,
    /// A llama.cpp mmproj GGUF with the vision tower of a GGUF language model (an HF folder
    /// carries its own tower).
    pub mmproj: Option<&'a Path>,
    /// GPU memory budget in bytes (`--gpu-memory`): the most the GPU may hold for this
    /// process, its CUDA context included; ignored on the CPU.
    pub gpu_memory: Option<usize>,
}

impl std::fmt::Debug for OpenOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenOptions")
            .field("device", &self.device)
            .field("threads", &self.threads)
            .field("load_mode", &self.load_mode)
            .field("progress", &self.progress.is_some())
            .field("chat_template_file", &self.chat_template_file)
            .field("mmproj", &self.mmproj)
            .field("gpu_memory", &self.gpu_memory)
            .finish()
    }
}

/// A model ready to run, with everything the CLI and the server need beside it.
pub struct OpenedModel {
    /// The path it was opened from (a GGUF file or a model folder).
    pub path: PathBuf,
    /// The model; its weights live where `backend` keeps them.
    pub model: Arc<dyn CausalLm>,
    /// The backend the model computes on.
    pub backend: Arc<dyn Backend>,
    /// Which device, for stderr: `cpu`, or `cpu (no usable GPU: <reason>)` when `auto` fell
    /// back to the CPU.
    pub device: String,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Source text of the chat template: the `chat_template_file` if one was given, else the
    /// model's own (GGUF metadata, `tokenizer_config.json` or `chat_template.jinja`); `None`
    /// when there is none. Compile it with [`OpenedModel::chat_template`].
    pub chat_template_source: Option<String>,
    /// The opened files (metadata for tools such as `bench`).
    pub source: ModelSource,
    /// Architecture name (`qwen2`, `qwen35moe`, ...).
    pub arch: String,
    /// Identity of the weight files for prefix-cache fingerprints (see
    /// [`crate::loader::model_identity`]).
    pub identity: String,
    /// One line for stderr: architecture, layer kinds, vocabulary and backend, e.g.
    /// `qwen2 (24 layers: 24 attention; vocab 151936) on cpu avx512, 8 threads`.
    pub description: String,
    /// The vision tower, when the checkpoint has one (Qwen3.5/3.6 `model.visual.*`), on the
    /// model's backend: give it to [`crate::EngineConfig::vision`].
    pub vision: Option<Arc<dyn VisionTower>>,
    /// The image processor's settings of the checkpoint as JSON text, when it has them
    /// (`preprocessor_config.json`, or `processor_config.json`'s `image_processor`; for a
    /// GGUF with an mmproj, those files beside the mmproj).
    pub preprocessor_config: Option<String>,
}

impl std::fmt::Debug for OpenedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedModel")
            .field("path", &self.path)
            .field("device", &self.device)
            .field("description", &self.description)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl OpenedModel {
    /// The chat template compiled (`None` when the model has none). Compiled on demand, so a
    /// model whose template does not compile still runs raw prompts.
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>> {
        self.chat_template_source
            .as_deref()
            .map(|src| compile_chat_template(src, &self.tokenizer))
            .transpose()
    }

    /// The context per sequence for a `--ctx-size` of `requested` tokens: `requested`, or
    /// for 0 the model's training context capped at [`MAX_DEFAULT_CONTEXT`].
    pub fn context_size(&self, requested: usize) -> usize {
        if requested == 0 {
            self.model.spec().n_ctx_train.min(MAX_DEFAULT_CONTEXT)
        } else {
            requested
        }
    }
}

/// `e` with what was being done: `"{context}: {e}"`.
fn context<E>(what: impl Into<String>) -> impl FnOnce(E) -> EngineError
where
    E: std::error::Error + Send + Sync + 'static,
{
    let what = what.into();
    move |e| EngineError::Open {
        context: what,
        source: Box::new(e),
    }
}

/// The backend for `device` with `threads` host compute threads (0 = one per core), and
/// which device it is, for stderr: `cuda[:N]` is that GPU or [`EngineError::Device`] with
/// the one-line reason (no driver, no GPU, a build without the `cuda` feature); `auto` is GPU
/// 0 when it works, else the CPU (`"cpu (no usable GPU: <reason>)"`); `cpu` is the CPU.
/// `gpu_memory` is a GPU's memory budget ([`OpenOptions::gpu_memory`]).
pub fn make_backend(
    device: DeviceChoice,
    threads: usize,
    gpu_memory: Option<usize>,
) -> Result<(Arc<dyn Backend>, String)> {
    let which = match device {
        DeviceChoice::Exact(Device::Cuda(n)) => {
            let be = kapitsa_backend_cuda::open(n, gpu_memory)
                .map_err(|e| EngineError::Device(e.to_string()))?;
            return Ok((be, format!("cuda:{n}")));
        }
        DeviceChoice::Exact(Device::Cpu) => "cpu".to_string(),
        DeviceChoice::Auto => match kapitsa_backend_cuda::open(0, gpu_memory) {
            Ok(be) => return Ok((be, "cuda:0".to_string())),
            Err(_) if !cfg!(feature = "cuda") => format!("cpu (no usable GPU: {NO_GPU_REASON})"),
            Err(e) => format!("cpu (no usable GPU: {e})"),
        },
    };
    let pool =
        kapitsa_base::pool::cpu_pool(threads).map_err(context("starting the thread pool"))?;
    let be = CpuBackend::from_env(pool).map_err(|e| EngineError::Device(e.to_string()))?;
    Ok((Arc::new(be), which))
}

/// On a GPU backend, [`EngineError::Device`] before loading when the weight file at `path` (a
/// GGUF: its size is about what its tensors take on the device) is larger than the memory
/// the backend may still allocate, naming the budget when one is set. Folders (whose weights
/// may be converted at load) are left to the allocator's own out-of-memory error.
fn check_weights_fit(path: &Path, backend: &dyn Backend) -> Result<()> {
    let Some(mem) = backend.memory() else {
        return Ok(());
    };
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(());
    };
    let need = usize::try_from(meta.len()).unwrap_or(usize::MAX);
    if !meta.is_file() || need <= mem.available {
        return Ok(());
    }
    let limit = match mem.budget {
        Some(b) => format!(
            "--gpu-memory {} leaves {} after the {} the device already holds",
            kapitsa_backend::gib(b),
            kapitsa_backend::gib(mem.available),
            kapitsa_backend::gib(mem.base)
        ),
        None => format!(
            "{} is free on the device",
            kapitsa_backend::gib(mem.available)
        ),
    };
    Err(EngineError::Device(format!(
        "{} needs about {} of GPU memory for its weights, but {limit}",
        path.display(),
        kapitsa_backend::gib(need)
    )))
}

/// Open the model at `path` (a GGUF file, or a Hugging Face / MLX model folder) on the
/// device `opts` chooses: its backend, weights, tokenizer, chat template source and identity.
pub fn open_model(path: &Path, opts: &OpenOptions<'_>) -> Result<OpenedModel> {
    let (backend, device) = make_backend(opts.device, opts.threads, opts.gpu_memory)?;
    check_weights_fit(path, &*backend)?;
    let template_file = match opts.chat_template_file {
        Some(p) => Some(std::fs::read_to_string(p).map_err(context(format!(
            "reading the chat template {}",
            p.display()
        )))?),
        None => None,
    };
    let loaded = kapitsa_models::load_model(
        path,
        backend.clone(),
        &LoadOptions {
            progress: opts.progress,
            load_mode: opts.load_mode,
        },
    )
    .map_err(context(format!("loading {}", path.display())))?;
    let tokenizer = tokenizer_for(&loaded.source).map_err(context(format!(
        "building the tokenizer of {}",
        path.display()
    )))?;
    let chat_template_source = template_file.or_else(|| chat_template_source(&loaded.source));
    let identity = model_identity(path).map_err(context(format!("reading {}", path.display())))?;
    let mut description = describe(&*loaded.model, &loaded.arch, &*backend);
    let vision = load_vision(&loaded, &tokenizer, opts.mmproj, path, &backend)?;
    if let Some(v) = &vision {
        description.push_str(&format!("; {}", v.describe()));
    }
    // the checkpoint folder's, else (a GGUF with an mmproj) the mmproj's folder's
    let preprocessor_config = if path.is_dir() {
        image_processor_config(path)
    } else {
        opts.mmproj
            .and_then(Path::parent)
            .and_then(image_processor_config)
    };
    Ok(OpenedModel {
        path: path.to_path_buf(),
        model: loaded.model,
        backend,
        device,
        tokenizer: Arc::new(tokenizer),
        chat_template_source,
        source: loaded.source,
        arch: loaded.arch,
        identity,
        description,
        vision,
        preprocessor_config,
    })
}

/// The vision tower: the mmproj's when one is given (Qwen3.5/3.6 language models, which take
/// multimodal rotary positions), else the checkpoint's own (HF Qwen3.5/3.6 `model.visual.*`,
/// Nemotron omni `vision_model.*`), `None` when there is none.
fn load_vision(
    loaded: &kapitsa_models::LoadedModel,
    tok: &Tokenizer,
    mmproj: Option<&Path>,
    path: &Path,
    backend: &Arc<dyn Backend>,
) -> Result<Option<Arc<dyn VisionTower>>> {
    let takes_images = loaded.model.spec().mrope.is_some();
    let Some(mp) = mmproj else {
        let what = format!("loading the vision tower of {}", path.display());
        if loaded.arch.starts_with("nemotron_h") {
            let v = NemotronVision::load(&loaded.source, backend.clone()).map_err(context(what))?;
            return Ok(v.map(|v| Arc::new(v) as Arc<dyn VisionTower>));
        }
        if !takes_images {
            return Ok(None);
        }
        let v = Qwen35Vision::load(&loaded.source, backend.clone()).map_err(context(what))?;
        return Ok(v.map(|v| Arc::new(v) as Arc<dyn VisionTower>));
    };
    let what = format!("loading the vision tower {}", mp.display());
    let fail = |m: String| context(what.clone())(kapitsa_models::ModelError::Config(m));
    if !takes_images {
        return Err(fail(format!(
            "the {} model takes no images (a vision tower needs Qwen3.5/3.6)",
            loaded.arch
        )));
    }
    let id = |t: &str| {
        tok.token_to_id(t)
            .ok_or_else(|| fail(format!("the vocabulary has no {t} token")))
    };
    let tokens = kapitsa_models::vision::VisionTokens {
        image: id("<|image_pad|>")?,
        start: id("<|vision_start|>")?,
        end: id("<|vision_end|>")?,
    };
    let src = ModelSource::open(mp).map_err(context(what.clone()))?;
    let v = Qwen35Vision::load_mmproj(&src, tokens, backend.clone()).map_err(context(what))?;
    Ok(Some(Arc::new(v)))
}

/// The image processor's settings in the model folder `dir`, as JSON text:
/// `preprocessor_config.json`, or the `image_processor` object of `processor_config.json`
/// (where transformers 5 writes them).
fn image_processor_config(dir: &Path) -> Option<String> {
    if let Ok(t) = std::fs::read_to_string(dir.join("preprocessor_config.json")) {
        return Some(t);
    }
    let t = std::fs::read_to_string(dir.join("processor_config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&t).ok()?;
    Some(v.get("image_processor")?.to_string())
}

/// Open a draft model for speculative decoding beside `target`: on the target's backend (so
/// both compute on the same device and threads), checked to tokenize like the target (the
/// draft's proposals are the target's token ids). The engine checks the rest (vocabulary
/// size, attention-only layers) when it starts.
pub fn open_draft_model(
    path: &Path,
    target: &OpenedModel,
    load_mode: LoadMode,
) -> Result<Arc<dyn CausalLm>> {
    let loaded = kapitsa_models::load_model(
        path,
        target.backend.clone(),
        &LoadOptions {
            progress: None,
            load_mode,
        },
    )
    .map_err(context(format!(
        "loading the draft model {}",
        path.display()
    )))?;
    let tok = tokenizer_for(&loaded.source).map_err(context(format!(
        "building the tokenizer of the draft model {}",
        path.display()
    )))?;
    let probe = "def main():\n    print(\"Hello, world\") # 12345 ünïcode 語";
    let same = tok.vocab_size() == target.tokenizer.vocab_size()
        && matches!(
            (tok.encode(probe, false, false), target.tokenizer.encode(probe, false, false)),
            (Ok(a), Ok(b)) if a == b
        );
    if !same {
        return Err(EngineError::BadRequest(format!(
            "the draft model {} does not share the model's tokenizer",
            path.display()
        )));
    }
    Ok(loaded.model)
}

/// `qwen35moe (40 layers: 10 attention, 30 recurrent, +1 MTP kept; vocab 248320) on <backend>`.
fn describe(model: &dyn CausalLm, arch: &str, backend: &dyn Backend) -> String {
    let spec = model.spec();
    let mut kinds = format!("{} attention", spec.n_attention_layers());
    if spec.n_recurrent_layers() > 0 {
        kinds.push_str(&format!(", {} recurrent", spec.n_recurrent_layers()));
    }
    if spec.n_mtp_layers > 0 {
        kinds.push_str(&format!(", +{} MTP kept", spec.n_mtp_layers));
    }
    format!(
        "{arch} ({} layers: {kinds}; vocab {}) on {}",
        spec.layers.len(),
        spec.n_vocab,
        backend.describe()
    )
}

/// Without the `cuda` feature (with it, the answer depends on the machine's GPU).
#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;

    #[test]
    fn backends_by_device() {
        let (be, which) = make_backend(DeviceChoice::Auto, 1, None).unwrap();
        assert_eq!(which, "cpu (no usable GPU: this build has no CUDA support)");
        assert!(be.describe().contains("cpu"), "{}", be.describe());
        let (_, which) = make_backend(DeviceChoice::Exact(Device::Cpu), 1, None).unwrap();
        assert_eq!(which, "cpu");
        for n in [0, 3] {
            let e = make_backend(DeviceChoice::Exact(Device::Cuda(n)), 1, None)
                .err()
                .unwrap()
                .to_string();
            assert_eq!(e, kapitsa_backend_cuda::NOT_BUILT);
        }
    }
}
