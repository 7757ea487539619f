//! The device side of a frontend connection: [`BlkBackend`] owns the
//! virtqueues and one queue worker per queue group; the daemon's worker
//! threads (`worker_pool`), each serving groups of many sessions, wait on
//! the queues' kick eventfds, io_uring completions and engine results,
//! and call it.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tracing::error;
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};

use crate::device::blk::BlkDevice;
use crate::device::gate::PauseGuard;
use crate::device::offload::panic_message;
use crate::device::stats::QueueStats;
use crate::device::worker::{Notifications, QueueWorker, Taken};
use crate::transport::guest_mem::GuestMem;
use crate::transport::vring::{SharedMem, Vring};

/// Requests a worker takes off a queue before it completes what finished
/// (see [`QueueWorker::set_batch`]). Measured with random 4 KiB reads at
/// depth 32 (libblkio client, one queue): a whole queue at a time made the
/// guest and the worker take turns (~220k IOPS), batches of 2, 4, 8, 16
/// gave ~340k, 400k, 450k, 455k.
const REQUEST_BATCH: usize = 8;

/// One queue group's state: its worker and what it has left to do.
struct WorkerSlot {
    worker: QueueWorker,
    /// Worker-local queues that stopped at the batch size with requests
    /// left: the thread takes their next batch before it sleeps.
    pending: Vec<bool>,
    /// Worker-local queues with requests completed on the spot (put on
    /// the used ring while they were taken) that the driver has not been
    /// considered for a notification about yet.
    unsignalled: Vec<bool>,
}

impl WorkerSlot {
    /// Marks worker-local queue `local` pending or not.
    fn set_pending(&mut self, local: usize, pending: bool) {
        if self.pending.len() <= local {
            self.pending.resize(local + 1, false);
        }
        self.pending[local] = pending;
    }
}

/// A vhost-user-blk device for one frontend connection.
pub(crate) struct BlkBackend {
    device: Arc<BlkDevice>,
    workers: Vec<Mutex<WorkerSlot>>,
    /// The queues of each queue group, in worker-local order.
    group_queues: Vec<Vec<usize>>,
    vrings: Vec<Vring>,
    mem: SharedMem,
}

impl std::fmt::Debug for BlkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlkBackend")
            .field("threads", &self.workers.len())
            .field("group_queues", &self.group_queues)
            .finish()
    }
}

/// What woke the thread of a queue group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wake {
    /// The kick eventfd of this queue.
    Kick(usize),
    /// The group's io_uring completions.
    Completion,
    /// The group's engine results, or the device's resume.
    Mailbox,
}

impl BlkBackend {
    /// A backend for `device`, `queues_per_thread` queues in each queue
    /// group (one worker each).
    pub(crate) fn new(device: Arc<BlkDevice>, queues_per_thread: u16) -> io::Result<Self> {
        let num_queues = usize::from(device.config().num_queues).clamp(1, 64);
        let per = usize::from(queues_per_thread).clamp(1, num_queues);
        let group_queues: Vec<Vec<usize>> = (0..num_queues)
            .step_by(per)
            .map(|first| (first..(first + per).min(num_queues)).collect())
            .collect();
        let workers = group_queues
            .iter()
            .map(|_| {
                let mut worker = QueueWorker::new(device.clone())?;
                worker.set_batch(REQUEST_BATCH);
                Ok(Mutex::new(WorkerSlot {
                    worker,
                    pending: Vec::new(),
                    unsignalled: Vec::new(),
                }))
            })
            .collect::<io::Result<_>>()?;
        let max = device.config().queue_size;
        let vrings = (0..num_queues).map(|_| Vring::new(max)).collect();
        Ok(BlkBackend {
            device,
            workers,
            group_queues,
            vrings,
            mem: GuestMemoryAtomic::new(GuestMem::new()),
        })
    }

    /// The device served.
    pub(crate) fn device(&self) -> &Arc<BlkDevice> {
        &self.device
    }

    /// Queues offered.
    pub(crate) fn num_queues(&self) -> usize {
        self.vrings.len()
    }

    pub(crate) fn vring(&self, queue: usize) -> Option<&Vring> {
        self.vrings.get(queue)
    }

    pub(crate) fn mem(&self) -> &SharedMem {
        &self.mem
    }

    /// Queue groups, each with its worker (each attached to a thread of the
    /// daemon's `worker_pool`).
    pub(crate) fn groups(&self) -> usize {
        self.workers.len()
    }

    /// The completion and mailbox eventfds of `group`'s worker.
    pub(super) fn group_fds(&self, group: usize) -> (RawFd, RawFd) {
        match self.workers.get(group) {
            Some(w) => {
                let slot = lock(w);
                (
                    slot.worker.completion_fd().as_raw_fd(),
                    slot.worker.mailbox_fd().as_raw_fd(),
                )
            }
            None => (-1, -1),
        }
    }

    /// The kick eventfds `group`'s rings hold now.
    pub(super) fn group_kicks(&self, group: usize) -> Vec<RawFd> {
        self.queues_of(group)
            .iter()
            .filter_map(|&q| self.vrings.get(q))
            .filter_map(|v| v.lock().kick.as_ref().map(|k| k.as_raw_fd()))
            .collect()
    }

    /// The queue group serving `queue`.
    pub(crate) fn group_of(&self, queue: usize) -> Option<usize> {
        self.group_queues.iter().position(|qs| qs.contains(&queue))
    }

    /// The queues of queue group `group`, in worker-local order.
    fn queues_of(&self, group: usize) -> &[usize] {
        self.group_queues.get(group).map_or(&[], Vec::as_slice)
    }

    /// Stops new requests from starting until the guard is dropped; the
    /// workers go on completing those in flight.
    pub(crate) fn pause(&self) -> PauseGuard {
        self.device.gate().pause()
    }

    /// Waits (while paused) until no request is in flight, at most
    /// `timeout`; whether that happened.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> bool {
        self.device.gate().wait_idle(timeout)
    }

    /// Waits until the queue group of `queue` has no request in flight,
    /// at most `timeout`; whether that happened.
    pub(crate) fn wait_queue_idle(&self, queue: usize, timeout: Duration) -> bool {
        let Some(group) = self.group_of(queue) else {
            return true;
        };
        let Some(w) = self.workers.get(group) else {
            return true;
        };
        // A request parked for the limits was taken from the ring: it
        // starts now whatever them (QEMU's drain restarts throttled
        // requests), and completes before the ring's index is given.
        if lock(w).worker.force_parked() {
            self.wake(group);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if lock(w).worker.in_flight() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Per-queue statistics: (queue number, its statistics).
    pub(crate) fn queue_stats(&self) -> Vec<(usize, QueueStats)> {
        let mut out = Vec::new();
        for (group, w) in self.workers.iter().enumerate() {
            let queues = self.queues_of(group);
            let slot = lock(w);
            for (local, st) in slot.worker.stats().iter().enumerate() {
                out.push((queues.get(local).copied().unwrap_or(local), st.clone()));
            }
        }
        out
    }

    /// The latencies of every request completed so far, all queues
    /// together (microseconds).
    pub(crate) fn latency_histogram(&self) -> hdrhistogram::Histogram<u64> {
        let mut all = crate::device::stats::QueueStats::default().latency_us;
        for w in &self.workers {
            let slot = lock(w);
            for st in slot.worker.stats() {
                let _ = all.add(&st.latency_us);
            }
        }
        all
    }

    /// Waits for every request in flight to finish and completes it to the
    /// guest (if its ring is still live), running each worker's completions
    /// in the calling thread: for when the groups are detached.
    pub(crate) fn drain(&self) {
        // All workers in turns, none waiting for its own jobs alone: a
        // live snapshot's switch may wait for one worker's requests (ring
        // transfers, a flush's answer) while the jobs another worker waits
        // for wait for the switch.
        loop {
            let mut all_done = true;
            for (group, w) in self.workers.iter().enumerate() {
                let mut slot = lock(w);
                all_done &= slot.worker.drain_some();
                self.complete(&mut slot, group);
            }
            if all_done {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Puts the worker's finished requests on their used rings and notifies
    /// the driver where it asked to be: once per queue, for everything
    /// completed since the last notification (requests completed on the
    /// spot included), since a notification that wakes the driver costs
    /// more than the rest of a small request.
    fn complete(&self, slot: &mut WorkerSlot, group: usize) {
        let completions = slot.worker.take_completions();
        if completions.is_empty() && !slot.unsignalled.iter().any(|u| *u) {
            return;
        }
        let queues = self.queues_of(group);
        let mut touched = std::mem::take(&mut slot.unsignalled);
        touched.resize(queues.len(), false);
        for c in &completions {
            if let Some(t) = touched.get_mut(c.queue) {
                *t = true;
            }
        }
        let mem = self.mem.memory();
        for (local, &queue) in queues.iter().enumerate() {
            if !touched[local] {
                continue;
            }
            let Some(vring) = self.vrings.get(queue) else {
                continue;
            };
            let mut st = vring.lock();
            for c in completions.iter().filter(|c| c.queue == local) {
                st.put_used(&mem, c.head, c.len);
            }
            st.signal(&mem);
        }
        touched.fill(false);
        slot.unsignalled = touched;
    }

    /// Takes one batch of requests of queue `queue` (worker-local `local`
    /// of queue group `group`), completes what finished; whether any
    /// request was taken. A queue left with requests is marked pending
    /// (the thread takes its next batch before it sleeps: queues and
    /// events take turns).
    fn process(
        &self,
        slot: &mut WorkerSlot,
        group: usize,
        local: usize,
        queue: usize,
        notifications: Notifications,
    ) -> bool {
        let Some(vring) = self.vrings.get(queue) else {
            return false;
        };
        // Held while requests are taken and started (io_uring submissions,
        // which never wait, and hand-offs to engine threads): the ring must
        // not be stopped or moved by the protocol side in the middle.
        let mut st = vring.lock();
        let taking = st.may_take();
        if !taking && slot.worker.parked_due() != Some(local) {
            // Nothing to take until the ring (re)starts, which marks it
            // pending again (`kick_now`): left pending, the thread would
            // spin on it.
            slot.set_pending(local, false);
            return false;
        }
        let used_before = st.queue.next_used();
        let state = &mut *st;
        let taken = if taking {
            slot.worker.process_tracked(
                local,
                &mut state.queue,
                state.tracker.as_mut(),
                &self.mem,
                notifications,
            )
        } else {
            // The ring stops: only the request parked from it, which it
            // waits for.
            slot.worker.start_parked_only(
                local,
                &mut state.queue,
                state.tracker.as_mut(),
                &self.mem,
            )
        };
        // Requests completed on the spot (even if taking failed later) are
        // signalled with the rest, in `complete` below.
        if st.queue.next_used() != used_before {
            st.note_used();
            if slot.unsignalled.len() <= local {
                slot.unsignalled.resize(local + 1, false);
            }
            slot.unsignalled[local] = true;
        }
        drop(st);
        // An error here means the guest's rings are unusable (e.g. the
        // used ring lies outside guest memory). Returning it would end this
        // group and every queue on it, so log it instead; it is no
        // progress (a polling thread must not spin on it).
        let taken = match taken {
            Ok(t) => t,
            Err(e) => {
                crate::limited_warn!(queue, "queue unusable: {e}");
                Taken::default()
            }
        };
        slot.set_pending(local, taken.more);
        // Reads of cached data often complete during the submission:
        // finish them now rather than after another epoll round.
        slot.worker.reap_ready();
        self.complete(slot, group);
        taken.taken > 0 || taken.used
    }

    /// Takes the next batch of every pending queue of queue group
    /// `thread`; whether one is still pending after that.
    pub(super) fn continue_pending(&self, group: usize) -> bool {
        let Some(w) = self.workers.get(group) else {
            return false;
        };
        let mut slot = lock(w);
        let queues = self.queues_of(group);
        let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for (local, &queue) in queues.iter().enumerate() {
                if slot.pending.get(local).copied().unwrap_or(false) {
                    self.process(&mut slot, group, local, queue, Notifications::Restore);
                }
            }
        }));
        if let Err(panic) = handled {
            self.worker_panicked(&mut slot, group, &*panic);
        }
        self.complete(&mut slot, group);
        slot.pending.iter().any(|p| *p)
    }

    /// After a pause ended: one batch of every queue of queue group
    /// `thread` (requests the guest queued meanwhile, resubmissions
    /// included); whether any request was taken.
    fn resume(&self, slot: &mut WorkerSlot, group: usize, notifications: Notifications) -> bool {
        let mut taken = false;
        for (local, &queue) in self.queues_of(group).iter().enumerate() {
            taken |= self.process(slot, group, local, queue, notifications);
        }
        taken
    }

    /// One wake-up of queue group `group`.
    pub(super) fn handle(&self, group: usize, wake: Wake) {
        let Some(w) = self.workers.get(group) else {
            return;
        };
        let queues = self.queues_of(group);
        // Nothing here waits for another thread: requests start only with a
        // permit of the device's gate (none while paused), and everything
        // that may block runs on engine threads.
        let mut slot = lock(w);
        let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match wake {
            Wake::Kick(queue) => {
                if let Some(local) = queues.iter().position(|q| *q == queue) {
                    if let Some(vring) = self.vrings.get(queue) {
                        if let Some(kick) = &vring.lock().kick {
                            // Readable (epoll said so): clears it without
                            // blocking.
                            let _ = kick.read();
                        }
                    }
                    self.process(&mut slot, group, local, queue, Notifications::Restore);
                }
            }
            Wake::Completion => slot.worker.handle_completion_event(),
            Wake::Mailbox => {
                if slot.worker.handle_mailbox_event() {
                    // A pause ended: start what the guest queued meanwhile.
                    self.resume(&mut slot, group, Notifications::Restore);
                }
            }
        }));
        if let Err(panic) = handled {
            self.worker_panicked(&mut slot, group, &*panic);
        }
        self.complete(&mut slot, group);
    }

    /// After a panic in queue group `group` (a bug): logged, counted,
    /// the stuck requests failed, writes refused from then on.
    fn worker_panicked(
        &self,
        slot: &mut WorkerSlot,
        group: usize,
        panic: &(dyn std::any::Any + Send),
    ) {
        let what = panic_message(panic);
        error!(
            group,
            "worker panicked (a bug), failing its stuck requests and refusing writes: {what}"
        );
        self.device
            .record_panic(&format!("a queue worker panicked: {what}"));
        slot.worker.recover_after_panic();
    }

    /// One busy-poll step of queue group `group`: finished transfers
    /// and engine results are applied and a batch of requests taken from
    /// each of its queues that has some, with no syscall when there is
    /// nothing to do; whether anything moved (requests taken, transfers or
    /// jobs finished). A ring that cannot be read is no progress.
    pub(super) fn poll(&self, group: usize) -> bool {
        let Some(w) = self.workers.get(group) else {
            return false;
        };
        let queues = self.queues_of(group);
        let mut slot = lock(w);
        let mut moved = false;
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            moved |= slot.worker.poll_finished();
            if let Some(local) = slot.worker.parked_due() {
                if let Some(&queue) = queues.get(local) {
                    moved |= self.process(&mut slot, group, local, queue, Notifications::KeepOff);
                }
            }
            if slot.worker.is_deferred() {
                if slot.worker.resume_after_pause() {
                    // Every queue, resubmissions included: the mailbox's
                    // wake-up will find nothing left to resume.
                    moved |= self.resume(&mut slot, group, Notifications::KeepOff);
                }
                // Paused: requests stay on the queues until it ends.
                return;
            }
            let mem = self.mem.memory();
            for (local, &queue) in queues.iter().enumerate() {
                let waiting = self
                    .vrings
                    .get(queue)
                    .is_some_and(|v| v.lock().has_work(&mem));
                if waiting {
                    moved |= self.process(&mut slot, group, local, queue, Notifications::KeepOff);
                }
            }
        }));
        if let Err(panic) = polled {
            self.worker_panicked(&mut slot, group, &*panic);
        }
        self.complete(&mut slot, group);
        moved
    }

    /// Ends a busy-poll of queue group `group`: the guest's
    /// notifications back on, and what the thread does next.
    pub(super) fn stop_polling(&self, group: usize) -> AfterPoll {
        let Some(w) = self.workers.get(group) else {
            return AfterPoll::Sleep;
        };
        let slot = lock(w);
        // Paused: requests on the queues wait for the mailbox's wake-up.
        let deferred = slot.worker.is_deferred();
        let mem = self.mem.memory();
        let mut next = AfterPoll::Sleep;
        for &queue in self.queues_of(group) {
            if let Some(v) = self.vrings.get(queue) {
                let mut st = v.lock();
                if !st.may_take() {
                    continue;
                }
                match st.notifications_on(&mem) {
                    Ok(true) if !deferred => next = AfterPoll::PollAgain,
                    Ok(_) => {}
                    Err(e) => {
                        // The guest may not kick: look again soon.
                        crate::limited_warn!(queue, "queue unusable: {e}");
                        if next == AfterPoll::Sleep {
                            next = AfterPoll::SleepBriefly;
                        }
                    }
                }
            }
        }
        next
    }

    /// Starts queue `queue` after a (re)start of its ring: what it holds
    /// is taken as if it had been kicked. (Handing this to the worker
    /// thread instead, 0ad7078, made a kill-and-restart test fail about
    /// one run in four with an I/O error; reverted until understood.)
    pub(crate) fn kick_now(&self, queue: usize) {
        let Some(group) = self.group_of(queue) else {
            return;
        };
        let queues = self.queues_of(group);
        if let (Some(w), Some(local)) = (
            self.workers.get(group),
            queues.iter().position(|q| *q == queue),
        ) {
            let mut slot = lock(w);
            self.process(&mut slot, group, local, queue, Notifications::Restore);
            let pending = slot.pending.iter().any(|p| *p);
            drop(slot);
            if pending {
                // The worker thread takes the rest: wake it.
                self.wake(group);
            }
        }
    }

    /// Wakes queue group `group` out of epoll (through its mailbox's
    /// eventfd), so that it looks at its pending queues.
    fn wake(&self, group: usize) {
        if let Some(w) = self.workers.get(group) {
            if let Err(e) = lock(w).worker.mailbox_fd().write(1) {
                crate::limited_warn!("waking a worker: {e}");
            }
        }
    }

    /// When queue group `group` must look at its parked request (one
    /// that waits for the export's limits), if it has one.
    pub(super) fn parked_until(&self, group: usize) -> Option<Instant> {
        self.workers
            .get(group)
            .and_then(|w| lock(w).worker.parked_until())
    }

    /// Starts queue group `group`'s parked request if its time has
    /// come (and takes what its queue holds behind it); whether it did.
    pub(super) fn start_parked(&self, group: usize) -> bool {
        let Some(w) = self.workers.get(group) else {
            return false;
        };
        let mut slot = lock(w);
        let Some(local) = slot.worker.parked_due() else {
            return false;
        };
        let Some(&queue) = self.queues_of(group).get(local) else {
            return false;
        };
        let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.process(&mut slot, group, local, queue, Notifications::Restore)
        }));
        match handled {
            Ok(_) => {}
            Err(panic) => self.worker_panicked(&mut slot, group, &*panic),
        }
        if slot.worker.parked_until().is_none() {
            // The group's other queues were not taken from meanwhile (a
            // kick on one found the worker parked): each looked at now.
            for l in 0..self.queues_of(group).len() {
                slot.set_pending(l, true);
            }
        }
        self.complete(&mut slot, group);
        true
    }

    /// Wakes every queue group (the export's limits changed: a parked
    /// request looks again).
    pub(crate) fn wake_all(&self) {
        for t in 0..self.workers.len() {
            self.wake(t);
        }
    }

    /// Lets requests parked for the export's limits start whatever the
    /// limits (a stop finishes what the guest asked for, as QEMU's drain
    /// does); waits at most `timeout` until none is parked.
    pub(crate) fn release_parked(&self, timeout: Duration) -> bool {
        self.device.throttle().set_bypass(true);
        let deadline = Instant::now() + timeout;
        loop {
            let parked: Vec<usize> = (0..self.workers.len())
                .filter(|&t| self.parked_until(t).is_some())
                .collect();
            if parked.is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            for t in parked {
                self.wake(t);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// What queue group `group` waits for.
    pub(super) fn waiting_for(&self, group: usize) -> WaitingFor {
        let Some(w) = self.workers.get(group) else {
            return WaitingFor::Guest;
        };
        let slot = lock(w);
        if slot.worker.waits_only_for_jobs() {
            WaitingFor::Jobs
        } else if slot.worker.in_flight() > 0 {
            WaitingFor::Device
        } else {
            WaitingFor::Guest
        }
    }

    /// Whether queue group `group` has queues with requests left at
    /// the batch size.
    pub(super) fn has_pending(&self, group: usize) -> bool {
        self.workers
            .get(group)
            .is_some_and(|w| lock(w).pending.iter().any(|p| *p))
    }

    /// Submits transfers of `thread`'s ring that a failed submit left
    /// queued; whether some still wait.
    pub(super) fn submit_left(&self, group: usize) -> bool {
        self.workers
            .get(group)
            .is_some_and(|w| lock(w).worker.submit_left())
    }
}

/// What a queue group waits for, each with its own poll window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WaitingFor {
    /// Requests: none is in flight.
    Guest,
    /// Transfers of its ring (and maybe jobs too).
    Device,
    /// Only jobs handed to engine threads or the flusher.
    Jobs,
}

/// What a worker thread does when a busy-poll ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterPoll {
    /// Sleep until an event.
    Sleep,
    /// Requests arrived as notifications came back on: poll again.
    PollAgain,
    /// A ring could not be told to notify: sleep, but look again soon.
    SleepBriefly,
}

impl AfterPoll {
    /// What a thread does for two groups' answers: poll again if either
    /// needs it, else sleep briefly if either does.
    pub(super) fn or(self, other: AfterPoll) -> AfterPoll {
        use AfterPoll::*;
        match (self, other) {
            (PollAgain, _) | (_, PollAgain) => PollAgain,
            (SleepBriefly, _) | (_, SleepBriefly) => SleepBriefly,
            _ => Sleep,
        }
    }
}

fn lock(w: &Mutex<WorkerSlot>) -> MutexGuard<'_, WorkerSlot> {
    w.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::blk::DeviceOptions;
    use crate::device::handle::ChainHandle;

    fn backend(dir: &std::path::Path) -> BlkBackend {
        let chain = crate::device::test_support::small_chain(dir, "disk.qcow2");
        let device =
            BlkDevice::new(Arc::new(ChainHandle::new(chain)), DeviceOptions::new(1, 16)).unwrap();
        BlkBackend::new(Arc::new(device), 1).unwrap()
    }

    /// A ring restarted (`kick_now`) and stopped again before its worker
    /// thread took from it, or stopped while requests were left at the
    /// batch size: nothing can be taken until it starts again. Still
    /// marked pending, the thread would poll it without sleeping (epoll
    /// with a zero timeout) for as long as the ring stays stopped.
    #[test]
    fn a_ring_that_cannot_be_taken_from_is_not_left_pending() {
        let dir = tempfile::tempdir().unwrap();
        let backend = backend(dir.path());
        // Requests left at the batch size when the ring stopped.
        lock(&backend.workers[0]).set_pending(0, true);
        assert!(
            !backend.continue_pending(0),
            "a stopped ring stays pending: its worker thread would spin"
        );
        assert!(!backend.has_pending(0));
    }
}
