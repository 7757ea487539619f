//! Phases of one continuous load (`load --phase-file`): a script names
//! the phase it is in by writing a word to a file (`before`, `during`,
//! `after`; `end` stops the load) and the load keeps the latencies of
//! each phase apart, so that a change made under load (a live commit) is
//! measured against the same connection's steady state, not against a
//! fresh connection's first seconds.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// How often the phase file is read.
const POLL: Duration = Duration::from_millis(5);
/// The phase name that ends the load.
pub const END: &str = "end";
/// Slices with fewer requests do not count for a phase's worst slice.
const MIN_SLICE_IOS: u64 = 100;

/// The phases seen so far and the current one, from a watcher thread.
pub struct PhaseClock {
    names: Mutex<Vec<(String, Instant)>>,
    current: AtomicUsize,
    ended: AtomicBool,
    stop: AtomicBool,
}

impl PhaseClock {
    /// Starts watching `path` (a missing or empty file at the start is
    /// the phase `start`; an empty file later is one being rewritten).
    pub fn watch(path: PathBuf) -> Arc<PhaseClock> {
        let first = read_phase(&path).unwrap_or_else(|| "start".to_owned());
        let clock = Arc::new(PhaseClock {
            names: Mutex::new(vec![(first, Instant::now())]),
            current: AtomicUsize::new(0),
            ended: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let c = Arc::clone(&clock);
        std::thread::spawn(move || {
            while !c.stop.load(Ordering::Relaxed) && !c.ended.load(Ordering::Relaxed) {
                let Some(name) = read_phase(&path) else {
                    std::thread::sleep(POLL);
                    continue;
                };
                let mut names = c.names.lock().unwrap_or_else(PoisonError::into_inner);
                let i = c.current.load(Ordering::Relaxed);
                if names[i].0 != name {
                    if name == END {
                        c.ended.store(true, Ordering::Relaxed);
                    } else {
                        names.push((name, Instant::now()));
                        c.current.store(names.len() - 1, Ordering::Relaxed);
                    }
                }
                drop(names);
                std::thread::sleep(POLL);
            }
        });
        clock
    }

    /// The index of the phase now.
    pub fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// Whether the script said `end`.
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::Relaxed)
    }

    /// Stops the watcher; the phases' names and starts.
    pub fn finish(&self) -> Vec<(String, Instant)> {
        self.stop.store(true, Ordering::Relaxed);
        self.names
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The word in the phase file; `None` while it is missing or empty (a
/// shell's `echo WORD >FILE` truncates it first).
fn read_phase(path: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let name = text.trim();
    (!name.is_empty()).then(|| name.to_owned())
}

fn histogram() -> Histogram<u64> {
    // 1 µs .. 1 min at 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("constant bounds are valid")
}

/// One queue's latencies per phase, and per slice of each phase.
#[derive(Default)]
pub struct PhaseLatencies {
    /// `[phase] -> (whole phase, [slice])`.
    phases: Vec<(Histogram<u64>, Vec<Histogram<u64>>)>,
}

impl PhaseLatencies {
    /// Records a request of `us` completed in `phase`, `since_phase` after
    /// the phase began (slices of `slice`).
    pub fn record(&mut self, phase: usize, since_phase: Duration, slice: Duration, us: u64) {
        while self.phases.len() <= phase {
            self.phases.push((histogram(), Vec::new()));
        }
        let (all, slices) = &mut self.phases[phase];
        let _ = all.record(us.max(1));
        let s = (since_phase.as_nanos() / slice.as_nanos().max(1)) as usize;
        while slices.len() <= s {
            slices.push(histogram());
        }
        let _ = slices[s].record(us.max(1));
    }

    /// Adds another queue's latencies.
    pub fn add(&mut self, other: &PhaseLatencies) {
        for (i, (all, slices)) in other.phases.iter().enumerate() {
            while self.phases.len() <= i {
                self.phases.push((histogram(), Vec::new()));
            }
            let (a, s) = &mut self.phases[i];
            let _ = a.add(all);
            for (j, h) in slices.iter().enumerate() {
                while s.len() <= j {
                    s.push(histogram());
                }
                let _ = s[j].add(h);
            }
        }
    }

    /// Each phase's figures, in the order they came.
    pub fn results(&self, names: &[(String, Instant)], end: Instant) -> Vec<PhaseResult> {
        names
            .iter()
            .enumerate()
            .map(|(i, (name, start))| {
                let until = names.get(i + 1).map_or(end, |n| n.1);
                let seconds = until.saturating_duration_since(*start).as_secs_f64();
                let (ios, p50, p99, p999, max, per_slice) = match self.phases.get(i) {
                    Some((all, slices)) => (
                        all.len(),
                        all.value_at_quantile(0.5),
                        all.value_at_quantile(0.99),
                        all.value_at_quantile(0.999),
                        all.max(),
                        slices
                            .iter()
                            .map(|h| (h.len() >= MIN_SLICE_IOS).then(|| h.value_at_quantile(0.99)))
                            .collect::<Vec<_>>(),
                    ),
                    None => (0, 0, 0, 0, 0, Vec::new()),
                };
                let worst = per_slice.iter().flatten().copied().max().unwrap_or(0);
                PhaseResult {
                    name: name.clone(),
                    seconds,
                    ios,
                    iops: if seconds > 0.0 {
                        ios as f64 / seconds
                    } else {
                        0.0
                    },
                    lat_p50_us: p50,
                    lat_p99_us: p99,
                    lat_p999_us: p999,
                    lat_max_us: max,
                    worst_slice_p99_us: worst,
                    slice_p99_us: per_slice,
                }
            })
            .collect()
    }
}

/// What one phase of a load measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PhaseResult {
    pub name: String,
    pub seconds: f64,
    /// Reads and writes completed in the phase.
    pub ios: u64,
    pub iops: f64,
    pub lat_p50_us: u64,
    /// p99 over every request of the phase.
    pub lat_p99_us: u64,
    pub lat_p999_us: u64,
    pub lat_max_us: u64,
    /// The largest p99 of the phase's slices (`--slice-ms`).
    pub worst_slice_p99_us: u64,
    /// Each slice's p99, in order (`None`: too few requests in it).
    #[serde(default)]
    pub slice_p99_us: Vec<Option<u64>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_keep_their_latencies_apart() {
        let t0 = Instant::now();
        let names = vec![
            ("before".to_owned(), t0),
            ("during".to_owned(), t0 + Duration::from_secs(2)),
        ];
        let slice = Duration::from_secs(1);
        let mut q1 = PhaseLatencies::default();
        let mut q2 = PhaseLatencies::default();
        for i in 0..1000 {
            q1.record(0, Duration::from_millis(i), slice, 100);
            q2.record(1, Duration::from_millis(i), slice, 1000);
        }
        // One slow second in "during": its slice's p99, not the phase's.
        for i in 0..200 {
            q2.record(1, Duration::from_millis(1000 + i), slice, 5000);
        }
        q1.add(&q2);
        let r = q1.results(&names, t0 + Duration::from_secs(4));
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].ios, r[0].lat_p99_us), (1000, 100));
        assert_eq!(r[1].ios, 1200);
        assert!((4990..=5010).contains(&r[1].lat_p99_us));
        assert!((4990..=5010).contains(&r[1].worst_slice_p99_us));
        assert!((r[1].seconds - 2.0).abs() < 1e-9);
        let mut q3 = PhaseLatencies::default();
        for i in 0..1000 {
            q3.record(
                0,
                Duration::from_millis(i),
                slice,
                if i % 50 == 0 { 900 } else { 100 },
            );
        }
        let r = q3.results(&names[..1], t0 + Duration::from_secs(1));
        assert!(
            (895..=905).contains(&r[0].lat_p99_us),
            "{}",
            r[0].lat_p99_us
        );
    }

    #[test]
    fn a_phase_file_names_the_phase_and_end_stops() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("phase");
        let clock = PhaseClock::watch(path.clone());
        assert_eq!(clock.current(), 0);
        std::fs::write(&path, "during\n").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while clock.current() != 1 && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        assert_eq!(clock.current(), 1);
        // Truncated first, as a shell rewrites it: not a phase.
        std::fs::write(&path, "").unwrap();
        std::thread::sleep(POLL * 4);
        std::fs::write(&path, "end").unwrap();
        while !clock.ended() && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        assert!(clock.ended());
        let names: Vec<String> = clock.finish().into_iter().map(|n| n.0).collect();
        assert_eq!(names, ["start", "during"]);
    }
}
