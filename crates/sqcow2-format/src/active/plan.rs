//! Planning a write to one guest cluster under the metadata lock, and
//! committing (or giving back) what the plan reserved.

use std::sync::Arc;

use crate::entry::{COMPRESSED, COPIED, OFFSET_MASK, ZERO};
use crate::error::{Error, ErrorKind};
use crate::header::Version;
use crate::types::{GuestCluster, GuestOffset, HostOffset};

use super::claim::ClaimCell;
use super::state::ActiveState;

/// Bitmap with every subcluster allocated.
pub(crate) const ALL_ALLOC: u64 = 0x0000_0000_ffff_ffff;
/// Bitmap with every subcluster reading as zeros.
pub(crate) const ALL_ZERO: u64 = 0xffff_ffff_0000_0000;

/// What a write to one cluster needs.
#[derive(Debug)]
pub(crate) enum WritePlan {
    /// The cluster is the top's own data: write the bytes here.
    InPlace(HostOffset),
    /// Another write is allocating this cluster: wait for it, then plan
    /// again.
    Wait(Arc<ClaimCell>),
    /// A new mapping: the data moves with no lock held, then
    /// [`ActiveState::commit`].
    Allocate(Allocation),
}

/// An allocation in flight for one guest cluster, claimed in the metadata.
#[derive(Debug)]
pub(crate) struct Allocation {
    pub(crate) cluster: GuestCluster,
    /// First byte of the guest cluster.
    pub(crate) start: GuestOffset,
    /// Offset of the (pinned) L2 table and the entry's index in it.
    pub(crate) l2: u64,
    pub(crate) index: usize,
    pub(crate) kind: AllocationKind,
    pub(crate) cell: Arc<ClaimCell>,
}

/// How an allocation fills its cluster.
#[derive(Debug)]
pub(crate) enum AllocationKind {
    /// A new cluster for the whole guest cluster (copy-on-write); the old
    /// entry's clusters are released at commit.
    NewCluster {
        new: HostOffset,
        old_entry: u64,
        origin: NewClusterOrigin,
    },
    /// The top's own preallocated zero cluster, written whole.
    FillZero { host: HostOffset },
    /// Subclusters of the top's own cluster (extended L2): allocated ones
    /// get the new bytes only, the others are written whole.
    Subclusters { host: HostOffset, bitmap: u64 },
}

/// Where a new cluster comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NewClusterOrigin {
    /// A spare: counted, space reserved and reading as zeros, durably
    /// ([`super::spares`]).
    Spare,
    /// Past the end of the file: reads as zeros once its space is
    /// reserved.
    Fresh,
    /// A free cluster inside the file, which may hold old bytes.
    Reused,
}

impl ActiveState {
    /// Plans the write of `len` bytes at `guest` (within one cluster).
    /// Metadata that needs no data write (the `COPIED` flag, a new L2
    /// table) changes here.
    pub(crate) fn plan_write(&mut self, guest: GuestOffset, len: u64) -> Result<WritePlan, Error> {
        let g = self.top.geometry;
        let cluster = g.guest_cluster(guest);
        if let Some(cell) = self.claims.get(&cluster) {
            return Ok(WritePlan::Wait(cell.clone()));
        }
        if let Some(s) = &self.top.summary {
            s.mark(guest);
        }
        let l2 = self.l2_for_write(guest)?;
        let (index, entry, bitmap) = self.entry_at(l2, guest);
        let host = entry & OFFSET_MASK;
        let in_cluster = g.offset_in_cluster(guest.0);
        let kind = if entry & COMPRESSED == 0
            && host != 0
            && g.offset_in_cluster(host) == 0
            && self.owned(HostOffset(host))?
        {
            self.check_data_cluster(guest, host)?;
            // A cluster may end past the file (QEMU writes only the
            // subclusters written of an extended-L2 cluster); one that
            // starts there is what `qemu-img check` calls corrupt.
            let file_size = self.top.storage.len().map_err(|e| self.top.io(e))?;
            if host >= file_size {
                return Err(self.top.err(ErrorKind::ClusterBeyondEof {
                    guest_offset: guest.0,
                    host_offset: host,
                    file_size,
                }));
            }
            if !g.extended_l2 {
                if entry & ZERO == 0 {
                    if entry & COPIED == 0 {
                        self.set_entry(l2, index, host | COPIED, 0);
                    }
                    return Ok(WritePlan::InPlace(HostOffset(host + in_cluster)));
                }
                AllocationKind::FillZero {
                    host: HostOffset(host),
                }
            } else {
                let sc = g.subcluster_size();
                let all_alloc =
                    (in_cluster / sc..=(in_cluster + len - 1) / sc).all(|i| bitmap & (1 << i) != 0);
                if all_alloc && entry & COPIED != 0 {
                    return Ok(WritePlan::InPlace(HostOffset(host + in_cluster)));
                }
                AllocationKind::Subclusters {
                    host: HostOffset(host),
                    bitmap,
                }
            }
        } else {
            // The old mapping must be releasable (not metadata) before
            // anything is allocated for the new one.
            self.check_releasable(guest, entry)?;
            let (new, origin) = match self.spares.take() {
                Some(spare) => (HostOffset(spare << g.cluster_bits), NewClusterOrigin::Spare),
                None => {
                    // The data cluster's space is reserved by the caller,
                    // outside the lock.
                    let new = HostOffset(self.alloc(false)? << g.cluster_bits);
                    let file_size = self.top.storage.len().map_err(|e| self.top.io(e))?;
                    let origin = if new.0 >= file_size {
                        NewClusterOrigin::Fresh
                    } else {
                        NewClusterOrigin::Reused
                    };
                    (new, origin)
                }
            };
            AllocationKind::NewCluster {
                new,
                old_entry: entry,
                origin,
            }
        };
        let cell = Arc::new(ClaimCell::default());
        self.claims.insert(cluster, cell.clone());
        self.pin(l2);
        Ok(WritePlan::Allocate(Allocation {
            cluster,
            start: g.cluster_start(guest),
            l2,
            index,
            kind,
            cell,
        }))
    }

    /// Links the cluster of `alloc`, whose data is written, into the
    /// mapping; `bitmap` is the new subcluster bitmap (extended L2). The
    /// cluster stays claimed until [`ActiveState::end_settled_claim`]
    /// (once the change is journaled, or noted as not).
    pub(crate) fn commit(&mut self, alloc: &Allocation, bitmap: u64) -> Result<(), Error> {
        let g = self.top.geometry;
        match alloc.kind {
            AllocationKind::NewCluster { new, old_entry, .. } => {
                self.release(alloc.start, old_entry)?;
                self.top
                    .faults
                    .hit(crate::fault::FaultPoint::MidMetadataUpdate);
                let bitmap = if g.extended_l2 { ALL_ALLOC } else { 0 };
                self.set_entry(alloc.l2, alloc.index, new.0 | COPIED, bitmap);
            }
            AllocationKind::FillZero { host } => {
                self.set_entry(alloc.l2, alloc.index, host.0 | COPIED, 0);
            }
            AllocationKind::Subclusters { host, .. } => {
                self.set_entry(alloc.l2, alloc.index, host.0 | COPIED, bitmap);
            }
        }
        self.unpin(alloc.l2);
        Ok(())
    }

    /// Ends the claim of a committed allocation whose change is settled:
    /// a write into the cluster may complete from now on.
    pub(crate) fn end_settled_claim(&mut self, alloc: &Allocation) {
        self.claims.remove(&alloc.cluster);
    }

    /// Gives back what `alloc` reserved (its data could not be written).
    pub(crate) fn abort(&mut self, alloc: &Allocation) {
        if let AllocationKind::NewCluster { new, .. } = alloc.kind {
            // Nothing references the cluster: it is reusable at once (a
            // spare is not a spare any more: part of its data may be
            // written).
            self.unalloc(new.0 >> self.top.geometry.cluster_bits);
        }
        self.end_claim(alloc);
    }

    fn end_claim(&mut self, alloc: &Allocation) {
        self.unpin(alloc.l2);
        self.claims.remove(&alloc.cluster);
    }

    /// Zeroes or discards the whole cluster at `guest` (as `how` says)
    /// without writing data; `WriteZeros` when the image cannot express
    /// it (zeros must be written), `Wait` of a claim to wait for while the
    /// cluster is being allocated.
    pub(crate) fn zero_cluster(
        &mut self,
        guest: GuestOffset,
        how: Zeroing,
    ) -> Result<ZeroOutcome, Error> {
        let g = self.top.geometry;
        if let Some(cell) = self.claims.get(&g.guest_cluster(guest)) {
            return Ok(ZeroOutcome::Wait(cell.clone()));
        }
        let v2 = self.top.version == Version::V2;
        let unmap = match how {
            Zeroing::Zeroes { unmap } => unmap,
            Zeroing::Discard | Zeroing::ToBacking => true,
        };
        // v2 has no zero flag: over a backing file, only data reads as
        // zeros, and a discard is not done at all (as QEMU: unmapping
        // would show the backing file's stale data, zeros would take
        // space).
        if v2 && self.top.has_backing {
            match how {
                Zeroing::Discard => return Ok(ZeroOutcome::Unchanged),
                Zeroing::Zeroes { .. } => return Ok(ZeroOutcome::WriteZeros),
                Zeroing::ToBacking => {}
            }
        }
        if let Some(s) = &self.top.summary {
            s.mark(guest);
        }
        let l2 = self.l2_for_write(guest)?;
        let (i, entry, _) = self.entry_at(l2, guest);
        let host = entry & OFFSET_MASK;
        let compressed = entry & COMPRESSED != 0;
        let keep = !unmap && !v2 && !compressed && host != 0 && self.owned(HostOffset(host))?;
        let (new_entry, new_bitmap) = match (g.extended_l2, v2, keep) {
            _ if how == Zeroing::ToBacking => (0, 0),
            (true, _, true) => (host | COPIED, ALL_ZERO),
            (true, _, false) => (0, ALL_ZERO),
            (false, false, true) => (host | ZERO | COPIED, 0),
            (false, false, false) => (ZERO, 0),
            // v2 without a backing file: unallocated reads as zeros.
            (false, true, _) => (0, 0),
        };
        if !keep {
            self.release(guest, entry)?;
        }
        self.set_entry(l2, i, new_entry, new_bitmap);
        Ok(ZeroOutcome::Done { l2 })
    }
}

/// What a whole-cluster [`ActiveState::zero_cluster`] leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Zeroing {
    /// Zeros to read (`unmap`: the cluster's space may be released).
    Zeroes { unmap: bool },
    /// A discard: the space released, zeros to read (not done on a v2
    /// image over a backing file, which cannot say zeros without data).
    Discard,
    /// Unmapped: the space released, the backing file's data to read (a
    /// live commit's drain, once the base holds the cluster's view).
    ToBacking,
}

/// What [`ActiveState::zero_cluster`] did.
#[derive(Debug)]
pub(crate) enum ZeroOutcome {
    /// The cluster reads as zeros now (its entry in the table at `l2`).
    Done { l2: u64 },
    /// The image cannot express it: write zeros.
    WriteZeros,
    /// A discard the image cannot express: nothing done (discard is
    /// advisory).
    Unchanged,
    /// The cluster is being allocated: wait, then try again.
    Wait(Arc<ClaimCell>),
}
