//! Which requests may start: a request starts only with a
//! [`RequestPermit`], which it holds until it has completed. A pause (a
//! live snapshot, a stop) makes new requests wait and lets its holder wait
//! until every permit has been returned, while the workers go on
//! completing what they started: nothing that completes a request ever
//! waits for the gate, so a pause cannot deadlock with a request in flight.
//! While the daemon is inactive (a disk handed over to another daemon)
//! requests wait too, and once it has been inactive too long they are
//! refused (IOERR) instead.
//!
//! A live snapshot's pause ([`RequestGate::pause_for_switch`]) waits for
//! less: only for what uses the chain the request started on. A request
//! whose only work left is [`DeferredWork`] (an engine write that looks
//! up the chain when it begins, from a copy of the guest's data) no
//! longer counts once it has [`RequestPermit::leave_chain`]; that work
//! waits for the switch to end before it begins, and then writes into
//! the new chain, as if the guest had sent it after the snapshot (it
//! had not been completed, so either is what the guest may see).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use crate::device::job_threads::{JobThreads, OnJobThread, RaisedJobThreads};

/// A switch that waits longer for the old chain's users is logged.
const SLOW_SWITCH: Duration = Duration::from_millis(2);

/// Counts the requests in flight; pauses new ones.
#[derive(Debug, Default)]
pub struct RequestGate {
    /// Pauses held now (counted: a pause ends when the last guard goes).
    paused: AtomicUsize,
    inactive: AtomicBool,
    refusing: AtomicBool,
    in_flight: AtomicUsize,
    /// Switches held now ([`RequestGate::pause_for_switch`]): deferred
    /// work waits while there is one.
    switching: AtomicUsize,
    /// Requests and begun deferred work that use the chain they started
    /// on (what a switch waits for).
    on_chain: AtomicUsize,
    /// Of those, begun deferred work (engine jobs), for the log of a
    /// slow switch.
    begun: AtomicUsize,
    /// The threads running begun deferred work, so that a switch can
    /// tell what those it waits for do, and raise them.
    job_threads: JobThreads,
    idle_lock: Mutex<()>,
    idle: Condvar,
    /// Signalled when the last switch ends (deferred work waits on it).
    switched: Condvar,
    /// Worker wake-ups: written when a pause ends, so that workers start
    /// the requests the guest queued meanwhile.
    wakers: Mutex<Vec<Arc<EventFd>>>,
}

/// Held by a request from before it starts until it has completed.
#[must_use = "a request holds its permit until it has completed"]
#[derive(Debug)]
pub struct RequestPermit {
    gate: Arc<RequestGate>,
    on_chain: bool,
}

impl RequestPermit {
    /// The request no longer uses the chain it started on: what it has
    /// left is [`DeferredWork`] and answers from the flusher. A switch no
    /// longer waits for it (other pauses still do, until it completes).
    pub fn leave_chain(&mut self) {
        if std::mem::take(&mut self.on_chain) {
            self.gate.leave_chain();
        }
    }

    /// A ticket for work of this request that looks the chain up when it
    /// begins.
    pub fn deferred_work(&self) -> DeferredWork {
        DeferredWork {
            gate: self.gate.clone(),
        }
    }
}

impl Drop for RequestPermit {
    fn drop(&mut self) {
        self.leave_chain();
        self.gate.release();
    }
}

/// Work of a request in flight that has not begun and will look the
/// chain up when it does ([`DeferredWork::begin`]).
#[must_use = "deferred work must begin before it touches the chain"]
#[derive(Debug)]
pub struct DeferredWork {
    gate: Arc<RequestGate>,
}

impl DeferredWork {
    /// Waits while a switch is held, then counts the work as using the
    /// chain until the guard is dropped (a switch waits for it).
    pub fn begin(self) -> BegunWork {
        loop {
            // Named before it counts, so that a switch that waits for it
            // finds its thread.
            let on = self.gate.job_threads.enter();
            self.gate.on_chain.fetch_add(1, Ordering::SeqCst);
            if self.gate.switching.load(Ordering::SeqCst) == 0 {
                self.gate.begun.fetch_add(1, Ordering::SeqCst);
                return BegunWork {
                    gate: self.gate,
                    on,
                };
            }
            self.gate.job_threads.leave(&on);
            self.gate.leave_chain();
            let lock = self
                .gate
                .idle_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let _unused = self
                .gate
                .switched
                .wait_while(lock, |_| self.gate.switching.load(Ordering::SeqCst) > 0)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Deferred work that has begun: it uses the chain until dropped, on the
/// thread it began on (not `Send`: its thread is named in the gate until
/// then, and lowered there if a switch raised it).
#[must_use = "the work counts as using the chain only while this is held"]
#[derive(Debug)]
pub struct BegunWork {
    gate: Arc<RequestGate>,
    on: OnJobThread,
}

impl Drop for BegunWork {
    fn drop(&mut self) {
        // Lowered (if raised) before a switch can see it gone.
        self.gate.job_threads.leave(&self.on);
        self.gate.begun.fetch_sub(1, Ordering::SeqCst);
        self.gate.leave_chain();
    }
}

impl PauseGuard {
    /// For a switch's pause ([`RequestGate::pause_for_switch`]): waits at
    /// most `timeout` until nothing uses the chain (requests whose only
    /// work left is deferred do not count: that work begins after the
    /// pause, on the chain current then). False for a plain pause.
    pub(super) fn off_chain(&self, timeout: Duration) -> bool {
        self.switch && self.gate.wait_off_chain(timeout)
    }

    /// Waits at most `timeout` until no request is in flight and nothing
    /// is on the chain.
    pub(super) fn idle(&self, timeout: Duration) -> bool {
        self.gate.idle_and_off_chain(timeout)
    }
}

/// While held, no request starts; dropping it lets them start again.
#[must_use = "the device is paused only while the guard is held"]
#[derive(Debug)]
pub struct PauseGuard {
    gate: Arc<RequestGate>,
    switch: bool,
}

impl Drop for PauseGuard {
    fn drop(&mut self) {
        if self.switch && self.gate.switching.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _lock = self
                .gate
                .idle_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.gate.switched.notify_all();
        }
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
        self.on_chain.fetch_add(1, Ordering::SeqCst);
        if self.waiting() {
            self.leave_chain();
            self.release();
            return Admission::Wait;
        }
        Admission::Start(RequestPermit {
            gate: self.clone(),
            on_chain: true,
        })
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
    pub(super) fn set_inactive(&self, inactive: bool) {
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

    /// While inactive (requests wait at the gate): waits at most `timeout`
    /// until none is in flight ([`crate::device::handle::Exclusive::quiesce_inactive`]).
    pub(crate) fn idle_while_inactive(&self, timeout: Duration) -> bool {
        self.is_inactive() && self.idle_and_off_chain(timeout)
    }

    /// No request in flight and nothing on the chain (begun deferred work
    /// included), within `timeout`.
    fn idle_and_off_chain(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        self.wait_idle(timeout)
            && self.wait_until_zero(
                &self.on_chain,
                deadline.saturating_duration_since(Instant::now()),
            )
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
            self.notify_idle();
        }
    }

    fn leave_chain(&self) {
        let before = self.on_chain.fetch_sub(1, Ordering::SeqCst);
        if before == 1 && self.waiting() {
            self.notify_idle();
        }
    }

    fn notify_idle(&self) {
        // Taken after the count changed and let go before the wake-up: a
        // waiter checks the count under the lock, so it either sees the
        // change or already waits; woken outside the lock, it does not
        // preempt this thread only to block on it (a live snapshot's
        // pause waits here at real-time priority).
        drop(
            self.idle_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        self.idle.notify_all();
    }

    /// Stops new requests from starting (those in flight go on).
    pub fn pause(self: &Arc<Self>) -> PauseGuard {
        self.paused.fetch_add(1, Ordering::SeqCst);
        PauseGuard {
            gate: self.clone(),
            switch: false,
        }
    }

    /// A pause for switching the chain (a live snapshot): like
    /// [`RequestGate::pause`], and deferred work does not begin until it
    /// ends; wait with [`RequestGate::wait_off_chain`].
    pub(super) fn pause_for_switch(self: &Arc<Self>) -> PauseGuard {
        self.switching.fetch_add(1, Ordering::SeqCst);
        self.paused.fetch_add(1, Ordering::SeqCst);
        PauseGuard {
            gate: self.clone(),
            switch: true,
        }
    }

    /// Whether new requests wait (a pause, or inactive).
    pub fn is_paused(&self) -> bool {
        self.waiting()
    }

    /// Whether new requests are refused.
    pub fn is_refusing(&self) -> bool {
        self.refusing.load(Ordering::SeqCst)
    }

    /// The threads running begun deferred work now (kernel thread ids,
    /// one per thread): what a switch's drain waits for besides requests
    /// being set up or transferring.
    pub fn begun_threads(&self) -> Vec<libc::pid_t> {
        self.job_threads.tids()
    }

    /// Raises the threads running begun deferred work to real-time
    /// scheduling (where allowed: see [`crate::realtime`]) until their work
    /// ends or the guard goes, so that a switch waiting for them does not
    /// wait for a CPU too.
    pub(crate) fn raise_begun_threads(&self) -> RaisedJobThreads<'_> {
        self.job_threads.raise()
    }

    /// Waits (while paused for a switch) at most `timeout` until nothing
    /// uses the chain, quietly; whether that happened.
    pub(crate) fn off_chain_within(&self, timeout: Duration) -> bool {
        self.wait_until_zero(&self.on_chain, timeout)
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Waits (while paused) until no request is in flight, at most
    /// `timeout`; whether that happened.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        self.wait_until_zero(&self.in_flight, timeout)
    }

    /// Waits (while paused for a switch) until nothing uses the chain:
    /// requests in flight whose only work left is deferred do not count.
    /// At most `timeout`; whether that happened.
    pub fn wait_off_chain(&self, timeout: Duration) -> bool {
        if self.wait_until_zero(&self.on_chain, SLOW_SWITCH) {
            return true;
        }
        tracing::info!(
            users = self.on_chain.load(Ordering::SeqCst),
            engine_jobs = self.begun.load(Ordering::SeqCst),
            "a switch waits for requests using the old chain"
        );
        self.wait_until_zero(&self.on_chain, timeout.saturating_sub(SLOW_SWITCH))
    }

    fn wait_until_zero(&self, count: &AtomicUsize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut lock = self
            .idle_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while count.load(Ordering::SeqCst) != 0 {
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

    use crate::device::test_support::admitted as started;

    #[test]
    fn a_switch_waits_for_what_uses_the_chain_and_holds_deferred_work_back() {
        let gate = Arc::new(RequestGate::default());
        let mut left = started(&gate);
        let queued = left.deferred_work();
        let mut running = started(&gate);
        let begun = running.deferred_work().begin();
        running.leave_chain();
        left.leave_chain();
        let on_chain = started(&gate);
        let switch = gate.pause_for_switch();
        assert!(matches!(gate.try_start(), Admission::Wait));
        // A request that still uses the chain, and begun work, hold it.
        assert!(!gate.wait_off_chain(Duration::from_millis(20)));
        drop(on_chain);
        assert!(!gate.wait_off_chain(Duration::from_millis(20)));
        drop(begun);
        // Only a request whose work has not begun is left: the switch
        // need not wait for it, a plain wait for idle still does.
        assert!(gate.wait_off_chain(Duration::from_millis(20)));
        assert!(!gate.wait_idle(Duration::from_millis(20)));
        // That work waits for the switch to end before it begins.
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = std::thread::spawn(move || {
            let begun = queued.begin();
            tx.send(()).unwrap();
            drop(begun);
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "deferred work began during a switch"
        );
        drop(switch);
        rx.recv_timeout(Duration::from_secs(30))
            .expect("deferred work did not begin after the switch");
        worker.join().unwrap();
        drop((left, running));
        assert_eq!(gate.in_flight(), 0);
        assert_eq!(gate.on_chain.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn deferred_work_is_not_held_back_by_a_plain_pause() {
        let gate = Arc::new(RequestGate::default());
        let mut request = started(&gate);
        let work = request.deferred_work();
        request.leave_chain();
        let pause = gate.pause();
        // A stop or a merge waits for the request to complete, which needs
        // its work to run: it must not wait for the pause.
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = std::thread::spawn(move || {
            let _begun = work.begin();
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("deferred work held back by a plain pause");
        worker.join().unwrap();
        assert!(!gate.wait_idle(Duration::from_millis(20)));
        drop(request);
        assert!(gate.wait_idle(Duration::from_millis(20)));
        drop(pause);
    }

    #[test]
    fn begun_work_names_its_thread_until_it_ends() {
        let gate = Arc::new(RequestGate::default());
        let (a, b) = (started(&gate), started(&gate));
        let (tx, rx) = std::sync::mpsc::channel();
        let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
        let (wa, wb) = (a.deferred_work(), b.deferred_work());
        let worker = std::thread::spawn(move || {
            let one = wa.begin();
            let two = wb.begin();
            tx.send(crate::realtime::current_tid()).unwrap();
            end_rx.recv().unwrap();
            drop(one);
            tx.send(0).unwrap();
            end_rx.recv().unwrap();
            drop(two);
        });
        let tid = rx.recv().unwrap();
        // Two pieces of work on one thread: the thread once.
        assert_eq!(gate.begun_threads(), vec![tid]);
        end_tx.send(()).unwrap();
        rx.recv().unwrap();
        assert_eq!(
            gate.begun_threads(),
            vec![tid],
            "one piece is still running"
        );
        end_tx.send(()).unwrap();
        worker.join().unwrap();
        assert!(gate.begun_threads().is_empty());
        drop((a, b));
    }
}
