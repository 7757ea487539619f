//! Point-in-time exports: a layer below the served top (immutable: the
//! old top of a live snapshot), with the layers below it, exported
//! read-only by name beside the live disk, for a backup that reads the
//! disk as it was at the snapshot while the guest writes on (control
//! `nbd-export`, `nbd-export-remove`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use sqcow2_format::{Chain, ChainOptions, Locking};

use super::protocol::{Failure, FailureKind, LayerName, NbdExportResult};
use super::Shared;

/// The point-in-time exports, by name.
#[derive(Debug, Default)]
pub(crate) struct FrozenExports {
    chains: Mutex<HashMap<String, Arc<Chain>>>,
    /// The live export's name (set when the export starts).
    pub(crate) live_name: OnceLock<String>,
}

impl FrozenExports {
    /// The chain exported as `name`, if one is.
    pub(crate) fn get(&self, name: &str) -> Option<Arc<Chain>> {
        self.lock().get(name).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Chain>>> {
        self.chains.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn fail(kind: FailureKind, message: impl Into<String>) -> Failure {
    Failure::new(kind, message.into())
}

/// `nbd-export`: exports `layer` of the served chain as `name`.
pub(crate) fn add(
    shared: &Shared,
    name: &str,
    layer: &LayerName,
) -> Result<NbdExportResult, Failure> {
    let Some(live) = shared.frozen.live_name.get() else {
        return Err(fail(
            FailureKind::BadRequest,
            "the daemon has no NBD export (serve --nbd)",
        ));
    };
    if name == live {
        return Err(fail(
            FailureKind::Exists,
            format!("{name:?} is the live export's name"),
        ));
    }
    let served = shared.handle.get();
    let at = sqcow2_format::reshape::find_layer(&served, &layer.into())
        .map_err(|e| fail(FailureKind::BadRequest, e.to_string()))?;
    if at.0 >= served.top_index().0 {
        return Err(fail(
            FailureKind::BadRequest,
            "only a layer below the top is immutable: take a live snapshot first",
        ));
    }
    let path = served.layers()[at.0].path().to_path_buf();
    drop(served);
    // The daemon holds the chain's image locks itself.
    let options = ChainOptions {
        writable: false,
        locking: Locking::Off,
        top_storage: None,
        ..shared.options.clone()
    };
    let chain =
        Chain::open(&path, &options).map_err(|e| fail(FailureKind::IoError, e.to_string()))?;
    let size = chain.virtual_size();
    let mut chains = shared.frozen.lock();
    if chains.contains_key(name) {
        return Err(fail(FailureKind::Exists, format!("export {name:?} exists")));
    }
    chains.insert(name.to_string(), Arc::new(chain));
    Ok(NbdExportResult {
        name: name.to_string(),
        layer: path,
        size,
    })
}

/// `nbd-export-remove`: ends export `name` (clients connected to it go
/// on reading until they disconnect).
pub(crate) fn remove(shared: &Shared, name: &str) -> Result<NbdExportResult, Failure> {
    let chain = shared
        .frozen
        .lock()
        .remove(name)
        .ok_or_else(|| fail(FailureKind::BadRequest, format!("no export {name:?}")))?;
    Ok(NbdExportResult {
        name: name.to_string(),
        layer: chain.top().path().to_path_buf(),
        size: chain.virtual_size(),
    })
}
