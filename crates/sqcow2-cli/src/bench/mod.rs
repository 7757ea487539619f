//! `sqcow2 bench`: the load generator and the comparison suite.

pub mod load;
pub mod plot;
pub mod report;
pub mod servers;
pub mod suite;

/// What to benchmark.
#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Drive a vhost-user-blk socket (or a raw file) with a load and
    /// report IOPS, MB/s and latency percentiles.
    Load(load::LoadArgs),
    /// sqcow2 vs qemu-storage-daemon vs the raw-file limit on generated
    /// chains of 1 to 1000 layers; writes JSON, plots and a README section.
    Suite(suite::SuiteArgs),
}

pub fn run(cmd: &BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Load(a) => load::run_cli(a),
        BenchCommand::Suite(a) => suite::run(a),
    }
}
