//! The chain index parser: any bytes as a `.sqidx` file. Opening must
//! return an index or a stale reason, and lookups through a parsed index
//! must return entries or `None`, never panic or read without bound.
//!
//! Input: `[flags][index bytes]`. Unless flags bit 0 is set, the target
//! first rewrites the checksums (header, layer table, L1, slices) to match
//! the bytes, so that mutations reach the structures behind them; with the
//! bit set the checksums are checked as given.

#![no_main]

use std::path::Path;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use sqcow2_cache::{CacheConfig, SliceCache};
use sqcow2_format::index::{ChainIndex, ENTRY_SIZE, INDEX_HEADER_LEN, SLICE_ENTRIES_BITS};
use sqcow2_format::storage::MemStorage;

fn be_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn range(len: usize, offset: u64, size: u64) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(usize::try_from(size).ok()?)?;
    (end <= len).then_some(start..end)
}

/// Recomputes every checksum the parser verifies, where the structure it
/// covers lies inside the file.
fn reseal(b: &mut [u8]) -> Option<()> {
    let header = INDEX_HEADER_LEN as usize;
    if b.len() < header {
        return None;
    }
    // Layer table: records then a u64 CRC-32C of them.
    if let Some(r) = range(b.len(), be_u64(b, 48)?, be_u64(b, 56)?).filter(|r| r.len() >= 8) {
        let crc = u64::from(crc32c::crc32c(&b[r.start..r.end - 8]));
        b[r.end - 8..r.end].copy_from_slice(&crc.to_be_bytes());
    }
    // L1: (slice offset u64, slice checksum u32, pad) records.
    let slices = be_u64(b, 72)?;
    if let Some(r) = range(b.len(), be_u64(b, 64)?, slices.checked_mul(ENTRY_SIZE)?) {
        let slice_bytes = (1u64 << SLICE_ENTRIES_BITS) * ENTRY_SIZE;
        for rec in r.clone().step_by(16) {
            let offset = be_u64(b, rec)?;
            if let Some(s) = range(b.len(), offset, slice_bytes) {
                let sum = xxhash_rust::xxh3::xxh3_64(&b[s]) as u32;
                b[rec + 8..rec + 12].copy_from_slice(&sum.to_be_bytes());
            }
        }
        let crc = crc32c::crc32c(&b[r]);
        b[88..92].copy_from_slice(&crc.to_be_bytes());
    }
    b[80..84].fill(0);
    let crc = crc32c::crc32c(&b[..header]);
    b[80..84].copy_from_slice(&crc.to_be_bytes());
    Some(())
}

fuzz_target!(|data: &[u8]| {
    let [flags, rest @ ..] = data else {
        return;
    };
    let mut bytes = rest.to_vec();
    if flags & 1 == 0 {
        reseal(&mut bytes);
    }
    let storage = Arc::new(MemStorage::new(bytes));
    let Ok(index) = ChainIndex::open(Path::new("fuzz.sqidx"), storage) else {
        return;
    };
    let cache = SliceCache::new(CacheConfig {
        budget: 1 << 20,
        ..CacheConfig::default()
    });
    let chunks = index.geometry().chunks();
    let step = (chunks / 512).max(1);
    let mut chunk = 0;
    while chunk < chunks {
        if let Ok(Some(entry)) = index.entry(chunk, &cache) {
            let _ = entry.layer();
        }
        chunk += step;
    }
    let _ = index.entry(u64::MAX, &cache);
    let layers = index.layers().to_vec();
    let ok = vec![true; layers.len()];
    let _ = index.matches(&layers, &ok, index.geometry().covered_size, 21);
    let _ = index.heap_bytes();
});
