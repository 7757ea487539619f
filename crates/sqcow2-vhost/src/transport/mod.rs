//! The vhost-user transport: one frontend connection's protocol
//! ([`frontend`]), the guest's memory, and the virtqueues in it
//! (descriptor chains, inflight tracking). It knows nothing of block
//! devices: a device plugs in through [`frontend::QueueDevice`].

pub(crate) mod backend_channel;
pub(crate) mod descriptors;
pub(crate) mod frontend;
pub(crate) mod guest_mem;
pub(crate) mod inflight;
pub(crate) mod vring;
