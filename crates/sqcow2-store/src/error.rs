//! What a request to the store can end in.

/// A failed request, naming the object it was about.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The configuration is incomplete or malformed (an input mistake).
    #[error("object store configuration: {0}")]
    Config(String),
    /// No such object (or bucket).
    #[error("{key}: no such object in the bucket")]
    NotFound { key: String },
    /// The bucket does not exist.
    #[error("bucket {bucket}: no such bucket in the object store")]
    NoSuchBucket { bucket: String },
    /// The credentials are wrong or lack the permission.
    #[error("{key}: access denied (credentials wrong or without permission)")]
    AccessDenied { key: String },
    /// The object is no longer the version first seen (its ETag changed):
    /// its bytes are not mixed with the old ones.
    #[error("{key}: the object changed since it was first read (ETag {expected})")]
    Changed { key: String, expected: String },
    /// The store could not be reached or the connection broke.
    #[error("{endpoint}: the object store is unreachable: {message}")]
    Unreachable { endpoint: String, message: String },
    /// Any other answer the request did not expect.
    #[error("{key}: the object store answered {status}: {message}")]
    Http {
        key: String,
        status: u16,
        message: String,
    },
    /// An answer that does not hold what it must (a short body, a range
    /// other than the one asked for, no ETag).
    #[error("{key}: malformed answer from the object store: {message}")]
    BadResponse { key: String, message: String },
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}
