//! The internal snapshot table: where each snapshot's L1 table is.

use crate::bytes::{be_u32, be_u64};
use crate::error::{ErrorKind, Table};
use crate::header::Header;
use crate::storage::Storage;

/// One internal snapshot's L1 table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SnapshotL1 {
    /// Offset of its L1 table.
    pub l1_table_offset: u64,
    /// Entries in it.
    pub l1_size: u32,
}

/// The snapshot table: its byte length and every snapshot's L1 table.
#[derive(Debug, Clone, Default)]
pub(crate) struct SnapshotTable {
    /// Bytes the table occupies from `snapshots_offset`.
    pub len: u64,
    /// The snapshots, in table order.
    pub snapshots: Vec<SnapshotL1>,
}

/// What `qemu-img info` shows of an internal snapshot (its field names).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct SnapshotInfo {
    /// Its unique id.
    pub id: String,
    /// Its name (tag).
    pub name: String,
    /// Bytes of VM state saved with it.
    pub vm_state_size: u64,
    /// When it was taken: seconds since the epoch.
    pub date_sec: u64,
    /// And nanoseconds.
    pub date_nsec: u64,
    /// The guest's clock then: seconds.
    pub vm_clock_sec: u64,
    /// And nanoseconds.
    pub vm_clock_nsec: u64,
    /// The guest's instruction count then, if recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icount: Option<u64>,
}

/// Every internal snapshot's [`SnapshotInfo`], in table order.
pub fn describe_snapshots(
    header: &Header,
    storage: &dyn Storage,
) -> Result<Vec<SnapshotInfo>, ErrorKind> {
    let mut out = Vec::new();
    let file_size = storage.len()?;
    walk_entries(header, storage, |offset, fixed, lens| {
        if offset + lens.entry() > file_size {
            return Err(beyond_eof(header, offset + lens.entry(), file_size));
        }
        // Extra data (QEMU's: a 64-bit VM state size, the disk size, the
        // instruction count), then the id, then the name.
        let mut rest = vec![0u8; (lens.extra + lens.id + lens.name) as usize];
        storage.read_at(&mut rest, offset + 40)?;
        let (extra, strings) = rest.split_at(lens.extra as usize);
        let (id, name) = strings.split_at(lens.id as usize);
        let vm_clock = be_u64(fixed, 24);
        out.push(SnapshotInfo {
            id: String::from_utf8_lossy(id).into_owned(),
            name: String::from_utf8_lossy(name).into_owned(),
            vm_state_size: if extra.len() >= 8 {
                be_u64(extra, 0)
            } else {
                u64::from(be_u32(fixed, 32))
            },
            date_sec: u64::from(be_u32(fixed, 16)),
            date_nsec: u64::from(be_u32(fixed, 20)),
            vm_clock_sec: vm_clock / 1_000_000_000,
            vm_clock_nsec: vm_clock % 1_000_000_000,
            icount: (extra.len() >= 24)
                .then(|| be_u64(extra, 16))
                .filter(|&n| n != u64::MAX),
        });
        Ok(())
    })?;
    Ok(out)
}

/// The variable parts of a snapshot table entry: bytes of extra data, of
/// the id, of the name.
struct EntryLens {
    extra: u64,
    id: u64,
    name: u64,
}

impl EntryLens {
    /// The entry's bytes, the 40 fixed ones included (before padding).
    fn entry(&self) -> u64 {
        40 + self.extra + self.id + self.name
    }
}

fn beyond_eof(header: &Header, end: u64, file_size: u64) -> ErrorKind {
    ErrorKind::TableBeyondEof {
        table: Table::Snapshots,
        offset: header.snapshots_offset,
        len: end - header.snapshots_offset,
        file_size,
    }
}

/// Calls `f` with each snapshot table entry's offset, fixed 40 bytes (in
/// the file: checked) and lengths; returns where the table ends.
fn walk_entries(
    header: &Header,
    storage: &dyn Storage,
    mut f: impl FnMut(u64, &[u8; 40], &EntryLens) -> Result<(), ErrorKind>,
) -> Result<u64, ErrorKind> {
    let file_size = storage.len()?;
    let mut offset = header.snapshots_offset;
    for _ in 0..header.nb_snapshots {
        if offset + 40 > file_size {
            return Err(beyond_eof(header, offset + 40, file_size));
        }
        let mut fixed = [0u8; 40];
        storage.read_at(&mut fixed, offset)?;
        let lens = EntryLens {
            extra: u64::from(be_u32(&fixed, 36)),
            id: u64::from(u16::from_be_bytes([fixed[12], fixed[13]])),
            name: u64::from(u16::from_be_bytes([fixed[14], fixed[15]])),
        };
        f(offset, &fixed, &lens)?;
        offset += lens.entry().div_ceil(8) * 8;
    }
    Ok(offset)
}

/// Reads the snapshot table of an image (bounded by QEMU's limits, which
/// the header validation enforced for the count).
pub(crate) fn read_snapshot_table(
    header: &Header,
    storage: &dyn Storage,
) -> Result<SnapshotTable, ErrorKind> {
    let mut table = SnapshotTable::default();
    let end = walk_entries(header, storage, |_, fixed, _| {
        table.snapshots.push(SnapshotL1 {
            l1_table_offset: be_u64(fixed, 0),
            l1_size: be_u32(fixed, 8),
        });
        Ok(())
    })?;
    table.len = end - header.snapshots_offset;
    Ok(table)
}
