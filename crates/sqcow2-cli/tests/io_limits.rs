//! I/O limits (QEMU's throttle options on `--export`, `--limits`,
//! `set-io-throttle`): a limited export completes about its limit over a
//! window whatever the client asks, an unlimited neighbour in the same
//! daemon runs far past it, a group's exports share one limit, limits
//! change live, a throttled request waits and never fails, and a stop
//! finishes the requests waiting for the limits. Driven by libblkio
//! clients (`sqcow2-bench load`); the windows are long against the
//! buckets' bursts, and every bound leaves a wide margin (the limits are
//! far below what this machine serves).

mod common;

use std::path::Path;
use std::time::Duration;

use common::vhost::{connect_retry_to, Daemon};
use common::{assert_check_clean, qemu_img, s};
use serde_json::json;

/// `sqcow2-bench load` of 4 KiB random reads (or `pattern`) at depth 8
/// on `socket` for `seconds`: (requests completed, errors).
fn load(socket: &Path, pattern: &str, seconds: f64) -> (u64, u64) {
    let out = common::run(
        std::process::Command::new(common::sqcow2_bench_bin()).args([
            "load",
            "--socket",
            s(socket),
            "--pattern",
            pattern,
            "--iodepth",
            "8",
            "--duration",
            &seconds.to_string(),
            "--output",
            "json",
        ]),
    );
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    (
        json["ios"].as_u64().unwrap(),
        json["errors"].as_u64().unwrap(),
    )
}

fn chains(dir: &Path, names: &[&str]) {
    for n in names {
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            s(&dir.join(format!("{n}.qcow2"))),
            "64M",
        ]);
        common::qemu_io(
            &dir.join(format!("{n}.qcow2")),
            &["write -P 7 0 16M".to_string()],
        );
    }
}

fn export(dir: &Path, id: &str, extra: &str) -> [String; 2] {
    [
        "--export".into(),
        format!(
            "socket={},image={},id={id}{extra}",
            s(&dir.join(format!("{id}.sock"))),
            s(&dir.join(format!("{id}.qcow2")))
        ),
    ]
}

/// Whether `n` requests in `seconds` at a limit of `limit` per second
/// are about the limit: no more than it lets through (the bucket's tenth
/// of a second on top, and a margin), and not far less.
fn about(n: u64, limit: u64, seconds: f64) -> bool {
    let most = limit as f64 * (seconds * 1.1 + 0.2) + 10.0;
    let least = limit as f64 * seconds * 0.6;
    (least..=most).contains(&(n as f64))
}

#[test]
fn a_limited_export_runs_at_its_limit_beside_a_free_neighbour() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    chains(d, &["slow", "free"]);
    let ctl = d.join("ctl.sock");
    let mut args = vec!["--control".to_string(), s(&ctl).to_string()];
    args.extend(export(d, "slow", ",iops-total=200"));
    args.extend(export(d, "free", ""));
    let mut daemon = Daemon::start_args(d, &args);

    let slow = std::thread::spawn({
        let socket = d.join("slow.sock");
        move || load(&socket, "rand-read", 3.0)
    });
    let (free, free_errors) = load(&d.join("free.sock"), "rand-read", 3.0);
    let (limited, errors) = slow.join().unwrap();
    assert_eq!((errors, free_errors), (0, 0), "a throttled request failed");
    assert!(
        about(limited, 200, 3.0),
        "{limited} reads in 3 s at 200 IOPS"
    );
    assert!(
        free > limited * 5,
        "the neighbour did {free} beside {limited}"
    );

    let stats = daemon.control(&ctl, json!({"command": "stats", "export": "slow"}));
    let t = &stats["result"]["throttle"];
    assert_eq!(t["group"], "slow", "{stats}");
    assert_eq!(t["limits"]["iops-total"], 200, "{stats}");
    assert!(t["throttled"].as_u64().unwrap() > 100, "{stats}");
    let free_stats = daemon.control(&ctl, json!({"command": "stats", "export": "free"}));
    assert!(
        free_stats["result"].get("throttle").is_none(),
        "{free_stats}"
    );

    // Live: a new limit holds at once, in bytes too; none lifts them.
    let set = daemon.control(
        &ctl,
        json!({"command": "set-io-throttle", "export": "slow", "iops-total": 500}),
    );
    assert_eq!(set["result"]["limits"]["iops-total"], 500, "{set}");
    let (n, errors) = load(&d.join("slow.sock"), "rand-read", 2.0);
    assert!(
        errors == 0 && about(n, 500, 2.0),
        "{n} reads in 2 s at 500 IOPS"
    );
    daemon.control(
        &ctl,
        json!({"command": "set-io-throttle", "export": "slow", "bps-read": 400 * 4096}),
    );
    let (n, errors) = load(&d.join("slow.sock"), "rand-read", 2.0);
    assert!(
        errors == 0 && about(n, 400, 2.0),
        "{n} reads in 2 s at 400 x 4 KiB/s"
    );
    let lifted = daemon.control(
        &ctl,
        json!({"command": "set-io-throttle", "export": "slow"}),
    );
    assert_eq!(lifted["result"], serde_json::Value::Null, "{lifted}");
    let (n, _) = load(&d.join("slow.sock"), "rand-read", 1.0);
    assert!(n > 2000, "{n} reads in 1 s with no limit");

    // Limits QEMU refuses are refused, the export as it was.
    for bad in [
        json!({"command": "set-io-throttle", "export": "slow", "iops-total": 5, "iops-read": 5}),
        json!({"command": "set-io-throttle", "export": "slow", "iops-total-max": 5}),
        json!({"command": "set-io-throttle", "export": "slow", "iops-total": "fast"}),
        json!({"command": "set-io-throttle", "export": "slow", "iops": 5}),
        json!({"command": "set-io-throttle", "export": "slow", "iops-total": 5, "group": "a b"}),
    ] {
        let reply = daemon.control(&ctl, bad.clone());
        assert_eq!(reply["error"]["kind"], "bad-request", "{bad}: {reply}");
    }
    daemon.stop();
    assert_check_clean(&d.join("slow.qcow2"));
}

/// Two exports of one group share its limit: together about it.
#[test]
fn a_group_shares_its_limit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    chains(d, &["a", "b"]);
    let mut args = Vec::new();
    args.extend(export(d, "a", ",group=g,iops-total=300"));
    args.extend(export(d, "b", ",group=g"));
    let daemon = Daemon::start_args(d, &args);
    let a = std::thread::spawn({
        let socket = d.join("a.sock");
        move || load(&socket, "rand-read", 3.0)
    });
    let (b, b_errors) = load(&d.join("b.sock"), "rand-read", 3.0);
    let (a, a_errors) = a.join().unwrap();
    assert_eq!((a_errors, b_errors), (0, 0));
    assert!(
        about(a + b, 300, 3.0),
        "{a} + {b} reads in 3 s at 300 IOPS for the group"
    );
    assert!(a > 150 && b > 150, "one export took the group: {a} / {b}");
    drop(daemon);
}

/// A stop finishes a write waiting for the limits: it completes (long
/// before the limit would let it), is in the file, and the daemon exits
/// cleanly.
#[test]
fn a_stop_finishes_requests_waiting_for_the_limits() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    chains(d, &["w"]);
    // 4 KiB a second: after a first 64 KiB write the next waits 16 s.
    let args: Vec<String> = export(d, "w", ",bps-write=4096").into();
    let mut daemon = Daemon::start_args(d, &args);
    let mut client = connect_retry_to(&daemon, &d.join("w.sock"), 1, false);
    let first = client.try_write_within(0, &vec![0x31; 65536], Duration::from_secs(10));
    assert_eq!(first, Some(0));
    let writer = std::thread::spawn(move || {
        // Answered only if the stop lets it through (the limit would in
        // 16 s).
        let r = client.try_write_within(65536, &vec![0x32; 65536], Duration::from_secs(10));
        (r, client)
    });
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    let (r, _client) = writer.join().unwrap();
    assert_eq!(
        r,
        Some(0),
        "the waiting write failed or was not finished by the stop"
    );
    let status = daemon.stop_with(0);
    assert!(status.success(), "{status}: {}", daemon.log());
    assert_check_clean(&d.join("w.qcow2"));
    common::qemu_io(
        &d.join("w.qcow2"),
        &["read -P 0x31 0 64k".into(), "read -P 0x32 64k 64k".into()],
    );
}

/// A write waiting under a limit starts as soon as the limit is lifted
/// live (as QEMU restarts throttled requests when the limits change),
/// not when the old limit would have let it.
#[test]
fn lifting_a_limit_starts_the_request_waiting_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    chains(d, &["w"]);
    let ctl = d.join("ctl.sock");
    let mut args: Vec<String> = vec!["--control".into(), s(&ctl).into()];
    args.extend(export(d, "w", ",bps-write=4096"));
    let mut daemon = Daemon::start_args(d, &args);
    let mut client = connect_retry_to(&daemon, &d.join("w.sock"), 1, false);
    assert_eq!(
        client.try_write_within(0, &vec![0x41; 65536], Duration::from_secs(10)),
        Some(0)
    );
    let writer = std::thread::spawn(move || {
        // 16 s under the limit; the 10 s wait fails unless it is lifted.
        client.try_write_within(65536, &vec![0x42; 65536], Duration::from_secs(10))
    });
    std::thread::sleep(Duration::from_millis(300));
    let lifted = daemon.control(&ctl, json!({"command": "set-io-throttle", "export": "w"}));
    assert_eq!(lifted["ok"], true, "{lifted}");
    assert_eq!(
        writer.join().unwrap(),
        Some(0),
        "the waiting write did not start"
    );
    daemon.stop();
    common::qemu_io(
        &d.join("w.qcow2"),
        &["read -P 0x41 0 64k".into(), "read -P 0x42 64k 64k".into()],
    );
}

/// Two queues on one worker thread, notifications only (no polling):
/// while a request of the first waits for the limit, one put on the
/// second is taken once the first's has started, not left on its ring.
#[test]
fn a_queue_beside_a_waiting_one_is_not_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    chains(d, &["q"]);
    let mut args: Vec<String> = vec![
        "--poll-us".into(),
        "0".into(),
        "--queues-per-thread".into(),
        "2".into(),
    ];
    args.extend(export(d, "q", ",num-queues=2,iops-write=2"));
    let mut daemon = Daemon::start_args(d, &args);
    let mut client = connect_retry_to(&daemon, &d.join("q.sock"), 2, false);
    let ptr = client.region.addr as *const u8;
    // The bucket (a tenth of a second's worth) takes one; the second
    // waits about 0.4 s, and the third, on the other queue, after it.
    for (q, n) in [(0usize, 2usize), (1, 1)] {
        for i in 0..n {
            client.queues[q].write(
                (q * 8 + i) as u64 * 4096,
                ptr,
                4096,
                0,
                blkio::ReqFlags::empty(),
            );
        }
        // Submitted now (libblkio submits at its next do_io), waiting
        // for nothing.
        let mut none: [std::mem::MaybeUninit<blkio::Completion>; 0] = [];
        let mut zero = Duration::ZERO;
        client.queues[q]
            .do_io(&mut none, 0, Some(&mut zero), None)
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let first = client.wait(0, 2);
    let second = client.wait(1, 1);
    assert!(
        first.iter().chain(&second).all(|(_, r)| *r == 0),
        "{first:?} {second:?}"
    );
    drop(client);
    daemon.stop();
    assert_check_clean(&d.join("q.qcow2"));
}
