//! Model-based tests of the write path: random writes, write-zeroes,
//! discards, flushes and reads on chains of four layers (compressed, zero
//! and discarded clusters below), checked against an in-memory model of the
//! disk, then against QEMU: `qemu-img check` finds nothing and
//! `qemu-img compare` finds the image identical to the model.
//!
//! `SQCOW2_MODEL_SEEDS=N` runs N seeds (default 40, 300 operations each).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{build_chain, qemu_img, run_raw, s, LayerSpec};
use sqcow2_format::{Chain, ChainOptions};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 8 * MIB;

/// Options of the writable top, drawn per seed.
#[derive(Debug)]
struct TopConfig {
    cluster: u64,
    extended_l2: bool,
    v2: bool,
    lazy: bool,
    refcount_bits: u32,
    created_by_qemu: bool,
}

impl TopConfig {
    fn draw(rng: &mut fastrand::Rng) -> Self {
        let cluster = [512u64, 4096, 16384, 65536, 65536][rng.usize(0..5)];
        let v2 = rng.u8(0..5) == 0;
        let extended_l2 = !v2 && cluster >= 16384 && rng.bool();
        Self {
            cluster,
            extended_l2,
            v2,
            lazy: !v2 && rng.u8(0..3) == 0,
            refcount_bits: if v2 {
                16
            } else {
                [1u32, 8, 16, 16, 64][rng.usize(0..5)]
            },
            created_by_qemu: rng.bool(),
        }
    }

    fn options(&self) -> String {
        let mut o = vec![format!("cluster_size={}", self.cluster)];
        o.push(format!("compat={}", if self.v2 { "0.10" } else { "1.1" }));
        if self.extended_l2 {
            o.push("extended_l2=on".into());
        }
        if self.lazy {
            o.push("lazy_refcounts=on".into());
        }
        o.push(format!("refcount_bits={}", self.refcount_bits));
        o.join(",")
    }
}

/// Three read-only layers with data, compressed, zero and discarded
/// clusters; returns the path of the topmost of them.
fn lower_layers(dir: &Path, rng: &mut fastrand::Rng) -> PathBuf {
    let compression = if rng.bool() { "zstd" } else { "zlib" };
    let layers = [
        LayerSpec::new(
            &format!("cluster_size=65536,compression_type={compression}"),
            SIZE,
            &[
                "write -c -P 0x10 0 512k",
                "write -c -P 0x11 2M 1M",
                "write -P 0x12 1M 512k",
                "write -z 1536k 128k",
                "write -P 0x13 6M 2M",
            ],
        ),
        LayerSpec::new(
            "cluster_size=4096",
            SIZE,
            &[
                "write -P 0x20 300k 700k",
                "write -z 2500k 100k",
                "discard 6M 256k",
                "write -P 0x21 7M 4097",
            ],
        ),
        LayerSpec::new(
            "cluster_size=32768,extended_l2=on",
            SIZE,
            &[
                "write -c -P 0x30 4M 64k",
                "write -P 0x31 4200k 3000",
                "write -z 100k 8k",
            ],
        ),
    ];
    build_chain(dir, &layers)
}

fn create_top(dir: &Path, backing: &Path, cfg: &TopConfig) -> PathBuf {
    let top = dir.join("top.qcow2");
    let name = backing.file_name().unwrap().to_str().unwrap();
    let opts = cfg.options();
    if cfg.created_by_qemu {
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &opts,
            "-b",
            name,
            "-F",
            "qcow2",
            s(&top),
        ]);
    } else {
        common::sqcow2(&["create", "-o", &opts, "-b", name, "-F", "qcow2", s(&top)]);
    }
    top
}

fn open_rw(top: &Path, small_cache: bool) -> Chain {
    let opts = ChainOptions {
        writable: true,
        cache_size: if small_cache { 16 << 10 } else { 32 << 20 },
        slice_size: if small_cache { 512 } else { 4096 },
        ..ChainOptions::default()
    };
    Chain::open(top, &opts).unwrap_or_else(|e| panic!("open {}: {e}", top.display()))
}

/// A random range: unaligned, sector-aligned or cluster-aligned.
fn range(rng: &mut fastrand::Rng, cluster: u64) -> (u64, u64) {
    let (mut off, mut len) = (rng.u64(0..SIZE), rng.u64(1..=3 * cluster.max(4096)));
    match rng.u8(0..4) {
        0 => {}
        1 => {
            off &= !511;
            len = len.div_ceil(512) * 512;
        }
        _ => {
            off -= off % cluster;
            len = len.div_ceil(cluster) * cluster;
        }
    }
    (off, len.min(SIZE - off).max(1).min(SIZE - off))
}

fn run_seed(seed: u64, ops: usize) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let below = lower_layers(dir, &mut rng);
    let cfg = TopConfig::draw(&mut rng);
    let ctx = format!("seed {seed}, {cfg:?}");
    let top = create_top(dir, &below, &cfg);

    // Half the seeds index the chain first: writes then go through the
    // resolved slices of indexed mode.
    let indexed = rng.bool();
    if indexed {
        common::sqcow2(&["upgrade", s(&top)]);
    }
    let ctx = format!("{ctx}, indexed {indexed}");

    // The model starts as QEMU's view of the chain.
    let initial = dir.join("initial.raw");
    qemu_img(&["convert", "-O", "raw", s(&top), s(&initial)]);
    let mut model = std::fs::read(&initial).unwrap();

    let small_cache = rng.bool();
    let mut chain = open_rw(&top, small_cache);
    for step in 0..ops {
        let (off, len) = range(&mut rng, cfg.cluster);
        let (o, l) = (off as usize, len as usize);
        match rng.u8(0..20) {
            0..=8 => {
                let mut data = vec![0u8; l];
                rng.fill(&mut data);
                chain
                    .write_at(&data, off)
                    .unwrap_or_else(|e| panic!("{ctx} step {step}: {e}"));
                model[o..o + l].copy_from_slice(&data);
            }
            9..=10 => {
                let unmap = rng.bool();
                chain
                    .write_zeroes(off, len, unmap)
                    .unwrap_or_else(|e| panic!("{ctx} step {step}: {e}"));
                model[o..o + l].fill(0);
            }
            11..=12 => {
                chain
                    .discard(off, len)
                    .unwrap_or_else(|e| panic!("{ctx} step {step}: {e}"));
                // Whole clusters of the top read as zeros, partial ones
                // stay; a v2 top (over its backing file: no zero flag)
                // keeps everything, as QEMU's discard.
                let c = cfg.cluster;
                let first = off.div_ceil(c) * c;
                let end = if off + len == SIZE {
                    SIZE
                } else {
                    (off + len) / c * c
                };
                if first < end && !cfg.v2 {
                    model[first as usize..end as usize].fill(0);
                }
            }
            13 => chain
                .flush()
                .unwrap_or_else(|e| panic!("{ctx} step {step}: {e}")),
            14 => {
                chain
                    .close()
                    .unwrap_or_else(|e| panic!("{ctx} step {step}: {e}"));
                chain = open_rw(&top, small_cache);
            }
            _ if std::env::var("SQCOW2_MODEL_DEBUG").is_ok() => {
                let mut all = vec![0u8; SIZE as usize];
                chain.read_at(&mut all, 0).unwrap();
                if let Some(b) = all.iter().zip(&model).position(|(a, b)| a != b) {
                    panic!(
                        "{ctx} step {step}: byte {b} differs ({} vs model {})",
                        all[b], model[b]
                    );
                }
            }
            _ => {
                let mut buf = vec![0u8; l];
                chain
                    .read_at(&mut buf, off)
                    .unwrap_or_else(|e| panic!("{ctx} step {step}: {e}"));
                assert!(
                    buf == model[o..o + l],
                    "{ctx} step {step}: read {off}+{len} differs from the model"
                );
            }
        }
    }
    assert_eq!(chain.index().is_used(), indexed, "{ctx}");
    let mut all = vec![0u8; SIZE as usize];
    chain.read_at(&mut all, 0).unwrap();
    assert!(all == model, "{ctx}: final content differs from the model");
    chain.close().unwrap();

    let check = run_raw(Command::new("qemu-img").args(["check", s(&top)]));
    let out = String::from_utf8_lossy(&check.stdout);
    assert_eq!(
        check.status.code(),
        Some(0),
        "{ctx}: qemu-img check:\n{out}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let model_path = dir.join("model.raw");
    std::fs::write(&model_path, &model).unwrap();
    let cmp = run_raw(Command::new("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "qcow2",
        s(&model_path),
        s(&top),
    ]));
    assert_eq!(
        cmp.status.code(),
        Some(0),
        "{ctx}: qemu-img compare: {}{}",
        String::from_utf8_lossy(&cmp.stdout),
        String::from_utf8_lossy(&cmp.stderr)
    );
}

#[test]
fn random_operations_match_the_model() {
    let seeds: u64 = std::env::var("SQCOW2_MODEL_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    for seed in 0..seeds {
        run_seed(seed, 300);
    }
}
