//! The sQcow2 chain index: QEMU reads every indexed chain identically and
//! finds nothing wrong with any layer; after any vanilla tool touches a
//! layer the index is detected stale and sqcow2 still returns QEMU's bytes;
//! a damaged or missing index changes nothing but speed; a cold indexed
//! lookup reads at most two metadata slices whatever the chain length.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{assert_same_as_qemu, qemu_img, qemu_io, qemu_overlay, run_raw, s, sqcow2};
use sqcow2_format::gen::{generate, owners, parse_tag, plan, Distribution, GenOptions, TAG_STRIDE};
use sqcow2_format::IndexState;
use sqcow2_format::{Chain, ChainOptions};

const MIB: u64 = 1 << 20;

fn open(top: &Path, use_index: bool) -> Chain {
    Chain::open(
        top,
        &ChainOptions {
            use_index,
            ..ChainOptions::default()
        },
    )
    .unwrap()
}

fn qemu_check_all(top: &Path) {
    let chain = open(top, false);
    for layer in chain.layers() {
        if layer.header().is_none() {
            continue;
        }
        let out = run_raw(Command::new("qemu-img").args(["check", s(layer.path())]));
        assert_eq!(
            out.status.code(),
            Some(0),
            "qemu-img check {}: {}",
            layer.path().display(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

fn state(top: &Path) -> IndexState {
    open(top, true).index().state().clone()
}

fn assert_valid(top: &Path) {
    let st = state(top);
    assert!(
        matches!(st, IndexState::Valid { .. }),
        "{}: {st:?}",
        top.display()
    );
}

fn assert_stale(top: &Path) {
    let st = state(top);
    assert!(
        matches!(st, IndexState::Stale { .. }),
        "{}: {st:?}",
        top.display()
    );
}

/// Reads the whole disk and checks every 4 KiB tag against the plan.
fn verify_tags(top: &Path, opts: &GenOptions, use_index: bool) {
    let chain = open(top, use_index);
    assert_eq!(
        chain.index().is_used(),
        use_index && opts.index && opts.layers > 1
    );
    let p = plan(opts);
    let clusters = opts.size.div_ceil(opts.cluster_size);
    let owner = owners(&p, clusters, opts.layers - 1);
    let mut buf = vec![0u8; opts.cluster_size as usize];
    for c in 0..clusters {
        chain.read_at(&mut buf, c * opts.cluster_size).unwrap();
        for block in buf.chunks(TAG_STRIDE) {
            match owner[c as usize] {
                Some(layer) => assert_eq!(parse_tag(block), Some((layer, c)), "cluster {c}"),
                None => assert!(block.iter().all(|&b| b == 0), "cluster {c} should be zeros"),
            }
        }
    }
}

fn gen(
    dir: &Path,
    layers: usize,
    index: bool,
    distribution: Distribution,
) -> (PathBuf, GenOptions) {
    let opts = GenOptions {
        layers,
        size: 64 * MIB,
        cluster_size: 65536,
        fill: 0.6,
        seed: layers as u64,
        distribution,
        index,
    };
    let top = generate(dir, &opts, &mut |_, _| {}).unwrap();
    (top, opts)
}

#[test]
fn generated_chains_read_right_in_both_modes() {
    for (layers, distribution) in [
        (1, Distribution::Uniform),
        (10, Distribution::Zipf),
        (100, Distribution::SequentialRuns),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let (top, opts) = gen(tmp.path(), layers, true, distribution);
        verify_tags(&top, &opts, true);
        verify_tags(&top, &opts, false);
        assert_same_as_qemu(&top);
        qemu_check_all(&top);
    }
}

/// QEMU 10.0's qemu-img crashes on chains of ~900 layers, so at 1000 the
/// oracle is the generator's plan (every cluster tagged with its owner).
#[test]
fn thousand_layers_via_the_cli() {
    let tmp = tempfile::tempdir().unwrap();
    let out = sqcow2(&[
        "gen-chain",
        "--layers",
        "1000",
        "--size",
        "32M",
        "--fill",
        "0.9",
        s(tmp.path()),
    ]);
    let top = PathBuf::from(out.trim());
    let opts = GenOptions {
        layers: 1000,
        size: 32 * MIB,
        cluster_size: 65536,
        fill: 0.9,
        seed: 1,
        distribution: Distribution::Uniform,
        index: true,
    };
    assert_valid(&top);
    verify_tags(&top, &opts, true);
    verify_tags(&top, &opts, false);
    for layer in [
        &top,
        &tmp.path().join("layer0000.qcow2"),
        &tmp.path().join("layer0500.qcow2"),
    ] {
        let out = run_raw(Command::new("qemu-img").args(["check", s(layer)]));
        assert_eq!(out.status.code(), Some(0));
    }
}

#[test]
fn cold_indexed_lookups_read_at_most_two_slices() {
    let tmp = tempfile::tempdir().unwrap();
    let (top, opts) = gen(tmp.path(), 100, true, Distribution::Uniform);
    let p = plan(&opts);
    // A cluster only the base holds: the walk must visit every layer.
    let owner = owners(&p, opts.size / opts.cluster_size, 99);
    let base_only = owner
        .iter()
        .position(|o| *o == Some(0))
        .expect("a base cluster") as u64;
    let mut buf = vec![0u8; 4096];
    let indexed = open(&top, true);
    indexed.read_at(&mut buf, base_only * 65536).unwrap();
    let st = indexed.diagnostics().cache();
    assert!(
        st.loads <= 2,
        "indexed cold lookup read {} metadata slices",
        st.loads
    );
    assert_eq!(parse_tag(&buf), Some((0, base_only)));
    let walked = open(&top, false);
    walked.read_at(&mut buf, base_only * 65536).unwrap();
    let st = walked.diagnostics().cache();
    assert!(st.loads > 50, "walk mode read only {} slices", st.loads);
    // Repeated, the lookup is a cache hit in both modes.
    let before = indexed.diagnostics().cache();
    indexed.read_at(&mut buf, base_only * 65536).unwrap();
    let after = indexed.diagnostics().cache();
    assert_eq!(after.loads, before.loads, "a cached lookup touched a file");
}

/// A chain made by QEMU with every kind of layer, upgraded in place.
fn qemu_chain(dir: &Path) -> PathBuf {
    let base = dir.join("base.raw");
    std::fs::write(&base, vec![0x11u8; 3 << 20]).unwrap();
    let names = ["l1.qcow2", "l2.qcow2", "l3.qcow2", "top.qcow2"];
    let opts = [
        "compression_type=zstd",
        "cluster_size=65536,extended_l2=on",
        "",
        "",
    ];
    let mut prev = ("base.raw".to_owned(), "raw");
    for (i, (name, o)) in names.iter().zip(opts).enumerate() {
        let p = dir.join(name);
        let mut args = vec!["create", "-q", "-f", "qcow2", "-b", &prev.0, "-F", prev.1];
        if !o.is_empty() {
            args.extend(["-o", o]);
        }
        let size = format!("{}", 8 * MIB);
        args.extend([s(&p), &size]);
        qemu_img(&args);
        if i < 3 {
            qemu_io(
                &p,
                &[
                    format!("write -P {} {} 300k", 0x20 + i, i as u64 * MIB),
                    format!(
                        "write -c -P {} {} 64k",
                        0x30 + i,
                        4 * MIB + i as u64 * 65536
                    ),
                    format!("write -z {} 64k", 5 * MIB + i as u64 * 65536),
                    format!("write -P {} {} 4k", 0x40 + i, 6 * MIB + 8192 * i as u64),
                ],
            );
        }
        prev = (name.to_string(), "qcow2");
    }
    let top = dir.join("top.qcow2");
    sqcow2(&["upgrade", s(&top)]);
    top
}

fn fresh_chain() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let top = qemu_chain(tmp.path());
    assert_valid(&top);
    (tmp, top)
}

#[test]
fn upgraded_chain_is_clean_and_identical_for_qemu() {
    let (_tmp, top) = fresh_chain();
    assert_same_as_qemu(&top);
    qemu_check_all(&top);
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["check", s(&top)]));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// `map` answers from the index as from a walk: QEMU's map, entry for
/// entry, the depth of unallocated ranges included (the layer the walk
/// down ends at: the base, or the first layer whose backing is shorter),
/// on a chain over a shorter raw base and one with a shorter middle
/// layer.
#[test]
fn indexed_map_is_qemus_map() {
    let (_tmp, top) = fresh_chain();
    assert_valid(&top);
    common::assert_full_map_equal(&top);

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let layers = [
        ("a.qcow2", "8M"),
        ("b.qcow2", "2M"),
        ("c.qcow2", "8M"),
        ("d.qcow2", "8M"),
    ];
    for (i, (name, size)) in layers.iter().enumerate() {
        let p = dir.join(name);
        if i == 0 {
            common::qemu_create(&p, "", size);
        } else {
            qemu_overlay(&p, layers[i - 1].0, "qcow2", &[], Some(size));
        }
        qemu_io(
            &p,
            &[format!(
                "write -P {} {} 64k",
                0x50 + i,
                i as u64 * MIB + 65536
            )],
        );
    }
    // Beyond the shorter middle layer: hidden from the layers above it.
    qemu_io(&dir.join("a.qcow2"), &["write -P 0x70 5M 64k".into()]);
    let top = dir.join("d.qcow2");
    sqcow2(&["upgrade", s(&top)]);
    assert_valid(&top);
    common::assert_full_map_equal(&top);
    assert_same_as_qemu(&top);
}

/// A script that upgrades every top of a host meets lone images too: they
/// have nothing to index, which is not an error.
#[test]
fn upgrade_of_a_lone_image_says_there_is_nothing_to_index() {
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("lone.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&image), "16M"]);
    let before = std::fs::read(&image).unwrap();
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["upgrade", s(&image)]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("nothing to index"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let json = run_raw(Command::new(common::sqcow2_bin()).args([
        "upgrade",
        "--output",
        "json",
        s(&image),
    ]));
    assert!(json.status.success());
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["index"], serde_json::Value::Null, "{v}");
    assert_eq!(std::fs::read(&image).unwrap(), before, "the image changed");
    assert!(!tmp.path().join("lone.qcow2.sqidx").exists());
}

#[test]
fn qemu_io_write_to_the_top_keeps_the_index() {
    let (_tmp, top) = fresh_chain();
    qemu_io(
        &top,
        &["write -P 0x77 1M 256k".into(), "write -z 4M 64k".into()],
    );
    assert_valid(&top);
    assert_same_as_qemu(&top);
}

#[test]
fn commit_of_a_middle_layer_makes_it_stale() {
    let (tmp, top) = fresh_chain();
    qemu_img(&["commit", "-q", s(&tmp.path().join("l2.qcow2"))]);
    assert_stale(&top);
    assert_same_as_qemu(&top);
}

#[test]
fn unsafe_and_safe_rebase_make_it_stale() {
    let (tmp, top) = fresh_chain();
    qemu_img(&["rebase", "-u", "-b", "l1.qcow2", "-F", "qcow2", s(&top)]);
    assert_stale(&top);
    assert_same_as_qemu(&top);
    let (tmp2, top2) = fresh_chain();
    qemu_img(&["rebase", "-b", "l1.qcow2", "-F", "qcow2", s(&top2)]);
    assert_stale(&top2);
    assert_same_as_qemu(&top2);
    drop((tmp, tmp2));
}

#[test]
fn resize_makes_it_stale() {
    let (_tmp, top) = fresh_chain();
    qemu_img(&["resize", "-q", s(&top), "+16M"]);
    assert_stale(&top);
    assert_same_as_qemu(&top);
}

#[test]
fn check_repair_of_a_layer_makes_it_stale() {
    let (tmp, top) = fresh_chain();
    qemu_img(&["check", "-q", "-r", "all", s(&tmp.path().join("l1.qcow2"))]);
    assert_stale(&top);
    assert_same_as_qemu(&top);
}

#[test]
fn vanilla_overlay_on_an_indexed_chain() {
    let (tmp, _top) = fresh_chain();
    let over = tmp.path().join("over.qcow2");
    qemu_overlay(&over, "top.qcow2", "qcow2", &[], None);
    qemu_io(&over, &["write -P 0x5e 2M 100k".into()]);
    assert!(matches!(state(&over), IndexState::None));
    assert_same_as_qemu(&over);
    // ... and it can be indexed in turn.
    sqcow2(&["upgrade", s(&over)]);
    assert_valid(&over);
    assert_same_as_qemu(&over);
    qemu_check_all(&over);
}

#[test]
fn damaged_index_changes_nothing_but_speed() {
    let (_tmp, top) = fresh_chain();
    let index = top.with_file_name("top.qcow2.sqidx");
    let good = std::fs::read(&index).unwrap();
    // Corrupt one byte of the last slice: noticed when the slice is read.
    let mut bad = good.clone();
    let n = bad.len();
    bad[n - 40] ^= 0x01;
    std::fs::write(&index, &bad).unwrap();
    assert_same_as_qemu(&top);
    // Corrupt the header, truncate, delete: noticed at open.
    let mut bad = good.clone();
    bad[20] ^= 0xff;
    std::fs::write(&index, &bad).unwrap();
    assert_stale(&top);
    assert_same_as_qemu(&top);
    std::fs::write(&index, &good[..good.len() / 2]).unwrap();
    assert_stale(&top);
    assert_same_as_qemu(&top);
    std::fs::remove_file(&index).unwrap();
    assert_stale(&top);
    assert_same_as_qemu(&top);
    // upgrade rebuilds it.
    sqcow2(&["upgrade", s(&top)]);
    assert_valid(&top);
    assert_same_as_qemu(&top);
}

#[test]
fn snapshots_extend_the_index_incrementally() {
    let (tmp, mut top) = fresh_chain();
    for i in 0..5u64 {
        let new = tmp.path().join(format!("snap{i}.qcow2"));
        // Odd snapshots defer the index (the default): the old top's
        // index serves, the old top walked above it, until the next
        // snapshot with `--index now` extends it over both.
        let now = i % 2 == 0;
        let when = if now { "now" } else { "deferred" };
        let out = sqcow2(&[
            "snapshot",
            "--output",
            "json",
            "--index",
            when,
            s(&top),
            s(&new),
        ]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["index-written"], now, "{out}");
        assert_eq!(v["incremental"], now, "{out}");
        assert_valid(&new);
        match state(&new) {
            IndexState::Valid { pending, .. } => {
                assert_eq!(pending, usize::from(!now), "snapshot {i}")
            }
            other => panic!("snapshot {i}: {other:?}"),
        }
        sqcow2(&[
            "io",
            "-c",
            &format!("write -P {} {} 200k", 0x60 + i, i * 700_000),
            s(&new),
        ]);
        // Writing to the new top leaves the index (of the layers below) valid.
        assert_valid(&new);
        assert_same_as_qemu(&new);
        top = new;
    }
    qemu_check_all(&top);
    // QEMU sees the new top exactly as if qemu-img create -b had made it.
    let info: serde_json::Value =
        serde_json::from_str(&qemu_img(&["info", "--output", "json", s(&top)])).unwrap();
    // Absolute paths given, absolute name written (as qemu-img does).
    assert_eq!(info["backing-filename"], s(&tmp.path().join("snap3.qcow2")));
    assert_eq!(info["backing-filename-format"], "qcow2");
    // Refuses to overwrite.
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["snapshot", s(&top), s(&top)]));
    assert_eq!(out.status.code(), Some(1));
}

/// What a crash in the middle of `snapshot` leaves (its temporary files,
/// recognised by their headers: an image marked unpublished, an index's
/// magic) is removed by the next snapshot of that name; the old chain
/// reads as before meanwhile. A file of the same name that sqcow2 did not
/// make is refused, untouched.
#[test]
fn interrupted_snapshot_leaves_the_chain_usable() {
    let (tmp, top) = fresh_chain();
    let new = tmp.path().join("new.qcow2");
    // The state after a crash before the final rename: an index and a
    // half-written image under their temporary names (the image's header
    // carries the unpublished bit, autoclear bit 61; the index its magic).
    let mut image = std::fs::read(&top).unwrap();
    image.truncate(4096);
    image[88] |= 1 << 5;
    std::fs::write(tmp.path().join("new.qcow2.sqtmp"), &image).unwrap();
    std::fs::write(tmp.path().join("new.qcow2.sqidx.tmp"), b"SQC2INDX partial").unwrap();
    assert!(!new.exists());
    assert_valid(&top);
    assert_same_as_qemu(&top);
    sqcow2(&["snapshot", s(&top), s(&new)]);
    assert!(!tmp.path().join("new.qcow2.sqtmp").exists());
    assert!(!tmp.path().join("new.qcow2.sqidx.tmp").exists());
    assert_valid(&new);
    assert_same_as_qemu(&new);
    qemu_check_all(&new);
    // Not sqcow2's: refused, kept.
    let other = tmp.path().join("other.qcow2");
    std::fs::write(tmp.path().join("other.qcow2.sqtmp"), b"QFI\xfb partial").unwrap();
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["snapshot", s(&top), s(&other)]));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        std::fs::read(tmp.path().join("other.qcow2.sqtmp")).unwrap(),
        b"QFI\xfb partial"
    );
}

/// A damaged index (a flipped byte: a slice fails its checksum) is a
/// stale index, not a damaged image: `check` warns and names the way out
/// (exit 0, as `qemu-img check`), `check -r all` rebuilds it.
#[test]
fn a_damaged_index_is_a_warning_and_check_r_all_rebuilds_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (top, _) = gen(tmp.path(), 5, true, Distribution::Uniform);
    let path = top.with_file_name("layer0004.qcow2.sqidx");
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    qemu_check_all(&top);

    let out = run_raw(Command::new(common::sqcow2_bin()).args(["check", s(&top)]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("No errors were found on the image."),
        "{text}"
    );
    assert!(text.contains("index is damaged"), "{text}");
    assert!(text.contains("sqcow2 upgrade"), "{text}");
    assert!(!text.contains("ERROR"), "{text}");

    let out = run_raw(Command::new(common::sqcow2_bin()).args(["check", "-r", "all", s(&top)]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("index rebuilt"), "{text}");
    assert_valid(&top);
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["check", s(&top)]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(!text.contains("index"), "{text}");
    assert_same_as_qemu(&top);
    qemu_check_all(&top);
}

/// An index whose checksums are intact but whose content is wrong (as a
/// buggy writer could leave it) is caught by `sqcow2 check`.
#[test]
fn check_compares_the_index_with_a_walk() {
    use sqcow2_format::index::{encode_index, ChainIndex, IndexEntry};
    use sqcow2_format::storage::FileStorage;
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let (top, opts) = gen(tmp.path(), 5, true, Distribution::Uniform);
    let path = top.with_file_name("layer0004.qcow2.sqidx");
    let index =
        ChainIndex::open(&path, Arc::new(FileStorage::open_read_only(&path).unwrap())).unwrap();
    let cache = sqcow2_cache::SliceCache::new(sqcow2_cache::CacheConfig::default());
    let g = index.geometry();
    let mut entries: Vec<IndexEntry> = (0..g.chunks())
        .map(|c| index.entry(c, &cache).unwrap().unwrap())
        .collect();
    let victim = entries
        .iter()
        .position(|e| matches!(e, IndexEntry::Data { .. }))
        .unwrap();
    entries[victim] = IndexEntry::None;
    let layers = index.layers().to_vec();
    drop(index);
    std::fs::write(&path, encode_index(g, &layers, &entries)).unwrap();
    assert_valid(&top);
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["check", s(&top)]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("chain index disagrees"), "{text}");
    let _ = opts;
}

/// A pending layer shorter than the disk hides everything below it past
/// its end (zeros, as QEMU reads it): building the top's index from an
/// older index must not copy the older index's entries there. Chain:
/// base (data everywhere) <- l1 (index written now: covers base) <- l2
/// (32 MiB) <- l3 (64 MiB; both made by qemu-img: no index) <- top (index
/// deferred).
#[test]
fn a_background_build_respects_a_shorter_pending_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = dir.join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "64M"]);
    qemu_io(&base, &["write -P 0x5a 0 64M".into()]);
    let l1 = dir.join("l1.qcow2");
    sqcow2(&["snapshot", "--index", "now", s(&base), s(&l1)]);
    let l2 = dir.join("l2.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "l1.qcow2",
        "-F",
        "qcow2",
        s(&l2),
        "32M",
    ]);
    let l3 = dir.join("l3.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "l2.qcow2",
        "-F",
        "qcow2",
        s(&l3),
        "64M",
    ]);
    // The top names an index that is not written yet (as after a live
    // snapshot): l1's index serves, l1, l2 and l3 pending.
    let top = dir.join("top.qcow2");
    sqcow2(&["snapshot", s(&l3), s(&top)]);
    match state(&top) {
        IndexState::Valid { pending, .. } => assert_eq!(pending, 3),
        other => panic!("{other:?}"),
    }
    assert_same_as_qemu(&top);
    {
        let chain = Chain::open(
            &top,
            &ChainOptions {
                writable: true,
                ..ChainOptions::default()
            },
        )
        .unwrap();
        let built = sqcow2_format::indexing::build_index(
            &chain,
            sqcow2_format::Locking::Auto,
            &mut |_, _| {},
            &|| false,
        )
        .unwrap();
        assert!(built.is_some());
        assert_eq!(chain.index().pending_layers(), 0);
        // Read through the index just installed, in this process.
        let mut buf = vec![0u8; 4096];
        chain.read_at(&mut buf, 48 * MIB).unwrap();
        assert!(
            buf.iter().all(|b| *b == 0),
            "past the shorter layer's end the disk reads zeros"
        );
    }
    match state(&top) {
        IndexState::Valid { pending, .. } => assert_eq!(pending, 0),
        other => panic!("{other:?}"),
    }
    assert_same_as_qemu(&top);
    qemu_check_all(&top);
}

/// A slice size that is not a power of two of at least 512 bytes (QEMU's
/// rule for its L2 cache entries) is refused: the slice arithmetic assumes
/// one, and with 1000 or 100 reads returned the base layer's data where
/// the top had its own (and copy-on-writes copied the wrong cluster).
/// Powers of two keep reading what QEMU reads.
#[test]
fn slice_sizes_that_are_not_powers_of_two_are_refused() {
    let (tmp, top) = fresh_chain();
    for bad in ["1000", "100", "24k", "0", "256"] {
        let out = Command::new(common::sqcow2_bin())
            .args(["--slice-size", bad, "map", s(&top)])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "--slice-size {bad}: {err}");
        assert!(err.contains("slice size"), "--slice-size {bad}: {err}");
        let opened = Chain::open(
            &top,
            &ChainOptions {
                slice_size: sqcow2_format::parse_size(bad).unwrap(),
                ..ChainOptions::default()
            },
        );
        assert!(opened.is_err(), "slice size {bad} opened");
    }
    for good in ["512", "8k", "64k", "2M"] {
        let raw = tmp.path().join("out.raw");
        sqcow2(&[
            "--slice-size",
            good,
            "convert",
            "-O",
            "raw",
            s(&top),
            s(&raw),
        ]);
        let theirs = tmp.path().join("theirs.raw");
        qemu_img(&["convert", "-O", "raw", s(&top), s(&theirs)]);
        assert!(
            std::fs::read(&raw).unwrap() == std::fs::read(&theirs).unwrap(),
            "--slice-size {good}"
        );
    }
}

/// A snapshot never writes through a symlink nor over a name that is
/// taken: a symlink where its temporary file goes (to a file of the
/// operator's) is refused and the file left alone, as is a dangling
/// symlink at the new top's name; a leftover regular temporary file is an
/// interrupted snapshot's and is replaced.
#[test]
fn snapshots_never_write_through_symlinks() {
    let (tmp, top) = fresh_chain();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let new = tmp.path().join("new.qcow2");
    std::os::unix::fs::symlink(&victim, tmp.path().join("new.qcow2.sqtmp")).unwrap();
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["snapshot", s(&top), s(&new)]));
    assert_eq!(
        out.status.code(),
        Some(1),
        "through a symlinked temporary file"
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(std::fs::symlink_metadata(&new).is_err());
    std::fs::remove_file(tmp.path().join("new.qcow2.sqtmp")).unwrap();

    let dangling = tmp.path().join("dangling.qcow2");
    std::os::unix::fs::symlink(tmp.path().join("nowhere.qcow2"), &dangling).unwrap();
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["snapshot", s(&top), s(&dangling)]));
    assert_eq!(out.status.code(), Some(1), "over a dangling symlink");
    assert!(!tmp.path().join("nowhere.qcow2").exists());

    // The index's temporary file too (the new top's index is built
    // later: here by `upgrade`).
    sqcow2(&["snapshot", s(&top), s(&new)]);
    std::os::unix::fs::symlink(&victim, tmp.path().join("new.qcow2.sqidx.tmp")).unwrap();
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["upgrade", s(&new)]));
    assert_eq!(out.status.code(), Some(1), "through a symlinked index file");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    std::fs::remove_file(tmp.path().join("new.qcow2.sqidx.tmp")).unwrap();
    sqcow2(&["upgrade", s(&new)]);
    assert_valid(&new);
    assert_same_as_qemu(&new);
}

/// An offline snapshot of a lone image defers the new top's index, which
/// nothing below can lend: until `serve` or `upgrade` writes it the short
/// chain is walked, which is no reason for a warning on every command.
#[test]
fn a_snapshot_of_a_lone_image_warns_of_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    common::qemu_create(&base, "", "8M");
    qemu_io(&base, &["write -P 0x21 1M 64k".into()]);
    let top = tmp.path().join("top.qcow2");
    sqcow2(&["snapshot", s(&base), s(&top)]);
    for args in [&["info", s(&top)][..], &["map", s(&top)][..]] {
        let out = run_raw(Command::new(common::sqcow2_bin()).args(args));
        assert!(out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("WARN"), "{args:?}: {stderr}");
    }
    assert_same_as_qemu(&top);
    sqcow2(&["upgrade", s(&top)]);
    assert_valid(&top);
}

/// An index extended from the one below (where the new layers leave a
/// chunk free, its entry is read from the old index, a slice at a time)
/// equals a walk of the chain, over a disk of many slices (256 MiB:
/// sixteen) with the new layers' clusters scattered across all of them,
/// and reads as QEMU reads the chain.
#[test]
fn an_extended_index_of_many_slices_equals_a_walk() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = GenOptions {
        layers: 3,
        size: 256 * MIB,
        cluster_size: 65536,
        fill: 0.3,
        seed: 43,
        distribution: Distribution::Uniform,
        index: true,
    };
    let mut top = generate(tmp.path(), &opts, &mut |_, _| {}).unwrap();
    for i in 0..3u64 {
        let new = tmp.path().join(format!("ext{i}.qcow2"));
        sqcow2(&["snapshot", "--index", "now", s(&top), s(&new)]);
        // Clusters in every slice, at offsets that differ per layer.
        let writes: Vec<String> = (0..40u64)
            .map(|k| {
                let at = k * (6 * MIB + 65536 * (i + 1)) % (256 * MIB);
                format!("write -P {} {at} 4k", 0x70 + i)
            })
            .collect();
        let mut args = vec!["io"];
        for w in &writes {
            args.extend(["-c", w.as_str()]);
        }
        args.push(s(&new));
        sqcow2(&args);
        top = new;
    }
    // The last snapshot's index covers the three written layers, each
    // extended from the index below.
    let last = tmp.path().join("last.qcow2");
    sqcow2(&["snapshot", "--index", "now", s(&top), s(&last)]);
    assert_valid(&last);
    let out = run_raw(Command::new(common::sqcow2_bin()).args(["check", s(&last)]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert_same_as_qemu(&last);
}
