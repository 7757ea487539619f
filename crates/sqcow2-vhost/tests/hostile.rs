//! Hostile guests: malformed descriptor chains built with virtio-queue's
//! mock split queue and fed straight to a queue worker. Every request
//! must get the right status (or no status where there is no room for
//! one), and the queue must keep serving valid requests afterwards. Also
//! the worker's accounting of latencies, which the same harness drives.

use std::path::Path;
use std::sync::Arc;

use sqcow2_format::create::{create, CreateOptions};
use sqcow2_format::{Chain, ChainOptions};
use sqcow2_vhost::internals::{
    BlkDevice, ChainHandle, DeviceOptions, GuestMem, GuestMemAtomic, QueueWorker,
};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};

const MEM_SIZE: u64 = 128 << 20;
const DISK_SIZE: u64 = 4 << 20;
const QUEUE_SIZE: u16 = 256;
/// Request headers, data and status bytes live from here on.
const HEADER: u64 = 0x10_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0x1F_0000;
const PATTERN: u8 = 0x5A;

/// A descriptor as the guest would write it.
#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    write: bool,
}

fn r(addr: u64, len: u32) -> Desc {
    Desc {
        addr,
        len,
        write: false,
    }
}
fn w(addr: u64, len: u32) -> Desc {
    Desc {
        addr,
        len,
        write: true,
    }
}

struct Guest {
    _dir: tempfile::TempDir,
    mem: GuestMem,
    atomic: GuestMemAtomic,
    worker: QueueWorker,
    device: Arc<BlkDevice>,
    next_desc: u16,
}

impl Guest {
    /// A 4 MiB image filled with PATTERN, exported read-write or not.
    fn new(read_only: bool) -> Guest {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.qcow2");
        create(
            &image,
            &CreateOptions {
                size: DISK_SIZE,
                ..CreateOptions::default()
            },
        )
        .unwrap();
        fill(&image);
        let chain = Chain::open(
            &image,
            &ChainOptions {
                writable: !read_only,
                ..ChainOptions::default()
            },
        )
        .unwrap();
        let device = Arc::new(
            BlkDevice::new(
                Arc::new(ChainHandle::new(chain)),
                DeviceOptions::new(1, QUEUE_SIZE),
            )
            .unwrap(),
        );
        let mem = GuestMem::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap();
        let atomic = GuestMemoryAtomic::new(mem.clone());
        Guest {
            _dir: dir,
            mem,
            atomic,
            worker: QueueWorker::new(device.clone()).unwrap(),
            device,
            next_desc: 0,
        }
    }

    fn header(&self, request_type: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&request_type.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(HEADER)).unwrap();
        self.mem.write_obj(0xFFu8, GuestAddress(STATUS)).unwrap();
    }

    /// Submits one chain and runs the worker until it is answered;
    /// returns the used length and the status byte.
    fn submit(&mut self, descs: &[Desc]) -> (u32, u8) {
        let first = self.next_desc;
        let (mock, mut queue) = offer(&self.mem, first, descs);
        self.next_desc = (first + descs.len() as u16) % QUEUE_SIZE;
        self.worker
            .process_queue(0, &mut queue, &self.atomic)
            .unwrap();
        self.worker.drain();
        for c in self.worker.take_completions() {
            queue.add_used(&self.mem, c.head, c.len).unwrap();
        }
        let used = mock.used_addr();
        let idx: u16 = self.mem.read_obj(used.unchecked_add(2)).unwrap();
        assert_eq!(idx, 1, "exactly one request answered");
        let id: u32 = self.mem.read_obj(used.unchecked_add(4)).unwrap();
        assert_eq!(id, u32::from(first), "answer for the submitted chain");
        let len: u32 = self.mem.read_obj(used.unchecked_add(8)).unwrap();
        let status: u8 = self.mem.read_obj(GuestAddress(STATUS)).unwrap();
        (len, status)
    }

    /// Discards cluster 2 (sectors 256..384), so that the next write
    /// there allocates.
    fn discard_cluster_2(&mut self) {
        self.mem
            .write_slice(&zero_segment(256, 128, 0), GuestAddress(DATA))
            .unwrap();
        self.header(VIRTIO_BLK_T_DISCARD, 0);
        let (_, status) = self.submit(&[r(HEADER, 16), r(DATA, 16), w(STATUS, 1)]);
        assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    }

    /// A valid 4 KiB read at sector 8 still works and returns PATTERN.
    fn assert_still_serving(&mut self) {
        self.mem
            .write_slice(&[0u8; 4096], GuestAddress(DATA))
            .unwrap();
        self.header(VIRTIO_BLK_T_IN, 8);
        let (len, status) = self.submit(&[r(HEADER, 16), w(DATA, 4096), w(STATUS, 1)]);
        assert_eq!((len, u32::from(status)), (4097, VIRTIO_BLK_S_OK));
        let mut got = [0u8; 4096];
        self.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert!(
            got.iter().all(|&b| b == PATTERN),
            "data after a hostile request"
        );
    }
}

use vm_memory::Address;

/// A fresh queue on `mem` holding one descriptor chain of `descs`, its
/// head at descriptor `first`.
fn offer<'m>(
    mem: &'m GuestMem,
    first: u16,
    descs: &[Desc],
) -> (MockSplitQueue<'m, GuestMem>, Queue) {
    let mock = MockSplitQueue::create(mem, GuestAddress(0), QUEUE_SIZE);
    let raw: Vec<RawDescriptor> = descs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let last = i + 1 == descs.len();
            let mut flags = if d.write {
                VRING_DESC_F_WRITE as u16
            } else {
                0
            };
            if !last {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let next = (first + i as u16 + 1) % QUEUE_SIZE;
            RawDescriptor::from(SplitDescriptor::new(d.addr, d.len, flags, next))
        })
        .collect();
    mock.add_desc_chains(&raw, first).unwrap();
    let queue = mock.create_queue().unwrap();
    (mock, queue)
}

fn fill(image: &Path) {
    let chain = Chain::open(
        image,
        &ChainOptions {
            writable: true,
            ..ChainOptions::default()
        },
    )
    .unwrap();
    chain
        .write_at(&vec![PATTERN; DISK_SIZE as usize], 0)
        .unwrap();
    chain.close().unwrap();
}

fn expect(guest: &mut Guest, descs: &[Desc], want: u32, what: &str) {
    let (len, status) = guest.submit(descs);
    assert_eq!(u32::from(status), want, "{what}: status");
    assert_eq!(len, 1, "{what}: used length");
    guest.assert_still_serving();
}

const IOERR: u32 = VIRTIO_BLK_S_IOERR;
const UNSUPP: u32 = VIRTIO_BLK_S_UNSUPP;

#[test]
fn buffers_outside_guest_memory() {
    let mut g = Guest::new(false);
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(MEM_SIZE - 2048, 4096), w(STATUS, 1)],
        IOERR,
        "read into the end of memory",
    );
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(u64::MAX - 511, 512), w(STATUS, 1)],
        IOERR,
        "address wraps",
    );
    g.header(VIRTIO_BLK_T_OUT, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), r(MEM_SIZE + (1 << 30), 4096), w(STATUS, 1)],
        IOERR,
        "write from outside",
    );
    expect(
        &mut g,
        &[r(MEM_SIZE + 4096, 16), w(STATUS, 1)],
        IOERR,
        "header outside memory",
    );
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(DATA, u32::MAX - 511), w(STATUS, 1)],
        IOERR,
        "4 GiB buffer",
    );
}

#[test]
fn wrong_device_writable_flags() {
    let mut g = Guest::new(false);
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), r(DATA, 4096), w(STATUS, 1)],
        IOERR,
        "read into a read-only buffer",
    );
    g.header(VIRTIO_BLK_T_OUT, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(DATA, 4096), w(STATUS, 1)],
        IOERR,
        "write from a write-only buffer",
    );
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[w(HEADER, 16), w(DATA, 4096), w(STATUS, 1)],
        IOERR,
        "write-only header",
    );
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[
            r(HEADER, 16),
            w(DATA, 4096),
            r(DATA + 8192, 512),
            w(STATUS, 1),
        ],
        IOERR,
        "readable after writable",
    );
    g.header(VIRTIO_BLK_T_FLUSH, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), r(DATA, 512), w(STATUS, 1)],
        OK_FLUSH_WITH_DATA,
        "flush with a payload",
    );
}

/// A flush with a stray readable payload is still a flush.
const OK_FLUSH_WITH_DATA: u32 = VIRTIO_BLK_S_OK;

#[test]
fn missing_or_short_status_and_header() {
    let mut g = Guest::new(false);
    g.header(VIRTIO_BLK_T_IN, 0);
    let (len, status) = g.submit(&[r(HEADER, 16), r(DATA, 4096)]);
    assert_eq!(
        (len, status),
        (0, 0xFF),
        "no writable byte: nothing written"
    );
    g.assert_still_serving();
    g.header(VIRTIO_BLK_T_IN, 0);
    let (len, status) = g.submit(&[r(HEADER, 16), w(STATUS, 0)]);
    assert_eq!(
        (len, status),
        (0, 0xFF),
        "zero-length status: nothing written"
    );
    g.assert_still_serving();
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[r(HEADER, 8), w(STATUS, 1)],
        IOERR,
        "8-byte header",
    );
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(&mut g, &[r(HEADER, 0), w(STATUS, 1)], IOERR, "empty header");
    // A header split over two descriptors is valid framing.
    g.header(VIRTIO_BLK_T_IN, 8);
    let (len, status) = g.submit(&[r(HEADER, 4), r(HEADER + 4, 12), w(DATA, 4096), w(STATUS, 1)]);
    assert_eq!((len, u32::from(status)), (4097, VIRTIO_BLK_S_OK));
}

#[test]
fn ranges_beyond_capacity_and_sector_overflow() {
    let mut g = Guest::new(false);
    let sectors = DISK_SIZE / 512;
    for (sector, what) in [
        (sectors, "first sector past the end"),
        (sectors - 1, "last sector plus one more"),
        (u64::MAX, "sector overflow"),
        (u64::MAX / 512 + 1, "byte offset overflow"),
    ] {
        for t in [VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT] {
            g.header(t, sector);
            let data = if t == VIRTIO_BLK_T_IN {
                w(DATA, 1024)
            } else {
                r(DATA, 1024)
            };
            expect(&mut g, &[r(HEADER, 16), data, w(STATUS, 1)], IOERR, what);
        }
    }
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(DATA, 1000), w(STATUS, 1)],
        IOERR,
        "not a multiple of 512",
    );
}

#[test]
fn zero_length_and_huge_requests() {
    let mut g = Guest::new(false);
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(STATUS, 1)],
        VIRTIO_BLK_S_OK,
        "zero-length read",
    );
    g.header(VIRTIO_BLK_T_OUT, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(STATUS, 1)],
        VIRTIO_BLK_S_OK,
        "zero-length write",
    );
    // The whole disk in one request, from 64 buffers of 64 KiB.
    g.header(VIRTIO_BLK_T_IN, 0);
    let mut descs = vec![r(HEADER, 16)];
    descs.extend((0..64).map(|i| w(DATA + i * 65536, 65536)));
    descs.push(w(STATUS, 1));
    let (len, status) = g.submit(&descs);
    assert_eq!(
        (len, u32::from(status)),
        (DISK_SIZE as u32 + 1, VIRTIO_BLK_S_OK)
    );
    let mut got = vec![0u8; DISK_SIZE as usize];
    g.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert!(got.iter().all(|&b| b == PATTERN));
    // Larger than the disk: refused.
    g.header(VIRTIO_BLK_T_IN, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(DATA, DISK_SIZE as u32 + 512), w(STATUS, 1)],
        IOERR,
        "larger than the disk",
    );
}

#[test]
fn writes_to_a_read_only_export() {
    let mut g = Guest::new(true);
    g.header(VIRTIO_BLK_T_OUT, 0);
    g.mem.write_slice(&[0u8; 4096], GuestAddress(DATA)).unwrap();
    expect(
        &mut g,
        &[r(HEADER, 16), r(DATA, 4096), w(STATUS, 1)],
        IOERR,
        "write",
    );
    let seg = zero_segment(0, 8, 0);
    g.mem.write_slice(&seg, GuestAddress(DATA)).unwrap();
    for t in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES] {
        g.header(t, 0);
        expect(
            &mut g,
            &[r(HEADER, 16), r(DATA, 16), w(STATUS, 1)],
            IOERR,
            "discard/write-zeroes",
        );
    }
    g.header(VIRTIO_BLK_T_FLUSH, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(STATUS, 1)],
        VIRTIO_BLK_S_OK,
        "flush",
    );
}

fn zero_segment(sector: u64, sectors: u32, flags: u32) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[..8].copy_from_slice(&sector.to_le_bytes());
    s[8..12].copy_from_slice(&sectors.to_le_bytes());
    s[12..].copy_from_slice(&flags.to_le_bytes());
    s
}

#[test]
fn unknown_types_and_bad_discard_payloads() {
    let mut g = Guest::new(false);
    for t in [2, 3, 14, 15, 99, u32::MAX] {
        g.header(t, 0);
        expect(
            &mut g,
            &[r(HEADER, 16), w(STATUS, 1)],
            UNSUPP,
            "unknown type",
        );
    }
    let cases: [(u32, Vec<u8>, u32, &str); 6] = [
        (
            VIRTIO_BLK_T_DISCARD,
            zero_segment(0, 8, 1).to_vec(),
            UNSUPP,
            "discard with unmap flag",
        ),
        (
            VIRTIO_BLK_T_WRITE_ZEROES,
            zero_segment(0, 8, 2).to_vec(),
            UNSUPP,
            "unknown write-zeroes flag",
        ),
        (
            VIRTIO_BLK_T_DISCARD,
            zero_segment(0, 8, 0)[..10].to_vec(),
            IOERR,
            "partial range",
        ),
        (VIRTIO_BLK_T_DISCARD, Vec::new(), IOERR, "no range"),
        (
            VIRTIO_BLK_T_WRITE_ZEROES,
            zero_segment(DISK_SIZE / 512 - 4, 8, 0).to_vec(),
            IOERR,
            "beyond capacity",
        ),
        (
            VIRTIO_BLK_T_DISCARD,
            zero_segment(u64::MAX, 8, 0).to_vec(),
            IOERR,
            "sector overflow",
        ),
    ];
    for (t, payload, want, what) in cases {
        g.mem.write_slice(&payload, GuestAddress(DATA)).unwrap();
        g.header(t, 0);
        let mut descs = vec![r(HEADER, 16)];
        if !payload.is_empty() {
            descs.push(r(DATA, payload.len() as u32));
        }
        descs.push(w(STATUS, 1));
        expect(&mut g, &descs, want, what);
    }
    let many: Vec<u8> = (0..17).flat_map(|i| zero_segment(i * 8, 8, 0)).collect();
    g.mem.write_slice(&many, GuestAddress(DATA)).unwrap();
    g.header(VIRTIO_BLK_T_DISCARD, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), r(DATA, many.len() as u32), w(STATUS, 1)],
        IOERR,
        "17 ranges",
    );
}

#[test]
fn valid_requests_of_every_type() {
    let mut g = Guest::new(false);
    // Write 8 KiB of 0x11 at sector 16, read it back.
    g.mem
        .write_slice(&[0x11u8; 8192], GuestAddress(DATA))
        .unwrap();
    g.header(VIRTIO_BLK_T_OUT, 16);
    expect(
        &mut g,
        &[
            r(HEADER, 16),
            r(DATA, 4096),
            r(DATA + 4096, 4096),
            w(STATUS, 1),
        ],
        VIRTIO_BLK_S_OK,
        "write",
    );
    g.header(VIRTIO_BLK_T_IN, 16);
    let (len, status) = g.submit(&[r(HEADER, 16), w(DATA + 65536, 8192), w(STATUS, 1)]);
    assert_eq!((len, u32::from(status)), (8193, VIRTIO_BLK_S_OK));
    let mut got = [0u8; 8192];
    g.mem
        .read_slice(&mut got, GuestAddress(DATA + 65536))
        .unwrap();
    assert!(got.iter().all(|&b| b == 0x11));
    // Write-zeroes over it, then it reads as zeros.
    g.mem
        .write_slice(&zero_segment(16, 16, 1), GuestAddress(DATA))
        .unwrap();
    g.header(VIRTIO_BLK_T_WRITE_ZEROES, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), r(DATA, 16), w(STATUS, 1)],
        VIRTIO_BLK_S_OK,
        "write-zeroes",
    );
    g.header(VIRTIO_BLK_T_IN, 16);
    let (_, status) = g.submit(&[r(HEADER, 16), w(DATA + 65536, 8192), w(STATUS, 1)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    g.mem
        .read_slice(&mut got, GuestAddress(DATA + 65536))
        .unwrap();
    assert!(got.iter().all(|&b| b == 0));
    // Discard of a whole cluster, flush, GET_ID.
    g.mem
        .write_slice(&zero_segment(256, 128, 0), GuestAddress(DATA))
        .unwrap();
    g.header(VIRTIO_BLK_T_DISCARD, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), r(DATA, 16), w(STATUS, 1)],
        VIRTIO_BLK_S_OK,
        "discard",
    );
    g.header(VIRTIO_BLK_T_FLUSH, 0);
    expect(
        &mut g,
        &[r(HEADER, 16), w(STATUS, 1)],
        VIRTIO_BLK_S_OK,
        "flush",
    );
    g.header(VIRTIO_BLK_T_GET_ID, 0);
    let (len, status) = g.submit(&[r(HEADER, 16), w(DATA, 20), w(STATUS, 1)]);
    assert_eq!((len, u32::from(status)), (21, VIRTIO_BLK_S_OK));
    let mut id = [0u8; 20];
    g.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id[..10], b"disk.qcow2");
}

#[test]
fn descriptor_loops_and_indirect_tables_outside_memory() {
    use virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT;
    let mut g = Guest::new(false);
    let mock = MockSplitQueue::create(&g.mem, GuestAddress(0), QUEUE_SIZE);
    // Descriptor 0 -> 1 -> 0 -> ...: a loop with no writable byte.
    g.header(VIRTIO_BLK_T_IN, 0);
    let looped = [
        RawDescriptor::from(SplitDescriptor::new(
            HEADER,
            16,
            VRING_DESC_F_NEXT as u16,
            1,
        )),
        RawDescriptor::from(SplitDescriptor::new(DATA, 512, VRING_DESC_F_NEXT as u16, 0)),
    ];
    mock.add_desc_chains(&looped, 0).unwrap();
    // An indirect table far outside guest memory.
    let indirect = [RawDescriptor::from(SplitDescriptor::new(
        MEM_SIZE * 4,
        16 * 4,
        VRING_DESC_F_INDIRECT as u16,
        0,
    ))];
    mock.add_desc_chains(&indirect, 2).unwrap();
    let mut queue: Queue = mock.create_queue().unwrap();
    g.worker.process_queue(0, &mut queue, &g.atomic).unwrap();
    g.worker.drain();
    let used = mock.used_addr();
    let idx: u16 = g.mem.read_obj(used.unchecked_add(2)).unwrap();
    assert_eq!(idx, 2, "both chains answered");
    for i in 0..2u64 {
        let len: u32 = g.mem.read_obj(used.unchecked_add(8 + 8 * i)).unwrap();
        assert_eq!(len, 0, "no status byte to write");
    }
    g.next_desc = 3;
    g.assert_still_serving();
}

#[test]
fn a_used_ring_outside_memory_is_an_error_not_a_crash() {
    let mut g = Guest::new(false);
    let mock = MockSplitQueue::create(&g.mem, GuestAddress(0), QUEUE_SIZE);
    // GET_ID completes on the spot, so its used entry is written while the
    // queue is processed (flushes complete later, from the flusher).
    g.header(VIRTIO_BLK_T_GET_ID, 0);
    let raw = [
        RawDescriptor::from(SplitDescriptor::new(
            HEADER,
            16,
            VRING_DESC_F_NEXT as u16,
            1,
        )),
        RawDescriptor::from(SplitDescriptor::new(
            STATUS,
            1,
            VRING_DESC_F_WRITE as u16,
            0,
        )),
    ];
    mock.add_desc_chains(&raw, 0).unwrap();
    let mut queue: Queue = mock.create_queue().unwrap();
    let far = MEM_SIZE * 8;
    queue.set_used_ring_address(Some(far as u32), Some((far >> 32) as u32));
    assert!(g.worker.process_queue(0, &mut queue, &g.atomic).is_err());
    g.next_desc = 2;
    g.assert_still_serving();
}

/// A panic on an engine thread in the middle of a metadata update (a
/// bug, made to happen by a test hook): the request fails with IOERR, the
/// panic is counted, the chain refuses writes from then on (in place or
/// not) and says why, and reads go on.
#[test]
fn a_panic_mid_update_fails_writes_from_then_on_and_reads_go_on() {
    let mut g = Guest::new(false);
    g.discard_cluster_2();
    g.device
        .chain()
        .arm_fault(sqcow2_format::FaultPoint::MidMetadataUpdate, 1);
    let write = |g: &mut Guest, sector: u64| {
        g.mem
            .write_slice(&[0x42u8; 4096], GuestAddress(DATA))
            .unwrap();
        g.header(VIRTIO_BLK_T_OUT, sector);
        let (_, status) = g.submit(&[r(HEADER, 16), r(DATA, 4096), w(STATUS, 1)]);
        u32::from(status)
    };
    assert_eq!(write(&mut g, 256), IOERR, "the write that panicked");
    assert_eq!(g.device.panics(), 1);
    let failure = g.device.chain().failure().map(str::to_owned);
    assert!(
        failure.as_deref().is_some_and(|f| f.contains("panic")),
        "{failure:?}"
    );
    // Allocating and in-place writes are refused now.
    assert_eq!(
        write(&mut g, 512),
        IOERR,
        "allocating write after the panic"
    );
    assert_eq!(write(&mut g, 8), IOERR, "in-place write after the panic");
    g.header(VIRTIO_BLK_T_FLUSH, 0);
    let (_, status) = g.submit(&[r(HEADER, 16), w(STATUS, 1)]);
    assert_eq!(u32::from(status), IOERR, "flush after the panic");
    g.next_desc = 0;
    g.assert_still_serving();
}

/// An available index more than a queue ahead of the device (a guest
/// that lies, or a frontend that handed over a wrong base): the worker
/// gives up on the queue with an error instead of spinning on it, with or
/// without event-index notifications, and goes on serving other queues.
#[test]
fn an_available_index_past_the_queue_size_is_an_error_not_a_spin() {
    for event_idx in [false, true] {
        let mut g = Guest::new(false);
        let mock = MockSplitQueue::create(&g.mem, GuestAddress(0), QUEUE_SIZE);
        g.header(VIRTIO_BLK_T_GET_ID, 0);
        mock.avail().idx().store(QUEUE_SIZE + 3);
        let mut queue: Queue = mock.create_queue().unwrap();
        queue.set_event_idx(event_idx);
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = std::thread::spawn(move || {
            let result = g.worker.process_queue(0, &mut queue, &g.atomic);
            let _ = tx.send(result.is_err());
            g
        });
        let failed = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("process_queue spins (event_idx {event_idx})"));
        assert!(
            failed,
            "a broken available index is an error (event_idx {event_idx})"
        );
        let mut g = worker.join().unwrap();
        g.next_desc = 0;
        g.assert_still_serving();
    }
}

/// Not hostile, but the same harness: a request's latency counts until
/// its completion is handled, also when busy-poll steps handle them one
/// after another (no new request between them). A read (io_uring, done
/// in microseconds) and a flush (the flusher thread, a sync: much later)
/// are taken in one round; once the read has been handled the test waits
/// 50 ms before the next poll step, so the flush's latency is at least
/// that. (Two flushes, tried first, were often answered by one batched
/// flush, in one poll step: the test failed on a loaded machine.)
#[test]
fn busy_poll_steps_time_each_completion_when_it_is_handled() {
    const FLUSH_HEADER: u64 = HEADER + 0x100;
    let wait = std::time::Duration::from_millis(50);
    let mut g = Guest::new(false);
    for _attempt in 0..50 {
        g.header(VIRTIO_BLK_T_IN, 0);
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&VIRTIO_BLK_T_FLUSH.to_le_bytes());
        g.mem.write_slice(&h, GuestAddress(FLUSH_HEADER)).unwrap();
        let desc = |addr: u64, len: u32, write: bool, next: Option<u16>| {
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            if next.is_some() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next.unwrap_or(0)))
        };
        let chains = vec![
            desc(HEADER, 16, false, Some(1)),
            desc(DATA, 4096, true, Some(2)),
            desc(STATUS, 1, true, None),
            desc(FLUSH_HEADER, 16, false, Some(4)),
            desc(STATUS + 1, 1, true, None),
        ];
        let mock = MockSplitQueue::create(&g.mem, GuestAddress(0), QUEUE_SIZE);
        mock.add_desc_chains(&chains, 0).unwrap();
        let mut queue: Queue = mock.create_queue().unwrap();
        g.worker.process_queue(0, &mut queue, &g.atomic).unwrap();
        let poll = |g: &mut Guest| loop {
            g.worker.poll_finished();
            let done = g.worker.take_completions().len();
            if done > 0 {
                return done;
            }
            std::thread::yield_now();
        };
        if poll(&mut g) == 2 {
            // Both handled in one step: nothing to tell apart; again.
            continue;
        }
        std::thread::sleep(wait);
        assert_eq!(poll(&mut g), 1);
        let hist = &g.worker.stats()[0].latency_us;
        assert!(
            hist.max() >= wait.as_micros() as u64,
            "the flush, handled after {wait:?}, was timed at {} us",
            hist.max()
        );
        return;
    }
    panic!("the read and the flush were always handled in one poll step");
}

/// Not hostile, but the same harness: the worker never waits for an
/// allocating write, even one that is all it has (no request in flight,
/// none behind it): a stall of the engine in it (2 s, a test hook) holds
/// an engine thread, not the worker, which returns with the write not yet
/// answered and completes it later. A slow or remote disk under that
/// write must not hold requests the guest sends meanwhile.
#[test]
fn the_worker_never_waits_for_a_lone_allocating_write() {
    let mut g = Guest::new(false);
    g.discard_cluster_2();
    g.device
        .chain()
        .stall_at(sqcow2_format::FaultPoint::BeforeJournalRecord, 2000);
    g.mem
        .write_slice(&[0x42u8; 4096], GuestAddress(DATA))
        .unwrap();
    g.header(VIRTIO_BLK_T_OUT, 256);
    let (mock, mut queue) = offer(&g.mem, 0, &[r(HEADER, 16), r(DATA, 4096), w(STATUS, 1)]);
    g.worker.process_queue(0, &mut queue, &g.atomic).unwrap();
    let used: u16 = g.mem.read_obj(mock.used_addr().unchecked_add(2)).unwrap();
    let answered = usize::from(used) + g.worker.take_completions().len();
    assert_eq!(answered, 0, "the worker waited for the allocating write");
    g.worker.drain();
    assert_eq!(g.worker.take_completions().len(), 1);
    let status: u8 = g.mem.read_obj(GuestAddress(STATUS)).unwrap();
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    g.next_desc = 0;
    g.assert_still_serving();
}
