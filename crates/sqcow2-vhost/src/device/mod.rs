//! The virtio-blk device over the transport's virtqueues: requests
//! parsed from descriptor chains ([`request`]), executed by queue workers
//! ([`worker`], [`backend`], on the daemon's [`worker_pool`]) with
//! io_uring ([`ring`]) and engine threads ([`offload`]) against the served
//! chain ([`handle`]), admitted by the [`gate`] that pauses them for a
//! switch of the chain, limited by the export's [`throttle`].

pub(crate) mod backend;
pub(crate) mod blk;
pub(crate) mod config;
pub(crate) mod handle;
pub(crate) use handle::gate;
pub(crate) mod job_pool;
pub(crate) mod job_queue;
pub(crate) mod job_threads;
pub(crate) mod offload;
pub(crate) mod polling;
pub(crate) mod request;
pub(crate) mod ring;
pub(crate) mod session;
pub(crate) mod stats;
#[cfg(test)]
pub(crate) mod test_support;
pub(crate) mod throttle;
pub(crate) mod worker;
pub(crate) mod worker_pool;
