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
