//! `sqcow2 check`: refcount and mapping consistency, like `qemu-img check`.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use sqcow2_format::check::{check, Repair};
use sqcow2_format::indexing::{upgrade, verify_index};
use sqcow2_format::{Chain, ChainOptions, IndexState, Locking};

use crate::output::{print_json, OutputFormat};

/// `-r` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RepairArg {
    /// Drop leaked clusters.
    Leaks,
    /// Fix leaks and errors.
    All,
}

/// Runs `sqcow2 check`; the exit code follows qemu-img check.
pub fn run(
    image: &Path,
    repair: Option<RepairArg>,
    output: OutputFormat,
    quiet: bool,
    locking: Locking,
    force_share: bool,
) -> anyhow::Result<ExitCode> {
    let repair = match repair {
        None => Repair::None,
        Some(RepairArg::Leaks) => Repair::Leaks,
        Some(RepairArg::All) => Repair::All,
    };
    // `qemu-img check` opens the image with its backing chain: a backing
    // chain that cannot be opened fails it (exit 1) before any repair
    // (the image's own problems are what the check reports).
    let probe = ChainOptions {
        inspect_only: true,
        locking,
        force_share,
        use_index: false,
        ..ChainOptions::default()
    };
    if let Err(e) = Chain::open(image, &probe) {
        if e.concerns_the_backing_chain_of(image) {
            return Err(e.into());
        }
    }
    let mut report = check(image, repair, locking, force_share)?;
    // An index the chain trusts must agree with a fresh walk.
    let index = match verify_index(image, locking, force_share) {
        Ok(v) => v,
        Err(e) => {
            report
                .messages
                .push(format!("Chain index not verified: {e}"));
            return finish(report, output, quiet);
        }
    };
    let stale = matches!(index.state, IndexState::Stale { .. });
    if repair == Repair::All && (index.mismatches > 0 || index.unreadable > 0 || stale) {
        // The index is sqcow2's own cache of the chain: repaired by
        // writing it anew.
        let rebuilt = upgrade(image, locking, &mut |_, _| {})?;
        if let Some(path) = rebuilt.index {
            report.messages.push(format!(
                "Chain index rebuilt ({}, {} layers)",
                path.display(),
                rebuilt.layers
            ));
        }
        return finish(report, output, quiet);
    }
    if index.mismatches > 0 {
        // Slices that pass their checksums yet disagree with the chain:
        // reads through this index would return wrong data.
        report.corruptions += index.mismatches;
        report.messages.push(format!(
            "ERROR chain index disagrees with the chain for {} of {} chunks",
            index.mismatches, index.chunks
        ));
        report
            .messages
            .extend(index.examples.iter().map(|e| format!("ERROR {e}")));
    }
    if index.unreadable > 0 {
        // A damaged slice is detected and the index given up: the chain
        // is walked, as for a stale index. Not a problem of the image.
        report.messages.push(format!(
            "Chain index is damaged ({}): sqcow2 does not use it and walks the chain. `sqcow2 upgrade` (or `check -r all`) rebuilds it",
            index.unreadable_reason.as_deref().unwrap_or("unreadable"),
        ));
    }
    if let IndexState::Stale { reason, .. } = &index.state {
        report.messages.push(format!(
            "Chain index is stale and not used ({reason}); `sqcow2 upgrade` (or `check -r all`) rebuilds it"
        ));
    }
    finish(report, output, quiet)
}

/// Prints `report` (nothing when `quiet`, as qemu-img check -q); the exit
/// code says what it found.
fn finish(
    report: sqcow2_format::check::CheckReport,
    output: OutputFormat,
    quiet: bool,
) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    match output {
        _ if quiet => {}
        OutputFormat::Json => print_json(&mut out, &report)?,
        OutputFormat::Human => {
            for m in &report.messages {
                writeln!(out, "{m}")?;
            }
            if report.leaks_fixed > 0 || report.corruptions_fixed > 0 {
                writeln!(
                    out,
                    "The following inconsistencies were found and repaired:\n\n    {} leaked clusters\n    {} corruptions\n",
                    report.leaks_fixed, report.corruptions_fixed
                )?;
            }
            if report.corruptions == 0 && report.leaks == 0 && report.check_errors == 0 {
                writeln!(out, "No errors were found on the image.")?;
            }
            if report.corruptions > 0 {
                writeln!(
                    out,
                    "\n{} errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.",
                    report.corruptions
                )?;
            }
            if report.leaks > 0 {
                writeln!(
                    out,
                    "\n{} leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data.",
                    report.leaks
                )?;
            }
            if report.check_errors > 0 {
                writeln!(
                    out,
                    "\n{} internal errors have occurred during the check.",
                    report.check_errors
                )?;
            }
            let pct = |n: u64| {
                if report.total_clusters == 0 {
                    0.0
                } else {
                    n as f64 * 100.0 / report.total_clusters as f64
                }
            };
            writeln!(
                out,
                "{}/{} = {:.2}% allocated, {:.2}% fragmented, {:.2}% compressed clusters",
                report.allocated_clusters,
                report.total_clusters,
                pct(report.allocated_clusters),
                pct(report.fragmented_clusters),
                pct(report.compressed_clusters)
            )?;
            writeln!(out, "Image end offset: {}", report.image_end_offset)?;
        }
    }
    Ok(ExitCode::from(report.exit_code() as u8))
}
