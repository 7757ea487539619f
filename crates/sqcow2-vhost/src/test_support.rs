//! Set-up shared by the unit tests.

use std::path::Path;
use std::sync::Arc;

use sqcow2_format::create::{create, CreateOptions};
use sqcow2_format::{Chain, ChainOptions};

use crate::gate::{Admission, RequestGate, RequestPermit};

/// A new empty 1 MiB image `name` in `dir`, opened read-only.
pub(crate) fn small_chain(dir: &Path, name: &str) -> Chain {
    open(dir, name, false)
}

/// [`small_chain`] opened read-write.
pub(crate) fn small_writable_chain(dir: &Path, name: &str) -> Chain {
    open(dir, name, true)
}

fn open(dir: &Path, name: &str, writable: bool) -> Chain {
    let image = dir.join(name);
    create(
        &image,
        &CreateOptions {
            size: 1 << 20,
            ..CreateOptions::default()
        },
    )
    .unwrap();
    let options = ChainOptions {
        writable,
        ..ChainOptions::default()
    };
    Chain::open(&image, &options).unwrap()
}

/// A request admitted by `gate` (which must not be paused).
pub(crate) fn admitted(gate: &Arc<RequestGate>) -> RequestPermit {
    match gate.try_start() {
        Admission::Start(p) => p,
        other => panic!("not admitted: {other:?}"),
    }
}
