//! Handing a disk over between two daemons on the same chain (live
//! migration on shared storage): A serves and is written to; B starts
//! inactive (no locks) while A holds the chain; A inactivates (flush,
//! locks released); B activates (locks taken, chain reloaded) and serves
//! every write A completed, and its own; A cannot take the chain back while
//! B holds it; requests to an inactive daemon wait for its activation, and
//! fail once they waited too long.

mod common;

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::Duration;

use blkio::{Completion, ReqFlags};
use common::vhost::{connect_retry, control, Daemon};
use common::{assert_check_clean, qemu_img, s, tagged_block};
use serde_json::json;

const BLOCK: usize = 64 << 10;

fn chain(dir: &Path) -> std::path::PathBuf {
    let base = dir.join("base.qcow2");
    let top = dir.join("top.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "32M"]);
    common::qemu_io(&base, &["write -P 0x21 0 32M".to_string()]);
    common::qemu_overlay(&top, "base.qcow2", "qcow2", &[], None);
    top
}

#[test]
fn a_disk_moves_between_daemons_and_only_one_holds_it() {
    let tmp = tempfile::tempdir().unwrap();
    let top = chain(tmp.path());
    let (dir_a, dir_b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&dir_a).unwrap();
    std::fs::create_dir_all(&dir_b).unwrap();
    let (ctl_a, ctl_b) = (dir_a.join("ctl"), dir_b.join("ctl"));
    let mut model = vec![0x21u8; 32 << 20];

    let mut a = Daemon::start(
        &dir_a,
        &top,
        &[
            "--control",
            s(&ctl_a),
            "--backing-root",
            s(tmp.path()),
            "--inactive-timeout",
            "1",
        ],
    );
    let mut client = connect_retry(&a, 1, false);
    for i in 0..24u64 {
        let data = tagged_block(i * 7, 1, BLOCK);
        let r = client.try_write(i * 7 * BLOCK as u64, &data);
        assert_eq!(r, 0, "write {i}: {}", a.log());
        let at = (i * 7) as usize * BLOCK;
        model[at..at + BLOCK].copy_from_slice(&data);
        if i == 15 {
            client.flush();
        }
    }

    // B starts while A holds the chain: inactive, it takes no lock.
    let mut b = Daemon::start(
        &dir_b,
        &top,
        &[
            "--control",
            s(&ctl_b),
            "--backing-root",
            s(tmp.path()),
            "--inactive",
        ],
    );
    let info = control(&ctl_b, json!({"command": "info"}));
    assert_eq!(info["result"]["active"], false, "{info}");
    // A request to B waits for its activation.
    let mut client_b = connect_retry(&b, 1, false);
    let early = 3 * 7 * BLOCK as u64;
    let buf = client_b.region.addr as *mut u8;
    client_b.queues[0].read(early, buf, BLOCK, 1, ReqFlags::empty());
    client_b.queues[0]
        .do_io(&mut [], 0, None, None)
        .expect("submit");
    // B cannot take the chain while A holds it.
    let reply = control(&ctl_b, json!({"command": "activate"}));
    assert_eq!(reply["ok"], false, "{reply}");
    assert_eq!(reply["error"]["kind"], "locked", "{reply}");

    // The handover.
    let reply = control(&ctl_a, json!({"command": "inactivate"}));
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(reply["result"]["active"], false);
    drop(client);
    let reply = control(&ctl_b, json!({"command": "activate"}));
    assert_eq!(reply["ok"], true, "{reply}");

    // The waiting read completes, with A's data.
    let mut c = [MaybeUninit::<Completion>::uninit()];
    let mut timeout = Duration::from_secs(60);
    let n = client_b.queues[0]
        .do_io(&mut c, 1, Some(&mut timeout), None)
        .expect("do_io");
    assert_eq!(n, 1, "the waiting read did not complete after activation");
    // SAFETY: do_io initialised the first entry.
    assert_eq!(unsafe { c[0].assume_init_ref() }.ret, 0);
    let at = early as usize;
    assert!(client_b.buf()[..BLOCK] == model[at..at + BLOCK]);

    // Every write A completed reads back through B; B's writes land.
    let mut pos = 0u64;
    while pos < model.len() as u64 {
        let n = (4usize << 20).min(model.len() - pos as usize);
        assert!(
            client_b.read(pos, n) == model[pos as usize..pos as usize + n],
            "B reads something else than A wrote at {pos}"
        );
        pos += n as u64;
    }
    for i in 0..8u64 {
        let block = i * 11 + 3;
        let data = tagged_block(block, 2, BLOCK);
        let r = client_b.try_write(block * BLOCK as u64, &data);
        assert_eq!(r, 0, "B's write {i}: {}", b.log());
        let at = block as usize * BLOCK;
        model[at..at + BLOCK].copy_from_slice(&data);
    }
    client_b.flush();

    // A cannot take the chain back while B holds it; a request to A,
    // inactive for longer than its timeout, fails.
    let reply = control(&ctl_a, json!({"command": "activate"}));
    assert_eq!(reply["ok"], false, "{reply}");
    assert_eq!(reply["error"]["kind"], "locked", "{reply}");
    std::thread::sleep(Duration::from_millis(1200));
    let mut client_a = connect_retry(&a, 1, false);
    assert!(
        client_a.try_read(0, 4096).is_err(),
        "a request to an inactive daemon succeeded"
    );
    drop(client_a);
    let reply = control(
        &ctl_a,
        json!({"command": "snapshot", "path": tmp.path().join("x.qcow2")}),
    );
    assert_eq!(reply["error"]["kind"], "inactive", "{reply}");

    drop(client_b);
    b.stop();
    a.stop();
    assert_check_clean(&top);
    let raw = tmp.path().join("after.raw");
    qemu_img(&["convert", "-O", "raw", s(&top), s(&raw)]);
    assert!(
        std::fs::read(&raw).unwrap() == model,
        "qemu-img convert differs from the model"
    );
}
