//! Unix sockets bound with the permissions asked for from the start: the
//! vhost-user socket and the control socket; the listener of the first
//! placed to die before its connections.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
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

/// The highest descriptor a listener is moved to: a fd table this size
/// costs the kernel 128 KiB.
const LISTENER_FD_CEILING: u32 = 16 * 1024;

/// `listener` moved to a descriptor above any its connections will get,
/// so that a process killed while serving refuses a frontend dialling
/// again rather than accepting it and resetting it.
///
/// A dying process's descriptors are released highest first (Linux >=
/// 5.11 runs the deferred releases last in, first out): a connection
/// accepted into a lower descriptor than its listener hangs up while the
/// listener still queues new connections, which the kernel then resets.
/// Cloud Hypervisor v53 reconnects the moment its socket hangs up and
/// gives the disk up for good when that handshake fails. Where the move
/// fails (a descriptor limit this low), the listener stays where it is.
pub(crate) fn above_connections(listener: UnixListener) -> UnixListener {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let ceiling = u64::from(LISTENER_FD_CEILING).min(limit.saturating_sub(1));
    let Ok(ceiling) = i32::try_from(ceiling) else {
        return listener;
    };
    match rustix::io::fcntl_dupfd_cloexec(&listener, ceiling) {
        Ok(moved) => UnixListener::from(moved),
        Err(e) => {
            tracing::debug!("listener left at descriptor {}: {e}", listener.as_raw_fd());
            listener
        }
    }
}
