//! Concurrency: eight threads write and flush overlapping ranges of one
//! chain at once. Every 512-byte block must end up holding the data of a
//! write that no other write to it strictly followed, never a mix, and the
//! image must be clean for `qemu-img check`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{assert_same_as_qemu, qemu_img, qemu_io, s};
use sqcow2_format::{Chain, ChainOptions};

const BLOCK: u64 = 512;
const REGION: u64 = 1 << 20;

#[derive(Debug, Clone)]
struct Done {
    id: u64,
    offset: u64,
    len: u64,
    start: u64,
    end: u64,
}

fn block_pattern(id: u64) -> [u8; BLOCK as usize] {
    let mut b = [0u8; BLOCK as usize];
    for chunk in b.chunks_exact_mut(8) {
        chunk.copy_from_slice(&id.to_le_bytes());
    }
    b
}

fn run(opts: &str, seed: u64) {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "4M"]);
    qemu_io(
        &base,
        &[
            "write -P 0x61 0 512k".into(),
            "write -P 0x63 1M 2M".into(),
            "write -c -P 0x62 768k 256k".into(),
        ],
    );
    let top = tmp.path().join("top.qcow2");
    common::sqcow2(&[
        "create",
        "-o",
        opts,
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        s(&top),
    ]);
    let mut original = vec![0u8; REGION as usize];
    Chain::open(&top, &ChainOptions::default())
        .unwrap()
        .read_at(&mut original, 0)
        .unwrap();

    let chain = Arc::new(
        Chain::open(
            &top,
            &ChainOptions {
                writable: true,
                ..ChainOptions::default()
            },
        )
        .unwrap(),
    );
    let clock = Arc::new(AtomicU64::new(0));
    let ids = Arc::new(AtomicU64::new(1));
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let (chain, clock, ids) = (chain.clone(), clock.clone(), ids.clone());
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(seed * 100 + t);
                let mut done = Vec::new();
                for _ in 0..200 {
                    if rng.u8(0..8) == 0 {
                        chain.flush().unwrap();
                        continue;
                    }
                    let blocks = rng.u64(1..=32);
                    let offset = rng.u64(0..REGION / BLOCK - blocks) * BLOCK;
                    let id = ids.fetch_add(1, Ordering::SeqCst);
                    let data: Vec<u8> = (0..blocks).flat_map(|_| block_pattern(id)).collect();
                    let start = clock.fetch_add(1, Ordering::SeqCst);
                    chain.write_at(&data, offset).unwrap();
                    let end = clock.fetch_add(1, Ordering::SeqCst);
                    done.push(Done {
                        id,
                        offset,
                        len: blocks * BLOCK,
                        start,
                        end,
                    });
                }
                done
            })
        })
        .collect();
    let writes: Vec<Done> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("writer thread panicked"))
        .collect();

    let mut actual = vec![0u8; REGION as usize];
    chain.read_at(&mut actual, 0).unwrap();
    let chain = Arc::try_unwrap(chain).expect("threads are done");
    chain.close().unwrap();

    for b in 0..REGION / BLOCK {
        let at = (b * BLOCK) as usize;
        let got = &actual[at..at + BLOCK as usize];
        let covering: Vec<&Done> = writes
            .iter()
            .filter(|w| w.offset <= b * BLOCK && b * BLOCK < w.offset + w.len)
            .collect();
        if covering.is_empty() {
            assert_eq!(
                got,
                &original[at..at + BLOCK as usize],
                "{opts}: block {b} changed"
            );
            continue;
        }
        let id = u64::from_le_bytes(got[..8].try_into().unwrap());
        assert_eq!(
            got,
            block_pattern(id),
            "{opts}: block {b} is torn or foreign"
        );
        let winner = covering
            .iter()
            .find(|w| w.id == id)
            .unwrap_or_else(|| panic!("{opts}: block {b} holds id {id}, which did not write it"));
        let later = covering.iter().find(|w| w.start > winner.end);
        assert!(
            later.is_none(),
            "{opts}: block {b} holds write {id}, but write {:?} started after it completed",
            later
        );
    }
    let check = common::run_raw(std::process::Command::new("qemu-img").args(["check", s(&top)]));
    assert_eq!(
        check.status.code(),
        Some(0),
        "{opts}: {}",
        String::from_utf8_lossy(&check.stdout)
    );
    assert_same_as_qemu(&top);
}

#[test]
fn eight_writers_small_clusters() {
    run("cluster_size=4096", 1);
}

#[test]
fn eight_writers_64k_clusters() {
    run("cluster_size=65536", 2);
}

#[test]
fn eight_writers_extended_l2() {
    run("cluster_size=65536,extended_l2=on", 3);
}

#[test]
fn eight_writers_lazy_refcounts() {
    run("cluster_size=16384,lazy_refcounts=on", 4);
}
