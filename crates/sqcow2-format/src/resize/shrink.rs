//! Shrinking a closed qcow2 image, as `qemu-img resize --shrink`: the
//! mappings of whole clusters past the new end are dropped, the L2 tables
//! wholly past it released (the header's L1 size stays, as QEMU leaves
//! it), the refcounts lowered and the file cut after its last used
//! cluster. The partial cluster at the new end keeps its bytes, as in
//! QEMU.
//!
//! Crash order: the new size is durable first, so every later step only
//! changes what lies past the end; mappings are dropped before refcounts
//! are lowered (a crash between leaves leaks, which `check -r leaks`
//! repairs, never a cluster in use with refcount 0).

use std::path::Path;

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
    storage
        .write_at(&size.to_be_bytes(), field::SIZE as u64)
        .and_then(|()| storage.sync())
        .map_err(io)?;
    drop_mappings_past(&*storage, &header, size).map_err(e)?;
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
    if header.has_bitmaps() {
        return Err(ErrorKind::Unsupported(Feature::ShrinkWithBitmaps));
    }
    Ok(())
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
        rc.write_blocks(storage)?;
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
