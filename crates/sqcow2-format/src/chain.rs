//! A backing chain: opened iteratively from the top, read like QEMU reads it.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracing::debug;

use crate::backing::{resolve_backing_path, BackingFormat};
use crate::compressed::decompress;
use crate::entry::CompressedDescriptor;
use crate::error::{Error, ErrorKind, WithPath};
use crate::header::QCOW2_MAGIC;
use crate::l2_cache::L2Cache;
use crate::layer::{Layer, LayerStatus, Qcow2Layer, RawLayer};
use crate::storage::{FileStorage, Storage};
use crate::types::{GuestOffset, HostOffset, LayerIndex};

/// Default limit on the number of layers in a chain.
pub const DEFAULT_MAX_LAYERS: usize = 65535;
/// Default byte budget of the interim L2 table cache.
pub const DEFAULT_L2_CACHE_BYTES: u64 = 32 << 20;

/// How to open a chain.
#[derive(Debug, Clone)]
pub struct ChainOptions {
    /// Most layers a chain may have, the top included.
    pub max_layers: usize,
    /// Byte budget of the L2 table cache.
    pub l2_cache_bytes: u64,
}

impl Default for ChainOptions {
    fn default() -> Self {
        Self {
            max_layers: DEFAULT_MAX_LAYERS,
            l2_cache_bytes: DEFAULT_L2_CACHE_BYTES,
        }
    }
}

/// What a run of guest bytes reads as, and which layer decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentKind {
    /// Data stored uncompressed at a host offset of the deciding layer.
    Data {
        /// Host offset of the first byte.
        host: HostOffset,
    },
    /// A compressed cluster of the deciding layer.
    Compressed(CompressedDescriptor),
    /// Zeros.
    Zero {
        /// Host offset, for preallocated zero clusters and raw holes.
        host: Option<HostOffset>,
        /// Whether a layer records the zeros (false: nothing is allocated,
        /// or the range lies beyond the end of a backing file).
        allocated: bool,
    },
}

/// A run of guest bytes with one mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// First guest byte.
    pub start: GuestOffset,
    /// Length in bytes.
    pub len: u64,
    /// The layer that decided the mapping (the last one looked at).
    pub layer: LayerIndex,
    /// The mapping.
    pub kind: ExtentKind,
}

/// An opened chain; layer 0 is the base, the last layer the top.
#[derive(Debug)]
pub struct Chain {
    layers: Vec<Layer>,
    cache: L2Cache,
}

/// Which format to open the next file with.
enum Expect {
    /// The top image (must be qcow2).
    Top,
    /// A backing file with a recorded format.
    Recorded(BackingFormat),
    /// A backing file without a recorded format (qcow2 if its magic says so).
    Probe,
}

fn open_layer(path: &Path, file: File, expect: Expect) -> Result<Layer, ErrorKind> {
    let storage: Arc<dyn Storage> = Arc::new(FileStorage::from_file(file));
    let is_qcow2 = || -> Result<bool, ErrorKind> {
        let mut magic = [0u8; 4];
        storage.read_at(&mut magic, 0)?;
        Ok(storage.len()? >= 4 && u32::from_be_bytes(magic) == QCOW2_MAGIC)
    };
    match expect {
        Expect::Top => Ok(Layer::Qcow2(Qcow2Layer::open(path, storage.clone())?)),
        Expect::Recorded(BackingFormat::Raw) => Ok(Layer::Raw(RawLayer::open(path, storage)?)),
        Expect::Recorded(BackingFormat::Qcow2) => {
            if !is_qcow2()? {
                return Err(ErrorKind::BackingNotQcow2(path.to_path_buf()));
            }
            Ok(Layer::Qcow2(Qcow2Layer::open(path, storage)?))
        }
        Expect::Probe => {
            if !is_qcow2()? {
                return Err(ErrorKind::UnknownBackingFormat(path.to_path_buf()));
            }
            Ok(Layer::Qcow2(Qcow2Layer::open(path, storage)?))
        }
    }
}

impl Chain {
    /// Opens the chain whose top image is `path`, following backing files
    /// iteratively.
    pub fn open(path: &Path, options: &ChainOptions) -> Result<Chain, Error> {
        let mut top_down: Vec<Layer> = Vec::new();
        let mut seen = HashSet::new();
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
            let file = match File::open(&current) {
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
            if !seen.insert((meta.dev(), meta.ino())) {
                return Err(Error::new(blame, ErrorKind::BackingLoop(current)));
            }
            let layer = open_layer(&current, file, expect).map_err(|kind| match kind {
                // The referring image records the wrong format: blame it.
                ErrorKind::UnknownBackingFormat(_) | ErrorKind::BackingNotQcow2(_) => {
                    Error::new(&blame, kind)
                }
                kind => Error::new(&current, kind),
            })?;
            if let Some(header) = layer.header() {
                if let Some(name) = &header.backing_file {
                    let backing = resolve_backing_path(&current, name).with_path(&current)?;
                    let format = BackingFormat::from_recorded(header.backing_format())
                        .with_path(&current)?;
                    let expect = match format {
                        Some(f) => Expect::Recorded(f),
                        None => Expect::Probe,
                    };
                    next = Some((backing, expect));
                }
            }
            debug!(path = %current.display(), format = layer.format_name(), "opened layer");
            top_down.push(layer);
        }
        top_down.reverse();
        Ok(Chain {
            layers: top_down,
            cache: L2Cache::new(options.l2_cache_bytes),
        })
    }

    /// The layers, base first.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The top layer (the active volume).
    pub fn top(&self) -> &Layer {
        // A chain always has at least its top layer.
        &self.layers[self.layers.len() - 1]
    }

    /// Index of the top layer.
    pub fn top_index(&self) -> LayerIndex {
        LayerIndex(self.layers.len() - 1)
    }

    /// Virtual size of the disk (the top's).
    pub fn virtual_size(&self) -> u64 {
        self.top().virtual_size()
    }

    fn layer_status(
        &self,
        index: LayerIndex,
        guest: GuestOffset,
        max: u64,
        precise: bool,
    ) -> Result<(LayerStatus, u64), Error> {
        let layer = &self.layers[index.0];
        match layer {
            Layer::Qcow2(q) => q
                .status(index, guest, max, &self.cache)
                .with_path(layer.path()),
            Layer::Raw(r) => Ok(r.status(guest, max, precise)),
        }
    }

    /// Resolves the mapping of `[start, start + max)` (which must lie within
    /// the virtual size): the first run with one mapping. `precise` asks
    /// raw layers for their holes (for `map`; reads do not need it).
    pub fn resolve(&self, start: GuestOffset, max: u64, precise: bool) -> Result<Extent, Error> {
        let mut len = max;
        let mut index = self.top_index();
        loop {
            let (status, n) = self.layer_status(index, start, len, precise)?;
            len = n;
            let kind = match status {
                LayerStatus::Data { host } => ExtentKind::Data { host },
                LayerStatus::Compressed(d) => ExtentKind::Compressed(d),
                LayerStatus::Zero { host } => ExtentKind::Zero {
                    host,
                    allocated: true,
                },
                LayerStatus::Unallocated { host } => {
                    let below = index.0.checked_sub(1).map(|i| &self.layers[i]);
                    match below {
                        Some(below) if start.0 < below.virtual_size() => {
                            len = len.min(below.virtual_size() - start.0);
                            index = LayerIndex(index.0 - 1);
                            continue;
                        }
                        _ => ExtentKind::Zero {
                            host,
                            allocated: false,
                        },
                    }
                }
            };
            return Ok(Extent {
                start,
                len,
                layer: index,
                kind,
            });
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), Error> {
        let size = self.virtual_size();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::new(
                self.top().path(),
                ErrorKind::OutOfRange { offset, len, size },
            ));
        }
        Ok(())
    }

    /// Reads guest bytes at `offset` into `buf`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        self.check_range(offset, buf.len() as u64)?;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = GuestOffset(offset + done as u64);
            let extent = self.resolve(pos, (buf.len() - done) as u64, false)?;
            let n = extent.len as usize;
            let out = &mut buf[done..done + n];
            let layer = &self.layers[extent.layer.0];
            match extent.kind {
                ExtentKind::Zero { .. } => out.fill(0),
                ExtentKind::Data { host } => layer
                    .storage()
                    .read_at(out, host.0)
                    .map_err(|e| Error::new(layer.path(), e.into()))?,
                ExtentKind::Compressed(d) => {
                    self.read_compressed(layer, d, pos, out)?;
                }
            }
            done += n;
        }
        Ok(())
    }

    fn read_compressed(
        &self,
        layer: &Layer,
        d: CompressedDescriptor,
        pos: GuestOffset,
        out: &mut [u8],
    ) -> Result<(), Error> {
        let fail = |kind| Error::new(layer.path(), kind);
        let Layer::Qcow2(q) = layer else {
            unreachable!("raw layers have no compressed clusters");
        };
        let header = q.header();
        let file_size = q.file_size();
        if d.offset.0 >= file_size {
            return Err(fail(ErrorKind::CompressedBeyondEof {
                offset: d.offset.0,
                len: d.len,
                file_size,
            }));
        }
        let mut packed = vec![0u8; d.len as usize];
        layer
            .storage()
            .read_at(&mut packed, d.offset.0)
            .map_err(|e| fail(e.into()))?;
        let g = header.geometry;
        let mut cluster = vec![0u8; g.cluster_size() as usize];
        decompress(header.compression_type, &packed, &mut cluster).map_err(|reason| {
            fail(ErrorKind::Decompression {
                offset: d.offset.0,
                algorithm: match header.compression_type {
                    crate::header::CompressionType::Deflate => "deflate",
                    crate::header::CompressionType::Zstd => "zstd",
                },
                reason,
            })
        })?;
        let from = g.offset_in_cluster(pos.0) as usize;
        out.copy_from_slice(&cluster[from..from + out.len()]);
        Ok(())
    }

    /// The whole disk as extents, merged the way `qemu-img map` merges them.
    pub fn map(&self, mut each: impl FnMut(&Extent)) -> Result<(), Error> {
        let size = self.virtual_size();
        let mut pos = 0u64;
        let mut pending: Option<Extent> = None;
        while pos < size {
            let e = self.resolve(GuestOffset(pos), size - pos, true)?;
            pos += e.len;
            match &mut pending {
                Some(p) if mergeable(p, &e) => p.len += e.len,
                _ => {
                    if let Some(p) = pending.replace(e) {
                        each(&p);
                    }
                }
            }
        }
        if let Some(p) = pending {
            each(&p);
        }
        Ok(())
    }
}

/// Whether `next` directly continues `cur` with the same mapping.
fn mergeable(cur: &Extent, next: &Extent) -> bool {
    if cur.layer != next.layer {
        return false;
    }
    match (cur.kind, next.kind) {
        (ExtentKind::Data { host: a }, ExtentKind::Data { host: b }) => a.0 + cur.len == b.0,
        (ExtentKind::Compressed(_), ExtentKind::Compressed(_)) => true,
        (
            ExtentKind::Zero {
                host: a,
                allocated: x,
            },
            ExtentKind::Zero {
                host: b,
                allocated: y,
            },
        ) => {
            x == y
                && match (a, b) {
                    (None, None) => true,
                    (Some(a), Some(b)) => a.0 + cur.len == b.0,
                    _ => false,
                }
        }
        _ => false,
    }
}

/// The path of a layer's backing file as the image names it, resolved.
pub fn backing_path_of(layer: &Layer) -> Option<PathBuf> {
    let header = layer.header()?;
    let name = header.backing_file.as_ref()?;
    resolve_backing_path(layer.path(), name).ok()
}
