//! `sqcow2 push` and `sqcow2 pull`: the layers below an image moved to an
//! object store and back (issue 48), and the opener of layers named by
//! URL that every command uses when `--remote-cache` is given.
//!
//! A push uploads every local layer below the image, byte for byte, under
//! one prefix: the layers name each other by relative names, which resolve
//! under the URL as they did in the directory (QEMU's curl driver combines
//! them the same way). Then it writes the push's manifest beside the
//! highest layer, checks that each layer reads back from the store with
//! its fingerprint, and renames the image's backing file to the highest
//! layer's URL (its index rewritten with the new name). Nothing else local
//! changes; the local layer files stay where they were.

use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use serde::Serialize;
use sqcow2_format::storage::{FileStorage, Storage};
use sqcow2_format::{Chain, ChainOptions, Layer, Qcow2Layer};
use sqcow2_store::{Manifest, ManifestLayer, Retry, StoreConfig, StoreLayers, MANIFEST_SUFFIX};

use crate::output::{print_json, OutputFormat};

/// Arguments of `sqcow2 push`.
#[derive(Debug, clap::Args)]
pub struct PushArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    output: OutputFormat,
    /// The image whose backing layers go to the store (it stays local and
    /// is renamed to name them there).
    image: PathBuf,
    /// Where: `s3://BUCKET/PREFIX` (the store from AWS_ENDPOINT_URL, the
    /// credentials from the environment or the shared credentials file).
    to: String,
}

/// Arguments of `sqcow2 pull`.
#[derive(Debug, clap::Args)]
pub struct PullArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    output: OutputFormat,
    /// Directory the layers are written into (default: the image's).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The image whose backing layers come back from the store.
    image: PathBuf,
}

/// Where `--remote-cache` is, from the option or SQCOW2_REMOTE_CACHE.
pub fn cache_dir(option: Option<PathBuf>) -> Option<PathBuf> {
    option.or_else(|| std::env::var_os("SQCOW2_REMOTE_CACHE").map(PathBuf::from))
}

/// The opener of remote layers for the configured store, caching in
/// `dir`, each layer's cache at most `bytes`, each read tried `tries`
/// times (0: until the store answers).
pub fn store_layers(dir: &Path, bytes: u64, tries: u32) -> anyhow::Result<Arc<StoreLayers>> {
    let bucket = std::env::var("SQCOW2_S3_BUCKET").unwrap_or_else(|_| "sqcow2".into());
    let config = StoreConfig::from_env(&bucket).context("the object store")?;
    let first_pause = std::time::Duration::from_millis(100);
    let retry = match tries {
        0 => Retry::Forever { first_pause },
        tries => Retry::Bounded { tries, first_pause },
    };
    Ok(Arc::new(
        StoreLayers::new(config, dir)
            .context("the remote layers' cache")?
            .with_cache_bytes(bytes)
            .with_retry(retry),
    ))
}

/// `s3://BUCKET/PREFIX` split (the prefix without slashes at its ends).
fn parse_s3(to: &str) -> anyhow::Result<(String, String)> {
    let Some(rest) = to.strip_prefix("s3://") else {
        bail!("{to}: not an s3://BUCKET/PREFIX address");
    };
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        bail!("{to}: no bucket");
    }
    Ok((bucket.into(), prefix.trim_matches('/').into()))
}

/// Whether a layer is in an object store (named by URL).
fn is_remote(layer: &Layer) -> bool {
    sqcow2_format::is_remote_name(layer.path().as_os_str().as_bytes())
}

/// The backing name layer `i + 1` of `chain` records (for the top: its
/// own).
fn name_above(chain: &Chain, i: usize) -> Vec<u8> {
    chain.layers()[i + 1]
        .header()
        .and_then(|h| h.backing_file.as_ref())
        .map(|p| p.as_os_str().as_bytes().to_vec())
        .unwrap_or_default()
}

/// A relative name a layer may give its backing file to be pushed: plain
/// components, no `.`, `..` or `:` (it must resolve under a URL as it
/// does in a directory).
fn relative_name(name: &[u8], layer: &Path) -> anyhow::Result<String> {
    let text = std::str::from_utf8(name).ok();
    match text {
        Some(t)
            if !t.is_empty()
                && !t.starts_with('/')
                && !t.contains(':')
                && t.split('/').all(|c| !c.is_empty() && c != "." && c != "..") =>
        {
            Ok(t.to_owned())
        }
        _ => bail!(
            "{}: names its backing file {:?}, not a plain relative name: rename it \
             (`sqcow2 rebase -u`) before a push",
            layer.display(),
            String::from_utf8_lossy(name)
        ),
    }
}

/// `name` beside `key` (in its "directory").
fn beside(key: &str, name: &str) -> String {
    match key.rfind('/') {
        Some(i) => format!("{}{name}", &key[..=i]),
        None => name.to_owned(),
    }
}

fn open_chain(
    image: &Path,
    options: &ChainOptions,
    layers: &Arc<StoreLayers>,
) -> anyhow::Result<Chain> {
    Ok(Chain::open(
        image,
        &ChainOptions {
            remote_layers: Some(layers.clone()),
            ..options.clone()
        },
    )?)
}

/// One layer pushed or pulled.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
struct MovedLayer {
    /// Where it was read from.
    from: String,
    /// Where it is now.
    to: String,
    bytes: u64,
}

/// What a push or a pull did.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
struct MoveReport {
    image: PathBuf,
    /// The layers, highest first.
    layers: Vec<MovedLayer>,
    /// The image's backing name now.
    backing: String,
    /// Its index, rewritten for the new name.
    index: Option<PathBuf>,
    /// Requests sent to the store.
    requests: u64,
}

fn print(report: &MoveReport, output: OutputFormat, verb: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match output {
        OutputFormat::Json => print_json(&mut out, report)?,
        OutputFormat::Human => {
            let bytes: u64 = report.layers.iter().map(|l| l.bytes).sum();
            writeln!(
                out,
                "{verb} {} layers ({}) below {}; it names {} now ({} requests)",
                report.layers.len(),
                crate::output::human_size(bytes),
                report.image.display(),
                report.backing,
                report.requests
            )?;
        }
    }
    Ok(())
}

/// The layer `chain` has at `i`, opened again from `storage` by itself,
/// must have the same fingerprint (the same bytes, as far as a chain
/// checks them).
fn same_layer(
    chain: &Chain,
    i: usize,
    name: &Path,
    storage: Arc<dyn Storage>,
) -> anyhow::Result<()> {
    let Layer::Qcow2(want) = &chain.layers()[i] else {
        bail!("{}: not a qcow2 layer", chain.layers()[i].path().display());
    };
    let got = Qcow2Layer::open(name, storage)
        .map_err(|k| sqcow2_format::Error::new(name, k))
        .with_context(|| format!("{} read back", name.display()))?;
    if got.fingerprint() != want.fingerprint() || got.file_size() != want.file_size() {
        bail!(
            "{} does not read back as {}: header, L1 table or length differ",
            name.display(),
            chain.layers()[i].path().display()
        );
    }
    Ok(())
}

/// Runs `sqcow2 push IMAGE s3://BUCKET/PREFIX`.
pub fn run_push(
    args: &PushArgs,
    options: &ChainOptions,
    remote: Option<Arc<StoreLayers>>,
) -> anyhow::Result<()> {
    let (bucket, prefix) = parse_s3(&args.to)?;
    let scratch = tempfile::tempdir()?;
    let layers = match remote {
        Some(l) => l,
        None => store_layers(scratch.path(), sqcow2_store::DEFAULT_CACHE_BYTES, 3)?,
    };
    let store = layers.store(&bucket)?;
    store.check_bucket()?;
    let chain = open_chain(&args.image, options, &layers)?;
    let n = chain.layers().len();
    // The local layers right below the image, highest first.
    let local: Vec<usize> = (0..n.saturating_sub(1))
        .rev()
        .take_while(|&i| !is_remote(&chain.layers()[i]))
        .collect();
    let Some(&highest) = local.first() else {
        bail!("{}: no local layer below it to push", args.image.display());
    };
    // Keys: the highest under the prefix by its file name, each lower one
    // by the relative name the layer above gives it.
    let mut keys: Vec<String> = Vec::with_capacity(local.len());
    for &i in &local {
        let layer = &chain.layers()[i];
        if !matches!(layer, Layer::Qcow2(_)) {
            bail!("{}: only qcow2 layers are pushed", layer.path().display());
        }
        let key = if i == highest {
            let file = layer
                .path()
                .file_name()
                .and_then(|f| f.to_str())
                .context("a layer's file name is not UTF-8")?;
            match prefix.as_str() {
                "" => file.to_owned(),
                p => format!("{p}/{file}"),
            }
        } else {
            let above = keys.last().map(String::as_str).unwrap_or_default();
            beside(
                above,
                &relative_name(&name_above(&chain, i), chain.layers()[i + 1].path())?,
            )
        };
        keys.push(key);
    }
    // Lowest first: a reader never finds a layer whose backing is missing.
    let mut manifest = Vec::with_capacity(local.len());
    let mut moved = Vec::with_capacity(local.len());
    for (&i, key) in local.iter().zip(&keys).rev() {
        let layer = &chain.layers()[i];
        let pinned = layer
            .storage()
            .pinned_file()?
            .with_context(|| format!("{}: not a file", layer.path().display()))?;
        // The file the chain opened (not whatever its name holds now).
        let fd_path = PathBuf::from(format!("/proc/self/fd/{}", pinned.file.as_raw_fd()));
        let info = store
            .put_file(key, &fd_path)
            .with_context(|| format!("uploading {}", layer.path().display()))?;
        let url = layers.url_of(&bucket, key);
        manifest.push(ManifestLayer::of_file(&url, &info.etag, &pinned.file)?);
        tracing::info!(layer = %layer.path().display(), %url, bytes = info.len, "layer pushed");
        moved.push(MovedLayer {
            from: layer.path().display().to_string(),
            to: url,
            bytes: info.len,
        });
    }
    manifest.reverse();
    moved.reverse();
    let manifest_key = format!("{}{MANIFEST_SUFFIX}", keys[0]);
    store.put_bytes(&manifest_key, &Manifest::new(manifest).to_bytes())?;
    // Read back through the store (the manifest just written) before the
    // image names any of it.
    for (&i, m) in local.iter().zip(&moved) {
        let object = layers.open_layer(&m.to)?;
        same_layer(&chain, i, Path::new(&m.to), object)?;
    }
    let url = moved[0].to.clone();
    let renamed =
        sqcow2_format::indexing::rename_top_backing(&chain, url.as_bytes(), options.locking)?;
    print(
        &MoveReport {
            image: args.image.clone(),
            layers: moved,
            backing: renamed.new_name,
            index: renamed.index,
            requests: layers.requests(),
        },
        args.output,
        "pushed",
    )
}

/// Runs `sqcow2 pull IMAGE`.
pub fn run_pull(
    args: &PullArgs,
    options: &ChainOptions,
    remote: Option<Arc<StoreLayers>>,
) -> anyhow::Result<()> {
    let scratch = tempfile::tempdir()?;
    let layers = match remote {
        Some(l) => l,
        None => store_layers(scratch.path(), sqcow2_store::DEFAULT_CACHE_BYTES, 3)?,
    };
    let chain = open_chain(&args.image, options, &layers)?;
    let n = chain.layers().len();
    if n < 2 || !is_remote(&chain.layers()[n - 2]) {
        bail!(
            "{}: its backing file is not in an object store",
            args.image.display()
        );
    }
    let image_dir = args
        .image
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let dir = args.dir.clone().unwrap_or_else(|| image_dir.to_path_buf());
    // The remote layers right below the image that name each other by
    // relative names (one named by URL stays where it is), highest first,
    // each with the local name it gets.
    let mut pulled: Vec<(usize, String, PathBuf)> = Vec::new();
    for i in (0..n - 1).rev() {
        let layer = &chain.layers()[i];
        if !is_remote(layer) {
            break;
        }
        let url = layer.path().to_string_lossy().into_owned();
        let local = match pulled.last() {
            None => {
                let tail = url.rsplit('/').next().unwrap_or_default();
                dir.join(relative_name(tail.as_bytes(), Path::new(&url))?)
            }
            Some((_, _, above)) => {
                let written = name_above(&chain, i);
                if sqcow2_format::is_remote_name(&written) {
                    break;
                }
                let name = relative_name(&written, chain.layers()[i + 1].path())?;
                above.parent().unwrap_or(&dir).join(name)
            }
        };
        pulled.push((i, url, local));
    }
    for (_, _, local) in &pulled {
        if local.exists() {
            bail!(
                "{} exists: remove it or pull into another --dir",
                local.display()
            );
        }
    }
    let mut moved = Vec::with_capacity(pulled.len());
    for (i, url, local) in pulled.iter().rev() {
        let object = layers.open_layer(url)?;
        let place = layers.place_of(url)?;
        let store = layers.store(&place.bucket)?;
        if let Some(parent) = local.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let tmp = local.with_extension("sqcow2-pull");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        let fetched = store
            .get_to_file(
                &place.key,
                &object.info().etag,
                object.info().len,
                &mut file,
            )
            .and_then(|()| {
                file.sync_all()
                    .map_err(|source| sqcow2_store::StoreError::Io {
                        path: tmp.display().to_string(),
                        source,
                    })
            });
        let checked = fetched
            .map_err(anyhow::Error::from)
            .and_then(|()| same_layer(&chain, *i, local, Arc::new(FileStorage::from_file(file))));
        // Linked under its name only if nothing is there (never replaced).
        let linked = checked.and_then(|()| {
            std::fs::hard_link(&tmp, local).with_context(|| format!("naming {}", local.display()))
        });
        let _ = std::fs::remove_file(&tmp);
        linked?;
        tracing::info!(%url, layer = %local.display(), "layer pulled");
        moved.push(MovedLayer {
            from: url.clone(),
            to: local.display().to_string(),
            bytes: object.info().len,
        });
    }
    moved.reverse();
    let highest = &pulled[0].2;
    let name = if highest.parent() == Some(image_dir) {
        PathBuf::from(highest.file_name().unwrap_or_default())
    } else {
        std::path::absolute(highest)?
    };
    let renamed = sqcow2_format::indexing::rename_top_backing(
        &chain,
        name.as_os_str().as_bytes(),
        options.locking,
    )?;
    print(
        &MoveReport {
            image: args.image.clone(),
            layers: moved,
            backing: renamed.new_name,
            index: renamed.index,
            requests: layers.requests(),
        },
        args.output,
        "pulled",
    )
}
