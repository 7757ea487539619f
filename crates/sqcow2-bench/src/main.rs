//! `sqcow2-bench`: the benchmark harness, kept out of the shipped `sqcow2`
//! binary. `load` drives a vhost-user-blk socket (or a raw file) with
//! libblkio; `suite` compares sqcow2 with qemu-storage-daemon on generated
//! chains and rewrites the benchmark section of `docs/measured.md`.

mod delay_proxy;
mod fixtures;
mod load;
mod objstore;
mod page_cache;
mod phases;
mod plot;
mod remote;
mod report;
mod results;
mod servers;
mod slowfs;
mod spread;
mod spread_seq;
mod suite;
mod wakeup;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Benchmarks of sqcow2.
#[derive(Debug, Parser)]
#[command(name = "sqcow2-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Drive a vhost-user-blk socket (or a raw file) with a load and
    /// report IOPS, MB/s and latency percentiles.
    Load(load::LoadArgs),
    /// sqcow2 vs qemu-storage-daemon vs the raw-file limit on generated
    /// chains of 1 to 10000 layers; writes JSON, plots and a Markdown section.
    Suite(suite::SuiteArgs),
    /// Chains on remote storage (a FUSE filesystem adding a fixed delay to
    /// every read): cold random reads, sqcow2 vs qemu-storage-daemon.
    Remote(remote::RemoteArgs),
    /// Mount a directory's files read-only through FUSE, every read
    /// answered a fixed delay later (remote storage on one machine);
    /// unmounts on Ctrl-C or SIGTERM.
    Slowfs(slowfs::SlowfsArgs),
    /// The kernel's cost of a long chain alone: the same bytes spread
    /// over 1 to 10,000 raw files, random 4 KiB reads with io_uring in
    /// process.
    Spread(spread::SpreadArgs),
    /// The kernel's cost of the suite's sequential reads of a long chain
    /// alone: the chain's clusters in one raw file per layer, read 1 MiB
    /// at a time, against one raw file.
    SpreadSeq(spread_seq::SpreadSeqArgs),
    /// A TCP proxy adding a round trip to every exchange (the network
    /// between a host and its object store); prints `listening=ADDR`.
    DelayProxy(delay_proxy::DelayProxyArgs),
    /// A long chain whose layers below the top are in an S3 store (the
    /// environment names it: `scripts/object-store.sh`), served through a
    /// proxy adding 0, 5 and 20 ms round trips: cold and warm reads,
    /// requests per guest read, against local disk and the store itself.
    ObjectStore(objstore::ObjStoreArgs),
    /// The machine's own latency beside a load: how late a real-time
    /// thread sleeping 1 ms at a time wakes up (a floor under any
    /// request's latency there).
    WakeupLatency(wakeup::WakeupArgs),
}

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Text for people.
    Human,
    /// JSON for programs.
    Json,
}

/// Parses a size like qemu-img.
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    Ok(sqcow2_format::parse_size(s)?)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let result = match &cli.command {
        Command::Load(a) => load::run_cli(a),
        Command::Suite(a) => suite::run(a),
        Command::Remote(a) => remote::run(a),
        Command::Slowfs(a) => slowfs::run_cli(a),
        Command::Spread(a) => spread::run_cli(a),
        Command::SpreadSeq(a) => spread_seq::run_cli(a),
        Command::WakeupLatency(a) => wakeup::run_cli(a),
        Command::DelayProxy(a) => delay_proxy::run_cli(a),
        Command::ObjectStore(a) => objstore::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sqcow2-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
