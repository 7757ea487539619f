//! The qcow2 header (v2 and v3), parsed and validated field by field.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::bytes::{be_u32, be_u64};
use crate::error::{ErrorKind, Feature, Table};
use crate::extension::{parse_extensions, HeaderExtension};
use crate::features::{
    lookup_name, FeatureBits, FeatureKind, FeatureNameEntry, AUTOCLEAR_BITMAPS,
    INCOMPAT_COMPRESSION, INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE, INCOMPAT_DIRTY, INCOMPAT_EXTL2,
};
use crate::storage::Storage;
use crate::types::Geometry;

/// `QFI\xfb`.
pub(crate) const QCOW2_MAGIC: u32 = 0x5146_49fb;
/// Length of a v2 header.
pub(crate) const V2_HEADER_LEN: usize = 72;
/// Minimum length of a v3 header.
pub(crate) const V3_MIN_HEADER_LEN: usize = 104;
/// Incompatible bits sqcow2 knows.
const KNOWN_INCOMPAT: u64 =
    INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_DATA_FILE | INCOMPAT_COMPRESSION | INCOMPAT_EXTL2;
/// Byte offsets of the header fields (qcow2 specification, "Header").
pub(crate) mod field {
    pub(crate) const MAGIC: usize = 0;
    pub(crate) const VERSION: usize = 4;
    pub(crate) const BACKING_FILE_OFFSET: usize = 8;
    pub(crate) const BACKING_FILE_SIZE: usize = 16;
    pub(crate) const CLUSTER_BITS: usize = 20;
    pub(crate) const SIZE: usize = 24;
    pub(crate) const CRYPT_METHOD: usize = 32;
    pub(crate) const L1_SIZE: usize = 36;
    pub(crate) const L1_TABLE_OFFSET: usize = 40;
    pub(crate) const REFCOUNT_TABLE_OFFSET: usize = 48;
    pub(crate) const REFCOUNT_TABLE_CLUSTERS: usize = 56;
    pub(crate) const NB_SNAPSHOTS: usize = 60;
    pub(crate) const SNAPSHOTS_OFFSET: usize = 64;
    pub(crate) const INCOMPATIBLE_FEATURES: usize = 72;
    pub(crate) const COMPATIBLE_FEATURES: usize = 80;
    pub(crate) const AUTOCLEAR_FEATURES: usize = 88;
    pub(crate) const REFCOUNT_ORDER: usize = 96;
    pub(crate) const HEADER_LENGTH: usize = 100;
}

/// QEMU's limit on the active L1 table (bytes).
pub(crate) const MAX_L1_BYTES: u64 = 32 << 20;
/// QEMU's limit on the refcount table (bytes).
pub(crate) const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// QEMU's limit on internal snapshots.
pub(crate) const MAX_SNAPSHOTS: u64 = 65536;
/// Size of the fixed part of a snapshot table entry.
const SNAPSHOT_HEADER_LEN: u64 = 40;
/// QEMU's limit on the backing file name.
pub(crate) const MAX_BACKING_NAME: u64 = 1023;

/// qcow2 version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// compat=0.10.
    V2,
    /// compat=1.1.
    V3,
}

/// How compressed clusters are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompressionType {
    /// Raw deflate (type 0, the default).
    Deflate,
    /// zstd (type 1).
    Zstd,
}

impl CompressionType {
    /// QEMU's name for it.
    pub fn name(self) -> &'static str {
        match self {
            CompressionType::Deflate => "zlib",
            CompressionType::Zstd => "zstd",
        }
    }
}

/// A validated qcow2 header with its extensions and backing file name.
#[derive(Debug, Clone)]
pub struct Header {
    /// Version 2 or 3.
    pub version: Version,
    /// Cluster geometry.
    pub geometry: Geometry,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// 0: no encryption (the only value that validates).
    pub crypt_method: u32,
    /// Entries in the active L1 table.
    pub l1_size: u32,
    /// Offset of the active L1 table.
    pub l1_table_offset: u64,
    /// Offset of the refcount table.
    pub refcount_table_offset: u64,
    /// Clusters of the refcount table.
    pub refcount_table_clusters: u32,
    /// Number of internal snapshots.
    pub nb_snapshots: u32,
    /// Offset of the snapshot table.
    pub snapshots_offset: u64,
    /// Feature bits (zero for v2).
    pub features: FeatureBits,
    /// log2 of the refcount width in bits (4 for v2).
    pub refcount_order: u32,
    /// Length of the header proper (72 for v2).
    pub header_length: u32,
    /// Compression type of compressed clusters.
    pub compression_type: CompressionType,
    /// Header extensions in file order.
    pub extensions: Vec<HeaderExtension>,
    /// Backing file name as written in the image (bytes, up to the first NUL).
    pub backing_file: Option<PathBuf>,
    /// Bytes at the start of the file that the header, its extensions and
    /// the backing file name occupy.
    pub area_len: u64,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ErrorKind {
    ErrorKind::InvalidHeader {
        field,
        reason: reason.into(),
    }
}

/// Checks a table's size, alignment, and that it lies inside the file and
/// outside the header cluster.
fn validate_table(
    table: Table,
    offset: u64,
    entries: u64,
    entry_len: u64,
    max_bytes: u64,
    cluster_size: u64,
    file_size: u64,
) -> Result<(), ErrorKind> {
    if entries > max_bytes / entry_len {
        return Err(ErrorKind::TableTooLarge {
            table,
            entries,
            max: max_bytes / entry_len,
        });
    }
    if offset & (cluster_size - 1) != 0 {
        return Err(ErrorKind::UnalignedTable { table, offset });
    }
    if entries == 0 {
        return Ok(());
    }
    let len = entries * entry_len;
    if offset < cluster_size {
        return Err(ErrorKind::TableOverlapsHeader { table, offset });
    }
    if offset.checked_add(len).is_none_or(|end| end > file_size) {
        return Err(ErrorKind::TableBeyondEof {
            table,
            offset,
            len,
            file_size,
        });
    }
    Ok(())
}

impl Header {
    /// Bytes to read from the start of the file so that [`Header::parse`]
    /// sees the whole header cluster: the cluster size, once the first
    /// bytes have given `cluster_bits`.
    pub fn cluster_size_hint(first: &[u8]) -> Option<u64> {
        let bits = be_u32(first, field::CLUSTER_BITS);
        (9..=21).contains(&bits).then(|| 1u64 << bits)
    }

    /// Parses and validates the header from the start of a file, for a
    /// writer: an image marked corrupt is refused (QEMU refuses to open
    /// one read/write, except to repair it).
    ///
    /// `cluster` holds the first cluster of the file (or the whole file if
    /// it is shorter, zero-padded is fine), `file_size` the real file size.
    pub fn parse(cluster: &[u8], file_size: u64) -> Result<Header, ErrorKind> {
        let header = Self::parse_for_reading(cluster, file_size)?;
        header.refuse_if_marked_corrupt()?;
        Ok(header)
    }

    /// Refuses an image marked corrupt to a writer.
    pub fn refuse_if_marked_corrupt(&self) -> Result<(), ErrorKind> {
        if self.is_marked_corrupt() {
            return Err(ErrorKind::Unsupported(Feature::CorruptBit));
        }
        Ok(())
    }

    /// Whether the image is marked corrupt (QEMU's incompatible bit 1: it
    /// found an inconsistency while writing); QEMU still opens it
    /// read-only, and `check -r all` clears the mark.
    pub fn is_marked_corrupt(&self) -> bool {
        self.features.incompatible & INCOMPAT_CORRUPT != 0
    }

    /// [`Header::parse`] for a reader, which may read an image marked
    /// corrupt (as QEMU opens one read-only: `info`, `map`, `convert`, a
    /// backing file, `check`).
    pub fn parse_for_reading(cluster: &[u8], file_size: u64) -> Result<Header, ErrorKind> {
        Self::parse_with(cluster, file_size, Purpose::Use)
    }

    /// [`Header::parse_for_reading`] for `info`, which shows images
    /// sqcow2 cannot read the data of: LUKS-encrypted ones and those with
    /// an external data file are accepted ([`Header::crypt_method`],
    /// [`Header::data_file`], [`Header::luks_header`] tell).
    pub fn parse_for_inspection(cluster: &[u8], file_size: u64) -> Result<Header, ErrorKind> {
        Self::parse_with(cluster, file_size, Purpose::Inspect)
    }

    fn parse_with(cluster: &[u8], file_size: u64, purpose: Purpose) -> Result<Header, ErrorKind> {
        let inspect = purpose == Purpose::Inspect;
        let truncated = |needed: usize| ErrorKind::Truncated {
            what: "qcow2 header",
            offset: 0,
            needed: needed as u64,
            file_size,
        };
        if file_size < 8 || cluster.len() < 8 {
            return Err(truncated(V2_HEADER_LEN));
        }
        let magic = be_u32(cluster, field::MAGIC);
        if magic != QCOW2_MAGIC {
            return Err(ErrorKind::BadMagic(magic));
        }
        let version = match be_u32(cluster, field::VERSION) {
            2 => Version::V2,
            3 => Version::V3,
            v => return Err(ErrorKind::UnsupportedVersion(v)),
        };
        let min_len = match version {
            Version::V2 => V2_HEADER_LEN,
            Version::V3 => V3_MIN_HEADER_LEN,
        };
        if file_size < min_len as u64 || cluster.len() < min_len {
            return Err(truncated(min_len));
        }
        let cluster_bits = be_u32(cluster, field::CLUSTER_BITS);
        if !(9..=21).contains(&cluster_bits) {
            return Err(ErrorKind::ClusterBits(cluster_bits));
        }
        let cluster_size = 1u64 << cluster_bits;

        let (features, refcount_order, header_length) = match version {
            Version::V2 => (FeatureBits::default(), 4, V2_HEADER_LEN as u32),
            Version::V3 => (
                FeatureBits {
                    incompatible: be_u64(cluster, field::INCOMPATIBLE_FEATURES),
                    compatible: be_u64(cluster, field::COMPATIBLE_FEATURES),
                    autoclear: be_u64(cluster, field::AUTOCLEAR_FEATURES),
                },
                be_u32(cluster, field::REFCOUNT_ORDER),
                be_u32(cluster, field::HEADER_LENGTH),
            ),
        };
        if version == Version::V3 && (header_length as usize) < V3_MIN_HEADER_LEN {
            return Err(invalid(
                "header_length",
                format!("{header_length} is below 104"),
            ));
        }
        if u64::from(header_length) > cluster_size {
            return Err(invalid(
                "header_length",
                format!("{header_length} exceeds the cluster size {cluster_size}"),
            ));
        }
        if cluster.len() < header_length as usize || file_size < u64::from(header_length) {
            return Err(truncated(header_length as usize));
        }

        let backing_file_offset = be_u64(cluster, field::BACKING_FILE_OFFSET);
        let backing_file_size = be_u32(cluster, field::BACKING_FILE_SIZE);
        if backing_file_offset > cluster_size {
            return Err(ErrorKind::InvalidBackingName(format!(
                "offset {backing_file_offset:#x} lies beyond the first cluster"
            )));
        }
        let ext_end = if backing_file_offset != 0 {
            backing_file_offset
        } else {
            cluster_size
        };
        let extensions = parse_extensions(cluster, header_length as usize, ext_end as usize);
        let feature_table: Vec<FeatureNameEntry> = match &extensions {
            Ok((exts, _)) => exts
                .iter()
                .filter_map(|e| match e {
                    HeaderExtension::FeatureNameTable(t) => Some(t.iter().cloned()),
                    _ => None,
                })
                .flatten()
                .collect(),
            Err(_) => Vec::new(),
        };

        let compression_type = if header_length > 104 { cluster[104] } else { 0 };
        let compression_type = match compression_type {
            0 => CompressionType::Deflate,
            1 => CompressionType::Zstd,
            t => return Err(ErrorKind::Unsupported(Feature::UnknownCompressionType(t))),
        };
        let has_compression_bit = features.incompatible & INCOMPAT_COMPRESSION != 0;
        if (compression_type == CompressionType::Zstd) != has_compression_bit {
            return Err(invalid(
                "incompatible_features",
                "compression type bit must be set exactly when the compression type is not deflate",
            ));
        }

        let unknown = features.incompatible & !KNOWN_INCOMPAT;
        if unknown != 0 {
            let bit = unknown.trailing_zeros();
            let name = lookup_name(&feature_table, FeatureKind::Incompatible, bit);
            return Err(ErrorKind::Unsupported(Feature::UnknownIncompatible {
                bit,
                name,
            }));
        }
        let data_file = features.incompatible & INCOMPAT_DATA_FILE != 0;
        if data_file && !inspect {
            return Err(ErrorKind::Unsupported(Feature::ExternalDataFile));
        }
        if features.autoclear & crate::features::AUTOCLEAR_DATA_FILE_RAW != 0 && !data_file {
            // (QEMU's words: it refuses the image too.)
            return Err(invalid(
                "autoclear_features",
                "data-file-raw requires a data file".to_string(),
            ));
        }
        let geometry = Geometry {
            cluster_bits,
            extended_l2: features.incompatible & INCOMPAT_EXTL2 != 0,
        };
        if geometry.subcluster_size() < 512 {
            return Err(invalid(
                "incompatible_features",
                format!("extended L2 entries need clusters of at least 16 KiB, not {cluster_size}"),
            ));
        }
        if refcount_order > 6 {
            return Err(invalid(
                "refcount_order",
                format!("{refcount_order} is above 6"),
            ));
        }
        let crypt_method = be_u32(cluster, field::CRYPT_METHOD);
        match crypt_method {
            0 => {}
            1 => return Err(ErrorKind::Unsupported(Feature::AesEncryption)),
            2 if inspect => {}
            2 => return Err(ErrorKind::Unsupported(Feature::LuksEncryption)),
            m => return Err(ErrorKind::Unsupported(Feature::UnknownEncryption(m))),
        }

        let refcount_table_offset = be_u64(cluster, field::REFCOUNT_TABLE_OFFSET);
        let refcount_table_clusters = be_u32(cluster, field::REFCOUNT_TABLE_CLUSTERS);
        if refcount_table_clusters == 0 {
            return Err(invalid(
                "refcount_table_clusters",
                "image has no refcount table",
            ));
        }
        validate_table(
            Table::Refcount,
            refcount_table_offset,
            u64::from(refcount_table_clusters),
            cluster_size,
            MAX_REFTABLE_BYTES,
            cluster_size,
            file_size,
        )?;
        let nb_snapshots = be_u32(cluster, field::NB_SNAPSHOTS);
        let snapshots_offset = be_u64(cluster, field::SNAPSHOTS_OFFSET);
        validate_table(
            Table::Snapshots,
            snapshots_offset,
            u64::from(nb_snapshots),
            SNAPSHOT_HEADER_LEN,
            SNAPSHOT_HEADER_LEN * MAX_SNAPSHOTS,
            cluster_size,
            file_size,
        )?;
        let l1_size = be_u32(cluster, field::L1_SIZE);
        let l1_table_offset = be_u64(cluster, field::L1_TABLE_OFFSET);
        validate_table(
            Table::L1,
            l1_table_offset,
            u64::from(l1_size),
            8,
            MAX_L1_BYTES,
            cluster_size,
            file_size,
        )?;
        let size = be_u64(cluster, field::SIZE);
        let needed = geometry.l1_entries_for(size);
        if size > i64::MAX as u64 || needed > i32::MAX as u64 {
            return Err(ErrorKind::SizeTooLarge(size));
        }
        if u64::from(l1_size) < needed {
            return Err(ErrorKind::L1TooSmall { l1_size, needed });
        }

        let (extensions, ext_area_end) = extensions?;
        for ext in &extensions {
            match ext {
                HeaderExtension::Bitmaps(b) if features.autoclear & AUTOCLEAR_BITMAPS != 0 => {
                    b.validate(cluster_size)?;
                }
                HeaderExtension::Crypto { .. } if crypt_method != 2 => {
                    return Err(ErrorKind::InvalidExtension {
                        ext_type: ext.ext_type(),
                        offset: 0,
                        reason: "crypto header without LUKS encryption".into(),
                    });
                }
                _ => {}
            }
        }

        let backing_file = if backing_file_offset != 0 && backing_file_size != 0 {
            let len = u64::from(backing_file_size);
            if len > MAX_BACKING_NAME.min(cluster_size - backing_file_offset) {
                return Err(ErrorKind::InvalidBackingName(format!(
                    "{len} bytes is too long (at most {MAX_BACKING_NAME}, inside the first cluster)"
                )));
            }
            let start = backing_file_offset as usize;
            let raw = cluster
                .get(start..start + len as usize)
                .ok_or_else(|| truncated(start + len as usize))?;
            let raw = raw.split(|&b| b == 0).next().unwrap_or_default();
            (!raw.is_empty()).then(|| PathBuf::from(OsStr::from_bytes(raw)))
        } else {
            None
        };

        let area_len = (ext_area_end as u64)
            .max(u64::from(header_length))
            .max(if backing_file_offset != 0 {
                backing_file_offset + u64::from(backing_file_size)
            } else {
                0
            })
            .min(cluster_size);
        Ok(Header {
            area_len,
            version,
            geometry,
            size,
            crypt_method,
            l1_size,
            l1_table_offset,
            refcount_table_offset,
            refcount_table_clusters,
            nb_snapshots,
            snapshots_offset,
            features,
            refcount_order,
            header_length,
            compression_type,
            extensions,
            backing_file,
        })
    }

    /// The backing format recorded in the backing format extension.
    pub fn backing_format(&self) -> Option<&str> {
        self.extensions.iter().find_map(|e| match e {
            HeaderExtension::BackingFormat(f) => Some(f.as_str()),
            _ => None,
        })
    }

    /// All entries of the feature name table extension.
    pub fn feature_names(&self) -> Vec<FeatureNameEntry> {
        self.extensions
            .iter()
            .filter_map(|e| match e {
                HeaderExtension::FeatureNameTable(t) => Some(t.iter().cloned()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// Whether a persistent bitmaps extension is present and in force.
    pub fn has_bitmaps(&self) -> bool {
        self.features.autoclear & AUTOCLEAR_BITMAPS != 0
            && self
                .extensions
                .iter()
                .any(|e| matches!(e, HeaderExtension::Bitmaps(_)))
    }

    /// The guest's disk size: the header's size in whole 512-byte
    /// sectors, as QEMU counts it (a partial last sector is not part of
    /// the disk).
    pub fn virtual_size(&self) -> u64 {
        self.size / 512 * 512
    }

    /// Whether the dirty bit is set.
    pub fn is_dirty(&self) -> bool {
        self.features.incompatible & INCOMPAT_DIRTY != 0
    }

    /// Whether refcounts are updated lazily.
    pub fn lazy_refcounts(&self) -> bool {
        self.features.compatible & crate::features::COMPAT_LAZY_REFCOUNTS != 0
    }
}

/// What a header is parsed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// Reading or writing the image.
    Use,
    /// Showing what it is (`info`).
    Inspect,
}

impl Header {
    /// The external data file's name and whether it is raw (it holds the
    /// guest's bytes at their own offsets), where the image has one.
    pub fn data_file(&self) -> Option<(String, bool)> {
        if self.features.incompatible & INCOMPAT_DATA_FILE == 0 {
            return None;
        }
        let name = self.extensions.iter().find_map(|e| match e {
            HeaderExtension::ExternalDataFile(n) => Some(String::from_utf8_lossy(n).into_owned()),
            _ => None,
        })?;
        let raw = self.features.autoclear & crate::features::AUTOCLEAR_DATA_FILE_RAW != 0;
        Some((name, raw))
    }

    /// Where the LUKS header of an encrypted image lies (offset, length).
    pub fn luks_header(&self) -> Option<(u64, u64)> {
        (self.crypt_method == 2)
            .then(|| {
                self.extensions.iter().find_map(|e| match e {
                    HeaderExtension::Crypto { offset, length } => Some((*offset, *length)),
                    _ => None,
                })
            })
            .flatten()
    }

    /// Reads the header of the image in `storage` for `info`
    /// ([`Header::parse_for_inspection`]).
    pub fn read_for_inspection(storage: &dyn Storage) -> Result<Header, ErrorKind> {
        let file_size = storage.len()?;
        let mut first = vec![0u8; 112];
        storage.read_at(&mut first, 0)?;
        let len = Header::cluster_size_hint(&first).map_or(112, |cs| cs.min(file_size).max(112));
        let mut cluster = vec![0u8; len as usize];
        storage.read_at(&mut cluster, 0)?;
        Header::parse_for_inspection(&cluster, file_size)
    }

    /// Reads the header of the image in `storage` (its first cluster),
    /// validated; an image marked corrupt is refused, as QEMU refuses to
    /// open it.
    pub fn read(storage: &dyn Storage) -> Result<Header, ErrorKind> {
        let header = Header::read_for_check(storage)?;
        header.refuse_if_marked_corrupt()?;
        Ok(header)
    }

    /// [`Header::read`] for a reader or a repair, which may meet an image
    /// marked corrupt (`qemu-img check` reads and repairs one).
    pub(crate) fn read_for_check(storage: &dyn Storage) -> Result<Header, ErrorKind> {
        Header::read_with_area(storage).map(|(header, _, _)| header)
    }

    /// [`Header::read_for_check`], with the header area's bytes as the
    /// file holds them (`area_len` of them) and the file's size it was
    /// parsed against.
    pub(crate) fn read_with_area(
        storage: &dyn Storage,
    ) -> Result<(Header, Vec<u8>, u64), ErrorKind> {
        let file_size = storage.len()?;
        let mut first = vec![0u8; 112];
        storage.read_at(&mut first, 0)?;
        let (header, mut area) = match Header::cluster_size_hint(&first) {
            Some(cluster_size) => {
                let mut cluster = vec![0u8; cluster_size.min(file_size).max(112) as usize];
                storage.read_at(&mut cluster, 0)?;
                (Header::parse_for_reading(&cluster, file_size)?, cluster)
            }
            None => (
                Header::parse_for_reading(&first[..file_size.min(112) as usize], file_size)?,
                first,
            ),
        };
        area.truncate(header.area_len as usize);
        Ok((header, area, file_size))
    }
}
