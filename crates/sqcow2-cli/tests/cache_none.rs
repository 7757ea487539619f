//! `serve --cache none` (QEMU's cache=none): guest I/O leaves the
//! images' page cache as it was (`fincore` the oracle; the same load with
//! `--cache writeback` fills it, so the check can fail), requests whose
//! guest memory is not aligned are served correctly (bounce buffers, no
//! EINVAL), and QEMU reads every byte written.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use blkio::ReqFlags;
use common::vhost::{connect_retry, Daemon};
use common::*;

/// The page-cache pages `fincore` finds for `path`.
fn cached_pages(path: &Path) -> u64 {
    let out = Command::new("fincore")
        .args(["--raw", "--noheadings", "--output", "PAGES", s(path)])
        .output()
        .expect("fincore (util-linux)");
    assert!(out.status.success(), "fincore {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a page count")
}

/// Writes `path`'s dirty pages out and drops its cached ones.
fn drop_cache(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: fadvise on a descriptor `f` owns; no memory is passed.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0);
}

fn images(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "qcow2"))
        .collect();
    v.sort();
    v
}

/// A 4-layer chain, served with `cache`; a load of reads over the whole
/// disk, overwrites, allocating writes, and reads and writes from guest
/// memory at an odd address; the page-cache pages of the images after
/// the daemon stopped, and the chain's top.
fn run_load(cache: &str) -> (u64, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let top = gen_chain(dir.path(), 4, "32M", "0.5");
    qemu_io(&top, &["write -P 0x17 1M 1M".to_string()]);
    for img in images(dir.path()) {
        drop_cache(&img);
    }
    let before: u64 = images(dir.path()).iter().map(|p| cached_pages(p)).sum();
    assert_eq!(before, 0, "the images' pages could not be dropped");

    let mut daemon = Daemon::start(dir.path(), &top, &["--cache", cache]);
    let mut c = connect_retry(&daemon, 1, false);
    // Reads of the whole disk, through every layer.
    for off in (0..32u64 << 20).step_by(1 << 20) {
        c.read(off, 1 << 20);
    }
    // Overwrites and allocating writes, aligned.
    c.write(1 << 20, &vec![0x21; 64 << 10]);
    c.write(20 << 20, &vec![0x22; 4096]);
    c.write((30 << 20) + 512, &vec![0x23; 1536]);
    // Guest memory at an odd address (a bounce buffer when direct).
    let base = c.region.addr as *mut u8;
    // SAFETY: 1 + 8192 bytes inside the client's mapped region, which
    // outlives the requests, waited for below.
    let odd = unsafe { base.add(1) };
    unsafe { std::ptr::write_bytes(odd, 0x24, 8192) };
    c.queues[0].write(8 << 20, odd, 8192, 0, ReqFlags::empty());
    assert_eq!(c.wait(0, 1)[0].1, 0, "write from odd guest memory");
    unsafe { std::ptr::write_bytes(odd, 0, 8192) };
    c.queues[0].read(1 << 20, odd, 8192, 0, ReqFlags::empty());
    assert_eq!(c.wait(0, 1)[0].1, 0, "read into odd guest memory");
    // SAFETY: as above; the read completed.
    let got = unsafe { std::slice::from_raw_parts(odd, 8192) };
    assert!(got.iter().all(|b| *b == 0x21), "read into odd guest memory");
    c.flush();
    assert_eq!(c.read(8 << 20, 8192), vec![0x24; 8192]);
    drop(c);
    daemon.stop();

    for p in images(dir.path()) {
        eprintln!("{}: {} pages", p.display(), cached_pages(&p));
    }
    let after = images(dir.path()).iter().map(|p| cached_pages(p)).sum();
    qemu_io(
        &top,
        &[
            "read -P 0x21 1M 64k".to_string(),
            "read -P 0x17 1088k 960k".to_string(),
            "read -P 0x22 20M 4k".to_string(),
            "read -P 0x23 31457792 1536".to_string(),
            "read -P 0x24 8M 8k".to_string(),
        ],
    );
    assert_check_clean(&top);
    (after, top, dir)
}

#[test]
fn cache_none_leaves_the_page_cache_alone() {
    let (none, top, _dir) = run_load("none");
    assert_eq!(
        none, 0,
        "pages of the images cached after a load with --cache none"
    );
    assert_same_as_qemu(&top);
    // The same load through the page cache fills it: the check can fail.
    let (writeback, _, _dir) = run_load("writeback");
    assert!(
        writeback > 100,
        "only {writeback} pages cached with --cache writeback"
    );
}

#[test]
fn cache_none_refuses_small_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    qemu_create(&img, "cluster_size=2048", "16M");
    let out = run_raw(Command::new(sqcow2_bin()).args([
        "serve",
        "--cache",
        "none",
        "--socket",
        s(&dir.path().join("s.sock")),
        s(&img),
    ]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--cache none needs clusters of at least 4096 bytes"),
        "{err}"
    );
}

/// Writes that allocate tables (a new L2 table, so a new L1 entry) leave
/// the page cache alone while the daemon serves, before any flush: the
/// small metadata writes they publish go around it too.
#[test]
fn cache_none_allocating_tables_leave_the_page_cache_alone() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.qcow2");
    qemu_create(&img, "cluster_size=65536", "2G");
    drop_cache(&img);
    let mut daemon = Daemon::start(dir.path(), &img, &["--cache", "none"]);
    let mut c = connect_retry(&daemon, 1, false);
    // Each 512 MiB range of the disk has its own L2 table.
    for (i, off) in [0u64, 600 << 20, 1100 << 20, 1800 << 20]
        .into_iter()
        .enumerate()
    {
        c.write(off, &vec![0x30 + i as u8; 4096]);
    }
    // Long enough for the mappings to be published (no guest flush).
    for _ in 0..200 {
        c.read(0, 4096);
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let served = cached_pages(&img);
    drop(c);
    daemon.stop();
    assert_eq!(
        served, 0,
        "pages of the image cached by allocating writes with --cache none"
    );
    qemu_io(
        &img,
        &[
            "read -P 0x30 0 4k".to_string(),
            "read -P 0x31 600M 4k".to_string(),
            "read -P 0x32 1100M 4k".to_string(),
            "read -P 0x33 1800M 4k".to_string(),
        ],
    );
    assert_check_clean(&img);
}

/// 4 KiB writes at depth 1, each into a cluster the top does not map, at
/// every offset in it, over data below (a copy-on-write) and over holes:
/// once spares are ready the queue worker moves them itself (with cache
/// none, the read from below, then the cluster's write, through its
/// io_uring; with writeback, those over holes). Each completes (a cluster
/// write queued as a read completed was once never submitted: the guest
/// waited for ever), and QEMU reads the chain as a model of the writes
/// says.
#[test]
fn allocating_writes_at_depth_one_complete_and_read_as_written() {
    for cache in ["none", "writeback"] {
        let dir = tempfile::tempdir().unwrap();
        let top = gen_chain(dir.path(), 2, "64M", "0.5");
        let mut model = qemu_raw(&top, dir.path());
        // No polling: the worker sleeps as soon as it has nothing to do,
        // so only its own submit hands a queued write to the kernel.
        let args = ["--cache", cache, "--poll-us", "0"];
        let mut daemon = Daemon::start(dir.path(), &top, &args);
        let mut c = connect_retry(&daemon, 1, false);
        for i in 0..300u64 {
            let off = i * 3 * 65536 + (i % 16) * 4096;
            let data = vec![(i % 250) as u8 + 1; 4096];
            c.write(off, &data);
            model[off as usize..off as usize + 4096].copy_from_slice(&data);
        }
        c.flush();
        drop(c);
        daemon.stop();
        assert_check_clean(&top);
        let after = qemu_raw(&top, dir.path());
        assert!(
            after == model,
            "--cache {cache}: QEMU reads other bytes at {:?}",
            after.iter().zip(&model).position(|(a, b)| a != b)
        );
    }
}
