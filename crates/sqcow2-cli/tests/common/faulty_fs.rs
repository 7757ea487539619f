//! A FUSE filesystem that passes a flat directory's files through (and,
//! mounted so, lets files be created, renamed, linked and removed there)
//! and fails reads, writes or fsyncs with a real `EIO` on demand (a change
//! of the directory fails with the writes): the I/O error a
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
    consts::FOPEN_DIRECT_IO, FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow,
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
    /// The directory passed through.
    dir: PathBuf,
    /// Open files by inode number - 2 (`None`: gone, no name left).
    inodes: Vec<Option<File>>,
    /// The directory's entries: name and inode number (hard links share
    /// one).
    names: Vec<(String, u64)>,
    faults: Arc<Faults>,
    /// Take over byte-range locks and refuse them (ENOLCK), like a
    /// network filesystem mounted without lock support.
    refuse_locks: bool,
    /// Files may be created, renamed, linked and removed, and the
    /// directory listed (else `ENOSYS`, as a filesystem without them).
    new_files: bool,
}

const ROOT: u64 = 1;
const TTL: Duration = Duration::ZERO;

impl Passthrough {
    fn file(&self, ino: u64) -> Option<&File> {
        let i = usize::try_from(ino.checked_sub(2)?).ok()?;
        self.inodes.get(i)?.as_ref()
    }

    fn ino_of(&self, name: &OsStr) -> Option<u64> {
        self.names
            .iter()
            .find(|(n, _)| OsStr::new(n) == name)
            .map(|(_, ino)| *ino)
    }

    /// Drops the name (and the inode once no name is left).
    fn forget_name(&mut self, name: &OsStr) {
        let Some(ino) = self.ino_of(name) else {
            return;
        };
        self.names.retain(|(n, _)| OsStr::new(n) != name);
        if !self.names.iter().any(|(_, i)| *i == ino) {
            if let Some(slot) = self.inodes.get_mut(ino as usize - 2) {
                *slot = None;
            }
        }
    }

    /// The error a change of the directory gets now, if any: `ENOSYS`
    /// unless mounted with new files, `EIO` while writes fail.
    fn dir_change_refused(&self) -> Option<libc::c_int> {
        if !self.new_files {
            Some(libc::ENOSYS)
        } else if self.faults.writes.load(Ordering::SeqCst) {
            Some(libc::EIO)
        } else {
            None
        }
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
        let nlink = if ino == ROOT {
            2
        } else {
            self.names.iter().filter(|(_, i)| *i == ino).count() as u32
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
            nlink,
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
            .then(|| self.ino_of(name))
            .flatten()
            .and_then(|ino| self.attr(ino));
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
    fn create(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        if parent != ROOT {
            return reply.error(libc::ENOENT);
        }
        if let Some(e) = self.dir_change_refused() {
            return reply.error(e);
        }
        if let Some(ino) = self.ino_of(name) {
            if flags & libc::O_EXCL != 0 {
                return reply.error(libc::EEXIST);
            }
            return match self.attr(ino) {
                Some(attr) => reply.created(&TTL, &attr, 0, 0, FOPEN_DIRECT_IO),
                None => reply.error(libc::ENOENT),
            };
        }
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(self.dir.join(name))
        {
            Ok(f) => f,
            Err(e) => return reply.error(e.raw_os_error().unwrap_or(libc::EIO)),
        };
        self.inodes.push(Some(file));
        let ino = self.inodes.len() as u64 + 1;
        self.names.push((name.to_string_lossy().into_owned(), ino));
        match self.attr(ino) {
            Some(attr) => reply.created(&TTL, &attr, 0, 0, FOPEN_DIRECT_IO),
            None => reply.error(libc::EIO),
        }
    }

    fn unlink(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        if parent != ROOT || self.ino_of(name).is_none() {
            return reply.error(libc::ENOENT);
        }
        if let Some(e) = self.dir_change_refused() {
            return reply.error(e);
        }
        if let Err(e) = std::fs::remove_file(self.dir.join(name)) {
            return reply.error(e.raw_os_error().unwrap_or(libc::EIO));
        }
        self.forget_name(name);
        reply.ok();
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: ReplyEmpty,
    ) {
        let Some(ino) = (parent == ROOT && newparent == ROOT)
            .then(|| self.ino_of(name))
            .flatten()
        else {
            return reply.error(libc::ENOENT);
        };
        if flags & !libc::RENAME_NOREPLACE != 0 {
            return reply.error(libc::EINVAL);
        }
        if let Some(e) = self.dir_change_refused() {
            return reply.error(e);
        }
        if flags & libc::RENAME_NOREPLACE != 0 && self.ino_of(newname).is_some() {
            return reply.error(libc::EEXIST);
        }
        if self.ino_of(newname) == Some(ino) {
            // The same file (the same name, or another link to it):
            // rename(2) does nothing.
            return reply.ok();
        }
        if let Err(e) = std::fs::rename(self.dir.join(name), self.dir.join(newname)) {
            return reply.error(e.raw_os_error().unwrap_or(libc::EIO));
        }
        self.forget_name(newname);
        self.names.retain(|(n, _)| OsStr::new(n) != name);
        self.names
            .push((newname.to_string_lossy().into_owned(), ino));
        reply.ok();
    }

    fn link(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        newparent: u64,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let Some(old) = self
            .names
            .iter()
            .find(|(_, i)| *i == ino)
            .map(|(n, _)| n.clone())
        else {
            return reply.error(libc::ENOENT);
        };
        if newparent != ROOT {
            return reply.error(libc::ENOENT);
        }
        if let Some(e) = self.dir_change_refused() {
            return reply.error(e);
        }
        if self.ino_of(newname).is_some() {
            return reply.error(libc::EEXIST);
        }
        if let Err(e) = std::fs::hard_link(self.dir.join(old), self.dir.join(newname)) {
            return reply.error(e.raw_os_error().unwrap_or(libc::EIO));
        }
        self.names
            .push((newname.to_string_lossy().into_owned(), ino));
        match self.attr(ino) {
            Some(attr) => reply.entry(&TTL, &attr, 0),
            None => reply.error(libc::EIO),
        }
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        if !self.new_files {
            return reply.error(libc::ENOSYS);
        }
        if ino != ROOT {
            return reply.error(libc::ENOTDIR);
        }
        let mut entries = vec![
            (ROOT, FileType::Directory, ".".to_string()),
            (ROOT, FileType::Directory, "..".to_string()),
        ];
        entries.extend(
            self.names
                .iter()
                .map(|(n, i)| (*i, FileType::RegularFile, n.clone())),
        );
        for (k, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, k as i64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _fh: u64,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        if self.faults.fsyncs.load(Ordering::SeqCst) {
            return reply.error(libc::EIO);
        }
        match File::open(&self.dir).and_then(|d| d.sync_all()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e.raw_os_error().unwrap_or(libc::EIO)),
        }
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
    /// The files of `source`, no new file possible (`ENOSYS`): so no
    /// side file (journal, index) either.
    pub fn mount(source: &Path, mountpoint: &Path) -> FaultyFs {
        FaultyFs::mount_with(source, mountpoint, false, false)
    }

    /// [`FaultyFs::mount`] where files can also be created, renamed,
    /// linked and removed (side files work; a change of the directory
    /// fails with `EIO` while writes do).
    pub fn mount_with_new_files(source: &Path, mountpoint: &Path) -> FaultyFs {
        FaultyFs::mount_with(source, mountpoint, false, true)
    }

    /// [`FaultyFs::mount`] on a filesystem that refuses byte-range locks
    /// (ENOLCK), like NFS mounted with `nolock` and no local locking.
    pub fn mount_without_locks(source: &Path, mountpoint: &Path) -> FaultyFs {
        FaultyFs::mount_with(source, mountpoint, true, false)
    }

    fn mount_with(
        source: &Path,
        mountpoint: &Path,
        refuse_locks: bool,
        new_files: bool,
    ) -> FaultyFs {
        std::fs::create_dir_all(mountpoint).unwrap();
        let (mut inodes, mut names) = (Vec::new(), Vec::new());
        for entry in std::fs::read_dir(source).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(entry.path())
                    .unwrap();
                inodes.push(Some(file));
                let ino = inodes.len() as u64 + 1;
                names.push((entry.file_name().to_string_lossy().into_owned(), ino));
            }
        }
        let faults = Arc::new(Faults::default());
        let fs = Passthrough {
            dir: source.to_path_buf(),
            inodes,
            names,
            faults: faults.clone(),
            refuse_locks,
            new_files,
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
