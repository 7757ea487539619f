//! A panic in the middle of a metadata update (a bug) must not let the
//! engine carry on as if the metadata were whole: writes and flushes fail
//! until the image is reopened, reads go on, and what is on disk stays as
//! the last successful flush left it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use sqcow2_format::check::{check_storage, Repair};
use sqcow2_format::create::{image_bytes, CreateOptions};
use sqcow2_format::storage::{MemStorage, Storage};
use sqcow2_format::{Chain, ChainOptions, FaultPoint};

const CLUSTER: u64 = 65536;

fn open(storage: &Arc<MemStorage>, dir: &std::path::Path) -> Chain {
    Chain::open(
        &dir.join("top.qcow2"),
        &ChainOptions {
            writable: true,
            top_storage: Some(storage.clone() as Arc<dyn Storage>),
            ..ChainOptions::default()
        },
    )
    .expect("open")
}

/// A 16 MiB image in memory, open for writing, its first cluster written
/// and flushed.
fn flushed_image(dir: &std::path::Path) -> (Arc<MemStorage>, Chain) {
    let bytes = image_bytes(&CreateOptions {
        size: 16 << 20,
        ..CreateOptions::default()
    })
    .unwrap();
    let storage = Arc::new(MemStorage::new(bytes));
    let chain = open(&storage, dir);
    chain.write_at(&[0x11; CLUSTER as usize], 0).unwrap();
    chain.flush().unwrap();
    (storage, chain)
}

#[test]
fn a_panic_mid_update_fails_later_writes_and_keeps_the_disk_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, chain) = flushed_image(dir.path());
    // What the flush left: spare clusters counted but not used yet (leaks
    // until the image, marked dirty, is next opened for writing).
    let top = dir.path().join("top.qcow2");
    let flushed = check_storage(
        &top,
        Arc::new(MemStorage::new(storage.snapshot())),
        Repair::None,
    )
    .expect("check");
    assert_eq!(flushed.corruptions, 0, "{:?}", flushed.messages);
    // An allocating write that panics between queuing the old mapping's
    // release and setting the new mapping (the cluster it allocated is
    // referenced by nothing yet).
    chain.arm_fault(FaultPoint::MidMetadataUpdate, 1);
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let _ = chain.write_at(&[0x22; 4096], 3 * CLUSTER);
    }));
    assert!(panicked.is_err(), "the armed fault did not fire");

    // Writes and flushes fail now, with an error that says why.
    let write = chain.write_at(&[0x33; 4096], 5 * CLUSTER);
    assert!(write.is_err(), "a write succeeded after a panic mid-update");
    let msg = write.unwrap_err().to_string();
    assert!(msg.contains("reopen"), "unclear error: {msg}");
    assert!(
        chain.flush().is_err(),
        "a flush succeeded after a panic mid-update"
    );
    assert!(chain.discard(0, CLUSTER).is_err(), "a discard succeeded");
    // Reads go on.
    let mut buf = vec![0u8; 4096];
    chain.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, vec![0x11; 4096]);
    drop(chain);

    // On disk: what the last flush left, consistent, and nothing from the
    // half-updated metadata (not one more leaked cluster).
    let report = check_storage(&top, storage.clone(), Repair::None).expect("check");
    assert_eq!(report.corruptions, 0, "{:?}", report.messages);
    assert_eq!(
        (report.leaks, report.allocated_clusters),
        (flushed.leaks, flushed.allocated_clusters),
        "metadata written after the panic: {:?}",
        report.messages
    );
    // Reopened for writing, the dirty image is repaired: no leak left.
    open(&storage, dir.path()).close().unwrap();
    let report = check_storage(&top, storage.clone(), Repair::None).expect("check");
    assert_eq!(
        (report.corruptions, report.leaks),
        (0, 0),
        "{:?}",
        report.messages
    );
    let chain = open(&storage, dir.path());
    let mut buf = vec![0u8; CLUSTER as usize];
    chain.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, vec![0x11; CLUSTER as usize]);
    chain.read_at(&mut buf, 3 * CLUSTER).unwrap();
    assert_eq!(buf, vec![0; CLUSTER as usize]);
}

/// A panic after an allocating write set its mapping and before its
/// change was journaled: the engine fails (the change is neither
/// journaled nor counted for a publish), and a later write into the same
/// cluster gets that error instead of waiting forever for the claim.
#[test]
fn a_panic_before_the_journal_record_fails_the_engine_and_ends_the_claim() {
    let dir = tempfile::tempdir().unwrap();
    let (_storage, chain) = flushed_image(dir.path());
    chain.arm_fault(FaultPoint::BeforeJournalRecord, 1);
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let _ = chain.write_at(&[0x22; 4096], 3 * CLUSTER);
    }));
    assert!(panicked.is_err(), "the armed fault did not fire");
    // Same cluster: an error, not a wait for a claim nobody will end (on
    // a thread of its own, left behind if it hangs).
    let chain: &'static Chain = Box::leak(Box::new(chain));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(chain.write_at(&[0x33; 4096], 3 * CLUSTER + 4096));
    });
    let write = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("a write into the cluster waited for the claim");
    let msg = write
        .expect_err("a write succeeded after the panic")
        .to_string();
    assert!(msg.contains("reopen"), "unclear error: {msg}");
}
