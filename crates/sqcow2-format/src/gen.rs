//! The chain generator (`sqcow2 gen-chain`): writes a qcow2 backing chain
//! natively, each data cluster tagged with the layer and guest cluster it
//! belongs to, so that a wrong read is recognised.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::chain::{Chain, ChainOptions};
use crate::create::{image_layout, CreateOptions};
use crate::entry::COPIED;
use crate::error::{Error, ErrorKind};
use crate::index::{encode_index, IndexEntry, IndexGeometry, AUTOCLEAR_SQCOW2};
use crate::sidefile::Dir;
use crate::sqcow2_ext::{fingerprints, write_index_extension};
use crate::types::{Geometry, GuestOffset};

/// Magic at the start of every tagged 4 KiB block.
pub(crate) const TAG_MAGIC: &[u8; 4] = b"SQGC";
/// Bytes between tags.
pub const TAG_STRIDE: usize = 4096;

/// How each layer chooses its clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Distribution {
    /// Any cluster with the same probability.
    Uniform,
    /// Zipf (s = 1) over a fixed random order: hot clusters are rewritten
    /// by many layers.
    Zipf,
    /// Runs of up to 64 consecutive clusters at random places.
    SequentialRuns,
}

/// What to generate.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct GenOptions {
    /// Layers, the top included.
    pub layers: usize,
    /// Virtual size in bytes.
    pub size: u64,
    /// Cluster size of every layer.
    pub cluster_size: u64,
    /// Fraction of the disk's clusters written by the chain as a whole,
    /// shared evenly among the layers.
    pub fill: f64,
    /// Seed of the generator.
    pub seed: u64,
    /// How clusters are chosen.
    pub distribution: Distribution,
    /// Also write a chain index for the top.
    pub index: bool,
}

/// The file name of layer `i` (0 = base).
pub fn layer_file_name(i: usize) -> String {
    format!("layer{i:04}.qcow2")
}

/// Guest clusters each layer writes (sorted), derived from the options.
pub fn plan(opts: &GenOptions) -> Vec<Vec<u64>> {
    let mut rng = fastrand::Rng::with_seed(opts.seed);
    let clusters = opts.size.div_ceil(opts.cluster_size).max(1);
    let total = (clusters as f64 * opts.fill.clamp(0.0, 1.0)).round() as u64;
    let per_layer = (total / opts.layers.max(1) as u64).clamp(1, clusters);
    let mut order: Vec<u64> = (0..clusters).collect();
    rng.shuffle(&mut order);
    let zipf_cdf: Vec<f64> = if opts.distribution == Distribution::Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=clusters)
            .map(|k| {
                acc += 1.0 / k as f64;
                acc
            })
            .collect();
        cdf.iter_mut().for_each(|c| *c /= acc);
        cdf
    } else {
        Vec::new()
    };
    (0..opts.layers)
        .map(|_| {
            let mut set = std::collections::BTreeSet::new();
            let mut attempts = 0u64;
            while (set.len() as u64) < per_layer && attempts < per_layer * 64 {
                attempts += 1;
                match opts.distribution {
                    Distribution::Uniform => {
                        set.insert(rng.u64(0..clusters));
                    }
                    Distribution::Zipf => {
                        let u = rng.f64();
                        let k = zipf_cdf
                            .partition_point(|&c| c < u)
                            .min(clusters as usize - 1);
                        set.insert(order[k]);
                    }
                    Distribution::SequentialRuns => {
                        let start = rng.u64(0..clusters);
                        let len = rng.u64(1..=64).min(per_layer - set.len() as u64);
                        for c in start..(start + len).min(clusters) {
                            set.insert(c);
                        }
                    }
                }
            }
            set.into_iter().collect()
        })
        .collect()
}

/// The content of guest cluster `cluster` as written by layer `layer`:
/// a tag every 4 KiB, zeros elsewhere.
pub(crate) fn cluster_content(layer: u32, cluster: u64, cluster_size: u64) -> Vec<u8> {
    let mut buf = vec![0u8; cluster_size as usize];
    for (block, chunk) in buf
        .chunks_mut(TAG_STRIDE.min(cluster_size as usize))
        .enumerate()
    {
        chunk[0..4].copy_from_slice(TAG_MAGIC);
        chunk[4..8].copy_from_slice(&layer.to_be_bytes());
        chunk[8..16].copy_from_slice(&cluster.to_be_bytes());
        chunk[16..20].copy_from_slice(&(block as u32).to_be_bytes());
    }
    buf
}

/// The (layer, guest cluster) a tagged block names, if it is one.
pub fn parse_tag(block: &[u8]) -> Option<(u32, u64)> {
    if block.len() < 20 || &block[0..4] != TAG_MAGIC {
        return None;
    }
    Some((
        u32::from_be_bytes(block[4..8].try_into().ok()?),
        u64::from_be_bytes(block[8..16].try_into().ok()?),
    ))
}

/// For every guest cluster, the topmost layer `<= upto` that writes it.
pub fn owners(plan: &[Vec<u64>], clusters: u64, upto: usize) -> Vec<Option<u32>> {
    let mut owner = vec![None; clusters as usize];
    for (layer, list) in plan.iter().enumerate().take(upto + 1) {
        for &c in list {
            if let Some(o) = owner.get_mut(c as usize) {
                *o = Some(layer as u32);
            }
        }
    }
    owner
}

/// Writes layer `i` with its clusters; returns the host offset of each.
fn write_layer(
    dir: &Dir,
    i: usize,
    opts: &GenOptions,
    clusters: &[u64],
    mark: bool,
) -> Result<(Vec<u64>, crate::sidefile::FileId), Error> {
    let name = layer_file_name(i);
    let path = dir.join(std::ffi::OsStr::new(&name));
    let e = |err: std::io::Error| Error::new(&path, ErrorKind::Io(err));
    let g = Geometry {
        cluster_bits: opts.cluster_size.trailing_zeros(),
        extended_l2: false,
    };
    let cs = opts.cluster_size;
    let mut l1_indices: Vec<u64> = clusters
        .iter()
        .map(|&c| g.l1_index(GuestOffset(c * cs)))
        .collect();
    l1_indices.dedup();
    let create = CreateOptions {
        size: opts.size,
        cluster_size: cs,
        backing_file: (i > 0).then(|| PathBuf::from(layer_file_name(i - 1))),
        backing_format: (i > 0).then(|| "qcow2".to_owned()),
        ..CreateOptions::default()
    };
    let extra = (l1_indices.len() + clusters.len()) as u64;
    let (mut prefix, layout) = image_layout(&create, extra).map_err(|k| Error::new(&path, k))?;
    if mark {
        prefix[88..96].copy_from_slice(&AUTOCLEAR_SQCOW2.to_be_bytes());
    }
    let l2_base = layout.next_cluster;
    let data_base = l2_base + l1_indices.len() as u64;
    let entries = g.l2_entries() as usize;
    let mut tables = vec![0u8; l1_indices.len() * cs as usize];
    let mut hosts = Vec::with_capacity(clusters.len());
    for (n, &c) in clusters.iter().enumerate() {
        let host = (data_base + n as u64) * cs;
        hosts.push(host);
        let l1i = g.l1_index(GuestOffset(c * cs));
        let t = l1_indices.partition_point(|&x| x < l1i);
        let at = t * cs as usize + (c as usize % entries) * 8;
        tables[at..at + 8].copy_from_slice(&(host | COPIED).to_be_bytes());
    }
    for (t, &l1i) in l1_indices.iter().enumerate() {
        let at = (layout.l1_offset + l1i * 8) as usize;
        prefix[at..at + 8].copy_from_slice(&(((l2_base + t as u64) * cs) | COPIED).to_be_bytes());
    }
    let file = create_generated(dir, &name).map_err(e)?;
    let id = crate::sidefile::file_id(&file).map_err(e)?;
    file.write_all_at(&prefix, 0).map_err(e)?;
    file.write_all_at(&tables, l2_base * cs).map_err(e)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, &file);
    {
        use std::io::Seek;
        w.seek(std::io::SeekFrom::Start(data_base * cs))
            .map_err(e)?;
    }
    for &c in clusters {
        w.write_all(&cluster_content(i as u32, c, cs)).map_err(e)?;
    }
    w.flush().map_err(e)?;
    drop(w);
    file.sync_all().map_err(e)?;
    Ok((hosts, id))
}

/// Creates the file `name` in `dir` (a directory opened once): a new
/// file, never one that exists (a file of someone's is never emptied),
/// never through a symlink.
fn create_generated(dir: &Dir, name: &str) -> std::io::Result<std::fs::File> {
    dir.create(std::ffi::OsStr::new(name))
}

/// Generates the chain in `dir` (created if needed; the files it makes
/// must not exist there); returns the top.
pub fn generate(
    dir: &Path,
    opts: &GenOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PathBuf, Error> {
    let e = |err: std::io::Error| Error::new(dir, ErrorKind::Io(err));
    if opts.layers == 0 || !opts.cluster_size.is_power_of_two() {
        return Err(Error::new(
            dir,
            ErrorKind::InvalidHeader {
                field: "layers",
                reason: "at least one layer and a power-of-two cluster size".into(),
            },
        ));
    }
    std::fs::create_dir_all(dir).map_err(e)?;
    // Opened once: every file is made in it by name.
    let gdir = Dir::open(dir).map_err(e)?;
    let plan = plan(opts);
    let clusters = opts.size.div_ceil(opts.cluster_size);
    let mut hosts: Vec<Vec<u64>> = Vec::with_capacity(opts.layers);
    let mut top_id = None;
    for (i, list) in plan.iter().enumerate() {
        let mark = opts.index && i + 1 < opts.layers;
        let (h, id) = write_layer(&gdir, i, opts, list, mark)?;
        hosts.push(h);
        top_id = Some(id);
        progress(i as u64 + 1, opts.layers as u64);
    }
    let top = dir.join(layer_file_name(opts.layers - 1));
    if opts.index && opts.layers > 1 {
        let upto = opts.layers - 2;
        let owner = owners(&plan, clusters, upto);
        let entries: Vec<IndexEntry> = owner
            .iter()
            .enumerate()
            .map(|(c, o)| match o {
                Some(layer) => {
                    let list = &plan[*layer as usize];
                    let n = list.partition_point(|&x| x < c as u64);
                    IndexEntry::Data {
                        layer: *layer,
                        host: hosts[*layer as usize][n],
                    }
                }
                None => IndexEntry::None,
            })
            .collect();
        let geometry = IndexGeometry {
            granularity_bits: opts.cluster_size.trailing_zeros(),
            covered_size: opts.size,
        };
        // The top written above (another file put at its name since is
        // refused).
        let chain = Chain::open_expecting(
            &top,
            top_id,
            &ChainOptions {
                use_index: false,
                ..ChainOptions::default()
            },
        )?;
        let fps = fingerprints(chain.layers(), upto, layer_file_name(upto).as_bytes());
        let name = format!("{}.sqidx", layer_file_name(opts.layers - 1));
        let bytes = encode_index(geometry, &fps, &entries);
        create_generated(&gdir, &name)
            .and_then(|f| f.write_all_at(&bytes, 0))
            .map_err(e)?;
        let header = chain.top().header().cloned();
        // The top the chain read, through its descriptor.
        let storage =
            crate::storage::writable_same_file(&**chain.top().storage(), &top).map_err(e)?;
        drop(chain);
        if let Some(h) = header {
            write_index_extension(&storage, &h, Path::new(&name)).map_err(e)?;
        }
    }
    Ok(top)
}
