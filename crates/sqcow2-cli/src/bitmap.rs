//! `sqcow2 bitmap`: a top's persistent dirty bitmaps added, removed,
//! cleared, enabled, disabled and merged, with `qemu-img bitmap`'s
//! arguments, order of operations, messages and exit codes.

use std::ops::Range;
use std::path::PathBuf;

use anyhow::{anyhow, bail};
use sqcow2_format::{read_dirty_ranges, Chain, ChainOptions};

use crate::output::{parse_size, OutputFormat};

/// `sqcow2 bitmap` (qemu-img bitmap's arguments; the operations run in
/// the order given).
#[derive(Debug, clap::Args)]
pub(crate) struct BitmapArgs {
    /// Add BITMAP, empty.
    #[arg(long, action = clap::ArgAction::Count)]
    add: u8,
    /// Remove BITMAP.
    #[arg(long, action = clap::ArgAction::Count)]
    remove: u8,
    /// Clear every bit of BITMAP.
    #[arg(long, action = clap::ArgAction::Count)]
    clear: u8,
    /// Make BITMAP track writes.
    #[arg(long, action = clap::ArgAction::Count)]
    enable: u8,
    /// Make BITMAP stop tracking writes.
    #[arg(long, action = clap::ArgAction::Count)]
    disable: u8,
    /// Set in BITMAP every bit set in bitmap SOURCE (of this image, or of
    /// SOURCE_FILE with -b).
    #[arg(long, value_name = "SOURCE")]
    merge: Vec<String>,
    /// The image holding the --merge source.
    #[arg(short = 'b', value_name = "SOURCE_FILE")]
    source_file: Option<PathBuf>,
    /// The source image's format (only qcow2).
    #[arg(short = 'F', value_name = "SOURCE_FMT", value_parser = ["qcow2"])]
    source_format: Option<String>,
    /// Granularity of an added bitmap (bytes; a power of 2, 512 to 2G;
    /// default the cluster size, at least 4 KiB).
    #[arg(short = 'g', value_name = "GRANULARITY")]
    granularity: Option<String>,
    /// Image format, as qemu-img's -f (only qcow2).
    #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
    format: String,
    /// Edit the bitmaps of the disk a running `sqcow2 serve` serves
    /// (IMAGE is then its control socket; -b names a layer of its chain);
    /// each operation is in the image when it returns.
    #[arg(long)]
    live: bool,
    /// Output format (with --live: json prints the bitmaps after the
    /// last operation).
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    output: OutputFormat,
    /// The image (the top of its chain); with --live, the daemon's
    /// control socket.
    image: PathBuf,
    /// The bitmap.
    bitmap: String,
}

/// One operation, in command-line order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Add,
    Remove,
    Clear,
    Enable,
    Disable,
    Merge(String),
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Add => "add",
            Op::Remove => "remove",
            Op::Clear => "clear",
            Op::Enable => "enable",
            Op::Disable => "disable",
            Op::Merge(_) => "merge",
        }
    }
}

/// The operations of the `bitmap` command line `argv` in the order
/// given (clap has checked the syntax; it keeps no order across flags).
fn ops_in_order(argv: &[String]) -> Vec<Op> {
    let mut ops = Vec::new();
    let mut words = argv
        .iter()
        .skip_while(|w| w.as_str() != "bitmap")
        .skip(1)
        .take_while(|w| w.as_str() != "--");
    while let Some(w) = words.next() {
        match w.as_str() {
            "--add" => ops.push(Op::Add),
            "--remove" => ops.push(Op::Remove),
            "--clear" => ops.push(Op::Clear),
            "--enable" => ops.push(Op::Enable),
            "--disable" => ops.push(Op::Disable),
            "--merge" => {
                if let Some(source) = words.next() {
                    ops.push(Op::Merge(source.clone()));
                }
            }
            other => {
                if let Some(source) = other.strip_prefix("--merge=") {
                    ops.push(Op::Merge(source.to_owned()));
                }
            }
        }
    }
    ops
}

/// Runs `sqcow2 bitmap`; operations done before one that fails are
/// kept (stored), as qemu-img keeps them.
pub(crate) fn run(args: &BitmapArgs, options: &ChainOptions) -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    let ops = ops_in_order(&argv);
    let counted = usize::from(args.add)
        + usize::from(args.remove)
        + usize::from(args.clear)
        + usize::from(args.enable)
        + usize::from(args.disable)
        + args.merge.len();
    if ops.is_empty() {
        bail!("Need at least one of --add, --remove, --clear, --enable, --disable, or --merge");
    }
    if ops.len() != counted {
        bail!("could not tell the order of the operations: give each as its own word");
    }
    let granularity = match &args.granularity {
        Some(_) if args.add == 0 => bail!("granularity only supported with --add"),
        Some(g) => Some(parse_size(g)?),
        None => None,
    };
    if args.source_file.is_some() && args.merge.is_empty() {
        bail!("Merge bitmap source file only supported with --merge");
    }
    if args.source_format.is_some() && args.source_file.is_none() {
        bail!("Merge bitmap source format only supported with --merge");
    }
    if args.live {
        return run_live(args, &ops, granularity);
    }
    let writable = ChainOptions {
        writable: true,
        ..options.clone()
    };
    let chain = Chain::open(&args.image, &writable)?;
    let name = &args.bitmap;
    let mut failed = None;
    for op in &ops {
        let done = apply(&chain, op, name, granularity, args, options);
        if let Err(e) = done {
            failed = Some(anyhow!(
                "Operation {} on bitmap {name} failed: {e}",
                op.name()
            ));
            break;
        }
    }
    chain.close()?;
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The operations as control requests, in order; the first failure
/// ends the run (those before it are done).
fn run_live(args: &BitmapArgs, ops: &[Op], granularity: Option<u64>) -> anyhow::Result<()> {
    use sqcow2_vhost::protocol::{BitmapList, BitmapOp, BitmapRequest, Command, LayerName};
    let name = &args.bitmap;
    let mut last = None;
    for op in ops {
        let (op_kind, source) = match op {
            Op::Add => (BitmapOp::Add, None),
            Op::Remove => (BitmapOp::Remove, None),
            Op::Clear => (BitmapOp::Clear, None),
            Op::Enable => (BitmapOp::Enable, None),
            Op::Disable => (BitmapOp::Disable, None),
            Op::Merge(source) => (BitmapOp::Merge, Some(source.clone())),
        };
        let request = BitmapRequest {
            op: op_kind,
            name: Some(name.clone()),
            granularity: granularity.filter(|_| *op == Op::Add),
            disabled: *op == Op::Add && args.disable > 0,
            source_layer: source
                .as_ref()
                .and(args.source_file.as_ref())
                .map(|f| std::path::absolute(f).map(LayerName::File))
                .transpose()?,
            source,
        };
        let list: BitmapList = crate::live::request(&args.image, Command::Bitmap(request))
            .map_err(|e| anyhow!("Operation {} on bitmap {name} failed: {e}", op.name()))?;
        last = Some(list);
    }
    if let (OutputFormat::Json, Some(list)) = (args.output, last) {
        println!("{}", serde_json::to_string_pretty(&list)?);
    }
    Ok(())
}

/// One operation; its error as qemu-img words it (after "failed: ").
fn apply(
    chain: &Chain,
    op: &Op,
    name: &str,
    granularity: Option<u64>,
    args: &BitmapArgs,
    options: &ChainOptions,
) -> Result<(), String> {
    let bitmaps = chain.bitmaps();
    let kind = |e: sqcow2_format::Error| e.kind.to_string();
    match op {
        Op::Add => bitmaps
            .add(name, granularity, args.disable == 0)
            .map_err(kind),
        Op::Remove => bitmaps.remove(name).map_err(kind),
        Op::Clear => bitmaps.clear(name).map_err(kind),
        Op::Enable => bitmaps.set_enabled(name, true).map_err(kind),
        Op::Disable => bitmaps.set_enabled(name, false).map_err(kind),
        Op::Merge(source) => {
            let (ranges, size) = match &args.source_file {
                None => (bitmaps.dirty(source).map_err(kind)?, chain.virtual_size()),
                Some(file) => source_ranges(file, source, options)?,
            };
            bitmaps.merge(name, &ranges, size).map_err(kind)
        }
    }
}

/// The dirty ranges of bitmap `name` of image `file` (opened read-only)
/// and its disk size.
fn source_ranges(
    file: &std::path::Path,
    name: &str,
    options: &ChainOptions,
) -> Result<(Vec<Range<u64>>, u64), String> {
    let chain = Chain::open(file, options).map_err(|e| e.to_string())?;
    let top = chain.top();
    let header = top
        .header()
        .ok_or_else(|| format!("{}: not a qcow2 image", file.display()))?;
    let read = read_dirty_ranges(header, &**top.storage(), name).map_err(|e| e.to_string())?;
    let dirty = read
        .dirty
        .ok_or_else(|| format!("Bitmap '{name}' is inconsistent and cannot be used"))?;
    Ok((dirty, header.size))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn operations_keep_their_command_line_order() {
        let ops = ops_in_order(&argv(&[
            "sqcow2",
            "-v",
            "bitmap",
            "--enable",
            "--merge",
            "src",
            "--clear",
            "--merge=b",
            "-g",
            "64k",
            "--add",
            "img",
            "--",
            "--remove",
        ]));
        assert_eq!(
            ops,
            vec![
                Op::Enable,
                Op::Merge("src".into()),
                Op::Clear,
                Op::Merge("b".into()),
                Op::Add
            ]
        );
    }
}
