//! A vhost-user-blk backend that serves an sQcow2 chain to unmodified
//! QEMU and Cloud Hypervisor guests.
//!
//! * [`request`] parses untrusted descriptor chains into validated
//!   requests;
//! * [`worker`] executes them: data clusters are read with io_uring
//!   straight into guest memory, metadata comes from the chain's unified
//!   cache;
//! * `frontend` speaks the vhost-user protocol (with inflight I/O
//!   tracking), [`backend`] runs the queues on worker threads;
//! * [`server`] owns the socket: one frontend at a time, reconnects,
//!   signals, readiness.

mod backend;
mod config;
mod control;
mod descriptors;
mod device;
mod frontend;
mod gate;
mod guest_mem;
mod handle;
mod inflight;
mod job_threads;
mod offload;
mod polling;
mod ratelimit;
mod realtime;
mod request;
mod ring;
mod server;
mod socket_file;
mod stats;
#[cfg(test)]
mod test_support;
mod vring;
mod worker;

/// The control socket's messages (`docs/control-api.md`).
pub use control::protocol;
pub use device::DEFAULT_ENGINE_THREADS;
pub use polling::Polling;
pub use server::{serve, ServeError, ServeOptions};

/// The device without the daemon, for the crate's integration tests and
/// the fuzz targets (feature `internals`): not a stable interface.
#[cfg(feature = "internals")]
pub mod internals {
    pub use crate::control::{handle_line, prometheus, Shared};
    pub use crate::device::{BlkDevice, DeviceOptions};
    pub use crate::guest_mem::{GuestMem, GuestMemAtomic};
    pub use crate::handle::ChainHandle;
    pub use crate::worker::{Completion, QueueWorker};
}
