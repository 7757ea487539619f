//! qcow2 feature bits: what each known bit means and which ones sqcow2 can
//! read.

use serde::Serialize;

/// Incompatible bit 0: the image was not closed cleanly (lazy refcounts).
pub(crate) const INCOMPAT_DIRTY: u64 = 1 << 0;
/// Incompatible bit 1: QEMU found the image corrupt.
pub(crate) const INCOMPAT_CORRUPT: u64 = 1 << 1;
/// Incompatible bit 2: guest data lives in an external data file.
pub(crate) const INCOMPAT_DATA_FILE: u64 = 1 << 2;
/// Incompatible bit 3: the compression type field is not deflate.
pub(crate) const INCOMPAT_COMPRESSION: u64 = 1 << 3;
/// Incompatible bit 4: 128-bit L2 entries with subclusters.
pub(crate) const INCOMPAT_EXTL2: u64 = 1 << 4;
/// Compatible bit 0: refcounts may be updated lazily.
pub(crate) const COMPAT_LAZY_REFCOUNTS: u64 = 1 << 0;
/// Autoclear bit 0: the bitmaps extension is consistent.
pub(crate) const AUTOCLEAR_BITMAPS: u64 = 1 << 0;
/// Autoclear bit 1: the external data file is raw-compatible.
pub(crate) const AUTOCLEAR_DATA_FILE_RAW: u64 = 1 << 1;
/// Autoclear bit 62 (sqcow2's): the image's mapping journal
/// (`<top>.sqjournal`) is current. A writer that does not know it clears
/// it, and the journal is then never replayed.
pub(crate) const AUTOCLEAR_JOURNAL: u64 = 1 << 62;
/// Autoclear bit 61 (sqcow2's): the file is a new image sqcow2 is still
/// making under its temporary name (`<name>.sqtmp`); cleared before it
/// is renamed to its name. It tells a killed operation's leftover from
/// any other file of that name.
pub(crate) const AUTOCLEAR_UNPUBLISHED: u64 = 1 << 61;

/// The three feature bit fields of a v3 header (all zero for v2).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct FeatureBits {
    /// Incompatible features: a reader that does not know a set bit must not
    /// open the image.
    pub incompatible: u64,
    /// Compatible features: may be ignored.
    pub compatible: u64,
    /// Autoclear features: cleared by a writer that does not know them.
    pub autoclear: u64,
}

/// Which of the three fields a feature bit belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FeatureKind {
    /// Incompatible feature.
    Incompatible,
    /// Compatible feature.
    Compatible,
    /// Autoclear feature.
    Autoclear,
}

impl FeatureKind {
    /// The kind of a feature name table entry's type byte.
    pub fn from_table_type(t: u8) -> Option<Self> {
        match t {
            0 => Some(Self::Incompatible),
            1 => Some(Self::Compatible),
            2 => Some(Self::Autoclear),
            _ => None,
        }
    }
}

/// Name of a feature bit QEMU defines, `None` for an unknown bit.
pub(crate) fn known_name(kind: FeatureKind, bit: u32) -> Option<&'static str> {
    match (kind, bit) {
        (FeatureKind::Incompatible, 0) => Some("dirty bit"),
        (FeatureKind::Incompatible, 1) => Some("corrupt bit"),
        (FeatureKind::Incompatible, 2) => Some("external data file"),
        (FeatureKind::Incompatible, 3) => Some("compression type"),
        (FeatureKind::Incompatible, 4) => Some("extended L2 entries"),
        (FeatureKind::Compatible, 0) => Some("lazy refcounts"),
        (FeatureKind::Autoclear, 0) => Some("bitmaps"),
        (FeatureKind::Autoclear, 1) => Some("raw external data"),
        _ => None,
    }
}

/// One set feature bit, described for read-outs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct SetFeature {
    /// Which field.
    pub kind: FeatureKind,
    /// Bit number.
    pub bit: u32,
    /// Name, from QEMU's list or the image's feature name table.
    pub name: Option<String>,
}

impl FeatureBits {
    /// Every set bit, with its name (from QEMU's list, else from `table`).
    pub fn describe(&self, table: &[FeatureNameEntry]) -> Vec<SetFeature> {
        let mut out = Vec::new();
        for (kind, value) in [
            (FeatureKind::Incompatible, self.incompatible),
            (FeatureKind::Compatible, self.compatible),
            (FeatureKind::Autoclear, self.autoclear),
        ] {
            for bit in 0..64 {
                if value & (1 << bit) != 0 {
                    let name = known_name(kind, bit)
                        .map(str::to_owned)
                        .or_else(|| lookup_name(table, kind, bit));
                    out.push(SetFeature { kind, bit, name });
                }
            }
        }
        out
    }
}

/// One entry of the feature name table header extension.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct FeatureNameEntry {
    /// Field the bit belongs to (`None` for a type byte QEMU does not define).
    pub kind: Option<FeatureKind>,
    /// Bit number.
    pub bit: u8,
    /// Name, up to 46 bytes.
    pub name: String,
}

/// The name an image's feature table gives a bit.
pub(crate) fn lookup_name(
    table: &[FeatureNameEntry],
    kind: FeatureKind,
    bit: u32,
) -> Option<String> {
    table
        .iter()
        .find(|e| e.kind == Some(kind) && u32::from(e.bit) == bit)
        .map(|e| e.name.clone())
}
