//! The chain index a chain uses and the layers it covers. An index built
//! for an older top covers the layers below that top only: the layers
//! above it (below the current top) are *pending*, walked before the
//! index is asked, until a newer index is built and installed while the
//! chain serves ([`crate::IndexView::install`]).

use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, ErrorKind};
use crate::index::{ChainIndex, Stale};
use crate::sqcow2_ext::{fingerprints, granularity_bits, IndexState};
use crate::storage::{FileStorage, Storage};
use crate::types::LayerIndex;

use super::{Chain, IndexView};

/// The index in use, if any, with what `info` says about it.
#[derive(Debug)]
pub(crate) struct IndexInUse {
    /// The index and the highest layer it covers (layers `0..=upto`).
    pub(crate) covering: Option<(Arc<ChainIndex>, LayerIndex)>,
    pub(crate) state: IndexState,
}

impl IndexInUse {
    /// The index and the highest layer it covers, while it is usable (a
    /// slice that failed its checksum turns it off).
    pub(crate) fn usable(&self) -> Option<(&ChainIndex, LayerIndex)> {
        self.covering
            .as_ref()
            .filter(|(i, _)| i.usable())
            .map(|(i, upto)| (&**i, *upto))
    }
}

/// What [`crate::IndexView::install`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// The index now serves lookups.
    Yes,
    /// The chain uses an index that covers as many layers already.
    NotNewer,
}

impl Chain {
    fn install_index_file(&self, path: &Path, file: std::fs::File) -> Result<Installed, Error> {
        let stale = |reason: Stale| Error::new(path, ErrorKind::IndexStale(reason.to_string()));
        let storage: Arc<dyn Storage> = Arc::new(FileStorage::from_file(file));
        let index = ChainIndex::open(path, storage).map_err(stale)?;
        let covered = index.layers().len();
        let Some(upto) = covered.checked_sub(1) else {
            return Err(stale(Stale::LayerCount {
                indexed: 0,
                actual: self.top_index().0 as u32,
            }));
        };
        if covered > self.top_index().0 {
            return Err(stale(Stale::LayerCount {
                indexed: covered as u32,
                actual: self.top_index().0 as u32,
            }));
        }
        if let Some((_, current)) = self.index.load().usable() {
            if current.0 >= upto {
                return Ok(Installed::NotNewer);
            }
        }
        let above = &self.layers[covered];
        let top_name = backing_name(above);
        let actual = fingerprints(&self.layers, upto, &top_name);
        let flags = vec![true; covered];
        index
            .matches(
                &actual,
                &flags,
                above.virtual_size(),
                granularity_bits(&self.layers, upto),
            )
            .map_err(stale)?;
        if index.geometry().granularity_bits < self.resolved.bits() {
            return Err(stale(Stale::Granularity));
        }
        let state = IndexState::Valid {
            path: path.to_path_buf(),
            layers: covered,
            pending: self.top_index().0 - covered,
            bytes: index.file_size(),
            granularity: index.geometry().chunk_size(),
        };
        self.index.store(Arc::new(IndexInUse {
            covering: Some((Arc::new(index), LayerIndex(upto))),
            state,
        }));
        Ok(Installed::Yes)
    }
}

/// The backing file name `layer` records, as bytes (empty for none).
pub(crate) fn backing_name(layer: &crate::layer::Layer) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    layer
        .header()
        .and_then(|h| h.backing_file.as_ref())
        .map(|p| p.as_os_str().as_bytes().to_vec())
        .unwrap_or_default()
}

impl IndexView<'_> {
    /// Whether and why the chain index is (not) used.
    pub fn state(&self) -> IndexState {
        self.chain.index.load().state.clone()
    }

    /// Whether lookups currently go through a chain index.
    pub fn is_used(&self) -> bool {
        self.chain.index.load().usable().is_some()
    }

    /// Layers between the index in use and the top, walked on every
    /// lookup the top cannot answer (0 without an index, or when the
    /// index covers every layer below the top).
    pub fn pending_layers(&self) -> usize {
        match self.chain.index.load().usable() {
            Some((_, upto)) => self.chain.top_index().0 - 1 - upto.0,
            None => 0,
        }
    }

    /// The layers an index of this chain would cover now (every layer
    /// below the top), `None` for a lone image, and while a live
    /// snapshot's old top below is not closed (its file may lack tables
    /// the chain reads from its writer: [`crate::Handover::retire`]).
    pub fn indexable_layers(&self) -> Option<LayerIndex> {
        if !self.chain.unclosed_below().is_empty() {
            return None;
        }
        self.chain.top_index().0.checked_sub(1).map(LayerIndex)
    }

    /// Starts using the index at `path` (built for a top of this chain or
    /// for this chain's top) when it covers more layers than the index in
    /// use: its fingerprints must match the layers as this process opened
    /// them. Lookups that started before go on with the old index, which
    /// gives the same answers.
    ///
    /// The layers' autoclear bits, which tell of a writer that does not
    /// know the index, are checked when a chain is opened; while this
    /// chain is open its image locks keep such writers away.
    pub fn install(&self, path: &Path) -> Result<Installed, Error> {
        let stale = |reason: Stale| Error::new(path, ErrorKind::IndexStale(reason.to_string()));
        let file =
            crate::sidefile::open_side_file(path).map_err(|e| stale(Stale::from_open_error(&e)))?;
        self.chain.install_index_file(path, file)
    }

    /// [`crate::IndexView::install`] of an index [`crate::indexing::build_index`]
    /// just built: opened through the directory it was made in (no name
    /// resolved again), and only if it is still the file made.
    pub fn install_built(&self, report: &crate::indexing::BuildReport) -> Result<Installed, Error> {
        let Some(made) = &report.file else {
            return self.install(&report.index);
        };
        let path = &report.index;
        let stale = |reason: Stale| Error::new(path, ErrorKind::IndexStale(reason.to_string()));
        let file = made
            .dir()
            .open_file(made.place().name(), false)
            .map_err(|e| stale(Stale::from_open_error(&e)))?;
        if crate::sidefile::file_id(&file).ok() != Some(made.id()) {
            return Err(Error::new(path, ErrorKind::FileReplaced));
        }
        self.chain.install_index_file(path, file)
    }
}
