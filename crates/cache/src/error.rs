//! Errors of cache storage operations.

/// What can go wrong making or using cache storage.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A bad size or setting.
    #[error("bad cache config: {0}")]
    Config(String),
    /// A bad slot, block or range (a caller's bookkeeping error).
    #[error("bad batch: {0}")]
    Batch(String),
    /// A sequence would grow past the cache's context size.
    #[error("context full: position {pos} does not fit a context of {n_ctx} tokens")]
    ContextFull {
        /// Position that did not fit.
        pos: usize,
        /// Context size of the cache.
        n_ctx: usize,
    },
    /// The KV block pool has too few free blocks for a chunk ([`crate::KvCache::prepare`]);
    /// the caller frees some (evicts or preempts a sequence) and retries.
    #[error("KV cache full: {needed} free blocks needed, {free} free")]
    OutOfBlocks {
        /// Blocks the chunk needs.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// The backend failed to allocate or copy cache memory.
    #[error(transparent)]
    Backend(#[from] kapitsa_backend::BackendError),
}

/// Result of cache operations.
pub type Result<T> = std::result::Result<T, CacheError>;
