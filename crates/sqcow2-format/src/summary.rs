//! Which regions of the top hold nothing at all, so that an indexed lookup
//! there skips reading the top's L2 slice (one metadata read instead of
//! two on a cold miss). Conservative: a region is only ever marked
//! non-empty, never back.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::entry::OFFSET_MASK;
use crate::error::ErrorKind;
use crate::header::Header;
use crate::layer::read_l2_table;
use crate::storage::Storage;
use crate::types::GuestOffset;

/// Scanning the top stops past this much L2 metadata (every region is then
/// treated as non-empty).
const MAX_SCAN_BYTES: u64 = 64 << 20;

/// One bit per region of the top: set when the region may hold mappings.
#[derive(Debug)]
pub(crate) struct TopSummary {
    region_bits: u32,
    bits: Vec<AtomicU64>,
}

impl TopSummary {
    /// A summary where every region may hold mappings.
    fn full(region_bits: u32, size: u64) -> Self {
        let regions = size.div_ceil(1 << region_bits).max(1);
        Self {
            region_bits,
            bits: (0..regions.div_ceil(64))
                .map(|_| AtomicU64::new(u64::MAX))
                .collect(),
        }
    }

    /// Scans the top's L2 tables; regions are as large as one L2 slice of
    /// `slice_size` bytes covers.
    pub(crate) fn build(
        header: &Header,
        l1: &[u64],
        storage: &dyn Storage,
        slice_size: u64,
    ) -> Result<Self, ErrorKind> {
        let g = header.geometry;
        let entries_per_slice =
            slice_size.clamp(g.l2_entry_size(), g.cluster_size()) / g.l2_entry_size();
        let region_bits = (entries_per_slice * g.cluster_size()).trailing_zeros();
        let tables = l1.iter().filter(|e| *e & OFFSET_MASK != 0).count() as u64;
        if tables * g.cluster_size() > MAX_SCAN_BYTES {
            return Ok(Self::full(region_bits, header.virtual_size()));
        }
        let summary = Self::full(region_bits, header.virtual_size());
        summary
            .bits
            .iter()
            .for_each(|b| b.store(0, Ordering::Relaxed));
        let file_size = storage.len()?;
        let words = if g.extended_l2 { 2 } else { 1 };
        for (i, e) in l1.iter().enumerate() {
            let offset = e & OFFSET_MASK;
            if offset == 0 {
                continue;
            }
            let table = read_l2_table(g, storage, offset, file_size)?;
            for (k, chunk) in table
                .chunks((entries_per_slice as usize) * words)
                .enumerate()
            {
                if chunk.iter().any(|&w| w != 0) {
                    let guest = i as u64 * g.l2_coverage()
                        + ((k as u64 * entries_per_slice) << g.cluster_bits);
                    summary.mark(GuestOffset(guest));
                }
            }
        }
        Ok(summary)
    }

    /// Whether the region holding `guest` surely holds no mapping.
    pub(crate) fn is_empty(&self, guest: GuestOffset) -> bool {
        let r = guest.0 >> self.region_bits;
        self.bits
            .get((r / 64) as usize)
            .is_some_and(|b| b.load(Ordering::Acquire) & (1 << (r % 64)) == 0)
    }

    /// Bytes from `guest` to the end of its region.
    pub(crate) fn region_end(&self, guest: GuestOffset) -> u64 {
        ((guest.0 >> self.region_bits) + 1) << self.region_bits
    }

    /// Records that the region holding `guest` may now hold mappings.
    pub(crate) fn mark(&self, guest: GuestOffset) {
        let r = guest.0 >> self.region_bits;
        if let Some(b) = self.bits.get((r / 64) as usize) {
            b.fetch_or(1 << (r % 64), Ordering::AcqRel);
        }
    }
}
