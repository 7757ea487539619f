//! A live resize, seen by a real guest: QEMU's `vhost-user-blk-pci`
//! with the kit's kernel reads the disk while `sqcow2 resize --live`
//! grows it; the daemon tells QEMU through its backend channel
//! (`VHOST_USER_BACKEND_CONFIG_CHANGE_MSG`), QEMU tells the guest, whose
//! `/dev/vda` takes the new size; the guest writes the new space's last
//! MiB and reads it back, with no I/O error. QEMU's tools then read the
//! grown chain.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::guest::{accelerator, base_args, field, guest_kit, run_qemu, vhost_user_disk};
use common::vhost::Daemon;
use common::{assert_check_clean, gen_chain, qemu_img, run, run_raw, s, sqcow2_bin};

const OLD: u64 = 64 << 20;
const NEW: u64 = 96 << 20;

#[test]
fn a_qemu_guest_sees_the_disk_grow_under_io() {
    let kit = guest_kit();
    let tmp = tempfile::tempdir().unwrap();
    let accel = accelerator(&kit, tmp.path());
    let top = gen_chain(tmp.path(), 10, "64M", "0.5");
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let console_path = tmp.path().join("console.log");
    let resizer = {
        let (console_path, ctl) = (console_path.clone(), ctl.clone());
        std::thread::spawn(move || {
            // Once the guest reads and waits for the new size.
            let deadline = Instant::now() + Duration::from_secs(300);
            while !std::fs::read_to_string(&console_path)
                .unwrap_or_default()
                .contains("SQCOW2-GUEST-WAITING-GROW")
            {
                if Instant::now() > deadline {
                    return String::from("the guest never waited for the resize");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let asked = Instant::now();
            let out = run_raw(Command::new(sqcow2_bin()).args([
                "resize",
                "--live",
                "--output",
                "json",
                s(&ctl),
                &NEW.to_string(),
            ]));
            // When the guest's new size shows on its console (it looks
            // every 20 ms): printed for scripts/bench-live-resize.sh.
            while !std::fs::read_to_string(&console_path)
                .unwrap_or_default()
                .contains("SQCOW2-GUEST-GREW")
                && asked.elapsed() < Duration::from_secs(120)
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            eprintln!(
                "live-resize-timing: seen_ms={:.1}",
                asked.elapsed().as_secs_f64() * 1e3
            );
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
    };
    let mut args = base_args(
        &kit,
        &accel,
        &format!("console=ttyS0 panic=-1 quiet sqcow2.grow={NEW}"),
    );
    args.extend(vhost_user_disk(&daemon.socket, 1));
    let console = run_qemu(&args, Duration::from_secs(600), &console_path);
    let resized = resizer.join().unwrap();
    let context = format!(
        "guest console:\n{console}\nresize:\n{resized}\ndaemon log:\n{}",
        daemon.log()
    );
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
        Some(OLD.to_string().as_str()),
        "{context}"
    );
    let reply: serde_json::Value =
        serde_json::from_str(&resized).unwrap_or_else(|e| panic!("resize reply: {e}\n{context}"));
    assert_eq!(reply["size"], NEW, "{context}");
    assert_eq!(reply["old-size"], OLD, "{context}");
    eprintln!("live-resize-timing: pause_ms={}", reply["pause-ms"]);
    assert_eq!(
        reply["frontend-told"], true,
        "QEMU gives a backend channel\n{context}"
    );
    // The guest's block device took the new size, in bytes and sectors.
    let grew = console
        .lines()
        .find_map(|l| l.strip_prefix("SQCOW2-GUEST-GREW "))
        .unwrap_or_else(|| panic!("no GREW line\n{context}"));
    assert_eq!(grew.trim(), format!("{NEW} {}", NEW / 512), "{context}");
    assert_eq!(
        field(&console, "SQCOW2-GUEST-GROW-WROTE"),
        Some("ok"),
        "{context}"
    );
    assert_eq!(
        field(&console, "SQCOW2-GUEST-IOERRORS"),
        Some("0"),
        "{context}"
    );

    daemon.stop();
    let info = qemu_img(&["info", "--output", "json", s(&top)]);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["virtual-size"], NEW);
    assert_check_clean(&top);
    let io = run(Command::new("qemu-io").args([
        "-c",
        &format!("read -P 0x47 {} 1M", NEW - (1 << 20)),
        s(&top),
    ]));
    assert!(!io.contains("Pattern verification failed"), "qemu-io: {io}");
}
