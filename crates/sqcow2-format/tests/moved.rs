//! Allocating writes whose data the caller moves
//! (`Chain::try_allocating_write`), as a queue worker does through its
//! io_uring: the test moves the bytes itself with plain reads and writes
//! of the files it is given. The chain reads what was written once the
//! claim is linked, what lay below if the claim is dropped; the image
//! checks clean and reads the same after a reopen.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use sqcow2_format::check::{check_storage, Repair};
use sqcow2_format::create::{create, CreateOptions};
use sqcow2_format::direct::CacheMode;
use sqcow2_format::storage::FileStorage;
use sqcow2_format::{indexing, AllocatingWrite, Chain, ChainOptions, GuestOffset};

const MIB: u64 = 1 << 20;
const CLUSTER: u64 = 64 << 10;

fn options(cache: CacheMode) -> ChainOptions {
    ChainOptions {
        writable: true,
        background_write_back: true,
        cache,
        ..ChainOptions::default()
    }
}

fn read(chain: &Chain, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    chain.read_at(&mut buf, offset).expect("read");
    buf
}

/// A base of 16 MiB with 0x11 in clusters 0..8, and an empty top over it.
fn chain_of_two(dir: &Path) -> std::path::PathBuf {
    let base = dir.join("base.qcow2");
    let top = dir.join("top.qcow2");
    create(
        &base,
        &CreateOptions {
            size: 16 * MIB,
            ..CreateOptions::default()
        },
    )
    .unwrap();
    let chain = Chain::open(&base, &options(CacheMode::WriteBack)).unwrap();
    chain
        .write_at(&vec![0x11; 8 * CLUSTER as usize], 0)
        .unwrap();
    indexing::snapshot_over(&chain, &base, &top, None).expect("top");
    chain.close().unwrap();
    top
}

/// Moves `data` into the claimed cluster as a worker would: the reads
/// from below into a cluster buffer around the guest's bytes, then one
/// write of the cluster; or the guest's bytes alone over zeros.
fn move_data(write: &AllocatingWrite, data: &[u8]) {
    match &write.copy {
        None => write.file.file.write_all_at(data, write.host.0).unwrap(),
        Some(copy) => {
            let mut buf = vec![0u8; copy.cluster_size as usize];
            let at = copy.guest_at as usize;
            buf[at..at + data.len()].copy_from_slice(data);
            for r in &copy.reads {
                let part = &mut buf[r.at as usize..(r.at + r.len) as usize];
                r.file.file.read_exact_at(part, r.host.0).unwrap();
            }
            write.file.file.write_all_at(&buf, copy.cluster.0).unwrap();
        }
    }
}

fn assert_checks_clean(path: &Path) {
    let storage = Arc::new(FileStorage::open_read_only(path).unwrap());
    let report = check_storage(path, storage, Repair::None).unwrap();
    assert_eq!(
        (report.corruptions, report.leaks, report.check_errors),
        (0, 0, 0),
        "{:?}",
        report.messages
    );
}

#[test]
fn a_moved_allocation_reads_as_written_once_linked_and_as_below_if_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let top = chain_of_two(dir.path());
    let chain = Arc::new(Chain::open(&top, &options(CacheMode::None)).unwrap());
    // A first allocating write through the chain: the spares are made.
    chain.write_at(&[0x22; 4096], 12 * CLUSTER).unwrap();
    // (The files the writes name are dropped with them, before the close.)
    {
        let ticket = chain.transfers().begin();

        // Over data below: a copy-on-write around the guest's bytes.
        let cow = chain
            .try_allocating_write(&ticket, GuestOffset(CLUSTER + 8192), 4096)
            .unwrap()
            .expect("a spare claimed from memory over data below");
        let copy = cow.copy.as_ref().expect("a copy-on-write");
        let spans: Vec<(u64, u64)> = copy.reads.iter().map(|r| (r.at, r.len)).collect();
        assert_eq!(spans, [(0, 8192), (12288, CLUSTER - 12288)]);
        // Claimed: another write of the cluster is not set up meanwhile.
        assert!(chain
            .try_allocating_write(&ticket, GuestOffset(CLUSTER), 4096)
            .unwrap()
            .is_none());
        move_data(&cow, &[0x33; 4096]);
        let linked = cow.claim.link().unwrap();
        let _ = linked.refill_spares;

        // Over a hole: the guest's bytes only.
        let fresh = chain
            .try_allocating_write(&ticket, GuestOffset(9 * CLUSTER + 4096), 4096)
            .unwrap()
            .expect("a spare claimed from memory over a hole");
        assert!(fresh.copy.is_none());
        move_data(&fresh, &[0x44; 4096]);
        let _ = fresh.claim.link().unwrap();

        // Dropped before its data moved: given back, the cluster reads as
        // below and takes a write through the chain.
        let dropped = chain
            .try_allocating_write(&ticket, GuestOffset(2 * CLUSTER), 4096)
            .unwrap()
            .expect("a third spare");
        drop(dropped);
        assert_eq!(read(&chain, 2 * CLUSTER, 4096), vec![0x11; 4096]);
        chain.write_at(&[0x55; 512], 2 * CLUSTER + 512).unwrap();
    }

    let expect = |chain: &Chain| {
        let mut cluster1 = vec![0x11; CLUSTER as usize];
        cluster1[8192..12288].fill(0x33);
        assert_eq!(read(chain, CLUSTER, CLUSTER as usize), cluster1);
        let mut cluster9 = vec![0; CLUSTER as usize];
        cluster9[4096..8192].fill(0x44);
        assert_eq!(read(chain, 9 * CLUSTER, CLUSTER as usize), cluster9);
        let mut cluster2 = vec![0x11; 4096];
        cluster2[512..1024].fill(0x55);
        assert_eq!(read(chain, 2 * CLUSTER, 4096), cluster2);
    };
    expect(&chain);
    Arc::into_inner(chain)
        .expect("the only chain")
        .close()
        .unwrap();
    assert_checks_clean(&top);
    let chain = Chain::open(&top, &options(CacheMode::WriteBack)).unwrap();
    expect(&chain);
}

/// Without `O_DIRECT` descriptions (cache=writeback) data below is left
/// to the engine, whose copy-on-write reads avoid read-ahead; a write
/// over a hole is still moved.
#[test]
fn with_the_page_cache_only_writes_over_holes_are_moved() {
    let dir = tempfile::tempdir().unwrap();
    let top = chain_of_two(dir.path());
    let chain = Arc::new(Chain::open(&top, &options(CacheMode::WriteBack)).unwrap());
    chain.write_at(&[0x22; 4096], 12 * CLUSTER).unwrap();
    let ticket = chain.transfers().begin();
    assert!(chain
        .try_allocating_write(&ticket, GuestOffset(CLUSTER), 4096)
        .unwrap()
        .is_none());
    let fresh = chain
        .try_allocating_write(&ticket, GuestOffset(9 * CLUSTER), 4096)
        .unwrap()
        .expect("over a hole");
    move_data(&fresh, &[0x66; 4096]);
    let _ = fresh.claim.link().unwrap();
    assert_eq!(read(&chain, 9 * CLUSTER, 4096), vec![0x66; 4096]);
}
