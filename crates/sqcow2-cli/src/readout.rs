//! A running daemon's replies written for a person (`--output human`):
//! sentences with units, times rounded to what can be measured.

use std::fmt::Write;
use std::path::Path;

use sqcow2_vhost::protocol::{
    Activity, ExportInfo, IndexMode, Info, MergeCounters, MergeState, SnapshotResult, Stats,
};

use crate::output::human_size;

/// Milliseconds as a person reads them.
fn ms(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0} ms")
    } else {
        format!("{value:.2} ms")
    }
}

/// Microseconds, in the unit that fits.
fn us(value: u64) -> String {
    if value >= 10_000 {
        ms(value as f64 / 1000.0)
    } else {
        format!("{value} µs")
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn name(p: &Path) -> String {
    p.display().to_string()
}

/// `snapshot --live`.
pub fn snapshot(r: &SnapshotResult) -> String {
    let s = &r.steps;
    format!(
        "{} is the new top: {} layers, {}\n\
         guest paused {} (drain {}, switch {}{}); prepared before in {}, old top closed after in {}\n",
        name(&r.path),
        r.layers,
        if r.indexed { "indexed" } else { "walked" },
        ms(r.pause_ms),
        ms(s.drain_ms),
        ms(s.switch_ms),
        if s.realtime { ", real-time" } else { "" },
        ms(s.prepare_ms),
        ms(s.close_ms),
    )
}

/// `activate` / `inactivate`.
pub fn activity(r: &Activity) -> String {
    if r.active {
        "active: the daemon holds the image locks and serves\n".into()
    } else {
        "inactive: the image locks are released; requests wait\n".into()
    }
}

/// `export list` / `export add`: one line per export.
pub fn exports(exports: &[ExportInfo]) -> String {
    let mut out = String::new();
    for e in exports {
        let _ = writeln!(
            out,
            "{}: {} ({} layers{}) on {}, {}",
            e.id,
            name(&e.image),
            e.layers,
            if e.read_only { ", read-only" } else { "" },
            e.socket
                .as_deref()
                .map(name)
                .unwrap_or_else(|| "no socket".into()),
            if e.frontend_connected {
                let threads: Vec<String> =
                    e.worker_threads.iter().map(ToString::to_string).collect();
                format!(
                    "a frontend connected (worker threads {})",
                    threads.join(", ")
                )
            } else {
                "no frontend".into()
            }
        );
    }
    if exports.is_empty() {
        out.push_str("no exports\n");
    }
    out
}

/// `info --live`.
pub fn info(r: &Info) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "top: {}", name(&r.top));
    let _ = writeln!(
        out,
        "virtual size: {} ({} bytes)",
        human_size(r.virtual_size),
        r.virtual_size
    );
    let _ = writeln!(out, "layers: {}", r.layers);
    for (i, p) in r.chain.iter().enumerate().rev() {
        let _ = writeln!(out, "  {i}: {}", name(p));
    }
    let _ = match &r.walking_because {
        None if r.indexed => writeln!(out, "lookups: through the chain index"),
        None => writeln!(out, "lookups: walking the layers"),
        Some(why) => writeln!(out, "lookups: walking the layers, because {why}"),
    };
    let _ = writeln!(out, "writable: {}", yes(r.writable));
    let _ = writeln!(out, "active: {}", yes(r.active));
    let _ = writeln!(out, "frontend connected: {}", yes(r.frontend_connected));
    if let Some(why) = &r.write_failure {
        let _ = writeln!(out, "writes refused: {why}");
    }
    out
}

/// The state of a live merge in one line.
pub fn merge(m: &MergeCounters) -> String {
    let path = m.path.as_deref().map(name).unwrap_or_default();
    let layers = format!("layers {}..{}", m.first, m.last);
    match m.state {
        MergeState::Idle => "merge: none has run\n".into(),
        MergeState::Measuring => {
            format!("merge: {layers} into {path}, measuring the guest's latency\n")
        }
        MergeState::Copying | MergeState::Switching => format!(
            "merge: {layers} into {path}, {} of {} looked at ({} written) in {}{}\n",
            human_size(m.done_bytes),
            human_size(m.total_bytes),
            human_size(m.written_bytes),
            ms(m.elapsed_ms),
            if m.state == MergeState::Switching {
                ", switching"
            } else {
                ""
            },
        ),
        MergeState::Done => format!(
            "merge: {layers} into {path} done in {} (pause {}), {} layers now\n",
            ms(m.elapsed_ms),
            ms(m.pause_ms),
            m.layers_after
        ),
        MergeState::Cancelled => format!("merge: {layers} into {path} cancelled\n"),
        MergeState::Failed => format!(
            "merge: {layers} into {path} failed: {}\n",
            m.error.as_deref().unwrap_or("unknown")
        ),
    }
}

/// `stats`.
pub fn stats(s: &Stats) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "uptime: {:.1} s; {}; {} layers, {}; {} requests in flight",
        s.uptime_s,
        if s.active { "active" } else { "inactive" },
        s.layers,
        match s.index_mode {
            IndexMode::Indexed => "lookups through the chain index",
            IndexMode::Walk => "lookups walking the layers",
        },
        s.requests_in_flight
    );
    if s.queues.is_empty() {
        let _ = writeln!(out, "queues: no frontend connected");
    }
    for q in &s.queues {
        let _ = writeln!(
            out,
            "queue {}: {} requests ({} read, {} written, {} errors); latency p50 {}, p99 {}, max {}",
            q.queue,
            q.requests,
            human_size(q.read_bytes),
            human_size(q.write_bytes),
            q.errors,
            us(q.latency_us_p50),
            us(q.latency_us_p99),
            us(q.latency_us_max)
        );
    }
    let c = &s.cache;
    let lookups = c.hits + c.misses;
    let _ = writeln!(
        out,
        "cache: {} held; {} hits of {} lookups ({:.1} %), {} loads, {} evictions",
        human_size(c.bytes),
        c.hits,
        lookups,
        if lookups == 0 {
            0.0
        } else {
            c.hits as f64 * 100.0 / lookups as f64
        },
        c.loads,
        c.evictions
    );
    let ix = &s.index;
    let _ = write!(
        out,
        "index: {} layers pending; {} builds (last {}), {} failed{}",
        ix.pending_layers,
        ix.builds,
        ms(ix.last_build_ms),
        ix.failures,
        if ix.building { "; building now" } else { "" }
    );
    if let Some(e) = &ix.last_error {
        let _ = write!(out, "; last failure: {e}");
    }
    if let Some(why) = &ix.walking_because {
        let _ = write!(out, "; walking because {why}");
    }
    out.push('\n');
    let sn = &s.snapshots;
    let _ = writeln!(
        out,
        "live snapshots: {}; pause p50 {}, p99 {}, max {}",
        sn.count,
        ms(sn.pause_ms_p50),
        ms(sn.pause_ms_p99),
        ms(sn.pause_ms_max)
    );
    out.push_str(&merge(&s.merge));
    if s.worker_panics > 0 {
        let _ = writeln!(
            out,
            "worker panics: {} (a bug: writes refused since)",
            s.worker_panics
        );
    }
    if let Some(why) = &s.write_failure {
        let _ = writeln!(out, "writes refused: {why}");
    }
    out
}
