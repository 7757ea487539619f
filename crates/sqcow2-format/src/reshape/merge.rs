//! `merge`: the view of layers i..j written into one new qcow2 file whose
//! backing is layer i-1, then layer j+1 switched onto it; their
//! persistent bitmaps merged by name into the new file's. No existing
//! layer's data is written; the layers it replaces are left in place.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::chain::{Chain, ChainOptions};
use crate::create::CreateOptions;
use crate::error::Error;
use crate::error::ErrorKind;
use crate::header_area::{AreaEdit, Edit};
use crate::indexing::{io_err, new_image_dir, BuildReport};
use crate::layer::Layer;
use crate::lock::Locking;
use crate::sidefile::{CreatedFile, FileId, NewImage};
use crate::types::LayerIndex;

use super::copy::{has_short_layers, Pace, ViewCopy, Zeros};
use super::{
    backing_name_for, find_layer, format_name, invalid, rebuild_index, HeaderWriter, LayerRef,
};

/// What to merge.
#[derive(Debug, Clone)]
pub struct MergeOptions {
    /// The chain's top (the image whose chain holds the layers).
    pub image: PathBuf,
    /// The lowest layer merged (`i`).
    pub first: LayerRef,
    /// The highest layer merged (`j`), below the top.
    pub last: LayerRef,
    /// The new file.
    pub output: PathBuf,
    /// Image locks.
    pub locking: Locking,
}

/// What a merge did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct MergeReport {
    /// The new file holding the merged layers' view.
    pub merged: PathBuf,
    /// Its backing file as written (`None`: the base was merged).
    pub backing: Option<PathBuf>,
    /// The layer switched onto the new file.
    pub switched: PathBuf,
    /// The layers replaced, lowest first: no longer in the chain, left
    /// for the operator to delete (other chains may still use them).
    pub replaced: Vec<PathBuf>,
    /// Layers in the chain before and after.
    pub layers_before: usize,
    /// Layers in the chain after.
    pub layers_after: usize,
    /// Guest bytes written with data.
    pub data_bytes: u64,
    /// Guest bytes written as zeros (hiding data below).
    pub zero_bytes: u64,
    /// The top's index, rebuilt.
    pub index: Option<BuildReport>,
}

/// How a merge opens again the layers of the chain it was prepared on: as
/// the served chain has them (each the same file: device and inode),
/// backing files inside the same root.
#[derive(Debug, Clone)]
pub(crate) struct Reopen {
    /// The backing root (a daemon's), if any.
    root: Option<PathBuf>,
    /// The files of the chain's layers `0..=last`, lowest first.
    ids: Vec<Option<FileId>>,
}

impl Reopen {
    /// `chain` (whose top is a layer of the prepared range or above it)
    /// if each of its layers is the file the prepared chain had at that
    /// position; else the first that differs is refused.
    fn checked(&self, chain: Chain) -> Result<Chain, Error> {
        for (layer, id) in chain.layers().iter().zip(&self.ids) {
            if layer.storage().file_id() != *id || id.is_none() {
                return Err(Error::new(layer.path(), ErrorKind::FileReplaced));
            }
        }
        Ok(chain)
    }
}

/// Metadata cache of each chain a merge opens for its copy.
const COPY_CACHE: u64 = 8 << 20;

/// The layers `first..=last` of a chain, checked for a merge.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MergeRange {
    pub first: LayerIndex,
    pub last: LayerIndex,
}

/// Checks that `first..=last` can be merged in `chain` (whose top is the
/// live or offline top): below the top, in order.
pub(crate) fn merge_range(
    chain: &Chain,
    first: &LayerRef,
    last: &LayerRef,
) -> Result<MergeRange, Error> {
    let top = chain.top().path();
    let first = find_layer(chain, first)?;
    let last = find_layer(chain, last)?;
    if first.0 > last.0 {
        return Err(invalid(
            top,
            format!("layer {} is above layer {}", first.0, last.0),
        ));
    }
    if last.0 >= chain.top_index().0 {
        return Err(invalid(
            top,
            "only layers below the top can be merged (the top is written)".into(),
        ));
    }
    if !chain.unclosed_below().is_empty() {
        // Its file may lack tables its writer still holds (the merge
        // copies from the files).
        return Err(invalid(
            top,
            "a live snapshot's old top is not closed yet: retry once the snapshot has finished"
                .into(),
        ));
    }
    Ok(MergeRange { first, last })
}

/// The new file of a merge, created and synced under its temporary name
/// (`<output>.sqtmp`), backing onto layer `first - 1`, naming its own
/// (deferred) index. Removed when dropped unless published.
#[must_use = "a merge file is removed unless published"]
pub(crate) struct MergeFile {
    image: NewImage,
    backing: Option<PathBuf>,
}

impl MergeFile {
    /// Its backing file name.
    pub(crate) fn backing(&self) -> Option<&Path> {
        self.backing.as_deref()
    }
}

/// Creates the (empty) merge file for `range` of `chain` under its
/// temporary name, in `output`'s directory (opened inside `root` when
/// given). Refused, before anything is written, when `output` or a name
/// its side files take holds anything but a killed merge's leftovers
/// (those are removed).
pub(crate) fn create_merge_file(
    chain: &Chain,
    range: &MergeRange,
    output: &Path,
    root: Option<&Path>,
) -> Result<MergeFile, Error> {
    let last = &chain.layers()[range.last.0];
    let below = range.first.0.checked_sub(1).map(|i| &chain.layers()[i]);
    let backing = below.map(|b| backing_name_for(output, b.path()));
    let (cluster_size, extended_l2, compression_type, lazy) = match last {
        Layer::Qcow2(q) => {
            let h = q.header();
            (
                h.geometry.cluster_size(),
                h.geometry.extended_l2,
                h.compression_type,
                h.lazy_refcounts(),
            )
        }
        Layer::Raw(_) => (65536, false, crate::header::CompressionType::Deflate, false),
    };
    let opts = CreateOptions {
        size: last.virtual_size(),
        cluster_size,
        extended_l2,
        compression_type,
        lazy_refcounts: lazy,
        backing_file: backing.clone(),
        backing_format: below.map(|b| format_name(b).to_string()),
        ..CreateOptions::default()
    };
    let bytes = crate::create::image_bytes(&opts).map_err(|k| Error::new(output, k))?;
    let name = crate::sidefile::dir::file_name(output).map_err(io_err(output))?;
    let dir = new_image_dir(output, root)?;
    let layers: Vec<_> = chain
        .layers()
        .iter()
        .filter_map(|l| l.storage().file_id())
        .collect();
    let image = NewImage::create(dir, name, &layers, bytes)?;
    if backing.is_some() {
        // The new layer names its own index (written once it is
        // published): the top's index can then be built from it.
        crate::sqcow2_ext::name_index_of(&image)?;
    }
    Ok(MergeFile { image, backing })
}

/// Copies the view of `range` of `chain` (any chain whose layers include
/// it; only mappings of layers `first..=last` are read) into the merge
/// file `file`, which this opens writable, fills and closes clean.
pub(crate) fn fill_merge_file(
    last_path: &Path,
    range: &MergeRange,
    file: &MergeFile,
    locking: Locking,
    pace: Pace<'_>,
    reopen: &Reopen,
) -> Result<(u64, u64), Error> {
    // The view at layer `last`, read through a chain whose top it is (the
    // index of the whole chain covers it too, but a lookup through the top
    // is decided by the layers above).
    // A copy reads each mapping once: small caches (a daemon merging
    // keeps its own memory bounded).
    let mut options = ChainOptions {
        locking,
        cache_size: COPY_CACHE,
        backing_root: reopen.root.clone(),
        ..ChainOptions::default()
    };
    let probe = reopen.checked(Chain::open(last_path, &options)?)?;
    let masks_ends = has_short_layers(&probe, range.first);
    let source = if masks_ends {
        drop(probe);
        options.use_index = false;
        reopen.checked(Chain::open(last_path, &options)?)?
    } else {
        probe
    };
    // The temporary file, opened by name in the directory it was made in,
    // checked to be the file made before anything is written.
    let target = Chain::open_at(
        file.image.tmp_place(),
        file.image.id(),
        &ChainOptions {
            writable: true,
            locking,
            cache_size: COPY_CACHE,
            // Its own index is built once it is filled.
            stale_index_expected: true,
            backing_root: reopen.root.clone(),
            ..ChainOptions::default()
        },
    )?;
    let copied = ViewCopy {
        source: &source,
        from: range.first,
        target: &target,
        zeros: if range.first.0 > 0 {
            Zeros::Write
        } else {
            Zeros::Skip
        },
        masks_ends,
    }
    .run(pace)?;
    // The merged layers' bitmaps, merged by name (as libvirt merges a
    // committed layer's into its base's).
    let skipped = target.bitmaps().take_in_from(&source, range.first)?;
    if !skipped.is_empty() {
        tracing::warn!(
            ?skipped,
            "inconsistent or incompatible bitmaps not carried into the merged layer"
        );
    }
    target.close()?;
    Ok((copied.data_bytes, copied.zero_bytes))
}

/// A merge under way: its range checked, its file created under the
/// temporary name (removed if this is dropped before
/// [`PreparedMerge::publish`]).
#[must_use = "a prepared merge is removed unless published"]
pub struct PreparedMerge {
    file: MergeFile,
    range: MergeRange,
    reopen: Reopen,
    last_path: PathBuf,
    above: PathBuf,
    above_id: Option<(u64, u64)>,
    above_backing: (Vec<u8>, Option<String>),
    replaced: Vec<PathBuf>,
    layers_before: usize,
}

/// The backing name and format the layer at `at` records.
fn recorded_backing(chain: &Chain, at: LayerIndex) -> (Vec<u8>, Option<String>) {
    let layer = &chain.layers()[at.0];
    let format = layer.header().and_then(|h| {
        h.extensions.iter().find_map(|e| match e {
            crate::extension::HeaderExtension::BackingFormat(f) => Some(f.clone()),
            _ => None,
        })
    });
    (crate::chain::backing_name_of(layer), format)
}

/// Where a merge switches: the file of the layer above the merged ones,
/// by path and identity.
fn layer_id(chain: &Chain, at: LayerIndex) -> Option<(u64, u64)> {
    chain.layers()[at.0].storage().file_id()
}

/// Checks `first..=last` of `chain` (below its top) and creates the merge
/// file `output`, empty, under its temporary name. Only headers of
/// `chain` are used: a daemon calls this with the chain it serves.
pub fn prepare_merge(
    chain: &Chain,
    first: &LayerRef,
    last: &LayerRef,
    output: &Path,
    root: Option<&Path>,
) -> Result<PreparedMerge, Error> {
    let range = merge_range(chain, first, last)?;
    let above_at = LayerIndex(range.last.0 + 1);
    let above = &chain.layers()[above_at.0];
    if let Layer::Qcow2(q) = above {
        if q.shared_elsewhere() {
            // Its header names the merged file at the switch: the other
            // chains reading it would find their backing file changed.
            return Err(super::invalid(
                above.path(),
                "another disk this process serves reads this layer: its backing file cannot change"
                    .into(),
            ));
        }
    }
    let file = create_merge_file(chain, &range, output, root)?;
    let reopen = Reopen {
        root: root.map(Path::to_path_buf),
        ids: chain.layers()[..=range.last.0]
            .iter()
            .map(|l| l.storage().file_id())
            .collect(),
    };
    Ok(PreparedMerge {
        reopen,
        last_path: chain.layers()[range.last.0].path().to_path_buf(),
        above: chain.layers()[above_at.0].path().to_path_buf(),
        above_id: layer_id(chain, above_at),
        above_backing: recorded_backing(chain, above_at),
        replaced: chain.layers()[range.first.0..=range.last.0]
            .iter()
            .map(|l| l.path().to_path_buf())
            .collect(),
        layers_before: chain.layers().len(),
        file,
        range,
    })
}

impl PreparedMerge {
    /// The merged layers' files, lowest first.
    pub fn replaced(&self) -> &[PathBuf] {
        &self.replaced
    }

    /// The lowest and highest layer merged.
    pub fn range(&self) -> (LayerIndex, LayerIndex) {
        (self.range.first, self.range.last)
    }

    /// Copies the merged layers' view into the file (every layer it reads
    /// is immutable: the copy finishes whatever the guest does). `pace`
    /// is called as it goes with `(done, total, bytes just written)` and
    /// cancels it by returning `false`. Returns the bytes written as data
    /// and as zeros.
    pub fn fill(&self, locking: Locking, pace: Pace<'_>) -> Result<(u64, u64), Error> {
        fill_merge_file(
            &self.last_path,
            &self.range,
            &self.file,
            locking,
            pace,
            &self.reopen,
        )
    }

    /// Makes the file visible under its name, durable, then builds its
    /// own index (when it has a backing file). Nothing references it
    /// yet: [`MergedFile::switch_in`] (live) or the offline merge switches
    /// the layer above onto it. `cancelled` stops the index build (as
    /// for [`crate::indexing::build_index`]); on a failure the file is
    /// removed (with its index).
    pub fn publish(
        self,
        locking: Locking,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<MergedFile, Error> {
        let backing = self.file.backing().map(Path::to_path_buf);
        let created = self.file.image.publish()?;
        let merged = MergedFile {
            merged: created.path(),
            range: self.range,
            created,
            backing,
            above: self.above,
            above_id: self.above_id,
            above_backing: self.above_backing,
            replaced: self.replaced,
            layers_before: self.layers_before,
            layers_after: self.layers_before - (self.range.last.0 - self.range.first.0),
        };
        if merged.backing.is_some() {
            if let Err(e) = self
                .reopen
                .build_index(&merged.created, self.range, locking, cancelled)
            {
                merged.remove();
                return Err(e);
            }
        }
        Ok(merged)
    }
}

impl Reopen {
    /// Builds the index of the merge file `created` (opened by name in the
    /// directory it was made in, checked to be the file made; the layers
    /// below it checked to be the chain's layers below the range).
    fn build_index(
        &self,
        created: &CreatedFile,
        range: MergeRange,
        locking: Locking,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Option<BuildReport>, Error> {
        let chain = Chain::open_at(
            created.place(),
            created.id(),
            &ChainOptions {
                locking,
                stale_index_expected: true,
                backing_root: self.root.clone(),
                ..ChainOptions::default()
            },
        )?;
        let below = Reopen {
            root: None,
            ids: self.ids[..range.first.0].to_vec(),
        };
        for (layer, id) in chain.layers().iter().zip(&below.ids) {
            if layer.storage().file_id() != *id || id.is_none() {
                return Err(Error::new(layer.path(), ErrorKind::FileReplaced));
            }
        }
        crate::indexing::build_index(&chain, locking, &mut |_, _| {}, cancelled)
    }
}

/// A complete merge file, not yet in the chain.
#[derive(Debug, Clone)]
pub struct MergedFile {
    merged: PathBuf,
    /// The layers merged (positions in the chain).
    range: MergeRange,
    /// The file made (removed by identity).
    created: CreatedFile,
    backing: Option<PathBuf>,
    above: PathBuf,
    above_id: Option<(u64, u64)>,
    above_backing: (Vec<u8>, Option<String>),
    replaced: Vec<PathBuf>,
    layers_before: usize,
    layers_after: usize,
}

impl MergedFile {
    /// The new file.
    pub fn path(&self) -> &Path {
        &self.merged
    }

    /// The layers it replaces once switched in, lowest first.
    pub fn replaced(&self) -> &[PathBuf] {
        &self.replaced
    }

    /// Checks that `new`, the chain opened after the switch, is `old` with
    /// the merged layers replaced by the merge file: each layer the same
    /// file (device and inode) as the one it must be. Another file put at
    /// a name meanwhile is refused, named.
    pub fn check_switched(&self, old: &Chain, new: &Chain) -> Result<(), Error> {
        let ids =
            |c: &Chain| -> Vec<_> { c.layers().iter().map(|l| l.storage().file_id()).collect() };
        let before = ids(old);
        let (first, last) = (self.range.first.0, self.range.last.0);
        let mut want = before[..first].to_vec();
        want.push(Some(self.created.id()));
        want.extend_from_slice(&before[last + 1..]);
        let got = ids(new);
        if got.len() != want.len() {
            return Err(Error::new(
                new.top().path(),
                ErrorKind::Io(std::io::Error::other(format!(
                    "the chain has {} layers after the switch, {} expected",
                    got.len(),
                    want.len()
                ))),
            ));
        }
        match got
            .iter()
            .zip(&want)
            .position(|(g, w)| g != w || g.is_none())
        {
            Some(i) => Err(Error::new(new.layers()[i].path(), ErrorKind::FileReplaced)),
            None => Ok(()),
        }
    }

    /// Removes the file (no chain references it: not switched in) and its
    /// index, each only if it is still the file made (the index: sqcow2's
    /// own), so that a retry can use the name.
    pub fn remove(&self) {
        let index = crate::sidefile::index_name(self.created.place().name());
        if let Err(e) = crate::sidefile::remove_index(self.created.dir(), &index) {
            tracing::warn!(error = %e, "could not remove the merge file's index");
        }
        self.created.remove();
    }

    /// Layers of the chain after the switch.
    pub fn layers_after(&self) -> usize {
        self.layers_after
    }

    fn backing_edit(&self) -> PathBuf {
        backing_name_for(&self.above, &self.merged)
    }

    /// Switches the layer above the merged ones onto the merge file, in
    /// the chain a daemon serves (its image locks held: the layer is
    /// rewritten without taking any; the top through its writer, whose
    /// feature words cannot change meanwhile). Call with requests paused
    /// and the chain flushed; then open the chain again: this one still
    /// has the merged layers. An error may come after the header was
    /// written: [`MergedFile::switch_back`] undoes it.
    pub fn switch_in(&self, chain: &Chain) -> Result<(), Error> {
        let name = self.backing_edit();
        self.set_above_backing(
            chain,
            std::os::unix::ffi::OsStrExt::as_bytes(name.as_os_str()),
            Some("qcow2"),
        )
    }

    /// Puts back the backing file the layer above recorded before
    /// [`MergedFile::switch_in`] (the chain it names is unchanged: the
    /// merged files are never written).
    pub fn switch_back(&self, chain: &Chain) -> Result<(), Error> {
        let (name, format) = &self.above_backing;
        self.set_above_backing(chain, name, format.as_deref())
    }

    fn set_above_backing(
        &self,
        chain: &Chain,
        name: &[u8],
        format: Option<&str>,
    ) -> Result<(), Error> {
        let at = chain
            .layers()
            .iter()
            .position(|l| l.storage().file_id() == self.above_id && self.above_id.is_some())
            .ok_or_else(|| {
                invalid(
                    &self.above,
                    "the layer above the merged ones is no longer in the chain".into(),
                )
            })?;
        let edit = AreaEdit {
            index: Edit::Keep,
            backing: Edit::Set(crate::header_area::BackingName { name, format }),
            fixed: crate::header_area::Edit::Keep,
            feature_table: None,
            bitmaps: crate::header_area::Edit::Keep,
        };
        if LayerIndex(at) == chain.top_index() && chain.is_writable() {
            chain.active()?.rewrite_header_area(&edit)
        } else {
            let name = Path::new(std::ffi::OsStr::from_bytes(name));
            HeaderWriter::of_layer(&chain.layers()[at], Locking::Off)?
                .set_backing(Some((name, format)))
        }
    }

    fn report(self, data_bytes: u64, zero_bytes: u64, index: Option<BuildReport>) -> MergeReport {
        MergeReport {
            merged: self.merged,
            backing: self.backing,
            switched: self.above,
            replaced: self.replaced,
            layers_before: self.layers_before,
            layers_after: self.layers_after,
            data_bytes,
            zero_bytes,
            index,
        }
    }
}

/// Merges layers `first..=last` of the chain under `image` into the new
/// file `output` (backing onto layer `first - 1`), switches the layer
/// above `last` onto it and rebuilds the top's index. A crash leaves the
/// old chain (with, at most, `<output>.tmp` or an unreferenced `output`)
/// or the new one; a crash after the switch leaves an index that its
/// fingerprints show stale, rebuilt by the next writer.
pub fn merge(
    options: &MergeOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<MergeReport, Error> {
    let locking = options.locking;
    let chain = Chain::open(
        &options.image,
        &ChainOptions {
            locking,
            inspect_only: true,
            ..ChainOptions::default()
        },
    )?;
    let prepared = prepare_merge(&chain, &options.first, &options.last, &options.output, None)?;
    let image_id = chain.top().storage().file_id();
    drop(chain);
    // The layer switched at the end, locked now: a chain served by a
    // daemon is refused before the copy.
    let switch = HeaderWriter::open_expecting(&prepared.above, locking, prepared.above_id)?;
    let (data_bytes, zero_bytes) = prepared.fill(locking, &mut |done, total, _| {
        progress(done, total);
        true
    })?;
    let merged = prepared.publish(locking, &|| false)?;
    switch.set_backing(Some((&merged.backing_edit(), Some("qcow2"))))?;
    drop(switch);
    let index = rebuild_index(&options.image, locking, &|| false, image_id)?;
    Ok(merged.report(data_bytes, zero_bytes, index))
}
