//! The clusters the top's own metadata lives in (header, L1 table,
//! refcount table and blocks, active L2 tables, snapshot table and
//! snapshot L1 tables), so that a hostile image cannot make the engine
//! write guest data over them, release them or hand them out again: an L2
//! entry that points there is corruption, as QEMU's metadata overlap
//! checks treat it.

use std::collections::HashSet;

use crate::entry::OFFSET_MASK;
use crate::error::ErrorKind;
use crate::header::Header;
use crate::snapshot::read_snapshot_table;
use crate::storage::Storage;

/// Cluster numbers holding the top's metadata.
#[derive(Debug, Default)]
pub(crate) struct MetadataClusters {
    clusters: HashSet<u64>,
}

/// What a cluster was found to hold twice.
fn overlap(what: &str, cluster: u64, bits: u32) -> ErrorKind {
    ErrorKind::InvalidHeader {
        field: "metadata",
        reason: format!("{what} at {:#x} overlaps other metadata", cluster << bits),
    }
}

impl MetadataClusters {
    /// The metadata clusters of an image with `header`, its active `l1`
    /// and refcount table `reftable`; refuses an image where two of them
    /// share a cluster.
    pub(crate) fn build(
        header: &Header,
        l1: &[u64],
        reftable: &[u64],
        storage: &dyn Storage,
    ) -> Result<Self, ErrorKind> {
        let bits = header.geometry.cluster_bits;
        let file_size = storage.len()?;
        let mut m = MetadataClusters::default();
        let add_range = |m: &mut Self, what: &str, offset: u64, len: u64| {
            // Only what lies in the file can be overwritten (and a hostile
            // length cannot make this loop long).
            let len = len.min(file_size.saturating_sub(offset));
            if len == 0 {
                return Ok(());
            }
            let first = offset >> bits;
            let last = (offset + len - 1) >> bits;
            for c in first..=last {
                if !m.clusters.insert(c) {
                    return Err(overlap(what, c, bits));
                }
            }
            Ok(())
        };
        add_range(&mut m, "header", 0, 1)?;
        add_range(
            &mut m,
            "L1 table",
            header.l1_table_offset,
            u64::from(header.l1_size) * 8,
        )?;
        add_range(
            &mut m,
            "refcount table",
            header.refcount_table_offset,
            u64::from(header.refcount_table_clusters) << bits,
        )?;
        let snapshots = read_snapshot_table(header, storage)?;
        add_range(
            &mut m,
            "snapshot table",
            header.snapshots_offset,
            snapshots.len,
        )?;
        for s in &snapshots.snapshots {
            add_range(
                &mut m,
                "snapshot L1 table",
                s.l1_table_offset,
                u64::from(s.l1_size) * 8,
            )?;
        }
        for &e in reftable {
            let block = e & crate::entry::REFT_OFFSET_MASK;
            if block != 0 {
                add_range(&mut m, "refcount block", block, 1)?;
            }
        }
        // Two L1 entries may share a table (QEMU writes none like that, but
        // reading one is harmless); a table on other metadata is not.
        let tables: HashSet<u64> = l1
            .iter()
            .map(|e| (e & OFFSET_MASK) >> bits)
            .filter(|&c| c != 0)
            .collect();
        for c in tables {
            if !m.clusters.insert(c) {
                return Err(overlap("L2 table", c, bits));
            }
        }
        Ok(m)
    }

    /// Whether cluster `cluster` holds metadata.
    pub(crate) fn contains(&self, cluster: u64) -> bool {
        self.clusters.contains(&cluster)
    }

    /// Records that `cluster` now holds metadata (a new table or block).
    pub(crate) fn insert(&mut self, cluster: u64) {
        self.clusters.insert(cluster);
    }

    /// Records that `cluster` no longer holds metadata (it was freed).
    pub(crate) fn remove(&mut self, cluster: u64) {
        self.clusters.remove(&cluster);
    }
}
