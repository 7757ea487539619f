//! Transfers in flight against frees.
//!
//! A cluster that a mapping change releases (discard, copy-on-write of a
//! shared cluster, a moved table) is only queued for release; a flush makes
//! it reusable. A transfer (a read of a data cluster, an in-place write)
//! that looked the mapping up before the release may still be running
//! then, outside every lock. So every transfer holds a [`TransferTicket`],
//! taken before it looks a mapping up, and a flush cuts the queue of
//! releases at a [`FenceCut`]: the releases become allocatable once every
//! ticket taken before the cut has ended ([`TransferFence::passed`]), at
//! that flush or a later one. Nothing ever waits for a ticket, so no
//! ticket holder can deadlock with a flush.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Tickets of the transfers in flight.
#[derive(Debug, Default)]
pub(crate) struct TransferFence {
    state: Mutex<FenceState>,
}

#[derive(Debug, Default)]
struct FenceState {
    next: u64,
    /// Tickets held now (as many as transfers in flight, whatever the
    /// ticket numbers: memory stays bounded behind a long-held ticket),
    /// in ascending order (numbers are handed out in order, so a new one
    /// goes to the back; most tickets end near the front).
    held: VecDeque<u64>,
}

/// A point in the ticket order: the tickets taken before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct FenceCut(u64);

/// Held by a transfer from before it looks a mapping up until its data has
/// moved: clusters released after that lookup are not handed out again
/// while the ticket is held.
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
        let mut s = self.fence.lock();
        if let Ok(i) = s.held.binary_search(&self.number) {
            s.held.remove(i);
        }
    }
}

impl TransferFence {
    fn lock(&self) -> MutexGuard<'_, FenceState> {
        // Each change is one insertion or removal: a panicking holder
        // cannot leave the state half-changed.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A ticket for a transfer about to look a mapping up.
    pub(crate) fn begin(self: &Arc<Self>) -> TransferTicket {
        let mut s = self.lock();
        let number = s.next;
        s.next += 1;
        s.held.push_back(number);
        TransferTicket {
            fence: self.clone(),
            number,
        }
    }

    /// The tickets taken so far.
    pub(crate) fn cut(&self) -> FenceCut {
        FenceCut(self.lock().next)
    }

    /// Whether every ticket taken before `cut` has ended.
    pub(crate) fn passed(&self, cut: FenceCut) -> bool {
        self.lock()
            .held
            .front()
            .is_none_or(|&oldest| oldest >= cut.0)
    }

    /// Tickets held now.
    pub(crate) fn in_flight(&self) -> usize {
        self.lock().held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_is_passed_once_every_earlier_ticket_has_ended() {
        let fence = Arc::new(TransferFence::default());
        let early = fence.begin();
        let also_early = fence.begin();
        let cut = fence.cut();
        let late = fence.begin();
        assert!(!fence.passed(cut));
        drop(also_early);
        assert!(!fence.passed(cut), "passed with an earlier ticket held");
        drop(early);
        assert!(fence.passed(cut), "a later ticket held back the cut");
        assert!(!fence.passed(fence.cut()) || fence.in_flight() == 0);
        drop(late);
        assert_eq!(fence.in_flight(), 0);
        assert!(fence.passed(fence.cut()));
    }
}
