//! Fetching ahead for chains with layers in an object store: a read
//! spanning several runs starts all their fetches at once (they wait on a
//! network, not on each other), and a guest that reads in order gets the
//! runs after it fetched ahead, in a window that doubles (up to a bound)
//! while it goes on in order. Layers that are files get no hint: the
//! kernel's readahead serves them.

use std::sync::{Mutex, PoisonError};

use crate::types::GuestOffset;
use crate::ExtentKind;

use super::Chain;

/// The first window past a read in order.
const MIN_WINDOW: u64 = 1 << 20;
/// The largest.
const MAX_WINDOW: u64 = 64 << 20;

/// A reader's progress through the guest disk.
#[derive(Debug, Default)]
pub(crate) struct Readahead {
    state: Mutex<Sequence>,
}

#[derive(Debug, Default)]
struct Sequence {
    /// The furthest end of a read in order.
    next: u64,
    window: u64,
    /// Hints were given up to here.
    hinted_to: u64,
}

impl Readahead {
    /// The guest range to hint for a read of `[offset, offset + len)`.
    fn range_for(&self, offset: u64, len: u64) -> (u64, u64) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let end = offset.saturating_add(len);
        // In order: at the furthest end so far, or a little behind it
        // (reads in flight together complete out of order).
        let in_order = offset <= s.next.saturating_add(MIN_WINDOW)
            && offset.saturating_add(MAX_WINDOW) >= s.next;
        if in_order && s.next > 0 {
            s.window = (s.window * 2).clamp(MIN_WINDOW, MAX_WINDOW);
            s.next = s.next.max(end);
        } else {
            s.window = 0;
            s.next = end;
            s.hinted_to = 0;
        }
        let from = offset.max(s.hinted_to);
        let to = s.next.saturating_add(s.window);
        s.hinted_to = s.hinted_to.max(to);
        (from, to)
    }
}

impl Chain {
    /// Starts the fetches of `[offset, offset + len)` and of the window
    /// ahead of it, on the layers that fetch from afar; a hint (errors
    /// leave the read to find them).
    pub(super) fn fetch_ahead(&self, readahead: &Readahead, offset: u64, len: u64) {
        let size = self.virtual_size();
        let (from, to) = readahead.range_for(offset, len);
        let to = to.min(size);
        // One run of a single cluster, nothing ahead: the read fetches it
        // itself (a hint would only add a thread hop).
        if from >= to || (to - from <= self.cluster_size() && to <= offset + len) {
            return;
        }
        let mut pending: Option<(usize, u64, u64)> = None;
        let flush = |p: Option<(usize, u64, u64)>| {
            if let Some((layer, host, n)) = p {
                self.storages[layer].prefetch(host, n);
            }
        };
        let mut pos = from;
        while pos < to {
            let Ok(e) = self.resolve(GuestOffset(pos), to - pos, false) else {
                break;
            };
            if let ExtentKind::Data { host } = e.kind {
                let layer = e.layer.0;
                if self.storages[layer].fetches_remotely() {
                    pending = match pending {
                        Some((l, h, n)) if l == layer && h + n == host.0 => Some((l, h, n + e.len)),
                        other => {
                            flush(other);
                            Some((layer, host.0, e.len))
                        }
                    };
                }
            }
            pos += e.len.max(1);
        }
        flush(pending);
    }
}
