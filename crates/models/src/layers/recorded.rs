//! Recorded decode steps: on a backend that records ([`Backend::can_record`]: CUDA graphs), a
//! decode step's device work is recorded once per batch shape and replayed with one launch,
//! the batch arrays rewritten in place ([`Backend::refill_batch`]) for each new step.
//!
//! A recording holds the device addresses of the weights, of one cache's storage and of its
//! own batch and logits tensors, so it is kept per (cache id, token count, logit rows) and
//! dropped when the batch no longer fits it (tables past its capacity, a context past its
//! attention split) or another cache comes along; it is then recorded again, which costs about
//! one op-by-op step. Only what replays exactly is recorded: decode batches (one token per
//! sequence) of at most [`MAX_RECORDED_TOKENS`] tokens on models without MoE blocks (the MoE
//! op reads the routing back to the host) and, until recorded hybrid steps are checked on a
//! GPU, without recurrent layers.

use kapitsa_backend::{Backend, Batch, BatchDesc, DType, Recording, Tensor};

use crate::{BatchInputs, Result};

/// Largest decode batch that is recorded (the GEMV kernels take up to 16 tokens; more go to
/// cuBLAS, whose workspace handling is not recorded here).
pub const MAX_RECORDED_TOKENS: usize = 16;

/// Recordings kept at once (one per batch size in use).
const MAX_RECORDINGS: usize = 8;

/// One recorded step and what it reads and writes.
struct Entry {
    cache_id: u64,
    n_tokens: usize,
    n_logits: usize,
    /// The batch the recording reads (rewritten in place for each replay).
    batch: Batch,
    /// `[n_logits, n_vocab]` f32, written by each replay.
    logits: Tensor,
    rec: Recording,
}

/// The recordings of one model (most recently used last).
#[derive(Default)]
pub struct Recordings {
    entries: Vec<Entry>,
    /// Recording failed once: the model runs every step op by op from then on.
    failed: bool,
}

impl std::fmt::Debug for Recordings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recordings({})", self.entries.len())
    }
}

/// Whether steps of models with recurrent layers (Gated DeltaNet, Mamba2) or MoE blocks are
/// recorded too (`KAPITSA_RECORD_HYBRID=0` turns it off, for A/B runs and as a way back).
/// Their kernels read every per-step value from the batch arrays and the MoE routes on the
/// device (`Backend::moe_reads_back`); checked on an H100 (2026-12-06, scripts/test-gpu.sh):
/// every hybrid and MoE fixture's 32 greedy tokens equal transformers' with recorded steps,
/// and the selftest's results were the same recorded and op by op.
pub fn hybrids_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KAPITSA_RECORD_HYBRID").map_or(true, |v| v != "0"))
}

/// Whether a step of `batch` is recorded on `be` (decode steps of at most
/// [`MAX_RECORDED_TOKENS`] tokens that want logits, on a recording backend).
pub fn recordable(be: &dyn Backend, batch: &BatchInputs) -> bool {
    let n = batch.n_tokens();
    n > 0
        && n <= MAX_RECORDED_TOKENS
        && !batch.logit_rows.is_empty()
        && batch.seqs.iter().all(|c| c.len == 1)
        && be.can_record()
}

impl Recordings {
    /// Run a step through a recording: replay a fitting one, or record a new one with `run`
    /// (the step's device work on the given batch, writing the logits tensor) and replay
    /// it; then give its logits tensor (`[n_logits, n_vocab]`) to `read`.
    ///
    /// `Ok(false)`: nothing ran, the caller runs the step op by op. That is the answer from
    /// the first time recording fails on (a capture the device refuses: nothing is executed
    /// while recording, so running the step again op by op is safe; a real error of the step
    /// then shows there).
    ///
    /// `table_capacity` is the longest block table a sequence of `cache_id`'s cache can have.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        be: &dyn Backend,
        cache_id: u64,
        desc: BatchDesc,
        table_capacity: usize,
        n_vocab: usize,
        run: impl FnOnce(&Batch, &mut Tensor) -> Result<()>,
        read: &mut dyn FnMut(&Tensor) -> Result<()>,
    ) -> Result<bool> {
        if self.failed {
            return Ok(false);
        }
        let (n_tokens, n_logits) = (desc.n_tokens(), desc.logit_rows.len());
        self.entries.retain(|e| e.cache_id == cache_id);
        let hit = self
            .entries
            .iter()
            .position(|e| e.n_tokens == n_tokens && e.n_logits == n_logits);
        if let Some(i) = hit {
            let mut e = self.entries.remove(i);
            if be.refill_batch(&mut e.batch, desc.clone())? {
                be.replay(&e.rec)?;
                let r = read(&e.logits);
                self.entries.push(e);
                r?;
                return Ok(true);
            }
            // the batch outgrew the recording: record again
        }
        let batch = be.prepare_batch_for_recording(desc, table_capacity)?;
        let mut logits = be.alloc_scratch(DType::F32, n_logits * n_vocab)?;
        if be.begin_recording().is_err() {
            self.failed = true;
            return Ok(false);
        }
        let ran = run(&batch, &mut logits);
        // always leave recording mode, also after an error in `run`
        let rec = be.end_recording();
        let rec = match (ran, rec) {
            (Ok(()), Ok(rec)) => rec,
            _ => {
                self.failed = true;
                return Ok(false);
            }
        };
        be.replay(&rec)?;
        read(&logits)?;
        if self.entries.len() >= MAX_RECORDINGS {
            self.entries.remove(0);
        }
        self.entries.push(Entry {
            cache_id,
            n_tokens,
            n_logits,
            batch,
            logits,
            rec,
        });
        Ok(true)
    }

    /// Kernel launches of the most recently used recording (`None`: nothing recorded).
    pub fn last_kernels(&self) -> Option<usize> {
        self.entries.last().map(|e| e.rec.n_kernels())
    }
}
