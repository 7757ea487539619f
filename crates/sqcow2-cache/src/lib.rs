//! One unified metadata cache for a whole qcow2 backing chain.
//!
//! [`SliceCache`] holds metadata slices (runs of 64-bit table entries: L2
//! table slices of any layer, chain index slices) under a single byte
//! budget, whatever the number of layers. It is sharded: a lookup locks one
//! shard, never the whole cache, so queue threads hit it concurrently.
//! Eviction follows a [`Policy`] (S3-FIFO by default; see
//! `docs/cache.md` for the measurements behind the choice).

#![warn(missing_docs)]
#![warn(unreachable_pub)]

mod policy;
mod stats;

use std::hash::{BuildHasher, Hash};

use foldhash::fast::RandomState;
use std::sync::{Arc, Mutex, MutexGuard};

pub use policy::Policy;
use policy::Queues;
pub use stats::{CacheStats, StatsSnapshot};

/// Default byte budget: QEMU's default L2 cache size for one layer.
pub const DEFAULT_BUDGET: u64 = 32 << 20;

/// Where a cached slice comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// An L2 table of the layer with this number (0 is the base).
    Layer(u32),
    /// A chain index, by a number its chain gives it (a chain that
    /// replaces its index gives the new one another number: the old
    /// one's slices are never taken for the new one's).
    Index(u32),
    /// Resolved slices (the top and the index combined), by guest slice
    /// number, for the chain with this number (the chain that follows a
    /// live snapshot shares the cache under a new number).
    Resolved(u32),
    /// An L2 table of a layer file several chains share, by the number
    /// the process gave the file when it first opened it.
    File(u32),
}

/// What identifies a slice: its source and its place there (a byte
/// offset in the file, or a guest slice number for resolved slices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SliceKey {
    /// Where the slice comes from.
    pub source: Source,
    /// Byte offset of the slice in its file (guest slice number for
    /// [`Source::Resolved`]).
    pub offset: u64,
}

/// A cached slice: decoded big-endian table entries.
pub type Slice = Arc<[u64]>;

/// Configuration of a [`SliceCache`].
#[derive(Debug, Clone, Copy)]
pub struct CacheConfig {
    /// Most bytes of slices held at once.
    pub budget: u64,
    /// Number of shards (rounded up to a power of two).
    pub shards: usize,
    /// Eviction policy.
    pub policy: Policy,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            budget: DEFAULT_BUDGET,
            shards: 16,
            policy: Policy::S3Fifo,
        }
    }
}

#[derive(Debug)]
struct Shard {
    map: policy::Map,
    queues: Queues,
    bytes: u64,
    budget: u64,
}

impl Shard {
    /// Removes `key` (not as an eviction), keeping the accounting right.
    fn take(&mut self, key: &SliceKey, stats: &CacheStats) {
        if let Some((old, meta)) = self.map.remove(key) {
            self.bytes -= weight(&old);
            stats.sub_bytes(weight(&old));
            self.queues.forget(&meta);
            self.queues.compact(&self.map);
        }
    }
}

/// The unified slice cache.
#[derive(Debug)]
pub struct SliceCache {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    stats: CacheStats,
}

fn weight(slice: &Slice) -> u64 {
    // The entries plus a fixed allowance for the map and queue bookkeeping.
    slice.len() as u64 * 8 + 64
}

impl SliceCache {
    /// A cache with `config`'s budget split evenly over its shards.
    pub fn new(config: CacheConfig) -> Self {
        let n = config.shards.max(1).next_power_of_two();
        let per_shard = (config.budget / n as u64).max(1);
        let shards = (0..n)
            .map(|_| {
                Mutex::new(Shard {
                    map: policy::Map::default(),
                    queues: Queues::new(config.policy, per_shard),
                    bytes: 0,
                    budget: per_shard,
                })
            })
            .collect();
        Self {
            shards,
            hasher: RandomState::default(),
            stats: CacheStats::default(),
        }
    }

    fn shard(&self, key: &SliceKey) -> MutexGuard<'_, Shard> {
        let i = (self.hasher.hash_one(key) as usize) & (self.shards.len() - 1);
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `f` of the cached slice under its shard's lock, counting a hit;
    /// on a miss (counted) `f` comes back unused.
    fn lookup<R, F: FnOnce(&Slice) -> R>(&self, key: SliceKey, f: F) -> Result<R, F> {
        let mut guard = self.shard(&key);
        let shard = &mut *guard;
        let Some((slice, meta)) = shard.map.get_mut(&key) else {
            drop(guard);
            self.stats.miss();
            return Err(f);
        };
        shard.queues.hit(key, meta);
        let r = f(slice);
        shard.queues.compact(&shard.map);
        drop(guard);
        self.stats.hit();
        Ok(r)
    }

    /// `load()`'s slice, counted as loaded and cached.
    fn load_and_insert<E>(
        &self,
        key: SliceKey,
        load: impl FnOnce() -> Result<Slice, E>,
    ) -> Result<Slice, E> {
        let slice = load()?;
        self.stats.loaded();
        self.insert(key, slice.clone());
        Ok(slice)
    }

    /// The cached slice, counting a hit or a miss.
    pub fn get(&self, key: SliceKey) -> Option<Slice> {
        self.lookup(key, Slice::clone).ok()
    }

    /// `f` of the cached slice, or of `load()`'s result, which is then
    /// cached. A hit lends the slice to `f` under its shard's lock (no
    /// reference count taken): keep `f` short and free of I/O.
    pub fn with_or_load<R, E>(
        &self,
        key: SliceKey,
        load: impl FnOnce() -> Result<Slice, E>,
        f: impl FnOnce(&[u64]) -> R,
    ) -> Result<R, E> {
        match self.lookup(key, |s: &Slice| f(s)) {
            Ok(r) => Ok(r),
            Err(f) => Ok(f(&self.load_and_insert(key, load)?)),
        }
    }

    /// The cached slice, or `load()`'s result, which is then cached.
    pub fn get_or_load<E>(
        &self,
        key: SliceKey,
        load: impl FnOnce() -> Result<Slice, E>,
    ) -> Result<Slice, E> {
        match self.get(key) {
            Some(s) => Ok(s),
            None => self.load_and_insert(key, load),
        }
    }

    /// Caches `slice` under `key` (replacing any older one), evicting by
    /// the policy until the shard fits its budget.
    pub fn insert(&self, key: SliceKey, slice: Slice) {
        self.insert_if(key, slice, || true);
    }

    /// [`SliceCache::insert`] if `still_valid()` holds, evaluated under the
    /// lock that [`SliceCache::remove`] of the same key takes: a caller that
    /// invalidates (a counter) before it removes the key can never have a
    /// slice built before the invalidation inserted after the removal.
    /// Returns whether the slice was inserted.
    pub fn insert_if(
        &self,
        key: SliceKey,
        slice: Slice,
        still_valid: impl FnOnce() -> bool,
    ) -> bool {
        let w = weight(&slice);
        let mut shard = self.shard(&key);
        if !still_valid() {
            return false;
        }
        let shard = &mut *shard;
        shard.take(&key, &self.stats);
        let meta = shard.queues.admit(key, w);
        shard.map.insert(key, (slice, meta));
        shard.bytes += w;
        self.stats.add_bytes(w);
        while shard.bytes > shard.budget {
            let Some(victim) = shard.queues.evict(&mut shard.map) else {
                break;
            };
            if let Some((old, _)) = shard.map.remove(&victim) {
                let w = weight(&old);
                shard.bytes -= w;
                self.stats.sub_bytes(w);
                self.stats.evicted();
            }
        }
        true
    }

    /// Drops the slice cached under `key`, if any.
    pub fn remove(&self, key: SliceKey) {
        self.shard(&key).take(&key, &self.stats);
    }

    /// Drops every slice of `source`.
    pub fn remove_source(&self, source: Source) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let keys: Vec<SliceKey> = shard
                .map
                .keys()
                .filter(|k| k.source == source)
                .copied()
                .collect();
            for key in keys {
                shard.take(&key, &self.stats);
            }
        }
    }

    /// Drops every slice (statistics are kept).
    pub fn clear(&self) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let shard = &mut *shard;
            let keys: Vec<SliceKey> = shard.map.keys().copied().collect();
            for key in keys {
                shard.take(&key, &self.stats);
            }
        }
    }

    /// The statistics counters (also for callers to record
    /// hit-unallocated lookups).
    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(n: usize, v: u64) -> Slice {
        vec![v; n].into()
    }

    #[test]
    fn stays_within_budget_for_every_policy() {
        for policy in [Policy::Lru, Policy::Clock, Policy::S3Fifo] {
            let cache = SliceCache::new(CacheConfig {
                budget: 64 * 1024,
                shards: 4,
                policy,
            });
            for i in 0..10_000u64 {
                cache.insert(
                    SliceKey {
                        source: Source::Layer((i % 7) as u32),
                        offset: i * 4096,
                    },
                    slice(512, i),
                );
                assert!(cache.stats().snapshot().bytes <= 64 * 1024, "{policy:?}");
            }
            let s = cache.stats().snapshot();
            assert!(s.evictions > 0);
        }
    }

    #[test]
    fn hits_return_what_was_inserted() {
        let cache = SliceCache::new(CacheConfig::default());
        let key = SliceKey {
            source: Source::Layer(3),
            offset: 65536,
        };
        assert!(cache.get(key).is_none());
        cache.insert(key, slice(8, 42));
        assert_eq!(cache.get(key).unwrap()[0], 42);
        cache.insert(key, slice(8, 43));
        assert_eq!(cache.get(key).unwrap()[0], 43);
        let s = cache.stats().snapshot();
        assert_eq!((s.hits, s.misses), (2, 1));
        cache.remove(key);
        assert!(cache.get(key).is_none());
        assert_eq!(cache.stats().snapshot().bytes, 0);
    }

    #[test]
    fn concurrent_use() {
        let cache = Arc::new(SliceCache::new(CacheConfig {
            budget: 1 << 20,
            shards: 8,
            policy: Policy::S3Fifo,
        }));
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let cache = cache.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let key = SliceKey {
                            source: Source::Layer(0),
                            offset: (i * 7 + t) % 4000,
                        };
                        let v = cache
                            .get_or_load(key, || Ok::<_, ()>(slice(64, key.offset)))
                            .unwrap();
                        assert_eq!(v[0], key.offset);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert!(cache.stats().snapshot().bytes <= 1 << 20);
    }
}

#[cfg(test)]
mod churn_tests {
    use super::*;

    /// Insert/remove churn (resolved slices invalidated by writes) never
    /// lets the queues grow without bound.
    #[test]
    fn queues_stay_bounded_under_churn() {
        for policy in [Policy::Lru, Policy::Clock, Policy::S3Fifo] {
            let cache = SliceCache::new(CacheConfig {
                budget: 1 << 30,
                shards: 1,
                policy,
            });
            for i in 0..100_000u64 {
                let key = SliceKey {
                    source: Source::Layer(0),
                    offset: i % 10,
                };
                cache.insert(key, vec![i; 4].into());
                let _ = cache.get(key);
                cache.remove(key);
            }
            let shard = cache.shards[0].lock().unwrap();
            assert!(
                shard.queues.len() < 1000,
                "{policy:?}: {} queue items",
                shard.queues.len()
            );
        }
    }

    #[test]
    fn insert_if_checks_under_the_shard_lock() {
        let cache = SliceCache::new(CacheConfig::default());
        let key = SliceKey {
            source: Source::Layer(1),
            offset: 0,
        };
        assert!(!cache.insert_if(key, vec![1u64; 8].into(), || false));
        assert!(cache.get(key).is_none());
        assert!(cache.insert_if(key, vec![2u64; 8].into(), || true));
        assert_eq!(cache.get(key).unwrap()[0], 2);
    }
}
