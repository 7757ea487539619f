//! The NBD export: any bytes a client sends, from the handshake on, to
//! a writable export of a scratch chain. The server must answer or hang
//! up, never panic; it reads nothing past the input.

#![no_main]

#[path = "scratch.rs"]
mod scratch;

use std::cell::RefCell;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use sqcow2_vhost::internals::{ChainHandle, Shared};
use sqcow2_vhost::nbd::{serve_bytes, Export};

struct Harness {
    _dir: tempfile::TempDir,
    shared: Arc<Shared>,
}

fn harness() -> Harness {
    let (dir, _, chain, options) = scratch::scratch_chain(1 << 20);
    let shared = Arc::new(Shared::new(Arc::new(ChainHandle::new(chain)), options));
    Harness { _dir: dir, shared }
}

thread_local! {
    static HARNESS: RefCell<Harness> = RefCell::new(harness());
}

fuzz_target!(|data: &[u8]| {
    HARNESS.with(|h| {
        let h = h.borrow();
        let export = Export {
            name: String::new(),
            writable: true,
        };
        let out = serve_bytes(data, &h.shared, &export);
        // The greeting always comes first.
        assert!(out.starts_with(b"NBDMAGICIHAVEOPT"), "no greeting");
    });
});
