//! The chain being served. A live snapshot replaces it while the device
//! is paused; everything else takes the current one per request.

use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use sqcow2_format::Chain;

/// The served chain, replaceable.
#[derive(Debug)]
pub struct ChainHandle {
    current: RwLock<Arc<Chain>>,
    /// Request processing holds this shared; a live snapshot exclusively.
    gate: RwLock<()>,
}

impl ChainHandle {
    /// Serves `chain`.
    pub fn new(chain: Chain) -> Self {
        ChainHandle {
            current: RwLock::new(Arc::new(chain)),
            gate: RwLock::new(()),
        }
    }

    /// The chain now.
    pub fn get(&self) -> Arc<Chain> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `chain` in place of the current one; returns the old one.
    pub fn replace(&self, chain: Chain) -> Arc<Chain> {
        let mut cur = self.current.write().unwrap_or_else(PoisonError::into_inner);
        std::mem::replace(&mut *cur, Arc::new(chain))
    }

    /// Held while requests are taken and started.
    pub fn running(&self) -> RwLockReadGuard<'_, ()> {
        self.gate.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Held while no request may start (a live snapshot).
    pub fn pause(&self) -> RwLockWriteGuard<'_, ()> {
        self.gate.write().unwrap_or_else(PoisonError::into_inner)
    }
}
