//! Resolved slices (indexed mode): for 256 consecutive granules, the
//! mapping as the top gives it, or the index entry where the top holds
//! nothing, built from the top's L2 slice and the index slice and kept in
//! the unified cache. A cached lookup is one cache access, whatever the
//! chain length.
//!
//! A change of the top's mapping bumps a generation counter and then drops
//! the slices it covers, under the metadata lock; a slice built across such
//! a change is never inserted (the generation is checked under the cache
//! shard's lock), so a lookup that starts after a change completed never
//! finds the old mapping.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::entry::CompressedDescriptor;
use crate::error::Error;
use crate::index::{decode_at, ChainIndex, IndexEntry};
use crate::layer::LayerStatus;
use crate::types::{GuestOffset, HostOffset, LayerIndex};
use sqcow2_cache::{Slice, SliceKey, Source};

use super::{Chain, Extent, ExtentKind};

/// Words of the filter of resolved slices looked up once.
const TOUCHED_WORDS: usize = 256;
/// log2 of the granules per resolved slice (256: a 4 KiB slice).
const RESOLVED_ENTRIES_BITS: u32 = 8;

/// State of the resolved slices of one chain (the slices themselves live
/// in the unified cache).
#[derive(Debug)]
pub(super) struct ResolvedSlices {
    /// Their number in the unified cache (unique in the process: a chain
    /// that follows another at a live snapshot shares its cache).
    id: u32,
    /// log2 of the granule (the smaller of the top's subcluster and the
    /// index chunk).
    bits: u32,
    /// Bumped whenever the top's mapping changes.
    generation: AtomicU64,
    /// Slices looked up once (a lossy bit filter): built on the second
    /// lookup, so that a cold lookup reads only what it needs.
    touched: Box<[AtomicU64]>,
}

impl ResolvedSlices {
    pub(super) fn new(bits: u32) -> Self {
        ResolvedSlices {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            bits,
            generation: AtomicU64::new(0),
            touched: (0..TOUCHED_WORDS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// log2 of the granule.
    pub(super) fn bits(&self) -> u32 {
        self.bits
    }

    fn key(&self, slice_no: u64) -> SliceKey {
        SliceKey {
            source: Source::Resolved(self.id),
            offset: slice_no,
        }
    }

    /// Whether slice `slice_no` is looked up for the first time (and
    /// remembers that it was).
    fn first_lookup(&self, slice_no: u64) -> bool {
        let bit = (slice_no.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 50) as usize;
        let word = &self.touched[(bit / 64) % TOUCHED_WORDS];
        let mask = 1u64 << (bit % 64);
        if word.load(Ordering::Relaxed) & mask == 0 {
            word.fetch_or(mask, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// Forgets which slices were looked up (the cache was emptied).
    pub(super) fn forget_lookups(&self) {
        self.touched
            .iter()
            .for_each(|w| w.store(0, Ordering::Relaxed));
    }
}

/// Numbers of the chains' resolved slices in this process.
static NEXT_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl Chain {
    /// The extent at `start` from the cache of resolved slices (top and
    /// index combined, one lookup whatever the chain length); `None` where
    /// the index says to walk. `ci` covers every layer below the top.
    pub(super) fn resolved_extent(
        &self,
        ci: &ChainIndex,
        start: GuestOffset,
        max: u64,
    ) -> Result<Option<Extent>, Error> {
        let bits = self.resolved.bits;
        let slice_no = start.0 >> (bits + RESOLVED_ENTRIES_BITS);
        let key = self.resolved.key(slice_no);
        // A slice never looked up since the cache was emptied cannot be
        // cached: answer directly (reading only what this lookup needs) and
        // remember it; build the resolved slice from the next lookup on.
        if self.resolved.first_lookup(slice_no) {
            return Ok(None);
        }
        let words = match self.cache.get(key) {
            Some(w) => w,
            None => {
                let generation = self.resolved.generation.load(Ordering::SeqCst);
                let built = self.build_resolved(ci, slice_no)?;
                // Kept only if no mapping changed meanwhile: checked under
                // the shard lock that `mapping_changed`'s removal takes
                // after bumping the generation. (This lookup itself may use
                // the slice: it began before the change completed.)
                self.cache.insert_if(key, built.clone(), || {
                    self.resolved.generation.load(Ordering::SeqCst) == generation
                });
                built
            }
        };
        let granule = 1u64 << bits;
        let first = (start.0 >> bits) & ((1 << RESOLVED_ENTRIES_BITS) - 1);
        let decode = |i: u64| {
            let i = i as usize * 2;
            IndexEntry::decode(words[i], words[i + 1])
        };
        let Some(entry) = decode(first) else {
            return Ok(None);
        };
        if entry == IndexEntry::Walk {
            return Ok(None);
        }
        let granule_start = start.0 & !(granule - 1);
        let mut len = (granule_start + granule - start.0).min(max);
        // Extend over following granules of the slice with the same mapping.
        let mut i = first + 1;
        while len < max && i < 1 << RESOLVED_ENTRIES_BITS {
            let next = decode(i);
            let delta = granule_start + (i - first) * granule;
            let same = match (entry, next) {
                (
                    IndexEntry::Data { layer: a, host: h },
                    Some(IndexEntry::Data { layer: b, host: k }),
                ) => a == b && k == h + (delta - granule_start),
                (IndexEntry::Zero { layer: a }, Some(IndexEntry::Zero { layer: b })) => a == b,
                (IndexEntry::None, Some(IndexEntry::None)) => true,
                _ => false,
            };
            if !same {
                break;
            }
            len = (len + granule).min(max);
            i += 1;
        }
        let layer = LayerIndex(entry.layer().unwrap_or(0) as usize);
        let kind = match entry {
            IndexEntry::Data { host, .. } => ExtentKind::Data {
                host: HostOffset(host + (start.0 - granule_start)),
            },
            IndexEntry::Compressed { layer, l2_entry } => {
                let Some(h) = self.layers.get(layer as usize).and_then(|l| l.header()) else {
                    return Ok(None);
                };
                ExtentKind::Compressed(CompressedDescriptor::decode(l2_entry, h.geometry))
            }
            IndexEntry::Zero { .. } => ExtentKind::Zero {
                host: None,
                allocated: true,
            },
            IndexEntry::None => ExtentKind::Zero {
                host: None,
                allocated: false,
            },
            IndexEntry::Walk => return Ok(None),
        };
        if layer.0 > self.top_index().0 {
            return Ok(None);
        }
        Ok(Some(Extent {
            start,
            len,
            layer,
            kind,
        }))
    }

    /// Builds resolved slice `slice_no`: each granule from the top, or from
    /// the index where the top does not hold it.
    fn build_resolved(&self, ci: &ChainIndex, slice_no: u64) -> Result<Slice, Error> {
        let bits = self.resolved.bits;
        let granule = 1u64 << bits;
        let n = 1u64 << RESOLVED_ENTRIES_BITS;
        let start = slice_no << (bits + RESOLVED_ENTRIES_BITS);
        let size = self.virtual_size();
        let end = (start + n * granule).min(size);
        let top = self.top_index();
        let mut words = vec![0u64; (n * 2) as usize];
        let mut put = |pos: u64, e: IndexEntry| {
            let i = (((pos - start) >> bits) * 2) as usize;
            let [a, b] = e.encode();
            words[i] = a;
            words[i + 1] = b;
        };
        // The index slice in use: (slice number, its words).
        let mut current: Option<(u64, Option<Slice>)> = None;
        let mut index_entry = |g: u64| -> Result<IndexEntry, Error> {
            let bits = ci.geometry().granularity_bits;
            let chunk = g >> bits;
            let per = ci.entries_per_slice();
            let slice_no = chunk / per;
            if current.as_ref().is_none_or(|(n, _)| *n != slice_no) {
                match ci.slice(slice_no, &self.cache) {
                    Ok(Some(words)) => current = Some((slice_no, words)),
                    Ok(None) => return Ok(IndexEntry::Walk),
                    Err(kind) => return Err(Error::new(ci.path(), kind)),
                }
            }
            let entry = match current.as_ref().and_then(|(_, w)| w.as_ref()) {
                Some(words) => decode_at(words, chunk % per).unwrap_or(IndexEntry::Walk),
                None => IndexEntry::None,
            };
            Ok(match entry {
                // A granule inside a larger chunk: offset the host.
                IndexEntry::Data { layer, host } => IndexEntry::Data {
                    layer,
                    host: host + (g - (chunk << bits)),
                },
                e => e,
            })
        };
        let mut pos = start;
        while pos < end {
            let (status, len) = self.layer_status(top, GuestOffset(pos), end - pos, false)?;
            let run_end = pos + len;
            let mut g = pos;
            while g < run_end {
                let entry = match status {
                    LayerStatus::Data { host } => IndexEntry::Data {
                        layer: top.0 as u32,
                        host: host.0 + (g - pos),
                    },
                    LayerStatus::Compressed(d) => IndexEntry::Compressed {
                        layer: top.0 as u32,
                        l2_entry: d.encode(self.top_geometry),
                    },
                    LayerStatus::Zero { .. } => IndexEntry::Zero {
                        layer: top.0 as u32,
                    },
                    LayerStatus::Unallocated { .. } => index_entry(g)?,
                };
                put(g, entry);
                g += granule;
            }
            pos = run_end.max(pos + 1);
        }
        Ok(words.into())
    }

    /// Drops resolved slices covering `[offset, offset + len)` after the
    /// top's mapping changed there. Called under the metadata lock of the
    /// change, so no lookup after the change can find the old mapping.
    pub(super) fn mapping_changed(&self, offset: GuestOffset, len: u64) {
        self.resolved.generation.fetch_add(1, Ordering::SeqCst);
        let shift = self.resolved.bits + RESOLVED_ENTRIES_BITS;
        let last = (offset.0 + len.max(1) - 1) >> shift;
        for slice_no in offset.0 >> shift..=last {
            self.cache.remove(self.resolved.key(slice_no));
        }
    }
}
