//! One queue worker: takes requests off its queues and starts them without
//! ever blocking on their I/O, completes them as their parts finish.
//!
//! * Reads: each piece that maps to a data cluster becomes an io_uring
//!   read into guest memory ([`crate::ring`]); zero ranges are zero-filled
//!   in place, compressed clusters decompressed through a bounce buffer.
//! * Writes: pieces landing in clusters the top owns become io_uring
//!   writes from guest memory; so do allocating writes whose new cluster
//!   can be claimed from memory ([`Chain::try_allocating_write`]: a
//!   spare, what lies below known), their copy-on-write read through the
//!   ring first, the cluster linked once written; the rest goes to an
//!   engine thread from a bounce buffer.
//! * Discards and write-zeroes run on an engine thread, flushes on the
//!   flusher ([`crate::offload`]).
//!
//! A request starts with a [`RequestPermit`] (none is given while the
//! device is paused) and holds it until it completes; its data transfers
//! hold a transfer ticket from before their first lookup until the last of
//! them has finished, so a flush never reuses a cluster they still touch.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use slab::Slab;
use sqcow2_format::direct::AlignedBuf;
use sqcow2_format::storage::PinnedFile;
use sqcow2_format::{
    AllocatingWrite, Chain, ExtentKind, GuestOffset, InPlaceTarget, MovedClaim, TransferHold,
    TransferTicket,
};
use tracing::{debug, warn};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddressSpace, GuestMemoryBackend, VolatileSlice};

use crate::device::blk::BlkDevice;
use crate::device::gate::{Admission, RequestPermit};
use crate::device::offload::{EngineWork, Finished, Mailbox, Persist};
use crate::device::request::{self, Request, RequestKind, ZeroRange};
use crate::device::ring::{Direction, OwnBuffer, Ring, RingCompletion, TransferEnd};
use crate::device::stats::{QueueStats, WorkerStats};
use crate::device::throttle::IoKind;
use crate::transport::guest_mem::{GuestBuffer, GuestMem, GuestMemAtomic};
use crate::transport::vring::{add_used_tracked, Tracker};

/// Largest bounce buffer handed to one engine job.
const WRITE_CHUNK: usize = 1 << 20;
/// Most requests in flight on a worker (the one being started included)
/// for it to move an allocating write itself: that saves a thread
/// hand-off, which is what a write at depth 1 waits for; with more in
/// flight, engine threads allocating side by side do better (4 KiB
/// writes, cache=none, fresh top, moved against engine only, interleaved:
/// depth 1 9.8-11.0k against 8.5-10.2k IOPS; moved at up to 4 in flight,
/// depth 4 25.3-27.6k against 28.6-33.7k; always, depth 32 80-102k
/// against 105-112k).
const MOVED_AT_MOST_IN_FLIGHT: usize = 1;
/// Alignment of a copy-on-write's cluster buffer (a page: what direct
/// transfers need, see [`sqcow2_format::direct::DirectFile`]).
const CLUSTER_BUF_ALIGN: usize = 4096;

/// What to leave the guest's notifications (kicks) at after taking
/// requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Notifications {
    /// On, re-checked against requests that arrived meanwhile: the thread
    /// may sleep afterwards.
    Restore,
    /// Off: the thread busy-polls the ring and turns them on before it
    /// sleeps.
    KeepOff,
}

/// What one call took off a queue.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Taken {
    /// Requests taken.
    pub taken: usize,
    /// Completions were put on the used ring on the spot.
    pub used: bool,
    /// The call stopped at the batch size with requests left.
    pub more: bool,
}

/// A request finished: `len` bytes written to the guest's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The worker-local queue index given to [`QueueWorker::process_queue`].
    pub queue: usize,
    /// Head of the request's descriptor chain.
    pub head: u16,
    /// Bytes written into the request's buffers (status byte included).
    pub len: u32,
}

/// A request whose parts are running.
struct InFlight {
    started: Instant,
    queue: usize,
    request: Request,
    /// Keeps the guest mapping alive while parts of the request use it.
    mem: Arc<GuestMem>,
    /// Counts the request as in flight for pauses (and as using the chain
    /// it started on, until [`RequestPermit::leave_chain`]).
    permit: RequestPermit,
    /// Held while data transfers of the request may still run.
    transfer: Option<TransferTicket>,
    /// A live commit's holds of the ring transfers queued (marks of
    /// in-place writes, drained ranges, the base's tickets): dropped once
    /// no ring transfer of the request runs (the data has moved).
    holds: Vec<TransferHold>,
    /// Allocating writes moved through the ring: linked once every ring
    /// transfer of the request is done (given back if one failed).
    allocations: Vec<RingAllocation>,
    /// Parts still being set up (blocks completion while set).
    submitting: bool,
    ring_pending: u32,
    jobs_pending: u32,
    failed: bool,
    short: bool,
    /// Flush once the data is written (write-through cache mode).
    flush_after: bool,
}

/// An allocating write of a request moved through the ring.
struct RingAllocation {
    claim: MovedClaim,
    /// A copy-on-write's write of the whole cluster, queued once the reads
    /// into its buffer (the request's ring transfers before it) are done.
    then_write: Option<ClusterWrite>,
}

/// The write of a copy-on-write's cluster.
struct ClusterWrite {
    file: PinnedFile,
    host: u64,
    buf: Arc<OwnBuffer>,
}

impl InFlight {
    /// Whether the request, all its parts set up and its ring transfers
    /// done, may stop counting as using the chain it started on: its
    /// engine jobs are given the chain when they begin, and what it may
    /// still do here afterwards (a write-through flush, a short read read
    /// again) takes the chain current then. A flush request too, once
    /// handed to the flusher: whichever chain the flusher flushes covers
    /// it (the old one, or the new one, which flushes the old top until
    /// it is closed).
    fn may_leave_chain(&self) -> bool {
        !self.submitting
            && self.ring_pending == 0
            && self.allocations.is_empty()
            && !matches!(self.request.kind, RequestKind::GetId { .. })
    }
}

/// The engine of one worker thread.
pub struct QueueWorker {
    device: Arc<BlkDevice>,
    ring: Ring,
    mailbox: Mailbox,
    /// Requests whose parts are running, by slot.
    slots: Slab<InFlight>,
    completed: Vec<Completion>,
    /// Finished transfers not yet applied to their requests.
    ring_done: Vec<RingCompletion>,
    /// Jobs handed off and not yet answered.
    jobs_outstanding: usize,
    /// The slot being started, if any (failed if a panic interrupts it).
    starting: Option<usize>,
    /// Requests were left on a queue while the device was paused.
    deferred: bool,
    /// A request taken that waits for the export's limits: no queue of
    /// this worker is taken from until it starts.
    parked: Option<Parked>,
    /// Most requests taken off a queue in one call ([`Taken::more`] says
    /// when requests were left).
    batch: usize,
    stats: WorkerStats,
}

impl std::fmt::Debug for QueueWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueWorker")
            .field("in_flight", &self.slots.len())
            .finish()
    }
}

/// The status code and used length of a finished request.
struct Outcome {
    code: u32,
    data_len: u32,
}

impl Outcome {
    fn ok(data_len: u32) -> Self {
        Outcome {
            code: VIRTIO_BLK_S_OK,
            data_len,
        }
    }
    fn ioerr() -> Self {
        Outcome {
            code: VIRTIO_BLK_S_IOERR,
            data_len: 0,
        }
    }
}

/// Why a transfer could not be set up.
#[derive(Debug, thiserror::Error)]
enum TransferError {
    #[error("guest buffer outside guest memory")]
    Memory,
    #[error(transparent)]
    Chain(#[from] sqcow2_format::Error),
    #[error("io_uring: {0}")]
    Ring(io::Error),
    #[error("engine threads stopped")]
    Offload,
}

impl QueueWorker {
    /// A worker for `device` with its own io_uring and mailbox.
    pub fn new(device: Arc<BlkDevice>) -> io::Result<Self> {
        let mailbox = Mailbox::new()?;
        device.gate().add_waker(mailbox.wake_fd().clone());
        Ok(QueueWorker {
            device,
            ring: Ring::new()?,
            mailbox,
            slots: Slab::new(),
            completed: Vec::new(),
            ring_done: Vec::new(),
            jobs_outstanding: 0,
            starting: None,
            deferred: false,
            parked: None,
            batch: usize::MAX,
            stats: WorkerStats::default(),
        })
    }

    /// The eventfd that becomes readable when io_uring completions wait.
    pub fn completion_fd(&self) -> &vmm_sys_util::eventfd::EventFd {
        self.ring.event_fd()
    }

    /// The eventfd that becomes readable when engine results wait or the
    /// device resumes after a pause.
    pub fn mailbox_fd(&self) -> &vmm_sys_util::eventfd::EventFd {
        self.mailbox.wake_fd()
    }

    /// Takes at most `batch` requests off a queue per call, so that the
    /// completions of the first ones reach the guest while it still has
    /// requests to send (one batch of a whole queue depth makes the guest
    /// and the worker wait for each other in turn).
    pub fn set_batch(&mut self, batch: usize) {
        self.batch = batch.max(1);
    }

    /// Takes finished transfers and engine results without waiting or
    /// clearing any eventfd (a busy-poll step); whether there were any.
    pub fn poll_finished(&mut self) -> bool {
        // A new round (the clock is read only if something completes).
        self.stats.next_round();
        self.ring.reap(&mut self.ring_done);
        let ring = !self.ring_done.is_empty();
        self.apply_ring_completions();
        let mut jobs = false;
        while let Some(finished) = self.mailbox.try_take() {
            jobs = true;
            self.job_done(finished);
        }
        ring || jobs
    }

    /// Whether requests wait on a queue for a pause to end (taken when
    /// the mailbox says it has).
    pub fn is_deferred(&self) -> bool {
        self.deferred
    }

    /// Requests taken whose I/O is still running or has not begun (one
    /// parked for the limits counts: a ring stop waits for it).
    pub fn in_flight(&self) -> usize {
        self.slots.len() + usize::from(self.parked.is_some())
    }

    /// Whether every request in flight waits only for handed-off jobs (no
    /// transfer of this thread's ring runs).
    pub(crate) fn waits_only_for_jobs(&self) -> bool {
        self.jobs_outstanding > 0 && self.ring.is_empty()
    }

    /// Statistics of this worker's queues, by worker-local queue index.
    pub fn stats(&self) -> &[QueueStats] {
        self.stats.queues()
    }

    /// Requests completed since the last call.
    pub fn take_completions(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.completed)
    }

    #[cfg(any(test, feature = "internals"))]
    /// Takes every available request off `queue` and starts it; requests
    /// finished on the spot are put on the used ring at once. Returns
    /// whether any was. `queue_index` names the queue in [`Completion`]s.
    /// While the device is paused requests stay on the queue; they are
    /// taken once [`QueueWorker::handle_mailbox_event`] says so.
    pub fn process_queue(
        &mut self,
        queue_index: usize,
        queue: &mut Queue,
        mem: &GuestMemAtomic,
    ) -> io::Result<bool> {
        let batch = std::mem::replace(&mut self.batch, usize::MAX);
        let taken = self.process_tracked(queue_index, queue, None, mem, Notifications::Restore);
        self.batch = batch;
        taken.map(|t| t.used)
    }

    /// [`QueueWorker::process_queue`] for at most one batch, with the
    /// queue's inflight tracking (requests to resubmit first, every
    /// request taken recorded); `notifications` says what to leave the
    /// guest's notifications at.
    pub(crate) fn process_tracked(
        &mut self,
        queue_index: usize,
        queue: &mut Queue,
        mut tracker: Option<&mut Tracker>,
        mem: &GuestMemAtomic,
        notifications: Notifications,
    ) -> io::Result<Taken> {
        self.stats.next_round();
        let mem = mem.memory().into_inner();
        let mut taken = Taken::default();
        if let Some(t) = tracker.as_deref_mut() {
            taken.used = self.resubmit(queue_index, queue, t, &mem)?;
        }
        let popped = self.pop_all(queue_index, queue, tracker, &mem, notifications, &mut taken);
        // Transfers queued so far go to the kernel even if the ring failed.
        let submitted = self.ring.submit();
        self.stats.next_round();
        self.apply_ring_completions();
        popped?;
        submitted?;
        Ok(taken)
    }

    /// Starts the requests a previous backend took and never completed,
    /// in the order it took them; whether any completed at once.
    fn resubmit(
        &mut self,
        queue_index: usize,
        queue: &mut Queue,
        tracker: &mut Tracker,
        mem: &Arc<GuestMem>,
    ) -> io::Result<bool> {
        let limits = self.device.limits();
        let mut used = false;
        while let Some(head) = tracker.resubmit.front().copied() {
            let admission = self.device.gate().try_start();
            if let Admission::Wait = admission {
                self.deferred = true;
                break;
            }
            tracker.resubmit.pop_front();
            let table = vm_memory::GuestAddress(queue.desc_table());
            let parsed = request::parse(mem, table, queue.size(), head, &limits);
            debug!(
                queue = queue_index,
                head, "resubmitting a request taken before a restart"
            );
            if let Some(c) = self.admit(queue_index, parsed, admission, mem) {
                add_used_tracked(queue, Some(tracker), mem, c.head, c.len)
                    .map_err(io::Error::other)?;
                used = true;
            }
        }
        Ok(used)
    }

    /// Starts a parsed request, or answers it at once; its completion if
    /// it finished already.
    fn admit(
        &mut self,
        queue_index: usize,
        parsed: Result<Request, request::Rejected>,
        admission: Admission,
        mem: &Arc<GuestMem>,
    ) -> Option<Completion> {
        match (parsed, admission) {
            (Ok(req), Admission::Start(permit)) => self.start(queue_index, req, mem, permit),
            (Ok(req), _) => {
                // Inactive too long: the request fails.
                let now = self.stats.now();
                self.stats
                    .account(queue_index, &req, VIRTIO_BLK_S_IOERR, now);
                Some(finish(queue_index, &req, Outcome::ioerr(), mem))
            }
            (Err(rejected), _) => {
                self.stats.account_rejected(queue_index);
                debug!(
                    reason = rejected.reason,
                    head = rejected.head,
                    "request rejected"
                );
                let len = match rejected.status {
                    Some(addr) => u32::from(mem.write_obj(rejected.code, addr).is_ok()),
                    None => 0,
                };
                Some(Completion {
                    queue: queue_index,
                    head: rejected.head,
                    len,
                })
            }
        }
    }

    /// When the parked request may be looked at again, if one waits.
    /// `None` while it waits for the gate instead (a pause: the mailbox
    /// wakes the worker when it ends).
    pub(crate) fn parked_until(&self) -> Option<Instant> {
        self.parked
            .as_ref()
            .filter(|_| !self.deferred)
            .map(|p| p.until)
    }

    /// The worker-local queue of the parked request, if it may be looked
    /// at again: its time has come, the limits changed since it was
    /// parked, or it must start whatever the limits (a stop, a ring
    /// stopping).
    pub(crate) fn parked_due(&self) -> Option<usize> {
        let p = self.parked.as_ref()?;
        (Instant::now() >= p.until || self.parked_released(p)).then_some(p.queue)
    }

    /// Whether `p` may start whatever its wait (the limits lifted for a
    /// stop or a ring stopping, or changed since it was parked).
    fn parked_released(&self, p: &Parked) -> bool {
        let throttle = self.device.throttle();
        p.force || throttle.bypassing() || throttle.generation() != p.generation
    }

    /// The parked request starts at its next look whatever the limits,
    /// as QEMU's drain restarts throttled requests (its ring stops);
    /// whether one is parked.
    pub(crate) fn force_parked(&mut self) -> bool {
        match &mut self.parked {
            Some(p) => {
                p.force = true;
                true
            }
            None => false,
        }
    }

    /// Starts the request parked from `queue_index` if the limits let it
    /// now (and the gate does); whether none waits any more.
    fn start_parked(
        &mut self,
        queue_index: usize,
        queue: &mut Queue,
        tracker: Option<&Tracker>,
        mem: &Arc<GuestMem>,
        out: &mut Taken,
    ) -> io::Result<bool> {
        let Some(p) = &mut self.parked else {
            return Ok(true);
        };
        if p.queue != queue_index {
            return Ok(false);
        }
        let now = Instant::now();
        let throttle = self.device.throttle();
        let (force, released) = (p.force, throttle.bypassing() || p.force);
        if now < p.until && !released && throttle.generation() == p.generation {
            return Ok(false);
        }
        p.generation = throttle.generation();
        if !force {
            if let Some(wait) = throttle.wait(p.direction) {
                p.until = now + wait;
                return Ok(false);
            }
        }
        let admission = self.device.gate().try_start();
        if let Admission::Wait = admission {
            self.deferred = true;
            return Ok(false);
        }
        let Some(p) = self.parked.take() else {
            return Ok(true);
        };
        throttle.account(p.direction, p.bytes);
        throttle.waited(p.since.elapsed());
        if let Some(c) = self.admit(queue_index, Ok(p.request), admission, mem) {
            add_used_tracked(queue, tracker, mem, c.head, c.len).map_err(io::Error::other)?;
            out.used = true;
        }
        Ok(true)
    }

    /// Starts only the request parked from `queue_index` (its ring
    /// stops: no other is taken), with the ring's inflight tracking.
    pub(crate) fn start_parked_only(
        &mut self,
        queue_index: usize,
        queue: &mut Queue,
        tracker: Option<&mut Tracker>,
        mem: &GuestMemAtomic,
    ) -> io::Result<Taken> {
        let mem = mem.memory().into_inner();
        let mut taken = Taken::default();
        let started = self.start_parked(queue_index, queue, tracker.as_deref(), &mem, &mut taken);
        let submitted = self.ring.submit();
        self.apply_ring_completions();
        started?;
        submitted?;
        Ok(taken)
    }

    fn pop_all(
        &mut self,
        queue_index: usize,
        queue: &mut Queue,
        mut tracker: Option<&mut Tracker>,
        mem: &Arc<GuestMem>,
        notifications: Notifications,
        out: &mut Taken,
    ) -> io::Result<()> {
        let limits = self.device.limits();
        if !self.start_parked(queue_index, queue, tracker.as_deref(), mem, out)? {
            // Waits for the limits (or the gate): the queue keeps the rest.
            return Ok(());
        }
        loop {
            queue
                .disable_notification(&**mem)
                .map_err(io::Error::other)?;
            loop {
                if out.taken == self.batch {
                    // The rest in the next call, notifications still off.
                    out.more = queue
                        .avail_idx(&**mem, std::sync::atomic::Ordering::Acquire)
                        .map_err(io::Error::other)?
                        .0
                        != queue.next_avail();
                    if out.more || notifications == Notifications::KeepOff {
                        return Ok(());
                    }
                    break;
                }
                let admission = self.device.gate().try_start();
                if let Admission::Wait = admission {
                    self.deferred = true;
                    break;
                }
                // Not `pop_descriptor_chain`, which logs and hides an
                // available index more than a queue ahead (the caller
                // would look again and again).
                let head = queue
                    .iter(&**mem)
                    .map_err(io::Error::other)?
                    .next()
                    .map(|chain| chain.head_index());
                let Some(head) = head else {
                    break;
                };
                out.taken += 1;
                if let Some(t) = tracker.as_deref_mut() {
                    // Recorded before it starts: a restart resubmits it.
                    t.taken(head);
                }
                let table = vm_memory::GuestAddress(queue.desc_table());
                let parsed = request::parse(mem, table, queue.size(), head, &limits);
                let parsed = match parsed {
                    Ok(req) => match self.throttled(queue_index, req) {
                        Some(req) => Ok(req),
                        None => {
                            // Parked without its permit (a pause does not
                            // wait for it); the rest stays on the queue,
                            // the guest's notifications off until then.
                            drop(admission);
                            return Ok(());
                        }
                    },
                    Err(rejected) => Err(rejected),
                };
                if let Some(c) = self.admit(queue_index, parsed, admission, mem) {
                    add_used_tracked(queue, tracker.as_deref(), mem, c.head, c.len)
                        .map_err(io::Error::other)?;
                    out.used = true;
                }
            }
            if notifications == Notifications::KeepOff {
                // The thread looks at the ring anyway, and asks for
                // notifications again before it sleeps.
                return Ok(());
            }
            // Requests that arrived before notifications were on again are
            // taken now, or the guest, which saw them off, never kicks.
            let more = queue
                .enable_notification(&**mem)
                .map_err(io::Error::other)?;
            if !more || self.deferred || out.taken == self.batch {
                out.more = more && !self.deferred;
                return Ok(());
            }
        }
    }

    /// `req` if the export's limits let it start now (counted), else
    /// `None`: parked until they do.
    fn throttled(&mut self, queue_index: usize, req: Request) -> Option<Request> {
        let Some((direction, bytes)) = limited_as(&req.kind) else {
            return Some(req);
        };
        let throttle = self.device.throttle();
        match throttle.wait(direction) {
            None => {
                throttle.account(direction, bytes);
                Some(req)
            }
            Some(wait) => {
                let now = Instant::now();
                self.parked = Some(Parked {
                    queue: queue_index,
                    request: req,
                    direction,
                    bytes,
                    since: now,
                    until: now + wait,
                    generation: throttle.generation(),
                    force: false,
                });
                None
            }
        }
    }

    /// Starts one request; returns its completion if it finished already.
    fn start(
        &mut self,
        queue: usize,
        req: Request,
        mem: &Arc<GuestMem>,
        permit: RequestPermit,
    ) -> Option<Completion> {
        let started = self.stats.now();
        let outcome = match &req.kind {
            RequestKind::In { .. } | RequestKind::Out { .. } => {
                return self.start_transfer(queue, req, mem, permit, started)
            }
            RequestKind::Flush | RequestKind::Discard(_) | RequestKind::WriteZeroes(_) => {
                return self.start_offloaded(queue, req, mem, permit, started)
            }
            RequestKind::GetId { buffers } => self.get_id(buffers, mem),
        };
        self.stats.account(queue, &req, outcome.code, started);
        Some(finish(queue, &req, outcome, mem))
    }

    fn new_slot(
        &mut self,
        queue: usize,
        request: Request,
        mem: &Arc<GuestMem>,
        permit: RequestPermit,
        started: Instant,
        transfer: Option<TransferTicket>,
    ) -> usize {
        let flush_after = !self.device.writeback()
            && matches!(
                request.kind,
                RequestKind::Out { .. } | RequestKind::Discard(_) | RequestKind::WriteZeroes(_)
            );
        self.slots.insert(InFlight {
            started,
            queue,
            request,
            mem: mem.clone(),
            permit,
            transfer,
            submitting: true,
            ring_pending: 0,
            holds: Vec::new(),
            allocations: Vec::new(),
            jobs_pending: 0,
            failed: false,
            short: false,
            flush_after,
        })
    }

    /// Starts a read or a write whose data moves between the image files
    /// and guest memory.
    fn start_transfer(
        &mut self,
        queue: usize,
        req: Request,
        mem: &Arc<GuestMem>,
        permit: RequestPermit,
        started: Instant,
    ) -> Option<Completion> {
        // One chain for the ring transfers of the whole request (a switch
        // of the chain waits for them; engine jobs get the chain current
        // when they begin).
        let chain = self.device.chain();
        let ticket = chain.transfers().begin();
        let kind = req.kind.clone();
        let slot = self.new_slot(queue, req, mem, permit, started, Some(ticket));
        self.starting = Some(slot);
        let result = match &kind {
            RequestKind::In {
                offset, buffers, ..
            } => self.submit_reads(&chain, slot, *offset, buffers, mem),
            RequestKind::Out {
                offset, buffers, ..
            } => self.submit_writes(&chain, slot, *offset, buffers, mem),
            _ => Ok(()),
        };
        if let Err(e) = &result {
            crate::limited_warn!("{}: {e}", describe(&kind));
        }
        self.starting = None;
        self.submitted(slot, result.is_err())
    }

    /// Starts a flush, discard or write-zeroes on the engine side.
    fn start_offloaded(
        &mut self,
        queue: usize,
        req: Request,
        mem: &Arc<GuestMem>,
        permit: RequestPermit,
        started: Instant,
    ) -> Option<Completion> {
        let kind = req.kind.clone();
        let slot = self.new_slot(queue, req, mem, permit, started, None);
        let sent = match kind {
            RequestKind::Flush => {
                if let Some(f) = self.slots.get_mut(slot) {
                    // The flush is the request itself.
                    f.flush_after = false;
                }
                self.send_flush(slot)
            }
            RequestKind::Discard(ranges) => self.send_mapping_job(slot, zero_job(ranges, false)),
            RequestKind::WriteZeroes(ranges) => self.send_mapping_job(slot, zero_job(ranges, true)),
            _ => Ok(()),
        };
        if let Err(e) = &sent {
            crate::limited_warn!("{}: {e}", describe(&kind_of(&self.slots, slot)));
        }
        self.submitted(slot, sent.is_err())
    }

    /// Hands off a job that may change mappings: its result comes back
    /// once they are published (in the file), so that the request's
    /// completion survives a death of the daemon.
    fn send_mapping_job(
        &mut self,
        slot: usize,
        work: impl EngineWork,
    ) -> Result<(), TransferError> {
        self.run_job(slot, true, work)
    }

    /// Counts a job handed off for the request in `slot`.
    fn handed_off(&mut self, slot: usize) {
        self.jobs_outstanding += 1;
        if let Some(f) = self.slots.get_mut(slot) {
            f.jobs_pending += 1;
        }
    }

    fn send_flush(&mut self, slot: usize) -> Result<(), TransferError> {
        self.send_persist(slot, Persist::Flush)
    }

    fn send_persist(&mut self, slot: usize, what: Persist) -> Result<(), TransferError> {
        self.device
            .offload()
            .persist(self.mailbox.address(slot), what)
            .map_err(|_| TransferError::Offload)?;
        self.handed_off(slot);
        Ok(())
    }

    /// The request in `slot` has all its parts set up.
    fn submitted(&mut self, slot: usize, failed: bool) -> Option<Completion> {
        let f = self.slots.get_mut(slot)?;
        f.submitting = false;
        f.failed |= failed;
        self.progress(slot)
    }

    /// Moves the request in `slot` on once its running parts are done:
    /// drops its transfer ticket, flushes (write-through), completes.
    fn progress(&mut self, slot: usize) -> Option<Completion> {
        let f = self.slots.get_mut(slot)?;
        if f.submitting || f.ring_pending > 0 {
            return None;
        }
        if !f.allocations.is_empty() {
            // Jobs it hands off (a publish, a refill) are waited for
            // below, as any other: the request may leave the chain then.
            self.move_allocations_on(slot);
        }
        let f = self.slots.get_mut(slot)?;
        if f.ring_pending > 0 {
            return None;
        }
        f.holds.clear();
        if f.jobs_pending > 0 {
            if f.may_leave_chain() {
                // What is left are engine jobs, which look the chain up
                // when they begin: a switch need not wait for them.
                f.transfer = None;
                f.permit.leave_chain();
            }
            return None;
        }
        // No transfer of the request runs any more.
        f.transfer = None;
        let flush = f.flush_after && !f.failed;
        f.flush_after = false;
        if flush {
            match self.send_flush(slot) {
                Ok(()) => return None,
                Err(e) => {
                    crate::limited_warn!("flush before completing: {e}");
                    if let Some(f) = self.slots.get_mut(slot) {
                        f.failed = true;
                    }
                }
            }
        }
        self.retire(slot)
    }

    /// The allocating writes of the request in `slot`, its ring transfers
    /// all done: queues the cluster writes of copies-on-write whose reads
    /// are done, or, all data written, links the clusters (gives them
    /// back if a transfer failed), asking for the publish (unjournaled) or
    /// the spares' refill that follows.
    fn move_allocations_on(&mut self, slot: usize) {
        let Some(f) = self.slots.get_mut(slot) else {
            return;
        };
        if f.failed || f.short {
            // (A write that ended short left part of a cluster unwritten:
            // reading as the spare's zeros, not as below.) Nothing runs in
            // their clusters any more.
            f.allocations.clear();
            return;
        }
        let writes: Vec<ClusterWrite> = f
            .allocations
            .iter_mut()
            .filter_map(|a| a.then_write.take())
            .collect();
        if !writes.is_empty() {
            let mem = f.mem.clone();
            for w in writes {
                let len = w.buf.len();
                let queued = self.ring.queue_own(
                    slot,
                    Direction::Write,
                    w.file,
                    w.host,
                    &w.buf,
                    0,
                    len,
                    &mem,
                    &mut self.ring_done,
                );
                self.queued_own(slot, queued, "a copy-on-write's cluster");
            }
            self.submit_own(slot);
            return;
        }
        let (mut linked, mut refill) = (false, false);
        for a in std::mem::take(&mut f.allocations) {
            match a.claim.link() {
                Ok(l) => {
                    linked = true;
                    refill |= l.refill_spares;
                }
                Err(e) => {
                    crate::limited_warn!("linking a written cluster: {e}");
                    f.failed = true;
                }
            }
        }
        if refill {
            // Before the request completes, as an engine's allocating write
            // refills: in the background instead, refills lagged and more
            // writes found no spare (depth 1, cache=none: 7.1-8.7k against
            // 9.0-9.4k IOPS, interleaved). If it cannot be sent, the next
            // allocations go to the engine, which refills.
            let _ = self.run_job(slot, false, |chain: &Chain| {
                chain.refill_spares();
                Ok(())
            });
        }
        if linked {
            let chain = self.device.chain();
            // Completed only once its mapping is in the file, unless
            // journaled.
            if self.device.offload().after_worker_change(&chain)
                && self.send_persist(slot, Persist::Publish).is_err()
            {
                if let Some(f) = self.slots.get_mut(slot) {
                    f.failed = true;
                }
            }
        }
    }

    /// Counts a transfer of the worker's own buffer queued for `slot`, or
    /// fails the request if it could not be (`what` it was).
    fn queued_own(&mut self, slot: usize, queued: io::Result<()>, what: &str) {
        match queued {
            Ok(()) => self.ring_queued(slot),
            Err(e) => {
                crate::limited_warn!("queueing {what}: {e}");
                if let Some(f) = self.slots.get_mut(slot) {
                    f.failed = true;
                }
            }
        }
    }

    /// Hands what [`QueueWorker::move_allocations_on`] queued to the
    /// kernel now: it runs as transfers complete, and nothing else submits
    /// until the next request is taken, which a guest waiting for this one
    /// may never send (a failed submit is retried before the thread
    /// sleeps). If nothing could be queued, the next step at once.
    fn submit_own(&mut self, slot: usize) {
        if let Err(e) = self.ring.submit() {
            crate::limited_warn!("submitting an allocating write's transfers: {e}");
        }
        if self.slots.get(slot).is_some_and(|f| f.ring_pending == 0) {
            self.move_allocations_on(slot);
        }
    }

    /// Moves the piece `src` of a write at `pos` (within one cluster)
    /// through the ring as an allocating write, if its cluster can be
    /// claimed from memory; `false`: the engine's.
    fn try_moved_allocation(
        &mut self,
        chain: &Arc<Chain>,
        slot: usize,
        pos: u64,
        src: &VolatileSlice<'_, ()>,
        mem: &Arc<GuestMem>,
    ) -> Result<bool, TransferError> {
        if self.slots.len() > MOVED_AT_MOST_IN_FLIGHT {
            return Ok(false);
        }
        let Some(ticket) = self.slots.get(slot).and_then(|f| f.transfer.as_ref()) else {
            return Ok(false);
        };
        let Some(write) = chain.try_allocating_write(ticket, GuestOffset(pos), src.len() as u64)?
        else {
            return Ok(false);
        };
        let AllocatingWrite {
            host,
            file,
            copy,
            claim,
        } = write;
        let Some(f) = self.slots.get_mut(slot) else {
            return Ok(false);
        };
        let Some(copy) = copy else {
            // Kept with the request before its data moves: given back (if
            // at all) only once no transfer writes into the cluster.
            f.allocations.push(RingAllocation {
                claim,
                then_write: None,
            });
            self.ring
                .queue(
                    slot,
                    Direction::Write,
                    file,
                    host.0,
                    src,
                    mem,
                    &mut self.ring_done,
                )
                .map_err(TransferError::Ring)?;
            self.ring_queued(slot);
            return Ok(true);
        };
        let mut buf = AlignedBuf::zeroed(copy.cluster_size as usize, CLUSTER_BUF_ALIGN)
            .map_err(TransferError::Ring)?;
        let at = copy.guest_at as usize;
        src.copy_to(&mut buf.as_mut_slice()[at..at + src.len()]);
        let buf = OwnBuffer::share(buf);
        f.allocations.push(RingAllocation {
            claim,
            then_write: Some(ClusterWrite {
                file,
                host: copy.cluster.0,
                buf: buf.clone(),
            }),
        });
        for r in copy.reads {
            self.ring
                .queue_own(
                    slot,
                    Direction::Read,
                    r.file,
                    r.host.0,
                    &buf,
                    r.at as usize,
                    r.len as usize,
                    mem,
                    &mut self.ring_done,
                )
                .map_err(TransferError::Ring)?;
            self.ring_queued(slot);
        }
        Ok(true)
    }

    /// Queues io_uring writes for the pieces of `[offset, ..)` that land
    /// in clusters the top owns, or in new clusters claimed from memory;
    /// the rest goes to engine threads from bounce buffers.
    fn submit_writes(
        &mut self,
        chain: &Arc<Chain>,
        slot: usize,
        offset: u64,
        buffers: &[GuestBuffer],
        mem: &Arc<GuestMem>,
    ) -> Result<(), TransferError> {
        let cluster = chain.cluster_size();
        let end = offset + buffers.iter().map(|b| u64::from(b.len)).sum::<u64>();
        let mut bounce = Bounce::default();
        let mut pos = offset;
        for piece in host_slices(mem, buffers) {
            let piece = piece?;
            let mut done = 0usize;
            while done < piece.len() {
                let n = ((piece.len() - done) as u64).min(cluster - pos % cluster) as usize;
                let src = piece.subslice(done, n).map_err(|_| TransferError::Memory)?;
                let target = match self.slots.get(slot).and_then(|f| f.transfer.as_ref()) {
                    // Never waiting for metadata here: a miss goes to the
                    // engine with the rest of the write.
                    Some(ticket) => {
                        chain
                            .transfers()
                            .try_in_place_target(ticket, GuestOffset(pos), n as u64)?
                    }
                    None => None,
                };
                match target {
                    Some(InPlaceTarget {
                        host,
                        file: Some(file),
                        hold,
                    }) => {
                        if let (Some(h), Some(f)) = (hold, self.slots.get_mut(slot)) {
                            f.holds.push(h);
                        }
                        // The bounce buffer holds one contiguous range.
                        self.write_through_engine(slot, &mut bounce)?;
                        self.ring
                            .queue(
                                slot,
                                Direction::Write,
                                file,
                                host.0,
                                &src,
                                mem,
                                &mut self.ring_done,
                            )
                            .map_err(TransferError::Ring)?;
                        self.ring_queued(slot);
                    }
                    _ => {
                        // The bounce buffer holds one contiguous range; a
                        // cluster the next piece continues (guest memory
                        // in pages) is the engine's, whole.
                        let whole = pos + n as u64 == end.min((pos / cluster + 1) * cluster);
                        if bounce.data.is_empty()
                            && whole
                            && self.try_moved_allocation(chain, slot, pos, &src, mem)?
                        {
                            // Moved through the ring.
                        } else {
                            bounce.append(pos, &src);
                            if bounce.data.len() >= WRITE_CHUNK {
                                self.write_through_engine(slot, &mut bounce)?;
                            }
                        }
                    }
                }
                done += n;
                pos += n as u64;
            }
        }
        self.write_through_engine(slot, &mut bounce)
    }

    /// Hands the bounce buffer's data to an engine thread.
    fn write_through_engine(
        &mut self,
        slot: usize,
        bounce: &mut Bounce,
    ) -> Result<(), TransferError> {
        if bounce.data.is_empty() {
            return Ok(());
        }
        let data = std::mem::take(&mut bounce.data);
        let start = bounce.start;
        self.send_mapping_job(slot, move |chain: &Chain| {
            chain
                .write_at(&data, start)
                .map_err(|e| format!("write at {start}: {e}"))
        })
    }

    /// Queues the io_uring reads of `[offset, ..)` into `buffers`; fills
    /// zero ranges on the spot. The rest of the request goes to an engine
    /// thread from the first piece that cannot be read that way: its
    /// mapping would need a metadata read (a cache miss: this thread never
    /// waits for one), or it is compressed.
    fn submit_reads(
        &mut self,
        chain: &Chain,
        slot: usize,
        offset: u64,
        buffers: &[GuestBuffer],
        mem: &Arc<GuestMem>,
    ) -> Result<(), TransferError> {
        let mut pos = offset;
        for piece in host_slices(mem, buffers) {
            let piece = piece?;
            let mut done = 0usize;
            while done < piece.len() {
                let want = (piece.len() - done) as u64;
                let Some(ticket) = self.slots.get(slot).and_then(|f| f.transfer.as_ref()) else {
                    return Err(TransferError::Memory);
                };
                let read =
                    match chain
                        .transfers()
                        .try_resolve_for_read(ticket, GuestOffset(pos), want)?
                    {
                        Some(read) => read,
                        None => return self.read_through_engine(slot, offset, pos, buffers, mem),
                    };
                let n = read.extent.len.min(want) as usize;
                let dst = piece.subslice(done, n).map_err(|_| TransferError::Memory)?;
                if let (Some(h), Some(f)) = (read.hold, self.slots.get_mut(slot)) {
                    f.holds.push(h);
                }
                match (read.extent.kind, read.file) {
                    (ExtentKind::Zero { .. }, _) => fill_zero(&dst),
                    (ExtentKind::Data { host }, Some(file)) => {
                        self.ring
                            .queue(
                                slot,
                                Direction::Read,
                                file,
                                host.0,
                                &dst,
                                mem,
                                &mut self.ring_done,
                            )
                            .map_err(TransferError::Ring)?;
                        self.ring_queued(slot);
                    }
                    // Compressed clusters, storage without a file.
                    _ => return self.read_through_engine(slot, offset, pos, buffers, mem),
                }
                done += n;
                pos += n as u64;
            }
        }
        Ok(())
    }

    /// Hands the read of `[pos, end of request)` to an engine thread: it
    /// reads through the chain (waiting for metadata as needed) into a
    /// bounce buffer and copies it into the request's buffers, from the
    /// byte of `buffers` that `pos` maps to (`offset` is the request's
    /// first byte).
    fn read_through_engine(
        &mut self,
        slot: usize,
        offset: u64,
        pos: u64,
        buffers: &[GuestBuffer],
        mem: &Arc<GuestMem>,
    ) -> Result<(), TransferError> {
        let total: u64 = buffers.iter().map(|b| u64::from(b.len)).sum();
        let skip = pos - offset;
        let len = usize::try_from(total - skip).map_err(|_| TransferError::Memory)?;
        let (mem, buffers) = (mem.clone(), buffers.to_vec());
        self.send_job(slot, move |chain: &Chain| {
            let mut data = vec![0u8; len];
            chain
                .read_at(&mut data, pos)
                .map_err(|e| format!("read at {pos}: {e}"))?;
            scatter(&mem, &buffers, skip, &data).map_err(|e| format!("copy into guest memory: {e}"))
        })
    }

    /// Hands off a job that changes no mapping.
    fn send_job(&mut self, slot: usize, work: impl EngineWork) -> Result<(), TransferError> {
        self.run_job(slot, false, work)
    }

    /// Hands `work` of the request in `slot` to an engine thread (it
    /// begins once no switch of the chain is held).
    fn run_job(
        &mut self,
        slot: usize,
        publish: bool,
        work: impl EngineWork,
    ) -> Result<(), TransferError> {
        let ticket = self
            .slots
            .get(slot)
            .map(|f| f.permit.deferred_work())
            .ok_or(TransferError::Offload)?;
        self.device
            .offload()
            .run(self.mailbox.address(slot), ticket, publish, work)
            .map_err(|_| TransferError::Offload)?;
        self.handed_off(slot);
        Ok(())
    }

    fn ring_queued(&mut self, slot: usize) {
        if let Some(f) = self.slots.get_mut(slot) {
            f.ring_pending += 1;
        }
    }

    /// Submits transfers a failed submit left queued; whether some still
    /// wait (the thread must not sleep until a completion then: none may
    /// come).
    pub fn submit_left(&mut self) -> bool {
        self.ring.submit_left()
    }

    /// Clears the completion eventfd and handles every completion waiting.
    pub fn handle_completion_event(&mut self) {
        self.ring.clear_event();
        self.reap_ready();
    }

    /// Handles the completions already in the ring, without waiting.
    pub fn reap_ready(&mut self) {
        self.stats.next_round();
        self.ring.reap(&mut self.ring_done);
        self.apply_ring_completions();
    }

    fn apply_ring_completions(&mut self) {
        for c in std::mem::take(&mut self.ring_done) {
            if let Some(f) = self.slots.get_mut(c.slot) {
                f.ring_pending = f.ring_pending.saturating_sub(1);
                match c.end {
                    TransferEnd::Done => {}
                    TransferEnd::Short => f.short = true,
                    TransferEnd::Failed => f.failed = true,
                }
            }
            if let Some(done) = self.progress(c.slot) {
                self.completed.push(done);
            }
        }
    }

    /// Handles the results of handed-off jobs; returns whether the queues
    /// must be looked at again (requests were left there during a pause
    /// that has ended).
    pub fn handle_mailbox_event(&mut self) -> bool {
        self.stats.next_round();
        for finished in self.mailbox.take() {
            self.job_done(finished);
        }
        self.resume_after_pause()
    }

    /// Whether requests left on the queues during a pause may be taken
    /// now (the pause ended, or the device refuses requests and they must
    /// be answered); clears the deferral then.
    pub fn resume_after_pause(&mut self) -> bool {
        let gate = self.device.gate();
        if self.deferred && (!gate.is_paused() || gate.is_refusing()) {
            self.deferred = false;
            return true;
        }
        false
    }

    fn job_done(&mut self, finished: Finished) {
        self.jobs_outstanding = self.jobs_outstanding.saturating_sub(1);
        let Finished { slot, result } = finished;
        if let Some(f) = self.slots.get_mut(slot) {
            f.jobs_pending = f.jobs_pending.saturating_sub(1);
            if let Err(e) = result {
                crate::limited_warn!("{}: {e}", describe(&f.request.kind));
                f.failed = true;
            }
        }
        if let Some(done) = self.progress(slot) {
            self.completed.push(done);
        }
    }

    /// Recovers after a panic in this worker (a bug): the request being
    /// started fails once its running parts have finished; requests whose
    /// parts can no longer finish fail now.
    pub fn recover_after_panic(&mut self) {
        self.stats.next_round();
        if let Some(slot) = self.starting.take() {
            if let Some(c) = self.submitted(slot, true) {
                self.completed.push(c);
            }
        }
        self.fail_orphans();
    }

    /// Fails the requests in flight when nothing is left that could
    /// complete them (no transfer in the ring, no job handed off).
    fn fail_orphans(&mut self) {
        if !self.ring.is_empty() || self.jobs_outstanding > 0 || self.slots.is_empty() {
            return;
        }
        let orphans: Vec<usize> = self.slots.iter().map(|(slot, _)| slot).collect();
        warn!(
            requests = orphans.len(),
            "failing requests with no I/O left"
        );
        for slot in orphans {
            if let Some(f) = self.slots.get_mut(slot) {
                f.failed = true;
                f.submitting = false;
                f.ring_pending = 0;
                f.jobs_pending = 0;
                f.flush_after = false;
            }
            if let Some(c) = self.retire(slot) {
                self.completed.push(c);
            }
        }
    }

    /// Completes the request in `slot` (its parts are done).
    fn retire(&mut self, slot: usize) -> Option<Completion> {
        let f = self.slots.try_remove(slot)?;
        let outcome = match &f.request.kind {
            RequestKind::In {
                offset,
                len,
                buffers,
            } => {
                let mut ok = !f.failed;
                if ok && f.short {
                    // A data cluster past the end of its file: read it the
                    // slow way, which zero-fills like every other reader.
                    ok = self.read_again_here(*offset, buffers, &f.mem).is_ok();
                }
                if ok {
                    Outcome::ok(*len as u32)
                } else {
                    Outcome::ioerr()
                }
            }
            // A short write to a regular file means no space: an error.
            _ if f.failed || f.short => Outcome::ioerr(),
            _ => Outcome::ok(0),
        };
        self.stats
            .account(f.queue, &f.request, outcome.code, f.started);
        Some(finish(f.queue, &f.request, outcome, &f.mem))
    }

    /// Reads a whole request again through the chain, on this thread
    /// (rare: a data cluster past the end of its file read short).
    fn read_again_here(
        &self,
        offset: u64,
        buffers: &[GuestBuffer],
        mem: &GuestMem,
    ) -> Result<(), TransferError> {
        let mut pos = offset;
        for b in buffers {
            let mut tmp = vec![0u8; b.len as usize];
            self.device.chain().read_at(&mut tmp, pos)?;
            mem.write_slice(&tmp, b.addr)
                .map_err(|_| TransferError::Memory)?;
            pos += u64::from(b.len);
        }
        Ok(())
    }

    /// Waits for every request of this worker to finish (from any thread,
    /// once the worker's own thread no longer runs it); their completions
    /// join [`QueueWorker::take_completions`]. With several workers use
    /// [`QueueWorker::drain_some`] on each in turn (see `BlkBackend::drain`).
    #[cfg(any(test, feature = "internals"))]
    pub fn drain(&mut self) {
        while !self.drain_some() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Moves this worker's requests on as far as they go without waiting
    /// for engine jobs (from any thread, once the worker's own thread no
    /// longer runs it): its ring transfers finished, the job results
    /// waiting taken; whether none is left. Their completions join
    /// [`QueueWorker::take_completions`].
    pub fn drain_some(&mut self) -> bool {
        self.finish_ring_transfers();
        let results = self.mailbox.take();
        if !results.is_empty() {
            self.stats.next_round();
        }
        for finished in results {
            self.job_done(finished);
        }
        if self.slots.is_empty() {
            return true;
        }
        if self.jobs_outstanding == 0 {
            // No transfer or job left that could complete them (a bug):
            // fail them rather than wait forever.
            self.stats.next_round();
            self.fail_orphans();
            return true;
        }
        false
    }

    /// Waits for every io_uring transfer in flight and applies it to its
    /// request (without waiting for engine jobs).
    fn finish_ring_transfers(&mut self) {
        while !self.ring.is_empty() {
            if let Err(e) = self.ring.submit_and_wait() {
                if e.kind() != io::ErrorKind::Interrupted {
                    warn!("io_uring wait: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            self.reap_ready();
        }
    }

    fn get_id(&self, buffers: &[GuestBuffer], mem: &GuestMem) -> Outcome {
        let id = self.device.id();
        let mut done = 0usize;
        for b in buffers {
            let n = (b.len as usize).min(id.len() - done);
            if mem.write_slice(&id[done..done + n], b.addr).is_err() {
                return Outcome::ioerr();
            }
            done += n;
        }
        Outcome::ok(done as u32)
    }
}

/// The engine work of a discard or write-zeroes request.
/// A request that waits for the export's limits.
#[derive(Debug)]
struct Parked {
    /// The worker-local queue it came from.
    queue: usize,
    request: Request,
    direction: IoKind,
    bytes: u64,
    /// Since when it waits.
    since: Instant,
    /// When the limits may let it start.
    until: Instant,
    /// The limits' generation it waits under (a change looks again).
    generation: u64,
    /// Starts at its next look whatever the limits (its ring stops).
    force: bool,
}

/// What the export's limits count a request as: reads and writes by
/// their bytes, write-zeroes as writes (QEMU's BlockBackend throttles
/// those; flushes, discards and id requests pass).
fn limited_as(kind: &RequestKind) -> Option<(IoKind, u64)> {
    match kind {
        RequestKind::In { len, .. } => Some((IoKind::Read, *len)),
        RequestKind::Out { len, .. } => Some((IoKind::Write, *len)),
        RequestKind::WriteZeroes(ranges) => {
            Some((IoKind::Write, ranges.iter().map(|r| r.len).sum()))
        }
        RequestKind::Flush | RequestKind::Discard(_) | RequestKind::GetId { .. } => None,
    }
}

fn zero_job(ranges: Vec<ZeroRange>, write_zeroes: bool) -> impl EngineWork {
    move |chain: &Chain| {
        for r in ranges {
            let result = if write_zeroes {
                chain.write_zeroes(r.offset, r.len, r.unmap)
            } else {
                chain.discard(r.offset, r.len)
            };
            result.map_err(|e| format!("at {}: {e}", r.offset))?;
        }
        Ok(())
    }
}

fn kind_of(slots: &Slab<InFlight>, slot: usize) -> RequestKind {
    slots
        .get(slot)
        .map_or(RequestKind::Flush, |f| f.request.kind.clone())
}

/// Writes the status byte; the completion to put on the used ring.
fn finish(queue: usize, req: &Request, outcome: Outcome, mem: &GuestMem) -> Completion {
    let written = match mem.write_obj(outcome.code as u8, req.status) {
        Ok(()) => 1,
        Err(_) => 0,
    };
    Completion {
        queue,
        head: req.head,
        len: outcome.data_len.saturating_add(written),
    }
}

/// Zeros `dst` (a zero run of a read) with one `memset`, not copies of a
/// buffer of zeros (16 of them per 64 KiB cluster): zeroing is 12-16 % of
/// the worker's time in sequential reads of half-filled chains, and the
/// `memset` saved 2-3 % of their CPU per request.
fn fill_zero(dst: &VolatileSlice<'_, ()>) {
    let guard = dst.ptr_guard_mut();
    // SAFETY: `dst` is a slice of a guest memory mapping that the caller
    // borrows (its `Arc<GuestMem>` outlives `dst`), checked to hold
    // `dst.len()` bytes from `guard.as_ptr()` when it was taken; the
    // guard keeps the pointer valid while it lives. Plain stores are what
    // `VolatileSlice::copy_from` does for byte slices too. The guest does
    // not touch a buffer it handed over before the request completes.
    unsafe { std::ptr::write_bytes(guard.as_ptr(), 0, dst.len()) };
}

fn describe(kind: &RequestKind) -> String {
    match kind {
        RequestKind::In { offset, len, .. } => format!("read of {len} bytes at {offset}"),
        RequestKind::Out { offset, len, .. } => format!("write of {len} bytes at {offset}"),
        RequestKind::Flush => "flush".into(),
        RequestKind::Discard(_) => "discard".into(),
        RequestKind::WriteZeroes(_) => "write-zeroes".into(),
        RequestKind::GetId { .. } => "get-id".into(),
    }
}

/// Guest data on its way to the engine: one contiguous guest range.
#[derive(Default)]
struct Bounce {
    start: u64,
    data: Vec<u8>,
}

impl Bounce {
    fn append(&mut self, pos: u64, src: &VolatileSlice<'_, ()>) {
        if self.data.is_empty() {
            self.start = pos;
        }
        let at = self.data.len();
        self.data.resize(at + src.len(), 0);
        src.copy_to(&mut self.data[at..]);
    }
}

/// The host-contiguous pieces of `buffers`, in order.
/// Copies `data` into guest `buffers`, starting `skip` bytes into them.
fn scatter(
    mem: &GuestMem,
    buffers: &[GuestBuffer],
    mut skip: u64,
    mut data: &[u8],
) -> Result<(), vm_memory::GuestMemoryError> {
    for b in buffers {
        let len = u64::from(b.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = ((len - skip) as usize).min(data.len());
        let at = b
            .addr
            .checked_add(skip)
            .ok_or(vm_memory::GuestMemoryError::InvalidGuestAddress(b.addr))?;
        mem.write_slice(&data[..n], at)?;
        data = &data[n..];
        skip = 0;
        if data.is_empty() {
            break;
        }
    }
    Ok(())
}

fn host_slices<'m>(
    mem: &'m GuestMem,
    buffers: &'m [GuestBuffer],
) -> impl Iterator<Item = Result<VolatileSlice<'m, ()>, TransferError>> + 'm {
    buffers.iter().flat_map(move |b| {
        GuestMemoryBackend::get_slices(mem, b.addr, b.len as usize)
            .map(|piece| piece.map_err(|_| TransferError::Memory))
    })
}
