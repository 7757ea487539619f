//! The daemon under a frontend that behaves like Cloud Hypervisor v53
//! (driven message by message with rust-vmm's vhost-user frontend): the
//! CONFIG protocol feature is required, 60 bytes of config are read at
//! offset 0, only the 1-byte writeback field is written, "enable vring"
//! comes several times, the queue has no call fd (no interrupt vector; the
//! driver polls the used ring), and the socket closes without
//! GET_VRING_BASE. The daemon must serve all of it and the next frontend.
//! And a driver without `VIRTIO_RING_F_EVENT_IDX` is interrupted once per
//! batch of completions, never for a kick that completed nothing.
//! And a frontend that dials again the moment a killed daemon's socket
//! hangs up (Cloud Hypervisor v53 gives the disk up for good when that
//! handshake fails) is refused, never accepted by the dying daemon and
//! reset.

mod common;

use std::time::{Duration, Instant};

use common::vhost::{connect_retry, control, Daemon, SharedGuestMemory};
use common::{gen_chain, qemu_raw, run_raw, s};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VringConfigData};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

const MEM: usize = 16 << 20;
const QSIZE: u16 = 16;
const HEADER: u64 = 0x10_0000;
const STATUS: u64 = 0x10_1000;
const DATA: u64 = 0x20_0000;

type Mem = GuestMemoryMmap<()>;

/// Puts one request (header, data, status) on the ring at descriptor
/// `first`.
fn add_request(mock: &MockSplitQueue<'_, Mem>, first: u16, data_write: bool, len: u32) {
    let descs = [
        (HEADER, 16, 0),
        (DATA, len, if data_write { VRING_DESC_F_WRITE } else { 0 }),
        (STATUS, 1, VRING_DESC_F_WRITE),
    ];
    let raw: Vec<RawDescriptor> = descs
        .iter()
        .enumerate()
        .map(|(i, &(addr, len, flags))| {
            let next = if i + 1 < descs.len() {
                VRING_DESC_F_NEXT
            } else {
                0
            };
            RawDescriptor::from(SplitDescriptor::new(
                addr,
                len,
                (flags | next) as u16,
                first + i as u16 + 1,
            ))
        })
        .collect();
    mock.add_desc_chains(&raw, first).unwrap();
}

/// Polls the used index (there is no call fd) until it reaches `want`.
fn wait_used(mem: &Mem, mock: &MockSplitQueue<'_, Mem>, want: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let idx: u16 = mem.read_obj(mock.used_addr().unchecked_add(2)).unwrap();
        if idx >= want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "request not completed (used idx {idx})"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Tells the daemon where queue 0's rings are (`mock`, in guest memory
/// mapped at `host` in this process) and that it starts at index 0.
fn place_vring(fe: &mut Frontend, mock: &MockSplitQueue<'_, Mem>, host: u64) {
    let (desc, avail, used) = (mock.desc_table_addr(), mock.avail_addr(), mock.used_addr());
    place_vring_at(fe, host, [desc.0, avail.0, used.0]);
}

/// Tells the daemon that queue 0's descriptor table, available and used
/// rings are at `rings` (guest addresses, memory mapped at `host` in this
/// process) and that it starts at index 0.
fn place_vring_at(fe: &mut Frontend, host: u64, rings: [u64; 3]) {
    fe.set_vring_num(0, QSIZE).unwrap();
    fe.set_vring_addr(
        0,
        &VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: host + rings[0],
            used_ring_addr: host + rings[2],
            avail_ring_addr: host + rings[1],
            log_addr: None,
        },
    )
    .unwrap();
    fe.set_vring_base(0, 0).unwrap();
}

/// A frontend connected to `daemon` that negotiates the features
/// `features` keeps of those offered and, of the protocol features, only
/// MQ; `guest`'s memory handed over and queue 0's rings placed at `mock`.
fn frontend_with_ring(
    daemon: &Daemon,
    guest: &SharedGuestMemory,
    mock: &MockSplitQueue<'_, Mem>,
    features: impl FnOnce(u64) -> u64,
) -> Frontend {
    let mut fe = frontend(daemon, guest, features, VhostUserProtocolFeatures::MQ);
    place_vring(&mut fe, mock, guest.host);
    fe
}

/// A frontend connected to `daemon` with the features `features` keeps
/// and the protocol features `protocol` (of those offered), `guest`'s
/// memory handed over; no ring placed yet.
fn frontend(
    daemon: &Daemon,
    guest: &SharedGuestMemory,
    features: impl FnOnce(u64) -> u64,
    protocol: VhostUserProtocolFeatures,
) -> Frontend {
    let mut fe = Frontend::connect(&daemon.socket, 1).unwrap();
    fe.set_owner().unwrap();
    let offered = fe.get_features().unwrap();
    fe.set_features(features(offered)).unwrap();
    let offered = fe.get_protocol_features().unwrap();
    fe.set_protocol_features(offered & protocol).unwrap();
    fe.set_mem_table(&[guest.region()]).unwrap();
    fe
}

/// The request just completed succeeded and read 4 KiB at `sector` equal
/// to `expected` (qemu-img's bytes of the disk).
fn assert_read_4k(mem: &Mem, expected: &[u8], sector: u64, what: &str) {
    let status: u8 = mem.read_obj(GuestAddress(STATUS)).unwrap();
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK, "{what}: status");
    let mut got = vec![0u8; 4096];
    mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    let at = sector as usize * 512;
    assert!(
        got == expected[at..at + 4096],
        "{what} differs from qemu-img"
    );
}

fn header(mem: &Mem, t: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&t.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(HEADER)).unwrap();
    mem.write_obj(0xFFu8, GuestAddress(STATUS)).unwrap();
}

#[test]
fn cloud_hypervisor_style_frontend() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 10, "16M", "0.5");
    let expected = qemu_raw(&top, tmp.path());
    let mut daemon = Daemon::start(tmp.path(), &top, &[]);

    let guest = SharedGuestMemory::new(MEM);
    let (mem, host) = (guest.mem.clone(), guest.host);

    let mut fe = Frontend::connect(&daemon.socket, 1).unwrap();
    fe.set_owner().unwrap();
    let features = fe.get_features().unwrap();
    assert_ne!(
        features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
        0
    );
    fe.set_features(features).unwrap();
    let wanted = VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS;
    let offered = fe.get_protocol_features().unwrap();
    assert!(offered.contains(wanted), "protocol features {offered:?}");
    fe.set_protocol_features(wanted).unwrap();
    assert_eq!(fe.get_queue_num().unwrap(), 1);

    // 60 bytes at offset 0, exactly that back.
    let (cfg_hdr, cfg) = fe
        .get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0u8; 60])
        .unwrap();
    assert_eq!((cfg_hdr.offset, cfg_hdr.size), (0, 60));
    assert_eq!(cfg.len(), 60);
    let capacity = u64::from_le_bytes(cfg[..8].try_into().unwrap());
    assert_eq!(capacity * 512, expected.len() as u64);
    assert_eq!(cfg[32], 1, "write-back by default");
    // Only the writeback byte is written: switch to write-through.
    fe.set_config(32, VhostUserConfigFlags::WRITABLE, &[0])
        .unwrap();
    let (_, cfg) = fe
        .get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0u8; 60])
        .unwrap();
    assert_eq!(cfg[32], 0, "writeback field not taken");

    fe.set_mem_table(&[guest.region()]).unwrap();
    let mock = MockSplitQueue::create(&mem, GuestAddress(0), QSIZE);
    place_vring(&mut fe, &mock, host);
    let kick = EventFd::new(0).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    // No SET_VRING_CALL: the queue has no interrupt vector.
    for _ in 0..3 {
        fe.set_vring_enable(0, true).unwrap();
    }

    // A read, then a write (write-through: flushed before completion).
    header(&mem, VIRTIO_BLK_T_IN, 16);
    add_request(&mock, 0, true, 8192);
    kick.write(1).unwrap();
    wait_used(&mem, &mock, 1);
    let status: u8 = mem.read_obj(GuestAddress(STATUS)).unwrap();
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    let mut got = vec![0u8; 8192];
    mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert!(
        got == expected[8192..16384],
        "read differs from qemu-img convert"
    );

    header(&mem, VIRTIO_BLK_T_OUT, 2048);
    mem.write_slice(&[0xC3u8; 4096], GuestAddress(DATA))
        .unwrap();
    add_request(&mock, 3, false, 4096);
    kick.write(1).unwrap();
    wait_used(&mem, &mock, 2);
    let status: u8 = mem.read_obj(GuestAddress(STATUS)).unwrap();
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);

    // Shutdown: the socket closes, no GET_VRING_BASE.
    drop(fe);
    assert!(daemon.is_running(), "daemon exited:\n{}", daemon.log());
    let mut next = connect_retry(&daemon, 1, false);
    assert_eq!(next.read(2048 * 512, 4096), vec![0xC3u8; 4096]);
    drop(next);
    daemon.stop();
    let check = run_raw(std::process::Command::new("qemu-img").args(["check", s(&top)]));
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
}

/// A frontend without `VIRTIO_RING_F_EVENT_IDX` (a driver that takes an
/// interrupt whenever the device sends one): one interrupt per request
/// completed, none for kicks that bring no request (the daemon used to
/// signal after every batch it looked at, completed or not).
#[test]
fn a_driver_without_event_idx_is_interrupted_only_for_completions() {
    const EVENT_IDX: u64 = 1 << 29;
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "16M", "0.5");
    let expected = qemu_raw(&top, tmp.path());
    let mut daemon = Daemon::start(tmp.path(), &top, &[]);
    let guest = SharedGuestMemory::new(MEM);
    let mem = guest.mem.clone();
    let mock = MockSplitQueue::create(&mem, GuestAddress(0), QSIZE);
    let mut fe = frontend_with_ring(&daemon, &guest, &mock, |offered| {
        assert_ne!(offered & EVENT_IDX, 0, "EVENT_IDX offered");
        offered & !EVENT_IDX
    });
    let call = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
    fe.set_vring_call(0, &call).unwrap();
    let kick = EventFd::new(0).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();
    // A new interrupt eventfd is signalled once (a completion may have
    // come before it): not counted.
    std::thread::sleep(Duration::from_millis(50));
    let _ = call.read();

    // The interrupts sent for the requests completed up to `used`.
    let interrupts_for = |used: u16| -> u64 {
        wait_used(&mem, &mock, used);
        // The signal follows the used index: wait for it, then give a
        // spurious second one the time to come.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut n = 0;
        while n == 0 {
            n = call.read().unwrap_or(0);
            assert!(Instant::now() < deadline, "no interrupt");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(200));
        n + call.read().unwrap_or(0)
    };
    for (round, first) in [(1u16, 0u16), (2, 3), (3, 6)] {
        if round > 1 {
            // Kicks that bring nothing new.
            for _ in 0..3 {
                kick.write(1).unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let sector = 16 * u64::from(round);
        header(&mem, VIRTIO_BLK_T_IN, sector);
        add_request(&mock, first, true, 4096);
        kick.write(1).unwrap();
        assert_eq!(interrupts_for(round), 1, "interrupts for request {round}");
        assert_read_4k(&mem, &expected, sector, &format!("read {round}"));
    }
    drop(fe);
    daemon.stop();
}

/// A request the driver put on the ring before the ring started (a
/// restarted backend, or a driver that kicked too early) is taken when
/// the ring starts, without a kick.
#[test]
fn a_request_on_the_ring_when_it_starts_is_taken_without_a_kick() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "16M", "0.5");
    let expected = qemu_raw(&top, tmp.path());
    let mut daemon = Daemon::start(tmp.path(), &top, &[]);
    let guest = SharedGuestMemory::new(MEM);
    let mem = guest.mem.clone();
    let mock = MockSplitQueue::create(&mem, GuestAddress(0), QSIZE);
    let mut fe = frontend_with_ring(&daemon, &guest, &mock, |offered| offered);
    let sector = 40;
    header(&mem, VIRTIO_BLK_T_IN, sector);
    add_request(&mock, 0, true, 4096);
    // The ring starts with the request on it; nobody writes the kick.
    let kick = EventFd::new(0).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();
    wait_used(&mem, &mock, 1);
    assert_read_4k(&mem, &expected, sector, "the read");
    drop(fe);
    daemon.stop();
}

/// Queue 0's rings placed apart (`MockSplitQueue` puts its used ring
/// over the available ring's entries past the eighth): the descriptor
/// table at 0, the available ring at `AVAIL`, the used ring at `USED`.
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;

/// Puts one request (header, data, status at the addresses given) on
/// the ring at descriptors `first..first + 3`.
fn push_request(mem: &Mem, first: u16, descs: [(u64, u32, u32); 3]) {
    for (i, &(addr, len, flags)) in descs.iter().enumerate() {
        let next = if i + 1 < descs.len() {
            VRING_DESC_F_NEXT
        } else {
            0
        };
        let d = SplitDescriptor::new(addr, len, (flags | next) as u16, first + i as u16 + 1);
        mem.write_obj(
            RawDescriptor::from(d),
            GuestAddress(u64::from(first + i as u16) * 16),
        )
        .unwrap();
    }
    let idx: u16 = mem.read_obj(GuestAddress(AVAIL + 2)).unwrap();
    mem.write_obj(first, GuestAddress(AVAIL + 4 + u64::from(idx % QSIZE) * 2))
        .unwrap();
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    mem.write_obj(idx.wrapping_add(1), GuestAddress(AVAIL + 2))
        .unwrap();
}

/// Live snapshots while a write-through driver (its write cache turned
/// off, as a guest does with `cache=writethrough`) writes into clusters
/// the top does not have: allocating writes wait for the one engine
/// thread, each is flushed before it completes. A snapshot's switch must
/// not wait for writes whose engine job has not begun (they wait for the
/// switch): it did (30 s, then the snapshot failed) when write-through
/// requests kept counting as using the old chain. Every write lands, in
/// the new top or the old one, as qemu-img reads the chain after.
#[test]
fn live_snapshots_under_write_through_allocating_writes() {
    const WRITES: u16 = 5;
    const LEN: u32 = 16 << 10;
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "64M", "0.3");
    let mut model = qemu_raw(&top, tmp.path());
    let ctl = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(
        tmp.path(),
        &top,
        &["--engine-threads", "1", "--control", s(&ctl)],
    );
    let guest = SharedGuestMemory::new(MEM);
    let mem = guest.mem.clone();
    let mut fe = frontend(
        &daemon,
        &guest,
        |offered| offered,
        VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::CONFIG,
    );
    fe.set_config(32, VhostUserConfigFlags::WRITABLE, &[0])
        .unwrap();
    place_vring_at(&mut fe, guest.host, [0, AVAIL, USED]);
    let kick = EventFd::new(0).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();

    let snapshots = std::thread::spawn({
        let (ctl, dir) = (ctl.clone(), tmp.path().to_path_buf());
        move || {
            let mut last = None;
            for i in 0..6 {
                std::thread::sleep(Duration::from_millis(30));
                let new = dir.join(format!("live{i}.qcow2"));
                let reply = control(
                    &ctl,
                    serde_json::json!({"id": i, "command": "snapshot", "path": new}),
                );
                assert_eq!(reply["ok"], true, "snapshot {i}: {reply}");
                last = Some(new);
            }
            last.unwrap()
        }
    });
    let clusters = model.len() as u64 / (64 << 10);
    let mut rng = fastrand::Rng::with_seed(7);
    let mut used = 0u16;
    let mut rounds = 0;
    while !snapshots.is_finished() || rounds < 20 {
        rounds += 1;
        let mut placed = Vec::new();
        for k in 0..WRITES {
            let (hdr, data, status) = (
                HEADER + u64::from(k) * 0x100,
                DATA + u64::from(k) * u64::from(LEN),
                STATUS + u64::from(k),
            );
            // A cluster not written in this round, 16 KiB inside it.
            let at = loop {
                let c = rng.u64(0..clusters) * (64 << 10) + rng.u64(0..4) * u64::from(LEN);
                if !placed.contains(&at_cluster(c)) {
                    placed.push(at_cluster(c));
                    break c;
                }
            };
            let mut h = [0u8; 16];
            h[..4].copy_from_slice(&VIRTIO_BLK_T_OUT.to_le_bytes());
            h[8..].copy_from_slice(&(at / 512).to_le_bytes());
            mem.write_slice(&h, GuestAddress(hdr)).unwrap();
            let fill = rng.u8(1..);
            mem.write_slice(&vec![fill; LEN as usize], GuestAddress(data))
                .unwrap();
            mem.write_obj(0xFFu8, GuestAddress(status)).unwrap();
            model[at as usize..(at + u64::from(LEN)) as usize].fill(fill);
            push_request(
                &mem,
                k * 3,
                [
                    (hdr, 16, 0),
                    (data, LEN, 0),
                    (status, 1, VRING_DESC_F_WRITE),
                ],
            );
        }
        kick.write(1).unwrap();
        used = used.wrapping_add(WRITES);
        let deadline = Instant::now() + Duration::from_secs(60);
        while mem.read_obj::<u16>(GuestAddress(USED + 2)).unwrap() != used {
            assert!(Instant::now() < deadline, "round {rounds} not completed");
            std::thread::sleep(Duration::from_millis(1));
        }
        for k in 0..WRITES {
            let status: u8 = mem.read_obj(GuestAddress(STATUS + u64::from(k))).unwrap();
            assert_eq!(
                u32::from(status),
                VIRTIO_BLK_S_OK,
                "write {k} of round {rounds}"
            );
        }
    }
    let last = snapshots.join().unwrap();
    drop(fe);
    daemon.stop();
    let got = qemu_raw(&last, tmp.path());
    assert!(
        got == model,
        "the chain after {rounds} rounds differs from the writes made"
    );
    for entry in std::fs::read_dir(tmp.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "qcow2") {
            let check = run_raw(std::process::Command::new("qemu-img").args(["check", s(&path)]));
            assert!(
                check.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&check.stdout)
            );
        }
    }
}

fn at_cluster(offset: u64) -> u64 {
    offset / (64 << 10)
}

/// One GET_FEATURES exchange on a raw vhost-user socket: the reply, or
/// how the exchange failed.
fn get_features(stream: &mut std::os::unix::net::UnixStream) -> std::io::Result<()> {
    use std::io::{Read, Write};
    // Request 1 (GET_FEATURES), flags: version 1, no payload.
    let mut msg = [0u8; 12];
    msg[..4].copy_from_slice(&1u32.to_le_bytes());
    msg[4..8].copy_from_slice(&1u32.to_le_bytes());
    stream.write_all(&msg)?;
    let mut reply = [0u8; 20];
    stream.read_exact(&mut reply)
}

#[test]
fn a_frontend_dialling_the_moment_a_killed_daemon_hangs_up_is_refused() {
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 1, "16M", "0");
    // The window is short (the dying process releases its descriptors one
    // by one): before the fix, about one kill in four hit it.
    for round in 0..40 {
        let mut daemon = Daemon::start(tmp.path(), &top, &[]);
        let mut first = UnixStream::connect(&daemon.socket).unwrap();
        get_features(&mut first).expect("the daemon answers its frontend");
        // SAFETY: kill(2) on the daemon this test started.
        unsafe { libc::kill(daemon.pid(), libc::SIGKILL) };
        let mut hangup = libc::pollfd {
            fd: first.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd this frame owns, its fd open.
        let ready = unsafe { libc::poll(&mut hangup, 1, 10_000) };
        assert_eq!(ready, 1, "round {round}: the connection never hung up");
        match UnixStream::connect(&daemon.socket) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            Err(e) => panic!("round {round}: dialling again failed otherwise: {e}"),
            Ok(mut again) => panic!(
                "round {round}: the dying daemon's socket took a connection, then: {:?}",
                get_features(&mut again)
            ),
        }
        use std::os::unix::process::ExitStatusExt;
        let status = daemon.stop_with(libc::SIGKILL);
        assert_eq!(status.signal(), Some(libc::SIGKILL), "round {round}");
    }
}

/// A request waiting for the export's I/O limits was taken off the ring:
/// when the frontend stops the ring (GET_VRING_BASE: a VM paused or
/// migrated), it starts whatever the limits and completes before the
/// ring's index is given back, as QEMU's drain restarts throttled
/// requests: none is lost, none runs twice after a restart.
#[test]
fn a_ring_stop_finishes_a_request_waiting_for_the_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "16M", "0.5");
    // 4 KiB a second: after a first 64 KiB write the next waits 16 s.
    let mut daemon = Daemon::start(tmp.path(), &top, &["--limits", "bps-write=4096"]);
    let guest = SharedGuestMemory::new(MEM);
    let mem = guest.mem.clone();
    let mock = MockSplitQueue::create(&mem, GuestAddress(0), QSIZE);
    let mut fe = frontend_with_ring(&daemon, &guest, &mock, |offered| offered);
    header(&mem, VIRTIO_BLK_T_OUT, 0);
    mem.write_slice(&[0x5a; 65536], GuestAddress(DATA)).unwrap();
    add_request(&mock, 0, false, 65536);
    add_request(&mock, 3, false, 65536);
    let kick = EventFd::new(0).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();
    wait_used(&mem, &mock, 1);
    std::thread::sleep(Duration::from_millis(300));
    let used = |mem: &Mem| -> u16 { mem.read_obj(mock.used_addr().unchecked_add(2)).unwrap() };
    assert_eq!(used(&mem), 1, "the second write did not wait for the limit");
    let base = fe.get_vring_base(0).unwrap();
    assert_eq!(base, 2, "both requests were taken");
    assert_eq!(
        used(&mem),
        2,
        "the ring stopped with a taken request never completed"
    );
    let status: u8 = mem.read_obj(GuestAddress(STATUS)).unwrap();
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    drop(fe);
    daemon.stop();
    let check = run_raw(std::process::Command::new("qemu-img").args(["check", s(&top)]));
    assert!(check.status.success());
}

/// A frontend that gives one blocking eventfd as the kick of its two
/// queues, on the one worker thread another export's queue shares, and
/// kicks once: epoll reports both, the first read empties the eventfd,
/// and a blocking second read would hold the thread (and every export on
/// it) for ever. The other export's guest must write on. A kick that is
/// not an eventfd (a pipe: readable for ever once its writer is gone) is
/// refused.
#[test]
fn a_hostile_kick_holds_up_no_other_export_on_its_thread() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for name in ["h", "g"] {
        common::qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            s(&d.join(format!("{name}.qcow2"))),
            "16M",
        ]);
    }
    let export = |id: &str, extra: &str| {
        format!(
            "socket={},image={},id={id}{extra}",
            s(&d.join(format!("{id}.sock"))),
            s(&d.join(format!("{id}.qcow2")))
        )
    };
    let args: Vec<String> = [
        "--worker-threads".to_string(),
        "1".into(),
        "--export".into(),
        export("h", ",num-queues=2"),
        "--export".into(),
        export("g", ""),
    ]
    .into();
    let mut daemon = Daemon::start_args(d, &args);

    let guest = SharedGuestMemory::new(MEM);
    let mem = guest.mem.clone();
    let mocks = [
        MockSplitQueue::create(&mem, GuestAddress(0), QSIZE),
        MockSplitQueue::create(&mem, GuestAddress(0x8_0000), QSIZE),
    ];
    let mut fe = Frontend::connect(d.join("h.sock"), 2).unwrap();
    fe.set_owner().unwrap();
    let offered = fe.get_features().unwrap();
    fe.set_features(offered).unwrap();
    let offered = fe.get_protocol_features().unwrap();
    fe.set_protocol_features(offered & VhostUserProtocolFeatures::MQ)
        .unwrap();
    fe.set_mem_table(&[guest.region()]).unwrap();
    for (q, mock) in mocks.iter().enumerate() {
        fe.set_vring_num(q, QSIZE).unwrap();
        fe.set_vring_addr(
            q,
            &VringConfigData {
                queue_max_size: QSIZE,
                queue_size: QSIZE,
                flags: 0,
                desc_table_addr: guest.host + mock.desc_table_addr().0,
                used_ring_addr: guest.host + mock.used_addr().0,
                avail_ring_addr: guest.host + mock.avail_addr().0,
                log_addr: None,
            },
        )
        .unwrap();
        fe.set_vring_base(q, 0).unwrap();
    }
    // Blocking (no EFD_NONBLOCK), the same for both queues.
    let kick = EventFd::new(0).unwrap();
    for q in 0..2 {
        fe.set_vring_kick(q, &kick).unwrap();
        fe.set_vring_enable(q, true).unwrap();
    }
    // Kicked a few times: each time epoll may report both queues.
    for _ in 0..10 {
        kick.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut g = common::vhost::connect_retry_to(&daemon, &d.join("g.sock"), 1, false);
    let written = g.try_write_within(0, &[0x47; 4096], Duration::from_secs(10));
    assert_eq!(
        written,
        Some(0),
        "the other export's write on the shared thread: {:?}\n{}",
        written,
        daemon.log()
    );
    assert!(g.read(0, 4096).iter().all(|b| *b == 0x47));

    // A pipe for a kick: the session is refused (the connection ends),
    // the other export serves on.
    let (pipe_read, pipe_write) = std::io::pipe().unwrap();
    drop(pipe_write);
    let pipe_kick = unsafe {
        // SAFETY: the descriptor is the pipe's, owned by `pipe_read`,
        // which outlives `pipe_kick`'s use (only its number is sent).
        use std::os::fd::{AsRawFd, FromRawFd};
        std::mem::ManuallyDrop::new(EventFd::from_raw_fd(pipe_read.as_raw_fd()))
    };
    let _ = fe.set_vring_kick(0, &pipe_kick);
    let refused = fe.get_features();
    assert!(refused.is_err(), "a pipe taken as a kick");
    assert_eq!(
        g.try_write_within(4096, &[0x48; 4096], Duration::from_secs(10)),
        Some(0),
        "{}",
        daemon.log()
    );
    drop(pipe_read);
    drop(g);
    drop(fe);
    daemon.stop();
}
