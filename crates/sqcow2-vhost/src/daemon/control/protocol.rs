//! The control protocol's messages (`docs/control-api.md`): one JSON
//! object per line each way. Requests are parsed into [`Command`]s,
//! replies built from the typed results below; the Prometheus text is
//! rendered from the same [`Stats`] value, so a renamed field cannot
//! silently export zeros.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::device::throttle::LIMIT_KEYS;
pub use crate::device::throttle::{IoLimits, ThrottleCounters};

/// A request line: its `id` (echoed), the export it is for and its
/// command.
#[derive(Debug)]
pub struct Request {
    /// Any JSON value; `null` when absent.
    pub id: Value,
    /// The export a command about one disk is for (`export`); may be
    /// left out while the daemon serves one.
    pub export: Option<String>,
    /// What to do.
    pub command: Command,
}

/// A control command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Live snapshot: a new active volume at `path`.
    Snapshot {
        /// The new active volume.
        path: PathBuf,
    },
    /// Make every completed write durable.
    Flush,
    /// The served chain.
    Info,
    /// Counters, as JSON or Prometheus text.
    Stats {
        /// Output format.
        format: StatsFormat,
    },
    /// Take the disk over: lock, reload, serve.
    Activate,
    /// Hand the disk over: quiesce, flush, release the locks.
    Inactivate,
    /// Start merging layers `first..=last` (below the top) into the new
    /// file `path`, in the background (progress in `stats`).
    Merge(MergeRequest),
    /// Start committing the top (and the layers down to `base`) into
    /// `base`, then serve from it (progress in `stats`, as a merge's).
    Commit(CommitRequest),
    /// Cancel the running merge (its file is removed; the chain is left
    /// as it was).
    MergeCancel,
    /// Grow the served disk to `size` bytes and tell the frontend.
    Resize {
        /// The new virtual size (a multiple of 512, not smaller).
        size: u64,
    },
    /// Edit or list the top's persistent dirty bitmaps.
    Bitmap(BitmapRequest),
    /// Export `layer` (below the top: immutable), with the layers below
    /// it, read-only over NBD as the export `name` (a point in time: the
    /// old top of a live snapshot).
    NbdExport {
        /// The export's name.
        name: String,
        /// The layer: a position or a file of the chain.
        layer: LayerName,
    },
    /// End the point-in-time export `name`.
    NbdExportRemove {
        /// The export's name.
        name: String,
    },
    /// Serve one more chain (a daemon command: no `export`).
    ExportAdd(ExportAddRequest),
    /// Stop serving an export: its guest's requests finish, its chain is
    /// flushed and closed clean, its socket removed.
    ExportRemove {
        /// The export.
        id: String,
    },
    /// The exports served.
    ExportList,
    /// Set the export's I/O limits, live.
    SetIoThrottle(IoThrottleRequest),
}

impl Command {
    /// Whether the command is about the daemon, not one of its exports.
    pub fn is_daemon_command(&self) -> bool {
        matches!(
            self,
            Command::ExportAdd(_) | Command::ExportRemove { .. } | Command::ExportList
        )
    }
}

/// What an `export-add` request asks (the keys of `serve --export`; the
/// export's name is the request's `export`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[serde(deny_unknown_fields)]
pub struct ExportAddRequest {
    /// The export's name (the request's `export`).
    #[serde(skip)]
    pub id: String,
    /// The vhost-user socket to create.
    pub socket: PathBuf,
    /// The top image of the chain.
    pub image: PathBuf,
    /// Export read-only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// Request queues offered (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_queues: Option<u16>,
    /// Largest queue the frontend may set up (default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_size: Option<u16>,
    /// Backing files must lie inside this directory (default: the
    /// daemon's `--backing-root`, else the top's directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing_root: Option<PathBuf>,
    /// The throttle group it joins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Its I/O limits (the limit keys, beside the others in the request).
    #[serde(skip)]
    pub limits: IoLimits,
}

/// What a `set-io-throttle` request asks: the export's limits (QEMU's
/// `block_set_io_throttle`: absent keys are no limit, none at all lifts
/// them), in `group` if named (its other exports take them too).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IoThrottleRequest {
    /// The throttle group the export joins (or stays in).
    pub group: Option<String>,
    /// The limits.
    pub limits: IoLimits,
}

/// Moves the limit keys of `object` into an [`IoLimits`] (unknown keys
/// stay in `object`).
fn take_limits(object: &mut Map<String, Value>) -> Result<IoLimits, String> {
    let mut limits = Map::new();
    for key in LIMIT_KEYS {
        if let Some(v) = object.remove(key) {
            limits.insert(key.to_owned(), v);
        }
    }
    serde_json::from_value(Value::Object(limits)).map_err(|e| format!("limits: {e}"))
}

/// The limit keys of `limits`, as request keys.
fn put_limits(o: &mut Map<String, Value>, limits: &IoLimits) {
    if let Ok(Value::Object(fields)) = serde_json::to_value(limits) {
        o.extend(fields);
    }
}

/// One export, as `export-add` and `export-list` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ExportInfo {
    /// Its name.
    pub id: String,
    /// Its vhost-user socket, if it has one.
    pub socket: Option<PathBuf>,
    /// The top of its chain now.
    pub image: PathBuf,
    /// Layers of its chain.
    pub layers: usize,
    /// Exported read-only.
    pub read_only: bool,
    /// Request queues offered.
    pub num_queues: u16,
    /// Whether a frontend is connected.
    pub frontend_connected: bool,
    /// The daemon's worker thread (`queue-worker-N`) of each group of
    /// the frontend's queues (`--queues-per-thread` queues each): empty
    /// without a frontend.
    #[serde(default)]
    pub worker_threads: Vec<usize>,
}

/// What `export-list` answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ExportListResult {
    /// In the order of their ids.
    pub exports: Vec<ExportInfo>,
}

/// What `export-remove` answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ExportRemoved {
    /// The export removed.
    pub id: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NbdExportArgs {
    name: String,
    layer: LayerName,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NbdExportRemoveArgs {
    name: String,
}

/// What `nbd-export` and `nbd-export-remove` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct NbdExportResult {
    /// The export's name.
    pub name: String,
    /// The top of the exported chain.
    pub layer: PathBuf,
    /// Its virtual size.
    pub size: u64,
}

/// What a `bitmap` request asks (qemu-img bitmap's operations, one per
/// request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[serde(deny_unknown_fields)]
pub struct BitmapRequest {
    /// The operation.
    pub op: BitmapOp,
    /// The bitmap (every operation but `list`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `add`: bytes per bit (default: the cluster size, at least 4 KiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granularity: Option<u64>,
    /// `add`: added disabled.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disabled: bool,
    /// `merge`: the source bitmap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// `merge`: the layer of the chain holding the source (default the
    /// top).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_layer: Option<LayerName>,
}

/// A `bitmap` operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BitmapOp {
    /// Add an empty bitmap.
    Add,
    /// Remove a bitmap.
    Remove,
    /// Clear every bit.
    Clear,
    /// Track writes.
    Enable,
    /// Stop tracking writes.
    Disable,
    /// Set every bit set in `source`.
    Merge,
    /// Change nothing.
    List,
}

/// What `bitmap` answers: the top's bitmaps after the operation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BitmapList {
    /// In directory order.
    pub bitmaps: Vec<BitmapState>,
}

/// One bitmap of a [`BitmapList`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BitmapState {
    /// Its name.
    pub name: String,
    /// Bytes of guest data per bit.
    pub granularity: u64,
    /// Writes set its bits.
    pub recording: bool,
    /// Left in use by a writer that died: unusable, never changed.
    pub inconsistent: bool,
    /// Guest bytes it marks dirty.
    pub count: u64,
}

/// What a `merge` request asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[serde(deny_unknown_fields)]
pub struct MergeRequest {
    /// The lowest layer merged: a position (0 the base) or a file of the
    /// chain.
    pub first: LayerName,
    /// The highest layer merged (below the top).
    pub last: LayerName,
    /// The new file.
    pub path: PathBuf,
    /// Most bytes per second the merge writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<u64>,
    /// Keep the guest's p99 latency within this many thousandths of its
    /// value before the merge (1200: 1.2x): the copy pauses while a
    /// recent window's p99 is above it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_p99_permille: Option<u32>,
}

/// What a `commit` request asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[serde(deny_unknown_fields)]
pub struct CommitRequest {
    /// The layer committed into (the top's backing file by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<LayerName>,
    /// Most bytes per second the background copy writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<u64>,
    /// Keep the guest's p99 latency within this many thousandths of its
    /// value before the commit (as a merge's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_p99_permille: Option<u32>,
}

/// What `commit` answers (the commit goes on in the background).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct CommitStarted {
    /// The layer committed into, served as the top once done.
    pub base: PathBuf,
    /// Its position in the chain.
    pub position: usize,
    /// The layers above it, lowest first: out of the chain once done,
    /// left in place.
    pub replaced: Vec<PathBuf>,
}

/// A layer in a request: its position or its file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LayerName {
    /// Position, 0 the base.
    Position(usize),
    /// A file of the chain.
    File(PathBuf),
}

impl From<&LayerName> for sqcow2_format::reshape::LayerRef {
    fn from(n: &LayerName) -> Self {
        match n {
            LayerName::Position(p) => sqcow2_format::reshape::LayerRef::Position(*p),
            LayerName::File(f) => sqcow2_format::reshape::LayerRef::File(f.clone()),
        }
    }
}

/// How `stats` answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StatsFormat {
    /// A [`Stats`] object.
    #[default]
    Json,
    /// `{"text": ...}` in Prometheus' text exposition format.
    Prometheus,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotArgs {
    path: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResizeArgs {
    size: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StatsArgs {
    #[serde(default)]
    format: StatsFormat,
}

/// Why a request failed (the reply's `error.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum FailureKind {
    /// Invalid JSON, not an object, a missing or wrong field, a line too
    /// long.
    BadRequest,
    /// A command this daemon does not know.
    UnknownCommand,
    /// Another snapshot is running.
    Busy,
    /// The snapshot target exists.
    Exists,
    /// The new volume could not be created or opened.
    SnapshotFailed,
    /// A flush failed.
    IoError,
    /// Another process holds the chain (image locks).
    Locked,
    /// The daemon is inactive (the disk is handed over).
    Inactive,
    /// A merge could not start (bad range, existing file, another merge
    /// running).
    MergeFailed,
    /// A live commit could not start (bad base, a base another process
    /// uses, a read-only chain).
    CommitFailed,
}

/// A failed request: its kind and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Failure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// What happened.
    pub message: String,
}

impl Failure {
    /// A failure of `kind`.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Failure {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = serde_json::to_value(self.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        write!(f, "{kind}: {}", self.message)
    }
}

/// A reply line.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Reply {
    /// The request's `id`.
    pub id: Value,
    /// Whether the request succeeded.
    pub ok: bool,
    /// The result (on success).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// The failure (otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Failure>,
}

impl Reply {
    /// A success carrying `result`.
    pub fn success(id: Value, result: &impl Serialize) -> Reply {
        match serde_json::to_value(result) {
            Ok(v) => Reply {
                id,
                ok: true,
                result: Some(v),
                error: None,
            },
            Err(e) => Reply::failure(
                id,
                Failure::new(FailureKind::IoError, format!("encoding the result: {e}")),
            ),
        }
    }

    /// A failure.
    pub fn failure(id: Value, failure: Failure) -> Reply {
        Reply {
            id,
            ok: false,
            result: None,
            error: Some(failure),
        }
    }

    /// The result as `T`, or the failure.
    pub fn into_result<T: serde::de::DeserializeOwned>(self) -> Result<T, Failure> {
        match (self.ok, self.result, self.error) {
            (true, Some(v), _) => serde_json::from_value(v).map_err(|e| {
                Failure::new(FailureKind::BadRequest, format!("unexpected result: {e}"))
            }),
            (_, _, Some(f)) => Err(f),
            _ => Err(Failure::new(
                FailureKind::BadRequest,
                "reply without a result",
            )),
        }
    }
}

/// A JSON value in which no object gives a key twice, at any depth (a
/// key given twice is an error, not the last value silently kept).
struct UniqueKeys(Value);

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::Bool(v)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::from(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::from(v)))
            }
            fn visit_f64<E>(self, v: f64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::from(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::String(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::String(v)))
            }
            fn visit_unit<E>(self) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::Null))
            }
            fn visit_none<E>(self) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::Null))
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<UniqueKeys, D::Error> {
                UniqueKeys::deserialize(d)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<UniqueKeys, A::Error> {
                let mut out = Vec::new();
                while let Some(UniqueKeys(v)) = seq.next_element()? {
                    out.push(v);
                }
                Ok(UniqueKeys(Value::Array(out)))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<UniqueKeys, A::Error> {
                let mut out = Map::new();
                while let Some((key, UniqueKeys(value))) = map.next_entry::<String, UniqueKeys>()? {
                    if out.contains_key(&key) {
                        return Err(serde::de::Error::custom(format!(
                            "the key {key:?} is given twice"
                        )));
                    }
                    out.insert(key, value);
                }
                Ok(UniqueKeys(Value::Object(out)))
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl Request {
    /// Parses a request line; on failure, the reply's `id` (when the line
    /// had one) and why.
    pub fn parse(line: &str) -> Result<Request, (Value, Failure)> {
        let bad = |m: String| Failure::new(FailureKind::BadRequest, m);
        let mut object: Map<String, Value> = match serde_json::from_str::<UniqueKeys>(line) {
            Ok(UniqueKeys(Value::Object(o))) => o,
            Ok(_) => return Err((Value::Null, bad("a request is a JSON object".into()))),
            Err(e) => return Err((Value::Null, bad(format!("invalid JSON: {e}")))),
        };
        let id = object.remove("id").unwrap_or(Value::Null);
        let export = match object.remove("export") {
            None => None,
            Some(Value::String(e)) => Some(e),
            Some(_) => return Err((id, bad("\"export\" must be a string".into()))),
        };
        let name = match object.remove("command") {
            Some(Value::String(s)) => s,
            Some(_) => return Err((id, bad("\"command\" must be a string".into()))),
            None => return Err((id, bad("missing \"command\"".into()))),
        };
        // Each command's arguments, no key it does not take.
        fn args<T: serde::de::DeserializeOwned>(
            name: &str,
            object: Map<String, Value>,
        ) -> Result<T, String> {
            serde_json::from_value(Value::Object(object)).map_err(|e| format!("{name}: {e}"))
        }
        let no_args = |command: Command| match object.keys().next() {
            Some(key) => Err(format!("{name} takes no argument (got {key:?})")),
            None => Ok(command),
        };
        let command = match name.as_str() {
            "flush" => no_args(Command::Flush),
            "info" => no_args(Command::Info),
            "activate" => no_args(Command::Activate),
            "inactivate" => no_args(Command::Inactivate),
            "merge-cancel" | "commit-cancel" => no_args(Command::MergeCancel),
            "commit" => args::<CommitRequest>("commit", object).map(Command::Commit),
            "snapshot" => args::<SnapshotArgs>("snapshot needs \"path\"", object)
                .map(|a| Command::Snapshot { path: a.path }),
            "resize" => args::<ResizeArgs>("resize needs \"size\" (bytes)", object)
                .map(|a| Command::Resize { size: a.size }),
            "bitmap" => args::<BitmapRequest>("bitmap", object).map(Command::Bitmap),
            "nbd-export" => {
                args::<NbdExportArgs>("nbd-export needs \"name\" and \"layer\"", object).map(|a| {
                    Command::NbdExport {
                        name: a.name,
                        layer: a.layer,
                    }
                })
            }
            "nbd-export-remove" => {
                args::<NbdExportRemoveArgs>("nbd-export-remove needs \"name\"", object)
                    .map(|a| Command::NbdExportRemove { name: a.name })
            }
            "merge" => args::<MergeRequest>("merge needs \"first\", \"last\" and \"path\"", object)
                .map(Command::Merge),
            "stats" => {
                args::<StatsArgs>("stats", object).map(|a| Command::Stats { format: a.format })
            }
            "export-add" | "export-remove" if export.is_none() => {
                Err(format!("{name} needs \"export\" (the export's name)"))
            }
            "export-add" => take_limits(&mut object).and_then(|limits| {
                args::<ExportAddRequest>("export-add", object).map(|a| {
                    Command::ExportAdd(ExportAddRequest {
                        id: export.clone().unwrap_or_default(),
                        limits,
                        ..a
                    })
                })
            }),
            "set-io-throttle" => take_limits(&mut object).and_then(|limits| {
                let group = match object.remove("group") {
                    None => Ok(None),
                    Some(Value::String(g)) => Ok(Some(g)),
                    Some(_) => Err("set-io-throttle: \"group\" must be a string".to_owned()),
                }?;
                match object.keys().next() {
                    Some(key) => Err(format!("set-io-throttle: unknown key {key:?}")),
                    None => Ok(Command::SetIoThrottle(IoThrottleRequest { group, limits })),
                }
            }),
            "export-remove" => no_args(Command::ExportRemove {
                id: export.clone().unwrap_or_default(),
            }),
            "export-list" => no_args(Command::ExportList),
            other => {
                return Err((
                    id,
                    Failure::new(
                        FailureKind::UnknownCommand,
                        format!("unknown command {other:?}"),
                    ),
                ))
            }
        };
        let command = command.map_err(|m| (id.clone(), bad(m)))?;
        if export.is_some() && command == Command::ExportList {
            return Err((id, bad(format!("{name} takes no \"export\""))));
        }
        Ok(Request {
            id,
            export,
            command,
        })
    }

    /// The line sending this request (with its `id`).
    pub fn to_line(&self) -> String {
        let mut o = Map::new();
        o.insert("id".into(), self.id.clone());
        let export = match &self.command {
            Command::ExportAdd(a) => Some(&a.id),
            Command::ExportRemove { id } => Some(id),
            _ => self.export.as_ref(),
        };
        if let Some(export) = export {
            o.insert("export".into(), Value::String(export.clone()));
        }
        let (name, args): (&str, Vec<(&str, Value)>) = match &self.command {
            Command::Snapshot { path } => (
                "snapshot",
                vec![("path", Value::String(path.to_string_lossy().into_owned()))],
            ),
            Command::Flush => ("flush", vec![]),
            Command::Info => ("info", vec![]),
            Command::Activate => ("activate", vec![]),
            Command::Inactivate => ("inactivate", vec![]),
            Command::MergeCancel => ("merge-cancel", vec![]),
            Command::Resize { size } => ("resize", vec![("size", Value::from(*size))]),
            Command::Commit(c) => (
                "commit",
                match serde_json::to_value(c) {
                    Ok(Value::Object(fields)) => {
                        for (k, v) in fields {
                            o.insert(k, v);
                        }
                        vec![]
                    }
                    _ => vec![],
                },
            ),
            Command::NbdExport { name, layer } => (
                "nbd-export",
                vec![
                    ("name", Value::String(name.clone())),
                    ("layer", serde_json::to_value(layer).unwrap_or(Value::Null)),
                ],
            ),
            Command::NbdExportRemove { name } => (
                "nbd-export-remove",
                vec![("name", Value::String(name.clone()))],
            ),
            Command::Bitmap(b) => (
                "bitmap",
                match serde_json::to_value(b) {
                    Ok(Value::Object(fields)) => {
                        for (k, v) in fields {
                            o.insert(k, v);
                        }
                        vec![]
                    }
                    _ => vec![],
                },
            ),
            Command::Merge(m) => (
                "merge",
                match serde_json::to_value(m) {
                    Ok(Value::Object(fields)) => {
                        for (k, v) in fields {
                            o.insert(k, v);
                        }
                        vec![]
                    }
                    _ => vec![],
                },
            ),
            Command::ExportAdd(a) => {
                if let Ok(Value::Object(fields)) = serde_json::to_value(a) {
                    o.extend(fields);
                }
                put_limits(&mut o, &a.limits);
                ("export-add", vec![])
            }
            Command::SetIoThrottle(t) => {
                put_limits(&mut o, &t.limits);
                if let Some(g) = &t.group {
                    o.insert("group".into(), Value::String(g.clone()));
                }
                ("set-io-throttle", vec![])
            }
            Command::ExportRemove { .. } => ("export-remove", vec![]),
            Command::ExportList => ("export-list", vec![]),
            Command::Stats { format } => (
                "stats",
                vec![(
                    "format",
                    Value::String(match format {
                        StatsFormat::Json => "json".into(),
                        StatsFormat::Prometheus => "prometheus".into(),
                    }),
                )],
            ),
        };
        o.insert("command".into(), Value::String(name.into()));
        for (k, v) in args {
            o.insert(k.into(), v);
        }
        Value::Object(o).to_string()
    }
}

/// The result of `activate` and `inactivate`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Activity {
    /// Whether the daemon is active now.
    pub active: bool,
}

/// Time of each step of a live snapshot, in milliseconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SnapshotSteps {
    /// Before the pause, while the guest runs: the new top created and
    /// opened (its index is built after the pause, in the background),
    /// the old top written back (its journal and spare clusters kept).
    pub prepare_ms: f64,
    /// In the pause: waiting for requests in flight.
    pub drain_ms: f64,
    /// In the pause: the new chain made from the old one (no file
    /// written: it reads the old top's last tables from memory until the
    /// close), switched to.
    pub switch_ms: f64,
    /// After the pause, while the guest runs: the old top closed (its
    /// last tables written back and made durable, journal ended, spare
    /// clusters given back, dirty bit cleared).
    #[serde(default)]
    pub close_ms: f64,
    /// Of the pause, how long the thread doing it was runnable but
    /// waited for a CPU that other threads had (the kernel's run-queue
    /// wait; 0 where the kernel does not keep it).
    #[serde(default)]
    pub cpu_wait_ms: f64,
    /// Engine jobs that had begun on the old chain when the pause came
    /// (the drain waits for them).
    #[serde(default)]
    pub drain_jobs: usize,
    /// Of their threads, those raised to real-time scheduling until
    /// their job ended (a drain not done after 0.1 ms, in a real-time
    /// pause).
    #[serde(default)]
    pub drain_jobs_raised: usize,
    /// From the pause's start to the drain's end, how long those jobs'
    /// threads waited for a CPU, summed over them.
    #[serde(default)]
    pub drain_jobs_cpu_wait_ms: f64,
    /// The same span, the longest any of them slept (a lock, I/O).
    #[serde(default)]
    pub drain_jobs_blocked_ms: f64,
    /// Whether the pause ran at real-time priority (`sqcow2 serve`
    /// without `--no-realtime-pause`, where the daemon may raise it).
    #[serde(default)]
    pub realtime: bool,
}

/// The result of `resize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ResizeResult {
    /// The disk's size now, in bytes.
    pub size: u64,
    /// The size before.
    pub old_size: u64,
    /// Whether the frontend was told (`VHOST_USER_BACKEND_CONFIG_CHANGE_MSG`
    /// through the channel it gave: QEMU does, Cloud Hypervisor v53 gives
    /// none); a frontend not told sees the size when it next reads the
    /// config space.
    pub frontend_told: bool,
    /// How long requests waited, in milliseconds.
    pub pause_ms: f64,
}

/// The result of `snapshot`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SnapshotResult {
    /// The new active volume.
    pub path: PathBuf,
    /// Layers of the chain now.
    pub layers: usize,
    /// Whether lookups go through the chain index.
    pub indexed: bool,
    /// How long new requests waited.
    pub pause_ms: f64,
    /// The pause, step by step.
    pub steps: SnapshotSteps,
    /// When the snapshot began (before the preparation), microseconds
    /// since the Unix epoch.
    #[serde(default)]
    pub started_unix_us: u64,
    /// When the pause began, microseconds since the Unix epoch.
    #[serde(default)]
    pub paused_unix_us: u64,
}

/// The result of `info`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Info {
    /// The active volume.
    pub top: PathBuf,
    /// Number of layers.
    pub layers: usize,
    /// Their paths, base first.
    pub chain: Vec<PathBuf>,
    /// Virtual size in bytes.
    pub virtual_size: u64,
    /// Whether lookups go through the chain index.
    pub indexed: bool,
    /// Why they do not, if they do not.
    #[serde(default)]
    pub walking_because: Option<String>,
    /// Whether the chain takes writes.
    pub writable: bool,
    /// Whether the daemon is active (holds its image locks and serves).
    pub active: bool,
    /// Why writes are refused although the chain was opened writable.
    pub write_failure: Option<String>,
    /// Whether a vhost-user frontend is connected.
    pub frontend_connected: bool,
}

/// How lookups are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IndexMode {
    /// Through the chain index.
    Indexed,
    /// Layer by layer.
    Walk,
}

/// The chain index in use and its background builds (after a live
/// snapshot, or at start when the top's index is missing).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct IndexCounters {
    /// Layers walked above the index in use until the top's own index is
    /// installed.
    pub pending_layers: usize,
    /// Whether a build runs now.
    pub building: bool,
    /// Builds completed (index written and installed).
    pub builds: u64,
    /// Builds that failed (the previous index goes on serving).
    pub failures: u64,
    /// Duration of the last completed build.
    pub last_build_ms: f64,
    /// Why the last build failed, if it did.
    pub last_error: Option<String>,
    /// Why lookups walk the layers below the top (none while an index
    /// serves them).
    #[serde(default)]
    pub walking_because: Option<String>,
}

/// Counters of the unified metadata cache.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct CacheCounters {
    /// Lookups served from the cache.
    pub hits: u64,
    /// Lookups not in the cache.
    pub misses: u64,
    /// Slices read from files.
    pub loads: u64,
    /// Cached entries that sent a walk further down.
    pub hit_unallocated: u64,
    /// Slices evicted.
    pub evictions: u64,
    /// Bytes held now.
    pub bytes: u64,
}

impl From<sqcow2_format::CacheSnapshot> for CacheCounters {
    fn from(c: sqcow2_format::CacheSnapshot) -> Self {
        CacheCounters {
            hits: c.hits,
            misses: c.misses,
            loads: c.loads,
            hit_unallocated: c.hit_unallocated,
            evictions: c.evictions,
            bytes: c.bytes,
        }
    }
}

/// Live snapshots taken.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SnapshotCounters {
    /// How many.
    pub count: u64,
    /// Median pause.
    pub pause_ms_p50: f64,
    /// 99th percentile pause.
    pub pause_ms_p99: f64,
    /// Longest pause.
    pub pause_ms_max: f64,
    /// Sum of the pauses.
    #[serde(default)]
    pub pause_ms_sum: f64,
    /// Pauses at most each of [`LATENCY_BUCKETS_US`] (cumulative).
    #[serde(default)]
    pub pause_buckets: Vec<u64>,
}

pub use crate::device::stats::LATENCY_BUCKETS_US;

/// Counters of one queue.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct QueueCounters {
    /// Queue number.
    pub queue: usize,
    /// Requests completed.
    pub requests: u64,
    /// Bytes read by the guest.
    pub read_bytes: u64,
    /// Bytes written by the guest.
    pub write_bytes: u64,
    /// Requests completed with an error status.
    pub errors: u64,
    /// Median latency.
    pub latency_us_p50: u64,
    /// 99th percentile latency.
    pub latency_us_p99: u64,
    /// Longest latency.
    pub latency_us_max: u64,
    /// Requests whose latency was measured (those completed after they
    /// started; not those rejected before).
    #[serde(default)]
    pub latency_us_count: u64,
    /// Sum of those latencies.
    #[serde(default)]
    pub latency_us_sum: u64,
    /// Requests whose latency is at most each of [`LATENCY_BUCKETS_US`]
    /// (cumulative, as Prometheus buckets).
    #[serde(default)]
    pub latency_us_buckets: Vec<u64>,
}

/// The result of `stats`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Stats {
    /// Seconds since the daemon started.
    pub uptime_s: f64,
    /// The last live merge.
    #[serde(default)]
    pub merge: MergeCounters,
    /// How lookups are resolved.
    pub index_mode: IndexMode,
    /// Layers of the chain.
    pub layers: usize,
    /// The unified metadata cache.
    pub cache: CacheCounters,
    /// Data reads served by each layer, base first.
    pub data_reads_per_layer: Vec<u64>,
    /// Live snapshots.
    pub snapshots: SnapshotCounters,
    /// The chain index and its background builds.
    pub index: IndexCounters,
    /// Per queue, while a frontend is connected.
    pub queues: Vec<QueueCounters>,
    /// Requests in flight now.
    pub requests_in_flight: usize,
    /// Whether the daemon is active (holds its image locks and serves).
    pub active: bool,
    /// Panics caught in queue workers and engine threads (bugs: their
    /// requests failed, and the chain refuses writes since).
    pub worker_panics: u64,
    /// Why writes are refused although the chain was opened writable.
    pub write_failure: Option<String>,
    /// The export's I/O limits and how often they held requests back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle: Option<ThrottleCounters>,
    /// The layer files the daemon's chains share, and their one cache
    /// (the daemon's, the same for every export).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_layers: Option<SharedLayerCounters>,
}

/// What `stats` shows of the layers the daemon's chains share.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SharedLayerCounters {
    /// Files shared now (each opened once).
    pub files: usize,
    /// Their one cache of tables.
    pub cache: CacheCounters,
}

/// The result of `stats` in Prometheus format.
/// Where a merge is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MergeState {
    /// No merge has run.
    #[default]
    Idle,
    /// Measuring the guest's latency before the copy.
    Measuring,
    /// Copying the merged layers' view into the new file.
    Copying,
    /// Pausing the guest to switch the chain.
    Switching,
    /// Finished: the chain uses the new file.
    Done,
    /// Failed (the chain is as it was before).
    Failed,
    /// Cancelled (the chain is as it was before).
    Cancelled,
}

/// What a background job of the daemon does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobKind {
    /// A live merge: layers below the top into a new file.
    #[default]
    Merge,
    /// A live commit: the top into a layer below, then served from it.
    Commit,
}

/// The last merge or live commit (one at a time).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct MergeCounters {
    /// Which job.
    #[serde(default)]
    pub kind: JobKind,
    /// Where it is.
    pub state: MergeState,
    /// The new file.
    pub path: Option<PathBuf>,
    /// The lowest layer merged.
    pub first: usize,
    /// The highest layer merged.
    pub last: usize,
    /// Guest bytes looked at.
    pub done_bytes: u64,
    /// Guest bytes to look at (the disk).
    pub total_bytes: u64,
    /// Bytes written into the new file.
    pub written_bytes: u64,
    /// Time from start to end (when it ended).
    pub elapsed_ms: f64,
    /// Time the copy waited for the rate limit or the guest's latency.
    pub throttled_ms: f64,
    /// The guest's p99 latency before the copy (latency-paced merges).
    pub baseline_p99_us: u64,
    /// The guest's p99 over the last window the copy looked at.
    pub window_p99_us: u64,
    /// The switch's pause.
    pub pause_ms: f64,
    /// Layers in the chain after the switch.
    pub layers_after: usize,
    /// The files no longer in the chain (left for the operator).
    pub replaced: Vec<PathBuf>,
    /// A commit: bytes the guest's own changes had mirrored into the base.
    #[serde(default)]
    pub mirrored_bytes: u64,
    /// Why it failed or stopped.
    pub error: Option<String>,
}

/// What `merge` answers (the merge goes on in the background).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct MergeStarted {
    /// The new file.
    pub path: PathBuf,
    /// The lowest layer merged.
    pub first: usize,
    /// The highest layer merged.
    pub last: usize,
    /// The files the merge replaces, lowest first.
    pub replaced: Vec<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct PrometheusText {
    /// The exposition text.
    pub text: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_errors_are_typed() {
        for command in [
            Command::Snapshot {
                path: "/a/b.qcow2".into(),
            },
            Command::Flush,
            Command::Info,
            Command::Activate,
            Command::Inactivate,
            Command::Stats {
                format: StatsFormat::Prometheus,
            },
            Command::MergeCancel,
            Command::Resize { size: 3 << 30 },
            Command::NbdExport {
                name: "backup".into(),
                layer: LayerName::File("/a/l3.qcow2".into()),
            },
            Command::NbdExportRemove {
                name: "backup".into(),
            },
            Command::Bitmap(BitmapRequest {
                op: BitmapOp::Merge,
                name: Some("b1".into()),
                granularity: None,
                disabled: false,
                source: Some("b0".into()),
                source_layer: Some(LayerName::Position(2)),
            }),
            Command::Bitmap(BitmapRequest {
                op: BitmapOp::Add,
                name: Some("b2".into()),
                granularity: Some(4096),
                disabled: true,
                source: None,
                source_layer: None,
            }),
            Command::Merge(MergeRequest {
                first: LayerName::Position(0),
                last: LayerName::File("/a/l3.qcow2".into()),
                path: "/a/m.qcow2".into(),
                rate_limit: Some(1 << 20),
                max_p99_permille: None,
            }),
        ] {
            let line = Request {
                id: Value::from(3),
                export: None,
                command: command.clone(),
            }
            .to_line();
            let parsed = Request::parse(&line).unwrap();
            assert_eq!(parsed.command, command);
            assert_eq!(parsed.id, Value::from(3));
        }
        let kind = |line: &str| Request::parse(line).unwrap_err().1.kind;
        assert_eq!(kind("{x"), FailureKind::BadRequest);
        assert_eq!(kind("[1]"), FailureKind::BadRequest);
        assert_eq!(kind("{\"id\":1}"), FailureKind::BadRequest);
        assert_eq!(kind("{\"command\":\"nope\"}"), FailureKind::UnknownCommand);
        // A key twice, at any depth; a key a command does not take.
        for line in [
            r#"{"command":"info","command":"flush"}"#,
            r#"{"command":"info","id":{"a":1,"a":2}}"#,
            r#"{"command":"info","id":[{"a":1,"a":2}]}"#,
            r#"{"command":"info","x":1}"#,
            r#"{"command":"snapshot","path":"/p","x":1}"#,
        ] {
            assert_eq!(kind(line), FailureKind::BadRequest, "{line}");
        }
        assert!(Request::parse(r#"{"command":"info","id":{"a":1,"b":[2,{"c":null}]}}"#).is_ok());
        assert_eq!(kind("{\"command\":\"snapshot\"}"), FailureKind::BadRequest);
        assert_eq!(
            kind("{\"command\":\"merge\",\"first\":0,\"path\":\"/m\"}"),
            FailureKind::BadRequest
        );
        assert_eq!(
            kind("{\"command\":\"stats\",\"format\":\"xml\"}"),
            FailureKind::BadRequest
        );
        assert_eq!(
            Request::parse("{\"id\":9,\"command\":7}").unwrap_err().0,
            Value::from(9)
        );
    }
}
