//! `sqcow2 resize`: a disk's virtual size changed, like `qemu-img resize`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use sqcow2_format::{Chain, ChainOptions};

use crate::output::{parse_size, OutputFormat};

/// `sqcow2 resize` (qemu-img resize's arguments).
#[derive(Debug, clap::Args)]
pub(crate) struct ResizeArgs {
    /// Image format, as qemu-img's -f (only qcow2).
    #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
    format: String,
    /// Quiet: print nothing but errors (qemu-img's -q).
    #[arg(short = 'q')]
    quiet: bool,
    /// Allow a smaller size (what lies past the new end is lost; offline
    /// only).
    #[arg(long)]
    shrink: bool,
    /// Preallocation of the new space: off (qemu-img's default) only;
    /// qemu-img's other modes are refused.
    #[arg(long, value_name = "MODE", default_value = "off")]
    preallocation: String,
    /// Grow the disk a running `sqcow2 serve` serves (IMAGE is then its
    /// control socket); the frontend is told (QEMU passes it on to the
    /// guest). Shrinking a served disk is refused.
    #[arg(long)]
    live: bool,
    /// Output format (with --live).
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    output: OutputFormat,
    /// The image (the top of its chain; the chain is opened as qemu-img
    /// opens it); with --live, the daemon's control socket.
    image: PathBuf,
    /// The new size (SIZE), or a change of it (+SIZE, -SIZE); suffixes
    /// K, M, G, T, P, E as qemu-img's.
    #[arg(allow_hyphen_values = true)]
    size: String,
}

/// The size `spec` asks for, given the size `now`.
fn new_size(spec: &str, now: u64) -> anyhow::Result<u64> {
    let positive = || anyhow::anyhow!("New image size must be positive");
    let size = if let Some(by) = spec.strip_prefix('+') {
        now.checked_add(parse_size(by)?)
            .context("the new size is too large")?
    } else if let Some(by) = spec.strip_prefix('-') {
        now.checked_sub(parse_size(by)?).ok_or_else(positive)?
    } else {
        parse_size(spec)?
    };
    if size == 0 {
        return Err(positive());
    }
    Ok(size)
}

/// Resizes the image as `args` say, opened with `options`.
pub(crate) fn run(args: &ResizeArgs, options: &ChainOptions) -> anyhow::Result<()> {
    let preallocate = match args.preallocation.as_str() {
        "off" => false,
        "metadata" | "falloc" | "full" => true,
        other => bail!("Invalid preallocation mode '{other}'"),
    };
    if args.live {
        if preallocate {
            bail!("--preallocation is not supported with --live (off only)");
        }
        return run_live(args);
    }
    resize_image(&args.image, &args.size, args.shrink, preallocate, options)?;
    if !args.quiet {
        println!("Image resized.");
    }
    Ok(())
}

/// Resizes the closed image at `image` to `spec` (as `amend -o size=`
/// does: shrinking allowed).
pub(crate) fn resize_to(image: &Path, spec: &str, options: &ChainOptions) -> anyhow::Result<()> {
    resize_image(image, spec, true, false, options)
}

/// Resizes the closed image at `image` to `spec` (SIZE, +SIZE, -SIZE):
/// a shrink only if `shrink`, no preallocation but off.
fn resize_image(
    image: &Path,
    spec: &str,
    shrink: bool,
    preallocate: bool,
    options: &ChainOptions,
) -> anyhow::Result<()> {
    let chain = Chain::open(
        image,
        &ChainOptions {
            writable: true,
            ..options.clone()
        },
    )?;
    let now = chain.virtual_size();
    let size = new_size(spec, now)?;
    if size < now {
        if !shrink {
            eprintln!(
                "sqcow2: warning: Shrinking an image will delete all data beyond the shrunken \
                 image's end. Before performing such an operation, make sure there is no \
                 important data there."
            );
            bail!("Use the --shrink option to perform a shrink operation.");
        }
        if preallocate {
            bail!("Preallocation can only be used for growing images");
        }
        // Closed first: a writer's journal applied, its tables written.
        chain.close()?;
        sqcow2_format::resize::shrink(image, size, options.locking)?;
        return rebuild_index(image, options);
    }
    if preallocate {
        bail!("--preallocation modes other than off are not supported when growing");
    }
    let in_place = chain
        .top()
        .header()
        .is_none_or(|h| sqcow2_format::resize::grows_in_place(h, size));
    let chain = if in_place {
        chain
    } else {
        // Past what the L1 table addresses where it is: moved first, on
        // the closed image (as qemu-img grows it).
        chain.close()?;
        sqcow2_format::resize::move_l1_for(image, size, options.locking)?;
        Chain::open(
            image,
            &ChainOptions {
                writable: true,
                stale_index_expected: true,
                ..options.clone()
            },
        )?
    };
    chain.handover().grow_top(size)?;
    chain.close()?;
    // Reopened at the new size: what the backing file would show through
    // the new range is zeroed, as qemu-img does.
    let chain = Chain::open(
        image,
        &ChainOptions {
            writable: true,
            stale_index_expected: true,
            ..options.clone()
        },
    )?;
    chain.handover().zero_grown(now)?;
    chain.close()?;
    rebuild_index(image, options)
}

/// After either resize: the index the top names covers the old size,
/// so it is rebuilt for the new one (the nearest valid index below, or
/// a walk, as after a commit).
fn rebuild_index(image: &Path, options: &ChainOptions) -> anyhow::Result<()> {
    sqcow2_format::reshape::rebuild_named_index(image, options.locking)
        .context("rebuilding the chain index after the resize")?;
    Ok(())
}

/// `sqcow2 resize --live CONTROL SIZE`.
fn run_live(args: &ResizeArgs) -> anyhow::Result<()> {
    use sqcow2_vhost::protocol::{Command, Info, ResizeResult};
    let info: Info = crate::live::request(&args.image, Command::Info)?;
    let size = new_size(&args.size, info.virtual_size)?;
    let r: ResizeResult = crate::live::request(&args.image, Command::Resize { size })?;
    crate::live::print(&r, args.output, |r| {
        if args.quiet {
            String::new()
        } else {
            let told = if r.frontend_told {
                "the frontend was told"
            } else {
                "no frontend channel: it sees the size when it next reads the config"
            };
            format!(
                "Image resized: {} -> {} bytes ({told}; paused {:.2} ms).\n",
                r.old_size, r.size, r.pause_ms
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_absolute_and_relative() {
        let g = 1 << 30;
        assert_eq!(new_size("2G", g).unwrap(), 2 * g);
        assert_eq!(new_size("+1G", g).unwrap(), 2 * g);
        assert_eq!(new_size("-512M", g).unwrap(), g / 2);
        for bad in ["-1G", "-2G", "0"] {
            let e = new_size(bad, g).unwrap_err().to_string();
            assert_eq!(e, "New image size must be positive", "{bad}");
        }
        assert!(new_size("+1Q", g).is_err());
    }
}
