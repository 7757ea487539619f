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
        let words = read_words(header, storage, &entry)?;
        Some(dirty_ranges(&words, entry.granularity(), header.size))
    };
    Ok(BitmapRead {
        granularity: entry.granularity(),
        enabled: entry.auto,
        dirty,
    })
}

/// The entries of bitmap `entry`'s table, checked as QEMU's
/// `bitmap_table_load` and `load_bitmap_data` check them.
fn read_entries(
    header: &Header,
    storage: &dyn Storage,
    entry: &BitmapEntry,
) -> Result<Vec<u64>, ErrorKind> {
    let invalid = |reason: String| invalid(entry, reason);
    let cluster = header.geometry.cluster_size();
    let bits = header.size.div_ceil(entry.granularity());
    let clusters = data_clusters(bits, cluster);
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
    let mut out = Vec::with_capacity(table.len() / 8);
    for (k, raw) in table.chunks_exact(8).enumerate() {
        let e = u64::from_be_bytes(raw.try_into().unwrap_or_default());
        let offset = e & ENTRY_OFFSET;
        if e & ENTRY_RESERVED != 0
            || (offset != 0 && e & ENTRY_ALL_ONES != 0)
            || offset % cluster != 0
            || offset
                .checked_add(cluster)
                .is_none_or(|end| end > file_size)
        {
            return Err(invalid(format!("invalid table entry {k}: {e:#018x}")));
        }
        out.push(e);
    }
    Ok(out)
}

fn invalid(entry: &BitmapEntry, reason: String) -> ErrorKind {
    ErrorKind::InvalidExtension {
        ext_type: EXT_BITMAPS,
        offset: 0,
        reason: format!("bitmap '{}': {reason}", entry.name),
    }
}

/// The data clusters (offsets) bitmap `entry`'s table names; none for an
/// in-use bitmap whose table does not pass the checks (QEMU reads no
/// table of those either).
pub(crate) fn read_table(
    header: &Header,
    storage: &dyn Storage,
    entry: &BitmapEntry,
) -> Result<Vec<u64>, ErrorKind> {
    let entries = match read_entries(header, storage, entry) {
        Ok(e) => e,
        Err(_) if entry.in_use => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(entries
        .into_iter()
        .map(|e| e & ENTRY_OFFSET)
        .filter(|&o| o != 0)
        .collect())
}

/// The bits of a consistent bitmap `entry` as 64-bit words (bit `n` in
/// word `n / 64` at bit `n % 64`), `ceil(size / granularity)` bits.
pub(crate) fn read_words(
    header: &Header,
    storage: &dyn Storage,
    entry: &BitmapEntry,
) -> Result<Vec<u64>, ErrorKind> {
    let table = read_entries(header, storage, entry)?;
    let cluster = header.geometry.cluster_size();
    let bits = header.size.div_ceil(entry.granularity());
    let cluster_bytes = usize::try_from(cluster).map_err(|_| invalid(entry, "cluster".into()))?;
    let words_per_cluster = cluster_bytes / 8;
    let n_words = usize::try_from(bits.div_ceil(64)).map_err(|_| invalid(entry, "size".into()))?;
    let mut words = vec![0u64; n_words];
    let mut data = vec![0u8; cluster_bytes];
    for (k, e) in table.into_iter().enumerate() {
        let offset = e & ENTRY_OFFSET;
        let first = k * words_per_cluster;
        let these = &mut words[first.min(n_words)..(first + words_per_cluster).min(n_words)];
        if offset == 0 {
            if e & ENTRY_ALL_ONES != 0 {
                these.fill(u64::MAX);
            }
            continue;
        }
        storage.read_at(&mut data, offset)?;
        for (w, raw) in these.iter_mut().zip(data.chunks_exact(8)) {
            *w = u64::from_le_bytes(raw.try_into().unwrap_or_default());
        }
    }
    // Bits past the disk's end are not bits of the bitmap.
    if let Some(last) = words.last_mut() {
        if bits % 64 != 0 {
            *last &= (1u64 << (bits % 64)) - 1;
        }
    }
    Ok(words)
}

/// A bitmap's data laid out for the image: per table entry, `None` for
/// an all-zero cluster (entry 0, as QEMU writes it) or the cluster's
/// bytes.
pub(crate) fn data_for_image(words: &[u64], cluster: u64) -> Vec<Option<Vec<u8>>> {
    let per = (cluster / 8) as usize;
    words
        .chunks(per)
        .map(|chunk| {
            chunk.iter().any(|&w| w != 0).then(|| {
                let mut bytes = vec![0u8; cluster as usize];
                for (raw, w) in bytes.chunks_exact_mut(8).zip(chunk) {
                    raw.copy_from_slice(&w.to_le_bytes());
                }
                bytes
            })
        })
        .collect()
}

/// A bitmap table naming `offsets` (0: an all-zero cluster), as the
/// image holds it.
pub(crate) fn encode_table(offsets: &[u64]) -> Vec<u8> {
    offsets.iter().flat_map(|o| o.to_be_bytes()).collect()
}

/// Clusters of data a bitmap of `bits` bits takes (whole 64-bit words, as
/// QEMU's hbitmap serializes them).
pub(crate) fn data_clusters(bits: u64, cluster: u64) -> u64 {
    (bits.div_ceil(64) * 8).div_ceil(cluster)
}

/// The guest ranges that the set bits of `words` cover, merged, within a
/// disk of `size` bytes.
pub(crate) fn dirty_ranges(words: &[u64], granularity: u64, size: u64) -> Vec<Range<u64>> {
    let mut ranges = Ranges::new(granularity, size);
    for (i, &w) in words.iter().enumerate() {
        let mut rest = w;
        while rest != 0 {
            let from = u64::from(rest.trailing_zeros());
            let run = u64::from((rest >> from).trailing_ones());
            let base = i as u64 * 64;
            ranges.mark(base + from, base + from + run);
            rest = if from + run >= 64 {
                0
            } else {
                rest & !(((1u64 << run) - 1) << from)
            };
        }
    }
    ranges.out
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
