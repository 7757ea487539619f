//! Random corruption of valid images: whatever bytes the metadata holds,
//! opening, reading, writing and checking return errors or data, never
//! panic or hang. (fuzz/ has the coverage-guided targets, run by
//! scripts/fuzz.sh; this runs in every test run.)

mod common;

use std::sync::Arc;

use common::{qemu_img, qemu_io, s};
use sqcow2_format::check::{check_storage, Repair};
use sqcow2_format::storage::MemStorage;
use sqcow2_format::{Chain, ChainOptions};

fn exercise(top: &std::path::Path, bytes: Vec<u8>, rng: &mut fastrand::Rng) {
    let storage = Arc::new(MemStorage::with_limit(bytes, 256 << 20));
    let writable = rng.bool();
    let opts = ChainOptions {
        writable,
        top_storage: Some(storage.clone()),
        ..ChainOptions::default()
    };
    if let Ok(chain) = Chain::open(top, &opts) {
        let size = chain.virtual_size().min(8 << 20);
        let mut buf = vec![0u8; 65536];
        for _ in 0..8 {
            let off = rng.u64(0..size.max(1));
            let len = (rng.u64(1..65536)).min(size.saturating_sub(off)) as usize;
            let _ = chain.read_at(&mut buf[..len], off);
            if writable {
                let _ = chain.write_at(&buf[..len], off);
                let _ = chain.write_zeroes(off, len as u64, rng.bool());
                let _ = chain.discard(off, len as u64);
            }
        }
        let _ = chain.close();
    }
    let _ = check_storage(
        top,
        storage,
        if rng.bool() {
            Repair::All
        } else {
            Repair::None
        },
    );
}

#[test]
fn corrupted_metadata_never_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=4096",
        s(&base),
        "8M",
    ]);
    qemu_io(
        &base,
        &["write -P 1 0 1M".into(), "write -c -P 2 2M 64k".into()],
    );
    let mut images = Vec::new();
    for opts in [
        "cluster_size=4096",
        "cluster_size=16384,extended_l2=on",
        "compat=0.10,cluster_size=512",
    ] {
        let top = tmp.path().join("top.qcow2");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            opts,
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            s(&top),
        ]);
        qemu_io(
            &top,
            &[
                "write -P 3 100k 300k".into(),
                "write -z 1M 64k".into(),
                "write -c -P 4 4M 16k".into(),
            ],
        );
        qemu_img(&["snapshot", "-c", "s", s(&top)]);
        images.push(std::fs::read(&top).unwrap());
    }
    let top = tmp.path().join("top.qcow2");
    let iterations: u64 = std::env::var("SQCOW2_MUTATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    for i in 0..iterations {
        let mut rng = fastrand::Rng::with_seed(i);
        let mut bytes = images[rng.usize(0..images.len())].clone();
        // Most metadata lives in the first clusters of a small image.
        let hot = bytes.len().min(64 << 10);
        for _ in 0..rng.usize(1..8) {
            let at = if rng.bool() {
                rng.usize(0..112)
            } else {
                rng.usize(0..hot)
            };
            bytes[at] = match rng.u8(0..4) {
                0 => 0,
                1 => 0xff,
                _ => rng.u8(..),
            };
        }
        let seed_note = format!("mutation seed {i}");
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            exercise(&top, bytes, &mut rng);
        }));
        assert!(result.is_ok(), "{seed_note} panicked");
    }
}
