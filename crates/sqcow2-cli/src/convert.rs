//! `sqcow2 convert`: the whole virtual disk, read through the engine, into a
//! sparse raw file.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use anyhow::{bail, Context};
use sqcow2_format::storage::{FileStorage, Storage};
use sqcow2_format::{Chain, ChainOptions, ExtentKind, GuestOffset, LockRequest};

/// Formats `convert` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TargetFormat {
    /// A raw disk image.
    Raw,
}

/// Largest read issued at once.
const CHUNK: u64 = 4 << 20;

/// Runs `sqcow2 convert -O raw`.
pub fn run(
    src: &Path,
    dst: &Path,
    _format: TargetFormat,
    progress: bool,
    options: &ChainOptions,
) -> anyhow::Result<()> {
    let chain = Chain::open(src, options)?;
    let size = chain.virtual_size();
    // Not truncated before it is known to be free: a file of the chain
    // read here is refused by name, and any file another process (or
    // this chain) holds is refused by its image lock, as `qemu-img
    // convert` takes a writer's lock on its target first.
    // Never waiting on a FIFO: a regular file or a block device only.
    let out = sqcow2_format::storage::open_output(dst)
        .with_context(|| format!("{}: cannot create", dst.display()))?;
    let target = out
        .metadata()
        .with_context(|| format!("{}: cannot stat", dst.display()))?;
    let id = (target.dev(), target.ino());
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
    let out = FileStorage::from_file(out);
    out.lock(LockRequest::WRITER, options.locking)
        .map_err(|k| sqcow2_format::Error::new(dst, k))?;
    out.set_len(0)
        .and_then(|()| out.set_len(size))
        .with_context(|| format!("{}: cannot set size", dst.display()))?;
    let bar = crate::output::progress_bar(
        size,
        progress,
        "{bar:40} {percent:>3}% {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    );
    let mut buf = vec![0u8; CHUNK as usize];
    let mut pos = 0u64;
    while pos < size {
        let extent = chain.resolve(GuestOffset(pos), (size - pos).min(CHUNK), false)?;
        let n = extent.len;
        if !matches!(extent.kind, ExtentKind::Zero { .. }) {
            let chunk = &mut buf[..n as usize];
            chain.read_at(chunk, pos)?;
            if chunk.iter().any(|&b| b != 0) {
                out.write_at(chunk, pos)
                    .with_context(|| format!("{}: write failed", dst.display()))?;
            }
        }
        pos += n;
        bar.inc(n);
    }
    out.sync()
        .with_context(|| format!("{}: sync failed", dst.display()))?;
    bar.finish();
    Ok(())
}
