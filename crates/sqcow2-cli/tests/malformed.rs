//! Malformed images: every corruption gives its specific typed error from
//! the library and a clean one-line failure from the CLI, never a panic, a
//! hang or unbounded allocation.
//!
//! Valid images come from `qemu-img`/`qemu-io`; the tests then break one
//! thing in them.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{qemu_img, qemu_io, qemu_overlay, s, sqcow2_bin};
use sqcow2_format::{Chain, ChainOptions, ErrorKind, Feature, Table};

const MIB: u64 = 1 << 20;

// Header field offsets (qcow2 specification).
const VERSION: u64 = 4;
const BACKING_OFFSET: u64 = 8;
const BACKING_SIZE: u64 = 16;
const CLUSTER_BITS: u64 = 20;
const SIZE: u64 = 24;
const CRYPT_METHOD: u64 = 32;
const L1_SIZE: u64 = 36;
const L1_OFFSET: u64 = 40;
const REFTABLE_OFFSET: u64 = 48;
const REFTABLE_CLUSTERS: u64 = 56;
const NB_SNAPSHOTS: u64 = 60;
const SNAPSHOTS_OFFSET: u64 = 64;
const INCOMPATIBLE: u64 = 72;
const REFCOUNT_ORDER: u64 = 96;
const HEADER_LENGTH: u64 = 100;
const COMPRESSION_TYPE: u64 = 104;

fn patch(path: &Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

fn read_be64(path: &Path, offset: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).unwrap();
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, offset).unwrap();
    u64::from_be_bytes(b)
}

fn read_be32(path: &Path, offset: u64) -> u32 {
    (read_be64(path, offset) >> 32) as u32
}

fn set32(path: &Path, offset: u64, v: u32) {
    patch(path, offset, &v.to_be_bytes());
}

fn set64(path: &Path, offset: u64, v: u64) {
    patch(path, offset, &v.to_be_bytes());
}

/// A valid 16 MiB image with 64 KiB clusters and data in its first clusters.
fn image(dir: &Path, opts: &str) -> PathBuf {
    let p = dir.join("img.qcow2");
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([s(&p), "16M"]);
    qemu_img(&args);
    qemu_io(&p, &["write -P 0x5a 0 256k".into()]);
    p
}

/// Host offset of the first L2 table.
fn first_l2(path: &Path) -> u64 {
    let l1 = read_be64(path, L1_OFFSET);
    read_be64(path, l1) & 0x00ff_ffff_ffff_fe00
}

/// Offset of the header extension of type `ext` (its 8-byte header).
fn find_ext(path: &Path, ext: u32) -> u64 {
    let mut off = u64::from(read_be32(path, HEADER_LENGTH));
    loop {
        let t = read_be32(path, off);
        let len = u64::from(read_be32(path, off + 4));
        assert_ne!(t, 0, "extension {ext:#x} not found");
        if t == ext {
            return off;
        }
        off += 8 + len.div_ceil(8) * 8;
    }
}

/// A chain `base.qcow2 <- top.qcow2` in `dir`; returns the top.
fn two_layers(dir: &Path) -> PathBuf {
    let base = dir.join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "16M"]);
    let top = dir.join("top.qcow2");
    qemu_overlay(&top, "base.qcow2", "qcow2", &[], None);
    top
}

/// Opens and reads the whole chain, returning the first error.
fn first_error(top: &Path, options: &ChainOptions) -> sqcow2_format::Error {
    let chain = match Chain::open(top, options) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let size = chain.virtual_size();
    let mut buf = vec![0u8; MIB as usize];
    let mut pos = 0;
    while pos < size {
        let n = (size - pos).min(MIB);
        if let Err(e) = chain.read_at(&mut buf[..n as usize], pos) {
            return e;
        }
        pos += n;
    }
    panic!("{} opened and read without error", top.display());
}

/// Runs the CLI with a time limit; returns (exit code, stderr).
fn cli(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(sqcow2_bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sqcow2");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status.code(), err);
        }
        if Instant::now() > deadline {
            child.kill().ok();
            panic!("sqcow2 {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Checks the library error and the CLI's behaviour for a broken chain.
fn check(
    top: &Path,
    blamed: &str,
    max_layers: Option<usize>,
    expected: impl Fn(&ErrorKind) -> bool,
) {
    let mut options = ChainOptions::default();
    if let Some(m) = max_layers {
        options.max_layers = m;
    }
    let err = first_error(top, &options);
    assert!(expected(&err.kind), "unexpected error kind: {err:?}");
    assert_eq!(
        err.path.file_name().and_then(|n| n.to_str()),
        Some(blamed),
        "error names the wrong file: {err}"
    );
    let out = top.with_file_name("out.raw");
    let limit = max_layers.map(|m| m.to_string());
    let mut args = vec![];
    if let Some(l) = &limit {
        args.extend(["--max-layers", l.as_str()]);
    }
    args.extend(["convert", "-O", "raw", s(top), s(&out)]);
    let (code, stderr) = cli(&args);
    assert_eq!(code, Some(1), "exit code for {err}: stderr {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr}");
    assert!(lines[0].starts_with("sqcow2: "), "{stderr}");
    assert!(
        lines[0].contains(blamed),
        "line does not name {blamed}: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

macro_rules! malformed {
    ($name:ident, |$dir:ident| $setup:expr, $blamed:expr, $pat:pat $(if $guard:expr)?) => {
        malformed!($name, None, |$dir| $setup, $blamed, $pat $(if $guard)?);
    };
    ($name:ident, $limit:expr, |$dir:ident| $setup:expr, $blamed:expr, $pat:pat $(if $guard:expr)?) => {
        #[test]
        fn $name() {
            let tmp = tempfile::tempdir().unwrap();
            let $dir: &Path = tmp.path();
            let top: PathBuf = $setup;
            check(&top, $blamed, $limit, |k| matches!(k, $pat $(if $guard)?));
        }
    };
}

// ---- The header ----

malformed!(
    empty_file,
    |d| {
        let p = d.join("img.qcow2");
        std::fs::write(&p, []).unwrap();
        p
    },
    "img.qcow2",
    ErrorKind::Truncated { .. }
);

malformed!(
    truncated_header,
    |d| {
        let p = image(d, "");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..50]).unwrap();
        p
    },
    "img.qcow2",
    ErrorKind::Truncated { .. }
);

malformed!(
    truncated_v3_header,
    |d| {
        let p = image(d, "");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..90]).unwrap();
        p
    },
    "img.qcow2",
    ErrorKind::Truncated { .. }
);

malformed!(
    bad_magic,
    |d| {
        let p = image(d, "");
        patch(&p, 0, b"QFI\x00");
        p
    },
    "img.qcow2",
    ErrorKind::BadMagic(0x5146_4900)
);

malformed!(
    version_1,
    |d| {
        let p = image(d, "");
        set32(&p, VERSION, 1);
        p
    },
    "img.qcow2",
    ErrorKind::UnsupportedVersion(1)
);

malformed!(
    version_4,
    |d| {
        let p = image(d, "");
        set32(&p, VERSION, 4);
        p
    },
    "img.qcow2",
    ErrorKind::UnsupportedVersion(4)
);

malformed!(
    cluster_bits_too_small,
    |d| {
        let p = image(d, "");
        set32(&p, CLUSTER_BITS, 8);
        p
    },
    "img.qcow2",
    ErrorKind::ClusterBits(8)
);

malformed!(
    cluster_bits_too_large,
    |d| {
        let p = image(d, "");
        set32(&p, CLUSTER_BITS, 22);
        p
    },
    "img.qcow2",
    ErrorKind::ClusterBits(22)
);

malformed!(
    size_overflow,
    |d| {
        let p = image(d, "");
        set64(&p, SIZE, u64::MAX);
        p
    },
    "img.qcow2",
    ErrorKind::SizeTooLarge(u64::MAX)
);

malformed!(
    l1_too_small_for_size,
    |d| {
        let p = image(d, "");
        set64(&p, SIZE, 1 << 40);
        p
    },
    "img.qcow2",
    ErrorKind::L1TooSmall { l1_size: 1, .. }
);

malformed!(
    l1_size_too_large,
    |d| {
        let p = image(d, "");
        set32(&p, L1_SIZE, 0x1000_0000);
        p
    },
    "img.qcow2",
    ErrorKind::TableTooLarge {
        table: Table::L1,
        ..
    }
);

malformed!(
    l1_beyond_eof,
    |d| {
        let p = image(d, "");
        set64(&p, L1_OFFSET, 1 << 40);
        p
    },
    "img.qcow2",
    ErrorKind::TableBeyondEof {
        table: Table::L1,
        ..
    }
);

malformed!(
    l1_overlaps_header,
    |d| {
        let p = image(d, "");
        set64(&p, L1_OFFSET, 0);
        p
    },
    "img.qcow2",
    ErrorKind::TableOverlapsHeader {
        table: Table::L1,
        offset: 0
    }
);

malformed!(
    l1_unaligned,
    |d| {
        let p = image(d, "");
        let l1 = read_be64(&p, L1_OFFSET);
        set64(&p, L1_OFFSET, l1 + 8);
        p
    },
    "img.qcow2",
    ErrorKind::UnalignedTable {
        table: Table::L1,
        ..
    }
);

malformed!(
    refcount_table_beyond_eof,
    |d| {
        let p = image(d, "");
        set64(&p, REFTABLE_OFFSET, 1 << 40);
        p
    },
    "img.qcow2",
    ErrorKind::TableBeyondEof {
        table: Table::Refcount,
        ..
    }
);

malformed!(
    refcount_table_overlaps_header,
    |d| {
        let p = image(d, "");
        set64(&p, REFTABLE_OFFSET, 0);
        p
    },
    "img.qcow2",
    ErrorKind::TableOverlapsHeader {
        table: Table::Refcount,
        ..
    }
);

malformed!(
    refcount_table_unaligned,
    |d| {
        let p = image(d, "");
        let r = read_be64(&p, REFTABLE_OFFSET);
        set64(&p, REFTABLE_OFFSET, r + 512);
        p
    },
    "img.qcow2",
    ErrorKind::UnalignedTable {
        table: Table::Refcount,
        ..
    }
);

malformed!(
    refcount_table_missing,
    |d| {
        let p = image(d, "");
        set32(&p, REFTABLE_CLUSTERS, 0);
        p
    },
    "img.qcow2",
    ErrorKind::InvalidHeader {
        field: "refcount_table_clusters",
        ..
    }
);

malformed!(
    refcount_table_too_large,
    |d| {
        let p = image(d, "");
        set32(&p, REFTABLE_CLUSTERS, u32::MAX);
        p
    },
    "img.qcow2",
    ErrorKind::TableTooLarge {
        table: Table::Refcount,
        ..
    }
);

malformed!(
    refcount_order_too_large,
    |d| {
        let p = image(d, "");
        set32(&p, REFCOUNT_ORDER, 7);
        p
    },
    "img.qcow2",
    ErrorKind::InvalidHeader {
        field: "refcount_order",
        ..
    }
);

malformed!(
    header_length_too_short,
    |d| {
        let p = image(d, "");
        set32(&p, HEADER_LENGTH, 100);
        p
    },
    "img.qcow2",
    ErrorKind::InvalidHeader {
        field: "header_length",
        ..
    }
);

malformed!(
    header_length_beyond_cluster,
    |d| {
        let p = image(d, "");
        set32(&p, HEADER_LENGTH, 0x2_0000);
        p
    },
    "img.qcow2",
    ErrorKind::InvalidHeader {
        field: "header_length",
        ..
    }
);

malformed!(
    snapshot_table_too_large,
    |d| {
        let p = image(d, "");
        set32(&p, NB_SNAPSHOTS, 100_000);
        p
    },
    "img.qcow2",
    ErrorKind::TableTooLarge {
        table: Table::Snapshots,
        ..
    }
);

malformed!(
    snapshot_table_beyond_eof,
    |d| {
        let p = image(d, "");
        set32(&p, NB_SNAPSHOTS, 2);
        set64(&p, SNAPSHOTS_OFFSET, 1 << 40);
        p
    },
    "img.qcow2",
    ErrorKind::TableBeyondEof {
        table: Table::Snapshots,
        ..
    }
);

// ---- Features ----

malformed!(
    aes_encryption,
    |d| {
        let p = image(d, "");
        set32(&p, CRYPT_METHOD, 1);
        p
    },
    "img.qcow2",
    ErrorKind::Unsupported(Feature::AesEncryption)
);

malformed!(
    luks_encryption,
    |d| {
        let p = image(d, "");
        set32(&p, CRYPT_METHOD, 2);
        p
    },
    "img.qcow2",
    ErrorKind::Unsupported(Feature::LuksEncryption)
);

malformed!(
    unknown_encryption,
    |d| {
        let p = image(d, "");
        set32(&p, CRYPT_METHOD, 7);
        p
    },
    "img.qcow2",
    ErrorKind::Unsupported(Feature::UnknownEncryption(7))
);

malformed!(
    external_data_file,
    |d| {
        let p = image(d, "");
        set64(&p, INCOMPATIBLE, 1 << 2);
        p
    },
    "img.qcow2",
    ErrorKind::Unsupported(Feature::ExternalDataFile)
);

/// QEMU's corrupt mark: the image opens read-only (as QEMU's does; see
/// `header_features.rs`), never for writing.
#[test]
fn corrupt_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "");
    set64(&p, INCOMPATIBLE, 1 << 1);
    let writable = ChainOptions {
        writable: true,
        ..ChainOptions::default()
    };
    let Err(err) = Chain::open(&p, &writable) else {
        panic!("opened for writing");
    };
    assert!(
        matches!(err.kind, ErrorKind::Unsupported(Feature::CorruptBit)),
        "{err:?}"
    );
    assert!(Chain::open(&p, &ChainOptions::default()).is_ok());
}

malformed!(
    unknown_incompatible_bit,
    |d| {
        let p = image(d, "");
        set64(&p, INCOMPATIBLE, 1 << 10);
        p
    },
    "img.qcow2",
    ErrorKind::Unsupported(Feature::UnknownIncompatible {
        bit: 10,
        name: None
    })
);

malformed!(unknown_incompatible_bit_named_by_table, |d| {
    let p = image(d, "");
    // Rename the table's first entry (incompatible bit 0, "dirty bit") to
    // bit 9 and set bit 9: the error carries the table's name for it.
    let table = find_ext(&p, 0x6803_f857) + 8;
    patch(&p, table + 1, &[9]);
    set64(&p, INCOMPATIBLE, 1 << 9);
    p
}, "img.qcow2", ErrorKind::Unsupported(Feature::UnknownIncompatible { bit: 9, name: Some(n) }) if n == "dirty bit");

malformed!(
    unknown_compression_type,
    |d| {
        let p = image(d, "");
        set64(&p, INCOMPATIBLE, 1 << 3);
        patch(&p, COMPRESSION_TYPE, &[2]);
        p
    },
    "img.qcow2",
    ErrorKind::Unsupported(Feature::UnknownCompressionType(2))
);

malformed!(
    zstd_without_feature_bit,
    |d| {
        let p = image(d, "");
        patch(&p, COMPRESSION_TYPE, &[1]);
        p
    },
    "img.qcow2",
    ErrorKind::InvalidHeader {
        field: "incompatible_features",
        ..
    }
);

malformed!(
    extended_l2_with_small_clusters,
    |d| {
        let p = image(d, "cluster_size=4096");
        set64(&p, INCOMPATIBLE, 1 << 4);
        p
    },
    "img.qcow2",
    ErrorKind::InvalidHeader {
        field: "incompatible_features",
        ..
    }
);

// ---- Header extensions and the backing file name ----

malformed!(
    extension_too_large,
    |d| {
        let p = image(d, "");
        let ext = find_ext(&p, 0x6803_f857);
        set32(&p, ext + 4, 0x00ff_ffff);
        p
    },
    "img.qcow2",
    ErrorKind::InvalidExtension { .. }
);

malformed!(
    backing_format_extension_too_long,
    |d| {
        let top = two_layers(d);
        let ext = find_ext(&top, 0xe279_2aca);
        set32(&top, ext + 4, 40);
        top
    },
    "top.qcow2",
    ErrorKind::InvalidExtension {
        ext_type: 0xe279_2aca,
        ..
    }
);

malformed!(
    backing_name_too_long,
    |d| {
        let top = two_layers(d);
        set32(&top, BACKING_SIZE, 2000);
        top
    },
    "top.qcow2",
    ErrorKind::InvalidBackingName(_)
);

malformed!(
    backing_name_beyond_cluster,
    |d| {
        let top = two_layers(d);
        set64(&top, BACKING_OFFSET, 0x2_0000);
        top
    },
    "top.qcow2",
    ErrorKind::InvalidBackingName(_)
);

// ---- Chains ----

malformed!(backing_loop, |d| {
    let a = d.join("a.qcow2");
    let b = d.join("b.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&b), "16M"]);
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "b.qcow2", "-F", "qcow2", s(&a)]);
    qemu_img(&["rebase", "-u", "-b", "a.qcow2", "-F", "qcow2", s(&b)]);
    a
}, "b.qcow2", ErrorKind::BackingLoop(p) if p.ends_with("a.qcow2"));

malformed!(
    backing_self_loop,
    |d| {
        let a = d.join("a.qcow2");
        qemu_img(&["create", "-q", "-f", "qcow2", s(&a), "16M"]);
        qemu_img(&["rebase", "-u", "-b", "a.qcow2", "-F", "qcow2", s(&a)]);
        a
    },
    "a.qcow2",
    ErrorKind::BackingLoop(_)
);

malformed!(
    chain_deeper_than_limit,
    Some(3),
    |d| {
        let mut prev = d.join("l0.qcow2");
        qemu_img(&["create", "-q", "-f", "qcow2", s(&prev), "16M"]);
        for i in 1..5 {
            let p = d.join(format!("l{i}.qcow2"));
            let b = prev.file_name().unwrap().to_str().unwrap().to_owned();
            qemu_overlay(&p, &b, "qcow2", &[], None);
            prev = p;
        }
        prev
    },
    "l2.qcow2",
    ErrorKind::ChainTooDeep { limit: 3 }
);

malformed!(
    missing_backing_file,
    |d| {
        let top = two_layers(d);
        std::fs::remove_file(d.join("base.qcow2")).unwrap();
        top
    },
    "top.qcow2",
    ErrorKind::MissingBacking { .. }
);

malformed!(unsupported_backing_format, |d| {
    let top = two_layers(d);
    let ext = find_ext(&top, 0xe279_2aca);
    patch(&top, ext + 8, b"vpc\0\0");
    top
}, "top.qcow2", ErrorKind::UnsupportedBackingFormat(f) if f == "vpc");

malformed!(raw_backing_never_guessed, |d| {
    let base = d.join("base.raw");
    std::fs::write(&base, vec![7u8; 65536]).unwrap();
    let top = d.join("top.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", s(&top), "1M"]);
    // Forget the recorded format: the extension becomes an unknown one.
    let ext = find_ext(&top, 0xe279_2aca);
    set32(&top, ext, 0x1234_5678);
    top
}, "top.qcow2", ErrorKind::UnknownBackingFormat(p) if p.ends_with("base.raw"));

malformed!(backing_recorded_qcow2_is_raw, |d| {
    let base = d.join("base.raw");
    std::fs::write(&base, vec![7u8; 65536]).unwrap();
    let top = d.join("top.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", s(&top), "1M"]);
    let ext = find_ext(&top, 0xe279_2aca);
    patch(&top, ext + 4, &[0, 0, 0, 5, b'q', b'c', b'o', b'w', b'2']);
    top
}, "top.qcow2", ErrorKind::BackingNotQcow2(p) if p.ends_with("base.raw"));

malformed!(
    backing_with_protocol,
    |d| {
        let top = two_layers(d);
        let off = read_be64(&top, BACKING_OFFSET);
        patch(&top, off, b"nbd:base.q");
        top
    },
    "top.qcow2",
    ErrorKind::BackingProtocol(_)
);

// ---- Tables reached by reads ----

malformed!(
    l2_table_beyond_eof,
    |d| {
        let p = image(d, "");
        let l1 = read_be64(&p, L1_OFFSET);
        set64(&p, l1, (1 << 63) | (1 << 40));
        p
    },
    "img.qcow2",
    ErrorKind::TableBeyondEof {
        table: Table::L2,
        ..
    }
);

malformed!(
    l2_table_unaligned,
    |d| {
        let p = image(d, "");
        let l1 = read_be64(&p, L1_OFFSET);
        let l2 = first_l2(&p);
        set64(&p, l1, (1 << 63) | (l2 + 512));
        p
    },
    "img.qcow2",
    ErrorKind::UnalignedTable {
        table: Table::L2,
        ..
    }
);

malformed!(
    data_cluster_unaligned,
    |d| {
        let p = image(d, "");
        let l2 = first_l2(&p);
        let e = read_be64(&p, l2);
        set64(&p, l2, e + 512);
        p
    },
    "img.qcow2",
    ErrorKind::UnalignedCluster {
        guest_offset: 0,
        ..
    }
);

malformed!(
    compressed_descriptor_beyond_eof,
    |d| {
        let p = d.join("img.qcow2");
        qemu_img(&["create", "-q", "-f", "qcow2", s(&p), "16M"]);
        qemu_io(&p, &["write -c -P 0x5a 0 64k".into()]);
        let l2 = first_l2(&p);
        let e = read_be64(&p, l2);
        // Keep the sector count, move the offset (bits 0..54) far away.
        set64(&p, l2, (e & !((1u64 << 54) - 1)) | (1 << 50));
        p
    },
    "img.qcow2",
    ErrorKind::CompressedBeyondEof { .. }
);

malformed!(
    compressed_data_garbage,
    |d| {
        let p = d.join("img.qcow2");
        qemu_img(&["create", "-q", "-f", "qcow2", s(&p), "16M"]);
        qemu_io(&p, &["write -c -P 0x5a 0 64k".into()]);
        let l2 = first_l2(&p);
        let host = read_be64(&p, l2) & ((1u64 << 54) - 1);
        patch(&p, host, &[0xff; 64]);
        p
    },
    "img.qcow2",
    ErrorKind::Decompression {
        algorithm: "deflate",
        ..
    }
);

malformed!(
    zstd_data_garbage,
    |d| {
        let p = d.join("img.qcow2");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "compression_type=zstd",
            s(&p),
            "16M",
        ]);
        qemu_io(&p, &["write -c -P 0x5a 0 64k".into()]);
        let l2 = first_l2(&p);
        let host = read_be64(&p, l2) & ((1u64 << 54) - 1);
        patch(&p, host, &[0x00; 16]);
        p
    },
    "img.qcow2",
    ErrorKind::Decompression {
        algorithm: "zstd",
        ..
    }
);

malformed!(
    subcluster_bitmap_contradiction,
    |d| {
        let p = image(d, "extended_l2=on");
        let l2 = first_l2(&p);
        // Subcluster 0 both allocated and reading as zeros.
        let bitmap = read_be64(&p, l2 + 8);
        set64(&p, l2 + 8, bitmap | (1 << 32) | 1);
        p
    },
    "img.qcow2",
    ErrorKind::InvalidSubclusterBitmap { .. }
);

/// `info` fails as cleanly as `convert`: one line, exit 1.
#[test]
fn info_reports_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let p = image(tmp.path(), "");
    set32(&p, VERSION, 9);
    for output in ["human", "json"] {
        let (code, stderr) = cli(&["info", "--output", output, s(&p)]);
        assert_eq!(code, Some(1));
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains("img.qcow2") && stderr.contains("version 9"),
            "{stderr}"
        );
    }
    let (code, stderr) = cli(&["map", s(&tmp.path().join("nonexistent.qcow2"))]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("nonexistent.qcow2"), "{stderr}");
}

malformed!(
    not_qcow2_at_all,
    |d| {
        let p = d.join("img.qcow2");
        std::fs::write(&p, vec![0xffu8; 65536]).unwrap();
        p
    },
    "img.qcow2",
    ErrorKind::BadMagic(0xffff_ffff)
);

#[test]
fn l1_tables_of_a_chain_are_bounded_together() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // 8 TiB disks with 64 KiB clusters: 128 KiB of L1 per layer.
    let mut prev = d.join("l0.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&prev), "8T"]);
    for i in 1..4 {
        let p = d.join(format!("l{i}.qcow2"));
        let b = prev.file_name().unwrap().to_str().unwrap().to_owned();
        qemu_overlay(&p, &b, "qcow2", &[], None);
        prev = p;
    }
    let tight = ChainOptions {
        max_l1_bytes_total: 300 << 10,
        ..ChainOptions::default()
    };
    let err = first_error(&prev, &tight);
    assert!(
        matches!(
            err.kind,
            ErrorKind::ChainMetadataTooLarge {
                bytes: 393216,
                limit: 307200
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.path.file_name().and_then(|n| n.to_str()),
        Some("l1.qcow2")
    );
    Chain::open(&prev, &ChainOptions::default()).expect("within the default bound");
}
