//! `sqcow2 bench suite`: sqcow2 and qemu-storage-daemon side by side on
//! the same generated chains, plus the raw-file limit; results as JSON,
//! plots and a section of `docs/measured.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use sqcow2_format::gen::{generate, layer_file_name, Distribution, GenOptions};

use crate::fixtures::{make_raw, CHAIN_FILL};
use crate::load::{self, LoadResult, LoadSpec, Pattern, Target};
use crate::results::{
    QsdTrial, Results, Run, SnapshotTimes, WriteImage, WriteLoad, WriteRun, WRITE_LOADS,
};
use crate::servers::{self, ChainFiles, Programs, Server};

/// Arguments of `sqcow2 bench suite`.
#[derive(Debug, clap::Args)]
pub struct SuiteArgs {
    /// The small matrix (lengths 1, 100, 1000; 256 MiB; one repetition;
    /// short runs): at most about 3 minutes.
    #[arg(long)]
    quick: bool,
    /// Chain lengths (default 1,50,100,500,1000,10000).
    #[arg(long, value_delimiter = ',')]
    lengths: Vec<usize>,
    /// Virtual disk size (default 1G; 256M with --quick).
    #[arg(long)]
    size: Option<String>,
    /// Repetitions of every configuration (default 3; 1 with --quick).
    #[arg(long)]
    repeat: Option<usize>,
    /// Seconds per load run (default 4; 1.5 with --quick).
    #[arg(long)]
    seconds: Option<f64>,
    /// Cache budget of sqcow2, and of qsd-budget in all.
    #[arg(long, default_value = "32M")]
    cache: String,
    /// Where chains, logs, results and plots go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Rewrite the section between the bench-suite markers of this
    /// Markdown file (`docs/measured.md`).
    #[arg(long)]
    doc: Option<PathBuf>,
    /// Servers to run (default all).
    #[arg(long, value_delimiter = ',')]
    servers: Vec<String>,
    /// Skip the write and queue matrix.
    #[arg(long)]
    no_writes: bool,
    /// Virtual size of the base under the allocating writes (2 % filled,
    /// sparse).
    #[arg(long, default_value = "32G")]
    write_base_size: String,
    /// Measure nothing: redraw the plots and the Markdown section from
    /// this results.json.
    #[arg(long)]
    replot: Option<PathBuf>,
    /// qemu-storage-daemon binaries to compare with (paths or names in
    /// `PATH`): with more than one, each is tried first (`qsd-iothread` on
    /// the shortest chain, the three read loads, twice in alternating
    /// order) and the run compares with the fastest. QEMU releases differ
    /// in speed, and the peer is taken at its best.
    #[arg(long, value_delimiter = ',', default_value = "qemu-storage-daemon")]
    qsd: Vec<PathBuf>,
}

impl Run {
    /// The three loads every server gets, in order; `server` is the
    /// server's pid (its CPU time is measured), if it has one.
    fn measure_loads(
        &mut self,
        target: Target,
        seconds: f64,
        server: Option<u32>,
    ) -> anyhow::Result<()> {
        let [qd1, qd32, seq] = loads(target, seconds);
        self.rand_read_qd1 = Some(run_load(&qd1, server)?);
        self.rand_read_qd32 = Some(run_load(&qd32, server)?);
        self.seq_read_1m = Some(run_load(&seq, server)?);
        Ok(())
    }
}

/// Runs `spec`; with a server pid, also the server's CPU time per I/O.
fn run_load(spec: &LoadSpec, server: Option<u32>) -> anyhow::Result<LoadResult> {
    let before = server.and_then(servers::cpu_us);
    let mut r = load::run(spec)?;
    let after = server.and_then(servers::cpu_us);
    if let (Some(a), Some(b)) = (after, before) {
        if r.ios > 0 {
            r.server_cpu_us_per_io = Some((a - b) / r.ios as f64);
        }
    }
    Ok(r)
}

/// Queues every server of the write matrix exports.
const WRITE_QUEUES: usize = 4;

/// The servers of the write matrix.
const WRITE_SERVERS: [Server; 5] = [
    Server::QsdDefault,
    Server::QsdIoUring,
    Server::QsdIothread,
    Server::Sqcow2Indexed,
    Server::Sqcow2Poll,
];

pub fn run(args: &SuiteArgs) -> anyhow::Result<()> {
    if let Some(json) = &args.replot {
        let text =
            std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
        let results: Results = serde_json::from_str(&text).context("parsing results")?;
        std::fs::create_dir_all(&args.out)?;
        return report_outputs(&results, &args.out.canonicalize()?, args.doc.as_deref());
    }
    let started = Instant::now();
    let lengths = if !args.lengths.is_empty() {
        args.lengths.clone()
    } else if args.quick {
        vec![1, 100, 1000]
    } else {
        vec![1, 50, 100, 500, 1000, 10000]
    };
    let size =
        crate::parse_size(
            args.size
                .as_deref()
                .unwrap_or(if args.quick { "256M" } else { "1G" }),
        )?;
    let repeat = args.repeat.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let seconds = args.seconds.unwrap_or(if args.quick { 1.5 } else { 4.0 });
    let cache_bytes = crate::parse_size(&args.cache)?;
    let startup_limit = Duration::from_secs(if args.quick { 30 } else { 60 });
    let servers: Vec<Server> = if args.servers.is_empty() {
        Server::ALL.to_vec()
    } else {
        args.servers
            .iter()
            .map(|n| {
                Server::ALL
                    .into_iter()
                    .find(|s| s.name() == n)
                    .with_context(|| format!("unknown server {n}"))
            })
            .collect::<anyhow::Result<_>>()?
    };
    // The daemon under test: the `sqcow2` built beside this binary.
    let sqcow2 = std::env::current_exe()
        .context("own path")?
        .with_file_name("sqcow2");
    anyhow::ensure!(
        sqcow2.exists(),
        "{} missing: build it first (cargo build --release -p sqcow2-cli)",
        sqcow2.display()
    );
    std::fs::create_dir_all(&args.out)?;
    let out = args.out.canonicalize()?;
    let first_qsd = args.qsd.first().cloned().context("no --qsd given")?;
    let mut programs = Programs {
        sqcow2,
        qsd: first_qsd,
    };
    let mut results = Results {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: machine(),
        disk_size: size,
        cache_bytes,
        seconds_per_run: seconds,
        repetitions: repeat,
        lengths: lengths.clone(),
        runs: Vec::new(),
        raw_limit: Vec::new(),
        qsd_raw: Vec::new(),
        spread_limit: Vec::new(),
        writes: Vec::new(),
        snapshots: Vec::new(),
        wall_seconds: 0.0,
        qsd_trials: Vec::new(),
    };

    let mut chains = BTreeMap::new();
    for &layers in &lengths {
        eprintln!("==> generating a {layers}-layer chain ({size} bytes)");
        chains.insert(
            layers,
            gen_chain(&out.join(format!("chain-{layers}")), layers, size)?,
        );
    }

    if args.qsd.len() > 1 {
        if let Some(shortest) = chains.values().min_by_key(|c| c.layers.len()) {
            let trial_setup = Setup {
                out: &out,
                programs: &programs,
                cache_bytes,
                seconds,
                startup_limit,
            };
            results.qsd_trials = try_qsds(&args.qsd, shortest, &trial_setup);
        }
        if let Some(best) = results.qsd_trials.iter().find(|t| t.chosen) {
            programs.qsd = PathBuf::from(&best.program);
        }
    }
    results
        .machine
        .insert("qemu".into(), servers::version(&programs.qsd));
    let setup = Setup {
        out: &out,
        programs: &programs,
        cache_bytes,
        seconds,
        startup_limit,
    };
    // The physical limit: the same amount of data as one raw file.
    let raw = out.join("limit.raw");
    make_raw(&raw, size)?;
    // The kernel's cost of a long chain: the bytes a chain holds, in N
    // files.
    let spread_dir = |layers: usize| out.join(format!("spread-{layers}"));
    let spread_bytes = (size as f64 * CHAIN_FILL) as u64;
    // And its sequential reads' cost: each chain's data clusters in one
    // raw file per layer.
    let mirror_dir = |layers: usize| out.join(format!("mirror-{layers}"));
    let mut mirrors = BTreeMap::new();
    for &layers in &lengths {
        eprintln!("==> spreading {spread_bytes} bytes over {layers} files");
        crate::spread::make_files(&spread_dir(layers), layers, spread_bytes)?;
        eprintln!("==> the {layers}-layer chain's clusters in {layers} files");
        mirrors.insert(
            layers,
            crate::spread_seq::Mirror::make(&mirror_dir(layers), layers, size)?,
        );
    }
    for rep in 0..repeat {
        for &layers in &lengths {
            let chain = &chains[&layers];
            for &server in &servers {
                // A server that did not start once is not tried again.
                let failed_before = results.runs.iter().any(|r| {
                    r.server == server.name() && r.layers == layers && r.startup_ms.is_none()
                });
                if failed_before {
                    continue;
                }
                eprintln!(
                    "==> {} on {layers} layers (repetition {})",
                    server.name(),
                    rep + 1
                );
                let run = measure_server(server, chain, &setup, rep);
                if let Some(e) = &run.error {
                    eprintln!("    failed: {e}");
                }
                results.runs.push(run);
            }
        }
        eprintln!("==> raw file limit (repetition {})", rep + 1);
        results.raw_limit.push(measure_raw(&raw, seconds, rep));
        for &layers in &lengths {
            eprintln!(
                "==> the same bytes in {layers} files (repetition {})",
                rep + 1
            );
            let mut run = measure_spread(&spread_dir(layers), layers, seconds, rep);
            match mirrors[&layers].measure(&mirror_dir(layers), Duration::from_secs_f64(seconds)) {
                Ok(seq) => run.seq_read_1m = Some(seq),
                Err(e) => run.error = Some(format!("{e:#}")),
            }
            results.spread_limit.push(run);
        }
        eprintln!(
            "==> qemu-storage-daemon raw export (repetition {})",
            rep + 1
        );
        results.qsd_raw.push(measure_qsd_raw(&raw, &setup, rep));
    }
    if !args.no_writes {
        let write_base = crate::parse_size(&args.write_base_size)?;
        let images = WriteImages::make(&out, write_base)?;
        for rep in 0..repeat {
            for server in WRITE_SERVERS {
                results
                    .writes
                    .extend(measure_writes(server, &images, &setup, rep));
            }
        }
    }
    for &layers in &lengths {
        eprintln!("==> snapshot time at {layers} layers");
        match snapshot_times(&chains[&layers], &programs.sqcow2, 5) {
            Ok(t) => results.snapshots.push(t),
            Err(e) => eprintln!("    failed: {e:#}"),
        }
    }
    let _ = std::fs::remove_file(&raw);
    drop(mirrors);
    for &layers in &lengths {
        let _ = std::fs::remove_dir_all(spread_dir(layers));
        let _ = std::fs::remove_dir_all(mirror_dir(layers));
    }
    results.wall_seconds = started.elapsed().as_secs_f64();

    let json = out.join("results.json");
    std::fs::write(&json, serde_json::to_string_pretty(&results)?)?;
    eprintln!("results: {}", json.display());
    report_outputs(&results, &out, args.doc.as_deref())
}

/// Plots, `summary.md` and (optionally) the section of a Markdown document.
fn report_outputs(results: &Results, out: &Path, doc: Option<&Path>) -> anyhow::Result<()> {
    let summary = crate::report::Summary::new(results);
    crate::plot::plots(&summary, out)?;
    // The plots as linked from where the section goes.
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let linked = |from: &Path| match pathdiff::diff_paths(absolute(out), absolute(from)) {
        Some(p) if p.as_os_str().is_empty() => PathBuf::from("."),
        Some(p) => p,
        None => out.to_path_buf(),
    };
    let section = crate::report::markdown(results, &summary, &linked(out));
    std::fs::write(out.join("summary.md"), &section)?;
    if let Some(doc) = doc {
        let dir = doc.parent().unwrap_or(Path::new("."));
        let section = crate::report::markdown(results, &summary, &linked(dir));
        crate::report::replace_section(doc, &section)?;
    }
    println!("{section}");
    Ok(())
}

fn machine() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    m.insert("cpu".into(), cpu);
    m.insert(
        "cores".into(),
        std::thread::available_parallelism()
            .map(|n| n.to_string())
            .unwrap_or_default(),
    );
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_string())
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| format!("{} GiB", kb / (1 << 20)))
        .unwrap_or_default();
    m.insert("memory".into(), mem);
    m.insert(
        "kernel".into(),
        servers::first_output_line(Path::new("uname"), &["-r"]),
    );
    m
}

fn gen_chain(dir: &Path, layers: usize, size: u64) -> anyhow::Result<ChainFiles> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let opts = GenOptions {
        layers,
        size,
        cluster_size: 65536,
        fill: CHAIN_FILL,
        seed: 1,
        distribution: Distribution::Uniform,
        index: true,
    };
    generate(dir, &opts, &mut |_, _| {})?;
    Ok(ChainFiles {
        layers: (0..layers).map(|i| dir.join(layer_file_name(i))).collect(),
    })
}

/// The three loads every server gets, in order.
fn loads(target: Target, seconds: f64) -> [LoadSpec; 3] {
    let spec = |pattern, block_size, iodepth| LoadSpec {
        target: target.clone(),
        pattern,
        block_size,
        iodepth,
        queues: 1,
        duration: Duration::from_secs_f64(seconds),
        flush_every: 0,
        flush_interval: None,
        timeline: None,
        phases: None,
        keep_samples: 200_000,
        slow_us: None,
    };
    [
        spec(Pattern::RandRead, 4096, 1),
        spec(Pattern::RandRead, 4096, 32),
        spec(Pattern::SeqRead, 1 << 20, 4),
    ]
}

/// Runs `qsd-iothread` of every qemu-storage-daemon in `qsds` on `chain`
/// (the three read loads) twice, the second round in reverse order (so
/// that none is favoured by going first), keeps each one's best run and
/// marks the fastest. A binary that does not run is left out (with its
/// error).
fn try_qsds(qsds: &[PathBuf], chain: &ChainFiles, setup: &Setup<'_>) -> Vec<QsdTrial> {
    let mut trials: Vec<Option<QsdTrial>> = vec![None; qsds.len()];
    let order: Vec<usize> = (0..qsds.len()).chain((0..qsds.len()).rev()).collect();
    for (round, &i) in order.iter().enumerate() {
        let qsd = &qsds[i];
        let version = servers::version(qsd);
        eprintln!("==> trying {} ({version})", qsd.display());
        let programs = Programs {
            sqcow2: setup.programs.sqcow2.clone(),
            qsd: qsd.clone(),
        };
        let trial_setup = Setup {
            programs: &programs,
            ..*setup
        };
        let run = measure_server(Server::QsdIothread, chain, &trial_setup, round);
        if let Some(e) = &run.error {
            eprintln!("    failed: {e}");
        }
        let better = match &trials[i] {
            None => true,
            Some(t) => trial_score(&run) > trial_score(&t.run),
        };
        if better {
            trials[i] = Some(QsdTrial {
                program: qsd.display().to_string(),
                version,
                run,
                chosen: false,
            });
        }
    }
    let mut trials: Vec<QsdTrial> = trials.into_iter().flatten().collect();
    mark_fastest(&mut trials);
    trials
}

/// The geometric mean of a trial run's three rates (random reads at depth 1
/// and 32 in IOPS, sequential reads in MB/s); none if it failed.
fn trial_score(r: &Run) -> Option<f64> {
    if r.error.is_some() {
        return None;
    }
    let rates = [
        r.rand_read_qd1.as_ref()?.iops,
        r.rand_read_qd32.as_ref()?.iops,
        r.seq_read_1m.as_ref()?.mb_per_s,
    ];
    Some((rates.iter().map(|x| x.max(1e-9).ln()).sum::<f64>() / 3.0).exp())
}

/// Marks the trial with the highest [`trial_score`] as chosen (none if
/// every one failed).
fn mark_fastest(trials: &mut [QsdTrial]) {
    let best = trials
        .iter()
        .enumerate()
        .filter_map(|(i, t)| trial_score(&t.run).map(|s| (i, s)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i);
    if let Some(i) = best {
        trials[i].chosen = true;
    }
}

/// Reads every file of `chain`'s directory (its layers and index) into the
/// page cache, so that every server starts on a warm cache whatever ran
/// before it (see [`crate::page_cache::warm_dir`]).
fn warm_chain(chain: &ChainFiles) -> std::io::Result<()> {
    match chain.top().parent() {
        Some(dir) => crate::page_cache::warm_dir(dir),
        None => Ok(()),
    }
}

/// What every server run shares.
struct Setup<'a> {
    out: &'a Path,
    programs: &'a Programs,
    cache_bytes: u64,
    seconds: f64,
    startup_limit: Duration,
}

fn measure_server(server: Server, chain: &ChainFiles, setup: &Setup<'_>, repetition: usize) -> Run {
    let mut run = Run::new(server.name(), chain.layers.len(), repetition);
    let Setup {
        out,
        programs,
        cache_bytes,
        seconds,
        startup_limit,
    } = *setup;
    let socket = out.join("bench.sock");
    let log = out.join(format!("{}-{}.log", server.name(), chain.layers.len()));
    if let Err(e) = warm_chain(chain) {
        run.error = Some(format!("reading the chain into the page cache: {e}"));
        return run;
    }
    let t0 = Instant::now();
    let export = servers::Export::READ;
    let mut child =
        match servers::spawn(server, chain, &socket, programs, cache_bytes, export, &log) {
            Ok(c) => c,
            Err(e) => {
                run.error = Some(format!("{e:#}"));
                return run;
            }
        };
    let result = (|| -> anyhow::Result<()> {
        let target = Target::Socket(socket.clone());
        wait_first_read(&mut child, &target, &log, startup_limit)?;
        run.startup_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        run.measure_loads(target, seconds, Some(child.id()))
    })();
    run.peak_rss_kib = servers::peak_rss_kib(child.id());
    servers::stop(&mut child);
    if let Err(e) = result {
        run.error = Some(format!("{e:#}"));
    }
    run
}

/// Waits until a read through `target` completes (the server serves).
fn wait_first_read(
    child: &mut std::process::Child,
    target: &Target,
    log: &Path,
    limit: Duration,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let Target::Socket(socket) = target else {
        return Ok(());
    };
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            bail!("server exited ({status}): {}", log.trim());
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

fn measure_raw(raw: &Path, seconds: f64, repetition: usize) -> Run {
    let mut run = Run::new("raw-file-io_uring", 0, repetition);
    let result = crate::page_cache::warm(raw)
        .map_err(anyhow::Error::from)
        .and_then(|()| run.measure_loads(Target::File(raw.to_owned()), seconds, None));
    if let Err(e) = result {
        run.error = Some(format!("{e:#}"));
    }
    run
}

/// Random reads at depth 1 and 32 over the disk's bytes spread over
/// `layers` files in `dir`.
fn measure_spread(dir: &Path, layers: usize, seconds: f64, repetition: usize) -> Run {
    let mut run = Run::new("raw-files-io_uring", layers, repetition);
    let duration = Duration::from_secs_f64(seconds);
    let result = crate::page_cache::warm_dir(dir)
        .map_err(anyhow::Error::from)
        .and_then(|()| crate::spread::measure(dir, 1, duration, Default::default()))
        .and_then(|qd1| {
            run.rand_read_qd1 = Some(qd1);
            run.rand_read_qd32 = Some(crate::spread::measure(
                dir,
                32,
                duration,
                Default::default(),
            )?);
            Ok(())
        });
    if let Err(e) = result {
        run.error = Some(format!("{e:#}"));
    }
    run
}

/// qemu-storage-daemon exporting the raw file, the three read loads.
fn measure_qsd_raw(raw: &Path, setup: &Setup<'_>, repetition: usize) -> Run {
    let mut run = Run::new("qsd-raw", 0, repetition);
    let socket = setup.out.join("bench.sock");
    let log = setup.out.join("qsd-raw.log");
    if let Err(e) = crate::page_cache::warm(raw) {
        run.error = Some(format!("reading the raw file into the page cache: {e}"));
        return run;
    }
    let t0 = Instant::now();
    let mut child = match servers::spawn_qsd_raw(&setup.programs.qsd, raw, &socket, &log) {
        Ok(c) => c,
        Err(e) => {
            run.error = Some(format!("{e:#}"));
            return run;
        }
    };
    let target = Target::Socket(socket.clone());
    let result = wait_first_read(&mut child, &target, &log, setup.startup_limit).and_then(|()| {
        run.startup_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        run.measure_loads(target.clone(), setup.seconds, Some(child.id()))
    });
    run.peak_rss_kib = servers::peak_rss_kib(child.id());
    servers::stop(&mut child);
    if let Err(e) = result {
        run.error = Some(format!("{e:#}"));
    }
    run
}

/// The images of the write matrix.
struct WriteImages {
    dir: PathBuf,
    /// One layer, 2 % filled (sparse), under the fresh overlays.
    base: PathBuf,
    /// One fully allocated layer.
    allocated: PathBuf,
}

impl WriteImages {
    fn make(out: &Path, base_size: u64) -> anyhow::Result<Self> {
        let dir = out.join("writes");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        eprintln!("==> write images: a {base_size}-byte base (2 % filled) and a full 1 GiB layer");
        let gen = |sub: &str, size: u64, fill: f64| -> anyhow::Result<PathBuf> {
            let d = dir.join(sub);
            std::fs::create_dir_all(&d)?;
            let opts = GenOptions {
                layers: 1,
                size,
                cluster_size: 65536,
                fill,
                seed: 2,
                distribution: Distribution::Uniform,
                index: true,
            };
            generate(&d, &opts, &mut |_, _| {})?;
            Ok(d.join(layer_file_name(0)))
        };
        let base = gen("base", base_size, 0.02)?;
        let allocated = gen("allocated", 1 << 30, 1.0)?;
        Ok(WriteImages {
            dir,
            base,
            allocated,
        })
    }

    /// A fresh overlay of `base` (as `qemu-img create -b` makes it, then
    /// indexed by `sqcow2 upgrade` for sqcow2).
    fn fresh(&self, base: &Path, sqcow2: Option<&Path>) -> anyhow::Result<PathBuf> {
        let over = self.dir.join("overlay.qcow2");
        let _ = std::fs::remove_file(&over);
        let _ = std::fs::remove_file(self.dir.join("overlay.qcow2.sqidx"));
        let ok = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(base)
            .arg(&over)
            .status()?
            .success();
        anyhow::ensure!(ok, "qemu-img create of the overlay failed");
        if let Some(sqcow2) = sqcow2 {
            let ok = std::process::Command::new(sqcow2)
                .arg("upgrade")
                .arg(&over)
                .stdout(std::process::Stdio::null())
                .status()?
                .success();
            anyhow::ensure!(ok, "sqcow2 upgrade of the overlay failed");
        }
        Ok(over)
    }
}

/// The write and queue matrix on `server`: one server start per image.
fn measure_writes(
    server: Server,
    images: &WriteImages,
    setup: &Setup<'_>,
    repetition: usize,
) -> Vec<WriteRun> {
    let mut runs = Vec::new();
    for image in [
        WriteImage::Fresh,
        WriteImage::FreshOverData,
        WriteImage::Allocated,
    ] {
        let loads: Vec<WriteLoad> = WRITE_LOADS
            .iter()
            .copied()
            .filter(|l| l.image == image)
            .collect();
        eprintln!(
            "==> {} writes on a{} image (repetition {})",
            server.name(),
            match image {
                WriteImage::Fresh => " fresh overlay",
                WriteImage::FreshOverData => " fresh overlay over data",
                WriteImage::Allocated => "n allocated",
            },
            repetition + 1
        );
        let result = (|| -> anyhow::Result<Vec<WriteRun>> {
            let top = match image {
                WriteImage::Fresh => images.fresh(
                    &images.base,
                    (!server.is_qemu()).then_some(setup.programs.sqcow2.as_path()),
                )?,
                WriteImage::FreshOverData => images.fresh(
                    &images.allocated,
                    (!server.is_qemu()).then_some(setup.programs.sqcow2.as_path()),
                )?,
                WriteImage::Allocated => images.allocated.clone(),
            };
            // Every server starts with none of the images' pages dirty (the
            // previous server's writes, still being written back, would
            // slow this one's: overwrites wait for pages under writeback)
            // and every page cached alone, whatever wrote or read it before
            // (see `page_cache`).
            for image in [&top, &images.base, &images.allocated] {
                crate::page_cache::cache_in_pages(image)?;
            }
            let chain = ChainFiles { layers: vec![top] };
            let socket = setup.out.join("bench.sock");
            let log = setup.out.join(format!("{}-writes.log", server.name()));
            let export = servers::Export {
                writable: true,
                queues: WRITE_QUEUES,
            };
            let mut child = servers::spawn(
                server,
                &chain,
                &socket,
                setup.programs,
                setup.cache_bytes,
                export,
                &log,
            )?;
            let target = Target::Socket(socket.clone());
            let mut out = Vec::new();
            let result = wait_first_read(&mut child, &target, &log, setup.startup_limit);
            if result.is_ok() {
                for l in &loads {
                    let spec = LoadSpec {
                        target: target.clone(),
                        pattern: l.pattern,
                        block_size: 4096,
                        iodepth: l.iodepth,
                        queues: l.queues,
                        duration: Duration::from_secs_f64(setup.seconds),
                        flush_every: 0,
                        flush_interval: None,
                        timeline: None,
                        phases: None,
                        keep_samples: 200_000,
                        slow_us: None,
                    };
                    let r = run_load(&spec, Some(child.id()));
                    out.push(WriteRun {
                        server: server.name().into(),
                        load: l.name(),
                        repetition,
                        error: r.as_ref().err().map(|e| format!("{e:#}")),
                        result: r.ok(),
                    });
                }
            }
            servers::stop(&mut child);
            result?;
            Ok(out)
        })();
        match result {
            Ok(r) => runs.extend(r),
            Err(e) => {
                eprintln!("    failed: {e:#}");
                runs.extend(loads.iter().map(|l| WriteRun {
                    server: server.name().into(),
                    load: l.name(),
                    repetition,
                    result: None,
                    error: Some(format!("{e:#}")),
                }));
            }
        }
    }
    runs
}

/// Longest a `qemu-img create -b` of the snapshot timing may take.
const QEMU_IMG_CREATE_LIMIT: Duration = Duration::from_secs(60);

/// Runs `cmd`; whether it exited successfully within `limit` (killed
/// past it by a watchdog thread, so that the caller's timing is the
/// process's own, not a polling interval's).
fn succeeds_within(cmd: &mut std::process::Command, limit: Duration) -> anyhow::Result<bool> {
    let mut child = cmd.spawn()?;
    let pid = child.id() as libc::pid_t;
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        let late = finished.recv_timeout(limit).is_err();
        if late {
            // SAFETY: kill only sends a signal; the child is reaped only
            // after this thread ends (the main thread waits with WNOWAIT
            // and joins it first), so the pid is still the child's.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        late
    });
    // Wait for the exit without reaping (WNOWAIT): until the watchdog has
    // stopped, the pid stays this child's and cannot be reused.
    // SAFETY: waitid writes into `info`, which we own.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `pid` is our unreaped child.
    unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT,
        )
    };
    let _ = done.send(());
    let late = watchdog.join().unwrap_or(true);
    let status = child.wait()?;
    Ok(status.success() && !late)
}

/// `sqcow2 snapshot` vs `qemu-img create -b` on the chain's top, `n`
/// times each; the new files are removed after every run.
fn snapshot_times(chain: &ChainFiles, sqcow2: &Path, n: usize) -> anyhow::Result<SnapshotTimes> {
    let top = chain.top();
    let dir = top.parent().context("top has a directory")?;
    let new = dir.join("bench-snapshot.qcow2");
    let mut t = SnapshotTimes {
        layers: chain.layers.len(),
        sqcow2_ms: Vec::new(),
        qemu_img_ms: Vec::new(),
    };
    let cleanup = || {
        let _ = std::fs::remove_file(&new);
        let _ = std::fs::remove_file(dir.join("bench-snapshot.qcow2.sqidx"));
    };
    for _ in 0..n {
        cleanup();
        // Both commands open the whole chain: from the page cache, not
        // from the disk (at 10,000 layers only one round may run).
        warm_chain(chain)?;
        let start = Instant::now();
        let ok = std::process::Command::new(sqcow2)
            .arg("snapshot")
            .arg(top)
            .arg(&new)
            .status()?
            .success();
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        if !ok {
            bail!("sqcow2 snapshot failed");
        }
        t.sqcow2_ms.push(ms);
        cleanup();
        let start = Instant::now();
        let mut qemu_img = std::process::Command::new("qemu-img");
        qemu_img
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(top)
            .arg(&new);
        let ok = succeeds_within(&mut qemu_img, QEMU_IMG_CREATE_LIMIT)?;
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        // qemu-img may fail on very long chains, or take far too long
        // (it opens the whole chain: hours at 10,000 layers with a high
        // open-file limit); keep sqcow2's figures and try no more.
        if !ok {
            eprintln!(
                "    qemu-img create -b failed or took over {} s",
                QEMU_IMG_CREATE_LIMIT.as_secs()
            );
            break;
        }
        t.qemu_img_ms.push(ms);
    }
    cleanup();
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(iops: f64, mb_per_s: f64) -> Option<LoadResult> {
        Some(LoadResult {
            mb_per_s,
            ..crate::load::tests::sample(iops, None)
        })
    }

    fn trial(program: &str, qd1: f64, qd32: f64, seq: f64, error: bool) -> QsdTrial {
        let mut run = Run::new("qsd-iothread", 1, 0);
        run.rand_read_qd1 = load(qd1, 0.0);
        run.rand_read_qd32 = load(qd32, 0.0);
        run.seq_read_1m = load(0.0, seq);
        run.error = error.then(|| "did not start".into());
        QsdTrial {
            program: program.into(),
            version: String::new(),
            run,
            chosen: false,
        }
    }

    #[test]
    fn the_qsd_fastest_over_all_loads_is_chosen_and_a_failed_one_never() {
        // Faster at depth 32 alone does not win against faster at every
        // other load; a failed binary is never chosen, however fast.
        let mut trials = [
            trial("a", 10_000.0, 400_000.0, 5_000.0, false),
            trial("b", 20_000.0, 300_000.0, 9_000.0, false),
            trial("c", 90_000.0, 900_000.0, 90_000.0, true),
        ];
        mark_fastest(&mut trials);
        let chosen: Vec<&str> = trials
            .iter()
            .filter(|t| t.chosen)
            .map(|t| t.program.as_str())
            .collect();
        assert_eq!(chosen, ["b"]);
        let mut failed = [trial("c", 1.0, 1.0, 1.0, true)];
        mark_fastest(&mut failed);
        assert!(!failed[0].chosen);
        let geo = trial_score(&trials[0].run).unwrap();
        assert!((geo - (10_000.0f64 * 400_000.0 * 5_000.0).cbrt()).abs() < 1e-3 * geo);
    }
}
