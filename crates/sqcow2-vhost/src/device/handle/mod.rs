//! The chain being served, the gate its requests pass, and the one way
//! to put another chain in its place. Everything else takes the current
//! chain per request (engine jobs when they begin).
//!
//! Replacing the chain (a live snapshot, a merge's switch, an activation,
//! an inactivation) is a sequence of values, each made only from the one
//! before and consumed by the next:
//!
//! 1. [`Exclusive`], the right to change the chain: one holder at a time
//!    ([`ChainHandle::try_exclusive`], [`ChainHandle::exclusive`]);
//! 2. a pause: new requests wait ([`Exclusive::pause_for_switch`] gives
//!    a [`SwitchPause`], [`Exclusive::pause`] a [`Pause`]);
//! 3. [`Quiesced`], the proof that nothing uses the chain and nothing
//!    starts to ([`SwitchPause::off_chain`], [`Pause::idle`], or
//!    [`Exclusive::quiesce_inactive`] while requests wait at an inactive
//!    gate); its [`Quiesced::replace`] is the only way to replace the
//!    chain, and it belongs to this handle by construction;
//! 4. [`Quiesced::resume`] ends the pause and gives the right back to
//!    its holder, who drops it when its change is complete.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, TryLockError};
use std::time::Duration;

use sqcow2_format::Chain;

pub(crate) mod gate;

use gate::{PauseGuard, RequestGate};

/// The served chain, the gate of its requests and the right to replace it.
#[derive(Debug)]
pub struct ChainHandle {
    current: RwLock<Arc<Chain>>,
    gate: Arc<RequestGate>,
    /// Held by [`Exclusive`].
    right: Mutex<()>,
}

impl ChainHandle {
    /// Serves `chain`, through a gate of its own.
    pub fn new(chain: Chain) -> Self {
        ChainHandle {
            current: RwLock::new(Arc::new(chain)),
            gate: Arc::default(),
            right: Mutex::new(()),
        }
    }

    /// Serves `chain` inactive: requests wait at the gate until the holder
    /// of the right activates it ([`Exclusive::set_inactive`]).
    pub fn new_inactive(chain: Chain) -> Self {
        let handle = ChainHandle::new(chain);
        handle.gate.set_inactive(true);
        handle
    }

    /// The chain now.
    pub fn get(&self) -> Arc<Chain> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Which requests may start on the chain.
    pub fn gate(&self) -> &Arc<RequestGate> {
        &self.gate
    }

    /// The right to change the chain, if nobody holds it. A holder that
    /// panicked left it free (the daemon goes on).
    #[must_use = "the right ends when this is dropped"]
    pub(crate) fn try_exclusive(&self) -> Option<Exclusive<'_>> {
        let held = match self.right.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        Some(Exclusive {
            handle: self,
            _held: held,
        })
    }

    /// [`ChainHandle::try_exclusive`], waiting for the holder.
    pub(crate) fn exclusive(&self) -> Exclusive<'_> {
        Exclusive {
            handle: self,
            _held: self.right.lock().unwrap_or_else(PoisonError::into_inner),
        }
    }
}

/// The right to change the served chain: one holder at a time. Held
/// across the I/O of the change it guards (drain, flush, reopen) on
/// purpose, so that no other change slips in between. Control requests
/// (live snapshot, activate, inactivate) meet it with `try_exclusive` and
/// answer `busy` at once; only a merge's switch and a stop wait for it.
#[must_use = "the right ends when this is dropped"]
#[derive(Debug)]
pub(crate) struct Exclusive<'h> {
    handle: &'h ChainHandle,
    _held: MutexGuard<'h, ()>,
}

impl<'h> Exclusive<'h> {
    /// Marks the gate inactive (requests wait, then fail) or active again.
    pub(crate) fn set_inactive(&self, inactive: bool) {
        self.handle.gate.set_inactive(inactive);
    }

    /// A switch's pause ([`RequestGate::pause_for_switch`]): new requests
    /// wait; work deferred off the chain begins only after it.
    pub(crate) fn pause_for_switch(self) -> SwitchPause<'h> {
        let guard = self.handle.gate.pause_for_switch();
        Paused::new(self, guard)
    }

    /// A plain pause ([`RequestGate::pause`]): new requests wait.
    pub(crate) fn pause(self) -> Pause<'h> {
        let guard = self.handle.gate.pause();
        Paused::new(self, guard)
    }

    /// While the gate is inactive (requests wait at it): waits at most
    /// `timeout` until none is in flight; the proof, or the right back.
    /// The proof holds while the gate stays inactive, which only the
    /// right's holder changes.
    pub(crate) fn quiesce_inactive(self, timeout: Duration) -> Result<Quiesced<'h>, Self> {
        if self.handle.gate.idle_while_inactive(timeout) {
            Ok(Quiesced {
                right: self,
                _pause: None,
            })
        } else {
            Err(self)
        }
    }
}

/// A switch's pause, taken by the right's holder: new requests wait, and
/// work deferred off the chain waits for the pause to end.
pub(crate) type SwitchPause<'h> = Paused<'h, ForSwitch>;

/// A plain pause, taken by the right's holder: new requests wait.
pub(crate) type Pause<'h> = Paused<'h, Plain>;

/// The kind of a [`SwitchPause`].
#[derive(Debug)]
pub(crate) enum ForSwitch {}

/// The kind of a [`Pause`].
#[derive(Debug)]
pub(crate) enum Plain {}

/// A pause of kind `K` with the right it was taken with: what ends it
/// is typed by the kind ([`SwitchPause::off_chain`], [`Pause::idle`]).
#[must_use = "the pause ends when this is dropped"]
#[derive(Debug)]
pub(crate) struct Paused<'h, K> {
    guard: PauseGuard,
    right: Exclusive<'h>,
    kind: std::marker::PhantomData<K>,
}

impl<'h, K> Paused<'h, K> {
    fn new(right: Exclusive<'h>, guard: PauseGuard) -> Self {
        Paused {
            guard,
            right,
            kind: std::marker::PhantomData,
        }
    }

    /// The proof if `quiet`, holding the pause from now on; else the
    /// pause back.
    fn proof_if(self, quiet: bool) -> Result<Quiesced<'h>, Self> {
        if quiet {
            Ok(Quiesced {
                _pause: Some(self.guard),
                right: self.right,
            })
        } else {
            Err(self)
        }
    }

    /// Ends the pause; the right stays held.
    pub(crate) fn resume(self) -> Exclusive<'h> {
        drop(self.guard);
        self.right
    }
}

impl<'h> SwitchPause<'h> {
    /// Waits at most `timeout` until nothing uses the chain (requests
    /// whose only work left is deferred do not count: that work begins
    /// after the pause, on the chain current then). The proof, which holds
    /// the pause from now on; the pause back if that did not happen.
    pub(crate) fn off_chain(self, timeout: Duration) -> Result<Quiesced<'h>, Self> {
        let quiet = self.guard.off_chain(timeout);
        self.proof_if(quiet)
    }
}

impl<'h> Pause<'h> {
    /// Waits at most `timeout` until no request is in flight and nothing
    /// is on the chain. The proof, holding the pause; the pause back if
    /// that did not happen.
    pub(crate) fn idle(self, timeout: Duration) -> Result<Quiesced<'h>, Self> {
        let quiet = self.guard.idle(timeout);
        self.proof_if(quiet)
    }
}

/// Proof that nothing uses the served chain and nothing starts to while it
/// lives, held with the right: the chain may be replaced.
#[must_use = "the chain may be replaced only while the proof is held"]
#[derive(Debug)]
pub(crate) struct Quiesced<'h> {
    /// The pause it rests on (none for an inactive gate). Ends first.
    _pause: Option<PauseGuard>,
    right: Exclusive<'h>,
}

impl<'h> Quiesced<'h> {
    /// The chain now (nothing uses it but the holder).
    pub(crate) fn current(&self) -> Arc<Chain> {
        self.right.handle.get()
    }

    /// Puts `chain` in place of the current one; returns the old one.
    #[must_use = "dropping the old chain here drops it inside the pause"]
    pub(crate) fn replace(&self, chain: Chain) -> Arc<Chain> {
        let mut cur = self
            .right
            .handle
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        std::mem::replace(&mut *cur, Arc::new(chain))
    }

    /// Ends the pause (requests start again); the right stays held.
    pub(crate) fn resume(self) -> Exclusive<'h> {
        drop(self._pause);
        self.right
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::test_support::small_chain as chain;

    #[test]
    fn one_right_at_a_time_and_the_proof_replaces() {
        let dir = tempfile::tempdir().expect("tempdir");
        let handle = ChainHandle::new(chain(dir.path(), "a.qcow2"));
        let right = handle.try_exclusive().expect("free");
        assert!(handle.try_exclusive().is_none(), "the right is held");
        let quiet = right
            .pause_for_switch()
            .off_chain(Duration::from_secs(1))
            .expect("nothing in flight");
        assert!(handle.gate().is_paused());
        let new = chain(dir.path(), "b.qcow2");
        let new_top = new.top().path().to_path_buf();
        let old = quiet.replace(new);
        assert!(old.top().path().ends_with("a.qcow2"));
        let right = quiet.resume();
        assert!(!handle.gate().is_paused(), "the pause ended");
        assert!(handle.try_exclusive().is_none(), "the right is still held");
        drop(right);
        assert!(handle.try_exclusive().is_some());
        assert_eq!(handle.get().top().path(), new_top);
    }

    #[test]
    fn an_active_gate_gives_no_inactive_proof() {
        let dir = tempfile::tempdir().expect("tempdir");
        let handle = ChainHandle::new(chain(dir.path(), "a.qcow2"));
        let right = handle.exclusive();
        let right = handle_err(right.quiesce_inactive(Duration::from_millis(10)));
        right.set_inactive(true);
        let quiet = right
            .quiesce_inactive(Duration::from_secs(1))
            .expect("inactive, nothing in flight");
        drop(quiet);
        assert!(
            handle.try_exclusive().is_some(),
            "dropping the proof frees the right"
        );
    }

    fn handle_err<'h>(r: Result<Quiesced<'h>, Exclusive<'h>>) -> Exclusive<'h> {
        match r {
            Ok(_) => panic!("an active gate must not give an inactive proof"),
            Err(right) => right,
        }
    }
}
