//! Backing files named by an `http://` or `https://` URL: immutable layers
//! kept in an object store (issue 48). This crate does no network I/O: a
//! chain opens such a layer through the [`RemoteLayers`] its options give,
//! and refuses the name without one (an explicit opt-in: nothing is
//! fetched from a name an image carries unless the operator said so).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::error::ErrorKind;
use crate::storage::Storage;

/// Opens the layers a chain names by URL, read-only.
pub trait RemoteLayers: Send + Sync + std::fmt::Debug {
    /// The layer at `url` (an absolute `http(s)://` URL), as storage that
    /// reads its bytes. An error says why, in words naming no secret.
    fn open(&self, url: &str) -> std::io::Result<Arc<dyn Storage>>;
}

/// The process's opener of remote layers, which every [`crate::ChainOptions`]
/// starts with (a binary sets it once, at start, when the operator asked
/// for remote layers).
static PROCESS_REMOTE: OnceLock<Arc<dyn RemoteLayers>> = OnceLock::new();

/// Sets the process's opener of remote layers; `false` if one was set
/// already (the first stays).
pub fn set_process_remote_layers(remote: Arc<dyn RemoteLayers>) -> bool {
    PROCESS_REMOTE.set(remote).is_ok()
}

/// The process's opener of remote layers, if one was set.
pub(crate) fn process_remote_layers() -> Option<Arc<dyn RemoteLayers>> {
    PROCESS_REMOTE.get().cloned()
}

/// Whether a backing name is an `http://` or `https://` URL.
pub fn is_remote_name(name: &[u8]) -> bool {
    let lower = |n: usize| name.get(..n).map(<[u8]>::to_ascii_lowercase);
    lower(7).is_some_and(|p| p == b"http://") || lower(8).is_some_and(|p| p == b"https://")
}

/// The URL a backing name written in the remote layer `referrer` (a URL)
/// stands for: a URL stays; a relative name is taken relative to the
/// referrer's "directory", as QEMU's curl driver combines them; a local
/// absolute path is refused (a layer in a bucket never sends a reader to
/// this host's files).
pub(crate) fn resolve_under_url(referrer: &str, name: &[u8]) -> Result<PathBuf, ErrorKind> {
    let text = std::str::from_utf8(name)
        .map_err(|_| ErrorKind::InvalidBackingName("not UTF-8 in a remote layer".into()))?;
    if is_remote_name(name) {
        return Ok(PathBuf::from(text));
    }
    if text.starts_with('/') || text.split('/').any(|c| c == ".." || c == ".") || text.contains(':')
    {
        return Err(ErrorKind::InvalidBackingName(format!(
            "{text:?}: a layer in an object store may name its backing file by URL or by a relative name without '.', '..' or ':'"
        )));
    }
    let dir = match referrer.rfind('/') {
        Some(i) => &referrer[..=i],
        None => referrer,
    };
    Ok(PathBuf::from(format!("{dir}{text}")))
}

/// A path that holds a URL, as text.
pub(crate) fn url_of(path: &Path) -> Option<&str> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    is_remote_name(bytes).then(|| path.to_str()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_under_a_url() {
        let r = "http://h:1/b/chain/l5.qcow2";
        assert_eq!(
            resolve_under_url(r, b"l4.qcow2").unwrap(),
            PathBuf::from("http://h:1/b/chain/l4.qcow2")
        );
        assert_eq!(
            resolve_under_url(r, b"sub/l4").unwrap(),
            PathBuf::from("http://h:1/b/chain/sub/l4")
        );
        assert_eq!(
            resolve_under_url(r, b"HTTPS://x/y").unwrap(),
            PathBuf::from("HTTPS://x/y")
        );
        for bad in [&b"/etc/passwd"[..], b"../x", b"a/./b", b"nbd:x", b"\xff"] {
            assert!(resolve_under_url(r, bad).is_err(), "{bad:?}");
        }
        assert!(is_remote_name(b"http://x") && !is_remote_name(b"http:/x"));
        assert!(!is_remote_name(b"base.qcow2"));
    }
}
