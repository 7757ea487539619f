//! A write into a cluster whose allocation has just set its mapping must
//! not complete before that mapping is journaled: a process death would
//! then lose the completed write with the mapping (real files, real page
//! cache; the death is simulated by keeping the files as they were when
//! the write completed).

use std::path::Path;

use sqcow2_format::create::{create, CreateOptions};
use sqcow2_format::{Chain, ChainOptions, FaultPoint, Locking};

const KIB4: usize = 4096;
const AT: u64 = 1 << 20;

fn writer() -> ChainOptions {
    ChainOptions {
        writable: true,
        // The "dead" writer keeps its descriptors.
        locking: Locking::Off,
        ..ChainOptions::default()
    }
}

fn files(dir: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    ["top.qcow2", "top.qcow2.sqjournal"]
        .iter()
        .map(|n| {
            let p = dir.join(n);
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}

/// Returns once the allocation has set its mapping and stalls before its
/// journal record.
fn wait_for_the_stall(chain: &Chain) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !chain.stalling_at(FaultPoint::BeforeJournalRecord) {
        assert!(
            std::time::Instant::now() < deadline,
            "the allocation never reached its journal record"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// A 16 MiB image open for writing with a journal, its tables made and
/// flushed.
fn journaled_image() -> (tempfile::TempDir, std::path::PathBuf, Chain) {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top.qcow2");
    create(
        &top,
        &CreateOptions {
            size: 16 << 20,
            ..CreateOptions::default()
        },
    )
    .unwrap();
    let chain = Chain::open(&top, &writer()).unwrap();
    assert!(chain.durability().journaled(), "no journal");
    // The tables exist and spares are made.
    chain.write_at(&[0x11; KIB4], 0).unwrap();
    chain.flush().unwrap();
    (dir, top, chain)
}

#[test]
fn a_write_into_a_new_cluster_completes_only_once_its_mapping_is_journaled() {
    let (dir, top, chain) = journaled_image();

    // The allocation of the cluster at AT stalls after setting its
    // mapping, before its journal record; a write into the same cluster
    // starts meanwhile.
    chain.stall_at(FaultPoint::BeforeJournalRecord, 400);
    let left = std::thread::scope(|s| {
        let allocating = s.spawn(|| chain.write_at(&[0xaa; KIB4], AT).unwrap());
        wait_for_the_stall(&chain);
        chain.write_at(&[0xbb; KIB4], AT + KIB4 as u64).unwrap();
        // The process dies as this write completes: its files as they are.
        let left = files(dir.path());
        allocating.join().unwrap();
        left
    });
    std::mem::forget(chain);

    for (path, bytes) in left {
        std::fs::write(path, bytes).unwrap();
    }
    let chain = Chain::open(&top, &writer()).unwrap();
    let mut got = vec![0u8; KIB4];
    chain.read_at(&mut got, AT + KIB4 as u64).unwrap();
    assert!(
        got.iter().all(|b| *b == 0xbb),
        "a completed write was lost with its cluster's mapping (reads {:#x})",
        got[0]
    );
    chain.close().unwrap();
}

/// Where the transfer path (the daemon's io_uring writes) may write in
/// place: not into a new cluster whose change is not journaled yet, and
/// once it is, there at once (no write-back needed first).
#[test]
fn a_new_cluster_goes_in_place_once_journaled_not_before() {
    use sqcow2_format::GuestOffset;
    let (_dir, _top, chain) = journaled_image();
    let in_place = |chain: &Chain| {
        let ticket = chain.transfers().begin();
        chain
            .transfers()
            .in_place_target(&ticket, GuestOffset(AT + KIB4 as u64), KIB4 as u64)
            .unwrap()
            .is_some()
    };
    chain.stall_at(FaultPoint::BeforeJournalRecord, 300);
    std::thread::scope(|s| {
        let allocating = s.spawn(|| chain.write_at(&[0xaa; KIB4], AT).unwrap());
        wait_for_the_stall(&chain);
        assert!(
            !in_place(&chain),
            "in place into a cluster whose mapping is not journaled yet"
        );
        allocating.join().unwrap();
    });
    assert!(
        chain.durability().journaled() && !chain.durability().needs_publish(),
        "the change was not journaled"
    );
    assert!(
        in_place(&chain),
        "a journaled mapping still waits for a write-back before going in place"
    );
    chain.close().unwrap();
}
