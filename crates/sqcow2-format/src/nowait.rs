//! Lookups that must not wait for metadata I/O. A queue worker serves
//! many requests from one thread: a lookup that would read a metadata
//! slice from a file (a cache miss, 200 µs on remote storage) stalls them
//! all. In a [`NoMetadataIo`] scope, the loaders of metadata slices fail
//! with [`ErrorKind::WouldBlock`] instead of reading, and the caller hands
//! the request to a thread that may wait.

use std::cell::Cell;

use crate::error::ErrorKind;

thread_local! {
    static NO_METADATA_IO: Cell<bool> = const { Cell::new(false) };
}

/// While alive, metadata loads on this thread fail with
/// [`ErrorKind::WouldBlock`] (cached metadata still serves).
#[must_use = "the scope ends when the guard is dropped"]
#[derive(Debug)]
pub(crate) struct NoMetadataIo {
    before: bool,
}

impl NoMetadataIo {
    pub(crate) fn enter() -> Self {
        NoMetadataIo {
            before: NO_METADATA_IO.with(|c| c.replace(true)),
        }
    }
}

impl Drop for NoMetadataIo {
    fn drop(&mut self) {
        NO_METADATA_IO.with(|c| c.set(self.before));
    }
}

/// `Err(WouldBlock)` inside a [`NoMetadataIo`] scope: called by metadata
/// loaders before they read.
pub(crate) fn may_load() -> Result<(), ErrorKind> {
    if NO_METADATA_IO.with(Cell::get) {
        Err(ErrorKind::WouldBlock)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scope_is_per_thread_and_nests() {
        assert!(may_load().is_ok());
        {
            let _outer = NoMetadataIo::enter();
            assert!(may_load().is_err());
            std::thread::spawn(|| assert!(may_load().is_ok()))
                .join()
                .unwrap();
            {
                let _inner = NoMetadataIo::enter();
                assert!(may_load().is_err());
            }
            assert!(may_load().is_err());
        }
        assert!(may_load().is_ok());
    }
}
