//! One bitmap's bits in memory while a writer keeps it: set from any
//! thread without a lock (a write, a write-zeroes or a discard marks the
//! granules it touches), read whole when the bitmap is stored.

use std::sync::atomic::{AtomicU64, Ordering};

/// The bits of one bitmap over a disk of `size` bytes: bit `n` covers
/// guest bytes `[n * g, (n + 1) * g)`, `g` the granularity.
#[derive(Debug)]
pub(crate) struct DirtyBits {
    granularity_bits: u8,
    size: u64,
    words: Box<[AtomicU64]>,
}

impl DirtyBits {
    /// All clear.
    pub(crate) fn empty(granularity_bits: u8, size: u64) -> Self {
        let n = Self::words_for(granularity_bits, size);
        DirtyBits {
            granularity_bits,
            size,
            words: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// From the words read from an image (as many as the size needs).
    pub(crate) fn from_words(granularity_bits: u8, size: u64, words: &[u64]) -> Self {
        let bits = Self::empty(granularity_bits, size);
        bits.merge(words);
        bits
    }

    fn words_for(granularity_bits: u8, size: u64) -> usize {
        let bits = size.div_ceil(1u64 << granularity_bits);
        usize::try_from(bits.div_ceil(64)).unwrap_or(usize::MAX)
    }

    /// Bytes of guest data per bit.
    pub(crate) fn granularity(&self) -> u64 {
        1u64 << self.granularity_bits
    }

    /// Sets the bits of every granule `[offset, offset + len)` touches
    /// (clipped to the disk). Sequentially consistent: a store that loads
    /// the words after it saw no mark in flight sees this one.
    pub(crate) fn mark(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.size);
        if len == 0 || offset >= end {
            return;
        }
        let first = offset >> self.granularity_bits;
        let last = (end - 1) >> self.granularity_bits;
        let mut bit = first;
        while bit <= last {
            let word = (bit / 64) as usize;
            let from = bit % 64;
            let to = (last - word as u64 * 64).min(63);
            let mask = if to - from == 63 {
                u64::MAX
            } else {
                ((1u64 << (to - from + 1)) - 1) << from
            };
            if let Some(w) = self.words.get(word) {
                // Skipped when already set: no cache line bouncing for
                // the common rewrite of a dirty granule.
                if w.load(Ordering::Relaxed) & mask != mask {
                    w.fetch_or(mask, Ordering::SeqCst);
                }
            }
            bit = word as u64 * 64 + to + 1;
        }
    }

    /// Sets every bit set in `words`.
    pub(crate) fn merge(&self, words: &[u64]) {
        for (w, &add) in self.words.iter().zip(words) {
            if add != 0 {
                w.fetch_or(add, Ordering::SeqCst);
            }
        }
    }

    /// Clears every bit.
    pub(crate) fn clear(&self) {
        for w in self.words.iter() {
            w.store(0, Ordering::SeqCst);
        }
    }

    /// A copy over a disk of `size` bytes (a resize): the bits of the
    /// granules both sizes share, none past the new end.
    pub(crate) fn resized(&self, size: u64) -> DirtyBits {
        let out = DirtyBits::empty(self.granularity_bits, size);
        out.merge(&self.words());
        let bits = size.div_ceil(self.granularity());
        if let Some(last) = out.words.last() {
            let used = bits % 64;
            if used != 0 {
                last.fetch_and((1u64 << used) - 1, Ordering::SeqCst);
            }
        }
        out
    }

    /// The dirty guest ranges within `window` now, merged, clipped to it
    /// (only the words covering it read).
    pub(crate) fn ranges_in(&self, window: std::ops::Range<u64>) -> Vec<std::ops::Range<u64>> {
        let g = self.granularity();
        let words = crate::bitmaps::word_window(g, self.size, &window);
        let first = words.start;
        let words: Vec<u64> = self.words
            [words.start.min(self.words.len())..words.end.min(self.words.len())]
            .iter()
            .map(|w| w.load(Ordering::SeqCst))
            .collect();
        crate::bitmaps::ranges_in_window(&words, first, g, self.size, &window)
    }

    /// The words now.
    pub(crate) fn words(&self) -> Vec<u64> {
        self.words
            .iter()
            .map(|w| w.load(Ordering::SeqCst))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_bits(b: &DirtyBits) -> Vec<u64> {
        let mut out = Vec::new();
        for (i, w) in b.words().iter().enumerate() {
            for k in 0..64 {
                if w & (1 << k) != 0 {
                    out.push(i as u64 * 64 + k);
                }
            }
        }
        out
    }

    #[test]
    fn marks_every_granule_touched_and_no_other() {
        // 64 KiB granules over 20 MiB: 320 bits, 5 words.
        let b = DirtyBits::empty(16, 20 << 20);
        b.mark(65535, 2);
        assert_eq!(set_bits(&b), vec![0, 1]);
        b.mark(100 << 16, 130 << 16);
        let mut want = vec![0, 1];
        want.extend(100..230);
        assert_eq!(set_bits(&b), want);
        // Past the end: clipped; empty: nothing.
        b.mark((20 << 20) - 1, 1 << 30);
        b.mark(5 << 16, 0);
        want.push(319);
        assert_eq!(set_bits(&b), want);
        b.clear();
        assert!(set_bits(&b).is_empty());
        b.mark(0, 20 << 20);
        assert_eq!(set_bits(&b), (0..320).collect::<Vec<_>>());
    }

    #[test]
    fn resized_keeps_the_shared_granules_only() {
        // 64 KiB granules: 100 bits over 6.25 MiB.
        let b = DirtyBits::empty(16, 100 << 16);
        b.mark(0, 1);
        b.mark(70 << 16, 30 << 16);
        let grown = b.resized(200 << 16);
        let mut want = vec![0];
        want.extend(70..100);
        assert_eq!(set_bits(&grown), want);
        assert_eq!(grown.words().len(), 4);
        // Shrunk into the middle of a word: nothing past the end stays.
        let shrunk = b.resized(80 << 16);
        let mut want = vec![0];
        want.extend(70..80);
        assert_eq!(set_bits(&shrunk), want);
        assert_eq!(shrunk.words().len(), 2);
        assert_eq!(set_bits(&b.resized(64 << 16)), vec![0]);
    }

    #[test]
    fn ranges_in_a_window_are_the_whole_ranges_clipped() {
        // 4 KiB granules over 10 MiB less a sector: 2560 bits, 40 words.
        let size = (10 << 20) - 512;
        let b = DirtyBits::empty(12, size);
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..300 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            b.mark(state % size, (state >> 40) % 70_000);
        }
        b.mark(size - 1, 1);
        let whole = crate::bitmaps::dirty_ranges(&b.words(), 4096, size);
        assert!(whole.len() > 50, "{}", whole.len());
        for (start, end) in [
            (0, size),
            (0, 1),
            (4095, 4097),
            (1 << 20, 3 << 20),
            (262_143, 262_145 + 4096 * 64),
            (size - 1, size + 10_000),
            (size, size + 1),
            (5 << 20, 5 << 20),
        ] {
            let want: Vec<_> = whole
                .iter()
                .map(|r| r.start.max(start)..r.end.min(end))
                .filter(|r| r.start < r.end)
                .collect();
            assert_eq!(b.ranges_in(start..end), want, "{start}..{end}");
        }
    }

    #[test]
    fn merges_words() {
        let b = DirtyBits::from_words(9, 1 << 20, &[1, 0, 1 << 63]);
        b.merge(&[2]);
        assert_eq!(b.words()[..3], [3, 0, 1 << 63]);
        assert_eq!(b.granularity(), 512);
    }
}
