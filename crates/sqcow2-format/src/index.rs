//! The sQcow2 chain index: for every guest chunk the top does not hold,
//! which layer below holds it and where. Stored in a sidecar file named by
//! a header extension of the top; see `docs/format.md` for the layout.
//!
//! An index is trusted only while it provably describes the layers below:
//! every header and table of the file is checksummed, every covered layer
//! is fingerprinted and (qcow2 v3) carries the sQcow2 autoclear bit that
//! any other writer clears. Anything else makes it [`Stale`], and the chain
//! is walked instead.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use sqcow2_cache::{Slice, SliceCache, SliceKey, Source};

use crate::bytes::{be_u32, be_u64};
use crate::error::ErrorKind;
use crate::storage::Storage;

/// File magic.
pub(crate) const INDEX_MAGIC: &[u8; 8] = b"SQC2INDX";
/// Current version; readers reject others.
pub(crate) const INDEX_VERSION: u32 = 1;
/// Header extension of the top naming its index file.
pub(crate) const EXT_SQCOW2: u32 = 0x7371_6332;
/// Autoclear bit carried by every qcow2 v3 layer an index covers.
pub const AUTOCLEAR_SQCOW2: u64 = 1 << 63;
/// Size of the index file header.
pub const INDEX_HEADER_LEN: u64 = 128;
/// Size of one index entry and of one index L1 entry.
pub const ENTRY_SIZE: u64 = 16;
/// Entries per index slice (4 KiB slices).
pub const SLICE_ENTRIES_BITS: u32 = 8;

const KIND_NONE: u64 = 0;
const KIND_DATA: u64 = 1;
const KIND_COMPRESSED: u64 = 2;
const KIND_ZERO: u64 = 3;
const KIND_WALK: u64 = 4;

/// What one chunk of the guest disk reads from, below the top.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexEntry {
    /// No layer below holds it (or it lies past a layer's end): zeros.
    None,
    /// Data at `host` (the chunk's first byte) in layer `layer`.
    Data {
        /// Layer number (0 = base).
        layer: u32,
        /// Host offset of the chunk's first byte.
        host: u64,
    },
    /// Part of a compressed cluster of layer `layer`.
    Compressed {
        /// Layer number.
        layer: u32,
        /// The layer's L2 entry (compressed descriptor).
        l2_entry: u64,
    },
    /// Zeros recorded by layer `layer`.
    Zero {
        /// Layer number.
        layer: u32,
    },
    /// The chunk is split between mappings (only at a layer's end): walk.
    Walk,
}

impl IndexEntry {
    /// Encodes as two 64-bit words.
    pub fn encode(self) -> [u64; 2] {
        match self {
            IndexEntry::None => [0, KIND_NONE << 32],
            IndexEntry::Data { layer, host } => [host, (KIND_DATA << 32) | u64::from(layer)],
            IndexEntry::Compressed { layer, l2_entry } => {
                [l2_entry, (KIND_COMPRESSED << 32) | u64::from(layer)]
            }
            IndexEntry::Zero { layer } => [0, (KIND_ZERO << 32) | u64::from(layer)],
            IndexEntry::Walk => [0, KIND_WALK << 32],
        }
    }

    /// Decodes two words; `None` for an unknown kind or reserved bits set.
    pub(crate) fn decode(w0: u64, w1: u64) -> Option<Self> {
        let layer = (w1 & 0xffff_ffff) as u32;
        if w1 >> 40 != 0 {
            return None;
        }
        Some(match w1 >> 32 {
            KIND_NONE => IndexEntry::None,
            KIND_DATA => IndexEntry::Data { layer, host: w0 },
            KIND_COMPRESSED => IndexEntry::Compressed {
                layer,
                l2_entry: w0,
            },
            KIND_ZERO => IndexEntry::Zero { layer },
            KIND_WALK => IndexEntry::Walk,
            _ => return None,
        })
    }

    /// The layer the entry points into, if any.
    pub fn layer(self) -> Option<u32> {
        match self {
            IndexEntry::Data { layer, .. }
            | IndexEntry::Compressed { layer, .. }
            | IndexEntry::Zero { layer } => Some(layer),
            IndexEntry::None | IndexEntry::Walk => None,
        }
    }
}

/// What identifies a covered layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerFingerprint {
    /// 0 qcow2, 1 raw.
    pub format: u8,
    /// Virtual size.
    pub virtual_size: u64,
    /// File length.
    pub file_size: u64,
    /// Hash of the header area, autoclear bits excluded (0 for raw).
    pub header_hash: u64,
    /// Hash of the active L1 table (0 for raw).
    pub l1_hash: u64,
    /// Backing file name as the layer above writes it.
    pub name: Vec<u8>,
}

impl LayerFingerprint {
    fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&0u32.to_be_bytes());
        out.push(self.format);
        out.extend_from_slice(&[0; 3]);
        out.extend_from_slice(&self.virtual_size.to_be_bytes());
        out.extend_from_slice(&self.file_size.to_be_bytes());
        out.extend_from_slice(&self.header_hash.to_be_bytes());
        out.extend_from_slice(&self.l1_hash.to_be_bytes());
        out.extend_from_slice(&(self.name.len() as u16).to_be_bytes());
        out.extend_from_slice(&self.name);
        out.resize(out.len().div_ceil(8) * 8, 0);
        let len = (out.len() - start) as u32;
        out[start..start + 4].copy_from_slice(&len.to_be_bytes());
    }

    fn decode(buf: &[u8]) -> Option<(Self, usize)> {
        let len = be_u32(buf, 0) as usize;
        if len < 42 || len > buf.len() || len % 8 != 0 {
            return None;
        }
        let name_len = u16::from_be_bytes([buf[40], buf[41]]) as usize;
        if 42 + name_len > len {
            return None;
        }
        Some((
            Self {
                format: buf[4],
                virtual_size: be_u64(buf, 8),
                file_size: be_u64(buf, 16),
                header_hash: be_u64(buf, 24),
                l1_hash: be_u64(buf, 32),
                name: buf[42..42 + name_len].to_vec(),
            },
            len,
        ))
    }
}

/// Why an index is not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stale {
    /// The top has no sQcow2 extension.
    NotIndexed,
    /// The index file does not exist (not written yet: an offline
    /// snapshot defers it; or removed).
    NotWritten,
    /// The index file cannot be opened or read.
    Missing(String),
    /// The file is shorter than its structures.
    Truncated,
    /// Bad magic or an unknown version.
    Format(String),
    /// A checksum does not match.
    Checksum(&'static str),
    /// The chain has a different number of layers below the top.
    LayerCount {
        /// Layers the index describes.
        indexed: u32,
        /// Layers below the top now.
        actual: u32,
    },
    /// A layer's autoclear bit was cleared: another writer modified it.
    AutoclearCleared(u32),
    /// A layer no longer matches its fingerprint.
    Fingerprint {
        /// Layer number.
        layer: u32,
        /// Which property differs.
        what: &'static str,
    },
    /// The top's virtual size changed since the index was built.
    SizeChanged,
    /// The index granularity does not fit the layers.
    Granularity,
}

impl fmt::Display for Stale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stale::NotIndexed => f.write_str("no chain index"),
            Stale::NotWritten => f.write_str("index file missing: not written yet, or removed"),
            Stale::Missing(e) => write!(f, "index file unreadable: {e}"),
            Stale::Truncated => f.write_str("index file truncated"),
            Stale::Format(e) => write!(f, "index file format: {e}"),
            Stale::Checksum(what) => write!(f, "{what} checksum mismatch"),
            Stale::LayerCount { indexed, actual } => {
                write!(
                    f,
                    "index covers {indexed} layers, the chain has {actual} below the top"
                )
            }
            Stale::AutoclearCleared(l) => {
                write!(
                    f,
                    "layer {l} was opened for writing by a tool that does not know sQcow2"
                )
            }
            Stale::Fingerprint { layer, what } => write!(f, "layer {layer} changed ({what})"),
            Stale::SizeChanged => f.write_str("the top's virtual size changed"),
            Stale::Granularity => f.write_str("index granularity does not fit the layers"),
        }
    }
}

/// Layout parameters of an index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexGeometry {
    /// log2 of the chunk size.
    pub granularity_bits: u32,
    /// Guest bytes covered (the top's virtual size when built).
    pub covered_size: u64,
}

impl IndexGeometry {
    /// Chunk size in bytes.
    pub(crate) fn chunk_size(&self) -> u64 {
        1 << self.granularity_bits
    }
    /// Number of chunks.
    pub fn chunks(&self) -> u64 {
        self.covered_size.div_ceil(self.chunk_size())
    }
    fn slice_entries(&self) -> u64 {
        1 << SLICE_ENTRIES_BITS
    }
    fn slices(&self) -> u64 {
        self.chunks().div_ceil(self.slice_entries())
    }
}

/// Where an [`IndexWriter`] puts its bytes.
pub(crate) trait IndexSink {
    /// Writes `bytes` at `offset`.
    fn write_at(&mut self, bytes: &[u8], offset: u64) -> std::io::Result<()>;
}

impl IndexSink for Vec<u8> {
    fn write_at(&mut self, bytes: &[u8], offset: u64) -> std::io::Result<()> {
        let end = offset as usize + bytes.len();
        if self.len() < end {
            self.resize(end, 0);
        }
        self[offset as usize..end].copy_from_slice(bytes);
        Ok(())
    }
}

impl IndexSink for std::fs::File {
    fn write_at(&mut self, bytes: &[u8], offset: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, bytes, offset)
    }
}

/// Writes an index chunk by chunk, one slice in memory at a time: entries
/// for every chunk in order ([`IndexWriter::push`]), then the header,
/// the fingerprints of the covered layers (base first) and the slice
/// table ([`IndexWriter::finish`]). Memory stays one slice plus the slice
/// table (16 bytes per 256 chunks) whatever the disk size.
pub(crate) struct IndexWriter<S: IndexSink> {
    sink: S,
    geometry: IndexGeometry,
    layer_table: Vec<u8>,
    layer_count: u32,
    l1_offset: u64,
    l1: Vec<u8>,
    slice: Vec<IndexEntry>,
    next_offset: u64,
    pushed: u64,
}

impl<S: IndexSink> IndexWriter<S> {
    /// A writer of an index with `geometry` over `layers`, into `sink`.
    pub(crate) fn new(sink: S, geometry: IndexGeometry, layers: &[LayerFingerprint]) -> Self {
        let mut layer_table = Vec::new();
        for l in layers {
            l.encode(&mut layer_table);
        }
        let table_crc = crc32c::crc32c(&layer_table);
        layer_table.extend_from_slice(&u64::from(table_crc).to_be_bytes());
        let l1_offset = INDEX_HEADER_LEN + layer_table.len() as u64;
        // Slices start on a 4 KiB boundary: one page per slice read.
        let body_start = (l1_offset + geometry.slices() * ENTRY_SIZE).div_ceil(4096) * 4096;
        IndexWriter {
            sink,
            geometry,
            layer_table,
            layer_count: layers.len() as u32,
            l1_offset,
            l1: Vec::with_capacity((geometry.slices() * ENTRY_SIZE) as usize),
            slice: Vec::with_capacity(geometry.slice_entries() as usize),
            next_offset: body_start,
            pushed: 0,
        }
    }

    /// Entries pushed so far (the chunk the next one describes).
    pub(crate) fn pushed(&self) -> u64 {
        self.pushed
    }

    /// The entry of the next chunk.
    pub(crate) fn push(&mut self, entry: IndexEntry) -> std::io::Result<()> {
        self.slice.push(entry);
        self.pushed += 1;
        if self.slice.len() as u64 == self.geometry.slice_entries() {
            self.write_slice()?;
        }
        Ok(())
    }

    fn write_slice(&mut self) -> std::io::Result<()> {
        if self.slice.iter().all(|e| *e == IndexEntry::None) {
            self.l1.extend_from_slice(&[0u8; 16]);
        } else {
            let per = self.geometry.slice_entries() as usize;
            let mut bytes = Vec::with_capacity(per * 16);
            for i in 0..per {
                let [a, b] = self
                    .slice
                    .get(i)
                    .copied()
                    .unwrap_or(IndexEntry::None)
                    .encode();
                bytes.extend_from_slice(&a.to_be_bytes());
                bytes.extend_from_slice(&b.to_be_bytes());
            }
            self.sink.write_at(&bytes, self.next_offset)?;
            self.l1.extend_from_slice(&self.next_offset.to_be_bytes());
            self.l1
                .extend_from_slice(&slice_checksum(&bytes).to_be_bytes());
            self.l1.extend_from_slice(&[0u8; 4]);
            self.next_offset += bytes.len() as u64;
        }
        self.slice.clear();
        Ok(())
    }

    /// Writes what describes the entries (chunks never pushed read as
    /// *none*) and returns the sink.
    pub(crate) fn finish(mut self) -> std::io::Result<S> {
        while self.pushed < self.geometry.chunks() {
            self.push(IndexEntry::None)?;
        }
        if !self.slice.is_empty() {
            self.write_slice()?;
        }
        let g = self.geometry;
        let mut header = vec![0u8; INDEX_HEADER_LEN as usize];
        header[0..8].copy_from_slice(INDEX_MAGIC);
        header[8..12].copy_from_slice(&INDEX_VERSION.to_be_bytes());
        header[12..16].copy_from_slice(&(INDEX_HEADER_LEN as u32).to_be_bytes());
        header[16..20].copy_from_slice(&g.granularity_bits.to_be_bytes());
        header[20..24].copy_from_slice(&SLICE_ENTRIES_BITS.to_be_bytes());
        header[24..28].copy_from_slice(&self.layer_count.to_be_bytes());
        header[32..40].copy_from_slice(&g.covered_size.to_be_bytes());
        header[40..48].copy_from_slice(&g.chunks().to_be_bytes());
        header[48..56].copy_from_slice(&INDEX_HEADER_LEN.to_be_bytes());
        header[56..64].copy_from_slice(&(self.layer_table.len() as u64).to_be_bytes());
        header[64..72].copy_from_slice(&self.l1_offset.to_be_bytes());
        header[72..80].copy_from_slice(&g.slices().to_be_bytes());
        header[88..92].copy_from_slice(&crc32c::crc32c(&self.l1).to_be_bytes());
        let crc = crc32c::crc32c(&header);
        header[80..84].copy_from_slice(&crc.to_be_bytes());
        let mut front = header;
        front.extend_from_slice(&self.layer_table);
        front.extend_from_slice(&self.l1);
        // Up to the first slice (the gap is part of the file even when no
        // slice follows).
        let body_start = (self.l1_offset + g.slices() * ENTRY_SIZE).div_ceil(4096) * 4096;
        front.resize(body_start as usize, 0);
        self.sink.write_at(&front, 0)?;
        Ok(self.sink)
    }
}

/// Serialises an index: entries for every chunk, fingerprints of the
/// covered layers (base first).
pub fn encode_index(
    geometry: IndexGeometry,
    layers: &[LayerFingerprint],
    entries: &[IndexEntry],
) -> Vec<u8> {
    let mut writer = IndexWriter::new(Vec::new(), geometry, layers);
    for e in entries.iter().take(geometry.chunks() as usize) {
        // A Vec never fails to take bytes.
        let _ = writer.push(*e);
    }
    writer.finish().unwrap_or_default()
}

/// Numbers of the indexes opened in this process, for their slices' keys
/// in the unified cache.
static NEXT_CACHE_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// An opened, structurally valid index file (its fit to the chain is
/// checked by [`ChainIndex::matches`]).
#[derive(Debug)]
pub struct ChainIndex {
    path: PathBuf,
    storage: Arc<dyn Storage>,
    geometry: IndexGeometry,
    layers: Vec<LayerFingerprint>,
    l1: Vec<(u64, u32)>,
    file_size: u64,
    usable: AtomicBool,
    /// Why it stopped being usable (the first reason).
    given_up: std::sync::OnceLock<String>,
    /// Its number in the unified cache (unique in the process).
    cache_id: u32,
    /// Slices whose checksum matched once: the file is never rewritten in
    /// place (a new index replaces it by rename), so a slice read again
    /// after eviction is not checked again.
    verified: Box<[std::sync::atomic::AtomicU64]>,
}

fn read(storage: &dyn Storage, offset: u64, len: u64, file_size: u64) -> Result<Vec<u8>, Stale> {
    if offset.checked_add(len).is_none_or(|end| end > file_size) || len > 1 << 30 {
        return Err(Stale::Truncated);
    }
    let mut buf = vec![0u8; len as usize];
    storage
        .read_at(&mut buf, offset)
        .map_err(|e| Stale::Missing(e.to_string()))?;
    Ok(buf)
}

impl Stale {
    /// Why opening the index file at a path failed.
    pub(crate) fn from_open_error(e: &std::io::Error) -> Stale {
        match e.kind() {
            std::io::ErrorKind::NotFound => Stale::NotWritten,
            _ => Stale::Missing(e.to_string()),
        }
    }
}

impl ChainIndex {
    /// Opens and verifies the structure of the index at `path`.
    pub fn open(path: &Path, storage: Arc<dyn Storage>) -> Result<Self, Stale> {
        let file_size = storage.len().map_err(|e| Stale::Missing(e.to_string()))?;
        let mut header = read(&*storage, 0, INDEX_HEADER_LEN, file_size)?;
        if &header[0..8] != INDEX_MAGIC {
            return Err(Stale::Format("bad magic".into()));
        }
        let version = be_u32(&header, 8);
        if version != INDEX_VERSION {
            return Err(Stale::Format(format!("version {version}")));
        }
        let crc = be_u32(&header, 80);
        header[80..84].fill(0);
        if crc32c::crc32c(&header) != crc {
            return Err(Stale::Checksum("index header"));
        }
        let granularity_bits = be_u32(&header, 16);
        let slice_bits = be_u32(&header, 20);
        let layer_count = be_u32(&header, 24);
        let geometry = IndexGeometry {
            granularity_bits,
            covered_size: be_u64(&header, 32),
        };
        if !(9..=21).contains(&granularity_bits)
            || slice_bits != SLICE_ENTRIES_BITS
            || be_u64(&header, 40) != geometry.chunks()
            || be_u64(&header, 72) != geometry.slices()
        {
            return Err(Stale::Format("inconsistent geometry".into()));
        }
        let table = read(
            &*storage,
            be_u64(&header, 48),
            be_u64(&header, 56),
            file_size,
        )?;
        if table.len() < 8 {
            return Err(Stale::Truncated);
        }
        let (records, crc) = table.split_at(table.len() - 8);
        if crc32c::crc32c(records) as u64 != be_u64(crc, 0) {
            return Err(Stale::Checksum("layer table"));
        }
        let mut layers = Vec::new();
        let mut pos = 0;
        while pos < records.len() {
            let (l, n) = LayerFingerprint::decode(&records[pos..])
                .ok_or_else(|| Stale::Format("layer record".into()))?;
            layers.push(l);
            pos += n;
        }
        if layers.len() != layer_count as usize {
            return Err(Stale::Format("layer count".into()));
        }
        let l1_raw = read(
            &*storage,
            be_u64(&header, 64),
            geometry.slices() * ENTRY_SIZE,
            file_size,
        )?;
        if crc32c::crc32c(&l1_raw) != be_u32(&header, 88) {
            return Err(Stale::Checksum("index L1 table"));
        }
        let l1: Vec<(u64, u32)> = l1_raw
            .chunks_exact(16)
            .map(|c| (be_u64(c, 0), be_u32(c, 8)))
            .collect();
        let slice_bytes = geometry.slice_entries() * ENTRY_SIZE;
        let end = l1
            .iter()
            .map(|(o, _)| o.saturating_add(slice_bytes))
            .max()
            .unwrap_or(0);
        if end > file_size {
            return Err(Stale::Truncated);
        }
        Ok(Self {
            path: path.to_path_buf(),
            storage,
            geometry,
            layers,
            l1,
            file_size,
            usable: AtomicBool::new(true),
            given_up: std::sync::OnceLock::new(),
            cache_id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            verified: (0..geometry.slices().div_ceil(64))
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        })
    }

    /// Layout of the index.
    pub fn geometry(&self) -> IndexGeometry {
        self.geometry
    }

    /// Fingerprints of the covered layers, base first.
    pub fn layers(&self) -> &[LayerFingerprint] {
        &self.layers
    }

    /// Path of the index file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of the index file.
    pub(crate) fn file_size(&self) -> u64 {
        self.file_size
    }

    /// Compares the index with the layers as they are now.
    pub fn matches(
        &self,
        actual: &[LayerFingerprint],
        autoclear_ok: &[bool],
        top_size: u64,
        max_granularity_bits: u32,
    ) -> Result<(), Stale> {
        if self.layers.len() != actual.len() {
            return Err(Stale::LayerCount {
                indexed: self.layers.len() as u32,
                actual: actual.len() as u32,
            });
        }
        if self.geometry.covered_size != top_size {
            return Err(Stale::SizeChanged);
        }
        if self.geometry.granularity_bits > max_granularity_bits {
            return Err(Stale::Granularity);
        }
        for (i, (want, got)) in self.layers.iter().zip(actual).enumerate() {
            let layer = i as u32;
            if !autoclear_ok[i] {
                return Err(Stale::AutoclearCleared(layer));
            }
            let what = if want.name != got.name {
                "backing file name"
            } else if want.format != got.format {
                "format"
            } else if want.virtual_size != got.virtual_size {
                "virtual size"
            } else if want.file_size != got.file_size {
                "file size"
            } else if want.header_hash != got.header_hash {
                "header"
            } else if want.l1_hash != got.l1_hash {
                "L1 table"
            } else {
                continue;
            };
            return Err(Stale::Fingerprint { layer, what });
        }
        Ok(())
    }

    /// Bytes of the index's in-memory tables (L1 and layer records).
    pub fn heap_bytes(&self) -> u64 {
        let records: usize = self.layers.iter().map(|l| 64 + l.name.len()).sum();
        (self.l1.len() * 16 + records) as u64
    }

    /// Whether the index is still in use (a bad slice turns it off).
    pub fn usable(&self) -> bool {
        self.usable.load(Ordering::Relaxed)
    }

    /// Stops using the index (lookups walk the chain from now on).
    fn give_up(&self, reason: String) {
        let _ = self.given_up.set(reason);
        self.usable.store(false, Ordering::Relaxed);
    }

    /// Why the index stopped being usable, if it did.
    pub(crate) fn given_up_because(&self) -> Option<&str> {
        self.given_up.get().map(String::as_str)
    }

    /// The entry of `chunk`, through the unified cache; `None` when the
    /// index has become unusable (a slice failed its checksum);
    /// `Err(WouldBlock)` as [`ChainIndex::slice`].
    pub fn entry(&self, chunk: u64, cache: &SliceCache) -> Result<Option<IndexEntry>, ErrorKind> {
        let per = self.geometry.slice_entries();
        let Some(slice) = self.slice(chunk / per, cache)? else {
            return Ok(None);
        };
        Ok(self.entry_in(slice.as_ref(), chunk))
    }

    /// The entry of `chunk` in its slice's words, as [`ChainIndex::slice`]
    /// gave them (`None`: a slice of *none* entries); `None` when the entry
    /// does not decode, which makes the index unusable.
    pub(crate) fn entry_in(&self, words: Option<&Slice>, chunk: u64) -> Option<IndexEntry> {
        let Some(words) = words else {
            return Some(IndexEntry::None);
        };
        decode_at(words, chunk % self.geometry.slice_entries()).or_else(|| {
            self.give_up(format!("the entry of chunk {chunk} does not decode"));
            None
        })
    }

    /// Entries per slice.
    pub(crate) fn entries_per_slice(&self) -> u64 {
        self.geometry.slice_entries()
    }

    /// The words of slice `slice_no` (`Some(None)` for a slice of *none*
    /// entries; `None` when the index is unusable). `Err(WouldBlock)` when
    /// it is not cached and no read is allowed (`crate::nowait`): the
    /// lookup goes where it may wait. (Walking instead would never cache
    /// the slice, and a walk whose tables are all cached, as they are
    /// after the index was built in place, would go on walking.)
    pub fn slice(
        &self,
        slice_no: u64,
        cache: &SliceCache,
    ) -> Result<Option<Option<Slice>>, ErrorKind> {
        if !self.usable() {
            return Ok(None);
        }
        let per = self.geometry.slice_entries();
        let Some(&(offset, crc)) = self.l1.get(slice_no as usize) else {
            return Ok(None);
        };
        if offset == 0 {
            return Ok(Some(None));
        }
        let key = SliceKey {
            source: Source::Index(self.cache_id),
            offset,
        };
        if let Err(e) = crate::nowait::may_load() {
            // Never a reason to give the index up.
            return cache.get(key).map(|w| Some(Some(w))).ok_or(e);
        }
        let words: Result<Slice, Stale> = cache.get_or_load(key, || {
            let raw = read(&*self.storage, offset, per * ENTRY_SIZE, self.file_size)?;
            let (word, bit) = ((slice_no / 64) as usize, 1u64 << (slice_no % 64));
            let verified = self.verified.get(word);
            if verified.is_none_or(|v| v.load(Ordering::Relaxed) & bit == 0) {
                if slice_checksum(&raw) != crc {
                    return Err(Stale::Checksum("index slice"));
                }
                if let Some(v) = verified {
                    v.fetch_or(bit, Ordering::Relaxed);
                }
            }
            Ok(raw.chunks_exact(8).map(|c| be_u64(c, 0)).collect())
        });
        match words {
            Ok(w) => Ok(Some(Some(w))),
            Err(reason) => {
                tracing::warn!(index = %self.path.display(), %reason, "chain index slice unreadable: falling back to walking the chain");
                self.give_up(format!("slice {slice_no}: {reason}"));
                Ok(None)
            }
        }
    }
}

/// Checksum of a slice: the low 32 bits of its XXH3-64 (cheaper than
/// CRC-32C on the cold lookup path; structures read once use CRC-32C).
fn slice_checksum(bytes: &[u8]) -> u32 {
    xxhash_rust::xxh3::xxh3_64(bytes) as u32
}

/// Entry `i` of a slice's words (`None` for an invalid entry).
pub(crate) fn decode_at(words: &[u64], i: u64) -> Option<IndexEntry> {
    let i = (i * 2) as usize;
    IndexEntry::decode(*words.get(i)?, *words.get(i + 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::MemStorage;

    #[test]
    fn entries_round_trip() {
        for e in [
            IndexEntry::None,
            IndexEntry::Walk,
            IndexEntry::Zero { layer: 7 },
            IndexEntry::Data {
                layer: 999,
                host: 0x1234_0000,
            },
            IndexEntry::Compressed {
                layer: 3,
                l2_entry: (1 << 62) | 0x55,
            },
        ] {
            let [a, b] = e.encode();
            assert_eq!(IndexEntry::decode(a, b), Some(e));
        }
        assert_eq!(IndexEntry::decode(0, 9 << 32), None);
        assert_eq!(IndexEntry::decode(0, 1 << 50), None);
    }

    #[test]
    fn file_round_trip_and_corruption() {
        let g = IndexGeometry {
            granularity_bits: 16,
            covered_size: 1000 * 65536 + 5,
        };
        let layers = vec![LayerFingerprint {
            format: 0,
            virtual_size: 5,
            file_size: 6,
            header_hash: 7,
            l1_hash: 8,
            name: b"base.qcow2".to_vec(),
        }];
        let mut entries = vec![IndexEntry::None; g.chunks() as usize];
        entries[700] = IndexEntry::Data {
            layer: 0,
            host: 65536 * 9,
        };
        let bytes = encode_index(g, &layers, &entries);
        let cache = SliceCache::new(sqcow2_cache::CacheConfig::default());
        let idx =
            ChainIndex::open(Path::new("x"), Arc::new(MemStorage::new(bytes.clone()))).unwrap();
        assert_eq!(idx.layers(), &layers[..]);
        assert_eq!(idx.entry(700, &cache).unwrap(), Some(entries[700]));
        assert_eq!(idx.entry(3, &cache).unwrap(), Some(IndexEntry::None));
        assert!(idx.matches(&layers, &[true], g.covered_size, 16).is_ok());
        assert!(idx.matches(&layers, &[false], g.covered_size, 16).is_err());
        // Any flipped byte is caught: at open, or when its slice is read.
        for at in (0..bytes.len()).step_by(7) {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            let cache = SliceCache::new(sqcow2_cache::CacheConfig::default());
            match ChainIndex::open(Path::new("x"), Arc::new(MemStorage::new(bad))) {
                Err(_) => {}
                Ok(idx) => {
                    let e = idx.entry(700, &cache).unwrap();
                    assert!(e.is_none() || e == Some(entries[700]), "byte {at}");
                    if e.is_none() {
                        assert!(!idx.usable());
                    }
                }
            }
        }
    }
}
