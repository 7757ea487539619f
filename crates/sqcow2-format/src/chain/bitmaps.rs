//! The persistent dirty bitmaps of a writable chain's top, edited as
//! `qemu-img bitmap` edits them ([`Chain::bitmaps`]): changes are kept
//! in memory and stored with the bits when the top is closed.

use std::ops::Range;

use crate::error::{Error, ErrorKind};

use super::Chain;

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
