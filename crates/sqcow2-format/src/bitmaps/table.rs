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
pub(crate) const ENTRY_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;
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
    read_dirty_ranges_in(header, storage, name, 0..header.size)
}

/// [`read_dirty_ranges`] within the guest range `window` only: the
/// dirty ranges clipped to it, only the data clusters covering it read.
pub fn read_dirty_ranges_in(
    header: &Header,
    storage: &dyn Storage,
    name: &str,
    window: Range<u64>,
) -> Result<BitmapRead, ErrorKind> {
    let entry = read_directory(header, storage)?
        .into_iter()
        .find(|e| e.name == name)
        .ok_or_else(|| ErrorKind::InvalidArgument(format!("Dirty bitmap '{name}' not found")))?;
    let g = entry.granularity();
    let dirty = if entry.in_use {
        None
    } else {
        let words = word_window(g, header.size, &window);
        let first = words.start;
        let words = read_words_in(header, storage, &entry, words)?;
        Some(ranges_in_window(&words, first, g, header.size, &window))
    };
    Ok(BitmapRead {
        granularity: g,
        enabled: entry.auto,
        dirty,
    })
}

/// The words (64 bits each) of a bitmap of granularity `g` over a disk
/// of `size` bytes that cover the guest range `window`.
pub(crate) fn word_window(g: u64, size: u64, window: &Range<u64>) -> Range<usize> {
    let end = window.end.min(size);
    if window.start >= end {
        return 0..0;
    }
    let first = window.start / g / 64;
    let last = (end - 1) / g / 64;
    usize::try_from(first).unwrap_or(usize::MAX)..usize::try_from(last + 1).unwrap_or(usize::MAX)
}

/// The dirty ranges within `window` of `words`, the bitmap's words from
/// word `first` on (granularity `g`, a disk of `size` bytes).
pub(crate) fn ranges_in_window(
    words: &[u64],
    first: usize,
    g: u64,
    size: u64,
    window: &Range<u64>,
) -> Vec<Range<u64>> {
    let base = first as u64 * 64 * g;
    let end = window.end.min(size);
    dirty_ranges(words, g, size.saturating_sub(base))
        .into_iter()
        .map(|r| (r.start + base).max(window.start)..(r.end + base).min(end))
        .filter(|r| r.start < r.end)
        .collect()
}

/// The entries of bitmap `entry`'s table, checked as QEMU's
/// `bitmap_table_load` and `load_bitmap_data` check them.
pub(crate) fn read_entries(
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
    read_words_in(header, storage, entry, 0..usize::MAX)
}

/// The words `window` (clipped to the bitmap's) of a consistent bitmap
/// `entry`: only the data clusters holding them read.
fn read_words_in(
    header: &Header,
    storage: &dyn Storage,
    entry: &BitmapEntry,
    window: Range<usize>,
) -> Result<Vec<u64>, ErrorKind> {
    let table = read_entries(header, storage, entry)?;
    let cluster = header.geometry.cluster_size();
    let bits = header.size.div_ceil(entry.granularity());
    let cluster_bytes = usize::try_from(cluster).map_err(|_| invalid(entry, "cluster".into()))?;
    let per = cluster_bytes / 8;
    let n_words = usize::try_from(bits.div_ceil(64)).map_err(|_| invalid(entry, "size".into()))?;
    let (from, to) = (window.start.min(n_words), window.end.min(n_words));
    let mut words = vec![0u64; to - from];
    let mut data = vec![0u8; cluster_bytes];
    for k in from / per..to.div_ceil(per) {
        let Some(&e) = table.get(k) else { break };
        // This cluster's words that the window takes.
        let (a, b) = ((k * per).max(from), ((k + 1) * per).min(to));
        let these = &mut words[a - from..b - from];
        let offset = e & ENTRY_OFFSET;
        if offset == 0 {
            if e & ENTRY_ALL_ONES != 0 {
                these.fill(u64::MAX);
            }
            continue;
        }
        storage.read_at(&mut data, offset)?;
        let raw = data.chunks_exact(8).skip(a - k * per);
        for (w, raw) in these.iter_mut().zip(raw) {
            *w = u64::from_le_bytes(raw.try_into().unwrap_or_default());
        }
    }
    // Bits past the disk's end are not bits of the bitmap.
    if to == n_words && bits % 64 != 0 {
        if let Some(last) = words.last_mut() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{Chain, ChainOptions};
    use crate::create::{create, CreateOptions};
    use crate::lock::Locking;

    /// A stored bitmap read within windows (across its data clusters:
    /// 512 B granules over 4 KiB clusters, 16 MiB of guest per cluster)
    /// reads as the whole bitmap's ranges clipped to each window.
    #[test]
    fn a_window_reads_the_whole_bitmaps_ranges_clipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.qcow2");
        let size = 64u64 << 20;
        create(
            &path,
            &CreateOptions {
                size,
                cluster_size: 4096,
                ..CreateOptions::default()
            },
        )
        .unwrap();
        let options = ChainOptions {
            writable: true,
            locking: Locking::Off,
            ..ChainOptions::default()
        };
        let chain = Chain::open(&path, &options).unwrap();
        chain.bitmaps().add("b", Some(512), true).unwrap();
        for (at, len) in [
            (0u64, 512u64),
            ((16 << 20) - 1024, 4096),
            (20 << 20, 1 << 20),
            ((48 << 20) + 7, 100),
            (size - 512, 512),
        ] {
            chain.write_at(&vec![1u8; len as usize], at).unwrap();
        }
        chain.close().unwrap();
        let chain = Chain::open(
            &path,
            &ChainOptions {
                writable: false,
                ..options
            },
        )
        .unwrap();
        let top = chain.top();
        let (header, storage) = (top.header().unwrap(), &**top.storage());
        let whole = read_dirty_ranges(header, storage, "b")
            .unwrap()
            .dirty
            .unwrap();
        assert_eq!(whole.len(), 5, "{whole:?}");
        for (start, end) in [
            (0, size),
            (1, (16 << 20) - 512),
            ((16 << 20) - 600, (16 << 20) + 600),
            (17 << 20, 47 << 20),
            ((48 << 20) + 100, size + 4096),
            (size, size + 1),
        ] {
            let want: Vec<_> = whole
                .iter()
                .map(|r| r.start.max(start)..r.end.min(end))
                .filter(|r| r.start < r.end)
                .collect();
            let got = read_dirty_ranges_in(header, storage, "b", start..end)
                .unwrap()
                .dirty
                .unwrap();
            assert_eq!(got, want, "{start}..{end}");
        }
    }
}
