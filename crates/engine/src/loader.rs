//! Tokenizer and chat template of an opened model, from GGUF metadata or the files of an HF
//! directory.

use kapitsa_formats::{GgufFile, GgufValue};
use kapitsa_models::ModelSource;
use kapitsa_text::{ChatTemplate, GgufVocab, Tokenizer};

use crate::{EngineError, Result};

/// Build the tokenizer of `src`.
pub fn tokenizer_for(src: &ModelSource) -> Result<Tokenizer> {
    if let Some(g) = src.gguf() {
        return Ok(Tokenizer::from_gguf_vocab(&gguf_vocab(g)?)?);
    }
    let h = src
        .hf()
        .ok_or_else(|| EngineError::BadRequest("unknown model source".into()))?;
    let path = h.tokenizer_json_path().ok_or_else(|| {
        EngineError::BadRequest(format!("{} has no tokenizer.json", src.path().display()))
    })?;
    Ok(Tokenizer::from_tokenizer_json(
        path,
        h.tokenizer_config(),
        h.generation_config(),
    )?)
}

/// Read the `tokenizer.ggml.*` keys.
pub fn gguf_vocab(g: &GgufFile) -> Result<GgufVocab> {
    let fe = |e: kapitsa_formats::FormatError| EngineError::Model(e.into());
    let opt_u32 = |k: &str| g.opt_u32(k).map_err(fe);
    let opt_bool = |k: &str| match g.get(k) {
        Some(GgufValue::Bool(b)) => Some(*b),
        _ => None,
    };
    Ok(GgufVocab {
        model: g.get_str("tokenizer.ggml.model").map_err(fe)?.to_string(),
        pre: g.get_str("tokenizer.ggml.pre").ok().map(str::to_string),
        tokens: g
            .get_str_array("tokenizer.ggml.tokens")
            .map_err(fe)?
            .iter()
            .map(|s| s.to_string())
            .collect(),
        token_types: g.get_i32_array("tokenizer.ggml.token_type").ok(),
        merges: match g.get("tokenizer.ggml.merges") {
            Some(_) => g
                .get_str_array("tokenizer.ggml.merges")
                .map_err(fe)?
                .iter()
                .map(|s| s.to_string())
                .collect(),
            None => Vec::new(),
        },
        bos_id: opt_u32("tokenizer.ggml.bos_token_id")?,
        eos_id: opt_u32("tokenizer.ggml.eos_token_id")?,
        eot_id: opt_u32("tokenizer.ggml.eot_token_id")?,
        eom_id: opt_u32("tokenizer.ggml.eom_token_id")?,
        pad_id: opt_u32("tokenizer.ggml.padding_token_id")?,
        add_bos: opt_bool("tokenizer.ggml.add_bos_token"),
        add_eos: opt_bool("tokenizer.ggml.add_eos_token"),
    })
}

/// The source text of the model's chat template: GGUF `tokenizer.chat_template`, else
/// `tokenizer_config.json`'s `chat_template`, else `chat_template.jinja` in the model directory.
pub fn chat_template_source(src: &ModelSource) -> Option<String> {
    if let Some(g) = src.gguf() {
        return g
            .get_str("tokenizer.chat_template")
            .ok()
            .map(str::to_string);
    }
    src.hf()
        .and_then(|h| h.tokenizer_config())
        .and_then(|c| c.get("chat_template"))
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .or_else(|| std::fs::read_to_string(src.path().join("chat_template.jinja")).ok())
}

/// The model's own chat template compiled, if it ships one.
pub fn chat_template_for(src: &ModelSource, tok: &Tokenizer) -> Result<Option<ChatTemplate>> {
    chat_template_source(src)
        .map(|source| compile_chat_template(&source, tok))
        .transpose()
}

/// Compile the chat template `source` for a model with tokenizer `tok` (whose BOS and EOS
/// token texts the template may use as `bos_token` / `eos_token`).
pub fn compile_chat_template(source: &str, tok: &Tokenizer) -> Result<ChatTemplate> {
    let name = |id: Option<u32>| {
        id.and_then(|i| tok.token_bytes(i))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    };
    Ok(ChatTemplate::new(
        source,
        name(tok.bos_id()),
        name(tok.eos_id()),
    )?)
}

/// A short identity of the model at `path` for cache fingerprints: for a file, its size and
/// a hash of its first and last MiB; for a directory, the same over `config.json` and every
/// `*.safetensors` file (sorted by name). Copies of the same file give the same identity;
/// another file, practically never.
pub fn model_identity(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    fn file_part(p: &std::path::Path, h: &mut u64) -> std::io::Result<()> {
        const MIB: u64 = 1 << 20;
        let mut f = std::fs::File::open(p)?;
        let len = f.metadata()?.len();
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                *h = (*h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        eat(&len.to_le_bytes());
        let mut buf = vec![0u8; len.min(MIB) as usize];
        f.read_exact(&mut buf)?;
        eat(&buf);
        if len > MIB {
            f.seek(SeekFrom::Start(len - len.min(MIB)))?;
            f.read_exact(&mut buf)?;
            eat(&buf);
        }
        Ok(())
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    if path.is_dir() {
        let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name().is_some_and(|n| n == "config.json")
                    || p.extension().is_some_and(|e| e == "safetensors")
            })
            .collect();
        files.sort();
        for f in files {
            file_part(&f, &mut h)?;
        }
    } else {
        file_part(path, &mut h)?;
    }
    Ok(format!("{h:016x}"))
}
