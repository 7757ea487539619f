//! `sqcow2`: read-outs, conversion and maintenance of qcow2 / sQcow2 chains,
//! in the spirit of `qemu-img`.

mod amend;
mod bitmap;
mod check;
mod compare;
mod convert;
mod create;
mod gen_chain;
mod index_cmds;
mod info;
mod input;
mod io;
mod live;
mod map;
mod measure;
mod output;
mod readout;
mod remote;
mod reshape;
mod resize;
mod serve;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use sqcow2_format::ChainOptions;

use crate::output::OutputFormat;

/// qcow2 backing chains with direct access and one unified metadata cache.
#[derive(Debug, Parser)]
#[command(name = "sqcow2", version, about)]
struct Cli {
    /// Most layers a chain may have before it is refused.
    #[arg(long, global = true, default_value_t = sqcow2_format::DEFAULT_MAX_LAYERS)]
    max_layers: usize,
    /// Byte budget of the unified metadata cache (whole chain).
    #[arg(long, global = true, default_value = "32M")]
    cache_size: String,
    /// Bytes per cached metadata slice.
    #[arg(long, global = true, default_value = "4k")]
    slice_size: String,
    /// Walk the chain even when the top has a valid chain index.
    #[arg(long, global = true)]
    walk: bool,
    /// Descriptors kept open for the layers below the top; past it the
    /// least recently used are closed and reopened on demand (default:
    /// half the open-file limit, which is first raised to its hard limit).
    #[arg(long, global = true)]
    max_open_files: Option<usize>,
    /// Image locking as QEMU does it (byte-range locks on every file
    /// opened, seen by QEMU and sqcow2 alike): auto (lock where the
    /// filesystem can, warn once where it cannot), on (refuse where it
    /// cannot), off.
    #[arg(long, global = true, value_enum, default_value_t = LockingArg::Auto)]
    locking: LockingArg,
    /// Log line format on standard error (level from RUST_LOG): text
    /// (coloured only on a terminal) or json (one object per line, for
    /// log collectors).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// The export a command sent to a daemon's control socket is for,
    /// when the daemon serves several (`serve --export ...,id=ID`).
    #[arg(long, global = true, value_name = "ID")]
    export_id: Option<String>,
    /// Read layers that backing names give as `http(s)://` URLs (layers
    /// in an object store, `sqcow2 push`) from the store that
    /// AWS_ENDPOINT_URL names, with the credentials of the environment or
    /// the shared credentials file, caching their blocks in this
    /// directory (also SQCOW2_REMOTE_CACHE). Without it such names are
    /// refused.
    #[arg(long, global = true, value_name = "DIR")]
    remote_cache: Option<PathBuf>,
    /// Bytes each remote layer's local cache may hold.
    #[arg(long, global = true, default_value = "1G")]
    remote_cache_size: String,
    /// Tries of a remote layer's read before its reader gets an I/O
    /// error (the store unreachable or failing; pauses of 100 ms,
    /// doubling); 0: try until the store answers (readers wait).
    #[arg(long, global = true, default_value_t = 3)]
    remote_tries: u32,
    #[command(subcommand)]
    command: Command,
}

/// `--locking` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LockingArg {
    /// Lock where the filesystem can.
    Auto,
    /// Always lock; refuse where the filesystem cannot.
    On,
    /// Never lock.
    Off,
}

impl From<LockingArg> for sqcow2_format::Locking {
    fn from(l: LockingArg) -> Self {
        match l {
            LockingArg::Auto => sqcow2_format::Locking::Auto,
            LockingArg::On => sqcow2_format::Locking::On,
            LockingArg::Off => sqcow2_format::Locking::Off,
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a chain to a VM as a vhost-user-blk device (QEMU
    /// `vhost-user-blk-pci`, Cloud Hypervisor `--disk vhost_user=true`).
    Serve(Box<serve::ServeArgs>),
    /// Statistics of a running `sqcow2 serve` (through its control socket).
    Stats(live::StatsArgs),
    /// Add, remove or list the exports of a running `sqcow2 serve`
    /// (through its control socket).
    #[command(subcommand)]
    Export(live::ExportCommand),
    /// Set the I/O limits of a served export live (QEMU's
    /// `block_set_io_throttle`; `--export-id` names the export).
    SetIoThrottle(live::SetIoThrottleArgs),
    /// Make a `sqcow2 serve` active: take the image locks, reload the
    /// chain, serve (the destination of a handover; fails while another
    /// process holds the chain).
    Activate {
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// The daemon's control socket.
        control: PathBuf,
    },
    /// Make a `sqcow2 serve` inactive: finish requests in flight, flush,
    /// release the image locks (the source of a handover); requests then
    /// wait until it is activated again.
    Inactivate {
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// The daemon's control socket.
        control: PathBuf,
    },
    /// Show an image's format, size, backing file and features.
    Info {
        /// Also show every layer of the backing chain.
        #[arg(long)]
        backing_chain: bool,
        /// Image format, as qemu-img's -f (only qcow2).
        #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
        format: String,
        /// Ask a running `sqcow2 serve` through this control socket
        /// instead of reading IMAGE.
        #[arg(long, value_name = "CONTROL", conflicts_with = "image")]
        live: Option<PathBuf>,
        /// Read even while another process writes the image (qemu-img's
        /// -U): nothing is locked against writers; the data may be
        /// inconsistent.
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// Top image of the chain.
        #[arg(required_unless_present = "live")]
        image: Option<PathBuf>,
    },
    /// Show which layer maps each range of the virtual disk, like `qemu-img map`.
    Map {
        /// Image format, as qemu-img's -f (only qcow2).
        #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
        format: String,
        /// Read even while another process writes the image (qemu-img's
        /// -U): nothing is locked against writers; the data may be
        /// inconsistent.
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// Top image of the chain.
        image: PathBuf,
    },
    /// Upload the local layers below IMAGE to an object store and name
    /// them there: IMAGE's backing file becomes the highest one's URL.
    Push(remote::PushArgs),
    /// Download the layers below IMAGE from an object store and name them
    /// locally again.
    Pull(remote::PullArgs),
    /// Create a qcow2 image, like `qemu-img create -f qcow2`.
    Create {
        /// Image format (only qcow2).
        #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
        format: String,
        /// Quiet: print nothing but errors (qemu-img's -q).
        #[arg(short = 'q')]
        quiet: bool,
        /// Backing file, named as it will be written in the image.
        #[arg(short = 'b')]
        backing: Option<PathBuf>,
        /// Backing file format (qcow2 or raw).
        #[arg(short = 'F')]
        backing_format: Option<String>,
        /// Options: cluster_size, extended_l2, compression_type,
        /// lazy_refcounts, compat, refcount_bits, backing_file,
        /// backing_fmt, preallocation (off only).
        #[arg(short = 'o')]
        options: Vec<String>,
        /// Do not open the backing file (it may not exist yet): give the
        /// size and -F (qemu-img's -u).
        #[arg(short = 'u')]
        unsafe_backing: bool,
        /// Image to create.
        file: PathBuf,
        /// Virtual size (defaults to the backing file's).
        size: Option<String>,
    },
    /// Check refcounts and mappings, like `qemu-img check`
    /// (exit 0 clean, 2 errors, 3 leaks, 1 check failed).
    Check {
        /// Repair leaks, or everything.
        #[arg(short = 'r', value_enum)]
        repair: Option<check::RepairArg>,
        /// Image format, as qemu-img's -f (only qcow2).
        #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
        format: String,
        /// Quiet: print nothing but errors (qemu-img's -q).
        #[arg(short = 'q')]
        quiet: bool,
        /// Read even while another process writes the image (qemu-img's
        /// -U): nothing is locked against writers; the data may be
        /// inconsistent.
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// Image to check.
        image: PathBuf,
    },
    /// Run qemu-io commands (read, write, discard, flush) on an image.
    Io {
        /// A command, as for qemu-io -c.
        #[arg(short = 'c', required = true)]
        commands: Vec<String>,
        /// Open read-only.
        #[arg(short = 'r')]
        read_only: bool,
        /// Read even while another process writes the image (qemu-img's
        /// -U): nothing is locked against writers; the data may be
        /// inconsistent.
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        /// Format (only qcow2).
        #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
        format: String,
        /// Top image of the chain.
        image: PathBuf,
    },
    /// Index a vanilla chain in place (the top names the new index).
    Upgrade {
        /// Show a progress bar even when standard error is not a terminal.
        #[arg(short = 'p')]
        progress: bool,
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// Top image of the chain.
        top: PathBuf,
    },
    /// Create a new active volume over TOP (like `qemu-img create -b TOP -F
    /// qcow2 NEW`, but with TOP's cluster size, extended L2, compression
    /// type and lazy refcounts, where qemu-img takes its defaults) with its
    /// chain index; atomic.
    Snapshot {
        /// Show a progress bar even when standard error is not a terminal.
        #[arg(short = 'p')]
        progress: bool,
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// Snapshot a running `sqcow2 serve`: TOP is then its control socket.
        #[arg(long)]
        live: bool,
        /// When the new top's index is written: `deferred` (default; the
        /// old top's index serves until a daemon serving the chain or
        /// `sqcow2 upgrade` writes it) or `now` (before the new top
        /// appears; takes time in proportion to the disk).
        #[arg(long, value_enum, default_value_t = index_cmds::IndexWhen::Deferred)]
        index: index_cmds::IndexWhen,
        /// Current top of the chain (with --live: the control socket).
        top: PathBuf,
        /// New active volume to create.
        new: PathBuf,
    },
    /// Commit an image's data into a layer below (as `qemu-img commit`).
    Commit(reshape::CommitArgs),
    /// Add, remove, clear, enable, disable or merge a persistent dirty
    /// bitmap, like `qemu-img bitmap` (operations run in the order given).
    Bitmap(bitmap::BitmapArgs),
    /// Change a disk's virtual size, like `qemu-img resize` (grows
    /// offline and live, moving the L1 table offline where it must;
    /// shrinks offline).
    Resize(resize::ResizeArgs),
    /// Whether two images read the same, like `qemu-img compare` (exit
    /// 0 identical, 1 different, 2 cannot open, 3/4 cannot read).
    Compare(compare::CompareArgs),
    /// How large a file an image (or a disk of a size) needs in a
    /// format, like `qemu-img measure`.
    Measure(measure::MeasureArgs),
    /// Change a closed image's format options, like `qemu-img amend`
    /// (compat, lazy_refcounts, refcount_bits, size).
    Amend(amend::AmendArgs),
    /// Change an image's backing file (as `qemu-img rebase`).
    Rebase(reshape::RebaseArgs),
    /// Merge layers FIRST..LAST of a chain (below its top) into one new
    /// file; the layer above them is switched onto it, the replaced files
    /// are left in place.
    Merge(reshape::MergeArgs),
    /// Generate a qcow2 chain whose clusters identify their layer.
    GenChain(gen_chain::GenArgs),
    /// Print a shell completion script (e.g. `sqcow2 completions bash >
    /// /etc/bash_completion.d/sqcow2`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the manual pages (sqcow2.1 and one per command) into DIR
    /// (made if missing).
    Man {
        /// Where to write them (e.g. /usr/local/share/man/man1).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Write the whole virtual disk to a raw file.
    Convert {
        /// Output format: `raw`, or `qcow2` (the chain flattened into
        /// one image).
        #[arg(short = 'O', value_enum)]
        output_format: convert::TargetFormat,
        /// Compress the clusters of a qcow2 output (those that get
        /// smaller), with its compression_type.
        #[arg(short = 'c')]
        compress: bool,
        /// Options of a qcow2 output (as `create -o`: cluster_size,
        /// compression_type, refcount_bits, compat, lazy_refcounts).
        #[arg(short = 'o')]
        options: Vec<String>,
        /// Write into the existing target (raw file or device, or a qcow2
        /// image at least as large) instead of creating it; zeros are
        /// written where the disk reads zeros.
        #[arg(short = 'n')]
        existing: bool,
        /// Source format, as qemu-img's -f (only qcow2).
        #[arg(short = 'f', default_value = "qcow2", value_parser = ["qcow2"])]
        format: String,
        /// Quiet: print nothing but errors (qemu-img's -q).
        #[arg(short = 'q')]
        quiet: bool,
        /// Show a progress bar even when standard error is not a terminal.
        #[arg(short = 'p')]
        progress: bool,
        /// Read even while another process writes the image (qemu-img's
        /// -U): nothing is locked against writers; the data may be
        /// inconsistent.
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        /// Top image of the source chain.
        src: PathBuf,
        /// File (or block device) to write.
        dst: PathBuf,
    },
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let slice_size = output::parse_size(&cli.slice_size)?;
    if !slice_size.is_power_of_two() || slice_size < 512 {
        anyhow::bail!(
            "--slice-size {}: the slice size must be a power of two of at least 512 bytes",
            cli.slice_size
        );
    }
    let options = ChainOptions {
        max_layers: cli.max_layers,
        cache_size: output::parse_size(&cli.cache_size)?,
        slice_size,
        use_index: !cli.walk,
        locking: cli.locking.into(),
        max_open_files: cli.max_open_files,
        ..ChainOptions::default()
    };
    let remote = match remote::cache_dir(cli.remote_cache.clone()) {
        Some(dir) => {
            let layers = remote::store_layers(
                &dir,
                output::parse_size(&cli.remote_cache_size)?,
                cli.remote_tries,
            )?;
            sqcow2_format::set_process_remote_layers(layers.clone());
            Some(layers)
        }
        None => None,
    };
    let options = ChainOptions {
        remote_layers: remote
            .clone()
            .map(|l| l as std::sync::Arc<dyn sqcow2_format::RemoteLayers>),
        ..options
    };
    let locking = options.locking;
    let sharing = |force_share: bool| ChainOptions {
        force_share,
        ..options.clone()
    };
    match cli.command {
        Command::Create {
            backing,
            backing_format,
            options,
            unsafe_backing,
            file,
            size,
            ..
        } => create::run(
            &file,
            size.as_deref(),
            backing.as_deref(),
            backing_format.as_deref(),
            &options,
            unsafe_backing,
            locking,
        )
        .map(|()| ExitCode::SUCCESS),
        Command::Check {
            repair,
            force_share,
            output,
            image,
            quiet,
            ..
        } => check::run(&image, repair, output, quiet, locking, force_share),
        Command::Io {
            commands,
            read_only,
            force_share,
            image,
            ..
        } => io::run(&image, &commands, read_only, &sharing(force_share)),
        Command::Push(args) => {
            remote::run_push(&args, &options, remote).map(|()| ExitCode::SUCCESS)
        }
        Command::Pull(args) => {
            remote::run_pull(&args, &options, remote).map(|()| ExitCode::SUCCESS)
        }
        Command::Upgrade {
            progress,
            output,
            top,
        } => index_cmds::run_upgrade(&top, progress, output, locking).map(|()| ExitCode::SUCCESS),
        Command::Snapshot {
            live: true,
            output,
            top,
            new,
            ..
        } => live::snapshot(&top, &new, output).map(|()| ExitCode::SUCCESS),
        Command::Snapshot {
            progress,
            output,
            top,
            new,
            index,
            ..
        } => index_cmds::run_snapshot(&top, &new, index, progress, output, locking)
            .map(|()| ExitCode::SUCCESS),
        Command::Stats(args) => live::stats(&args).map(|()| ExitCode::SUCCESS),
        Command::Export(command) => live::export(&command).map(|()| ExitCode::SUCCESS),
        Command::SetIoThrottle(args) => live::set_io_throttle(&args).map(|()| ExitCode::SUCCESS),
        Command::Activate { output, control } => {
            live::set_active(&control, true, output).map(|()| ExitCode::SUCCESS)
        }
        Command::Inactivate { output, control } => {
            live::set_active(&control, false, output).map(|()| ExitCode::SUCCESS)
        }
        Command::GenChain(args) => gen_chain::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut command_line(), "sqcow2", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Command::Man { dir } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(command_line(), &dir)
                .with_context(|| format!("writing manual pages into {}", dir.display()))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Commit(args) => reshape::run_commit(&args, locking).map(|()| ExitCode::SUCCESS),
        Command::Resize(args) => resize::run(&args, &options).map(|()| ExitCode::SUCCESS),
        Command::Bitmap(args) => bitmap::run(&args, &options).map(|()| ExitCode::SUCCESS),
        Command::Compare(args) => Ok(compare::run(&args, &options)),
        Command::Measure(args) => measure::run(&args, &options).map(|()| ExitCode::SUCCESS),
        Command::Amend(args) => amend::run(&args, &options).map(|()| ExitCode::SUCCESS),
        Command::Rebase(args) => reshape::run_rebase(&args, locking).map(|()| ExitCode::SUCCESS),
        Command::Merge(args) => reshape::run_merge(&args, locking).map(|()| ExitCode::SUCCESS),
        Command::Serve(args) => serve::run(&args, &options).map(|()| ExitCode::SUCCESS),
        other => run_read_out(other, &options),
    }
}

fn run_read_out(command: Command, options: &ChainOptions) -> anyhow::Result<ExitCode> {
    match command {
        Command::Info {
            live: Some(control),
            output,
            ..
        } => live::info(&control, output),
        Command::Info {
            backing_chain,
            force_share,
            output,
            image: Some(image),
            ..
        } => {
            // Headers only, as qemu-img info: nothing held on the data.
            let options = ChainOptions {
                force_share,
                inspect_only: true,
                ..options.clone()
            };
            info::run(&image, backing_chain, output, &options)
        }
        Command::Map {
            force_share,
            output,
            image,
            ..
        } => map::run(
            &image,
            output,
            &ChainOptions {
                force_share,
                ..options.clone()
            },
        ),
        Command::Convert {
            output_format,
            compress,
            options: create_options,
            existing,
            progress,
            quiet,
            force_share,
            src,
            dst,
            ..
        } => convert::run(
            &src,
            &dst,
            &convert::ConvertSpec {
                format: output_format,
                compress,
                options: create_options,
                existing,
                progress: progress && !quiet,
            },
            &ChainOptions {
                force_share,
                ..options.clone()
            },
        ),
        _ => unreachable!("handled by run"),
    }
    .map(|()| ExitCode::SUCCESS)
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            || e.downcast_ref::<serde_json::Error>()
                .and_then(|j| j.io_error_kind())
                .is_some_and(|k| k == std::io::ErrorKind::BrokenPipe)
    })
}

fn main() -> ExitCode {
    let cli = match Cli::from_arg_matches(&command_line().get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    live::set_export(cli.export_id.clone());
    // A daemon reports what it does; one-shot commands only what went wrong.
    let default_level = match cli.command {
        Command::Serve(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => logs.json().init(),
        // Colour escapes only where a terminal shows them, not in log files.
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    // As QEMU does: long chains need more descriptors than the usual soft
    // limit of 1024 (the descriptor cache works within whatever is left).
    match sqcow2_format::raise_open_file_limit() {
        Ok((old, new)) => tracing::debug!(old, new, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open-file limit"),
    }
    let hint = lock_hint(&cli.command);
    let log_format = cli.log_format;
    match run(cli) {
        Ok(code) => code,
        // A reader that went away (`sqcow2 map | head`) is not an error.
        Err(err) if is_broken_pipe(&err) => ExitCode::SUCCESS,
        Err(err) => {
            let hint = is_lock_refusal(&err).then_some(hint);
            match log_format {
                // One line a log collector can parse, like every other.
                LogFormat::Json => match hint {
                    Some(hint) => {
                        tracing::error!(error = %format!("{err:#}"), hint, "sqcow2 failed")
                    }
                    None => tracing::error!(error = %format!("{err:#}"), "sqcow2 failed"),
                },
                LogFormat::Text => {
                    eprintln!("sqcow2: {err:#}");
                    if let Some(hint) = hint {
                        eprintln!("{hint}");
                    }
                }
            }
            ExitCode::FAILURE
        }
    }
}

/// The command line. The engine options are global (every command takes
/// them, before or after its name) and described once, at the end of
/// `sqcow2 --help`; each command's help names them in one line.
fn command_line() -> clap::Command {
    let base = Cli::command();
    let mut text =
        String::from("Engine options (every command takes them, before or after its name):\n");
    for arg in base.get_arguments().filter(|a| a.is_global_set()) {
        let long = arg.get_long().unwrap_or_default();
        let value = if arg.get_action().takes_values() {
            let names = arg
                .get_value_names()
                .map(|v| {
                    v.iter()
                        .map(|n| n.to_string())
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_else(|| arg.get_id().as_str().to_uppercase());
            format!(" <{names}>")
        } else {
            String::new()
        };
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        let _ = write!(text, "      --{long}{value}\n          {help}");
        let possible: Vec<String> = arg
            .get_possible_values()
            .iter()
            .map(|p| p.get_name().to_owned())
            .collect();
        if arg.get_action().takes_values() && !possible.is_empty() {
            let _ = write!(text, " [possible values: {}]", possible.join(", "));
        }
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|d| d.to_string_lossy().into_owned())
            .collect();
        if !defaults.is_empty() {
            let _ = write!(text, " [default: {}]", defaults.join(" "));
        }
        text.push_str("\n\n");
    }
    base.mut_args(|a| if a.is_global_set() { a.hide(true) } else { a })
        .after_help(text.trim_end().to_owned())
        .mut_subcommands(|sub| {
            sub.after_help(
                "Engine options (--cache-size, --slice-size, --walk, --max-layers, --max-open-files, --locking, --log-format): see `sqcow2 --help`.",
            )
        })
}

/// Whether `err` is a refusal by the image locks of another process.
fn is_lock_refusal(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<sqcow2_format::Error>()
            .is_some_and(|e| matches!(e.kind, sqcow2_format::ErrorKind::Locked { .. }))
    })
}

/// What to do when the image locks refuse `command`: the way that works
/// for it (a read-out may share; a snapshot or merge of a served chain
/// goes through the daemon; a writer must wait for the other process).
fn lock_hint(command: &Command) -> &'static str {
    match command {
        Command::Info { .. } | Command::Map { .. } | Command::Convert { .. } => {
            "Is another process using the image? -U (--force-share) reads it anyway; the data may be inconsistent while it writes."
        }
        Command::Check { repair: None, .. } => {
            "Is another process using the image? -U (--force-share) checks it anyway; the result may be inconsistent while it writes."
        }
        Command::Snapshot { .. } => {
            "If a `sqcow2 serve` of this chain holds it, take the snapshot through it: `sqcow2 snapshot --live CONTROL NEW` (CONTROL: its --control socket)."
        }
        Command::Merge(_) => {
            "If a `sqcow2 serve` of this chain holds it, merge through it: `sqcow2 merge --live CONTROL FIRST LAST NEW` (CONTROL: its --control socket)."
        }
        _ => {
            "Another process is using the image for what this needs: stop it first (`sqcow2 serve` stops cleanly on SIGTERM)."
        }
    }
}
