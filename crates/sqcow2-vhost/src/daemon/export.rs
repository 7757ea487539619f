//! One export of the daemon: a chain served on its own vhost-user socket
//! (one frontend at a time, the next one accepted after a disconnect, a
//! second concurrent one refused), by a thread of its own that ends when
//! the daemon stops or the export is removed, leaving the chain flushed
//! and clean.

use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use sqcow2_format::{Chain, ChainOptions};
use tracing::{debug, info, warn};
use vhost::vhost_user::{BackendReqHandler, Listener};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::daemon::control::{Session, Shared};
use crate::daemon::error::{io_err, ExportSpecError, ServeError};
use crate::daemon::socket_file::MadeFiles;
use crate::device::backend::BlkBackend;
use crate::device::blk::{BlkDevice, DeviceOptions};
use crate::device::handle::ChainHandle;
use crate::device::offload::EnginePool;
use crate::device::session::SessionDevice;
use crate::device::throttle::{IoLimits, ThrottleGroups};
use crate::device::worker_pool::WorkerPool;
use crate::transport::backend_channel::{take_channel, BackendChannel};
use crate::transport::frontend::FrontendHandler;

/// How often an export's accept loop looks at its stop flags.
const POLL_INTERVAL_MS: i32 = 100;

/// How long an export waits after a frontend it could not serve (a
/// resource ran out) before it takes the next.
const SESSION_RETRY_PAUSE_MS: i32 = 1000;

/// Longest wait for requests in flight when stopping.
const STOP_DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
/// Smallest cluster of a top served with `--cache none`: a cluster
/// never shares a page with another, so the page cache (sub-sector
/// metadata words) and direct writes (data) never meet in one page.
const MIN_DIRECT_CLUSTER: u64 = 4096;

/// What one export serves, and how.
#[derive(Debug, Clone)]
pub struct ExportSpec {
    /// Its name in control requests and statistics.
    pub id: String,
    /// The top image of the chain.
    pub image: PathBuf,
    /// The vhost-user socket (`None`: served over NBD only).
    pub socket: Option<PathBuf>,
    /// Export read-only (VIRTIO_BLK_F_RO).
    pub read_only: bool,
    /// Request queues offered.
    pub num_queues: u16,
    /// Largest queue the frontend may set up.
    pub queue_size: u16,
    /// Queues served by each worker thread.
    pub queues_per_thread: u16,
    /// Backing files must lie inside this directory (default: the top's).
    pub backing_root: Option<PathBuf>,
    /// Export the chain over NBD there too.
    pub nbd: Option<(crate::nbd::NbdAddress, crate::nbd::Export)>,
    /// I/O limits (of its group, if it names one).
    pub limits: IoLimits,
    /// The throttle group it is in (QEMU's `throttle-group`), if any.
    pub group: Option<String>,
}

impl ExportSpec {
    /// A spec with the single-export defaults (one queue of up to 256).
    pub fn new(id: impl Into<String>, image: impl Into<PathBuf>) -> Self {
        ExportSpec {
            id: id.into(),
            image: image.into(),
            socket: None,
            read_only: false,
            num_queues: 1,
            queue_size: 256,
            queues_per_thread: 1,
            backing_root: None,
            nbd: None,
            limits: IoLimits::default(),
            group: None,
        }
    }

    /// Checks the values a device can take.
    pub fn validate(&self) -> Result<(), ExportSpecError> {
        let invalid = |message: &str| {
            Err(ExportSpecError::Invalid {
                id: self.id.clone(),
                message: message.to_owned(),
            })
        };
        if !valid_id(&self.id) {
            return invalid("an id is 1-64 letters, digits, '-', '_' or '.'");
        }
        if !(1..=64).contains(&self.num_queues) {
            return invalid("num-queues must be between 1 and 64");
        }
        if !self.queue_size.is_power_of_two() || self.queue_size < 2 {
            return invalid("queue-size must be a power of two, at least 2");
        }
        if self.queues_per_thread == 0 {
            return invalid("queues-per-thread must be at least 1");
        }
        if self.socket.is_none() && self.nbd.is_none() {
            return invalid("needs a socket");
        }
        if let Err(e) = self.limits.validate() {
            return invalid(&e);
        }
        if self.group.as_deref().is_some_and(|g| !valid_id(g)) {
            return invalid("a group is 1-64 letters, digits, '-', '_' or '.'");
        }
        Ok(())
    }

    /// The backing root: given, or the top's directory.
    fn root(&self) -> PathBuf {
        match &self.backing_root {
            Some(dir) => dir.clone(),
            None => match self.image.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            },
        }
    }

    /// How the chain is opened while active: `base` with this export's
    /// writability and backing root, tables written back by the flusher.
    pub fn chain_options(&self, base: &ChainOptions) -> ChainOptions {
        ChainOptions {
            writable: !self.read_only,
            backing_root: Some(self.root()),
            // The flusher thread writes tables back when they are due; no
            // guest write waits for it.
            background_write_back: true,
            ..base.clone()
        }
    }

    /// Opens the chain (inactive: read-only, no locks) after checking
    /// that the top lies inside the backing root; a writable open removes
    /// what killed snapshots and merges left beside the top.
    pub fn open(&self, base: &ChainOptions, inactive: bool) -> Result<Chain, ExportSpecError> {
        let root = self.root();
        // The top itself lies inside the root too (its side files are made
        // beside its file): a top whose name points elsewhere is refused.
        let resolve = |path: &Path| {
            std::fs::canonicalize(path).map_err(|e| ExportSpecError::Path {
                path: path.to_path_buf(),
                message: format!("cannot resolve: {e}"),
            })
        };
        let real_top = resolve(&self.image)?;
        let real_root = resolve(&root)?;
        if !real_top.starts_with(&real_root) {
            return Err(ExportSpecError::Path {
                path: self.image.clone(),
                message: format!(
                    "lies outside the backing root {} (its file is {}): give a backing root",
                    real_root.display(),
                    real_top.display()
                ),
            });
        }
        let active = self.chain_options(base);
        let opened = if inactive {
            ChainOptions {
                writable: false,
                inactive: true,
                ..active.clone()
            }
        } else {
            active
        };
        let open_error = |source| ExportSpecError::Open {
            id: self.id.clone(),
            image: self.image.clone(),
            source: Box::new(source),
        };
        let chain = Chain::open(&self.image, &opened).map_err(open_error)?;
        if opened.cache == sqcow2_format::CacheMode::None
            && chain.cluster_size() < MIN_DIRECT_CLUSTER
        {
            return Err(ExportSpecError::Invalid {
                id: self.id.clone(),
                message: format!(
                    "{}: --cache none needs clusters of at least {MIN_DIRECT_CLUSTER} bytes (this image has {})",
                    self.image.display(),
                    chain.cluster_size()
                ),
            });
        }
        if opened.writable {
            // What killed snapshots and merges left beside the top (their
            // temporary files, recognised by their headers, no longer made
            // by anyone): removed, in the top's directory as the chain
            // opened it (inside the backing root); nothing else is touched.
            if let Err(e) = chain.remove_leftovers_beside_top() {
                warn!(error = %e, "could not look for what killed operations left");
            }
        }
        Ok(chain)
    }
}

/// Whether `id` is a usable export name (kept to characters that need no
/// quoting in logs, metrics labels and shells).
pub(crate) fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// What every export of a daemon shares.
#[derive(Debug)]
pub(crate) struct DaemonContext {
    /// The engine threads of every device.
    pub(crate) engine: Arc<EnginePool>,
    /// The queue-worker threads of every session.
    pub(crate) workers: Arc<WorkerPool>,
    /// Permission bits of the sockets made.
    pub(crate) socket_mode: u32,
    /// Whether live snapshots' pauses run at real-time priority.
    pub(crate) realtime_pause: bool,
    /// How long requests wait while inactive.
    pub(crate) inactive_timeout: Duration,
    /// Set when the daemon stops (a signal): every export ends.
    pub(crate) stopping: Arc<AtomicBool>,
    /// The named throttle groups.
    pub(crate) throttle_groups: ThrottleGroups,
}

/// An export being served: its state and its thread.
#[derive(Debug)]
pub(crate) struct Export {
    pub(crate) spec: ExportSpec,
    pub(crate) shared: Arc<Shared>,
    /// Set to end this export alone.
    removed: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<Result<(), ServeError>>>,
}

impl Export {
    /// Serves `chain` as `spec` says (its socket bound and listening when
    /// this returns), on a thread of its own. `chain_options` are how the
    /// chain is opened while active; with `inactive`, `chain` was opened
    /// inactive. A start that fails leaves the chain closed clean and no
    /// file of the export behind.
    pub(crate) fn start(
        spec: ExportSpec,
        chain: Chain,
        chain_options: ChainOptions,
        inactive: bool,
        context: &Arc<DaemonContext>,
    ) -> Result<Export, ServeError> {
        let mut made = MadeFiles::default();
        let listener = match &spec.socket {
            Some(path) => {
                let listener = crate::daemon::socket_file::bind_vhost(path, context.socket_mode)?;
                made.push(path);
                Some(listener)
            }
            None => None,
        };
        let nbd = match &spec.nbd {
            Some((crate::nbd::NbdAddress::Unix(path), export)) => {
                let listener = crate::daemon::socket_file::bind_unix(path, context.socket_mode)
                    .map_err(io_err(format!("nbd socket {}", path.display())))?;
                made.push(path);
                Some((crate::nbd::NbdListener::Unix(listener), export.clone()))
            }
            Some((crate::nbd::NbdAddress::Tcp(addr), export)) => {
                let listener = std::net::TcpListener::bind(addr)
                    .map_err(io_err(format!("nbd address {addr}")))?;
                Some((crate::nbd::NbdListener::Tcp(listener), export.clone()))
            }
            None => None,
        };
        let handle = if inactive {
            Arc::new(ChainHandle::new_inactive(chain))
        } else {
            Arc::new(ChainHandle::new(chain))
        };
        let shared = if inactive {
            Shared::new_inactive(handle, chain_options)
        } else {
            Shared::new(handle, chain_options)
        };
        let shared = Arc::new(
            shared
                .with_inactive_timeout(context.inactive_timeout)
                .with_realtime_pause(context.realtime_pause),
        );
        let limits =
            (spec.group.is_none() || !spec.limits.is_unlimited()).then(|| spec.limits.clone());
        shared.throttle.set(
            &spec.id,
            spec.group.as_deref(),
            limits,
            &context.throttle_groups,
        );
        if let Some((listener, export)) = nbd {
            crate::nbd::spawn(listener, shared.clone(), export).map_err(io_err("nbd thread"))?;
        }
        if !inactive {
            // A daemon killed during a build left the old index serving.
            shared.index_builder.wake();
        }
        let removed = Arc::new(AtomicBool::new(false));
        let mut server = Server {
            shared: shared.clone(),
            spec: spec.clone(),
            context: context.clone(),
            removed: removed.clone(),
            listener: None,
            epoll: Epoll::new().map_err(io_err("epoll"))?,
        };
        if let Some(listener) = listener {
            server
                .epoll
                .ctl(
                    ControlOperation::Add,
                    listener.as_raw_fd(),
                    EpollEvent::new(EventSet::IN, 0),
                )
                .map_err(io_err("epoll"))?;
            server.listener = Some(listener);
        }
        info!(
            export = %spec.id,
            socket = %spec.socket.as_deref().map(|p| p.display().to_string()).unwrap_or_default(),
            image = %shared.handle.get().top().path().display(),
            "ready for a vhost-user frontend"
        );
        let thread = thread::Builder::new()
            .name(format!("export-{}", spec.id))
            .spawn(move || {
                let result = server.run();
                // However the export ended (an error too): no control job
                // goes on, and the chain is left clean; its files go after.
                let stopped = server.shared.end_jobs_for_stop();
                // Held across the flush (I/O) on purpose: no change of the
                // served chain may slip in between; only control requests,
                // which answer `busy` at once (`try_exclusive`), meet it.
                let closed = server.shared.handle.get().flush_clean();
                drop(stopped);
                drop(made);
                result?;
                closed?;
                info!(export = %server.spec.id, "stopped");
                Ok(())
            })
            .map_err(io_err("export thread"))?;
        Ok(Export {
            spec,
            shared,
            removed,
            thread: Some(thread),
        })
    }

    /// Asks the export to end (its guest's requests finish, the chain is
    /// flushed and left clean) without waiting.
    pub(crate) fn ask_to_end(&self) {
        self.removed.store(true, Ordering::SeqCst);
    }

    /// Whether its thread has ended (on its own: an error).
    pub(crate) fn has_ended(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| t.is_finished())
    }

    /// Ends the export (if not asked yet) and waits until it has.
    pub(crate) fn end(mut self) -> Result<(), ServeError> {
        self.ask_to_end();
        self.join()
    }

    fn join(&mut self) -> Result<(), ServeError> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| ServeError::Daemon(format!("export {}: panicked", self.spec.id)))?,
            None => Ok(()),
        }
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        self.ask_to_end();
        if let Err(e) = self.join() {
            warn!(export = %self.spec.id, "{e:#}");
        }
    }
}

/// The accept loop and sessions of one export.
struct Server {
    shared: Arc<Shared>,
    spec: ExportSpec,
    context: Arc<DaemonContext>,
    removed: Arc<AtomicBool>,
    /// `None`: served over NBD only.
    listener: Option<Listener>,
    epoll: Epoll,
}

#[derive(Debug, PartialEq, Eq)]
enum SessionEnd {
    Disconnected,
    Stop,
}

impl Server {
    /// Whether the daemon stops or the export is removed.
    fn stop_requested(&self) -> bool {
        self.context.stopping.load(Ordering::SeqCst) || self.removed.load(Ordering::SeqCst)
    }

    /// Waits up to one poll interval for a connection; whether one waits.
    fn connection_waiting(&self) -> Result<bool, ServeError> {
        if self.listener.is_none() {
            thread::sleep(Duration::from_millis(POLL_INTERVAL_MS as u64));
            return Ok(false);
        }
        let mut events = [EpollEvent::default(); 1];
        match self.epoll.wait(POLL_INTERVAL_MS, &mut events) {
            Ok(n) => Ok(n > 0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
            Err(e) => Err(io_err("epoll wait")(e)),
        }
    }

    fn run(&mut self) -> Result<(), ServeError> {
        loop {
            self.shared.tick();
            if self.stop_requested() {
                // No frontend to drain: the thread ends the control jobs
                // and flushes, as after any end.
                return Ok(());
            }
            if !self.connection_waiting()? {
                continue;
            }
            match self.session() {
                Ok(SessionEnd::Stop) => return Ok(()),
                Ok(SessionEnd::Disconnected) => {}
                Err(e) => {
                    // A frontend could not be set up (out of file
                    // descriptors, memory or threads: the daemon serves
                    // many exports): that one is refused, and the export
                    // waits for the next, after a pause, rather than end.
                    *self.session_slot() = None;
                    crate::limited_warn!(
                        export = %self.spec.id,
                        "a frontend could not be served: {e}; waiting for the next"
                    );
                    for _ in 0..SESSION_RETRY_PAUSE_MS / POLL_INTERVAL_MS {
                        if self.stop_requested() {
                            break;
                        }
                        thread::sleep(Duration::from_millis(POLL_INTERVAL_MS as u64));
                    }
                }
            }
        }
    }

    /// Serves one frontend until it disconnects or the export stops.
    fn session(&mut self) -> Result<SessionEnd, ServeError> {
        let Some(listener) = &self.listener else {
            return Ok(SessionEnd::Disconnected);
        };
        let o = &self.spec;
        let device = Arc::new(
            BlkDevice::new_on(
                self.shared.handle.clone(),
                DeviceOptions {
                    num_queues: o.num_queues,
                    queue_size: o.queue_size,
                    read_only: Some(!self.shared.options.writable),
                    throttle: self.shared.throttle.clone(),
                },
                self.context.engine.clone(),
            )
            .map_err(io_err("flusher thread"))?,
        );
        let backend = Arc::new(
            BlkBackend::new(device, o.queues_per_thread).map_err(io_err("io_uring worker"))?,
        );
        let Some(stream) = listener
            .accept()
            .map_err(|e| ServeError::Daemon(e.to_string()))?
        else {
            return Ok(SessionEnd::Disconnected);
        };
        stream
            .set_nonblocking(false)
            .map_err(io_err("frontend socket"))?;
        let hangup = stream.try_clone().map_err(io_err("frontend socket"))?;
        let threads = Arc::new(
            self.context
                .workers
                .attach(&backend)
                .map_err(io_err("worker threads"))?,
        );
        let channel = BackendChannel::default();
        let handler = FrontendHandler::new(SessionDevice {
            backend: backend.clone(),
            threads: threads.clone(),
        })
        .telling_negotiated(channel.negotiated());
        let reader = stream.try_clone().map_err(io_err("frontend socket"))?;
        let mut requests = BackendReqHandler::from_stream(stream, Arc::new(Mutex::new(handler)));
        info!(export = %o.id, "frontend connected");
        // The last session's end left the image clean: journaled again
        // before this frontend's first request (cheap: nothing is dirty).
        self.shared.handle.get().durability().resume_journal();
        *self.session_slot() = Some(Session {
            backend: backend.clone(),
            channel: channel.clone(),
            worker_threads: threads.threads(),
        });
        // A live resize that ended between the device's making and now
        // found no session to update.
        backend
            .device()
            .set_capacity(self.shared.handle.get().virtual_size());
        let waiter = thread::Builder::new()
            .name("vhost-user".into())
            .spawn(move || loop {
                // The one request the vhost crate cannot serve usefully
                // (see `backend_channel`), taken before it reads.
                match take_channel(&reader, &channel) {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(e) => return vhost::vhost_user::Error::SocketBroken(e),
                }
                if let Err(e) = requests.handle_request() {
                    return e;
                }
            })
            .map_err(io_err("spawning the vhost-user thread"))?;

        let mut end = SessionEnd::Disconnected;
        while !waiter.is_finished() {
            self.shared.tick();
            if self.stop_requested() {
                end = SessionEnd::Stop;
                let _exclusive = self.shared.end_jobs_for_stop();
                // Finish what the guest asked for (requests waiting for
                // the limits too; no new request starts), make it
                // durable, then hang up.
                if !backend.release_parked(STOP_DRAIN_TIMEOUT) {
                    warn!("requests still waiting for the limits after {STOP_DRAIN_TIMEOUT:?}");
                }
                let _paused = backend.pause();
                if !backend.wait_idle(STOP_DRAIN_TIMEOUT) {
                    warn!("requests still in flight after {STOP_DRAIN_TIMEOUT:?}; stopping anyway");
                }
                if let Err(e) = self.shared.handle.get().flush_clean() {
                    warn!("flush: {e}");
                }
                let _ = hangup.shutdown(std::net::Shutdown::Both);
                break;
            }
            if self.connection_waiting()? {
                // A frontend that reconnects right after hanging up finds
                // the old session still ending: give it a moment.
                if finishes_within(&waiter, Duration::from_millis(500)) {
                    break;
                }
                self.refuse_extra_frontends();
            }
        }
        // A panic (a bug) ends the session as a broken connection: the
        // requests in flight are drained and the chain flushed all the
        // same.
        let ended = waiter.join().unwrap_or_else(|_| {
            vhost::vhost_user::Error::SocketBroken(io::Error::other("vhost-user thread panicked"))
        });
        let _ = hangup.shutdown(std::net::Shutdown::Both);
        *self.session_slot() = None;
        match Arc::try_unwrap(threads) {
            Ok(mut threads) => threads.stop(),
            Err(_) => warn!("worker threads still referenced at the end of a session"),
        }
        backend.drain();
        self.shared.gate().clear_wakers();
        match ended {
            vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage => {}
            e if end == SessionEnd::Stop => debug!("frontend connection ended: {e}"),
            e => warn!(export = %self.spec.id, "frontend connection ended: {e}"),
        }
        // A failed flush (full disk, I/O error) is the guest's and the
        // operator's to see, not a reason to stop serving: the next
        // frontend may find space again, and SIGTERM reports it.
        if let Err(e) = self.shared.handle.get().flush_clean() {
            warn!(export = %self.spec.id, "flush after the frontend left: {e}");
        }
        if end == SessionEnd::Disconnected {
            info!(export = %self.spec.id, "frontend disconnected; waiting for the next");
        }
        Ok(end)
    }

    fn session_slot(&self) -> std::sync::MutexGuard<'_, Option<Session>> {
        self.shared
            .session
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Accepts and closes connections that arrive while a frontend is
    /// served: a second frontend would corrupt the first one's device.
    fn refuse_extra_frontends(&self) {
        let Some(listener) = &self.listener else {
            return;
        };
        while let Ok(Some(stream)) = listener.accept() {
            warn!(export = %self.spec.id, "refusing a second frontend while one is connected");
            drop(stream);
        }
    }
}

/// Whether `handle`'s thread ends within `timeout`.
fn finishes_within<T>(handle: &thread::JoinHandle<T>, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while !handle.is_finished() {
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
    true
}
