//! Qwen3.5 / Qwen3.6 hybrid models: `qwen35moe` (HF `qwen3_5_moe`, e.g. Qwen3.6-35B-A3B) and the
//! dense `qwen35` (HF `qwen3_5`).
//!
//! Layers alternate Gated DeltaNet mixers ([`crate::layers::gdn`]) with gated full attention
//! (q projection with an interleaved sigmoid output gate, per-head q/k RMSNorm, NeoX RoPE on the
//! first `n_rot` dims — interleaved MRoPE reduces to this for text); every layer then has a MoE
//! (softmax top-k, renormalised, SwiGLU experts, shared expert with a sigmoid gate) or, in the
//! dense model, a SwiGLU MLP.
//!
//! Format fix-ups, all here:
//! - RMSNorm weights: HF stores `w` of a `(1 + w)` norm (input, post-attention, final, q/k and
//!   MTP norms); GGUF (llama.cpp's converter) and MLX (mlx-lm's `sanitize`) store `1 + w`. The
//!   GDN output norm is plain everywhere. An HF checkpoint is told from an MLX one by its conv
//!   weight layout (`[C, 1, K]` vs `[C, K, 1]`, the test mlx-lm itself uses).
//! - `A`: HF/MLX store `A_log`, GGUF stores `-exp(A_log)`.
//! - Value-head order: HF/MLX grouped, GGUF tiled (a kernel parameter, no permutation).
//! - Experts: GGUF stacked, HF fused `gate_up_proj` or per expert, MLX `switch_mlp`.
//! - Layer layout: HF `layer_types`, else GGUF `attention.recurrent_layers` (llama.cpp's
//!   converter writes both it and the interval), else every `full_attention_interval`-th layer;
//!   a GGUF layout is checked against the file's tensors (`blk.N.ssm_conv1d.weight`).
//! - MTP: HF `mtp.*`, GGUF an extra block after the trunk (`nextn_predict_layers`); loaded and
//!   kept ([`Qwen35::mtp`]) for speculative decoding.
//!
//! References: transformers `models/qwen3_5_moe/modeling_qwen3_5_moe.py`,
//! `models/qwen3_5/modeling_qwen3_5.py`; llama.cpp `src/models/qwen35moe.cpp`,
//! `conversion/qwen.py`; mlx-lm `models/qwen3_5.py`.

use std::sync::Arc;

use kapitsa_backend::Backend;
use kapitsa_backend::GdnShape;

use crate::common::{
    first_weight, flat_weight, load_attention, load_globals, load_qwen_moe, load_swiglu, n_experts,
    vec_weight, AttnOptions, CommonHparams, Names,
};
use crate::config::Hparams;
use crate::layers::decoder::{Block, BlockOp, Decoder};
use crate::layers::ffn::Ffn;
use crate::layers::gdn::{head_order, GatedDeltaNet};
use crate::mtp::MtpParts;
use crate::{
    BatchInputs, CausalLm, KvCache, Logits, ModelError, ModelSource, ModelSpec, Result, Tensor,
};

/// Hyper-parameters beyond [`CommonHparams`].
#[derive(Debug, Clone)]
struct Hybrid {
    /// Per layer: full attention (else Gated DeltaNet).
    full_attn: Vec<bool>,
    n_rot: usize,
    conv_k: usize,
    n_k_heads: usize,
    n_v_heads: usize,
    dk: usize,
    dv: usize,
    /// `(n_expert, top_k, n_ff_expert, n_ff_shared)` for the MoE model.
    moe: Option<(usize, usize, usize, usize)>,
    /// Dense MLP size for `qwen35`.
    n_ff: usize,
    /// MTP layers present after the trunk.
    n_mtp: usize,
}

/// `<arch>.attention.recurrent_layers` (one bool per block, true for a Gated DeltaNet layer), as
/// llama.cpp's converter writes it beside `full_attention_interval`; it wins over the interval.
/// MTP blocks after the trunk may or may not be listed; only the first `n_layer` are used.
fn gguf_recurrent_layers(
    src: &ModelSource,
    arch: &str,
    n_layer: usize,
) -> Result<Option<Vec<bool>>> {
    let Some(g) = src.gguf() else {
        return Ok(None);
    };
    let key = format!("{arch}.attention.recurrent_layers");
    if g.get(&key).is_none() {
        return Ok(None);
    }
    let mut recurrent = g.get_bool_array(&key)?;
    if recurrent.len() < n_layer {
        return Err(ModelError::Config(format!(
            "{key} has {} entries for {n_layer} layers",
            recurrent.len()
        )));
    }
    recurrent.truncate(n_layer);
    Ok(Some(recurrent))
}

/// Check the layer layout against the GGUF tensors: a Gated DeltaNet layer has
/// `blk.N.ssm_conv1d.weight`, an attention layer has none, so a layout that disagrees with the
/// file names the first layer where it does instead of a missing tensor deep in loading.
fn check_layer_tensors(src: &ModelSource, full_attn: &[bool]) -> Result<()> {
    for (i, &attn) in full_attn.iter().enumerate() {
        let has_conv = src.has(&format!("blk.{i}.ssm_conv1d.weight"));
        if has_conv == attn {
            let (said, found) = if attn {
                (
                    "full attention",
                    "a recurrent layer (blk.{i}.ssm_conv1d.weight)",
                )
            } else {
                ("recurrent", "no blk.{i}.ssm_conv1d.weight")
            };
            return Err(ModelError::Config(format!(
                "layer {i}: the metadata makes it {said} but the file has {}",
                found.replace("{i}", &i.to_string())
            )));
        }
    }
    Ok(())
}

fn read_hybrid(src: &ModelSource, arch: &str, c: &mut CommonHparams, moe: bool) -> Result<Hybrid> {
    let hp = Hparams::new(src, arch);
    let gguf = hp.is_gguf();
    let n_mtp = if gguf {
        hp.usize_opt("nextn_predict_layers", "")?.unwrap_or(0)
    } else {
        // transformers ignores mtp.*; count it only when the weights are there.
        let n = hp.usize_opt("", "mtp_num_hidden_layers")?.unwrap_or(0);
        if src.has("mtp.fc.weight") || src.has("language_model.mtp.fc.weight") {
            n
        } else {
            0
        }
    };
    if gguf {
        // block_count counts the MTP block(s) appended after the trunk.
        c.n_layer = c
            .n_layer
            .checked_sub(n_mtp)
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "{arch}: block_count too small for {n_mtp} MTP layers"
                ))
            })?;
    }
    let interval = hp
        .usize_opt("full_attention_interval", "full_attention_interval")?
        .unwrap_or(4)
        .max(1);
    let layer_types = src
        .hf()
        .and_then(|h| {
            let cfg = h.config();
            cfg.get("layer_types")
                .or_else(|| cfg.get("text_config").and_then(|t| t.get("layer_types")))
                .cloned()
        })
        .and_then(|v| v.as_array().cloned());
    let full_attn: Vec<bool> = match layer_types {
        Some(t) => {
            if t.len() != c.n_layer {
                return Err(ModelError::Config(format!(
                    "layer_types has {} entries for {} layers",
                    t.len(),
                    c.n_layer
                )));
            }
            t.iter()
                .map(|v| match v.as_str() {
                    Some("full_attention") => Ok(true),
                    Some("linear_attention") => Ok(false),
                    _ => Err(ModelError::Config(format!("unknown layer type {v}"))),
                })
                .collect::<Result<_>>()?
        }
        None => match gguf_recurrent_layers(src, arch, c.n_layer)? {
            Some(recurrent) => recurrent.iter().map(|&r| !r).collect(),
            None => (0..c.n_layer).map(|i| (i + 1) % interval == 0).collect(),
        },
    };
    if gguf {
        check_layer_tensors(src, &full_attn)?;
    }
    let n_rot = if gguf {
        hp.usize("rope.dimension_count", "")?
    } else {
        let cfg = src.hf().map(|h| h.config());
        let get = |k: &str| {
            cfg.and_then(|c| {
                c.get(k)
                    .or_else(|| c.get("text_config").and_then(|t| t.get(k)))
                    .cloned()
            })
        };
        let factor = get("partial_rotary_factor")
            .or_else(|| {
                get("rope_parameters").and_then(|r| r.get("partial_rotary_factor").cloned())
            })
            .and_then(|v| v.as_f64())
            .unwrap_or(0.25);
        (c.head_dim as f64 * factor) as usize
    };
    let (n_k_heads, n_v_heads, dk, dv, conv_k) = if gguf {
        let state = hp.usize("ssm.state_size", "")?;
        let n_v = hp.usize("ssm.time_step_rank", "")?;
        let inner = hp.usize("ssm.inner_size", "")?;
        if n_v == 0 || inner % n_v != 0 {
            return Err(ModelError::Config(format!(
                "{arch}: ssm.inner_size {inner} is not a multiple of {n_v} value heads"
            )));
        }
        (
            hp.usize("ssm.group_count", "")?,
            n_v,
            state,
            inner / n_v,
            hp.usize("ssm.conv_kernel", "")?,
        )
    } else {
        (
            hp.usize("", "linear_num_key_heads")?,
            hp.usize("", "linear_num_value_heads")?,
            hp.usize("", "linear_key_head_dim")?,
            hp.usize("", "linear_value_head_dim")?,
            hp.usize("", "linear_conv_kernel_dim")?,
        )
    };
    let moe = if moe {
        Some((
            n_experts(&hp)?,
            hp.usize("expert_used_count", "num_experts_per_tok")?,
            hp.usize("expert_feed_forward_length", "moe_intermediate_size")?,
            hp.usize_opt(
                "expert_shared_feed_forward_length",
                "shared_expert_intermediate_size",
            )?
            .unwrap_or(0),
        ))
    } else {
        None
    };
    let n_ff = if moe.is_none() {
        hp.usize("feed_forward_length", "intermediate_size")?
    } else {
        0
    };
    Ok(Hybrid {
        full_attn,
        n_rot,
        conv_k,
        n_k_heads,
        n_v_heads,
        dk,
        dv,
        moe,
        n_ff,
        n_mtp,
    })
}

/// The interleaved multimodal rotary sections (t, h, w) of the file: HF
/// `rope_parameters.mrope_section` (top level or in `text_config`), GGUF
/// `<arch>.rope.dimension_sections` (four entries, the fourth 0); `None` when absent.
fn mrope_sections(src: &ModelSource, arch: &str) -> Option<[usize; 3]> {
    let v: Vec<usize> = if let Some(g) = src.gguf() {
        g.get_u32_array(&format!("{arch}.rope.dimension_sections"))
            .or_else(|_| {
                g.get_i32_array(&format!("{arch}.rope.dimension_sections"))
                    .map(|v| v.into_iter().map(|x| x.max(0) as u32).collect())
            })
            .ok()?
            .into_iter()
            .map(|x| x as usize)
            .collect()
    } else {
        let cfg = src.hf()?.config();
        let rp = cfg
            .get("rope_parameters")
            .or_else(|| cfg.get("text_config")?.get("rope_parameters"))?;
        rp.get("mrope_section")?
            .as_array()?
            .iter()
            .map(|x| x.as_u64().map(|x| x as usize))
            .collect::<Option<_>>()?
    };
    match v[..] {
        [t, h, w] | [t, h, w, 0] if t + h + w > 0 => Some([t, h, w]),
        _ => None,
    }
}

/// The multi-token-prediction head (kept for speculative decoding; not used by `forward`).
#[derive(Debug)]
pub struct Qwen35Mtp {
    /// `[n_embd, 2 n_embd]`: projects `[norm(embed(next)), norm(hidden)]`.
    pub fc: crate::Weight,
    /// Norm of the next token's embedding `[n_embd]`.
    pub norm_embedding: Vec<f32>,
    /// Norm of the trunk's hidden state `[n_embd]`.
    pub norm_hidden: Vec<f32>,
    /// Final norm `[n_embd]` (before the shared output projection).
    pub norm: Vec<f32>,
    /// The MTP decoder layer: attention block then FFN block.
    pub blocks: Vec<Block>,
    /// The trunk's final norm `[n_embd]` (the head reads the trunk's hidden after it).
    pub out_norm: Vec<f32>,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// A loaded Qwen3.5/3.6 model (MoE or dense).
pub struct Qwen35 {
    inner: Decoder,
    mtp: Option<Qwen35Mtp>,
}

impl Qwen35 {
    /// Load `qwen35moe` (`moe = true`) or `qwen35` from GGUF, HF or MLX.
    pub fn load(src: &ModelSource, backend: Arc<dyn Backend>, moe: bool) -> Result<Qwen35> {
        let arch = if moe { "qwen35moe" } else { "qwen35" };
        let mut c = CommonHparams::read(src, arch)?;
        let hy = read_hybrid(src, arch, &mut c, moe)?;
        let names = Names::detect(src)?;
        let gguf = names.gguf;
        // HF checkpoints store w of (1 + w) norms; GGUF and MLX store 1 + w.
        let first_gdn = hy.full_attn.iter().position(|f| !f);
        let conv_name = |i: usize| names.layer(i, "linear_attn.conv1d.weight", "ssm_conv1d.weight");
        let shifted = gguf
            || first_gdn.is_none()
            || first_gdn.is_some_and(|i| {
                src.weight(&conv_name(i))
                    .map(|w| w.shape.len() == 3 && w.shape[2] == 1)
                    .unwrap_or(false)
            });
        let off = if shifted { 0.0 } else { 1.0 };

        let parts = load_globals(src, &names, arch, &c, off)?;
        let attn_opts = AttnOptions {
            qkv_bias: false,
            qk_norm: Some(off),
            n_rot: hy.n_rot,
            gated: true,
        };
        let mut blocks = Vec::with_capacity(2 * c.n_layer);
        for i in 0..c.n_layer {
            let (mixer, ffn) = layer_blocks(src, &names, i, &c, &hy, &attn_opts, off)?;
            blocks.push(mixer);
            blocks.push(ffn);
        }
        let mtp = if hy.n_mtp > 0 {
            let mut m = load_mtp(src, &names, &c, &hy, &attn_opts, off)?;
            m.out_norm.clone_from(&parts.out_norm);
            Some(m)
        } else {
            None
        };
        let mut inner = Decoder::new(parts, blocks, backend)?;
        if mtp.is_some() {
            inner.set_mtp_layers(hy.n_mtp);
        }
        if let Some(sections) = mrope_sections(src, arch) {
            inner.set_mrope(sections);
        }
        Ok(Qwen35 { inner, mtp })
    }

    /// The MTP head, when the file has one.
    pub fn mtp(&self) -> Option<&Qwen35Mtp> {
        self.mtp.as_ref()
    }
}

/// The mixer block and the FFN block of trunk layer `i` (or of the MTP layer, with `names`
/// pointing at it).
fn layer_blocks(
    src: &ModelSource,
    names: &Names,
    i: usize,
    c: &CommonHparams,
    hy: &Hybrid,
    attn_opts: &AttnOptions,
    off: f32,
) -> Result<(Block, Block)> {
    let gguf = names.gguf;
    let l = |h: &str, g: &str| names.layer(i, h, g);
    let w = |h: &str, g: &str| src.weight(&l(h, g));
    let norm1 = vec_weight(
        src,
        &l("input_layernorm.weight", "attn_norm.weight"),
        c.n_embd,
        off,
    )?;
    let norm2 = vec_weight(
        src,
        &l(
            "post_attention_layernorm.weight",
            "post_attention_norm.weight",
        ),
        c.n_embd,
        off,
    )?;
    let full = hy.full_attn.get(i).copied().unwrap_or(true);
    let mixer = if full {
        BlockOp::Attention(load_attention(src, names, i, c, attn_opts)?)
    } else {
        let (nv, dv) = (hy.n_v_heads, hy.dv);
        let conv_dim = 2 * hy.n_k_heads * hy.dk + nv * dv;
        let conv_w = flat_weight(
            src,
            &l("linear_attn.conv1d.weight", "ssm_conv1d.weight"),
            conv_dim * hy.conv_k,
        )?;
        let a_neg = if gguf {
            flat_weight(src, &l("", "ssm_a"), nv)?
        } else {
            flat_weight(src, &l("linear_attn.A_log", ""), nv)?
                .iter()
                .map(|a| -a.exp())
                .collect()
        };
        BlockOp::Gdn(GatedDeltaNet {
            w_qkv: w("linear_attn.in_proj_qkv.weight", "attn_qkv.weight")?,
            w_z: w("linear_attn.in_proj_z.weight", "attn_gate.weight")?,
            w_b: w("linear_attn.in_proj_b.weight", "ssm_beta.weight")?,
            w_a: w("linear_attn.in_proj_a.weight", "ssm_alpha.weight")?,
            conv_w,
            conv_k: hy.conv_k,
            dt_bias: flat_weight(src, &l("linear_attn.dt_bias", "ssm_dt.bias"), nv)?,
            a_neg,
            norm: vec_weight(
                src,
                &l("linear_attn.norm.weight", "ssm_norm.weight"),
                dv,
                0.0,
            )?,
            w_out: w("linear_attn.out_proj.weight", "ssm_out.weight")?,
            shape: GdnShape {
                n_k_heads: hy.n_k_heads,
                n_v_heads: nv,
                dk: hy.dk,
                dv,
                order: head_order(gguf),
            },
            eps: c.rms_eps,
            l2_eps: 1e-6,
        })
    };
    let ffn = match hy.moe {
        Some((n_expert, top_k, n_ff, n_ff_sh)) => {
            let mut moe = load_qwen_moe(src, names, i, n_expert, top_k, n_ff, true)?;
            if n_ff_sh > 0 {
                moe.shared = Some(load_swiglu(src, names, i, "mlp.shared_expert", "_shexp")?);
                moe.shared_gate = Some(flat_weight(
                    src,
                    &l("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
                    c.n_embd,
                )?);
            }
            Ffn::Moe(moe)
        }
        None => {
            let _ = hy.n_ff;
            Ffn::Mlp(load_swiglu(src, names, i, "mlp", "")?)
        }
    };
    Ok((
        Block {
            layer: i,
            norm: norm1,
            op: mixer,
        },
        Block {
            layer: i,
            norm: norm2,
            op: BlockOp::Ffn(ffn),
        },
    ))
}

/// Load the MTP head: HF/MLX `mtp.*` (layer `mtp.layers.0`), GGUF block `n_layer` with
/// `nextn.*` tensors.
fn load_mtp(
    src: &ModelSource,
    names: &Names,
    c: &CommonHparams,
    hy: &Hybrid,
    attn_opts: &AttnOptions,
    off: f32,
) -> Result<Qwen35Mtp> {
    let d = c.n_embd;
    let (mtp_names, layer) = if names.gguf {
        (names.clone(), c.n_layer)
    } else {
        let prefix = if src.has("mtp.fc.weight") {
            "mtp."
        } else {
            "language_model.mtp."
        };
        (
            Names {
                gguf: false,
                prefix: prefix.into(),
                lm_head: names.lm_head.clone(),
            },
            0,
        )
    };
    let g = |h: &str, gg: &str| mtp_names.layer(layer, h, gg);
    let hf = |s: &str| format!("{}{s}", mtp_names.prefix);
    let pick = |h: &str, gg: &str| if names.gguf { g("", gg) } else { hf(h) };
    // The MTP layer is a full-attention layer whatever the trunk pattern says.
    let mut hy_mtp = hy.clone();
    hy_mtp.full_attn = vec![true; layer + 1];
    let (attn, ffn) = layer_blocks(src, &mtp_names, layer, c, &hy_mtp, attn_opts, off)?;
    let norm = if names.gguf && !src.has(&g("", "nextn.shared_head_norm.weight")) {
        vec_weight(src, "output_norm.weight", d, 0.0)?
    } else {
        vec_weight(
            src,
            &pick("norm.weight", "nextn.shared_head_norm.weight"),
            d,
            off,
        )?
    };
    Ok(Qwen35Mtp {
        fc: first_weight(src, &[pick("fc.weight", "nextn.eh_proj.weight")])?,
        norm_embedding: vec_weight(
            src,
            &pick("pre_fc_norm_embedding.weight", "nextn.enorm.weight"),
            d,
            off,
        )?,
        norm_hidden: vec_weight(
            src,
            &pick("pre_fc_norm_hidden.weight", "nextn.hnorm.weight"),
            d,
            off,
        )?,
        norm,
        blocks: vec![attn, ffn],
        out_norm: Vec::new(),
        eps: c.rms_eps,
    })
}

impl CausalLm for Qwen35 {
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
            fc: &m.fc,
            embed_norm: &m.norm_embedding,
            hidden_norm: &m.norm_hidden,
            trunk_norm: &m.out_norm,
            blocks: &m.blocks,
            head_norm: &m.norm,
            eps: m.eps,
        })
    }
}
