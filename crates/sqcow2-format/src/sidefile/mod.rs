//! The files sqcow2 keeps beside an image, and how it owns them.
//!
//! For an image file named `N` (its last path component), in `N`'s
//! directory:
//!
//! | file | what |
//! |---|---|
//! | `N.sqidx` | the chain index (the name the image's header records) |
//! | `N.sqidx.tmp` | an index being written, renamed to `N.sqidx` when complete |
//! | `N.sqjournal` | the mapping journal of a writer of `N` |
//! | `N.sqtmp` | `N` being made (snapshot, merge), renamed to `N` when complete |
//! | `N.sqtmp.sqjournal` | the journal of that writer of `N.sqtmp` (merge) |
//!
//! No suffix is a proper suffix of another (`.sqtmp.sqjournal` is the
//! journal of the file `N.sqtmp`, the same file whichever way it is
//! read), so no two images can have side files of the same name in two
//! roles. A file of any name can still be in the way (an image named
//! `N.sqidx`, a user's file): sqcow2 creates each side file exclusively
//! (`O_EXCL|O_NOFOLLOW`) from a directory it opened once ([`Dir`]),
//! replaces or removes one only after reading its header (it must be one
//! of its own: index, journal, or a temporary image marked unpublished)
//! and checking it is still the same file, and refuses, in one line
//! naming the file, to make a new image whose name or side files are
//! taken by anything else.
//!
//! A temporary file (`N.sqtmp`, `N.sqidx.tmp`) is held by its maker with
//! an open-file-description write lock on byte [`OWNER_BYTE`], so another
//! process (or another operation of the same process) never mistakes it
//! for the leftover of a killed one: a leftover is recognised by its
//! header, an owner lock nobody holds, and is removed by the next
//! operation that makes the same file.

pub(crate) mod dir;

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, ErrorKind};

pub(crate) use dir::{Dir, EntryKind, FileId};

/// The suffix of an index's name.
pub(crate) const INDEX_SUFFIX: &str = ".sqidx";
/// The suffix of a journal's name.
pub(crate) const JOURNAL_SUFFIX: &str = ".sqjournal";
/// The suffix of a new image's name while it is made.
pub(crate) const TEMPORARY_SUFFIX: &str = ".sqtmp";
/// The suffix of an index's temporary name (after the index's name).
pub(crate) const INDEX_TEMPORARY_SUFFIX: &str = ".tmp";

/// The byte a maker of a temporary file write-locks (an open file
/// description lock) for as long as it makes the file: far from QEMU's
/// image lock bytes (100-299).
pub(crate) const OWNER_BYTE: i64 = 0x5351_5400;

fn with_suffix(name: &OsStr, suffix: &str) -> OsString {
    let mut n = name.to_os_string();
    n.push(suffix);
    n
}

/// `N.sqidx` for the image `N`.
pub(crate) fn index_name(image: &OsStr) -> OsString {
    with_suffix(image, INDEX_SUFFIX)
}

/// `N.sqjournal` for the image `N`.
pub(crate) fn journal_name(image: &OsStr) -> OsString {
    with_suffix(image, JOURNAL_SUFFIX)
}

/// `N.sqtmp` for the image `N`.
pub(crate) fn temporary_name(image: &OsStr) -> OsString {
    with_suffix(image, TEMPORARY_SUFFIX)
}

/// `I.tmp` for the index `I`.
pub(crate) fn index_temporary_name(index: &OsStr) -> OsString {
    with_suffix(index, INDEX_TEMPORARY_SUFFIX)
}

/// Where an image file is: its directory, opened once, and its name in
/// it. Its side files are made there, by name.
#[derive(Debug, Clone)]
pub(crate) struct ImagePlace {
    dir: Arc<Dir>,
    name: OsString,
    /// A new image this process is making (its temporary file, marked
    /// unpublished in its header), not an image yet.
    unpublished: bool,
}

impl ImagePlace {
    /// The place of the image at `path`: its directory as named, or, where
    /// the name is a symlink, the place of the file it names (where any
    /// writer of that file keeps its side files, whatever name it was
    /// opened by).
    pub(crate) fn of(path: &Path) -> io::Result<ImagePlace> {
        let (dir, name) = Dir::of_file(&side_files_path(path)?)?;
        Ok(ImagePlace {
            dir: Arc::new(dir),
            name,
            unpublished: false,
        })
    }

    /// The image `name` in `dir`.
    pub(crate) fn new(dir: Arc<Dir>, name: OsString) -> ImagePlace {
        ImagePlace {
            dir,
            name,
            unpublished: false,
        }
    }

    /// Whether it is a new image's temporary file this process makes.
    pub(crate) fn is_unpublished(&self) -> bool {
        self.unpublished
    }

    /// Its directory.
    pub(crate) fn dir(&self) -> &Arc<Dir> {
        &self.dir
    }

    /// The image's file name.
    pub(crate) fn name(&self) -> &OsStr {
        &self.name
    }

    /// The image's path, as its directory was named.
    pub(crate) fn path(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    /// Its journal's name.
    pub(crate) fn journal(&self) -> OsString {
        journal_name(&self.name)
    }

    /// Opens the image itself by its name in its directory (the file's
    /// own name: a symlink at the name the caller gave was resolved when
    /// the place was found, so a symlink here now is refused, never
    /// followed), refused unless a regular file.
    pub(crate) fn open_image(&self, write: bool) -> io::Result<File> {
        self.dir.open_file(&self.name, write)
    }

    /// The place of the image at `path` inside `root` (a daemon's backing
    /// root): its real directory opened from the root's descriptor, no
    /// symlink followed; refused (`PermissionDenied`) outside it.
    pub(crate) fn beneath(root: &Dir, root_path: &Path, path: &Path) -> io::Result<ImagePlace> {
        let real = side_files_path(path)?;
        let name = dir::file_name(&real)?.to_os_string();
        let parent = real.parent().unwrap_or(Path::new(""));
        let dir = Dir::beneath(root, root_path, parent)?;
        Ok(ImagePlace::new(Arc::new(dir), name))
    }
}

/// The first bytes of a mapping journal (`active/journal.rs` writes it):
/// how a side file is recognised as one.
pub(crate) const JOURNAL_MAGIC: &[u8; 8] = b"SQJOURNL";

/// Whether the journal in `file` names the image file `id` (device and
/// inode at bytes 40..56 of its header, which must be a journal's).
pub(crate) fn journal_names_file(file: &File, id: (u64, u64)) -> bool {
    let be64 = |b: &[u8]| b.try_into().map_or(0, u64::from_be_bytes);
    let mut h = [0u8; 64];
    file.read_exact_at(&mut h, 0).is_ok()
        && &h[0..8] == JOURNAL_MAGIC
        && (be64(&h[40..48]), be64(&h[48..56])) == id
}

/// Where the side files of the image named `path` are named from: `path`,
/// or where its last component is a symlink, the file it names (resolved).
pub(crate) fn side_files_path(path: &Path) -> io::Result<PathBuf> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path),
        _ => Ok(path.to_path_buf()),
    }
}

/// Opens the side file at `path` for reading: a regular file, never
/// through a symlink at its name, never waiting on a FIFO.
pub(crate) fn open_side_file(path: &Path) -> io::Result<File> {
    let (dir, name) = Dir::of_file(path)?;
    dir.open_file(&name, false)
}

/// What a side file is, in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The new image itself.
    Image,
    Index,
    IndexTemporary,
    Journal,
    Temporary,
    TemporaryJournal,
}

impl Role {
    fn describe(self) -> &'static str {
        match self {
            Role::Image => "the new image",
            Role::Index => "the chain index of",
            Role::IndexTemporary => "the index being written of",
            Role::Journal => "the mapping journal of",
            Role::Temporary => "the file being made of",
            Role::TemporaryJournal => "the journal of the file being made of",
        }
    }

    /// The header a file of this role has when sqcow2 made it.
    fn content(self) -> Option<Content> {
        match self {
            Role::Image => None,
            Role::Index | Role::IndexTemporary => Some(Content::Index),
            Role::Journal | Role::TemporaryJournal => Some(Content::Journal),
            Role::Temporary => Some(Content::Unpublished),
        }
    }
}

/// The header of a file sqcow2 makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Content {
    /// A chain index (its magic; a temporary one has it from the start).
    Index,
    /// A mapping journal (its magic).
    Journal,
    /// A qcow2 v3 image with the unpublished autoclear bit: a temporary
    /// file of a new image.
    Unpublished,
}

impl Content {
    fn describe(self) -> &'static str {
        match self {
            Content::Index => "a chain index",
            Content::Journal => "a mapping journal",
            Content::Unpublished => "an sqcow2 temporary image",
        }
    }

    /// Whether `file` starts with this header.
    pub(crate) fn is_in(self, file: &File) -> bool {
        let mut h = [0u8; 96];
        let n = match read_prefix(file, &mut h) {
            Ok(n) => n,
            Err(_) => return false,
        };
        let h = &h[..n];
        match self {
            Content::Index => h.starts_with(crate::index::INDEX_MAGIC),
            Content::Journal => h.starts_with(JOURNAL_MAGIC),
            Content::Unpublished => {
                use crate::header::{field, QCOW2_MAGIC};
                h.len() >= 96
                    && crate::bytes::be_u32(h, field::MAGIC) == QCOW2_MAGIC
                    && crate::bytes::be_u32(h, field::VERSION) == 3
                    && crate::bytes::be_u64(h, field::AUTOCLEAR_FEATURES)
                        & crate::features::AUTOCLEAR_UNPUBLISHED
                        != 0
            }
        }
    }
}

fn read_prefix(file: &File, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Whether the maker of a temporary file still holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// Nobody holds it (now this description does): its maker is gone.
    Gone,
    /// Another open file description holds it: its maker is alive.
    Alive,
    /// The filesystem has no file locks: nobody can tell.
    Unknown,
}

/// Takes the owner lock of a temporary file: whether its maker is gone.
pub(crate) fn take_owner_lock(file: &File) -> io::Result<Owner> {
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = OWNER_BYTE;
    fl.l_len = 1;
    loop {
        // SAFETY: fcntl on a descriptor `file` owns, with a pointer to a
        // valid `flock` for the duration of the call.
        let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
        if r == 0 {
            return Ok(Owner::Gone);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) | Some(libc::EACCES) => return Ok(Owner::Alive),
            Some(libc::ENOLCK) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => {
                return Ok(Owner::Unknown)
            }
            _ => return Err(e),
        }
    }
}

/// Why a name is in the way.
fn collision(dir: &Dir, name: &OsStr, image: &OsStr, role: Role, found: &str) -> Error {
    Error::new(
        dir.join(name),
        ErrorKind::NameInUse {
            role: match role {
                Role::Image => role.describe().to_owned(),
                _ => format!("{} {}", role.describe(), Path::new(image).display()),
            },
            found: found.to_owned(),
        },
    )
}

fn io_error(dir: &Dir, name: &OsStr) -> impl Fn(io::Error) -> Error {
    let path = dir.join(name);
    move |e| Error::new(&path, ErrorKind::Io(e))
}

/// A file found at a side file's name.
enum Found {
    Nothing,
    /// One of sqcow2's own, of the role's kind: opened (and, for a
    /// temporary, its owner lock held).
    Own(File, FileId),
}

/// Looks at `name` in `dir`, where a file of `role` for the image `image`
/// goes: nothing, or sqcow2's own file of that kind (for a temporary: not
/// in use), else the collision, naming what is there (a layer of the chain
/// when its identity is one of `layers`).
fn look(
    dir: &Dir,
    name: &OsStr,
    image: &OsStr,
    role: Role,
    layers: &[FileId],
) -> Result<Found, Error> {
    let Some(entry) = dir.entry(name).map_err(io_error(dir, name))? else {
        return Ok(Found::Nothing);
    };
    let refuse = |found: &str| collision(dir, name, image, role, found);
    if layers.contains(&entry.id) {
        return Err(refuse("a layer of the chain"));
    }
    if entry.kind != EntryKind::Regular {
        return Err(refuse(entry.kind.describe()));
    }
    if entry.links != 1 {
        // Writing it, or removing it, would reach its other names.
        return Err(refuse("a file with other names (hard links)"));
    }
    let Some(content) = role.content() else {
        return Err(refuse("an existing file"));
    };
    let file = dir
        .open_file(name, true)
        .or_else(|_| dir.open_file(name, false))
        .map_err(io_error(dir, name))?;
    let id = file_id(&file).map_err(io_error(dir, name))?;
    if id != entry.id {
        return Err(refuse("a file that changed while it was looked at"));
    }
    if !content.is_in(&file) {
        return Err(refuse(&format!(
            "a file sqcow2 did not make (not {})",
            content.describe()
        )));
    }
    if matches!(role, Role::Temporary | Role::IndexTemporary) {
        match take_owner_lock(&file).map_err(io_error(dir, name))? {
            Owner::Gone => {}
            Owner::Alive => return Err(refuse("in use by another process or operation")),
            Owner::Unknown => {
                return Err(refuse(
                    "perhaps in use: this filesystem has no file locks to tell (remove it if no sqcow2 operation runs)",
                ))
            }
        }
    }
    Ok(Found::Own(file, id))
}

/// The identity of an open file.
pub(crate) fn file_id(file: &File) -> io::Result<FileId> {
    use std::os::unix::fs::MetadataExt;
    let m = file.metadata()?;
    Ok((m.dev(), m.ino()))
}

/// Removes the leftover `name` of a killed operation (sqcow2's own file of
/// `role`'s kind, not in use), if any; anything else there is refused.
fn clear_leftover(
    dir: &Dir,
    name: &OsStr,
    image: &OsStr,
    role: Role,
    layers: &[FileId],
) -> Result<(), Error> {
    if let Found::Own(_file, id) = look(dir, name, image, role, layers)? {
        // Removed while its owner lock is held (the file stays open).
        if dir.remove(name, id).map_err(io_error(dir, name))? {
            tracing::info!(path = %dir.join(name).display(), "removed what a killed operation left");
        }
    }
    Ok(())
}

/// Checks, before anything is written, that the new image `image` can be
/// made in `dir`: nothing at its name, its index's, its journal's (`N`,
/// `N.sqidx`, `N.sqjournal`), and at its temporary names (`N.sqtmp`,
/// `N.sqtmp.sqjournal`, `N.sqidx.tmp`) nothing or the leftovers of a
/// killed operation, which are then removed. `layers`: the chain's files,
/// named as such in a refusal.
pub(crate) fn make_way_for_image(dir: &Dir, image: &OsStr, layers: &[FileId]) -> Result<(), Error> {
    if !dir::is_plain_name(image) {
        return Err(Error::new(
            dir.join(image),
            ErrorKind::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a file name",
            )),
        ));
    }
    if is_temporary_name(image) {
        return Err(collision(
            dir,
            image,
            image,
            Role::Image,
            &format!("a name sqcow2 keeps for files being made (`*{TEMPORARY_SUFFIX}`)"),
        ));
    }
    let index = index_name(image);
    let taken = [
        (image.to_os_string(), Role::Image),
        (index.clone(), Role::Index),
        (journal_name(image), Role::Journal),
    ];
    let tmp = temporary_name(image);
    let leftovers = [
        (tmp.clone(), Role::Temporary),
        (journal_name(&tmp), Role::TemporaryJournal),
        (index_temporary_name(&index), Role::IndexTemporary),
    ];
    for (name, role) in &taken {
        if let Some(entry) = dir.entry(name).map_err(io_error(dir, name))? {
            let own = || {
                let content = role.content()?;
                let file = dir.open_file(name, false).ok()?;
                content.is_in(&file).then_some(content)
            };
            let found = if layers.contains(&entry.id) {
                "a layer of the chain"
            } else if entry.kind != EntryKind::Regular {
                entry.kind.describe()
            } else if let Some(content) = own() {
                match content {
                    Content::Index => "an index sqcow2 wrote for an earlier image of that name (remove it if that image is gone)",
                    _ => "a journal an earlier writer of an image of that name left (remove it if that image is gone)",
                }
            } else {
                "an existing file"
            };
            return Err(collision(dir, name, image, *role, found));
        }
    }
    // Every leftover recognised before any is removed.
    let mut held = Vec::new();
    for (name, role) in &leftovers {
        if let Found::Own(file, id) = look(dir, name, image, *role, layers)? {
            held.push((name, file, id));
        }
    }
    for (name, _file, id) in held {
        if dir.remove(name, id).map_err(io_error(dir, name))? {
            tracing::info!(path = %dir.join(name).display(), "removed what a killed operation left");
        }
    }
    Ok(())
}

/// Removes from the directory `dir` what killed operations left there:
/// temporary images (`*.sqtmp`, marked unpublished in their header),
/// temporary indexes (`*.sqidx.tmp`, an index's magic), each only if its
/// maker's owner lock is free (nobody makes it now), and the journals of
/// temporary images (`*.sqtmp.sqjournal`, a journal's magic) whose image
/// is gone or is itself a leftover. Nothing else is touched. Returns the
/// paths removed.
/// `keep`: files never removed (the chain a caller serves).
pub(crate) fn remove_leftovers(dir: &Dir, keep: &[(u64, u64)]) -> Result<Vec<PathBuf>, Error> {
    let names = dir.names().map_err(|e| Error::new(dir.path(), e.into()))?;
    let mut removed = Vec::new();
    let mut remove = |name: &OsStr, id: FileId| {
        if dir.remove(name, id).unwrap_or(false) {
            tracing::info!(path = %dir.join(name).display(), "removed what a killed operation left");
            removed.push(dir.join(name));
        }
    };
    // Own temporaries not in use; held (locked) until all are looked at.
    let mut held = Vec::new();
    for name in &names {
        let b = name.as_bytes();
        let role = if b.ends_with(TEMPORARY_SUFFIX.as_bytes()) {
            Role::Temporary
        } else if b.ends_with(b".sqidx.tmp") {
            Role::IndexTemporary
        } else {
            continue;
        };
        if let Ok(Found::Own(file, id)) = look(dir, name, name, role, keep) {
            held.push((name.clone(), file, id));
        }
    }
    for name in &names {
        let b = name.as_bytes();
        let Some(tmp) = b.strip_suffix(JOURNAL_SUFFIX.as_bytes()) else {
            continue;
        };
        if !tmp.ends_with(TEMPORARY_SUFFIX.as_bytes()) {
            continue;
        }
        let tmp = OsStr::from_bytes(tmp);
        let dead = held.iter().any(|(n, _, _)| n == tmp) || dir.entry(tmp).ok().flatten().is_none();
        if !dead {
            continue;
        }
        if let Ok(Found::Own(_file, id)) = look(dir, name, tmp, Role::TemporaryJournal, keep) {
            remove(name, id);
        }
    }
    for (name, _file, id) in held {
        remove(&name, id);
    }
    Ok(removed)
}

/// A file this process created (by its identity): removed on request
/// only if it is still that file.
#[derive(Debug, Clone)]
pub struct CreatedFile {
    dir: Arc<Dir>,
    name: OsString,
    id: FileId,
}

impl CreatedFile {
    /// Its path, as the directory was named.
    pub fn path(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    /// Removes it if the name still holds the file created (whatever is
    /// there otherwise is left alone).
    pub fn remove(&self) {
        if let Err(e) = self.dir.remove(&self.name, self.id) {
            tracing::warn!(path = %self.path().display(), error = %e, "could not remove a file this operation made");
        }
    }

    /// The directory it was made in.
    pub(crate) fn dir(&self) -> &Arc<Dir> {
        &self.dir
    }

    /// Where it is.
    pub(crate) fn place(&self) -> ImagePlace {
        ImagePlace::new(self.dir.clone(), self.name.clone())
    }

    /// Its identity.
    pub(crate) fn id(&self) -> FileId {
        self.id
    }
}

/// A new image being made under its temporary name (`N.sqtmp`): created
/// exclusively with the unpublished bit in its header, its owner lock
/// held; removed (with its journal) when dropped unpublished.
#[must_use = "a new image is removed unless published"]
#[derive(Debug)]
pub(crate) struct NewImage {
    dir: Arc<Dir>,
    name: OsString,
    tmp: OsString,
    file: File,
    id: FileId,
    published: bool,
}

impl NewImage {
    /// Makes way for `name` in `dir` ([`make_way_for_image`]) and creates
    /// its temporary file holding `bytes` (a v3 image's first bytes, which
    /// gain the unpublished bit), synced.
    pub(crate) fn create(
        dir: Arc<Dir>,
        name: &OsStr,
        layers: &[FileId],
        mut bytes: Vec<u8>,
    ) -> Result<NewImage, Error> {
        make_way_for_image(&dir, name, layers)?;
        let tmp = temporary_name(name);
        let path = dir.join(&tmp);
        let e = |io: io::Error| Error::new(&path, ErrorKind::Io(io));
        {
            use crate::header::field;
            let at = field::AUTOCLEAR_FEATURES;
            if bytes.len() < at + 8 {
                return Err(e(io::Error::other("image bytes without a v3 header")));
            }
            let word = crate::bytes::be_u64(&bytes, at) | crate::features::AUTOCLEAR_UNPUBLISHED;
            bytes[at..at + 8].copy_from_slice(&word.to_be_bytes());
        }
        // Under its name only with its header (marked unpublished) and its
        // maker's lock.
        let file = dir
            .create_with(&tmp, |f| {
                // (Where the filesystem has no locks, a leftover is never
                // taken for the maker's: see `look`.)
                take_owner_lock(f)?;
                f.write_all_at(&bytes, 0)?;
                f.sync_all()
            })
            .map_err(e)?;
        let id = file_id(&file).map_err(e)?;
        Ok(NewImage {
            dir,
            name: name.to_os_string(),
            tmp,
            file,
            id,
            published: false,
        })
    }

    /// The temporary file's path.
    pub(crate) fn tmp_path(&self) -> PathBuf {
        self.dir.join(&self.tmp)
    }

    /// Where the temporary file is (an unpublished image's place).
    pub(crate) fn tmp_place(&self) -> ImagePlace {
        ImagePlace {
            unpublished: true,
            ..ImagePlace::new(self.dir.clone(), self.tmp.clone())
        }
    }

    /// The image's own path.
    pub(crate) fn path(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    /// Its directory.
    pub(crate) fn dir(&self) -> &Arc<Dir> {
        &self.dir
    }

    /// The image's file name.
    pub(crate) fn name(&self) -> &OsStr {
        &self.name
    }

    /// Its identity.
    pub(crate) fn id(&self) -> FileId {
        self.id
    }

    /// The temporary file, writable (a description of its own).
    pub(crate) fn writable_storage(&self) -> io::Result<crate::storage::FileStorage> {
        self.file
            .try_clone()
            .and_then(crate::storage::FileStorage::from_writable_file)
    }

    /// Makes the image visible under its name: the file synced (the
    /// unpublished bit still set: a crash before the rename leaves a
    /// leftover that is recognised), renamed without replacing anything,
    /// the directory synced; then the bit cleared and synced (a crash
    /// before leaves it on the published image, where it means nothing:
    /// the next writable open clears it, sqcow2's or QEMU's).
    pub(crate) fn publish(mut self) -> Result<CreatedFile, Error> {
        let tmp_path = self.tmp_path();
        let e = |io: io::Error| Error::new(&tmp_path, ErrorKind::Io(io));
        self.file.sync_all().map_err(e)?;
        // The temporary is still the file made (identity), then renamed.
        match self.dir.entry(&self.tmp).map_err(e)? {
            Some(entry) if entry.id == self.id => {}
            _ => return Err(e(io::Error::other("the temporary file was replaced"))),
        }
        let path = self.path();
        let e = |io: io::Error| Error::new(&path, ErrorKind::Io(io));
        self.dir.rename_new(&self.tmp, &self.name).map_err(e)?;
        self.published = true;
        self.dir.sync().map_err(e)?;
        let at = crate::header::field::AUTOCLEAR_FEATURES as u64;
        let mut word = [0u8; 8];
        self.file.read_exact_at(&mut word, at).map_err(e)?;
        let word = u64::from_be_bytes(word) & !crate::features::AUTOCLEAR_UNPUBLISHED;
        self.file.write_all_at(&word.to_be_bytes(), at).map_err(e)?;
        self.file.sync_data().map_err(e)?;
        Ok(CreatedFile {
            dir: self.dir.clone(),
            name: self.name.clone(),
            id: self.id,
        })
    }
}

/// Whether `name` is a temporary image's (`*.sqtmp`).
pub(crate) fn is_temporary_name(name: &OsStr) -> bool {
    name.as_bytes().ends_with(TEMPORARY_SUFFIX.as_bytes())
}

impl Drop for NewImage {
    fn drop(&mut self) {
        if self.published {
            return;
        }
        let _ = self.dir.remove(&self.tmp, self.id);
        // Its journal (a writer of the temporary that did not end it).
        let journal = journal_name(&self.tmp);
        if let Ok(file) = self.dir.open_file(&journal, false) {
            if Content::Journal.is_in(&file) {
                if let Ok(id) = file_id(&file) {
                    let _ = self.dir.remove(&journal, id);
                }
            }
        }
    }
}

/// An index being written under its temporary name (`I.tmp`): created
/// exclusively (a leftover of a killed build removed first) with the
/// index magic at its start, its owner lock held; installed under `I`
/// (new, or over sqcow2's own older index), or removed when dropped.
#[must_use = "an index is removed unless installed"]
#[derive(Debug)]
pub(crate) struct NewIndex {
    dir: Arc<Dir>,
    name: OsString,
    tmp: OsString,
    file: File,
    id: FileId,
    /// The index it replaces (sqcow2's own, checked).
    replaces: Option<FileId>,
    installed: bool,
}

impl NewIndex {
    /// Checks `name` (an index may go there: nothing, or an index sqcow2
    /// wrote, not a layer of `layers`) and creates its temporary file.
    pub(crate) fn create(
        dir: Arc<Dir>,
        name: &OsStr,
        image: &OsStr,
        layers: &[FileId],
    ) -> Result<NewIndex, Error> {
        if !dir::is_plain_name(name) {
            return Err(Error::new(
                dir.join(name),
                ErrorKind::IndexStale(
                    "the index name is not a file name in the image's directory".into(),
                ),
            ));
        }
        let replaces = match look(&dir, name, image, Role::Index, layers)? {
            Found::Nothing => None,
            // Only the image's own index is replaced: a header (hostile, or
            // of an image renamed since) may name another image's.
            Found::Own(..) if name != index_name(image) => {
                return Err(collision(
                    &dir,
                    name,
                    image,
                    Role::Index,
                    "an index whose name is not the image's own (`sqcow2 upgrade` gives the image its own)",
                ))
            }
            Found::Own(_, id) => Some(id),
        };
        let tmp = index_temporary_name(name);
        clear_leftover(&dir, &tmp, image, Role::IndexTemporary, layers)?;
        let path = dir.join(&tmp);
        let e = |io: io::Error| Error::new(&path, ErrorKind::Io(io));
        // Under its name only with the index magic at its start (the
        // header, written last, replaces it) and its maker's lock.
        let file = dir
            .create_with(&tmp, |f| {
                take_owner_lock(f)?;
                f.write_all_at(crate::index::INDEX_MAGIC, 0)
            })
            .map_err(e)?;
        let id = file_id(&file).map_err(e)?;
        Ok(NewIndex {
            dir,
            name: name.to_os_string(),
            tmp,
            file,
            id,
            replaces,
            installed: false,
        })
    }

    /// The file to write (a second description: the owner lock stays
    /// with this one).
    pub(crate) fn file(&self) -> io::Result<File> {
        self.file.try_clone()
    }

    /// The temporary file's path.
    pub(crate) fn tmp_path(&self) -> PathBuf {
        self.dir.join(&self.tmp)
    }

    /// The index's path.
    pub(crate) fn path(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    /// Puts the complete index (synced) under its name: a new name never
    /// replaces anything; an older index only if it is still the file
    /// checked. The directory synced.
    pub(crate) fn install(mut self) -> Result<CreatedFile, Error> {
        let path = self.path();
        let e = |io: io::Error| Error::new(&path, ErrorKind::Io(io));
        match self.dir.entry(&self.tmp).map_err(e)? {
            Some(entry) if entry.id == self.id => {}
            _ => return Err(e(io::Error::other("the temporary file was replaced"))),
        }
        match self.replaces {
            None => self.dir.rename_new(&self.tmp, &self.name),
            Some(old) => self.dir.rename_over(&self.tmp, &self.name, old),
        }
        .map_err(e)?;
        self.installed = true;
        self.dir.sync().map_err(e)?;
        Ok(CreatedFile {
            dir: self.dir.clone(),
            name: self.name.clone(),
            id: self.id,
        })
    }
}

impl Drop for NewIndex {
    fn drop(&mut self) {
        if !self.installed {
            let _ = self.dir.remove(&self.tmp, self.id);
        }
    }
}

/// Opens the journal `name` of a writer, starting with `header`: created
/// (under its name only once `header` is in it), or sqcow2's own journal
/// there (a dead writer's, replayed before) started afresh (`header`
/// written over its start, then the file cut to it: it starts with a
/// journal's magic whenever the process dies). Anything else there (a
/// layer, a symlink, a file of another program) is refused, untouched.
pub(crate) fn open_journal(
    dir: &Dir,
    name: &OsStr,
    image: &OsStr,
    layers: &[FileId],
    header: &[u8],
) -> Result<(File, FileId), Error> {
    let path = dir.join(name);
    let e = |io: io::Error| Error::new(&path, ErrorKind::Io(io));
    let created = dir.create_with(name, |f| f.write_all_at(header, 0));
    let file = match created {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {
            match look(dir, name, image, Role::Journal, layers)? {
                Found::Own(file, _) => {
                    file.write_all_at(header, 0).map_err(e)?;
                    file.set_len(header.len() as u64).map_err(e)?;
                    file
                }
                // Gone since: made now.
                Found::Nothing => dir
                    .create_with(name, |f| f.write_all_at(header, 0))
                    .map_err(e)?,
            }
        }
        Err(err) => return Err(e(err)),
    };
    let id = file_id(&file).map_err(e)?;
    Ok((file, id))
}

/// Removes the index `name` if it is sqcow2's own (its magic) and still
/// the file read.
pub(crate) fn remove_index(dir: &Dir, name: &OsStr) -> io::Result<()> {
    if let Ok(file) = dir.open_file(name, false) {
        if Content::Index.is_in(&file) {
            dir.remove(name, file_id(&file)?)?;
        }
    }
    Ok(())
}

/// Opens the journal `name` for reading, if it is there and is a regular
/// file (never through a symlink, never waiting on a FIFO); `None`
/// otherwise.
pub(crate) fn read_journal_file(dir: &Dir, name: &OsStr) -> io::Result<Option<File>> {
    match dir.open_file(name, false) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => Ok(None),
        Err(e) => Err(e),
    }
}

/// Removes the journal `name` if it is sqcow2's own (its magic), the
/// journal of the image `image` (its header names that file: a journal of
/// another file at that name, a live one of another image, stays) and
/// still the file read.
pub(crate) fn remove_journal(dir: &Dir, name: &OsStr, image: Option<FileId>) -> io::Result<()> {
    if let Some(file) = read_journal_file(dir, name)? {
        let of_image = image.is_none_or(|id| journal_names_file(&file, id));
        if Content::Journal.is_in(&file) && of_image {
            dir.remove(name, file_id(&file)?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_dir() -> (tempfile::TempDir, Arc<Dir>) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Arc::new(Dir::open(tmp.path()).unwrap());
        (tmp, dir)
    }

    fn image_bytes() -> Vec<u8> {
        crate::create::image_bytes(&crate::create::CreateOptions {
            size: 1 << 20,
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn no_suffix_is_a_proper_suffix_of_another() {
        let all = [INDEX_SUFFIX, JOURNAL_SUFFIX, TEMPORARY_SUFFIX, ".sqidx.tmp"];
        for a in all {
            for b in all {
                assert!(a == b || !b.ends_with(a), "{a} ends {b}");
            }
        }
    }

    #[test]
    fn a_new_image_is_refused_where_any_of_its_names_is_taken() {
        let (tmp, dir) = new_dir();
        for taken in ["n", "n.sqidx", "n.sqjournal"] {
            std::fs::write(tmp.path().join(taken), b"mine").unwrap();
            let e = NewImage::create(dir.clone(), OsStr::new("n"), &[], image_bytes()).unwrap_err();
            assert!(e.path.ends_with(taken), "{e}");
            assert_eq!(std::fs::read(tmp.path().join(taken)).unwrap(), b"mine");
            std::fs::remove_file(tmp.path().join(taken)).unwrap();
        }
        // A foreign file at a temporary name: refused, kept.
        std::fs::write(tmp.path().join("n.sqtmp"), b"QFI\xfb not ours").unwrap();
        let e = NewImage::create(dir.clone(), OsStr::new("n"), &[], image_bytes()).unwrap_err();
        assert!(e.to_string().contains("did not make"), "{e}");
        std::fs::remove_file(tmp.path().join("n.sqtmp")).unwrap();
        // A layer of the chain, named so.
        std::fs::write(tmp.path().join("n.sqjournal"), b"x").unwrap();
        let id = dir.entry(OsStr::new("n.sqjournal")).unwrap().unwrap().id;
        let e = NewImage::create(dir.clone(), OsStr::new("n"), &[id], image_bytes()).unwrap_err();
        assert!(e.to_string().contains("a layer of the chain"), "{e}");
    }

    #[test]
    fn a_leftover_is_removed_and_a_live_temporary_is_not() {
        let (tmp, dir) = new_dir();
        let first = NewImage::create(dir.clone(), OsStr::new("n"), &[], image_bytes()).unwrap();
        // In use (its owner lock held): refused.
        let e = NewImage::create(dir.clone(), OsStr::new("n"), &[], image_bytes()).unwrap_err();
        assert!(e.to_string().contains("in use"), "{e}");
        // What a killed maker leaves: the marked header, no lock held.
        let leftover = std::fs::read(tmp.path().join("n.sqtmp")).unwrap();
        drop(first);
        assert!(!tmp.path().join("n.sqtmp").exists());
        std::fs::write(tmp.path().join("n.sqtmp"), &leftover).unwrap();
        let second = NewImage::create(dir.clone(), OsStr::new("n"), &[], image_bytes()).unwrap();
        let created = second.publish().unwrap();
        assert!(tmp.path().join("n").exists() && !tmp.path().join("n.sqtmp").exists());
        // Published: the unpublished bit is gone.
        let f = File::open(tmp.path().join("n")).unwrap();
        assert!(!Content::Unpublished.is_in(&f));
        created.remove();
        assert!(!tmp.path().join("n").exists());
    }

    #[test]
    fn an_index_replaces_only_an_index() {
        let (tmp, dir) = new_dir();
        let n = OsStr::new("t.sqidx");
        std::fs::write(tmp.path().join("t.sqidx"), b"QFI\xfb a base").unwrap();
        let e = NewIndex::create(dir.clone(), n, OsStr::new("t"), &[]).unwrap_err();
        assert!(e.to_string().contains("did not make"), "{e}");
        let mut old = crate::index::INDEX_MAGIC.to_vec();
        old.extend_from_slice(b"old index");
        std::fs::write(tmp.path().join("t.sqidx"), &old).unwrap();
        let index = NewIndex::create(dir.clone(), n, OsStr::new("t"), &[]).unwrap();
        index
            .file()
            .unwrap()
            .write_all_at(b"SQC2INDXnew", 0)
            .unwrap();
        index.install().unwrap();
        assert_eq!(
            std::fs::read(tmp.path().join("t.sqidx")).unwrap(),
            b"SQC2INDXnew"
        );
        assert!(!tmp.path().join("t.sqidx.tmp").exists());
    }

    #[test]
    fn a_journal_opens_only_over_a_journal() {
        let (tmp, dir) = new_dir();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, tmp.path().join("x.sqjournal")).unwrap();
        assert!(open_journal(
            &dir,
            OsStr::new("x.sqjournal"),
            OsStr::new("x"),
            &[],
            b"SQJOURNL"
        )
        .is_err());
        std::fs::remove_file(tmp.path().join("x.sqjournal")).unwrap();
        std::fs::write(tmp.path().join("x.sqjournal"), b"QFI\xfb").unwrap();
        assert!(open_journal(
            &dir,
            OsStr::new("x.sqjournal"),
            OsStr::new("x"),
            &[],
            b"SQJOURNL"
        )
        .is_err());
        remove_journal(&dir, OsStr::new("x.sqjournal"), None).unwrap();
        assert_eq!(
            std::fs::read(tmp.path().join("x.sqjournal")).unwrap(),
            b"QFI\xfb"
        );
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }
}
