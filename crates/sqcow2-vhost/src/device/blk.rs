//! The block device a chain becomes: what every queue worker shares.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use sqcow2_format::Chain;

use crate::device::config::{DeviceConfig, CONFIG_SPACE_SIZE, SECTOR_SIZE};
use crate::device::gate::RequestGate;
use crate::device::handle::ChainHandle;
use crate::device::offload::{EnginePool, Offload};
use crate::device::request::{RequestLimits, ID_SIZE};
use crate::device::throttle::ExportThrottle;

/// Default number of engine threads (allocating writes, discards,
/// write-zeroes run there, off the queue workers).
pub const DEFAULT_ENGINE_THREADS: usize = 4;
/// Engine threads by default with `--cache none`: each waits for the
/// device on every transfer it makes (no page cache to complete it), so
/// more of them keep allocating writes in flight (measured at depth 32,
/// 4 KiB allocating writes into a fresh top: 23k IOPS with 4, 33k with
/// 8, 41k with 16, against qemu-storage-daemon's 24k).
pub const DEFAULT_DIRECT_ENGINE_THREADS: usize = 16;

/// The shape of an exported device.
#[derive(Debug, Clone)]
pub struct DeviceOptions {
    /// Request queues offered.
    pub num_queues: u16,
    /// Largest queue the frontend may set up.
    pub queue_size: u16,
    /// Export read-only; `None`: as the chain is opened (an inactive chain
    /// is opened read-only, yet its export takes writes once active).
    pub read_only: Option<bool>,
    /// The export's I/O limits (kept across sessions, changed live).
    pub(crate) throttle: Arc<ExportThrottle>,
}

impl DeviceOptions {
    #[cfg(any(test, feature = "internals"))]
    /// `num_queues` queues of at most `queue_size` entries.
    pub fn new(num_queues: u16, queue_size: u16) -> Self {
        DeviceOptions {
            num_queues,
            queue_size,
            read_only: None,
            throttle: Arc::default(),
        }
    }
}

/// A chain exported as a virtio-blk device.
#[derive(Debug)]
pub struct BlkDevice {
    /// The disk's size in sectors ([`BlkDevice::capacity`]).
    capacity_sectors: AtomicU64,
    chain: Arc<ChainHandle>,
    config: DeviceConfig,
    offload: Offload,
    writeback: AtomicBool,
    id: [u8; ID_SIZE],
    panics: Arc<AtomicU64>,
    throttle: Arc<ExportThrottle>,
}

impl BlkDevice {
    /// Exports the chain of `handle`; read-only if the chain was opened
    /// read-only. Starts [`DEFAULT_ENGINE_THREADS`] engine threads of its
    /// own.
    #[cfg(any(test, feature = "internals"))]
    pub fn new(handle: Arc<ChainHandle>, options: DeviceOptions) -> io::Result<Self> {
        let pool = EnginePool::start(DEFAULT_ENGINE_THREADS)?;
        BlkDevice::new_on(handle, options, pool)
    }

    /// Exports the chain of `handle`, its engine jobs run by `pool`
    /// (shared with the daemon's other devices).
    pub(crate) fn new_on(
        handle: Arc<ChainHandle>,
        options: DeviceOptions,
        pool: Arc<EnginePool>,
    ) -> io::Result<Self> {
        let chain = handle.get();
        let config = DeviceConfig {
            num_queues: options.num_queues,
            queue_size: options.queue_size,
            read_only: options.read_only.unwrap_or(!chain.is_writable()),
            cluster_size: chain.cluster_size(),
        };
        let id = device_id(chain.top().path());
        let panics = Arc::new(AtomicU64::new(0));
        let offload = Offload::start_on(pool, handle.clone(), panics.clone())?;
        Ok(BlkDevice {
            capacity_sectors: AtomicU64::new(chain.virtual_size() / SECTOR_SIZE),
            chain: handle,
            config,
            offload,
            writeback: AtomicBool::new(true),
            id,
            panics,
            throttle: options.throttle,
        })
    }

    /// The chain behind the device now.
    pub fn chain(&self) -> Arc<Chain> {
        self.chain.get()
    }

    /// The disk's size in bytes, as requests are checked against it and
    /// the config space says (changed by a live resize).
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity_sectors.load(Ordering::Acquire) * SECTOR_SIZE
    }

    /// Sets the disk's size: requests are checked against it from now
    /// on, and the config space says it (the frontend is told apart).
    pub(crate) fn set_capacity(&self, bytes: u64) {
        self.capacity_sectors
            .store(bytes / SECTOR_SIZE, Ordering::Release);
    }

    /// The device's shape.
    pub fn config(&self) -> &DeviceConfig {
        &self.config
    }

    /// Limits every request is checked against.
    pub fn limits(&self) -> RequestLimits {
        RequestLimits {
            capacity: self.capacity(),
            read_only: self.config.read_only,
        }
    }

    /// Which requests may start (pauses for live snapshots and stops).
    pub fn gate(&self) -> &Arc<RequestGate> {
        self.chain.gate()
    }

    /// The engine threads and the flusher.
    pub(crate) fn offload(&self) -> &Offload {
        &self.offload
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
        self.config.space(
            self.capacity_sectors.load(Ordering::Acquire),
            self.writeback(),
        )
    }

    /// Records a caught panic (a bug); the chain refuses writes from now
    /// on.
    pub fn record_panic(&self, what: &str) {
        self.panics.fetch_add(1, Ordering::Relaxed);
        self.chain.get().fail(what);
    }

    /// Panics caught since start (queue workers and engine threads).
    pub fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    /// The export's I/O limits.
    pub(crate) fn throttle(&self) -> &ExportThrottle {
        &self.throttle
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
