//! Inflight I/O tracking, driven message by message with rust-vmm's
//! vhost-user frontend: a region obtained from one daemon is handed to the
//! next one after a `kill -9`, with two writes to one sector recorded as
//! taken and never completed (as a killed daemon leaves them, in the
//! layout of the vhost-user specification); the new daemon must resubmit
//! both, in the order they were taken (its debug log), complete them, and
//! leave one of them whole in the sector, before a new request. Malformed regions are refused or ignored, never served
//! from.

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::ring::{
    data_at, header_at, make_available, put_desc, status_at, used_idx, wait_used, write_request,
    AVAIL, DESC, MEM, QSIZE, SECTOR, USED,
};
use common::vhost::{connect_retry, wait_for_log, Daemon, SharedGuestMemory};
use common::{gen_chain, s};
use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VringConfigData};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

/// Negotiates, hands over `region` (or asks for one), sets the ring up
/// and kicks it; returns the frontend, the kick and the region.
fn start(
    daemon: &Daemon,
    g: &SharedGuestMemory,
    region: Option<(&VhostUserInflight, &File)>,
    base: u16,
) -> (Frontend, EventFd, Option<(VhostUserInflight, File)>) {
    let mut fe = Frontend::connect(&daemon.socket, 1).unwrap();
    fe.set_owner().unwrap();
    let features = fe.get_features().unwrap();
    assert_ne!(
        features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
        0
    );
    fe.set_features(features).unwrap();
    let offered = fe.get_protocol_features().unwrap();
    assert!(
        offered.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD),
        "inflight tracking not offered: {offered:?}"
    );
    fe.set_protocol_features(
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD,
    )
    .unwrap();
    let got = match region {
        Some((msg, file)) => {
            fe.set_inflight_fd(msg, file.as_raw_fd()).unwrap();
            None
        }
        None => {
            let ask = VhostUserInflight::new(0, 0, 1, QSIZE);
            let (msg, file) = fe.get_inflight_fd(&ask).unwrap();
            fe.set_inflight_fd(&msg, file.as_raw_fd()).unwrap();
            Some((msg, file))
        }
    };
    fe.set_mem_table(&[g.region()]).unwrap();
    fe.set_vring_num(0, QSIZE).unwrap();
    fe.set_vring_addr(
        0,
        &VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: g.host + DESC,
            used_ring_addr: g.host + USED,
            avail_ring_addr: g.host + AVAIL,
            log_addr: None,
        },
    )
    .unwrap();
    fe.set_vring_base(0, base).unwrap();
    let kick = EventFd::new(0).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();
    (fe, kick, got)
}

/// Marks `head` taken (as a daemon does before starting it) in queue 0 of
/// the region in `file`, in the specification's layout.
fn mark_taken(file: &File, head: u16, counter: u64) {
    let d = 16 + u64::from(head) * 16;
    file.write_all_at(&counter.to_le_bytes(), d + 8).unwrap();
    file.write_all_at(&[1], d).unwrap();
}

fn read_sector(top: &std::path::Path, dir: &std::path::Path) -> Vec<u8> {
    let raw = common::qemu_raw(top, dir);
    raw[(SECTOR * 512) as usize..(SECTOR * 512 + 4096) as usize].to_vec()
}

#[test]
fn requests_in_flight_at_a_kill_are_resubmitted_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 5, "16M", "0.5");
    let g = SharedGuestMemory::new(MEM);

    // Daemon A creates the region and initialises it at the ring's start.
    let mut a = Daemon::start(tmp.path(), &top, &[]);
    let (fe, _kick, region) = start(&a, &g, None, 0);
    let (msg, file) = region.expect("a region from GET_INFLIGHT_FD");
    assert_eq!(msg.num_queues, 1);
    assert_eq!(msg.queue_size, QSIZE);
    // Two writes to one sector, taken by A (counters 7 then 8) and never
    // completed: A dies.
    let first = write_request(&g.mem, 0, 0x11);
    let second = write_request(&g.mem, 1, 0x22);
    // The ring messages get no reply: wait until A started the ring.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut version = [0u8; 2];
        file.read_exact_at(&mut version, 8).unwrap();
        if u16::from_le_bytes(version) == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "A never set version 1\n{}",
            a.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    a.stop_with(libc::SIGKILL);
    drop(fe);
    // Taken in this order: `second` first, then `first`: the data of
    // `first` must be what stays.
    mark_taken(&file, second, 7);
    mark_taken(&file, first, 8);
    make_available(&g.mem, 0, second);
    make_available(&g.mem, 1, first);

    // B gets the region back, and (as QEMU does after a crash) a base of
    // the used index: 0. Its debug log shows the order of resubmission.
    let mut b = Daemon::start_with_env(
        tmp.path(),
        &top,
        &[],
        &[("RUST_LOG", "info,sqcow2_vhost::device::worker=debug")],
    );
    let (fe, kick, _) = start(&b, &g, Some((&msg, &file)), 0);
    wait_used(&g.mem, 2, &b);
    for r in [0u64, 1] {
        let status: u8 = g.mem.read_obj(GuestAddress(status_at(r))).unwrap();
        assert_eq!(u32::from(status), VIRTIO_BLK_S_OK, "request {r}");
    }
    // A new request after them is served too, and nothing runs twice.
    let third = write_request(&g.mem, 2, 0x33);
    put_desc(
        &g.mem,
        third + 1,
        data_at(2),
        4096,
        VRING_DESC_F_NEXT as u16,
        third + 2,
    );
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&VIRTIO_BLK_T_OUT.to_le_bytes());
    h[8..].copy_from_slice(&(SECTOR + 64).to_le_bytes());
    g.mem.write_slice(&h, GuestAddress(header_at(2))).unwrap();
    make_available(&g.mem, 2, third);
    kick.write(1).unwrap();
    wait_used(&g.mem, 3, &b);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(used_idx(&g.mem), 3, "a request completed twice");
    drop(fe);
    // Resubmitted in the order taken: `second`, then `first`.
    let order: Vec<String> = b
        .log()
        .lines()
        .filter(|l| l.contains("resubmitting a request taken before a restart"))
        .filter_map(|l| l.split("head=").nth(1).map(|h| h.trim().to_string()))
        .collect();
    assert_eq!(
        order,
        vec![second.to_string(), first.to_string()],
        "resubmitted out of the order taken\n{}",
        b.log()
    );
    // Both run concurrently (so may complete in either order, as two
    // overlapping writes in flight may): the sector holds one of them
    // whole, never a mix.
    let mut c = connect_retry(&b, 1, false);
    let got = c.read(SECTOR * 512, 4096);
    assert!(
        got == vec![0x11u8; 4096] || got == vec![0x22u8; 4096],
        "the sector holds neither resubmitted write whole"
    );
    drop(c);
    b.stop();
    assert_eq!(read_sector(&top, tmp.path()), got);
    let check = common::run_raw(std::process::Command::new("qemu-img").args(["check", s(&top)]));
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
}

/// QEMU 7.2, after losing a backend, gives the next one a base derived
/// from a used index it read earlier, which can be behind the used ring:
/// found by tests/guest_restart.rs, where the new daemon ran a completed
/// write again, its used index passed the available one and the guest saw
/// I/O errors. With an inflight region, the region and the used ring say
/// where to go on (as libvhost-user does), not the base.
#[test]
fn a_stale_vring_base_does_not_run_completed_requests_again() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 5, "16M", "0.5");
    let g = SharedGuestMemory::new(MEM);

    let mut a = Daemon::start(tmp.path(), &top, &[]);
    let (fe, kick, region) = start(&a, &g, None, 0);
    let (msg, file) = region.expect("a region from GET_INFLIGHT_FD");
    for (r, fill) in [(0u16, 0x11u8), (1, 0x22)] {
        let head = write_request(&g.mem, r, fill);
        make_available(&g.mem, r, head);
        kick.write(1).unwrap();
        wait_used(&g.mem, r + 1, &a);
    }
    // The guest reuses the buffer of the completed second write.
    g.mem
        .write_slice(&[0x99u8; 4096], GuestAddress(data_at(1)))
        .unwrap();
    a.stop();
    drop(fe);

    // B: the region back, and a base one behind the used index.
    let mut b = Daemon::start(tmp.path(), &top, &[]);
    let (fe, kick, _) = start(&b, &g, Some((&msg, &file)), 1);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        used_idx(&g.mem),
        2,
        "a completed request ran again\n{}",
        b.log()
    );
    // A new request is served, once.
    let third = write_request(&g.mem, 2, 0x33);
    make_available(&g.mem, 2, third);
    kick.write(1).unwrap();
    wait_used(&g.mem, 3, &b);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        used_idx(&g.mem),
        3,
        "a request completed twice\n{}",
        b.log()
    );
    drop(fe);
    b.stop();
    assert_eq!(read_sector(&top, tmp.path()), vec![0x33u8; 4096]);
}

/// QEMU starts a ring (kick, enable) before it gives the interrupt
/// eventfd (it unmasks the guest notifiers after the start): a request
/// left on the ring by the previous daemon can complete in between, and
/// its interrupt would be lost, the guest waiting for it forever (found by
/// tests/guest_restart.rs). A new interrupt eventfd is signalled once, as
/// libvhost-user does "in case of I/O hang after reconnecting".
#[test]
fn an_interrupt_eventfd_given_after_a_completion_is_signalled() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 2, "16M", "0.5");
    let g = SharedGuestMemory::new(MEM);
    let b = Daemon::start(tmp.path(), &top, &[]);
    let head = write_request(&g.mem, 0, 0x44);
    make_available(&g.mem, 0, head);
    let (fe, _kick, _) = start(&b, &g, None, 0);
    wait_used(&g.mem, 1, &b);
    let call = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    fe.set_vring_call(0, &call).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while call.read().is_err() {
        assert!(
            Instant::now() < deadline,
            "no interrupt for a request completed before the eventfd came\n{}",
            b.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn malformed_inflight_regions_are_refused_or_ignored() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "16M", "0.5");
    let g = SharedGuestMemory::new(MEM);
    let mut d = Daemon::start(tmp.path(), &top, &[]);

    // A region of the wrong size: refused.
    let small = tempfile::tempfile().unwrap();
    small.set_len(100).unwrap();
    let mut fe = Frontend::connect(&d.socket, 1).unwrap();
    fe.set_owner().unwrap();
    let features = fe.get_features().unwrap();
    fe.set_features(features).unwrap();
    fe.get_protocol_features().unwrap();
    fe.set_protocol_features(
        VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::INFLIGHT_SHMFD,
    )
    .unwrap();
    let wrong = VhostUserInflight::new(100, 0, 1, QSIZE);
    // The frontend library does not wait for an answer to this message:
    // the refusal shows in the daemon's log (and the connection ends).
    let _ = fe.set_inflight_fd(&wrong, small.as_raw_fd());
    wait_for_log(&d, "refusing the inflight region");
    drop(fe);
    let mut fe = Frontend::connect(&d.socket, 1).unwrap();
    fe.set_owner().unwrap();
    fe.get_features().unwrap();
    fe.set_features(features).unwrap();
    fe.get_protocol_features().unwrap();
    fe.set_protocol_features(
        VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::INFLIGHT_SHMFD,
    )
    .unwrap();
    let too_many = VhostUserInflight::new(100, 0, 64, QSIZE);
    let _ = fe.set_inflight_fd(&too_many, small.as_raw_fd());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d
        .log()
        .contains("inflight region for more queues than we offer")
    {
        assert!(Instant::now() < deadline, "no refusal logged:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(fe);

    // A region of the right size full of garbage (every descriptor in
    // flight, states out of range): ignored; requests still served.
    let (msg, file) = {
        let (fe, _k, r) = start(&d, &g, None, 0);
        drop(fe);
        r.unwrap()
    };
    std::thread::sleep(Duration::from_millis(300));
    let len = msg.mmap_size as usize;
    let garbage: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    file.write_all_at(&garbage, 0).unwrap();
    let (fe, kick, _) = start(&d, &g, Some((&msg, &file)), 0);
    let head = write_request(&g.mem, 0, 0x44);
    make_available(&g.mem, 0, head);
    kick.write(1).unwrap();
    wait_used(&g.mem, 1, &d);
    let status: u8 = g.mem.read_obj(GuestAddress(status_at(0))).unwrap();
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    drop(fe);
    assert!(d.is_running(), "daemon died:\n{}", d.log());
    assert!(
        d.log().contains("inflight region ignored")
            || d.log().contains("refusing the inflight region"),
        "no log line about the region:\n{}",
        d.log()
    );
    d.stop();
}
