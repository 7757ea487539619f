//! What a suite run measured, as saved to and read from `results.json`
//! and rendered by [`crate::report`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::load::{LoadResult, Pattern};

/// Metrics of one server run on one chain.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    pub server: String,
    pub layers: usize,
    pub repetition: usize,
    pub startup_ms: Option<f64>,
    pub peak_rss_kib: Option<u64>,
    pub rand_read_qd1: Option<LoadResult>,
    pub rand_read_qd32: Option<LoadResult>,
    pub seq_read_1m: Option<LoadResult>,
    pub error: Option<String>,
}

impl Run {
    pub(crate) fn new(server: &str, layers: usize, repetition: usize) -> Run {
        Run {
            server: server.into(),
            layers,
            repetition,
            startup_ms: None,
            peak_rss_kib: None,
            rand_read_qd1: None,
            rand_read_qd32: None,
            seq_read_1m: None,
            error: None,
        }
    }
}

/// One load of the write and queue matrix on one server.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WriteRun {
    pub server: String,
    /// The load's name ([`WriteLoad::name`]).
    pub load: String,
    pub repetition: usize,
    pub result: Option<LoadResult>,
    pub error: Option<String>,
}

/// The image a write load runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteImage {
    /// A fresh overlay of the write base (2 % filled): every write
    /// allocates, nearly always over zeros.
    Fresh,
    /// A fresh overlay of the fully allocated layer: every write allocates
    /// and copies the rest of its cluster from the data below (a disk
    /// after a snapshot).
    FreshOverData,
    /// A fully allocated one-layer image: writes go in place.
    Allocated,
}

/// One load of the write and queue matrix.
#[derive(Debug, Clone, Copy)]
pub struct WriteLoad {
    pub(crate) image: WriteImage,
    pub(crate) pattern: Pattern,
    pub(crate) iodepth: usize,
    pub(crate) queues: usize,
}

impl WriteLoad {
    /// The name in results and tables.
    pub fn name(&self) -> String {
        let what = match (self.image, self.pattern) {
            (WriteImage::Fresh, _) => "allocating writes",
            (WriteImage::FreshOverData, _) => "allocating writes over data",
            (_, Pattern::RandWrite) => "overwrites",
            (_, Pattern::Mixed) => "70/30 reads/overwrites",
            _ => "reads",
        };
        let q = if self.queues == 1 {
            String::new()
        } else {
            format!(", {} queues", self.queues)
        };
        format!("{what}, depth {}{q}", self.iodepth)
    }
}

/// The write and queue matrix, in order (the loads of one image run on
/// one server start).
pub const WRITE_LOADS: [WriteLoad; 13] = {
    const fn l(image: WriteImage, pattern: Pattern, iodepth: usize, queues: usize) -> WriteLoad {
        WriteLoad {
            image,
            pattern,
            iodepth,
            queues,
        }
    }
    use Pattern::*;
    use WriteImage::*;
    [
        l(Fresh, RandWrite, 1, 1),
        l(Fresh, RandWrite, 32, 1),
        l(FreshOverData, RandWrite, 1, 1),
        l(FreshOverData, RandWrite, 32, 1),
        l(Allocated, RandWrite, 1, 1),
        l(Allocated, RandWrite, 32, 1),
        l(Allocated, RandWrite, 32, 2),
        l(Allocated, RandWrite, 32, 4),
        l(Allocated, RandRead, 32, 1),
        l(Allocated, RandRead, 32, 2),
        l(Allocated, RandRead, 32, 4),
        l(Allocated, Mixed, 32, 1),
        l(Allocated, Mixed, 32, 4),
    ]
};

/// Snapshot times at one chain length.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotTimes {
    pub layers: usize,
    pub sqcow2_ms: Vec<f64>,
    pub qemu_img_ms: Vec<f64>,
}

/// Everything a suite run measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub command: String,
    pub machine: BTreeMap<String, String>,
    pub disk_size: u64,
    pub cache_bytes: u64,
    pub seconds_per_run: f64,
    pub repetitions: usize,
    pub lengths: Vec<usize>,
    pub runs: Vec<Run>,
    pub raw_limit: Vec<Run>,
    /// qemu-storage-daemon exporting the raw file (the vhost path's limit
    /// without qcow2).
    #[serde(default)]
    pub qsd_raw: Vec<Run>,
    /// The disk's bytes spread over as many raw files as each chain has
    /// layers, read in this process (server `raw-files-io_uring`, one run
    /// per length and repetition): random reads of the bytes spread
    /// evenly, and sequential reads of each chain's data clusters in one
    /// file per layer (`spread_seq`).
    #[serde(default)]
    pub spread_limit: Vec<Run>,
    #[serde(default)]
    pub writes: Vec<WriteRun>,
    pub snapshots: Vec<SnapshotTimes>,
    pub wall_seconds: f64,
    /// The qemu-storage-daemon binaries tried before the run, when there
    /// was more than one: the run compares with the fastest.
    #[serde(default)]
    pub qsd_trials: Vec<QsdTrial>,
}

/// One qemu-storage-daemon binary tried before a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QsdTrial {
    pub program: String,
    pub version: String,
    /// `qsd-iothread` on the shortest chain: its best run.
    pub run: Run,
    /// Whether the run compared with this one.
    pub chosen: bool,
}
