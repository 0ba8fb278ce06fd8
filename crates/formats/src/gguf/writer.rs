//! A small in-memory GGUF (version 3) writer, for tests, fixtures and tools.

use std::io::Write;

use kapitsa_base::GgmlType;

use super::parse::{align_up, DEFAULT_ALIGNMENT, MAX_DIMS};
use super::value::{encode_str, encode_value, GgufValue};
use crate::error::{FormatError, Result};

struct PendingTensor {
    name: String,
    dtype: GgmlType,
    /// PyTorch order.
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// Builds a GGUF v3 file in memory.
///
/// Key/value pairs are written in insertion order, then tensor infos in insertion order, then
/// the data section with every tensor padded to the alignment (32 unless a
/// `general.alignment` integer key that is a power of two was added).
#[derive(Default)]
pub struct GgufWriter {
    kvs: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces, keeping its position) metadata key `key`.
    pub fn add_kv(&mut self, key: impl Into<String>, value: GgufValue) -> &mut Self {
        let key = key.into();
        if let Some(slot) = self.kvs.iter_mut().find(|(k, _)| *k == key) {
            slot.1 = value;
        } else {
            self.kvs.push((key, value));
        }
        self
    }

    /// Adds a tensor. `shape` is PyTorch order (it is written reversed as GGUF `ne`); `bytes`
    /// must be exactly `dtype.row_bytes(shape.last()) * product(shape[..last])` long.
    /// Errors on a duplicate name, rank outside 1..=4, a partial block, or a size mismatch.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dtype: GgmlType,
        shape: &[usize],
        bytes: impl Into<Vec<u8>>,
    ) -> Result<()> {
        let name = name.into();
        let bytes = bytes.into();
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(FormatError::DuplicateTensor(name));
        }
        if shape.is_empty() || shape.len() > MAX_DIMS as usize {
            return Err(FormatError::Writer(format!(
                "tensor '{name}' has rank {}, supported 1..=4",
                shape.len()
            )));
        }
        let (&inner, outer) = shape
            .split_last()
            .ok_or_else(|| FormatError::Writer(format!("tensor '{name}' has an empty shape")))?;
        let expected = dtype
            .row_bytes(inner)
            .and_then(|row| outer.iter().try_fold(row, |acc, &d| acc.checked_mul(d)));
        if expected != Some(bytes.len()) {
            return Err(FormatError::Writer(format!(
                "tensor '{name}': {} bytes given, shape {shape:?} of {dtype} needs {expected:?}",
                bytes.len()
            )));
        }
        self.tensors.push(PendingTensor {
            name,
            dtype,
            shape: shape.to_vec(),
            bytes,
        });
        Ok(())
    }

    /// The metadata added so far, in insertion order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.kvs
    }

    /// The alignment the file will use.
    pub fn alignment(&self) -> usize {
        self.kvs
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_integer())
            .filter(|&a| a > 0 && a <= 1 << 30 && a & (a - 1) == 0)
            .map_or(DEFAULT_ALIGNMENT, |a| a as usize)
    }

    /// Serialises the whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment() as u64;
        let pad = |out: &mut Vec<u8>| {
            let target = align_up(out.len() as u64, align).unwrap_or(out.len() as u64);
            out.resize(target as usize, 0);
        };
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            encode_str(k, &mut out);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            encode_value(v, &mut out);
        }
        let mut rel = 0u64;
        for t in &self.tensors {
            encode_str(&t.name, &mut out);
            out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                out.extend_from_slice(&(d as u64).to_le_bytes());
            }
            out.extend_from_slice(&t.dtype.id().to_le_bytes());
            out.extend_from_slice(&rel.to_le_bytes());
            let len = t.bytes.len() as u64;
            rel = align_up(rel + len, align).unwrap_or(rel + len);
        }
        pad(&mut out);
        for t in &self.tensors {
            out.extend_from_slice(&t.bytes);
            pad(&mut out);
        }
        out
    }

    /// Serialises the whole file into `w`.
    pub fn write_to(&self, w: &mut impl Write) -> Result<()> {
        w.write_all(&self.to_bytes()).map_err(FormatError::Write)
    }
}
