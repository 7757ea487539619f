//! `sqcow2 commit`, `rebase` and `merge`: shortening and re-pointing
//! chains (the first two with `qemu-img`'s options and exit codes).

use std::io::Write;
use std::path::PathBuf;

use crate::output::Progress;
use sqcow2_format::reshape::{
    commit, merge, rebase, CommitOptions, LayerRef, MergeOptions, RebaseOptions,
};
use sqcow2_format::Locking;

use sqcow2_vhost::protocol::{
    Command, CommitRequest, CommitStarted, LayerName, MergeCounters, MergeRequest, MergeStarted,
    MergeState, Stats, StatsFormat,
};

use crate::live::request;
use crate::output::{parse_size, print_json, OutputFormat};

/// `sqcow2 commit` arguments (those of `qemu-img commit`).
#[derive(Debug, clap::Args)]
pub struct CommitArgs {
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Image format (only qcow2).
    #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
    format: String,
    /// Cache mode (accepted for compatibility; the page cache is used).
    #[arg(short = 't')]
    cache: Option<String>,
    /// The layer committed into (a file of the chain, or a position, 0 the
    /// base); the image's backing file by default. Implies -d.
    #[arg(short = 'b')]
    base: Option<LayerRef>,
    /// Most bytes per second written (size suffixes as qemu-img).
    #[arg(short = 'r')]
    rate_limit: Option<String>,
    /// Do not empty the image afterwards.
    #[arg(short = 'd')]
    keep: bool,
    /// Show a progress bar.
    #[arg(short = 'p')]
    progress: bool,
    /// Output format of the report.
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    output: OutputFormat,
    /// Commit the top of a running `sqcow2 serve` while the guest writes,
    /// then serve from the base: IMAGE is its control socket.
    #[arg(long, conflicts_with = "keep")]
    live: bool,
    /// With --live: keep the guest's p99 latency within this factor of
    /// its value before the commit (e.g. 1.2): the copy waits meanwhile.
    #[arg(long, requires = "live")]
    max_p99_ratio: Option<f64>,
    /// With --live: return once the commit has started (follow it with
    /// `sqcow2 stats`).
    #[arg(long, requires = "live")]
    no_wait: bool,
    /// With --live: cancel the running commit (the chain served as it
    /// was).
    #[arg(long, requires = "live")]
    cancel: bool,
    /// The image whose data is committed (with --live: the control
    /// socket).
    image: PathBuf,
}

/// `sqcow2 rebase` arguments (those of `qemu-img rebase`).
#[derive(Debug, clap::Args)]
pub struct RebaseArgs {
    /// Quiet.
    #[arg(short = 'q')]
    quiet: bool,
    /// Image format (only qcow2).
    #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
    format: String,
    /// Cache mode of the image (accepted for compatibility).
    #[arg(short = 't')]
    cache: Option<String>,
    /// Cache mode of the backing files (accepted for compatibility).
    #[arg(short = 'T')]
    src_cache: Option<String>,
    /// Show a progress bar.
    #[arg(short = 'p')]
    progress: bool,
    /// Unsafe: only change the recorded name and format.
    #[arg(short = 'u')]
    unsafe_names_only: bool,
    /// Read the new backing file even while another process writes it
    /// (qemu-img's -U; the data compared may then be inconsistent).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The new backing file ("" for none), relative to the image's
    /// directory unless absolute.
    #[arg(short = 'b', required = true)]
    backing: String,
    /// The new backing file's format (qcow2 or raw; required with -b).
    #[arg(short = 'F')]
    backing_format: Option<String>,
    /// Output format of the report.
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    output: OutputFormat,
    /// The image to rebase.
    image: PathBuf,
}

/// `sqcow2 merge` arguments.
#[derive(Debug, clap::Args)]
pub struct MergeArgs {
    /// Show a progress bar.
    #[arg(short = 'p')]
    progress: bool,
    /// Output format of the report.
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    output: OutputFormat,
    /// Merge in a running `sqcow2 serve`: IMAGE is its control socket.
    #[arg(long)]
    live: bool,
    /// With --live: most bytes per second written (size suffixes).
    #[arg(long, requires = "live")]
    rate_limit: Option<String>,
    /// With --live: keep the guest's p99 latency within this factor of
    /// its value before the merge (e.g. 1.2): the copy waits meanwhile.
    #[arg(long, requires = "live")]
    max_p99_ratio: Option<f64>,
    /// With --live: return once the merge has started (follow it with
    /// `sqcow2 stats`).
    #[arg(long, requires = "live")]
    no_wait: bool,
    /// With --live: cancel the running merge.
    #[arg(long, requires = "live")]
    cancel: bool,
    /// Top of the chain (with --live: the control socket).
    image: PathBuf,
    /// Lowest layer merged (a file of the chain, or a position, 0 the base).
    #[arg(required_unless_present = "cancel")]
    first: Option<LayerRef>,
    /// Highest layer merged (below the top).
    #[arg(required_unless_present = "cancel")]
    last: Option<LayerRef>,
    /// New file that replaces them (created; must not exist).
    #[arg(required_unless_present = "cancel")]
    new: Option<PathBuf>,
}

fn bar(forced: bool, quiet: bool) -> Progress {
    if quiet {
        return Progress::hidden();
    }
    crate::output::progress_bar(
        0,
        forced,
        "{bar:40} {percent:>3}% {bytes}/{total_bytes} eta {eta}",
    )
}

fn progress_of(pb: &Progress) -> impl FnMut(u64, u64) + '_ {
    |done, total| {
        pb.set_length(total);
        pb.set_position(done);
    }
}

/// Runs `sqcow2 commit`.
pub fn run_commit(args: &CommitArgs, locking: Locking) -> anyhow::Result<()> {
    let _ = &args.cache;
    if args.live {
        return run_live_commit(args);
    }
    let options = CommitOptions {
        image: args.image.clone(),
        base: args.base.clone(),
        keep: args.keep,
        rate_limit: args.rate_limit.as_deref().map(parse_size).transpose()?,
        locking,
    };
    let pb = bar(args.progress, args.quiet);
    let report = commit(&options, &mut progress_of(&pb))?;
    pb.finish();
    let mut out = std::io::stdout().lock();
    match args.output {
        OutputFormat::Json => print_json(&mut out, &report)?,
        OutputFormat::Human if !args.quiet => writeln!(out, "Image committed.")?,
        OutputFormat::Human => {}
    }
    Ok(())
}

/// Runs `sqcow2 rebase`.
pub fn run_rebase(args: &RebaseArgs, locking: Locking) -> anyhow::Result<()> {
    let _ = (&args.cache, &args.src_cache);
    let options = RebaseOptions {
        image: args.image.clone(),
        backing: (!args.backing.is_empty()).then(|| PathBuf::from(&args.backing)),
        format: args.backing_format.clone(),
        unsafe_names_only: args.unsafe_names_only,
        rate_limit: None,
        locking,
        force_share: args.force_share,
    };
    let pb = bar(args.progress, args.quiet);
    let report = rebase(&options, &mut progress_of(&pb))?;
    pb.finish();
    if args.output == OutputFormat::Json {
        print_json(&mut std::io::stdout().lock(), &report)?;
    }
    Ok(())
}

/// Runs `sqcow2 merge`.
pub fn run_merge(args: &MergeArgs, locking: Locking) -> anyhow::Result<()> {
    if args.live {
        return run_live_merge(args);
    }
    let (Some(first), Some(last), Some(new)) = (&args.first, &args.last, &args.new) else {
        anyhow::bail!("FIRST, LAST and NEW are required");
    };
    let options = MergeOptions {
        image: args.image.clone(),
        first: first.clone(),
        last: last.clone(),
        output: new.clone(),
        locking,
    };
    let pb = bar(args.progress, false);
    let report = merge(&options, &mut progress_of(&pb))?;
    pb.finish();
    let mut out = std::io::stdout().lock();
    match args.output {
        OutputFormat::Json => print_json(&mut out, &report)?,
        OutputFormat::Human => {
            writeln!(
                out,
                "merged {} layers into {} ({} layers in the chain, were {}); {} now backs onto it",
                report.replaced.len(),
                report.merged.display(),
                report.layers_after,
                report.layers_before,
                report.switched.display()
            )?;
            writeln!(out, "replaced (no longer in this chain, left in place):")?;
            for p in &report.replaced {
                writeln!(out, "  {}", p.display())?;
            }
        }
    }
    Ok(())
}

fn layer_name(r: &LayerRef) -> anyhow::Result<LayerName> {
    Ok(match r {
        LayerRef::Position(n) => LayerName::Position(*n),
        LayerRef::File(f) => LayerName::File(std::path::absolute(f)?),
    })
}

/// Follows the daemon's merge or commit to its end (progress on `pb`).
fn follow(control: &std::path::Path, pb: &Progress) -> anyhow::Result<MergeCounters> {
    loop {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let stats: Stats = request(
            control,
            Command::Stats {
                format: StatsFormat::Json,
            },
        )?;
        let m = stats.merge;
        pb.set_length(m.total_bytes);
        pb.set_position(m.done_bytes);
        if matches!(
            m.state,
            MergeState::Done | MergeState::Failed | MergeState::Cancelled
        ) {
            return Ok(m);
        }
    }
}

/// `sqcow2 commit --live CONTROL [-b BASE]`: starts the commit in the
/// daemon and, unless --no-wait, follows it to its end.
fn run_live_commit(args: &CommitArgs) -> anyhow::Result<()> {
    let control = &args.image;
    if args.cancel {
        let r: serde_json::Value = request(control, Command::MergeCancel)?;
        match args.output {
            OutputFormat::Json => print_json(&mut std::io::stdout().lock(), &r)?,
            OutputFormat::Human if r["cancelled"] == true => {
                println!("the running commit is cancelled (the chain served as it was)")
            }
            OutputFormat::Human => println!("no commit was running: nothing to cancel"),
        }
        return Ok(());
    }
    let started: CommitStarted = request(
        control,
        Command::Commit(CommitRequest {
            base: args.base.as_ref().map(layer_name).transpose()?,
            rate_limit: args.rate_limit.as_deref().map(parse_size).transpose()?,
            max_p99_permille: args
                .max_p99_ratio
                .map(|r| (r * 1000.0).round().max(1.0) as u32),
        }),
    )?;
    if args.no_wait {
        match args.output {
            OutputFormat::Json => print_json(&mut std::io::stdout().lock(), &started)?,
            OutputFormat::Human if !args.quiet => println!(
                "committing into {} (follow with sqcow2 stats)",
                started.base.display()
            ),
            OutputFormat::Human => {}
        }
        return Ok(());
    }
    let pb = bar(args.progress, args.quiet);
    let end = follow(control, &pb)?;
    pb.finish();
    match args.output {
        OutputFormat::Json => print_json(&mut std::io::stdout().lock(), &end)?,
        OutputFormat::Human if end.state == MergeState::Done && !args.quiet => {
            println!(
                "committed into {} in {:.0} ms (pause {:.2} ms, {} layers now); serving it",
                started.base.display(),
                end.elapsed_ms,
                end.pause_ms,
                end.layers_after
            );
            print_replaced(&end);
        }
        OutputFormat::Human => {}
    }
    fail_unless_done("commit", &end)
}

fn print_replaced(end: &MergeCounters) {
    println!("replaced (no longer in this chain, left in place):");
    for p in &end.replaced {
        println!("  {}", p.display());
    }
}

/// The error of a job (`what`) that did not end done.
fn fail_unless_done(what: &str, end: &MergeCounters) -> anyhow::Result<()> {
    if end.state != MergeState::Done {
        anyhow::bail!(
            "{what} {}: {}",
            if end.state == MergeState::Cancelled {
                "cancelled"
            } else {
                "failed"
            },
            end.error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

/// `sqcow2 merge --live CONTROL ...`: starts the merge in the daemon and,
/// unless --no-wait, follows it to its end.
fn run_live_merge(args: &MergeArgs) -> anyhow::Result<()> {
    let control = &args.image;
    if args.cancel {
        let r: serde_json::Value = request(control, Command::MergeCancel)?;
        match args.output {
            OutputFormat::Json => print_json(&mut std::io::stdout().lock(), &r)?,
            OutputFormat::Human if r["cancelled"] == true => {
                println!("the running merge is cancelled (its file removed, the chain as it was)")
            }
            OutputFormat::Human => println!("no merge was running: nothing to cancel"),
        }
        return Ok(());
    }
    let (Some(first), Some(last), Some(new)) = (&args.first, &args.last, &args.new) else {
        anyhow::bail!("FIRST, LAST and NEW are required");
    };
    let started: MergeStarted = request(
        control,
        Command::Merge(MergeRequest {
            first: layer_name(first)?,
            last: layer_name(last)?,
            path: std::path::absolute(new)?,
            rate_limit: args.rate_limit.as_deref().map(parse_size).transpose()?,
            max_p99_permille: args
                .max_p99_ratio
                .map(|r| (r * 1000.0).round().max(1.0) as u32),
        }),
    )?;
    if args.no_wait {
        match args.output {
            OutputFormat::Json => print_json(&mut std::io::stdout().lock(), &started)?,
            OutputFormat::Human => println!(
                "merging layers {}..{} into {} (follow with sqcow2 stats)",
                started.first,
                started.last,
                started.path.display()
            ),
        }
        return Ok(());
    }
    let pb = bar(args.progress, false);
    let end = follow(control, &pb)?;
    pb.finish();
    match args.output {
        OutputFormat::Json => print_json(&mut std::io::stdout().lock(), &end)?,
        OutputFormat::Human if end.state == MergeState::Done => {
            println!(
                "merged layers {}..{} into {} in {:.0} ms (pause {:.2} ms, {} layers now)",
                end.first,
                end.last,
                end.path
                    .as_deref()
                    .unwrap_or(std::path::Path::new(""))
                    .display(),
                end.elapsed_ms,
                end.pause_ms,
                end.layers_after
            );
            print_replaced(&end);
        }
        OutputFormat::Human => {}
    }
    fail_unless_done("merge", &end)
}
