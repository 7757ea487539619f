//! Unix sockets bound with the permissions asked for from the start: the
//! vhost-user sockets, the control socket, NBD sockets; the listener of a
//! vhost-user socket placed to die before its connections; the files the
//! daemon made, removed when it ends.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use vhost::vhost_user::Listener;

use crate::daemon::error::{io_err, ServeError};

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

/// Removes a stale socket at `path`; refuses anything else there.
fn claim_socket_path(path: &Path) -> Result<(), ServeError> {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    let taken = |reason: &str| ServeError::Socket {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    if !meta.file_type().is_socket() {
        return Err(taken("exists and is not a socket"));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(taken("another server is listening on it"));
    }
    fs::remove_file(path).map_err(io_err(format!("removing stale socket {}", path.display())))
}

/// Binds the socket with `mode` from the start.
pub(crate) fn bind_vhost(path: &Path, mode: u32) -> Result<Listener, ServeError> {
    claim_socket_path(path)?;
    let listener =
        with_umask(mode, || std::os::unix::net::UnixListener::bind(path)).map_err(|e| {
            ServeError::Socket {
                path: path.to_owned(),
                reason: e.to_string(),
            }
        })?;
    let listener = Listener::from(above_connections(listener));
    chmod_socket(path, mode).map_err(io_err(format!("chmod {}", path.display())))?;
    // Accepted only when epoll says a connection waits; never blocks.
    listener
        .set_nonblocking(true)
        .map_err(|e| ServeError::Daemon(e.to_string()))?;
    Ok(listener)
}

/// Files a server made (its sockets, its pidfile), by path and identity:
/// removed when it ends, however it ends (a start that fails half-way
/// too), each only if its path still holds the file made.
#[derive(Debug, Default)]
pub(crate) struct MadeFiles(Vec<(std::path::PathBuf, Option<(u64, u64)>)>);

/// Device and inode of what `path` names (a symlink not followed).
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl MadeFiles {
    pub(crate) fn push(&mut self, path: &Path) {
        self.0.push((path.to_path_buf(), identity(path)));
    }
}

impl Drop for MadeFiles {
    fn drop(&mut self) {
        for (path, id) in &self.0 {
            if id.is_some() && identity(path) == *id {
                let _ = fs::remove_file(path);
            }
        }
    }
}

/// Binds a Unix socket (the control socket, an NBD socket) with `mode`,
/// like the vhost-user socket: a stale socket there is replaced, anything
/// else refused.
pub(crate) fn bind_unix(path: &Path, mode: u32) -> std::io::Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "a file that is not a socket is there (never removed)",
            ));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "another server listens on it",
            ));
        }
        std::fs::remove_file(path)?;
    }
    with_umask(mode, || UnixListener::bind(path))
}
