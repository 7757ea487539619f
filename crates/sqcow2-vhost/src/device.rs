//! The block device a chain becomes: what every queue worker shares.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use sqcow2_format::Chain;

use crate::handle::ChainHandle;

use crate::config::{DeviceConfig, CONFIG_SPACE_SIZE, SECTOR_SIZE};
use crate::fence::ReadFence;
use crate::request::{RequestLimits, ID_SIZE};

/// A chain exported as a virtio-blk device.
#[derive(Debug)]
pub struct BlkDevice {
    chain: Arc<ChainHandle>,
    config: DeviceConfig,
    fence: ReadFence,
    writeback: AtomicBool,
    id: [u8; ID_SIZE],
    panics: AtomicU64,
}

impl BlkDevice {
    /// Exports the chain of `handle` with `num_queues` queues of at most
    /// `queue_size` entries; read-only if the chain was opened read-only.
    pub fn new(handle: Arc<ChainHandle>, num_queues: u16, queue_size: u16) -> Self {
        let chain = handle.get();
        let cluster_size = chain
            .top()
            .header()
            .map(|h| h.geometry.cluster_size())
            .unwrap_or(65536);
        let config = DeviceConfig {
            capacity_sectors: chain.virtual_size() / SECTOR_SIZE,
            num_queues,
            queue_size,
            read_only: !chain.is_writable(),
            cluster_size,
        };
        let id = device_id(chain.top().path());
        BlkDevice {
            chain: handle,
            config,
            fence: ReadFence::default(),
            writeback: AtomicBool::new(true),
            id,
            panics: AtomicU64::new(0),
        }
    }

    /// The chain behind the device now.
    pub fn chain(&self) -> Arc<Chain> {
        self.chain.get()
    }

    /// The replaceable chain.
    pub fn handle(&self) -> &Arc<ChainHandle> {
        &self.chain
    }

    /// The device's shape.
    pub fn config(&self) -> &DeviceConfig {
        &self.config
    }

    /// Limits every request is checked against.
    pub fn limits(&self) -> RequestLimits {
        RequestLimits {
            capacity: self.config.capacity_sectors * SECTOR_SIZE,
            read_only: self.config.read_only,
        }
    }

    /// Reads in flight against flushes.
    pub fn fence(&self) -> &ReadFence {
        &self.fence
    }

    /// Whether the driver asked for a write-back cache (else every write
    /// is flushed before it completes).
    pub fn writeback(&self) -> bool {
        self.writeback.load(Ordering::Relaxed)
    }

    /// Sets the cache mode (the config space's `writeback` byte).
    pub fn set_writeback(&self, on: bool) {
        self.writeback.store(on, Ordering::Relaxed);
    }

    /// The configuration space as the driver sees it now.
    pub fn config_space(&self) -> [u8; CONFIG_SPACE_SIZE] {
        self.config.space(self.writeback())
    }

    /// Records a caught worker panic (a bug).
    pub fn count_panic(&self) {
        self.panics.fetch_add(1, Ordering::Relaxed);
    }

    /// Worker panics caught since start.
    pub fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    /// The GET_ID answer.
    pub fn id(&self) -> &[u8; ID_SIZE] {
        &self.id
    }
}

/// The device id: the top image's file name, cut to 20 bytes.
fn device_id(path: &Path) -> [u8; ID_SIZE] {
    let mut id = [0u8; ID_SIZE];
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let bytes = name.as_bytes();
    let n = bytes.len().min(ID_SIZE);
    id[..n].copy_from_slice(&bytes[..n]);
    id
}
