//! Storage for the engine's hermetic tests: memory that records every
//! write and sync (to rebuild what a crash could leave), fails writes or
//! syncs on demand, and holds writes to a range until the test releases
//! them (to pin down races).

#![allow(dead_code)]

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sqcow2_format::create::{image_bytes, CreateOptions};
use sqcow2_format::storage::Storage;
use sqcow2_format::{Chain, ChainOptions};

/// One recorded operation.
#[derive(Debug, Clone)]
pub enum Op {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
    Sync,
}

/// Applies `op` to an image.
pub fn apply(image: &mut Vec<u8>, op: &Op) {
    match op {
        Op::Write { offset, data } => {
            let end = *offset as usize + data.len();
            if image.len() < end {
                image.resize(end, 0);
            }
            image[*offset as usize..end].copy_from_slice(data);
        }
        Op::SetLen(len) => image.resize(*len as usize, 0),
        Op::Sync => {}
    }
}

#[derive(Default)]
struct Hold {
    start: u64,
    end: u64,
    armed: bool,
    waiting: usize,
    released: bool,
}

/// Memory storage with a log, failures and holds.
#[derive(Default)]
pub struct TestStorage {
    live: Mutex<Vec<u8>>,
    log: Mutex<Vec<Op>>,
    /// Fail this many of the next writes with EIO.
    pub fail_writes: AtomicU32,
    /// Fail syncs with EIO.
    pub fail_syncs: AtomicBool,
    hold: Mutex<Hold>,
    hold_changed: Condvar,
}

impl std::fmt::Debug for TestStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TestStorage")
    }
}

impl TestStorage {
    pub fn new(bytes: Vec<u8>) -> Arc<Self> {
        Arc::new(TestStorage {
            live: Mutex::new(bytes),
            ..TestStorage::default()
        })
    }

    /// The current bytes.
    pub fn bytes(&self) -> Vec<u8> {
        self.live.lock().unwrap().clone()
    }

    /// The operations so far.
    pub fn log(&self) -> Vec<Op> {
        self.log.lock().unwrap().clone()
    }

    /// How many operations the log holds.
    pub fn log_len(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    /// Writes overlapping `[start, end)` block until [`TestStorage::release`].
    pub fn hold_writes(&self, start: u64, end: u64) {
        let mut h = self.hold.lock().unwrap();
        *h = Hold {
            start,
            end,
            armed: true,
            ..Hold::default()
        };
    }

    /// Waits (at most 10 s) until `n` writes are held.
    pub fn wait_held(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut h = self.hold.lock().unwrap();
        while h.waiting < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no write was held within 10 s");
            h = self.hold_changed.wait_timeout(h, left).unwrap().0;
        }
    }

    /// Writes held so far.
    pub fn held(&self) -> usize {
        self.hold.lock().unwrap().waiting
    }

    /// Lets held writes go on; later ones are not held.
    pub fn release(&self) {
        let mut h = self.hold.lock().unwrap();
        h.released = true;
        h.armed = false;
        self.hold_changed.notify_all();
    }

    fn maybe_hold(&self, offset: u64, len: u64) {
        let mut h = self.hold.lock().unwrap();
        if !h.armed || offset + len <= h.start || offset >= h.end {
            return;
        }
        h.waiting += 1;
        self.hold_changed.notify_all();
        while !h.released {
            h = self.hold_changed.wait(h).unwrap();
        }
    }
}

impl Storage for TestStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let live = self.live.lock().unwrap();
        buf.fill(0);
        let start = (offset as usize).min(live.len());
        let end = (start + buf.len()).min(live.len());
        buf[..end - start].copy_from_slice(&live[start..end]);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.live.lock().unwrap().len() as u64)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.maybe_hold(offset, buf.len() as u64);
        if self
            .fail_writes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(io::Error::from_raw_os_error(libc_eio()));
        }
        let op = Op::Write {
            offset,
            data: buf.to_vec(),
        };
        apply(&mut self.live.lock().unwrap(), &op);
        self.log.lock().unwrap().push(op);
        Ok(())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.live.lock().unwrap().resize(len as usize, 0);
        self.log.lock().unwrap().push(Op::SetLen(len));
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        if self.fail_syncs.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc_eio()));
        }
        self.log.lock().unwrap().push(Op::Sync);
        Ok(())
    }
}

fn libc_eio() -> i32 {
    5
}

/// A fresh image of `size` bytes with 64 KiB clusters (more options by
/// `f`), in a `TestStorage`.
pub fn image(size: u64, f: impl FnOnce(&mut CreateOptions)) -> Arc<TestStorage> {
    let mut opts = CreateOptions {
        size,
        ..CreateOptions::default()
    };
    f(&mut opts);
    TestStorage::new(image_bytes(&opts).expect("image"))
}

/// The path a test image pretends to have.
pub fn fake_path() -> PathBuf {
    Path::new("/nonexistent/sqcow2-test/top.qcow2").to_path_buf()
}

/// Opens `storage` as a chain (writable or not).
pub fn open(storage: &Arc<TestStorage>, writable: bool) -> Chain {
    Chain::open(
        &fake_path(),
        &ChainOptions {
            writable,
            top_storage: Some(storage.clone() as Arc<dyn Storage>),
            ..ChainOptions::default()
        },
    )
    .expect("open")
}
