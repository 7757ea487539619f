//! Writing metadata back. What waits to be written is taken under the
//! metadata lock ([`WriteBack`]) and written with no lock held, in an order
//! that leaves the file consistent for a reader at every moment and after a
//! power loss at any point:
//!
//! 1. guest data and refcount blocks, then one sync (new clusters are
//!    counted, and hold their data, before anything points to them); then
//!    the refcount table and the header when they changed, each synced;
//! 2. the changed parts of L2 tables; then, if L1 entries changed, a sync
//!    (the tables they point to are complete) and the L1 entries;
//! 3. for a flush only ([`Durability::Durable`]): a final sync, then the
//!    decrements of clusters no longer referenced, which only then become
//!    free for reuse, and only once every transfer that may still use them
//!    has ended (the transfer fence): at this flush if they have, else at a
//!    later one.
//!
//! A *publish* ([`Durability::Published`]) stops after step 2: the mappings
//! of completed writes are in the files (the kernel's page cache), so a
//! process death loses none of them, and since the data and refcounts they
//! point to are already durable, whatever the kernel writes back before
//! the next flush leaves at worst leaked clusters after a power loss.
//!
//! The syncs of steps 1 and 2 are skipped where nothing depends on them
//! ([`OrderNeeds`]): new mappings onto spares over a view of zeros, a new
//! L2 table made from a spare, zeroed entries. A publish of such changes
//! writes pages, with no sync at all.
//!
//! With lazy refcounts the refcount writes are deferred to a clean close,
//! and the dirty bit is set on disk before the first metadata write.

use crate::error::Error;
use crate::features::INCOMPAT_DIRTY;
use crate::fence::{FenceCut, TransferFence};
use crate::header::field;
use crate::refcount::RefcountSnapshot;

use super::held_table::PageRun;
use super::journal::Journal;
use super::state::{ActiveState, OrderNeeds, TopFile};
use std::sync::Arc;

/// A copy of the metadata that waits to be written, taken at one instant.
#[derive(Debug, Default)]
pub(crate) struct WriteBack {
    refcounts: RefcountSnapshot,
    /// Dirty L2 tables.
    tables: Vec<DirtyTable>,
    /// Dirty L1 entries: (index, value).
    l1: Vec<(usize, u64)>,
    /// Releases queued before the copy, and the transfers that may still
    /// use the released clusters (the tickets taken before the copy).
    frees: Vec<u64>,
    cut: Option<FenceCut>,
    /// The dirty bit must be set on disk first (lazy refcounts, spares).
    set_dirty_bit: bool,
    /// The syncs the mappings in this copy depend on.
    order: OrderNeeds,
    /// The mapping changes this copy holds (every one up to this number).
    horizon: u64,
    /// The journal records it covers (every one up to this number).
    journaled: Option<(Arc<Journal>, u64)>,
}

/// The changed parts of one L2 table: its pages, shared with the table
/// (a change made after the take copies the page it changes, and marks
/// it changed again).
#[derive(Debug)]
pub(crate) struct DirtyTable {
    offset: u64,
    /// Each changed part (pages shared with the table).
    parts: Vec<PageRun>,
}

/// How far a write-back goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// A flush: everything synced.
    Durable,
    /// A publish: the mappings in the files (page cache), not synced.
    Published,
}

impl WriteBack {
    /// Whether only a data sync is needed.
    pub(crate) fn is_empty(&self) -> bool {
        self.refcounts.is_empty() && self.tables.is_empty() && self.l1.is_empty()
    }

    /// The mapping changes this copy holds (every one up to this number).
    pub(crate) fn horizon(&self) -> u64 {
        self.horizon
    }

    /// Tells the journal that the image's tables hold what this write-back
    /// wrote (call once it is written). An error means the journal may
    /// replay records this write-back superseded: it must be ended.
    pub(crate) fn cover_journal(&self) -> std::io::Result<()> {
        match &self.journaled {
            Some((journal, upto)) => journal.applied(*upto),
            None => Ok(()),
        }
    }

    /// Whether the dirty bit is to be set on disk first.
    pub(crate) fn sets_dirty_bit(&self) -> bool {
        self.set_dirty_bit
    }
}

impl ActiveState {
    /// Takes what waits to be written; with `frees`, also takes the queued
    /// releases (applied by the flush after the fence, at `cut`).
    pub(crate) fn take_write_back(&mut self, frees: Option<FenceCut>) -> WriteBack {
        let lazy = self.top.lazy_refcounts;
        // Lazy refcounts are written at a clean close, except when the
        // table moved: the old table's clusters are released with this
        // flush, so the header must name the new table (and the table its
        // blocks) first.
        let refcounts = if lazy && !self.refcounts.table_moved() {
            RefcountSnapshot::default()
        } else {
            self.refcounts.dirty_snapshot()
        };
        let mut wb = WriteBack {
            refcounts,
            horizon: self.changes,
            journaled: self.journal.as_ref().map(|j| (j.clone(), j.horizon())),
            ..WriteBack::default()
        };
        for (offset, slot) in &mut self.l2 {
            if !slot.dirty.any() {
                continue;
            }
            // Taken: a change from now on marks its page again, and only
            // that page is left for the next write-back.
            slot.writing = std::mem::take(&mut slot.dirty);
            let parts = slot.table.share(*offset, &slot.writing);
            wb.tables.push(DirtyTable {
                offset: *offset,
                parts,
            });
        }
        self.changed_pages = 0;
        wb.l1 = std::mem::take(&mut self.dirty_l1)
            .into_iter()
            .map(|i| (i, self.l1[i]))
            .collect();
        if !wb.is_empty() {
            // Only a write-back that writes something discharges the syncs
            // owed (an empty one writes no mapping).
            if std::mem::take(&mut self.spares_unsynced) {
                // Spares made since the last write-back: their space (and
                // count) durable before anything that may point at them.
                self.order.data_before_l2 = true;
            }
            wb.order = std::mem::take(&mut self.order);
        }
        // Lazy refcounts: the counts on disk are stale from the first
        // metadata write on. Spares: a process death leaves them leaked,
        // which the next read-write open of a dirty image repairs.
        wb.set_dirty_bit =
            !self.dirty_bit_on_disk && (lazy || self.spares.made_any()) && !wb.is_empty();
        if let Some(cut) = frees {
            wb.frees = self.refcounts.take_pending_frees();
            wb.cut = Some(cut);
        }
        wb
    }

    /// Marks clean what `wb` wrote and has not changed since; publishes
    /// clean tables to the cache; keeps its releases until the transfers
    /// before its cut have ended.
    pub(crate) fn written(&mut self, wb: WriteBack) {
        self.refcounts_written(&wb.refcounts);
        for t in &wb.tables {
            if let Some(slot) = self.l2.get_mut(&t.offset) {
                // The file holds the table now (as of this copy, and any
                // later change is either journaled or unjournaled on its
                // own account).
                slot.journal_safe = true;
                slot.writing.clear();
            }
        }
        for (i, value) in &wb.l1 {
            let table = value & crate::entry::OFFSET_MASK;
            // Still the entry that names this table.
            if self
                .l1
                .get(*i)
                .is_some_and(|e| e & crate::entry::OFFSET_MASK == table)
            {
                if let Some(slot) = self.l2.get_mut(&table) {
                    slot.l1_in_file = true;
                }
            }
        }
        if wb.set_dirty_bit {
            self.dirty_bit_on_disk = true;
            self.header.features.incompatible |= INCOMPAT_DIRTY;
        }
        if let (Some(cut), false) = (wb.cut, wb.frees.is_empty()) {
            self.deferred_frees.push_back((cut, wb.frees));
        }
        // Dirty tables past the budget are written by the caller's next
        // write-back; this one just wrote what it could.
        let _ = self.settle();
    }

    /// Counts (in memory) the clusters to make spares of, when allocations
    /// asked for spares; the caller prepares them outside the lock, then
    /// [`ActiveState::add_spares`].
    pub(crate) fn take_refill(&mut self) -> Vec<u64> {
        let mut refill = Vec::new();
        for _ in 0..self.spares.refill_wanted() {
            match self.alloc(false) {
                Ok(c) => refill.push(c),
                Err(e) => {
                    tracing::debug!(error = %e, "no more spare clusters for now");
                    break;
                }
            }
        }
        refill
    }

    /// Makes prepared clusters spares: the next write-back syncs before it
    /// writes a mapping (their space and count become durable first).
    pub(crate) fn add_spares(&mut self, clusters: &[u64]) {
        if !clusters.is_empty() {
            self.spares.add(clusters);
            self.spares_unsynced = true;
        }
    }

    /// Gives back clusters that could not be prepared as spares.
    pub(crate) fn refill_failed(&mut self, clusters: &[u64]) {
        for &c in clusters {
            self.unalloc(c);
        }
        self.spares.failed();
    }

    /// Applies the releases whose transfers have all ended (in cut order);
    /// whether any was.
    pub(crate) fn apply_passed_frees(&mut self, fence: &TransferFence) -> Result<bool, Error> {
        let mut applied = false;
        while let Some((cut, _)) = self.deferred_frees.front() {
            if !fence.passed(*cut) {
                break;
            }
            let Some((_, frees)) = self.deferred_frees.pop_front() else {
                break;
            };
            self.apply_frees(&frees)?;
            applied = true;
        }
        Ok(applied)
    }

    /// Marks clean what a refcount snapshot wrote.
    pub(crate) fn refcounts_written(&mut self, rc: &RefcountSnapshot) {
        self.refcounts.mark_written(rc);
        if let Some((offset, clusters)) = rc.moved_to() {
            self.header.refcount_table_offset = offset;
            self.header.refcount_table_clusters = clusters as u32;
        }
    }

    /// Puts back what a failed write-back took (it is written next time).
    pub(crate) fn restore(&mut self, wb: WriteBack) {
        self.refcounts.restore(&wb.refcounts);
        self.order.merge(wb.order);
        for t in &wb.tables {
            if let Some(slot) = self.l2.get_mut(&t.offset) {
                let writing = std::mem::take(&mut slot.writing);
                self.changed_pages += slot.dirty.add(&writing);
            }
        }

        self.dirty_l1.extend(wb.l1.iter().map(|(i, _)| *i));
        if !wb.frees.is_empty() {
            self.refcounts.return_pending_frees(wb.frees);
        }
    }
}

/// Most bytes one call reserves for spares.
const RESERVE_STEP: u64 = 1 << 20;

impl TopFile {
    /// Makes clusters about to become spares read as zeros and gives them
    /// their space: past the end of the file by one `fallocate` for the
    /// batch (a data write into allocated blocks needs no block allocation
    /// of its own, which waits for the inode while the kernel writes the
    /// file back: measured, a sparse extension tripled the p99 of
    /// copy-on-write writes at depth 32), inside it by zeroing (a cluster
    /// inside the file may hold old bytes). Returns those prepared and
    /// those not (a full filesystem: spares are an optimisation, never a
    /// failure).
    pub(crate) fn prepare_spares(&self, clusters: &[u64]) -> (Vec<u64>, Vec<u64>) {
        let bits = self.geometry.cluster_bits;
        let (mut done, mut failed) = (Vec::new(), Vec::new());
        let Ok(len) = self.storage.len() else {
            return (done, clusters.to_vec());
        };
        let mut end = len;
        for (first, n) in super::spares::runs(clusters) {
            let (at, bytes) = (first << bits, n << bits);
            let zeroed = if at < len {
                self.storage.write_zeroes(at, bytes.min(len - at))
            } else {
                Ok(())
            };
            let run = first..first + n;
            match zeroed {
                Ok(()) => {
                    end = end.max(at + bytes);
                    done.extend(run);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not prepare spare clusters");
                    failed.extend(run);
                }
            }
        }
        if end > len {
            // Only with their blocks allocated: a spare must read as zeros
            // after a power loss whatever the filesystem's write-back order,
            // which a mere size extension does not promise (none are made
            // while the file syncs). A step at a time: the file's writes
            // wait for each call (the inode's lock), and a filesystem that
            // fills the space in (tmpfs zeroes its pages) took 16 MiB in
            // one call long enough to hold every guest write up (measured:
            // the longest write 40-60 ms against 10-12 ms in 1 MiB steps).
            let mut reserved = len;
            while reserved < end {
                let step = (end - reserved).min(RESERVE_STEP);
                match self.storage.reserve_ahead(reserved, step) {
                    Ok(true) => reserved += step,
                    Ok(false) => break,
                    Err(e) => {
                        tracing::debug!(error = %e, "could not reserve space for spare clusters");
                        break;
                    }
                }
            }
            if reserved < end {
                let (inside, past): (Vec<u64>, Vec<u64>) =
                    done.iter().partition(|&&c| (c + 1) << bits <= reserved);
                done = inside;
                failed.extend(past);
            }
        }
        (done, failed)
    }

    pub(crate) fn sync(&self) -> Result<(), Error> {
        self.storage.sync().map_err(|e| self.io(e))
    }

    fn write_header_u64(&self, at: usize, value: u64) -> Result<(), Error> {
        self.storage
            .write_at(&value.to_be_bytes(), at as u64)
            .map_err(|e| self.io(e))
    }

    /// Writes the incompatible and autoclear feature words, durably.
    pub(crate) fn write_feature_bits(
        &self,
        incompatible: u64,
        autoclear: u64,
    ) -> Result<(), Error> {
        self.write_header_u64(field::INCOMPATIBLE_FEATURES, incompatible)?;
        self.write_header_u64(field::AUTOCLEAR_FEATURES, autoclear)?;
        self.sync()
    }

    /// Writes the dirty bit (set or cleared) durably.
    pub(crate) fn write_dirty_bit(&self, incompatible: u64, dirty: bool) -> Result<(), Error> {
        let mut bits = incompatible & !INCOMPAT_DIRTY;
        if dirty {
            bits |= INCOMPAT_DIRTY;
        }
        self.write_header_u64(field::INCOMPATIBLE_FEATURES, bits)?;
        self.sync()
    }

    /// Writes refcount blocks, the table and (when it moved) the header
    /// fields naming it, each step durable before the next; whether it
    /// synced at all (then everything written before it is durable too).
    pub(crate) fn write_refcounts(&self, rc: &RefcountSnapshot) -> Result<bool, Error> {
        let storage = &*self.storage;
        let mut synced = false;
        if rc.write_blocks(storage).map_err(|e| self.io(e))? {
            self.sync()?;
            synced = true;
        }
        if rc.write_table(storage).map_err(|e| self.io(e))? {
            self.sync()?;
            synced = true;
        }
        if let Some((offset, clusters)) = rc.moved_to() {
            self.write_table_location(offset, clusters)?;
            synced = true;
        }
        Ok(synced)
    }

    /// Points the header at a moved refcount table, durably.
    fn write_table_location(&self, offset: u64, clusters: u64) -> Result<(), Error> {
        let mut fields = [0u8; 12];
        fields[..8].copy_from_slice(&offset.to_be_bytes());
        fields[8..].copy_from_slice(&(clusters as u32).to_be_bytes());
        self.storage
            .write_at(&fields, field::REFCOUNT_TABLE_OFFSET as u64)
            .map_err(|e| self.io(e))?;
        self.sync()
    }

    /// Writes `wb` in the order of the module's doc; `incompatible` is the
    /// header's incompatible feature word.
    pub(crate) fn write_out(
        &self,
        wb: &WriteBack,
        incompatible: u64,
        l1_offset: u64,
        durability: Durability,
    ) -> Result<(), Error> {
        if wb.set_dirty_bit {
            self.write_dirty_bit(incompatible, true)?;
        }
        if wb.is_empty() {
            // Data written in place needs no mapping: a flush syncs it.
            return match durability {
                Durability::Durable => self.sync(),
                Durability::Published => Ok(()),
            };
        }
        let storage = &*self.storage;
        if !self.write_refcounts(&wb.refcounts)? && wb.order.data_before_l2 {
            // No refcount change: the data (or new spares' space) still
            // need their sync.
            self.sync()?;
        }
        for t in &wb.tables {
            for run in &t.parts {
                storage
                    .write_all_vectored_at(&run.parts(), run.at)
                    .map_err(|e| self.io(e))?;
            }
        }
        if !wb.l1.is_empty() {
            if wb.order.tables_before_l1 && !wb.tables.is_empty() {
                self.sync()?;
            }
            // (Write-outs are serialised: the L1 table has one writer.)
            for (i, value) in &wb.l1 {
                storage
                    .write_metadata_at(&value.to_be_bytes(), l1_offset + *i as u64 * 8)
                    .map_err(|e| self.io(e))?;
            }
        }
        match durability {
            Durability::Durable => self.sync(),
            Durability::Published => Ok(()),
        }
    }
}
