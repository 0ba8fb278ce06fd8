//! Shared helpers for the fixture tests.
#![allow(dead_code)]

pub mod gguf_meta;

use std::path::PathBuf;
use std::sync::OnceLock;

use kapitsa_text::{GgufVocab, Tokenizer};

/// `tests/fixtures` at the repository root.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn qwen_dir() -> PathBuf {
    fixtures().join("text/qwen2.5-coder-0.5b")
}

pub fn corpus() -> Vec<String> {
    serde_json::from_value(read_json(&fixtures().join("text/corpus.json")))
        .expect("corpus is a list of strings")
}

/// The tokenizer.json fixture, loaded once per test binary.
pub fn json_tokenizer() -> &'static Tokenizer {
    static TK: OnceLock<Tokenizer> = OnceLock::new();
    TK.get_or_init(|| {
        let dir = qwen_dir();
        let cfg = read_json(&dir.join("tokenizer_config.json"));
        Tokenizer::from_tokenizer_json(&dir.join("tokenizer.json"), Some(&cfg), None)
            .expect("load tokenizer.json")
    })
}

/// The GGUF vocabulary of qwen2.5-coder-0.5b-instruct-q4_k_m.gguf, rebuilt from the committed
/// tokenizer.json (whose vocab and merges the fixture script checked to be identical to the
/// GGUF's `tokenizer.ggml.tokens` / `merges`) and `gguf_vocab_meta.json` (token types, ids).
pub fn gguf_vocab() -> GgufVocab {
    let dir = qwen_dir();
    let tj = read_json(&dir.join("tokenizer.json"));
    let meta = read_json(&dir.join("gguf_vocab_meta.json"));
    let n = meta["n_tokens"].as_u64().expect("n_tokens") as usize;
    let mut tokens = vec![String::new(); n];
    for (t, id) in tj["model"]["vocab"].as_object().expect("vocab") {
        tokens[id.as_u64().expect("id") as usize] = t.clone();
    }
    for t in tj["added_tokens"].as_array().expect("added_tokens") {
        tokens[t["id"].as_u64().expect("id") as usize] =
            t["content"].as_str().expect("content").to_string();
    }
    let merges = tj["model"]["merges"]
        .as_array()
        .expect("merges")
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(p) => format!(
                "{} {}",
                p[0].as_str().unwrap_or(""),
                p[1].as_str().unwrap_or("")
            ),
            _ => panic!("bad merge {m}"),
        })
        .collect();
    let mut types = vec![1i32; n];
    for pair in meta["non_normal_token_types"].as_array().expect("types") {
        types[pair[0].as_u64().expect("id") as usize] = pair[1].as_i64().expect("type") as i32;
    }
    let id = |k: &str| meta[k].as_u64().map(|v| v as u32);
    GgufVocab {
        model: meta["model"].as_str().expect("model").to_string(),
        pre: meta["pre"].as_str().map(str::to_string),
        tokens,
        token_types: Some(types),
        merges,
        bos_id: id("bos_id"),
        eos_id: id("eos_id"),
        eot_id: id("eot_id"),
        eom_id: id("eom_id"),
        pad_id: id("pad_id"),
        add_bos: meta["add_bos"].as_bool(),
        add_eos: meta["add_eos"].as_bool(),
    }
}

/// The GGUF-path tokenizer, built once per test binary.
pub fn gguf_tokenizer() -> &'static Tokenizer {
    static TK: OnceLock<Tokenizer> = OnceLock::new();
    TK.get_or_init(|| Tokenizer::from_gguf_vocab(&gguf_vocab()).expect("build from GGUF vocab"))
}

pub fn ids_list(v: &serde_json::Value) -> Vec<Vec<u32>> {
    serde_json::from_value(v.clone()).expect("list of id lists")
}

/// A short, printable description of a corpus string.
pub fn show(s: &str) -> String {
    let t: String = s.chars().take(60).collect();
    format!("{t:?}{}", if s.chars().count() > 60 { "..." } else { "" })
}
