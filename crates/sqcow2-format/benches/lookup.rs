//! Lookup latency of the chain engine, walk mode against indexed mode, at
//! chain lengths 1, 2, 10, 100 and 1000 files (generated 1 GiB chains):
//!
//! * `hit`: the cluster's metadata slices are cached; the cluster is held
//!   by the base, so a walk crosses every layer;
//! * `hit_unallocated`: cached, and no layer holds the cluster;
//! * `cold`: the metadata cache is emptied before each lookup (file data
//!   comes from the page cache), for a base cluster in a region where the
//!   top holds nothing (as after a snapshot);
//! * `cold_busy`: the same for a base cluster in a region (one 4 KiB L2
//!   slice of the top, 32 MiB) where the top does hold data.
//!
//! `scripts/bench-lookup.sh` runs this and prints the table for the README.

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use sqcow2_format::gen::{generate, owners, plan, Distribution, GenOptions};
use sqcow2_format::{Chain, ChainOptions, GuestOffset};

const SIZE: u64 = 1 << 30;
const CLUSTER: u64 = 65536;

struct Setup {
    _dir: tempfile::TempDir,
    indexed: Chain,
    walked: Chain,
    base_cluster: u64,
    busy_cluster: u64,
    empty_cluster: u64,
}

fn setup(layers: usize) -> Setup {
    let dir = tempfile::tempdir().expect("temporary directory");
    let opts = GenOptions {
        layers,
        size: SIZE,
        cluster_size: CLUSTER,
        fill: 0.5,
        seed: 42,
        distribution: Distribution::Uniform,
        index: true,
    };
    let top = generate(dir.path(), &opts, &mut |_, _| {}).expect("generate chain");
    let p = plan(&opts);
    let owner = owners(&p, SIZE / CLUSTER, layers - 1);
    let region = |c: u64| c / 512;
    let top_regions: std::collections::HashSet<u64> =
        p[layers - 1].iter().map(|&c| region(c)).collect();
    // A base cluster in a region where the top holds nothing (or does);
    // any base cluster when no such region exists (dense tops).
    let base = |busy: bool| {
        let find = |want: Option<bool>| {
            owner.iter().enumerate().position(|(c, o)| {
                *o == Some(0)
                    && want
                        .is_none_or(|b| layers == 1 || top_regions.contains(&region(c as u64)) == b)
            })
        };
        find(Some(busy))
            .or_else(|| find(None))
            .expect("base cluster") as u64
    };
    let base_cluster = base(false);
    let busy_cluster = base(true);
    let empty_cluster = owner
        .iter()
        .position(|o| o.is_none())
        .expect("empty cluster") as u64;
    let open = |use_index| {
        Chain::open(
            Path::new(&top),
            &ChainOptions {
                use_index,
                ..ChainOptions::default()
            },
        )
        .expect("open chain")
    };
    Setup {
        indexed: open(true),
        walked: open(false),
        _dir: dir,
        base_cluster,
        busy_cluster,
        empty_cluster,
    }
}

fn lookups(c: &mut Criterion) {
    let mut group = c.benchmark_group("lookup");
    group
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    for layers in [1usize, 2, 10, 100, 1000] {
        let s = setup(layers);
        assert!(layers == 1 || s.indexed.index().is_used());
        for (mode, chain) in [("indexed", &s.indexed), ("walk", &s.walked)] {
            let at = GuestOffset(s.base_cluster * CLUSTER);
            let empty = GuestOffset(s.empty_cluster * CLUSTER);
            chain.resolve(at, 4096, false).expect("warm");
            chain.resolve(empty, 4096, false).expect("warm");
            group.bench_with_input(
                BenchmarkId::new(format!("hit/{mode}"), layers),
                &at,
                |b, &at| b.iter(|| black_box(chain.resolve(at, 4096, false).expect("lookup"))),
            );
            group.bench_with_input(
                BenchmarkId::new(format!("hit_unallocated/{mode}"), layers),
                &empty,
                |b, &at| b.iter(|| black_box(chain.resolve(at, 4096, false).expect("lookup"))),
            );
            let busy = GuestOffset(s.busy_cluster * CLUSTER);
            for (name, at) in [("cold", at), ("cold_busy", busy)] {
                group.bench_with_input(
                    BenchmarkId::new(format!("{name}/{mode}"), layers),
                    &at,
                    |b, &at| {
                        b.iter_batched(
                            || chain.diagnostics().clear_cache(),
                            |()| black_box(chain.resolve(at, 4096, false).expect("lookup")),
                            BatchSize::PerIteration,
                        )
                    },
                );
            }
        }
    }
    group.finish();
}

criterion_group!(benches, lookups);
criterion_main!(benches);
