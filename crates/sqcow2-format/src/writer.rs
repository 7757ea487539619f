//! A new qcow2 image written front to back, for a conversion: the guest
//! clusters that hold data come in order and go to the file one after
//! the other (uncompressed, or compressed and packed byte to byte as
//! QEMU packs them), each L2 table after the clusters it maps. The L1
//! table sits after the header; the refcount structures, which count
//! every cluster once (a host cluster of compressed data once per
//! compressed cluster in it), go last. The header is written after
//! everything else is on disk: a conversion cut short leaves a file that
//! is no qcow2 image at all, never a plausible partial one.

use std::collections::HashMap;
use std::path::Path;

use crate::create::CreateOptions;
use crate::entry::{CompressedDescriptor, COPIED};
use crate::error::{Error, ErrorKind};
use crate::header::{field, CompressionType};
use crate::lock::{LockRequest, Locking};
use crate::refcount::{max_refcount, set_entry};
use crate::storage::{FileStorage, Storage};
use crate::types::{Geometry, HostOffset};

/// Bytes gathered before one write to the file.
const WRITE_BATCH: usize = 8 << 20;

/// A qcow2 image being written front to back.
#[derive(Debug)]
pub struct ImageWriter {
    storage: FileStorage,
    opts: CreateOptions,
    g: Geometry,
    l1: Vec<u64>,
    /// The L2 table being filled, and its index in the L1 table.
    l2: Option<(u64, Vec<u64>)>,
    /// The next free byte of the file.
    cursor: u64,
    /// Bytes waiting to be written at `pending_at`.
    pending: Vec<u8>,
    pending_at: u64,
    /// Host clusters holding compressed data: how many compressed
    /// clusters each holds (every other cluster below `cursor` counts
    /// once).
    compressed: HashMap<u64, u64>,
    /// The last guest cluster put (clusters come in increasing order).
    last: Option<u64>,
}

impl ImageWriter {
    /// Starts the image `opts` describes (no backing file) in `file`,
    /// which is emptied first, holding a writer's lock as `qemu-img
    /// convert` does.
    pub fn create(
        path: &Path,
        file: std::fs::File,
        opts: &CreateOptions,
        locking: Locking,
    ) -> Result<Self, Error> {
        let e = |k: ErrorKind| Error::new(path, k);
        if opts.backing_file.is_some() || opts.extended_l2 {
            return Err(e(ErrorKind::InvalidArgument(
                "a conversion writes images without backing file or extended L2 entries".into(),
            )));
        }
        // The layout is checked (cluster size, version, ...) as `create`
        // checks it.
        crate::create::image_bytes(opts).map_err(e)?;
        let storage = FileStorage::from_writable_file(file).map_err(|io| e(io.into()))?;
        storage.lock(LockRequest::WRITER, locking).map_err(e)?;
        // A file starts empty; a device keeps its size (every byte up to
        // the image's end is written, whatever it held).
        let device = {
            use std::os::unix::fs::FileTypeExt;
            storage
                .file()
                .metadata()
                .map_err(|io| e(io.into()))?
                .file_type()
                .is_block_device()
        };
        if !device {
            storage.set_len(0).map_err(|io| e(io.into()))?;
        }
        let cs = opts.cluster_size;
        let g = Geometry {
            cluster_bits: cs.trailing_zeros(),
            extended_l2: false,
        };
        let size = opts.size.div_ceil(512) * 512;
        let l1_entries = g.l1_entries_for(size);
        let l1_clusters = (l1_entries * 8).div_ceil(cs);
        let cursor = (1 + l1_clusters) * cs;
        Ok(ImageWriter {
            storage,
            opts: CreateOptions {
                size,
                ..opts.clone()
            },
            g,
            l1: vec![0; l1_entries as usize],
            l2: None,
            cursor,
            pending: Vec::with_capacity(WRITE_BATCH),
            pending_at: cursor,
            compressed: HashMap::new(),
            last: None,
        })
    }

    /// Bytes per cluster.
    pub fn cluster_size(&self) -> u64 {
        self.opts.cluster_size
    }

    /// The image's compression type.
    pub fn compression_type(&self) -> CompressionType {
        self.opts.compression_type
    }

    /// Makes the L2 table that maps guest cluster `guest` the one being
    /// filled (writing the one before, which moves the cursor); its
    /// index there. Checks that clusters come in order.
    fn entry_slot(&mut self, guest: u64) -> Result<usize, ErrorKind> {
        if self.last.is_some_and(|l| guest <= l) || guest >= self.l1.len() as u64 * self.per_l2() {
            return Err(ErrorKind::InvalidArgument(format!(
                "guest cluster {guest} is out of order or past the end"
            )));
        }
        self.last = Some(guest);
        let (l1i, l2i) = (guest / self.per_l2(), (guest % self.per_l2()) as usize);
        if self.l2.as_ref().is_some_and(|(i, _)| *i != l1i) {
            self.write_l2()?;
        }
        let per = self.per_l2() as usize;
        self.l2.get_or_insert_with(|| (l1i, vec![0; per]));
        Ok(l2i)
    }

    /// Sets entry `i` of the L2 table being filled.
    fn set_entry(&mut self, i: usize, entry: u64) {
        if let Some((_, table)) = self.l2.as_mut() {
            table[i] = entry;
        }
    }

    fn per_l2(&self) -> u64 {
        self.g.l2_entries()
    }

    /// Puts the data of guest cluster `guest` (at most a cluster: the
    /// rest reads as zeros).
    pub fn put(&mut self, guest: u64, data: &[u8]) -> Result<(), ErrorKind> {
        let cs = self.cluster_size();
        if data.len() as u64 > cs {
            return Err(ErrorKind::InvalidArgument("more than a cluster".into()));
        }
        let i = self.entry_slot(guest)?;
        self.align_cursor();
        self.set_entry(i, self.cursor | COPIED);
        self.append(data)?;
        self.append(&vec![0u8; (cs - data.len() as u64) as usize])?;
        Ok(())
    }

    /// Puts guest cluster `guest` as `packed`, its compressed data
    /// ([`compress`]), right after the data before it.
    pub fn put_compressed(&mut self, guest: u64, packed: &[u8]) -> Result<(), ErrorKind> {
        let cs = self.cluster_size();
        if packed.is_empty() || packed.len() as u64 >= cs {
            return Err(ErrorKind::InvalidArgument(
                "compressed data must be smaller than a cluster".into(),
            ));
        }
        let i = self.entry_slot(guest)?;
        let at = self.cursor;
        // The entry names whole sectors, to the end of the one the data
        // ends in.
        let len = (at % 512 + packed.len() as u64).div_ceil(512) * 512 - at % 512;
        let desc = CompressedDescriptor {
            offset: HostOffset(at),
            len,
        };
        self.set_entry(i, desc.encode(self.g));
        // Each host cluster the entry names counts it once.
        let (first, last) = (at / cs, (at + len - 1) / cs);
        for c in first..=last {
            *self.compressed.entry(c).or_insert(0) += 1;
        }
        self.append(packed)
    }

    /// The cursor to the next cluster boundary (after compressed data).
    fn align_cursor(&mut self) {
        let cs = self.cluster_size();
        let aligned = self.cursor.div_ceil(cs) * cs;
        if aligned != self.cursor {
            let pad = vec![0u8; (aligned - self.cursor) as usize];
            self.pending.extend_from_slice(&pad);
            self.cursor = aligned;
        }
    }

    fn append(&mut self, bytes: &[u8]) -> Result<(), ErrorKind> {
        self.pending.extend_from_slice(bytes);
        self.cursor += bytes.len() as u64;
        if self.pending.len() >= WRITE_BATCH {
            self.write_pending()?;
        }
        Ok(())
    }

    fn write_pending(&mut self) -> Result<(), ErrorKind> {
        if !self.pending.is_empty() {
            self.storage.write_at(&self.pending, self.pending_at)?;
            self.pending_at += self.pending.len() as u64;
            self.pending.clear();
        }
        Ok(())
    }

    /// Writes the L2 table being filled after the data it maps.
    fn write_l2(&mut self) -> Result<(), ErrorKind> {
        let Some((l1i, table)) = self.l2.take() else {
            return Ok(());
        };
        self.align_cursor();
        self.l1[l1i as usize] = self.cursor | COPIED;
        let bytes: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
        self.append(&bytes)
    }

    /// Writes the L1 table, the refcounts and, once they are on disk, the
    /// header: the image is complete.
    pub fn finish(mut self) -> Result<(), ErrorKind> {
        self.write_l2()?;
        self.align_cursor();
        self.write_pending()?;
        let cs = self.cluster_size();
        let mut l1: Vec<u8> = self.l1.iter().flat_map(|e| e.to_be_bytes()).collect();
        // Whole clusters (a device's old bytes never follow the table).
        l1.resize((l1.len() as u64).div_ceil(cs) as usize * cs as usize, 0);
        self.storage.write_at(&l1, cs)?;
        // Refcount blocks and table after the last cluster, counting
        // themselves.
        let order = self.opts.refcount_bits.trailing_zeros();
        let block_entries = (cs * 8) >> order;
        let start = self.cursor / cs;
        let (blocks, table) = crate::refcount::structures_after(start, cs, order);
        if table * cs > crate::header::MAX_REFTABLE_BYTES {
            return Err(ErrorKind::SizeTooLarge(self.opts.size));
        }
        let total = start + blocks + table;
        let max = max_refcount(order);
        let mut table_bytes = vec![0u8; (table * cs) as usize];
        for b in 0..blocks {
            let mut block = vec![0u8; cs as usize];
            for i in 0..block_entries {
                let c = b * block_entries + i;
                if c >= total {
                    break;
                }
                let n = self.compressed.get(&c).copied().unwrap_or(1);
                if n > max {
                    return Err(ErrorKind::InvalidArgument(format!(
                        "cluster {c} holds {n} compressed clusters, more than refcount_bits count"
                    )));
                }
                set_entry(&mut block, order, i as usize, n);
            }
            let at = (start + b) * cs;
            self.storage.write_at(&block, at)?;
            table_bytes[(b * 8) as usize..(b * 8 + 8) as usize].copy_from_slice(&at.to_be_bytes());
        }
        let table_offset = (start + blocks) * cs;
        self.storage.write_at(&table_bytes, table_offset)?;
        self.storage.sync()?;
        // The header `create` would write, pointing at the tables.
        let image = crate::create::image_bytes(&self.opts)?;
        let mut header = image[..cs as usize].to_vec();
        let l1_offset = if self.l1.is_empty() { 0 } else { cs };
        header[field::L1_TABLE_OFFSET..field::L1_TABLE_OFFSET + 8]
            .copy_from_slice(&l1_offset.to_be_bytes());
        header[field::REFCOUNT_TABLE_OFFSET..field::REFCOUNT_TABLE_OFFSET + 8]
            .copy_from_slice(&table_offset.to_be_bytes());
        header[field::REFCOUNT_TABLE_CLUSTERS..field::REFCOUNT_TABLE_CLUSTERS + 4]
            .copy_from_slice(&(table as u32).to_be_bytes());
        self.storage.write_at(&header, 0)?;
        self.storage.sync()?;
        Ok(())
    }
}

/// `data` (one cluster) compressed as QEMU compresses it for `ty` (raw
/// deflate with a 4 KiB window, or zstd); `None` when that saves less
/// than a sector, as QEMU then stores the cluster uncompressed.
pub fn compress(data: &[u8], ty: CompressionType) -> Option<Vec<u8>> {
    let limit = data.len().saturating_sub(512);
    let packed = match ty {
        CompressionType::Deflate => {
            use flate2::{Compress, Compression, FlushCompress, Status};
            let mut c = Compress::new_with_window_bits(Compression::default(), false, 12);
            let mut out = Vec::with_capacity(limit);
            match c.compress_vec(data, &mut out, FlushCompress::Finish) {
                Ok(Status::StreamEnd) => out,
                _ => return None,
            }
        }
        CompressionType::Zstd => zstd::bulk::compress(data, 0).ok()?,
    };
    (!packed.is_empty() && packed.len() <= limit).then_some(packed)
}
