//! Consistency check and repair of one qcow2 image, like `qemu-img check`:
//! every reference from the metadata is counted and compared with the
//! refcounts on disk; `COPIED` flags of the active tables are verified.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use crate::bytes::{be_u32, be_u64};
use crate::entry::{
    CompressedDescriptor, COMPRESSED, COPIED, L1_RESERVED_MASK, L2_STD_RESERVED_MASK, OFFSET_MASK,
    REFT_OFFSET_MASK, REFT_RESERVED_MASK,
};
use crate::error::{Error, ErrorKind};
use crate::extension::HeaderExtension;
use crate::header::Header;
use crate::lock::{LockRequest, Locking};
use crate::refcount::{get_entry, max_refcount, set_entry, Refcounts};
use crate::snapshot::read_snapshot_table;
use crate::storage::{FileStorage, Storage};

/// What to repair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair {
    /// Only report.
    None,
    /// Drop leaked references.
    Leaks,
    /// Fix leaks, refcounts that are too low and `COPIED` flags.
    All,
}

/// Result of a check, with `qemu-img check`'s JSON field names.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct CheckReport {
    /// The image checked.
    pub filename: String,
    /// Always `qcow2`.
    pub format: &'static str,
    /// Errors that may mean lost or wrong data.
    pub corruptions: u64,
    /// Clusters counted but not referenced.
    pub leaks: u64,
    /// Errors that stopped the check from completing.
    pub check_errors: u64,
    /// Corruptions repaired.
    pub corruptions_fixed: u64,
    /// Leaks repaired.
    pub leaks_fixed: u64,
    /// Byte offset after the last used cluster.
    pub image_end_offset: u64,
    /// Guest clusters of the virtual disk.
    pub total_clusters: u64,
    /// Guest clusters allocated in the active volume.
    pub allocated_clusters: u64,
    /// Allocated guest clusters not following their predecessor on disk.
    pub fragmented_clusters: u64,
    /// Compressed guest clusters.
    pub compressed_clusters: u64,
    /// One line per problem found, the first [`MAX_MESSAGES`] of them
    /// (then one line saying how many more).
    #[serde(skip)]
    pub messages: Vec<String>,
}

/// Problem lines kept in a report: a hostile image can have millions of
/// problems, and their text must not exhaust memory.
pub const MAX_MESSAGES: usize = 10_000;

impl CheckReport {
    /// Records a problem line, or counts it once [`MAX_MESSAGES`] are kept.
    fn note(&mut self, line: String) {
        match self.messages.len() {
            n if n < MAX_MESSAGES => self.messages.push(line),
            n if n == MAX_MESSAGES => self.messages.push("... and more problems".into()),
            _ => {}
        }
    }
}

impl CheckReport {
    /// `qemu-img check`'s exit code: 0 clean, 2 corruptions, 3 leaks only,
    /// 1 check errors.
    pub fn exit_code(&self) -> i32 {
        if self.check_errors > 0 {
            1
        } else if self.corruptions > 0 {
            2
        } else if self.leaks > 0 {
            3
        } else {
            0
        }
    }
}

/// Everything the metadata references, counted per host cluster.
struct Census {
    cluster_bits: u32,
    file_size: u64,
    counts: HashMap<u64, u64>,
    report: CheckReport,
    /// Active L1 entries and L2 entries whose COPIED flag must be checked:
    /// (where the entry lives on disk, entry value, referenced cluster).
    copied: Vec<(u64, u64, u64)>,
}

impl Census {
    /// Clusters the file holds (a partial last one included).
    fn clusters_in_file(&self) -> u64 {
        self.file_size.div_ceil(1 << self.cluster_bits)
    }

    fn corrupt(&mut self, msg: String) {
        self.report.corruptions += 1;
        self.report.note(format!("ERROR {msg}"));
    }

    fn add_cluster(&mut self, idx: u64, what: &str) {
        if (idx << self.cluster_bits) >= self.file_size {
            self.corrupt(format!(
                "{what} cluster {idx} is beyond the end of the file"
            ));
            return;
        }
        *self.counts.entry(idx).or_insert(0) += 1;
    }

    /// Counts the clusters of `[offset, offset + len)`; a range reaching
    /// past the end of the file is one problem (not one per cluster: a
    /// hostile size must not drive the work or the report).
    fn add_range(&mut self, offset: u64, len: u64, what: &str) {
        if len == 0 {
            return;
        }
        let first = offset >> self.cluster_bits;
        let last = offset.saturating_add(len - 1) >> self.cluster_bits;
        let in_file = self.clusters_in_file();
        if last >= in_file {
            self.corrupt(format!(
                "{what} at {offset:#x} ({len} bytes) extends beyond the end of the file"
            ));
        }
        for c in first..=last.min(in_file.saturating_sub(1)) {
            self.add_cluster(c, what);
        }
    }
}

/// Reads a table of big-endian `u64`s that must lie inside the file
/// (`None` otherwise, so that hostile sizes never drive an allocation).
fn read_table(
    storage: &dyn Storage,
    offset: u64,
    entries: u64,
) -> Result<Option<Vec<u64>>, ErrorKind> {
    let len = entries.checked_mul(8);
    if len
        .and_then(|l| offset.checked_add(l))
        .is_none_or(|end| end > storage.len().unwrap_or(0))
    {
        return Ok(None);
    }
    let mut raw = vec![0u8; (entries * 8) as usize];
    storage.read_at(&mut raw, offset)?;
    Ok(Some(raw.chunks_exact(8).map(|c| be_u64(c, 0)).collect()))
}

/// Counts one L1 table and the L2 tables and data it references.
fn count_l1(
    census: &mut Census,
    header: &Header,
    storage: &dyn Storage,
    l1_offset: u64,
    l1_size: u32,
    active: bool,
) -> Result<(), ErrorKind> {
    let g = header.geometry;
    let cs = g.cluster_size();
    let Some(l1) = read_table(storage, l1_offset, u64::from(l1_size))? else {
        census.corrupt(format!(
            "L1 table at {l1_offset:#x} ({l1_size} entries) lies outside the file"
        ));
        return Ok(());
    };
    let words = if g.extended_l2 { 2 } else { 1 };
    for (i, &l1e) in l1.iter().enumerate() {
        let l2 = l1e & OFFSET_MASK;
        if l2 == 0 {
            continue;
        }
        if l1e & L1_RESERVED_MASK != 0 {
            census.corrupt(format!("L1 entry {i} has reserved bits set: {l1e:#x}"));
        }
        if l2 % cs != 0 {
            census.corrupt(format!("L2 table offset {l2:#x} is not cluster aligned"));
            continue;
        }
        if l2 + cs > census.file_size {
            census.corrupt(format!("L2 table at {l2:#x} is beyond the end of the file"));
            continue;
        }
        census.add_cluster(l2 / cs, "L2 table");
        if active {
            census.copied.push((l1_offset + i as u64 * 8, l1e, l2 / cs));
        }
        let Some(table) = read_table(storage, l2, cs / 8)? else {
            continue;
        };
        // Fragmentation as QEMU counts it: within each L2 table, a data
        // cluster not right after the one before; every compressed one.
        let mut prev_host: Option<u64> = None;
        for (j, pair) in table.chunks_exact(words).enumerate() {
            let (e, bitmap) = (pair[0], if words == 2 { pair[1] } else { 0 });
            let entry_pos = l2 + (j * words) as u64 * 8;
            let guest_cluster = i as u64 * g.l2_entries() + j as u64;
            if e & COMPRESSED != 0 {
                let d = CompressedDescriptor::decode(e, g);
                if g.extended_l2 && bitmap != 0 {
                    census.corrupt(format!(
                        "compressed cluster {guest_cluster} has a subcluster bitmap"
                    ));
                }
                census.add_range(d.offset.0, d.len, "compressed data");
                if active && guest_cluster * cs < header.virtual_size() {
                    census.report.allocated_clusters += 1;
                    census.report.compressed_clusters += 1;
                    census.report.fragmented_clusters += 1;
                }
                continue;
            }
            if e & L2_STD_RESERVED_MASK != 0 {
                census.corrupt(format!(
                    "L2 entry {entry_pos:#x} has reserved bits set: {e:#x}"
                ));
            }
            let host = e & OFFSET_MASK;
            if g.extended_l2 {
                let (alloc, zero) = (bitmap & 0xffff_ffff, bitmap >> 32);
                if alloc & zero != 0 || (host == 0 && alloc != 0) {
                    census.corrupt(format!(
                        "invalid subcluster bitmap {bitmap:#x} at {entry_pos:#x}"
                    ));
                }
            }
            if host == 0 {
                continue;
            }
            if host % cs != 0 {
                census.corrupt(format!(
                    "data cluster offset {host:#x} is not cluster aligned"
                ));
                continue;
            }
            census.add_cluster(host / cs, "data");
            if active {
                census.copied.push((entry_pos, e, host / cs));
                if guest_cluster * cs < header.virtual_size() {
                    census.report.allocated_clusters += 1;
                    if prev_host.is_some_and(|p| p + cs != host) {
                        census.report.fragmented_clusters += 1;
                    }
                    prev_host = Some(host);
                }
            }
        }
    }
    Ok(())
}

/// Counts every reference except those of the refcount structures.
fn census(header: &Header, storage: &dyn Storage, path: &Path) -> Result<Census, ErrorKind> {
    let g = header.geometry;
    let cs = g.cluster_size();
    let file_size = storage.len()?;
    let mut census = Census {
        cluster_bits: g.cluster_bits,
        file_size,
        counts: HashMap::new(),
        report: CheckReport {
            filename: path.display().to_string(),
            format: "qcow2",
            total_clusters: header.virtual_size().div_ceil(cs),
            ..CheckReport::default()
        },
        copied: Vec::new(),
    };
    census.add_cluster(0, "header");
    census.add_range(
        header.l1_table_offset,
        u64::from(header.l1_size) * 8,
        "L1 table",
    );
    count_l1(
        &mut census,
        header,
        storage,
        header.l1_table_offset,
        header.l1_size,
        true,
    )?;
    let snapshots = read_snapshot_table(header, storage)?;
    census.add_range(header.snapshots_offset, snapshots.len, "snapshot table");
    for snap in &snapshots.snapshots {
        census.add_range(
            snap.l1_table_offset,
            u64::from(snap.l1_size) * 8,
            "snapshot L1 table",
        );
        count_l1(
            &mut census,
            header,
            storage,
            snap.l1_table_offset,
            snap.l1_size,
            false,
        )?;
    }
    if header.has_bitmaps() {
        count_bitmaps(&mut census, header, storage)?;
    }
    Ok(census)
}

/// Counts the bitmap directory, bitmap tables and bitmap data clusters.
fn count_bitmaps(
    census: &mut Census,
    header: &Header,
    storage: &dyn Storage,
) -> Result<(), ErrorKind> {
    let Some(ext) = header.extensions.iter().find_map(|e| match e {
        HeaderExtension::Bitmaps(b) => Some(b.clone()),
        _ => None,
    }) else {
        return Ok(());
    };
    census.add_range(ext.directory_offset, ext.directory_size, "bitmap directory");
    if ext.directory_offset.saturating_add(ext.directory_size) > census.file_size {
        census.corrupt("bitmap directory lies outside the file".into());
        return Ok(());
    }
    let mut dir = vec![0u8; ext.directory_size as usize];
    storage.read_at(&mut dir, ext.directory_offset)?;
    let mut pos = 0usize;
    for _ in 0..ext.nb_bitmaps {
        if pos + 24 > dir.len() {
            census.corrupt("bitmap directory entry beyond the directory".into());
            break;
        }
        let table_offset = be_u64(&dir, pos);
        let table_size = u64::from(be_u32(&dir, pos + 8));
        let name_size = u64::from(u16::from_be_bytes([dir[pos + 18], dir[pos + 19]]));
        let extra = u64::from(be_u32(&dir, pos + 20));
        census.add_range(table_offset, table_size * 8, "bitmap table");
        let Some(table) = read_table(storage, table_offset, table_size)? else {
            census.corrupt(format!(
                "bitmap table at {table_offset:#x} lies outside the file"
            ));
            break;
        };
        for e in table {
            let off = e & OFFSET_MASK;
            if off != 0 {
                census.add_cluster(off >> census.cluster_bits, "bitmap data");
            }
        }
        pos += (24 + extra + name_size).div_ceil(8) as usize * 8;
    }
    Ok(())
}

/// The refcount blocks a check reads.
struct RefcountBlocks {
    /// The valid blocks: (block index, offset).
    valid: Vec<(u64, u64)>,
    /// Blocks whose table entry points outside the file or off a cluster
    /// boundary: no refcount they hold can be read.
    unreadable: std::collections::HashSet<u64>,
}

/// Counts the refcount table and blocks as the header describes them.
fn count_refcount_structures(
    census: &mut Census,
    header: &Header,
    storage: &dyn Storage,
) -> Result<RefcountBlocks, ErrorKind> {
    let cs = header.geometry.cluster_size();
    census.add_range(
        header.refcount_table_offset,
        u64::from(header.refcount_table_clusters) * cs,
        "refcount table",
    );
    let Some(table) = read_table(
        storage,
        header.refcount_table_offset,
        u64::from(header.refcount_table_clusters) * cs / 8,
    )?
    else {
        return Ok(RefcountBlocks {
            valid: Vec::new(),
            unreadable: Default::default(),
        });
    };
    let mut blocks = Vec::new();
    let mut unreadable = std::collections::HashSet::new();
    // As `qemu-img check` judges each entry.
    let in_file = census.clusters_in_file();
    for (i, &e) in table.iter().enumerate() {
        if e & REFT_RESERVED_MASK != 0 {
            census.corrupt(format!("refcount table entry {i} has reserved bits set"));
            continue;
        }
        let off = e & REFT_OFFSET_MASK;
        if off % cs != 0 {
            census.corrupt(format!(
                "refcount block {i} is not cluster aligned; refcount table entry corrupted"
            ));
            unreadable.insert(i as u64);
            continue;
        }
        if off / cs >= in_file {
            census.corrupt(format!("refcount block {i} is outside image"));
            unreadable.insert(i as u64);
            continue;
        }
        if off == 0 {
            continue;
        }
        census.add_cluster(off / cs, "refcount block");
        blocks.push((i as u64, off));
    }
    Ok(RefcountBlocks {
        valid: blocks,
        unreadable,
    })
}

/// Checks (and repairs) the image at `path`.
/// Image locks are taken as QEMU's `qemu-img check` takes them: a reader's
/// (a writer's with a repair); `force_share` only without one.
pub fn check(
    path: &Path,
    repair: Repair,
    locking: Locking,
    force_share: bool,
) -> Result<CheckReport, Error> {
    let e = |k: ErrorKind| Error::new(path, k);
    // Its directory opened once: the image opened by name in it, its
    // journal read (and, repaired, removed) there.
    let place = crate::sidefile::ImagePlace::of(path).map_err(|io| e(io.into()))?;
    let (storage, lock) = if repair == Repair::None {
        let s = FileStorage::from_file(place.open_image(false).map_err(|io| e(io.into()))?);
        let lock = if force_share {
            LockRequest::READER.sharing_all()
        } else {
            LockRequest::READER
        };
        (s, lock)
    } else {
        if force_share {
            return Err(e(ErrorKind::ForceShareWritable));
        }
        let s = place
            .open_image(true)
            .and_then(FileStorage::from_writable_file)
            .map_err(|io| e(io.into()))?;
        (s, LockRequest::WRITER)
    };
    storage.lock(lock, locking).map_err(e)?;
    check_opened(&place, storage, repair)
}

/// [`check`] of the image at `place`, open (and locked) in `storage`:
/// writable for a repair.
pub(crate) fn check_opened(
    place: &crate::sidefile::ImagePlace,
    storage: FileStorage,
    repair: Repair,
) -> Result<CheckReport, Error> {
    let path = &place.path();
    let e = |k: ErrorKind| Error::new(path, k);
    // A writer that died leaves the mappings of its last completed writes
    // in its journal: a full repair applies them first, as a read-write
    // open would (then QEMU, which does not know the journal, reads them
    // too); otherwise the report says they are not counted.
    let mut notes = Vec::new();
    if repair == Repair::All {
        let applied = crate::active::replay_journal(place, &storage).map_err(e)?;
        crate::active::end_journal(place, &storage).map_err(e)?;
        if applied > 0 {
            notes.push(format!(
                "Applied {applied} mapping changes from the journal of a writer that did not close the image"
            ));
        }
    } else if let Some(n) = Header::read_for_check(&storage)
        .ok()
        .and_then(|h| crate::active::pending_journal(place, storage.file_id(), &h))
        .filter(|n| *n > 0)
    {
        notes.push(format!(
            "{n} mapping changes of a writer that did not close the image are in its journal, not yet in the tables: this report is without them (a read-write open or `check -r all` applies them)"
        ));
    }
    let storage = Arc::new(storage);
    let mut report = check_storage(path, storage.clone(), repair)?;
    if repair != Repair::None && report.corruptions == 0 && report.check_errors == 0 {
        // Consistent now: clean, as qemu-img check -r leaves it.
        mark_clean(&*storage).map_err(e)?;
    }
    report.messages.splice(0..0, notes);
    Ok(report)
}

/// Clears the dirty bit and the corrupt mark of the image in `storage`
/// where set (synced), as QEMU marks a repaired image clean and
/// consistent.
fn mark_clean(storage: &dyn Storage) -> Result<(), ErrorKind> {
    let header = Header::read_for_check(storage)?;
    if header.is_dirty() || header.is_marked_corrupt() {
        let clean = header.features.incompatible
            & !(crate::features::INCOMPAT_DIRTY | crate::features::INCOMPAT_CORRUPT);
        crate::header_area::write_word(
            storage,
            crate::header::field::INCOMPATIBLE_FEATURES,
            clean,
        )?;
    }
    Ok(())
}

/// [`check`] on already opened storage.
pub fn check_storage(
    path: &Path,
    storage: Arc<dyn Storage>,
    repair: Repair,
) -> Result<CheckReport, Error> {
    let e = |k: ErrorKind| Error::new(path, k);
    let header = Header::read_for_check(&*storage).map_err(e)?;
    let first = run_check(path, &header, &*storage).map_err(e)?;
    if repair == Repair::None || (first.report.corruptions == 0 && first.report.leaks == 0) {
        return Ok(first.report);
    }
    if repair == Repair::Leaks && first.mismatches.iter().any(|&(_, v, e)| v < e) {
        // Refcounts too low can only be rebuilt (`-r all`): as QEMU, fix
        // nothing and fail the check.
        let mut report = first.report;
        report.check_errors += 1;
        report.note("ERROR need to rebuild refcount structures".into());
        return Ok(report);
    }
    let (leaks, corruptions) = (first.report.leaks, first.report.corruptions);
    apply_repair(&header, &*storage, first, repair).map_err(e)?;
    // Double-check the result, as qemu-img does.
    let header = Header::read_for_check(&*storage).map_err(e)?;
    let mut after = run_check(path, &header, &*storage).map_err(e)?.report;
    after.leaks_fixed = leaks.saturating_sub(after.leaks);
    after.corruptions_fixed = corruptions.saturating_sub(after.corruptions);
    Ok(after)
}

struct Checked {
    report: CheckReport,
    counts: HashMap<u64, u64>,
    /// Clusters whose refcount on disk differs: (cluster, on disk, expected).
    mismatches: Vec<(u64, u64, u64)>,
    copied: Vec<(u64, u64, u64)>,
}

fn run_check(path: &Path, header: &Header, storage: &dyn Storage) -> Result<Checked, ErrorKind> {
    let mut census = census(header, storage, path)?;
    let blocks = count_refcount_structures(&mut census, header, storage)?;
    let g = header.geometry;
    let cs = g.cluster_size();
    let order = header.refcount_order;
    let block_entries = (cs * 8) >> order;
    // Compare every entry of every valid block (they lie inside the file,
    // so this is bounded by its size) for the clusters of the file (as
    // QEMU: a refcount past its end is no leak), then the references no
    // block covers.
    let in_file = census.clusters_in_file();
    let mut on_disk: HashMap<u64, u64> = HashMap::new();
    let mut block = vec![0u8; cs as usize];
    let mut covered = std::collections::HashSet::new();
    for &(bi, offset) in &blocks.valid {
        storage.read_at(&mut block, offset)?;
        covered.insert(bi);
        for i in 0..block_entries {
            let v = get_entry(&block, order, i as usize);
            if v != 0 {
                on_disk.insert(bi * block_entries + i, v);
            }
        }
    }
    let mut mismatches = Vec::new();
    for (&idx, &v) in on_disk.iter().filter(|(&idx, _)| idx < in_file) {
        let expected = census.counts.get(&idx).copied().unwrap_or(0);
        if v != expected {
            mismatches.push((idx, v, expected));
        }
    }
    let block_bits = g.cluster_bits + 3 - order;
    for (&idx, &expected) in &census.counts {
        // A refcount that cannot be read is not a wrong one (below).
        if !on_disk.contains_key(&idx) && !blocks.unreadable.contains(&(idx >> block_bits)) {
            mismatches.push((idx, 0, expected));
        }
    }
    // As QEMU, which reads the refcount of every cluster of the file.
    let mut unreadable: Vec<u64> = blocks.unreadable.iter().copied().collect();
    unreadable.sort_unstable();
    for bi in unreadable {
        for idx in (bi << block_bits)..((bi + 1) << block_bits).min(in_file) {
            census.report.check_errors += 1;
            census.report.note(format!(
                "Can't get refcount for cluster {idx}: Input/output error"
            ));
        }
    }
    mismatches.sort_unstable();
    for &(idx, v, expected) in &mismatches {
        if v > expected {
            census.report.leaks += 1;
            census.report.note(format!(
                "Leaked cluster {idx} refcount={v} reference={expected}"
            ));
        } else {
            census.corrupt(format!("cluster {idx} refcount={v} reference={expected}"));
        }
    }
    let copied = std::mem::take(&mut census.copied);
    for &(pos, entry, cluster) in &copied {
        if blocks.unreadable.contains(&(cluster >> block_bits)) {
            continue;
        }
        // A refcount of 0 under a COPIED flag too (QEMU counts both that
        // and the refcount itself).
        let rc = on_disk.get(&cluster).copied().unwrap_or(0);
        if (rc == 1) != (entry & COPIED != 0) {
            census.corrupt(format!(
                "OFLAG_COPIED mismatch: entry {entry:#x} at {pos:#x}, refcount={rc}"
            ));
        }
    }
    // As QEMU: the last cluster referenced or with a refcount on disk (a
    // leaked cluster at the end counts).
    let highest = census
        .counts
        .keys()
        .chain(
            on_disk
                .iter()
                .filter(|(&idx, &v)| v > 0 && idx < in_file)
                .map(|(idx, _)| idx),
        )
        .max()
        .copied()
        .unwrap_or(0);
    census.report.image_end_offset = (highest + 1) << g.cluster_bits;
    Ok(Checked {
        report: census.report,
        counts: census.counts,
        mismatches,
        copied,
    })
}

/// Repairs what `checked` found.
fn apply_repair(
    header: &Header,
    storage: &dyn Storage,
    checked: Checked,
    repair: Repair,
) -> Result<(), ErrorKind> {
    let too_low = checked.mismatches.iter().any(|&(_, v, e)| v < e);
    if repair == Repair::All && (too_low || checked.report.corruptions > 0) {
        rebuild_refcounts(header, storage)?;
        fix_copied_flags(storage, &checked)?;
        storage.sync()?;
        return Ok(());
    }
    // Leaks only: lower refcounts in place.
    let g = header.geometry;
    let mut refcounts = Refcounts::load(
        storage,
        header.refcount_order,
        g.cluster_bits,
        header.refcount_table_offset,
        header.refcount_table_clusters,
    )?;
    for &(idx, v, expected) in &checked.mismatches {
        if v > expected {
            refcounts.set_value(storage, idx, expected)?;
        }
    }
    refcounts.write_blocks(storage)?;
    storage.sync()?;
    Ok(())
}

/// Sets each active entry's COPIED flag to match its repaired refcount.
fn fix_copied_flags(storage: &dyn Storage, checked: &Checked) -> Result<(), ErrorKind> {
    for &(pos, entry, cluster) in &checked.copied {
        let rc = checked.counts.get(&cluster).copied().unwrap_or(0);
        let want = if rc == 1 {
            entry | COPIED
        } else {
            entry & !COPIED
        };
        if want != entry {
            storage.write_at(&want.to_be_bytes(), pos)?;
        }
    }
    Ok(())
}

/// Writes a fresh refcount table and blocks at the end of the file, computed
/// from the metadata alone, then points the header at them. The old
/// structures become free space. A crash before the header update leaves
/// the old ones in force.
pub(crate) fn rebuild_refcounts(header: &Header, storage: &dyn Storage) -> Result<(), ErrorKind> {
    let (table_offset, table) = write_refcounts(header, storage, header.refcount_order)?;
    let mut field = [0u8; 12];
    field[..8].copy_from_slice(&table_offset.to_be_bytes());
    field[8..].copy_from_slice(&table.to_be_bytes());
    storage.write_at(&field, 48)?;
    storage.sync()?;
    Ok(())
}

/// Writes a fresh refcount table and blocks of `order` at the end of the
/// file, computed from the metadata alone, and syncs; where the table is
/// and its clusters, for the caller to point the header at.
pub(crate) fn write_refcounts(
    header: &Header,
    storage: &dyn Storage,
    order: u32,
) -> Result<(u64, u32), ErrorKind> {
    let g = header.geometry;
    let cs = g.cluster_size();
    let census = census(header, storage, Path::new(""))?;
    let mut counts = census.counts;
    let block_entries = (cs * 8) >> order;
    let highest = counts.keys().max().map_or(0, |m| m + 1);
    let start = (storage.len()?.div_ceil(cs)).max(highest);
    let (blocks, table) = crate::refcount::structures_after(start, cs, order);
    if table * cs > crate::header::MAX_REFTABLE_BYTES {
        return Err(ErrorKind::TableTooLarge {
            table: crate::error::Table::Refcount,
            entries: table * cs / 8,
            max: crate::header::MAX_REFTABLE_BYTES / 8,
        });
    }
    for c in start..start + blocks + table {
        *counts.entry(c).or_insert(0) += 1;
    }
    let max = max_refcount(order);
    let mut table_bytes = vec![0u8; (table * cs) as usize];
    for b in 0..blocks {
        let mut block = vec![0u8; cs as usize];
        for i in 0..block_entries {
            let c = b * block_entries + i;
            let v = counts.get(&c).copied().unwrap_or(0);
            if v > max {
                return Err(ErrorKind::InvalidHeader {
                    field: "refcount_order",
                    reason: format!("cluster {c} needs refcount {v}, more than {max}"),
                });
            }
            set_entry(&mut block, order, i as usize, v);
        }
        let at = (start + b) * cs;
        storage.write_at(&block, at)?;
        table_bytes[(b * 8) as usize..(b * 8 + 8) as usize].copy_from_slice(&at.to_be_bytes());
    }
    let table_offset = (start + blocks) * cs;
    storage.write_at(&table_bytes, table_offset)?;
    storage.sync()?;
    Ok((table_offset, table as u32))
}
