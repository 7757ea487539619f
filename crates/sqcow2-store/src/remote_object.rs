//! One remote object read by byte ranges through its local
//! [`RangeCache`]: a read takes the blocks the cache holds and fetches
//! each run of missing ones with one ranged GET, pinned to the version the
//! object had at open. Concurrent readers never fetch a block twice: a
//! block being fetched is claimed, and a reader that needs it waits for
//! that fetch; no lock is held while a GET is in flight.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};

use crate::manifest::KnownBytes;
use crate::prefetch::Prefetcher;
use crate::{CacheStart, ObjectInfo, ObjectStore, RangeCache, Retry, StoreError};

/// Most bytes one prefetch GET asks for.
pub const PREFETCH_RUN: u64 = 2 << 20;

/// A prefetch takes in the object's bytes this far past the range asked
/// for. A layer written in guest order keeps the clusters a sequential
/// reader needs next from it right after the ones it needs now: in a
/// long chain each layer holds a few clusters of any window of the
/// disk, and fetching them one ranged GET each would bound the reader
/// by requests, not bytes.
pub const PREFETCH_NEIGHBOURS: u64 = 1 << 20;

/// An object of a store and its cache.
#[derive(Debug)]
pub struct RemoteObject {
    store: Arc<ObjectStore>,
    key: String,
    info: ObjectInfo,
    state: Mutex<State>,
    /// Signalled when fetches end.
    fetched: Condvar,
    /// Bytes a manifest gave (its metadata), read without a request.
    known: KnownBytes,
    retry: Retry,
    /// Fetches ahead of readers ([`RemoteObject::prefetch`]), and this
    /// object as its jobs hold it.
    prefetch: Option<(Arc<Prefetcher>, Weak<RemoteObject>)>,
}

#[derive(Debug)]
struct State {
    cache: RangeCache,
    /// Blocks a reader is fetching now.
    fetching: HashSet<u64>,
}

impl RemoteObject {
    /// Opens `key` (one HEAD: its length and version) with its cache in
    /// `cache_dir` (named `name`), in blocks of `block` bytes, at most
    /// `capacity` bytes; and how the cache started.
    pub fn open(
        store: Arc<ObjectStore>,
        key: &str,
        cache_dir: &Path,
        name: &str,
        block: u32,
        capacity: u64,
    ) -> Result<(Self, CacheStart), StoreError> {
        let info = store.head(key)?;
        Self::open_known(
            store,
            key,
            info,
            KnownBytes::default(),
            cache_dir,
            name,
            block,
            capacity,
        )
    }

    /// [`RemoteObject::open`] of an object whose length and version (and
    /// some bytes) a manifest gave: no request.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn open_known(
        store: Arc<ObjectStore>,
        key: &str,
        info: ObjectInfo,
        known: KnownBytes,
        cache_dir: &Path,
        name: &str,
        block: u32,
        capacity: u64,
    ) -> Result<(Self, CacheStart), StoreError> {
        let io = |source| StoreError::Io {
            path: cache_dir.join(name).display().to_string(),
            source,
        };
        let (cache, start) =
            RangeCache::open(cache_dir, name, info.len, &info.etag, block, capacity).map_err(io)?;
        Ok((
            RemoteObject {
                store,
                key: key.into(),
                info,
                state: Mutex::new(State {
                    cache,
                    fetching: HashSet::new(),
                }),
                fetched: Condvar::new(),
                known,
                retry: Retry::default(),
                prefetch: None,
            },
            start,
        ))
    }

    /// With reads tried again by `retry`.
    pub fn with_retry(mut self, retry: Retry) -> Self {
        self.retry = retry;
        self
    }

    /// With fetches ahead run by `pool`; `me` is this object as it will be
    /// shared (`Arc::new_cyclic`).
    pub(crate) fn with_prefetch(mut self, pool: Arc<Prefetcher>, me: Weak<RemoteObject>) -> Self {
        self.prefetch = Some((pool, me));
        self
    }

    /// The object's length and version, as at open.
    pub fn info(&self) -> &ObjectInfo {
        &self.info
    }

    /// Its key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Fills `buf` from `offset` (within the object).
    pub fn read_range(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        if buf.is_empty() {
            return Ok(());
        }
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|e| *e <= self.info.len)
            .ok_or_else(|| StoreError::BadResponse {
                key: self.key.clone(),
                message: format!("a read of {} bytes at {offset} past the end", buf.len()),
            })?;
        if self.known.read(offset, buf) {
            return Ok(());
        }
        let block = {
            let state = self.lock();
            u64::from(state.cache.block_size())
        };
        let (first, last) = (offset / block, (end - 1) / block);
        let mut done = vec![false; (last - first + 1) as usize];
        let span = |i: u64| {
            let start = i * block;
            let from = offset.max(start);
            let to = end.min(start + block);
            (
                (from - start) as usize,
                (from - offset) as usize,
                (to - from) as usize,
            )
        };
        loop {
            let mut state = self.lock();
            let mut claimed: Vec<(u64, u64)> = Vec::new();
            let mut waiting = false;
            for i in first..=last {
                let k = (i - first) as usize;
                if done[k] {
                    continue;
                }
                let (at, into, n) = span(i);
                if state
                    .cache
                    .read_held(i, at, &mut buf[into..into + n])
                    .map_err(|e| self.io(e))?
                {
                    done[k] = true;
                } else if state.fetching.contains(&i) {
                    waiting = true;
                } else {
                    state.fetching.insert(i);
                    match claimed.last_mut() {
                        Some(run) if run.1 == i => run.1 = i + 1,
                        _ => claimed.push((i, i + 1)),
                    }
                }
            }
            if claimed.is_empty() {
                if !waiting {
                    return Ok(());
                }
                drop(
                    self.fetched
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner),
                );
                continue;
            }
            drop(state);
            let mut result = Ok(());
            for &(from_block, to_block) in &claimed {
                if result.is_err() {
                    break;
                }
                result = self.fetch_run(block, from_block, to_block).map(|bytes| {
                    for (j, chunk) in bytes.chunks(block as usize).enumerate() {
                        let i = from_block + j as u64;
                        let (at, into, n) = span(i);
                        buf[into..into + n].copy_from_slice(&chunk[at..at + n]);
                        done[(i - first) as usize] = true;
                    }
                });
            }
            // Every claim given up, fetched or not: a waiter fetches what
            // is still missing itself.
            self.release(&claimed);
            result?;
        }
    }

    /// Blocks `[from_block, to_block)`, claimed by the caller, fetched in
    /// one GET (tried again by the policy) and kept in the cache.
    fn fetch_run(&self, block: u64, from_block: u64, to_block: u64) -> Result<Vec<u8>, StoreError> {
        let from = from_block * block;
        let to = (to_block * block).min(self.info.len);
        let bytes = self.retry.run(|| {
            self.store
                .get_range(&self.key, from, (to - from) as usize, Some(&self.info.etag))
        })?;
        let mut state = self.lock();
        for (j, chunk) in bytes.chunks(block as usize).enumerate() {
            state
                .cache
                .put(from_block + j as u64, chunk)
                .map_err(|e| self.io(e))?;
        }
        Ok(bytes)
    }

    /// Gives claims up and wakes the readers waiting for them.
    fn release(&self, claimed: &[(u64, u64)]) {
        let mut state = self.lock();
        for &(a, b) in claimed {
            for i in a..b {
                state.fetching.remove(&i);
            }
        }
        drop(state);
        self.fetched.notify_all();
    }

    /// Starts fetching the blocks of `[offset, offset + len)`, and of the
    /// [`PREFETCH_NEIGHBOURS`] bytes after it, that the cache lacks and
    /// no one fetches, on the prefetch threads (runs of at most 2 MiB,
    /// several in flight); returns at once. A reader of those blocks
    /// meanwhile waits for these fetches.
    pub fn prefetch(&self, offset: u64, len: u64) {
        let Some((pool, me)) = &self.prefetch else {
            return;
        };
        let end = offset
            .saturating_add(len)
            .saturating_add(PREFETCH_NEIGHBOURS)
            .min(self.info.len);
        if offset >= end {
            return;
        }
        let mut state = self.lock();
        let block = u64::from(state.cache.block_size());
        let most = (PREFETCH_RUN / block).max(1);
        let mut claimed: Vec<(u64, u64)> = Vec::new();
        for i in offset / block..end.div_ceil(block) {
            if state.cache.holds(i) || state.fetching.contains(&i) {
                continue;
            }
            state.fetching.insert(i);
            match claimed.last_mut() {
                Some(run) if run.1 == i && run.1 - run.0 < most => run.1 = i + 1,
                _ => claimed.push((i, i + 1)),
            }
        }
        drop(state);
        for run in claimed {
            let me = me.clone();
            let started = pool.run(move || {
                if let Some(object) = me.upgrade() {
                    if let Err(e) = object.fetch_run(block, run.0, run.1) {
                        tracing::debug!(key = %object.key, error = %e, "prefetch failed");
                    }
                    object.release(&[run]);
                }
            });
            if !started {
                self.release(&[run]);
            }
        }
    }

    /// The cache's data file, if it holds all of `[offset, offset + len)`
    /// checked, and a pin that keeps those bytes there (no eviction)
    /// until dropped: a reader may then read the file at the same offsets
    /// itself. `None` when any of it is missing (read through
    /// [`RemoteObject::read_range`], which fetches).
    pub fn pin_cached(&self, offset: u64, len: u64) -> Option<(Arc<std::fs::File>, CachePin)> {
        let (_, me) = self.prefetch.as_ref()?;
        let end = offset
            .checked_add(len)
            .filter(|&e| len > 0 && e <= self.info.len)?;
        let mut state = self.lock();
        let block = u64::from(state.cache.block_size());
        let (first, last) = (offset / block, (end - 1) / block);
        if !state.cache.pin(first, last) {
            return None;
        }
        let file = state.cache.file().clone();
        Some((
            file,
            CachePin {
                object: me.clone(),
                first,
                last,
            },
        ))
    }

    /// Makes the cache survive a restart.
    pub fn persist(&self) -> Result<(), StoreError> {
        self.lock().cache.persist().map_err(|e| self.io(e))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn io(&self, source: std::io::Error) -> StoreError {
        StoreError::Io {
            path: format!("cache of {}", self.key),
            source,
        }
    }
}

/// Blocks of a [`RemoteObject`]'s cache kept in its data file while held
/// ([`RemoteObject::pin_cached`]).
#[derive(Debug)]
#[must_use = "the blocks may be evicted once the pin is dropped"]
pub struct CachePin {
    object: Weak<RemoteObject>,
    first: u64,
    last: u64,
}

impl Drop for CachePin {
    fn drop(&mut self) {
        if let Some(object) = self.object.upgrade() {
            object.lock().cache.unpin(self.first, self.last);
        }
    }
}

impl Drop for RemoteObject {
    fn drop(&mut self) {
        if let Err(e) = self.persist() {
            tracing::warn!(key = %self.key, error = %e, "the local cache of a remote layer was not kept");
        }
    }
}

/// A remote object as a layer's storage (read-only): a qcow2 layer kept in
/// a bucket opens and reads through it as through a file, zeros past its
/// end as files give them.
impl sqcow2_format::storage::Storage for RemoteObject {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let held = self.info.len.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (inside, past) = buf.split_at_mut(held);
        self.read_range(offset, inside).map_err(|e| {
            let kind = match e {
                StoreError::NotFound { .. } => std::io::ErrorKind::NotFound,
                StoreError::AccessDenied { .. } => std::io::ErrorKind::PermissionDenied,
                _ => std::io::ErrorKind::Other,
            };
            std::io::Error::new(kind, e)
        })?;
        past.fill(0);
        Ok(())
    }

    fn len(&self) -> std::io::Result<u64> {
        Ok(self.info.len)
    }

    fn prefetch(&self, offset: u64, len: u64) {
        RemoteObject::prefetch(self, offset, len);
    }

    fn fetches_remotely(&self) -> bool {
        true
    }

    fn pin_cached(
        &self,
        offset: u64,
        len: u64,
    ) -> Option<(
        sqcow2_format::storage::PinnedFile,
        sqcow2_format::storage::CachedRangePin,
    )> {
        let (file, pin) = RemoteObject::pin_cached(self, offset, len)?;
        let pinned = sqcow2_format::storage::PinnedFile {
            file,
            // A local file.
            nowait: true,
            direct: None,
        };
        Some((pinned, Box::new(pin)))
    }
}
