//! Restarting the daemon under a running guest. A Debian guest (the guest
//! kit's `sqcow2.loop` mode, `scripts/lib/guest-loop.sh`) writes blocks
//! with a pattern naming writer, round and block (O_DIRECT; every other
//! round then fsync), reads them back with O_DIRECT and compares, on a
//! 20-layer chain served by `sqcow2 serve`; QEMU's chardev reconnects
//! (`reconnect=1`). Meanwhile the test restarts the daemon on the same
//! socket, each time after the guest completed a round and a random delay
//! more:
//!
//! * `kill -9` then the same binary (a crash, the OOM killer);
//! * SIGTERM then another binary (an upgrade).
//!
//! Pass: the guest saw no I/O error and no verification failure, its
//! kernel log has no block I/O error, the disk afterwards is exactly the
//! chain's original content with every write the guest logged applied in
//! its order (`qemu-img convert` against the guest's own record: flushed
//! or not, a process restart loses nothing that completed), and
//! `qemu-img check` finds no error (after a kill, a cluster counted but
//! not yet mapped may leak).
//!
//! `SQCOW2_RESTARTS` (default 10 kills, 4 upgrades in the test run;
//! `scripts/long-test.sh guest-restart` runs more) and `SQCOW2_RESTART_SEED`.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::guest::{accelerator, base_args, guest_kit};
use common::vhost::Daemon;
use common::{check_after_crash, env_count, gen_chain, qemu_raw, sqcow2_bin};

const BLOCK: usize = 4096;
/// Writers in the guest, the 4 KiB blocks each owns, blocks per round.
const WORKERS: u64 = 3;
const AREA_BLOCKS: u64 = 4096;
const ROUND_BLOCKS: u64 = 16;

/// How the daemon is restarted.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Restart {
    /// `kill -9`, then the same binary.
    Kill,
    /// SIGTERM, then another binary (a copy: what an upgrade installs).
    Upgrade,
}

/// One round the guest logged: `blocks` blocks from `first`, written by
/// `worker` in `round` (and flushed if `synced`), read back and compared.
#[derive(Debug)]
struct Round {
    worker: u64,
    round: u64,
    first: u64,
    blocks: u64,
    synced: bool,
    /// How long the write (and its fsync) and the read-back took, in ms.
    write_ms: u64,
    read_ms: u64,
}

impl Round {
    fn parse(line: &str) -> Option<Round> {
        // Anywhere in the line, and text may follow its last number: the
        // console echoes the line the test types to stop the loops, glued
        // before or after a round's line ("stopSQCOW2-GUEST-W 3 17 ..."
        // and "SQCOW2-GUEST-W 1 60 3730 16 0 103 2stop" were each once
        // missed and their write reported as a difference).
        const TAG: &str = "SQCOW2-GUEST-W ";
        let rest = &line[line.find(TAG)? + TAG.len()..];
        let tokens: Vec<&str> = rest.split_whitespace().take(7).collect();
        let (last, numbers) = tokens.split_last()?;
        let digits = last.len() - last.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let v: Vec<u64> = numbers
            .iter()
            .copied()
            .chain(std::iter::once(&last[..digits]))
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        let [worker, round, first, blocks, synced, write_cs, read_cs] = v[..] else {
            return None;
        };
        Some(Round {
            worker,
            round,
            first,
            blocks,
            synced: synced == 1,
            write_ms: write_cs * 10,
            read_ms: read_cs * 10,
        })
    }

    /// What the guest wrote to `block` (the same as `loop_pattern`).
    fn block_bytes(&self, block: u64) -> Vec<u8> {
        let line = format!("sqcow2 w{} r{:07} b{:09}\n", self.worker, self.round, block);
        line.as_bytes()
            .iter()
            .copied()
            .cycle()
            .take(BLOCK)
            .collect()
    }
}

/// The guest under test: QEMU with its console in a file and its stdin
/// (the guest's console input) held by the test.
struct Guest {
    child: Child,
    console: PathBuf,
    stderr: PathBuf,
}

impl Guest {
    fn start(kit: &Path, dir: &Path, accel: &str, socket: &Path) -> Guest {
        let mut args = base_args(
            kit,
            accel,
            &format!(
                "console=ttyS0 panic=-1 quiet sqcow2.loop={WORKERS},{AREA_BLOCKS},{ROUND_BLOCKS}"
            ),
        );
        args.extend([
            "-smp".into(),
            "2".into(),
            "-chardev".into(),
            format!("socket,id=vu,path={},reconnect=1", socket.display()),
            "-device".into(),
            "vhost-user-blk-pci,chardev=vu,num-queues=2".into(),
        ]);
        let console = dir.join("console.log");
        let stderr = dir.join("qemu.log");
        let child = Command::new("qemu-system-x86_64")
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(std::fs::File::create(&console).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("qemu-system-x86_64 (scripts/guest-kit.sh installs it)");
        Guest {
            child,
            console,
            stderr,
        }
    }

    fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    fn rounds(&self) -> Vec<Round> {
        self.console().lines().filter_map(Round::parse).collect()
    }

    fn context(&self) -> String {
        let console = self.console();
        let lines: Vec<&str> = console.lines().collect();
        let tail = &lines[lines.len().saturating_sub(60)..];
        format!(
            "guest console (end):\n{}\nQEMU stderr:\n{}",
            tail.join("\n"),
            std::fs::read_to_string(&self.stderr).unwrap_or_default()
        )
    }

    /// Waits until `done(console)` holds; panics after `timeout` or if QEMU
    /// exits first.
    fn wait_for(&mut self, what: &str, timeout: Duration, done: impl Fn(&Guest) -> bool) {
        let deadline = Instant::now() + timeout;
        while !done(self) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "QEMU exited ({status}) waiting for {what}\n{}",
                    self.context()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no {what} within {timeout:?}\n{}",
                self.context()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Tells the guest's loops to stop; waits for the guest to power off.
    fn stop(&mut self) {
        let stdin = self.child.stdin.as_mut().expect("QEMU stdin");
        stdin.write_all(b"stop\n").expect("guest console input");
        stdin.flush().expect("guest console input");
        let deadline = Instant::now() + Duration::from_secs(300);
        while self.child.try_wait().expect("wait").is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("guest did not power off\n{}", self.context());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The 4 KiB block where `expected` and `actual` first differ, with who
/// wrote it last, for the failure message.
fn first_difference(expected: &[u8], actual: &[u8], rounds: &[Round]) -> Option<String> {
    let block = expected
        .chunks(BLOCK)
        .zip(actual.chunks(BLOCK))
        .position(|(e, a)| e != a)? as u64;
    let writer = rounds
        .iter()
        .rev()
        .find(|r| (r.first..r.first + r.blocks).contains(&block));
    let start = block as usize * BLOCK;
    Some(format!(
        "block {block}: last written by {writer:?}; on disk: {:?}",
        String::from_utf8_lossy(&actual[start..start + 40])
    ))
}

fn restart_loop(how: Restart, restarts: usize) {
    let kit = guest_kit();
    let mut tmp = tempfile::tempdir().unwrap();
    // SQCOW2_KEEP_TMP=1 keeps the images and logs for a post-mortem.
    tmp.disable_cleanup(std::env::var_os("SQCOW2_KEEP_TMP").is_some());
    let dir = tmp.path();
    eprintln!("working in {}", dir.display());
    let accel = accelerator(&kit, dir);
    let top = gen_chain(dir, 20, "64M", "0.6");
    let mut expected = qemu_raw(&top, dir);
    let seed: u64 = env_count("SQCOW2_RESTART_SEED", fastrand::u64(..));
    eprintln!("{how:?} loop: {restarts} restarts, seed {seed}, accel {accel}");
    let mut rng = fastrand::Rng::with_seed(seed);

    // An upgrade alternates between the build's binary and a copy of it.
    let binaries = [sqcow2_bin(), dir.join("sqcow2-next")];
    std::fs::copy(&binaries[0], &binaries[1]).expect("copy of the binary");
    let args = ["--num-queues", "2"];
    // SQCOW2_RESTART_LOG sets the daemons' RUST_LOG (default info).
    let log_filter = std::env::var("SQCOW2_RESTART_LOG").unwrap_or_else(|_| "info".into());
    let env = [("RUST_LOG", log_filter.as_str())];
    let mut daemon = Daemon::start_bin(&binaries[0], dir, &top, &args, &env);
    let mut guest = Guest::start(&kit, dir, &accel, &daemon.socket);
    guest.wait_for("loop start", Duration::from_secs(600), |g| {
        g.console().contains("SQCOW2-GUEST-LOOP-START")
    });

    let started = Instant::now();
    let mut resubmitted = 0;
    for i in 0..restarts {
        // The guest made progress with this daemon; then a random moment.
        let before = guest.rounds().len();
        guest.wait_for(
            &format!("a guest round after restart {i}"),
            Duration::from_secs(120),
            |g| g.rounds().len() > before,
        );
        std::thread::sleep(Duration::from_millis(rng.u64(0..1500)));
        let status = match how {
            Restart::Kill => daemon.stop_with(libc::SIGKILL),
            Restart::Upgrade => daemon.stop_with(libc::SIGTERM),
        };
        let log = daemon.log();
        match how {
            Restart::Kill => assert!(
                !status.success(),
                "restart {i}: the daemon exited on its own ({status}) before the kill:\n{log}"
            ),
            Restart::Upgrade => assert!(
                status.success(),
                "restart {i}: SIGTERM: the daemon exited with {status}:\n{log}"
            ),
        }
        std::fs::write(dir.join(format!("serve-{i}.log")), &log).unwrap();
        resubmitted += log.matches("resubmitting requests").count();
        let bin = &binaries[(i + 1) % binaries.len()];
        daemon = Daemon::start_bin(bin, dir, &top, &args, &env);
    }
    let before = guest.rounds().len();
    guest.wait_for(
        "a guest round after the last restart",
        Duration::from_secs(120),
        |g| g.rounds().len() > before,
    );
    let elapsed = started.elapsed();
    guest.stop();
    let console = guest.console();
    let context = format!("{}\nlast daemon log:\n{}", guest.context(), daemon.log());
    daemon.stop();
    resubmitted += daemon.log().matches("resubmitting requests").count();

    // The guest's own verdict.
    let errors: Vec<&str> = console
        .lines()
        .filter(|l| l.contains("SQCOW2-GUEST-ERR") || l.contains("SQCOW2-GUEST-FAIL"))
        .collect();
    assert!(
        errors.is_empty(),
        "the guest saw errors:\n{}\n{context}",
        errors.join("\n")
    );
    assert_eq!(
        common::guest::field(&console, "SQCOW2-GUEST-KERNEL-IO-ERRORS"),
        Some("0"),
        "block I/O errors in the guest's kernel log\n{context}"
    );
    assert!(console.contains("SQCOW2-GUEST-DONE"), "{context}");
    let workers_done = console
        .lines()
        .filter(|l| l.contains("SQCOW2-GUEST-WORKER") && l.ends_with("errors=0"))
        .count();
    assert_eq!(workers_done as u64, WORKERS, "{context}");

    // The disk: the original content with the guest's writes applied.
    let rounds = guest.rounds();
    for r in &rounds {
        for block in r.first..r.first + r.blocks {
            let start = block as usize * BLOCK;
            expected[start..start + BLOCK].copy_from_slice(&r.block_bytes(block));
        }
    }
    std::fs::create_dir_all(dir.join("after")).unwrap();
    let actual = qemu_raw(&top, &dir.join("after"));
    if let Some(diff) = first_difference(&expected, &actual, &rounds) {
        panic!("qemu-img convert differs from the guest's record: {diff}\n{context}");
    }
    let (leaks, index) = check_after_crash(&top, &format!("after {restarts} restarts"));

    let writes: u64 = rounds.iter().map(|r| r.blocks).sum();
    let flushed: u64 = rounds.iter().filter(|r| r.synced).map(|r| r.blocks).sum();
    let longest = rounds
        .iter()
        .map(|r| r.write_ms.max(r.read_ms))
        .max()
        .unwrap_or(0);
    println!(
        "guest restart loop ({how:?}): {restarts} restarts in {:.0} s on a 20-layer chain; \
         {} guest rounds, {writes} 4 KiB writes verified ({flushed} flushed), 0 I/O errors, \
         0 verification failures; longest guest dd ({ROUND_BLOCKS} writes or reads) {longest} ms; \
         {resubmitted} daemon starts resubmitted in-flight requests; {leaks} leaked clusters, index {index}",
        elapsed.as_secs_f64(),
        rounds.len(),
    );
}

#[test]
fn guest_sees_no_error_across_kill_9_of_the_daemon() {
    restart_loop(Restart::Kill, env_count("SQCOW2_RESTARTS", 10));
}

#[test]
fn guest_sees_no_error_across_daemon_upgrades() {
    restart_loop(Restart::Upgrade, env_count("SQCOW2_RESTARTS", 4));
}

/// The console may glue the test's typed `stop` line before or after a
/// round's line; the round is found either way, and a line cut short is
/// not a round.
#[test]
fn round_lines_are_found_whatever_the_console_glued_to_them() {
    let plain = Round::parse("SQCOW2-GUEST-W 1 60 3730 16 0 103 2").unwrap();
    for line in [
        "stopSQCOW2-GUEST-W 1 60 3730 16 0 103 2",
        "SQCOW2-GUEST-W 1 60 3730 16 0 103 2stop",
        "SQCOW2-GUEST-W 1 60 3730 16 0 103 2 stop",
    ] {
        let r = Round::parse(line).unwrap_or_else(|| panic!("missed: {line}"));
        assert_eq!(
            (r.worker, r.round, r.first, r.blocks, r.synced, r.write_ms, r.read_ms),
            (
                plain.worker,
                plain.round,
                plain.first,
                plain.blocks,
                plain.synced,
                plain.write_ms,
                plain.read_ms
            ),
            "{line}"
        );
    }
    assert_eq!((plain.worker, plain.round, plain.first), (1, 60, 3730));
    assert!(Round::parse("SQCOW2-GUEST-W 1 60 3730 16 0").is_none());
    assert!(Round::parse("SQCOW2-GUEST-W 1 60 x3730 16 0 103 2").is_none());
}
