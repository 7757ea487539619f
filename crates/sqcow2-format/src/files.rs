//! Descriptors of a chain's lower layers, bounded. A chain of 10,000
//! layers must not need 10,000 open files: each lower layer is a
//! [`LazyFile`], whose descriptor lives in the chain's [`FileCache`] and is
//! closed when the least recently used one must make room; the next access
//! opens the file again by the path it was first opened by, checks that it
//! is the same file (device and inode), and takes its image locks again.
//!
//! The budget comes from the process's open-file limit, which the `sqcow2`
//! binary raises to the hard limit first, as QEMU does
//! ([`raise_open_file_limit`]): with the usual limits every layer of a long
//! chain stays open (and locked, as QEMU holds them); only past the budget
//! are descriptors closed and reopened. A lower layer that a
//! copy-on-write reads from has a second descriptor for those reads (see
//! `read_once.rs`): they count in the same budget, at most an eighth of
//! it, and only in room the files leave.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};

use crate::direct::CacheMode;
use crate::error::ErrorKind;
use crate::lock::{LockRequest, Locking};
use crate::read_once::DescriptorSlots;
use crate::storage::{fd_link, open_for_reading, real_path, FileStorage, PinnedFile, Storage};

/// Descriptors kept for lower layers when the open-file limit cannot be
/// read.
const FALLBACK_BUDGET: usize = 256;
/// Fewest descriptors a chain's cache keeps.
const MIN_BUDGET: usize = 16;

/// Raises this process's soft limit of open files to the hard limit (QEMU
/// does the same at start-up since 9.0); returns (old, new) soft limits.
pub fn raise_open_file_limit() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limits of this process into `lim`,
    // which we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let old = lim.rlim_cur;
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit reads `lim`, which we own; raising the soft
        // limit up to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok((old, lim.rlim_cur))
}

/// The descriptor budget of a chain's lower layers by default: half the
/// process's soft limit of open files (the rest for the top, sockets,
/// eventfds, io_uring, other chains).
pub(crate) fn default_budget() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into `lim`, which we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return FALLBACK_BUDGET;
    }
    usize::try_from(lim.rlim_cur / 2)
        .unwrap_or(usize::MAX)
        .max(MIN_BUDGET)
}

/// The open descriptors of one chain's lower layers. Past the budget, one
/// that has not been used since the clock hand last passed it is closed
/// (CLOCK, an approximation of least recently used that costs a hit no
/// lock beyond the file's own).
#[derive(Debug)]
pub(crate) struct FileCache {
    budget: usize,
    /// The second descriptors of copy-on-write reads (at most an eighth
    /// of the budget, in room the files leave; see `read_once.rs`).
    once_slots: Arc<DescriptorSlots>,
    state: Mutex<Clock>,
    /// Host page cache use of the files it opens again.
    cache: CacheMode,
}

#[derive(Debug, Default)]
struct Clock {
    /// The files open now.
    open: Vec<Weak<LazyFile>>,
    hand: usize,
}

/// An open descriptor of a lazily opened file.
#[derive(Debug, Clone)]
struct OpenFile {
    storage: Arc<FileStorage>,
    /// The same file, for transfers to pin (one hop from the `LazyFile`).
    file: PinnedFile,
}

impl FileCache {
    /// A cache keeping at most `budget` descriptors open.
    pub(crate) fn new(budget: usize) -> Self {
        let budget = budget.max(1);
        FileCache {
            budget,
            once_slots: DescriptorSlots::new(budget / 8, budget),
            state: Mutex::new(Clock::default()),
            cache: CacheMode::WriteBack,
        }
    }

    /// The same cache, opening files again with `cache`'s page cache use.
    pub(crate) fn with_cache(mut self, cache: CacheMode) -> Self {
        self.cache = cache;
        self
    }

    /// Descriptors open now: layer files and the second descriptors of
    /// their copy-on-write reads.
    #[cfg(test)]
    pub(crate) fn open_now(&self) -> usize {
        self.clock().open.len() + self.once_slots.used()
    }

    fn clock(&self) -> std::sync::MutexGuard<'_, Clock> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives `lazy` the descriptor `storage` (unless another thread did
    /// first: then that one serves) and closes others past the budget
    /// (their descriptors close once no transfer holds them). Returns the
    /// descriptor that serves.
    fn admit(&self, lazy: &LazyFile, storage: Arc<FileStorage>) -> io::Result<OpenFile> {
        let file = storage
            .pinned_file()?
            .ok_or_else(|| io::Error::other("no file"))?;
        let open = OpenFile { storage, file };
        let mut clock = self.clock();
        {
            let mut current = lazy.open.write().unwrap_or_else(PoisonError::into_inner);
            if let Some(other) = &*current {
                return Ok(other.clone());
            }
            *current = Some(open.clone());
        }
        lazy.referenced.store(true, Ordering::Relaxed);
        clock.open.push(lazy.me.clone());
        self.once_slots.file_opened();
        // Past the budget (the files and the second descriptors of
        // copy-on-write reads), files are closed; never the last one.
        while self.once_slots.total() > self.budget && clock.open.len() > 1 {
            if clock.hand >= clock.open.len() {
                clock.hand = 0;
            }
            let i = clock.hand;
            let Some(victim) = clock.open[i].upgrade() else {
                // Its chain is gone (the descriptor with it).
                clock.open.swap_remove(i);
                self.once_slots.file_closed();
                continue;
            };
            if std::ptr::eq(&*victim, lazy) || victim.referenced.swap(false, Ordering::Relaxed) {
                clock.hand += 1;
                continue;
            }
            *victim.open.write().unwrap_or_else(PoisonError::into_inner) = None;
            clock.open.swap_remove(i);
            self.once_slots.file_closed();
        }
        Ok(open)
    }
}

/// A lower layer's file, opened on demand through its chain's
/// [`FileCache`].
#[derive(Debug)]
pub(crate) struct LazyFile {
    /// The descriptor while it is open (first: in the cache line of the
    /// `Arc`'s counts, one memory access from a layer's storage).
    open: RwLock<Option<OpenFile>>,
    /// Itself, for the cache's list of open files.
    me: Weak<LazyFile>,
    /// Used since the cache's clock hand last passed.
    referenced: AtomicBool,
    path: PathBuf,
    /// Device and inode when first opened: a reopen must find the same.
    identity: (u64, u64),
    cache: Arc<FileCache>,
    /// The image locks every descriptor of the file takes.
    locks: Mutex<(LockRequest, Locking)>,
}

impl LazyFile {
    /// Hands `file`, opened by `path` and locked with `locks` (`mode`),
    /// to `cache`; later accesses reopen it by `path` when its descriptor
    /// was closed.
    pub(crate) fn adopt(
        path: &Path,
        file: FileStorage,
        locks: LockRequest,
        mode: Locking,
        cache: Arc<FileCache>,
    ) -> io::Result<Arc<Self>> {
        let identity = file
            .file_id()
            .ok_or_else(|| io::Error::other("no file identity"))?;
        let lazy = Arc::new_cyclic(|me| LazyFile {
            open: RwLock::new(None),
            me: me.clone(),
            referenced: AtomicBool::new(false),
            path: path.to_path_buf(),
            identity,
            cache: cache.clone(),
            locks: Mutex::new((locks, mode)),
        });
        cache.admit(
            &lazy,
            Arc::new(file.once_reads_within(cache.once_slots.clone())),
        )?;
        Ok(lazy)
    }

    /// A second, read-only description of the file `of` has open (opened
    /// through `/proc/self/fd`, so the same file whatever was renamed
    /// since), in `cache`, holding no image lock until [`Storage::lock`]
    /// gives it some: a live snapshot's top, read as a lower layer after
    /// the switch like every other one.
    pub(crate) fn reading_the_same_file(
        of: &dyn Storage,
        cache: Arc<FileCache>,
    ) -> io::Result<Arc<Self>> {
        let pinned = of
            .pinned_file()?
            .ok_or_else(|| io::Error::other("not a file"))?;
        let file = FileStorage::from_file(open_for_reading(&fd_link(&pinned.file))?)
            .with_cache(cache.cache)?;
        if file.file_id().is_none() || file.file_id() != of.file_id() {
            return Err(io::Error::other("not the same file"));
        }
        let path = real_path(file.file())?;
        Self::adopt(&path, file, LockRequest::NONE, Locking::Off, cache)
    }

    /// The descriptor if it is open now.
    fn current(&self) -> Option<OpenFile> {
        self.current_with(OpenFile::clone)
    }

    /// `f` of the descriptor if it is open now (one clone of what the
    /// caller needs, not of both halves: the read path takes this per
    /// request, for each of 10,000 files).
    fn current_with<T>(&self, f: impl FnOnce(&OpenFile) -> T) -> Option<T> {
        let value = f(self
            .open
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()?);
        if !self.referenced.load(Ordering::Relaxed) {
            self.referenced.store(true, Ordering::Relaxed);
        }
        Some(value)
    }

    /// The open file, reopened (same file, locks taken again) if its
    /// descriptor was closed.
    fn get(&self) -> io::Result<OpenFile> {
        if let Some(open) = self.current() {
            return Ok(open);
        }
        // Opening is I/O too (a round trip on remote storage).
        if crate::nowait::may_load().is_err() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        // Held from reading the locks to take until the descriptor that
        // took them serves, across the open (I/O): a lock change meanwhile
        // (`Storage::lock`, which takes it too) must find the new
        // descriptor, or the reopen would keep the request it read before
        // the change. Only reopens of this one file and its lock changes
        // wait for it.
        let locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(open) = self.current() {
            // Reopened by another thread meanwhile.
            return Ok(open);
        }
        // By its real path, no symlink followed on the way.
        let file = FileStorage::from_file(crate::sidefile::dir::open_resolved(&self.path)?)
            .with_cache(self.cache.cache)?;
        if file.file_id() != Some(self.identity) {
            return Err(io::Error::other(format!(
                "{} was replaced since the chain was opened",
                self.path.display()
            )));
        }
        let (want, mode) = *locks;
        file.lock(want, mode)
            .map_err(|k| io::Error::other(k.to_string()))?;
        let file = file.once_reads_within(self.cache.once_slots.clone());
        let open = self.cache.admit(self, Arc::new(file));
        drop(locks);
        open
    }
}

impl Storage for LazyFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.get()?.storage.read_at(buf, offset)
    }

    fn read_once_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.get()?.storage.read_once_at(buf, offset)
    }

    fn len(&self) -> io::Result<u64> {
        self.get()?.storage.len()
    }

    fn lock(&self, want: LockRequest, mode: Locking) -> Result<(), ErrorKind> {
        // Locking off changes no lock (as for a `FileStorage`): what the
        // next descriptor takes stays (an index build marks layers with
        // its locking off).
        if mode == Locking::Off {
            return Ok(());
        }
        let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(open) = self.current() {
            open.storage.lock(want, mode)?;
        }
        *locks = (want, mode);
        Ok(())
    }

    fn locks(&self) -> Option<LockRequest> {
        match self.current() {
            Some(open) => open.storage.locks(),
            // Closed: what its next descriptor takes.
            None => {
                let (want, mode) = *self.locks.lock().unwrap_or_else(PoisonError::into_inner);
                (mode != Locking::Off && want != LockRequest::NONE).then_some(want)
            }
        }
    }

    fn file_id(&self) -> Option<(u64, u64)> {
        Some(self.identity)
    }

    fn pinned_file(&self) -> io::Result<Option<PinnedFile>> {
        if let Some(file) = self.current_with(|o| o.file.clone()) {
            return Ok(Some(file));
        }
        Ok(Some(self.get()?.file))
    }

    fn allocation(&self, offset: u64, len: u64) -> Option<(bool, u64)> {
        self.get().ok()?.storage.allocation(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &Path, n: usize) -> Vec<PathBuf> {
        (0..n)
            .map(|i| {
                let p = dir.join(format!("f{i}"));
                std::fs::write(&p, vec![i as u8; 4096]).unwrap();
                p
            })
            .collect()
    }

    /// `path` opened, locked with `locks` and handed to `cache`.
    fn adopt(cache: &Arc<FileCache>, path: &Path, locks: LockRequest) -> Arc<LazyFile> {
        let mode = if locks == LockRequest::NONE {
            Locking::Off
        } else {
            Locking::On
        };
        let f = FileStorage::open_read_only(path).unwrap();
        f.lock(locks, mode).unwrap();
        LazyFile::adopt(path, f, locks, mode, cache.clone()).unwrap()
    }

    #[test]
    fn descriptors_stay_within_the_budget_and_reopen_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let paths = files(dir.path(), 10);
        let cache = Arc::new(FileCache::new(3));
        let lazy: Vec<Arc<LazyFile>> = paths
            .iter()
            .map(|p| adopt(&cache, p, LockRequest::NONE))
            .collect();
        assert_eq!(cache.open_now(), 3);
        for round in 0..3 {
            for (i, l) in lazy.iter().enumerate() {
                let mut b = [0u8; 16];
                l.read_at(&mut b, 100).unwrap();
                assert_eq!(b, [i as u8; 16], "round {round} file {i}");
                assert!(cache.open_now() <= 3);
            }
        }
        // A transfer's pinned file outlives its eviction.
        let pinned = lazy[0].pinned_file().unwrap().unwrap();
        for l in &lazy[1..] {
            l.read_at(&mut [0u8; 1], 0).unwrap();
        }
        let mut b = [0u8; 1];
        std::os::unix::fs::FileExt::read_at(&*pinned.file, &mut b, 0).unwrap();
        assert_eq!(b, [0]);
        // A file replaced under the same name is refused.
        std::fs::remove_file(&paths[0]).unwrap();
        std::fs::write(&paths[0], vec![0xEE; 4096]).unwrap();
        for l in &lazy[1..] {
            l.read_at(&mut [0u8; 1], 0).unwrap();
        }
        let err = lazy[0].read_at(&mut [0u8; 1], 0).unwrap_err();
        assert!(err.to_string().contains("replaced"), "{err}");
    }

    #[test]
    fn second_descriptors_of_copy_on_write_reads_count_in_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let paths = files(dir.path(), 12);
        // A budget of 8: at most one second descriptor.
        let cache = Arc::new(FileCache::new(8));
        let adopt = |p: &PathBuf| adopt(&cache, p, LockRequest::NONE);
        let mut lazy: Vec<Arc<LazyFile>> = paths[..7].iter().map(adopt).collect();
        let mut b = [0u8; 4];
        lazy[0].read_once_at(&mut b, 8).unwrap();
        assert_eq!(b, [0; 4]);
        assert_eq!(cache.open_now(), 8, "seven files and one second descriptor");
        // The budget is full: another file closes one.
        for (i, p) in paths.iter().enumerate().skip(7) {
            lazy.push(adopt(p));
            assert!(
                cache.open_now() <= 8,
                "after file {i}: {}",
                cache.open_now()
            );
        }
        for (i, l) in lazy.iter().enumerate() {
            l.read_once_at(&mut b, 8).unwrap();
            assert_eq!(b, [i as u8; 4]);
            assert!(
                cache.open_now() <= 8,
                "after reading file {i}: {}",
                cache.open_now()
            );
        }
    }

    /// A lock change while the file is reopened: the descriptor that
    /// serves afterwards holds what was asked last, never the request
    /// the reopen read before the change.
    #[test]
    fn a_lock_change_during_a_reopen_is_not_lost() {
        let dir = tempfile::tempdir().unwrap();
        let paths = files(dir.path(), 2);
        let cache = Arc::new(FileCache::new(1));
        let (a, b) = (
            adopt(&cache, &paths[0], LockRequest::READER),
            adopt(&cache, &paths[1], LockRequest::READER),
        );
        let mut lost = 0;
        for round in 0..400 {
            // `a` closed (the budget is one file), then reopened by a read
            // while its locks change.
            b.read_at(&mut [0u8; 1], 0).unwrap();
            let want = if round % 2 == 0 {
                LockRequest::NONE
            } else {
                LockRequest::READER
            };
            let start = std::sync::Barrier::new(2);
            std::thread::scope(|s| {
                s.spawn(|| {
                    start.wait();
                    a.read_at(&mut [0u8; 1], 0).unwrap();
                });
                start.wait();
                a.lock(want, Locking::On).unwrap();
            });
            a.read_at(&mut [0u8; 1], 0).unwrap();
            let held = a.locks().unwrap_or(LockRequest::NONE);
            if held != want {
                lost += 1;
            }
        }
        assert_eq!(lost, 0, "rounds whose lock change was lost");
    }

    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_limit() {
        let (_, new) = raise_open_file_limit().unwrap();
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into `lim`, which we own.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!((new, lim.rlim_cur), (lim.rlim_max, lim.rlim_max));
        assert!(default_budget() >= MIN_BUDGET);
    }
}
