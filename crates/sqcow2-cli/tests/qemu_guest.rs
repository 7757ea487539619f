//! A real guest: a Debian cloud kernel under `qemu-system-x86_64`, its
//! disk a `vhost-user-blk-pci` device served by `sqcow2 serve` from a
//! 100-layer chain, the worker threads busy-polling (`--poll-us`: the
//! guest's virtio driver honours the notification suppression polling
//! relies on, which libblkio does not). The guest hashes the whole disk (compared with
//! `qemu-img convert`), writes a pattern, flushes and powers off; then
//! `qemu-img check` and `qemu-io` judge the image.
//!
//! The kernel and initramfs come from `scripts/guest-kit.sh`
//! (`common::guest`).

mod common;

use std::process::Command;
use std::time::Duration;

use common::guest::{accelerator, base_args, field, guest_kit, run_qemu, vhost_user_disk};
use common::vhost::Daemon;
use common::{gen_chain, qemu_img, run, run_raw, s, sha256_file};

const PATTERN_OFFSET: u64 = 3 << 20;
const PATTERN_LEN: u64 = 1 << 20;

#[test]
fn debian_guest_reads_and_writes_a_100_layer_chain() {
    let kit = guest_kit();
    let tmp = tempfile::tempdir().unwrap();
    let accel = accelerator(&kit, tmp.path());
    let top = gen_chain(tmp.path(), 100, "64M", "0.6");
    let raw = tmp.path().join("expected.raw");
    qemu_img(&["convert", "-O", "raw", s(&top), s(&raw)]);
    let expected = sha256_file(&raw);

    let mut daemon = Daemon::start(tmp.path(), &top, &["--num-queues", "2", "--poll-us", "50"]);
    let mut args = base_args(
        &kit,
        &accel,
        &format!(
            "console=ttyS0 panic=-1 quiet sqcow2.pattern_offset={PATTERN_OFFSET} sqcow2.pattern_len={PATTERN_LEN}"
        ),
    );
    args.extend(vhost_user_disk(&daemon.socket, 2));
    let console = run_qemu(
        &args,
        Duration::from_secs(600),
        &tmp.path().join("console.log"),
    );
    let context = format!("guest console:\n{console}\ndaemon log:\n{}", daemon.log());
    assert!(
        console.contains("SQCOW2-GUEST-DONE"),
        "guest did not finish\n{context}"
    );
    assert!(
        !console.contains("SQCOW2-GUEST-FAIL"),
        "guest reported a failure\n{context}"
    );
    assert_eq!(
        field(&console, "SQCOW2-GUEST-SIZE"),
        Some("67108864"),
        "{context}"
    );
    assert_eq!(field(&console, "SQCOW2-GUEST-RO"), Some("0"), "{context}");
    assert_eq!(
        field(&console, "SQCOW2-GUEST-SHA256"),
        Some(expected.as_str()),
        "guest hash of /dev/vda differs from qemu-img convert\n{context}"
    );
    assert!(console.contains("SQCOW2-GUEST-WROTE"), "{context}");
    let pattern_file = tmp.path().join("pattern");
    std::fs::write(&pattern_file, vec![b'Z'; PATTERN_LEN as usize]).unwrap();
    assert_eq!(
        field(&console, "SQCOW2-GUEST-REREAD"),
        Some(sha256_file(&pattern_file).as_str()),
        "{context}"
    );

    // The guest is gone; the daemon waits for the next one.
    assert!(
        daemon.is_running(),
        "daemon exited with the guest\n{context}"
    );
    daemon.stop();

    let check = run_raw(Command::new("qemu-img").args(["check", s(&top)]));
    assert!(
        check.status.success(),
        "qemu-img check: {}",
        String::from_utf8_lossy(&check.stdout)
    );
    let io = run(Command::new("qemu-io").args([
        "-c",
        &format!("read -P 0x5a {PATTERN_OFFSET} {PATTERN_LEN}"),
        s(&top),
    ]));
    assert!(!io.contains("Pattern verification failed"), "qemu-io: {io}");
    assert!(io.contains("read 1048576/1048576 bytes"), "qemu-io: {io}");
}

/// Two guests at once on one daemon, each on its own export of a chain
/// over the same 20-layer base (opened once by the daemon): each hashes
/// its whole disk (equal to `qemu-img convert` of its chain), writes a
/// pattern and powers off; each chain then checks clean and holds its
/// guest's pattern, the shared base unchanged.
#[test]
fn two_guests_on_two_exports_of_one_daemon() {
    let kit = guest_kit();
    let tmp = tempfile::tempdir().unwrap();
    let accel = accelerator(&kit, tmp.path());
    let base = gen_chain(tmp.path(), 20, "64M", "0.6");
    let base_raw = tmp.path().join("base.raw");
    qemu_img(&["convert", "-O", "raw", s(&base), s(&base_raw)]);
    let base_sha = sha256_file(&base_raw);
    let mut tops = Vec::new();
    let mut daemon_args = Vec::new();
    for (i, fill) in [0x41u8, 0x42].into_iter().enumerate() {
        let top = tmp.path().join(format!("vm{i}.qcow2"));
        common::sqcow2(&["snapshot", s(&base), s(&top)]);
        common::sqcow2(&["io", "-c", &format!("write -P {fill} 8M 1M"), s(&top)]);
        let raw = tmp.path().join(format!("vm{i}.raw"));
        qemu_img(&["convert", "-O", "raw", s(&top), s(&raw)]);
        let socket = tmp.path().join(format!("vm{i}.sock"));
        daemon_args.push("--export".to_string());
        daemon_args.push(format!(
            "socket={},image={},id=vm{i},num-queues=2",
            s(&socket),
            s(&top)
        ));
        tops.push((top, socket, sha256_file(&raw)));
    }
    daemon_args.extend(["--poll-us".to_string(), "50".to_string()]);
    let mut daemon = Daemon::start_args(tmp.path(), &daemon_args);
    let guests: Vec<_> = tops
        .iter()
        .enumerate()
        .map(|(i, (_, socket, _))| {
            let mut args = base_args(
                &kit,
                &accel,
                &format!(
                    "console=ttyS0 panic=-1 quiet sqcow2.pattern_offset={PATTERN_OFFSET} sqcow2.pattern_len={PATTERN_LEN}"
                ),
            );
            args.extend(vhost_user_disk(socket, 2));
            let console = tmp.path().join(format!("console{i}.log"));
            std::thread::spawn(move || run_qemu(&args, Duration::from_secs(600), &console))
        })
        .collect();
    let consoles: Vec<String> = guests.into_iter().map(|g| g.join().unwrap()).collect();
    for (i, console) in consoles.iter().enumerate() {
        let context = format!(
            "guest {i} console:\n{console}\ndaemon log:\n{}",
            daemon.log()
        );
        assert!(console.contains("SQCOW2-GUEST-DONE"), "{context}");
        assert!(!console.contains("SQCOW2-GUEST-FAIL"), "{context}");
        assert_eq!(
            field(console, "SQCOW2-GUEST-SHA256"),
            Some(tops[i].2.as_str()),
            "guest {i}'s hash of /dev/vda differs from qemu-img convert\n{context}"
        );
        assert!(console.contains("SQCOW2-GUEST-WROTE"), "{context}");
    }
    assert!(daemon.is_running(), "daemon exited with the guests");
    daemon.stop();
    for (top, _, _) in &tops {
        let check = run_raw(Command::new("qemu-img").args(["check", s(top)]));
        assert!(check.status.success(), "qemu-img check {}", top.display());
        let io = run(Command::new("qemu-io").args([
            "-c",
            &format!("read -P 0x5a {PATTERN_OFFSET} {PATTERN_LEN}"),
            s(top),
        ]));
        assert!(
            io.contains("read 1048576/1048576 bytes") && !io.contains("failed"),
            "{io}"
        );
    }
    qemu_img(&["convert", "-O", "raw", s(&base), s(&base_raw)]);
    assert_eq!(sha256_file(&base_raw), base_sha, "the shared base changed");
}
