//! Untrusted images: backing files outside the allowed root are refused,
//! whether named directly or reached through a symlink.

mod common;

use std::path::Path;
use std::process::Command;

use common::vhost::Daemon;
use common::{qemu_img, run_raw, s, sqcow2_bin};
use sqcow2_format::{Chain, ChainOptions, ErrorKind};

/// dir/a/top.qcow2 -> ../b/base.qcow2, dir/a/via-link.qcow2 -> link.qcow2
/// (a symlink in a/ to ../b/base.qcow2), dir/a/inside.qcow2 -> near.qcow2.
fn layout(dir: &Path) {
    std::fs::create_dir_all(dir.join("a")).unwrap();
    std::fs::create_dir_all(dir.join("b")).unwrap();
    let base = dir.join("b/base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "16M"]);
    let a = dir.join("a");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "../b/base.qcow2",
        "-F",
        "qcow2",
        s(&a.join("top.qcow2")),
    ]);
    std::os::unix::fs::symlink("../b/base.qcow2", a.join("link.qcow2")).unwrap();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "link.qcow2",
        "-F",
        "qcow2",
        s(&a.join("via-link.qcow2")),
    ]);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        s(&a.join("near.qcow2")),
        "16M",
    ]);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "near.qcow2",
        "-F",
        "qcow2",
        s(&a.join("inside.qcow2")),
    ]);
}

fn open(top: &Path, root: &Path) -> Result<Chain, sqcow2_format::Error> {
    Chain::open(
        top,
        &ChainOptions {
            backing_root: Some(root.to_path_buf()),
            ..ChainOptions::default()
        },
    )
}

#[test]
fn library_refuses_backing_files_outside_the_root() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    layout(dir);
    let a = dir.join("a");
    for top in ["top.qcow2", "via-link.qcow2"] {
        let err = open(&a.join(top), &a).expect_err(top);
        match &err.kind {
            ErrorKind::BackingOutsideRoot { resolved, .. } => {
                assert!(resolved.ends_with("b/base.qcow2"), "{top}: {err}")
            }
            other => panic!("{top}: unexpected error {other}"),
        }
        assert!(
            err.to_string().contains("outside the allowed root"),
            "{err}"
        );
        // The parent directory as root allows it, and no root at all.
        assert_eq!(open(&a.join(top), dir).unwrap().layers().len(), 2);
        assert!(Chain::open(&a.join(top), &ChainOptions::default()).is_ok());
    }
    assert_eq!(open(&a.join("inside.qcow2"), &a).unwrap().layers().len(), 2);
}

#[test]
fn serve_confines_backing_files_to_the_top_directory_by_default() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    layout(dir);
    let a = dir.join("a");
    for top in ["top.qcow2", "via-link.qcow2"] {
        let out = run_raw(Command::new(sqcow2_bin()).args([
            "serve",
            "--socket",
            s(&dir.join("refused.sock")),
            s(&a.join(top)),
        ]));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{top}: {stderr}");
        assert!(
            stderr.contains("outside the allowed root"),
            "{top}: {stderr}"
        );
        assert!(!dir.join("refused.sock").exists());
    }
    // --backing-root widens it.
    let mut daemon = Daemon::start(dir, &a.join("via-link.qcow2"), &["--backing-root", s(dir)]);
    daemon.stop();
    let mut daemon = Daemon::start(dir, &a.join("inside.qcow2"), &[]);
    daemon.stop();
}
