//! `sqcow2 create`: a new qcow2 image, like `qemu-img create -f qcow2`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use sqcow2_format::create::{create_with_locking, CreateOptions};
use sqcow2_format::resolve_backing_path;
use sqcow2_format::{Chain, ChainOptions, CompressionType, Locking, Version};

use crate::output::parse_size;

fn parse_bool(key: &str, v: &str) -> anyhow::Result<bool> {
    match v {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => bail!("option {key}: expected on or off, got {v:?}"),
    }
}

/// Applies `-o key=value,...` to the options.
pub(crate) fn apply_options(opts: &mut CreateOptions, spec: &str) -> anyhow::Result<()> {
    for item in spec.split(',').filter(|s| !s.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .with_context(|| format!("option {item:?} is not key=value"))?;
        match key {
            "cluster_size" => opts.cluster_size = parse_size(value)?,
            "extended_l2" => opts.extended_l2 = parse_bool(key, value)?,
            "lazy_refcounts" => opts.lazy_refcounts = parse_bool(key, value)?,
            "compression_type" => {
                opts.compression_type = match value {
                    "zlib" | "deflate" => CompressionType::Deflate,
                    "zstd" => CompressionType::Zstd,
                    _ => bail!("compression_type must be zlib or zstd"),
                }
            }
            "compat" => {
                opts.version = match value {
                    "0.10" | "v2" => Version::V2,
                    "1.1" | "v3" => Version::V3,
                    _ => bail!("compat must be 0.10 or 1.1"),
                }
            }
            "refcount_bits" => opts.refcount_bits = value.parse()?,
            "backing_file" => opts.backing_file = Some(PathBuf::from(value)),
            "backing_fmt" => opts.backing_format = Some(value.to_owned()),
            "preallocation" => match value {
                // qemu-img's default: nothing to do.
                "off" => {}
                "metadata" | "falloc" | "full" => {
                    bail!("preallocation={value} is not supported (off only)")
                }
                _ => bail!("preallocation must be off, metadata, falloc or full"),
            },
            _ => bail!("unknown option {key:?}"),
        }
    }
    Ok(())
}

/// Runs `sqcow2 create`.
pub fn run(
    file: &Path,
    size: Option<&str>,
    backing: Option<&Path>,
    backing_format: Option<&str>,
    options: &[String],
    unsafe_backing: bool,
    locking: Locking,
) -> anyhow::Result<()> {
    let mut opts = CreateOptions::default();
    for spec in options {
        apply_options(&mut opts, spec)?;
    }
    if let Some(b) = backing {
        opts.backing_file = Some(b.to_path_buf());
    }
    if let Some(f) = backing_format {
        opts.backing_format = Some(f.to_owned());
    }
    let backing_size = match &opts.backing_file {
        // `-u`: the backing file is not opened (it may not exist yet): the
        // size and the format must be given.
        Some(_) if unsafe_backing => {
            if opts.backing_format.is_none() {
                bail!(
                    "{}: Backing file specified without backing format (give it with -F)",
                    file.display()
                );
            }
            None
        }
        Some(name) => {
            let path = resolve_backing_path(file, name)?;
            let Some(format) = opts.backing_format.clone() else {
                // As qemu-img since QEMU 6.1: a backing format is never
                // probed (probing is how a raw guest disk gets read as
                // an image).
                bail!(
                    "{}: Backing file specified without backing format (give it with -F)",
                    file.display()
                );
            };
            let size = match format.as_str() {
                "qcow2" => Chain::open(&path, &ChainOptions::default())?.virtual_size(),
                "raw" => std::fs::metadata(&path)
                    .with_context(|| format!("{}: cannot open backing file", path.display()))?
                    .len(),
                other => bail!("backing format {other:?} is not supported (qcow2, raw)"),
            };
            opts.backing_format = Some(format);
            Some(size)
        }
        None => None,
    };
    opts.size = match (size, backing_size) {
        (Some(s), _) => parse_size(s)?,
        (None, Some(s)) => s,
        (None, None) => bail!("{}: give a size (or a backing file)", file.display()),
    };
    create_with_locking(file, &opts, locking)?;
    Ok(())
}
