//! The writable engine without QEMU: races pinned down with held writes,
//! failing writes and syncs, crash points rebuilt from the write log, the
//! engine's own `check` as the oracle. Runs in seconds; the QEMU-oracle
//! tests in the workspace's `tests/` are the second tier.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{apply, fake_path, image, open, Op, TestStorage};
use sqcow2_format::check::{check_storage, CheckReport, Repair};
use sqcow2_format::storage::{MemStorage, Storage};
use sqcow2_format::{Chain, ChainOptions, GuestOffset};

const CLUSTER: u64 = 65536;
const MIB: u64 = 1 << 20;

fn check(storage: Arc<dyn Storage>) -> CheckReport {
    check_storage(&fake_path(), storage, Repair::None).expect("check runs")
}

fn assert_clean(storage: &Arc<TestStorage>) -> CheckReport {
    let r = check(storage.clone());
    assert_eq!(r.corruptions, 0, "corruptions: {:?}", r.messages);
    assert_eq!(r.leaks, 0, "leaks: {:?}", r.messages);
    r
}

/// Host offset of the top's own cluster at `guest`, if it is one.
/// Where a write to `guest` would go in place (mappings not yet published
/// to the file never go in place: publish first).
fn host_of(chain: &Chain, guest: u64) -> Option<u64> {
    chain.durability().publish().expect("publish");
    let ticket = chain.transfers().begin();
    chain
        .transfers()
        .in_place_target(&ticket, GuestOffset(guest), 512)
        .expect("lookup")
        .map(|t| t.host.0)
}

/// `storage` open writable with a cache of `cache_size` bytes, early
/// write-backs left to the caller if `background`.
fn open_writable(storage: &Arc<TestStorage>, cache_size: u64, background: bool) -> Chain {
    Chain::open(
        &fake_path(),
        &ChainOptions {
            writable: true,
            top_storage: Some(storage.clone() as Arc<dyn Storage>),
            cache_size,
            background_write_back: background,
            ..ChainOptions::default()
        },
    )
    .expect("open")
}

fn read(chain: &Chain, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    chain.read_at(&mut buf, offset).expect("read");
    buf
}

/// A discarded cluster is not handed out again while a transfer that
/// looked it up earlier still runs, even across flushes (which do not
/// wait for it, so a ticket holder may flush); once the transfer has
/// ended, the next flush makes it reusable.
#[test]
fn a_released_cluster_is_not_reused_while_an_earlier_transfer_runs() {
    let storage = image(16 * MIB, |_| {});
    let chain = open(&storage, true);
    chain.write_at(&vec![1; CLUSTER as usize], 0).unwrap();
    chain.flush().unwrap();
    let ticket = chain.transfers().begin();
    let old = chain
        .transfers()
        .in_place_target(&ticket, GuestOffset(0), 4096)
        .unwrap()
        .expect("own cluster")
        .host
        .0;
    chain.discard(0, CLUSTER).unwrap();
    chain.flush().unwrap();
    chain.flush().unwrap();
    // Enough allocations, with flushes between, to use up the spare
    // clusters prepared so far and have new ones made from the free ones.
    for c in 1..40 {
        chain
            .write_at(&vec![2; CLUSTER as usize], c * CLUSTER)
            .unwrap();
        assert_ne!(
            host_of(&chain, c * CLUSTER),
            Some(old),
            "a cluster still in use by a transfer was reallocated"
        );
        chain.flush().unwrap();
    }
    drop(ticket);
    chain.flush().unwrap();
    let reused = (40..250).find(|&c| {
        chain
            .write_at(&vec![3; CLUSTER as usize], c * CLUSTER)
            .unwrap();
        chain.flush().unwrap();
        host_of(&chain, c * CLUSTER) == Some(old)
    });
    assert!(
        reused.is_some(),
        "the released cluster was not reused once free"
    );
    assert_eq!(read(&chain, 5 * CLUSTER, 4096), vec![2; 4096]);
    chain.close().unwrap();
    assert_clean(&storage);
}

/// Eight writers hit the same unallocated clusters at once, each its own
/// 4 KiB of every cluster: every cluster is allocated once and holds all
/// eight pieces.
#[test]
fn writes_racing_for_one_cluster_allocate_it_once() {
    let storage = image(16 * MIB, |_| {});
    let chain = Arc::new(open(&storage, true));
    let clusters = 64u64;
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let chain = chain.clone();
            std::thread::spawn(move || {
                for c in 0..clusters {
                    let piece = vec![(t as u8 + 1) ^ (c as u8); 4096];
                    chain.write_at(&piece, c * CLUSTER + t * 8192).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for c in 0..clusters {
        let got = read(&chain, c * CLUSTER, CLUSTER as usize);
        for t in 0..8u64 {
            let at = (t * 8192) as usize;
            assert_eq!(
                got[at..at + 4096],
                vec![(t as u8 + 1) ^ (c as u8); 4096][..],
                "cluster {c}, writer {t}"
            );
            assert!(got[at + 4096..at + 8192].iter().all(|&b| b == 0));
        }
    }
    let chain = Arc::try_unwrap(chain).expect("threads done");
    chain.close().unwrap();
    let r = assert_clean(&storage);
    assert_eq!(r.allocated_clusters, clusters, "clusters allocated twice");
}

/// A second write to a cluster whose allocation is in flight waits for it
/// (and then goes in place) instead of allocating again; a flush meanwhile
/// does not wait for the allocation and leaves a consistent image.
#[test]
fn an_allocation_in_flight_is_waited_for_and_flushed_around() {
    let storage = image(16 * MIB, |_| {});
    let chain = Arc::new(open(&storage, true));
    chain.write_at(&[7; 512], 0).unwrap();
    chain.flush().unwrap();
    // New clusters (spares made after the first allocation) lie past the
    // first data cluster: hold their data writes.
    let first = host_of(&chain, 0).expect("an own cluster");
    storage.hold_writes(first + CLUSTER, u64::MAX);
    let first = {
        let chain = chain.clone();
        std::thread::spawn(move || chain.write_at(&[1; 4096], 3 * CLUSTER).unwrap())
    };
    storage.wait_held(1);
    let second = {
        let chain = chain.clone();
        std::thread::spawn(move || chain.write_at(&[2; 4096], 3 * CLUSTER + 8192).unwrap())
    };
    // The flush goes through while the allocation is held.
    chain.flush().unwrap();
    let on_disk: Arc<dyn Storage> = Arc::new(MemStorage::new(storage.bytes()));
    let r = check(on_disk);
    assert_eq!(
        r.corruptions, 0,
        "image inconsistent during an allocation: {:?}",
        r.messages
    );
    assert_eq!(storage.held(), 1, "the second write allocated too");
    storage.release();
    first.join().unwrap();
    second.join().unwrap();
    let got = read(&chain, 3 * CLUSTER, 16384);
    assert_eq!(got[..4096], [1; 4096]);
    assert_eq!(got[8192..12288], [2; 4096]);
    let chain = Arc::try_unwrap(chain).expect("threads done");
    chain.close().unwrap();
    let r = assert_clean(&storage);
    assert_eq!(r.allocated_clusters, 2);
}

/// A failed data write gives its cluster back (no leak) and the engine
/// goes on; a failed sync fails the flush and the next one writes it all.
#[test]
fn failed_writes_and_syncs_leak_nothing_and_are_retried() {
    let storage = image(16 * MIB, |_| {});
    let chain = open(&storage, true);
    storage.fail_writes.store(1, Ordering::SeqCst);
    assert!(chain.write_at(&[1; 4096], 2 * CLUSTER).is_err());
    chain.write_at(&[2; 4096], 4 * CLUSTER).unwrap();
    storage.fail_syncs.store(true, Ordering::SeqCst);
    assert!(chain.flush().is_err());
    storage.fail_syncs.store(false, Ordering::SeqCst);
    chain.flush().unwrap();
    assert_eq!(read(&chain, 2 * CLUSTER, 4096), vec![0; 4096]);
    assert_eq!(read(&chain, 4 * CLUSTER, 4096), vec![2; 4096]);
    chain.close().unwrap();
    let r = assert_clean(&storage);
    assert_eq!(r.allocated_clusters, 1);
    let chain = open(&storage, false);
    assert_eq!(read(&chain, 4 * CLUSTER, 4096), vec![2; 4096]);
}

/// With lazy refcounts, the refcount table moves as the image grows; its
/// old clusters are released only once the header names the new table
/// (they used to be reused while the header still named them).
#[test]
fn lazy_refcounts_never_reuse_the_table_the_header_names() {
    let storage = image(64 * MIB, |o| {
        o.cluster_size = 512;
        o.lazy_refcounts = true;
    });
    let chain = open(&storage, true);
    let chunk = vec![0x11u8; MIB as usize];
    for i in 0..12u64 {
        chain.write_at(&chunk, i * MIB).unwrap();
    }
    chain.flush().unwrap();
    let pattern = vec![0xabu8; 64 << 10];
    chain.write_at(&pattern, 40 * MIB).unwrap();
    chain.flush().unwrap();
    let mut header = [0u8; 56];
    storage.read_at(&mut header, 0).unwrap();
    let table = u64::from_be_bytes(header[48..56].try_into().unwrap());
    let mut first = [0u8; 512];
    storage.read_at(&mut first, table).unwrap();
    assert!(
        first.iter().any(|&b| b != 0xab) && first.iter().any(|&b| b != 0x11),
        "the refcount table the header names holds guest data"
    );
    // A crash now (nothing more written back): reopening repairs and
    // every flushed byte is there.
    chain.fail("simulated crash");
    drop(chain);
    let chain = open(&storage, true);
    assert_eq!(read(&chain, 40 * MIB, 64 << 10), pattern);
    assert_eq!(read(&chain, 3 * MIB, MIB as usize), chunk);
    chain.close().unwrap();
    assert_clean(&storage);
}

/// What a crash at any point of the log can leave: each sync is a crash
/// point; writes after it land or not at random. The image must have no
/// corruption for `check` (leaks allowed; lazy images are repaired when
/// opened), and every block not written since the last completed flush
/// must read back as the model says.
#[test]
fn crash_points_of_a_random_workload_are_consistent_and_keep_flushed_data() {
    for (seed, lazy) in [(1u64, false), (2, false), (3, true), (4, true)] {
        crash_points(seed, lazy);
    }
}

fn crash_points(seed: u64, lazy: bool) {
    const SIZE: u64 = 4 * MIB;
    const BLOCK: u64 = 4096;
    let mut rng = fastrand::Rng::with_seed(seed);
    let initial = image(SIZE, |o| o.lazy_refcounts = lazy);
    let start = initial.bytes();
    let chain = open(&initial, true);
    let mut model = vec![0u8; SIZE as usize];
    // (log length when the flush returned, model then, blocks written since)
    let mut flushed: Vec<(usize, Vec<u8>)> = vec![(0, model.clone())];
    let mut touched_after: Vec<Vec<bool>> = vec![vec![false; (SIZE / BLOCK) as usize]];
    for _ in 0..120 {
        let offset = rng.u64(0..SIZE / BLOCK) * BLOCK;
        let len = (rng.u64(1..=32) * BLOCK).min(SIZE - offset);
        let mark = |touched: &mut Vec<Vec<bool>>| {
            for b in offset / BLOCK..(offset + len) / BLOCK {
                touched.iter_mut().for_each(|t| t[b as usize] = true);
            }
        };
        match rng.u8(0..10) {
            0..=5 => {
                let fill = rng.u8(1..);
                chain.write_at(&vec![fill; len as usize], offset).unwrap();
                model[offset as usize..(offset + len) as usize].fill(fill);
                mark(&mut touched_after);
            }
            6 | 7 => {
                chain.discard(offset, len).unwrap();
                // Discard is advisory for partial clusters: unknown.
                mark(&mut touched_after);
                let (a, b) = (
                    offset.div_ceil(CLUSTER) * CLUSTER,
                    (offset + len) / CLUSTER * CLUSTER,
                );
                if a < b {
                    model[a as usize..b as usize].fill(0);
                }
            }
            _ => {
                chain.flush().unwrap();
                flushed.push((initial.log().len(), model.clone()));
                touched_after.push(vec![false; (SIZE / BLOCK) as usize]);
            }
        }
    }
    chain.flush().unwrap();
    drop(chain);
    let log = initial.log();
    let syncs: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, op)| matches!(op, Op::Sync))
        .map(|(i, _)| i + 1)
        .collect();
    for (n, &point) in syncs.iter().enumerate() {
        // Durable: everything up to this sync; after it, a random subset
        // of what the kernel may have written too.
        let mut disk = start.clone();
        for op in &log[..point] {
            apply(&mut disk, op);
        }
        let next_sync = syncs.get(n + 1).copied().unwrap_or(log.len());
        for op in &log[point..next_sync] {
            if rng.bool() {
                apply(&mut disk, op);
            }
        }
        let storage = TestStorage::new(disk);
        if !lazy {
            let r = check(storage.clone());
            assert_eq!(
                r.corruptions, 0,
                "seed {seed}, crash point {n}: {:?}",
                r.messages
            );
        }
        // Opening writable repairs a dirty (lazy) image.
        let chain = open(&storage, true);
        let (k, model_then) = flushed
            .iter()
            .enumerate()
            .rev()
            .find(|(_, (at, _))| *at <= point)
            .map(|(k, (_, m))| (k, m))
            .expect("the initial state");
        let touched = &touched_after[k];
        let got = read(&chain, 0, SIZE as usize);
        for (b, _) in touched.iter().enumerate().filter(|(_, t)| !**t) {
            let r = b * BLOCK as usize..(b + 1) * BLOCK as usize;
            assert!(
                got[r.clone()] == model_then[r],
                "seed {seed}, crash point {n}: block {b} lost its flushed data"
            );
        }
        chain.close().unwrap();
        let r = check(storage.clone());
        assert_eq!(r.corruptions, 0, "after reopening: {:?}", r.messages);
    }
}

/// Opening fails cleanly on garbage; nothing panics.
#[test]
fn garbage_is_refused_without_a_panic() {
    let storage = TestStorage::new(vec![0x5a; 4096]);
    let opened = Chain::open(
        &fake_path(),
        &ChainOptions {
            writable: true,
            top_storage: Some(storage as Arc<dyn Storage>),
            ..ChainOptions::default()
        },
    );
    assert!(opened.is_err());
}

fn be64(storage: &TestStorage, at: u64) -> u64 {
    let mut b = [0u8; 8];
    storage.read_at(&mut b, at).unwrap();
    u64::from_be_bytes(b)
}

/// The L2 entry of guest cluster 1 set to `entry` by a hostile hand.
fn hostile(entry: impl FnOnce(&TestStorage) -> u64) -> Arc<TestStorage> {
    let storage = image(16 * MIB, |_| {});
    let chain = open(&storage, true);
    chain.write_at(&vec![1; CLUSTER as usize], 0).unwrap();
    chain.close().unwrap();
    let l1 = be64(&storage, be64(&storage, 40));
    let l2 = l1 & 0x00ff_ffff_ffff_fe00;
    let e = entry(&storage);
    storage.write_at(&e.to_be_bytes(), l2 + 8).unwrap();
    storage
}

/// Mappings that point at the image's own metadata are corruption: the
/// engine never writes guest data there, never releases (and so never
/// reuses) such clusters, and refuses writes from then on, like QEMU's
/// overlap checks. The header, L1 table and refcount table survive.
#[test]
fn mappings_onto_metadata_never_overwrite_it() {
    let header_magic = 0x5146_49fb_u64;
    // A "compressed" cluster at host offset 0 (the header), released by a
    // full overwrite; a plain "own" cluster on the L1 table, the refcount
    // table and a refcount block, written in place. (A plain entry with
    // offset 0 means "unallocated", for QEMU too.)
    type Entry = Box<dyn Fn(&TestStorage) -> u64>;
    let cases: Vec<(&str, Entry)> = vec![
        ("compressed at 0", Box::new(|_| 1u64 << 62)),
        (
            "data on a refcount block",
            Box::new(|s| (1u64 << 63) | be64(s, be64(s, 48))),
        ),
        (
            "data on the L1 table",
            Box::new(|s| (1u64 << 63) | be64(s, 40)),
        ),
        (
            "data on the refcount table",
            Box::new(|s| (1u64 << 63) | be64(s, 48)),
        ),
    ];
    for (what, entry) in cases {
        let storage = hostile(entry);
        let l1_offset = be64(&storage, 40);
        let l1_before = be64(&storage, l1_offset);
        let reftable = be64(&storage, 48);
        let reftable_before = be64(&storage, reftable);
        let chain = open(&storage, true);
        let full = chain.write_at(&vec![0x77; CLUSTER as usize], CLUSTER);
        let partial = chain.write_at(&[0x66; 4096], CLUSTER);
        assert!(
            full.is_err() || partial.is_err(),
            "{what}: writes through a mapping onto metadata succeeded"
        );
        let _ = chain.flush();
        let _ = chain.write_at(&vec![0x99; CLUSTER as usize], 5 * CLUSTER);
        let _ = chain.flush();
        drop(chain);
        assert_eq!(
            be64(&storage, 0) >> 32,
            header_magic,
            "{what}: header overwritten"
        );
        assert_eq!(
            be64(&storage, l1_offset),
            l1_before,
            "{what}: L1 table overwritten"
        );
        assert_eq!(
            be64(&storage, reftable),
            reftable_before,
            "{what}: refcount table overwritten"
        );
        let chain = open(&storage, false);
        assert_eq!(read(&chain, 0, 4096), vec![1; 4096], "{what}");
    }
}

/// A new cluster is written sparsely (only its non-zero blocks); one that
/// reuses a freed cluster must not show the old cluster's bytes.
#[test]
fn a_reused_cluster_never_shows_old_bytes() {
    let storage = image(16 * MIB, |_| {});
    let chain = open(&storage, true);
    chain.write_at(&vec![0xff; CLUSTER as usize], 0).unwrap();
    chain.flush().unwrap();
    let old = host_of(&chain, 0);
    chain.discard(0, CLUSTER).unwrap();
    chain.flush().unwrap();
    // Allocations take spare clusters first; new spares are made from
    // free clusters, the freed one among them.
    let reused = (7..60)
        .find(|&c| {
            chain.write_at(&[0x42; 4096], c * CLUSTER + 8192).unwrap();
            chain.flush().unwrap();
            host_of(&chain, c * CLUSTER) == old
        })
        .expect("the freed cluster was reused");
    let got = read(&chain, reused * CLUSTER, CLUSTER as usize);
    assert_eq!(got[8192..12288], [0x42; 4096]);
    assert!(
        got[..8192].iter().chain(&got[12288..]).all(|&b| b == 0),
        "old bytes of a reused cluster show through"
    );
    // A fresh cluster written with 4 KiB: the file does not get the rest.
    let before = storage.log().len();
    chain.write_at(&[0x43; 4096], 61 * CLUSTER).unwrap();
    let written: usize = storage.log()[before..]
        .iter()
        .map(|op| match op {
            Op::Write { data, .. } => data.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(
        written, 4096,
        "a 4 KiB write into a fresh cluster wrote more"
    );
    chain.close().unwrap();
    assert_clean(&storage);
    let chain = open(&storage, false);
    assert_eq!(read(&chain, 61 * CLUSTER + 4096, 4096), vec![0; 4096]);
}

/// A publish writes the pages of metadata that changed, not whole
/// clusters (a whole 64 KiB refcount block per publish made every sync
/// write 16 pages more), and syncs only what a mapping depends on: an
/// allocating 4 KiB write onto a spare cluster, over zeros, costs its data
/// page and one page of its L2 table, with no sync at all (its count and
/// space were made durable with the spare); a write whose old view is not
/// zeros (here the top's own preallocated zero cluster, whose old bytes
/// stay on disk) costs one sync between its data and its mapping.
#[test]
fn a_publish_writes_only_the_changed_pages_and_syncs_only_what_depends_on_it() {
    let storage = image(64 * MIB, |_| {});
    let chain = open(&storage, true);
    // L2 table on disk, spares made.
    chain.write_at(&[1; 4096], 0).unwrap();
    chain.flush().unwrap();
    let writes = |log: &[Op]| -> Vec<(u64, usize)> {
        log.iter()
            .filter_map(|op| match op {
                Op::Write { offset, data } => Some((*offset, data.len())),
                _ => None,
            })
            .collect()
    };
    let syncs = |log: &[Op]| log.iter().filter(|op| matches!(op, Op::Sync)).count();
    let brief = |log: &[Op]| -> Vec<String> {
        log.iter()
            .map(|op| match op {
                Op::Write { offset, data } => format!("write {offset:#x}+{}", data.len()),
                Op::SetLen(n) => format!("set_len {n:#x}"),
                Op::Sync => "sync".into(),
            })
            .collect()
    };
    for round in 0..3u64 {
        let before = storage.log().len();
        let guest = (round + 5) * CLUSTER + 8192;
        chain.write_at(&[0x5a; 4096], guest).unwrap();
        chain.durability().publish().unwrap();
        let log = storage.log()[before..].to_vec();
        assert_eq!(syncs(&log), 0, "round {round}: a sync: {:?}", brief(&log));
        let w = writes(&log);
        assert_eq!(w.len(), 2, "round {round}: data, L2 page: {w:?}");
        assert!(
            w.iter().all(|(_, len)| *len == 4096),
            "round {round}: a write larger than a page: {w:?}"
        );
        let mut buf = vec![0; 4096];
        chain.read_at(&mut buf, guest).unwrap();
        assert_eq!(buf, vec![0x5a; 4096]);
    }
    // A cluster the top owns, made a zero cluster that keeps its space:
    // writing into it rewrites the whole cluster in place, whose old bytes
    // a power loss could expose if the mapping went first.
    chain
        .write_at(&[0x77; CLUSTER as usize], 20 * CLUSTER)
        .unwrap();
    chain.flush().unwrap();
    chain.write_zeroes(20 * CLUSTER, CLUSTER, false).unwrap();
    chain.flush().unwrap();
    let before = storage.log().len();
    chain.write_at(&[0x5b; 4096], 20 * CLUSTER).unwrap();
    chain.durability().publish().unwrap();
    let log = storage.log()[before..].to_vec();
    assert_eq!(syncs(&log), 1, "one sync: {:?}", brief(&log));
    let sync_at = log.iter().position(|op| matches!(op, Op::Sync)).unwrap();
    assert_eq!(
        writes(&log[sync_at..]).len(),
        1,
        "only the L2 page after the sync: {:?}",
        brief(&log)
    );
    assert_eq!(
        read(&chain, 20 * CLUSTER, CLUSTER as usize)[..8192],
        [[0x5b; 4096], [0; 4096]].concat()[..]
    );
    chain.close().unwrap();
    assert_clean(&storage);
}

/// With `background_write_back` (a server's), the writes that make the
/// tables under change outgrow their share of the cache leave their
/// write-back (and its syncs) to the caller, who is told once; only at
/// four times the share does a write write them back itself (memory stays
/// bounded). Without it, the write that finds them due writes them back.
#[test]
fn early_write_backs_are_left_to_the_caller_with_background_write_back() {
    // 512 MiB of guest per L2 table (64 KiB clusters); a 512 KiB cache
    // gives the tables under change half of it, 256 KiB: four tables.
    const REGION: u64 = 512 * MIB;
    let syncs = |log: &[Op]| log.iter().filter(|op| matches!(op, Op::Sync)).count();
    for background in [false, true] {
        let storage = image(64 * 1024 * MIB, |_| {});
        let chain = open_writable(&storage, MIB / 2, background);
        chain.write_at(&[1; 4096], 0).unwrap();
        chain.flush().unwrap();
        let before = storage.log().len();
        // Eight tables: twice the share.
        for r in 1..8u64 {
            chain.write_at(&[r as u8; 4096], r * REGION).unwrap();
        }
        let written = syncs(&storage.log()[before..]);
        if background {
            assert_eq!(written, 0, "a write synced: its write-back is the caller's");
            assert!(
                chain.durability().take_write_back_due(),
                "the caller is told"
            );
            assert!(!chain.durability().take_write_back_due(), "once");
            let before = storage.log().len();
            chain.durability().publish().unwrap();
            assert!(
                syncs(&storage.log()[before..]) > 0,
                "the caller's publish writes back"
            );
            // Far over the share (sixteen tables and more), the writes
            // write back themselves.
            let before = storage.log().len();
            for r in 8..40u64 {
                chain.write_at(&[r as u8; 4096], r * REGION).unwrap();
            }
            assert!(
                syncs(&storage.log()[before..]) > 0,
                "far over the share, no write wrote back"
            );
        } else {
            assert!(written > 0, "no write wrote back early");
            assert!(!chain.durability().take_write_back_due());
            for r in 8..40u64 {
                chain.write_at(&[r as u8; 4096], r * REGION).unwrap();
            }
        }
        for r in 1..40u64 {
            assert_eq!(
                read(&chain, r * REGION, 4096),
                vec![r as u8; 4096],
                "region {r}"
            );
        }
        chain.close().unwrap();
        assert_clean(&storage);
    }
}

/// A write-back takes the pages it writes: a change made while it runs
/// leaves only its own page for the next one (it used to leave the whole
/// table's changed pages, so that under a steady stream of writes every
/// flush rewrote every page changed since the table was loaded); a
/// write-back that fails puts back what it took, beside the change.
#[test]
fn a_write_back_leaves_only_the_pages_changed_meanwhile() {
    // One L2 table; each of its 4 KiB pages maps 32 MiB of the guest.
    const PAGE_SPAN: u64 = 32 * MIB;
    let storage = image(128 * MIB, |_| {});
    let chain = Arc::new(open(&storage, true));
    chain.write_at(&[1; 4096], 0).unwrap();
    chain.flush().unwrap();
    let l2 = be64(&storage, be64(&storage, 40)) & 0x00ff_ffff_ffff_fe00;
    let table_writes = |from: usize| -> Vec<(u64, usize)> {
        storage.log()[from..]
            .iter()
            .filter_map(|op| match op {
                Op::Write { offset, data } if (l2..l2 + CLUSTER).contains(offset) => {
                    Some((*offset - l2, data.len()))
                }
                _ => None,
            })
            .collect()
    };
    // Guest offsets in pages 0, 1 and 2 of the table, new in each round.
    let places = |fail: bool| {
        let k = CLUSTER * (1 + u64::from(fail));
        [k, PAGE_SPAN + k, 2 * PAGE_SPAN + k]
    };
    for fail in [false, true] {
        let round = u8::from(fail) * 10;
        let at = places(fail);
        // Pages 0 and 1 changed, taken by a write-back held on the table.
        chain.write_at(&[round + 1; 4096], at[0]).unwrap();
        chain.write_at(&[round + 2; 4096], at[1]).unwrap();
        storage.hold_writes(l2, l2 + CLUSTER);
        let publish = {
            let chain = chain.clone();
            std::thread::spawn(move || chain.durability().publish())
        };
        storage.wait_held(1);
        // Page 2 changes meanwhile.
        chain.write_at(&[round + 3; 4096], at[2]).unwrap();
        if fail {
            storage.fail_writes.store(1, Ordering::SeqCst);
        }
        storage.release();
        assert_eq!(publish.join().unwrap().is_err(), fail);
        let before = storage.log_len();
        chain.durability().publish().unwrap();
        let expected = if fail {
            vec![(0, 4096), (4096, 4096), (2 * 4096, 4096)]
        } else {
            vec![(2 * 4096, 4096)]
        };
        assert_eq!(table_writes(before), expected, "fail: {fail}");
    }
    let check_data = |chain: &Chain| {
        for fail in [false, true] {
            let round = u8::from(fail) * 10;
            for (i, at) in places(fail).into_iter().enumerate() {
                assert_eq!(read(chain, at, 4096), vec![round + 1 + i as u8; 4096]);
            }
        }
    };
    check_data(&chain);
    let chain = Arc::try_unwrap(chain).expect("threads done");
    chain.close().unwrap();
    assert_clean(&storage);
    check_data(&open(&storage, false));
}

/// With `background_write_back`, a caller is told once many table pages
/// (128) changed since the last write-back, well within the cache's
/// share, so that its flusher writes them back before a guest's flush
/// must; a few changes do not tell it, nor do many where nobody flushes
/// (a background write-back's sync would then gain nobody anything), and
/// without background write-back no write writes back on their account.
#[test]
fn many_changed_pages_are_left_to_the_caller_to_write_back() {
    const PAGE_SPAN: u64 = 32 * MIB;
    let syncs = |log: &[Op]| log.iter().filter(|op| matches!(op, Op::Sync)).count();
    for (background, flushed) in [(false, true), (true, false), (true, true)] {
        let storage = image(16 * 1024 * MIB, |_| {});
        let chain = open_writable(&storage, 256 * MIB, background);
        chain.write_at(&[1; 4096], 0).unwrap();
        if flushed {
            chain.flush().unwrap();
        }
        let before = storage.log_len();
        for i in 1..10u64 {
            chain.write_at(&[i as u8; 4096], i * PAGE_SPAN).unwrap();
        }
        assert!(
            !chain.durability().take_write_back_due(),
            "told after 9 pages"
        );
        for i in 10..300u64 {
            chain.write_at(&[i as u8; 4096], i * PAGE_SPAN).unwrap();
        }
        assert_eq!(syncs(&storage.log()[before..]), 0, "a write wrote back");
        assert_eq!(
            chain.durability().take_write_back_due(),
            background && flushed
        );
        assert!(!chain.durability().take_write_back_due(), "told twice");
        chain.durability().publish().unwrap();
        chain.write_at(&[7; 4096], 300 * PAGE_SPAN).unwrap();
        assert!(
            !chain.durability().take_write_back_due(),
            "told again after a publish"
        );
        for i in 1..=300u64 {
            let want = if i == 300 { 7 } else { i as u8 };
            assert_eq!(read(&chain, i * PAGE_SPAN, 4096), vec![want; 4096]);
        }
        chain.close().unwrap();
        assert_clean(&storage);
    }
}
