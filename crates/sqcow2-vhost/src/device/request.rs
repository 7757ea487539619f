//! virtio-blk requests: descriptor chains from the guest parsed into
//! validated [`Request`]s. Nothing here trusts the guest: every buffer is
//! checked against guest memory, every range against the capacity.

use smallvec::SmallVec;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use crate::transport::descriptors::Descriptor;
pub(crate) use crate::transport::guest_mem::GuestBuffer;
use crate::transport::guest_mem::GuestMem;

use crate::device::config::{MAX_ZERO_SECTORS, MAX_ZERO_SEGMENTS, SECTOR_SIZE};

/// Bytes of the request header (`type`, `ioprio`, `sector`).
const HEADER_SIZE: u64 = 16;
/// Bytes of one discard / write-zeroes range.
const ZERO_SEGMENT_SIZE: u64 = 16;
/// Bytes of the GET_ID answer.
pub(crate) const ID_SIZE: usize = 20;

/// One range of a discard or write-zeroes request, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ZeroRange {
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Release the space (write-zeroes UNMAP flag; always for discard).
    pub unmap: bool,
}

/// What a request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RequestKind {
    /// Read `len` bytes at `offset` into `buffers`.
    In {
        offset: u64,
        len: u64,
        buffers: BufferList,
    },
    /// Write `len` bytes at `offset` from `buffers`.
    Out {
        offset: u64,
        len: u64,
        buffers: BufferList,
    },
    /// Make completed writes durable.
    Flush,
    /// Write the device id into `buffers` (at most [`ID_SIZE`] bytes).
    GetId { buffers: BufferList },
    /// Discard the ranges.
    Discard(Vec<ZeroRange>),
    /// Zero the ranges.
    WriteZeroes(Vec<ZeroRange>),
}

/// A validated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    /// The descriptor chain's head index (for the used ring).
    pub head: u16,
    /// What to do.
    pub kind: RequestKind,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// A request that cannot be served as asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rejected {
    /// The descriptor chain's head index.
    pub head: u16,
    /// Where the status byte goes; `None` if the chain has no room for it.
    pub status: Option<GuestAddress>,
    /// `VIRTIO_BLK_S_IOERR` or `VIRTIO_BLK_S_UNSUPP`.
    pub code: u8,
    /// Why, for the log.
    pub reason: &'static str,
}

/// Limits a request is checked against.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    /// Device capacity in bytes.
    pub capacity: u64,
    /// The export refuses writes.
    pub read_only: bool,
}

/// Buffers of one request; most requests have one or two of each kind.
pub(crate) type BufferList = SmallVec<[GuestBuffer; 4]>;

/// The chain's buffers, split by direction.
struct Buffers {
    readable: BufferList,
    writable: BufferList,
    /// A readable buffer came after a writable one.
    misordered: bool,
}

/// Splits a chain's descriptors by direction.
fn split(descs: &[Descriptor]) -> Buffers {
    let mut b = Buffers {
        readable: BufferList::new(),
        writable: BufferList::new(),
        misordered: false,
    };
    for d in descs {
        if d.write_only {
            b.writable.push(d.buffer);
        } else {
            if !b.writable.is_empty() {
                b.misordered = true;
            }
            b.readable.push(d.buffer);
        }
    }
    b
}

fn total(buffers: &[GuestBuffer]) -> u64 {
    buffers.iter().map(|b| u64::from(b.len)).sum()
}

/// `buffers` without their first `skip` bytes.
fn skip_bytes(buffers: &[GuestBuffer], mut skip: u64) -> BufferList {
    let mut out = BufferList::new();
    for b in buffers {
        let len = u64::from(b.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        out.push(GuestBuffer {
            addr: b.addr.unchecked_add(skip),
            len: (len - skip) as u32,
        });
        skip = 0;
    }
    out.retain(|b| b.len > 0);
    out
}

/// `buffers` without their last `drop` bytes.
fn drop_tail(buffers: &[GuestBuffer], drop: u64) -> BufferList {
    let keep = total(buffers).saturating_sub(drop);
    let mut out = BufferList::new();
    let mut left = keep;
    for b in buffers {
        if left == 0 {
            break;
        }
        let len = u64::from(b.len).min(left);
        out.push(GuestBuffer {
            addr: b.addr,
            len: len as u32,
        });
        left -= len;
    }
    out
}

/// The request header: the first 16 bytes of `buffers`.
fn read_header(mem: &GuestMem, buffers: &[GuestBuffer]) -> Option<[u8; 16]> {
    match buffers.first() {
        Some(b) if b.len >= 16 => crate::transport::descriptors::read_16(mem, b.addr),
        _ => read_front::<16>(mem, buffers),
    }
}

/// Reads `N` bytes from the front of `buffers`.
fn read_front<const N: usize>(mem: &GuestMem, buffers: &[GuestBuffer]) -> Option<[u8; N]> {
    let mut out = [0u8; N];
    let mut done = 0usize;
    for b in buffers {
        if done == N {
            break;
        }
        let n = (b.len as usize).min(N - done);
        mem.read_slice(&mut out[done..done + n], b.addr).ok()?;
        done += n;
    }
    (done == N).then_some(out)
}

fn in_memory(mem: &GuestMem, buffers: &[GuestBuffer]) -> bool {
    buffers.iter().all(|b| {
        b.len == 0
            || b.addr.checked_add(u64::from(b.len) - 1).is_some()
                && GuestMemoryBackend::get_slices(mem, b.addr, b.len as usize).all(|s| s.is_ok())
    })
}

/// Byte range of a sector-addressed request, checked against the capacity.
fn byte_range(sector: u64, len: u64, capacity: u64) -> Option<u64> {
    let offset = sector.checked_mul(SECTOR_SIZE)?;
    let end = offset.checked_add(len)?;
    (end <= capacity).then_some(offset)
}

fn zero_ranges(
    mem: &GuestMem,
    data: &[GuestBuffer],
    write_zeroes: bool,
    capacity: u64,
) -> Result<Vec<ZeroRange>, (u8, &'static str)> {
    let ioerr = VIRTIO_BLK_S_IOERR as u8;
    let len = total(data);
    if len == 0 || len % ZERO_SEGMENT_SIZE != 0 {
        return Err((
            ioerr,
            "discard/write-zeroes payload not a whole number of ranges",
        ));
    }
    if len / ZERO_SEGMENT_SIZE > u64::from(MAX_ZERO_SEGMENTS) {
        return Err((ioerr, "too many discard/write-zeroes ranges"));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    for b in data {
        let mut chunk = vec![0u8; b.len as usize];
        mem.read_slice(&mut chunk, b.addr)
            .map_err(|_| (ioerr, "discard/write-zeroes payload outside guest memory"))?;
        bytes.extend_from_slice(&chunk);
    }
    let mut ranges = Vec::new();
    for seg in bytes.chunks_exact(ZERO_SEGMENT_SIZE as usize) {
        let word = |r: std::ops::Range<usize>| {
            let mut w = [0u8; 8];
            w[..r.len()].copy_from_slice(&seg[r]);
            u64::from_le_bytes(w)
        };
        let sector = word(0..8);
        let sectors = word(8..12) as u32;
        let flags = word(12..16) as u32;
        let allowed = if write_zeroes {
            VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
        } else {
            0
        };
        if flags & !allowed != 0 {
            return Err((
                VIRTIO_BLK_S_UNSUPP as u8,
                "unsupported discard/write-zeroes flags",
            ));
        }
        if sectors > MAX_ZERO_SECTORS {
            return Err((ioerr, "discard/write-zeroes range too long"));
        }
        let len = u64::from(sectors) * SECTOR_SIZE;
        let offset = byte_range(sector, len, capacity)
            .ok_or((ioerr, "discard/write-zeroes range beyond capacity"))?;
        ranges.push(ZeroRange {
            offset,
            len,
            unmap: !write_zeroes || flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0,
        });
    }
    Ok(ranges)
}

/// Parses the request whose chain starts at descriptor `head` of the
/// table at `desc_table` (of a queue of `queue_size`).
pub(crate) fn parse(
    mem: &GuestMem,
    desc_table: GuestAddress,
    queue_size: u16,
    head: u16,
    limits: &RequestLimits,
) -> Result<Request, Rejected> {
    let buffers = match crate::transport::descriptors::walk(mem, desc_table, queue_size, head) {
        Ok(descs) => split(&descs),
        Err(reason) => {
            return Err(Rejected {
                head,
                status: None,
                code: VIRTIO_BLK_S_IOERR as u8,
                reason,
            })
        }
    };
    parse_buffers(head, buffers, mem, limits)
}

fn parse_buffers(
    head: u16,
    buffers: Buffers,
    mem: &GuestMem,
    limits: &RequestLimits,
) -> Result<Request, Rejected> {
    // The status byte: the last byte of the last writable buffer.
    let status = buffers
        .writable
        .last()
        .filter(|b| b.len > 0)
        .and_then(|b| b.addr.checked_add(u64::from(b.len) - 1))
        .filter(|a| mem.address_in_range(*a));
    let reject = |code: u32, reason: &'static str| Rejected {
        head,
        status,
        code: code as u8,
        reason,
    };
    let ioerr = |reason| reject(VIRTIO_BLK_S_IOERR, reason);
    let Some(status) = status else {
        return Err(ioerr("no status byte"));
    };
    if buffers.misordered {
        return Err(ioerr("device-readable buffer after a device-writable one"));
    }
    if !in_memory(mem, &buffers.readable) || !in_memory(mem, &buffers.writable) {
        return Err(ioerr("buffer outside guest memory"));
    }
    let Some(header) = read_header(mem, &buffers.readable) else {
        return Err(ioerr("request header missing or short"));
    };
    let le32 = |r: std::ops::Range<usize>| {
        let mut w = [0u8; 4];
        w.copy_from_slice(&header[r]);
        u32::from_le_bytes(w)
    };
    let request_type = le32(0..4);
    let mut s = [0u8; 8];
    s.copy_from_slice(&header[8..16]);
    let sector = u64::from_le_bytes(s);

    let payload = skip_bytes(&buffers.readable, HEADER_SIZE);
    let writable_data = drop_tail(&buffers.writable, 1);
    let writes = matches!(
        request_type,
        VIRTIO_BLK_T_OUT | VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES
    );
    if writes && limits.read_only {
        return Err(ioerr("write to a read-only export"));
    }
    let kind = match request_type {
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
            let (data, other) = if request_type == VIRTIO_BLK_T_IN {
                (writable_data, total(&payload))
            } else {
                (payload, total(&writable_data))
            };
            if other != 0 {
                return Err(ioerr("data buffer with the wrong direction"));
            }
            let len = total(&data);
            if len % SECTOR_SIZE != 0 {
                return Err(ioerr("data length not a multiple of 512"));
            }
            let Some(offset) = byte_range(sector, len, limits.capacity) else {
                return Err(ioerr("request beyond capacity"));
            };
            if request_type == VIRTIO_BLK_T_IN {
                RequestKind::In {
                    offset,
                    len,
                    buffers: data,
                }
            } else {
                RequestKind::Out {
                    offset,
                    len,
                    buffers: data,
                }
            }
        }
        VIRTIO_BLK_T_FLUSH => RequestKind::Flush,
        VIRTIO_BLK_T_GET_ID => {
            if total(&payload) != 0 {
                return Err(ioerr("data buffer with the wrong direction"));
            }
            RequestKind::GetId {
                buffers: drop_tail(
                    &writable_data,
                    total(&writable_data).saturating_sub(ID_SIZE as u64),
                ),
            }
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            if total(&writable_data) != 0 {
                return Err(ioerr("data buffer with the wrong direction"));
            }
            let write_zeroes = request_type == VIRTIO_BLK_T_WRITE_ZEROES;
            let ranges = zero_ranges(mem, &payload, write_zeroes, limits.capacity)
                .map_err(|(code, reason)| reject(u32::from(code), reason))?;
            if write_zeroes {
                RequestKind::WriteZeroes(ranges)
            } else {
                RequestKind::Discard(ranges)
            }
        }
        _ => return Err(reject(VIRTIO_BLK_S_UNSUPP, "unsupported request type")),
    };
    Ok(Request { head, kind, status })
}
