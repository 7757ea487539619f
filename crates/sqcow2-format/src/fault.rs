//! Test hooks (cargo feature `fault-injection`): make the engine panic at a
//! named point, to test what a bug in the middle of an update leaves
//! behind. Armed per chain; without the feature the hooks compile to
//! nothing.

use std::sync::atomic::{AtomicU32, Ordering};

/// Where the engine can be made to panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(not(feature = "fault-injection"), allow(unreachable_pub))]
pub enum FaultPoint {
    /// In the middle of a metadata update of an allocating write: the old
    /// cluster's release is queued, the new mapping not yet set.
    MidMetadataUpdate,
}

/// Armed faults of one chain: hits left before each point panics (0: not
/// armed).
#[derive(Debug, Default)]
pub(crate) struct Faults {
    mid_metadata_update: AtomicU32,
}

impl Faults {
    /// Panics at the `nth` (1-based) next hit of `point`.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn arm(&self, point: FaultPoint, nth: u32) {
        match point {
            FaultPoint::MidMetadataUpdate => self.mid_metadata_update.store(nth, Ordering::SeqCst),
        }
    }

    /// A hook: panics if `point` is armed and its turn has come.
    pub(crate) fn hit(&self, point: FaultPoint) {
        if !cfg!(feature = "fault-injection") {
            return;
        }
        let counter = match point {
            FaultPoint::MidMetadataUpdate => &self.mid_metadata_update,
        };
        let left = counter.load(Ordering::SeqCst);
        if left == 0 {
            return;
        }
        counter.store(left - 1, Ordering::SeqCst);
        if left == 1 {
            panic!("injected fault at {point:?}");
        }
    }
}
