//! A FUSE filesystem that passes a directory's files through and fails
//! reads, writes or fsyncs with a real `EIO` on demand: the I/O error a
//! dying disk gives, seen through an ordinary file descriptor (and so
//! through io_uring too). It can also hold a write in flight until the
//! test releases it (a slow disk, made deterministic). Mounting needs root
//! (CI runs as root).

#![allow(dead_code)]

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use fuser::{
    consts::FOPEN_DIRECT_IO, FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyData,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow,
};

/// Which operations fail with `EIO` now, and which writes are held.
#[derive(Debug, Default)]
pub struct Faults {
    pub reads: AtomicBool,
    pub writes: AtomicBool,
    pub fsyncs: AtomicBool,
    holds: Mutex<Holds>,
}

/// Requests to hold: the next `count` reads or writes overlapping
/// `[start, end)`.
#[derive(Default)]
struct Holds {
    writes: bool,
    start: u64,
    end: u64,
    count: usize,
    held: Vec<Held>,
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Holds({}..{}, {} held)",
            self.start,
            self.end,
            self.held.len()
        )
    }
}

/// A request that has not reached the file yet, nor been answered.
enum Held {
    Write {
        file: File,
        offset: u64,
        data: Vec<u8>,
        reply: ReplyWrite,
    },
    Read {
        file: File,
        offset: u64,
        size: usize,
        reply: ReplyData,
    },
}

impl Faults {
    pub fn set(&self, reads: bool, writes: bool, fsyncs: bool) {
        self.reads.store(reads, Ordering::SeqCst);
        self.writes.store(writes, Ordering::SeqCst);
        self.fsyncs.store(fsyncs, Ordering::SeqCst);
    }

    /// Holds the next `count` writes (or reads) that overlap
    /// `[start, end)` of any file: they neither reach the file nor
    /// complete until [`Faults::release`]. Other requests go on meanwhile.
    pub fn hold(&self, writes: bool, start: u64, end: u64, count: usize) {
        let mut h = self.holds.lock().unwrap();
        h.writes = writes;
        h.start = start;
        h.end = end;
        h.count = count;
    }

    /// Waits (at most 30 s) until `n` requests are held.
    pub fn wait_held(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.holds.lock().unwrap().held.len() < n {
            assert!(Instant::now() < deadline, "no request was held within 30 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Carries out the held requests now and completes them.
    pub fn release(&self) {
        let held = std::mem::take(&mut self.holds.lock().unwrap().held);
        for h in held {
            match h {
                Held::Write {
                    file,
                    offset,
                    data,
                    reply,
                } => match file.write_all_at(&data, offset) {
                    Ok(()) => reply.written(data.len() as u32),
                    Err(_) => reply.error(libc::EIO),
                },
                Held::Read {
                    file,
                    offset,
                    size,
                    reply,
                } => match read_fully(&file, offset, size) {
                    Some(buf) => reply.data(&buf),
                    None => reply.error(libc::EIO),
                },
            }
        }
    }

    /// Whether a request of `len` bytes at `offset` is to be held now.
    fn take_hold(&self, writes: bool, offset: u64, len: u64) -> bool {
        let mut h = self.holds.lock().unwrap();
        if h.count == 0 || h.writes != writes || offset + len <= h.start || offset >= h.end {
            return false;
        }
        h.count -= 1;
        true
    }

    fn keep(&self, held: Held) {
        self.holds.lock().unwrap().held.push(held);
    }
}

/// Up to `size` bytes of `file` at `offset` (fewer at the end of the file).
fn read_fully(file: &File, offset: u64, size: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; size];
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(_) => return None,
        }
    }
    buf.truncate(done);
    Some(buf)
}

struct Passthrough {
    files: Vec<(String, File)>,
    faults: Arc<Faults>,
    /// Take over byte-range locks and refuse them (ENOLCK), like a
    /// network filesystem mounted without lock support.
    refuse_locks: bool,
}

const ROOT: u64 = 1;
const TTL: Duration = Duration::ZERO;

impl Passthrough {
    fn file(&self, ino: u64) -> Option<&File> {
        let i = usize::try_from(ino.checked_sub(2)?).ok()?;
        self.files.get(i).map(|(_, f)| f)
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let (kind, size, perm) = if ino == ROOT {
            (FileType::Directory, 0, 0o755)
        } else {
            (
                FileType::RegularFile,
                self.file(ino)?.metadata().ok()?.len(),
                0o644,
            )
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: SystemTime::UNIX_EPOCH,
            mtime: SystemTime::UNIX_EPOCH,
            ctime: SystemTime::UNIX_EPOCH,
            crtime: SystemTime::UNIX_EPOCH,
            kind,
            perm,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }
}

impl Filesystem for Passthrough {
    fn init(
        &mut self,
        _req: &Request<'_>,
        config: &mut fuser::KernelConfig,
    ) -> Result<(), libc::c_int> {
        if self.refuse_locks {
            // Locks go to this filesystem (not handled by the kernel).
            let _ = config.add_capabilities(fuser::consts::FUSE_POSIX_LOCKS);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn getlk(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _fh: u64,
        _lock_owner: u64,
        _start: u64,
        _end: u64,
        _typ: i32,
        _pid: u32,
        reply: fuser::ReplyLock,
    ) {
        reply.error(libc::ENOLCK);
    }

    #[allow(clippy::too_many_arguments)]
    fn setlk(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _fh: u64,
        _lock_owner: u64,
        _start: u64,
        _end: u64,
        _typ: i32,
        _pid: u32,
        _sleep: bool,
        reply: ReplyEmpty,
    ) {
        reply.error(libc::ENOLCK);
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let found = (parent == ROOT)
            .then(|| self.files.iter().position(|(n, _)| OsStr::new(n) == name))
            .flatten()
            .and_then(|i| self.attr(i as u64 + 2));
        match found {
            Some(attr) => reply.entry(&TTL, &attr, 0),
            None => reply.error(libc::ENOENT),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(libc::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        if let (Some(size), Some(f)) = (size, self.file(ino)) {
            if f.set_len(size).is_err() {
                return reply.error(libc::EIO);
            }
        }
        match self.attr(ino) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(libc::ENOENT),
        }
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        match self.file(ino) {
            Some(_) => reply.opened(0, FOPEN_DIRECT_IO),
            None => reply.error(libc::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock: Option<u64>,
        reply: ReplyData,
    ) {
        if self.faults.reads.load(Ordering::SeqCst) {
            return reply.error(libc::EIO);
        }
        let Some(f) = self.file(ino) else {
            return reply.error(libc::ENOENT);
        };
        if self.faults.take_hold(false, offset as u64, u64::from(size)) {
            if let Ok(file) = f.try_clone() {
                return self.faults.keep(Held::Read {
                    file,
                    offset: offset as u64,
                    size: size as usize,
                    reply,
                });
            }
        }
        match read_fully(f, offset as u64, size as usize) {
            Some(buf) => reply.data(&buf),
            None => reply.error(libc::EIO),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock: Option<u64>,
        reply: ReplyWrite,
    ) {
        if self.faults.writes.load(Ordering::SeqCst) {
            return reply.error(libc::EIO);
        }
        let Some(f) = self.file(ino) else {
            return reply.error(libc::ENOENT);
        };
        if self
            .faults
            .take_hold(true, offset as u64, data.len() as u64)
        {
            if let Ok(file) = f.try_clone() {
                return self.faults.keep(Held::Write {
                    file,
                    offset: offset as u64,
                    data: data.to_vec(),
                    reply,
                });
            }
        }
        match self.file(ino).map(|f| f.write_all_at(data, offset as u64)) {
            Some(Ok(())) => reply.written(data.len() as u32),
            _ => reply.error(libc::EIO),
        }
    }

    fn fsync(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, _data: bool, reply: ReplyEmpty) {
        if self.faults.fsyncs.load(Ordering::SeqCst) {
            return reply.error(libc::EIO);
        }
        match self.file(ino).map(File::sync_data) {
            Some(Ok(())) => reply.ok(),
            _ => reply.error(libc::EIO),
        }
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lock: u64, reply: ReplyEmpty) {
        reply.ok();
    }

    #[allow(clippy::too_many_arguments)]
    fn fallocate(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        length: i64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if self.faults.writes.load(Ordering::SeqCst) {
            return reply.error(libc::EIO);
        }
        let Some(f) = self.file(ino) else {
            return reply.error(libc::ENOENT);
        };
        // SAFETY: fallocate on a file this filesystem owns.
        let r =
            unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(f), mode, offset, length) };
        if r == 0 {
            reply.ok();
        } else {
            reply.error(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO),
            );
        }
    }
}

/// The files of `source` (a flat directory) mounted at `mountpoint`;
/// unmounted on drop.
pub struct FaultyFs {
    pub mountpoint: PathBuf,
    pub faults: Arc<Faults>,
    session: Option<fuser::BackgroundSession>,
}

impl FaultyFs {
    pub fn mount(source: &Path, mountpoint: &Path) -> FaultyFs {
        FaultyFs::mount_with(source, mountpoint, false)
    }

    /// [`FaultyFs::mount`] on a filesystem that refuses byte-range locks
    /// (ENOLCK), like NFS mounted with `nolock` and no local locking.
    pub fn mount_without_locks(source: &Path, mountpoint: &Path) -> FaultyFs {
        FaultyFs::mount_with(source, mountpoint, true)
    }

    fn mount_with(source: &Path, mountpoint: &Path, refuse_locks: bool) -> FaultyFs {
        std::fs::create_dir_all(mountpoint).unwrap();
        let mut files = Vec::new();
        for entry in std::fs::read_dir(source).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(entry.path())
                    .unwrap();
                files.push((entry.file_name().to_string_lossy().into_owned(), file));
            }
        }
        let faults = Arc::new(Faults::default());
        let fs = Passthrough {
            files,
            faults: faults.clone(),
            refuse_locks,
        };
        let session = fuser::spawn_mount2(
            fs,
            mountpoint,
            &[MountOption::FSName("sqcow2-faulty".into())],
        )
        .unwrap_or_else(|e| panic!("mounting FUSE needs root and /dev/fuse: {e}"));
        FaultyFs {
            mountpoint: mountpoint.to_path_buf(),
            faults,
            session: Some(session),
        }
    }
}

impl Drop for FaultyFs {
    fn drop(&mut self) {
        // A held write would keep its writer (and the unmount) waiting.
        self.faults.release();
        if let Some(s) = self.session.take() {
            s.join();
        }
    }
}
