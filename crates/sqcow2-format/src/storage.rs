//! Where the bytes of one layer live: a file, or memory for tests.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::direct::{CacheMode, DirectFile, PAGE_BYTES as PAGE};
use crate::error::ErrorKind;
use crate::lock::{FileLock, LockRequest, Locking};
use crate::read_once::{DescriptorSlots, OnceReader};

/// How a read goes on: part of a stream the kernel may read ahead of, or
/// read once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadPattern {
    /// A reader that may go on where it stopped (`Chain::read_at`).
    Stream,
    /// Bytes read once (a copy-on-write's source).
    Once,
}

impl ReadPattern {
    /// Reads `buf.len()` bytes of `storage` at `offset` this way.
    pub(crate) fn read(self, storage: &dyn Storage, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self {
            ReadPattern::Stream => storage.read_at(buf, offset),
            ReadPattern::Once => storage.read_once_at(buf, offset),
        }
    }
}

/// Byte-addressed storage of one layer.
///
/// Reads past the end of the storage return zeros for the missing part, like
/// QEMU's file driver; callers that need the bytes to exist check
/// [`Storage::len`] first.
pub trait Storage: Send + Sync + std::fmt::Debug {
    /// Reads `buf.len()` bytes at `offset`, zero-filling beyond the end.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// [`Storage::read_at`] of bytes read once, which no read goes on from
    /// (a copy-on-write's source): files read them without the kernel's
    /// readahead (see `read_once.rs`).
    fn read_once_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_at(buf, offset)
    }
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// Whether the storage is empty.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Writes all of `buf` at `offset`, extending the storage if needed.
    fn write_at(&self, _buf: &[u8], _offset: u64) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "read-only storage",
        ))
    }
    /// [`Storage::write_at`] of a few bytes of metadata (table entries)
    /// that no other write changes at the same time within their aligned
    /// block (the table has one writer): with `cache=none`, files read
    /// the block, patch it and write it back through `O_DIRECT`, so that
    /// the page cache stays untouched.
    fn write_metadata_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_at(buf, offset)
    }
    /// Writes `bufs` one after another from `offset` ([`Storage::write_at`]
    /// of each; files write them with one system call).
    fn write_all_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let mut at = offset;
        for buf in bufs {
            self.write_at(buf, at)?;
            at += buf.len() as u64;
        }
        Ok(())
    }
    /// From now on (`on`) writes through the page cache go to the file a
    /// page at a time, until turned off. A kernel with large folios
    /// (ext4 since Linux 6.16) otherwise caches a 64 KiB write in one
    /// 64 KiB folio, and every later 4 KiB write into it pays for the
    /// whole folio (`ext4_block_write_begin` walks its blocks): for a
    /// bulk copy into a file a guest then writes at random (a live
    /// commit's base). Storage without a page cache ignores it.
    fn set_page_sized_writes(&self, _on: bool) {}
    /// Starts fetching `[offset, offset + len)` ahead of a read, and
    /// returns at once (storage that fetches from afar: an object store;
    /// others ignore it).
    fn prefetch(&self, _offset: u64, _len: u64) {}
    /// Whether reads may wait on a network ([`Storage::prefetch`] worth
    /// calling).
    fn fetches_remotely(&self) -> bool {
        false
    }
    /// Drops the clean cached pages that hold any of `[offset, offset +
    /// len)` and no byte outside it (a hint; storage without a page cache
    /// ignores it).
    fn drop_cached(&self, _offset: u64, _len: u64) {}
    /// Sets the length, truncating or extending with zeros.
    fn set_len(&self, _len: u64) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "read-only storage",
        ))
    }
    /// Makes every completed write durable (fdatasync).
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
    /// Gives `[offset, offset + len)` backing space, extending the storage
    /// if needed, so that later writes there cannot fail for lack of space
    /// (`ENOSPC` is reported here instead). Files do it only while they
    /// are not syncing (see [`FileStorage`]); during a sync the range
    /// reads as zeros all the same (the size extended, never shrunk) and
    /// its space is claimed by the writes into it (which then report
    /// `ENOSPC`).
    fn reserve(&self, offset: u64, len: u64) -> io::Result<()> {
        extend_to(self, offset.saturating_add(len))
    }
    /// [`Storage::reserve`] only if the space can be given now, without
    /// waiting behind a sync (see [`FileStorage`]): `Ok(false)` when it
    /// was not, and nothing was done.
    fn reserve_ahead(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.reserve(offset, len).map(|()| true)
    }
    /// Makes `[offset, offset + len)` read as zeros (the range lies within
    /// the storage): by default by writing zeros; files ask the filesystem
    /// to do it without writing data.
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        write_zero_bytes(self, offset, len)
    }
    /// Takes or changes this file's image locks (QEMU's lock bytes): fails
    /// with [`ErrorKind::Locked`] when another user's permissions
    /// conflict, and then changes nothing. Storage without a file has no
    /// locks.
    fn lock(&self, _want: LockRequest, _mode: Locking) -> Result<(), ErrorKind> {
        Ok(())
    }
    /// The image locks held now (`None`: none).
    fn locks(&self) -> Option<LockRequest> {
        None
    }
    /// The file's identity (device and inode), for storage that is a
    /// file.
    fn file_id(&self) -> Option<(u64, u64)> {
        None
    }
    /// Whether writes are possible (a file opened for writing).
    fn is_writable(&self) -> bool {
        false
    }
    /// The open file behind this storage, for callers that submit their
    /// own I/O (io_uring): holding it keeps its descriptor valid for as
    /// long as the I/O runs, even if the storage closes its own (lower
    /// layers' descriptors are cached, see `files.rs`). `None` when
    /// there is no file.
    fn pinned_file(&self) -> io::Result<Option<PinnedFile>> {
        Ok(None)
    }
    /// For storage that keeps a local copy of some of its bytes (a layer
    /// in an object store and its cache file): the file holding all of
    /// `[offset, offset + len)` at the same offsets, and a pin that keeps
    /// them there until dropped, for callers that submit their own I/O
    /// (as [`Storage::pinned_file`]). `None` when not all of it is held.
    fn pin_cached(&self, _offset: u64, _len: u64) -> Option<(PinnedFile, CachedRangePin)> {
        None
    }
    /// Allocation status of `[offset, offset + len)`: `Some((is_data, run))`
    /// where `run` bytes from `offset` share the status, or `None` when the
    /// storage cannot tell (everything is then data).
    fn allocation(&self, _offset: u64, _len: u64) -> Option<(bool, u64)> {
        None
    }
}

/// Reads `buf.len()` bytes of `file` at `offset`, zeros past its end.
fn read_zero_filled(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `len` zero bytes at `offset`.
fn write_zero_bytes<S: Storage + ?Sized>(storage: &S, offset: u64, len: u64) -> io::Result<()> {
    static ZEROS: [u8; 65536] = [0; 65536];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(ZEROS.len() as u64);
        storage.write_at(&ZEROS[..n as usize], offset + done)?;
        done += n;
    }
    Ok(())
}

/// Extends `storage` with zeros to `end` bytes if it is shorter, by
/// writing a zero byte at `end - 1`, which lies in the caller's own new
/// range: a write only ever raises the size, so a thread extending the
/// file further meanwhile is never cut short (a `set_len` read-then-set
/// could shrink it under that thread's data).
fn extend_to<S: Storage + ?Sized>(storage: &S, end: u64) -> io::Result<()> {
    if end > storage.len()? {
        storage.write_at(&[0], end - 1)?;
    }
    Ok(())
}

/// Keeps a range [`Storage::pin_cached`] gave where it is until dropped.
pub type CachedRangePin = Box<dyn std::any::Any + Send + Sync>;

/// An open file pinned for a transfer, and how I/O to it is best
/// submitted.
#[derive(Debug, Clone)]
pub struct PinnedFile {
    /// The file (its descriptor stays open while this is held).
    pub file: Arc<File>,
    /// Whether its filesystem can tell that a read would block
    /// (`RWF_NOWAIT`): io_uring then tries each read inline (page cache)
    /// first. Where it cannot (FUSE, NFS, ...), io_uring serialised reads
    /// of one file (measured on a FUSE mount: about a sixth of the rate
    /// with `IOSQE_ASYNC`, which sends them straight to its workers, in
    /// parallel).
    pub nowait: bool,
    /// With `cache=none`, the file's `O_DIRECT` description, for the
    /// transfers that fit its alignment.
    pub direct: Option<Arc<crate::direct::DirectFile>>,
}

impl PinnedFile {
    /// Pins `file`, probing once whether its filesystem supports
    /// non-blocking reads (`preadv2` with `RWF_NOWAIT` fails with
    /// `EOPNOTSUPP` where it does not).
    pub fn probe(file: File) -> Self {
        use std::os::fd::AsRawFd;
        let mut byte = 0u8;
        let iov = libc::iovec {
            iov_base: (&mut byte as *mut u8).cast(),
            iov_len: 1,
        };
        // SAFETY: a one-byte read into `byte`, which outlives the call,
        // from a descriptor `file` owns; RWF_NOWAIT makes it return at once.
        let r = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
        let nowait = r >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EOPNOTSUPP);
        PinnedFile {
            file: Arc::new(file),
            nowait,
            direct: None,
        }
    }
}

/// A regular file, read with positioned reads.
///
/// Once an fsync fails, every later one fails too: the kernel may have
/// dropped the dirty pages it could not write, so a later success would
/// claim durability for data that is gone (as QEMU's file driver does).
///
/// Its syncs and its block allocations (`fallocate`) never overlap: an
/// allocation may have to read a block bitmap, which on a virtual disk
/// waits behind the sync's device cache flush, and it holds the file's
/// inode lock meanwhile, so every write to the file waits with it
/// (measured on ext4 in this VM: all 16 requests of a write load stalled
/// 0.4-1.4 s behind a background checkpoint's sync). During a sync, space
/// is therefore not allocated ahead: [`Storage::reserve_ahead`] declines,
/// [`Storage::reserve`] extends the size (a written zero byte) and
/// [`Storage::write_zeroes`] writes zeros, which allocate blocks only at
/// write-back on delayed-allocation filesystems (ext4). Only syncs of this
/// file object are kept apart; other files' syncs on the same device
/// flush its cache too.
#[derive(Debug)]
pub struct FileStorage {
    file: PinnedFile,
    writable: bool,
    sync_failed: std::sync::atomic::AtomicBool,
    lock: Mutex<FileLock>,
    allocations: AllocationGate,
    /// The description [`Storage::read_once_at`] reads through.
    once: OnceReader,
    /// With `cache=none`: the last range reserved ahead (see
    /// [`DIRECT_RESERVE_CHUNK`]), whose blocks stay allocated until the
    /// file is cut (nothing punches holes).
    reserved: Mutex<std::ops::Range<u64>>,
    /// Writes through the page cache go a page at a time (see
    /// [`Storage::set_page_sized_writes`]).
    page_sized_writes: std::sync::atomic::AtomicBool,
}

/// With `cache=none`, space is reserved ahead in chunks of this many
/// bytes. A reservation (`fallocate`) and a direct write into a hole
/// both make ext4 wait for every direct transfer of the file in flight
/// (`inode_dio_wait` under the exclusive inode lock); one per cluster
/// serialised allocating writes (measured: 2.8k IOPS at depth 32 where
/// qemu-storage-daemon did 14.6k).
const DIRECT_RESERVE_CHUNK: u64 = 8 << 20;

/// Writes `buf` at `offset` in pieces that end at page boundaries: the
/// page cache makes no folio larger than the write that creates it.
fn write_in_pages(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        let at = offset + done as u64;
        let n = ((PAGE - at % PAGE) as usize).min(buf.len() - done);
        file.write_all_at(&buf[done..done + n], at)?;
        done += n;
    }
    Ok(())
}

/// Keeps a file's block allocations apart from its syncs (see
/// [`FileStorage`]): held exclusively by a sync for its whole length;
/// allocations share it, each only if it can take it at once, and never
/// wait for anything else while they hold it (the fallbacks run after
/// it is released).
#[derive(Debug, Default)]
struct AllocationGate(RwLock<()>);

impl AllocationGate {
    /// Held while the file syncs.
    fn syncing(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Held while blocks are allocated; `None` while a sync runs or
    /// waits to.
    fn allocating(&self) -> Option<std::sync::RwLockReadGuard<'_, ()>> {
        match self.0.try_read() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
}

/// The `/proc/self/fd` link of `file`: where it really lies (read the
/// link), or the same file to open again whatever was renamed since.
pub(crate) fn fd_link(file: &File) -> std::path::PathBuf {
    use std::os::fd::AsRawFd;
    Path::new("/proc/self/fd").join(file.as_raw_fd().to_string())
}

/// Where an open file really lies (symlinks resolved), read from its
/// descriptor.
pub(crate) fn real_path(file: &File) -> io::Result<std::path::PathBuf> {
    std::fs::read_link(fd_link(file))
}

/// Opens `path` read-only without updating its access time on reads
/// (`O_NOATIME`, allowed to the file's owner and to root; a plain open
/// otherwise): reading a backing layer is not using it, and with
/// thousands of layers the inode updates cost a cache miss per request.
/// Never waits on a FIFO: anything but a regular file is refused.
pub(crate) fn open_for_reading(path: &Path) -> io::Result<File> {
    crate::sidefile::dir::open_image_file(path, false)
}

/// Opens (or creates) `path` to write a whole image into (a conversion's
/// output), not truncated: a regular file or a block device, never
/// waiting on a FIFO; anything else is refused.
pub fn open_output(path: &Path) -> io::Result<File> {
    crate::sidefile::dir::open_output_file(path, true)
}

/// A writable description of the file `of` has open, opened through
/// `/proc/self/fd` (the same file whatever is at its name now: no path is
/// resolved), checked to be that file. Storage that shows no file of its
/// own (a wrapper, in tests) is opened by `path`, and checked the same.
pub(crate) fn writable_same_file(of: &dyn Storage, path: &Path) -> io::Result<FileStorage> {
    let file = match of.pinned_file()? {
        Some(pinned) => crate::sidefile::dir::open_image_file(&fd_link(&pinned.file), true)?,
        None => crate::sidefile::dir::open_image_file(path, true)?,
    };
    let storage = FileStorage::from_writable_file(file)?;
    if storage.file_id().is_none() || storage.file_id() != of.file_id() {
        return Err(io::Error::other("not the same file"));
    }
    Ok(storage)
}

impl FileStorage {
    /// Opens `path` read-only (a regular file only, never waiting on a
    /// FIFO).
    pub fn open_read_only(path: &Path) -> io::Result<Self> {
        Ok(Self::from_file(crate::sidefile::dir::open_image_file(
            path, false,
        )?))
    }

    /// Opens `path` for reading and writing (a regular file only, never
    /// waiting on a FIFO).
    pub fn open_read_write(path: &Path) -> io::Result<Self> {
        Self::from_writable_file(crate::sidefile::dir::open_image_file(path, true)?)
    }

    /// Wraps a file opened for reading and writing.
    pub(crate) fn from_writable_file(file: File) -> io::Result<Self> {
        Ok(Self {
            writable: true,
            ..Self::from_file(file)
        })
    }

    /// Wraps a file opened read-only.
    pub fn from_file(file: File) -> Self {
        Self {
            file: PinnedFile::probe(file),
            writable: false,
            sync_failed: std::sync::atomic::AtomicBool::new(false),
            lock: Mutex::new(FileLock::default()),
            allocations: AllocationGate::default(),
            once: OnceReader::default(),
            reserved: Mutex::new(0..0),
            page_sized_writes: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Counts the descriptor of its reads once in `slots` (lower layers,
    /// whose descriptors share their chain's budget).
    pub(crate) fn once_reads_within(self, slots: Arc<DescriptorSlots>) -> Self {
        Self {
            once: OnceReader::within(slots),
            ..self
        }
    }

    /// The same storage with `mode`'s host page cache use: with
    /// [`CacheMode::None`], an `O_DIRECT` description of the file beside
    /// its first one (see [`crate::direct`]).
    pub fn with_cache(mut self, mode: CacheMode) -> io::Result<Self> {
        if mode == CacheMode::None && self.file.direct.is_none() {
            self.file.direct = Some(DirectFile::open(&fd_link(&self.file.file), self.writable)?);
            // What still goes through the page cache reads no more than
            // it asks for (no read-ahead to drop afterwards).
            crate::direct::no_read_ahead(&self.file.file);
            // (What was read before, the header, goes.)
            crate::direct::drop_cached(&self.file.file, 0, 0);
        }
        Ok(self)
    }

    /// The `O_DIRECT` description, if `cache=none` and a transfer of
    /// `len` bytes at `offset` fits it.
    fn direct_for(&self, offset: u64, len: u64) -> Option<&DirectFile> {
        self.file.direct.as_deref().filter(|d| d.fits(offset, len))
    }

    /// With `cache=none`, drops what a read through the page cache left
    /// there.
    fn drop_cached_read(&self, offset: u64, len: u64) {
        if self.file.direct.is_some() && len > 0 {
            crate::direct::drop_cached(&self.file.file, offset, len);
        }
    }

    /// The underlying file.
    pub fn file(&self) -> &File {
        &self.file.file
    }

    /// Starts writing the file's dirty pages out (`sync_file_range` with
    /// `SYNC_FILE_RANGE_WRITE`: no wait for them, no metadata, no cache
    /// flush); errors are left to the sync that follows.
    fn start_write_back(&self) {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain system call on a descriptor this storage owns;
        // no memory is passed.
        let r = unsafe {
            libc::sync_file_range(
                self.file.file.as_raw_fd(),
                0,
                0,
                libc::SYNC_FILE_RANGE_WRITE,
            )
        };
        if r != 0 {
            tracing::trace!(error = %io::Error::last_os_error(), "sync_file_range");
        }
    }

    /// `fallocate(mode)` over `[offset, offset + len)` unless the file is
    /// syncing; errors in `unsupported` mean the filesystem cannot do it
    /// (the caller's fallback runs after the gate is released).
    fn fallocate(
        &self,
        mode: i32,
        offset: u64,
        len: u64,
        unsupported: &[i32],
    ) -> io::Result<Fallocated> {
        use std::os::fd::AsRawFd;
        let (Ok(start), Ok(size)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(io::Error::from_raw_os_error(libc::EFBIG));
        };
        let Some(_allocating) = self.allocations.allocating() else {
            return Ok(Fallocated::Syncing);
        };
        loop {
            // SAFETY: fallocate on a file descriptor this storage owns; no
            // memory is passed, and the modes callers use never change
            // data outside the range.
            let r = unsafe { libc::fallocate(self.file.file.as_raw_fd(), mode, start, size) };
            if r == 0 {
                return Ok(Fallocated::Done);
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(code) if unsupported.contains(&code) => return Ok(Fallocated::Unsupported),
                _ => return Err(err),
            }
        }
    }
}

/// What [`FileStorage::fallocate`] did.
enum Fallocated {
    Done,
    /// Nothing: the file is syncing.
    Syncing,
    /// Nothing: the filesystem cannot.
    Unsupported,
}

impl Storage for FileStorage {
    fn lock(&self, want: LockRequest, mode: Locking) -> Result<(), ErrorKind> {
        self.lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .change(&self.file.file, want, mode)
    }

    fn locks(&self) -> Option<LockRequest> {
        self.lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .current()
    }

    fn is_writable(&self) -> bool {
        self.writable
    }

    fn file_id(&self) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let meta = self.file.file.metadata().ok()?;
        Some((meta.dev(), meta.ino()))
    }

    fn pinned_file(&self) -> io::Result<Option<PinnedFile>> {
        Ok(Some(self.file.clone()))
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if let Some(direct) = self.direct_for(offset, buf.len() as u64) {
            return direct.read_at(buf, offset);
        }
        read_zero_filled(&self.file.file, buf, offset)?;
        self.drop_cached_read(offset, buf.len() as u64);
        Ok(())
    }

    fn read_once_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if let Some(direct) = self.direct_for(offset, buf.len() as u64) {
            return direct.read_at(buf, offset);
        }
        read_zero_filled(self.once.file(&self.file.file), buf, offset)?;
        self.drop_cached_read(offset, buf.len() as u64);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        use std::os::unix::fs::FileTypeExt;
        let meta = self.file.file.metadata()?;
        if meta.file_type().is_block_device() {
            // (A device's size is where its end is; positioned I/O does
            // not use the offset this moves.)
            return Ok(rustix::fs::seek(
                &self.file.file,
                rustix::fs::SeekFrom::End(0),
            )?);
        }
        Ok(meta.len())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if let Some(direct) = self.direct_for(offset, buf.len() as u64) {
            return direct.write_vectored_at(&[buf], offset);
        }
        if self
            .page_sized_writes
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return write_in_pages(&self.file.file, buf, offset);
        }
        self.file.file.write_all_at(buf, offset)
    }

    fn set_page_sized_writes(&self, on: bool) {
        self.page_sized_writes
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn drop_cached(&self, offset: u64, len: u64) {
        if len > 0 {
            crate::direct::drop_cached(&self.file.file, offset, len);
        }
    }

    fn write_metadata_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let Some(direct) = self.file.direct.as_deref() else {
            return self.file.file.write_all_at(buf, offset);
        };
        if buf.is_empty() || direct.fits(offset, buf.len() as u64) {
            return self.write_at(buf, offset);
        }
        // The aligned block around it, as the file holds it now (a direct
        // read writes back a cached page of it first), patched.
        let align = direct.offset_align;
        let start = offset - offset % align;
        let end = (offset + buf.len() as u64).div_ceil(align) * align;
        let mut block = vec![0u8; (end - start) as usize];
        direct.read_at(&mut block, start)?;
        let at = (offset - start) as usize;
        block[at..at + buf.len()].copy_from_slice(buf);
        direct.write_vectored_at(&[&block], start)
    }

    fn write_all_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        if let Some(direct) = self.direct_for(offset, len) {
            return direct.write_vectored_at(bufs, offset);
        }
        if self
            .page_sized_writes
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            let mut at = offset;
            for buf in bufs {
                write_in_pages(&self.file.file, buf, at)?;
                at += buf.len() as u64;
            }
            return Ok(());
        }
        let mut bufs: Vec<&[u8]> = bufs.iter().copied().filter(|b| !b.is_empty()).collect();
        let mut at = offset;
        while !bufs.is_empty() {
            let slices: Vec<io::IoSlice<'_>> = bufs.iter().map(|b| io::IoSlice::new(b)).collect();
            let mut n = match rustix::io::pwritev(&self.file.file, &slices, at) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            };
            at += n as u64;
            // Drop what was written, keep the rest of a part written.
            while let Some(first) = bufs.first_mut() {
                if n < first.len() {
                    *first = &first[n..];
                    break;
                }
                n -= first.len();
                bufs.remove(0);
            }
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        {
            let mut r = self.reserved.lock().unwrap_or_else(PoisonError::into_inner);
            r.end = r.end.min(len);
        }
        self.file.file.set_len(len)
    }

    fn sync(&self) -> io::Result<()> {
        use std::sync::atomic::Ordering;
        if self.sync_failed.load(Ordering::SeqCst) {
            return Err(io::Error::other(
                "an earlier fsync of this file failed and written data may be lost; \
                 reopen the image to go on",
            ));
        }
        // Most of the dirty pages written out before the allocations are
        // held off: the part of the sync that excludes them is then
        // mostly the device's cache flush.
        self.start_write_back();
        let _syncing = self.allocations.syncing();
        // One description's sync covers the file's direct writes too.
        self.file.file.sync_data().inspect_err(|_| {
            self.sync_failed.store(true, Ordering::SeqCst);
        })?;
        if self.file.direct.is_some() {
            // Metadata written through the page cache is on disk now:
            // its pages go, as none would have been kept with O_DIRECT.
            crate::direct::drop_cached(&self.file.file, 0, 0);
        }
        Ok(())
    }

    fn reserve(&self, offset: u64, len: u64) -> io::Result<()> {
        if !self.reserve_ahead(offset, len)? {
            extend_to(self, offset.saturating_add(len))?;
        }
        Ok(())
    }

    fn reserve_ahead(&self, offset: u64, len: u64) -> io::Result<bool> {
        let end = offset.saturating_add(len);
        if self.file.direct.is_some() {
            let reserved = || self.reserved.lock().unwrap_or_else(PoisonError::into_inner);
            {
                let r = reserved();
                if offset >= r.start && end <= r.end {
                    return Ok(true);
                }
            }
            let ahead = end.div_ceil(DIRECT_RESERVE_CHUNK) * DIRECT_RESERVE_CHUNK;
            let unsupported = [libc::EOPNOTSUPP, libc::ENOSYS];
            if let Fallocated::Done = self.fallocate(0, offset, ahead - offset, &unsupported)? {
                *reserved() = offset..ahead;
                return Ok(true);
            }
        }
        // Mode 0 only allocates blocks (and extends the size), it never
        // changes data.
        match self.fallocate(0, offset, len, &[libc::EOPNOTSUPP, libc::ENOSYS])? {
            Fallocated::Done => Ok(true),
            Fallocated::Syncing => Ok(false),
            // Filesystems without fallocate: extend the size instead;
            // space is then only claimed by the write itself.
            Fallocated::Unsupported => extend_to(self, offset.saturating_add(len)).map(|()| true),
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        // ZERO_RANGE with KEEP_SIZE only makes the range read as zeros.
        let mode = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        // Filesystems without it (tmpfs, FUSE), or a sync running: write
        // the zeros.
        let unsupported = [libc::EOPNOTSUPP, libc::ENOSYS, libc::EINVAL];
        match self.fallocate(mode, offset, len, &unsupported)? {
            Fallocated::Done => Ok(()),
            Fallocated::Syncing | Fallocated::Unsupported => write_zero_bytes(self, offset, len),
        }
    }

    fn allocation(&self, offset: u64, len: u64) -> Option<(bool, u64)> {
        use std::os::fd::AsRawFd;
        let fd = self.file.file.as_raw_fd();
        let start = i64::try_from(offset).ok()?;
        // SAFETY: lseek on a file descriptor we own; it only moves the file
        // position, which positioned reads do not use.
        let data = unsafe { libc::lseek(fd, start, libc::SEEK_DATA) };
        if data < 0 {
            let err = io::Error::last_os_error();
            // ENXIO: no data at or after `offset` (a trailing hole).
            return (err.raw_os_error() == Some(libc::ENXIO)).then_some((false, len));
        }
        if data > start {
            return Some((false, ((data - start) as u64).min(len)));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
        if hole <= start {
            return None;
        }
        Some((true, ((hole - start) as u64).min(len)))
    }
}

/// Storage in memory, for tests and fault injection.
#[derive(Debug, Default)]
pub struct MemStorage {
    bytes: RwLock<Vec<u8>>,
    /// Most bytes it may grow to (`ENOSPC` beyond), like a small
    /// filesystem; `None`: unbounded.
    limit: Option<u64>,
}

impl MemStorage {
    /// Storage holding `bytes`.
    pub fn new(bytes: Vec<u8>) -> Self {
        Self {
            bytes: RwLock::new(bytes),
            limit: None,
        }
    }

    /// Storage holding `bytes` that refuses to grow past `limit` bytes, so
    /// that hostile images cannot make a test exhaust memory.
    pub fn with_limit(bytes: Vec<u8>, limit: u64) -> Self {
        Self {
            bytes: RwLock::new(bytes),
            limit: Some(limit),
        }
    }

    fn check_limit(&self, end: u64) -> io::Result<()> {
        match self.limit {
            Some(limit) if end > limit => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
            _ => Ok(()),
        }
    }

    /// A copy of the current bytes.
    pub fn snapshot(&self) -> Vec<u8> {
        self.bytes.read().map(|b| b.clone()).unwrap_or_default()
    }
}

impl Storage for MemStorage {
    fn is_writable(&self) -> bool {
        true
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let bytes = self
            .bytes
            .read()
            .map_err(|_| io::Error::other("storage lock poisoned"))?;
        buf.fill(0);
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(bytes.len());
        let end = start.saturating_add(buf.len()).min(bytes.len());
        buf[..end - start].copy_from_slice(&bytes[start..end]);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let bytes = self
            .bytes
            .read()
            .map_err(|_| io::Error::other("storage lock poisoned"))?;
        Ok(bytes.len() as u64)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_limit(offset.saturating_add(buf.len() as u64))?;
        let mut bytes = self
            .bytes
            .write()
            .map_err(|_| io::Error::other("storage lock poisoned"))?;
        let start = usize::try_from(offset).map_err(io::Error::other)?;
        let end = start + buf.len();
        if bytes.len() < end {
            bytes.resize(end, 0);
        }
        bytes[start..end].copy_from_slice(buf);
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.check_limit(len)?;
        let mut bytes = self
            .bytes
            .write()
            .map_err(|_| io::Error::other("storage lock poisoned"))?;
        bytes.resize(usize::try_from(len).map_err(io::Error::other)?, 0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn blocks(s: &FileStorage) -> u64 {
        s.file().metadata().unwrap().blocks()
    }

    /// An empty file in a new directory (removed with it), open for writing.
    fn scratch_file() -> (tempfile::TempDir, FileStorage) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::File::create(&path).unwrap();
        let s = FileStorage::open_read_write(&path).unwrap();
        (dir, s)
    }

    #[test]
    fn no_blocks_are_allocated_while_the_file_syncs() {
        let (_dir, s) = scratch_file();
        {
            let _sync = s.allocations.syncing();
            s.reserve(0, 1 << 20).unwrap();
            assert_eq!(s.len().unwrap(), 1 << 20, "the range is in the file");
            assert!(blocks(&s) <= 8, "no block allocated ahead during a sync");
            assert!(
                !s.reserve_ahead(0, 1 << 20).unwrap(),
                "declined during a sync"
            );
            s.write_zeroes(0, 4096).unwrap();
        }
        let mut buf = vec![1u8; 4096];
        s.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|b| *b == 0));
        s.reserve(1 << 20, 1 << 20).unwrap();
        assert!(
            blocks(&s) >= (1 << 20) / 512,
            "blocks allocated once no sync runs: {}",
            blocks(&s)
        );
        s.sync().unwrap();
    }

    /// A file whose length, as its user read it, is out of date: another
    /// thread extended it since.
    #[derive(Debug)]
    struct StaleLength {
        file: FileStorage,
        read: u64,
    }

    impl Storage for StaleLength {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.file.read_at(buf, offset)
        }
        fn len(&self) -> io::Result<u64> {
            Ok(self.read)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.file.write_at(buf, offset)
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            self.file.set_len(len)
        }
    }

    #[test]
    fn an_extension_never_shrinks_a_file_another_thread_extended() {
        let (_dir, file) = scratch_file();
        // Another thread's cluster at 1 MiB, written after this one read
        // the length (0).
        file.write_at(&[7u8; 4096], 1 << 20).unwrap();
        let stale = StaleLength { file, read: 0 };
        stale.reserve(0, 65536).unwrap();
        assert_eq!(stale.file.len().unwrap(), (1 << 20) + 4096);
        let mut buf = [0u8; 4096];
        stale.file.read_at(&mut buf, 1 << 20).unwrap();
        assert_eq!(buf, [7u8; 4096], "the other thread's data is still there");
    }

    /// With page-sized writes, a large write leaves its data in
    /// single-page folios; without, the kernel may make one folio of it
    /// (ext4 on Linux >= 6.16), which the test must see for its first
    /// half to mean anything.
    #[test]
    fn page_sized_writes_leave_single_page_folios() {
        let data = vec![0x5a; 256 << 10];
        let (_a, whole) = scratch_file();
        whole.write_at(&data, 0).unwrap();
        let Some(large) =
            crate::folios::largest_folio_pages(whole.file(), 0, data.len() as u64).unwrap()
        else {
            eprintln!("the kernel hides frame numbers (not root): nothing to compare");
            return;
        };
        if large == 1 {
            eprintln!("this kernel keeps a 256 KiB write in single pages anyway");
        }
        let (_b, paged) = scratch_file();
        paged.set_page_sized_writes(true);
        paged.write_at(&data[..64 << 10], 0).unwrap();
        paged
            .write_all_vectored_at(&[&data[..4 << 10], &data[(68 << 10)..]], 64 << 10)
            .unwrap();
        let got = crate::folios::largest_folio_pages(paged.file(), 0, data.len() as u64).unwrap();
        assert_eq!(got, Some(1), "a folio of several pages (without: {large})");
        let mut back = vec![0u8; data.len()];
        paged.read_at(&mut back, 0).unwrap();
        assert!(back == data, "page-sized writes wrote other bytes");
    }
}
