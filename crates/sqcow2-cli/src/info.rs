//! `sqcow2 info`: what `qemu-img info` shows, plus chain length and every
//! feature bit.

use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use serde::Serialize;
use sqcow2_format::backing_path_of;
use sqcow2_format::luks::LuksInfo;
use sqcow2_format::storage::FileStorage;
use sqcow2_format::IndexState;
use sqcow2_format::SetFeature;
use sqcow2_format::{
    describe_bitmaps, describe_snapshots, BitmapInfo, Chain, ChainOptions, Layer, Qcow2Layer,
    SnapshotInfo, Version,
};

use crate::output::{human_size, print_json, OutputFormat};

/// qemu-img's `format-specific`: the format's name and its details.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
struct FormatSpecific {
    #[serde(rename = "type")]
    format: &'static str,
    data: Qcow2Info,
}

/// qcow2-specific information: qemu-img's fields (those of v3 images only
/// for v3 images, as it shows them), then sqcow2's.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
struct Qcow2Info {
    compat: &'static str,
    compression_type: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    lazy_refcounts: Option<bool>,
    /// The persistent bitmaps (none: not shown, as qemu-img).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    bitmaps: Vec<BitmapInfo>,
    refcount_bits: u32,
    /// The LUKS header of an encrypted image.
    #[serde(skip_serializing_if = "Option::is_none")]
    encrypt: Option<LuksInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_file_raw: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    corrupt: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    extended_l2: Option<bool>,
    dirty: bool,
    /// Whether persistent bitmaps are there (qemu-img lists them as
    /// `bitmaps`).
    has_bitmaps: bool,
    internal_snapshots: u32,
    features: Vec<SetFeature>,
    unknown_extensions: Vec<String>,
}

/// One layer, with qemu-img's field names.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
struct LayerInfo {
    filename: String,
    format: &'static str,
    virtual_size: u64,
    actual_size: u64,
    /// Shown for encrypted images only, as qemu-img.
    #[serde(skip_serializing_if = "Option::is_none")]
    encrypted: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    backing_filename: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    full_backing_filename: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    backing_filename_format: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dirty_flag: Option<bool>,
    /// Layers from this one down to the base, this one included (`None`:
    /// a backing file cannot be opened).
    #[serde(skip_serializing_if = "Option::is_none")]
    chain_length: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    format_specific: Option<FormatSpecific>,
    /// Internal snapshots (none: not shown, as qemu-img).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    snapshots: Vec<SnapshotInfo>,
    /// The chain index (top layer only).
    #[serde(skip_serializing_if = "Option::is_none")]
    chain_index: Option<IndexState>,
    /// Changes a writer that died left in the mapping journal and not yet
    /// in the image (top layer only; a read-write open replays them).
    #[serde(skip_serializing_if = "Option::is_none")]
    journal_pending: Option<usize>,
    /// What sqcow2 cannot do with this image (it shows it only).
    #[serde(rename = "sqcow2-unsupported", skip_serializing_if = "Option::is_none")]
    unsupported: Option<String>,
}

fn layer_info(layer: &Layer, chain_length: Option<usize>) -> anyhow::Result<LayerInfo> {
    let meta = std::fs::metadata(layer.path())
        .with_context(|| format!("{}: cannot stat", layer.path().display()))?;
    let header = layer.header();
    Ok(LayerInfo {
        filename: layer.path().display().to_string(),
        format: layer.format_name(),
        virtual_size: layer.virtual_size(),
        actual_size: meta.blocks() * 512,
        encrypted: None,
        unsupported: None,
        cluster_size: header.map(|h| h.geometry.cluster_size()),
        backing_filename: header
            .and_then(|h| h.backing_file.as_ref())
            .map(|p| p.display().to_string()),
        full_backing_filename: backing_path_of(layer).map(|p| p.display().to_string()),
        backing_filename_format: header.and_then(|h| h.backing_format()).map(str::to_owned),
        // QEMU shows it for every format (raw: false).
        dirty_flag: Some(header.is_some_and(|h| h.is_dirty())),
        chain_length,
        chain_index: None,
        journal_pending: None,
        snapshots: match header {
            Some(h) if h.nb_snapshots > 0 => describe_snapshots(h, &**layer.storage())
                .with_context(|| format!("{}: snapshot table", layer.path().display()))?,
            _ => Vec::new(),
        },
        format_specific: match header {
            Some(h) => Some(FormatSpecific {
                format: "qcow2",
                data: qcow2_info(
                    h,
                    describe_bitmaps(h, &**layer.storage())
                        .with_context(|| format!("{}: bitmap directory", layer.path().display()))?,
                ),
            }),
            None => None,
        },
    })
}

fn qcow2_info(h: &sqcow2_format::Header, bitmaps: Vec<BitmapInfo>) -> Qcow2Info {
    let v3 = h.version == Version::V3;
    Qcow2Info {
        compat: if v3 { "1.1" } else { "0.10" },
        compression_type: h.compression_type.name(),
        lazy_refcounts: v3.then(|| h.lazy_refcounts()),
        bitmaps,
        refcount_bits: 1 << h.refcount_order,
        encrypt: None,
        data_file: h.data_file().map(|(name, _)| name),
        data_file_raw: h.data_file().map(|(_, raw)| raw),
        corrupt: v3.then_some(h.is_marked_corrupt()),
        extended_l2: v3.then_some(h.geometry.extended_l2),
        dirty: h.is_dirty(),
        has_bitmaps: h.has_bitmaps(),
        internal_snapshots: h.nb_snapshots,
        features: h.features.describe(&h.feature_names()),
        unknown_extensions: h
            .extensions
            .iter()
            .filter(|e| matches!(e, sqcow2_format::HeaderExtension::Unknown { .. }))
            .map(|e| format!("{:#010x}", e.ext_type()))
            .collect(),
    }
}

fn print_human(out: &mut impl Write, info: &LayerInfo) -> io::Result<()> {
    writeln!(out, "image: {}", info.filename)?;
    writeln!(out, "file format: {}", info.format)?;
    writeln!(
        out,
        "virtual size: {} ({} bytes)",
        human_size(info.virtual_size),
        info.virtual_size
    )?;
    writeln!(out, "disk size: {}", human_size(info.actual_size))?;
    if info.encrypted == Some(true) {
        writeln!(out, "encrypted: yes")?;
    }
    if let Some(c) = info.cluster_size {
        writeln!(out, "cluster_size: {c}")?;
    }
    if let Some(b) = &info.backing_filename {
        match &info.full_backing_filename {
            Some(full) if full != b => writeln!(out, "backing file: {b} (actual path: {full})")?,
            _ => writeln!(out, "backing file: {b}")?,
        }
    }
    if let Some(f) = &info.backing_filename_format {
        writeln!(out, "backing file format: {f}")?;
    }
    match info.chain_length {
        _ if info.unsupported.is_some() => {}
        Some(n) => writeln!(out, "chain length: {n}")?,
        None => writeln!(
            out,
            "chain length: unknown (a backing file cannot be opened)"
        )?,
    }
    match &info.chain_index {
        Some(IndexState::Valid {
            path,
            layers,
            pending: 0,
            bytes,
            granularity,
        }) => writeln!(
            out,
            "chain index: valid ({}; {layers} layers, {bytes} bytes, {granularity}-byte chunks)",
            path.display()
        )?,
        Some(IndexState::Valid {
            path,
            layers,
            pending,
            bytes,
            granularity,
        }) => writeln!(
            out,
            "chain index: pending (the top's index is not written yet; {} covers {layers} layers, \
             {bytes} bytes, {granularity}-byte chunks; {pending} layer(s) above it walked; \
             `sqcow2 serve` or `sqcow2 upgrade` writes it)",
            path.display()
        )?,
        Some(IndexState::Stale { path, reason }) => writeln!(
            out,
            "chain index: stale ({}: {reason}); walking the chain, `sqcow2 upgrade` rebuilds it",
            path.display()
        )?,
        Some(IndexState::None) => match info.chain_length {
            Some(n) if n > 1 => writeln!(
                out,
                "chain index: none (walk mode: a lookup the top cannot answer reads up to {} \
                 layers' tables; indexed, by `sqcow2 serve` in the background or `sqcow2 \
                 upgrade` now, it reads at most 2 metadata slices whatever the length)",
                n - 1
            )?,
            _ => writeln!(out, "chain index: none (a lone image: nothing to index)")?,
        },
        Some(IndexState::Disabled) => writeln!(out, "chain index: not used (--walk)")?,
        None => {}
    }
    if let Some(n) = info.journal_pending {
        writeln!(
            out,
            "journal: {n} record(s) of a writer that did not close the image are not in it yet \
             (any read-write open replays them, e.g. `sqcow2 io -c flush`; QEMU sees the image without them)"
        )?;
    }
    if let Some(what) = &info.unsupported {
        writeln!(
            out,
            "sqcow2: unsupported feature: {what} (the image is shown; its data is not read, written or served)"
        )?;
    }
    if !info.snapshots.is_empty() {
        print_snapshots(out, &info.snapshots)?;
    }
    if let Some(FormatSpecific { data: q, .. }) = &info.format_specific {
        writeln!(out, "Format specific information:")?;
        writeln!(out, "    compat: {}", q.compat)?;
        writeln!(out, "    compression type: {}", q.compression_type)?;
        if let Some(lazy) = q.lazy_refcounts {
            writeln!(out, "    lazy refcounts: {lazy}")?;
        }
        if !q.bitmaps.is_empty() {
            print_bitmaps(out, &q.bitmaps)?;
        }
        writeln!(out, "    refcount bits: {}", q.refcount_bits)?;
        if let Some(luks) = &q.encrypt {
            print_luks(out, luks)?;
        }
        if let Some(d) = &q.data_file {
            writeln!(out, "    data file: {d}")?;
        }
        if let Some(raw) = q.data_file_raw {
            writeln!(out, "    data file raw: {raw}")?;
        }
        if let Some(corrupt) = q.corrupt {
            writeln!(out, "    corrupt: {corrupt}")?;
        }
        if let Some(extended_l2) = q.extended_l2 {
            writeln!(out, "    extended l2: {extended_l2}")?;
        }
        writeln!(out, "    dirty: {}", q.dirty)?;
        writeln!(out, "    internal snapshots: {}", q.internal_snapshots)?;
        for f in &q.features {
            let name = f.name.as_deref().map(|n| format!(" ({n})"));
            writeln!(
                out,
                "    feature: {:?} bit {}{}",
                f.kind,
                f.bit,
                name.unwrap_or_default()
            )?;
        }
        for e in &q.unknown_extensions {
            writeln!(out, "    unknown header extension: {e} (kept)")?;
        }
    }
    Ok(())
}

/// A LUKS header as `qemu-img info` shows it.
fn print_luks(out: &mut impl Write, l: &LuksInfo) -> io::Result<()> {
    writeln!(out, "    encrypt:")?;
    writeln!(out, "        ivgen alg: {}", l.ivgen_alg)?;
    writeln!(out, "        hash alg: {}", l.hash_alg)?;
    writeln!(out, "        cipher alg: {}", l.cipher_alg)?;
    writeln!(out, "        uuid: {}", l.uuid)?;
    if let Some(h) = &l.ivgen_hash_alg {
        writeln!(out, "        ivgen hash alg: {h}")?;
    }
    writeln!(out, "        format: {}", l.format)?;
    writeln!(out, "        cipher mode: {}", l.cipher_mode)?;
    writeln!(out, "        slots:")?;
    for (i, s) in l.slots.iter().enumerate() {
        writeln!(out, "            [{i}]:")?;
        writeln!(out, "                active: {}", s.active)?;
        if let Some(n) = s.iters {
            writeln!(out, "                iters: {n}")?;
        }
        writeln!(out, "                key offset: {}", s.key_offset)?;
        if let Some(n) = s.stripes {
            writeln!(out, "                stripes: {n}")?;
        }
    }
    writeln!(out, "        payload offset: {}", l.payload_offset)?;
    writeln!(out, "        master key iters: {}", l.master_key_iters)?;
    Ok(())
}

/// The persistent bitmaps as `qemu-img info` lists them.
fn print_bitmaps(out: &mut impl Write, bitmaps: &[BitmapInfo]) -> io::Result<()> {
    writeln!(out, "    bitmaps:")?;
    for (i, b) in bitmaps.iter().enumerate() {
        writeln!(out, "        [{i}]:")?;
        writeln!(out, "            flags:")?;
        for (j, f) in b.flags.iter().enumerate() {
            writeln!(out, "                [{j}]: {f}")?;
        }
        writeln!(out, "            name: {}", b.name)?;
        writeln!(out, "            granularity: {}", b.granularity)?;
    }
    Ok(())
}

/// The internal snapshots as `qemu-img info` lists them (its columns and
/// widths; the date in local time).
fn print_snapshots(out: &mut impl Write, snapshots: &[SnapshotInfo]) -> io::Result<()> {
    writeln!(out, "Snapshot list:")?;
    writeln!(
        out,
        "{:<10}{:<17}{:>8}{:>20}{:>13}{:>11}",
        "ID", "TAG", "VM SIZE", "DATE", "VM CLOCK", "ICOUNT"
    )?;
    for sn in snapshots {
        let date = i64::try_from(sn.date_sec)
            .ok()
            .and_then(|secs| chrono::DateTime::from_timestamp(secs, 0))
            .map(|d| {
                d.with_timezone(&chrono::Local)
                    .format("%Y-%m-%d %H:%M:%S")
                    .to_string()
            })
            .unwrap_or_default();
        let secs = sn.vm_clock_sec;
        let clock = format!(
            "{:02}:{:02}:{:02}.{:03}",
            secs / 3600,
            (secs / 60) % 60,
            secs % 60,
            (sn.vm_clock_nsec / 1_000_000) % 1000
        );
        let icount = sn.icount.map(|n| n.to_string()).unwrap_or_default();
        writeln!(
            out,
            "{:<9} {:<16} {:>8}{:>20}{:>13}{:>11}",
            sn.id,
            sn.name,
            human_size(sn.vm_state_size),
            date,
            clock,
            icount
        )?;
    }
    Ok(())
}

/// What `info` shows of an open chain: its top, or every layer.
fn chain_info(chain: &Chain, backing_chain: bool) -> anyhow::Result<Vec<LayerInfo>> {
    let layers = chain.layers();
    let mut shown: Vec<LayerInfo> = if backing_chain {
        layers
            .iter()
            .enumerate()
            .rev()
            .map(|(i, l)| layer_info(l, Some(i + 1)))
            .collect::<anyhow::Result<_>>()?
    } else {
        vec![layer_info(chain.top(), Some(layers.len()))?]
    };
    shown[0].chain_index = Some(chain.index().state().clone());
    shown[0].journal_pending = chain.durability().journal_pending().filter(|n| *n > 0);
    Ok(shown)
}

/// What `info` shows of the qcow2 image at `image` opened alone (no lock:
/// its header only, as `qemu-img info` reads it).
fn lone_image_info(image: &Path) -> anyhow::Result<LayerInfo> {
    let storage = FileStorage::open_read_only(image)
        .with_context(|| format!("{}: cannot open", image.display()))?;
    let layer = Qcow2Layer::open_lazily(image, Arc::new(storage))
        .map_err(|kind| sqcow2_format::Error::new(image, kind))?;
    layer_info(&Layer::Qcow2(layer), None)
}

/// What `info` shows of an image sqcow2 cannot read the data of (LUKS
/// encryption, an external data file: `why`): its header, as qemu-img
/// shows it.
fn inspected_info(image: &Path, why: &sqcow2_format::Feature) -> anyhow::Result<LayerInfo> {
    let storage = FileStorage::open_read_only(image)
        .with_context(|| format!("{}: cannot open", image.display()))?;
    let e = |k| sqcow2_format::Error::new(image, k);
    let h = sqcow2_format::Header::read_for_inspection(&storage).map_err(e)?;
    let meta = storage.file().metadata()?;
    let mut q = qcow2_info(&h, describe_bitmaps(&h, &storage).map_err(e)?);
    q.encrypt = match h.luks_header() {
        Some((offset, len)) => {
            Some(sqcow2_format::luks::read_luks(&storage, offset, len).map_err(e)?)
        }
        None => None,
    };
    let backing = h.backing_file.as_ref().map(|p| p.display().to_string());
    Ok(LayerInfo {
        filename: image.display().to_string(),
        format: "qcow2",
        virtual_size: h.virtual_size(),
        actual_size: meta.blocks() * 512,
        encrypted: (h.crypt_method != 0).then_some(true),
        cluster_size: Some(h.geometry.cluster_size()),
        full_backing_filename: h
            .backing_file
            .as_ref()
            .and_then(|b| sqcow2_format::resolve_backing_path(image, b).ok())
            .map(|p| p.display().to_string()),
        backing_filename: backing,
        backing_filename_format: h.backing_format().map(str::to_owned),
        dirty_flag: Some(h.is_dirty()),
        chain_length: None,
        snapshots: if h.nb_snapshots > 0 {
            describe_snapshots(&h, &storage).map_err(e)?
        } else {
            Vec::new()
        },
        format_specific: Some(FormatSpecific {
            format: "qcow2",
            data: q,
        }),
        chain_index: None,
        journal_pending: None,
        unsupported: Some(why.to_string()),
    })
}

/// Runs `sqcow2 info`.
pub fn run(
    image: &Path,
    backing_chain: bool,
    output: OutputFormat,
    options: &ChainOptions,
) -> anyhow::Result<()> {
    let shown = match Chain::open(image, options) {
        Ok(chain) => chain_info(&chain, backing_chain)?,
        // `qemu-img info` does not open the backing chain: it shows an
        // image whose backing file is missing or unusable (with
        // `--backing-chain` it fails too).
        // Shown, not read: what sqcow2 cannot read the data of.
        Err(sqcow2_format::Error {
            kind:
                sqcow2_format::ErrorKind::Unsupported(
                    why @ (sqcow2_format::Feature::LuksEncryption
                    | sqcow2_format::Feature::ExternalDataFile),
                ),
            path,
        }) if path == image => vec![inspected_info(image, &why)?],
        Err(e) if !backing_chain && e.concerns_the_backing_chain_of(image) => {
            tracing::warn!("{e}: the image alone is shown");
            vec![lone_image_info(image)?]
        }
        Err(e) => return Err(e.into()),
    };
    let mut out = io::stdout().lock();
    match output {
        OutputFormat::Json if backing_chain => print_json(&mut out, &shown)?,
        OutputFormat::Json => print_json(&mut out, &shown[0])?,
        OutputFormat::Human => {
            for (i, info) in shown.iter().enumerate() {
                if i > 0 {
                    writeln!(out)?;
                }
                print_human(&mut out, info)?;
            }
        }
    }
    Ok(())
}
