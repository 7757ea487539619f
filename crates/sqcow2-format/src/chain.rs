//! A backing chain: opened iteratively from the top, read like QEMU reads it.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use tracing::debug;

use crate::active::{ActiveState, CacheLink, WritePlan};
use crate::backing::{resolve_backing_path, BackingFormat};
use crate::check::{check_storage, read_header, Repair};
use crate::compressed::read_compressed_cluster;
use crate::entry::CompressedDescriptor;
use crate::error::{Error, ErrorKind, Feature, WithPath};
use crate::features::{AUTOCLEAR_BITMAPS, AUTOCLEAR_DATA_FILE_RAW, INCOMPAT_DIRTY};
use crate::header::Version;
use crate::index::{decode_at, ChainIndex, IndexEntry, IndexGeometry};
use crate::sqcow2_ext::{granularity_bits, open_index, IndexState};
use crate::summary::TopSummary;

/// Autoclear bits this writer keeps consistent (or that do not apply).
const KNOWN_AUTOCLEAR: u64 = AUTOCLEAR_BITMAPS | AUTOCLEAR_DATA_FILE_RAW;
use crate::header::QCOW2_MAGIC;
use crate::layer::{Layer, LayerStatus, Qcow2Layer, RawLayer};
use crate::storage::{FileStorage, Storage};
use crate::types::{GuestOffset, HostOffset, LayerIndex};
use sqcow2_cache::{CacheConfig, Policy, Slice, SliceCache, SliceKey, StatsSnapshot};

/// Default limit on the number of layers in a chain.
pub const DEFAULT_MAX_LAYERS: usize = 65535;
/// Default byte budget of the unified metadata cache (QEMU's default for
/// one layer; here for the whole chain).
pub const DEFAULT_CACHE_SIZE: u64 = sqcow2_cache::DEFAULT_BUDGET;
/// Default size of a cached metadata slice.
pub const DEFAULT_SLICE_SIZE: u64 = 4096;

/// How to open a chain.
#[derive(Debug, Clone)]
pub struct ChainOptions {
    /// Most layers a chain may have, the top included.
    pub max_layers: usize,
    /// Byte budget of the unified metadata cache.
    pub cache_size: u64,
    /// Bytes per cached metadata slice (clamped to one cluster).
    pub slice_size: u64,
    /// Eviction policy of the cache.
    pub cache_policy: Policy,
    /// Use the chain index when the top names a valid one (otherwise walk
    /// the chain, as QEMU does).
    pub use_index: bool,
    /// Open the top image for writing.
    pub writable: bool,
    /// Storage to use for the top image instead of opening its path (tests
    /// inject faults this way); its path still anchors backing names.
    pub top_storage: Option<Arc<dyn Storage>>,
    /// Backing files must lie inside this directory (symlinks resolved,
    /// on the opened file itself); `None`: anywhere.
    pub backing_root: Option<PathBuf>,
    /// Most bytes the layers' L1 tables may take together (each is also
    /// bounded by itself, as in QEMU).
    pub max_l1_bytes_total: u64,
}

/// Default of [`ChainOptions::max_l1_bytes_total`]: 512 MiB, e.g. 1000
/// layers of 32 TiB disks with 64 KiB clusters.
pub const DEFAULT_MAX_L1_BYTES_TOTAL: u64 = 512 << 20;

impl Default for ChainOptions {
    fn default() -> Self {
        Self {
            max_layers: DEFAULT_MAX_LAYERS,
            cache_size: DEFAULT_CACHE_SIZE,
            slice_size: DEFAULT_SLICE_SIZE,
            cache_policy: Policy::S3Fifo,
            use_index: true,
            writable: false,
            top_storage: None,
            backing_root: None,
            max_l1_bytes_total: DEFAULT_MAX_L1_BYTES_TOTAL,
        }
    }
}

/// What a run of guest bytes reads as, and which layer decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentKind {
    /// Data stored uncompressed at a host offset of the deciding layer.
    Data {
        /// Host offset of the first byte.
        host: HostOffset,
    },
    /// A compressed cluster of the deciding layer.
    Compressed(CompressedDescriptor),
    /// Zeros.
    Zero {
        /// Host offset, for preallocated zero clusters and raw holes.
        host: Option<HostOffset>,
        /// Whether a layer records the zeros (false: nothing is allocated,
        /// or the range lies beyond the end of a backing file).
        allocated: bool,
    },
}

/// A run of guest bytes with one mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// First guest byte.
    pub start: GuestOffset,
    /// Length in bytes.
    pub len: u64,
    /// The layer that decided the mapping (the last one looked at).
    pub layer: LayerIndex,
    /// The mapping.
    pub kind: ExtentKind,
}

/// An opened chain; layer 0 is the base, the last layer the top.
///
/// Opened writable, the top takes writes; call [`Chain::close`] to flush
/// and leave the image clean (dropping does it too, logging any error).
#[derive(Debug)]
pub struct Chain {
    layers: Vec<Layer>,
    cache: Arc<SliceCache>,
    slice_size: u64,
    data_reads: Vec<AtomicU64>,
    active: Option<Active>,
    index: Option<ChainIndex>,
    index_state: IndexState,
    /// Bumped whenever the top's mapping changes; resolved slices built
    /// across a change are dropped.
    mapping_generation: AtomicU64,
    /// log2 of the granule of resolved slices.
    resolved_bits: u32,
    /// Regions of the top that hold nothing (indexed mode only).
    summary: Option<Arc<TopSummary>>,
    /// Resolved slices looked up once (a lossy bit filter): built on the
    /// second lookup, so that a cold lookup reads only what it needs.
    touched: Box<[AtomicU64]>,
}

/// Cache source of resolved slices (guest slice number as offset).
const RESOLVED_SOURCE: u32 = u32::MAX - 1;
/// Words of the filter of resolved slices looked up once.
const TOUCHED_WORDS: usize = 256;
/// log2 of the granules per resolved slice (256: a 4 KiB slice).
const RESOLVED_ENTRIES_BITS: u32 = 8;

/// The writable top: its metadata behind a lock, and a gate that requests
/// hold shared and a flush holds exclusively, so that clusters freed by a
/// flush are not in use by a request still in flight.
#[derive(Debug)]
struct Active {
    gate: RwLock<()>,
    state: Mutex<ActiveState>,
}

/// The storage of a qcow2 layer.
fn q_storage(q: &Qcow2Layer) -> &Arc<dyn Storage> {
    q.storage()
}

/// Locks a mutex, recovering from a panicked holder (the metadata stays
/// consistent because every update is applied before the lock is released).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which format to open the next file with.
enum Expect {
    /// The top image (must be qcow2).
    Top,
    /// A backing file with a recorded format.
    Recorded(BackingFormat),
    /// A backing file without a recorded format (qcow2 if its magic says so).
    Probe,
}

fn open_layer(
    path: &Path,
    file: Option<File>,
    expect: Expect,
    options: &ChainOptions,
) -> Result<Layer, ErrorKind> {
    let storage: Arc<dyn Storage> = match (&expect, &options.top_storage, file) {
        (Expect::Top, Some(s), _) => s.clone(),
        (Expect::Top, None, _) if options.writable => Arc::new(FileStorage::open_read_write(path)?),
        (_, _, Some(file)) => Arc::new(FileStorage::from_file(file)),
        (_, _, None) => Arc::new(FileStorage::open_read_only(path)?),
    };
    let is_qcow2 = || -> Result<bool, ErrorKind> {
        let mut magic = [0u8; 4];
        storage.read_at(&mut magic, 0)?;
        Ok(storage.len()? >= 4 && u32::from_be_bytes(magic) == QCOW2_MAGIC)
    };
    match expect {
        Expect::Top => Ok(Layer::Qcow2(Qcow2Layer::open(path, storage.clone())?)),
        Expect::Recorded(BackingFormat::Raw) => Ok(Layer::Raw(RawLayer::open(path, storage)?)),
        Expect::Recorded(BackingFormat::Qcow2) => {
            if !is_qcow2()? {
                return Err(ErrorKind::BackingNotQcow2(path.to_path_buf()));
            }
            Ok(Layer::Qcow2(Qcow2Layer::open(path, storage)?))
        }
        Expect::Probe => {
            if !is_qcow2()? {
                return Err(ErrorKind::UnknownBackingFormat(path.to_path_buf()));
            }
            Ok(Layer::Qcow2(Qcow2Layer::open(path, storage)?))
        }
    }
}

/// Refuses an opened backing file whose real location (read from the open
/// descriptor, so a symlink swapped after the check cannot fool it) is
/// outside `root`.
fn check_inside_root(file: &File, named: &Path, root: &Path) -> Result<(), ErrorKind> {
    use std::os::fd::AsRawFd;
    let root = std::fs::canonicalize(root)?;
    let resolved = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    if resolved.starts_with(&root) {
        Ok(())
    } else {
        Err(ErrorKind::BackingOutsideRoot {
            backing: named.to_path_buf(),
            resolved,
            root,
        })
    }
}

impl Chain {
    /// Opens the chain whose top image is `path`, following backing files
    /// iteratively.
    pub fn open(path: &Path, options: &ChainOptions) -> Result<Chain, Error> {
        let mut top_down: Vec<Layer> = Vec::new();
        let mut seen = HashSet::new();
        let mut l1_bytes = 0u64;
        let mut next = Some((path.to_path_buf(), Expect::Top));
        while let Some((current, expect)) = next.take() {
            let referrer = top_down.last().map(|l| l.path().to_path_buf());
            let blame = referrer.clone().unwrap_or_else(|| current.clone());
            if top_down.len() >= options.max_layers {
                return Err(Error::new(
                    blame,
                    ErrorKind::ChainTooDeep {
                        limit: options.max_layers,
                    },
                ));
            }
            let injected = referrer.is_none() && options.top_storage.is_some();
            let file = if injected {
                None
            } else {
                let file = match File::open(&current) {
                    Ok(f) => f,
                    Err(source) if referrer.is_some() => {
                        return Err(Error::new(
                            blame,
                            ErrorKind::MissingBacking {
                                backing: current,
                                source,
                            },
                        ))
                    }
                    Err(e) => return Err(Error::new(current, ErrorKind::Io(e))),
                };
                if let (Some(root), Some(_)) = (&options.backing_root, &referrer) {
                    check_inside_root(&file, &current, root).map_err(|k| Error::new(&blame, k))?;
                }
                let meta = file
                    .metadata()
                    .map_err(|e| Error::new(&current, e.into()))?;
                if !seen.insert((meta.dev(), meta.ino())) {
                    return Err(Error::new(blame, ErrorKind::BackingLoop(current)));
                }
                Some(file)
            };
            let layer = open_layer(&current, file, expect, options).map_err(|kind| match kind {
                // The referring image records the wrong format: blame it.
                ErrorKind::UnknownBackingFormat(_) | ErrorKind::BackingNotQcow2(_) => {
                    Error::new(&blame, kind)
                }
                kind => Error::new(&current, kind),
            })?;
            if let Some(header) = layer.header() {
                if let Some(name) = &header.backing_file {
                    let backing = resolve_backing_path(&current, name).with_path(&current)?;
                    let format = BackingFormat::from_recorded(header.backing_format())
                        .with_path(&current)?;
                    let expect = match format {
                        Some(f) => Expect::Recorded(f),
                        None => Expect::Probe,
                    };
                    next = Some((backing, expect));
                }
            }
            l1_bytes += layer.header().map_or(0, |h| u64::from(h.l1_size) * 8);
            if l1_bytes > options.max_l1_bytes_total {
                return Err(Error::new(
                    &current,
                    ErrorKind::ChainMetadataTooLarge {
                        bytes: l1_bytes,
                        limit: options.max_l1_bytes_total,
                    },
                ));
            }
            debug!(path = %current.display(), format = layer.format_name(), "opened layer");
            top_down.push(layer);
        }
        top_down.reverse();
        let (index, index_state) = if options.use_index {
            open_index(&top_down)
        } else {
            (None, IndexState::Disabled)
        };
        let resolved_bits = {
            let top_bits = top_down
                .last()
                .and_then(|l| l.header())
                .map_or(16, |h| h.geometry.subcluster_size().trailing_zeros());
            let index_bits = index
                .as_ref()
                .map_or(top_bits, |i| i.geometry().granularity_bits);
            top_bits.min(index_bits)
        };
        let summary = match (&index, top_down.last()) {
            (Some(_), Some(Layer::Qcow2(q))) => {
                TopSummary::build(q.header(), q.l1(), &**q_storage(q), options.slice_size)
                    .ok()
                    .map(Arc::new)
            }
            _ => None,
        };
        let cache = Arc::new(SliceCache::new(CacheConfig {
            budget: options.cache_size,
            policy: options.cache_policy,
            ..CacheConfig::default()
        }));
        let active = if options.writable {
            let link = CacheLink {
                cache: cache.clone(),
                source: (top_down.len() - 1) as u32,
                slice_size: options.slice_size,
                budget: options.cache_size,
                summary: summary.clone(),
            };
            Some(Active::open(&top_down, link)?)
        } else {
            None
        };
        Ok(Chain {
            data_reads: top_down.iter().map(|_| AtomicU64::new(0)).collect(),
            layers: top_down,
            cache,
            slice_size: options.slice_size,
            active,
            resolved_bits,
            index,
            index_state,
            mapping_generation: AtomicU64::new(0),
            summary,
            touched: (0..TOUCHED_WORDS).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Statistics of the unified cache.
    pub fn cache_stats(&self) -> StatsSnapshot {
        self.cache.stats().snapshot()
    }

    /// Bytes held by per-layer structures and the index's tables, outside
    /// the cache (whose bytes [`Chain::cache_stats`] reports).
    pub fn metadata_structure_bytes(&self) -> u64 {
        let layers: u64 = self.layers.iter().map(Layer::heap_bytes).sum();
        let counters = self.data_reads.len() as u64 * 8;
        let index = self.index.as_ref().map_or(0, |i| i.heap_bytes());
        layers + counters + index
    }

    /// Empties the metadata cache (benchmarks of cold lookups).
    pub fn clear_cache(&self) {
        self.cache.clear();
        self.touched
            .iter()
            .for_each(|w| w.store(0, Ordering::Relaxed));
    }

    /// Data reads served by each layer (base first).
    pub fn data_reads_per_layer(&self) -> Vec<u64> {
        self.data_reads
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    /// The layers, base first.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The top layer (the active volume).
    pub fn top(&self) -> &Layer {
        // A chain always has at least its top layer.
        &self.layers[self.layers.len() - 1]
    }

    /// Index of the top layer.
    pub fn top_index(&self) -> LayerIndex {
        LayerIndex(self.layers.len() - 1)
    }

    /// Virtual size of the disk (the top's).
    pub fn virtual_size(&self) -> u64 {
        match &self.active {
            Some(a) => lock(&a.state).size(),
            None => self.top().virtual_size(),
        }
    }

    fn layer_status(
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
            return lock(&active.state).status(guest.0, max);
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
    pub fn resolve(&self, start: GuestOffset, max: u64, precise: bool) -> Result<Extent, Error> {
        if !precise && self.is_indexed() {
            if let Some(extent) = self.resolved_extent(start, max)? {
                return Ok(extent);
            }
        }
        self.resolve_from(self.top_index(), start, max, precise)
    }

    /// The extent at `start` from the cache of resolved slices (top and
    /// index combined, one lookup whatever the chain length); `None` where
    /// the index says to walk.
    fn resolved_extent(&self, start: GuestOffset, max: u64) -> Result<Option<Extent>, Error> {
        let bits = self.resolved_bits;
        let slice_no = start.0 >> (bits + RESOLVED_ENTRIES_BITS);
        let key = SliceKey {
            source: RESOLVED_SOURCE,
            offset: slice_no,
        };
        // A slice never looked up since the cache was emptied cannot be
        // cached: answer directly (reading only what this lookup needs) and
        // remember it; build the resolved slice from the next lookup on.
        let bit = (slice_no.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 50) as usize;
        let word = &self.touched[(bit / 64) % TOUCHED_WORDS];
        let mask = 1u64 << (bit % 64);
        if word.load(Ordering::Relaxed) & mask == 0 {
            word.fetch_or(mask, Ordering::Relaxed);
            return Ok(None);
        }
        let words = match self.cache.get(key) {
            Some(w) => w,
            None => {
                let generation = self.mapping_generation.load(Ordering::SeqCst);
                let built = self.build_resolved(slice_no)?;
                self.cache.insert(key, built.clone());
                if self.mapping_generation.load(Ordering::SeqCst) != generation {
                    self.cache.remove(key);
                }
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
    fn build_resolved(&self, slice_no: u64) -> Result<Slice, Error> {
        let bits = self.resolved_bits;
        let granule = 1u64 << bits;
        let n = 1u64 << RESOLVED_ENTRIES_BITS;
        let start = slice_no << (bits + RESOLVED_ENTRIES_BITS);
        let size = self.virtual_size();
        let end = (start + n * granule).min(size);
        let top = self.top_index();
        let top_geometry = self.top().header().map(|h| h.geometry);
        let mut words = vec![0u64; (n * 2) as usize];
        let mut put = |pos: u64, e: IndexEntry| {
            let i = (((pos - start) >> bits) * 2) as usize;
            let [a, b] = e.encode();
            words[i] = a;
            words[i + 1] = b;
        };
        // The index slice in use: (slice number, its words).
        let mut current: Option<(u64, Option<Slice>)> = None;
        let mut index_entry = |g: u64| -> IndexEntry {
            let Some(ci) = &self.index else {
                return IndexEntry::Walk;
            };
            let bits = ci.geometry().granularity_bits;
            let chunk = g >> bits;
            let per = ci.entries_per_slice();
            let slice_no = chunk / per;
            if current.as_ref().is_none_or(|(n, _)| *n != slice_no) {
                match ci.slice(slice_no, &self.cache) {
                    Some(words) => current = Some((slice_no, words)),
                    None => return IndexEntry::Walk,
                }
            }
            let entry = match current.as_ref().and_then(|(_, w)| w.as_ref()) {
                Some(words) => decode_at(words, chunk % per).unwrap_or(IndexEntry::Walk),
                None => IndexEntry::None,
            };
            match entry {
                // A granule inside a larger chunk: offset the host.
                IndexEntry::Data { layer, host } => IndexEntry::Data {
                    layer,
                    host: host + (g - (chunk << bits)),
                },
                e => e,
            }
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
                        l2_entry: top_geometry.map_or(0, |tg| d.encode(tg)),
                    },
                    LayerStatus::Zero { .. } => IndexEntry::Zero {
                        layer: top.0 as u32,
                    },
                    LayerStatus::Unallocated { .. } => index_entry(g),
                };
                put(g, entry);
                g += granule;
            }
            pos = run_end.max(pos + 1);
        }
        Ok(words.into())
    }

    /// Drops resolved slices covering `[offset, offset + len)` after the
    /// top's mapping changed there.
    fn mapping_changed(&self, offset: u64, len: u64) {
        self.mapping_generation.fetch_add(1, Ordering::SeqCst);
        let shift = self.resolved_bits + RESOLVED_ENTRIES_BITS;
        let last = (offset + len.max(1) - 1) >> shift;
        for slice_no in offset >> shift..=last {
            self.cache.remove(SliceKey {
                source: RESOLVED_SOURCE,
                offset: slice_no,
            });
        }
    }

    /// [`Chain::resolve`] starting at layer `index` instead of the top
    /// (`start` must lie within that layer's virtual size).
    fn resolve_from(
        &self,
        mut index: LayerIndex,
        start: GuestOffset,
        max: u64,
        precise: bool,
    ) -> Result<Extent, Error> {
        let mut len = max;
        loop {
            let (status, n) = self.layer_status(index, start, len, precise)?;
            len = n;
            if index == self.top_index() && index.0 > 0 {
                if let (LayerStatus::Unallocated { .. }, Some(ci)) = (&status, &self.index) {
                    if let Some(extent) = self.index_extent(ci, start, len) {
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

    /// The extent at `start` (at most `len` bytes) from the chain index;
    /// `None` when the index cannot answer (split chunk, unusable index).
    fn index_extent(&self, ci: &ChainIndex, start: GuestOffset, len: u64) -> Option<Extent> {
        let g = ci.geometry();
        let chunk = start.0 >> g.granularity_bits;
        let chunk_start = chunk << g.granularity_bits;
        let len = len.min(chunk_start + g.chunk_size() - start.0);
        let below = LayerIndex(self.top_index().0 - 1);
        let (layer, kind) = match ci.entry(chunk, &self.cache)? {
            IndexEntry::Walk => return None,
            IndexEntry::None => (
                below,
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
                let geometry = self.layers.get(layer as usize)?.header()?.geometry;
                (
                    LayerIndex(layer as usize),
                    ExtentKind::Compressed(CompressedDescriptor::decode(l2_entry, geometry)),
                )
            }
        };
        if layer.0 >= self.top_index().0 {
            return None;
        }
        Some(Extent {
            start,
            len,
            layer,
            kind,
        })
    }

    /// Whether and why the chain index is (not) used.
    pub fn index_state(&self) -> &IndexState {
        &self.index_state
    }

    /// The raw index entry of `chunk`, when an index is in use.
    pub fn index_entry(&self, chunk: u64) -> Option<IndexEntry> {
        self.index.as_ref()?.entry(chunk, &self.cache)
    }

    /// Whether lookups currently go through the chain index.
    pub fn is_indexed(&self) -> bool {
        self.index.as_ref().is_some_and(|i| i.usable())
    }

    /// Index entries for every chunk of `[0, covered_size)` as layers
    /// `0..=upto` resolve it (through this chain's index when `upto` is the
    /// top), and the geometry to store them with. `progress(done, total)`
    /// is called as chunks are resolved.
    pub fn index_entries(
        &self,
        upto: LayerIndex,
        covered_size: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(IndexGeometry, Vec<IndexEntry>), Error> {
        let geometry = IndexGeometry {
            granularity_bits: granularity_bits(&self.layers, upto.0),
            covered_size,
        };
        let cs = geometry.chunk_size();
        let chunks = geometry.chunks();
        let size = self.layers[upto.0].virtual_size();
        // Extending this chain's own index (a snapshot of the top): where
        // the top holds nothing, the new entry is the old one.
        let extending = upto == self.top_index()
            && self.is_indexed()
            && self
                .index
                .as_ref()
                .is_some_and(|i| i.geometry() == geometry);
        let mut entries = Vec::with_capacity(chunks as usize);
        let mut chunk = 0u64;
        while chunk < chunks {
            let start = chunk * cs;
            if start >= size {
                entries.push(IndexEntry::None);
                chunk += 1;
                continue;
            }
            if extending {
                let (status, n) =
                    self.layer_status(upto, GuestOffset(start), size - start, false)?;
                if matches!(status, LayerStatus::Unallocated { .. }) && n >= cs {
                    let before = chunk;
                    let end = (chunk + n / cs).min(chunks);
                    while chunk < end {
                        match self.index_entry(chunk) {
                            Some(old) => entries.push(old),
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
            let extent = self.resolve_from(upto, GuestOffset(start), size - start, false)?;
            let whole = extent.len / cs;
            if whole == 0 {
                // The mapping changes inside this chunk (a layer ends here).
                entries.push(IndexEntry::Walk);
                chunk += 1;
                continue;
            }
            for k in 0..whole {
                let delta = k * cs;
                entries.push(match extent.kind {
                    ExtentKind::Data { host } => IndexEntry::Data {
                        layer: extent.layer.0 as u32,
                        host: host.0 + delta,
                    },
                    ExtentKind::Compressed(_) => {
                        // Re-read the layer's entry: the descriptor as stored.
                        let layer = &self.layers[extent.layer.0];
                        let l2_entry = match layer {
                            Layer::Qcow2(q) => q
                                .raw_l2_entry(
                                    extent.layer,
                                    extent.start.0 + delta,
                                    &self.cache,
                                    self.slice_size,
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
                });
            }
            chunk += whole;
            progress(chunk.min(chunks), chunks);
        }
        entries.truncate(chunks as usize);
        Ok((geometry, entries))
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), Error> {
        let size = self.virtual_size();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::new(
                self.top().path(),
                ErrorKind::OutOfRange { offset, len, size },
            ));
        }
        Ok(())
    }

    /// Reads guest bytes at `offset` into `buf`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        self.check_range(offset, buf.len() as u64)?;
        let _gate = self.active.as_ref().map(|a| a.gate.read());
        self.read_from(self.top_index(), buf, offset)
    }

    /// Reads what layer `index` and the layers below it hold at `offset`;
    /// zeros beyond that layer's virtual size.
    fn read_from(&self, index: LayerIndex, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        let size = self.layers[index.0].virtual_size();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = GuestOffset(offset + done as u64);
            if pos.0 >= size {
                buf[done..].fill(0);
                break;
            }
            let want = ((buf.len() - done) as u64).min(size - pos.0);
            let extent = if index == self.top_index() {
                self.resolve(pos, want, false)?
            } else {
                self.resolve_from(index, pos, want, false)?
            };
            let n = extent.len as usize;
            let out = &mut buf[done..done + n];
            let layer = &self.layers[extent.layer.0];
            if !matches!(extent.kind, ExtentKind::Zero { .. }) {
                self.data_reads[extent.layer.0].fetch_add(1, Ordering::Relaxed);
            }
            match extent.kind {
                ExtentKind::Zero { .. } => out.fill(0),
                ExtentKind::Data { host } => layer
                    .storage()
                    .read_at(out, host.0)
                    .map_err(|e| Error::new(layer.path(), e.into()))?,
                ExtentKind::Compressed(d) => {
                    self.read_compressed(layer, d, pos, out)?;
                }
            }
            done += n;
        }
        Ok(())
    }

    /// Reads the guest view of the layers below the top.
    fn read_below(&self, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        match self.top_index().0.checked_sub(1) {
            Some(i) => self.read_from(LayerIndex(i), buf, offset),
            None => {
                buf.fill(0);
                Ok(())
            }
        }
    }

    fn active(&self) -> Result<&Active, Error> {
        self.active.as_ref().ok_or_else(|| {
            Error::new(
                self.top().path(),
                ErrorKind::Io(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    "image opened read-only",
                )),
            )
        })
    }

    /// Calls `each(offset, len)` for every piece of `[offset, offset + len)`
    /// that lies within one cluster of the top.
    fn for_each_cluster(
        &self,
        offset: u64,
        len: u64,
        mut each: impl FnMut(u64, u64) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let cluster_size = self
            .top()
            .header()
            .map(|h| h.geometry.cluster_size())
            .unwrap_or(65536);
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = (cluster_size - pos % cluster_size).min(end - pos);
            each(pos, n)?;
            pos += n;
        }
        Ok(())
    }

    /// Writes `buf` at guest `offset` into the top.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), Error> {
        self.check_range(offset, buf.len() as u64)?;
        let active = self.active()?;
        let _gate = active.gate.read();
        self.write_locked(active, buf, offset)
    }

    fn write_locked(&self, active: &Active, buf: &[u8], offset: u64) -> Result<(), Error> {
        let below = |b: &mut [u8], o: u64| self.read_below(b, o);
        self.for_each_cluster(offset, buf.len() as u64, |pos, n| {
            let data = &buf[(pos - offset) as usize..(pos - offset + n) as usize];
            let plan = lock(&active.state).write_in_cluster(&below, data, pos)?;
            if plan == WritePlan::Done {
                self.mapping_changed(pos, n);
            }
            if let WritePlan::InPlace(host) = plan {
                let top = self.top();
                top.storage()
                    .write_at(data, host)
                    .map_err(|e| Error::new(top.path(), e.into()))?;
            }
            Ok(())
        })
    }

    /// Makes `[offset, offset + len)` read as zeros. Whole clusters become
    /// zero clusters (with `unmap`, their space is released); partial ones
    /// are written with zeros.
    pub fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> Result<(), Error> {
        self.zero_range(offset, len, unmap, true)
    }

    /// Discards `[offset, offset + len)`: whole clusters read as zeros
    /// afterwards and their space is released; partial clusters are left
    /// as they are (discard is advisory, as in QEMU).
    pub fn discard(&self, offset: u64, len: u64) -> Result<(), Error> {
        self.zero_range(offset, len, true, false)
    }

    /// Zeroes whole clusters as metadata (writing zeros where the image
    /// cannot express them) and, if `partial`, writes zeros over the
    /// partial clusters at the ends.
    fn zero_range(&self, offset: u64, len: u64, unmap: bool, partial: bool) -> Result<(), Error> {
        self.check_range(offset, len)?;
        let active = self.active()?;
        let _gate = active.gate.read();
        let cluster_size = self.cluster_size();
        let zeros = vec![0u8; cluster_size as usize];
        self.for_each_cluster(offset, len, |pos, n| {
            let whole =
                n == cluster_size || pos + n == self.virtual_size() && pos % cluster_size == 0;
            if !whole && !partial {
                return Ok(());
            }
            if whole && lock(&active.state).zero_cluster(pos, unmap)? {
                self.mapping_changed(pos, n);
                return Ok(());
            }
            self.write_locked(active, &zeros[..n as usize], pos)
        })
    }

    /// Makes every completed write durable, metadata in crash-safe order.
    pub fn flush(&self) -> Result<(), Error> {
        let Some(active) = &self.active else {
            return Ok(());
        };
        let _gate = active.gate.write();
        lock(&active.state).flush()
    }

    /// Flushes like [`Chain::close`] (lazy refcounts written, dirty bit
    /// cleared) but keeps the chain open: the image is clean for any reader
    /// until the next write.
    pub fn flush_clean(&self) -> Result<(), Error> {
        let Some(active) = &self.active else {
            return Ok(());
        };
        let _gate = active.gate.write();
        lock(&active.state).close()
    }

    /// Where a write of `len` bytes at guest `offset` (within one cluster)
    /// may go straight to the top's file, bypassing the engine: the host
    /// offset, or `None` when the write needs the engine (allocation,
    /// copy-on-write, zero, compressed or shared cluster). The caller must
    /// finish such a write before the next [`Chain::flush`] (a flush may
    /// make clusters freed meanwhile reusable).
    pub fn in_place_target(&self, offset: u64, len: u64) -> Result<Option<u64>, Error> {
        self.check_range(offset, len)?;
        let active = self.active()?;
        let cluster_size = self.cluster_size();
        if len == 0 || offset % cluster_size + len > cluster_size {
            return Ok(None);
        }
        let _gate = active.gate.read();
        lock(&active.state).in_place_target(offset, len)
    }

    /// Test hook: the writable engine panics at the `nth` next hit of
    /// `point` (cargo feature `fault-injection`; without it, nothing).
    pub fn arm_fault(&self, point: crate::fault::FaultPoint, nth: u32) {
        if let Some(a) = &self.active {
            lock(&a.state).faults.arm(point, nth);
        }
    }

    /// Counts a data read from `layer` done by a caller that reads the
    /// host file itself (see [`Chain::data_reads_per_layer`]).
    pub fn count_data_read(&self, layer: LayerIndex) {
        if let Some(counter) = self.data_reads.get(layer.0) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether the chain takes writes.
    pub fn is_writable(&self) -> bool {
        self.active.is_some()
    }

    /// Flushes and leaves the image clean (clears the dirty bit of lazy
    /// refcounts). Read-only chains close trivially.
    pub fn close(mut self) -> Result<(), Error> {
        match self.active.take() {
            Some(active) => active
                .state
                .into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .close(),
            None => Ok(()),
        }
    }

    fn cluster_size(&self) -> u64 {
        self.top()
            .header()
            .map(|h| h.geometry.cluster_size())
            .unwrap_or(65536)
    }

    fn read_compressed(
        &self,
        layer: &Layer,
        d: CompressedDescriptor,
        pos: GuestOffset,
        out: &mut [u8],
    ) -> Result<(), Error> {
        let Some(header) = layer.header() else {
            return Err(Error::new(
                layer.path(),
                ErrorKind::Io(std::io::Error::other("compressed cluster in a raw file")),
            ));
        };
        let g = header.geometry;
        let cluster = read_compressed_cluster(&**layer.storage(), header.compression_type, g, d)
            .map_err(|k| Error::new(layer.path(), k))?;
        let from = g.offset_in_cluster(pos.0) as usize;
        out.copy_from_slice(&cluster[from..from + out.len()]);
        Ok(())
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

impl Active {
    /// Takes the top of freshly opened `layers` (base first) for writing.
    fn open(layers: &[Layer], link: CacheLink) -> Result<Active, Error> {
        let top = &layers[layers.len() - 1];
        let Some(header) = top.header() else {
            return Err(Error::new(top.path(), ErrorKind::BadMagic(0)));
        };
        let path = top.path();
        let storage = top.storage().clone();
        let e = |k: ErrorKind| Error::new(path, k);
        if header.has_bitmaps() {
            return Err(e(ErrorKind::Unsupported(Feature::WriteWithBitmaps)));
        }
        let mut header = header.clone();
        if header.is_dirty() {
            // Refcounts of a dirty image may be stale: repair, as QEMU does.
            tracing::warn!(path = %path.display(), "image was not closed cleanly: repairing refcounts");
            check_storage(path, storage.clone(), Repair::All)?;
            header = read_header(&*storage).map_err(e)?;
            let clean = header.features.incompatible & !INCOMPAT_DIRTY;
            storage
                .write_at(&clean.to_be_bytes(), 72)
                .and_then(|()| storage.sync())
                .map_err(|io| e(io.into()))?;
            header.features.incompatible = clean;
        }
        let unknown_autoclear = header.features.autoclear & !KNOWN_AUTOCLEAR;
        if header.version == Version::V3 && unknown_autoclear != 0 {
            // A writer that does not know an autoclear feature clears it.
            let kept = header.features.autoclear & KNOWN_AUTOCLEAR;
            storage
                .write_at(&kept.to_be_bytes(), 88)
                .and_then(|()| storage.sync())
                .map_err(|io| e(io.into()))?;
            header.features.autoclear = kept;
        }
        let state = ActiveState::open(path, storage, header, layers.len() > 1, link)?;
        Ok(Active {
            gate: RwLock::new(()),
            state: Mutex::new(state),
        })
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        if let Some(active) = self.active.take() {
            let path = self.top().path().to_path_buf();
            let state = active.state.into_inner().unwrap_or_else(|p| p.into_inner());
            let mut state = state;
            if let Err(e) = state.close() {
                tracing::error!(path = %path.display(), error = %e, "closing the image failed");
            }
        }
    }
}
