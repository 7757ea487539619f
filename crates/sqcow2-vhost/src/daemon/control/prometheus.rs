//! [`Stats`] in the OpenMetrics text format (metrics `sqcow2_*`), through
//! the `prometheus-client` crate: counters end in `_total`, sizes and
//! times carry their unit (`_bytes`, `_seconds`), latencies are
//! histograms.

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use super::protocol::{IndexMode, Stats, LATENCY_BUCKETS_US};

/// A value taken from one [`Stats`], as a counter or a gauge.
#[derive(Debug)]
enum Value {
    Counter(u64),
    /// A counter of seconds.
    Seconds(f64),
    Gauge(f64),
}

impl EncodeMetric for Value {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        match self {
            Value::Counter(v) => encoder.encode_counter::<NoLabelSet, _, u64>(v, None),
            Value::Seconds(v) => encoder.encode_counter::<NoLabelSet, _, f64>(v, None),
            Value::Gauge(v) => encoder.encode_gauge(v),
        }
    }

    fn metric_type(&self) -> MetricType {
        match self {
            Value::Counter(_) | Value::Seconds(_) => MetricType::Counter,
            Value::Gauge(_) => MetricType::Gauge,
        }
    }
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

/// The labels of a sample: the export's (when the daemon serves
/// several), the queue's (per-queue metrics).
type Labels = Vec<(String, String)>;

/// One metric family: a sample per label set.
#[derive(Debug)]
struct Family<M>(Vec<(Labels, M)>);

impl<M: EncodeMetric> EncodeMetric for Family<M> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, metric) in &self.0 {
            metric.encode(encoder.encode_family(labels)?)?;
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

/// The stats of each export, with its labels.
struct Exports<'a>(Vec<(Labels, &'a Stats)>);

impl Exports<'_> {
    /// One sample per export.
    fn each<M>(&self, f: impl Fn(&Stats) -> M) -> Family<M> {
        Family(self.0.iter().map(|(l, s)| (l.clone(), f(s))).collect())
    }

    /// One sample per queue of each export.
    fn per_queue<M>(&self, f: impl Fn(&super::protocol::QueueCounters) -> M) -> Family<M> {
        Family(
            self.0
                .iter()
                .flat_map(|(l, s)| {
                    s.queues.iter().map(|q| {
                        let mut labels = l.clone();
                        labels.push(("queue".into(), q.queue.to_string()));
                        (labels, f(q))
                    })
                })
                .collect(),
        )
    }
}

/// The stats in the OpenMetrics text format.
pub fn render(s: &Stats) -> String {
    render_families(&Exports(vec![(Vec::new(), s)]))
}

/// The stats of several exports in the OpenMetrics text format, each
/// sample labelled `export="ID"`.
pub fn render_exports(stats: &[(String, Stats)]) -> String {
    render_families(&Exports(
        stats
            .iter()
            .map(|(id, s)| (vec![("export".to_owned(), id.clone())], s))
            .collect(),
    ))
}

fn render_families(e: &Exports<'_>) -> String {
    let mut r = Registry::with_prefix("sqcow2");
    let gauge = |f: fn(&Stats) -> f64| e.each(move |s| Value::Gauge(f(s)));
    let flag = |f: fn(&Stats) -> bool| e.each(move |s| Value::Gauge(f64::from(u8::from(f(s)))));
    let counter = |f: fn(&Stats) -> u64| e.each(move |s| Value::Counter(f(s)));
    r.register_with_unit(
        "uptime",
        "Time since the daemon started",
        Unit::Seconds,
        gauge(|s| s.uptime_s),
    );
    r.register(
        "layers",
        "Layers of the served chain",
        gauge(|s| s.layers as f64),
    );
    r.register(
        "indexed",
        "1 when lookups use the chain index",
        flag(|s| s.index_mode == IndexMode::Indexed),
    );
    r.register(
        "index_pending_layers",
        "Layers walked above the chain index until the top's own index is built",
        gauge(|s| s.index.pending_layers as f64),
    );
    r.register(
        "index_building",
        "1 while a background index build runs",
        flag(|s| s.index.building),
    );
    r.register(
        "index_builds",
        "Background index builds completed",
        counter(|s| s.index.builds),
    );
    r.register(
        "index_build_failures",
        "Background index builds that failed",
        counter(|s| s.index.failures),
    );
    type Counter = fn(&Stats) -> u64;
    let cache_counters: [(&str, &str, Counter); 5] = [
        (
            "cache_hits",
            "Metadata lookups served from the unified cache",
            |s| s.cache.hits,
        ),
        (
            "cache_misses",
            "Metadata lookups not in the unified cache",
            |s| s.cache.misses,
        ),
        ("cache_loads", "Metadata slices read from the files", |s| {
            s.cache.loads
        }),
        (
            "cache_hit_unallocated",
            "Cached entries that sent a walk further down",
            |s| s.cache.hit_unallocated,
        ),
        (
            "cache_evictions",
            "Slices evicted from the unified cache",
            |s| s.cache.evictions,
        ),
    ];
    for (name, help, value) in cache_counters {
        r.register(name, help, counter(value));
    }
    r.register_with_unit(
        "cache",
        "Bytes the unified metadata cache holds",
        Unit::Bytes,
        gauge(|s| s.cache.bytes as f64),
    );
    r.register(
        "requests_in_flight",
        "Requests started and not yet completed",
        gauge(|s| s.requests_in_flight as f64),
    );
    r.register(
        "worker_panics",
        "Panics caught in queue workers and engine threads (bugs; their requests failed)",
        counter(|s| s.worker_panics),
    );
    r.register(
        "writes_refused",
        "1 when the chain refuses writes until it is reopened (after an internal error)",
        flag(|s| s.write_failure.is_some()),
    );
    r.register_with_unit(
        "snapshot_pause",
        "Guest-visible pause of each live snapshot",
        Unit::Seconds,
        e.each(|s| Histogram {
            sum_s: s.snapshots.pause_ms_sum / 1000.0,
            count: s.snapshots.count,
            cumulative: s.snapshots.pause_buckets.clone(),
        }),
    );
    r.register(
        "queue_requests",
        "Requests completed",
        e.per_queue(|q| Value::Counter(q.requests)),
    );
    r.register_with_unit(
        "queue_read",
        "Bytes read by the guest",
        Unit::Bytes,
        e.per_queue(|q| Value::Counter(q.read_bytes)),
    );
    r.register_with_unit(
        "queue_written",
        "Bytes written by the guest",
        Unit::Bytes,
        e.per_queue(|q| Value::Counter(q.write_bytes)),
    );
    r.register(
        "queue_errors",
        "Requests completed with an error status",
        e.per_queue(|q| Value::Counter(q.errors)),
    );
    r.register_with_unit(
        "queue_request_duration",
        "Time from a request's start to its completion",
        Unit::Seconds,
        e.per_queue(|q| Histogram {
            sum_s: q.latency_us_sum as f64 / 1e6,
            count: q.latency_us_count,
            cumulative: q.latency_us_buckets.clone(),
        }),
    );
    r.register(
        "throttled_requests",
        "Requests that waited for the export's I/O limits",
        counter(|s| s.throttle.as_ref().map_or(0, |t| t.throttled)),
    );
    r.register_with_unit(
        "throttled",
        "Time requests waited for the export's I/O limits",
        Unit::Seconds,
        e.each(|s| Value::Seconds(s.throttle.as_ref().map_or(0.0, |t| t.throttled_seconds))),
    );
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &r);
    out
}
