//! The NBD export (`serve --nbd`, issue 46), QEMU the oracle: the same
//! chain exported by `sqcow2 serve --nbd` and by `qemu-nbd` read the
//! same through `qemu-img` (data, `base:allocation`,
//! `qemu:allocation-depth`, `qemu:dirty-bitmap:NAME`), and hostile
//! clients end alone.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::vhost::{connect_retry, Daemon};
use common::{qemu_create, qemu_img, qemu_io, qemu_overlay, s};

/// `qemu-img map --output=json` over NBD at `sock`, with `context` in
/// `x-dirty-bitmap` (the trick QEMU's iotests use to read any context)
/// or plain (`base:allocation`).
fn map(sock: &Path, context: Option<&str>) -> String {
    let mut opts = format!("driver=nbd,server.type=unix,server.path={}", sock.display());
    if let Some(c) = context {
        opts.push_str(&format!(",x-dirty-bitmap={c}"));
    }
    qemu_img(&["map", "--output=json", "--image-opts", &opts])
}

fn raw_over_nbd(sock: &Path, out: &Path) -> Vec<u8> {
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        &format!("nbd+unix:///?socket={}", sock.display()),
        s(out),
    ]);
    std::fs::read(out).unwrap()
}

/// A three-layer chain with data, zero clusters and a bitmap in the top
/// exported by `sqcow2 serve --nbd` and by `qemu-nbd -A -B b0`: byte for
/// byte the same disk, and the same maps of every context.
#[test]
fn nbd_export_reads_as_qemu_nbd_with_every_context() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let base = d.join("base.qcow2");
    let mid = d.join("mid.qcow2");
    let top = d.join("top.qcow2");
    qemu_create(&base, "cluster_size=65536", "64M");
    qemu_io(
        &base,
        &[
            "write -P 1 0 1M".into(),
            "write -z 2M 64k".into(),
            "write -P 4 30M 3M".into(),
        ],
    );
    qemu_overlay(&mid, "base.qcow2", "qcow2", &[], None);
    qemu_io(&mid, &["write -P 5 31M 64k".into(), "discard 0 64k".into()]);
    qemu_overlay(&top, "mid.qcow2", "qcow2", &[], None);
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&top), "b0"]);
    qemu_io(
        &top,
        &[
            "write -P 2 512k 64k".into(),
            "write -P 3 10M 128k".into(),
            "write -z 30M 4k".into(),
        ],
    );

    let ours_sock = d.join("ours.nbd");
    let mut daemon = Daemon::start(
        d,
        &top,
        &["--nbd", &format!("unix:{}", ours_sock.display())],
    );
    let contexts = [
        None,
        Some("qemu:allocation-depth"),
        Some("qemu:dirty-bitmap:b0"),
    ];
    let ours: Vec<String> = contexts.iter().map(|c| map(&ours_sock, *c)).collect();
    let ours_data = raw_over_nbd(&ours_sock, &d.join("ours.raw"));
    daemon.stop();

    let theirs_sock = d.join("theirs.nbd");
    let out = Command::new("qemu-nbd")
        .args(["-r", "--fork", "-t", "-A", "-B", "b0", "-f", "qcow2", "-k"])
        .arg(&theirs_sock)
        .arg(&top)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: Vec<String> = contexts.iter().map(|c| map(&theirs_sock, *c)).collect();
    let theirs_data = raw_over_nbd(&theirs_sock, &d.join("theirs.raw"));
    Command::new("pkill")
        .args(["-f", &theirs_sock.display().to_string()])
        .status()
        .unwrap();
    assert!(ours_data == theirs_data, "the data differ");
    for (k, c) in contexts.iter().enumerate() {
        assert_eq!(ours[k], theirs[k], "context {c:?}");
    }
    assert!(
        ours[2].contains("\"data\": false"),
        "b0 marks nothing: {}",
        ours[2]
    );
}

/// A client that did the fixed newstyle handshake with `NBD_OPT_GO`
/// (simple replies).
fn go(sock: &Path) -> UnixStream {
    let mut c = UnixStream::connect(sock).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = [0u8; 18];
    c.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], b"NBDMAGIC");
    assert_eq!(&hello[8..16], b"IHAVEOPT");
    c.write_all(&3u32.to_be_bytes()).unwrap();
    let mut opt = b"IHAVEOPT".to_vec();
    opt.extend_from_slice(&7u32.to_be_bytes()); // NBD_OPT_GO
    opt.extend_from_slice(&6u32.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes()); // name ""
    opt.extend_from_slice(&0u16.to_be_bytes()); // no info requests
    c.write_all(&opt).unwrap();
    loop {
        let mut head = [0u8; 20];
        c.read_exact(&mut head).unwrap();
        let kind = u32::from_be_bytes(head[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(head[16..20].try_into().unwrap());
        let mut data = vec![0u8; len as usize];
        c.read_exact(&mut data).unwrap();
        assert!(kind < 1 << 31, "NBD_OPT_GO refused: {kind:#x}");
        if kind == 1 {
            return c;
        }
    }
}

/// Sends a request; returns the simple reply's error and `read` bytes.
fn request(c: &mut UnixStream, cmd: u16, offset: u64, len: u32, read: usize) -> (u32, Vec<u8>) {
    let mut r = 0x2560_9513u32.to_be_bytes().to_vec();
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&cmd.to_be_bytes());
    r.extend_from_slice(&42u64.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&len.to_be_bytes());
    c.write_all(&r).unwrap();
    let mut head = [0u8; 16];
    c.read_exact(&mut head).unwrap();
    assert_eq!(
        u32::from_be_bytes(head[..4].try_into().unwrap()),
        0x6744_6698
    );
    assert_eq!(u64::from_be_bytes(head[8..16].try_into().unwrap()), 42);
    let error = u32::from_be_bytes(head[4..8].try_into().unwrap());
    let mut data = vec![0u8; if error == 0 { read } else { 0 }];
    c.read_exact(&mut data).unwrap();
    (error, data)
}

/// Whether the server has closed `c` (a read sees the end).
fn closed(c: &mut UnixStream) -> bool {
    let mut b = [0u8; 1];
    matches!(c.read(&mut b), Ok(0) | Err(_))
}

/// Hostile NBD clients, while a guest writes and reads back through
/// the vhost-user socket: unknown handshake flags, a broken request
/// header (bad magic), a client that disconnects before its 32 MiB
/// read is answered each lose their connection alone; an oversized
/// read, a read past the end and an unknown command get EINVAL and the
/// connection goes on; a write to the read-only export gets EPERM; a
/// client that sends 40 reads of 32 MiB and reads no reply pins at most
/// the server's in-flight budget. The guest sees its data, and a
/// well-behaved client after them all reads the disk.
#[test]
fn hostile_nbd_clients_end_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = d.join("top.qcow2");
    qemu_create(&top, "cluster_size=65536", "64M");
    qemu_io(&top, &["write -P 7 0 64M".into()]);
    let sock = d.join("n.sock");
    let daemon = Daemon::start(d, &top, &["--nbd", &format!("unix:{}", sock.display())]);
    let mut guest = connect_retry(&daemon, 1, false);

    // Unknown client flags: closed before any option.
    let mut c = UnixStream::connect(&sock).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = [0u8; 18];
    c.read_exact(&mut hello).unwrap();
    c.write_all(&0xffu32.to_be_bytes()).unwrap();
    assert!(closed(&mut c), "unknown client flags accepted");

    let mut c = go(&sock);
    let (e, _) = request(&mut c, 0, 0, 64 << 20, 0);
    assert_eq!(e, 22, "a 64 MiB read");
    let (e, _) = request(&mut c, 0, (64 << 20) - 512, 1024, 0);
    assert_eq!(e, 22, "a read past the end");
    let (e, _) = request(&mut c, 99, 0, 512, 0);
    assert_eq!(e, 22, "an unknown command");
    let (e, data) = request(&mut c, 0, 4096, 512, 512);
    assert_eq!((e, data), (0, vec![7u8; 512]), "the connection goes on");
    // A write to a read-only export: its data is read, EPERM answered.
    let mut w = 0x2560_9513u32.to_be_bytes().to_vec();
    w.extend_from_slice(&0u16.to_be_bytes());
    w.extend_from_slice(&1u16.to_be_bytes());
    w.extend_from_slice(&42u64.to_be_bytes());
    w.extend_from_slice(&0u64.to_be_bytes());
    w.extend_from_slice(&512u32.to_be_bytes());
    w.extend_from_slice(&[9u8; 512]);
    c.write_all(&w).unwrap();
    let mut head = [0u8; 16];
    c.read_exact(&mut head).unwrap();
    assert_eq!(
        u32::from_be_bytes(head[4..8].try_into().unwrap()),
        1,
        "EPERM"
    );
    // A broken header: closed.
    c.write_all(&[0u8; 28]).unwrap();
    assert!(closed(&mut c), "a request with a bad magic was answered");

    // Gone before its 32 MiB read is answered.
    let mut c = go(&sock);
    let mut r = 0x2560_9513u32.to_be_bytes().to_vec();
    r.extend_from_slice(&[0, 0, 0, 0]);
    r.extend_from_slice(&1u64.to_be_bytes());
    r.extend_from_slice(&0u64.to_be_bytes());
    r.extend_from_slice(&(32u32 << 20).to_be_bytes());
    c.write_all(&r).unwrap();
    drop(c);

    // 40 reads of 32 MiB sent, no reply read: the server holds at most
    // its in-flight budget for them (64 MiB), not a buffer per request.
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.pid())).unwrap();
        let kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap();
        kb << 10
    };
    let before = rss();
    let mut c = go(&sock);
    let mut reads = Vec::new();
    for k in 0..40u64 {
        reads.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        reads.extend_from_slice(&[0, 0, 0, 0]);
        reads.extend_from_slice(&k.to_be_bytes());
        reads.extend_from_slice(&0u64.to_be_bytes());
        reads.extend_from_slice(&(32u32 << 20).to_be_bytes());
    }
    c.write_all(&reads).unwrap();
    // Until the daemon's memory settles (the replies stuck in the socket).
    let mut last = 0;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(200));
        let now = rss();
        if now == last {
            break;
        }
        last = now;
    }
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 100 << 20,
        "a client reading no reply pinned {} MiB",
        grown >> 20
    );
    drop(c);

    // The guest, all along.
    guest.write(1 << 20, &[3u8; 8192]);
    assert_eq!(guest.read(1 << 20, 8192), vec![3u8; 8192]);
    drop(guest);
    let data = raw_over_nbd(&sock, &d.join("after.raw"));
    assert_eq!(&data[1 << 20..(1 << 20) + 8192], &[3u8; 8192][..]);
    assert!(data[..1 << 20].iter().all(|&b| b == 7));
    let mut daemon = daemon;
    daemon.stop();
}

/// `command`, which must succeed; its standard output.
fn run(command: &mut Command) -> String {
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The backup pattern, real clients only: a full backup (`nbdcopy`) of
/// a served disk whose top carries bitmap b0, guest writes (about 2 %
/// of the disk), an incremental backup of what `nbdinfo --map` says b0
/// marks dirty (each range read by `qemu-img convert` of a raw window
/// of the NBD export), then a restore (the full backup with the
/// incremental ranges written over it) byte for byte the disk at the
/// second backup. The incremental moves less than 3 % of the disk.
#[test]
fn full_and_incremental_backups_restore_the_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let size: u64 = 64 << 20;
    let base = d.join("base.qcow2");
    let top = d.join("top.qcow2");
    qemu_create(&base, "cluster_size=65536", "64M");
    qemu_io(
        &base,
        &["write -P 1 0 20M".into(), "write -P 2 40M 8M".into()],
    );
    qemu_overlay(&top, "base.qcow2", "qcow2", &[], None);
    qemu_io(&top, &["write -P 3 4M 1M".into()]);
    // The checkpoint: b0 from the full backup on.
    qemu_img(&["bitmap", "--add", s(&top), "b0"]);
    let sock = d.join("n.sock");
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let mut daemon = Daemon::start(d, &top, &["--nbd", &format!("unix:{}", sock.display())]);
    let full = d.join("full.raw");
    std::fs::File::create(&full).unwrap().set_len(size).unwrap();
    run(Command::new("nbdcopy").arg(&uri).arg(&full));

    // The guest writes about 2 % of the disk, spread out.
    let mut guest = connect_retry(&daemon, 1, false);
    for k in 0..20u64 {
        let at = (k * 3_200_000) & !65535;
        guest.write(at, &vec![0x40 + k as u8; 65536]);
    }
    guest.write_zeroes(41 << 20, 65536, true);
    guest.flush();
    drop(guest);

    // The incremental: b0's dirty ranges, as nbdinfo maps them.
    let map = run(Command::new("nbdinfo")
        .arg("--map=qemu:dirty-bitmap:b0")
        .arg(&uri));
    let dirty: Vec<(u64, u64)> = map
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 3 && f[2] == "1").then(|| (f[0].parse().unwrap(), f[1].parse().unwrap()))
        })
        .collect();
    assert!(!dirty.is_empty(), "{map}");
    let moved: u64 = dirty.iter().map(|r| r.1).sum();
    assert!(
        moved * 100 <= size * 3,
        "{moved} bytes of {size} for the incremental"
    );
    let restore = d.join("restore.raw");
    std::fs::copy(&full, &restore).unwrap();
    for (k, (offset, len)) in dirty.iter().enumerate() {
        let piece = d.join(format!("piece{k}.raw"));
        let window = format!(
            "json:{{\"driver\":\"raw\",\"offset\":{offset},\"size\":{len},\"file\":{{\"driver\":\"nbd\",\"server\":{{\"type\":\"unix\",\"path\":\"{}\"}}}}}}",
            sock.display()
        );
        run(Command::new("qemu-img")
            .args(["convert", "-O", "raw", &window])
            .arg(&piece));
        let bytes = std::fs::read(&piece).unwrap();
        assert_eq!(bytes.len() as u64, *len);
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&restore)
            .unwrap();
        f.write_all_at(&bytes, *offset).unwrap();
    }
    // The disk now, as QEMU reads the served chain.
    let now = d.join("now.raw");
    std::fs::File::create(&now).unwrap().set_len(size).unwrap();
    run(Command::new("nbdcopy").arg(&uri).arg(&now));
    daemon.stop();
    let restored = std::fs::read(&restore).unwrap();
    assert!(
        restored == std::fs::read(&now).unwrap(),
        "the restore differs from the disk"
    );
    assert!(
        restored == common::qemu_raw(&top, d),
        "the restore differs from qemu-img's read"
    );
}

/// The export on TCP (loopback, a port the daemon picks and logs): the
/// disk read by `qemu-img convert` from `nbd://` equals qemu-img's
/// read of the chain, and `nbdinfo` sees the dirty bitmap's context.
#[test]
fn nbd_export_over_tcp() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = d.join("top.qcow2");
    qemu_create(&top, "cluster_size=65536", "32M");
    qemu_img(&["bitmap", "--add", s(&top), "b0"]);
    qemu_io(&top, &["write -P 9 1M 3M".into()]);
    let mut daemon = Daemon::start(d, &top, &["--nbd", "tcp:127.0.0.1:0"]);
    common::vhost::wait_for_log(&daemon, "nbd export listening");
    let log = daemon.log();
    let address = log
        .split("address=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address logged:\n{log}"))
        .to_string();
    let uri = format!("nbd://{address}");
    let out = d.join("tcp.raw");
    qemu_img(&["convert", "-O", "raw", &uri, s(&out)]);
    let info = run(Command::new("nbdinfo").arg("--list").arg(&uri));
    assert!(info.contains("qemu:dirty-bitmap:b0"), "{info}");
    daemon.stop();
    assert!(std::fs::read(&out).unwrap() == common::qemu_raw(&top, d));
}

/// The backup pattern with a point-in-time export: a live snapshot
/// freezes the old top, the control socket exports it by name
/// (`nbd-export`), the guest writes on into the new top; the frozen
/// export reads the disk as it was at the snapshot (nbdcopy), its
/// bitmap (stored when the old top closed) marks only what the guest
/// wrote before the snapshot (nbdinfo), the live export shows the
/// writes after it; removed, the export is gone.
#[test]
fn a_point_in_time_export_reads_the_disk_as_at_the_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let size: u64 = 32 << 20;
    let top0 = d.join("top0.qcow2");
    let top1 = d.join("top1.qcow2");
    qemu_create(&top0, "cluster_size=65536", "32M");
    qemu_io(&top0, &["write -P 1 0 8M".into()]);
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&top0), "b0"]);
    let sock = d.join("n.sock");
    let ctl = d.join("control.sock");
    let mut daemon = Daemon::start(
        d,
        &top0,
        &[
            "--control",
            s(&ctl),
            "--nbd",
            &format!("unix:{}", sock.display()),
        ],
    );
    let mut guest = connect_retry(&daemon, 1, false);
    guest.write(1 << 20, &[0x11; 65536]);
    let r = daemon.control(
        &ctl,
        serde_json::json!({"command": "snapshot", "path": top1}),
    );
    assert_eq!(r["ok"], true, "{r}");
    let r = daemon.control(
        &ctl,
        serde_json::json!({"command": "nbd-export", "name": "backup", "layer": top0}),
    );
    assert_eq!(r["ok"], true, "{r}");
    // The top cannot be frozen; the live export's name is taken.
    let r = daemon.control(
        &ctl,
        serde_json::json!({"command": "nbd-export", "name": "x", "layer": top1}),
    );
    assert_eq!(r["ok"], false, "{r}");
    let r = daemon.control(
        &ctl,
        serde_json::json!({"command": "nbd-export", "name": "", "layer": top0}),
    );
    assert_eq!(r["ok"], false, "{r}");
    guest.write(1 << 20, &[0x22; 65536]);
    guest.write(20 << 20, &[0x33; 4096]);
    guest.flush();
    let backup_uri = format!("nbd+unix:///backup?socket={}", sock.display());
    let live_uri = format!("nbd+unix:///?socket={}", sock.display());
    let frozen = d.join("frozen.raw");
    std::fs::File::create(&frozen)
        .unwrap()
        .set_len(size)
        .unwrap();
    run(Command::new("nbdcopy").arg(&backup_uri).arg(&frozen));
    let map = run(Command::new("nbdinfo")
        .arg("--map=qemu:dirty-bitmap:b0")
        .arg(&backup_uri));
    let dirty: Vec<&str> = map.lines().filter(|l| l.contains("dirty")).collect();
    assert_eq!(dirty.len(), 1, "{map}");
    assert!(
        dirty[0].split_whitespace().take(2).eq(["1048576", "65536"]),
        "{map}"
    );
    let live = d.join("live.raw");
    std::fs::File::create(&live).unwrap().set_len(size).unwrap();
    run(Command::new("nbdcopy").arg(&live_uri).arg(&live));
    let r = daemon.control(
        &ctl,
        serde_json::json!({"command": "nbd-export-remove", "name": "backup"}),
    );
    assert_eq!(r["ok"], true, "{r}");
    let gone = Command::new("nbdinfo").arg(&backup_uri).output().unwrap();
    assert!(!gone.status.success(), "the removed export still answers");
    drop(guest);
    daemon.stop();
    let frozen = std::fs::read(&frozen).unwrap();
    assert!(
        frozen == common::qemu_raw(&top0, d),
        "the frozen export is not the old top's chain"
    );
    assert_eq!(&frozen[1 << 20..(1 << 20) + 4], &[0x11; 4]);
    let live = std::fs::read(&live).unwrap();
    assert!(
        live == common::qemu_raw(&top1, d),
        "the live export is not the served chain"
    );
    assert_eq!(&live[1 << 20..(1 << 20) + 4], &[0x22; 4]);
}

/// `serve --nbd` alone, with no vhost-user socket: the export reads as
/// qemu-img reads the chain, a SIGTERM ends the daemon cleanly (exit 0,
/// the image checks clean); without `--nbd`, `--socket` is required.
#[test]
fn an_nbd_export_alone_without_a_vhost_user_socket() {
    /// Killed if the test fails while it runs.
    struct Served(std::process::Child);
    impl Drop for Served {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = d.join("top.qcow2");
    qemu_create(&top, "cluster_size=65536", "32M");
    qemu_io(&top, &["write -P 4 1M 3M".into()]);
    let expected = common::qemu_raw(&top, d);
    let sock = d.join("n.sock");
    let log = d.join("serve.log");
    let nbd = format!("unix:{}", sock.display());
    let mut served = Served(
        Command::new(common::sqcow2_bin())
            .args(["serve", "--nbd", &nbd, s(&top)])
            .env("RUST_LOG", "info")
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !sock.exists() {
        let exited = served.0.try_wait().unwrap();
        assert!(
            exited.is_none(),
            "{}",
            std::fs::read_to_string(&log).unwrap()
        );
        assert!(std::time::Instant::now() < deadline, "no NBD socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let data = raw_over_nbd(&sock, &d.join("out.raw"));
    assert!(data == expected, "the export differs from qemu-img's read");
    run(Command::new("kill").args(["-TERM", &served.0.id().to_string()]));
    let status = served.0.wait().unwrap();
    assert!(
        status.success(),
        "{status}: {}",
        std::fs::read_to_string(&log).unwrap()
    );
    common::assert_check_clean(&top);
    let o = Command::new(common::sqcow2_bin())
        .args(["serve", s(&top)])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--socket"));
}
