//! One layer of a chain: a qcow2 image or a raw file, and what it says about
//! a range of guest offsets.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::bytes::be_u64;
use crate::entry::{decode_l2, ClusterMapping, EntryError, OFFSET_MASK};
use crate::error::{ErrorKind, Table};
use crate::header::Header;
use crate::held::{Busy, HolderSlot, TableHolder};
use crate::storage::Storage;
use crate::types::{Geometry, GuestOffset, HostOffset, LayerIndex};
use sqcow2_cache::{Slice, SliceCache, SliceKey, Source};
use xxhash_rust::xxh3::xxh3_64;

/// What a layer says about a run of guest bytes.
pub(crate) type LayerStatus = ClusterMapping;

/// A qcow2 image opened read-only: validated header and active L1 table
/// (read at open for the top; for a layer below it, read when first
/// needed, which indexed lookups never are, and checked against the
/// fingerprint taken at open).
///
/// Cloning is cheap and shares the header and the L1 table (a chain that
/// follows a live snapshot keeps the layers below the old top).
#[derive(Debug, Clone)]
pub struct Qcow2Layer {
    path: PathBuf,
    storage: Arc<dyn Storage>,
    header: Arc<Header>,
    l1: Arc<OnceLock<Vec<u64>>>,
    /// The file's size at open: what L2 table offsets are checked against.
    file_size: u64,
    /// Hash of the active L1 table at open.
    l1_hash: u64,
    /// What a chain index records of the file besides its L1 table; taken
    /// at open, taken again once the writer that had the image open has
    /// closed it ([`Qcow2Layer::refresh_identity`]).
    identity: Arc<Mutex<Identity>>,
    /// A writer of this process that may hold tables newer than the file
    /// (a live snapshot's old top until it is closed): asked first.
    holder: Option<HolderSlot>,
    /// The file other chains of the process share ([`crate::SharedLayers`]):
    /// its L2 slices are cached in the shared cache, not the chain's.
    shared: Option<SharedTables>,
}

/// Where the L2 slices of a file several chains share are cached, and
/// the registry's entry for it (one reference per chain's layer).
#[derive(Clone)]
pub(crate) struct SharedTables {
    pub(crate) cache: Arc<SliceCache>,
    pub(crate) source: Source,
    pub(crate) users: Arc<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for SharedTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedTables")
            .field("source", &self.source)
            .finish()
    }
}

/// What identifies an image's file besides its L1 table: its size and the
/// hash of its header area (autoclear bits excluded, which sqcow2 itself
/// sets). A writer's close changes both (the dirty bit cleared, spare
/// clusters cut off the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    file_size: u64,
    header_hash: u64,
}

/// An image's header, identity and active L1 table (bytes) as the file
/// holds them now.
fn read_image(storage: &dyn Storage) -> Result<(Header, Identity, Vec<u8>), ErrorKind> {
    let (header, identity) = read_header(storage)?;
    let mut raw = vec![0u8; header.l1_size as usize * 8];
    storage.read_at(&mut raw, header.l1_table_offset)?;
    Ok((header, identity, raw))
}

/// An image's header and identity as the file holds them now.
fn read_header(storage: &dyn Storage) -> Result<(Header, Identity), ErrorKind> {
    let (header, mut area, file_size) = Header::read_with_area(storage)?;
    if let Some(autoclear) = area.get_mut(88..96) {
        if header.version == crate::header::Version::V3 {
            autoclear.fill(0);
        }
    }
    let identity = Identity {
        file_size,
        header_hash: xxh3_64(&area),
    };
    Ok((header, identity))
}

/// A raw file used as the base of a chain.
#[derive(Debug, Clone)]
pub struct RawLayer {
    path: PathBuf,
    storage: Arc<dyn Storage>,
    file_size: u64,
}

/// A layer of a chain.
#[derive(Debug, Clone)]
pub enum Layer {
    /// A qcow2 image.
    Qcow2(Qcow2Layer),
    /// A raw file (only ever the base).
    Raw(RawLayer),
}

impl Qcow2Layer {
    /// Opens a qcow2 image: reads and validates the header, reads the L1
    /// table (once: kept, and hashed for the fingerprint).
    pub fn open(path: &Path, storage: Arc<dyn Storage>) -> Result<Self, ErrorKind> {
        Self::open_with(path, storage, true)
    }

    /// [`Qcow2Layer::open`] that keeps only the L1 table's fingerprint: the
    /// table is read again when first needed (a layer below the top of an
    /// indexed chain never needs it: memory per layer stays small).
    pub fn open_lazily(path: &Path, storage: Arc<dyn Storage>) -> Result<Self, ErrorKind> {
        Self::open_with(path, storage, false)
    }

    fn open_with(path: &Path, storage: Arc<dyn Storage>, keep_l1: bool) -> Result<Self, ErrorKind> {
        let (header, identity, raw) = read_image(&*storage)?;
        let l1 = OnceLock::new();
        if keep_l1 {
            let _ = l1.set(raw.chunks_exact(8).map(|c| be_u64(c, 0)).collect());
        }
        Ok(Self {
            path: path.to_path_buf(),
            storage,
            header: Arc::new(header),
            l1: Arc::new(l1),
            file_size: identity.file_size,
            l1_hash: xxh3_64(&raw),
            identity: Arc::new(Mutex::new(identity)),
            holder: None,
            shared: None,
        })
    }

    /// Opens an image that `holder`, a writer of this process, still has
    /// open and has stopped changing: its L1 table is `l1` (the writer's,
    /// which the file may not have yet), its L2 tables are asked of
    /// `holder` before the file until [`Qcow2Layer::release_holder`]. L2
    /// tables are checked against `min_len` (the writer's file length)
    /// when it is more than the file's. The fingerprint is that of `l1`,
    /// which [`Qcow2Layer::refresh_identity`] checks the file against
    /// once the writer has closed it.
    pub(crate) fn open_held(
        path: &Path,
        storage: Arc<dyn Storage>,
        l1: Vec<u64>,
        min_len: u64,
        holder: Arc<dyn TableHolder>,
    ) -> Result<Self, ErrorKind> {
        let (header, identity) = read_header(&*storage)?;
        if l1.len() != header.l1_size as usize {
            return Err(ErrorKind::LayerChanged);
        }
        let raw: Vec<u8> = l1.iter().flat_map(|e| e.to_be_bytes()).collect();
        Ok(Self {
            path: path.to_path_buf(),
            storage,
            header: Arc::new(header),
            l1: Arc::new(OnceLock::from(l1)),
            file_size: identity.file_size.max(min_len),
            l1_hash: xxh3_64(&raw),
            identity: Arc::new(Mutex::new(identity)),
            holder: Some(HolderSlot::new(holder)),
            shared: None,
        })
    }

    /// The writer named at [`Qcow2Layer::open_held`] has written all its
    /// tables to the file (and closed it): the file is read from now on.
    pub(crate) fn release_holder(&self) {
        if let Some(slot) = &self.holder {
            slot.release();
        }
    }

    /// Hashes of the header area (autoclear bits excluded) and of the L1
    /// table, taken when the image was opened (the first taken again by
    /// [`Qcow2Layer::refresh_identity`]).
    pub fn fingerprint(&self) -> (u64, u64) {
        (self.identity().header_hash, self.l1_hash)
    }

    fn identity(&self) -> Identity {
        *self.identity.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the file's size and header hash again, for an image that a
    /// writer of this process closed after this layer was opened (a live
    /// snapshot's old top, closed after the switch): an index built from
    /// now on records the image as it stays. Fails, changing nothing, if
    /// the image maps other tables than at open (its L1 table, geometry,
    /// size or backing file changed).
    pub fn refresh_identity(&self) -> Result<(), ErrorKind> {
        let (header, identity, raw) = read_image(&*self.storage)?;
        let old = &self.header;
        let same = header.l1_table_offset == old.l1_table_offset
            && header.l1_size == old.l1_size
            && header.geometry == old.geometry
            && header.size == old.size
            && header.backing_file == old.backing_file
            && xxh3_64(&raw) == self.l1_hash;
        if !same {
            return Err(ErrorKind::LayerChanged);
        }
        *self.identity.lock().unwrap_or_else(PoisonError::into_inner) = identity;
        Ok(())
    }

    /// The storage holding the image.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// The active L1 table as opened (read now if it was not yet, and
    /// refused if it is not what it was at open).
    pub fn l1(&self) -> Result<&[u64], ErrorKind> {
        if let Some(l1) = self.l1.get() {
            return Ok(l1);
        }
        // A queue worker does not wait for metadata reads.
        crate::nowait::may_load()?;
        let mut raw = vec![0u8; self.header.l1_size as usize * 8];
        self.storage
            .read_at(&mut raw, self.header.l1_table_offset)?;
        if xxh3_64(&raw) != self.l1_hash {
            return Err(ErrorKind::LayerChanged);
        }
        let l1 = raw.chunks_exact(8).map(|c| be_u64(c, 0)).collect();
        Ok(self.l1.get_or_init(|| l1))
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The file's size when it was opened (or last identified,
    /// [`Qcow2Layer::refresh_identity`]).
    pub fn file_size(&self) -> u64 {
        self.identity().file_size
    }

    /// The mapping of `[guest, guest + max)` in this image, truncated to the
    /// run that shares one mapping (contiguous host offsets for data).
    /// `guest` must be below the virtual size. L2 slices come through the
    /// unified `cache`.
    pub fn status(
        &self,
        index: LayerIndex,
        guest: GuestOffset,
        max: u64,
        cache: &SliceCache,
        slice_size: u64,
    ) -> Result<(LayerStatus, u64), ErrorKind> {
        let g = self.header.geometry;
        let max = clip_to_l2(g, guest, max);
        self.with_l2_slice(index, guest, cache, slice_size, |slice, words| {
            slice.status(g, words, guest, max)
        })?
        .unwrap_or(Ok((LayerStatus::Unallocated { host: None }, max)))
    }
}

impl Qcow2Layer {
    /// `f` of the L2 slice covering `guest` and its words, through the
    /// unified cache (`None` where the L1 entry is empty); the table's
    /// place is validated when the slice is first read. A cached slice is
    /// lent to `f` under the cache's lock: `f` only computes.
    fn with_l2_slice<R>(
        &self,
        index: LayerIndex,
        guest: GuestOffset,
        cache: &SliceCache,
        slice_size: u64,
        f: impl FnOnce(&L2Slice, &[u64]) -> R,
    ) -> Result<Option<R>, ErrorKind> {
        let g = self.header.geometry;
        let l1 = self.l1()?;
        let l1_entry = usize::try_from(g.l1_index(guest))
            .ok()
            .and_then(|i| l1.get(i))
            .copied()
            .unwrap_or(0);
        let l2_offset = l1_entry & OFFSET_MASK;
        if l2_offset == 0 {
            return Ok(None);
        }
        let slice = L2Slice::locate(g, l2_offset, guest, slice_size);
        let (cache, source) = match &self.shared {
            Some(shared) => (&*shared.cache, shared.source),
            None => (cache, Source::Layer(index.0 as u32)),
        };
        let key = SliceKey {
            source,
            offset: slice.offset,
        };
        cache
            .with_or_load(
                key,
                || {
                    if let Some(held) = self.held_slice(l2_offset, &slice)? {
                        return Ok(held);
                    }
                    crate::nowait::may_load()?;
                    validate_l2_offset(g, l2_offset, self.file_size)?;
                    read_words(&*self.storage, slice.offset, slice.words)
                },
                |words| f(&slice, words),
            )
            .map(Some)
    }

    /// This layer as a chain that reaches its file at `path` keeps it,
    /// `file` shared with other chains.
    pub(crate) fn sharing(self, tables: SharedTables, path: &Path) -> Self {
        Qcow2Layer {
            path: path.to_path_buf(),
            shared: Some(tables),
            ..self
        }
    }

    /// Whether `storage` is this layer's and shared with other chains
    /// (its locks are theirs too: never changed for one chain).
    pub(crate) fn shares_storage(&self, storage: &Arc<dyn Storage>) -> bool {
        self.shared.is_some() && Arc::ptr_eq(&self.storage, storage)
    }

    /// Whether another chain of the process (or another copy of this
    /// layer) uses this layer's file now: it must not be written.
    pub(crate) fn shared_elsewhere(&self) -> bool {
        self.shared
            .as_ref()
            .is_some_and(|t| Arc::strong_count(&t.users) > 1)
    }

    /// The slice as the writer that holds the image's tables has it
    /// ([`Qcow2Layer::open_held`]), if it holds the table; waits for the
    /// writer's lock only where metadata loads may wait.
    fn held_slice(&self, l2_offset: u64, slice: &L2Slice) -> Result<Option<Slice>, ErrorKind> {
        let Some(holder) = self.holder.as_ref().and_then(HolderSlot::holder) else {
            return Ok(None);
        };
        match holder.try_held_slice(l2_offset, slice.offset, slice.words) {
            Ok(held) => Ok(held),
            Err(Busy) => {
                crate::nowait::may_load()?;
                Ok(holder.held_slice(l2_offset, slice.offset, slice.words))
            }
        }
    }

    /// The raw L2 entry of the cluster at `guest` (0 when unallocated).
    pub fn raw_l2_entry(
        &self,
        index: LayerIndex,
        guest: u64,
        cache: &SliceCache,
        slice_size: u64,
    ) -> Result<u64, ErrorKind> {
        let g = self.header.geometry;
        let per = if g.extended_l2 { 2 } else { 1 };
        let entry = self.with_l2_slice(
            index,
            GuestOffset(guest),
            cache,
            slice_size,
            |slice, words| {
                let i = (g.l2_index(GuestOffset(guest)) - slice.first_entry) as usize * per;
                words.get(i).copied().unwrap_or(0)
            },
        )?;
        Ok(entry.unwrap_or(0))
    }
}

/// Where the L2 slice covering a guest offset lies, and what it covers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct L2Slice {
    /// Byte offset of the slice in the file.
    pub offset: u64,
    /// Number of 64-bit words in the slice.
    pub words: usize,
    /// L2 index of the slice's first entry.
    pub first_entry: u64,
}

impl L2Slice {
    /// The slice of `slice_size` bytes (clamped to one cluster, at least
    /// one entry) of the L2 table at `l2_offset` that covers `guest`.
    pub(crate) fn locate(g: Geometry, l2_offset: u64, guest: GuestOffset, slice_size: u64) -> Self {
        let entry_size = g.l2_entry_size();
        let slice_bytes = slice_size.clamp(entry_size, g.cluster_size());
        let entries_per_slice = slice_bytes / entry_size;
        let first_entry = g.l2_index(guest) / entries_per_slice * entries_per_slice;
        Self {
            offset: l2_offset + first_entry * entry_size,
            words: (slice_bytes / 8) as usize,
            first_entry,
        }
    }

    /// [`slice_status`] within this slice's words.
    pub(crate) fn status(
        &self,
        g: Geometry,
        words: &[u64],
        guest: GuestOffset,
        max: u64,
    ) -> Result<(LayerStatus, u64), ErrorKind> {
        let per_word = if g.extended_l2 { 2 } else { 1 };
        let entries = (words.len() / per_word) as u64;
        let l1_base = g.l1_index(guest) * g.l2_coverage();
        let slice_end = l1_base + (self.first_entry + entries) * g.cluster_size();
        let max = max.min(slice_end - guest.0);
        slice_status(g, words, self.first_entry, guest, max)
    }
}

/// Reads `words` big-endian 64-bit words at `offset`.
pub(crate) fn read_words(
    storage: &dyn Storage,
    offset: u64,
    words: usize,
) -> Result<Slice, ErrorKind> {
    let mut raw = vec![0u8; words * 8];
    storage.read_at(&mut raw, offset)?;
    Ok(raw.chunks_exact(8).map(|c| be_u64(c, 0)).collect())
}

/// `max` shortened so that `[guest, guest + max)` stays within one L2 table.
pub(crate) fn clip_to_l2(g: Geometry, guest: GuestOffset, max: u64) -> u64 {
    let l2_end = (g.l1_index(guest) + 1) * g.l2_coverage();
    max.min(l2_end - guest.0)
}

/// The mapping of (sub)cluster at `pos` in an L2 table slice whose first
/// entry has L2 index `first_entry`.
pub(crate) fn mapping_in_table(
    g: Geometry,
    table: &[u64],
    first_entry: u64,
    pos: u64,
) -> Result<LayerStatus, ErrorKind> {
    let words = if g.extended_l2 { 2 } else { 1 };
    let l2_index = (g.l2_index(GuestOffset(pos)) - first_entry) as usize;
    let entry = table.get(l2_index * words).copied().unwrap_or(0);
    let bitmap = if words == 2 {
        table.get(l2_index * 2 + 1).copied().unwrap_or(0)
    } else {
        0
    };
    let sc = (g.offset_in_cluster(pos) / g.subcluster_size()) as u32;
    decode_l2(entry, bitmap, sc, g).map_err(|e| match e {
        EntryError::UnalignedCluster(host_offset) => ErrorKind::UnalignedCluster {
            guest_offset: pos,
            host_offset,
        },
        EntryError::InvalidBitmap(bitmap) => ErrorKind::InvalidSubclusterBitmap {
            guest_offset: pos,
            bitmap,
        },
    })
}

/// The first run of `[guest, guest + max)` (within one L2 table) that
/// shares one mapping, in a slice of the table starting at L2 index
/// `first_entry`; `max` must not run past the slice.
pub(crate) fn slice_status(
    g: Geometry,
    table: &[u64],
    first_entry: u64,
    guest: GuestOffset,
    max: u64,
) -> Result<(LayerStatus, u64), ErrorKind> {
    let granule = g.subcluster_size();
    let first = mapping_in_table(g, table, first_entry, guest.0)?.advanced(guest.0 % granule);
    let mut len = (granule - guest.0 % granule).min(max);
    if let LayerStatus::Compressed(_) = first {
        let to_cluster_end = g.cluster_size() - g.offset_in_cluster(guest.0);
        return Ok((first, to_cluster_end.min(max)));
    }
    while len < max {
        let next = mapping_in_table(g, table, first_entry, guest.0 + len)?;
        if !first.continued_by(len, &next) {
            break;
        }
        len = (len + granule).min(max);
    }
    Ok((first, len))
}

/// Checks that an L2 table offset is aligned, after the header cluster and
/// inside a file of `file_size` bytes.
pub(crate) fn validate_l2_offset(
    g: Geometry,
    offset: u64,
    file_size: u64,
) -> Result<(), ErrorKind> {
    let cluster_size = g.cluster_size();
    if g.offset_in_cluster(offset) != 0 {
        return Err(ErrorKind::UnalignedTable {
            table: Table::L2,
            offset,
        });
    }
    if offset < cluster_size {
        return Err(ErrorKind::TableOverlapsHeader {
            table: Table::L2,
            offset,
        });
    }
    if offset + cluster_size > file_size {
        return Err(ErrorKind::TableBeyondEof {
            table: Table::L2,
            offset,
            len: cluster_size,
            file_size,
        });
    }
    Ok(())
}

/// Reads and decodes the table at `offset` (validated first).
pub(crate) fn read_l2_table(
    g: Geometry,
    storage: &dyn Storage,
    offset: u64,
    file_size: u64,
) -> Result<Vec<u64>, ErrorKind> {
    validate_l2_offset(g, offset, file_size)?;
    let mut raw = vec![0u8; g.cluster_size() as usize];
    storage.read_at(&mut raw, offset)?;
    Ok(raw.chunks_exact(8).map(|c| be_u64(c, 0)).collect())
}

impl RawLayer {
    /// Opens a raw file.
    pub fn open(path: &Path, storage: Arc<dyn Storage>) -> Result<Self, ErrorKind> {
        Ok(Self {
            path: path.to_path_buf(),
            file_size: storage.len()?,
            storage,
        })
    }

    /// The mapping of `[guest, guest + max)`: data at the same offset, or
    /// (when `precise` and the file system reports it) a hole reading zeros.
    pub fn status(&self, guest: GuestOffset, max: u64, precise: bool) -> (LayerStatus, u64) {
        let host = HostOffset(guest.0);
        if precise {
            if let Some((is_data, run)) = self.storage.allocation(guest.0, max) {
                let run = run.clamp(1, max);
                return if is_data {
                    (LayerStatus::Data { host }, run)
                } else {
                    (LayerStatus::Zero { host: Some(host) }, run)
                };
            }
        }
        (LayerStatus::Data { host }, max)
    }
}

impl Layer {
    /// Path the layer was opened by.
    pub fn path(&self) -> &Path {
        match self {
            Layer::Qcow2(l) => &l.path,
            Layer::Raw(l) => &l.path,
        }
    }

    /// Virtual size: the header's size, or the raw file's size rounded up to
    /// a 512-byte sector, as QEMU counts it (the tail past the end of the
    /// file reads as zeros).
    pub fn virtual_size(&self) -> u64 {
        match self {
            Layer::Qcow2(l) => l.header.virtual_size(),
            Layer::Raw(l) => l.file_size.div_ceil(512) * 512,
        }
    }

    /// `qcow2` or `raw`.
    pub fn format_name(&self) -> &'static str {
        match self {
            Layer::Qcow2(_) => "qcow2",
            Layer::Raw(_) => "raw",
        }
    }

    /// The storage holding the layer's bytes.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        match self {
            Layer::Qcow2(l) => &l.storage,
            Layer::Raw(l) => &l.storage,
        }
    }

    /// The qcow2 header, for a qcow2 layer.
    pub fn header(&self) -> Option<&Header> {
        match self {
            Layer::Qcow2(l) => Some(&l.header),
            Layer::Raw(_) => None,
        }
    }

    /// Bytes this layer's structures hold in memory (the struct, its path,
    /// header extensions, backing name and L1 table), excluding cached
    /// slices.
    pub fn heap_bytes(&self) -> u64 {
        let path = self.path().as_os_str().len() as u64;
        let base = std::mem::size_of::<Layer>() as u64 + path + 64;
        match self {
            Layer::Qcow2(q) => {
                let exts: u64 = q
                    .header
                    .extensions
                    .iter()
                    .map(|e| {
                        64 + match e {
                            crate::extension::HeaderExtension::Unknown { data, .. } => data.len(),
                            crate::extension::HeaderExtension::FeatureNameTable(t) => t.len() * 80,
                            crate::extension::HeaderExtension::ExternalDataFile(d) => d.len(),
                            crate::extension::HeaderExtension::BackingFormat(f) => f.len(),
                            _ => 0,
                        } as u64
                    })
                    .sum();
                let backing = q
                    .header
                    .backing_file
                    .as_ref()
                    .map_or(0, |b| b.as_os_str().len() as u64);
                let l1 = q.l1.get().map_or(0, Vec::len) as u64 * 8;
                base + std::mem::size_of::<Header>() as u64 + exts + backing + l1
            }
            Layer::Raw(_) => base,
        }
    }

    /// Size of the file when it was opened (or last identified, for a
    /// qcow2 image: [`Qcow2Layer::refresh_identity`]).
    pub fn file_size(&self) -> u64 {
        match self {
            Layer::Qcow2(l) => l.file_size(),
            Layer::Raw(l) => l.file_size.div_ceil(512) * 512,
        }
    }
}
