//! Copying the part of a chain's view that some layers decide into the top
//! of another chain: the data path of commit and merge.

use std::path::{Path, PathBuf};

use crate::chain::{Chain, ExtentKind};
use crate::error::{Error, ErrorKind};
use crate::indexing::io_err;
use crate::storage::{FileStorage, Storage};
use crate::types::{GuestOffset, LayerIndex};

/// Largest run read and written at once.
const CHUNK: u64 = 4 << 20;

/// What becomes of ranges the copied layers record as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Zeros {
    /// Written as zeros: the target has data below (a backing file, or
    /// its own clusters) that they must hide.
    Write,
    /// Left alone: the target reads zeros there already.
    Skip,
}

/// Where a copy writes: the top of a writable chain, or a raw file.
pub(crate) trait CopyTarget {
    /// Writes `buf` at guest offset `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), Error>;
    /// Makes `len` bytes at `offset` read as zeros.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), Error>;
    /// The file written (for errors).
    fn path(&self) -> &Path;
}

impl CopyTarget for Chain {
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), Error> {
        Chain::write_at(self, buf, offset)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), Error> {
        Chain::write_zeroes(self, offset, len, false)
    }
    fn path(&self) -> &Path {
        self.top().path()
    }
}

/// A raw file written in place (guest offset = file offset), as QEMU's
/// raw driver does.
pub(crate) struct RawTarget {
    pub path: PathBuf,
    pub storage: FileStorage,
}

impl CopyTarget for RawTarget {
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), Error> {
        self.storage
            .write_at(buf, offset)
            .map_err(io_err(&self.path))
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), Error> {
        self.storage
            .write_zeroes(offset, len)
            .map_err(io_err(&self.path))
    }
    fn path(&self) -> &Path {
        &self.path
    }
}

/// One copy: the view of `source` (read through its top) where layers
/// `from` and above decide it, into the top of `target`.
pub(crate) struct ViewCopy<'a> {
    /// The chain whose view is copied.
    pub source: &'a Chain,
    /// The lowest layer of `source` whose mappings are copied.
    pub from: LayerIndex,
    /// A writable chain of the same virtual size or larger, or a raw file
    /// of that size.
    pub target: &'a dyn CopyTarget,
    /// Zero ranges of the copied layers.
    pub zeros: Zeros,
    /// Whether a zero range with nothing allocated can come from the end
    /// of a copied layer shorter than the view (the source is then walked,
    /// not read through an index, which does not tell the two apart).
    pub masks_ends: bool,
}

/// What a copy moved.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Copied {
    /// Guest bytes written with data.
    pub data_bytes: u64,
    /// Guest bytes written as zeros.
    pub zero_bytes: u64,
}

/// Called as a copy goes: `(done, total)` guest bytes looked at, and the
/// bytes just written (for a rate limit). Returns `false` to cancel.
pub type Pace<'a> = &'a mut dyn FnMut(u64, u64, u64) -> bool;

/// Whether a chain open for a copy from layer `from` must walk (see
/// [`ViewCopy::masks_ends`]): a layer from `from` up is shorter than the
/// top.
pub(crate) fn has_short_layers(chain: &Chain, from: LayerIndex) -> bool {
    let size = chain.virtual_size();
    chain.layers()[from.0..]
        .iter()
        .any(|l| l.virtual_size() < size)
}

fn cancelled(path: &Path) -> Error {
    Error::new(
        path,
        ErrorKind::Io(std::io::Error::new(
            std::io::ErrorKind::Interrupted,
            "cancelled",
        )),
    )
}

impl ViewCopy<'_> {
    /// Runs the copy; the target is written but not flushed.
    pub(crate) fn run(&self, pace: Pace<'_>) -> Result<Copied, Error> {
        let size = self.source.virtual_size();
        let mut buf = vec![0u8; CHUNK as usize];
        let mut copied = Copied::default();
        let mut pos = 0u64;
        while pos < size {
            let e = self
                .source
                .resolve(GuestOffset(pos), (size - pos).min(CHUNK), false)?;
            let n = e.len;
            let mut written = 0;
            if e.layer.0 >= self.from.0 {
                match e.kind {
                    ExtentKind::Data { .. } | ExtentKind::Compressed(_) => {
                        let chunk = &mut buf[..n as usize];
                        self.source.read_at(chunk, pos)?;
                        if self.zeros == Zeros::Skip && crate::bytes::is_zero(chunk) {
                            // Nothing to hide: the target reads zeros.
                        } else {
                            self.target.write_at(chunk, pos)?;
                            copied.data_bytes += n;
                            written = n;
                        }
                    }
                    ExtentKind::Zero { allocated, .. } => {
                        let recorded = allocated || (self.masks_ends && e.layer.0 > 0);
                        if recorded && self.zeros == Zeros::Write {
                            self.target.write_zeroes(pos, n)?;
                            copied.zero_bytes += n;
                        }
                    }
                }
            }
            pos += n;
            if !pace(pos, size, written) {
                return Err(cancelled(self.target.path()));
            }
        }
        Ok(copied)
    }
}

/// A bytes-per-second limit on the bytes a copy writes (sleeps when it is
/// ahead of the allowance).
#[derive(Debug)]
pub struct RateLimit {
    bytes_per_sec: u64,
    start: std::time::Instant,
    written: u64,
}

impl RateLimit {
    /// A limit of `bytes_per_sec` (at least 1) from now.
    pub fn new(bytes_per_sec: u64) -> RateLimit {
        RateLimit {
            bytes_per_sec: bytes_per_sec.max(1),
            start: std::time::Instant::now(),
            written: 0,
        }
    }

    /// Counts `bytes` just written and waits until they are allowed.
    pub(crate) fn charge(&mut self, bytes: u64) {
        self.charge_unless(bytes, &|| false);
    }

    /// `RateLimit::charge`, the wait cut short (in steps of at most
    /// 20 ms) once `stop` says so; returns the time waited.
    pub fn charge_unless(&mut self, bytes: u64, stop: &dyn Fn() -> bool) -> std::time::Duration {
        self.written += bytes;
        let due =
            std::time::Duration::from_secs_f64(self.written as f64 / self.bytes_per_sec as f64);
        let started = std::time::Instant::now();
        let end = self.start + due;
        while !stop() {
            let now = std::time::Instant::now();
            if now >= end {
                break;
            }
            std::thread::sleep((end - now).min(std::time::Duration::from_millis(20)));
        }
        started.elapsed()
    }
}
