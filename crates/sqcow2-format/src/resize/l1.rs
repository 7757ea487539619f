//! Moving a closed image's L1 table to bigger clusters, so that it
//! addresses a larger disk (QEMU's `qcow2_grow_l1_table`, offline).
//!
//! Crash order: the new clusters are counted durably first, then the new
//! table written and synced, then the header's L1 size and offset
//! switched in one write (they are adjacent fields), synced; the old
//! table's clusters are freed last. A crash leaves the old table or the
//! new one named, and at worst leaked clusters.

use std::path::Path;

use crate::closed::ClosedImage;
use crate::error::{Error, ErrorKind, Feature};
use crate::header::{field, Header, Version, MAX_L1_BYTES};
use crate::lock::Locking;
use crate::refcount::Refcounts;
use crate::storage::Storage;

/// Moves the L1 table of the closed image at `path` to new clusters that
/// address `size` bytes, taking a writer's lock as QEMU would. Nothing
/// is done if the table addresses `size` in place already.
pub fn move_l1_for(path: &Path, size: u64, locking: Locking) -> Result<(), Error> {
    let e = |k: ErrorKind| Error::new(path, k);
    let (ClosedImage { storage, header }, entries) =
        ClosedImage::open(path, locking, |h| plan(h, size))?;
    let Some(entries) = entries else {
        return Ok(());
    };
    move_table(&*storage, &header, entries).map_err(e)
}

/// The new table's entries, `None` when it need not move; refused as
/// qemu-img refuses the size.
fn plan(header: &Header, size: u64) -> Result<Option<u64>, ErrorKind> {
    super::check_new_size(size)?;
    if header.version == Version::V2 && header.nb_snapshots > 0 {
        return Err(ErrorKind::Unsupported(Feature::ResizeV2WithSnapshots));
    }
    if size <= super::in_place_limit(header) {
        return Ok(None);
    }
    let entries = header.geometry.l1_entries_for(size);
    if entries * 8 > MAX_L1_BYTES || u32::try_from(entries).is_err() {
        return Err(ErrorKind::SizeTooLarge(size));
    }
    Ok(Some(entries))
}

fn move_table(storage: &dyn Storage, header: &Header, entries: u64) -> Result<(), ErrorKind> {
    let g = header.geometry;
    let cs = g.cluster_size();
    let clusters = (entries * 8).div_ceil(cs);
    let mut rc = Refcounts::load(
        storage,
        header.refcount_order,
        g.cluster_bits,
        header.refcount_table_offset,
        header.refcount_table_clusters,
    )?;
    // Clusters skipped on the way given back (a failure there leaks one).
    let first = crate::refcount::contiguous_run(
        &mut rc,
        clusters,
        |rc| rc.alloc(storage),
        |rc, c| drop(rc.unalloc(storage, c)),
    )?;
    super::write_counts(storage, &mut rc)?;
    let mut table = vec![0u8; (clusters * cs) as usize];
    let old_len = u64::from(header.l1_size) * 8;
    if header.l1_table_offset != 0 {
        storage.read_at(&mut table[..old_len as usize], header.l1_table_offset)?;
    }
    let at = first << g.cluster_bits;
    storage.write_at(&table, at)?;
    storage.sync()?;
    let mut fields = [0u8; 12];
    fields[..4].copy_from_slice(&(entries as u32).to_be_bytes());
    fields[4..].copy_from_slice(&at.to_be_bytes());
    storage.write_at(&fields, field::L1_SIZE as u64)?;
    storage.sync()?;
    if header.l1_table_offset != 0 {
        let old = header.l1_table_offset >> g.cluster_bits;
        for c in old..old + old_len.div_ceil(cs) {
            rc.unalloc(storage, c)?;
        }
        super::write_counts(storage, &mut rc)?;
    }
    Ok(())
}
