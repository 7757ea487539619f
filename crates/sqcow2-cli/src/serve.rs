//! `sqcow2 serve`: export a chain as a vhost-user-blk device.

use std::path::PathBuf;

use anyhow::{bail, Context};
use sqcow2_format::ChainOptions;
use sqcow2_vhost::{ExportSpec, Polling, ServeOptions};

/// Arguments of `sqcow2 serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The vhost-user socket to create (optional with --nbd: the disk is
    /// then served over NBD only).
    #[arg(
        long,
        required_unless_present_any = ["nbd", "export", "config"],
        conflicts_with_all = ["export", "config"]
    )]
    socket: Option<PathBuf>,
    /// One export of several served by this daemon, as KEY=VALUE pairs
    /// joined by commas (a comma in a value doubled, as QEMU's):
    /// socket=PATH and image=PATH, then any of id=NAME, read-only=on,
    /// num-queues=N, queue-size=N, backing-root=DIR, group=NAME and the
    /// I/O limits by QEMU's throttle names (iops-total, iops-read,
    /// iops-write, bps-total, bps-read, bps-write, each also with -max
    /// and -max-length, and iops-size); exports naming one group share
    /// its limits. Repeated for each disk; the other options apply to
    /// every export. Instead of --socket and IMAGE.
    #[arg(long, value_name = "KEY=VALUE,...")]
    export: Vec<String>,
    /// A JSON file of exports, with or instead of --export:
    /// {"exports": [{"socket": PATH, "image": PATH, "id": NAME, ...}]},
    /// each object taking --export's keys (numbers as numbers, read-only
    /// as true or false); relative paths from the file's directory.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// I/O limits of the single export, `KEY=VALUE,...` with QEMU's
    /// throttle names (iops-total, bps-write-max, ...; see --export).
    #[arg(long, value_name = "KEY=VALUE,...", conflicts_with = "export")]
    limits: Option<String>,
    /// With --export: bytes of the one cache of the layers the exports'
    /// chains share (each such file opened once, its tables cached once);
    /// each export's own layers, top and index keep a cache of
    /// --cache-size of their own, which the others cannot evict.
    #[arg(long, default_value = "64M", value_name = "BYTES")]
    shared_cache_size: String,
    /// Most exports served at a time (those added over the control
    /// socket past it are refused).
    #[arg(long, default_value_t = sqcow2_vhost::MAX_EXPORTS)]
    max_exports: usize,
    /// Export read-only (the device reports VIRTIO_BLK_F_RO).
    #[arg(long)]
    read_only: bool,
    /// Request queues offered to the guest (1-64).
    #[arg(long, default_value_t = 1)]
    num_queues: u16,
    /// Largest virtqueue the frontend may set up (a power of two).
    #[arg(long, default_value_t = 256)]
    queue_size: u16,
    /// Queues of one export handled together, as one group: a worker
    /// thread takes each group whole.
    #[arg(long, default_value_t = 1)]
    queues_per_thread: u16,
    /// Queue-worker threads, one set for every export: each frontend's
    /// queue groups go to the least loaded, and threads start as groups
    /// come (one disk of one queue runs one). Default: the CPUs.
    #[arg(long, value_name = "N")]
    worker_threads: Option<usize>,
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
    /// The top image of the chain (the single-export form).
    #[arg(
        required_unless_present_any = ["export", "config"],
        conflicts_with_all = ["export", "config"]
    )]
    image: Option<PathBuf>,
}

/// `--cache`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Cache {
    Writeback,
    None,
}

pub fn run(args: &ServeArgs, options: &ChainOptions) -> anyhow::Result<()> {
    let engine_threads = args.engine_threads.unwrap_or(match args.cache {
        Cache::Writeback => sqcow2_vhost::DEFAULT_ENGINE_THREADS,
        Cache::None => sqcow2_vhost::DEFAULT_DIRECT_ENGINE_THREADS,
    });
    if !(1..=256).contains(&engine_threads) {
        bail!("--engine-threads must be between 1 and 256");
    }
    let worker_threads = args.worker_threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(sqcow2_vhost::MAX_WORKER_THREADS)
    });
    if !(1..=sqcow2_vhost::MAX_WORKER_THREADS).contains(&worker_threads) {
        bail!(
            "--worker-threads must be between 1 and {}",
            sqcow2_vhost::MAX_WORKER_THREADS
        );
    }
    let socket_mode = u32::from_str_radix(&args.socket_mode, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .with_context(|| format!("--socket-mode {}: not an octal mode", args.socket_mode))?;
    anyhow::ensure!(
        args.inactive_timeout.is_finite() && args.inactive_timeout >= 0.0,
        "--inactive-timeout must be a number of seconds"
    );
    let exports = exports(args)?;
    if exports.len() > args.max_exports {
        bail!(
            "{} exports given, more than --max-exports {}",
            exports.len(),
            args.max_exports
        );
    }
    let chain_options = ChainOptions {
        cache: match args.cache {
            Cache::Writeback => sqcow2_format::CacheMode::WriteBack,
            Cache::None => sqcow2_format::CacheMode::None,
        },
        ..options.clone()
    };
    let serve = ServeOptions {
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
        worker_threads,
        realtime_pause: !args.no_realtime_pause,
        metrics: args.metrics.clone(),
        backing_root: args.backing_root.clone(),
        max_exports: args.max_exports,
        // The single-export form keeps its chain's layers to itself.
        shared_cache_size: (!args.export.is_empty())
            .then(|| crate::output::parse_size(&args.shared_cache_size))
            .transpose()?,
    };
    let what = match (&args.image, exports.as_slice()) {
        (Some(image), _) => image.display().to_string(),
        (None, [one]) => one.image.display().to_string(),
        (None, all) => format!("{} exports", all.len()),
    };
    sqcow2_vhost::serve(exports, chain_options, &serve).with_context(|| format!("serving {what}"))
}

/// The exports asked for: the single-export form's, or each `--export`.
fn exports(args: &ServeArgs) -> anyhow::Result<Vec<ExportSpec>> {
    if !(1..=64).contains(&args.num_queues) {
        bail!("--num-queues must be between 1 and 64");
    }
    if !args.queue_size.is_power_of_two() || args.queue_size < 2 {
        bail!("--queue-size must be a power of two, at least 2");
    }
    if args.queues_per_thread == 0 {
        bail!("--queues-per-thread must be at least 1");
    }
    let defaults = |id: String, image: PathBuf| ExportSpec {
        socket: None,
        read_only: args.read_only,
        num_queues: args.num_queues,
        queue_size: args.queue_size,
        queues_per_thread: args.queues_per_thread,
        backing_root: args.backing_root.clone(),
        ..ExportSpec::new(id, image)
    };
    let nbd = match &args.nbd {
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
    };
    if let Some(image) = &args.image {
        let limits = match &args.limits {
            Some(text) => limits_only(text).context("--limits")?,
            None => Default::default(),
        };
        let spec = ExportSpec {
            socket: args.socket.clone(),
            nbd,
            limits,
            ..defaults("disk0".into(), image.clone())
        };
        spec.validate()?;
        return Ok(vec![spec]);
    }
    // Each export's keys, and what names it in an error.
    let mut given: Vec<(String, Keys)> = Vec::new();
    for text in &args.export {
        given.push((
            format!("--export {text}"),
            keyvals(text).with_context(|| format!("--export {text}"))?,
        ));
    }
    if let Some(file) = &args.config {
        given.extend(config_exports(file)?);
    }
    let mut specs = Vec::new();
    for (n, (what, keys)) in given.into_iter().enumerate() {
        let spec = parse_export_keys(keys, |image| defaults(format!("disk{n}"), image))
            .with_context(|| what.clone())?;
        if let Some(other) = specs.iter().find(|o: &&ExportSpec| o.id == spec.id) {
            bail!(
                "{what}: the id {} is taken by {}",
                spec.id,
                other.image.display()
            );
        }
        if let Some(other) = specs.iter().find(|o: &&ExportSpec| o.socket == spec.socket) {
            bail!("{what}: the socket is taken by export {}", other.id);
        }
        specs.push(spec);
    }
    match (nbd, specs.as_mut_slice()) {
        (None, _) => {}
        (Some(nbd), [one]) => one.nbd = Some(nbd),
        (Some(_), _) => bail!("--nbd serves one disk: give it with a single export"),
    }
    Ok(specs)
}

/// `KEY=VALUE,...` of one `--export` (a comma in a value doubled); `with`
/// makes the spec from the image, with the daemon-wide defaults.
#[cfg(test)]
fn parse_export(
    text: &str,
    with: impl FnOnce(PathBuf) -> ExportSpec,
) -> anyhow::Result<ExportSpec> {
    parse_export_keys(keyvals(text)?, with)
}

/// The exports of a `--config` file, each with its keys (paths made
/// absolute from the file's directory) and a name for its errors.
fn config_exports(file: &std::path::Path) -> anyhow::Result<Vec<(String, Keys)>> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Config {
        exports: Vec<serde_json::Map<String, serde_json::Value>>,
    }
    let text =
        std::fs::read_to_string(file).with_context(|| format!("--config {}", file.display()))?;
    let config: Config = serde_json::from_str(&text).with_context(|| {
        format!(
            "--config {}: not a JSON object of \"exports\"",
            file.display()
        )
    })?;
    let dir = file.parent().unwrap_or(std::path::Path::new("."));
    let mut out = Vec::new();
    for (n, export) in config.exports.into_iter().enumerate() {
        let what = format!("{}: export {n}", file.display());
        let mut keys = Vec::new();
        for (key, value) in export {
            let value = match value {
                serde_json::Value::String(s)
                    if matches!(key.as_str(), "socket" | "image" | "backing-root") =>
                {
                    dir.join(s).to_string_lossy().into_owned()
                }
                serde_json::Value::String(s) => s,
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => if b { "on" } else { "off" }.to_owned(),
                other => bail!("{what}: {key} is {other}, not a string, number or boolean"),
            };
            keys.push((key, value));
        }
        out.push((what, keys));
    }
    Ok(out)
}

fn parse_export_keys(
    keys: Vec<(String, String)>,
    with: impl FnOnce(PathBuf) -> ExportSpec,
) -> anyhow::Result<ExportSpec> {
    let take = |name: &str| keys.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let image = take("image").context("image=PATH is missing")?;
    let mut spec = with(PathBuf::from(image));
    spec.socket = Some(PathBuf::from(
        take("socket").context("socket=PATH is missing")?,
    ));
    for (key, value) in &keys {
        let number = |what: &str| {
            value
                .parse::<u16>()
                .with_context(|| format!("{what}={value}: not a number"))
        };
        match key.as_str() {
            "image" | "socket" => {}
            "id" => spec.id = value.clone(),
            "read-only" => {
                spec.read_only = match value.as_str() {
                    "on" | "true" | "yes" => true,
                    "off" | "false" | "no" => false,
                    _ => bail!("read-only={value}: on or off"),
                }
            }
            "num-queues" => spec.num_queues = number("num-queues")?,
            "queue-size" => spec.queue_size = number("queue-size")?,
            "backing-root" => spec.backing_root = Some(PathBuf::from(value)),
            "group" => spec.group = Some(value.clone()),
            key if sqcow2_vhost::LIMIT_KEYS.contains(&key) => {}
            other => bail!(
                "unknown key {other:?} (socket, image, id, read-only, num-queues, queue-size, backing-root, group, {})",
                sqcow2_vhost::LIMIT_KEYS.join(", ")
            ),
        }
    }
    spec.limits = parse_limits(&keys)?;
    spec.validate()?;
    Ok(spec)
}

/// The I/O limits among `keys` (QEMU's throttle option names, each a
/// whole number).
pub(crate) fn parse_limits(keys: &[(String, String)]) -> anyhow::Result<sqcow2_vhost::IoLimits> {
    let mut limits = serde_json::Map::new();
    for (key, value) in keys {
        if sqcow2_vhost::LIMIT_KEYS.contains(&key.as_str()) {
            let n: u64 = value
                .parse()
                .with_context(|| format!("{key}={value}: not a whole number"))?;
            limits.insert(key.clone(), n.into());
        }
    }
    Ok(serde_json::from_value(serde_json::Value::Object(limits))?)
}

/// `KEY=VALUE,...` of limit keys only, checked as QEMU checks them.
pub(crate) fn limits_only(text: &str) -> anyhow::Result<sqcow2_vhost::IoLimits> {
    let keys = keyvals(text)?;
    if let Some((k, _)) = keys
        .iter()
        .find(|(k, _)| !sqcow2_vhost::LIMIT_KEYS.contains(&k.as_str()))
    {
        bail!(
            "{k} is not a limit ({})",
            sqcow2_vhost::LIMIT_KEYS.join(", ")
        );
    }
    let limits = parse_limits(&keys)?;
    limits.validate().map_err(anyhow::Error::msg)?;
    Ok(limits)
}

/// An export's keys and values, in the order given.
type Keys = Vec<(String, String)>;

/// `KEY=VALUE,...` as pairs (a comma in a value doubled), each key once.
pub(crate) fn keyvals(text: &str) -> anyhow::Result<Vec<(String, String)>> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for item in split_keyval(text) {
        let Some((key, value)) = item.split_once('=') else {
            bail!("{item:?} is not KEY=VALUE");
        };
        if keys.iter().any(|(k, _)| k == key) {
            bail!("{key} given twice");
        }
        keys.push((key.to_owned(), value.to_owned()));
    }
    Ok(keys)
}

/// Splits `a=1,b=x,,y` at single commas (`,,` is a comma in a value).
fn split_keyval(text: &str) -> Vec<String> {
    let mut items = vec![String::new()];
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ',' if chars.peek() == Some(&',') => {
                chars.next();
                items.last_mut().expect("one item").push(',');
            }
            ',' => items.push(String::new()),
            c => items.last_mut().expect("one item").push(c),
        }
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> anyhow::Result<ExportSpec> {
        parse_export(text, |image| ExportSpec::new("d", image))
    }

    #[test]
    fn export_keys_parse_as_qemu_keyvals() {
        let s =
            spec("socket=/r/a.sock,image=/i/a,,b.qcow2,id=vm1,read-only=on,num-queues=4").unwrap();
        assert_eq!(s.image, PathBuf::from("/i/a,b.qcow2"));
        assert_eq!(s.socket, Some(PathBuf::from("/r/a.sock")));
        assert_eq!((s.id.as_str(), s.read_only, s.num_queues), ("vm1", true, 4));
        let s = spec("socket=/a,image=/b,iops-total=1000,iops-total-max=2000,bps-read=5,group=g")
            .unwrap();
        assert_eq!(
            (
                s.limits.iops_total,
                s.limits.iops_total_max,
                s.limits.bps_read
            ),
            (1000, 2000, 5)
        );
        assert_eq!(s.group.as_deref(), Some("g"));
        for bad in [
            "socket=/a,image=/b,colour=red",
            "socket=/a,image=/b,id=x,id=y",
            "image=/b",
            "socket=/a",
            "socket=/a,image=/b,num-queues=0",
            "socket=/a,image=/b,num-queues=many",
            "socket=/a,image=/b,id=a/b",
            "socket=/a,image=/b,read-only=maybe",
            "socket=/a,image=/b,flag",
            "socket=/a,image=/b,iops-total=fast",
            "socket=/a,image=/b,iops-total=10,iops-read=5",
            "socket=/a,image=/b,bps-write-max=10",
            "socket=/a,image=/b,group=a/b",
        ] {
            assert!(spec(bad).is_err(), "{bad} accepted");
        }
    }
}
