//! A step's batch on the device: the per-step arrays every kernel reads its positions, slots,
//! sequence ranges, block tables and logit rows from, built by `prepare_batch` and rewritten
//! in place by `refill_batch` for a replayed recording (CUDA graph). The CUDA twin of the CPU
//! backend's batch handling in src/buffers.rs.
//!
//! # Layout (device memory, one `u32` array)
//! `[tokens | positions | token->sequence | sequence records (6 u32 each: slot, start, len,
//! pos0, table_start, table_len) | block tables | logit rows | attention query tiles
//! ((sequence, first row) pairs) | the split attention's tokens]` (kernels/common.cuh
//! `SEQ_*`; empty parts hold one padding entry). Kernels read every per-step value from it,
//! never from launch arguments, except the counts that set the grid.
//!
//! A batch prepared for recording gives every sequence a table of `table_capacity` entries
//! (sequence `i`'s at `i * table_capacity`, zero-padded) and fixes the number of context
//! chunks of the split attention (a power of two covering the longest context), so a later
//! step with the same numbers of tokens, sequences and logit rows has the same layout and
//! grid, and only the array contents change.

use std::ops::Deref;

use cudarc::driver::{CudaSlice, CudaView};
use kapitsa_backend::{shape_err, BackendError, Batch, BatchDesc, Result};

use crate::attention::{ATTN_SPLIT, TILE_MIN, TILE_Q};
use crate::device::dev_err;
use crate::recurrent::{gdn_chunked, mamba2_chunked};
use crate::CudaBackend;

/// Where the parts of a batch array start, and the facts about the step the host needs
/// (grid sizes, bound checks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BatchMeta {
    pub(crate) n_tokens: usize,
    pub(crate) n_seqs: usize,
    pub(crate) off_pos: usize,
    pub(crate) off_tok_seq: usize,
    pub(crate) off_seqs: usize,
    pub(crate) off_tables: usize,
    pub(crate) n_tables: usize,
    pub(crate) off_logits: usize,
    pub(crate) n_logits: usize,
    pub(crate) off_tiles: usize,
    /// Query tiles of the tiled attention kernel: `(sequence, first row)` pairs.
    pub(crate) n_tiles: usize,
    pub(crate) off_short: usize,
    /// Tokens of the sequences shorter than `attention::TILE_MIN` (the split kernel's), listed
    /// at `off_short`.
    pub(crate) n_short: usize,
    /// Largest `position + 1` of those tokens (the split kernel's longest context).
    pub(crate) max_ctx_short: usize,
    /// Largest block id any sequence's table uses for its positions (`None`: no table).
    pub(crate) max_block: Option<u32>,
    /// Largest slot of the batch.
    pub(crate) max_slot: usize,
    /// Tokens of the longest sequence.
    pub(crate) max_len: usize,
    /// Largest token id.
    pub(crate) max_token: u32,
    /// Positions per KV block.
    pub(crate) block_size: usize,
    /// Table entries per sequence of a batch prepared for recording (`None`: tables packed).
    pub(crate) table_cap: Option<usize>,
    /// Context chunks of the split attention fixed for a recording (`None`: enough for
    /// `max_ctx_short`, chosen per step).
    pub(crate) fixed_splits: Option<usize>,
    /// Length of the array.
    pub(crate) len: usize,
}

impl BatchMeta {
    /// Context chunks the split attention runs with.
    pub(crate) fn attn_splits(&self) -> usize {
        self.fixed_splits
            .unwrap_or_else(|| self.max_ctx_short.div_ceil(ATTN_SPLIT).max(1))
    }
}

/// A step's batch arrays in device memory (see the module docs for the layout).
pub(crate) struct DevBatch {
    /// Id of the backend that uploaded it.
    pub(crate) owner: u64,
    /// The concatenated `u32` arrays (token ids first: `buf[..n_tokens]`).
    pub(crate) buf: CudaSlice<u32>,
    meta: BatchMeta,
}

impl Deref for DevBatch {
    type Target = BatchMeta;
    fn deref(&self) -> &BatchMeta {
        &self.meta
    }
}

impl DevBatch {
    /// Positions `[n_tokens]`.
    pub(crate) fn positions(&self) -> CudaView<'_, u32> {
        self.buf.slice(self.off_pos..self.off_pos + self.n_tokens)
    }
    /// Sequence index of each token `[n_tokens]`.
    pub(crate) fn tok_seq(&self) -> CudaView<'_, u32> {
        self.buf
            .slice(self.off_tok_seq..self.off_tok_seq + self.n_tokens)
    }
    /// Sequence records `[n_seqs, 6]`.
    pub(crate) fn seqs(&self) -> CudaView<'_, u32> {
        self.buf
            .slice(self.off_seqs..self.off_seqs + 6 * self.n_seqs)
    }
    /// Block tables, concatenated (at least one element, so the view is never empty).
    pub(crate) fn tables(&self) -> CudaView<'_, u32> {
        self.buf
            .slice(self.off_tables..self.off_tables + self.n_tables.max(1))
    }
    /// Logit rows `[n_logits]`.
    pub(crate) fn logit_rows(&self) -> CudaView<'_, u32> {
        self.buf
            .slice(self.off_logits..self.off_logits + self.n_logits)
    }
    /// Tokens of the split attention kernel `[n_short]` (at least one element).
    pub(crate) fn short_tokens(&self) -> CudaView<'_, u32> {
        self.buf
            .slice(self.off_short..self.off_short + self.n_short.max(1))
    }
    /// Tiles of the tiled attention `[n_tiles, 2]` (at least one element).
    pub(crate) fn tiles(&self) -> CudaView<'_, u32> {
        self.buf
            .slice(self.off_tiles..self.off_tiles + (2 * self.n_tiles).max(1))
    }
}

/// `v` as a `u32` batch entry, or a shape error.
fn u32_of(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| BackendError::Shape {
        op: "prepare_batch",
        msg: format!("{what} = {v} does not fit in 32 bits"),
    })
}

/// Check `desc` and lay it out: the host copy of the array and its meta. With `table_cap`,
/// every sequence's table gets that many entries (an error when one is longer).
fn layout(desc: &BatchDesc, table_cap: Option<usize>) -> Result<(Vec<u32>, BatchMeta)> {
    const OP: &str = "prepare_batch";
    let n = desc.n_tokens();
    if desc.positions.len() != n {
        return shape_err(
            OP,
            format!("{} positions for {n} tokens", desc.positions.len()),
        );
    }
    let mut tok_seq = vec![0u32; n];
    let mut seq_rec = Vec::with_capacity(6 * desc.seqs.len());
    let mut tables: Vec<u32> = Vec::new();
    let mut next = 0usize;
    let mut max_block: Option<u32> = None;
    let mut max_slot = 0usize;
    for (i, s) in desc.seqs.iter().enumerate() {
        if s.start != next || s.len == 0 || s.len > n - next {
            return shape_err(
                OP,
                format!(
                    "sequence {i} ({}..+{}) does not tile the tokens",
                    s.start, s.len
                ),
            );
        }
        next = s.start + s.len;
        for (j, &p) in desc.positions[s.start..next].iter().enumerate() {
            if p as usize != s.pos0 + j {
                return shape_err(
                    OP,
                    format!(
                        "sequence {i}: token {j} at position {p}, expected {}",
                        s.pos0 + j
                    ),
                );
            }
        }
        let t_end = s
            .table_start
            .checked_add(s.table_len)
            .filter(|&e| e <= desc.block_tables.len());
        let Some(t_end) = t_end else {
            return shape_err(
                OP,
                format!(
                    "sequence {i}: table {}..+{} past the tables",
                    s.table_start, s.table_len
                ),
            );
        };
        let Some(end_pos) = s.pos0.checked_add(s.len) else {
            return shape_err(OP, format!("sequence {i}: position {} + {}", s.pos0, s.len));
        };
        let table = &desc.block_tables[s.table_start..t_end];
        if desc.block_size > 0 {
            let used = end_pos.div_ceil(desc.block_size);
            if used > s.table_len {
                return shape_err(
                    OP,
                    format!(
                        "sequence {i}: {end_pos} positions need {used} blocks, its table has {}",
                        s.table_len
                    ),
                );
            }
            max_block = max_block.max(table[..used].iter().copied().max());
        }
        // two sequences on one slot would race on its recurrent state
        if desc.seqs[..i].iter().any(|o| o.slot == s.slot) {
            return shape_err(OP, format!("slot {} appears twice", s.slot));
        }
        tok_seq[s.start..next].fill(u32_of("sequence index", i)?);
        max_slot = max_slot.max(s.slot);
        let table_start = match table_cap {
            Some(cap) => {
                if s.table_len > cap {
                    return shape_err(
                        OP,
                        format!(
                            "sequence {i}: a table of {} blocks, room for {cap}",
                            s.table_len
                        ),
                    );
                }
                tables.extend_from_slice(table);
                tables.resize((i + 1) * cap, 0);
                i * cap
            }
            None => {
                tables.extend_from_slice(table);
                tables.len() - table.len()
            }
        };
        for v in [s.slot, s.start, s.len, s.pos0, table_start, s.table_len] {
            seq_rec.push(u32_of("sequence field", v)?);
        }
    }
    if next != n {
        return shape_err(OP, format!("the sequences cover {next} of {n} tokens"));
    }
    if let Some(&r) = desc.logit_rows.iter().find(|&&r| r as usize >= n) {
        return shape_err(OP, format!("logit row {r} of {n} tokens"));
    }
    // the attention kernels' split of the work, per sequence by its length
    let mut tiles = Vec::new();
    let mut short = Vec::new();
    let mut max_ctx_short = 0usize;
    for (i, s) in desc.seqs.iter().enumerate() {
        if s.len >= TILE_MIN {
            for q in (0..s.len).step_by(TILE_Q) {
                tiles.extend([i as u32, q as u32]);
            }
        } else {
            short.extend(s.start as u32..(s.start + s.len) as u32);
            max_ctx_short = max_ctx_short.max(s.pos0 + s.len);
        }
    }
    let off_pos = n;
    let off_tok_seq = 2 * n;
    let off_seqs = 3 * n;
    let off_tables = off_seqs + seq_rec.len();
    let n_tables = tables.len();
    let off_logits = off_tables + n_tables.max(1);
    let n_logits = desc.logit_rows.len();
    let off_tiles = off_logits + n_logits;
    let off_short = off_tiles + tiles.len().max(1);
    let mut host = Vec::with_capacity(off_short + short.len().max(1));
    host.extend_from_slice(&desc.tokens);
    host.extend_from_slice(&desc.positions);
    host.extend_from_slice(&tok_seq);
    host.extend_from_slice(&seq_rec);
    host.extend_from_slice(&tables);
    if n_tables == 0 {
        host.push(0);
    }
    host.extend_from_slice(&desc.logit_rows);
    for part in [&tiles, &short] {
        host.extend_from_slice(part);
        if part.is_empty() {
            host.push(0);
        }
    }
    let meta = BatchMeta {
        n_tokens: n,
        n_seqs: desc.seqs.len(),
        off_pos,
        off_tok_seq,
        off_seqs,
        off_tables,
        n_tables,
        off_logits,
        n_logits,
        off_tiles,
        n_tiles: tiles.len() / 2,
        off_short,
        n_short: short.len(),
        max_ctx_short,
        max_block,
        max_slot,
        max_len: desc.seqs.iter().map(|s| s.len).max().unwrap_or(0),
        max_token: desc.tokens.iter().copied().max().unwrap_or(0),
        block_size: desc.block_size,
        table_cap,
        fixed_splits: None,
        len: host.len(),
    };
    Ok((host, meta))
}

impl CudaBackend {
    /// Upload a laid-out batch.
    fn upload_batch(&self, desc: BatchDesc, host: Vec<u32>, meta: BatchMeta) -> Result<Batch> {
        let mut buf = self.scratch::<u32>(host.len())?;
        self.stream
            .memcpy_htod(&host[..], &mut buf)
            .map_err(dev_err)?;
        let dev = DevBatch {
            owner: self.id,
            buf,
            meta,
        };
        Ok(Batch::from_parts(desc, Box::new(dev)))
    }

    pub(crate) fn prepare_batch_impl(&self, desc: BatchDesc) -> Result<Batch> {
        let (host, meta) = layout(&desc, None)?;
        self.upload_batch(desc, host, meta)
    }

    pub(crate) fn prepare_batch_for_recording_impl(
        &self,
        desc: BatchDesc,
        table_capacity: usize,
    ) -> Result<Batch> {
        let (host, mut meta) = layout(&desc, Some(table_capacity.max(1)))?;
        // a power of two of context chunks: a recording lasts until the longest context
        // doubles
        meta.fixed_splits = Some(meta.attn_splits().next_power_of_two());
        self.upload_batch(desc, host, meta)
    }

    pub(crate) fn refill_batch_impl(&self, batch: &mut Batch, desc: BatchDesc) -> Result<bool> {
        const OP: &str = "refill_batch";
        let id = self.id;
        let Some((old_desc, db)) = batch.parts_mut::<DevBatch>() else {
            return Err(BackendError::ForeignHandle {
                op: OP,
                what: "batch",
            });
        };
        if db.owner != id {
            return Err(BackendError::ForeignHandle {
                op: OP,
                what: "batch",
            });
        }
        let (Some(cap), Some(splits)) = (db.table_cap, db.fixed_splits) else {
            return shape_err(OP, "the batch was not prepared for recording");
        };
        if desc.seqs.iter().any(|s| s.table_len > cap) {
            return Ok(false);
        }
        let (host, mut meta) = layout(&desc, Some(cap))?;
        meta.fixed_splits = Some(splits);
        let same_layout = meta.len == db.len
            && meta.n_tokens == db.n_tokens
            && meta.n_seqs == db.n_seqs
            && meta.n_logits == db.n_logits
            && meta.n_tiles == db.n_tiles
            && meta.n_short == db.n_short
            && meta.off_short == db.off_short
            && meta.block_size == db.block_size
            && gdn_chunked(&meta) == gdn_chunked(db)
            && mamba2_chunked(&meta) == mamba2_chunked(db);
        let needs = meta.max_ctx_short.div_ceil(ATTN_SPLIT).max(1);
        if !same_layout || needs > splits {
            return Ok(false);
        }
        self.stream
            .memcpy_htod(&host[..], &mut db.buf)
            .map_err(dev_err)?;
        db.meta = meta;
        *old_desc = desc;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kapitsa_backend::SeqDesc;

    /// A decode batch: one token per sequence, sequence `i` at position `pos[i]` with a table
    /// of `pos[i] / bs + 1` blocks (ids made up from `i`).
    fn decode(pos: &[usize], bs: usize) -> BatchDesc {
        let mut d = BatchDesc {
            block_size: bs,
            ..Default::default()
        };
        for (i, &p) in pos.iter().enumerate() {
            let table: Vec<u32> = (0..p / bs + 1).map(|b| (100 * i + b) as u32).collect();
            d.seqs.push(SeqDesc {
                slot: i,
                start: i,
                len: 1,
                pos0: p,
                table_start: d.block_tables.len(),
                table_len: table.len(),
            });
            d.block_tables.extend(table);
            d.tokens.push(7 + i as u32);
            d.positions.push(p as u32);
            d.logit_rows.push(i as u32);
        }
        d
    }

    #[test]
    fn recorded_layout_puts_tables_at_fixed_offsets() {
        let (host, m) = layout(&decode(&[5, 40], 16), Some(4)).unwrap();
        assert_eq!(m.n_tables, 8);
        let rec = |i: usize| &host[m.off_seqs + 6 * i..m.off_seqs + 6 * i + 6];
        assert_eq!(rec(0)[4], 0);
        assert_eq!(rec(1)[4], 4);
        let tables = &host[m.off_tables..m.off_tables + 8];
        assert_eq!(tables, &[0, 0, 0, 0, 100, 101, 102, 0]);
    }

    #[test]
    fn later_decode_steps_keep_the_layout() {
        let (_, a) = layout(&decode(&[5, 40], 16), Some(4)).unwrap();
        let (_, b) = layout(&decode(&[21, 63], 16), Some(4)).unwrap();
        assert_eq!(
            (a.len, a.off_logits, a.off_short, a.n_short),
            (b.len, b.off_logits, b.off_short, b.n_short)
        );
        assert_eq!(b.max_ctx_short, 64);
        // packed tables (no capacity) change the layout as they grow
        let (_, c) = layout(&decode(&[5, 40], 16), None).unwrap();
        let (_, d) = layout(&decode(&[21, 63], 16), None).unwrap();
        assert_ne!(c.off_logits, d.off_logits);
    }

    #[test]
    fn the_longest_sequence_is_measured() {
        let (_, m) = layout(&decode(&[5, 40], 16), Some(4)).unwrap();
        assert_eq!(m.max_len, 1);
        let mut d = decode(&[5], 16);
        // a 70-token prompt after the decode token
        d.seqs.push(SeqDesc {
            slot: 1,
            start: 1,
            len: 70,
            pos0: 0,
            table_start: d.block_tables.len(),
            table_len: 5,
        });
        d.block_tables.extend(10..15);
        d.tokens.extend(std::iter::repeat_n(3, 70));
        d.positions.extend(0..70);
        let (_, m) = layout(&d, None).unwrap();
        assert_eq!(m.max_len, 70);
    }

    #[test]
    fn a_table_past_the_capacity_is_an_error() {
        assert!(layout(&decode(&[5, 70], 16), Some(4)).is_err());
    }

    #[test]
    fn fixed_splits_override_the_context() {
        let (_, mut m) = layout(&decode(&[300], 16), Some(32)).unwrap();
        assert_eq!(m.attn_splits(), 2);
        m.fixed_splits = Some(4);
        assert_eq!(m.attn_splits(), 4);
    }
}
