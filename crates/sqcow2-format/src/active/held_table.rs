//! An L2 table held in memory for changes, in 4 KiB pages that a
//! write-back shares instead of copying: taking a write-back's copy under
//! the metadata lock costs a reference per changed page, whatever their
//! number, and a change to a page a write-back still holds copies that page
//! first (copy on write), so the write-back writes the table as it was when
//! it was taken.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use crate::dirty::{DirtyPages, PAGE};
use crate::error::ErrorKind;
use crate::layer::{slice_status, LayerStatus};
use crate::types::{Geometry, GuestOffset};

/// An L2 table's entries as the file holds them (big-endian words), page
/// by page: a write-back writes the pages themselves.
#[derive(Debug, Clone)]
pub(crate) struct HeldTable {
    pages: Vec<Arc<[u8]>>,
    /// Words per page: a page's, or the whole table's if smaller.
    page_words: usize,
    /// Words in the table.
    len: usize,
}

/// Pages of a table shared with a write-back, adjacent in the file from
/// `at` on.
#[derive(Debug)]
pub(crate) struct PageRun {
    pub(crate) at: u64,
    pages: Vec<Arc<[u8]>>,
}

impl PageRun {
    /// The pages' bytes, in order.
    pub(crate) fn parts(&self) -> Vec<&[u8]> {
        self.pages.iter().map(|p| &p[..]).collect()
    }
}

impl HeldTable {
    /// A table of `words` (a whole L2 table's).
    pub(crate) fn from_words(words: &[u64]) -> Self {
        let page_words = (PAGE / 8).min(words.len()).max(1);
        Self {
            len: words.len(),
            pages: words
                .chunks(page_words)
                .map(|chunk| {
                    let mut page = Vec::with_capacity(chunk.len() * 8);
                    for w in chunk {
                        page.extend_from_slice(&w.to_be_bytes());
                    }
                    Arc::from(page)
                })
                .collect(),
            page_words,
        }
    }

    /// An empty table of `words` words. Whole pages share one page of
    /// zeros, which a change copies first: a new table costs no memory
    /// until it is written (the 16 pages of a 64 KiB table, built and
    /// faulted in, took ~100 µs under the metadata lock on a VM, for each
    /// table a fresh top makes).
    pub(crate) fn zeroed(words: usize) -> Self {
        let page_words = PAGE / 8;
        if words < page_words || words % page_words != 0 {
            return Self::from_words(&vec![0; words]);
        }
        static ZEROS: OnceLock<Arc<[u8]>> = OnceLock::new();
        let zeros = ZEROS.get_or_init(|| Arc::from(vec![0u8; PAGE]));
        Self {
            pages: vec![zeros.clone(); words / page_words],
            page_words,
            len: words,
        }
    }

    /// Its length in words.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Word `i`.
    ///
    /// # Panics
    ///
    /// If `i` is past the table (callers index by an L2 index of the
    /// table's geometry).
    pub(crate) fn get(&self, i: usize) -> u64 {
        word(&self.pages[i / self.page_words], i % self.page_words)
    }

    /// Sets word `i`, copying its page first if a write-back holds it.
    pub(crate) fn set(&mut self, i: usize, value: u64) {
        let at = i % self.page_words * 8;
        let page = Arc::make_mut(&mut self.pages[i / self.page_words]);
        page[at..at + 8].copy_from_slice(&value.to_be_bytes());
    }

    /// A copy of words `range` (`None` past the table).
    pub(crate) fn words(&self, range: Range<usize>) -> Option<Vec<u64>> {
        if range.start > range.end || range.end > self.len() {
            return None;
        }
        let mut out = Vec::with_capacity(range.len());
        let mut i = range.start;
        while i < range.end {
            let page = &self.pages[i / self.page_words];
            let from = i % self.page_words;
            let to = (page.len() / 8).min(from + (range.end - i));
            out.extend(page[from * 8..to * 8].chunks_exact(8).map(|c| {
                let mut bytes = [0u8; 8];
                bytes.copy_from_slice(c);
                u64::from_be_bytes(bytes)
            }));
            i += to - from;
        }
        Some(out)
    }

    /// The mapping of `[guest, guest + max)` (within this table), as
    /// [`slice_status`] over the whole table, possibly shortened to a page.
    pub(crate) fn status(
        &self,
        g: Geometry,
        guest: GuestOffset,
        max: u64,
    ) -> Result<(LayerStatus, u64), ErrorKind> {
        let per_entry = if g.extended_l2 { 2 } else { 1 };
        let entries_per_page = (self.page_words / per_entry) as u64;
        let index = g.l2_index(guest);
        let page = &self.pages[(index / entries_per_page) as usize];
        let page_end_entry =
            index / entries_per_page * entries_per_page + (page.len() / 8 / per_entry) as u64;
        // Only the entries `max` covers, from `guest`'s on.
        let l1_base = g.l1_index(guest) * g.l2_coverage();
        let page_end = l1_base + page_end_entry * g.cluster_size();
        let max = max.min(page_end - guest.0);
        let last_entry = g.l2_index(GuestOffset(guest.0 + max.max(1) - 1));
        let first_word = (index % entries_per_page) as usize * per_entry;
        let count = (last_entry - index + 1) as usize * per_entry;
        let mut words = [0u64; PAGE / 8];
        for (i, w) in words[..count].iter_mut().enumerate() {
            *w = word(page, first_word + i);
        }
        slice_status(g, &words[..count], index, guest, max)
    }

    /// The pages `dirty` names, shared (no copy), in runs of adjacent
    /// pages; the table lies at `offset` in the file.
    pub(crate) fn share(&self, offset: u64, dirty: &DirtyPages) -> Vec<PageRun> {
        dirty
            .ranges(self.len() * 8)
            .into_iter()
            .map(|bytes: Range<usize>| {
                let first = bytes.start / 8 / self.page_words;
                let last = (bytes.end / 8).div_ceil(self.page_words);
                PageRun {
                    at: offset + bytes.start as u64,
                    pages: self.pages[first..last].to_vec(),
                }
            })
            .collect()
    }
}

/// Word `i` of a page of big-endian words.
fn word(page: &[u8], i: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&page[i * 8..i * 8 + 8]);
    u64::from_be_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_tables_share_a_page_of_zeros_until_changed() {
        let mut a = HeldTable::zeroed(8192);
        let b = HeldTable::zeroed(8192);
        assert!(Arc::ptr_eq(&a.pages[0], &b.pages[15]));
        a.set(513, 9);
        assert_eq!((a.get(513), b.get(513), a.get(512)), (9, 0, 0));
        assert!(
            !Arc::ptr_eq(&a.pages[1], &b.pages[1]),
            "copied before the change"
        );
        assert!(Arc::ptr_eq(&a.pages[0], &b.pages[0]));
        assert_eq!(b.words(0..8192), Some(vec![0; 8192]));
        // Smaller than a page: a table of its own.
        let mut small = HeldTable::zeroed(64);
        small.set(63, 1);
        assert_eq!(small.words(60..64), Some(vec![0, 0, 0, 1]));
        assert_eq!(HeldTable::zeroed(64).get(63), 0);
    }

    #[test]
    fn a_change_after_sharing_leaves_the_shared_pages_as_they_were() {
        let mut t = HeldTable::zeroed(8192);
        t.set(0, 1);
        t.set(600, 2);
        let mut dirty = DirtyPages::default();
        dirty.mark(0);
        dirty.mark(600 * 8);
        let runs = t.share(0x10000, &dirty);
        assert_eq!(runs.len(), 1, "pages 0 and 1 are adjacent");
        assert_eq!(runs[0].at, 0x10000);
        t.set(0, 7);
        t.set(601, 8);
        let bytes = runs[0].parts().concat();
        assert_eq!(bytes.len(), 2 * PAGE);
        assert_eq!(bytes[..8], 1u64.to_be_bytes());
        assert_eq!(bytes[600 * 8..601 * 8], 2u64.to_be_bytes());
        assert_eq!(bytes[601 * 8..602 * 8], 0u64.to_be_bytes());
        assert_eq!((t.get(0), t.get(600), t.get(601)), (7, 2, 8));
        assert_eq!(t.words(599..602), Some(vec![0, 2, 8]));
        assert_eq!(t.words(8190..8193), None);
    }

    /// The status of every position agrees with the status over the
    /// whole table (cut at the page's end), for standard and extended
    /// entries: runs of allocated, zero and unallocated clusters.
    #[test]
    fn status_by_page_agrees_with_the_whole_table() {
        use crate::entry::{COPIED, ZERO};
        for extended_l2 in [false, true] {
            let g = Geometry {
                cluster_bits: 16,
                extended_l2,
            };
            let per = if extended_l2 { 2 } else { 1 };
            let entries = (g.cluster_size() / g.l2_entry_size()) as usize;
            let mut rng = fastrand::Rng::with_seed(7);
            let mut words = vec![0u64; entries * per];
            let mut host = 1u64 << 30;
            for e in 0..entries {
                let (entry, bitmap) = match rng.u8(0..4) {
                    0 => (0, 0),
                    1 if !extended_l2 => (ZERO, 0),
                    1 => (0, 0xffff_ffff << 32),
                    2 => {
                        host += g.cluster_size();
                        (host | COPIED, if extended_l2 { 0xffff_ffff } else { 0 })
                    }
                    _ => {
                        host += 3 * g.cluster_size();
                        (host | COPIED, if extended_l2 { 0xffff_ffff } else { 0 })
                    }
                };
                words[e * per] = entry;
                if extended_l2 {
                    words[e * per + 1] = bitmap;
                }
            }
            let held = HeldTable::from_words(&words);
            let entries_per_page = (PAGE / 8 / per) as u64;
            for _ in 0..2000 {
                let guest = GuestOffset(rng.u64(0..entries as u64 * g.cluster_size()));
                let max = rng.u64(1..=8 * g.cluster_size());
                let max = max.min(entries as u64 * g.cluster_size() - guest.0);
                let page_end = (g.l2_index(guest) / entries_per_page + 1)
                    * entries_per_page
                    * g.cluster_size();
                let want = slice_status(g, &words, 0, guest, max.min(page_end - guest.0));
                let got = held.status(g, guest, max).expect("valid entries");
                assert_eq!(got, want.expect("valid entries"), "at {guest:?} for {max}");
            }
        }
    }

    #[test]
    fn a_table_smaller_than_a_page_is_one_page() {
        // 512-byte clusters: 64 entries.
        let mut t = HeldTable::zeroed(64);
        t.set(63, 5);
        let runs = t.share(0, &DirtyPages::all(64 * 8));
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].parts().concat().len(), 512);
        assert_eq!(t.len(), 64);
        assert_eq!(t.words(0..64).map(|w| w[63]), Some(5));
    }
}
