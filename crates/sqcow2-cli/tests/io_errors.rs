//! `EIO` from the files under a served chain: the request that met it
//! fails, the data is never wrong (a failed read is not zeros or stale
//! bytes, a failed write leaves the old data), nothing leaks, and I/O works
//! again once the files do. The errors come from a FUSE filesystem
//! (`common::faulty_fs`), so they reach the daemon as a real file's errors,
//! through io_uring as well as through the engine.

mod common;

use common::faulty_fs::FaultyFs;
use common::vhost::{connect_retry, control, wait_index_state, Daemon};
use std::process::Command;

use common::{assert_check_clean, qemu_img, qemu_io, qemu_overlay, qemu_raw, run_raw, s};

const CLUSTER: usize = 65536;

fn at(c: usize) -> u64 {
    (c * CLUSTER) as u64
}

/// In `dir`: a 32 MiB base (its first 8 MiB 0x22) and over it `top.qcow2`
/// in `dir/src`, mounted through the faulty filesystem (`mount`, e.g.
/// [`FaultyFs::mount`]) at `dir/mnt` (the top at `mnt/top.qcow2`); the
/// mount and `dir/src`.
fn faulty_top(
    dir: &std::path::Path,
    mount: fn(&std::path::Path, &std::path::Path) -> FaultyFs,
) -> (FaultyFs, std::path::PathBuf) {
    let base = dir.join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "32M"]);
    qemu_io(&base, &["write -P 0x22 0 8M".to_string()]);
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    qemu_overlay(&src.join("top.qcow2"), s(&base), "qcow2", &[], None);
    (mount(&src, &dir.join("mnt")), src)
}

/// `faulty_top`'s top after a failed fsync: at worst what a crash leaves
/// (a leaked cluster: a refcount written for an allocation whose mapping
/// could not be published), never a corruption; `check -r leaks`
/// reclaims it, and QEMU then reads the base with `clusters` (index,
/// fill byte) written over it.
fn assert_clean_after_leaks_and_reads(top: &std::path::Path, clusters: &[(usize, u8)]) {
    let out = run_raw(Command::new("qemu-img").args(["check", s(top)]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        matches!(out.status.code(), Some(0 | 3)) && !text.contains("ERROR"),
        "qemu-img check:\n{text}"
    );
    qemu_img(&["check", "-q", "-r", "leaks", s(top)]);
    assert_check_clean(top);
    let mut expected = vec![0u8; 32 << 20];
    expected[..8 << 20].fill(0x22);
    for &(c, fill) in clusters {
        expected[c * CLUSTER..(c + 1) * CLUSTER].fill(fill);
    }
    let out = tempfile::tempdir().unwrap();
    assert!(qemu_raw(top, out.path()) == expected, "qemu-img convert");
}

#[test]
fn eio_reading_a_backing_file_fails_the_request_and_never_gives_wrong_data() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    let base_file = src.join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base_file), "32M"]);
    qemu_io(&base_file, &["write -P 0x22 0 8M".to_string()]);
    let fs = FaultyFs::mount(&src, &dir.join("mnt"));
    let top = dir.join("top.qcow2");
    let base = fs.mountpoint.join("base.qcow2");
    qemu_overlay(&top, s(&base), "qcow2", &[], None);

    let mut daemon = Daemon::start(dir, &top, &["--backing-root", s(dir)]);
    let mut client = connect_retry(&daemon, 1, false);
    assert_eq!(client.read(at(3), CLUSTER), vec![0x22; CLUSTER]);
    client.write(at(0), &[0x33; CLUSTER]);

    fs.faults.set(true, false, false);
    for c in [5, 6, 7] {
        assert!(
            client.try_read(at(c), CLUSTER).is_err(),
            "read of cluster {c} succeeded while its file fails"
        );
    }
    // Data the top owns is unaffected.
    assert_eq!(client.read(at(0), CLUSTER), vec![0x33; CLUSTER]);
    // A partial write needs the base's data (copy-on-write): it fails.
    assert_ne!(client.try_write(at(6) + 4096, &[0x44; 4096]), 0);

    fs.faults.set(false, false, false);
    assert_eq!(client.read(at(5), CLUSTER), vec![0x22; CLUSTER]);
    assert_eq!(
        client.read(at(6), CLUSTER),
        vec![0x22; CLUSTER],
        "a failed copy-on-write changed the data"
    );
    client.write(at(6) + 4096, &[0x44; 4096]);
    client.flush();
    drop(client);
    daemon.stop();
    assert!(
        daemon.log().contains("Input/output error"),
        "{}",
        daemon.log()
    );

    assert_check_clean(&top);
    let mut expected = vec![0u8; 32 << 20];
    expected[..8 << 20].fill(0x22);
    expected[..CLUSTER].fill(0x33);
    expected[CLUSTER * 6 + 4096..CLUSTER * 6 + 8192].fill(0x44);
    let out = tempfile::tempdir().unwrap();
    assert!(qemu_raw(&top, out.path()) == expected, "qemu-img convert");
}

#[test]
fn eio_writing_or_syncing_the_top_fails_the_request_and_corrupts_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (fs, src) = faulty_top(dir, FaultyFs::mount);
    let top = fs.mountpoint.join("top.qcow2");

    let mut daemon = Daemon::start(dir, &top, &["--backing-root", s(dir)]);
    let mut client = connect_retry(&daemon, 1, false);
    client.write(at(0), &[0x33; CLUSTER]);
    client.flush();

    fs.faults.set(false, true, false);
    // An allocating write (through the engine) and an in-place one
    // (io_uring from guest memory) both fail.
    assert_ne!(client.try_write(at(1), &[0x55; CLUSTER]), 0);
    assert_ne!(client.try_write(at(0), &[0x66; CLUSTER]), 0);
    assert_ne!(client.try_write(at(2) + 512, &[0x77; 512]), 0);

    fs.faults.set(false, false, true);
    // An allocating write's new mapping goes to the file only after its
    // data and refcounts are synced (it must survive a daemon restart and
    // stay power-loss safe): while fsync fails, it fails too. (This
    // filesystem cannot make the mapping journal, so every allocating
    // write is published before it completes; with a journal it would
    // complete, and the next flush fail.)
    assert_ne!(
        client.try_write(at(3), &[0x88; CLUSTER]),
        0,
        "an allocating write completed while fsync fails"
    );
    assert_ne!(client.try_flush(), 0, "flush succeeded while fsync fails");
    // The kernel may have dropped what it could not write: later flushes
    // keep failing (no false durability) until the image is reopened.
    fs.faults.set(false, false, false);
    assert_ne!(
        client.try_flush(),
        0,
        "flush succeeded after a failed fsync"
    );
    assert_eq!(client.read(at(0), CLUSTER), vec![0x33; CLUSTER]);
    assert_eq!(client.read(at(1), CLUSTER), vec![0x22; CLUSTER]);
    assert_eq!(client.read(at(2), CLUSTER), vec![0x22; CLUSTER]);
    drop(client);
    let status = daemon.stop_with(libc::SIGTERM);
    assert!(!status.success(), "the final flush cannot have succeeded");

    // Reopened: the last successful flush's state, writable again.
    let mut daemon = Daemon::start(dir, &top, &["--backing-root", s(dir)]);
    let mut client = connect_retry(&daemon, 1, false);
    assert_eq!(client.read(at(0), CLUSTER), vec![0x33; CLUSTER]);
    client.write(at(1), &[0x55; CLUSTER]);
    client.flush();
    drop(client);
    daemon.stop();
    drop(fs);

    assert_clean_after_leaks_and_reads(&src.join("top.qcow2"), &[(0, 0x33), (1, 0x55)]);
}

/// The same with a mapping journal (the filesystem can make files): an
/// allocating write completes while fsync fails (its mapping is in the
/// journal, nothing waits for a sync), but no flush succeeds from then
/// on; the daemon's stop fails its final flush, and the next start
/// replays the journal: the write is there, every layer checks clean
/// (after `check -r leaks`, as after a crash) and QEMU reads it.
#[test]
fn eio_syncing_a_journaled_top_fails_every_flush_and_loses_no_completed_write() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (fs, src) = faulty_top(dir, FaultyFs::mount_with_new_files);
    let top = fs.mountpoint.join("top.qcow2");

    let mut daemon = Daemon::start(dir, &top, &["--backing-root", s(dir)]);
    let mut client = connect_retry(&daemon, 1, false);
    client.write(at(0), &[0x33; CLUSTER]);
    client.flush();
    assert!(
        src.join("top.qcow2.sqjournal").exists(),
        "no mapping journal: this test needs one"
    );

    fs.faults.set(false, false, true);
    assert_eq!(
        client.try_write(at(3), &[0x88; CLUSTER]),
        0,
        "a journaled allocating write failed while only fsync fails"
    );
    assert_ne!(client.try_flush(), 0, "flush succeeded while fsync fails");
    fs.faults.set(false, false, false);
    assert_ne!(
        client.try_flush(),
        0,
        "flush succeeded after a failed fsync"
    );
    assert_eq!(client.read(at(3), CLUSTER), vec![0x88; CLUSTER]);
    drop(client);
    let status = daemon.stop_with(libc::SIGTERM);
    assert!(!status.success(), "the final flush cannot have succeeded");

    let mut daemon = Daemon::start(dir, &top, &["--backing-root", s(dir)]);
    let mut client = connect_retry(&daemon, 1, false);
    assert_eq!(client.read(at(0), CLUSTER), vec![0x33; CLUSTER]);
    assert_eq!(
        client.read(at(3), CLUSTER),
        vec![0x88; CLUSTER],
        "a completed write was lost"
    );
    client.flush();
    drop(client);
    daemon.stop();
    drop(fs);

    assert_clean_after_leaks_and_reads(&src.join("top.qcow2"), &[(0, 0x33), (3, 0x88)]);
}

/// A live snapshot whose old top cannot be closed after the switch (its
/// file refuses writes) still succeeds: the guest goes on, reading the old
/// top's tables from memory, and no index is built over the old top left
/// open. Once the file takes writes again, the next snapshot closes it
/// first: the index is built, every layer checks clean, and QEMU reads
/// every write.
#[test]
fn an_old_top_that_could_not_be_closed_is_closed_by_the_next_snapshot() {
    use serde_json::json;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (fs, _) = faulty_top(dir, FaultyFs::mount);
    let top = fs.mountpoint.join("top.qcow2");
    // The new tops outside the faulty filesystem: only the old top fails.
    let new = dir.join("new");
    std::fs::create_dir(&new).unwrap();
    let ctl = dir.join("c.sock");
    let mut daemon = Daemon::start(dir, &top, &["--backing-root", s(dir), "--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    client.write(at(0), &[0x33; CLUSTER]);
    client.flush();

    fs.faults.set(false, true, false);
    let first = new.join("live1.qcow2");
    let reply = control(&ctl, json!({"command": "snapshot", "path": first}));
    assert_eq!(reply["ok"], true, "{reply}");
    // Open below the new top: the guest's data still right, no index over
    // it (the builder woken by the snapshot tried and failed).
    assert_eq!(client.read(at(0), CLUSTER), vec![0x33; CLUSTER]);
    assert_eq!(client.read(at(1), CLUSTER), vec![0x22; CLUSTER]);
    let tried = wait_index_state(&ctl, "a failed index build", |index| {
        index["failures"].as_u64() >= Some(1)
    });
    assert!(
        tried["result"]["index"]["last-error"]
            .as_str()
            .is_some_and(|e| e.contains("top.qcow2")),
        "the builder did not meet the old top's failure: {tried}"
    );
    let info = control(&ctl, json!({"command": "info"}));
    assert_eq!(
        info["result"]["indexed"], false,
        "indexed over an open old top: {info}"
    );

    fs.faults.set(false, false, false);
    client.write(at(1), &[0x44; CLUSTER]);
    client.flush();
    let second = new.join("live2.qcow2");
    let reply = control(&ctl, json!({"command": "snapshot", "path": second}));
    assert_eq!(reply["ok"], true, "{reply}");
    let last = wait_index_state(&ctl, "the index built after the close", |index| {
        index["pending-layers"] == 0 && index["building"] == false
    });
    let info = control(&ctl, json!({"command": "info"}));
    assert_eq!(info["result"]["indexed"], true, "{info}; {last}");
    client.write(at(2), &[0x55; CLUSTER]);
    client.flush();
    drop(client);
    daemon.stop();

    // Checked through the mount (the new tops name the old top there).
    for image in [top, first, second.clone()] {
        assert_check_clean(&image);
    }
    let mut expected = vec![0u8; 32 << 20];
    expected[..8 << 20].fill(0x22);
    expected[..CLUSTER].fill(0x33);
    expected[CLUSTER..2 * CLUSTER].fill(0x44);
    expected[2 * CLUSTER..3 * CLUSTER].fill(0x55);
    let out = tempfile::tempdir().unwrap();
    assert!(
        qemu_raw(&second, out.path()) == expected,
        "qemu-img convert"
    );
    drop(fs);
}
