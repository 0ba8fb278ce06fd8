//! Backing bytes of an open file: a read-only memory map or an owned buffer.

use std::path::Path;

use crate::error::{FormatError, Result};

/// The bytes of one file. `Send + Sync`; the bytes never change while this value lives.
pub(crate) enum Storage {
    /// A read-only private mapping of a file.
    Mmap(memmap2::Mmap),
    /// Bytes held in memory (tests, fuzzing, empty files).
    Owned(Vec<u8>),
}

impl Storage {
    /// Memory-maps `path` read-only. Empty files become an empty owned buffer (mapping a
    /// zero-length file fails on some platforms).
    pub(crate) fn map_file(path: &Path) -> Result<Storage> {
        let io = |source| FormatError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Ok(Storage::Owned(Vec::new()));
        }
        // SAFETY: the mapping is read-only and we only ever hand out shared `&[u8]` borrows
        // tied to `self`. The one hazard of file mappings is another process truncating or
        // rewriting the file while it is mapped; model files are treated as immutable while
        // open (the same contract as llama.cpp and safetensors loaders), which is documented
        // on `GgufFile::open` and `HfModelDir::open`.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Ok(Storage::Mmap(map))
    }

    /// The file's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}
