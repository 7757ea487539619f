//! The active volume (top layer) opened for writing: its mutable metadata,
//! the write path, and the ordered flush that keeps it crash-safe.
//!
//! Flush order (each step made durable before the next):
//! 1. guest data;
//! 2. refcount blocks, then the refcount table, then the header when the
//!    table moved (new clusters are counted before anything points to them);
//! 3. L2 tables, then L1 entries;
//! 4. decrements of clusters no longer referenced, which only then become
//!    free for reuse.
//!
//! A crash at any point leaves at worst leaked clusters. With lazy refcounts
//! step 2 and 4's writes are deferred to a clean close, and the dirty bit
//! is set on disk before the first metadata write.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::compressed::read_compressed_cluster;
use crate::entry::{CompressedDescriptor, COPIED, OFFSET_MASK, ZERO};
use crate::error::{Error, ErrorKind};
use crate::features::INCOMPAT_DIRTY;
use crate::header::{Header, Version};
use crate::layer::{
    clip_to_l2, read_l2_table, read_words, table_status, validate_l2_offset, L2Slice, LayerStatus,
};
use crate::refcount::Refcounts;
use crate::storage::Storage;
use crate::summary::TopSummary;
use crate::types::{Geometry, GuestOffset};
use sqcow2_cache::{Slice, SliceCache, SliceKey};

/// Header field offsets that the write path updates.
const HDR_REFTABLE: u64 = 48;
const HDR_INCOMPATIBLE: u64 = 72;

/// Bitmap with every subcluster allocated.
const ALL_ALLOC: u64 = 0x0000_0000_ffff_ffff;
/// Bitmap with every subcluster reading as zeros.
const ALL_ZERO: u64 = 0xffff_ffff_0000_0000;

/// Tables under modification stay in memory until a flush writes them; past
/// this share of the cache budget, their metadata is written back early.
const DIRTY_SHARE_OF_BUDGET: u64 = 4;

/// Reads the guest view of the layers below the top: `(buf, offset)`.
pub type BelowReader<'a> = dyn Fn(&mut [u8], u64) -> Result<(), Error> + 'a;

#[derive(Debug)]
struct L2Slot {
    table: Vec<u64>,
    dirty: bool,
}

/// What a write to one cluster needs once metadata has been looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritePlan {
    /// The cluster is the top's own data: write the bytes at this host
    /// offset, no metadata change.
    InPlace(u64),
    /// The write was carried out under the metadata lock (allocation,
    /// copy-on-write or a subcluster update).
    Done,
}

/// Mutable metadata of the active volume.
#[derive(Debug)]
pub struct ActiveState {
    path: PathBuf,
    storage: Arc<dyn Storage>,
    header: Header,
    l1: Vec<u64>,
    dirty_l1: BTreeSet<usize>,
    l2: HashMap<u64, L2Slot>,
    refcounts: Refcounts,
    has_backing: bool,
    dirty_bit_on_disk: bool,
    cache: Arc<SliceCache>,
    source: u32,
    slice_size: u64,
    cache_budget: u64,
    summary: Option<Arc<TopSummary>>,
    /// Test hooks.
    pub(crate) faults: crate::fault::Faults,
}

/// Where the top's clean L2 slices are cached.
#[derive(Debug, Clone)]
pub struct CacheLink {
    /// The unified cache.
    pub cache: Arc<SliceCache>,
    /// The top's layer number (its source in the cache).
    pub source: u32,
    /// Bytes per slice.
    pub slice_size: u64,
    /// The cache's byte budget.
    pub budget: u64,
    /// Regions of the top known to be empty (indexed mode), to keep up to
    /// date.
    pub summary: Option<Arc<TopSummary>>,
}

impl ActiveState {
    /// Takes over an opened image for writing.
    pub fn open(
        path: &Path,
        storage: Arc<dyn Storage>,
        header: Header,
        has_backing: bool,
        link: CacheLink,
    ) -> Result<Self, Error> {
        let e = |kind| Error::new(path, kind);
        let mut raw = vec![0u8; header.l1_size as usize * 8];
        storage
            .read_at(&mut raw, header.l1_table_offset)
            .map_err(|io| e(io.into()))?;
        let l1 = raw
            .chunks_exact(8)
            .map(|c| crate::bytes::be_u64(c, 0))
            .collect();
        let refcounts = Refcounts::load(
            &*storage,
            header.refcount_order,
            header.geometry.cluster_bits,
            header.refcount_table_offset,
            header.refcount_table_clusters,
        )
        .map_err(e)?;
        Ok(Self {
            path: path.to_path_buf(),
            dirty_bit_on_disk: header.is_dirty(),
            storage,
            header,
            l1,
            dirty_l1: BTreeSet::new(),
            l2: HashMap::new(),
            refcounts,
            has_backing,
            cache: link.cache,
            source: link.source,
            slice_size: link.slice_size,
            cache_budget: link.budget,
            summary: link.summary,
            faults: crate::fault::Faults::default(),
        })
    }

    fn err(&self, kind: ErrorKind) -> Error {
        Error::new(&self.path, kind)
    }

    fn io(&self, e: std::io::Error) -> Error {
        self.err(e.into())
    }

    fn geometry(&self) -> Geometry {
        self.header.geometry
    }

    /// Virtual size of the disk.
    pub fn size(&self) -> u64 {
        self.header.size
    }

    /// The current header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    fn words(&self) -> usize {
        if self.geometry().extended_l2 {
            2
        } else {
            1
        }
    }

    /// Takes the whole table at `offset` into the set under modification.
    fn l2_loaded(&mut self, offset: u64) -> Result<(), Error> {
        if self.l2.contains_key(&offset) {
            return Ok(());
        }
        let file_size = self.storage.len().map_err(|e| self.io(e))?;
        let table = read_l2_table(self.geometry(), &*self.storage, offset, file_size)
            .map_err(|k| self.err(k))?;
        self.l2.insert(
            offset,
            L2Slot {
                table,
                dirty: false,
            },
        );
        Ok(())
    }

    /// The cached slice of the (clean) table at `l2_offset` covering `guest`.
    fn cached_slice(&self, l2_offset: u64, guest: u64) -> Result<(L2Slice, Slice), Error> {
        let g = self.geometry();
        let slice = L2Slice::locate(g, l2_offset, GuestOffset(guest), self.slice_size);
        let key = SliceKey {
            source: self.source,
            offset: slice.offset,
        };
        let words = self
            .cache
            .get_or_load(key, || {
                validate_l2_offset(g, l2_offset, self.storage.len()?)?;
                read_words(&*self.storage, slice.offset, slice.words)
            })
            .map_err(|k| self.err(k))?;
        Ok((slice, words))
    }

    /// The raw L2 entry and bitmap of the cluster at `guest` (`None` where
    /// the L1 entry is empty).
    fn raw_entry(&self, guest: u64) -> Result<Option<(u64, u64)>, Error> {
        let g = self.geometry();
        let l2_offset = self.l1_entry(guest) & OFFSET_MASK;
        if l2_offset == 0 {
            return Ok(None);
        }
        let per = self.words();
        let (words, first): (&[u64], u64) = match self.l2.get(&l2_offset) {
            Some(slot) => (&slot.table, 0),
            None => {
                let (slice, words) = self.cached_slice(l2_offset, guest)?;
                let i = (g.l2_index(GuestOffset(guest)) - slice.first_entry) as usize * per;
                let bitmap = if per == 2 { words[i + 1] } else { 0 };
                return Ok(Some((words[i], bitmap)));
            }
        };
        let i = (g.l2_index(GuestOffset(guest)) - first) as usize * per;
        let bitmap = if per == 2 { words[i + 1] } else { 0 };
        Ok(Some((words[i], bitmap)))
    }

    /// Moves tables that are not dirty out of the set under modification,
    /// and writes metadata back early when dirty tables take too much room.
    fn settle(&mut self) -> Result<(), Error> {
        let clean: Vec<u64> = self
            .l2
            .iter()
            .filter(|(_, s)| !s.dirty)
            .map(|(o, _)| *o)
            .collect();
        for offset in clean {
            if let Some(slot) = self.l2.remove(&offset) {
                self.publish(offset, &slot.table);
            }
        }
        let dirty_bytes: u64 = self.l2.values().map(|s| s.table.len() as u64 * 8).sum();
        if dirty_bytes > self.cache_budget / DIRTY_SHARE_OF_BUDGET {
            self.write_back(false)?;
        }
        Ok(())
    }

    /// Puts the slices of a clean table into the unified cache.
    fn publish(&self, offset: u64, table: &[u64]) {
        let g = self.geometry();
        let slice_bytes = self.slice_size.clamp(g.l2_entry_size(), g.cluster_size());
        let words = (slice_bytes / 8) as usize;
        for (i, chunk) in table.chunks(words).enumerate() {
            let key = SliceKey {
                source: self.source,
                offset: offset + i as u64 * slice_bytes,
            };
            self.cache.insert(key, chunk.to_vec().into());
        }
    }

    fn l1_entry(&self, guest: u64) -> u64 {
        usize::try_from(self.geometry().l1_index(GuestOffset(guest)))
            .ok()
            .and_then(|i| self.l1.get(i))
            .copied()
            .unwrap_or(0)
    }

    /// The mapping of `[guest, guest + max)` in the top, as for a read-only
    /// layer.
    pub fn status(&mut self, guest: u64, max: u64) -> Result<(LayerStatus, u64), Error> {
        let g = self.geometry();
        let max = clip_to_l2(g, GuestOffset(guest), max);
        let l2_offset = self.l1_entry(guest) & OFFSET_MASK;
        if l2_offset == 0 {
            return Ok((LayerStatus::Unallocated { host: None }, max));
        }
        if let Some(slot) = self.l2.get(&l2_offset) {
            return table_status(g, &slot.table, GuestOffset(guest), max).map_err(|k| self.err(k));
        }
        let (slice, words) = self.cached_slice(l2_offset, guest)?;
        slice
            .status(g, &words, GuestOffset(guest), max)
            .map_err(|k| self.err(k))
    }

    /// Reads the guest view of `[guest, guest + buf.len())`, which lies in
    /// one cluster, through the top and the layers below.
    fn read_view(&mut self, below: &BelowReader, buf: &mut [u8], guest: u64) -> Result<(), Error> {
        let size = self.size();
        let mut pos = 0usize;
        while pos < buf.len() {
            let at = guest + pos as u64;
            if at >= size {
                buf[pos..].fill(0);
                break;
            }
            let want = ((buf.len() - pos) as u64).min(size - at);
            let (st, n) = self.status(at, want)?;
            let out = &mut buf[pos..pos + n as usize];
            match st {
                LayerStatus::Data { host } => {
                    self.storage.read_at(out, host.0).map_err(|e| self.io(e))?
                }
                LayerStatus::Zero { .. } => out.fill(0),
                LayerStatus::Unallocated { .. } => below(out, at)?,
                LayerStatus::Compressed(d) => {
                    let cluster = self.decompress_own(d)?;
                    let from = self.geometry().offset_in_cluster(at) as usize;
                    out.copy_from_slice(&cluster[from..from + out.len()]);
                }
            }
            pos += n as usize;
        }
        Ok(())
    }

    fn decompress_own(&self, d: CompressedDescriptor) -> Result<Vec<u8>, Error> {
        read_compressed_cluster(
            &*self.storage,
            self.header.compression_type,
            self.geometry(),
            d,
        )
        .map_err(|k| self.err(k))
    }

    /// Host clusters (indices) that an entry holds a reference to.
    fn referenced_clusters(&self, entry: u64, bitmap: u64) -> Vec<u64> {
        let g = self.geometry();
        if entry & crate::entry::COMPRESSED != 0 {
            let d = CompressedDescriptor::decode(entry, g);
            let first = d.offset.0 >> g.cluster_bits;
            let last = (d.offset.0 + d.len - 1) >> g.cluster_bits;
            return (first..=last).collect();
        }
        let _ = bitmap;
        let host = entry & OFFSET_MASK;
        if host == 0 {
            Vec::new()
        } else {
            vec![host >> g.cluster_bits]
        }
    }

    /// The L2 table covering `guest`, owned by the top (allocated or copied
    /// from a shared one as needed); returns its offset.
    fn l2_for_write(&mut self, guest: u64) -> Result<u64, Error> {
        let g = self.geometry();
        let l1_index = g.l1_index(GuestOffset(guest)) as usize;
        let Some(&entry) = self.l1.get(l1_index) else {
            return Err(self.err(ErrorKind::OutOfRange {
                offset: guest,
                len: 0,
                size: self.size(),
            }));
        };
        let offset = entry & OFFSET_MASK;
        let storage = self.storage.clone();
        if offset != 0 {
            self.l2_loaded(offset)?;
            let rc = self
                .refcounts
                .get(&*storage, offset >> g.cluster_bits)
                .map_err(|k| self.err(k))?;
            if rc == 1 {
                if entry & COPIED == 0 {
                    self.l1[l1_index] = offset | COPIED;
                    self.dirty_l1.insert(l1_index);
                }
                return Ok(offset);
            }
        }
        let new = self.refcounts.alloc(&*storage).map_err(|k| self.err(k))? << g.cluster_bits;
        let table = if offset != 0 {
            self.refcounts.free_later(offset >> g.cluster_bits);
            self.l2[&offset].table.clone()
        } else {
            vec![0u64; (g.cluster_size() / 8) as usize]
        };
        self.l2.insert(new, L2Slot { table, dirty: true });
        self.l1[l1_index] = new | COPIED;
        self.dirty_l1.insert(l1_index);
        Ok(new)
    }

    fn entry_at(&self, l2: u64, guest: u64) -> (usize, u64, u64) {
        let g = self.geometry();
        let i = g.l2_index(GuestOffset(guest)) as usize * self.words();
        let table = &self.l2[&l2].table;
        let bitmap = if self.words() == 2 { table[i + 1] } else { 0 };
        (i, table[i], bitmap)
    }

    fn set_entry(&mut self, l2: u64, i: usize, entry: u64, bitmap: u64) {
        let words = self.words();
        if let Some(slot) = self.l2.get_mut(&l2) {
            slot.table[i] = entry;
            if words == 2 {
                slot.table[i + 1] = bitmap;
            }
            slot.dirty = true;
        }
    }

    fn release(&mut self, entry: u64, bitmap: u64) {
        for c in self.referenced_clusters(entry, bitmap) {
            self.refcounts.free_later(c);
        }
    }

    /// Whether host cluster `host` is referenced only by the top.
    fn owned(&mut self, host: u64) -> Result<bool, Error> {
        let storage = self.storage.clone();
        let rc = self
            .refcounts
            .get(&*storage, host >> self.geometry().cluster_bits)
            .map_err(|k| self.err(k))?;
        Ok(rc == 1)
    }

    /// Plans (and, unless it is a plain in-place overwrite, performs) the
    /// write of `data` at `guest`, which lies within one cluster.
    pub fn write_in_cluster(
        &mut self,
        below: &BelowReader,
        data: &[u8],
        guest: u64,
    ) -> Result<WritePlan, Error> {
        let plan = self.write_in_cluster_inner(below, data, guest)?;
        self.settle()?;
        Ok(plan)
    }

    /// Whether a write of `len` bytes at `guest` can go straight to the
    /// top's own cluster: returns its host offset.
    pub fn in_place_target(&mut self, guest: u64, len: u64) -> Result<Option<u64>, Error> {
        let g = self.geometry();
        let Some((entry, bitmap)) = self.raw_entry(guest)? else {
            return Ok(None);
        };
        let host = entry & OFFSET_MASK;
        let plain = entry & (crate::entry::COMPRESSED | ZERO) == 0 && entry & COPIED != 0;
        if !plain || host == 0 || g.offset_in_cluster(host) != 0 {
            return Ok(None);
        }
        let in_cluster = g.offset_in_cluster(guest);
        if g.extended_l2 {
            let sc = g.subcluster_size();
            let all =
                (in_cluster / sc..=(in_cluster + len - 1) / sc).all(|i| bitmap & (1 << i) != 0);
            if !all {
                return Ok(None);
            }
        }
        if !self.owned(host)? {
            return Ok(None);
        }
        let file_size = self.storage.len().map_err(|e| self.io(e))?;
        if host + g.cluster_size() > file_size {
            return Ok(None);
        }
        Ok(Some(host + in_cluster))
    }

    fn write_in_cluster_inner(
        &mut self,
        below: &BelowReader,
        data: &[u8],
        guest: u64,
    ) -> Result<WritePlan, Error> {
        if let Some(s) = &self.summary {
            s.mark(GuestOffset(guest));
        }
        if let Some(host) = self.in_place_target(guest, data.len() as u64)? {
            return Ok(WritePlan::InPlace(host));
        }
        let g = self.geometry();
        let cluster_size = g.cluster_size();
        let cluster_start = guest - g.offset_in_cluster(guest);
        let in_cluster = g.offset_in_cluster(guest);
        let l2 = self.l2_for_write(guest)?;
        let (i, entry, bitmap) = self.entry_at(l2, guest);
        let host = entry & OFFSET_MASK;
        let compressed = entry & crate::entry::COMPRESSED != 0;
        let storage = self.storage.clone();

        if !compressed && host != 0 && g.offset_in_cluster(host) == 0 && self.owned(host)? {
            let file_size = storage.len().map_err(|e| self.io(e))?;
            if host + cluster_size > file_size {
                return Err(self.err(ErrorKind::ClusterBeyondEof {
                    guest_offset: guest,
                    host_offset: host,
                    file_size,
                }));
            }
            if !g.extended_l2 {
                if entry & ZERO == 0 {
                    if entry & COPIED == 0 {
                        self.set_entry(l2, i, host | COPIED, 0);
                    }
                    return Ok(WritePlan::InPlace(host + in_cluster));
                }
                // Preallocated zero cluster: fill it and clear the flag.
                let mut full = vec![0u8; cluster_size as usize];
                full[in_cluster as usize..in_cluster as usize + data.len()].copy_from_slice(data);
                storage.write_at(&full, host).map_err(|e| self.io(e))?;
                self.set_entry(l2, i, host | COPIED, 0);
                return Ok(WritePlan::Done);
            }
            // Extended L2, own cluster: update the touched subclusters.
            let sc_size = g.subcluster_size();
            let first = in_cluster / sc_size;
            let last = (in_cluster + data.len() as u64 - 1) / sc_size;
            let all_alloc = (first..=last).all(|sc| bitmap & (1 << sc) != 0);
            if all_alloc && entry & COPIED != 0 {
                return Ok(WritePlan::InPlace(host + in_cluster));
            }
            let mut new_bitmap = bitmap;
            for sc in first..=last {
                let sc_start = sc * sc_size;
                let lo = in_cluster.max(sc_start);
                let hi = (in_cluster + data.len() as u64).min(sc_start + sc_size);
                let part = &data[(lo - in_cluster) as usize..(hi - in_cluster) as usize];
                if bitmap & (1 << sc) != 0 {
                    // Allocated: write only the new bytes, never rewrite
                    // bytes a concurrent in-place write may be changing.
                    storage.write_at(part, host + lo).map_err(|e| self.io(e))?;
                } else {
                    let mut buf = vec![0u8; sc_size as usize];
                    if bitmap & (1 << (sc + 32)) == 0 {
                        self.read_view(below, &mut buf, cluster_start + sc_start)?;
                    }
                    buf[(lo - sc_start) as usize..(hi - sc_start) as usize].copy_from_slice(part);
                    storage
                        .write_at(&buf, host + sc_start)
                        .map_err(|e| self.io(e))?;
                }
                new_bitmap = (new_bitmap | (1 << sc)) & !(1 << (sc + 32));
            }
            self.set_entry(l2, i, host | COPIED, new_bitmap);
            return Ok(WritePlan::Done);
        }

        // Copy-on-write into a new cluster.
        let mut full = vec![0u8; cluster_size as usize];
        if data.len() as u64 != cluster_size {
            self.read_view(below, &mut full, cluster_start)?;
        }
        full[in_cluster as usize..in_cluster as usize + data.len()].copy_from_slice(data);
        let new_index = self.refcounts.alloc(&*storage).map_err(|k| self.err(k))?;
        let new = new_index << g.cluster_bits;
        if let Err(e) = storage.write_at(&full, new) {
            // Nothing references the new cluster yet: give it back, so a
            // failed write leaks nothing.
            if let Err(k) = self.refcounts.unalloc(&*storage, new_index) {
                tracing::warn!(error = %k, "could not return an unused cluster");
            }
            return Err(self.io(e));
        }
        self.release(entry, bitmap);
        self.faults.hit(crate::fault::FaultPoint::MidMetadataUpdate);
        self.set_entry(
            l2,
            i,
            new | COPIED,
            if g.extended_l2 { ALL_ALLOC } else { 0 },
        );
        Ok(WritePlan::Done)
    }

    /// Makes the whole cluster at `guest` read as zeros without writing data
    /// (`false` when the image cannot express it and zeros must be written).
    pub fn zero_cluster(&mut self, guest: u64, unmap: bool) -> Result<bool, Error> {
        let done = self.zero_cluster_inner(guest, unmap)?;
        self.settle()?;
        Ok(done)
    }

    fn zero_cluster_inner(&mut self, guest: u64, unmap: bool) -> Result<bool, Error> {
        if let Some(s) = &self.summary {
            s.mark(GuestOffset(guest));
        }
        let g = self.geometry();
        let v2 = self.header.version == Version::V2;
        if v2 && self.has_backing {
            return Ok(false);
        }
        let l2 = self.l2_for_write(guest)?;
        let (i, entry, bitmap) = self.entry_at(l2, guest);
        let host = entry & OFFSET_MASK;
        let compressed = entry & crate::entry::COMPRESSED != 0;
        let keep = !unmap && !v2 && !compressed && host != 0 && self.owned(host)?;
        let (new_entry, new_bitmap) = match (g.extended_l2, v2, keep) {
            (true, _, true) => (host | COPIED, ALL_ZERO),
            (true, _, false) => (0, ALL_ZERO),
            (false, false, true) => (host | ZERO | COPIED, 0),
            (false, false, false) => (ZERO, 0),
            // v2 without a backing file: unallocated reads as zeros.
            (false, true, _) => (0, 0),
        };
        if !keep {
            self.release(entry, bitmap);
        }
        self.set_entry(l2, i, new_entry, new_bitmap);
        Ok(true)
    }

    /// Whether any metadata waits to be written.
    pub fn is_dirty(&self) -> bool {
        !self.dirty_l1.is_empty()
            || self.l2.values().any(|s| s.dirty)
            || self.refcounts.is_dirty()
            || self.refcounts.has_pending_frees()
    }

    fn lazy(&self) -> bool {
        self.header.lazy_refcounts()
    }

    fn sync(&self) -> Result<(), Error> {
        self.storage.sync().map_err(|e| self.io(e))
    }

    fn write_header_u64(&self, offset: u64, value: u64) -> Result<(), Error> {
        self.storage
            .write_at(&value.to_be_bytes(), offset)
            .map_err(|e| self.io(e))
    }

    /// Sets or clears the dirty bit on disk (durably).
    fn set_dirty_bit(&mut self, dirty: bool) -> Result<(), Error> {
        let mut incompatible = self.header.features.incompatible & !INCOMPAT_DIRTY;
        if dirty {
            incompatible |= INCOMPAT_DIRTY;
        }
        self.write_header_u64(HDR_INCOMPATIBLE, incompatible)?;
        self.sync()?;
        self.header.features.incompatible = incompatible;
        self.dirty_bit_on_disk = dirty;
        Ok(())
    }

    fn write_refcounts(&mut self) -> Result<(), Error> {
        let storage = self.storage.clone();
        if self
            .refcounts
            .write_blocks(&*storage)
            .map_err(|k| self.err(k))?
        {
            self.sync()?;
        }
        let moved = self.refcounts.table_moved();
        if self
            .refcounts
            .write_table(&*storage)
            .map_err(|k| self.err(k))?
        {
            self.sync()?;
        }
        if moved {
            let (offset, clusters) = self.refcounts.table_location();
            let mut field = [0u8; 12];
            field[..8].copy_from_slice(&offset.to_be_bytes());
            field[8..].copy_from_slice(&(clusters as u32).to_be_bytes());
            storage
                .write_at(&field, HDR_REFTABLE)
                .map_err(|e| self.io(e))?;
            self.sync()?;
            self.header.refcount_table_offset = offset;
            self.header.refcount_table_clusters = clusters as u32;
            self.refcounts.table_header_written();
        }
        Ok(())
    }

    /// The ordered flush described in the module documentation.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.write_back(true)
    }

    /// The flush sequence; queued frees are applied only when
    /// `apply_frees` (the caller guarantees no request in flight still uses
    /// a freed cluster).
    fn write_back(&mut self, apply_frees: bool) -> Result<(), Error> {
        if !self.is_dirty() {
            return self.sync();
        }
        let lazy = self.lazy();
        if lazy && !self.dirty_bit_on_disk {
            self.set_dirty_bit(true)?;
        }
        self.sync()?;
        if !lazy {
            self.write_refcounts()?;
        }
        let storage = self.storage.clone();
        let mut wrote = false;
        for (offset, slot) in self.l2.iter_mut() {
            if slot.dirty {
                let bytes: Vec<u8> = slot.table.iter().flat_map(|e| e.to_be_bytes()).collect();
                storage
                    .write_at(&bytes, *offset)
                    .map_err(|e| Error::new(&self.path, e.into()))?;
                slot.dirty = false;
                wrote = true;
            }
        }
        if wrote {
            self.sync()?;
        }
        if !self.dirty_l1.is_empty() {
            for &i in &self.dirty_l1 {
                storage
                    .write_at(
                        &self.l1[i].to_be_bytes(),
                        self.header.l1_table_offset + i as u64 * 8,
                    )
                    .map_err(|e| Error::new(&self.path, e.into()))?;
            }
            self.dirty_l1.clear();
            self.sync()?;
        }
        // Written tables are clean now: their slices serve reads from the
        // unified cache.
        for (offset, slot) in std::mem::take(&mut self.l2) {
            self.publish(offset, &slot.table);
        }
        if apply_frees && self.refcounts.has_pending_frees() {
            self.refcounts
                .apply_pending_frees(&*storage)
                .map_err(|k| self.err(k))?;
            if !lazy {
                self.write_refcounts()?;
            }
        }
        Ok(())
    }

    /// Flushes and, with lazy refcounts, writes the refcounts and clears
    /// the dirty bit: the image is then clean for any reader.
    pub fn close(&mut self) -> Result<(), Error> {
        self.flush()?;
        if self.lazy() {
            self.write_refcounts()?;
            if self.dirty_bit_on_disk {
                self.set_dirty_bit(false)?;
            }
        }
        Ok(())
    }
}
