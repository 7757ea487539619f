//! The daemon's queue-worker threads, one set for every export: each
//! frontend session attaches its queue groups ([`BlkBackend`]'s workers)
//! to the least loaded thread ([`WorkerPool::attach`]), which waits on
//! their kick eventfds, io_uring completions and engine results in one
//! epoll and busy-polls their rings together; the session's end detaches
//! them ([`Attachment::stop`]) and waits until no thread holds them.
//!
//! Threads start as groups are attached, up to the pool's size, and stay
//! until the pool ends: a daemon serving one disk of one queue runs one.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::device::backend::{AfterPoll, BlkBackend, WaitingFor, Wake};
use crate::device::polling::{PollWindow, Polling};

/// How long a thread sleeps when a ring could not be told to notify.
const BRIEF_SLEEP_MS: i32 = 10;

/// Most threads a pool may have.
pub const MAX_WORKER_THREADS: usize = 256;

/// An epoll event's data: the slot of the attached group in the thread's
/// table (high 32 bits) and what became readable (low 32 bits).
mod event {
    /// A queue's kick eventfd: the queue's number (< 64).
    pub(super) const COMPLETION: u32 = u32::MAX - 1;
    pub(super) const MAILBOX: u32 = u32::MAX - 2;
    /// The thread's own control eventfd (a change of its groups, or the
    /// pool's end).
    pub(super) const CONTROL: u64 = u64::MAX;

    pub(super) fn data(slot: u32, kind: u32) -> u64 {
        (u64::from(slot) << 32) | u64::from(kind)
    }

    pub(super) fn slot_and_kind(data: u64) -> (usize, u32) {
        ((data >> 32) as usize, data as u32)
    }
}

/// One queue group of a session, as a thread holds it.
#[derive(Debug, Clone)]
struct Unit {
    backend: Arc<BlkBackend>,
    group: usize,
}

/// A slot of a thread's table (its number is in the epoll events of the
/// group there).
#[derive(Debug, Clone, Default)]
enum Slot {
    #[default]
    Free,
    /// A group the thread serves.
    Serving(Unit),
    /// A group being detached: free once the thread has let it go (a
    /// group attached there sooner could have its events taken for the
    /// old one's by a thread still holding the old table).
    Leaving,
}

/// A thread's groups: what attach and detach change, and the thread
/// copies when `generation` moves.
#[derive(Debug, Default)]
struct Table {
    slots: Vec<Slot>,
}

impl Table {
    fn serving(&self) -> impl Iterator<Item = &Unit> {
        self.slots.iter().filter_map(|s| match s {
            Slot::Serving(u) => Some(u),
            _ => None,
        })
    }

    fn load(&self) -> usize {
        self.serving().count()
    }

    fn holds(&self, backend: &Arc<BlkBackend>) -> bool {
        self.serving().any(|u| Arc::ptr_eq(&u.backend, backend))
    }

    /// What the thread works with: the group of each slot it serves.
    fn units(&self) -> Vec<Option<Unit>> {
        self.slots
            .iter()
            .map(|s| match s {
                Slot::Serving(u) => Some(u.clone()),
                _ => None,
            })
            .collect()
    }
}

/// A pool thread and what attach and detach share with it.
#[derive(Debug)]
struct PoolThread {
    index: usize,
    epoll: Epoll,
    /// Written on a change of `table` and at the pool's end.
    control: EventFd,
    table: Mutex<Table>,
    /// Bumped on every change of `table`.
    generation: AtomicU64,
    /// The generation the thread works with: it holds no group removed
    /// before it. `u64::MAX` once the thread has ended.
    acked: Mutex<u64>,
    acked_changed: Condvar,
    stopping: AtomicBool,
}

impl PoolThread {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn acked(&self) -> MutexGuard<'_, u64> {
        self.acked.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells the thread to look at its table (or at `stopping`).
    fn poke(&self) {
        if let Err(e) = self.control.write(1) {
            crate::limited_warn!("waking a worker thread: {e}");
        }
    }

    /// Changes the table and bumps the generation; the generation the
    /// change is in.
    fn change(&self, f: impl FnOnce(&mut Table)) -> u64 {
        let mut table = self.table();
        f(&mut table);
        // Under the table's lock: a thread that copies the table sees the
        // generation it copied.
        self.generation.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Waits until the thread works with generation `g` or a later one.
    fn wait_acked(&self, g: u64) {
        let mut acked = self.acked();
        let mut since = Instant::now();
        while *acked < g {
            let (next, timeout) = self
                .acked_changed
                .wait_timeout(acked, Duration::from_secs(1))
                .unwrap_or_else(PoisonError::into_inner);
            acked = next;
            if timeout.timed_out() && since.elapsed() >= Duration::from_secs(5) {
                warn!(
                    thread = self.index,
                    "a worker thread is slow to let a queue go"
                );
                since = Instant::now();
            }
        }
    }

    fn ack(&self, g: u64) {
        *self.acked() = g;
        self.acked_changed.notify_all();
    }
}

/// A started thread: what it shares, and its handle until it is joined.
type Started = (Arc<PoolThread>, Option<JoinHandle<()>>);

/// The queue-worker threads of a daemon.
#[derive(Debug)]
pub(crate) struct WorkerPool {
    polling: Polling,
    max_threads: usize,
    threads: Mutex<Vec<Started>>,
}

impl WorkerPool {
    /// A pool of at most `max_threads` threads (started as groups come),
    /// each busy-polling its rings after its last piece of work as
    /// `polling` says.
    pub(crate) fn new(max_threads: usize, polling: Polling) -> Arc<Self> {
        Arc::new(WorkerPool {
            polling,
            max_threads: max_threads.clamp(1, MAX_WORKER_THREADS),
            threads: Mutex::new(Vec::new()),
        })
    }

    fn threads(&self) -> MutexGuard<'_, Vec<Started>> {
        self.threads.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Threads started so far.
    #[cfg(test)]
    fn started(&self) -> usize {
        self.threads().len()
    }

    /// Attaches every queue group of `backend` to a thread: a new one
    /// while the pool has room and every thread has groups, else the one
    /// with the fewest groups, preferring threads that hold none of
    /// `backend`'s (its queues then run in parallel).
    pub(crate) fn attach(self: &Arc<Self>, backend: &Arc<BlkBackend>) -> io::Result<Attachment> {
        let mut attachment = Attachment {
            backend: backend.clone(),
            places: Vec::new(),
        };
        let mut threads = self.threads();
        for group in 0..backend.groups() {
            let busy = threads.iter().all(|(t, _)| t.table().load() > 0);
            if threads.len() < self.max_threads && (threads.is_empty() || busy) {
                let index = threads.len();
                threads.push(self.spawn(index)?);
            }
            let Some(thread) = threads
                .iter()
                .map(|(t, _)| t)
                .min_by_key(|t| {
                    let table = t.table();
                    (table.holds(backend), table.load())
                })
                .cloned()
            else {
                return Err(io::Error::other("no worker thread"));
            };
            // Dropped on error: what was attached is detached.
            let place = Place::attach(thread, backend, group)?;
            attachment.places.push(place);
        }
        debug!(
            groups = attachment.places.len(),
            threads = ?attachment.places.iter().map(|p| p.thread.index).collect::<Vec<_>>(),
            "queues attached to worker threads"
        );
        Ok(attachment)
    }

    fn spawn(&self, index: usize) -> io::Result<Started> {
        let thread = Arc::new(PoolThread {
            index,
            epoll: Epoll::new()?,
            control: EventFd::new(EFD_NONBLOCK)?,
            table: Mutex::new(Table::default()),
            generation: AtomicU64::new(0),
            acked: Mutex::new(0),
            acked_changed: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        thread.epoll.ctl(
            ControlOperation::Add,
            thread.control.as_raw_fd(),
            EpollEvent::new(EventSet::IN, event::CONTROL),
        )?;
        let (t, polling) = (thread.clone(), self.polling);
        let handle = std::thread::Builder::new()
            .name(format!("queue-worker-{index}"))
            .spawn(move || {
                // Whatever way the loop ends, no detach waits for it.
                let _ended = Ended(&t);
                run(&t, polling);
            })?;
        Ok((thread, Some(handle)))
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        let mut threads = self.threads();
        for (t, _) in threads.iter() {
            t.stopping.store(true, Ordering::Relaxed);
            t.poke();
        }
        for (_, h) in threads.iter_mut() {
            if let Some(h) = h.take() {
                let _ = h.join();
            }
        }
    }
}

/// Marks a thread ended when its loop returns (or unwinds).
struct Ended<'a>(&'a PoolThread);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        self.0.ack(u64::MAX);
    }
}

/// Where one queue group is attached: its thread and its slot there.
#[derive(Debug)]
struct Place {
    thread: Arc<PoolThread>,
    slot: u32,
    backend: Arc<BlkBackend>,
    group: usize,
}

impl Place {
    /// Puts `group` of `backend` in a free slot of `thread` and watches
    /// its completion and mailbox eventfds.
    fn attach(
        thread: Arc<PoolThread>,
        backend: &Arc<BlkBackend>,
        group: usize,
    ) -> io::Result<Self> {
        let unit = Unit {
            backend: backend.clone(),
            group,
        };
        let mut slot = 0;
        thread.change(|table| {
            let free = table.slots.iter().position(|s| matches!(s, Slot::Free));
            slot = match free {
                Some(free) => {
                    table.slots[free] = Slot::Serving(unit);
                    free
                }
                None => {
                    table.slots.push(Slot::Serving(unit));
                    table.slots.len() - 1
                }
            };
        });
        // Dropped on a failure below: detached again.
        let place = Place {
            thread,
            // A table holds at most the groups of every export's queues
            // (exports x 64), far below 2^32.
            slot: slot as u32,
            backend: backend.clone(),
            group,
        };
        let (completion, mailbox) = backend.group_fds(group);
        for (fd, kind) in [(completion, event::COMPLETION), (mailbox, event::MAILBOX)] {
            place.watch(fd, kind)?;
        }
        place.thread.poke();
        Ok(place)
    }

    fn watch(&self, fd: RawFd, kind: u32) -> io::Result<()> {
        let ev = EpollEvent::new(EventSet::IN, event::data(self.slot, kind));
        match self.thread.epoll.ctl(ControlOperation::Add, fd, ev) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            other => other,
        }
    }

    fn unwatch(&self, fd: RawFd) {
        let _ = self
            .thread
            .epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default());
    }
}

impl Drop for Place {
    /// Detaches the group: its eventfds are no longer watched (the kicks
    /// its rings hold now: the frontend unwatches a kick before it
    /// replaces it, so no other is watched), then the thread drops it
    /// from its table, and this waits until it has, so that nothing runs
    /// the group's worker afterwards.
    fn drop(&mut self) {
        let (completion, mailbox) = self.backend.group_fds(self.group);
        for fd in [completion, mailbox]
            .into_iter()
            .chain(self.backend.group_kicks(self.group))
        {
            self.unwatch(fd);
        }
        let slot = self.slot as usize;
        let g = self.thread.change(|table| {
            if let Some(s) = table.slots.get_mut(slot) {
                *s = Slot::Leaving;
            }
        });
        self.thread.poke();
        self.thread.wait_acked(g);
        // The thread's table no longer has it: the slot may be reused (no
        // new generation: the thread's copy has it empty already).
        if let Some(s) = self.thread.table().slots.get_mut(slot) {
            *s = Slot::Free;
        }
    }
}

/// A session's queue groups, each attached to a pool thread until
/// [`Attachment::stop`] (or the drop).
#[derive(Debug)]
pub(crate) struct Attachment {
    backend: Arc<BlkBackend>,
    places: Vec<Place>,
}

impl Attachment {
    /// Wakes the thread of `queue` on `fd` (its kick eventfd).
    pub(crate) fn watch_kick(&self, queue: usize, fd: RawFd) -> io::Result<()> {
        match self.place_of(queue) {
            Some(p) => p.watch(fd, queue as u32),
            None => Ok(()),
        }
    }

    /// Stops waking the thread of `queue` on `fd`.
    pub(crate) fn unwatch_kick(&self, queue: usize, fd: RawFd) {
        if let Some(p) = self.place_of(queue) {
            p.unwatch(fd);
        }
    }

    fn place_of(&self, queue: usize) -> Option<&Place> {
        let group = self.backend.group_of(queue)?;
        self.places.iter().find(|p| p.group == group)
    }

    /// The pool thread of each queue group, in group order.
    pub(crate) fn threads(&self) -> Vec<usize> {
        self.places.iter().map(|p| p.thread.index).collect()
    }

    /// Detaches every group; returns once no thread holds one.
    pub(crate) fn stop(&mut self) {
        self.places.clear();
    }
}

/// A thread's loop: it handles the events of its groups' eventfds and,
/// while its poll window ([`PollWindow`]) is open, busy-polls all their
/// rings (guest notifications off) until nothing has happened for that
/// long, then sleeps in epoll.
fn run(thread: &PoolThread, polling: Polling) {
    let mut events = vec![EpollEvent::default(); 64];
    let mut units: Vec<Option<Unit>> = Vec::new();
    let mut seen = u64::MAX;
    // One window per kind of wait, as QEMU adapts one per event source
    // since 9.2: waiting for the device (requests in flight) and waiting
    // for the guest (none). One window for both is reset by every device
    // wait longer than the most (a read of an uncached file, cache=none)
    // and then misses the guest's next request, which comes sooner: the
    // thread sleeps and a kick must wake it (measured, 4 KiB reads of an
    // uncached file with --cache none at depth 1, A/B on one file: client
    // on the other CPU 9.2k / 8.7k -> 13.8k / 11.9k IOPS, unpinned 11.7k
    // -> 18.4k / 17.9k; depth 32 unchanged).
    // And a third for waits for engine jobs alone (an allocating write at
    // low depth, ~100 µs with cache=none), up to 8x longer: with QEMU's
    // 32 µs the thread slept through each and the engine's answer had to
    // wake it (measured, random 4 KiB writes at depth 1 on a fresh top,
    // --cache none, 6 interleaved rounds: 8.4-9.9k -> 11.9-13.1k IOPS,
    // at ~1.5x the daemon's CPU per write).
    // With several groups on the thread: the device's window while any
    // waits for the device, else the engine's while any waits for jobs.
    let mut device_wait = PollWindow::new(polling);
    let mut guest_wait = PollWindow::new(polling);
    let mut engine_wait = PollWindow::new(polling.for_engine_waits());
    // A poll that ended in a brief sleep must end in `stop_polling` again
    // (a queue's notifications may still be off), whatever the window
    // has become meanwhile.
    let mut retry_stop = false;
    let all = |units: &[Option<Unit>], f: &mut dyn FnMut(&Unit)| {
        for u in units.iter().flatten() {
            f(u);
        }
    };
    loop {
        if thread.stopping.load(Ordering::Relaxed) {
            return;
        }
        let generation = thread.generation.load(Ordering::Acquire);
        if generation != seen {
            // The generation read under the table's lock is the one
            // copied (changes bump it under the lock); the old table's
            // groups are let go before the ack, outside the lock.
            let table = thread.table();
            let copied = table.units();
            seen = thread.generation.load(Ordering::Acquire);
            drop(table);
            drop(std::mem::replace(&mut units, copied));
            thread.ack(seen);
        }
        let changed = || {
            thread.stopping.load(Ordering::Relaxed)
                || thread.generation.load(Ordering::Relaxed) != seen
        };
        let mut timeout = -1;
        let mut waiting = WaitingFor::Guest;
        all(&units, &mut |u| {
            waiting = match (waiting, u.backend.waiting_for(u.group)) {
                (WaitingFor::Device, _) | (_, WaitingFor::Device) => WaitingFor::Device,
                (WaitingFor::Jobs, _) | (_, WaitingFor::Jobs) => WaitingFor::Jobs,
                _ => WaitingFor::Guest,
            }
        });
        let window = match waiting {
            WaitingFor::Jobs => &mut engine_wait,
            WaitingFor::Device => &mut device_wait,
            WaitingFor::Guest => &mut guest_wait,
        };
        // When the thread last had work: the poll time is spent from here.
        let mut idle_since = Instant::now();
        let poll = if retry_stop {
            window.current().max(Duration::from_micros(1))
        } else {
            window.current()
        };
        let poll_all = |units: &[Option<Unit>]| {
            let mut moved = false;
            all(units, &mut |u| moved |= u.backend.poll(u.group));
            moved
        };
        if !poll.is_zero() && !units.is_empty() {
            loop {
                idle_since = Instant::now();
                while idle_since.elapsed() < poll && !changed() {
                    if poll_all(&units) {
                        idle_since = Instant::now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                let mut after = AfterPoll::Sleep;
                all(&units, &mut |u| {
                    after = after.or(u.backend.stop_polling(u.group));
                });
                match after {
                    // Not `changed()`: requests taken now would otherwise
                    // wait for a kick the guest does not send again.
                    AfterPoll::PollAgain if !thread.stopping.load(Ordering::Relaxed) => {
                        // Requests arrived as notifications came back on:
                        // take them and poll on. If none can be taken (an
                        // available index the ring cannot hold), look again
                        // soon rather than spin on it.
                        if poll_all(&units) {
                            continue;
                        }
                        timeout = BRIEF_SLEEP_MS;
                    }
                    AfterPoll::SleepBriefly => timeout = BRIEF_SLEEP_MS,
                    _ => {}
                }
                break;
            }
        }
        let mut left = false;
        all(&units, &mut |u| left |= u.backend.submit_left(u.group));
        if left {
            // No completion may come to wake it: try again soon.
            timeout = BRIEF_SLEEP_MS;
        }
        retry_stop = timeout == BRIEF_SLEEP_MS;
        let mut pending = false;
        let mut parked: Option<Instant> = None;
        all(&units, &mut |u| {
            pending |= u.backend.has_pending(u.group);
            if let Some(until) = u.backend.parked_until(u.group) {
                parked = Some(parked.map_or(until, |p| p.min(until)));
            }
        });
        if pending || changed() {
            // Requests left at the batch size: events first, then them.
            timeout = 0;
        }
        if let Some(until) = parked {
            // A request waits for the limits: look again when they may
            // let it start (epoll's milliseconds, rounded up; the buckets
            // count the time, not the wake-ups).
            let ms = until
                .saturating_duration_since(Instant::now())
                .as_micros()
                .div_ceil(1000)
                .min(i32::MAX as u128) as i32;
            timeout = if timeout < 0 { ms } else { timeout.min(ms) };
        }
        let n = match thread.epoll.wait(timeout, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Never seen; the thread's groups have no other thread to
                // go to, so it looks again rather than end.
                crate::limited_warn!(thread = thread.index, "epoll: {e}");
                std::thread::sleep(Duration::from_millis(BRIEF_SLEEP_MS as u64));
                continue;
            }
        };
        let work = events[..n].iter().any(|ev| ev.data() != event::CONTROL);
        if timeout != 0 && work {
            // It slept (or polled) until work came: adapt the window (not
            // to another session's attach or detach).
            window.observe(idle_since.elapsed());
        }
        for ev in &events[..n] {
            if ev.data() == event::CONTROL {
                // Cleared; the table and `stopping` are looked at above.
                let _ = thread.control.read();
                continue;
            }
            let (slot, kind) = event::slot_and_kind(ev.data());
            // A group attached after the table was copied: its events
            // stay (level-triggered) until the next round copies it.
            let Some(Some(u)) = units.get(slot) else {
                continue;
            };
            let wake = match kind {
                event::COMPLETION => Wake::Completion,
                event::MAILBOX => Wake::Mailbox,
                queue => Wake::Kick(queue as usize),
            };
            u.backend.handle(u.group, wake);
        }
        all(&units, &mut |u| {
            u.backend.start_parked(u.group);
            u.backend.continue_pending(u.group);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::blk::{BlkDevice, DeviceOptions};
    use crate::device::handle::ChainHandle;

    fn backend(dir: &std::path::Path, name: &str, queues: u16) -> Arc<BlkBackend> {
        let chain = crate::device::test_support::small_chain(dir, name);
        let device = BlkDevice::new(
            Arc::new(ChainHandle::new(chain)),
            DeviceOptions::new(queues, 16),
        )
        .unwrap();
        Arc::new(BlkBackend::new(Arc::new(device), 1).unwrap())
    }

    /// Many sessions' queues on a pool of two threads: no more threads
    /// than that, each session's queues spread over both, and a detach
    /// returns only once the thread has let the group go (nothing runs
    /// its worker after the session's end).
    #[test]
    fn groups_share_the_threads_and_detach_waits_for_them() {
        let dir = tempfile::tempdir().unwrap();
        let pool = WorkerPool::new(2, Polling::Off);
        let backends: Vec<_> = (0..5)
            .map(|i| backend(dir.path(), &format!("d{i}.qcow2"), 2))
            .collect();
        let mut attached: Vec<_> = backends.iter().map(|b| pool.attach(b).unwrap()).collect();
        assert_eq!(pool.started(), 2, "threads beyond the pool's size");
        for a in &attached {
            let mut threads = a.threads();
            threads.sort_unstable();
            assert_eq!(threads, [0, 1], "a session's two queues on one thread");
        }
        for (a, b) in attached.iter_mut().zip(&backends) {
            a.stop();
            // The attachment's and the test's own: no thread holds one.
            assert_eq!(Arc::strong_count(b), 2, "a thread still holds the group");
        }
    }

    /// One session of one queue starts one thread, whatever the pool's
    /// size.
    #[test]
    fn threads_start_as_groups_come() {
        let dir = tempfile::tempdir().unwrap();
        let pool = WorkerPool::new(8, Polling::Off);
        let a = backend(dir.path(), "a.qcow2", 1);
        let attached = pool.attach(&a).unwrap();
        assert_eq!(pool.started(), 1);
        drop(attached);
        // The thread stays, and takes the next session.
        let b = backend(dir.path(), "b.qcow2", 1);
        let _b = pool.attach(&b).unwrap();
        assert_eq!(pool.started(), 1);
    }
}
