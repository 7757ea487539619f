//! Which requests may start: a request starts only with a
//! [`RequestPermit`], which it holds until it has completed. A pause (a
//! live snapshot, a stop) makes new permits fail and lets its holder wait
//! until every permit has been returned, while the workers go on
//! completing what they started: nothing that completes a request ever
//! waits for the gate, so a pause cannot deadlock with a request in flight.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

/// Counts the requests in flight; pauses new ones.
#[derive(Debug, Default)]
pub struct RequestGate {
    paused: AtomicBool,
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
        self.gate.paused.store(false, Ordering::SeqCst);
        let wakers = self
            .gate
            .wakers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for w in wakers.iter() {
            if let Err(e) = w.write(1) {
                tracing::warn!("waking a worker after a pause: {e}");
            }
        }
    }
}

impl RequestGate {
    /// A permit to start a request, unless the device is paused.
    pub fn try_start(self: &Arc<Self>) -> Option<RequestPermit> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        if self.paused.load(Ordering::SeqCst) {
            self.release();
            return None;
        }
        Some(RequestPermit { gate: self.clone() })
    }

    fn release(&self) {
        let before = self.in_flight.fetch_sub(1, Ordering::SeqCst);
        if before == 1 && self.paused.load(Ordering::SeqCst) {
            let _lock = self
                .idle_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.idle.notify_all();
        }
    }

    /// Stops new requests from starting (those in flight go on).
    pub fn pause(self: &Arc<Self>) -> PauseGuard {
        self.paused.store(true, Ordering::SeqCst);
        PauseGuard { gate: self.clone() }
    }

    /// Whether new requests wait.
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
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
        let running = gate.try_start().expect("not paused");
        let pause = gate.pause();
        assert!(gate.try_start().is_none(), "started while paused");
        assert!(!gate.wait_idle(Duration::from_millis(20)));
        let g = gate.clone();
        let waiter = std::thread::spawn(move || g.wait_idle(Duration::from_secs(30)));
        drop(running);
        assert!(waiter.join().unwrap());
        drop(pause);
        assert!(gate.try_start().is_some());
    }
}
