//! Token ids for the committed corpus must equal the reference implementations exactly:
//! transformers for the tokenizer.json path, llama.cpp's `llama-tokenize` for the GGUF path.

mod common;

use common::*;
use kapitsa_text::Tokenizer;

fn compare(tk: &Tokenizer, expected: &serde_json::Value, label: &str) {
    let texts = corpus();
    for (key, parse_special) in [("parse_special", true), ("no_parse_special", false)] {
        let want = ids_list(&expected[key]);
        assert_eq!(want.len(), texts.len(), "{label}/{key}: fixture length");
        let mut bad = Vec::new();
        for (i, (text, want)) in texts.iter().zip(&want).enumerate() {
            let got = tk.encode(text, false, parse_special).expect("encode");
            if &got != want {
                bad.push(format!(
                    "#{i} {}: got {:?} want {:?}",
                    show(text),
                    &got[..got.len().min(24)],
                    &want[..want.len().min(24)]
                ));
            }
        }
        println!(
            "{label} {key}: {}/{} strings match",
            texts.len() - bad.len(),
            texts.len()
        );
        assert!(
            bad.is_empty(),
            "{label} {key}: {} mismatches:\n{}",
            bad.len(),
            bad.join("\n")
        );
    }
}

#[test]
fn tokenizer_json_matches_transformers() {
    let expected = read_json(&qwen_dir().join("expected_transformers.json"));
    let tk = json_tokenizer();
    compare(tk, &expected, "tokenizer.json vs transformers");
    // Decoding the ids gives what transformers' decode gives.
    let texts = corpus();
    let ids = ids_list(&expected["parse_special"]);
    let decoded: Vec<String> =
        serde_json::from_value(expected["decoded"].clone()).expect("decoded");
    for ((text, ids), want) in texts.iter().zip(&ids).zip(&decoded) {
        assert_eq!(
            &tk.decode(ids, false).expect("decode"),
            want,
            "decode of {}",
            show(text)
        );
    }
}

#[test]
fn gguf_vocab_matches_llama_cpp() {
    let expected = read_json(&qwen_dir().join("expected_llama_cpp.json"));
    compare(gguf_tokenizer(), &expected, "GGUF vocab vs llama.cpp");
}

#[test]
fn roundtrip_and_metadata() {
    for tk in [json_tokenizer(), gguf_tokenizer()] {
        assert_eq!(tk.vocab_size(), 151_936);
        assert_eq!(tk.token_to_id("<|im_end|>"), Some(151_645));
        assert_eq!(tk.token_to_id("<tool_call>"), Some(151_657));
        assert!(tk.is_special(151_645));
        assert!(
            !tk.is_special(151_657),
            "<tool_call> is user-defined, rendered as text"
        );
        // Qwen2.5 adds no BOS.
        assert_eq!(
            tk.encode("hi", true, true).expect("encode"),
            tk.encode("hi", false, true).expect("encode")
        );
        if std::ptr::eq(tk, gguf_tokenizer()) {
            // llama.cpp does not normalise, so every string round-trips (the tokenizer.json
            // path applies NFC; its decode is checked against transformers above).
            for text in corpus() {
                let ids = tk.encode(&text, false, true).expect("encode");
                assert_eq!(
                    tk.decode(&ids, false).expect("decode"),
                    text,
                    "roundtrip {}",
                    show(&text)
                );
            }
        }
        let ids = tk
            .encode("<|im_start|>user\nhi<|im_end|>", false, true)
            .expect("encode");
        assert_eq!(tk.decode(&ids, true).expect("decode"), "user\nhi");
        assert!(tk.decode(&[u32::MAX], false).is_err());
        assert_eq!(
            tk.token_bytes(tk.token_to_id("Ġhello").expect("Ġhello")),
            Some(b" hello".to_vec())
        );
        assert_eq!(tk.token_bytes(1_000_000), None);
    }
    // llama.cpp: EOS, <|endoftext|>, <|im_end|>, the FIM pad / repo / file-sep tokens, and the
    // plain vocabulary token "</s>" (llama.cpp logs "control-looking token: 128247 '</s>'" and
    // makes it a control token).
    assert_eq!(
        gguf_tokenizer().eog_ids(),
        &[128_247, 151_643, 151_645, 151_662, 151_663, 151_664]
    );
    assert!(gguf_tokenizer().is_special(128_247));
    assert!(!json_tokenizer().is_special(128_247));
    assert_eq!(
        json_tokenizer().eog_ids(),
        &[151_643, 151_645, 151_662, 151_663, 151_664]
    );
    assert_eq!(gguf_tokenizer().bos_id(), Some(151_643));
    assert!(!gguf_tokenizer().adds_bos());
    assert!(!json_tokenizer().adds_bos());
}

/// With `KAPITSA_MODELS` set (folder containing qwen2.5-coder-0.5b-instruct-q4_k_m.gguf), read
/// the vocabulary from the real GGUF, check it equals the one rebuilt from the fixtures, and
/// compare with llama.cpp again. Skipped otherwise.
#[test]
fn real_gguf_if_available() {
    let Some(dir) = std::env::var_os("KAPITSA_MODELS") else {
        println!("KAPITSA_MODELS not set; skipping");
        return;
    };
    let path = std::path::Path::new(&dir).join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    if !path.exists() {
        println!("{} missing; skipping", path.display());
        return;
    }
    let real = gguf_meta::vocab_from_gguf(&path);
    assert_eq!(
        real,
        gguf_vocab(),
        "GGUF metadata differs from the fixture rebuild"
    );
    let tk = Tokenizer::from_gguf_vocab(&real).expect("build");
    let expected = read_json(&qwen_dir().join("expected_llama_cpp.json"));
    compare(&tk, &expected, "real GGUF vs llama.cpp");
}

/// The Qwen3.5 (`qwen35`) and Nemotron 3 (`pixtral`, llama3 regex + ignore_merges)
/// pre-tokenizers, checked on the Qwen2.5 vocabulary re-labelled with those `pre` values,
/// against llama.cpp run on a vocab-only copy of the GGUF with the same change.
#[test]
fn other_pre_tokenizers_match_llama_cpp() {
    let texts = corpus();
    for pre in ["qwen35", "pixtral"] {
        let path = qwen_dir().join(format!("expected_llama_cpp_pre_{pre}.json"));
        let expected = read_json(&path);
        let mut v = gguf_vocab();
        v.pre = Some(pre.to_string());
        let tk = Tokenizer::from_gguf_vocab(&v).expect("build");
        let want = ids_list(&expected["parse_special"]);
        assert_eq!(want.len(), texts.len());
        let mut bad = Vec::new();
        for (i, (text, want)) in texts.iter().zip(&want).enumerate() {
            let got = tk.encode(text, false, true).expect("encode");
            if &got != want {
                bad.push(format!(
                    "#{i} {}: got {:?} want {:?}",
                    show(text),
                    &got[..got.len().min(24)],
                    &want[..want.len().min(24)]
                ));
            }
        }
        println!(
            "pre={pre} vs llama.cpp: {}/{} strings match",
            texts.len() - bad.len(),
            texts.len()
        );
        assert!(
            bad.is_empty(),
            "pre={pre}: {} mismatches:\n{}",
            bad.len(),
            bad.join("\n")
        );
    }
    // "pixtral" adds BOS by default in llama.cpp, unless the GGUF says otherwise.
    let mut v = gguf_vocab();
    v.pre = Some("pixtral".into());
    v.add_bos = None;
    let tk = Tokenizer::from_gguf_vocab(&v).expect("build");
    assert_eq!(tk.encode("a", true, true).expect("encode")[0], 151_643);
}
