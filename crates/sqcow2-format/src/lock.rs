//! Image locks as QEMU takes them (`block/file-posix.c`), so that QEMU and
//! sqcow2 see each other: open-file-description read locks on single
//! bytes of the image file, byte 100 + n for each permission n the user
//! holds, byte 200 + n for each permission it does not share. A new user
//! first locks its bytes, then probes for a conflict: a lock held by
//! another open file description (another process, or another open of the
//! same file) on byte 200 + n for a permission n it wants, or on byte
//! 100 + n for a permission it does not share. Locks die with the file
//! description (a killed process leaves none).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Once;

use crate::error::ErrorKind;

/// Permissions on an image, QEMU's `BLK_PERM_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Perms(u8);

impl Perms {
    /// Nothing.
    pub const NONE: Perms = Perms(0);
    /// Reading data that nobody changes meanwhile.
    pub const CONSISTENT_READ: Perms = Perms(0x01);
    /// Writing.
    pub const WRITE: Perms = Perms(0x02);
    /// Writing what does not change what readers see.
    pub const WRITE_UNCHANGED: Perms = Perms(0x04);
    /// Changing the file's size.
    pub const RESIZE: Perms = Perms(0x08);
    /// Every permission (QEMU 6.2 and later: bits 0 to 3).
    pub const ALL: Perms = Perms(0x0f);

    /// Both sets.
    pub const fn union(self, other: Perms) -> Perms {
        Perms(self.0 | other.0)
    }

    fn has(self, bit: u8) -> bool {
        self.0 & (1 << bit) != 0
    }
}

/// QEMU's names of the permission bits, in its error messages.
const NAMES: [&str; 4] = ["consistent read", "write", "write unchanged", "resize"];
/// First byte of the held permissions.
const PERM_BASE: i64 = 100;
/// First byte of the permissions not shared.
const SHARED_BASE: i64 = 200;

/// Whether to lock images (QEMU's `locking` option of the file driver).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Locking {
    /// Lock; where the filesystem cannot, warn once and go on without.
    #[default]
    Auto,
    /// Lock; where the filesystem cannot, refuse to open.
    On,
    /// Never lock nor look at others' locks.
    Off,
}

/// What a user of an image holds and does not share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LockRequest {
    /// Permissions held.
    pub held: Perms,
    /// Permissions others may not have.
    pub unshared: Perms,
}

impl LockRequest {
    /// No lock at all (an inactive image, or locking off).
    pub const NONE: LockRequest = LockRequest {
        held: Perms::NONE,
        unshared: Perms::NONE,
    };
    /// A writable top: consistent read, write and resize held; nobody else
    /// may write or resize (QEMU: bytes 100, 101, 103, 201, 203).
    pub const WRITER: LockRequest = LockRequest {
        held: Perms(0x0b),
        unshared: Perms(0x0a),
    };
    /// A reader (a backing layer, a read-only export, check, map,
    /// convert): consistent read held; nobody else may write or resize
    /// (bytes 100, 201, 203).
    pub const READER: LockRequest = LockRequest {
        held: Perms::CONSISTENT_READ,
        unshared: Perms(0x0a),
    };
    /// Looking at headers only (`info`): nothing held; nobody else may
    /// write or resize (bytes 201, 203).
    pub const INSPECTOR: LockRequest = LockRequest {
        held: Perms::NONE,
        unshared: Perms(0x0a),
    };

    /// The same, sharing everything with others (`qemu-img -U`,
    /// `--force-share`).
    pub const fn sharing_all(self) -> LockRequest {
        LockRequest {
            held: self.held,
            unshared: Perms::NONE,
        }
    }
}

/// The lock bytes one open file description holds.
#[derive(Debug, Default)]
pub(crate) struct FileLock {
    /// What is locked now (`None`: locking is off or unsupported here).
    current: Option<LockRequest>,
}

/// How a lock probe answered.
enum Probe {
    Free,
    Taken,
}

fn flock(kind: i16, byte: i64) -> libc::flock {
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = byte;
    fl.l_len = 1;
    fl
}

/// Sets (`F_RDLCK`) or releases (`F_UNLCK`) the OFD lock on `byte`.
fn set(file: &File, kind: i16, byte: i64) -> io::Result<()> {
    let fl = flock(kind, byte);
    loop {
        // SAFETY: fcntl on a file descriptor `file` owns, with a pointer
        // to a valid `flock` for the duration of the call.
        let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Whether another open file description holds a lock on `byte`.
fn probe(file: &File, byte: i64) -> io::Result<Probe> {
    let mut fl = flock(libc::F_WRLCK as i16, byte);
    loop {
        // SAFETY: as in `set`; the kernel fills `fl` in.
        let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
        if r == 0 {
            return Ok(if fl.l_type == libc::F_UNLCK as i16 {
                Probe::Free
            } else {
                Probe::Taken
            });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The bytes a request locks.
fn bytes(req: LockRequest) -> impl Iterator<Item = i64> {
    (0..4u8)
        .filter(move |&b| req.held.has(b))
        .map(|b| PERM_BASE + i64::from(b))
        .chain(
            (0..4u8)
                .filter(move |&b| req.unshared.has(b))
                .map(|b| SHARED_BASE + i64::from(b)),
        )
}

/// Sets exactly the bytes of `want`, releasing those of `had` that it
/// does not need.
fn apply_exactly(file: &File, had: LockRequest, want: LockRequest) -> io::Result<()> {
    for byte in bytes(want) {
        set(file, libc::F_RDLCK as i16, byte)?;
    }
    let keep: Vec<i64> = bytes(want).collect();
    for byte in bytes(had).filter(|b| !keep.contains(b)) {
        set(file, libc::F_UNLCK as i16, byte)?;
    }
    Ok(())
}

/// The conflict that `want` meets, if any.
fn conflict(file: &File, want: LockRequest) -> io::Result<Option<ErrorKind>> {
    for bit in 0..4u8 {
        if want.held.has(bit) {
            if let Probe::Taken = probe(file, SHARED_BASE + i64::from(bit))? {
                return Ok(Some(ErrorKind::Locked {
                    permission: NAMES[bit as usize],
                    shared: false,
                }));
            }
        }
    }
    for bit in 0..4u8 {
        if want.unshared.has(bit) {
            if let Probe::Taken = probe(file, PERM_BASE + i64::from(bit))? {
                return Ok(Some(ErrorKind::Locked {
                    permission: NAMES[bit as usize],
                    shared: true,
                }));
            }
        }
    }
    Ok(None)
}

/// Whether `e` says the filesystem (or kernel) cannot do OFD locks.
fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS)
    )
}

static WARN_UNSUPPORTED: Once = Once::new();

/// How long a conflict is looked at again before it is reported: the
/// waits between attempts (1 + 2 + ... + 128 ms, about a quarter second).
const CONFLICT_RECHECKS_MS: [u64; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// Runs `attempt` until it finds no conflict or the conflict outlasts
/// [`CONFLICT_RECHECKS_MS`], calling `undo` before each wait. A process
/// that starts another program shares every descriptor it has with the
/// child between fork and exec, so an image its owner has just closed
/// stays locked for that moment although nobody uses it; QEMU would report
/// such a conflict at once, and a test harness or a management daemon that
/// spawns programs would then see spurious refusals. A real user holds its
/// lock for longer than a quarter second.
fn confirmed(
    mut attempt: impl FnMut() -> io::Result<Option<ErrorKind>>,
    mut undo: impl FnMut() -> io::Result<()>,
) -> io::Result<Option<ErrorKind>> {
    let mut waits = CONFLICT_RECHECKS_MS.iter();
    loop {
        let found = attempt()?;
        let Some(wait) = waits.next().filter(|_| found.is_some()) else {
            return Ok(found);
        };
        undo()?;
        std::thread::sleep(std::time::Duration::from_millis(*wait));
    }
}

impl FileLock {
    /// Moves the locks of `file` to `want` (as QEMU does: the union is
    /// locked first, then probed, so that two users racing for
    /// conflicting permissions can both fail but never both succeed).
    /// On a conflict nothing changes.
    pub(crate) fn change(
        &mut self,
        file: &File,
        want: LockRequest,
        mode: Locking,
    ) -> Result<(), ErrorKind> {
        if mode == Locking::Off {
            return Ok(());
        }
        let had = self.current.unwrap_or_default();
        if self.current.is_some()
            && want.held.0 & !had.held.0 == 0
            && want.unshared.0 & !had.unshared.0 == 0
        {
            // Only giving permissions back: nothing to probe (a conflict
            // found now was there before, and keeping the larger set
            // would only make it worse for the other process).
            apply_exactly(file, had, want)?;
            self.current = Some(want);
            return Ok(());
        }
        let union = LockRequest {
            held: had.held.union(want.held),
            unshared: had.unshared.union(want.unshared),
        };
        let attempt = || -> io::Result<Option<ErrorKind>> {
            for byte in bytes(union) {
                set(file, libc::F_RDLCK as i16, byte)?;
            }
            conflict(file, want)
        };
        match confirmed(attempt, || apply_exactly(file, union, had)) {
            Ok(None) => {
                apply_exactly(file, union, want)?;
                self.current = Some(want);
                Ok(())
            }
            Ok(Some(conflict)) => {
                apply_exactly(file, union, had)?;
                Err(conflict)
            }
            Err(e) if unsupported(&e) => match mode {
                Locking::On => Err(ErrorKind::LockingUnsupported(e)),
                _ => {
                    WARN_UNSUPPORTED.call_once(|| {
                        tracing::warn!(
                            error = %e,
                            "image locking is not supported here: going on without it \
                             (another process may use the same images unnoticed)"
                        );
                    });
                    self.current = None;
                    Ok(())
                }
            },
            Err(e) => {
                let _ = apply_exactly(file, union, had);
                Err(e.into())
            }
        }
    }

    /// What is locked now.
    pub(crate) fn current(&self) -> Option<LockRequest> {
        self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lock bytes others hold on the file, as seen through `probe`
    /// (an open file description of its own).
    fn locked_bytes(probe: &File) -> Vec<i64> {
        (100..=203)
            .filter(|&b| {
                let mut fl = libc::flock {
                    l_type: libc::F_WRLCK as i16,
                    l_whence: libc::SEEK_SET as i16,
                    l_start: b,
                    l_len: 1,
                    l_pid: 0,
                };
                // SAFETY: F_OFD_GETLK on a descriptor this test owns,
                // writing into `fl`, which it owns.
                let r = unsafe {
                    libc::fcntl(
                        std::os::fd::AsRawFd::as_raw_fd(probe),
                        libc::F_OFD_GETLK,
                        &mut fl,
                    )
                };
                assert_eq!(r, 0);
                fl.l_type != libc::F_UNLCK as i16
            })
            .collect()
    }

    #[test]
    fn giving_permissions_back_succeeds_whatever_others_hold() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("img");
        std::fs::write(&path, [0u8; 512]).unwrap();
        let file = File::options().read(true).write(true).open(&path).unwrap();
        let other = File::open(&path).unwrap();
        let mut lock = FileLock::default();
        lock.change(&file, LockRequest::WRITER, Locking::On)
            .unwrap();
        // Another process takes the write permission regardless (it did
        // not probe): a conflict with what this one does not share.
        set(&other, libc::F_RDLCK as i16, 101).unwrap();
        lock.change(&file, LockRequest::READER, Locking::On)
            .unwrap();
        assert_eq!(lock.current(), Some(LockRequest::READER));
        let probe = File::open(&path).unwrap();
        let held: Vec<i64> = locked_bytes(&probe);
        // Byte 101 is the other's; ours are 100 (read) and 201, 203.
        assert_eq!(held, vec![100, 101, 201, 203]);
        drop(other);
        assert_eq!(locked_bytes(&probe), vec![100, 201, 203]);
    }
}
