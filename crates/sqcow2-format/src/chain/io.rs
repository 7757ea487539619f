//! Reading and writing guest bytes, and the transfer API for callers that
//! move data themselves (io_uring): every transfer holds a
//! [`TransferTicket`] from before it looks a mapping up until its data has
//! moved, and the lookups that give out host offsets take that ticket, so
//! a flush cannot hand out a cluster a transfer still uses.

use crate::compressed::read_compressed_cluster;
use crate::entry::CompressedDescriptor;
use crate::error::{Error, ErrorKind};
use crate::fence::TransferTicket;
use crate::layer::Layer;
use crate::storage::PinnedFile;
use crate::storage::ReadPattern;
use crate::types::{GuestOffset, HostOffset, LayerIndex};
use std::sync::Arc;

use super::{Chain, Durability, Extent, ExtentKind, Transfers, UnclosedTop};
use crate::active::{Active, Zeroing};

/// A run of guest bytes to read, and where its data is.
#[derive(Debug)]
pub struct ReadExtent {
    /// The mapping.
    pub extent: Extent,
    /// For [`ExtentKind::Data`], the open file holding the data, pinned:
    /// its descriptor stays open for as long as the transfer holds it.
    /// `None` for other kinds, and for storage that is not a file (read
    /// those through [`Chain::read_at`]).
    pub file: Option<PinnedFile>,
    /// While a live commit drains the top: held until the data has moved.
    pub hold: Option<super::TransferHold>,
}

/// Where an in-place write goes: the top's own cluster.
#[derive(Debug)]
pub struct InPlaceTarget {
    /// Host offset of the first byte.
    pub host: HostOffset,
    /// The top's open file, pinned for the transfer (`None` when the top
    /// is not a file: write through [`Chain::write_at`]).
    pub file: Option<PinnedFile>,
    /// While a live commit mirrors or drains the chain: held until the
    /// data is written, then dropped.
    pub hold: Option<super::TransferHold>,
}

impl Chain {
    pub(super) fn check_range(&self, offset: u64, len: u64) -> Result<(), Error> {
        let size = self.virtual_size();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::new(
                self.top().path(),
                ErrorKind::OutOfRange { offset, len, size },
            ));
        }
        Ok(())
    }

    pub(super) fn check_ticket(&self, ticket: &TransferTicket) -> Result<(), Error> {
        if ticket.is_from(&self.fence) {
            Ok(())
        } else {
            Err(Error::new(self.top().path(), ErrorKind::ForeignTicket))
        }
    }

    /// An I/O error of layer `index`'s file (`WouldBlock` kept as such:
    /// a lookup that may not wait).
    pub(super) fn layer_io(&self, index: LayerIndex, e: std::io::Error) -> Error {
        let kind = match e.kind() {
            std::io::ErrorKind::WouldBlock => ErrorKind::WouldBlock,
            _ => e.into(),
        };
        Error::new(self.layers[index.0].path(), kind)
    }

    /// Reads guest bytes at `offset` into `buf`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        self.check_range(offset, buf.len() as u64)?;
        self.check_readable()?;
        let _ticket = self.fence.begin();
        if let Some(readahead) = &self.readahead {
            self.fetch_ahead(readahead, offset, buf.len() as u64);
        }
        self.read_from(self.top_index(), buf, offset, ReadPattern::Stream)
    }

    /// Reads what layer `index` and the layers below it hold at `offset`;
    /// zeros beyond that layer's virtual size. The caller holds a ticket.
    fn read_from(
        &self,
        index: LayerIndex,
        buf: &mut [u8],
        offset: u64,
        pattern: ReadPattern,
    ) -> Result<(), Error> {
        let size = self.layers[index.0].virtual_size();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = GuestOffset(offset + done as u64);
            if pos.0 >= size {
                buf[done..].fill(0);
                break;
            }
            let want = ((buf.len() - done) as u64).min(size - pos.0);
            let extent = if index == self.top_index() {
                self.resolve(pos, want, false)?
            } else {
                self.resolve_from(index, pos, want, false)?
            };
            let n = extent.len as usize;
            let out = &mut buf[done..done + n];
            if index == self.top_index() && extent.layer != index {
                if let Some(drain) = self.drain() {
                    // Not the top's: the base's writer has the fresh view.
                    drain.target.read_at(out, pos.0)?;
                    done += n;
                    continue;
                }
            }
            let layer = &self.layers[extent.layer.0];
            if !matches!(extent.kind, ExtentKind::Zero { .. }) {
                self.count_data_read(extent.layer);
            }
            match extent.kind {
                ExtentKind::Zero { .. } => out.fill(0),
                ExtentKind::Data { host } => pattern
                    .read(&**layer.storage(), out, host.0)
                    .map_err(|e| Error::new(layer.path(), e.into()))?,
                ExtentKind::Compressed(d) => self.read_compressed(layer, d, pos, out, pattern)?,
            }
            done += n;
        }
        Ok(())
    }

    /// Whether layer `index` and the layers below it read as zeros over
    /// `[offset, offset + len)`, from the mappings alone.
    fn reads_as_zeros_from(&self, index: LayerIndex, offset: u64, len: u64) -> Result<bool, Error> {
        let size = self.layers[index.0].virtual_size();
        let end = (offset + len).min(size);
        let mut pos = offset;
        while pos < end {
            let extent = self.resolve_from(index, GuestOffset(pos), end - pos, false)?;
            if !matches!(extent.kind, ExtentKind::Zero { .. }) {
                return Ok(false);
            }
            pos += extent.len;
        }
        Ok(true)
    }

    fn read_compressed(
        &self,
        layer: &Layer,
        d: CompressedDescriptor,
        pos: GuestOffset,
        out: &mut [u8],
        pattern: ReadPattern,
    ) -> Result<(), Error> {
        let Some(header) = layer.header() else {
            return Err(Error::new(
                layer.path(),
                ErrorKind::Io(std::io::Error::other("compressed cluster in a raw file")),
            ));
        };
        let g = header.geometry;
        let cluster =
            read_compressed_cluster(&**layer.storage(), header.compression_type, g, d, pattern)
                .map_err(|k| Error::new(layer.path(), k))?;
        let from = g.offset_in_cluster(pos.0) as usize;
        out.copy_from_slice(&cluster[from..from + out.len()]);
        Ok(())
    }

    /// Calls `each(offset, len)` for every piece of `[offset, offset + len)`
    /// that lies within one cluster of the top.
    fn for_each_cluster(
        &self,
        offset: u64,
        len: u64,
        mut each: impl FnMut(GuestOffset, u64) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let cluster_size = self.cluster_size();
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = (cluster_size - pos % cluster_size).min(end - pos);
            each(GuestOffset(pos), n)?;
            pos += n;
        }
        Ok(())
    }

    /// Writes `buf` at guest `offset` into the top.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), Error> {
        self.note_guest_change(offset, buf.len() as u64)?;
        let written = self.write_top(buf, offset);
        // Even after an error: part of the range may have changed.
        self.mirror_change(offset, buf.len() as u64);
        written
    }

    /// Sets the bits of the top's enabled persistent bitmaps for a change
    /// of `[offset, offset + len)` (even if it then fails, as QEMU does),
    /// marking them in use in the image first if a close stored them.
    fn note_guest_change(&self, offset: u64, len: u64) -> Result<(), Error> {
        match &self.active {
            Some(active) => active.note_guest_change(offset, len),
            None => Ok(()),
        }
    }

    /// [`Chain::write_at`] without the mirror; while a drain runs, each
    /// cluster the top does not decide is written into the base.
    fn write_top(&self, buf: &[u8], offset: u64) -> Result<(), Error> {
        self.check_range(offset, buf.len() as u64)?;
        let drain = self.drain();
        self.for_each_cluster(offset, buf.len() as u64, |pos, n| {
            let data = &buf[(pos.0 - offset) as usize..(pos.0 - offset + n) as usize];
            let Some(drain) = &drain else {
                return self.write_top_cluster(data, pos);
            };
            // Held everywhere: a cluster the copier is unmapping reads as
            // not the top's before its unmapping is journaled and
            // published, which the copier does under its hold.
            let _held = drain.share(pos.0, pos.0 + n);
            if self.top_decides(pos)? {
                self.write_top_cluster(data, pos)
            } else {
                drain.routed(n, drain.target.write_at(data, pos.0))
            }
        })
    }

    /// Writes `data` (within one cluster) at `pos` into the top.
    fn write_top_cluster(&self, data: &[u8], pos: GuestOffset) -> Result<(), Error> {
        let active = self.active()?;
        // In-place pieces are transfers to clusters a flush may release.
        let _ticket = self.fence.begin();
        let changed = |o: GuestOffset, n: u64| self.mapping_changed(o, n);
        active.write_cluster(data, pos, &BelowTop(self), &changed)
    }

    /// Makes `[offset, offset + len)` read as zeros. Whole clusters become
    /// zero clusters (with `unmap`, their space is released); partial ones
    /// are written with zeros.
    pub fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> Result<(), Error> {
        self.note_guest_change(offset, len)?;
        let done = self.zero_range(offset, len, Zeroing::Zeroes { unmap }, true);
        self.mirror_change(offset, len);
        done
    }

    /// Discards `[offset, offset + len)`: whole clusters have their space
    /// released and read as zeros afterwards; partial clusters, and every
    /// cluster of a v2 image over a backing file (no zero flag), are left
    /// as they are (discard is advisory, as in QEMU).
    pub fn discard(&self, offset: u64, len: u64) -> Result<(), Error> {
        self.note_guest_change(offset, len)?;
        let done = self.zero_range(offset, len, Zeroing::Discard, false);
        self.mirror_change(offset, len);
        done
    }

    /// Zeroes or discards whole clusters as metadata (writing zeros where
    /// the image cannot express zeros) and, if `partial`, writes zeros over
    /// the partial clusters at the ends.
    fn zero_range(&self, offset: u64, len: u64, how: Zeroing, partial: bool) -> Result<(), Error> {
        self.check_range(offset, len)?;
        let active = self.active()?;
        let cluster_size = self.cluster_size();
        let size = self.virtual_size();
        let zeros = vec![0u8; cluster_size as usize];
        let changed = |o: GuestOffset, n: u64| self.mapping_changed(o, n);
        let drain = self.drain();
        self.for_each_cluster(offset, len, |pos, n| {
            let whole = n == cluster_size || pos.0 + n == size && pos.0 % cluster_size == 0;
            if !whole && !partial {
                return Ok(());
            }
            let _held = match &drain {
                Some(drain) => {
                    let held = drain.share(pos.0, pos.0 + n);
                    if !self.top_decides(pos)? {
                        let target = &drain.target;
                        return drain.routed(
                            n,
                            match how {
                                Zeroing::Discard if whole => target.discard(pos.0, n),
                                Zeroing::Zeroes { unmap } => target.write_zeroes(pos.0, n, unmap),
                                _ => Ok(()),
                            },
                        );
                    }
                    Some(held)
                }
                None => None,
            };
            if whole && active.zero_cluster(pos, how, &changed)? {
                return Ok(());
            }
            self.write_top_cluster(&zeros[..n as usize], pos)
        })
    }

    /// Makes every completed write durable, metadata in crash-safe order.
    /// Clusters released before it become reusable once every transfer
    /// that may still use them has ended (now, or at a later flush); it
    /// never waits for a transfer, so it may be called from anywhere, a
    /// ticket holder included.
    /// After a live snapshot, until the old top is closed
    /// ([`crate::Handover::retire`], [`crate::Handover::close_unclosed_below`]), the old top
    /// is flushed too (its last tables
    /// written back, the file synced): writes the guest completed there
    /// before the switch are durable once a flush after it completes.
    pub fn flush(&self) -> Result<(), Error> {
        if let Some(active) = &self.active {
            active.flush(&self.fence)?;
        }
        self.flush_below()?;
        self.flush_mirror();
        if let Some(drain) = self.drain() {
            // The base holds guest writes of its own: after the top,
            // whose unmappings must be durable before them.
            drain.target.flush()?;
        }
        Ok(())
    }

    /// Flushes the old tops live snapshots left below this chain's top
    /// whose writers have not closed them (see [`crate::Handover::successor`]).
    fn flush_below(&self) -> Result<(), Error> {
        for below in self.unclosed_below() {
            below.writer.flush(&below.fence)?;
        }
        Ok(())
    }

    /// The old tops below this chain's top that flushes flush too (a
    /// copy: no lock is held across their flushes).
    pub(crate) fn unclosed_below(&self) -> Vec<UnclosedTop> {
        self.unclosed_below
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The old top `writer` wrote below this chain's top is closed (all
    /// its tables durable in its file): flushes no longer flush it.
    pub(crate) fn below_closed(&self, writer: &Arc<Active>) {
        self.unclosed_below
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|b| !Arc::ptr_eq(&b.writer, writer));
    }

    /// Flushes like [`Chain::close`] (lazy refcounts written, dirty bit
    /// cleared, old tops left open below closed) but keeps the chain open:
    /// the images are clean for any reader until the next write.
    pub fn flush_clean(&self) -> Result<(), Error> {
        if let Some(active) = &self.active {
            active.close(&self.fence)?;
        }
        self.handover().close_unclosed_below()
    }

    /// Flushes and leaves the image clean (clears the dirty bit of lazy
    /// refcounts), and closes the old tops live snapshots left open below
    /// it ([`crate::Handover::close_unclosed_below`]). Read-only chains close
    /// trivially.
    pub fn close(mut self) -> Result<(), Error> {
        if let Some(active) = self.active.take() {
            active.close(&self.fence)?;
        }
        self.handover().close_unclosed_below()
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        let Some(active) = self.active.take() else {
            return;
        };
        if active.ended_quietly() {
            return;
        }
        if let Some(reason) = active.failure() {
            tracing::warn!(
                path = %self.top().path().display(),
                reason,
                "not writing metadata back: the engine failed"
            );
            return;
        }
        if let Err(e) = active.close(&self.fence) {
            tracing::error!(path = %self.top().path().display(), error = %e, "closing the image failed");
        }
        if let Err(e) = self.handover().close_unclosed_below() {
            tracing::error!(error = %e, "closing an old top of a live snapshot failed: the next read-write open repairs it");
        }
    }
}

/// The guest view of the layers below the top, immutable while the chain
/// is open (no ticket needed).
struct BelowTop<'a>(&'a Chain);

impl crate::active::Below for BelowTop<'_> {
    fn read(&self, buf: &mut [u8], at: GuestOffset) -> Result<(), Error> {
        match self.0.top_index().0.checked_sub(1) {
            // A copy-on-write's source.
            Some(i) => self
                .0
                .read_from(LayerIndex(i), buf, at.0, ReadPattern::Once),
            None => {
                buf.fill(0);
                Ok(())
            }
        }
    }

    fn reads_as_zeros(&self, at: GuestOffset, len: u64) -> Result<bool, Error> {
        match self.0.top_index().0.checked_sub(1) {
            Some(i) => self.0.reads_as_zeros_from(LayerIndex(i), at.0, len),
            None => Ok(true),
        }
    }
}

impl Durability<'_> {
    /// Writes the metadata of every completed write, discard and
    /// write-zeroes to the top's file (the kernel's page cache), without
    /// the final sync of a flush: once it returns, a death of this process
    /// (`kill -9`, a crash, an upgrade) loses none of them, and every file
    /// is consistent for a reader. The data and refcounts the new mappings
    /// point to are synced first, so a power loss before the next
    /// [`Chain::flush`] leaves at worst leaked clusters, as always. Cheap
    /// when nothing changed. A daemon calls it before it completes a write
    /// that [`crate::Durability::needs_publish`], and in the background as a
    /// checkpoint of the journal (concurrent calls are served in turn;
    /// batch them). After a live snapshot, until the old top is closed,
    /// what the old top still needs published (a change made before the
    /// switch) is published too, which may wait for that close.
    pub fn publish(&self) -> Result<(), Error> {
        if let Some(active) = &self.chain.active {
            active.publish()?;
        }
        for below in self.chain.unclosed_below() {
            if below.writer.needs_publish() {
                below.writer.publish()?;
            }
        }
        if let Some(drain) = self.chain.drain() {
            // The base takes the guest's writes the top no longer decides.
            drain.target.durability().publish()?;
        }
        Ok(())
    }

    /// Whether an early write-back of the top's tables is due and left to
    /// the caller ([`crate::ChainOptions::background_write_back`]): true
    /// once per time it became due, and the caller then runs
    /// [`crate::Durability::publish`], off the path of any request.
    pub fn take_write_back_due(&self) -> bool {
        self.chain
            .active
            .as_ref()
            .is_some_and(|a| a.take_write_back_due())
    }

    /// Starts the mapping journal again if [`crate::Chain::flush_clean`] ended it
    /// (the image is then dirty again): call before the guest writes on
    /// (a frontend connects, a pause ends), so that its changes are
    /// journaled from the first, instead of the first one restarting the
    /// journal and waiting, with every change after it, for a publish
    /// that syncs everything written since. A no-op otherwise.
    pub fn resume_journal(&self) {
        if let Some(active) = &self.chain.active {
            active.resume_journal_now();
        }
    }

    /// Whether a completed change is neither in the mapping journal nor
    /// in the file yet, so that [`crate::Durability::publish`] must run before a
    /// process death could not lose it (always false for a read-only
    /// chain). Cheap: a caller asks before it completes each write. With
    /// a journal (qcow2 v3 whose directory can hold `<top>.sqjournal`),
    /// only changes whose L2 table is not in the file yet need it.
    pub fn needs_publish(&self) -> bool {
        self.chain
            .active
            .as_ref()
            .is_some_and(|a| a.needs_publish())
            || self
                .chain
                .drain()
                .is_some_and(|d| d.target.durability().needs_publish())
    }

    /// For a chain opened read-only: the changes a writer of the top that
    /// did not close it left in its mapping journal (this boot's, still
    /// named by the image) and that are not in the image yet; a
    /// read-write open replays them. `None`: no such journal.
    pub fn journal_pending(&self) -> Option<usize> {
        if self.chain.active.is_some() {
            return None;
        }
        let top = self.chain.top();
        crate::active::pending_journal(
            self.chain.top_place.as_ref()?,
            top.storage().file_id(),
            top.header()?,
        )
    }

    /// Journal records that no checkpoint ([`crate::Durability::publish`]) covers yet.
    pub fn journal_backlog(&self) -> u64 {
        self.chain
            .active
            .as_ref()
            .map_or(0, |a| a.journal_backlog())
    }

    /// Whether completed changes are journaled now (see
    /// [`crate::Durability::needs_publish`]).
    pub fn journaled(&self) -> bool {
        self.chain.active.as_ref().is_some_and(|a| a.journaled())
    }

    /// Syncs the writable top's file as it is (the data written so far),
    /// writing no metadata back and holding nothing a writer waits for: a
    /// [`Chain::flush`] right after has little left to sync while it holds
    /// the flush order, which writes that must publish wait for. A
    /// read-only chain has nothing to sync.
    pub fn sync_data(&self) -> Result<(), Error> {
        if self.chain.active.is_none() {
            return Ok(());
        }
        let top = self.chain.top();
        top.storage()
            .sync()
            .map_err(|e| Error::new(top.path(), e.into()))
    }
}

/// Where a write of a cluster the draining top no longer decides may go
/// straight to the base's file (the base's ticket held with it).
fn in_place_in_base(
    drain: &super::drain::Drain,
    offset: GuestOffset,
    len: u64,
) -> Result<Option<InPlaceTarget>, Error> {
    let base = drain.target.transfers();
    let ticket = base.begin();
    Ok(base
        .in_place_target(&ticket, offset, len)?
        .map(|target| InPlaceTarget {
            hold: Some(super::TransferHold::ticket(ticket)),
            ..target
        }))
}

impl Transfers<'_> {
    /// A ticket for a transfer about to look mappings up; hold it until the
    /// transfer's data has moved.
    pub fn begin(&self) -> TransferTicket {
        self.chain.fence.begin()
    }

    /// Transfers in flight (tickets held).
    pub fn in_flight(&self) -> usize {
        self.chain.fence.in_flight()
    }

    /// The first run of `[start, start + max)` with one mapping, for a read
    /// transfer that holds `ticket`; counts a data read of the layer.
    pub fn resolve_for_read(
        &self,
        ticket: &TransferTicket,
        start: GuestOffset,
        max: u64,
    ) -> Result<ReadExtent, Error> {
        self.chain.check_ticket(ticket)?;
        self.chain.check_range(start.0, max)?;
        self.chain.check_readable()?;
        let extent = self.chain.resolve(start, max, false)?;
        let mut hold = None;
        let file = match extent.kind {
            ExtentKind::Data { host } => {
                let storage = self.chain.storage_of(extent.layer);
                match storage
                    .pinned_file()
                    .map_err(|e| self.chain.layer_io(extent.layer, e))?
                {
                    Some(file) => Some(file),
                    // A layer in an object store: its cache file where it
                    // holds the range (else the read fetches it).
                    None => storage.pin_cached(host.0, extent.len).map(|(file, pin)| {
                        hold = Some(super::TransferHold::cached(pin));
                        if let Some(readahead) = &self.chain.readahead {
                            self.chain.fetch_ahead(readahead, start.0, extent.len);
                        }
                        file
                    }),
                }
            }
            _ => None,
        };
        if extent.layer != self.chain.top_index() {
            if let Some(drain) = self.chain.drain() {
                // Not the top's: read where the base's writer says, under
                // its own ticket.
                let base = drain.target.transfers();
                let ticket = base.begin();
                let mut read = base.resolve_for_read(&ticket, start, extent.len)?;
                let ticket = super::TransferHold::ticket(ticket);
                read.hold = Some(match read.hold.take() {
                    Some(cached) => cached.and(ticket),
                    None => ticket,
                });
                return Ok(read);
            }
        }
        if !matches!(extent.kind, ExtentKind::Zero { .. }) {
            self.chain.count_data_read(extent.layer);
        }
        Ok(ReadExtent { extent, file, hold })
    }

    /// [`crate::Transfers::resolve_for_read`] from cached metadata only: `None` when
    /// it would have to read a metadata slice from a file (the caller then
    /// resolves where it may wait). For threads that serve many requests
    /// and must not stall them on one cache miss.
    pub fn try_resolve_for_read(
        &self,
        ticket: &TransferTicket,
        start: GuestOffset,
        max: u64,
    ) -> Result<Option<ReadExtent>, Error> {
        let _scope = crate::nowait::NoMetadataIo::enter();
        match self.chain.transfers().resolve_for_read(ticket, start, max) {
            Ok(read) => Ok(Some(read)),
            Err(e) if matches!(e.kind, ErrorKind::WouldBlock) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Where a write of `len` bytes at guest `offset` (within one cluster)
    /// may go straight to the top's file, for a transfer that holds
    /// `ticket`: `None` when the write needs the engine (allocation,
    /// copy-on-write, zero, compressed or shared cluster).
    pub fn in_place_target(
        &self,
        ticket: &TransferTicket,
        offset: GuestOffset,
        len: u64,
    ) -> Result<Option<InPlaceTarget>, Error> {
        self.chain.check_ticket(ticket)?;
        self.chain.check_range(offset.0, len)?;
        let active = self.chain.active()?;
        let cluster_size = self.chain.cluster_size();
        if len == 0 || offset.0 % cluster_size + len > cluster_size {
            return Ok(None);
        }
        // Taken before the lookup: the write may land any time after.
        let hold = match self.chain.drain() {
            Some(drain) => {
                // Held first (see `write_top`); never waited for here.
                let start = offset.0 - offset.0 % cluster_size;
                let Some(held) = drain.try_share(start, start + cluster_size) else {
                    return Ok(None);
                };
                if !active.decides(offset)? {
                    // The base's: in place there, under its own ticket;
                    // the top's bitmaps mark it all the same.
                    drop(held);
                    if !active.note_in_place_change(offset.0, len) {
                        return Ok(None);
                    }
                    return in_place_in_base(&drain, offset, len);
                }
                Some(super::TransferHold::range(held))
            }
            None => match self.chain.in_place_mark(offset.0, len) {
                Ok(mark) => mark.map(super::TransferHold::mark),
                Err(()) => return Ok(None),
            },
        };
        let Some(host) = active.in_place_target(offset, len)? else {
            return Ok(None);
        };
        // Bits first; a store that cleared the in-use flag means the
        // engine marks them in use again first (it may write).
        if !active.note_in_place_change(offset.0, len) {
            return Ok(None);
        }
        let file = self
            .chain
            .top()
            .storage()
            .pinned_file()
            .map_err(|e| Error::new(self.chain.top().path(), e.into()))?;
        Ok(Some(InPlaceTarget { host, file, hold }))
    }

    /// [`crate::Transfers::in_place_target`] from cached metadata only: `None` also
    /// when telling would need a metadata read (the write then goes
    /// through the engine, which may wait).
    pub fn try_in_place_target(
        &self,
        ticket: &TransferTicket,
        offset: GuestOffset,
        len: u64,
    ) -> Result<Option<InPlaceTarget>, Error> {
        let _scope = crate::nowait::NoMetadataIo::enter();
        match self.chain.transfers().in_place_target(ticket, offset, len) {
            Err(e) if matches!(e.kind, ErrorKind::WouldBlock) => Ok(None),
            other => other,
        }
    }
}
