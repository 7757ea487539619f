//! The busy-poll mode (`serve --poll-us`) against a driver that honours
//! notification suppression the way a guest kernel does: it kicks only
//! when the device asks for it (`VRING_USED_F_NO_NOTIFY` clear, or with
//! `VIRTIO_RING_F_EVENT_IDX` when the available index passes
//! `avail_event`). While the worker polls it may suppress kicks; before it
//! sleeps it must ask for them again, or the next request is never seen.
//! Requests come one at a time with pauses shorter and longer than the
//! poll window; every one must complete (libblkio kicks whatever the
//! device says, so it cannot show this).

mod common;

use std::num::Wrapping;
use std::time::Duration;

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
    fe.set_vring_base(0, 0).unwrap();
    let kick = EventFd::new(0).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();
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
        let (kicks, silent) = requests_one_at_a_time(&[], event_idx);
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
    }
}
