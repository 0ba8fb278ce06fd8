//! Integration tests for kapitsa-formats (one test binary, several modules).

mod common;
mod gguf_basic;
mod gguf_errors;
mod gguf_fuzz;
mod gguf_real;
mod hf_dir;
mod mlx_quant;
