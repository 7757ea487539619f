//! A bounded cache of whole L2 tables for the chain engine.
//!
//! Interim: the unified slice cache of `sqcow2-cache` replaces it. Tables are
//! evicted in insertion order once the byte budget is exceeded.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::types::{HostOffset, LayerIndex};

/// Key of a cached table: the layer and the table's host offset.
type Key = (LayerIndex, HostOffset);

/// A decoded L2 table: one `u64` per standard entry, two per extended entry.
pub type L2Table = Arc<[u64]>;

#[derive(Debug, Default)]
struct Inner {
    tables: HashMap<Key, L2Table>,
    order: VecDeque<Key>,
    bytes: u64,
}

/// Bounded map from (layer, table offset) to decoded table.
#[derive(Debug)]
pub struct L2Cache {
    budget: u64,
    inner: Mutex<Inner>,
}

impl L2Cache {
    /// A cache holding at most `budget` bytes of tables (at least one table).
    pub fn new(budget: u64) -> Self {
        Self {
            budget,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The cached table, if any.
    pub fn get(&self, key: Key) -> Option<L2Table> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.tables.get(&key).cloned()
    }

    /// Caches a table, evicting the oldest ones beyond the budget.
    pub fn insert(&self, key: Key, table: L2Table) {
        let size = table.len() as u64 * 8;
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.tables.insert(key, table).is_none() {
            inner.order.push_back(key);
            inner.bytes += size;
        }
        while inner.bytes > self.budget && inner.order.len() > 1 {
            let Some(old) = inner.order.pop_front() else {
                break;
            };
            if let Some(t) = inner.tables.remove(&old) {
                inner.bytes -= t.len() as u64 * 8;
            }
        }
    }
}
