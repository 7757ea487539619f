//! Medians, ratios, goals and the README section of a suite run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;

use crate::load::LoadResult;
use crate::suite::{Results, Run};

const START: &str = "<!-- bench-suite:start -->";
const END: &str = "<!-- bench-suite:end -->";

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
        Summary {
            servers,
            lengths: results.lengths.clone(),
            cells,
            raw: cell(&raw),
        }
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

/// The README section of a run.
pub fn markdown(results: &Results, s: &Summary, out_dir: &Path) -> String {
    let mut md = String::new();
    let m = &results.machine;
    let dir = out_dir
        .file_name()
        .map(|d| d.to_string_lossy().into_owned())
        .unwrap_or_else(|| "bench-results".into());
    let _ = writeln!(md, "{START}");
    let _ = writeln!(
        md,
        "Produced by `{}` in {:.0} s. Machine: {} ({} cores, {}), kernel {}, {}. \
         Chains from `gen-chain` (64 KiB clusters, half the clusters written, spread over the layers), \
         disk {} MiB, served read-only over vhost-user-blk to a libblkio client (1 queue); \
         each load runs {:.1} s; medians of {} repetitions; sqcow2 cache budget {} MiB \
         (qsd-budget: the same budget split over the layers, 4 KiB cache entries). \
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
        "\n**sqcow2-indexed vs qsd-default** (ratios of the medians above):\n"
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
    let ratios: [(&str, CellMetric); 4] = [
        ("IOPS, depth 1", |c| c.iops_qd1),
        ("IOPS, depth 32", |c| c.iops_qd32),
        ("sequential MB/s", |c| c.seq_mb_s),
        ("peak RSS", |c| c.rss_mib),
    ];
    for (name, f) in ratios {
        let _ = write!(md, "| {name} |");
        for &l in &s.lengths {
            let r = match (
                s.get("sqcow2-indexed", l).and_then(f),
                s.get("qsd-default", l).and_then(f),
            ) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
                _ => "-".into(),
            };
            let _ = write!(md, " {r} |");
        }
        md.push('\n');
    }
    let _ = writeln!(
        md,
        "\n**Physical limit** (the same amount of data in one raw file, read by libblkio's io_uring driver on the host): \
         {} IOPS at depth 1, {} IOPS at depth 32, {} MB/s sequential.",
        fmt(s.raw.iops_qd1, 0),
        fmt(s.raw.iops_qd32, 0),
        fmt(s.raw.seq_mb_s, 0)
    );
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
    let errors: Vec<String> = s
        .cells
        .iter()
        .flat_map(|((srv, l), c)| {
            c.errors
                .iter()
                .map(move |e| format!("{srv} at {l} layers: {e}"))
        })
        .collect();
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
        "\n![Random-read IOPS vs chain length]({dir}/iops.png)\n![Peak RSS vs chain length]({dir}/rss.png)\n![QD1 latency CDF at the longest chain]({dir}/latency-cdf.png)\n\n(SVG versions next to the PNGs.)"
    );
    let _ = writeln!(md, "{END}");
    md
}

fn goals(s: &Summary) -> Vec<String> {
    let mut out = Vec::new();
    let (Some(&first), Some(&last)) = (s.lengths.first(), s.lengths.last()) else {
        return out;
    };
    let idx = |l| s.get("sqcow2-indexed", l);
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    for (name, f) in [
        (
            "depth 1",
            (|c: &Cell| c.iops_qd1) as fn(&Cell) -> Option<f64>,
        ),
        ("depth 32", |c: &Cell| c.iops_qd32),
    ] {
        if let (Some(a), Some(b)) = (idx(last).and_then(f), idx(first).and_then(f)) {
            let r = a / b;
            out.push(format!(
                "indexed random-read IOPS at {last} layers >= 0.95 x at {first} ({name}): {a:.0} / {b:.0} = {r:.2} — {}",
                verdict(r >= 0.95)
            ));
        }
        if let (Some(a), Some(b)) = (
            idx(first).and_then(f),
            s.get("qsd-default", first).and_then(f),
        ) {
            let r = a / b;
            out.push(format!(
                "indexed IOPS at {first} layer(s) >= qemu-storage-daemon's ({name}): {a:.0} vs {b:.0} = {r:.2}x — {}",
                verdict(r >= 1.0)
            ));
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
    }
    out
}

/// Replaces the text between the bench-suite markers of `path` (appends
/// a section if there are none).
pub fn replace_section(path: &Path, section: &str) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let new = match (text.find(START), text.find(END)) {
        (Some(a), Some(b)) if b > a => {
            format!(
                "{}{}{}",
                &text[..a],
                section.trim_end(),
                &text[b + END.len()..]
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
