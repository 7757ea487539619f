//! Descriptor chains walked from a head index: every request's, whether
//! the head came off the available ring or back from the inflight region
//! (a request a previous backend took and never completed). The rules are
//! virtio-queue's: at most `queue_size` descriptors, one level of indirect
//! table whose entries are then the whole rest of the chain, at most 2^32
//! bytes in all; where its iterator cuts a bad chain short, the walk
//! refuses it. Each descriptor is read once (the guest cannot change it
//! between a check and its use).

use smallvec::SmallVec;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, VolatileMemory, VolatileSlice};

use crate::transport::guest_mem::GuestBuffer;
use crate::transport::guest_mem::GuestMem;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;
/// Bytes of one descriptor.
const DESC_SIZE: u64 = 16;

/// One descriptor of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Descriptor {
    pub(crate) buffer: GuestBuffer,
    pub(crate) write_only: bool,
}

/// A descriptor table: translated to host memory once where it lies in
/// one region (the usual case: one lookup per table, not per
/// descriptor), read descriptor by descriptor through guest memory where
/// it straddles regions.
struct Table<'m> {
    mem: &'m GuestMem,
    addr: GuestAddress,
    size: u16,
    host: Option<VolatileSlice<'m, ()>>,
}

impl<'m> Table<'m> {
    fn new(mem: &'m GuestMem, addr: GuestAddress, size: u16) -> Self {
        let host = mem
            .get_slice(addr, usize::from(size) * DESC_SIZE as usize)
            .ok();
        Table {
            mem,
            addr,
            size,
            host,
        }
    }

    /// Descriptor `index` (below `size`): address, length, flags, next.
    fn read(&self, index: u16) -> Result<(u64, u32, u16, u16), &'static str> {
        let at = u64::from(index) * DESC_SIZE;
        let raw = match &self.host {
            Some(table) => table
                .get_ref::<[u8; 16]>(at as usize)
                .map(|r| r.load())
                .map_err(|_| "descriptor outside guest memory")?,
            None => {
                let at = self
                    .addr
                    .checked_add(at)
                    .ok_or("descriptor table wraps around")?;
                read_16(self.mem, at).ok_or("descriptor outside guest memory")?
            }
        };
        let addr = u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default());
        let len = u32::from_le_bytes(raw[8..12].try_into().unwrap_or_default());
        let flags = u16::from_le_bytes([raw[12], raw[13]]);
        let next = u16::from_le_bytes([raw[14], raw[15]]);
        Ok((addr, len, flags, next))
    }
}

/// The 16 bytes at `at`: one load where they lie in one region (the
/// usual case), a copy where they straddle two.
pub(crate) fn read_16(mem: &GuestMem, at: GuestAddress) -> Option<[u8; 16]> {
    let one_load = mem
        .get_slice(at, 16)
        .ok()
        .and_then(|s| s.get_ref::<[u8; 16]>(0).ok().map(|r| r.load()));
    one_load.or_else(|| mem.read_obj(at).ok())
}

/// The descriptors of one chain; most chains have three or fewer.
pub(crate) type Descriptors = SmallVec<[Descriptor; 4]>;

/// The descriptors of the chain at `head` of the table at `desc_table`.
pub(crate) fn walk(
    mem: &GuestMem,
    desc_table: GuestAddress,
    queue_size: u16,
    head: u16,
) -> Result<Descriptors, &'static str> {
    let mut out = Descriptors::new();
    let mut table = Table::new(mem, desc_table, queue_size);
    let mut index = head;
    let mut ttl = queue_size;
    let mut indirect = false;
    // virtio 1.2, 2.7.5.2: no chain longer than 2^32 bytes in total.
    let mut bytes = 0u32;
    loop {
        if index >= table.size {
            return Err("descriptor index past the table");
        }
        let (addr, len, flags, next) = table.read(index)?;
        if flags & F_INDIRECT != 0 {
            if indirect {
                return Err("nested indirect table");
            }
            if len == 0 || u64::from(len) % DESC_SIZE != 0 {
                return Err("indirect table of a bad length");
            }
            let entries = u64::from(len) / DESC_SIZE;
            if entries > u64::from(u16::MAX) {
                return Err("indirect table too long");
            }
            indirect = true;
            table = Table::new(mem, GuestAddress(addr), entries as u16);
            ttl = table.size;
            index = 0;
            continue;
        }
        if ttl == 0 {
            return Err("descriptor chain longer than its table (a loop)");
        }
        ttl -= 1;
        bytes = bytes
            .checked_add(len)
            .ok_or("descriptor chain longer than 2^32 bytes")?;
        out.push(Descriptor {
            buffer: GuestBuffer {
                addr: GuestAddress(addr),
                len,
            },
            write_only: flags & F_WRITE != 0,
        });
        if flags & F_NEXT == 0 {
            return Ok(out);
        }
        index = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as RawDesc, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueOwnedT, QueueT};

    const QUEUE: u16 = 16;

    fn mem() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap()
    }

    /// What virtio-queue's own iterator makes of the chain at the front
    /// of the available ring.
    fn oracle(mem: &GuestMem, queue: &mut Queue) -> Vec<Descriptor> {
        let chain = queue.iter(mem).unwrap().next().unwrap();
        chain
            .map(|d| Descriptor {
                buffer: GuestBuffer {
                    addr: d.addr(),
                    len: d.len(),
                },
                write_only: d.is_write_only(),
            })
            .collect()
    }

    #[test]
    fn chains_walk_as_virtio_queue_iterates_them() {
        let mut rng = fastrand_lite(7);
        for round in 0..200 {
            let m = mem();
            let mock = MockSplitQueue::create(&m, GuestAddress(0), QUEUE);
            let n = 1 + (rng() % 6) as u16;
            let descs: Vec<RawDescriptor> = (0..n)
                .map(|i| {
                    let flags = if i + 1 < n { F_NEXT } else { 0 }
                        | if rng() % 2 == 0 { F_WRITE } else { 0 };
                    RawDescriptor::from(RawDesc::new(
                        0x10_0000 + u64::from(i) * 0x1000,
                        (rng() % 4096) as u32 + 1,
                        flags,
                        i + 1,
                    ))
                })
                .collect();
            mock.build_desc_chain(&descs).unwrap();
            let mut queue: Queue = mock.create_queue().unwrap();
            let head = 0;
            let ours = walk(&m, GuestAddress(queue.desc_table()), queue.size(), head).unwrap();
            assert_eq!(ours.to_vec(), oracle(&m, &mut queue), "round {round}");
        }
    }

    /// A descriptor table across two memory regions (read descriptor by
    /// descriptor) walks as one inside a region (translated once).
    #[test]
    fn a_table_across_two_regions_walks_as_virtio_queue_iterates_it() {
        let m = GuestMem::from_ranges(&[
            (GuestAddress(0), 0x1_0000),
            (GuestAddress(0x1_0000), 0x20_0000),
        ])
        .unwrap();
        // 16 descriptors of 16 bytes from 0xff80: half in each region.
        let mock = MockSplitQueue::create(&m, GuestAddress(0xff80), QUEUE);
        assert!(m.get_slice(GuestAddress(0xff80), 256).is_err());
        let descs: Vec<RawDescriptor> = (0..QUEUE)
            .map(|i| {
                let flags = if i + 1 < QUEUE { F_NEXT } else { F_WRITE };
                RawDescriptor::from(RawDesc::new(
                    0x10_0000 + u64::from(i) * 512,
                    512,
                    flags,
                    i + 1,
                ))
            })
            .collect();
        mock.build_desc_chain(&descs).unwrap();
        let mut queue: Queue = mock.create_queue().unwrap();
        let ours = walk(&m, GuestAddress(queue.desc_table()), queue.size(), 0).unwrap();
        assert_eq!(ours.len(), usize::from(QUEUE));
        assert_eq!(ours.to_vec(), oracle(&m, &mut queue));
    }

    #[test]
    fn loops_and_bad_indexes_are_refused() {
        let m = mem();
        let table = GuestAddress(0x1000);
        let put = |i: u64, addr: u64, len: u32, flags: u16, next: u16| {
            let mut raw = [0u8; 16];
            raw[0..8].copy_from_slice(&addr.to_le_bytes());
            raw[8..12].copy_from_slice(&len.to_le_bytes());
            raw[12..14].copy_from_slice(&flags.to_le_bytes());
            raw[14..16].copy_from_slice(&next.to_le_bytes());
            m.write_slice(&raw, table.unchecked_add(i * 16)).unwrap();
        };
        // 0 -> 1 -> 0 -> ...
        put(0, 0x10_0000, 512, F_NEXT, 1);
        put(1, 0x10_0000, 512, F_NEXT, 0);
        assert_eq!(
            walk(&m, table, QUEUE, 0),
            Err("descriptor chain longer than its table (a loop)")
        );
        // An indirect table naming another indirect table.
        put(2, 0x3000, 32, F_INDIRECT, 0);
        let mut inner = [0u8; 16];
        inner[8..12].copy_from_slice(&32u32.to_le_bytes());
        inner[12..14].copy_from_slice(&F_INDIRECT.to_le_bytes());
        m.write_slice(&inner, GuestAddress(0x3000)).unwrap();
        assert_eq!(walk(&m, table, QUEUE, 2), Err("nested indirect table"));
        put(3, 0x3000, 17, F_INDIRECT, 0);
        assert!(walk(&m, table, QUEUE, 3).is_err());

        // Two buffers of 3 GiB: more than 2^32 bytes in one chain.
        put(4, 0x10_0000, 3 << 30, F_NEXT, 5);
        put(5, 0x10_0000, 3 << 30, 0, 0);
        assert_eq!(
            walk(&m, table, QUEUE, 4),
            Err("descriptor chain longer than 2^32 bytes")
        );

        assert!(walk(&m, table, QUEUE, QUEUE).is_err());
        assert!(walk(&m, GuestAddress(0x1f_fff8), QUEUE, 0).is_err());
    }

    /// A tiny deterministic generator (no extra dependency for one test).
    fn fastrand_lite(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }
}
