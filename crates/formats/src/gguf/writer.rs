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

/// A tensor declared for a streamed file: name, type and PyTorch-order shape, no data.
pub type StreamTensor<'a> = (&'a str, GgmlType, &'a [usize]);

impl GgufWriter {
    /// Streaming support for files too large to build in memory: the header (magic, version,
    /// counts, this writer's metadata, the tensor infos of `tensors`, padding to the
    /// alignment) of a file whose data section the caller writes itself, right after it.
    ///
    /// The data section must hold each declared tensor's bytes (exactly
    /// [`GgufWriter::stream_tensor_len`]) in declaration order, each followed by
    /// [`GgufWriter::stream_padding`] zero bytes. The result is byte-identical to
    /// [`GgufWriter::to_bytes`] of a writer holding the same metadata and tensors.
    ///
    /// Errors if tensors were already added with [`GgufWriter::add_tensor`] (a file is either
    /// built in memory or streamed), and on the conditions `add_tensor` checks: a duplicate
    /// name, rank outside 1..=4, a partial block, an overflowing size.
    pub fn stream_header(&self, tensors: &[StreamTensor<'_>]) -> Result<Vec<u8>> {
        if !self.tensors.is_empty() {
            return Err(FormatError::Writer(
                "stream_header: tensors were added with add_tensor; stream all of them instead"
                    .into(),
            ));
        }
        let align = self.alignment() as u64;
        let mut seen = std::collections::HashSet::with_capacity(tensors.len());
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            encode_str(k, &mut out);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            encode_value(v, &mut out);
        }
        let mut rel = 0u64;
        for &(name, dtype, shape) in tensors {
            if !seen.insert(name) {
                return Err(FormatError::DuplicateTensor(name.to_string()));
            }
            let len = Self::stream_tensor_len(name, dtype, shape)?;
            encode_str(name, &mut out);
            out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
            for &d in shape.iter().rev() {
                out.extend_from_slice(&(d as u64).to_le_bytes());
            }
            out.extend_from_slice(&dtype.id().to_le_bytes());
            out.extend_from_slice(&rel.to_le_bytes());
            rel = rel
                .checked_add(len)
                .and_then(|end| align_up(end, align))
                .ok_or_else(|| FormatError::Writer("data section size overflows u64".into()))?;
        }
        let target = align_up(out.len() as u64, align).unwrap_or(out.len() as u64);
        out.resize(target as usize, 0);
        Ok(out)
    }

    /// Byte size of the data of a tensor of `dtype` and PyTorch-order `shape` (what a streamed
    /// file holds for it before padding). Errors on rank outside 1..=4, a last dimension that is
    /// not a whole number of blocks, or overflow; `name` is only used in messages.
    pub fn stream_tensor_len(name: &str, dtype: GgmlType, shape: &[usize]) -> Result<u64> {
        if shape.is_empty() || shape.len() > MAX_DIMS as usize {
            return Err(FormatError::Writer(format!(
                "tensor '{name}' has rank {}, supported 1..=4",
                shape.len()
            )));
        }
        let (&inner, outer) = shape
            .split_last()
            .ok_or_else(|| FormatError::Writer(format!("tensor '{name}' has an empty shape")))?;
        dtype
            .row_bytes(inner)
            .and_then(|row| outer.iter().try_fold(row, |acc, &d| acc.checked_mul(d)))
            .map(|n| n as u64)
            .ok_or_else(|| {
                FormatError::Writer(format!(
                    "tensor '{name}': shape {shape:?} is not a whole number of {dtype} blocks per row \
                     or its size overflows"
                ))
            })
    }

    /// Zero bytes that follow a tensor of `len` data bytes in a streamed file (padding to this
    /// writer's alignment).
    pub fn stream_padding(&self, len: u64) -> u64 {
        let align = self.alignment() as u64;
        align_up(len, align).map_or(0, |end| end - len)
    }
}

#[cfg(test)]
mod stream_tests {
    use super::*;
    use crate::GgufFile;

    fn tensors() -> Vec<(String, GgmlType, Vec<usize>, Vec<u8>)> {
        vec![
            ("a".into(), GgmlType::F32, vec![3], vec![1u8; 12]),
            (
                "b.weight".into(),
                GgmlType::Q8_0,
                vec![2, 64],
                vec![7u8; 2 * 2 * 34],
            ),
            ("empty".into(), GgmlType::F16, vec![0, 4], vec![]),
            ("c".into(), GgmlType::F16, vec![5], vec![9u8; 10]),
        ]
    }

    #[test]
    fn streamed_file_equals_in_memory_file() {
        for align in [None, Some(64u32)] {
            let mut mem = GgufWriter::new();
            let mut st = GgufWriter::new();
            for w in [&mut mem, &mut st] {
                w.add_kv("general.architecture", GgufValue::String("x".into()));
                if let Some(a) = align {
                    w.add_kv("general.alignment", GgufValue::U32(a));
                }
            }
            let ts = tensors();
            for (n, d, s, b) in &ts {
                mem.add_tensor(n.clone(), *d, s, b.clone()).unwrap();
            }
            let decl: Vec<StreamTensor<'_>> = ts
                .iter()
                .map(|(n, d, s, _)| (n.as_str(), *d, s.as_slice()))
                .collect();
            let mut out = st.stream_header(&decl).unwrap();
            for (n, d, s, b) in &ts {
                assert_eq!(
                    GgufWriter::stream_tensor_len(n, *d, s).unwrap(),
                    b.len() as u64
                );
                out.extend_from_slice(b);
                out.resize(out.len() + st.stream_padding(b.len() as u64) as usize, 0);
            }
            assert_eq!(out, mem.to_bytes());
            let f = GgufFile::from_bytes(out).unwrap();
            assert_eq!(f.tensor_infos().len(), 4);
            assert_eq!(f.tensor("b.weight").unwrap().data, &[7u8; 136][..]);
        }
    }

    #[test]
    fn stream_header_rejects_bad_declarations() {
        let w = GgufWriter::new();
        let dup: [StreamTensor<'_>; 2] = [("x", GgmlType::F32, &[2]), ("x", GgmlType::F32, &[2])];
        assert!(matches!(
            w.stream_header(&dup),
            Err(FormatError::DuplicateTensor(_))
        ));
        assert!(w.stream_header(&[("q", GgmlType::Q4_K, &[100])]).is_err());
        assert!(w.stream_header(&[("r", GgmlType::F32, &[])]).is_err());
        let mut held = GgufWriter::new();
        held.add_tensor("t", GgmlType::F32, &[1], vec![0u8; 4])
            .unwrap();
        assert!(held.stream_header(&[("u", GgmlType::F32, &[1])]).is_err());
    }
}
