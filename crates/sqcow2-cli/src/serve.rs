//! `sqcow2 serve`: export a chain as a vhost-user-blk device.

use std::path::PathBuf;

use anyhow::{bail, Context};
use sqcow2_format::{Chain, ChainOptions};
use sqcow2_vhost::{Polling, ServeOptions};

/// Arguments of `sqcow2 serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The vhost-user socket to create (optional with --nbd: the disk is
    /// then served over NBD only).
    #[arg(long, required_unless_present = "nbd")]
    socket: Option<PathBuf>,
    /// Export read-only (the device reports VIRTIO_BLK_F_RO).
    #[arg(long)]
    read_only: bool,
    /// Request queues offered to the guest (1-64).
    #[arg(long, default_value_t = 1)]
    num_queues: u16,
    /// Largest virtqueue the frontend may set up (a power of two).
    #[arg(long, default_value_t = 256)]
    queue_size: u16,
    /// Queues handled by each worker thread.
    #[arg(long, default_value_t = 1)]
    queues_per_thread: u16,
    /// Permission bits of the socket, in octal.
    #[arg(long, default_value = "600")]
    socket_mode: String,
    /// Write the daemon's pid to this file once it accepts connections.
    #[arg(long)]
    pidfile: Option<PathBuf>,
    /// Backing files must lie inside this directory, symlinks resolved
    /// (default: the top image's directory).
    #[arg(long)]
    backing_root: Option<PathBuf>,
    /// Control socket (JSON lines: snapshot, stats, info, flush; see
    /// docs/control-api.md), created with --socket-mode.
    #[arg(long)]
    control: Option<PathBuf>,
    /// Engine threads: allocating writes, discards and write-zeroes run
    /// there, so that they never hold up the other requests of a queue.
    /// Default: 4, or 16 with `--cache none` (their transfers wait for
    /// the device).
    #[arg(long)]
    engine_threads: Option<usize>,
    /// Start inactive, for a disk another daemon still serves (a live
    /// migration's destination): no image lock is taken and requests wait
    /// until `sqcow2 activate CONTROL`.
    #[arg(long, requires = "control")]
    inactive: bool,
    /// Seconds requests wait while the daemon is inactive before they
    /// fail with an I/O error.
    #[arg(long, default_value_t = 60.0)]
    inactive_timeout: f64,
    /// Microseconds a worker thread busy-polls its rings (guest
    /// notifications off) after its last piece of work before it sleeps,
    /// always; 0 never polls. Not given: adaptive, up to `--poll-max-us`
    /// (polled while requests come back sooner than that, as
    /// qemu-storage-daemon's iothreads adapt theirs; an idle queue costs
    /// no CPU).
    #[arg(long)]
    poll_us: Option<u64>,
    /// The longest adaptive poll, in microseconds (0: never poll);
    /// QEMU's iothreads default to 32. While a worker waits only for
    /// engine jobs (allocating writes at low depth), 8 times that.
    #[arg(long, default_value_t = 32, conflicts_with = "poll_us")]
    poll_max_us: u64,
    /// Run a live snapshot's pause at normal priority. By default the
    /// thread doing it runs at real-time priority (`SCHED_FIFO`, lowest
    /// level) for the pause, where the daemon may (`CAP_SYS_NICE`), so
    /// that no other thread of the host delays the guest's wait.
    #[arg(long)]
    no_realtime_pause: bool,
    /// Serve the statistics for Prometheus over HTTP at HOST:PORT
    /// (`GET /metrics`, OpenMetrics text; port 0 picks one, logged). The
    /// same numbers as `sqcow2 stats --output prometheus`.
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<String>,
    /// Export the disk over NBD too, on a Unix socket (`unix:PATH`) or a
    /// TCP address (`tcp:HOST:PORT`, port 0 picks one, logged), as
    /// qemu-nbd would: read with `qemu-img ... nbd+unix:///?socket=PATH`,
    /// `nbdcopy`, `nbdinfo --map`; block status for `base:allocation`,
    /// `qemu:allocation-depth` and `qemu:dirty-bitmap:NAME`.
    #[arg(long, value_name = "unix:PATH|tcp:HOST:PORT")]
    nbd: Option<String>,
    /// The NBD export's name (default empty, as qemu-nbd's).
    #[arg(long, value_name = "NAME", default_value = "")]
    nbd_name: String,
    /// Let NBD clients write, trim and zero (default: read-only).
    #[arg(long)]
    nbd_writable: bool,
    /// Host page cache use, as QEMU's `cache` option: `none` opens the
    /// images `O_DIRECT` too (guest data and aligned metadata bypass the
    /// page cache; flushes still sync), `writeback` goes through it.
    #[arg(long, value_enum, default_value_t = Cache::Writeback)]
    cache: Cache,
    /// The top image of the chain.
    image: PathBuf,
}

/// `--cache`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Cache {
    Writeback,
    None,
}

/// Smallest cluster of a top served with `--cache none`: a cluster
/// never shares a page with another, so the page cache (sub-sector
/// metadata words) and direct writes (data) never meet in one page.
const MIN_DIRECT_CLUSTER: u64 = 4096;

pub fn run(args: &ServeArgs, options: &ChainOptions) -> anyhow::Result<()> {
    if !(1..=64).contains(&args.num_queues) {
        bail!("--num-queues must be between 1 and 64");
    }
    if !args.queue_size.is_power_of_two() || args.queue_size < 2 {
        bail!("--queue-size must be a power of two, at least 2");
    }
    if args.queues_per_thread == 0 {
        bail!("--queues-per-thread must be at least 1");
    }
    let engine_threads = args.engine_threads.unwrap_or(match args.cache {
        Cache::Writeback => sqcow2_vhost::DEFAULT_ENGINE_THREADS,
        Cache::None => sqcow2_vhost::DEFAULT_DIRECT_ENGINE_THREADS,
    });
    if !(1..=256).contains(&engine_threads) {
        bail!("--engine-threads must be between 1 and 256");
    }
    let socket_mode = u32::from_str_radix(&args.socket_mode, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .with_context(|| format!("--socket-mode {}: not an octal mode", args.socket_mode))?;
    let backing_root = match &args.backing_root {
        Some(dir) => dir.clone(),
        None => match args.image.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        },
    };
    // The top itself lies inside the root too (its side files are made
    // beside its file): a top whose name points elsewhere is refused.
    let real_top = std::fs::canonicalize(&args.image)
        .with_context(|| format!("{}: cannot resolve", args.image.display()))?;
    let real_root = std::fs::canonicalize(&backing_root)
        .with_context(|| format!("{}: cannot resolve", backing_root.display()))?;
    if !real_top.starts_with(&real_root) {
        bail!(
            "{}: lies outside the backing root {} (its file is {}): pass --backing-root",
            args.image.display(),
            real_root.display(),
            real_top.display()
        );
    }
    let chain_options = ChainOptions {
        writable: !args.read_only,
        backing_root: Some(backing_root),
        // The flusher thread writes tables back when they are due; no
        // guest write waits for it.
        background_write_back: true,
        cache: match args.cache {
            Cache::Writeback => sqcow2_format::CacheMode::WriteBack,
            Cache::None => sqcow2_format::CacheMode::None,
        },
        ..options.clone()
    };
    let opened = if args.inactive {
        ChainOptions {
            writable: false,
            inactive: true,
            ..chain_options.clone()
        }
    } else {
        chain_options.clone()
    };
    let chain = Chain::open(&args.image, &opened)?;
    if args.cache == Cache::None && chain.cluster_size() < MIN_DIRECT_CLUSTER {
        bail!(
            "{}: --cache none needs clusters of at least {MIN_DIRECT_CLUSTER} bytes (this image has {})",
            args.image.display(),
            chain.cluster_size()
        );
    }
    if opened.writable {
        // What killed snapshots and merges left beside the top (their
        // temporary files, recognised by their headers, no longer made by
        // anyone): removed, in the top's directory as the chain opened it
        // (inside the backing root); nothing else is touched.
        if let Err(e) = chain.remove_leftovers_beside_top() {
            tracing::warn!(error = %e, "could not look for what killed operations left");
        }
    }
    anyhow::ensure!(
        args.inactive_timeout.is_finite() && args.inactive_timeout >= 0.0,
        "--inactive-timeout must be a number of seconds"
    );
    let serve = ServeOptions {
        socket: args.socket.clone(),
        num_queues: args.num_queues,
        queue_size: args.queue_size,
        queues_per_thread: args.queues_per_thread,
        socket_mode,
        pidfile: args.pidfile.clone(),
        control: args.control.clone(),
        engine_threads,
        inactive: args.inactive,
        inactive_timeout: std::time::Duration::from_secs_f64(args.inactive_timeout),
        polling: match (args.poll_us, args.poll_max_us) {
            (Some(0), _) | (None, 0) => Polling::Off,
            (Some(us), _) => Polling::Fixed(std::time::Duration::from_micros(us)),
            (None, max) => Polling::Adaptive {
                max: std::time::Duration::from_micros(max),
            },
        },
        realtime_pause: !args.no_realtime_pause,
        metrics: args.metrics.clone(),
        nbd: match &args.nbd {
            Some(spec) => Some((
                sqcow2_vhost::nbd::NbdAddress::parse(spec).ok_or_else(|| {
                    anyhow::anyhow!("--nbd takes unix:PATH or tcp:HOST:PORT (got {spec:?})")
                })?,
                sqcow2_vhost::nbd::Export {
                    name: args.nbd_name.clone(),
                    writable: args.nbd_writable,
                },
            )),
            None => None,
        },
    };
    sqcow2_vhost::serve(chain, chain_options, &serve)
        .with_context(|| format!("serving {}", args.image.display()))
}
