//! A live resize (`resize` on the control socket): the served disk grown
//! inside a pause as short as a merge's switch; requests are checked
//! against the new size at once and the config space reports it; then
//! the frontend is told through its backend channel
//! (`VHOST_USER_BACKEND_CONFIG_CHANGE_MSG`, as qemu-storage-daemon does),
//! where it gave one.

use std::time::Instant;

use sqcow2_format::{Chain, ChainOptions};
use tracing::{info, warn};

use super::merge_job::Resume;
use super::protocol::{FailureKind, ResizeResult};
use super::{fail, Failure, Shared, SNAPSHOT_DRAIN_TIMEOUT};

/// Grows the served disk to `size` bytes. Shrinking a served disk is
/// refused (the guest's data past the end would go under it).
pub(super) fn resize(shared: &Shared, size: u64) -> Result<ResizeResult, Failure> {
    let right = shared.take_right_to_replace()?;
    if !shared.is_active() {
        return Err(fail(
            FailureKind::Inactive,
            "the daemon is inactive: activate it first",
        ));
    }
    // The size the top's header had when the chain was opened: a resize
    // whose reopen failed has grown the file (and the old chain's count)
    // but not what is served, and is done again.
    let old_size = shared.handle.get().top().virtual_size();
    if size < old_size {
        return Err(fail(
            FailureKind::BadRequest,
            format!(
                "shrinking a served disk is refused ({size} < {old_size} bytes): \
                 stop the guest's use of the end first, then resize offline"
            ),
        ));
    }
    if size % 512 != 0 {
        return Err(fail(
            FailureKind::BadRequest,
            "The new size must be a multiple of 512",
        ));
    }
    if size == old_size {
        return Ok(ResizeResult {
            size,
            old_size,
            frontend_told: false,
            pause_ms: 0.0,
        });
    }
    // No build writes the top's index meanwhile; the index covers the old
    // size and is rebuilt after (builds run again before the right goes).
    shared.index_builder.suspend();
    let resumed = Resume(shared);
    // What the guest wrote, written back while it runs.
    if let Err(e) = shared.handle.get().flush_clean() {
        drop(resumed);
        return Err(fail(
            FailureKind::IoError,
            format!("flush before the resize: {e}"),
        ));
    }
    let start = Instant::now();
    let quiet = match right.pause().idle(SNAPSHOT_DRAIN_TIMEOUT) {
        Ok(quiet) => quiet,
        Err(pause) => {
            let right = pause.resume();
            drop(resumed);
            drop(right);
            return Err(fail(
                FailureKind::IoError,
                format!("requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}"),
            ));
        }
    };
    let grown = (|| {
        let old = quiet.current();
        old.flush_clean().map_err(|e| {
            fail(
                FailureKind::IoError,
                format!("flush before the resize: {e}"),
            )
        })?;
        old.handover().grow_top(size).map_err(|e| {
            let kind = match e.kind {
                sqcow2_format::ErrorKind::InvalidArgument(_)
                | sqcow2_format::ErrorKind::Unsupported(_)
                | sqcow2_format::ErrorKind::SizeTooLarge(_) => FailureKind::BadRequest,
                _ => FailureKind::IoError,
            };
            fail(kind, e.to_string())
        })?;
        // The chain reopened at its new size (its open files reused); the
        // top's index is rebuilt in the background.
        let top = old.top().path().to_path_buf();
        let reopen = ChainOptions {
            stale_index_expected: true,
            ..shared.options.clone()
        };
        let chain = Chain::open_reusing(&top, &reopen, &old).map_err(|e| {
            warn!(error = %e, "reopening the chain after a resize failed: it is grown on disk, served at its old size until the next start");
            fail(FailureKind::IoError, format!("reopening the chain: {e}"))
        })?;
        // What the backing file would show through the new range: zeroed
        // before any request sees it, as QEMU does.
        chain.handover().zero_grown(old_size).map_err(|e| {
            // The old chain serves on: the new one writes nothing back
            // (its bitmaps and tables are the old writer's to store).
            chain.handover().release_top();
            fail(FailureKind::IoError, format!("zeroing the new range: {e}"))
        })?;
        old.handover().release_top();
        drop(old);
        let old = quiet.replace(chain);
        // Requests are checked against the new size from here on.
        if let Some(session) = shared.session() {
            session.device().set_capacity(size);
        }
        Ok(old)
    })();
    // The pause ends.
    let right = quiet.resume();
    let pause_ms = start.elapsed().as_secs_f64() * 1e3;
    // Builds run again before the right is given back, on every path.
    let grown = grown.map(drop);
    drop(resumed);
    drop(right);
    grown?;
    // Told outside the pause: the frontend reads the config space while
    // it handles the message.
    let frontend_told = match shared.frontend_channel().map(|c| c.config_changed()) {
        Some(Ok(told)) => told,
        Some(Err(e)) => {
            warn!(error = %e, "telling the frontend of the new size failed");
            false
        }
        None => false,
    };
    info!(size, old_size, pause_ms, frontend_told, "live resize");
    Ok(ResizeResult {
        size,
        old_size,
        frontend_told,
        pause_ms,
    })
}
