//! What the guest changed that a live commit's copier has still to copy:
//! one bit per granule of guest bytes (called clusters here), set after
//! the change is in the top, cleared by the copier before it reads the
//! view (so a change that lands after the read sets the bit again and is
//! copied again).

use std::sync::atomic::{AtomicU64, Ordering};

/// A bitmap of guest granules.
#[derive(Debug)]
pub(crate) struct ChangedClusters {
    words: Vec<AtomicU64>,
    clusters: u64,
    count: AtomicU64,
}

impl ChangedClusters {
    /// For `clusters` guest clusters, none changed.
    pub(crate) fn new(clusters: u64) -> ChangedClusters {
        ChangedClusters {
            words: (0..clusters.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            clusters,
            count: AtomicU64::new(0),
        }
    }

    /// Marks clusters `first..=last` changed.
    pub(crate) fn mark(&self, first: u64, last: u64) {
        if self.clusters == 0 {
            return;
        }
        let last = last.min(self.clusters - 1);
        let mut c = first;
        while c <= last {
            let word = (c / 64) as usize;
            let Some(w) = self.words.get(word) else {
                return;
            };
            let lo = c % 64;
            let hi = (last - c + lo).min(63);
            let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            let before = w.fetch_or(mask, Ordering::SeqCst);
            self.count
                .fetch_add(u64::from((mask & !before).count_ones()), Ordering::SeqCst);
            c += hi - lo + 1;
        }
    }

    /// Clusters marked and not taken yet.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    /// Takes every marked cluster (clearing it first), calling `each`
    /// with runs of consecutive ones `(first, n)`, `n <= max_run`; stops
    /// at the first error or `Ok(false)` (the clusters of that run and
    /// those not handed over yet are marked again).
    pub(crate) fn take<E>(
        &self,
        max_run: u64,
        each: &mut dyn FnMut(u64, u64) -> Result<bool, E>,
    ) -> Result<bool, E> {
        for (i, w) in self.words.iter().enumerate() {
            let mut bits = w.swap(0, Ordering::SeqCst);
            if bits == 0 {
                continue;
            }
            self.count
                .fetch_sub(u64::from(bits.count_ones()), Ordering::SeqCst);
            while bits != 0 {
                let lo = u64::from(bits.trailing_zeros());
                let n = u64::from((bits >> lo).trailing_ones()).min(max_run.max(1));
                let run = if n == 64 {
                    u64::MAX
                } else {
                    ((1u64 << n) - 1) << lo
                };
                bits &= !run;
                let first = i as u64 * 64 + lo;
                let go_on = match each(first, n) {
                    Ok(go_on) => go_on,
                    Err(e) => {
                        self.mark_bits(i, bits | run);
                        return Err(e);
                    }
                };
                if !go_on {
                    // The run just handed over may not be copied: back too.
                    self.mark_bits(i, bits | run);
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    fn mark_bits(&self, word: usize, bits: u64) {
        if bits == 0 {
            return;
        }
        let before = self.words[word].fetch_or(bits, Ordering::SeqCst);
        self.count
            .fetch_add(u64::from((bits & !before).count_ones()), Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taken(c: &ChangedClusters, max_run: u64) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        c.take::<()>(max_run, &mut |f, n| {
            runs.push((f, n));
            Ok(true)
        })
        .unwrap();
        runs
    }

    #[test]
    fn marks_count_and_take_runs() {
        let c = ChangedClusters::new(200);
        c.mark(3, 3);
        c.mark(60, 70);
        c.mark(65, 66); // already marked: not counted twice
        c.mark(199, 199);
        c.mark(250, 260); // past the end: ignored
        assert_eq!(c.count(), 1 + 11 + 1);
        assert_eq!(
            taken(&c, 64),
            vec![(3, 1), (60, 4), (64, 7), (199, 1)],
            "runs end at word boundaries"
        );
        assert_eq!(c.count(), 0);
        assert!(taken(&c, 64).is_empty());
        c.mark(0, 127);
        assert_eq!(c.count(), 128);
        assert_eq!(taken(&c, 16).len(), 8);
    }

    #[test]
    fn a_stopped_take_marks_what_it_did_not_hand_over() {
        let c = ChangedClusters::new(128);
        c.mark(0, 9);
        c.mark(100, 100);
        let mut seen = 0;
        let done = c
            .take::<()>(4, &mut |_, _| {
                seen += 1;
                Ok(seen < 2)
            })
            .unwrap();
        assert!(!done);
        // Run 0..4 handed over, 4..8 stopped: given back with 8..10.
        assert_eq!(c.count(), 6 + 1);
        let e = c.take::<&str>(4, &mut |_, _| Err("full"));
        assert!(e.is_err());
        assert_eq!(c.count(), 7, "nothing lost on an error");
    }
}
