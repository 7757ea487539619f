//! Persistent dirty bitmaps (issue 46), QEMU the oracle: bitmaps that
//! QEMU created and maintained (`qemu-img bitmap`, writes through
//! `qemu-io`) read back by sqcow2 as the granules those writes touched.

mod common;

use std::ops::Range;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{qemu_create, qemu_img, qemu_io, s};
use sqcow2_format::{describe_bitmaps, read_dirty_ranges, BitmapRead, Chain, ChainOptions};

/// Reads bitmap `name` of `image` through sqcow2.
fn try_read(image: &Path, name: &str) -> Result<BitmapRead, sqcow2_format::ErrorKind> {
    let chain = Chain::open(image, &ChainOptions::default()).unwrap();
    let top = chain.top();
    let header = top.header().expect("a qcow2 image");
    read_dirty_ranges(header, &**top.storage(), name)
}

/// [`try_read`], which must succeed.
fn read(image: &Path, name: &str) -> BitmapRead {
    try_read(image, name).unwrap()
}

/// The granules of `granularity` bytes that `writes` touch, within a
/// disk of `size` bytes, as merged ranges (what QEMU marks dirty).
fn touched(writes: &[(u64, u64)], granularity: u64, size: u64) -> Vec<Range<u64>> {
    let mut granules: Vec<u64> = writes
        .iter()
        .flat_map(|&(offset, len)| offset / granularity..(offset + len).div_ceil(granularity))
        .collect();
    granules.sort_unstable();
    granules.dedup();
    let mut out: Vec<Range<u64>> = Vec::new();
    for g in granules {
        let r = g * granularity..((g + 1) * granularity).min(size);
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

/// Bitmaps QEMU kept (enabled at 64 KiB and 512 B granularity, the
/// latter's data spanning many clusters; a disabled one) read back as
/// the granules QEMU's writes, write-zeroes and discards touched; the
/// disabled one clean.
#[test]
fn bitmaps_qemu_kept_read_as_the_granules_its_writes_touched() {
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("disk.qcow2");
    let size: u64 = 8 << 30;
    qemu_create(&image, "cluster_size=65536", "8G");
    qemu_img(&["bitmap", "--add", "-g", "65536", s(&image), "coarse"]);
    qemu_img(&["bitmap", "--add", "-g", "512", s(&image), "fine"]);
    qemu_img(&["bitmap", "--add", "--disable", s(&image), "off"]);
    let writes: Vec<(u64, u64)> = vec![
        (0, 4096),
        (70_000, 100),
        (1 << 30, 3 << 20),
        ((3 << 30) + 512 * 7, 512 * 3),
        (size - 512, 512),
    ];
    let mut cmds: Vec<String> = writes
        .iter()
        .enumerate()
        .map(|(i, (off, len))| match i {
            1 => format!("write -z {off} {len}"),
            _ => format!("write -P 0x5a {off} {len}"),
        })
        .collect();
    // A discard dirties too (QEMU: every write, write-zeroes, discard).
    let discard = ((5u64 << 30) + 65536, 131_072u64);
    cmds.push(format!("discard {} {}", discard.0, discard.1));
    qemu_io(&image, &cmds);
    let mut all = writes.clone();
    all.push(discard);

    let chain = Chain::open(&image, &ChainOptions::default()).unwrap();
    let infos = describe_bitmaps(chain.top().header().unwrap(), &**chain.top().storage()).unwrap();
    drop(chain);
    assert_eq!(infos.len(), 3, "{infos:?}");
    for (name, granularity) in [("coarse", 65536u64), ("fine", 512)] {
        let got = read(&image, name);
        assert_eq!(got.granularity, granularity, "{name}");
        assert!(got.enabled, "{name}");
        assert_eq!(
            got.dirty,
            Some(touched(&all, granularity, size)),
            "{name}: the dirty ranges QEMU recorded"
        );
    }
    let off = read(&image, "off");
    assert!(!off.enabled);
    assert_eq!(off.dirty, Some(Vec::new()), "a disabled bitmap changed");
}

/// A writer killed before it stored its bitmaps leaves them in use:
/// sqcow2 reads no bit of them (QEMU calls them inconsistent), lists
/// them with the `in-use` flag, and a bitmap of another name is an
/// input mistake.
#[test]
fn a_bitmap_left_in_use_by_a_killed_writer_reads_as_unusable() {
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("disk.qcow2");
    qemu_create(&image, "", "64M");
    qemu_img(&["bitmap", "--add", s(&image), "b0"]);
    let mut io = Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write 0 64k", "-c", "sleep 60000"])
        .arg(&image)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let shared = ChainOptions {
            force_share: true,
            ..ChainOptions::default()
        };
        let chain = Chain::open(&image, &shared)
            .unwrap_or_else(|e| panic!("open while qemu-io writes: {e}"));
        let top = chain.top();
        let infos = describe_bitmaps(top.header().unwrap(), &**top.storage()).unwrap();
        if infos[0].flags.contains(&"in-use") {
            break;
        }
        assert!(Instant::now() < deadline, "qemu-io never marked b0 in use");
        std::thread::sleep(Duration::from_millis(20));
    }
    io.kill().unwrap();
    io.wait().unwrap();
    let got = read(&image, "b0");
    assert_eq!(got.dirty, None, "bits of an in-use bitmap were read");
    let err = try_read(&image, "nope").unwrap_err();
    assert_eq!(err.to_string(), "Dirty bitmap 'nope' not found");
}

/// Where the bitmap directory of `image` is (offset in the file), read
/// from the header's bitmaps extension by hand.
fn directory_offset(image: &Path) -> u64 {
    let bytes = std::fs::read(image).unwrap();
    let be32 = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    let be64 = |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().unwrap());
    let mut at = be32(100) as usize;
    loop {
        let (kind, len) = (be32(at), be32(at + 4) as usize);
        assert_ne!(kind, 0, "no bitmaps extension");
        if kind == 0x2385_2875 {
            return be64(at + 8 + 16);
        }
        at += 8 + len.next_multiple_of(8);
    }
}

/// Malformed bitmaps (a table entry with a reserved bit, one pointing
/// at an unaligned cluster, a table too short for the disk, a table
/// past the end of the file): a clear error naming the bitmap, never a
/// panic or wrong bits.
#[test]
fn malformed_bitmap_tables_are_clear_errors() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let pristine = tmp.path().join("pristine.qcow2");
    qemu_create(&pristine, "cluster_size=65536", "1G");
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&pristine), "b0"]);
    qemu_io(&pristine, &["write 0 64k".to_string()]);
    let dir = directory_offset(&pristine);
    let file = std::fs::File::open(&pristine).unwrap();
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, dir).unwrap();
    let table = u64::from_be_bytes(word);
    file.read_exact_at(&mut word, table).unwrap();
    let entry = u64::from_be_bytes(word);
    assert_ne!(entry, 0, "the write left a data cluster");
    let file_len = file.metadata().unwrap().len();
    let cases: [(&str, u64, Vec<u8>); 4] = [
        ("reserved bit", table, (entry | 0x2).to_be_bytes().to_vec()),
        (
            "unaligned cluster",
            table,
            (entry + 512).to_be_bytes().to_vec(),
        ),
        ("table size", dir + 8, 7u32.to_be_bytes().to_vec()),
        (
            "table offset",
            dir,
            (file_len + (1 << 20))
                .next_multiple_of(65536)
                .to_be_bytes()
                .to_vec(),
        ),
    ];
    for (what, at, bytes) in cases {
        let image = tmp.path().join(format!("{}.qcow2", what.replace(' ', "-")));
        std::fs::copy(&pristine, &image).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&image)
            .unwrap();
        f.write_all_at(&bytes, at).unwrap();
        drop(f);
        let err = try_read(&image, "b0").expect_err(what).to_string();
        assert!(err.contains("bitmap 'b0'"), "{what}: {err}");
    }
}
