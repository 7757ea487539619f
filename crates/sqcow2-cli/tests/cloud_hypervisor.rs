//! `sqcow2 serve` under a real, unmodified Cloud Hypervisor v53 with the
//! mini guest of `../shared/ch/` (`run-ch.sh`): whole-disk sha256 against
//! `qemu-img convert`, writes flushed and read back, 1 and 2 queues, a
//! live snapshot and a live merge between guest commands, and a kill -9
//! and restart of the daemon while the guest runs.
//!
//! Where `../shared/ch/run-ch.sh` (or `SQCOW2_CH_DIR/run-ch.sh`) or
//! `/dev/kvm` is missing, each test says so and passes: the suite must
//! pass on a machine without them.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::vhost::{control, Daemon};
use common::{gen_chain, qemu_img, run_raw, s, sha256_file, sqcow2};

/// The Cloud Hypervisor runner, if this machine has it.
fn run_ch_script() -> Option<PathBuf> {
    let dir = std::env::var_os("SQCOW2_CH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| common::workspace_root().join("../shared/ch"));
    let script = dir.join("run-ch.sh");
    if !script.exists() || !Path::new("/dev/kvm").exists() {
        eprintln!(
            "skipped: no Cloud Hypervisor here ({} or /dev/kvm missing)",
            script.display()
        );
        return None;
    }
    Some(script)
}

/// Boots the mini guest on `socket` with `commands`; its output, which
/// must end in the guest's success.
fn run_ch(script: &Path, socket: &Path, queues: u32, commands: &str) -> String {
    let out: Output = run_raw(
        Command::new(script)
            .args([s(socket), commands])
            .env("CPUS", queues.to_string())
            .env("NUM_QUEUES", queues.to_string())
            .env("TIMEOUT", "300"),
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the guest failed ({}): {commands}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The disk's sha256 as the guest read it.
fn guest_sha256(output: &str) -> String {
    let begin = output
        .find("===SHA256-BEGIN")
        .expect("no sha256 in the guest's output");
    output[begin..]
        .lines()
        .nth(1)
        .expect("sha256 line")
        .trim()
        .to_owned()
}

/// sha256 of the chain's disk as `qemu-img convert` reads it.
fn qemu_sha256(top: &Path, dir: &Path) -> String {
    let raw = dir.join("oracle.raw");
    qemu_img(&["convert", "-U", "-O", "raw", s(top), s(&raw)]);
    let sum = sha256_file(&raw);
    std::fs::remove_file(&raw).unwrap();
    sum
}

/// Every layer of the chain under `top` is clean for `qemu-img check`.
fn check_chain(top: &Path) {
    let info: serde_json::Value = serde_json::from_str(&qemu_img(&[
        "info",
        "--backing-chain",
        "--output",
        "json",
        s(top),
    ]))
    .unwrap();
    for layer in info.as_array().unwrap() {
        if layer["format"] == "qcow2" {
            common::assert_check_clean(Path::new(layer["filename"].as_str().unwrap()));
        }
    }
}

/// Reads `len` bytes at `offset` of the chain through qemu-io and checks
/// they are all `byte`.
fn qemu_reads(top: &Path, offset: &str, len: &str, byte: u8) {
    let out = run_raw(Command::new("qemu-io").args([
        "-r",
        "-c",
        &format!("read -P {byte:#x} {offset} {len}"),
        s(top),
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("Pattern verification failed"),
        "{offset}+{len} is not {byte:#x} through QEMU: {text}"
    );
}

/// Requests the daemon completed so far, all queues.
fn requests(control_socket: &Path) -> u64 {
    let stats = control(control_socket, serde_json::json!({"command": "stats"}));
    stats["result"]["queues"].as_array().map_or(0, |q| {
        q.iter().map(|q| q["requests"].as_u64().unwrap_or(0)).sum()
    })
}

/// Waits until the daemon completed at least `n` requests.
fn wait_requests(control_socket: &Path, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while requests(control_socket) < n {
        assert!(
            Instant::now() < deadline,
            "the guest never sent {n} requests"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_guest_reads_what_qemu_reads_with_one_and_two_queues() {
    let Some(script) = run_ch_script() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 5, "16M", "0.5");
    let want = qemu_sha256(&top, tmp.path());
    for queues in [1, 2] {
        let mut daemon = Daemon::start(tmp.path(), &top, &["--num-queues", &queues.to_string()]);
        let out = run_ch(&script, &daemon.socket, queues, "info sha256");
        assert_eq!(guest_sha256(&out), want, "{queues} queue(s)");
        daemon.stop();
    }
    check_chain(&top);
}

#[test]
fn guest_writes_are_flushed_and_read_back_by_the_guest_and_by_qemu() {
    let Some(script) = run_ch_script() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 5, "16M", "0.5");
    for queues in [1, 2] {
        let byte = 0x50 + queues as u8;
        let mut daemon = Daemon::start(tmp.path(), &top, &["--num-queues", &queues.to_string()]);
        let at = format!("{}M", queues * 3);
        run_ch(
            &script,
            &daemon.socket,
            queues,
            &format!(
                "write:{at}:64K:{byte:#x} write:{queues}K:4K:{byte:#x} flush verify:{at}:64K:{byte:#x} verify:{queues}K:4K:{byte:#x}"
            ),
        );
        daemon.stop();
        qemu_reads(&top, &at, "64k", byte);
        qemu_reads(&top, &format!("{queues}k"), "4k", byte);
    }
    check_chain(&top);
}

#[test]
fn a_live_snapshot_and_a_live_merge_between_guest_commands() {
    let Some(script) = run_ch_script() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 4, "16M", "0.5");
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let new = tmp.path().join("new.qcow2");
    let merged = tmp.path().join("merged.qcow2");
    let host = {
        let (ctl, new, merged) = (ctl.clone(), new.clone(), merged.clone());
        std::thread::spawn(move || {
            // While the guest spins after its first write and flush.
            wait_requests(&ctl, 2);
            sqcow2(&["snapshot", "--live", s(&ctl), s(&new)]);
            // While it spins after its second.
            wait_requests(&ctl, 5);
            sqcow2(&["merge", "--live", s(&ctl), "0", "2", s(&merged)]);
        })
    };
    run_ch(
        &script,
        &daemon.socket,
        1,
        "write:1M:64K:0x21 flush spin:1 verify:1M:64K:0x21 write:2M:64K:0x22 flush spin:1 \
         verify:1M:64K:0x21 verify:2M:64K:0x22 write:5M:4K:0x23 flush verify:5M:4K:0x23",
    );
    host.join().expect("the host's snapshot and merge");
    daemon.stop();
    // The new top carries the guest's later writes, over the merged file.
    let info = qemu_img(&["info", "--backing-chain", s(&new)]);
    assert!(info.contains("merged.qcow2"), "{info}");
    for (at, len, byte) in [("1M", "64k", 0x21), ("2M", "64k", 0x22), ("5M", "4k", 0x23)] {
        qemu_reads(&new, at, len, byte);
    }
    check_chain(&new);
}

#[test]
fn kill_9_and_restart_of_the_daemon_while_the_guest_runs() {
    let Some(script) = run_ch_script() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 4, "16M", "0.5");
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let pid = daemon.pid();
    let restarted = {
        let (ctl, dir, top) = (ctl.clone(), tmp.path().to_path_buf(), top.clone());
        std::thread::spawn(move || {
            wait_requests(&ctl, 2);
            // SAFETY: kill(2) on the daemon this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // Cloud Hypervisor dials the socket again: a new daemon on it.
            let _ = std::fs::remove_file(&ctl);
            Daemon::start(&dir, &top, &["--control", s(&ctl)])
        })
    };
    run_ch(
        &script,
        &daemon.socket,
        1,
        "write:1M:64K:0x31 flush spin:1 verify:1M:64K:0x31 write:2M:64K:0x32 flush verify:2M:64K:0x32",
    );
    let mut second = restarted.join().expect("restart");
    assert!(!daemon.is_running(), "the first daemon survived kill -9");
    second.stop();
    qemu_reads(&top, "1M", "64k", 0x31);
    qemu_reads(&top, "2M", "64k", 0x32);
    check_chain(&top);
}
