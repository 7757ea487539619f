//! Images a read-only command takes as input, as qemu-img opens them: a
//! qcow2 chain or a raw file, the format given or probed.

use std::path::Path;

use sqcow2_format::storage::{FileStorage, Storage};
use sqcow2_format::{Chain, ChainOptions, ExtentKind, GuestOffset, LockRequest};

/// An input image's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Format {
    Qcow2,
    Raw,
}

/// What a run of an image reads as (the terms of `compare -s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Data some layer holds.
    Data,
    /// Zeros a layer records.
    AllocatedZero,
    /// Nothing allocated: zeros.
    Unallocated,
}

impl Status {
    pub(crate) fn reads_zeros(self) -> bool {
        !matches!(self, Status::Data)
    }
}

/// One opened image.
pub(crate) enum Image {
    Qcow2(Box<Chain>),
    Raw(FileStorage, u64),
}

impl Image {
    pub(crate) fn open(
        path: &Path,
        format: Option<Format>,
        options: &ChainOptions,
    ) -> anyhow::Result<Self> {
        let format = match format {
            Some(f) => f,
            None => probe(path)?,
        };
        Ok(match format {
            Format::Qcow2 => Image::Qcow2(Box::new(Chain::open(path, options)?)),
            Format::Raw => {
                let s = FileStorage::open_read_only(path)
                    .map_err(|e| anyhow::anyhow!("Could not open '{}': {e}", path.display()))?;
                let lock = if options.force_share {
                    LockRequest::READER.sharing_all()
                } else {
                    LockRequest::READER
                };
                s.lock(lock, options.locking)
                    .map_err(|k| sqcow2_format::Error::new(path, k))?;
                let len = s.len()?;
                Image::Raw(s, len)
            }
        })
    }

    pub(crate) fn size(&self) -> u64 {
        match self {
            Image::Qcow2(c) => c.virtual_size(),
            Image::Raw(_, len) => *len,
        }
    }

    /// What `[pos, pos + max)` starts with, and for how many bytes.
    pub(crate) fn run(&self, pos: u64, max: u64) -> anyhow::Result<(Status, u64)> {
        match self {
            Image::Qcow2(c) => {
                // Runs of one status joined up to `max` (the engine's end
                // at slice boundaries; QEMU's reach the end of the table).
                let status_at = |at: u64| -> anyhow::Result<(Status, u64)> {
                    let e = c.resolve(GuestOffset(at), max - (at - pos), false)?;
                    let status = match e.kind {
                        ExtentKind::Zero {
                            allocated: true, ..
                        } => Status::AllocatedZero,
                        ExtentKind::Zero { .. } => Status::Unallocated,
                        _ => Status::Data,
                    };
                    Ok((status, e.len.max(1)))
                };
                let (status, mut len) = status_at(pos)?;
                while len < max {
                    let (next, n) = status_at(pos + len)?;
                    if next != status {
                        break;
                    }
                    len += n;
                }
                Ok((status, len.min(max)))
            }
            Image::Raw(s, _) => Ok(match s.allocation(pos, max) {
                Some((false, n)) if n > 0 => (Status::Unallocated, n),
                Some((true, n)) if n > 0 => (Status::Data, n),
                _ => (Status::Data, max),
            }),
        }
    }

    pub(crate) fn read(&self, buf: &mut [u8], pos: u64) -> anyhow::Result<()> {
        match self {
            Image::Qcow2(c) => Ok(c.read_at(buf, pos)?),
            Image::Raw(s, _) => Ok(s.read_at(buf, pos)?),
        }
    }
}

/// qcow2 where the file starts with its magic, raw otherwise (as
/// qemu-img probes).
fn probe(path: &Path) -> anyhow::Result<Format> {
    let s = FileStorage::open_read_only(path)
        .map_err(|e| anyhow::anyhow!("Could not open '{}': {e}", path.display()))?;
    let mut magic = [0u8; 4];
    if s.len()? >= 4 {
        s.read_at(&mut magic, 0)?;
    }
    Ok(if &magic == b"QFI\xfb" {
        Format::Qcow2
    } else {
        Format::Raw
    })
}
