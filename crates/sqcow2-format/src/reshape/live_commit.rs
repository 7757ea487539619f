//! `commit --live`: the served chain's view from a base's layer up
//! written into the base while the guest runs, then the base served as the
//! top (QEMU's active block-commit with its pivot). It always finishes,
//! whatever the guest writes and at any pace. Into the base directly
//! below the top, the top drains ([`crate::chain::drain`]): it only
//! shrinks, clusters it no longer decides read and written in the base.
//! Over several layers, guest changes are mirrored into the base
//! ([`crate::chain::mirror`]): marked, copied pass after pass, then each
//! one waiting for its copy. Until the switch the files on disk still
//! name the old top, which reads every completed write.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::chain::drain::Drain;
use crate::chain::mirror::Mirror;
use crate::chain::{Chain, ChainOptions};
use crate::error::{Error, ErrorKind};
use crate::layer::Layer;
use crate::lock::{LockRequest, Locking, Perms};
use crate::storage::Storage;
use crate::types::LayerIndex;

use super::copy::{has_short_layers, Pace};
use super::{find_layer, invalid, LayerRef};

/// Guest bytes the background copy holds (and copies) at once: a guest
/// change of the same range waits for it (asynchronous mirror: only the
/// copy of its clusters, later, does).
const CHUNK: u64 = 256 << 10;
/// Longest a switch waits for another thread to let go of the base (a
/// publish in progress) before it gives up.
const SWITCH_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Sleeps `step` at a time while `busy`, at most `longest` in all.
fn wait_bounded(longest: std::time::Duration, step: std::time::Duration, busy: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + longest;
    while busy() && std::time::Instant::now() < deadline {
        std::thread::sleep(step);
    }
}
/// Changed bytes left below which the mirror goes synchronous (the
/// guest's changes then wait for their copies until the rest is copied).
const SYNCHRONOUS_BELOW: u64 = 4 << 20;
/// Passes over the changed clusters at most before it goes synchronous
/// (each must at least halve what is left).
const ASYNC_PASSES: u32 = 16;

/// How the guest's changes reach the base while the copy runs.
#[derive(Debug)]
enum Mode {
    /// The top drains into the base directly below it.
    Drain(Arc<Drain>),
    /// Changes are mirrored into a base further down.
    Mirror(Arc<Mirror>),
}

/// Guest bytes a drain holds (and copies) at once.
const DRAIN_BATCH: u64 = 1 << 20;

/// A live commit prepared on a served chain: the base open for writing
/// (its image lock taken, so no other process uses it), not yet mirrored.
#[must_use = "a live commit holds the base for writing until finished or abandoned"]
pub struct LiveCommit {
    target: Arc<Chain>,
    mode: Mode,
    /// [`LiveCommit::start`] ran: the served chain routes or mirrors.
    started: std::sync::atomic::AtomicBool,
    base: LayerIndex,
    base_path: PathBuf,
    replaced: Vec<PathBuf>,
    /// The served chain's top and layer count (the chain the mirror and
    /// the copy must be given).
    top_id: Option<(u64, u64)>,
    layers: usize,
    /// The served chain's description of the base, its lock relaxed to
    /// share writing with `target` (put back by [`LiveCommit::abandon`]).
    served_base: Arc<dyn Storage>,
    served_lock: Option<LockRequest>,
    locking: Locking,
}

impl std::fmt::Debug for LiveCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveCommit")
            .field("base", &self.base_path)
            .finish_non_exhaustive()
    }
}

/// What the background copy wrote.
#[derive(Debug, Clone, Copy, Default)]
pub struct LiveCopied {
    /// Guest bytes written with data.
    pub data_bytes: u64,
    /// Guest bytes written as zeros.
    pub zero_bytes: u64,
}

/// Checks a live commit of the served `chain` into `base` (its top's
/// backing file when `None`) and opens the base for writing with
/// `options` (the daemon's): refused when another process uses the base,
/// before anything is written.
pub fn prepare_live_commit(
    chain: &Chain,
    base: Option<&LayerRef>,
    options: &ChainOptions,
) -> Result<LiveCommit, Error> {
    let top = chain.top().path();
    if !chain.is_writable() {
        return Err(invalid(top, "the chain is served read-only".into()));
    }
    if chain.layers().len() < 2 {
        return Err(invalid(top, "image does not have a backing file".into()));
    }
    let base = match base {
        Some(b) => find_layer(chain, b)?,
        None => LayerIndex(chain.top_index().0 - 1),
    };
    if base.0 >= chain.top_index().0 {
        return Err(invalid(top, "the base is the top itself".into()));
    }
    if !chain.unclosed_below().is_empty() {
        return Err(invalid(
            top,
            "a live snapshot's old top is not closed yet: retry once the snapshot has finished"
                .into(),
        ));
    }
    let layer = &chain.layers()[base.0];
    let base_path = layer.path().to_path_buf();
    let Layer::Qcow2(q) = layer else {
        return Err(invalid(
            &base_path,
            "a raw base is committed offline only (sqcow2 commit)".into(),
        ));
    };
    q.header()
        .refuse_if_marked_corrupt()
        .map_err(|k| Error::new(&base_path, k))?;
    if q.shared_elsewhere() {
        // Its descriptor (and locks) are other chains' too: no lock
        // would keep their reads from the commit's writes.
        return Err(invalid(
            &base_path,
            "another disk this process serves reads the base: it cannot be written".into(),
        ));
    }
    // No chain opened from now on shares it (it would take the tables as
    // they were, and no lock of its own): they open it afresh, under the
    // image locks.
    if let (Some(shared), Some(id)) = (&options.shared_layers, q.storage().file_id()) {
        shared.forget(id);
    }
    if layer.virtual_size() != chain.virtual_size() {
        return Err(invalid(
            &base_path,
            format!(
                "the base is {} bytes, the disk {}: a live commit does not resize its base \
                 (commit offline, or resize the base first)",
                layer.virtual_size(),
                chain.virtual_size()
            ),
        ));
    }
    let from = LayerIndex(base.0 + 1);
    if has_short_layers(chain, from) {
        return Err(invalid(
            top,
            "a layer above the base is shorter than the disk: commit offline".into(),
        ));
    }
    // The served chain reads the base through a description that does not
    // share writing; it shares it now (giving a permission back needs no
    // probe), so that the only conflict the base's writer can find is
    // another process's.
    let served_base = chain.storage_of(base).clone();
    let served_lock = served_base.locks();
    if let Some(had) = served_lock {
        served_base
            .lock(relaxed(had), options.locking)
            .map_err(|k| Error::new(&base_path, k))?;
    }
    let restore = |e: Error| {
        put_lock_back(&served_base, served_lock, options.locking, &base_path);
        e
    };
    let target = Chain::open_expecting(
        &base_path,
        served_base.file_id(),
        &ChainOptions {
            writable: true,
            top_storage: None,
            // Its index (if any) covers the layers below it, which do not
            // change; as the top it is built in the background anyway.
            stale_index_expected: true,
            ..options.clone()
        },
    )
    .map_err(restore)?;
    if target.virtual_size() != chain.virtual_size() {
        drop(target);
        return Err(restore(invalid(
            &base_path,
            "the base changed size since the chain was opened".into(),
        )));
    }
    let target = Arc::new(target);
    let mode = if from == chain.top_index() && chain.active().is_ok() {
        Mode::Drain(Arc::new(Drain::new(target.clone())))
    } else {
        Mode::Mirror(Arc::new(Mirror::new(
            target.clone(),
            from,
            chain.virtual_size(),
        )))
    };
    Ok(LiveCommit {
        mode,
        started: Default::default(),
        target,
        base,
        replaced: chain.layers()[from.0..]
            .iter()
            .map(|l| l.path().to_path_buf())
            .collect(),
        base_path,
        top_id: chain.top().storage().file_id(),
        layers: chain.layers().len(),
        served_base,
        served_lock,
        locking: options.locking,
    })
}

impl LiveCommit {
    /// The base's position in the served chain.
    pub fn base(&self) -> LayerIndex {
        self.base
    }

    /// The base's file.
    pub fn base_path(&self) -> &Path {
        &self.base_path
    }

    /// The layers above the base, lowest first: out of the chain after
    /// the switch, left for the operator.
    pub fn replaced(&self) -> &[PathBuf] {
        &self.replaced
    }

    fn check_chain(&self, chain: &Chain) -> Result<(), Error> {
        if chain.top().storage().file_id() != self.top_id || chain.layers().len() != self.layers {
            return Err(Error::new(chain.top().path(), ErrorKind::FileReplaced));
        }
        Ok(())
    }

    /// The guest's changes of `chain` (the chain prepared on) reach the
    /// base from now on (drained or mirrored). Call with no request in
    /// flight (a pause).
    pub fn start(&self, chain: &Chain) -> Result<(), Error> {
        self.check_chain(chain)?;
        match &self.mode {
            Mode::Drain(d) => chain.start_drain(d.clone()),
            Mode::Mirror(m) => chain.start_mirror(m.clone()),
        }
        self.started
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Whether the served chain routes through a drain: once started, it
    /// stops only in a pause, followed by a reopen
    /// ([`LiveCommit::abandon`]).
    pub fn drain_started(&self) -> bool {
        self.drains() && self.started.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the top drains into the base (else changes are mirrored).
    pub fn drains(&self) -> bool {
        matches!(self.mode, Mode::Drain(_))
    }

    /// Why the commit cannot finish, if something failed.
    fn failure(&self) -> Option<String> {
        match &self.mode {
            Mode::Drain(d) => d.failure(),
            Mode::Mirror(m) => m.failure(),
        }
    }

    /// The background copy: every range of `chain`'s view that the layers
    /// above the base decide, written into the base (after
    /// [`LiveCommit::start`]); a drain also unmaps it from the top. `pace`
    /// is called after each chunk or batch.
    pub fn copy(&self, chain: &Chain, pace: Pace<'_>) -> Result<LiveCopied, Error> {
        self.check_chain(chain)?;
        match &self.mode {
            Mode::Drain(d) => self.drain(chain, d, pace),
            Mode::Mirror(m) => self.mirror_copy(chain, m, pace),
        }
    }

    fn cancelled(&self) -> Error {
        Error::new(
            &self.base_path,
            ErrorKind::Io(std::io::Error::new(
                std::io::ErrorKind::Interrupted,
                "cancelled",
            )),
        )
    }

    /// The top drained a batch at a time, in one pass (nothing becomes
    /// the top's again); a second pass finds nothing (checked).
    fn drain(
        &self,
        chain: &Chain,
        drain: &Arc<Drain>,
        pace: Pace<'_>,
    ) -> Result<LiveCopied, Error> {
        let size = chain.virtual_size();
        let batch = DRAIN_BATCH.max(chain.cluster_size());
        let mut buf = Vec::new();
        let mut copied = LiveCopied::default();
        for pass in 0..2 {
            let mut pos = 0;
            while pos < size {
                if let Some(why) = drain.failure() {
                    return Err(invalid(&self.base_path, why));
                }
                let end = (pos + batch).min(size);
                let d = drain.drain_range(chain, pos, end, &mut buf)?;
                if pass == 1 && d.data_bytes + d.zero_bytes > 0 {
                    return Err(invalid(
                        &self.base_path,
                        "the top still decided clusters after the drain (a bug)".into(),
                    ));
                }
                copied.data_bytes += d.data_bytes;
                copied.zero_bytes += d.zero_bytes;
                pos = end;
                if pass == 0 && !pace(pos, size, d.data_bytes + d.zero_bytes) {
                    return Err(self.cancelled());
                }
            }
        }
        Ok(copied)
    }

    fn mirror_copy(
        &self,
        chain: &Chain,
        mirror: &Mirror,
        pace: Pace<'_>,
    ) -> Result<LiveCopied, Error> {
        let size = chain.virtual_size();
        let cancelled = || self.cancelled();
        let mut buf = Vec::new();
        let mut copied = LiveCopied::default();
        let mut pos = 0;
        while pos < size {
            if let Some(why) = mirror.failure() {
                return Err(invalid(&self.base_path, why));
            }
            let n = CHUNK.min(size - pos);
            let c = mirror.copy_range(chain, pos, n, &mut buf)?;
            copied.data_bytes += c.data_bytes;
            copied.zero_bytes += c.zero_bytes;
            pos += n;
            if !pace(pos, size, c.data_bytes + c.zero_bytes) {
                return Err(cancelled());
            }
        }
        // What the guest changed meanwhile, pass after pass while that
        // shrinks fast; then the mirror goes synchronous and the rest
        // (marked, and fixed from then on) is copied once.
        let mut passes = 0;
        let mut before = u64::MAX;
        loop {
            let left = mirror.changed_bytes();
            let converging = left.saturating_mul(2) <= before;
            if left <= SYNCHRONOUS_BELOW || passes >= ASYNC_PASSES || !converging {
                tracing::info!(passes, left, "live commit: the mirror goes synchronous");
                break;
            }
            tracing::debug!(pass = passes + 1, left, "live commit: copying the changes");
            before = left;
            passes += 1;
            if !mirror.copy_changed(chain, CHUNK, &mut |w| pace(size, size, w))? {
                return Err(cancelled());
            }
        }
        mirror.go_synchronous();
        if !mirror.copy_changed(chain, CHUNK, &mut |w| pace(size, size, w))? {
            return Err(cancelled());
        }
        if let Some(why) = mirror.failure() {
            return Err(invalid(&self.base_path, why));
        }
        Ok(copied)
    }

    /// Bytes the guest's changes made the mirror write so far (a drain
    /// copies nothing for them).
    pub fn mirrored_bytes(&self) -> u64 {
        match &self.mode {
            Mode::Drain(_) => 0,
            Mode::Mirror(m) => m.written(),
        }
    }

    /// Guest bytes written into the base directly (a drain's clusters
    /// the top no longer decides).
    pub fn routed_bytes(&self) -> u64 {
        match &self.mode {
            Mode::Drain(d) => d.routed_bytes(),
            Mode::Mirror(_) => 0,
        }
    }

    /// Why the commit cannot finish, if something failed.
    pub fn mirror_failure(&self) -> Option<String> {
        self.failure()
    }

    /// Writes the base's changes so far back and syncs them (while the
    /// guest runs: the flush in the switch's pause then has little left).
    pub fn flush(&self) -> Result<(), Error> {
        match &self.mode {
            // Also what the top let go of: the switch's pause then syncs
            // nothing more.
            Mode::Drain(d) => d.sync_base(),
            Mode::Mirror(_) => self.target.flush(),
        }
    }

    /// The switch, with no request in flight, after [`LiveCommit::flush`]:
    /// mirroring stops, the base's latest mappings are published, and the
    /// chain to serve from now on (the base its top, recording into the
    /// bitmaps the top records into) is returned. On an error the commit
    /// is abandoned (the served chain is as before).
    pub fn finish(self, chain: &Chain) -> Result<Chain, Error> {
        let left = match &self.mode {
            Mode::Drain(_) => {
                // The copy left the top deciding nothing: served from the
                // base alone from now on (synced before the pause).
                chain.stop_drain()
            }
            Mode::Mirror(m) => {
                chain.stop_mirror();
                // Nothing is left once the copy has ended (the mirror
                // synchronous); copied here if something is, as a guard.
                m.copy_changed(chain, CHUNK, &mut |_| true).map(|_| ())
            }
        };
        let ready = left
            .and_then(|()| match self.failure() {
                Some(why) => Err(invalid(&self.base_path, why)),
                None => Ok(()),
            })
            // Flushed before the pause (every copy of the background
            // copy durable) and at each guest flush since: what the
            // guest wrote since then needs only its mappings published to
            // survive this process (as the top's do).
            .and_then(|()| self.target.durability().publish());
        if let Err(e) = ready {
            self.abandon(chain);
            return Err(e);
        }
        let LiveCommit {
            target,
            mode,
            base_path,
            served_base,
            served_lock,
            locking,
            ..
        } = self;
        drop(mode);
        // Another thread may still hold the drain, and the base with it:
        // the flusher's checkpoint publishing the base (the pause waits
        // for the guest's requests, not for it). It lets go once that
        // publish ends, which has little left after `flush`.
        wait_bounded(SWITCH_WAIT, std::time::Duration::from_micros(100), || {
            Arc::strong_count(&target) > 1
        });
        let base = Arc::try_unwrap(target).map_err(|target| {
            // Still referenced (a bug): not served; the base stays open
            // with it, and the served chain's lock is put back.
            drop(target);
            put_lock_back(&served_base, served_lock, locking, &base_path);
            invalid(&base_path, "the base is still in use (a bug)".into())
        })?;
        // The bitmaps the top records into record in the base from its
        // first request on (memory only; their bits are merged after
        // the pause: `PersistentBitmaps::take_in_from`).
        if let Err(e) = base.bitmaps().add_recording_of(chain) {
            tracing::warn!(error = %e, "live commit: the top's bitmaps do not record in the base");
        }
        Ok(base)
    }

    /// Stops the commit: no more mirroring or draining of `chain`, the
    /// base closed (what was written stays: the layers above hide it, or,
    /// drained, the top no longer decides it) and the served chain's lock
    /// on it put back (unless it changed meanwhile: an inactivation
    /// dropped it, and it stays dropped). After a drain, `chain` reads the
    /// base as it was: call with no request in flight, and serve a chain
    /// opened again from then on ([`LiveCommit::drains`]).
    pub fn abandon(self, chain: &Chain) {
        chain.stop_mirror();
        if let Err(e) = chain.stop_drain() {
            // The top's tables may now reach the disk before copies the
            // base could not sync (a failing base loses them anyway).
            tracing::warn!(error = %e, "live commit: the base could not be synced as the drain stopped");
        }
        let LiveCommit {
            target,
            mode,
            base_path,
            served_base,
            served_lock,
            locking,
            ..
        } = self;
        // A change that took the mirror (or the drain) before it stopped
        // goes on into the base: waited for (bounded), then the base is
        // closed.
        let busy = || match &mode {
            Mode::Drain(d) => Arc::strong_count(d) > 1,
            Mode::Mirror(m) => Arc::strong_count(m) > 1,
        };
        wait_bounded(
            std::time::Duration::from_secs(30),
            std::time::Duration::from_millis(1),
            busy,
        );
        drop(mode);
        match Arc::try_unwrap(target) {
            Ok(t) => {
                if let Err(e) = t.close() {
                    tracing::warn!(base = %base_path.display(), error = %e, "closing the base");
                }
            }
            Err(_) => tracing::warn!(base = %base_path.display(), "the base is still in use"),
        }
        put_lock_back(&served_base, served_lock, locking, &base_path);
    }
}

/// The lock the served chain's description of the base holds while the
/// base is written through another: as before, sharing writing.
fn relaxed(had: LockRequest) -> LockRequest {
    LockRequest {
        held: had.held,
        unshared: Perms::NONE,
    }
}

/// Puts the served chain's lock on the base back to `had`, if the
/// description still holds the relaxed one (compare and set: an
/// inactivation that dropped every lock meanwhile keeps them dropped).
fn put_lock_back(
    served_base: &Arc<dyn Storage>,
    had: Option<LockRequest>,
    locking: Locking,
    base_path: &Path,
) {
    let Some(had) = had else { return };
    if served_base.locks() != Some(relaxed(had)) {
        return;
    }
    if let Err(k) = served_base.lock(had, locking) {
        tracing::warn!(base = %base_path.display(), error = %k, "putting the base's lock back");
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    use super::*;
    use crate::create::{create, CreateOptions};
    use crate::types::GuestOffset;
    use crate::ExtentKind;

    const SIZE: u64 = 8 << 20;

    fn image(dir: &Path, name: &str, backing: Option<&str>) -> PathBuf {
        let path = dir.join(name);
        create(
            &path,
            &CreateOptions {
                size: SIZE,
                backing_file: backing.map(Into::into),
                backing_format: backing.map(|_| "qcow2".into()),
                ..CreateOptions::default()
            },
        )
        .unwrap();
        path
    }

    fn options(writable: bool) -> ChainOptions {
        ChainOptions {
            writable,
            locking: Locking::Off,
            use_index: false,
            ..ChainOptions::default()
        }
    }

    /// A xorshift generator (deterministic per seed).
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// A writable chain of `top.qcow2` over `base.qcow2` in `dir`, its
    /// first cluster written with `byte` in the top; the base's path.
    fn top_over_base(dir: &Path, byte: u8) -> (PathBuf, Chain) {
        let base = image(dir, "base.qcow2", None);
        let top = image(dir, "top.qcow2", Some("base.qcow2"));
        let chain = Chain::open(&top, &options(true)).unwrap();
        chain.write_at(&[byte; 65536], 0).unwrap();
        (base, chain)
    }

    fn read_all(chain: &Chain) -> Vec<u8> {
        let mut all = vec![0u8; SIZE as usize];
        chain.read_at(&mut all, 0).unwrap();
        all
    }

    /// The chain a commit's switch returns records, from its first
    /// request, into the bitmaps the old top recorded into: a write the
    /// base serves before the bits are taken in is in them after.
    #[test]
    fn the_served_base_records_into_the_tops_bitmaps_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let (base, chain) = top_over_base(dir.path(), 1);
        chain.bitmaps().add("t1", Some(4096), true).unwrap();
        chain.bitmaps().add("off", Some(4096), false).unwrap();
        chain.write_at(&[2; 4096], 1 << 20).unwrap();
        let commit =
            prepare_live_commit(&chain, Some(&LayerRef::Position(0)), &options(true)).unwrap();
        commit.start(&chain).unwrap();
        commit.copy(&chain, &mut |_, _, _| true).unwrap();
        commit.flush().unwrap();
        let served = commit.finish(&chain).unwrap();
        assert_eq!(served.top().path(), base.as_path());
        // The guest's first write after the switch, then the take-in.
        served.write_at(&[3; 4096], 3 << 20).unwrap();
        let skipped = served
            .bitmaps()
            .take_in_from(&chain, LayerIndex(1))
            .unwrap();
        assert!(skipped.is_empty(), "{skipped:?}");
        assert_eq!(
            served.bitmaps().dirty("t1").unwrap(),
            vec![(1 << 20)..(1 << 20) + 4096, (3 << 20)..(3 << 20) + 4096]
        );
        assert!(served.bitmaps().dirty("off").unwrap().is_empty());
        served.close().unwrap();
    }

    /// Guest writes, zeroes and discards racing the background copy (on
    /// the ranges it copies) of a commit of the layers above `layers[0]`
    /// (`mid` between: mirrored; else drained): the base, served as the
    /// top afterwards, reads exactly what the old chain read at the
    /// switch.
    fn commit_under_writes(mid: bool) {
        let dir = tempfile::tempdir().unwrap();
        let base = image(dir.path(), "base.qcow2", None);
        let mut files = vec![base.clone()];
        if mid {
            files.push(image(dir.path(), "mid.qcow2", Some("base.qcow2")));
        }
        let below = if mid { "mid.qcow2" } else { "base.qcow2" };
        let top = image(dir.path(), "top.qcow2", Some(below));
        files.push(top.clone());
        for (seed, path) in files.iter().enumerate() {
            let c = Chain::open(path, &options(true)).unwrap();
            let seed = seed as u64 + 1;
            let mut s = seed;
            for _ in 0..200 {
                let off = (next(&mut s) % (SIZE - 70_000)) & !511;
                let len = ((next(&mut s) % 70_000 + 1) as usize & !511) | 512;
                c.write_at(&vec![(seed as u8) ^ (off as u8); len], off)
                    .unwrap();
            }
            c.close().unwrap();
        }
        let chain = Chain::open(&top, &options(true)).unwrap();
        let commit =
            prepare_live_commit(&chain, Some(&LayerRef::Position(0)), &options(true)).unwrap();
        assert_eq!(commit.replaced().len(), files.len() - 1);
        assert_eq!(commit.drains(), !mid);
        if let Mode::Drain(d) = &commit.mode {
            // Guest writes into a batch between its copy and its
            // unmapping, if the batch's hold let them.
            *d.before_unmap.lock().unwrap() = Some(crate::chain::drain::TestHook(Box::new(|| {
                std::thread::sleep(std::time::Duration::from_millis(20))
            })));
        }
        commit.start(&chain).unwrap();
        let done = AtomicBool::new(false);
        let before = read_all(&chain);
        let stripe = SIZE / 4;
        let cs = chain.cluster_size();
        let expected = std::thread::scope(|s| {
            // Each writer owns a stripe and knows what it must read.
            let writers: Vec<_> = (0..4u64)
                .map(|t| {
                    let (chain, done) = (&chain, &done);
                    let mut model =
                        before[(t * stripe) as usize..((t + 1) * stripe) as usize].to_vec();
                    s.spawn(move || {
                        let mut st = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                        let mut ops = 0u64;
                        while !done.load(Ordering::Relaxed) {
                            ops += 1;
                            if ops % 32 == 0 {
                                // Released clusters become reusable.
                                chain.flush().unwrap();
                            }
                            let rel = (next(&mut st) % (stripe - 200_000)) & !511;
                            let len = ((next(&mut st) % 200_000) & !511) | 512;
                            let off = t * stripe + rel;
                            let span = rel as usize..(rel + len) as usize;
                            match next(&mut st) % 8 {
                                0 => {
                                    chain.write_zeroes(off, len, true).unwrap();
                                    model[span].fill(0);
                                }
                                1 => {
                                    chain.discard(off, len).unwrap();
                                    // Whole clusters read as zeros.
                                    let first = off.div_ceil(cs) * cs;
                                    let last = (off + len) / cs * cs;
                                    if first < last {
                                        let a = (first - t * stripe) as usize;
                                        let b = (last - t * stripe) as usize;
                                        model[a..b].fill(0);
                                    }
                                }
                                _ => {
                                    let byte = (st >> 8) as u8 | 1;
                                    chain.write_at(&vec![byte; len as usize], off).unwrap();
                                    model[span].fill(byte);
                                }
                            }
                        }
                        model
                    })
                })
                .collect();
            // Slowed, so that the guest changes ranges before, while and
            // after they are copied.
            let copied = commit
                .copy(&chain, &mut |_, _, _| {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    true
                })
                .unwrap();
            assert!(copied.data_bytes > 0);
            // The guest goes on: its changes reach the base now.
            std::thread::sleep(std::time::Duration::from_millis(30));
            done.store(true, Ordering::Relaxed);
            writers
                .into_iter()
                .flat_map(|w| w.join().unwrap())
                .collect::<Vec<u8>>()
        });
        match &commit.mode {
            Mode::Mirror(m) => {
                assert_eq!(
                    m.changed_bytes(),
                    0,
                    "changes after the copy were left for the switch"
                );
                assert!(
                    commit.mirrored_bytes() > 0,
                    "the guest's writes were mirrored"
                );
            }
            Mode::Drain(_) => {
                assert!(commit.routed_bytes() > 0, "no guest write went to the base");
                for c in (0..SIZE).step_by(chain.cluster_size() as usize) {
                    assert!(!chain.top_decides(GuestOffset(c)).unwrap(), "{c}");
                }
            }
        }
        let view = read_all(&chain);
        assert!(view == expected, "the chain lost a guest change");
        let served = commit.finish(&chain).unwrap();
        assert_eq!(served.top().path(), base.as_path());
        assert!(served.is_writable());
        assert!(read_all(&served) == view, "the base differs from the view");
        served.close().unwrap();
        drop(chain);
        // And once closed, as any reader opens it.
        let reopened = Chain::open(&base, &options(false)).unwrap();
        assert!(read_all(&reopened) == view, "the closed base differs");
        if !mid {
            // The old top, drained, over the base reads the same.
            let old = Chain::open(&top, &options(false)).unwrap();
            assert!(
                read_all(&old) == view,
                "the drained top over the base differs"
            );
        }
    }

    #[test]
    fn the_base_ends_equal_to_the_view_whatever_the_guest_writes() {
        commit_under_writes(true);
    }

    #[test]
    fn the_top_drains_into_the_base_whatever_the_guest_writes() {
        commit_under_writes(false);
    }

    /// A guest write into a cluster whose batch has been copied into the
    /// base and not yet unmapped from the top waits for the unmapping,
    /// then lands in the base: it is never left behind in the top.
    #[test]
    fn a_write_into_a_batch_being_drained_waits_then_lands_in_the_base() {
        let dir = tempfile::tempdir().unwrap();
        let (_, chain) = top_over_base(dir.path(), 0x11);
        let commit = prepare_live_commit(&chain, None, &options(true)).unwrap();
        let Mode::Drain(d) = &commit.mode else {
            panic!("not drained")
        };
        let (copied_tx, copied_rx) = std::sync::mpsc::channel::<()>();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let go_rx = Mutex::new(go_rx);
        *d.before_unmap.lock().unwrap() =
            Some(crate::chain::drain::TestHook(Box::new(move || {
                let _ = copied_tx.send(());
                let _ = go_rx.lock().unwrap().recv();
            })));
        commit.start(&chain).unwrap();
        let landed = AtomicBool::new(false);
        std::thread::scope(|s| {
            let copier = s.spawn(|| commit.copy(&chain, &mut |_, _, _| true).unwrap());
            copied_rx.recv().unwrap();
            let writer = s.spawn(|| {
                chain.write_at(&[0x22; 4096], 4096).unwrap();
                landed.store(true, Ordering::SeqCst);
            });
            // The copier stalls between the base's sync and the unmapping.
            std::thread::sleep(std::time::Duration::from_millis(200));
            let early = landed.load(Ordering::SeqCst);
            go_tx.send(()).unwrap();
            copier.join().unwrap();
            writer.join().unwrap();
            assert!(!early, "the write completed inside the drained batch");
        });
        let mut got = vec![0u8; 8192];
        chain.read_at(&mut got, 0).unwrap();
        assert_eq!(&got[..4096], &[0x11; 4096][..]);
        assert_eq!(&got[4096..], &[0x22; 4096][..], "the write was lost");
        assert!(!chain.top_decides(GuestOffset(0)).unwrap());
        let base = commit.finish(&chain).unwrap();
        let mut got = vec![0u8; 4096];
        base.read_at(&mut got, 4096).unwrap();
        assert_eq!(got, vec![0x22; 4096]);
    }

    /// A drained batch is mapped in the base's file before the top lets
    /// go of it (a death of this process loses neither), and the base is
    /// synced before the top's tables say so (a power loss never keeps
    /// the unmapping without the copy); the copier itself syncs nothing.
    #[test]
    fn the_base_is_synced_before_the_top_writes_an_unmapping() {
        let dir = tempfile::tempdir().unwrap();
        let (base, chain) = top_over_base(dir.path(), 0x11);
        let top = dir.path().join("top.qcow2");
        chain.flush().unwrap();
        let commit = prepare_live_commit(&chain, None, &options(true)).unwrap();
        let Mode::Drain(d) = &commit.mode else {
            panic!("not drained")
        };
        let d = d.clone();
        commit.start(&chain).unwrap();
        let first = |path: &std::path::Path| {
            let c = Chain::open(path, &options(false)).unwrap();
            let e = c.resolve(GuestOffset(0), 4096, false).unwrap();
            let mut got = vec![0u8; 4096];
            c.read_at(&mut got, 0).unwrap();
            (e.layer == c.top_index(), got[0])
        };
        commit.copy(&chain, &mut |_, _, _| true).unwrap();
        assert!(!chain.top_decides(GuestOffset(0)).unwrap());
        assert_eq!(d.base_syncs.load(Ordering::Relaxed), 0, "the copier synced");
        assert_eq!(
            first(&base),
            (true, 0x11),
            "the copy is not in the base's file"
        );
        assert!(first(&top).0, "the unmapping is in the top's file early");
        chain.durability().publish().unwrap();
        assert!(!first(&top).0, "the unmapping was not written");
        assert_eq!(
            d.base_syncs.load(Ordering::Relaxed),
            1,
            "the top's tables went out without a sync of the base first"
        );
        // Nothing unsynced since: the switch syncs nothing more.
        commit.flush().unwrap();
        let syncs = d.base_syncs.load(Ordering::Relaxed);
        chain.durability().publish().unwrap();
        assert_eq!(d.base_syncs.load(Ordering::Relaxed), syncs);
        drop(d);
        let served = commit.finish(&chain).unwrap();
        let mut got = vec![0u8; 4096];
        served.read_at(&mut got, 0).unwrap();
        assert_eq!(got, vec![0x11; 4096]);
    }

    /// The drain's copies land in the base's page cache a page per folio
    /// (the guest's 4 KiB writes into a cluster copied whole into one
    /// folio paid for the folio: 220k against 304k IOPS), also where the
    /// base's own data was cached in large folios, and writes go whole
    /// again once the drain has ended.
    #[test]
    fn a_drained_copy_is_cached_in_single_pages() {
        let dir = tempfile::tempdir().unwrap();
        let base = image(dir.path(), "base.qcow2", None);
        // The base's own data, cached as one large write leaves it, under
        // the first two clusters the top writes.
        let b = Chain::open(&base, &options(true)).unwrap();
        b.write_at(&[0x11; 2 << 16], 0).unwrap();
        b.flush().unwrap();
        drop(b);
        let top = image(dir.path(), "top.qcow2", Some("base.qcow2"));
        let chain = Chain::open(&top, &options(true)).unwrap();
        chain.write_at(&[0x22; 4 << 16], 0).unwrap();
        chain.flush().unwrap();
        let commit = prepare_live_commit(&chain, None, &options(true)).unwrap();
        assert!(commit.drains());
        commit.start(&chain).unwrap();
        commit.copy(&chain, &mut |_, _, _| true).unwrap();
        commit.flush().unwrap();
        let served = commit.finish(&chain).unwrap();
        drop(chain);
        // A cluster written whole after the drain: the usual folios.
        served.write_at(&[0x33; 1 << 16], 8 << 16).unwrap();
        served.flush().unwrap();
        let host = |guest: u64| match served
            .resolve(GuestOffset(guest), 1 << 16, false)
            .unwrap()
            .kind
        {
            ExtentKind::Data { host } => host.0,
            other => panic!("not data in the base: {other:?}"),
        };
        let (copied, later) = (host(0), host(8 << 16));
        let file = std::fs::File::open(&base).unwrap();
        let largest =
            |at: u64, len: u64| crate::folios::largest_folio_pages(&file, at, len).unwrap();
        let Some(after) = largest(later, 1 << 16) else {
            eprintln!("the kernel hides frame numbers (not root): nothing to compare");
            return;
        };
        if after == 1 {
            eprintln!("this kernel keeps a cluster written whole in single pages anyway");
        }
        for c in 0..4u64 {
            let at = host(c << 16);
            assert_eq!(
                largest(at, 1 << 16),
                Some(1),
                "the copy of cluster {c} is cached in folios of several pages (after the drain: {after})"
            );
        }
        assert_ne!(copied, later);
        let mut got = vec![0u8; 4 << 16];
        served.read_at(&mut got, 0).unwrap();
        assert!(got.iter().all(|&b| b == 0x22));
    }

    /// A switch while another thread still holds the drain (the
    /// flusher's checkpoint publishing the base, which the guest's pause
    /// does not wait for) waits for it rather than fail the commit ("the
    /// base is still in use").
    #[test]
    fn the_switch_waits_for_a_publish_that_holds_the_drain() {
        let dir = tempfile::tempdir().unwrap();
        let (_, chain) = top_over_base(dir.path(), 0x44);
        let commit = prepare_live_commit(&chain, None, &options(true)).unwrap();
        commit.start(&chain).unwrap();
        commit.copy(&chain, &mut |_, _, _| true).unwrap();
        commit.flush().unwrap();
        let held = chain.drain().expect("draining");
        let publisher = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            held.target.durability().publish().unwrap();
        });
        let served = commit.finish(&chain).unwrap();
        publisher.join().unwrap();
        let mut got = vec![0u8; 4096];
        served.read_at(&mut got, 0).unwrap();
        assert_eq!(got, vec![0x44; 4096]);
    }

    /// A live commit is refused for the top itself, a raw or smaller base,
    /// and a read-only chain; nothing is left mirrored.
    #[test]
    fn refusals() {
        let dir = tempfile::tempdir().unwrap();
        image(dir.path(), "base.qcow2", None);
        let top = image(dir.path(), "top.qcow2", Some("base.qcow2"));
        let ro = Chain::open(&top, &options(false)).unwrap();
        assert!(prepare_live_commit(&ro, None, &options(true)).is_err());
        drop(ro);
        let chain = Chain::open(&top, &options(true)).unwrap();
        let e = prepare_live_commit(&chain, Some(&LayerRef::Position(1)), &options(true));
        assert!(e.unwrap_err().to_string().contains("top itself"));
        let ok = prepare_live_commit(&chain, None, &options(true)).unwrap();
        assert!(ok.drains());
        ok.start(&chain).unwrap();
        assert!(chain.drain().is_some());
        ok.abandon(&chain);
        assert!(chain.drain().is_none() && !chain.mirroring());
    }
}
