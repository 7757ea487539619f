//! The exports of a daemon, by id: started together at the daemon's
//! start, added and removed over the control socket while the others
//! serve (`export-add`, `export-remove`, `export-list`), each request
//! about one disk routed to its export.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sqcow2_format::ChainOptions;
use tracing::info;

use crate::daemon::control::protocol::{
    Command, ExportAddRequest, ExportInfo, ExportListResult, ExportRemoved, Failure, FailureKind,
    IoThrottleRequest, Reply, Request, ThrottleCounters,
};
use crate::daemon::control::Shared;
use crate::daemon::error::{AddError, ExportSpecError, ServeError};
use crate::daemon::export::{DaemonContext, Export, ExportSpec};

/// Most exports one daemon serves by default (a control client adding
/// them in a loop is refused past it: each has threads and descriptors).
pub const MAX_EXPORTS: usize = 1024;

/// What identifies an export's resources: no two exports share one.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Claims {
    id: String,
    socket: Option<PathBuf>,
    /// The top's device and inode (a top served twice for writing would
    /// have two writers; read-only, twice is allowed).
    top: Option<(u64, u64)>,
    writable: bool,
}

/// The exports of a daemon.
#[derive(Debug)]
pub(crate) struct Exports {
    context: Arc<DaemonContext>,
    /// How chains are opened (each export's own keys applied on top).
    base: ChainOptions,
    /// The daemon-wide backing root, if given.
    backing_root: Option<PathBuf>,
    /// Most exports served at a time.
    max_exports: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The daemon stops: no export is added any more.
    closed: bool,
    serving: BTreeMap<String, Export>,
    /// Exports being added or removed (their claims held meanwhile: the
    /// chain's opening and closing run outside the lock).
    changing: Vec<Claims>,
}

impl State {
    fn claims(&self) -> impl Iterator<Item = Claims> + '_ {
        self.serving
            .values()
            .map(|e| claims_of(&e.spec, Some(&e.shared)))
            .chain(self.changing.iter().cloned())
    }
}

fn claims_of(spec: &ExportSpec, shared: Option<&Shared>) -> Claims {
    let top = match shared {
        Some(s) => std::fs::metadata(s.handle.get().top().path()).ok(),
        None => std::fs::metadata(&spec.image).ok(),
    };
    Claims {
        id: spec.id.clone(),
        socket: spec.socket.clone(),
        top: top.map(|m| (m.dev(), m.ino())),
        writable: !spec.read_only,
    }
}

/// Why `new` may not be served beside `old`, if it may not.
fn conflict(new: &Claims, old: &Claims) -> Option<String> {
    if new.id == old.id {
        return Some(format!("an export named {} exists", new.id));
    }
    if new.socket.is_some() && new.socket == old.socket {
        return Some(format!(
            "export {} serves on {} already",
            old.id,
            new.socket
                .as_deref()
                .map(Path::display)
                .map(|d| d.to_string())
                .unwrap_or_default()
        ));
    }
    if new.top.is_some() && new.top == old.top && (new.writable || old.writable) {
        return Some(format!(
            "export {} serves this image already{}",
            old.id,
            if old.writable { " for writing" } else { "" }
        ));
    }
    None
}

fn fail(kind: FailureKind, message: impl Into<String>) -> Failure {
    Failure::new(kind, message)
}

impl Exports {
    pub(crate) fn new(
        context: Arc<DaemonContext>,
        base: ChainOptions,
        backing_root: Option<PathBuf>,
        max_exports: usize,
    ) -> Self {
        Exports {
            context,
            base,
            backing_root,
            max_exports,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts serving `spec` (the daemon's backing root applied where the
    /// spec names none); refused if its id, socket or top (for writing)
    /// is another export's, or past the most exports.
    pub(crate) fn add(&self, mut spec: ExportSpec, inactive: bool) -> Result<(), AddError> {
        spec.validate()?;
        if spec.backing_root.is_none() {
            spec.backing_root = self.backing_root.clone();
        }
        let claims = claims_of(&spec, None);
        {
            let mut st = self.lock();
            if st.serving.len() + st.changing.len() >= self.max_exports {
                return Err(AddError::Refused(format!(
                    "the daemon serves its most exports already ({}, serve --max-exports)",
                    self.max_exports
                )));
            }
            if let Some(why) = st.claims().find_map(|old| conflict(&claims, &old)) {
                return Err(AddError::Refused(why));
            }
            st.changing.push(claims.clone());
        }
        // Opened outside the lock (I/O); the claims keep another add of
        // the same id, socket or top out meanwhile.
        let started = spec
            .open(&self.base, inactive)
            .map_err(AddError::Spec)
            .and_then(|chain| {
                let options = spec.chain_options(&self.base);
                Export::start(spec, chain, options, inactive, &self.context)
                    .map_err(AddError::Serve)
            });
        let mut st = self.lock();
        st.changing.retain(|c| *c != claims);
        let export = started?;
        if st.closed {
            // The daemon stopped meanwhile: ended as the others were.
            drop(st);
            let id = export.spec.id.clone();
            export.end().map_err(AddError::Serve)?;
            return Err(AddError::Refused(format!(
                "the daemon is stopping: export {id} ended"
            )));
        }
        st.serving.insert(export.spec.id.clone(), export);
        Ok(())
    }

    /// Stops serving export `id` and waits until it has ended (its
    /// guest's requests finished, its chain flushed and closed clean).
    pub(crate) fn remove(&self, id: &str) -> Result<(), Failure> {
        let export = {
            let mut st = self.lock();
            if st.serving.get(id).is_some_and(|e| e.spec.nbd.is_some()) {
                // Its NBD clients would go on with a chain closed under
                // them: it ends with the daemon.
                return Err(fail(
                    FailureKind::BadRequest,
                    format!("export {id} has an NBD socket: it is removed with the daemon"),
                ));
            }
            let Some(export) = st.serving.remove(id) else {
                return Err(fail(
                    FailureKind::BadRequest,
                    format!("no export named {id:?}"),
                ));
            };
            st.changing
                .push(claims_of(&export.spec, Some(&export.shared)));
            export
        };
        let claims = claims_of(&export.spec, Some(&export.shared));
        let ended = export.end();
        self.lock().changing.retain(|c| c.id != claims.id);
        ended.map_err(|e| fail(FailureKind::IoError, format!("export {id}: {e:#}")))?;
        info!(export = %id, "removed");
        Ok(())
    }

    /// The export a request is for: the one named, or the only one.
    pub(crate) fn get(&self, id: Option<&str>) -> Result<Arc<Shared>, Failure> {
        let st = self.lock();
        match id {
            Some(id) => st
                .serving
                .get(id)
                .map(|e| e.shared.clone())
                .ok_or_else(|| fail(FailureKind::BadRequest, format!("no export named {id:?}"))),
            None if st.serving.len() == 1 => Ok(st
                .serving
                .values()
                .next()
                .map(|e| e.shared.clone())
                .expect("one export")),
            None => Err(fail(
                FailureKind::BadRequest,
                format!(
                    "the daemon serves {} exports: name one (\"export\": ID)",
                    st.serving.len()
                ),
            )),
        }
    }

    /// Every export's state, by id.
    pub(crate) fn all(&self) -> Vec<(String, Arc<Shared>)> {
        self.lock()
            .serving
            .iter()
            .map(|(id, e)| (id.clone(), e.shared.clone()))
            .collect()
    }

    /// Exports whose thread ended on its own (an error), removed, with
    /// how they ended.
    pub(crate) fn reap_ended(&self) -> Vec<(String, Result<(), ServeError>)> {
        let ended: Vec<Export> = {
            let mut st = self.lock();
            let ids: Vec<String> = st
                .serving
                .iter()
                .filter(|(_, e)| e.has_ended())
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| st.serving.remove(id)).collect()
        };
        ended
            .into_iter()
            .map(|e| (e.spec.id.clone(), e.end()))
            .collect()
    }

    /// The exports as `export-list` answers.
    pub(crate) fn list(&self) -> ExportListResult {
        let st = self.lock();
        ExportListResult {
            exports: st.serving.values().map(info_of).collect(),
        }
    }

    /// Asks every export to end and waits for each, and for adds and
    /// removals under way; the first failure.
    pub(crate) fn end_all(&self) -> Result<(), ServeError> {
        let exports = {
            let mut st = self.lock();
            st.closed = true;
            std::mem::take(&mut st.serving)
        };
        for e in exports.values() {
            e.ask_to_end();
        }
        let mut first = Ok(());
        for (_, e) in exports {
            let ended = e.end();
            if first.is_ok() {
                first = ended;
            }
        }
        // An add finishing now ends its export itself; a removal ends its
        // own: both are waited for (each bounded by its drain's timeout).
        while !self.lock().changing.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        first
    }

    /// Answers one control request line: a daemon command, or one for
    /// the export it names (or the only one).
    pub(crate) fn handle_line(&self, line: &str) -> Reply {
        let request = match Request::parse(line) {
            Ok(r) => r,
            Err((id, failure)) => return Reply::failure(id, failure),
        };
        let id = request.id.clone();
        match request.command {
            Command::ExportAdd(add) => match self.add_requested(&add) {
                Ok(r) => Reply::success(id, &r),
                Err(f) => Reply::failure(id, f),
            },
            Command::ExportRemove { id: export } => match self.remove(&export) {
                Ok(()) => Reply::success(id, &ExportRemoved { id: export }),
                Err(f) => Reply::failure(id, f),
            },
            Command::ExportList => Reply::success(id, &self.list()),
            Command::SetIoThrottle(t) => {
                match self.set_io_throttle(request.export.as_deref(), &t) {
                    Ok(counters) => Reply::success(id, &counters),
                    Err(f) => Reply::failure(id, f),
                }
            }
            command => match self.get(request.export.as_deref()) {
                Ok(shared) => super::control::handle_request(
                    Request {
                        id: request.id,
                        export: request.export,
                        command,
                    },
                    &shared,
                ),
                Err(f) => Reply::failure(id, f),
            },
        }
    }

    /// `set-io-throttle`: the export's limits now (`null` when none).
    fn set_io_throttle(
        &self,
        export: Option<&str>,
        t: &IoThrottleRequest,
    ) -> Result<Option<ThrottleCounters>, Failure> {
        t.limits
            .validate()
            .map_err(|e| fail(FailureKind::BadRequest, e))?;
        if let Some(g) = &t.group {
            if !crate::daemon::export::valid_id(g) {
                return Err(fail(
                    FailureKind::BadRequest,
                    "a group is 1-64 letters, digits, '-', '_' or '.'",
                ));
            }
        }
        let (id, shared) = {
            let shared = self.get(export)?;
            let st = self.lock();
            let id = st
                .serving
                .iter()
                .find(|(_, e)| Arc::ptr_eq(&e.shared, &shared))
                .map(|(id, _)| id.clone())
                .unwrap_or_default();
            (id, shared)
        };
        shared.throttle.set(
            &id,
            t.group.as_deref(),
            Some(t.limits.clone()),
            &self.context.throttle_groups,
        );
        // A request parked under the old limits looks again now (the
        // group's other exports' at their next wake-up).
        if let Some(backend) = shared.session() {
            backend.wake_all();
        }
        info!(export = %id, group = ?t.group, limits = ?t.limits, "I/O limits set");
        Ok(shared.throttle.counters())
    }

    fn add_requested(&self, add: &ExportAddRequest) -> Result<ExportInfo, Failure> {
        let mut spec = ExportSpec::new(add.id.clone(), add.image.clone());
        spec.socket = Some(add.socket.clone());
        spec.read_only = add.read_only;
        spec.num_queues = add.num_queues.unwrap_or(spec.num_queues);
        spec.queue_size = add.queue_size.unwrap_or(spec.queue_size);
        spec.backing_root = add.backing_root.clone();
        spec.limits = add.limits.clone();
        spec.group = add.group.clone();
        self.add(spec, false).map_err(|e| {
            let kind = match &e {
                AddError::Spec(ExportSpecError::Open { source, .. })
                    if matches!(source.kind, sqcow2_format::ErrorKind::Locked { .. }) =>
                {
                    FailureKind::Locked
                }
                AddError::Spec(ExportSpecError::Open { .. }) | AddError::Serve(_) => {
                    FailureKind::IoError
                }
                AddError::Refused(_) => FailureKind::Exists,
                AddError::Spec(_) => FailureKind::BadRequest,
            };
            fail(kind, format!("{:#}", anyhow_like(&e)))
        })?;
        let st = self.lock();
        st.serving
            .get(&add.id)
            .map(info_of)
            .ok_or_else(|| fail(FailureKind::IoError, "removed while it was added"))
    }
}

/// `e` with its causes, as `{:#}` of anyhow would print it.
fn anyhow_like(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn info_of(e: &Export) -> ExportInfo {
    let chain = e.shared.handle.get();
    ExportInfo {
        id: e.spec.id.clone(),
        socket: e.spec.socket.clone(),
        image: chain.top().path().to_path_buf(),
        layers: chain.layers().len(),
        read_only: e.spec.read_only,
        num_queues: e.spec.num_queues,
        frontend_connected: e.shared.session().is_some(),
        worker_threads: e.shared.session_threads(),
    }
}
