//! The chain that follows a live snapshot, made from the chain it
//! replaces without reading the whole chain again: inside the guest's
//! pause only headers are read, whatever the disk size and the chain
//! length.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::active::{Active, CacheLink};
use crate::backing::resolve_backing_path;
use crate::error::{Error, ErrorKind};
use crate::fence::TransferFence;
use crate::files::LazyFile;
use crate::layer::{Layer, Qcow2Layer};
use crate::sidefile::{CreatedFile, ImagePlace};
use crate::sqcow2_ext::{granularity_bits, IndexState};
use crate::storage::{FileStorage, Storage};
use crate::summary::TopSummary;
use crate::types::LayerIndex;
use sqcow2_cache::Source;

use super::covering::IndexInUse;
use super::resolved::ResolvedSlices;
use super::{Chain, ChainOptions, Handover, UnclosedTop};

/// Bytes of the old top's loaded tables handed to the unified cache after
/// a live snapshot's switch (copying all of them took 12 ms at 1 TiB).
const HANDED_OVER: u64 = 1 << 20;

/// The new top of a live snapshot, made ready while the guest runs: its
/// file opened and checked to stand on the chain's top, its image lock
/// taken, taken for writing (its mapping journal started, its first spare
/// clusters made). [`crate::Handover::successor`] switches to it inside the pause;
/// dropped unused, it is closed clean.
#[derive(Debug)]
#[must_use = "prepared for Handover::successor"]
pub struct PreparedTop {
    path: std::path::PathBuf,
    /// Where the new top is (its directory, opened when it was made).
    place: ImagePlace,
    layer: Layer,
    active: Option<Active>,
    /// Regions of the new top known to be empty, kept up to date by its
    /// writes (used if an index covers the layers below at the switch).
    summary: Option<Arc<TopSummary>>,
    /// Its place in the next chain.
    at: LayerIndex,
    /// The file the new top names as its backing file.
    backing_id: Option<(u64, u64)>,
    /// The chain's top opened again read-only in the chain's file cache:
    /// what the next chain reads it through as a lower layer (`None`: not
    /// a file; then through the writer's own description).
    old_top_reader: Option<Arc<LazyFile>>,
}

impl Drop for PreparedTop {
    fn drop(&mut self) {
        if let Some(active) = self.active.take() {
            if let Err(e) = active.close(&TransferFence::default()) {
                tracing::warn!(path = %self.path.display(), error = %e, "closing an unused new top");
            }
        }
    }
}

impl Chain {
    /// Closes `below`, an old top this chain reads from its writer's
    /// memory: then the chain reads it from its file and flushes no more.
    fn close_below(&self, below: &UnclosedTop) -> Result<(), Error> {
        let layer = match self.layers.get(below.at.0) {
            Some(Layer::Qcow2(l)) if same_file(l.storage(), below.writer.storage()) => l,
            _ => {
                return Err(Error::new(
                    below.writer.path(),
                    ErrorKind::Io(std::io::Error::other(
                        "an old top left open is not where the chain has it",
                    )),
                ))
            }
        };
        below.writer.close(&below.fence)?;
        layer
            .refresh_identity()
            .map_err(|k| Error::new(below.writer.path(), k))?;
        layer.release_holder();
        self.below_closed(&below.writer);
        Ok(())
    }

    /// Drops a chain [`crate::Handover::successor`] built and did not switch to: its
    /// new top closed clean, as an unused [`PreparedTop`] is; the old tops
    /// it lists as not closed are still this chain's writer and the ones
    /// it lists, and stay open.
    fn abandon(self) {
        self.unclosed_below
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
    }

    /// The next chain, the old top read through `reader` (else its
    /// writer's storage).
    fn successor_from(
        &self,
        prepared: PreparedTop,
        writer: Arc<Active>,
        reader: Option<Arc<dyn Storage>>,
    ) -> Result<Chain, Error> {
        let mut prepared = prepared;
        let old = self.top();
        // Read through the writer's tables, which nothing changes any
        // more, until it has closed the image: its L1 table kept (the
        // first lookups after the pause walk it, pending until the new
        // top's index is installed, from queue workers that must not wait
        // for metadata reads).
        let holder: Arc<dyn crate::held::TableHolder> = writer.clone();
        let reopened = Qcow2Layer::open_held(
            old.path(),
            reader.unwrap_or_else(|| old.storage().clone()),
            writer.l1_table(),
            writer.known_len(),
            holder,
        )
        .map_err(|k| Error::new(old.path(), k))?;
        let mut layers: Vec<Layer> = self.layers[..self.top_index().0].to_vec();
        layers.push(Layer::Qcow2(reopened));
        layers.push(prepared.layer.clone());
        let top = LayerIndex(layers.len() - 1);
        let top_geometry = layers[top.0]
            .header()
            .map(|h| h.geometry)
            .unwrap_or(self.top_geometry);
        let guard = self.index.load();
        let covering = guard.covering.clone();
        let state = match &covering {
            Some((index, upto)) => IndexState::Valid {
                path: index.path().to_path_buf(),
                layers: upto.0 + 1,
                pending: top.0 - upto.0 - 1,
                bytes: index.file_size(),
                granularity: index.geometry().chunk_size(),
            },
            None => guard.state.clone(),
        };
        let resolved_bits = {
            let top_bits = top_geometry.subcluster_size().trailing_zeros();
            let index_bits = covering
                .as_ref()
                .map_or(top_bits, |(i, _)| i.geometry().granularity_bits);
            top_bits
                .min(granularity_bits(&layers, top.0 - 1))
                .min(index_bits)
        };
        // The chain answers from the new top's summary only with an index
        // (its fast path for regions the top never wrote).
        let summary = covering.as_ref().and(prepared.summary.clone());
        // Taken last: on any failure before, dropping `prepared` closes
        // the new top clean.
        let Some(active) = prepared.active.take() else {
            return Err(Error::new(
                &prepared.path,
                ErrorKind::Io(std::io::Error::other("new top already used")),
            ));
        };
        // This chain's top, and any older top not closed yet (a retire that
        // failed): the next chain's flushes flush them.
        let mut unclosed_below = self.unclosed_below();
        unclosed_below.push(UnclosedTop {
            writer,
            fence: self.fence.clone(),
            at: self.top_index(),
        });
        let data_reads = (0..layers.len())
            .map(|i| {
                let before = self
                    .data_reads
                    .get(i)
                    .map_or(0, |c| c.load(Ordering::Relaxed));
                AtomicU64::new(before)
            })
            .collect();
        let remote = layers.iter().any(|l| l.storage().fetches_remotely());
        Ok(Chain {
            data_reads,
            size_floors: Default::default(),
            storages: layers.iter().map(|l| l.storage().clone()).collect(),
            layers,
            files: self.files.clone(),
            cache: self.cache.clone(),
            slice_size: self.slice_size,
            top_geometry,
            active: Some(Arc::new(active)),
            fence: Arc::new(TransferFence::default()),
            resolved: ResolvedSlices::new(resolved_bits),
            index: arc_swap::ArcSwap::from_pointee(IndexInUse { covering, state }),
            summary,
            unclosed_below: std::sync::Mutex::new(unclosed_below),
            top_place: Some(prepared.place.clone()),
            mirror: Default::default(),
            drain: Default::default(),
            unreadable: Default::default(),
            readahead: remote.then(Box::default),
        })
    }
}

/// Whether `a` and `b` are the same file: the same storage, or the same
/// device and inode (the next chain reads a live snapshot's old top
/// through a description of its own).
fn same_file(a: &Arc<dyn Storage>, b: &Arc<dyn Storage>) -> bool {
    Arc::ptr_eq(a, b) || a.file_id().is_some_and(|id| b.file_id() == Some(id))
}

impl Handover<'_> {
    /// Grows the top's disk to `size` bytes (a multiple of 512, more than
    /// now), as `qemu-img resize` does, where its L1 table addresses the
    /// new size without moving. The size is for the chain opened next
    /// (`Chain::open`, `Chain::open_reusing`), which must then
    /// [`Handover::zero_grown`]: this one reports the new size but keeps
    /// its lookups to the old one, and is closed or handed over without
    /// further I/O. Its bitmaps grow with it (stored at once).
    pub fn grow_top(&self, size: u64) -> Result<(), Error> {
        let active = self.chain.active()?;
        let now = self.chain.virtual_size();
        if size < now {
            return Err(Error::new(
                self.chain.top().path(),
                ErrorKind::InvalidArgument(format!(
                    "{size} bytes is smaller than the disk ({now} bytes): that is a shrink"
                )),
            ));
        }
        if size == now {
            return Ok(());
        }
        active.grow(size)?;
        // The bitmaps grown with the disk are stored at its new size (and
        // the clusters of their old tables freed) before the next chain
        // reads them.
        if !active.bitmaps().is_empty() {
            self.chain.flush_clean()?;
        }
        Ok(())
    }

    /// On a chain opened after its top grew from `old_size`: zeroes what
    /// the layer below would otherwise show through the new range (a
    /// backing file longer than the old top), as QEMU zero-writes it when
    /// it grows an image.
    pub fn zero_grown(&self, old_size: u64) -> Result<(), Error> {
        let layers = self.chain.layers();
        let Some(below) = layers.len().checked_sub(2).and_then(|i| layers.get(i)) else {
            return Ok(());
        };
        let end = self.chain.virtual_size().min(below.virtual_size());
        if end <= old_size {
            return Ok(());
        }
        self.chain.write_zeroes(old_size, end - old_size, true)
    }

    /// Prepares `created`, an empty image this process created over this
    /// chain's top (which must be writable), for [`crate::Handover::successor`]:
    /// everything that does not need the guest paused. The file is opened
    /// by name in the directory it was made in, and must still be the file
    /// made. Fails if the new top does not stand on this chain's top or
    /// the chain would grow too deep.
    pub fn prepare_successor(
        &self,
        created: &CreatedFile,
        options: &ChainOptions,
    ) -> Result<PreparedTop, Error> {
        self.chain.active()?;
        let old = self.chain.top();
        let new_path = created.path();
        let new_top = new_path.as_path();
        let place = created.place();
        let file = created
            .dir()
            .open_file(place.name(), true)
            .map_err(|e| Error::new(new_top, e.into()))?;
        if crate::sidefile::file_id(&file).ok() != Some(created.id()) {
            return Err(Error::new(new_top, ErrorKind::FileReplaced));
        }
        let storage: Arc<dyn Storage> = Arc::new(
            FileStorage::from_writable_file(file)
                .and_then(|s| s.with_cache(options.cache))
                .map_err(|e| Error::new(new_top, e.into()))?,
        );
        let layer =
            Qcow2Layer::open(new_top, storage.clone()).map_err(|k| Error::new(new_top, k))?;
        // The new top must stand on this chain's top, nothing else.
        let backing_id = layer
            .header()
            .backing_file
            .as_ref()
            .and_then(|name| resolve_backing_path(new_top, name).ok())
            .and_then(|path| std::fs::metadata(path).ok())
            .map(|m| {
                use std::os::unix::fs::MetadataExt;
                (m.dev(), m.ino())
            });
        if backing_id.is_none() || backing_id != old.storage().file_id() {
            return Err(Error::new(
                new_top,
                ErrorKind::Io(std::io::Error::other(format!(
                    "its backing file is not the chain's top {}",
                    old.path().display()
                ))),
            ));
        }
        if self.chain.top_index().0 + 2 > options.max_layers {
            return Err(Error::new(
                new_top,
                ErrorKind::ChainTooDeep {
                    limit: options.max_layers,
                },
            ));
        }
        storage
            .lock(options.lock_request(true), options.locking)
            .map_err(|k| Error::new(new_top, k))?;
        let at = LayerIndex(self.chain.top_index().0 + 1);
        let summary = layer
            .l1()
            .and_then(|l1| TopSummary::build(layer.header(), l1, &*storage, options.slice_size))
            .ok()
            .map(Arc::new);
        let layer = Layer::Qcow2(layer);
        let link = CacheLink {
            cache: self.chain.cache.clone(),
            source: Source::Layer(at.0 as u32),
            slice_size: self.chain.slice_size,
            budget: options.cache_size,
            summary: summary.clone(),
        };
        let below: Vec<_> = self
            .chain
            .storages
            .iter()
            .filter_map(|s| s.file_id())
            .collect();
        let active = Active::open(&layer, true, link, Some(place.clone()), below)?
            .with_background_write_back(options.background_write_back);
        active.take_on_bitmaps(self.chain.active()?)?;
        active.prefill_spares();
        let old_top_reader =
            match LazyFile::reading_the_same_file(&**old.storage(), self.chain.files.clone()) {
                Ok(reader) => Some(reader),
                Err(e) => {
                    tracing::debug!(path = %old.path().display(), error = %e,
                        "the old top is read through its writer's descriptor");
                    None
                }
            };
        Ok(PreparedTop {
            path: new_top.to_path_buf(),
            place,
            layer,
            active: Some(active),
            summary,
            at,
            backing_id,
            old_top_reader,
        })
    }

    /// The chain whose top is `prepared` ([`crate::Handover::prepare_successor`]),
    /// made inside the guest's pause, with no file write: nothing may
    /// change this chain's top meanwhile or afterwards (no write in
    /// flight; from this call on it refuses changes, so switch to the
    /// chain returned). This chain's top becomes a backing layer (its
    /// image locks lowered to a reader's, which still keeps every other
    /// writer away) that the next chain reads through the L1 table and
    /// the L2 tables held in memory here, which the file may not have
    /// yet, until [`crate::Handover::retire`] has written them back and closed the
    /// image; until then the next chain's flushes flush this top too. The
    /// layers below it, the unified cache and the index in use carry
    /// over, the old top walked above the index until the new top's index
    /// is installed ([`crate::indexing::build_index`]). Only the old
    /// top's header is read, before any lock changes. On failure this
    /// chain stays as it was, its top's locks a writer's throughout (if
    /// they were lowered and cannot be taken back, its writes fail rather
    /// than go on without them). Once
    /// the switch is done (outside the guest's pause),
    /// [`crate::Handover::tables`] gives the next chain the tables this
    /// one used last and [`crate::Handover::retire`] closes the old top.
    pub fn successor(
        &self,
        mut prepared: PreparedTop,
        options: &ChainOptions,
    ) -> Result<Chain, Error> {
        let Some(writer) = self.chain.active.clone() else {
            return Err(Error::new(self.chain.top().path(), ErrorKind::ReadOnly));
        };
        // A failed engine's tables in memory may be inconsistent: not for
        // reading.
        writer.check_failed()?;
        let old = self.chain.top();
        let old_storage = old.storage().clone();
        if prepared.backing_id != old_storage.file_id()
            || prepared.at.0 != self.chain.top_index().0 + 1
        {
            return Err(Error::new(
                &prepared.path,
                ErrorKind::Io(std::io::Error::other(format!(
                    "prepared over another top than {}",
                    old.path().display()
                ))),
            ));
        }
        // The next chain is built first (a header read, the only step
        // that can fail for want of the disk), the locks changed last: a
        // failed switch leaves this chain writing its top, and until then
        // the top's locks must keep out every reader that refuses writers
        // (lowered and taken back, they could have let one in).
        let reader = prepared
            .old_top_reader
            .take()
            .map(|reader| reader as Arc<dyn Storage>);
        let built = self
            .chain
            .successor_from(prepared, writer.clone(), reader.clone())?;
        if let Err(k) = old_storage.lock(options.lock_request(false), options.locking) {
            // A failed change changes nothing: still the writer's locks.
            built.abandon();
            return Err(Error::new(old.path(), k));
        }
        // The description the next chain reads the old top through takes
        // a reader's locks too (once the writer's are a reader's: a
        // writer's would conflict), before the writer's description may
        // go.
        if let Some(reader) = reader {
            if let Err(k) = reader.lock(options.lock_request(false), options.locking) {
                built.abandon();
                if let Err(back) = old_storage.lock(options.lock_request(true), options.locking) {
                    // Writing on without the writer's locks could write
                    // under a reader promised no writer.
                    writer.fail(&format!(
                        "the image's write lock could not be taken back after a failed live snapshot: {back}"
                    ));
                }
                return Err(Error::new(old.path(), k));
            }
        }
        // The tables the next chain reads from the writer stay as they
        // are.
        writer.supersede();
        Ok(built)
    }

    /// Puts the tables this chain's top used last (at most 1 MiB) into the
    /// unified cache, for the chain that follows it after a live snapshot
    /// (bounded work; the other tables are read from the file when first
    /// needed). Harmless at any time: only tables as written go there.
    pub fn tables(&self) {
        if let Some(active) = &self.chain.active {
            active.publish_recent(HANDED_OVER);
        }
    }

    /// Closes this chain's top, which `next` (made by
    /// [`crate::Handover::successor`]) reads as a backing layer and nothing writes
    /// any more: its tables written back and made durable, its journal
    /// ended, its spare clusters given back, lazy refcounts written, its
    /// dirty bit cleared; then `next` reads the image from its file alone
    /// and no longer flushes it, and `next`'s layer of it is identified
    /// again ([`crate::Qcow2Layer::refresh_identity`]), so that an index
    /// of `next` built from then on records the image as it stays.
    /// Outside the guest's pause: nothing in it waits for this. If it
    /// fails, `next` goes on reading the tables from memory and writing
    /// them back at its flushes, and [`crate::Handover::close_unclosed_below`] of
    /// `next` (or of a chain after it) tries again; a process that dies
    /// first leaves the old top open, which the next read-write open of
    /// the chain repairs (its journal has every completed change). This
    /// chain's drop closes nothing again.
    pub fn retire(&self, next: &Chain) -> Result<(), Error> {
        let at = self.chain.top_index();
        let listed = next.unclosed_below().into_iter().find(|b| b.at == at);
        if let Some(unclosed) = listed.filter(|b| {
            self.chain
                .active
                .as_ref()
                .is_some_and(|w| Arc::ptr_eq(w, &b.writer))
        }) {
            return next.close_below(&unclosed);
        }
        // Not listed: closed already (by an index build of `next`), if
        // `next` is this chain's successor at all.
        let old = self.chain.top();
        match next.layers.get(at.0) {
            Some(Layer::Qcow2(l))
                if self.chain.active.is_some() && same_file(l.storage(), old.storage()) =>
            {
                Ok(())
            }
            _ => Err(Error::new(
                old.path(),
                ErrorKind::Io(std::io::Error::other(
                    "the chain given is not this chain's successor",
                )),
            )),
        }
    }

    /// Closes every old top that live snapshots left open below this
    /// chain's top, as [`crate::Handover::retire`] does: for a retire that failed,
    /// before an index of this chain is built
    /// ([`crate::IndexView::indexable_layers`]), and before the chain's own close.
    /// Each is tried; those that fail stay open (their tables read from
    /// their writers, flushed at each flush) for the next call, and the
    /// first error is returned.
    pub fn close_unclosed_below(&self) -> Result<(), Error> {
        let mut first_error = None;
        for below in self.chain.unclosed_below() {
            if let Err(e) = self.chain.close_below(&below) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}
