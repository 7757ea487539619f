//! How a top names its chain index, and how an index is matched to the
//! layers of a chain: the sQcow2 header extension, layer fingerprints, the
//! sQcow2 autoclear bit.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use crate::extension::HeaderExtension;
use crate::header::{field, Header, Version};
use crate::index::{ChainIndex, LayerFingerprint, Stale, AUTOCLEAR_SQCOW2, EXT_SQCOW2};
use crate::layer::Layer;
use crate::storage::{FileStorage, Storage};

/// Whether a chain is read through its index, and why not.
#[derive(Debug, Clone, Serialize)]
#[serde(
    tag = "state",
    rename_all = "kebab-case",
    rename_all_fields = "kebab-case"
)]
pub enum IndexState {
    /// The top names no index.
    None,
    /// The index is valid and used.
    Valid {
        /// Index file.
        path: PathBuf,
        /// Layers covered.
        layers: usize,
        /// Layers above the covered ones, below the top, walked until the
        /// top's own index is built (an index of an older top serves).
        pending: usize,
        /// Size of the index file.
        bytes: u64,
        /// Chunk size.
        granularity: u64,
    },
    /// The top names an index that is not used.
    Stale {
        /// Index file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Indexes were disabled by the caller.
    Disabled,
}

/// The index file named by a header's sQcow2 extension, if any.
pub(crate) fn index_name(header: &Header) -> Option<PathBuf> {
    header.extensions.iter().find_map(|e| match e {
        HeaderExtension::Unknown { ext_type, data }
            if *ext_type == EXT_SQCOW2 && data.len() > 8 =>
        {
            Some(PathBuf::from(OsStr::from_bytes(&data[8..])))
        }
        _ => None,
    })
}

/// Fingerprints of layers `0..=upto`, each named as the layer above writes
/// it (`names[i]` for the layer right above `upto`, passed by the caller).
pub(crate) fn fingerprints(
    layers: &[Layer],
    upto: usize,
    top_name: &[u8],
) -> Vec<LayerFingerprint> {
    (0..=upto)
        .map(|i| {
            let layer = &layers[i];
            let name = if i == upto {
                top_name.to_vec()
            } else {
                layers[i + 1]
                    .header()
                    .and_then(|h| h.backing_file.as_ref())
                    .map(|p| p.as_os_str().as_bytes().to_vec())
                    .unwrap_or_default()
            };
            let (format, (header_hash, l1_hash)) = match layer {
                Layer::Qcow2(q) => (0, q.fingerprint()),
                Layer::Raw(_) => (1, (0, 0)),
            };
            LayerFingerprint {
                format,
                virtual_size: layer.virtual_size(),
                file_size: layer.file_size(),
                header_hash,
                l1_hash,
                name,
            }
        })
        .collect()
}

/// Whether each layer `0..=upto` still carries the sQcow2 autoclear bit
/// (layers that cannot carry one, raw and qcow2 v2, count as carrying it).
pub(crate) fn autoclear_flags(layers: &[Layer], upto: usize) -> Vec<bool> {
    layers[..=upto]
        .iter()
        .map(|l| match l.header() {
            Some(h) if h.version == Version::V3 => h.features.autoclear & AUTOCLEAR_SQCOW2 != 0,
            _ => true,
        })
        .collect()
}

/// The largest chunk size (log2) that every layer `0..=upto` maps
/// uniformly: their smallest subcluster.
pub(crate) fn granularity_bits(layers: &[Layer], upto: usize) -> u32 {
    layers[..=upto]
        .iter()
        .filter_map(|l| l.header())
        .map(|h| h.geometry.subcluster_size().trailing_zeros())
        .min()
        .unwrap_or(16)
}

/// Most layers walked above an index of an older top: beyond, walking
/// the chain costs as much as the index saves.
pub(crate) const MAX_PENDING_LAYERS: usize = 64;

/// Opens the index the top names and checks it against the layers below.
/// When it is missing or stale (a crash before a new top's index was
/// built, say), the nearest layer below whose own index is valid lends
/// its index, which covers the layers below that layer: the layers in
/// between are walked (at most [`MAX_PENDING_LAYERS`]). No usable index
/// is a warning unless `stale_expected` (the caller rebuilds it).
/// Indexes are opened inside `root` when one is set (a daemon's backing
/// root): beside each layer's file (its real location, read from the
/// descriptor the chain opened), resolved and checked before they are
/// opened, as backing files are.
pub(crate) fn open_index(
    layers: &[Layer],
    stale_expected: bool,
    root: Option<&Path>,
) -> (Option<(ChainIndex, usize)>, IndexState) {
    let root = root.and_then(|r| crate::backing::BackingRoot::open(r).ok());
    let root = root.as_ref();
    let top = layers.len() - 1;
    let Some(path) = named_index(&layers[top]) else {
        return (None, IndexState::None);
    };
    let reason = match open_index_of(layers, top, root) {
        Ok(index) => {
            let state = valid_state(&path, &index, top);
            return (Some((index, top - 1)), state);
        }
        Err(reason) => reason,
    };
    for owner in (1..top).rev().take(MAX_PENDING_LAYERS) {
        let Some(lower) = named_index(&layers[owner]) else {
            continue;
        };
        if let Ok(index) = open_index_of(layers, owner, root) {
            tracing::info!(
                index = %path.display(), %reason, lent_by = %lower.display(),
                pending = top - owner,
                "chain index of the top not usable: the index of a layer below serves"
            );
            let state = valid_state(&lower, &index, top);
            return (Some((index, owner - 1)), state);
        }
    }
    if stale_expected {
        tracing::info!(index = %path.display(), %reason, "chain index not used until it is rebuilt: walking the chain");
    } else if reason == Stale::NotWritten && top <= MAX_PENDING_LAYERS {
        // Not written yet (a snapshot defers it) over a chain no longer
        // than a lent index may leave to walk: nothing an operator must
        // chase.
        tracing::info!(index = %path.display(), %reason, layers = top + 1, "chain index not written yet: walking the chain");
    } else {
        tracing::warn!(index = %path.display(), %reason, "chain index not used: walking the chain");
    }
    (
        None,
        IndexState::Stale {
            path,
            reason: reason.to_string(),
        },
    )
}

/// Where the index `layer` names lies (in the layer's directory: a name
/// that is not one path component is refused when the index is opened).
fn named_index(layer: &Layer) -> Option<PathBuf> {
    let name = layer.header().and_then(index_name)?;
    // Beside the file the chain opened (its real location, read from its
    // descriptor: no name resolved again), where its writer made it.
    let at = layer
        .storage()
        .pinned_file()
        .ok()
        .flatten()
        .and_then(|p| crate::storage::real_path(&p.file).ok())
        .unwrap_or_else(|| {
            crate::sidefile::side_files_path(layer.path())
                .unwrap_or_else(|_| layer.path().to_path_buf())
        });
    Some(match at.parent() {
        Some(dir) => dir.join(&name),
        None => name,
    })
}

fn valid_state(path: &Path, index: &ChainIndex, top: usize) -> IndexState {
    let covered = index.layers().len();
    IndexState::Valid {
        path: path.to_path_buf(),
        layers: covered,
        pending: top - covered,
        bytes: index.file_size(),
        granularity: index.geometry().chunk_size(),
    }
}

/// Opens the index that layer `owner` names, which must cover exactly the
/// layers below it as they are now.
fn open_index_of(
    layers: &[Layer],
    owner: usize,
    root: Option<&crate::backing::BackingRoot>,
) -> Result<ChainIndex, Stale> {
    let Some(path) = named_index(&layers[owner]) else {
        return Err(Stale::NotIndexed);
    };
    if !layers[owner]
        .header()
        .and_then(index_name)
        .is_some_and(|n| crate::sidefile::dir::is_plain_name(n.as_os_str()))
    {
        return Err(Stale::Missing(
            "the index name is not a file name in the image's directory".into(),
        ));
    }
    if owner < 1 {
        return Err(Stale::LayerCount {
            indexed: 0,
            actual: 0,
        });
    }
    let file = match root {
        Some(root) => root.open_file(&path).map_err(|r| match r {
            crate::backing::RootRefusal::Io(e) => Stale::from_open_error(&e),
            crate::backing::RootRefusal::Outside(real) => {
                Stale::Missing(format!("{} lies outside the backing root", real.display()))
            }
        })?,
        None => crate::sidefile::open_side_file(&path).map_err(|e| Stale::from_open_error(&e))?,
    };
    let storage: Arc<dyn Storage> = Arc::new(FileStorage::from_file(file));
    let index = ChainIndex::open(&path, storage)?;
    let upto = owner - 1;
    let top_name = layers[owner]
        .header()
        .and_then(|h| h.backing_file.as_ref())
        .map(|p| p.as_os_str().as_bytes().to_vec())
        .unwrap_or_default();
    let actual = fingerprints(layers, upto, &top_name);
    index.matches(
        &actual,
        &autoclear_flags(layers, upto),
        layers[owner].virtual_size(),
        granularity_bits(layers, upto),
    )?;
    Ok(index)
}

/// Sets the sQcow2 autoclear bit of a qcow2 v3 image (durably), the
/// word's other bits kept as the file has them now: a header read earlier
/// may be older (a live snapshot's old top, whose close cleared its
/// journal's bit after this process read it).
pub(crate) fn set_autoclear_bit(storage: &dyn Storage) -> std::io::Result<()> {
    let bits = autoclear_word(storage)? | AUTOCLEAR_SQCOW2;
    crate::header_area::write_word(storage, field::AUTOCLEAR_FEATURES, bits)
}

/// The autoclear feature word as the image's file has it now.
pub(crate) fn autoclear_word(storage: &dyn Storage) -> std::io::Result<u64> {
    let mut word = [0u8; 8];
    storage.read_at(&mut word, field::AUTOCLEAR_FEATURES as u64)?;
    Ok(u64::from_be_bytes(word))
}

/// Rewrites the header area so that it names `index` (relative to the
/// image's directory): extensions are re-laid out as QEMU does, the backing
/// name moved after them. Fails if it does not fit the first cluster.
pub(crate) fn write_index_extension(
    storage: &dyn Storage,
    header: &Header,
    index: &Path,
) -> std::io::Result<()> {
    crate::header_area::rewrite(
        storage,
        header,
        &crate::header_area::AreaEdit {
            index: crate::header_area::Edit::Set(index),
            backing: crate::header_area::Edit::Keep,
            fixed: crate::header_area::Edit::Keep,
            feature_table: None,
            bitmaps: crate::header_area::Edit::Keep,
        },
    )
}

/// Makes the new image name its index (`N.sqidx`) in its header (the
/// header area rewritten as QEMU lays it out), before it is published.
pub(crate) fn name_index_of(image: &crate::sidefile::NewImage) -> Result<(), crate::error::Error> {
    use crate::error::{Error, ErrorKind};
    let tmp = image.tmp_path();
    let e = |io: std::io::Error| Error::new(&tmp, ErrorKind::Io(io));
    let storage = image.writable_storage().map_err(e)?;
    let header = Header::read(&storage).map_err(|k| Error::new(&tmp, k))?;
    let index = crate::sidefile::index_name(image.name());
    write_index_extension(&storage, &header, Path::new(&index)).map_err(e)
}
