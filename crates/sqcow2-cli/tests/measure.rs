//! `sqcow2 measure` against `qemu-img measure` on the same inputs: the
//! same figures (human and JSON) for chains, raw files, compressed data,
//! bitmaps, output options (cluster size, refcount width, extended L2,
//! compat, preallocation) and `--size`; the same refusals.

mod common;

use common::*;

fn measure(program: &str, args: &[&str]) -> (String, Option<i32>) {
    verb_outcome(program, "measure", args)
}

#[test]
fn measure_figures_are_qemu_imgs() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n);
    let top = gen_chain(&d("chain"), 6, "512M", "0.3");
    qemu_create(&d("a.qcow2"), "", "64M");
    qemu_io(
        &d("a.qcow2"),
        &[
            "write -P 1 1M 64k".to_string(),
            "write -P 2 60M 4k".to_string(),
        ],
    );
    qemu_img(&["bitmap", "--add", s(&d("a.qcow2")), "b0"]);
    qemu_img(&[
        "bitmap",
        "--add",
        "-g",
        "512k",
        s(&d("a.qcow2")),
        "a-longer-name",
    ]);
    qemu_img(&["convert", "-O", "raw", s(&d("a.qcow2")), s(&d("a.raw"))]);
    qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        s(&top),
        s(&d("compressed.qcow2")),
    ]);
    let paths = [top, d("a.qcow2"), d("a.raw"), d("compressed.qcow2")];
    let [top, a, raw, comp] = [0, 1, 2, 3].map(|i| s(&paths[i]));
    let cases: Vec<Vec<&str>> = vec![
        vec!["-O", "qcow2", top],
        vec!["-O", "qcow2", "--output", "json", top],
        vec!["-O", "raw", top],
        vec!["-O", "qcow2", a],
        vec!["-O", "qcow2", "--output", "json", a],
        vec!["-O", "qcow2", "-o", "compat=0.10", a],
        vec!["-O", "qcow2", raw],
        vec!["-O", "qcow2", comp],
        vec!["-O", "qcow2", "-o", "cluster_size=4096", top],
        vec!["-O", "qcow2", "-o", "cluster_size=2M,refcount_bits=64", top],
        vec!["-O", "qcow2", "-o", "extended_l2=on,cluster_size=128k", top],
        vec!["-O", "qcow2", "-o", "preallocation=full", top],
        vec!["-O", "qcow2", "-o", "preallocation=metadata", top],
        vec!["-O", "qcow2", "--size", "1T"],
        vec!["-O", "raw", "--size", "1000"],
        vec!["-O", "qcow2", "--size", "1G", a],
        vec!["-O", "qcow2"],
    ];
    for args in &cases {
        let (theirs, their_code) = measure("qemu-img", args);
        let (ours, our_code) = measure("sqcow2", args);
        assert_eq!(our_code, their_code, "measure {args:?}");
        if args.contains(&"json") {
            let t: serde_json::Value = serde_json::from_str(&theirs).unwrap();
            let o: serde_json::Value = serde_json::from_str(&ours).unwrap();
            assert_eq!(o, t, "measure {args:?}");
        } else {
            assert_eq!(ours, theirs, "measure {args:?}");
        }
    }
}
