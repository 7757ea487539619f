//! Crash simulation: a storage layer records every write and flush of the
//! top image; the image is then rebuilt as it could be after a crash at
//! every point of the log, keeping or dropping each write not yet flushed
//! (at random and in adversarial orders). At each crash point: the image
//! has no errors for `qemu-img check` (leaks allowed), reopens,
//! `check -r leaks` leaves no leak, and every write completed before the
//! last completed flush reads back.
//!
//! Seeds also publish (`Durability::publish`: completed writes' mappings written
//! to the file without a sync) after every write, or after some: a power
//! loss must still leave only leaks, and a process death right after the
//! last operation (the file as the kernel's page cache holds it) must read
//! back every published write. With a mapping journal (v3 images), a
//! process death keeps every completed write, published or not, once the
//! journal is replayed by a read-write open; a power loss removes the
//! journal (it names the boot that wrote it).

mod common;
/// The engine tests' recording storage (every write, length change and
/// sync logged).
#[path = "../../sqcow2-format/tests/common/mod.rs"]
mod engine_storage;

use std::path::Path;
use std::process::Command;

use common::{qemu_img, qemu_io, run_raw, s};
use engine_storage::{apply, Op, TestStorage};
use sqcow2_format::check::{check, Repair};
use sqcow2_format::create::{image_bytes, CreateOptions};
use sqcow2_format::{Chain, ChainOptions, Version};

const SIZE: u64 = 2 << 20;

/// A guest operation of the workload and what it may leave on disk.
#[derive(Debug, Clone)]
enum GuestOp {
    Write { offset: u64, data: Vec<u8> },
    Zero { offset: u64, len: u64 },
    Flush,
}

#[derive(Debug)]
struct Config {
    cluster: u64,
    lazy: bool,
    extended_l2: bool,
    v2: bool,
    snapshot: bool,
}

impl Config {
    /// A qcow2 v3 top without extended L2 entries or internal snapshots.
    fn v3(cluster: u64, lazy: bool) -> Config {
        Config {
            cluster,
            lazy,
            extended_l2: false,
            v2: false,
            snapshot: false,
        }
    }
}

/// Base layer with data and compressed clusters, then a top created by
/// sqcow2 (optionally given data and an internal snapshot by QEMU, so that
/// clusters are shared). Returns the top's bytes.
fn prepare(dir: &Path, cfg: &Config) -> Vec<u8> {
    let base = dir.join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), &SIZE.to_string()]);
    qemu_io(
        &base,
        &[
            "write -P 0x41 0 1M".into(),
            "write -c -P 0x42 1M 512k".into(),
        ],
    );
    let opts = CreateOptions {
        size: SIZE,
        cluster_size: cfg.cluster,
        version: if cfg.v2 { Version::V2 } else { Version::V3 },
        extended_l2: cfg.extended_l2,
        lazy_refcounts: cfg.lazy,
        backing_file: Some("base.qcow2".into()),
        backing_format: Some("qcow2".into()),
        ..CreateOptions::default()
    };
    let top = dir.join("top.qcow2");
    std::fs::write(&top, image_bytes(&opts).unwrap()).unwrap();
    if cfg.snapshot {
        qemu_io(
            &top,
            &[
                "write -P 0x51 256k 512k".into(),
                "write -P 0x52 1536k 64k".into(),
            ],
        );
        qemu_img(&["snapshot", "-c", "s1", s(&top)]);
    }
    std::fs::read(&top).unwrap()
}

fn workload(rng: &mut fastrand::Rng, cluster: u64, n: usize) -> Vec<GuestOp> {
    (0..n)
        .map(|_| {
            let offset = rng.u64(0..SIZE);
            let len = rng.u64(1..=(2 * cluster).min(SIZE - offset));
            match rng.u8(0..10) {
                0..=5 => {
                    let mut data = vec![0u8; len as usize];
                    rng.fill(&mut data);
                    GuestOp::Write { offset, data }
                }
                6 => GuestOp::Zero { offset, len },
                _ => GuestOp::Flush,
            }
        })
        .collect()
}

/// When a seed publishes the mappings of completed writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Publish {
    Never,
    Always,
    Sometimes,
    /// When `Durability::needs_publish` says so (what the daemon does).
    WhenNeeded,
}

impl Publish {
    fn of_seed(seed: u64) -> Self {
        match seed % 4 {
            0 => Publish::Never,
            1 => Publish::Always,
            2 => Publish::Sometimes,
            _ => Publish::WhenNeeded,
        }
    }
}

/// The process died after the last operation: the file as the page cache
/// holds it (`live`), with the journal left beside it, is consistent and
/// reads back the model exactly after a reopen for writing (which replays
/// the journal), and before it too if every write was `published`.
fn process_death(top: &Path, live: &[u8], model: &[u8], lazy: bool, published: bool, ctx: &str) {
    std::fs::write(top, live).unwrap();
    let here = format!("{ctx} process death");
    if !lazy {
        let (code, out) = qemu_check_code(top);
        assert!(
            matches!(code, Some(0 | 3)),
            "{here}: qemu-img check:\n{out}"
        );
    }
    let read_back = |when: &str| {
        let chain = Chain::open(top, &ChainOptions::default())
            .unwrap_or_else(|e| panic!("{here}: open {when}: {e}"));
        let mut actual = vec![0u8; SIZE as usize];
        chain.read_at(&mut actual, 0).unwrap();
        if let Some(b) = actual.iter().zip(model).position(|(a, m)| a != m) {
            panic!(
                "{here}: {when}, byte {b} reads {:#x}, the last completed write left {:#x}",
                actual[b], model[b]
            );
        }
    };
    if !lazy && published {
        read_back("as left");
    }
    let rw = ChainOptions {
        writable: true,
        ..ChainOptions::default()
    };
    Chain::open(top, &rw)
        .unwrap_or_else(|e| panic!("{here}: reopen: {e}"))
        .close()
        .unwrap_or_else(|e| panic!("{here}: close: {e}"));
    let (code, out) = qemu_check_code(top);
    assert!(
        matches!(code, Some(0 | 3)),
        "{here}: qemu-img check after reopening:\n{out}"
    );
    read_back("after a reopen");
}

/// `got` holds the bytes every completed write left (`model`).
fn assert_reads_model(got: &[u8], model: &[u8], what: &str) {
    if let Some(b) = got.iter().zip(model).position(|(a, m)| a != m) {
        panic!(
            "{what}: byte {b} reads {:#x}, the last completed write left {:#x}",
            got[b], model[b]
        );
    }
}

/// `qemu-img check` finds nothing wrong with `top`.
fn assert_qemu_clean(top: &Path, what: &str) {
    let (code, out) = qemu_check_code(top);
    assert_eq!(code, Some(0), "{what}: qemu-img check:\n{out}");
}

fn qemu_check_code(top: &Path) -> (Option<i32>, String) {
    let out = run_raw(Command::new("qemu-img").args(["check", s(top)]));
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Runs one seed; returns the number of crash points checked.
fn run_seed(seed: u64) -> usize {
    let mut rng = fastrand::Rng::with_seed(seed);
    let cfg = Config {
        cluster: [4096u64, 65536][rng.usize(0..2)],
        lazy: rng.u8(0..3) == 0,
        extended_l2: false,
        v2: rng.u8(0..5) == 0,
        snapshot: rng.bool(),
    };
    let cfg = Config {
        extended_l2: !cfg.v2 && cfg.cluster == 65536 && rng.bool(),
        lazy: cfg.lazy && !cfg.v2,
        ..cfg
    };
    let ctx = format!("seed {seed} {cfg:?} {:?}", Publish::of_seed(seed));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let initial = prepare(dir, &cfg);
    let top = dir.join("top.qcow2");

    // Model of the disk before the workload: QEMU's view.
    let raw = dir.join("initial.raw");
    qemu_img(&["convert", "-O", "raw", s(&top), s(&raw)]);
    let mut model = std::fs::read(&raw).unwrap();

    let storage = TestStorage::new(initial.clone());
    // Half the seeds use a tiny cache, so that metadata is written back
    // early and slices are evicted while the workload runs.
    let options = ChainOptions {
        writable: true,
        top_storage: Some(storage.clone()),
        cache_size: if seed % 2 == 0 { 16 << 10 } else { 32 << 20 },
        slice_size: if seed % 2 == 0 { 512 } else { 4096 },
        ..ChainOptions::default()
    };
    let ops = workload(&mut rng, cfg.cluster, 50);
    let publish = Publish::of_seed(seed);
    // (op index, log length when the op completed, model after the op)
    let mut completed: Vec<(usize, usize, Option<Vec<u8>>)> = Vec::new();
    let mut all_safe = true;
    {
        let chain = Chain::open(&top, &options).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        for (i, op) in ops.iter().enumerate() {
            match op {
                GuestOp::Write { offset, data } => {
                    chain.write_at(data, *offset).unwrap();
                    model[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
                }
                GuestOp::Zero { offset, len } => {
                    chain.write_zeroes(*offset, *len, i % 2 == 0).unwrap();
                    model[*offset as usize..(*offset + *len) as usize].fill(0);
                }
                GuestOp::Flush => chain.flush().unwrap(),
            }
            let published = match publish {
                Publish::Never => false,
                Publish::Always => true,
                Publish::Sometimes => rng.bool(),
                Publish::WhenNeeded => chain.durability().needs_publish(),
            };
            if published && !matches!(op, GuestOp::Flush) {
                chain
                    .durability()
                    .publish()
                    .unwrap_or_else(|e| panic!("{ctx}: publish: {e}"));
            }
            // Whether every completed write so far survives a process
            // death: published, or journaled.
            all_safe &= !chain.durability().needs_publish();
            let log_len = storage.log_len();
            let snapshot = matches!(op, GuestOp::Flush).then(|| model.clone());
            completed.push((i, log_len, snapshot));
        }
        // No close: the process "dies" after the last operation.
        std::mem::forget(chain);
    }
    let log = storage.log();
    let initial_model = std::fs::read(&raw).unwrap();
    // The mapping journal (qcow2 v3): what a process death leaves of it is
    // the file as written (the page cache survives the process).
    let journal_path = dir.join("top.qcow2.sqjournal");
    let journal = std::fs::read(&journal_path).ok();
    assert_eq!(
        journal.is_some(),
        !cfg.v2,
        "{ctx}: a journal exactly for v3 images"
    );
    if publish == Publish::WhenNeeded {
        assert!(
            all_safe,
            "{ctx}: publishing when needed left a write unsafe"
        );
    }
    if all_safe {
        let live = storage.bytes();
        process_death(
            &top,
            &live,
            &model,
            cfg.lazy,
            publish == Publish::Always,
            &ctx,
        );
    }

    let mut points = 0;
    let mut durable = initial.clone();
    let mut last_sync = 0usize; // log entries [0, last_sync) are durable
    for k in 0..=log.len() {
        if k > 0 && matches!(log[k - 1], Op::Sync) {
            for op in &log[last_sync..k] {
                apply(&mut durable, op);
            }
            last_sync = k;
        }
        // The last flush completed by log position k, and the ops after it.
        let flushed = completed
            .iter()
            .rfind(|(i, at, _)| *at <= k && matches!(ops[*i], GuestOp::Flush));
        let (flush_index, expected) = match flushed {
            Some((i, _, Some(m))) => (Some(*i), m.clone()),
            _ => (None, initial_model.clone()),
        };
        let started_after: Vec<&GuestOp> = ops
            .iter()
            .enumerate()
            .filter(|(i, _)| flush_index.is_none_or(|f| *i > f))
            .filter(|(i, _)| *i == 0 || completed[*i - 1].1 <= k)
            .map(|(_, op)| op)
            .collect();
        let pending: Vec<&Op> = log[last_sync..k].iter().collect();
        let variants: Vec<Vec<&Op>> = if pending.is_empty() {
            vec![vec![]]
        } else {
            let subset: Vec<&Op> = pending.iter().copied().filter(|_| rng.bool()).collect();
            let mut shuffled = subset.clone();
            rng.shuffle(&mut shuffled);
            let reversed: Vec<&Op> = pending.iter().rev().copied().collect();
            let pick = [vec![], pending.clone(), subset, shuffled, reversed];
            let a = rng.usize(0..pick.len());
            let b = (a + 1 + rng.usize(0..pick.len() - 1)) % pick.len();
            vec![pick[a].clone(), pick[b].clone()]
        };
        for kept in variants {
            let mut image = durable.clone();
            for op in kept {
                apply(&mut image, op);
            }
            std::fs::write(&top, &image).unwrap();
            // A power loss: the machine boots again, and a journal names
            // the boot that wrote it (here: it is gone, as its page cache).
            let _ = std::fs::remove_file(&journal_path);
            let here = format!("{ctx} crash at log {k}/{}", log.len());
            if !cfg.lazy {
                let (code, out) = qemu_check_code(&top);
                assert!(
                    matches!(code, Some(0 | 3)),
                    "{here}: qemu-img check before reopening:\n{out}"
                );
            }
            // Reopen read-write (repairs a dirty image) and close cleanly.
            let rw = ChainOptions {
                writable: true,
                ..ChainOptions::default()
            };
            Chain::open(&top, &rw)
                .unwrap_or_else(|e| panic!("{here}: reopen: {e}"))
                .close()
                .unwrap_or_else(|e| panic!("{here}: close: {e}"));
            let (code, out) = qemu_check_code(&top);
            assert!(
                matches!(code, Some(0 | 3)),
                "{here}: qemu-img check after reopening:\n{out}"
            );
            let report = check(&top, Repair::Leaks, sqcow2_format::Locking::Auto, false).unwrap();
            assert_eq!(
                (report.leaks, report.corruptions),
                (0, 0),
                "{here}: after check -r leaks"
            );
            let (code, out) = qemu_check_code(&top);
            assert_eq!(code, Some(0), "{here}: qemu-img check after repair:\n{out}");

            let chain = Chain::open(&top, &ChainOptions::default()).unwrap();
            let mut actual = vec![0u8; SIZE as usize];
            chain.read_at(&mut actual, 0).unwrap();
            for (b, (&got, &want)) in actual.iter().zip(&expected).enumerate() {
                if got == want {
                    continue;
                }
                let b = b as u64;
                let explained = started_after.iter().any(|op| match op {
                    GuestOp::Write { offset, data } => {
                        b >= *offset
                            && b < offset + data.len() as u64
                            && data[(b - offset) as usize] == got
                    }
                    GuestOp::Zero { offset, len } => b >= *offset && b < offset + len && got == 0,
                    GuestOp::Flush => false,
                });
                assert!(
                    explained,
                    "{here}: byte {b} reads {got:#x}, flushed value {want:#x}"
                );
            }
            points += 1;
        }
    }
    points
}

#[test]
fn crash_at_every_point_of_the_log() {
    let seeds: u64 = std::env::var("SQCOW2_CRASH_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let points: usize = (0..seeds).map(run_seed).sum();
    println!("{points} crash points checked");
    assert!(points >= 1000 || seeds < 8, "only {points} crash points");
}

/// A top prepared in `dir` for `cfg`, and a writer of it that flushes
/// once, then makes 60 writes and zeroes from `rng` with the journal on
/// (publishing only when the chain asks) and dies: nothing closed or
/// written back. Returns the top and the bytes its completed writes left.
fn die_with_journal(
    dir: &Path,
    cfg: &Config,
    rng: &mut fastrand::Rng,
    ctx: &str,
) -> (std::path::PathBuf, Vec<u8>) {
    prepare(dir, cfg);
    let top = dir.join("top.qcow2");
    let raw = dir.join("initial.raw");
    qemu_img(&["convert", "-O", "raw", s(&top), s(&raw)]);
    let mut model = std::fs::read(&raw).unwrap();
    // No image locks: the "dead" writer keeps its descriptors.
    let writer = ChainOptions {
        writable: true,
        locking: sqcow2_format::Locking::Off,
        ..ChainOptions::default()
    };
    let chain = Chain::open(&top, &writer).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    assert!(chain.durability().journaled(), "{ctx}: no journal");
    // A flush first (the tables exist and spares are made), then
    // writes and zeroes, published only when the chain says so.
    chain.write_at(&[0x77; 4096], 0).unwrap();
    model[..4096].fill(0x77);
    chain.flush().unwrap();
    for op in workload(rng, cfg.cluster, 60) {
        match op {
            GuestOp::Write { offset, data } => {
                chain.write_at(&data, offset).unwrap();
                model[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
            }
            GuestOp::Zero { offset, len } => {
                chain.write_zeroes(offset, len, false).unwrap();
                model[offset as usize..(offset + len) as usize].fill(0);
            }
            GuestOp::Flush => {}
        }
        if chain.durability().needs_publish() {
            chain.durability().publish().unwrap();
        }
    }
    // The process dies: nothing is closed or written back.
    std::mem::forget(chain);
    (top, model)
}

/// A process death with writes since the last flush and none published:
/// every completed write is in the journal. Read-only (no replay), the
/// image shows the state of its last checkpoint, consistent for QEMU; a
/// read-write open replays the journal and reads back every completed
/// write; QEMU finds the image clean then. Real files, real page cache.
#[test]
fn a_process_death_keeps_every_completed_write_through_the_journal() {
    let mut journal_mattered = 0;
    for seed in 0..6u64 {
        let mut rng = fastrand::Rng::with_seed(1000 + seed);
        let cfg = Config {
            // 512-byte clusters: a table maps 32 KiB, so the workload makes
            // new tables after the flush (records of their L1 entries).
            cluster: [512u64, 4096, 65536][seed as usize % 3],
            lazy: seed % 3 == 2,
            extended_l2: seed % 3 == 1,
            v2: false,
            snapshot: seed % 2 == 1,
        };
        let cfg = Config {
            cluster: if cfg.extended_l2 { 65536 } else { cfg.cluster },
            ..cfg
        };
        let ctx = format!("seed {seed} {cfg:?}");
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let rw = ChainOptions {
            writable: true,
            ..ChainOptions::default()
        };
        let (top, model) = die_with_journal(dir, &cfg, &mut rng, &ctx);
        let read = |opts: &ChainOptions| {
            let chain = Chain::open(&top, opts).unwrap_or_else(|e| panic!("{ctx}: open: {e}"));
            let mut got = vec![0u8; SIZE as usize];
            chain.read_at(&mut got, 0).unwrap();
            chain.close().unwrap();
            got
        };
        if !cfg.lazy {
            let (code, out) = qemu_check_code(&top);
            assert!(
                matches!(code, Some(0 | 3)),
                "{ctx}: qemu-img check as left:\n{out}"
            );
        }
        if read(&ChainOptions::default()) != model {
            journal_mattered += 1;
        }
        assert_reads_model(&read(&rw), &model, &format!("{ctx}: after the replay"));
        assert_qemu_clean(&top, &format!("{ctx}: after the replay"));
        assert!(
            !dir.join("top.qcow2.sqjournal").exists(),
            "{ctx}: a clean close leaves no journal"
        );
    }
    assert!(
        journal_mattered >= 4,
        "the journal held writes the image did not in only {journal_mattered} of 6 seeds"
    );
}

/// A journal left by a dead writer is never replayed over what another
/// writer did since: QEMU, opening the image for writing, clears the
/// journal's autoclear bit (and repairs the dirty image), and a later
/// read-write open by sqcow2 then leaves the image as QEMU left it.
#[test]
fn a_journal_is_not_replayed_after_qemu_wrote_the_image() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let cfg = Config::v3(65536, false);
    prepare(dir, &cfg);
    let top = dir.join("top.qcow2");
    {
        let chain = Chain::open(
            &top,
            &ChainOptions {
                writable: true,
                locking: sqcow2_format::Locking::Off,
                ..ChainOptions::default()
            },
        )
        .unwrap();
        chain.write_at(&[0x11; 4096], 0).unwrap();
        chain.flush().unwrap();
        // Journaled, not checkpointed: 0x22 over the base's 0x41.
        chain.write_at(&[0x22; 4096], 1 << 20).unwrap();
        assert!(!chain.durability().needs_publish());
        std::mem::forget(chain);
    }
    assert!(dir.join("top.qcow2.sqjournal").exists());
    // QEMU writes the same block, then closes the image.
    qemu_io(&top, &["write -P 0x33 1M 4k".into()]);
    let rw = ChainOptions {
        writable: true,
        ..ChainOptions::default()
    };
    let chain = Chain::open(&top, &rw).unwrap();
    let mut got = vec![0u8; 4096];
    chain.read_at(&mut got, 1 << 20).unwrap();
    assert_eq!(
        got,
        vec![0x33; 4096],
        "the journal was replayed over QEMU's write"
    );
    chain.read_at(&mut got, 0).unwrap();
    assert_eq!(got, vec![0x11; 4096]);
    chain.close().unwrap();
    let (code, out) = qemu_check_code(&top);
    assert_eq!(code, Some(0), "{out}");
}

/// After a process death, `sqcow2 check` (read-only) says that completed
/// writes wait in the journal, and `check -r all` applies them before it
/// repairs, as a read-write open would: QEMU, which does not know the
/// journal, then reads every completed write and finds the image clean.
#[test]
fn check_with_repair_applies_a_dead_writers_journal() {
    for seed in 0..2u64 {
        let mut rng = fastrand::Rng::with_seed(2000 + seed);
        let cfg = Config::v3(4096, seed == 1);
        let ctx = format!("seed {seed} {cfg:?}");
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (top, model) = die_with_journal(dir, &cfg, &mut rng, &ctx);
        let journal = dir.join("top.qcow2.sqjournal");
        assert!(journal.exists(), "{ctx}: no journal left");

        let off = sqcow2_format::Locking::Off;
        let report = check(&top, Repair::None, off, false).unwrap();
        assert!(
            report.messages.iter().any(|m| m.contains("journal")),
            "{ctx}: the read-only check does not mention the journal: {:?}",
            report.messages
        );
        let report = check(&top, Repair::All, off, false).unwrap();
        assert_eq!(
            (report.corruptions, report.leaks),
            (0, 0),
            "{ctx}: after check -r all: {:?}",
            report.messages
        );
        assert!(!journal.exists(), "{ctx}: the journal is still there");
        let header = sqcow2_format::Header::read(
            &sqcow2_format::storage::FileStorage::open_read_only(&top).unwrap(),
        )
        .unwrap();
        assert!(!header.is_dirty(), "{ctx}: left dirty after check -r all");
        let after = dir.join("after.raw");
        qemu_img(&["convert", "-U", "-O", "raw", s(&top), s(&after)]);
        let what = format!("{ctx}: after check -r all, as QEMU reads it");
        assert_reads_model(&std::fs::read(&after).unwrap(), &model, &what);
        assert_qemu_clean(&top, &what);
    }
}

/// A writer that died while its top already had a new top over it (a live
/// snapshot's daemon killed between the switch and the old top's close)
/// leaves a backing layer with the dirty bit, spare clusters and perhaps a
/// journal. The next read-write open of the chain repairs it as it would
/// its top: the journal applied, the refcounts repaired, the bit cleared.
/// The chain then reads every completed write, QEMU reads the same bytes
/// and finds every layer clean.
#[test]
fn the_next_writer_repairs_a_backing_layer_a_dead_writer_left() {
    for seed in 0..4u64 {
        let mut rng = fastrand::Rng::with_seed(3000 + seed);
        let cfg = Config::v3([4096u64, 65536][seed as usize % 2], seed >= 2);
        let ctx = format!("seed {seed} {cfg:?}");
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (old_top, model) = die_with_journal(dir, &cfg, &mut rng, &ctx);
        // The new top over it, as a live snapshot makes it.
        let new_top = dir.join("new.qcow2");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            "top.qcow2",
            s(&new_top),
        ]);
        let rw = ChainOptions {
            writable: true,
            ..ChainOptions::default()
        };
        let chain = Chain::open(&new_top, &rw).unwrap_or_else(|e| panic!("{ctx}: open: {e}"));
        let mut got = vec![0u8; SIZE as usize];
        chain.read_at(&mut got, 0).unwrap();
        assert_reads_model(&got, &model, &format!("{ctx}: through the next writer"));
        chain.close().unwrap();
        assert!(
            !dir.join("top.qcow2.sqjournal").exists(),
            "{ctx}: the old top's journal is still there"
        );
        for layer in [&old_top, &new_top] {
            assert_qemu_clean(layer, &format!("{ctx}: {}", layer.display()));
        }
        let raw = dir.join("after.raw");
        qemu_img(&["convert", "-O", "raw", s(&new_top), s(&raw)]);
        assert_reads_model(
            &std::fs::read(&raw).unwrap(),
            &model,
            &format!("{ctx}: as QEMU reads the chain"),
        );
    }
}

/// A backing layer that is only dirty (a writer with lazy refcounts, here
/// a live QEMU, that has it open; or one that died without a journal) is
/// read as QEMU reads a backing file: the next writer of the chain does
/// not repair it, which would rewrite the refcounts of an image another
/// process may be writing (with image locks off, nothing else stops it).
#[test]
fn a_backing_layer_that_is_only_dirty_is_not_repaired() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = dir.join("base.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "lazy_refcounts=on",
        s(&base),
        "4M",
    ]);
    let mut writer = Command::new("qemu-io")
        .args(["-c", "write -P 0x61 0 64k", "-c", "sleep 20000", s(&base)])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("qemu-io");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while !common::dirty_bit(&base) {
        assert!(
            std::time::Instant::now() < deadline,
            "QEMU never set the dirty bit"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let header = std::fs::read(&base).unwrap()[..104].to_vec();
    let top = dir.join("top.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-F",
        "qcow2",
        "-b",
        "base.qcow2",
        s(&top),
        "4M",
    ]);
    let rw = ChainOptions {
        writable: true,
        locking: sqcow2_format::Locking::Off,
        ..ChainOptions::default()
    };
    let chain = Chain::open(&top, &rw).expect("open over a dirty backing layer");
    chain.write_at(&[0x62; 4096], 1 << 20).unwrap();
    chain.close().unwrap();
    assert_eq!(
        std::fs::read(&base).unwrap()[..104],
        header[..],
        "the next writer changed the header of a backing layer QEMU is writing"
    );
    assert!(common::dirty_bit(&base));
    let _ = writer.kill();
    let _ = writer.wait();
}
