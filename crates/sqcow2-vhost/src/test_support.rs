//! Set-up shared by the unit tests.

use std::path::Path;

use sqcow2_format::create::{create, CreateOptions};
use sqcow2_format::{Chain, ChainOptions};

/// A new empty 1 MiB image `name` in `dir`, opened read-write.
pub(crate) fn small_chain(dir: &Path, name: &str) -> Chain {
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
