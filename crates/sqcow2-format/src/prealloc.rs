//! Whether an image looks preallocated with metadata only: clusters
//! mapped that the file has no blocks for. QEMU asks the file system which
//! mapped clusters are holes (reading as zeros) only for such an image;
//! `map` follows it.

use std::os::unix::fs::MetadataExt;

use crate::header::Header;
use crate::refcount::Refcounts;
use crate::storage::Storage;

/// QEMU's test (`qcow2_detect_metadata_preallocation`): the clusters in
/// use reach max(10/9 of, 2 more than) those the file has blocks for.
/// Storage that is not a file, or whose refcounts cannot be read, does
/// not look preallocated.
pub fn looks_metadata_preallocated(header: &Header, storage: &dyn Storage) -> bool {
    let cs = header.geometry.cluster_size();
    let Ok(Some(pinned)) = storage.pinned_file() else {
        return false;
    };
    let Ok(meta) = pinned.file.metadata() else {
        return false;
    };
    let real_clusters = meta.blocks() * 512 / cs;
    let threshold = (real_clusters * 10 / 9).max(real_clusters + 2);
    let Ok(mut refcounts) = Refcounts::load(
        storage,
        header.refcount_order,
        header.geometry.cluster_bits,
        header.refcount_table_offset,
        header.refcount_table_clusters,
    ) else {
        return false;
    };
    let mut in_use = 0;
    for i in 0..meta.len().div_ceil(cs) {
        if in_use >= threshold {
            break;
        }
        match refcounts.get(storage, i) {
            Ok(rc) => in_use += u64::from(rc != 0),
            Err(_) => return false,
        }
    }
    in_use >= threshold
}
