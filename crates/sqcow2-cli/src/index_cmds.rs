//! `sqcow2 upgrade` and `sqcow2 snapshot`: create chain indexes.

use std::io::Write;
use std::path::Path;

use crate::output::Progress;
use sqcow2_format::indexing::{snapshot, upgrade, SnapshotIndex};
use sqcow2_format::Locking;

use crate::output::{print_json, OutputFormat};

fn bar(forced: bool) -> Progress {
    crate::output::progress_bar(
        0,
        forced,
        "{msg} {bar:40} {percent:>3}% {pos}/{len} chunks eta {eta}",
    )
}

/// Runs `sqcow2 upgrade TOP`.
pub fn run_upgrade(
    top: &Path,
    progress: bool,
    output: OutputFormat,
    locking: Locking,
) -> anyhow::Result<()> {
    let pb = bar(progress);
    pb.set_message("indexing");
    let report = upgrade(top, locking, &mut |done, total| {
        pb.set_length(total);
        pb.set_position(done);
    })?;
    pb.finish();
    let mut out = std::io::stdout().lock();
    match output {
        OutputFormat::Json => print_json(&mut out, &report)?,
        OutputFormat::Human => match &report.index {
            Some(index) => writeln!(
                out,
                "indexed {} layers below {}: {} ({} chunks, {} bytes)",
                report.layers,
                top.display(),
                index.display(),
                report.chunks,
                report.bytes
            )?,
            None => writeln!(
                out,
                "nothing to index: {} has no backing file",
                top.display()
            )?,
        },
    }
    Ok(())
}

/// When `snapshot` writes the new top's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IndexWhen {
    /// Before the new top appears.
    Now,
    /// By the first daemon that serves the chain, or `upgrade`.
    Deferred,
}

/// Runs `sqcow2 snapshot TOP NEW`.
pub fn run_snapshot(
    top: &Path,
    new: &Path,
    when: IndexWhen,
    progress: bool,
    output: OutputFormat,
    locking: Locking,
) -> anyhow::Result<()> {
    let pb = bar(progress);
    pb.set_message("indexing");
    let start = std::time::Instant::now();
    let when = match when {
        IndexWhen::Now => SnapshotIndex::Now,
        IndexWhen::Deferred => SnapshotIndex::Deferred,
    };
    let report = snapshot(top, new, locking, when, &mut |done, total| {
        pb.set_length(total);
        pb.set_position(done);
    })?;
    pb.finish();
    let elapsed = start.elapsed();
    let mut out = std::io::stdout().lock();
    match output {
        OutputFormat::Json => print_json(&mut out, &report)?,
        OutputFormat::Human => writeln!(
            out,
            "{} created over {} (backing file {:?}), index {} ({}) in {:.1} ms",
            report.new.display(),
            top.display(),
            report.backing,
            report.index.display(),
            match (report.index_written, report.incremental) {
                (false, _) => "deferred: written by the first `sqcow2 serve` or `sqcow2 upgrade`; until then the old top's index, if it has one, serves",
                (true, true) => "incremental",
                (true, false) => "walked the chain",
            },
            elapsed.as_secs_f64() * 1e3
        )?,
    }
    Ok(())
}
