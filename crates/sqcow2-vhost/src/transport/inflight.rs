//! The inflight region of vhost-user "Inflight I/O tracking" for split
//! virtqueues (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`): shared memory the
//! frontend keeps across restarts of the backend, in which the backend
//! marks every request it has taken off a queue and not yet completed, so
//! that the next backend resubmits them.
//!
//! Layout, per queue, at `i * queue_region_size(queue_size)`:
//!
//! | offset | field |
//! | ---: | --- |
//! | 0 | `features: u64` (0) |
//! | 8 | `version: u16` (1 once initialised; 0 after a guest reset) |
//! | 10 | `desc_num: u16` (the queue size) |
//! | 12 | `last_batch_head: u16` |
//! | 14 | `used_idx: u16` (the used index as the backend last left it) |
//! | 16 | `desc[desc_num]`, 16 bytes each: `inflight: u8`, 5 bytes of padding, `next: u16`, `counter: u64` |
//!
//! The region comes from the frontend (or from us, on `GET_INFLIGHT_FD`)
//! and may hold anything: every value read from it is checked before use
//! ([`QueueInflight::recover`]), and it is only ever accessed through
//! atomics, so a frontend writing it concurrently cannot cause undefined
//! behaviour, only a request that is refused. This module holds the only
//! `unsafe` code touching it.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// Alignment of each queue's part.
const ALIGN: usize = 64;
/// Bytes before the first descriptor state.
const HEADER: usize = 16;
/// Bytes of one descriptor state.
const DESC: usize = 16;
/// The version this backend writes and understands.
const VERSION: u16 = 1;

const OFF_VERSION: usize = 8;
const OFF_DESC_NUM: usize = 10;
const OFF_LAST_BATCH_HEAD: usize = 12;
const OFF_USED_IDX: usize = 14;
const DESC_OFF_INFLIGHT: usize = 0;
const DESC_OFF_NEXT: usize = 6;
const DESC_OFF_COUNTER: usize = 8;

/// Bytes of one queue's part for queues of `queue_size` descriptors (what
/// libvhost-user and DPDK compute too).
pub(crate) fn queue_region_size(queue_size: u16) -> usize {
    (HEADER + DESC * usize::from(queue_size)).div_ceil(ALIGN) * ALIGN
}

/// Why an inflight region is refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum InflightError {
    /// The sizes do not describe a region we can use.
    #[error("inflight region of {mmap_size} bytes at offset {mmap_offset} for {num_queues} queues of {queue_size}: {reason}")]
    Geometry {
        mmap_size: u64,
        mmap_offset: u64,
        num_queues: u16,
        queue_size: u16,
        reason: &'static str,
    },
    /// A system call failed.
    #[error("inflight region: {0}")]
    Io(#[from] io::Error),
}

/// A mapping of the shared inflight region.
#[derive(Debug)]
pub(crate) struct InflightRegion {
    ptr: NonNull<u8>,
    len: usize,
    file: File,
    num_queues: u16,
    queue_size: u16,
}

// SAFETY: the mapping is owned by this value (unmapped only in Drop) and
// only ever accessed through atomics, from any thread.
unsafe impl Send for InflightRegion {}
// SAFETY: as above.
unsafe impl Sync for InflightRegion {}

impl Drop for InflightRegion {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made in `map_file`, which
        // nothing else unmaps; no reference into it outlives `self` (every
        // accessor borrows `self`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn geometry(
    mmap_size: u64,
    mmap_offset: u64,
    num_queues: u16,
    queue_size: u16,
    reason: &'static str,
) -> InflightError {
    InflightError::Geometry {
        mmap_size,
        mmap_offset,
        num_queues,
        queue_size,
        reason,
    }
}

impl InflightRegion {
    /// A new zeroed region for `num_queues` queues of `queue_size` (the
    /// answer to `GET_INFLIGHT_FD`), in a sealed memfd.
    pub(crate) fn create(num_queues: u16, queue_size: u16) -> Result<Self, InflightError> {
        let size = Self::size_for(num_queues, queue_size)
            .ok_or_else(|| geometry(0, 0, num_queues, queue_size, "no queues or empty queues"))?;
        // SAFETY: a plain system call on a NUL-terminated name.
        let fd = unsafe {
            libc::memfd_create(
                c"sqcow2-inflight".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size as u64)?;
        // SAFETY: fcntl on a file we own; sealing only restricts it.
        let sealed = unsafe {
            libc::fcntl(
                file.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL,
            )
        };
        if sealed < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // A new memfd reads as zeros: nothing to clear.
        Self::map_file(file, size, 0, num_queues, queue_size)
    }

    /// Maps a region the frontend hands over (`SET_INFLIGHT_FD`); refused
    /// unless its size is exactly what `num_queues` queues of `queue_size`
    /// need.
    pub(crate) fn open(
        file: File,
        mmap_size: u64,
        mmap_offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Self, InflightError> {
        let err = |reason| geometry(mmap_size, mmap_offset, num_queues, queue_size, reason);
        let size = Self::size_for(num_queues, queue_size).ok_or_else(|| err("no queues"))?;
        if mmap_size != size as u64 {
            return Err(err("the size does not match the queues"));
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        if mmap_offset % page != 0 {
            return Err(err("the offset is not page aligned"));
        }
        let file_len = file.metadata()?.len();
        if mmap_offset
            .checked_add(mmap_size)
            .is_none_or(|end| end > file_len)
        {
            return Err(err("the region lies past the end of its file"));
        }
        Self::map_file(file, size, mmap_offset, num_queues, queue_size)
    }

    fn size_for(num_queues: u16, queue_size: u16) -> Option<usize> {
        (num_queues > 0 && queue_size > 0)
            .then(|| usize::from(num_queues) * queue_region_size(queue_size))
    }

    fn map_file(
        file: File,
        len: usize,
        offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Self, InflightError> {
        let offset = libc::off_t::try_from(offset).map_err(|_| {
            geometry(
                len as u64,
                offset,
                num_queues,
                queue_size,
                "offset too large",
            )
        })?;
        // SAFETY: a new shared mapping of `len` bytes of a file we own,
        // checked above to be at least that long; it is unmapped in Drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error().into());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap at 0"))?;
        Ok(InflightRegion {
            ptr,
            len,
            file,
            num_queues,
            queue_size,
        })
    }

    /// The file the region lives in (sent to the frontend).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Bytes mapped.
    pub(crate) fn size(&self) -> u64 {
        self.len as u64
    }

    /// The part of queue `index`, if the region covers it.
    pub(crate) fn queue(self: &Arc<Self>, index: u16) -> Option<QueueInflight> {
        (index < self.num_queues).then(|| QueueInflight {
            region: self.clone(),
            base: usize::from(index) * queue_region_size(self.queue_size),
        })
    }

    /// The atomic of type `T` at byte `at` of the mapping.
    fn atomic<T>(&self, at: usize) -> &T {
        assert!(
            at + std::mem::size_of::<T>() <= self.len && at % std::mem::align_of::<T>() == 0,
            "inflight field at {at} outside the region (a bug)"
        );
        // SAFETY: `at` is in bounds and aligned for `T` (checked above; the
        // mapping is page aligned), the mapping lives as long as `self`
        // (the returned reference borrows it), and `T` is an atomic
        // integer, valid for any bit pattern and sound to share with other
        // threads and processes.
        unsafe { &*self.ptr.as_ptr().add(at).cast::<T>() }
    }
}

/// One queue's part of the inflight region.
#[derive(Debug, Clone)]
pub(crate) struct QueueInflight {
    region: Arc<InflightRegion>,
    base: usize,
}

/// What a restarted backend must do on a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Recovery {
    /// Heads of the requests to resubmit, in the order they were taken.
    pub resubmit: Vec<u16>,
    /// Where to take the next new request from the available ring.
    pub next_avail: u16,
    /// What the region said that was ignored, for the log.
    pub ignored: Vec<String>,
}

impl QueueInflight {
    fn u16_at(&self, off: usize) -> &AtomicU16 {
        self.region.atomic(self.base + off)
    }

    fn desc(&self, head: u16) -> usize {
        self.base + HEADER + usize::from(head) * DESC
    }

    fn inflight(&self, head: u16) -> &AtomicU8 {
        self.region.atomic(self.desc(head) + DESC_OFF_INFLIGHT)
    }

    fn next(&self, head: u16) -> &AtomicU16 {
        self.region.atomic(self.desc(head) + DESC_OFF_NEXT)
    }

    fn counter(&self, head: u16) -> &AtomicU64 {
        self.region.atomic(self.desc(head) + DESC_OFF_COUNTER)
    }

    /// Descriptors this part tracks.
    pub(crate) fn desc_num(&self) -> u16 {
        self.region.queue_size
    }

    /// Records that the request at `head` was taken off the queue, as the
    /// `counter`-th: before it is started.
    pub(crate) fn taken(&self, head: u16, counter: u64) {
        if head >= self.desc_num() {
            return;
        }
        self.counter(head).store(counter, Ordering::Relaxed);
        self.inflight(head).store(1, Ordering::Release);
    }

    /// Before the request at `head` goes on the used ring: it becomes the
    /// last batch (of one), found again if the backend dies before
    /// [`QueueInflight::completed`].
    pub(crate) fn completing(&self, head: u16) {
        if head >= self.desc_num() {
            return;
        }
        let last = self.u16_at(OFF_LAST_BATCH_HEAD);
        self.next(head)
            .store(last.load(Ordering::Relaxed), Ordering::Relaxed);
        last.store(head, Ordering::Relaxed);
        // Both before the used index the caller publishes next.
        fence(Ordering::SeqCst);
    }

    /// After the request at `head` is on the used ring and the used index
    /// is `used_idx`.
    pub(crate) fn completed(&self, head: u16, used_idx: u16) {
        fence(Ordering::SeqCst);
        if head < self.desc_num() {
            self.inflight(head).store(0, Ordering::Release);
        }
        fence(Ordering::SeqCst);
        self.u16_at(OFF_USED_IDX).store(used_idx, Ordering::Release);
    }

    /// What to resubmit when a queue starts, given the ring's used index
    /// and available index now; repairs the region for the requests that
    /// follow (a batch interrupted while completing is settled). A fresh
    /// region (version 0) is initialised and yields nothing. Entries that
    /// cannot be right (more requests in flight than the ring has
    /// outstanding, unknown states) are ignored and reported.
    pub(crate) fn recover(&self, ring_used: u16, ring_avail: u16) -> Recovery {
        let mut out = Recovery {
            resubmit: Vec::new(),
            next_avail: ring_used,
            ignored: Vec::new(),
        };
        let n = self.desc_num();
        let version = self.u16_at(OFF_VERSION).load(Ordering::Acquire);
        if version != VERSION {
            if version != 0 {
                out.ignored.push(format!("version {version}"));
            }
            self.reset(ring_used);
            return out;
        }
        let desc_num = self.u16_at(OFF_DESC_NUM).load(Ordering::Relaxed);
        if desc_num != n {
            out.ignored
                .push(format!("{desc_num} descriptors where the queue has {n}"));
            self.reset(ring_used);
            return out;
        }
        // A batch whose used index went out but whose entries were not
        // cleared yet: those requests completed.
        let region_used = self.u16_at(OFF_USED_IDX).load(Ordering::Acquire);
        let unsettled = ring_used.wrapping_sub(region_used);
        if unsettled != 0 {
            let mut head = self.u16_at(OFF_LAST_BATCH_HEAD).load(Ordering::Relaxed);
            if unsettled > n {
                out.ignored.push(format!(
                    "{unsettled} completions not settled (more than the queue holds)"
                ));
            } else {
                for _ in 0..unsettled {
                    if head >= n {
                        out.ignored
                            .push(format!("last batch lists descriptor {head} of {n}"));
                        break;
                    }
                    self.inflight(head).store(0, Ordering::Relaxed);
                    head = self.next(head).load(Ordering::Relaxed);
                }
            }
            self.u16_at(OFF_USED_IDX)
                .store(ring_used, Ordering::Release);
        }
        let mut taken: Vec<(u64, u16)> = Vec::new();
        for head in 0..n {
            match self.inflight(head).load(Ordering::Acquire) {
                0 => {}
                1 => taken.push((self.counter(head).load(Ordering::Relaxed), head)),
                other => {
                    out.ignored
                        .push(format!("descriptor {head} in state {other}"));
                    self.inflight(head).store(0, Ordering::Relaxed);
                }
            }
        }
        let outstanding = ring_avail.wrapping_sub(ring_used);
        if taken.len() > usize::from(outstanding.min(n)) {
            out.ignored.push(format!(
                "{} requests marked in flight, but the ring has only {outstanding} outstanding",
                taken.len()
            ));
            for (_, head) in taken {
                self.inflight(head).store(0, Ordering::Relaxed);
            }
            return out;
        }
        taken.sort_unstable();
        out.next_avail = ring_used.wrapping_add(taken.len() as u16);
        out.resubmit = taken.into_iter().map(|(_, head)| head).collect();
        out
    }

    /// The counter to give the next request taken: past every counter in
    /// the region.
    pub(crate) fn next_counter(&self) -> u64 {
        (0..self.desc_num())
            .filter(|h| self.inflight(*h).load(Ordering::Relaxed) != 0)
            .map(|h| self.counter(h).load(Ordering::Relaxed))
            .max()
            .map_or(0, |c| c.wrapping_add(1))
    }

    /// Initialises the part: nothing in flight.
    fn reset(&self, ring_used: u16) {
        for head in 0..self.desc_num() {
            self.inflight(head).store(0, Ordering::Relaxed);
        }
        self.u16_at(OFF_DESC_NUM)
            .store(self.desc_num(), Ordering::Relaxed);
        self.u16_at(OFF_LAST_BATCH_HEAD).store(0, Ordering::Relaxed);
        self.u16_at(OFF_USED_IDX)
            .store(ring_used, Ordering::Relaxed);
        self.u16_at(OFF_VERSION).store(VERSION, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(queues: u16, size: u16) -> Arc<InflightRegion> {
        Arc::new(InflightRegion::create(queues, size).unwrap())
    }

    #[test]
    fn sizes_agree_with_libvhost_user() {
        // ALIGN_UP(16 * size + 2, 64) in libvhost-user.
        for size in [1u16, 2, 3, 64, 128, 256, 1024, 32768] {
            let lvu = (16 * usize::from(size) + 2).div_ceil(64) * 64;
            assert_eq!(queue_region_size(size), lvu, "queue size {size}");
        }
        assert_eq!(queue_region_size(128), 2112);
    }

    #[test]
    fn requests_taken_and_not_completed_come_back_in_order() {
        let r = region(2, 8);
        let q = r.queue(1).unwrap();
        assert_eq!(q.recover(0, 0).resubmit, Vec::<u16>::new());
        // Taken: heads 5, 2, 7 (counters 0, 1, 2); 2 completes.
        q.taken(5, 0);
        q.taken(2, 1);
        q.taken(7, 2);
        q.completing(2);
        q.completed(2, 1);
        let again = r.queue(1).unwrap();
        let rec = again.recover(1, 3);
        assert_eq!(rec.resubmit, vec![5, 7]);
        assert_eq!(rec.next_avail, 3);
        assert!(rec.ignored.is_empty());
        assert_eq!(again.next_counter(), 3);
        // Queue 0 is untouched.
        assert!(r.queue(0).unwrap().recover(0, 0).resubmit.is_empty());
    }

    #[test]
    fn a_completion_cut_short_after_the_used_index_is_settled() {
        let r = region(1, 4);
        let q = r.queue(0).unwrap();
        q.recover(0, 0);
        q.taken(1, 0);
        q.taken(3, 1);
        // Head 3 went on the used ring (used index 1) but the backend died
        // before clearing its entry.
        q.completing(3);
        let rec = q.recover(1, 2);
        assert_eq!(rec.resubmit, vec![1]);
        assert_eq!(rec.next_avail, 2);
    }

    #[test]
    fn a_hostile_region_is_refused_or_ignored_without_panicking() {
        assert!(matches!(
            InflightRegion::create(0, 8),
            Err(InflightError::Geometry { .. })
        ));
        let r = region(1, 8);
        let file = r.file().try_clone().unwrap();
        assert!(InflightRegion::open(file.try_clone().unwrap(), 100, 0, 1, 8).is_err());
        assert!(InflightRegion::open(file.try_clone().unwrap(), r.size(), 4096, 1, 8).is_err());
        assert!(InflightRegion::open(file.try_clone().unwrap(), r.size(), 1, 1, 8).is_err());
        let shared = Arc::new(InflightRegion::open(file, r.size(), 0, 1, 8).unwrap());
        let q = r.queue(0).unwrap();
        let other = shared.queue(0).unwrap();
        q.recover(0, 0);
        // Every descriptor claimed, strange states, a batch list that
        // points out of range.
        for h in 0..8 {
            q.taken(h, u64::from(h));
        }
        q.inflight(4).store(9, Ordering::Relaxed);
        q.u16_at(OFF_LAST_BATCH_HEAD).store(999, Ordering::Relaxed);
        let rec = other.recover(1, 3);
        assert!(rec.resubmit.is_empty(), "{rec:?}");
        assert_eq!(rec.next_avail, 1);
        assert!(rec.ignored.len() >= 2, "{rec:?}");
        // Out-of-range heads are ignored by the trackers too.
        q.taken(100, 0);
        q.completing(100);
        q.completed(100, 2);
        // A wrong version or descriptor count: reset, nothing resubmitted.
        q.u16_at(OFF_VERSION).store(7, Ordering::Relaxed);
        assert!(q.recover(0, 5).resubmit.is_empty());
        q.taken(1, 0);
        q.u16_at(OFF_DESC_NUM).store(3, Ordering::Relaxed);
        assert!(q.recover(0, 5).resubmit.is_empty());
        assert!(r.queue(1).is_none());
    }
}
