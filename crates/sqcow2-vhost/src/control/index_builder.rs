//! Builds the served top's chain index in the background: after a live
//! snapshot (the new top's index is not built inside the guest's pause)
//! and at start (a daemon killed during a build left the old index
//! serving). One thread at a time; a wake-up during a build runs another
//! build after it, for the chain served then (snapshots faster than
//! builds merge into one build for the newest top).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use sqcow2_format::indexing::build_index;
use sqcow2_format::Locking;
use tracing::{info, warn};

use super::protocol::IndexCounters;
use crate::handle::ChainHandle;

#[derive(Debug, Default)]
struct State {
    /// A thread is building.
    running: bool,
    /// Woken while building: build again after.
    again: bool,
    counters: IndexCounters,
}

/// The background builder of the served chain's index.
#[derive(Debug)]
pub struct IndexBuilder {
    handle: Arc<ChainHandle>,
    state: Arc<Mutex<State>>,
}

impl IndexBuilder {
    /// A builder for the chain `handle` serves (nothing runs until
    /// [`IndexBuilder::wake`]).
    pub fn new(handle: Arc<ChainHandle>) -> Self {
        IndexBuilder {
            handle,
            state: Arc::default(),
        }
    }

    fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
        state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Builds the served chain's index if it needs one (a writable chain
    /// whose top names an index that does not cover every layer below
    /// it), on a background thread.
    pub fn wake(&self) {
        let mut st = Self::lock(&self.state);
        if st.running {
            st.again = true;
            return;
        }
        st.running = true;
        st.counters.building = true;
        drop(st);
        let handle = self.handle.clone();
        let state = self.state.clone();
        let spawned = std::thread::Builder::new()
            .name("sqcow2-index".into())
            .spawn(move || loop {
                build_once(&handle, &state);
                let mut st = Self::lock(&state);
                if st.again {
                    st.again = false;
                    continue;
                }
                st.running = false;
                st.counters.building = false;
                return;
            });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start the index builder: the chain is walked above its index");
            let mut st = Self::lock(&self.state);
            st.running = false;
            st.counters.building = false;
        }
    }

    /// Counters for `stats` (`pending_layers` filled in by the caller).
    pub fn counters(&self) -> IndexCounters {
        Self::lock(&self.state).counters.clone()
    }
}

/// One build for the chain served now.
fn build_once(handle: &ChainHandle, state: &Mutex<State>) {
    let chain = handle.get();
    if !chain.is_writable() {
        return;
    }
    let start = Instant::now();
    // The daemon holds the chain's image locks: the build takes none.
    let result = build_index(&chain, Locking::Off, &mut |_, _| {});
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let mut st = IndexBuilder::lock(state);
    match result {
        Ok(Some(report)) => {
            st.counters.builds += 1;
            st.counters.last_build_ms = ms;
            st.counters.last_error = None;
            info!(index = %report.index.display(), layers = report.layers, bytes = report.bytes, ms, "chain index built");
        }
        Ok(None) => {}
        Err(e) => {
            st.counters.failures += 1;
            st.counters.last_error = Some(e.to_string());
            warn!(error = %e, "building the chain index failed: the old index goes on serving");
        }
    }
}
