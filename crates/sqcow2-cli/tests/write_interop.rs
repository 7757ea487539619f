//! Interoperability of the write path with QEMU, both ways, and the
//! `create`, `check` and `io` commands against their QEMU counterparts.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{
    assert_same_as_qemu, qemu_create, qemu_img, qemu_io, qemu_overlay, run_raw, s, sqcow2,
    sqcow2_bin,
};
use sqcow2_format::{Chain, ChainOptions};

fn rw(top: &Path) -> Chain {
    Chain::open(
        top,
        &ChainOptions {
            writable: true,
            ..ChainOptions::default()
        },
    )
    .unwrap()
}

fn qemu_check(top: &Path) -> (Option<i32>, String) {
    let out = run_raw(Command::new("qemu-img").args(["check", s(top)]));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn sqcow2_status(args: &[&str]) -> (Option<i32>, String, String) {
    let out = run_raw(Command::new(sqcow2_bin()).args(args));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn chain_of_two(dir: &Path) -> PathBuf {
    let base = dir.join("base.qcow2");
    qemu_create(&base, "", "32M");
    qemu_io(
        &base,
        &[
            "write -P 0x11 0 8M".into(),
            "write -c -P 0x12 16M 1M".into(),
        ],
    );
    let top = dir.join("top.qcow2");
    sqcow2(&["create", "-b", "base.qcow2", "-F", "qcow2", s(&top)]);
    top
}

#[test]
fn qemu_reads_what_sqcow2_wrote_and_back() {
    let tmp = tempfile::tempdir().unwrap();
    let top = chain_of_two(tmp.path());
    let chain = rw(&top);
    chain.write_at(&[0x33; 5000], 1000).unwrap();
    chain
        .write_at(&vec![0x44; 3 << 20], (16 << 20) | 777)
        .unwrap();
    chain.write_zeroes(4 << 20, 2 << 20, false).unwrap();
    chain.discard(6 << 20, 1 << 20).unwrap();
    chain.close().unwrap();
    assert_eq!(qemu_check(&top).0, Some(0));
    assert_same_as_qemu(&top);
    // QEMU writes on top of what sqcow2 wrote; sqcow2 reads QEMU's bytes.
    qemu_io(
        &top,
        &[
            "write -P 0x55 3000 70000".into(),
            "write -z 16M 64k".into(),
            "discard 4M 1M".into(),
        ],
    );
    assert_same_as_qemu(&top);
    let (code, out, _) = sqcow2_status(&["check", s(&top)]);
    assert_eq!(code, Some(0), "{out}");
    // And sqcow2 writes again on top of QEMU's writes.
    let chain = rw(&top);
    chain.write_at(&[0x66; 100_000], 50_000).unwrap();
    chain.close().unwrap();
    assert_eq!(qemu_check(&top).0, Some(0));
    assert_same_as_qemu(&top);
}

#[test]
fn io_runs_qemu_io_scripts_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = chain_of_two(tmp.path());
    let theirs = tmp.path().join("theirs.qcow2");
    qemu_overlay(&theirs, "base.qcow2", "qcow2", &[], None);
    let script = [
        "write -P 0xab 0 64k",
        "write -P 0x5 100000 3000",
        "write -z 1M 128k",
        "write -z -u 2M 64k",
        "discard 0 64k",
        "flush",
        "read -P 0 0 64k",
        "read -P 5 100000 3000",
        "read -P 0x11 3M 64k",
        "write -q -P 0x6 5M 512",
        "read -q -P 0x6 5M 512",
    ];
    let mut q = Command::new("qemu-io");
    let mut o = Command::new(sqcow2_bin());
    o.arg("io");
    q.args(["-f", "qcow2"]);
    for c in script {
        q.args(["-c", c]);
        o.args(["-c", c]);
    }
    let q = run_raw(q.arg(&theirs));
    let o = run_raw(o.arg(&ours));
    assert!(q.status.success() && o.status.success());
    let first_lines = |out: &[u8]| -> Vec<String> {
        String::from_utf8_lossy(out)
            .lines()
            .filter(|l| l.starts_with("wrote") || l.starts_with("read") || l.starts_with("discard"))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(first_lines(&o.stdout), first_lines(&q.stdout));
    let cmp = run_raw(Command::new("qemu-img").args(["compare", s(&ours), s(&theirs)]));
    assert_eq!(
        cmp.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&cmp.stdout)
    );
    // An invalid pattern byte is refused as qemu-io refuses it.
    let (code, out, err) = sqcow2_status(&["io", "-c", "write -P 300 0 512", s(&ours)]);
    assert_eq!(code, Some(1));
    assert!(
        format!("{out}{err}").contains("300 is not a valid pattern byte"),
        "{out}{err}"
    );
    // A failed pattern check fails the command and the exit status.
    let (code, out, _) = sqcow2_status(&["io", "-c", "read -P 0x77 0 512", s(&ours)]);
    assert_eq!(code, Some(1));
    assert!(
        out.contains("Pattern verification failed at offset 0"),
        "{out}"
    );
}

#[test]
fn create_matches_qemu_for_every_option() {
    let tmp = tempfile::tempdir().unwrap();
    for opts in [
        "cluster_size=512",
        "cluster_size=2M",
        "compat=0.10",
        "extended_l2=on,compression_type=zstd",
        "lazy_refcounts=on,refcount_bits=1",
        "refcount_bits=64,cluster_size=4096",
    ] {
        let ours = tmp.path().join("ours.qcow2");
        let theirs = tmp.path().join("theirs.qcow2");
        sqcow2(&["create", "-o", opts, s(&ours), "3G"]);
        qemu_create(&theirs, opts, "3G");
        assert_eq!(qemu_check(&ours).0, Some(0), "{opts}");
        let info = |p: &Path| -> serde_json::Value {
            let mut v: serde_json::Value =
                serde_json::from_str(&qemu_img(&["info", "--output", "json", s(p)])).unwrap();
            let o = v.as_object_mut().unwrap();
            for k in ["filename", "actual-size", "dirty-flag", "children"] {
                o.remove(k);
            }
            v
        };
        assert_eq!(info(&ours), info(&theirs), "{opts}");
    }
    // Size defaults to the backing file's; a raw backing needs -F.
    let base = tmp.path().join("base.raw");
    std::fs::write(&base, vec![1u8; 1 << 20]).unwrap();
    let top = tmp.path().join("top.qcow2");
    let (code, _, err) = sqcow2_status(&["create", "-b", "base.raw", s(&top)]);
    assert_eq!(code, Some(1), "{err}");
    sqcow2(&["create", "-b", "base.raw", "-F", "raw", s(&top)]);
    assert_same_as_qemu(&top);
    // A backing file without its format is refused, as qemu-img refuses
    // it (whatever the backing file holds), and nothing is created.
    let qbase = tmp.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&qbase), "1M"]);
    for (tool, target) in [("qemu-img", "q-nofmt.qcow2"), ("sqcow2", "s-nofmt.qcow2")] {
        let target = tmp.path().join(target);
        let mut cmd = if tool == "qemu-img" {
            let mut c = Command::new("qemu-img");
            c.args(["create", "-q", "-f", "qcow2"]);
            c
        } else {
            let mut c = Command::new(common::sqcow2_bin());
            c.arg("create");
            c
        };
        let out = run_raw(cmd.args(["-b", "base.qcow2", s(&target)]));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{tool}: {err}");
        assert!(
            err.contains("Backing file specified without backing format"),
            "{tool}: {err}"
        );
        assert!(!target.exists(), "{tool} created {}", target.display());
    }
}

/// Adds `delta` to the 16-bit refcount of cluster `idx` (first block only).
fn poke_refcount(path: &Path, idx: u64, value: u16) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, 48).unwrap();
    let table = u64::from_be_bytes(b);
    f.read_exact_at(&mut b, table).unwrap();
    let block = u64::from_be_bytes(b);
    f.write_all_at(&value.to_be_bytes(), block + idx * 2)
        .unwrap();
}

#[test]
fn check_exit_codes_and_repairs_match_qemu() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img.qcow2");
    sqcow2(&["create", s(&img), "16M"]);
    sqcow2(&["io", "-c", "write -P 1 0 1M", s(&img)]);
    let clusters = std::fs::metadata(&img).unwrap().len() / 65536;

    // A leak: a cluster inside the file that nothing uses gets refcount 1.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len((clusters + 4) * 65536)
        .unwrap();
    poke_refcount(&img, clusters + 3, 1);
    let (code, out, _) = sqcow2_status(&["check", s(&img)]);
    assert_eq!(code, Some(3), "{out}");
    assert_eq!(qemu_check(&img).0, Some(3));
    let (code, json, _) = sqcow2_status(&["check", "--output", "json", s(&img)]);
    assert_eq!(code, Some(3));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["leaks"], 1);
    let (code, _, _) = sqcow2_status(&["check", "-r", "leaks", s(&img)]);
    assert_eq!(code, Some(0));
    assert_eq!(qemu_check(&img).0, Some(0));

    // A corruption: a data cluster's refcount drops to 0.
    let l1: u64 = {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(&img).unwrap();
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, 40).unwrap();
        let l1 = u64::from_be_bytes(b);
        f.read_exact_at(&mut b, l1).unwrap();
        let l2 = u64::from_be_bytes(b) & 0x00ff_ffff_ffff_fe00;
        f.read_exact_at(&mut b, l2).unwrap();
        (u64::from_be_bytes(b) & 0x00ff_ffff_ffff_fe00) / 65536
    };
    poke_refcount(&img, l1, 0);
    let (code, out, _) = sqcow2_status(&["check", s(&img)]);
    assert_eq!(code, Some(2), "{out}");
    assert_eq!(qemu_check(&img).0, Some(2));
    // `-r leaks` cannot fix a refcount too low: QEMU changes nothing and
    // fails the check ("need to rebuild refcount structures").
    let copy = tmp.path().join("copy.qcow2");
    std::fs::copy(&img, &copy).unwrap();
    let qemu = run_raw(Command::new("qemu-img").args(["check", "-r", "leaks", s(&copy)]));
    let before = std::fs::read(&img).unwrap();
    let (code, out, _) = sqcow2_status(&["check", "-r", "leaks", s(&img)]);
    assert_eq!(
        code,
        qemu.status.code(),
        "-r leaks does not fix errors: {out}"
    );
    assert_eq!(code, Some(1));
    assert!(out.contains("need to rebuild refcount structures"), "{out}");
    assert!(
        std::fs::read(&img).unwrap() == before,
        "-r leaks changed the image"
    );
    let (code, out, _) = sqcow2_status(&["check", "-r", "all", s(&img)]);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(qemu_check(&img).0, Some(0));
    let (code, out, _) = sqcow2_status(&["io", "-c", "read -P 1 0 1M", s(&img)]);
    assert_eq!(code, Some(0), "{out}");
}

fn incompatible_bits(path: &Path) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 8];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut b, 72)
        .unwrap();
    u64::from_be_bytes(b)
}

#[test]
fn lazy_refcounts_dirty_bit_and_repair() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img.qcow2");
    sqcow2(&["create", "-o", "lazy_refcounts=on", s(&img), "16M"]);
    let chain = rw(&img);
    // Set from the open: the mapping journal is active (a process death
    // must be followed by a repair).
    assert_eq!(incompatible_bits(&img) & 1, 1, "dirty bit set at the open");
    assert!(img.with_file_name("img.qcow2.sqjournal").exists());
    chain.write_at(&[7u8; 200_000], 12345).unwrap();
    chain.flush().unwrap();
    assert_eq!(
        incompatible_bits(&img) & 1,
        1,
        "dirty bit set before metadata changes"
    );
    chain.close().unwrap();
    assert_eq!(
        incompatible_bits(&img) & 1,
        0,
        "clean close clears the dirty bit"
    );
    assert!(
        !img.with_file_name("img.qcow2.sqjournal").exists(),
        "a clean close removes the journal"
    );
    assert_eq!(qemu_check(&img).0, Some(0));

    // A crash after a flush: the image stays dirty with stale refcounts
    // (a failed engine writes nothing more back; dropping it closes the
    // file as a crash would).
    let chain = rw(&img);
    chain.write_at(&[8u8; 300_000], 2 << 20).unwrap();
    chain.flush().unwrap();
    chain.fail("simulated crash");
    drop(chain);
    assert_eq!(incompatible_bits(&img) & 1, 1);
    let info: serde_json::Value =
        serde_json::from_str(&sqcow2(&["info", "--output", "json", s(&img)])).unwrap();
    assert_eq!(info["dirty-flag"], true);
    // Opening read-write repairs it, as QEMU does.
    rw(&img).close().unwrap();
    assert_eq!(incompatible_bits(&img) & 1, 0);
    assert_eq!(qemu_check(&img).0, Some(0));
    let (code, out, _) = sqcow2_status(&[
        "io",
        "-c",
        "read -P 8 2M 300000",
        "-c",
        "read -P 7 12345 200000",
        s(&img),
    ]);
    assert_eq!(code, Some(0), "{out}");
}

#[test]
fn shared_clusters_of_internal_snapshots_are_copied() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img.qcow2");
    sqcow2(&["create", "-o", "cluster_size=4096", s(&img), "8M"]);
    qemu_io(&img, &["write -P 0x21 0 1M".into()]);
    qemu_img(&["snapshot", "-c", "before", s(&img)]);
    let chain = rw(&img);
    chain.write_at(&[0x22; 10_000], 5000).unwrap();
    chain.write_zeroes(512 << 10, 256 << 10, true).unwrap();
    chain.close().unwrap();
    assert_eq!(qemu_check(&img).0, Some(0));
    // The snapshot still holds the old data.
    qemu_img(&["snapshot", "-a", "before", s(&img)]);
    let (code, out, _) = sqcow2_status(&["io", "-c", "read -P 0x21 0 1M", s(&img)]);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(qemu_check(&img).0, Some(0));
}

#[test]
fn read_only_chains_refuse_writes_and_rebase_u_keeps_bitmaps() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img.qcow2");
    sqcow2(&["create", s(&img), "16M"]);
    let ro = Chain::open(&img, &ChainOptions::default()).unwrap();
    assert!(ro.write_at(&[1], 0).is_err());
    assert!(ro.write_at(&[1], 16 << 20).is_err());
    // (A reader holds the image locks: qemu-img could not write it.)
    drop(ro);
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);

    // Changing only the header (`rebase -u`) keeps the bitmaps, as
    // qemu-img rebase -u does.
    let theirs = tmp.path().join("theirs.qcow2");
    std::fs::copy(&img, &theirs).unwrap();
    let base = tmp.path().join("base.qcow2");
    qemu_create(&base, "", "16M");
    let (code, out, err) =
        sqcow2_status(&["rebase", "-u", "-b", "base.qcow2", "-F", "qcow2", s(&img)]);
    assert_eq!(code, Some(0), "{out}{err}");
    qemu_img(&[
        "rebase",
        "-u",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        s(&theirs),
    ]);
    let info = |p: &Path| -> serde_json::Value {
        let v: serde_json::Value =
            serde_json::from_str(&qemu_img(&["info", "--output", "json", s(p)])).unwrap();
        serde_json::json!([v["backing-filename"], v["format-specific"]])
    };
    assert_eq!(info(&img), info(&theirs));
    assert_eq!(qemu_check(&img).0, Some(0));
}

#[test]
fn refcount_table_grows_as_the_image_grows() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img.qcow2");
    // 512-byte clusters with 64-bit refcounts: one refcount block covers
    // 64 clusters and the first table 4096, so 8 MiB of data outgrows it.
    sqcow2(&[
        "create",
        "-o",
        "cluster_size=512,refcount_bits=64",
        s(&img),
        "16M",
    ]);
    let table_before = std::fs::read(&img).unwrap()[48..60].to_vec();
    let chain = rw(&img);
    for i in 0..16u64 {
        chain
            .write_at(&vec![i as u8 + 1; 512 << 10], i * (512 << 10))
            .unwrap();
        if i % 4 == 3 {
            chain.flush().unwrap();
        }
    }
    chain.close().unwrap();
    let table_after = std::fs::read(&img).unwrap()[48..60].to_vec();
    assert_ne!(
        table_before, table_after,
        "the refcount table should have moved"
    );
    assert_eq!(qemu_check(&img), (Some(0), qemu_check(&img).1));
    let (code, out, _) = sqcow2_status(&["io", "-c", "read -P 16 7680k 512k", s(&img)]);
    assert_eq!(code, Some(0), "{out}");
}

/// What the page cache holds of `path`, in bytes (util-linux's `fincore`).
fn cached_bytes(path: &Path) -> u64 {
    let out = common::run(
        Command::new("fincore")
            .args(["--bytes", "--noheadings", "--output", "RES"])
            .arg(path),
    );
    out.trim().parse().expect("fincore's RES")
}

/// `posix_fadvise(advice)` over the whole of `file`.
fn advise(file: &std::fs::File, advice: i32) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain call on a descriptor `file` owns; no memory passed.
    assert_eq!(
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, advice) },
        0
    );
}

/// Host offset of guest offset `guest` in `image` (allocated there), from
/// `qemu-img map`.
fn host_of(image: &Path, guest: u64) -> u64 {
    let map: serde_json::Value =
        serde_json::from_str(&qemu_img(&["map", "--output=json", s(image)])).unwrap();
    map.as_array()
        .unwrap()
        .iter()
        .find(|e| {
            let start = e["start"].as_u64().unwrap();
            start <= guest && guest < start + e["length"].as_u64().unwrap() && e["data"] == true
        })
        .and_then(|e| Some(e["offset"].as_u64()? + guest - e["start"].as_u64()?))
        .expect("guest offset allocated")
}

/// A copy-on-write reads the rest of its cluster from the layer below
/// once, without the kernel's readahead: through the file's usual
/// descriptor, a page-cache miss right after cached pages is taken for a
/// stream and read on (up to the disk's `read_ahead_kb`, 8 MiB on this
/// project's VMs; over a sparse layer's holes page after page zero-filled
/// in the writing thread, measured as engine jobs running 2-4 ms inside a
/// live snapshot's drain). Oracle: the page cache's residency of the
/// layer below (`fincore`), against a plain read of the same shape, which
/// must read ahead (or the test could not tell).
#[test]
fn a_copy_on_write_does_not_read_ahead_in_the_layer_below() {
    const MIB: u64 = 1 << 20;
    const CLUSTER: u64 = 65536;
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    let top = tmp.path().join("top.qcow2");
    qemu_create(&base, "", "64M");
    // Written in order: guest and host offsets go up together.
    qemu_io(&base, &["write -P 7 0 64M".to_string()]);
    qemu_overlay(&top, "base.qcow2", "qcow2", &[], None);
    let chain = rw(&top);
    // The base's tables into sqcow2's cache (a copy-on-write elsewhere in
    // the same slice), so that only data is read below from now on.
    chain.write_at(&[1; 4096], 60 * MIB).unwrap();
    let plain = std::fs::File::open(&base).unwrap();
    plain.sync_all().unwrap();
    advise(&plain, libc::POSIX_FADV_DONTNEED);
    // Caches the 8 MiB of the base before `host` and nothing else
    // (readahead off on this description).
    advise(&plain, libc::POSIX_FADV_RANDOM);
    let cache_before = |host: u64| {
        let mut buf = vec![0u8; MIB as usize];
        for at in (host - 8 * MIB..host).step_by(MIB as usize) {
            std::os::unix::fs::FileExt::read_exact_at(&plain, &mut buf, at).unwrap();
        }
    };

    // The plain read: a cluster's 60 KiB right after 8 MiB of cached data.
    let control = host_of(&base, 16 * MIB);
    cache_before(control);
    let before = cached_bytes(&base);
    let reader = std::fs::File::open(&base).unwrap();
    let mut buf = vec![0u8; (CLUSTER - 4096) as usize];
    std::os::unix::fs::FileExt::read_exact_at(&reader, &mut buf, control).unwrap();
    let read_ahead = cached_bytes(&base) - before;
    assert!(
        read_ahead > CLUSTER,
        "this filesystem does not read ahead (a plain read brought {read_ahead} bytes in): \
         the test cannot tell"
    );

    // The copy-on-write: the guest writes the cluster's last 4 KiB, its
    // first 60 KiB come from the base, right after 8 MiB of cached data.
    let guest = 40 * MIB;
    let source = host_of(&base, guest);
    cache_before(source);
    let before = cached_bytes(&base);
    chain.write_at(&[2; 4096], guest + CLUSTER - 4096).unwrap();
    let brought = cached_bytes(&base) - before;
    assert!(
        brought <= CLUSTER,
        "the copy-on-write brought {brought} bytes of the base into the page cache \
         (a plain read: {read_ahead}); it reads {} once",
        CLUSTER - 4096
    );
    // And it copied the right bytes.
    let mut got = vec![0u8; CLUSTER as usize];
    chain.read_at(&mut got, guest).unwrap();
    assert!(got[..(CLUSTER - 4096) as usize].iter().all(|&b| b == 7));
    assert!(got[(CLUSTER - 4096) as usize..].iter().all(|&b| b == 2));
    chain.close().unwrap();
    assert_eq!(qemu_check(&top).0, Some(0));
}

/// QEMU allocates an extended-L2 cluster and writes only the subclusters
/// written: the file ends inside that cluster (its tail was never
/// written). `qemu-img check` finds nothing wrong, so sqcow2 must write
/// into the rest of the cluster as QEMU does, not refuse the write.
#[test]
fn writes_into_a_qemu_cluster_that_ends_past_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("ours.qcow2");
    qemu_create(&ours, "extended_l2=on,cluster_size=128k", "64M");
    // The last cluster QEMU allocates gets its second and third 4 KiB
    // subclusters only.
    qemu_io(&ours, &["write -P 0x11 4k 8k".into()]);
    let len = std::fs::metadata(&ours).unwrap().len();
    assert_eq!(
        len % (128 << 10),
        12 << 10,
        "the file ends inside the cluster"
    );
    assert_eq!(qemu_check(&ours).0, Some(0));
    let theirs = tmp.path().join("theirs.qcow2");
    std::fs::copy(&ours, &theirs).unwrap();

    // Into an unallocated subcluster (a copy-on-write), an allocated one
    // (in place), and the cluster's last one, past the file's end.
    let writes = [
        "write -P 0x22 2k 4k",
        "write -P 0x33 6k 1k",
        "write -P 0x44 124k 4k",
    ];
    for w in writes {
        let (code, out, err) = sqcow2_status(&["io", "-c", w, s(&ours)]);
        assert_eq!(code, Some(0), "{w}: {out}{err}");
    }
    qemu_io(&theirs, &writes.map(String::from));
    assert_eq!(qemu_check(&ours).0, Some(0), "{}", qemu_check(&ours).1);
    assert_same_as_qemu(&ours);
    qemu_img(&["compare", "-q", s(&ours), s(&theirs)]);
    // And through the library, in place, into what is now written.
    let chain = rw(&ours);
    chain.write_at(&[0x55; 512], 100 << 10).unwrap();
    chain.close().unwrap();
    qemu_io(&theirs, &["write -P 0x55 100k 512".into()]);
    assert_eq!(qemu_check(&ours).0, Some(0));
    qemu_img(&["compare", "-q", s(&ours), s(&theirs)]);
}

/// A data cluster that starts at or past the end of the file is what
/// `qemu-img check` counts as one corruption (and it compares no
/// refcount there: no leak); `sqcow2 check` finds the same, and a write
/// into it is refused with that reason rather than made.
#[test]
fn a_cluster_past_the_end_of_the_file_is_checked_and_refused_as_qemu_does() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("img.qcow2");
    qemu_create(&img, "", "64M");
    qemu_io(
        &img,
        &["write -P 0x77 0 64k".into(), "write -P 0x78 1M 64k".into()],
    );
    // Cut the last data cluster off, as a crash before the file grew
    // could leave it.
    let len = std::fs::metadata(&img).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(len - (64 << 10))
        .unwrap();
    let (qemu_code, qemu_out) = qemu_check(&img);
    assert_eq!(qemu_code, Some(2), "{qemu_out}");
    let (code, json, _) = sqcow2_status(&["check", "--output", "json", s(&img)]);
    assert_eq!(code, qemu_code, "{json}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(
        qemu_out.contains("1 errors were found") && !qemu_out.contains("leaked"),
        "{qemu_out}"
    );
    assert_eq!(
        (v["corruptions"].as_u64(), v["leaks"].as_u64()),
        (Some(1), Some(0)),
        "{json}"
    );
    let (code, out, err) = sqcow2_status(&["io", "-c", "write -P 0x79 1M 4k", s(&img)]);
    assert_eq!(code, Some(1), "{out}");
    // Reported as `qemu-io` reports a failed write, on its output.
    assert!(
        format!("{out}{err}").contains("beyond the end of the file"),
        "{out}{err}"
    );
    // Nothing written: the file as it was.
    assert_eq!(std::fs::metadata(&img).unwrap().len(), len - (64 << 10));
}

/// Sizes that are not whole 512-byte sectors: `qemu-img create` rounds
/// the size up to a sector, and QEMU opening an image whose header says
/// otherwise sees the whole sectors only. sqcow2 must store and see the
/// same size, or bytes it writes past QEMU's end would be lost to QEMU.
#[test]
fn sizes_that_are_not_whole_sectors_are_counted_as_qemu_counts_them() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("ours.qcow2");
    let theirs = tmp.path().join("theirs.qcow2");
    let virtual_size = |p: &Path| -> u64 {
        let v: serde_json::Value =
            serde_json::from_str(&qemu_img(&["info", "--output", "json", s(p)])).unwrap();
        v["virtual-size"].as_u64().unwrap()
    };
    let header_size = |p: &Path| -> u64 {
        let bytes = std::fs::read(p).unwrap();
        u64::from_be_bytes(bytes[24..32].try_into().unwrap())
    };
    // (And an empty disk: no L1 table, no cluster leaked.)
    for size in ["1000001", "1", "511", "513", "0"] {
        sqcow2(&["create", s(&ours), size]);
        qemu_create(&theirs, "", size);
        assert_eq!(header_size(&ours), header_size(&theirs), "size {size}");
        assert_eq!(qemu_check(&ours).0, Some(0), "size {size}");
    }
    // The size taken from a raw backing file of odd length.
    let base = tmp.path().join("base.raw");
    std::fs::write(&base, vec![7u8; 1_000_001]).unwrap();
    std::fs::remove_file(&ours).unwrap();
    std::fs::remove_file(&theirs).unwrap();
    sqcow2(&["create", "-b", "base.raw", "-F", "raw", s(&ours)]);
    qemu_overlay(&theirs, "base.raw", "raw", &[], None);
    assert_eq!(
        header_size(&ours),
        header_size(&theirs),
        "from the backing file"
    );

    // An image whose header holds an odd size (another tool wrote it).
    let odd = tmp.path().join("odd.qcow2");
    qemu_create(&odd, "", "1000448");
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&odd).unwrap();
        f.write_all_at(&1_000_001u64.to_be_bytes(), 24).unwrap();
    }
    let expected = virtual_size(&odd);
    assert_eq!(expected, 999_936, "QEMU's view of the image");
    let json = sqcow2(&["info", "--output", "json", s(&odd)]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["virtual-size"].as_u64(), Some(expected), "{json}");
    assert_same_as_qemu(&odd);
    // A write past QEMU's end is refused as qemu-io refuses it.
    let (code, out, err) = sqcow2_status(&["io", "-c", "write -P 1 999900 101", s(&odd)]);
    assert_ne!(code, Some(0), "{out}{err}");
    let (code, out, err) = sqcow2_status(&["io", "-c", "write -P 1 999424 512", s(&odd)]);
    assert_eq!(code, Some(0), "{out}{err}");
    qemu_io(&odd, &["read -P 1 999424 512".into()]);
}

/// `qemu-img check --output json`'s counts and exit code.
fn qemu_check_counts(img: &Path) -> (Option<i32>, [u64; 3]) {
    let out = run_raw(Command::new("qemu-img").args(["check", "--output", "json", s(img)]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    (
        out.status.code(),
        [n("corruptions"), n("leaks"), n("check-errors")],
    )
}

fn sqcow2_check_counts(img: &Path) -> (Option<i32>, [u64; 3]) {
    let (code, json, _) = sqcow2_status(&["check", "--output", "json", s(img)]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap_or_default();
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    (code, [n("corruptions"), n("leaks"), n("check-errors")])
}

fn poke(img: &Path, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(img)
        .unwrap()
        .write_all_at(bytes, at)
        .unwrap();
}

/// Damaged refcount tables and a dirty lazy-refcounts image: `sqcow2
/// check` counts what `qemu-img check` counts (a refcount table entry's
/// offset is all of bits 9-63, unlike an L1 or L2 entry's; its low bits
/// are reserved; a COPIED flag over a refcount of 0 is an error of its
/// own), and a write that needs a block outside the file is refused.
#[test]
fn check_counts_damaged_refcount_tables_as_qemu_does() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = |name: &str, writes: &[&str]| {
        let img = tmp.path().join(name);
        qemu_create(&img, "", "16M");
        if !writes.is_empty() {
            qemu_io(
                &img,
                &writes.iter().map(|w| w.to_string()).collect::<Vec<_>>(),
            );
        }
        img
    };
    // The first refcount table entry's high bits set: its block is
    // outside the file (QEMU: one corruption, and each cluster's
    // refcount unreadable).
    let high = fresh("high.qcow2", &["write -P 1 0 1M"]);
    poke(&high, 0x10000, &[0xf2]);
    let before = std::fs::read(&high).unwrap();
    let qemu = qemu_check_counts(&high);
    assert_eq!(qemu.0, Some(1), "{qemu:?}");
    assert_eq!(sqcow2_check_counts(&high), qemu, "high bits");
    let (code, out, err) = sqcow2_status(&["io", "-c", "write -P 2 2M 64k", s(&high)]);
    assert_ne!(
        code,
        Some(0),
        "a write through a block outside the file: {out}{err}"
    );
    assert!(std::fs::read(&high).unwrap() == before, "the image changed");

    // An unused entry's reserved bits set.
    let reserved = fresh("reserved.qcow2", &[]);
    poke(&reserved, 0x10000 + 8 * 4 + 7, &[0x08]);
    let qemu = qemu_check_counts(&reserved);
    assert_eq!(qemu.0, Some(2), "{qemu:?}");
    assert_eq!(sqcow2_check_counts(&reserved), qemu, "reserved bits");

    // A writer with lazy refcounts killed: refcounts of 0 under COPIED.
    let lazy = tmp.path().join("lazy.qcow2");
    qemu_create(&lazy, "lazy_refcounts=on", "16M");
    let _ = run_raw(Command::new("qemu-io").args([
        "-c",
        "write -P 9 0 1M",
        "-c",
        "write -P 10 5M 100k",
        "-c",
        "sigraise 9",
        s(&lazy),
    ]));
    let qemu = qemu_check_counts(&lazy);
    assert_eq!(qemu.0, Some(2), "{qemu:?}");
    assert_eq!(sqcow2_check_counts(&lazy), qemu, "dirty lazy refcounts");
}

/// A discard does what QEMU's does to the image: on a v2 image over a
/// backing file (no zero flag) nothing at all (QEMU: unmapping would show
/// the backing file's stale data, zeros would take space; sqcow2 wrote
/// zeros and grew the file), elsewhere the clusters released, reading
/// zeros.
#[test]
fn discards_leave_what_qemus_leave() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    qemu_create(&base, "", "4M");
    qemu_io(&base, &["write -P 0x63 0 4M".into()]);
    let cmds = ["discard 0 1M", "discard 2M 1M", "discard 3M 64k"];
    for (compat, backing) in [
        ("0.10", true),
        ("0.10", false),
        ("1.1", true),
        ("1.1", false),
    ] {
        let ours = tmp.path().join("ours.qcow2");
        let theirs = tmp.path().join("theirs.qcow2");
        let mut args = vec!["create", "-q", "-f", "qcow2", "-o"];
        let opts = format!("compat={compat}");
        args.push(&opts);
        if backing {
            args.extend(["-b", "base.qcow2", "-F", "qcow2"]);
        }
        args.extend([s(&ours), "4M"]);
        qemu_img(&args);
        qemu_io(&ours, &["write -P 0x64 0 2M".into()]);
        std::fs::copy(&ours, &theirs).unwrap();
        for c in cmds {
            let (code, out, err) = sqcow2_status(&["io", "-c", c, s(&ours)]);
            assert_eq!(code, Some(0), "{c}: {out}{err}");
        }
        qemu_io(&theirs, &cmds.map(String::from));
        let what = format!("compat={compat}, backing file: {backing}");
        assert_eq!(qemu_check(&ours).0, Some(0), "{what}");
        qemu_img(&["compare", "-q", s(&ours), s(&theirs)]);
        assert_eq!(
            std::fs::metadata(&ours).unwrap().len(),
            std::fs::metadata(&theirs).unwrap().len(),
            "{what}: file sizes"
        );
    }
}

/// `check`'s allocation figures are QEMU's: fragmentation counted within
/// each L2 table, every compressed cluster fragmented.
#[test]
fn check_counts_fragmentation_as_qemu_does() {
    let tmp = tempfile::tempdir().unwrap();
    let raw = tmp.path().join("mix.raw");
    qemu_img(&["create", "-q", "-f", "raw", s(&raw), "8M"]);
    let out = run_raw(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x41 0 2M",
        "-c",
        "write -P 0x42 5M 1M",
        s(&raw),
    ]));
    assert!(out.status.success());
    let figures = |json: &str| -> [u64; 3] {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        let n = |k: &str| v[k].as_u64().unwrap_or(0);
        [
            n("allocated-clusters"),
            n("fragmented-clusters"),
            n("compressed-clusters"),
        ]
    };
    for opts in [
        &["-c", "-O", "qcow2", "-o", "cluster_size=4k"][..],
        &["-c", "-O", "qcow2"][..],
        &["-O", "qcow2", "-o", "cluster_size=512"][..],
        &["-O", "qcow2"][..],
    ] {
        let img = tmp.path().join("img.qcow2");
        let _ = std::fs::remove_file(&img);
        let mut args = vec!["convert"];
        args.extend_from_slice(opts);
        args.extend([s(&raw), s(&img)]);
        qemu_img(&args);
        qemu_io(
            &img,
            &[
                "write -P 1 3M 64k".into(),
                "write -P 2 1M 4k".into(),
                "write -P 3 7M 512".into(),
            ],
        );
        let ours = figures(&sqcow2(&["check", "--output", "json", s(&img)]));
        let theirs = figures(&qemu_img(&["check", "--output", "json", s(&img)]));
        assert_eq!(ours, theirs, "{opts:?}");
    }
}

/// Preallocated clusters never written are holes of the file: QEMU's map
/// calls them data that reads as zeros (it asks the file system), and so
/// does sqcow2's, in JSON and in the human table.
#[test]
fn map_reads_preallocated_clusters_as_qemu_does() {
    let tmp = tempfile::tempdir().unwrap();
    for prealloc in ["metadata", "falloc", "full"] {
        let img = tmp.path().join(format!("{prealloc}.qcow2"));
        qemu_create(&img, &format!("preallocation={prealloc}"), "4M");
        qemu_io(
            &img,
            &["write -P 1 1M 64k".into(), "write -z 2M 64k".into()],
        );
        common::assert_full_map_equal(&img);
        assert_eq!(
            sqcow2(&["map", s(&img)]),
            qemu_img(&["map", s(&img)]),
            "{prealloc}"
        );
        assert_same_as_qemu(&img);
    }
}

/// A leaked cluster at the end of the file (a refcount on disk, no
/// reference) ends the image for `check` as for QEMU, which counts every
/// cluster with a refcount: the same exit code (leaks), the same
/// `image-end-offset`.
#[test]
fn check_ends_the_image_at_a_leaked_last_cluster_as_qemu_does() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("leak.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "4M"]);
    qemu_io(&img, &["write -P 1 0 64k".into()]);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    let len = f.metadata().unwrap().len();
    let cluster = 65536;
    assert_eq!(len % cluster, 0);
    // One more cluster, with a refcount of 1 (16-bit refcounts; the first
    // refcount block covers it).
    f.set_len(len + 2 * cluster).unwrap();
    let mut word = [0u8; 8];
    f.read_exact_at(&mut word, 48).unwrap();
    let table = u64::from_be_bytes(word);
    f.read_exact_at(&mut word, table).unwrap();
    let block = u64::from_be_bytes(word);
    let leaked = len / cluster + 1;
    f.write_all_at(&1u16.to_be_bytes(), block + leaked * 2)
        .unwrap();
    drop(f);
    let report = |program: &Path| {
        let out = run_raw(Command::new(program).args(["check", "--output", "json", s(&img)]));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            out.status.code(),
            v["leaks"].clone(),
            v["image-end-offset"].clone(),
        )
    };
    let theirs = report(Path::new("qemu-img"));
    assert_eq!(theirs.0, Some(3), "{theirs:?}");
    assert_eq!(theirs.2, (leaked + 1) * cluster);
    assert_eq!(report(&common::sqcow2_bin()), theirs);
}

/// `io` runs every command around one that does not parse, as qemu-io
/// does (the bad one reported, exit code 1), instead of none of them.
#[test]
fn io_runs_every_command_around_a_bad_one_as_qemu_io() {
    let tmp = tempfile::tempdir().unwrap();
    let (theirs, ours) = (tmp.path().join("q.qcow2"), tmp.path().join("s.qcow2"));
    for p in [&theirs, &ours] {
        qemu_img(&["create", "-q", "-f", "qcow2", s(p), "4M"]);
    }
    let cmds = ["write -P 3 0 512", "bogus", "read 0", "write -P 4 512 512"];
    let mut q = Command::new("qemu-io");
    let mut o = Command::new(common::sqcow2_bin());
    o.arg("io");
    for c in cmds {
        q.args(["-c", c]);
        o.args(["-c", c]);
    }
    let qc = run_raw(q.arg(&theirs)).status.code();
    let oc = run_raw(o.arg(&ours)).status.code();
    assert_eq!((oc, qc), (Some(1), Some(1)));
    assert_eq!(
        common::qemu_raw(&ours, tmp.path()),
        common::qemu_raw(&theirs, tmp.path())
    );
    let data = common::qemu_raw(&ours, tmp.path());
    assert_eq!(&data[..1024], &[[3u8; 512], [4u8; 512]].concat()[..]);
}

/// `create -u` (the backing file not opened: it may not exist yet) and
/// `-o preallocation=off` are accepted as qemu-img accepts them; `convert
/// -p` shows its progress where standard error is not a terminal (a log).
#[test]
fn create_u_preallocation_off_and_convert_p_as_documented() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let ok = |program: &Path, args: &[&str]| {
        let out = run_raw(Command::new(program).current_dir(dir).args(args));
        assert!(
            out.status.success(),
            "{program:?} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    let ours = common::sqcow2_bin();
    for (program, name) in [
        (Path::new("qemu-img"), "q.qcow2"),
        (ours.as_path(), "s.qcow2"),
    ] {
        ok(
            program,
            &[
                "create",
                "-f",
                "qcow2",
                "-u",
                "-b",
                "later.qcow2",
                "-F",
                "qcow2",
                name,
                "1M",
            ],
        );
        ok(
            program,
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "preallocation=off",
                &format!("p{name}"),
                "1M",
            ],
        );
    }
    let info = |name: &str| -> serde_json::Value {
        serde_json::from_str(&qemu_img(&[
            "info",
            "-U",
            "--output",
            "json",
            s(&dir.join(name)),
        ]))
        .unwrap()
    };
    for k in [
        "backing-filename",
        "backing-filename-format",
        "virtual-size",
    ] {
        assert_eq!(info("s.qcow2")[k], info("q.qcow2")[k], "{k}");
    }
    let src = dir.join("src.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&src), "64M"]);
    let out = ok(
        &ours,
        &["convert", "-p", "-O", "raw", "src.qcow2", "dst.raw"],
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains('%'),
        "no progress line"
    );
}
