//! One queue worker: takes requests off its queues, reads data clusters
//! with io_uring straight into guest memory, completes requests as their
//! I/O finishes.
//!
//! Reads are asynchronous: each piece of a read that maps to a data
//! cluster becomes one io_uring read into the guest buffer, and the
//! request completes when its last piece does (the ring's eventfd wakes
//! the worker). Zero and unallocated ranges are zero-filled in place;
//! compressed clusters are decompressed through a bounce buffer. Writes,
//! discards, write-zeroes and flushes go through the chain engine
//! synchronously (metadata updates need its lock anyway).

use std::io;
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};
use slab::Slab;
use sqcow2_format::chain::ExtentKind;
use sqcow2_format::{GuestOffset, LayerIndex};
use tracing::{debug, warn};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use virtio_queue::{Queue, QueueT};
use vm_memory::{
    Bytes, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap, VolatileSlice,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::device::BlkDevice;
use crate::request::{self, GuestBuffer, Request, RequestKind, ZeroRange};

/// Guest memory as the daemon maps it.
pub type GuestMem = GuestMemoryMmap<()>;
/// Guest memory that the frontend may remap at any time.
pub type GuestMemAtomic = GuestMemoryAtomic<GuestMem>;

/// Submission queue entries per worker ring.
const RING_ENTRIES: u32 = 256;
/// Largest bounce buffer for a write.
const WRITE_CHUNK: usize = 1 << 20;

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

/// Counters and latencies of one queue.
#[derive(Debug, Clone)]
pub struct QueueStats {
    /// Requests completed (rejected ones included).
    pub requests: u64,
    /// Bytes read by the guest.
    pub read_bytes: u64,
    /// Bytes written by the guest.
    pub write_bytes: u64,
    /// Requests completed with an error status.
    pub errors: u64,
    /// Latency from start to completion, microseconds.
    pub latency_us: hdrhistogram::Histogram<u64>,
}

impl Default for QueueStats {
    fn default() -> Self {
        QueueStats {
            requests: 0,
            read_bytes: 0,
            write_bytes: 0,
            errors: 0,
            // Two significant digits, auto-resizing: bounded and cheap.
            latency_us: hdrhistogram::Histogram::new(2).unwrap_or_else(|_| {
                hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 2)
                    .expect("valid histogram bounds")
            }),
        }
    }
}

/// A read whose io_uring pieces are in flight.
struct InFlight {
    started: std::time::Instant,
    queue: usize,
    request: Request,
    /// Keeps the guest mapping alive while the kernel writes into it.
    mem: Arc<GuestMem>,
    pending: u32,
    failed: bool,
    short: bool,
    /// Held until the request's transfers have finished.
    ticket: sqcow2_format::TransferTicket,
}

/// The engine of one worker thread.
pub struct QueueWorker {
    device: Arc<BlkDevice>,
    ring: IoUring,
    event: EventFd,
    /// Requests whose I/O is running, by slot.
    slots: Slab<InFlight>,
    completed: Vec<Completion>,
    /// io_uring operations queued and not yet reaped (key = user_data).
    ring_ops: Slab<RingOp>,
    /// The slot being submitted by [`QueueWorker::start_async`], if any.
    starting: Option<usize>,
    stats: Vec<QueueStats>,
}

impl std::fmt::Debug for QueueWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueWorker")
            .field("in_flight", &self.slots.len())
            .finish()
    }
}

/// The status code and used length of a request finished here.
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

impl QueueWorker {
    /// A worker for `device` with its own io_uring and completion eventfd.
    pub fn new(device: Arc<BlkDevice>) -> io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        let event = EventFd::new(EFD_NONBLOCK)?;
        ring.submitter()
            .register_eventfd(std::os::fd::AsRawFd::as_raw_fd(&event))?;
        Ok(QueueWorker {
            device,
            ring,
            event,
            slots: Slab::new(),
            completed: Vec::new(),
            ring_ops: Slab::new(),
            starting: None,
            stats: Vec::new(),
        })
    }

    /// The eventfd that becomes readable when io_uring completions wait.
    pub fn completion_fd(&self) -> &EventFd {
        &self.event
    }

    /// Requests whose I/O is still running.
    pub fn in_flight(&self) -> usize {
        self.slots.len()
    }

    /// Takes every available request off `queue` and starts it; requests
    /// finished on the spot are put on the used ring at once. Returns
    /// whether any was. `queue_index` names the queue in [`Completion`]s.
    pub fn process_queue(
        &mut self,
        queue_index: usize,
        queue: &mut Queue,
        mem: &GuestMemAtomic,
    ) -> io::Result<bool> {
        let mem = mem.memory().into_inner();
        let popped = self.pop_all(queue_index, queue, &mem);
        // Reads queued so far go to the kernel even if the ring failed.
        let submitted = self.ring.submit();
        let used = popped?;
        submitted?;
        Ok(used)
    }

    fn pop_all(
        &mut self,
        queue_index: usize,
        queue: &mut Queue,
        mem: &Arc<GuestMem>,
    ) -> io::Result<bool> {
        let limits = self.device.limits();
        let event_idx = queue.event_idx_enabled();
        let mut used = false;
        loop {
            if event_idx {
                queue
                    .disable_notification(&**mem)
                    .map_err(io::Error::other)?;
            }
            while let Some(chain) = queue.pop_descriptor_chain(&**mem) {
                let done = match request::parse(chain, &limits) {
                    Ok(req) => self.start(queue_index, req, mem),
                    Err(rejected) => {
                        self.account_rejected(queue_index);
                        debug!(
                            reason = rejected.reason,
                            head = rejected.head,
                            "request rejected"
                        );
                        let len = match rejected.status {
                            Some(addr) => {
                                let _ = mem.write_obj(rejected.code, addr);
                                1
                            }
                            None => 0,
                        };
                        Some(Completion {
                            queue: queue_index,
                            head: rejected.head,
                            len,
                        })
                    }
                };
                if let Some(c) = done {
                    queue
                        .add_used(&**mem, c.head, c.len)
                        .map_err(io::Error::other)?;
                    used = true;
                }
            }
            if !event_idx
                || !queue
                    .enable_notification(&**mem)
                    .map_err(io::Error::other)?
            {
                return Ok(used);
            }
        }
    }

    /// Starts one request; returns its completion if it finished already.
    fn start(&mut self, queue: usize, req: Request, mem: &Arc<GuestMem>) -> Option<Completion> {
        let started = std::time::Instant::now();
        let outcome = match &req.kind {
            RequestKind::In { .. } => return self.start_async(queue, req, mem),
            RequestKind::Out { .. } if self.device.writeback() => {
                return self.start_async(queue, req, mem)
            }
            RequestKind::Out {
                offset, buffers, ..
            } => self.write(*offset, buffers, mem),
            RequestKind::Flush => self.flush(),
            RequestKind::GetId { buffers } => self.get_id(buffers, mem),
            RequestKind::Discard(ranges) | RequestKind::WriteZeroes(ranges) => {
                let write_zeroes = matches!(req.kind, RequestKind::WriteZeroes(_));
                self.zero(ranges, write_zeroes)
            }
        };
        self.account(queue, &req, &outcome, started);
        Some(finish(queue, &req, outcome, mem))
    }

    /// Counts a finished request in its queue's statistics.
    fn account(
        &mut self,
        queue: usize,
        req: &Request,
        outcome: &Outcome,
        started: std::time::Instant,
    ) {
        if self.stats.len() <= queue {
            self.stats.resize_with(queue + 1, QueueStats::default);
        }
        let st = &mut self.stats[queue];
        st.requests += 1;
        if outcome.code != VIRTIO_BLK_S_OK {
            st.errors += 1;
        } else {
            match &req.kind {
                RequestKind::In { len, .. } => st.read_bytes += len,
                RequestKind::Out { len, .. } => st.write_bytes += len,
                _ => {}
            }
        }
        let us = started.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
        let _ = st.latency_us.record(us.max(1));
    }

    /// Counts a request rejected before it started.
    fn account_rejected(&mut self, queue: usize) {
        if self.stats.len() <= queue {
            self.stats.resize_with(queue + 1, QueueStats::default);
        }
        self.stats[queue].requests += 1;
        self.stats[queue].errors += 1;
    }

    /// Statistics of this worker's queues, by worker-local queue index.
    pub fn stats(&self) -> &[QueueStats] {
        &self.stats
    }

    /// Starts a read or a write-back write whose data moves between the
    /// image files and guest memory with io_uring.
    fn start_async(
        &mut self,
        queue: usize,
        req: Request,
        mem: &Arc<GuestMem>,
    ) -> Option<Completion> {
        let ticket = self.device.chain().begin_transfer();
        let kind = req.kind.clone();
        let slot = self.slots.insert(InFlight {
            started: std::time::Instant::now(),
            queue,
            request: req,
            mem: mem.clone(),
            // One for the submission itself: the slot cannot retire while
            // its pieces are still being queued.
            pending: 1,
            failed: false,
            short: false,
            ticket,
        });
        self.starting = Some(slot);
        let result = match &kind {
            RequestKind::In {
                offset, buffers, ..
            } => self.submit_reads(slot, *offset, buffers, mem),
            RequestKind::Out {
                offset, buffers, ..
            } => self.submit_writes(slot, *offset, buffers, mem),
            _ => Ok(()),
        };
        if let Err(e) = &result {
            crate::limited_warn!("{}: {e}", describe(&kind));
        }
        self.starting = None;
        self.piece_done(slot, result.is_err())
    }

    /// One piece of the request in `slot` has finished (the submission
    /// counts as one); completes the request after its last piece.
    fn piece_done(&mut self, slot: usize, failed: bool) -> Option<Completion> {
        let f = self.slots.get_mut(slot)?;
        f.failed |= failed;
        f.pending -= 1;
        if f.pending == 0 {
            self.retire(slot)
        } else {
            None
        }
    }

    /// Recovers after a panic in this worker (a bug): the request that was
    /// being submitted fails once its queued I/O (if any) has finished, and
    /// when no I/O is left in the ring, every request still in flight
    /// fails instead of waiting for completions that will never come.
    pub fn recover_after_panic(&mut self) {
        if let Some(slot) = self.starting.take() {
            if let Some(c) = self.piece_done(slot, true) {
                self.completed.push(c);
            }
        }
        self.fail_orphans();
    }

    /// Fails the requests in flight when the ring holds no I/O for them.
    fn fail_orphans(&mut self) {
        if !self.ring_ops.is_empty() || self.slots.is_empty() {
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
            }
            if let Some(c) = self.retire(slot) {
                self.completed.push(c);
            }
        }
    }

    /// Queues io_uring writes for the pieces of `[offset, ..)` that land
    /// in clusters the top owns; the rest (allocation, copy-on-write) goes
    /// through the engine from a bounce buffer.
    fn submit_writes(
        &mut self,
        slot: usize,
        offset: u64,
        buffers: &[GuestBuffer],
        mem: &GuestMem,
    ) -> Result<(), ReadError> {
        let chain = self.device.chain();
        let cluster = self.device.config().cluster_size;
        let top_fd = chain.top().storage().raw_fd();
        let mut bounce = Bounce::default();
        let mut pos = offset;
        for piece in host_slices(mem, buffers) {
            let piece = piece?;
            let mut done = 0usize;
            while done < piece.len() {
                let n = ((piece.len() - done) as u64).min(cluster - pos % cluster) as usize;
                let src = piece.subslice(done, n).map_err(|_| ReadError::Memory)?;
                let target = match (top_fd, self.slots.get(slot)) {
                    (Some(fd), Some(f)) => chain
                        .in_place_target(&f.ticket, GuestOffset(pos), n as u64)?
                        .map(|t| (fd, t.host.0)),
                    _ => None,
                };
                match target {
                    Some((fd, host)) => {
                        bounce.write_out(&chain)?;
                        self.queue_io(slot, IoKind::Write, fd, host, &src)?;
                    }
                    None => {
                        bounce.append(pos, &src);
                        if bounce.data.len() >= WRITE_CHUNK {
                            bounce.write_out(&chain)?;
                        }
                    }
                }
                done += n;
                pos += n as u64;
            }
        }
        bounce.write_out(&chain)
    }

    /// Queues the io_uring reads of `[offset, ..)` into `buffers`; fills
    /// zero and compressed ranges on the spot.
    fn submit_reads(
        &mut self,
        slot: usize,
        offset: u64,
        buffers: &[GuestBuffer],
        mem: &GuestMem,
    ) -> Result<(), ReadError> {
        let chain = self.device.chain();
        let mut pos = offset;
        for piece in host_slices(mem, buffers) {
            let piece = piece?;
            let mut done = 0usize;
            while done < piece.len() {
                let want = (piece.len() - done) as u64;
                let Some(f) = self.slots.get(slot) else {
                    return Err(ReadError::Memory);
                };
                let extent = chain
                    .resolve_for_read(&f.ticket, GuestOffset(pos), want)?
                    .extent;
                let n = extent.len.min(want) as usize;
                let dst = piece.subslice(done, n).map_err(|_| ReadError::Memory)?;
                match extent.kind {
                    ExtentKind::Zero { .. } => fill_zero(&dst),
                    ExtentKind::Data { host } => {
                        self.queue_read(slot, extent.layer, host.0, &dst, pos)?;
                    }
                    // Compressed (and anything else): through the engine.
                    _ => {
                        let mut tmp = vec![0u8; n];
                        chain.read_at(&mut tmp, pos)?;
                        dst.copy_from(&tmp);
                    }
                }
                done += n;
                pos += n as u64;
            }
        }
        Ok(())
    }

    /// One io_uring read of `dst.len()` bytes of `layer` at `host`.
    fn queue_read(
        &mut self,
        slot: usize,
        layer: LayerIndex,
        host: u64,
        dst: &VolatileSlice<'_, ()>,
        guest: u64,
    ) -> Result<(), ReadError> {
        let chain = self.device.chain();
        let storage = chain.layers()[layer.0].storage().clone();
        let Some(fd) = storage.raw_fd() else {
            let mut tmp = vec![0u8; dst.len()];
            chain.read_at(&mut tmp, guest)?;
            dst.copy_from(&tmp);
            return Ok(());
        };
        self.queue_io(slot, IoKind::Read, fd, host, dst)
    }

    /// One io_uring read into (or write from) the guest memory `buf`.
    fn queue_io(
        &mut self,
        slot: usize,
        kind: IoKind,
        fd: std::os::fd::RawFd,
        host: u64,
        buf: &VolatileSlice<'_, ()>,
    ) -> Result<(), ReadError> {
        let len = buf.len() as u32;
        let ptr = buf.ptr_guard_mut().as_ptr();
        let entry = match kind {
            IoKind::Read => opcode::Read::new(types::Fd(fd), ptr, len)
                .offset(host)
                .build(),
            IoKind::Write => opcode::Write::new(types::Fd(fd), ptr, len)
                .offset(host)
                .build(),
        };
        // The buffer's validity for the whole operation is what `push`
        // relies on: `ptr..ptr + len` lies in a guest memory region whose
        // mapping the in-flight slot keeps alive (`InFlight::mem`) until the
        // completion is reaped (a resubmission included); the guest does
        // not touch a buffer it handed to the device before the request
        // completes (if it does, only its own data is garbled). `fd`
        // belongs to the chain, which `self.device` keeps open.
        let op = RingOp {
            slot,
            len,
            entry,
            retries: 0,
        };
        self.submit_op(op).map_err(ReadError::Io)?;
        if let Some(f) = self.slots.get_mut(slot) {
            f.pending += 1;
        }
        Ok(())
    }

    /// Puts `op` in the ring under a fresh user_data, making room in the
    /// submission queue if it is full.
    fn submit_op(&mut self, op: RingOp) -> io::Result<()> {
        let entry = op.entry.clone();
        let key = self.ring_ops.insert(op);
        let entry = entry.user_data(key as u64);

        // SAFETY: every entry is a read or write built by `queue_io`,
        // whose buffer and file stay valid until its completion is reaped
        // (see there).
        while unsafe { self.ring.submission().push(&entry) }.is_err() {
            if let Err(e) = self.ring.submit() {
                self.ring_ops.remove(key);
                return Err(e);
            }
            self.reap();
        }
        Ok(())
    }

    /// Clears the completion eventfd and handles every completion waiting.
    pub fn handle_completion_event(&mut self) {
        let _ = self.event.read();
        self.reap();
    }

    /// Handles the completions already in the ring, without waiting.
    pub fn reap_ready(&mut self) {
        self.reap();
    }

    /// Handles the completions in the ring.
    fn reap(&mut self) {
        let done: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|cqe| (cqe.user_data(), cqe.result()))
            .collect();
        for (user_data, res) in done {
            let Some(mut op) = self.ring_ops.try_remove(user_data as usize) else {
                continue;
            };
            let slot = op.slot;
            // Interrupted or not ready: the same I/O again (as QEMU does).
            if (res == -libc::EINTR || res == -libc::EAGAIN) && op.retries < MAX_RETRIES {
                op.retries += 1;
                match self.submit_op(op) {
                    Ok(()) => continue,
                    Err(e) => crate::limited_warn!("resubmitting interrupted I/O: {e}"),
                }
            } else if res < 0 {
                crate::limited_warn!("data I/O failed: {}", io::Error::from_raw_os_error(-res));
            } else if (res as u32) < op.len {
                if let Some(f) = self.slots.get_mut(slot) {
                    f.short = true;
                }
            }
            if let Some(c) = self.piece_done(slot, res < 0) {
                self.completed.push(c);
            }
        }
    }

    /// Completes the read in `slot` (its I/O is done).
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
                    ok = self.read_through_engine(*offset, buffers, &f.mem).is_ok();
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
        drop(f.ticket);
        self.account(f.queue, &f.request, &outcome, f.started);
        Some(finish(f.queue, &f.request, outcome, &f.mem))
    }

    fn read_through_engine(
        &self,
        offset: u64,
        buffers: &[GuestBuffer],
        mem: &GuestMem,
    ) -> Result<(), ReadError> {
        let mut pos = offset;
        for b in buffers {
            let mut tmp = vec![0u8; b.len as usize];
            self.device.chain().read_at(&mut tmp, pos)?;
            mem.write_slice(&tmp, b.addr)
                .map_err(|_| ReadError::Memory)?;
            pos += u64::from(b.len);
        }
        Ok(())
    }

    /// Requests completed since the last call.
    pub fn take_completions(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.completed)
    }

    /// Waits for every read of this worker to finish; their completions
    /// join [`QueueWorker::take_completions`].
    pub fn drain(&mut self) {
        while !self.slots.is_empty() {
            if self.ring_ops.is_empty() {
                // Nothing left that could complete them (a bug): fail them
                // rather than wait forever.
                self.fail_orphans();
                break;
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.kind() != io::ErrorKind::Interrupted {
                    warn!("io_uring wait: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            self.reap();
        }
    }

    /// A write-through write: through the engine, flushed before it
    /// completes.
    fn write(&mut self, offset: u64, buffers: &[GuestBuffer], mem: &GuestMem) -> Outcome {
        let chain = self.device.chain();
        let mut bounce = Bounce::default();
        let mut pos = offset;
        let mut result = Ok(());
        for piece in host_slices(mem, buffers) {
            result = piece.and_then(|piece| {
                bounce.append(pos, &piece);
                pos += piece.len() as u64;
                if bounce.data.len() >= WRITE_CHUNK {
                    bounce.write_out(&chain)?;
                }
                Ok(())
            });
            if result.is_err() {
                break;
            }
        }
        if let Err(e) = result.and_then(|()| bounce.write_out(&chain)) {
            crate::limited_warn!("write at {offset}: {e}");
            return Outcome::ioerr();
        }
        self.after_write()
    }

    fn zero(&mut self, ranges: &[ZeroRange], write_zeroes: bool) -> Outcome {
        let chain = self.device.chain();
        for r in ranges {
            let result = if write_zeroes {
                chain.write_zeroes(r.offset, r.len, r.unmap)
            } else {
                chain.discard(r.offset, r.len)
            };
            if let Err(e) = result {
                crate::limited_warn!("discard/write-zeroes at {}: {e}", r.offset);
                return Outcome::ioerr();
            }
        }
        self.after_write()
    }

    /// In write-through mode a write completes only once durable.
    fn after_write(&mut self) -> Outcome {
        if self.device.writeback() {
            Outcome::ok(0)
        } else {
            self.flush()
        }
    }

    fn flush(&mut self) -> Outcome {
        // Our own reads first (only this thread reaps them), then everyone
        // else's: a flush may make clusters freed by discards reusable.
        self.drain();
        match self.device.chain().flush() {
            Ok(()) => Outcome::ok(0),
            Err(e) => {
                crate::limited_warn!("flush: {e}");
                Outcome::ioerr()
            }
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

fn fill_zero(dst: &VolatileSlice<'_, ()>) {
    const ZEROS: [u8; 4096] = [0; 4096];
    let mut off = 0;
    while off < dst.len() {
        let n = (dst.len() - off).min(ZEROS.len());
        if let Ok(s) = dst.subslice(off, n) {
            s.copy_from(&ZEROS[..n]);
        }
        off += n;
    }
}

/// Why a transfer could not be set up.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("guest buffer outside guest memory")]
    Memory,
    #[error(transparent)]
    Chain(#[from] sqcow2_format::Error),
    #[error("io_uring: {0}")]
    Io(io::Error),
}

/// Direction of one io_uring data transfer.
#[derive(Debug, Clone, Copy)]
enum IoKind {
    Read,
    Write,
}

/// An io_uring operation in the ring: what to redo if it is interrupted.
struct RingOp {
    slot: usize,
    len: u32,
    entry: squeue::Entry,
    retries: u8,
}

/// Resubmissions of one interrupted operation before it fails.
const MAX_RETRIES: u8 = 16;

fn describe(kind: &RequestKind) -> String {
    match kind {
        RequestKind::In { offset, len, .. } => format!("read of {len} bytes at {offset}"),
        RequestKind::Out { offset, len, .. } => format!("write of {len} bytes at {offset}"),
        other => format!("{other:?}"),
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

    fn write_out(&mut self, chain: &sqcow2_format::Chain) -> Result<(), ReadError> {
        if !self.data.is_empty() {
            chain.write_at(&self.data, self.start)?;
            self.data.clear();
        }
        Ok(())
    }
}

/// The host-contiguous pieces of `buffers`, in order.
fn host_slices<'m>(
    mem: &'m GuestMem,
    buffers: &'m [GuestBuffer],
) -> impl Iterator<Item = Result<VolatileSlice<'m, ()>, ReadError>> + 'm {
    buffers.iter().flat_map(move |b| {
        GuestMemoryBackend::get_slices(mem, b.addr, b.len as usize)
            .map(|piece| piece.map_err(|_| ReadError::Memory))
    })
}
