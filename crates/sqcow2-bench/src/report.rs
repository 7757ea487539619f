//! Medians, ratios, goals and the Markdown section of a suite run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;

use crate::load::LoadResult;
use crate::results::{Results, Run, WRITE_LOADS};

const START: &str = "<!-- bench-suite:start -->";
const END: &str = "<!-- bench-suite:end -->";

/// sqcow2's configurations compared with QEMU's best: the default first.
const SQCOW2_CONFIGS: [&str; 2] = ["sqcow2-indexed", "sqcow2-poll"];

/// How a row of `config` is marked (nothing for the default).
fn config_suffix(config: &str) -> String {
    if config == SQCOW2_CONFIGS[0] {
        String::new()
    } else {
        format!(" ({})", config.trim_start_matches("sqcow2-"))
    }
}

/// Picks one figure of a [`Cell`].
type CellMetric = fn(&Cell) -> Option<f64>;

/// Medians of one server at one chain length.
#[derive(Debug, Clone, Default)]
pub struct Cell {
    pub iops_qd1: Option<f64>,
    pub p99_qd1_us: Option<f64>,
    pub iops_qd32: Option<f64>,
    pub p99_qd32_us: Option<f64>,
    pub seq_mb_s: Option<f64>,
    /// Server CPU time per I/O (µs) at depth 1 and 32.
    pub cpu_qd1_us: Option<f64>,
    pub cpu_qd32_us: Option<f64>,
    pub rss_mib: Option<f64>,
    pub startup_ms: Option<f64>,
    /// QD1 latency quantiles (µs) of the median run.
    pub cdf_qd1_us: Vec<f64>,
    pub errors: Vec<String>,
}

/// The suite's figures, ready for tables and plots.
#[derive(Debug, Clone)]
pub struct Summary {
    pub servers: Vec<String>,
    pub lengths: Vec<usize>,
    pub cells: BTreeMap<(String, usize), Cell>,
    pub raw: Cell,
    /// qemu-storage-daemon's raw-file export.
    pub qsd_raw: Cell,
    /// The same bytes spread over as many raw files as each length has
    /// layers, read in process (random reads only).
    pub spread: BTreeMap<usize, Cell>,
    /// The write and queue matrix: servers in order, loads in order, and
    /// the medians of each (server, load).
    pub write_servers: Vec<String>,
    pub write_loads: Vec<String>,
    pub writes: BTreeMap<(String, String), WriteCell>,
}

/// Medians of one load of the write matrix on one server.
#[derive(Debug, Clone, Default)]
pub struct WriteCell {
    pub iops: Option<f64>,
    pub cpu_us: Option<f64>,
    pub errors: u64,
    pub failures: Vec<String>,
}

pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
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

fn cell(runs: &[&Run]) -> Cell {
    let pick = |f: &dyn Fn(&Run) -> Option<f64>| median(runs.iter().filter_map(|r| f(r)).collect());
    let load = |f: fn(&Run) -> &Option<LoadResult>, g: fn(&LoadResult) -> f64| {
        move |r: &Run| f(r).as_ref().map(g)
    };
    let iops_qd1 = pick(&load(|r| &r.rand_read_qd1, |l| l.iops));
    // The CDF of the run whose QD1 IOPS is closest to the median.
    let cdf_qd1_us = runs
        .iter()
        .filter_map(|r| r.rand_read_qd1.as_ref())
        .min_by(|a, b| {
            let m = iops_qd1.unwrap_or(0.0);
            (a.iops - m).abs().total_cmp(&(b.iops - m).abs())
        })
        .map(|l| l.lat_cdf_us.clone())
        .unwrap_or_default();
    Cell {
        iops_qd1,
        p99_qd1_us: pick(&load(|r| &r.rand_read_qd1, |l| l.lat_p99_us)),
        iops_qd32: pick(&load(|r| &r.rand_read_qd32, |l| l.iops)),
        p99_qd32_us: pick(&load(|r| &r.rand_read_qd32, |l| l.lat_p99_us)),
        seq_mb_s: pick(&load(|r| &r.seq_read_1m, |l| l.mb_per_s)),
        cpu_qd1_us: pick(&|r: &Run| {
            r.rand_read_qd1
                .as_ref()
                .and_then(|l| l.server_cpu_us_per_io)
        }),
        cpu_qd32_us: pick(&|r: &Run| {
            r.rand_read_qd32
                .as_ref()
                .and_then(|l| l.server_cpu_us_per_io)
        }),
        // A server that never started serving has no meaningful peak.
        rss_mib: pick(&|r: &Run| r.startup_ms.and(r.peak_rss_kib).map(|k| k as f64 / 1024.0)),
        startup_ms: pick(&|r: &Run| r.startup_ms),
        cdf_qd1_us,
        errors: runs.iter().filter_map(|r| r.error.clone()).collect(),
    }
}

impl Summary {
    pub fn new(results: &Results) -> Summary {
        let mut servers: Vec<String> = Vec::new();
        for r in &results.runs {
            if !servers.contains(&r.server) {
                servers.push(r.server.clone());
            }
        }
        let mut cells = BTreeMap::new();
        for s in &servers {
            for &l in &results.lengths {
                let runs: Vec<&Run> = results
                    .runs
                    .iter()
                    .filter(|r| &r.server == s && r.layers == l)
                    .collect();
                cells.insert((s.clone(), l), cell(&runs));
            }
        }
        let raw: Vec<&Run> = results.raw_limit.iter().collect();
        let qsd_raw: Vec<&Run> = results.qsd_raw.iter().collect();
        let spread = results
            .lengths
            .iter()
            .map(|&l| {
                let runs: Vec<&Run> = results
                    .spread_limit
                    .iter()
                    .filter(|r| r.layers == l)
                    .collect();
                (l, cell(&runs))
            })
            .filter(|(_, c)| c.iops_qd1.is_some() || c.iops_qd32.is_some())
            .collect();
        let mut write_servers: Vec<String> = Vec::new();
        for w in &results.writes {
            if !write_servers.contains(&w.server) {
                write_servers.push(w.server.clone());
            }
        }
        let write_loads: Vec<String> = WRITE_LOADS
            .iter()
            .map(|l| l.name())
            .filter(|n| results.writes.iter().any(|w| &w.load == n))
            .collect();
        let mut writes = BTreeMap::new();
        for srv in &write_servers {
            for load in &write_loads {
                let runs: Vec<_> = results
                    .writes
                    .iter()
                    .filter(|w| &w.server == srv && &w.load == load)
                    .collect();
                let med = |f: &dyn Fn(&LoadResult) -> Option<f64>| {
                    median(
                        runs.iter()
                            .filter_map(|w| w.result.as_ref().and_then(f))
                            .collect(),
                    )
                };
                writes.insert(
                    (srv.clone(), load.clone()),
                    WriteCell {
                        iops: med(&|l| Some(l.iops)),
                        cpu_us: med(&|l| l.server_cpu_us_per_io),
                        errors: runs
                            .iter()
                            .filter_map(|w| w.result.as_ref().map(|l| l.errors))
                            .sum(),
                        failures: runs.iter().filter_map(|w| w.error.clone()).collect(),
                    },
                );
            }
        }
        Summary {
            servers,
            lengths: results.lengths.clone(),
            cells,
            raw: cell(&raw),
            qsd_raw: cell(&qsd_raw),
            spread,
            write_servers,
            write_loads,
            writes,
        }
    }

    /// The qemu-storage-daemon configuration with the best value of `f`
    /// at `layers` (the highest, or the lowest with `lowest`): its name
    /// without the `qsd-` prefix, and the value.
    pub fn best_qemu(&self, layers: usize, f: CellMetric, lowest: bool) -> Option<(String, f64)> {
        self.servers
            .iter()
            .filter(|srv| srv.starts_with("qsd-"))
            .filter_map(|srv| {
                self.get(srv, layers)
                    .and_then(f)
                    .map(|v| (srv.trim_start_matches("qsd-").to_string(), v))
            })
            .reduce(|a, b| {
                let better = if lowest { b.1 < a.1 } else { b.1 > a.1 };
                if better {
                    b
                } else {
                    a
                }
            })
    }

    /// The best qemu-storage-daemon value of the write matrix's `load`
    /// (highest IOPS): configuration name and cell.
    pub fn best_qemu_write(&self, load: &str) -> Option<(String, &WriteCell)> {
        self.write_servers
            .iter()
            .filter(|srv| srv.starts_with("qsd-"))
            .filter_map(|srv| {
                self.writes
                    .get(&(srv.clone(), load.to_string()))
                    .filter(|c| c.iops.is_some())
                    .map(|c| (srv.trim_start_matches("qsd-").to_string(), c))
            })
            .max_by(|a, b| a.1.iops.unwrap_or(0.0).total_cmp(&b.1.iops.unwrap_or(0.0)))
    }

    pub fn get(&self, server: &str, layers: usize) -> Option<&Cell> {
        self.cells.get(&(server.to_string(), layers))
    }
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    match v {
        Some(x) => format!("{x:.digits$}"),
        None => "failed".into(),
    }
}

fn table(
    out: &mut String,
    s: &Summary,
    title: &str,
    f: &dyn Fn(&Cell) -> Option<f64>,
    digits: usize,
) {
    let _ = writeln!(out, "\n{title}\n");
    let _ = write!(out, "| server |");
    for l in &s.lengths {
        let _ = write!(out, " {l} |");
    }
    let _ = write!(out, "\n| --- |");
    for _ in &s.lengths {
        let _ = write!(out, " ---: |");
    }
    out.push('\n');
    for server in &s.servers {
        let _ = write!(out, "| {server} |");
        for &l in &s.lengths {
            let v = s.get(server, l).and_then(f);
            let _ = write!(out, " {} |", fmt(v, digits));
        }
        out.push('\n');
    }
}

/// Which qemu-storage-daemon the run compared with, when it tried several.
fn qsd_trials(md: &mut String, results: &Results) {
    if results.qsd_trials.is_empty() {
        return;
    }
    let _ = write!(
        md,
        "\nqemu-storage-daemon binaries tried first (`qsd-iothread`, the shortest chain, two runs \
         each in alternating order, the better one shown; the run compares with the fastest, by \
         the geometric mean of the three loads):"
    );
    for t in &results.qsd_trials {
        let rate = |l: &Option<LoadResult>, f: fn(&LoadResult) -> f64| {
            l.as_ref()
                .map_or_else(|| "failed".into(), |l| format!("{:.0}", f(l)))
        };
        let _ = write!(
            md,
            " `{}` ({}): {} / {} IOPS at depth 1 / 32, {} MB/s{};",
            t.program,
            if t.version.is_empty() {
                "?"
            } else {
                &t.version
            },
            rate(&t.run.rand_read_qd1, |l| l.iops),
            rate(&t.run.rand_read_qd32, |l| l.iops),
            rate(&t.run.seq_read_1m, |l| l.mb_per_s),
            if t.chosen { ", chosen" } else { "" },
        );
    }
    md.pop();
    md.push_str(".\n");
}

/// The Markdown section of a run; `plots` is where its plots are, as a
/// link from the document it goes into.
pub fn markdown(results: &Results, s: &Summary, plots: &Path) -> String {
    let mut md = String::new();
    let m = &results.machine;
    let dir = plots.display();
    let _ = writeln!(md, "{START}");
    let _ = writeln!(
        md,
        "Produced by `{}` in {:.0} s. Machine: {} ({} cores, {}), kernel {}, {}. \
         Chains from `gen-chain` (64 KiB clusters, half the clusters written, spread over the layers), \
         disk {} MiB, served read-only over vhost-user-blk to a libblkio client (1 queue); \
         each load runs {:.1} s; medians of {} repetitions; sqcow2 cache budget {} MiB. \
         Servers (`docs/benchmarks.md` has their command lines): `qsd-default` (QEMU's defaults, `aio=threads`, for reference), \
         `qsd-io_uring` (`aio=io_uring`), `qsd-iothread` (`aio=io_uring`, the export in a polling iothread), \
         `qsd-budget` (as qsd-iothread, every layer a node with sqcow2's budget split over the layers), \
         `sqcow2-walk` (`--walk`), `sqcow2-indexed`, `sqcow2-poll` (`--poll-us 50`). \
         Raw JSON: `{dir}/results.json`.",
        results.command,
        results.wall_seconds,
        m.get("cpu").map(String::as_str).unwrap_or("?"),
        m.get("cores").map(String::as_str).unwrap_or("?"),
        m.get("memory").map(String::as_str).unwrap_or("?"),
        m.get("kernel").map(String::as_str).unwrap_or("?"),
        m.get("qemu").map(String::as_str).unwrap_or("?"),
        results.disk_size >> 20,
        results.seconds_per_run,
        results.repetitions,
        results.cache_bytes >> 20,
    );
    qsd_trials(&mut md, results);
    table(
        &mut md,
        s,
        "**Random 4 KiB reads, queue depth 1, IOPS** (chain length in layers)",
        &|c| c.iops_qd1,
        0,
    );
    table(
        &mut md,
        s,
        "**Random 4 KiB reads, queue depth 32, IOPS**",
        &|c| c.iops_qd32,
        0,
    );
    table(
        &mut md,
        s,
        "**p99 latency, queue depth 1 (µs)**",
        &|c| c.p99_qd1_us,
        0,
    );
    table(
        &mut md,
        s,
        "**p99 latency, queue depth 32 (µs)**",
        &|c| c.p99_qd32_us,
        0,
    );
    table(
        &mut md,
        s,
        "**Sequential 1 MiB reads, queue depth 4, MB/s**",
        &|c| c.seq_mb_s,
        0,
    );
    table(
        &mut md,
        s,
        "**Server CPU time per I/O, random reads at depth 32 (µs; user + system)**",
        &|c| c.cpu_qd32_us,
        1,
    );
    table(&mut md, s, "**Server peak RSS (MiB)**", &|c| c.rss_mib, 1);
    table(
        &mut md,
        s,
        "**Time from start to the first completed read (ms)**",
        &|c| c.startup_ms,
        0,
    );
    let _ = writeln!(
        md,
        "\n**sqcow2 vs the best qemu-storage-daemon configuration of each cell** \
         (ratios of the medians above: sqcow2-indexed, and sqcow2-poll where marked; the \
         qemu-storage-daemon configuration in parentheses; CPU and RSS: below 1 is less):\n"
    );
    let _ = write!(md, "| metric |");
    for l in &s.lengths {
        let _ = write!(md, " {l} |");
    }
    let _ = write!(md, "\n| --- |");
    for _ in &s.lengths {
        let _ = write!(md, " ---: |");
    }
    md.push('\n');
    let ratios: [(&str, CellMetric, bool); 6] = [
        ("IOPS, depth 1", |c| c.iops_qd1, false),
        ("IOPS, depth 32", |c| c.iops_qd32, false),
        ("sequential MB/s", |c| c.seq_mb_s, false),
        ("CPU per I/O, depth 1", |c| c.cpu_qd1_us, true),
        ("CPU per I/O, depth 32", |c| c.cpu_qd32_us, true),
        ("peak RSS", |c| c.rss_mib, true),
    ];
    for ours in SQCOW2_CONFIGS {
        if !s.servers.iter().any(|srv| srv == ours) {
            continue;
        }
        for (name, f, lowest) in ratios {
            if ours != SQCOW2_CONFIGS[0] && name == "peak RSS" {
                continue;
            }
            let _ = write!(md, "| {name}{} |", config_suffix(ours));
            for &l in &s.lengths {
                let r = match (s.get(ours, l).and_then(f), s.best_qemu(l, f, lowest)) {
                    (Some(a), Some((cfg, b))) if b > 0.0 => format!("{:.2}x ({cfg})", a / b),
                    _ => "-".into(),
                };
                let _ = write!(md, " {r} |");
            }
            md.push('\n');
        }
    }
    let _ = writeln!(
        md,
        "\n**Limits** (the same amount of data in one raw file): libblkio's io_uring driver reading it \
         in-process on the host: {} IOPS at depth 1, {} IOPS at depth 32, {} MB/s sequential; \
         qemu-storage-daemon exporting it over vhost-user-blk (`aio=io_uring`, polling iothread; \
         the vhost-user path without qcow2): {} IOPS at depth 1, {} IOPS at depth 32, {} MB/s \
         sequential, {} µs of CPU per I/O at depth 32.",
        fmt(s.raw.iops_qd1, 0),
        fmt(s.raw.iops_qd32, 0),
        fmt(s.raw.seq_mb_s, 0),
        fmt(s.qsd_raw.iops_qd1, 0),
        fmt(s.qsd_raw.iops_qd32, 0),
        fmt(s.qsd_raw.seq_mb_s, 0),
        fmt(s.qsd_raw.cpu_qd32_us, 1),
    );
    write_spread(&mut md, s);
    write_matrix(&mut md, s);
    let _ = writeln!(md, "\n**Snapshot time** (median of 5, ms):\n\n| layers | sqcow2 snapshot | qemu-img create -b |\n| ---: | ---: | ---: |");
    for t in &results.snapshots {
        let _ = writeln!(
            md,
            "| {} | {} | {} |",
            t.layers,
            fmt(median(t.sqcow2_ms.clone()), 1),
            fmt(median(t.qemu_img_ms.clone()), 1)
        );
    }
    let _ = writeln!(md, "\n**Goals** (measured in this run):\n");
    for line in goals(s) {
        let _ = writeln!(md, "* {line}");
    }
    let mut errors: Vec<String> = s
        .cells
        .iter()
        .flat_map(|((srv, l), c)| {
            c.errors
                .iter()
                .map(move |e| format!("{srv} at {l} layers: {e}"))
        })
        .collect();
    for ((srv, load), c) in &s.writes {
        errors.extend(c.failures.iter().map(|e| format!("{srv}, {load}: {e}")));
        if c.errors > 0 {
            errors.push(format!("{srv}, {load}: {} requests failed", c.errors));
        }
    }
    errors.dedup();
    if !errors.is_empty() {
        let _ = writeln!(md, "\n**Failures**:\n");
        for e in errors {
            let first = e
                .lines()
                .next()
                .unwrap_or("")
                .chars()
                .take(300)
                .collect::<String>();
            let _ = writeln!(md, "* {first}");
        }
    }
    let _ = writeln!(
        md,
        "\n![Random-read IOPS vs chain length]({dir}/iops.svg)\n![Peak RSS vs chain length]({dir}/rss.svg)\n![QD1 latency CDF at the longest chain]({dir}/latency-cdf.svg)"
    );
    let _ = writeln!(md, "{END}");
    md
}

/// The write and queue matrix: IOPS and CPU per I/O per server, and
/// sqcow2 against the best qemu-storage-daemon configuration of each load.
fn write_matrix(md: &mut String, s: &Summary) {
    if s.write_loads.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "\n**Writes and queues** (one layer: allocating writes into a fresh overlay of a sparse base \
         2 % filled, allocating writes over data into a fresh overlay of a fully allocated 1 GiB \
         layer (copy-on-write of the rest of each cluster), the others on that layer; 4 KiB \
         random, random bytes; every server exports 4 queues, writable; no guest flushes; IOPS, \
         and sqcow2 against the best qemu-storage-daemon configuration):\n"
    );
    let _ = write!(md, "| load |");
    for srv in &s.write_servers {
        let _ = write!(md, " {srv} |");
    }
    let ours: Vec<&str> = SQCOW2_CONFIGS
        .into_iter()
        .filter(|c| s.write_servers.iter().any(|srv| srv == c))
        .collect();
    for c in &ours {
        let _ = write!(md, " {} / best QSD |", c.trim_start_matches("sqcow2-"));
    }
    md.push('\n');
    let _ = write!(md, "| --- |");
    for _ in 0..s.write_servers.len() + ours.len() {
        let _ = write!(md, " ---: |");
    }
    md.push('\n');
    for load in &s.write_loads {
        let _ = write!(md, "| {load} |");
        for srv in &s.write_servers {
            let v = s
                .writes
                .get(&(srv.clone(), load.clone()))
                .and_then(|c| c.iops);
            let _ = write!(md, " {} |", fmt(v, 0));
        }
        for c in &ours {
            let mine = s
                .writes
                .get(&(c.to_string(), load.clone()))
                .and_then(|c| c.iops);
            let r = match (mine, s.best_qemu_write(load)) {
                (Some(a), Some((cfg, c))) => match c.iops {
                    Some(b) if b > 0.0 => format!("{:.2}x ({cfg})", a / b),
                    _ => "-".into(),
                },
                _ => "-".into(),
            };
            let _ = write!(md, " {r} |");
        }
        md.push('\n');
    }
    let _ = writeln!(
        md,
        "\n**Writes and queues: server CPU time per I/O (µs)**\n"
    );
    let _ = write!(md, "| load |");
    for srv in &s.write_servers {
        let _ = write!(md, " {srv} |");
    }
    md.push('\n');
    let _ = write!(md, "| --- |");
    for _ in &s.write_servers {
        let _ = write!(md, " ---: |");
    }
    md.push('\n');
    for load in &s.write_loads {
        let _ = write!(md, "| {load} |");
        for srv in &s.write_servers {
            let v = s
                .writes
                .get(&(srv.clone(), load.clone()))
                .and_then(|c| c.cpu_us);
            let _ = write!(md, " {} |", fmt(v, 1));
        }
        md.push('\n');
    }
}

/// The kernel's own cost of a long chain: the spread limit per length,
/// and its ratio to the first length.
fn write_spread(md: &mut String, s: &Summary) {
    let Some(first) = s.spread.values().next() else {
        return;
    };
    let _ = writeln!(
        md,
        "\n**The kernel's part of a long chain** (no server, no qcow2: as many bytes as a chain holds, \
         spread evenly over as many raw files as the chain has layers, random 4 KiB reads of them \
         with io_uring in process; reading many files costs the kernel more per read, and every \
         server reading a chain pays it on the reads that find data, half of them here):\n"
    );
    let _ = writeln!(
        md,
        "| files | IOPS, depth 1 | IOPS, depth 32 | CPU per I/O, depth 32 (µs) | depth 1 vs one file | depth 32 vs one file |\n| ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for (l, c) in &s.spread {
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "-".into(),
        };
        let _ = writeln!(
            md,
            "| {l} | {} | {} | {} | {} | {} |",
            fmt(c.iops_qd1, 0),
            fmt(c.iops_qd32, 0),
            fmt(c.cpu_qd32_us, 1),
            ratio(c.iops_qd1, first.iops_qd1),
            ratio(c.iops_qd32, first.iops_qd32),
        );
    }
}

fn goals(s: &Summary) -> Vec<String> {
    let mut out = Vec::new();
    let (Some(&first), Some(&last)) = (s.lengths.first(), s.lengths.last()) else {
        return out;
    };
    let idx = |l| s.get("sqcow2-indexed", l);
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let metrics: [(&str, CellMetric); 2] =
        [("depth 1", |c| c.iops_qd1), ("depth 32", |c| c.iops_qd32)];
    for ours in SQCOW2_CONFIGS {
        let mine = |l| s.get(ours, l);
        let label = ours.trim_start_matches("sqcow2-");
        for (name, f) in metrics {
            if let (Some(a), Some((cfg, b))) =
                (mine(first).and_then(f), s.best_qemu(first, f, false))
            {
                let r = a / b;
                out.push(format!(
                    "{label} IOPS at {first} layer(s) >= the best qemu-storage-daemon's ({name}, qsd-{cfg}): {a:.0} vs {b:.0} = {r:.2}x — {}",
                    verdict(r >= 1.0)
                ));
            }
            if let (Some(a), Some(b)) = (mine(first).and_then(f), f(&s.qsd_raw)) {
                let r = a / b;
                out.push(format!(
                    "{label} IOPS at {first} layer(s) >= 0.9 x qemu-storage-daemon's raw-file export ({name}): {a:.0} vs {b:.0} = {r:.2} — {}",
                    verdict(r >= 0.9)
                ));
            }
        }
        let cpu: CellMetric = |c| c.cpu_qd32_us;
        if let (Some(a), Some((cfg, _))) = (
            mine(first).and_then(cpu),
            s.best_qemu(first, |c| c.iops_qd32, false),
        ) {
            if let Some(b) = s.get(&format!("qsd-{cfg}"), first).and_then(cpu) {
                out.push(format!(
                    "{label} server CPU per I/O at {first} layer(s), depth 32, <= the best qemu-storage-daemon's (qsd-{cfg}): {a:.1} vs {b:.1} µs — {}",
                    verdict(a <= b)
                ));
            }
        }
    }
    for (name, f) in metrics {
        for &l in s.lengths.iter().filter(|&&l| l >= 1000) {
            if let (Some(a), Some(b)) = (idx(l).and_then(f), idx(first).and_then(f)) {
                let r = a / b;
                out.push(format!(
                    "indexed random-read IOPS at {l} layers >= 0.95 x at {first} ({name}): {a:.0} / {b:.0} = {r:.2} — {}",
                    verdict(r >= 0.95)
                ));
                // The same ratio of the kernel alone (the files limit).
                let spread = |l| s.spread.get(&l).and_then(f);
                if let (Some(sa), Some(sb)) = (spread(l), spread(first)) {
                    let k = sa / sb;
                    out.push(format!(
                        "(for reference, not a goal) the kernel alone, the same bytes in {l} raw files against {first} ({name}): {k:.2}; sqcow2-indexed's ratio over the kernel's: {:.2}",
                        r / k
                    ));
                }
            }
        }
    }
    if let (Some(a), Some(b)) = (
        idx(last).and_then(|c| c.rss_mib),
        idx(first).and_then(|c| c.rss_mib),
    ) {
        out.push(format!(
            "peak RSS at {last} layers <= RSS at {first} + 16 MiB: {a:.1} MiB vs {b:.1} + 16 MiB — {}",
            verdict(a <= b + 16.0)
        ));
    }
    if let (Some(a), Some(b)) = (idx(last).and_then(|c| c.seq_mb_s), s.raw.seq_mb_s) {
        let r = a / b;
        out.push(format!(
            "sequential read at {last} layers >= 0.9 x the raw-file limit: {a:.0} vs {b:.0} MB/s = {r:.2} — {}",
            verdict(r >= 0.9)
        ));
        // What the kernel alone does for the same reads of the chain.
        if let Some(k) = s.spread.get(&last).and_then(|c| c.seq_mb_s) {
            out.push(format!(
                "(for reference, not a goal) the kernel alone, the {last}-layer chain's data clusters in {last} raw files read the same way: {k:.0} MB/s = {:.2} of the raw-file limit; sqcow2-indexed's MB/s over the kernel's: {:.2}",
                k / b,
                a / k
            ));
        }
    }
    // Queue scaling of sqcow2 in the write matrix: never negative.
    let w = |load: &str| {
        s.writes
            .get(&("sqcow2-indexed".to_string(), load.to_string()))
            .and_then(|c| c.iops)
    };
    for what in ["reads", "overwrites"] {
        if let (Some(one), Some(four)) = (
            w(&format!("{what}, depth 32")),
            w(&format!("{what}, depth 32, 4 queues")),
        ) {
            out.push(format!(
                "sqcow2 {what} at depth 32 scale with queues (4 queues >= 1): {four:.0} vs {one:.0} IOPS = {:.2}x — {}",
                four / one,
                verdict(four >= one)
            ));
        }
    }
    out
}

/// Replaces the text between the bench-suite markers of `path` (appends
/// a section if there are none).
pub fn replace_section(path: &Path, section: &str) -> anyhow::Result<()> {
    replace_between(path, START, END, section)
}

/// Replaces the text from `start` to `end` (markers included, `section`
/// holding its own) of `path`; appends `section` if the markers are not
/// there.
pub fn replace_between(path: &Path, start: &str, end: &str, section: &str) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let new = match (text.find(start), text.find(end)) {
        (Some(a), Some(b)) if b > a => {
            format!(
                "{}{}{}",
                &text[..a],
                section.trim_end(),
                &text[b + end.len()..]
            )
        }
        _ => format!("{}\n{}", text.trim_end(), section),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![f64::NAN]), None);
        assert_eq!(median(Vec::new()), None);
    }

    fn load(iops: f64, cpu: f64) -> Option<LoadResult> {
        Some(crate::load::tests::sample(iops, Some(cpu)))
    }

    fn run(server: &str, layers: usize, iops: f64, cpu: f64) -> Run {
        Run {
            server: server.into(),
            layers,
            repetition: 0,
            startup_ms: Some(1.0),
            peak_rss_kib: Some(1024),
            rand_read_qd1: load(iops / 10.0, cpu),
            rand_read_qd32: load(iops, cpu),
            seq_read_1m: load(iops, cpu),
            error: None,
        }
    }

    #[test]
    fn sqcow2_is_compared_with_the_best_qemu_configuration_of_each_cell() {
        let results = Results {
            command: "test".into(),
            machine: BTreeMap::new(),
            disk_size: 1 << 30,
            cache_bytes: 32 << 20,
            seconds_per_run: 1.0,
            repetitions: 1,
            lengths: vec![1, 1000],
            runs: vec![
                run("qsd-default", 1, 100.0, 9.0),
                run("qsd-iothread", 1, 300.0, 3.0),
                run("qsd-default", 1000, 10.0, 9.0),
                run("qsd-iothread", 1000, 5.0, 3.0),
                run("sqcow2-indexed", 1, 330.0, 2.0),
                run("sqcow2-indexed", 1000, 320.0, 2.0),
                run("sqcow2-poll", 1, 360.0, 2.5),
            ],
            raw_limit: vec![run("raw-file-io_uring", 0, 1000.0, 0.0)],
            qsd_raw: vec![run("qsd-raw", 0, 400.0, 2.5)],
            spread_limit: vec![
                run("raw-files-io_uring", 1, 1000.0, 1.0),
                run("raw-files-io_uring", 1000, 400.0, 2.0),
            ],
            writes: Vec::new(),
            snapshots: Vec::new(),
            wall_seconds: 1.0,
            qsd_trials: vec![
                crate::results::QsdTrial {
                    program: "/q72/qemu-storage-daemon".into(),
                    version: "qemu-storage-daemon version 7.2.22".into(),
                    run: run("qsd-iothread", 1, 350.0, 3.0),
                    chosen: true,
                },
                crate::results::QsdTrial {
                    program: "qemu-storage-daemon".into(),
                    version: "qemu-storage-daemon version 10.0.2".into(),
                    run: run("qsd-iothread", 1, 250.0, 3.0),
                    chosen: false,
                },
            ],
        };
        let s = Summary::new(&results);
        let (cfg, best) = s.best_qemu(1, |c| c.iops_qd32, false).unwrap();
        assert_eq!((cfg.as_str(), best), ("iothread", 300.0));
        // At 1000 layers the default configuration is the best.
        assert_eq!(
            s.best_qemu(1000, |c| c.iops_qd32, false).unwrap().0,
            "default"
        );
        // Lowest CPU wins for CPU.
        assert_eq!(
            s.best_qemu(1, |c| c.cpu_qd32_us, true).unwrap().0,
            "iothread"
        );
        let md = markdown(&results, &s, Path::new("bench-results"));
        assert!(
            md.contains(
                "`/q72/qemu-storage-daemon` (qemu-storage-daemon version 7.2.22): 35 / 350 IOPS \
                 at depth 1 / 32, 0 MB/s, chosen; `qemu-storage-daemon` (qemu-storage-daemon \
                 version 10.0.2): 25 / 250 IOPS at depth 1 / 32, 0 MB/s."
            ),
            "{md}"
        );
        assert!(
            md.contains("| IOPS, depth 32 | 1.10x (iothread) | 32.00x (default) |"),
            "{md}"
        );
        assert!(
            md.contains("(depth 32, qsd-iothread): 330 vs 300 = 1.10x — met"),
            "{md}"
        );
        assert!(
            md.contains("raw-file export (depth 32): 330 vs 400 = 0.82 — MISSED"),
            "{md}"
        );
        assert!(
            md.contains("<= the best qemu-storage-daemon's (qsd-iothread): 2.0 vs 3.0 µs — met"),
            "{md}"
        );
        // The kernel's own ratio at 1000 files, and sqcow2's against it.
        assert!(
            md.contains("| 1000 | 40 | 400 | 2.0 | 0.40 | 0.40 |"),
            "{md}"
        );
        assert!(
            md.contains("the same bytes in 1000 raw files against 1 (depth 32): 0.40; sqcow2-indexed's ratio over the kernel's: 2.42"),
            "{md}"
        );
    }

    #[test]
    fn section_is_replaced_between_markers_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("README.md");
        std::fs::write(&p, format!("intro\n{START}\nold\n{END}\ntail\n")).unwrap();
        replace_section(&p, &format!("{START}\nnew\n{END}\n")).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("intro\n{START}\nnew\n{END}\ntail\n")
        );
    }
}
