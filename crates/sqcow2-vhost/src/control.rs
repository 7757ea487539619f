//! The control socket (`sqcow2 serve --control PATH`): one JSON object per
//! line each way; see `docs/control-api.md`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use serde_json::{json, Value};
use sqcow2_format::{Chain, ChainOptions};
use tracing::{info, warn};

use crate::backend::BlkBackend;
use crate::handle::ChainHandle;

/// Longest request line accepted.
const MAX_LINE: usize = 64 * 1024;

/// What the control socket and the vhost-user side share.
#[derive(Debug)]
pub struct Shared {
    /// The served chain.
    pub handle: Arc<ChainHandle>,
    /// How the chain is opened (a live snapshot reopens it so).
    pub options: ChainOptions,
    /// The backend of the connected frontend, if any.
    pub session: Mutex<Option<Arc<BlkBackend>>>,
    /// Held by a running snapshot.
    snapshot_running: Mutex<()>,
    /// Pause of every live snapshot, in milliseconds.
    pauses_ms: Mutex<Vec<f64>>,
    started: Instant,
}

impl Shared {
    /// State for serving `handle`.
    pub fn new(handle: Arc<ChainHandle>, options: ChainOptions) -> Self {
        Shared {
            handle,
            options,
            session: Mutex::new(None),
            snapshot_running: Mutex::new(()),
            pauses_ms: Mutex::new(Vec::new()),
            started: Instant::now(),
        }
    }

    fn session(&self) -> Option<Arc<BlkBackend>> {
        self.session
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A typed error reply.
#[derive(Debug)]
struct Failure {
    kind: &'static str,
    message: String,
}

fn fail(kind: &'static str, message: impl Into<String>) -> Failure {
    Failure {
        kind,
        message: message.into(),
    }
}

/// Serves the control socket at `listener` until the process ends.
pub fn spawn(listener: UnixListener, shared: Arc<Shared>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => {
                        let shared = shared.clone();
                        let _ = std::thread::Builder::new()
                            .name("control-conn".into())
                            .spawn(move || connection(stream, &shared));
                    }
                    Err(e) => warn!("control socket: {e}"),
                }
            }
        })
        .map(|_| ())
}

fn connection(stream: UnixStream, shared: &Shared) {
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        match (&mut reader).take(MAX_LINE as u64 + 1).read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let reply = if line.len() > MAX_LINE {
            error_reply(&Value::Null, fail("bad-request", "line too long"))
        } else {
            handle_line(line.trim(), shared)
        };
        let mut text = reply.to_string();
        text.push('\n');
        if out.write_all(text.as_bytes()).is_err() {
            return;
        }
        if line.len() > MAX_LINE {
            return;
        }
    }
}

fn error_reply(id: &Value, f: Failure) -> Value {
    json!({"id": id, "ok": false, "error": {"kind": f.kind, "message": f.message}})
}

/// Answers one request line.
pub fn handle_line(line: &str, shared: &Shared) -> Value {
    let request: Value = match serde_json::from_str(line) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return error_reply(
                &Value::Null,
                fail("bad-request", "a request is a JSON object"),
            )
        }
        Err(e) => {
            return error_reply(
                &Value::Null,
                fail("bad-request", format!("invalid JSON: {e}")),
            )
        }
    };
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    let result = match request.get("command").and_then(Value::as_str) {
        Some("snapshot") => match request.get("path").and_then(Value::as_str) {
            Some(path) => live_snapshot(shared, Path::new(path)),
            None => Err(fail("bad-request", "snapshot needs \"path\"")),
        },
        Some("flush") => flush(shared),
        Some("info") => Ok(info_of(shared)),
        Some("stats") => match request.get("format").and_then(Value::as_str) {
            None | Some("json") => Ok(stats(shared)),
            Some("prometheus") => Ok(json!({"text": prometheus(&stats(shared))})),
            Some(other) => Err(fail("bad-request", format!("unknown stats format {other}"))),
        },
        Some(other) => Err(fail(
            "unknown-command",
            format!("unknown command {other:?}"),
        )),
        None => Err(fail("bad-request", "missing \"command\"")),
    };
    match result {
        Ok(v) => json!({"id": id, "ok": true, "result": v}),
        Err(f) => error_reply(&id, f),
    }
}

fn flush(shared: &Shared) -> Result<Value, Failure> {
    shared
        .handle
        .get()
        .flush()
        .map_err(|e| fail("io-error", e.to_string()))?;
    Ok(json!({}))
}

/// Quiesce, flush, create the new active volume and its index, switch.
fn live_snapshot(shared: &Shared, new: &Path) -> Result<Value, Failure> {
    let Ok(_running) = shared.snapshot_running.try_lock() else {
        return Err(fail("busy", "another snapshot is running"));
    };
    if new.exists() {
        return Err(fail("exists", format!("{} exists", new.display())));
    }
    // Write most dirty metadata back while the guest still runs: the
    // flush inside the pause then has little left to do.
    shared
        .handle
        .get()
        .flush()
        .map_err(|e| fail("io-error", format!("flush before the snapshot: {e}")))?;
    let start = Instant::now();
    let session = shared.session();
    let pause = shared.handle.pause();
    if let Some(backend) = &session {
        backend.drain();
    }
    let drained = start.elapsed();
    let old = shared.handle.get();
    old.flush_clean()
        .map_err(|e| fail("io-error", format!("flush before the snapshot: {e}")))?;
    let flushed = start.elapsed();
    let top = old.top().path().to_path_buf();
    sqcow2_format::indexing::snapshot(&top, new, &mut |_, _| {})
        .map_err(|e| fail("snapshot-failed", e.to_string()))?;
    let created = start.elapsed();
    let chain = match Chain::open(new, &shared.options) {
        Ok(c) => c,
        Err(e) => {
            // Keep serving the old top; the new file would go stale.
            let _ = std::fs::remove_file(new);
            let _ = std::fs::remove_file(sqcow2_format::indexing::index_path_of(new));
            return Err(fail("snapshot-failed", format!("opening the new top: {e}")));
        }
    };
    let layers = chain.layers().len();
    let indexed = chain.is_indexed();
    let old = {
        drop(old);
        shared.handle.replace(chain)
    };
    drop(pause);
    let pause_ms = start.elapsed().as_secs_f64() * 1000.0;
    drop(old);
    shared
        .pauses_ms
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(pause_ms);
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    let steps = json!({
        "drain_ms": ms(drained),
        "flush_ms": ms(flushed - drained),
        "create_ms": ms(created - flushed),
        "open_ms": pause_ms - ms(created),
    });
    info!(new = %new.display(), layers, pause_ms, %steps, "live snapshot");
    Ok(
        json!({"path": new, "layers": layers, "indexed": indexed, "pause_ms": pause_ms, "steps": steps}),
    )
}

fn info_of(shared: &Shared) -> Value {
    let chain = shared.handle.get();
    let layers: Vec<PathBuf> = chain
        .layers()
        .iter()
        .map(|l| l.path().to_path_buf())
        .collect();
    json!({
        "top": chain.top().path(),
        "layers": layers.len(),
        "chain": layers,
        "virtual_size": chain.virtual_size(),
        "indexed": chain.is_indexed(),
        "writable": chain.is_writable(),
        "frontend_connected": shared.session().is_some(),
    })
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn stats(shared: &Shared) -> Value {
    let chain = shared.handle.get();
    let c = chain.cache_stats();
    let mut pauses = shared
        .pauses_ms
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    pauses.sort_by(f64::total_cmp);
    let session = shared.session();
    let queues = session
        .as_ref()
        .map(|b| b.queue_stats())
        .unwrap_or_default();
    let worker_panics = session.as_ref().map_or(0, |b| b.device().panics());
    json!({
        "uptime_s": shared.started.elapsed().as_secs_f64(),
        "index_mode": if chain.is_indexed() { "indexed" } else { "walk" },
        "layers": chain.layers().len(),
        "cache": {
            "hits": c.hits, "misses": c.misses, "loads": c.loads,
            "hit_unallocated": c.hit_unallocated, "evictions": c.evictions, "bytes": c.bytes,
        },
        "data_reads_per_layer": chain.data_reads_per_layer(),
        "snapshots": {
            "count": pauses.len(),
            "pause_ms_p50": quantile(&pauses, 0.5),
            "pause_ms_p99": quantile(&pauses, 0.99),
            "pause_ms_max": pauses.last().copied().unwrap_or(0.0),
        },
        "queues": queues,
        "worker_panics": worker_panics,
    })
}

/// The stats in Prometheus' text format.
pub fn prometheus(stats: &Value) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, help: &str, kind: &str, samples: Vec<(String, f64)>| {
        out.push_str(&format!(
            "# HELP sqcow2_{name} {help}\n# TYPE sqcow2_{name} {kind}\n"
        ));
        for (labels, v) in samples {
            out.push_str(&format!("sqcow2_{name}{labels} {v}\n"));
        }
    };
    let num = |v: &Value| v.as_f64().unwrap_or(0.0);
    metric(
        "uptime_seconds",
        "Seconds since the daemon started.",
        "gauge",
        vec![(String::new(), num(&stats["uptime_s"]))],
    );
    metric(
        "layers",
        "Layers of the served chain.",
        "gauge",
        vec![(String::new(), num(&stats["layers"]))],
    );
    metric(
        "indexed",
        "1 when lookups use the chain index.",
        "gauge",
        vec![(
            String::new(),
            if stats["index_mode"] == "indexed" {
                1.0
            } else {
                0.0
            },
        )],
    );
    for (key, kind) in [
        ("hits", "counter"),
        ("misses", "counter"),
        ("loads", "counter"),
        ("hit_unallocated", "counter"),
        ("evictions", "counter"),
        ("bytes", "gauge"),
    ] {
        metric(
            &format!("cache_{key}"),
            &format!("Unified metadata cache: {key}."),
            kind,
            vec![(String::new(), num(&stats["cache"][key]))],
        );
    }
    metric(
        "worker_panics_total",
        "Worker panics caught (bugs; their requests failed).",
        "counter",
        vec![(String::new(), num(&stats["worker_panics"]))],
    );
    let snaps = &stats["snapshots"];
    metric(
        "snapshots_total",
        "Live snapshots taken.",
        "counter",
        vec![(String::new(), num(&snaps["count"]))],
    );
    metric(
        "snapshot_pause_milliseconds",
        "Guest-visible pause of live snapshots.",
        "gauge",
        vec![
            ("{quantile=\"0.5\"}".into(), num(&snaps["pause_ms_p50"])),
            ("{quantile=\"0.99\"}".into(), num(&snaps["pause_ms_p99"])),
            ("{quantile=\"1\"}".into(), num(&snaps["pause_ms_max"])),
        ],
    );
    let queues = stats["queues"].as_array().cloned().unwrap_or_default();
    for (key, help) in [
        ("requests", "Requests completed."),
        ("read_bytes", "Bytes read by the guest."),
        ("write_bytes", "Bytes written by the guest."),
        ("errors", "Requests completed with an error status."),
    ] {
        let samples = queues
            .iter()
            .map(|q| (format!("{{queue=\"{}\"}}", q["queue"]), num(&q[key])))
            .collect();
        metric(&format!("queue_{key}_total"), help, "counter", samples);
    }
    for (key, q) in [("latency_us_p50", "0.5"), ("latency_us_p99", "0.99")] {
        let samples = queues
            .iter()
            .map(|x| {
                (
                    format!("{{queue=\"{}\",quantile=\"{q}\"}}", x["queue"]),
                    num(&x[key]),
                )
            })
            .collect();
        metric(
            &format!("queue_{key}"),
            "Request latency in microseconds.",
            "gauge",
            samples,
        );
    }
    out
}

/// Binds the control socket with `mode`, like the vhost-user socket.
pub fn bind(path: &Path, mode: u32) -> std::io::Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() || UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} is in use", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    crate::server::with_umask(mode, || UnixListener::bind(path))
}
