//! `sqcow2 resize` against `qemu-img resize`: the same chain resized by
//! each reads the same (`qemu-img compare`), checks clean, keeps its data
//! and its chain index; every refusal is qemu-img's and writes nothing.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

fn sqcow2_raw(args: &[&str]) -> Output {
    run_raw(Command::new(sqcow2_bin()).args(args))
}

fn qemu_img_raw(args: &[&str]) -> Output {
    run_raw(Command::new("qemu-img").args(args))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn virtual_size(image: &Path) -> u64 {
    let json = qemu_img(&["info", "--output", "json", s(image)]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v["virtual-size"].as_u64().unwrap()
}

/// The bytes of every file in `dir`, to show that nothing was written.
fn files_of(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .map(|p| {
            let h = sha256_file(&p);
            (p, h)
        })
        .collect();
    files.sort();
    files
}

/// A copy of every file of `from` in a new directory below `root`.
fn copy_dir(from: &Path, root: &Path, name: &str) -> PathBuf {
    let to = root.join(name);
    std::fs::create_dir(&to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        if e.path().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    to
}

#[test]
fn growing_a_chain_matches_qemu_img_and_keeps_the_index() {
    let root = tempfile::tempdir().unwrap();
    let ours_dir = root.path().join("ours");
    std::fs::create_dir(&ours_dir).unwrap();
    let top = gen_chain(&ours_dir, 4, "64M", "0.5");
    // Data at the very end of the old disk, across the new boundary's
    // cluster.
    qemu_io(&top, &["write -P 0x5a 63M 1M".to_string()]);
    let theirs_dir = copy_dir(&ours_dir, root.path(), "theirs");
    let theirs = theirs_dir.join(top.file_name().unwrap());

    let out = sqcow2(&["resize", s(&top), "+1G"]);
    assert_eq!(out.trim(), "Image resized.");
    qemu_img(&["resize", "-q", s(&theirs), "+1G"]);

    assert_eq!(virtual_size(&top), (64 << 20) + (1 << 30));
    assert_same_images(&top, &theirs);
    assert_check_clean(&top);
    // The index still serves the chain.
    let info: serde_json::Value =
        serde_json::from_str(&sqcow2(&["info", "--output", "json", s(&top)])).unwrap();
    assert_eq!(info["chain-index"]["state"], "valid", "{info:#}");
    assert_eq!(info["virtual-size"], virtual_size(&top));
    // The new space reads as zeros and takes writes, through QEMU.
    qemu_io(
        &top,
        &[
            "read -P 0x5a 63M 1M".to_string(),
            "read -P 0 64M 1G".to_string(),
            "write -P 0x33 1000M 1M".to_string(),
            "read -P 0x33 1000M 1M".to_string(),
        ],
    );
    assert_check_clean(&top);
    // And through sqcow2 (the whole disk, as qemu-img reads it).
    assert_same_as_qemu(&top);
}

/// Growing past what the L1 table's clusters address (1 GiB per cluster
/// at 4 KiB clusters): the table moves, as qemu-img moves it. The top of
/// a two-layer chain with an internal snapshot, side by side with
/// qemu-img: the same disk (`compare`), both `check` clean, the snapshot
/// still applies, the index still serves, the new space takes writes.
#[test]
fn growing_past_the_l1_tables_clusters_moves_it_as_qemu_img() {
    let root = tempfile::tempdir().unwrap();
    let ours_dir = root.path().join("ours");
    std::fs::create_dir(&ours_dir).unwrap();
    let base = ours_dir.join("base.qcow2");
    let top = ours_dir.join("top.qcow2");
    qemu_create(&base, "cluster_size=4096", "1G");
    qemu_io(&base, &["write -P 0x11 0 2M".to_string()]);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        "base.qcow2",
        "-o",
        "cluster_size=4096",
        s(&top),
    ]);
    qemu_io(
        &top,
        &[
            "write -P 0x22 1M 2M".to_string(),
            "write -P 0x33 1023M 1M".to_string(),
        ],
    );
    qemu_img(&["snapshot", "-c", "before", s(&top)]);
    qemu_io(&top, &["write -P 0x44 500M 1M".to_string()]);
    sqcow2(&["upgrade", s(&top)]);
    let theirs_dir = copy_dir(&ours_dir, root.path(), "theirs");
    let theirs = theirs_dir.join("top.qcow2");

    assert_eq!(sqcow2(&["resize", s(&top), "3G"]).trim(), "Image resized.");
    qemu_img(&["resize", "-q", s(&theirs), "3G"]);
    assert_eq!(virtual_size(&top), 3 << 30);
    assert_same_images(&top, &theirs);
    assert_check_clean(&top);
    let info: serde_json::Value =
        serde_json::from_str(&sqcow2(&["info", "--output", "json", s(&top)])).unwrap();
    assert_eq!(info["chain-index"]["state"], "valid", "{info:#}");
    assert_same_as_qemu(&top);
    qemu_io(
        &top,
        &[
            "write -P 0x55 2900M 1M".to_string(),
            "read -P 0x55 2900M 1M".to_string(),
            "read -P 0x33 1023M 1M".to_string(),
        ],
    );
    assert_check_clean(&top);
    qemu_img(&["snapshot", "-a", "before", s(&top)]);
    qemu_io(&top, &["read -P 0 500M 1M".to_string()]);
    assert_check_clean(&top);
}

/// Shrinking an image whose L2 table across the new end an internal
/// snapshot shares: the table is copied first, and where that copy's
/// cluster needs a new refcount block (512 B clusters with 64-bit
/// refcounts: a block covers 64 clusters; the image's end moved across
/// such a boundary by 0..70 extra clusters of data), the block and the
/// refcount table naming it are written too. Each shrink checks clean,
/// reads as qemu-img's shrink of a copy, and the snapshot applies.
#[test]
fn shrinking_copies_a_shared_table_whatever_refcount_block_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("ours.qcow2");
    let theirs = dir.path().join("theirs.qcow2");
    let cut = (1 << 20) - (16 << 10);
    for extra in 0..70u64 {
        let _ = std::fs::remove_file(&ours);
        qemu_create(&ours, "cluster_size=512,refcount_bits=64", "2M");
        qemu_io(&ours, &["write -P 1 0 1M".to_string()]);
        qemu_img(&["snapshot", "-c", "s1", s(&ours)]);
        if extra > 0 {
            qemu_io(&ours, &[format!("write -P 2 1M {}", extra * 512)]);
        }
        std::fs::copy(&ours, &theirs).unwrap();
        let o = sqcow2_raw(&["resize", "--shrink", s(&ours), &cut.to_string()]);
        assert!(o.status.success(), "extra {extra}: {}", stderr(&o));
        qemu_img(&["resize", "-q", "--shrink", s(&theirs), &cut.to_string()]);
        assert_check_clean(&ours);
        assert_same_images(&ours, &theirs);
        qemu_img(&["snapshot", "-a", "s1", s(&ours)]);
        qemu_io(&ours, &["read -P 1 0 1M".to_string()]);
    }
}

#[test]
fn an_absolute_size_and_quiet() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    qemu_create(&img, "", "1G");
    let out = sqcow2(&["resize", "-q", s(&img), "3G"]);
    assert_eq!(out, "", "-q prints nothing");
    assert_eq!(virtual_size(&img), 3 << 30);
    // The same size again: nothing to do, as qemu-img.
    assert_eq!(sqcow2(&["resize", s(&img), "3G"]).trim(), "Image resized.");
    assert_check_clean(&img);
}

#[test]
fn internal_snapshots_of_a_v3_image_stay_readable() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    qemu_create(&img, "", "1G");
    qemu_io(&img, &["write -P 0x11 0 1M".to_string()]);
    qemu_img(&["snapshot", "-c", "before", s(&img)]);
    qemu_io(&img, &["write -P 0x22 0 1M".to_string()]);
    sqcow2(&["resize", s(&img), "2G"]);
    assert_eq!(virtual_size(&img), 2 << 30);
    assert_check_clean(&img);
    qemu_img(&["snapshot", "-a", "before", s(&img)]);
    qemu_io(&img, &["read -P 0x11 0 1M".to_string()]);
}

/// Each refusal writes nothing; where qemu-img refuses the same, in its
/// words and with its exit code.
#[test]
fn refusals_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    qemu_create(&img, "", "1G");
    qemu_io(&img, &["write -P 0x5a 0 1M".to_string()]);
    let v2 = dir.path().join("v2.qcow2");
    qemu_create(&v2, "compat=0.10", "1G");
    qemu_img(&["snapshot", "-c", "s1", s(&v2)]);
    let before = files_of(dir.path());
    let cases: [(&[&str], &str, &str); 7] = [
        (
            &["resize", s(&img), "512M"],
            "Use the --shrink option",
            "1G",
        ),
        (
            &["resize", s(&img), "-1G"],
            "New image size must be positive",
            "",
        ),
        (
            &["resize", s(&img), "--", "-2G"],
            "New image size must be positive",
            "",
        ),
        (
            &["resize", s(&img), "+100"],
            "The new size must be a multiple of 512",
            "",
        ),
        (
            &["resize", "--preallocation=bogus", s(&img), "2G"],
            "Invalid preallocation mode 'bogus'",
            "",
        ),
        (
            &["resize", s(&v2), "2G"],
            "Can't resize a v2 image which has snapshots",
            "",
        ),
        (
            &["resize", s(&img), "-f", "raw", "2G"],
            "invalid value 'raw'",
            "",
        ),
    ];
    for (args, ours, _) in cases {
        let o = sqcow2_raw(args);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(stderr(&o).contains(ours), "{args:?}: {}", stderr(&o));
    }
    // qemu-img refuses the same (its own words where sqcow2 shares them).
    for (args, words) in [
        (vec!["resize", s(&img), "512M"], "Use the --shrink option"),
        (
            vec!["resize", s(&img), "--", "-2G"],
            "New image size must be positive",
        ),
        (
            vec!["resize", s(&img), "+100"],
            "The new size must be a multiple of 512",
        ),
        (
            vec!["resize", "--preallocation=bogus", s(&img), "2G"],
            "Invalid preallocation mode 'bogus'",
        ),
        (
            vec!["resize", s(&v2), "2G"],
            "Can't resize a v2 image which has snapshots",
        ),
    ] {
        let q = qemu_img_raw(&args);
        assert_eq!(q.status.code(), Some(1), "qemu-img {args:?}");
        assert!(
            stderr(&q).contains(words),
            "qemu-img {args:?}: {}",
            stderr(&q)
        );
    }
    assert_eq!(files_of(dir.path()), before, "a refused resize wrote");
}

#[test]
fn an_image_in_use_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    qemu_create(&img, "", "1G");
    // qemu-io holds the image (write lock) while it sleeps.
    let mut holder = QemuIoHolder::hold(&img, &["-f", "qcow2"]);
    let before = sha256_file(&img);
    let o = sqcow2_raw(&["resize", s(&img), "2G"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("lock"), "{}", stderr(&o));
    assert_eq!(sha256_file(&img), before);
    assert!(holder.still_running(), "qemu-io held the image throughout");
    drop(holder);
    assert_eq!(virtual_size(&img), 1 << 30);
}

/// A live resize: `sqcow2 resize --live` grows the disk a daemon serves
/// (the guest's data kept), past what the L1 table's clusters address too
/// (the table moves, as QEMU grows it live), a frontend that connects
/// next sees the new capacity and writes the new space; shrinking a
/// served disk or growing past the format's limits is refused; QEMU reads
/// the grown chain after the daemon stops.
#[test]
fn a_live_resize_grows_the_served_disk() {
    use common::vhost::{connect_retry, Daemon};
    let dir = tempfile::tempdir().unwrap();
    let top = gen_chain(dir.path(), 4, "64M", "0.5");
    let ctl = dir.path().join("control.sock");
    let mut daemon = Daemon::start(dir.path(), &top, &["--control", s(&ctl)]);
    let mut first = connect_retry(&daemon, 1, false);
    assert_eq!(first.capacity(), 64 << 20);
    first.write(63 << 20, &vec![0x61; 1 << 20]);
    first.flush();
    // A write past the end is refused before the resize.
    assert_ne!(first.try_write(80 << 20, &[0x62; 4096]), 0);

    let out = sqcow2(&["resize", "--live", "--output", "json", s(&ctl), "+32M"]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["old-size"], 64 << 20, "{out}");
    assert_eq!(r["size"], 96 << 20, "{out}");
    // Past the format's limits (a 32 MiB L1 table): refused inside the
    // pause, the daemon answers and goes on.
    let o = sqcow2_raw(&["resize", "--live", s(&ctl), "4P"]);
    assert!(!o.status.success(), "{}", stderr(&o));
    // Shrinking what is served: refused, the size unchanged.
    let o = sqcow2_raw(&["resize", "--live", s(&ctl), "32M"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("shrinking a served disk is refused"),
        "{}",
        stderr(&o)
    );
    // The connected frontend's requests are checked against the new size.
    assert_eq!(first.try_write(80 << 20, &[0x62; 4096]), 0);
    first.flush();
    // Past what the L1 table's cluster addresses (4 TiB at 64 KiB
    // clusters): the table moves inside the pause.
    let out = sqcow2(&["resize", "--live", "--output", "json", s(&ctl), "5T"]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["size"], 5u64 << 40, "{out}");
    assert_eq!(first.try_write(4u64 << 40, &[0x64; 4096]), 0);
    first.flush();
    drop(first);

    let mut next = connect_retry(&daemon, 1, false);
    assert_eq!(
        next.capacity(),
        5u64 << 40,
        "a frontend connecting now sees the new size"
    );
    next.write(95 << 20, &vec![0x63; 1 << 20]);
    next.write((5u64 << 40) - (1 << 20), &vec![0x65; 1 << 20]);
    next.flush();
    assert_eq!(next.read(63 << 20, 1 << 20), vec![0x61; 1 << 20]);
    assert_eq!(next.read(4u64 << 40, 4096), vec![0x64; 4096]);
    drop(next);
    daemon.stop();

    assert_eq!(virtual_size(&top), 5u64 << 40);
    assert_check_clean(&top);
    qemu_io(
        &top,
        &[
            "read -P 0x61 63M 1M".to_string(),
            "read -P 0x62 80M 4k".to_string(),
            "read -P 0x63 95M 1M".to_string(),
            "read -P 0x64 4T 4k".to_string(),
            "read -P 0x65 5242879M 1M".to_string(),
            "read -P 0 3T 4k".to_string(),
        ],
    );
}

/// Growing a top over a longer backing file: the new range reads as
/// zeros, not as the backing file's data (as QEMU zero-writes it), the
/// same as `qemu-img resize` of a copy.
#[test]
fn growing_over_a_longer_backing_file_reads_zeros() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ours");
    std::fs::create_dir(&dir).unwrap();
    let base = dir.join("base.qcow2");
    qemu_create(&base, "", "128M");
    qemu_io(
        &base,
        &[
            "write -P 0xaa 96M 1M".to_string(),
            "write -P 0xbb 1M 1M".to_string(),
        ],
    );
    let top = dir.join("top.qcow2");
    qemu_overlay(&top, "base.qcow2", "qcow2", &[], Some("64M"));
    let theirs_dir = copy_dir(&dir, root.path(), "theirs");
    sqcow2(&["resize", s(&top), "128M"]);
    qemu_img(&["resize", "-q", s(&theirs_dir.join("top.qcow2")), "128M"]);
    qemu_io(
        &top,
        &[
            "read -P 0 96M 1M".to_string(),
            "read -P 0xbb 1M 1M".to_string(),
        ],
    );
    assert_same_images(&top, &theirs_dir.join("top.qcow2"));
    assert_check_clean(&top);
}

fn assert_same_images(a: &Path, b: &Path) {
    let cmp = qemu_img_raw(&["compare", s(a), s(b)]);
    assert!(
        cmp.status.success(),
        "qemu-img compare: {}{}",
        String::from_utf8_lossy(&cmp.stdout),
        stderr(&cmp)
    );
}

/// `--shrink` of a chain's top against `qemu-img resize --shrink` of a
/// copy: the same bytes, checks clean, the file cut as QEMU cuts it, an
/// internal snapshot that shares the table across the new end still
/// reads its old data, the index valid; grown again, both read zeros
/// past the old end.
#[test]
fn shrinking_matches_qemu_img() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ours");
    std::fs::create_dir(&dir).unwrap();
    let top = gen_chain(&dir, 3, "1G", "0.3");
    qemu_io(
        &top,
        &[
            "write -P 0x11 100M 2M".to_string(),
            "write -P 0x22 700M 1M".to_string(),
            "write -P 0x33 1000M 1M".to_string(),
        ],
    );
    // The snapshot shares every table of the top, the one across the new
    // end (100M) included.
    qemu_img(&["snapshot", "-c", "before", s(&top)]);
    let theirs_dir = copy_dir(&dir, root.path(), "theirs");
    let theirs = theirs_dir.join(top.file_name().unwrap());

    let out = sqcow2(&["resize", "--shrink", s(&top), "101M"]);
    assert_eq!(out.trim(), "Image resized.");
    qemu_img(&["resize", "-q", "--shrink", s(&theirs), "101M"]);
    assert_eq!(virtual_size(&top), 101 << 20);
    assert_same_images(&top, &theirs);
    assert_check_clean(&top);
    assert_eq!(
        std::fs::metadata(&top).unwrap().len(),
        std::fs::metadata(&theirs).unwrap().len(),
        "the file cut after its last used cluster, as qemu-img cuts it"
    );
    let info: serde_json::Value =
        serde_json::from_str(&sqcow2(&["info", "--output", "json", s(&top)])).unwrap();
    assert_eq!(info["chain-index"]["state"], "valid", "{info:#}");
    assert_same_as_qemu(&top);
    qemu_io(&top, &["read -P 0x11 100M 1M".to_string()]);

    // Grown again: past 101M, zeros (not the dropped data, nor what the
    // backing files hold there), as qemu-img leaves it.
    sqcow2(&["resize", s(&top), "1G"]);
    qemu_img(&["resize", "-q", s(&theirs), "1G"]);
    assert_same_images(&top, &theirs);
    qemu_io(
        &top,
        &[
            "read -P 0 101M 923M".to_string(),
            "read -P 0x11 100M 1M".to_string(),
        ],
    );
    assert_check_clean(&top);

    // The snapshot kept everything.
    qemu_img(&["snapshot", "-a", "before", s(&top)]);
    qemu_io(
        &top,
        &[
            "read -P 0x11 100M 2M".to_string(),
            "read -P 0x22 700M 1M".to_string(),
            "read -P 0x33 1000M 1M".to_string(),
        ],
    );
    assert_check_clean(&top);
}

/// Shrink refusals, each also qemu-img's, write nothing.
#[test]
fn shrink_refusals_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    qemu_create(&img, "", "1G");
    qemu_io(&img, &["write -P 0x5a 900M 1M".to_string()]);
    let v2 = dir.path().join("v2.qcow2");
    qemu_create(&v2, "compat=0.10", "1G");
    qemu_img(&["snapshot", "-c", "s1", s(&v2)]);
    let before = files_of(dir.path());
    for (args, words) in [
        (
            vec![
                "resize",
                "--shrink",
                "--preallocation=full",
                s(&img),
                "512M",
            ],
            "Preallocation can only be used for growing images",
        ),
        (
            vec!["resize", "--shrink", s(&v2), "512M"],
            "Can't resize a v2 image which has snapshots",
        ),
        (
            vec!["resize", "--shrink", s(&img), "--", "-1G"],
            "New image size must be positive",
        ),
        (
            vec!["resize", "--shrink", s(&img), "100000"],
            "The new size must be a multiple of 512",
        ),
    ] {
        let o = sqcow2_raw(&args);
        assert_eq!(o.status.code(), Some(1), "sqcow2 {args:?}");
        assert!(stderr(&o).contains(words), "{args:?}: {}", stderr(&o));
        let q = qemu_img_raw(&args);
        assert_eq!(q.status.code(), Some(1), "qemu-img {args:?}");
        assert!(
            stderr(&q).contains(words),
            "qemu-img {args:?}: {}",
            stderr(&q)
        );
    }
    assert_eq!(files_of(dir.path()), before, "a refused shrink wrote");
}

/// After a live resize the guest's next writes find the mapping journal
/// running, as before it: stopped by the resize's flushes and restarted
/// only by the next change, it made that change and every one after it
/// wait for a publish whose sync covered everything written in place
/// since (the stall a reconnect caused, see `vhost_blkio.rs`).
#[test]
fn a_live_resize_leaves_the_journal_running() {
    use common::vhost::{connect_retry, Daemon};
    let dir = tempfile::tempdir().unwrap();
    let top = gen_chain(dir.path(), 2, "64M", "0.5");
    let ctl = dir.path().join("control.sock");
    let mut daemon = Daemon::start(dir.path(), &top, &["--control", s(&ctl)]);
    let mut c = connect_retry(&daemon, 1, false);
    c.write(1 << 20, &[0x11u8; 64 << 10]);
    assert!(journal_running(&top), "no journal before the resize");
    sqcow2(&["resize", "--live", s(&ctl), "+32M"]);
    assert!(
        journal_running(&top),
        "the journal is not running after the resize:\n{}",
        daemon.log()
    );
    let data = vec![0x22u8; 64 << 10];
    c.write(80 << 20, &data);
    assert_eq!(c.read(80 << 20, data.len()), data);
    // A resize refused inside the pause (past the format's limits)
    // leaves the chain served as it was, its journal running too.
    let o = sqcow2_raw(&["resize", "--live", s(&ctl), "4P"]);
    assert!(!o.status.success());
    assert!(
        journal_running(&top),
        "the journal is not running after a refused resize:\n{}",
        daemon.log()
    );
    c.write(81 << 20, &data);
    assert_eq!(c.read(81 << 20, data.len()), data);
    drop(c);
    daemon.stop();
    assert_check_clean(&top);
}
