//! Concurrency hazards found by review, each shown by a test first (they
//! failed on the code before the fix) and kept:
//!
//! * a flush from the control socket must not make a cluster reusable
//!   while a transfer that was set up before the cluster was freed is
//!   still in flight (a late io_uring write would land in whatever the
//!   cluster was reallocated to);
//! * flushes on several queues and back-to-back live snapshots must never
//!   deadlock the daemon;
//! * a read whose metadata is not cached must not stall the other reads
//!   of its queue while the disk serves that metadata.

mod common;

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use blkio::{Blkioq, Completion, ReqFlags};
use common::faulty_fs::FaultyFs;
use common::vhost::{connect_retry, control_within, Daemon};
use common::{assert_check_clean, gen_chain, qemu_img, qemu_io, qemu_raw, s};
use serde_json::{json, Value};

const CLUSTER: u64 = 65536;

/// Waits for one completion on `queue` (at most `secs` seconds); its
/// result, or `None` on timeout.
fn wait_one(queue: &mut Blkioq, secs: u64) -> Option<(usize, i32)> {
    let mut c = [MaybeUninit::<Completion>::uninit()];
    let mut timeout = Duration::from_secs(secs);
    let n = queue.do_io(&mut c, 1, Some(&mut timeout), None).ok()?;
    if n == 0 {
        return None;
    }
    // SAFETY: do_io initialised the first entry.
    let c = unsafe { c[0].assume_init_ref() };
    Some((c.user_data, c.ret))
}

/// Host offset of guest offset 0's cluster, from `qemu-img map`.
fn host_of_first_cluster(image: &Path) -> u64 {
    let map: Value = serde_json::from_str(&qemu_img(&["map", "--output=json", s(image)])).unwrap();
    map.as_array()
        .unwrap()
        .iter()
        .find(|e| e["start"] == 0)
        .and_then(|e| e["offset"].as_u64())
        .expect("guest cluster 0 is allocated")
}

/// A read of a cluster held in flight (by the filesystem) while the guest
/// discards that cluster on another queue and the operator flushes through
/// the control socket: the flush must not hand the cluster out again
/// before the read has finished. Before the fix the flush returned at
/// once, the next allocation reused the cluster, and the late read
/// returned another guest cluster's data. (An in-place write is the same
/// transfer the other way round, and would overwrite the new data; FUSE
/// serialises writes to one file, so the test holds a read.)
#[test]
fn control_flush_waits_for_a_transfer_in_flight() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    let image = src.join("top.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&image), "16M"]);
    qemu_io(&image, &["write -P 0x11 0 64k".to_string()]);
    let host = host_of_first_cluster(&image);

    let fs = FaultyFs::mount(&src, &dir.join("mnt"));
    let served = fs.mountpoint.join("top.qcow2");
    let ctl = dir.join("control.sock");
    let mut daemon = Daemon::start(dir, &served, &["--num-queues", "2", "--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 2, false);
    let base = client.region.addr as *mut u8;
    // Buffers: [0, 4K) the held read, [64K, 128K) the new data.
    // SAFETY: the region is 8 MiB mapped by libblkio for this client;
    // each range below is used by one request at a time.
    let buf =
        |off: usize, len: usize| unsafe { std::slice::from_raw_parts_mut(base.add(off), len) };
    buf(65536, 65536).fill(0x55);

    // Queue 0: a read of guest cluster 0, held by the disk.
    fs.faults.hold(false, host, host + CLUSTER, 1);
    client.queues[0].read(0, base, 4096, 1, ReqFlags::empty());
    // Submit without waiting for the completion.
    client.queues[0]
        .do_io(&mut [], 0, None, None)
        .expect("submit");
    fs.faults.wait_held(1);

    // Queue 1: the guest discards that cluster (a queued free).
    client.queues[1].discard(0, CLUSTER, 2, ReqFlags::empty());
    assert_eq!(wait_one(&mut client.queues[1], 60), Some((2, 0)), "discard");

    // The operator flushes. It may wait for the held read; the test goes
    // on either way after a moment.
    let (tx, rx) = mpsc::channel();
    let flusher = {
        let ctl = ctl.clone();
        std::thread::spawn(move || {
            let reply = control_within(&ctl, json!({"command": "flush"}), Duration::from_secs(120));
            let _ = tx.send(reply);
        })
    };
    let early = rx.recv_timeout(Duration::from_secs(2)).ok();

    // Queue 1: a new allocation, which must not get the cluster being read.
    client.queues[1].write(
        5 * CLUSTER,
        base.wrapping_add(65536),
        65536,
        3,
        ReqFlags::empty(),
    );
    assert_eq!(
        wait_one(&mut client.queues[1], 60),
        Some((3, 0)),
        "allocating write"
    );

    // The held read runs now, late.
    fs.faults.release();
    assert_eq!(
        wait_one(&mut client.queues[0], 60),
        Some((1, 0)),
        "held read"
    );
    let got = buf(0, 4096).to_vec();
    let reply = match early {
        Some(r) => r,
        None => rx
            .recv_timeout(Duration::from_secs(60))
            .expect("flush reply"),
    };
    flusher.join().unwrap();
    let reply = reply.expect("flush answered");
    assert_eq!(reply["ok"], true, "flush: {reply}");
    // The read raced with the discard: the old data or zeros are right,
    // the new cluster's data is not.
    assert!(
        got.iter().all(|&b| b == 0x11) || got.iter().all(|&b| b == 0),
        "the read returned data of a cluster reallocated meanwhile (first byte 0x{:02x})",
        got[0]
    );
    assert_eq!(client.read(5 * CLUSTER, 65536), vec![0x55; 65536]);
    drop(client);
    daemon.stop();
    drop(fs);
    assert_check_clean(&image);
}

/// Writes at depth 16 on two queues with a flush every 2 ms, and live
/// snapshots back to back: before the fix the daemon hung within one or
/// two snapshots (a worker flushing while holding the request gate waited
/// for the other worker's reads; that worker waited for the gate, behind
/// the snapshot, which waited for the first worker).
#[test]
fn flushes_on_two_queues_and_live_snapshots_never_deadlock() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "16M", "0.5");
    let model = Arc::new(Mutex::new(qemu_raw(&top, tmp.path())));
    let size = model.lock().unwrap().len() as u64;
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(
        tmp.path(),
        &top,
        &["--num-queues", "2", "--control", s(&ctl)],
    );
    let mut client = connect_retry(&daemon, 2, false);
    // Every cluster the top's own first: the writes below then go to the
    // files as io_uring transfers, which a flush must wait for.
    {
        let mut model = model.lock().unwrap();
        let mut pos = 0u64;
        while pos < size {
            let n = (4u64 << 20).min(size - pos) as usize;
            let data: Vec<u8> = (0..n).map(|i| (i / 4096) as u8 ^ 0x3c).collect();
            client.write(pos, &data);
            model[pos as usize..pos as usize + n].copy_from_slice(&data);
            pos += n as u64;
        }
    }
    const BLOCK: u64 = 4096;
    const DEPTH: usize = 16;
    let stop = Arc::new(AtomicBool::new(false));
    let hung = Arc::new(AtomicBool::new(false));
    let workers = client.spawn_per_queue({
        let (model, stop, hung) = (model.clone(), stop.clone(), hung.clone());
        move |q, mut queue, base| -> (u64, u64) {
            let blocks = size / BLOCK;
            let mut rng = fastrand::Rng::with_seed(q as u64 + 101);
            let slot = |k: usize| (base + (q * DEPTH + k) * BLOCK as usize) as *mut u8;
            let mut slot_block = [0u64; DEPTH];
            let mut slot_fill = [0u8; DEPTH];
            let (mut writes, mut errors) = (0u64, 0u64);
            let mut last_flush = Instant::now();
            let mut in_flight = 0usize;
            let mut free: Vec<usize> = (0..DEPTH).collect();
            let mut flushing = false;
            while !stop.load(Ordering::Relaxed) || in_flight > 0 {
                if !stop.load(Ordering::Relaxed) {
                    while let Some(k) = free.pop() {
                        // Queue q owns the blocks with block % 2 == q; a
                        // block is written by one request at a time.
                        let block = loop {
                            let b = rng.u64(0..blocks / 2) * 2 + q as u64;
                            if !slot_block[..].contains(&b) {
                                break b;
                            }
                        };
                        slot_block[k] = block;
                        slot_fill[k] = rng.u8(1..);
                        // SAFETY: slot k of queue q is BLOCK bytes of the
                        // mapped region only this thread uses.
                        unsafe { std::ptr::write_bytes(slot(k), slot_fill[k], BLOCK as usize) };
                        queue.write(block * BLOCK, slot(k), BLOCK as usize, k, ReqFlags::empty());
                        in_flight += 1;
                    }
                    if !flushing && last_flush.elapsed() >= Duration::from_millis(2) {
                        queue.flush(DEPTH, ReqFlags::empty());
                        flushing = true;
                        in_flight += 1;
                    }
                }
                let Some((k, ret)) = wait_one(&mut queue, 30) else {
                    hung.store(true, Ordering::SeqCst);
                    return (writes, errors);
                };
                in_flight -= 1;
                if ret != 0 {
                    errors += 1;
                }
                if k == DEPTH {
                    flushing = false;
                    last_flush = Instant::now();
                    continue;
                }
                if ret == 0 {
                    let off = (slot_block[k] * BLOCK) as usize;
                    model.lock().unwrap()[off..off + BLOCK as usize].fill(slot_fill[k]);
                    writes += 1;
                }
                slot_block[k] = u64::MAX;
                free.push(k);
            }
            (writes, errors)
        }
    });

    let count = common::env_count("SQCOW2_HAZARD_SNAPSHOTS", 150usize);
    let mut snapshots: Vec<PathBuf> = Vec::new();
    for i in 0..count {
        let new = tmp.path().join(format!("snap{i:03}.qcow2"));
        let reply = control_within(
            &ctl,
            json!({"id": i, "command": "snapshot", "path": new}),
            Duration::from_secs(30),
        );
        let Some(reply) = reply else {
            stop.store(true, Ordering::SeqCst);
            panic!(
                "snapshot {i} got no reply within 30 s: the daemon hangs\n{}",
                daemon.log()
            );
        };
        assert_eq!(reply["ok"], true, "snapshot {i}: {reply}");
        assert!(!hung.load(Ordering::SeqCst), "a client queue hangs");
        snapshots.push(new);
    }
    stop.store(true, Ordering::SeqCst);
    let mut total = 0;
    for w in workers {
        let (writes, errors) = w.join().expect("client thread");
        assert_eq!(errors, 0, "I/O errors");
        total += writes;
    }
    assert!(
        !hung.load(Ordering::SeqCst),
        "a request got no completion within 30 s: the daemon hangs\n{}",
        daemon.log()
    );
    println!("{count} snapshots under {total} writes and flushes every 2 ms");
    drop(client);
    let model = model.lock().unwrap().clone();
    let mut client = connect_retry(&daemon, 1, false);
    let mut pos = 0u64;
    while pos < size {
        let n = (4u64 << 20).min(size - pos) as usize;
        assert!(
            client.read(pos, n) == model[pos as usize..pos as usize + n],
            "daemon read at {pos} differs from the model"
        );
        pos += n as u64;
    }
    drop(client);
    daemon.stop();
    let last = snapshots.last().expect("snapshots taken");
    for layer in &snapshots {
        assert_check_clean(layer);
    }
    assert!(
        qemu_raw(last, tmp.path()) == model,
        "qemu-img convert of the final chain differs from the model"
    );
}

/// A read whose mapping needs a metadata slice not in the cache, while
/// the filesystem holds that metadata read (a slow or remote disk): other
/// reads on the same queue, whose metadata is cached, complete meanwhile.
/// Before, the queue worker read the slice itself and every request of
/// the queue waited for it.
#[test]
fn a_metadata_read_held_by_the_disk_does_not_stall_the_queue() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    let top = gen_chain(&src, 3, "256M", "0.9");
    let expected = qemu_raw(&top, dir);
    let fs = FaultyFs::mount(&src, &dir.join("mnt"));
    let served = fs.mountpoint.join(top.file_name().unwrap());
    let mut daemon = Daemon::start(dir, &served, &["--backing-root", s(&fs.mountpoint)]);
    let mut client = connect_retry(&daemon, 1, true);
    // Region A, its metadata now cached.
    let a = 4096usize;
    assert!(client.read(0, 1 << 20) == expected[..1 << 20]);
    // The next read of any file is held: the metadata of region B, far
    // from A (another L2 slice, another index slice).
    let b = 200usize << 20;
    fs.faults.hold(false, 0, u64::MAX, 1);
    let base = client.region.addr as *mut u8;
    // SAFETY: two disjoint 4 KiB ranges of the client's mapped region,
    // each used by one request at a time.
    let (buf_b, buf_a) = unsafe { (base, base.add(1 << 20)) };
    client.queues[0].read(b as u64, buf_b, 4096, 1, ReqFlags::empty());
    // Submit without waiting for the completion.
    client.queues[0]
        .do_io(&mut [], 0, None, None)
        .expect("submit");
    fs.faults.wait_held(1);
    client.queues[0].read(a as u64, buf_a, 4096, 2, ReqFlags::empty());
    let first = wait_one(&mut client.queues[0], 10);
    let released_late = first.is_none();
    fs.faults.release();
    assert!(
        !released_late,
        "a read with cached metadata waited for another read's metadata"
    );
    assert_eq!(first, Some((2, 0)), "the read of A completes first");
    assert_eq!(wait_one(&mut client.queues[0], 30), Some((1, 0)));
    // SAFETY: both reads completed.
    let (got_a, got_b) = unsafe {
        (
            std::slice::from_raw_parts(buf_a, 4096),
            std::slice::from_raw_parts(buf_b, 4096),
        )
    };
    assert!(got_a == &expected[a..a + 4096], "A's data");
    assert!(got_b == &expected[b..b + 4096], "B's data");
    drop(client);
    daemon.stop();
}
