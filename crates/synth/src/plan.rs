//! What a synthetic file holds: its metadata and every tensor's name, shape, type and initial
//! distribution, before any byte is generated.

use std::collections::BTreeMap;

use kapitsa_base::GgmlType;
use kapitsa_formats::{GgufArray, GgufValue};

use crate::preset::{Dims, Family, Preset};
use crate::SynthError;

/// The tensor type mix, named after the llama.cpp file types it reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMix {
    /// `llama-quantize Q4_K_M` on a converted model (see [`q4_k_m_type`]).
    Q4KM,
    /// Every quantisable weight Q8_0 (`convert_hf_to_gguf.py --outtype q8_0`).
    Q8_0,
    /// Every quantisable weight F16 (`--outtype f16`).
    F16,
}

impl QuantMix {
    /// Parse `q4_k_m`, `q8_0` or `f16` (case-insensitive).
    pub fn parse(s: &str) -> Result<QuantMix, SynthError> {
        match s.to_ascii_lowercase().as_str() {
            "q4_k_m" => Ok(QuantMix::Q4KM),
            "q8_0" => Ok(QuantMix::Q8_0),
            "f16" => Ok(QuantMix::F16),
            _ => Err(SynthError::Usage(format!(
                "unknown --quant '{s}' (known: q4_k_m, q8_0, f16)"
            ))),
        }
    }

    /// Canonical name.
    pub fn name(self) -> &'static str {
        match self {
            QuantMix::Q4KM => "q4_k_m",
            QuantMix::Q8_0 => "q8_0",
            QuantMix::F16 => "f16",
        }
    }

    /// `general.file_type` (`enum llama_ftype`).
    pub fn file_type(self) -> u32 {
        match self {
            QuantMix::Q4KM => 15,
            QuantMix::Q8_0 => 7,
            QuantMix::F16 => 1,
        }
    }
}

/// How a tensor's values are drawn. Every distribution is zero-mean unless stated.
#[derive(Debug, Clone, PartialEq)]
pub enum Init {
    /// A weight matrix: i.i.d. values of standard deviation `std` (uniform for float types,
    /// random codes with per-block scales for quantised types).
    Matrix {
        /// Target standard deviation.
        std: f32,
    },
    /// The output projection: like `Matrix`, but rows whose flag in `zero_rows` is set (tokens
    /// that are not plain text: control, unused, padding) are exactly zero.
    Output {
        /// Target standard deviation of the live rows.
        std: f32,
        /// Which vocabulary rows are zero.
        zero_rows: std::sync::Arc<Vec<bool>>,
    },
    /// Every value `v`.
    Const(f32),
    /// Normal with this standard deviation.
    Normal(f32),
    /// A softmax/sigmoid router: normal rows of standard deviation `std`, each row scaled by
    /// `exp(row_log_std * N(0,1))` so some experts win more often than others.
    Router {
        /// Base standard deviation.
        std: f32,
        /// Log-normal spread of the per-expert row scale.
        row_log_std: f32,
    },
    /// `-exp(A_log)` with `A = exp(A_log)` uniform in [1, 16] (Mamba2 / GDN initialisation).
    NegA,
    /// `dt_bias = softplus^-1(dt)` with `dt` log-uniform in [1e-3, 1e-1].
    DtBias,
}

/// One tensor of the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPlan {
    /// GGUF name.
    pub name: String,
    /// PyTorch-order shape (the last dimension is the contiguous one, GGUF `ne[0]`).
    pub shape: Vec<usize>,
    /// Storage type.
    pub dtype: GgmlType,
    /// Value distribution.
    pub init: Init,
}

impl TensorPlan {
    /// Number of elements.
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of data.
    pub fn n_bytes(&self) -> u64 {
        // Cannot fail: the planner only makes tensors with a non-empty shape whose last
        // dimension is a whole number of blocks of their type (`q4_k_m_type` and the mix
        // fall back to a type that fits).
        let (&inner, outer) = self.shape.split_last().expect("non-empty shape");
        let row = self.dtype.row_bytes(inner).expect("whole blocks") as u64;
        outer.iter().fold(row, |a, &d| a * d as u64)
    }
}

/// A complete file description.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Metadata in file order.
    pub metadata: Vec<(String, GgufValue)>,
    /// Tensors in file order.
    pub tensors: Vec<TensorPlan>,
    /// The layer pattern written.
    pub pattern: String,
    /// Dimensions used.
    pub dims: Dims,
}

impl Plan {
    /// Per type: (tensor count, bytes), in ggml type-id order.
    pub fn type_histogram(&self) -> Vec<(GgmlType, usize, u64)> {
        let mut h: BTreeMap<u32, (GgmlType, usize, u64)> = BTreeMap::new();
        for t in &self.tensors {
            let e = h.entry(t.dtype.id()).or_insert((t.dtype, 0, 0));
            e.1 += 1;
            e.2 += t.n_bytes();
        }
        h.into_values().collect()
    }

    /// Total parameters.
    pub fn n_params(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_elements() as u64).sum()
    }
}

/// What the planner needs besides the preset.
pub struct PlanInput<'a> {
    /// The preset.
    pub preset: &'a Preset,
    /// Dimensions (production or width-divided), with the final vocabulary size.
    pub dims: Dims,
    /// Layer pattern (see [`Preset::layer_pattern`]).
    pub pattern: String,
    /// Type mix.
    pub mix: QuantMix,
    /// Tokenizer metadata (`tokenizer.*` keys), already sized to `dims.n_vocab`.
    pub tokenizer: Vec<(String, GgufValue)>,
    /// Output rows to zero (`dims.n_vocab` flags).
    pub zero_rows: std::sync::Arc<Vec<bool>>,
    /// Extra `general.*` / provenance keys.
    pub extra: Vec<(String, GgufValue)>,
}

/// Standard deviation of the logits the output projection gives for a unit-RMS input.
pub const LOGIT_STD: f32 = 2.0;
/// Router logit standard deviation (softmax routers).
pub const ROUTER_STD_SOFTMAX: f32 = 2.0;
/// Router logit standard deviation (sigmoid routers).
pub const ROUTER_STD_SIGMOID: f32 = 1.5;
/// Log-normal spread of softmax router rows (skews expert load like a trained router).
pub const ROUTER_ROW_LOG_STD: f32 = 0.2;
/// Standard deviation of Nemotron's selection bias `exp_probs_b` (skews expert load).
pub const SELECTION_BIAS_STD: f32 = 0.025;
/// Standard deviation of causal-conv taps (kernel 4: unit gain on unit inputs).
pub const CONV_STD: f32 = 0.5;

struct Builder {
    tensors: Vec<TensorPlan>,
}

impl Builder {
    fn add(&mut self, name: impl Into<String>, shape: &[usize], init: Init) {
        self.tensors.push(TensorPlan {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: GgmlType::F32,
            init,
        });
    }

    /// A weight matrix whose inputs are its last dimension: std `1/sqrt(n_in)` keeps unit-RMS
    /// inputs at unit-RMS outputs.
    fn mat(&mut self, name: impl Into<String>, shape: &[usize]) {
        // Cannot fail: every call passes a literal shape of 1-3 dimensions.
        let n_in = *shape.last().expect("shape");
        self.add(
            name,
            shape,
            Init::Matrix {
                std: 1.0 / (n_in as f32).sqrt(),
            },
        );
    }
}

fn u32v(x: usize) -> GgufValue {
    GgufValue::U32(x as u32)
}

/// Build the plan: metadata (general, architecture, tokenizer) and tensors with their types.
pub fn build(inp: PlanInput<'_>) -> Result<Plan, SynthError> {
    let d = &inp.dims;
    let arch = inp.preset.family.arch();
    let tied = inp.preset.tied_embeddings;
    let n_layer = inp.pattern.len();
    let kinds: Vec<char> = inp.pattern.chars().collect();
    let mut md: Vec<(String, GgufValue)> = vec![
        (
            "general.architecture".into(),
            GgufValue::String(arch.into()),
        ),
        ("general.type".into(), GgufValue::String("model".into())),
    ];
    md.extend(inp.extra.iter().cloned());
    let k = |s: &str| format!("{arch}.{s}");
    let mut kv = |key: &str, v: GgufValue| md.push((k(key), v));
    kv("block_count", u32v(n_layer));
    kv("context_length", u32v(d.n_ctx));
    kv("embedding_length", u32v(d.n_embd));

    let mut b = Builder {
        tensors: Vec::new(),
    };
    let h = d.n_embd;
    b.mat("token_embd.weight", &[d.n_vocab, h]);
    // Cannot fail: `mat` just pushed a tensor.
    b.tensors.last_mut().expect("just added").init = if tied {
        // The embedding is also the output head: drawn like one (logit std LOGIT_STD, rows of
        // non-text tokens zero). Its small rows are no trouble as inputs: the first norm
        // rescales them (and maps a zero row to zero).
        output_init(&inp)
    } else {
        // Embedding rows: unit RMS (the first norm rescales them anyway).
        Init::Matrix { std: 1.0 }
    };

    match inp.preset.family {
        Family::Qwen35Moe => {
            kv("attention.head_count", u32v(d.n_head));
            kv("attention.head_count_kv", u32v(d.n_head_kv));
            // Interleaved MRoPE sections over n_rot / 2 frequency slots: [11, 11, 10, 0] for 64.
            let half = d.n_rot / 2;
            let s0 = half.div_ceil(3);
            let s1 = (half - s0).div_ceil(2);
            let sections = [s0, s1, half - s0 - s1, 0].map(|x| x as i32).to_vec();
            kv(
                "rope.dimension_sections",
                GgufValue::Array(GgufArray::I32(sections)),
            );
            kv("rope.freq_base", GgufValue::F32(d.rope_theta));
            kv("attention.layer_norm_rms_epsilon", GgufValue::F32(d.eps));
            kv("expert_count", u32v(d.n_expert));
            kv("expert_used_count", u32v(d.top_k));
            kv("attention.key_length", u32v(d.head_dim));
            kv("attention.value_length", u32v(d.head_dim));
            kv("expert_feed_forward_length", u32v(d.n_ff_exp));
            kv("expert_shared_feed_forward_length", u32v(d.n_ff_shexp));
            kv("ssm.conv_kernel", u32v(d.ssm_conv));
            kv("ssm.state_size", u32v(d.ssm_state));
            kv("ssm.group_count", u32v(d.ssm_groups));
            kv("ssm.time_step_rank", u32v(d.ssm_heads));
            kv("ssm.inner_size", u32v(d.ssm_heads * d.ssm_head_dim));
            kv(
                "attention.recurrent_layers",
                GgufValue::Array(GgufArray::Bool(kinds.iter().map(|&c| c == 'L').collect())),
            );
            kv("full_attention_interval", u32v(4));
            kv("rope.dimension_count", u32v(d.n_rot));
            for (i, &c) in kinds.iter().enumerate() {
                let l = |s: &str| format!("blk.{i}.{s}");
                b.add(l("attn_norm.weight"), &[h], Init::Const(1.0));
                if c == 'L' {
                    let (hk, hv, dk, dv) = (d.ssm_groups, d.ssm_heads, d.ssm_state, d.ssm_head_dim);
                    let conv_dim = 2 * hk * dk + hv * dv;
                    b.add(l("ssm_a"), &[hv], Init::NegA);
                    b.add(
                        l("ssm_conv1d.weight"),
                        &[conv_dim, d.ssm_conv],
                        Init::Normal(CONV_STD),
                    );
                    b.add(l("ssm_dt.bias"), &[hv], Init::DtBias);
                    b.mat(l("ssm_alpha.weight"), &[hv, h]);
                    b.mat(l("ssm_beta.weight"), &[hv, h]);
                    b.mat(l("attn_qkv.weight"), &[conv_dim, h]);
                    b.mat(l("attn_gate.weight"), &[hv * dv, h]);
                    b.add(l("ssm_norm.weight"), &[dv], Init::Const(1.0));
                    b.mat(l("ssm_out.weight"), &[h, hv * dv]);
                } else {
                    let hd = d.head_dim;
                    b.add(l("attn_k_norm.weight"), &[hd], Init::Const(1.0));
                    b.mat(l("attn_k.weight"), &[d.n_head_kv * hd, h]);
                    b.mat(l("attn_output.weight"), &[h, d.n_head * hd]);
                    b.add(l("attn_q_norm.weight"), &[hd], Init::Const(1.0));
                    // Query and output gate interleaved per head.
                    b.mat(l("attn_q.weight"), &[2 * d.n_head * hd, h]);
                    b.mat(l("attn_v.weight"), &[d.n_head_kv * hd, h]);
                }
                qwen_moe(&mut b, d, i, true);
                b.add(l("post_attention_norm.weight"), &[h], Init::Const(1.0));
            }
        }
        Family::Qwen3Moe => {
            kv("feed_forward_length", u32v(d.n_ff_dense));
            kv("attention.head_count", u32v(d.n_head));
            kv("attention.head_count_kv", u32v(d.n_head_kv));
            kv("rope.freq_base", GgufValue::F32(d.rope_theta));
            kv("attention.layer_norm_rms_epsilon", GgufValue::F32(d.eps));
            kv("expert_used_count", u32v(d.top_k));
            kv("attention.key_length", u32v(d.head_dim));
            kv("attention.value_length", u32v(d.head_dim));
            kv("expert_count", u32v(d.n_expert));
            kv("expert_feed_forward_length", u32v(d.n_ff_exp));
            for i in 0..n_layer {
                let l = |s: &str| format!("blk.{i}.{s}");
                let hd = d.head_dim;
                b.add(l("attn_norm.weight"), &[h], Init::Const(1.0));
                b.mat(l("attn_q.weight"), &[d.n_head * hd, h]);
                b.mat(l("attn_k.weight"), &[d.n_head_kv * hd, h]);
                b.mat(l("attn_v.weight"), &[d.n_head_kv * hd, h]);
                b.mat(l("attn_output.weight"), &[h, d.n_head * hd]);
                b.add(l("attn_q_norm.weight"), &[hd], Init::Const(1.0));
                b.add(l("attn_k_norm.weight"), &[hd], Init::Const(1.0));
                b.add(l("ffn_norm.weight"), &[h], Init::Const(1.0));
                qwen_moe(&mut b, d, i, false);
            }
        }
        Family::Qwen2 | Family::Qwen3 => {
            let qwen3 = inp.preset.family == Family::Qwen3;
            // The keys (and order) llama.cpp's converter writes for these architectures.
            kv("feed_forward_length", u32v(d.n_ff_dense));
            kv("attention.head_count", u32v(d.n_head));
            kv("attention.head_count_kv", u32v(d.n_head_kv));
            kv("rope.freq_base", GgufValue::F32(d.rope_theta));
            kv("attention.layer_norm_rms_epsilon", GgufValue::F32(d.eps));
            if qwen3 {
                kv("attention.key_length", u32v(d.head_dim));
                kv("attention.value_length", u32v(d.head_dim));
            }
            for i in 0..n_layer {
                dense_layer(&mut b, d, i, qwen3);
            }
        }
        Family::NemotronHMoe => {
            let per_layer = |f: &dyn Fn(char) -> usize| {
                GgufValue::Array(GgufArray::I32(kinds.iter().map(|&c| f(c) as i32).collect()))
            };
            kv(
                "feed_forward_length",
                per_layer(&|c| if c == 'E' { d.n_ff_exp } else { 0 }),
            );
            kv("attention.head_count", u32v(d.n_head));
            kv(
                "attention.head_count_kv",
                per_layer(&|c| if c == '*' { d.n_head_kv } else { 0 }),
            );
            kv("attention.layer_norm_epsilon", GgufValue::F32(d.eps));
            kv("expert_count", u32v(d.n_expert));
            kv("expert_used_count", u32v(d.top_k));
            kv("expert_group_count", u32v(1));
            kv("expert_group_used_count", u32v(1));
            kv("vocab_size", u32v(d.n_vocab));
            kv("rope.dimension_count", u32v(d.head_dim));
            kv("ssm.conv_kernel", u32v(d.ssm_conv));
            kv("ssm.state_size", u32v(d.ssm_state));
            kv("ssm.group_count", u32v(d.ssm_groups));
            kv("ssm.inner_size", u32v(d.ssm_heads * d.ssm_head_dim));
            kv("ssm.time_step_rank", u32v(d.ssm_heads));
            kv("rope.scaling.finetuned", GgufValue::Bool(false));
            kv("attention.key_length", u32v(d.head_dim));
            kv("attention.value_length", u32v(d.head_dim));
            kv("expert_feed_forward_length", u32v(d.n_ff_exp));
            kv("expert_shared_feed_forward_length", u32v(d.n_ff_shexp));
            kv("expert_shared_count", u32v(1));
            kv("expert_weights_norm", GgufValue::Bool(true));
            kv("expert_weights_scale", GgufValue::F32(d.routed_scale));
            if let Some(lat) = d.latent {
                kv("moe_latent_size", u32v(lat));
            }
            for (i, &c) in kinds.iter().enumerate() {
                let l = |s: &str| format!("blk.{i}.{s}");
                match c {
                    'M' => {
                        let (nh, p, g, n) =
                            (d.ssm_heads, d.ssm_head_dim, d.ssm_groups, d.ssm_state);
                        let d_inner = nh * p;
                        let conv_dim = d_inner + 2 * g * n;
                        b.add(l("ssm_a"), &[nh, 1], Init::NegA);
                        b.add(l("ssm_d"), &[nh, 1], Init::Const(1.0));
                        b.add(l("ssm_conv1d.bias"), &[conv_dim], Init::Const(0.0));
                        b.add(
                            l("ssm_conv1d.weight"),
                            &[conv_dim, d.ssm_conv],
                            Init::Normal(CONV_STD),
                        );
                        b.add(l("ssm_dt.bias"), &[nh], Init::DtBias);
                        b.mat(l("ssm_in.weight"), &[d_inner + conv_dim + nh, h]);
                        b.add(l("ssm_norm.weight"), &[g, d_inner / g], Init::Const(1.0));
                        b.mat(l("ssm_out.weight"), &[h, d_inner]);
                    }
                    '*' => {
                        let hd = d.head_dim;
                        b.mat(l("attn_k.weight"), &[d.n_head_kv * hd, h]);
                        b.mat(l("attn_output.weight"), &[h, d.n_head * hd]);
                        b.mat(l("attn_q.weight"), &[d.n_head * hd, h]);
                        b.mat(l("attn_v.weight"), &[d.n_head_kv * hd, h]);
                    }
                    'E' => {
                        let inner = d.latent.unwrap_or(h);
                        b.mat(l("ffn_down_exps.weight"), &[d.n_expert, inner, d.n_ff_exp]);
                        b.mat(l("ffn_up_exps.weight"), &[d.n_expert, d.n_ff_exp, inner]);
                        if let Some(lat) = d.latent {
                            b.mat(l("ffn_latent_down.weight"), &[lat, h]);
                            b.mat(l("ffn_latent_up.weight"), &[h, lat]);
                        }
                        b.add(
                            l("exp_probs_b.bias"),
                            &[d.n_expert],
                            Init::Normal(SELECTION_BIAS_STD),
                        );
                        b.add(
                            l("ffn_gate_inp.weight"),
                            &[d.n_expert, h],
                            Init::Router {
                                std: ROUTER_STD_SIGMOID / (h as f32).sqrt(),
                                row_log_std: 0.0,
                            },
                        );
                        b.mat(l("ffn_down_shexp.weight"), &[h, d.n_ff_shexp]);
                        b.mat(l("ffn_up_shexp.weight"), &[d.n_ff_shexp, h]);
                    }
                    other => {
                        return Err(SynthError::Usage(format!(
                            "internal: unknown block kind '{other}' in pattern"
                        )))
                    }
                }
                b.add(l("attn_norm.weight"), &[h], Init::Const(1.0));
            }
        }
    }
    md.push((
        "general.file_type".into(),
        u32v(inp.mix.file_type() as usize),
    ));
    md.push(("general.quantization_version".into(), u32v(2)));
    md.extend(inp.tokenizer.iter().cloned());

    b.add("output_norm.weight", &[h], Init::Const(1.0));
    if !tied {
        b.add("output.weight", &[d.n_vocab, h], output_init(&inp));
    }

    let mut tensors = b.tensors;
    assign_types(&mut tensors, inp.mix, n_layer);
    Ok(Plan {
        metadata: md,
        tensors,
        pattern: inp.pattern,
        dims: inp.dims,
    })
}

/// The distribution of the output head (`output.weight`, or the tied `token_embd.weight`).
fn output_init(inp: &PlanInput<'_>) -> Init {
    Init::Output {
        std: LOGIT_STD / (inp.dims.n_embd as f32).sqrt(),
        zero_rows: inp.zero_rows.clone(),
    }
}

/// Standard deviation of the q/k/v biases of Qwen2 (small next to the unit-RMS projections).
pub const QKV_BIAS_STD: f32 = 0.1;

/// Dense layer `i` of Qwen2 (`qwen3 == false`: q/k/v biases) or Qwen3 (q/k norms, no biases):
/// attention and a SwiGLU MLP of width `n_ff_dense`, in the converter's tensor order.
fn dense_layer(b: &mut Builder, d: &Dims, i: usize, qwen3: bool) {
    let l = |s: &str| format!("blk.{i}.{s}");
    let (h, hd, ff) = (d.n_embd, d.head_dim, d.n_ff_dense);
    b.add(l("attn_norm.weight"), &[h], Init::Const(1.0));
    b.mat(l("ffn_down.weight"), &[h, ff]);
    b.mat(l("ffn_gate.weight"), &[ff, h]);
    b.mat(l("ffn_up.weight"), &[ff, h]);
    b.add(l("ffn_norm.weight"), &[h], Init::Const(1.0));
    let (q, kv) = (d.n_head * hd, d.n_head_kv * hd);
    let bias = |b: &mut Builder, name: &str, rows: usize| {
        if !qwen3 {
            b.add(l(name), &[rows], Init::Normal(QKV_BIAS_STD));
        }
    };
    bias(b, "attn_k.bias", kv);
    if qwen3 {
        b.add(l("attn_k_norm.weight"), &[hd], Init::Const(1.0));
    }
    b.mat(l("attn_k.weight"), &[kv, h]);
    b.mat(l("attn_output.weight"), &[h, q]);
    bias(b, "attn_q.bias", q);
    if qwen3 {
        b.add(l("attn_q_norm.weight"), &[hd], Init::Const(1.0));
    }
    b.mat(l("attn_q.weight"), &[q, h]);
    bias(b, "attn_v.bias", kv);
    b.mat(l("attn_v.weight"), &[kv, h]);
}

/// The Qwen MoE block of layer `i`: router, stacked SwiGLU experts and (Qwen3.6) the gated
/// shared expert.
fn qwen_moe(b: &mut Builder, d: &Dims, i: usize, shared: bool) {
    let l = |s: &str| format!("blk.{i}.{s}");
    let h = d.n_embd;
    b.mat(l("ffn_down_exps.weight"), &[d.n_expert, h, d.n_ff_exp]);
    b.mat(l("ffn_gate_exps.weight"), &[d.n_expert, d.n_ff_exp, h]);
    b.mat(l("ffn_up_exps.weight"), &[d.n_expert, d.n_ff_exp, h]);
    b.add(
        l("ffn_gate_inp.weight"),
        &[d.n_expert, h],
        Init::Router {
            std: ROUTER_STD_SOFTMAX / (h as f32).sqrt(),
            row_log_std: ROUTER_ROW_LOG_STD,
        },
    );
    if shared {
        b.mat(l("ffn_down_shexp.weight"), &[h, d.n_ff_shexp]);
        b.mat(l("ffn_gate_shexp.weight"), &[d.n_ff_shexp, h]);
        b.mat(l("ffn_up_shexp.weight"), &[d.n_ff_shexp, h]);
        // Stored 2-D [1, H] by the converter; ggml sees a 1-D tensor (kept F32).
        b.add(
            l("ffn_gate_inp_shexp.weight"),
            &[1, h],
            Init::Normal(1.0 / (h as f32).sqrt()),
        );
    }
}

/// Number of dimensions as ggml counts them (trailing size-1 dims of `ne` do not count).
fn ggml_n_dims(shape: &[usize]) -> usize {
    // PyTorch order: ggml's trailing dims are our leading ones.
    let lead_ones = shape.iter().take_while(|&&x| x == 1).count();
    (shape.len() - lead_ones).max(1)
}

/// Whether llama-quantize would quantise this tensor (`tensor_allows_quantization`, for the
/// names these architectures use); the converter stores every other tensor as F32.
pub fn allows_quantization(name: &str, shape: &[usize]) -> bool {
    ggml_n_dims(shape) >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && !name.contains("ssm_conv1d")
}

/// Layer index of a `blk.N.*` name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// llama.cpp `use_more_bits`.
fn use_more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// llama.cpp `tensor_type_fallback`: K-quants need rows that are a multiple of 256.
fn fallback(ty: GgmlType, ne0: usize) -> GgmlType {
    if ne0.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let f = match ty {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        GgmlType::IQ4_XS | GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::IQ4_NL,
        other => other,
    };
    if ne0.is_multiple_of(f.block_size()) {
        f
    } else {
        GgmlType::F16
    }
}

/// Counters of the Q4_K_M choice that depend on the whole file.
pub struct Q4kmState {
    /// Number of attention-V-like tensors (`attn_v`, `attn_qkv`).
    pub n_attention_wv: usize,
    /// How many of them were seen so far (in llama.cpp's order: layer, then name).
    pub i_attention_wv: usize,
    /// `n_layer_all` (block count).
    pub n_layer: usize,
    /// No `output.weight` in the file: `token_embd.weight` is the output head too, and gets
    /// the output head's type (llama.cpp `has_tied_embeddings`).
    pub tied: bool,
}

/// The type `llama-quantize Q4_K_M` gives a quantisable tensor (`llama_tensor_get_type` for
/// this ftype, without imatrix or overrides, for an arch with `n_expert != 8`):
///
/// - `output.weight`, and `token_embd.weight` when the embeddings are tied (no
///   `output.weight`): Q6_K, or Q8_0 when its rows are not a multiple of 256.
/// - `token_embd.weight` (untied): Q4_K.
/// - attention-V-like (`attn_v`, and `attn_qkv`, which shares the category): Q6_K when
///   `use_more_bits(i_attention_wv, n_attention_wv)`, else Q4_K.
/// - `ffn_down*` (dense MLP, experts, shared expert): Q6_K when `use_more_bits(layer, n_layer)`,
///   else Q4_K (llama.cpp counts dense `ffn_down` tensors in visiting order, which is the
///   layer index since there is one per layer).
/// - everything else: Q4_K.
///
/// then the shape fallback: Q4_K -> Q5_0, Q6_K -> Q8_0 when rows are not a multiple of 256,
/// F16 when not even a multiple of 32.
pub fn q4_k_m_type(name: &str, shape: &[usize], st: &mut Q4kmState) -> GgmlType {
    // Cannot fail: called for planned tensors, whose shapes are never empty.
    let ne0 = *shape.last().expect("shape");
    let ty = if name == "output.weight" || (st.tied && name == "token_embd.weight") {
        if ne0.is_multiple_of(256) {
            GgmlType::Q6_K
        } else {
            GgmlType::Q8_0
        }
    } else if name.contains("attn_qkv.weight") || name.contains("attn_v.weight") {
        let t = if use_more_bits(st.i_attention_wv, st.n_attention_wv) {
            GgmlType::Q6_K
        } else {
            GgmlType::Q4_K
        };
        st.i_attention_wv += 1;
        t
    } else if name.contains("ffn_up") || name.contains("ffn_gate") {
        GgmlType::Q4_K
    } else if name.contains("ffn_down") {
        let i = layer_of(name).unwrap_or(0);
        if use_more_bits(i, st.n_layer) {
            GgmlType::Q6_K
        } else {
            GgmlType::Q4_K
        }
    } else {
        GgmlType::Q4_K
    };
    fallback(ty, ne0)
}

/// Give every tensor its storage type for `mix`.
pub fn assign_types(tensors: &mut [TensorPlan], mix: QuantMix, n_layer: usize) {
    // llama-quantize visits tensors ordered by layer (globals first), then by name.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let la = layer_of(&tensors[a].name).map_or(-1, |x| x as i64);
        let lb = layer_of(&tensors[b].name).map_or(-1, |x| x as i64);
        la.cmp(&lb)
            .then_with(|| tensors[a].name.cmp(&tensors[b].name))
    });
    let mut st = Q4kmState {
        n_attention_wv: tensors
            .iter()
            .filter(|t| t.name.contains("attn_qkv.weight") || t.name.contains("attn_v.weight"))
            .count(),
        i_attention_wv: 0,
        n_layer,
        tied: !tensors.iter().any(|t| t.name == "output.weight"),
    };
    for i in order {
        let t = &mut tensors[i];
        t.dtype = if !allows_quantization(&t.name, &t.shape) {
            GgmlType::F32
        } else {
            // Cannot fail: planned shapes are never empty.
            let ne0 = *t.shape.last().expect("shape");
            match mix {
                QuantMix::Q4KM => q4_k_m_type(&t.name, &t.shape, &mut st),
                QuantMix::Q8_0 => fallback(GgmlType::Q8_0, ne0),
                QuantMix::F16 => GgmlType::F16,
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_cpp_on_40_layers() {
        let picked: Vec<usize> = (0..40).filter(|&i| use_more_bits(i, 40)).collect();
        assert_eq!(picked.len(), 20);
        assert_eq!(&picked[..6], &[0, 1, 2, 3, 4, 7]);
    }

    #[test]
    fn fallbacks() {
        assert_eq!(fallback(GgmlType::Q4_K, 2688), GgmlType::Q5_0);
        assert_eq!(fallback(GgmlType::Q6_K, 1856), GgmlType::Q8_0);
        assert_eq!(fallback(GgmlType::Q4_K, 4096), GgmlType::Q4_K);
        assert_eq!(fallback(GgmlType::Q4_K, 48), GgmlType::F16);
    }

    #[test]
    fn quantisable_set() {
        assert!(allows_quantization("blk.0.ssm_in.weight", &[10304, 2688]));
        assert!(!allows_quantization("blk.0.ssm_conv1d.weight", &[6144, 4]));
        assert!(!allows_quantization(
            "blk.0.ffn_gate_inp.weight",
            &[128, 2688]
        ));
        assert!(!allows_quantization(
            "blk.0.ffn_gate_inp_shexp.weight",
            &[1, 2048]
        ));
        assert!(!allows_quantization("blk.0.ssm_norm.weight", &[8, 512]));
        assert!(!allows_quantization("blk.0.ssm_a", &[64, 1]));
        assert!(!allows_quantization("blk.0.exp_probs_b.bias", &[128]));
        assert!(allows_quantization(
            "blk.0.ffn_up_exps.weight",
            &[128, 1856, 2688]
        ));
    }
}
