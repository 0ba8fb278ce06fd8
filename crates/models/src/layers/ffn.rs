//! Feed-forward blocks as loaded: a dense MLP (SwiGLU or squared ReLU) and a routed mixture of
//! experts, checked against the model width and uploaded to the backend, whose
//! [`Backend::mlp`] and [`Backend::moe`] run them (routing, top-k, grouping tokens by expert
//! and the weighted combination are backend work: semantics on
//! [`kapitsa_backend::MoeWeights`]).
//!
//! References: transformers `Qwen3_5MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`,
//! `NemotronHMoE` / `NemotronHTopkRouter`; llama.cpp `build_moe_ffn`.

pub use kapitsa_backend::Act;
use kapitsa_backend::{Backend, MlpWeights, MoeWeights, Tensor};

use crate::layers::{check_experts, check_matrix, check_vec, upload_opt};
use crate::{ModelError, Result, Weight};

/// A dense MLP. `gate` is present for SwiGLU and absent for squared ReLU.
#[derive(Debug)]
pub struct Mlp {
    /// `[n_ff, n_in]` (SwiGLU only).
    pub gate: Option<Weight>,
    /// `[n_ff, n_in]`.
    pub up: Weight,
    /// `[n_out, n_ff]`.
    pub down: Weight,
    /// Activation.
    pub act: Act,
}

impl Mlp {
    /// Check shapes: input width `n_in`, output width `n_out`.
    pub fn validate(&self, n_in: usize, n_out: usize) -> Result<()> {
        let n_ff = self.up.shape.first().copied().unwrap_or(0);
        check_matrix(&self.up, [n_ff, n_in])?;
        check_matrix(&self.down, [n_out, n_ff])?;
        match (&self.gate, self.act) {
            (Some(g), Act::SwiGlu) => check_matrix(g, [n_ff, n_in]),
            (None, Act::Relu2) => Ok(()),
            _ => Err(ModelError::Config(format!(
                "MLP '{}': gate projection does not match activation {:?}",
                self.up.name, self.act
            ))),
        }
    }

    /// Upload the weights to `be`.
    pub fn upload(&self, be: &dyn Backend) -> Result<MlpWeights> {
        Ok(MlpWeights {
            gate: self.gate.as_ref().map(|g| g.upload(be)).transpose()?,
            up: self.up.upload(be)?,
            down: self.down.upload(be)?,
            act: self.act,
        })
    }
}

/// How router logits become expert scores.
#[derive(Debug, Clone, PartialEq)]
pub enum Gating {
    /// `softmax(logits)`; selection and weights both use the probabilities (Qwen).
    Softmax,
    /// `sigmoid(logits)`; experts are selected by `score + bias` but weighted by `score`
    /// (Nemotron-H's `e_score_correction_bias`).
    Sigmoid {
        /// Selection-only bias `[n_expert]`.
        bias: Option<Vec<f32>>,
    },
}

/// Storage of the routed experts' weights.
#[derive(Debug)]
pub enum Experts {
    /// Stacked 3-D tensors (GGUF `ffn_*_exps`, MLX `switch_mlp`): gate and up `[E, I, n_in]`
    /// (gate absent for squared-ReLU experts), down `[E, n_out, I]`.
    Stacked {
        /// `[E, I, n_in]`.
        gate: Option<Weight>,
        /// `[E, I, n_in]`.
        up: Weight,
        /// `[E, n_out, I]`.
        down: Weight,
    },
    /// HF fused layout: `gate_up [E, 2I, n_in]` (rows `0..I` gate, `I..2I` up), down
    /// `[E, n_out, I]`.
    FusedGateUp {
        /// `[E, 2I, n_in]`.
        gate_up: Weight,
        /// `[E, n_out, I]`.
        down: Weight,
    },
    /// One 2-D MLP per expert (HF `experts.{e}.*`).
    PerExpert(Vec<Mlp>),
}

impl Experts {
    fn count(&self) -> usize {
        match self {
            Experts::Stacked { up, .. } => up.shape.first().copied().unwrap_or(0),
            Experts::FusedGateUp { gate_up, .. } => gate_up.shape.first().copied().unwrap_or(0),
            Experts::PerExpert(v) => v.len(),
        }
    }

    fn validate(
        &self,
        n_exp: usize,
        n_ff: usize,
        n_in: usize,
        n_out: usize,
        act: Act,
    ) -> Result<()> {
        match self {
            Experts::Stacked { gate, up, down } => {
                check_experts(up, [n_exp, n_ff, n_in])?;
                check_experts(down, [n_exp, n_out, n_ff])?;
                match (gate, act) {
                    (Some(g), Act::SwiGlu) => check_experts(g, [n_exp, n_ff, n_in]),
                    (None, Act::Relu2) => Ok(()),
                    _ => Err(ModelError::Config(format!(
                        "experts '{}': gate projection does not match activation {act:?}",
                        up.name
                    ))),
                }
            }
            Experts::FusedGateUp { gate_up, down } => {
                if act != Act::SwiGlu {
                    return Err(ModelError::Config(
                        "fused gate_up experts need a SwiGLU activation".into(),
                    ));
                }
                check_experts(gate_up, [n_exp, 2 * n_ff, n_in])?;
                check_experts(down, [n_exp, n_out, n_ff])
            }
            Experts::PerExpert(v) => {
                if v.len() != n_exp {
                    return Err(ModelError::Config(format!(
                        "{} experts loaded, router has {n_exp}",
                        v.len()
                    )));
                }
                for m in v {
                    if m.act != act {
                        return Err(ModelError::Config("experts disagree on activation".into()));
                    }
                    m.validate(n_in, n_out)?;
                    check_matrix(&m.up, [n_ff, n_in])?;
                }
                Ok(())
            }
        }
    }

    fn upload(&self, be: &dyn Backend) -> Result<kapitsa_backend::Experts> {
        Ok(match self {
            Experts::Stacked { gate, up, down } => kapitsa_backend::Experts::Stacked {
                gate: gate.as_ref().map(|g| g.upload(be)).transpose()?,
                up: up.upload(be)?,
                down: down.upload(be)?,
            },
            Experts::FusedGateUp { gate_up, down } => kapitsa_backend::Experts::FusedGateUp {
                gate_up: gate_up.upload(be)?,
                down: down.upload(be)?,
            },
            Experts::PerExpert(v) => kapitsa_backend::Experts::PerExpert(
                v.iter().map(|m| m.upload(be)).collect::<Result<_>>()?,
            ),
        })
    }
}

/// Latent MoE (Nemotron 3 Super): experts run in a smaller space; `down` projects the block
/// input into it before the experts and `up` projects the combined expert output back.
#[derive(Debug)]
pub struct Latent {
    /// `[latent, n_embd]`.
    pub down: Weight,
    /// `[n_embd, latent]`.
    pub up: Weight,
}

/// A routed mixture-of-experts block with an optional (optionally gated) shared expert.
#[derive(Debug)]
pub struct Moe {
    /// Router `[n_expert, n_embd]`.
    pub router: Weight,
    /// Score function and selection bias.
    pub gating: Gating,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the selected weights to sum to 1.
    pub norm_topk: bool,
    /// Multiplier of the routed weights (Nemotron's `routed_scaling_factor`; 1 otherwise).
    pub scale: f32,
    /// Routed experts.
    pub experts: Experts,
    /// Expert intermediate size.
    pub n_ff: usize,
    /// Expert activation.
    pub act: Act,
    /// Always-on expert.
    pub shared: Option<Mlp>,
    /// Sigmoid gate of the shared expert `[n_embd]` (Qwen3.5: `sigmoid(x . w)` per token).
    pub shared_gate: Option<Vec<f32>>,
    /// Latent projections (Nemotron 3 Super).
    pub latent: Option<Latent>,
}

impl Moe {
    fn n_expert(&self) -> usize {
        self.router.shape.first().copied().unwrap_or(0)
    }

    /// Check shapes against the model width `d`.
    pub fn validate(&self, d: usize) -> Result<()> {
        let n_exp = self.n_expert();
        check_matrix(&self.router, [n_exp, d])?;
        if self.top_k == 0 || self.top_k > n_exp {
            return Err(ModelError::Config(format!(
                "top-k {} must be in 1..={n_exp}",
                self.top_k
            )));
        }
        if self.experts.count() != n_exp {
            return Err(ModelError::Config(format!(
                "router has {n_exp} experts, weights have {}",
                self.experts.count()
            )));
        }
        let d_exp = match &self.latent {
            Some(l) => {
                let ld = l.down.shape.first().copied().unwrap_or(0);
                check_matrix(&l.down, [ld, d])?;
                check_matrix(&l.up, [d, ld])?;
                ld
            }
            None => d,
        };
        self.experts
            .validate(n_exp, self.n_ff, d_exp, d_exp, self.act)?;
        if let Gating::Sigmoid { bias: Some(b) } = &self.gating {
            check_vec("expert selection bias", b, n_exp)?;
        }
        if let Some(s) = &self.shared {
            s.validate(d, d)?;
        }
        if let Some(g) = &self.shared_gate {
            check_vec("shared expert gate", g, d)?;
        }
        Ok(())
    }

    /// Upload the weights to `be`.
    pub fn upload(&self, be: &dyn Backend) -> Result<MoeWeights> {
        Ok(MoeWeights {
            router: self.router.upload(be)?,
            gating: match &self.gating {
                Gating::Softmax => kapitsa_backend::Gating::Softmax,
                Gating::Sigmoid { bias } => kapitsa_backend::Gating::Sigmoid {
                    bias: upload_opt(be, bias)?,
                },
            },
            top_k: self.top_k,
            norm_topk: self.norm_topk,
            scale: self.scale,
            experts: self.experts.upload(be)?,
            n_ff: self.n_ff,
            act: self.act,
            shared: self.shared.as_ref().map(|m| m.upload(be)).transpose()?,
            shared_gate: upload_opt(be, &self.shared_gate)?,
            latent: match &self.latent {
                Some(l) => Some(kapitsa_backend::Latent {
                    down: l.down.upload(be)?,
                    up: l.up.upload(be)?,
                }),
                None => None,
            },
        })
    }
}

/// The feed-forward op of a block.
// Blocks are few (two per layer), so variant size differences do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Ffn {
    /// Dense MLP.
    Mlp(Mlp),
    /// Mixture of experts.
    Moe(Moe),
}

impl Ffn {
    /// Check shapes against the model width `d`.
    pub fn validate(&self, d: usize) -> Result<()> {
        match self {
            Ffn::Mlp(m) => m.validate(d, d),
            Ffn::Moe(m) => m.validate(d),
        }
    }

    /// Upload the weights to `be`.
    pub fn upload(&self, be: &dyn Backend) -> Result<DeviceFfn> {
        Ok(match self {
            Ffn::Mlp(m) => DeviceFfn::Mlp(Box::new(m.upload(be)?)),
            Ffn::Moe(m) => DeviceFfn::Moe(Box::new(m.upload(be)?)),
        })
    }
}

/// An [`Ffn`] uploaded to a backend.
#[derive(Debug)]
pub enum DeviceFfn {
    /// Dense MLP.
    Mlp(Box<MlpWeights>),
    /// Mixture of experts.
    Moe(Box<MoeWeights>),
}

impl DeviceFfn {
    /// `out[n, d] = ffn(x[n, d])`.
    pub fn forward(&self, be: &dyn Backend, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
        match self {
            DeviceFfn::Mlp(m) => be.mlp(m, x, n, out)?,
            DeviceFfn::Moe(m) => be.moe(m, x, n, out)?,
        }
        Ok(())
    }

    /// A residual FFN block with its pre-norm: `h = rms_norm(y)` with `norm` = (weights
    /// `[d]`, eps), then `y[n, d] += ffn(h)` ([`Backend::norm_moe_add`] for an MoE: a device
    /// backend computes the norm inside its router).
    pub fn forward_norm_add(
        &self,
        be: &dyn Backend,
        norm: (&Tensor, f32),
        h: &mut Tensor,
        n: usize,
        y: &mut Tensor,
    ) -> Result<()> {
        match self {
            DeviceFfn::Mlp(m) => {
                be.rms_norm_to(y, h, norm.0.len(), norm.0, norm.1)?;
                be.mlp_add(m, h, n, y)?;
            }
            DeviceFfn::Moe(m) => be.norm_moe_add(m, norm, h, n, y)?,
        }
        Ok(())
    }

    /// `y[n, d] += ffn(h[n, d])` (the residual stream).
    pub fn forward_add(
        &self,
        be: &dyn Backend,
        h: &Tensor,
        n: usize,
        y: &mut Tensor,
    ) -> Result<()> {
        match self {
            DeviceFfn::Mlp(m) => be.mlp_add(m, h, n, y)?,
            DeviceFfn::Moe(m) => be.moe_add(m, h, n, y)?,
        }
        Ok(())
    }
}
