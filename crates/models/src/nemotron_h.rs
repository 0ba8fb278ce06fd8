//! NVIDIA Nemotron-H and Nemotron 3 (HF `nemotron_h`; GGUF `nemotron_h` for the dense-MLP
//! hybrids, `nemotron_h_moe` for Nemotron 3 Nano / Super).
//!
//! Every layer is one pre-norm residual block of one kind (`hybrid_override_pattern` letters):
//! `M` Mamba2 ([`crate::layers::mamba2`]), `*` attention without positional encoding (GQA),
//! `-` squared-ReLU MLP, `E` MoE (sigmoid router with a selection-only correction bias, top-k,
//! renormalised, times `routed_scaling_factor`; squared-ReLU experts; an ungated shared expert;
//! Nemotron 3 Super's latent MoE projects into a smaller space around the routed experts).
//!
//! The layer kinds are read from which tensors each layer has, the same in every format, so
//! the pattern string and the GGUF per-layer arrays need not be parsed. Norms are plain `w`
//! everywhere; GGUF stores `-exp(A_log)`, HF `A_log`.
//!
//! References: transformers `models/nemotron_h/modeling_nemotron_h.py`; llama.cpp
//! `src/models/nemotron-h.cpp`, `conversion/nemotron.py`.

use std::sync::Arc;

use kapitsa_backend::Backend;
use kapitsa_backend::Mamba2Shape;

use crate::common::{flat_weight, vec_weight};
use crate::config::Hparams;
use crate::layers::attention::Attention;
use crate::layers::decoder::{Block, BlockOp, Decoder, DecoderParts};
use crate::layers::ffn::{Act, Experts, Ffn, Gating, Latent, Mlp, Moe};
use crate::layers::mamba2::Mamba2;
use crate::mtp::MtpParts;
use crate::{
    BatchInputs, CausalLm, KvCache, Logits, ModelError, ModelSource, ModelSpec, Result, Tensor,
};

/// Tensor names: HF `{prefix}{i}.mixer.*` (prefix `backbone.layers.`, `language_model.backbone.layers.`
/// in a vision-language checkpoint, or `mtp.layers.` for the MTP head) or GGUF `blk.{i}.*`.
struct Names {
    gguf: bool,
    prefix: String,
}

impl Names {
    fn layer(&self, i: usize, hf: &str, gguf: &str) -> String {
        if self.gguf {
            format!("blk.{i}.{gguf}")
        } else {
            format!("{}{i}.{hf}", self.prefix)
        }
    }
}

/// The multi-token-prediction head (Nemotron 3 Super; kept for speculative decoding, not run
/// by `forward`). HF `mtp.layers.0` (input fusion + attention) and `mtp.layers.1` (MoE + head
/// norm); GGUF one extra block after the trunk with `nextn.*` tensors.
#[derive(Debug)]
pub struct NemotronMtp {
    /// `[n_embd, 2 n_embd]`: projects `[norm(embed(next)), norm(hidden)]`.
    pub eh_proj: crate::Weight,
    /// Norm of the next token's embedding.
    pub enorm: Vec<f32>,
    /// Norm of the trunk's hidden state.
    pub hnorm: Vec<f32>,
    /// Final head norm.
    pub head_norm: Vec<f32>,
    /// Attention block then MoE block.
    pub blocks: Vec<Block>,
    /// The trunk's final norm `norm_f` `[n_embd]` (the head reads the trunk's hidden after
    /// it, as vLLM and TensorRT-LLM feed it).
    pub out_norm: Vec<f32>,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// A loaded Nemotron-H model.
pub struct NemotronH {
    inner: Decoder,
    mtp: Option<NemotronMtp>,
}

struct Hp {
    n_embd: usize,
    n_layer: usize,
    eps: f32,
    head_dim: usize,
    n_groups: usize,
    top_k: usize,
    norm_topk: bool,
    scale: f32,
    n_ctx_train: usize,
}

fn read_hp(src: &ModelSource, arch: &str) -> Result<Hp> {
    let hp = Hparams::new(src, arch);
    let n_embd = hp.usize("embedding_length", "hidden_size")?;
    let n_head = hp.usize("attention.head_count", "num_attention_heads")?;
    let head_dim = hp
        .usize_opt("attention.key_length", "head_dim")?
        .unwrap_or(n_embd.checked_div(n_head).unwrap_or(0));
    let eps = match hp.f32_opt("attention.layer_norm_rms_epsilon", "layer_norm_epsilon")? {
        Some(e) => e,
        None => hp
            .f32_opt("attention.layer_norm_epsilon", "rms_norm_eps")?
            .unwrap_or(1e-5),
    };
    let scale = hp
        .f32_opt("expert_weights_scale", "routed_scaling_factor")?
        .unwrap_or(1.0);
    let norm_topk = if hp.is_gguf() {
        src.gguf()
            .and_then(|g| {
                g.opt_bool(&format!("{arch}.expert_weights_norm"))
                    .ok()
                    .flatten()
            })
            .unwrap_or(true)
    } else {
        hp.hf_bool("norm_topk_prob").unwrap_or(true)
    };
    let groups = hp.usize_opt("expert_group_count", "n_group")?.unwrap_or(1);
    if groups > 1 {
        return Err(ModelError::Config(format!(
            "{arch}: group-limited expert routing ({groups} groups) is not supported"
        )));
    }
    Ok(Hp {
        n_embd,
        n_layer: match hp.usize_opt("block_count", "num_hidden_layers")? {
            Some(n) => n,
            None => hf_pattern_len(src).ok_or_else(|| {
                ModelError::Config(
                    "config.json has neither num_hidden_layers, layers_block_type nor \
                     hybrid_override_pattern"
                        .into(),
                )
            })?,
        },
        eps,
        head_dim,
        n_groups: hp.usize("ssm.group_count", "n_groups")?,
        top_k: hp
            .usize_opt("expert_used_count", "num_experts_per_tok")?
            .unwrap_or(0),
        norm_topk,
        scale,
        n_ctx_train: hp
            .usize_opt("context_length", "max_position_embeddings")?
            .unwrap_or(4096),
    })
}

/// Layer count of an HF config from its layer pattern (`layers_block_type` list or
/// `hybrid_override_pattern` string).
fn hf_pattern_len(src: &ModelSource) -> Option<usize> {
    let root = src.hf()?.config();
    // a vision-language checkpoint nests the language model's settings in text_config
    let cfg = root.get("text_config").unwrap_or(root);
    if let Some(a) = cfg.get("layers_block_type").and_then(|v| v.as_array()) {
        return Some(a.len());
    }
    cfg.get("hybrid_override_pattern")
        .and_then(|v| v.as_str())
        .map(|s| s.chars().count())
}

impl NemotronH {
    /// Load from GGUF (`nemotron_h`, `nemotron_h_moe`) or an HF directory (`nemotron_h`).
    pub fn load(src: &ModelSource, backend: Arc<dyn Backend>) -> Result<NemotronH> {
        let arch = src.arch()?;
        let hp = read_hp(src, &arch)?;
        // NVIDIA's vision-language checkpoints put the language model under `language_model.`
        let root = if src.gguf().is_none() && src.has("language_model.backbone.embeddings.weight") {
            "language_model."
        } else {
            ""
        };
        let names = Names {
            gguf: src.gguf().is_some(),
            prefix: format!("{root}backbone.layers."),
        };
        let mut hp = hp;
        let n_mtp = if names.gguf {
            Hparams::new(src, &arch)
                .usize_opt("nextn_predict_layers", "")?
                .unwrap_or(0)
        } else if src.has("mtp.layers.0.eh_proj.weight") {
            1
        } else {
            0
        };
        if names.gguf {
            // block_count counts the MTP block appended after the trunk.
            hp.n_layer = hp
                .n_layer
                .checked_sub(n_mtp)
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "{arch}: block_count too small for {n_mtp} MTP layers"
                    ))
                })?;
        }
        let g = |hf: &str, gguf: &str| {
            if names.gguf {
                gguf.to_string()
            } else {
                format!("{root}{hf}")
            }
        };
        let tok_embd = src.weight(&g("backbone.embeddings.weight", "token_embd.weight"))?;
        let out_norm = vec_weight(
            src,
            &g("backbone.norm_f.weight", "output_norm.weight"),
            hp.n_embd,
            0.0,
        )?;
        let output = src.weight_opt(&g("lm_head.weight", "output.weight"))?;
        let parts = DecoderParts {
            arch: arch.clone(),
            n_ctx_train: hp.n_ctx_train,
            n_layer: hp.n_layer,
            rms_eps: hp.eps,
            tok_embd,
            out_norm,
            output,
        };
        let mut blocks = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let norm = vec_weight(
                src,
                &names.layer(i, "norm.weight", "attn_norm.weight"),
                hp.n_embd,
                0.0,
            )?;
            let op = load_block(src, &names, i, &hp, None)?;
            blocks.push(Block { layer: i, norm, op });
        }
        let mtp = if n_mtp > 0 {
            if n_mtp != 1 {
                return Err(ModelError::Config(format!(
                    "{arch}: {n_mtp} MTP layers (only 1 is supported)"
                )));
            }
            let mut m = load_mtp(src, &names, &hp)?;
            m.out_norm.clone_from(&parts.out_norm);
            Some(m)
        } else {
            None
        };
        let mut inner = Decoder::new(parts, blocks, backend)?;
        if mtp.is_some() {
            inner.set_mtp_layers(1);
        }
        Ok(NemotronH { inner, mtp })
    }

    /// The MTP head, when the file has one.
    pub fn mtp(&self) -> Option<&NemotronMtp> {
        self.mtp.as_ref()
    }
}

/// Load the MTP head (see [`NemotronMtp`]).
fn load_mtp(src: &ModelSource, names: &Names, hp: &Hp) -> Result<NemotronMtp> {
    let d = hp.n_embd;
    let v = |name: String| vec_weight(src, &name, d, 0.0);
    if names.gguf {
        let b = hp.n_layer;
        let l = |g: &str| names.layer(b, "", g);
        let attn = load_block(src, names, b, hp, Some(Kind::Attention))?;
        let moe = load_block(src, names, b, hp, Some(Kind::Moe))?;
        Ok(NemotronMtp {
            eh_proj: src.weight(&l("nextn.eh_proj.weight"))?,
            enorm: v(l("nextn.enorm.weight"))?,
            hnorm: v(l("nextn.hnorm.weight"))?,
            head_norm: v(l("nextn.shared_head_norm.weight"))?,
            out_norm: Vec::new(),
            eps: hp.eps,
            blocks: vec![
                Block {
                    layer: b,
                    norm: v(l("attn_norm.weight"))?,
                    op: attn,
                },
                Block {
                    layer: b,
                    norm: v(l("post_attention_norm.weight"))?,
                    op: moe,
                },
            ],
        })
    } else {
        let mtp = Names {
            gguf: false,
            prefix: "mtp.layers.".into(),
        };
        let attn = load_block(src, &mtp, 0, hp, Some(Kind::Attention))?;
        let moe = load_block(src, &mtp, 1, hp, Some(Kind::Moe))?;
        Ok(NemotronMtp {
            eh_proj: src.weight("mtp.layers.0.eh_proj.weight")?,
            enorm: v("mtp.layers.0.enorm.weight".into())?,
            hnorm: v("mtp.layers.0.hnorm.weight".into())?,
            head_norm: v("mtp.layers.1.final_layernorm.weight".into())?,
            out_norm: Vec::new(),
            eps: hp.eps,
            blocks: vec![
                Block {
                    layer: 0,
                    norm: v("mtp.layers.0.norm.weight".into())?,
                    op: attn,
                },
                Block {
                    layer: 1,
                    norm: v("mtp.layers.1.norm.weight".into())?,
                    op: moe,
                },
            ],
        })
    }
}

/// A block kind, to pick one sub-layer of the folded GGUF MTP block.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Attention,
    Moe,
}

/// The op of layer `i`, of the kind its tensors show (or `only` that kind, for the MTP block
/// that holds two).
fn load_block(
    src: &ModelSource,
    names: &Names,
    i: usize,
    hp: &Hp,
    only: Option<Kind>,
) -> Result<BlockOp> {
    let l = |h: &str, g: &str| names.layer(i, h, g);
    let w = |h: &str, g: &str| src.weight(&l(h, g));
    let has = |h: &str, g: &str| src.has(&l(h, g));
    let want = |k: Kind| only.is_none_or(|o| o == k);
    if only.is_none() && has("mixer.in_proj.weight", "ssm_in.weight") {
        let w_in = w("mixer.in_proj.weight", "ssm_in.weight")?;
        let w_out = w("mixer.out_proj.weight", "ssm_out.weight")?;
        let d_inner = w_out.shape.get(1).copied().unwrap_or(0);
        let n_heads = src.weight(&l("mixer.dt_bias", "ssm_dt.bias"))?.n_elements();
        let conv = w("mixer.conv1d.weight", "ssm_conv1d.weight")?;
        let conv_dim = conv.shape.first().copied().unwrap_or(0);
        let conv_k = conv.n_elements().checked_div(conv_dim).unwrap_or(0);
        let gn2 = conv_dim.saturating_sub(d_inner);
        let d_state = gn2.checked_div(2 * hp.n_groups).unwrap_or(0);
        let head_dim = d_inner.checked_div(n_heads).unwrap_or(0);
        if n_heads == 0 || head_dim * n_heads != d_inner || d_state * 2 * hp.n_groups != gn2 {
            return Err(ModelError::Config(format!(
                "layer {i}: Mamba2 shapes do not add up (d_inner {d_inner}, conv {conv_dim}, \
                 {n_heads} heads, {} groups)",
                hp.n_groups
            )));
        }
        let a_neg = if names.gguf {
            flat_weight(src, &l("", "ssm_a"), n_heads)?
        } else {
            flat_weight(src, &l("mixer.A_log", ""), n_heads)?
                .iter()
                .map(|a| -a.exp())
                .collect()
        };
        let conv_b = if has("mixer.conv1d.bias", "ssm_conv1d.bias") {
            Some(flat_weight(
                src,
                &l("mixer.conv1d.bias", "ssm_conv1d.bias"),
                conv_dim,
            )?)
        } else {
            None
        };
        return Ok(BlockOp::Mamba2(Mamba2 {
            w_in,
            conv_w: conv.to_f32()?,
            conv_b,
            conv_k,
            dt_bias: flat_weight(src, &l("mixer.dt_bias", "ssm_dt.bias"), n_heads)?,
            a_neg,
            d: flat_weight(src, &l("mixer.D", "ssm_d"), n_heads)?,
            norm: flat_weight(src, &l("mixer.norm.weight", "ssm_norm.weight"), d_inner)?,
            w_out,
            shape: Mamba2Shape {
                n_heads,
                head_dim,
                d_state,
                n_groups: hp.n_groups,
            },
            eps: hp.eps,
        }));
    }
    if want(Kind::Attention) && has("mixer.q_proj.weight", "attn_q.weight") {
        let wq = w("mixer.q_proj.weight", "attn_q.weight")?;
        let wk = w("mixer.k_proj.weight", "attn_k.weight")?;
        let hd = hp.head_dim;
        let rows = |x: &crate::Weight| x.shape.first().copied().unwrap_or(0);
        let (n_head, n_head_kv) = (rows(&wq) / hd.max(1), rows(&wk) / hd.max(1));
        return Ok(BlockOp::Attention(Attention {
            wq,
            wk,
            wv: w("mixer.v_proj.weight", "attn_v.weight")?,
            wo: w("mixer.o_proj.weight", "attn_output.weight")?,
            bq: None,
            bk: None,
            bv: None,
            q_norm: None,
            k_norm: None,
            n_head,
            n_head_kv,
            head_dim: hd,
            rope: None,
            gated: false,
            eps: hp.eps,
        }));
    }
    if want(Kind::Moe) && has("mixer.gate.weight", "ffn_gate_inp.weight") {
        let router = w("mixer.gate.weight", "ffn_gate_inp.weight")?;
        let n_expert = router.shape.first().copied().unwrap_or(0);
        let bias_name = l("mixer.gate.e_score_correction_bias", "exp_probs_b.bias");
        let bias = if src.has(&bias_name) {
            Some(flat_weight(src, &bias_name, n_expert)?)
        } else {
            None
        };
        let experts = if names.gguf {
            Experts::Stacked {
                gate: None,
                up: w("", "ffn_up_exps.weight")?,
                down: w("", "ffn_down_exps.weight")?,
            }
        } else {
            Experts::PerExpert(
                (0..n_expert)
                    .map(|e| {
                        Ok(Mlp {
                            gate: None,
                            up: w(&format!("mixer.experts.{e}.up_proj.weight"), "")?,
                            down: w(&format!("mixer.experts.{e}.down_proj.weight"), "")?,
                            act: Act::Relu2,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?,
            )
        };
        let n_ff = match &experts {
            Experts::Stacked { up, .. } => up.shape.get(1).copied().unwrap_or(0),
            Experts::PerExpert(v) => v.first().map_or(0, |m| m.up.shape[0]),
            Experts::FusedGateUp { .. } => 0,
        };
        let shared = if has("mixer.shared_experts.up_proj.weight", "ffn_up_shexp.weight") {
            Some(Mlp {
                gate: None,
                up: w("mixer.shared_experts.up_proj.weight", "ffn_up_shexp.weight")?,
                down: w(
                    "mixer.shared_experts.down_proj.weight",
                    "ffn_down_shexp.weight",
                )?,
                act: Act::Relu2,
            })
        } else {
            None
        };
        let latent = if has("mixer.fc1_latent_proj.weight", "ffn_latent_down.weight") {
            Some(Latent {
                down: w("mixer.fc1_latent_proj.weight", "ffn_latent_down.weight")?,
                up: w("mixer.fc2_latent_proj.weight", "ffn_latent_up.weight")?,
            })
        } else {
            None
        };
        return Ok(BlockOp::Ffn(Ffn::Moe(Moe {
            router,
            gating: Gating::Sigmoid { bias },
            top_k: hp.top_k,
            norm_topk: hp.norm_topk,
            scale: hp.scale,
            experts,
            n_ff,
            act: Act::Relu2,
            shared,
            shared_gate: None,
            latent,
        })));
    }
    if only.is_none() && has("mixer.up_proj.weight", "ffn_up.weight") {
        return Ok(BlockOp::Ffn(Ffn::Mlp(Mlp {
            gate: None,
            up: w("mixer.up_proj.weight", "ffn_up.weight")?,
            down: w("mixer.down_proj.weight", "ffn_down.weight")?,
            act: Act::Relu2,
        })));
    }
    Err(ModelError::Config(format!(
        "layer {i}: no Mamba2, attention, MLP or MoE tensors found"
    )))
}

impl CausalLm for NemotronH {
    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }
    fn backend(&self) -> &Arc<dyn Backend> {
        self.inner.backend()
    }
    fn forward(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits> {
        self.inner.forward(batch, cache)
    }

    fn step_kernels(&self) -> Option<usize> {
        self.inner.step_kernels()
    }

    fn forward_hidden(&self, batch: &BatchInputs, cache: &mut KvCache) -> Result<Logits> {
        self.inner.forward_hidden(batch, cache)
    }

    fn embed_tokens(&self, tokens: &[u32], out: &mut Tensor) -> Result<()> {
        self.inner.embed_tokens(tokens, out)
    }

    fn output_head(&self, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
        self.inner.output_head(x, n, out)
    }

    fn mtp_parts(&self) -> Option<MtpParts<'_>> {
        self.mtp.as_ref().map(|m| MtpParts {
            fc: &m.eh_proj,
            embed_norm: &m.enorm,
            hidden_norm: &m.hnorm,
            trunk_norm: &m.out_norm,
            blocks: &m.blocks,
            head_norm: &m.head_norm,
            eps: m.eps,
        })
    }
}
