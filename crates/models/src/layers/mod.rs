//! Building blocks shared by the architectures: the generic pre-norm residual [`decoder`] and the
//! ops its blocks run ([`attention`], [`ffn`] (MLP and MoE), [`gdn`] (Gated DeltaNet), [`mamba2`]).
//!
//! Each block exists twice: as loaded from the file (host weights, checked against the
//! hyper-parameters: `Attention`, `GatedDeltaNet`, `Mamba2`, `Ffn`) and as uploaded to the
//! backend (`Device*`), whose `forward` runs the block as backend ops on device tensors. The
//! model code computes nothing itself: every arithmetic step is a [`Backend`] op.

pub mod attention;
pub mod decoder;
pub mod ffn;
pub mod gdn;
pub mod mamba2;
pub mod recorded;

use kapitsa_backend::{Backend, Batch, BatchDesc, DType, SeqDesc, Tensor};

use crate::{BatchInputs, KvCache, ModelError, Result, Weight};

/// What a block's forward pass borrows: the backend, the batch (host form and the backend's
/// copy) and the cache.
pub struct ForwardCtx<'a> {
    /// Ops.
    pub be: &'a dyn Backend,
    /// The batch being run, as the engine built it.
    pub batch: &'a BatchInputs,
    /// The batch as the backend holds it (positions, block tables, slots).
    pub dev_batch: &'a Batch,
    /// The caller's cache.
    pub cache: &'a mut KvCache,
    /// The rotary tables (cos, sin; `[n_tokens, n_rot / 2]`) of the batch's multimodal
    /// positions ([`BatchInputs::mrope`]); `None`: rotary embedding at the positions.
    pub rope_tables: Option<&'a (Tensor, Tensor)>,
}

/// An f32 activation tensor of `n` values on `be`'s device, for an op's output (contents
/// unspecified until the op writes them all: [`Backend::alloc_scratch`]).
pub fn tensor(be: &dyn Backend, n: usize) -> Result<Tensor> {
    Ok(be.alloc_scratch(DType::F32, n)?)
}

/// Check a matmul weight's shape is `want` (its type is checked when it is uploaded).
pub fn check_matrix(w: &Weight, want: [usize; 2]) -> Result<()> {
    check_weight(w, &want)
}

/// Check a stacked-experts weight `[n_expert, rows, cols]`.
pub fn check_experts(w: &Weight, want: [usize; 3]) -> Result<()> {
    check_weight(w, &want)
}

fn check_weight(w: &Weight, want: &[usize]) -> Result<()> {
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

/// Upload an optional f32 vector.
pub fn upload_opt(be: &dyn Backend, v: &Option<Vec<f32>>) -> Result<Option<Tensor>> {
    Ok(match v {
        Some(v) => Some(be.upload_f32(v)?),
        None => None,
    })
}

/// A batch of `tokens` at consecutive positions from `pos0` (for the embedding gather and
/// RoPE).
pub fn positions_batch(be: &dyn Backend, tokens: Vec<u32>, pos0: u32) -> Result<Batch> {
    let n = tokens.len();
    let desc = BatchDesc {
        positions: (0..n as u32).map(|i| pos0 + i).collect(),
        tokens,
        seqs: vec![SeqDesc {
            slot: 0,
            start: 0,
            len: n,
            pos0: pos0 as usize,
            table_start: 0,
            table_len: 0,
        }],
        block_tables: Vec::new(),
        block_size: 0,
        logit_rows: Vec::new(),
    };
    Ok(be.prepare_batch(desc)?)
}

/// `Err` unless positions `pos .. pos + n` fit in a `u32`.
pub fn check_positions(pos: u32, n: usize) -> Result<()> {
    match u32::try_from(n).ok().and_then(|n| pos.checked_add(n)) {
        Some(_) => Ok(()),
        None => Err(ModelError::Batch(format!(
            "{n} positions from {pos} overflow"
        ))),
    }
}
