//! Allocating writes whose data the caller moves: a queue worker claims a
//! spare under the metadata lock (memory only), moves the data through
//! its own io_uring and links the cluster afterwards, with no thread
//! hand-off and no wait for I/O on its side.

use std::sync::atomic::Ordering;

use crate::entry::{COPIED, OFFSET_MASK};
use crate::error::Error;
use crate::types::{GuestOffset, HostOffset};

use super::plan::{Allocation, AllocationKind, NewClusterOrigin, WritePlan};
use super::state::Residency;
use super::{Active, Claim, ClaimStage, Filled, MappingChanged};

impl Active {
    /// Claims the guest cluster of `[guest, guest + len)` and a spare for
    /// it, if that takes no I/O: the top maps nothing there (reads go
    /// below), its L2 table is held and its own, a spare is ready, the top
    /// has no subclusters, and metadata is written back in the background.
    /// `None` otherwise (the write goes through [`Active::write_cluster`]).
    /// The new cluster reads as zeros; its host offset is the allocation's.
    pub(crate) fn try_claim_spare(
        &self,
        guest: GuestOffset,
        len: u64,
    ) -> Result<Option<Allocation>, Error> {
        self.check_failed()?;
        if !self.background_write_back || self.top.geometry.extended_l2 {
            return Ok(None);
        }
        // Never waited for here: its holder may be reading a table.
        let Some(mut st) = self.try_write_state()? else {
            return Ok(None);
        };
        if !st.spare_allocation_ready(guest) {
            return Ok(None);
        }
        match st.plan_write(guest, len).map_err(|e| self.on_error(e))? {
            WritePlan::Allocate(alloc) => match alloc.kind {
                AllocationKind::NewCluster {
                    origin: NewClusterOrigin::Spare,
                    ..
                } => Ok(Some(alloc)),
                _ => {
                    // Not what was checked: given back, the engine's.
                    st.abort(&alloc);
                    alloc.cell.end();
                    Ok(None)
                }
            },
            WritePlan::InPlace(_) | WritePlan::Wait(_) => Ok(None),
        }
    }

    /// Links the cluster of `alloc` (from [`Active::try_claim_spare`]),
    /// whose data is written, as an engine's allocating write does (its
    /// journal record written here: one buffered write, no device I/O),
    /// except that a write-back due is only flagged
    /// ([`Active::take_write_back_due`]) and spares are not refilled here.
    /// `over_data`: data lies below in the cluster (it must be durable
    /// before its mapping is); otherwise the guest saw zeros around its
    /// bytes, which a spare keeps whatever a power loss drops. Returns
    /// whether the spares ran low and no refill was asked yet (a thread
    /// that may write should refill them: [`Active::refill_spares`]).
    pub(crate) fn link_moved(
        &self,
        alloc: Allocation,
        over_data: bool,
        changed: &MappingChanged,
    ) -> Result<bool, Error> {
        let claim = Claim {
            active: self,
            alloc,
            stage: ClaimStage::Claimed,
        };
        let filled = Filled {
            bitmap: 0,
            needs_sync: over_data,
        };
        let over = claim.link(filled, changed)?;
        if matches!(over, Residency::Over | Residency::FarOver) {
            self.write_back_due.store(true, Ordering::Release);
        } else {
            self.after_settle(over);
        }
        let due = self.read_state().spares.refill_due();
        Ok(due && !self.refill_asked.swap(true, Ordering::AcqRel))
    }

    /// Gives back a claim from [`Active::try_claim_spare`] whose data could
    /// not be written (the spare becomes a free cluster).
    pub(crate) fn abort_moved(&self, alloc: Allocation) {
        drop(Claim {
            active: self,
            alloc,
            stage: ClaimStage::Claimed,
        });
    }

    /// The host offset of a claimed new cluster.
    pub(crate) fn claimed_host(alloc: &Allocation) -> Option<HostOffset> {
        match alloc.kind {
            AllocationKind::NewCluster { new, .. } => Some(new),
            _ => None,
        }
    }
}

impl super::state::ActiveState {
    /// Whether planning a write at `guest` would take a spare for a new
    /// cluster without reading or writing anything (see
    /// [`Active::try_claim_spare`]).
    pub(crate) fn spare_allocation_ready(&self, guest: GuestOffset) -> bool {
        let g = self.top.geometry;
        if self.claims.contains_key(&g.guest_cluster(guest)) || !self.spares.has_ready() {
            return false;
        }
        let l1 = self.l1_entry(guest);
        let l2 = l1 & OFFSET_MASK;
        if l2 == 0
            || l1 & COPIED == 0
            || !self.l2.contains_key(&l2)
            || self.refcounts.peek(l2 >> g.cluster_bits) != Some(1)
        {
            return false;
        }
        let (_, entry, _) = self.entry_at(l2, guest);
        entry == 0
    }
}
