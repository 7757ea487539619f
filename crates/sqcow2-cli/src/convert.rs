//! `sqcow2 convert`: the whole virtual disk, read through the engine, into a
//! sparse raw file.

use std::fs::OpenOptions;
use std::io::IsTerminal;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use sqcow2_format::{Chain, ChainOptions, ExtentKind, GuestOffset};

/// Formats `convert` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TargetFormat {
    /// A raw disk image.
    Raw,
}

/// Largest read issued at once.
const CHUNK: u64 = 4 << 20;

fn progress_bar(len: u64, forced: bool) -> ProgressBar {
    if !forced && !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {percent:>3}% {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

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
    let out = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(dst)
        .with_context(|| format!("{}: cannot create", dst.display()))?;
    out.set_len(size)
        .with_context(|| format!("{}: cannot set size", dst.display()))?;
    let bar = progress_bar(size, progress);
    let mut buf = vec![0u8; CHUNK as usize];
    let mut pos = 0u64;
    while pos < size {
        let extent = chain.resolve(GuestOffset(pos), (size - pos).min(CHUNK), false)?;
        let n = extent.len;
        if !matches!(extent.kind, ExtentKind::Zero { .. }) {
            let chunk = &mut buf[..n as usize];
            chain.read_at(chunk, pos)?;
            if chunk.iter().any(|&b| b != 0) {
                out.write_all_at(chunk, pos)
                    .with_context(|| format!("{}: write failed", dst.display()))?;
            }
        }
        pos += n;
        bar.inc(n);
    }
    out.sync_all()
        .with_context(|| format!("{}: sync failed", dst.display()))?;
    bar.finish_and_clear();
    Ok(())
}
