//! A live commit's mirror: what the guest changes on the served chain
//! (writes, write-zeroes, discards) reaches the top of another chain (the
//! commit's base), as the view of the range where the layers from `from`
//! up decide it. Asynchronous first: a change marks its clusters
//! ([`ChangedClusters`]) and completes; the commit's copier copies them
//! later. Then synchronous ([`Mirror::go_synchronous`]): each change
//! copies its own range before it completes, so the copier's remaining
//! work is fixed and the commit ends whatever the guest writes. Copies of
//! a range take the same range locks, so whichever runs last reads the
//! newest view: the target ends equal to the view.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::changed::ChangedClusters;
use super::range_holds::RangeHolds;
use super::{Chain, ExtentKind};
use crate::error::Error;
use crate::types::{GuestOffset, LayerIndex};

/// Where a served chain's changes are copied to.
#[derive(Debug)]
pub(crate) struct Mirror {
    target: Arc<Chain>,
    from: LayerIndex,
    locks: RangeHolds,
    /// The first copy that failed (the guest's request itself succeeded:
    /// the commit fails instead).
    failure: Mutex<Option<String>>,
    /// Bytes the guest's changes had copied into the target.
    written: AtomicU64,
    /// Changes copy their own range (else they mark their clusters).
    synchronous: AtomicBool,
    /// Changes that found the mirror asynchronous and have not marked
    /// their clusters yet.
    marking: AtomicUsize,
    changed: ChangedClusters,
    /// Bytes per bit of `changed`.
    granule: u64,
}

/// Bytes per bit of a mirror's change map: 4 KiB (a guest's usual write,
/// so that the copier copies what changed, not whole clusters), larger
/// for disks over 256 GiB (at most 8 MiB of bits).
fn granule_for(size: u64) -> u64 {
    size.div_ceil(1 << 26).next_power_of_two().max(4096)
}

/// A write the caller moves itself (io_uring, [`crate::Transfers`])
/// into the top while a live commit mirrors it: hold it until the data is
/// written; dropping it marks the range changed for the commit's copier
/// (which cannot go synchronous until every mark is dropped).
#[must_use = "drop it once the data is written, not before"]
#[derive(Debug)]
pub(crate) struct ChangeMark {
    mirror: Arc<Mirror>,
    offset: u64,
    len: u64,
}

impl Drop for ChangeMark {
    fn drop(&mut self) {
        self.mirror.mark(self.offset, self.len);
        self.mirror.marking.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What one copy of a range wrote.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RangeCopied {
    /// Guest bytes written with data.
    pub data_bytes: u64,
    /// Guest bytes written as zeros.
    pub zero_bytes: u64,
}

impl Mirror {
    /// An asynchronous mirror of a chain of `size` guest bytes.
    pub(crate) fn new(target: Arc<Chain>, from: LayerIndex, size: u64) -> Mirror {
        let granule = granule_for(size);
        Mirror {
            target,
            from,
            locks: RangeHolds::default(),
            failure: Mutex::new(None),
            written: AtomicU64::new(0),
            synchronous: AtomicBool::new(false),
            marking: AtomicUsize::new(0),
            changed: ChangedClusters::new(size.div_ceil(granule)),
            granule,
        }
    }

    /// From now on each change copies its own range (and no in-place
    /// write is allowed); returns once every change that marks instead
    /// has marked (in-place writes in flight included: what is marked
    /// then is all the copier has left to do).
    pub(crate) fn go_synchronous(&self) {
        self.synchronous.store(true, Ordering::SeqCst);
        while self.marking.load(Ordering::SeqCst) > 0 {
            std::thread::yield_now();
        }
    }

    fn mark(&self, offset: u64, len: u64) {
        if len > 0 {
            let g = self.granule;
            self.changed.mark(offset / g, (offset + len - 1) / g);
        }
    }

    /// For an in-place write of `[offset, offset + len)`: its mark while
    /// the mirror is asynchronous; `None` once synchronous (the write
    /// must go through [`Chain::write_at`], which copies it).
    pub(crate) fn begin_in_place(self: &Arc<Self>, offset: u64, len: u64) -> Option<ChangeMark> {
        // Counted before the mode is read, as in `after_change`.
        self.marking.fetch_add(1, Ordering::SeqCst);
        if self.synchronous.load(Ordering::SeqCst) {
            self.marking.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(ChangeMark {
            mirror: self.clone(),
            offset,
            len,
        })
    }

    /// Bytes changed and not copied yet.
    pub(crate) fn changed_bytes(&self) -> u64 {
        self.changed.count() * self.granule
    }

    /// Copies what changed since the last call (at most `max_bytes` at
    /// once), calling `pace(bytes written)` after each run; `Ok(false)`
    /// when `pace` said stop.
    pub(crate) fn copy_changed(
        &self,
        source: &Chain,
        max_bytes: u64,
        pace: &mut dyn FnMut(u64) -> bool,
    ) -> Result<bool, Error> {
        let max_run = (max_bytes / self.granule).max(1);
        let mut buf = Vec::new();
        let cs = self.granule;
        let size = source.virtual_size();
        self.changed.take(max_run, &mut |first, n| {
            let start = first * cs;
            let len = (n * cs).min(size - start);
            let c = self.copy_range(source, start, len, &mut buf)?;
            let bytes = c.data_bytes + c.zero_bytes;
            self.written.fetch_add(bytes, Ordering::Relaxed);
            Ok(pace(bytes))
        })
    }

    /// Copies the view of `source` over `[offset, offset + len)` into the
    /// target where layers from `from` up decide it (data as data, zeros
    /// as zeros; what lower layers decide the target reads already),
    /// holding the range meanwhile.
    pub(crate) fn copy_range(
        &self,
        source: &Chain,
        offset: u64,
        len: u64,
        buf: &mut Vec<u8>,
    ) -> Result<RangeCopied, Error> {
        let end = offset + len;
        // Held across the read and the write, on purpose: a copy of the
        // same range must not read the view before this one has written
        // it (the newest view is written last). Only overlapping copies
        // wait; the locks' own mutex is never held across I/O.
        let _held = self.locks.lock_exclusive(offset, end);
        let mut copied = RangeCopied::default();
        let mut pos = offset;
        while pos < end {
            let e = source.resolve(GuestOffset(pos), end - pos, false)?;
            let n = e.len.min(end - pos);
            if e.layer.0 >= self.from.0 {
                match e.kind {
                    ExtentKind::Data { .. } | ExtentKind::Compressed(_) => {
                        buf.resize(n as usize, 0);
                        source.read_at(&mut buf[..n as usize], pos)?;
                        self.target.write_at(&buf[..n as usize], pos)?;
                        copied.data_bytes += n;
                    }
                    ExtentKind::Zero { .. } => {
                        self.target.write_zeroes(pos, n, false)?;
                        copied.zero_bytes += n;
                    }
                }
            }
            pos += n;
        }
        Ok(copied)
    }

    /// After the guest changed `[offset, offset + len)` of `source`: the
    /// range copied; a failure is kept for the commit, not returned.
    pub(crate) fn after_change(&self, source: &Chain, offset: u64, len: u64) {
        if self.failed() || len == 0 {
            return;
        }
        // Counted before the mode is read: `go_synchronous` waits for a
        // change that read "asynchronous" until its clusters are marked.
        self.marking.fetch_add(1, Ordering::SeqCst);
        if !self.synchronous.load(Ordering::SeqCst) {
            self.mark(offset, len);
            self.marking.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        self.marking.fetch_sub(1, Ordering::SeqCst);
        let mut buf = Vec::new();
        match self.copy_range(source, offset, len, &mut buf) {
            Ok(c) => {
                self.written
                    .fetch_add(c.data_bytes + c.zero_bytes, Ordering::Relaxed);
            }
            Err(e) => self.fail(format!("mirroring a guest write at {offset}: {e}")),
        }
    }

    pub(crate) fn fail(&self, why: String) {
        let mut f = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        if f.is_none() {
            tracing::warn!(error = %why, "live commit: the mirror failed");
            *f = Some(why);
        }
    }

    pub(crate) fn failed(&self) -> bool {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    pub(crate) fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Bytes the guest's changes made the mirror write.
    pub(crate) fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }
}

impl Chain {
    /// Guest changes from now on are mirrored into `mirror`'s target
    /// (call with no request in flight: a change under way now would not
    /// be). In-place transfers carry a [`ChangeMark`] while the mirror is
    /// asynchronous and stop once it is synchronous.
    pub(crate) fn start_mirror(&self, mirror: Arc<Mirror>) {
        self.mirror.store(Some(mirror));
    }

    /// Guest changes are no longer mirrored.
    pub(crate) fn stop_mirror(&self) {
        self.mirror.store(None);
    }

    /// The mark an in-place write of `[offset, offset + len)` must hold:
    /// `Ok(None)` without a mirror, `Err(())` when the mirror wants the
    /// write through [`Chain::write_at`].
    pub(super) fn in_place_mark(&self, offset: u64, len: u64) -> Result<Option<ChangeMark>, ()> {
        match self.mirror.load_full() {
            None => Ok(None),
            Some(m) => m.begin_in_place(offset, len).map(Some).ok_or(()),
        }
    }

    /// After a flush: a live commit's base flushed too, so that what the
    /// guest flushed stays durable once the base is served in its place
    /// (a failure fails the commit, not the flush: the top has it all).
    pub(super) fn flush_mirror(&self) {
        if let Some(m) = self.mirror.load_full() {
            if let Err(e) = m.target.flush() {
                m.fail(format!("flushing the base: {e}"));
            }
        }
    }

    /// Whether a live commit's mirror runs.
    pub(crate) fn mirroring(&self) -> bool {
        self.mirror.load().is_some()
    }

    /// Mirrors a change the guest made (no-op without a mirror).
    pub(super) fn mirror_change(&self, offset: u64, len: u64) {
        if self.check_range(offset, len).is_err() {
            return; // refused: nothing changed
        }
        if let Some(m) = self.mirror.load_full() {
            m.after_change(self, offset, len);
        }
    }
}
