//! Kapitsa text: tokenizers (Hugging Face `tokenizer.json` and GGUF vocabularies), incremental
//! detokenisation and chat templates.
//!
//! - [`Tokenizer`] encodes/decodes text. From `tokenizer.json` it behaves exactly as
//!   `transformers`; from GGUF metadata ([`GgufVocab`]) exactly as llama.cpp.
//! - [`IncrementalDecoder`] turns generated ids into a stream of valid UTF-8 text.
//! - [`ChatTemplate`] renders Hugging Face Jinja chat templates byte-identically to
//!   `transformers`' `apply_chat_template`, within the bounds of [`template_limits`].

#![warn(missing_docs)]

mod bytelevel;
mod chat;
mod detok;
mod error;
mod gguf;
mod pyfmt;
mod tokenizer;

pub use chat::{limits as template_limits, ChatTemplate};
pub use detok::IncrementalDecoder;
pub use error::TextError;
pub use gguf::GgufVocab;
pub use tokenizer::Tokenizer;
