//! Changing a closed qcow2 image's format options, as `qemu-img amend`:
//! the compatibility level (v2 <-> v3), lazy refcounts and the refcount
//! width. Every change ends in one rewrite of the header area; what it
//! needs first (new refcount structures, zero clusters a v2 image cannot
//! express made unallocated) is written and synced before it, so an
//! amend cut short leaves the image as it was, at worst with leaked
//! clusters.

use std::path::Path;

use crate::check::{check_storage, Repair};
use crate::closed::ClosedImage;
use crate::entry::{OFFSET_MASK, ZERO};
use crate::error::{Error, ErrorKind};
use crate::features::{COMPAT_LAZY_REFCOUNTS, INCOMPAT_DIRTY};
use crate::header::{field, Header, Version};
use crate::header_area::{AreaEdit, Edit};
use crate::lock::Locking;
use crate::storage::Storage;

/// What to change (`None`: as it is).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AmendOptions {
    /// `compat=0.10|1.1`.
    pub version: Option<Version>,
    /// `lazy_refcounts=on|off`.
    pub lazy_refcounts: Option<bool>,
    /// `refcount_bits=N`.
    pub refcount_bits: Option<u32>,
}

/// What an amend does to an image.
struct Plan {
    version: Version,
    order: u32,
    lazy: bool,
    downgrade: bool,
}

/// What `opts` do to the image whose header is `header`, or why they are
/// refused (qemu-img's words where it has them).
fn plan_of(header: &Header, opts: &AmendOptions) -> Result<Plan, ErrorKind> {
    let version = opts.version.unwrap_or(header.version);
    let order = match opts.refcount_bits {
        Some(bits) if !bits.is_power_of_two() || bits > 64 => {
            return Err(refuse(
                "Refcount width must be a power of two and may not exceed 64 bits",
            ))
        }
        Some(bits) => bits.trailing_zeros(),
        None => header.refcount_order,
    };
    let lazy = opts.lazy_refcounts.unwrap_or(header.lazy_refcounts());
    if version == Version::V2 {
        if lazy {
            return Err(refuse(
                "Lazy refcounts only supported with compatibility level 1.1 and above (use compat=1.1 or greater)",
            ));
        }
        if order != 4 {
            return Err(refuse(if header.version == Version::V2 {
                "Refcount widths other than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)"
            } else {
                "compat=0.10 requires refcount_bits=16"
            }));
        }
    }
    let downgrade = header.version == Version::V3 && version == Version::V2;
    if downgrade {
        let features = header.features.incompatible & !INCOMPAT_DIRTY;
        if features != 0 {
            return Err(refuse(format!(
                "Cannot downgrade an image with incompatible features {features:#x} set"
            )));
        }
        if header.has_bitmaps() || header.nb_snapshots > 0 {
            return Err(refuse(
                "sqcow2 does not downgrade images with persistent bitmaps or internal snapshots (qemu-img amend does)",
            ));
        }
    }
    Ok(Plan {
        version,
        order,
        lazy,
        downgrade,
    })
}

/// Why an amend is refused, in qemu-img's words where it has them.
fn refuse(reason: impl Into<String>) -> ErrorKind {
    ErrorKind::InvalidArgument(reason.into())
}

/// Amends the closed image at `path` as `opts` says, holding a writer's
/// lock as QEMU would.
pub fn amend(path: &Path, opts: &AmendOptions, locking: Locking) -> Result<(), Error> {
    let e = |k: ErrorKind| Error::new(path, k);
    let io = |io: std::io::Error| Error::new(path, io.into());
    let (
        ClosedImage { storage, header },
        Plan {
            version,
            order,
            lazy,
            downgrade,
        },
    ) = ClosedImage::open(path, locking, |h| plan_of(h, opts))?;
    if downgrade {
        unallocate_zero_clusters(&*storage, &header).map_err(e)?;
    }
    let refcounts = if order != header.refcount_order {
        Some(crate::check::write_refcounts(&header, &*storage, order).map_err(e)?)
    } else {
        None
    };
    let fixed = fixed_header(&*storage, &header, version, order, lazy, refcounts).map_err(e)?;
    let names = crate::create::feature_names();
    let upgrade = header.version == Version::V2 && version == Version::V3;
    let edit = AreaEdit {
        index: Edit::Keep,
        backing: Edit::Keep,
        fixed: Edit::Set(&fixed),
        feature_table: upgrade.then_some(&names[..]),
        bitmaps: crate::header_area::Edit::Keep,
    };
    crate::header_area::rewrite(&*storage, &header, &edit).map_err(io)?;
    if refcounts.is_some() {
        // The old structures are counted in the new ones: leaks now.
        let after = check_storage(path, storage.clone(), Repair::Leaks)?;
        if after.corruptions > 0 || after.check_errors > 0 {
            return Err(e(refuse("the amended image does not check clean")));
        }
    }
    Ok(())
}

/// The header proper after the amend: `header`'s, at `version`, with
/// refcount `order`, lazy refcounts `lazy` and the refcount table at
/// `refcounts` (offset, clusters) where it moved.
fn fixed_header(
    storage: &dyn Storage,
    header: &Header,
    version: Version,
    order: u32,
    lazy: bool,
    refcounts: Option<(u64, u32)>,
) -> Result<Vec<u8>, ErrorKind> {
    let mut fixed = vec![0u8; header.header_length as usize];
    storage.read_at(&mut fixed, 0)?;
    match version {
        Version::V2 => {
            fixed.truncate(72);
            fixed[field::VERSION..field::VERSION + 4].copy_from_slice(&2u32.to_be_bytes());
        }
        Version::V3 => {
            if header.version == Version::V2 {
                fixed.truncate(72);
                fixed.resize(112, 0);
                fixed[field::VERSION..field::VERSION + 4].copy_from_slice(&3u32.to_be_bytes());
                fixed[field::HEADER_LENGTH..field::HEADER_LENGTH + 4]
                    .copy_from_slice(&112u32.to_be_bytes());
            }
            fixed[field::REFCOUNT_ORDER..field::REFCOUNT_ORDER + 4]
                .copy_from_slice(&order.to_be_bytes());
            let mut compatible = crate::bytes::be_u64(&fixed, field::COMPATIBLE_FEATURES);
            compatible = if lazy {
                compatible | COMPAT_LAZY_REFCOUNTS
            } else {
                compatible & !COMPAT_LAZY_REFCOUNTS
            };
            fixed[field::COMPATIBLE_FEATURES..field::COMPATIBLE_FEATURES + 8]
                .copy_from_slice(&compatible.to_be_bytes());
        }
    }
    if let Some((offset, clusters)) = refcounts {
        fixed[field::REFCOUNT_TABLE_OFFSET..field::REFCOUNT_TABLE_OFFSET + 8]
            .copy_from_slice(&offset.to_be_bytes());
        fixed[field::REFCOUNT_TABLE_CLUSTERS..field::REFCOUNT_TABLE_CLUSTERS + 4]
            .copy_from_slice(&clusters.to_be_bytes());
    }
    Ok(fixed)
}

/// Expresses the active table's zero clusters as a v2 image can (as
/// QEMU's downgrade expands them): one that keeps its host cluster gets
/// zeros written there and becomes data; one without, unallocated (a v2
/// image without a backing file reads that as zeros). One without a
/// host cluster over a backing file would need a cluster allocated:
/// refused. The zeros are synced before the entries change.
fn unallocate_zero_clusters(storage: &dyn Storage, header: &Header) -> Result<(), ErrorKind> {
    let g = header.geometry;
    let cs = g.cluster_size();
    let mut l1 = vec![0u8; header.l1_size as usize * 8];
    storage.read_at(&mut l1, header.l1_table_offset)?;
    for word in l1.chunks_exact(8) {
        let table = crate::bytes::be_u64(word, 0) & OFFSET_MASK;
        if table == 0 {
            continue;
        }
        let mut l2 = vec![0u8; cs as usize];
        storage.read_at(&mut l2, table)?;
        let mut changed = false;
        for entry in l2.chunks_exact_mut(8) {
            let v = crate::bytes::be_u64(entry, 0);
            if v & ZERO == 0 || v & crate::entry::COMPRESSED != 0 {
                continue;
            }
            let host = v & OFFSET_MASK;
            if host != 0 {
                storage.write_zeroes(host, cs)?;
                storage.sync()?;
                entry.copy_from_slice(&(v & !ZERO).to_be_bytes());
            } else if header.backing_file.is_some() {
                return Err(refuse(
                    "sqcow2 does not expand zero clusters over a backing file (qemu-img amend does)",
                ));
            } else {
                entry.copy_from_slice(&0u64.to_be_bytes());
            }
            changed = true;
        }
        if changed {
            storage.write_at(&l2, table)?;
        }
    }
    storage.sync()?;
    Ok(())
}
