//! Taking the top of a freshly opened chain for writing: refuse what
//! cannot be written consistently, repair an image left dirty, clear
//! autoclear features this writer does not keep up to date.

use std::sync::Arc;

use crate::check::{check_storage, read_header, Repair};
use crate::error::{Error, ErrorKind, Feature};
use crate::features::{AUTOCLEAR_BITMAPS, AUTOCLEAR_DATA_FILE_RAW, INCOMPAT_DIRTY};
use crate::header::{field, Version};
use crate::layer::Layer;
use crate::summary::TopSummary;
use sqcow2_cache::SliceCache;

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
    /// Takes the top of freshly opened `layers` (base first) for writing.
    pub(crate) fn open(layers: &[Layer], link: CacheLink) -> Result<Active, Error> {
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
        let state = ActiveState::open(top.clone(), header)?;
        Ok(Active::with(top, state, len))
    }
}
