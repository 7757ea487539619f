//! The busy-poll mode (`serve --poll-us`) against a driver that honours
//! notification suppression the way a guest kernel does: it kicks only
//! when the device asks for it (`VRING_USED_F_NO_NOTIFY` clear, or with
//! `VIRTIO_RING_F_EVENT_IDX` when the available index passes
//! `avail_event`). While the worker polls it may suppress kicks; before it
//! sleeps it must ask for them again, or the next request is never seen.
//! Requests come one at a time with pauses shorter and longer than the
//! poll window; every one must complete (libblkio kicks whatever the
//! device says, so it cannot show this). Also: a ring restarted after a
//! poll, suppression left by a killed daemon, a broken available index
//! (no spinning), a resubmission waiting for activation during a poll;
//! each of these failed before its fix (found by review).

mod common;

use std::num::Wrapping;
use std::time::{Duration, Instant};

use common::gen_chain;
use common::ring::{
    make_available, status_at, used_flags, used_idx, wait_used, write_request_at, AVAIL, DESC, MEM,
    QSIZE, USED,
};
use common::vhost::{Daemon, SharedGuestMemory};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VringConfigData};
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VRING_USED_F_NO_NOTIFY};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

/// Connects, negotiates (with or without `VIRTIO_RING_F_EVENT_IDX`), sets
/// the ring up; returns the frontend and the kick eventfd.
fn start(daemon: &Daemon, g: &SharedGuestMemory, event_idx: bool) -> (Frontend, EventFd) {
    let mut fe = connect(daemon, g, event_idx);
    let kick = start_ring(&mut fe, g, 0);
    (fe, kick)
}

/// Whether the device asks for a kick after the available index moved
/// from `old` to `new` (the driver's side of notification suppression).
fn device_wants_kick(g: &SharedGuestMemory, event_idx: bool, old: u16, new: u16) -> bool {
    // Read what the device wrote after the available index was published.
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    if event_idx {
        let event: u16 = g
            .mem
            .read_obj(GuestAddress(USED + 4 + 8 * u64::from(QSIZE)))
            .unwrap();
        // vring_need_event(event, new, old)
        (Wrapping(new) - Wrapping(event) - Wrapping(1)).0 < (Wrapping(new) - Wrapping(old)).0
    } else {
        used_flags(&g.mem) & VRING_USED_F_NO_NOTIFY as u16 == 0
    }
}

fn requests_one_at_a_time(serve_args: &[&str], event_idx: bool) -> (u32, u32) {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 2, "16M", "0.5");
    let g = SharedGuestMemory::new(MEM);
    let mut daemon = Daemon::start(tmp.path(), &top, serve_args);
    let (fe, kick) = start(&daemon, &g, event_idx);
    let mut rng = fastrand::Rng::with_seed(0x9011);
    let (mut kicks, mut silent) = (0u32, 0u32);
    for pos in 0..60u16 {
        let r = pos % 5;
        let head = write_request_at(&g.mem, r, pos as u8, 64 * u64::from(pos));
        make_available(&g.mem, pos, head);
        if device_wants_kick(&g, event_idx, pos, pos.wrapping_add(1)) {
            kick.write(1).unwrap();
            kicks += 1;
        } else {
            silent += 1;
        }
        wait_used(&g.mem, pos + 1, &daemon);
        let status: u8 = g
            .mem
            .read_obj(GuestAddress(status_at(u64::from(r))))
            .unwrap();
        assert_eq!(u32::from(status), VIRTIO_BLK_S_OK, "request {pos}");
        // Pauses within and beyond the poll window (50 ms; `wait_used`
        // looks every 5 ms).
        let pause = [0, 0, 1, 80, 120][rng.usize(0..5)];
        std::thread::sleep(Duration::from_millis(pause));
    }
    assert_eq!(used_idx(&g.mem), 60);
    drop(fe);
    daemon.stop();
    (kicks, silent)
}

#[test]
fn a_polling_worker_asks_for_kicks_again_before_it_sleeps() {
    for event_idx in [false, true] {
        // Without polling the device asks for every kick.
        let (kicks, silent) = requests_one_at_a_time(&["--poll-us", "0"], event_idx);
        assert_eq!(
            (kicks, silent),
            (60, 0),
            "event_idx {event_idx}, no polling"
        );
        // Polling: some requests are found without a kick (suppressed
        // while the worker polls), and every one completes.
        let (kicks, silent) = requests_one_at_a_time(&["--poll-us", "50000"], event_idx);
        assert!(kicks > 0, "event_idx {event_idx}: never asked for a kick");
        assert!(
            silent > 0,
            "event_idx {event_idx}: kicks never suppressed while polling ({kicks} kicks)"
        );
        // Adaptive polling (the default, here up to 50 ms): the window
        // grows over the short pauses and drops to nothing over the long
        // ones, switching between polling and sleeping many times; every
        // request completes (requests_one_at_a_time waits for each).
        let (kicks, _) = requests_one_at_a_time(&["--poll-max-us", "50000"], event_idx);
        assert!(kicks > 0, "event_idx {event_idx}: never asked for a kick");
    }
}

/// Connects and negotiates (with or without `VIRTIO_RING_F_EVENT_IDX`)
/// without starting the ring.
fn connect(daemon: &Daemon, g: &SharedGuestMemory, event_idx: bool) -> Frontend {
    let mut fe = Frontend::connect(&daemon.socket, 1).unwrap();
    fe.set_owner().unwrap();
    let mut features = fe.get_features().unwrap();
    assert_ne!(
        features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
        0
    );
    assert_ne!(
        features & (1 << VIRTIO_RING_F_EVENT_IDX),
        0,
        "EVENT_IDX offered"
    );
    if !event_idx {
        features &= !(1 << VIRTIO_RING_F_EVENT_IDX);
    }
    fe.set_features(features).unwrap();
    fe.set_protocol_features(
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK,
    )
    .unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    fe
}

/// Sets ring 0 up from `base` and starts it; returns the kick eventfd.
fn start_ring(fe: &mut Frontend, g: &SharedGuestMemory, base: u16) -> EventFd {
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
    kick
}

/// Whether the used index reaches `want` within `limit`.
fn used_within(g: &SharedGuestMemory, want: u16, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while used_idx(&g.mem) < want {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// A ring stopped (`GET_VRING_BASE`) while its worker polls and started
/// again after the poll window: the device asks for kicks again (it left
/// `VRING_USED_F_NO_NOTIFY` set, and a driver that honours it never kicked).
#[test]
fn a_ring_restarted_after_a_poll_asks_for_kicks() {
    for event_idx in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let top = gen_chain(tmp.path(), 2, "16M", "0.5");
        let g = SharedGuestMemory::new(MEM);
        let mut daemon = Daemon::start(tmp.path(), &top, &["--poll-us", "300000"]);
        let mut fe = connect(&daemon, &g, event_idx);
        let kick = start_ring(&mut fe, &g, 0);
        let head = write_request_at(&g.mem, 0, 1, 0);
        make_available(&g.mem, 0, head);
        kick.write(1).unwrap();
        wait_used(&g.mem, 1, &daemon);
        // The worker polls now (notifications off); the ring stops.
        std::thread::sleep(Duration::from_millis(20));
        let base = fe.get_vring_base(0).unwrap();
        std::thread::sleep(Duration::from_millis(600));
        let kick = start_ring(&mut fe, &g, base as u16);
        std::thread::sleep(Duration::from_millis(600));
        let head = write_request_at(&g.mem, 1, 2, 8);
        make_available(&g.mem, 1, head);
        if device_wants_kick(&g, event_idx, 1, 2) {
            kick.write(1).unwrap();
        }
        assert!(
            used_within(&g, 2, Duration::from_secs(10)),
            "event_idx {event_idx}: the request after the restart was never taken (flags {:#x})",
            used_flags(&g.mem)
        );
        drop(fe);
        daemon.stop();
    }
}

/// A daemon killed while polling leaves `VRING_USED_F_NO_NOTIFY` in the
/// used ring; the next one (not polling) asks for kicks again.
#[test]
fn notification_suppression_left_by_a_previous_daemon_is_cleared() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 2, "16M", "0.5");
    let g = SharedGuestMemory::new(MEM);
    g.mem
        .write_obj(VRING_USED_F_NO_NOTIFY as u16, GuestAddress(USED))
        .unwrap();
    let mut daemon = Daemon::start(tmp.path(), &top, &[]);
    let mut fe = connect(&daemon, &g, false);
    let kick = start_ring(&mut fe, &g, 0);
    std::thread::sleep(Duration::from_millis(200));
    let head = write_request_at(&g.mem, 0, 1, 0);
    make_available(&g.mem, 0, head);
    if device_wants_kick(&g, false, 0, 1) {
        kick.write(1).unwrap();
    }
    assert!(
        used_within(&g, 1, Duration::from_secs(10)),
        "never asked for a kick: flags {:#x}",
        used_flags(&g.mem)
    );
    drop(fe);
    daemon.stop();
}

/// CPU ticks (user + system) of process `pid` so far.
fn cpu_ticks(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// An available index more than a queue ahead (a hostile guest) is no
/// work: a polling worker goes to sleep instead of spinning on it (a full
/// core before the fix). Measured in CPU time, not wall time: a spinning
/// thread uses about 200 ticks in 2 s, a sleeping one none.
#[test]
fn a_broken_ring_does_not_keep_a_polling_worker_busy() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 2, "16M", "0.5");
    let g = SharedGuestMemory::new(MEM);
    let mut daemon = Daemon::start(tmp.path(), &top, &["--poll-us", "1000"]);
    let mut fe = connect(&daemon, &g, true);
    let kick = start_ring(&mut fe, &g, 0);
    g.mem.write_obj(QSIZE + 3, GuestAddress(AVAIL + 2)).unwrap();
    kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let before = cpu_ticks(daemon.pid());
    std::thread::sleep(Duration::from_secs(2));
    let busy = cpu_ticks(daemon.pid()) - before;
    drop(fe);
    daemon.stop();
    assert!(
        busy < 100,
        "the worker spins on a broken ring: {busy} ticks in 2 s"
    );
}

/// A request to resubmit after a restart (from the inflight region),
/// waiting while the daemon is inactive, is served when it is activated
/// during a poll window (before, the poll cleared the pause's deferral and
/// looked only at queues whose available index moved; the mailbox's
/// wake-up then found nothing to resume).
#[test]
fn a_resubmission_waiting_for_activation_is_served_by_a_polling_worker() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    use vhost::vhost_user::message::VhostUserInflight;
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 2, "16M", "0.5");
    let g = SharedGuestMemory::new(MEM);
    let (dir_a, dir_b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&dir_a).unwrap();
    std::fs::create_dir_all(&dir_b).unwrap();
    let negotiate = |fe: &mut Frontend, region: Option<(&VhostUserInflight, &std::fs::File)>| {
        fe.set_owner().unwrap();
        let features = fe.get_features().unwrap();
        fe.set_features(features).unwrap();
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
        got
    };
    // Daemon A creates the region and starts the ring, then dies.
    let mut a = Daemon::start(&dir_a, &top, &[]);
    let mut fe = Frontend::connect(&a.socket, 1).unwrap();
    let (msg, file) = negotiate(&mut fe, None).expect("a region");
    let _kick = start_ring(&mut fe, &g, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut version = [0u8; 2];
        file.read_exact_at(&mut version, 8).unwrap();
        if u16::from_le_bytes(version) == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "A never set version 1");
        std::thread::sleep(Duration::from_millis(5));
    }
    a.stop_with(libc::SIGKILL);
    drop(fe);
    // A write it took and never completed.
    let head = write_request_at(&g.mem, 0, 0x11, 0);
    let d = 16 + u64::from(head) * 16;
    file.write_all_at(&7u64.to_le_bytes(), d + 8).unwrap();
    file.write_all_at(&[1], d).unwrap();
    make_available(&g.mem, 0, head);
    // B starts inactive and polls with a window longer than the test.
    let ctl = dir_b.join("ctl.sock");
    let mut b = Daemon::start(
        &dir_b,
        &top,
        &[
            "--inactive",
            "--control",
            ctl.to_str().unwrap(),
            "--backing-root",
            tmp.path().to_str().unwrap(),
            "--poll-us",
            "3000000",
        ],
    );
    let mut fe = Frontend::connect(&b.socket, 1).unwrap();
    negotiate(&mut fe, Some((&msg, &file)));
    let _kick = start_ring(&mut fe, &g, 0);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(used_idx(&g.mem), 0, "served while inactive");
    let reply = common::vhost::control(&ctl, serde_json::json!({"command": "activate"}));
    assert_eq!(reply["ok"], true, "{reply}");
    let served = used_within(&g, 1, Duration::from_secs(10));
    drop(fe);
    b.stop();
    assert!(
        served,
        "the resubmitted request was never served after activation"
    );
}

/// Adaptive polling: a poll that ends in a brief sleep because the
/// queue's notifications cannot be turned back on (its available index is
/// broken) polls again after the sleep even when an event during the
/// sleep dropped the window to nothing (a sleep longer than the most);
/// otherwise the worker slept for good with kicks still off, and the
/// repaired queue's next request, from a driver that honours the
/// suppression, was never seen.
#[test]
fn a_window_dropped_during_a_brief_sleep_still_turns_kicks_back_on() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 2, "16M", "0.5");
    let g = SharedGuestMemory::new(MEM);
    let mut daemon = Daemon::start(tmp.path(), &top, &["--poll-max-us", "1000"]);
    let (fe, kick) = start(&daemon, &g, false);
    let request = |pos: u16| {
        let sector = 64 * u64::from(pos % 60);
        let head = write_request_at(&g.mem, pos % 5, pos as u8, sector);
        make_available(&g.mem, pos, head);
        if device_wants_kick(&g, false, pos, pos.wrapping_add(1)) {
            kick.write(1).unwrap();
        }
    };
    // Requests back to back (each completion watched by spinning): the
    // window grows to its most, 1 ms; then the ring breaks right after a
    // completion, while the worker polls with kicks off.
    let mut polling_seen = false;
    let mut pos = 0u16;
    for _ in 0..20_000 {
        request(pos);
        let deadline = Instant::now() + Duration::from_secs(10);
        while used_idx(&g.mem) <= pos {
            assert!(Instant::now() < deadline, "request {pos}\n{}", daemon.log());
            std::hint::spin_loop();
        }
        pos += 1;
        if pos > 20 && used_flags(&g.mem) & VRING_USED_F_NO_NOTIFY as u16 != 0 {
            g.mem
                .write_obj(pos + QSIZE + 3, GuestAddress(AVAIL + 2))
                .unwrap();
            polling_seen = true;
            break;
        }
    }
    assert!(polling_seen, "the worker never polled with kicks off");
    // The poll ends in a brief sleep (kicks cannot be turned on); a kick
    // during it wakes the worker after more than the most (1 ms).
    std::thread::sleep(Duration::from_millis(4));
    kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    // Repaired; the next request kicks only if the device asks.
    g.mem.write_obj(pos, GuestAddress(AVAIL + 2)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    request(pos);
    assert!(
        used_within(&g, pos + 1, Duration::from_secs(3)),
        "the request after the repair was never served (kicks left off)\n{}",
        daemon.log()
    );
    drop(fe);
    daemon.stop();
}
