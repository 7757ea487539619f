//! One virtqueue as the vhost-user protocol sets it up: the split ring
//! (virtio-queue's [`Queue`]), the kick and call eventfds, whether the
//! frontend enabled and started it, and its part of the inflight region.
//! The protocol thread configures it; the worker thread that serves the
//! queue takes requests off it and puts completions on it, each under the
//! vring's lock (held for ring accesses only, never across I/O).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tracing::debug;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::eventfd::EventFd;

use crate::transport::guest_mem::GuestMem;
use crate::transport::inflight::QueueInflight;

/// A virtqueue and its protocol state.
#[derive(Debug)]
pub(crate) struct Vring {
    state: Mutex<VringState>,
}

/// The inflight bookkeeping of one queue.
#[derive(Debug)]
pub(crate) struct Tracker {
    region: QueueInflight,
    /// The order number of the next request taken.
    counter: u64,
    /// Requests a previous backend took and never completed, to start
    /// before any new one.
    pub(crate) resubmit: VecDeque<u16>,
}

impl Tracker {
    /// Tracking in `region`, order numbers continuing after those in it.
    pub(crate) fn new(region: QueueInflight) -> Self {
        Tracker {
            counter: region.next_counter(),
            region,
            resubmit: VecDeque::new(),
        }
    }

    /// The request at `head` was taken off the ring.
    pub(crate) fn taken(&mut self, head: u16) {
        self.region.taken(head, self.counter);
        self.counter = self.counter.wrapping_add(1);
    }
}

/// Puts a finished request on `queue`'s used ring, with the inflight
/// bookkeeping around it in the specification's order.
pub(crate) fn add_used_tracked(
    queue: &mut Queue,
    tracker: Option<&Tracker>,
    mem: &GuestMem,
    head: u16,
    len: u32,
) -> Result<(), virtio_queue::Error> {
    if let Some(t) = tracker {
        t.region.completing(head);
    }
    queue.add_used(mem, head, len)?;
    if let Some(t) = tracker {
        t.region.completed(head, queue.next_used());
    }
    Ok(())
}

/// The state behind a [`Vring`]'s lock.
#[derive(Debug)]
pub(crate) struct VringState {
    pub(crate) queue: Queue,
    pub(crate) kick: Option<EventFd>,
    pub(crate) call: Option<EventFd>,
    /// Enabled by `SET_VRING_ENABLE` (or by features without
    /// `VHOST_USER_F_PROTOCOL_FEATURES`).
    pub(crate) enabled: bool,
    /// Started by its kick eventfd, stopped by `GET_VRING_BASE`: a stopped
    /// ring is not touched, not even to complete a request (the inflight
    /// region keeps it for the next start).
    pub(crate) started: bool,
    /// `GET_VRING_BASE` is stopping the ring: no request is taken any
    /// more, those running still complete. Cleared when it starts again.
    pub(crate) stopping: bool,
    pub(crate) tracker: Option<Tracker>,
    /// Used entries were added since the driver was last considered for a
    /// notification ([`VringState::signal`]).
    unsignalled: bool,
}

impl VringState {
    /// Whether requests may be completed (put on the used ring).
    pub(crate) fn is_live(&self) -> bool {
        self.enabled && self.started && self.queue.ready()
    }

    /// Whether requests may be taken off the ring.
    pub(crate) fn may_take(&self) -> bool {
        self.is_live() && !self.stopping
    }

    /// Whether there are requests to take: resubmissions after a restart,
    /// or an available index past the next one to take (a look at guest
    /// memory, no notification needed).
    pub(crate) fn has_work(&self, mem: &GuestMem) -> bool {
        if !self.may_take() {
            return false;
        }
        if self
            .tracker
            .as_ref()
            .is_some_and(|t| !t.resubmit.is_empty())
        {
            return true;
        }
        self.queue
            .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
            .is_ok_and(|idx| idx.0 != self.queue.next_avail())
    }

    /// Asks the driver to notify (kick) again, as before a worker sleeps;
    /// whether requests arrived meanwhile (to be taken before sleeping).
    pub(crate) fn notifications_on(&mut self, mem: &GuestMem) -> Result<bool, virtio_queue::Error> {
        self.queue.enable_notification(mem)
    }

    /// Puts a finished request on the used ring, with the inflight
    /// bookkeeping around it in the specification's order; nothing on a
    /// ring that is not live.
    pub(crate) fn put_used(&mut self, mem: &GuestMem, head: u16, len: u32) -> bool {
        if !self.is_live() {
            return false;
        }
        match add_used_tracked(&mut self.queue, self.tracker.as_ref(), mem, head, len) {
            Ok(()) => {
                self.unsignalled = true;
                true
            }
            Err(e) => {
                crate::limited_warn!("used ring: {e}");
                false
            }
        }
    }

    /// Used entries were added to the ring directly (through `queue`).
    pub(crate) fn note_used(&mut self) {
        self.unsignalled = true;
    }

    /// Notifies the driver of the used entries added since the last call,
    /// if it asked to be (nothing when none were added).
    pub(crate) fn signal(&mut self, mem: &GuestMem) {
        if !std::mem::take(&mut self.unsignalled) {
            return;
        }
        let needed = match self.queue.needs_notification(mem) {
            Ok(n) => n,
            Err(e) => {
                debug!("used event: {e}");
                true
            }
        };
        if let (true, Some(call)) = (needed, &self.call) {
            if let Err(e) = call.write(1) {
                debug!("signal used queue: {e}");
            }
        }
    }
}

impl Vring {
    pub(crate) fn new(max_size: u16) -> Self {
        // A queue size must be a power of two up to 32768: the largest one
        // within `max_size`.
        let size = 1u16 << (15 - max_size.max(1).leading_zeros()).min(15);
        let queue =
            Queue::new(size).unwrap_or_else(|_| unreachable!("{size} is a valid queue size"));
        Vring {
            state: Mutex::new(VringState {
                queue,
                kick: None,
                call: None,
                enabled: false,
                started: false,
                stopping: false,
                tracker: None,
                unsignalled: false,
            }),
        }
    }

    /// The state, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, VringState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Guest memory shared by the protocol thread and the workers.
pub(crate) type SharedMem = GuestMemoryAtomic<GuestMem>;
