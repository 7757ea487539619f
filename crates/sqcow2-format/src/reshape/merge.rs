//! `merge`: the view of layers i..j written into one new qcow2 file whose
//! backing is layer i-1, then layer j+1 switched onto it. No existing
//! layer's data is written; the layers it replaces are left in place.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::chain::{Chain, ChainOptions};
use crate::create::{create, CreateOptions};
use crate::error::{Error, ErrorKind};
use crate::header_area::{AreaEdit, Edit};
use crate::indexing::{index_file_name, io_err, sync_dir, BuildReport};
use crate::layer::Layer;
use crate::lock::Locking;
use crate::storage::FileStorage;
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

/// The layers `first..=last` of a chain, checked for a merge.
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
    Ok(MergeRange { first, last })
}

/// The new file of a merge, created and synced under a temporary name
/// (`<output>.tmp`), backing onto layer `first - 1`, naming its own
/// (deferred) index. Removed when dropped unless published.
#[must_use = "a merge file is removed unless published"]
pub(crate) struct MergeFile {
    tmp: PathBuf,
    output: PathBuf,
    backing: Option<PathBuf>,
    published: bool,
}

impl MergeFile {
    /// The temporary file (written by the copy).
    pub(crate) fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// Its backing file name.
    pub(crate) fn backing(&self) -> Option<&Path> {
        self.backing.as_deref()
    }

    /// Makes the file visible under its name (synced, renamed, directory
    /// synced).
    pub(crate) fn publish(mut self) -> Result<PathBuf, Error> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&self.tmp)
            .and_then(|f| f.sync_all())
            .map_err(io_err(&self.tmp))?;
        std::fs::rename(&self.tmp, &self.output).map_err(io_err(&self.output))?;
        self.published = true;
        sync_dir(&self.output)?;
        Ok(self.output.clone())
    }
}

impl Drop for MergeFile {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_file(&self.tmp);
            let mut journal = self.tmp.as_os_str().to_owned();
            journal.push(".sqjournal");
            let _ = std::fs::remove_file(journal);
        }
    }
}

/// The temporary name of a merge file being written: a file of this name
/// is a merge that did not finish (it is never referenced by a chain).
pub fn merge_tmp_path(output: &Path) -> PathBuf {
    let mut name = output.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// Creates the (empty) merge file for `range` of `chain` under its
/// temporary name. A temporary file left by a merge that died is removed
/// first; an existing `output` is refused.
pub(crate) fn create_merge_file(
    chain: &Chain,
    range: &MergeRange,
    output: &Path,
) -> Result<MergeFile, Error> {
    if output.exists() {
        return Err(Error::new(
            output,
            ErrorKind::Io(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "refusing to overwrite an existing file",
            )),
        ));
    }
    let tmp = merge_tmp_path(output);
    if tmp.exists() {
        tracing::warn!(path = %tmp.display(), "removing the file of a merge that did not finish");
        std::fs::remove_file(&tmp).map_err(io_err(&tmp))?;
    }
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
    let file = MergeFile {
        tmp: tmp.clone(),
        output: output.to_path_buf(),
        backing,
        published: false,
    };
    create(&tmp, &opts)?;
    if file.backing.is_some() {
        // The new layer names its own index (written later): the top's
        // index can then be built from it.
        let storage = FileStorage::open_read_write(&tmp).map_err(io_err(&tmp))?;
        let header = crate::check::read_header(&storage).map_err(|k| Error::new(&tmp, k))?;
        let name = index_file_name(output);
        let _ = std::fs::remove_file(output.with_file_name(&name));
        crate::header_area::rewrite(
            &storage,
            &header,
            &AreaEdit {
                index: Edit::Set(&name),
                backing: Edit::Keep,
            },
        )
        .map_err(io_err(&tmp))?;
    }
    Ok(file)
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
) -> Result<(u64, u64), Error> {
    // The view at layer `last`, read through a chain whose top it is (the
    // index of the whole chain covers it too, but a lookup through the top
    // is decided by the layers above).
    let mut options = ChainOptions {
        locking,
        ..ChainOptions::default()
    };
    let probe = Chain::open(last_path, &options)?;
    let masks_ends = has_short_layers(&probe, range.first);
    let source = if masks_ends {
        drop(probe);
        options.use_index = false;
        Chain::open(last_path, &options)?
    } else {
        probe
    };
    let target = Chain::open(
        file.tmp(),
        &ChainOptions {
            writable: true,
            locking,
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
    target.close()?;
    Ok((copied.data_bytes, copied.zero_bytes))
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
    let range = merge_range(&chain, &options.first, &options.last)?;
    let layers_before = chain.layers().len();
    let above = chain.layers()[range.last.0 + 1].path().to_path_buf();
    let replaced: Vec<PathBuf> = chain.layers()[range.first.0..=range.last.0]
        .iter()
        .map(|l| l.path().to_path_buf())
        .collect();
    let last_path = chain.layers()[range.last.0].path().to_path_buf();
    let file = create_merge_file(&chain, &range, &options.output)?;
    drop(chain);
    // The layer switched at the end, locked now: a chain served by a
    // daemon is refused before the copy.
    let switch = HeaderWriter::open(&above, locking)?;
    let (data_bytes, zero_bytes) =
        fill_merge_file(&last_path, &range, &file, locking, &mut |done, total, _| {
            progress(done, total);
            true
        })?;
    let backing = file.backing().map(Path::to_path_buf);
    let merged = file.publish()?;
    let name = backing_name_for(&above, &merged);
    switch.set_backing(Some((&name, Some("qcow2"))))?;
    drop(switch);
    let merged_index = if backing.is_some() {
        rebuild_index(&merged, locking)?
    } else {
        None
    };
    drop(merged_index);
    let index = rebuild_index(&options.image, locking)?;
    Ok(MergeReport {
        merged,
        backing,
        switched: above,
        replaced,
        layers_before,
        layers_after: layers_before - (range.last.0 - range.first.0),
        data_bytes,
        zero_bytes,
        index,
    })
}
