//! Backing bytes of an open file: a read-only memory map of the file, a read-only anonymous
//! copy of it, or an owned buffer.

use std::io::Read;
use std::path::Path;

use crate::error::{FormatError, Result};

/// How an opened model file's bytes are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadMode {
    /// A read-only memory map of the file: nothing is copied and opening is instant; reads go
    /// to the page cache.
    Mmap,
    /// A private copy read at open into anonymous memory (transparent huge pages requested),
    /// read-only afterwards. Opening reads the whole file, and the copy takes RAM beside the
    /// page cache's (reclaimable) one. On the VMs we measured, decode streams the weights
    /// noticeably faster from such a copy than from the page cache.
    Memory,
    /// [`LoadMode::Memory`] when the files take at most half of the RAM available now
    /// ([`memory_fits`]), else [`LoadMode::Mmap`].
    #[default]
    Auto,
}

/// Options for opening a model file or directory.
#[derive(Clone, Copy, Default)]
pub struct OpenOptions<'a> {
    /// How the bytes are held.
    pub mode: LoadMode,
    /// Called with `(bytes_done, bytes_total)` while a [`LoadMode::Memory`] copy is read
    /// (over all the files of a directory).
    pub progress: Option<&'a dyn Fn(u64, u64)>,
}

impl std::fmt::Debug for OpenOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenOptions")
            .field("mode", &self.mode)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

/// Whether `bytes` of model files fit the [`LoadMode::Auto`] budget for a copy in memory:
/// at most half of `MemAvailable` (Linux `/proc/meminfo`, which counts the reclaimable page
/// cache). False where that figure is unknown.
pub fn memory_fits(bytes: u64) -> bool {
    let Ok(s) = std::fs::read_to_string("/proc/meminfo") else {
        return false;
    };
    let kib = s.lines().find_map(|l| {
        l.strip_prefix("MemAvailable:")?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse::<u64>()
            .ok()
    });
    kib.is_some_and(|k| bytes <= k.saturating_mul(1024) / 2)
}

/// Resolves [`LoadMode::Auto`] for files of `bytes` in total.
pub(crate) fn resolve(mode: LoadMode, bytes: u64) -> LoadMode {
    match mode {
        LoadMode::Auto if memory_fits(bytes) => LoadMode::Memory,
        LoadMode::Auto => LoadMode::Mmap,
        m => m,
    }
}

/// The bytes of one file. `Send + Sync`; the bytes never change while this value lives.
pub(crate) enum Storage {
    /// A read-only mapping: of the file, or of an anonymous copy of it.
    Mmap(memmap2::Mmap),
    /// Bytes held in memory (tests, fuzzing, empty files).
    Owned(Vec<u8>),
}

impl Storage {
    /// Opens `path` as `mode` ([`LoadMode::Auto`] is taken as [`LoadMode::Mmap`]; resolve
    /// it first). `progress(done)` is called with the bytes read so far of this file while a
    /// copy is read. Empty files become an empty owned buffer (mapping a zero-length file
    /// fails on some platforms).
    pub(crate) fn open(
        path: &Path,
        mode: LoadMode,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Storage> {
        let io = |source| FormatError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Ok(Storage::Owned(Vec::new()));
        }
        if mode == LoadMode::Memory {
            let n = usize::try_from(len)
                .map_err(|_| io(std::io::Error::other("file larger than the address space")))?;
            let mut copy = memmap2::MmapOptions::new().len(n).map_anon().map_err(io)?;
            #[cfg(target_os = "linux")]
            {
                // A hint: without transparent huge pages the copy works the same.
                let _ = copy.advise(memmap2::Advice::HugePage);
            }
            let mut done = 0usize;
            for chunk in copy.chunks_mut(64 << 20) {
                file.read_exact(chunk).map_err(io)?;
                done += chunk.len();
                progress(done as u64);
            }
            return Ok(Storage::Mmap(copy.make_read_only().map_err(io)?));
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
