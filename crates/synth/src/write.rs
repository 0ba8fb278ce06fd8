//! Streaming the planned file to disk: the header from [`GgufWriter::stream_header`], then each
//! tensor generated in row chunks on all cores (deterministic: every chunk has its own random
//! stream) while a writer thread appends finished chunks to `OUT.partial`, renamed to `OUT`
//! once complete and synced.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::sync_channel;

use kapitsa_base::GgmlType;
use kapitsa_formats::GgufWriter;
use rayon::prelude::*;

use crate::plan::{Init, Plan, TensorPlan};
use crate::quant::{f32_bytes, fill_rows, stream_seed, Rng};
use crate::SynthError;

/// Bytes generated per work item.
const CHUNK_BYTES: usize = 8 << 20;

/// `OUT.partial` next to `OUT`.
pub fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

/// The values the file holds for small tensor `name` of `plan` written with `seed` (the F32
/// tensors: norms, routers, SSM parameters; `None` for a chunked weight matrix or an unknown
/// name). For tests and diagnostics.
pub fn small_tensor_values(plan: &Plan, name: &str, seed: u64) -> Option<Vec<f32>> {
    let ti = plan.tensors.iter().position(|t| t.name == name)?;
    let t = &plan.tensors[ti];
    if matches!(t.init, Init::Matrix { .. } | Init::Output { .. }) {
        return None;
    }
    let mut rng = Rng::new(stream_seed(seed, ti as u64, u64::MAX));
    Some(small_values(t, &mut rng))
}

/// The values of a small F32 tensor (norms, routers, SSM parameters), generated whole.
fn small_values(t: &TensorPlan, rng: &mut Rng) -> Vec<f32> {
    let n = t.n_elements();
    match &t.init {
        Init::Const(v) => vec![*v; n],
        Init::Normal(s) => (0..n).map(|_| s * rng.normal()).collect(),
        Init::Router { std, row_log_std } => {
            let cols = *t.shape.last().unwrap_or(&1);
            let mut v = Vec::with_capacity(n);
            for _ in 0..n / cols.max(1) {
                let scale = std * (row_log_std * rng.normal()).exp();
                v.extend((0..cols).map(|_| scale * rng.normal()));
            }
            v
        }
        Init::NegA => (0..n).map(|_| -rng.uniform(1.0, 16.0)).collect(),
        Init::DtBias => (0..n)
            .map(|_| {
                let dt = (rng.uniform(1e-3f32.ln(), 1e-1f32.ln()) as f64).exp();
                // softplus^-1(dt) = ln(e^dt - 1)
                dt.exp_m1().ln() as f32
            })
            .collect(),
        Init::Matrix { std } | Init::Output { std, .. } => {
            let a = std * 3f32.sqrt();
            (0..n).map(|_| rng.uniform(-a, a)).collect()
        }
    }
}

/// Bytes of rows `r0..r1` of tensor `t` (index `ti` in the plan).
fn gen_rows(
    t: &TensorPlan,
    seed: u64,
    ti: usize,
    r0: usize,
    r1: usize,
) -> Result<Vec<u8>, SynthError> {
    // Cannot fail: planned shapes are never empty and their rows are whole blocks (see
    // `Tensor::n_bytes`).
    let n = *t.shape.last().expect("shape");
    let row_bytes = t.dtype.row_bytes(n).expect("planned whole blocks");
    let mut out = vec![0u8; (r1 - r0) * row_bytes];
    let mut rng = Rng::new(stream_seed(seed, ti as u64, r0 as u64));
    let (std, zero): (f32, Option<&Vec<bool>>) = match &t.init {
        Init::Matrix { std } => (*std, None),
        Init::Output { std, zero_rows } => (*std, Some(zero_rows)),
        _ => unreachable!("small tensors are generated whole"),
    };
    let zero_row = |i: usize| zero.is_some_and(|z| z.get(r0 + i).copied().unwrap_or(false));
    fill_rows(t.dtype, n, std, &mut rng, &mut out, &zero_row)?;
    Ok(out)
}

/// Write `plan` to `out` (via `OUT.partial`), calling `progress(bytes_written, total)` as it
/// goes. Returns the file size. On error the partial file is removed.
pub fn write_plan(
    plan: &Plan,
    out: &Path,
    seed: u64,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<u64, SynthError> {
    let mut w = GgufWriter::new();
    for (k, v) in &plan.metadata {
        w.add_kv(k.clone(), v.clone());
    }
    let decl: Vec<(&str, GgmlType, &[usize])> = plan
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice()))
        .collect();
    let header = w.stream_header(&decl)?;
    let total = plan.tensors.iter().fold(header.len() as u64, |acc, t| {
        let n = t.n_bytes();
        acc + n + w.stream_padding(n)
    });
    let partial = partial_path(out);
    let file = File::create(&partial).map_err(|e| SynthError::Io {
        what: format!("cannot create {}", partial.display()),
        source: e,
    })?;
    let r = stream(plan, &w, header, file, seed, total, progress, &partial);
    match r {
        Ok(()) => {
            std::fs::rename(&partial, out).map_err(|e| {
                let _ = std::fs::remove_file(&partial);
                SynthError::Io {
                    what: format!("cannot rename {} to {}", partial.display(), out.display()),
                    source: e,
                }
            })?;
            Ok(total)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn stream(
    plan: &Plan,
    w: &GgufWriter,
    header: Vec<u8>,
    file: File,
    seed: u64,
    total: u64,
    progress: &(dyn Fn(u64, u64) + Sync),
    partial: &Path,
) -> Result<(), SynthError> {
    let io_err = |e: std::io::Error| SynthError::Io {
        what: format!("cannot write {}", partial.display()),
        source: e,
    };
    let (tx, rx) = sync_channel::<Vec<u8>>(4);
    std::thread::scope(|s| {
        let writer = s.spawn(move || -> std::io::Result<()> {
            let mut bw = BufWriter::with_capacity(4 << 20, file);
            for buf in rx {
                bw.write_all(&buf)?;
            }
            let file = bw.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()
        });
        let produce = || -> Result<(), SynthError> {
            let mut sent = 0u64;
            let mut send = |buf: Vec<u8>| -> Result<(), SynthError> {
                sent += buf.len() as u64;
                tx.send(buf)
                    .map_err(|_| SynthError::Internal("writer stopped".into()))?;
                progress(sent, total);
                Ok(())
            };
            send(header)?;
            let group = 2 * rayon::current_num_threads().max(1);
            for (ti, t) in plan.tensors.iter().enumerate() {
                let n_bytes = t.n_bytes();
                if matches!(t.init, Init::Matrix { .. } | Init::Output { .. }) {
                    // Cannot fail: planned shapes are never empty and rows are whole blocks.
                    let n = *t.shape.last().expect("shape");
                    let row_bytes = t.dtype.row_bytes(n).expect("whole blocks");
                    let rows = t.n_elements() / n.max(1);
                    let per = (CHUNK_BYTES / row_bytes.max(1)).max(1);
                    let chunks: Vec<(usize, usize)> = (0..rows)
                        .step_by(per)
                        .map(|r0| (r0, (r0 + per).min(rows)))
                        .collect();
                    for g in chunks.chunks(group) {
                        let bufs: Vec<Result<Vec<u8>, SynthError>> = g
                            .par_iter()
                            .map(|&(r0, r1)| gen_rows(t, seed, ti, r0, r1))
                            .collect();
                        for b in bufs {
                            send(b?)?;
                        }
                    }
                } else {
                    let mut rng = Rng::new(stream_seed(seed, ti as u64, u64::MAX));
                    let v = small_values(t, &mut rng);
                    let bytes = match t.dtype {
                        GgmlType::F32 => f32_bytes(&v),
                        other => {
                            return Err(SynthError::Internal(format!(
                                "small tensor {} planned as {other}",
                                t.name
                            )))
                        }
                    };
                    debug_assert_eq!(bytes.len() as u64, n_bytes);
                    send(bytes)?;
                }
                let pad = w.stream_padding(n_bytes) as usize;
                if pad > 0 {
                    send(vec![0u8; pad])?;
                }
            }
            Ok(())
        };
        let produced = produce();
        drop(tx);
        let written = writer
            .join()
            .map_err(|_| SynthError::Internal("writer thread panicked".into()))?;
        // A write error is the root cause of a failed send; report it first.
        written.map_err(io_err)?;
        produced
    })
}
