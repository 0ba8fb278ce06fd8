//! Nemotron omni's vision path (transformers' `NemotronH_Omni_Reasoning_V3`, model_type
//! `nemotron_h_omni`): the RADIO tower (`RadioModel`), a pixel shuffle and the projector turn an
//! image's patches into the rows the nemotron_h language model takes in place of its `<image>`
//! tokens.
//!
//! ```text
//! x   = patches @ patch_projection^T                 # [n, C*P*P] -> [n, hidden], no bias
//! x  += crop(bilinear(pos_embed, max(h, w)), h, w)   # the R x C table resampled to a square
//!                                                    # of the longer side (align_corners
//!                                                    # false), its top-left h x w, on the host
//! x   = [cls_register_token; x]                      # n_prefix learned rows first
//! per block:                                         # depth blocks, pre-LayerNorm
//!   q, k, v = split(LN1(x) @ qkv^T + b)              # heads of hidden / n_heads, no rotary
//!   x      += ls1 * (o_proj(attention(q, k, v)) + b) # full non-causal attention
//!   x      += ls2 * fc2(gelu(fc1(LN2(x))))
//! f   = x[n_prefix..]                                # the patch rows, row-major grid
//! f   = LN(f)                                        # only checkpoints with MTP layers
//! s   = pixel_shuffle(f)                             # each m x m block of patches -> one
//!                                                    # row [m*m*hidden], blocks row-major
//! out = linear_2(relu(linear_1(RMSNorm(s)))^2)       # eps 1e-5, no biases
//! ```
//! References: `transformers/models/radio/modeling_radio.py` (`RadioModel._forward_packed`,
//! the path `get_image_features` takes) and `models/nemotron_h_omni/modeling_nemotron_h_omni.py`
//! (`pixel_shuffle`, `NemotronH_Omni_Reasoning_V3MultiModalProjector`). The processor
//! normalises the pixels (the tower's input conditioner is made external), so `encode` takes
//! normalised patches.
//!
//! Pixel shuffle with `downsample_ratio = 1 / m`: output row `(r, c)` of the `h/m x w/m` grid is
//! the concatenation over `j` (row offset), then `k` (column offset), both `0..m`, of patch
//! `(m r + j, m c + k)`'s features. The rows come in the order the image's tokens take in the
//! prompt.
//!
//! Weights: the checkpoint's NVIDIA names (`vision_model.radio_model.model.*`, `mlp1.*`,
//! `vision_projector.vision_final_layernorm.*`; what `save_pretrained` writes) or transformers'
//! own (`vision_model.embeddings.*`, `vision_model.encoder.layer.*`, `multi_modal_projector.*`,
//! `vision_final_layernorm.*`), in their dtype on the backend; a LayerScale other than ones is
//! folded into the preceding projection. The position table stays on the host (it is resampled
//! per image). Activations are f32 on the backend; LayerNorm, GELU, span attention, RMSNorm and
//! the squared-ReLU MLP are the backend's ops, the prefix rows and the pixel shuffle are
//! device copies.

use std::sync::Arc;

use kapitsa_backend::{Act, AttnShape, Backend, Epilogue, MlpWeights, Tensor};
use serde_json::Value;

use crate::layers::tensor;
pub use crate::vision::VisionTokens;
use crate::vision::{ep, host_vec, linear, norm, vec_tensor, VisionInfo, VisionKind, VisionTower};
use crate::{ModelError, ModelSource, Result, Weight};

/// The projector's RMSNorm epsilon (fixed in transformers' projector).
const PROJECTOR_EPS: f32 = 1e-5;

/// The tower's and projector's dimensions (HF `vision_config` and the top-level keys).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Blocks (`num_hidden_layers`).
    pub depth: usize,
    /// Width of the residual stream (`hidden_size`).
    pub hidden: usize,
    /// Attention heads (`hidden / n_heads` per head).
    pub n_heads: usize,
    /// MLP width, `int(hidden * mlp_ratio)`.
    pub intermediate: usize,
    /// Patch side in pixels.
    pub patch: usize,
    /// Image channels.
    pub in_channels: usize,
    /// Rows and columns of the learned position table (`max_img_size / patch_size` each).
    pub pos_side: usize,
    /// Learned rows before the patches (`num_cls_tokens + num_registers`).
    pub n_prefix: usize,
    /// LayerNorm epsilon of the blocks and of the final norm (`layer_norm_eps`).
    pub eps: f32,
    /// Blocks' MLP activation: the tanh GELU, or the exact one (`gelu`, RADIO's).
    pub gelu_tanh: bool,
    /// Whether the attention projections have biases (`qkv_bias`).
    pub qkv_bias: bool,
    /// Patches merged per side into one language-model token (`round(1 / downsample_ratio)`).
    pub merge: usize,
    /// The projector's hidden width (`projector_hidden_size`).
    pub projector_hidden: usize,
    /// Width of the rows the language model takes (`text_config.hidden_size`).
    pub out_hidden: usize,
}

impl VisionConfig {
    /// Values of a patch row, `in_channels * patch^2`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.patch * self.patch
    }

    /// Dims per head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_heads
    }

    /// Width of a pixel-shuffled row, `merge^2 * hidden`.
    pub fn shuffled(&self) -> usize {
        self.merge * self.merge * self.hidden
    }

    /// Read an HF `nemotron_h_omni` config.json: `vision_config` (RadioConfig; its defaults for
    /// absent keys), `downsample_ratio`, `projector_hidden_size` and the language model's
    /// `hidden_size` (`text_config`, or the legacy `llm_config`).
    pub fn from_hf(cfg: &Value) -> Result<VisionConfig> {
        let v = cfg
            .get("vision_config")
            .ok_or_else(|| ModelError::Config("config.json has no vision_config".into()))?;
        let u = |obj: &Value, k: &str, default: Option<usize>| -> Result<usize> {
            match obj.get(k).and_then(Value::as_u64) {
                Some(x) => Ok(x as usize),
                None => default
                    .ok_or_else(|| ModelError::Config(format!("config.json has no integer {k}"))),
            }
        };
        let f = |obj: &Value, k: &str, default: f64| {
            obj.get(k).and_then(Value::as_f64).unwrap_or(default)
        };
        if v.get("use_swiglu_ffn").and_then(Value::as_bool) == Some(true) {
            return Err(ModelError::Config(
                "vision_config.use_swiglu_ffn: the SwiGLU RADIO blocks are not supported".into(),
            ));
        }
        let hidden = u(v, "hidden_size", Some(1280))?;
        let patch = u(v, "patch_size", Some(16))?;
        let act = v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("gelu");
        let gelu_tanh = match act {
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => true,
            "gelu" => false,
            other => {
                return Err(ModelError::Config(format!(
                    "vision_config.hidden_act {other} is not supported"
                )))
            }
        };
        let ratio = f(cfg, "downsample_ratio", 0.5);
        let merge = if ratio > 0.0 && ratio.is_finite() {
            (1.0 / ratio).round() as usize
        } else {
            0
        };
        let text = cfg
            .get("text_config")
            .or_else(|| cfg.get("llm_config"))
            .ok_or_else(|| ModelError::Config("config.json has no text_config".into()))?;
        let c = VisionConfig {
            depth: u(v, "num_hidden_layers", Some(32))?,
            hidden,
            n_heads: u(v, "num_attention_heads", Some(16))?,
            intermediate: (hidden as f64 * f(v, "mlp_ratio", 4.0)) as usize,
            patch,
            in_channels: u(v, "num_channels", Some(3))?,
            pos_side: u(v, "max_img_size", Some(2048))? / patch.max(1),
            n_prefix: u(v, "num_cls_tokens", Some(3))? + u(v, "num_registers", Some(7))?,
            eps: f(v, "layer_norm_eps", 1e-6) as f32,
            gelu_tanh,
            qkv_bias: v.get("qkv_bias").and_then(Value::as_bool).unwrap_or(true),
            merge,
            projector_hidden: u(cfg, "projector_hidden_size", Some(4096))?,
            out_hidden: u(text, "hidden_size", None)?,
        };
        let vit_hidden = cfg
            .get("vision_hidden_size")
            .or_else(|| cfg.get("vit_hidden_size"))
            .and_then(Value::as_u64);
        let bad = c.depth == 0
            || c.n_heads == 0
            || c.hidden == 0
            || !c.hidden.is_multiple_of(c.n_heads)
            || c.patch == 0
            || c.in_channels == 0
            || c.pos_side == 0
            || c.intermediate == 0
            || c.merge == 0
            || c.projector_hidden == 0
            || c.out_hidden == 0
            || vit_hidden.is_some_and(|h| h as usize != c.hidden);
        if bad {
            return Err(ModelError::Config(format!(
                "the vision config is not a shape this tower runs: {c:?} (downsample_ratio \
                 {ratio}, vision_hidden_size {vit_hidden:?})"
            )));
        }
        Ok(c)
    }
}

/// How the checkpoint names the vision tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Names {
    /// NVIDIA's (and `save_pretrained`'s): `vision_model.radio_model.model.*`, `mlp1.*`.
    Nvidia,
    /// transformers' module names: `vision_model.embeddings.*`, `multi_modal_projector.*`.
    Hf,
}

impl Names {
    /// The naming of `src`, if it has a RADIO tower.
    fn detect(src: &ModelSource) -> Option<Names> {
        if src.has("vision_model.radio_model.model.patch_generator.embedder.weight") {
            Some(Names::Nvidia)
        } else if src.has("vision_model.embeddings.patch_projection.weight") {
            Some(Names::Hf)
        } else {
            None
        }
    }

    /// Patch projection, position table, prefix rows.
    fn embeddings(self) -> [&'static str; 3] {
        match self {
            Names::Nvidia => [
                "vision_model.radio_model.model.patch_generator.embedder.weight",
                "vision_model.radio_model.model.patch_generator.pos_embed",
                "vision_model.radio_model.model.patch_generator.cls_token.token",
            ],
            Names::Hf => [
                "vision_model.embeddings.patch_projection.weight",
                "vision_model.embeddings.position_embedding",
                "vision_model.embeddings.cls_register_token",
            ],
        }
    }

    /// Stem of block `i`'s tensor `hf` (transformers' name inside the layer).
    fn block(self, i: usize, hf: &str) -> String {
        match self {
            Names::Nvidia => {
                let gg = match hf {
                    "attention.o_proj" => "attn.proj",
                    other => other,
                };
                format!("vision_model.radio_model.model.blocks.{i}.{gg}")
            }
            Names::Hf => format!("vision_model.encoder.layer.{i}.{hf}"),
        }
    }

    /// The final LayerNorm's stem and the projector's norm, linear_1 and linear_2 weights.
    fn head(self) -> [&'static str; 4] {
        match self {
            Names::Nvidia => [
                "vision_projector.vision_final_layernorm",
                "mlp1.0.weight",
                "mlp1.1.weight",
                "mlp1.3.weight",
            ],
            Names::Hf => [
                "vision_final_layernorm",
                "multi_modal_projector.layer_norm.weight",
                "multi_modal_projector.linear_1.weight",
                "multi_modal_projector.linear_2.weight",
            ],
        }
    }
}

/// One block's weights on the backend.
struct VisionBlock {
    norm1: (Tensor, Tensor),
    /// `[3 hidden, hidden]` (q | k | v rows) and its bias when the config has one.
    qkv: (kapitsa_backend::Weight, Option<Tensor>),
    /// The output projection, LayerScale 1 folded in.
    proj: (kapitsa_backend::Weight, Tensor),
    norm2: (Tensor, Tensor),
    fc1: (kapitsa_backend::Weight, Tensor),
    /// LayerScale 2 folded in.
    fc2: (kapitsa_backend::Weight, Tensor),
}

/// A loaded Nemotron omni vision path (tower, pixel shuffle, projector).
pub struct NemotronVision {
    be: Arc<dyn Backend>,
    cfg: VisionConfig,
    tokens: VisionTokens,
    /// `[hidden, patch_dim]`.
    patch: kapitsa_backend::Weight,
    /// `[pos_side^2, hidden]` f32 on the host.
    pos_embed: Vec<f32>,
    /// `[n_prefix, hidden]` f32.
    prefix: Tensor,
    blocks: Vec<VisionBlock>,
    /// The LayerNorm after the tower (checkpoints whose language model has MTP layers).
    final_norm: Option<(Tensor, Tensor)>,
    /// The projector's RMSNorm weight `[merge^2 hidden]`.
    proj_norm: Tensor,
    /// linear_1 (up) and linear_2 (down) as a squared-ReLU MLP.
    proj_mlp: MlpWeights,
}

impl std::fmt::Debug for NemotronVision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NemotronVision")
            .field("cfg", &self.cfg)
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}

/// The LayerScale `[n]` at `stem` (transformers' `layer_scaleK.lambda1` or timm's `lsK.gamma`),
/// `None` when absent or all ones.
fn layer_scale(src: &ModelSource, stems: [&str; 2], n: usize) -> Result<Option<Vec<f32>>> {
    for s in stems {
        if src.has(s) {
            let v = host_vec(src, s, n)?;
            return Ok(v.iter().any(|&x| x != 1.0).then_some(v));
        }
    }
    Ok(None)
}

/// The id of the special token `content`: `tokenizer_config.json`'s `added_tokens_decoder`,
/// else `tokenizer.json`'s `added_tokens` or vocabulary.
fn special_id(src: &ModelSource, content: &str) -> Option<u32> {
    let hf = src.hf()?;
    if let Some(map) = hf
        .tokenizer_config()
        .and_then(|t| t.get("added_tokens_decoder"))
        .and_then(Value::as_object)
    {
        for (id, tok) in map {
            if tok.get("content").and_then(Value::as_str) == Some(content) {
                if let Ok(id) = id.parse::<u32>() {
                    return Some(id);
                }
            }
        }
    }
    let text = std::fs::read_to_string(hf.tokenizer_json_path()?).ok()?;
    let tok: Value = serde_json::from_str(&text).ok()?;
    let added = tok.get("added_tokens").and_then(Value::as_array);
    for t in added.into_iter().flatten() {
        if t.get("content").and_then(Value::as_str) == Some(content) {
            return t.get("id").and_then(Value::as_u64).map(|x| x as u32);
        }
    }
    tok.get("model")?
        .get("vocab")?
        .get(content)?
        .as_u64()
        .map(|x| x as u32)
}

impl NemotronVision {
    /// Load the vision path of an HF `nemotron_h_omni` checkpoint onto `be`; `Ok(None)` when
    /// the checkpoint has no RADIO tower (a text-only file). The image token is the config's
    /// `image_token_id` (legacy `img_context_token_id`; else `<image>` in the tokenizer), the
    /// frame tokens `<img>` and `</img>` come from the tokenizer files.
    pub fn load(src: &ModelSource, be: Arc<dyn Backend>) -> Result<Option<NemotronVision>> {
        let (Some(hf), Some(names)) = (src.hf(), Names::detect(src)) else {
            return Ok(None);
        };
        let root = hf.config();
        let cfg = VisionConfig::from_hf(root)?;
        let token = |content: &str| {
            special_id(src, content)
                .ok_or_else(|| ModelError::Config(format!("the tokenizer has no {content} token")))
        };
        let image = ["image_token_id", "img_context_token_id"]
            .iter()
            .find_map(|k| root.get(*k).and_then(Value::as_u64))
            .map(|x| Ok(x as u32))
            .unwrap_or_else(|| token("<image>"))?;
        let tokens = VisionTokens {
            image,
            start: token("<img>")?,
            end: token("</img>")?,
        };
        let b = &*be;
        let (d, pd) = (cfg.hidden, cfg.patch_dim());
        let [patch, pos, prefix] = names.embeddings();
        let patch = src.weight(patch)?.expect_shape(&[d, pd])?.upload(b)?;
        let n_pos = cfg.pos_side * cfg.pos_side;
        let pos = src.weight(pos)?;
        if pos.n_elements() != n_pos * d {
            return Err(ModelError::BadShape {
                name: pos.name.clone(),
                got: pos.shape.clone(),
                want: vec![1, n_pos, d],
            });
        }
        let pos_embed = pos.to_f32()?;
        let prefix = vec_tensor(b, src, prefix, cfg.n_prefix * d)?;
        let mut blocks = Vec::with_capacity(cfg.depth);
        for i in 0..cfg.depth {
            let n = |hf: &str| names.block(i, hf);
            let ls = |k: usize| {
                layer_scale(
                    src,
                    [
                        &n(&format!("layer_scale{k}.lambda1")),
                        &n(&format!("ls{k}.gamma")),
                    ],
                    d,
                )
            };
            let (ls1, ls2) = (ls(1)?, ls(2)?);
            blocks.push(VisionBlock {
                norm1: norm(b, src, &n("norm1"), d)?,
                qkv: Self::qkv(b, src, names, i, &cfg)?,
                proj: linear(b, src, &n("attention.o_proj"), d, d, ls1.as_deref())?,
                norm2: norm(b, src, &n("norm2"), d)?,
                fc1: linear(b, src, &n("mlp.fc1"), cfg.intermediate, d, None)?,
                fc2: linear(b, src, &n("mlp.fc2"), d, cfg.intermediate, ls2.as_deref())?,
            });
        }
        let [final_norm, proj_norm, up, down] = names.head();
        let final_norm = if src.has(&format!("{final_norm}.weight")) {
            Some(norm(b, src, final_norm, d)?)
        } else {
            None
        };
        let md = cfg.shuffled();
        let proj_norm = vec_tensor(b, src, proj_norm, md)?;
        for w in [up, down] {
            let bias = w.replace(".weight", ".bias");
            if src.has(&bias) {
                return Err(ModelError::Config(format!(
                    "{bias}: a projector with biases is not supported"
                )));
            }
        }
        let proj_mlp = MlpWeights {
            gate: None,
            up: src
                .weight(up)?
                .expect_shape(&[cfg.projector_hidden, md])?
                .upload(b)?,
            down: src
                .weight(down)?
                .expect_shape(&[cfg.out_hidden, cfg.projector_hidden])?
                .upload(b)?,
            act: Act::Relu2,
        };
        Ok(Some(NemotronVision {
            be,
            cfg,
            tokens,
            patch,
            pos_embed,
            prefix,
            blocks,
            final_norm,
            proj_norm,
            proj_mlp,
        }))
    }

    /// Block `i`'s fused q | k | v projection `[3 hidden, hidden]` and bias: NVIDIA's
    /// `attn.qkv` as stored, transformers' `q_proj`, `k_proj`, `v_proj` stacked.
    fn qkv(
        be: &dyn Backend,
        src: &ModelSource,
        names: Names,
        i: usize,
        cfg: &VisionConfig,
    ) -> Result<(kapitsa_backend::Weight, Option<Tensor>)> {
        let d = cfg.hidden;
        let bias = |stems: &[String]| -> Result<Option<Tensor>> {
            if !cfg.qkv_bias {
                return Ok(None);
            }
            let mut b = Vec::with_capacity(3 * d);
            for s in stems {
                b.extend(host_vec(src, &format!("{s}.bias"), 3 * d / stems.len())?);
            }
            Ok(Some(be.upload_f32(&b)?))
        };
        match names {
            Names::Nvidia => {
                let stem = names.block(i, "attn.qkv");
                let w = src
                    .weight(&format!("{stem}.weight"))?
                    .expect_shape(&[3 * d, d])?
                    .upload(be)?;
                Ok((w, bias(&[stem])?))
            }
            Names::Hf => {
                let stems: Vec<String> = ["q_proj", "k_proj", "v_proj"]
                    .iter()
                    .map(|p| names.block(i, &format!("attention.{p}")))
                    .collect();
                let mut m = Vec::with_capacity(3 * d * d);
                for s in &stems {
                    m.extend(
                        src.weight(&format!("{s}.weight"))?
                            .expect_shape(&[d, d])?
                            .to_f32()?,
                    );
                }
                let w = Weight::from_f32(
                    &format!("{}.qkv", names.block(i, "attention")),
                    vec![3 * d, d],
                    &m,
                );
                Ok((w.upload(be)?, bias(&stems)?))
            }
        }
    }

    /// The tower's dimensions.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Run the vision path on one image of patch grid `grid` = (1, h, w): `pixels`
    /// `[h * w, in_channels * patch^2]` f32, the processor's normalised patches, row-major
    /// over the grid, each channel-major (`preprocess_nemotron`); returns the language-model
    /// rows `[h * w / merge^2, out_hidden]` (host), in the order of the image's tokens.
    pub fn encode(&self, pixels: &[f32], grid: [usize; 3]) -> Result<Vec<f32>> {
        let n = self.info().check_patches(pixels.len(), grid)?;
        let be = &*self.be;
        let c = &self.cfg;
        let (d, hd, np) = (c.hidden, c.head_dim(), c.n_prefix);
        let total = np + n;
        // patch rows plus positions, behind the learned prefix rows
        let mut e = tensor(be, n * d)?;
        let px = be.upload_f32(pixels)?;
        be.matmul(&self.patch, &px, n, &mut e)?;
        let pos = be.upload_f32(&self.position_rows(grid[1], grid[2]))?;
        be.add(&mut e, &pos)?;
        let mut x = tensor(be, total * d)?;
        be.copy(&self.prefix, 0, &mut x, 0, np * d)?;
        be.copy(&e, 0, &mut x, np * d, n * d)?;
        drop((e, px, pos));
        // one image: every row attends to the whole sequence
        let spans = vec![(0u32, total as u32); total];
        let shape = AttnShape {
            n_head: c.n_heads,
            n_head_kv: c.n_heads,
            head_dim: hd,
            scale: (hd as f32).powf(-0.5),
        };
        let mut h = tensor(be, total * d)?;
        let mut qkv = tensor(be, total * 3 * d)?;
        let mut q = tensor(be, total * d)?;
        let mut k = tensor(be, total * d)?;
        let mut v = tensor(be, total * d)?;
        let mut att = tensor(be, total * d)?;
        let mut mid = tensor(be, total * c.intermediate)?;
        for blk in &self.blocks {
            be.copy(&x, 0, &mut h, 0, total * d)?;
            be.layer_norm(&mut h, d, &blk.norm1.0, &blk.norm1.1, c.eps)?;
            let qkv_ep = Epilogue {
                bias: blk.qkv.1.as_ref(),
                accumulate: false,
            };
            be.matmul_with(&blk.qkv.0, &h, total, &mut qkv, qkv_ep)?;
            be.split_cols(&qkv, total, &[d, d, d], &mut [&mut q, &mut k, &mut v])?;
            be.attention_spans(shape, &q, &k, &v, &spans, &mut att)?;
            be.matmul_with(&blk.proj.0, &att, total, &mut x, ep(&blk.proj.1, true))?;
            be.copy(&x, 0, &mut h, 0, total * d)?;
            be.layer_norm(&mut h, d, &blk.norm2.0, &blk.norm2.1, c.eps)?;
            be.matmul_with(&blk.fc1.0, &h, total, &mut mid, ep(&blk.fc1.1, false))?;
            be.gelu(&mut mid, c.gelu_tanh)?;
            be.matmul_with(&blk.fc2.0, &mid, total, &mut x, ep(&blk.fc2.1, true))?;
        }
        drop((h, qkv, q, k, v, att, mid));
        if let Some((w, b)) = &self.final_norm {
            be.layer_norm(&mut x, d, w, b, c.eps)?;
        }
        // pixel shuffle: per merged row (r, c) and row offset j, the m patches
        // (m r + j, m c .. m c + m) are m * d contiguous values of x
        let (m, gw) = (c.merge, grid[2]);
        let rows = n / (m * m);
        let mut s = tensor(be, rows * c.shuffled())?;
        for r in 0..grid[1] / m {
            for col in 0..gw / m {
                let out_row = r * (gw / m) + col;
                for j in 0..m {
                    let src_row = np + (m * r + j) * gw + m * col;
                    let dst = (out_row * m * m + j * m) * d;
                    be.copy(&x, src_row * d, &mut s, dst, m * d)?;
                }
            }
        }
        drop(x);
        be.rms_norm(&mut s, c.shuffled(), &self.proj_norm, PROJECTOR_EPS)?;
        let mut out = tensor(be, rows * c.out_hidden)?;
        be.mlp(&self.proj_mlp, &s, rows, &mut out)?;
        let mut host = vec![0f32; rows * c.out_hidden];
        be.read_f32(&out, 0, &mut host)?;
        Ok(host)
    }

    /// The learned position rows of an `h x w` patch grid, row-major, `[h * w, hidden]`: the
    /// `side x side` table resampled bilinearly (align_corners false, no antialias) to
    /// `max(h, w)` squared, then its top-left `h x w` corner, as `RadioPatchEmbeddings.
    /// _interpolate_position_embedding` does.
    fn position_rows(&self, h: usize, w: usize) -> Vec<f32> {
        let (d, side) = (self.cfg.hidden, self.cfg.pos_side);
        let size = h.max(w);
        let mut out = vec![0f32; h * w * d];
        for (j, row_out) in out.chunks_exact_mut(d).enumerate() {
            let (ty, tx) = (
                bilinear_taps(j / w, side, size),
                bilinear_taps(j % w, side, size),
            );
            let at =
                |y: usize, x: usize| &self.pos_embed[(y * side + x) * d..(y * side + x + 1) * d];
            let (r00, r01) = (at(ty.0, tx.0), at(ty.0, tx.1));
            let (r10, r11) = (at(ty.1, tx.0), at(ty.1, tx.1));
            for (i, o) in row_out.iter_mut().enumerate() {
                let top = tx.2 * r00[i] + tx.3 * r01[i];
                let bottom = tx.2 * r10[i] + tx.3 * r11[i];
                *o = ty.2 * top + ty.3 * bottom;
            }
        }
        out
    }
}

impl VisionTower for NemotronVision {
    fn info(&self) -> VisionInfo {
        VisionInfo {
            kind: VisionKind::Nemotron,
            tokens: self.tokens,
            frames: true,
            patch: self.cfg.patch,
            temporal_patch: 1,
            merge: self.cfg.merge,
        }
    }

    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "Nemotron RADIO vision tower ({} blocks of {}, patches of {} px, {}x{} pixel shuffle)",
            c.depth, c.hidden, c.patch, c.merge, c.merge
        )
    }

    fn encode(&self, pixels: &[f32], grid: [usize; 3]) -> Result<Vec<f32>> {
        NemotronVision::encode(self, pixels, grid)
    }
}

/// Source taps of output index `dst` when `in_size` samples are resized to `out_size` by
/// torch's bilinear interpolation with `align_corners=False`: `(i0, i1, w0, w1)`, the source
/// index `max((dst + 0.5) * in / out - 0.5, 0)` split into its floor and fraction in f32 (the
/// last sample repeats at the edge); an unchanged size copies.
fn bilinear_taps(dst: usize, in_size: usize, out_size: usize) -> (usize, usize, f32, f32) {
    if in_size == out_size {
        return (dst, dst, 1.0, 0.0);
    }
    let scale = in_size as f32 / out_size as f32;
    let real = (scale * (dst as f32 + 0.5) - 0.5).max(0.0);
    let i0 = (real as usize).min(in_size - 1);
    let i1 = if i0 + 1 < in_size { i0 + 1 } else { i0 };
    let w1 = real - i0 as f32;
    (i0, i1, 1.0 - w1, w1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bilinear_taps_match_torch() {
        // torch: F.interpolate(arange(4).view(1,1,1,4), size=(1,8), mode="bilinear") =
        // [0, .25, .75, 1.25, 1.75, 2.25, 2.75, 3]
        let src = [0f32, 1.0, 2.0, 3.0];
        let got: Vec<f32> = (0..8)
            .map(|i| {
                let (a, b, wa, wb) = bilinear_taps(i, 4, 8);
                wa * src[a] + wb * src[b]
            })
            .collect();
        assert_eq!(got, [0.0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3.0]);
        // downsampling 8 -> 3 takes no antialias: index (i + .5) * 8/3 - .5
        let (a, b, _, wb) = bilinear_taps(1, 8, 3);
        assert_eq!((a, b), (3, 4));
        assert!((wb - (1.5f32 * 8.0 / 3.0 - 0.5 - 3.0)).abs() < 1e-6);
        assert_eq!(bilinear_taps(5, 7, 7), (5, 5, 1.0, 0.0));
    }
}
