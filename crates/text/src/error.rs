//! The error type of this crate.

/// Errors returned by tokenizers, detokenizers and chat templates.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The path that failed.
        path: String,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A tokenizer description (tokenizer.json, GGUF vocabulary, config) is malformed or unsupported.
    #[error("invalid tokenizer: {0}")]
    InvalidTokenizer(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not implement.
    #[error("unsupported GGUF pre-tokenizer {pre:?} (supported: {supported})")]
    UnsupportedPreTokenizer {
        /// The value of `tokenizer.ggml.pre`.
        pre: String,
        /// Comma-separated list of supported values.
        supported: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer model this crate does not implement.
    #[error("unsupported GGUF tokenizer model {0:?} (only \"gpt2\" byte-level BPE is supported)")]
    UnsupportedModel(String),
    /// Encoding text failed inside the tokenizer library.
    #[error("encode failed: {0}")]
    Encode(String),
    /// A token id is outside the vocabulary.
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    TokenOutOfRange {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A chat template failed to compile.
    #[error("chat template syntax error: {0}")]
    TemplateSyntax(String),
    /// A chat template failed while rendering (including `raise_exception` calls).
    #[error("chat template render error: {0}")]
    TemplateRender(String),
    /// The arguments passed to a chat template were not of the expected shape.
    #[error("invalid chat template input: {0}")]
    TemplateInput(String),
}

/// Convert a minijinja error into a message that includes its cause chain.
pub(crate) fn jinja_message(err: &minijinja::Error) -> String {
    use std::error::Error as _;
    let mut msg = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}
