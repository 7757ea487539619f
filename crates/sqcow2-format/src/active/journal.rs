//! The mapping journal: how a completed change of the top's mappings
//! survives a death of this process without a sync on its way to
//! completion.
//!
//! The metadata writes of a change (an L2 entry and its bitmap, the L1
//! entry of a new table) are appended as records to a sidecar file,
//! `<top>.sqjournal`, before the change completes; the image's own L2 and
//! L1 tables are written later, by checkpoints (write-backs) that sync the
//! data first. A process death leaves both files in the page cache, which
//! survives it: the next read-write open on the same boot replays the
//! records the image does not hold yet. A power loss loses the page cache
//! and with it, perhaps, part of the journal and part of everything else:
//! the journal is then ignored (it names the boot that wrote it), and the
//! image is what its checkpoints made it, consistent in crash-safe order.
//!
//! While a journal is active the top carries the dirty bit and the
//! journal's autoclear bit: QEMU, or any writer that does not know the
//! journal, clears the autoclear bit when it opens the image for writing,
//! and a journal whose bit is gone is never replayed over what that writer
//! did. A replay ends with the refcount repair of a dirty image.
//!
//! Records have sequence numbers in the order their changes were made
//! (assigned under the metadata lock), and slots in a ring; a slot is
//! reused only once a checkpoint covers the record in it and no record
//! before it is still being written.

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use crate::sidefile::{Dir, FileId, ImagePlace};

/// Size of the header (the first page).
const HEADER: u64 = 4096;
/// Size of a record.
const RECORD: u64 = 64;
/// Records the ring holds (4 MiB).
pub(crate) const CAPACITY: u64 = 262144;
pub(crate) use crate::sidefile::JOURNAL_MAGIC as MAGIC;
const VERSION: u32 = 1;
const RECORD_MAGIC: &[u8; 4] = b"SQJR";
/// Where the header keeps the sequence number checkpoints have covered.
const APPLIED_AT: u64 = 72;

/// A metadata write of the top: one or two big-endian words at `offset`
/// (an L1 entry; an L2 entry, with its bitmap in extended L2 images).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MetadataWrite {
    pub(crate) offset: u64,
    pub(crate) words: [u64; 2],
    /// Words used (1 or 2).
    pub(crate) len: u8,
}

impl MetadataWrite {
    pub(crate) fn one(offset: u64, word: u64) -> Self {
        MetadataWrite {
            offset,
            words: [word, 0],
            len: 1,
        }
    }

    pub(crate) fn two(offset: u64, word: u64, bitmap: u64) -> Self {
        MetadataWrite {
            offset,
            words: [word, bitmap],
            len: 2,
        }
    }

    /// The bytes to write at `offset`.
    pub(crate) fn bytes(&self) -> Vec<u8> {
        self.words[..usize::from(self.len)]
            .iter()
            .flat_map(|w| w.to_be_bytes())
            .collect()
    }
}

/// Which records are being written and which a checkpoint covers.
#[derive(Debug, Default)]
struct Progress {
    /// The next sequence number.
    next: u64,
    /// Every record up to this one is in the image's tables (page cache).
    applied: u64,
    /// Reserved and not yet written (or given up).
    writing: BTreeSet<u64>,
}

/// An active journal.
#[derive(Debug)]
pub(crate) struct Journal {
    file: File,
    path: PathBuf,
    /// Where it is: removed from there by name, if still this file.
    dir: Arc<Dir>,
    name: std::ffi::OsString,
    id: FileId,
    epoch: u64,
    progress: Mutex<Progress>,
}

/// Records reserved for one change: they must be written
/// ([`Journal::write`]) before the change completes; dropped unwritten,
/// the reservation is given up (the change is then not journaled).
#[must_use = "reserved records must be written before the change completes"]
#[derive(Debug)]
pub(crate) struct Reservation {
    journal: Arc<Journal>,
    first: u64,
    writes: Vec<MetadataWrite>,
    done: bool,
}

/// This boot's identity (`/proc/sys/kernel/random/boot_id`).
pub(crate) fn boot_id() -> io::Result<[u8; 16]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let hex: String = text.trim().chars().filter(|c| *c != '-').collect();
    let mut id = [0u8; 16];
    if hex.len() != 32 {
        return Err(io::Error::other("malformed boot id"));
    }
    for (i, byte) in id.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|_| io::Error::other("malformed boot id"))?;
    }
    Ok(id)
}

/// Who wrote a journal: the boot, the top file (device, inode; zeros when
/// the storage is not a file) and the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    boot: [u8; 16],
    file: (u64, u64),
}

fn header_bytes(id: Identity, epoch: u64) -> Vec<u8> {
    let mut h = vec![0u8; HEADER as usize];
    h[0..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_be_bytes());
    h[12..16].copy_from_slice(&(RECORD as u32).to_be_bytes());
    h[16..24].copy_from_slice(&CAPACITY.to_be_bytes());
    h[24..40].copy_from_slice(&id.boot);
    h[40..48].copy_from_slice(&id.file.0.to_be_bytes());
    h[48..56].copy_from_slice(&id.file.1.to_be_bytes());
    h[56..64].copy_from_slice(&epoch.to_be_bytes());
    let crc = crc32c::crc32c(&h[0..64]);
    h[64..68].copy_from_slice(&crc.to_be_bytes());
    // applied (72..80) starts at 0.
    h
}

fn record_bytes(epoch: u64, seq: u64, w: &MetadataWrite) -> [u8; RECORD as usize] {
    let mut r = [0u8; RECORD as usize];
    r[0..4].copy_from_slice(RECORD_MAGIC);
    r[4] = w.len;
    r[8..16].copy_from_slice(&epoch.to_be_bytes());
    r[16..24].copy_from_slice(&seq.to_be_bytes());
    r[24..32].copy_from_slice(&w.offset.to_be_bytes());
    r[32..40].copy_from_slice(&w.words[0].to_be_bytes());
    r[40..48].copy_from_slice(&w.words[1].to_be_bytes());
    let crc = crc32c::crc32c(&r[0..60]);
    r[60..64].copy_from_slice(&crc.to_be_bytes());
    r
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

fn slot_offset(seq: u64) -> u64 {
    HEADER + (seq % CAPACITY) * RECORD
}

impl Journal {
    /// Starts a new, empty journal for the top at `top` (made exclusively,
    /// or over an old journal of sqcow2's, never through a symlink nor
    /// over another file: a layer of `below` or anything else there is
    /// refused, untouched). The caller then marks the image (dirty and
    /// journal bits, synced) before the first record counts.
    pub(crate) fn create(
        top: &ImagePlace,
        below: &[FileId],
        file_id: Option<(u64, u64)>,
    ) -> Result<Journal, crate::Error> {
        let name = top.journal();
        let path = top.dir().join(&name);
        let e = |io: io::Error| crate::Error::new(&path, io.into());
        let id = Identity {
            boot: boot_id().map_err(e)?,
            file: file_id.unwrap_or((0, 0)),
        };
        let epoch = fastrand::u64(1..);
        let (file, journal_id) = crate::sidefile::open_journal(
            top.dir(),
            &name,
            top.name(),
            below,
            &header_bytes(id, epoch),
        )?;
        Ok(Journal {
            file,
            path,
            dir: top.dir().clone(),
            name,
            id: journal_id,
            epoch,
            progress: Mutex::new(Progress {
                next: 1,
                applied: 0,
                writing: BTreeSet::new(),
            }),
        })
    }

    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves records for `writes`, numbered after every record reserved
    /// before (call under the metadata lock, so that the order is the order
    /// of the changes); `None` when the ring has no room until a
    /// checkpoint.
    pub(crate) fn reserve(self: &Arc<Self>, writes: Vec<MetadataWrite>) -> Option<Reservation> {
        let n = writes.len() as u64;
        let mut p = self.progress();
        // The oldest slot in use: a record not covered by a checkpoint, or
        // one still being written (covered or not).
        let oldest = p.writing.first().map_or(p.next, |s| *s).min(p.applied + 1);
        if p.next + n - oldest > CAPACITY {
            return None;
        }
        let first = p.next;
        p.next += n;
        p.writing.extend(first..first + n);
        Some(Reservation {
            journal: self.clone(),
            first,
            writes,
            done: false,
        })
    }

    /// Records reserved and not yet covered by a checkpoint.
    pub(crate) fn backlog(&self) -> u64 {
        let p = self.progress();
        p.next - 1 - p.applied
    }

    /// The last sequence number reserved.
    pub(crate) fn horizon(&self) -> u64 {
        self.progress().next - 1
    }

    /// Records that a checkpoint put every change up to `seq` in the
    /// image's tables (page cache): a replay skips those records, even one
    /// whose writer lands it later (its change is in the image already);
    /// its slot stays taken until it has landed ([`Journal::reserve`]).
    pub(crate) fn applied(&self, seq: u64) -> io::Result<()> {
        {
            let mut p = self.progress();
            if seq <= p.applied {
                return Ok(());
            }
            p.applied = seq;
        }
        self.file.write_all_at(&seq.to_be_bytes(), APPLIED_AT)
    }

    /// Removes the journal file (every change is in the image, and the
    /// image no longer names a journal).
    pub(crate) fn remove(&self) {
        if let Err(e) = self.dir.remove(&self.name, self.id) {
            tracing::debug!(path = %self.path.display(), error = %e, "could not remove the journal");
        }
    }
}

impl Reservation {
    /// Writes the records; once it returns `Ok`, a process death keeps
    /// the change.
    pub(crate) fn write(mut self) -> io::Result<()> {
        let j = &self.journal;
        // Consecutive slots in one write (the ring wraps at most once).
        let mut result = Ok(());
        let mut run: Vec<u8> = Vec::with_capacity(self.writes.len() * RECORD as usize);
        let mut run_start = self.first;
        for (i, w) in self.writes.iter().enumerate() {
            let seq = self.first + i as u64;
            if !run.is_empty() && seq % CAPACITY == 0 {
                result = result.and(j.file.write_all_at(&run, slot_offset(run_start)));
                run.clear();
                run_start = seq;
            }
            run.extend_from_slice(&record_bytes(j.epoch, seq, w));
        }
        if !run.is_empty() {
            result = result.and(j.file.write_all_at(&run, slot_offset(run_start)));
        }
        self.release();
        result
    }

    fn release(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let mut p = self.journal.progress();
        for s in self.first..self.first + self.writes.len() as u64 {
            p.writing.remove(&s);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release();
    }
}

/// What a journal left by a dead writer holds: the metadata writes the
/// image does not hold yet, in the order they were made.
#[derive(Debug, Default)]
pub(crate) struct Replay {
    pub(crate) writes: Vec<MetadataWrite>,
    /// Records seen but not usable (torn, from another session, checksum).
    pub(crate) skipped: usize,
}

/// Reads the journal of `top`, if it was written on this boot for this
/// file; `Ok(None)` when there is none to replay (no file, another boot,
/// another file, malformed header).
pub(crate) fn read(top: &ImagePlace, file_id: Option<(u64, u64)>) -> io::Result<Option<Replay>> {
    let name = top.journal();
    let path = top.dir().join(&name);
    let Some(file) = crate::sidefile::read_journal_file(top.dir(), &name)? else {
        return Ok(None);
    };
    let mut h = vec![0u8; HEADER as usize];
    if file.read_exact_at(&mut h, 0).is_err() {
        return Ok(None);
    }
    let crc = u32::from_be_bytes([h[64], h[65], h[66], h[67]]);
    if &h[0..8] != MAGIC
        || h[8..12] != VERSION.to_be_bytes()
        || h[12..16] != (RECORD as u32).to_be_bytes()
        || be64(&h[16..24]) != CAPACITY
        || crc32c::crc32c(&h[0..64]) != crc
    {
        tracing::warn!(path = %path.display(), "ignoring a malformed journal");
        return Ok(None);
    }
    let id = Identity {
        boot: boot_id()?,
        file: file_id.unwrap_or((0, 0)),
    };
    if h[24..40] != id.boot {
        tracing::info!(path = %path.display(), "journal of an earlier boot: not replayed (the image is as its last checkpoint left it)");
        return Ok(None);
    }
    if (be64(&h[40..48]), be64(&h[48..56])) != id.file {
        tracing::warn!(path = %path.display(), "journal of another file: not replayed");
        return Ok(None);
    }
    let epoch = be64(&h[56..64]);
    let applied = be64(&h[APPLIED_AT as usize..APPLIED_AT as usize + 8]);
    let len = file.metadata()?.len();
    let mut ring = vec![0u8; (len.saturating_sub(HEADER)).min(CAPACITY * RECORD) as usize];
    file.read_exact_at(&mut ring, HEADER)?;
    let mut found: Vec<(u64, MetadataWrite)> = Vec::new();
    let mut skipped = 0;
    for (slot, r) in ring.chunks_exact(RECORD as usize).enumerate() {
        if r.iter().all(|b| *b == 0) {
            continue;
        }
        let crc = u32::from_be_bytes([r[60], r[61], r[62], r[63]]);
        let seq = be64(&r[16..24]);
        let ok = &r[0..4] == RECORD_MAGIC
            && crc32c::crc32c(&r[0..60]) == crc
            && matches!(r[4], 1 | 2)
            && seq % CAPACITY == slot as u64;
        if !ok || be64(&r[8..16]) != epoch {
            skipped += 1;
            continue;
        }
        if seq <= applied || seq > applied + CAPACITY {
            continue;
        }
        let w = MetadataWrite {
            offset: be64(&r[24..32]),
            words: [be64(&r[32..40]), be64(&r[40..48])],
            len: r[4],
        };
        found.push((seq, w));
    }
    found.sort_by_key(|(seq, _)| *seq);
    Ok(Some(Replay {
        writes: found.into_iter().map(|(_, w)| w).collect(),
        skipped,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(j: &Arc<Journal>, w: Vec<MetadataWrite>) {
        j.reserve(w).expect("room").write().expect("written");
    }

    fn place(dir: &tempfile::TempDir) -> ImagePlace {
        ImagePlace::of(&dir.path().join("top.qcow2")).unwrap()
    }

    #[test]
    fn records_written_are_read_back_in_order_after_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let top = place(&dir);
        let j = Arc::new(Journal::create(&top, &[], Some((1, 2))).unwrap());
        write(&j, vec![MetadataWrite::one(65536, 7)]);
        write(
            &j,
            vec![
                MetadataWrite::two(131072, 8, 9),
                MetadataWrite::one(512, 10),
            ],
        );
        j.applied(1).unwrap();
        write(&j, vec![MetadataWrite::one(65536, 11)]);
        let r = read(&top, Some((1, 2))).unwrap().expect("replayable");
        assert_eq!(
            r.writes,
            vec![
                MetadataWrite::two(131072, 8, 9),
                MetadataWrite::one(512, 10),
                MetadataWrite::one(65536, 11)
            ]
        );
        assert_eq!(r.skipped, 0);
        // Another file of the same name: not replayed.
        assert!(read(&top, Some((1, 3))).unwrap().is_none());
    }

    #[test]
    fn another_boot_or_a_damaged_record_is_not_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let top = place(&dir);
        let j = Arc::new(Journal::create(&top, &[], None).unwrap());
        write(&j, vec![MetadataWrite::one(65536, 7)]);
        write(&j, vec![MetadataWrite::one(65536 + 8, 8)]);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("top.qcow2.sqjournal"))
            .unwrap();
        // Tear the second record.
        f.write_all_at(&[0xff; 8], slot_offset(2) + 32).unwrap();
        let r = read(&top, None).unwrap().unwrap();
        assert_eq!(r.writes, vec![MetadataWrite::one(65536, 7)]);
        assert_eq!(r.skipped, 1);
        // The header names another boot.
        f.write_all_at(&[0u8; 16], 24).unwrap();
        assert!(
            read(&top, None).unwrap().is_none(),
            "the crc covers the boot id"
        );
        let mut h = header_bytes(
            Identity {
                boot: [7; 16],
                file: (0, 0),
            },
            1,
        );
        h.truncate(HEADER as usize);
        f.write_all_at(&h, 0).unwrap();
        assert!(read(&top, None).unwrap().is_none());
    }

    #[test]
    fn a_slot_is_reused_only_once_its_record_is_covered_and_nothing_before_is_being_written() {
        let dir = tempfile::tempdir().unwrap();
        let top = place(&dir);
        let j = Arc::new(Journal::create(&top, &[], None).unwrap());
        let stalled = j.reserve(vec![MetadataWrite::one(0, 1)]).unwrap();
        for _ in 0..CAPACITY - 1 {
            write(&j, vec![MetadataWrite::one(8, 2)]);
        }
        assert!(
            j.reserve(vec![MetadataWrite::one(8, 3)]).is_none(),
            "ring full"
        );
        // A checkpoint covers everything, but record 1 is still being
        // written: its slot is not free.
        j.applied(j.horizon()).unwrap();
        assert!(j.reserve(vec![MetadataWrite::one(8, 3)]).is_none());
        stalled.write().unwrap();
        assert!(j.reserve(vec![MetadataWrite::one(8, 3)]).is_some());
        // The late record is covered: a replay skips it.
        let r = read(&top, None).unwrap().unwrap();
        assert!(r.writes.is_empty(), "{:?}", r.writes);
    }
}
