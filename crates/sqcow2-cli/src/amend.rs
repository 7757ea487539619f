//! `sqcow2 amend`: a closed image's format options changed, like
//! `qemu-img amend -o ...` (compat, lazy_refcounts, refcount_bits, size
//! as `resize`; the backing file is refused as qemu-img refuses it).

use std::path::PathBuf;

use anyhow::bail;
use sqcow2_format::amend::{amend, AmendOptions};
use sqcow2_format::{Chain, ChainOptions, Version};

/// `sqcow2 amend` (qemu-img amend's arguments).
#[derive(Debug, clap::Args)]
pub(crate) struct AmendArgs {
    /// Image format (only qcow2).
    #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
    format: String,
    /// Options to change, `key=value[,...]`.
    #[arg(short = 'o')]
    options: Vec<String>,
    /// Quiet (qemu-img's -q).
    #[arg(short = 'q')]
    quiet: bool,
    /// The image.
    image: PathBuf,
}

fn on_off(key: &str, v: &str) -> anyhow::Result<bool> {
    match v {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => bail!("Parameter '{key}' expects 'on' or 'off'"),
    }
}

/// Runs `sqcow2 amend`.
pub(crate) fn run(args: &AmendArgs, options: &ChainOptions) -> anyhow::Result<()> {
    if args.options.is_empty() {
        bail!("Must specify options (-o)");
    }
    let mut opts = AmendOptions::default();
    let mut size = None;
    for spec in &args.options {
        for item in spec.split(',').filter(|s| !s.is_empty()) {
            let (key, value) = item.split_once('=').unwrap_or((item, ""));
            match key {
                "compat" => {
                    opts.version = Some(match value {
                        "0.10" | "v2" => Version::V2,
                        "1.1" | "v3" => Version::V3,
                        _ => bail!("Invalid compatibility level: '{value}'"),
                    })
                }
                "lazy_refcounts" => opts.lazy_refcounts = Some(on_off(key, value)?),
                "refcount_bits" => {
                    opts.refcount_bits = Some(value.parse().map_err(|_| {
                        anyhow::anyhow!("Parameter 'refcount_bits' expects a non-negative number")
                    })?)
                }
                // (As qemu-img 7.2.)
                "backing_file" | "backing_fmt" => {
                    bail!("Cannot amend the backing file\nYou can use 'sqcow2 rebase' instead.")
                }
                "size" => size = Some(value.to_string()),
                "cluster_size" | "preallocation" | "extended_l2" | "compression_type"
                | "encrypt.format" | "encryption" | "nocow" => bail!(
                    "Invalid parameter '{key}'\nThis option is only supported for image creation"
                ),
                "data_file" | "data_file_raw" => {
                    bail!("amending {key} is not supported (sqcow2 does not read external data files)")
                }
                k if k.starts_with("encrypt.") => {
                    bail!("amending {key} is not supported (sqcow2 does not read encrypted images)")
                }
                _ => bail!("Invalid parameter '{key}'"),
            }
        }
    }
    // Opened read-write and closed first, as qemu-img opens it: a
    // writer's journal applied, a dirty image's refcounts repaired.
    if let Ok(chain) = Chain::open(
        &args.image,
        &ChainOptions {
            writable: true,
            ..options.clone()
        },
    ) {
        chain.close()?;
    }
    if opts != AmendOptions::default() {
        amend(&args.image, &opts, options.locking)?;
    }
    if let Some(size) = size {
        crate::resize::resize_to(&args.image, &size, options)?;
    }
    Ok(())
}
