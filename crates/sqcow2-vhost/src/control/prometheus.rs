//! [`Stats`] in Prometheus' text exposition format (metrics `sqcow2_*`).

use std::fmt::Write;

use super::protocol::{IndexMode, Stats};

struct Metrics {
    out: String,
}

impl Metrics {
    fn metric(&mut self, name: &str, help: &str, kind: &str, samples: &[(String, f64)]) {
        let _ = writeln!(self.out, "# HELP sqcow2_{name} {help}");
        let _ = writeln!(self.out, "# TYPE sqcow2_{name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(self.out, "sqcow2_{name}{labels} {v}");
        }
    }

    fn one(&mut self, name: &str, help: &str, kind: &str, value: f64) {
        self.metric(name, help, kind, &[(String::new(), value)]);
    }
}

/// The stats in Prometheus' text format.
pub fn render(s: &Stats) -> String {
    let mut m = Metrics { out: String::new() };
    m.one(
        "uptime_seconds",
        "Seconds since the daemon started.",
        "gauge",
        s.uptime_s,
    );
    m.one(
        "layers",
        "Layers of the served chain.",
        "gauge",
        s.layers as f64,
    );
    m.one(
        "indexed",
        "1 when lookups use the chain index.",
        "gauge",
        f64::from(u8::from(s.index_mode == IndexMode::Indexed)),
    );
    let ix = &s.index;
    for (key, help, kind, value) in [
        (
            "index_pending_layers",
            "Layers walked above the chain index until the top's own index is built.",
            "gauge",
            ix.pending_layers as f64,
        ),
        (
            "index_building",
            "1 while a background index build runs.",
            "gauge",
            f64::from(u8::from(ix.building)),
        ),
        (
            "index_builds_total",
            "Background index builds completed.",
            "counter",
            ix.builds as f64,
        ),
        (
            "index_build_failures_total",
            "Background index builds that failed.",
            "counter",
            ix.failures as f64,
        ),
    ] {
        m.one(key, help, kind, value);
    }
    let c = &s.cache;
    for (key, kind, value) in [
        ("hits", "counter", c.hits),
        ("misses", "counter", c.misses),
        ("loads", "counter", c.loads),
        ("hit_unallocated", "counter", c.hit_unallocated),
        ("evictions", "counter", c.evictions),
        ("bytes", "gauge", c.bytes),
    ] {
        m.one(
            &format!("cache_{key}"),
            &format!("Unified metadata cache: {key}."),
            kind,
            value as f64,
        );
    }
    m.one(
        "requests_in_flight",
        "Requests started and not yet completed.",
        "gauge",
        s.requests_in_flight as f64,
    );
    m.one(
        "worker_panics_total",
        "Panics caught in queue workers and engine threads (bugs; their requests failed).",
        "counter",
        s.worker_panics as f64,
    );
    m.one(
        "writes_refused",
        "1 when the chain refuses writes until it is reopened (after an internal error).",
        "gauge",
        f64::from(u8::from(s.write_failure.is_some())),
    );
    let snaps = &s.snapshots;
    m.one(
        "snapshots_total",
        "Live snapshots taken.",
        "counter",
        snaps.count as f64,
    );
    m.metric(
        "snapshot_pause_milliseconds",
        "Guest-visible pause of live snapshots.",
        "gauge",
        &[
            ("{quantile=\"0.5\"}".into(), snaps.pause_ms_p50),
            ("{quantile=\"0.99\"}".into(), snaps.pause_ms_p99),
            ("{quantile=\"1\"}".into(), snaps.pause_ms_max),
        ],
    );
    type Field = fn(&super::protocol::QueueCounters) -> u64;
    let counters: [(&str, &str, Field); 4] = [
        ("requests", "Requests completed.", |q| q.requests),
        ("read_bytes", "Bytes read by the guest.", |q| q.read_bytes),
        ("write_bytes", "Bytes written by the guest.", |q| {
            q.write_bytes
        }),
        ("errors", "Requests completed with an error status.", |q| {
            q.errors
        }),
    ];
    for (key, help, field) in counters {
        let samples: Vec<(String, f64)> = s
            .queues
            .iter()
            .map(|q| (format!("{{queue=\"{}\"}}", q.queue), field(q) as f64))
            .collect();
        m.metric(&format!("queue_{key}_total"), help, "counter", &samples);
    }
    let latencies: [(&str, &str, Field); 2] = [
        ("latency_us_p50", "0.5", |q| q.latency_us_p50),
        ("latency_us_p99", "0.99", |q| q.latency_us_p99),
    ];
    for (key, quantile, field) in latencies {
        let samples: Vec<(String, f64)> = s
            .queues
            .iter()
            .map(|q| {
                (
                    format!("{{queue=\"{}\",quantile=\"{quantile}\"}}", q.queue),
                    field(q) as f64,
                )
            })
            .collect();
        m.metric(
            &format!("queue_{key}"),
            "Request latency in microseconds.",
            "gauge",
            &samples,
        );
    }
    m.out
}
