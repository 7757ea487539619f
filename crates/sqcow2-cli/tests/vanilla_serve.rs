//! Chains QEMU made are indexed by `sqcow2 serve` without a manual step:
//! in the background while a client writes, every layer `qemu-img check`
//! clean and QEMU reading what the client wrote once the daemon stops;
//! where a layer is held by another process, nothing is written into it,
//! the chain is walked and `stats` and `info` say why; a layer a vanilla
//! tool wrote while the daemon was stopped is detected at the next start
//! and the index built again.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::faulty_fs::FaultyFs;
use common::reference::Reference;
use common::vhost::{connect_retry, control, wait_index_state, wait_indexed, Daemon};
use common::{build_chain, qemu_io, s, sha256_file, sqcow2, LayerSpec};
use serde_json::json;

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;
const SIZE: u64 = 64 * MIB;

/// A chain of `n` layers made by `qemu-img` and `qemu-io`: each writes
/// data, a compressed cluster and zeros at offsets of its own and over
/// what the layers below wrote.
fn qemu_made(dir: &Path, n: usize) -> PathBuf {
    let specs: Vec<LayerSpec> = (0..n as u64)
        .map(|i| {
            let cmds = [
                format!(
                    "write -P {} {} 256k",
                    0x10 + i,
                    (i * 320 * 1024) % (SIZE / 2)
                ),
                format!("write -c -P {} {} 64k", 0x80 + i, SIZE / 2 + i * 65536),
                format!("write -z {} 64k", (i * 192 * 1024 + 65536) % (SIZE / 2)),
                format!("write -P {} {} 8k", 0xc0 + i, SIZE - 65536 * (i + 1) + 4096),
            ];
            let refs: Vec<&str> = cmds.iter().map(String::as_str).collect();
            LayerSpec::new("", SIZE, &refs)
        })
        .collect();
    build_chain(dir, &specs)
}

#[test]
fn serve_indexes_a_chain_qemu_made_while_a_client_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let top = qemu_made(tmp.path(), 40);
    let info = sqcow2(&["info", s(&top)]);
    assert!(info.contains("chain index: none (walk mode: "), "{info}");
    let reference = Arc::new(Mutex::new(Reference::new(&top, tmp.path(), BLOCK)));
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    // Writes from the first moment, while the index is built, and on
    // after it serves: copy-on-write from every depth both ways.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, reference) = (stop.clone(), reference.clone());
        std::thread::spawn(move || {
            let mut rng = fastrand::Rng::with_seed(43);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) || n < 200 {
                let offset = rng.u64(0..SIZE / BLOCK) * BLOCK;
                let fill = rng.u8(1..);
                client.write(offset, &vec![fill; BLOCK as usize]);
                reference.lock().unwrap().wrote(offset, fill);
                n += 1;
            }
            (client, n)
        })
    };
    let st = wait_indexed(&ctl);
    assert_eq!(st["result"]["index-mode"], "indexed", "{st}");
    assert!(st["result"]["index"]["builds"].as_u64() >= Some(1), "{st}");
    assert_eq!(
        st["result"]["index"]["walking-because"],
        serde_json::Value::Null
    );
    let info = control(&ctl, json!({"command": "info"}));
    assert_eq!(info["result"]["indexed"], true, "{info}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let (mut client, n) = writer.join().unwrap();
    let reference = reference.lock().unwrap();
    reference.verify_through(&mut client, "after the index was built");
    drop(client);
    daemon.stop();
    println!("{n} writes while the chain was indexed and after");
    // QEMU reads what the client wrote, every layer is clean, the index
    // agrees with a walk and the top names it.
    reference.verify_files(&top, tmp.path());
}

/// Waits for a failed index build of the daemon behind `ctl`; asserts it
/// walks, saying why (with every one of `says`) alike in `stats` and
/// `info`.
fn assert_walks_after_a_failed_build(ctl: &Path, says: &[&str]) {
    let st = wait_index_state(ctl, "a failed build", |index| {
        index["failures"].as_u64() >= Some(1) && index["building"] == false
    });
    let st = &st["result"];
    assert_eq!(st["index-mode"], "walk", "{st}");
    let why = st["index"]["walking-because"].as_str().unwrap_or_default();
    assert!(says.iter().all(|w| why.contains(w)), "stats: {st}");
    let info = control(ctl, json!({"command": "info"}));
    assert_eq!(
        info["result"]["walking-because"].as_str(),
        Some(why),
        "{info}"
    );
}

/// `count` random 4 KiB writes through `client` (seeded), noted in
/// `reference`.
fn write_random_blocks(
    client: &mut common::vhost::Client,
    reference: &mut Reference,
    seed: u64,
    count: usize,
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for _ in 0..count {
        let offset = rng.u64(0..SIZE / BLOCK) * BLOCK;
        let fill = rng.u8(1..);
        client.write(offset, &vec![fill; BLOCK as usize]);
        reference.wrote(offset, fill);
    }
}

#[test]
fn a_layer_another_process_holds_is_not_written_and_the_chain_walks() {
    let tmp = tempfile::tempdir().unwrap();
    let top = qemu_made(tmp.path(), 6);
    // QEMU reading layer 2 holds it and its backing files, layers 0-1.
    let mut reader =
        common::QemuIoHolder::hold(&tmp.path().join("layer2.qcow2"), &["-r", "-f", "qcow2"]);
    // Layer 0, opened (and locked) last.
    reader.wait_held(&tmp.path().join("layer0.qcow2"));
    let below: Vec<PathBuf> = (0..5)
        .map(|i| tmp.path().join(format!("layer{i}.qcow2")))
        .collect();
    let before: Vec<String> = below.iter().map(|p| sha256_file(p)).collect();
    let mut reference = Reference::new(&top, tmp.path(), BLOCK);
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    assert_walks_after_a_failed_build(&ctl, &["layer0.qcow2", "lock"]);
    // Served right while walking.
    let mut client = connect_retry(&daemon, 1, false);
    write_random_blocks(&mut client, &mut reference, 7, 100);
    reference.verify_through(&mut client, "walking");
    drop(client);
    daemon.stop();
    drop(reader);
    // Said once, and no layer below the top was written (the locks
    // come first: none was marked).
    let log = daemon.log();
    assert_eq!(log.matches("cannot be indexed").count(), 1, "{log}");
    let after: Vec<String> = below.iter().map(|p| sha256_file(p)).collect();
    assert_eq!(before, after, "a layer below the top was written");
    assert!(
        !tmp.path().join("layer5.qcow2.sqidx").exists(),
        "an index was left"
    );
    reference.verify_for_qemu(&top, tmp.path());
    let info = sqcow2(&["info", s(&top)]);
    assert!(info.contains("chain index: none"), "{info}");
}

#[test]
fn a_layer_a_vanilla_tool_wrote_while_stopped_is_detected_at_the_next_start() {
    let tmp = tempfile::tempdir().unwrap();
    let top = qemu_made(tmp.path(), 8);
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    wait_indexed(&ctl);
    daemon.stop();
    let info = sqcow2(&["info", s(&top)]);
    assert!(info.contains("chain index: valid"), "{info}");
    // A vanilla write into a middle layer, under clusters the layers
    // above do not hold: the index's answer there is now wrong.
    let middle = tmp.path().join("layer3.qcow2");
    qemu_io(
        &middle,
        &[format!("write -P 0x5e {} 1M", SIZE / 2 + 8 * MIB)],
    );
    let info = sqcow2(&["info", s(&top)]);
    assert!(info.contains("chain index: stale"), "{info}");
    let mut reference = Reference::new(&top, tmp.path(), BLOCK);
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let st = wait_indexed(&ctl);
    assert_eq!(st["result"]["index-mode"], "indexed", "{st}");
    assert_eq!(st["result"]["index"]["builds"], 1, "{st}");
    let mut client = connect_retry(&daemon, 1, false);
    let got = client.read(SIZE / 2 + 8 * MIB, MIB as usize);
    assert!(
        got.iter().all(|&b| b == 0x5e),
        "the vanilla write is not read"
    );
    // Partial writes over the vanilla data copy it from below.
    for k in 0..16u64 {
        let offset = SIZE / 2 + 8 * MIB + k * 65536 + 4096 * (k % 16);
        client.write(offset, &[0xa0 + k as u8; BLOCK as usize]);
        reference.wrote(offset, 0xa0 + k as u8);
    }
    drop(client);
    daemon.stop();
    reference.verify_files(&top, tmp.path());
}

/// An index build that meets I/O errors is abandoned: the chain lies on a
/// FUSE filesystem that fails every write, sync and new file with a real
/// `EIO` while the daemon starts (the index's side file cannot be made,
/// nor the mapping journal). The daemon says why once, in the log,
/// `stats` and `info`, and serves walking (changes published instead of
/// journaled); once the files work again it neither loses a write nor
/// returns wrong data, and QEMU reads the chain and finds every layer
/// clean.
#[test]
fn an_index_build_that_meets_eio_falls_back_to_walking() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    qemu_made(&src, 12);
    let fs = FaultyFs::mount_with_new_files(&src, &tmp.path().join("mnt"));
    let top = fs.mountpoint.join("layer11.qcow2");
    let mut reference = Reference::new(&top, tmp.path(), BLOCK);
    let ctl = tmp.path().join("control.sock");
    fs.faults.set(false, true, true);
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    assert_walks_after_a_failed_build(&ctl, &["cannot be indexed", "Input/output error"]);
    fs.faults.set(false, false, false);
    // Served right while walking: copy-on-write from every depth, reads
    // of every layer's data.
    let mut client = connect_retry(&daemon, 1, false);
    write_random_blocks(&mut client, &mut reference, 11, 300);
    reference.verify_through(&mut client, "walking after the failed build");
    let st = control(&ctl, json!({"command": "stats"}));
    assert_eq!(st["result"]["index"]["failures"], 1, "retried: {st}");
    drop(client);
    daemon.stop();
    let log = daemon.log();
    assert_eq!(log.matches("cannot be indexed").count(), 1, "{log}");
    drop(fs);
    // What QEMU sees: the files themselves, every layer clean.
    let top = src.join("layer11.qcow2");
    reference.verify_for_qemu(&top, tmp.path());
    for i in 0..12 {
        common::assert_check_clean(&src.join(format!("layer{i}.qcow2")));
    }
}

/// A 50-layer vanilla chain in `dir`, opened writable: its top, the
/// options it was opened with, the chain.
fn writable_vanilla_chain(
    dir: &Path,
) -> (PathBuf, sqcow2_format::ChainOptions, sqcow2_format::Chain) {
    let top = common::gen_vanilla_chain(dir, 50, "256M", "0.5");
    let options = sqcow2_format::ChainOptions {
        writable: true,
        ..sqcow2_format::ChainOptions::default()
    };
    let chain = sqcow2_format::Chain::open(&top, &options).unwrap();
    (top, options, chain)
}

/// Reads of `count` random clusters of `chain`: cache lookups that sent a
/// walk further down (steps down the chain).
fn steps_down_over_reads(chain: &sqcow2_format::Chain, count: usize) -> u64 {
    let mut rng = fastrand::Rng::with_seed(3);
    let mut buf = vec![0u8; BLOCK as usize];
    let before = chain.diagnostics().cache().hit_unallocated;
    for _ in 0..count {
        let offset = rng.u64(0..chain.virtual_size() / BLOCK) * BLOCK;
        chain.read_at(&mut buf, offset).unwrap();
    }
    chain.diagnostics().cache().hit_unallocated - before
}

#[test]
fn an_index_built_in_place_serves_as_one_found_at_open() {
    let tmp = tempfile::tempdir().unwrap();
    let (top, options, chain) = writable_vanilla_chain(tmp.path());
    assert!(!chain.index().is_used());
    let walked = steps_down_over_reads(&chain, 2000);
    let built =
        sqcow2_format::indexing::index_in_place(&chain, sqcow2_format::Locking::Auto, &|| false)
            .unwrap();
    assert!(built.is_some());
    assert!(chain.index().is_used());
    let installed = steps_down_over_reads(&chain, 2000);
    chain.close().unwrap();
    let reopened = sqcow2_format::Chain::open(&top, &options).unwrap();
    assert!(reopened.index().is_used());
    let at_open = steps_down_over_reads(&reopened, 2000);
    println!("steps down: walking {walked}, installed {installed}, at open {at_open}");
    assert!(walked > 10_000, "walking took {walked} steps");
    assert!(
        installed <= at_open,
        "installed in place: {installed} steps down, opened indexed: {at_open}"
    );
}

/// What a queue worker does: a lookup from cached metadata only, handed
/// to a thread that may read (as the engine does) when it would block.
fn steps_down_over_worker_reads(chain: &sqcow2_format::Chain, count: usize) -> u64 {
    let mut rng = fastrand::Rng::with_seed(4);
    let before = chain.diagnostics().cache().hit_unallocated;
    for _ in 0..count {
        let offset = rng.u64(0..chain.virtual_size() / BLOCK) * BLOCK;
        let ticket = chain.transfers().begin();
        let at = sqcow2_format::GuestOffset(offset);
        if chain
            .transfers()
            .try_resolve_for_read(&ticket, at, BLOCK)
            .unwrap()
            .is_none()
        {
            chain
                .transfers()
                .resolve_for_read(&ticket, at, BLOCK)
                .unwrap();
        }
    }
    chain.diagnostics().cache().hit_unallocated - before
}

#[test]
fn lookups_that_must_not_wait_use_an_index_installed_over_a_warm_walk() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, _, chain) = writable_vanilla_chain(tmp.path());
    // Walking caches every layer's tables (the build walks them too).
    let walked = steps_down_over_worker_reads(&chain, 4000);
    sqcow2_format::indexing::index_in_place(&chain, sqcow2_format::Locking::Auto, &|| false)
        .unwrap()
        .unwrap();
    let installed = steps_down_over_worker_reads(&chain, 4000);
    println!("steps down: walking {walked}, installed {installed}");
    assert!(walked > 10_000, "walking took {walked} steps");
    // A cold index slice is read where waiting is allowed, not walked
    // around through the tables cached before.
    assert!(
        installed < walked / 20,
        "installed in place: {installed} steps down, walking: {walked}"
    );
}

/// A QEMU chain of `n` layers over 1 TiB (slow enough to index that a
/// control command lands during the build): each layer writes near the
/// start and far out.
fn slow_to_index(dir: &Path, n: usize) -> PathBuf {
    let specs: Vec<LayerSpec> = (0..n as u64)
        .map(|i| {
            let cmds = [
                format!("write -P {} {} 64k", 0x20 + i, i * 3 * MIB),
                format!("write -P {} {} 128k", 0x40 + i, i * 7 * 1024 * MIB),
            ];
            let refs: Vec<&str> = cmds.iter().map(String::as_str).collect();
            LayerSpec::new("", 1 << 40, &refs)
        })
        .collect();
    build_chain(dir, &specs)
}

#[test]
fn a_live_snapshot_during_an_in_place_build_leaves_every_index_valid() {
    let tmp = tempfile::tempdir().unwrap();
    let top = slow_to_index(tmp.path(), 20);
    let mut reference = Reference::new(&top, tmp.path(), BLOCK);
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    wait_index_state(&ctl, "a build running", |index| index["building"] == true);
    let new = tmp.path().join("new.qcow2");
    let r = control(&ctl, json!({"command": "snapshot", "path": new}));
    assert_eq!(r["ok"], true, "{r}");
    wait_indexed(&ctl);
    for k in 0..32u64 {
        client.write(k * 3 * MIB + 4096, &[0x99; BLOCK as usize]);
        reference.wrote(k * 3 * MIB + 4096, 0x99);
    }
    reference.verify_through(&mut client, "after the snapshot");
    drop(client);
    daemon.stop();
    reference.verify_for_qemu(&new, tmp.path());
    // The new top's own index, built by the daemon, records the old top
    // as its file is: valid at the next open.
    let info = sqcow2(&["info", s(&new)]);
    assert!(
        info.contains(&format!("chain index: valid ({}.sqidx", new.display())),
        "{info}\n{}",
        daemon.log()
    );
    let log = daemon.log();
    assert!(!log.contains("cannot be indexed"), "{log}");
}

#[test]
fn a_top_whose_header_cannot_name_an_index_is_left_as_it_is() {
    let tmp = tempfile::tempdir().unwrap();
    // 512-byte clusters and a long backing name: no room for the index
    // extension in the top's first cluster.
    let base = tmp.path().join(format!("{}.qcow2", "b".repeat(200)));
    common::qemu_create(&base, "cluster_size=512", "64M");
    qemu_io(&base, &["write -P 0x31 0 1M".to_owned()]);
    let top = tmp.path().join(format!("{}.qcow2", "t".repeat(150)));
    common::qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=512",
        "-b",
        s(&base),
        "-F",
        "qcow2",
        s(&top),
    ]);
    qemu_io(&top, &["write -P 0x32 1M 1M".to_owned()]);
    let before = [sha256_file(&base), sha256_file(&top)];
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let st = wait_index_state(&ctl, "a refused build", |index| {
        index["failures"].as_u64() >= Some(1) && index["building"] == false
    });
    let why = st["result"]["index"]["walking-because"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(why.contains("do not fit"), "{st}");
    daemon.stop();
    // Refused before anything was written: the base is not marked, no
    // index file is left, and the top is as QEMU left it.
    assert_eq!(sha256_file(&base), before[0], "the base was written");
    assert_eq!(sha256_file(&top), before[1], "the top was written");
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().contains(".sqidx"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
