//! Which requests may start: a request starts only with a
//! [`RequestPermit`], which it holds until it has completed. A pause (a
//! live snapshot, a stop) makes new requests wait and lets its holder wait
//! until every permit has been returned, while the workers go on
//! completing what they started: nothing that completes a request ever
//! waits for the gate, so a pause cannot deadlock with a request in flight.
//! While the daemon is inactive (a disk handed over to another daemon)
//! requests wait too, and once it has been inactive too long they are
//! refused (IOERR) instead.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

/// Counts the requests in flight; pauses new ones.
#[derive(Debug, Default)]
pub struct RequestGate {
    /// Pauses held now: pauses nest (a stop during a merge's switch must
    /// not end the merge's pause).
    paused: AtomicUsize,
    inactive: AtomicBool,
    refusing: AtomicBool,
    in_flight: AtomicUsize,
    idle_lock: Mutex<()>,
    idle: Condvar,
    /// Worker wake-ups: written when a pause ends, so that workers start
    /// the requests the guest queued meanwhile.
    wakers: Mutex<Vec<Arc<EventFd>>>,
}

/// Held by a request from before it starts until it has completed.
#[must_use = "a request holds its permit until it has completed"]
#[derive(Debug)]
pub struct RequestPermit {
    gate: Arc<RequestGate>,
}

impl Drop for RequestPermit {
    fn drop(&mut self) {
        self.gate.release();
    }
}

/// While held, no request starts; dropping it lets them start again.
#[must_use = "the device is paused only while the guard is held"]
#[derive(Debug)]
pub struct PauseGuard {
    gate: Arc<RequestGate>,
}

impl Drop for PauseGuard {
    fn drop(&mut self) {
        if self.gate.paused.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.gate.wake();
        }
    }
}

/// Whether a request may start now.
#[derive(Debug)]
pub enum Admission {
    /// Yes: it holds this permit until it completes.
    Start(RequestPermit),
    /// Not yet: leave it on its queue (the workers are woken when it may).
    Wait,
    /// No: complete it with IOERR (the daemon has been inactive too long).
    Refuse,
}

impl RequestGate {
    /// Whether a request may start now.
    pub fn try_start(self: &Arc<Self>) -> Admission {
        if self.refusing.load(Ordering::SeqCst) {
            return Admission::Refuse;
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        if self.waiting() {
            self.release();
            return Admission::Wait;
        }
        Admission::Start(RequestPermit { gate: self.clone() })
    }

    fn waiting(&self) -> bool {
        self.paused.load(Ordering::SeqCst) > 0 || self.inactive.load(Ordering::SeqCst)
    }

    /// Wakes every worker (requests may have waited on their queues).
    fn wake(&self) {
        let wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        for w in wakers.iter() {
            if let Err(e) = w.write(1) {
                tracing::warn!("waking a worker: {e}");
            }
        }
    }

    /// Makes new requests wait (inactive) or start again (active).
    pub fn set_inactive(&self, inactive: bool) {
        self.inactive.store(inactive, Ordering::SeqCst);
        if !inactive {
            self.refusing.store(false, Ordering::SeqCst);
            self.wake();
        }
    }

    /// Whether the daemon is inactive.
    pub fn is_inactive(&self) -> bool {
        self.inactive.load(Ordering::SeqCst)
    }

    /// While inactive: refuses the waiting requests and the next ones
    /// (IOERR) until activated again.
    pub fn refuse_while_inactive(&self) {
        if self.is_inactive() && !self.refusing.swap(true, Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Forgets the wake-ups of a session that ended.
    pub fn clear_wakers(&self) {
        self.wakers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    fn release(&self) {
        let before = self.in_flight.fetch_sub(1, Ordering::SeqCst);
        if before == 1 && self.waiting() {
            let _lock = self
                .idle_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.idle.notify_all();
        }
    }

    /// Stops new requests from starting (those in flight go on).
    pub fn pause(self: &Arc<Self>) -> PauseGuard {
        self.paused.fetch_add(1, Ordering::SeqCst);
        PauseGuard { gate: self.clone() }
    }

    /// Whether new requests wait (a pause, or inactive).
    pub fn is_paused(&self) -> bool {
        self.waiting()
    }

    /// Whether new requests are refused.
    pub fn is_refusing(&self) -> bool {
        self.refusing.load(Ordering::SeqCst)
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Waits (while paused) until no request is in flight, at most
    /// `timeout`; whether that happened.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut lock = self
            .idle_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while self.in_flight.load(Ordering::SeqCst) != 0 {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            lock = self
                .idle
                .wait_timeout(lock, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Registers a worker's wake-up eventfd.
    pub fn add_waker(&self, waker: Arc<EventFd>) {
        self.wakers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(waker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_refuses_new_requests_and_waits_for_those_in_flight() {
        let gate = Arc::new(RequestGate::default());
        let Admission::Start(running) = gate.try_start() else {
            panic!("not paused, yet not admitted");
        };
        let pause = gate.pause();
        assert!(
            matches!(gate.try_start(), Admission::Wait),
            "started while paused"
        );
        assert!(!gate.wait_idle(Duration::from_millis(20)));
        let g = gate.clone();
        let waiter = std::thread::spawn(move || g.wait_idle(Duration::from_secs(30)));
        drop(running);
        assert!(waiter.join().unwrap());
        drop(pause);
        assert!(matches!(gate.try_start(), Admission::Start(_)));
        gate.set_inactive(true);
        assert!(matches!(gate.try_start(), Admission::Wait));
        gate.refuse_while_inactive();
        assert!(matches!(gate.try_start(), Admission::Refuse));
        gate.set_inactive(false);
        assert!(matches!(gate.try_start(), Admission::Start(_)));
    }
}
