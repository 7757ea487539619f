//! `rebase`: a new backing file for an image, as `qemu-img rebase`. In
//! the default (safe) mode every cluster the image does not hold and whose
//! content differs between the old and the new backing file is copied
//! into the image first, so that the image reads the same; `-u` only
//! rewrites the name.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::chain::{Chain, ChainOptions, ExtentKind};
use crate::error::{Error, ErrorKind};
use crate::indexing::{io_err, BuildReport};
use crate::layer::Layer;
use crate::lock::{LockRequest, Locking};
use crate::storage::{FileStorage, Storage};
use crate::types::{GuestOffset, LayerIndex};

use super::commit::settle;
use super::copy::RateLimit;
use super::{find_layer, invalid, rebuild_index, HeaderWriter, LayerRef};

/// Largest run compared at once.
const CHUNK: u64 = 4 << 20;

/// What to rebase.
#[derive(Debug, Clone)]
pub struct RebaseOptions {
    /// The image whose backing file changes.
    pub image: PathBuf,
    /// The new backing file as it is to be recorded (relative names are
    /// relative to the image's directory); `None` (`-b ""`): no backing
    /// file, the image then holds its whole view.
    pub backing: Option<PathBuf>,
    /// Its format (`-F`): required with a backing file, as in QEMU 7.2.
    pub format: Option<String>,
    /// Only rewrite the name (`-u`).
    pub unsafe_names_only: bool,
    /// Most bytes per second written.
    pub rate_limit: Option<u64>,
    /// Image locks.
    pub locking: Locking,
    /// Share every permission on the new backing file, which is only read
    /// (qemu-img's `-U`): another process may write it meanwhile.
    pub force_share: bool,
}

/// What a rebase did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct RebaseReport {
    /// Guest bytes copied into the image from the old backing chain.
    pub copied_bytes: u64,
    /// The image's index, rebuilt.
    pub index: Option<BuildReport>,
}

/// The content a new backing file gives.
enum NewView {
    Chain(Box<Chain>),
    Raw(FileStorage, u64),
    Zeros,
}

impl NewView {
    fn size(&self) -> u64 {
        match self {
            NewView::Chain(c) => c.virtual_size(),
            NewView::Raw(_, n) => *n,
            NewView::Zeros => 0,
        }
    }

    /// Reads `buf.len()` bytes at `pos`, zeros past the end.
    fn read(&self, buf: &mut [u8], pos: u64, path: &Path) -> Result<(), Error> {
        let n = (buf.len() as u64).min(self.size().saturating_sub(pos)) as usize;
        buf[n..].fill(0);
        if n == 0 {
            return Ok(());
        }
        match self {
            NewView::Chain(c) => c.read_at(&mut buf[..n], pos),
            NewView::Raw(f, _) => f.read_at(&mut buf[..n], pos).map_err(io_err(path)),
            NewView::Zeros => Ok(()),
        }
    }
}

fn open_new_view(
    path: &Path,
    format: &str,
    locking: Locking,
    force_share: bool,
) -> Result<NewView, Error> {
    match format {
        "qcow2" => Ok(NewView::Chain(Box::new(Chain::open(
            path,
            &ChainOptions {
                locking,
                force_share,
                ..ChainOptions::default()
            },
        )?))),
        _ => {
            let storage = FileStorage::open_read_only(path).map_err(io_err(path))?;
            let lock = if force_share {
                LockRequest::READER.sharing_all()
            } else {
                LockRequest::READER
            };
            storage
                .lock(lock, locking)
                .map_err(|k| Error::new(path, k))?;
            let len = storage.len().map_err(io_err(path))?;
            Ok(NewView::Raw(storage, len))
        }
    }
}

/// Rebases the image, as `qemu-img rebase`.
pub fn rebase(
    options: &RebaseOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RebaseReport, Error> {
    let image = &options.image;
    let locking = options.locking;
    let format = match (&options.backing, options.format.as_deref()) {
        (Some(b), None) => {
            return Err(invalid(
                image,
                format!(
                    "could not change the backing file to '{}': backing format must be specified",
                    b.display()
                ),
            ))
        }
        (Some(_), Some(f @ ("qcow2" | "raw"))) => Some(f),
        (Some(_), Some(f)) => {
            return Err(invalid(
                image,
                format!("backing format '{f}' is not supported"),
            ))
        }
        (None, _) => None,
    };
    let writer = HeaderWriter::open(image, locking)?;
    // Every later open of the image by name must find this file.
    let image_id = writer.id();
    let new_path = options.backing.as_ref().map(|b| {
        if b.is_absolute() {
            b.clone()
        } else {
            image.parent().unwrap_or(Path::new("")).join(b)
        }
    });
    let mut copied_bytes = 0;
    if !options.unsafe_names_only {
        drop(writer);
        settle(image, locking, image_id)?;
        copied_bytes = copy_differences(options, new_path.as_deref(), format, progress, image_id)?;
        let writer = HeaderWriter::open_expecting(image, locking, image_id)?;
        set_name(&writer, options, format)?;
    } else {
        set_name(&writer, options, format)?;
        drop(writer);
    }
    let index = match rebuild_index(image, locking, &|| false, image_id) {
        Ok(index) => index,
        // Unsafe mode only renames: the new backing file may not exist
        // yet (QEMU does not open it either). The rename is done; the
        // index, now stale, is rebuilt when the chain can be opened.
        Err(e) if options.unsafe_names_only && e.concerns_the_backing_chain_of(image) => {
            tracing::warn!(
                "{}: backing file renamed; chain index not rebuilt: {e}",
                image.display()
            );
            None
        }
        // `-U`: the new backing file is another process's to write; an
        // index of it is not built under that writer (the rebase itself
        // is done, as QEMU's). The index, stale, is rebuilt when the chain
        // can be opened (`sqcow2 upgrade`, the next `serve`).
        Err(e) if options.force_share && matches!(e.kind, ErrorKind::Locked { .. }) => {
            tracing::warn!(
                "{}: rebased; chain index not rebuilt while another process writes the new backing file: {e}",
                image.display()
            );
            None
        }
        Err(e) => return Err(e),
    };
    Ok(RebaseReport {
        copied_bytes,
        index,
    })
}

fn set_name(
    writer: &HeaderWriter,
    options: &RebaseOptions,
    format: Option<&str>,
) -> Result<(), Error> {
    match &options.backing {
        Some(b) => writer.set_backing(Some((b, format))),
        None => writer.set_backing(None),
    }
}

/// Safe mode: copies into the image every cluster it does not hold whose
/// content differs between the old backing chain and the new backing
/// file. Returns the bytes written.
fn copy_differences(
    options: &RebaseOptions,
    new_path: Option<&Path>,
    format: Option<&str>,
    progress: &mut dyn FnMut(u64, u64),
    image_id: Option<crate::sidefile::FileId>,
) -> Result<u64, Error> {
    let image = &options.image;
    let locking = options.locking;
    let chain = Chain::open_expecting(
        image,
        image_id,
        &ChainOptions {
            writable: true,
            locking,
            ..ChainOptions::default()
        },
    )?;
    let top = chain.top_index();
    // The new backing file as a layer of the old chain: wherever that
    // layer or one below it decides the old view, both views agree.
    let same_below: Option<LayerIndex> = match (new_path, format) {
        (Some(p), Some(f)) => find_layer(&chain, &LayerRef::File(p.to_path_buf()))
            .ok()
            .filter(|m| {
                m.0 < top.0
                    && matches!(
                        (&chain.layers()[m.0], f),
                        (Layer::Qcow2(_), "qcow2") | (Layer::Raw(_), "raw")
                    )
            }),
        _ => None,
    };
    let new = match (new_path, format) {
        (Some(p), Some(f)) => open_new_view(p, f, locking, options.force_share)?,
        _ => NewView::Zeros,
    };
    let new_name = new_path.unwrap_or(Path::new(""));
    let size = chain.virtual_size();
    let cluster = chain.cluster_size();
    let mut old = vec![0u8; CHUNK as usize];
    let mut fresh = vec![0u8; CHUNK as usize];
    let mut limit = options.rate_limit.map(RateLimit::new);
    let mut written = 0u64;
    let mut pos = 0u64;
    while pos < size {
        let e = chain.resolve(GuestOffset(pos), (size - pos).min(CHUNK), false)?;
        let n = e.len;
        let decided_below_new = same_below.is_some_and(|m| e.layer.0 <= m.0);
        // Zeros past the end of a shorter layer below are the backing
        // chain's, though the walk names the top as deciding them.
        let in_top = e.layer == top
            && !matches!(
                e.kind,
                ExtentKind::Zero {
                    allocated: false,
                    ..
                }
            );
        if !in_top && !decided_below_new {
            let old = &mut old[..n as usize];
            let fresh = &mut fresh[..n as usize];
            chain.read_at(old, pos)?;
            new.read(fresh, pos, new_name)?;
            // Cluster by cluster of the image, as far as the run goes.
            let mut at = 0u64;
            while at < n {
                let end = ((pos + at) / cluster * cluster + cluster - pos).min(n);
                let (a, b) = (at as usize, end as usize);
                if old[a..b] != fresh[a..b] {
                    if crate::bytes::is_zero(&old[a..b]) {
                        chain.write_zeroes(pos + at, end - at, false)?;
                    } else {
                        chain.write_at(&old[a..b], pos + at)?;
                    }
                    written += end - at;
                    if let Some(l) = &mut limit {
                        l.charge(end - at);
                    }
                }
                at = end;
            }
        }
        pos += n;
        progress(pos, size);
    }
    chain.close()?;
    Ok(written)
}
