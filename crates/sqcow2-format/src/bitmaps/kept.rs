//! The persistent bitmaps a writer of an image keeps, as QEMU keeps them
//! (`block/qcow2-bitmap.c`): loaded when the image is opened for writing
//! and marked in use in the image at once, set by every write,
//! write-zeroes and discard while enabled, stored back (and no longer in
//! use) when the writer closes. A bitmap in use when opened (its last
//! writer died) is inconsistent: never changed, left in use.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use crate::bitmaps::directory::{
    bitmaps_extension, read_directory, BitmapEntry, GRANULARITY_BITS, MAX_NAME,
};
use crate::bitmaps::dirty_bits::DirtyBits;
use crate::bitmaps::table::{data_clusters, read_table, read_words};
use crate::error::ErrorKind;
use crate::extension::BitmapsExtension;
use crate::header::Header;
use crate::storage::Storage;

/// Where a stored bitmap's table is, and the data clusters it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredTable {
    /// The table's offset.
    pub(crate) offset: u64,
    /// Its entries.
    pub(crate) size: u32,
    /// The data clusters its entries name (cluster indexes).
    pub(crate) data: Vec<u64>,
}

/// One bitmap kept by a writer.
#[derive(Debug)]
pub(crate) struct KeptBitmap {
    pub(crate) name: String,
    pub(crate) granularity_bits: u8,
    /// Tracks writes (QEMU's "auto" flag).
    enabled: AtomicBool,
    /// `None`: inconsistent (in use when the image was opened).
    pub(crate) bits: Option<DirtyBits>,
    /// Its table in the image, if it was ever stored.
    pub(crate) stored: Mutex<Option<StoredTable>>,
    /// Its bits or flags changed since they were last stored.
    changed: AtomicBool,
}

impl KeptBitmap {
    pub(crate) fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Takes the "changed since stored" mark.
    pub(crate) fn take_changed(&self) -> bool {
        // Sequentially consistent, as the bits and the in-use state: a
        // store that finds it clear saw no mark in flight.
        self.changed.swap(false, Ordering::SeqCst)
    }

    /// Marks it changed (again, after a failed store).
    pub(crate) fn set_changed(&self) {
        self.changed.store(true, Ordering::SeqCst);
    }

    pub(crate) fn stored(&self) -> MutexGuard<'_, Option<StoredTable>> {
        self.stored.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Its directory entry for `table` (flags as they must read).
    pub(crate) fn entry(&self, table: &StoredTable, in_use: bool) -> BitmapEntry {
        BitmapEntry {
            table_offset: table.offset,
            table_size: table.size,
            in_use,
            auto: self.is_enabled(),
            granularity_bits: self.granularity_bits,
            name: self.name.clone(),
        }
    }
}

/// Whether the image says the kept bitmaps are in use.
const IN_USE: u8 = 0;
/// Stored: the image holds them as consistent; a change must mark them
/// in use first.
const STORED: u8 = 1;

/// The bitmaps a writer keeps.
#[derive(Debug)]
pub(crate) struct KeptBitmaps {
    list: RwLock<Vec<Arc<KeptBitmap>>>,
    /// Some bitmap is enabled and consistent: writes mark.
    marking: AtomicBool,
    /// [`IN_USE`] or [`STORED`].
    on_disk: AtomicU8,
    /// The directory in the image (its extension), if any.
    directory: Mutex<Option<BitmapsExtension>>,
    /// Removed since the last store: their tables are freed by it.
    removed: Mutex<Vec<Arc<KeptBitmap>>>,
    /// Held across every edit of the image's bitmaps (a store, marking
    /// them in use again): I/O under it on purpose, as those steps must
    /// not interleave.
    edit: Mutex<()>,
}

/// An error reading the bitmaps, or a request that makes no sense.
pub(crate) type BitmapResult<T> = Result<T, ErrorKind>;

impl KeptBitmaps {
    /// Loads the bitmaps of an image opened for writing (consistent ones
    /// with their bits) and marks the consistent ones in use in the image,
    /// in place, as QEMU does: the autoclear bit cleared, the directory
    /// rewritten, the bit set again, each step synced. `header` is the
    /// header as in the file now.
    pub(crate) fn open(header: &Header, storage: &dyn Storage) -> BitmapResult<KeptBitmaps> {
        let entries = read_directory(header, storage)?;
        let cluster_bits = header.geometry.cluster_bits;
        let mut list = Vec::with_capacity(entries.len());
        for e in &entries {
            let bits = if e.in_use {
                None
            } else {
                let words = read_words(header, storage, e)?;
                Some(DirtyBits::from_words(
                    e.granularity_bits,
                    header.size,
                    &words,
                ))
            };
            let data = read_table(header, storage, e)?
                .into_iter()
                .map(|off| off >> cluster_bits)
                .collect();
            list.push(Arc::new(KeptBitmap {
                name: e.name.clone(),
                granularity_bits: e.granularity_bits,
                enabled: AtomicBool::new(e.auto),
                bits,
                stored: Mutex::new(Some(StoredTable {
                    offset: e.table_offset,
                    size: e.table_size,
                    data,
                })),
                changed: AtomicBool::new(false),
            }));
        }
        let kept = KeptBitmaps {
            marking: AtomicBool::new(false),
            on_disk: AtomicU8::new(IN_USE),
            directory: Mutex::new(
                bitmaps_extension(header)
                    .filter(|_| !entries.is_empty())
                    .cloned(),
            ),
            edit: Mutex::new(()),
            removed: Mutex::new(Vec::new()),
            list: RwLock::new(list),
        };
        kept.update_marking();
        if entries.iter().any(|e| !e.in_use) {
            let in_use: Vec<BitmapEntry> = entries
                .into_iter()
                .map(|e| BitmapEntry { in_use: true, ..e })
                .collect();
            write_directory_in_place(storage, header, header.features.autoclear, &in_use)?;
        }
        Ok(kept)
    }

    fn update_marking(&self) {
        let any = self
            .read_list()
            .iter()
            .any(|b| b.bits.is_some() && b.is_enabled());
        self.marking.store(any, Ordering::Release);
    }

    fn read_list(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<KeptBitmap>>> {
        self.list.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The bitmaps kept, in directory order.
    pub(crate) fn list(&self) -> Vec<Arc<KeptBitmap>> {
        self.read_list().clone()
    }

    /// Whether the image holds any bitmap or any is kept.
    pub(crate) fn is_empty(&self) -> bool {
        self.read_list().is_empty() && self.directory().is_none()
    }

    /// The directory in the image.
    pub(crate) fn directory(&self) -> Option<BitmapsExtension> {
        self.directory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn set_directory(&self, ext: Option<BitmapsExtension>) {
        *self
            .directory
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = ext;
    }

    /// Held across an edit of the image's bitmaps.
    pub(crate) fn edit(&self) -> MutexGuard<'_, ()> {
        self.edit.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the bits of every enabled, consistent bitmap for a guest change
    /// of `[offset, offset + len)`; whether the image says they are in use
    /// (if not, [`KeptBitmaps::mark_in_use`] must run before the change
    /// reaches the image). The marks come first: a store that set
    /// [`STORED`] after this read [`IN_USE`] sees them.
    pub(crate) fn mark(&self, offset: u64, len: u64) -> bool {
        if self.marking.load(Ordering::Acquire) {
            for b in self.read_list().iter() {
                if let (Some(bits), true) = (&b.bits, b.is_enabled()) {
                    bits.mark(offset, len);
                    b.set_changed();
                }
            }
        }
        self.on_disk.load(Ordering::SeqCst) == IN_USE
    }

    /// Whether the image says the bitmaps are in use (or there are none).
    pub(crate) fn in_use(&self) -> bool {
        self.on_disk.load(Ordering::SeqCst) == IN_USE
    }

    /// Before a store: changes from now on must mark the bitmaps in use
    /// again first.
    pub(crate) fn storing(&self) {
        self.on_disk.store(STORED, Ordering::SeqCst);
    }

    /// Marks the stored, consistent bitmaps in use again in the image (in
    /// place), after a store, before a change reaches the image. Call
    /// with [`KeptBitmaps::edit`] held; `header` as in the file now.
    pub(crate) fn mark_in_use(
        &self,
        header: &Header,
        autoclear: u64,
        storage: &dyn Storage,
    ) -> BitmapResult<()> {
        if self.on_disk.load(Ordering::SeqCst) == IN_USE {
            return Ok(());
        }
        let entries: Vec<BitmapEntry> = read_directory(header, storage)?
            .into_iter()
            .map(|e| BitmapEntry { in_use: true, ..e })
            .collect();
        if !entries.is_empty() {
            write_directory_in_place(storage, header, autoclear, &entries)?;
        }
        self.on_disk.store(IN_USE, Ordering::SeqCst);
        Ok(())
    }

    /// Adds an empty bitmap (`qemu-img bitmap --add`), stored at the next
    /// store.
    pub(crate) fn add(
        &self,
        name: &str,
        granularity: u64,
        enabled: bool,
        size: u64,
        cluster_size: u64,
    ) -> BitmapResult<()> {
        check_name(name)?;
        let bits_log = granularity.trailing_zeros();
        let valid = granularity.is_power_of_two()
            && u8::try_from(bits_log).is_ok_and(|b| GRANULARITY_BITS.contains(&b));
        if !valid {
            return Err(ErrorKind::InvalidArgument(
                "Granularity must be power of 2 and at least 512".into(),
            ));
        }
        let granularity_bits = bits_log as u8;
        let bits = size.div_ceil(granularity);
        if data_clusters(bits, cluster_size) * cluster_size > 0x2000_0000 {
            return Err(ErrorKind::InvalidArgument(format!(
                "Too large bitmap '{name}': granularity {granularity} is too fine for the disk"
            )));
        }
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        if list.iter().any(|b| b.name == name) {
            return Err(ErrorKind::InvalidArgument(format!(
                "Bitmap already exists: {name}"
            )));
        }
        if list.len() >= 65535 {
            return Err(ErrorKind::InvalidArgument(
                "the image holds QEMU's most bitmaps already".into(),
            ));
        }
        list.push(Arc::new(KeptBitmap {
            name: name.to_owned(),
            granularity_bits,
            enabled: AtomicBool::new(enabled),
            bits: Some(DirtyBits::empty(granularity_bits, size)),
            stored: Mutex::new(None),
            changed: AtomicBool::new(true),
        }));
        drop(list);
        self.update_marking();
        Ok(())
    }

    /// Why the bitmaps cannot be resized with the disk: one is
    /// inconsistent (QEMU's words).
    pub(crate) fn check_resizable(&self) -> BitmapResult<()> {
        match self.read_list().iter().find(|b| b.bits.is_none()) {
            Some(b) => Err(ErrorKind::InvalidArgument(format!(
                "Bitmap '{}' is inconsistent and cannot be used\n\
                 Try block-dirty-bitmap-remove to delete this bitmap from disk",
                b.name
            ))),
            None => Ok(()),
        }
    }

    /// Resizes every bitmap with the disk, to `size` bytes (QEMU's
    /// `bdrv_dirty_bitmap_truncate`): the bits of granules past the new end
    /// dropped, new ones clear; each stored anew at the next store.
    /// Refused, nothing changed, if one is inconsistent (QEMU's check
    /// before a resize). Only with no guest change in flight.
    pub(crate) fn resize(&self, size: u64) -> BitmapResult<()> {
        let _edit = self.edit();
        self.check_resizable()?;
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        for b in list.iter_mut() {
            let resized = Arc::new(KeptBitmap {
                name: b.name.clone(),
                granularity_bits: b.granularity_bits,
                enabled: AtomicBool::new(b.is_enabled()),
                bits: b.bits.as_ref().map(|bits| bits.resized(size)),
                stored: Mutex::new(b.stored().clone()),
                changed: AtomicBool::new(true),
            });
            *b = resized;
        }
        Ok(())
    }

    /// The bitmap `name`.
    pub(crate) fn get(&self, name: &str) -> BitmapResult<Arc<KeptBitmap>> {
        self.read_list()
            .iter()
            .find(|b| b.name == name)
            .cloned()
            .ok_or_else(|| ErrorKind::InvalidArgument(format!("Dirty bitmap '{name}' not found")))
    }

    /// The bitmap `name`, refused if inconsistent (as QEMU refuses to use
    /// it).
    pub(crate) fn get_consistent(&self, name: &str) -> BitmapResult<Arc<KeptBitmap>> {
        let b = self.get(name)?;
        if b.bits.is_none() {
            return Err(ErrorKind::InvalidArgument(format!(
                "Bitmap '{name}' is inconsistent and cannot be used"
            )));
        }
        Ok(b)
    }

    /// Removes `name` from the kept set; its table is freed at the next
    /// store. Returns it.
    pub(crate) fn remove(&self, name: &str) -> BitmapResult<Arc<KeptBitmap>> {
        // Not while a store runs: it could write a directory naming the
        // table this frees.
        let _edit = self.edit();
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        let at = list.iter().position(|b| b.name == name).ok_or_else(|| {
            ErrorKind::InvalidArgument(format!("Dirty bitmap '{name}' not found"))
        })?;
        let b = list.remove(at);
        drop(list);
        self.update_marking();
        self.removed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(b.clone());
        Ok(b)
    }

    /// The bitmaps removed since the last store.
    pub(crate) fn take_removed(&self) -> Vec<Arc<KeptBitmap>> {
        std::mem::take(&mut *self.removed.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Clears every bit of `name`.
    pub(crate) fn clear(&self, name: &str) -> BitmapResult<()> {
        let b = self.get_consistent(name)?;
        if let Some(bits) = &b.bits {
            bits.clear();
        }
        b.set_changed();
        Ok(())
    }

    /// Enables or disables `name`.
    pub(crate) fn set_enabled(&self, name: &str, enabled: bool) -> BitmapResult<()> {
        let b = self.get_consistent(name)?;
        b.enabled.store(enabled, Ordering::Release);
        b.set_changed();
        self.update_marking();
        Ok(())
    }

    /// Sets in `name` the bits of every granule of `ranges`.
    pub(crate) fn merge_ranges(
        &self,
        name: &str,
        ranges: &[std::ops::Range<u64>],
    ) -> BitmapResult<()> {
        let b = self.get_consistent(name)?;
        if let Some(bits) = &b.bits {
            for r in ranges {
                bits.mark(r.start, r.end - r.start);
            }
        }
        b.set_changed();
        Ok(())
    }
}

/// QEMU's in-place directory update (`update_ext_header_and_dir_in_place`):
/// `entries` (the same names, so the same size) written over the
/// directory the header names, with the autoclear bit cleared meanwhile
/// so that a torn directory is never read as bitmaps; `autoclear` is the
/// header's word as in the file.
pub(crate) fn write_directory_in_place(
    storage: &dyn Storage,
    header: &Header,
    autoclear: u64,
    entries: &[BitmapEntry],
) -> BitmapResult<()> {
    use crate::features::AUTOCLEAR_BITMAPS;
    use crate::header::field::AUTOCLEAR_FEATURES;
    use crate::header_area::write_word;
    // Where the header read last says it is (not a cached location
    // a failed store may have left stale).
    let Some(ext) = bitmaps_extension(header) else {
        return Ok(());
    };
    let bytes = crate::bitmaps::directory::encode_directory(entries);
    if bytes.len() as u64 != ext.directory_size {
        return Err(ErrorKind::InvalidArgument(
            "the bitmap directory changed size".into(),
        ));
    }
    write_word(storage, AUTOCLEAR_FEATURES, autoclear & !AUTOCLEAR_BITMAPS)?;
    storage.write_at(&bytes, ext.directory_offset)?;
    storage.sync()?;
    write_word(storage, AUTOCLEAR_FEATURES, autoclear | AUTOCLEAR_BITMAPS)?;
    Ok(())
}

/// QEMU's rules for a bitmap name.
fn check_name(name: &str) -> BitmapResult<()> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(ErrorKind::InvalidArgument(format!(
            "Bitmap name must be 1 to {MAX_NAME} bytes long"
        )));
    }
    if name.contains('\0') {
        return Err(ErrorKind::InvalidArgument(
            "Bitmap name must not contain a NUL byte".into(),
        ));
    }
    Ok(())
}
