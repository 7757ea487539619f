//! Ranges of guest bytes held against each other, shared or exclusive,
//! granted in the order asked: a live commit's mirror copies and a
//! drain's copier hold them exclusively, a drain's guest changes shared.

use std::sync::{Condvar, Mutex, PoisonError};

/// Ranges of guest bytes held, shared (guest changes) or exclusive (the
/// copier), granted in the order asked where they conflict: a copier
/// waiting for a range is not starved by the guest's changes of it.
#[derive(Debug, Default)]
pub(crate) struct RangeHolds {
    state: Mutex<HoldQueue>,
    freed: Condvar,
}

#[derive(Debug, Default)]
struct HoldQueue {
    next: u64,
    entries: Vec<HoldEntry>,
    /// Callers waiting for a turn: a release wakes them only if any (a
    /// condition variable's wake is a system call even with no waiter,
    /// and every guest write of a drain releases a hold).
    waiting: usize,
}

#[derive(Debug, Clone, Copy)]
struct HoldEntry {
    turn: u64,
    start: u64,
    end: u64,
    exclusive: bool,
}

impl HoldQueue {
    /// Queues a hold of `[start, end)`; its turn.
    fn push(&mut self, start: u64, end: u64, exclusive: bool) -> u64 {
        let turn = self.next;
        self.next += 1;
        self.entries.push(HoldEntry {
            turn,
            start,
            end,
            exclusive,
        });
        turn
    }
}

impl HoldEntry {
    fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        self.start < end && start < self.end && (self.exclusive || exclusive)
    }
}

impl RangeHolds {
    fn queue(&self) -> std::sync::MutexGuard<'_, HoldQueue> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until no range asked before conflicts, then holds
    /// `[start, end)`; returns its turn.
    pub(crate) fn lock(&self, start: u64, end: u64, exclusive: bool) -> u64 {
        let mut q = self.queue();
        let turn = q.push(start, end, exclusive);
        while q
            .entries
            .iter()
            .any(|e| e.turn < turn && e.conflicts(start, end, exclusive))
        {
            q.waiting += 1;
            q = self.freed.wait(q).unwrap_or_else(PoisonError::into_inner);
            q.waiting -= 1;
        }
        turn
    }

    /// A shared hold of `[start, end)` if no range held or asked
    /// conflicts now (never waits).
    pub(crate) fn try_share(&self, start: u64, end: u64) -> Option<u64> {
        let mut q = self.queue();
        if q.entries.iter().any(|e| e.conflicts(start, end, false)) {
            return None;
        }
        Some(q.push(start, end, false))
    }

    pub(crate) fn release(&self, turn: u64) {
        let mut q = self.queue();
        if let Some(i) = q.entries.iter().position(|e| e.turn == turn) {
            q.entries.swap_remove(i);
        }
        let wake = q.waiting > 0;
        drop(q);
        if wake {
            self.freed.notify_all();
        }
    }
}

/// An exclusive hold, released when dropped.
#[must_use = "the range is released when the guard drops"]
pub(crate) struct RangeGuard<'a> {
    holds: &'a RangeHolds,
    turn: u64,
}

impl RangeHolds {
    /// Waits until every overlapping range asked before is released, then
    /// holds `[start, end)` alone.
    pub(crate) fn lock_exclusive(&self, start: u64, end: u64) -> RangeGuard<'_> {
        RangeGuard {
            holds: self,
            turn: self.lock(start, end, true),
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.holds.release(self.turn);
    }
}
