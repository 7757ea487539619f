//! Taking the top of a freshly opened chain for writing: refuse what
//! cannot be written consistently, repair an image left dirty, clear
//! autoclear features this writer does not keep up to date.

use std::sync::Arc;

use crate::check::{check_storage, read_header, Repair};
use crate::error::{Error, ErrorKind, Feature};
use std::collections::HashMap;
use std::path::Path;

use crate::entry::OFFSET_MASK;
use crate::features::{
    AUTOCLEAR_BITMAPS, AUTOCLEAR_DATA_FILE_RAW, AUTOCLEAR_JOURNAL, INCOMPAT_DIRTY,
};
use crate::header::{field, Version};
use crate::layer::Layer;
use crate::storage::Storage;
use crate::summary::TopSummary;
use sqcow2_cache::SliceCache;

use super::journal::{self, Journal};
use super::state::{ActiveState, TopFile};
use super::Active;

/// Autoclear bits this writer keeps consistent (or that do not apply).
const KNOWN_AUTOCLEAR: u64 = AUTOCLEAR_BITMAPS | AUTOCLEAR_DATA_FILE_RAW;

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
    /// Takes the top of freshly opened `layers` (base first) for writing,
    /// with the mapping journal `prepared` for it if there is one (else
    /// one is started here).
    pub(crate) fn open(
        layers: &[Layer],
        link: CacheLink,
        prepared: Option<PreparedJournal>,
    ) -> Result<Active, Error> {
        let Some(top) = layers.last() else {
            return Err(Error::new("", ErrorKind::BadMagic(0)));
        };
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
                .write_at(&clean.to_be_bytes(), field::INCOMPATIBLE_FEATURES as u64)
                .and_then(|()| storage.sync())
                .map_err(|io| e(io.into()))?;
            header.features.incompatible = clean;
        }
        let unknown_autoclear = header.features.autoclear & !KNOWN_AUTOCLEAR;
        if header.version == Version::V3 && unknown_autoclear != 0 {
            // A writer that does not know an autoclear feature clears it.
            let kept = header.features.autoclear & KNOWN_AUTOCLEAR;
            storage
                .write_at(&kept.to_be_bytes(), field::AUTOCLEAR_FEATURES as u64)
                .and_then(|()| storage.sync())
                .map_err(|io| e(io.into()))?;
            header.features.autoclear = kept;
        }
        let len = storage.len().map_err(|io| e(io.into()))?;
        let top = Arc::new(TopFile {
            path: path.to_path_buf(),
            storage,
            geometry: header.geometry,
            version: header.version,
            lazy_refcounts: header.lazy_refcounts(),
            has_backing: layers.len() > 1,
            cache: link.cache,
            source: link.source,
            slice_size: link.slice_size,
            cache_budget: link.budget,
            summary: link.summary,
            faults: crate::fault::Faults::default(),
        });
        if let Some(p) = &prepared {
            // The feature words it wrote (the layer was read before).
            (header.features.incompatible, header.features.autoclear) = p.features;
        }
        let state = ActiveState::open(top.clone(), header)?;
        let active = Active::with(top, state, len);
        match prepared {
            Some(mut p) => {
                if let Some(journal) = p.journal.take() {
                    let mut st = active.write_state_anyway();
                    st.dirty_bit_on_disk = true;
                    st.journal = Some(journal);
                }
            }
            None => active.start_journal(),
        }
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
        let features = match self.write_state() {
            Ok(st) => (st.header.features.incompatible, st.header.features.autoclear),
            Err(_) => return,
        };
        let Some((journal, (incompatible, autoclear))) =
            new_journal(&top.path, &*top.storage, features)
        else {
            return;
        };
        let Ok(mut st) = self.write_state() else {
            journal.remove();
            return;
        };
        st.header.features.incompatible = incompatible;
        st.header.features.autoclear = autoclear;
        st.dirty_bit_on_disk = true;
        st.journal = Some(journal);
    }
}

/// A new, empty journal for the image at `path` whose feature words are
/// `features`, with the image's dirty bit and journal bit set durably;
/// the words written. `None` (logged) when the journal cannot be made:
/// every change is then published before it completes.
fn new_journal(
    path: &Path,
    storage: &dyn Storage,
    (incompatible, autoclear): (u64, u64),
) -> Option<(Arc<Journal>, (u64, u64))> {
    let fail = |e: &dyn std::fmt::Display| {
        tracing::warn!(
            path = %path.display(),
            error = %e,
            "no mapping journal: each allocating write is published (synced) before it completes"
        );
    };
    let journal = match Journal::create(path, storage.file_id()) {
        Ok(j) => Arc::new(j),
        Err(e) => {
            fail(&e);
            return None;
        }
    };
    let words = (incompatible | INCOMPAT_DIRTY, autoclear | AUTOCLEAR_JOURNAL);
    let written = storage
        .write_at(&words.0.to_be_bytes(), field::INCOMPATIBLE_FEATURES as u64)
        .and_then(|()| storage.write_at(&words.1.to_be_bytes(), field::AUTOCLEAR_FEATURES as u64))
        .and_then(|()| storage.sync());
    if let Err(e) = written {
        journal.remove();
        fail(&e);
        return None;
    }
    Some((journal, words))
}

/// The mapping journal of an image not yet taken for writing, started
/// ahead (a live snapshot prepares the new top's before the guest's
/// pause, since it costs a sync): the journal file made, the image's
/// dirty bit and journal bit set durably. [`Active::open`] takes it;
/// dropped unused, it removes the journal file.
#[derive(Debug)]
#[must_use = "dropped unused, the journal file is removed"]
pub(crate) struct PreparedJournal {
    journal: Option<Arc<Journal>>,
    /// The feature words written (incompatible, autoclear).
    features: (u64, u64),
}

impl PreparedJournal {
    /// Starts the journal of the image at `path` (read from `storage`,
    /// whose header is `header`), as [`Active::open`] would.
    pub(crate) fn start(path: &Path, storage: &dyn Storage, header: &crate::Header) -> Self {
        let features = (header.features.incompatible, header.features.autoclear);
        if header.version != Version::V3 {
            return PreparedJournal {
                journal: None,
                features,
            };
        }
        match new_journal(path, storage, features) {
            Some((journal, features)) => PreparedJournal {
                journal: Some(journal),
                features,
            },
            None => PreparedJournal {
                journal: None,
                features,
            },
        }
    }
}

impl Drop for PreparedJournal {
    fn drop(&mut self) {
        if let Some(journal) = self.journal.take() {
            journal.remove();
        }
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
pub(crate) fn replay_journal(path: &Path, storage: &dyn Storage) -> Result<(), ErrorKind> {
    // A header that does not parse is reported by the open that follows.
    let Ok(header) = read_header(storage) else {
        return Ok(());
    };
    if header.version != Version::V3 || header.features.autoclear & AUTOCLEAR_JOURNAL == 0 {
        return Ok(());
    }
    let replay = match journal::read(path, storage.file_id()) {
        Ok(Some(r)) if !r.writes.is_empty() => r,
        Ok(_) => return Ok(()),
        Err(io) => {
            tracing::warn!(path = %path.display(), error = %io, "could not read the journal: not replayed");
            return Ok(());
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
    Ok(())
}
