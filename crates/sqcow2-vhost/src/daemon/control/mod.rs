//! The control socket (`sqcow2 serve --control PATH`): one JSON object per
//! line each way ([`protocol`]); see `docs/control-api.md`.

mod bitmap;
mod commit_job;
mod cpu_wait;
mod index_builder;
mod live_snapshot;
mod merge_job;
pub(crate) mod nbd_export;
pub mod prometheus;
pub mod protocol;
mod resize;

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqcow2_format::{Chain, ChainOptions, IndexState};
use tracing::info;

use crate::device::backend::BlkBackend;
use crate::device::gate::RequestGate;
use crate::device::handle::{ChainHandle, Exclusive};
use crate::device::throttle::ExportThrottle;
use crate::transport::backend_channel::BackendChannel;
pub(crate) use index_builder::IndexBuilder;
pub(crate) use merge_job::MergeJob;
use protocol::{
    Activity, Command, Failure, FailureKind, IndexCounters, IndexMode, Info, PrometheusText,
    QueueCounters, Reply, Request, SnapshotCounters, Stats, StatsFormat,
};

/// How long a stop or an inactivation waits for a merge to stop copying
/// or switching.
const STOP_MERGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for requests in flight before a live snapshot.
pub(crate) const SNAPSHOT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Most write-backs of the old top before a live snapshot's pause: each
/// writes back what the guest wrote during the one before.
const PRE_PAUSE_ROUNDS: usize = 6;
/// A write-back before the pause this short: the device has caught up.
const PRE_PAUSE_SETTLED: Duration = Duration::from_millis(2);
/// A drain not done after this raises the engine jobs it waits for.
const RAISE_JOBS_AFTER: Duration = Duration::from_micros(100);
/// A switch step this long is logged with its parts.
const SLOW_SWITCH_STEP: Duration = Duration::from_millis(1);

/// Whether the daemon holds its chain, and how often it let it go.
#[derive(Debug, Default)]
struct Ownership {
    /// Since when the daemon is inactive, if it is.
    inactive_since: Option<Instant>,
    /// Inactivations so far.
    inactivations: u64,
}

/// One period in which the daemon holds its chain: from its start or an
/// activation to the next inactivation. A job begun in a term changes
/// the chain only while that term lasts (another process may have
/// changed the chain in between).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Term(u64);

/// The connected frontend's session.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    /// Its queues and device.
    pub(crate) backend: Arc<BlkBackend>,
    /// Its channel for messages the backend starts (empty until given).
    pub(crate) channel: BackendChannel,
    /// The daemon's worker thread of each of its queue groups.
    pub(crate) worker_threads: Vec<usize>,
}

/// What the control socket and the vhost-user side share.
#[derive(Debug)]
pub struct Shared {
    /// The served chain.
    pub handle: Arc<ChainHandle>,
    /// How the chain is opened while active (a live snapshot and an
    /// activation open it so).
    pub options: ChainOptions,
    /// The backend of the connected frontend, if any.
    pub(crate) session: Mutex<Option<Session>>,
    /// Whether the daemon holds its chain (changed only with the
    /// exclusive right: [`Shared::set_active`]).
    ownership: Mutex<Ownership>,
    /// How long requests wait while inactive before they fail.
    inactive_timeout: Duration,
    /// Pause of every live snapshot, in milliseconds.
    pauses_ms: Mutex<Vec<f64>>,
    /// Builds the top's chain index in the background.
    pub index_builder: IndexBuilder,
    /// The live merge.
    pub merge: MergeJob,
    /// Whether a live snapshot's pause runs at real-time priority.
    realtime_pause: bool,
    started: Instant,
    /// The daemon stops: no snapshot or (in)activation starts (checked by
    /// each under the exclusive right, set before it is taken).
    stopping: std::sync::atomic::AtomicBool,
    /// Point-in-time NBD exports of layers below the top, by name.
    pub(crate) frozen: nbd_export::FrozenExports,
    /// The export's I/O limits.
    pub(crate) throttle: Arc<ExportThrottle>,
}

impl Shared {
    /// State for serving `handle` (active), the chain opened with `options`.
    pub fn new(handle: Arc<ChainHandle>, options: ChainOptions) -> Self {
        Shared {
            index_builder: IndexBuilder::new(handle.clone(), options.use_index, options.locking),
            merge: MergeJob::default(),
            handle,
            options,
            session: Mutex::new(None),
            ownership: Mutex::new(Ownership::default()),
            inactive_timeout: Duration::from_secs(60),
            pauses_ms: Mutex::new(Vec::new()),
            realtime_pause: true,
            started: Instant::now(),
            stopping: Default::default(),
            frozen: Default::default(),
            throttle: Arc::default(),
        }
    }

    /// Ends the control jobs for a stop (again and again: the same): no
    /// snapshot, merge, (in)activation or index build starts any more; a
    /// merge stops copying (its file removed) or, if it is switching the
    /// chain, finishes; a live snapshot finishes; a background index build
    /// is cancelled (its temporary file removed; the next start builds
    /// it). The stop then flushes the chain served, holding the guard.
    pub(crate) fn end_jobs_for_stop(&self) -> Exclusive<'_> {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if !self.merge.stop(STOP_MERGE_TIMEOUT) {
            tracing::warn!("the merge did not stop within {STOP_MERGE_TIMEOUT:?}; stopping anyway");
        }
        let exclusive = self.handle.exclusive();
        self.index_builder.stop();
        exclusive
    }

    /// Refuses a change of the served chain once the daemon stops (call
    /// with the exclusive right held).
    fn refuse_if_stopping(&self) -> Result<(), Failure> {
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(fail(FailureKind::Busy, "the daemon is stopping"));
        }
        Ok(())
    }

    /// Whether a live snapshot's pause runs at real-time priority, where
    /// the daemon may raise it (default: yes).
    pub fn with_realtime_pause(self, realtime: bool) -> Self {
        Shared {
            realtime_pause: realtime,
            ..self
        }
    }

    /// How long requests wait while the daemon is inactive (default 60 s).
    pub fn with_inactive_timeout(self, timeout: Duration) -> Self {
        Shared {
            inactive_timeout: timeout,
            ..self
        }
    }

    /// State for serving `handle`, made inactive
    /// ([`ChainHandle::new_inactive`]): requests wait for an activation
    /// (which opens the chain with `options`), for at most the inactive
    /// timeout, then fail.
    pub fn new_inactive(handle: Arc<ChainHandle>, options: ChainOptions) -> Self {
        debug_assert!(handle.gate().is_inactive(), "made with new_inactive");
        let shared = Shared::new(handle, options);
        shared.lock_ownership().inactive_since = Some(Instant::now());
        shared
    }

    /// Which requests may start, across frontend sessions.
    pub fn gate(&self) -> &Arc<RequestGate> {
        self.handle.gate()
    }

    /// The right to change the served chain, for a control request:
    /// `busy` (saying what holds it) if another holds it; refused once the
    /// daemon stops.
    fn take_right(&self) -> Result<Exclusive<'_>, Failure> {
        // Checked first too: a stop holds the right for its last flush.
        self.refuse_if_stopping()?;
        let Some(right) = self.handle.try_exclusive() else {
            return Err(fail(
                FailureKind::Busy,
                "a snapshot, merge switch or handover is running",
            ));
        };
        self.refuse_if_stopping()?;
        Ok(right)
    }

    /// [`Shared::take_right`] for a change that replaces the served
    /// chain (a snapshot, a resize): `busy` too while a live commit
    /// mirrors it.
    fn take_right_to_replace(&self) -> Result<Exclusive<'_>, Failure> {
        let right = self.take_right()?;
        if self.merge.committing() {
            return Err(fail(
                FailureKind::Busy,
                "a live commit is running: wait for it, or cancel it (commit-cancel)",
            ));
        }
        Ok(right)
    }

    fn lock_ownership(&self) -> std::sync::MutexGuard<'_, Ownership> {
        self.ownership
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks the daemon active or inactive (an inactivation ends the
    /// current [`Term`]); only with the exclusive right, so that a job
    /// holding it sees the state stay as it checked it.
    fn set_active(&self, _right: &Exclusive<'_>, active: bool) {
        let mut o = self.lock_ownership();
        if active {
            o.inactive_since = None;
        } else if o.inactive_since.is_none() {
            o.inactive_since = Some(Instant::now());
            o.inactivations += 1;
        }
    }

    /// Whether the daemon is active (holds its image locks, serves).
    pub fn is_active(&self) -> bool {
        self.term().is_some()
    }

    /// The current term, if the daemon is active.
    pub(crate) fn term(&self) -> Option<Term> {
        let o = self.lock_ownership();
        o.inactive_since.is_none().then_some(Term(o.inactivations))
    }

    /// Whether the daemon still holds its chain in `term` (no
    /// inactivation since, whatever activation came after).
    pub(crate) fn holds(&self, term: Term) -> bool {
        self.term() == Some(term)
    }

    /// Called now and then: once inactive longer than the timeout,
    /// waiting requests fail (IOERR) and new ones fail at once.
    pub fn tick(&self) {
        let since = self.lock_ownership().inactive_since;
        if let Some(since) = since {
            if since.elapsed() >= self.inactive_timeout {
                self.gate().refuse_while_inactive();
            }
        }
    }

    /// `f` of the connected frontend's session, if one is connected.
    fn with_session<R>(&self, f: impl FnOnce(&Session) -> R) -> Option<R> {
        self.session
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(f)
    }

    /// The worker threads serving the frontend's queues (none without
    /// one).
    pub(crate) fn session_threads(&self) -> Vec<usize> {
        self.with_session(|s| s.worker_threads.clone())
            .unwrap_or_default()
    }

    pub(crate) fn session(&self) -> Option<Arc<BlkBackend>> {
        self.with_session(|s| s.backend.clone())
    }

    /// The connected frontend's channel for messages the backend starts.
    pub(crate) fn frontend_channel(&self) -> Option<BackendChannel> {
        self.with_session(|s| s.channel.clone())
    }
}

fn fail(kind: FailureKind, message: impl Into<String>) -> Failure {
    Failure::new(kind, message)
}

/// Answers one request line about the export of `shared` (daemon
/// commands are refused).
#[cfg(any(test, feature = "internals"))]
pub fn handle_line(line: &str, shared: &Arc<Shared>) -> Reply {
    match Request::parse(line) {
        Ok(r) => handle_request(r, shared),
        Err((id, failure)) => Reply::failure(id, failure),
    }
}

/// Answers one request about the export of `shared`.
pub(crate) fn handle_request(request: Request, shared: &Arc<Shared>) -> Reply {
    let id = request.id;
    let result = match request.command {
        Command::ExportAdd(_)
        | Command::ExportRemove { .. }
        | Command::ExportList
        | Command::SetIoThrottle(_) => Err(fail(
            FailureKind::BadRequest,
            "a daemon command, answered by the daemon's control socket",
        )),
        Command::Snapshot { path } => {
            live_snapshot::live_snapshot(shared, &path).map(|r| Reply::success(id.clone(), &r))
        }
        Command::Flush => {
            flush(shared).map(|()| Reply::success(id.clone(), &serde_json::json!({})))
        }
        Command::Activate => activate(shared).map(|r| Reply::success(id.clone(), &r)),
        Command::Merge(request) => {
            MergeJob::start(shared, &request).map(|r| Reply::success(id.clone(), &r))
        }
        Command::Commit(request) => {
            commit_job::start(shared, &request).map(|r| Reply::success(id.clone(), &r))
        }
        Command::MergeCancel => Ok(Reply::success(
            id.clone(),
            &serde_json::json!({ "cancelled": shared.merge.cancel() }),
        )),
        Command::Inactivate => inactivate(shared).map(|r| Reply::success(id.clone(), &r)),
        Command::Resize { size } => {
            resize::resize(shared, size).map(|r| Reply::success(id.clone(), &r))
        }
        Command::NbdExport { name, layer } => {
            nbd_export::add(shared, &name, &layer).map(|r| Reply::success(id.clone(), &r))
        }
        Command::NbdExportRemove { name } => {
            nbd_export::remove(shared, &name).map(|r| Reply::success(id.clone(), &r))
        }
        Command::Bitmap(request) => {
            bitmap::bitmap(shared, &request).map(|r| Reply::success(id.clone(), &r))
        }
        Command::Info => Ok(Reply::success(id.clone(), &info_of(shared))),
        Command::Stats {
            format: StatsFormat::Json,
        } => Ok(Reply::success(id.clone(), &stats(shared))),
        Command::Stats {
            format: StatsFormat::Prometheus,
        } => Ok(Reply::success(
            id.clone(),
            &PrometheusText {
                text: prometheus::render(&stats(shared)),
            },
        )),
    };
    result.unwrap_or_else(|f| Reply::failure(id, f))
}

/// Makes every completed write durable (waits itself for transfers that
/// may still use released clusters).
fn flush(shared: &Shared) -> Result<(), Failure> {
    shared
        .handle
        .get()
        .flush()
        .map_err(|e| fail(FailureKind::IoError, e.to_string()))
}

/// A file the chain will have as a layer (a live snapshot's new top, a
/// merge file) must lie where the daemon may open backing files (its
/// `--backing-root`): else the chain could not be opened again (after a
/// merge's switch, at the next start).
fn inside_backing_root(shared: &Shared, path: &Path, kind: FailureKind) -> Result<(), Failure> {
    let Some(root) = &shared.options.backing_root else {
        return Ok(());
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let (Ok(dir), Ok(root)) = (std::fs::canonicalize(&dir), std::fs::canonicalize(root)) else {
        return Err(fail(kind, format!("{}: no such directory", dir.display())));
    };
    if !dir.starts_with(&root) {
        return Err(fail(
            kind,
            format!(
                "{} lies outside the backing root {} (serve --backing-root)",
                path.display(),
                root.display()
            ),
        ));
    }
    Ok(())
}

/// A live snapshot's new top could not be taken on.
fn new_top_failure(e: sqcow2_format::Error) -> Failure {
    let kind = match e.kind {
        sqcow2_format::ErrorKind::Locked { .. } => FailureKind::Locked,
        _ => FailureKind::SnapshotFailed,
    };
    fail(kind, format!("opening the new top: {e}"))
}

/// Microseconds since the Unix epoch now.
fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A new top created for a live snapshot: removed (if it is still the
/// file made) unless the daemon switched to it.
struct CreatedTop {
    file: sqcow2_format::CreatedFile,
    switched: bool,
}

impl Drop for CreatedTop {
    fn drop(&mut self) {
        if !self.switched {
            self.file.remove();
        }
    }
}

/// Hands the disk over to this daemon: takes the image locks (refused if
/// another process holds the chain), opens the chain afresh (metadata and
/// index reloaded and checked), lets requests start.
fn activate(shared: &Shared) -> Result<Activity, Failure> {
    let right = shared.take_right()?;
    if shared.is_active() {
        return Ok(Activity { active: true });
    }
    // Checked before the chain is opened for writing (an open that is
    // dropped writes its metadata back). Inactive, requests wait at the
    // gate: nothing is in flight but what drains at once.
    let quiet = right
        .quiesce_inactive(SNAPSHOT_DRAIN_TIMEOUT)
        .map_err(|_right| {
            fail(
                FailureKind::IoError,
                format!("inactive, yet requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}"),
            )
        })?;
    let old = quiet.current();
    let top = old.top().path().to_path_buf();
    let chain = Chain::open_reusing(&top, &shared.options, &old).map_err(|e| {
        let kind = match e.kind {
            sqcow2_format::ErrorKind::Locked { .. } => FailureKind::Locked,
            _ => FailureKind::IoError,
        };
        fail(kind, e.to_string())
    })?;
    drop(old);
    drop(quiet.replace(chain));
    let right = quiet.resume();
    shared.set_active(&right, true);
    right.set_inactive(false);
    shared.index_builder.resume();
    shared.index_builder.wake();
    info!(top = %top.display(), "activated");
    Ok(Activity { active: true })
}

/// Hands the disk over to another daemon: new requests wait, those in
/// flight complete, the chain is flushed and left clean, its metadata
/// dropped and every image lock released; a merge that was copying stops
/// (its file removed) before the reply.
fn inactivate(shared: &Shared) -> Result<Activity, Failure> {
    // A live commit is stopped first, the daemon still active: a drain's
    // copier writes the top, and its stop reopens the chain in a pause.
    if shared.merge.committing() {
        shared.merge.cancel();
        if !shared.merge.wait_ended(STOP_MERGE_TIMEOUT) {
            return Err(fail(
                FailureKind::Busy,
                format!("the live commit did not end within {STOP_MERGE_TIMEOUT:?}: still active"),
            ));
        }
    }
    let activity = inactivate_chain(shared)?;
    // A merge begun before sees its term ended and stops, cancelled (none
    // starts while the daemon is inactive). Waited for here, without the
    // exclusive right its switch would take (and give back at once), so
    // that nothing of it is left, nor written, when the next owner takes
    // the chain: until then the reply says not to hand the disk over.
    if !shared.merge.wait_ended(STOP_MERGE_TIMEOUT) {
        return Err(fail(
            FailureKind::Busy,
            format!(
                "inactive, but the merge did not end within {STOP_MERGE_TIMEOUT:?}: \
                 do not hand the disk over yet (inactivate again to wait again)"
            ),
        ));
    }
    Ok(activity)
}

/// [`inactivate`]'s part under the exclusive right.
fn inactivate_chain(shared: &Shared) -> Result<Activity, Failure> {
    let right = shared.take_right()?;
    if !shared.is_active() {
        return Ok(Activity { active: false });
    }
    right.set_inactive(true);
    // No build writes into the images once another process owns them.
    shared.index_builder.suspend();
    let undo = |right: &Exclusive<'_>, f: Failure| {
        right.set_inactive(false);
        shared.index_builder.resume();
        f
    };
    let quiet = match right.quiesce_inactive(SNAPSHOT_DRAIN_TIMEOUT) {
        Ok(quiet) => quiet,
        Err(right) => {
            return Err(undo(
                &right,
                fail(
                    FailureKind::IoError,
                    format!("requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}"),
                ),
            ))
        }
    };
    let old = quiet.current();
    let top = old.top().path().to_path_buf();
    let options = ChainOptions {
        writable: false,
        inactive: true,
        ..shared.options.clone()
    };
    let reopened = old
        .flush_clean()
        .map_err(|e| fail(FailureKind::IoError, format!("flush: {e}")))
        .and_then(|()| {
            Chain::open_reusing(&top, &options, &old)
                .map_err(|e| fail(FailureKind::IoError, e.to_string()))
        });
    drop(old);
    let chain = match reopened {
        Ok(chain) => chain,
        Err(f) => return Err(undo(&quiet.resume(), f)),
    };
    drop(quiet.replace(chain));
    let right = quiet.resume();
    shared.set_active(&right, false);
    info!(top = %top.display(), "inactivated: image locks released");
    Ok(Activity { active: false })
}

fn info_of(shared: &Shared) -> Info {
    let chain = shared.handle.get();
    let layers: Vec<_> = chain
        .layers()
        .iter()
        .map(|l| l.path().to_path_buf())
        .collect();
    Info {
        top: chain.top().path().to_path_buf(),
        layers: layers.len(),
        chain: layers,
        virtual_size: chain.virtual_size(),
        indexed: chain.index().is_used(),
        walking_because: walking_because(shared, &chain),
        writable: chain.is_writable(),
        active: shared.is_active(),
        write_failure: chain.failure().map(str::to_owned),
        frontend_connected: shared.session().is_some(),
    }
}

/// Why lookups below the top walk the layers, if they do.
fn walking_because(shared: &Shared, chain: &Chain) -> Option<String> {
    if chain.index().is_used() || chain.layers().len() < 2 {
        return None;
    }
    let builds = shared.index_builder.counters();
    Some(if builds.building {
        "the chain index is being built".to_owned()
    } else if let Some(e) = builds.last_error {
        format!("the chain cannot be indexed: {e}")
    } else {
        match chain.index().state() {
            IndexState::Disabled => "indexes are off (--walk)".to_owned(),
            IndexState::Stale { reason, .. } => format!("the index is stale: {reason}"),
            IndexState::None if !chain.is_writable() => {
                "the top names no index (a read-only daemon does not index)".to_owned()
            }
            IndexState::None => "the top names no index".to_owned(),
            IndexState::Valid { .. } => "the index in use failed a checksum".to_owned(),
        }
    })
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

pub(crate) fn stats(shared: &Shared) -> Stats {
    let chain = shared.handle.get();
    let c = chain.diagnostics().cache();
    let mut pauses = shared
        .pauses_ms
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    pauses.sort_by(f64::total_cmp);
    let session = shared.session();
    let queues: Vec<QueueCounters> = session
        .as_ref()
        .map(|b| {
            b.queue_stats()
                .into_iter()
                .map(|(queue, st)| QueueCounters {
                    queue,
                    requests: st.requests,
                    read_bytes: st.read_bytes,
                    write_bytes: st.write_bytes,
                    errors: st.errors,
                    latency_us_p50: st.latency_us.value_at_quantile(0.5),
                    latency_us_p99: st.latency_us.value_at_quantile(0.99),
                    latency_us_max: st.latency_us.max(),
                    latency_us_count: st.measured(),
                    latency_us_sum: st.latency_us_sum,
                    latency_us_buckets: st.cumulative_buckets(),
                })
                .collect()
        })
        .unwrap_or_default();
    Stats {
        uptime_s: shared.started.elapsed().as_secs_f64(),
        merge: shared.merge.snapshot(),
        index_mode: if chain.index().is_used() {
            IndexMode::Indexed
        } else {
            IndexMode::Walk
        },
        layers: chain.layers().len(),
        cache: c.into(),
        data_reads_per_layer: chain.diagnostics().data_reads_per_layer(),
        snapshots: SnapshotCounters {
            count: pauses.len() as u64,
            pause_ms_p50: quantile(&pauses, 0.5),
            pause_ms_p99: quantile(&pauses, 0.99),
            pause_ms_max: pauses.last().copied().unwrap_or(0.0),
            pause_ms_sum: pauses.iter().sum(),
            pause_buckets: protocol::LATENCY_BUCKETS_US
                .iter()
                .map(|&b| pauses.partition_point(|&p| p * 1000.0 <= b as f64) as u64)
                .collect(),
        },
        index: IndexCounters {
            pending_layers: chain.index().pending_layers(),
            walking_because: walking_because(shared, &chain),
            ..shared.index_builder.counters()
        },
        queues,
        requests_in_flight: shared.gate().in_flight(),
        active: shared.is_active(),
        worker_panics: session.as_ref().map_or(0, |b| b.device().panics()),
        write_failure: chain.failure().map(str::to_owned),
        throttle: shared.throttle.counters(),
        shared_layers: shared.options.shared_layers.as_ref().map(|l| {
            protocol::SharedLayerCounters {
                files: l.files(),
                cache: l.cache_stats().snapshot().into(),
            }
        }),
    }
}
