//! The writable top's metadata in memory: the L1 table, the L2 tables
//! under modification, the refcounts and the allocations in flight. It
//! lives behind [`super::Active`]'s lock; lookups need shared access only.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;

use crate::dirty::DirtyPages;
use crate::entry::{CompressedDescriptor, COMPRESSED, COPIED, OFFSET_MASK, ZERO};
use crate::error::{Error, ErrorKind};
use crate::fence::FenceCut;
use crate::header::{Header, Version};
use crate::layer::{clip_to_l2, read_l2_table, read_words, validate_l2_offset};
use crate::layer::{L2Slice, LayerStatus};
use crate::refcount::Refcounts;
use crate::storage::Storage;
use crate::summary::TopSummary;
use crate::types::{Geometry, GuestCluster, GuestOffset, HostOffset};
use sqcow2_cache::{Slice, SliceCache, SliceKey, Source};

use super::claim::ClaimCell;
use super::held_table::HeldTable;
use super::journal::{Journal, MetadataWrite, Reservation};
use super::overlap::MetadataClusters;
use super::spares::Spares;

/// Tables under modification stay in memory until a flush writes them, and
/// stay there once written while they fit in this share of the cache
/// budget (the least recently changed go back to the cache first); when
/// tables that cannot go back (dirty or pinned) alone take more, their
/// metadata is written back early.
const RESIDENT_SHARE_OF_BUDGET: u64 = 2;

/// What does not change while the top is open: its file, geometry and
/// where its clean metadata is cached.
#[derive(Debug)]
pub(crate) struct TopFile {
    pub(crate) path: PathBuf,
    /// Its directory (opened once) and name: its journal is made there.
    pub(crate) place: Option<crate::sidefile::ImagePlace>,
    /// The files of the layers below it when it was opened (named in a
    /// refusal when one of them is where its journal would go).
    pub(crate) below: Vec<crate::sidefile::FileId>,
    pub(crate) storage: Arc<dyn Storage>,
    pub(crate) geometry: Geometry,
    pub(crate) version: Version,
    pub(crate) lazy_refcounts: bool,
    pub(crate) has_backing: bool,
    pub(crate) cache: Arc<SliceCache>,
    /// The top's source in the cache.
    pub(crate) source: Source,
    pub(crate) slice_size: u64,
    pub(crate) cache_budget: u64,
    /// Regions of the top known to be empty (indexed mode), kept up to date.
    pub(crate) summary: Option<Arc<TopSummary>>,
    /// Test hooks.
    pub(crate) faults: crate::fault::Faults,
}

impl TopFile {
    pub(crate) fn err(&self, kind: ErrorKind) -> Error {
        Error::new(&self.path, kind)
    }

    pub(crate) fn io(&self, e: std::io::Error) -> Error {
        self.err(e.into())
    }

    /// 64-bit words per L2 entry.
    pub(crate) fn words(&self) -> usize {
        if self.geometry.extended_l2 {
            2
        } else {
            1
        }
    }
}

/// An L2 table taken out of the cache to be modified. It stays resident
/// once written (clean) while there is room, so that a steady stream of
/// writes does not move it between the cache and this set at every
/// write-back.
#[derive(Debug)]
pub(crate) struct L2Slot {
    pub(crate) table: HeldTable,
    /// When the table was last loaded or changed ([`ActiveState`]'s clock),
    /// for choosing which clean tables go back to the cache.
    pub(crate) used: u64,
    /// The parts of the table changed since a write-back last took it.
    pub(crate) dirty: DirtyPages,
    /// The parts a write-back took and has not written yet (a change made
    /// meanwhile marks its page in `dirty` again): not in the file yet,
    /// and put back into `dirty` if the write-back fails.
    pub(crate) writing: DirtyPages,
    /// Allocations in flight that will commit into this table: it stays
    /// here until they have.
    pub(crate) pins: u32,
    /// What the file holds at the table's place is a valid table (loaded
    /// from it, written since, or a spare's zeros, which read as an empty
    /// table), so that a journal record of one entry may be replayed on
    /// its own. A copy of a shared table, or a new one not made from a
    /// spare, is not until a write-back has written it.
    pub(crate) journal_safe: bool,
    /// The L1 entry naming this table is in the file (a write-back that
    /// wrote it has completed, or the table was loaded from the file):
    /// journal records of its entries need no record of the L1 entry.
    pub(crate) l1_in_file: bool,
}

/// Changed table pages worth a write-back of their own (512 KiB): a flush
/// writes what changed since the last write-back, so a server that writes
/// back in the background at this mark keeps what a flush waits for
/// bounded, however many tables change between two flushes (measured at
/// 1,000-1,600 pages per flush under random allocating writes otherwise).
pub(crate) const WRITE_BACK_PAGES: u64 = 128;

/// How much the tables under change take against their share of the
/// cache ([`ActiveState::settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Residency {
    Within,
    /// Within it, but [`WRITE_BACK_PAGES`] or more pages changed since the
    /// last write-back: worth writing back in the background (where a
    /// server's flusher can), so that a guest's flush has little left.
    ManyChanged,
    /// Over it: their metadata should be written back soon.
    Over,
    /// Over four times it: written back now, by the write that found it.
    FarOver,
}

/// Whether a write may go straight to the top's own cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InPlace {
    /// Yes, at this host offset.
    At(HostOffset),
    /// No: the write needs the engine.
    No,
    /// Cannot tell without loading metadata (needs exclusive access).
    Unknown,
}

/// Mutable metadata of the active volume.
#[derive(Debug)]
pub(crate) struct ActiveState {
    pub(crate) top: Arc<TopFile>,
    pub(crate) header: Header,
    pub(crate) l1: Vec<u64>,
    pub(crate) dirty_l1: BTreeSet<usize>,
    pub(crate) l2: HashMap<u64, L2Slot>,
    /// Ticks at every load or change of a table in `l2`.
    clock: u64,
    pub(crate) refcounts: Refcounts,
    /// Guest clusters whose allocation is in flight.
    pub(crate) claims: HashMap<GuestCluster, Arc<ClaimCell>>,
    /// Releases written out by a flush, waiting for the transfers that
    /// may still use their clusters (in cut order).
    pub(crate) deferred_frees: VecDeque<(FenceCut, Vec<u64>)>,
    /// Clusters holding the top's own metadata.
    pub(crate) metadata: MetadataClusters,
    pub(crate) dirty_bit_on_disk: bool,
    /// Clusters ready for allocations that need no sync before their
    /// mapping is written.
    pub(crate) spares: Spares,
    /// The syncs the next write-back owes to what changed since the last.
    pub(crate) order: OrderNeeds,
    /// Spares were added since the last write-back (which must sync
    /// before it writes any mapping).
    pub(crate) spares_unsynced: bool,
    /// The mapping journal, while one is active.
    pub(crate) journal: Option<Arc<Journal>>,
    /// Mapping changes made so far (commits, zeroed clusters): the
    /// horizon a write-back covers.
    pub(crate) changes: u64,
    /// Pages of tables under change marked since the last write-back took
    /// them (what the next one writes).
    pub(crate) changed_pages: u64,
}

impl ActiveState {
    /// Takes over an opened image for writing: reads its L1 table and
    /// refcount table.
    pub(crate) fn open(top: Arc<TopFile>, header: Header) -> Result<Self, Error> {
        let mut raw = vec![0u8; header.l1_size as usize * 8];
        top.storage
            .read_at(&mut raw, header.l1_table_offset)
            .map_err(|e| top.io(e))?;
        let l1: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| crate::bytes::be_u64(c, 0))
            .collect();
        let refcounts = Refcounts::load(
            &*top.storage,
            header.refcount_order,
            header.geometry.cluster_bits,
            header.refcount_table_offset,
            header.refcount_table_clusters,
        )
        .map_err(|k| top.err(k))?;
        let metadata =
            MetadataClusters::build(&header, &l1, refcounts.table_entries(), &*top.storage)
                .map_err(|k| top.err(k))?;
        let header_cluster_bits = header.geometry.cluster_bits;
        let v3 = header.version == Version::V3;
        Ok(Self {
            metadata,
            dirty_bit_on_disk: header.is_dirty(),
            header,
            l1,
            dirty_l1: BTreeSet::new(),
            l2: HashMap::new(),
            clock: 0,
            refcounts,
            claims: HashMap::new(),
            deferred_frees: VecDeque::new(),
            spares: Spares::new(header_cluster_bits, v3),
            order: OrderNeeds::default(),
            spares_unsynced: false,
            journal: None,
            changes: 0,
            changed_pages: 0,
            top,
        })
    }

    fn g(&self) -> Geometry {
        self.top.geometry
    }

    /// Virtual size of the disk.
    pub(crate) fn size(&self) -> u64 {
        self.header.virtual_size()
    }

    pub(crate) fn l1_entry(&self, guest: GuestOffset) -> u64 {
        usize::try_from(self.g().l1_index(guest))
            .ok()
            .and_then(|i| self.l1.get(i))
            .copied()
            .unwrap_or(0)
    }

    /// The cached slice of the (clean) table at `l2_offset` covering
    /// `guest`; a miss reads it from the file (a metadata read under the
    /// caller's lock, shared or not: the table cannot change meanwhile).
    fn cached_slice(&self, l2_offset: u64, guest: GuestOffset) -> Result<(L2Slice, Slice), Error> {
        let g = self.g();
        let top = &self.top;
        let slice = L2Slice::locate(g, l2_offset, guest, top.slice_size);
        let key = SliceKey {
            source: top.source,
            offset: slice.offset,
        };
        let words = top
            .cache
            .get_or_load(key, || {
                crate::nowait::may_load()?;
                validate_l2_offset(g, l2_offset, top.storage.len()?)?;
                read_words(&*top.storage, slice.offset, slice.words)
            })
            .map_err(|k| top.err(k))?;
        Ok((slice, words))
    }

    /// The raw L2 entry and bitmap of the cluster at `guest` (`None` where
    /// the L1 entry is empty).
    pub(crate) fn raw_entry(&self, guest: GuestOffset) -> Result<Option<(u64, u64)>, Error> {
        let g = self.g();
        let l2_offset = self.l1_entry(guest) & OFFSET_MASK;
        if l2_offset == 0 {
            return Ok(None);
        }
        let per = self.top.words();
        if let Some(slot) = self.l2.get(&l2_offset) {
            let i = g.l2_index(guest) as usize * per;
            let bitmap = if per == 2 { slot.table.get(i + 1) } else { 0 };
            return Ok(Some((slot.table.get(i), bitmap)));
        }
        let (slice, words) = self.cached_slice(l2_offset, guest)?;
        let i = (g.l2_index(guest) - slice.first_entry) as usize * per;
        let bitmap = if per == 2 { words[i + 1] } else { 0 };
        Ok(Some((words[i], bitmap)))
    }

    /// Whether the mapping of `guest` changed since the metadata was last
    /// written to the file.
    fn unpublished(&self, guest: GuestOffset) -> bool {
        let g = self.g();
        let l2_offset = self.l1_entry(guest) & OFFSET_MASK;
        let i = g.l2_index(guest) as usize * self.top.words();
        self.l2
            .get(&l2_offset)
            .is_some_and(|s| s.dirty.contains(i * 8) || s.writing.contains(i * 8))
    }

    /// The mapping of `[guest, guest + max)` in the top, as for a read-only
    /// layer.
    pub(crate) fn status(&self, guest: GuestOffset, max: u64) -> Result<(LayerStatus, u64), Error> {
        let g = self.g();
        let max = clip_to_l2(g, guest, max);
        let l2_offset = self.l1_entry(guest) & OFFSET_MASK;
        if l2_offset == 0 {
            return Ok((LayerStatus::Unallocated { host: None }, max));
        }
        if let Some(slot) = self.l2.get(&l2_offset) {
            return slot
                .table
                .status(g, guest, max)
                .map_err(|k| self.top.err(k));
        }
        let (slice, words) = self.cached_slice(l2_offset, guest)?;
        slice
            .status(g, &words, guest, max)
            .map_err(|k| self.top.err(k))
    }

    /// Whether a write of `len` bytes at `guest` (within one cluster) can
    /// go straight to the top's own cluster, looking at loaded metadata
    /// only (shared access).
    pub(crate) fn peek_in_place(
        &self,
        guest: GuestOffset,
        len: u64,
        file_len: u64,
        settled: Settled,
    ) -> Result<InPlace, Error> {
        let g = self.g();
        let Some((entry, bitmap)) = self.raw_entry(guest)? else {
            return Ok(InPlace::No);
        };
        let host = entry & OFFSET_MASK;
        let plain = entry & (COMPRESSED | ZERO) == 0 && entry & COPIED != 0;
        if !plain || host == 0 || g.offset_in_cluster(host) != 0 {
            return Ok(InPlace::No);
        }
        // A mapping not yet in the file: in place only once its change is
        // journaled (its claim ends after that) and no change waits to be
        // published; otherwise through the engine, whose writes are
        // journaled or published before they complete.
        if self.unpublished(guest)
            && (settled == Settled::Unknown || self.claims.contains_key(&g.guest_cluster(guest)))
        {
            return Ok(InPlace::No);
        }
        let in_cluster = g.offset_in_cluster(guest.0);
        if g.extended_l2 {
            let sc = g.subcluster_size();
            let all =
                (in_cluster / sc..=(in_cluster + len - 1) / sc).all(|i| bitmap & (1 << i) != 0);
            if !all {
                return Ok(InPlace::No);
            }
        }
        if self.metadata.contains(host >> g.cluster_bits) {
            // Let the planning under the write lock report the corruption.
            return Ok(InPlace::Unknown);
        }
        match self.refcounts.peek(host >> g.cluster_bits) {
            None => return Ok(InPlace::Unknown),
            Some(1) => {}
            Some(_) => return Ok(InPlace::No),
        }
        if host >= file_len {
            return Ok(InPlace::Unknown);
        }
        Ok(InPlace::At(HostOffset(host + in_cluster)))
    }

    /// Loads what [`ActiveState::peek_in_place`] needs to answer.
    pub(crate) fn load_for_in_place(&mut self, guest: GuestOffset) -> Result<(), Error> {
        if let Some((entry, _)) = self.raw_entry(guest)? {
            let host = entry & OFFSET_MASK;
            if host != 0 {
                self.owned(HostOffset(host))?;
            }
        }
        Ok(())
    }

    /// Whether host cluster `host` is referenced only by the top.
    pub(crate) fn owned(&mut self, host: HostOffset) -> Result<bool, Error> {
        let storage = self.top.storage.clone();
        let rc = self
            .refcounts
            .get(&*storage, host.0 >> self.g().cluster_bits)
            .map_err(|k| self.top.err(k))?;
        Ok(rc == 1)
    }

    /// Takes the whole table at `offset` into the set under modification.
    fn l2_loaded(&mut self, offset: u64) -> Result<(), Error> {
        if self.l2.contains_key(&offset) {
            return Ok(());
        }
        let top = &self.top;
        let file_size = top.storage.len().map_err(|e| top.io(e))?;
        let table = read_l2_table(top.geometry, &*top.storage, offset, file_size)
            .map_err(|k| top.err(k))?;
        // It changes from now on: the cache's copies of its slices (taken
        // by readers, or published when it was clean) would go stale.
        self.forget_cached(offset);
        let used = self.tick();
        self.l2.insert(
            offset,
            L2Slot {
                table: HeldTable::from_words(&table),
                used,
                dirty: DirtyPages::default(),
                writing: DirtyPages::default(),
                pins: 0,
                journal_safe: true,
                l1_in_file: true,
            },
        );
        Ok(())
    }

    /// The L2 table covering `guest`, owned by the top (allocated, or
    /// copied from a shared one, as needed) and loaded; returns its offset.
    pub(crate) fn l2_for_write(&mut self, guest: GuestOffset) -> Result<u64, Error> {
        let g = self.g();
        let l1_index = g.l1_index(guest) as usize;
        let Some(&entry) = self.l1.get(l1_index) else {
            return Err(self.top.err(ErrorKind::OutOfRange {
                offset: guest.0,
                len: 0,
                size: self.size(),
            }));
        };
        let offset = entry & OFFSET_MASK;
        if offset != 0 {
            self.l2_loaded(offset)?;
            if self.owned(HostOffset(offset))? {
                if entry & COPIED == 0 {
                    self.l1[l1_index] = offset | COPIED;
                    self.dirty_l1.insert(l1_index);
                }
                return Ok(offset);
            }
        }
        // A spare reads as zeros on disk, so a table made from one is valid
        // (empty) there whatever part of it a power loss keeps. Otherwise
        // metadata clusters are reserved at once (rare; under the lock),
        // and the table must be durable before the L1 entry points to it;
        // so must a copy, which holds entries.
        let (new, zeroed) = match self.spares.take() {
            Some(spare) => {
                // Its space claimed now, so that writing the table back
                // cannot fail for lack of it (rare; under the lock).
                let storage = self.top.storage.clone();
                if let Err(k) =
                    crate::refcount::reserve_clusters(&*storage, g.cluster_bits, spare, 1)
                {
                    self.unalloc(spare);
                    return Err(self.top.err(k));
                }
                (spare << g.cluster_bits, true)
            }
            None => {
                self.order.tables_before_l1 = true;
                (self.alloc(true)? << g.cluster_bits, false)
            }
        };
        if offset != 0 {
            self.order.tables_before_l1 = true;
        }
        self.metadata.insert(new >> g.cluster_bits);
        // Slices of an older table at that place (freed since) must not
        // be taken for the new one.
        self.forget_cached(new);
        let table = if offset != 0 {
            self.refcounts.free_later(offset >> g.cluster_bits);
            self.l2[&offset].table.clone()
        } else {
            HeldTable::zeroed((g.cluster_size() / 8) as usize)
        };
        let used = self.tick();
        // A new table from a spare reads as zeros in the file already:
        // only the pages changes set are written back (not 64 KiB of
        // zeros per table a fresh top makes). A copy, or a cluster that
        // may hold old bytes, is written whole.
        let clean_on_disk = zeroed && offset == 0;
        let dirty = if clean_on_disk {
            DirtyPages::default()
        } else {
            DirtyPages::all(table.len() * 8)
        };
        self.changed_pages += dirty.count();
        self.l2.insert(
            new,
            L2Slot {
                used,
                dirty,
                writing: DirtyPages::default(),
                table,
                pins: 0,
                journal_safe: clean_on_disk,
                l1_in_file: false,
            },
        );
        self.l1[l1_index] = new | COPIED;
        self.dirty_l1.insert(l1_index);
        Ok(new)
    }

    /// Allocates a cluster (its space reserved now if `reserve`, else by
    /// the caller outside the lock); never one holding metadata, whatever
    /// a hostile image's refcounts say.
    pub(crate) fn alloc(&mut self, reserve: bool) -> Result<u64, Error> {
        let storage = self.top.storage.clone();
        loop {
            let idx = if reserve {
                self.refcounts.alloc(&*storage)
            } else {
                self.refcounts.alloc_unreserved(&*storage)
            }
            .map_err(|k| self.top.err(k))?;
            for placed in self.refcounts.take_placed() {
                self.metadata.insert(placed);
            }
            if !self.metadata.contains(idx) {
                return Ok(idx);
            }
            // A metadata cluster counted as free: it keeps the count of 1
            // it has now, which is right.
            tracing::warn!(
                path = %self.top.path.display(),
                cluster = idx,
                "a metadata cluster had a refcount of 0; not handing it out"
            );
        }
    }

    /// Counts a change of the mappings; when a journal is active and the
    /// change's L2 table allows it, reserves its records: the L2 entry of
    /// `guest` in table `l2` (and its bitmap), and the table's L1 entry if
    /// that is not written yet. `None`: the change is not journaled, and
    /// must be published (a write-back) before it completes.
    pub(crate) fn record_change(&mut self, l2: u64, guest: GuestOffset) -> Option<Reservation> {
        self.changes += 1;
        let journal = self.journal.as_ref()?;
        let slot = self.l2.get(&l2)?;
        if !slot.journal_safe {
            return None;
        }
        let g = self.g();
        let words = self.top.words();
        let i = g.l2_index(guest) as usize * words;
        let at = l2 + i as u64 * 8;
        // The L1 entry first, until a completed write-back has put it in
        // the file (one may have taken it and not written it yet): a
        // replay takes an L2 record only into a table the L1 table names
        // by then.
        let mut writes = Vec::with_capacity(2);
        if !slot.l1_in_file {
            let l1_index = g.l1_index(guest) as usize;
            writes.push(MetadataWrite::one(
                self.header.l1_table_offset + l1_index as u64 * 8,
                self.l1[l1_index],
            ));
        }
        writes.push(if words == 2 {
            MetadataWrite::two(at, slot.table.get(i), slot.table.get(i + 1))
        } else {
            MetadataWrite::one(at, slot.table.get(i))
        });
        journal.reserve(writes)
    }

    /// Returns a cluster counted by [`ActiveState::alloc`] that nothing
    /// references: reusable at once.
    pub(crate) fn unalloc(&mut self, idx: u64) {
        let storage = self.top.storage.clone();
        if let Err(k) = self.refcounts.unalloc(&*storage, idx) {
            tracing::warn!(error = %k, cluster = idx, "could not return an unused cluster");
        }
    }

    /// Applies releases; clusters that became free no longer hold
    /// metadata.
    pub(crate) fn apply_frees(&mut self, frees: &[u64]) -> Result<(), Error> {
        let storage = self.top.storage.clone();
        let freed = self
            .refcounts
            .apply_frees(&*storage, frees)
            .map_err(|k| self.top.err(k))?;
        for c in freed {
            self.metadata.remove(c);
        }
        Ok(())
    }

    /// Refuses `host` as a data cluster for `guest` if it holds metadata.
    pub(crate) fn check_data_cluster(&self, guest: GuestOffset, host: u64) -> Result<(), Error> {
        if self.metadata.contains(host >> self.g().cluster_bits) {
            return Err(self.top.err(ErrorKind::MetadataOverlap {
                guest_offset: guest.0,
                host_offset: host,
            }));
        }
        Ok(())
    }

    /// Entry index, entry and bitmap of `guest` in the loaded table `l2`.
    pub(crate) fn entry_at(&self, l2: u64, guest: GuestOffset) -> (usize, u64, u64) {
        let i = self.g().l2_index(guest) as usize * self.top.words();
        let table = &self.l2[&l2].table;
        let bitmap = if self.top.words() == 2 {
            table.get(i + 1)
        } else {
            0
        };
        (i, table.get(i), bitmap)
    }

    /// Sets entry `i` of the loaded (or pinned) table `l2`.
    ///
    /// # Panics
    ///
    /// If the table is not loaded: a bug, which must not pass as a lost
    /// write. The panic poisons the metadata lock, and the engine refuses
    /// writes from then on.
    pub(crate) fn set_entry(&mut self, l2: u64, i: usize, entry: u64, bitmap: u64) {
        let words = self.top.words();
        let used = self.tick();
        let Some(slot) = self.l2.get_mut(&l2) else {
            panic!("L2 table {l2:#x} is not loaded for a change (a bug)");
        };
        slot.used = used;
        slot.table.set(i, entry);
        if words == 2 {
            slot.table.set(i + 1, bitmap);
        }
        if slot.dirty.mark(i * 8) {
            self.changed_pages += 1;
        }
    }

    pub(crate) fn pin(&mut self, l2: u64) {
        let used = self.tick();
        if let Some(slot) = self.l2.get_mut(&l2) {
            slot.pins += 1;
            slot.used = used;
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    pub(crate) fn unpin(&mut self, l2: u64) {
        if let Some(slot) = self.l2.get_mut(&l2) {
            slot.pins = slot.pins.saturating_sub(1);
        }
    }

    /// Host clusters (indices) that an entry holds a reference to.
    fn referenced_clusters(&self, entry: u64) -> Vec<u64> {
        let g = self.g();
        if entry & COMPRESSED != 0 {
            let d = CompressedDescriptor::decode(entry, g);
            let first = d.offset.0 >> g.cluster_bits;
            let last = (d.offset.0 + d.len - 1) >> g.cluster_bits;
            return (first..=last).collect();
        }
        let host = entry & OFFSET_MASK;
        if host == 0 {
            Vec::new()
        } else {
            vec![host >> g.cluster_bits]
        }
    }

    /// Refuses the release of what `entry` (the mapping of `guest`)
    /// references if that is metadata.
    pub(crate) fn check_releasable(&self, guest: GuestOffset, entry: u64) -> Result<(), Error> {
        match self
            .referenced_clusters(entry)
            .into_iter()
            .find(|&c| self.metadata.contains(c))
        {
            Some(c) => Err(self.top.err(ErrorKind::MetadataOverlap {
                guest_offset: guest.0,
                host_offset: c << self.g().cluster_bits,
            })),
            None => Ok(()),
        }
    }

    /// Queues the release of what `entry` (the mapping of `guest`)
    /// references; refuses to release metadata.
    pub(crate) fn release(&mut self, guest: GuestOffset, entry: u64) -> Result<(), Error> {
        self.check_releasable(guest, entry)?;
        for c in self.referenced_clusters(entry) {
            self.refcounts.free_later(c);
        }
        Ok(())
    }

    /// Moves clean, unpinned tables out of the set under modification into
    /// the cache, least recently used first, while the set takes more than
    /// its share of the budget; how much the tables left (dirty or pinned)
    /// take against it, so that metadata should be written back early.
    pub(crate) fn settle(&mut self) -> Residency {
        let limit = self.top.cache_budget / RESIDENT_SHARE_OF_BUDGET;
        let bytes = |s: &L2Slot| s.table.len() as u64 * 8;
        let mut resident: u64 = self.l2.values().map(bytes).sum();
        if resident <= limit {
            return self.within();
        }
        let mut clean: Vec<(u64, u64)> = self
            .l2
            .iter()
            .filter(|(_, s)| !s.dirty.any() && !s.writing.any() && s.pins == 0)
            .map(|(o, s)| (s.used, *o))
            .collect();
        clean.sort_unstable();
        for (_, offset) in clean {
            if resident <= limit {
                break;
            }
            if let Some(slot) = self.l2.remove(&offset) {
                resident -= bytes(&slot);
                self.publish(offset, &slot.table);
            }
        }
        if resident > limit.saturating_mul(4) {
            Residency::FarOver
        } else if resident > limit {
            Residency::Over
        } else {
            self.within()
        }
    }

    fn within(&self) -> Residency {
        if self.changed_pages >= WRITE_BACK_PAGES {
            Residency::ManyChanged
        } else {
            Residency::Within
        }
    }

    /// Hands the loaded tables over to readers of this image as a backing
    /// layer (after a live snapshot's switch): the most recently used
    /// clean tables, up to `max_bytes`, go to the unified cache; the
    /// others are read from the file when first needed. The work is
    /// bounded by `max_bytes`, whatever the disk size and the cache's
    /// size: the cache holds no stale slice of this image, since a
    /// table's slices leave it when the table is loaded for changes
    /// ([`ActiveState::forget_cached`]) and come back only as it is once
    /// written, so nothing needs dropping first.
    pub(crate) fn publish_recent(&self, max_bytes: u64) {
        let mut recent: Vec<(u64, u64)> = self
            .l2
            .iter()
            .filter(|(_, s)| !s.dirty.any() && !s.writing.any())
            .map(|(o, s)| (s.used, *o))
            .collect();
        recent.sort_unstable_by(|a, b| b.cmp(a));
        let mut bytes = 0;
        for (_, offset) in recent {
            let Some(slot) = self.l2.get(&offset) else {
                continue;
            };
            bytes += slot.table.len() as u64 * 8;
            if bytes > max_bytes {
                break;
            }
            self.publish(offset, &slot.table);
        }
    }

    /// The `words` words at byte `offset` of the file inside the table
    /// at `l2_offset`, if the table is held here (`None` if the slice does
    /// not lie inside it).
    pub(crate) fn held_slice(&self, l2_offset: u64, offset: u64, words: usize) -> Option<Slice> {
        let slot = self.l2.get(&l2_offset)?;
        let first = usize::try_from(offset.checked_sub(l2_offset)? / 8).ok()?;
        slot.table
            .words(first..first.checked_add(words)?)
            .map(Slice::from)
    }

    /// Drops the unified cache's slices of the table at `offset` (a
    /// table taken for changes, or made at a place that held another).
    fn forget_cached(&self, offset: u64) {
        let g = self.g();
        let top = &self.top;
        let slice_bytes = top.slice_size.clamp(g.l2_entry_size(), g.cluster_size());
        for i in 0..g.cluster_size() / slice_bytes {
            top.cache.remove(SliceKey {
                source: top.source,
                offset: offset + i * slice_bytes,
            });
        }
    }

    /// Puts the slices of a clean table into the unified cache.
    pub(crate) fn publish(&self, offset: u64, table: &HeldTable) {
        let g = self.g();
        let top = &self.top;
        let slice_bytes = top.slice_size.clamp(g.l2_entry_size(), g.cluster_size());
        let words = (slice_bytes / 8) as usize;
        let len = table.len();
        for (i, first) in (0..len).step_by(words).enumerate() {
            let Some(chunk) = table.words(first..(first + words).min(len)) else {
                continue;
            };
            let key = SliceKey {
                source: top.source,
                offset: offset + i as u64 * slice_bytes,
            };
            top.cache.insert(key, chunk.into());
        }
    }
}

/// The syncs that changes since the last write-back depend on.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OrderNeeds {
    /// Data that new mappings point to must be durable before the L2
    /// entries are written.
    pub(crate) data_before_l2: bool,
    /// New L2 tables must be durable before the L1 entries pointing to
    /// them are written (a table that may not read as zeros on disk, or
    /// a copy holding entries).
    pub(crate) tables_before_l1: bool,
}

impl OrderNeeds {
    pub(crate) fn merge(&mut self, other: OrderNeeds) {
        self.data_before_l2 |= other.data_before_l2;
        self.tables_before_l1 |= other.tables_before_l1;
    }
}

/// Whether the mappings changed since the last write-back are safe from a
/// process death once their claims have ended, as far as the caller can
/// tell (read under the metadata lock, after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// A journal is active and every change it did not take is published.
    Journaled,
    /// Not known: such a mapping must be published first.
    Unknown,
}
