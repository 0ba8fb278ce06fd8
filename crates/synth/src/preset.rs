//! The model presets: production shapes of the target models (see
//! `shared/reference/architectures.md`), layer-count reduction and the test-only width divisor.
//!
//! Dense presets (`qwen2.5-coder-1.5b`, `qwen3-8b`) take their shapes from the models' Hugging
//! Face `config.json`; MoE and hybrid presets from the architecture notes.

use crate::SynthError;

/// Which GGUF architecture (and so which tensor set) a preset is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `qwen35moe`: Gated DeltaNet + gated full attention (every 4th layer), MoE with a gated
    /// shared expert in every layer.
    Qwen35Moe,
    /// `qwen3moe`: GQA attention with q/k norms, routed MoE in every layer.
    Qwen3Moe,
    /// `nemotron_h_moe`: one block per layer, `M` Mamba2, `E` MoE (sigmoid router, relu^2,
    /// shared expert, optional latent projection), `*` NoPE attention.
    NemotronHMoe,
    /// `qwen2`: dense GQA attention with q/k/v biases, SwiGLU MLP (Qwen2 / Qwen2.5).
    Qwen2,
    /// `qwen3`: dense GQA attention with q/k RMS norms and no biases, SwiGLU MLP.
    Qwen3,
}

impl Family {
    /// The GGUF architecture name (`general.architecture`, and the prefix of its keys).
    pub fn arch(self) -> &'static str {
        match self {
            Family::Qwen35Moe => "qwen35moe",
            Family::Qwen3Moe => "qwen3moe",
            Family::NemotronHMoe => "nemotron_h_moe",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }

    /// Whether every layer is alike (any layer count from 1 up is a valid reduction).
    pub fn uniform_layers(self) -> bool {
        matches!(self, Family::Qwen3Moe | Family::Qwen2 | Family::Qwen3)
    }
}

/// A named production shape.
#[derive(Debug, Clone)]
pub struct Preset {
    /// CLI name.
    pub name: &'static str,
    /// One-line description.
    pub about: &'static str,
    /// Tensor set / GGUF architecture.
    pub family: Family,
    /// Production layer pattern, one letter per layer: `L`/`A` (linear / full attention) for
    /// Qwen3.6, `A` for Qwen3 MoE and the dense presets, `M`/`E`/`*` for Nemotron.
    pub pattern: &'static str,
    /// Whether `pattern` is an approximation (the exact production string is not public).
    pub pattern_approximate: bool,
    /// Whether the output head is the token embedding (`tie_word_embeddings`: no
    /// `output.weight` tensor; llama.cpp then reads `token_embd.weight` for both).
    pub tied_embeddings: bool,
    /// Production dimensions.
    pub dims: Dims,
}

/// Every dimension a preset's tensors and metadata need.
#[derive(Debug, Clone, PartialEq)]
pub struct Dims {
    /// Vocabulary rows of `token_embd` / `output`.
    pub n_vocab: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Training context written as `context_length`.
    pub n_ctx: usize,
    /// Attention query heads.
    pub n_head: usize,
    /// Attention KV heads.
    pub n_head_kv: usize,
    /// Dims per attention head.
    pub head_dim: usize,
    /// Rotary dims (0 for NoPE).
    pub n_rot: usize,
    /// Routed experts.
    pub n_expert: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Routed expert FFN width.
    pub n_ff_exp: usize,
    /// Shared expert FFN width (0: none).
    pub n_ff_shexp: usize,
    /// Dense FFN width written as `feed_forward_length`: the MLP width of the dense presets
    /// (Qwen2, Qwen3); written but unused by the graph for Qwen3 MoE.
    pub n_ff_dense: usize,
    /// Latent MoE width (Nemotron 3 Super).
    pub latent: Option<usize>,
    /// Recurrent mixer: conv kernel.
    pub ssm_conv: usize,
    /// Recurrent mixer: state size (Mamba2 `d_state`; GDN key head dim).
    pub ssm_state: usize,
    /// Recurrent mixer: groups (Mamba2 B/C groups; GDN key heads).
    pub ssm_groups: usize,
    /// Recurrent mixer: heads (Mamba2 heads; GDN value heads).
    pub ssm_heads: usize,
    /// Recurrent mixer: dims per head (Mamba2 head dim; GDN value head dim).
    pub ssm_head_dim: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// RoPE base (ignored for NoPE).
    pub rope_theta: f32,
    /// Routed-weight scale (Nemotron `routed_scaling_factor`).
    pub routed_scale: f32,
}

/// Nemotron 3 Nano's published `hybrid_override_pattern`.
const NANO_PATTERN: &str = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME";

/// Stand-in for Nemotron 3 Super's pattern (only the counts M40 / E40 / *8 are public): 40
/// Mamba/MoE pairs in 8 groups of 5, the last pair of each group with an attention block
/// between its M and its E, as in Nano's `MEMEM*E` groups.
const SUPER_PATTERN: &str =
    "MEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*E";

/// Qwen3.6-35B-A3B: `[linear, linear, linear, full] x 10`.
const QWEN36_PATTERN: &str = "LLLALLLALLLALLLALLLALLLALLLALLLALLLALLLA";

/// Qwen2.5-Coder-1.5B: 28 attention layers.
const QWEN25_1_5B_PATTERN: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAA";

/// Qwen3-8B: 36 attention layers.
const QWEN3_8B_PATTERN: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

/// All presets.
pub fn presets() -> Vec<Preset> {
    vec![
        Preset {
            name: "qwen3.6-35b-a3b",
            about: "Qwen3.6-35B-A3B (qwen35moe): 40 layers [3 Gated DeltaNet + 1 gated attention] x 10, 256 experts top-8",
            family: Family::Qwen35Moe,
            pattern: QWEN36_PATTERN,
            pattern_approximate: false,
            tied_embeddings: false,
            dims: Dims {
                n_vocab: 248_320,
                n_embd: 2048,
                n_ctx: 262_144,
                n_head: 16,
                n_head_kv: 2,
                head_dim: 256,
                n_rot: 64,
                n_expert: 256,
                top_k: 8,
                n_ff_exp: 512,
                n_ff_shexp: 512,
                n_ff_dense: 0,
                latent: None,
                ssm_conv: 4,
                ssm_state: 128,
                ssm_groups: 16,
                ssm_heads: 32,
                ssm_head_dim: 128,
                eps: 1e-6,
                rope_theta: 1e7,
                routed_scale: 1.0,
            },
        },
        Preset {
            name: "qwen3-30b-a3b",
            about: "Qwen3-30B-A3B (qwen3moe): 48 attention layers, 128 experts top-8",
            family: Family::Qwen3Moe,
            pattern: "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
            pattern_approximate: false,
            tied_embeddings: false,
            dims: Dims {
                n_vocab: 151_936,
                n_embd: 2048,
                n_ctx: 40_960,
                n_head: 32,
                n_head_kv: 4,
                head_dim: 128,
                n_rot: 128,
                n_expert: 128,
                top_k: 8,
                n_ff_exp: 768,
                n_ff_shexp: 0,
                n_ff_dense: 6144,
                latent: None,
                ssm_conv: 0,
                ssm_state: 0,
                ssm_groups: 0,
                ssm_heads: 0,
                ssm_head_dim: 0,
                eps: 1e-6,
                rope_theta: 1e6,
                routed_scale: 1.0,
            },
        },
        Preset {
            name: "nemotron-3-nano-30b-a3b",
            about: "NVIDIA Nemotron 3 Nano 30B-A3B (nemotron_h_moe): 52 blocks M23/E23/*6, 128 experts top-6",
            family: Family::NemotronHMoe,
            pattern: NANO_PATTERN,
            pattern_approximate: false,
            tied_embeddings: false,
            dims: Dims {
                n_vocab: 131_072,
                n_embd: 2688,
                n_ctx: 262_144,
                n_head: 32,
                n_head_kv: 2,
                head_dim: 128,
                n_rot: 0,
                n_expert: 128,
                top_k: 6,
                n_ff_exp: 1856,
                n_ff_shexp: 3712,
                n_ff_dense: 0,
                latent: None,
                ssm_conv: 4,
                ssm_state: 128,
                ssm_groups: 8,
                ssm_heads: 64,
                ssm_head_dim: 64,
                eps: 1e-5,
                rope_theta: 10_000.0,
                routed_scale: 2.5,
            },
        },
        Preset {
            name: "nemotron-3-super-120b-a12b",
            about: "NVIDIA Nemotron 3 Super 120B-A12B (nemotron_h_moe, latent MoE): 88 blocks M40/E40/*8 (approximate order), 512 experts top-22",
            family: Family::NemotronHMoe,
            pattern: SUPER_PATTERN,
            pattern_approximate: true,
            tied_embeddings: false,
            dims: Dims {
                n_vocab: 131_072,
                n_embd: 4096,
                n_ctx: 262_144,
                n_head: 32,
                n_head_kv: 2,
                head_dim: 128,
                n_rot: 0,
                n_expert: 512,
                top_k: 22,
                n_ff_exp: 2688,
                n_ff_shexp: 5376,
                n_ff_dense: 0,
                latent: Some(1024),
                ssm_conv: 4,
                ssm_state: 128,
                ssm_groups: 8,
                ssm_heads: 128,
                ssm_head_dim: 64,
                eps: 1e-5,
                rope_theta: 10_000.0,
                routed_scale: 5.0,
            },
        },
        Preset {
            name: "qwen2.5-coder-1.5b",
            about: "Qwen2.5-Coder-1.5B (qwen2, dense): 28 layers, GQA 12/2 heads with q/k/v biases, tied embeddings",
            family: Family::Qwen2,
            pattern: QWEN25_1_5B_PATTERN,
            pattern_approximate: false,
            // config.json: "tie_word_embeddings": true (the published GGUFs have no output.weight).
            tied_embeddings: true,
            dims: Dims {
                n_vocab: 151_936,
                n_embd: 1536,
                n_ctx: 32_768,
                n_head: 12,
                n_head_kv: 2,
                head_dim: 128,
                n_rot: 128,
                n_expert: 0,
                top_k: 0,
                n_ff_exp: 0,
                n_ff_shexp: 0,
                n_ff_dense: 8960,
                latent: None,
                ssm_conv: 0,
                ssm_state: 0,
                ssm_groups: 0,
                ssm_heads: 0,
                ssm_head_dim: 0,
                eps: 1e-6,
                rope_theta: 1e6,
                routed_scale: 1.0,
            },
        },
        Preset {
            name: "qwen3-8b",
            about: "Qwen3-8B (qwen3, dense): 36 layers, GQA 32/8 heads with q/k norms, untied output",
            family: Family::Qwen3,
            pattern: QWEN3_8B_PATTERN,
            pattern_approximate: false,
            tied_embeddings: false,
            dims: Dims {
                n_vocab: 151_936,
                n_embd: 4096,
                n_ctx: 40_960,
                n_head: 32,
                n_head_kv: 8,
                head_dim: 128,
                n_rot: 128,
                n_expert: 0,
                top_k: 0,
                n_ff_exp: 0,
                n_ff_shexp: 0,
                n_ff_dense: 12_288,
                latent: None,
                ssm_conv: 0,
                ssm_state: 0,
                ssm_groups: 0,
                ssm_heads: 0,
                ssm_head_dim: 0,
                eps: 1e-6,
                rope_theta: 1e6,
                routed_scale: 1.0,
            },
        },
    ]
}

/// The preset called `name`, or an error listing the known names.
pub fn preset(name: &str) -> Result<Preset, SynthError> {
    presets()
        .into_iter()
        .find(|p| p.name == name)
        .ok_or_else(|| {
            SynthError::Usage(format!(
                "unknown preset '{name}' (known: {})",
                presets()
                    .iter()
                    .map(|p| p.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

impl Preset {
    /// Production layer count.
    pub fn n_layer(&self) -> usize {
        self.pattern.len()
    }

    /// Smallest and largest accepted `--layers`.
    pub fn layer_range(&self) -> (usize, usize) {
        let max = self.n_layer();
        let min = match self.family {
            Family::Qwen35Moe => 4,
            Family::Qwen3Moe | Family::Qwen2 | Family::Qwen3 => 1,
            Family::NemotronHMoe => {
                // The shortest prefix holding every block kind.
                let kinds: Vec<char> = {
                    let mut k: Vec<char> = self.pattern.chars().collect();
                    k.sort_unstable();
                    k.dedup();
                    k
                };
                (1..=max)
                    .find(|&n| kinds.iter().all(|c| self.pattern[..n].contains(*c)))
                    .unwrap_or(max)
            }
        };
        (min, max)
    }

    /// The layer pattern for `layers` layers (`None`: production count).
    ///
    /// - Qwen3.6: a multiple of 4, keeping the `[linear, linear, linear, full]` period.
    /// - Qwen3 MoE and the dense presets: any count (all layers are alike).
    /// - Nemotron: a prefix of the production pattern long enough to hold every block kind
    ///   (`MEMEM*` for Nano; a prefix keeps the local interleaving, so per-block costs and the
    ///   M:E ratio stay close to production).
    pub fn layer_pattern(&self, layers: Option<usize>) -> Result<String, SynthError> {
        let Some(n) = layers else {
            return Ok(self.pattern.to_string());
        };
        let (min, max) = self.layer_range();
        let rule = match self.family {
            Family::Qwen35Moe => {
                "a multiple of 4, keeping the [linear, linear, linear, full] period"
            }
            Family::Qwen3Moe | Family::Qwen2 | Family::Qwen3 => "all layers are alike",
            Family::NemotronHMoe => {
                "a prefix of the block pattern that holds every block kind M, E, *"
            }
        };
        let bad = n < min || n > max || (self.family == Family::Qwen35Moe && n % 4 != 0);
        if bad {
            return Err(SynthError::Usage(format!(
                "--layers {n} is not valid for {}: use {min}..={max} ({rule})",
                self.name
            )));
        }
        Ok(self.pattern[..n].to_string())
    }

    /// The dimensions with the width divided by `div` (1: production). Test-only: keeps the
    /// structure (head dims, state sizes, top-k, GQA) while shrinking hidden size, FFN widths,
    /// head counts, expert count and vocabulary, rounding widths up to multiples of 32 so every
    /// 32-element block type still fits (Qwen2: hidden size = heads x head dim, as its GGUF
    /// has no head-size key).
    pub fn dims(&self, div: usize) -> Dims {
        let d = self.dims.clone();
        if div <= 1 {
            return d;
        }
        let w = |x: usize| (x / div).div_ceil(32).max(1) * 32;
        let c = |x: usize| (x / div).max(1);
        let n_head_kv = c(d.n_head_kv);
        let n_head = c(d.n_head).div_ceil(n_head_kv) * n_head_kv;
        let ssm_groups = if d.ssm_groups == 0 {
            0
        } else {
            c(d.ssm_groups)
        };
        let ssm_heads = if d.ssm_heads == 0 {
            0
        } else {
            c(d.ssm_heads).div_ceil(ssm_groups) * ssm_groups
        };
        // Qwen2 has no head-size key: llama.cpp and Kapitsa derive it as n_embd / n_head, so
        // the hidden size must stay n_head * head_dim.
        let n_embd = if self.family == Family::Qwen2 {
            n_head * d.head_dim
        } else {
            w(d.n_embd)
        };
        Dims {
            n_vocab: (d.n_vocab / div).max(256),
            n_embd,
            n_head,
            n_head_kv,
            n_expert: if d.n_expert == 0 {
                0
            } else {
                c(d.n_expert).max(2 * d.top_k)
            },
            n_ff_exp: if d.n_ff_exp == 0 { 0 } else { w(d.n_ff_exp) },
            n_ff_shexp: if d.n_ff_shexp == 0 {
                0
            } else {
                w(d.n_ff_shexp)
            },
            n_ff_dense: if d.n_ff_dense == 0 {
                0
            } else {
                w(d.n_ff_dense)
            },
            latent: d.latent.map(w),
            ssm_groups,
            ssm_heads,
            ..d
        }
    }
}
