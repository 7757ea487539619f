//! One worker's io_uring: data transfers between image files and guest
//! memory. Each operation owns what its buffer and file descriptor rest
//! on (the guest memory mapping and the image file, both `Arc`s) until its
//! completion has been reaped; interrupted operations are resubmitted.

use std::io;
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};
use slab::Slab;
use sqcow2_format::direct::AlignedBuf;
use sqcow2_format::storage::PinnedFile;
use std::os::fd::AsRawFd;
use vm_memory::VolatileSlice;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::transport::guest_mem::GuestMem;

/// Submission queue entries per ring.
const RING_ENTRIES: u32 = 256;
/// Resubmissions of one interrupted operation before it fails.
const MAX_RETRIES: u8 = 16;

/// Direction of one transfer.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Direction {
    /// File to guest memory.
    Read,
    /// Guest memory to file.
    Write,
}

/// How a transfer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransferEnd {
    /// All bytes moved.
    Done,
    /// Fewer bytes than asked (end of file).
    Short,
    /// The kernel reported an error.
    Failed,
}

/// A finished transfer of the request in `slot`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingCompletion {
    pub(crate) slot: usize,
    pub(crate) end: TransferEnd,
}

/// An operation in the ring: what to redo if it is interrupted, and what
/// keeps its buffer and file valid.
struct RingOp {
    slot: usize,
    len: u32,
    entry: squeue::Entry,
    retries: u8,
    /// The image file whose descriptor the entry uses.
    _file: PinnedFile,
    /// The guest memory mapping the entry's buffer lies in.
    _mem: Arc<GuestMem>,
    /// The aligned buffer a direct transfer of unaligned guest memory
    /// goes through.
    bounce: Option<Bounce>,
    /// The worker's own buffer the entry's lies in.
    _own: Option<Arc<OwnBuffer>>,
    /// A read that ends short leaves zeros (its buffer was zeroed): done.
    short_reads_zeros: bool,
}

/// A buffer of the worker's own that several transfers of one request
/// use (a copy-on-write's cluster: reads into disjoint parts of it, then
/// one write of it all). Nothing reads or changes it through Rust while
/// transfers use it: they see it through `base`.
pub(crate) struct OwnBuffer {
    _buf: AlignedBuf,
    base: *mut u8,
    len: usize,
}

// SAFETY: `base` points into `buf`, which this owns (kept only so that
// it is freed with this); the kernel writes through it only while the
// `Arc` held by the operation keeps it alive.
unsafe impl Send for OwnBuffer {}
// SAFETY: shared references never touch the bytes (see the type's doc).
unsafe impl Sync for OwnBuffer {}

impl OwnBuffer {
    /// Shares `buf` (filled as needed before) with the transfers to come.
    pub(crate) fn share(mut buf: AlignedBuf) -> Arc<Self> {
        let len = buf.as_slice().len();
        let base = buf.as_mut_ptr();
        Arc::new(OwnBuffer {
            _buf: buf,
            base,
            len,
        })
    }

    /// Its length (the bytes are not looked at).
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl std::fmt::Debug for OwnBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnBuffer")
            .field("len", &self.len())
            .finish()
    }
}

/// A direct transfer's aligned stand-in for guest memory (`cache=none`):
/// a write's bytes are copied in before it is queued, a read's copied
/// out to `guest` when it completes.
struct Bounce {
    buf: AlignedBuf,
    /// Where a read's bytes go: `len` bytes of guest memory in the
    /// operation's `_mem` (`None` for a write).
    guest: Option<*mut u8>,
}

// SAFETY: `guest` points into the guest memory mapping the same
// operation holds an `Arc` of, so it stays valid wherever the operation
// goes; only the thread that reaps the operation writes through it.
unsafe impl Send for Bounce {}

/// The submission entry of a transfer of `len` bytes at `ptr` from or to
/// `fd` at `host`; straight to io_uring's workers unless the file's
/// filesystem can try it without blocking (`nowait`).
fn entry(
    direction: Direction,
    fd: i32,
    ptr: *mut u8,
    len: u32,
    host: u64,
    nowait: bool,
) -> squeue::Entry {
    let entry = match direction {
        Direction::Read => opcode::Read::new(types::Fd(fd), ptr, len)
            .offset(host)
            .build(),
        Direction::Write => opcode::Write::new(types::Fd(fd), ptr, len)
            .offset(host)
            .build(),
    };
    if nowait {
        entry
    } else {
        entry.flags(squeue::Flags::ASYNC)
    }
}

/// A worker's ring and the eventfd its completions signal.
pub(crate) struct Ring {
    ring: IoUring,
    event: EventFd,
    ops: Slab<RingOp>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("ops", &self.ops.len())
            .finish()
    }
}

impl Ring {
    /// A ring whose task work (what the kernel finishes in the thread
    /// that submitted: freeing a request io_uring's workers completed, a
    /// buffered write; completing a read that went to the device) does not
    /// interrupt that thread with an inter-processor interrupt: it runs at
    /// the thread's next syscall, or at once if it sleeps
    /// (`IORING_SETUP_COOP_TASKRUN`, Linux 5.19); [`Ring::reap`] makes
    /// that syscall when the kernel flags such work
    /// (`IORING_SETUP_TASKRUN_FLAG`). Older kernels get a plain ring.
    pub(crate) fn new() -> io::Result<Self> {
        let ring = match IoUring::builder()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .build(RING_ENTRIES)
        {
            Ok(ring) => ring,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::new(RING_ENTRIES)?,
            Err(e) => return Err(e),
        };
        let event = EventFd::new(EFD_NONBLOCK)?;
        ring.submitter()
            .register_eventfd(std::os::fd::AsRawFd::as_raw_fd(&event))?;
        Ok(Ring {
            ring,
            event,
            ops: Slab::new(),
        })
    }

    /// Becomes readable when completions wait.
    pub(crate) fn event_fd(&self) -> &EventFd {
        &self.event
    }

    /// Whether no operation is in the ring.
    pub(crate) fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Queues one transfer of `buf` (in `mem`) from or to `file` (held
    /// until the transfer ends, so its descriptor stays open) at `host`,
    /// for the request in `slot`; straight to io_uring's workers where the
    /// file's filesystem cannot try it without blocking (see
    /// [`PinnedFile::nowait`]). With `cache=none` a transfer whose offset
    /// and length fit the file's direct-I/O alignment goes through its
    /// `O_DIRECT` description (through an aligned bounce buffer when the
    /// guest's memory does not fit), any other through the page cache.
    /// Completions reaped to make room go to `done`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn queue(
        &mut self,
        slot: usize,
        direction: Direction,
        file: PinnedFile,
        host: u64,
        buf: &VolatileSlice<'_, ()>,
        mem: &Arc<GuestMem>,
        done: &mut Vec<RingCompletion>,
    ) -> io::Result<()> {
        let len = u32::try_from(buf.len()).map_err(io::Error::other)?;
        let guest = buf.ptr_guard_mut().as_ptr();
        let (mut fd, mut ptr, mut bounce) = (file.file.as_raw_fd(), guest, None);
        if let Some(direct) = file.direct.as_deref().filter(|d| d.fits(host, len.into())) {
            fd = direct.file.as_raw_fd();
            if !direct.mem_fits(guest as usize) {
                let mut aligned = AlignedBuf::zeroed(buf.len(), direct.bounce_align)?;
                let reads = match direction {
                    Direction::Read => Some(guest),
                    Direction::Write => {
                        buf.copy_to(aligned.as_mut_slice());
                        None
                    }
                };
                ptr = aligned.as_mut_ptr();
                bounce = Some(Bounce {
                    buf: aligned,
                    guest: reads,
                });
            }
        }
        let entry = entry(direction, fd, ptr, len, host, file.nowait);
        let op = RingOp {
            slot,
            len,
            entry,
            retries: 0,
            _file: file,
            _mem: mem.clone(),
            bounce,
            _own: None,
            short_reads_zeros: false,
        };
        self.push(op, done)
    }

    /// Queues one transfer of `len` bytes at `at` in `own` from or to
    /// `file` at `host`, for the request in `slot` (whose guest memory
    /// `mem` the operation keeps, as every operation does). Direct where
    /// the file has an `O_DIRECT` description that fits, else through the
    /// page cache; a read that ends short is done (the rest stays zeros).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn queue_own(
        &mut self,
        slot: usize,
        direction: Direction,
        file: PinnedFile,
        host: u64,
        own: &Arc<OwnBuffer>,
        at: usize,
        len: usize,
        mem: &Arc<GuestMem>,
        done: &mut Vec<RingCompletion>,
    ) -> io::Result<()> {
        let end = at.checked_add(len).filter(|&e| e <= own.len());
        let (Some(_), Ok(n)) = (end, u32::try_from(len)) else {
            return Err(io::Error::other("transfer outside its buffer"));
        };
        // SAFETY: `at + len` lies within the buffer (checked above).
        let ptr = unsafe { own.base.add(at) };
        let fd = match file
            .direct
            .as_deref()
            .filter(|d| d.fits(host, len as u64) && d.mem_fits(ptr as usize))
        {
            Some(direct) => direct.file.as_raw_fd(),
            None => file.file.as_raw_fd(),
        };
        let entry = entry(direction, fd, ptr, n, host, file.nowait);
        let op = RingOp {
            slot,
            len: n,
            entry,
            retries: 0,
            _file: file,
            _mem: mem.clone(),
            bounce: None,
            _own: Some(own.clone()),
            short_reads_zeros: matches!(direction, Direction::Read),
        };
        self.push(op, done)
    }

    /// Puts `op` in the submission queue under a fresh key, making room if
    /// it is full.
    fn push(&mut self, op: RingOp, done: &mut Vec<RingCompletion>) -> io::Result<()> {
        let entry = op.entry.clone();
        let key = self.ops.insert(op);
        let entry = entry.user_data(key as u64);
        // SAFETY: the entry reads or writes `len` bytes at `ptr` of the
        // file `fd`. The operation kept in `self.ops[key]` owns an `Arc` of
        // what holds `ptr..ptr + len`: the guest memory mapping (checked
        // when the slice was taken from it), its bounce buffer, or the
        // worker's own buffer (checked in `queue_own`; the worker's other
        // transfers use disjoint parts of it, or follow these), and an
        // `Arc` of the file that owns `fd`; it is removed only when its
        // completion is reaped, so both stay valid for as long as the
        // kernel may use them. The guest does not touch a buffer it handed
        // over before the request completes (if it does, only its own data
        // is garbled).
        while unsafe { self.ring.submission().push(&entry) }.is_err() {
            if let Err(e) = self.ring.submit() {
                self.ops.remove(key);
                return Err(e);
            }
            self.reap(done);
        }
        Ok(())
    }

    /// Hands the queued entries to the kernel.
    pub(crate) fn submit(&mut self) -> io::Result<usize> {
        self.ring.submit()
    }

    /// Submits what waits in the submission queue (a submit that failed
    /// earlier); whether some still waits.
    pub(crate) fn submit_left(&mut self) -> bool {
        if self.ring.submission().is_empty() {
            return false;
        }
        self.submit_logged("submitting transfers left queued");
        !self.ring.submission().is_empty()
    }

    /// Submits and waits for at least one completion.
    pub(crate) fn submit_and_wait(&mut self) -> io::Result<usize> {
        self.ring.submit_and_wait(1)
    }

    /// Clears the eventfd.
    pub(crate) fn clear_event(&self) {
        let _ = self.event.read();
    }

    /// Handles the completions in the ring, without waiting; finished
    /// transfers go to `done`.
    pub(crate) fn reap(&mut self, done: &mut Vec<RingCompletion>) {
        // Completions that wait as task work until this thread enters the
        // kernel: enter it (a thread that busy-polls makes no other
        // syscall).
        if self.ring.submission().taskrun() {
            self.submit_logged("running io_uring's completion work");
        }
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|cqe| (cqe.user_data(), cqe.result()))
            .collect();
        for (user_data, res) in cqes {
            let Some(mut op) = self.ops.try_remove(user_data as usize) else {
                continue;
            };
            let (slot, len, short_ok) = (op.slot, op.len, op.short_reads_zeros);
            if let Some(Bounce {
                buf,
                guest: Some(guest),
            }) = &op.bounce
            {
                // (A failed read, retried or not, moved nothing.)
                let n = usize::try_from(res).unwrap_or(0).min(len as usize);
                // SAFETY: `guest` is the start of the `len` bytes of guest
                // memory this read was for, kept mapped by the `Arc` in
                // `op`; the bounce buffer holds at least `len` bytes and
                // does not overlap guest memory.
                unsafe { std::ptr::copy_nonoverlapping(buf.as_slice().as_ptr(), *guest, n) };
            }
            // Interrupted or not ready: the same I/O again (as QEMU does).
            if (res == -libc::EINTR || res == -libc::EAGAIN) && op.retries < MAX_RETRIES {
                op.retries += 1;
                match self.push(op, done) {
                    Ok(()) => continue,
                    Err(e) => crate::limited_warn!("resubmitting interrupted I/O: {e}"),
                }
            } else if res < 0 {
                crate::limited_warn!("data I/O failed: {}", io::Error::from_raw_os_error(-res));
            }
            let end = if res < 0 {
                TransferEnd::Failed
            } else if (res as u32) < len && !short_ok {
                TransferEnd::Short
            } else {
                TransferEnd::Done
            };
            done.push(RingCompletion { slot, end });
        }
        // Retries go to the kernel now: nothing else submits until the
        // next request is taken, which a guest waiting for this one may
        // never send.
        if !self.ring.submission().is_empty() {
            self.submit_logged("resubmitting interrupted I/O");
        }
    }

    /// Enters the kernel (submitting what is queued) where a failure
    /// leaves nothing to undo: it is logged as `what`, and the next reap
    /// tries again.
    fn submit_logged(&mut self, what: &str) {
        if let Err(e) = self.ring.submit() {
            crate::limited_warn!("{what}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::unix::fs::FileExt;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

    /// A transfer the kernel answers "try again" is queued again by
    /// `reap`, which must hand it to the kernel itself: the worker's loop
    /// submits only when it takes new requests, so a retry left in the
    /// submission queue would wait for the guest's next request (a guest
    /// waiting for this one never sends it). The "try again": a read with
    /// `RWF_NOWAIT` of data not in the page cache.
    #[test]
    fn a_transfer_retried_by_reap_reaches_the_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, vec![0x5a; 4096]).unwrap();
        let file = File::open(&path).unwrap();
        file.sync_all().unwrap();
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        let file = Arc::new(file);
        let mem = Arc::new(GuestMem::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap());
        let buf = mem.get_slice(GuestAddress(0), 4096).unwrap();
        let entry = opcode::Read::new(
            types::Fd(file.as_raw_fd()),
            buf.ptr_guard_mut().as_ptr(),
            4096,
        )
        .offset(0)
        .rw_flags(libc::RWF_NOWAIT)
        .build();
        let mut ring = Ring::new().unwrap();
        let mut done = Vec::new();
        let op = RingOp {
            slot: 7,
            len: 4096,
            entry,
            retries: 0,
            _file: PinnedFile {
                file: file.clone(),
                nowait: true,
                direct: None,
            },
            _mem: mem.clone(),
            bounce: None,
            _own: None,
            short_reads_zeros: false,
        };
        ring.push(op, &mut done).unwrap();
        ring.submit().unwrap();
        // The data in the page cache now: the next try succeeds.
        let mut warm = [0u8; 4096];
        file.read_exact_at(&mut warm, 0).unwrap();
        for _ in 0..200 {
            ring.reap(&mut done);
            if !done.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(
            ring.ops.iter().map(|(_, op)| op.retries).sum::<u8>(),
            0,
            "a retry still waits in the submission queue"
        );
        assert_eq!(done.len(), 1, "the retried read never completed");
        assert_eq!((done[0].slot, done[0].end), (7, TransferEnd::Done));
        let mut got = [0u8; 4];
        mem.read_slice(&mut got, GuestAddress(0)).unwrap();
        assert_eq!(got, [0x5a; 4]);
    }
}
