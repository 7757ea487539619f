//! The file sizes `qemu-img measure` reports for a qcow2 image: what
//! holding every cluster of a disk takes (header, L1 and L2 tables,
//! refcount structures, data), what a copy of some data takes, and what
//! persistent bitmaps add. QEMU's own arithmetic (`qcow2_measure`), so
//! that the figures are the same.

use crate::bitmaps::BitmapInfo;

/// The layout of the qcow2 image measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Qcow2Layout {
    /// Bytes per cluster.
    pub cluster_size: u64,
    /// Bits per refcount (a power of two, 1 to 64).
    pub refcount_bits: u32,
    /// 128-bit L2 entries.
    pub extended_l2: bool,
}

impl Qcow2Layout {
    fn round_up(&self, n: u64) -> u64 {
        n.div_ceil(self.cluster_size) * self.cluster_size
    }

    /// Bytes of a qcow2 file of a `size`-byte disk with every cluster
    /// allocated (QEMU's `qcow2_calc_prealloc_size`).
    pub fn fully_allocated(&self, size: u64) -> u64 {
        let cs = self.cluster_size;
        let aligned = self.round_up(size);
        let l2e = if self.extended_l2 { 16 } else { 8 };
        let mut meta = cs; // the header
        let nl2e = (aligned / cs).div_ceil(cs / l2e) * (cs / l2e);
        meta += nl2e * l2e;
        let nl1e = (nl2e * l2e / cs).div_ceil(cs / 8) * (cs / 8);
        meta += nl1e * 8;
        meta += self.refcount_metadata((meta + aligned) / cs);
        meta + aligned
    }

    /// Bytes of the refcount table and blocks that count `clusters`
    /// clusters and themselves (`qcow2_refcount_metadata_size`).
    fn refcount_metadata(&self, clusters: u64) -> u64 {
        let cs = self.cluster_size;
        let per_table_cluster = cs / 8;
        let per_block = cs * 8 / u64::from(self.refcount_bits);
        let (mut table, mut blocks, mut n) = (0u64, 0u64, 0u64);
        loop {
            let last = n;
            blocks = (clusters + table + blocks).div_ceil(per_block);
            table = blocks.div_ceil(per_table_cluster);
            n = clusters + blocks + table;
            if n == last {
                break;
            }
        }
        (blocks + table) * cs
    }

    /// Bytes of a `size`-byte disk's image holding `data` bytes of
    /// clusters (whole clusters, the metadata of a full image: QEMU's
    /// overestimate).
    pub fn required(&self, size: u64, data: u64) -> u64 {
        self.fully_allocated(size) - self.round_up(size) + data
    }

    /// Bytes the persistent `bitmaps` of a `size`-byte disk take
    /// (`qcow2_measure_bitmaps`: every bitmap cluster allocated, its
    /// table, the directory).
    pub fn bitmaps(&self, size: u64, bitmaps: &[BitmapInfo]) -> u64 {
        let mut total = 0;
        let mut dir = 0;
        for b in bitmaps {
            let bits = size.div_ceil(b.granularity.max(1));
            let clusters = bits.div_ceil(8).div_ceil(self.cluster_size);
            total += clusters * self.cluster_size;
            total += self.round_up(clusters * 8);
            dir += (24 + b.name.len() as u64).div_ceil(8) * 8;
        }
        total + self.round_up(dir)
    }
}

/// Bytes of guest data to copy, counted as `qemu-img measure` counts
/// them: each run of data from `runs` (offset, length; in order, not
/// overlapping) extended to whole clusters of `cluster_size`.
pub fn data_clusters(runs: impl IntoIterator<Item = (u64, u64)>, cluster_size: u64) -> u64 {
    let mut counted_to = 0u64;
    let mut total = 0u64;
    for (offset, len) in runs {
        let start = (offset / cluster_size * cluster_size).max(counted_to);
        let end = (offset + len).div_ceil(cluster_size) * cluster_size;
        if end > start {
            total += end - start;
            counted_to = end;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULT: Qcow2Layout = Qcow2Layout {
        cluster_size: 65536,
        refcount_bits: 16,
        extended_l2: false,
    };

    /// Figures qemu-img 7.2 printed.
    #[test]
    fn qemu_img_measure_figures() {
        assert_eq!(DEFAULT.fully_allocated(64 << 20), 67_436_544);
        assert_eq!(DEFAULT.fully_allocated(1 << 30), 1_074_135_040);
        assert_eq!(DEFAULT.required(1 << 30, 0), 393_216);
        let small = Qcow2Layout {
            cluster_size: 4096,
            ..DEFAULT
        };
        assert_eq!(small.fully_allocated(64 << 20), 67_289_088);
        assert_eq!(small.required(64 << 20, 65536), 245_760);
    }

    #[test]
    fn data_runs_are_counted_in_whole_clusters_once() {
        let c = 65536;
        assert_eq!(data_clusters([(0, 4096)], c), c);
        assert_eq!(data_clusters([(0, 4096), (8192, 4096)], c), c);
        assert_eq!(data_clusters([(0, 4096), (70_000, 10)], c), 2 * c);
        assert_eq!(data_clusters([(c - 512, 1024)], c), 2 * c);
        assert_eq!(data_clusters([], c), 0);
    }

    #[test]
    fn bitmaps_count_clusters_tables_and_directory() {
        let b = BitmapInfo {
            flags: vec![],
            name: "b0".into(),
            granularity: 65536,
        };
        // 1 GiB at 64 KiB per bit: 2 KiB of bits, one cluster; its table
        // one cluster; the directory one.
        assert_eq!(DEFAULT.bitmaps(1 << 30, &[b]), 3 * 65536);
        assert_eq!(DEFAULT.bitmaps(1 << 30, &[]), 0);
    }
}
