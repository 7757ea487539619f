//! The chain that follows a live snapshot (`Handover::successor`) reads the
//! old top through the unified cache it shares with the chain before: a
//! slice of the old top that the cache holds must be what the file holds.

use std::path::Path;

use sqcow2_format::check::{check_storage, Repair};
use sqcow2_format::create::{create, CreateOptions};
use sqcow2_format::reshape::{prepare_merge, LayerRef};
use sqcow2_format::storage::FileStorage;
use sqcow2_format::{indexing, Chain, ChainOptions, FaultPoint};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const CLUSTER: u64 = 64 << 10;
/// The autoclear bit of an image whose writer keeps a mapping journal.
const AUTOCLEAR_JOURNAL: u64 = 1 << 62;

fn options(writable: bool) -> ChainOptions {
    ChainOptions {
        writable,
        slice_size: 4096,
        use_index: false,
        ..ChainOptions::default()
    }
}

fn read(chain: &Chain, offset: u64) -> Vec<u8> {
    let mut buf = vec![0u8; 4096];
    chain.read_at(&mut buf, offset).expect("read");
    buf
}

/// A new empty image of `size` bytes at `path` (64 KiB clusters).
fn new_image(path: &Path, size: u64) {
    create(
        path,
        &CreateOptions {
            size,
            ..CreateOptions::default()
        },
    )
    .unwrap();
}

/// A live snapshot's steps, as the daemon takes them.
fn successor(chain: &Chain, top: &Path, new: &Path) -> Chain {
    successor_with(chain, top, new, &options(true))
}

fn successor_with(chain: &Chain, top: &Path, new: &Path, opts: &ChainOptions) -> Chain {
    let created = indexing::snapshot_over(chain, top, new, None).expect("new top");
    let prepared = chain
        .handover()
        .prepare_successor(&created, opts)
        .expect("prepare");
    // Before the pause (the daemon repeats this until it is short).
    chain.durability().sync_data().expect("sync");
    chain.durability().publish().expect("publish");
    // The pause: the switch alone (the next chain reads what the old top
    // did not write back from its writer).
    let next = chain
        .handover()
        .successor(prepared, opts)
        .expect("successor");
    chain.handover().retire(&next).expect("retire");
    chain.handover().tables();
    next
}

/// `qemu-img check`'s findings on `path`, by this crate's check: none.
fn assert_checks_clean(path: &Path, what: &str) {
    let storage = std::sync::Arc::new(FileStorage::open_read_only(path).unwrap());
    let report = check_storage(path, storage, Repair::None).unwrap();
    assert_eq!(
        (report.corruptions, report.leaks, report.check_errors),
        (0, 0, 0),
        "{what}: {:?}",
        report.messages
    );
}

fn journal_of(p: &Path) -> std::path::PathBuf {
    let mut name = p.file_name().unwrap().to_os_string();
    name.push(".sqjournal");
    p.with_file_name(name)
}

/// The old top closed after the switch (`Handover::retire`, once the guest
/// runs again): it is clean (no journal, no spare cluster left as a leak,
/// no dirty bit), and an index the next chain builds afterwards is valid
/// when the chain is opened again: it records the old top as the close
/// left it, not as it was at the switch.
#[test]
fn the_old_top_closed_after_the_switch_is_clean_and_indexed_as_it_stays() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top.qcow2");
    new_image(&top, GIB);
    let indexed = ChainOptions {
        use_index: true,
        ..options(true)
    };
    let chain = Chain::open(&top, &indexed).unwrap();
    for i in 0..64u64 {
        chain
            .write_at(&[i as u8 + 1; 4096], i * 3 * CLUSTER)
            .unwrap();
    }
    let next_path = dir.path().join("next.qcow2");
    let next = successor_with(&chain, &top, &next_path, &indexed);
    assert!(!journal_of(&top).exists(), "the old top's journal is left");
    assert!(
        chain.write_at(&[0xFF; 4096], 0).is_err(),
        "the chain before the snapshot still writes its old top"
    );
    assert_checks_clean(&top, "old top after its close");
    let header = sqcow2_format::Header::read(&FileStorage::open_read_only(&top).unwrap()).unwrap();
    assert!(!header.is_dirty(), "the old top is left dirty");
    let built = indexing::build_index(&next, sqcow2_format::Locking::Off, &mut |_, _| {}, &|| {
        false
    })
    .unwrap();
    assert!(built.is_some(), "no index built");
    // Marked as indexed by the build, with the autoclear bits its close
    // left: not its journal's again (the next read-write open would take
    // the image for one a writer left open, and repair it).
    let autoclear = sqcow2_format::Header::read(&FileStorage::open_read_only(&top).unwrap())
        .unwrap()
        .features
        .autoclear;
    assert_ne!(autoclear & sqcow2_format::index::AUTOCLEAR_SQCOW2, 0);
    assert_eq!(
        autoclear & AUTOCLEAR_JOURNAL,
        0,
        "the index build wrote the old top's journal bit back"
    );
    drop(chain);
    next.close().unwrap();
    let reopened = Chain::open(&next_path, &indexed).unwrap();
    assert!(
        reopened.index().is_used(),
        "the index built after the close is not valid at the next open: {:?}",
        reopened.index().state()
    );
    for i in 0..64u64 {
        assert!(read(&reopened, i * 3 * CLUSTER) == vec![i as u8 + 1; 4096]);
    }
}

/// An L2 table whose slice the cache took from the file, then loaded for
/// writing and changed, and not among the tables handed over last: the
/// next chain must not take the cache's older copy of it.
#[test]
fn the_next_chain_sees_a_table_changed_after_the_cache_took_it() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top.qcow2");
    new_image(&top, 16 * GIB);
    // Table A (the first 512 MiB) in the file.
    let chain = Chain::open(&top, &options(true)).unwrap();
    chain.write_at(&[0xA1; 4096], 0).unwrap();
    chain.close().unwrap();

    let chain = Chain::open(&top, &options(true)).unwrap();
    // A read takes A's first slice into the cache.
    assert!(read(&chain, 0) == vec![0xA1; 4096]);
    // A write maps a new cluster in A (loaded for writing, changed)...
    chain.write_at(&[0xA2; 4096], CLUSTER).unwrap();
    assert!(read(&chain, CLUSTER) == vec![0xA2; 4096]);
    // ...then the tables of 24 other regions are used after it: more
    // than a successor hands over (1 MiB of tables, 16 here).
    for region in 1..25u64 {
        chain.write_at(&[0xB0; 4096], region * 512 * MIB).unwrap();
    }

    let next = successor(&chain, &top, &dir.path().join("next.qcow2"));
    assert!(read(&next, 0) == vec![0xA1; 4096]);
    assert!(
        read(&next, CLUSTER) == vec![0xA2; 4096],
        "the next chain read an older copy of the old top's table"
    );
    for region in 1..25u64 {
        assert!(read(&next, region * 512 * MIB) == vec![0xB0; 4096]);
    }
}

/// A new top prepared while the guest runs is taken for writing ahead:
/// its journal started and spare clusters made (both cost syncs, which
/// stay out of the pause); the next chain takes it as it is. A
/// preparation dropped unused leaves the new top clean, its journal gone.
#[test]
fn a_prepared_top_is_ready_for_writes_or_left_clean() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top.qcow2");
    new_image(&top, GIB);
    let len = |p: &Path| std::fs::metadata(p).unwrap().len();
    let chain = Chain::open(&top, &options(true)).unwrap();
    chain.write_at(&[0xC1; 4096], 0).unwrap();

    let unused = dir.path().join("unused.qcow2");
    let created = indexing::snapshot_over(&chain, &top, &unused, None).unwrap();
    let created_len = len(&unused);
    let prepared = chain
        .handover()
        .prepare_successor(&created, &options(true))
        .unwrap();
    assert!(journal_of(&unused).exists(), "journal made ahead");
    assert!(len(&unused) > created_len, "no spare clusters made ahead");
    drop(prepared);
    assert!(!journal_of(&unused).exists(), "journal left behind");
    assert_eq!(len(&unused), created_len, "spare clusters left behind");
    assert_checks_clean(&unused, "unused new top");

    let next_path = dir.path().join("next.qcow2");
    let next = successor(&chain, &top, &next_path);
    assert!(journal_of(&next_path).exists());
    // The next chain journals its writes from the first one on.
    next.write_at(&[0xC2; 4096], 2 * CLUSTER).unwrap();
    assert!(
        next.durability().journaled(),
        "the next chain writes without its journal"
    );
    assert!(read(&next, 0) == vec![0xC1; 4096]);
    assert!(read(&next, 2 * CLUSTER) == vec![0xC2; 4096]);
    next.close().unwrap();
    assert!(
        !journal_of(&next_path).exists(),
        "a clean close ends the journal"
    );
}

/// A file that remembers whether it was written since its last sync, and
/// refuses writes (`EIO`, as a failing disk) while told to.
#[derive(Debug)]
struct SyncWatch {
    file: FileStorage,
    unsynced: std::sync::atomic::AtomicBool,
    failing: std::sync::atomic::AtomicBool,
}

impl SyncWatch {
    fn new(path: &Path) -> std::sync::Arc<Self> {
        std::sync::Arc::new(SyncWatch {
            file: FileStorage::open_read_write(path).unwrap(),
            unsynced: Default::default(),
            failing: Default::default(),
        })
    }
    fn fail_writes(&self, failing: bool) {
        self.failing
            .store(failing, std::sync::atomic::Ordering::SeqCst);
    }
    fn unsynced(&self) -> bool {
        self.unsynced.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn wrote(&self) {
        self.unsynced
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl sqcow2_format::storage::Storage for SyncWatch {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.file.read_at(buf, offset)
    }
    fn len(&self) -> std::io::Result<u64> {
        self.file.len()
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.wrote();
        self.file.write_at(buf, offset)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.wrote();
        self.file.set_len(len)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.file.sync()?;
        self.unsynced
            .store(false, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn reserve(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.wrote();
        self.file.reserve(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.wrote();
        self.file.write_zeroes(offset, len)
    }
    fn lock(
        &self,
        want: sqcow2_format::LockRequest,
        mode: sqcow2_format::Locking,
    ) -> Result<(), sqcow2_format::ErrorKind> {
        self.file.lock(want, mode)
    }
    fn file_id(&self) -> Option<(u64, u64)> {
        self.file.file_id()
    }
    fn is_writable(&self) -> bool {
        self.file.is_writable()
    }
}

/// A new 1 GiB image `top.qcow2` in `dir`, opened for writing through a
/// [`SyncWatch`].
fn watched_top(dir: &Path) -> (std::path::PathBuf, std::sync::Arc<SyncWatch>, Chain) {
    let top = dir.join("top.qcow2");
    new_image(&top, GIB);
    let watch = SyncWatch::new(&top);
    let opts = ChainOptions {
        top_storage: Some(watch.clone()),
        ..options(true)
    };
    let chain = Chain::open(&top, &opts).unwrap();
    (top, watch, chain)
}

/// What the file `path` alone maps at `offset` (4 KiB), read by another
/// opener as QEMU's `-U` would (no lock, the writer still has it open).
fn read_file_alone(path: &Path, offset: u64) -> Vec<u8> {
    let opened = Chain::open(
        path,
        &ChainOptions {
            force_share: true,
            locking: sqcow2_format::Locking::Off,
            ..options(false)
        },
    )
    .expect("open the file alone");
    read(&opened, offset)
}

/// Inside the pause nothing is written: the next chain reads the old
/// top's tables that are not in its file yet from the old top's writer.
/// A guest flush after the switch, before the old top's close, must
/// still make them durable: the next chain's flush writes them back and
/// syncs the old top too, until `retire` has closed it.
#[test]
fn a_flush_after_the_switch_makes_the_old_tops_last_writes_durable() {
    let dir = tempfile::tempdir().unwrap();
    let (top, watch, chain) = watched_top(dir.path());
    chain.write_at(&[0xD1; 4096], 0).unwrap();
    let new = dir.path().join("next.qcow2");
    let created = indexing::snapshot_over(&chain, &top, &new, None).unwrap();
    let prepared = chain
        .handover()
        .prepare_successor(&created, &options(true))
        .unwrap();
    chain.flush().unwrap();
    // Written after the last flush before the pause, not written back
    // (one in a second L2 table: a new L1 entry too).
    let places: Vec<u64> = (1..8u64)
        .map(|i| i * 7 * CLUSTER)
        .chain([700 * MIB])
        .collect();
    for &at in &places {
        chain.write_at(&[0xD2; 4096], at).unwrap();
    }
    let next = chain
        .handover()
        .successor(prepared, &options(true))
        .unwrap();
    for &at in &places {
        assert!(
            read_file_alone(&top, at) != vec![0xD2; 4096],
            "the old top's file has its last mappings (this test would show nothing)"
        );
        assert!(
            read(&next, at) == vec![0xD2; 4096],
            "the next chain misses a write the old top completed before the switch"
        );
    }
    next.write_at(&[0xD3; 4096], 3 * CLUSTER).unwrap();
    next.flush().unwrap();
    assert!(
        !watch.unsynced(),
        "a flush after the switch left the old top's last writes not durable"
    );
    for &at in &places {
        assert!(
            read_file_alone(&top, at) == vec![0xD2; 4096],
            "a flush after the switch did not write the old top's last tables back"
        );
    }
    // A merge copies the layers from their files: refused while the old
    // top's writer may hold tables its file lacks, taken after the close.
    let merged = dir.path().join("merged.qcow2");
    let (first, last) = (LayerRef::Position(0), LayerRef::Position(0));
    assert!(
        prepare_merge(&next, &first, &last, &merged, None).is_err(),
        "a merge took an old top that is not closed"
    );
    chain.handover().retire(&next).unwrap();
    drop(prepare_merge(&next, &first, &last, &merged, None).expect("merge after the close"));
    for i in 1..8u64 {
        assert!(read(&next, i * 7 * CLUSTER) == vec![0xD2; 4096]);
    }
    next.close().unwrap();
}

/// An old top whose close after the switch failed (or never ran) stays
/// synced by every flush, through later snapshots too: here a second
/// snapshot comes before any flush, and a flush of the third chain must
/// still make the first top's last writes durable.
#[test]
fn an_old_top_not_closed_stays_synced_through_later_snapshots() {
    let dir = tempfile::tempdir().unwrap();
    let (top, watch, first) = watched_top(dir.path());
    first.write_at(&[0xE1; 4096], 0).unwrap();
    // The first snapshot, its old top never closed (a retire that failed).
    let second_path = dir.path().join("second.qcow2");
    let created = indexing::snapshot_over(&first, &top, &second_path, None).unwrap();
    let prepared = first
        .handover()
        .prepare_successor(&created, &options(true))
        .unwrap();
    let second = first
        .handover()
        .successor(prepared, &options(true))
        .unwrap();
    assert!(
        first.write_at(&[0xE0; 4096], 0).is_err(),
        "the old top took a write after the switch"
    );
    assert!(
        watch.unsynced(),
        "the first top was synced (nothing to show)"
    );
    // The second snapshot, before any flush, closed as it should be.
    let third_path = dir.path().join("third.qcow2");
    second.write_at(&[0xE2; 4096], CLUSTER).unwrap();
    let third = successor(&second, &second_path, &third_path);
    assert!(watch.unsynced());
    third.flush().unwrap();
    assert!(
        !watch.unsynced(),
        "a flush two snapshots later left the first top's last writes not durable"
    );
    assert!(read(&third, 0) == vec![0xE1; 4096]);
    assert!(read(&third, CLUSTER) == vec![0xE2; 4096]);
    assert!(
        read_file_alone(&top, 0) == vec![0xE1; 4096],
        "a flush two snapshots later did not write the first top's tables back"
    );
    drop(second);
    third.close().unwrap();
    drop(first);
}

/// An engine that failed (here a panic in the middle of a metadata
/// update) may hold inconsistent tables: no next chain reads them.
#[test]
fn no_successor_reads_the_tables_of_a_failed_engine() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top.qcow2");
    new_image(&top, GIB);
    let chain = Chain::open(&top, &options(true)).unwrap();
    chain.write_at(&[0xF1; 4096], 0).unwrap();
    let new = dir.path().join("next.qcow2");
    let created = indexing::snapshot_over(&chain, &top, &new, None).unwrap();
    let prepared = chain
        .handover()
        .prepare_successor(&created, &options(true))
        .unwrap();
    chain.arm_fault(FaultPoint::MidMetadataUpdate, 1);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = chain.write_at(&[0xF2; 4096], 3 * CLUSTER);
    }));
    assert!(panicked.is_err(), "the armed fault did not fire");
    let next = chain.handover().successor(prepared, &options(true));
    assert!(next.is_err(), "a successor reads a failed engine's tables");
}

/// A change made on the old chain just before the switch that needs a
/// publish (a new L2 table) may be published after the switch, through
/// the next chain: its publish covers the old top until it is closed.
#[test]
fn the_next_chains_publish_covers_the_old_tops_last_change() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top.qcow2");
    new_image(&top, GIB);
    let chain = Chain::open(&top, &options(true)).unwrap();
    let new = dir.path().join("next.qcow2");
    let created = indexing::snapshot_over(&chain, &top, &new, None).unwrap();
    let prepared = chain
        .handover()
        .prepare_successor(&created, &options(true))
        .unwrap();
    chain.write_at(&[0xA5; 4096], 300 * MIB).unwrap();
    assert!(
        chain.durability().needs_publish(),
        "the write needs no publish: the test does not test it"
    );
    let next = chain
        .handover()
        .successor(prepared, &options(true))
        .unwrap();
    next.durability().publish().unwrap();
    assert!(
        !chain.durability().needs_publish(),
        "the old top's change is still unpublished"
    );
    assert!(
        read_file_alone(&top, 300 * MIB) == vec![0xA5; 4096],
        "the next chain's publish left the old top's change out of its file"
    );
    chain.handover().retire(&next).unwrap();
    next.close().unwrap();
}

/// A process death between the switch and the old top's close (nothing
/// closed, nothing dropped): the old top's last writes are only in its
/// journal, not in its file; the next read-write open of the chain
/// replays them, and every write reads back, the old top clean.
#[test]
fn a_death_between_the_switch_and_the_close_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top.qcow2");
    new_image(&top, GIB);
    let unlocked = ChainOptions {
        locking: sqcow2_format::Locking::Off,
        ..options(true)
    };
    let chain = Chain::open(&top, &unlocked).unwrap();
    chain.write_at(&[0xB1; 4096], 0).unwrap();
    chain.flush().unwrap();
    let places: Vec<u64> = (1..6u64)
        .map(|i| i * 5 * CLUSTER)
        .chain([600 * MIB])
        .collect();
    for &at in &places {
        chain.write_at(&[0xB2; 4096], at).unwrap();
        // What the daemon does before it completes such a write.
        if chain.durability().needs_publish() {
            chain.durability().publish().unwrap();
        }
    }
    let new = dir.path().join("next.qcow2");
    let created = indexing::snapshot_over(&chain, &top, &new, None).unwrap();
    let prepared = chain
        .handover()
        .prepare_successor(&created, &unlocked)
        .unwrap();
    let next = chain.handover().successor(prepared, &unlocked).unwrap();
    next.write_at(&[0xB3; 4096], 2 * CLUSTER).unwrap();
    // The death: nothing closed, nothing dropped.
    std::mem::forget(next);
    std::mem::forget(chain);
    assert!(
        places
            .iter()
            .any(|&at| read_file_alone(&top, at) != vec![0xB2; 4096]),
        "the old top's file has all its last mappings (this test would show nothing)"
    );
    let reopened = Chain::open(&new, &unlocked).expect("the next open repairs the old top");
    assert!(read(&reopened, 0) == vec![0xB1; 4096]);
    for &at in &places {
        assert!(
            read(&reopened, at) == vec![0xB2; 4096],
            "a write completed before the switch is lost"
        );
    }
    assert!(read(&reopened, 2 * CLUSTER) == vec![0xB3; 4096]);
    reopened.close().unwrap();
    assert_checks_clean(&top, "old top after the repair");
}

/// The old top's close after the switch fails (its file refuses writes):
/// the next chain goes on reading the old top's last tables from its
/// writer, a later snapshot stacks on it, and the next index build closes
/// it once the file takes writes again. Nothing is lost, every layer is
/// clean and the chain indexed.
#[test]
fn a_failed_close_of_the_old_top_is_tried_again_by_the_next_index_build() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top.qcow2");
    new_image(&top, GIB);
    let watch = SyncWatch::new(&top);
    let indexed = || ChainOptions {
        use_index: true,
        ..options(true)
    };
    let chain = Chain::open(
        &top,
        &ChainOptions {
            top_storage: Some(watch.clone()),
            ..indexed()
        },
    )
    .unwrap();
    chain.write_at(&[0x11; 4096], 0).unwrap();
    let next_path = dir.path().join("next.qcow2");
    let created = indexing::snapshot_over(&chain, &top, &next_path, None).unwrap();
    let prepared = chain
        .handover()
        .prepare_successor(&created, &indexed())
        .unwrap();
    chain.durability().sync_data().unwrap();
    chain.durability().publish().unwrap();
    // Completed just before the pause: its mapping is in the old top's
    // writer and journal only.
    chain.write_at(&[0x22; 4096], 40 * CLUSTER).unwrap();
    let next = chain.handover().successor(prepared, &indexed()).unwrap();

    watch.fail_writes(true);
    assert!(
        chain.handover().retire(&next).is_err(),
        "the old top's tables cannot have reached its file"
    );
    assert!(
        next.index().indexable_layers().is_none(),
        "an index must not record an old top its file does not hold yet"
    );
    assert!(read(&next, 40 * CLUSTER) == vec![0x22; 4096]);
    next.write_at(&[0x33; 4096], 41 * CLUSTER).unwrap();
    // Another snapshot: the old top left open is two layers down now.
    let third_path = dir.path().join("third.qcow2");
    let third = successor_with(&next, &next_path, &third_path, &indexed());
    assert!(third.index().indexable_layers().is_none());
    let build = |chain: &Chain| {
        indexing::build_index(chain, sqcow2_format::Locking::Off, &mut |_, _| {}, &|| {
            false
        })
    };
    assert!(build(&third).is_err(), "the old top's file still fails");
    watch.fail_writes(false);
    let built = build(&third).expect("the build closes the old top first");
    assert!(built.is_some(), "no index built");
    assert!(third.index().is_used());
    third.write_at(&[0x44; 4096], 42 * CLUSTER).unwrap();
    drop(chain);
    drop(next);
    third.close().unwrap();

    for path in [&top, &next_path, &third_path] {
        assert_checks_clean(path, &path.display().to_string());
        let header =
            sqcow2_format::Header::read(&FileStorage::open_read_only(path).unwrap()).unwrap();
        assert!(!header.is_dirty(), "{} left dirty", path.display());
        assert_eq!(header.features.autoclear & AUTOCLEAR_JOURNAL, 0);
        assert!(
            !journal_of(path).exists(),
            "{}: journal left",
            path.display()
        );
    }
    let reopened = Chain::open(&third_path, &indexed()).unwrap();
    assert!(reopened.index().is_used(), "{:?}", reopened.index().state());
    for (offset, byte) in [
        (0, 0x11),
        (40 * CLUSTER, 0x22),
        (41 * CLUSTER, 0x33),
        (42 * CLUSTER, 0x44),
    ] {
        assert!(read(&reopened, offset) == vec![byte; 4096], "at {offset}");
    }
}

/// Descriptors this process has open on files under `dir`.
fn descriptors_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let dir = std::fs::canonicalize(dir).unwrap();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.starts_with(&dir))
        .collect()
}

/// A daemon that takes a live snapshot a day keeps every old top as a
/// lower layer: their descriptors (and the second ones their
/// copy-on-write reads open) count in the chain's descriptor budget like
/// every other lower layer's, so the process never holds more than the
/// budget however many snapshots it took; a chain reopened over it (a
/// merge's switch, an activation) keeps the same budget.
#[test]
fn old_tops_of_live_snapshots_count_in_the_descriptor_budget() {
    const BUDGET: usize = 8;
    const SNAPSHOTS: usize = 30;
    let dir = tempfile::tempdir().unwrap();
    let bounded = ChainOptions {
        max_open_files: Some(BUDGET),
        ..options(true)
    };
    let mut path = dir.path().join("layer-0.qcow2");
    new_image(&path, GIB);
    let mut chain = Chain::open(&path, &bounded).unwrap();
    let mut most = 0;
    for s in 0..SNAPSHOTS as u64 {
        if s == SNAPSHOTS as u64 / 2 {
            // Reopened over itself as the daemon does after a merge's
            // switch: its open files reused, its writer done.
            chain.flush_clean().unwrap();
            let reopened = Chain::open_reusing(&path, &bounded, &chain).unwrap();
            chain.fail("replaced");
            drop(std::mem::replace(&mut chain, reopened));
        }
        // A cluster of its own, and a copy-on-write over the cluster the
        // layer before wrote (a read of the layer below).
        chain
            .write_at(&[s as u8 + 1; 4096], (2 * s) * CLUSTER)
            .unwrap();
        if s > 0 {
            chain
                .write_at(&[0xC0; 512], (2 * (s - 1)) * CLUSTER + 8192)
                .unwrap();
        }
        let next_path = dir.path().join(format!("layer-{}.qcow2", s + 1));
        let next = successor_with(&chain, &path, &next_path, &bounded);
        // What the daemon does once the switch is done: the chain before
        // goes.
        drop(std::mem::replace(&mut chain, next));
        path = next_path;
        most = most.max(descriptors_under(dir.path()).len());
    }
    // The top: its file, its journal, the second description of its own
    // copy-on-write reads; the index files are not opened (no index).
    let allowed = BUDGET + 3;
    assert!(most > 0, "no descriptor seen: not counted");
    assert!(
        most <= allowed,
        "{most} descriptors open on the chain's files after {SNAPSHOTS} live snapshots (budget {BUDGET}, top {}): {:#?}",
        allowed - BUDGET,
        descriptors_under(dir.path())
    );
    // Every layer reads back what was written into it.
    for s in 0..SNAPSHOTS as u64 {
        let mut want = vec![0u8; 3 * 4096];
        want[..4096].fill(s as u8 + 1);
        if s + 1 < SNAPSHOTS as u64 {
            want[8192..8192 + 512].fill(0xC0);
        }
        let mut got = vec![0u8; 3 * 4096];
        chain.read_at(&mut got, 2 * s * CLUSTER).unwrap();
        assert!(got == want, "layer {s}");
    }
    chain.close().unwrap();
    for s in 0..=SNAPSHOTS {
        assert_checks_clean(&dir.path().join(format!("layer-{s}.qcow2")), "a layer");
    }
}

/// A top whose next read fails (`EIO`) once armed; that read first lets
/// another opener of the file try to take a reader's image locks, as
/// `qemu-img check` would at that moment, and keeps what it got.
#[derive(Debug)]
struct IntrudedTop {
    path: std::path::PathBuf,
    file: FileStorage,
    armed: std::sync::atomic::AtomicBool,
    /// The other opener's attempt: `Some(true)` if it got its locks.
    intruder_locked: std::sync::Mutex<Option<bool>>,
    intruder: std::sync::Mutex<Option<FileStorage>>,
    /// Lock changes to a reader's fail (`ENOLCK`) while set.
    refuse_reader_locks: std::sync::atomic::AtomicBool,
}

impl IntrudedTop {
    fn open(path: &Path) -> std::sync::Arc<Self> {
        std::sync::Arc::new(IntrudedTop {
            path: path.to_path_buf(),
            file: FileStorage::open_read_write(path).unwrap(),
            armed: Default::default(),
            intruder_locked: Default::default(),
            intruder: Default::default(),
            refuse_reader_locks: Default::default(),
        })
    }
}

impl sqcow2_format::storage::Storage for IntrudedTop {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let other = FileStorage::open_read_only(&self.path).unwrap();
            let got = other
                .lock(
                    sqcow2_format::LockRequest::READER,
                    sqcow2_format::Locking::On,
                )
                .is_ok();
            *self.intruder_locked.lock().unwrap() = Some(got);
            *self.intruder.lock().unwrap() = Some(other);
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.file.read_at(buf, offset)
    }
    fn len(&self) -> std::io::Result<u64> {
        self.file.len()
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.file.write_at(buf, offset)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.file.set_len(len)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.file.sync()
    }
    fn lock(
        &self,
        want: sqcow2_format::LockRequest,
        mode: sqcow2_format::Locking,
    ) -> Result<(), sqcow2_format::ErrorKind> {
        if want == sqcow2_format::LockRequest::READER
            && self
                .refuse_reader_locks
                .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(sqcow2_format::ErrorKind::Io(
                std::io::Error::from_raw_os_error(libc::ENOLCK),
            ));
        }
        self.file.lock(want, mode)
    }
    fn locks(&self) -> Option<sqcow2_format::LockRequest> {
        self.file.locks()
    }
    fn file_id(&self) -> Option<(u64, u64)> {
        self.file.file_id()
    }
    fn is_writable(&self) -> bool {
        self.file.is_writable()
    }
}

/// A writable 1 GiB top over an [`IntrudedTop`], `fill` written at 0, a
/// new top `new.qcow2` created and prepared over it.
struct SwitchAttempt {
    dir: tempfile::TempDir,
    top: std::path::PathBuf,
    new: std::path::PathBuf,
    storage: std::sync::Arc<IntrudedTop>,
    opts: ChainOptions,
    chain: Chain,
}

impl SwitchAttempt {
    fn prepare(fill: u8) -> (Self, sqcow2_format::PreparedTop) {
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path().join("top.qcow2");
        new_image(&top, GIB);
        let storage = IntrudedTop::open(&top);
        let opts = ChainOptions {
            top_storage: Some(storage.clone()),
            locking: sqcow2_format::Locking::On,
            ..options(true)
        };
        let chain = Chain::open(&top, &opts).unwrap();
        chain.write_at(&[fill; 4096], 0).unwrap();
        let new = dir.path().join("new.qcow2");
        let created = indexing::snapshot_over(&chain, &top, &new, None).unwrap();
        let prepared = chain.handover().prepare_successor(&created, &opts).unwrap();
        let attempt = SwitchAttempt {
            dir,
            top,
            new,
            storage,
            opts,
            chain,
        };
        (attempt, prepared)
    }

    /// After the failed switch: the top still the chain's, with a
    /// writer's locks, taking writes; the unused new top left clean; the
    /// next try switches and reads both writes.
    fn assert_still_writing(self, fill: u8) {
        assert_eq!(
            sqcow2_format::storage::Storage::locks(&*self.storage),
            Some(sqcow2_format::LockRequest::WRITER),
            "the top's locks after the failed switch"
        );
        assert!(
            !journal_of(&self.new).exists(),
            "the unused new top's journal left behind"
        );
        assert_checks_clean(&self.new, "unused new top");
        self.chain.write_at(&[fill ^ 0xFF; 4096], CLUSTER).unwrap();
        self.chain.flush().unwrap();
        let next = successor_with(
            &self.chain,
            &self.top,
            &self.dir.path().join("next.qcow2"),
            &self.opts,
        );
        assert!(read(&next, 0) == vec![fill; 4096]);
        assert!(read(&next, CLUSTER) == vec![fill ^ 0xFF; 4096]);
        drop(next);
        assert_checks_clean(&self.top, "old top");
    }
}

/// A live snapshot that fails inside the pause leaves the chain writing
/// its top, so at no moment of it may the top's image locks let a reader
/// in that refuses writers (`qemu-img check`, a backing user): a failed
/// switch must not lower them, then find it cannot take them back and
/// write on regardless.
#[test]
fn a_failed_switch_never_lets_a_reader_in_under_the_writer() {
    let (attempt, prepared) = SwitchAttempt::prepare(0xD1);
    let storage = attempt.storage.clone();
    storage
        .armed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(
        attempt
            .chain
            .handover()
            .successor(prepared, &attempt.opts)
            .is_err(),
        "the old top's header could not be read"
    );
    assert_eq!(
        *storage.intruder_locked.lock().unwrap(),
        Some(false),
        "another opener took a reader's locks on the top while the chain kept writing it"
    );
    drop(storage.intruder.lock().unwrap().take());
    attempt.assert_still_writing(0xD1);
}

/// A live snapshot whose lock change fails in the pause (after the next
/// chain is built) switches nothing: the chain built for it is dropped
/// with its new top closed clean, and the chain's own top, which that
/// chain listed as an old top to close, stays open and writable.
#[test]
fn a_switch_whose_lock_change_fails_leaves_the_top_writing() {
    let (attempt, prepared) = SwitchAttempt::prepare(0xE1);
    let refuse = |on: bool| {
        attempt
            .storage
            .refuse_reader_locks
            .store(on, std::sync::atomic::Ordering::SeqCst)
    };
    assert!(journal_of(&attempt.top).exists());
    refuse(true);
    assert!(attempt
        .chain
        .handover()
        .successor(prepared, &attempt.opts)
        .is_err());
    refuse(false);
    // Its writer not closed by the dropped chain (which would end its
    // journal): still journaling the writes it takes.
    assert!(
        journal_of(&attempt.top).exists(),
        "the top was closed under its chain"
    );
    attempt.assert_still_writing(0xE1);
}
