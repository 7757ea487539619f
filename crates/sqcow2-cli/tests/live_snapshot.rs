//! Live snapshots under load: a libblkio client writes, flushes and
//! verifies at queue depth 16 on 2 queues while snapshots are taken at
//! random intervals through the control socket; then the chain is judged
//! by the daemon, `qemu-img check` and `qemu-img convert`.

mod common;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::mem::MaybeUninit;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blkio::{Completion, ReqFlags};
use common::reference::Reference;
use common::vhost::{connect_retry, control, wait_indexed, Daemon};
use common::{dirty_bit, env_count, gen_chain, qemu_raw, run_raw, s, sqcow2};
use serde_json::{json, Value};

const BLOCK: u64 = 16 << 10;
const DEPTH: usize = 16;

#[test]
fn live_snapshots_under_write_load() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 10, "64M", "0.5");
    let model = Arc::new(Mutex::new(qemu_raw(&top, tmp.path())));
    let size = model.lock().unwrap().len() as u64;
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(
        tmp.path(),
        &top,
        &["--num-queues", "2", "--control", s(&ctl)],
    );
    let mut client = connect_retry(&daemon, 2, false);
    let stop = Arc::new(AtomicBool::new(false));
    let workers = client.spawn_per_queue({
        let (model, stop) = (model.clone(), stop.clone());
        move |q, mut queue, base| -> (u64, u64) {
            let blocks = size / BLOCK;
            let mut rng = fastrand::Rng::with_seed(q as u64 + 11);
            let slot_ptr = |k: usize| (base + (q * DEPTH + k) * BLOCK as usize) as *mut u8;
            // Queue q owns the blocks with block % 2 == q.
            let mut busy: HashSet<u64> = HashSet::new();
            let mut slot_block = [0u64; DEPTH];
            let mut slot_fill = [0u8; DEPTH];
            let mut completions: Vec<MaybeUninit<Completion>> =
                (0..DEPTH).map(|_| MaybeUninit::uninit()).collect();
            let (mut writes, mut errors) = (0u64, 0u64);
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                // DEPTH writes to distinct blocks.
                busy.clear();
                for k in 0..DEPTH {
                    let block = loop {
                        let b = rng.u64(0..blocks / 2) * 2 + q as u64;
                        if busy.insert(b) {
                            break b;
                        }
                    };
                    let fill = rng.u8(1..);
                    slot_block[k] = block;
                    slot_fill[k] = fill;
                    // SAFETY: slot k of queue q is BLOCK bytes of the
                    // mapped region that only this thread uses.
                    unsafe { std::ptr::write_bytes(slot_ptr(k), fill, BLOCK as usize) };
                    queue.write(
                        block * BLOCK,
                        slot_ptr(k),
                        BLOCK as usize,
                        k,
                        ReqFlags::empty(),
                    );
                }
                let mut done = 0;
                while done < DEPTH {
                    let n = queue
                        .do_io(&mut completions[..DEPTH - done], 1, None, None)
                        .expect("do_io");
                    for c in &completions[..n] {
                        // SAFETY: do_io initialised the first n entries.
                        let c = unsafe { c.assume_init_ref() };
                        if c.ret != 0 {
                            errors += 1;
                        } else {
                            let k = c.user_data;
                            let off = (slot_block[k] * BLOCK) as usize;
                            model.lock().unwrap()[off..off + BLOCK as usize].fill(slot_fill[k]);
                            writes += 1;
                        }
                    }
                    done += n;
                }
                if round % 4 == 0 {
                    queue.flush(0, ReqFlags::empty());
                    let n = queue.do_io(&mut completions[..1], 1, None, None).unwrap();
                    assert_eq!(n, 1);
                    // SAFETY: as above.
                    if unsafe { completions[0].assume_init_ref() }.ret != 0 {
                        errors += 1;
                    }
                }
                // Verify one block of ours (not in flight now).
                let block = rng.u64(0..blocks / 2) * 2 + q as u64;
                queue.read(
                    block * BLOCK,
                    slot_ptr(0),
                    BLOCK as usize,
                    0,
                    ReqFlags::empty(),
                );
                let n = queue.do_io(&mut completions[..1], 1, None, None).unwrap();
                assert_eq!(n, 1);
                // SAFETY: as above; the read into slot 0 completed.
                let got = unsafe { std::slice::from_raw_parts(slot_ptr(0), BLOCK as usize) };
                let off = (block * BLOCK) as usize;
                let want = model.lock().unwrap()[off..off + BLOCK as usize].to_vec();
                assert!(
                    got == want.as_slice(),
                    "queue {q}: block {block} differs during the run"
                );
            }
            queue.flush(0, ReqFlags::empty());
            let _ = queue.do_io(&mut completions[..1], 1, None, None);
            (writes, errors)
        }
    });

    let mut rng = fastrand::Rng::with_seed(99);
    let mut pauses = Vec::new();
    let count = env_count("SQCOW2_LIVE_SNAPSHOTS", 50usize);
    let may_raise = may_raise_priority();
    // One connection for all of them: its thread, which does the pauses,
    // stays for the check after them.
    let conn = UnixStream::connect(&ctl).unwrap();
    let mut replies = BufReader::new(conn.try_clone().unwrap());
    let mut requests = conn;
    for i in 0..count {
        std::thread::sleep(Duration::from_millis(rng.u64(10..80)));
        let new = tmp.path().join(format!("live{i:03}.qcow2"));
        writeln!(
            requests,
            "{}",
            json!({"id": i, "command": "snapshot", "path": new})
        )
        .unwrap();
        let mut line = String::new();
        replies.read_line(&mut line).unwrap();
        let reply: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(reply["ok"], true, "snapshot {i}: {reply}");
        assert_eq!(reply["id"], i);
        // A daemon allowed to runs the pause ahead of the host's normal
        // threads.
        assert_eq!(
            reply["result"]["steps"]["realtime"], may_raise,
            "snapshot {i}: {reply}"
        );
        pauses.push(reply["result"]["pause-ms"].as_f64().unwrap());
    }
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    let mut total_writes = 0;
    for w in workers {
        let (writes, errors) = w.join().expect("client thread");
        assert_eq!(errors, 0, "I/O errors during live snapshots");
        total_writes += writes;
    }
    // And every thread of the daemon back at normal scheduling after, the
    // one that did the pauses still there.
    assert_eq!(realtime_threads(daemon.pid()), 0);
    drop((requests, replies));
    pauses.sort_by(f64::total_cmp);
    let q = |p: f64| pauses[((pauses.len() - 1) as f64 * p).round() as usize];
    println!(
        "{count} live snapshots under {total_writes} writes: pause p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        q(0.5),
        q(0.99),
        q(1.0)
    );

    let info = control(&ctl, json!({"command": "info"}));
    assert_eq!(info["result"]["layers"], 10 + count, "{info}");
    assert_eq!(info["result"]["indexed"], true, "{info}");
    let stats = wait_indexed(&ctl);
    assert_eq!(stats["result"]["snapshots"]["count"], count);
    let model = model.lock().unwrap().clone();
    // Through the daemon (a new connection: the queues went to threads).
    drop(client);
    let mut client = connect_retry(&daemon, 1, false);
    let mut pos = 0u64;
    while pos < size {
        let n = (4u64 << 20).min(size - pos) as usize;
        assert!(
            client.read(pos, n) == model[pos as usize..pos as usize + n],
            "daemon read at {pos} differs"
        );
        pos += n as u64;
    }
    drop(client);
    daemon.stop();
    // Every layer clean, the final chain equal to the model.
    let new_top = tmp.path().join(format!("live{:03}.qcow2", count - 1));
    let mut layers: Vec<PathBuf> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "qcow2"))
        .collect();
    layers.sort();
    assert_eq!(layers.len(), 10 + count);
    for layer in &layers {
        let out = run_raw(std::process::Command::new("qemu-img").args([
            "check",
            "--output=json",
            s(layer),
        ]));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "qemu-img check {}: {text}",
            layer.display()
        );
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v["leaks"].as_u64().unwrap_or(0),
            0,
            "{}: {text}",
            layer.display()
        );
    }
    assert!(
        qemu_raw(&new_top, tmp.path()) == model,
        "qemu-img convert of the final chain differs"
    );
    let info = sqcow2(&["info", s(&new_top)]);
    assert!(info.contains("valid"), "index of the final top: {info}");
    // `check` compares every index entry with a walk of the chain.
    let check =
        run_raw(std::process::Command::new(common::sqcow2_bin()).args(["check", s(&new_top)]));
    assert!(
        check.status.success(),
        "sqcow2 check of the final top: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
}

#[test]
fn bad_control_input_gets_error_replies() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "16M", "0.5");
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&ctl).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let kind = |reply: &Value| reply["error"]["kind"].as_str().unwrap_or("").to_string();
    // Raw lines on one connection.
    let mut stream = UnixStream::connect(&ctl).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    for (line, want) in [
        ("{not json", "bad-request"),
        ("[1,2]", "bad-request"),
        ("{\"id\":1}", "bad-request"),
        ("{\"id\":2,\"command\":\"explode\"}", "unknown-command"),
        ("{\"id\":3,\"command\":\"snapshot\"}", "bad-request"),
        (
            "{\"id\":4,\"command\":\"stats\",\"format\":\"xml\"}",
            "bad-request",
        ),
    ] {
        stream.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut reply = String::new();
        reader.read_line(&mut reply).unwrap();
        let reply: Value = serde_json::from_str(&reply).unwrap();
        assert_eq!(reply["ok"], false, "{line}: {reply}");
        assert_eq!(kind(&reply), want, "{line}: {reply}");
    }
    // Bytes that are not UTF-8 get a reply too, and the connection goes on.
    stream.write_all(b"\xff\xfe\x00\x01\n").unwrap();
    let mut reply = String::new();
    reader.read_line(&mut reply).unwrap();
    let reply: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(kind(&reply), "bad-request", "{reply}");
    stream
        .write_all(b"{\"id\":5,\"command\":\"info\"}\n")
        .unwrap();
    let mut reply = String::new();
    reader.read_line(&mut reply).unwrap();
    let reply: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    // A line over 64 KiB gets its reply before the connection closes,
    // however much longer it is (unread bytes made the close reset the
    // connection, and the client lost the reply).
    for len in [65_537usize, 200_000, 3_000_000] {
        let mut long = UnixStream::connect(&ctl).unwrap();
        long.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut line = vec![b'x'; len];
        line.push(b'\n');
        long.write_all(&line).unwrap();
        let mut reply = String::new();
        BufReader::new(long)
            .read_line(&mut reply)
            .unwrap_or_else(|e| panic!("{len} bytes: {e}"));
        let reply: Value = serde_json::from_str(&reply).unwrap();
        assert_eq!(kind(&reply), "bad-request", "{len}: {reply}");
    }
    // Connections are bounded (a thread each): beyond 64 at a time one
    // is told so and closed; once they go, connections work again.
    let held: Vec<UnixStream> = (0..64)
        .map(|_| UnixStream::connect(&ctl).unwrap())
        .collect();
    let extra = UnixStream::connect(&ctl).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reply = String::new();
    BufReader::new(extra).read_line(&mut reply).unwrap();
    let reply: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(kind(&reply), "busy", "{reply}");
    drop(held);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        // (The connection threads end as they see their clients go; the
        // accept thread may still be working through the backlog.)
        let reply = common::vhost::try_control(&ctl, json!({"command": "info"}));
        if reply.as_ref().is_some_and(|r| r["ok"] == true) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{reply:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Snapshot onto an existing file, into a directory nobody can create
    // files in.
    let reply = control(&ctl, json!({"command": "snapshot", "path": top}));
    assert_eq!(kind(&reply), "exists", "{reply}");
    let reply = control(
        &ctl,
        json!({"command": "snapshot", "path": "/proc/sqcow2-live.qcow2"}),
    );
    assert_eq!(kind(&reply), "snapshot-failed", "{reply}");
    // Outside the backing root (default: the top's directory), where the
    // chain could not be opened again at the next start; and over a
    // dangling symlink.
    let elsewhere = tempfile::tempdir().unwrap();
    let outside = elsewhere.path().join("outside.qcow2");
    let reply = control(&ctl, json!({"command": "snapshot", "path": outside}));
    assert_eq!(kind(&reply), "snapshot-failed", "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("outside the backing root"),
        "{reply}"
    );
    assert!(!outside.exists());
    // (Timings are never negative zero: `-0.0` was printed.)
    let ok_reply = control(
        &ctl,
        json!({"command": "snapshot", "path": tmp.path().join("fine.qcow2")}),
    );
    let text = ok_reply.to_string();
    assert!(ok_reply["ok"] == true && !text.contains("-0.0"), "{text}");
    let dangling = tmp.path().join("dangling.qcow2");
    std::os::unix::fs::symlink(tmp.path().join("nowhere.qcow2"), &dangling).unwrap();
    let reply = control(&ctl, json!({"command": "snapshot", "path": dangling}));
    assert_eq!(kind(&reply), "exists", "{reply}");
    std::fs::remove_file(&dangling).unwrap();
    // Concurrent snapshots: each one succeeds or is told another runs.
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let ctl = ctl.clone();
            let path = tmp.path().join(format!("race{i}.qcow2"));
            std::thread::spawn(move || control(&ctl, json!({"command": "snapshot", "path": path})))
        })
        .collect();
    let mut ok = 0;
    for t in threads {
        let reply = t.join().unwrap();
        if reply["ok"] == true {
            ok += 1;
        } else {
            assert_eq!(kind(&reply), "busy", "{reply}");
        }
    }
    assert!(ok >= 1);
    // Still serving: I/O works, stats and info answer, Prometheus text.
    let mut client = connect_retry(&daemon, 1, false);
    client.write(0, &[9u8; 4096]);
    assert_eq!(client.read(0, 4096), vec![9u8; 4096]);
    let prom = control(&ctl, json!({"command": "stats", "format": "prometheus"}));
    let text = prom["result"]["text"].as_str().unwrap();
    assert!(text.contains("sqcow2_cache_hits_total "), "{text}");
    assert!(
        text.contains("sqcow2_queue_requests_total{queue=\"0\"}"),
        "{text}"
    );
    let info = control(&ctl, json!({"command": "info"}));
    assert_eq!(info["result"]["layers"], 4 + ok, "{info}");
    drop(client);
    daemon.stop();
    assert!(!ctl.exists(), "control socket left behind");
    let check = run_raw(std::process::Command::new("qemu-img").args(["check", s(&top)]));
    assert!(check.status.success());
}

/// `kill -9` of the daemon right after live snapshots, while it builds the
/// new top's index in the background (at random moments, a few rounds;
/// `scripts/long-test.sh kill-index-builds` runs many): each restart serves the
/// chain at once (the old index lends itself, the new top walked above
/// it) with every completed write, rebuilds the index without an
/// operator, and in the end every layer is clean, QEMU reads the
/// reference's bytes and the index agrees with a walk of the chain.
#[test]
fn kills_during_background_index_builds_lose_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    // A large sparse disk: the index has many chunks, so builds take long
    // enough for kills to land inside them.
    let mut top = gen_chain(tmp.path(), 6, "16G", "0.002");
    let mut reference = Reference::new(&top, tmp.path(), BLOCK);
    let size: u64 = 16 << 30;
    let ctl = tmp.path().join("control.sock");
    let rounds = env_count("SQCOW2_BUILD_KILLS", 4usize);
    let mut rng = fastrand::Rng::with_seed(17);
    let mut killed_while_building = 0;
    for round in 0..rounds {
        let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
        let mut client = connect_retry(&daemon, 1, false);
        reference.verify_through(&mut client, &format!("round {round}, after the restart"));
        write_random(&mut client, &mut reference, &mut rng, size, 32);
        if rng.bool() {
            client.flush();
        }
        let new = tmp.path().join(format!("kill{round:03}.qcow2"));
        let reply = control(&ctl, json!({"command": "snapshot", "path": new}));
        assert_eq!(reply["ok"], true, "round {round}: {reply}");
        top = new;
        // Writes into the new top too, then the kill at a random moment of
        // the background build.
        write_random(&mut client, &mut reference, &mut rng, size, 8);
        std::thread::sleep(Duration::from_millis(rng.u64(0..40)));
        let stats = control(&ctl, json!({"command": "stats"}));
        if stats["result"]["index"]["building"] == true {
            killed_while_building += 1;
        }
        drop(client);
        daemon.stop_with(libc::SIGKILL);
    }
    // The last kill may have come after its build installed the index:
    // then there is nothing left to build.
    let info: serde_json::Value =
        serde_json::from_str(&sqcow2(&["info", "--output", "json", s(&top)])).unwrap();
    let indexed_before = info["chain-index"]["state"] == "valid";
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    reference.verify_through(&mut client, "after the last restart");
    let stats = wait_indexed(&ctl);
    assert!(
        indexed_before || stats["result"]["index"]["builds"].as_u64().unwrap_or(0) >= 1,
        "the restarted daemon did not build the top's index: {stats}"
    );
    drop(client);
    daemon.stop();
    println!("{rounds} kills, {killed_while_building} while a build ran");
    reference.verify_files(&top, tmp.path());
}

/// `kill -9` of the daemon at a random moment of a live snapshot, from
/// the command on: while the new top is created or prepared, in the pause,
/// while the old top is closed after the switch, or during the background
/// build (a few rounds; `scripts/long-test.sh kill-index-builds` runs many). The
/// daemon restarts on the new top if its file exists (an empty overlay of
/// the old top until the switch), else on the old one: each restart serves
/// every completed write, and a backing layer the kill left open (dirty,
/// with its journal and spare clusters) is repaired by that restart; in
/// the end every layer is clean for `qemu-img check` and QEMU reads the
/// reference's bytes.
#[test]
fn kills_at_any_moment_of_a_live_snapshot_lose_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut top = gen_chain(tmp.path(), 4, "8G", "0.002");
    let mut reference = Reference::new(&top, tmp.path(), BLOCK);
    let size: u64 = 8 << 30;
    let ctl = tmp.path().join("control.sock");
    let rounds = env_count("SQCOW2_SNAPSHOT_KILLS", 6usize);
    let mut rng = fastrand::Rng::with_seed(23);
    let (mut switched, mut old_left_open) = (0, 0);
    for round in 0..rounds {
        let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
        let mut client = connect_retry(&daemon, 1, false);
        reference.verify_through(&mut client, &format!("round {round}, after the restart"));
        write_random(&mut client, &mut reference, &mut rng, size, 48);
        if rng.bool() {
            client.flush();
        }
        let new = tmp.path().join(format!("killsnap{round:03}.qcow2"));
        let asked = std::thread::spawn({
            let (ctl, new) = (ctl.clone(), new.clone());
            move || {
                common::vhost::control_within(
                    &ctl,
                    json!({"command": "snapshot", "path": new}),
                    Duration::from_secs(60),
                )
            }
        });
        std::thread::sleep(Duration::from_micros(rng.u64(0..30_000)));
        drop(client);
        daemon.stop_with(libc::SIGKILL);
        let reply = asked.join().expect("control thread");
        if reply.is_some_and(|r| r["ok"] == true) {
            switched += 1;
        }
        if new.exists() {
            if dirty_bit(&top) {
                old_left_open += 1;
            }
            top = new;
        }
    }
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    reference.verify_through(&mut client, "after the last restart");
    wait_indexed(&ctl);
    drop(client);
    daemon.stop();
    println!(
        "{rounds} kills: {switched} after the snapshot's reply, {old_left_open} with the old top left open under the new one"
    );
    reference.verify_files(&top, tmp.path());
}

/// `n` writes of random blocks of a disk of `size` bytes, each filled
/// with one random nonzero byte, noted in `reference`.
fn write_random(
    client: &mut common::vhost::Client,
    reference: &mut Reference,
    rng: &mut fastrand::Rng,
    size: u64,
    n: usize,
) {
    for _ in 0..n {
        let offset = rng.u64(0..size / BLOCK) * BLOCK;
        let fill = rng.u8(1..);
        client.write(offset, &vec![fill; BLOCK as usize]);
        reference.wrote(offset, fill);
    }
}

/// 50 live snapshots back to back, faster than their background index
/// builds, while a client writes and flushes: builds queue and merge
/// (fewer builds than snapshots), the guest's writes all complete and read
/// back, and the chain ends indexed, clean and equal to the reference.
#[test]
fn snapshots_back_to_back_outrun_the_index_builds() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 4, "4G", "0.01");
    let reference = Arc::new(Mutex::new(Reference::new(&top, tmp.path(), BLOCK)));
    let size: u64 = 4 << 30;
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let client = connect_retry(&daemon, 1, false);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = std::thread::spawn({
        let (reference, stop) = (reference.clone(), stop.clone());
        let mut client = client;
        move || {
            let mut rng = fastrand::Rng::with_seed(5);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let offset = rng.u64(0..size / BLOCK) * BLOCK;
                let fill = rng.u8(1..);
                assert_eq!(client.try_write(offset, &vec![fill; BLOCK as usize]), 0);
                reference.lock().unwrap().wrote(offset, fill);
                n += 1;
                if n % 16 == 0 {
                    assert_eq!(client.try_flush(), 0);
                }
            }
            client
        }
    });
    let count = 50;
    let mut last = top.clone();
    for i in 0..count {
        let new = tmp.path().join(format!("burst{i:03}.qcow2"));
        let reply = control(&ctl, json!({"id": i, "command": "snapshot", "path": new}));
        assert_eq!(reply["ok"], true, "snapshot {i}: {reply}");
        last = new;
    }
    stop.store(true, Ordering::Relaxed);
    let mut client = writer.join().expect("writer");
    let stats = wait_indexed(&ctl);
    let builds = stats["result"]["index"]["builds"].as_u64().unwrap_or(0);
    println!("{count} snapshots back to back: {builds} index builds");
    assert!(builds >= 1, "{stats}");
    let info = control(&ctl, json!({"command": "info"}));
    assert_eq!(info["result"]["layers"], 4 + count, "{info}");
    let reference = Arc::try_unwrap(reference)
        .ok()
        .unwrap()
        .into_inner()
        .unwrap();
    reference.verify_through(&mut client, "after the burst");
    drop(client);
    daemon.stop();
    reference.verify_files(&last, tmp.path());
}

/// A daemon told not to use indexes (`sqcow2 --walk serve`) builds none
/// after a live snapshot either: the new top's index file never appears.
#[test]
fn a_walking_daemon_builds_no_index() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "64M", "0.5");
    let ctl = tmp.path().join("control.sock");
    let socket = tmp.path().join("vhost.sock");
    let pidfile = tmp.path().join("serve.pid");
    /// Killed if the test fails before it stops the daemon.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Killed(
        std::process::Command::new(common::sqcow2_bin())
            .args(["--walk", "serve", "--socket", s(&socket)])
            .args(["--pidfile", s(&pidfile), "--control", s(&ctl), s(&top)])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    while !pidfile.exists() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let new = tmp.path().join("walked.qcow2");
    let reply = control(&ctl, json!({"command": "snapshot", "path": new}));
    assert_eq!(reply["ok"], true, "{reply}");
    std::thread::sleep(Duration::from_millis(500));
    let stats = control(&ctl, json!({"command": "stats"}));
    assert_eq!(stats["result"]["index"]["builds"], 0, "{stats}");
    assert!(
        !tmp.path().join("walked.qcow2.sqidx").exists(),
        "a --walk daemon wrote an index"
    );
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
}

/// Whether the daemon this test starts may run a thread real-time, asked
/// of util-linux's `chrt` (an independent program started as the daemon
/// is: capabilities, `RLIMIT_RTPRIO`, seccomp, cgroups), and whether it
/// would (it raises only from the default policy at nice 0).
fn may_raise_priority() -> bool {
    let chrt = std::process::Command::new("chrt")
        .args(["-f", "1", "true"])
        .status()
        .is_ok_and(|s| s.success());
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    let (nice, policy) = nice_and_policy(&stat);
    chrt && nice == "0" && policy == "0"
}

/// Fields 19 (nice) and 41 (scheduling policy) of a `stat` line.
fn nice_and_policy(stat: &str) -> (String, String) {
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .collect();
    (fields[19 - 3].to_string(), fields[41 - 3].to_string())
}

/// Threads of process `pid` running at a real-time policy now.
fn realtime_threads(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("stat")).ok())
        .filter(|stat| {
            let (_, policy) = nice_and_policy(stat);
            policy == "1" || policy == "2"
        })
        .count()
}

/// The descriptions the daemon `pid` has open on `path`: whether each was
/// opened for writing.
fn descriptions_of(pid: i32, path: &std::path::Path) -> Vec<bool> {
    let want = std::fs::canonicalize(path).unwrap();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            (std::fs::read_link(e.path()).ok()? == want).then_some(e.file_name())
        })
        .filter_map(|fd| {
            let info =
                std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.to_str()?)).ok()?;
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())?;
            Some(flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32)
        })
        .collect()
}

/// After live snapshots the old tops are lower layers like any other, as
/// QEMU reopens an old top read-only after `blockdev-snapshot`: read
/// through a read-only description (counted in the chain's descriptor
/// budget, see `tests/successor.rs` of sqcow2-format) that holds a
/// reader's image locks, QEMU refused writes and allowed reads, and the
/// writer's read-write description closed. A budget of two descriptors
/// closes and reopens them; each, reopened after the index builds (which
/// mark every layer as indexed), is locked again.
#[test]
fn old_tops_are_read_only_locked_lower_layers_after_live_snapshots() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 2, "16M", "0.5");
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(
        tmp.path(),
        &top,
        &["--control", s(&ctl), "--max-open-files", "2"],
    );
    let mut client = connect_retry(&daemon, 1, false);
    let mut tops = vec![top.clone()];
    let mut want: Vec<Vec<u8>> = (0..4u64)
        .map(|i| client.read(i * 2 * 65536, 3 * 4096))
        .collect();
    for i in 0..4u64 {
        want[i as usize][..4096].fill(i as u8 + 1);
        if i < 3 {
            want[i as usize][8192..].fill(0xC0);
        }
        // A cluster of its own, and a copy-on-write over the one written
        // before the last snapshot (a read of the old top).
        client.write(i * 2 * 65536, &[i as u8 + 1; 4096]);
        // And one no later write copies up: reads of it go to this top
        // alone once it is an old top.
        client.write(i * 2 * 65536 + 65536, &[0xA0 + i as u8; 4096]);
        if i > 0 {
            client.write((i - 1) * 2 * 65536 + 8192, &[0xC0; 4096]);
        }
        client.flush();
        let path = tmp.path().join(format!("snap{i}.qcow2"));
        let reply = control(&ctl, json!({"command": "snapshot", "path": path}));
        assert_eq!(reply["ok"], true, "{reply}");
        tops.push(path);
    }
    client.write(7 * 2 * 65536 + 8192, &[0xC1; 4096]);
    client.flush();
    wait_indexed(&ctl);
    let old_tops = &tops[..tops.len() - 1];
    // The chains before each snapshot go once no request uses them.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let writable: Vec<_> = old_tops
            .iter()
            .filter(|p| descriptions_of(daemon.pid(), p).contains(&true))
            .collect();
        if writable.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "old tops still open for writing 20 s after their snapshot: {writable:?}"
        );
        assert_eq!(client.read(0, 4096), vec![1u8; 4096]);
        std::thread::sleep(Duration::from_millis(50));
    }
    for (i, old) in old_tops.iter().enumerate() {
        assert!(
            client.read(i as u64 * 2 * 65536, 3 * 4096) == want[i],
            "cluster {i}"
        );
        // A cluster only it holds, read through the daemon: the layer's
        // file is open (reopened if the budget had closed it). (The one
        // above was copied up into the next top by a later write.)
        assert!(
            client.read(i as u64 * 2 * 65536 + 65536, 4096) == vec![0xA0 + i as u8; 4096],
            "cluster {} of {}",
            2 * i + 1,
            old.display()
        );
        let open = descriptions_of(daemon.pid(), old);
        assert!(
            !open.is_empty() && open.len() <= 2,
            "{}: {} descriptions open",
            old.display(),
            open.len()
        );
        // QEMU's own tools are the oracle of the image locks.
        let write = run_raw(std::process::Command::new("qemu-io").args([
            "-f",
            "qcow2",
            "-c",
            "write 0 512",
            s(old),
        ]));
        let said = String::from_utf8_lossy(&write.stderr).to_string()
            + &String::from_utf8_lossy(&write.stdout);
        assert!(
            said.contains("lock"),
            "QEMU could open the old top {} for writing: {said}",
            old.display()
        );
        let read = run_raw(std::process::Command::new("qemu-io").args([
            "-r",
            "-f",
            "qcow2",
            "-c",
            "read 0 512",
            s(old),
        ]));
        assert!(
            read.status.success() && !String::from_utf8_lossy(&read.stdout).contains("failed"),
            "QEMU could not read the old top {}: {}",
            old.display(),
            String::from_utf8_lossy(&read.stderr)
        );
    }
    for (i, want) in want.iter().enumerate() {
        assert!(
            client.read(i as u64 * 2 * 65536, 3 * 4096) == *want,
            "cluster {i}"
        );
    }
    drop(client);
    daemon.stop();
    for layer in &tops {
        common::assert_check_clean(layer);
    }
}

/// SIGTERM with no frontend connected while a live snapshot or a merge
/// runs: the stop waits for the snapshot and stops the merge (its file
/// removed), then flushes; whatever the moment, the daemon exits 0 and
/// leaves no temporary file, no journal, no dirty layer (before, it
/// exited under them: the new top's temporary file, or a new top left
/// dirty with its journal, or the merge's temporary file).
#[test]
fn sigterm_without_a_frontend_waits_for_snapshots_and_merges() {
    use std::io::Write as _;
    for round in 0..8u64 {
        let tmp = tempfile::tempdir().unwrap();
        let top = gen_chain(tmp.path(), 3, "64M", "0.5");
        let ctl = tmp.path().join("control.sock");
        let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
        let request = if round % 2 == 0 {
            json!({"command": "snapshot", "path": tmp.path().join("new.qcow2")})
        } else {
            json!({"command": "merge", "first": 0, "last": 1,
                   "path": tmp.path().join("m.qcow2"), "rate-limit": 20_000_000})
        };
        let mut stream = UnixStream::connect(&ctl).unwrap();
        stream.write_all(format!("{request}\n").as_bytes()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(round * 2));
        let status = daemon.stop_with(libc::SIGTERM);
        assert!(
            status.success(),
            "round {round}: {status}\n{}",
            daemon.log()
        );
        let mut left = Vec::new();
        for entry in std::fs::read_dir(tmp.path()).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if name.ends_with(".tmp")
                || name.ends_with(".sqtmp")
                || name.contains(".sqjournal")
                || name.ends_with(".sock")
            {
                left.push(name);
            }
        }
        assert!(left.is_empty(), "round {round}: left behind {left:?}");
        for entry in std::fs::read_dir(tmp.path()).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "qcow2") {
                let check =
                    run_raw(std::process::Command::new("qemu-img").args(["check", s(&path)]));
                assert!(check.status.success(), "round {round}: {}", path.display());
                let dirty = std::fs::read(&path).unwrap()[79] & 1 == 1;
                assert!(!dirty, "round {round}: {} left dirty", path.display());
            }
        }
    }
}
