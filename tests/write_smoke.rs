mod common;
use common::{qemu_img, s};
use sqcow2_format::{Chain, ChainOptions};

#[test]
fn smoke() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "64M"]);
    common::qemu_io(
        &base,
        &[
            "write -P 0x11 0 8M".into(),
            "write -c -P 0x22 16M 1M".into(),
        ],
    );
    let top = tmp.path().join("top.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        s(&top),
    ]);
    let opts = ChainOptions {
        writable: true,
        ..Default::default()
    };
    let chain = Chain::open(&top, &opts).unwrap();
    chain.write_at(&vec![0x33; 5000], 1000).unwrap();
    chain
        .write_at(&vec![0x44; 3 << 20], 16 << 20 | 777)
        .unwrap();
    chain.write_zeroes(4 << 20, 2 << 20, false).unwrap();
    chain.discard(6 << 20, 1 << 20).unwrap();
    chain.flush().unwrap();
    chain.write_at(&[0x55; 100], 2000).unwrap();
    chain.close().unwrap();
    println!("{}", qemu_img(&["check", s(&top)]));
    let ro = Chain::open(&top, &ChainOptions::default()).unwrap();
    let mut b = vec![0u8; 8];
    ro.read_at(&mut b, 2000).unwrap();
    assert_eq!(b, [0x55; 8]);
    ro.read_at(&mut b, 999).unwrap();
    assert_eq!(b, [0x11, 0x33, 0x33, 0x33, 0x33, 0x33, 0x33, 0x33]);
    common::assert_same_as_qemu(&top);
}
