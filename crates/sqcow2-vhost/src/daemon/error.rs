//! Why the daemon, or one of its exports, could not serve.

use std::io;
use std::path::PathBuf;

/// Why serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The socket path is taken.
    #[error("{path}: {reason}")]
    Socket { path: PathBuf, reason: String },
    /// The vhost-user daemon failed.
    #[error("vhost-user: {0}")]
    Daemon(String),
    /// An I/O error (its cause the source: shown once by `{:#}`).
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// Flushing the chain failed.
    #[error(transparent)]
    Chain(#[from] sqcow2_format::Error),
    /// An export could not be started.
    #[error(transparent)]
    Export(Box<AddError>),
}

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> ServeError {
    let context = context.into();
    move |source| ServeError::Io { context, source }
}

/// Why an export's description is refused.
#[derive(Debug, thiserror::Error)]
pub enum ExportSpecError {
    /// A value out of its range, a missing key.
    #[error("export {id}: {message}")]
    Invalid { id: String, message: String },
    /// The image (or its backing root) cannot be resolved.
    #[error("{path}: {message}")]
    Path { path: PathBuf, message: String },
    /// The chain cannot be opened.
    #[error("export {id}: opening {image}")]
    Open {
        id: String,
        image: PathBuf,
        #[source]
        source: Box<sqcow2_format::Error>,
    },
}

/// Why an export could not be added.
#[derive(Debug, thiserror::Error)]
pub enum AddError {
    /// Its description is refused, or its chain cannot be opened.
    #[error(transparent)]
    Spec(#[from] ExportSpecError),
    /// Another export holds its id, socket or top; too many exports.
    #[error("{0}")]
    Refused(String),
    /// Its socket or threads could not be made.
    #[error(transparent)]
    Serve(ServeError),
}
