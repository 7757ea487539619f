//! The virtio-blk device: feature bits and the configuration space.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// Bytes per virtio-blk sector.
pub(crate) const SECTOR_SIZE: u64 = 512;
/// Size of the configuration space we expose (`struct virtio_blk_config`
/// up to and including the write-zeroes fields).
pub(crate) const CONFIG_SPACE_SIZE: usize = 60;
/// Offset of the `writeback` (cache mode) byte in the configuration space.
pub(crate) const CONFIG_WRITEBACK_OFFSET: u32 = 32;
/// Largest single segment the driver may send (`size_max`).
pub(crate) const SIZE_MAX: u32 = 1 << 20;
/// Largest discard or write-zeroes range, in sectors (32 MiB).
pub(crate) const MAX_ZERO_SECTORS: u32 = 65536;
/// Most ranges in one discard or write-zeroes request.
pub(crate) const MAX_ZERO_SEGMENTS: u32 = 16;

/// What the device looks like to the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Number of request queues.
    pub num_queues: u16,
    /// Largest queue the driver may set up.
    pub queue_size: u16,
    /// The export refuses writes.
    pub read_only: bool,
    /// Cluster size of the top image (optimal I/O size, discard alignment).
    pub cluster_size: u64,
}

impl DeviceConfig {
    /// The virtio feature bits offered to the driver.
    pub fn features(&self) -> u64 {
        let mut bits = [
            VIRTIO_F_VERSION_1,
            VIRTIO_BLK_F_SEG_MAX,
            VIRTIO_BLK_F_SIZE_MAX,
            VIRTIO_BLK_F_BLK_SIZE,
            VIRTIO_BLK_F_TOPOLOGY,
            VIRTIO_BLK_F_FLUSH,
            VIRTIO_BLK_F_CONFIG_WCE,
            VIRTIO_BLK_F_MQ,
            VIRTIO_RING_F_EVENT_IDX,
            VIRTIO_RING_F_INDIRECT_DESC,
        ]
        .iter()
        .fold(0u64, |acc, bit| acc | 1 << bit);
        if self.read_only {
            bits |= 1 << VIRTIO_BLK_F_RO;
        } else {
            bits |= 1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        bits
    }

    /// Most data segments in one request (`seg_max`).
    pub fn seg_max(&self) -> u32 {
        u32::from(self.queue_size).saturating_sub(2).max(1)
    }

    /// The configuration space, `writeback` as given.
    pub fn space(&self, capacity_sectors: u64, writeback: bool) -> [u8; CONFIG_SPACE_SIZE] {
        let mut c = [0u8; CONFIG_SPACE_SIZE];
        let cluster_sectors =
            (self.cluster_size / SECTOR_SIZE).clamp(1, u64::from(u32::MAX)) as u32;
        c[0..8].copy_from_slice(&capacity_sectors.to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&self.seg_max().to_le_bytes());
        // geometry (16..20) left zero: no legacy CHS.
        c[20..24].copy_from_slice(&(SECTOR_SIZE as u32).to_le_bytes());
        // physical_block_exp 0, alignment_offset 0, min_io_size 1 sector.
        c[26..28].copy_from_slice(&1u16.to_le_bytes());
        c[28..32].copy_from_slice(&cluster_sectors.to_le_bytes());
        c[32] = u8::from(writeback);
        c[34..36].copy_from_slice(&self.num_queues.to_le_bytes());
        c[36..40].copy_from_slice(&MAX_ZERO_SECTORS.to_le_bytes());
        c[40..44].copy_from_slice(&MAX_ZERO_SEGMENTS.to_le_bytes());
        c[44..48].copy_from_slice(&cluster_sectors.to_le_bytes());
        c[48..52].copy_from_slice(&MAX_ZERO_SECTORS.to_le_bytes());
        c[52..56].copy_from_slice(&MAX_ZERO_SEGMENTS.to_le_bytes());
        c[56] = 1; // write_zeroes_may_unmap
        c
    }
}

/// `size` bytes of `space` from `offset`, zero-padded past its end (a
/// driver newer than this device may ask for more fields).
pub(crate) fn read_config(space: &[u8], offset: u32, size: u32) -> Vec<u8> {
    let mut out = vec![0u8; size as usize];
    let start = (offset as usize).min(space.len());
    let end = (offset as usize)
        .saturating_add(size as usize)
        .min(space.len());
    out[..end - start].copy_from_slice(&space[start..end]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> DeviceConfig {
        DeviceConfig {
            num_queues: 4,
            queue_size: 256,
            read_only: false,
            cluster_size: 65536,
        }
    }

    #[test]
    fn space_layout_matches_virtio_blk_config() {
        let c = config().space(2048, true);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 254);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512);
        assert_eq!(u32::from_le_bytes(c[28..32].try_into().unwrap()), 128);
        assert_eq!(c[32], 1);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 4);
        assert_eq!(c[56], 1);
    }

    #[test]
    fn read_config_pads_and_clips() {
        let c = config().space(2048, false);
        assert_eq!(read_config(&c, 0, 60), c.to_vec());
        assert_eq!(read_config(&c, 56, 8), vec![1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(read_config(&c, 100, 4), vec![0; 4]);
        assert_eq!(read_config(&c, u32::MAX, 2), vec![0; 2]);
    }

    #[test]
    fn read_only_drops_discard_and_write_zeroes() {
        let mut c = config();
        let rw = c.features();
        c.read_only = true;
        let ro = c.features();
        assert_ne!(rw & 1 << VIRTIO_BLK_F_DISCARD, 0);
        assert_eq!(ro & 1 << VIRTIO_BLK_F_DISCARD, 0);
        assert_ne!(ro & 1 << VIRTIO_BLK_F_RO, 0);
    }
}
