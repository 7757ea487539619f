//! qcow2 on-disk structures and the sqcow2 chain engine.
//!
//! [`Chain::open`] opens a backing chain from its top image, validating
//! every header and following backing files iteratively; [`Chain::read_at`]
//! returns the bytes QEMU returns, and [`Chain::map`] the extents
//! `qemu-img map` reports. Opened writable, [`Chain::write_at`],
//! [`Chain::discard`], [`Chain::write_zeroes`] and [`Chain::flush`] change
//! the top as QEMU would. One job per type: what else a chain offers is
//! grouped in views it hands out: [`Chain::transfers`] (callers that move
//! data themselves, under a [`TransferTicket`]), [`Chain::index`] (the
//! chain index in use), [`Chain::durability`] (journal, publish,
//! write-back), [`Chain::handover`] (a successor chain, retiring the old
//! top) and [`Chain::diagnostics`] (cache and read statistics).
//!
//! Public modules are the tools around the engine: [`check`] (like
//! `qemu-img check`), [`create`], [`indexing`] (upgrade, snapshot,
//! verify), [`gen`] (test chains), [`index`] (the chain index format) and
//! [`storage`]. Everything else is reached through the re-exports below.

#![warn(missing_docs)]
#![warn(unreachable_pub)]

mod active;
pub mod amend;
mod backing;
mod bitmaps;
mod bytes;
mod chain;
pub mod check;
mod closed;
mod compressed;
pub mod create;
pub mod direct;
mod dirty;
mod entry;
mod error;
mod extension;
mod fault;
mod features;
mod fence;
mod files;
#[cfg(test)]
mod folios;
pub mod gen;
mod header;
mod header_area;
mod held;
pub mod index;
pub mod indexing;
mod layer;
mod lock;
pub mod luks;
pub mod measure;
mod nowait;
pub mod prealloc;
mod read_once;
mod refcount;
mod remote;
pub mod reshape;
pub mod resize;
mod shared_layers;
mod sidefile;
mod size;
mod snapshot;
mod sqcow2_ext;
pub mod storage;
mod summary;
mod types;
pub mod writer;

/// Records the mapping journal holds (`<top>.sqjournal`, a ring).
pub const JOURNAL_RECORDS: u64 = active::journal::CAPACITY;
pub use backing::resolve_backing_path;
pub use bitmaps::{
    describe_bitmaps, read_dirty_ranges, read_dirty_ranges_in, BitmapInfo, BitmapRead,
};
pub use chain::bitmaps::{BitmapStatus, PersistentBitmaps};
pub use chain::{
    backing_path_of, AllocatingWrite, Chain, ChainOptions, ClusterCopy, CopyRead, Diagnostics,
    Durability, Extent, ExtentKind, Handover, InPlaceTarget, IndexView, Installed, Linked,
    MovedClaim, PreparedTop, ReadExtent, TransferHold, Transfers, DEFAULT_MAX_LAYERS,
};
pub use direct::CacheMode;
pub use entry::CompressedDescriptor;
pub use error::{Error, ErrorKind, Feature, Table};
pub use extension::HeaderExtension;
#[cfg(feature = "fault-injection")]
pub use fault::FaultPoint;
pub use features::{FeatureBits, SetFeature};
pub use fence::TransferTicket;
pub use files::raise_open_file_limit;
pub use header::{CompressionType, Header, Version};
pub use layer::{Layer, Qcow2Layer, RawLayer};
pub use lock::{LockRequest, Locking, Perms};
pub use remote::{is_remote_name, set_process_remote_layers, RemoteLayers};
pub use shared_layers::SharedLayers;
pub use sidefile::CreatedFile;
pub use size::{parse_size, SizeError};
pub use snapshot::{describe_snapshots, SnapshotInfo};
/// The unified cache's counters at one moment.
pub use sqcow2_cache::StatsSnapshot as CacheSnapshot;
pub use sqcow2_ext::IndexState;
pub use types::{Geometry, GuestCluster, GuestOffset, HostOffset, LayerIndex};

#[cfg(test)]
mod tests {
    /// The engine is shared by queue threads: it must be `Send + Sync`.
    #[test]
    fn chain_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<crate::Chain>();
    }
}
