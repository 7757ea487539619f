//! Concurrency stress: on one served chain, at once,
//!
//! * queue 0 writes random 4 KiB blocks of the first half of the disk
//!   (allocating, then in place) with guest flushes, exactly modelled;
//! * queue 1 writes, discards and write-zeroes the clusters of the second
//!   half at depth 16, so that discards race with in-place writes to the
//!   same clusters; each block must end up zero, as it was, or one of the
//!   versions written to *it* (a block holding another block's data, or a
//!   mix, is a reused cluster or a lost update);
//! * the control socket flushes and takes live snapshots back to back.
//!
//! Then every block is read through the daemon and checked, every layer
//! passes `qemu-img check` without errors or leaks, and `qemu-img convert`
//! of the final chain equals what the daemon served.
//!
//! The worker threads busy-poll (`--poll-us`), so that polling meets
//! pauses, snapshots and engine results as often as sleeping does in the
//! other daemon tests.
//!
//! `SQCOW2_STRESS_SECONDS` (default 15 in the test run; `scripts/long-test.sh stress`
//! runs longer), `SQCOW2_STRESS_SEED`.

mod common;

use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkio::{Blkioq, Completion, ReqFlags};
use common::vhost::{connect_retry, Daemon};
use common::{assert_check_clean, env_count, gen_chain, qcow2_files, qemu_raw, s, tagged_block};
use serde_json::json;

const BLOCK: u64 = 4096;
const CLUSTER: u64 = 65536;
const DEPTH: usize = 16;

/// Waits for `want` completions; (user_data, ret) each.
fn complete(queue: &mut Blkioq, want: usize) -> Vec<(usize, i32)> {
    let mut out = Vec::new();
    let mut c: Vec<MaybeUninit<Completion>> = (0..want).map(|_| MaybeUninit::uninit()).collect();
    while out.len() < want {
        let mut timeout = Duration::from_secs(60);
        let n = queue
            .do_io(&mut c[..want - out.len()], 1, Some(&mut timeout), None)
            .expect("do_io");
        assert!(n > 0, "no completion within 60 s: the daemon hangs");
        for done in &c[..n] {
            // SAFETY: do_io initialised the first n entries.
            let done = unsafe { done.assume_init_ref() };
            out.push((done.user_data, done.ret));
        }
    }
    out
}

/// The version of `block` that `data` holds, if it is one.
fn version_of(block: u64, data: &[u8]) -> Option<u32> {
    let word = u64::from_le_bytes(data[..8].try_into().ok()?) ^ 0x5bd1_e995;
    if word >> 40 != block {
        return None;
    }
    let v = ((word >> 16) & 0xff_ffff) as u32;
    (tagged_block(block, v, data.len()) == data).then_some(v)
}

#[test]
fn snapshots_flushes_discards_and_in_place_writes_racing() {
    let seconds = env_count("SQCOW2_STRESS_SECONDS", 15u64);
    let seed = env_count("SQCOW2_STRESS_SEED", 7u64);
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "32M", "0.5");
    let original = Arc::new(qemu_raw(&top, tmp.path()));
    let size = original.len() as u64;
    let half = size / 2;
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(
        tmp.path(),
        &top,
        &[
            "--num-queues",
            "2",
            "--control",
            s(&ctl),
            "--poll-us",
            "100",
        ],
    );
    let mut client = connect_retry(&daemon, 2, false);
    let stop = Arc::new(AtomicBool::new(false));
    let model = Arc::new(Mutex::new(original[..half as usize].to_vec()));
    let ops = Arc::new(AtomicU64::new(0));
    let workers = client.spawn_per_queue({
        let (stop, model, ops) = (stop.clone(), model.clone(), ops.clone());
        move |q, mut queue, base| {
            let mut rng = fastrand::Rng::with_seed(seed * 10 + q as u64);
            let slot = |k: usize| (base + (q * DEPTH + k) * BLOCK as usize) as *mut u8;
            let mut errors = 0u64;
            let mut version = 0u32;
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                rounds += 1;
                let mut pending = Vec::new();
                if q == 0 {
                    // Distinct blocks of the first half, exactly modelled.
                    let mut blocks: Vec<u64> = Vec::new();
                    while blocks.len() < DEPTH {
                        let b = rng.u64(0..half / BLOCK);
                        if !blocks.contains(&b) {
                            blocks.push(b);
                        }
                    }
                    for (k, &b) in blocks.iter().enumerate() {
                        let fill = rng.u8(1..);
                        // SAFETY: slot k of queue q is BLOCK bytes of the
                        // mapped region only this thread uses.
                        unsafe { std::ptr::write_bytes(slot(k), fill, BLOCK as usize) };
                        queue.write(b * BLOCK, slot(k), BLOCK as usize, k, ReqFlags::empty());
                        pending.push((b, fill));
                    }
                    for (k, ret) in complete(&mut queue, DEPTH) {
                        if ret != 0 {
                            errors += 1;
                            continue;
                        }
                        let (b, fill) = pending[k];
                        let at = (b * BLOCK) as usize;
                        model.lock().unwrap()[at..at + BLOCK as usize].fill(fill);
                    }
                    if rounds % 3 == 0 {
                        queue.flush(0, ReqFlags::empty());
                        errors +=
                            complete(&mut queue, 1).iter().filter(|c| c.1 != 0).count() as u64;
                    }
                } else {
                    // The second half: writes, discards and write-zeroes of
                    // the same few clusters, all in flight together.
                    let clusters = half / CLUSTER;
                    let hot: Vec<u64> = (0..4).map(|_| rng.u64(0..clusters)).collect();
                    for k in 0..DEPTH {
                        let c = hot[rng.usize(0..hot.len())];
                        let at = half + c * CLUSTER;
                        match rng.u8(0..10) {
                            0..=6 => {
                                let b = (at + rng.u64(0..CLUSTER / BLOCK) * BLOCK) / BLOCK;
                                version += 1;
                                let data = tagged_block(b, version, BLOCK as usize);
                                // SAFETY: as above.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        data.as_ptr(),
                                        slot(k),
                                        data.len(),
                                    )
                                };
                                queue.write(
                                    b * BLOCK,
                                    slot(k),
                                    BLOCK as usize,
                                    k,
                                    ReqFlags::empty(),
                                );
                            }
                            7 | 8 => queue.discard(at, CLUSTER, k, ReqFlags::empty()),
                            _ => {
                                let flags = if rng.bool() {
                                    ReqFlags::NO_UNMAP
                                } else {
                                    ReqFlags::empty()
                                };
                                queue.write_zeroes(at, CLUSTER, k, flags);
                            }
                        }
                    }
                    errors += complete(&mut queue, DEPTH)
                        .iter()
                        .filter(|c| c.1 != 0)
                        .count() as u64;
                }
                ops.fetch_add(DEPTH as u64, Ordering::Relaxed);
            }
            queue.flush(0, ReqFlags::empty());
            errors += complete(&mut queue, 1).iter().filter(|c| c.1 != 0).count() as u64;
            errors
        }
    });

    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut snapshots: Vec<PathBuf> = Vec::new();
    let mut flushes = 0;
    let mut i = 0;
    while Instant::now() < deadline {
        i += 1;
        if i % 3 == 0 {
            let new = tmp.path().join(format!("snap{:04}.qcow2", snapshots.len()));
            let reply = daemon.control(&ctl, json!({"command": "snapshot", "path": new}));
            assert_eq!(reply["ok"], true, "snapshot: {reply}");
            snapshots.push(new);
        } else {
            let reply = daemon.control(&ctl, json!({"command": "flush"}));
            assert_eq!(reply["ok"], true, "control flush: {reply}");
            flushes += 1;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        assert_eq!(w.join().expect("client thread"), 0, "I/O errors");
    }
    println!(
        "{} requests, {} live snapshots, {flushes} control flushes in {seconds} s",
        ops.load(Ordering::Relaxed),
        snapshots.len()
    );
    drop(client);

    // Every block through the daemon.
    let mut client = connect_retry(&daemon, 1, false);
    let mut served = Vec::with_capacity(size as usize);
    let mut pos = 0u64;
    while pos < size {
        let n = (4u64 << 20).min(size - pos) as usize;
        served.extend(client.read(pos, n));
        pos += n as u64;
    }
    drop(client);
    daemon.stop();
    let model = model.lock().unwrap().clone();
    assert!(
        served[..half as usize] == model[..],
        "first half differs from the model"
    );
    for b in half / BLOCK..size / BLOCK {
        let r = (b * BLOCK) as usize..((b + 1) * BLOCK) as usize;
        let got = &served[r.clone()];
        let ok = got.iter().all(|&x| x == 0) || got == &original[r] || version_of(b, got).is_some();
        assert!(
            ok,
            "block {b} holds neither zeros, its old data nor a version written to it"
        );
    }
    for layer in qcow2_files(tmp.path()) {
        assert_check_clean(&layer);
    }
    let final_top = snapshots.last().cloned().unwrap_or(top);
    assert!(
        qemu_raw(&final_top, tmp.path()) == served,
        "qemu-img convert of the final chain differs from what the daemon served"
    );
}
