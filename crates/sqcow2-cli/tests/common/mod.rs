//! Helpers shared by the integration tests: the `sqcow2` binary, QEMU's
//! tools as the oracle, and chain construction with `qemu-img`/`qemu-io`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

/// The `sqcow2` binary of this build (cargo builds it for these tests).
pub fn sqcow2_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sqcow2"))
}

/// The workspace's root directory.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Newest modification time of any file below `dir` that goes into a
/// binary (a crate's own tests, benchmarks and examples do not).
fn newest_mtime(dir: &Path) -> SystemTime {
    let mut newest = SystemTime::UNIX_EPOCH;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return newest;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let not_built = ["tests", "benches", "examples"]
            .iter()
            .any(|d| path.file_name().is_some_and(|n| n == *d));
        let t = if path.is_dir() && not_built {
            continue;
        } else if path.is_dir() {
            newest_mtime(&path)
        } else {
            entry
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH)
        };
        newest = newest.max(t);
    }
    newest
}

/// The `sqcow2-bench` binary of this build, beside `sqcow2`. Cargo builds
/// only this package's binaries for its tests, so the test command builds
/// the other package first (`cargo build --workspace`); a missing or stale
/// binary fails the test instead of testing old code.
pub fn sqcow2_bench_bin() -> PathBuf {
    let bin = sqcow2_bin().with_file_name("sqcow2-bench");
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} missing: run `cargo build --workspace` first (scripts/test.sh does)",
                bin.display()
            )
        });
    let crates = workspace_root().join("crates");
    let sources = ["sqcow2-bench", "sqcow2-format", "sqcow2-cache"]
        .iter()
        .map(|c| newest_mtime(&crates.join(c)))
        .max()
        .unwrap_or(SystemTime::UNIX_EPOCH);
    assert!(
        built >= sources,
        "{} is older than the sources: run `cargo build --workspace` first",
        bin.display()
    );
    bin
}

/// Runs a command, returning its output whatever the exit status.
/// `PROGRAM VERB ARGS`' standard output and exit code, `sqcow2` being
/// this build's binary (to hold sqcow2's answer beside qemu-img's).
pub fn verb_outcome(program: &str, verb: &str, args: &[&str]) -> (String, Option<i32>) {
    let bin = if program == "sqcow2" {
        sqcow2_bin()
    } else {
        program.into()
    };
    let o = run_raw(Command::new(bin).arg(verb).args(args));
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        o.status.code(),
    )
}

pub fn run_raw(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| {
        panic!("cannot run {cmd:?}: {e} (is QEMU installed? scripts/test.sh installs it)")
    })
}

/// Runs a command that must succeed; returns its standard output.
pub fn run(cmd: &mut Command) -> String {
    let out = run_raw(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}:\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `sqcow2 ARGS...`, which must succeed.
pub fn sqcow2(args: &[&str]) -> String {
    run(Command::new(sqcow2_bin()).args(args))
}

/// `qemu-img ARGS...`, which must succeed.
pub fn qemu_img(args: &[&str]) -> String {
    run(Command::new("qemu-img").args(args))
}

/// `qemu-img create -f qcow2 [-o OPTS] PATH SIZE`, which must succeed
/// (`opts` empty: QEMU's defaults).
pub fn qemu_create(path: &Path, opts: &str, size: &str) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([s(path), size]);
    qemu_img(&args);
}

/// `qemu-img create -f qcow2 -b BACKING -F FORMAT [EXTRA...] PATH [SIZE]`:
/// an overlay, the backing file named as given (relative to `path`'s
/// directory), which must succeed.
pub fn qemu_overlay(path: &Path, backing: &str, format: &str, extra: &[&str], size: Option<&str>) {
    let mut args = vec!["create", "-q", "-f", "qcow2", "-b", backing, "-F", format];
    args.extend_from_slice(extra);
    args.push(s(path));
    args.extend(size);
    qemu_img(&args);
}

/// `qemu-io -f FMT IMAGE -c CMD...`, which must succeed.
pub fn qemu_io(image: &Path, cmds: &[String]) {
    let mut cmd = Command::new("qemu-io");
    cmd.arg("-f").arg("qcow2");
    for c in cmds {
        cmd.arg("-c").arg(c);
    }
    cmd.arg(image);
    let out = run(&mut cmd);
    assert!(
        !out.contains("failed") && !out.contains("error"),
        "qemu-io reported a failure on {}: {out}",
        image.display()
    );
}

/// sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> String {
    let mut hasher = Sha256::new();
    let mut f = std::fs::File::open(path).expect("open for hashing");
    std::io::copy(&mut f, &mut hasher).expect("hash file");
    format!("{:x}", hasher.finalize())
}

/// Path as `&str` for command lines.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 test path")
}

/// One extent of `map --output json`, reduced to what both tools must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataZero {
    pub start: u64,
    pub length: u64,
    pub data: bool,
    pub zero: bool,
}

/// Parses map JSON and merges neighbours with equal data/zero flags.
pub fn data_zero_extents(json: &str) -> Vec<DataZero> {
    let v: serde_json::Value = serde_json::from_str(json).expect("map JSON");
    let mut out: Vec<DataZero> = Vec::new();
    for e in v.as_array().expect("map JSON is an array") {
        let cur = DataZero {
            start: e["start"].as_u64().expect("start"),
            length: e["length"].as_u64().expect("length"),
            data: e["data"].as_bool().expect("data"),
            zero: e["zero"].as_bool().expect("zero"),
        };
        match out.last_mut() {
            Some(prev)
                if prev.data == cur.data
                    && prev.zero == cur.zero
                    && prev.start + prev.length == cur.start =>
            {
                prev.length += cur.length
            }
            _ => out.push(cur),
        }
    }
    out
}

/// Asserts that sqcow2 reads `top` exactly as QEMU does: the same raw bytes
/// and the same data/zero extents. Returns both map outputs (sqcow2, QEMU).
pub fn assert_same_as_qemu(top: &Path) -> (String, String) {
    let dir = top.parent().expect("image directory");
    let ours = dir.join("sqcow2-convert.raw");
    let theirs = dir.join("qemu-convert.raw");
    sqcow2(&["convert", "-O", "raw", s(top), s(&ours)]);
    qemu_img(&["convert", "-O", "raw", s(top), s(&theirs)]);
    assert_eq!(
        std::fs::metadata(&ours).unwrap().len(),
        std::fs::metadata(&theirs).unwrap().len(),
        "raw sizes differ for {}",
        top.display()
    );
    assert_eq!(
        sha256_file(&ours),
        sha256_file(&theirs),
        "sqcow2 and qemu-img read different bytes from {}",
        top.display()
    );
    std::fs::remove_file(&ours).ok();
    std::fs::remove_file(&theirs).ok();

    let our_map = sqcow2(&["map", "--output", "json", s(top)]);
    let their_map = qemu_img(&["map", "--output", "json", s(top)]);
    assert_eq!(
        data_zero_extents(&our_map),
        data_zero_extents(&their_map),
        "data/zero extents differ for {}",
        top.display()
    );
    (our_map, their_map)
}

/// Asserts that the full map (depth, present, offsets, compressed) equals
/// qemu-img's, entry for entry.
pub fn assert_full_map_equal(top: &Path) {
    let mut ours: serde_json::Value =
        serde_json::from_str(&sqcow2(&["map", "--output", "json", s(top)])).unwrap();
    let theirs: serde_json::Value =
        serde_json::from_str(&qemu_img(&["map", "--output", "json", s(top)])).unwrap();
    // QEMU before 8.2 has no "compressed" field; compare the rest.
    let qemu_has_compressed = theirs
        .as_array()
        .and_then(|a| a.first())
        .is_some_and(|e| e.get("compressed").is_some());
    if !qemu_has_compressed {
        for e in ours.as_array_mut().expect("map JSON is an array") {
            e.as_object_mut().expect("map entry").remove("compressed");
        }
    }
    assert_eq!(ours, theirs, "full map differs for {}", top.display());
}

/// One layer to create: `qemu-img create` options, virtual size, and the
/// `qemu-io` commands that fill it.
pub struct LayerSpec {
    pub opts: String,
    pub size: u64,
    pub cmds: Vec<String>,
}

impl LayerSpec {
    pub fn new(opts: &str, size: u64, cmds: &[&str]) -> Self {
        Self {
            opts: opts.to_owned(),
            size,
            cmds: cmds.iter().map(|c| (*c).to_owned()).collect(),
        }
    }
}

/// Creates `layer0.qcow2` (the base) up to `layerN.qcow2` (the top), each
/// backed by the previous one with a recorded qcow2 format; returns the top.
pub fn build_chain(dir: &Path, layers: &[LayerSpec]) -> PathBuf {
    let mut prev: Option<PathBuf> = None;
    for (i, spec) in layers.iter().enumerate() {
        let path = dir.join(format!("layer{i}.qcow2"));
        let mut args = vec!["create", "-q", "-f", "qcow2"];
        if !spec.opts.is_empty() {
            args.extend(["-o", &spec.opts]);
        }
        // Relative backing names, as management tools usually write them.
        let backing_name;
        if let Some(p) = &prev {
            backing_name = p.file_name().unwrap().to_str().unwrap().to_owned();
            args.extend(["-b", &backing_name, "-F", "qcow2"]);
        }
        let size = spec.size.to_string();
        args.extend([s(&path), &size]);
        qemu_img(&args);
        if !spec.cmds.is_empty() {
            qemu_io(&path, &spec.cmds);
        }
        prev = Some(path);
    }
    prev.expect("at least one layer")
}
/// A `sqcow2 gen-chain` chain (indexed) of `layers` layers of `size`,
/// `fill` of its clusters written, in `dir`; returns its top.
pub fn gen_chain(dir: &Path, layers: usize, size: &str, fill: &str) -> PathBuf {
    gen_chain_with(dir, layers, size, fill, &[])
}

/// `sqcow2 gen-chain` with `extra` options; returns the top.
fn gen_chain_with(dir: &Path, layers: usize, size: &str, fill: &str, extra: &[&str]) -> PathBuf {
    let layers = layers.to_string();
    let mut args = vec![
        "gen-chain",
        "--layers",
        &layers,
        "--size",
        size,
        "--fill",
        fill,
    ];
    args.extend(extra);
    args.push(s(dir));
    PathBuf::from(sqcow2(&args).trim())
}

/// [`gen_chain`] without an index (a chain as QEMU could have made it).
pub fn gen_vanilla_chain(dir: &Path, layers: usize, size: &str, fill: &str) -> PathBuf {
    gen_chain_with(dir, layers, size, fill, &["--no-index"])
}

/// The chain's guest view according to `qemu-img convert` (written to
/// `dir/expected.raw`).
pub fn qemu_raw(top: &Path, dir: &Path) -> Vec<u8> {
    let raw = dir.join("expected.raw");
    qemu_img(&["convert", "-O", "raw", s(top), s(&raw)]);
    std::fs::read(&raw).unwrap()
}

/// A count from the environment variable `name`, else `default`.
pub fn env_count<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `len` bytes that identify `block` and its version `v`: what load tests
/// write, so a read of the wrong block or version is recognised.
pub fn tagged_block(block: u64, v: u32, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let word = (block << 40) ^ (u64::from(v) << 16) ^ i as u64 ^ 0x5bd1_e995;
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    out
}

/// Asserts that `qemu-img check` finds no error and no leak in `image`.
pub fn assert_check_clean(image: &Path) {
    let out = run_raw(Command::new("qemu-img").args(["check", s(image)]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("No errors were found"),
        "qemu-img check {}:\n{text}{}",
        image.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// After a process death: `qemu-img check` finds no error (leaked clusters
/// are allowed: a cluster counted before a kill and never mapped is one),
/// `sqcow2 check` agrees with the index, and the index is valid or known
/// stale. Returns the leaks and the index state; `round` names the moment
/// in messages.
pub fn check_after_crash(top: &Path, round: &str) -> (u64, String) {
    let leaks = assert_no_corruption(top, round);
    let ours = run_raw(Command::new(sqcow2_bin()).args(["check", "--output", "json", s(top)]));
    let ours_report: serde_json::Value = serde_json::from_slice(&ours.stdout).unwrap_or_else(|e| {
        panic!(
            "{round}: sqcow2 check output: {e}\n{}",
            String::from_utf8_lossy(&ours.stderr)
        )
    });
    assert_eq!(
        ours_report["corruptions"],
        0,
        "{round}: sqcow2 check (index vs walk): {ours_report}\n{}",
        String::from_utf8_lossy(&ours.stderr)
    );
    let info = run_raw(Command::new(sqcow2_bin()).args(["info", "--output", "json", s(top)]));
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).expect("info json");
    let state = info["chain-index"]["state"]
        .as_str()
        .unwrap_or("none")
        .to_string();
    assert!(
        state == "valid" || state.starts_with("stale"),
        "{round}: index state {state}"
    );
    (leaks, state)
}

/// `qemu-img check` finds no corruption nor check error in `image`
/// (leaks allowed: a cluster counted before a kill and never mapped is
/// one); the leaks.
pub fn assert_no_corruption(image: &Path, round: &str) -> u64 {
    let out = run_raw(Command::new("qemu-img").args(["check", "--output=json", s(image)]));
    let code = out.status.code();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{round}: qemu-img check {} output: {e}", image.display()));
    assert!(
        matches!(code, Some(0) | Some(3))
            && report["corruptions"].as_u64().unwrap_or(0) == 0
            && report["check-errors"].as_u64().unwrap_or(0) == 0,
        "{round}: qemu-img check {} found errors: {report}",
        image.display()
    );
    report["leaks"].as_u64().unwrap_or(0)
}

/// The qcow2 files of `dir`, sorted.
pub fn qcow2_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "qcow2"))
        .collect();
    files.sort();
    files
}

pub mod faulty_fs;
pub mod guest;
pub mod object_store;
pub mod reference;
pub mod ring;
pub mod vhost;

/// Whether the qcow2 v3 image at `path` carries the dirty bit.
pub fn dirty_bit(path: &Path) -> bool {
    use std::os::unix::fs::FileExt;
    let mut word = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|f| f.read_exact_at(&mut word, 72))
        .is_ok_and(|()| u64::from_be_bytes(word) & 1 != 0)
}

/// Whether the mapping journal of the top at `top` is running: its file
/// beside the top, the top carrying the dirty bit (both gone once a
/// writer leaves the image clean).
#[allow(dead_code)]
pub fn journal_running(top: &Path) -> bool {
    top.with_extension("qcow2.sqjournal").exists() && dirty_bit(top)
}

/// Whether neither the journal's file nor the dirty bit is left.
#[allow(dead_code)]
pub fn left_clean(top: &Path) -> bool {
    !top.with_extension("qcow2.sqjournal").exists() && !dirty_bit(top)
}

/// A `qemu-io` process holding `image` open (with QEMU's locks for
/// `args`, e.g. `-r` for a reader) until dropped.
#[allow(dead_code)]
pub struct QemuIoHolder(std::process::Child);

#[allow(dead_code)]
impl QemuIoHolder {
    /// Starts `qemu-io ARGS -c "sleep ..." IMAGE` and returns once it
    /// holds its locks on IMAGE (watched in `/proc`, which takes no lock
    /// that could make qemu-io's own open fail, as a `qemu-img info` probe
    /// could).
    pub fn hold(image: &Path, args: &[&str]) -> QemuIoHolder {
        let mut holder = QemuIoHolder(
            Command::new("qemu-io")
                .args(args)
                .args(["-c", "sleep 600000", s(image)])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("qemu-io"),
        );
        holder.wait_held(image);
        holder
    }

    /// Returns once qemu-io itself holds a lock on `path` (the image or a
    /// file of its backing chain, which qemu-io opens after it): a lock
    /// line in the fdinfo of qemu-io's descriptor of that file. Not
    /// `/proc/locks`, where OFD locks carry no pid: another process's
    /// lock on the same file (a daemon serving it) would match there.
    pub fn wait_held(&mut self, path: &Path) {
        use std::os::unix::fs::MetadataExt;
        let want = std::fs::metadata(path).unwrap();
        let pid = self.0.id();
        let held = || -> bool {
            let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                return false;
            };
            fds.flatten().any(|fd| {
                let same = std::fs::metadata(fd.path())
                    .is_ok_and(|m| m.dev() == want.dev() && m.ino() == want.ino());
                same && std::fs::read_to_string(format!(
                    "/proc/{pid}/fdinfo/{}",
                    fd.file_name().to_string_lossy()
                ))
                .is_ok_and(|info| info.lines().any(|l| l.starts_with("lock:")))
            })
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !held() {
            assert!(
                self.still_running(),
                "qemu-io ended before it held {}",
                path.display()
            );
            assert!(
                std::time::Instant::now() < deadline,
                "qemu-io never held {}",
                path.display()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    pub fn still_running(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }
}

impl Drop for QemuIoHolder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
