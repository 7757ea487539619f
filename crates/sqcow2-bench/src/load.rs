//! `sqcow2 bench load`: a guest-less load generator on libblkio. It drives
//! a vhost-user-blk socket (`virtio-blk-vhost-user`) or, for the physical
//! limit, a raw file with io_uring, and reports IOPS, MB/s and latency
//! percentiles.

use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use blkio::{Blkio, Blkioq, ReqFlags};
use serde::{Deserialize, Serialize};

use crate::phases::{PhaseClock, PhaseLatencies, PhaseResult};

/// What the load does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    /// Random reads.
    RandRead,
    /// Random writes.
    RandWrite,
    /// Sequential reads (each queue its own stripe).
    SeqRead,
    /// 70% random reads, 30% random writes.
    Mixed,
    /// Random writes, each into a 64 KiB cluster this queue has not
    /// written before (the queue's stripe of clusters in a random order,
    /// a block at a random offset of each): on a fresh overlay every
    /// write allocates, however fast the server.
    RandWriteNew,
}

/// The cluster size [`Pattern::RandWriteNew`] assumes.
const NEW_CLUSTER: u64 = 64 << 10;

/// Where the load goes.
#[derive(Debug, Clone)]
pub enum Target {
    /// A vhost-user-blk socket.
    Socket(PathBuf),
    /// A file read with io_uring (the physical limit).
    File(PathBuf),
}

/// One load run.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub target: Target,
    pub pattern: Pattern,
    pub block_size: usize,
    pub iodepth: usize,
    pub queues: usize,
    pub duration: Duration,
    /// A flush after every this many writes submitted on a queue (0:
    /// never), as fio's `fsync=N`.
    pub flush_every: u64,
    /// A flush every this long on each queue, whatever was written (`None`:
    /// never); the flush takes the place of the next request due.
    pub flush_interval: Option<Duration>,
    /// Keep at most this many latency samples per queue for the CDF.
    pub keep_samples: usize,
    /// Record every request at least this slow (µs), with its start time
    /// ([`LoadResult::slow`]); `None`: none.
    pub slow_us: Option<u64>,
    /// Count completions per interval of this length ([`LoadResult::timeline_iops`]).
    pub timeline: Option<Duration>,
    /// Phases named by a file (`--phase-file`) and their slices.
    pub phases: Option<PhaseSpec>,
}

/// `--phase-file`: the phase file and the slice length of each phase's
/// worst-slice p99.
#[derive(Debug, Clone)]
pub struct PhaseSpec {
    pub file: PathBuf,
    pub slice: Duration,
}

/// A request at least `--slow-us` slow.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct SlowRequest {
    /// When it was submitted: microseconds since the Unix epoch.
    pub start_unix_us: u64,
    /// How long it took, µs.
    pub latency_us: u64,
}

/// What a run measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadResult {
    pub pattern: Pattern,
    pub block_size: usize,
    pub iodepth: usize,
    pub queues: usize,
    pub seconds: f64,
    /// Reads and writes completed (flushes not counted).
    pub ios: u64,
    /// Flushes completed (see `--flush-every`).
    #[serde(default)]
    pub flushes: u64,
    pub errors: u64,
    pub iops: f64,
    pub mb_per_s: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
    /// The longest read or write, µs.
    #[serde(default)]
    pub lat_max_us: f64,
    /// Flush latency p50, p99 and maximum, µs (0 without flushes).
    #[serde(default)]
    pub flush_lat_p50_us: f64,
    #[serde(default)]
    pub flush_lat_p99_us: f64,
    #[serde(default)]
    pub flush_lat_max_us: f64,
    /// Latency quantiles 0.00, 0.01, ..., 1.00 in microseconds.
    pub lat_cdf_us: Vec<f64>,
    /// CPU time (user + system) the server used per I/O over the run, in
    /// microseconds (filled in by the suite, which knows the server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_cpu_us_per_io: Option<f64>,
    /// Every request at least `--slow-us` slow, flushes included.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slow: Vec<SlowRequest>,
    /// With `--timeline-ms`: reads and writes completed per interval, as
    /// IOPS, from `start_unix_us` on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timeline_iops: Vec<f64>,
    /// When the load began: microseconds since the Unix epoch.
    #[serde(default)]
    pub start_unix_us: u64,
    /// With `--phase-file`: each phase's figures, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseResult>,
}

/// Connects to `target` with `queues` queues; `read_only` for loads that
/// only read (a read-only export refuses read-write drivers).
pub fn connect(
    target: &Target,
    queues: usize,
    read_only: bool,
) -> anyhow::Result<(Blkio, Vec<Blkioq>)> {
    // A server may still be ending the previous connection: retry a
    // refusal for a few seconds.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match connect_once(target, queues, read_only) {
            Err(e) if Instant::now() < deadline && is_refusal(&e) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

fn is_refusal(e: &anyhow::Error) -> bool {
    let m = format!("{e:#}");
    m.contains("reset by peer") || m.contains("Broken pipe") || m.contains("refused")
}

fn connect_once(
    target: &Target,
    queues: usize,
    read_only: bool,
) -> anyhow::Result<(Blkio, Vec<Blkioq>)> {
    let (driver, path) = match target {
        Target::Socket(p) => ("virtio-blk-vhost-user", p),
        Target::File(p) => ("io_uring", p),
    };
    let mut b = Blkio::new(driver).map_err(blkio_err)?;
    b.set_str("path", &path.to_string_lossy())
        .map_err(blkio_err)?;
    if read_only {
        b.set_bool("read-only", true).map_err(blkio_err)?;
    }
    b.connect()
        .map_err(blkio_err)
        .with_context(|| format!("connecting to {}", path.display()))?;
    b.set_i32("num-queues", queues as i32).map_err(blkio_err)?;
    let q = b.start().map_err(blkio_err)?.queues;
    Ok((b, q))
}

pub fn blkio_err(e: blkio::Error) -> anyhow::Error {
    anyhow::anyhow!("libblkio: {}", e.message())
}

/// Reads 4 KiB at offset 0 once; for time-to-first-read.
pub fn first_read(target: &Target) -> anyhow::Result<()> {
    let (mut b, mut queues) = connect(target, 1, true)?;
    let region = b.alloc_mem_region(1 << 20).map_err(blkio_err)?;
    b.map_mem_region(&region).map_err(blkio_err)?;
    let q = &mut queues[0];
    q.read(0, region.addr as *mut u8, 4096, 0, ReqFlags::empty());
    let mut c = [MaybeUninit::uninit()];
    let mut timeout = Duration::from_secs(30);
    let n = q
        .do_io(&mut c, 1, Some(&mut timeout), None)
        .map_err(blkio_err)?;
    if n != 1 {
        bail!("first read did not complete within 30 s");
    }
    // SAFETY: do_io initialised the first n completions.
    let ret = unsafe { c[0].assume_init_ref() }.ret;
    if ret != 0 {
        bail!("first read failed: {ret}");
    }
    Ok(())
}

/// Runs one load; every queue on its own thread.
pub fn run(spec: &LoadSpec) -> anyhow::Result<LoadResult> {
    let read_only = matches!(spec.pattern, Pattern::RandRead | Pattern::SeqRead);
    let (mut b, queues) = connect(&spec.target, spec.queues, read_only)?;
    let capacity = b.get_u64("capacity").map_err(blkio_err)?;
    let per_queue = spec.block_size * spec.iodepth;
    let align = b.get_u64("mem-region-alignment").map_err(blkio_err)? as usize;
    let len = (per_queue * spec.queues).div_ceil(align) * align;
    let region = b.alloc_mem_region(len).map_err(blkio_err)?;
    b.map_mem_region(&region).map_err(blkio_err)?;
    // Writes carry random bytes, as a guest's do: a region of zeros let a
    // server that skips zero blocks (sqcow2 does, for new clusters) skip
    // the data of every allocating write.
    // SAFETY: libblkio just allocated the region for this process, `len`
    // bytes at `addr`, and no request uses it yet.
    let bytes = unsafe { std::slice::from_raw_parts_mut(region.addr as *mut u8, len) };
    fastrand::Rng::with_seed(0x5eed_da7a).fill(bytes);
    if capacity < spec.block_size as u64 * 2 {
        bail!("disk too small");
    }
    let start = Instant::now();
    let start_unix_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    let clock = spec
        .phases
        .as_ref()
        .map(|p| PhaseClock::watch(p.file.clone()));
    let threads: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(i, q)| {
            let spec = spec.clone();
            let base = region.addr + i * per_queue;
            let clock = clock.clone();
            std::thread::spawn(move || {
                let mut q = q;
                drive_queue(&mut q, i, base, capacity, &spec, start, clock.as_deref())
            })
        })
        .collect();
    let mut lat = Vec::new();
    let mut ios = 0u64;
    let mut flushes = 0u64;
    let mut errors = 0u64;
    let mut slow = Vec::new();
    let mut max_ns = 0u64;
    let mut flush_lat = Vec::new();
    let mut timeline: Vec<u64> = Vec::new();
    let mut phase_lat = PhaseLatencies::default();
    for t in threads {
        let r = t
            .join()
            .map_err(|_| anyhow::anyhow!("load thread panicked"))??;
        ios += r.ios;
        flushes += r.flushes;
        errors += r.errors;
        lat.extend(r.samples);
        slow.extend(r.slow);
        max_ns = max_ns.max(r.max_ns);
        flush_lat.extend(r.flush_samples);
        if timeline.len() < r.timeline.len() {
            timeline.resize(r.timeline.len(), 0);
        }
        for (sum, n) in timeline.iter_mut().zip(&r.timeline) {
            *sum += n;
        }
        phase_lat.add(&r.phases);
    }
    let end = Instant::now();
    let seconds = end.duration_since(start).as_secs_f64();
    drop(b);
    let mut r = summarize(spec, seconds, ios, errors, lat);
    r.flushes = flushes;
    r.lat_max_us = max_ns as f64 / 1000.0;
    flush_lat.sort_unstable();
    r.flush_lat_p50_us = quantile_us(&flush_lat, 0.5);
    r.flush_lat_p99_us = quantile_us(&flush_lat, 0.99);
    r.flush_lat_max_us = quantile_us(&flush_lat, 1.0);
    slow.sort_by_key(|s| s.start_unix_us);
    r.slow = slow;
    r.start_unix_us = start_unix_us;
    if let Some(clock) = &clock {
        r.phases = phase_lat.results(&clock.finish(), end);
    }
    if let Some(every) = spec.timeline {
        r.timeline_iops = timeline
            .iter()
            .map(|&n| n as f64 / every.as_secs_f64())
            .collect();
    }
    Ok(r)
}

/// Turns counts and latency samples (ns) into a [`LoadResult`].
pub fn summarize(
    spec: &LoadSpec,
    seconds: f64,
    ios: u64,
    errors: u64,
    mut lat: Vec<u64>,
) -> LoadResult {
    lat.sort_unstable();
    let q = |p: f64| quantile_us(&lat, p);
    LoadResult {
        pattern: spec.pattern,
        block_size: spec.block_size,
        iodepth: spec.iodepth,
        queues: spec.queues,
        seconds,
        ios,
        flushes: 0,
        errors,
        iops: ios as f64 / seconds,
        mb_per_s: ios as f64 * spec.block_size as f64 / seconds / 1e6,
        lat_p50_us: q(0.5),
        lat_p99_us: q(0.99),
        lat_p999_us: q(0.999),
        lat_max_us: q(1.0),
        flush_lat_p50_us: 0.0,
        flush_lat_p99_us: 0.0,
        flush_lat_max_us: 0.0,
        lat_cdf_us: (0..=100).map(|i| q(i as f64 / 100.0)).collect(),
        server_cpu_us_per_io: None,
        slow: Vec::new(),
        timeline_iops: Vec::new(),
        start_unix_us: 0,
        phases: Vec::new(),
    }
}

/// The `p` quantile of sorted nanosecond samples, in µs (0 when empty).
fn quantile_us(sorted_ns: &[u64], p: f64) -> f64 {
    if sorted_ns.is_empty() {
        return 0.0;
    }
    let i = ((sorted_ns.len() - 1) as f64 * p).round() as usize;
    sorted_ns[i] as f64 / 1000.0
}

/// What one queue saw.
pub struct QueueResult {
    pub ios: u64,
    pub flushes: u64,
    pub errors: u64,
    /// Latencies in nanoseconds (a reservoir sample when there are many).
    pub samples: Vec<u64>,
    /// Requests at least `spec.slow_us` slow.
    pub slow: Vec<SlowRequest>,
    /// The longest read or write, ns.
    pub max_ns: u64,
    /// Every flush's latency, ns.
    pub flush_samples: Vec<u64>,
    /// Reads and writes completed per `spec.timeline` interval.
    pub timeline: Vec<u64>,
    /// Latencies per phase (with a phase clock).
    pub phases: PhaseLatencies,
}

/// Microseconds since the Unix epoch at `at` (an `Instant` of this
/// process), from one reading of both clocks.
fn unix_us(at: Instant, now: Instant, now_unix_us: u64) -> u64 {
    now_unix_us.saturating_sub(now.saturating_duration_since(at).as_micros() as u64)
}

/// Keeps `spec.iodepth` requests in flight on `q` for `spec.duration`,
/// buffers from `base` (`block_size * iodepth` bytes of a mapped region).
pub fn drive_queue(
    q: &mut Blkioq,
    index: usize,
    base: usize,
    capacity: u64,
    spec: &LoadSpec,
    start: Instant,
    clock: Option<&PhaseClock>,
) -> anyhow::Result<QueueResult> {
    let bs = spec.block_size as u64;
    let blocks = capacity / bs;
    let mut rng = fastrand::Rng::with_seed(0x10AD + index as u64);
    // Sequential: each queue reads its own stripe of the disk.
    let stripe = blocks / spec.queues as u64;
    let mut next_seq = stripe * index as u64;
    let mut started = vec![Instant::now(); spec.iodepth];
    // Which slots hold a flush, and writes submitted since the last one.
    let mut is_flush = vec![false; spec.iodepth];
    let mut writes_since_flush = 0u64;
    let mut out = QueueResult {
        ios: 0,
        flushes: 0,
        errors: 0,
        samples: Vec::new(),
        slow: Vec::new(),
        max_ns: 0,
        flush_samples: Vec::new(),
        timeline: Vec::new(),
        phases: PhaseLatencies::default(),
    };
    // Phase starts as this queue saw them (index -> start).
    let mut phase_starts: Vec<Instant> = Vec::new();
    let mut next_flush = spec.flush_interval.map(|i| Instant::now() + i);
    let slow_ns = spec.slow_us.map(|us| us * 1000);
    let mut seen = 0u64;
    // RandWriteNew: this queue's clusters, shuffled (written in turn; past
    // the end, around again).
    let mut fresh: Vec<u64> = Vec::new();
    if spec.pattern == Pattern::RandWriteNew {
        let clusters = capacity / NEW_CLUSTER;
        let per = clusters / spec.queues as u64;
        fresh = (per * index as u64..per * (index as u64 + 1)).collect();
        rng.shuffle(&mut fresh);
    }
    let mut next_fresh = 0usize;
    let mut submit = |q: &mut Blkioq,
                      slot: usize,
                      rng: &mut fastrand::Rng,
                      started: &mut [Instant],
                      is_flush: &mut [bool]| {
        is_flush[slot] = false;
        let interval_due = next_flush.is_some_and(|at| Instant::now() >= at);
        if interval_due || (spec.flush_every > 0 && writes_since_flush >= spec.flush_every) {
            writes_since_flush = 0;
            if let (Some(at), Some(every)) = (next_flush.as_mut(), spec.flush_interval) {
                if interval_due {
                    *at = Instant::now() + every;
                }
            }
            is_flush[slot] = true;
            started[slot] = Instant::now();
            q.flush(slot, ReqFlags::empty());
            return;
        }
        let buf = (base + slot * spec.block_size) as *mut u8;
        let write = match spec.pattern {
            Pattern::RandRead | Pattern::SeqRead => false,
            Pattern::RandWrite | Pattern::RandWriteNew => true,
            Pattern::Mixed => rng.u8(0..10) < 3,
        };
        let block = match spec.pattern {
            Pattern::SeqRead => {
                let b = next_seq;
                next_seq += 1;
                if next_seq >= stripe * (index as u64 + 1) {
                    next_seq = stripe * index as u64;
                }
                b
            }
            Pattern::RandWriteNew if !fresh.is_empty() => {
                let cluster = fresh[next_fresh % fresh.len()];
                next_fresh += 1;
                let per_cluster = (NEW_CLUSTER / bs).max(1);
                cluster * per_cluster + rng.u64(0..per_cluster)
            }
            _ => rng.u64(0..blocks),
        };
        started[slot] = Instant::now();
        if write {
            writes_since_flush += 1;
            q.write(block * bs, buf, spec.block_size, slot, ReqFlags::empty());
        } else {
            q.read(block * bs, buf, spec.block_size, slot, ReqFlags::empty());
        }
    };
    for slot in 0..spec.iodepth {
        submit(q, slot, &mut rng, &mut started, &mut is_flush);
    }
    let deadline = Instant::now() + spec.duration;
    let going = |now: Instant| now < deadline && !clock.is_some_and(PhaseClock::ended);
    let mut completions: Vec<MaybeUninit<blkio::Completion>> =
        (0..spec.iodepth).map(|_| MaybeUninit::uninit()).collect();
    let mut in_flight = spec.iodepth;
    while in_flight > 0 {
        let mut timeout = Duration::from_secs(30);
        let n = q
            .do_io(&mut completions, 1, Some(&mut timeout), None)
            .map_err(blkio_err)?;
        if n == 0 {
            bail!("no completion within 30 s");
        }
        let now = Instant::now();
        for c in &completions[..n] {
            // SAFETY: do_io initialised the first n completions.
            let c = unsafe { c.assume_init_ref() };
            let slot = c.user_data;
            let ns = now.duration_since(started[slot]).as_nanos() as u64;
            if c.ret != 0 {
                out.errors += 1;
            }
            if slow_ns.is_some_and(|limit| ns >= limit) {
                let now_unix_us = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_micros() as u64);
                out.slow.push(SlowRequest {
                    start_unix_us: unix_us(started[slot], now, now_unix_us),
                    latency_us: ns / 1000,
                });
            }
            if is_flush[slot] {
                out.flushes += 1;
                out.flush_samples.push(ns);
                if going(now) {
                    submit(q, slot, &mut rng, &mut started, &mut is_flush);
                } else {
                    in_flight -= 1;
                }
                continue;
            }
            out.ios += 1;
            seen += 1;
            out.max_ns = out.max_ns.max(ns);
            if let (Some(clock), Some(p)) = (clock, &spec.phases) {
                let phase = clock.current();
                while phase_starts.len() <= phase {
                    phase_starts.push(now);
                }
                let since = now.duration_since(phase_starts[phase]);
                out.phases.record(phase, since, p.slice, ns / 1000);
            }
            if let Some(every) = spec.timeline {
                let bucket =
                    (now.duration_since(start).as_nanos() / every.as_nanos().max(1)) as usize;
                if out.timeline.len() <= bucket {
                    out.timeline.resize(bucket + 1, 0);
                }
                out.timeline[bucket] += 1;
            }
            // Reservoir sampling keeps the latency distribution unbiased.
            if out.samples.len() < spec.keep_samples {
                out.samples.push(ns);
            } else {
                let j = rng.u64(0..seen) as usize;
                if j < spec.keep_samples {
                    out.samples[j] = ns;
                }
            }
            if going(now) {
                submit(q, slot, &mut rng, &mut started, &mut is_flush);
            } else {
                in_flight -= 1;
            }
        }
    }
    Ok(out)
}

/// Arguments of `sqcow2 bench load`.
#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// vhost-user-blk socket to drive.
    #[arg(long, conflicts_with = "file")]
    socket: Option<PathBuf>,
    /// A file to read with io_uring instead (the physical limit).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Access pattern.
    #[arg(long, value_enum, default_value = "rand-read")]
    pattern: Pattern,
    /// Block size.
    #[arg(long, default_value = "4k")]
    bs: String,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 32)]
    iodepth: usize,
    /// Queues (one thread each).
    #[arg(long, default_value_t = 1)]
    queues: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// A flush after every N writes on a queue (fio's `fsync=N`; 0: none).
    #[arg(long, default_value_t = 0)]
    flush_every: u64,
    /// A flush every this many milliseconds on each queue (0: none), e.g.
    /// a guest filesystem's periodic commit.
    #[arg(long, default_value_t = 0)]
    flush_interval_ms: u64,
    /// List every request at least this slow (µs) with its start time in
    /// the JSON output (`slow`), e.g. to find the requests a live snapshot
    /// held up.
    #[arg(long)]
    slow_us: Option<u64>,
    /// Count completions per this many milliseconds (`timeline_iops` in
    /// the JSON output: IOPS over time, e.g. across live snapshots).
    #[arg(long)]
    timeline_ms: Option<u64>,
    /// Keep latencies per phase, the phase being the word in this file
    /// (`phases` in the JSON output; `end` stops the load, `--duration`
    /// is then a maximum): a change made under one continuous load
    /// measured against the same connection's steady state.
    #[arg(long)]
    phase_file: Option<PathBuf>,
    /// Slices of each phase for its worst-slice p99, milliseconds.
    #[arg(long, default_value_t = 1000)]
    slice_ms: u64,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    output: crate::OutputFormat,
}

pub fn run_cli(args: &LoadArgs) -> anyhow::Result<()> {
    let target = match (&args.socket, &args.file) {
        (Some(s), None) => Target::Socket(s.clone()),
        (None, Some(f)) => Target::File(f.clone()),
        _ => bail!("give --socket or --file"),
    };
    if args.iodepth == 0 || args.queues == 0 {
        bail!("--iodepth and --queues must be at least 1");
    }
    if matches!(target, Target::File(_))
        && args.pattern != Pattern::RandRead
        && args.pattern != Pattern::SeqRead
    {
        bail!("--file is read-only: use rand-read or seq-read");
    }
    let spec = LoadSpec {
        target,
        pattern: args.pattern,
        block_size: crate::parse_size(&args.bs)? as usize,
        iodepth: args.iodepth,
        queues: args.queues,
        duration: Duration::from_secs_f64(args.duration),
        flush_every: args.flush_every,
        flush_interval: (args.flush_interval_ms > 0)
            .then(|| Duration::from_millis(args.flush_interval_ms)),
        keep_samples: 100_000,
        slow_us: args.slow_us,
        timeline: args
            .timeline_ms
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis),
        phases: args.phase_file.clone().map(|file| PhaseSpec {
            file,
            slice: Duration::from_millis(args.slice_ms.max(1)),
        }),
    };
    let r = run(&spec)?;
    match args.output {
        crate::OutputFormat::Json => {
            println!("{}", serde_json::to_string_pretty(&r)?);
        }
        crate::OutputFormat::Human => {
            println!(
                "{:?} bs={} iodepth={} queues={}: {:.0} IOPS, {:.1} MB/s, latency p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, max {:.1} us, {} flushes (p99 {:.1} us, max {:.1} us), {} errors",
                r.pattern, r.block_size, r.iodepth, r.queues, r.iops, r.mb_per_s, r.lat_p50_us, r.lat_p99_us, r.lat_p999_us, r.lat_max_us, r.flushes, r.flush_lat_p99_us, r.flush_lat_max_us, r.errors
            );
        }
    }
    if r.errors > 0 {
        bail!("{} requests failed", r.errors);
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A made-up depth-32 random-read result for report tests.
    pub(crate) fn sample(iops: f64, cpu_us_per_io: Option<f64>) -> LoadResult {
        LoadResult {
            pattern: Pattern::RandRead,
            block_size: 4096,
            iodepth: 32,
            queues: 1,
            seconds: 1.0,
            ios: iops as u64,
            flushes: 0,
            errors: 0,
            iops,
            mb_per_s: 0.0,
            lat_p50_us: 1.0,
            lat_p99_us: 2.0,
            lat_p999_us: 3.0,
            lat_max_us: 4.0,
            flush_lat_p50_us: 0.0,
            flush_lat_p99_us: 0.0,
            flush_lat_max_us: 0.0,
            lat_cdf_us: vec![1.0; 101],
            server_cpu_us_per_io: cpu_us_per_io,
            slow: Vec::new(),
            timeline_iops: Vec::new(),
            start_unix_us: 0,
            phases: Vec::new(),
        }
    }
}
