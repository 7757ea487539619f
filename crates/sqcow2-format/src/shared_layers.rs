//! Layer files below the tops that several chains of one process share
//! (a daemon serving many disks over the same base images): each file is
//! opened once (one descriptor, one set of image locks: a reader's), its
//! header and L1 table read once, and its L2 tables cached once, in one
//! cache for every shared file with its own budget, apart from each
//! chain's own cache (its top, its index, its private layers: a busy
//! chain cannot evict another's). A file is shared while a chain uses it
//! and forgotten (its slices dropped) with the last one.
//!
//! Only files opened fresh below a top, as qcow2, with a reader's locks,
//! are shared; a top never is (a file one chain writes is refused as
//! another's backing file by the image locks, as between processes).
//! Writing into a shared file (a commit into it) is refused while
//! another chain uses it ([`SharedLayers::users`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use sqcow2_cache::{CacheConfig, CacheStats, SliceCache, Source};

use crate::direct::CacheMode;
use crate::layer::{Qcow2Layer, SharedTables};
use crate::lock::{LockRequest, Locking};

/// How a file was opened: only opens alike share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpenMode {
    pub(crate) cache: CacheMode,
    pub(crate) lock: LockRequest,
    pub(crate) locking: Locking,
}

/// The shared files by device and inode, each opened by mode.
type Files = HashMap<(u64, u64), Vec<(OpenMode, Weak<SharedFile>)>>;

/// The shared files of a process and the cache of their tables.
#[derive(Debug)]
pub struct SharedLayers {
    cache: Arc<SliceCache>,
    files: Mutex<Files>,
    next_id: AtomicU32,
}

/// One shared file: what every chain's layer for it is cloned from.
#[derive(Debug)]
pub(crate) struct SharedFile {
    id: u32,
    cache: Arc<SliceCache>,
    /// The layer as first opened (its `shared` unset).
    template: Qcow2Layer,
}

impl SharedFile {
    /// A chain's layer for the file, reached at `path`.
    fn layer(self: &Arc<Self>, path: &std::path::Path) -> Qcow2Layer {
        let tables = SharedTables {
            cache: self.cache.clone(),
            source: Source::File(self.id),
            users: self.clone(),
        };
        self.template.clone().sharing(tables, path)
    }
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        self.cache.remove_source(Source::File(self.id));
    }
}

impl SharedLayers {
    /// A registry whose shared tables take at most `cache_bytes`.
    pub fn new(cache_bytes: u64) -> Self {
        SharedLayers {
            cache: Arc::new(SliceCache::new(CacheConfig {
                budget: cache_bytes,
                ..CacheConfig::default()
            })),
            files: Mutex::new(HashMap::new()),
            next_id: AtomicU32::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Files> {
        self.files.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The shared cache's counters.
    pub fn cache_stats(&self) -> &CacheStats {
        self.cache.stats()
    }

    /// Files shared now.
    pub fn files(&self) -> usize {
        self.lock()
            .values()
            .flatten()
            .filter(|(_, f)| f.strong_count() > 0)
            .count()
    }

    /// The layer of file `id` opened as `mode`, for a chain that reaches
    /// it at `path`, if a chain has it open.
    pub(crate) fn get(
        &self,
        id: (u64, u64),
        mode: OpenMode,
        path: &std::path::Path,
    ) -> Option<Qcow2Layer> {
        let files = self.lock();
        let file = files
            .get(&id)?
            .iter()
            .find(|(m, _)| *m == mode)
            .and_then(|(_, f)| f.upgrade())?;
        Some(file.layer(path))
    }

    /// Shares `layer` (just opened fresh as `mode`): the layer the chain
    /// keeps (or the one another chain shared meanwhile).
    pub(crate) fn insert(
        &self,
        id: (u64, u64),
        mode: OpenMode,
        layer: Qcow2Layer,
        path: &std::path::Path,
    ) -> Qcow2Layer {
        let mut files = self.lock();
        let entries = files.entry(id).or_default();
        entries.retain(|(_, f)| f.strong_count() > 0);
        if let Some(file) = entries
            .iter()
            .find(|(m, _)| *m == mode)
            .and_then(|(_, f)| f.upgrade())
        {
            return file.layer(path);
        }
        let file = Arc::new(SharedFile {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            cache: self.cache.clone(),
            template: layer,
        });
        entries.push((mode, Arc::downgrade(&file)));
        file.layer(path)
    }

    /// Shares file `id` no more: chains that have it keep it, those
    /// opened from now on open it afresh (it is about to be written).
    pub(crate) fn forget(&self, id: (u64, u64)) {
        self.lock().remove(&id);
    }

    /// Chains using the shared file `id` now (0: not shared).
    pub fn users(&self, id: (u64, u64)) -> usize {
        self.lock().get(&id).map_or(0, |entries| {
            entries
                .iter()
                // Each chain's layer holds one reference.
                .map(|(_, f)| f.strong_count())
                .sum()
        })
    }
}
