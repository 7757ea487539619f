//! Where the store is and who asks: from the environment and the shared
//! credentials file, as the AWS tools read them.

use std::path::PathBuf;

use crate::StoreError;

/// An access key and its secret (and a session token for temporary
/// credentials). `Debug` shows the key id only.
#[derive(Clone)]
pub struct Credentials {
    pub(crate) key: String,
    pub(crate) secret: String,
    pub(crate) token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("key", &self.key)
            .field("secret", &"<hidden>")
            .field("token", &self.token.as_ref().map(|_| "<hidden>"))
            .finish()
    }
}

impl Credentials {
    pub fn new(key: impl Into<String>, secret: impl Into<String>) -> Self {
        Credentials {
            key: key.into(),
            secret: secret.into(),
            token: None,
        }
    }
}

/// A bucket of a store and the credentials to use it.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub endpoint: url::Url,
    pub region: String,
    pub bucket: String,
    /// Buckets addressed as `ENDPOINT/BUCKET/KEY` (any store but AWS's
    /// own endpoints) rather than `BUCKET.ENDPOINT/KEY`.
    pub path_style: bool,
    pub credentials: Credentials,
    /// Connect there instead of the endpoint's host (curl's
    /// `--connect-to`; SQCOW2_S3_CONNECT_TO=HOST:PORT): requests still
    /// name the endpoint (a proxy in between, the same store).
    pub connect_to: Option<String>,
    /// Where the bucket is readable without credentials
    /// (SQCOW2_S3_PUBLIC_URL, e.g. a website endpoint): `BASE/KEY` names
    /// the object `KEY` of the bucket, a URL QEMU's curl driver can read.
    pub public_url: Option<url::Url>,
}

impl StoreConfig {
    /// `bucket` of the store the environment names: `AWS_ENDPOINT_URL_S3`
    /// or `AWS_ENDPOINT_URL` (else AWS in the region), `AWS_REGION` or
    /// `AWS_DEFAULT_REGION` (else `us-east-1`), the credentials from
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
    /// `AWS_SESSION_TOKEN`, else from the profile `AWS_PROFILE` (else
    /// `default`) of the shared credentials file
    /// (`AWS_SHARED_CREDENTIALS_FILE`, else `~/.aws/credentials`).
    pub fn from_env(bucket: &str) -> Result<Self, StoreError> {
        Self::from_lookup(bucket, |k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// [`StoreConfig::from_env`] with the variables `var` gives.
    pub fn from_lookup(
        bucket: &str,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, StoreError> {
        if bucket.is_empty() || bucket.contains('/') {
            return Err(StoreError::Config(format!(
                "{bucket:?} is not a bucket name"
            )));
        }
        let region = var("AWS_REGION")
            .or_else(|| var("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".into());
        let (endpoint, path_style) =
            match var("AWS_ENDPOINT_URL_S3").or_else(|| var("AWS_ENDPOINT_URL")) {
                Some(e) => (e, true),
                None => (format!("https://s3.{region}.amazonaws.com"), false),
            };
        let endpoint: url::Url = endpoint
            .parse()
            .map_err(|e| StoreError::Config(format!("endpoint {endpoint:?}: {e}")))?;
        if !matches!(endpoint.scheme(), "http" | "https") || endpoint.host().is_none() {
            return Err(StoreError::Config(format!(
                "endpoint {endpoint}: not an http(s) URL with a host"
            )));
        }
        let credentials = match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
            (Some(key), Some(secret)) => Credentials {
                key,
                secret,
                token: var("AWS_SESSION_TOKEN"),
            },
            _ => profile_credentials(&var)?,
        };
        Ok(StoreConfig {
            endpoint,
            region,
            bucket: bucket.into(),
            path_style,
            credentials,
            connect_to: var("SQCOW2_S3_CONNECT_TO"),
            public_url: match var("SQCOW2_S3_PUBLIC_URL") {
                Some(u) => Some(public_base(&u)?),
                None => None,
            },
        })
    }
}

/// A public base URL, checked, ending with `/`.
fn public_base(text: &str) -> Result<url::Url, StoreError> {
    let with_slash = if text.ends_with('/') {
        text.to_string()
    } else {
        format!("{text}/")
    };
    let url: url::Url = with_slash
        .parse()
        .map_err(|e| StoreError::Config(format!("SQCOW2_S3_PUBLIC_URL {text:?}: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") || url.query().is_some() {
        return Err(StoreError::Config(format!(
            "SQCOW2_S3_PUBLIC_URL {text:?}: not an http(s) URL without a query"
        )));
    }
    Ok(url)
}

/// The credentials of the profile the variables name, from the shared
/// credentials file (an INI file of `[profile]` sections).
fn profile_credentials(var: &impl Fn(&str) -> Option<String>) -> Result<Credentials, StoreError> {
    let path = match var("AWS_SHARED_CREDENTIALS_FILE") {
        Some(p) => PathBuf::from(p),
        None => match var("HOME") {
            Some(home) => PathBuf::from(home).join(".aws/credentials"),
            None => return Err(StoreError::Config(
                "no credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY unset, and no HOME"
                    .into(),
            )),
        },
    };
    let profile = var("AWS_PROFILE").unwrap_or_else(|| "default".into());
    let text = std::fs::read_to_string(&path).map_err(|e| {
        StoreError::Config(format!(
            "no credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY unset, and {}: {e}",
            path.display()
        ))
    })?;
    let mut section = None;
    let (mut key, mut secret, mut token) = (None, None, None);
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = Some(name.trim().to_string());
            continue;
        }
        if section.as_deref() != Some(profile.as_str()) {
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        let v = v.trim().to_string();
        match k.trim() {
            "aws_access_key_id" => key = Some(v),
            "aws_secret_access_key" => secret = Some(v),
            "aws_session_token" => token = Some(v),
            _ => {}
        }
    }
    match (key, secret) {
        (Some(key), Some(secret)) => Ok(Credentials { key, secret, token }),
        _ => Err(StoreError::Config(format!(
            "no credentials for profile {profile:?} in {}",
            path.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_environment_comes_first_then_the_profile_file() {
        let c = StoreConfig::from_lookup(
            "b",
            lookup(&[
                ("AWS_ENDPOINT_URL", "http://127.0.0.1:3900"),
                ("AWS_REGION", "garage"),
                ("AWS_ACCESS_KEY_ID", "GK1"),
                ("AWS_SECRET_ACCESS_KEY", "s3cr3t"),
            ]),
        )
        .unwrap();
        assert_eq!(c.endpoint.as_str(), "http://127.0.0.1:3900/");
        assert!(c.path_style);
        assert_eq!(c.credentials.key, "GK1");
        assert!(
            !format!("{c:?}").contains("s3cr3t"),
            "the secret in a Debug print"
        );

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("credentials");
        std::fs::write(
            &file,
            "[default]\naws_access_key_id = D\naws_secret_access_key = d\n\n\
             [ci]\n# a comment\naws_access_key_id=C\naws_secret_access_key = c\naws_session_token = t\n",
        )
        .unwrap();
        let f = file.to_str().unwrap();
        let c = StoreConfig::from_lookup(
            "b",
            lookup(&[("AWS_SHARED_CREDENTIALS_FILE", f), ("AWS_PROFILE", "ci")]),
        )
        .unwrap();
        assert_eq!(
            (c.credentials.key.as_str(), c.credentials.secret.as_str()),
            ("C", "c")
        );
        assert_eq!(c.credentials.token.as_deref(), Some("t"));
        assert_eq!(c.endpoint.as_str(), "https://s3.us-east-1.amazonaws.com/");
        assert!(!c.path_style);
        let c =
            StoreConfig::from_lookup("b", lookup(&[("AWS_SHARED_CREDENTIALS_FILE", f)])).unwrap();
        assert_eq!(c.credentials.key, "D");
    }

    #[test]
    fn missing_or_malformed_settings_are_config_errors() {
        let none = StoreConfig::from_lookup("b", lookup(&[("HOME", "/nonexistent")]));
        assert!(matches!(none, Err(StoreError::Config(_))), "{none:?}");
        let bad = StoreConfig::from_lookup(
            "b",
            lookup(&[
                ("AWS_ENDPOINT_URL", "ftp://x"),
                ("AWS_ACCESS_KEY_ID", "k"),
                ("AWS_SECRET_ACCESS_KEY", "s"),
            ]),
        );
        assert!(matches!(bad, Err(StoreError::Config(_))), "{bad:?}");
        let bucket = StoreConfig::from_lookup(
            "a/b",
            lookup(&[("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s")]),
        );
        assert!(matches!(bucket, Err(StoreError::Config(_))), "{bucket:?}");
    }
}
