//! A live snapshot, as steps that can only be taken in order: each step
//! consumes the value of the one before and returns the next
//! (`#[must_use]`), and the chain is replaced only inside [`Drained::switch`],
//! through the proof of the pause, which holds the exclusive right
//! ([`Quiesced`]: the sequence of [`crate::handle`]):
//!
//! 1. [`Admitted::check`]: the exclusive right, and the request checked;
//! 2. [`Admitted::prepare`]: the new top made, opened and locked, the old
//!    top written back while the guest runs;
//! 3. [`Prepared::pause`]: new requests wait, those using the old chain
//!    drain (the proof of it holds the pause);
//! 4. [`Drained::switch`]: the successor chain made and put in place; the
//!    pause ends;
//! 5. [`Switched::retire`]: the old top's last tables written back and
//!    closed, the report.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use sqcow2_format::{Chain, PreparedTop};
use tracing::{info, warn};

use super::cpu_wait::{self, ThreadTime};
use super::index_builder::BuildHold;
use super::protocol::{FailureKind, SnapshotResult, SnapshotSteps};
use super::{
    fail, inside_backing_root, new_top_failure, unix_us, CreatedTop, Failure, Shared,
    PRE_PAUSE_ROUNDS, PRE_PAUSE_SETTLED, RAISE_JOBS_AFTER, SLOW_SWITCH_STEP,
    SNAPSHOT_DRAIN_TIMEOUT,
};
use crate::device::handle::{Exclusive, Quiesced};
use crate::realtime::RealtimeSection;

/// Takes a live snapshot of the served chain into the new file `new`.
/// While the guest runs: the new top created (empty, over the old top),
/// made durable and opened, the old top written back. Then the pause,
/// whose work does not grow with the disk or the chain: new requests
/// wait, those in flight finish what they do on the old chain (engine
/// jobs not begun run after the switch), the new chain is made from the
/// old one (a header read; it reads what the old top has not written back
/// yet from memory) and switched to. After it, while the guest runs: the
/// old top's last tables written back, it closed and made durable
/// (journal ended, spare clusters given back, dirty bit cleared), then,
/// in the background, the new top's index built and installed; until
/// then the old top is walked above the old index.
pub(super) fn live_snapshot(shared: &Shared, new: &Path) -> Result<SnapshotResult, Failure> {
    let admitted = Admitted::check(shared, new)?;
    let prepared = admitted.prepare()?;
    let drained = prepared.pause()?;
    let switched = drained.switch()?;
    Ok(switched.retire())
}

/// Step 1: the exclusive right is held (no other snapshot, merge switch,
/// handover or stop meanwhile) and the request is acceptable.
#[must_use]
pub(super) struct Admitted<'s> {
    shared: &'s Shared,
    new: &'s Path,
    right: Exclusive<'s>,
}

impl<'s> Admitted<'s> {
    pub(super) fn check(shared: &'s Shared, new: &'s Path) -> Result<Self, Failure> {
        let right = shared.take_right_to_replace()?;
        if !shared.is_active() {
            return Err(fail(
                FailureKind::Inactive,
                "the daemon is inactive: activate it first",
            ));
        }
        if new.as_os_str().is_empty() {
            return Err(fail(FailureKind::BadRequest, "path is empty"));
        }
        // Anything there, a dangling symlink included.
        if std::fs::symlink_metadata(new).is_ok() {
            return Err(fail(
                FailureKind::Exists,
                format!("{} exists", new.display()),
            ));
        }
        inside_backing_root(shared, new, FailureKind::SnapshotFailed)?;
        Ok(Admitted { shared, new, right })
    }

    /// Step 2: everything that can be done while the guest runs.
    pub(super) fn prepare(self) -> Result<Prepared<'s>, Failure> {
        let shared = self.shared;
        let begin = Instant::now();
        let started_unix_us = unix_us();
        let current = shared.handle.get();
        // An old top an earlier snapshot could not close (below) is closed
        // now, while the guest runs; if it still fails, it stays open below
        // the new top too.
        if let Err(e) = current.handover().close_unclosed_below() {
            warn!(error = %e, "closing an earlier snapshot's old top failed again: it stays open");
        }
        // The new top, complete and durable under its name before the pause
        // (an empty image over the old top: the old top may go on changing
        // below it). The daemon holds the chain's image locks itself.
        let top = current.top().path().to_path_buf();
        // Made in the new top's directory, opened once inside the backing
        // root; refused if its name or its side files' are taken.
        let created = sqcow2_format::indexing::snapshot_over(
            &current,
            &top,
            self.new,
            shared.options.backing_root.as_deref(),
        )
        .map_err(|e| {
            let kind = match e.kind {
                sqcow2_format::ErrorKind::NameInUse { .. } => FailureKind::Exists,
                _ => FailureKind::SnapshotFailed,
            };
            fail(kind, e.to_string())
        })?;
        // Removes the new top unless the switch happened.
        let created = CreatedTop {
            file: created,
            switched: false,
        };
        // Opened, locked and given its mapping journal (a sync) before the
        // pause too.
        let next_top = current
            .handover()
            .prepare_successor(&created.file, &shared.options)
            .map_err(new_top_failure)?;
        // Then what the guest wrote written back while it still runs, in
        // rounds until one is short (each writes back what was written
        // during the one before): each round a plain sync of the file
        // (holding nothing: writes that must publish do not wait behind
        // it), then a publish (the mappings in crash-safe order; its syncs
        // find little to do after that sync). Nothing in the pause needs it
        // (the next chain reads the old top's tables from memory until the
        // close), but the pause then comes when the device has just written
        // the old top back, and engine jobs in flight, which the pause
        // waits for, are not stuck behind that write-back. Measured at 1 TiB
        // (stop 31, 20 snapshots): without the rounds pause p50 2.7-3.0 ms
        // and p99 58-85 ms, all slow drains waiting for engine jobs; with
        // one round p50 0.4 ms, p99 40 ms. They stall the guest's writes to
        // the same file meanwhile (at 10 GiB the longest request overlapping
        // a snapshot 36-39 ms with them against 26 ms without, the load's
        // own tail 23-30 ms).
        let write_back_failed = |e: sqcow2_format::Error| {
            fail(
                FailureKind::IoError,
                format!("flush before the snapshot: {e}"),
            )
        };
        for _ in 0..PRE_PAUSE_ROUNDS {
            let round = Instant::now();
            current
                .durability()
                .sync_data()
                .map_err(write_back_failed)?;
            current.durability().publish().map_err(write_back_failed)?;
            if round.elapsed() < PRE_PAUSE_SETTLED {
                break;
            }
        }
        let Admitted { shared, new, right } = self;
        Ok(Prepared {
            new_top: NewTop {
                next_top,
                created,
                top,
                started_unix_us,
                prepared: begin.elapsed(),
            },
            shared,
            new,
            right,
        })
    }
}

/// The new top, made before the pause. (Fields drop in this order: the
/// unused new top is closed, then its file removed, if it was not
/// switched to.)
struct NewTop {
    next_top: PreparedTop,
    created: CreatedTop,
    /// The old top.
    top: PathBuf,
    started_unix_us: u64,
    prepared: Duration,
}

/// Step 2 done: the new top is ready to take over. (Dropped, the new top
/// goes before the exclusive right is given back.)
#[must_use]
pub(super) struct Prepared<'s> {
    new_top: NewTop,
    right: Exclusive<'s>,
    shared: &'s Shared,
    new: &'s Path,
}

impl<'s> Prepared<'s> {
    /// Step 3: new requests wait, those using the old chain drain.
    pub(super) fn pause(self) -> Result<Drained<'s>, Failure> {
        let Prepared {
            new_top,
            right,
            shared,
            new,
        } = self;
        // From here to the end of the pause this thread runs ahead of the
        // normal threads (where allowed).
        let realtime = RealtimeSection::enter(shared.realtime_pause);
        let cpu_wait_before = cpu_wait::thread_cpu_wait();
        let start = Instant::now();
        let paused_unix_us = unix_us();
        // A background index build (of an earlier snapshot) waits while the
        // guest does, and until the old top is closed: the pause's few
        // milliseconds of work get the CPUs, and no build records the old
        // top before its close changes its header.
        let build_held = shared.index_builder.hold();
        // No new request starts; those in flight complete (the workers keep
        // running, nothing they do waits for this thread), except engine
        // jobs that have not begun: they look the chain up when they begin,
        // after the switch, and write into the new top (as if the guest had
        // sent them after the snapshot: none of them had been completed).
        let pause = right.pause_for_switch();
        // The engine jobs it waits for, to tell afterwards whether they ran,
        // waited for a CPU or slept (a procfs read per job, ~10 us, none
        // when no job has begun).
        let jobs = cpu_wait::ThreadsSince::sample(shared.gate().begun_threads());
        // Jobs still running after a moment run real-time too until they
        // end (where this thread could be raised): one job waited 9.9 ms for
        // a CPU in a 10.5 ms drain.
        let raised = (realtime.raised() && !shared.gate().off_chain_within(RAISE_JOBS_AFTER))
            .then(|| shared.gate().raise_begun_threads());
        // The pause from here on is the proof's: it ends with it.
        let quiet = match pause.off_chain(SNAPSHOT_DRAIN_TIMEOUT) {
            Ok(quiet) => quiet,
            Err(pause) => {
                // The guest goes on first; then the new top is closed and
                // removed, then the right given back.
                let right = pause.resume();
                drop(raised);
                drop(build_held);
                drop(realtime);
                drop(new_top);
                drop(right);
                return Err(fail(
                    FailureKind::SnapshotFailed,
                    format!("requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}"),
                ));
            }
        };
        let drained = start.elapsed();
        let job_times = jobs.since();
        let raised_jobs = raised.map_or(0, |r| r.count());
        Ok(Drained {
            new_top,
            shared,
            new,
            realtime,
            build_held,
            quiet,
            cpu_wait_before,
            start,
            paused_unix_us,
            drained,
            job_times,
            raised_jobs,
        })
    }
}

/// Step 3 done: nothing uses the old chain, and nothing starts to while
/// `quiet` (which holds the pause and the exclusive right) lives.
#[must_use]
pub(super) struct Drained<'s> {
    /// (Dropped first, unless taken apart in order: the new top is removed
    /// before the pause ends and the right is given back.)
    new_top: NewTop,
    quiet: Quiesced<'s>,
    build_held: BuildHold<'s>,
    realtime: RealtimeSection,
    cpu_wait_before: Option<Duration>,
    start: Instant,
    paused_unix_us: u64,
    drained: Duration,
    job_times: Vec<ThreadTime>,
    raised_jobs: usize,
    shared: &'s Shared,
    new: &'s Path,
}

impl<'s> Drained<'s> {
    /// Step 4: the successor chain made and put in place; the pause ends.
    pub(super) fn switch(self) -> Result<Switched<'s>, Failure> {
        let Drained {
            quiet,
            build_held,
            realtime,
            cpu_wait_before,
            start,
            paused_unix_us,
            drained,
            job_times,
            raised_jobs,
            new_top,
            shared,
            new,
        } = self;
        let NewTop {
            next_top,
            mut created,
            top,
            started_unix_us,
            prepared,
        } = new_top;
        let old = quiet.current();
        let switch_start = Instant::now();
        // Nothing written here: the new chain reads the old top's last
        // tables from its writer's memory (nothing changes them any more)
        // until the close after the pause has written them back, and its
        // flushes flush the old top meanwhile. A process death first leaves
        // the old top's journal, which the next open replays.
        let chain = match old.handover().successor(next_top, &shared.options) {
            Ok(chain) => chain,
            Err(e) => {
                // The guest goes on first; then the new top is removed,
                // then the right given back.
                let right = quiet.resume();
                drop(build_held);
                drop(realtime);
                drop(created);
                drop(right);
                return Err(new_top_failure(e));
            }
        };
        let made = switch_start.elapsed();
        let layers = chain.layers().len();
        let indexed = chain.index().is_used();
        let old = {
            drop(old);
            quiet.replace(chain)
        };
        created.switched = true;
        let replaced = switch_start.elapsed();
        // Read in the pause (a file read, ~10 us), so that the wait counted
        // is the pause's own.
        let cpu_wait_ms = cpu_wait_before
            .zip(cpu_wait::thread_cpu_wait())
            .map_or(0.0, |(a, b)| b.saturating_sub(a).as_secs_f64() * 1000.0);
        // The pause ends; the right stays held until the old top is retired.
        let right = quiet.resume();
        let pause_ms = start.elapsed().as_secs_f64() * 1000.0;
        let realtime_pause = realtime.raised();
        drop(realtime);
        if replaced >= SLOW_SWITCH_STEP {
            info!(
                made_ms = made.as_secs_f64() * 1000.0,
                replaced_ms = replaced.as_secs_f64() * 1000.0,
                cpu_wait_ms,
                "a live snapshot's switch was slow"
            );
        }
        Ok(Switched {
            shared,
            new,
            _right: right,
            old,
            top,
            build_held,
            layers,
            indexed,
            pause_ms,
            realtime_pause,
            cpu_wait_ms,
            prepared,
            drained,
            job_times,
            raised_jobs,
            started_unix_us,
            paused_unix_us,
        })
    }
}

/// Step 4 done: the new chain serves; the old top is still open.
#[must_use]
pub(super) struct Switched<'s> {
    old: Arc<Chain>,
    top: PathBuf,
    build_held: BuildHold<'s>,
    layers: usize,
    indexed: bool,
    pause_ms: f64,
    realtime_pause: bool,
    cpu_wait_ms: f64,
    prepared: Duration,
    drained: Duration,
    job_times: Vec<ThreadTime>,
    raised_jobs: usize,
    started_unix_us: u64,
    paused_unix_us: u64,
    shared: &'s Shared,
    new: &'s Path,
    /// Given back last.
    _right: Exclusive<'s>,
}

impl Switched<'_> {
    /// Step 5: the old top closed (its last tables written back and made
    /// durable; then the new chain reads them from the file); the report.
    /// If the close fails, the old top stays open: the new chain reads its
    /// tables from memory and flushes it at its flushes, and the index
    /// build woken here (or the next snapshot) closes it; a process death
    /// first leaves it to the next read-write open of the chain, which
    /// repairs it.
    pub(super) fn retire(self) -> SnapshotResult {
        let shared = self.shared;
        let retire_start = Instant::now();
        let next = shared.handle.get();
        // Writes completed on the old top just before the switch whose
        // mappings are not journaled (a new L2 table) wait in the flusher
        // for a publish through the old top's writer, whose flush order the
        // close holds through all its syncs: published first, they wait for
        // this publish only (nothing to do, no syscall, when none is
        // waiting). A failure is the flusher's to report; the close tries
        // again.
        if let Err(e) = next.durability().publish() {
            warn!(error = %e, "publishing the old top's last changes failed");
        }
        if let Err(e) = self.old.handover().retire(&next) {
            warn!(path = %self.top.display(), error = %e, "closing the old top after the snapshot failed: the next index build or snapshot tries again");
        }
        // The tables the old top used last, to the cache the new chain
        // reads it through (0.4-1.8 ms of copying at 1 TiB).
        self.old.handover().tables();
        let retired = retire_start.elapsed();
        drop(next);
        drop(self.old);
        drop(self.build_held);
        shared.index_builder.wake();
        shared
            .pauses_ms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(self.pause_ms);
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let job_times = &self.job_times;
        if self.drained >= SLOW_SWITCH_STEP {
            info!(
                drain_ms = ms(self.drained),
                jobs = %job_times
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
                "a live snapshot's drain was slow"
            );
        }
        let steps = SnapshotSteps {
            prepare_ms: ms(self.prepared),
            drain_ms: ms(self.drained),
            switch_ms: self.pause_ms - ms(self.drained),
            close_ms: ms(retired),
            cpu_wait_ms: self.cpu_wait_ms,
            drain_jobs: job_times.len(),
            drain_jobs_raised: self.raised_jobs,
            // (A float sum of nothing is -0.0.)
            drain_jobs_cpu_wait_ms: job_times.iter().fold(0.0, |a, t| a + t.cpu_wait_ms),
            drain_jobs_blocked_ms: job_times.iter().map(|t| t.blocked_ms).fold(0.0, f64::max),
            realtime: self.realtime_pause,
        };
        let new = self.new;
        info!(
            new = %new.display(),
            layers = self.layers,
            pause_ms = self.pause_ms,
            prepare_ms = steps.prepare_ms,
            drain_ms = steps.drain_ms,
            switch_ms = steps.switch_ms,
            close_ms = steps.close_ms,
            cpu_wait_ms = steps.cpu_wait_ms,
            drain_jobs = steps.drain_jobs,
            realtime = steps.realtime,
            "live snapshot"
        );
        SnapshotResult {
            path: new.to_path_buf(),
            layers: self.layers,
            indexed: self.indexed,
            pause_ms: self.pause_ms,
            steps,
            started_unix_us: self.started_unix_us,
            paused_unix_us: self.paused_unix_us,
        }
    }
}
