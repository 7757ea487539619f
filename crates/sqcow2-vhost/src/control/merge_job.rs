//! A live merge (`merge` on the control socket): layers i..j of the served
//! chain copied into a new file in the background, then, inside a pause as
//! short as a live snapshot's, the layer above them switched onto it and
//! the chain reopened. The merged layers are immutable (below the top), so
//! the copy finishes whatever the guest does; it can be paced by a byte
//! rate and by the guest's own latency.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqcow2_format::reshape::{prepare_merge, LayerRef, MergedFile, PreparedMerge};
use sqcow2_format::Chain;
use tracing::{info, warn};

use super::protocol::{
    Failure, FailureKind, MergeCounters, MergeRequest, MergeStarted, MergeState,
};
use super::{Shared, SNAPSHOT_DRAIN_TIMEOUT};

/// How long the guest's latency is measured before a latency-paced copy.
const BASELINE: Duration = Duration::from_secs(1);
/// The window a latency-paced copy looks at.
const WINDOW: Duration = Duration::from_millis(200);
/// How long a latency-paced copy waits when the window is above the limit.
const BACKOFF: Duration = Duration::from_millis(20);

/// The merge of this daemon (one at a time) and its counters.
#[derive(Debug, Default)]
pub struct MergeJob {
    counters: Mutex<MergeCounters>,
    running: AtomicBool,
    cancel: AtomicBool,
}

/// Clears `running` when the merge thread ends, however it ends.
struct Running<'a>(&'a AtomicBool);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

fn fail(kind: FailureKind, message: impl Into<String>) -> Failure {
    Failure::new(kind, message)
}

impl MergeJob {
    fn counters(&self) -> std::sync::MutexGuard<'_, MergeCounters> {
        self.counters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The last merge's counters.
    pub fn snapshot(&self) -> MergeCounters {
        self.counters().clone()
    }

    /// Asks the running merge to stop.
    pub fn cancel(&self) -> bool {
        let running = self.running.load(Ordering::Acquire);
        if running {
            self.cancel.store(true, Ordering::Release);
        }
        running
    }

    /// Starts a merge: checks the range and creates the file now (an
    /// error is the reply), copies and switches in a background thread.
    pub fn start(shared: &Arc<Shared>, request: &MergeRequest) -> Result<MergeStarted, Failure> {
        let job = &shared.merge;
        if job
            .running
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(fail(FailureKind::Busy, "a merge is running"));
        }
        let running = Running(&job.running);
        if !shared.is_active() {
            return Err(fail(FailureKind::Inactive, "the daemon is inactive"));
        }
        if request.path.exists() {
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
        let first: LayerRef = (&request.first).into();
        let last: LayerRef = (&request.last).into();
        let prepared = prepare_merge(&chain, &first, &last, &request.path)
            .map_err(|e| fail(FailureKind::MergeFailed, e.to_string()))?;
        drop(chain);
        let (a, b) = prepared.range();
        let started = MergeStarted {
            path: request.path.clone(),
            first: a.0,
            last: b.0,
            replaced: prepared.replaced().to_vec(),
        };
        job.cancel.store(false, Ordering::Release);
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
                    run(&shared, prepared, &request)
                }));
                let mut c = shared.merge.counters();
                c.elapsed_ms = begin.elapsed().as_secs_f64() * 1e3;
                match outcome {
                    Ok(Ok(())) => c.state = MergeState::Done,
                    Ok(Err(e)) if shared.merge.cancel.load(Ordering::Acquire) => {
                        c.state = MergeState::Cancelled;
                        c.error = Some(e);
                    }
                    Ok(Err(e)) => {
                        warn!(error = %e, "merge failed");
                        c.state = MergeState::Failed;
                        c.error = Some(e);
                    }
                    Err(_) => {
                        c.state = MergeState::Failed;
                        c.error = Some("the merge panicked (a bug)".into());
                    }
                }
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

/// The guest's latency now, all queues together (`None`: no frontend).
fn latencies(shared: &Shared) -> Option<hdrhistogram::Histogram<u64>> {
    shared.session().map(|b| b.latency_histogram())
}

/// p99 of the requests completed between two histograms (`None`: none).
fn window_p99(
    before: &hdrhistogram::Histogram<u64>,
    now: &hdrhistogram::Histogram<u64>,
) -> Option<u64> {
    let mut w = now.clone();
    w.subtract(before).ok()?;
    (!w.is_empty()).then(|| w.value_at_quantile(0.99))
}

/// Paces a copy by the guest's p99 latency: the copy waits while the
/// last window's p99 exceeds the limit.
struct LatencyGuard {
    limit_us: u64,
    last: Option<hdrhistogram::Histogram<u64>>,
    at: Instant,
}

impl LatencyGuard {
    /// Measures the baseline p99 (over [`BASELINE`]); `None` when the
    /// guest does no I/O meanwhile (nothing to protect).
    fn measure(shared: &Shared, permille: u32) -> Option<(LatencyGuard, u64)> {
        let before = latencies(shared)?;
        std::thread::sleep(BASELINE);
        let now = latencies(shared)?;
        let base = window_p99(&before, &now)?;
        let limit_us = base * u64::from(permille) / 1000;
        Some((
            LatencyGuard {
                limit_us: limit_us.max(1),
                last: Some(now),
                at: Instant::now(),
            },
            base,
        ))
    }

    /// Waits while the guest's recent p99 is above the limit; returns
    /// the time waited and the last window's p99.
    fn pace(&mut self, shared: &Shared, cancel: &AtomicBool) -> (Duration, u64) {
        let mut waited = Duration::ZERO;
        let mut p99 = 0;
        loop {
            if self.at.elapsed() < WINDOW {
                return (waited, p99);
            }
            let Some(now) = latencies(shared) else {
                return (waited, p99);
            };
            let p = self.last.as_ref().and_then(|l| window_p99(l, &now));
            self.last = Some(now);
            self.at = Instant::now();
            match p {
                Some(v) if v > self.limit_us && !cancel.load(Ordering::Acquire) => {
                    p99 = v;
                    std::thread::sleep(BACKOFF);
                    waited += BACKOFF;
                    // The next window starts now, without the copy.
                    self.at = Instant::now() - WINDOW + BACKOFF;
                }
                Some(v) => return (waited, v),
                None => return (waited, p99),
            }
        }
    }
}

fn run(shared: &Shared, prepared: PreparedMerge, request: &MergeRequest) -> Result<(), String> {
    let job = &shared.merge;
    let locking = shared.options.locking;
    let mut guard = None;
    if let Some(permille) = request.max_p99_permille {
        job.counters().state = MergeState::Measuring;
        if let Some((g, base)) = LatencyGuard::measure(shared, permille) {
            job.counters().baseline_p99_us = base;
            guard = Some(g);
        }
        job.counters().state = MergeState::Copying;
    }
    let mut limit = request.rate_limit.map(|r| (r.max(1), Instant::now(), 0u64));
    let mut last_note = Instant::now();
    let (mut done_b, mut total_b, mut written_b, mut throttled) = (0, 0, 0, Duration::ZERO);
    let filled = prepared.fill(locking, &mut |done, total, written| {
        written_b += written;
        (done_b, total_b) = (done, total);
        if let Some((rate, start, sent)) = &mut limit {
            *sent += written;
            let due = Duration::from_secs_f64(*sent as f64 / *rate as f64);
            let elapsed = start.elapsed();
            if due > elapsed {
                let wait = due - elapsed;
                std::thread::sleep(wait);
                throttled += wait;
            }
        }
        let mut p99 = None;
        if let Some(g) = &mut guard {
            let (w, p) = g.pace(shared, &job.cancel);
            throttled += w;
            p99 = Some(p);
        }
        if last_note.elapsed() > Duration::from_millis(50) || done == total {
            last_note = Instant::now();
            let mut c = job.counters();
            c.done_bytes = done_b;
            c.total_bytes = total_b;
            c.written_bytes = written_b;
            c.throttled_ms = throttled.as_secs_f64() * 1e3;
            if let Some(p) = p99.filter(|p| *p > 0) {
                c.window_p99_us = p;
            }
        }
        !job.cancel.load(Ordering::Acquire) && shared.is_active()
    });
    {
        let mut c = job.counters();
        c.done_bytes = done_b;
        c.total_bytes = total_b;
        c.written_bytes = written_b;
        c.throttled_ms = throttled.as_secs_f64() * 1e3;
    }
    filled.map_err(|e| e.to_string())?;
    if job.cancel.load(Ordering::Acquire) {
        return Err("cancelled".into());
    }
    let merged = prepared.publish(locking).map_err(|e| e.to_string())?;
    job.counters().state = MergeState::Switching;
    let result = switch(shared, &merged);
    if result.is_err() {
        // Not referenced by any chain: the operator's to delete; removed
        // here so that a retry can use the name.
        let _ = std::fs::remove_file(merged.path());
        let mut idx = merged.path().as_os_str().to_owned();
        idx.push(".sqidx");
        let _ = std::fs::remove_file(PathBuf::from(idx));
    }
    result
}

/// The pause: requests drained, the chain flushed clean, the layer above
/// the merged ones switched onto the new file, the chain reopened (its
/// open files reused), requests resumed; the top's index built after.
fn switch(shared: &Shared, merged: &MergedFile) -> Result<(), String> {
    // No snapshot, activation or handover meanwhile.
    let _busy = shared
        .snapshot_running
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if !shared.is_active() {
        return Err("the daemon was inactivated".into());
    }
    // No build writes the top's index for the chain being replaced.
    shared.index_builder.suspend();
    let resumed = Resume(shared);
    let start = Instant::now();
    let pause = shared.gate.pause();
    if !shared.gate.wait_idle(SNAPSHOT_DRAIN_TIMEOUT) {
        return Err(format!(
            "requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}"
        ));
    }
    let old = shared.handle.get();
    old.flush_clean()
        .map_err(|e| format!("flush before the switch: {e}"))?;
    merged
        .switch_in(&old)
        .map_err(|e| format!("switching the layer above: {e}"))?;
    // From here the files say the new chain: the daemon must serve it.
    let top = old.top().path().to_path_buf();
    let reuse: Vec<_> = old.layers().iter().map(|l| l.storage().clone()).collect();
    let chain = match Chain::open_reusing(&top, &shared.options, &reuse) {
        Ok(c) => c,
        Err(e) => {
            // The old chain still reads the same data (the merged files
            // are untouched) and its top still takes writes.
            warn!(error = %e, "reopening the chain after the merge failed: serving the old one");
            return Err(format!("reopening the chain: {e}"));
        }
    };
    let layers = chain.layers().len();
    drop(old);
    let old = shared.handle.replace(chain);
    drop(pause);
    let pause_ms = start.elapsed().as_secs_f64() * 1e3;
    drop(old);
    drop(resumed);
    {
        let mut c = shared.merge.counters();
        c.pause_ms = pause_ms;
        c.layers_after = layers;
    }
    info!(merged = %merged.path().display(), layers, pause_ms, "live merge switched");
    Ok(())
}

/// Lets index builds run again, and wakes one (the top's index no longer
/// matches the chain), when the switch ends.
struct Resume<'a>(&'a Shared);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        self.0.index_builder.resume();
        self.0.index_builder.wake();
    }
}
