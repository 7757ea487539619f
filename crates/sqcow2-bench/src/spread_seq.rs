//! The kernel's own cost of sequential reads of a long chain: the data
//! clusters of the suite's generated chain, each in a raw file of its
//! layer (as many files as layers, each holding the clusters its layer
//! wrote), read 1 MiB at a time in guest order at depth 4 with io_uring in
//! this process (no vhost, no qcow2): per request, one read per run of
//! clusters that lie next to each other in one file, zeros for the
//! clusters no layer wrote. Against the raw file read the same way, this
//! is the best any server can do for the suite's sequential load at N
//! layers.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use io_uring::{opcode, types, IoUring};
use sqcow2_format::gen::{plan, Distribution, GenOptions};

use crate::load::{summarize, LoadResult, LoadSpec, Pattern, Target};

/// Bytes per request (the suite's sequential load).
const REQUEST: usize = 1 << 20;
/// Requests in flight (the suite's sequential load).
const DEPTH: usize = 4;
/// Cluster size of the suite's chains.
const CLUSTER: u64 = 64 << 10;

/// `sqcow2-bench spread-seq`: sequential 1 MiB reads of a chain's data
/// laid out in one raw file per layer, against one raw file.
#[derive(Debug, clap::Args)]
pub struct SpreadSeqArgs {
    /// Chain lengths (files).
    #[arg(long, value_delimiter = ',', default_value = "1,1000,10000")]
    pub layers: Vec<usize>,
    /// Virtual disk size (the suite's: 1 GiB).
    #[arg(long, default_value = "1G")]
    pub size: String,
    /// Seconds per run.
    #[arg(long, default_value_t = 4.0)]
    pub seconds: f64,
    /// Rounds (each measures the raw file and every length; medians are
    /// printed).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Where the files go (removed afterwards).
    #[arg(long, default_value = "bench-results/spread-seq")]
    pub dir: std::path::PathBuf,
}

/// Where each guest cluster's bytes are: `(file, offset)`, `None` for a
/// cluster that reads as zeros.
type ClusterMap = Vec<Option<(usize, u64)>>;

/// A chain's data clusters as raw files, one per layer.
pub(crate) struct Mirror {
    layers: usize,
    map: ClusterMap,
    size: u64,
}

impl Mirror {
    /// Writes the mirror of the suite's chain of `layers` layers over a
    /// disk of `size` bytes into `dir`.
    pub(crate) fn make(dir: &Path, layers: usize, size: u64) -> anyhow::Result<Mirror> {
        let map = make_mirror(dir, layers, size)?;
        Ok(Mirror { layers, map, size })
    }

    /// Sequential 1 MiB reads at depth 4 for `duration` of the mirror in
    /// `dir` (its files opened for the run only, in the page cache first);
    /// CPU µs per request in `server_cpu_us_per_io`.
    pub(crate) fn measure(&self, dir: &Path, duration: Duration) -> anyhow::Result<LoadResult> {
        crate::page_cache::warm_dir(dir)?;
        let files = (0..self.layers)
            .map(|i| std::fs::File::open(dir.join(format!("f{i:05}"))))
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("opening the files of {}", dir.display()))?;
        measure(&files, Some(&self.map), self.size, duration)
    }
}

/// Sequential 1 MiB reads at depth 4 of the raw file `path` for
/// `duration`, by the same loop as [`Mirror::measure`].
pub(crate) fn measure_raw(path: &Path, duration: Duration) -> anyhow::Result<LoadResult> {
    crate::page_cache::warm(path)?;
    let file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    measure(&[file], None, size, duration)
}

/// Writes the clusters each layer of the suite's chain of `layers` layers
/// writes (same generator, same seed) as raw files in `dir`, and returns
/// where the top-most copy of each guest cluster is.
fn make_mirror(dir: &Path, layers: usize, size: u64) -> anyhow::Result<ClusterMap> {
    use std::io::Write;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let layout = plan(&GenOptions {
        layers,
        size,
        cluster_size: CLUSTER,
        fill: crate::fixtures::CHAIN_FILL,
        seed: 1,
        distribution: Distribution::Uniform,
        index: false,
    });
    let mut map: ClusterMap = vec![None; size.div_ceil(CLUSTER) as usize];
    let mut rng = fastrand::Rng::with_seed(13);
    let mut buf = vec![0u8; CLUSTER as usize];
    for (layer, clusters) in layout.iter().enumerate() {
        let mut f = std::fs::File::create(dir.join(format!("f{layer:05}")))?;
        for (i, &c) in clusters.iter().enumerate() {
            rng.fill(&mut buf);
            f.write_all(&buf)?;
            if let Some(slot) = map.get_mut(c as usize) {
                *slot = Some((layer, i as u64 * CLUSTER));
            }
        }
        // Written back before any read (see `spread::make_files`).
        f.sync_all()?;
    }
    Ok(map)
}

/// The reads of the request at `guest` (`REQUEST` bytes): `(file, file
/// offset, offset in the request, length)`, adjacent clusters of one file
/// merged; the rest of the request reads as zeros.
fn pieces(map: &ClusterMap, guest: u64) -> Vec<(usize, u64, usize, usize)> {
    let first = (guest / CLUSTER) as usize;
    let n = REQUEST / CLUSTER as usize;
    let mut out: Vec<(usize, u64, usize, usize)> = Vec::new();
    for k in 0..n {
        let Some(&Some((file, off))) = map.get(first + k) else {
            continue;
        };
        let at = k * CLUSTER as usize;
        match out.last_mut() {
            Some(last)
                if last.0 == file && last.1 + last.3 as u64 == off && last.2 + last.3 == at =>
            {
                last.3 += CLUSTER as usize;
            }
            _ => out.push((file, off, at, CLUSTER as usize)),
        }
    }
    out
}

/// Sequential 1 MiB reads (depth 4) for `duration`: through `map` over
/// `files`, or (`map` `None`) of the one file in `files` read whole
/// requests at a time; CPU µs per request in `server_cpu_us_per_io`.
fn measure(
    files: &[std::fs::File],
    map: Option<&ClusterMap>,
    size: u64,
    duration: Duration,
) -> anyhow::Result<LoadResult> {
    let requests = size / REQUEST as u64;
    if requests == 0 || files.is_empty() {
        bail!("nothing to read");
    }
    let mut ring = IoUring::new(64)?;
    let mut buffers = vec![0u8; REQUEST * DEPTH];
    let base = buffers.as_mut_ptr();
    let mut next = 0u64;
    let mut done_bytes = 0u64;
    let cpu_before = crate::spread::thread_cpu_us();
    let start = Instant::now();
    let deadline = start + duration;
    // Starts requests in `slot` until one has reads to wait for (one of
    // zeros is done at once); the reads it pushed.
    let mut fill_slot = |ring: &mut IoUring, slot: usize, done_bytes: &mut u64| -> usize {
        while Instant::now() < deadline {
            let guest = (next % requests) * REQUEST as u64;
            next += 1;
            let reads = match map {
                Some(map) => pieces(map, guest),
                None => vec![(0, guest, 0, REQUEST)],
            };
            if reads.is_empty() {
                *done_bytes += REQUEST as u64;
                continue;
            }
            // `slot * REQUEST + at + len` stays inside `buffers` (slot <
            // DEPTH, pieces lie within one request).
            let buf = base.wrapping_add(slot * REQUEST);
            if map.is_some() {
                // SAFETY: no read of this slot is in flight (its request
                // completed); the slot's bytes are inside `buffers`.
                unsafe { std::ptr::write_bytes(buf, 0, REQUEST) };
            }
            let mut pushed = 0;
            for (file, off, at, len) in reads {
                let sqe = opcode::Read::new(
                    types::Fd(files[file].as_raw_fd()),
                    buf.wrapping_add(at),
                    len as u32,
                )
                .offset(off)
                .build()
                .user_data(slot as u64);
                // SAFETY: the target is this slot's part of `buffers`,
                // owned by this function, reused only once every read of
                // the slot has completed, and never freed while a read may
                // be in flight (all are reaped before returning, or the
                // buffers are leaked).
                if unsafe { ring.submission().push(&sqe) }.is_ok() {
                    pushed += 1;
                }
            }
            return pushed;
        }
        0
    };
    // Reads still in flight per request slot.
    let mut left = [0usize; DEPTH];
    let mut in_flight = 0usize;
    for (slot, l) in left.iter_mut().enumerate() {
        *l = fill_slot(&mut ring, slot, &mut done_bytes);
        in_flight += *l;
    }
    let mut failure: Option<std::io::Error> = None;
    while in_flight > 0 {
        if let Err(e) = ring.submit_and_wait(1) {
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            failure = Some(e);
            break;
        }
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (slot, res) in done {
            in_flight -= 1;
            if res < 0 {
                failure.get_or_insert(std::io::Error::from_raw_os_error(-res));
            }
            left[slot] -= 1;
            if left[slot] == 0 {
                done_bytes += REQUEST as u64;
                if failure.is_none() {
                    left[slot] = fill_slot(&mut ring, slot, &mut done_bytes);
                    in_flight += left[slot];
                }
            }
        }
    }
    if let Some(e) = failure {
        // Reads may still be in flight into the buffers: never free them.
        std::mem::forget(buffers);
        return Err(e.into());
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu = crate::spread::thread_cpu_us()
        .zip(cpu_before)
        .map(|(a, b)| a - b);
    let requests_done = done_bytes / REQUEST as u64;
    let spec = LoadSpec {
        target: Target::File(std::path::PathBuf::new()),
        pattern: Pattern::SeqRead,
        block_size: REQUEST,
        iodepth: DEPTH,
        queues: 1,
        duration,
        flush_every: 0,
        flush_interval: None,
        timeline: None,
        phases: None,
        keep_samples: 0,
        slow_us: None,
    };
    let mut r = summarize(&spec, seconds, requests_done, 0, Vec::new());
    r.server_cpu_us_per_io = cpu
        .filter(|_| requests_done > 0)
        .map(|us| us / requests_done as f64);
    Ok(r)
}

/// Runs [`SpreadSeqArgs`]: a Markdown table of the medians.
pub fn run_cli(args: &SpreadSeqArgs) -> anyhow::Result<()> {
    let size = crate::parse_size(&args.size)?;
    let duration = Duration::from_secs_f64(args.seconds);
    std::fs::create_dir_all(&args.dir)?;
    let raw_path = args.dir.join("raw");
    crate::fixtures::make_raw(&raw_path, size)?;
    let dir = |n: usize| args.dir.join(format!("{n}"));
    let mut mirrors = Vec::new();
    for &n in &args.layers {
        mirrors.push((n, Mirror::make(&dir(n), n, size)?));
    }
    let mut raw = Vec::new();
    let mut runs: Vec<Vec<LoadResult>> = vec![Vec::new(); mirrors.len()];
    for _ in 0..args.repeat.max(1) {
        raw.push(measure_raw(&raw_path, duration)?);
        for (i, (n, mirror)) in mirrors.iter().enumerate() {
            runs[i].push(mirror.measure(&dir(*n), duration)?);
        }
    }
    let medians = |v: &[LoadResult]| {
        let m = |f: fn(&LoadResult) -> f64| {
            crate::report::median(v.iter().map(f).collect()).unwrap_or(0.0)
        };
        (
            m(|r| r.mb_per_s),
            m(|r| r.server_cpu_us_per_io.unwrap_or(0.0)),
        )
    };
    let (raw_mb, raw_cpu) = medians(&raw);
    println!("| files | MB/s | CPU per MiB (µs) | vs the raw file |");
    println!("| --- | ---: | ---: | ---: |");
    println!("| the raw file | {raw_mb:.0} | {raw_cpu:.1} | 1.00 |");
    for (i, (n, _)) in mirrors.iter().enumerate() {
        let (mb, cpu) = medians(&runs[i]);
        println!(
            "| {n} (the chain's clusters) | {mb:.0} | {cpu:.1} | {:.2} |",
            mb / raw_mb
        );
    }
    for &n in &args.layers {
        let _ = std::fs::remove_dir_all(dir(n));
    }
    let _ = std::fs::remove_file(&raw_path);
    Ok(())
}
