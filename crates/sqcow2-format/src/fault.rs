//! Test hooks (cargo feature `fault-injection`): make the engine panic at a
//! named point, to test what a bug in the middle of an update leaves
//! behind, or stall at one, to widen a race. Armed per chain; without the
//! feature the hooks compile to nothing.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// Where the engine can be made to panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(not(feature = "fault-injection"), allow(unreachable_pub))]
pub enum FaultPoint {
    /// In the middle of a metadata update of an allocating write: the old
    /// cluster's release is queued, the new mapping not yet set.
    MidMetadataUpdate,
    /// After an allocating write's new mapping is set, before its journal
    /// record is written (also a stall point: [`Faults::stall`]).
    BeforeJournalRecord,
}

/// Armed faults of one chain: hits left before each point panics (0: not
/// armed).
#[derive(Debug, Default)]
pub(crate) struct Faults {
    mid_metadata_update: AtomicU32,
    before_journal_record: AtomicU32,
    /// Milliseconds the next hit of `BeforeJournalRecord` stalls.
    journal_record_stall_ms: AtomicU32,
    /// A hit of `BeforeJournalRecord` is stalling now.
    journal_record_stalling: AtomicBool,
}

impl Faults {
    /// Panics at the `nth` (1-based) next hit of `point`.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn arm(&self, point: FaultPoint, nth: u32) {
        match point {
            FaultPoint::MidMetadataUpdate => self.mid_metadata_update.store(nth, Ordering::SeqCst),
            FaultPoint::BeforeJournalRecord => {
                self.before_journal_record.store(nth, Ordering::SeqCst)
            }
        }
    }

    /// The next hit of `point` sleeps `ms` milliseconds.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn stall(&self, point: FaultPoint, ms: u32) {
        if point == FaultPoint::BeforeJournalRecord {
            self.journal_record_stall_ms.store(ms, Ordering::SeqCst);
        }
    }

    /// Whether a hit of `point` is stalling now.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn stalling(&self, point: FaultPoint) -> bool {
        point == FaultPoint::BeforeJournalRecord
            && self.journal_record_stalling.load(Ordering::SeqCst)
    }

    /// A hook: panics if `point` is armed and its turn has come.
    pub(crate) fn hit(&self, point: FaultPoint) {
        if !cfg!(feature = "fault-injection") {
            return;
        }
        let counter = match point {
            FaultPoint::MidMetadataUpdate => &self.mid_metadata_update,
            FaultPoint::BeforeJournalRecord => {
                let ms = self.journal_record_stall_ms.swap(0, Ordering::SeqCst);
                if ms > 0 {
                    self.journal_record_stalling.store(true, Ordering::SeqCst);
                    std::thread::sleep(std::time::Duration::from_millis(ms.into()));
                    self.journal_record_stalling.store(false, Ordering::SeqCst);
                }
                &self.before_journal_record
            }
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
