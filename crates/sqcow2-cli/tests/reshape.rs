//! `sqcow2 commit`, `rebase` and `merge` against QEMU: random chains made
//! by qemu-img and qemu-io (data, compressed and zero clusters, discards,
//! different cluster sizes, a raw base, a layer shorter than the others),
//! each operation run by qemu-img on one copy and by sqcow2 on another;
//! `qemu-img compare` must find every file's view equal, `qemu-img check`
//! every file clean.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{assert_check_clean, qemu_img, run_raw, s, sha256_file, sqcow2, sqcow2_bin};

const SIZE: u64 = 8 << 20;

/// A random chain of `layers` files `l0..` in `dir` (l0 raw when
/// `raw_base`); one middle layer is shorter than the others when
/// `short_layer`. Returns the files, base first.
fn random_chain(
    dir: &Path,
    seed: u64,
    layers: usize,
    raw_base: bool,
    short_layer: bool,
) -> Vec<PathBuf> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut files = Vec::new();
    for i in 0..layers {
        let path = dir.join(format!("l{i}.qcow2"));
        let cluster = [4096u64, 65536, 16384][rng.usize(..3)];
        let size = if short_layer && i == layers / 2 {
            SIZE / 2
        } else {
            SIZE
        };
        let raw = raw_base && i == 0;
        let fmt = if raw { "raw" } else { "qcow2" };
        let mut args: Vec<String> = vec!["create".into(), "-q".into(), "-f".into(), fmt.into()];
        if !raw {
            args.push("-o".into());
            args.push(format!("cluster_size={cluster}"));
        }
        if let Some(prev) = files.last() {
            let prev: &PathBuf = prev;
            let prev_fmt = if raw_base && i == 1 { "raw" } else { "qcow2" };
            args.extend([
                "-b".into(),
                prev.file_name().unwrap().to_str().unwrap().into(),
                "-F".into(),
                prev_fmt.into(),
            ]);
        }
        args.push(s(&path).into());
        args.push(size.to_string());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        qemu_img(&args);
        let mut cmd = Command::new("qemu-io");
        cmd.arg("-f").arg(fmt);
        // QEMU refuses a compressed write over an allocated cluster: those
        // go only where this layer has written nothing yet.
        let mut touched = std::collections::HashSet::new();
        for _ in 0..rng.usize(6..16) {
            let c = if raw { 4096 } else { cluster };
            let clusters = size / c;
            let at = rng.u64(..clusters) * c;
            let (op, start, len) = match rng.u8(..10) {
                0..=4 => {
                    let off = at + rng.u64(..c / 512) * 512;
                    let len = (rng.u64(1..(3 * c / 512)) * 512).min(size - off);
                    (format!("write -P {} {off} {len}", rng.u8(1..255)), off, len)
                }
                5 | 6 if !raw => {
                    let len = (c * rng.u64(1..4)).min(size - at);
                    (format!("write -z {at} {len}"), at, len)
                }
                7 if !raw && !touched.contains(&(at / c)) => {
                    (format!("write -c -P {} {at} {c}", rng.u8(1..255)), at, c)
                }
                8 if !raw => (format!("discard {at} {c}"), at, c),
                _ => {
                    let len = c.min(size - at);
                    (format!("write -P {} {at} {len}", rng.u8(1..255)), at, len)
                }
            };
            for k in start / c..(start + len).div_ceil(c) {
                touched.insert(k);
            }
            cmd.arg("-c").arg(op);
        }
        cmd.arg(&path);
        let out = run_raw(&mut cmd);
        assert!(
            out.status.success(),
            "qemu-io: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        files.push(path);
    }
    files
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Every qcow2 file's view (and each raw file's bytes) equal between the
/// two directories, every qcow2 file of `b` clean.
fn assert_dirs_agree(a: &Path, b: &Path, what: &str) {
    let mut names: Vec<_> = std::fs::read_dir(a)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_str().is_some_and(|n| n.ends_with(".qcow2")))
        .collect();
    names.sort();
    for name in names {
        let (fa, fb) = (a.join(&name), b.join(&name));
        let out = run_raw(Command::new("qemu-img").args(["compare", s(&fa), s(&fb)]));
        assert!(
            out.status.success(),
            "{what}: {} differs from QEMU's result: {}{}",
            name.to_string_lossy(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if is_qcow2(&fb) {
            assert_check_clean(&fb);
        }
    }
}

fn is_qcow2(p: &Path) -> bool {
    std::fs::read(p).is_ok_and(|b| b.starts_with(b"QFI\xfb"))
}

fn code(cmd: &mut Command) -> (Option<i32>, String) {
    let out = run_raw(cmd);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs one operation with qemu-img on a copy and sqcow2 on another.
fn both(dir: &Path, round: &str, qemu: &[&str], ours: &[&str]) {
    let (q, o) = (
        dir.join(format!("{round}-qemu")),
        dir.join(format!("{round}-sqcow2")),
    );
    copy_dir(&dir.join("orig"), &q);
    copy_dir(&dir.join("orig"), &o);
    let (qc, qe) = code(Command::new("qemu-img").current_dir(&q).args(qemu));
    let (oc, oe) = code(Command::new(sqcow2_bin()).current_dir(&o).args(ours));
    assert_eq!(
        qc, oc,
        "{round}: exit codes differ: qemu-img {qe} / sqcow2 {oe}"
    );
    assert_dirs_agree(&q, &o, round);
}

#[test]
fn commit_matches_qemu_img_commit() {
    for seed in 0..6u64 {
        let tmp = tempfile::tempdir().unwrap();
        let orig = tmp.path().join("orig");
        std::fs::create_dir(&orig).unwrap();
        let raw_base = seed % 3 == 2;
        let files = random_chain(&orig, seed, 4, raw_base, seed % 2 == 1);
        let top = files[3].file_name().unwrap().to_str().unwrap().to_owned();
        let r = |x: &str| format!("seed {seed}: {x}");
        // Into the backing file, the top emptied.
        both(
            tmp.path(),
            &r("commit"),
            &["commit", "-q", &top],
            &["commit", "-q", &top],
        );
        both(
            tmp.path(),
            &r("commit-d"),
            &["commit", "-q", "-d", &top],
            &["commit", "-q", "-d", &top],
        );
        // Into the base (raw or qcow2), through two layers.
        both(
            tmp.path(),
            &r("commit-b"),
            &["commit", "-q", "-b", "l0.qcow2", &top],
            &["commit", "-q", "-b", "l0.qcow2", &top],
        );
        // A base outside the chain: both refuse, nothing changes.
        both(
            tmp.path(),
            &r("commit-missing"),
            &["commit", "-q", "-b", "nothere.qcow2", &top],
            &["commit", "-q", "-b", "nothere.qcow2", &top],
        );
    }
}

/// A commit of a chain only sqcow2 ever touched warns about nothing: the
/// base it writes invalidates the top's index, which the commit itself
/// rebuilds (no "a tool that does not know sQcow2").
#[test]
fn commit_of_a_chain_only_sqcow2_touched_warns_nothing() {
    for base in [None, Some("layer0000.qcow2")] {
        let tmp = tempfile::tempdir().unwrap();
        let top = common::gen_chain(tmp.path(), 4, "64M", "0.3");
        let top = s(&top);
        let mut args = vec!["commit"];
        if let Some(b) = base {
            args.extend(["-b", b]);
        }
        args.push(top);
        let out = run_raw(
            Command::new(sqcow2_bin())
                .current_dir(tmp.path())
                .env("RUST_LOG", "warn")
                .args(&args),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        assert!(!stderr.contains("WARN"), "{args:?}: {stderr}");
        assert_check_clean(Path::new(top));
    }
}

/// The engine options every command takes are described once, in
/// `sqcow2 --help`; a command's help names them in one line and still
/// accepts them.
#[test]
fn global_options_are_described_once() {
    let help = |args: &[&str]| {
        let out = run_raw(Command::new(sqcow2_bin()).args(args));
        assert!(out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let top = help(&["--help"]);
    for option in [
        "--cache-size",
        "--slice-size",
        "--walk",
        "--max-layers",
        "--locking",
    ] {
        assert!(top.contains(option), "sqcow2 --help lacks {option}:\n{top}");
    }
    for command in ["info", "map", "check", "convert", "commit", "serve"] {
        let text = help(&[command, "--help"]);
        assert!(
            !text.contains("Byte budget of the unified metadata cache"),
            "{command} --help repeats the engine options:\n{text}"
        );
        assert!(text.contains("sqcow2 --help"), "{command} --help:\n{text}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("x.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&image), "1M"]);
    sqcow2(&["info", "--cache-size", "4M", "--walk", s(&image)]);
}

/// qemu-img's -f, -q and -U are taken where qemu-img takes them: the
/// same command lines succeed with both tools (qemu-img the oracle of
/// what is valid), and -q prints nothing.
#[test]
fn qemu_img_options_are_taken_where_qemu_img_takes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = dir.join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "4M"]);
    for tool in ["qemu-img", "sqcow2"] {
        let bin = if tool == "qemu-img" {
            PathBuf::from("qemu-img")
        } else {
            sqcow2_bin()
        };
        let made = dir.join(format!("{tool}.qcow2"));
        let raw = dir.join(format!("{tool}.raw"));
        for (args, quiet) in [
            (vec!["create", "-q", "-f", "qcow2", s(&made), "4M"], true),
            (vec!["info", "-f", "qcow2", "-U", s(&base)], false),
            (vec!["map", "-f", "qcow2", "-U", s(&base)], false),
            (vec!["check", "-q", "-f", "qcow2", "-U", s(&base)], true),
            (
                vec![
                    "convert",
                    "-q",
                    "-f",
                    "qcow2",
                    "-U",
                    "-O",
                    "raw",
                    s(&base),
                    s(&raw),
                ],
                true,
            ),
        ] {
            let out = run_raw(Command::new(&bin).args(&args));
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{tool} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            if quiet {
                assert!(stdout.is_empty(), "{tool} {args:?} printed: {stdout}");
            }
        }
    }
}

/// `sqcow2 completions bash` completes commands in a real bash, and
/// `sqcow2 man` renders through groff without a warning.
#[test]
fn shell_completions_and_man_pages_work() {
    let script = format!(
        r#"source <({bin} completions bash) || exit 3
COMP_WORDS=(sqcow2 sn); COMP_CWORD=1; COMP_LINE="sqcow2 sn"; COMP_POINT=${{#COMP_LINE}}
_sqcow2 sqcow2 sn sqcow2
printf '%s\n' "${{COMPREPLY[@]}}""#,
        bin = sqcow2_bin().display()
    );
    let out = run_raw(Command::new("bash").args(["-c", &script]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.trim(), "snapshot", "{text}");
    for shell in ["zsh", "fish"] {
        sqcow2(&["completions", shell]);
    }

    let tmp = tempfile::tempdir().unwrap();
    sqcow2(&["man", "--dir", s(tmp.path())]);
    for page in ["sqcow2.1", "sqcow2-serve.1", "sqcow2-snapshot.1"] {
        let path = tmp.path().join(page);
        let out = run_raw(Command::new("groff").args(["-man", "-Tutf8", "-ww", "-z", s(&path)]));
        assert!(out.status.success(), "{page}");
        let warnings = String::from_utf8_lossy(&out.stderr);
        assert!(warnings.is_empty(), "{page}: {warnings}");
    }
    let out = run_raw(
        Command::new("man")
            .args(["-l", s(&tmp.path().join("sqcow2.1"))])
            .env("MANPAGER", "cat")
            .env("MANWIDTH", "100"),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("snapshot"), "{text}");
}

/// `rebase -U` shares the new backing file with a process that writes it
/// (qemu-img's meaning): refused without it, done with it, by both tools.
#[test]
fn rebase_u_shares_the_new_backing_file_as_qemu_img() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = dir.join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "1M"]);
    let other = dir.join("other.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&other), "1M"]);
    // Another process writes the new backing file meanwhile.
    let writer = common::QemuIoHolder::hold(&other, &[]);
    for tool in ["qemu-img", "sqcow2"] {
        let top = dir.join(format!("{tool}-top.qcow2"));
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            s(&top),
        ]);
        let bin = if tool == "qemu-img" {
            PathBuf::from("qemu-img")
        } else {
            sqcow2_bin()
        };
        let rebase = |share: bool| {
            let mut args = vec!["rebase"];
            if share {
                args.push("-U");
            }
            args.extend(["-b", "other.qcow2", "-F", "qcow2", s(&top)]);
            run_raw(Command::new(&bin).args(&args))
        };
        let out = rebase(false);
        assert_eq!(out.status.code(), Some(1), "{tool} without -U");
        let out = rebase(true);
        assert!(
            out.status.success(),
            "{tool} -U: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let info = run_raw(Command::new("qemu-img").args(["info", "-U", s(&top)]));
        assert!(
            String::from_utf8_lossy(&info.stdout).contains("backing file: other.qcow2"),
            "{tool}"
        );
    }
    drop(writer);
}

/// A mistake in the arguments is said as one (exit 1), never as an I/O
/// error: a layer number past the chain, a file not in it.
#[test]
fn input_mistakes_are_not_io_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let top = common::gen_chain(tmp.path(), 3, "16M", "0.3");
    let top = s(&top);
    let other = tmp.path().join("other.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&other), "16M"]);
    let merged = tmp.path().join("m.qcow2");
    for (args, says) in [
        (vec!["merge", top, "0", "3", s(&merged)], "no layer 3"),
        (
            vec!["merge", top, s(&other), "1", s(&merged)],
            "is not in the chain",
        ),
        (vec!["commit", "-b", s(&other), top], "did not find"),
    ] {
        let out = run_raw(Command::new(sqcow2_bin()).args(&args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("I/O error"), "{args:?}: {err}");
    }
}

/// `-p` where standard error is not a terminal (a log) ends with the
/// line of the finished work, as qemu-img's `(100.00/100%)`.
#[test]
fn progress_without_a_terminal_ends_at_100_percent() {
    let tmp = tempfile::tempdir().unwrap();
    let gen = |dir: &str| common::gen_chain(&tmp.path().join(dir), 4, "64M", "0.3");
    let (a, b, c) = (gen("a"), gen("b"), gen("c"));
    let raw = tmp.path().join("out.raw");
    for args in [
        vec!["convert", "-p", "-O", "raw", s(&a), s(&raw)],
        vec!["commit", "-p", s(&b)],
        vec!["upgrade", "-p", s(&c)],
    ] {
        let out = run_raw(Command::new(sqcow2_bin()).args(&args));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
        assert!(
            last.is_some_and(|l| l.contains("100%")),
            "{args:?}: the last progress line is not the finished one:\n{stderr}"
        );
    }
}

#[test]
fn commit_of_an_image_without_backing_file_fails_as_in_qemu() {
    let tmp = tempfile::tempdir().unwrap();
    let orig = tmp.path().join("orig");
    std::fs::create_dir(&orig).unwrap();
    random_chain(&orig, 7, 1, false, false);
    both(
        tmp.path(),
        "lone",
        &["commit", "l0.qcow2"],
        &["commit", "l0.qcow2"],
    );
}

#[test]
fn rebase_matches_qemu_img_rebase() {
    for seed in 10..16u64 {
        let tmp = tempfile::tempdir().unwrap();
        let orig = tmp.path().join("orig");
        std::fs::create_dir(&orig).unwrap();
        let raw_base = seed % 3 == 2;
        let files = random_chain(&orig, seed, 4, raw_base, seed % 2 == 1);
        let base_fmt = if raw_base { "raw" } else { "qcow2" };
        let r = |x: &str| format!("seed {seed}: {x}");
        for (name, args) in [
            (
                "onto-base",
                vec!["rebase", "-b", "l0.qcow2", "-F", base_fmt, "l3.qcow2"],
            ),
            (
                "onto-l1",
                vec!["rebase", "-b", "l1.qcow2", "-F", "qcow2", "l3.qcow2"],
            ),
            ("none", vec!["rebase", "-b", "", "l3.qcow2"]),
            (
                "unsafe",
                vec!["rebase", "-u", "-b", "l1.qcow2", "-F", "qcow2", "l3.qcow2"],
            ),
            // An unrelated image as the new backing file.
            (
                "other",
                vec!["rebase", "-b", "l2.qcow2", "-F", "qcow2", "l1.qcow2"],
            ),
            ("no-format", vec!["rebase", "-b", "l0.qcow2", "l3.qcow2"]),
            (
                "missing",
                vec!["rebase", "-b", "nothere.qcow2", "-F", "qcow2", "l3.qcow2"],
            ),
        ] {
            both(tmp.path(), &r(name), &args, &args);
        }
        let _ = files;
    }
}

/// `rebase -u` only renames the backing file, which need not exist yet
/// (it may be copied or renamed into place later): it succeeds as QEMU's
/// does and writes the same header.
#[test]
fn unsafe_rebase_onto_a_file_not_there_yet_succeeds_as_in_qemu() {
    let tmp = tempfile::tempdir().unwrap();
    let orig = tmp.path().join("orig");
    std::fs::create_dir(&orig).unwrap();
    random_chain(&orig, 21, 3, false, false);
    let (q, o) = (tmp.path().join("qemu"), tmp.path().join("sqcow2"));
    copy_dir(&orig, &q);
    copy_dir(&orig, &o);
    let args = [
        "rebase",
        "-u",
        "-b",
        "later.qcow2",
        "-F",
        "qcow2",
        "l2.qcow2",
    ];
    let (qc, qe) = code(Command::new("qemu-img").current_dir(&q).args(args));
    let (oc, oe) = code(Command::new(sqcow2_bin()).current_dir(&o).args(args));
    assert_eq!(
        (qc, oc),
        (Some(0), Some(0)),
        "qemu-img: {qe} / sqcow2: {oe}"
    );
    assert_eq!(
        std::fs::read(q.join("l2.qcow2")).unwrap(),
        std::fs::read(o.join("l2.qcow2")).unwrap(),
        "the headers differ"
    );
}

/// Merges `first..=last` of a chain and checks the top's view (against
/// `qemu-img convert` before), every file clean, the replaced files
/// untouched, and the chain one file per merged range.
fn merge_and_check(dir: &Path, files: &[PathBuf], first: usize, last: usize) {
    let top = files.last().unwrap();
    let before = dir.join("before.raw");
    qemu_img(&["convert", "-O", "raw", s(top), s(&before)]);
    let sums: Vec<String> = files[first..=last].iter().map(|f| sha256_file(f)).collect();
    let merged = dir.join(format!("m{first}-{last}.qcow2"));
    let out = sqcow2(&[
        "merge",
        "--output",
        "json",
        s(top),
        &first.to_string(),
        &last.to_string(),
        s(&merged),
    ]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        report["replaced"].as_array().unwrap().len(),
        last - first + 1
    );
    let out = run_raw(Command::new("qemu-img").args(["compare", s(&before), s(top)]));
    assert!(
        out.status.success(),
        "merge {first}..{last}: the top reads differently: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    for (f, sum) in files[first..=last].iter().zip(&sums) {
        assert_eq!(&sha256_file(f), sum, "merge wrote into {}", f.display());
    }
    assert_check_clean(&merged);
    assert_check_clean(&files[last + 1]);
    let chain = qemu_img(&["info", "--backing-chain", s(top)]);
    assert_eq!(
        chain.matches("image: ").count(),
        files.len() - (last - first),
        "{chain}"
    );
    assert!(!Path::new(&format!("{}.sqtmp", s(&merged))).exists());
}

#[test]
fn merge_keeps_the_view_and_never_writes_the_merged_layers() {
    for seed in 20..26u64 {
        let tmp = tempfile::tempdir().unwrap();
        let raw_base = seed % 3 == 2;
        let files = random_chain(tmp.path(), seed, 6, raw_base, seed % 2 == 1);
        let mut rng = fastrand::Rng::with_seed(seed);
        let first = rng.usize(..4);
        let last = rng.usize(first..5);
        merge_and_check(tmp.path(), &files, first, last);
    }
}

#[test]
fn merge_of_the_base_and_of_a_middle_range() {
    let tmp = tempfile::tempdir().unwrap();
    let files = random_chain(tmp.path(), 99, 5, false, true);
    merge_and_check(tmp.path(), &files, 0, 1);
    let tmp = tempfile::tempdir().unwrap();
    let files = random_chain(tmp.path(), 98, 5, true, false);
    merge_and_check(tmp.path(), &files, 1, 3);
}

#[test]
fn merge_refuses_the_top_and_a_served_chain() {
    let tmp = tempfile::tempdir().unwrap();
    let files = random_chain(tmp.path(), 5, 3, false, false);
    let top = &files[2];
    let m = tmp.path().join("m.qcow2");
    let (c, e) = code(Command::new(sqcow2_bin()).args(["merge", s(top), "1", "2", s(&m)]));
    assert_eq!(c, Some(1), "{e}");
    assert!(e.contains("below the top"), "{e}");
    // A reader holding the chain (as a daemon serving it would) keeps
    // the layer to switch from being rewritten.
    let qio = common::QemuIoHolder::hold(top, &["-r"]);
    let (c, e) = code(Command::new(sqcow2_bin()).args(["merge", s(top), "0", "0", s(&m)]));
    drop(qio);
    assert_eq!(c, Some(1), "{e}");
    assert!(!m.exists() && !tmp.path().join("m.qcow2.sqtmp").exists());
}

#[test]
fn reshaping_keeps_the_chain_index_valid() {
    let tmp = tempfile::tempdir().unwrap();
    let top = common::gen_chain(tmp.path(), 12, "16M", "0.3");
    let before = tmp.path().join("before.raw");
    qemu_img(&["convert", "-O", "raw", s(&top), s(&before)]);
    let info = |top: &Path| -> serde_json::Value {
        serde_json::from_str(&sqcow2(&["info", "--output", "json", s(top)])).unwrap()
    };
    let chain = qemu_img(&["info", "--backing-chain", s(&top)]);
    let layers: Vec<PathBuf> = chain
        .lines()
        .filter_map(|l| l.strip_prefix("image: "))
        .map(|n| tmp.path().join(n))
        .collect();
    assert_eq!(layers.len(), 12);
    let merged = tmp.path().join("merged.qcow2");
    sqcow2(&["merge", s(&top), "3", "8", s(&merged)]);
    let state = info(&top);
    assert_eq!(state["chain-index"]["state"], "valid", "{state}");
    assert_eq!(state["chain-index"]["pending"], 0, "{state}");
    // `check` compares every index entry with a walk of the chain.
    sqcow2(&["check", s(&top)]);
    let out = run_raw(Command::new("qemu-img").args(["compare", s(&before), s(&top)]));
    assert!(out.status.success());
    // Rebase the top past the layer below it (its data copied into the
    // top), then commit the top into its new backing file.
    let below = &layers[2];
    sqcow2(&[
        "rebase",
        "-b",
        below.file_name().unwrap().to_str().unwrap(),
        "-F",
        "qcow2",
        s(&top),
    ]);
    assert_eq!(info(&top)["chain-index"]["state"], "valid");
    sqcow2(&["check", s(&top)]);
    let out = run_raw(Command::new("qemu-img").args(["compare", s(&before), s(&top)]));
    assert!(out.status.success());
    sqcow2(&["commit", "-q", "-d", s(&top)]);
    assert_eq!(info(&top)["chain-index"]["state"], "valid");
    sqcow2(&["check", s(&top)]);
    let out = run_raw(Command::new("qemu-img").args(["compare", s(&before), s(&top)]));
    assert!(out.status.success());
    for f in common::qcow2_files(tmp.path()) {
        assert_check_clean(&f);
    }
}
