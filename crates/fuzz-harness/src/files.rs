//! Targets over model files: GGUF bytes, a GGUF header on real tensor data (load and one
//! forward pass), an HF/MLX directory, `tokenizer.json`, chat templates.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kapitsa_backend::Backend;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_base::pool::RayonPool;
use kapitsa_formats::GgufFile;
use kapitsa_models::registry::load_from_source;
use kapitsa_models::source::SourceKind;
use kapitsa_models::{BatchInputs, KvType, LoadOptions, ModelSource};
use kapitsa_text::{ChatTemplate, Tokenizer};

/// GGUF fixtures whose headers the `gguf_model` target fuzzes (one per architecture family).
pub(crate) const GGUF_MODELS: [&str; 4] = [
    "tiny/qwen2-a/model-f32.gguf",
    "tiny/qwen3moe-a/model-f32.gguf",
    "tiny/qwen35moe-a/model-f32.gguf",
    "tiny/nemotronh-latent-a/model-f32.gguf",
];

/// HF / MLX fixture directories whose `config.json` and safetensors header `hf_dir` fuzzes,
/// with their `model.safetensors`.
pub(crate) const HF_MODELS: [(&str, &str); 4] = [
    ("tiny/qwen2-a", "tiny/qwen2-a/model.safetensors"),
    ("tiny/qwen35moe-a", "tiny/qwen35moe-a/model.safetensors"),
    (
        "tiny/nemotronh-moe-b",
        "tiny/nemotronh-moe-b/model.safetensors",
    ),
    (
        "tiny/qwen35moe-a/mlx-4bit",
        "tiny/qwen35moe-a/mlx-4bit/model.safetensors",
    ),
];

/// A one-thread CPU backend, made once.
fn backend() -> Option<Arc<dyn Backend>> {
    static BACKEND: OnceLock<Option<Arc<dyn Backend>>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            let pool = RayonPool::new(1).ok()?;
            Some(Arc::new(CpuBackend::new(Box::new(pool))) as Arc<dyn Backend>)
        })
        .clone()
}

/// Fixture files read so far: (path under `tests/fixtures`, contents).
type FixtureCache = Vec<(&'static str, &'static [u8])>;

/// The bytes of a fixture file, read once.
pub(crate) fn fixture_bytes(rel: &'static str) -> &'static [u8] {
    static CACHE: OnceLock<std::sync::Mutex<FixtureCache>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, b)) = cache.iter().find(|(r, _)| *r == rel) {
        return b;
    }
    let bytes: &'static [u8] = std::fs::read(crate::fixtures().join(rel))
        .unwrap_or_default()
        .leak();
    cache.push((rel, bytes));
    bytes
}

/// Every accessor of an opened GGUF file, on every key and tensor.
fn walk_gguf(g: &GgufFile) {
    let _ = (g.version(), g.alignment(), g.data_offset(), g.file_len());
    let _ = g.architecture();
    for (key, value) in g.metadata() {
        let _ = (value.type_name(), value.as_integer(), value.as_float());
        let _ = (value.as_str(), value.as_array().map(|a| a.to_integers()));
        let _ = (
            g.get_u32(key),
            g.get_u64(key),
            g.get_i64(key),
            g.get_f32(key),
        );
        let _ = (g.get_str(key), g.get_bool(key), g.get_str_array(key));
        let _ = (
            g.get_i32_array(key),
            g.get_u32_array(key),
            g.get_f32_array(key),
        );
        let _ = (g.get_bool_array(key), g.opt_u32(key), g.opt_f32(key));
        let _ = (g.opt_bool(key), g.opt_str(key), g.per_layer_u32(key, 4));
    }
    for info in g.tensor_infos() {
        let _ = (info.n_elements(), info.ne());
        let _ = g.tensor(&info.name).map(|t| t.data.len());
    }
}

/// The GGUF tokenizer and chat template of a file, built and used once; whether both worked.
fn gguf_text(g: &GgufFile) -> bool {
    let tokenizer = match kapitsa_engine::loader::gguf_vocab(g) {
        Ok(vocab) => match Tokenizer::from_gguf_vocab(&vocab) {
            Ok(tok) => {
                use_tokenizer(&tok);
                true
            }
            Err(_) => false,
        },
        Err(_) => false,
    };
    let template = match g.get_str("tokenizer.chat_template") {
        Ok(src) => render_template(src),
        Err(_) => false,
    };
    tokenizer && template
}

/// Encode and decode a few texts.
fn use_tokenizer(tok: &Tokenizer) {
    for text in [
        "Hello, world! <|im_start|>user\n12345 ",
        "",
        "\u{0}\u{ffff} é 日本",
    ] {
        for special in [false, true] {
            if let Ok(ids) = tok.encode(text, special, special) {
                let _ = tok.decode(&ids, special);
            }
        }
    }
    let _ = tok.decode(&[0, 1, u32::MAX], true);
}

/// Compile `src` as a chat template and render a conversation with tools through it; whether
/// it rendered.
fn render_template(src: &str) -> bool {
    let Ok(t) = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())) else {
        return false;
    };
    let messages = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 3.5}"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}
    ]);
    let tools = serde_json::json!([{"type": "function", "function": {
        "name": "weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]);
    let extra = serde_json::json!({"enable_thinking": false});
    let with_tools = t.render(&messages, Some(&tools), true, Some(&extra));
    let simple = serde_json::json!([{"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]);
    let plain = t.render(&simple, None, true, None);
    with_tools.is_ok() || plain.is_ok()
}

/// `gguf`: arbitrary bytes as a GGUF file, through every accessor, the GGUF tokenizer and the
/// chat template it carries.
pub fn gguf(data: &[u8]) -> bool {
    match GgufFile::from_bytes(data.to_vec()) {
        Ok(g) => {
            walk_gguf(&g);
            gguf_text(&g)
        }
        Err(_) => false,
    }
}

/// `gguf_model`: byte 0 picks a fixture of [`GGUF_MODELS`]; the rest is a GGUF header (up to
/// the data section), followed by that fixture's real tensor data. Opened, loaded on the CPU
/// backend and run on three tokens.
pub fn gguf_model(data: &[u8]) -> bool {
    let Some((&pick, header)) = data.split_first() else {
        return false;
    };
    let Some(tensor_data) = gguf_tensor_data(pick as usize % GGUF_MODELS.len()) else {
        return false;
    };
    let mut bytes = header.to_vec();
    bytes.resize(header.len().next_multiple_of(32), 0);
    bytes.extend_from_slice(tensor_data);
    let Ok(g) = GgufFile::from_bytes(bytes) else {
        return false;
    };
    let text = gguf_text(&g);
    let source = ModelSource::from_kind(SourceKind::Gguf(g), PathBuf::from("fuzz.gguf"));
    run_model(source) && text
}

/// The data section of fixture `i` of [`GGUF_MODELS`] (found once per fixture).
fn gguf_tensor_data(i: usize) -> Option<&'static [u8]> {
    static STARTS: OnceLock<Vec<Option<usize>>> = OnceLock::new();
    let starts = STARTS.get_or_init(|| {
        GGUF_MODELS
            .iter()
            .map(|rel| {
                let g = GgufFile::from_bytes(fixture_bytes(rel).to_vec()).ok()?;
                usize::try_from(g.data_offset()).ok()
            })
            .collect()
    });
    fixture_bytes(GGUF_MODELS[i]).get((*starts.get(i)?)?..)
}

/// Load `source` and run one forward pass over three tokens; whether it ran.
fn run_model(source: ModelSource) -> bool {
    let Some(be) = backend() else {
        return false;
    };
    let Ok(loaded) = load_from_source(source, be, &LoadOptions::default()) else {
        return false;
    };
    let model = loaded.model;
    let n_vocab = model.spec().n_vocab.max(1) as u32;
    let Ok(mut cache) = kapitsa_models::new_cache(model.as_ref(), 1, 16, KvType::F32) else {
        return false;
    };
    let tokens = [1 % n_vocab, 7 % n_vocab, 3 % n_vocab];
    let batch = BatchInputs::single(0, &tokens, 0, vec![0, 1, 2]);
    model.forward(&batch, &mut cache).is_ok()
}

/// `hf_dir`: byte 0 picks a directory of [`HF_MODELS`]; the rest is `config.json`, a NUL byte,
/// and the JSON header of `model.safetensors`, whose tensor data is the fixture's. Written to a
/// temporary directory (with the fixture's other JSON files), loaded and run on three tokens.
pub fn hf_dir(data: &[u8]) -> bool {
    let Some((&pick, rest)) = data.split_first() else {
        return false;
    };
    let (rel, st_file) = HF_MODELS[pick as usize % HF_MODELS.len()];
    let (config, header) = match rest.iter().position(|&b| b == 0) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let src_dir = crate::fixtures().join(rel);
    let Some(tensor_data) = safetensors_data(fixture_bytes(st_file)) else {
        return false;
    };
    let Ok(dir) = tempfile::tempdir() else {
        return false;
    };
    let mut st = (header.len() as u64).to_le_bytes().to_vec();
    st.extend_from_slice(header);
    st.extend_from_slice(tensor_data);
    let written = std::fs::write(dir.path().join("config.json"), config)
        .and_then(|()| std::fs::write(dir.path().join("model.safetensors"), st));
    if written.is_err() {
        return false;
    }
    for name in ["model.safetensors.index.json", "generation_config.json"] {
        let _ = std::fs::copy(src_dir.join(name), dir.path().join(name));
    }
    match ModelSource::open(dir.path()) {
        Ok(source) => run_model(source),
        Err(_) => false,
    }
}

/// The tensor data of a safetensors file (everything after its header).
pub(crate) fn safetensors_data(bytes: &[u8]) -> Option<&[u8]> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let start = 8usize.checked_add(usize::try_from(n).ok()?)?;
    bytes.get(start..)
}

/// `tokenizer_json`: arbitrary bytes as `tokenizer.json`, then encoding and decoding.
pub fn tokenizer_json(data: &[u8]) -> bool {
    let cfg = serde_json::json!({"bos_token": "<s>", "eos_token": {"content": "</s>"}});
    match Tokenizer::from_tokenizer_json_bytes(data, Some(&cfg), None) {
        Ok(tok) => {
            use_tokenizer(&tok);
            true
        }
        Err(_) => false,
    }
}

/// `chat_template`: arbitrary (UTF-8) bytes as a chat template, rendered on a conversation with
/// reasoning, tool calls and tools.
pub fn chat_template(data: &[u8]) -> bool {
    match std::str::from_utf8(data) {
        Ok(src) => render_template(src),
        Err(_) => false,
    }
}
