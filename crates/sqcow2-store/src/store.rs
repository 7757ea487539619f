//! Requests to one bucket: HEAD, ranged GET, PUT of a file, DELETE.

use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rusty_s3::actions::{DeleteObject, GetObject, HeadBucket, HeadObject, PutObject, S3Action};
use rusty_s3::{Bucket, UrlStyle};

use crate::{StoreConfig, StoreError};

/// How long a signed request stays valid (it is sent at once).
const SIGNED_FOR: Duration = Duration::from_secs(300);

/// Longest wait for a connection, and for any read or write of a
/// request to make progress (a store that stops answering fails the
/// request; a long transfer that goes on does not).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const STALL_TIMEOUT: Duration = Duration::from_secs(15);

/// Largest object one PUT may write (S3's limit).
const MAX_SINGLE_PUT: u64 = 5 << 30;

/// What the store says of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Its length in bytes.
    pub len: u64,
    /// Its version (the ETag, quotes included, as the store gives it).
    pub etag: String,
}

/// A bucket of an S3-compatible store.
pub struct ObjectStore {
    bucket: Bucket,
    credentials: rusty_s3::Credentials,
    agent: ureq::Agent,
    endpoint: String,
    /// Requests sent (for the GETs-per-read figures and tests).
    requests: AtomicU64,
}

impl std::fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStore")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket.name())
            .finish()
    }
}

impl ObjectStore {
    pub fn new(config: &StoreConfig) -> Result<Self, StoreError> {
        let style = if config.path_style {
            UrlStyle::Path
        } else {
            UrlStyle::VirtualHost
        };
        let bucket = Bucket::new(
            config.endpoint.clone(),
            style,
            config.bucket.clone(),
            config.region.clone(),
        )
        .map_err(|e| StoreError::Config(format!("bucket {}: {e}", config.bucket)))?;
        let c = &config.credentials;
        let credentials = match &c.token {
            Some(token) => rusty_s3::Credentials::new_with_token(&c.key, &c.secret, token),
            None => rusty_s3::Credentials::new(&c.key, &c.secret),
        };
        let mut agent = ureq::AgentBuilder::new()
            .timeout_connect(CONNECT_TIMEOUT)
            .timeout_read(STALL_TIMEOUT)
            .timeout_write(STALL_TIMEOUT);
        if let Some(to) = &config.connect_to {
            let addrs: Vec<std::net::SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(to)
                .map_err(|e| StoreError::Config(format!("connect to {to}: {e}")))?
                .collect();
            agent = agent.resolver(move |_: &str| Ok(addrs.clone()));
        }
        let agent = agent.build();
        Ok(ObjectStore {
            bucket,
            credentials,
            agent,
            endpoint: config.endpoint.to_string(),
            requests: AtomicU64::new(0),
        })
    }

    /// Checks that the bucket exists and that the credentials may use it
    /// (one HEAD): a write then fails for what it writes, not for where.
    /// A store that refuses a request cuts the upload it reads short, so
    /// a PUT with a wrong key or bucket would otherwise end in a broken
    /// connection rather than the store's answer.
    pub fn check_bucket(&self) -> Result<(), StoreError> {
        let url = HeadBucket::new(&self.bucket, Some(&self.credentials)).sign(SIGNED_FOR);
        let bucket = self.bucket.name();
        match self.send(bucket, self.agent.request_url("HEAD", &url), None) {
            Ok(_) => Ok(()),
            Err(StoreError::NotFound { .. }) => Err(StoreError::NoSuchBucket {
                bucket: bucket.into(),
            }),
            Err(StoreError::AccessDenied { .. }) => Err(StoreError::AccessDenied {
                key: format!("bucket {bucket}"),
            }),
            Err(e) => Err(e),
        }
    }

    /// The object's length and version.
    pub fn head(&self, key: &str) -> Result<ObjectInfo, StoreError> {
        let url = HeadObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNED_FOR);
        let resp = self.send(key, self.agent.request_url("HEAD", &url), None)?;
        let len = resp
            .header("Content-Length")
            .and_then(|l| l.parse().ok())
            .ok_or_else(|| bad(key, "no Content-Length"))?;
        Ok(ObjectInfo {
            len,
            etag: etag_of(key, &resp)?,
        })
    }

    /// `len` bytes of the object from `offset`; with `etag`, only from
    /// that version ([`StoreError::Changed`] otherwise).
    pub fn get_range(
        &self,
        key: &str,
        offset: u64,
        len: usize,
        etag: Option<&str>,
    ) -> Result<Vec<u8>, StoreError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let last = offset
            .checked_add(len as u64 - 1)
            .ok_or_else(|| bad(key, "range past 2^64"))?;
        let url = GetObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNED_FOR);
        let mut req = self
            .agent
            .request_url("GET", &url)
            .set("Range", &format!("bytes={offset}-{last}"));
        if let Some(etag) = etag {
            req = req.set("If-Match", etag);
        }
        let resp = self.send(key, req, etag)?;
        if resp.status() != 206 {
            return Err(bad(key, &format!("{} to a range request", resp.status())));
        }
        let want = format!("bytes {offset}-{last}/");
        if !resp
            .header("Content-Range")
            .is_some_and(|r| r.starts_with(&want))
        {
            return Err(bad(key, "a range other than the one asked for"));
        }
        if let Some(expected) = etag {
            if resp.header("ETag") != Some(expected) {
                return Err(StoreError::Changed {
                    key: key.into(),
                    expected: expected.into(),
                });
            }
        }
        let mut data = Vec::with_capacity(len);
        resp.into_reader()
            .take(len as u64 + 1)
            .read_to_end(&mut data)
            .map_err(|e| self.unreachable(&e.to_string()))?;
        if data.len() != len {
            return Err(bad(
                key,
                &format!("{} bytes for a range of {len}", data.len()),
            ));
        }
        Ok(data)
    }

    /// Writes `path` whole as the object `key`; what the store then says
    /// of it.
    pub fn put_file(&self, key: &str, path: &Path) -> Result<ObjectInfo, StoreError> {
        let io = |source| StoreError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len > MAX_SINGLE_PUT {
            return Err(StoreError::Config(format!(
                "{}: {len} bytes, more than one PUT writes (multipart uploads are not done yet)",
                path.display()
            )));
        }
        let url = PutObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNED_FOR);
        let req = self
            .agent
            .request_url("PUT", &url)
            .set("Content-Length", &len.to_string());
        self.requests.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = req.send(file) {
            return Err(self.put_error(key, e));
        }
        let info = self.head(key)?;
        if info.len != len {
            return Err(bad(
                key,
                &format!("{} bytes stored of {len} written", info.len),
            ));
        }
        Ok(info)
    }

    /// Writes `bytes` as the object `key`; what the store then says of it.
    pub fn put_bytes(&self, key: &str, bytes: &[u8]) -> Result<ObjectInfo, StoreError> {
        let url = PutObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNED_FOR);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.agent
            .request_url("PUT", &url)
            .send_bytes(bytes)
            .map_err(|e| self.put_error(key, e))?;
        let info = self.head(key)?;
        if info.len != bytes.len() as u64 {
            return Err(bad(key, "a length other than the one written"));
        }
        Ok(info)
    }

    /// The whole object (at most `limit` bytes, else
    /// [`StoreError::BadResponse`]) and its version, in one request.
    pub fn get(&self, key: &str, limit: u64) -> Result<(Vec<u8>, ObjectInfo), StoreError> {
        let url = GetObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNED_FOR);
        let resp = self.send(key, self.agent.request_url("GET", &url), None)?;
        if resp.status() != 200 {
            return Err(bad(key, &format!("{} to a GET", resp.status())));
        }
        let etag = etag_of(key, &resp)?;
        let mut data = Vec::new();
        resp.into_reader()
            .take(limit + 1)
            .read_to_end(&mut data)
            .map_err(|e| self.unreachable(&e.to_string()))?;
        if data.len() as u64 > limit {
            return Err(bad(key, &format!("more than {limit} bytes")));
        }
        let len = data.len() as u64;
        Ok((data, ObjectInfo { len, etag }))
    }

    /// Copies the object, which must be at version `etag` and `len` bytes
    /// long, into `out` (from its start) in one request.
    pub fn get_to_file(
        &self,
        key: &str,
        etag: &str,
        len: u64,
        out: &mut std::fs::File,
    ) -> Result<(), StoreError> {
        let url = GetObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNED_FOR);
        let req = self.agent.request_url("GET", &url).set("If-Match", etag);
        let resp = self.send(key, req, Some(etag))?;
        if resp.header("ETag") != Some(etag) {
            return Err(StoreError::Changed {
                key: key.into(),
                expected: etag.into(),
            });
        }
        let copied =
            std::io::copy(&mut resp.into_reader().take(len + 1), out).map_err(|e| {
                match e.kind() {
                    std::io::ErrorKind::Other | std::io::ErrorKind::UnexpectedEof => {
                        self.unreachable(&e.to_string())
                    }
                    _ => StoreError::Io {
                        path: format!("the copy of {key}"),
                        source: e,
                    },
                }
            })?;
        if copied != len {
            return Err(bad(key, &format!("{copied} bytes of {len}")));
        }
        Ok(())
    }

    /// Deletes the object (none there is no error, as S3 answers).
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        let url = DeleteObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNED_FOR);
        self.send(key, self.agent.request_url("DELETE", &url), None)
            .map(|_| ())
    }

    /// Requests sent so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    fn send(
        &self,
        key: &str,
        req: ureq::Request,
        etag: Option<&str>,
    ) -> Result<ureq::Response, StoreError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        req.call().map_err(|e| self.error(key, e, etag))
    }

    /// A failed PUT: a connection the store broke off is asked about
    /// with [`Self::check_bucket`], whose answer (no such bucket, access
    /// denied) is the reason.
    fn put_error(&self, key: &str, e: ureq::Error) -> StoreError {
        match self.error(key, e, None) {
            e @ StoreError::Unreachable { .. } => self.check_bucket().err().unwrap_or(e),
            e => e,
        }
    }

    fn error(&self, key: &str, e: ureq::Error, etag: Option<&str>) -> StoreError {
        match e {
            ureq::Error::Status(404, _) => StoreError::NotFound { key: key.into() },
            ureq::Error::Status(401 | 403, _) => StoreError::AccessDenied { key: key.into() },
            ureq::Error::Status(412, _) if etag.is_some() => StoreError::Changed {
                key: key.into(),
                expected: etag.unwrap_or_default().into(),
            },
            ureq::Error::Status(status, resp) => {
                let mut body = String::new();
                let _ = resp.into_reader().take(512).read_to_string(&mut body);
                StoreError::Http {
                    key: key.into(),
                    status,
                    message: s3_message(&body),
                }
            }
            ureq::Error::Transport(t) => self.unreachable(&t.to_string()),
        }
    }

    fn unreachable(&self, message: &str) -> StoreError {
        StoreError::Unreachable {
            endpoint: self.endpoint.clone(),
            message: without_signatures(message),
        }
    }
}

fn bad(key: &str, message: &str) -> StoreError {
    StoreError::BadResponse {
        key: key.into(),
        message: message.into(),
    }
}

fn etag_of(key: &str, resp: &ureq::Response) -> Result<String, StoreError> {
    resp.header("ETag")
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| bad(key, "no ETag"))
}

/// The `<Message>` of an S3 error document, else its first line.
/// `message` with the query of every presigned URL in it cut out: the
/// signature and the access key id stay out of errors and logs.
fn without_signatures(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("?X-Amz-") {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let end = rest
            .find(|c: char| c.is_whitespace() || c == ':')
            .unwrap_or(rest.len());
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn s3_message(body: &str) -> String {
    let inner = body
        .split_once("<Message>")
        .and_then(|(_, rest)| rest.split_once("</Message>"))
        .map(|(m, _)| m);
    let text = inner.unwrap_or_else(|| body.lines().next().unwrap_or(""));
    text.chars().filter(|c| !c.is_control()).take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::without_signatures;

    #[test]
    fn presigned_queries_are_cut_from_messages() {
        let m = "http://h:1/b/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=GKabc%2F1&X-Amz-Signature=f00: Network Error: Broken pipe";
        assert_eq!(
            without_signatures(m),
            "http://h:1/b/k: Network Error: Broken pipe"
        );
        assert_eq!(without_signatures("no url"), "no url");
        let two = "a?X-Amz-Credential=GK1 then b?X-Amz-Credential=GK2";
        assert!(!without_signatures(two).contains("GK"));
    }
}
