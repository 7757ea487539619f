//! Newtypes that keep guest offsets, host offsets and layer numbers apart,
//! and the cluster geometry derived from a validated header.

use std::fmt;
use std::ops::Add;

/// A byte offset in the virtual disk seen by the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GuestOffset(pub u64);

/// A byte offset in one file of the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostOffset(pub u64);

/// The position of a layer in a chain: 0 is the base, the highest is the top.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LayerIndex(pub usize);

impl fmt::Display for GuestOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for HostOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// The host offset `len` bytes further on.
impl Add<u64> for HostOffset {
    type Output = HostOffset;
    fn add(self, len: u64) -> HostOffset {
        HostOffset(self.0 + len)
    }
}

/// The guest offset `len` bytes further on.
impl Add<u64> for GuestOffset {
    type Output = GuestOffset;
    fn add(self, len: u64) -> GuestOffset {
        GuestOffset(self.0 + len)
    }
}

/// Cluster size, table sizes and subcluster layout of one image, derived from
/// a header that has been validated (so every shift here is in range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// log2 of the cluster size, 9 to 21.
    pub cluster_bits: u32,
    /// Whether L2 entries are 128-bit extended entries with 32 subclusters.
    pub extended_l2: bool,
}

impl Geometry {
    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Size of one L2 entry in bytes (8, or 16 with extended L2).
    pub fn l2_entry_size(&self) -> u64 {
        if self.extended_l2 {
            16
        } else {
            8
        }
    }

    /// Number of L2 entries in one L2 table (one cluster).
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / self.l2_entry_size()
    }

    /// Bytes of guest data addressed by one L2 table.
    pub fn l2_coverage(&self) -> u64 {
        self.l2_entries() << self.cluster_bits
    }

    /// Number of subclusters per cluster (1 without extended L2).
    pub fn subclusters(&self) -> u64 {
        if self.extended_l2 {
            32
        } else {
            1
        }
    }

    /// Subcluster size in bytes (the cluster size without extended L2).
    pub fn subcluster_size(&self) -> u64 {
        self.cluster_size() / self.subclusters()
    }

    /// Byte offset within its cluster.
    pub fn offset_in_cluster(&self, offset: u64) -> u64 {
        offset & (self.cluster_size() - 1)
    }

    /// Index into the L1 table for a guest offset.
    pub fn l1_index(&self, guest: GuestOffset) -> u64 {
        guest.0 / self.l2_coverage()
    }

    /// Index into the L2 table for a guest offset.
    pub fn l2_index(&self, guest: GuestOffset) -> u64 {
        (guest.0 >> self.cluster_bits) & (self.l2_entries() - 1)
    }

    /// Number of L1 entries needed to address `size` bytes.
    pub fn l1_entries_for(&self, size: u64) -> u64 {
        size.div_ceil(self.l2_coverage())
    }
}

/// A guest cluster: a guest offset divided by the cluster size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GuestCluster(pub u64);

impl Geometry {
    /// The guest cluster holding `guest`.
    pub fn guest_cluster(&self, guest: GuestOffset) -> GuestCluster {
        GuestCluster(guest.0 >> self.cluster_bits)
    }

    /// The first byte of the cluster holding `guest`.
    pub fn cluster_start(&self, guest: GuestOffset) -> GuestOffset {
        GuestOffset(guest.0 & !(self.cluster_size() - 1))
    }

    /// The host cluster number of a host offset.
    pub fn host_cluster(&self, host: HostOffset) -> u64 {
        host.0 >> self.cluster_bits
    }
}
