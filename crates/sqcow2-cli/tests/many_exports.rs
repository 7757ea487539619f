//! One daemon serving several disks (`serve --export ...` repeated, and
//! `export-add` / `export-remove` over the control socket): each export
//! reads and writes its own chain over a shared base while the others
//! come and go; a removed export's completed writes are all in its file;
//! bad exports are refused with the others serving on; a kill -9 of the
//! daemon loses no completed write of any export. Checked with libblkio
//! clients, `qemu-img check` and `qemu-io` reads.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::vhost::{connect_retry_to, Client, Daemon};
use common::{assert_check_clean, qemu_img, s};
use serde_json::json;

const BLOCK: usize = 64 << 10;
/// Blocks each writer cycles through (the first 4 MiB of the disk).
const BLOCKS: u64 = 64;
/// What the base holds everywhere.
const BASE_FILL: u8 = 0x21;

/// `base.qcow2` (32 MiB of [`BASE_FILL`]) and an overlay on it per name.
fn chains(dir: &Path, names: &[&str]) -> Vec<PathBuf> {
    let base = dir.join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "32M"]);
    common::qemu_io(&base, &[format!("write -P {BASE_FILL} 0 32M")]);
    names
        .iter()
        .map(|n| {
            let top = dir.join(format!("{n}.qcow2"));
            common::qemu_overlay(&top, "base.qcow2", "qcow2", &[], None);
            top
        })
        .collect()
}

fn export_arg(dir: &Path, id: &str) -> [String; 2] {
    [
        "--export".into(),
        format!(
            "socket={},image={},id={id}",
            s(&dir.join(format!("{id}.sock"))),
            s(&dir.join(format!("{id}.qcow2")))
        ),
    ]
}

/// The fill of write `round` of `block` by the writer `who`: never the
/// base's, never another writer's.
fn fill(who: u8, block: u64, round: u64) -> u8 {
    let f = who.wrapping_mul(61) ^ (block as u8).wrapping_mul(7) ^ (round as u8).wrapping_mul(13);
    if f == BASE_FILL {
        f ^ 0x80
    } else {
        f
    }
}

/// What a writer saw: every write completed, as `(block, fill)` in
/// order, and the one sent last if its completion never came (the
/// export went away: it may be in the file or not).
struct Written {
    done: Vec<(u64, u8)>,
    unanswered: Option<(u64, u8)>,
}

impl Written {
    /// Whether `got` (block `b`) holds what the writes leave there.
    fn holds(&self, b: u64, got: &[u8]) -> bool {
        let want = last_fills(&self.done).get(&b).copied().unwrap_or(BASE_FILL);
        let uniform = |f: u8| got.iter().all(|x| *x == f);
        uniform(want) || self.unanswered.is_some_and(|(ub, f)| ub == b && uniform(f))
    }
}

/// How long a request of a writer may take before it takes the export
/// for gone.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Writes and reads back blocks of `client` until `stop`, or until a
/// request fails or gets no answer (the export went away).
fn writer(mut client: Client, who: u8, stop: Arc<AtomicBool>) -> Written {
    let mut done = Vec::new();
    let mut round = 0;
    while !stop.load(Ordering::Relaxed) {
        for block in 0..BLOCKS {
            let f = fill(who, block, round);
            match client.try_write_within(block * BLOCK as u64, &vec![f; BLOCK], ANSWER_WITHIN) {
                Some(0) => done.push((block, f)),
                // Failed, or never answered: either way perhaps written.
                _ => {
                    return Written {
                        done,
                        unanswered: Some((block, f)),
                    }
                }
            }
            match client.try_read_within(block * BLOCK as u64, BLOCK, ANSWER_WITHIN) {
                Some(Ok(back)) => {
                    assert!(
                        back.iter().all(|b| *b == f),
                        "writer {who}: block {block} torn"
                    )
                }
                _ => {
                    return Written {
                        done,
                        unanswered: None,
                    }
                }
            }
            if stop.load(Ordering::Relaxed) {
                break;
            }
        }
        round += 1;
    }
    Written {
        done,
        unanswered: None,
    }
}

/// The last fill written to each block.
fn last_fills(done: &[(u64, u8)]) -> std::collections::BTreeMap<u64, u8> {
    done.iter().copied().collect()
}

/// `qemu-io` reads every block as `expected` says (the base's fill where
/// nothing was written).
fn assert_reads(top: &Path, expected: &std::collections::BTreeMap<u64, u8>) {
    let cmds: Vec<String> = (0..BLOCKS)
        .map(|b| {
            let f = expected.get(&b).copied().unwrap_or(BASE_FILL);
            format!("read -P {f} {} {BLOCK}", b * BLOCK as u64)
        })
        .collect();
    common::qemu_io(top, &cmds);
}

/// Every block of `top`, as `qemu-img convert` reads it, holds what
/// `written` leaves there.
fn assert_written(top: &Path, dir: &Path, written: &Written) {
    let raw = common::qemu_raw(top, dir);
    for b in 0..BLOCKS {
        let at = (b as usize) * BLOCK;
        assert!(
            written.holds(b, &raw[at..at + BLOCK]),
            "{}: block {b} reads {:#x}",
            top.display(),
            raw[at]
        );
    }
}

fn request(daemon: &Daemon, ctl: &Path, req: serde_json::Value) -> serde_json::Value {
    daemon.control(ctl, req)
}

fn error_kind(reply: &serde_json::Value) -> &str {
    assert_eq!(reply["ok"], false, "expected a refusal: {reply}");
    reply["error"]["kind"].as_str().unwrap_or_default()
}

/// Two exports from the start, a third added and the second removed while
/// the first is written to: each reads its own writes over the shared
/// base, the removed one's completed writes are all in its file, every
/// chain checks clean.
#[test]
fn exports_serve_side_by_side_and_come_and_go_under_load() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tops = chains(d, &["a", "b", "c"]);
    let ctl = d.join("ctl.sock");
    let mut args = vec!["--control".to_string(), s(&ctl).to_string()];
    args.extend(export_arg(d, "a"));
    args.extend(export_arg(d, "b"));
    let mut daemon = Daemon::start_args(d, &args);

    let list = request(&daemon, &ctl, json!({"command": "export-list"}));
    let ids: Vec<&str> = list["result"]["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a", "b"], "{list}");

    // Requests about one disk name it once several are served.
    let info = request(&daemon, &ctl, json!({"command": "info"}));
    assert_eq!(error_kind(&info), "bad-request");
    assert!(
        info["error"]["message"]
            .as_str()
            .unwrap()
            .contains("name one"),
        "{info}"
    );
    let info = request(&daemon, &ctl, json!({"command": "info", "export": "b"}));
    assert_eq!(info["result"]["top"], json!(s(&tops[1])), "{info}");
    let info = request(&daemon, &ctl, json!({"command": "info", "export": "zz"}));
    assert_eq!(error_kind(&info), "bad-request");

    let stop_a = Arc::new(AtomicBool::new(false));
    let a = connect_retry_to(&daemon, &d.join("a.sock"), 1, false);
    let a_writer = std::thread::spawn({
        let stop = stop_a.clone();
        move || writer(a, 1, stop)
    });
    let b = connect_retry_to(&daemon, &d.join("b.sock"), 1, false);
    let b_writer = std::thread::spawn({
        let stop = Arc::new(AtomicBool::new(false));
        move || writer(b, 2, stop)
    });
    std::thread::sleep(Duration::from_millis(300));

    // A third export joins while both are written to.
    let added = request(
        &daemon,
        &ctl,
        json!({"command": "export-add", "export": "c", "socket": s(&d.join("c.sock")),
               "image": s(&tops[2])}),
    );
    assert_eq!(added["ok"], true, "{added}\n{}", daemon.log());
    assert_eq!(added["result"]["layers"], 2, "{added}");
    let mut c = connect_retry_to(&daemon, &d.join("c.sock"), 1, false);
    c.write(0, &vec![0x5c; BLOCK]);
    assert!(c.read(0, BLOCK).iter().all(|b| *b == 0x5c));
    assert!(
        c.read(BLOCK as u64, BLOCK).iter().all(|b| *b == BASE_FILL),
        "export c reads the shared base below its top"
    );

    // The second goes while its guest writes: its requests finish or fail,
    // and every write completed is in its file.
    let removed = request(
        &daemon,
        &ctl,
        json!({"command": "export-remove", "export": "b"}),
    );
    assert_eq!(removed["ok"], true, "{removed}\n{}", daemon.log());
    let b_done = b_writer.join().unwrap();
    assert!(
        b_done.done.len() > 10,
        "the writer of b wrote {} blocks",
        b_done.done.len()
    );
    assert!(
        !d.join("b.sock").exists(),
        "the removed export's socket is left"
    );
    // Closed clean: no other process holds it, it checks clean and reads
    // as its guest wrote.
    assert_check_clean(&tops[1]);
    assert_written(&tops[1], d, &b_done);
    let list = request(&daemon, &ctl, json!({"command": "export-list"}));
    assert_eq!(
        list["result"]["exports"].as_array().unwrap().len(),
        2,
        "{list}"
    );
    let gone = request(&daemon, &ctl, json!({"command": "stats", "export": "b"}));
    assert_eq!(error_kind(&gone), "bad-request");

    // The first wrote on through all of it.
    std::thread::sleep(Duration::from_millis(200));
    stop_a.store(true, Ordering::Relaxed);
    let a_done = a_writer.join().unwrap();
    assert!(a_done.unanswered.is_none(), "a's writer failed");
    assert!(
        a_done.done.len() > b_done.done.len() / 2,
        "a: {} writes",
        a_done.done.len()
    );
    let stats = request(&daemon, &ctl, json!({"command": "stats", "export": "a"}));
    assert_eq!(stats["result"]["queues"][0]["errors"], 0, "{stats}");
    // The base is opened once for the chains that share it.
    assert_eq!(stats["result"]["shared-layers"]["files"], 1, "{stats}");
    assert!(
        !daemon.log().contains("cannot be indexed"),
        "a chain could not mark the shared base:\n{}",
        daemon.log()
    );
    drop(c);
    daemon.stop();
    for top in &tops {
        assert_check_clean(top);
    }
    assert_reads(&tops[0], &last_fills(&a_done.done));
    let mut c_expected = std::collections::BTreeMap::new();
    c_expected.insert(0, 0x5c);
    assert_reads(&tops[2], &c_expected);
}

/// What the daemon refuses, at its start and over the control socket,
/// each with an error saying why, the served export reading on.
#[test]
fn bad_exports_are_refused_and_the_others_serve() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tops = chains(d, &["a", "b"]);
    let refused = |args: &[String], why: &str| {
        let out = common::run_raw(
            std::process::Command::new(common::sqcow2_bin())
                .arg("serve")
                .args(args),
        );
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{args:?} started");
        assert!(err.contains(why), "{args:?}: {err}");
    };
    let a = export_arg(d, "a");
    let twice_socket = format!("socket={},image={},id=b", s(&d.join("a.sock")), s(&tops[1]));
    refused(
        &[a[0].clone(), a[1].clone(), "--export".into(), twice_socket],
        "socket is taken by export a",
    );
    let twice_image = format!("socket={},image={},id=b", s(&d.join("b.sock")), s(&tops[0]));
    refused(
        &[a[0].clone(), a[1].clone(), "--export".into(), twice_image],
        "serves this image already for writing",
    );
    refused(
        &["--export".into(), format!("{},colour=red", a[1])],
        "unknown key \"colour\"",
    );
    refused(
        &["--export".into(), format!("{},id=a,id=b", a[1])],
        "given twice",
    );
    assert!(
        !d.join("a.sock").exists(),
        "a refused start left its socket"
    );

    let ctl = d.join("ctl.sock");
    let mut args = vec![
        "--control".to_string(),
        s(&ctl).to_string(),
        "--max-exports".into(),
        "3".into(),
    ];
    args.extend(export_arg(d, "a"));
    let mut daemon = Daemon::start_args(d, &args);
    let mut client = connect_retry_to(&daemon, &d.join("a.sock"), 1, false);
    client.write(0, &vec![0x77; BLOCK]);

    let add = |extra: serde_json::Value| {
        let mut req = json!({"command": "export-add"});
        for (k, v) in extra.as_object().unwrap() {
            req[k] = v.clone();
        }
        request(&daemon, &ctl, req)
    };
    let sock = |n: &str| s(&d.join(n)).to_string();
    let garbage = d.join("garbage.qcow2");
    std::fs::write(&garbage, vec![0xa5u8; 1 << 20]).unwrap();
    for (req, kind) in [
        (
            json!({"export": "x", "socket": sock("x.sock"), "image": s(&tops[1]), "colour": 1}),
            "bad-request",
        ),
        (
            json!({"export": "x", "socket": sock("x.sock")}),
            "bad-request",
        ),
        (
            json!({"export": "a", "socket": sock("x.sock"), "image": s(&tops[1])}),
            "exists",
        ),
        (
            json!({"export": "x", "socket": sock("a.sock"), "image": s(&tops[1])}),
            "exists",
        ),
        (
            json!({"export": "x", "socket": sock("x.sock"), "image": s(&tops[0])}),
            "exists",
        ),
        (
            json!({"export": "x/y", "socket": sock("x.sock"), "image": s(&tops[1])}),
            "bad-request",
        ),
        (
            json!({"export": "x", "socket": sock("x.sock"), "image": s(&garbage)}),
            "io-error",
        ),
        (
            json!({"export": "x", "socket": sock("x.sock"), "image": s(&d.join("none.qcow2"))}),
            "bad-request",
        ),
        (
            json!({"export": "x", "socket": sock("x.sock"), "image": s(&tops[1]), "num-queues": 0}),
            "bad-request",
        ),
    ] {
        let reply = add(req.clone());
        assert_eq!(error_kind(&reply), kind, "{req}: {reply}");
        assert!(!d.join("x.sock").exists(), "{req}: left its socket");
    }
    // The export being written names it in its refusal.
    let reply = add(json!({"export": "x", "socket": sock("x.sock"), "image": s(&tops[0])}));
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("export a"),
        "{reply}"
    );
    // Read-only twice is fine; the most exports is not passed.
    for id in ["r1", "r2"] {
        let reply = add(json!({"export": id, "socket": sock(&format!("{id}.sock")),
                                "image": s(&tops[1]), "read-only": true}));
        assert_eq!(reply["ok"], true, "{reply}\n{}", daemon.log());
    }
    let reply = add(
        json!({"export": "r3", "socket": sock("r3.sock"), "image": s(&tops[1]),
                            "read-only": true}),
    );
    assert_eq!(error_kind(&reply), "exists", "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("most exports"),
        "{reply}"
    );
    let reply = request(
        &daemon,
        &ctl,
        json!({"command": "export-remove", "export": "nope"}),
    );
    assert_eq!(error_kind(&reply), "bad-request");
    let reply = request(
        &daemon,
        &ctl,
        json!({"command": "export-list", "export": "a"}),
    );
    assert_eq!(error_kind(&reply), "bad-request");
    let mut r1 = connect_retry_to(&daemon, &d.join("r1.sock"), 1, true);
    assert!(r1.read(0, BLOCK).iter().all(|b| *b == BASE_FILL));
    assert_ne!(
        r1.try_write(0, &vec![1; BLOCK]),
        0,
        "a read-only export took a write"
    );

    // The first export served through all of it.
    assert!(client.read(0, BLOCK).iter().all(|b| *b == 0x77));
    drop((client, r1));
    daemon.stop();
    assert_check_clean(&tops[0]);
    assert_check_clean(&tops[1]);
}

/// kill -9 of a daemon serving four exports, each written to: after a
/// restart each export reads every write its guest saw completed.
#[test]
fn a_killed_daemon_keeps_every_completed_write_of_every_export() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let names = ["a", "b", "c", "e"];
    let tops = chains(d, &names);
    let args: Vec<String> = names.iter().flat_map(|n| export_arg(d, n)).collect();
    let mut daemon = Daemon::start_args(d, &args);
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let client = connect_retry_to(&daemon, &d.join(format!("{n}.sock")), 1, false);
            let stop = stop.clone();
            std::thread::spawn(move || writer(client, i as u8 + 1, stop))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(700));
    // The writers stop (libblkio would wait for ever on a daemon gone),
    // with nothing flushed; then the kill.
    stop.store(true, Ordering::Relaxed);
    let written: Vec<Written> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    let _ = daemon.stop_with(libc::SIGKILL);

    let mut daemon = Daemon::start_args(d, &args);
    for (i, n) in names.iter().enumerate() {
        assert!(
            written[i].done.len() > 5,
            "export {n}: {} writes",
            written[i].done.len()
        );
        let mut client = connect_retry_to(&daemon, &d.join(format!("{n}.sock")), 1, false);
        for b in 0..BLOCKS {
            let got = client.read(b * BLOCK as u64, BLOCK);
            assert!(
                written[i].holds(b, &got),
                "export {n}: block {b} reads {:#x}",
                got[0]
            );
        }
    }
    daemon.stop();
    for top in &tops {
        assert_check_clean(top);
    }
}

/// A hostile frontend on one export (garbage for messages, a header
/// announcing more than any message holds, a connection dropped in the
/// middle of a message) ends its own connections only: the other
/// export's guest writes on without an error, and the hostile one's
/// socket takes a proper frontend afterwards.
#[test]
fn a_hostile_frontend_on_one_export_leaves_the_others_serving() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tops = chains(d, &["a", "b"]);
    // One worker thread for both: the hostile frontend's sessions and the
    // guest's requests go through the same thread.
    let mut args = vec!["--worker-threads".to_string(), "1".into()];
    args.extend(export_arg(d, "a"));
    args.extend(export_arg(d, "b"));
    let mut daemon = Daemon::start_args(d, &args);
    let stop = Arc::new(AtomicBool::new(false));
    let a = connect_retry_to(&daemon, &d.join("a.sock"), 1, false);
    let a_writer = std::thread::spawn({
        let stop = stop.clone();
        move || writer(a, 1, stop)
    });
    let hostile = |bytes: &[u8], close_early: bool| {
        let mut s = UnixStream::connect(d.join("b.sock")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(bytes);
        if close_early {
            return;
        }
        // The daemon hangs up on it (EOF or a reset), within the timeout.
        let mut rest = Vec::new();
        let r = s.read_to_end(&mut rest);
        assert!(
            !matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "the daemon kept a garbage connection open"
        );
    };
    let mut garbage = vec![0u8; 4096];
    for (i, b) in garbage.iter_mut().enumerate() {
        *b = (i * 131 % 251) as u8;
    }
    hostile(&garbage, false);
    // GET_FEATURES (1), flags 0x1, a payload of 4 GiB - 1 announced.
    let mut huge = Vec::new();
    huge.extend(1u32.to_le_bytes());
    huge.extend(1u32.to_le_bytes());
    huge.extend(u32::MAX.to_le_bytes());
    hostile(&huge, false);
    // SET_MEM_TABLE (5) announcing a payload, then gone.
    let mut cut = Vec::new();
    cut.extend(5u32.to_le_bytes());
    cut.extend(1u32.to_le_bytes());
    cut.extend(40u32.to_le_bytes());
    cut.extend([0u8; 8]);
    hostile(&cut, true);

    let mut b = connect_retry_to(&daemon, &d.join("b.sock"), 1, false);
    b.write(0, &vec![0x6b; BLOCK]);
    assert!(b.read(0, BLOCK).iter().all(|x| *x == 0x6b));
    assert!(b.read(BLOCK as u64, BLOCK).iter().all(|x| *x == BASE_FILL));
    drop(b);
    stop.store(true, Ordering::Relaxed);
    let a_done = a_writer.join().unwrap();
    assert!(a_done.unanswered.is_none(), "a's guest saw an error");
    assert!(
        a_done.done.len() > 10,
        "a wrote {} blocks",
        a_done.done.len()
    );
    daemon.stop();
    for top in &tops {
        assert_check_clean(top);
    }
    assert_reads(&tops[0], &last_fills(&a_done.done));
}

/// The `queue-worker-N` threads of daemon `pid`.
fn queue_worker_threads(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter(|t| {
            let comm = t.as_ref().unwrap().path().join("comm");
            std::fs::read_to_string(comm).is_ok_and(|c| c.starts_with("queue-worker-"))
        })
        .count()
}

/// The worker threads export `id` is served by, as `export-list` says.
fn worker_threads_of(list: &serde_json::Value, id: &str) -> Vec<u64> {
    let e = list["result"]["exports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == id)
        .unwrap_or_else(|| panic!("{id} not listed: {list}"));
    let mut t: Vec<u64> = e["worker-threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    t.sort_unstable();
    t
}

/// Four exports written at once by their guests on a daemon of two
/// worker threads: two threads serve them all (not one per export), and
/// an export removed and another of two queues added on those threads
/// while the others write leave every completed write where its guest
/// put it, the others' guests seeing no error.
#[test]
fn exports_share_the_daemons_worker_threads() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ids = ["a", "b", "c", "d", "e"];
    let tops = chains(d, &ids);
    let ctl = d.join("ctl.sock");
    let mut args = vec![
        "--control".to_string(),
        s(&ctl).to_string(),
        "--worker-threads".into(),
        "2".into(),
    ];
    for id in &ids[..4] {
        args.extend(export_arg(d, id));
    }
    let mut daemon = Daemon::start_args(d, &args);
    let mut writers = Vec::new();
    let mut stops = Vec::new();
    for (who, id) in ids[..4].iter().enumerate() {
        let client = connect_retry_to(&daemon, &d.join(format!("{id}.sock")), 1, false);
        let stop = Arc::new(AtomicBool::new(false));
        stops.push(stop.clone());
        writers.push(std::thread::spawn(move || {
            writer(client, who as u8 + 1, stop)
        }));
    }
    std::thread::sleep(Duration::from_millis(300));
    let list = request(&daemon, &ctl, json!({"command": "export-list"}));
    let mut used = std::collections::BTreeSet::new();
    for id in &ids[..4] {
        let t = worker_threads_of(&list, id);
        assert_eq!(t.len(), 1, "{id}: {list}");
        assert!(t[0] < 2, "{id} on a thread past --worker-threads: {list}");
        used.extend(t);
    }
    assert_eq!(used.len(), 2, "the exports are not spread: {list}");
    assert_eq!(
        queue_worker_threads(daemon.pid()),
        2,
        "queue-worker threads of four exports"
    );

    // One goes and another comes, the threads busy with the rest.
    let removed = request(
        &daemon,
        &ctl,
        json!({"command": "export-remove", "export": "b"}),
    );
    assert_eq!(removed["ok"], true, "{removed}\n{}", daemon.log());
    stops[1].store(true, Ordering::Relaxed);
    let b_done = writers.remove(1).join().unwrap();
    stops.remove(1);
    assert_written(&tops[1], d, &b_done);
    let added = request(
        &daemon,
        &ctl,
        json!({"command": "export-add", "export": "e", "socket": s(&d.join("e.sock")),
               "image": s(&tops[4]), "num-queues": 2}),
    );
    assert_eq!(added["ok"], true, "{added}\n{}", daemon.log());
    let mut e = connect_retry_to(&daemon, &d.join("e.sock"), 2, false);
    e.write(0, &vec![0x5e; BLOCK]);
    assert!(e.read(0, BLOCK).iter().all(|x| *x == 0x5e));
    assert!(e.read(BLOCK as u64, BLOCK).iter().all(|x| *x == BASE_FILL));
    let list = request(&daemon, &ctl, json!({"command": "export-list"}));
    assert_eq!(
        worker_threads_of(&list, "e"),
        [0, 1],
        "the two queues of e on one thread: {list}"
    );
    assert_eq!(queue_worker_threads(daemon.pid()), 2);

    std::thread::sleep(Duration::from_millis(200));
    for stop in &stops {
        stop.store(true, Ordering::Relaxed);
    }
    let done: Vec<Written> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    drop(e);
    daemon.stop();
    for (written, top) in done.iter().zip([&tops[0], &tops[2], &tops[3]]) {
        assert!(
            written.unanswered.is_none(),
            "{}: its guest saw an error",
            top.display()
        );
        assert!(
            written.done.len() > 10,
            "{}: {} writes",
            top.display(),
            written.done.len()
        );
        assert_check_clean(top);
        assert_reads(top, &last_fills(&written.done));
    }
    assert_check_clean(&tops[4]);
}

/// The daemon out of file descriptors (its soft limit lowered to the
/// lowest free one) when a frontend dials one export: that frontend is
/// not served, and once descriptors are free again the export serves the
/// next, the other export serving throughout. (An export used to end for
/// good on any error setting up a session.)
#[test]
fn an_export_out_of_file_descriptors_serves_the_next_frontend() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tops = chains(d, &["a", "b"]);
    let mut args = Vec::new();
    args.extend(export_arg(d, "a"));
    args.extend(export_arg(d, "b"));
    let mut daemon = Daemon::start_args(d, &args);
    let mut b = connect_retry_to(&daemon, &d.join("b.sock"), 1, false);
    let pid = daemon.pid();
    let prlimit = |soft: &str| {
        let out = common::run_raw(
            std::process::Command::new("prlimit")
                .arg("--pid")
                .arg(pid.to_string())
                .arg(format!("--nofile={soft}:")),
        );
        assert!(out.status.success(), "prlimit: {out:?}");
    };
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let soft: String = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .unwrap()
        .to_string();
    let open: std::collections::BTreeSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_str().unwrap().parse().unwrap())
        .collect();
    let lowest_free = (0..).find(|n| !open.contains(n)).unwrap();
    prlimit(&lowest_free.to_string());
    {
        // Dialled while the daemon can open nothing: not served.
        let mut refused = std::os::unix::net::UnixStream::connect(d.join("a.sock")).unwrap();
        use std::io::Write;
        let _ = refused.write_all(&[0u8; 12]);
        std::thread::sleep(Duration::from_millis(1500));
    }
    prlimit(&soft);
    // The export serves the next frontend.
    let mut a = connect_retry_to(&daemon, &d.join("a.sock"), 1, false);
    a.write(0, &vec![0x4a; BLOCK]);
    assert!(a.read(0, BLOCK).iter().all(|x| *x == 0x4a));
    b.write(0, &vec![0x4b; BLOCK]);
    assert!(b.read(0, BLOCK).iter().all(|x| *x == 0x4b));
    assert!(
        daemon.log().contains("could not be served"),
        "no frontend refused:\n{}",
        daemon.log()
    );
    drop((a, b));
    daemon.stop();
    for (top, fill) in tops.iter().zip([0x4a, 0x4b]) {
        assert_check_clean(top);
        let mut expected = std::collections::BTreeMap::new();
        expected.insert(0, fill);
        assert_reads(top, &expected);
    }
}

/// Exports from a `--config` file (paths relative to it) beside one
/// given with `--export`; a file with an unknown key is refused.
#[test]
fn exports_come_from_a_config_file_too() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tops = chains(d, &["a", "b", "c"]);
    let config = d.join("exports.json");
    std::fs::write(
        &config,
        json!({"exports": [
            {"socket": "a.sock", "image": "a.qcow2", "id": "a", "num-queues": 2},
            {"socket": "b.sock", "image": "b.qcow2", "id": "b", "read-only": true,
             "iops-total": 1000},
        ]})
        .to_string(),
    )
    .unwrap();
    let ctl = d.join("ctl.sock");
    let mut args = vec![
        "--control".to_string(),
        s(&ctl).to_string(),
        "--config".into(),
        s(&config).to_string(),
    ];
    args.extend(export_arg(d, "c"));
    let mut daemon = Daemon::start_args(d, &args);
    let list = request(&daemon, &ctl, json!({"command": "export-list"}));
    let exports = list["result"]["exports"].as_array().unwrap();
    assert_eq!(exports.len(), 3, "{list}");
    assert_eq!(exports[0]["num-queues"], 2, "{list}");
    assert_eq!(exports[1]["read-only"], true, "{list}");
    let stats = request(&daemon, &ctl, json!({"command": "stats", "export": "b"}));
    assert_eq!(
        stats["result"]["throttle"]["limits"]["iops-total"], 1000,
        "{stats}"
    );
    let mut a = connect_retry_to(&daemon, &d.join("a.sock"), 2, false);
    a.write(0, &vec![0x3a; BLOCK]);
    let mut b = connect_retry_to(&daemon, &d.join("b.sock"), 1, true);
    assert!(b.read(0, BLOCK).iter().all(|x| *x == BASE_FILL));
    drop((a, b));
    daemon.stop();
    assert_check_clean(&tops[0]);

    std::fs::write(
        &config,
        json!({"exports": [{"socket": "a.sock", "image": "a.qcow2", "colour": "red"}]}).to_string(),
    )
    .unwrap();
    let out = common::run_raw(
        std::process::Command::new(common::sqcow2_bin())
            .args(["serve", "--config"])
            .arg(&config),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown key \"colour\"") && err.contains("export 0"),
        "{err}"
    );
}

/// The CLI's side of it: `sqcow2 export add|list|remove`,
/// `set-io-throttle` and `stats` with `--export-id`, as an operator types
/// them.
#[test]
fn the_cli_adds_lists_limits_and_removes_exports() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    chains(d, &["a", "b"]);
    let ctl = d.join("ctl.sock");
    let mut args = vec!["--control".to_string(), s(&ctl).to_string()];
    args.extend(export_arg(d, "a"));
    let mut daemon = Daemon::start_args(d, &args);
    let json_of = |args: &[&str]| -> serde_json::Value {
        serde_json::from_str(&common::sqcow2(args)).expect("JSON output")
    };
    let added = json_of(&[
        "export",
        "add",
        "--output",
        "json",
        "--id",
        "b",
        "--socket",
        s(&d.join("b.sock")),
        "--limits",
        "iops-total=300",
        s(&ctl),
        s(&d.join("b.qcow2")),
    ]);
    assert_eq!(added["id"], "b", "{added}");
    let list = json_of(&["export", "list", "--output", "json", s(&ctl)]);
    assert_eq!(list["exports"].as_array().unwrap().len(), 2, "{list}");
    let set = json_of(&[
        "set-io-throttle",
        "--export-id",
        "b",
        "--output",
        "json",
        s(&ctl),
        "bps-read=4096000",
    ]);
    assert_eq!(set["limits"]["bps-read"], 4096000, "{set}");
    let stats = json_of(&["stats", "--export-id", "b", "--output", "json", s(&ctl)]);
    assert_eq!(stats["throttle"]["limits"]["bps-read"], 4096000, "{stats}");
    // Without --export-id, a per-disk command is refused naming the way.
    let out =
        common::run_raw(std::process::Command::new(common::sqcow2_bin()).args(["stats", s(&ctl)]));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("name one"));
    let bad = common::run_raw(std::process::Command::new(common::sqcow2_bin()).args([
        "set-io-throttle",
        "--export-id",
        "b",
        s(&ctl),
        "iops-total=5,iops-read=5",
    ]));
    assert!(!bad.status.success(), "QEMU's refusal not made");
    let removed = json_of(&["export", "remove", "--output", "json", s(&ctl), "b"]);
    assert_eq!(removed["id"], "b", "{removed}");
    assert!(!d.join("b.sock").exists());
    daemon.stop();
}
