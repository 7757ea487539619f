//! `sqcow2 compare` against `qemu-img compare` on the same pairs: the
//! same line printed and the same exit code, for identical, different,
//! differently sized and differently allocated images, chains against
//! their flattened copies, raw against qcow2, strict mode, quiet mode and
//! a missing image.

mod common;

use common::*;

fn outcome(program: &str, args: &[&str]) -> (String, Option<i32>) {
    verb_outcome(program, "compare", args)
}

#[test]
fn compare_answers_as_qemu_img_does() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n);
    let top = gen_chain(&d("chain"), 5, "64M", "0.4");
    // The chain flattened by QEMU (qcow2 and raw), and changed copies.
    qemu_img(&["convert", "-O", "qcow2", s(&top), s(&d("flat.qcow2"))]);
    qemu_img(&["convert", "-O", "raw", s(&top), s(&d("flat.raw"))]);
    qemu_img(&["convert", "-O", "qcow2", s(&top), s(&d("changed.qcow2"))]);
    qemu_io(&d("changed.qcow2"), &["write -P 0x77 33M 4k".to_string()]);
    // Same content, other allocation: zeros written where nothing was.
    qemu_create(&d("a.qcow2"), "", "64M");
    qemu_io(&d("a.qcow2"), &["write -P 1 1M 64k".to_string()]);
    qemu_create(&d("b.qcow2"), "", "64M");
    qemu_io(
        &d("b.qcow2"),
        &[
            "write -P 1 1M 64k".to_string(),
            "write -z 8M 1M".to_string(),
            "write -P 0 9M 64k".to_string(),
        ],
    );
    // Larger: zeros past the end, then data past the end.
    qemu_create(&d("big.qcow2"), "", "128M");
    qemu_io(&d("big.qcow2"), &["write -P 1 1M 64k".to_string()]);
    qemu_create(&d("bigdata.qcow2"), "", "128M");
    qemu_io(
        &d("bigdata.qcow2"),
        &[
            "write -P 1 1M 64k".to_string(),
            "write -P 3 100M 1k".to_string(),
        ],
    );
    let p = |n: &str| d(n).to_str().unwrap().to_string();
    let top = top.to_str().unwrap().to_string();
    let cases: Vec<Vec<String>> = vec![
        vec![top.clone(), p("flat.qcow2")],
        vec![top.clone(), p("flat.raw")],
        vec![
            "-f".into(),
            "qcow2".into(),
            "-F".into(),
            "raw".into(),
            top.clone(),
            p("flat.raw"),
        ],
        vec![top.clone(), p("changed.qcow2")],
        vec![p("a.qcow2"), p("b.qcow2")],
        vec!["-s".into(), p("a.qcow2"), p("b.qcow2")],
        vec!["-s".into(), p("a.qcow2"), p("a.qcow2")],
        vec![p("a.qcow2"), p("big.qcow2")],
        vec!["-s".into(), p("a.qcow2"), p("big.qcow2")],
        vec![p("bigdata.qcow2"), p("a.qcow2")],
        vec!["-q".into(), p("a.qcow2"), p("bigdata.qcow2")],
        vec!["-f".into(), "raw".into(), p("a.qcow2"), p("a.qcow2")],
        vec![p("a.qcow2"), p("missing.qcow2")],
    ];
    for args in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let theirs = outcome("qemu-img", &args);
        let ours = outcome("sqcow2", &args);
        assert_eq!(ours, theirs, "compare {args:?}");
    }
    // Not every case the same answer: the table means something.
    let codes: std::collections::BTreeSet<_> = cases
        .iter()
        .map(|a| {
            outcome(
                "qemu-img",
                &a.iter().map(String::as_str).collect::<Vec<_>>(),
            )
            .1
        })
        .collect();
    assert_eq!(codes.len(), 3, "exit codes 0, 1 and 2 all seen: {codes:?}");
}
