//! qcow2 on-disk structures and the sqcow2 chain engine.
//!
//! [`Chain::open`] opens a backing chain from its top image, validating
//! every header and following backing files iteratively; [`Chain::read_at`]
//! returns the bytes QEMU returns, and [`Chain::map`] the extents
//! `qemu-img map` reports.

#![warn(missing_docs)]

mod active;
pub mod backing;
mod bytes;
pub mod chain;
pub mod check;
pub mod compressed;
pub mod create;
pub mod entry;
pub mod error;
pub mod extension;
mod fault;
pub mod features;
mod fence;
pub mod gen;
pub mod header;
pub mod index;
pub mod indexing;
pub mod layer;
pub mod refcount;
mod size;
pub mod snapshot;
pub mod sqcow2_ext;
pub mod storage;
pub mod summary;
pub mod types;

pub use chain::{Chain, ChainOptions, Extent, ExtentKind, InPlaceTarget, ReadExtent};
pub use error::{Error, ErrorKind, Feature, Table};
pub use fault::FaultPoint;
pub use fence::TransferTicket;
pub use header::{CompressionType, Header, Version};
pub use layer::Layer;
pub use size::{parse_size, SizeError};
pub use types::{GuestOffset, HostOffset, LayerIndex};

#[cfg(test)]
mod tests {
    /// The engine is shared by queue threads: it must be `Send + Sync`.
    #[test]
    fn chain_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<crate::Chain>();
    }
}
