//! Growing a qcow2 image's virtual size where its L1 table can address
//! the new size without moving: the entries it needs lie in the clusters
//! the table occupies already (QEMU allocates the table in whole
//! clusters; with 64 KiB clusters one cluster addresses 4 TiB). Those
//! entries are zeroed and made durable first, then the header's L1 size,
//! then its virtual size, each write synced: an image cut short between
//! two of them is valid and has its old size. Past that, the table is
//! moved first, offline (`l1.rs`).

use crate::error::{ErrorKind, Feature};
use crate::header::{field, Header, Version};
use crate::refcount::{RefcountSnapshot, Refcounts};
use crate::storage::Storage;

mod l1;
mod shrink;
pub use l1::move_l1_for;
pub(crate) use l1::plan as plan_l1_move;
pub use shrink::shrink;

/// Whether the image whose header is `header` grows to `size` bytes
/// with its L1 table where it is (else [`move_l1_for`] moves it first).
pub fn grows_in_place(header: &Header, size: u64) -> bool {
    size <= in_place_limit(header)
}

/// Why a size is not one an image can be resized to (qemu-img's words).
pub(crate) fn check_new_size(size: u64) -> Result<(), ErrorKind> {
    if size == 0 {
        return Err(ErrorKind::InvalidArgument(
            "New image size must be positive".into(),
        ));
    }
    if size % 512 != 0 {
        return Err(ErrorKind::InvalidArgument(
            "The new size must be a multiple of 512".into(),
        ));
    }
    if size > i64::MAX as u64 {
        return Err(ErrorKind::SizeTooLarge(size));
    }
    Ok(())
}

/// The largest virtual size the L1 table of `header` addresses without
/// moving.
pub(crate) fn in_place_limit(header: &Header) -> u64 {
    if header.l1_table_offset == 0 {
        return 0;
    }
    let g = &header.geometry;
    let room = (u64::from(header.l1_size) * 8).div_ceil(g.cluster_size()) * g.cluster_size() / 8;
    room.min(crate::header::MAX_L1_BYTES / 8)
        .saturating_mul(g.l2_coverage())
        .min(i64::MAX as u64 / 512 * 512)
}

/// Grows the image whose header is `header` to `size` bytes (more than
/// its size now) in place; its new L1 size. The caller holds the write
/// and resize permissions and nothing else writes the header meanwhile,
/// and resizes the image's bitmaps (if any) with it.
pub(crate) fn grow_in_place(
    storage: &dyn Storage,
    header: &Header,
    size: u64,
) -> Result<u32, ErrorKind> {
    check_new_size(size)?;
    if header.version == Version::V2 && header.nb_snapshots > 0 {
        return Err(ErrorKind::Unsupported(Feature::ResizeV2WithSnapshots));
    }
    let most = in_place_limit(header);
    if size > most {
        return Err(ErrorKind::Unsupported(Feature::GrowMovesL1 { most }));
    }
    let old = u64::from(header.l1_size);
    let need = header.geometry.l1_entries_for(size).max(old);
    let need32 = u32::try_from(need).map_err(|_| ErrorKind::SizeTooLarge(size))?;
    if need > old {
        // Inside the table's own clusters: whatever lies there is no
        // entry of the table yet.
        let zeros = vec![0u8; ((need - old) * 8) as usize];
        storage.write_at(&zeros, header.l1_table_offset + old * 8)?;
        storage.sync()?;
        let mut l1_size = [0u8; 4];
        l1_size.copy_from_slice(&need32.to_be_bytes());
        storage.write_at(&l1_size, field::L1_SIZE as u64)?;
        storage.sync()?;
    }
    storage.write_at(&size.to_be_bytes(), field::SIZE as u64)?;
    storage.sync()?;
    Ok(need32)
}

/// Writes what changed in `rc`, a closed image's refcounts, durably:
/// blocks, then the table (and the header's pointer to it, if it
/// moved), each synced; a moved table's old clusters freed after.
fn write_counts(storage: &dyn Storage, rc: &mut Refcounts) -> Result<(), ErrorKind> {
    let snap: RefcountSnapshot = rc.dirty_snapshot();
    snap.write_blocks(storage)?;
    storage.sync()?;
    snap.write_table(storage)?;
    storage.sync()?;
    if let Some((offset, clusters)) = snap.moved_to() {
        let mut fields = [0u8; 12];
        fields[..8].copy_from_slice(&offset.to_be_bytes());
        fields[8..].copy_from_slice(&(clusters as u32).to_be_bytes());
        storage.write_at(&fields, field::REFCOUNT_TABLE_OFFSET as u64)?;
        storage.sync()?;
    }
    rc.mark_written(&snap);
    let freed = rc.take_pending_frees();
    if !freed.is_empty() {
        for c in freed {
            rc.unalloc(storage, c)?;
        }
        let snap = rc.dirty_snapshot();
        snap.write_blocks(storage)?;
        storage.sync()?;
        rc.mark_written(&snap);
    }
    Ok(())
}
