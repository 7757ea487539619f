//! A vhost-user-blk backend that serves an sQcow2 chain to unmodified
//! QEMU and Cloud Hypervisor guests. Three layers, each importing only
//! the ones below it:
//!
//! * `transport`: the vhost-user protocol of a frontend connection,
//!   guest memory and the virtqueues in it;
//! * `device`: the virtio-blk device on those queues, its workers,
//!   engine threads and the served chain with its switch sequence;
//! * `daemon`: the socket, sessions, signals and the control socket.
//!
//! Beside them, two leaf utilities: `ratelimit` (log limits) and
//! `realtime` (thread priorities).

// Items outside the API are pub(crate); checked with the device
// internals exported (without them, those are unreachable by design).
#![cfg_attr(feature = "internals", warn(unreachable_pub))]

mod daemon;
mod device;
pub mod nbd;
mod ratelimit;
mod realtime;
mod transport;

/// The control socket's messages (`docs/control-api.md`).
pub use daemon::control::protocol;
pub use daemon::error::{AddError, ExportSpecError, ServeError};
pub use daemon::export::ExportSpec;
pub use daemon::exports::MAX_EXPORTS;
pub use daemon::server::{serve, ServeOptions};
pub use device::blk::{DEFAULT_DIRECT_ENGINE_THREADS, DEFAULT_ENGINE_THREADS};
pub use device::polling::Polling;
pub use device::throttle::{IoLimits, ThrottleCounters, LIMIT_KEYS};
pub use device::worker_pool::MAX_WORKER_THREADS;

/// The device without the daemon, for the crate's integration tests and
/// the fuzz targets (feature `internals`): not a stable interface.
#[cfg(feature = "internals")]
pub mod internals {
    pub use crate::daemon::control::{handle_line, prometheus, Shared};
    pub use crate::device::blk::{BlkDevice, DeviceOptions};
    pub use crate::device::handle::ChainHandle;
    pub use crate::device::worker::{Completion, QueueWorker};
    pub use crate::transport::guest_mem::{GuestMem, GuestMemAtomic};
}
