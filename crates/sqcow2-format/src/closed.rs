//! A closed image opened to be changed offline (a shrink, an amend): the
//! file opened for writing by its place, a writer's lock taken as QEMU
//! takes it, the header read, and the image checked to be one such a
//! change may rewrite: closed cleanly (no dirty bit, no writer's journal)
//! and consistent (its refcounts may be recomputed as a leak repair).

use std::path::Path;
use std::sync::Arc;

use crate::check::{check_storage, Repair};
use crate::error::{Error, ErrorKind};
use crate::header::Header;
use crate::lock::{LockRequest, Locking};
use crate::sidefile::ImagePlace;
use crate::storage::{FileStorage, Storage};

/// An image opened for an offline change.
#[derive(Debug)]
pub(crate) struct ClosedImage {
    pub(crate) storage: Arc<dyn Storage>,
    pub(crate) header: Header,
}

impl ClosedImage {
    /// Opens the image at `path` for a change; `plan` makes what the
    /// change needs of its header, or says why the header rules it out
    /// (before the consistency check, which reads the whole metadata).
    pub(crate) fn open<T>(
        path: &Path,
        locking: Locking,
        plan: impl FnOnce(&Header) -> Result<T, ErrorKind>,
    ) -> Result<(ClosedImage, T), Error> {
        let e = |k: ErrorKind| Error::new(path, k);
        let io = |io: std::io::Error| Error::new(path, io.into());
        let place = ImagePlace::of(path).map_err(io)?;
        let storage = place
            .open_image(true)
            .and_then(FileStorage::from_writable_file)
            .map_err(io)?;
        storage.lock(LockRequest::WRITER, locking).map_err(e)?;
        let header = Header::read(&storage).map_err(e)?;
        let journaled = crate::active::pending_journal(&place, storage.file_id(), &header)
            .is_some_and(|n| n > 0);
        if header.is_dirty() || journaled {
            return Err(e(ErrorKind::InvalidArgument(
                "the image was not closed cleanly: open it read-write once (or sqcow2 check -r all) first"
                    .into(),
            )));
        }
        let planned = plan(&header).map_err(e)?;
        let storage: Arc<dyn Storage> = Arc::new(storage);
        let report = check_storage(path, storage.clone(), Repair::None)?;
        if report.corruptions > 0 || report.check_errors > 0 {
            return Err(e(ErrorKind::InvalidArgument(format!(
                "the image has {} corruptions: repair it first (sqcow2 check -r all)",
                report.corruptions + report.check_errors
            ))));
        }
        Ok((ClosedImage { storage, header }, planned))
    }
}
