//! Conformance: for chains QEMU writes, sqcow2 returns exactly QEMU's bytes
//! (sha256 of `convert -O raw`) and QEMU's data/zero extents (`map`).
//!
//! Every image is generated here with `qemu-img` and `qemu-io`.

mod common;

use common::{
    assert_full_map_equal, assert_same_as_qemu, build_chain, qemu_img, qemu_io, qemu_overlay, s,
    LayerSpec,
};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temporary directory")
}

const MIB: u64 = 1 << 20;

/// Writes at unaligned offsets, zero writes, discards and a compressed
/// write, which exercise every kind of L2 entry of one image.
fn mixed_cmds(cluster: u64) -> Vec<String> {
    vec![
        format!("write -P 0x11 0 {}", cluster * 3),
        format!("write -P 0x22 {} 1000", cluster * 5 + 17),
        format!("write -P 0x33 {} {}", cluster * 8 - 512, cluster + 1024),
        format!("write -P 0 {} {}", cluster * 12, cluster),
        format!("write -z {} {}", cluster * 14, cluster * 2),
        format!("write -P 0x44 {} {}", cluster * 20, cluster * 2),
        format!("discard {} {}", cluster * 20, cluster),
        format!("write -c -P 0x55 {} {}", cluster * 24, cluster * 2),
    ]
}

fn single_image(opts: &str, cluster: u64) {
    let dir = tmp();
    let cmds = mixed_cmds(cluster);
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let size = (cluster * 40).max(4 * MIB);
    let top = build_chain(dir.path(), &[LayerSpec::new(opts, size, &cmds)]);
    assert_same_as_qemu(&top);
    assert_full_map_equal(&top);
}

#[test]
fn v2_image() {
    single_image("compat=0.10,cluster_size=65536", 65536);
}

#[test]
fn v3_cluster_512() {
    single_image("cluster_size=512", 512);
}

#[test]
fn v3_cluster_4k() {
    single_image("cluster_size=4096", 4096);
}

#[test]
fn v3_cluster_64k() {
    single_image("cluster_size=65536", 65536);
}

#[test]
fn v3_cluster_2m() {
    single_image("cluster_size=2097152", 2 * MIB);
}

#[test]
fn refcount_widths() {
    for bits in [1, 8, 64] {
        single_image(&format!("refcount_bits={bits},cluster_size=4096"), 4096);
    }
}

#[test]
fn extended_l2_subclusters() {
    for cluster in [16384u64, 65536, 2 * MIB] {
        let dir = tmp();
        let sc = cluster / 32;
        let base = LayerSpec::new(
            &format!("cluster_size={cluster}"),
            cluster * 16,
            &[&format!("write -P 0xa1 0 {}", cluster * 16)],
        );
        let cmds = [
            format!("write -P 0xb2 {} {}", sc * 3, sc),
            format!("write -P 0xb3 {} 700", sc * 9 + 100),
            format!("write -z {} {}", sc * 12, sc * 2),
            format!("discard {} {}", cluster * 2, cluster),
            format!("write -P 0xb4 {} {}", cluster * 4 + sc * 31, sc * 2),
            format!("write -c -P 0xb5 {} {}", cluster * 8, cluster),
            format!("write -z {} {}", cluster * 10, cluster),
        ];
        let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
        let top = LayerSpec::new(
            &format!("cluster_size={cluster},extended_l2=on"),
            cluster * 16,
            &cmds,
        );
        let top = build_chain(dir.path(), &[base, top]);
        assert_same_as_qemu(&top);
        assert_full_map_equal(&top);
    }
}

/// A base converted with `qemu-img convert -c`, under an overlay.
fn compressed_base(compression: &str, cluster: u64, extended_l2: bool) {
    let dir = tmp();
    let src = dir.path().join("src.qcow2");
    let size = (cluster * 64).max(8 * MIB);
    qemu_img(&["create", "-q", "-f", "qcow2", s(&src), &size.to_string()]);
    qemu_io(
        &src,
        &[
            "write -P 0x61 0 1M".into(),
            format!("write -P 0x62 {} 123457", 2 * MIB + 999),
            // Incompressible-looking data: a repeating pattern still
            // compresses, so mix several patterns in one cluster run.
            format!("write -P 0x63 {} 4096", 5 * MIB),
            format!("write -P 0x64 {} 4096", 5 * MIB + 8192),
        ],
    );
    let base = dir.path().join("base.qcow2");
    let opts = format!(
        "compression_type={compression},cluster_size={cluster},extended_l2={}",
        if extended_l2 { "on" } else { "off" }
    );
    qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        "-o",
        &opts,
        s(&src),
        s(&base),
    ]);
    std::fs::remove_file(&src).unwrap();
    assert_same_as_qemu(&base);
    assert_full_map_equal(&base);
    let top = dir.path().join("top.qcow2");
    qemu_overlay(
        &top,
        "base.qcow2",
        "qcow2",
        &["-o", &format!("compression_type={compression}")],
        None,
    );
    qemu_io(
        &top,
        &[
            "write -P 0x71 100000 5000".into(),
            format!("write -c -P 0x72 {} {}", 4 * MIB, cluster.max(65536)),
        ],
    );
    assert_same_as_qemu(&top);
    assert_full_map_equal(&top);
}

#[test]
fn deflate_compressed_layers() {
    compressed_base("zlib", 65536, false);
    compressed_base("zlib", 512, false);
    compressed_base("zlib", 2 * MIB, false);
}

#[test]
fn zstd_compressed_layers() {
    compressed_base("zstd", 65536, false);
    compressed_base("zstd", 4096, false);
    compressed_base("zstd", 2 * MIB, false);
}

#[test]
fn compressed_extended_l2() {
    compressed_base("zstd", 65536, true);
    compressed_base("zlib", 32768, true);
}

#[test]
fn zero_clusters_hide_backing_data() {
    let dir = tmp();
    let top = build_chain(
        dir.path(),
        &[
            LayerSpec::new("", 8 * MIB, &["write -P 0x41 0 8M"]),
            LayerSpec::new(
                "",
                8 * MIB,
                &[
                    "write -z 0 64k",
                    "write -z 1M 200k",
                    "write -z -u 3M 1M",
                    "write -z 5000 3000",
                ],
            ),
        ],
    );
    assert_same_as_qemu(&top);
    assert_full_map_equal(&top);
}

#[test]
fn discarded_clusters() {
    let dir = tmp();
    let top = build_chain(
        dir.path(),
        &[
            LayerSpec::new("", 8 * MIB, &["write -P 0x41 0 8M", "discard 1M 1M"]),
            LayerSpec::new(
                "",
                8 * MIB,
                &["write -P 0x42 0 4M", "discard 0 128k", "discard 3M 512k"],
            ),
            LayerSpec::new(
                "compat=0.10",
                8 * MIB,
                &["write -P 0x43 2M 1M", "discard 2M 64k"],
            ),
        ],
    );
    assert_same_as_qemu(&top);
    assert_full_map_equal(&top);
}

#[test]
fn raw_base() {
    let dir = tmp();
    let base = dir.path().join("base.raw");
    // An odd size: not a multiple of 512, sparse in the middle.
    std::fs::write(&base, []).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&base).unwrap();
    f.set_len(9 * MIB + 333).unwrap();
    drop(f);
    common::run(std::process::Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x51 0 1M",
        "-c",
        "write -P 0x52 5M 1M",
        "-c",
        "write -P 0x53 9437184 333",
        s(&base),
    ]));
    let top = dir.path().join("top.qcow2");
    qemu_overlay(&top, "base.raw", "raw", &[], Some("16M"));
    qemu_io(
        &top,
        &["write -P 0x54 512k 1M".into(), "write -z 5M 64k".into()],
    );
    assert_same_as_qemu(&top);
    assert_full_map_equal(&top);
}

/// `n` layers of one chain, each writing its own pattern at pseudo-random
/// offsets, so that every layer shows through somewhere.
fn spread_chain(n: usize, seed: u64) {
    let dir = tmp();
    let size = 32 * MIB;
    let mut rng = fastrand::Rng::with_seed(seed);
    let layers: Vec<LayerSpec> = (0..n)
        .map(|i| {
            let cmds: Vec<String> = (0..4)
                .map(|_| {
                    let off = rng.u64(0..size - 300_000);
                    let len = rng.u64(1..300_000);
                    match rng.u8(0..10) {
                        0 => format!("write -z {off} {len}"),
                        1 => format!("discard {} {}", off & !0xffff, 65536),
                        _ => format!("write -P {} {off} {len}", (i * 7 + 1) % 256),
                    }
                })
                .collect();
            LayerSpec {
                opts: String::new(),
                size,
                cmds,
            }
        })
        .collect();
    let top = build_chain(dir.path(), &layers);
    assert_same_as_qemu(&top);
    assert_full_map_equal(&top);
}

#[test]
fn chain_of_1() {
    spread_chain(1, 1);
}

#[test]
fn chain_of_2() {
    spread_chain(2, 2);
}

#[test]
fn chain_of_10() {
    spread_chain(10, 10);
}

#[test]
fn chain_of_100() {
    spread_chain(100, 100);
}

#[test]
fn top_larger_than_base() {
    let dir = tmp();
    let top = build_chain(
        dir.path(),
        &[
            LayerSpec::new("", 4 * MIB, &["write -P 0x21 0 4M"]),
            LayerSpec::new("", 6 * MIB, &["write -P 0x22 5M 64k"]),
            // A middle layer shorter than the base: beyond its end the base
            // no longer shows through.
            LayerSpec::new("", 2 * MIB, &["write -P 0x23 1M 4k"]),
            LayerSpec::new("", 10 * MIB, &["write -P 0x24 9M 100k"]),
        ],
    );
    assert_same_as_qemu(&top);
    assert_full_map_equal(&top);
}

#[test]
fn backing_in_another_directory() {
    let dir = tmp();
    std::fs::create_dir(dir.path().join("base")).unwrap();
    std::fs::create_dir(dir.path().join("vm")).unwrap();
    let base = dir.path().join("base/disk.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "4M"]);
    qemu_io(&base, &["write -P 0x31 0 2M".into()]);
    let top = dir.path().join("vm/top.qcow2");
    qemu_overlay(&top, "../base/disk.qcow2", "qcow2", &[], None);
    qemu_io(&top, &["write -P 0x32 1M 4k".into()]);
    assert_same_as_qemu(&top);
    // Opened through a relative path from another working directory.
    let out = common::run(
        std::process::Command::new(common::sqcow2_bin())
            .current_dir(dir.path())
            .args([
                "info",
                "--backing-chain",
                "--output",
                "json",
                "vm/top.qcow2",
            ]),
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert_eq!(v[1]["filename"], "vm/../base/disk.qcow2");
}

/// Random chains mixing every option, as a guard against chains this file
/// did not think of. `SQCOW2_RANDOM_CHAINS=N` runs N seeds instead of 6.
#[test]
fn random_chains() {
    let seeds: u64 = std::env::var("SQCOW2_RANDOM_CHAINS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    for seed in 0..seeds {
        let mut rng = fastrand::Rng::with_seed(0x5eed_0000 + seed);
        let dir = tmp();
        let layers = rng.usize(1..6);
        let size = rng.u64(1..24) * MIB + rng.u64(0..4) * 512;
        let specs: Vec<LayerSpec> = (0..layers)
            .map(|i| {
                let cluster = 1u64 << rng.u32(12..=21);
                let mut opts = vec![format!("cluster_size={cluster}")];
                if rng.bool() && cluster >= 16384 {
                    opts.push("extended_l2=on".into());
                } else if rng.u8(0..4) == 0 {
                    opts.push("compat=0.10".into());
                }
                if !opts.iter().any(|o| o == "compat=0.10") && rng.bool() {
                    opts.push("compression_type=zstd".into());
                }
                let layer_size = size - rng.u64(0..2) * MIB.min(size / 2);
                // Compressed writes only succeed on clusters the layer does
                // not hold yet, so they come first, once per cluster.
                let mut compressed = std::collections::BTreeSet::new();
                let mut cmds: Vec<String> = (0..6)
                    .map(|_| {
                        let off = rng.u64(0..layer_size);
                        let len = rng.u64(1..(layer_size - off).min(3 * MIB) + 1);
                        let aligned = off / cluster * cluster;
                        match rng.u8(0..10) {
                            0 => format!("write -z {off} {len}"),
                            1 => format!("discard {off} {len}"),
                            2 if aligned + cluster <= layer_size && compressed.insert(aligned) => {
                                format!("write -c -P {} {aligned} {cluster}", i + 0x80)
                            }
                            _ => format!("write -P {} {off} {len}", i * 13 + 1),
                        }
                    })
                    .collect();
                cmds.sort_by_key(|c| !c.starts_with("write -c"));
                LayerSpec {
                    opts: opts.join(","),
                    size: layer_size,
                    cmds,
                }
            })
            .collect();
        let top = build_chain(dir.path(), &specs);
        assert_same_as_qemu(&top);
        assert_full_map_equal(&top);
    }
}

/// An empty disk maps as QEMU maps it (one empty extent); the human map of
/// compressed data stops as qemu-img's does (its table cannot show data
/// without a place in a file): the same lines, the same exit code.
#[test]
fn map_edge_cases_as_qemu_img() {
    let dir = tmp();
    let empty = dir.path().join("empty.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&empty), "0"]);
    assert_full_map_equal(&empty);

    let plain = dir.path().join("plain.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&plain), "4M"]);
    qemu_io(
        &plain,
        &[
            "write -P 1 0 1M".to_string(),
            "write -P 2 2M 64k".to_string(),
        ],
    );
    let packed = dir.path().join("packed.qcow2");
    qemu_img(&["convert", "-c", "-O", "qcow2", s(&plain), s(&packed)]);
    qemu_io(&packed, &["write -P 3 3M 64k".to_string()]);
    let run = |program: &std::path::Path| {
        let out = common::run_raw(std::process::Command::new(program).args(["map", s(&packed)]));
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (theirs, ours) = (
        run(std::path::Path::new("qemu-img")),
        run(&common::sqcow2_bin()),
    );
    assert_eq!(theirs.0, Some(1), "qemu-img map: {theirs:?}");
    assert_eq!(ours, theirs);
}
