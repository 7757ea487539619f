//! Resolution layer by layer (QEMU's block-status walk) and through the
//! chain index; the whole-disk map.

use std::path::PathBuf;

use sqcow2_cache::{Slice, SliceCache};

use crate::backing::resolve_backing_path;
use crate::entry::CompressedDescriptor;
use crate::error::{Error, ErrorKind, WithPath};
use crate::index::{ChainIndex, IndexEntry, IndexGeometry};
use crate::layer::{Layer, LayerStatus};
use crate::sqcow2_ext::granularity_bits;
use crate::types::{GuestOffset, HostOffset, LayerIndex};

use super::{Chain, Extent, ExtentKind, IndexView};

impl Chain {
    pub(super) fn layer_status(
        &self,
        index: LayerIndex,
        guest: GuestOffset,
        max: u64,
        precise: bool,
    ) -> Result<(LayerStatus, u64), Error> {
        let layer = &self.layers[index.0];
        if let (Some(summary), true) = (&self.summary, index == self.top_index()) {
            if summary.is_empty(guest) {
                let len = max.min(summary.region_end(guest) - guest.0);
                return Ok((LayerStatus::Unallocated { host: None }, len));
            }
        }
        if let (Some(active), true) = (&self.active, index == self.top_index()) {
            return active.status(guest, max);
        }
        match layer {
            Layer::Qcow2(q) => q
                .status(index, guest, max, &self.cache, self.slice_size)
                .with_path(layer.path()),
            Layer::Raw(r) => Ok(r.status(guest, max, precise)),
        }
    }

    /// Resolves the mapping of `[start, start + max)` (which must lie within
    /// the virtual size): the first run with one mapping. `precise` asks
    /// raw layers for their holes (for `map`; reads do not need it).
    ///
    /// For read-outs (map, convert's hole detection, lookup benchmarks).
    /// A caller that moves data at the host offsets itself must hold a
    /// [`crate::TransferTicket`] from before the lookup: use
    /// [`crate::Transfers::resolve_for_read`], which takes it.
    pub fn resolve(&self, start: GuestOffset, max: u64, precise: bool) -> Result<Extent, Error> {
        let index = self.index.load();
        let covering = index.usable();
        if let (false, Some((ci, upto))) = (precise, covering) {
            // Resolved slices combine the top with an index that covers
            // every layer below it (none while layers are pending).
            if upto.0 + 1 == self.top_index().0 {
                if let Some(extent) = self.resolved_extent(ci, start, max)? {
                    return Ok(extent);
                }
            }
        }
        self.walk_from(covering, self.top_index(), start, max, precise)
    }

    /// [`Chain::resolve`] starting at layer `index` instead of the top
    /// (`start` must lie within that layer's virtual size).
    pub(super) fn resolve_from(
        &self,
        index: LayerIndex,
        start: GuestOffset,
        max: u64,
        precise: bool,
    ) -> Result<Extent, Error> {
        let guard = self.index.load();
        self.walk_from(guard.usable(), index, start, max, precise)
    }

    /// Walks down from layer `index`; below the lowest layer the index
    /// `covering` does not cover, asks the index.
    fn walk_from(
        &self,
        covering: Option<(&ChainIndex, LayerIndex)>,
        mut index: LayerIndex,
        start: GuestOffset,
        max: u64,
        precise: bool,
    ) -> Result<Extent, Error> {
        let mut len = max;
        // Starting at the index's own top layer (a copy-on-write's source,
        // right below the top): the index answers at once.
        if let (Some((ci, upto)), false) = (covering, precise) {
            if index == upto {
                if let Some(extent) = self.index_extent(ci, upto, start, len)? {
                    return Ok(extent);
                }
            }
        }
        loop {
            let (status, n) = self.layer_status(index, start, len, precise)?;
            len = n;
            if let (LayerStatus::Unallocated { .. }, Some((ci, upto))) = (&status, covering) {
                if index.0 == upto.0 + 1 {
                    if let Some(mut extent) = self.index_extent(ci, upto, start, len)? {
                        if precise
                            && matches!(
                                extent.kind,
                                ExtentKind::Zero {
                                    allocated: false,
                                    ..
                                }
                            )
                        {
                            // Where a walk would have ended (`map` shows
                            // it as the depth); reads need not know.
                            extent.layer = self.walk_end_unallocated(index, start, &mut extent.len);
                        }
                        return Ok(extent);
                    }
                }
            }
            let kind = match status {
                LayerStatus::Data { host } => ExtentKind::Data { host },
                LayerStatus::Compressed(d) => ExtentKind::Compressed(d),
                LayerStatus::Zero { host } => ExtentKind::Zero {
                    host,
                    allocated: true,
                },
                LayerStatus::Unallocated { host } => {
                    let below = index.0.checked_sub(1).map(|i| &self.layers[i]);
                    match below {
                        Some(below) if start.0 < below.virtual_size() => {
                            self.cache.stats().hit_unallocated();
                            len = len.min(below.virtual_size() - start.0);
                            index = LayerIndex(index.0 - 1);
                            continue;
                        }
                        _ => ExtentKind::Zero {
                            host,
                            allocated: false,
                        },
                    }
                }
            };
            return Ok(Extent {
                start,
                len,
                layer: index,
                kind,
            });
        }
    }

    /// The layer a walk down from layer `from` ends at for `start`, which
    /// no layer from `from` down maps: the first whose backing ends at or
    /// before `start` (QEMU reads zeros there), or the base; `len` is
    /// trimmed as the walk trims it (to each lower layer it steps into).
    /// The walk reached `from`, so every layer from `from` up to the top
    /// is larger than `start` and `len` already fits them: the floors
    /// taken up to the top answer as floors taken up to `from` would.
    fn walk_end_unallocated(
        &self,
        from: LayerIndex,
        start: GuestOffset,
        len: &mut u64,
    ) -> LayerIndex {
        let floors = self.size_floors.get_or_init(|| {
            let top = self.top_index().0;
            let mut floors = vec![0u64; top];
            let mut min = u64::MAX;
            for j in (0..top).rev() {
                min = min.min(self.layers[j].virtual_size());
                floors[j] = min;
            }
            floors
        });
        // Floors grow with the layer: the layers at or below the last one
        // whose floor is at most `start` are not stepped into.
        let below = floors[..from.0.min(floors.len())].partition_point(|&f| f <= start.0);
        if let Some(&floor) = floors.get(below) {
            if below < from.0 {
                *len = (*len).min(floor - start.0);
            }
        }
        LayerIndex(below)
    }

    /// The extent at `start` (at most `len` bytes) from the chain index,
    /// which covers layers `0..=upto`; `None` when the index cannot answer
    /// (split chunk, unusable index).
    fn index_extent(
        &self,
        ci: &ChainIndex,
        upto: LayerIndex,
        start: GuestOffset,
        len: u64,
    ) -> Result<Option<Extent>, Error> {
        let g = ci.geometry();
        let chunk = start.0 >> g.granularity_bits;
        let chunk_start = chunk << g.granularity_bits;
        let len = len.min(chunk_start + g.chunk_size() - start.0);
        let entry = ci
            .entry(chunk, &self.cache)
            .map_err(|k| Error::new(ci.path(), k))?;
        let Some(entry) = entry else {
            return Ok(None);
        };
        let (layer, kind) = match entry {
            IndexEntry::Walk => return Ok(None),
            IndexEntry::None => (
                upto,
                ExtentKind::Zero {
                    host: None,
                    allocated: false,
                },
            ),
            IndexEntry::Zero { layer } => (
                LayerIndex(layer as usize),
                ExtentKind::Zero {
                    host: None,
                    allocated: true,
                },
            ),
            IndexEntry::Data { layer, host } => (
                LayerIndex(layer as usize),
                ExtentKind::Data {
                    host: HostOffset(host + (start.0 - chunk_start)),
                },
            ),
            IndexEntry::Compressed { layer, l2_entry } => {
                let Some(header) = self.layers.get(layer as usize).and_then(|l| l.header()) else {
                    return Ok(None);
                };
                let geometry = header.geometry;
                (
                    LayerIndex(layer as usize),
                    ExtentKind::Compressed(CompressedDescriptor::decode(l2_entry, geometry)),
                )
            }
        };
        if layer.0 > upto.0 {
            return Ok(None);
        }
        Ok(Some(Extent {
            start,
            len,
            layer,
            kind,
        }))
    }

    /// The whole disk as extents, merged the way `qemu-img map` merges them.
    pub fn map(&self, mut each: impl FnMut(&Extent)) -> Result<(), Error> {
        let size = self.virtual_size();
        let mut pos = 0u64;
        let mut pending: Option<Extent> = None;
        while pos < size {
            let e = self.resolve(GuestOffset(pos), size - pos, true)?;
            pos += e.len;
            match &mut pending {
                Some(p) if mergeable(p, &e) => p.len += e.len,
                _ => {
                    if let Some(p) = pending.replace(e) {
                        each(&p);
                    }
                }
            }
        }
        if let Some(p) = pending {
            each(&p);
        }
        Ok(())
    }
}

/// The slice of an index that entries were last read from: an index
/// build reads the old index entry by entry, and one cache lookup per
/// slice instead of one per entry took the lookups from about a fifth of
/// a build's time to nothing.
#[derive(Default)]
struct HeldSlice {
    /// The slice's number and words (`None`: every entry *none*).
    slice: Option<(u64, Option<Slice>)>,
}

impl HeldSlice {
    /// The entry of `chunk` in `index`; `None` when the index cannot say
    /// (unusable, an entry that does not decode, a slice not at hand).
    fn entry(&mut self, index: &ChainIndex, chunk: u64, cache: &SliceCache) -> Option<IndexEntry> {
        let per = index.entries_per_slice();
        let no = chunk / per;
        let words = match &self.slice {
            Some((held, words)) if *held == no => words,
            _ => {
                let words = index.slice(no, cache).ok()??;
                &self.slice.insert((no, words)).1
            }
        };
        index.entry_in(words.as_ref(), chunk)
    }
}

/// Whether `next` directly continues `cur` with the same mapping.
fn mergeable(cur: &Extent, next: &Extent) -> bool {
    if cur.layer != next.layer {
        return false;
    }
    match (cur.kind, next.kind) {
        (ExtentKind::Data { host: a }, ExtentKind::Data { host: b }) => a.0 + cur.len == b.0,
        (ExtentKind::Compressed(_), ExtentKind::Compressed(_)) => true,
        (
            ExtentKind::Zero {
                host: a,
                allocated: x,
            },
            ExtentKind::Zero {
                host: b,
                allocated: y,
            },
        ) => {
            x == y
                && match (a, b) {
                    (None, None) => true,
                    (Some(a), Some(b)) => a.0 + cur.len == b.0,
                    _ => false,
                }
        }
        _ => false,
    }
}

/// The path of a layer's backing file as the image names it, resolved.
pub fn backing_path_of(layer: &Layer) -> Option<PathBuf> {
    let header = layer.header()?;
    let name = header.backing_file.as_ref()?;
    resolve_backing_path(layer.path(), name).ok()
}

impl IndexView<'_> {
    /// The raw index entry of `chunk`, when an index is in use (it
    /// answers for the layers [`crate::IndexView::covers`] says); an error
    /// once the index was given up (a slice unreadable or failing its
    /// checksum).
    pub fn entry(&self, chunk: u64) -> Result<Option<IndexEntry>, Error> {
        let in_use = self.chain.index.load();
        let Some((index, _)) = in_use.covering.as_ref() else {
            return Ok(None);
        };
        match index.entry(chunk, &self.chain.cache) {
            Ok(None) if !index.usable() => Err(Error::new(
                index.path(),
                ErrorKind::IndexStale(index.given_up_because().unwrap_or_default().into()),
            )),
            got => got.map_err(|k| Error::new(index.path(), k)),
        }
    }

    /// The highest layer the index in use covers.
    pub fn covers(&self) -> Option<LayerIndex> {
        self.chain.index.load().usable().map(|(_, upto)| upto)
    }

    /// The geometry of an index of layers `0..=upto` over
    /// `[0, covered_size)`.
    pub fn geometry(&self, upto: LayerIndex, covered_size: u64) -> IndexGeometry {
        IndexGeometry {
            granularity_bits: granularity_bits(&self.chain.layers, upto.0),
            covered_size,
        }
    }

    /// The index entry of every chunk of `geometry`, in order, as layers
    /// `0..=upto` resolve it, given to `each`. Where the layers above the
    /// index in use (up to `upto`) hold nothing, its entries are taken as
    /// they are: building the index of a new top reads the old index and
    /// the layers it does not cover, not the whole chain. `progress(done,
    /// total)` is called as chunks are resolved.
    pub fn entries(
        &self,
        upto: LayerIndex,
        geometry: IndexGeometry,
        each: &mut dyn FnMut(IndexEntry) -> Result<(), Error>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), Error> {
        let cs = geometry.chunk_size();
        let chunks = geometry.chunks();
        let size = self.chain.layers[upto.0].virtual_size();
        let guard = self.chain.index.load();
        // An index in use with the same layout, covering layers up to
        // `upto` or fewer: where the layers above it hold nothing, its
        // entries are the answer.
        let extending = guard
            .usable()
            .filter(|(ci, covers)| covers.0 <= upto.0 && ci.geometry() == geometry);
        let mut held = HeldSlice::default();
        let mut chunk = 0u64;
        while chunk < chunks {
            let start = chunk * cs;
            if start >= size {
                each(IndexEntry::None)?;
                chunk += 1;
                continue;
            }
            if let Some((ci, covers)) = extending {
                let mut free = size - start;
                for layer in (covers.0 + 1..=upto.0).rev() {
                    // Past a layer's end, the layers below it do not show
                    // (zeros): no entry of the old index holds there.
                    let end = self.chain.layers[layer].virtual_size();
                    if start >= end {
                        free = 0;
                        break;
                    }
                    free = free.min(end - start);
                    let (status, n) = self.chain.layer_status(
                        LayerIndex(layer),
                        GuestOffset(start),
                        free,
                        false,
                    )?;
                    if !matches!(status, LayerStatus::Unallocated { .. }) {
                        free = 0;
                        break;
                    }
                    free = free.min(n);
                }
                if free >= cs {
                    let before = chunk;
                    let end = (chunk + free / cs).min(chunks);
                    while chunk < end {
                        match held.entry(ci, chunk, &self.chain.cache) {
                            Some(old) => each(old)?,
                            None => break,
                        }
                        chunk += 1;
                    }
                    if chunk > before {
                        progress(chunk.min(chunks), chunks);
                        continue;
                    }
                }
            }
            let extent = self
                .chain
                .resolve_from(upto, GuestOffset(start), size - start, false)?;
            let whole = (extent.len / cs).min(chunks - chunk);
            if whole == 0 {
                // The mapping changes inside this chunk (a layer ends here).
                each(IndexEntry::Walk)?;
                chunk += 1;
                continue;
            }
            for k in 0..whole {
                let delta = k * cs;
                each(match extent.kind {
                    ExtentKind::Data { host } => IndexEntry::Data {
                        layer: extent.layer.0 as u32,
                        host: host.0 + delta,
                    },
                    ExtentKind::Compressed(_) => {
                        // Re-read the layer's entry: the descriptor as stored.
                        let layer = &self.chain.layers[extent.layer.0];
                        let l2_entry = match layer {
                            Layer::Qcow2(q) => q
                                .raw_l2_entry(
                                    extent.layer,
                                    extent.start.0 + delta,
                                    &self.chain.cache,
                                    self.chain.slice_size,
                                )
                                .with_path(layer.path())?,
                            Layer::Raw(_) => 0,
                        };
                        IndexEntry::Compressed {
                            layer: extent.layer.0 as u32,
                            l2_entry,
                        }
                    }
                    ExtentKind::Zero {
                        allocated: true, ..
                    } => IndexEntry::Zero {
                        layer: extent.layer.0 as u32,
                    },
                    ExtentKind::Zero { .. } => IndexEntry::None,
                })?;
            }
            chunk += whole;
            progress(chunk.min(chunks), chunks);
        }
        Ok(())
    }
}
