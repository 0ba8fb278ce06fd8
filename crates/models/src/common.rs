//! Loading helpers shared by the architecture files: tensor naming across GGUF / HF / MLX, the
//! hyper-parameters every decoder has, and the attention / MLP / MoE weight tables of the Qwen
//! families.

use kapitsa_backend::RopeDesc;

use crate::config::Hparams;
use crate::layers::attention::Attention;
use crate::layers::decoder::{Block, BlockOp, DecoderParts};
use crate::layers::ffn::{Act, Experts, Ffn, Gating, Mlp, Moe};
use crate::{ModelError, ModelSource, Result, Weight};

/// How the tensors of one model file are named.
#[derive(Debug, Clone)]
pub struct Names {
    /// GGUF naming (`blk.N.*`), else HF/MLX.
    pub gguf: bool,
    /// HF/MLX prefix of the trunk (`model.`, `model.language_model.`, `language_model.model.`).
    pub prefix: String,
    /// HF/MLX name of the output projection.
    pub lm_head: String,
}

impl Names {
    /// Detect the naming of `src` from where the embedding lives.
    pub fn detect(src: &ModelSource) -> Result<Names> {
        if src.gguf().is_some() {
            return Ok(Names {
                gguf: true,
                prefix: String::new(),
                lm_head: "output.weight".into(),
            });
        }
        for (prefix, lm_head) in [
            ("model.", "lm_head.weight"),
            ("model.language_model.", "lm_head.weight"),
            ("language_model.model.", "language_model.lm_head.weight"),
        ] {
            if src.has(&format!("{prefix}embed_tokens.weight")) {
                return Ok(Names {
                    gguf: false,
                    prefix: prefix.into(),
                    lm_head: lm_head.into(),
                });
            }
        }
        Err(ModelError::MissingTensor(
            "model.embed_tokens.weight".into(),
        ))
    }

    /// Name of a per-layer tensor: HF `<prefix>layers.{i}.{hf}` or GGUF `blk.{i}.{gguf}`.
    pub fn layer(&self, i: usize, hf: &str, gguf: &str) -> String {
        if self.gguf {
            format!("blk.{i}.{gguf}")
        } else {
            format!("{}layers.{i}.{hf}", self.prefix)
        }
    }

    /// Name of a trunk-level tensor: HF `<prefix>{hf}` or GGUF `{gguf}`.
    pub fn global(&self, hf: &str, gguf: &str) -> String {
        if self.gguf {
            gguf.to_string()
        } else {
            format!("{}{hf}", self.prefix)
        }
    }
}

/// Hyper-parameters every decoder has (llama.cpp names in the comments).
#[derive(Debug, Clone)]
pub struct CommonHparams {
    /// `embedding_length` / `hidden_size`.
    pub n_embd: usize,
    /// `block_count` / `num_hidden_layers`.
    pub n_layer: usize,
    /// `attention.head_count`.
    pub n_head: usize,
    /// `attention.head_count_kv` (defaults to `n_head`).
    pub n_head_kv: usize,
    /// `attention.key_length` / `head_dim` (defaults to `n_embd / n_head`).
    pub head_dim: usize,
    /// `attention.layer_norm_rms_epsilon` / `rms_norm_eps`.
    pub rms_eps: f32,
    /// `rope.freq_base`.
    pub rope_theta: f32,
    /// `context_length` / `max_position_embeddings`.
    pub n_ctx_train: usize,
}

impl CommonHparams {
    /// Read them from `src` (GGUF keys under `arch.`).
    pub fn read(src: &ModelSource, arch: &str) -> Result<CommonHparams> {
        let hp = Hparams::new(src, arch);
        let n_embd = hp.usize("embedding_length", "hidden_size")?;
        let n_head = hp.usize("attention.head_count", "num_attention_heads")?;
        let n_head_kv = hp
            .usize_opt("attention.head_count_kv", "num_key_value_heads")?
            .unwrap_or(n_head);
        let head_dim = hp
            .usize_opt("attention.key_length", "head_dim")?
            .unwrap_or(n_embd.checked_div(n_head).unwrap_or(0));
        let c = CommonHparams {
            n_embd,
            n_layer: hp.usize("block_count", "num_hidden_layers")?,
            n_head,
            n_head_kv,
            head_dim,
            rms_eps: hp
                .f32_opt("attention.layer_norm_rms_epsilon", "rms_norm_eps")?
                .unwrap_or(1e-6),
            rope_theta: hp.rope_theta(10000.0)?,
            n_ctx_train: hp
                .usize_opt("context_length", "max_position_embeddings")?
                .unwrap_or(4096),
        };
        if c.n_embd == 0 || c.n_layer == 0 || c.n_head == 0 || c.head_dim == 0 {
            return Err(ModelError::Config(format!("{arch}: zero-sized dimension")));
        }
        if c.rope_theta.is_nan() || c.rope_theta <= 0.0 {
            return Err(ModelError::Config(format!(
                "{arch}: rope_theta must be positive"
            )));
        }
        Ok(c)
    }
}

/// A vector weight (norm, bias) of length `len` as f32, plus `offset` on every element.
pub fn vec_weight(src: &ModelSource, name: &str, len: usize, offset: f32) -> Result<Vec<f32>> {
    let mut v = src.weight(name)?.expect_shape(&[len])?.to_f32()?;
    if offset != 0.0 {
        for x in &mut v {
            *x += offset;
        }
    }
    Ok(v)
}

/// A small weight as f32 whatever its stored shape, checked to hold `len` values (1-D GGUF
/// tensors vs `[1, n]` / `[n, 1]` HF ones).
pub fn flat_weight(src: &ModelSource, name: &str, len: usize) -> Result<Vec<f32>> {
    let w = src.weight(name)?;
    if w.n_elements() != len {
        return Err(ModelError::BadShape {
            name: w.name.clone(),
            got: w.shape.clone(),
            want: vec![len],
        });
    }
    w.to_f32()
}

/// Embedding, final norm and output projection. `norm_offset` is added to the final norm
/// weight (1 for checkpoints that store `w` of a `(1 + w)` norm).
pub fn load_globals(
    src: &ModelSource,
    names: &Names,
    arch: &str,
    c: &CommonHparams,
    norm_offset: f32,
) -> Result<DecoderParts> {
    let tok_embd = src.weight(&names.global("embed_tokens.weight", "token_embd.weight"))?;
    let out_norm = vec_weight(
        src,
        &names.global("norm.weight", "output_norm.weight"),
        c.n_embd,
        norm_offset,
    )?;
    let output = src.weight_opt(&names.lm_head)?;
    Ok(DecoderParts {
        arch: arch.to_string(),
        n_ctx_train: c.n_ctx_train,
        n_layer: c.n_layer,
        rms_eps: c.rms_eps,
        tok_embd,
        out_norm,
        output,
    })
}

/// Options of a Qwen-style attention block.
pub struct AttnOptions {
    /// q/k/v biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-head q/k RMSNorm (Qwen3, Qwen3.5), with this offset added to their weights.
    pub qk_norm: Option<f32>,
    /// Rotary dims per head (`head_dim` for full RoPE).
    pub n_rot: usize,
    /// Sigmoid output gate interleaved in the q projection (Qwen3.5).
    pub gated: bool,
}

/// Load the attention block of layer `i` (HF `self_attn.*`, GGUF `attn_*`).
pub fn load_attention(
    src: &ModelSource,
    names: &Names,
    i: usize,
    c: &CommonHparams,
    o: &AttnOptions,
) -> Result<Attention> {
    let w = |h: &str, g: &str| src.weight(&names.layer(i, h, g));
    let hd = c.head_dim;
    let (q_dim, kv_dim) = (c.n_head * hd, c.n_head_kv * hd);
    let bias = |h: &str, g: &str, len: usize| -> Result<Option<Vec<f32>>> {
        if o.qkv_bias {
            vec_weight(src, &names.layer(i, h, g), len, 0.0).map(Some)
        } else {
            Ok(None)
        }
    };
    let norm = |h: &str, g: &str| -> Result<Option<Vec<f32>>> {
        match o.qk_norm {
            Some(off) => vec_weight(src, &names.layer(i, h, g), hd, off).map(Some),
            None => Ok(None),
        }
    };
    Ok(Attention {
        wq: w("self_attn.q_proj.weight", "attn_q.weight")?,
        wk: w("self_attn.k_proj.weight", "attn_k.weight")?,
        wv: w("self_attn.v_proj.weight", "attn_v.weight")?,
        wo: w("self_attn.o_proj.weight", "attn_output.weight")?,
        bq: bias("self_attn.q_proj.bias", "attn_q.bias", q_dim)?,
        bk: bias("self_attn.k_proj.bias", "attn_k.bias", kv_dim)?,
        bv: bias("self_attn.v_proj.bias", "attn_v.bias", kv_dim)?,
        q_norm: norm("self_attn.q_norm.weight", "attn_q_norm.weight")?,
        k_norm: norm("self_attn.k_norm.weight", "attn_k_norm.weight")?,
        n_head: c.n_head,
        n_head_kv: c.n_head_kv,
        head_dim: hd,
        rope: Some(RopeDesc {
            n_rot: o.n_rot,
            theta: c.rope_theta,
        }),
        gated: o.gated,
        eps: c.rms_eps,
    })
}

/// The attention block of a Qwen-style layer `i`: pre-norm `input_layernorm` / `attn_norm`
/// (plus `norm_offset`) and [`load_attention`].
pub fn attention_block(
    src: &ModelSource,
    names: &Names,
    i: usize,
    c: &CommonHparams,
    o: &AttnOptions,
    norm_offset: f32,
) -> Result<Block> {
    Ok(Block {
        layer: i,
        norm: vec_weight(
            src,
            &names.layer(i, "input_layernorm.weight", "attn_norm.weight"),
            c.n_embd,
            norm_offset,
        )?,
        op: BlockOp::Attention(load_attention(src, names, i, c, o)?),
    })
}

/// The FFN block of a Qwen-style layer `i`: pre-norm `post_attention_layernorm` / GGUF
/// `gguf_norm` (plus `norm_offset`) and `ffn`.
pub fn ffn_block(
    src: &ModelSource,
    names: &Names,
    i: usize,
    c: &CommonHparams,
    gguf_norm: &str,
    norm_offset: f32,
    ffn: Ffn,
) -> Result<Block> {
    Ok(Block {
        layer: i,
        norm: vec_weight(
            src,
            &names.layer(i, "post_attention_layernorm.weight", gguf_norm),
            c.n_embd,
            norm_offset,
        )?,
        op: BlockOp::Ffn(ffn),
    })
}

/// Load the SwiGLU MLP of layer `i` under HF `{hf}.{gate,up,down}_proj.weight` / GGUF
/// `ffn_{gate,up,down}{gguf_suffix}.weight`.
pub fn load_swiglu(
    src: &ModelSource,
    names: &Names,
    i: usize,
    hf: &str,
    gguf_suffix: &str,
) -> Result<Mlp> {
    let w = |p: &str| {
        src.weight(&names.layer(
            i,
            &format!("{hf}.{p}_proj.weight"),
            &format!("ffn_{p}{gguf_suffix}.weight"),
        ))
    };
    Ok(Mlp {
        gate: Some(w("gate")?),
        up: w("up")?,
        down: w("down")?,
        act: Act::SwiGlu,
    })
}

/// Load the routed SwiGLU experts of layer `i` (softmax router, renormalised top-k) from any
/// of the layouts: GGUF stacked `ffn_{gate,up,down}_exps` (or fused `ffn_gate_up_exps`), HF
/// fused `mlp.experts.gate_up_proj` + `down_proj`, HF per-expert `mlp.experts.{e}.*`, MLX
/// stacked `mlp.switch_mlp.*`.
pub fn load_qwen_moe(
    src: &ModelSource,
    names: &Names,
    i: usize,
    n_expert: usize,
    top_k: usize,
    n_ff: usize,
    norm_topk: bool,
) -> Result<Moe> {
    let l = |h: &str, g: &str| names.layer(i, h, g);
    let router = src.weight(&l("mlp.gate.weight", "ffn_gate_inp.weight"))?;
    let experts = if names.gguf {
        if src.has(&l("", "ffn_gate_up_exps.weight")) {
            Experts::FusedGateUp {
                gate_up: src.weight(&l("", "ffn_gate_up_exps.weight"))?,
                down: src.weight(&l("", "ffn_down_exps.weight"))?,
            }
        } else {
            Experts::Stacked {
                gate: Some(src.weight(&l("", "ffn_gate_exps.weight"))?),
                up: src.weight(&l("", "ffn_up_exps.weight"))?,
                down: src.weight(&l("", "ffn_down_exps.weight"))?,
            }
        }
    } else if src.has(&l("mlp.experts.gate_up_proj", "")) {
        Experts::FusedGateUp {
            gate_up: src.weight(&l("mlp.experts.gate_up_proj", ""))?,
            down: src.weight(&l("mlp.experts.down_proj", ""))?,
        }
    } else if src.has(&l("mlp.switch_mlp.up_proj.weight", "")) {
        Experts::Stacked {
            gate: Some(src.weight(&l("mlp.switch_mlp.gate_proj.weight", ""))?),
            up: src.weight(&l("mlp.switch_mlp.up_proj.weight", ""))?,
            down: src.weight(&l("mlp.switch_mlp.down_proj.weight", ""))?,
        }
    } else {
        Experts::PerExpert(
            (0..n_expert)
                .map(|e| load_swiglu(src, names, i, &format!("mlp.experts.{e}"), ""))
                .collect::<Result<Vec<_>>>()?,
        )
    };
    Ok(Moe {
        router,
        gating: Gating::Softmax,
        top_k,
        norm_topk,
        scale: 1.0,
        experts,
        n_ff,
        act: Act::SwiGlu,
        shared: None,
        shared_gate: None,
        latent: None,
    })
}

/// Weight lookup that reports the first of several candidate names that exists.
pub fn first_weight(src: &ModelSource, candidates: &[String]) -> Result<Weight> {
    for c in candidates {
        if src.has(c) {
            return src.weight(c);
        }
    }
    Err(ModelError::MissingTensor(
        candidates.first().cloned().unwrap_or_default(),
    ))
}

/// Routed expert count: GGUF `expert_count`, HF `num_experts` or (transformers 5)
/// `num_local_experts`.
pub fn n_experts(hp: &Hparams<'_>) -> Result<usize> {
    match hp.usize_opt("expert_count", "num_experts")? {
        Some(n) => Ok(n),
        None => hp.usize("expert_count", "num_local_experts"),
    }
}
