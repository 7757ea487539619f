//! A split virtqueue driven by hand in shared guest memory, for tests that
//! speak vhost-user message by message (rust-vmm's frontend): descriptor
//! table, available and used rings at fixed places, 4 KiB write requests.

use std::time::{Duration, Instant};

use virtio_bindings::virtio_blk::VIRTIO_BLK_T_OUT;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::vhost::Daemon;

/// Guest memory size.
pub const MEM: usize = 16 << 20;
/// Queue size.
pub const QSIZE: u16 = 16;
/// Where the rings lie in guest memory.
pub const DESC: u64 = 0x1000;
pub const AVAIL: u64 = 0x2000;
pub const USED: u64 = 0x3000;
/// The sector the write requests write to.
pub const SECTOR: u64 = 4096;

pub type Mem = GuestMemoryMmap<()>;

/// Request `r` uses descriptors 3r..3r+2 and these buffers.
pub fn header_at(r: u64) -> u64 {
    0x10_0000 + r * 0x1000
}
pub fn data_at(r: u64) -> u64 {
    0x20_0000 + r * 0x1_0000
}
pub fn status_at(r: u64) -> u64 {
    0x30_0000 + r * 0x1000
}

pub fn put_desc(mem: &Mem, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
    let mut raw = [0u8; 16];
    raw[0..8].copy_from_slice(&addr.to_le_bytes());
    raw[8..12].copy_from_slice(&len.to_le_bytes());
    raw[12..14].copy_from_slice(&flags.to_le_bytes());
    raw[14..16].copy_from_slice(&next.to_le_bytes());
    mem.write_slice(&raw, GuestAddress(DESC + u64::from(i) * 16))
        .unwrap();
}

/// Request `r`: a 4 KiB write of `fill` at sector `sector`, descriptors
/// from 3r; returns its head.
pub fn write_request_at(mem: &Mem, r: u16, fill: u8, sector: u64) -> u16 {
    let r64 = u64::from(r);
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&VIRTIO_BLK_T_OUT.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(header_at(r64))).unwrap();
    mem.write_slice(&[fill; 4096], GuestAddress(data_at(r64)))
        .unwrap();
    mem.write_obj(0xFFu8, GuestAddress(status_at(r64))).unwrap();
    let head = 3 * r;
    let next = VRING_DESC_F_NEXT as u16;
    put_desc(mem, head, header_at(r64), 16, next, head + 1);
    put_desc(mem, head + 1, data_at(r64), 4096, next, head + 2);
    put_desc(
        mem,
        head + 2,
        status_at(r64),
        1,
        VRING_DESC_F_WRITE as u16,
        0,
    );
    head
}

/// Request `r`: a 4 KiB write of `fill` at sector [`SECTOR`].
pub fn write_request(mem: &Mem, r: u16, fill: u8) -> u16 {
    write_request_at(mem, r, fill, SECTOR)
}

/// Puts `head` on the available ring at position `pos` and publishes
/// `pos + 1` as the available index.
pub fn make_available(mem: &Mem, pos: u16, head: u16) {
    let slot = AVAIL + 4 + u64::from(pos % QSIZE) * 2;
    mem.write_obj(head, GuestAddress(slot)).unwrap();
    mem.write_obj(pos.wrapping_add(1), GuestAddress(AVAIL + 2))
        .unwrap();
}

pub fn used_idx(mem: &Mem) -> u16 {
    mem.read_obj(GuestAddress(USED + 2)).unwrap()
}

/// The used ring's flags (`VRING_USED_F_NO_NOTIFY`: do not kick).
pub fn used_flags(mem: &Mem) -> u16 {
    mem.read_obj(GuestAddress(USED)).unwrap()
}

/// The device's `avail_event` (with `VIRTIO_RING_F_EVENT_IDX`: kick when
/// the available index passes it).
pub fn avail_event(mem: &Mem) -> u16 {
    mem.read_obj(GuestAddress(USED + 4 + 8 * u64::from(QSIZE)))
        .unwrap()
}

pub fn wait_used(mem: &Mem, want: u16, daemon: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while used_idx(mem) < want {
        assert!(
            Instant::now() < deadline,
            "used index {} never reached {want}\n{}",
            used_idx(mem),
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
