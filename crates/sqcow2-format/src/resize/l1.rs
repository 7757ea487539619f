//! Moving a closed image's L1 table to bigger clusters, so that it
//! addresses a larger disk (QEMU's `qcow2_grow_l1_table`, offline).
//!
//! Crash order: the new clusters are counted durably first, then the new
//! table written and synced, then the header's L1 size and offset
//! switched in one write (they are adjacent fields), synced; the old
//! table's clusters are freed last. A crash leaves the old table or the
//! new one named, and at worst leaked clusters.

use std::path::Path;

use crate::closed::ClosedImage;
use crate::error::{Error, ErrorKind, Feature};
use crate::header::{field, Header, Version, MAX_L1_BYTES};
use crate::lock::Locking;
use crate::refcount::Refcounts;
use crate::storage::Storage;

/// Moves the L1 table of the closed image at `path` to new clusters that
/// address `size` bytes, taking a writer's lock as QEMU would. Nothing
/// is done if the table addresses `size` in place already.
pub fn move_l1_for(path: &Path, size: u64, locking: Locking) -> Result<(), Error> {
    let e = |k: ErrorKind| Error::new(path, k);
    let (ClosedImage { storage, header }, entries) =
        ClosedImage::open(path, locking, |h| plan(h, size))?;
    let Some(entries) = entries else {
        return Ok(());
    };
    move_table(&*storage, &header, entries).map_err(e)
}

/// The new table's entries, `None` when it need not move; refused as
/// qemu-img refuses the size.
pub(crate) fn plan(header: &Header, size: u64) -> Result<Option<u64>, ErrorKind> {
    super::check_new_size(size)?;
    if header.version == Version::V2 && header.nb_snapshots > 0 {
        return Err(ErrorKind::Unsupported(Feature::ResizeV2WithSnapshots));
    }
    if size <= super::in_place_limit(header) {
        return Ok(None);
    }
    let entries = header.geometry.l1_entries_for(size);
    if entries * 8 > MAX_L1_BYTES || u32::try_from(entries).is_err() {
        return Err(ErrorKind::SizeTooLarge(size));
    }
    Ok(Some(entries))
}

fn move_table(storage: &dyn Storage, header: &Header, entries: u64) -> Result<(), ErrorKind> {
    let g = header.geometry;
    let cs = g.cluster_size();
    let clusters = (entries * 8).div_ceil(cs);
    let mut rc = Refcounts::load(
        storage,
        header.refcount_order,
        g.cluster_bits,
        header.refcount_table_offset,
        header.refcount_table_clusters,
    )?;
    // Clusters skipped on the way given back (a failure there leaks one).
    let first = crate::refcount::contiguous_run(
        &mut rc,
        clusters,
        |rc| rc.alloc(storage),
        |rc, c| drop(rc.unalloc(storage, c)),
    )?;
    super::write_counts(storage, &mut rc)?;
    let mut table = vec![0u8; (clusters * cs) as usize];
    let old_len = u64::from(header.l1_size) * 8;
    if header.l1_table_offset != 0 {
        storage.read_at(&mut table[..old_len as usize], header.l1_table_offset)?;
    }
    let at = first << g.cluster_bits;
    storage.write_at(&table, at)?;
    storage.sync()?;
    let mut fields = [0u8; 12];
    fields[..4].copy_from_slice(&(entries as u32).to_be_bytes());
    fields[4..].copy_from_slice(&at.to_be_bytes());
    storage.write_at(&fields, field::L1_SIZE as u64)?;
    storage.sync()?;
    if header.l1_table_offset != 0 {
        let old = header.l1_table_offset >> g.cluster_bits;
        for c in old..old + old_len.div_ceil(cs) {
            rc.unalloc(storage, c)?;
        }
        super::write_counts(storage, &mut rc)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::chain::{Chain, ChainOptions};
    use crate::check::{check_storage, Repair};
    use crate::create::{create, CreateOptions};
    use crate::storage::FileStorage;

    /// A file whose process dies after `left` more writes: those reach
    /// the file (the page cache), every later write or sync fails.
    #[derive(Debug)]
    struct DiesAfter {
        file: FileStorage,
        left: AtomicUsize,
    }

    impl DiesAfter {
        fn spend(&self) -> io::Result<()> {
            self.left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .map(drop)
                .map_err(|_| io::Error::other("the process died"))
        }
    }

    impl Storage for DiesAfter {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.file.read_at(buf, offset)
        }
        fn len(&self) -> io::Result<u64> {
            self.file.len()
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.spend()?;
            self.file.write_at(buf, offset)
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            self.spend()?;
            self.file.set_len(len)
        }
        fn sync(&self) -> io::Result<()> {
            if self.left.load(Ordering::SeqCst) == 0 {
                return Err(io::Error::other("the process died"));
            }
            self.file.sync()
        }
    }

    fn read_all(path: &Path, size: u64) -> Vec<u8> {
        let chain = Chain::open(
            path,
            &ChainOptions {
                locking: Locking::Off,
                ..ChainOptions::default()
            },
        )
        .unwrap();
        let mut all = vec![0u8; size as usize];
        chain.read_at(&mut all, 0).unwrap();
        all
    }

    /// Size of the images the cut-short tests move the table of.
    const SIZE: u64 = 1 << 30;

    /// A 1 GiB image with 4 KiB clusters (its L1 table addresses 1 GiB
    /// in one cluster) and three writes, in `dir`; its path and bytes.
    fn pristine(dir: &Path) -> (std::path::PathBuf, Vec<u8>) {
        let pristine = dir.join("pristine.qcow2");
        create(
            &pristine,
            &CreateOptions {
                size: SIZE,
                cluster_size: 4096,
                ..CreateOptions::default()
            },
        )
        .unwrap();
        let chain = Chain::open(
            &pristine,
            &ChainOptions {
                writable: true,
                locking: Locking::Off,
                ..ChainOptions::default()
            },
        )
        .unwrap();
        for (k, at) in [0u64, 300 << 20, SIZE - 4096].into_iter().enumerate() {
            chain.write_at(&[k as u8 + 1; 4096], at).unwrap();
        }
        chain.close().unwrap();
        let want = read_all(&pristine, SIZE);
        (pristine, want)
    }

    fn open_rw(path: &Path) -> FileStorage {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        FileStorage::from_writable_file(file).unwrap()
    }

    /// After a move cut after `cut` writes: `work` checks without
    /// corruption and reads as `want`; the check's report.
    fn assert_whole(work: &Path, want: &[u8], cut: usize) -> crate::check::CheckReport {
        let check: Arc<dyn Storage> = Arc::new(open_rw(work));
        let report = check_storage(work, check, Repair::None).unwrap();
        assert_eq!(
            (report.corruptions, report.check_errors),
            (0, 0),
            "cut after {cut} writes: {:?}",
            report.messages
        );
        assert!(read_all(work, SIZE) == want, "cut after {cut} writes");
        report
    }

    /// The live move (a served top grown past what its L1 table's clusters
    /// address, `Active::grow`) cut short after each of its writes in
    /// turn, the process then dead: the image checks without corruption
    /// and reads as before; uncut, it has the new size.
    #[test]
    fn a_live_move_cut_short_anywhere_leaves_the_image_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (pristine, want) = pristine(dir.path());
        let work = dir.path().join("work.qcow2");
        for cut in 0.. {
            std::fs::copy(&pristine, &work).unwrap();
            let storage = Arc::new(DiesAfter {
                file: open_rw(&work),
                left: AtomicUsize::new(usize::MAX),
            });
            let options = ChainOptions {
                writable: true,
                locking: Locking::Off,
                top_storage: Some(storage.clone() as Arc<dyn Storage>),
                ..ChainOptions::default()
            };
            let chain = Chain::open(&work, &options).unwrap();
            storage.left.store(cut, Ordering::SeqCst);
            let done = chain.handover().grow_top(3 << 30).is_ok();
            // The process dies: nothing more reaches the file.
            storage.left.store(0, Ordering::SeqCst);
            drop(chain);
            drop(storage);
            assert_whole(&work, &want, cut);
            if done {
                let header = Header::read(&open_rw(&work)).unwrap();
                assert_eq!(header.size, 3 << 30, "an uncut grow");
                assert!(cut > 3, "the move wrote too little");
                break;
            }
        }
    }

    /// The L1 move cut short after each of its writes in turn: the image
    /// checks without corruption (leaks at most) and reads as before,
    /// through the old table or the new one; uncut, the new table
    /// addresses the new size.
    #[test]
    fn a_move_cut_short_anywhere_leaves_the_image_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (pristine, want) = pristine(dir.path());
        let work = dir.path().join("work.qcow2");
        for cut in 0.. {
            std::fs::copy(&pristine, &work).unwrap();
            let storage = DiesAfter {
                file: open_rw(&work),
                left: AtomicUsize::new(cut),
            };
            let header = Header::read(&storage.file).unwrap();
            let entries = plan(&header, 3 << 30)
                .unwrap()
                .expect("the table must move");
            let done = move_table(&storage, &header, entries).is_ok();
            drop(storage);
            let report = assert_whole(&work, &want, cut);
            if done {
                let header = Header::read(&open_rw(&work)).unwrap();
                assert!(super::super::grows_in_place(&header, 3 << 30));
                assert_eq!(report.leaks, 0, "an uncut move leaks nothing");
                assert!(cut > 2, "the move wrote too little");
                break;
            }
        }
    }
}
