//! The threads running engine jobs that have begun on a chain: what a
//! live snapshot's drain waits for. The drain samples them (what they did:
//! ran, waited for a CPU, slept) and, once it has waited a little, raises
//! them to real-time scheduling until each job ends ([`JobThreads::raise`]):
//! on a host with few CPUs one such job waited 9.9 ms for a CPU in a
//! 10.5 ms drain. A thread is raised and lowered by its kernel thread id,
//! which names no memory: a thread that has ended makes the call fail.

use std::marker::PhantomData;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::realtime::{self, current_tid};

/// The registry: one entry per thread running begun work.
#[derive(Debug, Default)]
pub(crate) struct JobThreads {
    threads: Mutex<Vec<JobThread>>,
}

#[derive(Debug)]
struct JobThread {
    tid: libc::pid_t,
    /// Pieces of begun work it runs (one, for an engine thread).
    works: usize,
    /// Raised by a drain: lowered when its last work ends or when the
    /// drain's [`RaisedJobThreads`] goes, whichever comes first.
    raised: bool,
}

/// The calling thread's entry, left on the same thread (not `Send`).
#[must_use = "the thread stays registered until it leaves"]
#[derive(Debug)]
pub(crate) struct OnJobThread {
    tid: libc::pid_t,
    _not_send: PhantomData<*const ()>,
}

impl JobThreads {
    /// Registers the calling thread as running one more piece of work.
    pub(crate) fn enter(&self) -> OnJobThread {
        let tid = current_tid();
        let mut threads = self.lock();
        match threads.iter_mut().find(|t| t.tid == tid) {
            Some(t) => t.works += 1,
            None => threads.push(JobThread {
                tid,
                works: 1,
                raised: false,
            }),
        }
        OnJobThread {
            tid,
            _not_send: PhantomData,
        }
    }

    /// The calling thread's piece of work has ended: after its last one it
    /// leaves, lowered if a drain raised it.
    pub(crate) fn leave(&self, on: &OnJobThread) {
        let lower = {
            let mut threads = self.lock();
            match threads.iter().position(|t| t.tid == on.tid) {
                Some(i) if threads[i].works > 1 => {
                    threads[i].works -= 1;
                    false
                }
                Some(i) => threads.swap_remove(i).raised,
                None => false,
            }
        };
        if lower {
            realtime::lower_thread(on.tid);
        }
    }

    /// The registered threads (kernel thread ids).
    pub(crate) fn tids(&self) -> Vec<libc::pid_t> {
        self.lock().iter().map(|t| t.tid).collect()
    }

    /// Raises every registered thread to real-time scheduling (where
    /// allowed: see [`crate::realtime`]) until its work ends or the guard
    /// goes. Under the lock (a procfs read and a syscall per thread, ~15
    /// us each), so that no thread leaves between its raise and its mark.
    pub(crate) fn raise(&self) -> RaisedJobThreads<'_> {
        let mut raised = Vec::new();
        for t in self.lock().iter_mut().filter(|t| !t.raised) {
            if realtime::raise_thread(t.tid) {
                t.raised = true;
                raised.push(t.tid);
            }
        }
        RaisedJobThreads {
            threads: self,
            raised,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<JobThread>> {
        self.threads.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Threads a drain raised: those whose work has not ended when this goes
/// (a drain that failed) are lowered then, so a raise never outlasts it.
#[must_use = "raised threads are lowered when this is dropped"]
#[derive(Debug)]
pub(crate) struct RaisedJobThreads<'a> {
    threads: &'a JobThreads,
    /// The threads this raise raised.
    raised: Vec<libc::pid_t>,
}

impl RaisedJobThreads<'_> {
    /// How many threads were raised.
    pub(crate) fn count(&self) -> usize {
        self.raised.len()
    }
}

impl Drop for RaisedJobThreads<'_> {
    fn drop(&mut self) {
        if self.raised.is_empty() {
            return;
        }
        // Those that left have lowered themselves. Under the lock (a
        // procfs read and a syscall per thread still raised, rare: a
        // failed drain), so that a thread leaving now sees its flag as
        // this leaves it.
        for t in self.threads.lock().iter_mut() {
            if t.raised && self.raised.contains(&t.tid) {
                realtime::lower_thread(t.tid);
                t.raised = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::sync::Arc;

    /// A thread that enters `works` times, reports its id, then leaves
    /// once per message.
    fn worker(
        threads: Arc<JobThreads>,
        works: usize,
    ) -> (
        libc::pid_t,
        std::sync::mpsc::Sender<()>,
        std::sync::mpsc::Receiver<()>,
        std::thread::JoinHandle<()>,
    ) {
        let (tid_tx, tid_rx) = channel();
        let (step_tx, step_rx) = channel::<()>();
        let (done_tx, done_rx) = channel();
        let handle = std::thread::spawn(move || {
            let on: Vec<_> = (0..works).map(|_| threads.enter()).collect();
            tid_tx.send(current_tid()).unwrap();
            for o in &on {
                step_rx.recv().unwrap();
                threads.leave(o);
                done_tx.send(()).unwrap();
            }
            // Stays alive until told, so its scheduling can be read.
            let _ = step_rx.recv();
        });
        (tid_rx.recv().unwrap(), step_tx, done_rx, handle)
    }

    fn expected_raise(tid: libc::pid_t) -> bool {
        realtime::may_raise() && realtime::scheduling_of(tid) == Some((0, 0))
    }

    #[test]
    fn a_thread_is_named_once_and_until_its_last_work_ends() {
        let threads = Arc::new(JobThreads::default());
        let (tid, step, done, handle) = worker(threads.clone(), 2);
        assert_eq!(threads.tids(), vec![tid]);
        step.send(()).unwrap();
        done.recv().unwrap();
        assert_eq!(threads.tids(), vec![tid], "one piece still runs");
        step.send(()).unwrap();
        done.recv().unwrap();
        assert!(threads.tids().is_empty());
        step.send(()).unwrap();
        handle.join().unwrap();
    }

    #[test]
    fn a_raised_thread_runs_real_time_until_its_last_work_ends() {
        let threads = Arc::new(JobThreads::default());
        let (tid, step, done, handle) = worker(threads.clone(), 2);
        let before = realtime::scheduling_of(tid).unwrap();
        let expected = expected_raise(tid);
        let raised = threads.raise();
        assert_eq!(raised.count(), usize::from(expected));
        let fifo_or_before = if expected { 1 } else { before.0 };
        assert_eq!(realtime::scheduling_of(tid).unwrap().0, fifo_or_before);
        // Raised once only.
        assert_eq!(threads.raise().count(), 0);
        step.send(()).unwrap();
        done.recv().unwrap();
        assert_eq!(
            realtime::scheduling_of(tid).unwrap().0,
            fifo_or_before,
            "one piece still runs"
        );
        step.send(()).unwrap();
        done.recv().unwrap();
        assert_eq!(
            realtime::scheduling_of(tid).unwrap(),
            before,
            "lowered when its work ended"
        );
        drop(raised);
        step.send(()).unwrap();
        handle.join().unwrap();
    }

    #[test]
    fn a_raise_never_outlasts_its_guard() {
        let threads = Arc::new(JobThreads::default());
        let (tid, step, done, handle) = worker(threads.clone(), 1);
        let before = realtime::scheduling_of(tid).unwrap();
        let expected = expected_raise(tid);
        let raised = threads.raise();
        assert_eq!(raised.count(), usize::from(expected));
        // The drain gave up while the work still runs.
        drop(raised);
        assert_eq!(realtime::scheduling_of(tid).unwrap(), before);
        // Its end does not lower it twice (nothing to see but no harm).
        step.send(()).unwrap();
        done.recv().unwrap();
        assert_eq!(realtime::scheduling_of(tid).unwrap(), before);
        step.send(()).unwrap();
        handle.join().unwrap();
    }

    #[test]
    fn a_thread_scheduled_otherwise_is_left_as_it_is() {
        let threads = Arc::new(JobThreads::default());
        let (tx, rx) = channel();
        let (step_tx, step_rx) = channel::<()>();
        let t = threads.clone();
        let handle = std::thread::spawn(move || {
            // A lower priority is always allowed.
            rustix::process::setpriority_process(None, 5).unwrap();
            let on = t.enter();
            tx.send(current_tid()).unwrap();
            step_rx.recv().unwrap();
            t.leave(&on);
        });
        let tid = rx.recv().unwrap();
        let before = realtime::scheduling_of(tid).unwrap();
        assert_eq!(before.1, 5);
        let raised = threads.raise();
        assert_eq!(raised.count(), 0);
        assert_eq!(realtime::scheduling_of(tid).unwrap(), before);
        drop(raised);
        step_tx.send(()).unwrap();
        handle.join().unwrap();
    }
}
