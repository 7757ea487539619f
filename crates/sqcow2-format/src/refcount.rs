//! Reference counts: the refcount table and blocks of a writable image,
//! cluster allocation, and growth of the refcount structures.
//!
//! Changes stay in memory until [`Refcounts::write_blocks`] and
//! [`Refcounts::write_table`] are called by the flush sequence, which
//! orders them so that a crash leaves at worst leaked clusters.

use std::collections::{BTreeSet, HashMap};

use crate::bytes::be_u64;
use crate::entry::OFFSET_MASK;
use crate::error::{ErrorKind, Table};
use crate::header::MAX_REFTABLE_BYTES;
use crate::storage::Storage;

/// Reads refcount entry `i` of a block with entries of `1 << order` bits.
pub fn get_entry(block: &[u8], order: u32, i: usize) -> u64 {
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
pub fn set_entry(block: &mut [u8], order: u32, i: usize, value: u64) {
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

/// Largest refcount an entry of `1 << order` bits holds.
pub fn max_refcount(order: u32) -> u64 {
    if order == 6 {
        u64::MAX
    } else {
        (1u64 << (1 << order)) - 1
    }
}

#[derive(Debug)]
struct Block {
    data: Vec<u8>,
    dirty: bool,
}

/// The refcount structures of one writable image.
#[derive(Debug)]
pub struct Refcounts {
    order: u32,
    cluster_bits: u32,
    table: Vec<u64>,
    table_offset: u64,
    table_clusters: u64,
    dirty_entries: BTreeSet<usize>,
    table_moved: bool,
    blocks: HashMap<u64, Block>,
    cursor: u64,
    pending_free: Vec<u64>,
}

impl Refcounts {
    /// Loads the refcount table described by the header.
    pub fn load(
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
            blocks: HashMap::new(),
            cursor: 0,
            pending_free: Vec::new(),
        })
    }

    fn block_bits(&self) -> u32 {
        self.cluster_bits + 3 - self.order
    }

    /// Refcount table location: (offset, clusters).
    pub fn table_location(&self) -> (u64, u64) {
        (self.table_offset, self.table_clusters)
    }

    /// Whether the table moved since the last [`Refcounts::write_table`]
    /// (the header must then be rewritten after the table).
    pub fn table_moved(&self) -> bool {
        self.table_moved
    }

    fn block(&mut self, storage: &dyn Storage, bi: u64) -> Result<Option<&mut Block>, ErrorKind> {
        let Some(&entry) = usize::try_from(bi).ok().and_then(|i| self.table.get(i)) else {
            return Ok(None);
        };
        let offset = entry & OFFSET_MASK;
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
            if offset + cluster_size > file_size {
                return Err(ErrorKind::TableBeyondEof {
                    table: Table::Refcount,
                    offset,
                    len: cluster_size,
                    file_size,
                });
            }
            let mut data = vec![0u8; cluster_size as usize];
            storage.read_at(&mut data, offset)?;
            self.blocks.insert(bi, Block { data, dirty: false });
        }
        Ok(self.blocks.get_mut(&bi))
    }

    /// Refcount of host cluster `idx` (0 where no block covers it).
    pub fn get(&mut self, storage: &dyn Storage, idx: u64) -> Result<u64, ErrorKind> {
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
        block.dirty = true;
        Ok(())
    }

    /// Sets the refcount of a cluster whose block exists (repairs).
    pub fn set_value(
        &mut self,
        storage: &dyn Storage,
        idx: u64,
        value: u64,
    ) -> Result<(), ErrorKind> {
        self.set(storage, idx, value)
    }

    /// Adds `delta` to the refcount of cluster `idx` (whose block exists).
    pub fn increment(&mut self, storage: &dyn Storage, idx: u64) -> Result<(), ErrorKind> {
        let v = self.get(storage, idx)?;
        self.set(storage, idx, v + 1)
    }

    /// Queues a decrement of cluster `idx`, applied by
    /// [`Refcounts::apply_pending_frees`] once no metadata on disk
    /// references the cluster through the old mapping.
    pub fn free_later(&mut self, idx: u64) {
        self.pending_free.push(idx);
    }

    /// Whether decrements wait to be applied.
    pub fn has_pending_frees(&self) -> bool {
        !self.pending_free.is_empty()
    }

    /// Applies the queued decrements in memory; freed clusters become
    /// available for allocation.
    pub fn apply_pending_frees(&mut self, storage: &dyn Storage) -> Result<(), ErrorKind> {
        for idx in std::mem::take(&mut self.pending_free) {
            let v = self.get(storage, idx)?;
            if v > 0 {
                self.set(storage, idx, v - 1)?;
                if v == 1 {
                    self.cursor = self.cursor.min(idx);
                }
            }
        }
        Ok(())
    }

    /// Allocates one cluster (refcount 0 -> 1) and returns its index.
    ///
    /// Every cluster handed out (and every refcount block or table cluster
    /// placed on the way) has its space reserved in the file first, so a
    /// full filesystem fails this call and leaves the counts unchanged,
    /// instead of failing a later write of data or metadata.
    pub fn alloc(&mut self, storage: &dyn Storage) -> Result<u64, ErrorKind> {
        loop {
            let idx = self.cursor;
            let bits = self.block_bits();
            let bi = idx >> bits;
            if bi >= self.table.len() as u64 {
                self.grow(storage, idx)?;
                continue;
            }
            if self.table[bi as usize] & OFFSET_MASK == 0 {
                // No block covers this range, so every cluster in it is
                // free: the new block goes at `idx` and describes itself.
                self.reserve(storage, idx, 1)?;
                let cluster_size = 1usize << self.cluster_bits;
                self.table[bi as usize] = idx << self.cluster_bits;
                self.dirty_entries.insert(bi as usize);
                self.blocks.insert(
                    bi,
                    Block {
                        data: vec![0; cluster_size],
                        dirty: true,
                    },
                );
                self.set(storage, idx, 1)?;
                self.cursor = idx + 1;
                continue;
            }
            if self.get(storage, idx)? == 0 {
                self.reserve(storage, idx, 1)?;
                self.set(storage, idx, 1)?;
                self.cursor = idx + 1;
                return Ok(idx);
            }
            self.cursor = idx + 1;
        }
    }

    /// Returns a cluster from [`Refcounts::alloc`] that nothing references
    /// (its data write failed): refcount 1 -> 0, reusable at once.
    pub fn unalloc(&mut self, storage: &dyn Storage, idx: u64) -> Result<(), ErrorKind> {
        if self.get(storage, idx)? == 1 {
            self.set(storage, idx, 0)?;
            self.cursor = self.cursor.min(idx);
        }
        Ok(())
    }

    /// Reserves file space for clusters `idx .. idx + count`.
    fn reserve(&self, storage: &dyn Storage, idx: u64, count: u64) -> Result<(), ErrorKind> {
        let offset = idx
            .checked_shl(self.cluster_bits)
            .filter(|o| o >> self.cluster_bits == idx)
            .ok_or(ErrorKind::Io(std::io::Error::from_raw_os_error(
                libc::EFBIG,
            )))?;
        Ok(storage.reserve(offset, count << self.cluster_bits)?)
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
            self.blocks.insert(
                first_bi + k,
                Block {
                    data: vec![0; cluster_size as usize],
                    dirty: true,
                },
            );
        }
        self.table = table;
        for c in idx..idx + blocks + table_clusters {
            self.set(storage, c, 1)?;
        }
        let old_first = self.table_offset >> self.cluster_bits;
        for c in old_first..old_first + self.table_clusters {
            self.free_later(c);
        }
        self.table_offset = (idx + blocks) << self.cluster_bits;
        self.table_clusters = table_clusters;
        self.table_moved = true;
        self.dirty_entries.clear();
        Ok(())
    }

    /// Writes every modified refcount block in place.
    pub fn write_blocks(&mut self, storage: &dyn Storage) -> Result<bool, ErrorKind> {
        let mut wrote = false;
        for (bi, block) in self.blocks.iter_mut() {
            if block.dirty {
                let offset = self.table[*bi as usize] & OFFSET_MASK;
                storage.write_at(&block.data, offset)?;
                block.dirty = false;
                wrote = true;
            }
        }
        Ok(wrote)
    }

    /// Writes the refcount table: whole if it moved, else the changed
    /// entries. Returns whether anything was written.
    pub fn write_table(&mut self, storage: &dyn Storage) -> Result<bool, ErrorKind> {
        let wrote = if self.table_moved {
            let bytes: Vec<u8> = self.table.iter().flat_map(|e| e.to_be_bytes()).collect();
            storage.write_at(&bytes, self.table_offset)?;
            true
        } else {
            for &i in &self.dirty_entries {
                storage.write_at(
                    &self.table[i].to_be_bytes(),
                    self.table_offset + i as u64 * 8,
                )?;
            }
            !self.dirty_entries.is_empty()
        };
        self.dirty_entries.clear();
        Ok(wrote)
    }

    /// Marks the header update for a moved table as done.
    pub fn table_header_written(&mut self) {
        self.table_moved = false;
    }

    /// Whether anything waits to be written.
    pub fn is_dirty(&self) -> bool {
        self.table_moved || !self.dirty_entries.is_empty() || self.blocks.values().any(|b| b.dirty)
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
