//! The tokenizer section: every `tokenizer.*` key of a source GGUF, with the per-token arrays
//! padded to the model's vocabulary the way llama.cpp's converter pads a vocabulary
//! (`[PAD{id}]` tokens of type UNUSED).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kapitsa_formats::{GgufArray, GgufFile, GgufValue};

use crate::SynthError;

/// llama.cpp token types.
pub mod token_type {
    /// A normal text token.
    pub const NORMAL: i32 = 1;
    /// A control token (`<|im_end|>`, ...).
    pub const CONTROL: i32 = 3;
    /// A padding / unused slot.
    pub const UNUSED: i32 = 5;
    /// A byte-fallback token (SentencePiece `<0xNN>`).
    pub const BYTE: i32 = 6;
}

/// Score the converter gives SentencePiece padding tokens.
const PAD_SCORE: f32 = -1000.0;

/// `tokenizer.*` keys sized to a vocabulary, and the output rows to zero (one flag per id).
pub type TokenizerSection = (Vec<(String, GgufValue)>, Arc<Vec<bool>>);

/// The tokenizer metadata of a GGUF file.
#[derive(Debug, Clone)]
pub struct TokenizerSource {
    /// The file it came from.
    pub path: PathBuf,
    /// Every `tokenizer.*` key, in file order.
    pub kvs: Vec<(String, GgufValue)>,
    /// Number of tokens (`tokenizer.ggml.tokens`).
    pub n_tokens: usize,
    /// `tokenizer.ggml.model`.
    pub model: String,
    /// `tokenizer.ggml.pre`, if present.
    pub pre: Option<String>,
}

fn bad(path: &Path, why: impl std::fmt::Display) -> SynthError {
    SynthError::Usage(format!("bad tokenizer source {}: {why}", path.display()))
}

/// Read the tokenizer metadata of `path`.
pub fn read(path: &Path) -> Result<TokenizerSource, SynthError> {
    if !path.is_file() {
        return Err(bad(path, "no such file"));
    }
    let g = GgufFile::open(path).map_err(|e| bad(path, e))?;
    let kvs: Vec<(String, GgufValue)> = g
        .metadata()
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .cloned()
        .collect();
    let n_tokens = match g.get("tokenizer.ggml.tokens") {
        Some(GgufValue::Array(GgufArray::String(t))) => t.len(),
        Some(_) => return Err(bad(path, "tokenizer.ggml.tokens is not a string array")),
        None => {
            return Err(bad(
                path,
                "it has no tokenizer.ggml.tokens (no tokenizer section)",
            ))
        }
    };
    if n_tokens == 0 {
        return Err(bad(path, "tokenizer.ggml.tokens is empty"));
    }
    let model = g
        .opt_str("tokenizer.ggml.model")
        .map_err(|e| bad(path, e))?
        .ok_or_else(|| bad(path, "it has no tokenizer.ggml.model"))?
        .to_string();
    for key in ["tokenizer.ggml.token_type", "tokenizer.ggml.scores"] {
        if let Some(v) = g.get(key) {
            let len = v.as_array().map(|a| a.len());
            if len != Some(n_tokens) {
                return Err(bad(
                    path,
                    format!("{key} has {len:?} entries for {n_tokens} tokens"),
                ));
            }
        }
    }
    let pre = g
        .opt_str("tokenizer.ggml.pre")
        .ok()
        .flatten()
        .map(str::to_string);
    Ok(TokenizerSource {
        path: path.to_path_buf(),
        kvs,
        n_tokens,
        model,
        pre,
    })
}

impl TokenizerSource {
    /// The `tokenizer.*` keys for a model of `n_vocab >= n_tokens` rows, and which output rows
    /// to zero: every id that is not a NORMAL or BYTE token (control tokens, unused slots and
    /// the padding), so random logits never pick a special or padding token under greedy
    /// decoding and generation runs to its requested length.
    pub fn for_vocab(&self, n_vocab: usize) -> Result<TokenizerSection, SynthError> {
        if n_vocab < self.n_tokens {
            return Err(SynthError::Internal(format!(
                "vocabulary {n_vocab} smaller than the tokenizer's {}",
                self.n_tokens
            )));
        }
        let mut kvs = self.kvs.clone();
        let mut types: Option<Vec<i32>> = None;
        for (k, v) in kvs.iter_mut() {
            match (k.as_str(), v) {
                ("tokenizer.ggml.tokens", GgufValue::Array(GgufArray::String(t))) => {
                    for i in t.len()..n_vocab {
                        t.push(format!("[PAD{i}]"));
                    }
                }
                ("tokenizer.ggml.token_type", GgufValue::Array(a)) => {
                    let mut t: Vec<i32> = a
                        .to_integers()
                        .ok_or_else(|| bad(&self.path, "tokenizer.ggml.token_type is not integer"))?
                        .into_iter()
                        .map(|x| x as i32)
                        .collect();
                    t.resize(n_vocab, token_type::UNUSED);
                    types = Some(t.clone());
                    *a = GgufArray::I32(t);
                }
                ("tokenizer.ggml.scores", GgufValue::Array(GgufArray::F32(s))) => {
                    s.resize(n_vocab, PAD_SCORE);
                }
                ("tokenizer.ggml.scores", GgufValue::Array(GgufArray::F64(s))) => {
                    s.resize(n_vocab, f64::from(PAD_SCORE));
                }
                _ => {}
            }
        }
        if types.is_none() && n_vocab > self.n_tokens {
            // No type array in the source: add one so the padding is marked UNUSED.
            let mut t = vec![token_type::NORMAL; self.n_tokens];
            t.resize(n_vocab, token_type::UNUSED);
            kvs.push((
                "tokenizer.ggml.token_type".into(),
                GgufValue::Array(GgufArray::I32(t.clone())),
            ));
            types = Some(t);
        }
        let zero: Vec<bool> = match types {
            Some(t) => t
                .iter()
                .map(|&ty| ty != token_type::NORMAL && ty != token_type::BYTE)
                .collect(),
            None => vec![false; n_vocab],
        };
        Ok((kvs, Arc::new(zero)))
    }
}
