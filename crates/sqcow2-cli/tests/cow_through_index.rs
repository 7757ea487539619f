//! Writes into a fresh top find what lies below through the chain index:
//! the source of a copy-on-write, and what write-zeroes and discard leave
//! visible, cost the same metadata whatever the chain length (counted, not
//! timed), and the bytes are QEMU's: the same writes by `qemu-io` on a copy
//! of the chain give the same disk, and every layer stays `qemu-img check`
//! clean.

mod common;

use std::path::{Path, PathBuf};

use common::{assert_check_clean, qemu_img, qemu_io, s, sha256_file, sqcow2};
use sqcow2_format::gen::{generate, owners, parse_tag, plan, Distribution, GenOptions};
use sqcow2_format::{Chain, ChainOptions, LayerIndex};

const MIB: u64 = 1 << 20;
const CLUSTER: u64 = 65536;

/// A generated indexed chain of `layers` and a fresh top over it made by
/// `sqcow2 snapshot`, its own index written (`sqcow2 upgrade`, as `serve`
/// does) unless `pending`; returns the new top and the generator's options.
fn fresh_top(dir: &Path, layers: usize, pending: bool) -> (PathBuf, GenOptions) {
    let opts = GenOptions {
        layers,
        size: 64 * MIB,
        cluster_size: CLUSTER,
        fill: 0.6,
        seed: 5,
        distribution: Distribution::Uniform,
        index: true,
    };
    let top = generate(dir, &opts, &mut |_, _| {}).unwrap();
    let new = dir.join("new.qcow2");
    sqcow2(&["snapshot", s(&top), s(&new)]);
    if !pending {
        sqcow2(&["upgrade", s(&new)]);
    }
    (new, opts)
}

/// What `count` partial-cluster writes over the clusters held deepest in
/// the chain cost in metadata lookups; checks the bytes read back.
fn cow_from_the_bottom(layers: usize, count: usize, pending: bool) -> Lookups {
    let tmp = tempfile::tempdir().unwrap();
    let (new, opts) = fresh_top(tmp.path(), layers, pending);
    let clusters = opts.size / opts.cluster_size;
    let owner = owners(&plan(&opts), clusters, layers - 1);
    let mut deepest: Vec<(u32, u64)> = (0..clusters)
        .filter_map(|c| owner[c as usize].map(|l| (l, c)))
        .collect();
    deepest.sort_unstable();
    deepest.truncate(count);
    assert_eq!(deepest.len(), count, "clusters of a {layers}-layer chain");
    assert!(deepest[count - 1].0 < layers as u32 / 2, "{deepest:?}");
    let chain = Chain::open(
        &new,
        &ChainOptions {
            writable: true,
            ..ChainOptions::default()
        },
    )
    .unwrap();
    assert!(chain.index().is_used(), "{layers} layers: not indexed");
    let below_top = LayerIndex(layers - 1);
    let covers = chain.index().covers();
    if pending {
        assert!(covers < Some(below_top), "{covers:?}");
    } else {
        assert_eq!(covers, Some(below_top));
    }
    let before = chain.diagnostics().cache();
    for (i, &(_, c)) in deepest.iter().enumerate() {
        // A different offset in each cluster: the rest is copied from
        // below.
        let at = c * CLUSTER + (i as u64 * 4096) % CLUSTER;
        chain.write_at(&[0xab; 4096], at).unwrap();
    }
    let after = chain.diagnostics().cache();
    let mut buf = vec![0u8; CLUSTER as usize];
    for (i, &(layer, c)) in deepest.iter().enumerate() {
        chain.read_at(&mut buf, c * CLUSTER).unwrap();
        let written = ((i as u64 * 4096) % CLUSTER) as usize;
        for (b, block) in buf.chunks(4096).enumerate() {
            if b * 4096 == written {
                assert!(block.iter().all(|&x| x == 0xab), "cluster {c}: write lost");
            } else {
                assert_eq!(parse_tag(block), Some((layer, c)), "cluster {c} block {b}");
            }
        }
    }
    chain.close().unwrap();
    assert_check_clean(&new);
    Lookups {
        lookups: after.hits + after.misses - before.hits - before.misses,
        steps_down: after.hit_unallocated - before.hit_unallocated,
        loads: after.loads - before.loads,
    }
}

/// Counters of the unified cache over some writes.
#[derive(Debug)]
struct Lookups {
    /// Cache lookups.
    lookups: u64,
    /// Lookups that said "look further down the chain".
    steps_down: u64,
    /// Metadata slices read from files.
    loads: u64,
}

/// Partial writes over clusters deep in a 2-layer and a 300-layer chain,
/// the fresh top's own index written or still pending.
fn same_lookups_over_300_layers_as_over_2(pending: bool) {
    let short = cow_from_the_bottom(2, 24, pending);
    let long = cow_from_the_bottom(300, 24, pending);
    eprintln!("pending {pending}: 2 layers: {short:?}\n300 layers: {long:?}");
    // A walk steps through every layer (hit_unallocated) and loads each
    // one's L2 slice; through the index neither grows with the chain.
    assert!(
        long.steps_down <= short.steps_down,
        "300 layers stepped down {} times, 2 layers {}",
        long.steps_down,
        short.steps_down
    );
    assert!(
        long.loads <= short.loads + 4,
        "300 layers loaded {} slices, 2 layers {}",
        long.loads,
        short.loads
    );
    assert!(
        long.lookups <= short.lookups + 4,
        "300 layers: {} lookups, 2 layers: {}",
        long.lookups,
        short.lookups
    );
}

#[test]
fn copy_on_write_looks_up_as_much_over_300_layers_as_over_2() {
    same_lookups_over_300_layers_as_over_2(false);
}

#[test]
fn copy_on_write_under_a_pending_index_looks_up_as_much_too() {
    same_lookups_over_300_layers_as_over_2(true);
}

/// A chain QEMU made with every kind of cluster at depth (data, zstd
/// compressed, zero, a raw base, a shorter layer, an extended-L2 layer),
/// indexed by `sqcow2 upgrade`, and a fresh top over it (`extended` makes
/// the top extended-L2, with subclusters), its own index written unless
/// `pending`.
fn qemu_chain(dir: &Path, extended: bool, pending: bool) -> PathBuf {
    let base = dir.join("base.raw");
    std::fs::write(&base, vec![0x11u8; 6 * MIB as usize]).unwrap();
    let specs = [
        ("l1.qcow2", "compression_type=zstd", 8 * MIB),
        ("l2.qcow2", "cluster_size=65536,extended_l2=on", 8 * MIB),
        ("l3.qcow2", "", 7 * MIB),
        ("l4.qcow2", "", 8 * MIB),
    ];
    let mut prev = ("base.raw".to_owned(), "raw");
    for (i, (name, o, size)) in specs.iter().enumerate() {
        let p = dir.join(name);
        let mut args = vec!["create", "-q", "-f", "qcow2", "-b", &prev.0, "-F", prev.1];
        if !o.is_empty() {
            args.extend(["-o", o]);
        }
        let size = size.to_string();
        args.extend([s(&p), &size]);
        qemu_img(&args);
        let i = i as u64;
        qemu_io(
            &p,
            &[
                format!("write -P {} {} 300k", 0x20 + i, i * MIB),
                format!("write -c -P {} {} 64k", 0x30 + i, 4 * MIB + i * CLUSTER),
                format!("write -z {} 64k", 5 * MIB + i * CLUSTER),
                format!("write -P {} {} 4k", 0x40 + i, 6 * MIB + 8192 * i),
                format!(
                    "write -P {} {} 12k",
                    0x50 + i,
                    6 * MIB + 512 * 1024 + 20480 * i
                ),
            ],
        );
        prev = (name.to_string(), "qcow2");
    }
    let old = dir.join("l4.qcow2");
    let top = dir.join("top.qcow2");
    if extended {
        common::qemu_overlay(&top, "l4.qcow2", "qcow2", &["-o", "extended_l2=on"], None);
    } else {
        sqcow2(&["upgrade", s(&old)]);
        sqcow2(&["snapshot", s(&old), s(&top)]);
    }
    if !pending {
        sqcow2(&["upgrade", s(&top)]);
    }
    top
}

/// Partial writes at every 4 KiB offset of clusters whose data lies at
/// every depth, write-zeroes and discards over data at depth, in `qemu-io`
/// syntax (which `sqcow2 io` shares).
fn writes() -> Vec<String> {
    let mut cmds = Vec::new();
    // One cluster per kind and depth: data at 0..3 MiB (layer i at i MiB),
    // compressed at 4 MiB, zero at 5 MiB, small writes at 6 and 6.5 MiB,
    // the raw base everywhere else (6 MiB long), and beyond layer 3's end
    // (7 MiB).
    let mut clusters: Vec<u64> = (0..4).map(|i| i * MIB / CLUSTER).collect();
    clusters.extend((0..4).map(|i| (4 * MIB + i * CLUSTER) / CLUSTER));
    clusters.extend((0..4).map(|i| (5 * MIB + i * CLUSTER) / CLUSTER));
    clusters.extend([
        6 * MIB / CLUSTER,
        (6 * MIB + 512 * 1024) / CLUSTER,
        7 * MIB / CLUSTER + 1,
        2 * MIB / CLUSTER + 8,
    ]);
    for (n, &c) in clusters.iter().enumerate() {
        let at = (n as u64 * 4096 + 512 * (n as u64 % 3)) % CLUSTER;
        cmds.push(format!("write -P {} {} 3584", 0x60 + n, c * CLUSTER + at));
    }
    // Whole-cluster and partial write-zeroes and discards over data at
    // depth (layers 0-3 and the raw base).
    cmds.push(format!("write -z {} 64k", MIB + 2 * CLUSTER));
    cmds.push(format!("write -z {} 10000", 3 * MIB + 1000));
    cmds.push(format!("write -z -u {} 128k", 2 * MIB + 4 * CLUSTER));
    cmds.push(format!("discard {} 64k", 3 * MIB + 3 * CLUSTER));
    cmds.push(format!("discard {} 192k", 5 * MIB + 8 * CLUSTER));
    cmds.push(format!(
        "write -z {} 4096",
        6 * MIB + 512 * 1024 + 20480 * 3 + 4096
    ));
    cmds
}

fn qemu_view(top: &Path, dir: &Path, name: &str) -> String {
    let raw = dir.join(name);
    qemu_img(&["convert", "-O", "raw", s(top), s(&raw)]);
    sha256_file(&raw)
}

fn same_writes_as_qemu(extended: bool, pending: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("ours");
    let theirs = tmp.path().join("theirs");
    std::fs::create_dir(&ours).unwrap();
    let top = qemu_chain(&ours, extended, pending);
    let copy = std::process::Command::new("cp")
        .args(["-a", s(&ours), s(&theirs)])
        .status()
        .unwrap();
    assert!(copy.success());
    let chain = Chain::open(&top, &ChainOptions::default()).unwrap();
    assert!(chain.index().is_used(), "the fresh top is not indexed");
    let below_top = Some(LayerIndex(4));
    assert_eq!(chain.index().covers() == below_top, !pending);
    drop(chain);
    let cmds = writes();
    let mut args = vec!["io".to_owned()];
    for c in &cmds {
        args.extend(["-c".to_owned(), c.clone()]);
    }
    args.push(s(&top).to_owned());
    sqcow2(&args.iter().map(String::as_str).collect::<Vec<_>>());
    qemu_io(&theirs.join("top.qcow2"), &cmds);
    assert_eq!(
        qemu_view(&top, tmp.path(), "ours.raw"),
        qemu_view(&theirs.join("top.qcow2"), tmp.path(), "theirs.raw"),
        "the disk differs from QEMU's after the same writes"
    );
    for name in ["l1.qcow2", "l2.qcow2", "l3.qcow2", "l4.qcow2", "top.qcow2"] {
        assert_check_clean(&ours.join(name));
    }
    // sqcow2 reads its own top as QEMU does.
    common::assert_same_as_qemu(&top);
}

#[test]
fn copy_on_write_from_every_depth_gives_qemus_disk() {
    same_writes_as_qemu(false, false);
}

#[test]
fn copy_on_write_under_a_pending_index_gives_qemus_disk() {
    same_writes_as_qemu(false, true);
}

#[test]
fn subcluster_writes_over_every_depth_give_qemus_disk() {
    same_writes_as_qemu(true, false);
}
