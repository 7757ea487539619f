//! Bytes read once, which the kernel should not read ahead of: a
//! copy-on-write's source (the part of a cluster a guest write does not
//! cover, read from the layers below, or from the top itself where the
//! cluster's data or compressed copy is there).
//!
//! Through a file's usual descriptor such a read, on a page-cache miss,
//! starts the kernel's readahead, which takes the cached pages before it
//! for a stream and reads on up to the device's `read_ahead_kb` (8 MiB on
//! this project's VMs' disks): over a sparse layer's holes, page after
//! page zero-filled by the writing thread (measured 2026-11-27: engine jobs
//! running 2-4 ms inside a live snapshot's drain, six slow drains in 30
//! snapshots; none with the disk's readahead off). Such reads go through a
//! second open description of the file advised `POSIX_FADV_RANDOM`: the
//! advice belongs to the description, so the guest's reads through the
//! first keep their readahead.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The second descriptors of one chain's lower layers: at most `cap` at
/// once, and only while the chain's descriptors (its open layer files and
/// these) stay within its budget. They take only room the files leave;
/// past it, the file cache closes files. The files and the slots are
/// counted in one word, so that a slot taken while a file is opened is
/// seen by the opening (which then closes another file) or sees the file.
/// Past the budget (a chain longer than it), no slot is taken: the cache
/// is full of files, and copy-on-write reads read ahead as before.
#[derive(Debug)]
pub(crate) struct DescriptorSlots {
    /// Open layer files in the high half, slots taken in the low half.
    counts: AtomicU64,
    cap: u64,
    budget: u64,
}

const FILE: u64 = 1 << 32;
const SLOTS: u64 = FILE - 1;

/// The descriptors a counts word holds: files and slots.
fn descriptors(counts: u64) -> usize {
    ((counts >> 32) + (counts & SLOTS)) as usize
}

impl DescriptorSlots {
    pub(crate) fn new(cap: usize, budget: usize) -> Arc<Self> {
        let limit = |n: usize| (n as u64).min(SLOTS);
        Arc::new(DescriptorSlots {
            counts: AtomicU64::new(0),
            cap: limit(cap),
            budget: limit(budget),
        })
    }

    /// A slot, if fewer than `cap` are taken and the budget has room.
    fn take(self: &Arc<Self>) -> Option<DescriptorSlot> {
        self.counts
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                let (files, used) = (v >> 32, v & SLOTS);
                (used < self.cap && files + used < self.budget).then_some(v + 1)
            })
            .ok()?;
        Some(DescriptorSlot(self.clone()))
    }

    /// Slots taken now.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        (self.counts.load(Ordering::Acquire) & SLOTS) as usize
    }

    /// Counts a layer file opened; returns the descriptors counted now
    /// (files and slots).
    pub(crate) fn file_opened(&self) -> usize {
        descriptors(self.counts.fetch_add(FILE, Ordering::AcqRel) + FILE)
    }

    /// Counts a layer file closed; returns the descriptors counted now.
    pub(crate) fn file_closed(&self) -> usize {
        descriptors(self.counts.fetch_sub(FILE, Ordering::AcqRel) - FILE)
    }

    /// The descriptors counted now (files and slots).
    pub(crate) fn total(&self) -> usize {
        descriptors(self.counts.load(Ordering::Acquire))
    }
}

/// One taken slot, given back when the descriptor it counts is closed.
#[derive(Debug)]
struct DescriptorSlot(Arc<DescriptorSlots>);

impl Drop for DescriptorSlot {
    fn drop(&mut self) {
        self.0.counts.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The second, readahead-free description of one file, opened on first
/// use and closed with its owner.
#[derive(Debug, Default)]
pub(crate) struct OnceReader {
    opened: OnceLock<Opened>,
    /// Opening it failed (no `/proc`, ...): reads use the first
    /// description, and opening is not tried again.
    failed: AtomicBool,
    /// Where its descriptor is counted (`None`: not counted; a chain's
    /// top, whose descriptors are outside the file cache's budget; after
    /// a live snapshot the chain reads it as a lower layer through a
    /// description of the file cache, and this one goes with its writer).
    slots: Option<Arc<DescriptorSlots>>,
}

#[derive(Debug)]
struct Opened {
    file: File,
    _slot: Option<DescriptorSlot>,
}

impl OnceReader {
    /// A reader whose descriptor counts in `slots`; while all are taken,
    /// reads go through the first description.
    pub(crate) fn within(slots: Arc<DescriptorSlots>) -> Self {
        OnceReader {
            slots: Some(slots),
            ..Default::default()
        }
    }

    /// The description to read bytes once from: the second one of `file`,
    /// or `file` itself where none can be had.
    pub(crate) fn file<'a>(&'a self, file: &'a File) -> &'a File {
        if let Some(opened) = self.opened.get() {
            return &opened.file;
        }
        if self.failed.load(Ordering::Relaxed) {
            return file;
        }
        let slot = match &self.slots {
            None => None,
            Some(slots) => match slots.take() {
                Some(slot) => Some(slot),
                None => return file,
            },
        };
        match reopen_without_readahead(file) {
            Ok(second) => {
                let opened = Opened {
                    file: second,
                    _slot: slot,
                };
                // Another thread may have opened one first: then ours (and
                // its slot) goes.
                &self.opened.get_or_init(move || opened).file
            }
            Err(e) => {
                // Out of descriptors or memory for now: tried again on a
                // later read; anything else (no /proc, ...) for good.
                let transient = matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM)
                );
                if !transient && !self.failed.swap(true, Ordering::Relaxed) {
                    tracing::debug!(error = %e, "no readahead-free descriptor; copy-on-write reads read ahead");
                }
                file
            }
        }
    }
}

/// `file` opened again (a new open description of the same inode, through
/// `/proc/self/fd`, so a rename or unlink meanwhile cannot change which
/// file), read-only, advised not to read ahead.
fn reopen_without_readahead(file: &File) -> io::Result<File> {
    // A description of its own (its readahead state apart), of the same
    // file whatever is at its name now.
    let link = std::path::Path::new("/proc/self/fd").join(file.as_raw_fd().to_string());
    let second = crate::sidefile::dir::open_image_file(&link, false)?;
    // SAFETY: posix_fadvise on a descriptor `second` owns; no memory is
    // passed.
    let r = unsafe { libc::posix_fadvise(second.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(second)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn the_second_description_reads_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"abcdef").unwrap();
        let file = File::open(&path).unwrap();
        let reader = OnceReader::default();
        let second = reader.file(&file);
        assert_ne!(second.as_raw_fd(), file.as_raw_fd());
        // Renamed and rewritten through the first: still the same file.
        std::fs::rename(&path, dir.path().join("g")).unwrap();
        std::fs::write(&path, b"zzzzzz").unwrap();
        let mut b = [0u8; 3];
        reader.file(&file).read_exact_at(&mut b, 2).unwrap();
        assert_eq!(&b, b"cde");
        assert_eq!(reader.file(&file).as_raw_fd(), second.as_raw_fd());
    }

    #[test]
    fn second_descriptors_stay_within_their_slots() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").unwrap();
        let files: Vec<File> = (0..3).map(|_| File::open(&path).unwrap()).collect();
        let slots = DescriptorSlots::new(2, 10);
        let readers: Vec<OnceReader> = (0..3).map(|_| OnceReader::within(slots.clone())).collect();
        let got: Vec<bool> = readers
            .iter()
            .zip(&files)
            .map(|(r, f)| r.file(f).as_raw_fd() != f.as_raw_fd())
            .collect();
        assert_eq!(got, [true, true, false]);
        assert_eq!(slots.used(), 2);
        // A closed one gives its slot back; the third then gets one.
        let mut readers = readers;
        readers.remove(0);
        assert_eq!(slots.used(), 1);
        assert_ne!(readers[1].file(&files[2]).as_raw_fd(), files[2].as_raw_fd());
        assert_eq!(slots.used(), 2);
        // No room left by the files: none.
        let slots = DescriptorSlots::new(2, 10);
        for _ in 0..10 {
            slots.file_opened();
        }
        let full = OnceReader::within(slots.clone());
        assert_eq!(full.file(&files[0]).as_raw_fd(), files[0].as_raw_fd());
        assert_eq!(slots.file_closed(), 9);
        let room = OnceReader::within(slots.clone());
        assert_ne!(room.file(&files[0]).as_raw_fd(), files[0].as_raw_fd());
        assert_eq!(slots.used(), 1);
    }
}
