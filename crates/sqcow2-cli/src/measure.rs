//! `sqcow2 measure`: how large a file an image (or a disk of a size)
//! needs in a format, as `qemu-img measure` reckons it.

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::Serialize;
use sqcow2_format::create::CreateOptions;
use sqcow2_format::measure::{data_clusters, Qcow2Layout};
use sqcow2_format::{ChainOptions, Version};

use crate::input::{Format, Image};
use crate::output::{parse_size, OutputFormat};

/// `sqcow2 measure` (qemu-img measure's arguments).
#[derive(Debug, clap::Args)]
pub(crate) struct MeasureArgs {
    /// The output format (qemu-img's default: raw).
    #[arg(short = 'O', value_enum, default_value = "raw")]
    output_format: Format,
    /// The input's format (probed when not given).
    #[arg(short = 'f', value_enum)]
    format: Option<Format>,
    /// Options of the output image (`-o cluster_size=..,refcount_bits=..,
    /// extended_l2=..,compat=..,preallocation=..`).
    #[arg(short = 'o')]
    options: Vec<String>,
    /// Measure a disk of this size instead of an image.
    #[arg(long)]
    size: Option<String>,
    /// Open the image even if another process writes it.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    output: OutputFormat,
    /// The image to measure.
    image: Option<PathBuf>,
}

/// What `measure` prints (qemu-img's field names).
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
struct Measured {
    required: u64,
    fully_allocated: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    bitmaps: Option<u64>,
}

/// Runs `sqcow2 measure`.
pub(crate) fn run(args: &MeasureArgs, options: &ChainOptions) -> anyhow::Result<()> {
    let mut out = CreateOptions::default();
    let mut preallocated = false;
    for spec in &args.options {
        let mut rest = Vec::new();
        for item in spec.split(',').filter(|s| !s.is_empty()) {
            match item.split_once('=') {
                Some(("preallocation", mode)) => {
                    preallocated = match mode {
                        "off" | "metadata" => false,
                        "falloc" | "full" => true,
                        _ => bail!("Invalid parameter '{mode}'"),
                    }
                }
                _ => rest.push(item),
            }
        }
        crate::create::apply_options(&mut out, &rest.join(","))?;
    }
    let image = match (&args.size, &args.image) {
        (Some(_), Some(_)) => bail!("--size N cannot be used together with a filename."),
        (None, None) => bail!("Either --size N or one filename must be specified."),
        (Some(_), None) => None,
        (None, Some(path)) => Some(Image::open(
            path,
            args.format,
            &ChainOptions {
                force_share: args.force_share,
                ..options.clone()
            },
        )?),
    };
    let size = match (&args.size, &image) {
        (Some(s), _) => parse_size(s)?,
        (None, Some(i)) => i.size(),
        (None, None) => unreachable!("checked above"),
    };
    let measured = match args.output_format {
        Format::Raw => {
            let raw = size.div_ceil(512) * 512;
            Measured {
                required: raw,
                fully_allocated: raw,
                bitmaps: None,
            }
        }
        Format::Qcow2 => {
            let layout = Qcow2Layout {
                cluster_size: out.cluster_size,
                refcount_bits: out.refcount_bits,
                extended_l2: out.extended_l2,
            };
            let full = layout.fully_allocated(size);
            let aligned = size.div_ceil(out.cluster_size) * out.cluster_size;
            let data = match &image {
                _ if preallocated => aligned,
                Some(i) => data_clusters(data_runs(i, size)?, out.cluster_size),
                None => 0,
            };
            // Bitmaps are counted where both sides can hold them.
            let bitmaps = match &image {
                Some(Image::Qcow2(chain)) if out.version == Version::V3 => {
                    let top = chain.top();
                    let header = top.header().context("the top's header")?;
                    let list = sqcow2_format::describe_bitmaps(header, &**top.storage())
                        .map_err(|k| sqcow2_format::Error::new(top.path(), k))?;
                    Some(layout.bitmaps(size, &list))
                }
                _ => None,
            };
            Measured {
                required: layout.required(size, data),
                fully_allocated: full,
                bitmaps,
            }
        }
    };
    crate::live::print(&measured, args.output, |m| {
        let mut s = format!(
            "required size: {}\nfully allocated size: {}\n",
            m.required, m.fully_allocated
        );
        if let Some(b) = m.bitmaps {
            s += &format!("bitmaps size: {b}\n");
        }
        s
    })
}

/// The runs of `image` that hold data (not zeros) up to `size`.
fn data_runs(image: &Image, size: u64) -> anyhow::Result<Vec<(u64, u64)>> {
    let mut runs = Vec::new();
    let mut pos = 0;
    while pos < size {
        let (status, n) = image.run(pos, size - pos)?;
        if !status.reads_zeros() {
            runs.push((pos, n));
        }
        pos += n;
    }
    Ok(runs)
}
