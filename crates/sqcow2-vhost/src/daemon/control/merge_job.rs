//! A live merge (`merge` on the control socket): layers i..j of the served
//! chain copied into a new file in the background, then, inside a pause as
//! short as a live snapshot's, the layer above them switched onto it and
//! the chain reopened. The merged layers are immutable (below the top), so
//! the copy finishes whatever the guest does; it can be paced by a byte
//! rate and by the guest's own latency.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqcow2_format::reshape::{prepare_merge, LayerRef, MergedFile, PreparedMerge, RateLimit};
use sqcow2_format::{Chain, ChainOptions, Locking};
use tracing::{info, warn};

use super::protocol::{
    Failure, FailureKind, MergeCounters, MergeRequest, MergeStarted, MergeState,
};
use super::{Shared, Term, SNAPSHOT_DRAIN_TIMEOUT};
use crate::device::handle::Quiesced;

/// One window of the guest's latency measured before a latency-paced
/// copy.
const BASELINE: Duration = Duration::from_secs(1);
/// Windows whose median p99 is the baseline: one window's p99 varied
/// 110-370 us under a steady load (the kernel's write-back comes in
/// bursts), and a high one let the copy raise the client's p99 4.4x.
const BASELINE_WINDOWS: usize = 5;
/// Baseline windows tried before a latency-paced copy goes unpaced (the
/// guest does no I/O: nothing to protect); a frontend connecting may take
/// seconds to send its first request.
const BASELINE_TRIES: u32 = 15;
/// The window a latency-paced copy looks at.
const WINDOW: Duration = Duration::from_millis(200);
/// How long a latency-paced copy waits when the window is above the limit.
const BACKOFF: Duration = Duration::from_millis(20);

/// The merge of this daemon (one at a time) and its counters.
#[derive(Debug, Default)]
pub struct MergeJob {
    counters: Mutex<MergeCounters>,
    pub(super) running: AtomicBool,
    cancel: AtomicBool,
    /// The daemon stops: no merge starts (set under the counters' lock).
    stopped: AtomicBool,
    /// A live commit mirrors the served chain: nothing may replace it but
    /// the commit's own switch (set before the commit takes the right).
    committing: AtomicBool,
}

/// Clears `running` when the merge thread ends, however it ends.
pub(super) struct Running<'a>(pub(super) &'a AtomicBool);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

fn fail(kind: FailureKind, message: impl Into<String>) -> Failure {
    Failure::new(kind, message)
}

/// Clears the commit flag when a live commit ends, however it ends.
pub(super) struct Committing<'a>(pub(super) &'a AtomicBool);

impl Drop for Committing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Checks a job's pacing options (a rate limit above 0, a p99 limit of
/// at least 1.0x).
pub(super) fn check_pacing(
    rate_limit: Option<u64>,
    max_p99_permille: Option<u32>,
) -> Result<(), Failure> {
    if rate_limit == Some(0) {
        return Err(fail(FailureKind::BadRequest, "rate-limit must be above 0"));
    }
    if max_p99_permille.is_some_and(|p| p < 1000) {
        return Err(fail(
            FailureKind::BadRequest,
            "max-p99-permille must be at least 1000 (1.0x the latency before the job)",
        ));
    }
    Ok(())
}

impl MergeJob {
    pub(super) fn counters(&self) -> std::sync::MutexGuard<'_, MergeCounters> {
        self.counters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The last merge's counters.
    pub fn snapshot(&self) -> MergeCounters {
        self.counters().clone()
    }

    /// Asks the running merge to stop (under the counters' lock, which
    /// a start holds while it clears the flag: a cancel is never lost).
    pub fn cancel(&self) -> bool {
        let _c = self.counters();
        let running = self.running.load(Ordering::Acquire);
        if running {
            self.cancel.store(true, Ordering::Release);
        }
        running
    }

    /// For a stop: no merge starts any more, the running one is asked to
    /// stop, and this waits (at most `timeout`) until its thread has
    /// ended: its file removed, or its switch done. Whether no merge runs
    /// any more.
    pub fn stop(&self, timeout: Duration) -> bool {
        {
            let _c = self.counters();
            self.stopped.store(true, Ordering::Release);
        }
        self.cancel();
        self.wait_ended(timeout)
    }

    /// Whether a merge runs (copies, or waits for its switch).
    fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }

    /// Waits (at most `timeout`) until no merge runs; whether none does.
    pub(crate) fn wait_ended(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.is_running() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    /// Records how the job's thread (`what`: "merge", "commit") ended.
    pub(super) fn ended(
        &self,
        what: &str,
        begin: Instant,
        outcome: std::thread::Result<Result<(), MergeEnd>>,
    ) {
        let mut c = self.counters();
        c.elapsed_ms = begin.elapsed().as_secs_f64() * 1e3;
        match outcome {
            Ok(Ok(())) => c.state = MergeState::Done,
            Ok(Err(MergeEnd::Cancelled(why))) => {
                info!(why, "{what} cancelled");
                c.state = MergeState::Cancelled;
                c.error = Some(why.into());
            }
            Ok(Err(MergeEnd::Failed(e))) => {
                warn!(error = %e, "{what} failed");
                c.state = MergeState::Failed;
                c.error = Some(e);
            }
            Err(_) => {
                c.state = MergeState::Failed;
                c.error = Some(format!("the {what} panicked (a bug)"));
            }
        }
    }

    /// The flag [`Committing`] clears.
    pub(super) fn committing_flag(&self) -> &AtomicBool {
        &self.committing
    }

    /// Whether a cancel was asked for the running job.
    pub(super) fn cancel_asked(&self) -> bool {
        self.cancelled()
    }

    /// Whether a live commit mirrors the served chain (a snapshot, resize
    /// or activation must not replace it).
    pub(super) fn committing(&self) -> bool {
        self.committing.load(Ordering::Acquire)
    }

    /// Takes the one job slot: `busy` if a merge or commit runs, refused
    /// once the daemon stops. `commit`: the job is a live commit.
    pub(super) fn claim(&self, commit: bool) -> Result<Running<'_>, Failure> {
        let _c = self.counters();
        if self.stopped.load(Ordering::Acquire) {
            return Err(fail(FailureKind::Busy, "the daemon is stopping"));
        }
        if self
            .running
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(fail(FailureKind::Busy, "a merge or commit is running"));
        }
        self.cancel.store(false, Ordering::Release);
        if commit {
            self.committing.store(true, Ordering::Release);
        }
        Ok(Running(&self.running))
    }

    /// Starts a merge: checks the range and creates the file now (an
    /// error is the reply), copies and switches in a background thread.
    pub fn start(shared: &Arc<Shared>, request: &MergeRequest) -> Result<MergeStarted, Failure> {
        let job = &shared.merge;
        check_pacing(request.rate_limit, request.max_p99_permille)?;
        // `running` is set before the activity is read: an inactivation
        // after this read ends the term, which the merge sees.
        let running = job.claim(false)?;
        let Some(term) = shared.term() else {
            return Err(fail(FailureKind::Inactive, "the daemon is inactive"));
        };
        if request.path.as_os_str().is_empty() {
            return Err(fail(FailureKind::BadRequest, "path is empty"));
        }
        // Anything there, a dangling symlink included.
        if std::fs::symlink_metadata(&request.path).is_ok() {
            return Err(fail(
                FailureKind::Exists,
                format!("{} exists", request.path.display()),
            ));
        }
        let chain = shared.handle.get();
        if !chain.is_writable() {
            return Err(fail(
                FailureKind::MergeFailed,
                "the chain is served read-only",
            ));
        }
        super::inside_backing_root(shared, &request.path, FailureKind::MergeFailed)?;
        let first: LayerRef = (&request.first).into();
        let last: LayerRef = (&request.last).into();
        let prepared = prepare_merge(
            &chain,
            &first,
            &last,
            &request.path,
            shared.options.backing_root.as_deref(),
        )
        .map_err(|e| fail(FailureKind::MergeFailed, e.to_string()))?;
        drop(chain);
        let (a, b) = prepared.range();
        let started = MergeStarted {
            path: request.path.clone(),
            first: a.0,
            last: b.0,
            replaced: prepared.replaced().to_vec(),
        };
        *job.counters() = MergeCounters {
            state: MergeState::Copying,
            path: Some(request.path.clone()),
            first: a.0,
            last: b.0,
            replaced: started.replaced.clone(),
            ..MergeCounters::default()
        };
        let thread_shared = shared.clone();
        let request = request.clone();
        std::mem::forget(running);
        let spawned = std::thread::Builder::new()
            .name("sqcow2-merge".into())
            .spawn(move || {
                let shared = thread_shared;
                let _running = Running(&shared.merge.running);
                let begin = Instant::now();
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(&shared, term, prepared, &request)
                }));
                shared.merge.ended("merge", begin, outcome);
            });
        if let Err(e) = spawned {
            job.running.store(false, Ordering::Release);
            return Err(fail(
                FailureKind::MergeFailed,
                format!("cannot start the merge: {e}"),
            ));
        }
        Ok(started)
    }
}

/// How a merge ended without its switch.
pub(super) enum MergeEnd {
    /// Stopped before the switch (its file removed): why.
    Cancelled(&'static str),
    /// An error.
    Failed(String),
}

impl From<String> for MergeEnd {
    fn from(e: String) -> Self {
        MergeEnd::Failed(e)
    }
}

/// What a merge stopped by `merge-cancel` or a stop reports.
pub(super) const CANCELLED: &str = "cancelled";
/// What a merge stopped by an inactivation (a handover) reports.
pub(super) const INACTIVATED: &str = "cancelled: the daemon was inactivated";

/// Why the merge begun in `term` must stop before its switch, if it
/// must (for good: a cancel stays until the next merge, a term ends once).
pub(super) fn must_stop(shared: &Shared, term: Term) -> Option<&'static str> {
    if shared.merge.cancelled() {
        Some(CANCELLED)
    } else if !shared.holds(term) {
        // Another process may have owned, and changed, the chain since.
        Some(INACTIVATED)
    } else {
        None
    }
}

/// The guest's latency now, all queues together (`None`: no frontend).
fn latencies(shared: &Shared) -> Option<hdrhistogram::Histogram<u64>> {
    shared.session().map(|b| b.latency_histogram())
}

/// p99 of the requests completed between two histograms (`None`: fewer
/// than [`MIN_SAMPLES`]).
fn window_p99(
    before: &hdrhistogram::Histogram<u64>,
    now: &hdrhistogram::Histogram<u64>,
) -> Option<u64> {
    let mut w = now.clone();
    w.subtract(before).ok()?;
    (w.len() >= MIN_SAMPLES).then(|| w.value_at_quantile(0.99))
}

/// Requests a window needs for its p99 to count: a frontend's first few
/// requests gave a baseline of 63 us against 500-600 us under the steady
/// load, and the guard then throttled the whole commit.
const MIN_SAMPLES: u64 = 200;

/// The copy's rate a latency guard starts at: a 4 MiB/s copy beside a
/// 70/30 load at depth 16 left its p99 unchanged (docs/measured.md).
const GUARD_START_RATE: f64 = 4.0 * 1048576.0;
/// The least a latency guard lets the copy go: it always finishes.
const GUARD_MIN_RATE: f64 = 1048576.0;
/// What a window within the limit adds to the copy's rate.
const GUARD_STEP: f64 = 1048576.0;

/// Paces a copy by the guest's p99 latency, as a rate (AIMD): each
/// window within the limit adds [`GUARD_STEP`] per second, a window above
/// it halves the rate (down to [`GUARD_MIN_RATE`]). The copy moves at the
/// rate in between, never in bursts: a copy let go at full speed until
/// the guest's latency rises has already hurt it by then.
struct LatencyGuard {
    limit_us: u64,
    last: Option<hdrhistogram::Histogram<u64>>,
    at: Instant,
    /// Bytes per second the copy may write now.
    rate: f64,
    /// Bytes written since `at`.
    written: u64,
}

impl LatencyGuard {
    /// Measures the baseline p99 (over [`BASELINE`]); `None` when the
    /// guest does no I/O meanwhile (nothing to protect).
    fn measure(shared: &Shared, permille: u32) -> Option<(LatencyGuard, u64)> {
        // A frontend that has just connected (or reconnects) may not have
        // completed requests yet: a few more windows are tried.
        let mut p99s = Vec::new();
        // A window's end is the next one's start.
        let mut last = None;
        for _ in 0..BASELINE_TRIES + BASELINE_WINDOWS as u32 {
            let Some(before) = last.take().or_else(|| latencies(shared)) else {
                std::thread::sleep(BASELINE / 5);
                continue;
            };
            std::thread::sleep(BASELINE);
            last = latencies(shared);
            if let Some(p) = last.as_ref().and_then(|now| window_p99(&before, now)) {
                p99s.push(p);
                if p99s.len() == BASELINE_WINDOWS {
                    break;
                }
            }
        }
        if p99s.is_empty() {
            return None;
        }
        let now = last.or_else(|| latencies(shared))?;
        p99s.sort_unstable();
        let base = p99s[p99s.len() / 2];
        let limit_us = base * u64::from(permille) / 1000;
        Some((
            LatencyGuard {
                limit_us: limit_us.max(1),
                last: Some(now),
                at: Instant::now(),
                rate: GUARD_START_RATE,
                written: 0,
            },
            base,
        ))
    }

    /// After `written` bytes: waits until the rate allows them, and at
    /// the end of each window (at least [`WINDOW`]) sets the rate by the
    /// window's p99. Returns the time waited and the last window's p99.
    fn pace(&mut self, shared: &Shared, written: u64, stop: &dyn Fn() -> bool) -> (Duration, u64) {
        self.written += written;
        let started = Instant::now();
        let due = self.at + Duration::from_secs_f64(self.written as f64 / self.rate);
        while !stop() {
            let now = Instant::now();
            if now >= due {
                break;
            }
            std::thread::sleep((due - now).min(BACKOFF));
        }
        let waited = started.elapsed();
        if self.at.elapsed() < WINDOW {
            return (waited, 0);
        }
        let Some(now) = latencies(shared) else {
            return (waited, 0);
        };
        let p = self.last.as_ref().and_then(|l| window_p99(l, &now));
        let seconds = self.at.elapsed().as_secs_f64();
        self.last = Some(now);
        self.at = Instant::now();
        self.written = 0;
        match p {
            Some(v) if v > self.limit_us => {
                self.rate = (self.rate / 2.0).max(GUARD_MIN_RATE);
                (waited, v)
            }
            Some(v) => {
                self.rate += GUARD_STEP * seconds;
                (waited, v)
            }
            None => (waited, 0),
        }
    }
}

/// Paces a job's copy (a rate limit, the guest's p99) and keeps its
/// progress in the counters.
pub(super) struct Pacer<'a> {
    shared: &'a Shared,
    term: Term,
    limit: Option<RateLimit>,
    guard: Option<LatencyGuard>,
    last_note: Instant,
    done: u64,
    total: u64,
    written: u64,
    throttled: Duration,
}

impl<'a> Pacer<'a> {
    /// Measures the guest's baseline first when a p99 limit is asked.
    pub(super) fn new(
        shared: &'a Shared,
        term: Term,
        rate_limit: Option<u64>,
        max_p99_permille: Option<u32>,
    ) -> Pacer<'a> {
        let job = &shared.merge;
        let mut guard = None;
        if let Some(permille) = max_p99_permille {
            job.counters().state = MergeState::Measuring;
            if let Some((g, base)) = LatencyGuard::measure(shared, permille) {
                job.counters().baseline_p99_us = base;
                guard = Some(g);
            }
            job.counters().state = MergeState::Copying;
        }
        Pacer {
            shared,
            term,
            limit: rate_limit.map(RateLimit::new),
            guard,
            last_note: Instant::now(),
            done: 0,
            total: 0,
            written: 0,
            throttled: Duration::ZERO,
        }
    }

    /// After a step of the copy: `(done, total)` bytes looked at, `written`
    /// just now. Waits as the limits say; whether to go on.
    pub(super) fn step(&mut self, done: u64, total: u64, written: u64) -> bool {
        let (shared, term) = (self.shared, self.term);
        self.written += written;
        (self.done, self.total) = (done, total);
        let stop = || must_stop(shared, term).is_some();
        if let Some(l) = &mut self.limit {
            self.throttled += l.charge_unless(written, &stop);
        }
        let mut p99 = None;
        if let Some(g) = &mut self.guard {
            let (w, p) = g.pace(shared, written, &stop);
            self.throttled += w;
            p99 = Some(p);
        }
        if self.last_note.elapsed() > Duration::from_millis(50) || done == total {
            self.last_note = Instant::now();
            self.note();
            if let Some(p) = p99.filter(|p| *p > 0) {
                shared.merge.counters().window_p99_us = p;
            }
        }
        !stop()
    }

    /// Puts the progress in the counters.
    pub(super) fn note(&self) {
        let mut c = self.shared.merge.counters();
        c.done_bytes = self.done;
        c.total_bytes = self.total;
        c.written_bytes = self.written;
        c.throttled_ms = self.throttled.as_secs_f64() * 1e3;
    }
}

fn run(
    shared: &Shared,
    term: Term,
    prepared: PreparedMerge,
    request: &MergeRequest,
) -> Result<(), MergeEnd> {
    let locking = shared.options.locking;
    let mut pacer = Pacer::new(shared, term, request.rate_limit, request.max_p99_permille);
    let filled = prepared.fill(locking, &mut |done, total, written| {
        pacer.step(done, total, written)
    });
    pacer.note();
    if let Some(why) = must_stop(shared, term) {
        return Err(MergeEnd::Cancelled(why));
    }
    filled.map_err(|e| e.to_string())?;
    // The daemon holds the chain's image locks: the new file's index
    // build takes none, and stops when the term ends (the inactivation
    // waits for it before its reply).
    let published = prepared.publish(Locking::Off, &|| must_stop(shared, term).is_some());
    if let Some(why) = must_stop(shared, term) {
        // A published file removed here; one not published went with
        // its temporary name (a file at its name would be somebody
        // else's).
        if let Ok(merged) = &published {
            merged.remove();
        }
        return Err(MergeEnd::Cancelled(why));
    }
    let merged = published.map_err(|e| e.to_string())?;
    shared.merge.counters().state = MergeState::Switching;
    match switch(shared, term, &merged) {
        Ok(()) => Ok(()),
        Err(SwitchError::Inactivated) => {
            merged.remove();
            Err(MergeEnd::Cancelled(INACTIVATED))
        }
        Err(SwitchError::NotSwitched(e)) => {
            merged.remove();
            Err(MergeEnd::Failed(e))
        }
        Err(SwitchError::Switched(e)) => Err(MergeEnd::Failed(e)),
    }
}

/// How a switch failed.
enum SwitchError {
    /// The merge's term ended before the switch (nothing switched).
    Inactivated,
    /// The files still describe the old chain (the merge file is not
    /// referenced).
    NotSwitched(String),
    /// The layer above names the merge file on disk, but the daemon could
    /// not reopen the chain: it serves the old one, which reads the same
    /// data; the next start opens the new one.
    Switched(String),
}

/// The pause: requests drained, the chain flushed clean, the layer above
/// the merged ones switched onto the new file, the chain reopened (its
/// open files reused), requests resumed; the top's index built after.
fn switch(shared: &Shared, term: Term, merged: &MergedFile) -> Result<(), SwitchError> {
    // No snapshot, activation, handover or stop meanwhile.
    let right = shared.handle.exclusive();
    if !shared.holds(term) {
        return Err(SwitchError::Inactivated);
    }
    // No build writes the top's index for the chain being replaced; they
    // run again when `resumed` drops, which is always before the right is
    // given back (an inactivation that took the right next must find
    // builds suspended as it left them).
    shared.index_builder.suspend();
    let resumed = Resume(shared);
    // Most dirty metadata written back while the guest still runs: the
    // flush inside the pause then has little left (a merge's first run
    // flushed everything inside it: 113-138 ms under a 70/30 load).
    if let Err(e) = shared.handle.get().flush_clean() {
        drop(resumed);
        return Err(SwitchError::NotSwitched(format!(
            "flush before the switch: {e}"
        )));
    }
    let start = Instant::now();
    let (right, switched) = match right.pause().idle(SNAPSHOT_DRAIN_TIMEOUT) {
        Ok(quiet) => {
            let switched = switch_paused(shared, &quiet, merged);
            // The pause ends.
            (quiet.resume(), switched)
        }
        Err(pause) => (
            pause.resume(),
            Err(SwitchError::NotSwitched(format!(
                "requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}"
            ))),
        ),
    };
    let pause_ms = start.elapsed().as_secs_f64() * 1e3;
    let layers = switched.map(|(layers, old)| {
        drop(old);
        layers
    });
    drop(resumed);
    drop(right);
    let layers = layers?;
    {
        let mut c = shared.merge.counters();
        c.pause_ms = pause_ms;
        c.layers_after = layers;
    }
    info!(merged = %merged.path().display(), layers, pause_ms, "live merge switched");
    Ok(())
}

/// [`switch`]'s part inside the pause (`quiet`): the chain flushed clean,
/// the layer above switched onto the merge file, the chain reopened and
/// put in place. The new chain's layer count and the old chain (dropped
/// by the caller after the pause).
fn switch_paused(
    shared: &Shared,
    quiet: &Quiesced<'_>,
    merged: &MergedFile,
) -> Result<(usize, Arc<Chain>), SwitchError> {
    use SwitchError::{NotSwitched, Switched};
    let old = quiet.current();
    old.flush_clean()
        .map_err(|e| NotSwitched(format!("flush before the switch: {e}")))?;
    if let Err(e) = merged.switch_in(&old) {
        // Another file at the layer's name: refused before anything was
        // written (nothing to put back, and nothing to write into it).
        if matches!(e.kind, sqcow2_format::ErrorKind::FileReplaced) {
            return Err(NotSwitched(format!("switching the layer above: {e}")));
        }
        // The header may have been written before the error: put the old
        // name back (the chain it names is unchanged).
        return Err(match merged.switch_back(&old) {
            Ok(()) => NotSwitched(format!("switching the layer above: {e}")),
            Err(back) => Switched(format!(
                "switching the layer above: {e}; and putting the old backing file back: {back}"
            )),
        });
    }
    let top = old.top().path().to_path_buf();
    let reopen = ChainOptions {
        // The top's index is rebuilt in the background after the switch.
        stale_index_expected: true,
        ..shared.options.clone()
    };
    // Each layer as it must be: the old chain's, the merge file made by
    // this process in place of the merged ones (a file put at a name
    // meanwhile is refused).
    let reopened = Chain::open_reusing(&top, &reopen, &old).and_then(|c| {
        match merged.check_switched(&old, &c) {
            Ok(()) => Ok(c),
            Err(e) => {
                // Dropped unused: nothing of it written back (the old
                // chain serves on; its writer stores what it holds).
                c.handover().release_top();
                Err(e)
            }
        }
    });
    let chain = match reopened {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "reopening the chain after the merge failed: switching back");
            return Err(match merged.switch_back(&old) {
                Ok(()) => NotSwitched(format!("reopening the chain: {e}")),
                Err(back) => {
                    // The old chain still reads the same data (the merged
                    // files are untouched) and its top still takes writes.
                    warn!(error = %back, "could not switch back: serving the old chain, the files name the new one");
                    Switched(format!("reopening the chain: {e}; switching back: {back}"))
                }
            });
        }
    };
    let layers = chain.layers().len();
    // The old chain's writer is done: nothing it holds is written again
    // (its close would be a no-op after the flush above, and must stay
    // one while the new chain's writer owns the top). Quietly: this is
    // no failure.
    old.handover().release_top();
    drop(old);
    Ok((layers, quiet.replace(chain)))
}

/// Lets index builds run again, and wakes one (the top's index no longer
/// matches the chain), when the switch ends; and starts the served
/// chain's mapping journal again if the flush before the pause ended it
/// and no switch replaced that chain (a switch refused inside the pause):
/// restarted by the guest's next change instead, it made that change and
/// every one after it wait for a publish whose sync covered everything
/// written in place since.
pub(super) struct Resume<'a>(pub(super) &'a Shared);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        // Before the switch gives the right back: an inactivation that took
        // it must not find its suspension of builds undone.
        debug_assert!(
            std::thread::panicking() || self.0.handle.try_exclusive().is_none(),
            "index builds resumed after the right was given back"
        );
        self.0.index_builder.resume();
        self.0.index_builder.wake();
        self.0.handle.get().durability().resume_journal();
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use sqcow2_format::create::{create, CreateOptions};

    use super::*;
    use crate::device::handle::ChainHandle;

    fn image(dir: &Path, name: &str, backing: Option<&str>) -> PathBuf {
        let path = dir.join(name);
        create(
            &path,
            &CreateOptions {
                size: 1 << 20,
                backing_file: backing.map(Into::into),
                backing_format: backing.map(|_| "qcow2".into()),
                ..CreateOptions::default()
            },
        )
        .unwrap();
        path
    }

    /// base <- mid <- top in `dir`; the top's path.
    fn three_layers(dir: &Path) -> PathBuf {
        image(dir, "base.qcow2", None);
        image(dir, "mid.qcow2", Some("base.qcow2"));
        image(dir, "top.qcow2", Some("mid.qcow2"))
    }

    /// A switch that fails inside its pause lets index builds run again
    /// before it gives the right back (else an inactivation that takes
    /// the right in between has its suspension of builds undone, and a
    /// build writes into images another daemon is about to own).
    #[test]
    fn a_failed_switch_resumes_builds_before_giving_the_right_back() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let options = ChainOptions {
            writable: true,
            locking: Locking::Off,
            use_index: false,
            ..ChainOptions::default()
        };
        // The merge is made from chain A while chain B (other files) is
        // served: the layer above is not found, the switch fails in the
        // pause.
        let chain_a = Chain::open(&three_layers(a.path()), &options).unwrap();
        let chain_b = Chain::open(&three_layers(b.path()), &options).unwrap();
        let shared = Shared::new(Arc::new(ChainHandle::new(chain_b)), options);
        let term = shared.term().unwrap();
        let prepared = prepare_merge(
            &chain_a,
            &LayerRef::Position(0),
            &LayerRef::Position(1),
            &a.path().join("merged.qcow2"),
            None,
        )
        .unwrap();
        prepared.fill(Locking::Off, &mut |_, _, _| true).unwrap();
        let merged = prepared.publish(Locking::Off, &|| false).unwrap();
        let r = switch(&shared, term, &merged);
        // (The layer above is not in the served chain: switching it fails,
        // and so does putting its old backing name back.)
        assert!(
            matches!(
                r,
                Err(SwitchError::NotSwitched(_) | SwitchError::Switched(_))
            ),
            "a merge of another chain must fail inside the pause"
        );
        assert!(shared.handle.try_exclusive().is_some(), "the right is free");
    }
}
