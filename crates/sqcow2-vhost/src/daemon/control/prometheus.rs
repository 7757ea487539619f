//! [`Stats`] in the OpenMetrics text format (metrics `sqcow2_*`), through
//! the `prometheus-client` crate: counters end in `_total`, sizes and
//! times carry their unit (`_bytes`, `_seconds`), latencies are
//! histograms.

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use super::protocol::{IndexMode, Stats, LATENCY_BUCKETS_US};

/// A value taken from one [`Stats`], as a counter or a gauge.
#[derive(Debug)]
enum Value {
    Counter(u64),
    Gauge(f64),
}

impl EncodeMetric for Value {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        match self {
            Value::Counter(v) => encoder.encode_counter::<NoLabelSet, _, u64>(v, None),
            Value::Gauge(v) => encoder.encode_gauge(v),
        }
    }

    fn metric_type(&self) -> MetricType {
        match self {
            Value::Counter(_) => MetricType::Counter,
            Value::Gauge(_) => MetricType::Gauge,
        }
    }
}

/// The label of a per-queue sample.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct QueueLabel {
    queue: String,
}

/// A histogram's sum (seconds), count and cumulative bucket counts (for
/// [`LATENCY_BUCKETS_US`]).
#[derive(Debug)]
struct Histogram {
    sum_s: f64,
    count: u64,
    cumulative: Vec<u64>,
}

impl Histogram {
    /// Each bucket's own count (the encoder makes them cumulative), the
    /// last one unbounded.
    fn buckets(&self) -> Vec<(f64, u64)> {
        let mut below = 0;
        let mut out: Vec<(f64, u64)> = LATENCY_BUCKETS_US
            .iter()
            .zip(&self.cumulative)
            .map(|(&b, &n)| {
                let own = n.saturating_sub(below);
                below = n;
                (b as f64 / 1e6, own)
            })
            .collect();
        out.push((f64::INFINITY, self.count.saturating_sub(below)));
        out
    }
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(self.sum_s, self.count, &self.buckets(), None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// One metric per queue.
#[derive(Debug)]
struct PerQueue<M>(Vec<(QueueLabel, M)>);

impl<M: EncodeMetric> EncodeMetric for PerQueue<M> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (label, metric) in &self.0 {
            metric.encode(encoder.encode_family(label)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        self.0
            .first()
            .map_or(MetricType::Counter, |(_, m)| m.metric_type())
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn per_queue<M>(s: &Stats, f: impl Fn(&super::protocol::QueueCounters) -> M) -> PerQueue<M> {
    PerQueue(
        s.queues
            .iter()
            .map(|q| {
                (
                    QueueLabel {
                        queue: q.queue.to_string(),
                    },
                    f(q),
                )
            })
            .collect(),
    )
}

/// The stats in the OpenMetrics text format.
pub fn render(s: &Stats) -> String {
    let mut r = Registry::with_prefix("sqcow2");
    let gauge = |v: f64| Value::Gauge(v);
    let flag = |b: bool| Value::Gauge(f64::from(u8::from(b)));
    r.register_with_unit(
        "uptime",
        "Time since the daemon started",
        Unit::Seconds,
        gauge(s.uptime_s),
    );
    r.register(
        "layers",
        "Layers of the served chain",
        gauge(s.layers as f64),
    );
    r.register(
        "indexed",
        "1 when lookups use the chain index",
        flag(s.index_mode == IndexMode::Indexed),
    );
    let ix = &s.index;
    r.register(
        "index_pending_layers",
        "Layers walked above the chain index until the top's own index is built",
        gauge(ix.pending_layers as f64),
    );
    r.register(
        "index_building",
        "1 while a background index build runs",
        flag(ix.building),
    );
    r.register(
        "index_builds",
        "Background index builds completed",
        Value::Counter(ix.builds),
    );
    r.register(
        "index_build_failures",
        "Background index builds that failed",
        Value::Counter(ix.failures),
    );
    let c = &s.cache;
    for (name, help, value) in [
        (
            "cache_hits",
            "Metadata lookups served from the unified cache",
            c.hits,
        ),
        (
            "cache_misses",
            "Metadata lookups not in the unified cache",
            c.misses,
        ),
        (
            "cache_loads",
            "Metadata slices read from the files",
            c.loads,
        ),
        (
            "cache_hit_unallocated",
            "Cached entries that sent a walk further down",
            c.hit_unallocated,
        ),
        (
            "cache_evictions",
            "Slices evicted from the unified cache",
            c.evictions,
        ),
    ] {
        r.register(name, help, Value::Counter(value));
    }
    r.register_with_unit(
        "cache",
        "Bytes the unified metadata cache holds",
        Unit::Bytes,
        gauge(c.bytes as f64),
    );
    r.register(
        "requests_in_flight",
        "Requests started and not yet completed",
        gauge(s.requests_in_flight as f64),
    );
    r.register(
        "worker_panics",
        "Panics caught in queue workers and engine threads (bugs; their requests failed)",
        Value::Counter(s.worker_panics),
    );
    r.register(
        "writes_refused",
        "1 when the chain refuses writes until it is reopened (after an internal error)",
        flag(s.write_failure.is_some()),
    );
    let sn = &s.snapshots;
    r.register_with_unit(
        "snapshot_pause",
        "Guest-visible pause of each live snapshot",
        Unit::Seconds,
        Histogram {
            sum_s: sn.pause_ms_sum / 1000.0,
            count: sn.count,
            cumulative: sn.pause_buckets.clone(),
        },
    );
    r.register(
        "queue_requests",
        "Requests completed",
        per_queue(s, |q| Value::Counter(q.requests)),
    );
    r.register_with_unit(
        "queue_read",
        "Bytes read by the guest",
        Unit::Bytes,
        per_queue(s, |q| Value::Counter(q.read_bytes)),
    );
    r.register_with_unit(
        "queue_written",
        "Bytes written by the guest",
        Unit::Bytes,
        per_queue(s, |q| Value::Counter(q.write_bytes)),
    );
    r.register(
        "queue_errors",
        "Requests completed with an error status",
        per_queue(s, |q| Value::Counter(q.errors)),
    );
    r.register_with_unit(
        "queue_request_duration",
        "Time from a request's start to its completion",
        Unit::Seconds,
        per_queue(s, |q| Histogram {
            sum_s: q.latency_us_sum as f64 / 1e6,
            count: q.latency_us_count,
            cumulative: q.latency_us_buckets.clone(),
        }),
    );
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &r);
    out
}
