//! Building blocks shared by the architectures: the generic pre-norm residual [`decoder`] and the
//! ops its blocks run ([`attention`], [`ffn`] (MLP and MoE), [`gdn`] (Gated DeltaNet), [`mamba2`]).

pub mod attention;
pub mod decoder;
pub mod ffn;
pub mod gdn;
pub mod mamba2;

use kapitsa_backend::Backend;

use crate::{BatchInputs, KvCache, ModelError, Result, Weight};

/// What a block's forward pass borrows: the backend, the batch and the cache.
pub struct Step<'a> {
    /// Ops.
    pub be: &'a dyn Backend,
    /// The batch being run.
    pub batch: &'a BatchInputs,
    /// The caller's cache.
    pub cache: &'a mut KvCache,
}

/// `1 / (1 + exp(-x))`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Check a matmul weight: a dot kernel exists for its type and its shape is `want`.
pub fn check_matrix(w: &Weight, want: [usize; 2]) -> Result<()> {
    check_weight(w, &want)
}

/// Check a stacked-experts weight `[n_expert, rows, cols]`.
pub fn check_experts(w: &Weight, want: [usize; 3]) -> Result<()> {
    check_weight(w, &want)
}

fn check_weight(w: &Weight, want: &[usize]) -> Result<()> {
    w.check_matmul_type()?;
    if w.shape != want {
        return Err(ModelError::BadShape {
            name: w.name.clone(),
            got: w.shape.clone(),
            want: want.to_vec(),
        });
    }
    Ok(())
}

/// Check the length of a vector weight (norms, biases).
pub fn check_vec(name: &str, v: &[f32], n: usize) -> Result<()> {
    if v.len() != n {
        return Err(ModelError::BadShape {
            name: name.to_string(),
            got: vec![v.len()],
            want: vec![n],
        });
    }
    Ok(())
}
