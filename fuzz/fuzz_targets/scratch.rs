//! Shared by the targets that need a real image: a fresh one in a
//! scratch directory, opened writable.

use std::path::PathBuf;

use sqcow2_format::create::{create, CreateOptions};
use sqcow2_format::{Chain, ChainOptions};

/// A `size`-byte image in a new scratch directory, opened writable, with
/// the options used; the directory lives as long as the returned guard.
pub fn scratch_chain(size: u64) -> (tempfile::TempDir, PathBuf, Chain, ChainOptions) {
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("disk.qcow2");
    create(
        &image,
        &CreateOptions {
            size,
            ..CreateOptions::default()
        },
    )
    .expect("create image");
    let options = ChainOptions {
        writable: true,
        ..ChainOptions::default()
    };
    let chain = Chain::open(&image, &options).expect("open image");
    (dir, image, chain, options)
}
