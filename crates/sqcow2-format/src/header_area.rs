//! Rewriting the header area of a qcow2 image (the header, its extensions
//! and the backing file name) in one write: naming an index, changing or
//! removing the backing file.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::extension::{HeaderExtension, EXT_BACKING_FORMAT, EXT_BITMAPS, EXT_FEATURE_TABLE};
use crate::header::Header;
use crate::index::EXT_SQCOW2;
use crate::storage::Storage;

/// Version of the sQcow2 header extension's data.
const EXT_VERSION: u32 = 1;

/// What happens to one part of the header area.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Edit<T> {
    /// Left as it is.
    Keep,
    /// Replaced (or added).
    Set(T),
    /// Removed.
    Remove,
}

/// A backing file as the header records it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BackingName<'a> {
    /// The name, as written (relative names are relative to the image's
    /// directory).
    pub name: &'a [u8],
    /// The backing format extension (`None`: none written).
    pub format: Option<&'a str>,
}

/// The changes [`rewrite`] makes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AreaEdit<'a> {
    /// The sQcow2 extension naming the index file.
    pub index: Edit<&'a Path>,
    /// The backing file name and format.
    pub backing: Edit<BackingName<'a>>,
    /// The header proper (its fixed fields, `header_length` bytes of
    /// them): `Keep`, or new bytes (a version change; `Remove` is not
    /// meaningful). With a v2 header, only extensions v2 knows are kept.
    pub fixed: Edit<&'a [u8]>,
    /// Write the feature name table (v3 headers), whether the image had
    /// one or not.
    pub feature_table: Option<&'a [crate::features::FeatureNameEntry]>,
    /// Where the bitmap directory is.
    pub bitmaps: Edit<&'a crate::extension::BitmapsExtension>,
}

fn push(out: &mut Vec<u8>, t: u32, data: &[u8]) {
    out.extend_from_slice(&t.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(8) * 8, 0);
}

fn feature_table_bytes(t: &[crate::features::FeatureNameEntry]) -> Vec<u8> {
    let mut data = Vec::new();
    for e in t.iter() {
        let mut entry = [0u8; 48];
        entry[0] = match e.kind {
            Some(crate::features::FeatureKind::Incompatible) => 0,
            Some(crate::features::FeatureKind::Compatible) => 1,
            Some(crate::features::FeatureKind::Autoclear) => 2,
            None => 0xff,
        };
        entry[1] = e.bit;
        let n = e.name.len().min(46);
        entry[2..2 + n].copy_from_slice(&e.name.as_bytes()[..n]);
        data.extend_from_slice(&entry);
    }
    data
}

/// Writes the 64-bit header field at byte `at` (a feature word) and syncs.
pub(crate) fn write_word(storage: &dyn Storage, at: usize, value: u64) -> std::io::Result<()> {
    storage.write_at(&value.to_be_bytes(), at as u64)?;
    storage.sync()
}

/// Rewrites the header area of the image in `storage` (whose header is
/// `header`) with `edit` applied: extensions re-laid out as QEMU does,
/// the backing name after them, all of it in one write of the first
/// cluster's head, then synced. Fails (writing nothing) if the area does
/// not fit the first cluster or holds an extension this code cannot
/// rewrite (crypto, data file: images refused for writing).
pub(crate) fn rewrite(
    storage: &dyn Storage,
    header: &Header,
    edit: &AreaEdit<'_>,
) -> std::io::Result<()> {
    let out = compose(storage, header, edit)?;
    storage.write_at(&out, 0)?;
    storage.sync()
}

/// The header area [`rewrite`] would write (the old area's tail cleared),
/// nothing written; fails as it would.
pub(crate) fn compose(
    storage: &dyn Storage,
    header: &Header,
    edit: &AreaEdit<'_>,
) -> std::io::Result<Vec<u8>> {
    let cs = header.geometry.cluster_size() as usize;
    let mut out = match edit.fixed {
        Edit::Set(bytes) => bytes.to_vec(),
        Edit::Keep | Edit::Remove => {
            let mut out = vec![0u8; header.header_length as usize];
            storage.read_at(&mut out, 0)?;
            out
        }
    };
    let v2 = out.get(4..8) == Some(&2u32.to_be_bytes()[..]);
    let old_index = header.extensions.iter().find_map(|ext| match ext {
        HeaderExtension::Unknown { ext_type, data } if *ext_type == EXT_SQCOW2 => {
            Some(data.clone())
        }
        _ => None,
    });
    let old_format = header.extensions.iter().find_map(|ext| match ext {
        HeaderExtension::BackingFormat(f) => Some(f.clone()),
        _ => None,
    });
    let (backing, format): (Option<Vec<u8>>, Option<String>) = match edit.backing {
        Edit::Keep => (
            header
                .backing_file
                .as_ref()
                .map(|b| b.as_os_str().as_bytes().to_vec()),
            old_format,
        ),
        Edit::Set(b) => (Some(b.name.to_vec()), b.format.map(str::to_owned)),
        Edit::Remove => (None, None),
    };
    if let Some(f) = &format {
        push(&mut out, EXT_BACKING_FORMAT, f.as_bytes());
    }
    for ext in &header.extensions {
        match ext {
            HeaderExtension::Unknown { ext_type, .. } if *ext_type == EXT_SQCOW2 => {}
            HeaderExtension::BackingFormat(_) => {}
            HeaderExtension::FeatureNameTable(_) if v2 || edit.feature_table.is_some() => {}
            HeaderExtension::FeatureNameTable(t) => {
                push(&mut out, EXT_FEATURE_TABLE, &feature_table_bytes(t))
            }
            HeaderExtension::Unknown { ext_type, data } => push(&mut out, *ext_type, data),
            // Where the bitmap directory is: kept unless edited (the
            // header's other fields change nothing the bitmaps describe).
            HeaderExtension::Bitmaps(b) => match edit.bitmaps {
                Edit::Keep => push(&mut out, EXT_BITMAPS, &b.to_bytes()),
                Edit::Set(new) => push(&mut out, EXT_BITMAPS, &new.to_bytes()),
                Edit::Remove => {}
            },
            other => {
                return Err(std::io::Error::other(format!(
                    "cannot rewrite header extension {:#x}",
                    other.ext_type()
                )))
            }
        }
    }
    let had_bitmaps = header
        .extensions
        .iter()
        .any(|e| matches!(e, HeaderExtension::Bitmaps(_)));
    if let (Edit::Set(new), false) = (edit.bitmaps, had_bitmaps) {
        push(&mut out, EXT_BITMAPS, &new.to_bytes());
    }
    if let (Some(t), false) = (edit.feature_table, v2) {
        push(&mut out, EXT_FEATURE_TABLE, &feature_table_bytes(t));
    }
    let index = match edit.index {
        Edit::Keep => old_index,
        Edit::Set(path) => {
            let mut data = Vec::new();
            data.extend_from_slice(&EXT_VERSION.to_be_bytes());
            data.extend_from_slice(&0u32.to_be_bytes());
            data.extend_from_slice(path.as_os_str().as_bytes());
            Some(data)
        }
        Edit::Remove => None,
    };
    if let Some(data) = &index {
        push(&mut out, EXT_SQCOW2, data);
    }
    out.extend_from_slice(&[0u8; 8]);
    match &backing {
        Some(name) => {
            let at = out.len() as u64;
            out[8..16].copy_from_slice(&at.to_be_bytes());
            out[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
            out.extend_from_slice(name);
        }
        None => out[8..20].fill(0),
    }
    if out.len() > cs {
        return Err(std::io::Error::other(
            "header extensions do not fit the first cluster",
        ));
    }
    // Clear what the old area used beyond the new one.
    let old_len = header.area_len as usize;
    if old_len > out.len() {
        out.resize(old_len, 0);
    }
    Ok(out)
}
