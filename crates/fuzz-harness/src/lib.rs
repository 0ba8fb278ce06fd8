//! The bodies of the fuzz targets in `fuzz/` (cargo-fuzz, libFuzzer), as plain functions over
//! bytes, so that the replay test (`tests/replay.rs`) can run the committed corpora and every
//! crash reproducer through the same code on the stable toolchain.
//!
//! Contract of every target: any input ends in `Ok` or a typed error, within bounded time and
//! memory; a panic, abort, stack overflow or hang is a bug in the code under test. Targets that
//! need model weights take them from the tiny fixtures (`tests/fixtures/tiny`), with the first
//! input byte choosing the fixture and the rest replacing the part being fuzzed (a GGUF header,
//! a `config.json` plus safetensors header).

mod files;
mod requests;
mod seeds;

pub use files::{chat_template, gguf, gguf_model, hf_dir, tokenizer_json};
pub use requests::{anthropic_request, openai_request};
pub use seeds::seeds;

/// The body of a target: `true` when the input went all the way through (a model loaded and
/// ran, a template rendered, a request succeeded), `false` when it ended in an error.
pub type Target = fn(&[u8]) -> bool;

/// The fuzz targets, by the name of their directory under `fuzz/corpus/`, with their bodies.
pub const TARGETS: [(&str, Target); 7] = [
    ("gguf", gguf),
    ("gguf_model", gguf_model),
    ("hf_dir", hf_dir),
    ("tokenizer_json", tokenizer_json),
    ("chat_template", chat_template),
    ("openai_request", openai_request),
    ("anthropic_request", anthropic_request),
];

/// Call once before fuzzing. libFuzzer's panic hook aborts on every panic, even one the code
/// under test contains on purpose (the `tokenizers` crate's, at `Tokenizer::from_tokenizer_json_bytes`;
/// minijinja's, on the chat template's render thread); this hook stays silent instead. A panic
/// that escapes a target still aborts: libfuzzer-sys catches it at the target's boundary.
pub fn fuzz_init() {
    std::panic::set_hook(Box::new(|_| {}));
}

/// `tests/fixtures` of the repository this crate was built in.
pub fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}
