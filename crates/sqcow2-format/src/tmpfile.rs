//! Files made under a temporary name and published under their own (a
//! new top, an index): never written through a symlink, and a new top
//! never renamed over a file that appeared meanwhile.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Makes way for a temporary file at `tmp`: a regular file there is the
/// leftover of an interrupted attempt and goes; anything else (a symlink,
/// dangling or not, a directory) is refused.
pub(crate) fn clear_leftover(tmp: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(tmp) {
        Ok(meta) if meta.file_type().is_file() => std::fs::remove_file(tmp),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a regular file", tmp.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// A new, empty temporary file at `tmp` (a leftover cleared first),
/// created exclusively: nothing another program put there meanwhile is
/// opened, a symlink included.
pub(crate) fn create_temporary(tmp: &Path) -> io::Result<File> {
    clear_leftover(tmp)?;
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(tmp)
}

/// A temporary file removed when this is dropped, unless kept (renamed to
/// its own name).
#[must_use = "the file is removed when this is dropped"]
pub(crate) struct RemovedUnlessKept<'a>(Option<&'a Path>);

impl<'a> RemovedUnlessKept<'a> {
    pub(crate) fn new(path: &'a Path) -> Self {
        RemovedUnlessKept(Some(path))
    }

    /// The file stays (it was published).
    pub(crate) fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for RemovedUnlessKept<'_> {
    fn drop(&mut self) {
        if let Some(path) = self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Refuses `path` if anything is there, a dangling symlink included.
pub(crate) fn refuse_existing(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "refusing to overwrite an existing file",
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Renames `from` to `to` unless something is at `to` (then fails with
/// `AlreadyExists`, both left as they are).
pub(crate) fn rename_no_replace(from: &Path, to: &Path) -> io::Result<()> {
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
    };
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: both are NUL-terminated strings this function owns, alive
    // for the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        // A file system without it: a hard link fails the same way on an
        // existing name.
        Some(libc::EINVAL) | Some(libc::ENOSYS) => {
            std::fs::hard_link(from, to)?;
            std::fs::remove_file(from)
        }
        _ => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporaries_never_follow_symlinks_nor_replace_files() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let tmp = dir.path().join("x.tmp");
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        assert!(create_temporary(&tmp).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        std::fs::remove_file(&tmp).unwrap();
        // A leftover regular file is replaced.
        std::fs::write(&tmp, b"partial").unwrap();
        drop(create_temporary(&tmp).unwrap());
        assert_eq!(std::fs::read(&tmp).unwrap(), b"");
        // A dangling symlink is something.
        let dangling = dir.path().join("new");
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
        assert!(refuse_existing(&dangling).is_err());
        assert!(rename_no_replace(&tmp, &dangling).is_err());
        assert!(tmp.exists());
        let free = dir.path().join("free");
        rename_no_replace(&tmp, &free).unwrap();
        assert!(free.exists() && !tmp.exists());
    }
}
