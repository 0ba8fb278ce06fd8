//! DFlash and DFlash2 block drafters (z-lab format): a few Qwen3-style layers that read the
//! target's tapped hidden states as extra keys and values, and draft a whole block of tokens
//! in one pass.
//!
//! Reference: the PyPI `dflash` 0.1.0 package (`dflash/model.py`: `DFlashDraftModel`,
//! `DFlash2DraftModel`, `GroupedDynamicCausalConv`, `CandidateSelector`, `dflash_generate`);
//! checked against it by `crates/models/tests/dflash.rs` on the fixtures that
//! `tools/gen_dflash_fixtures.py` makes. Format and semantics: docs/dflash.md.
//!
//! # Math (per sequence)
//! - **Context.** The target taps `T` `[m, n_taps * n_embd]` (outputs of the layers
//!   [`Drafter::tap_layers`], concatenated in that order) of `m` committed tokens become
//!   `ctx = rmsnorm(fc · T, hidden_norm)`; every draft layer keeps
//!   `K = rope(k_norm(Wk · ctx))`, `V = Wv · ctx` at the tokens' positions ([`DraftState`]).
//! - **Block.** `[anchor, mask × n]` at positions `p .. p + n` (the anchor is the last
//!   committed token, not yet in the context), embedded with the target's embedding table
//!   (times `input_embedding_scale`). Each layer: `h = rmsnorm(x)`, queries and block keys
//!   from `h`, attention over the context keys and the block keys under the layer's mask,
//!   `x += Wo · att`, then `x += mlp(rmsnorm(x))`. DFlash2 wraps both sublayers in a grouped
//!   dynamic causal conv (coefficients projected from the sublayer input; side 0 on the
//!   input, side 1 on the output; zero before the block start). Block K/V are transient.
//! - **Logits.** `lm_head(rmsnorm(x, norm)) · output_multiplier`, then `tanh(x / cap) · cap`
//!   when `final_logit_softcapping > 0`, for block rows `1 ..` (row 0, the anchor, is
//!   dropped). DFlash drafts the argmax of each row; DFlash2 takes the top-K of each row and
//!   walks them with the candidate selector: `score(b) = U[b] + Σ_r pred[prev]_r ·
//!   (P · h)_r · succ[C[b]]_r`, `prev` = the anchor, then each chosen candidate.
//! - **Masks.** Key positions `k`, query position `q`: a causal layer needs `k ≤ q`; a
//!   sliding layer of window `W` needs `q − k < W` and, if not causal, `k − q < W`.
//!   Causality: `is_causal` if the config has it, else `dflash_config.causal`, else sliding
//!   layers are causal and full layers not (the z-lab legacy rule).
//!
//! # Where it runs
//! Every product, norm, RoPE, conv and the attention are [`Backend`] ops on the target's
//! backend (the drafter's weights are uploaded there). The logits rows come back to the host
//! for the argmax / top-K, and the selector walk runs on the host (K candidates per row; the
//! codebook rows are read from the weight file as needed).

use std::path::Path;
use std::sync::Arc;

use kapitsa_backend::{Act, AttnShape, Backend, DType, Epilogue, MlpWeights, RopeDesc, Tensor};
use serde_json::Value;

use crate::layers::{check_positions, positions_batch, tensor};
use crate::{CausalLm, ModelError, ModelSource, Result, Weight};

/// Which drafter a checkpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrafterKind {
    /// DFlash (v1): the argmax of each block row.
    DFlash,
    /// DFlash2: grouped dynamic convs around both sublayers and the candidate selector.
    DFlash2,
}

/// The attention mask of one drafter layer (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerMask {
    /// Keys after the query are hidden.
    pub causal: bool,
    /// Sliding window `W` (`None`: full attention).
    pub window: Option<usize>,
}

/// DFlash2's extra hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dflash2Params {
    /// Conv taps (`conv_kernel_size`, 2 in published drafts).
    pub conv_kernel: usize,
    /// Channels per dynamic coefficient (`conv_group_size`).
    pub conv_group: usize,
    /// Selector rank (`selector_rank`).
    pub selector_rank: usize,
    /// Candidates per position (`selector_top_k`).
    pub selector_top_k: usize,
}

/// A drafter's hyper-parameters, from its `config.json` (`dflash_config.*` first, then the
/// top level; llama.cpp names).
#[derive(Debug, Clone, PartialEq)]
pub struct DflashConfig {
    /// DFlash or DFlash2.
    pub kind: DrafterKind,
    /// `hidden_size` (must equal the target's).
    pub n_embd: usize,
    /// `num_hidden_layers`.
    pub n_layer: usize,
    /// `num_attention_heads`.
    pub n_head: usize,
    /// `num_key_value_heads`.
    pub n_head_kv: usize,
    /// `head_dim`.
    pub head_dim: usize,
    /// `intermediate_size`.
    pub n_ff: usize,
    /// `vocab_size` (must equal the target's).
    pub n_vocab: usize,
    /// `rms_norm_eps`.
    pub rms_eps: f32,
    /// `rope_theta` / `rope_parameters.rope_theta`.
    pub rope_theta: f32,
    /// q/k/v/o biases (`attention_bias`).
    pub attention_bias: bool,
    /// `target_layer_ids`: the target layers whose outputs form the context.
    pub target_layers: Vec<usize>,
    /// `mask_token_id`.
    pub mask_token: u32,
    /// `block_size` (anchor + drafts).
    pub block_size: usize,
    /// Per-layer masks.
    pub masks: Vec<LayerMask>,
    /// `input_embedding_scale` (1 if absent).
    pub input_scale: f32,
    /// `output_multiplier` (1 if absent).
    pub output_multiplier: f32,
    /// `final_logit_softcapping` (`None` if absent or not positive).
    pub softcap: Option<f32>,
    /// DFlash2 only.
    pub dflash2: Option<Dflash2Params>,
}

/// `dflash_config.<key>`, else the top-level `<key>`.
fn draft_value<'a>(cfg: &'a Value, key: &str) -> Option<&'a Value> {
    cfg.get("dflash_config")
        .and_then(|d| d.get(key))
        .or_else(|| cfg.get(key))
        .filter(|v| !v.is_null())
}

fn bad(msg: String) -> ModelError {
    ModelError::Config(format!("drafter config.json: {msg}"))
}

fn req_usize(cfg: &Value, key: &str) -> Result<usize> {
    opt_usize(cfg, key)?.ok_or_else(|| bad(format!("missing '{key}'")))
}

fn opt_usize(cfg: &Value, key: &str) -> Result<Option<usize>> {
    match draft_value(cfg, key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|x| Some(x as usize))
            .ok_or_else(|| bad(format!("'{key}' is not a non-negative integer"))),
    }
}

fn opt_f32(cfg: &Value, key: &str) -> Result<Option<f32>> {
    match draft_value(cfg, key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| bad(format!("'{key}' is not a number"))),
    }
}

impl DflashConfig {
    /// Read and check a drafter's `config.json`.
    pub fn from_json(cfg: &Value) -> Result<DflashConfig> {
        if cfg.get("speculators_model_type").is_some() {
            return Err(bad(
                "speculators-format drafters are not supported (convert to the z-lab format)"
                    .into(),
            ));
        }
        let archs: Vec<&str> = cfg
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| a.iter().filter_map(|s| s.as_str()).collect())
            .unwrap_or_default();
        let kind = if archs.contains(&"DFlash2DraftModel")
            || opt_usize(cfg, "selector_top_k")?.is_some_and(|k| k > 0)
        {
            DrafterKind::DFlash2
        } else if archs.contains(&"DFlashDraftModel")
            || draft_value(cfg, "target_layer_ids").is_some()
        {
            DrafterKind::DFlash
        } else {
            return Err(bad(format!(
                "not a DFlash drafter (architectures {archs:?}, no dflash_config)"
            )));
        };
        for key in ["rope_scaling", "rope_parameters"] {
            let scaling = cfg
                .get(key)
                .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
                .and_then(|t| t.as_str());
            if let Some(t) = scaling.filter(|t| *t != "default") {
                return Err(bad(format!("RoPE scaling '{t}' is not supported")));
            }
        }
        let n_embd = req_usize(cfg, "hidden_size")?;
        let n_layer = req_usize(cfg, "num_hidden_layers")?;
        let n_head = req_usize(cfg, "num_attention_heads")?;
        let n_head_kv = opt_usize(cfg, "num_key_value_heads")?.unwrap_or(n_head);
        let head_dim = match opt_usize(cfg, "head_dim")? {
            Some(h) => h,
            None => n_embd.checked_div(n_head).unwrap_or(0),
        };
        if n_embd == 0 || n_layer == 0 || n_head == 0 || head_dim == 0 || n_head_kv == 0 {
            return Err(bad("zero-sized dimension".into()));
        }
        if !n_head.is_multiple_of(n_head_kv) {
            return Err(bad(format!(
                "{n_head} attention heads is not a multiple of {n_head_kv} KV heads"
            )));
        }
        let target_layers: Vec<usize> = match draft_value(cfg, "target_layer_ids") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|x| x as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("'target_layer_ids' must be non-negative integers".into()))?,
            Some(_) => return Err(bad("'target_layer_ids' is not a list".into())),
            None => return Err(bad("missing 'target_layer_ids'".into())),
        };
        if target_layers.is_empty() {
            return Err(bad("'target_layer_ids' is empty".into()));
        }
        let mask_token = req_usize(cfg, "mask_token_id")?;
        let block_size = opt_usize(cfg, "block_size")?.unwrap_or(16);
        if block_size < 2 {
            return Err(bad(format!("block_size {block_size} drafts nothing")));
        }
        let n_vocab = req_usize(cfg, "vocab_size")?;
        if mask_token >= n_vocab {
            return Err(bad(format!(
                "mask_token_id {mask_token} outside the vocabulary ({n_vocab})"
            )));
        }
        let masks = layer_masks(cfg, n_layer)?;
        let rope_theta = match opt_f32(cfg, "rope_theta")? {
            Some(t) => t,
            None => cfg
                .get("rope_parameters")
                .and_then(|r| r.get("rope_theta"))
                .and_then(|v| v.as_f64())
                .map(|t| t as f32)
                .unwrap_or(10000.0),
        };
        if rope_theta.is_nan() || rope_theta <= 0.0 {
            return Err(bad("rope_theta must be positive".into()));
        }
        let rms_eps = opt_f32(cfg, "rms_norm_eps")?.unwrap_or(1e-6);
        if rms_eps.is_nan() || rms_eps <= 0.0 {
            return Err(bad("rms_norm_eps must be positive".into()));
        }
        let dflash2 = match kind {
            DrafterKind::DFlash => None,
            DrafterKind::DFlash2 => {
                let p = Dflash2Params {
                    conv_kernel: req_usize(cfg, "conv_kernel_size")?,
                    conv_group: req_usize(cfg, "conv_group_size")?,
                    selector_rank: req_usize(cfg, "selector_rank")?,
                    selector_top_k: req_usize(cfg, "selector_top_k")?,
                };
                if p.conv_kernel == 0 || p.conv_group == 0 || !n_embd.is_multiple_of(p.conv_group) {
                    return Err(bad(format!(
                        "conv kernel {} / group {} do not fit hidden_size {n_embd}",
                        p.conv_kernel, p.conv_group
                    )));
                }
                if p.selector_rank == 0 || p.selector_top_k == 0 || p.selector_top_k > n_vocab {
                    return Err(bad(format!(
                        "selector rank {} / top-k {} (vocab {n_vocab})",
                        p.selector_rank, p.selector_top_k
                    )));
                }
                Some(p)
            }
        };
        let softcap = opt_f32(cfg, "final_logit_softcapping")?.filter(|c| *c > 0.0);
        Ok(DflashConfig {
            kind,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: req_usize(cfg, "intermediate_size")?,
            n_vocab,
            rms_eps,
            rope_theta,
            attention_bias: cfg
                .get("attention_bias")
                .and_then(|b| b.as_bool())
                .unwrap_or(false),
            target_layers,
            mask_token: mask_token as u32,
            block_size,
            masks,
            input_scale: opt_f32(cfg, "input_embedding_scale")?.unwrap_or(1.0),
            output_multiplier: opt_f32(cfg, "output_multiplier")?.unwrap_or(1.0),
            softcap,
            dflash2,
        })
    }

    /// Width of one row of taps: `target_layers.len() * n_embd`.
    pub fn tap_width(&self) -> usize {
        self.target_layers.len() * self.n_embd
    }
}

/// Per-layer masks from `layer_types`, the raw `sliding_window` and the causality keys
/// (module docs). The raw JSON window is used whatever `use_sliding_window` says.
fn layer_masks(cfg: &Value, n_layer: usize) -> Result<Vec<LayerMask>> {
    let types: Vec<String> = match cfg.get("layer_types") {
        None | Some(Value::Null) => vec!["full_attention".into(); n_layer],
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| t.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("'layer_types' must be strings".into()))?,
        Some(_) => return Err(bad("'layer_types' is not a list".into())),
    };
    if types.len() != n_layer {
        return Err(bad(format!(
            "{} layer_types for {n_layer} layers",
            types.len()
        )));
    }
    let window = cfg.get("sliding_window").and_then(|w| w.as_u64());
    let is_causal = cfg.get("is_causal").and_then(|c| c.as_bool());
    let dflash_causal = cfg
        .get("dflash_config")
        .and_then(|d| d.get("causal"))
        .and_then(|c| c.as_bool());
    types
        .iter()
        .map(|t| {
            let sliding = match t.as_str() {
                "full_attention" => false,
                "sliding_attention" => true,
                other => return Err(bad(format!("layer type '{other}' is not supported"))),
            };
            let window = match (sliding, window) {
                (false, _) => None,
                (true, Some(w)) if w > 0 => Some(w as usize),
                (true, _) => {
                    return Err(bad(
                        "a sliding_attention layer needs a positive 'sliding_window'".into(),
                    ))
                }
            };
            Ok(LayerMask {
                causal: is_causal.or(dflash_causal).unwrap_or(sliding),
                window,
            })
        })
        .collect()
}

/// One DFlash2 conv: the static kernel per side (`[taps, n_embd]` each) and the projection
/// to the per-row coefficients `[2 * taps * groups, n_embd]`.
struct Conv {
    base: [Tensor; 2],
    proj: kapitsa_backend::Weight,
}

/// One drafter layer on the backend.
struct DraftLayer {
    attn_norm: Tensor,
    ffn_norm: Tensor,
    wq: kapitsa_backend::Weight,
    wk: kapitsa_backend::Weight,
    wv: kapitsa_backend::Weight,
    wo: kapitsa_backend::Weight,
    /// q, k, v, o biases (`attention_bias`).
    biases: Option<[Tensor; 4]>,
    q_norm: Tensor,
    k_norm: Tensor,
    mlp: MlpWeights,
    mask: LayerMask,
    /// DFlash2: around attention, around the MLP.
    convs: Option<[Conv; 2]>,
}

/// DFlash2's candidate selector: the projection on the backend, the codebooks `[n_vocab,
/// rank]` read row by row from the weight file.
struct Selector {
    proj: kapitsa_backend::Weight,
    predecessor: Weight,
    successor: Weight,
}

/// A loaded DFlash / DFlash2 drafter, its weights on the target's backend.
pub struct Drafter {
    cfg: DflashConfig,
    backend: Arc<dyn Backend>,
    fc: kapitsa_backend::Weight,
    hidden_norm: Tensor,
    norm: Tensor,
    layers: Vec<DraftLayer>,
    selector: Option<Selector>,
    /// The drafter's own embedding table, when the checkpoint has one.
    embed: Option<kapitsa_backend::Weight>,
    /// The drafter's own LM head, when the checkpoint has one.
    head: Option<kapitsa_backend::Weight>,
    /// A trained mask embedding `[n_embd]` replacing `embed[mask_token_id]`.
    mask_embedding: Option<Tensor>,
}

/// One sequence's drafter context: per layer the K and V rows of its committed tokens
/// (`[capacity, n_head_kv * head_dim]` f32 on the backend) and their positions (strictly
/// increasing). Made by [`Drafter::new_state`].
pub struct DraftState {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    positions: Vec<u32>,
    /// Rows the tensors hold.
    capacity: usize,
}

impl DraftState {
    /// Context rows held.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether no context is held.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// The position after the last context row (0 when empty): the smallest position the
    /// next [`Drafter::append_context`] may start at.
    pub fn next_pos(&self) -> u32 {
        self.positions.last().map_or(0, |p| p + 1)
    }

    /// Drop the context rows at positions `>= n_pos` (rollback after a rejected draft or a
    /// truncated sequence).
    pub fn truncate(&mut self, n_pos: u32) {
        let keep = self.positions.partition_point(|&p| p < n_pos);
        self.positions.truncate(keep);
    }

    /// Drop all context (the tensors are kept for reuse).
    pub fn clear(&mut self) {
        self.positions.clear();
    }
}

/// The selector's view of one drafted position (DFlash2).
#[derive(Debug, Clone, PartialEq)]
pub struct Candidates {
    /// The top-K token ids of the row's logits, best first.
    pub ids: Vec<u32>,
    /// Their logits (the selector's unary scores).
    pub unary: Vec<f32>,
    /// The selector scores given the chosen predecessor.
    pub scores: Vec<f32>,
    /// `softmax(scores / T)` when sampled ([`Drafter::draft_sampled`]); empty when greedy.
    /// The draft distribution `q` of this position is sparse: `q[ids[b]] = probs[b]`.
    pub probs: Vec<f32>,
    /// Index (into `ids`) of the chosen candidate.
    pub chosen: usize,
}

/// How [`Drafter::draft_sampled`] samples.
pub struct Sampling<'a> {
    /// Temperature `T > 0`.
    pub temperature: f32,
    /// Uniform draws in `[0, 1)`, one per drafted position.
    pub uniform: &'a mut dyn FnMut() -> f32,
}

/// A drafted block.
#[derive(Debug, Clone)]
pub struct Draft {
    /// Draft tokens for positions `anchor_pos + 1 ..` (DFlash: the argmax of each row;
    /// DFlash2: the selector's path).
    pub tokens: Vec<u32>,
    /// The draft logits `[tokens.len(), n_vocab]` (after `output_multiplier` and the
    /// softcap): for DFlash at `T > 0`, `q = softmax(logits / T)` (with the request's top-k /
    /// top-p) is the draft distribution to sample and verify with.
    pub logits: Vec<f32>,
    /// Row width of `logits`.
    pub n_vocab: usize,
    /// DFlash2: the selector's candidates per position; empty for DFlash.
    pub candidates: Vec<Candidates>,
}

impl Draft {
    /// Logits row `i`.
    pub fn logits_row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.n_vocab..(i + 1) * self.n_vocab]
    }
}

/// Look a drafter tensor up under its z-lab name or with a `model.` prefix.
fn find(src: &ModelSource, name: &str) -> Result<Weight> {
    match src.weight_opt(name)? {
        Some(w) => Ok(w),
        None => src
            .weight_opt(&format!("model.{name}"))?
            .ok_or_else(|| ModelError::MissingTensor(name.to_string())),
    }
}

fn find_opt(src: &ModelSource, name: &str) -> Result<Option<Weight>> {
    if src.has(name) || src.has(&format!("model.{name}")) {
        find(src, name).map(Some)
    } else {
        Ok(None)
    }
}

/// A matrix checked to be `[rows, cols]` and uploaded.
fn matrix(
    be: &dyn Backend,
    src: &ModelSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<kapitsa_backend::Weight> {
    find(src, name)?.expect_shape(&[rows, cols])?.upload(be)
}

/// A vector of `len` values (any stored shape holding that many) uploaded as f32.
fn vector(be: &dyn Backend, src: &ModelSource, name: &str, len: usize) -> Result<Tensor> {
    let w = find(src, name)?;
    if w.n_elements() != len {
        return Err(ModelError::BadShape {
            name: w.name.clone(),
            got: w.shape.clone(),
            want: vec![len],
        });
    }
    Ok(be.upload_f32(&w.to_f32()?)?)
}

impl Drafter {
    /// Load the drafter in `dir` (`config.json` + safetensors) for `target`, onto the
    /// target's backend. Checks the drafter against the target: hidden size, vocabulary,
    /// tapped layers, and that the target can lend its embedding and LM head (unless the
    /// checkpoint has its own).
    pub fn load(dir: &Path, target: &dyn CausalLm) -> Result<Drafter> {
        if dir.join("mask_embedding.pt").exists() {
            return Err(ModelError::Config(format!(
                "{}: mask_embedding.pt (a torch pickle) is not read; store it as a \
                 'mask_embedding' tensor in the safetensors file",
                dir.display()
            )));
        }
        let src = ModelSource::open(dir)?;
        let cfg_json = src
            .hf()
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "{}: a drafter is a directory with config.json and safetensors (GGUF \
                     drafters are not supported)",
                    dir.display()
                ))
            })?
            .config()
            .clone();
        let cfg = DflashConfig::from_json(&cfg_json)?;
        let spec = target.spec();
        if cfg.n_embd != spec.n_embd {
            return Err(ModelError::Config(format!(
                "drafter hidden_size {} differs from the target's {}",
                cfg.n_embd, spec.n_embd
            )));
        }
        if cfg.n_vocab != spec.n_vocab {
            return Err(ModelError::Config(format!(
                "drafter vocab_size {} differs from the target's {}",
                cfg.n_vocab, spec.n_vocab
            )));
        }
        if let Some(&l) = cfg.target_layers.iter().find(|&&l| l >= spec.layers.len()) {
            return Err(ModelError::Config(format!(
                "drafter taps layer {l} of a {}-layer target",
                spec.layers.len()
            )));
        }
        let be = target.backend().clone();
        let d = cfg.n_embd;
        let fc = matrix(&*be, &src, "fc.weight", d, cfg.tap_width())?;
        let hidden_norm = vector(&*be, &src, "hidden_norm.weight", d)?;
        let norm = vector(&*be, &src, "norm.weight", d)?;
        let layers = (0..cfg.n_layer)
            .map(|i| load_layer(&*be, &src, &cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let selector = match cfg.dflash2 {
            None => None,
            Some(p) => Some(load_selector(&*be, &src, &cfg, p)?),
        };
        let embed = find_opt(&src, "embed_tokens.weight")?
            .map(|w| w.expect_shape(&[cfg.n_vocab, d])?.upload_embedding(&*be))
            .transpose()?;
        let head = find_opt(&src, "lm_head.weight")?
            .map(|w| w.expect_shape(&[cfg.n_vocab, d])?.upload(&*be))
            .transpose()?;
        let mask_embedding = match find_opt(&src, "mask_embedding")? {
            Some(_) => Some(vector(&*be, &src, "mask_embedding", d)?),
            None => None,
        };
        let drafter = Drafter {
            cfg,
            backend: be,
            fc,
            hidden_norm,
            norm,
            layers,
            selector,
            embed,
            head,
            mask_embedding,
        };
        // Fail at load, not at the first draft, when the target cannot lend its embedding or
        // head.
        let mut probe = tensor(&*drafter.backend, d)?;
        drafter.embed_block(target, &[drafter.cfg.mask_token], 0, &mut probe)?;
        let mut out = tensor(&*drafter.backend, drafter.cfg.n_vocab)?;
        drafter.head_rows(target, &probe, 1, &mut out)?;
        Ok(drafter)
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &DflashConfig {
        &self.cfg
    }

    /// DFlash or DFlash2.
    pub fn kind(&self) -> DrafterKind {
        self.cfg.kind
    }

    /// The target layers to tap ([`crate::BatchInputs::tap_layers`]) for
    /// [`Drafter::append_context`], in this order.
    pub fn tap_layers(&self) -> &[usize] {
        &self.cfg.target_layers
    }

    /// Width of one row of taps (`tap_layers().len() * n_embd`).
    pub fn tap_width(&self) -> usize {
        self.cfg.tap_width()
    }

    /// The block size the drafter was trained with (anchor + drafts).
    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }

    /// The most tokens one draft gives (`block_size - 1`).
    pub fn max_draft(&self) -> usize {
        self.cfg.block_size - 1
    }

    /// An empty context for one sequence.
    pub fn new_state(&self) -> DraftState {
        DraftState {
            k: Vec::new(),
            v: Vec::new(),
            positions: Vec::new(),
            capacity: 0,
        }
    }

    fn kv_dim(&self) -> usize {
        self.cfg.n_head_kv * self.cfg.head_dim
    }

    fn rope(&self) -> RopeDesc {
        RopeDesc {
            n_rot: self.cfg.head_dim,
            theta: self.cfg.rope_theta,
        }
    }

    /// Make room for `rows` K/V rows in every layer, keeping the rows held.
    fn reserve(&self, state: &mut DraftState, rows: usize) -> Result<()> {
        if rows <= state.capacity && state.k.len() == self.layers.len() {
            return Ok(());
        }
        let be = &*self.backend;
        let kv = self.kv_dim();
        let cap = rows.max(2 * state.capacity).max(64);
        let held = state.len() * kv;
        let grow = |old: Option<&Tensor>| -> Result<Tensor> {
            let mut t = be.alloc(DType::F32, cap * kv)?;
            if let Some(o) = old.filter(|_| held > 0) {
                be.copy(o, 0, &mut t, 0, held)?;
            }
            Ok(t)
        };
        let k = (0..self.layers.len())
            .map(|l| grow(state.k.get(l)))
            .collect::<Result<Vec<_>>>()?;
        let v = (0..self.layers.len())
            .map(|l| grow(state.v.get(l)))
            .collect::<Result<Vec<_>>>()?;
        state.k = k;
        state.v = v;
        state.capacity = cap;
        Ok(())
    }

    /// Add committed tokens to the context: `taps` `[m, tap_width()]` are the target's
    /// tapped hidden states ([`crate::Logits::taps`] rows) of `m` tokens at positions
    /// `start_pos .. start_pos + m`; `start_pos` must be at least [`DraftState::next_pos`]
    /// (a gap, e.g. a prefix restored without taps, is allowed).
    pub fn append_context(
        &self,
        state: &mut DraftState,
        taps: &[f32],
        start_pos: u32,
    ) -> Result<()> {
        let w = self.tap_width();
        if taps.is_empty() {
            return Ok(());
        }
        if !taps.len().is_multiple_of(w) {
            return Err(ModelError::Batch(format!(
                "{} tap values are not rows of {w}",
                taps.len()
            )));
        }
        if start_pos < state.next_pos() {
            return Err(ModelError::Batch(format!(
                "context at position {start_pos} but the drafter holds up to {}",
                state.next_pos()
            )));
        }
        let m = taps.len() / w;
        check_positions(start_pos, m)?;
        let (be, d, kv) = (&*self.backend, self.cfg.n_embd, self.kv_dim());
        let hd = self.cfg.head_dim;
        self.reserve(state, state.len() + m)?;
        let t = be.upload_f32(taps)?;
        let mut ctx = tensor(be, m * d)?;
        be.matmul(&self.fc, &t, m, &mut ctx)?;
        be.rms_norm(&mut ctx, d, &self.hidden_norm, self.cfg.rms_eps)?;
        let batch = positions_batch(be, vec![0; m], start_pos)?;
        let at = state.len() * kv;
        for (l, layer) in self.layers.iter().enumerate() {
            let mut k = tensor(be, m * kv)?;
            let mut v = tensor(be, m * kv)?;
            let (bk, bv) = match &layer.biases {
                Some([_, bk, bv, _]) => (Some(bk), Some(bv)),
                None => (None, None),
            };
            be.matmul_many_with(
                &[&layer.wk, &layer.wv],
                &ctx,
                m,
                &mut [&mut k, &mut v],
                &[epilogue(bk), epilogue(bv)],
            )?;
            be.rms_norm(&mut k, hd, &layer.k_norm, self.cfg.rms_eps)?;
            be.rope(&mut k, self.cfg.n_head_kv, hd, self.rope(), &batch)?;
            be.copy(&k, 0, &mut state.k[l], at, m * kv)?;
            be.copy(&v, 0, &mut state.v[l], at, m * kv)?;
        }
        state.positions.extend((0..m as u32).map(|i| start_pos + i));
        Ok(())
    }

    /// Draft `n` tokens (`1 ..= max_draft()`) after `anchor`, the last committed token, at
    /// position `anchor_pos` (at least [`DraftState::next_pos`]: the anchor's own taps are
    /// not in the context yet): greedy (DFlash: the argmax of each row; DFlash2: the
    /// selector's greedy walk). Runs a block of `n + 1` rows, as the reference does; the
    /// drafter was trained on blocks of `block_size()`, so `n = max_draft()` drafts best.
    /// `state` is borrowed mutably for the block's transient K/V; its context is unchanged.
    pub fn draft(
        &self,
        target: &dyn CausalLm,
        state: &mut DraftState,
        anchor: u32,
        anchor_pos: u32,
        n: usize,
    ) -> Result<Draft> {
        self.draft_with(target, state, anchor, anchor_pos, n, None)
    }

    /// [`Drafter::draft`] sampled at `sampling.temperature > 0`: DFlash2 samples each
    /// position from `softmax(scores / T)` over its candidates (the sparse `q` is in
    /// [`Draft::candidates`]); DFlash samples each row from `softmax(logits / T)` (full
    /// vocabulary, no top-k / top-p).
    pub fn draft_sampled(
        &self,
        target: &dyn CausalLm,
        state: &mut DraftState,
        anchor: u32,
        anchor_pos: u32,
        n: usize,
        sampling: Sampling<'_>,
    ) -> Result<Draft> {
        let t = sampling.temperature;
        if t.is_nan() || t <= 0.0 {
            return Err(ModelError::Batch(format!(
                "sampling temperature {t} (use draft() for greedy)"
            )));
        }
        self.draft_with(target, state, anchor, anchor_pos, n, Some(sampling))
    }

    fn draft_with(
        &self,
        target: &dyn CausalLm,
        state: &mut DraftState,
        anchor: u32,
        anchor_pos: u32,
        n: usize,
        sampling: Option<Sampling<'_>>,
    ) -> Result<Draft> {
        if n == 0 || n > self.max_draft() {
            return Err(ModelError::Batch(format!(
                "draft of {n} tokens (1 ..= {})",
                self.max_draft()
            )));
        }
        if anchor as usize >= self.cfg.n_vocab {
            return Err(ModelError::Batch(format!(
                "anchor token {anchor} outside the vocabulary ({})",
                self.cfg.n_vocab
            )));
        }
        if anchor_pos < state.next_pos() {
            return Err(ModelError::Batch(format!(
                "anchor at position {anchor_pos} but the context reaches {}",
                state.next_pos()
            )));
        }
        check_positions(anchor_pos, n + 1)?;
        let hidden = self.block_hidden(target, state, anchor, anchor_pos, n + 1)?;
        let be = &*self.backend;
        let v = self.cfg.n_vocab;
        let mut out = tensor(be, n * v)?;
        self.head_rows(target, &hidden, n, &mut out)?;
        let mut logits = vec![0f32; n * v];
        be.read_f32(&out, 0, &mut logits)?;
        if self.cfg.output_multiplier != 1.0 {
            logits
                .iter_mut()
                .for_each(|x| *x *= self.cfg.output_multiplier);
        }
        if let Some(cap) = self.cfg.softcap {
            logits.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
        }
        let (tokens, candidates) = match (&self.selector, self.cfg.dflash2) {
            (Some(sel), Some(p)) => {
                let mut proj = tensor(be, n * p.selector_rank)?;
                be.matmul(&sel.proj, &hidden, n, &mut proj)?;
                let mut h = vec![0f32; n * p.selector_rank];
                be.read_f32(&proj, 0, &mut h)?;
                let c = select(sel, p, &logits, v, &h, anchor, sampling)?;
                (c.iter().map(|c| c.ids[c.chosen]).collect(), c)
            }
            _ => {
                let rows = logits.chunks_exact(v);
                let tokens = match sampling {
                    None => rows.map(argmax).collect(),
                    Some(s) => rows
                        .map(|r| {
                            let p = softmax(r, s.temperature);
                            sample(&p, (s.uniform)())
                        })
                        .collect(),
                };
                (tokens, Vec::new())
            }
        };
        Ok(Draft {
            tokens,
            logits,
            n_vocab: v,
            candidates,
        })
    }

    /// `out[i] = embedding of tokens[i]` (the drafter's own table or the target's, the mask
    /// rows replaced by a trained mask embedding, times `input_embedding_scale`); `pos0` is
    /// the position of the first token (only for the batch description).
    fn embed_block(
        &self,
        target: &dyn CausalLm,
        tokens: &[u32],
        pos0: u32,
        out: &mut Tensor,
    ) -> Result<()> {
        let be = &*self.backend;
        let d = self.cfg.n_embd;
        match &self.embed {
            Some(e) => be.embed(e, &positions_batch(be, tokens.to_vec(), pos0)?, out)?,
            None => target.embed_tokens(tokens, out)?,
        }
        if let Some(m) = &self.mask_embedding {
            for (i, _) in tokens
                .iter()
                .enumerate()
                .filter(|(_, &t)| t == self.cfg.mask_token)
            {
                be.copy(m, 0, out, i * d, d)?;
            }
        }
        if self.cfg.input_scale != 1.0 {
            let mut x = vec![0f32; tokens.len() * d];
            be.read_f32(out, 0, &mut x)?;
            x.iter_mut().for_each(|v| *v *= self.cfg.input_scale);
            be.write_f32(out, 0, &x)?;
        }
        Ok(())
    }

    /// The LM head (the drafter's own or the target's) on `n` rows.
    fn head_rows(
        &self,
        target: &dyn CausalLm,
        x: &Tensor,
        n: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        match &self.head {
            Some(h) => Ok(self.backend.matmul(h, x, n, out)?),
            None => target.output_head(x, n, out),
        }
    }

    /// The block forward: final-normed hidden rows `1 .. len` (`[len - 1, n_embd]`) of the
    /// block `[anchor, mask × (len - 1)]` at positions `anchor_pos ..`.
    fn block_hidden(
        &self,
        target: &dyn CausalLm,
        state: &mut DraftState,
        anchor: u32,
        anchor_pos: u32,
        len: usize,
    ) -> Result<Tensor> {
        let be = &*self.backend;
        let cfg = &self.cfg;
        let (d, hd, kv) = (cfg.n_embd, cfg.head_dim, self.kv_dim());
        let q_dim = cfg.n_head * hd;
        let mut tokens = vec![cfg.mask_token; len];
        tokens[0] = anchor;
        let mut x = tensor(be, len * d)?;
        self.embed_block(target, &tokens, anchor_pos, &mut x)?;
        let batch = positions_batch(be, tokens, anchor_pos)?;
        let n_ctx = state.len();
        self.reserve(state, n_ctx + len)?;
        let shape = AttnShape {
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let mut h = tensor(be, len * d)?;
        for (l, layer) in self.layers.iter().enumerate() {
            // attention sublayer
            be.rms_norm_to(&x, &mut h, d, &layer.attn_norm, cfg.rms_eps)?;
            let conv = layer.convs.as_ref().map(|c| &c[0]);
            let dyn_out = match conv {
                Some(c) => Some(self.conv_prepare(c, &mut h, len)?),
                None => None,
            };
            let mut q = tensor(be, len * q_dim)?;
            let mut k = tensor(be, len * kv)?;
            let mut v = tensor(be, len * kv)?;
            let b = layer.biases.as_ref();
            be.matmul_many_with(
                &[&layer.wq, &layer.wk, &layer.wv],
                &h,
                len,
                &mut [&mut q, &mut k, &mut v],
                &[
                    epilogue(b.map(|b| &b[0])),
                    epilogue(b.map(|b| &b[1])),
                    epilogue(b.map(|b| &b[2])),
                ],
            )?;
            be.rms_norm(&mut q, hd, &layer.q_norm, cfg.rms_eps)?;
            be.rms_norm(&mut k, hd, &layer.k_norm, cfg.rms_eps)?;
            be.rope(&mut q, cfg.n_head, hd, self.rope(), &batch)?;
            be.rope(&mut k, cfg.n_head_kv, hd, self.rope(), &batch)?;
            // the block's K/V after the context rows, transient (beyond state.len())
            be.copy(&k, 0, &mut state.k[l], n_ctx * kv, len * kv)?;
            be.copy(&v, 0, &mut state.v[l], n_ctx * kv, len * kv)?;
            let spans = spans(&state.positions, anchor_pos, len, layer.mask);
            let mut att = tensor(be, len * q_dim)?;
            be.attention_spans(shape, &q, &state.k[l], &state.v[l], &spans, &mut att)?;
            let mut o = tensor(be, len * d)?;
            be.matmul_with(&layer.wo, &att, len, &mut o, epilogue(b.map(|b| &b[3])))?;
            if let (Some(c), Some(dy)) = (conv, &dyn_out) {
                o = self.conv_apply(&c.base[1], dy, &o, len)?;
            }
            be.add(&mut x, &o)?;
            // MLP sublayer
            be.rms_norm_to(&x, &mut h, d, &layer.ffn_norm, cfg.rms_eps)?;
            let conv = layer.convs.as_ref().map(|c| &c[1]);
            let dyn_out = match conv {
                Some(c) => Some(self.conv_prepare(c, &mut h, len)?),
                None => None,
            };
            let mut m = tensor(be, len * d)?;
            be.mlp(&layer.mlp, &h, len, &mut m)?;
            if let (Some(c), Some(dy)) = (conv, &dyn_out) {
                m = self.conv_apply(&c.base[1], dy, &m, len)?;
            }
            be.add(&mut x, &m)?;
        }
        be.rms_norm(&mut x, d, &self.norm, cfg.rms_eps)?;
        let mut rows = tensor(be, (len - 1) * d)?;
        be.copy(&x, d, &mut rows, 0, (len - 1) * d)?;
        Ok(rows)
    }

    /// DFlash2 conv, input side: project the coefficients from `h` (both sides), convolve
    /// `h` in place with side 0, return side 1's coefficients `[len, taps * groups]`.
    fn conv_prepare(&self, c: &Conv, h: &mut Tensor, len: usize) -> Result<Tensor> {
        let be = &*self.backend;
        let d = self.cfg.n_embd;
        let p = self
            .cfg
            .dflash2
            .ok_or_else(|| ModelError::Config("conv weights without DFlash2 parameters".into()))?;
        let per_side = p.conv_kernel * (d / p.conv_group);
        let mut both = tensor(be, len * 2 * per_side)?;
        be.matmul(&c.proj, h, len, &mut both)?;
        let mut side0 = tensor(be, len * per_side)?;
        let mut side1 = tensor(be, len * per_side)?;
        be.split_cols(
            &both,
            len,
            &[per_side, per_side],
            &mut [&mut side0, &mut side1],
        )?;
        *h = self.conv_apply(&c.base[0], &side0, h, len)?;
        Ok(side1)
    }

    /// One side of a DFlash2 conv over the block rows of `x`.
    fn conv_apply(
        &self,
        base: &Tensor,
        dynamic: &Tensor,
        x: &Tensor,
        len: usize,
    ) -> Result<Tensor> {
        let be = &*self.backend;
        let group = self.cfg.dflash2.map_or(1, |p| p.conv_group);
        let mut out = tensor(be, x.len())?;
        be.dynamic_conv(x, self.cfg.n_embd, base, dynamic, group, len, &mut out)?;
        Ok(out)
    }
}

/// No bias, or `b`; never accumulating.
fn epilogue(b: Option<&Tensor>) -> Epilogue<'_> {
    Epilogue {
        bias: b,
        accumulate: false,
    }
}

/// The key span of each block row (module docs, "Masks"): keys are the context rows
/// (`positions`) followed by the `len` block rows at `anchor_pos ..`.
fn spans(positions: &[u32], anchor_pos: u32, len: usize, mask: LayerMask) -> Vec<(u32, u32)> {
    let n_ctx = positions.len();
    (0..len)
        .map(|i| {
            let q = anchor_pos as u64 + i as u64;
            let lo = match mask.window {
                None => 0,
                Some(w) => {
                    // first key with q - k < w, i.e. k > q - w
                    let ctx_lo = positions.partition_point(|&p| (p as u64) + (w as u64) <= q);
                    if ctx_lo < n_ctx {
                        ctx_lo
                    } else {
                        n_ctx + (i + 1).saturating_sub(w)
                    }
                }
            };
            let hi = if mask.causal {
                n_ctx + i + 1
            } else {
                n_ctx + mask.window.map_or(len, |w| len.min(i + w))
            };
            (lo as u32, hi as u32)
        })
        .collect()
}

fn load_layer(
    be: &dyn Backend,
    src: &ModelSource,
    cfg: &DflashConfig,
    i: usize,
) -> Result<DraftLayer> {
    let (d, hd) = (cfg.n_embd, cfg.head_dim);
    let (q_dim, kv_dim) = (cfg.n_head * hd, cfg.n_head_kv * hd);
    let n = |s: &str| format!("layers.{i}.{s}");
    let biases = if cfg.attention_bias {
        Some([
            vector(be, src, &n("self_attn.q_proj.bias"), q_dim)?,
            vector(be, src, &n("self_attn.k_proj.bias"), kv_dim)?,
            vector(be, src, &n("self_attn.v_proj.bias"), kv_dim)?,
            vector(be, src, &n("self_attn.o_proj.bias"), d)?,
        ])
    } else {
        None
    };
    let convs = match cfg.dflash2 {
        None => None,
        Some(p) => Some([
            load_conv(be, src, cfg, p, &n("attention_conv"))?,
            load_conv(be, src, cfg, p, &n("mlp_conv"))?,
        ]),
    };
    Ok(DraftLayer {
        attn_norm: vector(be, src, &n("input_layernorm.weight"), d)?,
        ffn_norm: vector(be, src, &n("post_attention_layernorm.weight"), d)?,
        wq: matrix(be, src, &n("self_attn.q_proj.weight"), q_dim, d)?,
        wk: matrix(be, src, &n("self_attn.k_proj.weight"), kv_dim, d)?,
        wv: matrix(be, src, &n("self_attn.v_proj.weight"), kv_dim, d)?,
        wo: matrix(be, src, &n("self_attn.o_proj.weight"), d, q_dim)?,
        biases,
        q_norm: vector(be, src, &n("self_attn.q_norm.weight"), hd)?,
        k_norm: vector(be, src, &n("self_attn.k_norm.weight"), hd)?,
        mlp: MlpWeights {
            gate: Some(matrix(be, src, &n("mlp.gate_proj.weight"), cfg.n_ff, d)?),
            up: matrix(be, src, &n("mlp.up_proj.weight"), cfg.n_ff, d)?,
            down: matrix(be, src, &n("mlp.down_proj.weight"), d, cfg.n_ff)?,
            act: Act::SwiGlu,
        },
        mask: cfg.masks[i],
        convs,
    })
}

fn load_conv(
    be: &dyn Backend,
    src: &ModelSource,
    cfg: &DflashConfig,
    p: Dflash2Params,
    prefix: &str,
) -> Result<Conv> {
    let d = cfg.n_embd;
    let taps = p.conv_kernel;
    let base = find(src, &format!("{prefix}.base_kernel"))?
        .expect_shape(&[2, taps, d])?
        .to_f32()?;
    if let Some(bad) = base.iter().find(|x| !x.is_finite()) {
        return Err(ModelError::Config(format!(
            "{prefix}.base_kernel holds {bad} (an uninitialised kernel?)"
        )));
    }
    let (side0, side1) = base.split_at(taps * d);
    Ok(Conv {
        base: [be.upload_f32(side0)?, be.upload_f32(side1)?],
        proj: matrix(
            be,
            src,
            &format!("{prefix}.kernel_projection.weight"),
            2 * taps * (d / p.conv_group),
            d,
        )?,
    })
}

fn load_selector(
    be: &dyn Backend,
    src: &ModelSource,
    cfg: &DflashConfig,
    p: Dflash2Params,
) -> Result<Selector> {
    let codebook = |name: &str| -> Result<Weight> {
        // published checkpoints: `candidate_selector.<name>`; HF save_pretrained: `.weight`
        let base = format!("candidate_selector.{name}");
        let w = match find_opt(src, &base)? {
            Some(w) => w,
            None => find(src, &format!("{base}.weight"))?,
        };
        let w = w.expect_shape(&[cfg.n_vocab, p.selector_rank])?;
        if w.dtype.row_bytes(p.selector_rank).is_none() {
            return Err(ModelError::UnsupportedType(w.name.clone(), w.dtype));
        }
        Ok(w)
    };
    Ok(Selector {
        proj: matrix(
            be,
            src,
            "candidate_selector.hidden_projection.weight",
            p.selector_rank,
            cfg.n_embd,
        )?,
        predecessor: codebook("predecessor_codebook")?,
        successor: codebook("successor_codebook")?,
    })
}

/// Row `token` of a codebook `[n_vocab, rank]` as f32.
fn codebook_row(w: &Weight, token: u32, rank: usize) -> Result<Vec<f32>> {
    let rb = w
        .dtype
        .row_bytes(rank)
        .ok_or_else(|| ModelError::UnsupportedType(w.name.clone(), w.dtype))?;
    let at = token as usize * rb;
    let bytes = w
        .bytes()?
        .get(at..at + rb)
        .ok_or_else(|| ModelError::Batch(format!("token {token} outside '{}'", w.name)))?;
    let mut row = vec![0f32; rank];
    kapitsa_base::quant::dequantize_row(w.dtype, bytes, &mut row)
        .map_err(|_| ModelError::UnsupportedType(w.name.clone(), w.dtype))?;
    Ok(row)
}

/// The top `k` entries of `row`, best first (lower index first on ties).
fn top_k(row: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let by_value = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, by_value);
        idx.truncate(k);
    }
    idx.sort_by(by_value);
    idx
}

/// The DFlash2 selector walk over `n` rows of `logits` with the projected hidden rows `h`
/// `[n, rank]` (module docs); greedy, or sampled at `(t, uniform)`.
fn select(
    sel: &Selector,
    p: Dflash2Params,
    logits: &[f32],
    n_vocab: usize,
    h: &[f32],
    anchor: u32,
    mut sampling: Option<Sampling<'_>>,
) -> Result<Vec<Candidates>> {
    let rank = p.selector_rank;
    let mut prev = anchor;
    let mut out = Vec::new();
    for (row, hr) in logits.chunks_exact(n_vocab).zip(h.chunks_exact(rank)) {
        let ids = top_k(row, p.selector_top_k);
        let unary: Vec<f32> = ids.iter().map(|&i| row[i as usize]).collect();
        let pred = codebook_row(&sel.predecessor, prev, rank)?;
        let a: Vec<f32> = pred.iter().zip(hr).map(|(x, y)| x * y).collect();
        let scores = ids
            .iter()
            .zip(&unary)
            .map(|(&c, &u)| {
                let succ = codebook_row(&sel.successor, c, rank)?;
                Ok(u + a.iter().zip(&succ).map(|(x, y)| x * y).sum::<f32>())
            })
            .collect::<Result<Vec<f32>>>()?;
        let (chosen, probs) = match sampling.as_mut() {
            None => (argmax(&scores) as usize, Vec::new()),
            Some(s) => {
                let probs = softmax(&scores, s.temperature);
                (sample(&probs, (s.uniform)()) as usize, probs)
            }
        };
        prev = ids[chosen];
        out.push(Candidates {
            ids,
            unary,
            scores,
            probs,
            chosen,
        });
    }
    Ok(out)
}

/// Index of the largest value (first on ties).
pub(crate) fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// `softmax(x / t)`.
pub(crate) fn softmax(x: &[f32], t: f32) -> Vec<f32> {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut p: Vec<f32> = x.iter().map(|&v| ((v - max) / t).exp()).collect();
    let sum: f32 = p.iter().sum();
    p.iter_mut().for_each(|v| *v /= sum);
    p
}

/// The index whose cumulative probability first exceeds `u` (the last one if rounding
/// leaves `u` above the total).
pub(crate) fn sample(p: &[f32], u: f32) -> u32 {
    let mut acc = 0f32;
    for (i, &v) in p.iter().enumerate() {
        acc += v;
        if u < acc {
            return i as u32;
        }
    }
    p.len().saturating_sub(1) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(causal: bool, window: Option<usize>) -> LayerMask {
        LayerMask { causal, window }
    }

    #[test]
    fn spans_follow_the_mask_rules() {
        let ctx: Vec<u32> = (0..10).collect();
        // full, non-causal: everything
        assert_eq!(spans(&ctx, 10, 3, mask(false, None)), vec![(0, 13); 3]);
        // causal: context plus the block up to the query
        assert_eq!(
            spans(&ctx, 10, 3, mask(true, None)),
            vec![(0, 11), (0, 12), (0, 13)]
        );
        // window 4, causal: q - k < 4
        assert_eq!(
            spans(&ctx, 10, 3, mask(true, Some(4))),
            vec![(7, 11), (8, 12), (9, 13)]
        );
        // window 2, non-causal: also k - q < 2; row 2's window starts inside the block
        assert_eq!(
            spans(&ctx, 10, 3, mask(false, Some(2))),
            vec![(9, 12), (10, 13), (11, 13)]
        );
        // a gap between context and anchor
        assert_eq!(
            spans(&[0, 1], 8, 2, mask(true, Some(4))),
            vec![(2, 3), (2, 4)]
        );
    }

    #[test]
    fn legacy_causality_and_window() {
        let cfg = serde_json::json!({
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8, "use_sliding_window": false
        });
        let m = layer_masks(&cfg, 2).unwrap();
        assert_eq!(m, vec![mask(true, Some(8)), mask(false, None)]);
        let cfg = serde_json::json!({
            "layer_types": ["sliding_attention"], "sliding_window": 8, "is_causal": false,
            "dflash_config": {"causal": true}
        });
        assert_eq!(layer_masks(&cfg, 1).unwrap(), vec![mask(false, Some(8))]);
        let cfg = serde_json::json!({"dflash_config": {"causal": true}});
        assert_eq!(layer_masks(&cfg, 1).unwrap(), vec![mask(true, None)]);
        let cfg = serde_json::json!({"layer_types": ["sliding_attention"]});
        assert!(layer_masks(&cfg, 1).is_err());
    }

    #[test]
    fn top_k_is_sorted_and_stable() {
        assert_eq!(top_k(&[1.0, 3.0, 3.0, -1.0, 2.0], 3), vec![1, 2, 4]);
        assert_eq!(top_k(&[0.5, 0.1], 5), vec![0, 1]);
        assert_eq!(sample(&[0.25, 0.5, 0.25], 0.3), 1);
        assert_eq!(sample(&[0.25, 0.5, 0.25], 0.99999), 2);
    }
}
