//! Cache statistics: the sQemu paper's low-level metrics.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

/// Live counters, updated without locks.
#[derive(Debug, Default)]
pub struct CacheStats {
    hits: AtomicU64,
    misses: AtomicU64,
    hit_unallocated: AtomicU64,
    evictions: AtomicU64,
    bytes: AtomicU64,
    loads: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct StatsSnapshot {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that had to read a slice.
    pub misses: u64,
    /// Hits whose entry said "not here, look further down the chain".
    pub hit_unallocated: u64,
    /// Slices evicted to stay within the budget.
    pub evictions: u64,
    /// Bytes of slices held now (with bookkeeping allowance).
    pub bytes: u64,
    /// Slices loaded from their files (misses of `get_or_load`).
    pub loads: u64,
}

impl CacheStats {
    pub(crate) fn hit(&self) {
        self.hits.fetch_add(1, Relaxed);
    }
    pub(crate) fn miss(&self) {
        self.misses.fetch_add(1, Relaxed);
    }
    pub(crate) fn loaded(&self) {
        self.loads.fetch_add(1, Relaxed);
    }
    pub(crate) fn evicted(&self) {
        self.evictions.fetch_add(1, Relaxed);
    }
    pub(crate) fn add_bytes(&self, n: u64) {
        self.bytes.fetch_add(n, Relaxed);
    }
    pub(crate) fn sub_bytes(&self, n: u64) {
        self.bytes.fetch_sub(n, Relaxed);
    }

    /// Records a cached entry that sent the lookup further down the chain.
    pub fn hit_unallocated(&self) {
        self.hit_unallocated.fetch_add(1, Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            hit_unallocated: self.hit_unallocated.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            loads: self.loads.load(Relaxed),
        }
    }
}
