//! Unix sockets bound with the permissions asked for from the start: the
//! vhost-user socket and the control socket.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Runs `f` with the file-creation mask that gives new files `mode`, so a
/// socket is never more open than asked, not even briefly.
pub(crate) fn with_umask<T>(mode: u32, f: impl FnOnce() -> T) -> T {
    // SAFETY: umask only changes this process's file-creation mask; it is
    // restored right after `f`.
    let old = unsafe { libc::umask(!mode & 0o777) };
    let out = f();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    out
}

/// Gives the socket just bound at `path` `mode` (a default ACL of the
/// directory may have widened what the umask gave), never following a
/// symlink put at its name meanwhile: the name opened without following
/// (`O_PATH|O_NOFOLLOW`), checked to be a socket, changed through that
/// descriptor.
pub(crate) fn chmod_socket(path: &Path, mode: u32) -> io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(
        path,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let st = rustix::fs::fstat(&fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(io::Error::other(
            "not the socket bound: refusing to change it",
        ));
    }
    rustix::fs::chmod(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        Mode::from_raw_mode(mode),
    )?;
    Ok(())
}
