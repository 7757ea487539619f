//! The daemon: the vhost-user socket and its frontend sessions
//! ([`server`]), signals, readiness, and the control socket
//! ([`control`]) whose jobs change the served chain (live snapshot,
//! merge, handover) through the device's switch sequence.

pub(crate) mod control;
pub(crate) mod control_socket;
pub(crate) mod error;
pub(crate) mod export;
pub(crate) mod exports;
pub(crate) mod metrics_http;
pub(crate) mod server;
pub(crate) mod socket_file;
