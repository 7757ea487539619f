//! The persistent dirty bitmaps of a writable chain's top, edited as
//! `qemu-img bitmap` edits them ([`Chain::bitmaps`]): changes are kept
//! in memory and stored with the bits when the top is closed.

use std::ops::Range;

use serde::Serialize;

use crate::error::{Error, ErrorKind};
use crate::types::LayerIndex;

use super::Chain;

/// One kept bitmap, as `query-block` describes a dirty bitmap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct BitmapStatus {
    /// Its name.
    pub name: String,
    /// Bytes of guest data per bit.
    pub granularity: u64,
    /// Enabled: writes set its bits.
    pub recording: bool,
    /// In use when the image was opened (its writer died): unusable,
    /// never changed.
    pub inconsistent: bool,
    /// Guest bytes it marks dirty.
    pub count: u64,
}

/// A bitmap taken in by [`PersistentBitmaps::take_in_from`]; `ranges`
/// `None` when it cannot be used (inconsistent).
struct SourceBitmap {
    name: String,
    granularity: u64,
    enabled: bool,
    ranges: Option<Vec<Range<u64>>>,
}

/// The top's persistent bitmaps ([`Chain::bitmaps`]).
#[derive(Debug, Clone, Copy)]
pub struct PersistentBitmaps<'a> {
    pub(super) chain: &'a Chain,
}

impl PersistentBitmaps<'_> {
    fn kept(&self) -> Result<&crate::bitmaps::kept::KeptBitmaps, Error> {
        Ok(self.chain.active()?.bitmaps())
    }

    fn input<T>(&self, r: Result<T, ErrorKind>) -> Result<T, Error> {
        r.map_err(|k| Error::new(self.chain.top().path(), k))
    }

    /// The kept bitmaps, in directory order.
    pub fn list(&self) -> Result<Vec<BitmapStatus>, Error> {
        let size = self.chain.virtual_size();
        Ok(self
            .kept()?
            .list()
            .iter()
            .map(|b| {
                let granularity = 1u64 << b.granularity_bits;
                let count = b.bits.as_ref().map_or(0, |bits| {
                    crate::bitmaps::dirty_ranges(&bits.words(), granularity, size)
                        .iter()
                        .map(|r| r.end - r.start)
                        .sum()
                });
                BitmapStatus {
                    name: b.name.clone(),
                    granularity,
                    recording: b.is_enabled() && b.bits.is_some(),
                    inconsistent: b.bits.is_none(),
                    count,
                }
            })
            .collect())
    }

    /// The names of the kept bitmaps that can be used (consistent), in
    /// directory order; cheap (no bits looked at).
    pub fn usable_names(&self) -> Result<Vec<String>, Error> {
        Ok(self
            .kept()?
            .list()
            .iter()
            .filter(|b| b.bits.is_some())
            .map(|b| b.name.clone())
            .collect())
    }

    /// Writes the bitmaps into the image now (added ones appear, removed
    /// ones go), left in use: what a live edit does at once, so that a
    /// crash keeps it. Holds the flush order meanwhile.
    pub fn persist(&self) -> Result<(), Error> {
        self.chain.active()?.persist_bitmaps()
    }

    /// The dirty ranges of the stored bitmap `name` of the layer at
    /// `layer` below the top (as its file holds it); refused if it is in
    /// use there.
    pub fn dirty_in_layer(&self, layer: LayerIndex, name: &str) -> Result<Vec<Range<u64>>, Error> {
        let l = self
            .chain
            .layers()
            .get(layer.0)
            .ok_or_else(|| self.invalid(format!("no layer {}", layer.0)))?;
        let Some(header) = l.header() else {
            return Err(self.invalid(format!("{}: not a qcow2 image", l.path().display())));
        };
        let read = crate::bitmaps::read_dirty_ranges(header, &**l.storage(), name)
            .map_err(|k| Error::new(l.path(), k))?;
        if header.size != self.chain.virtual_size() {
            return Err(self.invalid("Bitmaps are incompatible and can't be merged".into()));
        }
        read.dirty.ok_or_else(|| {
            self.invalid(format!(
                "Bitmap '{name}' is inconsistent and cannot be used"
            ))
        })
    }

    /// Takes in the bitmaps of the layers of `old` from `from` up to its
    /// top (layers a commit or a merge folded into this chain's top), as
    /// libvirt does at the end of a block commit: each consistent one
    /// merged into the bitmap of its name here, which is added (same
    /// granularity, the enabled flag of the lowest layer holding it) where
    /// missing. A writable top's come from its writer's memory, the
    /// others from their files; inconsistent ones are skipped (reported
    /// in the returned list). Then written into the image.
    pub fn take_in_from(&self, old: &Chain, from: LayerIndex) -> Result<Vec<String>, Error> {
        let mut skipped = Vec::new();
        let top = old.top_index();
        let mut sources: Vec<SourceBitmap> = Vec::new();
        let from_files = if old.is_writable() { top.0 } else { top.0 + 1 };
        for i in from.0..from_files {
            let layer = &old.layers()[i];
            let Some(header) = layer.header() else {
                continue;
            };
            let infos = crate::bitmaps::describe_bitmaps(header, &**layer.storage())
                .map_err(|k| Error::new(layer.path(), k))?;
            for info in infos {
                let ranges = old.bitmaps().dirty_in_layer(LayerIndex(i), &info.name).ok();
                sources.push(SourceBitmap {
                    enabled: info.flags.contains(&"auto"),
                    name: info.name,
                    granularity: info.granularity,
                    ranges,
                });
            }
        }
        if old.is_writable() {
            for b in old.bitmaps().list()? {
                let ranges = (!b.inconsistent)
                    .then(|| old.bitmaps().dirty(&b.name))
                    .transpose()?;
                sources.push(SourceBitmap {
                    name: b.name,
                    granularity: b.granularity,
                    enabled: b.recording,
                    ranges,
                });
            }
        }
        let size = self.chain.virtual_size();
        for SourceBitmap {
            name,
            granularity,
            enabled,
            ranges,
        } in sources
        {
            let Some(ranges) = ranges else {
                skipped.push(name);
                continue;
            };
            if self.kept()?.get(&name).is_err() {
                self.add(&name, Some(granularity), enabled)?;
            }
            match self.merge(&name, &ranges, size) {
                Ok(()) => {}
                Err(e) if matches!(e.kind, ErrorKind::InvalidArgument(_)) => skipped.push(name),
                Err(e) => return Err(e),
            }
        }
        self.persist()?;
        Ok(skipped)
    }

    /// Adds here, empty and enabled, each bitmap that `old`'s writable
    /// top records into and this chain's top lacks, in memory only (no
    /// I/O: for a switch's pause, so that tracking goes on from the first
    /// request served; [`PersistentBitmaps::take_in_from`] merges the bits
    /// after).
    pub fn add_recording_of(&self, old: &Chain) -> Result<(), Error> {
        if old.is_writable() {
            self.chain.active()?.add_recording_of(old.active()?)?;
        }
        Ok(())
    }

    fn invalid(&self, message: String) -> Error {
        Error::new(self.chain.top().path(), ErrorKind::InvalidArgument(message))
    }

    /// Adds an empty bitmap `name` (QEMU's default granularity, the
    /// cluster size but at least 4 KiB, when `granularity` is `None`),
    /// enabled or not.
    pub fn add(&self, name: &str, granularity: Option<u64>, enabled: bool) -> Result<(), Error> {
        let cluster = self.chain.cluster_size();
        let granularity = granularity.unwrap_or(cluster.max(4096));
        let size = self.chain.virtual_size();
        self.input(self.kept()?.add(name, granularity, enabled, size, cluster))
    }

    /// Removes bitmap `name`.
    pub fn remove(&self, name: &str) -> Result<(), Error> {
        self.input(self.kept()?.remove(name).map(drop))
    }

    /// Clears every bit of bitmap `name`.
    pub fn clear(&self, name: &str) -> Result<(), Error> {
        self.input(self.kept()?.clear(name))
    }

    /// Enables or disables bitmap `name` (whether writes set its bits).
    pub fn set_enabled(&self, name: &str, enabled: bool) -> Result<(), Error> {
        self.input(self.kept()?.set_enabled(name, enabled))
    }

    /// [`PersistentBitmaps::dirty`] within the guest range `window` only
    /// (clipped to it; only its part of the bits read).
    pub fn dirty_in(&self, name: &str, window: Range<u64>) -> Result<Vec<Range<u64>>, Error> {
        let kept = self.kept()?;
        let b = self.input(kept.get_consistent(name))?;
        Ok(b.bits
            .as_ref()
            .map(|bits| bits.ranges_in(window))
            .unwrap_or_default())
    }

    /// The guest ranges bitmap `name` marks dirty now, merged, in order;
    /// refused for an inconsistent bitmap.
    pub fn dirty(&self, name: &str) -> Result<Vec<Range<u64>>, Error> {
        let kept = self.kept()?;
        let b = self.input(kept.get_consistent(name))?;
        let Some(bits) = &b.bits else {
            return Ok(Vec::new());
        };
        Ok(crate::bitmaps::dirty_ranges(
            &bits.words(),
            bits.granularity(),
            self.chain.virtual_size(),
        ))
    }

    /// Sets in bitmap `name` the bits of every granule of `ranges` (the
    /// dirty ranges of a source bitmap over a disk of `source_size`
    /// bytes, which must be this disk's size, as QEMU requires).
    pub fn merge(&self, name: &str, ranges: &[Range<u64>], source_size: u64) -> Result<(), Error> {
        if source_size != self.chain.virtual_size() {
            return self.input(Err(ErrorKind::InvalidArgument(
                "Bitmaps are incompatible and can't be merged".into(),
            )));
        }
        self.input(self.kept()?.merge_ranges(name, ranges))
    }
}
