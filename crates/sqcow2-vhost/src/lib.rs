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

pub mod backend;
pub mod config;
pub mod control;
mod descriptors;
pub mod device;
mod frontend;
pub mod gate;
mod guest_mem;
pub mod handle;
pub mod inflight;
mod job_threads;
mod offload;
mod polling;
pub mod ratelimit;
mod realtime;
pub mod request;
mod ring;
pub mod server;
mod socket_file;
mod stats;
#[cfg(test)]
mod test_support;
mod vring;
pub mod worker;

pub use backend::BlkBackend;
pub use device::{BlkDevice, DeviceOptions};
pub use guest_mem::{GuestMem, GuestMemAtomic};
pub use handle::ChainHandle;
pub use polling::Polling;
pub use server::{serve, ServeOptions};
pub use stats::QueueStats;
pub use worker::{Completion, QueueWorker};
