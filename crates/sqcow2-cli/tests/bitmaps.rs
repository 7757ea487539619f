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

/// `sqcow2 io -c CMD...` on `image`, which must succeed (the commands
/// as qemu-io takes them).
fn sqcow2_io(image: &Path, cmds: &[String]) {
    let mut io = vec!["io"];
    for c in cmds {
        io.extend(["-c", c.as_str()]);
    }
    io.push(s(image));
    common::sqcow2(&io);
}

/// The same qemu-io commands through `sqcow2 io` on `ours` and through
/// qemu-io on `theirs`.
fn io_both(ours: &Path, theirs: &Path, cmds: &[&str]) {
    let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
    sqcow2_io(ours, &cmds);
    qemu_io(theirs, &cmds);
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
        // (Empty while qemu-io has the bitmaps' autoclear bit cleared,
        // rewriting the directory in place.)
        if infos.first().is_some_and(|i| i.flags.contains(&"in-use")) {
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

/// Where the header's bitmaps extension of `image` is (its type word),
/// found by hand.
fn bitmaps_extension_at(image: &Path) -> usize {
    let bytes = std::fs::read(image).unwrap();
    let be32 = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    let mut at = be32(100) as usize;
    loop {
        let (kind, len) = (be32(at), be32(at + 4) as usize);
        assert_ne!(kind, 0, "no bitmaps extension");
        if kind == 0x2385_2875 {
            return at;
        }
        at += 8 + len.next_multiple_of(8);
    }
}

/// Where the bitmap directory of `image` is (offset in the file), read
/// from the header's bitmaps extension by hand.
fn directory_offset(image: &Path) -> u64 {
    let at = bitmaps_extension_at(image) + 8 + 16;
    let bytes = std::fs::read(image).unwrap();
    u64::from_be_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// The data clusters of bitmap `name` of `image` as the file holds
/// them (from its table, by hand; `None` for an all-zero one).
fn bitmap_data(image: &Path, name: &str) -> Vec<Option<Vec<u8>>> {
    let bytes = std::fs::read(image).unwrap();
    let be32 = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    let be64 = |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().unwrap());
    let cluster = 1usize << be32(20);
    let mut at = directory_offset(image) as usize;
    loop {
        let name_len = u16::from_be_bytes([bytes[at + 18], bytes[at + 19]]) as usize;
        if &bytes[at + 24..at + 24 + name_len] == name.as_bytes() {
            let (table, n) = (be64(at) as usize, be32(at + 8) as usize);
            return (0..n)
                .map(|k| {
                    let e = be64(table + k * 8) & 0x00ff_ffff_ffff_fe00;
                    (e != 0).then(|| bytes[e as usize..e as usize + cluster].to_vec())
                })
                .collect();
        }
        at += (24 + name_len).next_multiple_of(8);
    }
}

/// A shrink of an image whose bitmap table does not fit the disk (two
/// entries where the disk's bits take one cluster: QEMU refuses to
/// load it) is refused before anything is written: the file is
/// unchanged (every table is read and checked before the size is cut).
#[test]
fn a_shrink_with_a_malformed_bitmap_table_writes_nothing() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("disk.qcow2");
    qemu_create(&image, "", "64M");
    qemu_img(&["bitmap", "--add", s(&image), "b0"]);
    qemu_io(&image, &["write -P 5 0 64k".into()]);
    let size_at = directory_offset(&image) + 8;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .unwrap();
    f.write_all_at(&2u32.to_be_bytes(), size_at).unwrap();
    drop(f);
    let before = std::fs::read(&image).unwrap();
    let out = Command::new(common::sqcow2_bin())
        .args(["resize", "--shrink", s(&image), "32M"])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a shrink over a malformed table went through"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("table of 2 entries"), "{err}");
    assert!(std::fs::read(&image).unwrap() == before, "the file changed");
}

/// Bitmap directories QEMU refuses (an entry with an unknown flag, a
/// granularity over or under QEMU's range, a directory past the end of
/// the file): QEMU refuses the image; sqcow2 refuses writing it (`io`,
/// `serve`) with an error that names the bitmap and what is wrong, the
/// file unchanged, and reads it (the data as QEMU wrote it).
#[test]
fn bad_bitmap_directories_refuse_writes_and_reads_go_on() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("disk.qcow2");
    let cases: [(&str, u64, &[u8], &str); 4] = [
        (
            "flags",
            12,
            &[0, 0, 0, 0x0a],
            "bitmap 'b0': unknown flags 0x8",
        ),
        (
            "granularity 2^32",
            17,
            &[32],
            "bitmap 'b0': granularity 2^32 bytes",
        ),
        (
            "granularity 2^8",
            17,
            &[8],
            "bitmap 'b0': granularity 2^8 bytes",
        ),
        (
            "directory",
            u64::MAX,
            &[0, 0, 1, 0, 0, 0, 0, 0],
            "extends beyond the end of the file",
        ),
    ];
    for (what, at, bytes, words) in cases {
        let _ = std::fs::remove_file(&image);
        qemu_create(&image, "", "64M");
        qemu_io(&image, &["write -P 5 0 64k".into()]);
        qemu_img(&["bitmap", "--add", s(&image), "b0"]);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&image)
            .unwrap();
        let at = match at {
            u64::MAX => bitmaps_extension_at(&image) as u64 + 8 + 16,
            entry => directory_offset(&image) + entry,
        };
        f.write_all_at(bytes, at).unwrap();
        drop(f);
        let before = std::fs::read(&image).unwrap();
        let qemu = Command::new("qemu-io")
            .args(["-c", "write 0 4k", s(&image)])
            .output()
            .unwrap();
        let qemu_err = String::from_utf8_lossy(&qemu.stderr);
        assert!(
            qemu_err.contains("doesn't satisfy the constraints"),
            "{what}: QEMU: {qemu_err}"
        );
        let write = Command::new(common::sqcow2_bin())
            .args(["io", "-c", "write 0 4k", s(&image)])
            .output()
            .unwrap();
        assert!(!write.status.success(), "{what}: a write went through");
        let err = String::from_utf8_lossy(&write.stderr);
        assert!(err.contains(words), "{what}: {err}");
        let sock = tmp.path().join("v.sock");
        let serve = Command::new(common::sqcow2_bin())
            .args(["serve", "--socket", s(&sock), s(&image)])
            .output()
            .unwrap();
        assert!(!serve.status.success(), "{what}: served");
        let err = String::from_utf8_lossy(&serve.stderr);
        assert!(err.contains(words), "{what}: {err}");
        assert!(
            std::fs::read(&image).unwrap() == before,
            "{what}: the file changed"
        );
        common::sqcow2(&["io", "-c", "read -P 5 0 64k", s(&image)]);
    }
}

/// Malformed bitmaps (a table entry with a reserved bit, one pointing
/// at an unaligned cluster, a table too short for the disk, a table
/// past the end of the file): a clear error naming the bitmap, never a
/// panic or wrong bits; a writer refuses the image, untouched.
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
        // A writer refuses the image (as QEMU's open fails) and leaves
        // it as it was.
        let before = std::fs::read(&image).unwrap();
        let out = Command::new(common::sqcow2_bin())
            .args(["io", "-c", "write 0 4k", s(&image)])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
        assert!(stderr.contains("bitmap 'b0'"), "{what}: {stderr}");
        assert!(
            std::fs::read(&image).unwrap() == before,
            "{what}: the image changed"
        );
    }
}

/// The dirty ranges of bitmap `name` of `image` as QEMU reads them:
/// qemu-nbd exports it with `-B`, and `qemu-img map` over NBD with
/// `x-dirty-bitmap` reports each dirty extent as `"data": false`.
/// `Err` with qemu-nbd's message when QEMU refuses the bitmap.
fn qemu_dirty_map(image: &Path, name: &str) -> Result<Vec<Range<u64>>, String> {
    let sock = image.with_extension(format!("{name}.nbd"));
    // Without locking: a writer (the daemon) may hold the image.
    let out = Command::new("qemu-nbd")
        .args(["-r", "--fork", "-B", name, "-k"])
        .arg(&sock)
        .arg("--image-opts")
        .arg(format!(
            "driver=qcow2,file.driver=file,file.locking=off,file.filename={}",
            image.display()
        ))
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},x-dirty-bitmap=qemu:dirty-bitmap:{name}",
        sock.display()
    );
    let map = qemu_img(&["map", "--output=json", "--image-opts", &opts]);
    let map: Vec<serde_json::Value> = serde_json::from_str(&map).unwrap();
    let mut out: Vec<Range<u64>> = Vec::new();
    for e in map.iter().filter(|e| e["data"] == false) {
        let start = e["start"].as_u64().unwrap();
        let r = start..start + e["length"].as_u64().unwrap();
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    Ok(out)
}

/// The flags `qemu-img info` shows for each bitmap of `image`, by name
/// (`-U`: a writer may hold it).
fn qemu_flags(image: &Path) -> Vec<(String, Vec<String>)> {
    try_qemu_flags(image).unwrap()
}

/// [`qemu_flags`]; `None` if qemu-img fails (a `-U` read can meet a
/// directory half rewritten by its writer, as with QEMU's own writers).
fn try_qemu_flags(image: &Path) -> Option<Vec<(String, Vec<String>)>> {
    let out = Command::new("qemu-img")
        .args(["info", "-U", "--output=json", s(image)])
        .output()
        .unwrap();
    if !out.status.success() {
        return None;
    }
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    info["format-specific"]["data"]["bitmaps"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|b| {
                    let flags = b["flags"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|f| f.as_str().unwrap().to_owned())
                        .collect();
                    (b["name"].as_str().unwrap().to_owned(), flags)
                })
                .collect()
        })
        .or(Some(Vec::new()))
}

/// The same writes, write-zeroes and discards through `sqcow2 io` and
/// through qemu-io, on copies of one image with an enabled bitmap at
/// 64 KiB, one at 512 B and a disabled one: QEMU reads each bitmap that
/// sqcow2 kept (qemu-nbd `-B`) exactly as the one it kept itself, none
/// is left in use, and `qemu-img check` finds nothing.
#[test]
fn bitmaps_sqcow2_kept_read_by_qemu_as_the_ones_qemu_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("ours.qcow2");
    let theirs = tmp.path().join("theirs.qcow2");
    qemu_create(&ours, "cluster_size=65536", "2G");
    qemu_img(&["bitmap", "--add", s(&ours), "coarse"]);
    qemu_img(&["bitmap", "--add", "-g", "512", s(&ours), "fine"]);
    qemu_img(&["bitmap", "--add", "--disable", s(&ours), "off"]);
    // Bits QEMU set before: kept.
    qemu_io(&ours, &["write 1536M 4k".to_string()]);
    std::fs::copy(&ours, &theirs).unwrap();
    io_both(
        &ours,
        &theirs,
        &[
            "write -P 1 0 4k",
            "write -P 2 1M 200k",
            "write -P 3 70000 100",
            "write -z 10M 64k",
            "write -z 12M 3k",
            "discard 20M 1M",
            "discard 30M 1k",
            "write -P 4 2047M 1M",
        ],
    );
    for name in ["coarse", "fine", "off"] {
        let want = qemu_dirty_map(&theirs, name).unwrap();
        assert_eq!(qemu_dirty_map(&ours, name).unwrap(), want, "bitmap {name}");
        if name == "off" {
            assert!(want.is_empty(), "QEMU changed a disabled bitmap");
        } else {
            assert!(want.len() >= 7, "{name}: {want:?}");
        }
    }
    assert_eq!(qemu_flags(&ours), qemu_flags(&theirs));
    assert!(qemu_flags(&ours)
        .iter()
        .all(|(_, f)| !f.contains(&"in-use".to_string())));
    common::assert_check_clean(&ours);
    assert_eq!(
        common::qemu_raw(&ours, tmp.path()),
        common::qemu_raw(&theirs, tmp.path())
    );
}

/// `sqcow2 bitmap` against `qemu-img bitmap`, the same steps on copies
/// of one image (writes between them through each tool's own writer):
/// the same exit codes and messages, and then the same bitmaps (names,
/// flags, granularities in `qemu-img info`, bits read by QEMU).
#[test]
fn bitmap_command_does_what_qemu_img_bitmap_does() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("ours.qcow2");
    let theirs = tmp.path().join("theirs.qcow2");
    let other = tmp.path().join("other.qcow2");
    qemu_create(&ours, "cluster_size=65536", "1G");
    qemu_create(&other, "cluster_size=65536", "1G");
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&other), "src"]);
    qemu_io(
        &other,
        &["write 300M 1M".to_string(), "write 5000 1".to_string()],
    );
    std::fs::copy(&ours, &theirs).unwrap();
    // (argument list, writes after it)
    let steps: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["--add"], vec!["write 0 4k"]),
        (vec!["--add", "-g", "512", "--disable"], vec![]),
        (vec!["--add"], vec![]), // exists
        (vec!["--remove"], vec![]),
        (vec!["--clear"], vec![]),
        (vec!["--add", "-g", "100"], vec![]),
        (vec!["--add", "-g", "4G"], vec![]),
        (vec!["-g", "4096", "--remove"], vec![]),
        (vec!["-b", "x", "--add"], vec![]),
        (vec![], vec![]),
        (
            vec!["--add", "-g", "1k"],
            vec!["write 1M 64k", "discard 8M 1M"],
        ),
        (vec!["--disable"], vec!["write 100M 4k"]),
        (vec!["--merge", "b0"], vec![]),
        (vec!["--enable", "--clear"], vec!["write -z 200M 4k"]),
        (vec!["--merge", "nope"], vec![]),
        (vec!["--merge", "src", "-b", "OTHER", "-F", "qcow2"], vec![]),
        (vec!["--remove", "--add", "--disable"], vec!["write 50M 1k"]),
    ];
    // Bitmap names per step: the step's own, cycling.
    let names = [
        "b0", "b1", "b0", "nope", "nope", "b2", "b2", "b0", "b0", "b0", "b3", "b3", "b3", "b1",
        "b1", "b3", "b0",
    ];
    for (k, ((args, writes), name)) in steps.iter().zip(names).enumerate() {
        let mut outcomes = Vec::new();
        for (image, program) in [(&ours, "sqcow2"), (&theirs, "qemu-img")] {
            let mut cmd = match program {
                "sqcow2" => Command::new(common::sqcow2_bin()),
                _ => Command::new("qemu-img"),
            };
            cmd.arg("bitmap");
            for a in args {
                cmd.arg(if *a == "OTHER" { s(&other) } else { a });
            }
            let out = cmd.arg(image).arg(name).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr)
                .trim()
                .trim_start_matches("qemu-img: ")
                .trim_start_matches("sqcow2: ")
                .trim_start_matches("Error: ")
                .to_string();
            outcomes.push((out.status.code(), err));
            if !writes.is_empty() {
                let cmds: Vec<String> = writes.iter().map(|w| w.to_string()).collect();
                if program == "qemu-img" {
                    qemu_io(image, &cmds);
                } else {
                    let mut io = vec!["io".to_string()];
                    for c in cmds {
                        io.extend(["-c".to_string(), c]);
                    }
                    io.push(s(image).to_string());
                    let io: Vec<&str> = io.iter().map(String::as_str).collect();
                    common::sqcow2(&io);
                }
            }
        }
        assert_eq!(
            outcomes[0].0, outcomes[1].0,
            "step {k} {args:?}: exit codes {outcomes:?}"
        );
        let (ours_err, theirs_err) = (&outcomes[0].1, &outcomes[1].1);
        assert!(
            ours_err.lines().next().unwrap_or("") == theirs_err.lines().next().unwrap_or(""),
            "step {k} {args:?}: messages differ:\n sqcow2: {ours_err}\n qemu-img: {theirs_err}"
        );
        assert_eq!(qemu_flags(&ours), qemu_flags(&theirs), "step {k} {args:?}");
    }
    let info = |p: &Path| -> serde_json::Value {
        let v: serde_json::Value =
            serde_json::from_str(&qemu_img(&["info", "--output=json", s(p)])).unwrap();
        v["format-specific"]["data"]["bitmaps"].clone()
    };
    assert_eq!(info(&ours), info(&theirs));
    for (name, _) in qemu_flags(&theirs) {
        assert_eq!(
            qemu_dirty_map(&ours, &name).unwrap(),
            qemu_dirty_map(&theirs, &name).unwrap(),
            "bitmap {name}"
        );
    }
    common::assert_check_clean(&ours);
}

/// Waits (at most 20 s) until `qemu-img info -U` shows bitmap flags
/// `in_use` for every bitmap of `image`.
fn wait_in_use(image: &Path, in_use: bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let flags = try_qemu_flags(image).unwrap_or_default();
        if !flags.is_empty()
            && flags
                .iter()
                .all(|(_, f)| f.contains(&"in-use".to_string()) == in_use)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "bitmaps never {} in use: {flags:?}",
            if in_use { "went" } else { "stopped being" }
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A served image's bitmaps, QEMU the oracle: in use while a frontend
/// writes, stored (not in use) once it leaves, in use again before the
/// next frontend's writes land, stored at SIGTERM with every granule
/// the guest's writes, write-zeroes and discards touched; a `kill -9`
/// leaves them in use, QEMU then refuses them as inconsistent, and a
/// restarted daemon leaves such a bitmap in use and unchanged while it
/// keeps the others.
#[test]
fn served_bitmaps_are_in_use_while_written_and_stored_at_stop() {
    use common::vhost::{connect_retry, Daemon};
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("disk.qcow2");
    let size = 256u64 << 20;
    qemu_create(&image, "cluster_size=65536", "256M");
    qemu_img(&["bitmap", "--add", s(&image), "b0"]);
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&image), "fine"]);
    let mut daemon = Daemon::start(tmp.path(), &image, &[]);
    wait_in_use(&image, true);
    let mut client = connect_retry(&daemon, 1, false);
    let mut touched_writes: Vec<(u64, u64)> = Vec::new();
    for (at, len) in [(0u64, 4096u64), (5 << 20, 65536), (100 << 20, 12288)] {
        client.write(at, &vec![0x5a; len as usize]);
        touched_writes.push((at, len));
    }
    client.write_zeroes(20 << 20, 1 << 20, true);
    touched_writes.push((20 << 20, 1 << 20));
    client.discard(40 << 20, 2 << 20);
    touched_writes.push((40 << 20, 2 << 20));
    client.flush();
    assert!(qemu_flags(&image)
        .iter()
        .all(|(_, f)| f.contains(&"in-use".to_string())));
    drop(client);
    // The frontend left: stored.
    wait_in_use(&image, false);
    for (name, g) in [("b0", 65536u64), ("fine", 4096)] {
        assert_eq!(
            qemu_dirty_map(&image, name).unwrap(),
            touched(&touched_writes, g, size),
            "{name} after the frontend left"
        );
    }
    // The next frontend's write marks them in use before it lands.
    let mut client = connect_retry(&daemon, 1, false);
    client.write(200 << 20, &[7u8; 512]);
    touched_writes.push((200 << 20, 512));
    assert!(
        qemu_flags(&image)
            .iter()
            .all(|(_, f)| f.contains(&"in-use".to_string())),
        "{:?}",
        qemu_flags(&image)
    );
    drop(client);
    daemon.stop();
    for (name, g) in [("b0", 65536u64), ("fine", 4096)] {
        assert_eq!(
            qemu_dirty_map(&image, name).unwrap(),
            touched(&touched_writes, g, size),
            "{name} after SIGTERM"
        );
    }
    common::assert_check_clean(&image);

    // kill -9 while serving: left in use; QEMU refuses them.
    let mut daemon = Daemon::start(tmp.path(), &image, &[]);
    let mut client = connect_retry(&daemon, 1, false);
    client.write(150 << 20, &[1u8; 4096]);
    daemon.stop_with(libc::SIGKILL);
    drop(client);
    wait_in_use(&image, true);
    let err = qemu_dirty_map(&image, "b0").unwrap_err();
    assert!(err.contains("inconsistent"), "{err}");
    // QEMU's answer to an inconsistent bitmap: remove it; a new one then
    // tracks from scratch.
    qemu_img(&["bitmap", "--remove", s(&image), "fine"]);
    qemu_img(&["bitmap", "--add", s(&image), "fresh"]);
    let mut daemon = Daemon::start(tmp.path(), &image, &[]);
    let mut client = connect_retry(&daemon, 1, false);
    client.write(3 << 20, &[2u8; 4096]);
    drop(client);
    daemon.stop();
    let flags = qemu_flags(&image);
    assert_eq!(
        flags,
        vec![
            (
                "b0".to_string(),
                vec!["in-use".to_string(), "auto".to_string()]
            ),
            ("fresh".to_string(), vec!["auto".to_string()]),
        ]
    );
    assert_eq!(
        qemu_dirty_map(&image, "fresh").unwrap(),
        touched(&[(3 << 20, 4096)], 65536, size)
    );
    common::assert_check_clean(&image);
}

/// A live snapshot carries tracking on as libvirt does for a snapshot's
/// overlay: the new top gets an empty bitmap of each enabled one's name
/// and granularity, written into it at once (in use); the old top's
/// bitmaps are stored when it closes and hold the writes before the
/// snapshot, the new top's those after it; a disabled bitmap stays
/// behind. kill -9 then leaves the new top's bitmap in use (QEMU reads
/// it as inconsistent), never missing.
#[test]
fn a_live_snapshot_carries_enabled_bitmaps_into_the_new_top() {
    use common::vhost::{connect_retry, Daemon};
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    let size = 64u64 << 20;
    qemu_create(&base, "cluster_size=65536", "64M");
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&base), "b0"]);
    qemu_img(&["bitmap", "--add", "--disable", s(&base), "off"]);
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &base, &["--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    client.write(1 << 20, &[1u8; 8192]);
    let top = tmp.path().join("top.qcow2");
    let reply = daemon.control(
        &ctl,
        serde_json::json!({"command": "snapshot", "path": top}),
    );
    assert_eq!(reply["ok"], true, "{reply}");
    // In the new top at once, in use.
    assert_eq!(
        qemu_flags(&top),
        vec![(
            "b0".to_string(),
            vec!["in-use".to_string(), "auto".to_string()]
        )]
    );
    client.write(2 << 20, &[2u8; 4096]);
    client.write(1 << 20, &[3u8; 512]);
    client.flush();
    drop(client);
    daemon.stop();
    assert_eq!(
        qemu_dirty_map(&base, "b0").unwrap(),
        touched(&[(1 << 20, 8192)], 4096, size),
        "the old top's bitmap: the writes before the snapshot"
    );
    assert_eq!(qemu_dirty_map(&base, "off").unwrap(), Vec::new());
    assert_eq!(
        qemu_dirty_map(&top, "b0").unwrap(),
        touched(&[(2 << 20, 4096), (1 << 20, 512)], 4096, size),
        "the new top's bitmap: the writes after it"
    );
    assert!(qemu_flags(&base)
        .iter()
        .all(|(_, f)| !f.contains(&"in-use".to_string())));
    for image in [&base, &top] {
        common::assert_check_clean(image);
    }

    // kill -9 after another snapshot: the newest top's bitmap in use.
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let newest = tmp.path().join("newest.qcow2");
    let reply = daemon.control(
        &ctl,
        serde_json::json!({"command": "snapshot", "path": newest}),
    );
    assert_eq!(reply["ok"], true, "{reply}");
    let mut client = connect_retry(&daemon, 1, false);
    client.write(0, &[4u8; 4096]);
    daemon.stop_with(libc::SIGKILL);
    drop(client);
    let err = qemu_dirty_map(&newest, "b0").unwrap_err();
    assert!(err.contains("inconsistent"), "{err}");
}

/// `sqcow2 commit` and `sqcow2 rebase` against `qemu-img commit` and
/// `qemu-img rebase` on copies of one chain: the bitmaps of the image
/// each writes into (the base, the top) mark the same granules.
#[test]
fn commit_and_rebase_mark_bitmaps_as_qemu_img_does() {
    let tmp = tempfile::tempdir().unwrap();
    let build = |tag: &str| {
        let base = tmp.path().join(format!("{tag}-base.qcow2"));
        let mid = tmp.path().join(format!("{tag}-mid.qcow2"));
        let top = tmp.path().join(format!("{tag}-top.qcow2"));
        qemu_create(&base, "cluster_size=65536", "64M");
        qemu_img(&["bitmap", "--add", "-g", "4096", s(&base), "b0"]);
        common::qemu_overlay(&mid, &format!("{tag}-base.qcow2"), "qcow2", &[], None);
        qemu_io(&mid, &["write -P 7 3M 128k".to_string()]);
        common::qemu_overlay(&top, &format!("{tag}-mid.qcow2"), "qcow2", &[], None);
        qemu_img(&["bitmap", "--add", "-g", "512", s(&top), "t0"]);
        qemu_io(
            &top,
            &[
                "write 1M 64k".to_string(),
                "write -z 5M 4k".to_string(),
                "write 9M 512".to_string(),
            ],
        );
        (base, mid, top)
    };
    let (ours_base, ours_mid, ours_top) = build("ours");
    let (theirs_base, _, theirs_top) = build("theirs");
    // The top rebased onto the base: the middle layer's data copied into
    // the top.
    common::sqcow2(&["rebase", "-b", s(&ours_base), "-F", "qcow2", s(&ours_top)]);
    qemu_img(&[
        "rebase",
        "-b",
        s(&theirs_base),
        "-F",
        "qcow2",
        s(&theirs_top),
    ]);
    assert_eq!(
        qemu_dirty_map(&ours_top, "t0").unwrap(),
        qemu_dirty_map(&theirs_top, "t0").unwrap(),
        "the top's bitmap after rebase"
    );
    common::sqcow2(&["commit", s(&ours_top)]);
    qemu_img(&["commit", "-q", s(&theirs_top)]);
    let got = qemu_dirty_map(&ours_base, "b0").unwrap();
    assert_eq!(
        got,
        qemu_dirty_map(&theirs_base, "b0").unwrap(),
        "the base's bitmap after commit"
    );
    assert!(!got.is_empty());
    for image in [&ours_base, &ours_mid, &ours_top] {
        common::assert_check_clean(image);
    }
}

/// `sqcow2 bitmap --live` on a served chain: each operation is in the
/// image when it returns (an added bitmap there in use, a removed one
/// gone), bits follow the guest's writes from the add on, a disabled
/// bitmap stops, a merge takes a bitmap of the top or of a layer below
/// (`-b`), and a refused operation says why as qemu-img would; after
/// SIGTERM QEMU reads each bitmap as the writes made it.
#[test]
fn bitmaps_edited_live_over_the_control_socket() {
    use common::vhost::{connect_retry, Daemon};
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    let top = tmp.path().join("top.qcow2");
    let size = 64u64 << 20;
    qemu_create(&base, "cluster_size=65536", "64M");
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&base), "old"]);
    qemu_io(&base, &["write 7M 4k".to_string()]);
    common::qemu_overlay(&top, "base.qcow2", "qcow2", &[], None);
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&top), "b0"]);
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    let live = |args: &[&str]| {
        let mut cmd = Command::new(common::sqcow2_bin());
        cmd.args(["bitmap", "--live"]).args(args);
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    client.write(1 << 20, &[1u8; 4096]);
    assert_eq!(live(&["--add", "-g", "4096", s(&ctl), "b1"]).0, Some(0));
    assert!(
        qemu_flags(&top).contains(&(
            "b1".to_string(),
            vec!["in-use".to_string(), "auto".to_string()]
        )),
        "{:?}",
        qemu_flags(&top)
    );
    client.write(2 << 20, &[2u8; 4096]);
    assert_eq!(live(&["--disable", s(&ctl), "b0"]).0, Some(0));
    client.write(3 << 20, &[3u8; 4096]);
    let (code, err) = live(&["--add", s(&ctl), "b0"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("Operation add on bitmap b0 failed")
            && err.contains("Bitmap already exists: b0"),
        "{err}"
    );
    assert_eq!(live(&["--add", s(&ctl), "gone"]).0, Some(0));
    assert_eq!(live(&["--remove", s(&ctl), "gone"]).0, Some(0));
    assert!(!qemu_flags(&top).iter().any(|(n, _)| n == "gone"));
    // b2 = b0 merged with the base's "old".
    assert_eq!(live(&["--add", "--disable", s(&ctl), "b2"]).0, Some(0));
    assert_eq!(live(&["--merge", "b0", s(&ctl), "b2"]).0, Some(0));
    let (code, err) = live(&["--merge", "old", "-b", s(&base), s(&ctl), "b2"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, err) = live(&["--merge", "nope", s(&ctl), "b2"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("Dirty bitmap 'nope' not found"), "{err}");
    drop(client);
    daemon.stop();
    let g = 4096;
    assert_eq!(
        qemu_dirty_map(&top, "b0").unwrap(),
        touched(&[(1 << 20, 4096), (2 << 20, 4096)], g, size)
    );
    assert_eq!(
        qemu_dirty_map(&top, "b1").unwrap(),
        touched(&[(2 << 20, 4096), (3 << 20, 4096)], g, size)
    );
    assert_eq!(
        qemu_dirty_map(&top, "b2").unwrap(),
        // At its own (default) granularity, 64 KiB.
        touched(
            &[(1 << 20, 4096), (2 << 20, 4096), (7 << 20, 4096)],
            65536,
            size
        )
    );
    let flags = qemu_flags(&top);
    assert_eq!(
        flags
            .iter()
            .map(|(n, f)| (n.as_str(), f.len()))
            .collect::<Vec<_>>(),
        vec![("b0", 0), ("b1", 1), ("b2", 0)],
        "{flags:?}"
    );
    common::assert_check_clean(&top);
}

/// A live commit of the top into a base that carries a bitmap: the
/// base's bitmap is consistent after the daemon stops and marks every
/// granule the guest wrote after the commit began (those writes reach
/// the base through the drain and after the switch) and what the copy
/// brought down from the top. A bitmap only the top had is carried into
/// the base (libvirt's end of a block commit) with every write since
/// it was added.
#[test]
fn a_live_commit_keeps_the_bases_bitmaps_consistent() {
    use common::vhost::{connect_retry, Daemon};
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    let top = tmp.path().join("top.qcow2");
    let size = 64u64 << 20;
    qemu_create(&base, "cluster_size=65536", "64M");
    qemu_img(&["bitmap", "--add", s(&base), "b0"]);
    // Clusters the base holds: the guest's writes there during the
    // commit go straight into the base's file (in place).
    qemu_io(&base, &["write -P 6 40M 4M".to_string()]);
    common::qemu_overlay(&top, "base.qcow2", "qcow2", &[], None);
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&top), "t1"]);
    qemu_io(
        &top,
        &["write 5M 64k".to_string(), "write 32M 8M".to_string()],
    );
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&ctl)]);
    let mut client = connect_retry(&daemon, 1, false);
    // Slow enough (8 MiB at 4 MiB/s) that the writes below meet the copy.
    let reply = daemon.control(
        &ctl,
        serde_json::json!({"command": "commit", "rate-limit": 4u64 << 20}),
    );
    assert_eq!(reply["ok"], true, "{reply}");
    let stats = daemon.control(&ctl, serde_json::json!({"command": "stats"}));
    assert_eq!(stats["result"]["merge"]["state"], "copying", "{stats}");
    let mut writes = vec![(5u64 << 20, 65536u64), (32 << 20, 8 << 20)];
    for k in 0..40u64 {
        let at = ((k * 1_300_000) % (size - 4096)) & !4095;
        client.write(at, &[k as u8; 4096]);
        writes.push((at, 4096));
        let into_base = (40 << 20) + k * 65536 + 8192;
        client.write(into_base, &[k as u8; 4096]);
        writes.push((into_base, 4096));
    }
    // Writes on, each a granule of its own, through the switch to the
    // base and the bitmaps' carry after it: the top's t1 records in the
    // base from the first request the base serves.
    let mut k = 0u64;
    let ended = loop {
        for _ in 0..16 {
            let at = (48 << 20) + (k % 2048) * 4096;
            client.write(at, &[k as u8; 4096]);
            writes.push((at, 4096));
            k += 1;
        }
        let stats = daemon.control(&ctl, serde_json::json!({"command": "stats"}));
        let m = &stats["result"]["merge"];
        if !["copying", "switching", "measuring"].contains(&m["state"].as_str().unwrap_or("")) {
            break m.clone();
        }
    };
    assert_eq!(ended["state"], "done", "{ended}");
    for _ in 0..64 {
        let at = (48 << 20) + (k % 2048) * 4096;
        client.write(at, &[k as u8; 4096]);
        writes.push((at, 4096));
        k += 1;
    }
    client.write(60 << 20, &[9u8; 4096]);
    writes.push((60 << 20, 4096));
    drop(client);
    daemon.stop();
    let auto = vec!["auto".to_string()];
    assert_eq!(
        qemu_flags(&base),
        vec![("b0".to_string(), auto.clone()), ("t1".to_string(), auto)]
    );
    let mut with_base = writes.clone();
    with_base.push((40 << 20, 4 << 20));
    assert_eq!(
        qemu_dirty_map(&base, "b0").unwrap(),
        touched(&with_base, 65536, size)
    );
    assert_eq!(
        qemu_dirty_map(&base, "t1").unwrap(),
        touched(&writes, 4096, size)
    );
    common::assert_check_clean(&base);
}

/// A bitmap added live, writes, then a live resize: the bitmap grows
/// with the disk (as QEMU resizes a block node's bitmaps), the guest's
/// writes in the new space are marked, and QEMU reads the stored bitmap
/// as the granules the writes touched at the new size; `check` is clean.
#[test]
fn a_live_resize_grows_the_bitmaps_with_the_disk() {
    use common::vhost::Daemon;
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("disk.qcow2");
    qemu_create(&image, "cluster_size=65536", "64M");
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &image, &["--control", s(&ctl)]);
    let out = Command::new(common::sqcow2_bin())
        .args(["bitmap", "--live", "--add", "-g", "4096", s(&ctl), "b0"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut client = common::vhost::connect_retry(&daemon, 1, false);
    client.write(1 << 20, &[1u8; 8192]);
    let reply = daemon.control(
        &ctl,
        serde_json::json!({"command": "resize", "size": 128u64 << 20}),
    );
    assert_eq!(reply["ok"], true, "{reply}");
    drop(client);
    let mut client = common::vhost::connect_retry(&daemon, 1, false);
    assert_eq!(client.capacity(), 128 << 20);
    client.write(100 << 20, &[2u8; 4096]);
    client.write((128 << 20) - 4096, &[3u8; 4096]);
    drop(client);
    daemon.stop();
    let info: serde_json::Value =
        serde_json::from_str(&qemu_img(&["info", "--output=json", s(&image)])).unwrap();
    assert_eq!(info["virtual-size"], 128u64 << 20);
    let writes = [
        (1 << 20, 8192),
        (100 << 20, 4096),
        ((128 << 20) - 4096, 4096),
    ];
    assert_eq!(
        qemu_dirty_map(&image, "b0").unwrap(),
        touched(&writes, 4096, 128 << 20)
    );
    common::assert_check_clean(&image);
}

/// `sqcow2 resize` of an image with bitmaps against `qemu-img resize` on
/// a copy (growing past where a 512 B bitmap's table needs more
/// clusters), then the same writes into the new space: QEMU reads every
/// bitmap alike (bits kept, the new range marked only where written, the
/// disabled one untouched), neither left in use, both `check` clean;
/// then shrunk and grown again beside qemu-img, alike. An inconsistent
/// bitmap refuses the resize with qemu-img's words, the size unchanged.
#[test]
fn resize_grows_and_shrinks_bitmaps_as_qemu_img_does() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("ours.qcow2");
    let theirs = tmp.path().join("theirs.qcow2");
    qemu_create(&ours, "cluster_size=4096", "64M");
    qemu_img(&["bitmap", "--add", s(&ours), "coarse"]);
    qemu_img(&["bitmap", "--add", "-g", "512", s(&ours), "fine"]);
    qemu_img(&["bitmap", "--add", "--disable", s(&ours), "off"]);
    qemu_io(&ours, &["write 0 4k".into(), "write 60M 1M".into()]);
    std::fs::copy(&ours, &theirs).unwrap();
    common::sqcow2(&["resize", s(&ours), "+64M"]);
    qemu_img(&["resize", s(&theirs), "+64M"]);
    io_both(
        &ours,
        &theirs,
        &[
            "write -P 1 100M 64k",
            "write -P 2 127M 1M",
            "write -z 90M 4k",
        ],
    );
    for name in ["coarse", "fine", "off"] {
        let want = qemu_dirty_map(&theirs, name).unwrap();
        assert_eq!(qemu_dirty_map(&ours, name).unwrap(), want, "bitmap {name}");
        if name != "off" {
            assert_eq!(want.len(), 5, "{name}: {want:?}");
        }
    }
    assert_eq!(qemu_flags(&ours), qemu_flags(&theirs));
    common::assert_check_clean(&ours);
    assert_eq!(
        common::qemu_raw(&ours, tmp.path()),
        common::qemu_raw(&theirs, tmp.path())
    );
    // Shrunk past bits set at both sizes (the 512 B bitmap's table
    // from 8 clusters to 3, its last cluster cut in the middle): the
    // bits past the new end dropped, as qemu-img resize --shrink.
    io_both(
        &ours,
        &theirs,
        &["write -P 5 40900k 200k", "write -P 6 10M 4k"],
    );
    common::sqcow2(&["resize", "--shrink", s(&ours), "40M"]);
    qemu_img(&["resize", "-q", "--shrink", s(&theirs), "40M"]);
    for name in ["coarse", "fine", "off"] {
        let want = qemu_dirty_map(&theirs, name).unwrap();
        assert_eq!(qemu_dirty_map(&ours, name).unwrap(), want, "shrunk {name}");
        if name != "off" {
            assert_eq!(
                want.last().map(|r| r.end),
                Some(40 << 20),
                "{name}: {want:?}"
            );
        }
    }
    assert_eq!(qemu_flags(&ours), qemu_flags(&theirs));
    // The stored bits alike, byte for byte (none past the new end).
    for name in ["coarse", "fine"] {
        assert!(
            bitmap_data(&ours, name) == bitmap_data(&theirs, name),
            "{name}: the stored data differs from QEMU's"
        );
    }
    assert_eq!(bitmap_data(&ours, "fine").len(), 3);
    common::assert_check_clean(&ours);
    assert_eq!(
        common::qemu_raw(&ours, tmp.path()),
        common::qemu_raw(&theirs, tmp.path())
    );
    // Grown again: the granules past 40M come back clean.
    common::sqcow2(&["resize", s(&ours), "128M"]);
    qemu_img(&["resize", "-q", s(&theirs), "128M"]);
    for name in ["coarse", "fine", "off"] {
        let want = qemu_dirty_map(&theirs, name).unwrap();
        assert_eq!(qemu_dirty_map(&ours, name).unwrap(), want, "regrown {name}");
    }
    // An inconsistent bitmap (in use, as a killed writer leaves it).
    for image in [&ours, &theirs] {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(image).unwrap();
        let flags_at = directory_offset(image) + 12;
        f.write_all_at(&3u32.to_be_bytes(), flags_at).unwrap();
    }
    let refused = |cmd: &mut Command| {
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let qemu = refused(Command::new("qemu-img").args(["resize", s(&theirs), "256M"]));
    let sq = refused(Command::new(common::sqcow2_bin()).args(["resize", s(&ours), "256M"]));
    let words = "Bitmap 'coarse' is inconsistent and cannot be used";
    assert!(qemu.contains(words), "{qemu}");
    assert!(sq.contains(words), "{sq}");
    let qemu = refused(Command::new("qemu-img").args(["resize", "--shrink", s(&theirs), "64M"]));
    let sq =
        refused(Command::new(common::sqcow2_bin()).args(["resize", "--shrink", s(&ours), "64M"]));
    assert!(qemu.contains(words), "{qemu}");
    assert!(sq.contains(words), "{sq}");
    for image in [&ours, &theirs] {
        let info: serde_json::Value =
            serde_json::from_str(&qemu_img(&["info", "--output=json", s(image)])).unwrap();
        assert_eq!(info["virtual-size"], 128u64 << 20);
        assert_eq!(
            qemu_dirty_map(image, "fine").unwrap(),
            qemu_dirty_map(&theirs, "fine").unwrap()
        );
    }
    common::assert_check_clean(&ours);
}

/// The union of two lists of merged ranges.
fn union(a: &[Range<u64>], b: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut all: Vec<Range<u64>> = a.iter().chain(b).cloned().collect();
    all.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::new();
    for r in all {
        match out.last_mut() {
            Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// A four-layer chain whose middle layers hold bitmaps QEMU kept (`b0`
/// in both, `b1` disabled in the upper one); the bits each reads as by
/// QEMU, taken before any merge.
struct MergeChain {
    top: std::path::PathBuf,
    b0: Vec<Range<u64>>,
    b1: Vec<Range<u64>>,
}

fn merge_chain(dir: &Path) -> MergeChain {
    let layer = |name: &str, below: Option<&str>| {
        let path = dir.join(name);
        let mut args = vec!["create", "-q", "-f", "qcow2"];
        if let Some(b) = below {
            args.extend(["-F", "qcow2", "-b", b]);
        }
        args.extend([s(&path), "64M"]);
        qemu_img(&args);
        path
    };
    let base = layer("base.qcow2", None);
    let l1 = layer("l1.qcow2", Some("base.qcow2"));
    let l2 = layer("l2.qcow2", Some("l1.qcow2"));
    let top = layer("top.qcow2", Some("l2.qcow2"));
    qemu_io(&base, &["write -P 1 0 8M".into()]);
    qemu_img(&["bitmap", "--add", s(&l1), "b0"]);
    qemu_io(
        &l1,
        &["write -P 2 0 64k".into(), "write -P 2 10M 4k".into()],
    );
    qemu_img(&["bitmap", "--add", s(&l2), "b0"]);
    qemu_img(&["bitmap", "--add", "-g", "4096", s(&l2), "b1"]);
    qemu_io(
        &l2,
        &[
            "write -P 3 20M 64k".into(),
            "write -P 3 4k 4k".into(),
            "write -z 30M 1M".into(),
        ],
    );
    qemu_img(&["bitmap", "--disable", s(&l2), "b1"]);
    qemu_io(&top, &["write -P 4 40M 64k".into()]);
    let b0 = union(
        &qemu_dirty_map(&l1, "b0").unwrap(),
        &qemu_dirty_map(&l2, "b0").unwrap(),
    );
    assert_eq!(b0.len(), 4, "{b0:?}");
    let b1 = qemu_dirty_map(&l2, "b1").unwrap();
    assert_eq!(b1.len(), 3, "{b1:?}");
    MergeChain { top, b0, b1 }
}

/// A merge (offline and live) of the two middle layers, whose files
/// hold bitmaps: the new file holds each bitmap once, its bits the union
/// of the merged layers' (libvirt's rule at a block commit's end), the
/// flag of the lowest layer holding it; QEMU reads them so, and the new
/// file is `check` clean and reads as the layers it replaced.
#[test]
fn a_merge_carries_the_merged_layers_bitmaps() {
    for live in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let chain = merge_chain(tmp.path());
        let merged = tmp.path().join("merged.qcow2");
        let before = common::qemu_raw(&chain.top, tmp.path());
        if live {
            use common::vhost::{control, wait_job_ended, Daemon};
            let ctl = tmp.path().join("control.sock");
            let mut daemon = Daemon::start(tmp.path(), &chain.top, &["--control", s(&ctl)]);
            let r = control(
                &ctl,
                serde_json::json!({"command": "merge", "first": 1, "last": 2, "path": merged}),
            );
            assert_eq!(r["ok"], true, "{r}");
            let m = wait_job_ended(&ctl, 60);
            assert_eq!(m["state"], "done", "{m}");
            daemon.stop();
        } else {
            common::sqcow2(&["merge", s(&chain.top), "1", "2", s(&merged)]);
        }
        assert_eq!(
            qemu_dirty_map(&merged, "b0").unwrap(),
            chain.b0,
            "live: {live}"
        );
        assert_eq!(
            qemu_dirty_map(&merged, "b1").unwrap(),
            chain.b1,
            "live: {live}"
        );
        assert_eq!(
            qemu_flags(&merged),
            vec![
                ("b0".to_string(), vec!["auto".to_string()]),
                ("b1".to_string(), Vec::new())
            ]
        );
        common::assert_check_clean(&merged);
        assert_eq!(common::qemu_raw(&chain.top, tmp.path()), before);
    }
}
