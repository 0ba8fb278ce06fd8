//! Reading hyper-parameters from GGUF metadata (`<arch>.<key>`) or an HF `config.json`.

use crate::{ModelError, ModelSource, Result};

/// Typed access to the hyper-parameters of one model, whatever its file format.
pub struct Hparams<'a> {
    src: &'a ModelSource,
    arch: &'a str,
}

impl<'a> Hparams<'a> {
    /// Read from `src`; GGUF keys are prefixed with `arch`.
    pub fn new(src: &'a ModelSource, arch: &'a str) -> Hparams<'a> {
        Hparams { src, arch }
    }

    /// Whether this is a GGUF source.
    pub fn is_gguf(&self) -> bool {
        self.src.gguf().is_some()
    }

    fn hf_value(&self, key: &str) -> Option<&serde_json::Value> {
        let cfg = self.src.hf()?.config();
        // Multimodal configs nest the language model under text_config.
        cfg.get(key)
            .or_else(|| cfg.get("text_config").and_then(|t| t.get(key)))
    }

    /// A usize from GGUF key `<arch>.<gguf_key>` or HF key `hf_key`.
    pub fn usize(&self, gguf_key: &str, hf_key: &str) -> Result<usize> {
        self.usize_opt(gguf_key, hf_key)?.ok_or_else(|| {
            ModelError::Config(format!(
                "missing hyper-parameter {}",
                self.describe(gguf_key, hf_key)
            ))
        })
    }

    /// Like [`Hparams::usize`] but `None` when absent.
    pub fn usize_opt(&self, gguf_key: &str, hf_key: &str) -> Result<Option<usize>> {
        if let Some(g) = self.src.gguf() {
            return Ok(g
                .opt_u32(&format!("{}.{gguf_key}", self.arch))?
                .map(|v| v as usize));
        }
        match self.hf_value(hf_key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
                ModelError::Config(format!(
                    "config.json '{hf_key}' is not a non-negative integer"
                ))
            }),
        }
    }

    /// An f32 from GGUF or HF, `None` when absent.
    pub fn f32_opt(&self, gguf_key: &str, hf_key: &str) -> Result<Option<f32>> {
        if let Some(g) = self.src.gguf() {
            return Ok(g.opt_f32(&format!("{}.{gguf_key}", self.arch))?);
        }
        match self.hf_value(hf_key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| {
                ModelError::Config(format!("config.json '{hf_key}' is not a number"))
            }),
        }
    }

    /// RoPE base: GGUF `rope.freq_base`, HF `rope_theta` or `rope_parameters.rope_theta`.
    pub fn rope_theta(&self, default: f32) -> Result<f32> {
        if let Some(t) = self.f32_opt("rope.freq_base", "rope_theta")? {
            return Ok(t);
        }
        if let Some(t) = self
            .hf_value("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .and_then(|v| v.as_f64())
        {
            return Ok(t as f32);
        }
        Ok(default)
    }

    /// A bool from the HF config (GGUF sources answer `None`).
    pub fn hf_bool(&self, hf_key: &str) -> Option<bool> {
        self.hf_value(hf_key).and_then(|v| v.as_bool())
    }

    fn describe(&self, gguf_key: &str, hf_key: &str) -> String {
        if self.is_gguf() {
            format!("'{}.{gguf_key}'", self.arch)
        } else {
            format!("'{hf_key}' in config.json")
        }
    }
}
