//! An S3-compatible object store, where sqcow2 keeps the immutable layers
//! of a chain (issue 48): objects read by byte range, checked against the
//! version (ETag) they had when first seen, and written whole; and the
//! local cache of an object's blocks ([`RangeCache`]).
//!
//! Requests are signed with AWS Signature Version 4 (`rusty-s3`, sans-IO)
//! and sent with a blocking HTTP client (`ureq`): callers run them off any
//! thread that must not wait. Credentials come from the usual places (the
//! environment, then the shared credentials file), never from a command
//! line, and are never printed ([`Credentials`]'s `Debug` hides them).

mod config;
mod error;
mod layers;
mod manifest;
mod prefetch;
mod range_cache;
mod remote_object;
mod retry;
mod store;

pub use config::{Credentials, StoreConfig};
pub use error::StoreError;
pub use layers::{ObjectPlace, StoreLayers, DEFAULT_BLOCK, DEFAULT_CACHE_BYTES};
pub use manifest::{Manifest, ManifestLayer, MANIFEST_SUFFIX};
pub use range_cache::{CacheStart, RangeCache};
pub use remote_object::{CachePin, RemoteObject};
pub use retry::Retry;
pub use store::{ObjectInfo, ObjectStore};
