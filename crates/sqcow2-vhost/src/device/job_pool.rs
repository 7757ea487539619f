//! The threads that run a [`JobQueue`]'s jobs: a base set, and more while
//! the queue stalls. When jobs wait and every thread has been busy for
//! [`STALL`] without one finishing (their disk's storage hangs, or their
//! chain is being switched), a watchdog starts one more thread, up to
//! [`MAX_EXTRA`]; an extra thread ends after [`EXTRA_IDLE`] without a
//! job. So the jobs of a disk whose storage hangs hold threads of their
//! own, and the other disks' jobs still run (as io_uring's workers and
//! QEMU's thread pool grow for blocking work).

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::debug;

use crate::device::job_queue::{JobQueue, Owned};

/// How long every thread must be busy with jobs waiting before another
/// starts: far above a job's time (~0.1-10 ms), far below a guest's
/// request timeout.
pub(crate) const STALL: Duration = Duration::from_millis(200);

/// How often the watchdog looks.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// Most threads started beyond the base set (QEMU's thread pool has 64).
pub(crate) const MAX_EXTRA: usize = 64;

/// How long an extra thread waits for a job before it ends.
const EXTRA_IDLE: Duration = Duration::from_secs(10);

/// Base threads and the watchdog over a queue.
pub(crate) struct JobPool<T: Owned + Send + 'static> {
    queue: Arc<JobQueue<T>>,
    threads: Vec<JoinHandle<()>>,
    watchdog: Option<JoinHandle<()>>,
    extra: Arc<Extra>,
}

/// The extra threads: how many run, and their handles to join.
#[derive(Default)]
struct Extra {
    running: AtomicUsize,
    handles: Mutex<Vec<JoinHandle<()>>>,
}

impl<T: Owned + Send + 'static> std::fmt::Debug for JobPool<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobPool")
            .field("threads", &self.threads.len())
            .field("extra", &self.extra.running.load(Ordering::Relaxed))
            .finish()
    }
}

impl<T: Owned + Send + 'static> JobPool<T> {
    /// Starts `threads` threads (at least one) named `NAME-N` running
    /// `run` on each job of `queue`, and the watchdog.
    pub(crate) fn start(
        name: &'static str,
        threads: usize,
        queue: Arc<JobQueue<T>>,
        run: fn(T),
    ) -> io::Result<Self> {
        let mut pool = JobPool {
            queue: queue.clone(),
            threads: Vec::new(),
            watchdog: None,
            extra: Arc::new(Extra::default()),
        };
        for i in 0..threads.max(1) {
            let q = queue.clone();
            // On failure, `pool`'s drop ends the threads started.
            pool.threads.push(
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || {
                        while let Some((job, running)) = q.take() {
                            run(job);
                            drop(running);
                        }
                    })?,
            );
        }
        let (q, extra) = (queue, pool.extra.clone());
        pool.watchdog = Some(
            std::thread::Builder::new()
                .name(format!("{name}-watch"))
                .spawn(move || watch(name, &q, &extra, run))?,
        );
        Ok(pool)
    }

    /// Queues `job` for the threads; `Err(job)` once the pool ends.
    pub(crate) fn push(&self, job: T) -> Result<(), T> {
        self.queue.push(job)
    }

    /// Extra threads running now.
    #[cfg(test)]
    pub(crate) fn extra_threads(&self) -> usize {
        self.extra.running.load(Ordering::SeqCst)
    }
}

/// The watchdog: one more thread each time the queue is found stalled.
fn watch<T: Owned + Send + 'static>(
    name: &'static str,
    queue: &Arc<JobQueue<T>>,
    extra: &Arc<Extra>,
    run: fn(T),
) {
    while !queue.is_closed() {
        std::thread::park_timeout(WATCH_EVERY);
        if !queue.stalled(STALL) || extra.running.load(Ordering::SeqCst) >= MAX_EXTRA {
            continue;
        }
        let (q, e) = (queue.clone(), extra.clone());
        extra.running.fetch_add(1, Ordering::SeqCst);
        let started = std::thread::Builder::new()
            .name(format!("{name}-extra"))
            .spawn(move || {
                while let Some((job, running)) = q.take_within(Some(EXTRA_IDLE)) {
                    run(job);
                    drop(running);
                }
                e.running.fetch_sub(1, Ordering::SeqCst);
            });
        let mut handles = extra.handles.lock().unwrap_or_else(PoisonError::into_inner);
        handles.retain(|h| !h.is_finished());
        match started {
            Ok(h) => {
                crate::limited_warn!(
                    extra = extra.running.load(Ordering::SeqCst),
                    "every {name} thread busy for {STALL:?} with jobs waiting \
                     (a disk's storage slow or hung?): started one more"
                );
                handles.push(h);
            }
            Err(e) => {
                extra.running.fetch_sub(1, Ordering::SeqCst);
                debug!("starting an extra {name} thread: {e}");
            }
        }
    }
}

impl<T: Owned + Send + 'static> Drop for JobPool<T> {
    fn drop(&mut self) {
        // The threads take what is queued, then end.
        self.queue.close();
        if let Some(w) = self.watchdog.take() {
            w.thread().unpark();
            let _ = w.join();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let extra = std::mem::take(
            &mut *self
                .extra
                .handles
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for t in extra {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{channel, Receiver, Sender};

    use super::*;

    /// A job of an owner: blocks until its gate says, then reports.
    #[derive(Debug)]
    struct Job {
        owner: usize,
        /// Told when the job runs.
        started: Option<Sender<()>>,
        gate: Option<Receiver<()>>,
        done: Sender<usize>,
    }

    impl Owned for Job {
        fn owner(&self) -> usize {
            self.owner
        }
    }

    fn run(job: Job) {
        if let Some(started) = job.started {
            let _ = started.send(());
        }
        if let Some(gate) = job.gate {
            let _ = gate.recv();
        }
        let _ = job.done.send(job.owner);
    }

    /// One disk's jobs hang (its storage stopped answering) on every base
    /// thread: another disk's job still runs, on a thread started for it,
    /// and the hung ones finish once their storage answers.
    #[test]
    fn a_hung_owner_does_not_hold_up_another() {
        let queue = Arc::new(JobQueue::new());
        let pool = JobPool::start("test-engine", 2, queue.clone(), run).unwrap();
        let (done, finished) = channel();
        let (started, running) = channel();
        let mut gates = Vec::new();
        for i in 0..4 {
            let (open, gate) = channel();
            gates.push(open);
            queue
                .push(Job {
                    owner: 1,
                    started: Some(started.clone()),
                    gate: Some(gate),
                    done: done.clone(),
                })
                .unwrap();
            if i == 1 {
                // Both base threads hang on one.
                for _ in 0..2 {
                    running.recv_timeout(Duration::from_secs(30)).unwrap();
                }
            }
        }
        queue
            .push(Job {
                owner: 2,
                started: None,
                gate: None,
                done: done.clone(),
            })
            .unwrap();
        assert_eq!(
            finished.recv_timeout(Duration::from_secs(30)),
            Ok(2),
            "the other owner's job waited for the hung ones"
        );
        assert!(pool.extra_threads() >= 1);
        for g in gates {
            g.send(()).unwrap();
        }
        for _ in 0..4 {
            assert_eq!(finished.recv_timeout(Duration::from_secs(30)), Ok(1));
        }
        drop(pool);
    }
}
