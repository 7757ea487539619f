//! Opening a chain: the top first, then each backing file it names, with
//! every bound checked before anything is trusted (chain depth, loops, the
//! backing root, the L1 bytes of all layers together).

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use tracing::debug;

use crate::active::{Active, CacheLink};
use crate::backing::{resolve_backing_path, BackingFormat, BackingRoot, RootRefusal};
use crate::check::Repair;
use crate::error::{Error, ErrorKind, WithPath};
use crate::features::AUTOCLEAR_JOURNAL;
use crate::fence::TransferFence;
use crate::files::{default_budget, FileCache, LazyFile};
use crate::header::{field, QCOW2_MAGIC};
use crate::layer::{Layer, Qcow2Layer, RawLayer};
use crate::lock::Locking;
use crate::sidefile::{FileId, ImagePlace};
use crate::sqcow2_ext::{granularity_bits, open_index, IndexState};
use crate::storage::{open_for_reading, real_path, FileStorage, Storage};
use crate::summary::TopSummary;
use crate::types::{Geometry, LayerIndex};
use sqcow2_cache::{CacheConfig, SliceCache, Source};

use super::covering::IndexInUse;
use super::resolved::ResolvedSlices;
use super::{Chain, ChainOptions};

/// Which format to open the next file with.
enum Expect {
    /// The top image (must be qcow2).
    Top,
    /// A backing file with a recorded format.
    Recorded(BackingFormat),
    /// A backing file without a recorded format (qcow2 if its magic says so).
    Probe,
}

/// An opened file, or storage this process has open already, or a layer
/// another chain of the process shares.
enum Opened {
    File(File),
    Reused(Arc<dyn Storage>),
    Shared(crate::layer::Qcow2Layer),
}

fn open_layer(
    path: &Path,
    file: Option<Opened>,
    expect: Expect,
    options: &ChainOptions,
    files: &Arc<FileCache>,
    top_place: Option<&ImagePlace>,
) -> Result<Layer, ErrorKind> {
    let place = || top_place.ok_or_else(|| ErrorKind::Io(std::io::ErrorKind::NotFound.into()));
    let top = matches!(expect, Expect::Top);
    let want = options.lock_request(top);
    let storage: Arc<dyn Storage> = match (&expect, &options.top_storage, file) {
        (Expect::Top, Some(s), _) => s.clone(),
        // A top to write that was open read-only (an inactive chain, which
        // holds no lock): opened again for writing.
        (Expect::Top, None, Some(Opened::Reused(s))) if options.writable && !s.is_writable() => {
            // The same file (through its descriptor, not its name).
            Arc::new(crate::storage::writable_same_file(&*s, path)?.with_cache(options.cache)?)
        }
        (_, _, Some(Opened::Reused(s))) => s,
        (_, _, Some(Opened::Shared(q))) => q.storage().clone(),
        // Opened for writing in the first place (`open_layers`).
        (Expect::Top, None, Some(Opened::File(file))) if options.writable => {
            Arc::new(FileStorage::from_writable_file(file)?.with_cache(options.cache)?)
        }
        (Expect::Top, _, Some(Opened::File(file))) => {
            Arc::new(FileStorage::from_file(file).with_cache(options.cache)?)
        }
        (Expect::Top, _, None) => {
            Arc::new(FileStorage::from_file(place()?.open_image(false)?).with_cache(options.cache)?)
        }
        // A layer below the top: its descriptor in the chain's cache, the
        // file reopened by its real path when it was closed.
        (_, _, file) => {
            let file = match file {
                Some(Opened::File(f)) => FileStorage::from_file(f),
                _ => FileStorage::open_read_only(path)?,
            }
            .with_cache(options.cache)?;
            file.lock(want, options.locking)?;
            let real = real_path(file.file()).unwrap_or_else(|_| path.to_path_buf());
            LazyFile::adopt(&real, file, want, options.locking, files.clone())?
        }
    };
    // QEMU's image locks, before anything is read.
    storage.lock(want, options.locking)?;
    let is_qcow2 = || -> Result<bool, ErrorKind> {
        let mut magic = [0u8; 4];
        storage.read_at(&mut magic, 0)?;
        Ok(storage.len()? >= 4 && u32::from_be_bytes(magic) == QCOW2_MAGIC)
    };
    match expect {
        Expect::Top => {
            if options.writable {
                // Not written at all when marked corrupt (QEMU opens such
                // an image read-only only).
                if let Ok(header) = crate::header::Header::read_for_check(&*storage) {
                    header.refuse_if_marked_corrupt()?;
                }
                // What a dead writer completed is in the image before any
                // of its tables is read.
                if let Some(place) = top_place {
                    crate::active::replay_journal(place, &*storage)?;
                }
            }
            Ok(Layer::Qcow2(Qcow2Layer::open(path, storage.clone())?))
        }
        Expect::Recorded(BackingFormat::Raw) => Ok(Layer::Raw(RawLayer::open(path, storage)?)),
        Expect::Recorded(BackingFormat::Qcow2) => {
            if !is_qcow2()? {
                return Err(ErrorKind::BackingNotQcow2(path.to_path_buf()));
            }
            Ok(Layer::Qcow2(Qcow2Layer::open_lazily(path, storage)?))
        }
        Expect::Probe => {
            if !is_qcow2()? {
                return Err(ErrorKind::UnknownBackingFormat(path.to_path_buf()));
            }
            Ok(Layer::Qcow2(Qcow2Layer::open_lazily(path, storage)?))
        }
    }
}

/// What a qcow2 v3 image's header says of a writer that left it open.
#[derive(Debug, Clone, Copy)]
struct LeftOpen {
    /// QEMU's corrupt mark is set too: only `check -r` may repair it.
    marked_corrupt: bool,
}

/// Whether the qcow2 v3 image in `file` names a mapping journal: an
/// sqcow2 writer had it open and did not close it (a live snapshot's
/// daemon that died before the old top's close after the switch: its
/// last changes are then only in the journal); QEMU, opening an image
/// for writing,
/// clears that bit. Reads the header's first 96 bytes; anything else says
/// no (the open that follows reports a bad header). An image that is only
/// dirty (a writer with lazy refcounts, or without a journal, that died)
/// is read as QEMU reads a backing file, without a repair: its mappings
/// are all in its tables.
fn journal_left_behind(file: &File) -> Option<LeftOpen> {
    use std::os::unix::fs::FileExt;
    let mut h = [0u8; field::REFCOUNT_ORDER];
    file.read_exact_at(&mut h, 0).ok()?;
    let journal = crate::bytes::be_u32(&h, field::MAGIC) == QCOW2_MAGIC
        && crate::bytes::be_u32(&h, field::VERSION) == 3
        && crate::bytes::be_u64(&h, field::AUTOCLEAR_FEATURES) & AUTOCLEAR_JOURNAL != 0;
    journal.then(|| LeftOpen {
        marked_corrupt: crate::bytes::be_u64(&h, field::INCOMPATIBLE_FEATURES)
            & crate::features::INCOMPAT_CORRUPT
            != 0,
    })
}

/// Repairs the backing layer at `path` (opened as `opened`) that an
/// sqcow2 writer left open: its journal applied, its refcounts repaired,
/// its dirty bit cleared, as for a top ([`crate::check::check`] with a
/// full repair), under a writer's image lock, which fails if any other
/// process uses the image (with automatic locking too: a filesystem
/// without locks gets no repair, the open fails and says why). Before the
/// layer is opened and locked for reading; a read-write open of the chain
/// only.
fn repair_left_open(
    path: &Path,
    opened: &File,
    left: LeftOpen,
    locking: Locking,
    root: Option<&BackingRoot>,
) -> Result<(), Error> {
    // Marked corrupt: only an explicit `check -r` repairs it (as QEMU's
    // opens refuse to write it); not replayed, not read without its
    // journal either.
    if left.marked_corrupt {
        return Err(Error::new(
            path,
            ErrorKind::Unsupported(crate::error::Feature::CorruptBit),
        ));
    }
    tracing::warn!(path = %path.display(), "a backing layer was left open by an sqcow2 writer: repairing it");
    // The file opened (and checked: inside the backing root, not a
    // loop), written through its descriptor, never reopened by its name;
    // its journal read in its directory, opened inside the root when one
    // is set.
    let e = |io: std::io::Error| Error::new(path, ErrorKind::Io(io));
    let storage = crate::storage::writable_same_file(
        &FileStorage::from_file(opened.try_clone().map_err(e)?),
        path,
    )
    .map_err(e)?;
    // Its journal is looked for beside the file opened (its real
    // location, read from the descriptor; inside the root when one is
    // set), never beside a name that points there (a journal put beside a
    // symlink is nobody's), and only if that name still holds the file.
    let real = real_path(opened).map_err(e)?;
    let real_parent = real.parent().unwrap_or(Path::new("/"));
    let name = crate::sidefile::dir::file_name(&real).map_err(e)?;
    let dir = match root {
        Some(root) => crate::sidefile::Dir::beneath(root.dir(), root.path(), real_parent),
        None => crate::sidefile::Dir::open(real_parent),
    }
    .map_err(e)?;
    let here = dir.entry(name).map_err(e)?.map(|entry| entry.id);
    if here.is_none() || here != crate::sidefile::file_id(opened).ok() {
        return Err(Error::new(path, ErrorKind::FileReplaced));
    }
    let place = ImagePlace::new(Arc::new(dir), name.to_os_string());
    let locking = match locking {
        Locking::Off => Locking::Off,
        Locking::Auto | Locking::On => Locking::On,
    };
    storage
        .lock(crate::lock::LockRequest::WRITER, locking)
        .map_err(|k| Error::new(path, k))?;
    let report = crate::check::check_opened(&place, storage, Repair::All)?;
    if report.corruptions > 0 || report.check_errors > 0 {
        return Err(Error::new(
            path,
            ErrorKind::Io(std::io::Error::other(format!(
                "a backing layer left open by a writer could not be repaired: {} corruptions, {} check errors",
                report.corruptions, report.check_errors
            ))),
        ));
    }
    Ok(())
}

/// Opens the files of the chain whose top is `path`, top first. A file
/// that one of `reuse` has open already is not opened again: its storage
/// (and its open file description, which holds the image locks) serves.
fn open_layers(
    path: &Path,
    top_place: Option<&ImagePlace>,
    expect_top: Option<FileId>,
    options: &ChainOptions,
    reuse: Option<&Chain>,
) -> Result<(Vec<Layer>, Arc<FileCache>), Error> {
    let mut top_down: Vec<Layer> = Vec::new();
    // One budget for the chain and the chain it replaces, whose lower
    // layers it reuses.
    let files = match reuse {
        Some(old) => old.files.clone(),
        None => Arc::new(
            FileCache::new(options.max_open_files.unwrap_or_else(default_budget))
                .with_cache(options.cache),
        ),
    };
    // A chain reopened in place of another has the same top: its open
    // file, not whatever is at its name now.
    let old_top = reuse.map(|old| old.top().storage().clone());
    // A shared file's storage is not taken over (its locks are other
    // chains' too, and this chain may open it otherwise: inactive, no
    // locks): a shared one comes from the registry, another is opened.
    let reuse: Vec<Arc<dyn Storage>> = reuse.map_or_else(Vec::new, |old| {
        old.storages
            .iter()
            .filter(|s| {
                !old.layers.iter().any(|l| match l {
                    Layer::Qcow2(q) => q.shares_storage(s),
                    Layer::Raw(_) => false,
                })
            })
            .cloned()
            .collect()
    });
    // Backing files are checked against the root before they are opened.
    let root = match &options.backing_root {
        Some(root) => Some(BackingRoot::open(root).map_err(|e| Error::new(root, e.into()))?),
        None => None,
    };
    let mut seen = HashSet::new();
    let mut remote_seen: HashSet<String> = HashSet::new();
    let mut l1_bytes = 0u64;
    let mut next = Some((path.to_path_buf(), Expect::Top));
    while let Some((current, expect)) = next.take() {
        let referrer = top_down.last().map(|l| l.path().to_path_buf());
        let blame = referrer.clone().unwrap_or_else(|| current.clone());
        if top_down.len() >= options.max_layers {
            return Err(Error::new(
                blame,
                ErrorKind::ChainTooDeep {
                    limit: options.max_layers,
                },
            ));
        }
        let injected = referrer.is_none() && options.top_storage.is_some();
        let remote_url = referrer.as_ref().and(crate::remote::url_of(&current));
        let file = if injected {
            None
        } else if let Some(url) = remote_url {
            // A layer in an object store: no file, no lock (immutable),
            // no backing root (not a path); opened by the opener the
            // operator gave, else refused.
            if !remote_seen.insert(url.to_owned()) {
                return Err(Error::new(blame, ErrorKind::BackingLoop(current)));
            }
            let Some(remote) = &options.remote_layers else {
                return Err(Error::new(blame, ErrorKind::RemoteNotEnabled(url.into())));
            };
            let storage = remote.open(url).map_err(|source| {
                Error::new(
                    &blame,
                    ErrorKind::MissingBacking {
                        backing: current.clone(),
                        source,
                    },
                )
            })?;
            Some(Opened::Reused(storage))
        } else if let (None, Some(old)) = (&referrer, &old_top) {
            let id = old.file_id();
            if id.is_none() || expect_top.is_some_and(|e| Some(e) != id) {
                return Err(Error::new(&current, ErrorKind::FileReplaced));
            }
            seen.insert(id.unwrap_or_default());
            Some(Opened::Reused(old.clone()))
        } else {
            let opened = match (&referrer, &root) {
                (None, _) => match top_place {
                    Some(place) => place.open_image(options.writable),
                    None => Err(std::io::ErrorKind::NotFound.into()),
                },
                (Some(_), None) => open_for_reading(&current),
                (Some(_), Some(root)) => match root.open_file(&current) {
                    Ok(file) => Ok(file),
                    Err(RootRefusal::Io(e)) => Err(e),
                    Err(RootRefusal::Outside(resolved)) => {
                        return Err(Error::new(
                            &blame,
                            ErrorKind::BackingOutsideRoot {
                                backing: current,
                                resolved,
                                root: root.path().to_path_buf(),
                            },
                        ))
                    }
                },
            };
            let file = match opened {
                Ok(f) => f,
                Err(source) if referrer.is_some() => {
                    return Err(Error::new(
                        blame,
                        ErrorKind::MissingBacking {
                            backing: current,
                            source,
                        },
                    ))
                }
                Err(e) => return Err(Error::new(current, ErrorKind::Io(e))),
            };
            let meta = file
                .metadata()
                .map_err(|e| Error::new(&current, e.into()))?;
            // A top that must be a given file (reopened, or made by this
            // process): checked before anything reads or writes it.
            if referrer.is_none() && expect_top.is_some_and(|id| id != (meta.dev(), meta.ino())) {
                return Err(Error::new(&current, ErrorKind::FileReplaced));
            }
            if !seen.insert((meta.dev(), meta.ino())) {
                return Err(Error::new(blame, ErrorKind::BackingLoop(current)));
            }
            // Shared as qcow2 only (a chain that records the file as raw
            // reads it as raw, its own).
            let as_qcow2 = matches!(
                expect,
                Expect::Recorded(BackingFormat::Qcow2) | Expect::Probe
            );
            let shared = match (&referrer, &options.shared_layers) {
                (Some(_), Some(shared)) if as_qcow2 => {
                    shared.get((meta.dev(), meta.ino()), options.shared_mode(), &current)
                }
                _ => None,
            };
            let open = reuse
                .iter()
                .find(|s| s.file_id() == Some((meta.dev(), meta.ino())));
            match (shared, open) {
                (Some(layer), _) => Some(Opened::Shared(layer)),
                (None, Some(s)) => Some(Opened::Reused(s.clone())),
                (None, None) => Some(Opened::File(file)),
            }
        };
        if let (Some(_), Some(Opened::File(f))) = (&referrer, &file) {
            let raw = matches!(expect, Expect::Recorded(BackingFormat::Raw));
            if let Some(left) = journal_left_behind(f).filter(|_| options.writable && !raw) {
                repair_left_open(&current, f, left, options.locking, root.as_ref())?;
            }
        }
        // A lower layer opened fresh is shared with the process's other
        // chains, where they share layers.
        let share = match (&referrer, &options.shared_layers, &file) {
            (Some(_), Some(shared), Some(Opened::File(f))) => {
                f.metadata().ok().map(|m| (shared, (m.dev(), m.ino())))
            }
            _ => None,
        };
        let layer =
            match file {
                Some(Opened::Shared(q)) => Layer::Qcow2(q),
                file => open_layer(&current, file, expect, options, &files, top_place).map_err(
                    |kind| match kind {
                        // The referring image records the wrong format: blame it.
                        ErrorKind::UnknownBackingFormat(_) | ErrorKind::BackingNotQcow2(_) => {
                            Error::new(&blame, kind)
                        }
                        kind => Error::new(&current, kind),
                    },
                )?,
            };
        let layer = match (share, layer) {
            (Some((shared, id)), Layer::Qcow2(q)) => {
                Layer::Qcow2(shared.insert(id, options.shared_mode(), q, &current))
            }
            (_, layer) => layer,
        };
        if let Some(header) = layer.header() {
            if let Some(name) = &header.backing_file {
                let backing = match crate::remote::url_of(&current) {
                    Some(url) => crate::remote::resolve_under_url(url, name.as_os_str().as_bytes()),
                    None => resolve_backing_path(&current, name),
                }
                .with_path(&current)?;
                let format =
                    BackingFormat::from_recorded(header.backing_format()).with_path(&current)?;
                let expect = match format {
                    Some(f) => Expect::Recorded(f),
                    None => Expect::Probe,
                };
                next = Some((backing, expect));
            }
        }
        l1_bytes += layer.header().map_or(0, |h| u64::from(h.l1_size) * 8);
        if l1_bytes > options.max_l1_bytes_total {
            return Err(Error::new(
                &current,
                ErrorKind::ChainMetadataTooLarge {
                    bytes: l1_bytes,
                    limit: options.max_l1_bytes_total,
                },
            ));
        }
        debug!(path = %current.display(), format = layer.format_name(), "opened layer");
        top_down.push(layer);
    }
    top_down.reverse();
    Ok((top_down, files))
}

impl Chain {
    /// Opens the chain whose top image is `path`, following backing files
    /// iteratively, each file locked as QEMU would lock it.
    pub fn open(path: &Path, options: &ChainOptions) -> Result<Chain, Error> {
        Chain::open_with(path, None, None, options, None)
    }

    /// [`Chain::open`], where files that `old` (a chain this one replaces:
    /// after a merge's switch, an activation, a handover) has open
    /// already are used through its storage: the same open file
    /// description keeps its image locks, changed to what this chain
    /// needs, instead of a second open conflicting with the first; and
    /// the lower layers' descriptors stay in one budget with `old`'s.
    ///
    /// The top must be `old`'s top (`path` its path): it is opened by name
    /// in the directory `old` opened, and must still be the same file
    /// (else [`ErrorKind::FileReplaced`], nothing written).
    pub fn open_reusing(path: &Path, options: &ChainOptions, old: &Chain) -> Result<Chain, Error> {
        let place = (path == old.top().path())
            .then(|| old.top_place.clone())
            .flatten();
        let expect = old.top().storage().file_id();
        Chain::open_with(path, place, expect, options, Some(old))
    }

    /// [`Chain::open`] of a top that must be the file `expect` (a file an
    /// operation opened before by the same name): checked before anything
    /// is read or written ([`ErrorKind::FileReplaced`]).
    pub(crate) fn open_expecting(
        path: &Path,
        expect: Option<FileId>,
        options: &ChainOptions,
    ) -> Result<Chain, Error> {
        Chain::open_with(path, None, expect, options, None)
    }

    /// Opens the chain whose top is the image at `place` (its directory
    /// opened already: nothing of its path is resolved again), which must
    /// be the file `expect`: checked before anything is read or written.
    pub(crate) fn open_at(
        place: ImagePlace,
        expect: FileId,
        options: &ChainOptions,
    ) -> Result<Chain, Error> {
        Chain::open_with(&place.path(), Some(place), Some(expect), options, None)
    }

    fn open_with(
        path: &Path,
        place: Option<ImagePlace>,
        expect_top: Option<FileId>,
        options: &ChainOptions,
        reuse: Option<&Chain>,
    ) -> Result<Chain, Error> {
        // The slice arithmetic (cached slices, resolved slices, the
        // index's granularity) assumes a power of two.
        if !options.slice_size.is_power_of_two() || options.slice_size < 512 {
            return Err(Error::new(path, ErrorKind::SliceSize(options.slice_size)));
        }
        if options.force_share && options.writable {
            return Err(Error::new(path, ErrorKind::ForceShareWritable));
        }
        if options.inactive && options.writable {
            return Err(Error::new(path, ErrorKind::ReadOnly));
        }
        // The top's directory, opened once: the top is opened by name in
        // it, and its side files (journal, index) are made there.
        // With a backing root, the top lies inside it too: its directory
        // opened from the root's descriptor (no symlink followed), the top
        // opened by its own name there (a symlink swapped in is refused).
        let find = || match &options.backing_root {
            Some(root) => BackingRoot::open(root).and_then(|root| {
                ImagePlace::beneath(root.dir(), root.path(), path).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::PermissionDenied {
                        std::io::Error::new(
                            e.kind(),
                            format!("lies outside the backing root {}", root.path().display()),
                        )
                    } else {
                        e
                    }
                })
            }),
            None => ImagePlace::of(path),
        };
        let top_place = match place.map_or_else(find, Ok) {
            Ok(place) => Some(place),
            // A top given as storage (tests) may name a directory that
            // does not exist: it has no side files then (no journal).
            Err(_) if options.top_storage.is_some() => None,
            Err(e) => return Err(Error::new(path, e.into())),
        };
        let (layers, files) = open_layers(path, top_place.as_ref(), expect_top, options, reuse)?;
        let (index, index_state) = if options.use_index {
            open_index(
                &layers,
                options.stale_index_expected,
                options.backing_root.as_deref(),
            )
        } else {
            (None, IndexState::Disabled)
        };
        let top_header = layers.last().and_then(|l| l.header());
        let top_geometry = top_header.map_or(
            Geometry {
                cluster_bits: 16,
                extended_l2: false,
            },
            |h| h.geometry,
        );
        // Fine enough for this index and for any index of this chain
        // installed later (whose chunks are at most the smallest
        // subcluster of the layers below the top).
        let resolved_bits = {
            let top_bits = top_geometry.subcluster_size().trailing_zeros();
            let below_bits = match layers.len() {
                0 | 1 => top_bits,
                n => granularity_bits(&layers, n - 2),
            };
            let index_bits = index
                .as_ref()
                .map_or(top_bits, |(i, _)| i.geometry().granularity_bits);
            top_bits.min(below_bits).min(index_bits)
        };
        let summary = match (&index, layers.last()) {
            (Some(_), Some(Layer::Qcow2(q))) => q
                .l1()
                .and_then(|l1| {
                    TopSummary::build(q.header(), l1, &**q.storage(), options.slice_size)
                })
                .ok()
                .map(Arc::new),
            _ => None,
        };
        let cache = Arc::new(SliceCache::new(CacheConfig {
            budget: options.cache_size,
            policy: options.cache_policy,
            ..CacheConfig::default()
        }));
        let active = if options.writable {
            let link = CacheLink {
                cache: cache.clone(),
                source: Source::Layer((layers.len() - 1) as u32),
                slice_size: options.slice_size,
                budget: options.cache_size,
                summary: summary.clone(),
            };
            let top = layers
                .last()
                .ok_or_else(|| Error::new(path, ErrorKind::BadMagic(0)))?;
            let below: Vec<_> = layers[..layers.len() - 1]
                .iter()
                .filter_map(|l| l.storage().file_id())
                .collect();
            Some(Arc::new(
                Active::open(top, layers.len() > 1, link, top_place.clone(), below)?
                    .with_background_write_back(options.background_write_back),
            ))
        } else {
            None
        };
        let remote = layers.iter().any(|l| l.storage().fetches_remotely());
        Ok(Chain {
            data_reads: layers.iter().map(|_| AtomicU64::new(0)).collect(),
            size_floors: Default::default(),
            storages: layers.iter().map(|l| l.storage().clone()).collect(),
            layers,
            files,
            cache,
            slice_size: options.slice_size,
            top_geometry,
            active,
            fence: Arc::new(TransferFence::default()),
            resolved: ResolvedSlices::new(resolved_bits),
            index: arc_swap::ArcSwap::from_pointee(IndexInUse {
                covering: index.map(|(i, upto)| (Arc::new(i), LayerIndex(upto))),
                state: index_state,
            }),
            summary,
            unclosed_below: std::sync::Mutex::new(Vec::new()),
            top_place,
            mirror: Default::default(),
            drain: Default::default(),
            unreadable: Default::default(),
            readahead: remote.then(Box::default),
        })
    }
}
