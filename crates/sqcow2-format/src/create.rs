//! Creation of new qcow2 images, laid out like `qemu-img create` does.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind};
use crate::extension::{EXT_BACKING_FORMAT, EXT_FEATURE_TABLE};
use crate::features::{COMPAT_LAZY_REFCOUNTS, INCOMPAT_COMPRESSION, INCOMPAT_EXTL2};
use crate::header::{CompressionType, Version, MAX_BACKING_NAME, QCOW2_MAGIC};
use crate::lock::{LockRequest, Locking};
use crate::refcount::set_entry;
use crate::storage::{FileStorage, Storage};
use crate::types::Geometry;
use std::os::unix::fs::MetadataExt;

/// Bytes per sector: an image's size is a whole number of them.
const SECTOR: u64 = 512;

/// What to create.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    /// Virtual size in bytes.
    pub size: u64,
    /// Cluster size in bytes (power of two, 512 B to 2 MiB).
    pub cluster_size: u64,
    /// qcow2 version.
    pub version: Version,
    /// 128-bit L2 entries with subclusters.
    pub extended_l2: bool,
    /// Compression type for compressed clusters.
    pub compression_type: CompressionType,
    /// Lazy refcounts (compatible bit 0).
    pub lazy_refcounts: bool,
    /// Refcount width in bits (1 to 64, a power of two).
    pub refcount_bits: u32,
    /// Backing file name as it will be written in the image.
    pub backing_file: Option<PathBuf>,
    /// Backing file format recorded in the backing format extension.
    pub backing_format: Option<String>,
}

impl Default for CreateOptions {
    fn default() -> Self {
        Self {
            size: 0,
            cluster_size: 65536,
            version: Version::V3,
            extended_l2: false,
            compression_type: CompressionType::Deflate,
            lazy_refcounts: false,
            refcount_bits: 16,
            backing_file: None,
            backing_format: None,
        }
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ErrorKind {
    ErrorKind::InvalidHeader {
        field,
        reason: reason.into(),
    }
}

/// The names QEMU writes in the feature name table.
const FEATURE_NAMES: [(u8, u8, &str); 8] = [
    (0, 0, "dirty bit"),
    (0, 1, "corrupt bit"),
    (0, 2, "external data file"),
    (0, 3, "compression type"),
    (0, 4, "extended L2 entries"),
    (1, 0, "lazy refcounts"),
    (2, 0, "bitmaps"),
    (2, 1, "raw external data"),
];

/// The feature name table `create` writes.
pub(crate) fn feature_names() -> Vec<crate::features::FeatureNameEntry> {
    use crate::features::{FeatureKind, FeatureNameEntry};
    FEATURE_NAMES
        .iter()
        .map(|&(kind, bit, name)| FeatureNameEntry {
            kind: Some(match kind {
                0 => FeatureKind::Incompatible,
                1 => FeatureKind::Compatible,
                _ => FeatureKind::Autoclear,
            }),
            bit,
            name: name.to_string(),
        })
        .collect()
}

fn push_extension(out: &mut Vec<u8>, ext_type: u32, data: &[u8]) {
    out.extend_from_slice(&ext_type.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(8) * 8, 0);
}

/// Builds the image bytes (header cluster, refcount structures, L1 table).
pub fn image_bytes(opts: &CreateOptions) -> Result<Vec<u8>, ErrorKind> {
    image_layout(opts, 0).map(|(bytes, _)| bytes)
}

/// Where [`image_layout`] put things.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ImageLayout {
    /// Offset of the L1 table.
    pub l1_offset: u64,
    /// First cluster after the L1 table: where the `extra` clusters go.
    pub next_cluster: u64,
}

/// [`image_bytes`] with `extra` clusters after the L1 table already
/// counted in the refcounts (the caller writes them: L2 tables, data).
pub(crate) fn image_layout(
    opts: &CreateOptions,
    extra: u64,
) -> Result<(Vec<u8>, ImageLayout), ErrorKind> {
    let cs = opts.cluster_size;
    if !cs.is_power_of_two() || !(512..=2 << 20).contains(&cs) {
        return Err(invalid(
            "cluster_size",
            format!("{cs} is not a power of two from 512 to 2M"),
        ));
    }
    let cluster_bits = cs.trailing_zeros();
    let v3 = opts.version == Version::V3;
    if !opts.refcount_bits.is_power_of_two() || opts.refcount_bits > 64 {
        return Err(invalid(
            "refcount_order",
            format!("{} bits", opts.refcount_bits),
        ));
    }
    if !v3 && opts.refcount_bits != 16 {
        return Err(invalid(
            "refcount_order",
            "version 2 images have 16-bit refcounts",
        ));
    }
    if !v3
        && (opts.extended_l2
            || opts.lazy_refcounts
            || opts.compression_type != CompressionType::Deflate)
    {
        return Err(invalid(
            "version",
            "extended L2, lazy refcounts and zstd need compat=1.1",
        ));
    }
    if opts.extended_l2 && cs < 16384 {
        return Err(invalid(
            "cluster_size",
            "extended L2 entries need clusters of at least 16 KiB",
        ));
    }
    if opts.backing_format.is_some() && opts.backing_file.is_none() {
        return Err(invalid(
            "backing_file",
            "a backing format needs a backing file",
        ));
    }
    let g = Geometry {
        cluster_bits,
        extended_l2: opts.extended_l2,
    };
    if opts.size > i64::MAX as u64 {
        return Err(ErrorKind::SizeTooLarge(opts.size));
    }
    // Whole 512-byte sectors, rounded up (as `qemu-img create`; QEMU
    // sees no partial sector at the end).
    let size = opts.size.div_ceil(SECTOR) * SECTOR;
    let l1_size = g.l1_entries_for(size);
    if size > i64::MAX as u64 || l1_size * 8 > crate::header::MAX_L1_BYTES {
        return Err(ErrorKind::SizeTooLarge(opts.size));
    }
    let order = opts.refcount_bits.trailing_zeros();
    let block_entries = (cs * 8) >> order;
    // An empty disk has no L1 table at all (as QEMU writes it).
    let l1_clusters = (l1_size * 8).div_ceil(cs);
    let (mut blocks, mut table) = (1u64, 1u64);
    loop {
        let total = 1 + table + blocks + l1_clusters + extra;
        let nb = total.div_ceil(block_entries);
        let nt = (nb * 8).div_ceil(cs);
        if (nb, nt) == (blocks, table) {
            break;
        }
        (blocks, table) = (nb, nt);
    }
    let total = 1 + table + blocks + l1_clusters + extra;
    let mut image = vec![0u8; ((total - extra) * cs) as usize];

    // Header.
    let header_length: u32 = if v3 { 112 } else { 72 };
    let mut incompatible = 0u64;
    if opts.extended_l2 {
        incompatible |= INCOMPAT_EXTL2;
    }
    if opts.compression_type == CompressionType::Zstd {
        incompatible |= INCOMPAT_COMPRESSION;
    }
    let compatible = if opts.lazy_refcounts {
        COMPAT_LAZY_REFCOUNTS
    } else {
        0
    };
    let reftable_offset = cs;
    let l1_offset = if l1_size == 0 {
        0
    } else {
        (1 + table + blocks) * cs
    };
    let mut h = Vec::with_capacity(cs as usize);
    h.extend_from_slice(&QCOW2_MAGIC.to_be_bytes());
    h.extend_from_slice(&(if v3 { 3u32 } else { 2 }).to_be_bytes());
    h.extend_from_slice(&0u64.to_be_bytes()); // backing_file_offset, set below
    h.extend_from_slice(&0u32.to_be_bytes()); // backing_file_size, set below
    h.extend_from_slice(&cluster_bits.to_be_bytes());
    h.extend_from_slice(&size.to_be_bytes());
    h.extend_from_slice(&0u32.to_be_bytes()); // crypt_method
    h.extend_from_slice(&(l1_size as u32).to_be_bytes());
    h.extend_from_slice(&l1_offset.to_be_bytes());
    h.extend_from_slice(&reftable_offset.to_be_bytes());
    h.extend_from_slice(&(table as u32).to_be_bytes());
    h.extend_from_slice(&0u32.to_be_bytes()); // nb_snapshots
    h.extend_from_slice(&0u64.to_be_bytes()); // snapshots_offset
    if v3 {
        h.extend_from_slice(&incompatible.to_be_bytes());
        h.extend_from_slice(&compatible.to_be_bytes());
        h.extend_from_slice(&0u64.to_be_bytes()); // autoclear
        h.extend_from_slice(&order.to_be_bytes());
        h.extend_from_slice(&header_length.to_be_bytes());
        h.push(match opts.compression_type {
            CompressionType::Deflate => 0,
            CompressionType::Zstd => 1,
        });
        h.resize(112, 0);
    }
    if let Some(format) = &opts.backing_format {
        if format.len() >= 16 {
            return Err(invalid("backing_format", format!("{format:?} is too long")));
        }
        push_extension(&mut h, EXT_BACKING_FORMAT, format.as_bytes());
    }
    let backing_len = opts
        .backing_file
        .as_ref()
        .map_or(0, |b| b.as_os_str().as_bytes().len());
    // Like QEMU, leave the feature name table out when it does not fit.
    let table_len = 8 + FEATURE_NAMES.len() * 48;
    if v3 && h.len() + table_len + 8 + backing_len <= cs as usize {
        let mut table = Vec::new();
        for (kind, bit, name) in FEATURE_NAMES {
            let mut entry = [0u8; 48];
            entry[0] = kind;
            entry[1] = bit;
            entry[2..2 + name.len()].copy_from_slice(name.as_bytes());
            table.extend_from_slice(&entry);
        }
        push_extension(&mut h, EXT_FEATURE_TABLE, &table);
    }
    h.extend_from_slice(&[0u8; 8]); // end of extensions
    if let Some(backing) = &opts.backing_file {
        let name = backing.as_os_str().as_bytes();
        if name.is_empty()
            || name.len() as u64 > MAX_BACKING_NAME
            || h.len() + name.len() > cs as usize
        {
            return Err(ErrorKind::InvalidBackingName(format!(
                "{} bytes does not fit the header cluster",
                name.len()
            )));
        }
        let at = h.len() as u64;
        h[8..16].copy_from_slice(&at.to_be_bytes());
        h[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
        h.extend_from_slice(name);
    }
    if h.len() > cs as usize {
        return Err(invalid("header_length", "header does not fit one cluster"));
    }
    image[..h.len()].copy_from_slice(&h);

    // Refcount table, blocks: every cluster of the new image has refcount 1.
    for b in 0..blocks {
        let block_offset = (1 + table + b) * cs;
        let t = (reftable_offset + b * 8) as usize;
        image[t..t + 8].copy_from_slice(&block_offset.to_be_bytes());
        let mut block = vec![0u8; cs as usize];
        for i in 0..block_entries {
            if b * block_entries + i < total {
                set_entry(&mut block, order, i as usize, 1);
            }
        }
        image[block_offset as usize..(block_offset + cs) as usize].copy_from_slice(&block);
    }
    let layout = ImageLayout {
        l1_offset,
        next_cluster: total - extra,
    };
    Ok((image, layout))
}

/// Creates (or overwrites) the image at `path` ([`create_with_locking`],
/// QEMU's locks taken where the filesystem has them).
pub fn create(path: &Path, opts: &CreateOptions) -> Result<(), Error> {
    create_with_locking(path, opts, Locking::Auto)
}

/// Creates (or overwrites) the image at `path`, as `qemu-img create`: a
/// file named as its own backing file is refused, and an existing file
/// is emptied only once this process holds a writer's image lock on it
/// (another process using it, or a chain of this one, refuses it,
/// untouched).
pub fn create_with_locking(
    path: &Path,
    opts: &CreateOptions,
    locking: Locking,
) -> Result<(), Error> {
    let e = |k: ErrorKind| Error::new(path, k);
    if let Some(backing) = &opts.backing_file {
        let resolved = crate::resolve_backing_path(path, backing).map_err(e)?;
        let same_file = match (std::fs::metadata(path), std::fs::metadata(&resolved)) {
            (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
            _ => false,
        };
        if same_file || resolved == path {
            return Err(e(ErrorKind::InvalidBackingName(
                "the image cannot be its own backing file".into(),
            )));
        }
    }
    let bytes = image_bytes(opts).map_err(e)?;
    // Anything but a regular file refused, without being opened.
    let file = crate::sidefile::dir::open_output_file(path, false).map_err(|io| e(io.into()))?;
    let storage = FileStorage::from_file(file);
    storage.lock(LockRequest::WRITER, locking).map_err(e)?;
    storage.set_len(0).map_err(|io| e(io.into()))?;
    storage.write_at(&bytes, 0).map_err(|io| e(io.into()))?;
    storage.sync().map_err(|io| e(io.into()))?;
    Ok(())
}
