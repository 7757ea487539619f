//! Operations that create chain indexes: `upgrade` (index a vanilla chain
//! in place), `snapshot` (a new top over the current one, with its index),
//! and `verify_index` (compare an index with a fresh walk).

use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use crate::backing::BackingRoot;
use crate::chain::{Chain, ChainOptions};
use crate::create::CreateOptions;
use crate::error::{Error, ErrorKind};
use crate::header::Version;
use crate::index::{IndexEntry, IndexGeometry, IndexWriter};
use crate::layer::Layer;
use crate::lock::{LockRequest, Locking};
use crate::sidefile::{CreatedFile, Dir, FileId, NewImage, NewIndex};
use crate::sqcow2_ext::{fingerprints, set_autoclear_bit, write_index_extension, IndexState};
use crate::storage::FileStorage;
use crate::types::LayerIndex;

/// Callback for long operations: `(done, total)`.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

pub(crate) fn io_err(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::new(path, ErrorKind::Io(e))
}

/// Writes the index of layers `0..=upto` of `chain` over `covered_size`
/// guest bytes into `index`'s temporary file, slice by slice, synced;
/// `top_name` is the backing name the layer above `upto` records. The
/// caller installs it ([`NewIndex::install`]: rename, fsync of the
/// directory). Returns the geometry and the file's size.
#[allow(clippy::too_many_arguments)]
fn write_index(
    chain: &Chain,
    upto: LayerIndex,
    covered_size: u64,
    top_name: &[u8],
    index: &NewIndex,
    progress: Progress,
    cancelled: &dyn Fn() -> bool,
) -> Result<(IndexGeometry, u64), Error> {
    let geometry = chain.index().geometry(upto, covered_size);
    let fps = fingerprints(chain.layers(), upto.0, top_name);
    let tmp = index.tmp_path();
    let file = index.file().map_err(io_err(&tmp))?;
    let mut writer = IndexWriter::new(file, geometry, &fps);
    let stopped = || Error::new(&tmp, ErrorKind::Io(cancel_error()));
    chain.index().entries(
        upto,
        geometry,
        &mut |entry| {
            if writer.pushed() % 4096 == 0 && cancelled() {
                return Err(stopped());
            }
            writer
                .push(entry)
                .map_err(|e| Error::new(&tmp, ErrorKind::Io(e)))
        },
        progress,
    )?;
    let file = writer.finish().map_err(io_err(&tmp))?;
    let bytes = file.metadata().map_err(io_err(&tmp))?.len();
    // Once more before the sync (a caller's check may also wait there,
    // as the daemon's does while a guest is paused).
    if cancelled() {
        return Err(stopped());
    }
    file.sync_all().map_err(io_err(&tmp))?;
    Ok((geometry, bytes))
}

/// The files of `chain`'s layers (named so in a refusal).
fn layer_ids(chain: &Chain) -> Vec<FileId> {
    chain
        .layers()
        .iter()
        .filter_map(|l| l.storage().file_id())
        .collect()
}

/// Opens `layer`'s file again for writing: the file the chain has open
/// (through its descriptor, not its name).
fn reopen_writable(layer: &Layer) -> Result<FileStorage, Error> {
    crate::storage::writable_same_file(&**layer.storage(), layer.path())
        .map_err(io_err(layer.path()))
}

fn cancel_error() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::Interrupted, "index build cancelled")
}

/// `Err(cancelled)` naming `what` once `cancelled` says so.
fn stop_if(cancelled: &dyn Fn() -> bool, what: &Path) -> Result<(), Error> {
    if cancelled() {
        return Err(Error::new(what, ErrorKind::Io(cancel_error())));
    }
    Ok(())
}

/// The index of layers `0..=upto` under `name` beside the top: its file
/// made (refused, untouched, if the name holds anything but an older
/// index of sqcow2's), the layers marked (`locking`), the entries written
/// and synced; not installed yet. Returns it with its size.
fn write_top_index(
    chain: &Chain,
    upto: LayerIndex,
    name: &Path,
    locking: Locking,
    progress: Progress,
    cancelled: &dyn Fn() -> bool,
) -> Result<(NewIndex, u64), Error> {
    let top = chain.top();
    let place = chain.top_place()?;
    let index = NewIndex::create(
        place.dir().clone(),
        name.as_os_str(),
        place.name(),
        &layer_ids(chain),
    )?;
    // The locks first: a layer another process holds stops the build
    // before a slice is written.
    mark_layers(chain, upto.0, locking)?;
    let top_name = crate::chain::backing_name_of(top);
    let (_, bytes) = write_index(
        chain,
        upto,
        top.virtual_size(),
        &top_name,
        &index,
        progress,
        cancelled,
    )?;
    stop_if(cancelled, &top.path().with_file_name(name))?;
    Ok((index, bytes))
}

/// Starts using the index just installed in `chain`; what was built.
fn install_report(
    chain: &Chain,
    installed: CreatedFile,
    upto: LayerIndex,
    bytes: u64,
) -> Result<BuildReport, Error> {
    let report = BuildReport {
        index: installed.path(),
        layers: upto.0 + 1,
        bytes,
        file: Some(installed),
    };
    chain.index().install_built(&report)?;
    Ok(report)
}

/// An in-place build whose top stopped being served (a live snapshot, a
/// handover): ended as a cancelled one is.
fn superseded(top: &Path) -> Error {
    Error::new(
        top,
        ErrorKind::Io(std::io::Error::new(
            std::io::ErrorKind::Interrupted,
            "index build cancelled: the top is not served any more",
        )),
    )
}

/// Whether `e` ended an index build that was cancelled (or whose top
/// stopped being served), not one that failed.
pub fn is_cancelled(e: &Error) -> bool {
    matches!(&e.kind, ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::Interrupted)
}

/// The layers of `0..=upto` an index build marks: qcow2 v3 layers
/// without the sQcow2 autoclear bit.
fn layers_to_mark(chain: &Chain, upto: usize) -> impl Iterator<Item = &Layer> {
    chain.layers()[..=upto].iter().filter(|layer| match layer {
        Layer::Qcow2(q) => {
            let header = q.header();
            header.version == Version::V3
                && header.features.autoclear & crate::index::AUTOCLEAR_SQCOW2 == 0
                && !autoclear_bit_on_disk(layer)
        }
        Layer::Raw(_) => false,
    })
}

/// Refuses, before anything is written, an index build that would write
/// into an image marked corrupt: a layer of `0..=upto` that may need its
/// mark (from the headers read at open: no file is read again), or `top`
/// (which names the index).
fn refuse_corrupt_targets(chain: &Chain, upto: usize, top: &Layer) -> Result<(), Error> {
    let unmarked = chain.layers()[..=upto].iter().filter(|layer| {
        layer.header().is_some_and(|h| {
            h.version == Version::V3 && h.features.autoclear & crate::index::AUTOCLEAR_SQCOW2 == 0
        })
    });
    for layer in unmarked.chain(std::iter::once(top)) {
        if let Some(header) = layer.header() {
            header
                .refuse_if_marked_corrupt()
                .map_err(|k| Error::new(layer.path(), k))?;
        }
    }
    Ok(())
}

/// Sets the sQcow2 autoclear bit on layers `0..=upto` that lack it; each
/// one written is locked as a writer first (an image another process
/// reads or writes is not touched), then given back the locks it had.
fn mark_layers(chain: &Chain, upto: usize, locking: Locking) -> Result<(), Error> {
    for layer in layers_to_mark(chain, upto) {
        if let Some(header) = layer.header() {
            // Nothing is written into an image marked corrupt.
            header
                .refuse_if_marked_corrupt()
                .map_err(|k| Error::new(layer.path(), k))?;
        }
        let held = layer.storage().locks();
        layer
            .storage()
            .lock(LockRequest::WRITER, locking)
            .map_err(|k| Error::new(layer.path(), k))?;
        let marked = reopen_writable(layer)
            .map_err(|e| {
                Error::new(
                    layer.path(),
                    ErrorKind::Io(std::io::Error::other(format!(
                        "cannot mark the layer as indexed: {}",
                        e.kind
                    ))),
                )
            })
            .and_then(|storage| set_autoclear_bit(&storage).map_err(io_err(layer.path())));
        // Back to the locks held before (a daemon goes on reading the
        // layer and must not keep others from reading it).
        if let Some(held) = held {
            layer
                .storage()
                .lock(held, locking)
                .map_err(|k| Error::new(layer.path(), k))?;
        }
        marked?;
    }
    Ok(())
}

/// Whether the layer's file carries the sQcow2 autoclear bit now (the
/// header in memory is the one read at open: an old top marked by an
/// earlier build of this process does not show it).
fn autoclear_bit_on_disk(layer: &Layer) -> bool {
    crate::sqcow2_ext::autoclear_word(&**layer.storage())
        .is_ok_and(|word| word & crate::index::AUTOCLEAR_SQCOW2 != 0)
}

/// What `upgrade` did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct UpgradeReport {
    /// Index file written; `None` when the image has no backing file
    /// (nothing to index).
    pub index: Option<PathBuf>,
    /// Layers it covers.
    pub layers: usize,
    /// Chunks it describes.
    pub chunks: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Indexes the chain under `top` in place: writes `<top>.sqidx`, marks the
/// covered layers, then names the index in the top's header (last, so that a
/// crash leaves the chain vanilla). Every file written is locked as a
/// writer first.
pub fn upgrade(top: &Path, locking: Locking, progress: Progress) -> Result<UpgradeReport, Error> {
    let options = ChainOptions {
        use_index: false,
        locking,
        ..ChainOptions::default()
    };
    let chain = Chain::open(top, &options)?;
    let n = chain.layers().len();
    if n < 2 {
        // A lone image: every lookup is in the top already.
        return Ok(UpgradeReport {
            index: None,
            layers: 0,
            chunks: 0,
            bytes: 0,
        });
    }
    let upto = n - 2;
    let top_layer = chain.top();
    let Some(header) = top_layer.header() else {
        return Err(Error::new(top, ErrorKind::BadMagic(0)));
    };
    let top_name = header
        .backing_file
        .as_ref()
        .map(|p| p.as_os_str().as_bytes().to_vec())
        .unwrap_or_default();
    refuse_corrupt_targets(&chain, upto, top_layer)?;
    // Named after the file (a symlink at `top` resolved), as its other
    // side files are.
    let name = PathBuf::from(crate::sidefile::index_name(chain.top_place()?.name()));
    top_layer
        .storage()
        .lock(LockRequest::WRITER, locking)
        .map_err(|k| Error::new(top, k))?;
    // Checked before anything is written: the name may hold nothing but
    // an older index of sqcow2's (not a layer, not another file).
    let index = NewIndex::create(
        chain.top_place()?.dir().clone(),
        name.as_os_str(),
        chain.top_place()?.name(),
        &layer_ids(&chain),
    )?;
    let (geometry, bytes) = write_index(
        &chain,
        LayerIndex(upto),
        chain.virtual_size(),
        &top_name,
        &index,
        progress,
        &|| false,
    )?;
    let index_path = index.install()?.path();
    mark_layers(&chain, upto, locking)?;
    let storage = reopen_writable(top_layer)?;
    write_index_extension(&storage, header, &name).map_err(io_err(top))?;
    Ok(UpgradeReport {
        index: Some(index_path),
        layers: upto + 1,
        chunks: geometry.chunks(),
        bytes,
    })
}

/// `path` relative to directory `base` (both as given; `..` as needed).
pub(crate) fn relative_to(path: &Path, base: &Path) -> PathBuf {
    if path.is_absolute() != base.is_absolute() {
        return std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    }
    let p: Vec<Component> = path.components().collect();
    let b: Vec<Component> = base
        .components()
        .filter(|c| *c != Component::CurDir)
        .collect();
    let p: Vec<Component> = p.into_iter().filter(|c| *c != Component::CurDir).collect();
    let common = p.iter().zip(&b).take_while(|(x, y)| x == y).count();
    if b[common..].contains(&Component::ParentDir) {
        return std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    }
    let mut out = PathBuf::new();
    for _ in common..b.len() {
        out.push("..");
    }
    for c in &p[common..] {
        out.push(c);
    }
    out
}

/// What `snapshot` did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct SnapshotReport {
    /// The new active volume.
    pub new: PathBuf,
    /// Its backing file name, as written.
    pub backing: PathBuf,
    /// Its index file (named by the new top's header; written now with
    /// [`SnapshotIndex::Now`], else by the first writable open that serves
    /// the chain, or by `upgrade`).
    pub index: PathBuf,
    /// Whether the index was written now.
    pub index_written: bool,
    /// Whether the old top's index was used (O(1) lookups) or the chain
    /// had to be walked (only when the index was written now).
    pub incremental: bool,
}

/// When `snapshot` writes the new top's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotIndex {
    /// Before the new top appears (the cost grows with the disk).
    Now,
    /// Later ([`build_index`], called by a daemon that serves the chain,
    /// or `upgrade`); until then the old top's index serves and the old
    /// top is walked first.
    Deferred,
}

/// Creates `new` over `top` exactly as `qemu-img create -b TOP -F qcow2
/// NEW` would (same size and cluster size as the top), naming its index
/// (`<new>.sqidx`), which is written now or later as `index` says.
/// Atomic: `new` appears (by rename) only once complete. The chain is
/// locked as a reader, and a layer whose header gains the index bit as a
/// writer (`Locking::Off` for a caller that holds the locks itself).
/// Refused before anything is written when `new`, or a name its side
/// files take (`sidefile`), holds anything but a killed snapshot's
/// leftovers.
pub fn snapshot(
    top: &Path,
    new: &Path,
    locking: Locking,
    index: SnapshotIndex,
    progress: Progress,
) -> Result<SnapshotReport, Error> {
    let prepared = prepare_snapshot(top, new, locking, index, progress)?;
    prepared.publish()
}

/// A new top created under a temporary name, not yet visible under its
/// own ([`PreparedSnapshot::publish`] renames it; dropped, it is
/// removed, with its index's temporary file).
#[must_use = "a prepared snapshot is removed unless published"]
#[derive(Debug)]
pub(crate) struct PreparedSnapshot {
    image: NewImage,
    index: Option<NewIndex>,
    report: SnapshotReport,
}

impl PreparedSnapshot {
    /// Makes the new top visible under its name (rename, fsync of the
    /// directory), then its index, if written (a crash between leaves the
    /// top without its index: rebuilt by the next writer, walked until).
    pub(crate) fn publish(self) -> Result<SnapshotReport, Error> {
        let mut report = self.report;
        self.image.publish()?;
        if let Some(index) = self.index {
            if let Err(e) = index.install() {
                tracing::warn!(error = %e, "the new top is made, its index is not: it is rebuilt by the next writer");
                report.index_written = false;
            }
        }
        Ok(report)
    }
}

/// The part of [`snapshot`] that does not need the old top to stay
/// unchanged (with [`SnapshotIndex::Deferred`]): the new top created and
/// synced under a temporary name.
pub(crate) fn prepare_snapshot(
    top: &Path,
    new: &Path,
    locking: Locking,
    index: SnapshotIndex,
    progress: Progress,
) -> Result<PreparedSnapshot, Error> {
    let chain = Chain::open(
        top,
        &ChainOptions {
            locking,
            // Headers and the top's L1 table are all a deferred index needs.
            use_index: index == SnapshotIndex::Now,
            ..ChainOptions::default()
        },
    )?;
    // Extended from the index in use (its layers not walked again).
    let incremental =
        index == SnapshotIndex::Now && (chain.index().is_used() || chain.layers().len() == 1);
    let top_index = chain.top_index();
    if index == SnapshotIndex::Now {
        // The new top is a new file; the layers below are marked.
        refuse_corrupt_targets(&chain, top_index.0, chain.top())?;
    }
    let (image, mut report) = create_over(&chain, top, new, None)?;
    let mut written = None;
    if index == SnapshotIndex::Now {
        let pending = NewIndex::create(
            image.dir().clone(),
            crate::sidefile::index_name(image.name()).as_os_str(),
            image.name(),
            &layer_ids(&chain),
        )?;
        write_index(
            &chain,
            top_index,
            chain.virtual_size(),
            report.backing.as_os_str().as_bytes(),
            &pending,
            progress,
            &|| false,
        )?;
        mark_layers(&chain, top_index.0, locking)?;
        written = Some(pending);
    }
    report.index_written = written.is_some();
    report.incremental = incremental;
    Ok(PreparedSnapshot {
        image,
        index: written,
        report,
    })
}

/// The directory a new image `new` goes in, opened once: inside `root`
/// when given (resolved and opened from the root's descriptor, no
/// symlink followed), else as named.
pub(crate) fn new_image_dir(new: &Path, root: Option<&Path>) -> Result<Arc<Dir>, Error> {
    let parent = new.parent().unwrap_or(Path::new(""));
    let dir = match root {
        Some(root) => {
            let root = BackingRoot::open(root).map_err(io_err(root))?;
            Dir::beneath(root.dir(), root.path(), parent).map_err(|e| {
                if e.kind() == std::io::ErrorKind::PermissionDenied {
                    Error::new(
                        new,
                        ErrorKind::BackingOutsideRoot {
                            backing: new.to_path_buf(),
                            resolved: std::fs::canonicalize(parent)
                                .unwrap_or_else(|_| parent.to_path_buf()),
                            root: root.path().to_path_buf(),
                        },
                    )
                } else {
                    Error::new(parent, e.into())
                }
            })?
        }
        None => Dir::open(parent).map_err(io_err(parent))?,
    };
    Ok(Arc::new(dir))
}

/// The new top over `chain`'s top `top`, created and synced under its
/// temporary name, naming its (not yet written) index; its directory
/// opened inside `root` when given.
fn create_over(
    chain: &Chain,
    top: &Path,
    new: &Path,
    root: Option<&Path>,
) -> Result<(NewImage, SnapshotReport), Error> {
    let Some(top_header) = chain.top().header() else {
        return Err(Error::new(top, ErrorKind::BadMagic(0)));
    };
    let name = crate::sidefile::dir::file_name(new).map_err(io_err(new))?;
    let dir = new_image_dir(new, root)?;
    let new_dir = new.parent().unwrap_or(Path::new(""));
    let backing = if top.is_absolute() {
        top.to_path_buf()
    } else {
        relative_to(top, new_dir)
    };
    let opts = CreateOptions {
        size: chain.virtual_size(),
        cluster_size: top_header.geometry.cluster_size(),
        extended_l2: top_header.geometry.extended_l2,
        compression_type: top_header.compression_type,
        lazy_refcounts: top_header.lazy_refcounts(),
        backing_file: Some(backing.clone()),
        backing_format: Some("qcow2".into()),
        ..CreateOptions::default()
    };
    let bytes = crate::create::image_bytes(&opts).map_err(|k| Error::new(new, k))?;
    let image = NewImage::create(dir, name, &layer_ids(chain), bytes)?;
    crate::sqcow2_ext::name_index_of(&image)?;
    let report = SnapshotReport {
        new: new.to_path_buf(),
        backing,
        index: new.with_file_name(crate::sidefile::index_name(name)),
        index_written: false,
        incremental: false,
    };
    Ok((image, report))
}

/// Creates `new` over `top`, the top of `chain` (which this process has
/// open, writable or not, and whose locks it holds), with a deferred
/// index: only the top's header is looked at, never its L1 or L2 tables
/// (which a writer may be changing), so a daemon can create the new top
/// of a live snapshot while the guest runs. `new`'s directory must lie
/// inside `root` when given (a daemon's backing root): it is opened once,
/// from the root's descriptor, and every file is made in it by name.
/// Atomic and durable as [`snapshot`]; what was created is returned, to
/// be opened ([`crate::Handover::prepare_successor`]) or removed.
pub fn snapshot_over(
    chain: &Chain,
    top: &Path,
    new: &Path,
    root: Option<&Path>,
) -> Result<CreatedFile, Error> {
    let (image, _) = create_over(chain, top, new, root)?;
    image.publish()
}

/// What [`build_index`] did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct BuildReport {
    /// The index written.
    pub index: PathBuf,
    /// Layers it covers.
    pub layers: usize,
    /// Its size in bytes.
    pub bytes: u64,
    /// The file made (opened again through its directory, by identity).
    #[serde(skip)]
    pub(crate) file: Option<CreatedFile>,
}

/// Writes the index the top of `chain` names, covering every layer below
/// the top, from the index in use and the layers above it (pending
/// layers), and installs it into `chain`: lookups stop walking the
/// pending layers. Layers below the top gain the autoclear bit first (each
/// locked as a writer unless `locking` is off: a daemon that holds the
/// chain's locks passes `Locking::Off`). Nothing is done (`None`) when
/// the top names no index or the index in use covers every layer below
/// the top. A crash at any moment leaves the old index serving: the new
/// one appears by rename, complete. `cancelled` is asked every few
/// thousand entries and before the file's sync, with no lock of the chain
/// held: it may block (a daemon holds a build so while a guest is paused).
/// Old tops that live snapshots left open below the top (a failed
/// [`crate::Handover::retire`]) are closed first ([`crate::Handover::close_unclosed_below`]):
/// an index records layers as their files hold them.
pub fn build_index(
    chain: &Chain,
    locking: Locking,
    progress: Progress,
    cancelled: &dyn Fn() -> bool,
) -> Result<Option<BuildReport>, Error> {
    stop_if(cancelled, chain.top().path())?;
    chain.handover().close_unclosed_below()?;
    let Some(upto) = chain.index().indexable_layers() else {
        return Ok(None);
    };
    let top = chain.top();
    let Some(name) = top.header().and_then(crate::sqcow2_ext::index_name) else {
        return Ok(None);
    };
    if chain.index().covers() == Some(upto) {
        return Ok(None);
    }
    stop_if(cancelled, &top.path().with_file_name(&name))?;
    refuse_corrupt_targets(chain, upto.0, top)?;
    let (index, bytes) = write_top_index(chain, upto, &name, locking, progress, cancelled)?;
    let installed = index.install()?;
    install_report(chain, installed, upto, bytes).map(Some)
}

/// Indexes in place the vanilla chain a daemon serves (`chain` open
/// writable; its top names no index), as [`upgrade`] does offline, and
/// installs the index into `chain`: the layers below the top gain the
/// autoclear bit first, each locked as a writer for it with `locking`
/// (a layer another process holds is refused before anything is written:
/// an error names it, and the chain goes on walking), the index is written
/// beside the top, then the top's header names it (under the writer's
/// flush order). A crash at any moment leaves a chain QEMU and sqcow2
/// read as before (an index the top does not name is an older index of
/// sqcow2's, replaced by the next build). `None` when the top names an
/// index already ([`build_index`] keeps it up to date) or there is
/// nothing to index (a lone image, old tops of live snapshots still
/// open). `cancelled` as for [`build_index`].
pub fn index_in_place(
    chain: &Chain,
    locking: Locking,
    cancelled: &dyn Fn() -> bool,
) -> Result<Option<BuildReport>, Error> {
    let top = chain.top();
    stop_if(cancelled, top.path())?;
    let Some(header) = top.header() else {
        return Ok(None);
    };
    if crate::sqcow2_ext::index_name(header).is_some() {
        return Ok(None);
    }
    let Some(upto) = chain.index().indexable_layers() else {
        return Ok(None);
    };
    if chain.index().covers() == Some(upto) {
        return Ok(None);
    }
    let active = chain.active()?;
    refuse_corrupt_targets(chain, upto.0, top)?;
    let name = PathBuf::from(crate::sidefile::index_name(chain.top_place()?.name()));
    // Where the index goes, checked before anything is written.
    let edit = crate::header_area::AreaEdit {
        index: crate::header_area::Edit::Set(&name),
        backing: crate::header_area::Edit::Keep,
        fixed: crate::header_area::Edit::Keep,
        feature_table: None,
        bitmaps: crate::header_area::Edit::Keep,
    };
    // The top's header must be able to name the index: checked before
    // anything is written.
    if !active.rewrite_header_area_while_serving(&edit, true)? {
        return Err(superseded(top.path()));
    }
    let (index, bytes) = write_top_index(chain, upto, &name, locking, &mut |_, _| {}, cancelled)?;
    let installed = index.install()?;
    // A live snapshot meanwhile made this top a backing layer: its
    // header stays as the successor recorded it (the new top has an
    // index of its own to build).
    if !active.rewrite_header_area_while_serving(&edit, false)? {
        return Err(superseded(top.path()));
    }
    install_report(chain, installed, upto, bytes).map(Some)
}

/// Result of comparing an index with a fresh walk of the chain.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct IndexVerification {
    /// The index state as opened.
    pub state: IndexState,
    /// Chunks compared.
    pub chunks: u64,
    /// Chunks whose entry differs from the walk (their slice read and
    /// passed its checksum: lookups through the index would be wrong).
    pub mismatches: u64,
    /// Chunks not compared because the index was given up before them
    /// (a slice unreadable or failing its checksum: a damaged index,
    /// which lookups no longer use).
    pub unreadable: u64,
    /// Why the index was given up.
    pub unreadable_reason: Option<String>,
    /// The first few differences.
    pub examples: Vec<String>,
}

/// Compares the top's index, if valid, with what walking the chain gives
/// (the chain locked as a reader, or sharing all with `force_share`).
pub fn verify_index(
    top: &Path,
    locking: Locking,
    force_share: bool,
) -> Result<IndexVerification, Error> {
    let options = ChainOptions {
        locking,
        force_share,
        ..ChainOptions::default()
    };
    let indexed = Chain::open(top, &options)?;
    let state = indexed.index().state().clone();
    if !indexed.index().is_used() {
        return Ok(IndexVerification {
            state,
            chunks: 0,
            mismatches: 0,
            unreadable: 0,
            unreadable_reason: None,
            examples: Vec::new(),
        });
    }
    let walked = Chain::open(
        top,
        &ChainOptions {
            use_index: false,
            ..options
        },
    )?;
    // The layers the index in use covers (fewer than all below the top
    // while layers are pending).
    let Some(upto) = indexed.index().covers() else {
        return Ok(IndexVerification {
            state,
            chunks: 0,
            mismatches: 0,
            unreadable: 0,
            unreadable_reason: None,
            examples: Vec::new(),
        });
    };
    let covered_size = indexed.layers()[upto.0 + 1].virtual_size();
    let geometry = walked.index().geometry(upto, covered_size);
    let (mut mismatches, mut unreadable, mut unreadable_reason) = (0, 0, None);
    let mut examples = Vec::new();
    let mut chunk = 0u64;
    walked.index().entries(
        upto,
        geometry,
        &mut |want| {
            let got = match indexed.index().entry(chunk) {
                Ok(got) => got,
                Err(e) => {
                    unreadable += 1;
                    unreadable_reason.get_or_insert_with(|| e.to_string());
                    chunk += 1;
                    return Ok(());
                }
            };
            let same = match got {
                Some(g) => g == want || matches!(g, IndexEntry::Walk),
                None => false,
            };
            if !same {
                mismatches += 1;
                if examples.len() < 10 {
                    examples.push(format!(
                        "chunk {chunk} (guest offset {:#x}): index says {got:?}, the chain {want:?}",
                        chunk * geometry.chunk_size()
                    ));
                }
            }
            chunk += 1;
            Ok(())
        },
        &mut |_, _| {},
    )?;
    Ok(IndexVerification {
        state,
        chunks: chunk,
        mismatches,
        unreadable,
        unreadable_reason,
        examples,
    })
}

/// What [`rename_top_backing`] did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct RenameReport {
    /// The backing name the top recorded before.
    pub old_name: String,
    /// The name it records now.
    pub new_name: String,
    /// The index rewritten for the new name (`None`: the top names none,
    /// or its index did not cover the chain and is left to a rebuild).
    pub index: Option<PathBuf>,
}

/// Names the top's backing layer `name` instead: the same layer, byte for
/// byte, elsewhere (pushed to an object store, pulled back). The chain is
/// open read-only with the layer reached through its old name; `name` must
/// reach the same bytes (the caller checked). The top's index, when it
/// covers every layer below, is written again with the new name in its
/// fingerprints (its entries copied, no layer walked) and installed
/// first; then the header names the layer anew (in one synced write). A
/// crash between leaves an index that no longer matches: the chain is
/// walked until the next build, and reads stay right.
pub fn rename_top_backing(
    chain: &Chain,
    name: &[u8],
    locking: Locking,
) -> Result<RenameReport, Error> {
    let top = chain.top();
    let path = top.path();
    let Some(header) = top.header() else {
        return Err(Error::new(path, ErrorKind::BadMagic(0)));
    };
    let Some(old) = header.backing_file.as_ref() else {
        return Err(Error::new(
            path,
            ErrorKind::InvalidBackingName("the image has no backing file".into()),
        ));
    };
    header
        .refuse_if_marked_corrupt()
        .map_err(|k| Error::new(path, k))?;
    top.storage()
        .lock(LockRequest::WRITER, locking)
        .map_err(|k| Error::new(path, k))?;
    let upto = chain.top_index().0.checked_sub(1).map(LayerIndex);
    let index_name = crate::sqcow2_ext::index_name(header);
    let covers_all = upto.is_some() && chain.index().covers() == upto;
    let index = match (index_name, upto) {
        (Some(index_name), Some(upto)) if covers_all => {
            let place = chain.top_place()?;
            let index = NewIndex::create(
                place.dir().clone(),
                index_name.as_os_str(),
                place.name(),
                &layer_ids(chain),
            )?;
            write_index(
                chain,
                upto,
                top.virtual_size(),
                name,
                &index,
                &mut |_, _| {},
                &|| false,
            )?;
            Some(index.install()?.path())
        }
        (Some(_), _) => {
            tracing::warn!(top = %path.display(), "the chain index does not cover the chain: renamed without it (rebuild it with `sqcow2 upgrade`)");
            None
        }
        _ => None,
    };
    let storage = reopen_writable(top)?;
    let edit = crate::header_area::AreaEdit {
        index: crate::header_area::Edit::Keep,
        backing: crate::header_area::Edit::Set(crate::header_area::BackingName {
            name,
            format: header.backing_format(),
        }),
        fixed: crate::header_area::Edit::Keep,
        feature_table: None,
        bitmaps: crate::header_area::Edit::Keep,
    };
    crate::header_area::rewrite(&storage, header, &edit).map_err(io_err(path))?;
    Ok(RenameReport {
        old_name: String::from_utf8_lossy(old.as_os_str().as_bytes()).into_owned(),
        new_name: String::from_utf8_lossy(name).into_owned(),
        index,
    })
}
