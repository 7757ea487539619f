//! L1 and L2 table entries, decoded into what they mean.

use crate::types::{Geometry, HostOffset};

/// Bits 9-55 of L1 and standard L2 entries: a host offset.
pub(crate) const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Bit 63: refcount is exactly one.
pub(crate) const COPIED: u64 = 1 << 63;
/// Bit 62: compressed cluster.
pub(crate) const COMPRESSED: u64 = 1 << 62;
/// Bit 0 (v3, without extended L2): reads as zeros.
pub(crate) const ZERO: u64 = 1;
/// Reserved bits of an L1 entry.
pub(crate) const L1_RESERVED_MASK: u64 = 0x7f00_0000_0000_01ff;
/// Reserved bits of a standard L2 entry.
pub(crate) const L2_STD_RESERVED_MASK: u64 = 0x3f00_0000_0000_01fe;
/// Bits 9-63 of a refcount table entry: a refcount block's offset (all of
/// the high bits, unlike L1 and L2 entries).
pub(crate) const REFT_OFFSET_MASK: u64 = 0xffff_ffff_ffff_fe00;
/// Reserved bits of a refcount table entry.
pub(crate) const REFT_RESERVED_MASK: u64 = 0x1ff;

/// A compressed cluster's location: host byte offset and length of the
/// compressed data (which may run past the data proper to the next sector
/// boundary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressedDescriptor {
    /// Where the compressed data starts.
    pub offset: HostOffset,
    /// How many bytes may hold compressed data.
    pub len: u64,
}

impl CompressedDescriptor {
    /// Decodes the descriptor bits of a compressed L2 entry.
    pub fn decode(entry: u64, geometry: Geometry) -> Self {
        let shift = 62 - (geometry.cluster_bits - 8);
        let offset = entry & ((1u64 << shift) - 1);
        let sectors = ((entry >> shift) & ((1u64 << (geometry.cluster_bits - 8)) - 1)) + 1;
        CompressedDescriptor {
            offset: HostOffset(offset),
            len: sectors * 512 - (offset & 511),
        }
    }

    /// The compressed L2 entry that decodes to this descriptor.
    pub fn encode(&self, geometry: Geometry) -> u64 {
        let shift = 62 - (geometry.cluster_bits - 8);
        let sectors = (self.len + (self.offset.0 & 511)) / 512;
        COMPRESSED | (sectors.saturating_sub(1) << shift) | self.offset.0
    }
}

/// What one (sub)cluster of an L2 table says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterMapping {
    /// Not allocated here: look in the backing file. `host` is set for an
    /// unallocated subcluster of an allocated cluster (extended L2).
    Unallocated {
        /// The subcluster's place in the allocated cluster, if any.
        host: Option<HostOffset>,
    },
    /// Reads as zeros; `host` is set when a cluster stays preallocated.
    Zero {
        /// Preallocated host cluster, if any.
        host: Option<HostOffset>,
    },
    /// Data at a host offset (of the subcluster, with extended L2).
    Data {
        /// Where the data is.
        host: HostOffset,
    },
    /// A compressed cluster.
    Compressed(CompressedDescriptor),
}

/// Why an L2 entry cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryError {
    /// A data cluster offset that is not cluster aligned.
    UnalignedCluster(u64),
    /// Allocation and zero bits that contradict each other.
    InvalidBitmap(u64),
}

/// Decodes the mapping of subcluster `sc` of the cluster described by
/// `entry` (and `bitmap`, the second word of an extended L2 entry; 0
/// otherwise), following QEMU's `qcow2_get_subcluster_type`.
pub(crate) fn decode_l2(
    entry: u64,
    bitmap: u64,
    sc: u32,
    geometry: Geometry,
) -> Result<ClusterMapping, EntryError> {
    if entry & COMPRESSED != 0 {
        return Ok(ClusterMapping::Compressed(CompressedDescriptor::decode(
            entry, geometry,
        )));
    }
    let offset = entry & OFFSET_MASK;
    let host = (offset != 0).then_some(HostOffset(offset));
    if let Some(h) = host {
        if geometry.offset_in_cluster(h.0) != 0 {
            return Err(EntryError::UnalignedCluster(h.0));
        }
    }
    if !geometry.extended_l2 {
        return Ok(if entry & ZERO != 0 {
            ClusterMapping::Zero { host }
        } else if let Some(host) = host {
            ClusterMapping::Data { host }
        } else {
            ClusterMapping::Unallocated { host: None }
        });
    }
    let alloc_bits = bitmap & 0xffff_ffff;
    let zero_bits = bitmap >> 32;
    let sc_mask = 1u64 << sc;
    match host {
        Some(host) => {
            if alloc_bits & zero_bits != 0 {
                Err(EntryError::InvalidBitmap(bitmap))
            } else if zero_bits & sc_mask != 0 {
                Ok(ClusterMapping::Zero {
                    host: Some(host + u64::from(sc) * geometry.subcluster_size()),
                })
            } else if alloc_bits & sc_mask != 0 {
                Ok(ClusterMapping::Data {
                    host: host + u64::from(sc) * geometry.subcluster_size(),
                })
            } else {
                Ok(ClusterMapping::Unallocated {
                    host: Some(host + u64::from(sc) * geometry.subcluster_size()),
                })
            }
        }
        None => {
            if alloc_bits != 0 {
                Err(EntryError::InvalidBitmap(bitmap))
            } else if zero_bits & sc_mask != 0 {
                Ok(ClusterMapping::Zero { host: None })
            } else {
                Ok(ClusterMapping::Unallocated { host: None })
            }
        }
    }
}

impl ClusterMapping {
    /// The host offset the mapping carries, if any.
    pub fn host(&self) -> Option<HostOffset> {
        match *self {
            ClusterMapping::Unallocated { host } | ClusterMapping::Zero { host } => host,
            ClusterMapping::Data { host } => Some(host),
            ClusterMapping::Compressed(_) => None,
        }
    }

    /// The same mapping `delta` bytes further into the guest range.
    pub fn advanced(self, delta: u64) -> Self {
        let shift = |h: Option<HostOffset>| h.map(|h| h + delta);
        match self {
            ClusterMapping::Unallocated { host } => {
                ClusterMapping::Unallocated { host: shift(host) }
            }
            ClusterMapping::Zero { host } => ClusterMapping::Zero { host: shift(host) },
            ClusterMapping::Data { host } => ClusterMapping::Data {
                host: (host + delta),
            },
            c @ ClusterMapping::Compressed(_) => c,
        }
    }

    /// Whether `next`, found `len` bytes after `self`, continues the same
    /// run: same kind and, where there are host offsets, contiguous ones.
    /// Compressed clusters never continue each other.
    pub fn continued_by(&self, len: u64, next: &ClusterMapping) -> bool {
        let same_kind = std::mem::discriminant(self) == std::mem::discriminant(next);
        same_kind
            && !matches!(self, ClusterMapping::Compressed(_))
            && match (self.host(), next.host()) {
                (None, None) => true,
                (Some(a), Some(b)) => a.0 + len == b.0,
                _ => false,
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G64K: Geometry = Geometry {
        cluster_bits: 16,
        extended_l2: false,
    };

    #[test]
    fn standard_entries() {
        assert_eq!(
            decode_l2(0, 0, 0, G64K),
            Ok(ClusterMapping::Unallocated { host: None })
        );
        assert_eq!(
            decode_l2(COPIED | 0x5_0000, 0, 0, G64K),
            Ok(ClusterMapping::Data {
                host: HostOffset(0x5_0000)
            })
        );
        assert_eq!(
            decode_l2(ZERO, 0, 0, G64K),
            Ok(ClusterMapping::Zero { host: None })
        );
        assert_eq!(
            decode_l2(0x5_0200, 0, 0, G64K),
            Err(EntryError::UnalignedCluster(0x5_0200))
        );
    }

    #[test]
    fn compressed_descriptor_round_trip() {
        for bits in [9u32, 12, 16, 21] {
            let g = Geometry {
                cluster_bits: bits,
                extended_l2: false,
            };
            let e = COMPRESSED | (1u64 << (62 - (bits - 8))) | 0x1234;
            assert_eq!(CompressedDescriptor::decode(e, g).encode(g), e);
        }
    }

    #[test]
    fn compressed_descriptor() {
        // 64 KiB clusters: shift 54; 3 additional sectors, offset 0x1234.
        let e = COMPRESSED | (3u64 << 54) | 0x1234;
        let d = CompressedDescriptor::decode(e, G64K);
        assert_eq!(d.offset, HostOffset(0x1234));
        assert_eq!(d.len, 4 * 512 - 0x34);
    }

    #[test]
    fn extended_entries() {
        let g = Geometry {
            cluster_bits: 16,
            extended_l2: true,
        };
        let host = 0x10_0000;
        assert_eq!(
            decode_l2(host, 1 << 3, 3, g),
            Ok(ClusterMapping::Data {
                host: HostOffset(host + 3 * 2048)
            })
        );
        assert_eq!(
            decode_l2(host, 1 << 3, 2, g),
            Ok(ClusterMapping::Unallocated {
                host: Some(HostOffset(host + 2 * 2048))
            })
        );
        assert_eq!(
            decode_l2(0, 1 << 33, 1, g),
            Ok(ClusterMapping::Zero { host: None })
        );
        assert_eq!(
            decode_l2(host, (1 << 33) | 2, 1, g),
            Err(EntryError::InvalidBitmap((1 << 33) | 2))
        );
        assert_eq!(decode_l2(0, 1, 0, g), Err(EntryError::InvalidBitmap(1)));
    }
}
