//! GGUF files: a validated, zero-copy reader ([`GgufFile`]) and an in-memory writer
//! ([`GgufWriter`]).
//!
//! Layout (little-endian, versions 2 and 3): magic `GGUF`, `u32` version, `u64` tensor count,
//! `u64` key/value count, the key/value pairs, the tensor infos, padding to
//! `general.alignment` (default 32), then the data section. Tensor offsets in the infos are
//! relative to the data section; [`GgufTensorInfo::offset`] is absolute.

mod parse;
mod value;
mod writer;

use std::collections::HashMap;
use std::path::Path;

use kapitsa_base::GgmlType;

pub use parse::{DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_STRING_LEN};
pub use value::{GgufArray, GgufValue, GgufValueType};
pub use writer::GgufWriter;

use crate::error::{FormatError, Result};
use crate::storage::{self, LoadMode, OpenOptions, Storage};
use crate::tensor::TensorView;

/// Description of one tensor of a GGUF file, validated against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// Tensor name (e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Element type.
    pub dtype: GgmlType,
    /// Dimensions in PyTorch order: GGUF `ne` reversed (so `shape.last() == ne[0]`, the
    /// contiguous dimension). Length 1..=4.
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file (data section start + relative offset);
    /// a multiple of the file alignment when the file is memory-mapped.
    pub offset: u64,
    /// Exact byte size of the data: `dtype.row_bytes(shape.last()) * product(shape[..last])`.
    pub n_bytes: usize,
}

impl GgufTensorInfo {
    /// Number of elements (product of `shape`).
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Dimensions in GGUF order (`ne`, innermost first).
    pub fn ne(&self) -> Vec<usize> {
        self.shape.iter().rev().copied().collect()
    }
}

/// An open, fully validated GGUF file.
///
/// Owns the memory map (or the byte vector given to [`GgufFile::from_bytes`]); tensor views
/// borrow from it. All metadata is decoded eagerly at open; tensor data is never copied.
/// Every tensor's data range was checked to lie inside the file, so [`GgufFile::tensor`]
/// cannot fail for a listed tensor.
pub struct GgufFile {
    storage: Storage,
    /// How the bytes are held ([`LoadMode::Mmap`] or [`LoadMode::Memory`], never `Auto`).
    mode: LoadMode,
    version: u32,
    alignment: usize,
    data_offset: u64,
    metadata: Vec<(String, GgufValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("file_len", &self.storage.bytes().len())
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and validates the GGUF file at `path`. The file must not be modified or
    /// truncated by another process while the returned value lives (the usual contract of
    /// memory-mapped model loaders).
    pub fn open(path: &Path) -> Result<GgufFile> {
        let opts = OpenOptions {
            mode: LoadMode::Mmap,
            progress: None,
        };
        Self::open_with(path, &opts)
    }

    /// Opens and validates the GGUF file at `path`, held as `opts.mode` says (a memory map,
    /// or a copy in memory read now, reporting progress). A memory-mapped file must not be
    /// modified or truncated by another process while the returned value lives.
    pub fn open_with(path: &Path, opts: &OpenOptions<'_>) -> Result<GgufFile> {
        let len = std::fs::metadata(path)
            .map_err(|source| FormatError::Io {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        let mode = storage::resolve(opts.mode, len);
        if mode == LoadMode::Memory {
            // A copy reads the whole file before the header is parsed: reject a file that is
            // not GGUF from its first bytes instead (the error the full parse would give).
            parse::check_start(&read_prefix(path, 8)?)?;
        }
        let mut progress = |done: u64| {
            if let Some(p) = opts.progress {
                p(done, len);
            }
        };
        Self::from_storage(Storage::open(path, mode, &mut progress)?, mode)
    }

    /// Validates a GGUF file held in memory (same checks as [`GgufFile::open`]).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::from_storage(Storage::Owned(bytes), LoadMode::Memory)
    }

    fn from_storage(storage: Storage, mode: LoadMode) -> Result<GgufFile> {
        let h = parse::parse(storage.bytes())?;
        Ok(GgufFile {
            storage,
            mode,
            version: h.version,
            alignment: h.alignment,
            data_offset: h.data_offset,
            metadata: h.metadata,
            key_index: h.key_index,
            tensors: h.tensors,
            tensor_index: h.tensor_index,
        })
    }

    /// How the bytes are held: [`LoadMode::Mmap`] or [`LoadMode::Memory`] (a copy, or bytes
    /// given to [`GgufFile::from_bytes`]).
    pub fn load_mode(&self) -> LoadMode {
        self.mode
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment in bytes (`general.alignment`, default 32; a power of two).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Total file size in bytes.
    pub fn file_len(&self) -> usize {
        self.storage.bytes().len()
    }

    /// All metadata key/value pairs, in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&GgufValue> {
        self.get(key)
            .ok_or_else(|| FormatError::MissingKey(key.to_string()))
    }

    /// `general.architecture` (e.g. `"qwen2"`, `"qwen35moe"`).
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// An integer value of any width converted to `T`; errors name the key.
    fn get_int<T: TryFrom<i128>>(&self, key: &str, target: &'static str) -> Result<T> {
        let v = self.require(key)?;
        let Some(i) = v.as_integer() else {
            return Err(wrong_type(key, "integer", v));
        };
        T::try_from(i).map_err(|_| FormatError::OutOfRange {
            key: key.to_string(),
            value: i.to_string(),
            target,
        })
    }

    /// `key` as `u32`; accepts any integer type whose value fits.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get_int(key, "u32")
    }

    /// `key` as `u64`; accepts any integer type whose value fits.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_int(key, "u64")
    }

    /// `key` as `i64`; accepts any integer type whose value fits.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.get_int(key, "i64")
    }

    /// `key` as `f32`; accepts F32 and F64 values.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_float()
            .map(|f| f as f32)
            .ok_or_else(|| wrong_type(key, "float", v))
    }

    /// `key` as a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| wrong_type(key, "string", v))
    }

    /// `key` as a bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            GgufValue::Bool(b) => Ok(*b),
            v => Err(wrong_type(key, "bool", v)),
        }
    }

    fn get_array(&self, key: &str, expected: &'static str) -> Result<&GgufArray> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| wrong_type(key, expected, v))
    }

    /// `key` as an array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.get_array(key, "array<string>")? {
            GgufArray::String(v) => Ok(v),
            a => Err(wrong_type_arr(key, "array<string>", a)),
        }
    }

    fn get_int_array<T: TryFrom<i128>>(
        &self,
        key: &str,
        expected: &'static str,
        target: &'static str,
    ) -> Result<Vec<T>> {
        let a = self.get_array(key, expected)?;
        let Some(ints) = a.to_integers() else {
            return Err(wrong_type_arr(key, expected, a));
        };
        ints.into_iter()
            .map(|i| {
                T::try_from(i).map_err(|_| FormatError::OutOfRange {
                    key: key.to_string(),
                    value: i.to_string(),
                    target,
                })
            })
            .collect()
    }

    /// `key` as `Vec<i32>`; accepts an array of any integer type whose values fit.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.get_int_array(key, "array<integer>", "i32")
    }

    /// `key` as `Vec<u32>`; accepts an array of any integer type whose values fit.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>> {
        self.get_int_array(key, "array<integer>", "u32")
    }

    /// `key` as `Vec<f32>`; accepts F32 and F64 arrays.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        match self.get_array(key, "array<float>")? {
            GgufArray::F32(v) => Ok(v.clone()),
            GgufArray::F64(v) => Ok(v.iter().map(|&x| x as f32).collect()),
            a => Err(wrong_type_arr(key, "array<float>", a)),
        }
    }

    /// `key` as `Vec<bool>`.
    pub fn get_bool_array(&self, key: &str) -> Result<Vec<bool>> {
        match self.get_array(key, "array<bool>")? {
            GgufArray::Bool(v) => Ok(v.clone()),
            a => Err(wrong_type_arr(key, "array<bool>", a)),
        }
    }

    /// Like [`GgufFile::get_u32`] but a missing key gives `Ok(None)`.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.optional(key, Self::get_u32)
    }

    /// Like [`GgufFile::get_f32`] but a missing key gives `Ok(None)`.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.optional(key, Self::get_f32)
    }

    /// Like [`GgufFile::get_bool`] but a missing key gives `Ok(None)`.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.optional(key, Self::get_bool)
    }

    /// Like [`GgufFile::get_str`] but a missing key gives `Ok(None)`.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.get_str(key).map(Some)
    }

    fn optional<'s, T>(
        &'s self,
        key: &str,
        f: impl FnOnce(&'s Self, &str) -> Result<T>,
    ) -> Result<Option<T>> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        f(self, key).map(Some)
    }

    /// A per-layer `u32` hyper-parameter that may be stored either as one scalar (broadcast to
    /// all `n_layers`) or as an integer array of exactly `n_layers` entries (as nemotron_h does
    /// for `feed_forward_length` and `attention.head_count_kv`).
    pub fn per_layer_u32(&self, key: &str, n_layers: usize) -> Result<Vec<u32>> {
        if let GgufValue::Array(_) = self.require(key)? {
            let v = self.get_u32_array(key)?;
            if v.len() != n_layers {
                return Err(FormatError::BadConfig(format!(
                    "metadata key '{key}' has {} entries, expected {n_layers} (one per layer)",
                    v.len()
                )));
            }
            Ok(v)
        } else {
            Ok(vec![self.get_u32(key)?; n_layers])
        }
    }

    /// All tensor infos, in file order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The info of tensor `name`, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A zero-copy view of tensor `name` (shape in PyTorch order), or `None` if absent.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let info = self.tensor_info(name)?;
        let start = usize::try_from(info.offset).ok()?;
        let end = start.checked_add(info.n_bytes)?;
        // Bounds were validated at open; `get` keeps this panic-free regardless.
        let data = self.storage.bytes().get(start..end)?;
        Some(TensorView {
            name: &info.name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            data,
        })
    }
}

/// Up to the first `n` bytes of the file at `path` (fewer if the file is shorter).
fn read_prefix(path: &Path, n: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let io = |source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut buf = Vec::new();
    std::fs::File::open(path)
        .map_err(io)?
        .take(n)
        .read_to_end(&mut buf)
        .map_err(io)?;
    Ok(buf)
}

fn wrong_type(key: &str, expected: &'static str, v: &GgufValue) -> FormatError {
    FormatError::WrongType {
        key: key.to_string(),
        expected,
        found: v.type_name(),
    }
}

fn wrong_type_arr(key: &str, expected: &'static str, a: &GgufArray) -> FormatError {
    FormatError::WrongType {
        key: key.to_string(),
        expected,
        found: a.type_name(),
    }
}
