//! An NBD export of the served chain (`serve --nbd unix:PATH`), beside
//! the vhost-user socket: backup tools (qemu-img, nbdcopy, nbdinfo)
//! read the disk and its block status (allocation, allocation depth,
//! the persistent dirty bitmaps) as from qemu-nbd. One thread per
//! client, at most [`MAX_CLIENTS`]; a client that breaks the protocol is
//! disconnected, alone.

mod contexts;
mod session;
mod wire;

use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tracing::{debug, warn};

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

/// Serves one client whose bytes are `input` (the fuzz target's entry);
/// what the server answered.
#[cfg(feature = "internals")]
pub fn serve_bytes(input: &[u8], shared: &Arc<Shared>, export: &Export) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = session::serve(input, &mut out, shared, export);
    out
}

/// Serves `listener` on a thread of its own.
pub(crate) fn spawn(
    listener: UnixListener,
    shared: Arc<Shared>,
    export: Export,
) -> std::io::Result<()> {
    let clients = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("nbd".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let stream = match stream {
                    Ok(s) => s,
                    Err(e) => {
                        warn!("nbd socket: {e}");
                        continue;
                    }
                };
                if clients.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
                    clients.fetch_sub(1, Ordering::AcqRel);
                    warn!("nbd: more than {MAX_CLIENTS} clients: one refused");
                    continue;
                }
                let (shared, export, clients) = (shared.clone(), export.clone(), clients.clone());
                let spawned =
                    std::thread::Builder::new()
                        .name("nbd-client".into())
                        .spawn(move || {
                            let ended = stream.try_clone().and_then(|reader| {
                                session::serve(stream, reader, &shared, &export)
                            });
                            if let Err(e) = ended {
                                debug!("nbd client ended: {e}");
                            }
                            clients.fetch_sub(1, Ordering::AcqRel);
                        });
                if let Err(e) = spawned {
                    warn!("nbd: cannot start a client thread: {e}");
                }
            }
        })
        .map(drop)
}
