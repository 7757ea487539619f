//! Operations that create chain indexes: `upgrade` (index a vanilla chain
//! in place), `snapshot` (a new top over the current one, with its index),
//! and `verify_index` (compare an index with a fresh walk).

use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use crate::chain::{Chain, ChainOptions};
use crate::create::{create, CreateOptions};
use crate::error::{Error, ErrorKind};
use crate::header::Version;
use crate::index::{encode_index, IndexEntry};
use crate::layer::Layer;
use crate::lock::{LockRequest, Locking};
use crate::sqcow2_ext::{fingerprints, set_autoclear_bit, write_index_extension, IndexState};
use crate::storage::FileStorage;
use crate::types::LayerIndex;

/// Callback for long operations: `(done, total)`.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::new(path, ErrorKind::Io(e))
}

/// Writes `bytes` to `path` atomically: a temporary file, fsync, rename,
/// fsync of the directory.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let tmp = path.with_extension("sqidx.tmp");
    {
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        std::io::Write::write_all(&mut f, bytes).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    sync_dir(path)
}

fn sync_dir(path: &Path) -> Result<(), Error> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(&dir))
}

/// The index file name for an image: `<image file name>.sqidx`.
fn index_file_name(image: &Path) -> PathBuf {
    let mut name = image.file_name().unwrap_or_default().to_os_string();
    name.push(".sqidx");
    PathBuf::from(name)
}

/// Where the index of `image` lives: `<image>.sqidx` beside it.
pub fn index_path_of(image: &Path) -> PathBuf {
    image.with_file_name(index_file_name(image))
}

/// Sets the sQcow2 autoclear bit on layers `0..=upto` that lack it; each
/// one written is locked as a writer first (an image another process
/// reads or writes is not touched).
fn mark_layers(chain: &Chain, upto: usize, locking: Locking) -> Result<(), Error> {
    for layer in &chain.layers()[..=upto] {
        let Layer::Qcow2(q) = layer else { continue };
        let header = q.header();
        if header.version == Version::V3
            && header.features.autoclear & crate::index::AUTOCLEAR_SQCOW2 == 0
        {
            layer
                .storage()
                .lock(LockRequest::WRITER, locking)
                .map_err(|k| Error::new(layer.path(), k))?;
            let storage = FileStorage::open_read_write(layer.path()).map_err(|e| {
                Error::new(
                    layer.path(),
                    ErrorKind::Io(std::io::Error::new(
                        e.kind(),
                        format!("cannot mark the layer as indexed: {e}"),
                    )),
                )
            })?;
            set_autoclear_bit(&storage, header).map_err(io_err(layer.path()))?;
        }
    }
    Ok(())
}

/// What `upgrade` did.
#[derive(Debug, Clone, Serialize)]
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
    let (geometry, entries) =
        chain.index_entries(LayerIndex(upto), chain.virtual_size(), progress)?;
    let top_layer = chain.top();
    let Some(header) = top_layer.header() else {
        return Err(Error::new(top, ErrorKind::BadMagic(0)));
    };
    let top_name = header
        .backing_file
        .as_ref()
        .map(|p| p.as_os_str().as_bytes().to_vec())
        .unwrap_or_default();
    let fps = fingerprints(chain.layers(), upto, &top_name);
    let bytes = encode_index(geometry, &fps, &entries);
    let name = index_file_name(top);
    let index_path = top.with_file_name(&name);
    top_layer
        .storage()
        .lock(LockRequest::WRITER, locking)
        .map_err(|k| Error::new(top, k))?;
    write_atomically(&index_path, &bytes)?;
    mark_layers(&chain, upto, locking)?;
    let storage = FileStorage::open_read_write(top).map_err(io_err(top))?;
    write_index_extension(&storage, header, &name).map_err(io_err(top))?;
    Ok(UpgradeReport {
        index: Some(index_path),
        layers: upto + 1,
        chunks: geometry.chunks(),
        bytes: bytes.len() as u64,
    })
}

/// `path` relative to directory `base` (both as given; `..` as needed).
fn relative_to(path: &Path, base: &Path) -> PathBuf {
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
pub struct SnapshotReport {
    /// The new active volume.
    pub new: PathBuf,
    /// Its backing file name, as written.
    pub backing: PathBuf,
    /// Its index file.
    pub index: PathBuf,
    /// Whether the old top's index was used (O(1) lookups) or the chain
    /// had to be walked.
    pub incremental: bool,
}

/// Creates `new` over `top` exactly as `qemu-img create -b TOP -F qcow2
/// NEW` would (same size and cluster size as the top), plus its index.
/// Atomic: `new` appears (by rename) only once complete. The chain is
/// locked as a reader, and a layer whose header gains the index bit as a
/// writer (`Locking::Off` for a caller that holds the locks itself).
pub fn snapshot(
    top: &Path,
    new: &Path,
    locking: Locking,
    progress: Progress,
) -> Result<SnapshotReport, Error> {
    if new.exists() {
        return Err(Error::new(
            new,
            ErrorKind::Io(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "refusing to overwrite an existing file",
            )),
        ));
    }
    let chain = Chain::open(
        top,
        &ChainOptions {
            locking,
            ..ChainOptions::default()
        },
    )?;
    let incremental = chain.is_indexed() || chain.layers().len() == 1;
    let top_index = chain.top_index();
    let Some(top_header) = chain.top().header() else {
        return Err(Error::new(top, ErrorKind::BadMagic(0)));
    };
    let new_dir = new.parent().unwrap_or(Path::new(""));
    let backing = if top.is_absolute() {
        top.to_path_buf()
    } else {
        relative_to(top, new_dir)
    };
    let size = chain.virtual_size();
    let (geometry, entries) = chain.index_entries(top_index, size, progress)?;
    let fps = fingerprints(chain.layers(), top_index.0, backing.as_os_str().as_bytes());
    let bytes = encode_index(geometry, &fps, &entries);
    let name = index_file_name(new);
    let index_path = new.with_file_name(&name);
    write_atomically(&index_path, &bytes)?;
    mark_layers(&chain, top_index.0, locking)?;

    let tmp = new.with_extension("qcow2.tmp");
    let opts = CreateOptions {
        size,
        cluster_size: top_header.geometry.cluster_size(),
        extended_l2: top_header.geometry.extended_l2,
        compression_type: top_header.compression_type,
        lazy_refcounts: top_header.lazy_refcounts(),
        backing_file: Some(backing.clone()),
        backing_format: Some("qcow2".into()),
        ..CreateOptions::default()
    };
    create(&tmp, &opts)?;
    let storage = FileStorage::open_read_write(&tmp).map_err(io_err(&tmp))?;
    let header = crate::check::read_header(&storage).map_err(|k| Error::new(&tmp, k))?;
    write_index_extension(&storage, &header, &name).map_err(io_err(&tmp))?;
    drop(storage);
    OpenOptions::new()
        .write(true)
        .open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, new).map_err(io_err(new))?;
    sync_dir(new)?;
    Ok(SnapshotReport {
        new: new.to_path_buf(),
        backing,
        index: index_path,
        incremental,
    })
}

/// Result of comparing an index with a fresh walk of the chain.
#[derive(Debug, Clone, Serialize)]
pub struct IndexVerification {
    /// The index state as opened.
    pub state: IndexState,
    /// Chunks compared.
    pub chunks: u64,
    /// Chunks whose entry differs from the walk.
    pub mismatches: u64,
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
    let state = indexed.index_state().clone();
    if !indexed.is_indexed() {
        return Ok(IndexVerification {
            state,
            chunks: 0,
            mismatches: 0,
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
    let upto = LayerIndex(walked.top_index().0 - 1);
    let (geometry, expected) = walked.index_entries(upto, walked.virtual_size(), &mut |_, _| {})?;
    let mut mismatches = 0;
    let mut examples = Vec::new();
    for (chunk, want) in expected.iter().enumerate() {
        let got = indexed.index_entry(chunk as u64);
        let same = match (got, want) {
            (Some(g), w) => g == *w || matches!((g, w), (IndexEntry::Walk, _)),
            (None, _) => false,
        };
        if !same {
            mismatches += 1;
            if examples.len() < 10 {
                examples.push(format!(
                    "chunk {chunk} (guest offset {:#x}): index says {got:?}, the chain {want:?}",
                    chunk as u64 * geometry.chunk_size()
                ));
            }
        }
    }
    Ok(IndexVerification {
        state,
        chunks: expected.len() as u64,
        mismatches,
        examples,
    })
}
