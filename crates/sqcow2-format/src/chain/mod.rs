//! A backing chain: opened iteratively from the top ([`open`]), resolved
//! layer by layer or through the chain index ([`walk`], [`resolved`]), read
//! and written like QEMU reads and writes it ([`io`]).

pub(crate) mod bitmaps;
mod changed;
mod covering;
pub(crate) mod drain;
mod io;
pub(crate) mod mirror;
mod moved;
mod open;
mod range_holds;
mod readahead;
mod resolved;
mod successor;
mod walk;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::active::Active;
use crate::entry::CompressedDescriptor;
use crate::error::{Error, ErrorKind};
use crate::fence::TransferFence;
use crate::layer::Layer;
use crate::lock::{LockRequest, Locking};
use crate::storage::Storage;
use crate::summary::TopSummary;
use crate::types::{Geometry, HostOffset, LayerIndex};
use sqcow2_cache::{Policy, SliceCache, StatsSnapshot};

pub(crate) use covering::backing_name as backing_name_of;
pub use covering::Installed;
pub use drain::TransferHold;
pub use io::{InPlaceTarget, ReadExtent};
pub use moved::{AllocatingWrite, ClusterCopy, CopyRead, Linked, MovedClaim};
pub use successor::PreparedTop;
pub use walk::backing_path_of;

/// Default limit on the number of layers in a chain.
pub const DEFAULT_MAX_LAYERS: usize = 65535;
/// Default byte budget of the unified metadata cache (QEMU's default for
/// one layer; here for the whole chain).
pub(crate) const DEFAULT_CACHE_SIZE: u64 = sqcow2_cache::DEFAULT_BUDGET;
/// Default size of a cached metadata slice.
pub(crate) const DEFAULT_SLICE_SIZE: u64 = 4096;
/// Default of [`ChainOptions::max_l1_bytes_total`]: 512 MiB, e.g. 1000
/// layers of 32 TiB disks with 64 KiB clusters.
pub(crate) const DEFAULT_MAX_L1_BYTES_TOTAL: u64 = 512 << 20;

/// How to open a chain.
#[derive(Debug, Clone)]
pub struct ChainOptions {
    /// Most layers a chain may have, the top included.
    pub max_layers: usize,
    /// Byte budget of the unified metadata cache.
    pub cache_size: u64,
    /// Bytes per cached metadata slice (clamped to one cluster).
    pub slice_size: u64,
    /// Eviction policy of the cache.
    pub cache_policy: Policy,
    /// Use the chain index when the top names a valid one (otherwise walk
    /// the chain, as QEMU does).
    pub use_index: bool,
    /// Open the top image for writing.
    pub writable: bool,
    /// Storage to use for the top image instead of opening its path (tests
    /// inject faults this way); its path still anchors backing names.
    pub top_storage: Option<Arc<dyn Storage>>,
    /// Backing files must lie inside this directory (symlinks resolved,
    /// on the opened file itself); `None`: anywhere.
    pub backing_root: Option<PathBuf>,
    /// Most bytes the layers' L1 tables may take together (each is also
    /// bounded by itself, as in QEMU).
    pub max_l1_bytes_total: u64,
    /// Whether to take QEMU's image locks on the files opened.
    pub locking: Locking,
    /// Share every permission with other users (`qemu-img -U`): read
    /// while another process writes, at the risk of inconsistent data.
    /// Only for read-only opens.
    pub force_share: bool,
    /// Only headers are looked at (`info`): no permission is held on the
    /// data (QEMU's `qemu-img info`).
    pub inspect_only: bool,
    /// Inactive (handed over to another process, like QEMU's inactive
    /// nodes during migration): read-only, no image lock held at all.
    pub inactive: bool,
    /// Descriptors kept open for the layers below the top (closed least
    /// recently used first, reopened on demand: `files.rs`); `None`:
    /// half the process's soft limit of open files.
    pub max_open_files: Option<usize>,
    /// Early write-backs of the top's tables (when those under change
    /// outgrow their share of the cache) are left to the caller instead
    /// of run by the write that finds them due, so that no request waits
    /// for their syncs: [`crate::Durability::take_write_back_due`] says when, and
    /// [`crate::Durability::publish`] does it (a server's background thread). A write
    /// that finds them far over their share (4x) still writes them back
    /// itself, so memory stays bounded.
    pub background_write_back: bool,
    /// The caller builds the top's index right after this open (a merge,
    /// commit or rebase just changed the chain below it): an index found
    /// stale is logged at INFO, not as a warning for the operator.
    pub stale_index_expected: bool,
    /// Host page cache use of the image files (QEMU's `cache` option):
    /// [`crate::CacheMode::None`] opens each one `O_DIRECT` too.
    pub cache: crate::direct::CacheMode,
    /// Layer files below the top shared with the process's other chains
    /// that reach them (opened once, their tables cached once); `None`:
    /// this chain's own.
    pub shared_layers: Option<Arc<crate::SharedLayers>>,
    /// Opens the layers a backing name gives as an `http(s)://` URL
    /// (layers in an object store); `None`: such names are refused.
    /// Defaults to the process's ([`crate::set_process_remote_layers`]).
    pub remote_layers: Option<Arc<dyn crate::RemoteLayers>>,
}

impl Default for ChainOptions {
    fn default() -> Self {
        Self {
            max_layers: DEFAULT_MAX_LAYERS,
            cache_size: DEFAULT_CACHE_SIZE,
            slice_size: DEFAULT_SLICE_SIZE,
            cache_policy: Policy::S3Fifo,
            use_index: true,
            writable: false,
            top_storage: None,
            backing_root: None,
            max_l1_bytes_total: DEFAULT_MAX_L1_BYTES_TOTAL,
            locking: Locking::Auto,
            force_share: false,
            inspect_only: false,
            inactive: false,
            max_open_files: None,
            background_write_back: false,
            stale_index_expected: false,
            cache: crate::direct::CacheMode::WriteBack,
            shared_layers: None,
            remote_layers: crate::remote::process_remote_layers(),
        }
    }
}

/// What a run of guest bytes reads as, and which layer decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExtentKind {
    /// Data stored uncompressed at a host offset of the deciding layer.
    Data {
        /// Host offset of the first byte.
        host: HostOffset,
    },
    /// A compressed cluster of the deciding layer.
    Compressed(CompressedDescriptor),
    /// Zeros.
    Zero {
        /// Host offset, for preallocated zero clusters and raw holes.
        host: Option<HostOffset>,
        /// Whether a layer records the zeros (false: nothing is allocated,
        /// or the range lies beyond the end of a backing file).
        allocated: bool,
    },
}

/// A run of guest bytes with one mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// First guest byte.
    pub start: crate::types::GuestOffset,
    /// Length in bytes.
    pub len: u64,
    /// The layer that decided the mapping (the last one looked at).
    pub layer: LayerIndex,
    /// The mapping.
    pub kind: ExtentKind,
}

/// An opened chain; layer 0 is the base, the last layer the top.
///
/// Opened writable, the top takes writes; call [`Chain::close`] to flush
/// and leave the image clean (dropping does it too, logging any error).
#[derive(Debug)]
pub struct Chain {
    layers: Vec<Layer>,
    /// Each layer's storage, in a compact vector the read path looks up
    /// (a `Layer` is a few hundred bytes: with 10,000 layers, touching it
    /// per read was a cache miss per request).
    storages: Vec<Arc<dyn Storage>>,
    /// The descriptors of the layers below the top (the old tops of live
    /// snapshots join them).
    files: Arc<crate::files::FileCache>,
    cache: Arc<SliceCache>,
    slice_size: u64,
    /// The top's geometry (a raw-only chain has none; 64 KiB clusters are
    /// assumed for splitting writes, which it refuses anyway).
    top_geometry: Geometry,
    data_reads: Vec<AtomicU64>,
    /// For each layer below the top, the smallest virtual size from it up
    /// to the top (excluded): where a walk down for an unallocated offset
    /// ends, found by a binary search (`map`'s depths). Built when first
    /// needed.
    size_floors: std::sync::OnceLock<Vec<u64>>,
    active: Option<Arc<Active>>,
    /// Transfers in flight, which a flush waits for before it makes
    /// released clusters reusable.
    fence: Arc<TransferFence>,
    /// The index in use and the layers it covers (replaced while the chain
    /// serves when a newer one is installed).
    index: arc_swap::ArcSwap<covering::IndexInUse>,
    /// Resolved slices (indexed mode).
    resolved: resolved::ResolvedSlices,
    /// Regions of the top that hold nothing (indexed mode only).
    summary: Option<Arc<TopSummary>>,
    /// Layers below the top that were tops of the chains this one follows
    /// and whose writers have not closed them yet ([`crate::Handover::successor`];
    /// carried on from chain to chain): each flush writes their tables
    /// back and syncs them too, until [`crate::Handover::retire`] (or, after a
    /// failed one, [`crate::Handover::close_unclosed_below`]) has closed each.
    unclosed_below: std::sync::Mutex<Vec<UnclosedTop>>,
    /// Where the top is: its directory, opened once, in which its side
    /// files (journal, index) are made by name.
    top_place: Option<crate::sidefile::ImagePlace>,
    /// A live commit's mirror: guest changes copied into its base.
    mirror: arc_swap::ArcSwapOption<mirror::Mirror>,
    /// A live commit's drain: the top shrinking into the base below it.
    drain: arc_swap::ArcSwapOption<drain::Drain>,
    /// Why the chain must not be read any more (its view of the base of
    /// an abandoned drain is stale, and it could not be reopened).
    unreadable: std::sync::OnceLock<String>,
    /// Where some layer fetches from afar (an object store): reads start
    /// their fetches together and fetch ahead of readers in order.
    readahead: Option<Box<readahead::Readahead>>,
}

/// Guest I/O that the caller moves itself (io_uring straight between the
/// files and guest memory, [`Chain::transfers`]): mappings looked up under
/// a [`crate::TransferTicket`] that keeps the clusters they name from
/// being reused until the transfer ends.
#[derive(Debug, Clone, Copy)]
pub struct Transfers<'a> {
    chain: &'a Chain,
}

/// The chain index a chain uses ([`Chain::index`]): whether and how far
/// it serves lookups, its entries, and installing a newer one.
#[derive(Debug, Clone, Copy)]
pub struct IndexView<'a> {
    chain: &'a Chain,
}

/// How a writable chain's changes become durable ([`Chain::durability`]):
/// the mapping journal, publishing mappings in crash-safe order, and the
/// background write-back a server's flusher runs.
#[derive(Debug, Clone, Copy)]
pub struct Durability<'a> {
    chain: &'a Chain,
}

/// Handing a chain over to the next one (a live snapshot's successor, a
/// merge's reopened chain) and retiring it ([`Chain::handover`]).
#[derive(Debug, Clone, Copy)]
pub struct Handover<'a> {
    chain: &'a Chain,
}

/// What a chain costs and does, for stats and benchmarks
/// ([`Chain::diagnostics`]).
#[derive(Debug, Clone, Copy)]
pub struct Diagnostics<'a> {
    chain: &'a Chain,
}

/// A live snapshot's old top below a chain's top whose writer has not
/// closed it yet: its last tables may be neither in its file nor durable
/// (the chain reads them from the writer meanwhile).
#[derive(Debug, Clone)]
pub(crate) struct UnclosedTop {
    writer: Arc<Active>,
    /// The fence of the chain that wrote it.
    fence: Arc<TransferFence>,
    /// Its place in the chains that follow (layers below the top do not
    /// move while it is open: no merge starts then, and a merge's switch
    /// closes it first, in [`Chain::flush_clean`]).
    at: LayerIndex,
}

impl ChainOptions {
    /// How a layer below the top is opened: chains share a file only
    /// when they open it alike.
    pub(crate) fn shared_mode(&self) -> crate::shared_layers::OpenMode {
        crate::shared_layers::OpenMode {
            cache: self.cache,
            lock: self.lock_request(false),
            locking: self.locking,
        }
    }

    /// The image locks a layer takes: the top (`top`) written or read,
    /// backing layers read.
    pub(crate) fn lock_request(&self, top: bool) -> LockRequest {
        if self.inactive {
            return LockRequest::NONE;
        }
        let base = if top && self.writable {
            LockRequest::WRITER
        } else if self.inspect_only {
            LockRequest::INSPECTOR
        } else {
            LockRequest::READER
        };
        if self.force_share {
            base.sharing_all()
        } else {
            base
        }
    }
}

impl Chain {
    /// Removes, in the top's directory (the one opened with the chain:
    /// inside the backing root for a daemon), what killed operations
    /// left there (temporary files recognised by their headers, no longer
    /// made by anyone); never a file of this chain. The paths removed.
    pub fn remove_leftovers_beside_top(&self) -> Result<Vec<std::path::PathBuf>, Error> {
        let keep: Vec<_> = self
            .layers
            .iter()
            .filter_map(|l| l.storage().file_id())
            .collect();
        crate::sidefile::remove_leftovers(self.top_place()?.dir(), &keep)
    }

    /// Where the top is: its directory (opened once) and name (none for
    /// a top given as storage whose path names no directory).
    pub(crate) fn top_place(&self) -> Result<&crate::sidefile::ImagePlace, Error> {
        self.top_place.as_ref().ok_or_else(|| {
            Error::new(
                self.top().path(),
                ErrorKind::Io(std::io::Error::other("the top's directory is not open")),
            )
        })
    }

    /// Counts a data read from `layer` done by a caller that reads the
    /// host file itself (see [`crate::Diagnostics::data_reads_per_layer`]).
    /// The storage of layer `index`.
    pub(crate) fn storage_of(&self, index: LayerIndex) -> &Arc<dyn Storage> {
        &self.storages[index.0]
    }

    pub(crate) fn count_data_read(&self, layer: LayerIndex) {
        if let Some(counter) = self.data_reads.get(layer.0) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The layers, base first.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The top layer (the active volume).
    pub fn top(&self) -> &Layer {
        // A chain always has at least its top layer.
        &self.layers[self.layers.len() - 1]
    }

    /// Index of the top layer.
    pub fn top_index(&self) -> LayerIndex {
        LayerIndex(self.layers.len() - 1)
    }

    /// Cluster size of the top.
    pub fn cluster_size(&self) -> u64 {
        self.top_geometry.cluster_size()
    }

    /// Virtual size of the disk (the top's).
    pub fn virtual_size(&self) -> u64 {
        match &self.active {
            Some(a) => a.size(),
            None => self.top().virtual_size(),
        }
    }

    /// Whether the chain takes writes.
    pub fn is_writable(&self) -> bool {
        self.active.is_some()
    }

    /// Why the chain refuses writes although opened writable (a panic
    /// interrupted a metadata update, or [`Chain::fail`] was called); it
    /// must be reopened to take writes again.
    pub fn failure(&self) -> Option<&str> {
        self.active.as_deref().and_then(Active::failure)
    }

    /// Refuses reads and writes from now on: for a chain whose view of a
    /// layer is known to be stale and that could not be reopened.
    pub fn refuse_io(&self, reason: &str) {
        let _ = self.unreadable.set(reason.to_owned());
        self.fail(reason);
    }

    pub(crate) fn check_readable(&self) -> Result<(), Error> {
        match self.unreadable.get() {
            None => Ok(()),
            Some(why) => Err(Error::new(
                self.top().path(),
                ErrorKind::Io(std::io::Error::other(why.clone())),
            )),
        }
    }

    /// Refuses writes from now on, until the chain is reopened: for callers
    /// that caught a panic (a bug) while using the chain. Nothing more is
    /// written back; reads go on.
    pub fn fail(&self, reason: &str) {
        if let Some(a) = &self.active {
            a.fail(reason);
        }
    }

    /// Test hook: the writable engine panics at the `nth` next hit of
    /// `point` (cargo feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    pub fn arm_fault(&self, point: crate::fault::FaultPoint, nth: u32) {
        if let Some(a) = &self.active {
            a.faults().arm(point, nth);
        }
    }

    /// Test hook: the writable engine sleeps `ms` milliseconds at the next
    /// hit of `point` (cargo feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    pub fn stall_at(&self, point: crate::fault::FaultPoint, ms: u32) {
        if let Some(a) = &self.active {
            a.faults().stall(point, ms);
        }
    }

    /// Test hook: whether the writable engine is stalling at `point` now
    /// (cargo feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    pub fn stalling_at(&self, point: crate::fault::FaultPoint) -> bool {
        self.active
            .as_ref()
            .is_some_and(|a| a.faults().stalling(point))
    }

    /// Guest I/O the caller moves itself.
    pub fn transfers(&self) -> Transfers<'_> {
        Transfers { chain: self }
    }

    /// The chain index in use.
    pub fn index(&self) -> IndexView<'_> {
        IndexView { chain: self }
    }

    /// How changes become durable.
    pub fn durability(&self) -> Durability<'_> {
        Durability { chain: self }
    }

    /// Handing the chain over to the next one.
    pub fn handover(&self) -> Handover<'_> {
        Handover { chain: self }
    }

    /// The top's persistent dirty bitmaps (a writable chain's).
    pub fn bitmaps(&self) -> bitmaps::PersistentBitmaps<'_> {
        bitmaps::PersistentBitmaps { chain: self }
    }

    /// Cache and read statistics.
    pub fn diagnostics(&self) -> Diagnostics<'_> {
        Diagnostics { chain: self }
    }

    pub(crate) fn active(&self) -> Result<&Active, Error> {
        self.active
            .as_deref()
            .ok_or_else(|| Error::new(self.top().path(), ErrorKind::ReadOnly))
    }
}

impl Diagnostics<'_> {
    /// Statistics of the unified cache.
    pub fn cache(&self) -> StatsSnapshot {
        self.chain.cache.stats().snapshot()
    }

    /// Bytes held by per-layer structures and the index's tables, outside
    /// the cache (whose bytes [`crate::Diagnostics::cache`] reports).
    pub fn metadata_structure_bytes(&self) -> u64 {
        let layers: u64 = self.chain.layers.iter().map(Layer::heap_bytes).sum();
        let counters = self.chain.data_reads.len() as u64 * 8;
        let index = self
            .chain
            .index
            .load()
            .covering
            .as_ref()
            .map_or(0, |(i, _)| i.heap_bytes());
        layers + counters + index
    }

    /// Empties the metadata cache (benchmarks of cold lookups).
    pub fn clear_cache(&self) {
        self.chain.cache.clear();
        self.chain.resolved.forget_lookups();
    }

    /// Data reads served by each layer (base first).
    pub fn data_reads_per_layer(&self) -> Vec<u64> {
        self.chain
            .data_reads
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

impl Handover<'_> {
    /// Refuses writes from now on, quietly, and its drop closes nothing:
    /// another chain of the same files (a merge's switch) owns the top
    /// now.
    pub fn release_top(&self) {
        if let Some(a) = &self.chain.active {
            a.hand_over();
        }
    }
}
