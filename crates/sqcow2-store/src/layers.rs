//! Layers named by URL, opened from the configured store: the opener a
//! chain uses for backing files in a bucket
//! ([`sqcow2_format::RemoteLayers`]).
//!
//! A layer's URL is its path-style S3 address, `ENDPOINT/BUCKET/KEY`; only
//! URLs under the configured endpoint are opened (signed with the
//! configured credentials): a name an image carries never sends them
//! anywhere else. Before a layer is opened by itself (a HEAD), the
//! manifest its push left beside it (`KEY.sqcow2-manifest`) is looked
//! for: one GET that opens every layer of that push with no further
//! request.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::manifest::{KnownBytes, Manifest, ManifestLayer, MANIFEST_LIMIT, MANIFEST_SUFFIX};
use crate::prefetch::Prefetcher;
use crate::{CacheStart, ObjectInfo, ObjectStore, RemoteObject, Retry, StoreConfig, StoreError};

/// Default bytes each layer's local cache may hold.
pub const DEFAULT_CACHE_BYTES: u64 = 1 << 30;
/// Default size of a cached block (a common cluster size: one GET per
/// cold cluster read).
pub const DEFAULT_BLOCK: u32 = 64 << 10;

/// Where an object lies: bucket and key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectPlace {
    pub bucket: String,
    pub key: String,
}

/// Opens layers from the configured store, each through a local cache.
#[derive(Debug)]
pub struct StoreLayers {
    /// The configuration, its bucket replaced per layer.
    config: StoreConfig,
    cache_dir: PathBuf,
    cache_bytes: u64,
    block: u32,
    retry: Retry,
    prefetcher: Arc<Prefetcher>,
    stores: Mutex<HashMap<String, Arc<ObjectStore>>>,
    /// Layers open now (by URL): a chain reopened gets the same object.
    open: Mutex<HashMap<String, Weak<RemoteObject>>>,
    /// What the manifests read so far give, by URL.
    listed: Mutex<HashMap<String, ManifestLayer>>,
    /// Keys whose manifest was looked for.
    looked_for: Mutex<HashSet<String>>,
}

impl StoreLayers {
    /// An opener with `config`'s endpoint and credentials (its bucket is
    /// ignored: each URL names its own), caching in `cache_dir`.
    pub fn new(config: StoreConfig, cache_dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(cache_dir).map_err(|source| StoreError::Io {
            path: cache_dir.display().to_string(),
            source,
        })?;
        Ok(StoreLayers {
            config,
            cache_dir: cache_dir.to_path_buf(),
            cache_bytes: DEFAULT_CACHE_BYTES,
            block: DEFAULT_BLOCK,
            retry: Retry::default(),
            prefetcher: Prefetcher::new(),
            stores: Mutex::default(),
            open: Mutex::default(),
            listed: Mutex::default(),
            looked_for: Mutex::default(),
        })
    }

    /// With each layer's cache holding at most `bytes`.
    pub fn with_cache_bytes(mut self, bytes: u64) -> Self {
        self.cache_bytes = bytes;
        self
    }

    /// With reads tried again by `retry`.
    pub fn with_retry(mut self, retry: Retry) -> Self {
        self.retry = retry;
        self
    }

    /// The URL of `key` in `bucket` of the configured store: under the
    /// bucket's public URL where it has one (readable by QEMU), else its
    /// path-style S3 URL.
    pub fn url_of(&self, bucket: &str, key: &str) -> String {
        match &self.config.public_url {
            Some(public) if bucket == self.config.bucket => format!("{public}{key}"),
            _ => {
                let base = self.config.endpoint.as_str().trim_end_matches('/');
                format!("{base}/{bucket}/{key}")
            }
        }
    }

    /// The bucket and key of `url`, which must lie under the configured
    /// endpoint.
    pub fn place_of(&self, url: &str) -> Result<ObjectPlace, StoreError> {
        let parsed: url::Url = url
            .parse()
            .map_err(|e| StoreError::Config(format!("{url}: {e}")))?;
        if let Some(public) = &self.config.public_url {
            let key = parsed.as_str().strip_prefix(public.as_str()).unwrap_or("");
            if !key.is_empty() && parsed.query().is_none() && parsed.fragment().is_none() {
                return Ok(ObjectPlace {
                    bucket: self.config.bucket.clone(),
                    key: percent_decode(key)
                        .ok_or_else(|| StoreError::Config(format!("{url}: bad escape")))?,
                });
            }
        }
        let ep = &self.config.endpoint;
        let same = parsed.scheme() == ep.scheme()
            && parsed.host_str() == ep.host_str()
            && parsed.port_or_known_default() == ep.port_or_known_default()
            && parsed.query().is_none()
            && parsed.fragment().is_none();
        let base = ep.path().trim_end_matches('/');
        let rest = parsed.path().strip_prefix(base).unwrap_or("");
        let (bucket, key) = rest
            .strip_prefix('/')
            .and_then(|r| r.split_once('/'))
            .unwrap_or(("", ""));
        if !same || bucket.is_empty() || key.is_empty() {
            return Err(StoreError::Config(format!(
                "{url} is not an object of the configured store {ep}"
            )));
        }
        let decode = |s: &str| {
            percent_decode(s).ok_or_else(|| StoreError::Config(format!("{url}: bad escape")))
        };
        Ok(ObjectPlace {
            bucket: decode(bucket)?,
            key: decode(key)?,
        })
    }

    /// The client of `bucket`.
    pub fn store(&self, bucket: &str) -> Result<Arc<ObjectStore>, StoreError> {
        let mut stores = self.stores.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = stores.get(bucket) {
            return Ok(s.clone());
        }
        let config = StoreConfig {
            bucket: bucket.into(),
            ..self.config.clone()
        };
        let store = Arc::new(ObjectStore::new(&config)?);
        stores.insert(bucket.into(), store.clone());
        Ok(store)
    }

    /// Requests sent to every bucket so far.
    pub fn requests(&self) -> u64 {
        let stores = self.stores.lock().unwrap_or_else(PoisonError::into_inner);
        stores.values().map(|s| s.requests()).sum()
    }

    /// The layer at `url`, opened (or the one open already).
    pub fn open_layer(&self, url: &str) -> Result<Arc<RemoteObject>, StoreError> {
        // Held across the open's requests: two chains opening one layer at
        // once get one object (two would share its cache files).
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(o) = open.get(url).and_then(Weak::upgrade) {
            return Ok(o);
        }
        let place = self.place_of(url)?;
        let store = self.store(&place.bucket)?;
        self.look_for_manifest(&store, url, &place.key)?;
        let listed = self
            .listed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(url)
            .cloned();
        let name = cache_name(url);
        let (object, start) = match listed {
            Some(layer) => {
                let known =
                    KnownBytes::of(&layer, layer.len).map_err(|m| StoreError::BadResponse {
                        key: format!("{}{MANIFEST_SUFFIX}", place.key),
                        message: m,
                    })?;
                let info = ObjectInfo {
                    len: layer.len,
                    etag: layer.etag,
                };
                RemoteObject::open_known(
                    store,
                    &place.key,
                    info,
                    known,
                    &self.cache_dir,
                    &name,
                    self.block,
                    self.cache_bytes,
                )?
            }
            None => RemoteObject::open(
                store,
                &place.key,
                &self.cache_dir,
                &name,
                self.block,
                self.cache_bytes,
            )?,
        };
        if let CacheStart::Dropped(why) = &start {
            tracing::info!(%url, %why, "local cache of a remote layer started afresh");
        }
        let object = object.with_retry(self.retry);
        let object =
            Arc::new_cyclic(|me| object.with_prefetch(self.prefetcher.clone(), me.clone()));
        open.retain(|_, w| w.strong_count() > 0);
        open.insert(url.into(), Arc::downgrade(&object));
        Ok(object)
    }

    /// Reads the manifest beside `key` once, if there is one.
    fn look_for_manifest(
        &self,
        store: &ObjectStore,
        url: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        let listed = self.listed.lock().unwrap_or_else(PoisonError::into_inner);
        if listed.contains_key(url) {
            return Ok(());
        }
        drop(listed);
        if !self
            .looked_for
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.into())
        {
            return Ok(());
        }
        let manifest_key = format!("{key}{MANIFEST_SUFFIX}");
        let bytes = match store.get(&manifest_key, MANIFEST_LIMIT) {
            Ok((bytes, _)) => bytes,
            Err(StoreError::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let manifest = Manifest::parse(&bytes).map_err(|message| StoreError::BadResponse {
            key: manifest_key.clone(),
            message,
        })?;
        tracing::debug!(%url, layers = manifest.layers.len(), "layer manifest read");
        let mut listed = self.listed.lock().unwrap_or_else(PoisonError::into_inner);
        for layer in manifest.layers {
            listed.entry(layer.url.clone()).or_insert(layer);
        }
        Ok(())
    }
}

impl sqcow2_format::RemoteLayers for StoreLayers {
    fn open(&self, url: &str) -> std::io::Result<Arc<dyn sqcow2_format::storage::Storage>> {
        match self.open_layer(url) {
            Ok(o) => Ok(o),
            Err(e) => Err(std::io::Error::other(e)),
        }
    }
}

/// The cache files' name of the layer at `url`: a hash (keys may be long
/// or hold any character) and the key's last part, for people.
fn cache_name(url: &str) -> String {
    let hash = xxhash_rust::xxh3::xxh3_128(url.as_bytes());
    let tail: String = url
        .rsplit('/')
        .next()
        .unwrap_or("")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        .take(64)
        .collect();
    format!("{hash:032x}-{tail}")
}

/// `%XX` escapes decoded (a URL path's).
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Credentials;

    fn layers(endpoint: &str) -> (tempfile::TempDir, StoreLayers) {
        let dir = tempfile::tempdir().unwrap();
        let config = StoreConfig {
            endpoint: endpoint.parse().unwrap(),
            region: "garage".into(),
            bucket: "unused".into(),
            path_style: true,
            credentials: Credentials::new("k", "s"),
            connect_to: None,
            public_url: Some("http://b.web.localhost:3902/".parse().unwrap()),
        };
        let l = StoreLayers::new(config, dir.path()).unwrap();
        (dir, l)
    }

    #[test]
    fn urls_map_to_objects_of_the_configured_store_only() {
        let (_d, l) = layers("http://127.0.0.1:3900");
        let url = l.url_of("b", "chain/l1.qcow2");
        assert_eq!(url, "http://127.0.0.1:3900/b/chain/l1.qcow2");
        assert_eq!(
            l.place_of(&url).unwrap(),
            ObjectPlace {
                bucket: "b".into(),
                key: "chain/l1.qcow2".into()
            }
        );
        assert_eq!(
            l.place_of("http://127.0.0.1:3900/b/a%20b").unwrap().key,
            "a b"
        );
        for other in [
            "http://127.0.0.1:3901/b/k",
            "https://127.0.0.1:3900/b/k",
            "http://evil.example:3900/b/k",
            "http://127.0.0.1:3900/b",
            "http://127.0.0.1:3900/b/",
            "http://127.0.0.1:3900/b/k?x=1",
        ] {
            assert!(l.place_of(other).is_err(), "{other}");
        }
        assert_ne!(cache_name("http://a/b/x"), cache_name("http://a/c/x"));
        // The public form of the configured bucket, both ways.
        assert_eq!(
            l.url_of("unused", "c/l2"),
            "http://b.web.localhost:3902/c/l2"
        );
        assert_eq!(
            l.place_of("http://b.web.localhost:3902/c/l2").unwrap(),
            ObjectPlace {
                bucket: "unused".into(),
                key: "c/l2".into()
            }
        );
        assert!(l.place_of("http://b.web.localhost:3902/").is_err());
    }
}
