//! Live commits of the top (`commit` on the control socket, `sqcow2
//! commit --live`) while a client writes and flushes: every completed
//! write reads back through the daemon, which serves the base afterwards,
//! and through `qemu-img convert` of the base's chain; the files are
//! clean for `qemu-img check`. `kill -9` at random moments: the log says
//! which top the restart serves, and it has every completed write. A
//! base another process uses is refused before anything is written.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::reference::Reference;
use common::vhost::{connect_retry, control, served_layers, wait_job_ended, Daemon};
use common::{
    assert_check_clean, check_after_crash, env_count, gen_chain, s, sha256_file, sqcow2_bin,
    QemuIoHolder,
};
use serde_json::{json, Value};

const BLOCK: u64 = 16 << 10;

/// Writes, zeroes and discards random blocks (a flush every few) until
/// `stop`, noting each completed change in `reference`.
fn writer(
    mut client: common::vhost::Client,
    size: u64,
    seed: u64,
    reference: Arc<Mutex<Reference>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut writes = 0;
        while !stop.load(Ordering::Relaxed) {
            let offset = rng.u64(0..size / BLOCK) * BLOCK;
            let fill = match rng.u8(..16) {
                0 => {
                    client.write_zeroes(offset, BLOCK, rng.bool());
                    0
                }
                _ => {
                    let fill = rng.u8(1..);
                    client.write(offset, &vec![fill; BLOCK as usize]);
                    fill
                }
            };
            reference.lock().unwrap().wrote(offset, fill);
            if rng.u8(..4) == 0 {
                // Read back at once: while a commit copies (or drains)
                // the range, too.
                assert_eq!(
                    client.read(offset, BLOCK as usize),
                    vec![fill; BLOCK as usize],
                    "read back at {offset}"
                );
            }
            writes += 1;
            if rng.u8(..8) == 0 {
                client.flush();
            }
        }
        writes
    })
}

/// Two live commits under writes (into a middle layer with the p99 guard
/// and a rate, then into the base through the CLI): the daemon serves the
/// base each time, loses nothing, and the files are clean for QEMU.
#[test]
fn live_commits_under_writes_lose_nothing_and_serve_the_base() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 8, "256M", "0.2");
    let size: u64 = 256 << 20;
    let reference = Arc::new(Mutex::new(Reference::new(&top, tmp.path(), BLOCK)));
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let client = connect_retry(&daemon, 1, false);
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(client, size, 7, reference.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    // The top drained into the layer below it.
    let all = served_layers(&ctl);
    let r = control(&ctl, json!({"command": "commit"}));
    assert_eq!(r["ok"], true, "{r}");
    let m = wait_job_ended(&ctl, 120);
    assert_eq!(m["state"], "done", "{m}");
    assert_eq!(m["mirrored-bytes"], 0, "a drain copies nothing twice: {m}");
    let before = served_layers(&ctl);
    assert_eq!(
        before,
        all[..all.len() - 1].to_vec(),
        "serves the layer below"
    );
    std::thread::sleep(Duration::from_millis(200));
    let r = control(
        &ctl,
        json!({"command": "commit", "base": 3, "rate-limit": 512u64 << 20,
               "max-p99-permille": 1500}),
    );
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["result"]["base"], json!(before[3]), "{r}");
    assert_eq!(r["result"]["replaced"].as_array().unwrap().len(), 3);
    // The chain may not be replaced meanwhile; one job at a time.
    for refused in [
        json!({"command": "snapshot", "path": tmp.path().join("s.qcow2")}),
        json!({"command": "resize", "size": 512u64 << 20}),
        json!({"command": "commit"}),
    ] {
        let busy = control(&ctl, refused.clone());
        if busy["ok"] == false {
            assert_eq!(busy["error"]["kind"], "busy", "{refused}: {busy}");
        } else {
            // Only once the commit has ended.
            assert_ne!(wait_job_ended(&ctl, 120)["state"], "copying");
        }
    }
    let m = wait_job_ended(&ctl, 120);
    assert_eq!(m["state"], "done", "{m}");
    assert_eq!(m["kind"], "commit", "{m}");
    assert!(m["mirrored-bytes"].as_u64().unwrap() > 0, "{m}");
    assert!(m["pause-ms"].as_f64().unwrap() > 0.0, "{m}");
    let after = served_layers(&ctl);
    assert_eq!(after, before[..=3].to_vec(), "serves the base as its top");
    let base = after[3].clone();
    // The CLI, into the base of what is left.
    let out = std::process::Command::new(sqcow2_bin())
        .args(["commit", "--live", "-b", "0", "--output", "json", s(&ctl)])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let end: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(end["state"], "done", "{end}");
    assert_eq!(served_layers(&ctl), vec![before[0].clone()]);
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let writes = w.join().unwrap();
    assert!(writes > 0);
    let mut client = connect_retry(&daemon, 1, false);
    reference
        .lock()
        .unwrap()
        .verify_through(&mut client, "after the commits");
    drop(client);
    daemon.stop();
    let log = daemon.log();
    assert!(!log.lines().any(|l| l.contains("ERROR")), "{log}");
    for f in [
        &before[0],
        &base,
        before.last().unwrap(),
        all.last().unwrap(),
    ] {
        assert_check_clean(f);
    }
    // A lone image now: nothing to index.
    let reference = reference.lock().unwrap();
    reference.verify_for_qemu(&before[0], tmp.path());
    println!("{writes} guest changes during two live commits");
}

/// A base another process uses (qemu-io reading it as a backing file) is
/// refused before anything is written, and the daemon serves on.
#[test]
fn a_base_another_process_uses_is_refused_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "64M", "0.3");
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let chain = served_layers(&ctl);
    let other = tmp.path().join("other.qcow2");
    common::qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        s(&chain[0]),
        s(&other),
    ]);
    let before = sha256_file(&chain[0]);
    let mut holder = QemuIoHolder::hold(&other, &["-r"]);
    // The backing file is opened (and locked) after the image.
    holder.wait_held(&chain[0]);
    let r = control(&ctl, json!({"command": "commit", "base": 0}));
    assert_eq!(r["ok"], false, "{r}");
    assert_eq!(r["error"]["kind"], "locked", "{r}");
    assert_eq!(sha256_file(&chain[0]), before, "the base was written");
    drop(holder);
    // Free again: it goes through, and the guest's data stays.
    let mut client = connect_retry(&daemon, 1, false);
    client.write(0, &[0x5a; 4096]);
    client.flush();
    let r = control(&ctl, json!({"command": "commit", "base": 0}));
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(wait_job_ended(&ctl, 120)["state"], "done");
    assert_eq!(client.read(0, 4096), vec![0x5a; 4096]);
    // Nothing to commit into any more; a bad base.
    for (req, kind) in [
        (json!({"command": "commit"}), "commit-failed"),
        (json!({"command": "commit", "base": 9}), "commit-failed"),
        (json!({"command": "commit", "rate-limit": 0}), "bad-request"),
    ] {
        let r = control(&ctl, req.clone());
        assert_eq!(r["error"]["kind"], kind, "{req}: {r}");
    }
    drop(client);
    daemon.stop();
}

/// A cancelled commit leaves the chain served as it was, the old top
/// still taking the guest's writes; nothing it wrote shows.
#[test]
fn a_cancelled_commit_serves_the_chain_as_it_was() {
    cancelled_commit(json!({"command": "commit", "base": 0, "rate-limit": 8u64 << 20}));
}

/// A cancelled drain (the top into the layer below) leaves the chain
/// served as it was: the clusters it drained, and the guest's writes
/// into them since, read from the base, now through the reopened chain.
#[test]
fn a_cancelled_drain_serves_the_chain_as_it_was() {
    cancelled_commit(json!({"command": "commit", "rate-limit": 8u64 << 20}));
}

fn cancelled_commit(request: Value) {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 4, "512M", "0.5");
    let size: u64 = 512 << 20;
    let reference = Arc::new(Mutex::new(Reference::new(&top, tmp.path(), BLOCK)));
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let before = served_layers(&ctl);
    let client = connect_retry(&daemon, 1, false);
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(client, size, 11, reference.clone(), stop.clone());
    let r = control(&ctl, request);
    assert_eq!(r["ok"], true, "{r}");
    std::thread::sleep(Duration::from_millis(400));
    let c = control(&ctl, json!({"command": "commit-cancel"}));
    assert_eq!(c["result"]["cancelled"], true, "{c}");
    let m = wait_job_ended(&ctl, 120);
    assert_eq!(m["state"], "cancelled", "{m}");
    assert_eq!(served_layers(&ctl), before);
    // A snapshot works again.
    let snap = tmp.path().join("snap.qcow2");
    let r = control(&ctl, json!({"command": "snapshot", "path": snap}));
    assert_eq!(r["ok"], true, "{r}");
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    w.join().unwrap();
    let mut client = connect_retry(&daemon, 1, false);
    reference
        .lock()
        .unwrap()
        .verify_through(&mut client, "after the cancel");
    drop(client);
    common::vhost::wait_indexed(&ctl);
    daemon.stop();
    for f in &before {
        assert_check_clean(f);
    }
    reference.lock().unwrap().verify_files(&snap, tmp.path());
}

/// `kill -9` at random moments of live commits (start, copy, switch,
/// after it): the restart serves the top the log names (the base once
/// it logged the switch, the old top before), with every completed
/// write, and `qemu-img check` finds no error. `SQCOW2_COMMIT_KILLS`
/// rounds.
#[test]
fn kills_during_live_commits_lose_no_completed_write() {
    let tmp = tempfile::tempdir().unwrap();
    let mut top = gen_chain(tmp.path(), 4, "1G", "0.05");
    let size: u64 = 1 << 30;
    let mut reference = Reference::new(&top, tmp.path(), BLOCK);
    let ctl = tmp.path().join("control.sock");
    let rounds = env_count("SQCOW2_COMMIT_KILLS", 8usize);
    let seed = env_count("SQCOW2_COMMIT_SEED", 43u64);
    let mut rng = fastrand::Rng::with_seed(seed);
    let (mut old_top, mut base_top) = (0, 0);
    for round in 0..rounds {
        let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
        let mut client = connect_retry(&daemon, 1, false);
        reference.verify_through(&mut client, &format!("round {round}, after the restart"));
        // Two new layers a round, written, then committed from the top.
        for k in 0..2 {
            let new = tmp.path().join(format!("snap{round:03}-{k}.qcow2"));
            let reply = control(&ctl, json!({"command": "snapshot", "path": new}));
            assert_eq!(reply["ok"], true, "round {round}: {reply}");
            top = new;
            for _ in 0..32 {
                let offset = rng.u64(0..size / BLOCK) * BLOCK;
                let fill = rng.u8(1..);
                client.write(offset, &vec![fill; BLOCK as usize]);
                reference.wrote(offset, fill);
            }
        }
        let chain = served_layers(&ctl);
        // Half of them drain the top into the layer below.
        let base_at = if rng.bool() {
            chain.len() - 2
        } else {
            rng.usize(0..chain.len() - 1)
        };
        let base = chain[base_at].clone();
        // Half of them slowed, so that more kills land in the copy.
        let mut request = json!({"command": "commit", "base": base_at});
        if rng.bool() {
            request["rate-limit"] = json!(32u64 << 20);
        }
        let r = control(&ctl, request);
        assert_eq!(r["ok"], true, "round {round}: {r}");
        let writes = rng.usize(0..96);
        for k in 0..writes {
            let offset = rng.u64(0..size / BLOCK) * BLOCK;
            let fill = rng.u8(1..);
            client.write(offset, &vec![fill; BLOCK as usize]);
            reference.wrote(offset, fill);
            if k % 16 == 15 {
                client.flush();
            }
        }
        match rng.u8(..3) {
            0 => std::thread::sleep(Duration::from_millis(rng.u64(0..40))),
            1 => {
                for _ in 0..4000 {
                    let st = control(&ctl, json!({"command": "stats"}));
                    if st["result"]["merge"]["state"] != "copying" {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            _ => {
                wait_job_ended(&ctl, 120);
                for _ in 0..rng.usize(0..16) {
                    let offset = rng.u64(0..size / BLOCK) * BLOCK;
                    let fill = rng.u8(1..);
                    client.write(offset, &vec![fill; BLOCK as usize]);
                    reference.wrote(offset, fill);
                }
            }
        }
        drop(client);
        daemon.stop_with(libc::SIGKILL);
        let switched = daemon.log().contains("live commit switched");
        if switched {
            top = base;
            base_top += 1;
        } else {
            old_top += 1;
        }
        for f in common::qcow2_files(tmp.path()) {
            // A base switched to has no index until the restart builds it.
            if f == top && !switched {
                check_after_crash(&f, &format!("round {round}, {}", f.display()));
            } else {
                common::assert_no_corruption(&f, &format!("round {round}"));
            }
        }
    }
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    reference.verify_through(&mut client, "at the end");
    drop(client);
    common::vhost::wait_indexed(&ctl);
    let chain = served_layers(&ctl);
    daemon.stop();
    // The layers commits took out of the chain, deleted as an operator
    // would (a killed writer left leaks in some: checked above).
    for f in common::qcow2_files(tmp.path()) {
        if !chain.contains(&f) {
            std::fs::remove_file(&f).unwrap();
        }
    }
    println!("{rounds} kills during live commits: {old_top} restarts on the old top, {base_top} on the base");
    if chain.len() > 1 {
        reference.verify_files(&top, tmp.path());
    } else {
        reference.verify_for_qemu(&top, tmp.path()); // a lone image: no index
    }
}

/// An inactivation while a commit copies ends it (cancelled) before its
/// reply, and leaves no lock behind: the next owner commits the top into
/// the base itself (`qemu-img commit` needs the base's write lock); the
/// daemon, activated again, commits what is left and serves the base.
#[test]
fn inactivating_ends_a_commit_and_leaves_no_lock() {
    inactivating_during(
        json!({"command": "commit", "base": 0, "rate-limit": 4u64 << 20}),
        0,
    );
}

/// The same for a drain (the top into the layer below it): stopped, the
/// chain reopened, before the locks go.
#[test]
fn inactivating_ends_a_drain_and_leaves_no_lock() {
    inactivating_during(json!({"command": "commit", "rate-limit": 4u64 << 20}), 1);
}

fn inactivating_during(request: Value, base: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let top = gen_chain(dir, 3, "256M", "0.5");
    let mut reference = Reference::new(&top, dir, BLOCK);
    let ctl = dir.join("control.sock");
    let mut daemon = Daemon::start(dir, &top, &["--control", s(&ctl)]);
    let chain = served_layers(&ctl);
    let r = control(&ctl, request);
    assert_eq!(r["ok"], true, "{r}");
    std::thread::sleep(Duration::from_millis(300));
    let r = control(&ctl, json!({"command": "inactivate"}));
    assert_eq!(r["result"]["active"], false, "{r}");
    let m = control(&ctl, json!({"command": "stats"}))["result"]["merge"].clone();
    assert_eq!(m["state"], "cancelled", "{m}");
    // The next owner writes the base (and the top).
    common::qemu_io(&chain[base], &["write -P 0x66 0 64k".to_string()]);
    common::qemu_io(&top, &["write -P 0x77 64k 64k".to_string()]);
    for b in 0..(64 << 10) / BLOCK {
        reference.wrote((64 << 10) + b * BLOCK, 0x77);
    }
    // (What it wrote into the base at 0 is hidden by the layers above
    // only where they have data: read back through the chain below.)
    let r = control(&ctl, json!({"command": "activate"}));
    assert_eq!(r["result"]["active"], true, "{r}");
    let mut client = connect_retry(&daemon, 1, false);
    let first = client.read(0, 64 << 10);
    for b in 0..(64 << 10) / BLOCK {
        let at = (b * BLOCK) as usize;
        reference.wrote(b * BLOCK, first[at]);
        assert!(
            first[at..at + BLOCK as usize]
                .iter()
                .all(|&x| x == first[at]),
            "block {b} is not one fill"
        );
    }
    let r = control(&ctl, json!({"command": "commit", "base": 0}));
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(wait_job_ended(&ctl, 120)["state"], "done");
    assert_eq!(served_layers(&ctl), vec![chain[0].clone()]);
    reference.verify_through(&mut client, "after the handover and the commit");
    drop(client);
    daemon.stop();
    reference.verify_for_qemu(&chain[0], dir);
}
