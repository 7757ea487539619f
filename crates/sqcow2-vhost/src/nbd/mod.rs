//! An NBD export of the served chain (`serve --nbd unix:PATH`), beside
//! the vhost-user socket: backup tools (qemu-img, nbdcopy, nbdinfo)
//! read the disk and its block status (allocation, allocation depth,
//! the persistent dirty bitmaps) as from qemu-nbd. One thread per
//! client reading its requests and a few serving them, at most
//! `MAX_CLIENTS`; a client that breaks the protocol is disconnected,
//! alone.

mod contexts;
mod session;
mod wire;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tracing::{debug, info, warn};

use crate::daemon::control::Shared;

/// Clients served at most at a time.
const MAX_CLIENTS: usize = 16;

/// What the export offers.
#[derive(Debug, Clone)]
pub struct Export {
    /// Its name (qemu-nbd's default: empty).
    pub name: String,
    /// Clients may write, trim and zero.
    pub writable: bool,
}

/// Where the export listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdAddress {
    /// A Unix socket.
    Unix(PathBuf),
    /// A TCP address (`HOST:PORT`; port 0 picks one, logged).
    Tcp(String),
}

impl NbdAddress {
    /// `unix:PATH` or `tcp:HOST:PORT`.
    pub fn parse(spec: &str) -> Option<NbdAddress> {
        if let Some(path) = spec.strip_prefix("unix:") {
            return (!path.is_empty()).then(|| NbdAddress::Unix(path.into()));
        }
        spec.strip_prefix("tcp:")
            .filter(|a| !a.is_empty())
            .map(|a| NbdAddress::Tcp(a.to_string()))
    }
}

/// A bound NBD listener.
#[derive(Debug)]
pub(crate) enum NbdListener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// Serves one client whose bytes are `input` (the fuzz target's entry);
/// what the server answered.
#[cfg(feature = "internals")]
pub fn serve_bytes(input: &[u8], shared: &Arc<Shared>, export: &Export) -> Vec<u8> {
    let mut out = Vec::new();
    // One worker: replies in request order, as the input's.
    let _ = session::serve(input, &mut out, shared, export, 1);
    out
}

/// Serves `listener` on a thread of its own.
pub(crate) fn spawn(
    listener: NbdListener,
    shared: Arc<Shared>,
    export: Export,
) -> std::io::Result<()> {
    let _ = shared.frozen.live_name.set(export.name.clone());
    match listener {
        NbdListener::Unix(l) => {
            info!(socket = ?l.local_addr().ok(), "nbd export listening");
            spawn_on(move || l.accept().map(|(s, _)| s), shared, export)
        }
        NbdListener::Tcp(l) => {
            info!(address = %l.local_addr()?, "nbd export listening");
            spawn_on(
                move || {
                    let (s, _) = l.accept()?;
                    // Replies are written whole: no delay for the next.
                    s.set_nodelay(true)?;
                    Ok(s)
                },
                shared,
                export,
            )
        }
    }
}

/// A connected client's two directions.
trait Duplex: Send + 'static {
    fn split(self) -> std::io::Result<(Box<dyn Read + Send>, Box<dyn Write + Send>)>;
}

impl Duplex for std::os::unix::net::UnixStream {
    fn split(self) -> std::io::Result<(Box<dyn Read + Send>, Box<dyn Write + Send>)> {
        Ok((Box::new(self.try_clone()?), Box::new(self)))
    }
}

impl Duplex for std::net::TcpStream {
    fn split(self) -> std::io::Result<(Box<dyn Read + Send>, Box<dyn Write + Send>)> {
        Ok((Box::new(self.try_clone()?), Box::new(self)))
    }
}

/// Accepts clients with `accept` on a thread; one thread per client, at
/// most [`MAX_CLIENTS`].
fn spawn_on<S: Duplex>(
    mut accept: impl FnMut() -> std::io::Result<S> + Send + 'static,
    shared: Arc<Shared>,
    export: Export,
) -> std::io::Result<()> {
    let clients = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("nbd".into())
        .spawn(move || loop {
            let stream = match accept() {
                Ok(s) => s,
                Err(e) => {
                    warn!("nbd socket: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
            };
            if clients.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
                clients.fetch_sub(1, Ordering::AcqRel);
                warn!("nbd: more than {MAX_CLIENTS} clients: one refused");
                continue;
            }
            let (shared, export, clients) = (shared.clone(), export.clone(), clients.clone());
            let spawned = std::thread::Builder::new()
                .name("nbd-client".into())
                .spawn(move || {
                    let ended = stream.split().and_then(|(reader, writer)| {
                        session::serve(reader, writer, &shared, &export, session::WORKERS)
                    });
                    if let Err(e) = ended {
                        debug!("nbd client ended: {e}");
                    }
                    clients.fetch_sub(1, Ordering::AcqRel);
                });
            if let Err(e) = spawned {
                warn!("nbd: cannot start a client thread: {e}");
            }
        })
        .map(drop)
}
