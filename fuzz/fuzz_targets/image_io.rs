//! Image open plus reads and writes: any bytes as a (top) qcow2 image,
//! driven by a short operation script; first the header as `info` reads
//! images it does not open (LUKS, external data file). Opening, I/O and closing must
//! return data or errors, never panic, hang or allocate without bound.
//!
//! Input: `[flags][n][n x 7-byte op][image bytes]`; flags bit 0 opens the
//! image writable. An op is `[kind][offset: u32 LE, in 512-byte units]
//! [len: u16 LE]`; kind % 4 is read, write, write-zeroes, discard.

#![no_main]

use std::path::Path;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use sqcow2_format::storage::MemStorage;
use sqcow2_format::{Chain, ChainOptions};

/// Most bytes the image may grow to: a hostile image cannot make the
/// target exhaust memory.
const LIMIT: u64 = 64 << 20;

fuzz_target!(|data: &[u8]| {
    let [flags, n, rest @ ..] = data else {
        return;
    };
    let ops_len = usize::from(*n % 16) * 7;
    if rest.len() < ops_len {
        return;
    }
    let (ops, image) = rest.split_at(ops_len);
    let writable = flags & 1 != 0;
    let storage = Arc::new(MemStorage::with_limit(image.to_vec(), LIMIT));
    // What `info` reads of an image it shows without opening it (LUKS,
    // an external data file).
    if let Ok(header) = sqcow2_format::Header::read_for_inspection(&*storage) {
        if let Some((offset, len)) = header.luks_header() {
            let _ = sqcow2_format::luks::read_luks(&*storage, offset, len);
        }
        let _ = header.data_file();
    }
    let options = ChainOptions {
        writable,
        // One layer: a backing file named by the image is refused here
        // (and not looked up on this machine's filesystem).
        max_layers: 1,
        cache_size: 1 << 20,
        use_index: false,
        top_storage: Some(storage),
        ..ChainOptions::default()
    };
    let Ok(chain) = Chain::open(Path::new("/nonexistent/fuzz.qcow2"), &options) else {
        return;
    };
    let size = chain.virtual_size();
    let mut buf = vec![0u8; 65536];
    for op in ops.chunks_exact(7) {
        let offset = u64::from(u32::from_le_bytes([op[1], op[2], op[3], op[4]])) * 512;
        let offset = if size == 0 { offset } else { offset % size };
        let len = usize::from(u16::from_le_bytes([op[5], op[6]])) + 1;
        let _ = match op[0] % 4 {
            0 => chain.read_at(&mut buf[..len], offset),
            1 if writable => chain.write_at(&buf[..len], offset),
            2 if writable => chain.write_zeroes(offset, len as u64, op[0] & 4 != 0),
            3 if writable => chain.discard(offset, len as u64),
            _ => chain.read_at(&mut buf[..len], offset),
        };
    }
    let _ = chain.flush();
    let _ = chain.close();
});
