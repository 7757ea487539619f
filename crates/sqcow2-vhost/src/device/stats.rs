//! Per-queue request statistics.

use std::time::Instant;

use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;

use crate::device::request::{Request, RequestKind};

/// Upper bounds of the latency buckets, microseconds (Prometheus
/// histograms: `le` in seconds). A bucket counts what is at most its
/// bound; the count of all is the `+Inf` bucket.
pub const LATENCY_BUCKETS_US: [u64; 14] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
    5_000_000,
];

/// Counters and latencies of one queue.
#[derive(Debug, Clone)]
pub struct QueueStats {
    /// Requests completed (rejected ones included).
    pub requests: u64,
    /// Bytes read by the guest.
    pub read_bytes: u64,
    /// Bytes written by the guest.
    pub write_bytes: u64,
    /// Requests completed with an error status.
    pub errors: u64,
    /// Latency from start to completion, microseconds.
    pub latency_us: hdrhistogram::Histogram<u64>,
    /// The sum of those latencies, microseconds.
    pub latency_us_sum: u64,
    /// Requests per latency bucket ([`LATENCY_BUCKETS_US`], then one
    /// past the last bound), not cumulative.
    pub latency_buckets: [u64; LATENCY_BUCKETS_US.len() + 1],
}

impl QueueStats {
    /// Requests whose latency was measured.
    pub fn measured(&self) -> u64 {
        self.latency_buckets.iter().sum()
    }

    /// Requests at most each bound of [`LATENCY_BUCKETS_US`].
    pub fn cumulative_buckets(&self) -> Vec<u64> {
        self.latency_buckets[..LATENCY_BUCKETS_US.len()]
            .iter()
            .scan(0, |sum, n| {
                *sum += n;
                Some(*sum)
            })
            .collect()
    }
}

impl Default for QueueStats {
    fn default() -> Self {
        QueueStats {
            requests: 0,
            read_bytes: 0,
            write_bytes: 0,
            errors: 0,
            latency_us_sum: 0,
            latency_buckets: [0; LATENCY_BUCKETS_US.len() + 1],
            // Two significant digits, auto-resizing: bounded and cheap.
            latency_us: hdrhistogram::Histogram::new(2).unwrap_or_else(|_| {
                hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 2)
                    .expect("valid histogram bounds")
            }),
        }
    }
}

/// The statistics of a worker's queues, by worker-local queue index.
#[derive(Debug, Default)]
pub(crate) struct WorkerStats {
    queues: Vec<QueueStats>,
    /// The time of the current round (the requests taken off a queue in
    /// one call, or the completions handled in one call), read at its
    /// first use: the clock is read once per round, not twice per request.
    round_time: Option<Instant>,
}

impl WorkerStats {
    /// Starts a new round: the next [`WorkerStats::now`] reads the clock.
    pub(crate) fn next_round(&mut self) {
        self.round_time = None;
    }

    /// The time of the current round.
    pub(crate) fn now(&mut self) -> Instant {
        *self.round_time.get_or_insert_with(Instant::now)
    }

    fn queue(&mut self, queue: usize) -> &mut QueueStats {
        if self.queues.len() <= queue {
            self.queues.resize_with(queue + 1, QueueStats::default);
        }
        &mut self.queues[queue]
    }

    /// Counts a finished request with virtio status `code`.
    pub(crate) fn account(&mut self, queue: usize, req: &Request, code: u32, started: Instant) {
        let now = self.now();
        let st = self.queue(queue);
        st.requests += 1;
        if code != VIRTIO_BLK_S_OK {
            st.errors += 1;
        } else {
            match &req.kind {
                RequestKind::In { len, .. } => st.read_bytes += len,
                RequestKind::Out { len, .. } => st.write_bytes += len,
                _ => {}
            }
        }
        let us = now
            .saturating_duration_since(started)
            .as_micros()
            .min(u128::from(u64::MAX)) as u64;
        let _ = st.latency_us.record(us.max(1));
        st.latency_us_sum = st.latency_us_sum.saturating_add(us);
        st.latency_buckets[LATENCY_BUCKETS_US.partition_point(|&b| b < us)] += 1;
    }

    /// Counts a request rejected before it started.
    pub(crate) fn account_rejected(&mut self, queue: usize) {
        let st = self.queue(queue);
        st.requests += 1;
        st.errors += 1;
    }

    pub(crate) fn queues(&self) -> &[QueueStats] {
        &self.queues
    }
}
