//! Soak: 4 queues at queue depth 32, 70 % reads / 30 % writes of random
//! 16 KiB blocks, every read checked against a model, on a 100-layer
//! indexed chain served by `sqcow2 serve`. At the end: zero errors, the
//! daemon's RSS within 5 % of its RSS after the first minute (runs of at
//! least 5 minutes), every block read back through the daemon, and the
//! image checked and compared with `qemu-img`.
//!
//! `SQCOW2_SOAK_SECONDS` (default 20 in the test run; `scripts/long-test.sh soak`
//! runs 600), `SQCOW2_SOAK_SIZE` (default 256M), `SQCOW2_SOAK_SEED`.

mod common;

use std::mem::MaybeUninit;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blkio::{Blkioq, ReqFlags};
use common::vhost::{connect_retry, Daemon, BUF_SIZE};
use common::{env_count, gen_chain, qemu_raw, run_raw, s};

const BLOCK: usize = 16 << 10;
const QUEUES: usize = 4;
const DEPTH: usize = 32;

/// Content of version `v` of `block`.
fn version_bytes(block: u64, v: u32) -> Vec<u8> {
    common::tagged_block(block, v, BLOCK)
}

fn rss_kib(pid: i32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[derive(Default)]
struct QueueReport {
    reads: u64,
    writes: u64,
    errors: u64,
    mismatches: u64,
    first_problem: Option<String>,
}

/// One queue's workload on the blocks `b` with `b % QUEUES == q`; returns
/// its report and its final model (block -> version, 0 = original).
#[allow(clippy::too_many_arguments)]
fn run_queue(
    q: usize,
    mut queue: Blkioq,
    region: usize,
    blocks: u64,
    original: Arc<Vec<u8>>,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> (QueueReport, Vec<u32>) {
    let mut rng = fastrand::Rng::with_seed(seed ^ q as u64);
    let mine: Vec<u64> = (0..blocks).filter(|b| *b as usize % QUEUES == q).collect();
    let mut model = vec![0u32; mine.len()];
    let mut report = QueueReport::default();
    // slot -> (index into `mine`, Some(version) for a write, None for a read)
    let mut slots: Vec<Option<(usize, Option<u32>)>> = vec![None; DEPTH];
    let mut busy = vec![false; mine.len()];
    let mut next_version = 0u32;
    let base = region + q * DEPTH * BLOCK;
    let mut completions: Vec<MaybeUninit<blkio::Completion>> =
        (0..DEPTH).map(|_| MaybeUninit::uninit()).collect();
    let note = |report: &mut QueueReport, what: String| {
        if report.first_problem.is_none() {
            report.first_problem = Some(what);
        }
    };
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        if !stopping {
            for (slot, state) in slots.iter_mut().enumerate() {
                if state.is_some() {
                    continue;
                }
                let i = loop {
                    let i = rng.usize(0..mine.len());
                    if !busy[i] {
                        break i;
                    }
                };
                busy[i] = true;
                let ptr = (base + slot * BLOCK) as *mut u8;
                let offset = mine[i] * BLOCK as u64;
                if rng.u32(0..10) < 7 {
                    queue.read(offset, ptr, BLOCK, slot, ReqFlags::empty());
                    *state = Some((i, None));
                } else {
                    next_version += 1;
                    let data = version_bytes(mine[i], next_version);
                    // SAFETY: this slot's part of the mapped region belongs
                    // to this thread and no request is using it.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, BLOCK) };
                    queue.write(offset, ptr, BLOCK, slot, ReqFlags::empty());
                    *state = Some((i, Some(next_version)));
                }
            }
        }
        if slots.iter().all(Option::is_none) {
            return (report, model);
        }
        let mut timeout = Duration::from_secs(60);
        let got = queue
            .do_io(&mut completions, 1, Some(&mut timeout), None)
            .expect("do_io");
        assert!(got > 0, "queue {q}: no completion within 60 s");
        for c in &completions[..got] {
            // SAFETY: do_io initialised the first `got` entries.
            let c = unsafe { c.assume_init_ref() };
            let slot = c.user_data;
            let (i, write) = slots[slot].take().expect("a request in this slot");
            busy[i] = false;
            if c.ret != 0 {
                report.errors += 1;
                note(&mut report, format!("queue {q}: request error {}", c.ret));
                continue;
            }
            match write {
                Some(v) => {
                    report.writes += 1;
                    model[i] = v;
                }
                None => {
                    report.reads += 1;
                    // SAFETY: the read into this slot has completed.
                    let got = unsafe {
                        std::slice::from_raw_parts((base + slot * BLOCK) as *const u8, BLOCK)
                    };
                    let block = mine[i];
                    let ok = if model[i] == 0 {
                        let at = block as usize * BLOCK;
                        got == &original[at..at + BLOCK]
                    } else {
                        *got == version_bytes(block, model[i])[..]
                    };
                    if !ok {
                        report.mismatches += 1;
                        note(
                            &mut report,
                            format!("queue {q}: block {block} read wrong data"),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn soak_four_queues_depth_32_mixed_verified() {
    let seconds: u64 = env_count("SQCOW2_SOAK_SECONDS", 20);
    let seed: u64 = env_count("SQCOW2_SOAK_SEED", 0x50a4);
    let size = std::env::var("SQCOW2_SOAK_SIZE").unwrap_or_else(|_| "256M".into());
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let chain_dir = dir.join("chain");
    std::fs::create_dir(&chain_dir).unwrap();
    let top = gen_chain(&chain_dir, 100, &size, "0.3");
    let original = Arc::new(qemu_raw(&top, dir));
    let blocks = original.len() as u64 / BLOCK as u64;
    const { assert!(QUEUES * DEPTH * BLOCK <= BUF_SIZE) };

    let mut daemon = Daemon::start(dir, &top, &["--num-queues", "4"]);
    let mut client = connect_retry(&daemon, QUEUES as i32, false);
    let pid = daemon.pid();
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let workers = client.spawn_per_queue({
        let (original, stop) = (original.clone(), stop.clone());
        move |q, queue, region| {
            run_queue(
                q,
                queue,
                region,
                blocks,
                original.clone(),
                stop.clone(),
                seed,
            )
        }
    });

    let baseline_at = Duration::from_secs(60.min(seconds / 3));
    std::thread::sleep(baseline_at);
    let (rss_baseline, _) = rss_kib(pid);
    let mut samples = vec![(baseline_at.as_secs(), rss_baseline)];
    let end = started + Duration::from_secs(seconds);
    let mut next_sample = started + baseline_at + Duration::from_secs(60);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(500));
        if Instant::now() >= next_sample {
            samples.push((started.elapsed().as_secs(), rss_kib(pid).0));
            next_sample += Duration::from_secs(60);
        }
    }
    let (rss_end, hwm) = rss_kib(pid);
    stop.store(true, Ordering::Relaxed);
    let mut model = vec![0u32; blocks as usize];
    let mut total = QueueReport::default();
    for (q, w) in workers.into_iter().enumerate() {
        let (r, m) = w.join().expect("queue thread");
        for (k, v) in m.into_iter().enumerate() {
            model[q + k * QUEUES] = v;
        }
        total.reads += r.reads;
        total.writes += r.writes;
        total.errors += r.errors;
        total.mismatches += r.mismatches;
        total.first_problem = total.first_problem.or(r.first_problem);
    }
    let elapsed = started.elapsed().as_secs_f64();

    // Content at the end, through the daemon and then through qemu-img.
    let mut expected = original.to_vec();
    for (b, &v) in model.iter().enumerate() {
        if v != 0 {
            expected[b * BLOCK..(b + 1) * BLOCK].copy_from_slice(&version_bytes(b as u64, v));
        }
    }
    client.queues = Vec::new();
    drop(client);
    let mut reader = connect_retry(&daemon, 1, true);
    let chunk = 4 << 20;
    for at in (0..expected.len()).step_by(chunk) {
        let len = chunk.min(expected.len() - at);
        assert!(
            reader.read(at as u64, len) == expected[at..at + len],
            "content at {at} differs at the end of the soak"
        );
    }
    drop(reader);
    daemon.stop();
    let check = run_raw(Command::new("qemu-img").args(["check", s(&top)]));
    assert!(
        check.status.success(),
        "qemu-img check:\n{}",
        String::from_utf8_lossy(&check.stdout)
    );
    assert!(
        qemu_raw(&top, dir) == expected,
        "qemu-img convert differs from the model"
    );

    let growth = rss_end as f64 / rss_baseline.max(1) as f64 - 1.0;
    eprintln!(
        "soak: {elapsed:.0} s, 4 queues x depth 32, {} reads + {} writes ({:.0} IOPS), {} errors, {} wrong reads; RSS {} KiB after {} s, {} KiB at the end ({:+.1} %), peak {} KiB; samples {:?}",
        total.reads,
        total.writes,
        (total.reads + total.writes) as f64 / elapsed,
        total.errors,
        total.mismatches,
        rss_baseline,
        baseline_at.as_secs(),
        rss_end,
        growth * 100.0,
        hwm,
        samples
    );
    assert_eq!(
        (total.errors, total.mismatches),
        (0, 0),
        "{}",
        total.first_problem.unwrap_or_default()
    );
    assert!(total.reads > 0 && total.writes > 0);
    if seconds >= 300 {
        assert!(
            growth <= 0.05,
            "RSS grew {:.1} % after the first minute ({rss_baseline} -> {rss_end} KiB)",
            growth * 100.0
        );
    }
}
