//! The Qwen3.5/3.6 vision tower (transformers' `Qwen3_5VisionModel`): image patches in,
//! the rows the language model takes in place of an image's `<|image_pad|>` tokens out.
//!
//! ```text
//! x   = patches @ patch_embed^T + b            # Conv3d with kernel = stride: a matmul
//!                                              # [n, C*T*P*P] -> [n, hidden]
//! x  += bilinear(pos_embed, grid)              # learned side x side table resampled to the
//!                                              # image's grid (align_corners), on the host
//! per block:                                   # depth blocks, pre-LayerNorm (eps 1e-6)
//!   q, k, v = split(LN1(x) @ qkv^T + b)        # heads of hidden / n_heads
//!   q, k    = rope2d(q, k)                     # dims [0, hd/4) turn with the patch row,
//!                                              # [hd/4, hd/2) with its column (NeoX pairs)
//!   x      += proj(attention(q, k, v)) + b     # full attention within each frame
//!   x      += fc2(gelu_tanh(fc1(LN2(x))))
//! out = fc2(gelu(fc1(LN(x).view(n / m^2, m^2 hidden))))   # the merger: m x m patches -> 1
//! ```
//! Patches come in the image processor's order (each `m x m` merge block's patches
//! consecutive, blocks row-major), so the merger's rows are the merged grid, row-major: the
//! order of the image's tokens in the prompt. Qwen3.5 has no deepstack features: the merger's
//! output is all the language model takes.
//!
//! Weights: HF `model.visual.*` (Qwen3_5ForConditionalGeneration / Qwen3_5Moe...) in the
//! checkpoint's dtype on the backend; the position table stays on the host (it is resampled
//! per image). Activations are `[n_patches, hidden]` f32 on the backend; the LayerNorm, GELU,
//! rotary-table and span-attention ops are the backend's (their CUDA forms are host round
//! trips until kernels exist). llama.cpp's mmproj GGUF is not read yet.

use std::sync::Arc;

use kapitsa_backend::{AttnShape, Backend, Tensor};
use serde_json::Value;

use crate::layers::tensor;
use crate::mrope::inv_freq;
pub use crate::vision::VisionTokens;
use crate::vision::{ep, linear, norm, vec_tensor, VisionInfo, VisionKind, VisionTower};
use crate::{ModelError, ModelSource, Result, Weight};

/// The tower's dimensions (HF `vision_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Blocks.
    pub depth: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Attention heads (`hidden / n_heads` per head).
    pub n_heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Patch side in pixels.
    pub patch: usize,
    /// Frames per patch.
    pub temporal_patch: usize,
    /// Patches merged per side into one language-model token.
    pub merge: usize,
    /// Image channels.
    pub in_channels: usize,
    /// Width of the rows the language model takes.
    pub out_hidden: usize,
    /// Side of the learned position table (`sqrt(num_position_embeddings)`).
    pub pos_side: usize,
    /// Blocks' MLP activation: the tanh GELU (`gelu_pytorch_tanh`) or the exact one.
    pub gelu_tanh: bool,
    /// Rotary base.
    pub theta: f32,
}

impl VisionConfig {
    /// Values of a patch row, `in_channels * temporal_patch * patch^2`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch * self.patch * self.patch
    }

    /// Dims per head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_heads
    }

    /// Read `vision_config` of an HF config.json.
    pub fn from_hf(cfg: &Value) -> Result<VisionConfig> {
        let v = cfg
            .get("vision_config")
            .ok_or_else(|| ModelError::Config("config.json has no vision_config".into()))?;
        let u = |k: &str, default: Option<usize>| -> Result<usize> {
            match v.get(k).and_then(Value::as_u64) {
                Some(x) => Ok(x as usize),
                None => default
                    .ok_or_else(|| ModelError::Config(format!("vision_config has no integer {k}"))),
            }
        };
        let n_pos = u("num_position_embeddings", Some(2304))?;
        let pos_side = (n_pos as f64).sqrt().round() as usize;
        let act = v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("gelu_pytorch_tanh");
        let theta = v
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0) as f32;
        let c = VisionConfig {
            depth: u("depth", None)?,
            hidden: u("hidden_size", None)?,
            n_heads: u("num_heads", None)?,
            intermediate: u("intermediate_size", None)?,
            patch: u("patch_size", Some(16))?,
            temporal_patch: u("temporal_patch_size", Some(2))?,
            merge: u("spatial_merge_size", Some(2))?,
            in_channels: u("in_channels", Some(3))?,
            out_hidden: u("out_hidden_size", None)?,
            pos_side,
            gelu_tanh: match act {
                "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => true,
                "gelu" => false,
                other => {
                    return Err(ModelError::Config(format!(
                        "vision_config.hidden_act {other} is not supported"
                    )))
                }
            },
            theta,
        };
        let bad = c.depth == 0
            || c.n_heads == 0
            || c.hidden == 0
            || !c.hidden.is_multiple_of(c.n_heads)
            || !c.head_dim().is_multiple_of(4)
            || c.merge == 0
            || c.patch == 0
            || c.temporal_patch == 0
            || pos_side * pos_side != n_pos;
        if bad {
            return Err(ModelError::Config(format!(
                "vision_config is not a shape this tower runs: {c:?} ({n_pos} positions)"
            )));
        }
        Ok(c)
    }
}

/// One block's weights on the backend.
struct VisionBlock {
    norm1: (Tensor, Tensor),
    qkv: (kapitsa_backend::Weight, Tensor),
    proj: (kapitsa_backend::Weight, Tensor),
    norm2: (Tensor, Tensor),
    fc1: (kapitsa_backend::Weight, Tensor),
    fc2: (kapitsa_backend::Weight, Tensor),
}

/// A loaded vision tower.
pub struct Qwen35Vision {
    be: Arc<dyn Backend>,
    cfg: VisionConfig,
    tokens: VisionTokens,
    patch: (kapitsa_backend::Weight, Tensor),
    /// `[pos_side^2, hidden]` f32 on the host.
    pos_embed: Vec<f32>,
    blocks: Vec<VisionBlock>,
    merger_norm: (Tensor, Tensor),
    merger_fc1: (kapitsa_backend::Weight, Tensor),
    merger_fc2: (kapitsa_backend::Weight, Tensor),
}

impl std::fmt::Debug for Qwen35Vision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qwen35Vision")
            .field("cfg", &self.cfg)
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}

/// How a file names the tower's tensors.
enum Names {
    /// HF: `<prefix>blocks.{i}.<name>` and `<prefix><name>`.
    Hf(&'static str),
    /// llama.cpp's mmproj: `v.blk.{i}.<name>` and the global names as given.
    Mmproj,
}

impl Names {
    /// The name of a tensor (or a weight/bias pair's stem): `hf` as HF spells it (under
    /// `blocks.{block}` when `block` is given), `gg` as the mmproj does.
    fn get(&self, block: Option<usize>, hf: &str, gg: &str) -> String {
        match (self, block) {
            (Names::Hf(p), Some(i)) => format!("{p}blocks.{i}.{hf}"),
            (Names::Hf(p), None) => format!("{p}{hf}"),
            (Names::Mmproj, Some(i)) => format!("v.blk.{i}.{gg}"),
            (Names::Mmproj, None) => gg.to_string(),
        }
    }
}

/// The prefix of the tower's tensors in `src`, if it has one.
fn visual_prefix(src: &ModelSource) -> Option<&'static str> {
    ["model.visual.", "visual.", "vision_tower."]
        .into_iter()
        .find(|p| src.has(&format!("{p}patch_embed.proj.weight")))
}

impl Qwen35Vision {
    /// Load the tower of an HF checkpoint onto `be`; `Ok(None)` when the checkpoint has none
    /// (a text-only file).
    pub fn load(src: &ModelSource, be: Arc<dyn Backend>) -> Result<Option<Qwen35Vision>> {
        let (Some(hf), Some(p)) = (src.hf(), visual_prefix(src)) else {
            return Ok(None);
        };
        let root = hf.config();
        let cfg = VisionConfig::from_hf(root)?;
        let id = |k: &str| -> Result<u32> {
            root.get(k)
                .or_else(|| root.get("text_config").and_then(|t| t.get(k)))
                .and_then(Value::as_u64)
                .map(|x| x as u32)
                .ok_or_else(|| ModelError::Config(format!("config.json has no {k}")))
        };
        let tokens = VisionTokens {
            image: id("image_token_id")?,
            start: id("vision_start_token_id")?,
            end: id("vision_end_token_id")?,
        };
        let (d, pd) = (cfg.hidden, cfg.patch_dim());
        let conv = src.weight(&format!("{p}patch_embed.proj.weight"))?;
        let want = [d, cfg.in_channels, cfg.temporal_patch, cfg.patch, cfg.patch];
        if conv.shape != want {
            return Err(ModelError::BadShape {
                name: conv.name.clone(),
                got: conv.shape.clone(),
                want: want.to_vec(),
            });
        }
        // Conv3d with kernel = stride over one patch: a [hidden, C*T*P*P] matmul.
        let conv = Weight::from_bytes(&conv.name, conv.dtype, vec![d, pd], conv.bytes()?.to_vec())?;
        let names = Names::Hf(p);
        Self::assemble(src, &names, cfg, tokens, conv, be).map(Some)
    }

    /// Load the tower of a llama.cpp mmproj GGUF (`convert_hf_to_gguf.py --mmproj`, projector
    /// `qwen3vl_merger`) onto `be`; `tokens` come from the language model's vocabulary. The
    /// converter splits the Conv3d over its two frames (`v.patch_embd.weight`, `.weight.1`):
    /// they are joined back into the `[hidden, C*T*P*P]` matrix.
    pub fn load_mmproj(
        src: &ModelSource,
        tokens: VisionTokens,
        be: Arc<dyn Backend>,
    ) -> Result<Qwen35Vision> {
        let g = src
            .gguf()
            .ok_or_else(|| ModelError::Config("an mmproj must be a GGUF file".into()))?;
        let proj = g.get_str("clip.projector_type").unwrap_or("");
        if proj != "qwen3vl_merger" || !g.get_bool("clip.has_vision_encoder").unwrap_or(false) {
            return Err(ModelError::Config(format!(
                "the mmproj's projector is {proj:?}: only Qwen3.5/3.6's (qwen3vl_merger) runs"
            )));
        }
        let u = |k: &str| -> Result<usize> {
            Ok(g.get_u32(&format!("clip.vision.{k}"))
                .map_err(|e| ModelError::Config(format!("mmproj: {e}")))? as usize)
        };
        let frames = [
            src.weight("v.patch_embd.weight")?,
            src.weight("v.patch_embd.weight.1")?,
        ];
        let pos = src.weight("v.position_embd.weight")?;
        let (d, patch) = (u("embedding_length")?, u("patch_size")?);
        let n_pos = pos.shape.first().copied().unwrap_or(0);
        let pos_side = (n_pos as f64).sqrt().round() as usize;
        let n_heads = u("attention.head_count")?;
        let cfg = VisionConfig {
            depth: u("block_count")?,
            hidden: d,
            n_heads,
            intermediate: u("feed_forward_length")?,
            patch,
            temporal_patch: 2,
            merge: u("spatial_merge_size")?,
            in_channels: 3,
            out_hidden: u("projection_dim")?,
            pos_side,
            gelu_tanh: true,
            theta: 10000.0,
        };
        let bad = cfg.depth == 0
            || n_heads == 0
            || !d.is_multiple_of(n_heads)
            || !cfg.head_dim().is_multiple_of(4)
            || cfg.merge == 0
            || pos_side * pos_side != n_pos;
        if bad {
            return Err(ModelError::Config(format!(
                "the mmproj is not a shape this tower runs: {cfg:?} ({n_pos} positions)"
            )));
        }
        // frame t of the Conv3d: [hidden, C, P, P]; joined as [hidden, C, T, P, P]
        let frame_len = patch * patch;
        let mut f = Vec::with_capacity(2);
        for w in frames {
            f.push(w.expect_shape(&[d, 3, patch, patch])?.to_f32()?);
        }
        let mut conv = Vec::with_capacity(d * cfg.patch_dim());
        for o in 0..d {
            for c in 0..3 {
                for fr in &f {
                    let at = (o * 3 + c) * frame_len;
                    conv.extend_from_slice(&fr[at..at + frame_len]);
                }
            }
        }
        let conv = Weight::from_f32("v.patch_embd.weight", vec![d, cfg.patch_dim()], &conv);
        Self::assemble(src, &Names::Mmproj, cfg, tokens, conv, be)
    }

    /// The rest of a load: every weight but the patch embedding's matrix `conv`
    /// (`[hidden, patch_dim]`), named as `names` says.
    fn assemble(
        src: &ModelSource,
        names: &Names,
        cfg: VisionConfig,
        tokens: VisionTokens,
        conv: Weight,
        be: Arc<dyn Backend>,
    ) -> Result<Qwen35Vision> {
        let b = &*be;
        let d = cfg.hidden;
        let patch = (
            conv.upload(b)?,
            vec_tensor(
                b,
                src,
                &names.get(None, "patch_embed.proj.bias", "v.patch_embd.bias"),
                d,
            )?,
        );
        let pos = src
            .weight(&names.get(None, "pos_embed.weight", "v.position_embd.weight"))?
            .expect_shape(&[cfg.pos_side * cfg.pos_side, d])?;
        let pos_embed = pos.to_f32()?;
        let mut blocks = Vec::with_capacity(cfg.depth);
        for i in 0..cfg.depth {
            let n = |hf: &str, gg: &str| names.get(Some(i), hf, gg);
            blocks.push(VisionBlock {
                norm1: norm(b, src, &n("norm1", "ln1"), d)?,
                qkv: linear(b, src, &n("attn.qkv", "attn_qkv"), 3 * d, d, None)?,
                proj: linear(b, src, &n("attn.proj", "attn_out"), d, d, None)?,
                norm2: norm(b, src, &n("norm2", "ln2"), d)?,
                fc1: linear(
                    b,
                    src,
                    &n("mlp.linear_fc1", "ffn_up"),
                    cfg.intermediate,
                    d,
                    None,
                )?,
                fc2: linear(
                    b,
                    src,
                    &n("mlp.linear_fc2", "ffn_down"),
                    d,
                    cfg.intermediate,
                    None,
                )?,
            });
        }
        let md = d * cfg.merge * cfg.merge;
        let n = |hf: &str, gg: &str| names.get(None, hf, gg);
        let merger_norm = norm(b, src, &n("merger.norm", "v.post_ln"), d)?;
        let merger_fc1 = linear(b, src, &n("merger.linear_fc1", "mm.0"), md, md, None)?;
        let merger_fc2 = linear(
            b,
            src,
            &n("merger.linear_fc2", "mm.2"),
            cfg.out_hidden,
            md,
            None,
        )?;
        Ok(Qwen35Vision {
            be,
            cfg,
            tokens,
            patch,
            pos_embed,
            blocks,
            merger_norm,
            merger_fc1,
            merger_fc2,
        })
    }

    /// The tower's dimensions.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Run the tower on one image (or video) of patch grid `grid` (t, h, w): `pixels`
    /// `[t * h * w, patch_dim]` f32 in the processor's order; returns the language-model rows
    /// `[t * h * w / merge^2, out_hidden]` (host).
    pub fn encode(&self, pixels: &[f32], grid: [usize; 3]) -> Result<Vec<f32>> {
        let n = self.info().check_patches(pixels.len(), grid)?;
        let be = &*self.be;
        let c = &self.cfg;
        let (d, hd) = (c.hidden, c.head_dim());
        let mut x = tensor(be, n * d)?;
        let px = be.upload_f32(pixels)?;
        be.matmul_with(&self.patch.0, &px, n, &mut x, ep(&self.patch.1, false))?;
        let pos = be.upload_f32(&self.position_rows(grid))?;
        be.add(&mut x, &pos)?;
        let (cos, sin) = rotary_tables(grid, c.merge, hd, c.theta);
        let (cos, sin) = (be.upload_f32(&cos)?, be.upload_f32(&sin)?);
        // each frame attends to itself
        let frame = grid[1] * grid[2];
        let spans: Vec<(u32, u32)> = (0..n)
            .map(|i| {
                let f = i / frame;
                ((f * frame) as u32, ((f + 1) * frame) as u32)
            })
            .collect();
        let shape = AttnShape {
            n_head: c.n_heads,
            n_head_kv: c.n_heads,
            head_dim: hd,
            scale: (hd as f32).powf(-0.5),
        };
        let mut h = tensor(be, n * d)?;
        let mut qkv = tensor(be, n * 3 * d)?;
        let (mut q, mut k, mut v) = (tensor(be, n * d)?, tensor(be, n * d)?, tensor(be, n * d)?);
        let mut att = tensor(be, n * d)?;
        let mut mid = tensor(be, n * c.intermediate)?;
        for blk in &self.blocks {
            be.copy(&x, 0, &mut h, 0, n * d)?;
            be.layer_norm(&mut h, d, &blk.norm1.0, &blk.norm1.1, 1e-6)?;
            be.matmul_with(&blk.qkv.0, &h, n, &mut qkv, ep(&blk.qkv.1, false))?;
            be.split_cols(&qkv, n, &[d, d, d], &mut [&mut q, &mut k, &mut v])?;
            be.rope_table(&mut q, c.n_heads, hd, &cos, &sin)?;
            be.rope_table(&mut k, c.n_heads, hd, &cos, &sin)?;
            be.attention_spans(shape, &q, &k, &v, &spans, &mut att)?;
            be.matmul_with(&blk.proj.0, &att, n, &mut x, ep(&blk.proj.1, true))?;
            be.copy(&x, 0, &mut h, 0, n * d)?;
            be.layer_norm(&mut h, d, &blk.norm2.0, &blk.norm2.1, 1e-6)?;
            be.matmul_with(&blk.fc1.0, &h, n, &mut mid, ep(&blk.fc1.1, false))?;
            be.gelu(&mut mid, c.gelu_tanh)?;
            be.matmul_with(&blk.fc2.0, &mid, n, &mut x, ep(&blk.fc2.1, true))?;
        }
        // the merger: LayerNorm per patch, then m*m consecutive patches as one row
        be.layer_norm(&mut x, d, &self.merger_norm.0, &self.merger_norm.1, 1e-6)?;
        let (rows, md) = (n / (c.merge * c.merge), d * c.merge * c.merge);
        let mut m1 = tensor(be, rows * md)?;
        be.matmul_with(
            &self.merger_fc1.0,
            &x,
            rows,
            &mut m1,
            ep(&self.merger_fc1.1, false),
        )?;
        be.gelu(&mut m1, false)?;
        let mut out = tensor(be, rows * c.out_hidden)?;
        be.matmul_with(
            &self.merger_fc2.0,
            &m1,
            rows,
            &mut out,
            ep(&self.merger_fc2.1, false),
        )?;
        let mut host = vec![0f32; rows * c.out_hidden];
        be.read_f32(&out, 0, &mut host)?;
        Ok(host)
    }

    /// The learned position rows of every patch of `grid` (processor order), `[n, hidden]`:
    /// the `side x side` table resampled bilinearly to the grid with aligned corners, as
    /// transformers' `get_vision_interpolation_indices_and_weights` (f32 weights).
    fn position_rows(&self, grid: [usize; 3]) -> Vec<f32> {
        let (d, side, m) = (self.cfg.hidden, self.cfg.pos_side, self.cfg.merge);
        let [t, gh, gw] = grid;
        let taps = |i: usize, size: usize| -> [(usize, f32); 2] {
            let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let f = src.floor();
            let lo = f as usize;
            let w_hi = src - f;
            [
                (lo.min(side - 1), 1.0 - w_hi),
                ((lo + 1).min(side - 1), w_hi),
            ]
        };
        let mut out = vec![0f32; t * gh * gw * d];
        for (j, row_out) in out.chunks_exact_mut(d).enumerate() {
            let (r, col) = patch_row_col(j % (gh * gw), gw, m);
            let (th, tw) = (taps(r, gh), taps(col, gw));
            for &(hi, wh) in &th {
                for &(wi, ww) in &tw {
                    let wgt = wh * ww;
                    let src = &self.pos_embed[(hi * side + wi) * d..(hi * side + wi + 1) * d];
                    for (o, &s) in row_out.iter_mut().zip(src) {
                        *o += s * wgt;
                    }
                }
            }
        }
        out
    }
}

impl VisionTower for Qwen35Vision {
    fn info(&self) -> VisionInfo {
        VisionInfo {
            kind: VisionKind::Qwen35,
            tokens: self.tokens,
            frames: false,
            patch: self.cfg.patch,
            temporal_patch: self.cfg.temporal_patch,
            merge: self.cfg.merge,
        }
    }

    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "Qwen3.5 vision tower ({} blocks of {}, patches of {} px)",
            c.depth, c.hidden, c.patch
        )
    }

    fn encode(&self, pixels: &[f32], grid: [usize; 3]) -> Result<Vec<f32>> {
        Qwen35Vision::encode(self, pixels, grid)
    }
}

/// Row and column of patch `j` of a frame `w` patches wide in the processor's order (merge
/// blocks of `m x m` row-major, patches inside a block row-major).
fn patch_row_col(j: usize, w: usize, m: usize) -> (usize, usize) {
    let blocks_w = w / m;
    let (in_col, in_row) = (j % m, (j / m) % m);
    let (block_col, block_row) = ((j / (m * m)) % blocks_w, j / (m * m * blocks_w));
    (block_row * m + in_row, block_col * m + in_col)
}

/// The 2-D rotary tables of every patch of `grid`, `[n, head_dim / 2]` each: slot `i <
/// head_dim / 4` turns with the patch's row, the rest with its column, at the inverse
/// frequencies of a `head_dim / 2`-dim rotary embedding (transformers'
/// `Qwen3_5VisionRotaryEmbedding`).
fn rotary_tables(grid: [usize; 3], m: usize, head_dim: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let inv = inv_freq(head_dim / 2, theta);
    let [t, gh, gw] = grid;
    let n = t * gh * gw;
    let (mut cos, mut sin) = (Vec::with_capacity(n * head_dim / 2), Vec::new());
    sin.reserve(n * head_dim / 2);
    for j in 0..n {
        let (r, col) = patch_row_col(j % (gh * gw), gw, m);
        for p in [r, col] {
            for &f in &inv {
                crate::mrope::push_angle(&mut cos, &mut sin, p as f32, f);
            }
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_order_is_merge_block_major() {
        // a 4-wide frame, merge 2: patches 0..4 are the first block (rows 0-1, cols 0-1)
        let got: Vec<_> = (0..8).map(|j| patch_row_col(j, 4, 2)).collect();
        assert_eq!(
            got,
            [
                (0, 0),
                (0, 1),
                (1, 0),
                (1, 1),
                (0, 2),
                (0, 3),
                (1, 2),
                (1, 3)
            ]
        );
    }

    #[test]
    fn rotary_rows_and_columns() {
        let (c, _) = rotary_tables([1, 2, 2], 2, 8, 10000.0);
        // head_dim 8: 2 slots for the row, 2 for the column; patch 1 is (0, 1)
        assert_eq!(
            c[4..8],
            [1.0, 1.0, 1f64.cos() as f32, (0.01f32 as f64).cos() as f32]
        );
    }
}
