//! Transfers in flight against frees.
//!
//! A cluster that a mapping change releases (discard, copy-on-write of a
//! shared cluster, a moved table) is only queued for release; a flush makes
//! it reusable. A transfer (a read of a data cluster, an in-place write)
//! that looked the mapping up before the release may still be running
//! then, outside every lock. So every transfer holds a [`TransferTicket`],
//! taken before it looks a mapping up, and a flush cuts the queue of
//! releases and waits, before applying them, until every ticket older than
//! the cut has ended ([`TransferFence::wait_below`]).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

/// Tickets of the transfers in flight, in the order they were taken.
#[derive(Debug, Default)]
pub(crate) struct TransferFence {
    state: Mutex<FenceState>,
    finished: Condvar,
}

#[derive(Debug, Default)]
struct FenceState {
    /// Ticket number of `live[0]`.
    first: u64,
    /// Whether each ticket from `first` on is still in flight; the front
    /// is always in flight (ended tickets there are popped).
    live: VecDeque<bool>,
    /// Threads waiting in [`TransferFence::wait_below`].
    waiters: usize,
}

impl FenceState {
    fn next(&self) -> u64 {
        self.first + self.live.len() as u64
    }
}

/// A point in the ticket order: the tickets taken before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FenceCut(u64);

/// Held by a transfer from before it looks a mapping up until its data has
/// moved: a flush does not make clusters reusable while a ticket older than
/// the release is held.
#[must_use = "a transfer must hold its ticket until its data has moved"]
#[derive(Debug)]
pub struct TransferTicket {
    fence: Arc<TransferFence>,
    number: u64,
}

impl TransferTicket {
    /// Whether this ticket was issued by `fence`.
    pub(crate) fn is_from(&self, fence: &Arc<TransferFence>) -> bool {
        Arc::ptr_eq(&self.fence, fence)
    }
}

impl Drop for TransferTicket {
    fn drop(&mut self) {
        self.fence.end(self.number);
    }
}

impl TransferFence {
    fn lock(&self) -> MutexGuard<'_, FenceState> {
        // The state is a counter and a queue of flags, updated in single
        // steps: a panicking holder cannot leave it half-changed.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A ticket for a transfer about to look a mapping up.
    pub(crate) fn begin(self: &Arc<Self>) -> TransferTicket {
        let mut s = self.lock();
        let number = s.next();
        s.live.push_back(true);
        TransferTicket {
            fence: self.clone(),
            number,
        }
    }

    fn end(&self, number: u64) {
        let mut s = self.lock();
        let Some(i) = number.checked_sub(s.first) else {
            return;
        };
        if let Some(flag) = s.live.get_mut(i as usize) {
            *flag = false;
        }
        let mut advanced = false;
        while s.live.front() == Some(&false) {
            s.live.pop_front();
            s.first += 1;
            advanced = true;
        }
        let wake = advanced && s.waiters > 0;
        drop(s);
        if wake {
            self.finished.notify_all();
        }
    }

    /// The tickets taken so far.
    pub(crate) fn cut(&self) -> FenceCut {
        FenceCut(self.lock().next())
    }

    /// Blocks until no ticket taken before `cut` is held. The caller must
    /// hold no ticket itself, nor anything a ticket holder waits for.
    pub(crate) fn wait_below(&self, cut: FenceCut) {
        let mut s = self.lock();
        s.waiters += 1;
        while !s.live.is_empty() && s.first < cut.0 {
            s = self
                .finished
                .wait(s)
                .unwrap_or_else(PoisonError::into_inner);
        }
        s.waiters -= 1;
    }

    /// Tickets held now.
    pub(crate) fn in_flight(&self) -> usize {
        self.lock().live.iter().filter(|l| **l).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_only_for_tickets_before_the_cut() {
        let fence = Arc::new(TransferFence::default());
        let early = fence.begin();
        let cut = fence.cut();
        let late = fence.begin();
        let f = fence.clone();
        let waiter = std::thread::spawn(move || f.wait_below(cut));
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            !waiter.is_finished(),
            "returned with an earlier ticket held"
        );
        drop(early);
        waiter.join().unwrap();
        assert_eq!(fence.in_flight(), 1);
        drop(late);
        assert_eq!(fence.in_flight(), 0);
    }

    #[test]
    fn tickets_ending_out_of_order_release_the_waiter_once_all_earlier_end() {
        let fence = Arc::new(TransferFence::default());
        let a = fence.begin();
        let b = fence.begin();
        let c = fence.begin();
        let cut = fence.cut();
        drop(b);
        drop(c);
        assert_eq!(fence.in_flight(), 1);
        let f = fence.clone();
        let waiter = std::thread::spawn(move || f.wait_below(cut));
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!waiter.is_finished());
        drop(a);
        waiter.join().unwrap();
        // Nothing held: a cut returns at once.
        fence.wait_below(fence.cut());
    }
}
