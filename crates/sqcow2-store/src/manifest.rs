//! A layer manifest: what a reader needs to open the layers one push put
//! in a bucket without asking the store about each (issue 48): per layer
//! its URL, length and version (ETag), and the metadata a chain reads of
//! a backing layer (its header cluster, L1 table and L2 tables) as the
//! ranges they span and the non-zero 8-byte words in them. One GET of the
//! manifest replaces a HEAD and the header, L1 and L2 reads of every layer
//! it lists; a data read is then one ranged GET.
//!
//! The manifest is trusted as the objects are (the same bucket, the same
//! credentials). Each object is still read only at the version listed: an
//! object changed or deleted since the push fails its first data read
//! ([`crate::StoreError::Changed`]), and is never mixed with old bytes.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

/// The `format` field of a manifest.
const FORMAT: &str = "sqcow2-layer-manifest";
/// The version written and the only one read.
const VERSION: u32 = 1;
/// Suffix of a manifest's key: the key of the highest layer it lists plus
/// this.
pub const MANIFEST_SUFFIX: &str = ".sqcow2-manifest";
/// Largest manifest read (bytes).
pub const MANIFEST_LIMIT: u64 = 256 << 20;

/// A manifest: the layers of one push.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    format: String,
    version: u32,
    /// The layers, highest first.
    pub layers: Vec<ManifestLayer>,
}

/// One layer of a manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ManifestLayer {
    /// Its URL, as the layer above names it.
    pub url: String,
    /// Its length in bytes.
    pub len: u64,
    /// Its version.
    pub etag: String,
    /// Byte ranges `[offset, len]` whose content the words give (every
    /// word of a range not listed is zero).
    pub ranges: Vec<[u64; 2]>,
    /// Non-zero 8-byte words `[offset, big-endian value]` of the ranges.
    pub words: Vec<[u64; 2]>,
}

impl Manifest {
    /// A manifest of `layers`, highest first.
    pub fn new(layers: Vec<ManifestLayer>) -> Self {
        Manifest {
            format: FORMAT.into(),
            version: VERSION,
            layers,
        }
    }

    /// Parses a manifest; an error says what is wrong.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if m.format != FORMAT || m.version != VERSION {
            return Err(format!("format {:?} version {}", m.format, m.version));
        }
        Ok(m)
    }

    /// Its bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Offsets of an L1 or L2 entry that point at a table or cluster.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const QCOW2_MAGIC: u32 = 0x5146_49fb;

impl ManifestLayer {
    /// The manifest entry of the qcow2 layer in `file` (the bytes
    /// uploaded as `url` at version `etag`).
    pub fn of_file(url: &str, etag: &str, file: &File) -> io::Result<Self> {
        let len = file.metadata()?.len();
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
        let mut header = [0u8; 48];
        file.read_exact_at(&mut header, 0)?;
        let be32 =
            |at: usize| u32::from_be_bytes(header[at..at + 4].try_into().unwrap_or_default());
        let be64 =
            |at: usize| u64::from_be_bytes(header[at..at + 8].try_into().unwrap_or_default());
        if be32(0) != QCOW2_MAGIC {
            return Err(bad("not a qcow2 image"));
        }
        let cluster_bits = be32(20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(bad("cluster size out of range"));
        }
        let cluster = 1u64 << cluster_bits;
        let (l1_size, l1_offset) = (u64::from(be32(36)), be64(40));
        if l1_size > (32 << 20) {
            return Err(bad("L1 table too large"));
        }
        let mut ranges = vec![(0, cluster.min(len))];
        if l1_size > 0 {
            ranges.push((l1_offset, l1_size * 8));
            let mut l1 = vec![0u8; (l1_size * 8) as usize];
            read_zero_filled(file, &mut l1, l1_offset, len)?;
            for e in l1.chunks_exact(8) {
                let table = u64::from_be_bytes(e.try_into().unwrap_or_default()) & OFFSET_MASK;
                if table != 0 && table < len {
                    ranges.push((table, cluster.min(len - table)));
                }
            }
        }
        let ranges = merge(ranges);
        let mut words = Vec::new();
        for &(start, n) in &ranges {
            let mut buf = vec![0u8; n as usize];
            read_zero_filled(file, &mut buf, start, len)?;
            for (i, w) in buf.chunks(8).enumerate() {
                let mut word = [0u8; 8];
                word[..w.len()].copy_from_slice(w);
                let v = u64::from_be_bytes(word);
                if v != 0 {
                    words.push([start + i as u64 * 8, v]);
                }
            }
        }
        Ok(ManifestLayer {
            url: url.into(),
            len,
            etag: etag.into(),
            ranges: ranges.into_iter().map(|(s, n)| [s, n]).collect(),
            words,
        })
    }
}

fn read_zero_filled(file: &File, buf: &mut [u8], offset: u64, len: u64) -> io::Result<()> {
    let n = len.saturating_sub(offset).min(buf.len() as u64) as usize;
    file.read_exact_at(&mut buf[..n], offset)?;
    buf[n..].fill(0);
    Ok(())
}

/// Sorted, non-overlapping ranges covering the same bytes.
fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.retain(|r| r.1 > 0);
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (s, n) in ranges {
        match out.last_mut() {
            Some(last) if s <= last.0 + last.1 => {
                last.1 = last.1.max(s + n - last.0);
            }
            _ => out.push((s, n)),
        }
    }
    out
}

/// The metadata a manifest gives of one object, checked, for reads.
#[derive(Debug, Default)]
pub(crate) struct KnownBytes {
    /// Sorted, non-overlapping `(start, len)`.
    ranges: Vec<(u64, u64)>,
    words: BTreeMap<u64, [u8; 8]>,
}

impl KnownBytes {
    /// The bytes `layer` gives of an object of `len` bytes; an error when
    /// the manifest contradicts itself or the object.
    pub(crate) fn of(layer: &ManifestLayer, len: u64) -> Result<Self, String> {
        let mut ranges: Vec<(u64, u64)> = Vec::with_capacity(layer.ranges.len());
        for &[s, n] in &layer.ranges {
            if n == 0 || s.checked_add(n).is_none_or(|end| end > len) {
                return Err(format!("range {s}+{n} past the object's {len} bytes"));
            }
            if ranges.last().is_some_and(|&(ls, ln)| s < ls + ln) {
                return Err("ranges out of order".into());
            }
            ranges.push((s, n));
        }
        let mut words = BTreeMap::new();
        for &[at, v] in &layer.words {
            let i = ranges.partition_point(|&(s, _)| s <= at);
            let inside = i > 0 && at % 8 == 0 && at < ranges[i - 1].0 + ranges[i - 1].1;
            if !inside {
                return Err(format!("word at {at} outside its ranges"));
            }
            words.insert(at, v.to_be_bytes());
        }
        Ok(KnownBytes { ranges, words })
    }

    /// Fills `buf` from `offset` if the manifest gives all of it.
    pub(crate) fn read(&self, offset: u64, buf: &mut [u8]) -> bool {
        let end = offset + buf.len() as u64;
        let i = self.ranges.partition_point(|&(s, _)| s <= offset);
        if i == 0 || end > self.ranges[i - 1].0 + self.ranges[i - 1].1 {
            return false;
        }
        buf.fill(0);
        for (&at, word) in self.words.range(offset & !7..end) {
            let from = offset.max(at);
            let to = end.min(at + 8);
            if from >= to {
                continue;
            }
            let dst = (from - offset) as usize..(to - offset) as usize;
            buf[dst].copy_from_slice(&word[(from - at) as usize..(to - at) as usize]);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_bytes_read_back_as_written() {
        let mut object = vec![0u8; 8192];
        for (i, b) in object.iter_mut().enumerate().skip(1000).take(600) {
            *b = (i * 7 % 251) as u8;
        }
        object[4100] = 9;
        let ranges = vec![[512, 2048], [4096, 512]];
        let mut words = Vec::new();
        for &[s, n] in &ranges {
            for at in (s..s + n).step_by(8) {
                let w =
                    u64::from_be_bytes(object[at as usize..at as usize + 8].try_into().unwrap());
                if w != 0 {
                    words.push([at, w]);
                }
            }
        }
        let layer = ManifestLayer {
            url: "u".into(),
            len: 8192,
            etag: "e".into(),
            ranges,
            words,
        };
        let known = KnownBytes::of(&layer, 8192).unwrap();
        for (off, n) in [(512, 2048), (997, 13), (1599, 2), (4096, 512), (4099, 3)] {
            let mut buf = vec![0xaa; n];
            assert!(known.read(off, &mut buf), "{off}+{n}");
            assert_eq!(buf, object[off as usize..off as usize + n], "{off}+{n}");
        }
        let mut buf = [0u8; 8];
        assert!(!known.read(2556, &mut buf) && !known.read(0, &mut buf));
        assert!(KnownBytes::of(&layer, 4000).is_err());
        let mut bad = layer.clone();
        bad.words.push([3000, 1]);
        assert!(KnownBytes::of(&bad, 8192).is_err());
        let round = Manifest::parse(&Manifest::new(vec![layer]).to_bytes()).unwrap();
        assert_eq!(round.layers[0].words.len(), round.layers[0].words.len());
        assert!(Manifest::parse(b"{\"format\":\"x\",\"version\":1,\"layers\":[]}").is_err());
    }
}
