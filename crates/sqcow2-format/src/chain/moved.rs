//! Allocating writes whose data the caller moves (a queue worker through
//! its io_uring): the claim and the spare are taken here, in memory; the
//! caller reads what the cluster keeps from below, writes the cluster and
//! links it ([`MovedClaim::link`]), with no thread hand-off between.

use std::sync::Arc;

use crate::active::Allocation;
use crate::error::{Error, ErrorKind};
use crate::fence::TransferTicket;
use crate::storage::PinnedFile;
use crate::types::{GuestOffset, HostOffset};

use super::{Chain, ExtentKind};

/// A claimed new cluster of the top for a write inside one guest cluster,
/// with what the caller moves into it.
#[derive(Debug)]
pub struct AllocatingWrite {
    /// Where the guest's bytes go in the top's file.
    pub host: HostOffset,
    /// The top's file.
    pub file: PinnedFile,
    /// `None`: the cluster reads as zeros around the guest's bytes (the
    /// new cluster already does); write only those.
    pub copy: Option<ClusterCopy>,
    /// Linked once the data is written; dropped, given back.
    pub claim: MovedClaim,
}

/// A copy-on-write: the new cluster is written whole from a buffer that
/// holds the guest's bytes at `guest_at` and, around them, what `reads`
/// bring from below (zeros elsewhere, and where a read ends short).
#[derive(Debug)]
pub struct ClusterCopy {
    /// The new cluster's first byte in the top's file.
    pub cluster: HostOffset,
    /// Its size.
    pub cluster_size: u64,
    /// Where the guest's bytes lie in it.
    pub guest_at: u64,
    /// Reads from the layers below, none overlapping the guest's bytes;
    /// each fits its file's direct-I/O alignment.
    pub reads: Vec<CopyRead>,
}

/// One read of a [`ClusterCopy`].
#[derive(Debug)]
pub struct CopyRead {
    /// Offset in the cluster's buffer.
    pub at: u64,
    /// Bytes to read.
    pub len: u64,
    /// The layer's file.
    pub file: PinnedFile,
    /// Where the bytes are in it.
    pub host: HostOffset,
}

/// The claim of an [`AllocatingWrite`]: other writes to the guest cluster
/// wait for it; [`MovedClaim::link`] maps the written cluster, a drop
/// gives the cluster back.
#[derive(Debug)]
#[must_use = "dropping the claim gives the cluster back"]
pub struct MovedClaim {
    chain: Arc<Chain>,
    alloc: Option<Allocation>,
    /// Data lies below in the cluster (what the guest saw there was not
    /// zeros): the new cluster must be durable before its mapping is.
    over_data: bool,
}

/// What linking left to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a refill of the spares must be asked of a thread that may write"]
pub struct Linked {
    /// Spares ran low: refill them where waiting for I/O is allowed
    /// ([`Chain::refill_spares`]).
    pub refill_spares: bool,
}

impl MovedClaim {
    /// Maps the new cluster, whose data has been written (all of it: the
    /// guest's bytes and any copy), as an allocating write through the
    /// chain does (journaled: one buffered write of the record, no device
    /// I/O; or left to be published: see
    /// [`crate::Durability::needs_publish`]; an early write-back only
    /// flagged: [`crate::Durability::take_write_back_due`]).
    pub fn link(mut self) -> Result<Linked, Error> {
        let chain = self.chain.clone();
        let active = chain.active()?;
        let Some(alloc) = self.alloc.take() else {
            return Ok(Linked {
                refill_spares: false,
            });
        };
        let changed = |o: GuestOffset, n: u64| chain.mapping_changed(o, n);
        let refill_spares = active.link_moved(alloc, self.over_data, &changed)?;
        Ok(Linked { refill_spares })
    }
}

impl Drop for MovedClaim {
    fn drop(&mut self) {
        if let Ok(active) = self.chain.active() {
            if let Some(alloc) = self.alloc.take() {
                active.abort_moved(alloc);
            }
        }
    }
}

impl Chain {
    /// An allocating write of `len` bytes at `offset` (within one cluster)
    /// that the caller moves itself, for a transfer that holds `ticket`:
    /// `None` where it cannot be set up from memory alone (the write then
    /// goes through [`Chain::write_at`], which may wait): the top must map
    /// nothing there, a spare be ready, what lies below be known from
    /// cached metadata (data only in files with a direct-I/O description it
    /// fits, see [`ClusterCopy`]), no live commit run, and the top's
    /// persistent bitmaps take the change in memory.
    pub fn try_allocating_write(
        self: &Arc<Self>,
        ticket: &TransferTicket,
        offset: GuestOffset,
        len: u64,
    ) -> Result<Option<AllocatingWrite>, Error> {
        self.check_ticket(ticket)?;
        self.check_range(offset.0, len)?;
        let active = self.active()?;
        let cluster_size = self.cluster_size();
        let guest_at = offset.0 % cluster_size;
        if len == 0 || guest_at + len > cluster_size || self.drain().is_some() || self.mirroring() {
            return Ok(None);
        }
        let Some(file) = self
            .top()
            .storage()
            .pinned_file()
            .map_err(|e| Error::new(self.top().path(), e.into()))?
        else {
            return Ok(None);
        };
        // Bytes a direct write cannot take would go through the page cache
        // here; the engine's write keeps them out of it.
        if file.direct.as_ref().is_some_and(|d| !d.fits(guest_at, len)) {
            return Ok(None);
        }
        let _scope = crate::nowait::NoMetadataIo::enter();
        let start = offset.0 - guest_at;
        let (reads, data_below) = match self.reads_below(start, cluster_size, guest_at, len) {
            Ok(Some(found)) => found,
            Ok(None) => return Ok(None),
            Err(e) if matches!(e.kind, ErrorKind::WouldBlock) => return Ok(None),
            Err(e) => return Err(e),
        };
        let alloc = match active.try_claim_spare(offset, len) {
            Ok(Some(alloc)) => alloc,
            Ok(None) => return Ok(None),
            Err(e) if matches!(e.kind, ErrorKind::WouldBlock) => return Ok(None),
            Err(e) => return Err(e),
        };
        let Some(cluster) = crate::active::Active::claimed_host(&alloc) else {
            active.abort_moved(alloc);
            return Ok(None);
        };
        let claim = MovedClaim {
            chain: self.clone(),
            alloc: Some(alloc),
            over_data: data_below,
        };
        // Bits first, as for an in-place write; a store that cleared the
        // in-use flag leaves the write to the engine (it may write).
        if !active.note_in_place_change(offset.0, len) {
            return Ok(None);
        }
        let copy = (!reads.is_empty()).then(|| ClusterCopy {
            cluster,
            cluster_size,
            guest_at,
            reads,
        });
        Ok(Some(AllocatingWrite {
            host: cluster + guest_at,
            file,
            copy,
            claim,
        }))
    }

    /// The reads that bring what the guest cluster at `start` holds below
    /// the top, except the guest's `[guest_at, guest_at + len)` (none
    /// where it reads as zeros), and whether data lies below anywhere in
    /// it; `None` if the top maps part of it, or a part is compressed, or
    /// data lies where a direct read cannot take it.
    fn reads_below(
        &self,
        start: u64,
        cluster_size: u64,
        guest_at: u64,
        len: u64,
    ) -> Result<Option<(Vec<CopyRead>, bool)>, Error> {
        let end = (start + cluster_size).min(self.virtual_size());
        let top = self.top_index();
        let mut reads = Vec::new();
        let mut data = false;
        let mut pos = start;
        while pos < end {
            let extent = self.resolve(GuestOffset(pos), end - pos, false)?;
            if extent.layer == top
                && !matches!(
                    extent.kind,
                    ExtentKind::Zero {
                        allocated: false,
                        ..
                    }
                )
            {
                return Ok(None);
            }
            let n = extent.len.min(end - pos);
            match extent.kind {
                ExtentKind::Zero { .. } => {}
                ExtentKind::Compressed(_) => return Ok(None),
                ExtentKind::Data { host } => {
                    data = true;
                    let Some(file) = self
                        .storage_of(extent.layer)
                        .pinned_file()
                        .map_err(|e| self.layer_io(extent.layer, e))?
                    else {
                        return Ok(None);
                    };
                    // The parts before and after the guest's bytes.
                    let (lo, hi) = (pos - start, pos - start + n);
                    for (a, b) in [(lo, hi.min(guest_at)), (lo.max(guest_at + len), hi)] {
                        if a >= b {
                            continue;
                        }
                        let host = host + (a - (pos - start));
                        let fits = file.direct.as_ref().is_some_and(|d| d.fits(host.0, b - a));
                        if !fits {
                            return Ok(None);
                        }
                        reads.push(CopyRead {
                            at: a,
                            len: b - a,
                            file: file.clone(),
                            host,
                        });
                    }
                }
            }
            pos += n;
        }
        Ok(Some((reads, data)))
    }

    /// Prepares spare clusters of the top where they ran low (after
    /// [`Linked::refill_spares`]); on a thread that may wait for I/O.
    pub fn refill_spares(&self) {
        if let Some(active) = self.active.as_deref() {
            active.refill_spares();
        }
    }
}
