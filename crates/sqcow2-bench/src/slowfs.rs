//! A read-only FUSE filesystem that passes a directory's files through
//! and answers every read a fixed delay later: remote storage (the sQemu
//! paper's NFS server) on one machine. Reads are direct I/O at the FUSE
//! layer (`FOPEN_DIRECT_IO`), so the page cache of the mount never hides
//! the delay; the files below are read from the host's page cache.
//! Requests overlap: the delay is latency, not a limit on throughput.
//! Mounting needs root and `/dev/fuse`.

use std::collections::{BinaryHeap, HashMap};
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use fuser::{
    consts::FOPEN_DIRECT_IO, FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyData,
    ReplyEntry, ReplyOpen, Request,
};

/// Arguments of `sqcow2-bench slowfs`.
#[derive(Debug, clap::Args)]
pub struct SlowfsArgs {
    /// Delay added to every read, microseconds.
    #[arg(long, default_value_t = 200)]
    delay_us: u64,
    /// Directory whose files to serve.
    source: PathBuf,
    /// Where to mount them.
    mountpoint: PathBuf,
}

/// Mounts until SIGINT or SIGTERM, then unmounts.
pub fn run_cli(args: &SlowfsArgs) -> anyhow::Result<()> {
    // SAFETY: `set` is a signal set this function owns, initialised by
    // sigemptyset; blocking SIGINT and SIGTERM before any thread starts
    // (the filesystem's threads inherit the mask) leaves them to sigwait.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let fs = SlowFs::mount(
        &args.source,
        &args.mountpoint,
        Duration::from_micros(args.delay_us),
    )?;
    let mut signal = 0;
    // SAFETY: sigwait reads `set` and writes `signal`, both owned here.
    unsafe { libc::sigwait(&set, &mut signal) };
    eprintln!("signal {signal}: unmounting after {} reads", fs.reads());
    drop(fs);
    Ok(())
}

/// What the filesystem served.
#[derive(Debug, Default)]
pub struct Counters {
    /// Read requests answered.
    pub reads: AtomicU64,
}

/// A mounted slow filesystem; unmounted when dropped.
pub struct SlowFs {
    mountpoint: PathBuf,
    counters: Arc<Counters>,
    session: Option<fuser::BackgroundSession>,
}

impl std::fmt::Debug for SlowFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlowFs")
            .field("mountpoint", &self.mountpoint)
            .finish()
    }
}

impl SlowFs {
    /// Mounts the regular files of `source` (not its subdirectories) at
    /// `mountpoint`, every read answered `delay` after it arrived.
    pub fn mount(source: &Path, mountpoint: &Path, delay: Duration) -> anyhow::Result<SlowFs> {
        std::fs::create_dir_all(mountpoint)?;
        let mut files = Vec::new();
        let mut by_name = HashMap::new();
        for entry in std::fs::read_dir(source)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                let name = entry.file_name().to_string_lossy().into_owned();
                by_name.insert(name, files.len() as u64 + 2);
                files.push(Arc::new(File::open(entry.path())?));
            }
        }
        let counters = Arc::new(Counters::default());
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name("slowfs-delay".into())
            .spawn(move || answer_when_due(rx))?;
        let fs = Passthrough {
            files,
            by_name,
            delay,
            counters: counters.clone(),
            due: tx,
        };
        let session = fuser::spawn_mount2(
            fs,
            mountpoint,
            &[MountOption::FSName("sqcow2-slowfs".into()), MountOption::RO],
        )
        .context("mounting the slow FUSE filesystem (needs root and /dev/fuse)")?;
        Ok(SlowFs {
            mountpoint: mountpoint.to_path_buf(),
            counters,
            session: Some(session),
        })
    }

    /// Read requests answered so far.
    pub fn reads(&self) -> u64 {
        self.counters.reads.load(Ordering::Relaxed)
    }
}

impl Drop for SlowFs {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            s.join();
        }
    }
}

/// A read answered when its time comes.
struct Due {
    at: Instant,
    data: Vec<u8>,
    reply: ReplyData,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // The earliest first out of the (max-)heap.
        other.at.cmp(&self.at)
    }
}

/// Answers each read at its time, in time order.
fn answer_when_due(rx: Receiver<Due>) {
    let mut heap: BinaryHeap<Due> = BinaryHeap::new();
    loop {
        let now = Instant::now();
        while heap.peek().is_some_and(|d| d.at <= now) {
            if let Some(d) = heap.pop() {
                d.reply.data(&d.data);
            }
        }
        let next = match heap.peek() {
            Some(d) => rx.recv_timeout(d.at.saturating_duration_since(now)),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match next {
            Ok(d) => heap.push(d),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                for d in heap.drain() {
                    d.reply.data(&d.data);
                }
                return;
            }
        }
    }
}

struct Passthrough {
    files: Vec<Arc<File>>,
    by_name: HashMap<String, u64>,
    delay: Duration,
    counters: Arc<Counters>,
    due: Sender<Due>,
}

const ROOT: u64 = 1;
const TTL: Duration = Duration::from_secs(3600);

impl Passthrough {
    fn file(&self, ino: u64) -> Option<&Arc<File>> {
        let i = usize::try_from(ino.checked_sub(2)?).ok()?;
        self.files.get(i)
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let (kind, size, perm) = if ino == ROOT {
            (FileType::Directory, 0, 0o555)
        } else {
            (
                FileType::RegularFile,
                self.file(ino)?.metadata().ok()?.len(),
                0o444,
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
    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let found = (parent == ROOT)
            .then(|| self.by_name.get(&*name.to_string_lossy()).copied())
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

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(libc::EROFS);
        }
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
        let arrived = Instant::now();
        let Some(f) = self.file(ino) else {
            return reply.error(libc::ENOENT);
        };
        let mut buf = vec![0u8; size as usize];
        let mut done = 0;
        while done < buf.len() {
            match f.read_at(&mut buf[done..], offset as u64 + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(_) => return reply.error(libc::EIO),
            }
        }
        buf.truncate(done);
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        let due = Due {
            at: arrived + self.delay,
            data: buf,
            reply,
        };
        if let Err(e) = self.due.send(due) {
            e.0.reply.error(libc::EIO);
        }
    }
}
