//! L2 tables that a writer of this process holds in memory for an image
//! that a chain reads as a backing layer: a live snapshot's old top, from
//! the switch until its writer has closed it. Its latest mappings may not
//! be in its file yet (nothing is written back inside the guest's pause),
//! so the layer's slice loader asks the writer first.

use std::sync::{Arc, PoisonError, RwLock};

use sqcow2_cache::Slice;

/// A writer's tables were locked (by a write-back) when asked without
/// waiting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Busy;

/// A writer that may hold tables newer than its image's file.
pub(crate) trait TableHolder: Send + Sync + std::fmt::Debug {
    /// The `words` words at byte `offset` of the file, inside the table
    /// at `l2_offset`, as the writer holds them (the latest, written back
    /// or not); `None` if it does not hold the table (the file has it as
    /// it is).
    fn held_slice(&self, l2_offset: u64, offset: u64, words: usize) -> Option<Slice>;

    /// [`TableHolder::held_slice`] without waiting for the writer's lock.
    fn try_held_slice(
        &self,
        l2_offset: u64,
        offset: u64,
        words: usize,
    ) -> Result<Option<Slice>, Busy>;
}

/// The writer a layer asks before its file, until
/// [`HolderSlot::release`] (once the writer has written every table it
/// holds to the file). Shared by the clones of the layer.
#[derive(Debug, Clone)]
pub(crate) struct HolderSlot(Arc<RwLock<Option<Arc<dyn TableHolder>>>>);

impl HolderSlot {
    pub(crate) fn new(holder: Arc<dyn TableHolder>) -> Self {
        HolderSlot(Arc::new(RwLock::new(Some(holder))))
    }

    /// The writer, while it still holds tables the file may lack.
    pub(crate) fn holder(&self) -> Option<Arc<dyn TableHolder>> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The writer's tables are all in the file: read it from now on.
    pub(crate) fn release(&self) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = None;
    }
}
