//! Set-up shared by the unit tests.

use std::path::Path;
use std::sync::Arc;

use sqcow2_format::create::{create, CreateOptions};
use sqcow2_format::{Chain, ChainOptions};

use crate::device::gate::{Admission, RequestGate, RequestPermit};

/// A new empty 1 MiB image `name` in `dir`, opened read-only.
pub(crate) fn small_chain(dir: &Path, name: &str) -> Chain {
    open(dir, name)
}

fn open(dir: &Path, name: &str) -> Chain {
    let image = dir.join(name);
    create(
        &image,
        &CreateOptions {
            size: 1 << 20,
            ..CreateOptions::default()
        },
    )
    .unwrap();
    Chain::open(&image, &ChainOptions::default()).unwrap()
}

/// A request admitted by `gate` (which must not be paused).
pub(crate) fn admitted(gate: &Arc<RequestGate>) -> RequestPermit {
    match gate.try_start() {
        Admission::Start(p) => p,
        other => panic!("not admitted: {other:?}"),
    }
}
