//! Storing the kept persistent bitmaps into the top, as QEMU's
//! `qcow2_store_persistent_dirty_bitmaps` does: each changed bitmap's
//! data and table in new clusters, then a new directory, then the header
//! naming it, the old clusters freed last; a crash at any step leaves the
//! old directory (bitmaps in use) or the new one, and at worst leaked
//! clusters. Marking them in use again before a change that follows a
//! store.

use std::sync::Arc;

use crate::bitmaps::kept::{KeptBitmap, StoredTable};
use crate::bitmaps::{data_for_image, encode_directory, encode_table, BitmapEntry};
use crate::error::{Error, ErrorKind};
use crate::extension::BitmapsExtension;
use crate::features::AUTOCLEAR_BITMAPS;
use crate::header_area::{AreaEdit, Edit};

use super::Active;

/// A rewritten bitmap's new table.
struct NewTable<'p> {
    plan: &'p Planned,
    table: StoredTable,
    /// Its entries: each data cluster's offset, 0 for an all-zero one.
    offsets: Vec<u64>,
}

/// One bitmap's part of a store.
struct Planned {
    bitmap: Arc<KeptBitmap>,
    /// New data, per table entry (`None`: all zero); `None`: its table
    /// stays.
    data: Option<Vec<Option<Vec<u8>>>>,
}

impl Active {
    /// Stores every kept bitmap that changed, clears the in-use flag of
    /// the consistent ones (inconsistent ones stay in use), frees the
    /// tables of rewritten and removed bitmaps. The caller holds the flush
    /// order and has made the guest data durable; the refcounts it writes
    /// after cover the frees.
    pub(super) fn store_bitmaps(&self) -> Result<(), Error> {
        let kept = &self.bitmaps;
        if kept.is_empty() {
            return Ok(());
        }
        let _edit = kept.edit();
        kept.storing();
        let plans: Vec<Planned> = kept
            .list()
            .into_iter()
            .map(|bitmap| {
                let data = match &bitmap.bits {
                    // Inconsistent: kept as it is, in use.
                    None => None,
                    Some(bits) => {
                        let stored = bitmap.stored().is_some();
                        (bitmap.take_changed() || !stored).then(|| {
                            data_for_image(&bits.words(), self.top.geometry.cluster_size())
                        })
                    }
                };
                Planned { bitmap, data }
            })
            .collect();
        let stored = self.write_bitmaps(&plans);
        if stored.is_err() {
            for p in plans.iter().filter(|p| p.data.is_some()) {
                p.bitmap.set_changed();
            }
        }
        stored
    }

    fn write_bitmaps(&self, plans: &[Planned]) -> Result<(), Error> {
        let top = &self.top;
        let storage = &*top.storage;
        let cluster = top.geometry.cluster_size();
        let bits = top.geometry.cluster_bits;
        let io = |e: std::io::Error| top.io(e);
        let table_clusters = |entries: usize| (entries as u64 * 8).div_ceil(cluster);
        // Every new cluster placed (and counted durably) first.
        let mut frees: Vec<u64> = Vec::new();
        let mut entries: Vec<BitmapEntry> = Vec::with_capacity(plans.len());
        let mut new_tables: Vec<NewTable<'_>> = Vec::new();
        {
            let mut st = self.write_back_state()?;
            for plan in plans {
                let Some(data) = &plan.data else {
                    continue;
                };
                let mut offsets = Vec::with_capacity(data.len());
                for d in data {
                    offsets.push(match d {
                        Some(_) => st.alloc(true)? << bits,
                        None => 0,
                    });
                }
                let table = self.alloc_run(&mut st, table_clusters(data.len()))?;
                let table = StoredTable {
                    offset: table << bits,
                    size: data.len() as u32,
                    data: offsets
                        .iter()
                        .filter(|&&o| o != 0)
                        .map(|o| o >> bits)
                        .collect(),
                };
                new_tables.push(NewTable {
                    plan,
                    table,
                    offsets,
                });
            }
            drop(st);
            self.write_counts()?;
        }
        // Data and tables.
        for t in &new_tables {
            let data = t.plan.data.iter().flatten();
            for (d, &at) in data.zip(&t.offsets) {
                if let Some(d) = d {
                    storage.write_at(d, at).map_err(io)?;
                }
            }
            storage
                .write_at(&encode_table(&t.offsets), t.table.offset)
                .map_err(io)?;
        }
        for p in plans {
            let b = &p.bitmap;
            let table = match new_tables.iter().find(|t| Arc::ptr_eq(&t.plan.bitmap, b)) {
                Some(t) => t.table.clone(),
                None => match b.stored().clone() {
                    Some(t) => t,
                    None => continue,
                },
            };
            // Inconsistent ones stay in use.
            entries.push(b.entry(&table, b.bits.is_none()));
        }
        // The directory, in new clusters, and the header naming it.
        let old = self.bitmaps.directory();
        let ext = if entries.is_empty() {
            None
        } else {
            let bytes = encode_directory(&entries);
            let at = {
                let mut st = self.write_back_state()?;
                let first = self.alloc_run(&mut st, (bytes.len() as u64).div_ceil(cluster))?;
                drop(st);
                self.write_counts()?;
                first << bits
            };
            storage.write_at(&bytes, at).map_err(io)?;
            Some(BitmapsExtension {
                nb_bitmaps: entries.len() as u32,
                directory_size: bytes.len() as u64,
                directory_offset: at,
            })
        };
        storage.sync().map_err(io)?;
        let edit = AreaEdit {
            index: Edit::Keep,
            backing: Edit::Keep,
            fixed: Edit::Keep,
            feature_table: None,
            bitmaps: match &ext {
                Some(e) => Edit::Set(e),
                None => Edit::Remove,
            },
        };
        self.edit_header_area(&edit, false)?;
        {
            let mut st = self.write_back_state()?;
            let exts = &mut st.header.extensions;
            exts.retain(|e| !matches!(e, crate::extension::HeaderExtension::Bitmaps(_)));
            if let Some(e) = &ext {
                exts.push(crate::extension::HeaderExtension::Bitmaps(e.clone()));
            }
        }
        let autoclear = {
            let st = self.read_state();
            match ext {
                Some(_) => st.header.features.autoclear | AUTOCLEAR_BITMAPS,
                None => st.header.features.autoclear & !AUTOCLEAR_BITMAPS,
            }
        };
        if autoclear != self.read_state().header.features.autoclear {
            crate::header_area::write_word(
                storage,
                crate::header::field::AUTOCLEAR_FEATURES,
                autoclear,
            )
            .map_err(io)?;
            self.write_back_state()?.header.features.autoclear = autoclear;
        }
        // Nothing names the old clusters now.
        if let Some(old) = &old {
            let first = old.directory_offset >> bits;
            frees.extend(first..first + old.directory_size.div_ceil(cluster));
        }
        for t in &new_tables {
            let previous = t.plan.bitmap.stored().replace(t.table.clone());
            if let Some(t) = previous {
                frees.extend(table_clusters_of(&t, cluster, bits));
            }
        }
        for gone in self.bitmaps.take_removed() {
            if let Some(t) = gone.stored().take() {
                frees.extend(table_clusters_of(&t, cluster, bits));
            }
        }
        self.bitmaps.set_directory(ext);
        self.write_back_state()?.apply_frees(&frees)?;
        Ok(())
    }

    /// Writes the refcounts changed so far (the new clusters counted
    /// before anything names them).
    fn write_counts(&self) -> Result<(), Error> {
        let rc = self.write_back_state()?.refcounts.dirty_snapshot();
        if let Err(e) = self.top.write_refcounts(&rc) {
            self.write_state_anyway().refcounts.restore(&rc);
            return Err(e);
        }
        self.write_back_state()?.refcounts_written(&rc);
        Ok(())
    }

    /// `n` contiguous clusters (a table or directory of more than one);
    /// the first's index. Clusters skipped on the way are given back.
    fn alloc_run(&self, st: &mut super::state::ActiveState, n: u64) -> Result<u64, Error> {
        crate::refcount::contiguous_run(st, n, |st| st.alloc(true), |st, c| st.unalloc(c))
    }

    /// The kept bitmaps.
    pub(crate) fn bitmaps(&self) -> &crate::bitmaps::kept::KeptBitmaps {
        &self.bitmaps
    }

    /// Takes on, empty, every enabled and consistent bitmap of `below`
    /// (the top this new top is a live snapshot of), as libvirt does
    /// for a snapshot's overlay, so that tracking goes on in the new top;
    /// written into the image at once, in use (a crash before the close
    /// leaves them inconsistent, not missing). The old top keeps its own,
    /// stored when it closes.
    pub(crate) fn take_on_bitmaps(&self, below: &Active) -> Result<(), Error> {
        if self.add_recording_of(below)? {
            self.persist_bitmaps()?;
        }
        Ok(())
    }

    /// Adds, empty and enabled, each enabled and consistent bitmap of
    /// `other` this lacks (in memory only: no I/O); whether it added any.
    pub(crate) fn add_recording_of(&self, other: &Active) -> Result<bool, Error> {
        let size = self.size();
        let cluster = self.top.geometry.cluster_size();
        let mut any = false;
        for b in other.bitmaps.list() {
            let Some(bits) = &b.bits else { continue };
            if !b.is_enabled() || self.bitmaps.get(&b.name).is_ok() {
                continue;
            }
            self.bitmaps
                .add(&b.name, bits.granularity(), true, size, cluster)
                .map_err(|k| Error::new(&self.top.path, k))?;
            any = true;
        }
        Ok(any)
    }

    /// Stores the bitmaps now and marks them in use again (a live edit
    /// made durable). Holds the flush order across the I/O, as a close
    /// does: no write-back may interleave with the store's steps.
    pub(crate) fn persist_bitmaps(&self) -> Result<(), Error> {
        let _order = self
            .flush_order
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.store_bitmaps()?;
        self.bitmaps_in_use_locked()
    }

    /// Sets the bits of a guest change of `[offset, offset + len)` and
    /// makes sure the image says the bitmaps are in use before the change
    /// reaches it (on an engine thread: that may write and sync).
    pub(crate) fn note_guest_change(&self, offset: u64, len: u64) -> Result<(), Error> {
        if self.bitmaps.mark(offset, len) {
            return Ok(());
        }
        self.bitmaps_in_use()
    }

    /// [`Active::note_guest_change`] for a write that goes straight to
    /// the file: `false` (bits set) when the bitmaps must be marked in
    /// use first, which it leaves to the engine.
    pub(crate) fn note_in_place_change(&self, offset: u64, len: u64) -> bool {
        self.bitmaps.mark(offset, len)
    }

    /// Marks the kept bitmaps in use in the image again if a store
    /// cleared the flag, before a change reaches the image (on an engine
    /// thread: it writes and syncs).
    pub(crate) fn bitmaps_in_use(&self) -> Result<(), Error> {
        if self.bitmaps.in_use() || self.failure().is_some() {
            return Ok(());
        }
        // The feature word is written: no write-back (a journal's start)
        // may write it meanwhile.
        let _order = self
            .flush_order
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.bitmaps_in_use_locked()
    }

    /// [`Active::bitmaps_in_use`] with the flush order held.
    pub(super) fn bitmaps_in_use_locked(&self) -> Result<(), Error> {
        if self.bitmaps.in_use() || self.failure().is_some() {
            return Ok(());
        }
        let _edit = self.bitmaps.edit();
        let e = |k: ErrorKind| Error::new(&self.top.path, k);
        let header = crate::header::Header::read(&*self.top.storage).map_err(e)?;
        let autoclear = self.read_state().header.features.autoclear;
        self.bitmaps
            .mark_in_use(&header, autoclear, &*self.top.storage)
            .map_err(e)
    }
}

/// The clusters a stored table takes: its own and its data's.
fn table_clusters_of(t: &StoredTable, cluster: u64, bits: u32) -> Vec<u64> {
    let first = t.offset >> bits;
    let n = (u64::from(t.size) * 8).div_ceil(cluster);
    (first..first + n).chain(t.data.iter().copied()).collect()
}
