//! `sqcow2 convert`: the whole virtual disk, read through the engine,
//! into a raw file or device, or flattened into one new qcow2 image
//! (compressed with `-c`), like `qemu-img convert`.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use anyhow::{bail, Context};
use sqcow2_format::create::CreateOptions;
use sqcow2_format::storage::{FileStorage, Storage};
use sqcow2_format::writer::{compress, ImageWriter};
use sqcow2_format::{Chain, ChainOptions, ExtentKind, GuestOffset, LockRequest};

/// Formats `convert` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TargetFormat {
    /// A raw disk image.
    Raw,
    /// One qcow2 image with the whole disk (no backing file).
    Qcow2,
}

/// How to convert.
#[derive(Debug, Clone)]
pub struct ConvertSpec {
    pub format: TargetFormat,
    /// `-c`: compress every cluster that gets smaller (qcow2 only).
    pub compress: bool,
    /// `-o`: options of the new image (as `create`'s).
    pub options: Vec<String>,
    /// `-n`: write into the existing target, not a new one.
    pub existing: bool,
    pub progress: bool,
}

/// Largest read issued at once.
const CHUNK: u64 = 4 << 20;

/// Runs `sqcow2 convert`.
pub fn run(
    src: &Path,
    dst: &Path,
    spec: &ConvertSpec,
    options: &ChainOptions,
) -> anyhow::Result<()> {
    if spec.compress && spec.format != TargetFormat::Qcow2 {
        bail!("Compression not supported for this file format");
    }
    let chain = Chain::open(src, options)?;
    let size = chain.virtual_size();
    // Never waiting on a FIFO: a regular file or a block device only; not
    // emptied before it is known to be free (its image lock, not a file
    // of the chain), as `qemu-img convert` takes a writer's lock first.
    let out = if spec.existing {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dst)
            .with_context(|| format!("Could not open '{}'", dst.display()))?
    } else {
        sqcow2_format::storage::open_output(dst)
            .with_context(|| format!("{}: cannot create", dst.display()))?
    };
    let meta = out
        .metadata()
        .with_context(|| format!("{}: cannot stat", dst.display()))?;
    let id = (meta.dev(), meta.ino());
    if chain
        .layers()
        .iter()
        .any(|l| l.storage().file_id() == Some(id))
    {
        bail!(
            "{}: is a file of the chain being converted; not overwritten",
            dst.display()
        );
    }
    let device = meta.file_type().is_block_device();
    let bar = crate::output::progress_bar(
        size,
        spec.progress,
        "{bar:40} {percent:>3}% {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    );
    let mut target: Box<dyn Target> = match (spec.format, spec.existing) {
        (TargetFormat::Raw, _) => Box::new(RawTarget::open(dst, out, size, device, spec, options)?),
        (TargetFormat::Qcow2, false) => {
            let mut opts = CreateOptions {
                size,
                ..CreateOptions::default()
            };
            for o in &spec.options {
                crate::create::apply_options(&mut opts, o)?;
            }
            let writer = ImageWriter::create(dst, out, &opts, options.locking)?;
            Box::new(NewQcow2 {
                writer: Some(writer),
                compress: spec.compress,
            })
        }
        (TargetFormat::Qcow2, true) => {
            drop(out);
            if spec.compress {
                bail!("-c is not supported with -n (sqcow2 writes compressed clusters only into a new image)");
            }
            let target = Chain::open(
                dst,
                &ChainOptions {
                    writable: true,
                    force_share: false,
                    ..options.clone()
                },
            )?;
            if target.virtual_size() < size {
                bail!(
                    "{}: the target ({} bytes) is smaller than the disk ({size} bytes)",
                    dst.display(),
                    target.virtual_size()
                );
            }
            Box::new(ExistingQcow2(Some(target)))
        }
    };
    let grain = target.grain();
    let mut buf = vec![0u8; CHUNK as usize];
    let mut pos = 0u64;
    while pos < size {
        let len = (size - pos).min(CHUNK);
        if holds_data(&chain, pos, len)? {
            let chunk = &mut buf[..len as usize];
            chain.read_at(chunk, pos)?;
            for (i, piece) in chunk.chunks(grain as usize).enumerate() {
                let at = pos + i as u64 * grain;
                if piece.iter().all(|&b| b == 0) {
                    target.zeros(at, piece.len() as u64)?;
                } else {
                    target.data(at, piece)?;
                }
            }
        } else {
            target.zeros(pos, len)?;
        }
        pos += len;
        bar.inc(len);
    }
    target
        .finish()
        .with_context(|| format!("{}: could not finish the image", dst.display()))?;
    bar.finish();
    Ok(())
}

/// Whether any part of `[pos, pos + len)` of `chain` may hold data.
fn holds_data(chain: &Chain, pos: u64, len: u64) -> anyhow::Result<bool> {
    let mut at = pos;
    while at < pos + len {
        let e = chain.resolve(GuestOffset(at), pos + len - at, false)?;
        if !matches!(e.kind, ExtentKind::Zero { .. }) {
            return Ok(true);
        }
        at += e.len.max(1);
    }
    Ok(false)
}

/// Where converted bytes go. Pieces come in order, each at most a
/// [`Target::grain`] and aligned to it.
trait Target {
    /// The size of the pieces (a cluster of a qcow2 target).
    fn grain(&self) -> u64;
    fn data(&mut self, at: u64, bytes: &[u8]) -> anyhow::Result<()>;
    /// `[at, at + len)` reads as zeros.
    fn zeros(&mut self, at: u64, len: u64) -> anyhow::Result<()>;
    fn finish(&mut self) -> anyhow::Result<()>;
}

/// A raw file (emptied and sized, or written over with `-n`) or a block
/// device (written over; never resized).
struct RawTarget {
    storage: FileStorage,
    /// Zeros must be written: the target does not start out zero (a
    /// device, an existing file).
    zero_fill: bool,
}

impl RawTarget {
    fn open(
        dst: &Path,
        out: std::fs::File,
        size: u64,
        device: bool,
        spec: &ConvertSpec,
        options: &ChainOptions,
    ) -> anyhow::Result<Self> {
        if !spec.options.is_empty() {
            bail!("raw images take no -o options");
        }
        let storage = FileStorage::from_file(out);
        storage
            .lock(LockRequest::WRITER, options.locking)
            .map_err(|k| sqcow2_format::Error::new(dst, k))?;
        if device || spec.existing {
            let have = storage.len()?;
            if have < size {
                bail!(
                    "{}: {have} bytes, smaller than the disk ({size} bytes)",
                    dst.display()
                );
            }
        } else {
            storage
                .set_len(0)
                .and_then(|()| storage.set_len(size))
                .with_context(|| format!("{}: cannot set size", dst.display()))?;
        }
        Ok(RawTarget {
            storage,
            zero_fill: device || spec.existing,
        })
    }
}

impl Target for RawTarget {
    fn grain(&self) -> u64 {
        CHUNK
    }

    fn data(&mut self, at: u64, bytes: &[u8]) -> anyhow::Result<()> {
        Ok(self.storage.write_at(bytes, at)?)
    }

    fn zeros(&mut self, at: u64, len: u64) -> anyhow::Result<()> {
        if self.zero_fill {
            self.storage.write_zeroes(at, len)?;
        }
        Ok(())
    }

    fn finish(&mut self) -> anyhow::Result<()> {
        Ok(self.storage.sync()?)
    }
}

/// A new qcow2 image, written front to back.
struct NewQcow2 {
    writer: Option<ImageWriter>,
    compress: bool,
}

impl Target for NewQcow2 {
    fn grain(&self) -> u64 {
        self.writer.as_ref().map_or(CHUNK, |w| w.cluster_size())
    }

    fn data(&mut self, at: u64, bytes: &[u8]) -> anyhow::Result<()> {
        let Some(w) = self.writer.as_mut() else {
            bail!("the image is finished");
        };
        let cluster = at / w.cluster_size();
        let packed = if self.compress {
            compress(bytes, w.compression_type())
        } else {
            None
        };
        match packed {
            Some(p) => w.put_compressed(cluster, &p)?,
            None => w.put(cluster, bytes)?,
        }
        Ok(())
    }

    fn zeros(&mut self, _at: u64, _len: u64) -> anyhow::Result<()> {
        Ok(())
    }

    fn finish(&mut self) -> anyhow::Result<()> {
        if let Some(w) = self.writer.take() {
            w.finish()?;
        }
        Ok(())
    }
}

/// An existing qcow2 image (`-n`), written through the engine.
struct ExistingQcow2(Option<Chain>);

impl Target for ExistingQcow2 {
    fn grain(&self) -> u64 {
        self.0.as_ref().map_or(CHUNK, |c| c.cluster_size())
    }

    fn data(&mut self, at: u64, bytes: &[u8]) -> anyhow::Result<()> {
        match &self.0 {
            Some(c) => Ok(c.write_at(bytes, at)?),
            None => bail!("the image is closed"),
        }
    }

    fn zeros(&mut self, at: u64, len: u64) -> anyhow::Result<()> {
        match &self.0 {
            Some(c) => Ok(c.write_zeroes(at, len, true)?),
            None => bail!("the image is closed"),
        }
    }

    fn finish(&mut self) -> anyhow::Result<()> {
        if let Some(c) = self.0.take() {
            c.close()?;
        }
        Ok(())
    }
}
