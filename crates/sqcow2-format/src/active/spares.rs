//! Spare clusters: counted (refcount 1) and reading as zeros in the file,
//! both made durable by one sync, and referenced by nothing.
//!
//! A write that allocates one of them, over a guest view that read as
//! zeros across the whole cluster, needs no sync before its mapping is
//! written to the file: whatever a power loss keeps of its data, each page
//! reads either the new bytes or zeros, which is what the guest saw there
//! before, and the cluster's count and space are on disk already. So a
//! *publish* of such writes (the mappings in the page cache, so that a
//! process death loses none of them) costs page-cache writes only; the
//! sync is paid by the next write-back after a refill. Any other allocation (a
//! copy-on-write over data, a reused or preallocated cluster, an L2 table
//! copied from a shared one) still has its data synced before its mapping
//! is written ([`super::flush`]).
//!
//! While spares are held the image carries the dirty bit (set durably
//! before the first batch is counted on disk): a process that dies leaves
//! them as leaked clusters, and the next read-write open (sqcow2's or
//! QEMU's) repairs the refcounts. [`super::Active::close`] gives them back
//! and clears the bit.

use std::collections::VecDeque;

/// Most bytes held in spare clusters (the leak a process death leaves at
/// worst until the next read-write open repairs it).
const MAX_SPARE_BYTES: u64 = 16 << 20;
/// Most bytes one refill on demand prepares: it runs on the path of the
/// write that asked for it, and a filesystem that fills the space in
/// (tmpfs zeroes the pages) took long enough over 16 MiB at once to be
/// that write's latency (measured: the longest write 40-60 ms against
/// 10-12 ms with 1 MiB). One cluster where a cluster is larger.
const MAX_REFILL_BYTES: u64 = 1 << 20;
/// Most spare clusters held.
const MAX_POOL: usize = 1024;
/// Most bytes held in spare clusters for a bulk copier (a live commit's
/// drain into this file): each refill costs a sync of the whole file,
/// which writes back every guest write cached there (measured: refills
/// of the 16 MiB pool synced a drained base 0.7 times a second at
/// 4 MiB/s); the copier uses every one of them.
const MAX_COPIER_SPARE_BYTES: u64 = 128 << 20;
/// Most spare clusters held for a bulk copier.
const MAX_COPIER_POOL: usize = 4096;
/// The first pool. It doubles (up to the maximum) when a refill filled it
/// or when an allocation found it empty, so that an image written a
/// little does not get many spares, and one written fast gets more.
const FIRST_POOL: usize = 8;

/// How much a refill of the spares prepares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NextRefill {
    /// At most [`MAX_REFILL_BYTES`], once at most half the pool is left
    /// (an allocating write found it low).
    OnDemand,
    /// The whole pool once at most half of it is left (asked ahead of a
    /// burst, off any request's path).
    WholePool,
    /// The whole (copier's) pool now, however much of it is left (a bulk
    /// copier's, off any request's path).
    TopUp,
}

/// The spare clusters of the writable top (cluster indices).
#[derive(Debug)]
pub(crate) struct Spares {
    ready: VecDeque<u64>,
    /// How many spares to hold: a refill is due once at most half of it
    /// is left.
    target: usize,
    max_pool: usize,
    /// The pool a bulk copier keeps ([`Spares::want_topped_up`]).
    copier_pool: usize,
    /// Most clusters one refill on demand prepares.
    max_refill: usize,
    /// How much the next refill prepares.
    next: NextRefill,
    /// An allocation found no spare since the last refill.
    ran_dry: bool,
    /// The last refill filled the pool to its target.
    filled: bool,
    /// An allocation looked for a spare since the last refill.
    wanted: bool,
    /// Spares were made since the image was opened (it carries the dirty
    /// bit then).
    made: bool,
}

impl Spares {
    /// Spares for clusters of `1 << cluster_bits` bytes; none where the
    /// image has no dirty bit to mark them with (`enabled` false: qcow2
    /// v2).
    pub(crate) fn new(cluster_bits: u32, enabled: bool) -> Self {
        let clusters = |bytes: u64, most: usize| {
            if enabled {
                ((bytes >> cluster_bits) as usize).clamp(1, most)
            } else {
                0
            }
        };
        let max_pool = clusters(MAX_SPARE_BYTES, MAX_POOL);
        Spares {
            ready: VecDeque::new(),
            target: FIRST_POOL.min(max_pool),
            max_pool,
            copier_pool: clusters(MAX_COPIER_SPARE_BYTES, MAX_COPIER_POOL).max(max_pool),
            max_refill: clusters(MAX_REFILL_BYTES, MAX_POOL),
            next: NextRefill::OnDemand,
            ran_dry: false,
            filled: false,
            wanted: false,
            made: false,
        }
    }

    /// The lowest spare, if any.
    pub(crate) fn take(&mut self) -> Option<u64> {
        self.wanted = true;
        let spare = self.ready.pop_front();
        self.ran_dry |= spare.is_none();
        spare
    }

    /// Whether a spare is ready to be taken.
    pub(crate) fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Whether [`Spares::refill_wanted`] would prepare clusters now (it
    /// decides; this only tells a caller that cannot refill to ask one
    /// that can).
    pub(crate) fn refill_due(&self) -> bool {
        self.wanted
            && self.target > 0
            && (self.next == NextRefill::TopUp || self.ready.len() <= self.target / 2)
    }

    /// How many clusters to prepare now (0: none): when allocations asked
    /// for spares and at most half of the pool is left; at most
    /// [`MAX_REFILL_BYTES`] of them unless asked ahead.
    pub(crate) fn refill_wanted(&mut self) -> usize {
        let next = std::mem::replace(&mut self.next, NextRefill::OnDemand);
        let half_left = self.ready.len() <= self.target / 2;
        if !self.wanted || self.target == 0 || (next != NextRefill::TopUp && !half_left) {
            // A pool asked for ahead but full enough: nothing owed.
            if next == NextRefill::WholePool && half_left {
                self.next = next;
            }
            return 0;
        }
        self.wanted = false;
        // Grow when the last refill filled the pool and it is half used
        // again, or when it ran out: allocations outpace it.
        let ran_dry = std::mem::take(&mut self.ran_dry);
        if self.made && (self.filled || ran_dry) {
            // (Never below a copier's pool while it is asked for.)
            self.target = (self.target * 2).min(self.max_pool.max(self.target));
        }
        let missing = self.target.saturating_sub(self.ready.len());
        let n = match next {
            NextRefill::OnDemand => missing.min(self.max_refill),
            NextRefill::WholePool | NextRefill::TopUp => missing,
        };
        self.filled = n == missing;
        n
    }

    /// Asks for the whole pool at the next refill (a top prepared for a
    /// burst of allocations, as after a live snapshot's switch, before
    /// the pause).
    pub(crate) fn want_full_batch(&mut self) {
        self.wanted = true;
        self.next = NextRefill::WholePool;
        self.target = self.max_pool;
    }

    /// Asks for the copier's whole pool ([`MAX_COPIER_SPARE_BYTES`]) at
    /// the next refill once a quarter of it is used, for a copier that
    /// allocates in batches off any request's path: the pool then never
    /// falls to half, where refills come a megabyte at a time from the
    /// allocating write, and each refill (a sync at the next write-back)
    /// serves a quarter of the pool.
    pub(crate) fn want_topped_up(&mut self) {
        self.target = self.copier_pool;
        if self.ready.len() <= self.target * 3 / 4 {
            self.wanted = true;
            self.next = NextRefill::TopUp;
        }
    }

    /// The copier is done: refills keep the usual pool again (the spares
    /// held are used first).
    pub(crate) fn end_topped_up(&mut self) {
        self.target = self.target.min(self.max_pool);
        self.next = NextRefill::OnDemand;
    }

    /// Preparing a batch failed (a full filesystem): start small again.
    pub(crate) fn failed(&mut self) {
        self.target = FIRST_POOL.min(self.max_pool);
        self.next = NextRefill::OnDemand;
        self.ran_dry = false;
        self.filled = false;
    }

    /// Whether spares were ever made.
    pub(crate) fn made_any(&self) -> bool {
        self.made
    }

    /// Adds prepared clusters (counted and zeroed).
    pub(crate) fn add(&mut self, clusters: &[u64]) {
        self.made = true;
        self.ready.extend(clusters.iter().copied());
        self.ready.make_contiguous().sort_unstable();
    }

    /// Takes every spare (to give them back).
    pub(crate) fn take_all(&mut self) -> Vec<u64> {
        self.wanted = false;
        self.ready.drain(..).collect()
    }
}

/// Runs of consecutive cluster indices in `clusters` (sorted first).
pub(crate) fn runs(clusters: &[u64]) -> Vec<(u64, u64)> {
    let mut sorted = clusters.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for c in sorted {
        match out.last_mut() {
            Some((start, n)) if *start + *n == c => *n += 1,
            _ => out.push((c, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Takes `n` spares, then refills as the engine does (counted
    /// clusters numbered from `next`); the sizes of the refills.
    fn take_and_refill(s: &mut Spares, n: usize, next: &mut u64) -> Vec<usize> {
        let mut refills = Vec::new();
        for _ in 0..n {
            s.take();
            let k = s.refill_wanted();
            if k > 0 {
                refills.push(k);
                let batch: Vec<u64> = (*next..*next + k as u64).collect();
                *next += k as u64;
                s.add(&batch);
            }
        }
        refills
    }

    #[test]
    fn the_pool_grows_a_megabyte_at_a_time_and_refills_only_on_demand() {
        let mut s = Spares::new(16, true);
        assert_eq!(s.refill_wanted(), 0, "nobody asked");
        assert_eq!(s.take(), None);
        assert_eq!(s.refill_wanted(), FIRST_POOL);
        assert_eq!(s.refill_wanted(), 0, "one refill per demand");
        s.add(&[10, 8, 9, 11, 12, 13, 14, 15]);
        assert_eq!(s.take(), Some(8), "the lowest first");
        let mut next = 100;
        // A few allocations leave a few spares, not megabytes.
        take_and_refill(&mut s, 12, &mut next);
        assert!(
            s.ready.len() <= 32,
            "{} spares after 13 writes",
            s.ready.len()
        );
        let refills = take_and_refill(&mut s, 5000, &mut next);
        let most = (MAX_REFILL_BYTES >> 16) as usize;
        assert!(refills.iter().all(|&k| k <= most), "{refills:?}");
        assert!(s.ready.len() <= (MAX_SPARE_BYTES >> 16) as usize);
        assert!(
            s.ready.len() > most,
            "the pool grew past one refill: {}",
            s.ready.len()
        );
        // Allocations faster than the refills (none added for a while):
        // the pool doubles once it has run dry.
        let before = s.target;
        for _ in 0..s.ready.len() + 1 {
            s.take();
        }
        s.refill_wanted();
        assert_eq!(s.target, (before * 2).min(s.max_pool));
        // 2 MiB clusters: at most 8 held, one prepared at a time.
        let mut s = Spares::new(21, true);
        let refills = take_and_refill(&mut s, 100, &mut next);
        assert!(refills.iter().all(|&k| k == 1), "{refills:?}");
        assert!(s.ready.len() <= 8);
        let mut s = Spares::new(16, false);
        assert_eq!(s.take(), None);
        assert_eq!(s.refill_wanted(), 0, "disabled");
    }

    #[test]
    fn a_full_pool_is_asked_for_ahead_of_demand() {
        let mut s = Spares::new(16, true);
        s.want_full_batch();
        assert_eq!(s.refill_wanted(), (MAX_SPARE_BYTES >> 16) as usize);
        assert_eq!(s.refill_wanted(), 0, "one refill per demand");
        s.add(&(0..256).collect::<Vec<_>>());
        for _ in 0..200 {
            s.take();
        }
        assert_eq!(
            s.refill_wanted(),
            (MAX_REFILL_BYTES >> 16) as usize,
            "on demand again afterwards: a megabyte"
        );
        // Asked ahead while the pool is full enough: nothing owed, and
        // the next refill on demand is a megabyte again.
        let mut s = Spares::new(16, true);
        s.want_full_batch();
        assert_eq!(s.refill_wanted(), 256);
        s.add(&(0..256).collect::<Vec<_>>());
        s.want_full_batch();
        assert_eq!(s.refill_wanted(), 0, "full enough");
        for _ in 0..200 {
            s.take();
        }
        assert_eq!(
            s.refill_wanted(),
            16,
            "not the whole pool on a write's path"
        );
        let mut s = Spares::new(16, false);
        s.want_full_batch();
        assert_eq!(s.refill_wanted(), 0, "disabled");
    }

    #[test]
    fn a_copier_keeps_the_pool_topped_up_in_few_refills() {
        let mut s = Spares::new(16, true);
        let copier = (MAX_COPIER_SPARE_BYTES >> 16) as usize;
        let mut next = 0u64;
        let mut refills = Vec::new();
        // Batches of 16 allocations; the copier asks before each, the
        // allocating writes after each cluster.
        for _ in 0..1024 {
            s.want_topped_up();
            let k = s.refill_wanted();
            if k > 0 {
                refills.push(k);
                s.add(&(next..next + k as u64).collect::<Vec<_>>());
                next += k as u64;
            }
            for _ in 0..16 {
                assert!(s.take().is_some(), "ran dry");
                assert_eq!(s.refill_wanted(), 0, "a refill on the write's path");
            }
        }
        // The copier's pool first, then a quarter of it at a time.
        assert_eq!(refills[0], copier, "{refills:?}");
        assert!(refills.iter().all(|&k| k >= copier / 4), "{refills:?}");
        assert!(refills.len() <= 16384 / (copier / 4) + 1, "{refills:?}");
        assert!(s.ready.len() <= copier);
        // Done copying: allocations use up what is held, and refills
        // keep the usual pool again.
        s.end_topped_up();
        let held = s.ready.len();
        let refills = take_and_refill(&mut s, held + 1000, &mut next);
        let most = (MAX_REFILL_BYTES >> 16) as usize;
        assert!(refills.iter().all(|&k| k <= most), "{refills:?}");
        assert!(s.ready.len() <= (MAX_SPARE_BYTES >> 16) as usize);
        let mut s = Spares::new(16, false);
        s.want_topped_up();
        assert_eq!(s.refill_wanted(), 0, "disabled");
    }

    #[test]
    fn runs_of_consecutive_clusters() {
        assert_eq!(runs(&[5, 3, 4, 9, 10, 12]), vec![(3, 3), (9, 2), (12, 1)]);
        assert!(runs(&[]).is_empty());
    }
}
