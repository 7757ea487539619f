//! A live commit's drain of the top into the base directly below it: the
//! top only shrinks. While it runs, each guest cluster goes where it is
//! decided: a cluster the top still decides (its entry maps data, zeros
//! or a compressed cluster) is read and written in the top as before;
//! every other cluster is read and written through the base's own writer
//! (the target chain), whose view of the base is the fresh one. The
//! copier takes the top's clusters a batch at a time: holding the batch
//! against guest changes, it writes their view into the base, publishes
//! the base's mappings, then unmaps them from the top (journaled), so
//! that they read through to the base from then on. Nothing the guest
//! writes makes more work, so the copy ends whatever the guest does, at
//! any pace.
//!
//! On disk the chain stays the old top over the base throughout: a
//! cluster reads from the top until its unmapping, and the base's file
//! maps that cluster's data before it (a death of this process loses
//! neither); a guest write into a cluster the top no longer decides is
//! in the base, where the chain reads it. Against a power loss the base
//! is synced before any of the top's tables is written (the top's
//! [`DurableFirst`]): an unmapping reaches the disk only after the copy
//! it relies on. The copier syncs nothing itself: a sync per batch wrote
//! back every guest write routed to the base since the last one (late in
//! a drain, all of them), many times over what the kernel's write-back
//! writes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::range_holds::RangeHolds;

use super::Chain;
use crate::active::DurableFirst;
use crate::error::Error;
use crate::fence::TransferTicket;
use crate::types::GuestOffset;

/// A range held until dropped.
#[must_use = "the range is released when the guard drops"]
#[derive(Debug)]
pub(crate) struct DrainHold {
    drain: Arc<Drain>,
    turn: u64,
}

impl Drop for DrainHold {
    fn drop(&mut self) {
        self.drain.holds.release(self.turn);
    }
}

/// What a transfer the caller moves itself must hold until its data has
/// moved: when the chain is being committed live, a mark of a live
/// commit's mirror, the range of a drain, the base's own ticket; for a
/// layer in an object store, the range of its cache file read.
#[must_use = "drop it once the data has moved, not before"]
#[derive(Debug)]
pub struct TransferHold(#[allow(dead_code)] HoldKind);

/// Each kind is held for its drop.
#[derive(Debug)]
#[allow(dead_code)]
enum HoldKind {
    Mark(super::mirror::ChangeMark),
    Range(DrainHold),
    Ticket(TransferTicket),
    /// A range of a layer's local cache kept where it is.
    Cached(crate::storage::CachedRangePin),
    Both(Box<(TransferHold, TransferHold)>),
}

impl TransferHold {
    pub(crate) fn mark(mark: super::mirror::ChangeMark) -> Self {
        TransferHold(HoldKind::Mark(mark))
    }
    pub(crate) fn range(hold: DrainHold) -> Self {
        TransferHold(HoldKind::Range(hold))
    }
    pub(crate) fn ticket(ticket: TransferTicket) -> Self {
        TransferHold(HoldKind::Ticket(ticket))
    }
    pub(crate) fn cached(pin: crate::storage::CachedRangePin) -> Self {
        TransferHold(HoldKind::Cached(pin))
    }
    /// `self` and `other`, both held.
    pub(crate) fn and(self, other: TransferHold) -> Self {
        TransferHold(HoldKind::Both(Box::new((self, other))))
    }
}

/// The base a served chain's top drains into, and the holds of ranges
/// against its copier.
#[derive(Debug)]
pub(crate) struct Drain {
    pub(crate) target: Arc<Chain>,
    holds: RangeHolds,
    /// The first failure of a change routed to the base (the guest's
    /// request failed too; the commit fails with it).
    failure: Mutex<Option<String>>,
    /// Guest bytes changed in the base directly.
    routed: AtomicU64,
    /// Whether the copier let the top go of clusters whose copies the
    /// base has not synced yet (held across the sync that clears it).
    unsynced: Mutex<bool>,
    /// Called by each batch between the base's publish and the unmapping
    /// (unit tests: stalls there, to show what the hold keeps out).
    #[cfg(test)]
    pub(crate) before_unmap: Mutex<Option<TestHook>>,
    /// Syncs of the base so far (unit tests).
    #[cfg(test)]
    pub(crate) base_syncs: AtomicU64,
}

/// A unit test's hook.
#[cfg(test)]
pub(crate) struct TestHook(pub(crate) Box<dyn FnMut() + Send>);

#[cfg(test)]
impl std::fmt::Debug for TestHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TestHook")
    }
}

impl Drain {
    pub(crate) fn new(target: Arc<Chain>) -> Drain {
        Drain {
            target,
            holds: RangeHolds::default(),
            failure: Mutex::new(None),
            routed: AtomicU64::new(0),
            unsynced: Mutex::new(false),
            #[cfg(test)]
            before_unmap: Mutex::new(None),
            #[cfg(test)]
            base_syncs: AtomicU64::new(0),
        }
    }

    /// Holds `[start, end)` against the copier (waits for it).
    pub(crate) fn share(self: &Arc<Self>, start: u64, end: u64) -> DrainHold {
        DrainHold {
            drain: self.clone(),
            turn: self.holds.lock(start, end, false),
        }
    }

    /// [`Drain::share`] if it need not wait.
    pub(crate) fn try_share(self: &Arc<Self>, start: u64, end: u64) -> Option<DrainHold> {
        let turn = self.holds.try_share(start, end)?;
        Some(DrainHold {
            drain: self.clone(),
            turn,
        })
    }

    /// Holds `[start, end)` alone (the copier): waits for the guest's
    /// changes of it in flight.
    pub(crate) fn exclusive(self: &Arc<Self>, start: u64, end: u64) -> DrainHold {
        DrainHold {
            drain: self.clone(),
            turn: self.holds.lock(start, end, true),
        }
    }

    /// Counts a change routed to the base, or keeps its failure.
    pub(crate) fn routed<T>(&self, len: u64, done: Result<T, Error>) -> Result<T, Error> {
        match &done {
            Ok(_) => {
                self.routed.fetch_add(len, Ordering::Relaxed);
            }
            Err(e) => {
                let mut f = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
                if f.is_none() {
                    tracing::warn!(error = %e, "live commit: a change of the base failed");
                    *f = Some(format!("a guest change of the base failed: {e}"));
                }
            }
        }
        done
    }

    pub(crate) fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Guest bytes changed in the base directly so far.
    pub(crate) fn routed_bytes(&self) -> u64 {
        self.routed.load(Ordering::Relaxed)
    }

    /// Whether writes into the base go a page at a time (see
    /// [`crate::storage::Storage::set_page_sized_writes`]).
    fn set_page_sized_writes(&self, on: bool) {
        if let Ok(base) = self.target.active() {
            base.storage().set_page_sized_writes(on);
        }
    }

    /// Drops the base's cached pages of the guest clusters at `clusters`
    /// (each `cs` bytes) where the base has data, before the copy
    /// overwrites them: pages cached in large folios (a base read ahead
    /// or written in large pieces) would stay so under the page-sized
    /// copy. The top decides these clusters, so no guest read wants
    /// those pages, and nothing wrote them since the base was opened for
    /// the drain (clean: dropped, nothing written back).
    fn drop_cached_base(&self, clusters: &[u64], cs: u64) -> Result<(), Error> {
        let Ok(base) = self.target.active() else {
            return Ok(());
        };
        let layer = self.target.top_index();
        // Host ranges, adjacent ones merged: a folio goes only if the range
        // covers it whole.
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for &c in clusters {
            let e = self.target.resolve(GuestOffset(c), cs, false)?;
            let (super::ExtentKind::Data { host }, true) = (e.kind, e.layer == layer) else {
                continue;
            };
            let len = e.len.min(cs);
            match ranges.last_mut() {
                Some((at, n)) if *at + *n == host.0 => *n += len,
                _ => ranges.push((host.0, len)),
            }
        }
        for (at, n) in ranges {
            base.storage().drop_cached(at, n);
        }
        Ok(())
    }

    /// Flushes the base (everything written to it so far durable).
    pub(crate) fn sync_base(&self) -> Result<(), Error> {
        self.sync_base_if(true)
    }

    /// Syncs the base if `force` or a copy may not be durable yet.
    fn sync_base_if(&self, force: bool) -> Result<(), Error> {
        // Held across the flush on purpose: a caller that finds nothing
        // unsynced must not go on while another's sync is still running.
        let mut unsynced = self.unsynced.lock().unwrap_or_else(PoisonError::into_inner);
        if force || *unsynced {
            self.target.flush()?;
            *unsynced = false;
            #[cfg(test)]
            self.base_syncs.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

impl DurableFirst for Drain {
    /// The base synced if a copy the top relies on may not be durable yet.
    fn make_durable(&self) -> Result<(), Error> {
        self.sync_base_if(false)
    }
}

impl Chain {
    /// From now on clusters the top does not decide are read and written
    /// in `drain`'s base (call with no request in flight: a pause), and
    /// the base is synced before the top's tables are written.
    pub(crate) fn start_drain(&self, drain: Arc<Drain>) {
        if let Some(active) = &self.active {
            active.set_durable_first(Some(drain.clone()));
        }
        // The copies into the base stay in single-page folios, which the
        // guest's small writes into them (routed now, served later) find
        // cheap; whole clusters in one folio each took the guest's
        // writes into the drained base from 304k to 220k IOPS (measured
        // in docs/measured.md, "Live commit").
        drain.set_page_sized_writes(true);
        self.drain.store(Some(drain));
    }

    /// Routing stops, once the base has synced what the top let go of
    /// (cheap after [`Drain::sync_base`]); an error of that sync is
    /// returned, after the routing stopped all the same. Call with no
    /// request in flight, and only when this chain will not serve again
    /// (its view of the base is stale) or nothing was drained.
    pub(crate) fn stop_drain(&self) -> Result<(), Error> {
        let Some(drain) = self.drain.swap(None) else {
            return Ok(());
        };
        let synced = drain.make_durable();
        if let Some(active) = &self.active {
            active.set_durable_first(None);
        }
        drain.set_page_sized_writes(false);
        if let Ok(base) = drain.target.active() {
            base.end_top_up_spares();
        }
        synced
    }

    /// The drain in progress, if any.
    pub(crate) fn drain(&self) -> Option<Arc<Drain>> {
        // A guard first: no count taken on the hot path without a drain.
        self.drain.load().as_ref().map(Arc::clone)
    }

    /// Whether the top decides any byte of the cluster at `guest`.
    pub(crate) fn top_decides(&self, guest: GuestOffset) -> Result<bool, Error> {
        self.active()?.decides(guest)
    }
}

/// Guest bytes a drain's batch copied.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Drained {
    pub(crate) data_bytes: u64,
    pub(crate) zero_bytes: u64,
}

impl Drain {
    /// Drains the top's clusters in `[start, end)` (cluster-aligned) of
    /// `chain`: their view written into the base, the base synced, then
    /// each unmapped from the top (journaled), the range held against
    /// guest changes throughout.
    pub(crate) fn drain_range(
        self: &Arc<Self>,
        chain: &Chain,
        start: u64,
        end: u64,
        buf: &mut Vec<u8>,
    ) -> Result<Drained, Error> {
        let cs = chain.cluster_size();
        let mut done = Drained::default();
        // Nothing becomes the top's again: a range it decides nothing of
        // is skipped without holding it.
        let mut any = false;
        for c in (start..end).step_by(cs as usize) {
            if chain.top_decides(GuestOffset(c))? {
                any = true;
                break;
            }
        }
        if !any {
            return Ok(done);
        }
        // The base's new clusters come from spares prepared here, off any
        // guest request's path and many at once: a publish of copies onto
        // spares over zeros syncs nothing (one sync per refill).
        if let Ok(base) = self.target.active() {
            base.top_up_spares();
        }
        // Held across the copy, the publish and the unmapping, on purpose: a
        // guest change of these clusters must land after the unmapping
        // (then in the base) or before the copy (then copied).
        let _held = self.exclusive(start, end);
        let top = chain.top_index();
        let mut decided = Vec::new();
        for c in (start..end).step_by(cs as usize) {
            if chain.top_decides(GuestOffset(c))? {
                decided.push(c);
            }
        }
        self.drop_cached_base(&decided, cs)?;
        for &c in &decided {
            let c_end = (c + cs).min(end);
            let mut pos = c;
            while pos < c_end {
                let e = chain.resolve(GuestOffset(pos), c_end - pos, false)?;
                let n = e.len.min(c_end - pos);
                if e.layer == top {
                    match e.kind {
                        super::ExtentKind::Data { .. } | super::ExtentKind::Compressed(_) => {
                            buf.resize(n as usize, 0);
                            chain.read_at(&mut buf[..n as usize], pos)?;
                            self.target.write_at(&buf[..n as usize], pos)?;
                            done.data_bytes += n;
                        }
                        super::ExtentKind::Zero { .. } => {
                            self.target.write_zeroes(pos, n, false)?;
                            done.zero_bytes += n;
                        }
                    }
                }
                pos += n;
            }
        }
        if decided.is_empty() {
            return Ok(done);
        }
        // Mapped in the base's file before the top lets go of them (a
        // read-only open of the base after a death of this process does
        // not replay its journal); synced before the top's tables say so
        // (`make_durable`). Marked first: a sync from now on covers them.
        *self.unsynced.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.target.durability().publish()?;
        #[cfg(test)]
        if let Some(hook) = self
            .before_unmap
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            (hook.0)();
        }
        let active = chain.active()?;
        let changed = |o: GuestOffset, n: u64| chain.mapping_changed(o, n);
        for c in decided {
            active.zero_cluster(GuestOffset(c), crate::active::Zeroing::ToBacking, &changed)?;
        }
        // Safe from a death of this process before the range is let go (a
        // change the journal could not take is published): a guest write
        // into these clusters goes to the base from then on.
        if active.needs_publish() {
            active.publish()?;
        }
        Ok(done)
    }
}
