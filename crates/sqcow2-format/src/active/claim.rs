//! Allocations in flight: a write that needs a new mapping for a guest
//! cluster claims the cluster under the metadata lock, moves its data with
//! no lock held, and commits the mapping under the lock again (QEMU's
//! in-flight allocations). Anything else that would change the cluster's
//! mapping meanwhile waits for the claim ([`ClaimCell::wait`]), so two
//! writes racing for one cluster allocate once.

use std::sync::{Condvar, Mutex, PoisonError};

/// Signalled when a claim ends (committed or given back).
#[derive(Debug, Default)]
pub(crate) struct ClaimCell {
    ended: Mutex<bool>,
    cond: Condvar,
}

impl ClaimCell {
    /// Blocks until the claim has ended. Call without the metadata lock.
    pub(crate) fn wait(&self) {
        let mut ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        while !*ended {
            ended = self
                .cond
                .wait(ended)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Ends the claim: wakes every waiter.
    pub(crate) fn end(&self) {
        *self.ended.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cond.notify_all();
    }
}
