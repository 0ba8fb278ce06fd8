//! Property tests of the incremental detokenizer on the real Qwen2.5 vocabulary.

mod common;

use common::*;
use kapitsa_text::{IncrementalDecoder, Tokenizer};
use proptest::prelude::*;

/// Ids of tokens that are single non-ASCII bytes (pieces of multi-byte UTF-8 characters), plus
/// the ids of a few multi-byte strings split into byte tokens.
fn byte_token_ids(tk: &Tokenizer) -> Vec<u32> {
    (0..tk.vocab_size() as u32)
        .filter(|&id| {
            tk.token_bytes(id)
                .is_some_and(|b| b.len() == 1 && b[0] >= 0x80)
        })
        .collect()
}

fn check(tk: &Tokenizer, ids: &[u32], keep_special: bool) -> Result<(), TestCaseError> {
    let mut dec = IncrementalDecoder::with_special(keep_special);
    let mut out = String::new();
    for &id in ids {
        let chunk = dec.push(tk, id);
        prop_assert!(std::str::from_utf8(chunk.as_bytes()).is_ok());
        out.push_str(&chunk);
    }
    out.push_str(&dec.flush());
    prop_assert!(!dec.has_pending());
    let whole = tk.decode(ids, !keep_special).expect("decode");
    prop_assert_eq!(out, whole);
    Ok(())
}

fn id_strategy() -> impl Strategy<Value = Vec<u32>> {
    let tk = json_tokenizer();
    let bytes = byte_token_ids(tk);
    let n = tk.vocab_size() as u32;
    let one = prop_oneof![
        3 => 0..n,
        4 => proptest::sample::select(bytes),
        1 => proptest::sample::select(vec![151_643u32, 151_644, 151_645, 151_657]),
    ];
    proptest::collection::vec(one, 0..40)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn pushes_concat_to_decode(ids in id_strategy(), keep in any::<bool>()) {
        check(json_tokenizer(), &ids, keep)?;
    }
}

#[test]
fn multibyte_split_across_tokens() {
    let tk = json_tokenizer();
    for text in ["😶‍🌫️ 東京 é", "👨‍👩‍👧‍👦", "क्षत्रिय", "\u{10ffff}"]
    {
        let ids = tk.encode(text, false, true).expect("encode");
        let mut dec = IncrementalDecoder::new();
        let mut out = String::new();
        for &id in &ids {
            let chunk = dec.push(tk, id);
            assert!(
                !chunk.contains('\u{FFFD}'),
                "broken UTF-8 emitted for {text:?}"
            );
            out.push_str(&chunk);
        }
        out.push_str(&dec.flush());
        assert_eq!(out, text);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Arbitrary text never makes either tokenizer fail, and the GGUF path (no normaliser)
    /// always round-trips.
    #[test]
    fn encode_any_text(text in "\\PC{0,48}|[<|>a-z_/ \n]{0,48}", parse_special in any::<bool>()) {
        let gguf = gguf_tokenizer();
        let ids = gguf.encode(&text, false, parse_special).expect("encode");
        prop_assert_eq!(gguf.decode(&ids, false).expect("decode"), text.clone());
        let json = json_tokenizer();
        let ids = json.encode(&text, true, parse_special).expect("encode");
        prop_assert!(json.decode(&ids, false).is_ok());
    }
}

#[test]
fn thread_safety() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    check::<kapitsa_text::ChatTemplate>();
    check::<IncrementalDecoder>();
}
