//! Architecture registry: one line per architecture, mapping its GGUF name to a loader.

use std::path::Path;
use std::sync::Arc;

use kapitsa_backend::Backend;
use kapitsa_formats::{LoadMode, OpenOptions};

use crate::{CausalLm, ModelError, ModelSource, Result};

type LoadFn = fn(&ModelSource, Arc<dyn Backend>) -> Result<Arc<dyn CausalLm>>;

/// `(architecture, loader)`; HF `model_type`s are mapped to these names by
/// [`ModelSource::arch`].
const REGISTRY: &[(&str, LoadFn)] = &[
    ("qwen2", |s, b| {
        Ok(Arc::new(crate::qwen2::Qwen2::load(s, b)?))
    }),
    ("qwen3", |s, b| {
        Ok(Arc::new(crate::qwen3::Qwen3::load(s, b)?))
    }),
    ("qwen3moe", |s, b| {
        Ok(Arc::new(crate::qwen3moe::Qwen3Moe::load(s, b)?))
    }),
    ("qwen35moe", |s, b| {
        Ok(Arc::new(crate::qwen35::Qwen35::load(s, b, true)?))
    }),
    ("qwen35", |s, b| {
        Ok(Arc::new(crate::qwen35::Qwen35::load(s, b, false)?))
    }),
    ("nemotron_h", |s, b| {
        Ok(Arc::new(crate::nemotron_h::NemotronH::load(s, b)?))
    }),
    ("nemotron_h_moe", |s, b| {
        Ok(Arc::new(crate::nemotron_h::NemotronH::load(s, b)?))
    }),
];

/// Names of the supported architectures.
pub fn supported_archs() -> Vec<&'static str> {
    REGISTRY.iter().map(|(a, _)| *a).collect()
}

/// Options for [`load_model`].
#[derive(Default)]
pub struct LoadOptions<'a> {
    /// Called with `(bytes_done, bytes_total)` while weights are read into memory.
    pub progress: Option<&'a dyn Fn(u64, u64)>,
    /// How the weight files are held (default [`LoadMode::Auto`]: a copy in memory when it
    /// fits in half the available RAM, else a memory map).
    pub load_mode: LoadMode,
}

/// A model ready to run, with the source it came from (for tokenizer and template metadata).
pub struct LoadedModel {
    /// The model.
    pub model: Arc<dyn CausalLm>,
    /// The opened file(s).
    pub source: ModelSource,
    /// Architecture name.
    pub arch: String,
}

/// Open `path` and build its model on `backend`.
pub fn load_model(
    path: &Path,
    backend: Arc<dyn Backend>,
    opts: &LoadOptions<'_>,
) -> Result<LoadedModel> {
    let open = OpenOptions {
        mode: opts.load_mode,
        progress: opts.progress,
    };
    let source = ModelSource::open_with(path, &open)?;
    load_from_source(source, backend, opts)
}

/// Build the model of an opened source.
pub fn load_from_source(
    source: ModelSource,
    backend: Arc<dyn Backend>,
    opts: &LoadOptions<'_>,
) -> Result<LoadedModel> {
    let arch = source.arch()?;
    let load = REGISTRY
        .iter()
        .find(|(a, _)| *a == arch)
        .map(|(_, f)| *f)
        .ok_or_else(|| ModelError::UnsupportedArch(arch.clone(), supported_archs().join(", ")))?;
    // (A copy in memory was read whole when the source was opened.)
    if source.load_mode() != LoadMode::Memory {
        prefetch(&source, opts.progress);
    }
    let model = load(&source, backend)?;
    Ok(LoadedModel {
        model,
        source,
        arch,
    })
}

/// Read every tensor byte once so weights are resident before the first token, reporting
/// progress. Reads one byte per 4 KiB page.
fn prefetch(source: &ModelSource, progress: Option<&dyn Fn(u64, u64)>) {
    let total = source.total_tensor_bytes();
    let mut done = 0u64;
    let mut sink = 0u8;
    let mut visit = |data: &[u8]| {
        for chunk in data.chunks(1 << 22) {
            for page in chunk.iter().step_by(4096) {
                sink ^= *page;
            }
            done += chunk.len() as u64;
            if let Some(p) = progress {
                p(done, total);
            }
        }
    };
    if let Some(g) = source.gguf() {
        for t in g.tensor_infos() {
            if let Some(v) = g.tensor(&t.name) {
                visit(v.data);
            }
        }
    } else if let Some(h) = source.hf() {
        for n in h.tensor_names() {
            if let Some(v) = h.tensor(n) {
                visit(v.data);
            }
        }
    }
    std::hint::black_box(sink);
}
