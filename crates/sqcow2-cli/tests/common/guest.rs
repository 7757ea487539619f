//! A real guest: a Debian cloud kernel and a busybox initramfs under
//! `qemu-system-x86_64`, from `scripts/guest-kit.sh` (run here; it
//! downloads and installs what is missing, then reuses its result).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{run, s};

/// The kit's directory (`SQCOW2_GUEST_KIT`, else `target/guest-kit`),
/// made or refreshed by `scripts/guest-kit.sh`.
pub fn guest_kit() -> PathBuf {
    let root = super::workspace_root();
    let dir = std::env::var_os("SQCOW2_GUEST_KIT")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/guest-kit"));
    let out = run(Command::new(root.join("scripts/guest-kit.sh")).arg(&dir));
    PathBuf::from(out.trim())
}

/// Runs QEMU until it exits or `timeout`; returns the serial console.
pub fn run_qemu(args: &[String], timeout: Duration, console: &Path) -> String {
    let mut child = Command::new("qemu-system-x86_64")
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(console).unwrap())
        // Inherited, not piped: nothing would read a pipe, and a full one
        // would block QEMU.
        .stderr(Stdio::inherit())
        .spawn()
        .expect("qemu-system-x86_64 (scripts/guest-kit.sh installs it)");
    let deadline = Instant::now() + timeout;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::read_to_string(console).unwrap_or_default()
}

/// QEMU's arguments for a `vhost-user-blk-pci` disk served on `socket`
/// with `queues` queues.
pub fn vhost_user_disk(socket: &Path, queues: u32) -> [String; 4] {
    [
        "-chardev".to_string(),
        format!("socket,id=vu,path={}", socket.display()),
        "-device".to_string(),
        format!("vhost-user-blk-pci,chardev=vu,num-queues={queues}"),
    ]
}

/// QEMU's arguments for the kit's kernel with `append` as its command
/// line: 512 MiB of shared memory (vhost-user needs it), serial console
/// on stdio, no reboot.
pub fn base_args(kit: &Path, accel: &str, append: &str) -> Vec<String> {
    [
        "-accel",
        accel,
        "-m",
        "512M",
        "-object",
        "memory-backend-memfd,id=mem,size=512M,share=on",
        "-machine",
        "q35,memory-backend=mem",
        "-kernel",
        s(&kit.join("vmlinuz")),
        "-initrd",
        s(&kit.join("initrd.img")),
        "-append",
        append,
        "-display",
        "none",
        "-serial",
        "stdio",
        "-no-reboot",
        "-nodefaults",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

/// KVM if a smoke boot reaches init with it (the nested-virtualization
/// module on some hosts cannot boot a stock kernel), else TCG;
/// `SQCOW2_GUEST_ACCEL` overrides.
pub fn accelerator(kit: &Path, dir: &Path) -> String {
    if let Ok(a) = std::env::var("SQCOW2_GUEST_ACCEL") {
        return a;
    }
    if !Path::new("/dev/kvm").exists() {
        return "tcg".into();
    }
    let args = base_args(kit, "kvm", "console=ttyS0 panic=-1 quiet sqcow2.smoke=1");
    let console = run_qemu(&args, Duration::from_secs(20), &dir.join("smoke.log"));
    if console.contains("SQCOW2-GUEST-UP") {
        "kvm".into()
    } else {
        eprintln!("KVM smoke boot did not reach init; using TCG");
        "tcg".into()
    }
}

/// The value after `key` on the first console line that starts with it.
pub fn field<'a>(console: &'a str, key: &str) -> Option<&'a str> {
    console
        .lines()
        .find_map(|l| l.trim().strip_prefix(key))
        .map(str::trim)
}
