//! A live commit (`commit` on the control socket): the top and the layers
//! down to a base written into the base while the guest runs, then the
//! base served as the top (QEMU's active block-commit and its pivot).
//! Guest changes are mirrored into the base from a pause at the start,
//! so the background copy has a fixed amount of work and always ends;
//! the switch is a pause as short as a live snapshot's. It shares the
//! merge's job slot, counters, pacing and cancel.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use sqcow2_format::reshape::{prepare_live_commit, LayerRef, LiveCommit};
use sqcow2_format::{Chain, ChainOptions, ErrorKind};
use tracing::{info, warn};

use super::merge_job::{
    check_pacing, must_stop, Committing, MergeEnd, Pacer, Resume, Running, CANCELLED, INACTIVATED,
};
use super::protocol::{
    CommitRequest, CommitStarted, Failure, FailureKind, JobKind, MergeCounters, MergeState,
};
use super::{Shared, Term, SNAPSHOT_DRAIN_TIMEOUT};
use crate::device::handle::{Exclusive, Quiesced};

fn fail(kind: FailureKind, message: impl Into<String>) -> Failure {
    Failure::new(kind, message)
}

/// Starts a live commit: checks it, opens the base for writing (refused
/// if another process uses it, before anything is written) and starts
/// mirroring inside a pause; the copy and the switch run in a thread.
pub(super) fn start(
    shared: &Arc<Shared>,
    request: &CommitRequest,
) -> Result<CommitStarted, Failure> {
    check_pacing(request.rate_limit, request.max_p99_permille)?;
    let job = &shared.merge;
    let running = job.claim(true)?;
    let committing = Committing(job.committing_flag());
    let Some(term) = shared.term() else {
        return Err(fail(FailureKind::Inactive, "the daemon is inactive"));
    };
    // No snapshot, resize or handover replaces the chain from here on
    // (each refuses while `committing`); none runs now.
    let right = shared.take_right()?;
    if !shared.holds(term) {
        return Err(fail(FailureKind::Inactive, "the daemon is inactive"));
    }
    let chain = shared.handle.get();
    let base: Option<LayerRef> = request.base.as_ref().map(Into::into);
    // No index build (which marks layers, taking their locks) runs until
    // the commit ends: its switch or its abandon lets them run again.
    shared.index_builder.suspend();
    let resumed = Resume(shared);
    let commit = match prepare_live_commit(&chain, base.as_ref(), &shared.options) {
        Ok(commit) => commit,
        Err(e) => {
            let kind = match e.kind {
                ErrorKind::Locked { .. } => FailureKind::Locked,
                _ => FailureKind::CommitFailed,
            };
            drop(resumed);
            drop(right);
            return Err(fail(kind, e.to_string()));
        }
    };
    std::mem::forget(resumed);
    let paused = Instant::now();
    let quiet = match right.pause().idle(SNAPSHOT_DRAIN_TIMEOUT) {
        Ok(quiet) => quiet,
        Err(pause) => {
            let right = pause.resume();
            abandon(shared, term, &chain, commit, Some(right));
            return Err(fail(
                FailureKind::IoError,
                format!("requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}"),
            ));
        }
    };
    let mirrored = commit.start(&quiet.current());
    let right = quiet.resume();
    let start_pause_ms = paused.elapsed().as_secs_f64() * 1e3;
    if let Err(e) = mirrored {
        abandon(shared, term, &chain, commit, Some(right));
        return Err(fail(FailureKind::CommitFailed, e.to_string()));
    }
    drop(right);
    let started = CommitStarted {
        base: commit.base_path().to_path_buf(),
        position: commit.base().0,
        replaced: commit.replaced().to_vec(),
    };
    *job.counters() = MergeCounters {
        kind: JobKind::Commit,
        state: MergeState::Copying,
        path: Some(started.base.clone()),
        first: started.position + 1,
        last: chain.top_index().0,
        replaced: started.replaced.clone(),
        ..MergeCounters::default()
    };
    info!(base = %started.base.display(), drains = commit.drains(), start_pause_ms, "live commit started");
    // The commit goes to the thread through a slot, so that it can be
    // abandoned here if the thread cannot start.
    let slot = Arc::new(Mutex::new(Some(commit)));
    let thread_slot = slot.clone();
    let chain_here = chain.clone();
    let thread_shared = shared.clone();
    let request = request.clone();
    std::mem::forget(running);
    std::mem::forget(committing);
    let spawned = std::thread::Builder::new()
        .name("sqcow2-commit".into())
        .spawn(move || {
            let shared = thread_shared;
            let _running = Running(&shared.merge.running);
            let _committing = Committing(shared.merge.committing_flag());
            let begin = Instant::now();
            let taken = lock_slot(&thread_slot).take();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match taken {
                Some(commit) => run(&shared, term, &chain, commit, &request),
                None => Err(MergeEnd::Failed("the commit was taken (a bug)".into())),
            }));
            shared.merge.ended("live commit", begin, outcome);
        });
    if let Err(e) = spawned {
        // The thread never ran: the commit is still in the slot.
        if let Some(commit) = lock_slot(&slot).take() {
            abandon(shared, term, &chain_here, commit, None);
        }
        job.running.store(false, Ordering::Release);
        job.committing_flag().store(false, Ordering::Release);
        return Err(fail(
            FailureKind::CommitFailed,
            format!("cannot start the commit: {e}"),
        ));
    }
    Ok(started)
}

fn lock_slot(slot: &Mutex<Option<LiveCommit>>) -> MutexGuard<'_, Option<LiveCommit>> {
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

fn run(
    shared: &Shared,
    term: Term,
    chain: &Arc<Chain>,
    commit: LiveCommit,
    request: &CommitRequest,
) -> Result<(), MergeEnd> {
    let mut pacer = Pacer::new(shared, term, request.rate_limit, request.max_p99_permille);
    let copied = commit.copy(chain, &mut |done, total, written| {
        pacer.step(done, total, written)
    });
    pacer.note();
    shared.merge.counters().mirrored_bytes = commit.mirrored_bytes();
    if let Some(why) = must_stop(shared, term) {
        abandon(shared, term, chain, commit, None);
        return Err(MergeEnd::Cancelled(why));
    }
    if let Err(e) = copied {
        abandon(shared, term, chain, commit, None);
        return Err(MergeEnd::Failed(e.to_string()));
    }
    shared.merge.counters().state = MergeState::Switching;
    switch(shared, term, chain, commit)
}

/// The bitmaps of the layers the commit folded into the base, merged
/// into the base's (added where missing), as libvirt does when a block
/// commit ends; the guest runs meanwhile (bits are set atomically). A
/// failure is logged: the commit itself is done.
fn carry_bitmaps(shared: &Shared, old: &Chain) {
    let served = shared.handle.get();
    let base = served.top().path().to_path_buf();
    let from = match sqcow2_format::reshape::find_layer(
        old,
        &sqcow2_format::reshape::LayerRef::File(base),
    ) {
        Ok(at) => sqcow2_format::LayerIndex(at.0 + 1),
        Err(e) => return warn!(error = %e, "bitmaps not carried into the base"),
    };
    match served.bitmaps().take_in_from(old, from) {
        Ok(skipped) if skipped.is_empty() => {}
        Ok(skipped) => warn!(
            ?skipped,
            "inconsistent or incompatible bitmaps not carried into the base"
        ),
        Err(e) => warn!(error = %e, "bitmaps not carried into the base"),
    }
}

/// Pauses tried after the first before a drain that cannot be stopped
/// makes the chain refuse requests.
const DRAIN_STOP_TRIES: u32 = 3;

/// Stops a commit that will not switch, the guest running. Opening the
/// base for writing changed it on disk (its sQcow2 mark, and its tables
/// where the layers above hide it or the drained top no longer decides):
/// the commit is stopped and the served chain reopened in one pause, the
/// base read as it is now, and the top's index, stale for the next open,
/// built again. Not after an inactivation (the chain was replaced; the
/// next activation opens it afresh).
fn abandon(
    shared: &Shared,
    term: Term,
    chain: &Chain,
    commit: LiveCommit,
    right: Option<Exclusive<'_>>,
) {
    let mut right = right.unwrap_or_else(|| shared.handle.exclusive());
    if !shared.holds(term) {
        commit.abandon(chain);
        return;
    }
    shared.index_builder.suspend();
    let resumed = Resume(shared);
    let mut tries = 0;
    let right = loop {
        match right.pause().idle(SNAPSHOT_DRAIN_TIMEOUT) {
            Ok(quiet) => {
                stop_in_pause(shared, &quiet, chain, commit);
                break quiet.resume();
            }
            Err(pause) if commit.drain_started() && tries < DRAIN_STOP_TRIES => {
                // The chain reads what its top no longer decides through
                // the drain, which stops only in a pause: tried again.
                tries += 1;
                warn!("requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}: the drain ends at the next pause");
                right = pause.resume();
            }
            Err(pause) => {
                if commit.drain_started() {
                    warn!("requests still in flight after {DRAIN_STOP_TRIES} more pauses: the drained chain refuses requests");
                    chain.refuse_io("a drain could not be stopped in a pause");
                }
                commit.abandon(chain);
                warn!("requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}: the chain is reopened at the next start");
                break pause.resume();
            }
        }
    };
    // Builds run again before the right is given back.
    drop(resumed);
    drop(right);
}

/// Inside a pause: the commit stopped (the base closed, its tables
/// written) and the served chain reopened, reading the base as it is
/// now. After a drain the old chain's view of the base is stale: if it
/// cannot be reopened, it refuses every request rather than serve it.
fn stop_in_pause(shared: &Shared, quiet: &Quiesced<'_>, chain: &Chain, commit: LiveCommit) {
    let drained = commit.drain_started();
    commit.abandon(chain);
    if !reopen(shared, quiet) && drained {
        warn!("the chain could not be reopened after its top was drained in part: it refuses requests");
        quiet
            .current()
            .refuse_io("the chain could not be reopened after a drain was abandoned");
    }
}

/// Inside a pause: the served chain opened again (its open files reused,
/// each layer's tables read as they are now; the top's index rebuilt in
/// the background); whether it was. On an error the old chain serves
/// on.
fn reopen(shared: &Shared, quiet: &Quiesced<'_>) -> bool {
    let old = quiet.current();
    let options = ChainOptions {
        stale_index_expected: true,
        ..shared.options.clone()
    };
    let top = old.top().path().to_path_buf();
    let reopened = old
        .flush_clean()
        .and_then(|()| Chain::open_reusing(&top, &options, &old));
    match reopened {
        Ok(chain) => {
            old.handover().release_top();
            drop(quiet.replace(chain));
            true
        }
        Err(e) => {
            warn!(error = %e, "reopening the chain after an abandoned commit failed: serving it as it was");
            false
        }
    }
}

/// The pause: requests drained, mirroring stopped, the base made durable
/// and put in place as the served chain's top; the old chain (its top
/// closed clean) dropped after the pause; the new top's index built after.
fn switch(
    shared: &Shared,
    term: Term,
    chain: &Arc<Chain>,
    commit: LiveCommit,
) -> Result<(), MergeEnd> {
    let right = shared.handle.exclusive();
    if !shared.holds(term) {
        abandon(shared, term, chain, commit, Some(right));
        return Err(MergeEnd::Cancelled(INACTIVATED));
    }
    if shared.merge.cancel_asked() {
        abandon(shared, term, chain, commit, Some(right));
        return Err(MergeEnd::Cancelled(CANCELLED));
    }
    // Most of what the mirror wrote, written back and synced while the
    // guest runs: the flush in the pause has little left.
    if let Err(e) = commit.flush() {
        abandon(shared, term, chain, commit, Some(right));
        return Err(MergeEnd::Failed(format!("flushing the base: {e}")));
    }
    shared.index_builder.suspend();
    let resumed = Resume(shared);
    let start = Instant::now();
    let quiet = match right.pause().idle(SNAPSHOT_DRAIN_TIMEOUT) {
        Ok(quiet) => quiet,
        Err(pause) => {
            // Abandoned with the guest running again.
            let right = pause.resume();
            drop(resumed);
            abandon(shared, term, chain, commit, Some(right));
            return Err(MergeEnd::Failed(format!(
                "requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}"
            )));
        }
    };
    let drained_ms = start.elapsed().as_secs_f64() * 1e3;
    let current = quiet.current();
    if !Arc::ptr_eq(&current, chain) {
        let right = quiet.resume();
        drop(resumed);
        abandon(shared, term, chain, commit, Some(right));
        return Err(MergeEnd::Failed(
            "the served chain was replaced during the commit (a bug)".into(),
        ));
    }
    let drained = commit.drain_started();
    let switched = commit
        .finish(&current)
        .map(|base| {
            let top = base.top().path().display().to_string();
            let finished_ms = start.elapsed().as_secs_f64() * 1e3;
            let old = quiet.replace(base);
            // Logged before any request reaches the base: a log without it
            // means the old top has them all.
            info!(
                top,
                drained_ms, finished_ms, "live commit switched: serving the base"
            );
            old
        })
        .map_err(|e| {
            // Abandoned: the chain read afresh (see `stop_in_pause`).
            if !reopen(shared, &quiet) && drained {
                quiet
                    .current()
                    .refuse_io("the chain could not be reopened after a drain was abandoned");
            }
            format!("switching to the base: {e}")
        });
    drop(current);
    let right = quiet.resume();
    let pause_ms = start.elapsed().as_secs_f64() * 1e3;
    drop(resumed);
    drop(right);
    // The old chain, dropped here by the caller's last reference: its top
    // is written back and left clean, outside the pause.
    let old = switched.map_err(MergeEnd::Failed)?;
    carry_bitmaps(shared, &old);
    let layers = shared.handle.get().layers().len();
    {
        let mut c = shared.merge.counters();
        c.pause_ms = pause_ms;
        c.layers_after = layers;
    }
    drop(old);
    info!(layers, pause_ms, "live commit done");
    Ok(())
}
