//! What a frontend session drives ([`QueueDevice`]): a backend's rings
//! and the pool threads its queue groups are attached to.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use tracing::debug;

use crate::device::backend::BlkBackend;
use crate::device::config::{read_config, CONFIG_WRITEBACK_OFFSET};
use crate::device::worker_pool::Attachment;
use crate::transport::frontend::QueueDevice;
use crate::transport::vring::{SharedMem, Vring};

/// A frontend session's view of the device: the backend's rings and the
/// worker threads that serve them, as the transport asks for them.
#[derive(Debug, Clone)]
pub(crate) struct SessionDevice {
    pub(crate) backend: Arc<BlkBackend>,
    pub(crate) threads: Arc<Attachment>,
}

impl QueueDevice for SessionDevice {
    fn features(&self) -> u64 {
        self.backend.device().config().features()
    }

    fn num_queues(&self) -> usize {
        self.backend.num_queues()
    }

    fn max_queue_size(&self) -> u16 {
        self.backend.device().config().queue_size
    }

    fn vring(&self, queue: usize) -> Option<&Vring> {
        self.backend.vring(queue)
    }

    fn mem(&self) -> &SharedMem {
        self.backend.mem()
    }

    fn watch_kick(&self, queue: usize, kick: RawFd) -> io::Result<()> {
        self.threads.watch_kick(queue, kick)
    }

    fn unwatch_kick(&self, queue: usize, kick: RawFd) {
        self.threads.unwatch_kick(queue, kick);
    }

    fn kick_now(&self, queue: usize) {
        self.backend.kick_now(queue);
    }

    fn wait_queue_idle(&self, queue: usize, timeout: Duration) -> bool {
        self.backend.wait_queue_idle(queue, timeout)
    }

    fn read_config(&self, offset: u32, size: u32) -> Vec<u8> {
        read_config(&self.backend.device().config_space(), offset, size)
    }

    fn write_config(&self, offset: u32, data: &[u8]) -> bool {
        match (offset, data) {
            (CONFIG_WRITEBACK_OFFSET, [mode]) => {
                debug!(writeback = *mode != 0, "cache mode set by driver");
                self.backend.device().set_writeback(*mode != 0);
                true
            }
            _ => false,
        }
    }
}
