//! `commit`: the data of the layers above a base written into the base, as
//! `qemu-img commit` does; the top emptied afterwards unless asked not to.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use crate::chain::{Chain, ChainOptions};
use crate::check::{check_storage, Repair};
use crate::error::{Error, ErrorKind};
use crate::indexing::{io_err, BuildReport};
use crate::layer::Layer;
use crate::lock::{LockRequest, Locking};
use crate::storage::{FileStorage, Storage};
use crate::types::LayerIndex;

use super::copy::{has_short_layers, CopyTarget, RateLimit, RawTarget, ViewCopy, Zeros};
use super::{find_layer, invalid, rebuild_index, LayerRef};
use crate::sidefile::FileId;

/// What to commit.
#[derive(Debug, Clone)]
pub struct CommitOptions {
    /// The image whose data is committed (`qemu-img commit IMAGE`).
    pub image: PathBuf,
    /// The layer written (`-b BASE`); the image's backing file by default.
    pub base: Option<LayerRef>,
    /// Leave the image as it is (`-d`); implied by `base`.
    pub keep: bool,
    /// Most bytes per second written (`-r`).
    pub rate_limit: Option<u64>,
    /// Image locks.
    pub locking: Locking,
}

/// What a commit did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct CommitReport {
    /// The layer written.
    pub base: PathBuf,
    /// Guest bytes written with data.
    pub data_bytes: u64,
    /// Guest bytes written as zeros.
    pub zero_bytes: u64,
    /// Whether the image was emptied.
    pub emptied: bool,
    /// The image's index, rebuilt.
    pub index: Option<BuildReport>,
}

/// Opens and closes `path` for writing if a writer left it dirty or with
/// a journal (replayed and repaired as any read-write open does), so that
/// what follows reads and changes a consistent image. `expect`: the file
/// it must be (an operation's earlier open); returns the file's identity.
pub(super) fn settle(
    path: &Path,
    locking: Locking,
    expect: Option<FileId>,
) -> Result<Option<FileId>, Error> {
    let storage = FileStorage::open_read_only(path).map_err(io_err(path))?;
    let id = storage.file_id();
    if expect.is_some() && id != expect {
        return Err(Error::new(path, ErrorKind::FileReplaced));
    }
    let Ok(header) = crate::header::Header::read(&storage) else {
        return Ok(id); // raw, or refused later with a proper error
    };
    let journal = header.features.autoclear & crate::features::AUTOCLEAR_JOURNAL != 0;
    if header.is_dirty() || journal {
        drop(storage);
        let chain = Chain::open_expecting(
            path,
            id,
            &ChainOptions {
                writable: true,
                locking,
                ..ChainOptions::default()
            },
        )?;
        chain.close()?;
    }
    Ok(id)
}

/// Opens `path` for writing; refused unless it is the file `expect` (an
/// operation's earlier open), before anything is written.
fn open_writable_expecting(path: &Path, expect: Option<FileId>) -> Result<FileStorage, Error> {
    let storage = FileStorage::open_read_write(path).map_err(io_err(path))?;
    if expect.is_some() && storage.file_id() != expect {
        return Err(Error::new(path, ErrorKind::FileReplaced));
    }
    Ok(storage)
}

/// Makes the qcow2 image at `path` empty, as QEMU's `make_empty`: every
/// active L1 entry cleared in one write, then the clusters that freed
/// given back by a leak repair (a crash between the two leaves leaks,
/// never a wrong read).
fn make_empty(path: &Path, locking: Locking, expect: Option<FileId>) -> Result<(), Error> {
    let storage = open_writable_expecting(path, expect)?;
    storage
        .lock(LockRequest::WRITER, locking)
        .map_err(|k| Error::new(path, k))?;
    let header = crate::header::Header::read(&storage).map_err(|k| Error::new(path, k))?;
    let zeros = vec![0u8; header.l1_size as usize * 8];
    storage
        .write_at(&zeros, header.l1_table_offset)
        .and_then(|()| storage.sync())
        .map_err(io_err(path))?;
    let storage: Arc<dyn Storage> = Arc::new(storage);
    check_storage(path, storage, Repair::Leaks)?;
    Ok(())
}

/// Grows the qcow2 image at `path` to `size` bytes where its L1 table
/// can address them without moving ([`crate::resize`]). Images with
/// internal snapshots are not resized here; growing past the table's
/// clusters is not done.
fn grow(path: &Path, size: u64, locking: Locking, expect: Option<FileId>) -> Result<(), Error> {
    let unsupported = || {
        Error::new(
            path,
            ErrorKind::Unsupported(crate::error::Feature::CommitGrowsBase),
        )
    };
    let storage = open_writable_expecting(path, expect)?;
    storage
        .lock(LockRequest::WRITER, locking)
        .map_err(|k| Error::new(path, k))?;
    let header = crate::header::Header::read(&storage).map_err(|k| Error::new(path, k))?;
    // Bitmaps would have to grow with it (the commit writes the base
    // closed, not through a writer that keeps them).
    if header.nb_snapshots > 0 || header.has_bitmaps() {
        return Err(unsupported());
    }
    match crate::resize::grow_in_place(&storage, &header, size) {
        Ok(_) => Ok(()),
        Err(ErrorKind::Unsupported(_)) => Err(unsupported()),
        Err(k) => Err(Error::new(path, k)),
    }
}

/// The layer a commit writes.
enum CommitTarget {
    Qcow2(Box<Chain>),
    Raw(RawTarget),
}

impl CommitTarget {
    fn as_copy_target(&self) -> &dyn CopyTarget {
        match self {
            CommitTarget::Qcow2(chain) => chain.as_ref(),
            CommitTarget::Raw(raw) => raw,
        }
    }

    /// Makes what was written durable.
    fn close(self) -> Result<(), Error> {
        match self {
            CommitTarget::Qcow2(chain) => chain.close(),
            CommitTarget::Raw(raw) => raw.storage.sync().map_err(io_err(&raw.path)),
        }
    }
}

/// Opens the raw base at `path` for a commit, locked as a writer, grown
/// to `size` bytes if it is shorter (as QEMU's commit truncates its base
/// up to the image's length; the new range reads zeros).
fn open_raw_base(
    path: &Path,
    size: u64,
    locking: Locking,
    expect: Option<FileId>,
) -> Result<RawTarget, Error> {
    let storage = open_writable_expecting(path, expect)?;
    storage
        .lock(LockRequest::WRITER, locking)
        .map_err(|k| Error::new(path, k))?;
    if storage.len().map_err(io_err(path))? < size {
        storage.set_len(size).map_err(io_err(path))?;
    }
    Ok(RawTarget {
        path: path.to_path_buf(),
        storage,
    })
}

/// Commits the image's data into its backing file (or `base`), as
/// `qemu-img commit`.
pub fn commit(
    options: &CommitOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<CommitReport, Error> {
    let image = &options.image;
    let locking = options.locking;
    // Every later open of the image and of the base by name must find
    // the file opened first (another file put at a name meanwhile is
    // refused before anything is written into it).
    let image_id = settle(image, locking, None)?;
    let inspect = Chain::open_expecting(
        image,
        image_id,
        &ChainOptions {
            locking,
            inspect_only: true,
            ..ChainOptions::default()
        },
    )?;
    if inspect.layers().len() < 2 {
        return Err(invalid(image, "image does not have a backing file".into()));
    }
    // The top is emptied at the end (unless `-d`, which QEMU refuses as
    // well): an image marked corrupt is refused before any copy.
    if let Some(header) = inspect.top().header() {
        header
            .refuse_if_marked_corrupt()
            .map_err(|k| Error::new(image, k))?;
    }
    let base = match &options.base {
        Some(b) => {
            let at = find_layer(&inspect, b).map_err(|_| {
                invalid(
                    image,
                    format!(
                        "did not find '{b}' in the backing chain of '{}'",
                        image.display()
                    ),
                )
            })?;
            if at == inspect.top_index() {
                return Err(invalid(image, "the base is the image itself".into()));
            }
            at
        }
        None => LayerIndex(inspect.top_index().0 - 1),
    };
    let emptied = options.base.is_none() && !options.keep;
    let base_layer = &inspect.layers()[base.0];
    let base_path = base_layer.path().to_path_buf();
    let base_is_raw = matches!(base_layer, Layer::Raw(_));
    let size = inspect.virtual_size();
    let old_size = base_layer.virtual_size();
    let grows = old_size < size;
    let base_has_backing = base.0 > 0;
    let base_id = base_layer.storage().file_id();
    drop(inspect);
    let target = if base_is_raw {
        CommitTarget::Raw(open_raw_base(&base_path, size, locking, base_id)?)
    } else {
        settle(&base_path, locking, base_id)?;
        if grows {
            // As QEMU: a base smaller than the image grows to its size.
            grow(&base_path, size, locking, base_id)?;
        }
        let chain = Chain::open_expecting(
            &base_path,
            base_id,
            &ChainOptions {
                writable: true,
                locking,
                ..ChainOptions::default()
            },
        )?;
        if grows && base_has_backing {
            // The grown range reads zeros, not the base's backing file
            // (QEMU zeroes it for the same reason).
            chain.write_zeroes(old_size, size - old_size, false)?;
        }
        CommitTarget::Qcow2(Box::new(chain))
    };
    // The source shares everything (the base is written by `target`
    // through another descriptor); the layers above the base are then
    // locked as what they are to the commit. Its index covers the base,
    // which this commit now writes: found stale, as expected (rebuilt at
    // the end).
    let open_source = |use_index| {
        Chain::open_expecting(
            image,
            image_id,
            &ChainOptions {
                locking,
                force_share: true,
                use_index,
                stale_index_expected: true,
                ..ChainOptions::default()
            },
        )
    };
    let from = LayerIndex(base.0 + 1);
    let mut source = open_source(true)?;
    let masks_ends = has_short_layers(&source, from);
    if masks_ends {
        drop(source);
        source = open_source(false)?;
    }
    for (i, layer) in source.layers().iter().enumerate().skip(from.0) {
        let want = if i == source.top_index().0 && emptied {
            LockRequest::WRITER
        } else {
            LockRequest::READER
        };
        layer
            .storage()
            .lock(want, locking)
            .map_err(|k| Error::new(layer.path(), k))?;
    }
    let mut limit = options.rate_limit.map(RateLimit::new);
    let copied = ViewCopy {
        source: &source,
        from,
        target: target.as_copy_target(),
        zeros: Zeros::Write,
        masks_ends,
    }
    .run(&mut |done, total, written| {
        if let Some(l) = &mut limit {
            l.charge(written);
        }
        progress(done, total);
        true
    })?;
    target.close()?;
    drop(source);
    if emptied {
        make_empty(image, locking, image_id)?;
    }
    let index = rebuild_index(image, locking, &|| false, image_id)?;
    Ok(CommitReport {
        base: base_path,
        data_bytes: copied.data_bytes,
        zero_bytes: copied.zero_bytes,
        emptied,
        index,
    })
}
