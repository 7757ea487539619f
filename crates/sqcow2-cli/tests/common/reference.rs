//! A reference of what a disk must hold, for tests that write through a
//! daemon: QEMU's view at the start and every completed write.

use std::path::PathBuf;

use serde_json::Value;

use super::{run_raw, s, sqcow2};

/// A reference of what the disk must hold: the chain's bytes as QEMU read
/// them at the start (a sparse raw file), and every completed write
/// applied to it.
pub struct Reference {
    block: u64,
    raw: PathBuf,
    file: std::fs::File,
    /// (offset, fill) of each completed write, in order.
    writes: Vec<(u64, u8)>,
}

impl Reference {
    /// QEMU's view of `top`, written into `dir/reference.raw`; writes of
    /// `block` bytes.
    pub fn new(top: &std::path::Path, dir: &std::path::Path, block: u64) -> Reference {
        let raw = dir.join("reference.raw");
        super::qemu_img(&["convert", "-O", "raw", s(top), s(&raw)]);
        let file = std::fs::OpenOptions::new().write(true).open(&raw).unwrap();
        Reference {
            block,
            raw,
            file,
            writes: Vec::new(),
        }
    }

    /// Notes a completed write of `fill` at `offset`.
    pub fn wrote(&mut self, offset: u64, fill: u8) {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(&vec![fill; self.block as usize], offset)
            .unwrap();
        self.writes.push((offset, fill));
    }

    /// The last fill written at each offset.
    pub fn latest(&self) -> std::collections::BTreeMap<u64, u8> {
        self.writes.iter().copied().collect()
    }

    /// Every block written reads back through the daemon.
    pub fn verify_through(&self, client: &mut super::vhost::Client, when: &str) {
        for (offset, fill) in self.latest() {
            let got = client.read(offset, self.block as usize);
            assert!(
                got.iter().all(|b| *b == fill),
                "{when}: block at {offset} lost its write (fill {fill})"
            );
        }
    }

    /// [`Reference::verify_for_qemu`], then the top is indexed and its
    /// index agrees with a walk (`sqcow2 check`).
    pub fn verify_files(&self, top: &std::path::Path, dir: &std::path::Path) {
        self.verify_for_qemu(top, dir);
        let check =
            run_raw(std::process::Command::new(super::sqcow2_bin()).args(["check", s(top)]));
        assert!(
            check.status.success(),
            "sqcow2 check (every index entry against a walk): {}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        let info = sqcow2(&["info", s(top)]);
        assert!(
            info.contains("chain index: valid"),
            "the top is not indexed again: {info}"
        );
    }

    /// The whole chain equals the reference for QEMU (`qemu-img
    /// compare`), and every layer is clean for `qemu-img check`.
    pub fn verify_for_qemu(&self, top: &std::path::Path, dir: &std::path::Path) {
        let out = run_raw(std::process::Command::new("qemu-img").args([
            "compare",
            "-f",
            "qcow2",
            "-F",
            "raw",
            s(top),
            s(&self.raw),
        ]));
        assert!(
            out.status.success(),
            "qemu-img compare with the reference: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let layer = entry.path();
            if layer.extension().is_none_or(|e| e != "qcow2") {
                continue;
            }
            let out = run_raw(std::process::Command::new("qemu-img").args([
                "check",
                "--output=json",
                s(&layer),
            ]));
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "qemu-img check {}: {text}",
                layer.display()
            );
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                v["leaks"].as_u64().unwrap_or(0),
                0,
                "{}: {text}",
                layer.display()
            );
        }
    }
}
