//! Live merges (`merge` on the control socket) while a client writes and
//! flushes: every completed write reads back through the daemon and, at
//! the end, through `qemu-img convert`; every file is clean for `qemu-img
//! check`; the chain is indexed again. And `kill -9` at random moments of
//! merges: each restart serves the old chain or the new one, never
//! anything else, with every completed write.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::reference::Reference;
use common::vhost::{connect_retry, control, served_layers, wait_indexed, wait_job_ended, Daemon};
use common::{env_count, gen_chain, s};
use serde_json::json;

const BLOCK: u64 = 16 << 10;

/// Merges layers `first..=last` into `path` and waits until that is done.
fn merge_to_the_end(ctl: &Path, first: usize, last: usize, path: &Path) {
    let r = control(
        ctl,
        json!({"command": "merge", "first": first, "last": last, "path": path}),
    );
    assert_eq!(r["ok"], true, "{r}");
    let m = wait_job_ended(ctl, 60);
    assert_eq!(m["state"], "done", "{m}");
}

/// Writes random blocks (a flush every few) until `stop`, noting each
/// completed write in `reference`.
fn writer(
    mut client: common::vhost::Client,
    size: u64,
    seed: u64,
    reference: Arc<Mutex<Reference>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, u64)> {
    std::thread::spawn(move || {
        let mut rng = fastrand::Rng::with_seed(seed);
        let (mut writes, mut flushes) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            let offset = rng.u64(0..size / BLOCK) * BLOCK;
            let fill = rng.u8(1..);
            client.write(offset, &vec![fill; BLOCK as usize]);
            reference.lock().unwrap().wrote(offset, fill);
            writes += 1;
            if rng.u8(..8) == 0 {
                client.flush();
                flushes += 1;
            }
        }
        (writes, flushes)
    })
}

#[test]
fn a_live_merge_under_writes_loses_nothing_and_ends_indexed() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 12, "256M", "0.2");
    let size: u64 = 256 << 20;
    let reference = Arc::new(Mutex::new(Reference::new(&top, tmp.path(), BLOCK)));
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let client = connect_retry(&daemon, 1, false);
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(client, size, 3, reference.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    let before = served_layers(&ctl);
    // The base and the eight layers above it, then a middle range of what
    // is left, paced by a byte rate.
    let merged = tmp.path().join("merged-0-8.qcow2");
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 0, "last": 8, "path": merged}),
    );
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["result"]["replaced"].as_array().unwrap().len(), 9);
    let m = wait_job_ended(&ctl, 60);
    assert_eq!(m["state"], "done", "{m}");
    let after = served_layers(&ctl);
    assert_eq!(after.len(), before.len() - 8, "{after:?}");
    assert_eq!(after[0], merged);
    let merged2 = tmp.path().join("merged-1-2.qcow2");
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 1, "last": 2, "path": merged2,
               "rate-limit": 64 << 20, "max-p99-permille": 1200}),
    );
    assert_eq!(r["ok"], true, "{r}");
    // One merge at a time.
    let busy = control(
        &ctl,
        json!({"command": "merge", "first": 0, "last": 1, "path": tmp.path().join("x.qcow2")}),
    );
    if busy["ok"] == false {
        assert_eq!(busy["error"]["kind"], "busy", "{busy}");
    }
    let m = wait_job_ended(&ctl, 60);
    assert_eq!(m["state"], "done", "{m}");
    assert_eq!(served_layers(&ctl).len(), after.len() - 1);
    // The top cannot be merged.
    let top_at = served_layers(&ctl).len() - 1;
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 0, "last": top_at, "path": tmp.path().join("y.qcow2")}),
    );
    assert_eq!(r["ok"], false, "{r}");
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let (writes, flushes) = w.join().unwrap();
    assert!(writes > 0);
    let mut client = connect_retry(&daemon, 1, false);
    reference
        .lock()
        .unwrap()
        .verify_through(&mut client, "after the merges");
    wait_indexed(&ctl);
    drop(client);
    daemon.stop();
    // Merges that succeed are no errors in the log (the old chain's
    // writer was ended with a failure's ERROR line).
    let log = daemon.log();
    assert!(
        !log.lines()
            .any(|l| l.contains("ERROR") || l.contains("not writing metadata back")),
        "{log}"
    );
    println!("{writes} writes, {flushes} flushes during two merges");
    let reference = reference.lock().unwrap();
    reference.verify_files(&top, tmp.path());
}

/// `kill -9` at random moments of live merges (copy, publish, switch,
/// index build after it): each restart serves either the chain before
/// the merge or the one after it, with every completed write; a merge
/// file left half-written is never part of a chain. `SQCOW2_MERGE_KILLS`
/// rounds (`scripts/long-test.sh kill-merges` runs many).
#[test]
fn kills_during_live_merges_leave_the_old_chain_or_the_new_one() {
    let tmp = tempfile::tempdir().unwrap();
    let mut top = gen_chain(tmp.path(), 8, "1G", "0.05");
    let size: u64 = 1 << 30;
    let mut reference = Reference::new(&top, tmp.path(), BLOCK);
    let ctl = tmp.path().join("control.sock");
    let rounds = env_count("SQCOW2_MERGE_KILLS", 4usize);
    let seed = env_count("SQCOW2_MERGE_SEED", 41u64);
    let mut rng = fastrand::Rng::with_seed(seed);
    let (mut old_chain, mut new_chain, mut cleaned) = (0, 0, 0);
    for round in 0..rounds {
        let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
        let mut client = connect_retry(&daemon, 1, false);
        reference.verify_through(&mut client, &format!("round {round}, after the restart"));
        // Keep the chain long enough to merge: a live snapshot per round.
        let new = tmp.path().join(format!("snap{round:03}.qcow2"));
        let reply = control(&ctl, json!({"command": "snapshot", "path": new}));
        assert_eq!(reply["ok"], true, "round {round}: {reply}");
        top = new;
        let before = served_layers(&ctl);
        let below_top = before.len() - 1;
        let first = rng.usize(0..below_top - 1);
        let last = rng.usize(first + 1..below_top);
        let merged = tmp.path().join(format!("merged{round:03}.qcow2"));
        let r = control(
            &ctl,
            json!({"command": "merge", "first": first, "last": last, "path": merged}),
        );
        assert_eq!(r["ok"], true, "round {round}: {r}");
        // Writes while it runs, a flush now and then, then the kill.
        let writes = rng.usize(0..64);
        for k in 0..writes {
            let offset = rng.u64(0..size / BLOCK) * BLOCK;
            let fill = rng.u8(1..);
            client.write(offset, &vec![fill; BLOCK as usize]);
            reference.wrote(offset, fill);
            if k % 16 == 15 {
                client.flush();
            }
        }
        // The kill: during the copy, as soon as the copy ends (publish or
        // switch), or after the switch (the top's index being built).
        match rng.u8(..3) {
            0 => std::thread::sleep(Duration::from_millis(rng.u64(0..60))),
            1 => {
                for _ in 0..2000 {
                    let st = control(&ctl, json!({"command": "stats"}));
                    if st["result"]["merge"]["state"] != "copying" {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            _ => {
                wait_job_ended(&ctl, 60);
                std::thread::sleep(Duration::from_millis(rng.u64(0..20)));
            }
        }
        drop(client);
        daemon.stop_with(libc::SIGKILL);
        // Restart: the old chain or the new one, nothing else; what the
        // killed merge left under temporary names (recognised by their
        // headers) removed at the start (checked once this daemon has
        // stopped: its own index build makes a temporary file meanwhile).
        let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
        cleaned += daemon
            .log()
            .matches("removed what a killed operation left")
            .count();
        let now = served_layers(&ctl);
        if now == before {
            old_chain += 1;
        } else {
            assert_eq!(
                now.len(),
                before.len() - (last - first),
                "round {round}: {now:?}"
            );
            assert_eq!(now[first], merged, "round {round}: {now:?}");
            assert_eq!(&now[..first], &before[..first]);
            assert_eq!(&now[first + 1..], &before[last + 1..]);
            new_chain += 1;
        }
        let mut client = connect_retry(&daemon, 1, false);
        reference.verify_through(&mut client, &format!("round {round}, after the kill"));
        drop(client);
        daemon.stop();
        let leftovers: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| {
                n.ends_with(".sqtmp")
                    || n.ends_with(".sqtmp.sqjournal")
                    || n.ends_with(".sqidx.tmp")
            })
            .collect();
        assert!(
            leftovers.is_empty(),
            "round {round}: left after the restart: {leftovers:?}"
        );
    }
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    wait_indexed(&ctl);
    daemon.stop();
    println!("{rounds} kills during merges: {old_chain} restarts on the old chain, {new_chain} on the new one, {cleaned} leftover files removed at restarts");
    reference.verify_files(&top, tmp.path());
}

/// Five layers made by qemu-img / qemu-io, 4 MiB of data each; the top.
fn qemu_chain(dir: &Path) -> PathBuf {
    let mut prev: Option<PathBuf> = None;
    for i in 0..5 {
        let path = dir.join(format!("q{i}.qcow2"));
        match &prev {
            None => common::qemu_img(&["create", "-q", "-f", "qcow2", s(&path), "64M"]),
            Some(p) => {
                common::qemu_overlay(
                    &path,
                    p.file_name().unwrap().to_str().unwrap(),
                    "qcow2",
                    &[],
                    None,
                );
                String::new()
            }
        };
        common::qemu_io(&path, &[format!("write -P {} {} 4M", i + 1, i * (4 << 20))]);
        prev = Some(path);
    }
    prev.unwrap()
}

/// A chain made by QEMU (no sQcow2 bit on its layers: the merge file's
/// own index build marks them while the daemon holds their locks), a
/// merge file outside the backing root, a zero rate, a cancelled merge.
#[test]
fn refusals_cancel_and_a_chain_made_by_qemu() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let top = qemu_chain(dir);
    let reference = Reference::new(&top, dir, BLOCK);
    let ctl = dir.join("control.sock");
    let mut daemon = Daemon::start(dir, &top, &["--control", s(&ctl)]);
    let elsewhere = tempfile::tempdir().unwrap();
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 1, "last": 3, "path": elsewhere.path().join("m.qcow2")}),
    );
    assert_eq!(r["error"]["kind"], "merge-failed", "{r}");
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 1, "last": 3, "path": dir.join("m.qcow2"), "rate-limit": 0}),
    );
    assert_eq!(r["error"]["kind"], "bad-request", "{r}");
    // A slow merge, cancelled: the chain stays, the file goes.
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 1, "last": 3, "path": dir.join("m.qcow2"), "rate-limit": 1 << 20}),
    );
    assert_eq!(r["ok"], true, "{r}");
    std::thread::sleep(Duration::from_millis(300));
    let r = control(&ctl, json!({"command": "merge-cancel"}));
    assert_eq!(r["result"]["cancelled"], true, "{r}");
    let m = wait_job_ended(&ctl, 60);
    assert_eq!(m["state"], "cancelled", "{m}");
    assert_eq!(served_layers(&ctl).len(), 5);
    assert!(!dir.join("m.qcow2").exists() && !dir.join("m.qcow2.sqtmp").exists());
    // The same merge to the end: the layers below it carry no sQcow2 bit.
    merge_to_the_end(&ctl, 1, 3, &dir.join("m.qcow2"));
    assert_eq!(served_layers(&ctl).len(), 3);
    let mut client = connect_retry(&daemon, 1, false);
    reference.verify_through(&mut client, "after the merge");
    drop(client);
    wait_indexed(&ctl);
    daemon.stop();
    reference.verify_for_qemu(&top, dir);
}

/// A handover while a merge copies: the inactivation stops the merge
/// (reported cancelled, not failed; its file gone by the reply), so
/// nothing of it is left for the next owner, which writes the chain; the
/// daemon, activated again, merges to the end and serves that owner's
/// writes.
#[test]
fn inactivating_cancels_a_running_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let top = qemu_chain(dir);
    let mut reference = Reference::new(&top, dir, BLOCK);
    let ctl = dir.join("control.sock");
    let mut daemon = Daemon::start(dir, &top, &["--control", s(&ctl)]);
    let merged = dir.join("m.qcow2");
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 1, "last": 3, "path": merged, "rate-limit": 1 << 20}),
    );
    assert_eq!(r["ok"], true, "{r}");
    std::thread::sleep(Duration::from_millis(300));
    let r = control(&ctl, json!({"command": "inactivate"}));
    assert_eq!(r["result"]["active"], false, "{r}");
    let m = control(&ctl, json!({"command": "stats"}))["result"]["merge"].clone();
    assert_eq!(m["state"], "cancelled", "{m}");
    assert!(
        m["error"].as_str().unwrap_or("").contains("inactivated"),
        "{m}"
    );
    for leftover in [
        "m.qcow2",
        "m.qcow2.sqtmp",
        "m.qcow2.sqidx",
        "m.qcow2.sqtmp.sqjournal",
    ] {
        assert!(
            !dir.join(leftover).exists(),
            "{leftover} outlived the inactivation"
        );
    }
    // The next owner writes the top (it needs the write lock).
    common::qemu_io(&top, &["write -P 0x77 0 64k".to_string()]);
    for b in 0..(64 << 10) / BLOCK {
        reference.wrote(b * BLOCK, 0x77);
    }
    let r = control(&ctl, json!({"command": "activate"}));
    assert_eq!(r["result"]["active"], true, "{r}");
    merge_to_the_end(&ctl, 1, 3, &merged);
    assert_eq!(served_layers(&ctl).len(), 3);
    let mut client = connect_retry(&daemon, 1, false);
    reference.verify_through(&mut client, "after the handover and the merge");
    drop(client);
    daemon.stop();
    // (A chain made by QEMU names no index: none is built.)
    reference.verify_for_qemu(&top, dir);
}

/// A live merge rebuilds the indexes it makes stale (the merge file's
/// own, the top's after the switch): the stale index it meets on the
/// way is expected, not a warning for the operator. Merges above the
/// base and of the base itself; the daemon logs no WARN.
#[test]
fn live_merges_warn_of_nothing_they_rebuild() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let top = gen_chain(dir, 6, "64M", "0.5");
    let ctl = dir.join("control.sock");
    let mut daemon = Daemon::start(dir, &top, &["--control", s(&ctl)]);
    wait_indexed(&ctl);
    for (first, last, name) in [(1, 3, "m.qcow2"), (0, 1, "m0.qcow2")] {
        merge_to_the_end(&ctl, first, last, &dir.join(name));
        wait_indexed(&ctl);
    }
    assert_eq!(served_layers(&ctl).len(), 3);
    daemon.stop();
    let log = daemon.log();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ")).collect();
    assert!(warnings.is_empty(), "{warnings:#?}");
}
