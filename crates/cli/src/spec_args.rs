//! The speculative-decoding options `run`, `chat`, `serve` and `bench` share, and the
//! summary line they print.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use kapitsa_engine::{EngineMetrics, OpenedModel, SpecConfig, SpecMode};
use kapitsa_models::LoadMode;

/// Speculative decoding (`--spec`, `--draft-model`, `--spec-max`).
#[derive(Args, Clone, Debug)]
pub struct SpecArgs {
    /// Speculative decoding: off, auto (the engine picks n-gram matching or the drafter per
    /// request and step, and stops when it does not pay), ngram (prompt lookup and recent
    /// requests), draft (a --draft-model), dflash (a DFlash --draft-model), mtp (the
    /// model's own multi-token-prediction head, Qwen3.5/3.6 and Nemotron 3 files that have
    /// one). The output is the same as without.
    #[arg(long = "spec", default_value = "off", value_parser = parse_mode)]
    pub mode: SpecMode,
    /// A small model with the same tokenizer that proposes tokens (e.g. Qwen2.5-Coder-0.5B
    /// for the 1.5B; attention-only architectures: qwen2, qwen3, qwen3moe), or the folder of
    /// a DFlash / DFlash2 drafter made for this model (config.json with `dflash_config` +
    /// model.safetensors), used by `--spec dflash` and `auto`.
    #[arg(long, value_name = "PATH")]
    pub draft_model: Option<PathBuf>,
    /// Most proposed tokens per sequence and step (0 = 16 in auto, 8 in the other modes).
    #[arg(long, default_value_t = 0)]
    pub spec_max: usize,
}

/// Whether `p` is the folder of a DFlash / DFlash2 drafter: its config.json has a
/// `dflash_config` or names a DFlash architecture.
fn is_dflash_dir(p: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(p.join("config.json")) else {
        return false;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    v.get("dflash_config").is_some()
        || v["architectures"].as_array().is_some_and(|a| {
            a.iter()
                .any(|x| x.as_str().is_some_and(|s| s.contains("DFlash")))
        })
}

fn parse_mode(s: &str) -> std::result::Result<SpecMode, String> {
    s.parse()
}

impl SpecArgs {
    /// The engine settings, loading the draft model beside `target`. Refuses a mode that
    /// cannot run (draft without --draft-model, mtp, dflash) before anything is loaded
    /// beyond the target.
    pub fn config(&self, target: &OpenedModel, load_mode: LoadMode) -> Result<SpecConfig> {
        let (mut draft_model, mut dflash) = (None, None);
        match &self.draft_model {
            // One set of taps feeds one hidden-state drafter: the engine asks the target for
            // the DFlash drafter's layers when it has one, and the MTP head (which wants the
            // last layer's) would never draft.
            Some(p) if self.mode == SpecMode::Mtp && is_dflash_dir(p) => anyhow::bail!(
                "--spec mtp drafts with the model's own MTP head, but --draft-model {} is a \
                 DFlash drafter: use --spec dflash (or auto) with it, or drop --draft-model",
                p.display()
            ),
            Some(p) if is_dflash_dir(p) => {
                let d = kapitsa_models::dflash::Drafter::load(p, &*target.model)
                    .with_context(|| format!("loading the DFlash drafter {}", p.display()))?;
                eprintln!(
                    "drafter: {} ({:?}, block {}, taps {:?})",
                    p.display(),
                    d.kind(),
                    d.block_size(),
                    d.tap_layers()
                );
                dflash = Some(std::sync::Arc::new(d));
            }
            Some(p) => {
                let m = kapitsa_engine::open_draft_model(p, target, load_mode)?;
                eprintln!(
                    "draft model: {} ({} layers, vocab {})",
                    p.display(),
                    m.spec().layers.len(),
                    m.spec().n_vocab
                );
                draft_model = Some(m);
            }
            None => {}
        }
        // The model's own MTP head, when asked for (or in auto, without a DFlash drafter) and
        // the file has one: its weights are uploaded again for the drafter.
        let wants_mtp =
            self.mode == SpecMode::Mtp || (self.mode == SpecMode::Auto && dflash.is_none());
        let mtp = if wants_mtp && target.model.mtp_parts().is_some() {
            let m = kapitsa_models::mtp::MtpDrafter::for_model(&*target.model)
                .context("loading the model's MTP head")?;
            eprintln!("drafter: the model's MTP head");
            Some(std::sync::Arc::new(m))
        } else {
            None
        };
        let cfg = SpecConfig {
            mode: self.mode,
            max_draft: self.spec_max,
            draft_model,
            suffix_tokens: 0,
            dflash,
            mtp,
        };
        cfg.check_mode(self.mode)
            .map_err(anyhow::Error::msg)
            .context("--spec")?;
        Ok(cfg)
    }
}

/// `speculative: ngram 12 rounds, 30/48 accepted (3.5 tokens/round) | draft ...`, or `None`
/// when nothing was proposed.
pub fn summary(m: &EngineMetrics) -> Option<String> {
    let parts: Vec<String> = [
        ("ngram", &m.spec.ngram),
        ("draft", &m.spec.draft),
        ("dflash", &m.spec.dflash),
        ("mtp", &m.spec.mtp),
    ]
    .into_iter()
    .filter(|(_, c)| c.rounds > 0)
    .map(|(name, c)| {
        format!(
            "{name} {} rounds, {}/{} accepted ({:.2} tokens/round)",
            c.rounds,
            c.accepted,
            c.drafted,
            c.mean_accepted_length()
        )
    })
    .collect();
    (!parts.is_empty()).then(|| format!("speculative: {}", parts.join(" | ")))
}
