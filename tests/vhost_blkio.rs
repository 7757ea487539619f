//! `sqcow2 serve` against libblkio (the `blkio` crate's
//! `virtio-blk-vhost-user` driver), an independent vhost-user-blk
//! frontend; QEMU's tools are the oracle for the image content.

mod common;

use std::path::{Path, PathBuf};

use common::vhost::{connect_retry, Client, Daemon};
use common::{qemu_img, run_raw, s, sqcow2};

/// A `gen-chain` chain of `layers` layers and `size`; returns its top.
fn gen_chain(dir: &Path, layers: usize, size: &str, index: bool) -> PathBuf {
    let layers = layers.to_string();
    let mut args = vec!["gen-chain", "--layers", &layers, "--size", size, "--fill", "0.6"];
    if !index {
        args.push("--no-index");
    }
    args.push(s(dir));
    PathBuf::from(sqcow2(&args).trim())
}

/// The chain's guest view according to `qemu-img convert`.
fn qemu_raw(top: &Path, dir: &Path) -> Vec<u8> {
    let raw = dir.join("expected.raw");
    qemu_img(&["convert", "-O", "raw", s(top), s(&raw)]);
    std::fs::read(&raw).unwrap()
}

fn assert_qemu_check_clean(image: &Path) {
    let out = run_raw(std::process::Command::new("qemu-img").args(["check", "--output=json", s(image)]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "qemu-img check {}: {text}", image.display());
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json.get("leaks").and_then(|v| v.as_u64()).unwrap_or(0), 0, "{text}");
    assert_eq!(json.get("corruptions").and_then(|v| v.as_u64()).unwrap_or(0), 0, "{text}");
}

fn read_all(client: &mut Client, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let chunk = 1 << 20;
    let mut pos = 0;
    while pos < len {
        let n = chunk.min(len - pos) as usize;
        out.extend_from_slice(&client.read(pos, n));
        pos += n as u64;
    }
    out
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[test]
fn every_byte_of_a_100_layer_chain_matches_qemu() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 100, "64M", true);
    let expected = qemu_raw(&top, tmp.path());
    let mut daemon = Daemon::start(tmp.path(), &top, &["--read-only"]);
    let mut client = connect_retry(&daemon, 1, true);
    assert_eq!(client.capacity(), expected.len() as u64);
    let got = read_all(&mut client, expected.len() as u64);
    assert_eq!(first_difference(&got, &expected), None, "guest view differs from qemu-img convert");
    drop(client);
    daemon.stop();
}
