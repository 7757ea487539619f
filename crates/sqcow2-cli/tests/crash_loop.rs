//! Crash loop: `kill -9` of `sqcow2 serve` at random moments while a
//! libblkio client writes and flushes, on a 100-layer indexed chain. After
//! every kill: `qemu-img check` finds no errors (leaks are allowed: the
//! crash contract), `sqcow2 check` finds the chain index agreeing with a
//! walk (or reports it stale), the chain reopens, and every write
//! *completed* before the kill reads back, flushed or not: a process death
//! is not a power loss, and the daemon publishes a write's mapping to the
//! page cache before it completes it. A write still in flight may read
//! old or new, sector by sector, never anything else. `qemu-img convert` checks
//! the same from QEMU's side every tenth round and at the end.
//!
//! `SQCOW2_CRASH_ITERATIONS` (default 5 in the test run;
//! `scripts/long-test.sh crash-loop` runs 100) and `SQCOW2_CRASH_SEED`.

mod common;

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use blkio::ReqFlags;
use common::vhost::{connect_retry, Client, Daemon};
use common::{check_after_crash, env_count, gen_chain, qemu_raw};

const BLOCK: usize = 16 << 10;
const SECTOR: usize = 512;
const DEPTH: usize = 8;
/// Blocks the workload writes to (the first 64 MiB of the disk).
const BLOCKS: u64 = 4096;

/// Content of version `v` of `block`.
fn version_bytes(block: u64, v: u32) -> Vec<u8> {
    common::tagged_block(block, v, BLOCK)
}

/// What each block may hold: the version last made durable by a flush,
/// and every version written (or being written) since.
#[derive(Default)]
struct Model {
    durable: HashMap<u64, u32>,
    since_flush: HashMap<u64, Vec<u32>>,
    /// The newest version of each block whose write has completed.
    completed: HashMap<u64, u32>,
    next_version: u32,
}

impl Model {
    /// Version `v` of `block` is in the files: older ones cannot return.
    fn settle(&mut self, block: u64, v: u32) {
        if self.durable.get(&block).is_some_and(|&d| d >= v) {
            return;
        }
        self.durable.insert(block, v);
        if let Some(list) = self.since_flush.get_mut(&block) {
            list.retain(|&x| x > v);
            if list.is_empty() {
                self.since_flush.remove(&block);
            }
        }
    }

    fn candidates(&self, block: u64) -> Vec<u32> {
        let mut c: Vec<u32> = self.durable.get(&block).copied().into_iter().collect();
        c.extend(self.since_flush.get(&block).into_iter().flatten());
        c
    }

    /// Every sector of `got` must be that sector of one candidate (the
    /// base content, v = 0, stands for "never written": checked against
    /// `original`). Returns the version the block now holds when the
    /// whole block is one version, so the model can settle on it.
    fn check(&self, block: u64, got: &[u8], original: &[u8]) -> Result<Option<u32>, String> {
        let cands = self.candidates(block);
        let never_durable = !self.durable.contains_key(&block);
        let mut versions: Vec<(u32, Vec<u8>)> = cands
            .iter()
            .map(|&v| (v, version_bytes(block, v)))
            .collect();
        if never_durable {
            versions.push((0, original.to_vec()));
        }
        let mut whole: Option<Option<u32>> = None;
        for (i, sector) in got.chunks(SECTOR).enumerate() {
            let range = i * SECTOR..(i + 1) * SECTOR;
            let matching: Vec<u32> = versions
                .iter()
                .filter(|(_, b)| b[range.clone()] == *sector)
                .map(|(v, _)| *v)
                .collect();
            if matching.is_empty() {
                return Err(format!(
                    "block {block} sector {i}: matches none of versions {:?}",
                    versions.iter().map(|(v, _)| v).collect::<Vec<_>>()
                ));
            }
            let this = matching.last().copied();
            whole = match whole {
                None => Some(this),
                Some(w) if w == this => Some(w),
                Some(_) => Some(None),
            };
        }
        Ok(whole.flatten())
    }
}

struct Round {
    writes: usize,
    flushes: usize,
    in_flight_at_kill: usize,
}

/// Writes and flushes until the daemon dies (killed by another thread).
fn workload(
    client: &mut Client,
    daemon: &mut Daemon,
    model: &mut Model,
    rng: &mut fastrand::Rng,
) -> Round {
    let mut round = Round {
        writes: 0,
        flushes: 0,
        in_flight_at_kill: 0,
    };
    let base = client.region.addr as *mut u8;
    // slot -> (block, version); slot DEPTH is the flush.
    let mut in_flight: HashMap<usize, (u64, u32)> = HashMap::new();
    let mut flush_pending: Option<HashMap<u64, u32>> = None;
    let mut completions: Vec<MaybeUninit<blkio::Completion>> =
        (0..DEPTH + 1).map(|_| MaybeUninit::uninit()).collect();
    loop {
        // Keep DEPTH writes in flight; now and then a flush.
        if flush_pending.is_none() && rng.u32(0..12) == 0 {
            // Everything completed so far becomes durable when it succeeds.
            flush_pending = Some(model.completed.clone());
            client.queues[0].flush(DEPTH, ReqFlags::empty());
        }
        for slot in 0..DEPTH {
            if in_flight.contains_key(&slot) {
                continue;
            }
            let block = loop {
                let b = rng.u64(0..BLOCKS);
                if !in_flight.values().any(|(x, _)| *x == b) {
                    break b;
                }
            };
            model.next_version += 1;
            let v = model.next_version;
            // SAFETY: slot `slot` of the client's mapped region is ours
            // until its write completes.
            let buf = unsafe { std::slice::from_raw_parts_mut(base.add(slot * BLOCK), BLOCK) };
            buf.copy_from_slice(&version_bytes(block, v));
            // Possibly torn or lost, but a candidate from now on.
            model.since_flush.entry(block).or_default().push(v);
            client.queues[0].write(
                block * BLOCK as u64,
                buf.as_ptr(),
                BLOCK,
                slot,
                ReqFlags::empty(),
            );
            in_flight.insert(slot, (block, v));
        }
        let mut timeout = Duration::from_millis(200);
        let got = client.queues[0]
            .do_io(&mut completions, 1, Some(&mut timeout), None)
            .unwrap_or(0);
        if got == 0 && !daemon.is_running() {
            round.in_flight_at_kill = in_flight.len() + usize::from(flush_pending.is_some());
            return round;
        }
        for c in &completions[..got] {
            // SAFETY: do_io initialised the first `got` entries.
            let c = unsafe { c.assume_init_ref() };
            if c.user_data == DEPTH {
                let snapshot = flush_pending.take().expect("a flush in flight");
                if c.ret == 0 {
                    round.flushes += 1;
                    // Writes completed before the flush was sent are
                    // durable; older versions can no longer come back.
                    for (block, v) in snapshot {
                        model.settle(block, v);
                    }
                }
            } else if let Some((block, v)) = in_flight.remove(&c.user_data) {
                if c.ret == 0 {
                    round.writes += 1;
                    let newest = model.completed.entry(block).or_insert(v);
                    *newest = (*newest).max(v);
                    // Completed: it survives a kill of the daemon, so older
                    // versions can no longer come back (writes to one
                    // block never overlap).
                    model.settle(block, v);
                }
            }
        }
    }
}

fn verify(
    client: &mut Client,
    daemon: &Daemon,
    model: &mut Model,
    original: &[u8],
    round: usize,
) -> usize {
    let mut blocks: Vec<u64> = model
        .durable
        .keys()
        .chain(model.since_flush.keys())
        .copied()
        .collect();
    blocks.sort_unstable();
    blocks.dedup();
    for &block in &blocks {
        let got = client
            .try_read(block * BLOCK as u64, BLOCK)
            .unwrap_or_else(|e| {
                let killed = std::fs::read_to_string(daemon.socket.with_file_name("killed.log"))
                    .unwrap_or_default();
                panic!(
                    "round {round}: reading block {block} after reopening: {e}\n\
                     log of the reopened daemon:\n{}\nlog of the killed one:\n{killed}",
                    daemon.log()
                )
            });
        let at = block as usize * BLOCK;
        match model.check(block, &got, &original[at..at + BLOCK]) {
            // The reopened chain's files hold one version of the block: it
            // stays until overwritten (a kill loses memory, not the page
            // cache), so the model settles on it.
            Ok(Some(0)) => {
                model.since_flush.remove(&block);
                model.completed.remove(&block);
            }
            Ok(Some(v)) => {
                model.durable.insert(block, v);
                model.since_flush.remove(&block);
                model.completed.remove(&block);
            }
            // Torn between versions: every one of them stays possible.
            Ok(None) => {}
            Err(e) => panic!("round {round}: {e}"),
        }
    }
    blocks.len()
}

#[test]
fn kill_9_during_writes_loses_nothing_completed() {
    let iterations: usize = env_count("SQCOW2_CRASH_ITERATIONS", 5);
    let seed: u64 = env_count("SQCOW2_CRASH_SEED", 0x5eed);
    let layers: usize = env_count("SQCOW2_CRASH_LAYERS", 100);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let chain_dir = dir.join("chain");
    std::fs::create_dir(&chain_dir).unwrap();
    let top = gen_chain(&chain_dir, layers, "128M", "0.3");
    let original = qemu_raw(&top, dir);
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut model = Model::default();
    let started = Instant::now();
    let (mut writes, mut flushes, mut blocks_verified) = (0, 0, 0);
    let mut leaks = 0;
    for round in 0..iterations {
        let mut daemon = Daemon::start(dir, &top, &[]);
        let mut client = connect_retry(&daemon, 1, false);
        // Verify what the previous crash left (the chain reopened).
        blocks_verified = verify(&mut client, &daemon, &mut model, &original, round);
        let pid = daemon.pid();
        let delay = Duration::from_millis(rng.u64(20..1500));
        let killer = std::thread::spawn(move || {
            std::thread::sleep(delay);
            // SAFETY: kill(2) on the daemon's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        });
        let r = workload(&mut client, &mut daemon, &mut model, &mut rng);
        killer.join().unwrap();
        drop(client);
        let status = daemon.stop_with(libc::SIGKILL);
        // The daemon must have died of our kill, not on its own before it.
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL),
            "round {round}: the daemon ended with {status} before the kill:\n{}",
            daemon.log()
        );
        // Kept for a failure found when the chain is reopened.
        let _ = std::fs::write(dir.join("killed.log"), daemon.log());
        writes += r.writes;
        flushes += r.flushes;
        let (l, state) = check_after_crash(&top, &format!("round {round}"));
        leaks = l;
        eprintln!(
            "round {round}: killed after {} ms: {} writes, {} flushes, {} in flight; leaks {l}, index {state}",
            delay.as_millis(),
            r.writes,
            r.flushes,
            r.in_flight_at_kill
        );
        if round % 10 == 9 || round + 1 == iterations {
            let now = qemu_raw(&top, dir);
            for (&block, _) in model.durable.iter() {
                let at = block as usize * BLOCK;
                if let Err(e) = model.check(block, &now[at..at + BLOCK], &original[at..at + BLOCK])
                {
                    panic!("round {round}, qemu-img convert: {e}");
                }
            }
        }
    }
    // Final reopen and verification.
    let mut daemon = Daemon::start(dir, &top, &[]);
    let mut client = connect_retry(&daemon, 1, false);
    blocks_verified = blocks_verified.max(verify(
        &mut client,
        &daemon,
        &mut model,
        &original,
        iterations,
    ));
    drop(client);
    daemon.stop();
    eprintln!(
        "crash loop: {iterations} kills on a {layers}-layer chain in {:.0} s: {writes} writes, {flushes} flushes acknowledged, {blocks_verified} blocks verified, 0 errors, {leaks} leaked clusters at the end",
        started.elapsed().as_secs_f64()
    );
}
