//! The internal snapshot table: where each snapshot's L1 table is.

use crate::bytes::{be_u32, be_u64};
use crate::error::{ErrorKind, Table};
use crate::header::Header;
use crate::storage::Storage;

/// One internal snapshot's L1 table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotL1 {
    /// Offset of its L1 table.
    pub l1_table_offset: u64,
    /// Entries in it.
    pub l1_size: u32,
}

/// The snapshot table: its byte length and every snapshot's L1 table.
#[derive(Debug, Clone, Default)]
pub struct SnapshotTable {
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
    let mut offset = header.snapshots_offset;
    for _ in 0..header.nb_snapshots {
        let mut fixed = [0u8; 40];
        storage.read_at(&mut fixed, offset)?;
        let id_len = u64::from(u16::from_be_bytes([fixed[12], fixed[13]]));
        let name_len = u64::from(u16::from_be_bytes([fixed[14], fixed[15]]));
        let extra_len = u64::from(be_u32(&fixed, 36));
        let entry_len = 40 + extra_len + id_len + name_len;
        if offset + entry_len > file_size {
            return Err(ErrorKind::TableBeyondEof {
                table: Table::Snapshots,
                offset: header.snapshots_offset,
                len: offset + entry_len - header.snapshots_offset,
                file_size,
            });
        }
        // Extra data (QEMU's: a 64-bit VM state size, the disk size, the
        // instruction count), then the id, then the name.
        let mut rest = vec![0u8; (extra_len + id_len + name_len) as usize];
        storage.read_at(&mut rest, offset + 40)?;
        let (extra, strings) = rest.split_at(extra_len as usize);
        let (id, name) = strings.split_at(id_len as usize);
        let vm_clock = be_u64(&fixed, 24);
        out.push(SnapshotInfo {
            id: String::from_utf8_lossy(id).into_owned(),
            name: String::from_utf8_lossy(name).into_owned(),
            vm_state_size: if extra.len() >= 8 {
                be_u64(extra, 0)
            } else {
                u64::from(be_u32(&fixed, 32))
            },
            date_sec: u64::from(be_u32(&fixed, 16)),
            date_nsec: u64::from(be_u32(&fixed, 20)),
            vm_clock_sec: vm_clock / 1_000_000_000,
            vm_clock_nsec: vm_clock % 1_000_000_000,
            icount: (extra.len() >= 24)
                .then(|| be_u64(extra, 16))
                .filter(|&n| n != u64::MAX),
        });
        offset += entry_len.div_ceil(8) * 8;
    }
    Ok(out)
}

/// Reads the snapshot table of an image (bounded by QEMU's limits, which
/// the header validation enforced for the count).
pub fn read_snapshot_table(
    header: &Header,
    storage: &dyn Storage,
) -> Result<SnapshotTable, ErrorKind> {
    let mut table = SnapshotTable::default();
    let file_size = storage.len()?;
    let mut offset = header.snapshots_offset;
    for _ in 0..header.nb_snapshots {
        let mut fixed = [0u8; 40];
        if offset + 40 > file_size {
            return Err(ErrorKind::TableBeyondEof {
                table: Table::Snapshots,
                offset: header.snapshots_offset,
                len: offset + 40 - header.snapshots_offset,
                file_size,
            });
        }
        storage.read_at(&mut fixed, offset)?;
        let id_len = u64::from(u16::from_be_bytes([fixed[12], fixed[13]]));
        let name_len = u64::from(u16::from_be_bytes([fixed[14], fixed[15]]));
        let extra_len = u64::from(be_u32(&fixed, 36));
        table.snapshots.push(SnapshotL1 {
            l1_table_offset: be_u64(&fixed, 0),
            l1_size: be_u32(&fixed, 8),
        });
        offset += (40 + extra_len + id_len + name_len).div_ceil(8) * 8;
    }
    table.len = offset - header.snapshots_offset;
    Ok(table)
}
