//! Chains of one process that share layer files ([`SharedLayers`]): a
//! file opened once (one storage), its tables cached once (a second
//! chain's reads of a warmed base load nothing), each chain reading its
//! own data as `qemu-io` wrote it; a file one chain writes is refused as
//! another's backing file; a shared base cannot be committed into while
//! another chain reads it; the last chain gone, nothing stays shared.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use sqcow2_format::reshape::prepare_live_commit;
use sqcow2_format::{Chain, ChainOptions, ErrorKind, SharedLayers};

const MIB: usize = 1 << 20;

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// base.qcow2 (two layers: 0x11 over the first 8 MiB, then 0x22 over
/// 4-6 MiB) and an overlay per name, each with its own byte at 1 MiB.
fn chains(dir: &Path, names: &[&str]) -> Vec<PathBuf> {
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let b0 = dir.join("b0.qcow2");
    let base = dir.join("base.qcow2");
    run(Command::new("qemu-img").args(["create", "-q", "-f", "qcow2", &s(&b0), "16M"]));
    run(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write -P 0x11 0 8M", &s(&b0)]));
    run(Command::new("qemu-img").args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "b0.qcow2",
        "-F",
        "qcow2",
        &s(&base),
    ]));
    run(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write -P 0x22 4M 2M", &s(&base)]));
    names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let top = dir.join(format!("{n}.qcow2"));
            run(Command::new("qemu-img").args([
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                "base.qcow2",
                "-F",
                "qcow2",
                &s(&top),
            ]));
            let cmd = format!("write -P {} 1M 64k", 0x40 + i);
            run(Command::new("qemu-io").args(["-f", "qcow2", "-c", &cmd, &s(&top)]));
            top
        })
        .collect()
}

fn options(shared: &Arc<SharedLayers>, writable: bool) -> ChainOptions {
    ChainOptions {
        writable,
        shared_layers: Some(shared.clone()),
        ..ChainOptions::default()
    }
}

fn read(chain: &Chain, offset: usize, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    chain.read_at(&mut buf, offset as u64).expect("read");
    buf
}

fn all(buf: &[u8], v: u8) -> bool {
    buf.iter().all(|b| *b == v)
}

#[test]
fn chains_share_their_common_layers_and_their_tables() {
    let dir = tempfile::tempdir().unwrap();
    let tops = chains(dir.path(), &["a", "b", "c"]);
    let shared = Arc::new(SharedLayers::new(8 * MIB as u64));
    let a = Chain::open(&tops[0], &options(&shared, true)).unwrap();
    assert_eq!(shared.files(), 2, "the base's two files");
    // The first chain reads the whole disk: the base's tables load once.
    for at in (0..16 * MIB).step_by(MIB) {
        read(&a, at, 4096);
    }
    let loaded = shared.cache_stats().snapshot().loads;
    assert!(loaded > 0);
    let b = Chain::open(&tops[1], &options(&shared, true)).unwrap();
    let c = Chain::open(&tops[2], &options(&shared, false)).unwrap();
    assert_eq!(shared.files(), 2, "opened again by the other chains");
    assert!(
        Arc::ptr_eq(a.layers()[0].storage(), b.layers()[0].storage()),
        "one descriptor for the shared base"
    );
    for (i, chain) in [&a, &b, &c].into_iter().enumerate() {
        assert!(
            all(&read(chain, MIB, 65536), 0x40 + i as u8),
            "chain {i}'s own data"
        );
        assert!(all(&read(chain, 0, 65536), 0x11), "chain {i} over the base");
        assert!(
            all(&read(chain, 5 * MIB, 65536), 0x22),
            "chain {i} over the base's top"
        );
        assert!(
            all(&read(chain, 12 * MIB, 65536), 0),
            "chain {i} past the data"
        );
    }
    assert_eq!(
        shared.cache_stats().snapshot().loads,
        loaded,
        "the other chains read the warmed base without loading a table"
    );

    // The base is another chain's: not written by a commit.
    let refused = prepare_live_commit(&b, None, &options(&shared, true)).unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("another disk this process serves reads the base"),
        "{refused}"
    );
    // A top one chain writes is no one's backing file.
    let over_a = dir.path().join("over-a.qcow2");
    run(Command::new("qemu-img").args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        "a.qcow2",
        "-F",
        "qcow2",
        over_a.to_str().unwrap(),
        "16M",
    ]));
    let locked = Chain::open(&over_a, &options(&shared, true)).unwrap_err();
    assert!(matches!(locked.kind, ErrorKind::Locked { .. }), "{locked}");

    drop((a, b, c));
    assert_eq!(shared.files(), 0, "nothing shared once the chains are gone");
    assert_eq!(
        shared.cache_stats().snapshot().bytes,
        0,
        "their tables dropped"
    );
}

/// One chain reopened inactive (a handover: no image lock) and again
/// active leaves the other chains' locks on the shared base as they
/// were: a writer (`qemu-io`) is refused throughout. A merge that would
/// rename the shared base's backing file is refused.
#[test]
fn one_chain_handing_over_leaves_the_shared_locks_alone() {
    let dir = tempfile::tempdir().unwrap();
    let tops = chains(dir.path(), &["a", "b"]);
    let shared = Arc::new(SharedLayers::new(8 * MIB as u64));
    let a = Chain::open(&tops[0], &options(&shared, true)).unwrap();
    let b = Chain::open(&tops[1], &options(&shared, true)).unwrap();
    let base = dir.path().join("base.qcow2");
    let writer_refused = || {
        let out = Command::new("qemu-io")
            .args([
                "-f",
                "qcow2",
                "-c",
                "write -P 9 0 4k",
                base.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        text.contains("lock")
    };
    assert!(writer_refused(), "the shared base is not locked");
    // As the daemon inactivates: flushed clean, reopened inactive over
    // the chain it replaces.
    a.flush_clean().unwrap();
    let inactive = ChainOptions {
        writable: false,
        inactive: true,
        ..options(&shared, true)
    };
    let a_inactive = Chain::open_reusing(&tops[0], &inactive, &a).unwrap();
    drop(a);
    let a = a_inactive;
    assert!(
        writer_refused(),
        "an inactive chain unlocked the base b still reads"
    );
    let a_again = Chain::open_reusing(&tops[0], &options(&shared, true), &a).unwrap();
    drop(a);
    assert!(writer_refused(), "a reactivated chain unlocked the base");
    assert!(all(&read(&a_again, 5 * MIB, 4096), 0x22));

    let merged = dir.path().join("merged.qcow2");
    let Err(refused) = sqcow2_format::reshape::prepare_merge(
        &b,
        &sqcow2_format::reshape::LayerRef::Position(0),
        &sqcow2_format::reshape::LayerRef::Position(0),
        &merged,
        None,
    ) else {
        panic!("a merge renamed the shared base's backing file");
    };
    assert!(
        refused
            .to_string()
            .contains("its backing file cannot change"),
        "{refused}"
    );
    assert!(!merged.exists());
    drop((a_again, b));
}
