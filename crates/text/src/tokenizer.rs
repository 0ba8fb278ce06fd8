//! [`Tokenizer`]: one type over two sources, a Hugging Face `tokenizer.json` (encoded exactly as
//! `transformers` / `tokenizers` do) and a GGUF vocabulary (encoded exactly as llama.cpp does).

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use tokenizers::DecoderWrapper;

use crate::gguf::{self, Fragment, GgufVocab, SpecialText};
use crate::{bytelevel, TextError};

/// Where the tokenizer came from; decides how special tokens are split out of text.
enum Backend {
    /// A full `tokenizers` tokenizer from `tokenizer.json`. `no_special` is a lazily made clone
    /// with `encode_special_tokens` set, used for `parse_special = false`.
    Json {
        tk: Box<tokenizers::Tokenizer>,
        no_special: OnceLock<Box<tokenizers::Tokenizer>>,
    },
    /// BPE model + pre-tokenizer from GGUF metadata; special tokens are split out by
    /// [`gguf::partition`] (llama.cpp semantics) before it runs.
    Gguf {
        tk: Box<tokenizers::Tokenizer>,
        specials: Vec<SpecialText>,
        add_bos: bool,
        add_eos: bool,
    },
}

/// A text tokenizer: encode, decode, special-token and end-of-generation metadata.
///
/// Built either from `tokenizer.json` ([`Tokenizer::from_tokenizer_json`]) or from GGUF
/// metadata ([`Tokenizer::from_gguf_vocab`]). Immutable after construction; `Send + Sync`.
pub struct Tokenizer {
    backend: Backend,
    /// Raw bytes of every id in `0..vocab_size` (empty for holes and unused entries).
    token_bytes: Vec<Box<[u8]>>,
    /// Ids dropped by `decode(.., skip_special = true)`.
    skip: Vec<bool>,
    /// Text -> id for every token (byte-level alphabet for normal BPE tokens).
    vocab: HashMap<String, u32>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eog_ids: Vec<u32>,
    chat_template: Option<String>,
}

/// The text of a caught panic's payload (`&str` or `String`; anything else is unnamed).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "no message".into()
    }
}

/// Read a special token given in `tokenizer_config.json` either as a string or as an
/// `AddedToken` object with a `content` field.
fn config_token(cfg: Option<&serde_json::Value>, key: &str) -> Option<String> {
    match cfg?.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Read `generation_config.json`'s `eos_token_id` / `bos_token_id`, an integer or a list.
fn config_ids(cfg: Option<&serde_json::Value>, key: &str) -> Vec<u32> {
    let to_id = |v: &serde_json::Value| v.as_u64().and_then(|x| u32::try_from(x).ok());
    match cfg.and_then(|c| c.get(key)) {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(to_id).collect(),
        Some(v) => to_id(v).into_iter().collect(),
        None => Vec::new(),
    }
}

/// `tokenizer_config.json`'s `chat_template`: a string, or a list of `{name, template}` from
/// which the one named `default` is taken.
fn config_chat_template(cfg: Option<&serde_json::Value>) -> Option<String> {
    match cfg?.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list.iter().find_map(|t| {
            (t.get("name")?.as_str()? == "default")
                .then(|| t.get("template")?.as_str().map(str::to_string))
                .flatten()
        }),
        _ => None,
    }
}

impl Tokenizer {
    /// Load a Hugging Face `tokenizer.json`.
    ///
    /// `tokenizer_config` (the parsed `tokenizer_config.json`) supplies `bos_token`,
    /// `eos_token` and `chat_template`; `generation_config` (parsed `generation_config.json`)
    /// supplies extra `eos_token_id`s. Whether BOS/EOS are added by `encode(.., add_special =
    /// true)` is decided by the file's post-processor, as in `transformers`.
    pub fn from_tokenizer_json(
        path: &Path,
        tokenizer_config: Option<&serde_json::Value>,
        generation_config: Option<&serde_json::Value>,
    ) -> Result<Tokenizer, TextError> {
        let bytes = std::fs::read(path).map_err(|source| TextError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_tokenizer_json_bytes(&bytes, tokenizer_config, generation_config)
    }

    /// Like [`Tokenizer::from_tokenizer_json`], from the file's contents.
    ///
    /// A malformed file gives [`TextError::InvalidTokenizer`], never a panic.
    pub fn from_tokenizer_json_bytes(
        json: &[u8],
        tokenizer_config: Option<&serde_json::Value>,
        generation_config: Option<&serde_json::Value>,
    ) -> Result<Tokenizer, TextError> {
        // The `tokenizers` crate panics on some malformed files instead of returning an error
        // (an `expect` in its decoder, normalizer and pre-tokenizer deserialisers, reached by a
        // syntax error inside those sections), and the per-id decode below runs the file's
        // decoder. This is the one boundary where file contents reach that crate, so a panic is
        // contained here and turned into a typed error; nothing escapes half-built (the value is
        // only returned whole).
        std::panic::catch_unwind(|| {
            Self::build_from_json(json, tokenizer_config, generation_config)
        })
        .unwrap_or_else(|payload| {
            Err(TextError::InvalidTokenizer(format!(
                "tokenizer.json is malformed (the tokenizers library panicked: {})",
                panic_message(payload.as_ref())
            )))
        })
    }

    /// The body of [`Tokenizer::from_tokenizer_json_bytes`], run under its `catch_unwind`.
    fn build_from_json(
        json: &[u8],
        tokenizer_config: Option<&serde_json::Value>,
        generation_config: Option<&serde_json::Value>,
    ) -> Result<Tokenizer, TextError> {
        let tk = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| TextError::InvalidTokenizer(format!("tokenizer.json: {e}")))?;
        let vocab = tk.get_vocab(true);
        let vocab_size = vocab.values().max().map_or(0, |&m| m as usize + 1);
        if vocab_size == 0 {
            return Err(TextError::InvalidTokenizer(
                "tokenizer.json has an empty vocabulary".into(),
            ));
        }
        // Refuse absurdly sparse ids instead of allocating per-id tables for them.
        if vocab_size > 2 * vocab.len() + 4096 {
            return Err(TextError::InvalidTokenizer(format!(
                "tokenizer.json ids are too sparse: highest id {} for {} tokens",
                vocab_size - 1,
                vocab.len()
            )));
        }
        let byte_level = matches!(tk.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let mut token_bytes = Vec::with_capacity(vocab_size);
        for id in 0..vocab_size as u32 {
            let bytes = match tk.id_to_token(id) {
                None => Vec::new(),
                Some(t) if byte_level => bytelevel::decode_token(&t),
                Some(_) => tk
                    .decode(&[id], false)
                    .map(String::into_bytes)
                    .unwrap_or_default(),
            };
            token_bytes.push(bytes.into_boxed_slice());
        }
        let mut skip = vec![false; vocab_size];
        let mut added: HashMap<String, u32> = HashMap::new();
        for (id, tok) in tk.get_added_tokens_decoder() {
            if let Some(s) = skip.get_mut(id as usize) {
                *s = tok.special;
            }
            added.insert(tok.content, id);
        }
        let lookup = |s: &str| vocab.get(s).copied();
        // Text-based end-of-generation detection only looks at added tokens: a plain BPE token
        // that happens to read "</s>" (Qwen2 has one) is ordinary text here.
        let lookup_added = |s: &str| added.get(s).copied();
        let bos_id = config_token(tokenizer_config, "bos_token")
            .and_then(|t| lookup(&t))
            .or_else(|| {
                config_ids(generation_config, "bos_token_id")
                    .first()
                    .copied()
            });
        let eos_id = config_token(tokenizer_config, "eos_token").and_then(|t| lookup(&t));
        let mut explicit: Vec<Option<u32>> = vec![eos_id];
        explicit.extend(
            config_ids(generation_config, "eos_token_id")
                .into_iter()
                .map(Some),
        );
        let eog_ids = gguf::collect_eog(&lookup_added, &explicit, vocab_size);
        let eos_id = eos_id.or_else(|| {
            config_ids(generation_config, "eos_token_id")
                .first()
                .copied()
        });
        Ok(Tokenizer {
            backend: Backend::Json {
                tk: Box::new(tk),
                no_special: OnceLock::new(),
            },
            token_bytes,
            skip,
            vocab,
            bos_id,
            eos_id,
            eog_ids,
            chat_template: config_chat_template(tokenizer_config),
        })
    }

    /// Build a byte-level BPE tokenizer from GGUF metadata, as llama.cpp does.
    ///
    /// Refuses `tokenizer.ggml.model` other than `gpt2` and unknown `tokenizer.ggml.pre` values.
    /// Control, unknown and user-defined tokens (types 3, 2, 4) are split out of the text before
    /// BPE, longest first; control/unknown ones only when `parse_special` is set, user-defined
    /// ones always (llama.cpp `tokenizer_st_partition`).
    pub fn from_gguf_vocab(v: &GgufVocab) -> Result<Tokenizer, TextError> {
        let parts = gguf::build(v)?;
        let mut vocab = HashMap::with_capacity(v.tokens.len());
        for (id, t) in v.tokens.iter().enumerate() {
            // The vocabulary size was checked to fit in u32 by `gguf::build`.
            vocab.entry(t.clone()).or_insert(id as u32);
        }
        Ok(Tokenizer {
            backend: Backend::Gguf {
                tk: Box::new(parts.tokenizer),
                specials: parts.specials,
                add_bos: parts.add_bos,
                add_eos: parts.add_eos,
            },
            token_bytes: parts.token_bytes,
            skip: parts.skip,
            vocab,
            bos_id: v.bos_id,
            eos_id: v.eos_id,
            eog_ids: parts.eog_ids,
            chat_template: None,
        })
    }

    /// Encode text to token ids.
    ///
    /// `add_special`: add BOS/EOS if the model wants them (Qwen does not). `parse_special`:
    /// recognise control tokens such as `<|im_start|>` written in the text; when false they are
    /// tokenized as plain text (user-defined tokens such as `<tool_call>` are still recognised,
    /// as in both llama.cpp and `tokenizers`).
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TextError> {
        let enc_err = |e: tokenizers::Error| TextError::Encode(e.to_string());
        match &self.backend {
            Backend::Json { tk, no_special } => {
                let tk: &tokenizers::Tokenizer = if parse_special {
                    tk
                } else {
                    no_special.get_or_init(|| {
                        let mut c = tk.clone();
                        c.set_encode_special_tokens(true);
                        c
                    })
                };
                Ok(tk
                    .encode_fast(text, add_special)
                    .map_err(enc_err)?
                    .get_ids()
                    .to_vec())
            }
            Backend::Gguf {
                tk,
                specials,
                add_bos,
                add_eos,
            } => {
                let mut ids = Vec::with_capacity(text.len() / 3 + 2);
                if add_special && *add_bos {
                    ids.extend(self.bos_id);
                }
                for frag in gguf::partition(text, specials, parse_special) {
                    match frag {
                        Fragment::Token(id) => ids.push(id),
                        Fragment::Text(s, e) => {
                            let piece = text.get(s..e).ok_or_else(|| {
                                TextError::Encode(format!(
                                    "fragment {s}..{e} is not on char boundaries"
                                ))
                            })?;
                            ids.extend_from_slice(
                                tk.encode_fast(piece, false).map_err(enc_err)?.get_ids(),
                            );
                        }
                    }
                }
                if add_special && *add_eos {
                    ids.extend(self.eos_id);
                }
                Ok(ids)
            }
        }
    }

    /// Decode ids to text. Invalid UTF-8 (for example a sequence cut inside a multi-byte
    /// character) is replaced with U+FFFD. With `skip_special`, control / special tokens are
    /// left out (user-defined tokens such as `<tool_call>` are kept).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let b = self
                .token_bytes
                .get(id as usize)
                .ok_or(TextError::TokenOutOfRange {
                    id,
                    vocab_size: self.token_bytes.len(),
                })?;
            if skip_special && self.is_special(id) {
                continue;
            }
            bytes.extend_from_slice(b);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Raw bytes of one token (byte-level BPE decoded; special tokens give their text).
    /// `None` if `id` is out of range.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.token_bytes_ref(id).map(<[u8]>::to_vec)
    }

    /// Borrowed form of [`Tokenizer::token_bytes`].
    pub fn token_bytes_ref(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(|b| &**b)
    }

    /// Number of token ids (highest id + 1), including added / special tokens.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// The BOS id, if the model defines one (whether it is added is up to `encode`).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The EOS id, if the model defines one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Whether `encode(.., add_special = true, ..)` adds BOS. For `tokenizer.json` this is
    /// probed by encoding an empty string.
    pub fn adds_bos(&self) -> bool {
        match &self.backend {
            Backend::Gguf { add_bos, .. } => *add_bos,
            Backend::Json { .. } => match (self.bos_id, self.encode("", true, true)) {
                (Some(bos), Ok(ids)) => ids.first() == Some(&bos),
                _ => false,
            },
        }
    }

    /// End-of-generation ids, sorted: EOS / EOT / EOM plus every token whose text llama.cpp
    /// treats as end of generation (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, `</s>`, FIM
    /// pad / repo / file-separator tokens, ...). From GGUF this is exactly llama.cpp's list (for
    /// Qwen2.5 it includes the plain token `</s>`, 128247, as llama.cpp does); from
    /// `tokenizer.json` the text matches are looked up among added tokens only, plus
    /// `generation_config.json`'s `eos_token_id`s.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog_ids
    }

    /// Whether `id` is an end-of-generation token.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog_ids.binary_search(&id).is_ok()
    }

    /// Whether `id` is a special (control) token: those are the tokens `decode(.., true)` and
    /// the [`crate::IncrementalDecoder`] leave out. User-defined tokens (GGUF type 4,
    /// non-special added tokens) are not special in this sense.
    pub fn is_special(&self, id: u32) -> bool {
        self.skip.get(id as usize).copied().unwrap_or(false)
    }

    /// The id of a token given its vocabulary text (byte-level alphabet for normal tokens,
    /// e.g. `"Ġthe"`; plain text for special tokens, e.g. `"<|im_end|>"`).
    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        self.vocab.get(s).copied()
    }

    /// The chat template from `tokenizer_config.json`, if any (GGUF templates are passed to
    /// [`crate::ChatTemplate::new`] by the caller).
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }

    #[test]
    fn config_helpers() {
        let cfg = serde_json::json!({
            "bos_token": {"content": "<s>"},
            "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
        });
        assert_eq!(
            config_token(Some(&cfg), "bos_token").as_deref(),
            Some("<s>")
        );
        assert_eq!(
            config_token(Some(&cfg), "eos_token").as_deref(),
            Some("</s>")
        );
        assert_eq!(config_chat_template(Some(&cfg)).as_deref(), Some("y"));
        let gen = serde_json::json!({"eos_token_id": [1, 2]});
        assert_eq!(config_ids(Some(&gen), "eos_token_id"), vec![1, 2]);
        assert!(config_ids(None, "eos_token_id").is_empty());
    }
}
