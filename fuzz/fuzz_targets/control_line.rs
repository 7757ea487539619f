//! The control protocol: any line sent to the control socket. Every line
//! must get a reply (typed error or result) that serialises to a JSON
//! object, never panic, and the Prometheus rendering of any stats reply
//! must work.
//!
//! A `path` argument is confined to a scratch directory (its last
//! component kept) so the target cannot create files elsewhere on the
//! machine; the validation of everything else sees the raw input.

#![no_main]

#[path = "scratch.rs"]
mod scratch;

use std::cell::RefCell;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sqcow2_vhost::internals::ChainHandle;
use sqcow2_vhost::internals::{handle_line, prometheus, Shared};
use sqcow2_vhost::protocol::Stats;

struct Harness {
    dir: tempfile::TempDir,
    shared: Arc<Shared>,
}

fn harness() -> Harness {
    let (dir, _, chain, options) = scratch::scratch_chain(1 << 20);
    let shared = Arc::new(Shared::new(Arc::new(ChainHandle::new(chain)), options));
    Harness { dir, shared }
}

thread_local! {
    static HARNESS: RefCell<Harness> = RefCell::new(harness());
}

/// Rewrites a string `path` argument to a name inside `dir`.
fn confine(line: &str, dir: &std::path::Path) -> String {
    let Ok(Value::Object(mut request)) = serde_json::from_str::<Value>(line) else {
        return line.to_string();
    };
    if let Some(Value::String(p)) = request.get("path") {
        let name = std::path::Path::new(p)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Always the same few names: snapshots mostly meet `exists`.
        let name = format!("snap-{}", name.len() % 4);
        let confined = dir.join(name).to_string_lossy().into_owned();
        request.insert("path".into(), Value::String(confined));
    }
    Value::Object(request).to_string()
}

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    HARNESS.with(|h| {
        let h = h.borrow();
        let line = confine(line, h.dir.path());
        let reply = handle_line(&line, &h.shared);
        let json = serde_json::to_value(&reply).expect("a reply serialises");
        assert!(json.is_object(), "reply is not an object: {json}");
        assert_eq!(reply.ok, reply.error.is_none(), "{json}");
        if let Some(stats) = reply
            .result
            .and_then(|r| serde_json::from_value::<Stats>(r).ok())
        {
            let _ = prometheus::render(&stats);
        }
    });
});
