//! One remote object read by byte ranges through its local
//! [`RangeCache`]: a read takes the blocks the cache holds and fetches
//! each run of missing ones with one ranged GET, pinned to the version the
//! object had at open.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use crate::{CacheStart, ObjectInfo, ObjectStore, RangeCache, StoreError};

/// An object of a store and its cache.
#[derive(Debug)]
pub struct RemoteObject {
    store: Arc<ObjectStore>,
    key: String,
    info: ObjectInfo,
    cache: Mutex<RangeCache>,
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
                cache: Mutex::new(cache),
            },
            start,
        ))
    }

    /// The object's length and version, as at open.
    pub fn info(&self) -> &ObjectInfo {
        &self.info
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
        // Held across the fetches: concurrent misses of one block make one
        // GET, not several (the daemon's fetch threads, to come, will
        // track ranges in flight instead).
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let block = u64::from(cache.block_size());
        let (first, last) = (offset / block, (end - 1) / block);
        let mut blocks: Vec<Option<Vec<u8>>> = Vec::with_capacity((last - first + 1) as usize);
        for i in first..=last {
            blocks.push(cache.get(i).map_err(|e| self.io(e))?);
        }
        // Each run of missing blocks: one GET.
        let mut i = 0;
        while i < blocks.len() {
            if blocks[i].is_some() {
                i += 1;
                continue;
            }
            let run_start = i;
            while i < blocks.len() && blocks[i].is_none() {
                i += 1;
            }
            let from = (first + run_start as u64) * block;
            let to = ((first + i as u64) * block).min(self.info.len);
            let bytes = self.store.get_range(
                &self.key,
                from,
                (to - from) as usize,
                Some(&self.info.etag),
            )?;
            for (k, chunk) in bytes.chunks(block as usize).enumerate() {
                let index = first + (run_start + k) as u64;
                cache.put(index, chunk).map_err(|e| self.io(e))?;
                blocks[run_start + k] = Some(chunk.to_vec());
            }
        }
        drop(cache);
        let mut at = 0;
        for (k, b) in blocks.iter().enumerate() {
            let Some(b) = b else { continue };
            let block_start = (first + k as u64) * block;
            let from = offset.max(block_start) - block_start;
            let to = (end.min(block_start + b.len() as u64) - block_start) as usize;
            let n = to - from as usize;
            buf[at..at + n].copy_from_slice(&b[from as usize..to]);
            at += n;
        }
        Ok(())
    }

    /// Makes the cache survive a restart.
    pub fn persist(&self) -> Result<(), StoreError> {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .persist()
            .map_err(|e| self.io(e))
    }

    fn io(&self, source: std::io::Error) -> StoreError {
        StoreError::Io {
            path: format!("cache of {}", self.key),
            source,
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
}
