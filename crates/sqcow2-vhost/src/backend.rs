//! The vhost-user side: [`BlkBackend`] plugs queue workers into
//! vhost-user-backend's daemon (one per frontend connection).

use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use tracing::{debug, error};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::config::{read_config, CONFIG_WRITEBACK_OFFSET};
use crate::control::protocol::QueueCounters;
use crate::device::BlkDevice;
use crate::gate::PauseGuard;
use crate::offload::panic_message;
use crate::worker::{GuestMemAtomic, QueueWorker};

/// One worker thread's state: its engine and the vrings it serves.
struct WorkerSlot {
    worker: QueueWorker,
    /// The thread's vrings, kept to complete requests when draining from
    /// another thread.
    vrings: Vec<VringRwLock>,
}

/// A vhost-user-blk backend for one frontend connection.
pub struct BlkBackend {
    device: Arc<BlkDevice>,
    workers: Vec<Mutex<WorkerSlot>>,
    queues_per_thread: Vec<u64>,
    mem: RwLock<Option<GuestMemAtomic>>,
}

impl std::fmt::Debug for BlkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlkBackend")
            .field("threads", &self.workers.len())
            .field("queues_per_thread", &self.queues_per_thread)
            .finish()
    }
}

impl BlkBackend {
    /// A backend for `device`, `queues_per_thread` queues on each worker
    /// thread.
    pub fn new(device: Arc<BlkDevice>, queues_per_thread: u16) -> io::Result<Self> {
        let num_queues = u32::from(device.config().num_queues).clamp(1, 64);
        let per = u32::from(queues_per_thread).clamp(1, num_queues);
        let masks: Vec<u64> = (0..num_queues)
            .step_by(per as usize)
            .map(|first| {
                let last = (first + per).min(num_queues);
                (first..last).fold(0u64, |m, q| m | 1 << q)
            })
            .collect();
        let workers = masks
            .iter()
            .map(|_| {
                Ok(Mutex::new(WorkerSlot {
                    worker: QueueWorker::new(device.clone())?,
                    vrings: Vec::new(),
                }))
            })
            .collect::<io::Result<_>>()?;
        Ok(BlkBackend {
            device,
            workers,
            queues_per_thread: masks,
            mem: RwLock::new(None),
        })
    }

    /// The device served.
    pub fn device(&self) -> &Arc<BlkDevice> {
        &self.device
    }

    /// The event id of io_uring completions in each worker's epoll set
    /// (ids up to `num_queues` belong to the queues and the exit event).
    pub fn completion_event_id(&self) -> u64 {
        self.num_queues() as u64 + 1
    }

    /// The event id of engine results (and wake-ups after a pause) in each
    /// worker's epoll set.
    pub fn mailbox_event_id(&self) -> u64 {
        self.num_queues() as u64 + 2
    }

    /// The io_uring completion eventfd of worker thread `thread`.
    pub fn completion_fd(&self, thread: usize) -> Option<std::os::fd::RawFd> {
        self.workers
            .get(thread)
            .map(|w| std::os::fd::AsRawFd::as_raw_fd(lock(w).worker.completion_fd()))
    }

    /// The mailbox eventfd of worker thread `thread`.
    pub fn mailbox_fd(&self, thread: usize) -> Option<std::os::fd::RawFd> {
        self.workers
            .get(thread)
            .map(|w| std::os::fd::AsRawFd::as_raw_fd(lock(w).worker.mailbox_fd()))
    }

    /// Stops new requests from starting until the guard is dropped; the
    /// workers go on completing those in flight.
    pub fn pause(&self) -> PauseGuard {
        self.device.gate().pause()
    }

    /// Waits (while paused) until no request is in flight, at most
    /// `timeout`; whether that happened.
    pub fn wait_idle(&self, timeout: std::time::Duration) -> bool {
        self.device.gate().wait_idle(timeout)
    }

    /// Per-queue statistics.
    pub fn queue_stats(&self) -> Vec<QueueCounters> {
        let mut out = Vec::new();
        for (thread, w) in self.workers.iter().enumerate() {
            let first = self.queues_per_thread[thread].trailing_zeros() as usize;
            let slot = lock(w);
            for (local, st) in slot.worker.stats().iter().enumerate() {
                out.push(QueueCounters {
                    queue: first + local,
                    requests: st.requests,
                    read_bytes: st.read_bytes,
                    write_bytes: st.write_bytes,
                    errors: st.errors,
                    latency_us_p50: st.latency_us.value_at_quantile(0.5),
                    latency_us_p99: st.latency_us.value_at_quantile(0.99),
                    latency_us_max: st.latency_us.max(),
                });
            }
        }
        out
    }

    /// Waits for every request in flight to finish and completes it to the
    /// guest (if it is still there), running each worker's completions in
    /// the calling thread: for when the worker threads have stopped.
    pub fn drain(&self) {
        for w in &self.workers {
            let mut slot = lock(w);
            slot.worker.drain();
            complete(&mut slot);
        }
    }
}

fn lock(w: &Mutex<WorkerSlot>) -> MutexGuard<'_, WorkerSlot> {
    w.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Puts the worker's finished requests on their used rings and notifies
/// the driver where it asked to be.
fn complete(slot: &mut WorkerSlot) {
    let mut touched = vec![false; slot.vrings.len()];
    for c in slot.worker.take_completions() {
        let Some(vring) = slot.vrings.get(c.queue) else {
            continue;
        };
        if let Err(e) = vring.add_used(c.head, c.len) {
            crate::limited_warn!("used ring: {e}");
        }
        touched[c.queue] = true;
    }
    for (vring, _) in slot.vrings.iter().zip(touched).filter(|(_, t)| *t) {
        signal(vring);
    }
}

fn signal(vring: &VringRwLock) {
    match vring.needs_notification() {
        Ok(true) => {
            if let Err(e) = vring.signal_used_queue() {
                debug!("signal used queue: {e}");
            }
        }
        Ok(false) => {}
        Err(e) => debug!("used event: {e}"),
    }
}

impl BlkBackend {
    /// One event of a worker thread, its slot locked.
    fn handle_locked(
        &self,
        slot: &mut WorkerSlot,
        index: usize,
        device_event: u16,
        vrings: &[VringRwLock],
    ) {
        if slot.vrings.len() != vrings.len() {
            slot.vrings = vrings.to_vec();
        }
        if let Some(vring) = vrings.get(index) {
            self.process(slot, index, vring);
        } else if u64::from(device_event) == self.completion_event_id() {
            slot.worker.handle_completion_event();
        } else if u64::from(device_event) == self.mailbox_event_id()
            && slot.worker.handle_mailbox_event()
        {
            // A pause ended: start what the guest queued meanwhile.
            for (index, vring) in vrings.iter().enumerate() {
                self.process(slot, index, vring);
            }
        }
    }

    /// Takes the requests of one queue.
    fn process(&self, slot: &mut WorkerSlot, index: usize, vring: &VringRwLock) {
        let Some(mem) = self
            .mem
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        else {
            return;
        };
        let used = {
            let mut state = vring.get_mut();
            slot.worker
                .process_queue(index, state.get_queue_mut(), &mem)
        };
        // An error here means the guest's rings are unusable (e.g. the
        // used ring lies outside guest memory). Returning it would end
        // this worker thread and every queue on it, so log it instead.
        match used {
            Ok(true) => signal(vring),
            Ok(false) => {}
            Err(e) => crate::limited_warn!(queue = index, "queue unusable: {e}"),
        }
        // Reads of cached data often complete during the submission:
        // finish them now rather than after another epoll round.
        slot.worker.reap_ready();
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        usize::from(self.device.config().num_queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.device.config().queue_size)
    }

    fn features(&self) -> u64 {
        self.device.config().features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, _enabled: bool) {
        // The vrings carry the flag; workers read it from the queue.
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        read_config(&self.device.config_space(), offset, size)
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        match (offset, buf) {
            (CONFIG_WRITEBACK_OFFSET, [mode]) => {
                debug!(writeback = *mode != 0, "cache mode set by driver");
                self.device.set_writeback(*mode != 0);
                Ok(())
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("config write at {offset} ({} bytes) not allowed", buf.len()),
            )),
        }
    }

    fn update_memory(&self, mem: GuestMemAtomic) -> io::Result<()> {
        *self.mem.write().unwrap_or_else(PoisonError::into_inner) = Some(mem);
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        self.queues_per_thread.clone()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[VringRwLock],
        thread_id: usize,
    ) -> io::Result<()> {
        // Never returns an error: vhost-user-backend ends the worker thread
        // on one.
        let Some(w) = self.workers.get(thread_id) else {
            return Ok(());
        };
        let index = usize::from(device_event);
        // Nothing here waits for another thread: requests start only with a
        // permit of the device's gate (none while paused), and everything
        // that may block runs on engine threads.
        let mut slot = lock(w);
        let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.handle_locked(&mut slot, index, device_event, vrings)
        }));
        if let Err(panic) = handled {
            let what = panic_message(&*panic);
            error!(
                thread = thread_id,
                "worker panicked (a bug), failing its stuck requests and refusing writes: {what}"
            );
            self.device
                .record_panic(&format!("a queue worker panicked: {what}"));
            slot.worker.recover_after_panic();
        }
        complete(&mut slot);
        Ok(())
    }
}
