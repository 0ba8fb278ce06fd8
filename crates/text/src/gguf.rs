//! Byte-level BPE tokenizers rebuilt from GGUF metadata (`tokenizer.ggml.*`), following
//! llama.cpp's `llama-vocab.cpp`: the pre-tokenizer regex is chosen from `tokenizer.ggml.pre`,
//! control / user-defined tokens are split out of the text before BPE, end-of-generation tokens are
//! collected from the special ids plus a list of well-known token texts.

use std::collections::HashMap;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use crate::bytelevel;
use crate::TextError;

/// The tokenizer part of a GGUF file's metadata, handed over as plain data (this crate does not
/// parse GGUF itself).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`, e.g. `"gpt2"` (the only supported value).
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. `"qwen2"`, `"qwen35"`, `"pixtral"`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: token texts indexed by id (byte-level alphabet for normal tokens).
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
    /// 6 byte. Missing means all normal.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs in rank order.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`.
    pub eot_id: Option<u32>,
    /// `tokenizer.ggml.eom_token_id`.
    pub eom_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`; when missing the default of the pre-tokenizer applies.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`; defaults to false.
    pub add_eos: Option<bool>,
}

/// llama.cpp token types (`llama_token_type`).
pub(crate) mod token_type {
    /// A normal token, byte-level encoded.
    pub const NORMAL: i32 = 1;
    /// The unknown token.
    pub const UNKNOWN: i32 = 2;
    /// A control token (`<|im_start|>`), matched in text only with `parse_special`.
    pub const CONTROL: i32 = 3;
    /// A user-defined token (`<tool_call>`), always matched in text, rendered as text.
    pub const USER_DEFINED: i32 = 4;
    /// An unused padding entry.
    pub const UNUSED: i32 = 5;
    /// A raw byte token `<0xXX>`.
    pub const BYTE: i32 = 6;
}

/// The pre-tokenizer settings llama.cpp uses for one `tokenizer.ggml.pre` value.
struct PreConfig {
    /// The split regex, in llama.cpp's adapted form (no `(?i:...)`).
    regex: &'static str,
    /// If a whole pre-token is in the vocabulary, use it without applying merges.
    ignore_merges: bool,
    /// Whether BOS is added when the GGUF does not say.
    add_bos_default: bool,
}

/// Qwen2 / Qwen3 (`LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5 / Qwen3.6 (`LLAMA_VOCAB_PRE_TYPE_QWEN35`): combining marks join letters.
const QWEN35_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3 and Tekken-style vocabularies such as Nemotron 3 (`pre = "pixtral"`):
/// `LLAMA_VOCAB_PRE_TYPE_LLAMA3`, digits in groups of up to three.
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values this crate supports.
const SUPPORTED_PRE: &str =
    "qwen2, deepseek-r1-qwen, megrez, qwen35, llama3, llama-v3, llama-bpe, pixtral";

fn pre_config(pre: &str) -> Option<PreConfig> {
    let cfg = match pre {
        "qwen2" | "deepseek-r1-qwen" | "megrez" => PreConfig {
            regex: QWEN2_REGEX,
            ignore_merges: false,
            add_bos_default: false,
        },
        "qwen35" => PreConfig {
            regex: QWEN35_REGEX,
            ignore_merges: false,
            add_bos_default: false,
        },
        "llama3" | "llama-v3" | "llama-bpe" | "pixtral" => PreConfig {
            regex: LLAMA3_REGEX,
            ignore_merges: true,
            add_bos_default: true,
        },
        _ => return None,
    };
    Some(cfg)
}

/// A token that is split out of the input text before BPE runs.
#[derive(Debug, Clone)]
pub(crate) struct SpecialText {
    /// The token text to look for.
    pub text: String,
    /// Its id.
    pub id: u32,
    /// Control or unknown token: only matched when `parse_special` is set.
    pub control: bool,
}

/// Everything [`crate::Tokenizer`] needs from a GGUF vocabulary.
pub(crate) struct GgufParts {
    /// BPE model plus pre-tokenizer, with no added tokens.
    pub tokenizer: tokenizers::Tokenizer,
    /// Tokens split out of text before BPE, longest first.
    pub specials: Vec<SpecialText>,
    /// Raw bytes of every token.
    pub token_bytes: Vec<Box<[u8]>>,
    /// Tokens dropped by `decode(.., skip_special = true)`.
    pub skip: Vec<bool>,
    /// End-of-generation ids, sorted.
    pub eog_ids: Vec<u32>,
    /// Whether `encode(.., add_special = true)` adds BOS.
    pub add_bos: bool,
    /// Whether `encode(.., add_special = true)` adds EOS.
    pub add_eos: bool,
}

/// Token texts llama.cpp treats as end of generation wherever they appear in a vocabulary
/// (`llama-vocab.cpp`, "maintain a list of tokens that cause end-of-generation").
pub(crate) const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// FIM pad / repo / file-separator token texts; llama.cpp also stops on these.
pub(crate) const FIM_EOG_TEXTS: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

/// Collect end-of-generation ids the way llama.cpp does: FIM pad/repo/sep tokens, every token
/// whose text is in [`EOG_TEXTS`], plus the given EOS / EOT / EOM ids. Applies llama.cpp's two
/// corrections (`<|end|>` is not EOG next to `<|return|>`+`<|call|>` or `<|calls|>`+`<|flush|>`;
/// `</s>` is not EOG next to `<|tool_response>` or `<|plamo:eos|>`).
pub(crate) fn collect_eog(
    lookup: &dyn Fn(&str) -> Option<u32>,
    explicit: &[Option<u32>],
    vocab_size: usize,
) -> Vec<u32> {
    let mut ids: Vec<u32> = Vec::new();
    for names in FIM_EOG_TEXTS {
        if let Some(id) = names.iter().find_map(|n| lookup(n)) {
            ids.push(id);
        }
    }
    ids.extend(EOG_TEXTS.iter().filter_map(|t| lookup(t)));
    ids.extend(explicit.iter().flatten().copied());
    ids.retain(|&id| (id as usize) < vocab_size);
    let has = |ids: &[u32], text: &str| lookup(text).filter(|id| ids.contains(id));
    if let Some(end) = has(&ids, "<|end|>") {
        let harmony = has(&ids, "<|return|>").is_some() && has(&ids, "<|call|>").is_some();
        let solar = has(&ids, "<|calls|>").is_some() && has(&ids, "<|flush|>").is_some();
        if harmony || solar {
            ids.retain(|&id| id != end);
        }
    }
    if let Some(s) = has(&ids, "</s>") {
        if has(&ids, "<|tool_response>").is_some() || lookup("<|plamo:eos|>").is_some() {
            ids.retain(|&id| id != s);
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Parse a byte token text `<0xXX>`.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Build the tokenizer parts from a GGUF vocabulary.
pub(crate) fn build(v: &GgufVocab) -> Result<GgufParts, TextError> {
    if v.model != "gpt2" {
        return Err(TextError::UnsupportedModel(v.model.clone()));
    }
    let pre_name = v.pre.as_deref().unwrap_or("");
    let pre = pre_config(pre_name).ok_or_else(|| TextError::UnsupportedPreTokenizer {
        pre: pre_name.to_string(),
        supported: SUPPORTED_PRE.to_string(),
    })?;
    let n = v.tokens.len();
    if n == 0 || u32::try_from(n).is_err() {
        return Err(TextError::InvalidTokenizer(format!(
            "GGUF vocabulary has {n} tokens"
        )));
    }
    let mut types: Vec<i32> = match &v.token_types {
        Some(t) if t.len() == n => t.clone(),
        Some(t) => {
            return Err(TextError::InvalidTokenizer(format!(
                "GGUF token_type has {} entries for {n} tokens",
                t.len()
            )))
        }
        None => vec![token_type::NORMAL; n],
    };
    for (name, id) in [
        ("bos", v.bos_id),
        ("eos", v.eos_id),
        ("eot", v.eot_id),
        ("eom", v.eom_id),
    ] {
        if let Some(id) = id {
            if id as usize >= n {
                return Err(TextError::InvalidTokenizer(format!(
                    "GGUF {name} token id {id} is out of range (vocabulary size {n})"
                )));
            }
        }
    }

    // Text -> id; on duplicates the lowest id wins.
    let mut vocab: HashMap<String, u32> = HashMap::with_capacity(n);
    for (id, tok) in v.tokens.iter().enumerate() {
        // `n` fits in u32 (checked above), so every index does too.
        let id = id as u32;
        vocab.entry(tok.clone()).or_insert(id);
    }
    let lookup = |s: &str| vocab.get(s).copied();

    let eog_ids = collect_eog(&lookup, &[v.eos_id, v.eot_id, v.eom_id], n);
    // llama.cpp forces EOG and FIM tokens to be control tokens.
    for &id in &eog_ids {
        if let Some(t) = types.get_mut(id as usize) {
            if *t != token_type::CONTROL {
                *t = token_type::CONTROL;
            }
        }
    }

    let mut merges = Vec::with_capacity(v.merges.len());
    for m in &v.merges {
        // llama.cpp splits at the first space after the first byte; a space is ASCII, so the
        // split position is a char boundary.
        let split = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        let Some(pos) = split else {
            return Err(TextError::InvalidTokenizer(format!(
                "malformed GGUF merge {m:?}"
            )));
        };
        let (a, b) = (&m[..pos], &m[pos + 1..]);
        // Merges whose parts or result are not tokens can never produce a token; skip them.
        if vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&format!("{a}{b}"))
        {
            merges.push((a.to_string(), b.to_string()));
        }
    }

    let bpe = BPE::builder()
        .vocab_and_merges(
            vocab
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect::<tokenizers::models::bpe::Vocab>(),
            merges,
        )
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| TextError::InvalidTokenizer(format!("cannot build BPE model: {e}")))?;
    let split = Split::new(
        SplitPattern::Regex(pre.regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| TextError::InvalidTokenizer(format!("bad pre-tokenizer regex: {e}")))?;
    let pretok = Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
    ]);
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pretok));

    let mut specials = Vec::new();
    let mut token_bytes = Vec::with_capacity(n);
    let mut skip = Vec::with_capacity(n);
    for (id, (text, &ty)) in v.tokens.iter().zip(types.iter()).enumerate() {
        let is_control = ty == token_type::CONTROL || ty == token_type::UNKNOWN;
        if (is_control || ty == token_type::USER_DEFINED) && !text.is_empty() {
            specials.push(SpecialText {
                text: text.clone(),
                id: id as u32,
                control: is_control,
            });
        }
        let bytes: Vec<u8> = match ty {
            token_type::CONTROL | token_type::UNKNOWN | token_type::USER_DEFINED => {
                text.as_bytes().to_vec()
            }
            token_type::BYTE => parse_byte_token(text).map(|b| vec![b]).unwrap_or_default(),
            token_type::UNUSED => Vec::new(),
            _ => bytelevel_decode_lenient(text),
        };
        token_bytes.push(bytes.into_boxed_slice());
        skip.push(is_control);
    }
    // Longest first, as llama.cpp's `cache_special_tokens` (stable for equal lengths).
    specials.sort_by_key(|s| std::cmp::Reverse(s.text.len()));

    Ok(GgufParts {
        tokenizer,
        specials,
        token_bytes,
        skip,
        eog_ids,
        add_bos: v.add_bos.unwrap_or(pre.add_bos_default) && v.bos_id.is_some(),
        add_eos: v.add_eos.unwrap_or(false) && v.eos_id.is_some(),
    })
}

/// llama.cpp's `llama_decode_text`: map each character of a normal token through the byte
/// alphabet; characters outside it are kept as UTF-8.
fn bytelevel_decode_lenient(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match bytelevel::char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// A piece of input text after special tokens have been split out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// Byte range of plain text, to be BPE-encoded.
    Text(usize, usize),
    /// A special token matched in the text.
    Token(u32),
}

/// llama.cpp's `tokenizer_st_partition`: for each special token, longest first, split every
/// remaining text fragment at each of its occurrences. Control tokens are only considered when
/// `parse_special` is set; user-defined tokens always are.
pub(crate) fn partition(
    text: &str,
    specials: &[SpecialText],
    parse_special: bool,
) -> Vec<Fragment> {
    let mut frags = vec![Fragment::Text(0, text.len())];
    if text.is_empty() {
        return Vec::new();
    }
    for st in specials {
        if st.control && !parse_special {
            continue;
        }
        if !text.contains(st.text.as_str()) {
            continue;
        }
        let mut next = Vec::with_capacity(frags.len() + 2);
        for frag in frags {
            let Fragment::Text(start, end) = frag else {
                next.push(frag);
                continue;
            };
            let mut pos = start;
            // Byte offsets come from `find` on a &str, so they are char boundaries.
            while let Some(found) = text.get(pos..end).and_then(|s| s.find(st.text.as_str())) {
                let m = pos + found;
                if m > pos {
                    next.push(Fragment::Text(pos, m));
                }
                next.push(Fragment::Token(st.id));
                pos = m + st.text.len();
            }
            if pos < end {
                next.push(Fragment::Text(pos, end));
            }
        }
        frags = next;
    }
    frags
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(text: &str, id: u32, control: bool) -> SpecialText {
        SpecialText {
            text: text.into(),
            id,
            control,
        }
    }

    #[test]
    fn partition_splits_longest_first() {
        let sp = vec![st("<|im_start|>", 1, true), st("<tool>", 2, false)];
        let text = "a<|im_start|>b<tool>c";
        let f = partition(text, &sp, true);
        assert_eq!(
            f,
            vec![
                Fragment::Text(0, 1),
                Fragment::Token(1),
                Fragment::Text(13, 14),
                Fragment::Token(2),
                Fragment::Text(20, 21)
            ]
        );
        let f = partition(text, &sp, false);
        assert_eq!(
            f,
            vec![
                Fragment::Text(0, 14),
                Fragment::Token(2),
                Fragment::Text(20, 21)
            ]
        );
        assert!(partition("", &sp, true).is_empty());
    }

    #[test]
    fn unknown_pre_is_refused() {
        let v = GgufVocab {
            model: "gpt2".into(),
            pre: Some("nonsense".into()),
            tokens: vec!["a".into()],
            ..Default::default()
        };
        assert!(matches!(
            build(&v),
            Err(TextError::UnsupportedPreTokenizer { .. })
        ));
        let v = GgufVocab {
            model: "llama".into(),
            ..v
        };
        assert!(matches!(build(&v), Err(TextError::UnsupportedModel(_))));
    }

    #[test]
    fn byte_tokens() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0x0>"), None);
    }
}
