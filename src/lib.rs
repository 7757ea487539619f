//! sqcow2: qcow2 backing chains with backing-index direct access and one
//! unified metadata cache.
//!
//! This crate is the public facade: it re-exports the workspace crates.
//! * [`format`]: on-disk qcow2 structures and the chain engine;
//! * [`cache`]: the unified slice cache;
//! * [`vhost`]: the vhost-user-blk backend.

pub use sqcow2_cache as cache;
pub use sqcow2_format as format;
pub use sqcow2_vhost as vhost;
