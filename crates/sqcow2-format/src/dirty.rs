//! Which 4 KiB pages of a metadata cluster (an L2 table, a refcount block)
//! changed since it was last written: a write-back writes those pages, not
//! the whole cluster, so that a change of one entry dirties one page of
//! the page cache and costs one page at the next sync.

use std::ops::Range;

/// Changed parts of metadata copied for a write-back: (file offset, bytes).
pub(crate) type PageWrites = Vec<(u64, Vec<u8>)>;

/// Bytes written back together: a page.
pub(crate) const PAGE: usize = 4096;

/// The changed pages of one metadata cluster, by byte offset.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct DirtyPages(Vec<u64>);

impl DirtyPages {
    /// Every page of a cluster of `len` bytes.
    pub(crate) fn all(len: usize) -> Self {
        let mut d = DirtyPages::default();
        for at in (0..len).step_by(PAGE) {
            d.mark(at);
        }
        d
    }

    /// Marks the page holding byte `at`; whether it was not marked yet.
    pub(crate) fn mark(&mut self, at: usize) -> bool {
        let page = at / PAGE;
        if self.0.len() <= page / 64 {
            self.0.resize(page / 64 + 1, 0);
        }
        let bit = 1 << (page % 64);
        let new = self.0[page / 64] & bit == 0;
        self.0[page / 64] |= bit;
        new
    }

    /// How many pages are marked.
    pub(crate) fn count(&self) -> u64 {
        self.0.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Marks every page `other` marks; how many were not marked yet.
    pub(crate) fn add(&mut self, other: &DirtyPages) -> u64 {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        let mut new = 0;
        for (w, o) in self.0.iter_mut().zip(&other.0) {
            new += u64::from((o & !*w).count_ones());
            *w |= o;
        }
        new
    }

    /// Whether the page holding byte `at` changed.
    pub(crate) fn contains(&self, at: usize) -> bool {
        let page = at / PAGE;
        self.0
            .get(page / 64)
            .is_some_and(|w| w & (1 << (page % 64)) != 0)
    }

    /// Whether any page changed.
    pub(crate) fn any(&self) -> bool {
        self.0.iter().any(|w| *w != 0)
    }

    /// The changed pages' byte ranges within a cluster of `len` bytes,
    /// adjacent ones merged.
    pub(crate) fn ranges(&self, len: usize) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for (w, bits) in self.0.iter().enumerate() {
            for b in 0..64 {
                if bits & (1 << b) == 0 {
                    continue;
                }
                let lo = (w * 64 + b) * PAGE;
                let hi = (lo + PAGE).min(len);
                if lo >= hi {
                    continue;
                }
                match out.last_mut() {
                    Some(r) if r.end == lo => r.end = hi,
                    _ => out.push(lo..hi),
                }
            }
        }
        out
    }

    /// Marks everything written.
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_adjacent_pages_and_clip_to_the_cluster() {
        let mut d = DirtyPages::default();
        assert!(!d.any());
        d.mark(0);
        d.mark(PAGE + 7);
        d.mark(5 * PAGE);
        assert!(d.contains(PAGE) && !d.contains(2 * PAGE));
        assert_eq!(d.ranges(64 * 1024), vec![0..2 * PAGE, 5 * PAGE..6 * PAGE]);
        // A cluster smaller than a page: one range, its whole length.
        assert_eq!(DirtyPages::all(512).ranges(512), vec![0..512]);
        // Pages past the cluster's end are never reported.
        assert_eq!(d.ranges(PAGE + 100), vec![0..PAGE + 100]);
        let all = DirtyPages::all(2 << 20);
        assert_eq!(all.ranges(2 << 20), vec![0..2 << 20]);
        assert_eq!(d.count(), 3);
        assert!(!d.mark(5 * PAGE + 1), "marked already");
        let mut e = DirtyPages::default();
        assert!(e.mark(9 * PAGE));
        assert_eq!(e.add(&d), 3);
        assert_eq!(e.add(&d), 0);
        assert_eq!(e.count(), 4);
        d.clear();
        assert!(!d.any() && d.ranges(PAGE).is_empty());
    }
}
