//! The chain being served. A live snapshot replaces it while the device
//! is paused for a switch (nothing uses the old chain: see
//! [`crate::gate`]); everything else takes the current one per request,
//! engine jobs when they begin.

use std::sync::{Arc, PoisonError, RwLock};

use sqcow2_format::Chain;

use crate::gate::Quiesced;

/// The served chain, replaceable.
#[derive(Debug)]
pub struct ChainHandle {
    current: RwLock<Arc<Chain>>,
}

impl ChainHandle {
    /// Serves `chain`.
    pub fn new(chain: Chain) -> Self {
        ChainHandle {
            current: RwLock::new(Arc::new(chain)),
        }
    }

    /// The chain now.
    pub fn get(&self) -> Arc<Chain> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `chain` in place of the current one, while nothing uses the
    /// current one (`_quiet`); returns the old one.
    pub(crate) fn replace(&self, chain: Chain, _quiet: &Quiesced) -> Arc<Chain> {
        let mut cur = self.current.write().unwrap_or_else(PoisonError::into_inner);
        std::mem::replace(&mut *cur, Arc::new(chain))
    }
}
