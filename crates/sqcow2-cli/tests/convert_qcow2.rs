//! `sqcow2 convert -O qcow2` (a chain flattened into one image, front to
//! back), `-c`, `-o`, `-n`, and conversions onto block devices, with
//! QEMU the oracle: `qemu-img check` clean, `qemu-img compare` identical
//! to the chain, `qemu-img info` as asked.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn info(image: &Path) -> serde_json::Value {
    serde_json::from_str(&qemu_img(&["info", "--output", "json", s(image)])).unwrap()
}

fn assert_identical(a: &Path, b: &Path, b_format: &str) {
    let o = run_raw(Command::new("qemu-img").args(["compare", "-F", b_format, s(a), s(b)]));
    assert!(
        o.status.success(),
        "qemu-img compare {} {}: {}{}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A chain with a bit of everything: data in many layers, zero clusters,
/// compressed clusters, data in the last (partial) cluster.
fn varied_chain(dir: &Path) -> PathBuf {
    let top = gen_chain(&dir.join("chain"), 8, "96M", "0.3");
    let more = dir.join("chain").join("more.qcow2");
    qemu_overlay(&more, s(&top), "qcow2", &[], None);
    qemu_io(
        &more,
        &[
            "write -z 4M 1M".to_string(),
            "write -P 0x3c 50M 3M".to_string(),
            "write -P 0x3d 100659200 4k".to_string(),
        ],
    );
    more
}

#[test]
fn a_chain_flattens_into_one_image_qemu_reads() {
    let dir = tempfile::tempdir().unwrap();
    let top = varied_chain(dir.path());
    let cases: [(&[&str], u64, &str); 5] = [
        (&[], 65536, "zlib"),
        (&["-c"], 65536, "zlib"),
        (
            &["-c", "-o", "compression_type=zstd,cluster_size=4k"],
            4096,
            "zstd",
        ),
        (&["-o", "cluster_size=512"], 512, "zlib"),
        (
            &["-c", "-o", "cluster_size=2M,refcount_bits=64"],
            2 << 20,
            "zlib",
        ),
    ];
    for (i, (args, cluster, compression)) in cases.iter().enumerate() {
        let out = dir.path().join(format!("flat{i}.qcow2"));
        let mut all = vec!["convert", "-O", "qcow2"];
        all.extend_from_slice(args);
        all.extend_from_slice(&[s(&top), s(&out)]);
        sqcow2(&all);
        assert_check_clean(&out);
        assert_identical(&top, &out, "qcow2");
        let i = info(&out);
        assert!(i.get("backing-filename").is_none(), "{i:#}");
        assert_eq!(i["cluster-size"], *cluster, "{args:?}");
        assert_eq!(i["virtual-size"], 96 << 20);
        assert_eq!(
            i["format-specific"]["data"]["compression-type"],
            *compression
        );
        // Compressed where asked, and smaller for it.
        let check = qemu_img(&["check", "--output", "json", s(&out)]);
        let c: serde_json::Value = serde_json::from_str(&check).unwrap();
        let compressed = c["compressed-clusters"].as_u64().unwrap_or(0);
        assert_eq!(args.contains(&"-c"), compressed > 0, "{args:?}: {c:#}");
    }
    // Not larger than qemu-img's own flattening.
    let theirs = dir.path().join("theirs.qcow2");
    qemu_img(&["convert", "-O", "qcow2", s(&top), s(&theirs)]);
    let (ours, qemus) = (
        info(&dir.path().join("flat0.qcow2"))["actual-size"]
            .as_u64()
            .unwrap(),
        info(&theirs)["actual-size"].as_u64().unwrap(),
    );
    assert!(
        ours <= qemus + (1 << 20),
        "ours {ours} bytes, qemu-img's {qemus}"
    );
}

#[test]
fn n_writes_over_an_existing_image() {
    let dir = tempfile::tempdir().unwrap();
    let top = varied_chain(dir.path());
    // An image with other data everywhere, larger than the disk.
    let target = dir.path().join("target.qcow2");
    qemu_create(&target, "", "128M");
    qemu_io(&target, &["write -P 0xee 0 128M".to_string()]);
    sqcow2(&["convert", "-n", "-O", "qcow2", s(&top), s(&target)]);
    assert_check_clean(&target);
    qemu_io(&target, &["read -P 0xee 96M 32M".to_string()]);
    let o = run_raw(Command::new("qemu-img").args(["compare", s(&top), s(&target)]));
    // Larger target: identical where the disk is, its old bytes after.
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    qemu_img(&["resize", "--shrink", "-q", s(&target), "96M"]);
    assert_identical(&top, &target, "qcow2");
    // A raw file written over: zeros where the disk reads zeros.
    let raw = dir.path().join("target.raw");
    std::fs::write(&raw, vec![0xeeu8; 96 << 20]).unwrap();
    sqcow2(&["convert", "-n", "-O", "raw", s(&top), s(&raw)]);
    assert_identical(&top, &raw, "raw");
    // Too small: refused.
    let small = dir.path().join("small.qcow2");
    qemu_create(&small, "", "64M");
    let o = run_raw(Command::new(sqcow2_bin()).args([
        "convert",
        "-n",
        "-O",
        "qcow2",
        s(&top),
        s(&small),
    ]));
    assert!(!o.status.success());
}

/// A loop device over a file of `len` bytes; detached when dropped.
struct Loop(String);

impl Loop {
    fn new(file: &Path, len: u64) -> Loop {
        std::fs::File::create(file).unwrap().set_len(len).unwrap();
        let out = Command::new("losetup")
            .args(["--find", "--show", s(file)])
            .output()
            .expect("losetup");
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Loop(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// Onto a block device (a loop device here): raw written over without
/// resizing it (qemu-img's way: `cannot set size` was the old failure),
/// and a qcow2 image on the device.
#[test]
fn onto_a_block_device() {
    let dir = tempfile::tempdir().unwrap();
    let top = varied_chain(dir.path());
    let dev = Loop::new(&dir.path().join("dev.img"), 96 << 20);
    // Stale bytes on the device, which zeros must replace.
    std::fs::write(&dev.0, vec![0x99u8; 96 << 20]).unwrap();
    sqcow2(&["convert", "-O", "raw", s(&top), &dev.0]);
    assert_identical(&top, Path::new(&dev.0), "raw");
    let dev2 = Loop::new(&dir.path().join("dev2.img"), 128 << 20);
    std::fs::write(&dev2.0, vec![0x99u8; 128 << 20]).unwrap();
    sqcow2(&["convert", "-c", "-O", "qcow2", s(&top), &dev2.0]);
    let o = run_raw(Command::new("qemu-img").args(["check", "-f", "qcow2", &dev2.0]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    assert_identical(&top, Path::new(&dev2.0), "qcow2");
}

#[test]
fn refusals() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    qemu_create(&img, "", "16M");
    for (args, words) in [
        (
            vec!["convert", "-c", "-O", "raw"],
            "Compression not supported for this file format",
        ),
        (
            vec!["convert", "-O", "qcow2", "-o", "cluster_size=3000"],
            "cluster_size",
        ),
        (
            vec!["convert", "-O", "qcow2", "-o", "bogus=1"],
            "unknown option",
        ),
    ] {
        let mut all = args.clone();
        let out = dir.path().join("out.img");
        all.extend_from_slice(&[s(&img), s(&out)]);
        let o = run_raw(Command::new(sqcow2_bin()).args(&all));
        assert!(!o.status.success(), "{all:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(words), "{all:?}: {err}");
    }
}
