//! Header extensions: the typed ones QEMU defines, unknown ones kept verbatim.

use std::sync::{Arc, Mutex, PoisonError};

use serde::Serialize;

use crate::bytes::{be_u32, be_u64};
use crate::error::ErrorKind;
use crate::features::{FeatureKind, FeatureNameEntry};

/// End of the extension area.
pub(crate) const EXT_END: u32 = 0;
/// Backing file format name.
pub(crate) const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// Feature name table.
pub(crate) const EXT_FEATURE_TABLE: u32 = 0x6803_f857;
/// Persistent dirty bitmaps.
pub(crate) const EXT_BITMAPS: u32 = 0x2385_2875;
/// Full disk encryption header (LUKS).
pub(crate) const EXT_CRYPTO: u32 = 0x0537_be77;
/// External data file name.
pub(crate) const EXT_DATA_FILE: u32 = 0x4441_5441;

/// QEMU's limit on the number of persistent bitmaps.
const MAX_BITMAPS: u32 = 65535;
/// QEMU's limit on the size of the bitmap directory.
const MAX_BITMAP_DIRECTORY_SIZE: u64 = 1024 * MAX_BITMAPS as u64;
/// Size of one feature name table entry.
const FEATURE_ENTRY_SIZE: usize = 48;

/// The bitmaps extension: where the bitmap directory is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct BitmapsExtension {
    /// Number of bitmaps.
    pub nb_bitmaps: u32,
    /// Size of the bitmap directory in bytes.
    pub directory_size: u64,
    /// Offset of the bitmap directory.
    pub directory_offset: u64,
}

impl BitmapsExtension {
    /// The extension's data as the header holds it (the reserved word
    /// zero).
    pub(crate) fn to_bytes(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[0..4].copy_from_slice(&self.nb_bitmaps.to_be_bytes());
        b[8..16].copy_from_slice(&self.directory_size.to_be_bytes());
        b[16..24].copy_from_slice(&self.directory_offset.to_be_bytes());
        b
    }

    /// QEMU's checks, applied when the bitmaps autoclear bit is set.
    pub(crate) fn validate(&self, cluster_size: u64) -> Result<(), ErrorKind> {
        let fail = |reason: &str| Err(invalid(EXT_BITMAPS, 0, reason));
        if self.nb_bitmaps == 0 || self.nb_bitmaps > MAX_BITMAPS {
            return fail("bitmap count out of range");
        }
        if self.directory_size > MAX_BITMAP_DIRECTORY_SIZE {
            return fail("bitmap directory too large");
        }
        if self.directory_offset & (cluster_size - 1) != 0 {
            return fail("bitmap directory offset not cluster aligned");
        }
        Ok(())
    }
}

/// Distinct feature name tables kept for sharing at most (beyond, a
/// table is not shared: hostile images cannot grow this without bound).
const SHARED_TABLES: usize = 32;

/// `entries` as a shared table: the copy already made for an identical
/// table if there is one.
fn shared_table(entries: Vec<FeatureNameEntry>) -> Arc<[FeatureNameEntry]> {
    static TABLES: Mutex<Vec<Arc<[FeatureNameEntry]>>> = Mutex::new(Vec::new());
    let mut tables = TABLES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(t) = tables.iter().find(|t| ***t == *entries) {
        return t.clone();
    }
    let table: Arc<[FeatureNameEntry]> = entries.into();
    if tables.len() < SHARED_TABLES {
        tables.push(table.clone());
    }
    table
}

/// One header extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderExtension {
    /// Format of the backing file (`qcow2`, `raw`, ...).
    BackingFormat(String),
    /// Names of feature bits (identical tables of different images share
    /// one copy: every layer of a long chain usually has the same one).
    FeatureNameTable(Arc<[FeatureNameEntry]>),
    /// Persistent dirty bitmaps.
    Bitmaps(BitmapsExtension),
    /// LUKS header location.
    Crypto {
        /// Offset of the LUKS header.
        offset: u64,
        /// Its length.
        length: u64,
    },
    /// Name of the external data file.
    ExternalDataFile(Vec<u8>),
    /// An extension sqcow2 does not interpret, kept byte for byte.
    Unknown {
        /// Extension type.
        ext_type: u32,
        /// Its data, without padding.
        data: Vec<u8>,
    },
}

impl HeaderExtension {
    /// The extension's type number.
    pub fn ext_type(&self) -> u32 {
        match self {
            HeaderExtension::BackingFormat(_) => EXT_BACKING_FORMAT,
            HeaderExtension::FeatureNameTable(_) => EXT_FEATURE_TABLE,
            HeaderExtension::Bitmaps(_) => EXT_BITMAPS,
            HeaderExtension::Crypto { .. } => EXT_CRYPTO,
            HeaderExtension::ExternalDataFile(_) => EXT_DATA_FILE,
            HeaderExtension::Unknown { ext_type, .. } => *ext_type,
        }
    }
}

fn invalid(ext_type: u32, offset: usize, reason: impl Into<String>) -> ErrorKind {
    ErrorKind::InvalidExtension {
        ext_type,
        offset: offset as u64,
        reason: reason.into(),
    }
}

/// Parses the extensions in `cluster[start..end]`.
///
/// Stops at the end marker or at `end`, whichever comes first; returns the
/// extensions and the offset just past the last byte read.
pub(crate) fn parse_extensions(
    cluster: &[u8],
    start: usize,
    end: usize,
) -> Result<(Vec<HeaderExtension>, usize), ErrorKind> {
    let mut out = Vec::new();
    let end = end.min(cluster.len());
    let mut offset = start;
    while offset < end {
        let ext_type = be_u32(cluster, offset);
        let len = be_u32(cluster, offset + 4) as usize;
        let at = offset;
        offset += 8;
        if offset > end || len > end - offset {
            return Err(invalid(ext_type, at, "extension too large"));
        }
        let data = &cluster[offset..offset + len];
        match ext_type {
            EXT_END => return Ok((out, offset)),
            EXT_BACKING_FORMAT => {
                if len >= 16 {
                    return Err(invalid(
                        ext_type,
                        at,
                        format!("backing format length {len} too large"),
                    ));
                }
                let name = String::from_utf8_lossy(data);
                let name = name.split('\0').next().unwrap_or_default().to_owned();
                out.push(HeaderExtension::BackingFormat(name));
            }
            EXT_FEATURE_TABLE => {
                let entries = data
                    .chunks_exact(FEATURE_ENTRY_SIZE)
                    .map(|e| {
                        let name = String::from_utf8_lossy(&e[2..]);
                        FeatureNameEntry {
                            kind: FeatureKind::from_table_type(e[0]),
                            bit: e[1],
                            name: name.trim_end_matches('\0').to_owned(),
                        }
                    })
                    .collect();
                out.push(HeaderExtension::FeatureNameTable(shared_table(entries)));
            }
            EXT_BITMAPS => {
                if len != 24 {
                    return Err(invalid(
                        ext_type,
                        at,
                        format!("bitmaps extension length {len}, expected 24"),
                    ));
                }
                let ext = BitmapsExtension {
                    nb_bitmaps: be_u32(data, 0),
                    directory_size: be_u64(data, 8),
                    directory_offset: be_u64(data, 16),
                };
                out.push(HeaderExtension::Bitmaps(ext));
            }
            EXT_CRYPTO => {
                if len != 16 {
                    return Err(invalid(
                        ext_type,
                        at,
                        format!("crypto extension length {len}, expected 16"),
                    ));
                }
                out.push(HeaderExtension::Crypto {
                    offset: be_u64(data, 0),
                    length: be_u64(data, 8),
                });
            }
            EXT_DATA_FILE => out.push(HeaderExtension::ExternalDataFile(data.to_vec())),
            _ => out.push(HeaderExtension::Unknown {
                ext_type,
                data: data.to_vec(),
            }),
        }
        offset += len.div_ceil(8) * 8;
    }
    Ok((out, offset.min(end)))
}
