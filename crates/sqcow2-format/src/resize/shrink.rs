//! Shrinking a closed qcow2 image, as `qemu-img resize --shrink`: the
//! mappings of whole clusters past the new end are dropped, the L2 tables
//! wholly past it released (the header's L1 size stays, as QEMU leaves
//! it), the refcounts lowered and the file cut after its last used
//! cluster. The partial cluster at the new end keeps its bytes, as in
//! QEMU. Persistent bitmaps shrink with the disk.
//!
//! Crash order: the new size is durable first, so every later step only
//! changes what lies past the end; mappings are dropped before refcounts
//! are lowered (a crash between leaves leaks, which `check -r leaks`
//! repairs, never a cluster in use with refcount 0).

use std::path::Path;

use crate::bitmaps::kept::write_directory_in_place;
use crate::bitmaps::{data_clusters, read_directory, read_entries, BitmapEntry, ENTRY_OFFSET};
use crate::check::{check_storage, CheckReport, Repair};
use crate::closed::ClosedImage;
use crate::entry::{COPIED, OFFSET_MASK};
use crate::error::{Error, ErrorKind, Feature};
use crate::header::{field, Header, Version};
use crate::lock::Locking;
use crate::refcount::Refcounts;
use crate::storage::Storage;

/// What a shrink did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shrunk {
    /// The virtual size before.
    pub old_size: u64,
    /// The file's length before and after.
    pub file_len: (u64, u64),
}

/// Shrinks the closed image at `path` to `size` bytes (less than its
/// virtual size), taking a writer's lock as QEMU would.
pub fn shrink(path: &Path, size: u64, locking: Locking) -> Result<Shrunk, Error> {
    let e = |k: ErrorKind| Error::new(path, k);
    let io = |io: std::io::Error| Error::new(path, io.into());
    let (ClosedImage { storage, header }, ()) =
        ClosedImage::open(path, locking, |h| refuse(h, size))?;
    let file_len = storage.len().map_err(io)?;
    // In use before the size changes (a crash leaves them inconsistent,
    // as QEMU's), consistent again at the new size after.
    let bitmaps = ShrinkingBitmaps::mark_in_use(&*storage, &header).map_err(e)?;
    storage
        .write_at(&size.to_be_bytes(), field::SIZE as u64)
        .and_then(|()| storage.sync())
        .map_err(io)?;
    drop_mappings_past(&*storage, &header, size).map_err(e)?;
    bitmaps.store_at(&*storage, &header, size).map_err(e)?;
    let after = check_storage(path, storage.clone(), Repair::Leaks)?;
    if after.corruptions > 0 || after.check_errors > 0 || after.leaks > 0 {
        return Err(e(ErrorKind::InvalidArgument(format!(
            "the shrunk image does not check clean: {}",
            summary(&after)
        ))));
    }
    let end = after.image_end_offset;
    if end > 0 && end < file_len {
        // As QEMU: a file that cannot be cut is only larger than needed.
        if let Err(err) = storage.set_len(end) {
            tracing::warn!(path = %path.display(), %err, "could not cut the file after its last cluster");
        }
    }
    Ok(Shrunk {
        old_size: header.size,
        file_len: (file_len, storage.len().map_err(io)?),
    })
}

/// Why the image whose header is `header` cannot be shrunk to `size`
/// (qemu-img's words where it has them).
fn refuse(header: &Header, size: u64) -> Result<(), ErrorKind> {
    super::check_new_size(size)?;
    if size >= header.size {
        return Err(ErrorKind::InvalidArgument(format!(
            "{size} bytes is not smaller than the disk ({} bytes)",
            header.size
        )));
    }
    if header.version == Version::V2 && header.nb_snapshots > 0 {
        return Err(ErrorKind::Unsupported(Feature::ResizeV2WithSnapshots));
    }
    Ok(())
}

/// An image's bitmaps through a shrink, as QEMU shrinks them with the
/// disk (`bdrv_dirty_bitmap_truncate`): marked in use first, then each
/// table cut to the new size in place (the bits past the new end
/// cleared in the last data cluster kept) and the directory naming the
/// shorter tables with the bitmaps consistent again. The clusters past
/// the cut are left to the leak repair that ends the shrink.
struct ShrinkingBitmaps {
    /// Each bitmap with its table's entries (read and checked before
    /// anything is written).
    entries: Vec<(BitmapEntry, Vec<u64>)>,
}

impl ShrinkingBitmaps {
    /// Refused, nothing written, if one is inconsistent (QEMU's words).
    fn mark_in_use(storage: &dyn Storage, header: &Header) -> Result<Self, ErrorKind> {
        let entries = read_directory(header, storage)?;
        if let Some(b) = entries.iter().find(|b| b.in_use) {
            return Err(ErrorKind::InvalidArgument(format!(
                "Bitmap '{}' is inconsistent and cannot be used\n\
                 Try block-dirty-bitmap-remove to delete this bitmap from disk",
                b.name
            )));
        }
        // Every table read and checked first: a bad one refuses the
        // shrink with nothing written.
        let tables = entries
            .iter()
            .map(|e| read_entries(header, storage, e))
            .collect::<Result<Vec<_>, _>>()?;
        if !entries.is_empty() {
            let in_use: Vec<BitmapEntry> = entries
                .iter()
                .map(|b| BitmapEntry {
                    in_use: true,
                    ..b.clone()
                })
                .collect();
            write_directory_in_place(storage, header, header.features.autoclear, &in_use)?;
        }
        Ok(ShrinkingBitmaps {
            entries: entries.into_iter().zip(tables).collect(),
        })
    }

    /// Cuts each table to a disk of `size` bytes; `header` as before the
    /// shrink.
    fn store_at(self, storage: &dyn Storage, header: &Header, size: u64) -> Result<(), ErrorKind> {
        if self.entries.is_empty() {
            return Ok(());
        }
        let cs = header.geometry.cluster_size();
        let mut cut = Vec::with_capacity(self.entries.len());
        for (e, table) in self.entries {
            let bits = size.div_ceil(e.granularity());
            let kept = data_clusters(bits, cs);
            // The last data cluster kept: its bits past the end cleared.
            let bits_per_cluster = cs * 8;
            let last = kept.checked_sub(1).and_then(|k| table.get(k as usize));
            let offset = last.map_or(0, |t| t & ENTRY_OFFSET);
            if offset != 0 && bits % bits_per_cluster != 0 {
                let mut data = vec![0u8; cs as usize];
                storage.read_at(&mut data, offset)?;
                let from = (bits % bits_per_cluster) as usize;
                if from % 8 != 0 {
                    data[from / 8] &= (1u8 << (from % 8)) - 1;
                }
                data[from.div_ceil(8)..].fill(0);
                storage.write_at(&data, offset)?;
            }
            cut.push(BitmapEntry {
                table_size: kept as u32,
                ..e
            });
        }
        storage.sync()?;
        write_directory_in_place(storage, header, header.features.autoclear, &cut)?;
        Ok(())
    }
}

/// Makes every whole cluster at or past `size` unallocated in the active
/// L1/L2 tables: L2 tables wholly past it are unlinked from the L1 table,
/// the one across it has its tail entries zeroed (copied first where an
/// internal snapshot shares it). Everything written is synced.
fn drop_mappings_past(storage: &dyn Storage, header: &Header, size: u64) -> Result<(), ErrorKind> {
    let g = header.geometry;
    let cs = g.cluster_size();
    let cut = size.div_ceil(cs) * cs;
    let coverage = g.l2_coverage();
    let mut raw = vec![0u8; header.l1_size as usize * 8];
    storage.read_at(&mut raw, header.l1_table_offset)?;
    let mut refcounts: Option<Refcounts> = None;
    for (i, word) in raw.chunks_exact(8).enumerate() {
        let entry = crate::bytes::be_u64(word, 0);
        let table = entry & OFFSET_MASK;
        let start = i as u64 * coverage;
        if table == 0 || start + coverage <= cut {
            continue;
        }
        let l1_at = header.l1_table_offset + i as u64 * 8;
        if start >= cut {
            storage.write_at(&0u64.to_be_bytes(), l1_at)?;
            continue;
        }
        let mut l2 = vec![0u8; cs as usize];
        storage.read_at(&mut l2, table)?;
        let first = ((cut - start) / cs * g.l2_entry_size()) as usize;
        l2[first..].fill(0);
        if entry & COPIED != 0 {
            storage.write_at(&l2, table)?;
            continue;
        }
        // Shared with an internal snapshot: the active table is a copy.
        let rc = match &mut refcounts {
            Some(rc) => rc,
            None => refcounts.insert(Refcounts::load(
                storage,
                header.refcount_order,
                g.cluster_bits,
                header.refcount_table_offset,
                header.refcount_table_clusters,
            )?),
        };
        let copy = rc.alloc(storage)? << g.cluster_bits;
        // Counted durably, with any refcount block (and the table naming
        // it) the allocation placed, before anything names the copy.
        super::write_counts(storage, rc)?;
        storage.write_at(&l2, copy)?;
        storage.sync()?;
        storage.write_at(&(copy | COPIED).to_be_bytes(), l1_at)?;
    }
    storage.sync()?;
    Ok(())
}

fn summary(r: &CheckReport) -> String {
    format!(
        "{} corruptions, {} leaks, {} check errors",
        r.corruptions, r.leaks, r.check_errors
    )
}
