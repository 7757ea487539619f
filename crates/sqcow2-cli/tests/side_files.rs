//! Nothing sqcow2 did not create is deleted, emptied or written through
//! (issue 42): side files (index, journal, temporaries) whose names are
//! taken by layers or other files, symlinks where side files go, backing
//! files that are FIFOs, a pidfile that is a symlink, and control lines
//! that say one thing twice. Every file the operation did not create,
//! inside the directory and outside it, has the same content and inode
//! afterwards; QEMU's tools read and check what is left.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::reference::Reference;
use common::vhost::{connect_retry, control, Daemon};
use common::{qemu_img, qemu_io, run_raw, s, sha256_file, sqcow2, sqcow2_bin};
use serde_json::json;

/// What every entry below `dirs` is: inode and content hash, symlink
/// target, or kind (symlinks not followed).
fn state(dirs: &[&Path]) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut todo: Vec<PathBuf> = dirs.iter().map(|d| d.to_path_buf()).collect();
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let ft = meta.file_type();
            let what = if ft.is_symlink() {
                format!("link {}", std::fs::read_link(&path).unwrap().display())
            } else if ft.is_dir() {
                todo.push(path.clone());
                format!("dir {}", meta.ino())
            } else if ft.is_file() {
                format!("file {} {}", meta.ino(), sha256_file(&path))
            } else {
                format!("special {}", meta.ino())
            };
            out.insert(path, what);
        }
    }
    out
}

/// Asserts that every entry of `before` is unchanged in `after`.
fn assert_untouched(
    before: &BTreeMap<PathBuf, String>,
    after: &BTreeMap<PathBuf, String>,
    when: &str,
) {
    for (path, what) in before {
        assert_eq!(
            after.get(path),
            Some(what),
            "{when}: {} changed or went",
            path.display()
        );
    }
}

/// Runs the sqcow2 binary with `args`; its exit code (`None`: still
/// running after 20 s, then killed) and standard error.
fn run_sqcow2(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(sqcow2_bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            return (
                status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            return (None, String::from_utf8_lossy(&out.stderr).into_owned());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asserts a refusal: exit 1, the error naming `name`.
fn assert_refused(args: &[&str], name: &str) -> String {
    let (code, stderr) = run_sqcow2(args);
    assert_eq!(code, Some(1), "{args:?}: {stderr}");
    assert!(
        stderr.contains(name),
        "{args:?} should name {name}: {stderr}"
    );
    stderr
}

fn create(path: &Path, size: &str) {
    qemu_img(&["create", "-q", "-f", "qcow2", s(path), size]);
}

fn overlay(path: &Path, backing: &str) {
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        backing,
        "-F",
        "qcow2",
        s(path),
    ]);
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(s(path)).unwrap();
    // SAFETY: a NUL-terminated path this test owns.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// `sqcow2 snapshot foo.sqidx foo`: the new top's index would be the
/// chain's own top; `upgrade` of a top whose base is named as its index:
/// both refused, nothing written (before: the layer deleted or replaced by
/// an index, exit 0).
#[test]
fn a_layer_named_as_a_side_file_is_never_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let foo_idx = d.join("foo.sqidx");
    sqcow2(&["create", s(&foo_idx), "64M"]);
    sqcow2(&["io", "-c", "write -P 0x5a 0 1M", s(&foo_idx)]);
    let before = state(&[d]);
    assert_refused(&["snapshot", s(&foo_idx), s(&d.join("foo"))], "foo.sqidx");
    assert_untouched(&before, &state(&[d]), "snapshot to foo");
    assert!(!d.join("foo").exists());
    qemu_io(&foo_idx, &["read -P 0x5a 0 1M".into()]);

    let t_idx = d.join("t.sqidx");
    create(&t_idx, "64M");
    qemu_io(&t_idx, &["write -P 0x33 0 64k".into()]);
    overlay(&d.join("t"), "t.sqidx");
    let before = state(&[d]);
    assert_refused(&["upgrade", s(&d.join("t"))], "t.sqidx");
    assert_untouched(&before, &state(&[d]), "upgrade t");
    qemu_io(&d.join("t"), &["read -P 0x33 0 64k".into()]);
}

/// A base named as its top's journal (`x.sqjournal` under `x`), and a
/// top whose journal's name is a symlink to a file elsewhere: writes into
/// the top go on (without a journal: each change published before it
/// completes) and neither file is touched (before: the base emptied and
/// deleted, the symlink's target truncated to a journal).
#[test]
fn a_journal_is_never_made_over_another_file() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let base = d.join("x.sqjournal");
    create(&base, "64M");
    qemu_io(&base, &["write -P 0x11 0 1M".into()]);
    let x = d.join("x");
    overlay(&x, "x.sqjournal");
    let victim = outside.path().join("victim");
    std::fs::write(&victim, vec![0xEE; 8192]).unwrap();
    let n = d.join("n");
    create(&n, "64M");
    std::os::unix::fs::symlink(&victim, d.join("n.sqjournal")).unwrap();
    let before = state(&[d, outside.path()]);
    let (code, stderr) = run_sqcow2(&["io", "-c", "write -P 0x22 64k 64k", s(&x)]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("x.sqjournal"),
        "the collision is named: {stderr}"
    );
    let (code, stderr) = run_sqcow2(&["io", "-c", "write -P 0x44 0 64k", s(&n)]);
    assert_eq!(code, Some(0), "{stderr}");
    let after = state(&[d, outside.path()]);
    for keep in [&base, &victim, &d.join("n.sqjournal")] {
        assert_eq!(before.get(keep), after.get(keep), "{}", keep.display());
    }
    qemu_io(
        &x,
        &["read -P 0x11 0 64k".into(), "read -P 0x22 64k 64k".into()],
    );
    qemu_io(&n, &["read -P 0x44 0 64k".into()]);
    for image in [&base, &x, &n] {
        qemu_img(&["check", s(image)]);
    }
}

/// Files of other programs at the names of a new top's side files
/// (`C.sqidx`, `D.sqjournal`, `F.sqidx.tmp`, `P.sqtmp`, a symlink at
/// `S.sqtmp` to a file outside): each snapshot is refused in one line
/// naming the file, and nothing changes (before: deleted or overwritten
/// without a word). The old temporary names (`P.qcow2.tmp`) are not
/// sqcow2's any more: a snapshot to `P.other` leaves them alone.
#[test]
fn files_at_a_new_tops_side_file_names_are_refused_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = d.join("top.qcow2");
    create(&top, "64M");
    qemu_io(&top, &["write -P 0x66 0 64k".into()]);
    let victim = outside.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    for name in [
        "C.sqidx",
        "D.sqjournal",
        "F.sqidx.tmp",
        "P.sqtmp",
        "P.qcow2.tmp",
    ] {
        std::fs::write(d.join(name), format!("{name} belongs to someone")).unwrap();
    }
    std::os::unix::fs::symlink(&victim, d.join("S.sqtmp")).unwrap();
    std::os::unix::fs::symlink(&victim, d.join("L.sqidx")).unwrap();
    // A real qcow2 image of someone else's at a temporary name.
    create(&d.join("Q.sqtmp"), "1M");
    let before = state(&[d, outside.path()]);
    for (new, taken) in [
        ("C", "C.sqidx"),
        ("D", "D.sqjournal"),
        ("F", "F.sqidx.tmp"),
        ("P", "P.sqtmp"),
        ("S", "S.sqtmp"),
        ("L", "L.sqidx"),
        ("Q", "Q.sqtmp"),
    ] {
        let stderr = assert_refused(&["snapshot", s(&top), s(&d.join(new))], taken);
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
        assert!(!d.join(new).exists(), "{new}");
    }
    sqcow2(&["snapshot", s(&top), s(&d.join("P.other"))]);
    assert_untouched(&before, &state(&[d, outside.path()]), "snapshots");
    qemu_img(&["check", s(&d.join("P.other"))]);
}

/// A backing file that is a FIFO (outside the backing root or not), and a
/// top that is one: `info`, `check`, `map` and `serve` refuse it in one
/// line at once (before: they waited forever in `open`).
#[test]
fn a_fifo_is_never_opened_as_an_image() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let fifo = outside.path().join("fifo");
    mkfifo(&fifo);
    let top = d.join("top.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        s(&fifo),
        "-F",
        "raw",
        s(&top),
        "64M",
    ]);
    let inner = d.join("inner-fifo");
    mkfifo(&inner);
    let top2 = d.join("top2.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        "inner-fifo",
        "-F",
        "raw",
        s(&top2),
        "64M",
    ]);
    for args in [
        vec!["info", "--backing-chain", s(&top)],
        vec!["map", s(&top)],
        vec!["check", s(&top)],
        vec!["map", s(&top2)],
        vec!["info", s(&inner)],
        vec!["map", s(&inner)],
    ] {
        let (code, stderr) = run_sqcow2(&args);
        assert_eq!(code, Some(1), "{args:?} (None: it hung): {stderr}");
        assert!(stderr.contains("fifo"), "{args:?}: {stderr}");
    }
    // Nor written as a conversion's output.
    let plain = d.join("plain.qcow2");
    create(&plain, "1M");
    let (code, stderr) = run_sqcow2(&["convert", "-O", "raw", s(&plain), s(&inner)]);
    assert_eq!(
        code,
        Some(1),
        "convert onto a FIFO (None: it hung): {stderr}"
    );
    assert!(
        stderr.contains("inner-fifo") && stderr.contains("not a regular file"),
        "{stderr}"
    );
    for image in [&top, &top2] {
        let sock = d.join("v.sock");
        let (code, stderr) = run_sqcow2(&["serve", "--socket", s(&sock), s(image)]);
        assert_eq!(
            code,
            Some(1),
            "serve {} (None: it hung): {stderr}",
            image.display()
        );
        assert!(stderr.contains("fifo"), "{stderr}");
    }
}

/// `--pidfile` naming a symlink: the daemon refuses to start and the
/// symlink's target is untouched (before: written through).
#[test]
fn the_pidfile_is_never_written_through_a_symlink() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = d.join("top.qcow2");
    create(&top, "16M");
    let victim = outside.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let pidfile = d.join("serve.pid");
    std::os::unix::fs::symlink(&victim, &pidfile).unwrap();
    let sock = d.join("v.sock");
    let (code, stderr) = run_sqcow2(&[
        "serve",
        "--socket",
        s(&sock),
        "--pidfile",
        s(&pidfile),
        s(&top),
    ]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("serve.pid"), "{stderr}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}

const BLOCK: u64 = 64 << 10;

fn write_blocks(
    client: &mut common::vhost::Client,
    reference: &mut Reference,
    seed: u64,
    count: u64,
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let blocks = client.capacity() / BLOCK;
    for _ in 0..count {
        let offset = rng.u64(0..blocks) * BLOCK;
        let fill = rng.u8(1..);
        client.write(offset, &vec![fill; BLOCK as usize]);
        reference.wrote(offset, fill);
    }
}

/// Live snapshots whose new top's side files are layers of the served
/// chain: a new top `B` over a top named `B.sqjournal`, a new top `A`
/// over a top named `A.sqidx`. Both are refused with an error reply; the
/// served top is neither emptied nor unlinked; every acknowledged write
/// reads back, through the daemon and through QEMU after the stop (before:
/// the live top truncated into a journal and unlinked, every write since
/// the first snapshot lost).
#[test]
fn live_snapshots_never_take_a_layers_name() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let base = d.join("base.qcow2");
    create(&base, "64M");
    let mut reference = Reference::new(&base, d, BLOCK);
    let ctl = d.join("control.sock");
    let mut daemon = Daemon::start(d, &base, &["--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    write_blocks(&mut client, &mut reference, 8, 200);
    let b_journal = d.join("B.sqjournal");
    let r = control(&ctl, json!({"command": "snapshot", "path": b_journal}));
    assert_eq!(r["ok"], true, "{r}");
    write_blocks(&mut client, &mut reference, 9, 200);
    reference.verify_through(&mut client, "after the first snapshot");
    let ino = std::fs::metadata(&b_journal).unwrap().ino();
    let r = control(&ctl, json!({"command": "snapshot", "path": d.join("B")}));
    assert_eq!(r["ok"], false, "{r}");
    let message = r["error"]["message"].as_str().unwrap();
    assert!(message.contains("B.sqjournal"), "{r}");
    assert!(!d.join("B").exists());
    assert_eq!(std::fs::metadata(&b_journal).unwrap().ino(), ino);
    write_blocks(&mut client, &mut reference, 10, 100);
    reference.verify_through(&mut client, "after the refused snapshot");
    // A top named as an index.
    let a_idx = d.join("A.sqidx");
    let r = control(&ctl, json!({"command": "snapshot", "path": a_idx}));
    assert_eq!(r["ok"], true, "{r}");
    write_blocks(&mut client, &mut reference, 11, 100);
    let ino = std::fs::metadata(&a_idx).unwrap().ino();
    let r = control(&ctl, json!({"command": "snapshot", "path": d.join("A")}));
    assert_eq!(r["ok"], false, "{r}");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("A.sqidx"),
        "{r}"
    );
    assert_eq!(std::fs::metadata(&a_idx).unwrap().ino(), ino);
    write_blocks(&mut client, &mut reference, 12, 100);
    reference.verify_through(&mut client, "after the second refusal");
    drop(client);
    daemon.stop();
    reference.verify_for_qemu(&a_idx, d);
    for layer in [&base, &b_journal, &a_idx] {
        qemu_img(&["check", s(layer)]);
    }
}

/// A live merge whose temporary file's journal (`m.qcow2.sqtmp.sqjournal`)
/// or temporary file is a symlink to a file outside: refused before it
/// starts, the file outside untouched; a live snapshot during a merge
/// never touches the merge's files.
#[test]
fn a_live_merge_never_writes_through_symlinks() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = common::gen_chain(d, 4, "64M", "0.3");
    let ctl = d.join("control.sock");
    let mut daemon = Daemon::start(d, &top, &["--control", s(&ctl)]);
    let victim = outside.path().join("victim");
    std::fs::write(&victim, vec![0x5a; 4096]).unwrap();
    let m = d.join("m.qcow2");
    for side in ["m.qcow2.sqtmp.sqjournal", "m.qcow2.sqtmp", "m.qcow2.sqidx"] {
        std::os::unix::fs::symlink(&victim, d.join(side)).unwrap();
        let before = state(&[d, outside.path()]);
        let r = control(
            &ctl,
            json!({"command": "merge", "first": 0, "last": 1, "path": m}),
        );
        assert_eq!(r["ok"], false, "{side}: {r}");
        assert!(
            r["error"]["message"].as_str().unwrap().contains(side),
            "{r}"
        );
        let after = state(&[d, outside.path()]);
        for keep in [&victim, &d.join(side)] {
            assert_eq!(before.get(keep), after.get(keep), "{side}");
        }
        std::fs::remove_file(d.join(side)).unwrap();
    }
    assert_eq!(std::fs::read(&victim).unwrap(), vec![0x5a; 4096]);
    // A live snapshot named `m.snap` while the merge to `m.qcow2` copies:
    // their temporary files are each its own (before: the snapshot
    // deleted the merge's).
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 0, "last": 1, "path": m, "rate-limit": 8 << 20}),
    );
    assert_eq!(r["ok"], true, "{r}");
    let r = control(
        &ctl,
        json!({"command": "snapshot", "path": d.join("m.snap")}),
    );
    assert_eq!(r["ok"], true, "{r}");
    let mut state = serde_json::Value::Null;
    for _ in 0..1200 {
        state = control(&ctl, json!({"command": "stats"}))["result"]["merge"]["state"].clone();
        if state != "copying" && state != "switching" && state != "measuring" {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(state, "done");
    let info = control(&ctl, json!({"command": "info"}));
    assert_eq!(info["result"]["chain"][0], s(&m), "{info}");
    daemon.stop();
    qemu_img(&["check", s(&m)]);
}

/// Control lines that say a key twice, carry a key the command does not
/// take, or give a value of the wrong type: refused with `bad-request`,
/// nothing done (before: the last of two `command`s ran).
#[test]
fn control_lines_with_duplicate_or_unknown_keys_are_refused() {
    use std::io::{BufRead, BufReader, Write};
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = d.join("top.qcow2");
    create(&top, "16M");
    let ctl = d.join("control.sock");
    let mut daemon = Daemon::start(d, &top, &["--control", s(&ctl)]);
    let new = d.join("new.qcow2");
    let lines = [
        format!(
            r#"{{"command":"info","command":"snapshot","path":"{}"}}"#,
            s(&new)
        ),
        format!(
            r#"{{"command":"snapshot","path":"{}","path":"{}"}}"#,
            s(&new),
            s(&new)
        ),
        r#"{"id":1,"id":2,"command":"info"}"#.to_string(),
        format!(
            r#"{{"command":"snapshot","path":"{}","force":true}}"#,
            s(&new)
        ),
        r#"{"command":"info","verbose":1}"#.to_string(),
        r#"{"command":"stats","format":7}"#.to_string(),
        r#"{"command":"snapshot","path":7}"#.to_string(),
        r#"{"command":"merge","first":0,"last":"x","path":7}"#.to_string(),
    ];
    for line in &lines {
        let mut stream = std::os::unix::net::UnixStream::connect(&ctl).unwrap();
        stream.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut reply = String::new();
        BufReader::new(stream).read_line(&mut reply).unwrap();
        let r: serde_json::Value = serde_json::from_str(&reply).unwrap();
        assert_eq!(r["ok"], false, "{line}: {r}");
        assert_eq!(r["error"]["kind"], "bad-request", "{line}: {r}");
    }
    assert!(!new.exists());
    let r = control(&ctl, json!({"command": "info"}));
    assert_eq!(r["result"]["layers"], 1, "{r}");
    daemon.stop();
    let out = run_raw(Command::new("qemu-img").args(["check", s(&top)]));
    assert!(out.status.success());
}

/// Names the property tests draw from: stems that end in side-file
/// suffixes themselves, and every suffix.
const STEMS: [&str; 3] = ["n", "m", "n.qcow2"];
const SUFFIXES: [&str; 8] = [
    "",
    ".qcow2",
    ".sqidx",
    ".sqjournal",
    ".sqtmp",
    ".sqidx.tmp",
    ".sqtmp.sqjournal",
    ".tmp",
];

fn random_name(rng: &mut fastrand::Rng) -> String {
    format!(
        "{}{}",
        STEMS[rng.usize(..STEMS.len())],
        SUFFIXES[rng.usize(..SUFFIXES.len())]
    )
}

/// A chain of three layers with random names in `d` (some data in each);
/// its files, base first.
fn random_chain(d: &Path, rng: &mut fastrand::Rng) -> Vec<PathBuf> {
    let mut names: Vec<String> = Vec::new();
    while names.len() < 3 {
        let n = random_name(rng);
        if !names.contains(&n) {
            names.push(n);
        }
    }
    let files: Vec<PathBuf> = names.iter().map(|n| d.join(n)).collect();
    create(&files[0], "16M");
    overlay(&files[1], &names[0]);
    overlay(&files[2], &names[1]);
    for (i, f) in files.iter().enumerate() {
        qemu_io(f, &[format!("write -P {} {}M 64k", 0x10 + i, i * 3)]);
    }
    files
}

/// Puts things of other owners at `count` random names of `d` (and at
/// names of `extra`'s side files) that are free: regular files, qcow2
/// images, symlinks to a file and to a directory in `outside`, dangling
/// symlinks, FIFOs, directories.
fn distractors(d: &Path, outside: &Path, extra: &[&str], count: usize, rng: &mut fastrand::Rng) {
    let victim = outside.join("victim");
    if !victim.exists() {
        std::fs::write(&victim, b"precious outside").unwrap();
        std::fs::create_dir_all(outside.join("victim-dir")).unwrap();
    }
    let mut names: Vec<String> = (0..count).map(|_| random_name(rng)).collect();
    for e in extra {
        for suffix in SUFFIXES.iter().skip(1) {
            if rng.bool() {
                names.push(format!("{e}{suffix}"));
            }
        }
    }
    for name in names {
        let path = d.join(&name);
        if std::fs::symlink_metadata(&path).is_ok() {
            continue;
        }
        match rng.u8(..7) {
            0 => std::fs::write(&path, format!("{name} of another program")).unwrap(),
            1 => create(&path, "1M"),
            2 => std::os::unix::fs::symlink(&victim, &path).unwrap(),
            3 => std::os::unix::fs::symlink(outside.join("victim-dir"), &path).unwrap(),
            4 => std::os::unix::fs::symlink(outside.join("nowhere"), &path).unwrap(),
            5 => mkfifo(&path),
            _ => std::fs::create_dir(&path).unwrap(),
        }
    }
}

/// A round of a property: a chain of three layers with random names in a
/// directory, files of other owners at random names and at the names of
/// side files of the layers and of the target, a directory outside.
struct Scene {
    tmp: tempfile::TempDir,
    outside: tempfile::TempDir,
    layers: Vec<PathBuf>,
    /// The layers' file names.
    names: Vec<String>,
    /// The name of the file an operation makes.
    target: String,
}

impl Scene {
    fn new(rng: &mut fastrand::Rng) -> Scene {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let layers = random_chain(tmp.path(), rng);
        let target = random_name(rng);
        let names: Vec<String> = layers
            .iter()
            .map(|l| l.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        let mut extra: Vec<&str> = names.iter().map(String::as_str).collect();
        extra.push(&target);
        distractors(tmp.path(), outside.path(), &extra, 4, rng);
        Scene {
            tmp,
            outside,
            layers,
            names,
            target,
        }
    }
}

/// sha256 of the guest's view of `top` (as QEMU reads it).
fn view(top: &Path, d: &Path) -> String {
    let raw = d.join("view.raw");
    qemu_img(&["convert", "-U", "-O", "raw", s(top), s(&raw)]);
    let h = sha256_file(&raw);
    std::fs::remove_file(&raw).unwrap();
    h
}

/// Every file below the directory and outside it that is not a layer of
/// the chain is as it was; a layer's guest view too (the operations
/// change headers and move data between layers, never what the top
/// reads).
fn assert_only_own_files_changed(
    before: &BTreeMap<PathBuf, String>,
    after: &BTreeMap<PathBuf, String>,
    layers: &[PathBuf],
    when: &str,
) {
    for (path, what) in before {
        if layers.contains(path) {
            continue;
        }
        assert_eq!(
            after.get(path),
            Some(what),
            "{when}: {} changed or went",
            path.display()
        );
    }
}

/// A property over random names and directory contents (side-file
/// suffixes on the layers' own names, files of other programs at the
/// names of side files, symlinks to a file and to a directory outside,
/// FIFOs, names of chain layers as targets): `snapshot`, `merge`,
/// `commit`, `rebase`, `upgrade` and `io`, offline. Each succeeds or is
/// refused in one line (exit 1), never hangs nor panics; every file it did
/// not create, inside the directory and outside it, has the same content
/// and inode afterwards; what QEMU reads through the top is unchanged
/// (or holds the write), and every layer is clean for `qemu-img check`.
#[test]
fn offline_operations_touch_only_what_they_create() {
    let rounds = common::env_count("SQCOW2_SIDE_FILE_ROUNDS", 30u64);
    let (mut refused, mut done) = (0, 0);
    for round in 0..rounds {
        let mut rng = fastrand::Rng::with_seed(0x42_0000 + round);
        let Scene {
            tmp,
            outside,
            layers,
            names,
            target,
        } = Scene::new(&mut rng);
        let d = tmp.path();
        let top = layers[2].clone();
        let before_view = view(&top, outside.path());
        let before = state(&[d, outside.path()]);
        let new = d.join(&target);
        let op = rng.u8(..6);
        let args: Vec<String> = match op {
            0 => vec!["snapshot".into(), s(&top).into(), s(&new).into()],
            1 => vec![
                "merge".into(),
                s(&top).into(),
                "0".into(),
                "1".into(),
                s(&new).into(),
            ],
            2 => vec!["commit".into(), s(&top).into()],
            3 => vec![
                "rebase".into(),
                "-b".into(),
                names[0].clone(),
                "-F".into(),
                "qcow2".into(),
                s(&top).into(),
            ],
            4 => vec!["upgrade".into(), s(&top).into()],
            _ => vec![
                "io".into(),
                "-c".into(),
                "write -P 0x7e 5M 64k".into(),
                s(&top).into(),
            ],
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = run_sqcow2(&args);
        let when = format!("round {round}: {args:?}");
        assert!(
            matches!(code, Some(0) | Some(1)),
            "{when}: exit {code:?} (None: hung): {stderr}"
        );
        if code == Some(1) {
            refused += 1;
            assert_eq!(
                stderr.trim().lines().count(),
                1,
                "{when}: one line: {stderr}"
            );
        } else {
            done += 1;
        }
        let after = state(&[d, outside.path()]);
        assert_only_own_files_changed(&before, &after, &layers, &when);
        // The guest's view through the top: unchanged, or with the write.
        if op == 5 && code == Some(0) {
            qemu_io(&top, &["read -P 0x7e 5M 64k".into()]);
        } else {
            assert_eq!(
                view(&top, outside.path()),
                before_view,
                "{when}: the top's view changed"
            );
        }
        if code == Some(0) && matches!(op, 0 | 1) {
            qemu_img(&["check", s(&new)]);
        }
        for layer in &layers {
            qemu_img(&["check", "-U", s(layer)]);
        }
    }
    eprintln!("{done} operations done, {refused} refused");
    assert!(
        done > 0 && refused > 0,
        "both outcomes seen ({done} done, {refused} refused)"
    );
}

/// The same property live: `serve` of a chain with random names and
/// files of other owners at its side files' names, a client writing, then
/// a live snapshot or merge to a random name (a layer's name among them).
/// The daemon starts (or refuses in one line), every acknowledged write
/// reads back through it and through QEMU after the stop, and nothing it
/// did not create changes.
#[test]
fn live_operations_touch_only_what_they_create() {
    let rounds = common::env_count("SQCOW2_SIDE_FILE_LIVE_ROUNDS", 8u64);
    for round in 0..rounds {
        let mut rng = fastrand::Rng::with_seed(0x42_1000 + round);
        let Scene {
            tmp,
            outside,
            layers,
            names,
            target,
        } = Scene::new(&mut rng);
        let d = tmp.path();
        let top = layers[2].clone();
        let before = state(&[d, outside.path()]);
        let when = format!("round {round}: layers {names:?}, target {target}");
        // (The reference's own file elsewhere: its check of every
        // `.qcow2` file of a directory would meet the distractors.)
        let scratch = tempfile::tempdir().unwrap();
        let mut reference = Reference::new(&top, scratch.path(), BLOCK);
        let ctl = d.join("control.sock");
        let mut daemon = Daemon::start(d, &top, &["--control", s(&ctl)]);
        let mut client = connect_retry(&daemon, 1, false);
        write_blocks(&mut client, &mut reference, round, 40);
        let new = d.join(&target);
        let request = if rng.bool() {
            json!({"command": "snapshot", "path": new})
        } else {
            json!({"command": "merge", "first": 0, "last": 1, "path": new})
        };
        let r = control(&ctl, request.clone());
        let mut chain_files = layers.clone();
        if r["ok"] == true {
            if request["command"] == "merge" {
                for _ in 0..600 {
                    let m = control(&ctl, json!({"command": "stats"}))["result"]["merge"].clone();
                    if m["state"] == "done" || m["state"] == "failed" || m["state"] == "cancelled" {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            chain_files.push(new.clone());
        } else {
            let message = r["error"]["message"].as_str().unwrap_or("");
            assert!(
                !message.is_empty() && !message.contains('\n'),
                "{when}: {r}"
            );
        }
        write_blocks(&mut client, &mut reference, round + 100, 40);
        reference.verify_through(&mut client, &when);
        drop(client);
        let info = control(&ctl, json!({"command": "info"}));
        let served_top = PathBuf::from(info["result"]["top"].as_str().unwrap());
        daemon.stop();
        let after = state(&[d, outside.path()]);
        assert_only_own_files_changed(&before, &after, &chain_files, &when);
        reference.verify_for_qemu(&served_top, scratch.path());
        for layer in &chain_files {
            if layer.exists() {
                qemu_img(&["check", s(layer)]);
            }
        }
    }
}

/// Live snapshots into a subdirectory of the backing root while another
/// thread swaps that subdirectory for a symlink to a directory outside
/// the root, back and forth: each snapshot is made inside the root or
/// refused, nothing is ever created, changed or even opened outside it
/// (before: temporary files and indexes appeared there; later, an index
/// just built was reopened by its path and a decoy outside opened), and
/// every acknowledged write reads back.
#[test]
fn swapping_a_directory_for_a_symlink_never_redirects_a_create() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let sub = root.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let base = sub.join("base.qcow2");
    create(&base, "64M");
    let scratch = tempfile::tempdir().unwrap();
    let mut reference = Reference::new(&base, scratch.path(), BLOCK);
    let ctl = root.join("control.sock");
    let mut daemon = Daemon::start(
        root,
        &base,
        &["--control", s(&ctl), "--backing-root", s(root)],
    );
    let mut client = connect_retry(&daemon, 1, false);
    // Decoys outside where the new tops' side files would be reached
    // through the symlink: never opened, never changed.
    for i in 0..60 {
        let mut decoy = b"SQC2INDX".to_vec();
        decoy.extend_from_slice(&[0u8; 4088]);
        std::fs::write(
            outside.path().join(format!("snap{i:03}.qcow2.sqidx")),
            decoy,
        )
        .unwrap();
    }
    let decoys = state(&[outside.path()]);
    let watching = Arc::new(AtomicBool::new(false));
    let opens = count_opens(outside.path(), watching.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (sub, outside, stop) = (sub.clone(), outside.path().to_path_buf(), stop.clone());
        let aside = sub.with_file_name("sub.real");
        std::thread::spawn(move || {
            let mut swaps = 0u64;
            while !stop.load(Ordering::Relaxed) {
                std::fs::rename(&sub, &aside).unwrap();
                std::os::unix::fs::symlink(&outside, &sub).unwrap();
                std::thread::sleep(Duration::from_micros(300));
                std::fs::remove_file(&sub).unwrap();
                std::fs::rename(&aside, &sub).unwrap();
                std::thread::sleep(Duration::from_micros(300));
                swaps += 1;
            }
            swaps
        })
    };
    let (mut made, mut refused) = (0, 0);
    for i in 0..60u64 {
        let r = control(
            &ctl,
            json!({"command": "snapshot", "path": sub.join(format!("snap{i:03}.qcow2"))}),
        );
        if r["ok"] == true {
            made += 1;
        } else {
            refused += 1;
        }
        write_blocks(&mut client, &mut reference, i, 4);
    }
    // (The index builds after the last snapshots.)
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    watching.store(true, Ordering::Relaxed);
    // (Counted before this test reads them itself.)
    assert_eq!(
        opens.join().unwrap(),
        0,
        "files outside the root were opened"
    );
    assert_eq!(
        decoys,
        state(&[outside.path()]),
        "created or changed outside the root"
    );
    reference.verify_through(&mut client, "after the swaps");
    drop(client);
    let info = control(&ctl, json!({"command": "info"}));
    let top = PathBuf::from(info["result"]["top"].as_str().unwrap());
    daemon.stop();
    eprintln!("{made} snapshots made, {refused} refused, {swaps} swaps");
    assert!(made > 0, "no snapshot was made");
    reference.verify_for_qemu(&top, scratch.path());
    assert_eq!(decoys, state(&[outside.path()]));
}

/// Waits for the live merge to end; its final state.
fn merge_end(ctl: &Path) -> serde_json::Value {
    for _ in 0..1200 {
        let m = control(ctl, json!({"command": "stats"}))["result"]["merge"].clone();
        if m["state"] != "copying" && m["state"] != "switching" && m["state"] != "measuring" {
            return m;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the merge did not end within 60 s");
}

/// A file outside the root, with data, and its state.
fn victim_image(outside: &Path) -> PathBuf {
    let victim = outside.join("victim.qcow2");
    create(&victim, "64M");
    qemu_io(&victim, &["write -P 0x77 0 1M".into()]);
    victim
}

/// Files swapped at the names of a served chain's layers while it is
/// served (an attacker who can write inside the backing root): the served
/// top replaced by a symlink to an image outside the root before a live
/// merge reopens the chain; the layer above a merge's range replaced by
/// such a symlink before the switch rewrites its backing name; the base
/// replaced by an image whose backing file is a file outside the root
/// before the merge copies it. The last two merges fail; the first goes
/// on with the top the daemon has open (its name is never reopened).
/// The daemon keeps serving the chain it served (every write reads back),
/// the file outside is never written, and no byte of it reaches the
/// guest's disk (before: the daemon took the image outside as its
/// writable top; wrote the old backing name into it; copied the secret
/// into the merge file).
#[test]
fn live_merges_never_reopen_a_swapped_layer() {
    for case in ["top", "above", "base"] {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let vm = root.join("vm");
        let top = common::gen_chain(&vm, 4, "64M", "0.3");
        let mut reference = Reference::new(&top, outside.path(), BLOCK);
        let ctl = root.join("control.sock");
        let mut daemon = Daemon::start(
            root,
            &top,
            &["--control", s(&ctl), "--backing-root", s(root)],
        );
        let mut client = connect_retry(&daemon, 1, false);
        write_blocks(&mut client, &mut reference, 1, 20);
        let victim = victim_image(outside.path());
        let secret = outside.path().join("secret.raw");
        std::fs::write(&secret, b"TOPSECRET-OUTSIDE-ROOT".repeat(3000)).unwrap();
        let swap = |name: &Path, to: &Path| {
            let aside = name.with_extension("swap");
            std::os::unix::fs::symlink(to, &aside).unwrap();
            std::fs::rename(&aside, name).unwrap();
        };
        match case {
            "top" => {
                let r = control(
                    &ctl,
                    json!({"command": "snapshot", "path": vm.join("s.qcow2")}),
                );
                assert_eq!(r["ok"], true, "{r}");
                swap(&vm.join("s.qcow2"), &victim);
            }
            "above" => swap(&vm.join("layer0002.qcow2"), &victim),
            _ => {
                let evil = vm.join("evil.qcow2");
                qemu_img(&[
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-b",
                    s(&secret),
                    "-F",
                    "raw",
                    s(&evil),
                    "64M",
                ]);
                std::fs::rename(&evil, vm.join("layer0000.qcow2")).unwrap();
            }
        }
        let before = state(&[outside.path()]);
        write_blocks(&mut client, &mut reference, 2, 20);
        let m = vm.join("m.qcow2");
        let r = control(
            &ctl,
            json!({"command": "merge", "first": 0, "last": 1, "path": m}),
        );
        if r["ok"] == true {
            let end = merge_end(&ctl);
            // The top is the file the daemon has open, whatever its name
            // holds now: that merge may go through (on that file).
            if case != "top" {
                assert_eq!(end["state"], "failed", "{case}: {end}");
            }
        }
        write_blocks(&mut client, &mut reference, 3, 20);
        reference.verify_through(&mut client, case);
        // What the daemon serves holds no byte of the file outside (QEMU,
        // reading the files by name now, would read the swapped base).
        let disk = client.capacity();
        let mut at = 0;
        while at < disk {
            let bytes = client.read(at, 1 << 20);
            assert!(
                !bytes.windows(9).any(|w| w == b"TOPSECRET"),
                "{case}: served at {at}"
            );
            at += 1 << 20;
        }
        let info = control(&ctl, json!({"command": "info"}));
        assert!(
            info["result"]["layers"].as_u64().unwrap() >= 4,
            "{case}: {info}"
        );
        drop(client);
        daemon.stop();
        let after = state(&[outside.path()]);
        for path in [&victim, &secret] {
            assert_eq!(
                before.get(path),
                after.get(path),
                "{case}: {} written",
                path.display()
            );
        }
        if m.exists() {
            let bytes = std::fs::read(&m).unwrap();
            assert!(
                !bytes.windows(9).any(|w| w == b"TOPSECRET"),
                "{case}: the secret reached the merge file"
            );
        }
    }
}

/// `--pidfile` naming an existing file that is not a stale pidfile (a
/// file of other content, the pidfile of a running process): refused,
/// the file untouched and not removed (before: emptied, then deleted at
/// exit). A stale pidfile (a dead process's) is taken over and removed at
/// exit.
#[test]
fn the_pidfile_takes_over_only_a_stale_pidfile() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = d.join("top.qcow2");
    create(&top, "16M");
    let sock = d.join("v.sock");
    for (content, why) in [
        ("precious notes\n".to_string(), "not a pidfile"),
        (format!("{}\n", std::process::id()), "running process"),
    ] {
        let pidfile = d.join("other.pid");
        std::fs::write(&pidfile, &content).unwrap();
        let (code, stderr) = run_sqcow2(&[
            "serve",
            "--socket",
            s(&sock),
            "--pidfile",
            s(&pidfile),
            s(&top),
        ]);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains(why), "{stderr}");
        assert_eq!(std::fs::read_to_string(&pidfile).unwrap(), content);
    }
    // A dead process's pidfile: taken over, removed at exit.
    let mut dead = Command::new("true").spawn().unwrap();
    let pid = dead.id();
    dead.wait().unwrap();
    let pidfile = d.join("serve.pid");
    std::fs::write(&pidfile, format!("{pid}\n")).unwrap();
    let mut child = Command::new(sqcow2_bin())
        .args([
            "serve",
            "--socket",
            s(&sock),
            "--pidfile",
            s(&pidfile),
            s(&top),
        ])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(&pidfile).unwrap_or_default() != format!("{}\n", child.id()) {
        assert!(
            Instant::now() < deadline,
            "the stale pidfile was not taken over"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    assert!(!pidfile.exists());
}

/// A snapshot or merge killed right at its rename (`strace` injects
/// SIGKILL into `renameat2`) leaves its temporary file marked in its
/// header: the next snapshot or merge to the same name removes it and
/// succeeds (before: the mark was cleared before the rename, and the
/// leftover was refused forever).
#[test]
fn a_kill_at_the_rename_leaves_a_leftover_that_is_cleaned() {
    if Command::new("strace").arg("-V").output().is_err() {
        panic!("strace is needed (scripts/test.sh installs it)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = common::gen_chain(d, 3, "64M", "0.3");
    for (args, leftover) in [
        (
            vec![
                "snapshot".to_string(),
                s(&top).into(),
                s(&d.join("new.qcow2")).into(),
            ],
            "new.qcow2.sqtmp",
        ),
        (
            vec![
                "merge".into(),
                s(&top).into(),
                "0".into(),
                "1".into(),
                s(&d.join("m.qcow2")).into(),
            ],
            "m.qcow2.sqtmp",
        ),
    ] {
        let out = run_raw(
            Command::new("strace")
                .args([
                    "-f",
                    "-o",
                    "/dev/null",
                    "-e",
                    "inject=renameat2:signal=SIGKILL",
                ])
                .arg(sqcow2_bin())
                .args(&args),
        );
        assert!(!out.status.success());
        assert!(d.join(leftover).exists(), "{args:?}: no leftover to clean");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        sqcow2(&args);
        assert!(!d.join(leftover).exists(), "{args:?}: the leftover stayed");
    }
    qemu_img(&["check", s(&d.join("new.qcow2"))]);
    qemu_img(&["check", s(&d.join("m.qcow2"))]);
}

/// Replaces `dir/name` by a symlink to `target` right after the `n`-th
/// open of the name `on` in `dir` (`""`: of `dir` itself) (inotify), from
/// another thread: the other local user who can write in an image's
/// directory, racing an operation.
fn swap_after_open_of(
    dir: &Path,
    on: &str,
    name: &str,
    n: usize,
    target: &Path,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<bool> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: inotify_init1 takes flags only; the descriptor is ours.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    assert!(fd >= 0);
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid descriptor and a NUL-terminated path.
    assert!(unsafe { libc::inotify_add_watch(fd, c.as_ptr(), libc::IN_OPEN) } >= 0);
    let (dir, name, target) = (dir.to_path_buf(), name.to_string(), target.to_path_buf());
    let on = on.to_string();
    std::thread::spawn(move || {
        let mut seen = 0;
        let mut buf = [0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline && !done.load(std::sync::atomic::Ordering::Relaxed) {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd this function owns.
            if unsafe { libc::poll(&mut pfd, 1, 100) } <= 0 {
                continue;
            }
            // SAFETY: reads into a buffer this function owns.
            let n_read = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            let mut i = 0usize;
            while n_read > 0 && i + 16 <= n_read as usize {
                let len = u32::from_ne_bytes(buf[i + 12..i + 16].try_into().unwrap()) as usize;
                let got = &buf[i + 16..i + 16 + len];
                let got = &got[..got.iter().position(|b| *b == 0).unwrap_or(len)];
                i += 16 + len;
                if got == on.as_bytes() {
                    seen += 1;
                    if seen == n {
                        let aside = dir.join(".swap");
                        std::os::unix::fs::symlink(&target, &aside).unwrap();
                        std::fs::rename(&aside, dir.join(&name)).unwrap();
                        // SAFETY: our descriptor, closed once.
                        unsafe { libc::close(fd) };
                        return true;
                    }
                }
            }
        }
        // SAFETY: as above.
        unsafe { libc::close(fd) };
        false
    })
}

/// [`swap_after_open_of`] counting the opens of `name` itself.
fn swap_after_open(
    dir: &Path,
    name: &str,
    n: usize,
    target: &Path,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<bool> {
    swap_after_open_of(dir, name, name, n, target, done)
}

/// Offline `commit` and `rebase` reopen the image by name several times;
/// another local user replaces it by a symlink to an image elsewhere
/// right after its n-th open, for each n: the operation succeeds or is
/// refused, and the image elsewhere is never written (before: `commit`
/// emptied it, `rebase` wrote the new backing name into it).
#[test]
fn offline_operations_never_write_a_file_swapped_in() {
    let mut swaps = 0;
    for op in ["commit", "rebase"] {
        for n in 1..=6 {
            let tmp = tempfile::tempdir().unwrap();
            let outside = tempfile::tempdir().unwrap();
            let d = tmp.path();
            create(&d.join("base.qcow2"), "64M");
            create(&d.join("base2.qcow2"), "64M");
            overlay(&d.join("top.qcow2"), "base.qcow2");
            qemu_io(&d.join("top.qcow2"), &["write -P 0x11 0 8M".into()]);
            let victim = victim_image(outside.path());
            let before = state(&[outside.path()]);
            let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let racer = swap_after_open(d, "top.qcow2", n, &victim, done.clone());
            let top = d.join("top.qcow2");
            let args: Vec<&str> = match op {
                "commit" => vec!["commit", s(&top)],
                _ => vec!["rebase", "-b", "base2.qcow2", "-F", "qcow2", s(&top)],
            };
            let (code, stderr) = run_sqcow2(&args);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            swaps += usize::from(racer.join().unwrap());
            assert!(
                matches!(code, Some(0) | Some(1)),
                "{op} n={n}: {code:?} {stderr}"
            );
            assert_eq!(
                before,
                state(&[outside.path()]),
                "{op} n={n}: the file elsewhere was written: {stderr}"
            );
        }
    }
    assert!(swaps > 0, "no swap happened");
}

/// A process killed at its first write (`strace` injects SIGKILL into the
/// first `pwrite64`: the header of a new top's temporary file, of a
/// journal) leaves nothing under a side file's name: a side file appears
/// under its name only with its header (`O_TMPFILE`, then `linkat`). The
/// next snapshot succeeds and the next writer has its journal (before: an
/// empty `.sqtmp` refused every later snapshot of that name, an empty
/// journal left the image without one for good).
#[test]
fn a_kill_before_a_side_files_header_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = common::gen_chain(d, 3, "64M", "0.3");
    let new = d.join("new.qcow2");
    for args in [
        vec!["snapshot", s(&top), s(&new)],
        vec!["io", "-c", "write -P 0x5e 0 64k", s(&top)],
    ] {
        let out = run_raw(
            Command::new("strace")
                .args([
                    "-f",
                    "-o",
                    "/dev/null",
                    "-e",
                    "inject=pwrite64:signal=SIGKILL:when=1",
                ])
                .arg(sqcow2_bin())
                .args(&args),
        );
        assert!(!out.status.success(), "{args:?}: not killed");
        let left: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sqtmp") || n.ends_with(".sqjournal") || n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{args:?}: left {left:?}");
    }
    sqcow2(&["snapshot", s(&top), s(&new)]);
    let (code, stderr) = run_sqcow2(&["io", "-c", "write -P 0x5e 0 64k", s(&new)]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("no mapping journal"), "{stderr}");
    qemu_io(&new, &["read -P 0x5e 0 64k".into()]);
}

/// A header that names another image's index (`layer0002.qcow2.sqidx`,
/// the index of the chain beside it; a hostile image, or one renamed
/// since): serving it never replaces that index (before: the daemon's
/// index build renamed its own over it, and the other chain lost its
/// index). The image is served, walked.
#[test]
fn a_header_never_makes_another_images_index_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let top = common::gen_chain(d, 3, "64M", "0.3");
    let other_index = d.join("layer0002.qcow2.sqidx");
    assert!(other_index.exists());
    // An image of the same name length over the chain's base (the other
    // index does not fit it: the daemon builds one), its index name
    // patched to the other image's.
    let evil = d.join("layer0009.qcow2");
    sqcow2(&["snapshot", s(&d.join("layer0000.qcow2")), s(&evil)]);
    let mut bytes = std::fs::read(&evil).unwrap();
    let from = b"layer0009.qcow2.sqidx";
    let at = bytes[..65536]
        .windows(from.len())
        .position(|w| w == from)
        .expect("the index name in the header");
    bytes[at..at + from.len()].copy_from_slice(b"layer0002.qcow2.sqidx");
    std::fs::write(&evil, &bytes).unwrap();
    let before = state(&[d]);
    let ctl = d.join("control.sock");
    let mut daemon = Daemon::start(d, &evil, &["--control", s(&ctl)]);
    // A live snapshot and the index build after it.
    let r = control(
        &ctl,
        json!({"command": "snapshot", "path": d.join("next.qcow2")}),
    );
    assert_eq!(r["ok"], true, "{r}");
    std::thread::sleep(Duration::from_millis(500));
    daemon.stop();
    assert_eq!(
        before.get(&other_index),
        state(&[d]).get(&other_index),
        "the other image's index was replaced:\n{}",
        daemon.log()
    );
    let info = sqcow2(&["info", s(&top)]);
    assert!(info.contains("chain index: valid"), "{info}");
}

/// A backing layer that a writer left with its journal bit (a tenant can
/// set it) is repaired by the next writable open; another local user
/// swaps its name for a symlink to a dirty image elsewhere right after the
/// directory is opened for the repair (the layer was opened and checked
/// before), and every `openat` in the directory is held back 300 ms
/// (`strace` delays them) so that the swap lands before any later open by
/// name: the repair writes
/// through the descriptor opened (checked), never into the file elsewhere
/// (before: `check -r` reopened the name and cleared the other image's
/// dirty bit).
#[test]
fn a_backing_layer_repair_never_reopens_its_name() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let base = d.join("base.qcow2");
    create(&base, "64M");
    qemu_io(&base, &["write -P 0x31 0 1M".into()]);
    // The journal bit (autoclear bit 62) and the dirty bit, as a writer
    // that died leaves them.
    let mut h = std::fs::read(&base).unwrap();
    h[88] |= 0x40;
    h[79] |= 1;
    std::fs::write(&base, &h).unwrap();
    let top = d.join("top.qcow2");
    overlay(&top, "base.qcow2");
    let victim = victim_image(outside.path());
    let mut v = std::fs::read(&victim).unwrap();
    v[79] |= 1;
    std::fs::write(&victim, &v).unwrap();
    let before = state(&[outside.path()]);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The directory's opens: the top's place, then the repair's.
    let racer = swap_after_open_of(d, "", "base.qcow2", 2, &victim, done.clone());
    let out = run_raw(
        Command::new("strace")
            .args(["-f", "-o", "/dev/null", "-P"])
            .arg(d)
            .args(["-e", "inject=openat:delay_enter=300000"])
            .arg(sqcow2_bin())
            .args(["io", "-c", "write -P 0x32 1M 64k"])
            .arg(&top),
    );
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(racer.join().unwrap(), "no swap");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0) | Some(1)), "{stderr}");
    assert_eq!(
        before,
        state(&[outside.path()]),
        "the file elsewhere was written: {stderr}"
    );
}

/// Sets autoclear bits of the qcow2 v3 image at `path` (byte 88 on).
fn set_autoclear(path: &Path, bits: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut w = [0u8; 8];
    f.read_exact_at(&mut w, 88).unwrap();
    let w = u64::from_be_bytes(w) | bits;
    f.write_all_at(&w.to_be_bytes(), 88).unwrap();
}

/// Sets the dirty bit of the qcow2 v3 image at `path`.
fn set_dirty(path: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 79).unwrap();
    f.write_all_at(&[b[0] | 1], 79).unwrap();
}

/// A journal as a dead writer of the file `id` would have left, on this
/// boot, with one record writing `word` at `offset` (the format of
/// `docs/format.md`).
fn forged_journal(id: (u64, u64), offset: u64, word: u64) -> Vec<u8> {
    const CAPACITY: u64 = 262144;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let hex: String = boot.trim().chars().filter(|c| *c != '-').collect();
    let mut h = vec![0u8; 4096];
    h[0..8].copy_from_slice(b"SQJOURNL");
    h[8..12].copy_from_slice(&1u32.to_be_bytes());
    h[12..16].copy_from_slice(&64u32.to_be_bytes());
    h[16..24].copy_from_slice(&CAPACITY.to_be_bytes());
    for i in 0..16 {
        h[24 + i] = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    h[40..48].copy_from_slice(&id.0.to_be_bytes());
    h[48..56].copy_from_slice(&id.1.to_be_bytes());
    let epoch = 7u64;
    h[56..64].copy_from_slice(&epoch.to_be_bytes());
    let crc = crc32c::crc32c(&h[0..64]);
    h[64..68].copy_from_slice(&crc.to_be_bytes());
    let mut r = [0u8; 64];
    r[0..4].copy_from_slice(b"SQJR");
    r[4] = 1;
    r[8..16].copy_from_slice(&epoch.to_be_bytes());
    r[16..24].copy_from_slice(&1u64.to_be_bytes());
    r[24..32].copy_from_slice(&offset.to_be_bytes());
    r[32..40].copy_from_slice(&word.to_be_bytes());
    let crc = crc32c::crc32c(&r[0..60]);
    r[60..64].copy_from_slice(&crc.to_be_bytes());
    h.resize(4096 + 64 * 2, 0);
    h[4096 + 64..4096 + 128].copy_from_slice(&r);
    h
}

/// A layer named through a symlink in another directory (`A/x.qcow2 ->
/// ../B/disk.qcow2`) whose file a dead writer left with its journal bit:
/// a journal put beside the symlink (`A/x.qcow2.sqjournal`, forged by the
/// owner of A for B's file) is never replayed into B nor removed; the
/// repair looks beside the file itself. B's data stays (before: the
/// forged record zeroed B's L1 entry, B read zeros).
#[test]
fn a_journal_beside_a_symlink_is_nobodys() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("A"), tmp.path().join("B"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let disk = b.join("disk.qcow2");
    create(&disk, "64M");
    qemu_io(&disk, &["write -P 0x77 0 1M".into()]);
    set_autoclear(&disk, 1 << 62);
    set_dirty(&disk);
    let meta = std::fs::metadata(&disk).unwrap();
    let l1 = u64::from_be_bytes(std::fs::read(&disk).unwrap()[40..48].try_into().unwrap());
    std::os::unix::fs::symlink("../B/disk.qcow2", a.join("x.qcow2")).unwrap();
    let forged = a.join("x.qcow2.sqjournal");
    std::fs::write(&forged, forged_journal((meta.dev(), meta.ino()), l1, 0)).unwrap();
    let top = a.join("top.qcow2");
    overlay(&top, "x.qcow2");
    let before = state(&[&a]);
    let (code, stderr) = run_sqcow2(&["io", "-c", "write -P 0x11 32M 64k", s(&top)]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("replayed"), "{stderr}");
    assert_eq!(
        before.get(&forged),
        state(&[&a]).get(&forged),
        "the journal beside the symlink went"
    );
    qemu_io(&disk, &["read -P 0x77 0 1M".into()]);
    qemu_img(&["check", s(&disk)]);
}

/// An image named like a temporary file (`new.sqtmp`, made by QEMU or
/// left by a kill after a publish's rename, with the unpublished bit):
/// `serve` of it never removes it as a leftover, and its first writable
/// open clears the bit; a new image of sqcow2's is never given such a name
/// (before: the served top and its journal were removed at the start).
#[test]
fn an_image_named_like_a_temporary_is_never_swept() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let image = d.join("new.sqtmp");
    create(&image, "64M");
    qemu_io(&image, &["write -P 0x42 0 1M".into()]);
    set_autoclear(&image, 1 << 61);
    let mut daemon = Daemon::start(d, &image, &[]);
    let mut client = connect_retry(&daemon, 1, false);
    client.write(1 << 20, &vec![0x43; BLOCK as usize]);
    client.flush();
    drop(client);
    daemon.stop();
    assert!(
        image.exists(),
        "the served image was removed:\n{}",
        daemon.log()
    );
    qemu_io(
        &image,
        &["read -P 0x42 0 1M".into(), "read -P 0x43 1M 64k".into()],
    );
    let word = u64::from_be_bytes(std::fs::read(&image).unwrap()[88..96].try_into().unwrap());
    assert_eq!(word & (1 << 61), 0, "the unpublished bit stayed");
    assert_refused(
        &["snapshot", s(&image), s(&d.join("other.sqtmp"))],
        "other.sqtmp",
    );
}

/// A top served through a symlink (`cur.qcow2 -> layer0003.qcow2`, as
/// QEMU accepts it) keeps its side files beside the file: after a live
/// merge its index is rebuilt (before: refused, "not the image's own"
/// name, and the chain was walked from then on).
#[test]
fn a_top_served_through_a_symlink_is_indexed_after_a_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    common::gen_chain(d, 4, "64M", "0.3");
    let cur = d.join("cur.qcow2");
    std::os::unix::fs::symlink("layer0003.qcow2", &cur).unwrap();
    let ctl = d.join("control.sock");
    let mut daemon = Daemon::start(d, &cur, &["--control", s(&ctl)]);
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 0, "last": 1, "path": d.join("m.qcow2")}),
    );
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(merge_end(&ctl)["state"], "done");
    let indexed = common::vhost::wait_indexed(&ctl);
    assert_eq!(
        indexed["result"]["index"]["last-error"],
        serde_json::Value::Null,
        "{indexed}"
    );
    daemon.stop();
    let info = sqcow2(&["info", s(&cur)]);
    assert!(info.contains("chain index: valid"), "{info}");
}

/// A backing file that is a FIFO with a writer blocked on it: refused
/// without the FIFO being opened (the writer stays blocked; before, the
/// open without waiting released it, and earlier still the open hung).
#[test]
fn a_fifo_backing_file_is_never_opened() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let fifo = d.join("fifo");
    mkfifo(&fifo);
    let top = d.join("top.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        "fifo",
        "-F",
        "raw",
        s(&top),
        "64M",
    ]);
    let mut writer = Command::new("sh")
        .arg("-c")
        .arg(format!("echo released > {}", s(&fifo)))
        .spawn()
        .unwrap();
    for args in [
        vec!["info", "--backing-chain", s(&top)],
        vec!["map", s(&top)],
    ] {
        let (code, stderr) = run_sqcow2(&args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        writer.try_wait().unwrap().is_none(),
        "the FIFO was opened: its writer was released"
    );
    let _ = writer.kill();
    let _ = writer.wait();
}

/// `gen-chain` into a directory where a file of its names exists: refused,
/// the file kept (before: emptied and rewritten).
#[test]
fn gen_chain_never_overwrites_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    std::fs::write(d.join("layer0000.qcow2"), b"mine").unwrap();
    assert_refused(
        &["gen-chain", "--layers", "2", "--size", "16M", s(d)],
        "layer0000.qcow2",
    );
    assert_eq!(std::fs::read(d.join("layer0000.qcow2")).unwrap(), b"mine");
}

/// Counts the opens (inotify `IN_OPEN`) of anything in `dir` until `done`.
fn count_opens(
    dir: &Path,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: inotify_init1 takes flags only; the descriptor is ours.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
    assert!(fd >= 0);
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid descriptor and a NUL-terminated path.
    assert!(unsafe { libc::inotify_add_watch(fd, c.as_ptr(), libc::IN_OPEN) } >= 0);
    std::thread::spawn(move || {
        let mut opens = 0;
        let mut buf = [0u8; 4096];
        loop {
            let last = done.load(std::sync::atomic::Ordering::Relaxed);
            // SAFETY: reads into a buffer this function owns.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            let mut i = 0usize;
            while n > 0 && i + 16 <= n as usize {
                let len = u32::from_ne_bytes(buf[i + 12..i + 16].try_into().unwrap()) as usize;
                opens += 1;
                i += 16 + len;
            }
            if last && n <= 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: our descriptor, closed once.
        unsafe { libc::close(fd) };
        opens
    })
}

/// The served top's name swapped for a symlink to a copy outside the
/// backing root (with an index beside it), then a live merge and an
/// inactivation and activation, which reopen the chain: nothing outside
/// the root is opened, not even to read (before: the index beside the
/// copy was opened and checked).
#[test]
fn a_reopened_chain_opens_nothing_outside_the_root() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let vm = root.join("vm");
    let top = common::gen_chain(&vm, 4, "64M", "0.3");
    for name in ["layer0003.qcow2", "layer0003.qcow2.sqidx"] {
        std::fs::copy(vm.join(name), outside.path().join(name)).unwrap();
    }
    let ctl = root.join("control.sock");
    let mut daemon = Daemon::start(
        root,
        &top,
        &["--control", s(&ctl), "--backing-root", s(root)],
    );
    let aside = vm.join("swap");
    std::os::unix::fs::symlink(outside.path().join("layer0003.qcow2"), &aside).unwrap();
    std::fs::rename(&aside, &top).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opens = count_opens(outside.path(), done.clone());
    let r = control(
        &ctl,
        json!({"command": "merge", "first": 0, "last": 1, "path": vm.join("m.qcow2")}),
    );
    assert_eq!(r["ok"], true, "{r}");
    merge_end(&ctl);
    for command in ["inactivate", "activate"] {
        let r = control(&ctl, json!({"command": command}));
        assert_eq!(r["ok"], true, "{command}: {r}");
    }
    daemon.stop();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        opens.join().unwrap(),
        0,
        "files outside the root were opened:\n{}",
        daemon.log()
    );
}

/// `upgrade` of a top named through a symlink (`links/a -> ../store/l.qcow2`,
/// QEMU-style) names the index after the file (`store/l.qcow2.sqidx`,
/// beside it), so that it is the image's own whichever name opens it:
/// `upgrade` again rebuilds it (before: `store/a.sqidx`, then refused as
/// "not the image's own" for good). `serve` refuses a top whose name
/// points outside the backing root, creating nothing there.
#[test]
fn side_files_follow_the_file_not_the_name() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let store = d.join("store");
    common::gen_chain(&store, 3, "64M", "0.3");
    std::fs::create_dir(d.join("links")).unwrap();
    // The backing names, relative to the name opened (as QEMU resolves
    // them), reach the store through links too.
    for l in ["layer0000.qcow2", "layer0001.qcow2"] {
        std::os::unix::fs::symlink(format!("../store/{l}"), d.join("links").join(l)).unwrap();
    }
    std::os::unix::fs::symlink("../store/layer0002.qcow2", d.join("links/a")).unwrap();
    for _ in 0..2 {
        sqcow2(&["upgrade", s(&d.join("links/a"))]);
        assert!(store.join("layer0002.qcow2.sqidx").exists());
        assert!(!store.join("a.sqidx").exists() && !d.join("links/a.sqidx").exists());
        let info = sqcow2(&["info", s(&d.join("links/a"))]);
        assert!(info.contains("chain index: valid"), "{info}");
    }
    let before = state(&[&store]);
    let root = d.join("links");
    let (code, stderr) = run_sqcow2(&[
        "serve",
        "--socket",
        s(&d.join("v.sock")),
        "--backing-root",
        s(&root),
        s(&d.join("links/a")),
    ]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("outside the backing root"), "{stderr}");
    assert_eq!(before, state(&[&store]));
}

/// `serve` started again and again while another local user swaps the
/// top's name with a symlink to an image outside the backing root: each
/// start serves the image inside or is refused; the image outside is
/// never opened (before: the name was checked, then opened again, and the
/// daemon served, and wrote, the image outside).
#[test]
fn a_top_swapped_at_start_is_never_served_from_outside() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let top = root.join("top.qcow2");
    create(&top, "16M");
    let victim = victim_image(outside.path());
    let before = state(&[outside.path()]);
    let link = root.join("link");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let watching = Arc::new(AtomicBool::new(false));
    let opens = count_opens(outside.path(), watching.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let (top, link, stop) = (top.clone(), link.clone(), stop.clone());
        std::thread::spawn(move || {
            use std::os::unix::ffi::OsStrExt;
            let a = std::ffi::CString::new(top.as_os_str().as_bytes()).unwrap();
            let b = std::ffi::CString::new(link.as_os_str().as_bytes()).unwrap();
            let mut flips = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: two NUL-terminated paths this thread owns.
                let r = unsafe {
                    libc::renameat2(
                        libc::AT_FDCWD,
                        a.as_ptr(),
                        libc::AT_FDCWD,
                        b.as_ptr(),
                        libc::RENAME_EXCHANGE,
                    )
                };
                flips += u64::from(r == 0);
            }
            flips
        })
    };
    let (mut served, mut refused) = (0, 0);
    for _ in 0..20 {
        let sock = root.join("v.sock");
        let mut child = Command::new(sqcow2_bin())
            .args(["serve", "--socket", s(&sock), s(&top)])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if child.try_wait().unwrap().is_some() {
                refused += 1;
                break;
            }
            if sock.exists() || Instant::now() > deadline {
                served += 1;
                // SAFETY: kill(2) on our own child.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                child.wait().unwrap();
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let flips = flipper.join().unwrap();
    watching.store(true, Ordering::Relaxed);
    eprintln!("{served} starts served, {refused} refused, {flips} flips");
    assert_eq!(opens.join().unwrap(), 0, "the image outside was opened");
    assert_eq!(
        before,
        state(&[outside.path()]),
        "the image outside was written"
    );
}

/// `serve` of a top named through a symlink in another directory (inside
/// the root only by its file): the start-up sweep runs beside the file,
/// never in the directory of the name (before: a file there that was not
/// sqcow2's was opened for writing, and a leftover there removed, both
/// outside the root); a leftover beside the file is removed.
#[test]
fn the_start_up_sweep_runs_beside_the_served_file() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let (ops, real) = (w.join("ops"), w.join("root/t"));
    std::fs::create_dir_all(&ops).unwrap();
    std::fs::create_dir_all(&real).unwrap();
    create(&real.join("vm.qcow2"), "16M");
    std::os::unix::fs::symlink("../root/t/vm.qcow2", ops.join("vm.qcow2")).unwrap();
    // A leftover of sqcow2's (an image marked unpublished, nobody making
    // it) in each directory, and another program's file in the name's.
    for dir in [&ops, &real] {
        let leftover = dir.join("other.qcow2.sqtmp");
        create(&leftover, "1M");
        set_autoclear(&leftover, 1 << 61);
    }
    std::fs::write(ops.join("notes.sqtmp"), b"not sqcow2's").unwrap();
    let before = state(&[&ops]);
    let root = w.join("root");
    let mut daemon = Daemon::start(&root, &ops.join("vm.qcow2"), &["--backing-root", s(&root)]);
    daemon.stop();
    assert_eq!(before, state(&[&ops]), "the name's directory was touched");
    assert!(
        !real.join("other.qcow2.sqtmp").exists(),
        "the leftover beside the file stayed"
    );
}
