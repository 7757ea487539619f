//! `sqcow2-bench remote`: the sQemu paper's setting, chains on remote
//! storage. Each chain lives behind a FUSE filesystem that answers every
//! read a fixed delay later ([`crate::slowfs`]); the page cache of the
//! mount cannot hide it. Servers start cold (fresh process, empty caches)
//! and serve random 4 KiB reads; what counts is how many remote reads
//! each guest read costs as the chain grows: sqcow2's index needs at most
//! two metadata reads per miss whatever the length, a chain walk one per
//! layer crossed.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use sqcow2_format::gen::{generate, layer_file_name, Distribution, GenOptions};

use crate::load::{self, LoadResult, LoadSpec, Pattern, Target};
use crate::servers::{self, ChainFiles, Export, Programs, Server};
use crate::slowfs::SlowFs;

const START: &str = "<!-- bench-remote:start -->";
const END: &str = "<!-- bench-remote:end -->";

/// Arguments of `sqcow2-bench remote`.
#[derive(Debug, clap::Args)]
pub struct RemoteArgs {
    /// Delay added to every read of the remote filesystem, microseconds.
    #[arg(long, default_value_t = 200)]
    delay_us: u64,
    /// Chain lengths.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 100, 1000])]
    lengths: Vec<usize>,
    /// Virtual disk size.
    #[arg(long, default_value = "16G")]
    size: String,
    /// Share of the clusters written (spread over the layers).
    #[arg(long, default_value_t = 0.05)]
    fill: f64,
    /// Seconds per load.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Repetitions (medians are reported).
    #[arg(long, default_value_t = 2)]
    repeat: usize,
    /// Where chains, logs and results go.
    #[arg(long, default_value = "bench-results/remote")]
    out: PathBuf,
    /// Rewrite the section between the bench-remote markers of this
    /// Markdown file (`docs/measured.md`).
    #[arg(long)]
    doc: Option<PathBuf>,
    /// The qemu-storage-daemon to compare with (a path, or a name in
    /// `PATH`).
    #[arg(long, default_value = "qemu-storage-daemon")]
    qsd: PathBuf,
}

/// The servers compared: sqcow2 with its index, and qemu-storage-daemon in
/// every configuration (on remote storage the thread pool of its default
/// `aio=threads` may be its best).
const SERVERS: [Server; 4] = [
    Server::QsdDefault,
    Server::QsdIoUring,
    Server::QsdIothread,
    Server::Sqcow2Indexed,
];

/// One server on one chain, cold.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteRun {
    pub server: String,
    pub layers: usize,
    pub repetition: usize,
    /// From process start to the first completed read.
    pub startup_ms: Option<f64>,
    /// Remote reads the start-up took (headers, tables).
    pub startup_remote_reads: Option<u64>,
    pub qd1: Option<LoadResult>,
    /// Remote reads per guest read over the depth-1 load.
    pub qd1_remote_per_io: Option<f64>,
    pub qd32: Option<LoadResult>,
    pub qd32_remote_per_io: Option<f64>,
    /// sqcow2 only: metadata slices read from files per cache miss, over
    /// both loads (its own counters, control socket).
    pub loads_per_miss: Option<f64>,
    pub error: Option<String>,
}

/// Everything a remote run measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteResults {
    pub command: String,
    pub delay_us: u64,
    pub disk_size: u64,
    #[serde(default)]
    pub fill: f64,
    pub seconds: f64,
    pub repetitions: usize,
    pub lengths: Vec<usize>,
    pub runs: Vec<RemoteRun>,
    pub wall_seconds: f64,
    /// `--version` of the qemu-storage-daemon compared with.
    #[serde(default)]
    pub qemu: String,
}

pub fn run(args: &RemoteArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let size = crate::parse_size(&args.size)?;
    let sqcow2 = std::env::current_exe()
        .context("own path")?
        .with_file_name("sqcow2");
    anyhow::ensure!(
        sqcow2.exists(),
        "{} missing: build it first",
        sqcow2.display()
    );
    let programs = Programs {
        sqcow2,
        qsd: args.qsd.clone(),
    };
    std::fs::create_dir_all(&args.out)?;
    let out = args.out.canonicalize()?;
    let delay = Duration::from_micros(args.delay_us);
    let mut results = RemoteResults {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        delay_us: args.delay_us,
        disk_size: size,
        fill: args.fill,
        seconds: args.seconds,
        repetitions: args.repeat.max(1),
        lengths: args.lengths.clone(),
        runs: Vec::new(),
        wall_seconds: 0.0,
        qemu: servers::version(&programs.qsd),
    };
    for &layers in &args.lengths {
        let dir = out.join(format!("chain-{layers}"));
        eprintln!("==> generating a {layers}-layer chain ({size} bytes)");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        generate(
            &dir,
            &GenOptions {
                layers,
                size,
                cluster_size: 65536,
                fill: args.fill,
                seed: 1,
                distribution: Distribution::Uniform,
                index: true,
            },
            &mut |_, _| {},
        )?;
        let mnt = out.join(format!("mnt-{layers}"));
        let fs = SlowFs::mount(&dir, &mnt, delay)?;
        let chain = ChainFiles {
            layers: (0..layers).map(|i| mnt.join(layer_file_name(i))).collect(),
        };
        for rep in 0..results.repetitions {
            for server in SERVERS {
                eprintln!(
                    "==> {} on {layers} remote layers (repetition {})",
                    server.name(),
                    rep + 1
                );
                let run = measure(server, &chain, &fs, &out, &programs, args.seconds, rep);
                if let Some(e) = &run.error {
                    eprintln!("    failed: {e}");
                }
                results.runs.push(run);
            }
        }
        drop(fs);
        let _ = std::fs::remove_dir(&mnt);
    }
    results.wall_seconds = started.elapsed().as_secs_f64();
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    let md = markdown(&results);
    std::fs::write(out.join("summary.md"), &md)?;
    if let Some(doc) = &args.doc {
        replace_section(doc, &md)?;
    }
    println!("{md}");
    Ok(())
}

/// Starts `server` cold on `chain`; the control socket (sqcow2) is `ctl`.
fn start(
    server: Server,
    chain: &ChainFiles,
    out: &Path,
    programs: &Programs,
    ctl: &Path,
) -> anyhow::Result<std::process::Child> {
    let socket = out.join("remote.sock");
    let log = out.join(format!("{}-remote.log", server.name()));
    let extra: Vec<String> = if server.is_qemu() {
        Vec::new()
    } else {
        let _ = std::fs::remove_file(ctl);
        vec!["--control".into(), ctl.display().to_string()]
    };
    servers::spawn_with(
        server,
        chain,
        &socket,
        programs,
        32 << 20,
        Export::READ,
        &log,
        &extra,
    )
}

fn measure(
    server: Server,
    chain: &ChainFiles,
    fs: &SlowFs,
    out: &Path,
    programs: &Programs,
    seconds: f64,
    repetition: usize,
) -> RemoteRun {
    let mut run = RemoteRun {
        server: server.name().into(),
        layers: chain.layers.len(),
        repetition,
        startup_ms: None,
        startup_remote_reads: None,
        qd1: None,
        qd1_remote_per_io: None,
        qd32: None,
        qd32_remote_per_io: None,
        loads_per_miss: None,
        error: None,
    };
    let ctl = out.join("remote.ctl");
    let target = Target::Socket(out.join("remote.sock"));
    let result = (|| -> anyhow::Result<()> {
        let mut cache = (0u64, 0u64);
        for depth in [1usize, 32] {
            // Each load on a freshly started server: cold caches.
            let before = fs.reads();
            let t0 = Instant::now();
            let mut child = start(server, chain, out, programs, &ctl)?;
            let served = wait_first_read(&mut child, &target, Duration::from_secs(120));
            if let Err(e) = served {
                servers::stop(&mut child);
                return Err(e);
            }
            if depth == 1 {
                run.startup_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
                run.startup_remote_reads = Some(fs.reads() - before);
            }
            let spec = LoadSpec {
                target: target.clone(),
                pattern: Pattern::RandRead,
                block_size: 4096,
                iodepth: depth,
                queues: 1,
                duration: Duration::from_secs_f64(seconds),
                flush_every: 0,
                flush_interval: None,
                timeline: None,
                phases: None,
                keep_samples: 100_000,
                slow_us: None,
            };
            let before = fs.reads();
            let stats0 = (!server.is_qemu()).then(|| cache_counters(&ctl)).flatten();
            let r = load::run(&spec);
            let remote = fs.reads() - before;
            if let (Some(s0), Some(s1)) = (
                stats0,
                (!server.is_qemu()).then(|| cache_counters(&ctl)).flatten(),
            ) {
                cache.0 += s1.0 - s0.0;
                cache.1 += s1.1 - s0.1;
            }
            servers::stop(&mut child);
            let r = r?;
            let per_io = (r.ios > 0).then(|| remote as f64 / r.ios as f64);
            if depth == 1 {
                run.qd1_remote_per_io = per_io;
                run.qd1 = Some(r);
            } else {
                run.qd32_remote_per_io = per_io;
                run.qd32 = Some(r);
            }
        }
        if !server.is_qemu() && cache.1 > 0 {
            run.loads_per_miss = Some(cache.0 as f64 / cache.1 as f64);
        }
        Ok(())
    })();
    if let Err(e) = result {
        run.error = Some(format!("{e:#}"));
    }
    run
}

/// sqcow2's cache counters (loads, misses) through its control socket.
fn cache_counters(ctl: &Path) -> Option<(u64, u64)> {
    use std::io::{BufRead, BufReader, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(ctl).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    stream.write_all(b"{\"command\":\"stats\"}\n").ok()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).ok()?;
    let v: serde_json::Value = serde_json::from_str(&line).ok()?;
    let cache = &v["result"]["cache"];
    Some((cache["loads"].as_u64()?, cache["misses"].as_u64()?))
}

fn wait_first_read(
    child: &mut std::process::Child,
    target: &Target,
    limit: Duration,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let Target::Socket(socket) = target else {
        return Ok(());
    };
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            bail!("server exited ({status})");
        }
        if socket.exists() && load::first_read(target).is_ok() {
            return Ok(());
        }
        if t0.elapsed() > limit {
            bail!("no first read within {} s of the start", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "failed".into(), |x| format!("{x:.digits$}"))
}

/// The Markdown section of a run.
pub fn markdown(r: &RemoteResults) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "{START}");
    let _ = writeln!(
        md,
        "Produced by `{}` in {:.0} s: chains from `gen-chain` (64 KiB clusters, {:.0} % of the \
         clusters written, spread over the layers, {} MiB disk) behind a FUSE filesystem that \
         answers every read {} µs later (direct I/O at the mount: the page cache cannot hide \
         it); each server started cold for each load; random 4 KiB reads for {:.0} s; medians \
         of {} repetitions. {} in its default (`aio=threads`), `aio=io_uring` \
         and `aio=io_uring` + polling iothread configurations, sqcow2 with its chain index.",
        r.command,
        r.wall_seconds,
        r.fill * 100.0,
        r.disk_size >> 20,
        r.delay_us,
        r.seconds,
        r.repetitions,
        if r.qemu.is_empty() {
            "qemu-storage-daemon"
        } else {
            &r.qemu
        },
    );
    let servers: Vec<&str> = SERVERS.iter().map(|s| s.name()).collect();
    type Pick = fn(&RemoteRun) -> Option<f64>;
    let tables: [(&str, Pick, usize); 6] = [
        (
            "Random 4 KiB reads, depth 1, IOPS",
            |r| r.qd1.as_ref().map(|l| l.iops),
            0,
        ),
        (
            "Random 4 KiB reads, depth 32, IOPS",
            |r| r.qd32.as_ref().map(|l| l.iops),
            0,
        ),
        (
            "p99 latency at depth 1 (µs)",
            |r| r.qd1.as_ref().map(|l| l.lat_p99_us),
            0,
        ),
        (
            "Remote reads per guest read, depth 1",
            |r| r.qd1_remote_per_io,
            2,
        ),
        (
            "Time from start to the first read (ms)",
            |r| r.startup_ms,
            0,
        ),
        (
            "Remote reads to start",
            |r| r.startup_remote_reads.map(|n| n as f64),
            0,
        ),
    ];
    for (title, pick, digits) in tables {
        let _ = writeln!(md, "\n**{title}** (chain length in layers)\n");
        let _ = write!(md, "| server |");
        for l in &r.lengths {
            let _ = write!(md, " {l} |");
        }
        let _ = write!(md, "\n| --- |");
        for _ in &r.lengths {
            let _ = write!(md, " ---: |");
        }
        md.push('\n');
        for srv in &servers {
            let _ = write!(md, "| {srv} |");
            for &l in &r.lengths {
                let v = median(
                    r.runs
                        .iter()
                        .filter(|x| x.server == *srv && x.layers == l)
                        .filter_map(pick)
                        .collect(),
                );
                let _ = write!(md, " {} |", fmt(v, digits));
            }
            md.push('\n');
        }
    }
    let _ = write!(
        md,
        "\nsqcow2's own counters: metadata slices read per cache miss (both loads):"
    );
    for &l in &r.lengths {
        let v = median(
            r.runs
                .iter()
                .filter(|x| x.server == "sqcow2-indexed" && x.layers == l)
                .filter_map(|x| x.loads_per_miss)
                .collect(),
        );
        let _ = write!(md, " {} at {l} layers;", fmt(v, 2));
    }
    md.push('\n');
    let failures: Vec<String> = r
        .runs
        .iter()
        .filter_map(|x| {
            x.error
                .as_ref()
                .map(|e| format!("{} at {} layers: {e}", x.server, x.layers))
        })
        .collect();
    if !failures.is_empty() {
        let _ = writeln!(md, "\n**Failures**:\n");
        for f in failures {
            let _ = writeln!(md, "* {}", f.lines().next().unwrap_or(""));
        }
    }
    let _ = writeln!(md, "{END}");
    md
}

/// Replaces the text between the bench-remote markers of `path` (appends
/// a section if there are none).
fn replace_section(path: &Path, section: &str) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let new = match (text.find(START), text.find(END)) {
        (Some(a), Some(b)) if b > a => format!(
            "{}{}{}",
            &text[..a],
            section.trim_end(),
            &text[b + END.len()..]
        ),
        _ => format!("{}\n{}", text.trim_end(), section),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}
