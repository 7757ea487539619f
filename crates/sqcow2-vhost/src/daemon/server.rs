//! The socket side of `sqcow2 serve`: one frontend at a time, the next one
//! accepted after a disconnect, a second concurrent one refused, the
//! signals that stop qemu-storage-daemon (SIGTERM, SIGINT, SIGHUP,
//! SIGUSR1) drain and flush, readiness for supervisors.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;
use sqcow2_format::{Chain, ChainOptions};
use std::sync::Mutex;

use tracing::{debug, info, warn};
use vhost::vhost_user::{BackendReqHandler, Listener};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::daemon::control::{Session, Shared};
use crate::device::backend::{BlkBackend, SessionDevice, WorkerThreads};
use crate::device::blk::{BlkDevice, DeviceOptions};
use crate::device::handle::ChainHandle;
use crate::transport::backend_channel::{take_channel, BackendChannel};
use crate::transport::frontend::FrontendHandler;

/// The signals that stop the server cleanly: those that stop
/// qemu-storage-daemon with exit status 0 (measured with QEMU 7.2:
/// SIGTERM, SIGINT, SIGHUP, SIGUSR1), so that a supervisor's or a
/// terminal's hang-up never leaves the image dirty.
pub(crate) const STOP_SIGNALS: [i32; 4] = [SIGTERM, SIGINT, SIGHUP, SIGUSR1];

/// How often the accept loop looks at signals.
const POLL_INTERVAL_MS: i32 = 100;
/// Longest wait for requests in flight when stopping.
const STOP_DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How to serve a chain.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The vhost-user socket to listen on (`None`: the disk is served
    /// over NBD only).
    pub socket: Option<PathBuf>,
    /// Request queues offered.
    pub num_queues: u16,
    /// Largest queue the frontend may set up.
    pub queue_size: u16,
    /// Queues served by each worker thread.
    pub queues_per_thread: u16,
    /// Permission bits of the socket.
    pub socket_mode: u32,
    /// Write the daemon's pid here once it accepts connections.
    pub pidfile: Option<PathBuf>,
    /// The control socket (JSON lines; `docs/control-api.md`).
    pub control: Option<PathBuf>,
    /// Engine threads (allocating writes, discards, write-zeroes).
    pub engine_threads: usize,
    /// Start inactive (the chain handed over by another daemon): no image
    /// locks, requests wait until `activate` (at most `inactive_timeout`,
    /// then they fail).
    pub inactive: bool,
    /// How long requests wait while inactive.
    pub inactive_timeout: Duration,
    /// How a worker thread busy-polls its rings after its last piece of
    /// work before it sleeps.
    pub polling: crate::Polling,
    /// Whether a live snapshot's pause runs at real-time priority (where
    /// the daemon is allowed to raise it).
    pub realtime_pause: bool,
    /// Serve the statistics over HTTP for Prometheus here (`HOST:PORT`).
    pub metrics: Option<String>,
    /// Export the chain over NBD there too.
    pub nbd: Option<(crate::nbd::NbdAddress, crate::nbd::Export)>,
}

/// Why serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The socket path is taken.
    #[error("{path}: {reason}")]
    Socket { path: PathBuf, reason: String },
    /// The vhost-user daemon failed.
    #[error("vhost-user: {0}")]
    Daemon(String),
    /// An I/O error (its cause the source: shown once by `{:#}`).
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// Flushing the chain failed.
    #[error(transparent)]
    Chain(#[from] sqcow2_format::Error),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> ServeError {
    let context = context.into();
    move |source| ServeError::Io { context, source }
}

/// Removes a stale socket at `path`; refuses anything else there.
fn claim_socket_path(path: &Path) -> Result<(), ServeError> {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    let taken = |reason: &str| ServeError::Socket {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    if !meta.file_type().is_socket() {
        return Err(taken("exists and is not a socket"));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(taken("another server is listening on it"));
    }
    fs::remove_file(path).map_err(io_err(format!("removing stale socket {}", path.display())))
}

/// Binds the socket with `mode` from the start.
fn bind(path: &Path, mode: u32) -> Result<Listener, ServeError> {
    claim_socket_path(path)?;
    let listener = crate::daemon::socket_file::with_umask(mode, || {
        std::os::unix::net::UnixListener::bind(path)
    })
    .map_err(|e| ServeError::Socket {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let listener = Listener::from(crate::daemon::socket_file::above_connections(listener));
    crate::daemon::socket_file::chmod_socket(path, mode)
        .map_err(io_err(format!("chmod {}", path.display())))?;
    // Accepted only when epoll says a connection waits; never blocks.
    listener
        .set_nonblocking(true)
        .map_err(|e| ServeError::Daemon(e.to_string()))?;
    Ok(listener)
}

/// Everything that lives as long as the server.
struct Server {
    shared: Arc<Shared>,
    options: ServeOptions,
    listener: Listener,
    epoll: Epoll,
    signals: Signals,
}

/// Files a server made (its sockets, its pidfile), by path and identity:
/// removed when it ends, however it ends (a start that fails half-way
/// too), each only if its path still holds the file made.
struct MadeFiles(Vec<(std::path::PathBuf, Option<(u64, u64)>)>);

/// Device and inode of what `path` names (a symlink not followed).
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl MadeFiles {
    fn push(&mut self, path: &Path) {
        self.0.push((path.to_path_buf(), identity(path)));
    }
}

impl Drop for MadeFiles {
    fn drop(&mut self) {
        for (path, id) in &self.0 {
            if id.is_some() && identity(path) == *id {
                let _ = fs::remove_file(path);
            }
        }
    }
}

/// Writes this process's id to `path`: created (exclusively, never
/// through a symlink), or over a stale pidfile there (a regular file
/// holding only the id of a process that no longer runs). Anything else
/// there (a live process's pidfile, a file of other content, a symlink,
/// a FIFO) is refused, untouched.
fn write_pidfile(path: &Path) -> std::io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    let base = OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let refuse = |why: String| std::io::Error::new(std::io::ErrorKind::AlreadyExists, why);
    let fd = match rustix::fs::open(
        path,
        base | OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL,
        Mode::from_raw_mode(0o644),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::EXIST) => {
            let fd = rustix::fs::open(path, base | OFlags::RDWR, Mode::empty()).map_err(
                |e| match e {
                    rustix::io::Errno::LOOP => refuse("a symlink (never written through)".into()),
                    e => e.into(),
                },
            )?;
            let mut file = fs::File::from(fd);
            if !file.metadata()?.file_type().is_file() {
                return Err(refuse("not a regular file".into()));
            }
            let mut text = String::new();
            (&mut file).take(32).read_to_string(&mut text).ok();
            let Ok(pid) = text.trim().parse::<u32>() else {
                return Err(refuse("exists and is not a pidfile (not removed)".into()));
            };
            if Path::new(&format!("/proc/{pid}")).exists() {
                return Err(refuse(format!("the pidfile of running process {pid}")));
            }
            file.into()
        }
        Err(rustix::io::Errno::LOOP) => {
            return Err(refuse("a symlink (never written through)".into()))
        }
        Err(e) => return Err(e.into()),
    };
    let file = fs::File::from(fd);
    if !file.metadata()?.file_type().is_file() {
        return Err(refuse("not a regular file".into()));
    }
    file.set_len(0)?;
    file.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0)
}

/// Serves `chain` until a stop signal (`STOP_SIGNALS`) arrives; flushes it then.
/// `chain_options` are how the chain is opened while active (a live
/// snapshot and an activation reuse them); with `options.inactive`, `chain`
/// was opened inactive (read-only, no locks). A start that fails leaves
/// the chain closed clean and no file of this server behind.
pub fn serve(
    chain: Chain,
    chain_options: ChainOptions,
    options: &ServeOptions,
) -> Result<(), ServeError> {
    // Everything that can fail for want of a path first, before any
    // thread holds the chain: a failure here drops it, closed clean.
    // Before the pidfile, which tells that a signal stops the server
    // cleanly from now on.
    let signals = Signals::new(STOP_SIGNALS).map_err(io_err("signal handlers"))?;
    let mut made = MadeFiles(Vec::new());
    let listener = match &options.socket {
        Some(path) => {
            let listener = bind(path, options.socket_mode)?;
            made.push(path);
            Some(listener)
        }
        None => None,
    };
    let control = match &options.control {
        Some(path) => {
            let control = crate::daemon::control::bind(path, options.socket_mode)
                .map_err(io_err(format!("control socket {}", path.display())))?;
            made.push(path);
            crate::daemon::socket_file::chmod_socket(path, options.socket_mode)
                .map_err(io_err(format!("chmod {}", path.display())))?;
            Some(control)
        }
        None => None,
    };
    let nbd = match &options.nbd {
        Some((crate::nbd::NbdAddress::Unix(path), export)) => {
            let listener = crate::daemon::control::bind(path, options.socket_mode)
                .map_err(io_err(format!("nbd socket {}", path.display())))?;
            made.push(path);
            Some((crate::nbd::NbdListener::Unix(listener), export.clone()))
        }
        Some((crate::nbd::NbdAddress::Tcp(addr), export)) => {
            let listener =
                std::net::TcpListener::bind(addr).map_err(io_err(format!("nbd address {addr}")))?;
            Some((crate::nbd::NbdListener::Tcp(listener), export.clone()))
        }
        None => None,
    };
    let metrics = match &options.metrics {
        Some(addr) => {
            Some(crate::daemon::control::metrics_http::bind(addr).map_err(io_err("metrics"))?)
        }
        None => None,
    };
    if let Some(pidfile) = &options.pidfile {
        write_pidfile(pidfile).map_err(io_err(format!("writing {}", pidfile.display())))?;
        made.push(pidfile);
    }
    let shared = if options.inactive {
        Shared::new_inactive(Arc::new(ChainHandle::new_inactive(chain)), chain_options)
    } else {
        Shared::new(Arc::new(ChainHandle::new(chain)), chain_options)
    };
    let handle = shared.handle.clone();
    let shared = Arc::new(
        shared
            .with_inactive_timeout(options.inactive_timeout)
            .with_realtime_pause(options.realtime_pause),
    );
    if let Some((listener, export)) = nbd {
        crate::nbd::spawn(listener, shared.clone(), export).map_err(io_err("nbd thread"))?;
    }
    let result = start_and_run(shared.clone(), control, metrics, listener, signals, options);
    // However the server ended (an error too): no control job goes on,
    // and the chain is left clean; its files go after.
    let stopped = shared.end_jobs_for_stop();
    // Held across the flush (I/O) on purpose: no change of the served
    // chain may slip in between; only control requests, which answer
    // `busy` at once (`try_exclusive`), meet it.
    let closed = handle.get().flush_clean();
    drop(stopped);
    drop(made);
    result?;
    closed?;
    info!("stopped");
    Ok(())
}

/// The threads and event loop of a server whose files are made.
fn start_and_run(
    shared: Arc<Shared>,
    control: Option<std::os::unix::net::UnixListener>,
    metrics: Option<crate::daemon::control::metrics_http::MetricsEndpoint>,
    listener: Option<Listener>,
    mut signals: Signals,
    options: &ServeOptions,
) -> Result<(), ServeError> {
    if !options.inactive {
        // A daemon killed during a build left the old index serving.
        shared.index_builder.wake();
    }
    if let Some(control) = control {
        crate::daemon::control::spawn(control, shared.clone()).map_err(io_err("control thread"))?;
    }
    if let Some(endpoint) = metrics {
        crate::daemon::control::metrics_http::spawn(endpoint, shared.clone())
            .map_err(io_err("metrics thread"))?;
    }
    let Some(listener) = listener else {
        // No vhost-user frontend: the NBD export (and the control socket)
        // serve until a stop signal.
        if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
            warn!("sd_notify: {e}");
        }
        info!(
            image = %shared.handle.get().top().path().display(),
            "serving over NBD only (no vhost-user socket)"
        );
        loop {
            if let Some(signal) = signals.pending().next() {
                info!(signal, "stopping");
                return Ok(());
            }
            thread::sleep(Duration::from_millis(POLL_INTERVAL_MS as u64));
        }
    };
    let epoll = Epoll::new().map_err(io_err("epoll"))?;
    epoll
        .ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, 0),
        )
        .map_err(io_err("epoll"))?;
    let mut server = Server {
        shared,
        options: options.clone(),
        listener,
        epoll,
        signals,
    };
    if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
        warn!("sd_notify: {e}");
    }
    info!(
        socket = %listener_path(options),
        image = %server.shared.handle.get().top().path().display(),
        "ready for a vhost-user frontend"
    );
    server.run()
}

impl Server {
    /// Whether one of the [`STOP_SIGNALS`] arrived.
    fn stop_requested(&mut self) -> bool {
        let mut stop = false;
        for signal in self.signals.pending() {
            info!(signal, "stopping");
            stop = true;
        }
        stop
    }

    /// Waits up to one poll interval for a connection; whether one waits.
    fn connection_waiting(&self) -> Result<bool, ServeError> {
        let mut events = [EpollEvent::default(); 1];
        match self.epoll.wait(POLL_INTERVAL_MS, &mut events) {
            Ok(n) => Ok(n > 0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
            Err(e) => Err(io_err("epoll wait")(e)),
        }
    }

    fn run(&mut self) -> Result<(), ServeError> {
        loop {
            if self.stop_requested() {
                // No frontend to drain: `serve` ends the control jobs and
                // flushes, as after any end.
                return Ok(());
            }
            if !self.connection_waiting()? {
                continue;
            }
            if self.session()? == SessionEnd::Stop {
                return Ok(());
            }
        }
    }

    /// Serves one frontend until it disconnects or a signal asks to stop.
    fn session(&mut self) -> Result<SessionEnd, ServeError> {
        let o = &self.options;
        let device = Arc::new(
            BlkDevice::new(
                self.shared.handle.clone(),
                DeviceOptions {
                    num_queues: o.num_queues,
                    queue_size: o.queue_size,
                    engine_threads: o.engine_threads,
                    read_only: Some(!self.shared.options.writable),
                },
            )
            .map_err(io_err("engine threads"))?,
        );
        let backend = Arc::new(
            BlkBackend::new(device, o.queues_per_thread).map_err(io_err("io_uring worker"))?,
        );
        let Some(stream) = self
            .listener
            .accept()
            .map_err(|e| ServeError::Daemon(e.to_string()))?
        else {
            return Ok(SessionEnd::Disconnected);
        };
        stream
            .set_nonblocking(false)
            .map_err(io_err("frontend socket"))?;
        let hangup = stream.try_clone().map_err(io_err("frontend socket"))?;
        let threads =
            Arc::new(WorkerThreads::start(&backend, o.polling).map_err(io_err("worker threads"))?);
        let channel = BackendChannel::default();
        let handler = FrontendHandler::new(SessionDevice {
            backend: backend.clone(),
            threads: threads.clone(),
        })
        .telling_negotiated(channel.negotiated());
        let reader = stream.try_clone().map_err(io_err("frontend socket"))?;
        let mut requests = BackendReqHandler::from_stream(stream, Arc::new(Mutex::new(handler)));
        info!("frontend connected");
        // The last session's end left the image clean: journaled again
        // before this frontend's first request (cheap: nothing is dirty).
        self.shared.handle.get().durability().resume_journal();
        *self.session_slot() = Some(Session {
            backend: backend.clone(),
            channel: channel.clone(),
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
                // Finish what the guest asked for (no new request starts),
                // make it durable, then hang up.
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
        let ended = waiter
            .join()
            .map_err(|_| ServeError::Daemon("vhost-user thread panicked".into()))?;
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
            e => warn!("frontend connection ended: {e}"),
        }
        // A failed flush (full disk, I/O error) is the guest's and the
        // operator's to see, not a reason to stop serving: the next
        // frontend may find space again, and SIGTERM reports it.
        if let Err(e) = self.shared.handle.get().flush_clean() {
            warn!("flush after the frontend left: {e}");
        }
        if end == SessionEnd::Disconnected {
            info!("frontend disconnected; waiting for the next");
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
        while let Ok(Some(stream)) = self.listener.accept() {
            warn!("refusing a second frontend while one is connected");
            drop(stream);
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum SessionEnd {
    Disconnected,
    Stop,
}

/// The vhost-user socket's path, for the log.
fn listener_path(options: &ServeOptions) -> String {
    options
        .socket
        .as_deref()
        .map(|p| p.display().to_string())
        .unwrap_or_default()
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
