//! A bitmap's table and data: which guest ranges a persistent bitmap
//! marks dirty. Bit `n` covers guest bytes `[n * g, (n + 1) * g)` (`g` its
//! granularity), in data byte `n / 8` at bit `n % 8` from the least
//! significant; each table entry points at one cluster of those bytes, or
//! says it reads as all zeroes or all ones (QEMU's `load_bitmap_data`).

use std::ops::Range;

use crate::bitmaps::directory::{read_directory, BitmapEntry};
use crate::error::ErrorKind;
use crate::extension::EXT_BITMAPS;
use crate::header::Header;
use crate::storage::Storage;

/// Reserved bits of a table entry (QEMU's `BME_TABLE_ENTRY_RESERVED_MASK`).
const ENTRY_RESERVED: u64 = 0xff00_0000_0000_01fe;
/// The data cluster's offset in a table entry.
const ENTRY_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;
/// With no offset: the cluster reads as all ones.
const ENTRY_ALL_ONES: u64 = 1;
/// QEMU's limit on a bitmap's data, all its clusters together
/// (`BME_MAX_PHYS_SIZE`).
const MAX_DATA_BYTES: u64 = 0x2000_0000;

/// A persistent bitmap as read from the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapRead {
    /// Bytes of guest data per bit.
    pub granularity: u64,
    /// It tracks writes (QEMU's "auto" flag: enabled).
    pub enabled: bool,
    /// The guest ranges it marks dirty, in order, merged, within the
    /// disk; `None` when the bitmap is in use (its last writer did not
    /// store it back: QEMU takes it as inconsistent and reads no bit).
    pub dirty: Option<Vec<Range<u64>>>,
}

/// Reads the persistent bitmap `name` of the image whose header is
/// `header`: an input mistake if it has none of that name, an invalid
/// image if its table or data break QEMU's rules.
pub fn read_dirty_ranges(
    header: &Header,
    storage: &dyn Storage,
    name: &str,
) -> Result<BitmapRead, ErrorKind> {
    let entry = read_directory(header, storage)?
        .into_iter()
        .find(|e| e.name == name)
        .ok_or_else(|| ErrorKind::InvalidArgument(format!("Dirty bitmap '{name}' not found")))?;
    let dirty = if entry.in_use {
        None
    } else {
        Some(read_bits(header, storage, &entry)?)
    };
    Ok(BitmapRead {
        granularity: entry.granularity(),
        enabled: entry.auto,
        dirty,
    })
}

fn read_bits(
    header: &Header,
    storage: &dyn Storage,
    entry: &BitmapEntry,
) -> Result<Vec<Range<u64>>, ErrorKind> {
    let invalid = |reason: String| ErrorKind::InvalidExtension {
        ext_type: EXT_BITMAPS,
        offset: 0,
        reason: format!("bitmap '{}': {reason}", entry.name),
    };
    let cluster = header.geometry.cluster_size();
    let size = header.size;
    let granularity = entry.granularity();
    let bits = size.div_ceil(granularity);
    // Serialized as whole 64-bit words (QEMU's hbitmap), in clusters.
    let data_bytes = bits.div_ceil(64) * 8;
    let clusters = data_bytes.div_ceil(cluster);
    if u64::from(entry.table_size) != clusters {
        return Err(invalid(format!(
            "table of {} entries for {clusters} clusters of data",
            entry.table_size
        )));
    }
    if u64::from(entry.table_size) * cluster > MAX_DATA_BYTES {
        return Err(invalid("more data than QEMU allows".into()));
    }
    let table_bytes = usize::try_from(u64::from(entry.table_size) * 8)
        .map_err(|_| invalid("table too large".into()))?;
    let file_size = storage.len()?;
    if entry
        .table_offset
        .checked_add(table_bytes as u64)
        .is_none_or(|end| end > file_size)
    {
        return Err(invalid("table beyond the end of the file".into()));
    }
    let mut table = vec![0u8; table_bytes];
    storage.read_at(&mut table, entry.table_offset)?;
    let bits_per_cluster = cluster * 8;
    let mut ranges = Ranges::new(granularity, size);
    let mut data = vec![0u8; usize::try_from(cluster).map_err(|_| invalid("cluster".into()))?];
    for (k, raw) in table.chunks_exact(8).enumerate() {
        let e = u64::from_be_bytes(raw.try_into().unwrap_or_default());
        let offset = e & ENTRY_OFFSET;
        if e & ENTRY_RESERVED != 0
            || (offset != 0 && e & ENTRY_ALL_ONES != 0)
            || offset % cluster != 0
        {
            return Err(invalid(format!("invalid table entry {k}: {e:#018x}")));
        }
        let first_bit = k as u64 * bits_per_cluster;
        let last_bit = (first_bit + bits_per_cluster).min(bits);
        if offset == 0 {
            if e & ENTRY_ALL_ONES != 0 {
                ranges.mark(first_bit, last_bit);
            }
            continue;
        }
        storage.read_at(&mut data, offset)?;
        for (i, &byte) in data.iter().enumerate() {
            if byte == 0 {
                continue;
            }
            let base = first_bit + i as u64 * 8;
            for b in 0..8u64 {
                if byte & (1 << b) != 0 && base + b < last_bit {
                    ranges.mark(base + b, base + b + 1);
                }
            }
        }
    }
    Ok(ranges.out)
}

/// Dirty bits gathered into merged guest ranges.
struct Ranges {
    granularity: u64,
    size: u64,
    out: Vec<Range<u64>>,
}

impl Ranges {
    fn new(granularity: u64, size: u64) -> Self {
        Ranges {
            granularity,
            size,
            out: Vec::new(),
        }
    }

    /// Marks bits `[first, end)`, called in ascending order.
    fn mark(&mut self, first: u64, end: u64) {
        if first >= end {
            return;
        }
        let start = first * self.granularity;
        let stop = (end * self.granularity).min(self.size);
        match self.out.last_mut() {
            Some(last) if last.end == start => last.end = stop,
            _ => self.out.push(start..stop),
        }
    }
}
