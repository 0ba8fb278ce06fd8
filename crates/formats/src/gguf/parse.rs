//! Validating parser for the GGUF header: metadata and tensor infos.
//!
//! Every length and count read from the file is checked against the bytes that remain before
//! anything is allocated, so a hostile file can make the parser allocate at most a small
//! multiple of its own size.

use std::collections::HashMap;

use kapitsa_base::GgmlType;

use super::value::{GgufArray, GgufValue, GgufValueType};
use super::GgufTensorInfo;
use crate::error::{FormatError, Result};

/// Longest string accepted anywhere in the header (64 MiB).
pub const MAX_STRING_LEN: u64 = 64 << 20;
/// Deepest nesting of arrays of arrays accepted.
pub const MAX_ARRAY_DEPTH: u32 = 4;
/// Largest `general.alignment` accepted (1 GiB).
pub const MAX_ALIGNMENT: u64 = 1 << 30;
/// Alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Maximum tensor rank.
pub const MAX_DIMS: u32 = 4;

/// Smallest possible encoded tensor info: name length (8) + n_dims (4) + one ne (8) + type (4) + offset (8).
const MIN_TENSOR_INFO: u64 = 32;
/// Smallest possible encoded KV pair: key length (8) + value type (4) + one byte of value.
const MIN_KV: u64 = 13;

/// Everything the header holds, validated.
pub(crate) struct Header {
    pub version: u32,
    pub alignment: usize,
    pub metadata: Vec<(String, GgufValue)>,
    pub key_index: HashMap<String, usize>,
    pub tensors: Vec<GgufTensorInfo>,
    pub tensor_index: HashMap<String, usize>,
    pub data_offset: u64,
}

/// A bounds-checked little-endian reader over the whole file.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn truncated(&self, needed: u64, what: &str) -> FormatError {
        FormatError::Truncated {
            offset: self.pos as u64,
            needed,
            file_len: self.buf.len() as u64,
            what: what.to_string(),
        }
    }

    /// Takes `n` bytes or fails with `Truncated`.
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.truncated(n, what));
        }
        // `n <= remaining` so it fits in usize and the slice is in bounds.
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// Reads a count and checks that `count * min_elem` bytes remain.
    fn count(&mut self, min_elem: u64, what: &str) -> Result<usize> {
        let offset = self.pos as u64;
        let len = self.u64(what)?;
        let max = self.remaining() / min_elem.max(1);
        if len > max {
            return Err(FormatError::ArrayTooLong {
                what: what.to_string(),
                offset,
                len,
                max,
            });
        }
        // len <= remaining bytes, which fit in usize.
        Ok(len as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let offset = self.pos as u64;
        let len = self.u64(what)?;
        if len > MAX_STRING_LEN {
            return Err(FormatError::StringTooLong {
                offset,
                len,
                max: MAX_STRING_LEN,
            });
        }
        let start = self.pos as u64;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(FormatError::InvalidUtf8 {
                offset: start,
                what: what.to_string(),
            }),
        }
    }

    fn value_type(&mut self, what: &str) -> Result<GgufValueType> {
        let offset = self.pos as u64;
        let id = self.u32(what)?;
        GgufValueType::from_id(id).ok_or(FormatError::UnknownValueType { offset, id })
    }

    fn bool(&mut self, what: &str) -> Result<bool> {
        let offset = self.pos as u64;
        match self.array::<1>(what)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            byte => Err(FormatError::InvalidBool { offset, byte }),
        }
    }

    fn value(&mut self, ty: GgufValueType, what: &str) -> Result<GgufValue> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(self.array::<1>(what)?[0]),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array::<1>(what)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            GgufValueType::Bool => GgufValue::Bool(self.bool(what)?),
            GgufValueType::String => GgufValue::String(self.string(what)?),
            GgufValueType::Array => GgufValue::Array(self.gguf_array(0, what)?),
        })
    }

    /// Reads an array header and body. `depth` is the nesting level of this array (0 = top).
    fn gguf_array(&mut self, depth: u32, what: &str) -> Result<GgufArray> {
        let header_offset = self.pos as u64;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(FormatError::NestingTooDeep {
                offset: header_offset,
                max: MAX_ARRAY_DEPTH,
            });
        }
        let ty = self.value_type(what)?;
        let n = self.count(ty.min_size(), what)?;
        macro_rules! fixed {
            ($variant:ident, $t:ty, $size:expr) => {{
                // `count` checked n * min_size <= remaining, and min_size == $size here.
                let bytes = self.take((n as u64) * $size, what)?;
                GgufArray::$variant(
                    bytes
                        .chunks_exact($size)
                        .map(|c| {
                            let mut a = [0u8; $size];
                            a.copy_from_slice(c);
                            <$t>::from_le_bytes(a)
                        })
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            GgufValueType::U8 => GgufArray::U8(self.take(n as u64, what)?.to_vec()),
            GgufValueType::I8 => fixed!(I8, i8, 1),
            GgufValueType::U16 => fixed!(U16, u16, 2),
            GgufValueType::I16 => fixed!(I16, i16, 2),
            GgufValueType::U32 => fixed!(U32, u32, 4),
            GgufValueType::I32 => fixed!(I32, i32, 4),
            GgufValueType::U64 => fixed!(U64, u64, 8),
            GgufValueType::I64 => fixed!(I64, i64, 8),
            GgufValueType::F32 => fixed!(F32, f32, 4),
            GgufValueType::F64 => fixed!(F64, f64, 8),
            GgufValueType::Bool => {
                let start = self.pos;
                let bytes = self.take(n as u64, what)?;
                let mut v = Vec::with_capacity(n);
                for (i, &b) in bytes.iter().enumerate() {
                    match b {
                        0 => v.push(false),
                        1 => v.push(true),
                        byte => {
                            return Err(FormatError::InvalidBool {
                                offset: (start + i) as u64,
                                byte,
                            })
                        }
                    }
                }
                GgufArray::Bool(v)
            }
            GgufValueType::String => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string(what)?);
                }
                GgufArray::String(v)
            }
            GgufValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.gguf_array(depth + 1, what)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

/// Rounds `x` up to a multiple of `align` (a power of two); `None` on overflow.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    Some(x.checked_add(align - 1)? & !(align - 1))
}

/// Reads `general.alignment` from already-parsed metadata, validating it.
fn alignment_of(metadata: &[(String, GgufValue)], index: &HashMap<String, usize>) -> Result<usize> {
    let Some(&i) = index.get("general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let v = &metadata[i].1;
    let Some(a) = v.as_integer() else {
        return Err(FormatError::BadAlignment(format!(
            "of type {}",
            v.type_name()
        )));
    };
    if a <= 0 || a > i128::from(MAX_ALIGNMENT) || (a & (a - 1)) != 0 {
        return Err(FormatError::BadAlignment(a.to_string()));
    }
    // 0 < a <= 1 GiB fits in usize.
    Ok(a as usize)
}

/// Checks the magic and the version at the start of `buf` (a whole file or its first bytes):
/// the error [`parse`] gives for a file with that start, or `Ok` if those fields pass or
/// `buf` is too short to hold them (then [`parse`] reports what is missing).
pub(crate) fn check_start(buf: &[u8]) -> Result<()> {
    if buf.len() < 8 {
        return Ok(());
    }
    let mut c = Cursor { buf, pos: 0 };
    magic_and_version(&mut c).map(|_| ())
}

/// Reads and validates the magic and the version; returns the version.
fn magic_and_version(c: &mut Cursor<'_>) -> Result<u32> {
    let magic = c.array::<4>("magic")?;
    if &magic != b"GGUF" {
        return Err(FormatError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(FormatError::UnsupportedVersion { version });
    }
    Ok(version)
}

/// Parses and validates the header of a GGUF file held entirely in `buf`.
pub(crate) fn parse(buf: &[u8]) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0 };
    let version = magic_and_version(&mut c)?;
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata key/value count")?;
    let rem = c.remaining();
    if n_kv > rem / MIN_KV {
        return Err(FormatError::ArrayTooLong {
            what: "metadata key/value count".into(),
            offset: 16,
            len: n_kv,
            max: rem / MIN_KV,
        });
    }
    if n_tensors > rem / MIN_TENSOR_INFO {
        return Err(FormatError::ArrayTooLong {
            what: "tensor count".into(),
            offset: 8,
            len: n_tensors,
            max: rem / MIN_TENSOR_INFO,
        });
    }
    // Both counts are bounded by the file length, so they fit in usize.
    let (n_kv, n_tensors) = (n_kv as usize, n_tensors as usize);

    let mut metadata = Vec::with_capacity(n_kv);
    let mut key_index = HashMap::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let ty = c.value_type(&key)?;
        let value = c.value(ty, &key)?;
        if key_index.contains_key(&key) {
            return Err(FormatError::DuplicateKey(key));
        }
        key_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }
    let alignment = alignment_of(&metadata, &key_index)?;

    let mut infos: Vec<(String, GgmlType, Vec<u64>, u64)> = Vec::with_capacity(n_tensors);
    let mut tensor_index = HashMap::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(FormatError::BadDims { name, n_dims });
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(c.u64(&name)?);
        }
        let type_id = c.u32(&name)?;
        let offset = c.u64(&name)?;
        let Some(dtype) = GgmlType::from_id(type_id) else {
            return Err(FormatError::UnknownTensorType { name, id: type_id });
        };
        if tensor_index.contains_key(&name) {
            return Err(FormatError::DuplicateTensor(name));
        }
        tensor_index.insert(name.clone(), infos.len());
        infos.push((name, dtype, ne, offset));
    }

    let file_len = buf.len() as u64;
    let align = alignment as u64;
    let data_offset = align_up(c.pos as u64, align)
        .ok_or_else(|| FormatError::SizeOverflow("data section offset".into()))?;
    let mut tensors = Vec::with_capacity(n_tensors);
    for (name, dtype, ne, rel) in infos {
        let n_bytes = tensor_bytes(&name, dtype, &ne)?;
        if rel % align != 0 {
            return Err(FormatError::MisalignedTensor {
                name,
                offset: rel,
                alignment,
            });
        }
        let abs = data_offset.checked_add(rel);
        let end = abs.and_then(|a| a.checked_add(n_bytes as u64));
        match (abs, end) {
            (Some(abs), Some(end)) if end <= file_len => {
                // ne values were checked to fit usize in `tensor_bytes`.
                let shape = ne.iter().rev().map(|&d| d as usize).collect();
                tensors.push(GgufTensorInfo {
                    name,
                    dtype,
                    shape,
                    offset: abs,
                    n_bytes,
                });
            }
            _ => {
                return Err(FormatError::TensorOutOfBounds {
                    name,
                    offset: abs.unwrap_or(u64::MAX),
                    n_bytes: n_bytes as u64,
                    file_len,
                })
            }
        }
    }

    Ok(Header {
        version,
        alignment,
        metadata,
        key_index,
        tensors,
        tensor_index,
        data_offset,
    })
}

/// Byte size of a tensor with GGUF dims `ne` (innermost first), with every product checked.
fn tensor_bytes(name: &str, dtype: GgmlType, ne: &[u64]) -> Result<usize> {
    let overflow = || FormatError::SizeOverflow(format!("size of tensor '{name}' (ne = {ne:?})"));
    let mut n_elem: usize = 1;
    for &d in ne {
        if d > i64::MAX as u64 {
            return Err(overflow());
        }
        let d = usize::try_from(d).map_err(|_| overflow())?;
        n_elem = n_elem.checked_mul(d).ok_or_else(overflow)?;
    }
    // ne is non-empty (n_dims >= 1 checked by the caller); fall back to 1 defensively.
    let ne0 = ne.first().copied().unwrap_or(1) as usize;
    let bs = dtype.block_size();
    if !ne0.is_multiple_of(bs) {
        return Err(FormatError::BadRowSize {
            name: name.to_string(),
            dtype: dtype.name().to_string(),
            ne0: ne0 as u64,
            block: bs,
        });
    }
    let row = dtype.row_bytes(ne0).ok_or_else(overflow)?;
    let rows = ne
        .get(1..)
        .unwrap_or(&[])
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d as usize))
        .ok_or_else(overflow)?;
    row.checked_mul(rows).ok_or_else(overflow)
}
