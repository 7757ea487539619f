//! Builds the served top's chain index in the background: after a live
//! snapshot (the new top's index is not built inside the guest's pause),
//! at start (a daemon killed during a build left the old index serving, a
//! vanilla tool made the index stale) and for a chain QEMU made, which is
//! indexed in place as `sqcow2 upgrade` would (where the image locks
//! allow it; otherwise the chain is walked, and `stats` and `info` say
//! why). One thread at a time; a wake-up during a build runs another
//! build after it, for the chain served then (snapshots faster than
//! builds merge into one build for the newest top).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

use sqcow2_format::indexing::{build_index, index_in_place, is_cancelled};
use sqcow2_format::Locking;
use tracing::{info, warn};

use super::protocol::IndexCounters;
use crate::device::handle::ChainHandle;

/// How much nicer than the daemon the build runs: it yields the CPU to
/// the guest's requests (see [`crate::realtime::lower_current_thread`]).
const INDEX_NICENESS: i32 = 10;

#[derive(Debug, Default)]
struct State {
    /// A thread is building.
    running: bool,
    /// Woken while building: build again after.
    again: bool,
    /// No build starts (the daemon hands the disk over).
    suspended: bool,
    /// Suspended for good: the daemon stops.
    stopped: bool,
    /// Holds taken ([`IndexBuilder::hold`]): a running build waits at its
    /// next check while any is.
    holds: u32,
    /// A build is waiting for the holds to end.
    waiting: bool,
    counters: IndexCounters,
}

#[derive(Debug, Default)]
struct Builder {
    state: Mutex<State>,
    /// Signalled when a build thread ends.
    idle: Condvar,
    /// Signalled when the last hold ends or a cancel is asked for.
    unheld: Condvar,
    /// Asks a running build to stop as soon as it can.
    cancel: AtomicBool,
}

/// The background builder of the served chain's index.
#[derive(Debug)]
pub struct IndexBuilder {
    handle: Arc<ChainHandle>,
    shared: Arc<Builder>,
    /// Whether the daemon uses indexes at all (`--walk`: never builds).
    enabled: bool,
    /// The image locks the daemon takes, for the layers a build marks.
    locking: Locking,
}

impl IndexBuilder {
    /// A builder for the chain `handle` serves (nothing runs until
    /// [`IndexBuilder::wake`]); `enabled` false never builds; `locking`:
    /// the daemon's image locks.
    pub fn new(handle: Arc<ChainHandle>, enabled: bool, locking: Locking) -> Self {
        IndexBuilder {
            handle,
            shared: Arc::default(),
            enabled,
            locking,
        }
    }

    fn lock(shared: &Builder) -> std::sync::MutexGuard<'_, State> {
        shared.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Builds the served chain's index if it needs one (a writable chain
    /// whose top names no index, or one that does not cover every layer
    /// below it), on a background thread.
    pub fn wake(&self) {
        if !self.enabled {
            return;
        }
        let mut st = Self::lock(&self.shared);
        if st.suspended {
            return;
        }
        if st.running {
            st.again = true;
            return;
        }
        st.running = true;
        st.counters.building = true;
        drop(st);
        let handle = self.handle.clone();
        let shared = self.shared.clone();
        let locking = self.locking;
        let spawned = std::thread::Builder::new()
            .name("sqcow2-index".into())
            .spawn(move || {
                // Background work: the guest's requests come first.
                crate::realtime::lower_current_thread(INDEX_NICENESS);
                loop {
                    let built = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        build_once(&handle, &shared, locking);
                    }));
                    let mut st = Self::lock(&shared);
                    if built.is_err() {
                        st.counters.failures += 1;
                        st.counters.last_error = Some("the build panicked (a bug)".into());
                    }
                    if st.again && !st.suspended {
                        st.again = false;
                        continue;
                    }
                    st.again = false;
                    st.running = false;
                    st.counters.building = false;
                    shared.idle.notify_all();
                    return;
                }
            });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start the index builder: the chain is walked above its index");
            let mut st = Self::lock(&self.shared);
            st.running = false;
            st.counters.building = false;
        }
    }

    /// Stops building (a running build is cancelled and waited for; none
    /// starts until [`IndexBuilder::resume`]): before the daemon hands its
    /// images to another process.
    pub fn suspend(&self) {
        let mut st = Self::lock(&self.shared);
        st.suspended = true;
        self.shared.cancel.store(true, Ordering::SeqCst);
        // A held build stops waiting to see the cancel.
        self.shared.unheld.notify_all();
        while st.running {
            st = self
                .shared
                .idle
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
        self.shared.cancel.store(false, Ordering::SeqCst);
    }

    /// Holds a running build at its next check (every few thousand
    /// entries; it holds no lock of the chain there) until the returned
    /// guard is dropped: for the guest's pause of a live snapshot, whose
    /// few milliseconds of work must not share this small machine's CPUs
    /// with a build.
    pub fn hold(&self) -> BuildHold<'_> {
        Self::lock(&self.shared).holds += 1;
        BuildHold {
            shared: &self.shared,
        }
    }

    /// Builds may start again (then [`IndexBuilder::wake`]), unless the
    /// daemon stops.
    pub fn resume(&self) {
        let mut st = Self::lock(&self.shared);
        st.suspended = st.stopped;
    }

    /// [`IndexBuilder::suspend`] for good: the daemon stops (a cancelled
    /// build's temporary file is removed; the next start builds again).
    pub fn stop(&self) {
        Self::lock(&self.shared).stopped = true;
        self.suspend();
    }

    /// Counters for `stats` (`pending_layers` filled in by the caller).
    pub fn counters(&self) -> IndexCounters {
        Self::lock(&self.shared).counters.clone()
    }
}

/// A running build waits at its next check while this lives
/// ([`IndexBuilder::hold`]).
#[must_use = "the build is held only while the guard lives"]
#[derive(Debug)]
pub struct BuildHold<'a> {
    shared: &'a Builder,
}

impl Drop for BuildHold<'_> {
    fn drop(&mut self) {
        let mut st = IndexBuilder::lock(self.shared);
        st.holds = st.holds.saturating_sub(1);
        if st.holds == 0 {
            self.shared.unheld.notify_all();
        }
    }
}

impl Builder {
    /// Whether the build must stop; waits first while a hold is taken.
    fn check(&self) -> bool {
        let mut st = IndexBuilder::lock(self);
        // `suspended` too: a suspend clears `cancel` once the build ended.
        while st.holds > 0 && !st.suspended && !self.cancel.load(Ordering::SeqCst) {
            st.waiting = true;
            st = self.unheld.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        st.waiting = false;
        st.suspended || self.cancel.load(Ordering::Relaxed)
    }
}

/// One build for the chain served now (taken once no hold is left: a
/// live snapshot's old top may still be closing).
fn build_once(handle: &ChainHandle, shared: &Builder, locking: Locking) {
    if shared.check() {
        return;
    }
    let chain = handle.get();
    if !chain.is_writable() {
        return;
    }
    let start = Instant::now();
    let cancelled = || shared.check();
    // A chain QEMU made: its layers are marked, each locked as a writer
    // for it (another process's reader or writer refuses it).
    let result = match index_in_place(&chain, locking, &cancelled) {
        // The daemon holds the chain's image locks: the build takes none.
        Ok(None) => build_index(&chain, Locking::Off, &mut |_, _| {}, &cancelled),
        other => other,
    };
    drop(chain);
    // A live snapshot during the build made a new chain, which still uses
    // the older index: the new one covers more of its layers.
    if let Ok(Some(report)) = &result {
        // Checked (and held) before the served chain is taken: a snapshot
        // pausing now replaces it, and the index goes to its successor.
        if !cancelled() {
            let served = handle.get();
            if let Err(e) = served.index().install_built(report) {
                warn!(error = %e, "the index just built does not fit the chain served now");
            }
        }
    }
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let mut st = IndexBuilder::lock(shared);
    match result {
        Ok(Some(report)) => {
            st.counters.builds += 1;
            st.counters.last_build_ms = ms;
            st.counters.last_error = None;
            info!(index = %report.index.display(), layers = report.layers, bytes = report.bytes, ms, "chain index built");
        }
        Ok(None) => {}
        Err(e) if is_cancelled(&e) => {
            info!(reason = %e, "index build stopped (the next one starts when the daemon serves again)");
        }
        Err(e) => {
            st.counters.failures += 1;
            st.counters.last_error = Some(e.to_string());
            if handle.get().index().is_used() {
                warn!(error = %e, "building the chain index failed: the old index goes on serving");
            } else {
                warn!(error = %e, "the chain cannot be indexed: lookups walk its layers");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    fn builder() -> IndexBuilder {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.qcow2");
        sqcow2_format::create::create(
            &path,
            &sqcow2_format::create::CreateOptions {
                size: 1 << 20,
                ..Default::default()
            },
        )
        .unwrap();
        let chain = sqcow2_format::Chain::open(&path, &Default::default()).unwrap();
        IndexBuilder::new(Arc::new(ChainHandle::new(chain)), true, Locking::Off)
    }

    /// Waits (bounded) until a build is parked at its check.
    fn until_waiting(b: &IndexBuilder) {
        for _ in 0..10_000 {
            if IndexBuilder::lock(&b.shared).waiting {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("the build never waited for the hold");
    }

    #[test]
    fn a_held_build_waits_at_its_check_until_the_hold_ends() {
        let b = builder();
        let hold = b.hold();
        let done = Arc::new(AtomicBool::new(false));
        let (shared, d) = (b.shared.clone(), done.clone());
        let t = std::thread::spawn(move || {
            let stop = shared.check();
            d.store(true, Ordering::SeqCst);
            stop
        });
        until_waiting(&b);
        assert!(!done.load(Ordering::SeqCst), "the check ran on while held");
        drop(hold);
        assert!(!t.join().unwrap(), "a released build must not stop");
        // Without a hold the check does not wait.
        assert!(!b.shared.check());
    }

    #[test]
    fn suspending_stops_a_held_build() {
        let b = builder();
        let _hold = b.hold();
        let shared = b.shared.clone();
        let t = std::thread::spawn(move || shared.check());
        until_waiting(&b);
        b.suspend();
        assert!(t.join().unwrap(), "a suspended build must stop");
    }
}
