//! The disk tier of the prefix cache: one file per evicted KV block (`.kv`) and per recurrent
//! checkpoint (`.st`), under `DIR/<fingerprint>/`, with a size budget (least recently used
//! files go first).
//!
//! File layout (little-endian):
//!
//! | field | type |
//! |---|---|
//! | magic | `b"KPC1"` |
//! | kind | u8: 1 = KV block, 2 = recurrent state; then 3 zero bytes |
//! | fingerprint | u128: model, cache layout and block size ([`crate::prefix::fingerprint`]) |
//! | hash, parent | u128, u128: the node's chain hash and its parent's |
//! | start | u64: position of the node's first token |
//! | n_tokens, tokens | u32, `[u32; n_tokens]` |
//! | payload_len | u64 |
//! | header_sum | u64: FNV-1a of every byte above |
//! | payload | `payload_len` bytes |
//! | payload_sum | u64: FNV-1a of the payload |
//!
//! A file is written to a temporary name and renamed, so a crash leaves either the old state or
//! a whole file. Files that fail any check (magic, version, fingerprint, checksums, sizes) are
//! deleted and counted as rejected; they never reach the model.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"KPC1";
/// Header bytes before the tokens.
const FIXED: usize = 4 + 4 + 16 * 3 + 8 + 4;
/// Largest header we accept (tokens of one block).
const MAX_TOKENS: usize = 1 << 16;

/// What a file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Kv = 1,
    State = 2,
}

impl Kind {
    fn ext(self) -> &'static str {
        match self {
            Kind::Kv => "kv",
            Kind::State => "st",
        }
    }
}

/// The identity of a node, as stored in a file header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeKey {
    pub hash: u128,
    pub parent: u128,
    pub start: usize,
    pub tokens: Vec<u32>,
}

/// A file found by [`Disk::open`].
#[derive(Debug, Clone)]
pub(crate) struct Scanned {
    pub kind: Kind,
    pub key: NodeKey,
}

#[derive(Debug, Clone, Copy)]
struct FileInfo {
    size: u64,
    last_used: u64,
}

/// The files of one fingerprint.
#[derive(Debug)]
pub(crate) struct Disk {
    dir: PathBuf,
    fingerprint: u128,
    budget: u64,
    used: u64,
    tick: u64,
    files: HashMap<(u128, Kind), FileInfo>,
    /// Files that failed a check and were deleted.
    pub rejected: u64,
}

/// FNV-1a, 64 bit.
fn fnv(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const FNV0: u64 = 0xcbf2_9ce4_8422_2325;

impl Disk {
    /// Open (creating) `root/<fingerprint>/` and scan it. Damaged files are deleted.
    pub fn open(root: &Path, fingerprint: u128, budget: u64) -> io::Result<(Disk, Vec<Scanned>)> {
        let dir = root.join(format!("{fingerprint:032x}"));
        fs::create_dir_all(&dir)?;
        let mut d = Disk {
            dir,
            fingerprint,
            budget,
            used: 0,
            tick: 0,
            files: HashMap::new(),
            rejected: 0,
        };
        let mut found = Vec::new();
        let mut entries: Vec<(u64, PathBuf)> = Vec::new();
        for e in fs::read_dir(&d.dir)? {
            let Ok(e) = e else { continue };
            let path = e.path();
            let ext = path.extension().and_then(|x| x.to_str()).unwrap_or("");
            if ext == "tmp" {
                let _ = fs::remove_file(&path);
                continue;
            }
            if ext != "kv" && ext != "st" {
                continue;
            }
            let mtime = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |t| t.as_secs());
            entries.push((mtime, path));
        }
        // Oldest first, so recency survives a restart.
        entries.sort();
        for (_, path) in entries {
            match d.read_header(&path) {
                Ok((kind, key, size)) => {
                    d.tick += 1;
                    d.used += size;
                    d.files.insert(
                        (key.hash, kind),
                        FileInfo {
                            size,
                            last_used: d.tick,
                        },
                    );
                    found.push(Scanned { kind, key });
                }
                Err(_) => {
                    d.rejected += 1;
                    let _ = fs::remove_file(&path);
                }
            }
        }
        Ok((d, found))
    }

    fn path(&self, hash: u128, kind: Kind) -> PathBuf {
        self.dir.join(format!("{hash:032x}.{}", kind.ext()))
    }

    /// Bytes on disk.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Files on disk.
    pub fn n_files(&self) -> usize {
        self.files.len()
    }

    fn header(&self, kind: Kind, key: &NodeKey, payload_len: u64) -> Vec<u8> {
        let mut h = Vec::with_capacity(FIXED + 4 * key.tokens.len() + 16);
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&[kind as u8, 0, 0, 0]);
        h.extend_from_slice(&self.fingerprint.to_le_bytes());
        h.extend_from_slice(&key.hash.to_le_bytes());
        h.extend_from_slice(&key.parent.to_le_bytes());
        h.extend_from_slice(&(key.start as u64).to_le_bytes());
        h.extend_from_slice(&(key.tokens.len() as u32).to_le_bytes());
        for t in &key.tokens {
            h.extend_from_slice(&t.to_le_bytes());
        }
        h.extend_from_slice(&payload_len.to_le_bytes());
        let sum = fnv(&h, FNV0);
        h.extend_from_slice(&sum.to_le_bytes());
        h
    }

    /// Write a file; returns the (hash, kind) of files deleted to stay within the budget
    /// (never `keep`).
    pub fn write(
        &mut self,
        kind: Kind,
        key: &NodeKey,
        payload: &[u8],
        keep: &[u128],
    ) -> io::Result<Vec<(u128, Kind)>> {
        let head = self.header(kind, key, payload.len() as u64);
        let size = (head.len() + payload.len() + 8) as u64;
        if size > self.budget {
            return Err(io::Error::other("entry larger than the disk budget"));
        }
        let path = self.path(key.hash, kind);
        let tmp = path.with_extension("tmp");
        {
            let mut f = io::BufWriter::new(fs::File::create(&tmp)?);
            f.write_all(&head)?;
            f.write_all(payload)?;
            f.write_all(&fnv(payload, FNV0).to_le_bytes())?;
            f.into_inner().map_err(|e| e.into_error())?.sync_data()?;
        }
        fs::rename(&tmp, &path)?;
        if let Some(old) = self.files.remove(&(key.hash, kind)) {
            self.used -= old.size;
        }
        self.tick += 1;
        self.used += size;
        self.files.insert(
            (key.hash, kind),
            FileInfo {
                size,
                last_used: self.tick,
            },
        );
        let mut gone = Vec::new();
        while self.used > self.budget {
            let victim = self
                .files
                .iter()
                .filter(|((h, _), _)| *h != key.hash && !keep.contains(h))
                .min_by_key(|(_, f)| f.last_used)
                .map(|(k, _)| *k);
            let Some(v) = victim else { break };
            self.remove(v.0, v.1);
            gone.push(v);
        }
        Ok(gone)
    }

    /// Delete a file.
    pub fn remove(&mut self, hash: u128, kind: Kind) {
        if let Some(f) = self.files.remove(&(hash, kind)) {
            self.used -= f.size;
            let _ = fs::remove_file(self.path(hash, kind));
        }
    }

    fn read_header(&self, path: &Path) -> io::Result<(Kind, NodeKey, u64)> {
        let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_string());
        let mut f = fs::File::open(path)?;
        let size = f.metadata()?.len();
        let mut fixed = [0u8; FIXED];
        f.read_exact(&mut fixed)?;
        if &fixed[..4] != MAGIC || fixed[5..8] != [0, 0, 0] {
            return Err(bad("not a cache file"));
        }
        let kind = match fixed[4] {
            1 => Kind::Kv,
            2 => Kind::State,
            _ => return Err(bad("unknown kind")),
        };
        let u128_at = |o: usize| {
            let mut b = [0u8; 16];
            b.copy_from_slice(&fixed[o..o + 16]);
            u128::from_le_bytes(b)
        };
        if u128_at(8) != self.fingerprint {
            return Err(bad("another model or layout"));
        }
        let hash = u128_at(24);
        let parent = u128_at(40);
        let mut b8 = [0u8; 8];
        b8.copy_from_slice(&fixed[56..64]);
        let start = u64::from_le_bytes(b8);
        let mut b4 = [0u8; 4];
        b4.copy_from_slice(&fixed[64..68]);
        let n = u32::from_le_bytes(b4) as usize;
        if n == 0 || n > MAX_TOKENS {
            return Err(bad("bad token count"));
        }
        let mut rest = vec![0u8; 4 * n + 16];
        f.read_exact(&mut rest)?;
        let tokens: Vec<u32> = rest[..4 * n]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        b8.copy_from_slice(&rest[4 * n..4 * n + 8]);
        let payload_len = u64::from_le_bytes(b8);
        b8.copy_from_slice(&rest[4 * n + 8..]);
        let sum = u64::from_le_bytes(b8);
        let mut h = fnv(&fixed, FNV0);
        h = fnv(&rest[..4 * n + 8], h);
        if h != sum {
            return Err(bad("header checksum"));
        }
        let header_len = (FIXED + 4 * n + 16) as u64;
        if header_len
            .checked_add(payload_len)
            .and_then(|x| x.checked_add(8))
            != Some(size)
        {
            return Err(bad("truncated"));
        }
        let start = usize::try_from(start).map_err(|_| bad("bad start"))?;
        Ok((
            kind,
            NodeKey {
                hash,
                parent,
                start,
                tokens,
            },
            size,
        ))
    }

    /// Read and check a file's payload; `key` must match its header. A damaged file is
    /// deleted (and the error says so).
    pub fn read(&mut self, kind: Kind, key: &NodeKey) -> io::Result<Vec<u8>> {
        let path = self.path(key.hash, kind);
        let r = self.read_checked(&path, kind, key);
        match &r {
            Ok(_) => {
                self.tick += 1;
                if let Some(f) = self.files.get_mut(&(key.hash, kind)) {
                    f.last_used = self.tick;
                }
            }
            Err(_) => {
                self.rejected += 1;
                self.remove(key.hash, kind);
            }
        }
        r
    }

    fn read_checked(&self, path: &Path, kind: Kind, key: &NodeKey) -> io::Result<Vec<u8>> {
        let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_string());
        let (k, stored, _) = self.read_header(path)?;
        if k != kind || &stored != key {
            return Err(bad("file does not hold this node"));
        }
        let bytes = fs::read(path)?;
        let head = FIXED + 4 * key.tokens.len() + 16;
        if bytes.len() < head + 8 {
            return Err(bad("truncated"));
        }
        let (payload, sum) = bytes[head..].split_at(bytes.len() - head - 8);
        let mut b8 = [0u8; 8];
        b8.copy_from_slice(sum);
        if fnv(payload, FNV0) != u64::from_le_bytes(b8) {
            return Err(bad("payload checksum"));
        }
        Ok(payload.to_vec())
    }
}
