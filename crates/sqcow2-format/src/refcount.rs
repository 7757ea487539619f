//! Reference counts: the refcount table and blocks of a writable image,
//! cluster allocation, and growth of the refcount structures.
//!
//! Changes stay in memory until the flush sequence writes them
//! ([`Refcounts::dirty_snapshot`], written outside the metadata lock,
//! then [`Refcounts::mark_written`]), in an order that leaves at worst
//! leaked clusters after a crash.

use std::collections::{BTreeSet, HashMap};

use crate::bytes::be_u64;
use crate::dirty::{DirtyPages, PageWrites};
use crate::entry::REFT_OFFSET_MASK;
use crate::error::{ErrorKind, Table};
use crate::header::MAX_REFTABLE_BYTES;
use crate::storage::Storage;

/// Reads refcount entry `i` of a block with entries of `1 << order` bits.
pub(crate) fn get_entry(block: &[u8], order: u32, i: usize) -> u64 {
    match order {
        0..=2 => {
            let bits = 1usize << order;
            let per_byte = 8 / bits;
            let byte = block.get(i / per_byte).copied().unwrap_or(0);
            u64::from(byte >> ((i % per_byte) * bits)) & ((1 << bits) - 1)
        }
        _ => {
            let bytes = 1usize << (order - 3);
            let mut v = 0u64;
            for b in block.iter().skip(i * bytes).take(bytes) {
                v = (v << 8) | u64::from(*b);
            }
            v
        }
    }
}

/// Writes refcount entry `i` (the value must fit the width).
pub(crate) fn set_entry(block: &mut [u8], order: u32, i: usize, value: u64) {
    match order {
        0..=2 => {
            let bits = 1usize << order;
            let per_byte = 8 / bits;
            let shift = (i % per_byte) * bits;
            let mask = (((1u16 << bits) - 1) as u8) << shift;
            if let Some(byte) = block.get_mut(i / per_byte) {
                *byte = (*byte & !mask) | (((value as u8) << shift) & mask);
            }
        }
        _ => {
            let bytes = 1usize << (order - 3);
            let be = value.to_be_bytes();
            if let Some(dst) = block.get_mut(i * bytes..(i + 1) * bytes) {
                dst.copy_from_slice(&be[8 - bytes..]);
            }
        }
    }
}

/// Reserves file space for clusters `idx .. idx + count` of
/// `1 << cluster_bits` bytes.
pub(crate) fn reserve_clusters(
    storage: &dyn Storage,
    cluster_bits: u32,
    idx: u64,
    count: u64,
) -> Result<(), ErrorKind> {
    let offset = idx
        .checked_shl(cluster_bits)
        .filter(|o| o >> cluster_bits == idx)
        .ok_or(ErrorKind::Io(std::io::Error::from_raw_os_error(
            libc::EFBIG,
        )))?;
    Ok(storage.reserve(offset, count << cluster_bits)?)
}

/// `n` contiguous clusters (at least one) taken one at a time from
/// `alloc` on `state`; the first's index. Clusters skipped on the way
/// (not following the run) are given back through `give_back`.
pub(crate) fn contiguous_run<S, E>(
    state: &mut S,
    n: u64,
    mut alloc: impl FnMut(&mut S) -> Result<u64, E>,
    mut give_back: impl FnMut(&mut S, u64),
) -> Result<u64, E> {
    let mut run: Vec<u64> = Vec::new();
    let mut skipped = Vec::new();
    while (run.len() as u64) < n.max(1) {
        let c = alloc(state)?;
        if run.last().is_some_and(|&last| last + 1 != c) {
            skipped.append(&mut run);
        }
        run.push(c);
    }
    for c in skipped {
        give_back(state, c);
    }
    Ok(run[0])
}

/// How many refcount blocks and table clusters count clusters `0 ..
/// start` and themselves, placed from cluster `start` on (blocks, then
/// the table), with refcounts of `1 << order` bits.
pub(crate) fn structures_after(start: u64, cluster_size: u64, order: u32) -> (u64, u64) {
    let block_entries = (cluster_size * 8) >> order;
    let (mut blocks, mut table) = (1u64, 1u64);
    loop {
        let total = start + blocks + table;
        let nb = total.div_ceil(block_entries);
        let nt = (nb * 8).div_ceil(cluster_size);
        if (nb, nt) == (blocks, table) {
            return (blocks, table);
        }
        (blocks, table) = (nb, nt);
    }
}

/// Largest refcount an entry of `1 << order` bits holds.
pub(crate) fn max_refcount(order: u32) -> u64 {
    if order == 6 {
        u64::MAX
    } else {
        (1u64 << (1 << order)) - 1
    }
}

#[derive(Debug)]
struct Block {
    data: Vec<u8>,
    /// The pages changed since the block was last written.
    dirty: DirtyPages,
    /// Bumped by every change, so that a write of an older copy does not
    /// mark a newer change clean.
    generation: u64,
}

impl Block {
    /// A block read from the file.
    fn clean(data: Vec<u8>) -> Self {
        Block {
            data,
            dirty: DirtyPages::default(),
            generation: 0,
        }
    }

    /// A block new in memory, to be written whole.
    fn fresh(len: usize) -> Self {
        Block {
            data: vec![0; len],
            dirty: DirtyPages::all(len),
            generation: 0,
        }
    }
}

/// A copy of the refcount structures that wait to be written, taken under
/// the metadata lock and written outside it.
#[derive(Debug, Default)]
pub(crate) struct RefcountSnapshot {
    /// Blocks: (block number, changed parts as (file offset, bytes),
    /// generation).
    blocks: Vec<(u64, PageWrites, u64)>,
    /// The whole table when it moved: (offset, clusters, bytes, epoch).
    moved_table: Option<(u64, u64, Vec<u8>, u64)>,
    /// Changed table entries: (offset, value).
    entries: Vec<(u64, u64)>,
    /// Indices of the changed entries (to restore on failure).
    entry_indices: Vec<usize>,
}

impl RefcountSnapshot {
    /// Whether nothing waits to be written.
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty() && self.moved_table.is_none() && self.entries.is_empty()
    }

    /// Writes the blocks; whether anything was written.
    pub(crate) fn write_blocks(&self, storage: &dyn Storage) -> std::io::Result<bool> {
        for (_, parts, _) in &self.blocks {
            for (at, bytes) in parts {
                storage.write_at(bytes, *at)?;
            }
        }
        Ok(!self.blocks.is_empty())
    }

    /// Writes the table (whole if it moved, else the changed entries);
    /// whether anything was written.
    pub(crate) fn write_table(&self, storage: &dyn Storage) -> std::io::Result<bool> {
        if let Some((offset, _, bytes, _)) = &self.moved_table {
            storage.write_at(bytes, *offset)?;
            return Ok(true);
        }
        for (offset, value) in &self.entries {
            storage.write_at(&value.to_be_bytes(), *offset)?;
        }
        Ok(!self.entries.is_empty())
    }

    /// Where the header must point once the table is written, if it moved:
    /// (offset, clusters).
    pub(crate) fn moved_to(&self) -> Option<(u64, u64)> {
        self.moved_table.as_ref().map(|(o, c, _, _)| (*o, *c))
    }
}

/// The refcount structures of one writable image.
#[derive(Debug)]
pub(crate) struct Refcounts {
    order: u32,
    cluster_bits: u32,
    table: Vec<u64>,
    table_offset: u64,
    table_clusters: u64,
    dirty_entries: BTreeSet<usize>,
    table_moved: bool,
    /// Bumped whenever the table moves.
    table_epoch: u64,
    /// Clusters placed for the refcount structures themselves (new blocks,
    /// a moved table) since the last [`Refcounts::take_placed`].
    placed: Vec<u64>,
    blocks: HashMap<u64, Block>,
    cursor: u64,
    pending_free: Vec<u64>,
}

impl Refcounts {
    /// Loads the refcount table described by the header.
    pub(crate) fn load(
        storage: &dyn Storage,
        order: u32,
        cluster_bits: u32,
        table_offset: u64,
        table_clusters: u32,
    ) -> Result<Self, ErrorKind> {
        let len = u64::from(table_clusters) << cluster_bits;
        let mut raw = vec![0u8; len as usize];
        storage.read_at(&mut raw, table_offset)?;
        let table = raw.chunks_exact(8).map(|c| be_u64(c, 0)).collect();
        Ok(Self {
            order,
            cluster_bits,
            table,
            table_offset,
            table_clusters: u64::from(table_clusters),
            dirty_entries: BTreeSet::new(),
            table_moved: false,
            table_epoch: 0,
            placed: Vec::new(),
            blocks: HashMap::new(),
            cursor: 0,
            pending_free: Vec::new(),
        })
    }

    fn block_bits(&self) -> u32 {
        self.cluster_bits + 3 - self.order
    }

    fn block(&mut self, storage: &dyn Storage, bi: u64) -> Result<Option<&mut Block>, ErrorKind> {
        let Some(&entry) = usize::try_from(bi).ok().and_then(|i| self.table.get(i)) else {
            return Ok(None);
        };
        let offset = entry & REFT_OFFSET_MASK;
        if offset == 0 {
            return Ok(None);
        }
        if !self.blocks.contains_key(&bi) {
            let cluster_size = 1u64 << self.cluster_bits;
            if offset & (cluster_size - 1) != 0 {
                return Err(ErrorKind::UnalignedTable {
                    table: Table::Refcount,
                    offset,
                });
            }
            let file_size = storage.len()?;
            // (All of bits 9-63 are the offset: a hostile one overflows.)
            if offset
                .checked_add(cluster_size)
                .is_none_or(|end| end > file_size)
            {
                return Err(ErrorKind::TableBeyondEof {
                    table: Table::Refcount,
                    offset,
                    len: cluster_size,
                    file_size,
                });
            }
            crate::nowait::may_load()?;
            let mut data = vec![0u8; cluster_size as usize];
            storage.read_at(&mut data, offset)?;
            self.blocks.insert(bi, Block::clean(data));
        }
        Ok(self.blocks.get_mut(&bi))
    }

    /// Refcount of host cluster `idx` if its block is in memory already
    /// (`Some(0)` where no block covers it): a lookup that needs no write
    /// access.
    pub(crate) fn peek(&self, idx: u64) -> Option<u64> {
        let bits = self.block_bits();
        let bi = idx >> bits;
        let Some(&entry) = usize::try_from(bi).ok().and_then(|i| self.table.get(i)) else {
            return Some(0);
        };
        if entry & REFT_OFFSET_MASK == 0 {
            return Some(0);
        }
        let block = self.blocks.get(&bi)?;
        Some(get_entry(
            &block.data,
            self.order,
            (idx & ((1 << bits) - 1)) as usize,
        ))
    }

    /// Refcount of host cluster `idx` (0 where no block covers it).
    pub(crate) fn get(&mut self, storage: &dyn Storage, idx: u64) -> Result<u64, ErrorKind> {
        let bits = self.block_bits();
        let order = self.order;
        let i = (idx & ((1 << bits) - 1)) as usize;
        Ok(self
            .block(storage, idx >> bits)?
            .map(|b| get_entry(&b.data, order, i))
            .unwrap_or(0))
    }

    /// Sets the refcount of a cluster whose block exists.
    fn set(&mut self, storage: &dyn Storage, idx: u64, value: u64) -> Result<(), ErrorKind> {
        let bits = self.block_bits();
        let order = self.order;
        let i = (idx & ((1 << bits) - 1)) as usize;
        if value > max_refcount(order) {
            return Err(ErrorKind::InvalidHeader {
                field: "refcount_order",
                reason: format!("refcount of cluster {idx} would overflow"),
            });
        }
        let Some(block) = self.block(storage, idx >> bits)? else {
            return Err(ErrorKind::InvalidHeader {
                field: "refcount_table_offset",
                reason: format!("no refcount block covers cluster {idx}"),
            });
        };
        set_entry(&mut block.data, order, i, value);
        block.dirty.mark((i << order) / 8);
        block.generation += 1;
        Ok(())
    }

    /// Sets the refcount of a cluster whose block exists (repairs).
    pub(crate) fn set_value(
        &mut self,
        storage: &dyn Storage,
        idx: u64,
        value: u64,
    ) -> Result<(), ErrorKind> {
        self.set(storage, idx, value)
    }

    /// Queues a decrement of cluster `idx`, applied by a flush once no
    /// metadata on disk references the cluster through the old mapping and
    /// no transfer that looked the old mapping up is still running.
    pub(crate) fn free_later(&mut self, idx: u64) {
        self.pending_free.push(idx);
    }

    /// Allocates one cluster (refcount 0 -> 1) and returns its index.
    ///
    /// Every cluster handed out (and every refcount block or table cluster
    /// placed on the way) has its space reserved in the file first, so a
    /// full filesystem fails this call and leaves the counts unchanged,
    /// instead of failing a later write of data or metadata.
    pub(crate) fn alloc(&mut self, storage: &dyn Storage) -> Result<u64, ErrorKind> {
        let idx = self.alloc_unreserved(storage)?;
        if let Err(e) = self.reserve(storage, idx, 1) {
            self.unalloc(storage, idx)?;
            return Err(e);
        }
        Ok(idx)
    }

    /// [`Refcounts::alloc`] without reserving the returned cluster's space
    /// (refcount blocks and tables placed on the way are reserved): the
    /// caller reserves it with [`Refcounts::reserve_cluster`] outside the
    /// metadata lock, and gives it back if that fails.
    pub(crate) fn alloc_unreserved(&mut self, storage: &dyn Storage) -> Result<u64, ErrorKind> {
        loop {
            let idx = self.cursor;
            let bits = self.block_bits();
            let bi = idx >> bits;
            if bi >= self.table.len() as u64 {
                self.grow(storage, idx)?;
                continue;
            }
            if self.table[bi as usize] & REFT_OFFSET_MASK == 0 {
                // No block covers this range, so every cluster in it is
                // free: the new block goes at `idx` and describes itself.
                self.reserve(storage, idx, 1)?;
                let cluster_size = 1usize << self.cluster_bits;
                self.table[bi as usize] = idx << self.cluster_bits;
                self.placed.push(idx);
                self.dirty_entries.insert(bi as usize);
                self.blocks.insert(bi, Block::fresh(cluster_size));
                self.set(storage, idx, 1)?;
                self.cursor = idx + 1;
                continue;
            }
            if self.get(storage, idx)? == 0 {
                self.set(storage, idx, 1)?;
                self.cursor = idx + 1;
                return Ok(idx);
            }
            self.cursor = idx + 1;
        }
    }

    /// Returns a cluster from [`Refcounts::alloc`] that nothing references
    /// (its data write failed): refcount 1 -> 0, reusable at once.
    pub(crate) fn unalloc(&mut self, storage: &dyn Storage, idx: u64) -> Result<(), ErrorKind> {
        if self.get(storage, idx)? == 1 {
            self.set(storage, idx, 0)?;
            self.cursor = self.cursor.min(idx);
        }
        Ok(())
    }

    /// Reserves file space for clusters `idx .. idx + count`.
    fn reserve(&self, storage: &dyn Storage, idx: u64, count: u64) -> Result<(), ErrorKind> {
        reserve_clusters(storage, self.cluster_bits, idx, count)
    }

    /// Grows the refcount table so that it covers cluster `idx`, placing
    /// the new blocks and the new table in free clusters from `idx` on.
    fn grow(&mut self, storage: &dyn Storage, idx: u64) -> Result<(), ErrorKind> {
        let bits = self.block_bits();
        let cluster_size = 1u64 << self.cluster_bits;
        let entries_per_cluster = cluster_size / 8;
        let old_len = self.table.len() as u64;
        let (mut blocks, mut table_clusters) = (1u64, 1u64);
        loop {
            let end = idx + blocks + table_clusters;
            let first_bi = idx >> bits;
            let last_bi = (end - 1) >> bits;
            let new_blocks = last_bi - first_bi + 1;
            let entries = (last_bi + 1).max(old_len * 2);
            let new_table_clusters = entries.div_ceil(entries_per_cluster);
            if (new_blocks, new_table_clusters) == (blocks, table_clusters) {
                break;
            }
            (blocks, table_clusters) = (new_blocks, new_table_clusters);
        }
        if table_clusters * cluster_size > MAX_REFTABLE_BYTES {
            return Err(ErrorKind::TableTooLarge {
                table: Table::Refcount,
                entries: table_clusters * entries_per_cluster,
                max: MAX_REFTABLE_BYTES / 8,
            });
        }
        self.reserve(storage, idx, blocks + table_clusters)?;
        let first_bi = idx >> bits;
        let mut table = std::mem::take(&mut self.table);
        table.resize((table_clusters * entries_per_cluster) as usize, 0);
        for k in 0..blocks {
            table[(first_bi + k) as usize] = (idx + k) << self.cluster_bits;
            self.blocks
                .insert(first_bi + k, Block::fresh(cluster_size as usize));
        }
        self.table = table;
        for c in idx..idx + blocks + table_clusters {
            self.set(storage, c, 1)?;
            self.placed.push(c);
        }
        let old_first = self.table_offset >> self.cluster_bits;
        for c in old_first..old_first + self.table_clusters {
            self.free_later(c);
        }
        self.table_offset = (idx + blocks) << self.cluster_bits;
        self.table_clusters = table_clusters;
        self.table_moved = true;
        self.table_epoch += 1;
        self.dirty_entries.clear();
        Ok(())
    }

    /// Writes every modified refcount block in place (offline repairs,
    /// which hold the image alone).
    pub(crate) fn write_blocks(&mut self, storage: &dyn Storage) -> Result<bool, ErrorKind> {
        let snapshot = self.dirty_snapshot();
        let wrote = snapshot.write_blocks(storage)?;
        self.mark_written(&snapshot);
        Ok(wrote)
    }

    /// A copy of everything that waits to be written. The copy is written
    /// outside the metadata lock; [`Refcounts::mark_written`] afterwards
    /// marks clean what has not changed since, and
    /// [`Refcounts::restore`] puts back what a failed write left unwritten.
    pub(crate) fn dirty_snapshot(&mut self) -> RefcountSnapshot {
        let mut snap = RefcountSnapshot::default();
        for (bi, block) in &self.blocks {
            if block.dirty.any() {
                let offset = self
                    .table
                    .get(*bi as usize)
                    .map_or(0, |e| e & REFT_OFFSET_MASK);
                let parts = block
                    .dirty
                    .ranges(block.data.len())
                    .into_iter()
                    .map(|r| (offset + r.start as u64, block.data[r].to_vec()))
                    .collect();
                snap.blocks.push((*bi, parts, block.generation));
            }
        }
        if self.table_moved {
            let bytes = self.table.iter().flat_map(|e| e.to_be_bytes()).collect();
            snap.moved_table = Some((
                self.table_offset,
                self.table_clusters,
                bytes,
                self.table_epoch,
            ));
            snap.entry_indices = std::mem::take(&mut self.dirty_entries)
                .into_iter()
                .collect();
        } else {
            for i in std::mem::take(&mut self.dirty_entries) {
                snap.entries
                    .push((self.table_offset + i as u64 * 8, self.table[i]));
                snap.entry_indices.push(i);
            }
        }
        snap
    }

    /// Marks clean what `snapshot` wrote and has not changed since (the
    /// header already points at a moved table).
    pub(crate) fn mark_written(&mut self, snapshot: &RefcountSnapshot) {
        for (bi, _, generation) in &snapshot.blocks {
            if let Some(block) = self.blocks.get_mut(bi) {
                if block.generation == *generation {
                    block.dirty.clear();
                }
            }
        }
        if let Some((_, _, _, epoch)) = snapshot.moved_table {
            if epoch == self.table_epoch {
                self.table_moved = false;
            }
        }
    }

    /// Whether the table moved since the header last named it.
    pub(crate) fn table_moved(&self) -> bool {
        self.table_moved
    }

    /// Puts back the table entries of a snapshot whose write failed, so
    /// that the next flush writes them again (blocks stay dirty anyway).
    pub(crate) fn restore(&mut self, snapshot: &RefcountSnapshot) {
        self.dirty_entries
            .extend(snapshot.entry_indices.iter().copied());
    }

    /// Takes the queued decrements for a flush to apply once it is safe.
    pub(crate) fn take_pending_frees(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.pending_free)
    }

    /// Puts back decrements taken by a flush that failed.
    pub(crate) fn return_pending_frees(&mut self, frees: Vec<u64>) {
        self.pending_free.extend(frees);
    }

    /// Applies decrements taken by [`Refcounts::take_pending_frees`]: the
    /// clusters that reach 0 become allocatable.
    /// Returns the clusters that became free.
    pub(crate) fn apply_frees(
        &mut self,
        storage: &dyn Storage,
        frees: &[u64],
    ) -> Result<Vec<u64>, ErrorKind> {
        let mut freed = Vec::new();
        for &idx in frees {
            let v = self.get(storage, idx)?;
            if v > 0 {
                self.set(storage, idx, v - 1)?;
                if v == 1 {
                    self.cursor = self.cursor.min(idx);
                    freed.push(idx);
                }
            }
        }
        Ok(freed)
    }

    /// Clusters placed for refcount blocks and tables since the last call.
    pub(crate) fn take_placed(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.placed)
    }

    /// The refcount table's entries.
    pub(crate) fn table_entries(&self) -> &[u64] {
        &self.table
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_of_every_width() {
        for order in 0..=6u32 {
            let mut block = vec![0u8; 512];
            let max = max_refcount(order);
            let entries = (512 * 8) >> order;
            for i in 0..entries {
                set_entry(&mut block, order, i, (i as u64 * 7 + 1) & max);
            }
            for i in 0..entries {
                assert_eq!(
                    get_entry(&block, order, i),
                    (i as u64 * 7 + 1) & max,
                    "order {order} entry {i}"
                );
            }
        }
        // Sub-byte entries fill bytes from the least significant bit.
        let mut block = vec![0u8; 1];
        set_entry(&mut block, 0, 0, 1);
        assert_eq!(block[0], 1);
        let mut block = vec![0u8; 2];
        set_entry(&mut block, 4, 0, 0x0102);
        assert_eq!(block, vec![1, 2]);
    }
}
