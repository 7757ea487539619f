//! A fence between reads in flight and flushes.
//!
//! Reads submitted to io_uring run without the chain's read gate. A flush
//! may release clusters freed by earlier discards for reuse, so it first
//! waits for every read started before it: [`ReadFence::wait_for_earlier`].

use std::collections::BTreeSet;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Tickets of the reads in flight, in start order.
#[derive(Debug, Default)]
pub struct ReadFence {
    state: Mutex<FenceState>,
    finished: Condvar,
}

#[derive(Debug, Default)]
struct FenceState {
    next: u64,
    in_flight: BTreeSet<u64>,
}

impl ReadFence {
    fn lock(&self) -> MutexGuard<'_, FenceState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a read; returns its ticket.
    pub fn begin(&self) -> u64 {
        let mut s = self.lock();
        let ticket = s.next;
        s.next += 1;
        s.in_flight.insert(ticket);
        ticket
    }

    /// Marks the read with `ticket` finished.
    pub fn end(&self, ticket: u64) {
        let mut s = self.lock();
        s.in_flight.remove(&ticket);
        drop(s);
        self.finished.notify_all();
    }

    /// Blocks until every read begun before this call has ended. The
    /// caller must not hold reads of its own that only it can finish.
    pub fn wait_for_earlier(&self) {
        let limit = self.lock().next;
        self.wait_below(limit);
    }

    /// Blocks until no read with a ticket below `limit` is in flight.
    fn wait_below(&self, limit: u64) {
        let mut s = self.lock();
        while s.in_flight.first().is_some_and(|&t| t < limit) {
            s = self
                .finished
                .wait(s)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Reads in flight.
    pub fn in_flight(&self) -> usize {
        self.lock().in_flight.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn waits_only_for_earlier_reads() {
        let fence = Arc::new(ReadFence::default());
        let early = fence.begin();
        let limit = fence.lock().next;
        let late = fence.begin();
        let f = fence.clone();
        let waiter = std::thread::spawn(move || f.wait_below(limit));
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            !waiter.is_finished(),
            "finished with an earlier read in flight"
        );
        fence.end(early);
        waiter.join().unwrap();
        fence.end(late);
        assert_eq!(fence.in_flight(), 0);
    }
}
