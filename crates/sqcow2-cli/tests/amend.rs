//! `sqcow2 amend` against `qemu-img amend` on copies of the same image:
//! the same exit code, the same `qemu-img info` (its name and disk usage
//! aside), the same refusal in the same words, the result `qemu-img
//! check` clean and identical to qemu-img's for `qemu-img compare`; a
//! refused amend writes nothing.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;

fn info(image: &Path) -> serde_json::Value {
    let mut v: serde_json::Value =
        serde_json::from_str(&qemu_img(&["info", "--output", "json", s(image)])).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("filename");
    o.remove("actual-size");
    o.remove("full-backing-filename");
    v
}

fn amend(program: &str, options: &str, image: &Path) -> Output {
    let bin = if program == "sqcow2" {
        sqcow2_bin()
    } else {
        program.into()
    };
    run_raw(Command::new(bin).args(["amend", "-o", options, s(image)]))
}

/// The error line without the program's name.
fn words(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr);
    e.lines()
        .next()
        .unwrap_or_default()
        .split_once(": ")
        .map(|(_, w)| w.to_string())
        .unwrap_or_default()
}

#[test]
fn amend_does_what_qemu_img_amend_does() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    qemu_create(&base, "", "64M");
    qemu_io(&base, &["write -P 7 0 4M".to_string()]);
    let other = dir.path().join("other.qcow2");
    qemu_create(&other, "", "64M");
    // (options to amend, options the image is created with)
    let cases: &[(&str, &str)] = &[
        ("compat=0.10", ""),
        ("compat=1.1", "compat=0.10"),
        ("lazy_refcounts=on", ""),
        ("lazy_refcounts=on", "compat=0.10"),
        ("refcount_bits=8", ""),
        ("refcount_bits=64", ""),
        ("refcount_bits=1", ""),
        ("refcount_bits=3", ""),
        ("compat=0.10", "refcount_bits=64"),
        ("refcount_bits=8", "compat=0.10"),
        ("compat=0.10", "extended_l2=on"),
        ("compat=0.10,lazy_refcounts=off", "lazy_refcounts=on"),
        ("cluster_size=4k", ""),
        ("bogus=1", ""),
        ("size=128M", ""),
        ("size=32M", ""),
        ("backing_file=other.qcow2,backing_fmt=qcow2", ""),
    ];
    for (i, (options, created)) in cases.iter().enumerate() {
        let theirs = dir.path().join(format!("q{i}.qcow2"));
        let ours = dir.path().join(format!("s{i}.qcow2"));
        let extra: &[&str] = if created.is_empty() {
            &[]
        } else {
            &["-o", created]
        };
        qemu_overlay(&theirs, "base.qcow2", "qcow2", extra, Some("64M"));
        // Data, zeros over data of the base, an unwritten range.
        qemu_io(
            &theirs,
            &[
                "write -P 1 2M 64k".to_string(),
                "write -P 2 40M 1M".to_string(),
            ],
        );
        std::fs::copy(&theirs, &ours).unwrap();
        let before = sha256_file(&ours);
        let q = amend("qemu-img", options, &theirs);
        let o = amend("sqcow2", options, &ours);
        assert_eq!(
            o.status.code(),
            q.status.code(),
            "amend -o {options} [{created}]: {}",
            words(&o)
        );
        if q.status.success() {
            assert_eq!(info(&ours), info(&theirs), "amend -o {options} [{created}]");
            assert_check_clean(&ours);
            let cmp = run_raw(Command::new("qemu-img").args(["compare", s(&theirs), s(&ours)]));
            assert!(cmp.status.success(), "amend -o {options} [{created}]");
        } else {
            // (sqcow2 names the image before qemu-img's words.)
            let (mine, qemus) = (words(&o), words(&q));
            assert!(
                mine.ends_with(&qemus) && !qemus.is_empty(),
                "amend -o {options} [{created}]: ours {mine:?}, qemu-img's {qemus:?}"
            );
            assert_eq!(sha256_file(&ours), before, "a refused amend wrote");
        }
    }
}

#[test]
fn zero_clusters_without_a_backing_file_survive_a_downgrade() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("a.qcow2");
    qemu_create(&img, "", "64M");
    qemu_io(
        &img,
        &["write -P 1 0 4M".to_string(), "write -z 1M 1M".to_string()],
    );
    let theirs = dir.path().join("b.qcow2");
    std::fs::copy(&img, &theirs).unwrap();
    sqcow2(&["amend", "-o", "compat=0.10", s(&img)]);
    qemu_img(&["amend", "-o", "compat=0.10", s(&theirs)]);
    assert_eq!(info(&img), info(&theirs));
    assert_check_clean(&img);
    qemu_io(
        &img,
        &["read -P 0 1M 1M".to_string(), "read -P 1 2M 2M".to_string()],
    );
    // Over a backing file the zeros would have to be written: refused,
    // nothing changed.
    let top = dir.path().join("top.qcow2");
    qemu_overlay(&top, "b.qcow2", "qcow2", &[], None);
    qemu_img(&["amend", "-o", "compat=1.1", s(&top)]);
    qemu_io(&top, &["write -z 0 64k".to_string()]);
    let before = sha256_file(&top);
    let o = amend("sqcow2", "compat=0.10", &top);
    assert!(!o.status.success());
    assert!(words(&o).contains("zero clusters"), "{}", words(&o));
    assert_eq!(sha256_file(&top), before);
}
