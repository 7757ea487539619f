//! A directory opened once, in which files are made, opened, renamed and
//! removed by name: one path component, resolved from the directory's
//! descriptor, never through a symlink. Swapping the directory (or a
//! directory above it) for a symlink after it was opened redirects
//! nothing.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags, ResolveFlags};

/// Device and inode of a file.
pub(crate) type FileId = (u64, u64);

/// What a name in a directory is, read without following a symlink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) id: FileId,
    pub(crate) kind: EntryKind,
    /// Names the file has (hard links).
    pub(crate) links: u64,
}

/// The kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryKind {
    Regular,
    Symlink,
    Directory,
    /// A FIFO, a socket, a device node.
    Special,
}

impl EntryKind {
    fn of(mode: u32) -> EntryKind {
        match FileType::from_raw_mode(mode) {
            FileType::RegularFile => EntryKind::Regular,
            FileType::Symlink => EntryKind::Symlink,
            FileType::Directory => EntryKind::Directory,
            _ => EntryKind::Special,
        }
    }

    /// How an error names it.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            EntryKind::Regular => "a regular file",
            EntryKind::Symlink => "a symlink",
            EntryKind::Directory => "a directory",
            EntryKind::Special => "a FIFO, socket or device",
        }
    }
}

/// A directory opened once.
#[derive(Debug)]
pub(crate) struct Dir {
    fd: OwnedFd,
    /// How it was named (for messages and for paths handed to callers).
    path: PathBuf,
}

/// Flags of every open of a file in a directory: no symlink followed, no
/// wait on a FIFO, no controlling terminal, closed on exec.
fn file_flags() -> OFlags {
    OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC
}

impl Dir {
    /// Opens the directory at `path` (as named: symlinks in `path` itself
    /// are the caller's).
    pub(crate) fn open(path: &Path) -> io::Result<Dir> {
        let at = if path.as_os_str().is_empty() {
            Path::new(".")
        } else {
            path
        };
        let fd = rustix::fs::open(
            at,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Dir {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The directory of the file `file` and the file's name in it.
    pub(crate) fn of_file(file: &Path) -> io::Result<(Dir, OsString)> {
        let name = file_name(file)?;
        let dir = file.parent().unwrap_or(Path::new(""));
        Ok((Dir::open(dir)?, name.to_os_string()))
    }

    /// Opens `dir` inside `root` (a directory opened once, `root_path` its
    /// canonical path): `dir` is resolved to its canonical path, which must
    /// lie under `root_path`, then opened from `root`'s descriptor with no
    /// symlink followed (`openat2`, `RESOLVE_BENEATH`): a directory swapped
    /// for a symlink meanwhile fails the open, never redirects it.
    pub(crate) fn beneath(root: &Dir, root_path: &Path, dir: &Path) -> io::Result<Dir> {
        let real = std::fs::canonicalize(if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        })?;
        let Ok(rel) = real.strip_prefix(root_path) else {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} lies outside {}", real.display(), root_path.display()),
            ));
        };
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        let fd = open_beneath(
            &root.fd,
            rel,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        )?;
        Ok(Dir {
            fd,
            path: dir.to_path_buf(),
        })
    }

    /// The directory as named.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The path of `name` in this directory, as named.
    pub(crate) fn join(&self, name: &OsStr) -> PathBuf {
        self.path.join(name)
    }

    /// What `name` is (`None`: nothing there), its symlink not followed.
    pub(crate) fn entry(&self, name: &OsStr) -> io::Result<Option<Entry>> {
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(Entry {
                id: (st.st_dev, st.st_ino),
                kind: EntryKind::of(st.st_mode),
                links: st.st_nlink,
            })),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Creates `name`, which must not exist (a dangling symlink counts),
    /// for reading and writing.
    pub(crate) fn create(&self, name: &OsStr) -> io::Result<File> {
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            file_flags() | OFlags::RDWR | OFlags::CREATE | OFlags::EXCL,
            Mode::from_raw_mode(0o666),
        )?;
        blocking_regular(fd)
    }

    /// Creates `name`, which must not exist, with `init` done on it first:
    /// the file is made unnamed in the directory (`O_TMPFILE`), `init`
    /// writes it (its header: what tells it is sqcow2's), then it is linked
    /// under `name` (never over anything, never through a symlink), so the
    /// name never holds it without its header, whenever the process dies.
    /// Where the filesystem has no `O_TMPFILE`: created by name, then
    /// written.
    pub(crate) fn create_with(
        &self,
        name: &OsStr,
        init: impl FnOnce(&File) -> io::Result<()>,
    ) -> io::Result<File> {
        match rustix::fs::openat(
            &self.fd,
            ".",
            OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o666),
        ) {
            Ok(fd) => {
                let file = File::from(fd);
                init(&file)?;
                rustix::fs::linkat(
                    rustix::fs::CWD,
                    format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file)),
                    &self.fd,
                    name,
                    AtFlags::SYMLINK_FOLLOW,
                )?;
                Ok(file)
            }
            Err(
                rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::ISDIR | rustix::io::Errno::INVAL,
            ) => {
                let file = self.create(name)?;
                if let Err(e) = init(&file) {
                    if let Ok(st) = rustix::fs::fstat(&file) {
                        let _ = self.remove(name, (st.st_dev, st.st_ino));
                    }
                    return Err(e);
                }
                Ok(file)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Opens the regular file `name` (never through a symlink; a FIFO, a
    /// socket, a device or a directory is refused without being opened).
    pub(crate) fn open_file(&self, name: &OsStr, write: bool) -> io::Result<File> {
        let path = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        open_regular(path, write)
    }

    /// Renames `from` to `to` unless something is at `to` (then fails with
    /// `AlreadyExists`, both left as they are).
    pub(crate) fn rename_new(&self, from: &OsStr, to: &OsStr) -> io::Result<()> {
        match rustix::fs::renameat_with(&self.fd, from, &self.fd, to, RenameFlags::NOREPLACE) {
            Ok(()) => Ok(()),
            // A filesystem without it: a hard link fails the same way on an
            // existing name.
            Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOSYS) => {
                rustix::fs::linkat(&self.fd, from, &self.fd, to, AtFlags::empty())?;
                rustix::fs::unlinkat(&self.fd, from, AtFlags::empty())?;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Renames `from` over `to`, which must still be the file `replaced`
    /// (checked just before: a file put there since is not replaced).
    pub(crate) fn rename_over(&self, from: &OsStr, to: &OsStr, replaced: FileId) -> io::Result<()> {
        match self.entry(to)? {
            Some(e) if e.id == replaced && e.kind == EntryKind::Regular => {
                rustix::fs::renameat(&self.fd, from, &self.fd, to)?;
                Ok(())
            }
            _ => Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "the file changed since it was checked",
            )),
        }
    }

    /// Removes `name` if it is still the file `id` (whatever is there
    /// otherwise is left alone); whether it was removed.
    pub(crate) fn remove(&self, name: &OsStr, id: FileId) -> io::Result<bool> {
        match self.entry(name)? {
            Some(e) if e.id == id && e.kind == EntryKind::Regular => {
                match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
                    Ok(()) => Ok(true),
                    Err(rustix::io::Errno::NOENT) => Ok(false),
                    Err(e) => Err(e.into()),
                }
            }
            _ => Ok(false),
        }
    }

    /// The names in the directory (`.` and `..` left out).
    pub(crate) fn names(&self) -> io::Result<Vec<OsString>> {
        let mut out = Vec::new();
        for entry in rustix::fs::Dir::read_from(&self.fd)? {
            let name = OsStr::from_bytes(entry?.file_name().to_bytes()).to_os_string();
            if name != "." && name != ".." {
                out.push(name);
            }
        }
        Ok(out)
    }

    /// Makes the directory's entries durable.
    pub(crate) fn sync(&self) -> io::Result<()> {
        rustix::fs::fsync(&self.fd)?;
        Ok(())
    }
}

/// The last component of `path` (refused: none, `.`, `..`).
pub(crate) fn file_name(path: &Path) -> io::Result<&OsStr> {
    path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} names no file", path.display()),
        )
    })
}

/// Whether `name` is one plain path component (no `/`, not `.` or `..`,
/// not empty, no NUL).
pub(crate) fn is_plain_name(name: &OsStr) -> bool {
    let b = name.as_bytes();
    !b.is_empty() && b != b"." && b != b".." && !b.contains(&b'/') && !b.contains(&0)
}

/// Opens `rel` from `dir` without leaving it and without following any
/// symlink (`openat2`); on a kernel without `openat2` (before 5.6), with
/// `O_NOFOLLOW` on the last component only.
fn open_beneath(dir: &OwnedFd, rel: &Path, flags: OFlags) -> io::Result<OwnedFd> {
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    match rustix::fs::openat2(dir, rel, flags, Mode::empty(), resolve) {
        Ok(fd) => Ok(fd),
        Err(rustix::io::Errno::NOSYS) => Ok(rustix::fs::openat(
            dir,
            rel,
            flags | OFlags::NOFOLLOW,
            Mode::empty(),
        )?),
        Err(e @ (rustix::io::Errno::XDEV | rustix::io::Errno::LOOP)) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} changed while it was opened (a symlink on the way): {e}",
                rel.display()
            ),
        )),
        Err(e) => Err(e.into()),
    }
}

/// Opens the file `rel` (a path relative to `dir`, all of whose components
/// are real directories) for reading, as [`Dir::open_file`] opens a name.
pub(crate) fn open_file_beneath(dir: &Dir, rel: &Path) -> io::Result<File> {
    let path = open_beneath(&dir.fd, rel, OFlags::PATH | OFlags::CLOEXEC)?;
    open_regular(path, false)
}

/// Opens for reading the file at `path`, a canonical path (its real
/// location, as read back from an earlier open), with no symlink followed
/// on the way (`openat2`, `RESOLVE_NO_SYMLINKS`): a directory swapped
/// for a symlink since fails the open.
pub(crate) fn open_resolved(path: &Path) -> io::Result<File> {
    let resolve = ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    let flags = OFlags::PATH | OFlags::CLOEXEC;
    let fd = match rustix::fs::openat2(rustix::fs::CWD, path, flags, Mode::empty(), resolve) {
        Err(rustix::io::Errno::NOSYS) => return open_image_file(path, false),
        other => other?,
    };
    open_regular(fd, false)
}

/// Opens the file an `O_PATH` descriptor refers to, for reading
/// (`O_NOATIME` where allowed: reading a backing layer is not using it)
/// or reading and writing, if it is a regular file. The `O_PATH` open
/// touched nothing (a FIFO's or a device's open does not run), and the
/// file is opened through `/proc/self/fd` (the same file: no name is
/// resolved again), so anything but a regular file is never opened, even
/// if its name is swapped meanwhile.
pub(crate) fn open_regular(path: OwnedFd, write: bool) -> io::Result<File> {
    let st = rustix::fs::fstat(&path)?;
    let kind = EntryKind::of(st.st_mode);
    if kind == EntryKind::Symlink {
        return Err(rustix::io::Errno::LOOP.into());
    }
    if kind != EntryKind::Regular {
        return Err(not_regular(kind));
    }
    open_through(&path, write)
}

/// Opens the file of the `O_PATH` descriptor `path` through
/// `/proc/self/fd`, checked to be the same file.
fn open_through(path: &OwnedFd, write: bool) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    let link = format!("/proc/self/fd/{}", path.as_raw_fd());
    let base = OFlags::NOCTTY | OFlags::CLOEXEC;
    let fd = if write {
        rustix::fs::open(&link, base | OFlags::RDWR, Mode::empty())?
    } else {
        match rustix::fs::open(
            &link,
            base | OFlags::RDONLY | OFlags::NOATIME,
            Mode::empty(),
        ) {
            Err(rustix::io::Errno::PERM) => {
                rustix::fs::open(&link, base | OFlags::RDONLY, Mode::empty())?
            }
            other => other?,
        }
    };
    let (a, b) = (rustix::fs::fstat(path)?, rustix::fs::fstat(&fd)?);
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) {
        return Err(io::Error::other("the file changed while it was opened"));
    }
    Ok(File::from(fd))
}

/// Refuses a descriptor that is not a regular file (opened without
/// waiting: `O_NONBLOCK`), then makes its I/O blocking again.
pub(crate) fn blocking_regular(fd: OwnedFd) -> io::Result<File> {
    let st = rustix::fs::fstat(&fd)?;
    let kind = EntryKind::of(st.st_mode);
    if kind != EntryKind::Regular {
        return Err(not_regular(kind));
    }
    let flags = rustix::fs::fcntl_getfl(&fd)?;
    rustix::fs::fcntl_setfl(&fd, flags - OFlags::NONBLOCK)?;
    Ok(File::from(fd))
}

/// The error of a file that is not a regular file.
pub(crate) fn not_regular(kind: EntryKind) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        crate::error::NotRegular(kind.describe()),
    )
}

/// Opens the image file at `path` (as named: symlinks followed), for
/// reading (`O_NOATIME` where allowed) or for reading and writing;
/// anything but a regular file is refused without being opened.
pub(crate) fn open_image_file(path: &Path, write: bool) -> io::Result<File> {
    let fd = rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())?;
    open_regular(fd, write)
}

/// Opens (or creates) the file at `path` to write a whole image into (a
/// conversion's output or a new image, named by the caller: a symlink at
/// the name is followed, as `qemu-img` follows it), not truncated: a
/// regular file, or a block device where `block` allows; anything else
/// is refused without being opened.
pub(crate) fn open_output_file(path: &Path, block: bool) -> io::Result<File> {
    // (A dangling symlink at the name is never created through: after a
    // few rounds it is reported as the name taken.)
    for _ in 0..3 {
        match rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty()) {
            Ok(fd) => {
                let st = rustix::fs::fstat(&fd)?;
                return match FileType::from_raw_mode(st.st_mode) {
                    FileType::RegularFile => open_through(&fd, true),
                    FileType::BlockDevice if block => open_through(&fd, true),
                    _ => Err(not_regular(EntryKind::of(st.st_mode))),
                };
            }
            Err(rustix::io::Errno::NOENT) => {
                match rustix::fs::open(
                    path,
                    OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o666),
                ) {
                    Ok(fd) => return Ok(File::from(fd)),
                    // Made meanwhile: looked at again.
                    Err(rustix::io::Errno::EXIST) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(rustix::io::Errno::EXIST.into())
}

/// Whether the descriptor allows `fd`'s file to be looked at (for tests).
#[cfg(test)]
fn is_blocking(file: &File) -> bool {
    !rustix::fs::fcntl_getfl(file)
        .unwrap()
        .contains(OFlags::NONBLOCK)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path this test owns.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn names_are_created_once_and_never_through_symlinks() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, tmp.path().join("link")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("nowhere"), tmp.path().join("dangling"))
            .unwrap();
        for name in ["victim", "link", "dangling"] {
            assert!(dir.create(OsStr::new(name)).is_err(), "{name}");
        }
        assert!(dir.open_file(OsStr::new("link"), true).is_err());
        assert!(!tmp.path().join("nowhere").exists());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let f = dir.create(OsStr::new("new")).unwrap();
        assert!(is_blocking(&f));
        assert_eq!(
            dir.entry(OsStr::new("link")).unwrap().unwrap().kind,
            EntryKind::Symlink
        );
        assert!(dir.entry(OsStr::new("absent")).unwrap().is_none());
    }

    #[test]
    fn fifos_are_refused_without_waiting() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        fifo(&tmp.path().join("fifo"));
        let e = dir.open_file(OsStr::new("fifo"), false).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(open_image_file(&tmp.path().join("fifo"), false).is_err());
        assert!(open_image_file(&tmp.path().join("fifo"), true).is_err());
        assert!(open_image_file(tmp.path(), false).is_err());
        std::fs::write(tmp.path().join("f"), b"x").unwrap();
        assert!(is_blocking(
            &open_image_file(&tmp.path().join("f"), false).unwrap()
        ));
    }

    #[test]
    fn renames_and_removals_touch_only_the_file_expected() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        let n = |s: &str| OsString::from(s);
        std::fs::write(tmp.path().join("a"), b"a").unwrap();
        std::fs::write(tmp.path().join("b"), b"b").unwrap();
        assert_eq!(
            dir.rename_new(&n("a"), &n("b")).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        let a = dir.entry(&n("a")).unwrap().unwrap().id;
        let b = dir.entry(&n("b")).unwrap().unwrap().id;
        // `b` is not `a`'s identity: not removed, not replaced.
        assert!(!dir.remove(&n("b"), a).unwrap());
        assert!(dir.rename_over(&n("a"), &n("b"), a).is_err());
        assert_eq!(std::fs::read(tmp.path().join("b")).unwrap(), b"b");
        dir.rename_over(&n("a"), &n("b"), b).unwrap();
        assert_eq!(std::fs::read(tmp.path().join("b")).unwrap(), b"a");
        assert!(dir.remove(&n("b"), a).unwrap());
        assert!(dir.entry(&n("b")).unwrap().is_none());
    }

    #[test]
    fn a_directory_beneath_a_root_is_opened_without_symlinks() {
        let tmp = tempfile::tempdir().unwrap();
        let root_path = std::fs::canonicalize(tmp.path()).unwrap().join("root");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(root_path.join("sub")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root_path.join("escape")).unwrap();
        std::os::unix::fs::symlink("sub", root_path.join("inner")).unwrap();
        let root = Dir::open(&root_path).unwrap();
        assert!(Dir::beneath(&root, &root_path, &root_path.join("sub")).is_ok());
        assert!(Dir::beneath(&root, &root_path, &root_path).is_ok());
        // A symlink to a directory inside: resolved first, then opened.
        assert!(Dir::beneath(&root, &root_path, &root_path.join("inner")).is_ok());
        let e = Dir::beneath(&root, &root_path, &root_path.join("escape")).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
        assert!(open_file_beneath(&root, Path::new("sub/../../outside")).is_err());
    }

    #[test]
    fn plain_names() {
        for bad in ["", ".", "..", "a/b", "/x"] {
            assert!(!is_plain_name(OsStr::new(bad)), "{bad:?}");
        }
        assert!(is_plain_name(OsStr::new("disk.qcow2.sqidx")));
    }
}
