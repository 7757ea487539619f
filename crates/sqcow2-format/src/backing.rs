//! Backing file names and formats, resolved like QEMU does.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::ErrorKind;

/// Format of a backing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackingFormat {
    /// qcow2.
    Qcow2,
    /// raw.
    Raw,
}

impl BackingFormat {
    /// Interprets the backing format extension; `None` when it is absent.
    pub(crate) fn from_recorded(recorded: Option<&str>) -> Result<Option<Self>, ErrorKind> {
        match recorded {
            None => Ok(None),
            Some("qcow2") => Ok(Some(BackingFormat::Qcow2)),
            Some("raw") => Ok(Some(BackingFormat::Raw)),
            Some(other) => Err(ErrorKind::UnsupportedBackingFormat(other.to_owned())),
        }
    }
}

/// Whether a file name starts with a protocol prefix (`nbd:`, `json:`, ...),
/// as QEMU's `path_has_protocol` decides: a colon before any slash.
fn has_protocol(name: &[u8]) -> bool {
    name.iter()
        .find(|&&b| b == b':' || b == b'/' || b == b'\\')
        .is_some_and(|&b| b == b':')
}

/// The path of `backing` as named by the image at `image`: absolute names
/// (and `http(s)://` URLs) stay, relative ones are taken relative to the
/// image's directory.
pub fn resolve_backing_path(image: &Path, backing: &Path) -> Result<PathBuf, ErrorKind> {
    let bytes = backing.as_os_str().as_bytes();
    // A layer in an object store, named by URL: opened (or refused) by the
    // chain's opener of remote layers.
    if crate::remote::is_remote_name(bytes) {
        return Ok(backing.to_path_buf());
    }
    if has_protocol(bytes) {
        return Err(ErrorKind::BackingProtocol(
            String::from_utf8_lossy(bytes).into_owned(),
        ));
    }
    if backing.is_absolute() {
        return Ok(backing.to_path_buf());
    }
    Ok(match image.parent() {
        Some(dir) => dir.join(backing),
        None => backing.to_path_buf(),
    })
}

/// The directory backing files must lie in (`serve --backing-root`),
/// opened once for a chain's open.
#[derive(Debug)]
pub(crate) struct BackingRoot {
    dir: crate::sidefile::Dir,
    /// Its canonical path.
    real: PathBuf,
}

/// Why a backing file was not opened inside the root.
#[derive(Debug)]
pub(crate) enum RootRefusal {
    /// It lies elsewhere (its canonical path).
    Outside(PathBuf),
    /// Resolving or opening it failed (`NotFound`: missing).
    Io(std::io::Error),
}

impl BackingRoot {
    /// Opens the root directory `root`.
    pub(crate) fn open(root: &Path) -> std::io::Result<BackingRoot> {
        let real = std::fs::canonicalize(root)?;
        let dir = crate::sidefile::Dir::open(&real)?;
        Ok(BackingRoot { dir, real })
    }

    /// Its canonical path.
    pub(crate) fn path(&self) -> &Path {
        &self.real
    }

    /// The root directory, opened.
    pub(crate) fn dir(&self) -> &crate::sidefile::Dir {
        &self.dir
    }

    /// Opens the backing file named `named` for reading, checked before it
    /// is opened: its name resolved (symlinks followed, nothing opened),
    /// the result required inside the root, then opened from the root's
    /// descriptor with no symlink followed (a symlink swapped in meanwhile
    /// fails the open), and refused unless a regular file (a FIFO is never
    /// waited on, a device never opened outside the root).
    pub(crate) fn open_file(&self, named: &Path) -> Result<std::fs::File, RootRefusal> {
        let resolved = std::fs::canonicalize(named).map_err(RootRefusal::Io)?;
        let rel = match resolved.strip_prefix(&self.real) {
            Ok(rel) if !rel.as_os_str().is_empty() => rel.to_path_buf(),
            _ => return Err(RootRefusal::Outside(resolved)),
        };
        crate::sidefile::dir::open_file_beneath(&self.dir, &rel).map_err(RootRefusal::Io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_names_follow_the_image_directory() {
        let p = resolve_backing_path(Path::new("/a/b/top.qcow2"), Path::new("../base.qcow2"));
        assert_eq!(p.unwrap(), PathBuf::from("/a/b/../base.qcow2"));
        let p = resolve_backing_path(Path::new("top.qcow2"), Path::new("base.qcow2"));
        assert_eq!(p.unwrap(), PathBuf::from("base.qcow2"));
        let p = resolve_backing_path(Path::new("/a/top"), Path::new("/abs/base"));
        assert_eq!(p.unwrap(), PathBuf::from("/abs/base"));
    }

    #[test]
    fn protocols_are_refused() {
        for name in ["nbd:localhost:10809", "json:{}", "file:x"] {
            assert!(matches!(
                resolve_backing_path(Path::new("/a/top"), Path::new(name)),
                Err(ErrorKind::BackingProtocol(_))
            ));
        }
        assert!(resolve_backing_path(Path::new("/a/top"), Path::new("./x:y")).is_ok());
    }
}
