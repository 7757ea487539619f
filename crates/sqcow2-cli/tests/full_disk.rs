//! A full filesystem under the top image: the write that needs space fails
//! with an I/O error, nothing else does, the image stays consistent
//! (`qemu-img check` clean, no leaks) and writes work again once space is
//! freed. Runs `sqcow2 serve` on a size-limited tmpfs (needs root, as CI
//! has) and drives it with libblkio.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::vhost::{connect_retry, Daemon};
use common::{qemu_img, qemu_io, qemu_overlay, qemu_raw, run_raw, s};

const CLUSTER: usize = 65536;

/// A tmpfs of `size` mounted at `dir`, unmounted on drop.
struct SmallFs {
    dir: PathBuf,
}

impl SmallFs {
    fn mount(dir: &Path, size: &str) -> SmallFs {
        std::fs::create_dir_all(dir).unwrap();
        let out = run_raw(
            Command::new("mount")
                .args(["-t", "tmpfs", "-o"])
                .arg(format!("size={size}"))
                .arg("tmpfs")
                .arg(dir),
        );
        assert!(
            out.status.success(),
            "mounting a tmpfs needs root (CI runs as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallFs {
            dir: dir.to_path_buf(),
        }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// `dir/base.qcow2` (32 MiB, 0x11 over its first 8 MiB) and a 2 MiB
/// tmpfs at `dir/small` for the tops that fill it.
fn base_beside_a_small_fs(dir: &Path) -> (PathBuf, SmallFs) {
    let base = dir.join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "32M"]);
    qemu_io(&base, &["write -P 0x11 0 8M".to_string()]);
    (base, SmallFs::mount(&dir.join("small"), "2M"))
}

fn pattern(cluster: usize, round: u8) -> Vec<u8> {
    (0..CLUSTER)
        .map(|i| (i as u8) ^ (cluster as u8).wrapping_mul(31) ^ round.wrapping_mul(97))
        .collect()
}

#[test]
fn enospc_fails_only_the_write_that_needs_space_and_leaks_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (base, fs) = base_beside_a_small_fs(dir);
    let top = fs.dir.join("top.qcow2");
    qemu_overlay(&top, s(&base), "qcow2", &[], None);
    // Space to give back later.
    let ballast = fs.dir.join("ballast");
    std::fs::write(&ballast, vec![0xeeu8; 512 << 10]).unwrap();

    let mut expected = vec![0u8; 32 << 20];
    expected[..8 << 20].fill(0x11);

    let mut daemon = Daemon::start(dir, &top, &["--backing-root", s(dir)]);
    let mut client = connect_retry(&daemon, 1, false);

    // Fill the disk with new clusters until a write fails.
    let mut order: Vec<usize> = (0..512).collect();
    fastrand::Rng::with_seed(8).shuffle(&mut order);
    let mut written = Vec::new();
    let mut next = order.into_iter();
    let failed_at = loop {
        let c = next.next().expect("the 2 MiB filesystem never filled up");
        let data = pattern(c, 1);
        match client.try_write((c * CLUSTER) as u64, &data) {
            0 => {
                expected[c * CLUSTER..(c + 1) * CLUSTER].copy_from_slice(&data);
                written.push(c);
            }
            _ => break c,
        }
    };
    assert!(
        written.len() >= 8,
        "only {} writes before ENOSPC",
        written.len()
    );
    // Still full: more allocating writes fail, including a partial one
    // that needs copy-on-write from the base.
    for c in next.by_ref().take(3) {
        assert_ne!(client.try_write((c * CLUSTER) as u64, &pattern(c, 2)), 0);
    }
    assert_ne!(client.try_write(7 << 20, &[0x77; 4096]), 0);
    // Writes that need no space still succeed.
    let again = written[0];
    let data = pattern(again, 3);
    client.write((again * CLUSTER) as u64, &data);
    expected[again * CLUSTER..(again + 1) * CLUSTER].copy_from_slice(&data);
    // Everything reads back as the model says, the failed cluster too.
    for c in written
        .iter()
        .copied()
        .chain([failed_at, (7 << 20) / CLUSTER])
    {
        let got = client.read((c * CLUSTER) as u64, CLUSTER);
        assert!(
            got == expected[c * CLUSTER..(c + 1) * CLUSTER],
            "cluster {c} differs while the disk is full"
        );
    }
    assert_eq!(client.try_flush(), 0, "flush on a full disk");
    assert!(
        daemon.log().contains("No space left on device"),
        "the daemon log names ENOSPC:\n{}",
        daemon.log()
    );

    // Space is freed: the same writes now succeed.
    std::fs::remove_file(&ballast).unwrap();
    for c in [failed_at].into_iter().chain(next.take(4)) {
        let data = pattern(c, 4);
        client.write((c * CLUSTER) as u64, &data);
        expected[c * CLUSTER..(c + 1) * CLUSTER].copy_from_slice(&data);
    }
    client.flush();
    drop(client);
    daemon.stop();

    let check = run_raw(Command::new("qemu-img").args(["check", s(&top)]));
    let report = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && report.contains("No errors were found"),
        "qemu-img check after ENOSPC:\n{report}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let out = tempfile::tempdir().unwrap();
    assert!(qemu_raw(&top, out.path()) == expected, "qemu-img convert");
}

/// A snapshot onto a full filesystem fails with the error and leaves no
/// half-made file behind (neither the new top nor its temporary file).
#[test]
fn a_snapshot_onto_a_full_filesystem_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let top = tmp.path().join("top.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&top), "64M"]);
    let small = SmallFs::mount(&tmp.path().join("small"), "64k");
    // Most of the room taken.
    std::fs::write(small.dir.join("filler"), vec![1u8; 48 << 10]).unwrap();
    let new = small.dir.join("new.qcow2");
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["snapshot", s(&top), s(&new)]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("No space left"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&small.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "filler")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Bytes free on the filesystem of `dir`.
fn free_bytes(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: statvfs is plain old data; all zeros is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs reads the NUL-terminated path this function owns
    // and writes into `st`, which it owns.
    assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut st) }, 0);
    st.f_bavail * st.f_frsize
}

#[test]
fn an_index_build_on_a_full_filesystem_walks_and_tries_again_at_the_next_start() {
    let tmp = tempfile::tempdir().unwrap();
    let small = SmallFs::mount(&tmp.path().join("small"), "16M");
    // A chain QEMU made, 12 layers of 64 MiB with a little data each.
    let specs: Vec<common::LayerSpec> = (0..12u64)
        .map(|i| {
            let cmd = format!("write -P {} {} 64k", 0x20 + i, i * 5 * 65536);
            common::LayerSpec::new("", 64 << 20, &[cmd.as_str()])
        })
        .collect();
    let top = common::build_chain(&small.dir, &specs);
    let reference = common::reference::Reference::new(&top, tmp.path(), 4096);
    // No room for the index (12 KiB for these layers).
    let room = free_bytes(&small.dir);
    let filler = small.dir.join("filler");
    std::fs::write(&filler, vec![1u8; (room - 4096) as usize]).unwrap();
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let st = common::vhost::wait_index_state(&ctl, "a failed build", |index| {
        index["failures"].as_u64() >= Some(1) && index["building"] == false
    });
    let why = st["result"]["index"]["walking-because"]
        .as_str()
        .unwrap_or_default();
    assert!(why.contains("No space left"), "{st}");
    assert_eq!(st["result"]["index-mode"], "walk", "{st}");
    // Served right, walking.
    let mut client = connect_retry(&daemon, 1, false);
    for i in 0..12u64 {
        let got = client.read(i * 5 * 65536, 65536);
        assert!(got.iter().all(|&b| b == 0x20 + i as u8), "layer {i}'s data");
    }
    drop(client);
    daemon.stop();
    let left: Vec<_> = std::fs::read_dir(&small.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().contains(".sq"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // Room again: the next start indexes the chain.
    std::fs::remove_file(&filler).unwrap();
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let st = common::vhost::wait_indexed(&ctl);
    assert_eq!(st["result"]["index-mode"], "indexed", "{st}");
    daemon.stop();
    reference.verify_files(&top, &small.dir);
}

/// One daemon, two exports over one base: the top of one fills its
/// 2 MiB filesystem, the other's is on the big one. The full export's
/// allocating writes fail; the other export's writes and reads go on,
/// none failing; both images check clean.
#[test]
fn a_full_disk_under_one_export_fails_only_that_export() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (base, fs) = base_beside_a_small_fs(dir);
    let full = fs.dir.join("full.qcow2");
    qemu_overlay(&full, s(&base), "qcow2", &[], None);
    let roomy = dir.join("roomy.qcow2");
    qemu_overlay(&roomy, s(&base), "qcow2", &[], None);
    let export = |id: &str, top: &Path| {
        format!(
            "socket={},image={},id={id},backing-root={}",
            s(&dir.join(format!("{id}.sock"))),
            s(top),
            s(dir)
        )
    };
    let args = [
        "--export".to_string(),
        export("full", &full),
        "--export".to_string(),
        export("roomy", &roomy),
    ];
    let mut daemon = Daemon::start_args(dir, &args);
    let mut full_client =
        common::vhost::connect_retry_to(&daemon, &dir.join("full.sock"), 1, false);
    let mut roomy_client =
        common::vhost::connect_retry_to(&daemon, &dir.join("roomy.sock"), 1, false);
    let mut failed = 0;
    for c in 0..200usize {
        let at = (c * CLUSTER) as u64;
        if full_client.try_write(at, &pattern(c, 1)) != 0 {
            failed += 1;
        }
        // The other export, written and read between each of them.
        roomy_client.write(at, &pattern(c, 2));
        assert!(
            roomy_client.read(at, CLUSTER) == pattern(c, 2),
            "the roomy export's cluster {c}"
        );
    }
    assert!(
        failed > 100,
        "the full export failed {failed} writes of 200"
    );
    assert_eq!(roomy_client.try_flush(), 0);
    drop((full_client, roomy_client));
    daemon.stop();
    for top in [&full, &roomy] {
        let check = run_raw(Command::new("qemu-img").args(["check", s(top)]));
        assert!(
            check.status.success(),
            "{}: {}",
            top.display(),
            String::from_utf8_lossy(&check.stdout)
        );
    }
    let raw = qemu_raw(&roomy, dir);
    for c in 0..200usize {
        assert!(
            raw[c * CLUSTER..(c + 1) * CLUSTER] == pattern(c, 2),
            "roomy cluster {c} in the file"
        );
    }
}
