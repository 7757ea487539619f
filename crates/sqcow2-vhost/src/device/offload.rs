//! Work a queue worker hands off so that it never blocks on it: engine
//! operations (allocating writes, discards, write-zeroes) run on a pool of
//! engine threads, flushes and publishes (the mappings of completed
//! changes written to the files before the guest is told, see
//! [`sqcow2_format::Durability::publish`]) on one flusher thread, which serves
//! all those queued meanwhile with one flush, or one publish if none asked
//! for a flush (group commit: one sync for the whole batch). An engine job
//! that changes mappings goes from its engine thread straight to the
//! flusher, and its result to the worker only once published. Each result
//! goes back to the worker that asked, through its [`Mailbox`] (a channel
//! and an eventfd in the worker's epoll set, signalled once per batch).
//!
//! Nothing here waits for a request in flight: engine jobs wait only for
//! other jobs' claims on the same cluster (which those release without
//! waiting for anything) and, before they begin, for a switch of the
//! chain to end (a live snapshot's pause, which waits only for work that
//! has begun: see [`crate::gate`]); a flush never waits for transfers
//! (released clusters it cannot hand out yet wait for a later flush).

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{error, warn};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::device::gate::DeferredWork;
use crate::device::handle::ChainHandle;
use crate::device::job_pool::JobPool;
use crate::device::job_queue::{JobQueue, Owned};
use sqcow2_format::Chain;

/// What an offloaded operation says when it is done: `Ok`, or why it
/// failed (for the log).
pub(crate) type JobResult = Result<(), String>;

/// A finished job: the worker's request slot it belongs to.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) slot: usize,
    pub(crate) result: JobResult,
}

/// Where a worker receives the results of the jobs it handed off.
#[derive(Debug)]
pub(crate) struct Mailbox {
    tx: Sender<Finished>,
    rx: Receiver<Finished>,
    wake: Arc<EventFd>,
}

/// The address a job's result goes to.
#[derive(Debug, Clone)]
pub(crate) struct ReturnAddress {
    tx: Sender<Finished>,
    wake: Arc<EventFd>,
    slot: usize,
}

impl ReturnAddress {
    fn send(&self, result: JobResult) {
        if self.post(result) {
            wake(&self.wake);
        }
    }

    /// Posts the result without waking the worker; whether it was taken
    /// (a worker that is gone takes no results).
    fn post(&self, result: JobResult) -> bool {
        self.tx
            .send(Finished {
                slot: self.slot,
                result,
            })
            .is_ok()
    }
}

fn wake(fd: &EventFd) {
    if let Err(e) = fd.write(1) {
        warn!("waking a worker: {e}");
    }
}

/// Sends `result` to every address of `batch`, waking each worker once.
fn answer_all(batch: Vec<ReturnAddress>, result: &JobResult) {
    let mut woken: Vec<Arc<EventFd>> = Vec::new();
    for reply in batch {
        if reply.post(result.clone()) && !woken.iter().any(|w| Arc::ptr_eq(w, &reply.wake)) {
            woken.push(reply.wake);
        }
    }
    for w in &woken {
        wake(w);
    }
}

impl Mailbox {
    pub(crate) fn new() -> io::Result<Self> {
        let (tx, rx) = channel();
        Ok(Mailbox {
            tx,
            rx,
            wake: Arc::new(EventFd::new(EFD_NONBLOCK)?),
        })
    }

    /// The eventfd that becomes readable when results (or a wake-up after
    /// a pause) wait.
    pub(crate) fn wake_fd(&self) -> &Arc<EventFd> {
        &self.wake
    }

    /// The return address for request `slot`.
    pub(crate) fn address(&self, slot: usize) -> ReturnAddress {
        ReturnAddress {
            tx: self.tx.clone(),
            wake: self.wake.clone(),
            slot,
        }
    }

    /// Clears the eventfd and takes every result waiting.
    pub(crate) fn take(&self) -> Vec<Finished> {
        let _ = self.wake.read();
        let mut out = Vec::new();
        loop {
            match self.rx.try_recv() {
                Ok(f) => out.push(f),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return out,
            }
        }
    }

    /// A result waiting, if any, without touching the eventfd (which
    /// stays readable until [`Mailbox::take`]).
    pub(crate) fn try_take(&self) -> Option<Finished> {
        self.rx.try_recv().ok()
    }

    /// Waits up to `timeout` for a result.
    #[cfg(test)]
    pub(crate) fn wait(&self, timeout: std::time::Duration) -> Option<Finished> {
        self.rx.recv_timeout(timeout).ok()
    }
}

/// What an engine thread runs for a job: given the chain current when
/// the job begins (after any switch of the chain), never one captured
/// when it was queued.
pub(crate) trait EngineWork: FnOnce(&Chain) -> JobResult + Send + 'static {}

impl<F: FnOnce(&Chain) -> JobResult + Send + 'static> EngineWork for F {}

type Work = Box<dyn FnOnce(&Chain) -> JobResult + Send>;

/// Journaled changes are written to the image (a checkpoint: a sync,
/// then their L2 pages) at most this long after the first of them, so
/// that checkpoints batch many changes and leave the device to the guest
/// in between; sooner when the journal fills ([`CHECKPOINT_BACKLOG`]), a
/// guest flush or an unjournaled change asks.
const CHECKPOINT_INTERVAL: Duration = if cfg!(test) {
    Duration::from_millis(300)
} else {
    Duration::from_millis(5000)
};
/// Journal records waiting that make a checkpoint due at once (a
/// quarter of the ring).
const CHECKPOINT_BACKLOG: u64 = sqcow2_format::JOURNAL_RECORDS / 4;
/// How often the flusher looks at the journal's backlog while a
/// checkpoint waits (records come much slower than a quarter of the ring
/// in this time).
const BACKLOG_POLL: Duration = Duration::from_millis(50);

/// Whether a checkpoint has been asked of the flusher and not begun yet:
/// journaled changes ask once, not once each (every message wakes the
/// flusher: measured, 11,000 wake-ups a second at 35,000 allocating
/// writes a second, which took a tenth of the daemon's CPU).
#[derive(Debug, Default)]
struct CheckpointAsked(AtomicBool);

impl CheckpointAsked {
    /// Asks for a checkpoint; whether the flusher must be told (no
    /// checkpoint was asked since the last one began).
    #[must_use]
    fn ask(&self) -> bool {
        !self.0.swap(true, Ordering::SeqCst)
    }

    /// A persist begins: it covers every change made so far, and those
    /// made from now on ask again. Call before the persist takes what it
    /// writes.
    fn beginning(&self) {
        // SeqCst: the persist's reads of the chain (under its state lock)
        // come after this store; a change made before it is in what the
        // persist takes, one made after it asks again.
        self.0.store(false, Ordering::SeqCst);
    }
}

/// What a request asks of the flusher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Persist {
    /// Make every completed write durable (a guest flush).
    Flush,
    /// Write the mappings of completed changes to the files (before a
    /// write, discard or write-zeroes is completed to the guest).
    Publish,
    /// Write journaled changes to the image in the background (a
    /// checkpoint: nobody waits for it).
    Checkpoint,
    /// Write the top's tables back now, in the background: those under
    /// change outgrew their share of the cache (nobody waits for it; the
    /// engine thread that found it due goes on with the next job).
    WriteBack,
}

struct Job {
    work: Work,
    /// Begun before the work runs (waits while the chain is switched).
    ticket: DeferredWork,
    reply: ReturnAddress,
    /// The work changes mappings: published before the worker is told.
    publish: bool,
    /// The device it is for.
    device: Arc<JobDevice>,
}

/// What an engine thread needs of the device a job is for: its chain,
/// its flusher, its panic count. Every job holds it (and so a sender to
/// the flusher): the flusher ends once the device's last job has run.
struct JobDevice {
    handle: Arc<ChainHandle>,
    panics: Arc<AtomicU64>,
    flushes: Sender<PersistRequest>,
    asked: Arc<CheckpointAsked>,
}

/// Engine threads: one set for every device of the daemon (each job
/// carries its device), so that a daemon serving many disks does not run
/// a thread set per disk. The next job is one of the device with the
/// fewest running, and while every thread is stuck (a disk's storage
/// hangs) more start ([`JobPool`]).
pub(crate) struct EnginePool {
    threads: JobPool<Job>,
}

impl std::fmt::Debug for EnginePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnginePool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Owned for Job {
    fn owner(&self) -> usize {
        Arc::as_ptr(&self.device) as usize
    }
}

impl EnginePool {
    /// Starts `engine_threads` engine threads (at least one).
    pub(crate) fn start(engine_threads: usize) -> io::Result<Arc<Self>> {
        let jobs = Arc::new(JobQueue::<Job>::new());
        let threads = JobPool::start("engine", engine_threads, jobs, run_job)?;
        Ok(Arc::new(EnginePool { threads }))
    }
}

/// Runs one job on an engine thread.
fn run_job(job: Job) {
    let device = &job.device;
    // Counted as using the chain (a switch waits for it) from here until
    // its work has run, and given the chain current now.
    let begun = job.ticket.begin();
    let chain = device.handle.get();
    let result = run_guarded(job.work, &chain, &device.panics);
    if chain.durability().take_write_back_due() {
        let _ = device.flushes.send((None, Persist::WriteBack));
    }
    // Its changes are made: a switch may come (the publish below covers
    // them on either chain).
    drop(begun);
    if !job.publish || result.is_err() {
        job.reply.send(result);
    } else if chain.durability().needs_publish() {
        // Completed only once its mappings are in the file.
        let publish = (Some(job.reply), Persist::Publish);
        if let Err(e) = device.flushes.send(publish) {
            if let (Some(reply), _) = e.0 {
                reply.send(Err("flusher stopped".into()));
            }
        }
    } else {
        // Journaled: complete now, write it to the image in the
        // background.
        job.reply.send(result);
        if device.asked.ask() {
            let _ = device.flushes.send((None, Persist::Checkpoint));
        }
    }
}

/// A request to the flusher and where its result goes (none for a
/// checkpoint). A switch of the chain does not wait for it: whichever
/// chain the flusher persists covers work done on the old one (the new
/// chain publishes and flushes the old top until it is closed).
type PersistRequest = (Option<ReturnAddress>, Persist);

/// The engine threads (shared) and the flusher (its own) of one device.
pub(crate) struct Offload {
    pool: Arc<EnginePool>,
    /// `None` once dropping: the flusher ends when the last job goes.
    device: Option<Arc<JobDevice>>,
    flusher: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offload")
            .field("engine_threads", &self.pool.threads)
            .finish()
    }
}

/// Runs `work` on `chain`, turning a panic into a failed job and a
/// failed `chain` (the one the work ran on, not one switched to since).
fn run_guarded(
    work: impl FnOnce(&Chain) -> JobResult,
    chain: &Chain,
    panics: &AtomicU64,
) -> JobResult {
    match catch_unwind(AssertUnwindSafe(|| work(chain))) {
        Ok(result) => result,
        Err(panic) => {
            let what = panic_message(&*panic);
            error!("engine thread panicked (a bug): {what}");
            panics.fetch_add(1, Ordering::Relaxed);
            chain.fail(&format!("an engine thread panicked: {what}"));
            Err(format!("panic: {what}"))
        }
    }
}

/// The text of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

impl Offload {
    /// Starts `engine_threads` engine threads of its own and the flusher
    /// for the chain of `handle`; panics are counted in `panics`.
    #[cfg(test)]
    pub(crate) fn start(
        handle: Arc<ChainHandle>,
        engine_threads: usize,
        panics: Arc<AtomicU64>,
    ) -> io::Result<Self> {
        Offload::start_on(EnginePool::start(engine_threads)?, handle, panics)
    }

    /// Starts the flusher for the chain of `handle`, its engine jobs run
    /// by `pool`; panics are counted in `panics`.
    pub(crate) fn start_on(
        pool: Arc<EnginePool>,
        handle: Arc<ChainHandle>,
        panics: Arc<AtomicU64>,
    ) -> io::Result<Self> {
        let (flushes, flush_rx) = channel::<PersistRequest>();
        let asked = Arc::new(CheckpointAsked::default());
        let flusher = std::thread::Builder::new().name("flusher".into()).spawn({
            let (asked, handle, panics) = (asked.clone(), handle.clone(), panics.clone());
            move || flusher(flush_rx, handle, panics, &asked)
        })?;
        Ok(Offload {
            pool,
            device: Some(Arc::new(JobDevice {
                handle,
                panics,
                flushes,
                asked,
            })),
            flusher: Some(flusher),
        })
    }

    fn device(&self) -> Option<&Arc<JobDevice>> {
        self.device.as_ref()
    }

    /// Runs `work` on an engine thread once `ticket` may begin; its result
    /// goes to `reply`, once the mappings it changed are published if
    /// `publish`.
    pub(crate) fn run(
        &self,
        reply: ReturnAddress,
        ticket: DeferredWork,
        publish: bool,
        work: impl EngineWork,
    ) -> Result<(), ReturnAddress> {
        let Some(device) = self.device() else {
            return Err(reply);
        };
        self.pool
            .threads
            .push(Job {
                work: Box::new(work),
                ticket,
                reply,
                publish,
                device: device.clone(),
            })
            .map_err(|job| job.reply)
    }

    /// What follows a mapping change a worker made itself, as after an
    /// engine thread's job: a write-back found due is asked of the
    /// flusher; a journaled change asks for a checkpoint. Returns whether
    /// the change must be published before its request completes
    /// ([`Persist::Publish`], the worker's to ask).
    pub(crate) fn after_worker_change(&self, chain: &Chain) -> bool {
        let Some(device) = self.device() else {
            return chain.durability().needs_publish();
        };
        if chain.durability().take_write_back_due() {
            let _ = device.flushes.send((None, Persist::WriteBack));
        }
        if chain.durability().needs_publish() {
            return true;
        }
        if device.asked.ask() {
            let _ = device.flushes.send((None, Persist::Checkpoint));
        }
        false
    }

    /// Flushes or publishes the chain; the result goes to `reply` (those
    /// queued while one runs are served by the next, together).
    pub(crate) fn persist(&self, reply: ReturnAddress, what: Persist) -> Result<(), ReturnAddress> {
        match self.device() {
            Some(d) => d
                .flushes
                .send((Some(reply.clone()), what))
                .map_err(|_| reply),
            None => Err(reply),
        }
    }
}

/// The flusher: one flush (or publish, if no request of the batch asked
/// for a flush, which includes it) for every batch of requests;
/// checkpoints are publishes nobody waits for.
fn flusher(
    rx: Receiver<PersistRequest>,
    handle: Arc<ChainHandle>,
    panics: Arc<AtomicU64>,
    asked: &CheckpointAsked,
) {
    // Since when journaled changes wait for a checkpoint.
    let mut waiting_since: Option<Instant> = None;
    loop {
        let first = match waiting_since {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(t) => rx.recv_timeout(
                (t + CHECKPOINT_INTERVAL)
                    .saturating_duration_since(Instant::now())
                    .min(BACKLOG_POLL),
            ),
        };
        let mut batch = Vec::new();
        let mut closing = false;
        match first {
            Ok(request) => batch.push(request),
            Err(RecvTimeoutError::Timeout) => {}
            // The last checkpoint first.
            Err(RecvTimeoutError::Disconnected) if waiting_since.is_some() => closing = true,
            Err(RecvTimeoutError::Disconnected) => return,
        }
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
        }
        if batch.iter().any(|(_, what)| *what == Persist::Checkpoint) {
            waiting_since.get_or_insert_with(Instant::now);
        }
        let someone_waits = batch.iter().any(|(reply, _)| reply.is_some());
        let due = closing
            || batch.iter().any(|(_, what)| *what == Persist::WriteBack)
            || waiting_since.is_some_and(|t| t.elapsed() >= CHECKPOINT_INTERVAL)
            || handle.get().durability().journal_backlog() >= CHECKPOINT_BACKLOG;
        if !someone_waits && !due {
            continue;
        }
        waiting_since = None;
        asked.beginning();
        // Taken after the flag is cleared: a change on a chain switched to
        // meanwhile either asks again or is on the chain persisted here.
        let chain = handle.get();
        let flush = batch.iter().any(|(_, what)| *what == Persist::Flush);
        let persist = |chain: &Chain| {
            let done = if flush {
                chain.flush()
            } else {
                chain.durability().publish()
            };
            done.map_err(|e| e.to_string())
        };
        let mut result = run_guarded(persist, &chain, &panics);
        let current = handle.get();
        if result.is_err() && !Arc::ptr_eq(&chain, &current) {
            // A live snapshot switched chains meanwhile: the new chain's
            // persist covers what the batch asked for (it persists the
            // old top too until it is closed).
            result = run_guarded(persist, &current, &panics);
        }
        answer_all(
            batch.into_iter().filter_map(|(reply, _)| reply).collect(),
            &result,
        );
    }
}

impl Drop for Offload {
    fn drop(&mut self) {
        // The flusher ends once the device's queued jobs, which hold
        // senders to it, have run (and its last checkpoint is made): when
        // it is joined, no job of this device is left.
        self.device.take();
        if let Some(t) = self.flusher.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::mpsc::sync_channel;

    use super::*;
    use crate::device::gate::RequestGate;
    use crate::device::test_support::{admitted as request, small_chain as chain};

    /// One engine thread and its flusher serving `top`, a gate and a
    /// worker's mailbox.
    fn engine(top: Chain) -> (Arc<ChainHandle>, Offload, Arc<RequestGate>, Mailbox) {
        let handle = Arc::new(ChainHandle::new(top));
        let offload = Offload::start(handle.clone(), 1, Arc::default()).unwrap();
        let gate = handle.gate().clone();
        (handle, offload, gate, Mailbox::new().unwrap())
    }

    /// A live snapshot's switch waits for an engine job that has begun
    /// (it uses the old chain), not for one queued behind it, which
    /// begins only after the switch and is given the new chain.
    #[test]
    fn a_switch_waits_for_begun_jobs_and_queued_ones_get_the_new_chain() {
        let dir = tempfile::tempdir().unwrap();
        let (handle, offload, gate, mailbox) = engine(chain(dir.path(), "old.qcow2"));
        let (in_first, first_runs) = sync_channel::<PathBuf>(1);
        let (let_first_end, first_may_end) = sync_channel::<()>(1);
        let (in_second, second_runs) = sync_channel::<PathBuf>(1);

        let mut first = request(&gate);
        let ticket = first.deferred_work();
        offload
            .run(mailbox.address(0), ticket, false, move |chain: &Chain| {
                in_first.send(chain.top().path().to_path_buf()).unwrap();
                first_may_end.recv().unwrap();
                Ok(())
            })
            .map_err(|_| "engine stopped")
            .unwrap();
        first.leave_chain();
        let old_path = first_runs.recv().unwrap();
        // The only engine thread is busy: the second job waits unbegun.
        let mut second = request(&gate);
        let ticket = second.deferred_work();
        offload
            .run(mailbox.address(1), ticket, false, move |chain: &Chain| {
                in_second.send(chain.top().path().to_path_buf()).unwrap();
                Ok(())
            })
            .map_err(|_| "engine stopped")
            .unwrap();
        second.leave_chain();

        let switch = handle.exclusive().pause_for_switch();
        assert!(
            !gate.wait_off_chain(Duration::from_millis(50)),
            "the switch did not wait for a job running on the old chain"
        );
        let_first_end.send(()).unwrap();
        let Ok(quiet) = switch.off_chain(Duration::from_secs(30)) else {
            panic!("the switch waited for a job that had not begun");
        };
        assert!(
            second_runs
                .recv_timeout(Duration::from_millis(100))
                .is_err(),
            "a job began during the switch"
        );
        let new = chain(dir.path(), "new.qcow2");
        let new_path = new.top().path().to_path_buf();
        drop(quiet.replace(new));
        drop(quiet);
        let got = second_runs
            .recv_timeout(Duration::from_secs(30))
            .expect("the queued job never ran after the switch");
        assert_eq!(got, new_path, "the queued job ran on the old chain");
        assert_ne!(old_path, new_path);
        for slot in [0, 1] {
            let done = mailbox.wait(Duration::from_secs(30)).expect("no result");
            assert!(done.result.is_ok(), "job {slot}: {:?}", done.result);
        }
        drop((first, second));
    }

    /// The L1 entry `index` of the image at `path` as its file holds it.
    fn l1_entry_in_file(path: &std::path::Path, index: u64) -> u64 {
        use std::os::unix::fs::FileExt;
        let file = std::fs::File::open(path).unwrap();
        let mut word = [0u8; 8];
        file.read_exact_at(&mut word, 40).unwrap();
        let l1 = u64::from_be_bytes(word);
        file.read_exact_at(&mut word, l1 + index * 8).unwrap();
        u64::from_be_bytes(word)
    }

    /// One L2 table per 512 MiB: a write at `r * REGION` needs a new one.
    const REGION: u64 = 512 << 20;

    /// A new 64 GiB image at `image`, opened for writing with `options`.
    fn big_writable_chain(image: &std::path::Path, options: sqcow2_format::ChainOptions) -> Chain {
        sqcow2_format::create::create(
            image,
            &sqcow2_format::create::CreateOptions {
                size: 64 << 30,
                ..Default::default()
            },
        )
        .unwrap();
        Chain::open(
            image,
            &sqcow2_format::ChainOptions {
                writable: true,
                ..options
            },
        )
        .unwrap()
    }

    /// One engine job per region of `regions`, each writing its first
    /// 4 KiB (published by the engine if `publish`), waited for.
    fn write_regions(
        offload: &Offload,
        gate: &Arc<RequestGate>,
        mailbox: &Mailbox,
        regions: std::ops::RangeInclusive<u64>,
        publish: bool,
    ) {
        for r in regions {
            let mut req = request(gate);
            let ticket = req.deferred_work();
            offload
                .run(mailbox.address(0), ticket, publish, move |chain: &Chain| {
                    chain
                        .write_at(&[r as u8; 4096], r * REGION)
                        .map_err(|e| e.to_string())
                })
                .map_err(|_| "engine stopped")
                .unwrap();
            req.leave_chain();
            let done = mailbox.wait(Duration::from_secs(30)).expect("no result");
            assert!(done.result.is_ok(), "region {r}: {:?}", done.result);
            drop(req);
        }
    }

    /// Waits until the file holds the L1 entries of `regions`' tables;
    /// fails with `what` after 30 s.
    fn wait_tables_in_file(
        image: &std::path::Path,
        regions: std::ops::RangeInclusive<u64>,
        what: &str,
    ) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while regions.clone().any(|r| l1_entry_in_file(image, r) == 0) {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Journaled changes ask the flusher for a checkpoint once, not once
    /// each; every change is still checkpointed: one made after a
    /// checkpoint began asks again.
    #[test]
    fn journaled_changes_ask_once_and_each_reaches_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("top.qcow2");
        let top = big_writable_chain(&image, sqcow2_format::ChainOptions::default());
        assert!(
            top.durability().journaled(),
            "the test needs a journaled top"
        );
        let (_handle, offload, gate, mailbox) = engine(top);
        // Several changes before the checkpoint: one asks.
        write_regions(&offload, &gate, &mailbox, 1..=3, true);
        wait_tables_in_file(
            &image,
            1..=3,
            "journaled changes 1..=3 never reached the image",
        );
        // After it: asked again.
        write_regions(&offload, &gate, &mailbox, 4..=4, true);
        wait_tables_in_file(
            &image,
            4..=4,
            "journaled changes 4..=4 never reached the image",
        );
    }

    /// With background write-back, an engine job whose writes make the
    /// top's tables outgrow their share of the cache hands their
    /// write-back to the flusher: the tables reach the file although
    /// nobody publishes, flushes or asks for a checkpoint.
    #[test]
    fn an_early_write_back_found_by_a_job_is_done_by_the_flusher() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("big.qcow2");
        // A 512 KiB cache gives the tables under change half, 256 KiB,
        // four tables: eight is over (not four times).
        let top = big_writable_chain(
            &image,
            sqcow2_format::ChainOptions {
                cache_size: 512 << 10,
                background_write_back: true,
                ..Default::default()
            },
        );
        let (_handle, offload, gate, mailbox) = engine(top);
        // Not published by the engine (publish: false): only the
        // hand-over can write the tables.
        write_regions(&offload, &gate, &mailbox, 1..=8, false);
        wait_tables_in_file(
            &image,
            1..=8,
            "the tables never reached the file: no write-back was handed over",
        );
    }
}
