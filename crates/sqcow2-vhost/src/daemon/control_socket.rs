//! The control socket (`sqcow2 serve --control PATH`): one JSON object per
//! line each way, each connection on a thread of its own (a bounded
//! number), each line answered by the daemon's [`Exports`].

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tracing::warn;

use crate::daemon::control::protocol::{Failure, FailureKind, Reply};
use crate::daemon::exports::Exports;

/// Longest request line accepted.
const MAX_LINE: usize = 64 * 1024;

fn fail(kind: FailureKind, message: impl Into<String>) -> Failure {
    Failure::new(kind, message)
}

/// Serves the control socket at `listener` until the process ends.
pub(crate) fn spawn(listener: UnixListener, exports: Arc<Exports>) -> std::io::Result<()> {
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => {
                        // One thread per connection, so a bounded number.
                        let Some(slot) = ConnectionSlot::take(&open) else {
                            refuse(stream);
                            continue;
                        };
                        let exports = exports.clone();
                        let _ = std::thread::Builder::new()
                            .name("control-conn".into())
                            .spawn(move || {
                                let _slot = slot;
                                connection(stream, &exports)
                            });
                    }
                    Err(e) => warn!("control socket: {e}"),
                }
            }
        })
        .map(|_| ())
}

/// Control connections open at most at a time (each has a thread).
const MAX_CONNECTIONS: usize = 64;

/// One of the [`MAX_CONNECTIONS`], given back when dropped.
struct ConnectionSlot(Arc<std::sync::atomic::AtomicUsize>);

impl ConnectionSlot {
    fn take(open: &Arc<std::sync::atomic::AtomicUsize>) -> Option<ConnectionSlot> {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        open.fetch_update(AcqRel, Acquire, |n| (n < MAX_CONNECTIONS).then_some(n + 1))
            .ok()
            .map(|_| ConnectionSlot(open.clone()))
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Tells a connection beyond [`MAX_CONNECTIONS`] why it is closed.
fn refuse(mut stream: UnixStream) {
    let reply = Reply::failure(
        Value::Null,
        fail(
            FailureKind::Busy,
            format!("too many control connections (at most {MAX_CONNECTIONS})"),
        ),
    );
    if let Ok(mut text) = serde_json::to_string(&reply) {
        text.push('\n');
        let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = stream.write_all(text.as_bytes());
    }
}

fn connection(stream: UnixStream, exports: &Exports) {
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut bytes = Vec::new();
    loop {
        bytes.clear();
        match (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut bytes)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let too_long = bytes.len() > MAX_LINE;
        let reply = if too_long {
            // The rest of the line is read and dropped first (a bounded
            // amount): closing with it unread would reset the connection
            // and lose the reply on the client's side.
            skip_line(&mut reader);
            Reply::failure(Value::Null, fail(FailureKind::BadRequest, "line too long"))
        } else {
            match std::str::from_utf8(&bytes) {
                Ok(line) => exports.handle_line(line.trim()),
                // Every line gets a reply, this one too.
                Err(_) => Reply::failure(
                    Value::Null,
                    fail(FailureKind::BadRequest, "the line is not UTF-8"),
                ),
            }
        };
        let mut text = serde_json::to_string(&reply).unwrap_or_else(|e| {
            format!("{{\"id\":null,\"ok\":false,\"error\":{{\"kind\":\"io-error\",\"message\":\"{e}\"}}}}")
        });
        text.push('\n');
        if out.write_all(text.as_bytes()).is_err() || too_long {
            return;
        }
    }
}

/// Reads and drops what is left of an overlong line: up to its newline,
/// at most [`MAX_SKIPPED`] bytes.
fn skip_line(reader: &mut BufReader<UnixStream>) {
    let mut skipped = 0;
    while skipped < MAX_SKIPPED {
        let Ok(buf) = reader.fill_buf() else { return };
        if buf.is_empty() {
            return;
        }
        if let Some(end) = buf.iter().position(|&b| b == b'\n') {
            reader.consume(end + 1);
            return;
        }
        let n = buf.len();
        reader.consume(n);
        skipped += n;
    }
}

/// How much of an overlong line is read and dropped before the reply.
const MAX_SKIPPED: usize = 16 << 20;
