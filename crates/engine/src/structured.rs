//! Structured output: constrained decoding with [`llguidance`].
//!
//! A [`Constraint`] (JSON object, JSON schema, Lark grammar) is compiled once per request by a
//! [`StructuredEnv`] into a [`ConstraintMatcher`], which then runs alongside the sequence:
//!
//! 1. [`ConstraintMatcher::allowed_mask`] sets the logit of every token the grammar does not
//!    allow next to `-inf` (once the grammar is complete only end-of-generation tokens remain);
//! 2. the caller samples from the masked logits;
//! 3. [`ConstraintMatcher::consume`] advances the grammar by the sampled token.
//!
//! The [`StructuredEnv`] holds what is per model and immutable: the token trie (every token id
//! -> its bytes, special tokens marked with [`TokTrie::SPECIAL_TOKEN_MARKER`] so the grammar
//! never matches them as text) and llguidance's [`ParserFactory`]. It is built once per model
//! (1.0-1.4 s for the 151,936-id Qwen2.5 vocabulary on a busy 2-core machine: trie ~0.3 s,
//! llguidance's token-class slices the rest; see [`StructuredEnv::build_time`])
//! and shared behind an `Arc`; [`LazyStructuredEnv`] builds it on first use, on the thread that
//! asks, so models that never see a constrained request never pay for it.
//!
//! **Vocabulary padding.** The trie covers exactly the model's `n_vocab` ids. Ids the tokenizer
//! does not know (padding rows of the output head) and tokens without bytes get no trie entry,
//! so they are never allowed; tokenizer ids at or above `n_vocab` are dropped.
//!
//! **JSON whitespace.** Unless the schema sets llguidance's own options (an `"x-guidance"`
//! object at its top level), JSON may have whitespace between tokens, but at most
//! [`MAX_JSON_WHITESPACE`] characters at a time: small models otherwise tend to loop on
//! newlines inside a JSON value until `max_tokens`.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kapitsa_text::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;

/// Longest run of whitespace allowed between two JSON tokens (see the module docs).
pub const MAX_JSON_WHITESPACE: usize = 24;

/// Longest error message passed on from llguidance (its messages can hold a whole grammar).
const MAX_ERROR_CHARS: usize = 600;

/// What the output of a request must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Any JSON object (OpenAI `response_format: {"type": "json_object"}`); the same as the
    /// schema `{"type": "object"}`.
    JsonObject,
    /// A JSON value valid under this JSON schema (OpenAI `json_schema`). Local `$ref`s
    /// (`#/$defs/...`) are supported, remote ones are not.
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

/// Errors of constrained decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StructuredError {
    /// The model's tokenizer cannot drive a constraint (no end-of-generation token, ...).
    #[error("constrained decoding is not available for this model: {0}")]
    Unavailable(String),
    /// The JSON schema is malformed or uses something llguidance does not support.
    #[error("invalid JSON schema: {0}")]
    InvalidSchema(String),
    /// The Lark grammar does not compile.
    #[error("invalid grammar: {0}")]
    InvalidGrammar(String),
    /// The constraint failed while generating (a token it did not allow, a grammar that
    /// allows nothing, a step over llguidance's work limits).
    #[error("constrained decoding failed: {0}")]
    Failed(String),
    /// Logits shorter than the vocabulary the constraint was built for.
    #[error("logits have {got} entries, the vocabulary has {want}")]
    LogitsShape {
        /// Entries given.
        got: usize,
        /// The model's `n_vocab`.
        want: usize,
    },
}

/// Shorten an llguidance message to its first lines, at most [`MAX_ERROR_CHARS`].
fn short(msg: impl std::fmt::Display) -> String {
    let s = msg.to_string();
    let s = s.trim();
    if s.chars().count() <= MAX_ERROR_CHARS {
        return s.to_string();
    }
    let mut out: String = s.chars().take(MAX_ERROR_CHARS).collect();
    out.push_str(" ...");
    out
}

/// Our tokenizer as llguidance sees it: the trie plus tokenisation of forced text.
struct KapitsaTokEnv {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
    n_vocab: usize,
}

impl TokenizerEnv for KapitsaTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Tokenise with the model's own tokenizer (special tokens are not parsed); bytes that are
    /// not UTF-8, or that give ids outside the model's vocabulary, fall back to the trie's
    /// greedy tokenisation.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        if let Ok(text) = std::str::from_utf8(s) {
            if let Ok(ids) = self.tok.encode(text, false, false) {
                if ids.iter().all(|&t| (t as usize) < self.n_vocab) {
                    return ids;
                }
            }
        }
        self.trie.greedy_tokenize(s)
    }
}

/// Every id in `0..n_vocab` -> its bytes as toktrie wants them: special (control) tokens get
/// the [`TokTrie::SPECIAL_TOKEN_MARKER`] prefix, ids the tokenizer does not have are empty.
fn trie_words(tok: &Tokenizer, n_vocab: usize) -> Vec<Vec<u8>> {
    (0..n_vocab)
        .map(|id| {
            // `n_vocab` was checked to fit in u32 by the caller.
            let id = id as u32;
            match tok.token_bytes_ref(id) {
                None | Some([]) => Vec::new(),
                Some(b) if tok.is_special(id) => {
                    let mut w = Vec::with_capacity(b.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(b);
                    w
                }
                Some(b) => b.to_vec(),
            }
        })
        .collect()
}

/// Per-model state of constrained decoding: the token trie and llguidance's parser factory.
/// Immutable once built; share it with an `Arc`.
pub struct StructuredEnv {
    factory: ParserFactory,
    n_vocab: usize,
    eos: Vec<u32>,
    build_time: Duration,
}

impl std::fmt::Debug for StructuredEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StructuredEnv")
            .field("n_vocab", &self.n_vocab)
            .field("eos", &self.eos)
            .field("build_time", &self.build_time)
            .finish_non_exhaustive()
    }
}

impl StructuredEnv {
    /// Build the trie of `tok` over the model's `n_vocab` ids (`n_vocab` may be larger than
    /// the tokenizer's vocabulary: padding ids are never allowed) and the parser factory.
    /// End-of-generation ids are the tokenizer's [`Tokenizer::eog_ids`] below `n_vocab`.
    pub fn new(tok: Arc<Tokenizer>, n_vocab: usize) -> Result<StructuredEnv, StructuredError> {
        let t0 = Instant::now();
        let unavailable = |m: String| Err(StructuredError::Unavailable(m));
        let Ok(n_vocab_u32) = u32::try_from(n_vocab) else {
            return unavailable(format!("vocabulary of {n_vocab} ids"));
        };
        if n_vocab == 0 {
            return unavailable("empty vocabulary".into());
        }
        let mut eos: Vec<u32> = tok
            .eog_ids()
            .iter()
            .copied()
            .filter(|&t| t < n_vocab_u32)
            .collect();
        // The primary EOS first (llguidance reports it as "the" EOS token).
        if let Some(p) = tok.eos_id().filter(|&t| t < n_vocab_u32) {
            eos.retain(|&t| t != p);
            eos.insert(0, p);
        }
        if eos.is_empty() {
            return unavailable("the tokenizer has no end-of-generation token".into());
        }
        let words = trie_words(&tok, n_vocab);
        let info = TokRxInfo::new(n_vocab_u32, eos[0]);
        // toktrie asserts on malformed input (e.g. a token longer than it can store); turn
        // that into an error instead of taking the caller down.
        let built = std::panic::catch_unwind(|| TokTrie::from(&info, &words).with_eos_tokens(&eos));
        let trie = match built {
            Ok(t) => t,
            Err(_) => return unavailable("building the token trie failed".into()),
        };
        let env: TokEnv = Arc::new(KapitsaTokEnv { trie, tok, n_vocab });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| {
            StructuredError::Unavailable(format!("llguidance setup failed: {}", short(e)))
        })?;
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(StructuredEnv {
            factory,
            n_vocab,
            eos,
            build_time: t0.elapsed(),
        })
    }

    /// The model vocabulary size the trie covers (= the length of the logits it masks).
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// End-of-generation ids the constraint allows once the grammar is complete.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// How long [`StructuredEnv::new`] took.
    pub fn build_time(&self) -> Duration {
        self.build_time
    }

    /// Compile `c` into a matcher for one sequence (typically a few milliseconds; large
    /// schemas more). Schema and grammar errors are reported here, not while generating.
    pub fn compile(&self, c: &Constraint) -> Result<ConstraintMatcher, StructuredError> {
        let (grammar, bad): (TopLevelGrammar, fn(String) -> StructuredError) = match c {
            Constraint::JsonObject => (
                TopLevelGrammar::from_json_schema(json_options(
                    serde_json::json!({"type": "object"}),
                )),
                StructuredError::InvalidSchema,
            ),
            Constraint::JsonSchema(schema) => {
                if !schema.is_object() {
                    return Err(StructuredError::InvalidSchema(
                        "the schema must be a JSON object".into(),
                    ));
                }
                (
                    TopLevelGrammar::from_json_schema(json_options(schema.clone())),
                    StructuredError::InvalidSchema,
                )
            }
            Constraint::Lark(src) => (
                TopLevelGrammar::from_lark(src.clone()),
                StructuredError::InvalidGrammar,
            ),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| bad(short(e)))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(bad(short(e)));
        }
        // Some grammars compile but fail on their first token (a schema that is only
        // `{"$ref": "#"}` admits no value): computing the first mask now reports them as a bad
        // constraint of the request instead of a generation failure. The mask does not change
        // the matcher's state.
        match matcher.compute_mask() {
            Err(e) => return Err(bad(short(e))),
            Ok(mask) if mask.is_zero() => {
                return Err(bad("the constraint admits no output at all".into()))
            }
            Ok(_) => {}
        }
        Ok(ConstraintMatcher {
            matcher,
            n_vocab: self.n_vocab,
            eos: self.eos.clone(),
        })
    }
}

/// `schema` with the JSON options [`StructuredEnv::compile`] gives JSON schemas (whitespace
/// runs of at most [`MAX_JSON_WHITESPACE`] characters) unless it sets its own `"x-guidance"`;
/// for schemas embedded in a [`Constraint::Lark`] grammar with `%json { ... }`, which
/// llguidance compiles with the options found there. Non-objects are returned unchanged.
pub fn with_json_options(schema: Value) -> Value {
    json_options(schema)
}

/// Add our JSON options (bounded whitespace) to a schema object unless it brings its own
/// `"x-guidance"` options.
fn json_options(mut schema: Value) -> Value {
    if let Value::Object(o) = &mut schema {
        if !o.contains_key("x-guidance") {
            let opts = JsonCompileOptions {
                whitespace_pattern: Some(format!(r"[\x20\x0A\x0D\x09]{{1,{MAX_JSON_WHITESPACE}}}")),
                ..Default::default()
            };
            if let Ok(v) = serde_json::to_value(&opts) {
                o.insert("x-guidance".into(), v);
            }
        }
    }
    schema
}

/// The grammar state of one sequence.
pub struct ConstraintMatcher {
    matcher: Matcher,
    n_vocab: usize,
    /// End-of-generation ids (allowed once the grammar can end).
    eos: Vec<u32>,
}

impl std::fmt::Debug for ConstraintMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintMatcher")
            .field("n_vocab", &self.n_vocab)
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Clone for ConstraintMatcher {
    /// An independent copy in the same state (e.g. for the `n` choices of one request).
    fn clone(&self) -> Self {
        ConstraintMatcher {
            matcher: self.matcher.deep_clone(),
            n_vocab: self.n_vocab,
            eos: self.eos.clone(),
        }
    }
}

impl ConstraintMatcher {
    /// Set `logits[i] = -inf` for every token `i` the grammar does not allow next.
    ///
    /// `logits`: `[n_vocab]` (longer rows are accepted; the extra entries are disallowed).
    /// Once the grammar is complete only the end-of-generation tokens stay. Fails if the
    /// grammar allows no token at all or llguidance fails; the sequence must then end.
    pub fn allowed_mask(&mut self, logits: &mut [f32]) -> Result<(), StructuredError> {
        if logits.len() < self.n_vocab {
            return Err(StructuredError::LogitsShape {
                got: logits.len(),
                want: self.n_vocab,
            });
        }
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| StructuredError::Failed(short(e)))?;
        if mask.is_zero() {
            return Err(StructuredError::Failed(
                "the grammar allows no token".into(),
            ));
        }
        let (head, tail) = logits.split_at_mut(self.n_vocab);
        for (chunk, &bits) in head.chunks_mut(32).zip(mask.as_slice()) {
            match bits {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                _ => {
                    for (j, x) in chunk.iter_mut().enumerate() {
                        if bits & (1 << j) == 0 {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        // A mask shorter than the vocabulary (never with toktrie, which sizes it to the trie)
        // would leave the last ids untouched: disallow them too.
        let covered = mask.as_slice().len() * 32;
        if covered < head.len() {
            head[covered..].fill(f32::NEG_INFINITY);
        }
        tail.fill(f32::NEG_INFINITY);
        Ok(())
    }

    /// Advance the grammar by the sampled `token` (an end-of-generation token is accepted
    /// when the grammar can end here). Fails if the grammar does not allow it.
    pub fn consume(&mut self, token: u32) -> Result<(), StructuredError> {
        if token as usize >= self.n_vocab {
            return Err(StructuredError::Failed(format!(
                "token {token} is outside the vocabulary ({})",
                self.n_vocab
            )));
        }
        if self.is_finished() {
            // llguidance refuses every token once it has stopped; the end-of-generation
            // tokens its mask still allows are fine.
            return if self.eos.contains(&token) {
                Ok(())
            } else {
                Err(StructuredError::Failed(format!(
                    "token {token} after the end of the grammar"
                )))
            };
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| StructuredError::Failed(short(e)))
    }

    /// Whether the grammar is complete: nothing but an end-of-generation token may follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// Whether the grammar would accept ending here (an end-of-generation token is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// A [`StructuredEnv`] built on first use (by whichever thread first needs it; others wait
/// for it), then shared. A failed build is remembered and reported to every later caller.
pub struct LazyStructuredEnv {
    tok: Arc<Tokenizer>,
    n_vocab: usize,
    cell: OnceLock<Result<Arc<StructuredEnv>, StructuredError>>,
}

impl std::fmt::Debug for LazyStructuredEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyStructuredEnv")
            .field("n_vocab", &self.n_vocab)
            .field("built", &self.cell.get().is_some())
            .finish_non_exhaustive()
    }
}

impl LazyStructuredEnv {
    /// Nothing is built yet.
    pub fn new(tok: Arc<Tokenizer>, n_vocab: usize) -> LazyStructuredEnv {
        LazyStructuredEnv {
            tok,
            n_vocab,
            cell: OnceLock::new(),
        }
    }

    /// The environment, built now if this is the first call.
    pub fn get(&self) -> Result<Arc<StructuredEnv>, StructuredError> {
        self.cell
            .get_or_init(|| StructuredEnv::new(self.tok.clone(), self.n_vocab).map(Arc::new))
            .clone()
    }

    /// Compile `c` (building the environment first if needed).
    pub fn compile(&self, c: &Constraint) -> Result<ConstraintMatcher, StructuredError> {
        self.get()?.compile(c)
    }
}

/// Apply `m` (if any) to a copy of `row`: the logits a constrained sequence samples from.
/// Returns `None` when there is no constraint (sample from `row` itself).
pub fn masked_row(
    m: Option<&mut ConstraintMatcher>,
    row: &[f32],
) -> Result<Option<Vec<f32>>, StructuredError> {
    let Some(m) = m else { return Ok(None) };
    let mut l = row.to_vec();
    m.allowed_mask(&mut l)?;
    Ok(Some(l))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level tokenizer.json with 256 byte tokens, a few merges' worth of multi-byte
    /// tokens and two specials.
    fn tiny_tokenizer() -> Arc<Tokenizer> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny/qwen2-a/tokenizer.json");
        let gen = serde_json::json!({"eos_token_id": [399, 397]});
        let cfg = serde_json::json!({"eos_token": "<|im_end|>"});
        Arc::new(Tokenizer::from_tokenizer_json(&path, Some(&cfg), Some(&gen)).unwrap())
    }

    /// Greedy decoding under `c` from logits that prefer `pref` (bytes) in turn, then EOS.
    fn drive(env: &StructuredEnv, tok: &Tokenizer, c: &Constraint, pref: &[u8]) -> String {
        let mut m = env.compile(c).unwrap();
        let mut out = Vec::new();
        for step in 0..200 {
            let mut l = vec![0.0f32; env.n_vocab()];
            // Prefer the byte token of the next wanted byte, else the EOS tokens.
            match pref.get(step) {
                Some(&b) => {
                    let id = (0..tok.vocab_size() as u32)
                        .find(|&i| tok.token_bytes_ref(i) == Some(&[b][..]))
                        .unwrap();
                    l[id as usize] = 10.0;
                }
                None => {
                    for &e in env.eos_ids() {
                        l[e as usize] = 10.0;
                    }
                }
            }
            m.allowed_mask(&mut l).unwrap();
            let t = crate::sampler::argmax(&l) as u32;
            if env.eos_ids().contains(&t) {
                assert!(m.is_accepting());
                m.consume(t).unwrap();
                return String::from_utf8(out).unwrap();
            }
            m.consume(t).unwrap();
            out.extend_from_slice(tok.token_bytes_ref(t).unwrap());
        }
        panic!("no end");
    }

    #[test]
    fn json_schema_is_enforced() {
        let tok = tiny_tokenizer();
        // 8 padding ids beyond the tokenizer's 400.
        let env = StructuredEnv::new(tok.clone(), 408).unwrap();
        assert_eq!(env.eos_ids()[0], 399);
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
            "required": ["a", "b"],
            "additionalProperties": false
        });
        let c = Constraint::JsonSchema(schema);
        // The preferred text is valid: it comes out unchanged.
        let s = drive(&env, &tok, &c, br#"{"a":12,"b":"y"}"#);
        assert_eq!(s, r#"{"a":12,"b":"y"}"#);
        // Preferring garbage still gives valid JSON (the mask overrides the logits).
        let s = drive(&env, &tok, &c, b"hello world");
        let v: Value = serde_json::from_str(&s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        // (`-0` is a valid integer in JSON schema; serde_json reads it as a float.)
        let a = v["a"].as_f64().unwrap_or(0.5);
        assert!(a.fract() == 0.0 && (v["b"] == "x" || v["b"] == "y"), "{s}");
    }

    #[test]
    fn mask_never_allows_padding_or_specials() {
        let tok = tiny_tokenizer();
        let env = StructuredEnv::new(tok.clone(), 408).unwrap();
        let mut m = env.compile(&Constraint::JsonObject).unwrap();
        let mut l = vec![1.0f32; 410];
        m.allowed_mask(&mut l).unwrap();
        assert!(l[400..].iter().all(|&x| x == f32::NEG_INFINITY));
        // <|endoftext|>, <|im_start|>, <|im_end|>: not before the object is complete.
        assert!(l[397..400].iter().all(|&x| x == f32::NEG_INFINITY));
        let allowed: Vec<usize> = (0..410).filter(|&i| l[i] == 1.0).collect();
        assert!(!allowed.is_empty());
        for &i in &allowed {
            let b = tok.token_bytes_ref(i as u32).unwrap();
            assert!(b[0] == b'{' || b[0].is_ascii_whitespace(), "{b:?}");
        }
        assert!(matches!(
            m.allowed_mask(&mut [0.0; 10]),
            Err(StructuredError::LogitsShape { got: 10, want: 408 })
        ));
        // A disallowed token is an error, not a panic.
        let x = (0..400u32)
            .find(|&i| tok.token_bytes_ref(i) == Some(&b"x"[..]))
            .unwrap();
        assert!(matches!(m.consume(x), Err(StructuredError::Failed(_))));
    }

    #[test]
    fn complete_grammar_allows_only_eos() {
        let tok = tiny_tokenizer();
        let env = StructuredEnv::new(tok.clone(), 400).unwrap();
        let c = Constraint::Lark("start: \"ok\"".into());
        let mut m = env.compile(&c).unwrap();
        for &b in b"ok" {
            let id = (0..400u32)
                .find(|&i| tok.token_bytes_ref(i) == Some(&[b][..]))
                .unwrap();
            m.consume(id).unwrap();
        }
        assert!(m.is_finished());
        let mut l = vec![0.0f32; 400];
        m.allowed_mask(&mut l).unwrap();
        let allowed: Vec<u32> = (0..400u32).filter(|&i| l[i as usize] == 0.0).collect();
        let mut eos = env.eos_ids().to_vec();
        eos.sort_unstable();
        assert_eq!(allowed, eos);
    }

    #[test]
    fn bad_constraints_are_errors() {
        let tok = tiny_tokenizer();
        let env = StructuredEnv::new(tok, 400).unwrap();
        for schema in [
            serde_json::json!({"type": "no-such-type"}),
            serde_json::json!({"type": "string", "minLength": "three"}),
            serde_json::json!({"$ref": "#/$defs/missing"}),
            serde_json::json!(["not", "an", "object"]),
            // Refers to itself only: compiles, but admits no value at all.
            serde_json::json!({"$ref": "#"}),
        ] {
            let e = env.compile(&Constraint::JsonSchema(schema.clone()));
            assert!(
                matches!(e, Err(StructuredError::InvalidSchema(_))),
                "{schema}: {e:?}"
            );
        }
        let e = env.compile(&Constraint::Lark("start: (".into()));
        assert!(
            matches!(e, Err(StructuredError::InvalidGrammar(_))),
            "{e:?}"
        );
    }

    #[test]
    fn no_eos_is_unavailable() {
        let tok = tiny_tokenizer();
        // A model vocabulary that stops before every end-of-generation id.
        let e = StructuredEnv::new(tok, 300).unwrap_err();
        assert!(matches!(e, StructuredError::Unavailable(_)), "{e}");
    }
}
