//! I/O limits, as QEMU's throttle groups set them (`iops-total`,
//! `bps-read-max`, ... `group=NAME`): each limit a leaky bucket that
//! leaks at its average rate and holds a burst (its `-max` for
//! `-max-length` seconds, or a tenth of a second at the average when no
//! burst is given). A request may start while every bucket it fills is
//! under its size; it is then counted (its bytes, or one operation, or
//! its bytes over `iops-size`). One that may not start waits (a queue
//! worker parks it): it is never failed. Exports of one named group share
//! its buckets.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The largest value a limit takes (QEMU's `THROTTLE_VALUE_MAX`).
const VALUE_MAX: u64 = 1_000_000_000_000_000;
/// The longest burst, in seconds (QEMU's bound: a day).
const MAX_BURST_SECONDS: u64 = 86_400;

/// The limits of an export or group, by QEMU's option names (0 or absent:
/// no limit).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct IoLimits {
    /// Operations per second, reads and writes together.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_total: u64,
    /// Burst of `iops-total`, per second, for `iops-total-max-length` s.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_total_max: u64,
    /// Seconds a burst at `iops-total-max` may last (default 1).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_total_max_length: u64,
    /// Reads per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_read: u64,
    /// Burst of `iops-read`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_read_max: u64,
    /// Seconds of an `iops-read-max` burst.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_read_max_length: u64,
    /// Writes (and discards, write-zeroes) per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_write: u64,
    /// Burst of `iops-write`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_write_max: u64,
    /// Seconds of an `iops-write-max` burst.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_write_max_length: u64,
    /// Bytes per second, read and written together.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_total: u64,
    /// Burst of `bps-total`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_total_max: u64,
    /// Seconds of a `bps-total-max` burst.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_total_max_length: u64,
    /// Bytes read per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_read: u64,
    /// Burst of `bps-read`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_read_max: u64,
    /// Seconds of a `bps-read-max` burst.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_read_max_length: u64,
    /// Bytes written per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_write: u64,
    /// Burst of `bps-write`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_write_max: u64,
    /// Seconds of a `bps-write-max` burst.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_write_max_length: u64,
    /// A request larger than this counts as its size over it in
    /// operations (0: one operation each).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_size: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The option names [`IoLimits`] takes, as `--export` keys too.
pub const LIMIT_KEYS: [&str; 19] = [
    "iops-total",
    "iops-total-max",
    "iops-total-max-length",
    "iops-read",
    "iops-read-max",
    "iops-read-max-length",
    "iops-write",
    "iops-write-max",
    "iops-write-max-length",
    "bps-total",
    "bps-total-max",
    "bps-total-max-length",
    "bps-read",
    "bps-read-max",
    "bps-read-max-length",
    "bps-write",
    "bps-write-max",
    "bps-write-max-length",
    "iops-size",
];

/// One limit: average, burst, burst length.
#[derive(Debug, Clone, Copy)]
struct Limit {
    avg: u64,
    max: u64,
    length: u64,
}

impl IoLimits {
    /// Whether no limit is set.
    pub fn is_unlimited(&self) -> bool {
        self.limits().iter().all(|(_, l)| l.avg == 0)
    }

    /// The six limits, by kind.
    fn limits(&self) -> [(Kind, Limit); 6] {
        let l = |avg, max, length| Limit { avg, max, length };
        [
            (
                Kind::IopsTotal,
                l(
                    self.iops_total,
                    self.iops_total_max,
                    self.iops_total_max_length,
                ),
            ),
            (
                Kind::IopsRead,
                l(
                    self.iops_read,
                    self.iops_read_max,
                    self.iops_read_max_length,
                ),
            ),
            (
                Kind::IopsWrite,
                l(
                    self.iops_write,
                    self.iops_write_max,
                    self.iops_write_max_length,
                ),
            ),
            (
                Kind::BpsTotal,
                l(
                    self.bps_total,
                    self.bps_total_max,
                    self.bps_total_max_length,
                ),
            ),
            (
                Kind::BpsRead,
                l(self.bps_read, self.bps_read_max, self.bps_read_max_length),
            ),
            (
                Kind::BpsWrite,
                l(
                    self.bps_write,
                    self.bps_write_max,
                    self.bps_write_max_length,
                ),
            ),
        ]
    }

    /// Checks the limits as QEMU's `throttle_is_valid` does; why not.
    pub fn validate(&self) -> Result<(), String> {
        if (self.iops_total != 0 || self.iops_total_max != 0)
            && (self.iops_read != 0
                || self.iops_write != 0
                || self.iops_read_max != 0
                || self.iops_write_max != 0)
            || (self.bps_total != 0 || self.bps_total_max != 0)
                && (self.bps_read != 0
                    || self.bps_write != 0
                    || self.bps_read_max != 0
                    || self.bps_write_max != 0)
        {
            return Err("total and read/write limits of one kind cannot be given together".into());
        }
        if self.iops_size > VALUE_MAX {
            return Err(format!("iops-size must be at most {VALUE_MAX}"));
        }
        for (kind, l) in self.limits() {
            let name = kind.name();
            if l.avg > VALUE_MAX || l.max > VALUE_MAX {
                return Err(format!("{name}: limits must be at most {VALUE_MAX}"));
            }
            if l.max != 0 && l.avg == 0 {
                return Err(format!("{name}-max needs {name}"));
            }
            if l.max != 0 && l.max < l.avg {
                return Err(format!("{name}-max cannot be lower than {name}"));
            }
            if l.length > MAX_BURST_SECONDS {
                return Err(format!(
                    "{name}-max-length must be at most {MAX_BURST_SECONDS}"
                ));
            }
            if l.length > 1 && l.max == 0 {
                return Err(format!("{name}-max-length needs {name}-max"));
            }
        }
        Ok(())
    }
}

/// What a bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    IopsTotal,
    IopsRead,
    IopsWrite,
    BpsTotal,
    BpsRead,
    BpsWrite,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::IopsTotal => "iops-total",
            Kind::IopsRead => "iops-read",
            Kind::IopsWrite => "iops-write",
            Kind::BpsTotal => "bps-total",
            Kind::BpsRead => "bps-read",
            Kind::BpsWrite => "bps-write",
        }
    }

    /// Whether a request of `direction` fills it.
    fn counts(self, direction: IoKind) -> bool {
        match self {
            Kind::IopsTotal | Kind::BpsTotal => true,
            Kind::IopsRead | Kind::BpsRead => direction == IoKind::Read,
            Kind::IopsWrite | Kind::BpsWrite => direction == IoKind::Write,
        }
    }

    fn counts_bytes(self) -> bool {
        matches!(self, Kind::BpsTotal | Kind::BpsRead | Kind::BpsWrite)
    }
}

/// Which limits a request counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IoKind {
    Read,
    /// Writes, discards, write-zeroes.
    Write,
}

/// One leaky bucket: its level leaks at the average rate (and the burst
/// level at the burst rate).
#[derive(Debug, Clone)]
struct Bucket {
    kind: Kind,
    avg: f64,
    max: f64,
    length: f64,
    level: f64,
    burst_level: f64,
}

impl Bucket {
    fn new(kind: Kind, l: Limit) -> Option<Bucket> {
        (l.avg != 0).then(|| Bucket {
            kind,
            avg: l.avg as f64,
            max: l.max as f64,
            length: l.length.max(1) as f64,
            level: 0.0,
            burst_level: 0.0,
        })
    }

    fn leak(&mut self, seconds: f64) {
        self.level = (self.level - self.avg * seconds).max(0.0);
        if self.max > 0.0 {
            self.burst_level = (self.burst_level - self.max * seconds).max(0.0);
        }
    }

    /// How long until a request may fill it (zero: now).
    fn wait(&self) -> Duration {
        let (size, burst_size) = if self.max > 0.0 {
            // At most `max` for `length` seconds, then the average.
            (self.max * self.length, self.max / 10.0)
        } else {
            // Short bursts of a tenth of a second at the average.
            (self.avg / 10.0, 0.0)
        };
        let extra = self.level - size;
        if extra > 0.0 {
            return Duration::from_secs_f64(extra / self.avg);
        }
        if self.length > 1.0 {
            let extra = self.burst_level - burst_size;
            if extra > 0.0 {
                return Duration::from_secs_f64(extra / self.max);
            }
        }
        Duration::ZERO
    }

    fn fill(&mut self, units: f64) {
        self.level += units;
        if self.length > 1.0 {
            self.burst_level += units;
        }
    }
}

/// The buckets of a group and when they last leaked.
#[derive(Debug)]
struct Buckets {
    limits: IoLimits,
    buckets: Vec<Bucket>,
    leaked: Instant,
}

impl Buckets {
    fn new(limits: IoLimits) -> Buckets {
        Buckets {
            buckets: limits
                .limits()
                .into_iter()
                .filter_map(|(k, l)| Bucket::new(k, l))
                .collect(),
            limits,
            leaked: Instant::now(),
        }
    }

    fn leak(&mut self, now: Instant) {
        let seconds = now.saturating_duration_since(self.leaked).as_secs_f64();
        self.leaked = now;
        for b in &mut self.buckets {
            b.leak(seconds);
        }
    }
}

/// A set of exports sharing limits (QEMU's throttle group): named, or
/// one export's own.
#[derive(Debug)]
pub(crate) struct ThrottleGroup {
    name: String,
    buckets: Mutex<Buckets>,
    /// Requests that had to wait, and for how long in all (µs).
    waited: AtomicU64,
    waited_us: AtomicU64,
    /// Changes of its limits so far.
    generation: AtomicU64,
}

impl ThrottleGroup {
    fn new(name: String, limits: IoLimits) -> Self {
        ThrottleGroup {
            name,
            buckets: Mutex::new(Buckets::new(limits)),
            waited: AtomicU64::new(0),
            waited_us: AtomicU64::new(0),
            generation: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Buckets> {
        self.buckets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces the limits (levels start empty, as QEMU's do).
    fn set(&self, limits: IoLimits) {
        *self.lock() = Buckets::new(limits);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    fn limits(&self) -> IoLimits {
        self.lock().limits.clone()
    }

    /// How long a request of `direction` must wait before it may start
    /// (zero: now).
    fn wait(&self, direction: IoKind) -> Duration {
        let mut b = self.lock();
        b.leak(Instant::now());
        b.buckets
            .iter()
            .filter(|k| k.kind.counts(direction))
            .map(Bucket::wait)
            .max()
            .unwrap_or(Duration::ZERO)
    }

    /// Counts a request of `bytes` that starts.
    fn account(&self, direction: IoKind, bytes: u64) {
        let mut b = self.lock();
        let size = b.limits.iops_size;
        let ops = if size != 0 && bytes > size {
            bytes as f64 / size as f64
        } else {
            1.0
        };
        for k in b.buckets.iter_mut().filter(|k| k.kind.counts(direction)) {
            k.fill(if k.kind.counts_bytes() {
                bytes as f64
            } else {
                ops
            });
        }
    }
}

/// The named groups of a daemon (a group lives while an export is in it).
#[derive(Debug, Default)]
pub(crate) struct ThrottleGroups {
    groups: Mutex<HashMap<String, Weak<ThrottleGroup>>>,
}

impl ThrottleGroups {
    /// Group `name` with `limits`: the existing one (its limits replaced
    /// by `limits` unless they are `None`), or a new one (`None`: no
    /// limits yet).
    fn join(&self, name: &str, limits: Option<IoLimits>) -> Arc<ThrottleGroup> {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups.retain(|_, g| g.strong_count() > 0);
        if let Some(g) = groups.get(name).and_then(Weak::upgrade) {
            if let Some(limits) = limits {
                g.set(limits);
            }
            return g;
        }
        let g = Arc::new(ThrottleGroup::new(
            name.to_owned(),
            limits.unwrap_or_default(),
        ));
        groups.insert(name.to_owned(), Arc::downgrade(&g));
        g
    }
}

/// An export's limits: its group now (changed live), shared with its
/// queue workers across sessions.
#[derive(Debug, Default)]
pub(crate) struct ExportThrottle {
    /// Whether a group is set (checked first: no lock for an export
    /// without limits).
    on: AtomicBool,
    group: Mutex<Option<Arc<ThrottleGroup>>>,
    /// Set while the export stops: requests start whatever the limits
    /// (as QEMU's drain restarts throttled requests).
    bypass: AtomicBool,
    /// Changes of the limits so far: a parked request looks again at
    /// each (a lifted limit lets it start at once).
    generation: AtomicU64,
}

/// What `stats` shows of an export's limits.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ThrottleCounters {
    /// The group (an export's own is named after it).
    pub group: String,
    /// Its limits.
    pub limits: IoLimits,
    /// Requests of the group that waited for the limits.
    pub throttled: u64,
    /// Seconds they waited in all.
    pub throttled_seconds: f64,
}

impl ExportThrottle {
    fn lock(&self) -> MutexGuard<'_, Option<Arc<ThrottleGroup>>> {
        self.group.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the limits of export `id`: in group `group` if named (which
    /// takes `limits`, the other exports in it too; `None`: the group's
    /// as they are), else its own group (no limits at all: none).
    pub(crate) fn set(
        &self,
        id: &str,
        group: Option<&str>,
        limits: Option<IoLimits>,
        groups: &ThrottleGroups,
    ) {
        self.set_limits(id, group, limits, groups);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// The limits' generation: changed by every [`ExportThrottle::set`]
    /// and every change of its group's limits (through another export).
    pub(crate) fn generation(&self) -> u64 {
        let group = self
            .group()
            .map_or(0, |g| g.generation.load(Ordering::SeqCst));
        self.generation.load(Ordering::SeqCst).wrapping_add(group)
    }

    fn set_limits(
        &self,
        id: &str,
        group: Option<&str>,
        limits: Option<IoLimits>,
        groups: &ThrottleGroups,
    ) {
        let new = match (group, limits) {
            (Some(name), limits) => Some(groups.join(name, limits)),
            (None, Some(l)) if l.is_unlimited() => None,
            (None, Some(l)) => {
                let mut current = self.lock();
                match current.as_ref() {
                    // Its group (named or its own) takes the new limits.
                    Some(g) => {
                        g.set(l);
                        return;
                    }
                    None => {
                        *current = Some(Arc::new(ThrottleGroup::new(id.to_owned(), l)));
                        self.on.store(true, Ordering::SeqCst);
                        return;
                    }
                }
            }
            (None, None) => return,
        };
        let mut current = self.lock();
        self.on.store(new.is_some(), Ordering::SeqCst);
        *current = new;
    }

    /// The group now, if any.
    fn group(&self) -> Option<Arc<ThrottleGroup>> {
        if !self.on.load(Ordering::Relaxed) {
            return None;
        }
        self.lock().clone()
    }

    /// How long a request of `direction` must wait before it starts
    /// (`None`: it may start now).
    pub(crate) fn wait(&self, direction: IoKind) -> Option<Duration> {
        if self.bypass.load(Ordering::Relaxed) {
            return None;
        }
        let wait = self.group()?.wait(direction);
        (!wait.is_zero()).then_some(wait)
    }

    /// Counts a request of `bytes` that starts.
    pub(crate) fn account(&self, direction: IoKind, bytes: u64) {
        if let Some(g) = self.group() {
            g.account(direction, bytes);
        }
    }

    /// Counts a request that waited `waited` before it started.
    pub(crate) fn waited(&self, waited: Duration) {
        if let Some(g) = self.group() {
            g.waited.fetch_add(1, Ordering::Relaxed);
            g.waited_us
                .fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
        }
    }

    /// Lets every request start whatever the limits (`true`: while the
    /// export stops), or limits them again.
    pub(crate) fn set_bypass(&self, on: bool) {
        self.bypass.store(on, Ordering::SeqCst);
    }

    /// Whether requests start whatever the limits (the export stops).
    pub(crate) fn bypassing(&self) -> bool {
        self.bypass.load(Ordering::Relaxed)
    }

    /// The limits and counters, if limited.
    pub(crate) fn counters(&self) -> Option<ThrottleCounters> {
        self.group().map(|g| ThrottleCounters {
            group: g.name.clone(),
            limits: g.limits(),
            throttled: g.waited.load(Ordering::Relaxed),
            throttled_seconds: g.waited_us.load(Ordering::Relaxed) as f64 / 1e6,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests admitted by `group` when each takes the next free moment
    /// over `seconds` of simulated time (no sleeping: the clock moves).
    fn admitted(limits: IoLimits, direction: IoKind, bytes: u64, seconds: f64) -> f64 {
        let g = ThrottleGroup::new("t".into(), limits);
        let start = Instant::now();
        let mut now = start;
        let mut n = 0u64;
        let end = start + Duration::from_secs_f64(seconds);
        while now < end {
            let wait = {
                let mut b = g.lock();
                b.leak(now);
                b.buckets
                    .iter()
                    .filter(|k| k.kind.counts(direction))
                    .map(Bucket::wait)
                    .max()
                    .unwrap_or(Duration::ZERO)
            };
            if wait.is_zero() {
                g.account(direction, bytes);
                n += 1;
            } else {
                now += wait;
            }
        }
        n as f64
    }

    /// Over a long window the rate is the average, from 1k to 100k IOPS
    /// and in bytes; the first second's burst is the bucket's size.
    #[test]
    fn buckets_let_through_their_average_over_time() {
        for iops in [1_000u64, 10_000, 100_000] {
            let limits = IoLimits {
                iops_total: iops,
                ..Default::default()
            };
            let n = admitted(limits, IoKind::Read, 4096, 20.0);
            let rate = n / 20.0;
            assert!(
                (rate / iops as f64 - 1.0).abs() < 0.02,
                "{iops} IOPS: {rate} admitted per second"
            );
        }
        let limits = IoLimits {
            bps_write: 10 << 20,
            ..Default::default()
        };
        let n = admitted(limits, IoKind::Write, 64 << 10, 20.0);
        let rate = n * (64 << 10) as f64 / 20.0;
        assert!(
            (rate / (10u64 << 20) as f64 - 1.0).abs() < 0.02,
            "{rate} B/s"
        );
    }

    /// A burst runs at `-max` for `-max-length` seconds, then the average.
    #[test]
    fn a_burst_runs_at_its_max_for_its_length() {
        let limits = IoLimits {
            iops_write: 100,
            iops_write_max: 1000,
            iops_write_max_length: 4,
            ..Default::default()
        };
        let first = admitted(limits.clone(), IoKind::Write, 512, 2.0);
        assert!(
            (1700.0..=2300.0).contains(&first),
            "{first} in the first 2 s of a 1000/s burst"
        );
        let long = admitted(limits, IoKind::Write, 512, 60.0);
        // 4 s of burst (4000 ops) then the average.
        let expected = 4000.0 + 100.0 * 56.0;
        assert!((long / expected - 1.0).abs() < 0.1, "{long} in 60 s");
    }

    /// Reads do not fill write limits, and `iops-size` counts a large
    /// request as several.
    #[test]
    fn directions_and_sizes_count_as_qemu_counts_them() {
        let g = ThrottleGroup::new(
            "t".into(),
            IoLimits {
                iops_total: 100,
                iops_size: 4096,
                ..Default::default()
            },
        );
        // 16 KiB counts 4 operations: the bucket (10) is over after 3.
        for _ in 0..3 {
            assert!(g.wait(IoKind::Read).is_zero());
            g.account(IoKind::Read, 16384);
        }
        assert!(!g.wait(IoKind::Read).is_zero());
        let g = ThrottleGroup::new(
            "t".into(),
            IoLimits {
                iops_write: 10,
                ..Default::default()
            },
        );
        for _ in 0..100 {
            g.account(IoKind::Write, 512);
        }
        assert!(!g.wait(IoKind::Write).is_zero());
        assert!(g.wait(IoKind::Read).is_zero(), "a write limit held a read");
    }

    #[test]
    fn limits_qemu_refuses_are_refused() {
        for bad in [
            IoLimits {
                iops_total: 10,
                iops_read: 5,
                ..Default::default()
            },
            IoLimits {
                bps_total_max: 10,
                bps_write: 5,
                ..Default::default()
            },
            IoLimits {
                iops_read_max: 10,
                ..Default::default()
            },
            IoLimits {
                iops_read: 10,
                iops_read_max: 5,
                ..Default::default()
            },
            IoLimits {
                bps_read: 10,
                bps_read_max_length: 2,
                ..Default::default()
            },
            IoLimits {
                bps_read: VALUE_MAX + 1,
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?} accepted");
        }
        assert!(IoLimits {
            iops_read: 10,
            iops_read_max: 20,
            iops_read_max_length: 60,
            bps_total: 1 << 20,
            ..Default::default()
        }
        .validate()
        .is_ok());
    }

    /// A named group's limits are the last set; an export leaving its
    /// limits (all zero) is unthrottled; the group goes with its last
    /// export.
    #[test]
    fn exports_share_a_named_group() {
        let groups = ThrottleGroups::default();
        let (a, b) = (ExportThrottle::default(), ExportThrottle::default());
        let l = |n| IoLimits {
            iops_total: n,
            ..Default::default()
        };
        a.set("a", Some("g"), Some(l(10)), &groups);
        b.set("b", Some("g"), None, &groups);
        assert_eq!(b.counters().unwrap().limits, l(10));
        b.set("b", None, Some(l(20)), &groups);
        assert_eq!(
            a.counters().unwrap().limits,
            l(20),
            "the group took b's change"
        );
        for _ in 0..5 {
            a.account(IoKind::Read, 512);
            b.account(IoKind::Read, 512);
        }
        assert!(
            a.wait(IoKind::Read).is_some(),
            "the group's bucket is shared"
        );
        a.set("a", None, Some(IoLimits::default()), &groups);
        assert!(a.counters().is_none());
        assert!(a.wait(IoKind::Read).is_none());
        drop(b);
        assert!(
            groups.join("g", None).limits().is_unlimited(),
            "a new group"
        );
    }
}
