//! Header features and extensions that must not stop a read: persistent
//! bitmaps, internal snapshots, the dirty bit, unknown extensions and
//! unknown compatible/autoclear bits. Each image still reads as QEMU reads
//! it, and `info` reports what is there.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{assert_full_map_equal, assert_same_as_qemu, qemu_img, qemu_io, run, s, sqcow2};
use sqcow2_format::HeaderExtension;
use sqcow2_format::{Chain, ChainOptions};

fn image(dir: &Path, opts: &str) -> PathBuf {
    let p = dir.join("img.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", "-o", opts, s(&p), "8M"]);
    qemu_io(
        &p,
        &["write -P 0x42 0 1M".into(), "write -P 0x43 3M 100k".into()],
    );
    p
}

fn info_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&sqcow2(&["info", "--output", "json", s(p)])).unwrap()
}

/// The exit code of `program args`.
fn exit_code(program: &Path, args: &[&str]) -> Option<i32> {
    common::run_raw(Command::new(program).args(args))
        .status
        .code()
}

#[test]
fn persistent_bitmap() {
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "cluster_size=65536");
    qemu_img(&["bitmap", "--add", s(&p), "b0"]);
    assert_same_as_qemu(&p);
    let info = info_json(&p);
    assert_eq!(info["format-specific"]["data"]["has-bitmaps"], true);
    let chain = Chain::open(&p, &ChainOptions::default()).unwrap();
    assert!(chain.top().header().unwrap().has_bitmaps());
}

#[test]
fn internal_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "cluster_size=4096");
    qemu_img(&["snapshot", "-c", "snap1", s(&p)]);
    // The active state diverges from the snapshot: reads follow the active L1.
    qemu_io(&p, &["write -P 0x99 0 64k".into(), "write -z 3M 4k".into()]);
    assert_same_as_qemu(&p);
    assert_full_map_equal(&p);
    assert_eq!(
        info_json(&p)["format-specific"]["data"]["internal-snapshots"],
        1
    );
}

#[test]
fn dirty_image_with_lazy_refcounts() {
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "lazy_refcounts=on");
    // `abort` kills qemu-io without closing the image: the dirty bit stays.
    let out = Command::new("qemu-io")
        .args([
            "-f",
            "qcow2",
            "-c",
            "write -P 0x77 2M 64k",
            "-c",
            "abort",
            s(&p),
        ])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "qemu-io abort should not exit cleanly"
    );
    let info = info_json(&p);
    assert_eq!(info["dirty-flag"], true, "{info}");
    assert_eq!(info["format-specific"]["data"]["lazy-refcounts"], true);
    assert_same_as_qemu(&p);
}

/// Writes an unknown header extension after the existing ones.
fn inject_extension(p: &Path, ext_type: u32, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap();
    let mut hdr = vec![0u8; 4096];
    f.read_exact_at(&mut hdr, 0).unwrap();
    let be32 = |at: usize| u32::from_be_bytes(hdr[at..at + 4].try_into().unwrap());
    let mut off = be32(100) as usize;
    while be32(off) != 0 {
        off += 8 + (be32(off + 4) as usize).div_ceil(8) * 8;
    }
    let mut ext = Vec::new();
    ext.extend_from_slice(&ext_type.to_be_bytes());
    ext.extend_from_slice(&(data.len() as u32).to_be_bytes());
    ext.extend_from_slice(data);
    ext.resize(8 + data.len().div_ceil(8) * 8, 0);
    ext.extend_from_slice(&[0u8; 8]);
    f.write_all_at(&ext, off as u64).unwrap();
}

#[test]
fn unknown_extension_is_kept_verbatim() {
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "cluster_size=65536");
    inject_extension(&p, 0x5eed_c0de, b"hello");
    let chain = Chain::open(&p, &ChainOptions::default()).unwrap();
    let kept = chain.top().header().unwrap().extensions.iter().any(|e| {
        matches!(e, HeaderExtension::Unknown { ext_type: 0x5eed_c0de, data } if data == b"hello")
    });
    assert!(kept, "unknown extension not kept");
    assert_eq!(
        info_json(&p)["format-specific"]["data"]["unknown-extensions"][0],
        "0x5eedc0de"
    );
    // QEMU still reads the image, and so do we, identically.
    assert_same_as_qemu(&p);
    assert!(run(Command::new("qemu-img").args(["info", s(&p)])).contains("file format: qcow2"));
}

#[test]
fn unknown_compatible_and_autoclear_bits_are_ignored() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "cluster_size=65536");
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&(1u64 << 40).to_be_bytes(), 80).unwrap();
    f.write_all_at(&(1u64 << 63).to_be_bytes(), 88).unwrap();
    drop(f);
    assert_same_as_qemu(&p);
    let info = info_json(&p);
    let features = info["format-specific"]["data"]["features"]
        .as_array()
        .unwrap();
    let bits: Vec<(String, u64)> = features
        .iter()
        .map(|f| {
            (
                f["kind"].as_str().unwrap().to_owned(),
                f["bit"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(bits.contains(&("compatible".into(), 40)), "{bits:?}");
    assert!(bits.contains(&("autoclear".into(), 63)), "{bits:?}");
}

/// The data-file-raw autoclear bit without an external data file: QEMU
/// refuses to open the image for I/O ("data-file-raw requires a data
/// file"), and so does sqcow2.
#[test]
fn data_file_raw_without_a_data_file_is_refused_as_qemu_refuses_it() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "cluster_size=65536");
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&(1u64 << 1).to_be_bytes(), 88).unwrap();
    drop(f);
    let qemu = Command::new("qemu-io")
        .args(["-r", "-c", "read 0 512", s(&p)])
        .output()
        .unwrap();
    let qemu_err = String::from_utf8_lossy(&qemu.stderr);
    assert!(
        qemu_err.contains("data-file-raw requires a data file"),
        "{qemu_err}"
    );
    let err = Chain::open(&p, &ChainOptions::default()).unwrap_err();
    assert!(
        err.to_string()
            .contains("data-file-raw requires a data file"),
        "{err}"
    );
}

/// `info --output json` is shaped as qemu-img's: `format-specific` is
/// `{type, data}` with QEMU's fields (v3-only ones on v3 images only), and
/// `snapshots` lists the internal snapshots as QEMU does.
#[test]
fn info_json_has_qemus_shape() {
    let tmp = tempfile::tempdir().unwrap();
    for opts in [
        "compat=0.10",
        "compat=1.1,extended_l2=on",
        "lazy_refcounts=on",
    ] {
        let p = image(tmp.path(), opts);
        qemu_img(&["snapshot", "-c", "first", s(&p)]);
        qemu_img(&["snapshot", "-c", "second one", s(&p)]);
        let ours = info_json(&p);
        let theirs: serde_json::Value =
            serde_json::from_str(&qemu_img(&["info", "--output", "json", s(&p)])).unwrap();
        assert_eq!(ours["snapshots"], theirs["snapshots"], "{opts}");
        assert_eq!(
            ours["format-specific"]["type"],
            theirs["format-specific"]["type"]
        );
        let (ours, theirs) = (
            ours["format-specific"]["data"].as_object().unwrap(),
            theirs["format-specific"]["data"].as_object().unwrap(),
        );
        for (k, v) in theirs {
            assert_eq!(ours.get(k), Some(v), "{opts}: format-specific {k}");
        }
        std::fs::remove_file(&p).unwrap();
    }
}

/// Human `info` lists the internal snapshots as `qemu-img info` does: the
/// same "Snapshot list:" section, line for line.
#[test]
fn info_lists_internal_snapshots_as_qemu_img() {
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "cluster_size=65536");
    qemu_img(&["snapshot", "-c", "first", s(&p)]);
    qemu_io(&p, &["write -P 0x55 0 64k".into()]);
    qemu_img(&["snapshot", "-c", "a longer name than sixteen", s(&p)]);
    let section = |text: &str| -> Vec<String> {
        text.lines()
            .skip_while(|l| *l != "Snapshot list:")
            .take_while(|l| !l.starts_with("Format specific information:"))
            .map(str::to_owned)
            .collect()
    };
    let theirs = section(&qemu_img(&["info", s(&p)]));
    let ours = section(&sqcow2(&["info", s(&p)]));
    assert_eq!(theirs.len(), 4, "{theirs:#?}");
    assert_eq!(ours, theirs);
}

/// A backing file that cannot be opened: `info` shows the image itself
/// (exit 0, its header's fields as `qemu-img info` shows them; qemu-img
/// does not open the backing chain for it), `check` fails as `qemu-img
/// check` fails (exit 1: the chain cannot be opened), before any repair.
#[test]
fn a_missing_backing_file_is_met_as_qemu_img_meets_it() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "8M"]);
    let top = tmp.path().join("top.qcow2");
    common::qemu_overlay(&top, "base.qcow2", "qcow2", &[], None);
    qemu_io(&top, &["write -P 0x42 0 64k".into()]);
    std::fs::remove_file(&base).unwrap();
    let exit = |program: &Path, args: &[&str]| {
        let out = common::run_raw(Command::new(program).args(args));
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (qemu, ours) = (Path::new("qemu-img"), common::sqcow2_bin());
    let (qc, theirs) = exit(qemu, &["info", "--output", "json", s(&top)]);
    let (oc, mine) = exit(&ours, &["info", "--output", "json", s(&top)]);
    assert_eq!((oc, qc), (Some(0), Some(0)), "info: {mine}");
    let (mine, theirs): (serde_json::Value, serde_json::Value) = (
        serde_json::from_str(&mine).unwrap(),
        serde_json::from_str(&theirs).unwrap(),
    );
    for k in [
        "virtual-size",
        "cluster-size",
        "backing-filename",
        "backing-filename-format",
        "format",
    ] {
        assert_eq!(mine[k], theirs[k], "info {k}");
    }
    assert_eq!(exit(&ours, &["info", s(&top)]).0, Some(0));
    for args in [
        &["check", s(&top)][..],
        &["check", "-r", "all", s(&top)][..],
    ] {
        let before = std::fs::read(&top).unwrap();
        assert_eq!(exit(&ours, args).0, exit(qemu, args).0, "{args:?}");
        assert_eq!(exit(qemu, args).0, Some(1), "{args:?}");
        assert_eq!(
            std::fs::read(&top).unwrap(),
            before,
            "{args:?} changed the image"
        );
    }
}

/// Sets QEMU's "corrupt" mark (incompatible feature bit 1) on `p`.
fn mark_corrupt(p: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap();
    let mut word = [0u8; 8];
    f.read_exact_at(&mut word, 72).unwrap();
    let bits = u64::from_be_bytes(word) | 2;
    f.write_all_at(&bits.to_be_bytes(), 72).unwrap();
}

fn incompatible_bits(p: &Path) -> u64 {
    let b = std::fs::read(p).unwrap();
    u64::from_be_bytes(b[72..80].try_into().unwrap())
}

/// An image QEMU marked corrupt opens read-only as in QEMU: `info` says
/// so, `map` and `convert` read QEMU's extents and bytes, also as a
/// backing file; nothing writes it (`io`, `upgrade`), as QEMU opens it
/// read/write only to repair it; `check` reports as `qemu-img check`, and
/// `check -r all` repairs it and clears the mark as QEMU's does.
#[test]
fn an_image_marked_corrupt_reads_as_in_qemu_and_is_written_by_repair_only() {
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "compat=1.1");
    mark_corrupt(&p);
    let info = info_json(&p);
    let theirs: serde_json::Value =
        serde_json::from_str(&qemu_img(&["info", "--output", "json", s(&p)])).unwrap();
    assert_eq!(info["format-specific"]["data"]["corrupt"], true);
    assert_eq!(theirs["format-specific"]["data"]["corrupt"], true);
    assert_full_map_equal(&p);
    assert_same_as_qemu(&p);
    // As a backing file (read-only), under an overlay.
    let top = tmp.path().join("top.qcow2");
    common::qemu_overlay(&top, "img.qcow2", "qcow2", &[], None);
    qemu_io(&top, &["write -P 0x55 64k 64k".into()]);
    assert_same_as_qemu(&top);

    let before = std::fs::read(&p).unwrap();
    let status = exit_code;
    let ours = common::sqcow2_bin();
    assert_ne!(
        status(&ours, &["io", "-c", "write -P 1 0 4k", s(&p)]),
        Some(0)
    );
    assert_ne!(
        status(Path::new("qemu-io"), &["-c", "write -P 1 0 4k", s(&p)]),
        Some(0)
    );
    assert_ne!(status(&ours, &["upgrade", s(&top)]), Some(0));
    assert_eq!(std::fs::read(&p).unwrap(), before, "the image was written");

    assert_eq!(
        status(&ours, &["check", s(&p)]),
        status(Path::new("qemu-img"), &["check", s(&p)])
    );
    let theirs_repaired = tmp.path().join("qemu-repaired.qcow2");
    std::fs::copy(&p, &theirs_repaired).unwrap();
    assert_eq!(
        status(&ours, &["check", "-r", "all", s(&p)]),
        status(
            Path::new("qemu-img"),
            &["check", "-r", "all", s(&theirs_repaired)]
        )
    );
    assert_eq!(incompatible_bits(&p), incompatible_bits(&theirs_repaired));
    assert_eq!(incompatible_bits(&p) & 2, 0, "the mark stayed");
    assert_eq!(
        status(&ours, &["io", "-c", "write -P 1 0 4k", s(&p)]),
        Some(0)
    );
    common::assert_check_clean(&p);
}

/// `info` lists persistent bitmaps as `qemu-img info` does: name,
/// granularity and flags in JSON (`format-specific.data.bitmaps`, absent
/// without bitmaps) and its "bitmaps:" block in the human output.
#[test]
fn info_lists_bitmaps_as_qemu_img() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("bm.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&p), "10M"]);
    let none = info_json(&p);
    assert!(none["format-specific"]["data"].get("bitmaps").is_none());
    qemu_img(&["bitmap", "--add", s(&p), "first"]);
    qemu_img(&["bitmap", "--add", "-g", "131072", s(&p), "a longer name"]);
    qemu_img(&["bitmap", "--add", "--disable", s(&p), "disabled"]);
    let ours = info_json(&p);
    let theirs: serde_json::Value =
        serde_json::from_str(&qemu_img(&["info", "--output", "json", s(&p)])).unwrap();
    let bitmaps = &theirs["format-specific"]["data"]["bitmaps"];
    assert_eq!(bitmaps.as_array().map(Vec::len), Some(3), "{theirs}");
    assert_eq!(&ours["format-specific"]["data"]["bitmaps"], bitmaps);
    let block = |out: &str| -> Vec<String> {
        out.lines()
            .skip_while(|l| l.trim() != "bitmaps:")
            .take_while(|l| l.starts_with("        ") || l.trim() == "bitmaps:")
            .map(str::to_owned)
            .collect()
    };
    let (mine, qemu) = (
        block(&sqcow2(&["info", s(&p)])),
        block(&qemu_img(&["info", s(&p)])),
    );
    assert!(qemu.len() > 10, "{qemu:?}");
    assert_eq!(mine, qemu);
}

/// `info --backing-chain --output json` has qemu-img's fields for every
/// layer of a chain over a raw base (the raw layer's `dirty-flag` too).
#[test]
fn info_of_a_chain_over_a_raw_base_has_qemus_fields() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.raw");
    qemu_img(&["create", "-q", "-f", "raw", s(&base), "4M"]);
    let top = tmp.path().join("top.qcow2");
    common::qemu_overlay(&top, "base.raw", "raw", &[], None);
    let chain = |out: String| -> Vec<serde_json::Value> { serde_json::from_str(&out).unwrap() };
    let ours = chain(sqcow2(&[
        "info",
        "--backing-chain",
        "--output",
        "json",
        s(&top),
    ]));
    let theirs = chain(qemu_img(&[
        "info",
        "--backing-chain",
        "--output",
        "json",
        s(&top),
    ]));
    assert_eq!(ours.len(), theirs.len());
    for (o, t) in ours.iter().zip(&theirs) {
        for k in [
            "filename",
            "format",
            "virtual-size",
            "dirty-flag",
            "backing-filename",
            "backing-filename-format",
        ] {
            assert_eq!(o.get(k), t.get(k), "{k} of {}", t["filename"]);
        }
    }
}

/// Sets bits in the big-endian word at `offset` of the file `p`.
fn set_word_bits(p: &Path, offset: u64, bits: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap();
    let mut word = [0u8; 8];
    f.read_exact_at(&mut word, offset).unwrap();
    f.write_all_at(&(u64::from_be_bytes(word) | bits).to_be_bytes(), offset)
        .unwrap();
}

/// No command writes into an image marked corrupt, nor leaves work done
/// before refusing it: a writable open of a chain whose corrupt backing
/// layer carries a journal (which would be repaired), a commit of a
/// corrupt top, an upgrade over a corrupt lower layer, a merge under a
/// corrupt layer above. (Review findings of the first version.)
#[test]
fn nothing_writes_into_an_image_marked_corrupt() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let names = ["a.qcow2", "b.qcow2", "c.qcow2"];
    for (i, name) in names.iter().enumerate() {
        let p = dir.join(name);
        if i == 0 {
            common::qemu_create(&p, "", "8M");
        } else {
            common::qemu_overlay(&p, names[i - 1], "qcow2", &[], None);
        }
        qemu_io(&p, &[format!("write -P {} {}M 64k", i + 1, i)]);
    }
    let files = || -> Vec<Vec<u8>> {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        entries.iter().map(|p| std::fs::read(p).unwrap()).collect()
    };
    let fails = |args: &[&str], what: &str| {
        let before = files();
        let out = common::run_raw(
            Command::new(common::sqcow2_bin())
                .current_dir(dir)
                .args(args),
        );
        assert!(!out.status.success(), "{what}: succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("marked corrupt"), "{what}: {stderr}");
        assert!(files() == before, "{what}: files changed");
    };
    // The middle layer corrupt, with the journal bit of a writer that died.
    let b = dir.join("b.qcow2");
    mark_corrupt(&b);
    set_word_bits(&b, 88, 1 << 62);
    fails(
        &["io", "-c", "write -P 9 0 4k", "c.qcow2"],
        "a write over it",
    );
    fails(&["upgrade", "c.qcow2"], "upgrade over it");
    fails(
        &["merge", "c.qcow2", "a.qcow2", "a.qcow2", "m.qcow2"],
        "merge under it",
    );
    // The top corrupt.
    let c = dir.join("c.qcow2");
    mark_corrupt(&c);
    fails(&["commit", "-d", "c.qcow2"], "commit -d of it");
    fails(&["commit", "c.qcow2"], "commit of it");
}

/// A bitmap directory QEMU refuses (an entry of an unknown type) makes
/// `info` fail as `qemu-img info` fails, not list what it cannot read.
#[test]
fn a_broken_bitmap_directory_fails_info_as_in_qemu() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("bm.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&p), "10M"]);
    qemu_img(&["bitmap", "--add", s(&p), "uniquename"]);
    let bytes = std::fs::read(&p).unwrap();
    let name_at = bytes
        .windows(10)
        .position(|w| w == b"uniquename")
        .expect("the bitmap's name in the directory") as u64;
    // The entry's type byte: 24 bytes of fixed fields before the name
    // (no extra data), the type at 16 of them.
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&[2], name_at - 24 + 16).unwrap();
    let status = |program: &Path| exit_code(program, &["info", "--output", "json", s(&p)]);
    assert_ne!(status(Path::new("qemu-img")), Some(0));
    assert_eq!(status(&common::sqcow2_bin()), Some(1));
}

/// A backing file of the wrong format (a raw file recorded as qcow2):
/// `info` shows the image, `check` fails, as qemu-img's do.
#[test]
fn an_unusable_backing_file_is_met_as_qemu_img_meets_it() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.img");
    std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
    let top = tmp.path().join("top.qcow2");
    common::qemu_overlay(&top, "base.img", "qcow2", &["-u"], Some("1M"));
    let code = exit_code;
    let ours = common::sqcow2_bin();
    for args in [&["info", s(&top)][..], &["check", s(&top)][..]] {
        assert_eq!(
            code(&ours, args),
            code(Path::new("qemu-img"), args),
            "{args:?}"
        );
    }
    assert_eq!(code(&ours, &["check", s(&top)]), Some(1));
}
