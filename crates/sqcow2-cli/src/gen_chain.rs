//! `sqcow2 gen-chain`: generate a tagged qcow2 chain for tests and
//! benchmarks.

use std::io::{IsTerminal, Write};
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use sqcow2_format::gen::{generate, Distribution, GenOptions};

use crate::output::parse_size;

/// `--distribution` values.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum DistributionArg {
    /// Any cluster equally likely.
    Uniform,
    /// Hot clusters rewritten by many layers.
    Zipf,
    /// Runs of consecutive clusters.
    SequentialRuns,
}

/// Options of `gen-chain`.
#[derive(Debug, clap::Args)]
pub struct GenArgs {
    /// Number of layers, the top included.
    #[arg(long, default_value_t = 10)]
    pub layers: usize,
    /// Virtual disk size.
    #[arg(long, default_value = "1G")]
    pub size: String,
    /// Cluster size of every layer.
    #[arg(long, default_value = "64k")]
    pub cluster_size: String,
    /// Fraction of the disk written by the whole chain, shared by the layers.
    #[arg(long, default_value_t = 0.5)]
    pub fill: f64,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// How each layer chooses its clusters.
    #[arg(long, value_enum, default_value = "uniform")]
    pub distribution: DistributionArg,
    /// Write a chain index for the top (the default).
    #[arg(long, overrides_with = "no_index")]
    pub index: bool,
    /// Leave the chain vanilla (walk mode).
    #[arg(long)]
    pub no_index: bool,
    /// Directory to create the layers in (created if needed; existing files are never overwritten: a name taken is refused).
    pub dir: std::path::PathBuf,
}

/// Runs `sqcow2 gen-chain`; prints the path of the top.
pub fn run(args: &GenArgs) -> anyhow::Result<()> {
    let opts = GenOptions {
        layers: args.layers,
        size: parse_size(&args.size)?,
        cluster_size: parse_size(&args.cluster_size)?,
        fill: args.fill,
        seed: args.seed,
        distribution: match args.distribution {
            DistributionArg::Uniform => Distribution::Uniform,
            DistributionArg::Zipf => Distribution::Zipf,
            DistributionArg::SequentialRuns => Distribution::SequentialRuns,
        },
        index: !args.no_index,
    };
    anyhow::ensure!(
        opts.cluster_size.is_power_of_two() && (512..=2 << 20).contains(&opts.cluster_size),
        "cluster size must be a power of two from 512 to 2M"
    );
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new(opts.layers as u64);
        b.set_style(
            ProgressStyle::with_template("layers {bar:40} {pos}/{len} eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let top = generate(Path::new(&args.dir), &opts, &mut |done, _| {
        bar.set_position(done)
    })?;
    bar.finish_and_clear();
    writeln!(std::io::stdout(), "{}", top.display())?;
    Ok(())
}
