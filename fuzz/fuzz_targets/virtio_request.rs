//! virtio-blk requests from raw descriptor bytes, through the whole queue
//! worker: descriptor table, request parsing, guest-memory checks, I/O on
//! a real image file and completion. Every request must be answered or
//! dropped, never panic or hang, and the worker must keep serving.
//!
//! Input: `[n][head][n x 13-byte descriptor][payload]`. A descriptor is
//! `[sel][addr: u32 LE][len: u32 LE][flags][next: u16 LE][unused]`; its
//! address lies in the payload area of the 4 MiB guest memory unless
//! `sel` bit 7 is set, when it is `addr << (sel & 63)` (anywhere). The
//! payload (request headers, data) is written at the payload area.

#![no_main]

#[path = "scratch.rs"]
mod scratch;

use std::cell::RefCell;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use sqcow2_vhost::internals::{
    BlkDevice, ChainHandle, DeviceOptions, GuestMem, GuestMemAtomic, QueueWorker,
};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};

const MEM_SIZE: u64 = 4 << 20;
const QUEUE_SIZE: u16 = 16;
const PAYLOAD: u64 = 0x1_0000;

struct Harness {
    _dir: tempfile::TempDir,
    mem: GuestMem,
    atomic: GuestMemAtomic,
    worker: QueueWorker,
}

fn harness() -> Harness {
    let (dir, _, chain, _) = scratch::scratch_chain(4 << 20);
    let device = Arc::new(
        BlkDevice::new(
            Arc::new(ChainHandle::new(chain)),
            DeviceOptions::new(1, QUEUE_SIZE),
        )
        .expect("device"),
    );
    let mem = GuestMem::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).expect("memory");
    Harness {
        _dir: dir,
        atomic: GuestMemoryAtomic::new(mem.clone()),
        mem,
        worker: QueueWorker::new(device).expect("worker"),
    }
}

thread_local! {
    static HARNESS: RefCell<Harness> = RefCell::new(harness());
}

fuzz_target!(|data: &[u8]| {
    let [n, head, rest @ ..] = data else {
        return;
    };
    let n = usize::from(*n % QUEUE_SIZE as u8) + 1;
    if rest.len() < n * 13 {
        return;
    }
    let (descs, payload) = rest.split_at(n * 13);
    HARNESS.with(|h| {
        let h = &mut *h.borrow_mut();
        let room = (MEM_SIZE - PAYLOAD) as usize;
        let _ = h
            .mem
            .write_slice(&payload[..payload.len().min(room)], GuestAddress(PAYLOAD));
        let mock = MockSplitQueue::create(&h.mem, GuestAddress(0), QUEUE_SIZE);
        for (i, d) in descs.chunks_exact(13).enumerate() {
            let a = u32::from_le_bytes([d[1], d[2], d[3], d[4]]);
            let len = u32::from_le_bytes([d[5], d[6], d[7], d[8]]);
            let addr = if d[0] & 0x80 != 0 {
                u64::from(a).wrapping_shl(u32::from(d[0] & 63))
            } else {
                PAYLOAD + u64::from(a) % (MEM_SIZE - PAYLOAD)
            };
            let flags = u16::from(d[9] & 7);
            let next = u16::from_le_bytes([d[10], d[11]]);
            let raw = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            let _ = mock.desc_table().store(i as u16, raw);
        }
        if let Ok(slot) = mock.avail().ring().ref_at(0) {
            slot.store(u16::from(*head) % QUEUE_SIZE);
        }
        mock.avail().idx().store(1);
        let Ok(mut queue) = mock.create_queue::<Queue>() else {
            return;
        };
        let _ = h.worker.process_queue(0, &mut queue, &h.atomic);
        h.worker.drain();
        for c in h.worker.take_completions() {
            let _ = queue.add_used(&h.mem, c.head, c.len);
        }
        assert_eq!(h.worker.in_flight(), 0, "a request was left in flight");
    });
});
