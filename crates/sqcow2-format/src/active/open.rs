//! Taking the top of a freshly opened chain for writing: refuse what
//! cannot be written consistently, repair an image left dirty, clear
//! autoclear features this writer does not keep up to date.

use std::sync::Arc;

use crate::check::{check_storage, Repair};
use crate::error::{Error, ErrorKind};
use crate::sidefile::{FileId, ImagePlace};
use std::collections::HashMap;

use crate::entry::OFFSET_MASK;
use crate::features::{
    AUTOCLEAR_BITMAPS, AUTOCLEAR_DATA_FILE_RAW, AUTOCLEAR_JOURNAL, AUTOCLEAR_UNPUBLISHED,
    INCOMPAT_DIRTY,
};
use crate::header::{field, Version};
use crate::header_area::write_word;
use crate::layer::Layer;
use crate::storage::Storage;
use crate::summary::TopSummary;
use sqcow2_cache::SliceCache;

use super::journal::{self, Journal};
use super::state::{ActiveState, TopFile};
use super::Active;

/// Autoclear bits this writer keeps consistent (or that do not apply:
/// the unpublished bit of a merge's temporary file, which its writer
/// fills, is about the file, not its content).
const KNOWN_AUTOCLEAR: u64 = AUTOCLEAR_BITMAPS | AUTOCLEAR_DATA_FILE_RAW | AUTOCLEAR_UNPUBLISHED;

/// Where the top's clean L2 slices are cached.
#[derive(Debug, Clone)]
pub(crate) struct CacheLink {
    /// The unified cache.
    pub(crate) cache: Arc<SliceCache>,
    /// The top's source in the cache.
    pub(crate) source: sqcow2_cache::Source,
    /// Bytes per slice.
    pub(crate) slice_size: u64,
    /// The cache's byte budget.
    pub(crate) budget: u64,
    /// Regions of the top known to be empty (indexed mode).
    pub(crate) summary: Option<Arc<TopSummary>>,
}

impl Active {
    /// Takes `top`, a freshly opened layer (with layers below it if
    /// `has_backing`), for writing.
    pub(crate) fn open(
        top: &Layer,
        has_backing: bool,
        link: CacheLink,
        place: Option<ImagePlace>,
        below: Vec<FileId>,
    ) -> Result<Active, Error> {
        let Some(header) = top.header() else {
            return Err(Error::new(top.path(), ErrorKind::BadMagic(0)));
        };
        let path = top.path();
        let storage = top.storage().clone();
        let e = |k: ErrorKind| Error::new(path, k);
        // QEMU opens an image marked corrupt read-only only.
        header.refuse_if_marked_corrupt().map_err(e)?;
        let mut header = header.clone();
        if header.is_dirty() {
            // Refcounts of a dirty image may be stale: repair, as QEMU does.
            tracing::warn!(path = %path.display(), "image was not closed cleanly: repairing refcounts");
            check_storage(path, storage.clone(), Repair::All)?;
            header = crate::header::Header::read(&*storage).map_err(e)?;
            let clean = header.features.incompatible & !INCOMPAT_DIRTY;
            write_word(&*storage, field::INCOMPATIBLE_FEATURES, clean)
                .map_err(|io| e(io.into()))?;
            header.features.incompatible = clean;
        }
        // The unpublished bit is about the file, not its content: kept
        // while this process fills a temporary file it made (a merge's),
        // cleared anywhere else (a crash after a publish's rename left
        // it), whatever the image's name.
        let known = match &place {
            Some(p) if p.is_unpublished() => KNOWN_AUTOCLEAR | AUTOCLEAR_UNPUBLISHED,
            _ => KNOWN_AUTOCLEAR,
        };
        let unknown_autoclear = header.features.autoclear & !known;
        if header.version == Version::V3 && unknown_autoclear != 0 {
            // A writer that does not know an autoclear feature clears it.
            let kept = header.features.autoclear & known;
            write_word(&*storage, field::AUTOCLEAR_FEATURES, kept).map_err(|io| e(io.into()))?;
            header.features.autoclear = kept;
        }
        // Loaded and marked in use before anything changes the image.
        let bitmaps = crate::bitmaps::kept::KeptBitmaps::open(&header, &*storage).map_err(e)?;
        let len = storage.len().map_err(|io| e(io.into()))?;
        let top = Arc::new(TopFile {
            path: path.to_path_buf(),
            place,
            below,
            storage,
            geometry: header.geometry,
            version: header.version,
            lazy_refcounts: header.lazy_refcounts(),
            has_backing,
            cache: link.cache,
            source: link.source,
            slice_size: link.slice_size,
            cache_budget: link.budget,
            summary: link.summary,
            faults: crate::fault::Faults::default(),
        });
        let state = ActiveState::open(top.clone(), header)?;
        let active = Active::with(top, state, len, bitmaps);
        active.start_journal();
        Ok(active)
    }

    /// Starts a mapping journal (a new, empty one) if the image can carry
    /// one: the dirty bit and the journal's autoclear bit are set durably
    /// first. Without one (qcow2 v2, a directory that cannot hold the
    /// file), every change is published before it completes.
    /// The caller holds the flush order (or is opening the image), so
    /// that the feature words cannot change meanwhile.
    pub(crate) fn start_journal(&self) {
        let top = &self.top;
        if top.version != Version::V3 {
            return;
        }
        let fail = |e: &dyn std::fmt::Display| {
            tracing::warn!(
                path = %top.path.display(),
                error = %e,
                "no mapping journal: each allocating write is published (synced) before it completes"
            );
        };
        let Some(place) = &top.place else {
            return fail(&"the image's directory is not open");
        };
        let journal = match Journal::create(place, &top.below, top.storage.file_id()) {
            Ok(j) => Arc::new(j),
            Err(e) => return fail(&e),
        };
        let (incompatible, autoclear) = match self.write_state() {
            Ok(st) => (
                st.header.features.incompatible | INCOMPAT_DIRTY,
                st.header.features.autoclear | AUTOCLEAR_JOURNAL,
            ),
            Err(_) => return,
        };
        if let Err(e) = top.write_feature_bits(incompatible, autoclear) {
            journal.remove();
            return fail(&e);
        }
        let Ok(mut st) = self.write_state() else {
            return;
        };
        st.header.features.incompatible = incompatible;
        st.header.features.autoclear = autoclear;
        st.dirty_bit_on_disk = true;
        st.journal = Some(journal);
    }
}

/// Applies the journal a dead writer of the top at `path` left, if the
/// image still names one and it is this boot's and this file's, before
/// anything reads the image's tables (a read-write open, before the top
/// layer is parsed). Everything the writer wrote is synced first (its
/// data, which the records point at); then each metadata write lands only
/// in the L1 table or in an L2 table the L1 table names (as the replay
/// goes), and the image is synced again. The image carries the dirty bit
/// (a journal implies it), so its refcounts are repaired next
/// ([`Active::open`]).
pub(crate) fn replay_journal(
    place: &ImagePlace,
    storage: &dyn Storage,
) -> Result<usize, ErrorKind> {
    let path = &place.path();
    // A header that does not parse is reported by the open that follows
    // (an image marked corrupt is refused to writers before this; a
    // repair replays it too).
    let Ok(header) = crate::header::Header::read_for_check(storage) else {
        return Ok(0);
    };
    if header.version != Version::V3 || header.features.autoclear & AUTOCLEAR_JOURNAL == 0 {
        return Ok(0);
    }
    let replay = match journal::read(place, storage.file_id()) {
        Ok(Some(r)) if !r.writes.is_empty() => r,
        Ok(_) => return Ok(0),
        Err(io) => {
            tracing::warn!(path = %path.display(), error = %io, "could not read the journal: not replayed");
            return Ok(0);
        }
    };
    storage.sync()?;
    let g = header.geometry;
    let l1_start = header.l1_table_offset;
    let l1_end = l1_start + u64::from(header.l1_size) * 8;
    let mut raw = vec![0u8; (l1_end - l1_start) as usize];
    storage.read_at(&mut raw, l1_start)?;
    let mut tables: HashMap<u64, usize> = raw
        .chunks_exact(8)
        .enumerate()
        .map(|(i, c)| (crate::bytes::be_u64(c, 0) & OFFSET_MASK, i))
        .filter(|(o, _)| *o != 0)
        .collect();
    let file_len = storage.len()?;
    let (mut applied, mut refused) = (0usize, 0usize);
    for w in &replay.writes {
        let end = w.offset + u64::from(w.len) * 8;
        let in_l1 = w.offset >= l1_start && end <= l1_end;
        let cluster = w.offset & !(g.cluster_size() - 1);
        let in_table = tables.contains_key(&cluster) && end <= cluster + g.cluster_size();
        if w.offset % 8 != 0 || end > file_len || !(in_l1 || in_table) || cluster == 0 {
            refused += 1;
            continue;
        }
        storage.write_at(&w.bytes(), w.offset)?;
        if in_l1 {
            let index = ((w.offset - l1_start) / 8) as usize;
            tables.retain(|_, i| *i != index);
            let table = w.words[0] & OFFSET_MASK;
            if table != 0 {
                tables.insert(table, index);
            }
        }
        applied += 1;
    }
    storage.sync()?;
    tracing::warn!(
        path = %path.display(),
        applied,
        refused,
        torn = replay.skipped,
        "replayed the journal of a writer that did not close the image"
    );
    Ok(applied)
}

/// Records of a dead writer's journal that a read-write open of the image
/// at `path` (file `file_id`, header `header`) would apply (this boot's
/// and this file's), if the image names one.
pub(crate) fn pending_journal(
    place: &ImagePlace,
    file_id: Option<(u64, u64)>,
    header: &crate::Header,
) -> Option<usize> {
    if header.version != Version::V3 || header.features.autoclear & AUTOCLEAR_JOURNAL == 0 {
        return None;
    }
    journal::read(place, file_id)
        .ok()
        .flatten()
        .map(|r| r.writes.len())
}

/// Ends the journal of the image at `place` once its records are in the
/// tables ([`replay_journal`]): the image stops naming it (synced), then
/// the file goes (if it is a journal: a file of another kind at its name
/// is left alone).
pub(crate) fn end_journal(place: &ImagePlace, storage: &dyn Storage) -> Result<(), ErrorKind> {
    let header = crate::header::Header::read_for_check(storage)?;
    if header.features.autoclear & AUTOCLEAR_JOURNAL != 0 {
        let kept = header.features.autoclear & !AUTOCLEAR_JOURNAL;
        write_word(storage, field::AUTOCLEAR_FEATURES, kept)?;
    }
    crate::sidefile::remove_journal(place.dir(), &place.journal(), storage.file_id())?;
    Ok(())
}
