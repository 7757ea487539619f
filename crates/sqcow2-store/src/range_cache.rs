//! A local cache of one remote object's blocks: a sparse file the size of
//! the object holding the blocks fetched, and a map saying which blocks it
//! holds, with a checksum of each, for which version (ETag) of the object.
//!
//! The cache is bounded: past its capacity the least recently used block
//! is dropped (its range punched out of the file). It survives a restart:
//! [`RangeCache::persist`] syncs the blocks, then replaces the map (a new
//! file renamed over the old), so the map never names a block the file
//! does not hold. What it finds at open is checked: a map of another
//! version of the object, or for another length or block size, or one that
//! cannot be parsed, and a data file of the wrong length start the cache
//! afresh; a block whose bytes no longer match their checksum is a miss,
//! never wrong data.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MAGIC: &[u8; 8] = b"SQ2RCMAP";
const VERSION: u32 = 1;

/// Why a cache started empty at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheStart {
    /// Its map and data were taken up again.
    Reused {
        /// Blocks it holds.
        blocks: usize,
    },
    /// Nothing was there.
    New,
    /// What was there was dropped, and why (another version of the
    /// object, a truncated data file, a corrupt map).
    Dropped(String),
}

/// The cache of one object.
#[derive(Debug)]
pub struct RangeCache {
    data: Arc<File>,
    map_path: PathBuf,
    object_len: u64,
    block: u32,
    etag: String,
    capacity_blocks: usize,
    /// Per block: its checksum and last use, if held.
    held: Vec<Option<Held>>,
    /// Blocks held, by last use (the oldest first).
    by_use: BTreeMap<u64, u64>,
    clock: u64,
    changed: bool,
    /// Blocks pinned ([`RangeCache::pin`]) and how many times: never
    /// evicted.
    pins: HashMap<u64, u32>,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    crc: u32,
    used: u64,
    /// Its checksum was found right since this process opened the cache
    /// (or it wrote it): later reads of parts of it are not checked again.
    verified: bool,
}

impl RangeCache {
    /// Opens (or makes) the cache `DIR/NAME.data` and `DIR/NAME.map` of
    /// an object of `object_len` bytes at version `etag`, in blocks of
    /// `block` bytes, holding at most `capacity` bytes.
    pub fn open(
        dir: &Path,
        name: &str,
        object_len: u64,
        etag: &str,
        block: u32,
        capacity: u64,
    ) -> io::Result<(Self, CacheStart)> {
        if block == 0 || !block.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "block size must be a power of two",
            ));
        }
        let data_path = dir.join(format!("{name}.data"));
        let map_path = dir.join(format!("{name}.map"));
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&data_path)?;
        let blocks = object_len.div_ceil(u64::from(block));
        let blocks = usize::try_from(blocks)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "object too large"))?;
        let mut cache = RangeCache {
            data: Arc::new(data),
            map_path,
            object_len,
            block,
            etag: etag.into(),
            capacity_blocks: usize::try_from(capacity / u64::from(block)).unwrap_or(usize::MAX),
            held: vec![None; blocks],
            by_use: BTreeMap::new(),
            clock: 0,
            changed: false,
            pins: HashMap::new(),
        };
        let start = match std::fs::read(&cache.map_path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => CacheStart::New,
            Err(e) => return Err(e),
            Ok(map) => match cache.load(&map) {
                Ok(n) => CacheStart::Reused { blocks: n },
                Err(why) => CacheStart::Dropped(why),
            },
        };
        if !matches!(start, CacheStart::Reused { .. }) {
            // Whatever was there goes: nothing of it is trusted.
            cache.held.iter_mut().for_each(|h| *h = None);
            cache.by_use.clear();
            cache.data.set_len(0)?;
            cache.changed = true;
        }
        cache.data.set_len(object_len)?;
        cache.evict()?;
        Ok((cache, start))
    }

    /// Takes up the map `map`; the blocks it names, or why it is not
    /// this object's.
    fn load(&mut self, map: &[u8]) -> Result<usize, String> {
        let mut r = Reader(map);
        if r.take(8)? != MAGIC || r.u32()? != VERSION {
            return Err("not a cache map of this version".into());
        }
        let (len, block) = (r.u64()?, r.u32()?);
        let etag_len = r.u32()? as usize;
        let etag = r.take(etag_len)?;
        if etag != self.etag.as_bytes() {
            return Err(format!(
                "cached for version {}, the object is {}",
                String::from_utf8_lossy(etag),
                self.etag
            ));
        }
        if len != self.object_len || block != self.block {
            return Err("cached for another length or block size".into());
        }
        let data_len = self.data.metadata().map_err(|e| e.to_string())?.len();
        if data_len != self.object_len {
            return Err(format!(
                "data file of {data_len} bytes for an object of {}",
                self.object_len
            ));
        }
        let count = r.u64()? as usize;
        for _ in 0..count {
            let (index, crc) = (r.u64()?, r.u32()?);
            let slot = usize::try_from(index)
                .ok()
                .and_then(|i| self.held.get_mut(i))
                .ok_or("a block past the object's end")?;
            if slot.is_some() {
                return Err("a block listed twice".into());
            }
            self.clock += 1;
            *slot = Some(Held {
                crc,
                used: self.clock,
                verified: false,
            });
            self.by_use.insert(self.clock, index);
        }
        if !r.0.is_empty() {
            return Err("trailing bytes".into());
        }
        Ok(count)
    }

    /// The object's block size.
    pub fn block_size(&self) -> u32 {
        self.block
    }

    /// Whether block `index` is held (its checksum not checked).
    pub fn holds(&self, index: u64) -> bool {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.held.get(i))
            .is_some_and(Option::is_some)
    }

    /// Blocks held now.
    pub fn blocks_held(&self) -> usize {
        self.by_use.len()
    }

    /// The bytes of block `index` if the cache holds them intact (a block
    /// whose checksum fails is dropped: a miss).
    pub fn get(&mut self, index: u64) -> io::Result<Option<Vec<u8>>> {
        let Some(i) = usize::try_from(index).ok().filter(|i| *i < self.held.len()) else {
            return Ok(None);
        };
        let Some(held) = self.held[i] else {
            return Ok(None);
        };
        let mut buf = vec![0u8; self.block_len(index)];
        self.data
            .read_exact_at(&mut buf, index * u64::from(self.block))?;
        if crc32c::crc32c(&buf) != held.crc {
            self.drop_block(index)?;
            return Ok(None);
        }
        self.by_use.remove(&held.used);
        self.clock += 1;
        self.held[i] = Some(Held {
            crc: held.crc,
            used: self.clock,
            verified: true,
        });
        self.by_use.insert(self.clock, index);
        Ok(Some(buf))
    }

    /// Fills `out` from byte `at` of block `index` if the cache holds
    /// the block intact (checked whole the first time, as [`RangeCache::get`]
    /// does; after that only the bytes asked for are read); `false` on a
    /// miss.
    pub fn read_held(&mut self, index: u64, at: usize, out: &mut [u8]) -> io::Result<bool> {
        let Some(held) = usize::try_from(index)
            .ok()
            .and_then(|i| self.held.get(i).copied().flatten())
        else {
            return Ok(false);
        };
        if at + out.len() > self.block_len(index) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a read past the block",
            ));
        }
        if !held.verified {
            let Some(block) = self.get(index)? else {
                return Ok(false);
            };
            out.copy_from_slice(&block[at..at + out.len()]);
            return Ok(true);
        }
        self.data
            .read_exact_at(out, index * u64::from(self.block) + at as u64)?;
        self.touch(index);
        Ok(true)
    }

    /// Pins blocks `first..=last` if the cache holds every one of them
    /// checked (read whole once since open, or written by this process):
    /// they are not evicted until [`RangeCache::unpin`], so the data file
    /// (see [`RangeCache::file`]) can be read there directly. `false`
    /// (nothing pinned) otherwise.
    pub fn pin(&mut self, first: u64, last: u64) -> bool {
        let verified = |i: u64| {
            usize::try_from(i)
                .ok()
                .and_then(|i| self.held.get(i).copied().flatten())
                .is_some_and(|h| h.verified)
        };
        if first > last || !(first..=last).all(verified) {
            return false;
        }
        for i in first..=last {
            *self.pins.entry(i).or_insert(0) += 1;
            self.touch(i);
        }
        true
    }

    /// Gives up one pin of each of blocks `first..=last`.
    pub fn unpin(&mut self, first: u64, last: u64) {
        for i in first..=last {
            if let Some(n) = self.pins.get_mut(&i) {
                *n -= 1;
                if *n == 0 {
                    self.pins.remove(&i);
                }
            }
        }
        // Evictions skipped for the pins happen now.
        if let Err(e) = self.evict() {
            tracing::warn!(error = %e, "a cache block could not be punched out");
        }
    }

    /// The data file: block `i` at `i * block_size`, as in the object.
    pub fn file(&self) -> &Arc<File> {
        &self.data
    }

    /// Marks held block `index` just used.
    fn touch(&mut self, index: u64) {
        let Some(held) = self.held[index as usize] else {
            return;
        };
        self.by_use.remove(&held.used);
        self.clock += 1;
        self.held[index as usize] = Some(Held {
            used: self.clock,
            ..held
        });
        self.by_use.insert(self.clock, index);
    }

    /// Keeps block `index` (its whole length: the last block may be
    /// short), dropping the least recently used past the capacity.
    pub fn put(&mut self, index: u64, bytes: &[u8]) -> io::Result<()> {
        let i = usize::try_from(index)
            .ok()
            .filter(|i| *i < self.held.len())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "block past the end"))?;
        if bytes.len() != self.block_len(index) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a block's bytes must be whole",
            ));
        }
        if self.capacity_blocks == 0 {
            return Ok(());
        }
        if let Some(old) = self.held[i].take() {
            self.by_use.remove(&old.used);
        }
        self.data
            .write_all_at(bytes, index * u64::from(self.block))?;
        self.clock += 1;
        self.held[i] = Some(Held {
            crc: crc32c::crc32c(bytes),
            used: self.clock,
            verified: true,
        });
        self.by_use.insert(self.clock, index);
        self.changed = true;
        self.evict()
    }

    /// Makes what is held survive a restart: the blocks synced, then the
    /// map replaced.
    pub fn persist(&mut self) -> io::Result<()> {
        if !self.changed {
            return Ok(());
        }
        self.data.sync_data()?;
        let mut map = Vec::with_capacity(40 + self.etag.len() + self.by_use.len() * 12);
        map.extend_from_slice(MAGIC);
        map.extend_from_slice(&VERSION.to_le_bytes());
        map.extend_from_slice(&self.object_len.to_le_bytes());
        map.extend_from_slice(&self.block.to_le_bytes());
        map.extend_from_slice(&(self.etag.len() as u32).to_le_bytes());
        map.extend_from_slice(self.etag.as_bytes());
        // Oldest first: a reopened cache keeps the order of use.
        map.extend_from_slice(&(self.by_use.len() as u64).to_le_bytes());
        for &index in self.by_use.values() {
            let crc = self.held[index as usize].map_or(0, |h| h.crc);
            map.extend_from_slice(&index.to_le_bytes());
            map.extend_from_slice(&crc.to_le_bytes());
        }
        let tmp = self.map_path.with_extension("map.new");
        let mut f = File::create(&tmp)?;
        f.write_all(&map)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &self.map_path)?;
        if let Some(dir) = self.map_path.parent() {
            File::open(dir)?.sync_all()?;
        }
        self.changed = false;
        Ok(())
    }

    fn block_len(&self, index: u64) -> usize {
        let start = index * u64::from(self.block);
        (self.object_len - start).min(u64::from(self.block)) as usize
    }

    /// Drops least recently used blocks while past the capacity.
    fn evict(&mut self) -> io::Result<()> {
        while self.by_use.len() > self.capacity_blocks {
            // The oldest not pinned: pinned ones stay (past the capacity
            // by at most the blocks of the reads in flight).
            let Some((used, index)) = self
                .by_use
                .iter()
                .find(|(_, i)| !self.pins.contains_key(i))
                .map(|(&u, &i)| (u, i))
            else {
                break;
            };
            self.by_use.remove(&used);
            self.held[index as usize] = None;
            self.punch(index)?;
        }
        Ok(())
    }

    fn drop_block(&mut self, index: u64) -> io::Result<()> {
        if let Some(h) = self.held[index as usize].take() {
            self.by_use.remove(&h.used);
            self.changed = true;
            // A pinned block's range is being read: it stays as it is.
            if !self.pins.contains_key(&index) {
                self.punch(index)?;
            }
        }
        Ok(())
    }

    /// Frees the file's space of block `index`.
    fn punch(&mut self, index: u64) -> io::Result<()> {
        use rustix::fs::{fallocate, FallocateFlags};
        self.changed = true;
        fallocate(
            &self.data,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            index * u64::from(self.block),
            self.block_len(index) as u64,
        )
        .map_err(io::Error::from)
    }
}

/// Reads a map's fields in order.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("the map is cut short".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::os::unix::fs::MetadataExt;

    const BLOCK: u32 = 4096;
    /// Ten blocks and a short one.
    const LEN: u64 = 10 * BLOCK as u64 + 100;

    fn object() -> Vec<u8> {
        (0..LEN as usize)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2])
            .collect()
    }

    fn block_of(obj: &[u8], i: u64) -> &[u8] {
        let start = (i * BLOCK as u64) as usize;
        &obj[start..(start + BLOCK as usize).min(obj.len())]
    }

    fn open(dir: &Path, etag: &str, capacity_blocks: u64) -> (RangeCache, CacheStart) {
        RangeCache::open(dir, "l", LEN, etag, BLOCK, capacity_blocks * BLOCK as u64).unwrap()
    }

    /// Random puts and gets against a model: a get gives the block's own
    /// bytes or nothing, never others; at most the capacity is held, the
    /// file's space included; the block put last is always held.
    #[test]
    fn gets_are_exact_or_misses_and_the_capacity_holds() {
        let dir = tempfile::tempdir().unwrap();
        let obj = object();
        let (mut c, start) = open(dir.path(), "\"v1\"", 4);
        assert_eq!(start, CacheStart::New);
        let mut rng = fastrand::Rng::with_seed(7);
        let mut last = None;
        let mut hits = 0;
        for _ in 0..2000 {
            let i = rng.u64(0..11);
            if rng.bool() {
                c.put(i, block_of(&obj, i)).unwrap();
                last = Some(i);
            } else if let Some(got) = c.get(i).unwrap() {
                assert_eq!(got, block_of(&obj, i), "block {i}");
                hits += 1;
            }
            assert!(c.blocks_held() <= 4);
            if let Some(l) = last {
                assert!(
                    c.held[l as usize].is_some(),
                    "the block put last was dropped"
                );
            }
        }
        assert!(hits > 100, "{hits} hits");
        let allocated = c.data.metadata().unwrap().blocks() * 512;
        assert!(
            allocated <= 5 * BLOCK as u64,
            "{allocated} bytes allocated for 4 blocks"
        );
        let model: HashMap<u64, ()> = (0..11)
            .filter(|i| c.held[*i as usize].is_some())
            .map(|i| (i, ()))
            .collect();
        assert_eq!(model.len(), c.blocks_held());
    }

    /// A pinned block is never evicted and its bytes stay in the data
    /// file at the object's offsets; only checked blocks are pinned; once
    /// unpinned, the capacity holds again.
    #[test]
    fn pinned_blocks_stay_in_the_file_until_unpinned() {
        let dir = tempfile::tempdir().unwrap();
        let obj = object();
        let (mut c, _) = open(dir.path(), "\"v1\"", 3);
        assert!(!c.pin(0, 0), "a block not held was pinned");
        c.put(0, block_of(&obj, 0)).unwrap();
        c.put(1, block_of(&obj, 1)).unwrap();
        assert!(!c.pin(0, 2), "a run with a missing block was pinned");
        assert!(c.pin(0, 1));
        for i in 2..6 {
            c.put(i, block_of(&obj, i)).unwrap();
        }
        let mut buf = vec![0u8; 2 * BLOCK as usize];
        c.file().read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, obj[..2 * BLOCK as usize], "pinned bytes changed");
        assert!(c.holds(0) && c.holds(1));
        assert_eq!(c.blocks_held(), 3);
        assert!(c.holds(5), "the block put last was dropped");
        c.unpin(0, 1);
        c.put(6, block_of(&obj, 6)).unwrap();
        assert_eq!(c.blocks_held(), 3);
        assert!(!c.holds(0), "an unpinned block outlived newer ones");
        // Taken up again after a restart, a block is pinned only once
        // read whole (checked).
        c.persist().unwrap();
        drop(c);
        let (mut c, _) = open(dir.path(), "\"v1\"", 2);
        let held: Vec<u64> = (0..11).filter(|&i| c.holds(i)).collect();
        assert!(!held.is_empty());
        assert!(!c.pin(held[0], held[0]), "an unchecked block was pinned");
        assert!(c.get(held[0]).unwrap().is_some());
        assert!(c.pin(held[0], held[0]));
    }

    /// Persisted and reopened, the same blocks come back (in their order
    /// of use); reopened for another version of the object, with the data
    /// file cut short, or with a map cut short, nothing is taken up.
    #[test]
    fn a_restart_keeps_the_blocks_of_the_same_version_only() {
        let dir = tempfile::tempdir().unwrap();
        let obj = object();
        let (mut c, _) = open(dir.path(), "\"v1\"", 8);
        for i in [3, 10, 0] {
            c.put(i, block_of(&obj, i)).unwrap();
        }
        c.persist().unwrap();
        drop(c);
        let (mut c, start) = open(dir.path(), "\"v1\"", 8);
        assert_eq!(start, CacheStart::Reused { blocks: 3 });
        for i in [3, 10, 0] {
            assert_eq!(c.get(i).unwrap().as_deref(), Some(block_of(&obj, i)));
        }
        assert_eq!(c.get(5).unwrap(), None);
        c.persist().unwrap();
        drop(c);

        let (c, start) = open(dir.path(), "\"v2\"", 8);
        assert!(
            matches!(start, CacheStart::Dropped(ref why) if why.contains("v1")),
            "{start:?}"
        );
        assert_eq!(c.blocks_held(), 0);
        drop(c);

        // v2's (empty) cache persisted nothing: put one, persist, then cut
        // the data file while closed.
        let (mut c, _) = open(dir.path(), "\"v2\"", 8);
        c.put(1, block_of(&obj, 1)).unwrap();
        c.persist().unwrap();
        drop(c);
        let data = dir.path().join("l.data");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&data)
            .unwrap()
            .set_len(BLOCK as u64)
            .unwrap();
        let (c, start) = open(dir.path(), "\"v2\"", 8);
        assert!(
            matches!(start, CacheStart::Dropped(ref why) if why.contains("data file")),
            "{start:?}"
        );
        assert_eq!(c.blocks_held(), 0);
        drop(c);

        let map = dir.path().join("l.map");
        let (mut c, _) = open(dir.path(), "\"v2\"", 8);
        c.put(1, block_of(&obj, 1)).unwrap();
        c.persist().unwrap();
        drop(c);
        let bytes = std::fs::read(&map).unwrap();
        std::fs::write(&map, &bytes[..bytes.len() - 3]).unwrap();
        let (c, start) = open(dir.path(), "\"v2\"", 8);
        assert!(matches!(start, CacheStart::Dropped(_)), "{start:?}");
        assert_eq!(c.blocks_held(), 0);
    }

    /// A held block whose bytes changed on disk (a bit flipped while the
    /// daemon was stopped) is a miss, and dropped: never wrong data.
    #[test]
    fn a_corrupt_block_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let obj = object();
        let (mut c, _) = open(dir.path(), "\"v1\"", 8);
        c.put(2, block_of(&obj, 2)).unwrap();
        c.put(4, block_of(&obj, 4)).unwrap();
        c.persist().unwrap();
        drop(c);
        let data = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("l.data"))
            .unwrap();
        data.write_all_at(&[!obj[2 * BLOCK as usize + 17]], 2 * BLOCK as u64 + 17)
            .unwrap();
        let (mut c, start) = open(dir.path(), "\"v1\"", 8);
        assert_eq!(start, CacheStart::Reused { blocks: 2 });
        assert_eq!(c.get(2).unwrap(), None, "a corrupt block served");
        assert_eq!(c.blocks_held(), 1);
        assert_eq!(c.get(4).unwrap().as_deref(), Some(block_of(&obj, 4)));
        assert!(c.put(3, &[0u8; 10]).is_err(), "a short block taken");
        assert!(
            c.put(11, &[0u8; 100]).is_err(),
            "a block past the end taken"
        );
    }
}
