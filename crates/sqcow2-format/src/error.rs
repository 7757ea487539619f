//! Typed errors of the format crate.
//!
//! Every error names the file it concerns ([`Error::path`]) and what is wrong
//! with it ([`ErrorKind`]), so that a caller can print one line that a user
//! understands and a test can match the exact problem.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// An error about one file of a chain.
#[derive(Debug, thiserror::Error)]
pub struct Error {
    /// The file the error is about.
    pub path: PathBuf,
    /// What is wrong (its text is part of this error's message, so it is not
    /// also reported as the source).
    pub kind: ErrorKind,
}

impl Error {
    /// Attaches a path to an error kind.
    pub fn new(path: impl Into<PathBuf>, kind: ErrorKind) -> Self {
        Self {
            path: path.into(),
            kind,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.kind)
    }
}

/// Attaches a path to the error of a result.
pub(crate) trait WithPath<T> {
    fn with_path(self, path: &Path) -> Result<T, Error>;
}

impl<T> WithPath<T> for Result<T, ErrorKind> {
    fn with_path(self, path: &Path) -> Result<T, Error> {
        self.map_err(|kind| Error::new(path, kind))
    }
}

impl From<io::Error> for ErrorKind {
    fn from(e: io::Error) -> Self {
        match e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<NotRegular>())
        {
            Some(NotRegular(kind)) => ErrorKind::NotRegularFile(kind),
            None => ErrorKind::Io(e),
        }
    }
}

/// The payload of the I/O error of an open that found no regular file.
#[derive(Debug)]
pub(crate) struct NotRegular(pub(crate) &'static str);

impl fmt::Display for NotRegular {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not a regular file ({})", self.0)
    }
}

impl std::error::Error for NotRegular {}

/// A qcow2 metadata table, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Table {
    /// The active L1 table.
    L1,
    /// An L2 table.
    L2,
    /// The refcount table.
    Refcount,
    /// The internal snapshot table.
    Snapshots,
    /// The bitmap directory.
    BitmapDirectory,
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Table::L1 => "L1 table",
            Table::L2 => "L2 table",
            Table::Refcount => "refcount table",
            Table::Snapshots => "snapshot table",
            Table::BitmapDirectory => "bitmap directory",
        })
    }
}

/// What is wrong with a file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The operating system refused an operation.
    #[error("I/O error: {0}")]
    Io(io::Error),
    /// The caller's arguments do not fit the images (a layer past the
    /// chain, a file not in it): a mistake in the input, not a problem
    /// of the files.
    #[error("{0}")]
    InvalidArgument(String),
    /// Not a regular file (a FIFO, a socket, a device, a directory): never
    /// opened as an image or a side file (a FIFO's open would wait
    /// forever).
    #[error("not a regular file ({0}): refused")]
    NotRegularFile(&'static str),
    /// The file ends before the structure that was read.
    #[error(
        "file truncated: {what} needs {needed} bytes at offset {offset:#x}, file has {file_size}"
    )]
    Truncated {
        /// What was read.
        what: &'static str,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        needed: u64,
        /// The size of the file.
        file_size: u64,
    },
    /// The file does not start with the qcow2 magic.
    #[error("not a qcow2 image (bad magic {0:#010x})")]
    BadMagic(u32),
    /// A qcow2 version other than 2 or 3.
    #[error("unsupported qcow2 version {0}")]
    UnsupportedVersion(u32),
    /// `cluster_bits` outside 9..=21.
    #[error("cluster_bits {0} out of range (9 to 21)")]
    ClusterBits(u32),
    /// A header field with a value QEMU rejects.
    #[error("invalid header field {field}: {reason}")]
    InvalidHeader {
        /// Field name as in the qcow2 specification.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// The virtual size does not fit the format's limits.
    #[error("virtual size {0} too large")]
    SizeTooLarge(u64),
    /// The L1 table cannot address the whole virtual disk.
    #[error("L1 table too small: {l1_size} entries, {needed} needed for the virtual size")]
    L1TooSmall {
        /// Entries in the header.
        l1_size: u32,
        /// Entries needed.
        needed: u64,
    },
    /// A table with more entries than the format allows.
    #[error("{table} too large: {entries} entries (at most {max})")]
    TableTooLarge {
        /// Which table.
        table: Table,
        /// Entries in the header.
        entries: u64,
        /// The maximum.
        max: u64,
    },
    /// A table offset that is not cluster aligned.
    #[error("{table} offset {offset:#x} is not cluster aligned")]
    UnalignedTable {
        /// Which table.
        table: Table,
        /// Its offset.
        offset: u64,
    },
    /// A table that extends beyond the end of the file.
    #[error("{table} at {offset:#x} ({len} bytes) extends beyond the end of the file ({file_size} bytes)")]
    TableBeyondEof {
        /// Which table.
        table: Table,
        /// Its offset.
        offset: u64,
        /// Its length in bytes.
        len: u64,
        /// The size of the file.
        file_size: u64,
    },
    /// A table that overlaps the header cluster.
    #[error("{table} at {offset:#x} overlaps the image header")]
    TableOverlapsHeader {
        /// Which table.
        table: Table,
        /// Its offset.
        offset: u64,
    },
    /// A data cluster offset that is not cluster aligned.
    #[error("data cluster offset {host_offset:#x} for guest offset {guest_offset:#x} is not cluster aligned")]
    UnalignedCluster {
        /// The guest offset being resolved.
        guest_offset: u64,
        /// The host offset in the L2 entry.
        host_offset: u64,
    },
    /// A data cluster that an L2 entry places at or beyond the end of the
    /// file (one that only ends past it is valid), found when writing to
    /// it.
    #[error("data cluster {host_offset:#x} for guest offset {guest_offset:#x} lies beyond the end of the file ({file_size} bytes)")]
    ClusterBeyondEof {
        /// The guest offset being written.
        guest_offset: u64,
        /// The host offset in the L2 entry.
        host_offset: u64,
        /// The size of the file.
        file_size: u64,
    },
    /// An extended L2 entry whose bitmap QEMU treats as invalid.
    #[error("invalid subcluster bitmap {bitmap:#018x} for guest offset {guest_offset:#x}")]
    InvalidSubclusterBitmap {
        /// The guest offset being resolved.
        guest_offset: u64,
        /// The bitmap word.
        bitmap: u64,
    },
    /// A compressed cluster descriptor that points outside the file.
    #[error("compressed cluster at {offset:#x} ({len} bytes) lies beyond the end of the file ({file_size} bytes)")]
    CompressedBeyondEof {
        /// Host offset of the compressed data.
        offset: u64,
        /// Length of the compressed data.
        len: u64,
        /// The size of the file.
        file_size: u64,
    },
    /// Compressed data that does not decompress into exactly one cluster.
    #[error("compressed cluster at {offset:#x} does not decompress ({algorithm}): {reason}")]
    Decompression {
        /// Host offset of the compressed data.
        offset: u64,
        /// `deflate` or `zstd`.
        algorithm: &'static str,
        /// What the decompressor said.
        reason: String,
    },
    /// A feature sqcow2 does not implement.
    #[error("unsupported feature: {0}")]
    Unsupported(Feature),
    /// A header extension that is malformed.
    #[error("invalid header extension {ext_type:#010x} at offset {offset:#x}: {reason}")]
    InvalidExtension {
        /// Extension type.
        ext_type: u32,
        /// Offset of the extension in the header cluster.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// The backing file name is too long or lies outside the header cluster.
    #[error("backing file name invalid: {0}")]
    InvalidBackingName(String),
    /// The backing file named by the image does not exist or cannot be opened.
    #[error("cannot open backing file {backing}: {source}")]
    MissingBacking {
        /// The resolved backing path.
        backing: PathBuf,
        /// Why it could not be opened.
        source: io::Error,
    },
    /// A backing file that uses a protocol prefix (`nbd:`, `json:`, ...).
    #[error("backing file {0:?} uses a protocol prefix, which is not supported")]
    BackingProtocol(String),
    /// A backing file named by URL (a layer in an object store) in a
    /// process not set up to fetch it.
    #[error("backing file {0} is in an object store: give `--remote-cache DIR` (or SQCOW2_REMOTE_CACHE) and the store's credentials to read it")]
    RemoteNotEnabled(String),
    /// A backing format that is not `qcow2` or `raw`.
    #[error("backing format {0:?} is not supported (qcow2 and raw are)")]
    UnsupportedBackingFormat(String),
    /// A backing file whose format is not recorded and that is not qcow2.
    #[error("backing file {0} has no recorded format and is not qcow2 (raw is never guessed)")]
    UnknownBackingFormat(PathBuf),
    /// A backing file recorded as qcow2 that is not qcow2.
    #[error("backing file {0} is recorded as qcow2 but is not a qcow2 image")]
    BackingNotQcow2(PathBuf),
    /// A chain that comes back to a file already in it.
    #[error("backing chain loop: {0} is already in the chain")]
    BackingLoop(PathBuf),
    /// A backing file outside the directory backing files must live in.
    #[error("backing file {backing} resolves to {resolved}, outside the allowed root {root} (--backing-root widens it)")]
    BackingOutsideRoot {
        /// The backing file as named.
        backing: PathBuf,
        /// Where it really is (symlinks resolved).
        resolved: PathBuf,
        /// The allowed root.
        root: PathBuf,
    },
    /// The L1 tables of a chain's layers, together, exceed the limit (a
    /// chain of many huge tables would exhaust memory).
    #[error("L1 tables of the chain take {bytes} bytes, more than the limit of {limit}")]
    ChainMetadataTooLarge {
        /// L1 bytes of the layers opened so far.
        bytes: u64,
        /// The configured limit.
        limit: u64,
    },
    /// A lookup that may not wait found metadata it would have to read
    /// from a file (not an error of the image: the caller retries where
    /// waiting is allowed).
    #[error("metadata not cached: a non-blocking lookup would have to read it")]
    WouldBlock,
    /// A layer's L1 table, read when first needed, is not the one it had
    /// when the chain was opened: another program changed the file.
    #[error("the image changed since the chain was opened (its L1 table no longer matches)")]
    LayerChanged,
    /// A file is where sqcow2 would make one of its own (a new image, its
    /// index, journal or temporary file): refused, the file untouched.
    #[error("{role} goes here, but this is {found}: refused, the file left as it is")]
    NameInUse {
        /// What sqcow2 would put there.
        role: String,
        /// What is there.
        found: String,
    },
    /// Another file is at the name of a file opened before (or made by
    /// this process): refused before anything is read or written.
    #[error("not the file expected: another file was put at this name (nothing read or written)")]
    FileReplaced,
    /// A chain index that cannot serve this chain.
    #[error("chain index not usable: {0}")]
    IndexStale(String),
    /// A chain with more layers than the configured limit.
    #[error("backing chain longer than the limit of {limit} layers")]
    ChainTooDeep {
        /// The configured limit.
        limit: usize,
    },
    /// A write to a chain opened read-only.
    #[error("image opened read-only")]
    ReadOnly,
    /// Writes are refused until the image is reopened: the metadata in
    /// memory may be inconsistent (an internal error interrupted an
    /// update). Nothing more is written back.
    #[error("writes refused until the image is reopened: {reason}")]
    EngineFailed {
        /// What happened.
        reason: String,
    },
    /// An L2 entry of the top points at the top's own metadata (header,
    /// tables, refcount blocks): the image is corrupt, and writing there
    /// would destroy it.
    #[error("the mapping of guest offset {guest_offset:#x} points at the image's own metadata (host offset {host_offset:#x}): the image is corrupt ('qemu-img check -r all' repairs it)")]
    MetadataOverlap {
        /// The guest offset being written.
        guest_offset: u64,
        /// The host offset its entry names.
        host_offset: u64,
    },
    /// Another process (or another open of the file) holds a permission
    /// this open conflicts with (QEMU's image locks).
    #[error("failed to get {}\"{permission}\" lock: another process is using the image", if *shared { "shared " } else { "" })]
    Locked {
        /// The permission, as QEMU names it ("write", "consistent read", ...).
        permission: &'static str,
        /// Whether the conflict is on a permission this open does not
        /// share (someone holds it) rather than one it wants.
        shared: bool,
    },
    /// A slice size that is not a power of two of at least 512 bytes (as
    /// QEMU requires of its L2 cache entries).
    #[error("slice size {0} is not a power of two of at least 512 bytes")]
    SliceSize(u64),
    /// `--force-share` asked for an image opened for writing.
    #[error("force-share can only be used with read-only images")]
    ForceShareWritable,
    /// `--locking on` where the filesystem cannot lock.
    #[error("image locking is not supported here ({0}); --locking auto or off goes without")]
    LockingUnsupported(io::Error),
    /// A transfer ticket issued by another chain (a bug in the caller).
    #[error("transfer ticket of another chain")]
    ForeignTicket,
    /// A read outside the virtual disk.
    #[error("request at {offset:#x} ({len} bytes) is beyond the virtual size {size}")]
    OutOfRange {
        /// Guest offset.
        offset: u64,
        /// Request length.
        len: u64,
        /// Virtual size.
        size: u64,
    },
}

impl Error {
    /// Whether the error is about the image's backing chain rather than
    /// the image itself: a layer below it, or the backing file it names
    /// (missing, of the wrong format, a loop, too deep, ...). `qemu-img
    /// info` (which does not open the chain) shows such an image; `qemu-img
    /// check` (which does) fails on it.
    pub fn concerns_the_backing_chain_of(&self, image: &std::path::Path) -> bool {
        self.path != image
            || matches!(
                self.kind,
                ErrorKind::MissingBacking { .. }
                    | ErrorKind::BackingProtocol(_)
                    | ErrorKind::RemoteNotEnabled(_)
                    | ErrorKind::UnsupportedBackingFormat(_)
                    | ErrorKind::UnknownBackingFormat(_)
                    | ErrorKind::BackingNotQcow2(_)
                    | ErrorKind::BackingLoop(_)
                    | ErrorKind::BackingOutsideRoot { .. }
                    | ErrorKind::ChainTooDeep { .. }
                    | ErrorKind::ChainMetadataTooLarge { .. }
            )
    }
}

/// A qcow2 feature that sqcow2 does not implement, named in errors.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Feature {
    /// AES encryption (crypt_method 1).
    AesEncryption,
    /// LUKS encryption (crypt_method 2).
    LuksEncryption,
    /// A crypt_method value that no QEMU defines.
    UnknownEncryption(u32),
    /// The external data file (incompatible bit 2).
    ExternalDataFile,
    /// The corrupt bit (incompatible bit 1) is set.
    CorruptBit,
    /// An incompatible feature bit sqcow2 does not know, with its name from
    /// the image's feature name table when it has one.
    UnknownIncompatible {
        /// Bit number.
        bit: u32,
        /// Name from the feature name table.
        name: Option<String>,
    },
    /// A compression type other than deflate (0) and zstd (1).
    UnknownCompressionType(u8),
    /// Committing into a base smaller than the image whose L1 table would
    /// have to move to grow (or that has internal snapshots).
    CommitGrowsBase,
    /// Growing an image past what its L1 table addresses without moving
    /// (`most` bytes).
    GrowMovesL1 {
        /// The largest size reachable in place.
        most: u64,
    },
    /// Resizing a version 2 image that has internal snapshots (as QEMU
    /// refuses it).
    ResizeV2WithSnapshots,
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Feature::AesEncryption => f.write_str("AES encryption"),
            Feature::LuksEncryption => f.write_str("LUKS encryption"),
            Feature::UnknownEncryption(m) => write!(f, "unknown encryption method {m}"),
            Feature::ExternalDataFile => f.write_str("external data file"),
            Feature::CommitGrowsBase => {
                f.write_str(
                    "committing into a smaller base whose L1 table would have to move to grow, or that has internal snapshots",
                )
            }
            Feature::GrowMovesL1 { most } => write!(
                f,
                "growing past {most} bytes (the L1 table would have to move: resize offline)"
            ),
            Feature::ResizeV2WithSnapshots => {
                f.write_str("Can't resize a v2 image which has snapshots")
            }
            Feature::CorruptBit => {
                f.write_str("image is marked corrupt: only read; `sqcow2 check -r all` (or qemu-img's) repairs it")
            }
            Feature::UnknownIncompatible {
                bit,
                name: Some(name),
            } => write!(f, "incompatible feature bit {bit} ({name})"),
            Feature::UnknownIncompatible { bit, name: None } => {
                write!(f, "unknown incompatible feature bit {bit}")
            }
            Feature::UnknownCompressionType(t) => write!(f, "compression type {t}"),
        }
    }
}
