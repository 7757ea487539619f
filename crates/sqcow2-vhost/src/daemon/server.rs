//! The process side of `sqcow2 serve`: its exports started, the control
//! socket and metrics endpoint, the signals that stop
//! qemu-storage-daemon (SIGTERM, SIGINT, SIGHUP, SIGUSR1) ending every
//! export (drained and flushed), readiness for supervisors.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;
use sqcow2_format::ChainOptions;
use tracing::{error, info, warn};

use crate::daemon::error::{io_err, ServeError};
use crate::daemon::export::{DaemonContext, ExportSpec};
use crate::daemon::exports::Exports;
use crate::daemon::socket_file::MadeFiles;
use crate::device::offload::EnginePool;
use crate::device::worker_pool::WorkerPool;

/// The signals that stop the server cleanly: those that stop
/// qemu-storage-daemon with exit status 0 (measured with QEMU 7.2:
/// SIGTERM, SIGINT, SIGHUP, SIGUSR1), so that a supervisor's or a
/// terminal's hang-up never leaves the image dirty.
pub(crate) const STOP_SIGNALS: [i32; 4] = [SIGTERM, SIGINT, SIGHUP, SIGUSR1];

/// How often the daemon looks at signals and ended exports.
const POLL_INTERVAL_MS: u64 = 100;

/// How the daemon serves its exports (what every export shares).
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Permission bits of the sockets.
    pub socket_mode: u32,
    /// Write the daemon's pid here once it accepts connections.
    pub pidfile: Option<PathBuf>,
    /// The control socket (JSON lines; `docs/control-api.md`).
    pub control: Option<PathBuf>,
    /// Engine threads (allocating writes, discards, write-zeroes), one
    /// set for every export.
    pub engine_threads: usize,
    /// Start inactive (the chains handed over by another daemon): no image
    /// locks, requests wait until `activate` (at most `inactive_timeout`,
    /// then they fail).
    pub inactive: bool,
    /// How long requests wait while inactive.
    pub inactive_timeout: Duration,
    /// How a worker thread busy-polls its rings after its last piece of
    /// work before it sleeps.
    pub polling: crate::Polling,
    /// Queue-worker threads, one set for every export (at most
    /// [`crate::MAX_WORKER_THREADS`]): each frontend's queue groups are
    /// served by the least loaded, threads starting as groups come.
    pub worker_threads: usize,
    /// Whether a live snapshot's pause runs at real-time priority (where
    /// the daemon is allowed to raise it).
    pub realtime_pause: bool,
    /// Serve the statistics over HTTP for Prometheus here (`HOST:PORT`).
    pub metrics: Option<String>,
    /// Backing files of exports added later must lie inside this
    /// directory (`None`: each top's directory).
    pub backing_root: Option<PathBuf>,
    /// Most exports served at a time ([`crate::MAX_EXPORTS`] by default).
    pub max_exports: usize,
    /// Share the layer files the exports' chains have in common (opened
    /// once, their tables cached once in a cache of this many bytes);
    /// `None`: each chain its own.
    pub shared_cache_size: Option<u64>,
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

/// Serves `exports` until a stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1) arrives, then
/// ends each (its requests drained, its chain flushed and left clean).
/// `chain_options` are how chains are opened (each export's keys on
/// top). A start that fails leaves every chain closed clean and no file
/// of this daemon behind.
pub fn serve(
    exports: Vec<ExportSpec>,
    chain_options: ChainOptions,
    options: &ServeOptions,
) -> Result<(), ServeError> {
    // Everything that can fail for want of a path first. Before the
    // pidfile, which tells that a signal stops the server cleanly from
    // now on.
    let mut signals = Signals::new(STOP_SIGNALS).map_err(io_err("signal handlers"))?;
    let mut made = MadeFiles::default();
    let control = match &options.control {
        Some(path) => {
            let control = crate::daemon::socket_file::bind_unix(path, options.socket_mode)
                .map_err(io_err(format!("control socket {}", path.display())))?;
            made.push(path);
            crate::daemon::socket_file::chmod_socket(path, options.socket_mode)
                .map_err(io_err(format!("chmod {}", path.display())))?;
            Some(control)
        }
        None => None,
    };
    let metrics = match &options.metrics {
        Some(addr) => Some(crate::daemon::metrics_http::bind(addr).map_err(io_err("metrics"))?),
        None => None,
    };
    let context = Arc::new(DaemonContext {
        engine: EnginePool::start(options.engine_threads).map_err(io_err("engine threads"))?,
        workers: WorkerPool::new(options.worker_threads, options.polling),
        socket_mode: options.socket_mode,
        realtime_pause: options.realtime_pause,
        inactive_timeout: options.inactive_timeout,
        stopping: Arc::new(AtomicBool::new(false)),
        throttle_groups: Default::default(),
    });
    let chain_options = ChainOptions {
        shared_layers: options
            .shared_cache_size
            .map(|bytes| Arc::new(sqcow2_format::SharedLayers::new(bytes))),
        ..chain_options
    };
    let served = Arc::new(Exports::new(
        context.clone(),
        chain_options,
        options.backing_root.clone(),
        options.max_exports,
    ));
    let started = exports.len();
    for spec in exports {
        if let Err(e) = served.add(spec, options.inactive) {
            // Those started end clean.
            let _ = served.end_all();
            return Err(ServeError::Export(Box::new(e)));
        }
    }
    if let Some(pidfile) = &options.pidfile {
        if let Err(e) = write_pidfile(pidfile) {
            let _ = served.end_all();
            return Err(io_err(format!("writing {}", pidfile.display()))(e));
        }
        made.push(pidfile);
    }
    if let Some(control) = control {
        crate::daemon::control_socket::spawn(control, served.clone())
            .map_err(io_err("control thread"))?;
    }
    if let Some(endpoint) = metrics {
        crate::daemon::metrics_http::spawn(endpoint, served.clone())
            .map_err(io_err("metrics thread"))?;
    }
    if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
        warn!("sd_notify: {e}");
    }
    info!(exports = started, "serving");
    let mut first_error = None;
    loop {
        if let Some(signal) = signals.pending().next() {
            info!(signal, "stopping");
            break;
        }
        for (id, ended) in served.reap_ended() {
            match ended {
                Ok(()) => info!(export = %id, "ended"),
                Err(e) => {
                    error!(export = %id, "ended: {e:#}");
                    first_error.get_or_insert(e);
                }
            }
        }
        // Without a control socket nothing can add one again.
        if options.control.is_none() && served.all().is_empty() {
            break;
        }
        thread::sleep(Duration::from_millis(POLL_INTERVAL_MS));
    }
    context
        .stopping
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let ended = served.end_all();
    drop(made);
    if let Some(e) = first_error {
        return Err(e);
    }
    ended?;
    info!("stopped");
    Ok(())
}
