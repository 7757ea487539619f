//! The daemon: the vhost-user socket and its frontend sessions
//! ([`server`]), signals, readiness, and the control socket
//! ([`control`]) whose jobs change the served chain (live snapshot,
//! merge, handover) through the device's switch sequence.

pub(crate) mod control;
pub(crate) mod server;
pub(crate) mod socket_file;
