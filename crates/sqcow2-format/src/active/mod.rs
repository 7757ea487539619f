//! The active volume (top layer) opened for writing.
//!
//! Its metadata ([`state::ActiveState`]) lives behind one `RwLock`:
//! lookups take it shared, changes exclusively, and no data moves while it
//! is held. A write that needs a new mapping plans it under the lock
//! (claiming the guest cluster and allocating the host cluster), writes the
//! data with no lock held, and commits the mapping under the lock again;
//! other changes to the same guest cluster wait for the claim. A flush
//! copies what waits to be written under the lock and writes it outside
//! (see [`flush`]); released clusters become allocatable only once every
//! transfer that may still use them has ended (the transfer fence), which
//! nothing waits for: a flush applies the releases whose transfers are
//! done and leaves the others to a later flush.
//!
//! A panic while the lock is held (a bug) poisons it: from then on writes,
//! discards and flushes fail with [`ErrorKind::EngineFailed`] and nothing is
//! written back, so the image stays as the last flush left it; reads go on.

mod bitmaps;
mod claim;
mod flush;
mod held_table;
pub(crate) mod journal;
mod moved;
mod open;
mod overlap;
mod plan;
mod spares;
mod state;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::compressed::read_compressed_cluster;
use crate::entry::CompressedDescriptor;
use crate::error::{Error, ErrorKind};
use crate::features::{AUTOCLEAR_JOURNAL, INCOMPAT_DIRTY};
use crate::fence::TransferFence;
use crate::layer::LayerStatus;
use crate::refcount::reserve_clusters;
use crate::storage::ReadPattern;
use crate::types::{GuestOffset, HostOffset};

use flush::Durability;
pub(crate) use open::{end_journal, pending_journal, replay_journal, CacheLink};
pub(crate) use plan::{Allocation, Zeroing};
use plan::{AllocationKind, NewClusterOrigin, WritePlan, ZeroOutcome, ALL_ALLOC};
use spares::Spares;
use state::{ActiveState, InPlace, Residency, TopFile};

/// The guest view of the layers below the top, which does not change
/// while the chain is open.
pub(crate) trait Below {
    /// Reads `buf.len()` bytes at `at`.
    fn read(&self, buf: &mut [u8], at: GuestOffset) -> Result<(), Error>;
    /// Whether `[at, at + len)` reads as zeros, from the mappings alone
    /// (`false` wherever data is stored, even zeros).
    fn reads_as_zeros(&self, at: GuestOffset, len: u64) -> Result<bool, Error>;
}

/// Told which guest range's mapping changed, under the metadata lock (so
/// that no cached view of the old mapping outlives the change).
pub(crate) type MappingChanged<'a> = dyn Fn(GuestOffset, u64) + 'a;

/// The writable top.
#[derive(Debug)]
pub(crate) struct Active {
    top: Arc<TopFile>,
    state: RwLock<ActiveState>,
    /// Flushes (and early write-backs) run one at a time. Held across
    /// their I/O on purpose: one flush's ordered steps must not interleave
    /// with another's.
    flush_order: Mutex<()>,
    /// Why the engine refuses writes, once it does.
    failure: OnceLock<String>,
    /// The top file's length as last seen; it only grows while open
    /// (clusters are reserved before use), so a cluster below it exists.
    known_len: AtomicU64,
    /// The last mapping change that was not journaled (0: none): it is
    /// safe from a process death only once a write-back covers it.
    unjournaled: AtomicU64,
    /// Every mapping change up to this one is in the file: the horizon of
    /// the last write-back that completed.
    published: AtomicU64,
    /// The change count when [`Active::close`] ended the journal (`MAX`:
    /// it did not, or it was started again).
    journal_stopped_at: AtomicU64,
    /// Held by whoever makes spares, and by a close (which must not see
    /// spares appear while it gives them back).
    spare_maker: Mutex<()>,
    /// A checkpoint could not be noted in the journal, which must end.
    journal_broken: AtomicBool,
    /// Early write-backs are the caller's ([`Active::take_write_back_due`])
    /// unless far over the share.
    background_write_back: bool,
    /// An early write-back is due and left to the caller.
    write_back_due: AtomicBool,
    /// A refill of the spares was asked of a caller that may write
    /// ([`Active::link_moved`]) and has not run yet.
    refill_asked: AtomicBool,
    /// When this top was opened, the origin of `last_flush_ms`.
    opened: Instant,
    /// When the last flush began, in ms since `opened` plus one (0: none
    /// yet).
    last_flush_ms: AtomicU64,
    /// Made durable before any of the top's tables is written.
    durable_first: Mutex<Option<Arc<dyn DurableFirst>>>,
    /// The top's persistent dirty bitmaps.
    bitmaps: crate::bitmaps::kept::KeptBitmaps,
}

/// What must be durable before the top's tables may reach its file: a
/// live commit's base holding the data of clusters the top let go of
/// (their unmapping must not outlive a power loss that the copy does not).
pub(crate) trait DurableFirst: Send + Sync + std::fmt::Debug {
    fn make_durable(&self) -> Result<(), Error>;
}

/// A top flushed within this long is written back in the background as
/// its changed pages pile up ([`Residency::ManyChanged`]), so that its
/// next flush has little left; one that is not flushed is not (a
/// background write-back costs a sync, which nobody waits for then).
/// Long enough to cover a guest filesystem's periodic commits (ext4:
/// every 5 s).
const FLUSHED_LATELY: Duration = Duration::from_secs(10);

impl Active {
    fn with(
        top: Arc<TopFile>,
        state: ActiveState,
        len: u64,
        bitmaps: crate::bitmaps::kept::KeptBitmaps,
    ) -> Self {
        Active {
            top,
            state: RwLock::new(state),
            flush_order: Mutex::new(()),
            failure: OnceLock::new(),
            known_len: AtomicU64::new(len),
            unjournaled: AtomicU64::new(0),
            published: AtomicU64::new(0),
            journal_stopped_at: AtomicU64::new(u64::MAX),
            spare_maker: Mutex::new(()),
            journal_broken: AtomicBool::new(false),
            background_write_back: false,
            write_back_due: AtomicBool::new(false),
            refill_asked: AtomicBool::new(false),
            opened: Instant::now(),
            last_flush_ms: AtomicU64::new(0),
            durable_first: Mutex::new(None),
            bitmaps,
        }
    }

    /// From now on every write-back of the top's tables makes `first`
    /// durable before it (`None`: no longer).
    pub(crate) fn set_durable_first(&self, first: Option<Arc<dyn DurableFirst>>) {
        *self
            .durable_first
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = first;
    }

    /// Writes `wb` out, after what must be durable first.
    fn write_out(
        &self,
        wb: &flush::WriteBack,
        incompatible: u64,
        l1_offset: u64,
        durability: Durability,
    ) -> Result<(), Error> {
        if !wb.is_empty() {
            let first = self
                .durable_first
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            if let Some(first) = first {
                first.make_durable()?;
            }
        }
        self.top.write_out(wb, incompatible, l1_offset, durability)
    }

    /// Leaves early write-backs to the caller (see
    /// [`crate::ChainOptions::background_write_back`]).
    pub(crate) fn with_background_write_back(self, on: bool) -> Self {
        Active {
            background_write_back: on,
            ..self
        }
    }

    /// Whether an early write-back was left to the caller since it last
    /// asked (it is then the caller's to run: [`Active::publish`]).
    pub(crate) fn take_write_back_due(&self) -> bool {
        self.write_back_due.swap(false, Ordering::AcqRel)
    }

    /// What a write that changed mappings does about the tables under
    /// change once they are `over` their share of the cache, or many of
    /// their pages changed (then only where a caller writes back in the
    /// background: elsewhere the next flush or publish writes them).
    fn after_settle(&self, over: Residency) {
        match over {
            Residency::Within => {}
            Residency::ManyChanged => {
                if self.background_write_back && self.flushed_lately() {
                    self.write_back_due.store(true, Ordering::Release);
                }
            }
            Residency::Over if self.background_write_back => {
                self.write_back_due.store(true, Ordering::Release);
            }
            Residency::Over | Residency::FarOver => self.write_back_early(),
        }
    }

    /// Whether a flush began within [`FLUSHED_LATELY`].
    fn flushed_lately(&self) -> bool {
        match self.last_flush_ms.load(Ordering::Relaxed) {
            0 => false,
            at => {
                let now = self.opened.elapsed().as_millis() as u64 + 1;
                now.saturating_sub(at) <= FLUSHED_LATELY.as_millis() as u64
            }
        }
    }

    /// Whether some completed change is neither journaled nor written to
    /// the file yet: a [`Active::publish`] is needed before a process
    /// death could not lose it. Cheap (two atomics), for a caller about
    /// to complete a request.
    pub(crate) fn needs_publish(&self) -> bool {
        self.unjournaled.load(Ordering::Acquire) > self.published.load(Ordering::Acquire)
    }

    /// Whether changed mappings whose claims have ended are safe from a
    /// process death: read with the metadata lock held (`st`), so that a
    /// claim seen ended was settled before (see [`state::Settled`]).
    fn settled(&self, st: &ActiveState) -> state::Settled {
        if st.journal.is_some() && !self.needs_publish() {
            state::Settled::Journaled
        } else {
            state::Settled::Unknown
        }
    }

    /// Journal records not covered by a checkpoint yet.
    pub(crate) fn journal_backlog(&self) -> u64 {
        self.read_state()
            .journal
            .as_ref()
            .map_or(0, |j| j.backlog())
    }

    /// Whether changes are journaled now.
    pub(crate) fn journaled(&self) -> bool {
        self.read_state().journal.is_some()
    }

    /// Makes change `change` (and its records, if reserved) safe from a
    /// process death as far as the journal goes: writes the records, or
    /// notes the change as unjournaled.
    fn settle_change(&self, change: u64, records: Option<journal::Reservation>) {
        let written = match records {
            Some(r) => match r.write() {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "writing to the journal failed: the change is published instead");
                    false
                }
            },
            None => false,
        };
        if !written {
            self.unjournaled.fetch_max(change, Ordering::AcqRel);
        }
    }

    /// A write-back covering mapping changes up to `wb`'s horizon is
    /// written.
    fn write_back_done(&self, wb: &flush::WriteBack) {
        if let Err(e) = wb.cover_journal() {
            tracing::warn!(error = %e, "could not note a checkpoint in the journal");
            self.journal_broken.store(true, Ordering::Release);
        }
        self.published.fetch_max(wb.horizon(), Ordering::AcqRel);
    }

    /// Ends a journal a write-back could not note a checkpoint in (call
    /// with the flush order held).
    fn after_write_back(&self) {
        if self.journal_broken.swap(false, Ordering::AcqRel) {
            self.abandon_journal();
        }
    }

    /// Shared access for lookups. A poisoned lock still serves reads (the
    /// engine refuses writes from then on).
    fn read_state(&self) -> RwLockReadGuard<'_, ActiveState> {
        self.state.read().unwrap_or_else(|p| {
            self.fail("a panic interrupted a metadata update");
            p.into_inner()
        })
    }

    /// Exclusive access for a change; fails once the engine has failed.
    fn write_state(&self) -> Result<RwLockWriteGuard<'_, ActiveState>, Error> {
        self.check_failed()?;
        self.lock_unpoisoned()
    }

    /// [`Active::write_state`] if no one holds the lock now (`None`).
    fn try_write_state(&self) -> Result<Option<RwLockWriteGuard<'_, ActiveState>>, Error> {
        self.check_failed()?;
        match self.state.try_write() {
            Ok(st) => Ok(Some(st)),
            Err(std::sync::TryLockError::WouldBlock) => Ok(None),
            // Poisoned: refused as `write_state` refuses it.
            Err(std::sync::TryLockError::Poisoned(_)) => self.lock_unpoisoned().map(Some),
        }
    }

    /// The exclusive lock, unless a panic poisoned it (the engine fails).
    fn lock_unpoisoned(&self) -> Result<RwLockWriteGuard<'_, ActiveState>, Error> {
        self.state.write().map_err(|_| {
            const POISONED: &str = "a panic interrupted a metadata update";
            self.fail(POISONED);
            self.top.err(ErrorKind::EngineFailed {
                reason: POISONED.to_string(),
            })
        })
    }

    /// Exclusive access for a write-back or a close: refused once the
    /// engine has failed, but not once it is superseded (its tables are
    /// still written back and the image closed, by the chain that follows
    /// a live snapshot).
    fn write_back_state(&self) -> Result<RwLockWriteGuard<'_, ActiveState>, Error> {
        self.check_write_back()?;
        self.lock_unpoisoned()
    }

    /// Fails once the engine has failed, unless it is only superseded.
    fn check_write_back(&self) -> Result<(), Error> {
        if self.superseded() {
            return Ok(());
        }
        self.check_failed()
    }

    /// Exclusive access to give back a claim, whatever happened before.
    fn write_state_anyway(&self) -> RwLockWriteGuard<'_, ActiveState> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Refuses writes from now on (until the image is reopened), because
    /// the metadata in memory may be inconsistent: `reason` says why.
    pub(crate) fn fail(&self, reason: &str) {
        if self.failure.set(reason.to_string()).is_ok() {
            tracing::error!(
                path = %self.top.path.display(),
                reason,
                "refusing writes until the image is reopened"
            );
        }
    }

    /// Refuses changes from now on, quietly: the image is a backing layer
    /// of the chain a live snapshot made ([`crate::Handover::successor`]),
    /// which reads the tables held here until
    /// [`crate::Handover::retire`] has written them back and closed the
    /// image (or, if that failed, writes them back at its flushes until
    /// [`crate::Handover::close_unclosed_below`] closes it; a process death
    /// first leaves it to the next read-write open, which repairs it).
    /// Write-backs and the close still run.
    pub(crate) fn supersede(&self) {
        let _ = self.failure.set(SUPERSEDED.to_string());
    }

    /// Refuses changes from now on, quietly: another chain of the same
    /// files took over the image (a merge's switch), so nothing held here
    /// is written back again, and closing does nothing.
    pub(crate) fn hand_over(&self) {
        let _ = self.failure.set(HANDED_OVER.to_string());
    }

    /// Whether [`Active::supersede`] ended this engine (its tables may
    /// still be written back, by the chain after it).
    pub(crate) fn superseded(&self) -> bool {
        self.failure() == Some(SUPERSEDED)
    }

    /// Whether this engine ended without a failure: superseded, or handed
    /// over ([`Active::hand_over`]: nothing written back any more).
    pub(crate) fn ended_quietly(&self) -> bool {
        matches!(self.failure(), Some(SUPERSEDED | HANDED_OVER))
    }

    /// Why writes are refused, if they are.
    pub(crate) fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    /// Fails the engine on corruption found on the way (a mapping that
    /// points at metadata): nothing more is written to the image.
    fn on_error(&self, e: Error) -> Error {
        if matches!(e.kind, ErrorKind::MetadataOverlap { .. }) {
            self.fail(&e.to_string());
        }
        e
    }

    pub(crate) fn check_failed(&self) -> Result<(), Error> {
        match self.failure.get() {
            Some(reason) => Err(self.top.err(ErrorKind::EngineFailed {
                reason: reason.clone(),
            })),
            None => Ok(()),
        }
    }

    /// The top file this engine writes.
    pub(crate) fn storage(&self) -> &Arc<dyn crate::storage::Storage> {
        &self.top.storage
    }

    /// The path the top was opened by.
    pub(crate) fn path(&self) -> &std::path::Path {
        &self.top.path
    }

    /// Test hooks.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn faults(&self) -> &crate::fault::Faults {
        &self.top.faults
    }

    /// Virtual size of the disk.
    pub(crate) fn size(&self) -> u64 {
        self.read_state().size()
    }

    /// Grows the disk to `size` bytes (more than now), the L1 table moved
    /// first where it does not address them in its clusters
    /// ([`Active::move_l1_locked`]): the header written and synced, then
    /// the table in memory extended ([`crate::resize`]). Bitmaps are
    /// grown with it (QEMU's way): marked in use in the image before the
    /// size changes (a crash leaves them inconsistent, never a consistent
    /// one too small for the disk), then resized in memory: the caller
    /// stores them (a close) before anything else reads the image.
    pub(crate) fn grow(&self, size: u64) -> Result<(), Error> {
        self.check_failed()?;
        // Both held across the header's writes and syncs on purpose: no
        // write-back rewrites the header meanwhile, and no request sees
        // the new size before it is durable. (A resize runs offline or
        // with the device paused: nothing waits for them.)
        let _order = self
            .flush_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let bitmaps = !self.bitmaps.is_empty();
        if bitmaps {
            self.bitmaps
                .check_resizable()
                .map_err(|k| self.top.err(k))?;
            self.bitmaps_in_use_locked()?;
        }
        let l1_move = crate::resize::plan_l1_move(&self.read_state().header, size)
            .map_err(|k| self.top.err(k))?;
        if let Some(entries) = l1_move {
            self.move_l1_locked(entries)?;
        }
        {
            let mut st = self.write_state()?;
            let l1_size = crate::resize::grow_in_place(&*self.top.storage, &st.header, size)
                .map_err(|k| self.top.err(k))?;
            st.header.size = size;
            st.header.l1_size = l1_size;
            st.l1.resize(l1_size as usize, 0);
        }
        if bitmaps {
            self.bitmaps.resize(size).map_err(|k| self.top.err(k))?;
        }
        Ok(())
    }

    /// Moves the L1 table to new clusters that hold `entries` entries
    /// (a grow past what it addresses where it is; QEMU's
    /// `qcow2_grow_l1_table`). Call with the flush order held and nothing
    /// else changing the top (offline, or the device paused). Crash order
    /// as offline (`resize/l1.rs`): every change written back and synced
    /// first (the table in the file is the one in memory), the new
    /// clusters counted durably, the table written and synced, the
    /// header's adjacent L1 size and offset switched in one synced write;
    /// the old clusters freed and their counts written: a crash leaves
    /// the old table or the new one named, at worst leaked clusters.
    fn move_l1_locked(&self, entries: u64) -> Result<(), Error> {
        self.write_back(Durability::Durable)?;
        let top = &self.top;
        let g = top.geometry;
        let cs = g.cluster_size();
        let clusters = (entries * 8).div_ceil(cs);
        let storage = &*top.storage;
        let io = |e: std::io::Error| top.io(e);
        // Held across the writes and syncs on purpose: as `grow` holds
        // it, with nothing waiting for it.
        let mut st = self.write_state()?;
        let first = crate::refcount::contiguous_run(
            &mut *st,
            clusters,
            |st| st.alloc(true),
            |st, c| st.unalloc(c),
        )?;
        for c in first..first + clusters {
            st.metadata.insert(c);
        }
        let rc = st.refcounts.dirty_snapshot();
        if let Err(e) = top.write_refcounts(&rc) {
            st.refcounts.restore(&rc);
            return Err(e);
        }
        st.refcounts_written(&rc);
        top.sync()?;
        let mut table = vec![0u8; (clusters * cs) as usize];
        for (slot, entry) in table.chunks_exact_mut(8).zip(&st.l1) {
            slot.copy_from_slice(&entry.to_be_bytes());
        }
        let at = first << g.cluster_bits;
        storage.write_at(&table, at).map_err(io)?;
        top.sync()?;
        let entries32 = u32::try_from(entries).map_err(|_| {
            top.err(ErrorKind::SizeTooLarge(
                entries.saturating_mul(g.l2_coverage()),
            ))
        })?;
        let mut fields = [0u8; 12];
        fields[..4].copy_from_slice(&entries32.to_be_bytes());
        fields[4..].copy_from_slice(&at.to_be_bytes());
        storage
            .write_at(&fields, crate::header::field::L1_SIZE as u64)
            .map_err(io)?;
        top.sync()?;
        let (old, old_len) = (st.header.l1_table_offset, u64::from(st.header.l1_size) * 8);
        st.header.l1_table_offset = at;
        st.header.l1_size = entries32;
        st.l1.resize(entries as usize, 0);
        if old != 0 {
            // Nothing reads the old table any more (the L1 lives in
            // memory, and the header names the new one).
            let first_old = old >> g.cluster_bits;
            for c in first_old..first_old + old_len.div_ceil(cs) {
                st.metadata.remove(c);
                st.unalloc(c);
            }
            // Counted now: a write-back with no table to write would not.
            let rc = st.refcounts.dirty_snapshot();
            if let Err(e) = top.write_refcounts(&rc) {
                st.refcounts.restore(&rc);
                return Err(e);
            }
            st.refcounts_written(&rc);
        }
        Ok(())
    }

    /// Whether the top decides any byte of the cluster at `guest` (its
    /// entry maps data, zeros or a compressed cluster).
    pub(crate) fn decides(&self, guest: GuestOffset) -> Result<bool, Error> {
        Ok(self
            .read_state()
            .raw_entry(guest)?
            .is_some_and(|(entry, bitmap)| entry != 0 || bitmap != 0))
    }

    /// The mapping of `[guest, guest + max)` in the top.
    pub(crate) fn status(&self, guest: GuestOffset, max: u64) -> Result<(LayerStatus, u64), Error> {
        self.read_state().status(guest, max)
    }

    /// Where a write of `len` bytes at `guest` (within one cluster) may go
    /// straight to the top's file: the host offset, or `None` when the
    /// write needs the engine. The caller holds a transfer ticket taken
    /// before this call, until its write has finished.
    pub(crate) fn in_place_target(
        &self,
        guest: GuestOffset,
        len: u64,
    ) -> Result<Option<HostOffset>, Error> {
        self.check_failed()?;
        let known = self.known_len.load(Ordering::Relaxed);
        {
            let st = self.read_state();
            match st.peek_in_place(guest, len, known, self.settled(&st))? {
                InPlace::At(host) => return Ok(Some(host)),
                InPlace::No => return Ok(None),
                InPlace::Unknown => {}
            }
        }
        let len_now = self.top.storage.len().map_err(|e| self.top.io(e))?;
        self.known_len.fetch_max(len_now, Ordering::Relaxed);
        let mut st = self.write_state()?;
        st.load_for_in_place(guest)?;
        let settled = self.settled(&st);
        Ok(match st.peek_in_place(guest, len, len_now, settled)? {
            InPlace::At(host) => Some(host),
            InPlace::No | InPlace::Unknown => None,
        })
    }

    /// Writes `data` at `guest` (within one cluster). The caller holds a
    /// transfer ticket (for the in-place case).
    pub(crate) fn write_cluster(
        &self,
        data: &[u8],
        guest: GuestOffset,
        below: &dyn Below,
        changed: &MappingChanged,
    ) -> Result<(), Error> {
        loop {
            let plan = self
                .write_state()?
                .plan_write(guest, data.len() as u64)
                .map_err(|e| self.on_error(e))?;
            match plan {
                WritePlan::InPlace(host) => {
                    return self
                        .top
                        .storage
                        .write_at(data, host.0)
                        .map_err(|e| self.top.io(e));
                }
                WritePlan::Wait(cell) => cell.wait(),
                WritePlan::Allocate(alloc) => {
                    let claim = Claim {
                        active: self,
                        alloc,
                        stage: ClaimStage::Claimed,
                    };
                    let filled = self.fill(&claim.alloc, data, guest, below)?;
                    claim.commit(filled, changed)?;
                    self.refill_spares();
                    return Ok(());
                }
            }
        }
    }

    /// Writes the data of an allocation (no lock held).
    fn fill(
        &self,
        alloc: &Allocation,
        data: &[u8],
        guest: GuestOffset,
        below: &dyn Below,
    ) -> Result<Filled, Error> {
        let top = &self.top;
        let g = top.geometry;
        let storage = &*top.storage;
        let cluster_size = g.cluster_size();
        let in_cluster = guest.0 - alloc.start.0;
        let io = |e| top.io(e);
        match alloc.kind {
            AllocationKind::NewCluster { new, origin, .. } => {
                let spare = origin == NewClusterOrigin::Spare;
                if !spare {
                    reserve_clusters(storage, g.cluster_bits, g.host_cluster(new), 1)
                        .map_err(|k| top.err(k))?;
                    self.known_len
                        .fetch_max(new.0 + cluster_size, Ordering::Relaxed);
                }
                let reads_zeros = origin != NewClusterOrigin::Reused;
                let mut zeros_before = self.view_is_zero(below, alloc.start, cluster_size)?;
                if zeros_before {
                    // Nothing to copy: the guest's bytes, zeros around them.
                    if !reads_zeros {
                        storage.write_zeroes(new.0, cluster_size).map_err(io)?;
                    }
                    storage.write_at(data, new.0 + in_cluster).map_err(io)?;
                } else {
                    let mut full = vec![0u8; cluster_size as usize];
                    if data.len() as u64 != cluster_size {
                        self.read_view(below, &mut full, alloc.start)?;
                        // Stored data can be zeros too.
                        zeros_before = spare && crate::bytes::is_zero(&full);
                    }
                    full[in_cluster as usize..in_cluster as usize + data.len()]
                        .copy_from_slice(data);
                    write_sparse(storage, new, &full, reads_zeros).map_err(io)?;
                }
                Ok(Filled {
                    bitmap: if g.extended_l2 { ALL_ALLOC } else { 0 },
                    // A spare over zeros: any part of the data a power
                    // loss drops reads as the zeros the guest saw before.
                    needs_sync: !(spare && zeros_before),
                })
            }
            AllocationKind::FillZero { host } => {
                let mut full = vec![0u8; cluster_size as usize];
                full[in_cluster as usize..in_cluster as usize + data.len()].copy_from_slice(data);
                storage.write_at(&full, host.0).map_err(io)?;
                Ok(Filled {
                    bitmap: 0,
                    needs_sync: true,
                })
            }
            AllocationKind::Subclusters { host, bitmap } => {
                let sc_size = g.subcluster_size();
                let first = in_cluster / sc_size;
                let last = (in_cluster + data.len() as u64 - 1) / sc_size;
                let mut new_bitmap = bitmap;
                for sc in first..=last {
                    let sc_start = sc * sc_size;
                    let lo = in_cluster.max(sc_start);
                    let hi = (in_cluster + data.len() as u64).min(sc_start + sc_size);
                    let part = &data[(lo - in_cluster) as usize..(hi - in_cluster) as usize];
                    if bitmap & (1 << sc) != 0 {
                        // Allocated: write only the new bytes, never rewrite
                        // bytes a concurrent in-place write may be changing.
                        storage.write_at(part, host.0 + lo).map_err(io)?;
                    } else {
                        let mut buf = vec![0u8; sc_size as usize];
                        if bitmap & (1 << (sc + 32)) == 0 {
                            self.read_view(below, &mut buf, alloc.start + sc_start)?;
                        }
                        buf[(lo - sc_start) as usize..(hi - sc_start) as usize]
                            .copy_from_slice(part);
                        storage.write_at(&buf, host.0 + sc_start).map_err(io)?;
                    }
                    new_bitmap = (new_bitmap | (1 << sc)) & !(1 << (sc + 32));
                }
                Ok(Filled {
                    bitmap: new_bitmap,
                    needs_sync: true,
                })
            }
        }
    }

    /// Reads the guest view of `[guest, guest + buf.len())`, which lies in
    /// one claimed cluster (whose mapping therefore cannot change), through
    /// the top and the layers below.
    fn read_view(
        &self,
        below: &dyn Below,
        buf: &mut [u8],
        guest: GuestOffset,
    ) -> Result<(), Error> {
        let top = &self.top;
        let size = self.size();
        let mut pos = 0usize;
        while pos < buf.len() {
            let at = guest + pos as u64;
            if at.0 >= size {
                buf[pos..].fill(0);
                break;
            }
            let want = ((buf.len() - pos) as u64).min(size - at.0);
            let (st, n) = self.status(at, want)?;
            let out = &mut buf[pos..pos + n as usize];
            match st {
                LayerStatus::Data { host } => top
                    .storage
                    .read_once_at(out, host.0)
                    .map_err(|e| top.io(e))?,
                LayerStatus::Zero { .. } => out.fill(0),
                LayerStatus::Unallocated { .. } => below.read(out, at)?,
                LayerStatus::Compressed(d) => {
                    let cluster = self.decompress_own(d)?;
                    let from = top.geometry.offset_in_cluster(at.0) as usize;
                    out.copy_from_slice(&cluster[from..from + out.len()]);
                }
            }
            pos += n as usize;
        }
        Ok(())
    }

    /// Whether the guest view of `[guest, guest + len)` (in one claimed
    /// cluster) reads as zeros, from the mappings alone.
    fn view_is_zero(&self, below: &dyn Below, guest: GuestOffset, len: u64) -> Result<bool, Error> {
        let size = self.size();
        let end = guest.0 + len;
        let mut at = guest;
        while at.0 < end.min(size) {
            let (st, n) = self.status(at, end.min(size) - at.0)?;
            let zeros = match st {
                LayerStatus::Data { .. } | LayerStatus::Compressed(_) => false,
                LayerStatus::Zero { .. } => true,
                LayerStatus::Unallocated { .. } => below.reads_as_zeros(at, n)?,
            };
            if !zeros {
                return Ok(false);
            }
            at = at + n;
        }
        Ok(true)
    }

    fn decompress_own(&self, d: CompressedDescriptor) -> Result<Vec<u8>, Error> {
        let compression = self.read_state().header.compression_type;
        read_compressed_cluster(
            &*self.top.storage,
            compression,
            self.top.geometry,
            d,
            ReadPattern::Once,
        )
        .map_err(|k| self.top.err(k))
    }

    /// Makes the whole cluster at `guest` read as zeros without writing
    /// data; `false` when the image cannot express it and zeros must be
    /// written.
    pub(crate) fn zero_cluster(
        &self,
        guest: GuestOffset,
        how: Zeroing,
        changed: &MappingChanged,
    ) -> Result<bool, Error> {
        loop {
            let mut st = self.write_state()?;
            match st.zero_cluster(guest, how).map_err(|e| self.on_error(e))? {
                ZeroOutcome::Done { l2 } => {
                    let g = self.top.geometry;
                    changed(g.cluster_start(guest), g.cluster_size());
                    let records = st.record_change(l2, guest);
                    let change = st.changes;
                    let over = st.settle();
                    drop(st);
                    self.settle_change(change, records);
                    self.after_settle(over);
                    return Ok(true);
                }
                ZeroOutcome::WriteZeros => return Ok(false),
                ZeroOutcome::Unchanged => return Ok(true),
                ZeroOutcome::Wait(cell) => {
                    drop(st);
                    cell.wait();
                }
            }
        }
    }

    /// Makes every completed write durable, metadata in crash-safe order.
    /// Releases queued before it become allocatable once every transfer
    /// that may still use them (tickets of `fence` taken before) has ended:
    /// now if they have, else at a later flush. It never waits for a
    /// transfer.
    pub(crate) fn flush(&self, fence: &TransferFence) -> Result<(), Error> {
        self.last_flush_ms.store(
            self.opened.elapsed().as_millis() as u64 + 1,
            Ordering::Relaxed,
        );
        let _order = self
            .flush_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.resume_journal();
        let done = self.flush_locked(fence);
        self.after_write_back();
        done
    }

    /// [`Active::flush`] with the flush order held.
    fn flush_locked(&self, fence: &TransferFence) -> Result<(), Error> {
        let (wb, incompatible, l1_offset) = {
            let mut st = self.write_back_state()?;
            let wb = st.take_write_back(Some(fence.cut()));
            let h = &st.header;
            (wb, h.features.incompatible, h.l1_table_offset)
        };
        if let Err(e) = self.write_out(&wb, incompatible, l1_offset, Durability::Durable) {
            self.write_state_anyway().restore(wb);
            return Err(e);
        }
        self.write_back_done(&wb);
        let rc = {
            let mut st = self.write_back_state()?;
            st.written(wb);
            let applied = st.apply_passed_frees(fence)?;
            (applied && !self.top.lazy_refcounts).then(|| st.refcounts.dirty_snapshot())
        };
        if let Some(rc) = rc {
            if let Err(e) = self.top.write_refcounts(&rc) {
                self.write_state_anyway().refcounts.restore(&rc);
                return Err(e);
            }
            self.write_back_state()?.refcounts_written(&rc);
        }
        Ok(())
    }

    /// Writes the metadata of every completed change to the file (the
    /// kernel's page cache) without a final sync: a process death then
    /// loses none of them, and since the data and refcounts they point to
    /// are made durable first, a power loss before the next flush leaves
    /// at worst leaked clusters. Cheap when nothing changed (no syscall).
    pub(crate) fn publish(&self) -> Result<(), Error> {
        let _order = self
            .flush_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let done = self.write_back(Durability::Published);
        self.after_write_back();
        done
    }

    /// Writes metadata back (no releases taken) with the flush order held.
    fn write_back(&self, durability: Durability) -> Result<(), Error> {
        self.resume_journal();
        let (wb, incompatible, l1_offset) = {
            let mut st = self.write_back_state()?;
            let wb = st.take_write_back(None);
            (
                wb,
                st.header.features.incompatible,
                st.header.l1_table_offset,
            )
        };
        if wb.is_empty() && !wb.sets_dirty_bit() && durability == Durability::Published {
            return Ok(());
        }
        match self.write_out(&wb, incompatible, l1_offset, durability) {
            Ok(()) => {
                self.write_back_done(&wb);
                self.write_back_state()?.written(wb);
                Ok(())
            }
            Err(e) => {
                self.write_state_anyway().restore(wb);
                Err(e)
            }
        }
    }

    /// Makes spare clusters when allocations asked for them and at most
    /// half of the pool is left (at most 1 MiB at a time: this runs on a
    /// write's path; see `spares.rs`): counted under the lock, given their
    /// space and zeroed outside it (by one caller at a time; the others go
    /// on without). Those that cannot be prepared (a full filesystem) are
    /// given back.
    pub(crate) fn refill_spares(&self) {
        let Ok(_maker) = self.spare_maker.try_lock() else {
            return;
        };
        self.refill_asked.store(false, Ordering::Release);
        let wanted = match self.write_state() {
            Ok(mut st) => st.take_refill(),
            Err(_) => Vec::new(),
        };
        if !wanted.is_empty() {
            let (prepared, failed) = self.top.prepare_spares(&wanted);
            if let Some(&last) = prepared.iter().max() {
                let end = (last + 1) << self.top.geometry.cluster_bits;
                self.known_len.fetch_max(end, Ordering::Relaxed);
            }
            let mut st = self.write_state_anyway();
            st.add_spares(&prepared);
            if !failed.is_empty() {
                st.refill_failed(&failed);
            }
        }
    }

    /// Fills the whole pool of spare clusters now (for a top that is
    /// about to take a burst of allocating writes: a live snapshot's new
    /// top, prepared before the guest's pause), so that the first writes
    /// after the switch find spares rather than wait for a table's sync.
    pub(crate) fn prefill_spares(&self) {
        self.refill_spares_asked(Spares::want_full_batch);
    }

    /// Tops the pool of spare clusters up once a quarter of it is used,
    /// for a copier about to allocate a batch off any request's path (a
    /// live commit's drain into this top): refills, each a sync at the
    /// next write-back, come many clusters at a time.
    pub(crate) fn top_up_spares(&self) {
        self.refill_spares_asked(Spares::want_topped_up);
    }

    /// Ends [`Active::top_up_spares`]: the usual pool from now on.
    pub(crate) fn end_top_up_spares(&self) {
        if let Ok(mut st) = self.write_state() {
            st.spares.end_topped_up();
        }
    }

    /// Refills the spares after `ask` set how much the refill prepares.
    fn refill_spares_asked(&self, ask: fn(&mut Spares)) {
        if let Ok(mut st) = self.write_state() {
            ask(&mut st.spares);
        }
        self.refill_spares();
    }

    /// Writes metadata back without taking releases, when dirty tables
    /// take too much memory; skipped while a flush runs (it writes them).
    fn write_back_early(&self) {
        let Ok(_order) = self.flush_order.try_lock() else {
            return;
        };
        if let Err(e) = self.write_back(Durability::Published) {
            tracing::warn!(error = %e, "early metadata write-back failed (the next flush retries)");
        }
        self.after_write_back();
    }

    /// Rewrites the top's header area (its backing file name, as a merge
    /// below switches it) under the flush order, so that no feature word
    /// written by a write-back meanwhile is lost; the header is read from
    /// the file. The in-memory header keeps the old name (the chain is
    /// replaced after the switch).
    pub(crate) fn rewrite_header_area(
        &self,
        edit: &crate::header_area::AreaEdit<'_>,
    ) -> Result<(), Error> {
        // Held across the header's read and write on purpose: a feature
        // word written back meanwhile would be lost.
        let _order = self
            .flush_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.edit_header_area(edit, false)
    }

    /// Reads the header from the file and rewrites its area with `edit`
    /// (with `dry_run`, only checks that it fits). The caller holds the
    /// flush order.
    fn edit_header_area(
        &self,
        edit: &crate::header_area::AreaEdit<'_>,
        dry_run: bool,
    ) -> Result<(), Error> {
        let e = |k: ErrorKind| Error::new(&self.top.path, k);
        let storage = &*self.top.storage;
        let header = crate::header::Header::read(storage).map_err(e)?;
        let done = if dry_run {
            crate::header_area::compose(storage, &header, edit).map(drop)
        } else {
            crate::header_area::rewrite(storage, &header, edit)
        };
        done.map_err(|io| e(io.into()))
    }

    /// [`Active::rewrite_header_area`] only while this writer still serves
    /// the image (not superseded by a live snapshot, handed over or
    /// failed): checked under the flush order, which the close of a
    /// superseded writer takes before its image's identity is taken again
    /// ([`crate::Qcow2Layer::refresh_identity`]), so that a chain built
    /// after it never records the header from before the rewrite.
    /// `Ok(false)` when it does not serve it any more (nothing written);
    /// with `dry_run`, checks only (the area fits the first cluster).
    pub(crate) fn rewrite_header_area_while_serving(
        &self,
        edit: &crate::header_area::AreaEdit<'_>,
        dry_run: bool,
    ) -> Result<bool, Error> {
        // Held across the header's I/O on purpose (see above).
        let _order = self
            .flush_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if self.failure().is_some() {
            return Ok(false);
        }
        self.edit_header_area(edit, dry_run)?;
        Ok(true)
    }

    /// Puts the most recently used clean tables (at most `max_bytes`)
    /// into the unified cache for readers of the image as a backing
    /// layer.
    pub(crate) fn publish_recent(&self, max_bytes: u64) {
        self.read_state().publish_recent(max_bytes);
    }

    /// The L1 table as held in memory (the file may not have all of it).
    pub(crate) fn l1_table(&self) -> Vec<u64> {
        self.read_state().l1.clone()
    }

    /// The top file's length as last seen (clusters below it exist).
    pub(crate) fn known_len(&self) -> u64 {
        self.known_len.load(Ordering::Relaxed)
    }

    /// Flushes, gives the spare clusters back and, with lazy refcounts,
    /// writes the refcounts; then clears the dirty bit: the image is clean
    /// for any reader.
    pub(crate) fn close(&self, fence: &TransferFence) -> Result<(), Error> {
        let _order = self
            .flush_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // The bulk of the write-back first, while the journal still takes
        // changes and spares can still be made: its data sync may take
        // long (everything written since the last checkpoint), and a
        // writer completing meanwhile must neither publish (which waits
        // for this flush) nor wait for a spare. A live snapshot's flush
        // before its pause held allocating writes for up to 1.3 s so.
        if self.read_state().journal.is_some() {
            self.flush_locked(fence)?;
        }
        // No spares are made meanwhile (one being made is finished first).
        let _spares = self
            .spare_maker
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Changes from now on are not journaled (a caller publishes them,
        // after this): the journal ends with this flush.
        let journal = self.write_back_state()?.journal.take();
        if let Err(e) = self.flush_locked(fence) {
            if let Some(j) = journal {
                self.write_state_anyway().journal = Some(j);
            }
            return Err(e);
        }
        let ended = journal.is_some();
        if let Some(j) = journal {
            self.discard_journal(&j);
        }
        // The guest's data is durable: the bitmaps describing it are
        // stored (QEMU's close). A failure leaves them in use, which the
        // next writer reads as inconsistent, as after a crash.
        if let Err(e) = self.store_bitmaps() {
            tracing::warn!(path = %self.top.path.display(), error = %e, "could not store the persistent bitmaps: they stay in use");
        }
        let (rc, left, dirty) = {
            let mut st = self.write_back_state()?;
            let left: usize = st.deferred_frees.iter().map(|(_, f)| f.len()).sum();
            let spares = st.spares.take_all();
            if !spares.is_empty() {
                // Held across the truncation on purpose: no allocation may
                // place a cluster past the new end meanwhile.
                if let Err(e) = self.trim_spares(&spares) {
                    tracing::warn!(error = %e, "could not cut spare clusters off the file's end");
                }
                for c in spares {
                    st.unalloc(c);
                }
            }
            let rc = st.refcounts.dirty_snapshot();
            (rc, left, st.dirty_bit_on_disk)
        };
        if left > 0 {
            tracing::warn!(
                path = %self.top.path.display(),
                clusters = left,
                "transfers still in flight at close: their released clusters stay allocated (leaked)"
            );
        }
        if let Err(e) = self.top.write_refcounts(&rc) {
            self.write_state_anyway().refcounts.restore(&rc);
            return Err(e);
        }
        let (incompatible, autoclear) = {
            let mut st = self.write_back_state()?;
            st.refcounts_written(&rc);
            let f = st.header.features;
            (
                f.incompatible & !INCOMPAT_DIRTY,
                f.autoclear & !AUTOCLEAR_JOURNAL,
            )
        };
        if dirty || ended {
            self.top.write_feature_bits(incompatible, autoclear)?;
            let mut st = self.write_back_state()?;
            st.dirty_bit_on_disk = false;
            st.header.features.incompatible = incompatible;
            st.header.features.autoclear = autoclear;
        }
        Ok(())
    }

    /// Ends a journal whose every record a completed write-back covers:
    /// noted in it (a replay skips them all) and its file removed, so that
    /// no later change can be overwritten by a replay; started again with
    /// the next change ([`Active::resume_journal`]).
    fn discard_journal(&self, journal: &journal::Journal) {
        if let Err(e) = journal.applied(journal.horizon()) {
            tracing::warn!(error = %e, "could not note the last checkpoint in the journal");
        }
        journal.remove();
        self.journal_stopped_at
            .store(self.read_state().changes, Ordering::Release);
    }

    /// Ends the journal after a checkpoint could not be noted in it (a
    /// replay could write records that later changes superseded): every
    /// journaled change is written to the image first, then the journal
    /// goes and the image stops naming it. Call with the flush order held.
    fn abandon_journal(&self) {
        let Some(journal) = self.write_state_anyway().journal.take() else {
            return;
        };
        tracing::warn!(
            path = %self.top.path.display(),
            "the journal cannot be kept up to date: ending it (changes are published before they complete)"
        );
        if let Err(e) = self.write_back(Durability::Published) {
            tracing::warn!(error = %e, "could not write the journaled changes back: keeping the journal");
            self.write_state_anyway().journal = Some(journal);
            return;
        }
        self.discard_journal(&journal);
        let (incompatible, autoclear) = {
            let st = self.read_state();
            let f = st.header.features;
            (f.incompatible, f.autoclear & !AUTOCLEAR_JOURNAL)
        };
        match self.top.write_feature_bits(incompatible, autoclear) {
            Ok(()) => self.write_state_anyway().header.features.autoclear = autoclear,
            Err(e) => tracing::warn!(error = %e, "could not clear the journal's autoclear bit"),
        }
    }

    /// Starts a journal again after [`Active::close`] left the image
    /// clean, once there is a change to write (call with the flush order
    /// held).
    fn resume_journal(&self) {
        self.restart_journal(true);
    }

    /// Starts a journal again after [`Active::close`] left the image
    /// clean, now, before writes come: started by the first change
    /// instead, it makes that change and every one after it wait for a
    /// publish whose sync covers everything written in place meanwhile
    /// (a frontend that reconnected stalled 1.2-1.9 s a few seconds in,
    /// under 70/30 random I/O). Holds the flush order across the start's
    /// sync, as every write-back does.
    pub(crate) fn resume_journal_now(&self) {
        if let Err(e) = self.bitmaps_in_use() {
            tracing::warn!(error = %e, "could not mark the persistent bitmaps in use (the next write tries again)");
        }
        if self.journal_stopped_at.load(Ordering::Acquire) == u64::MAX {
            // Running (checked again under the flush order): no wait
            // behind a flush for nothing.
            return;
        }
        let _order = self
            .flush_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.restart_journal(false);
    }

    /// The journal started again if [`Active::close`] stopped it (and,
    /// if `after_a_change`, some change came since). The caller holds
    /// the flush order.
    fn restart_journal(&self, after_a_change: bool) {
        let stopped = self.journal_stopped_at.load(Ordering::Acquire);
        if stopped == u64::MAX || self.superseded() {
            return;
        }
        if after_a_change && self.read_state().changes <= stopped {
            return;
        }
        self.journal_stopped_at.store(u64::MAX, Ordering::Release);
        self.start_journal();
    }

    /// Cuts the spares at the end of the file off (they are counted, so
    /// nothing else can be there). The caller holds the metadata lock.
    fn trim_spares(&self, spares: &[u64]) -> Result<(), Error> {
        let top = &self.top;
        let bits = top.geometry.cluster_bits;
        let len = top.storage.len().map_err(|e| top.io(e))?;
        let spares: std::collections::HashSet<u64> = spares.iter().copied().collect();
        let mut end = len.div_ceil(1 << bits);
        while end > 0 && spares.contains(&(end - 1)) {
            end -= 1;
        }
        let new_len = (end << bits).min(len);
        if new_len < len {
            top.storage.set_len(new_len).map_err(|e| top.io(e))?;
            self.known_len.store(new_len, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Why a superseded engine refuses writes.
const SUPERSEDED: &str = "the image is a backing layer now (a live snapshot was taken over it)";
/// Why a handed-over engine refuses writes.
const HANDED_OVER: &str = "another chain took over the image (after a merge)";

/// Granule of the zero detection of new clusters.
const ZERO_BLOCK: usize = 4096;

/// Writes a new cluster's bytes at `at`. Blocks of zeros (the unwritten
/// rest of a cluster over an empty backing range) are not written: a
/// `fresh` cluster (past the old end of the file) reads as zeros already,
/// another one is zeroed by the filesystem first (QEMU skips zero
/// copy-on-write areas the same way). A 4 KiB write into a new 64 KiB
/// cluster then writes 4 KiB, not 64.
fn write_sparse(
    storage: &dyn crate::storage::Storage,
    at: HostOffset,
    full: &[u8],
    fresh: bool,
) -> std::io::Result<()> {
    let blocks: Vec<bool> = full.chunks(ZERO_BLOCK).map(crate::bytes::is_zero).collect();
    if !blocks.iter().any(|z| *z) {
        return storage.write_at(full, at.0);
    }
    if !fresh {
        storage.write_zeroes(at.0, full.len() as u64)?;
    }
    let mut i = 0;
    while i < blocks.len() {
        if blocks[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < blocks.len() && !blocks[i] {
            i += 1;
        }
        let (lo, hi) = (start * ZERO_BLOCK, (i * ZERO_BLOCK).min(full.len()));
        storage.write_at(&full[lo..hi], at.0 + lo as u64)?;
    }
    Ok(())
}

/// An allocation in flight: committed by [`Claim::commit`], given back
/// (cluster returned, claim ended) when dropped otherwise, e.g. when its
/// data write failed.
#[must_use = "an allocation in flight must be committed or given back"]
struct Claim<'a> {
    active: &'a Active,
    alloc: Allocation,
    stage: ClaimStage,
}

/// How far an allocation in flight has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClaimStage {
    /// Its data is being written; the mapping is unchanged.
    Claimed,
    /// The mapping is set; the change is not settled yet.
    Committed,
    /// The change is journaled (or counted as not) and the claim ended.
    Settled,
}

/// What the data write of an allocation left.
#[derive(Debug, Clone, Copy)]
struct Filled {
    /// The new subcluster bitmap (extended L2).
    bitmap: u64,
    /// The data must be durable before the mapping may be written.
    needs_sync: bool,
}

impl Claim<'_> {
    /// Links the written cluster into the mapping.
    fn commit(self, filled: Filled, changed: &MappingChanged) -> Result<(), Error> {
        let active = self.active;
        let over = self.link(filled, changed)?;
        active.after_settle(over);
        Ok(())
    }

    /// [`Claim::commit`] but for what the tables under change need then
    /// ([`Active::after_settle`]), which it returns.
    fn link(mut self, filled: Filled, changed: &MappingChanged) -> Result<Residency, Error> {
        let active = self.active;
        let mut st = active.write_state()?;
        st.commit(&self.alloc, filled.bitmap)
            .map_err(|e| active.on_error(e))?;
        if filled.needs_sync {
            st.order.data_before_l2 = true;
        }
        self.stage = ClaimStage::Committed;
        changed(self.alloc.start, active.top.geometry.cluster_size());
        let records = st.record_change(self.alloc.l2, self.alloc.start);
        let change = st.changes;
        let over = st.settle();
        drop(st);
        active
            .top
            .faults
            .hit(crate::fault::FaultPoint::BeforeJournalRecord);
        // Journaled (or noted as not) before anyone can write into the
        // cluster and complete: until then it stays claimed, so that a
        // write planned meanwhile waits too, and no write takes the
        // in-place path.
        active.settle_change(change, records);
        active.write_state_anyway().end_settled_claim(&self.alloc);
        self.stage = ClaimStage::Settled;
        self.alloc.cell.end();
        Ok(over)
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        match self.stage {
            ClaimStage::Settled => return,
            ClaimStage::Committed => {
                // A panic between setting the mapping and settling its
                // change, which is then neither journaled nor counted as
                // unjournaled: the engine fails (writes refused until the
                // image is reopened), and the claim ends, so that no write
                // waits for it forever.
                self.active
                    .fail("a panic interrupted an allocating write after its mapping was set");
                self.active
                    .write_state_anyway()
                    .end_settled_claim(&self.alloc);
            }
            ClaimStage::Claimed => {
                if std::thread::panicking() {
                    self.active.fail("a panic interrupted an allocating write");
                }
                self.active.write_state_anyway().abort(&self.alloc);
            }
        }
        self.alloc.cell.end();
    }
}

/// After a live snapshot's switch, the chain that follows reads the old
/// top's tables from here until they are all in the file: nothing changes
/// them any more (the engine is superseded), so what is held is the
/// latest.
impl crate::held::TableHolder for Active {
    fn held_slice(&self, l2_offset: u64, offset: u64, words: usize) -> Option<sqcow2_cache::Slice> {
        self.read_state().held_slice(l2_offset, offset, words)
    }

    fn try_held_slice(
        &self,
        l2_offset: u64,
        offset: u64,
        words: usize,
    ) -> Result<Option<sqcow2_cache::Slice>, crate::held::Busy> {
        match self.state.try_read() {
            Ok(st) => Ok(st.held_slice(l2_offset, offset, words)),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                Ok(p.into_inner().held_slice(l2_offset, offset, words))
            }
            Err(std::sync::TryLockError::WouldBlock) => Err(crate::held::Busy),
        }
    }
}
