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
//! sync is paid once per batch of spares. Any other allocation (a
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
/// worst until the next read-write open repairs it): the batch a top
/// prepared ahead of a burst of allocations asks for
/// ([`Spares::want_full_batch`]).
const MAX_SPARE_BYTES: u64 = 16 << 20;
/// Most bytes a refill on demand prepares: it runs on the path of the
/// write that asked for it, and a filesystem that fills the space in
/// (tmpfs zeroes the pages) took long enough over 16 MiB to be that
/// write's latency (measured: the longest write 40-60 ms against 10-12 ms
/// with 1 MiB).
const MAX_REFILL_BYTES: u64 = 1 << 20;
/// Most spare clusters prepared at once.
const MAX_BATCH: usize = 1024;
/// The first batch; each refill doubles it up to [`MAX_REFILL_BYTES`], so
/// that an image written a little does not get a megabyte of spares.
const FIRST_BATCH: usize = 8;

/// The spare clusters of the writable top (cluster indices).
#[derive(Debug)]
pub(crate) struct Spares {
    ready: VecDeque<u64>,
    /// Size of the next batch.
    batch: usize,
    /// Size of the last batch: the next is prepared once half of it is
    /// left.
    last: usize,
    /// The largest batch asked for ahead of demand, and on demand.
    max_batch: usize,
    max_refill: usize,
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
        let clusters = |bytes: u64| {
            if enabled {
                ((bytes >> cluster_bits) as usize).clamp(1, MAX_BATCH)
            } else {
                0
            }
        };
        let (max_batch, max_refill) = (clusters(MAX_SPARE_BYTES), clusters(MAX_REFILL_BYTES));
        Spares {
            ready: VecDeque::new(),
            batch: FIRST_BATCH.min(max_refill),
            last: 0,
            max_batch,
            max_refill,
            wanted: false,
            made: false,
        }
    }

    /// The lowest spare, if any.
    pub(crate) fn take(&mut self) -> Option<u64> {
        self.wanted = true;
        self.ready.pop_front()
    }

    /// How many clusters to prepare now (0: none): when allocations asked
    /// for spares and at most half of the last batch is left.
    pub(crate) fn refill_wanted(&mut self) -> usize {
        if !self.wanted || self.batch == 0 || self.ready.len() > self.last / 2 {
            return 0;
        }
        self.wanted = false;
        let n = self.batch;
        self.last = n;
        self.batch = (self.batch * 2).min(self.max_refill);
        n
    }

    /// Asks for the largest batch at the next refill (a top prepared for
    /// a burst of allocations, as after a live snapshot's switch).
    pub(crate) fn want_full_batch(&mut self) {
        self.wanted = true;
        self.batch = self.max_batch;
    }

    /// Preparing a batch failed (a full filesystem): start small again.
    pub(crate) fn failed(&mut self) {
        self.batch = FIRST_BATCH.min(self.max_refill);
        self.last = 0;
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

    #[test]
    fn batches_grow_and_refill_only_on_demand() {
        let mut s = Spares::new(16, true);
        assert_eq!(s.refill_wanted(), 0, "nobody asked");
        assert_eq!(s.take(), None);
        assert_eq!(s.refill_wanted(), FIRST_BATCH);
        assert_eq!(s.refill_wanted(), 0, "one refill per demand");
        s.add(&[10, 8, 9, 11, 12, 13, 14, 15]);
        assert_eq!(s.take(), Some(8));
        assert_eq!(s.refill_wanted(), 0, "7 of 8 left");
        for _ in 0..3 {
            s.take();
        }
        assert_eq!(s.refill_wanted(), 16, "half of the last batch left");
        s.add(&(16..32).collect::<Vec<_>>());
        for _ in 0..12 {
            s.take();
        }
        assert_eq!(s.refill_wanted(), 16, "a refill on demand: at most 1 MiB");
        let mut s = Spares::new(21, true); // 2 MiB clusters: at most 8
        for _ in 0..5 {
            s.take();
            assert!(s.refill_wanted() <= 8);
        }
        let mut s = Spares::new(16, false);
        assert_eq!(s.take(), None);
        assert_eq!(s.refill_wanted(), 0, "disabled");
    }

    #[test]
    fn a_full_batch_is_asked_for_ahead_of_demand() {
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
            "on demand again afterwards"
        );
        let mut s = Spares::new(16, false);
        s.want_full_batch();
        assert_eq!(s.refill_wanted(), 0, "disabled");
    }

    #[test]
    fn runs_of_consecutive_clusters() {
        assert_eq!(runs(&[5, 3, 4, 9, 10, 12]), vec![(3, 3), (9, 2), (12, 1)]);
        assert!(runs(&[]).is_empty());
    }
}
