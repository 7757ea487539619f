//! Changing the shape of a chain: `commit` (the top's data into a layer
//! below, as `qemu-img commit`), `rebase` (a new backing file, as
//! `qemu-img rebase`) and `merge` (layers i..j into one new file, which
//! replaces them). Each keeps the top's chain index valid: rebuilt from
//! the nearest valid index below once the chain has changed (an index
//! that no longer matches is detected by its fingerprints meanwhile).

mod commit;
mod copy;
mod live_commit;
mod merge;
mod rebase;

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::chain::{Chain, ChainOptions};
use crate::error::{Error, ErrorKind};
use crate::header_area::{AreaEdit, BackingName, Edit};
use crate::indexing::{build_index, io_err, BuildReport};
use crate::layer::Layer;
use crate::lock::{LockRequest, Locking};
use crate::storage::{FileStorage, Storage};
use crate::types::LayerIndex;

pub use commit::{commit, CommitOptions, CommitReport};
pub use copy::{Pace, RateLimit};
pub use live_commit::{prepare_live_commit, LiveCommit, LiveCopied};
pub use merge::{merge, prepare_merge, MergeOptions, MergeReport, MergedFile, PreparedMerge};
pub use rebase::{rebase, RebaseOptions, RebaseReport};

/// A layer of a chain, as an operator names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerRef {
    /// By position: 0 is the base.
    Position(usize),
    /// By file (compared with each layer's file, symlinks resolved).
    File(PathBuf),
}

impl std::str::FromStr for LayerRef {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.parse::<usize>() {
            Ok(n) => LayerRef::Position(n),
            Err(_) => LayerRef::File(PathBuf::from(s)),
        })
    }
}

impl std::fmt::Display for LayerRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerRef::Position(n) => write!(f, "layer {n}"),
            LayerRef::File(p) => write!(f, "{}", p.display()),
        }
    }
}

fn invalid(path: &Path, msg: String) -> Error {
    Error::new(path, ErrorKind::InvalidArgument(msg))
}

/// The position of `layer` in `chain`.
pub fn find_layer(chain: &Chain, layer: &LayerRef) -> Result<LayerIndex, Error> {
    let top = chain.top().path();
    match layer {
        LayerRef::Position(n) if *n < chain.layers().len() => Ok(LayerIndex(*n)),
        LayerRef::Position(n) => Err(invalid(
            top,
            format!(
                "the chain has {} layers: no layer {n}",
                chain.layers().len()
            ),
        )),
        LayerRef::File(p) => {
            let want = std::fs::canonicalize(p).map_err(io_err(p))?;
            chain
                .layers()
                .iter()
                .position(|l| std::fs::canonicalize(l.path()).is_ok_and(|c| c == want))
                .map(LayerIndex)
                .ok_or_else(|| {
                    invalid(
                        top,
                        format!("'{}' is not in the chain of this image", p.display()),
                    )
                })
        }
    }
}

/// The format name a backing file is recorded with.
fn format_name(layer: &Layer) -> &'static str {
    match layer {
        Layer::Qcow2(_) => "qcow2",
        Layer::Raw(_) => "raw",
    }
}

/// How the image at `image` names `target` as its backing file: relative
/// to the image's directory unless `target` is absolute.
fn backing_name_for(image: &Path, target: &Path) -> PathBuf {
    if target.is_absolute() {
        return target.to_path_buf();
    }
    crate::indexing::relative_to(target, image.parent().unwrap_or(Path::new("")))
}

/// The qcow2 image at `path` opened for a header rewrite, locked as a
/// writer (taken before the work whose result it records, so that a
/// conflict is found first).
pub(crate) struct HeaderWriter {
    path: PathBuf,
    storage: FileStorage,
}

impl HeaderWriter {
    pub(crate) fn open(path: &Path, locking: Locking) -> Result<HeaderWriter, Error> {
        HeaderWriter::open_expecting(path, locking, None)
    }

    /// A writer of the header of `layer`, a layer of a chain this process
    /// has open: the same file (through its descriptor, not its name),
    /// locked as a writer.
    pub(crate) fn of_layer(
        layer: &crate::layer::Layer,
        locking: Locking,
    ) -> Result<HeaderWriter, Error> {
        let path = layer.path();
        let storage =
            crate::storage::writable_same_file(&**layer.storage(), path).map_err(io_err(path))?;
        storage
            .lock(LockRequest::WRITER, locking)
            .map_err(|k| Error::new(path, k))?;
        crate::header::Header::read(&storage).map_err(|k| Error::new(path, k))?;
        Ok(HeaderWriter {
            path: path.to_path_buf(),
            storage,
        })
    }

    /// [`HeaderWriter::open`] of a layer that must be the file `expect`
    /// (a layer of a chain opened before): checked before anything is
    /// written or locked.
    pub(crate) fn open_expecting(
        path: &Path,
        locking: Locking,
        expect: Option<(u64, u64)>,
    ) -> Result<HeaderWriter, Error> {
        let storage = FileStorage::open_read_write(path).map_err(io_err(path))?;
        if expect.is_some() && storage.file_id() != expect {
            return Err(Error::new(path, crate::error::ErrorKind::FileReplaced));
        }
        storage
            .lock(LockRequest::WRITER, locking)
            .map_err(|k| Error::new(path, k))?;
        // An image marked corrupt is refused here, before any work whose
        // end would edit it (a merge's copy, a rebase's).
        crate::header::Header::read(&storage).map_err(|k| Error::new(path, k))?;
        Ok(HeaderWriter {
            path: path.to_path_buf(),
            storage,
        })
    }

    /// The file's identity.
    pub(crate) fn id(&self) -> Option<(u64, u64)> {
        self.storage.file_id()
    }

    /// Rewrites the backing file name and format (the header area in one
    /// write, synced); `None` removes the backing file.
    pub(crate) fn set_backing(&self, backing: Option<(&Path, Option<&str>)>) -> Result<(), Error> {
        let path = &self.path;
        let header = crate::header::Header::read(&self.storage).map_err(|k| Error::new(path, k))?;
        let edit = AreaEdit {
            index: Edit::Keep,
            backing: match backing {
                Some((name, format)) => Edit::Set(BackingName {
                    name: name.as_os_str().as_bytes(),
                    format,
                }),
                None => Edit::Remove,
            },
            fixed: crate::header_area::Edit::Keep,
            feature_table: None,
            bitmaps: crate::header_area::Edit::Keep,
        };
        crate::header_area::rewrite(&self.storage, &header, &edit).map_err(io_err(path))
    }
}

/// Rebuilds the chain index the image at `top` names, if any, after an
/// operation outside this module changed what it covers (a resize of the
/// top): the rebuild commit and rebase run with the top opened afresh.
pub fn rebuild_named_index(top: &Path, locking: Locking) -> Result<Option<BuildReport>, Error> {
    rebuild_index(top, locking, &|| false, None)
}

/// Rebuilds the index the image at `top` names, if any, after its chain
/// changed (from the nearest valid index below, or a walk); `cancelled`
/// as for [`build_index`]. Where the index goes holding a file that is
/// not sqcow2's index, the operation before stands: the index is not
/// rebuilt (a warning names the file; the chain is walked).
/// `expect`: the top's file, when the operation opened it before.
fn rebuild_index(
    top: &Path,
    locking: Locking,
    cancelled: &dyn Fn() -> bool,
    expect: Option<(u64, u64)>,
) -> Result<Option<BuildReport>, Error> {
    let chain = Chain::open_expecting(
        top,
        expect,
        &ChainOptions {
            locking,
            stale_index_expected: true,
            ..ChainOptions::default()
        },
    )?;
    match build_index(&chain, locking, &mut |_, _| {}, cancelled) {
        Err(e) if matches!(e.kind, crate::error::ErrorKind::NameInUse { .. }) => {
            tracing::warn!("chain index not rebuilt (the chain is walked): {e}");
            Ok(None)
        }
        other => other,
    }
}
