//! `sqcow2 map`: the extents of the virtual disk, like `qemu-img map`.

use std::io::Write;
use std::path::Path;

use serde::Serialize;
use sqcow2_format::prealloc::looks_metadata_preallocated;
use sqcow2_format::storage::Storage;
use sqcow2_format::{Chain, ChainOptions, ExtentKind, Layer};

use crate::output::{print_json, OutputFormat};

/// One extent with qemu-img's JSON field names.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
struct MapEntry {
    start: u64,
    length: u64,
    depth: usize,
    present: bool,
    zero: bool,
    data: bool,
    /// Shown for every extent but the one of an empty disk (as QEMU).
    #[serde(skip_serializing_if = "Option::is_none")]
    compressed: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    offset: Option<u64>,
}

/// `%#-16x` of C: `0` for zero, `0x...` otherwise, padded to 16.
fn c_hex(v: u64) -> String {
    let s = if v == 0 {
        "0".to_owned()
    } else {
        format!("{v:#x}")
    };
    format!("{s:<16}")
}

/// The runs of `[host, host + len)` in `storage`: `(offset from host,
/// length, reads as zeros)`; a hole of the file reads as zeros (as QEMU
/// asks the file system: a preallocated cluster never written).
fn host_runs(storage: &dyn Storage, host: u64, len: u64) -> Vec<(u64, u64, bool)> {
    let mut runs: Vec<(u64, u64, bool)> = Vec::new();
    let mut done = 0;
    while done < len {
        let (is_data, run) = match storage.allocation(host + done, len - done) {
            Some((is_data, run)) if run > 0 => (is_data, run.min(len - done)),
            _ => (true, len - done),
        };
        match runs.last_mut() {
            Some(last) if last.2 != is_data => last.1 += run,
            _ => runs.push((done, run, !is_data)),
        }
        done += run;
    }
    runs
}

/// Whether `b` continues `a` (one entry in qemu-img's output).
fn continues(a: &MapEntry, b: &MapEntry) -> bool {
    a.start + a.length == b.start
        && (a.depth, a.present, a.zero, a.data, a.compressed)
            == (b.depth, b.present, b.zero, b.data, b.compressed)
        && match (a.offset, b.offset) {
            (Some(x), Some(y)) => x + a.length == y,
            (None, None) => true,
            _ => false,
        }
}

/// Runs `sqcow2 map`.
pub fn run(image: &Path, output: OutputFormat, options: &ChainOptions) -> anyhow::Result<()> {
    let chain = Chain::open(image, options)?;
    let top = chain.top_index().0;
    let mut entries: Vec<(MapEntry, sqcow2_format::LayerIndex)> = Vec::new();
    let mut push = |entry: MapEntry, layer| match entries.last_mut() {
        Some((last, l)) if *l == layer && continues(last, &entry) => last.length += entry.length,
        _ => entries.push((entry, layer)),
    };
    // Layers whose holes read as zeros in the map (as QEMU's): raw files,
    // and images that look preallocated with metadata only.
    let mut holes_read_as_zeros: std::collections::HashMap<usize, bool> = Default::default();
    chain.map(|e| {
        if let ExtentKind::Data { host } = e.kind {
            let layer = &chain.layers()[e.layer.0];
            let storage = layer.storage();
            let holes = *holes_read_as_zeros
                .entry(e.layer.0)
                .or_insert_with(|| match layer {
                    Layer::Qcow2(l) => looks_metadata_preallocated(l.header(), &**storage),
                    _ => true,
                });
            let runs = if holes {
                host_runs(&**storage, host.0, e.len)
            } else {
                vec![(0, e.len, false)]
            };
            for (at, len, zero) in runs {
                push(
                    MapEntry {
                        start: e.start.0 + at,
                        length: len,
                        depth: top - e.layer.0,
                        present: true,
                        zero,
                        data: true,
                        compressed: Some(false),
                        offset: Some(host.0 + at),
                    },
                    e.layer,
                );
            }
            return;
        }
        let (present, zero, data, compressed, offset) = match e.kind {
            ExtentKind::Compressed(_) => (true, false, true, true, None),
            ExtentKind::Zero { host, allocated } => {
                (allocated, true, false, false, host.map(|h| h.0))
            }
            // A kind this version does not know: data, place not shown.
            _ => (true, false, true, false, None),
        };
        push(
            MapEntry {
                start: e.start.0,
                length: e.len,
                depth: top - e.layer.0,
                present,
                zero,
                data,
                compressed: Some(compressed),
                offset,
            },
            e.layer,
        );
    })?;
    let mut out = std::io::stdout().lock();
    match output {
        OutputFormat::Json => {
            let mut list: Vec<&MapEntry> = entries.iter().map(|(e, _)| e).collect();
            // An empty disk: one empty extent, as qemu-img shows it.
            let empty = MapEntry {
                start: 0,
                length: 0,
                depth: 0,
                present: false,
                zero: false,
                data: false,
                compressed: None,
                offset: None,
            };
            if list.is_empty() {
                list.push(&empty);
            }
            print_json(&mut out, &list)?;
        }
        OutputFormat::Human => {
            writeln!(
                out,
                "{:<16}{:<16}{:<16}File",
                "Offset", "Length", "Mapped to"
            )?;
            for (e, layer) in &entries {
                // As qemu-img: data that does not read as zeros.
                if !e.data || e.zero {
                    continue;
                }
                let file = chain.layers()[layer.0].path().display();
                // Data without a place in a file cannot be shown in this
                // table: qemu-img stops there with this error (exit 1).
                let Some(offset) = e.offset else {
                    out.flush()?;
                    anyhow::bail!("File contains external, encrypted or compressed clusters.");
                };
                let mapped = c_hex(offset);
                writeln!(
                    out,
                    "{}{}{}{}",
                    c_hex(e.start),
                    c_hex(e.length),
                    mapped,
                    file
                )?;
            }
        }
    }
    Ok(())
}
