//! Commands that talk to a running `sqcow2 serve` over its control socket:
//! `snapshot --live`, `info --live`, `stats`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use sqcow2_vhost::protocol::{
    Activity, Command, ExportAddRequest, ExportInfo, ExportListResult, ExportRemoved, Info,
    IoThrottleRequest, PrometheusText, Reply, Request, SnapshotResult, Stats, StatsFormat,
};

use crate::output::OutputFormat;
use crate::readout;

/// The export requests are for (`--export-id`), set once at start.
static EXPORT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// Sets the export requests name (`--export-id`); once, at start.
pub fn set_export(export: Option<String>) {
    let _ = EXPORT.set(export);
}

/// Sends one command (for the export `--export-id` names, if it does);
/// returns the result of a successful reply.
pub fn request<T: DeserializeOwned>(control: &Path, command: Command) -> anyhow::Result<T> {
    let mut stream = UnixStream::connect(control)
        .with_context(|| format!("connecting to the control socket {}", control.display()))?;
    let export = if command.is_daemon_command() {
        None
    } else {
        EXPORT.get().cloned().flatten()
    };
    let mut line = Request {
        id: Value::from(1),
        export,
        command,
    }
    .to_line();
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut reply = String::new();
    BufReader::new(stream).read_line(&mut reply)?;
    let reply: Reply = serde_json::from_str(&reply).context("the reply is not a control reply")?;
    reply.into_result().map_err(anyhow::Error::msg)
}

/// `value` as JSON, or as `human` renders it.
pub(crate) fn print<T: Serialize>(
    value: &T,
    output: OutputFormat,
    human: impl Fn(&T) -> String,
) -> anyhow::Result<()> {
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(value)?),
        OutputFormat::Human => print!("{}", human(value)),
    }
    Ok(())
}

pub fn snapshot(control: &Path, new: &Path, output: OutputFormat) -> anyhow::Result<()> {
    let path = std::path::absolute(new)?;
    let r: SnapshotResult = request(control, Command::Snapshot { path })?;
    print(&r, output, readout::snapshot)
}

/// `sqcow2 activate CONTROL` / `sqcow2 inactivate CONTROL`.
pub fn set_active(control: &Path, active: bool, output: OutputFormat) -> anyhow::Result<()> {
    let command = if active {
        Command::Activate
    } else {
        Command::Inactivate
    };
    let r: Activity = request(control, command)?;
    print(&r, output, readout::activity)
}

pub fn info(control: &Path, output: OutputFormat) -> anyhow::Result<()> {
    let r: Info = request(control, Command::Info)?;
    print(&r, output, readout::info)
}

/// Arguments of `sqcow2 stats`.
#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    /// Output format: human, json, or prometheus (text exposition format).
    #[arg(long, default_value = "human")]
    output: String,
    /// Print again every SECONDS until interrupted.
    #[arg(long)]
    watch: Option<f64>,
    /// The daemon's control socket.
    control: std::path::PathBuf,
}

pub fn stats(args: &StatsArgs) -> anyhow::Result<()> {
    loop {
        let json = Command::Stats {
            format: StatsFormat::Json,
        };
        match args.output.as_str() {
            "prometheus" => {
                let r: PrometheusText = request(
                    &args.control,
                    Command::Stats {
                        format: StatsFormat::Prometheus,
                    },
                )?;
                print!("{}", r.text);
            }
            "json" => print(
                &request::<Stats>(&args.control, json)?,
                OutputFormat::Json,
                readout::stats,
            )?,
            "human" => print(
                &request::<Stats>(&args.control, json)?,
                OutputFormat::Human,
                readout::stats,
            )?,
            other => bail!("unknown output format {other}"),
        }
        std::io::stdout().flush()?;
        match args.watch {
            Some(s) if s > 0.0 => std::thread::sleep(Duration::from_secs_f64(s)),
            _ => return Ok(()),
        }
    }
}

/// `sqcow2 export ...`.
#[derive(Debug, clap::Subcommand)]
pub enum ExportCommand {
    /// Serve one more chain (the daemon opens it as at its start).
    Add {
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// The export's name.
        #[arg(long)]
        id: String,
        /// The vhost-user socket to create.
        #[arg(long)]
        socket: std::path::PathBuf,
        /// Export read-only.
        #[arg(long)]
        read_only: bool,
        /// Request queues offered (default 1).
        #[arg(long)]
        num_queues: Option<u16>,
        /// Largest virtqueue the frontend may set up (default 256).
        #[arg(long)]
        queue_size: Option<u16>,
        /// Backing files must lie inside this directory.
        #[arg(long)]
        backing_root: Option<std::path::PathBuf>,
        /// I/O limits, `KEY=VALUE,...` with QEMU's throttle names
        /// (iops-total, bps-write-max, ...).
        #[arg(long, value_name = "KEY=VALUE,...")]
        limits: Option<String>,
        /// The throttle group it joins (its limits shared).
        #[arg(long)]
        group: Option<String>,
        /// The daemon's control socket.
        control: std::path::PathBuf,
        /// The top image of the chain.
        image: std::path::PathBuf,
    },
    /// Stop serving an export: its guest's requests finish, its chain is
    /// flushed and closed clean, its socket removed.
    Remove {
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// The daemon's control socket.
        control: std::path::PathBuf,
        /// The export.
        id: String,
    },
    /// The exports served.
    List {
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
        output: OutputFormat,
        /// The daemon's control socket.
        control: std::path::PathBuf,
    },
}

pub fn export(command: &ExportCommand) -> anyhow::Result<()> {
    match command {
        ExportCommand::Add {
            output,
            id,
            socket,
            read_only,
            num_queues,
            queue_size,
            backing_root,
            limits,
            group,
            control,
            image,
        } => {
            let absolute = |p: &Path| std::path::absolute(p);
            let limits = limits_arg(limits.as_deref())?;
            let r: ExportInfo = request(
                control,
                Command::ExportAdd(ExportAddRequest {
                    id: id.clone(),
                    socket: absolute(socket)?,
                    image: absolute(image)?,
                    read_only: *read_only,
                    num_queues: *num_queues,
                    queue_size: *queue_size,
                    backing_root: backing_root.as_deref().map(absolute).transpose()?,
                    group: group.clone(),
                    limits,
                }),
            )?;
            print(&r, *output, |e| readout::exports(std::slice::from_ref(e)))
        }
        ExportCommand::Remove {
            output,
            control,
            id,
        } => {
            let r: ExportRemoved = request(control, Command::ExportRemove { id: id.clone() })?;
            print(&r, *output, |r| format!("removed {}\n", r.id))
        }
        ExportCommand::List { output, control } => {
            let r: ExportListResult = request(control, Command::ExportList)?;
            print(&r, *output, |r| readout::exports(&r.exports))
        }
    }
}

/// `KEY=VALUE,...` of limit keys as [`sqcow2_vhost::IoLimits`] (none:
/// no limit).
fn limits_arg(text: Option<&str>) -> anyhow::Result<sqcow2_vhost::IoLimits> {
    match text.filter(|t| !t.is_empty()) {
        Some(text) => crate::serve::limits_only(text),
        None => Ok(Default::default()),
    }
}

/// Arguments of `sqcow2 set-io-throttle`.
#[derive(Debug, clap::Args)]
pub struct SetIoThrottleArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    output: OutputFormat,
    /// The throttle group the export joins (or stays in): its other
    /// exports take the limits too.
    #[arg(long)]
    group: Option<String>,
    /// The daemon's control socket.
    control: std::path::PathBuf,
    /// `KEY=VALUE,...` with QEMU's throttle names (iops-total,
    /// bps-read-max, ...); none lifts the export's limits.
    limits: Option<String>,
}

/// `sqcow2 set-io-throttle CONTROL [LIMITS]`: QEMU's
/// `block_set_io_throttle` for a served export (`--export-id`).
pub fn set_io_throttle(args: &SetIoThrottleArgs) -> anyhow::Result<()> {
    let limits = limits_arg(args.limits.as_deref())?;
    let r: Option<sqcow2_vhost::ThrottleCounters> = request(
        &args.control,
        Command::SetIoThrottle(IoThrottleRequest {
            group: args.group.clone(),
            limits,
        }),
    )?;
    print(&r, args.output, |r| match r {
        Some(t) => format!(
            "group {}: {}\n",
            t.group,
            serde_json::to_string(&t.limits).unwrap_or_default()
        ),
        None => "no limits\n".into(),
    })
}
