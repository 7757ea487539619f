//! `sqcow2 map`: the extents of the virtual disk, like `qemu-img map`.

use std::io::Write;
use std::path::Path;

use serde::Serialize;
use sqcow2_format::{Chain, ChainOptions, ExtentKind};

use crate::output::{print_json, OutputFormat};

/// One extent with qemu-img's JSON field names.
#[derive(Debug, Serialize)]
struct MapEntry {
    start: u64,
    length: u64,
    depth: usize,
    present: bool,
    zero: bool,
    data: bool,
    compressed: bool,
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

/// Runs `sqcow2 map`.
pub fn run(image: &Path, output: OutputFormat, options: &ChainOptions) -> anyhow::Result<()> {
    let chain = Chain::open(image, options)?;
    let top = chain.top_index().0;
    let mut entries = Vec::new();
    chain.map(|e| {
        let (present, zero, data, compressed, offset) = match e.kind {
            ExtentKind::Data { host } => (true, false, true, false, Some(host.0)),
            ExtentKind::Compressed(_) => (true, false, true, true, None),
            ExtentKind::Zero { host, allocated } => {
                (allocated, true, false, false, host.map(|h| h.0))
            }
            // A kind this version does not know: data, place not shown.
            _ => (true, false, true, false, None),
        };
        entries.push((
            MapEntry {
                start: e.start.0,
                length: e.len,
                depth: top - e.layer.0,
                present,
                zero,
                data,
                compressed,
                offset,
            },
            e.layer,
        ));
    })?;
    let mut out = std::io::stdout().lock();
    match output {
        OutputFormat::Json => {
            let list: Vec<&MapEntry> = entries.iter().map(|(e, _)| e).collect();
            print_json(&mut out, &list)?;
        }
        OutputFormat::Human => {
            writeln!(
                out,
                "{:<16}{:<16}{:<16}File",
                "Offset", "Length", "Mapped to"
            )?;
            for (e, layer) in &entries {
                if !e.data {
                    continue;
                }
                let file = chain.layers()[layer.0].path().display();
                let mapped = match e.offset {
                    Some(o) => c_hex(o),
                    None => format!("{:<16}", "compressed"),
                };
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
