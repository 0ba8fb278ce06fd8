//! The error type every fallible function of this crate returns.

use std::path::PathBuf;

/// Everything that can go wrong while reading or writing a model file.
///
/// Each variant's `Display` is one line naming the problem and, where known, the byte
/// offset, key or tensor involved. Offsets are absolute byte offsets in the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Opening, reading, memory-mapping or stat-ing a file failed.
    #[error("i/o error on '{path}': {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Writing to a sink (e.g. [`crate::GgufWriter::write_to`]) failed.
    #[error("write error: {0}")]
    Write(#[source] std::io::Error),
    /// The file does not start with `GGUF`.
    #[error("bad magic {found:02x?}: not a GGUF file (expected \"GGUF\")")]
    BadMagic {
        /// The first four bytes of the file.
        found: [u8; 4],
    },
    /// The GGUF version is not 2 or 3.
    #[error(
        "unsupported GGUF version {version} (supported: 2, 3; big-endian files are not supported)"
    )]
    UnsupportedVersion {
        /// The version number as read (little-endian).
        version: u32,
    },
    /// The file ended before a field could be read.
    #[error("truncated file: needed {needed} bytes at offset {offset} while reading {what}, file has {file_len}")]
    Truncated {
        /// Where the read started.
        offset: u64,
        /// How many bytes the read needed.
        needed: u64,
        /// Total file length.
        file_len: u64,
        /// What was being read.
        what: String,
    },
    /// A string length exceeds the sanity cap.
    #[error("string at offset {offset} too long: {len} bytes (max {max})")]
    StringTooLong {
        /// Offset of the length prefix.
        offset: u64,
        /// Declared length.
        len: u64,
        /// The cap.
        max: u64,
    },
    /// An array (or the tensor / key count) declares more elements than the rest of the file could hold.
    #[error("{what} at offset {offset} too long: {len} elements, the remaining file can hold at most {max}")]
    ArrayTooLong {
        /// What was being read.
        what: String,
        /// Offset of the count.
        offset: u64,
        /// Declared count.
        len: u64,
        /// Upper bound implied by the remaining bytes.
        max: u64,
    },
    /// Arrays of arrays nested deeper than the cap.
    #[error("array nesting too deep at offset {offset} (max depth {max})")]
    NestingTooDeep {
        /// Offset of the offending array header.
        offset: u64,
        /// The cap.
        max: u32,
    },
    /// A string is not valid UTF-8.
    #[error("invalid UTF-8 in {what} at offset {offset}")]
    InvalidUtf8 {
        /// Offset of the string bytes.
        offset: u64,
        /// What was being read.
        what: String,
    },
    /// A bool value byte other than 0 or 1.
    #[error("invalid bool byte {byte} at offset {offset}")]
    InvalidBool {
        /// Offset of the byte.
        offset: u64,
        /// The byte.
        byte: u8,
    },
    /// A metadata value type id outside 0..=12.
    #[error("unknown metadata value type id {id} at offset {offset}")]
    UnknownValueType {
        /// Offset of the type id.
        offset: u64,
        /// The id.
        id: u32,
    },
    /// The same metadata key appears twice.
    #[error("duplicate metadata key '{0}'")]
    DuplicateKey(String),
    /// The same tensor name appears twice.
    #[error("duplicate tensor '{0}'")]
    DuplicateTensor(String),
    /// A tensor's dimension count is outside 1..=4.
    #[error("tensor '{name}' has {n_dims} dimensions (supported: 1..=4)")]
    BadDims {
        /// Tensor name.
        name: String,
        /// Declared dimension count.
        n_dims: u32,
    },
    /// A tensor type id this engine does not know.
    #[error("unknown tensor type id {id} for '{name}'")]
    UnknownTensorType {
        /// Tensor name.
        name: String,
        /// The ggml type id.
        id: u32,
    },
    /// A tensor's innermost dimension is not a whole number of quantisation blocks.
    #[error("tensor '{name}': innermost dimension {ne0} is not a multiple of the {dtype} block size {block}")]
    BadRowSize {
        /// Tensor name.
        name: String,
        /// Element type name.
        dtype: String,
        /// Innermost dimension (GGUF `ne[0]`).
        ne0: u64,
        /// Block size of the type.
        block: usize,
    },
    /// A size computation overflowed.
    #[error("size overflow computing {0}")]
    SizeOverflow(String),
    /// `general.alignment` is zero, not a power of two, too large, or has a non-integer type.
    #[error("bad alignment value {0}: must be a non-zero power of two")]
    BadAlignment(String),
    /// A tensor's data offset is not a multiple of the file alignment.
    #[error("tensor '{name}' offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        /// Tensor name.
        name: String,
        /// Offset relative to the data section.
        offset: u64,
        /// The file alignment.
        alignment: usize,
    },
    /// A tensor's data extends past the end of the file.
    #[error("tensor '{name}' data out of bounds: {n_bytes} bytes at offset {offset}, file has {file_len}")]
    TensorOutOfBounds {
        /// Tensor name.
        name: String,
        /// Absolute offset of the data.
        offset: u64,
        /// Size of the data.
        n_bytes: u64,
        /// File length.
        file_len: u64,
    },
    /// A required metadata key is absent.
    #[error("missing metadata key '{0}'")]
    MissingKey(String),
    /// A metadata key has a type the caller cannot use.
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// What the caller asked for.
        expected: &'static str,
        /// What the file holds.
        found: &'static str,
    },
    /// A metadata integer does not fit the requested type.
    #[error("metadata key '{key}': value {value} does not fit in {target}")]
    OutOfRange {
        /// The key.
        key: String,
        /// The value, formatted.
        value: String,
        /// The requested type.
        target: &'static str,
    },
    /// A JSON file could not be parsed.
    #[error("json error in '{path}': {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A safetensors file is malformed.
    #[error("safetensors error in '{path}': {msg}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A required file is absent.
    #[error("missing file '{path}': {what}")]
    MissingFile {
        /// The expected path (or directory searched).
        path: PathBuf,
        /// What was looked for.
        what: String,
    },
    /// A required tensor is absent.
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    /// A JSON config has an unexpected structure.
    #[error("bad config: {0}")]
    BadConfig(String),
    /// Tensor shapes or dtypes are inconsistent for an operation.
    #[error("shape/dtype error: {0}")]
    Shape(String),
    /// An MLX quantisation parameter is unsupported.
    #[error("unsupported MLX quantisation: {0}")]
    UnsupportedQuant(String),
    /// Invalid input given to the GGUF writer.
    #[error("gguf writer: {0}")]
    Writer(String),
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, FormatError>;
