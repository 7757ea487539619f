//! The bitmap directory: every entry parsed into a [`BitmapEntry`] with
//! QEMU's checks (`bitmap_list_load`, `check_dir_entry`), and the view
//! of it `qemu-img info` shows.

use serde::Serialize;

use crate::bytes::{be_u32, be_u64};
use crate::error::ErrorKind;
use crate::extension::{HeaderExtension, EXT_BITMAPS};
use crate::header::Header;
use crate::storage::Storage;

/// Bytes of a directory entry before its extra data and name.
const ENTRY_FIXED: usize = 24;
/// QEMU's limit on a bitmap's name.
pub(crate) const MAX_NAME: usize = 1023;
/// QEMU's granularity limits (bits).
pub(crate) const GRANULARITY_BITS: std::ops::RangeInclusive<u8> = 9..=31;
/// QEMU's limit on a bitmap table's entries.
const MAX_TABLE_SIZE: u32 = 0x800_0000;
/// The one bitmap type there is.
const TYPE_DIRTY_TRACKING: u8 = 1;
const FLAG_IN_USE: u32 = 1;
const FLAG_AUTO: u32 = 2;

/// One persistent bitmap, with `qemu-img info`'s fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct BitmapInfo {
    /// `in-use` (a writer had it open and did not store it back) and
    /// `auto` (it tracks writes), as QEMU names them.
    pub flags: Vec<&'static str>,
    /// Its name.
    pub name: String,
    /// Bytes of guest data per bit.
    pub granularity: u64,
}

/// One entry of the bitmap directory, as QEMU's checks accept it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BitmapEntry {
    /// Where its table starts (cluster aligned, not 0).
    pub(crate) table_offset: u64,
    /// Entries of its table (not 0, at most QEMU's limit).
    pub(crate) table_size: u32,
    /// Not stored back by its last writer: its bits cannot be trusted.
    pub(crate) in_use: bool,
    /// Tracks writes (QEMU's "enabled").
    pub(crate) auto: bool,
    /// Bytes of guest data per bit, log2 (QEMU's 9..=31).
    pub(crate) granularity_bits: u8,
    /// Its name, as QEMU reads it (up to the first NUL).
    pub(crate) name: String,
}

impl BitmapEntry {
    /// Bytes of guest data per bit.
    pub(crate) fn granularity(&self) -> u64 {
        1u64 << self.granularity_bits
    }

    /// Appends the entry as the directory holds it (padded to 8 bytes).
    fn encode(&self, out: &mut Vec<u8>) {
        let mut flags = 0;
        if self.in_use {
            flags |= FLAG_IN_USE;
        }
        if self.auto {
            flags |= FLAG_AUTO;
        }
        out.extend_from_slice(&self.table_offset.to_be_bytes());
        out.extend_from_slice(&self.table_size.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
        out.push(TYPE_DIRTY_TRACKING);
        out.push(self.granularity_bits);
        // Names are checked against MAX_NAME where they come in.
        out.extend_from_slice(&(self.name.len() as u16).to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.resize(out.len().next_multiple_of(8), 0);
    }

    fn info(&self) -> BitmapInfo {
        BitmapInfo {
            flags: [(self.in_use, "in-use"), (self.auto, "auto")]
                .into_iter()
                .filter(|(set, _)| *set)
                .map(|(_, name)| name)
                .collect(),
            name: self.name.clone(),
            granularity: self.granularity(),
        }
    }
}

/// The image's persistent bitmaps, in directory order (none when the
/// bitmaps extension is absent or not in force).
pub fn describe_bitmaps(
    header: &Header,
    storage: &dyn Storage,
) -> Result<Vec<BitmapInfo>, ErrorKind> {
    Ok(read_directory(header, storage)?
        .iter()
        .map(BitmapEntry::info)
        .collect())
}

/// The header's bitmaps extension, in force or not.
pub(crate) fn bitmaps_extension(header: &Header) -> Option<&crate::extension::BitmapsExtension> {
    header.extensions.iter().find_map(|e| match e {
        HeaderExtension::Bitmaps(b) => Some(b),
        _ => None,
    })
}

/// The bitmap directory holding `entries`, in order, as QEMU writes it.
pub(crate) fn encode_directory(entries: &[BitmapEntry]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in entries {
        e.encode(&mut out);
    }
    out
}

/// The entries of the image's bitmap directory, in order (none when the
/// bitmaps extension is absent or not in force: without the autoclear
/// bit QEMU takes them as inconsistent and drops them).
pub(crate) fn read_directory(
    header: &Header,
    storage: &dyn Storage,
) -> Result<Vec<BitmapEntry>, ErrorKind> {
    if !header.has_bitmaps() {
        return Ok(Vec::new());
    }
    let Some(ext) = bitmaps_extension(header) else {
        return Ok(Vec::new());
    };
    let invalid = |offset: usize, reason: &str| ErrorKind::InvalidExtension {
        ext_type: EXT_BITMAPS,
        offset: ext.directory_offset.saturating_add(offset as u64),
        reason: format!("bitmap directory: {reason}"),
    };
    // Bounded by the extension's validation (QEMU's limit: 64 MiB).
    let size = usize::try_from(ext.directory_size).map_err(|_| invalid(0, "too large"))?;
    let end = ext.directory_offset.checked_add(ext.directory_size);
    let file_size = storage.len()?;
    if end.is_none_or(|end| end > file_size) {
        return Err(invalid(0, "extends beyond the end of the file"));
    }
    let mut dir = vec![0u8; size];
    storage.read_at(&mut dir, ext.directory_offset)?;
    let cluster = header.geometry.cluster_size();
    let mut out = Vec::new();
    let mut pos = 0usize;
    // QEMU's checks of each entry, and of the directory as a whole.
    while pos < dir.len() {
        let fixed = dir
            .get(pos..pos.saturating_add(ENTRY_FIXED))
            .ok_or_else(|| invalid(pos, "entry beyond the directory"))?;
        let table_offset = be_u64(fixed, 0);
        let table_size = be_u32(fixed, 8);
        let flags = be_u32(fixed, 12);
        let kind = fixed[16];
        let granularity_bits = fixed[17];
        let name_size = usize::from(u16::from_be_bytes([fixed[18], fixed[19]]));
        let extra = be_u32(fixed, 20);
        if name_size > MAX_NAME {
            return Err(invalid(pos, &format!("a name of {name_size} bytes")));
        }
        let name_start = pos.saturating_add(ENTRY_FIXED);
        let name_end = name_start.saturating_add(name_size);
        let name = dir
            .get(name_start..name_end)
            .ok_or_else(|| invalid(pos, "name beyond the directory"))?;
        let shown = String::from_utf8_lossy(name.split(|&b| b == 0).next().unwrap_or_default())
            .into_owned();
        // What breaks QEMU's constraints on an entry, named.
        let broken = if kind != TYPE_DIRTY_TRACKING {
            Some(format!("type {kind} (QEMU knows only 1, dirty tracking)"))
        } else if flags & !(FLAG_IN_USE | FLAG_AUTO) != 0 {
            Some(format!(
                "unknown flags {:#x}",
                flags & !(FLAG_IN_USE | FLAG_AUTO)
            ))
        } else if !GRANULARITY_BITS.contains(&granularity_bits) {
            Some(format!(
                "granularity 2^{granularity_bits} bytes (QEMU allows 2^{} to 2^{})",
                GRANULARITY_BITS.start(),
                GRANULARITY_BITS.end()
            ))
        } else if table_size == 0 || table_size > MAX_TABLE_SIZE {
            Some(format!("a table of {table_size} entries"))
        } else if table_offset == 0 || table_offset % cluster != 0 {
            Some(format!("a table at {table_offset:#x}, not a cluster"))
        } else if extra != 0 {
            Some("extra data, which is not supported".into())
        } else {
            None
        };
        if let Some(why) = broken {
            return Err(invalid(pos, &format!("bitmap '{shown}': {why}")));
        }
        out.push(BitmapEntry {
            table_offset,
            table_size,
            in_use: flags & FLAG_IN_USE != 0,
            auto: flags & FLAG_AUTO != 0,
            granularity_bits,
            // As QEMU reads it: up to the first NUL.
            name: shown,
        });
        if out.len() > ext.nb_bitmaps as usize {
            return Err(invalid(pos, "more entries than bitmaps"));
        }
        pos = name_end.next_multiple_of(8);
    }
    if out.len() != ext.nb_bitmaps as usize || pos != dir.len() {
        return Err(invalid(
            pos,
            "fewer entries than bitmaps, or bytes after the last",
        ));
    }
    Ok(out)
}
