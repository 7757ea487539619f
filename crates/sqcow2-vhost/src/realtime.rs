//! Real-time scheduling for the few milliseconds a live snapshot pauses
//! the guest. The thread doing the pause runs ahead of every normal
//! thread while the guest waits: on a host with few CPUs the daemon's
//! queue and engine threads, the guest's own threads and the kernel's
//! write-back share them, and a pause's 0.05-0.1 ms of work waited up to
//! 5 ms for a CPU (measured with `cpu_wait_ms`). So do the engine jobs
//! the pause's drain waits for, once it has waited a little: one such job
//! waited 9.9 ms for a CPU in a 10.5 ms drain (`drain_jobs_cpu_wait_ms`).
//! `SCHED_FIFO` at its lowest priority: above every `SCHED_OTHER` thread,
//! below every real-time one the host runs; the kernel's real-time
//! throttling still leaves the other threads their share. Needs
//! `CAP_SYS_NICE` (or an `RLIMIT_RTPRIO`); without it the pause runs as
//! before. Only threads at the default policy and nice 0 are raised, and
//! each goes back to exactly that.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::{info, warn};

/// The calling thread's kernel thread id (asked of the kernel once per
/// thread).
pub(crate) fn current_tid() -> libc::pid_t {
    thread_local! {
        static TID: libc::pid_t = rustix::thread::gettid().as_raw_nonzero().get();
    }
    TID.with(|t| *t)
}

/// Whether a refused raise of the pause's thread was reported.
static PAUSE_REFUSAL_REPORTED: AtomicBool = AtomicBool::new(false);
/// Whether a refused raise of a job thread was reported.
static JOB_REFUSAL_REPORTED: AtomicBool = AtomicBool::new(false);

/// The calling thread raised to real-time scheduling until this is
/// dropped, on the same thread (not `Send`). Raised only from the default
/// policy at nice 0 as the kernel has them, which the drop restores
/// exactly; a thread an operator scheduled otherwise is left as it is.
#[must_use = "the thread goes back to normal scheduling when this is dropped"]
#[derive(Debug)]
pub(crate) struct RealtimeSection {
    raised: bool,
    /// Dropped on the thread it raised.
    _not_send: PhantomData<*const ()>,
}

impl RealtimeSection {
    /// Raises the calling thread if `wanted` and it is allowed to.
    pub(crate) fn enter(wanted: bool) -> Self {
        let raised = wanted
            && raise(
                current_tid(),
                &PAUSE_REFUSAL_REPORTED,
                "live snapshots pause at normal priority",
            );
        RealtimeSection {
            raised,
            _not_send: PhantomData,
        }
    }

    /// Whether the thread runs real-time now.
    pub(crate) fn raised(&self) -> bool {
        self.raised
    }
}

impl Drop for RealtimeSection {
    fn drop(&mut self) {
        if self.raised {
            lower_thread(current_tid());
        }
    }
}

/// Raises thread `tid` of this process to `SCHED_FIFO` at its lowest
/// level if it runs the default policy at nice 0; whether it did. By
/// kernel thread id, which names no memory: a thread that has ended makes
/// it fail (`ESRCH`).
pub(crate) fn raise_thread(tid: libc::pid_t) -> bool {
    raise(
        tid,
        &JOB_REFUSAL_REPORTED,
        "engine jobs a live snapshot waits for run at normal priority",
    )
}

/// [`raise_thread`], a refusal reported once per `reported` flag.
fn raise(tid: libc::pid_t, reported: &AtomicBool, refused: &str) -> bool {
    if scheduling_of_task(tid) != Some(ThreadScheduling::NORMAL_AT_ZERO) {
        return false;
    }
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: the call reads `param`, which this frame owns, and nothing
    // else of this process; `tid` is a number, not a pointer.
    let r = unsafe { libc::sched_setscheduler(tid, libc::SCHED_FIFO, &param) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if !reported.swap(true, Ordering::Relaxed) {
            info!(error = %e, "{refused}: real-time scheduling is not allowed (CAP_SYS_NICE)");
        }
        return false;
    }
    true
}

/// Puts thread `tid` of this process, raised by [`raise_thread`], back to
/// the default policy (its nice value, 0, unchanged by the raise), unless
/// it no longer runs `SCHED_FIFO` (an operator changed it since: theirs).
pub(crate) fn lower_thread(tid: libc::pid_t) {
    if scheduling_of_task(tid).map(|s| s.policy) != Some(libc::SCHED_FIFO as u32) {
        return;
    }
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: as in `raise`: only `param`, owned here, is read.
    let r = unsafe { libc::sched_setscheduler(tid, libc::SCHED_OTHER, &param) };
    if r != 0 {
        warn!(tid, error = %std::io::Error::last_os_error(), "could not put a thread back to normal scheduling");
    }
}

/// Makes the calling thread `by` nice levels nicer than it is (at most
/// 19), for background work that must yield the CPU to the guest's
/// requests: under allocating writes on 2 cores, the new top's index
/// build after a live snapshot took a fifth of the CPU, and at nice 10
/// the writes' dip after each pause shrank from 300-600 ms under half
/// their rate to 0-200 ms, the index in use as soon (see
/// docs/benchmarks.md). Relative, so that an operator's own nice value
/// is kept as the base; a failure leaves the thread as it was.
pub(crate) fn lower_current_thread(by: i32) {
    let tid = current_tid();
    let Some(now) = scheduling_of_task(tid) else {
        return;
    };
    // SAFETY: a plain system call naming a thread of this process by
    // number; no memory is passed.
    let r = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            tid as libc::id_t,
            (now.nice + by).min(19),
        )
    };
    if r != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "could not lower a background thread's priority");
    }
}

/// A thread's scheduling, from the kernel (`stat` in procfs; glibc's own
/// answer is a cache that misses a change made from outside, e.g. by
/// `chrt -p`).
fn scheduling_of_task(tid: libc::pid_t) -> Option<ThreadScheduling> {
    parse_stat(&std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?)
}

/// A thread's scheduling as the kernel has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ThreadScheduling {
    /// `SCHED_OTHER` 0, `SCHED_FIFO` 1, ...
    policy: u32,
    nice: i32,
}

impl ThreadScheduling {
    const NORMAL_AT_ZERO: ThreadScheduling = ThreadScheduling {
        policy: libc::SCHED_OTHER as u32,
        nice: 0,
    };
}

/// Fields 19 (nice) and 41 (policy) of a `stat` line, counted after the
/// command name (which may hold spaces and parentheses).
fn parse_stat(stat: &str) -> Option<ThreadScheduling> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // `fields[0]` is field 3.
    Some(ThreadScheduling {
        nice: fields.get(19 - 3)?.parse().ok()?,
        policy: fields.get(41 - 3)?.parse().ok()?,
    })
}

/// A thread's policy and nice value, as the kernel has them.
#[cfg(test)]
pub(crate) fn scheduling_of(tid: libc::pid_t) -> Option<(u32, i32)> {
    scheduling_of_task(tid).map(|s| (s.policy, s.nice))
}

/// Whether a thread of this process may take real-time scheduling, asked
/// of util-linux's `chrt` (an independent program, as the caller is
/// scheduled: capabilities, `RLIMIT_RTPRIO`, seccomp, cgroups).
#[cfg(test)]
pub(crate) fn may_raise() -> bool {
    std::process::Command::new("chrt")
        .args(["-f", "1", "true"])
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduling() -> ThreadScheduling {
        scheduling_of_task(current_tid()).expect("procfs stat")
    }

    #[test]
    fn parses_the_kernels_stat_line() {
        let line = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 -5 1 0 \
                    1234 1000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 1 0 0 0 \
                    0 0 0 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(ThreadScheduling {
                policy: 1,
                nice: -5
            })
        );
        assert_eq!(parse_stat("4242 (a) S 1"), None);
    }

    #[test]
    fn a_background_thread_is_made_nicer_relative_to_its_own_value() {
        let ours = scheduling();
        std::thread::spawn(|| {
            let before = scheduling();
            lower_current_thread(10);
            let after = scheduling();
            assert_eq!(after.policy, before.policy);
            assert_eq!(after.nice, (before.nice + 10).min(19));
            lower_current_thread(10);
            assert_eq!(scheduling().nice, 19, "capped");
        })
        .join()
        .unwrap();
        // Other threads keep theirs.
        assert_eq!(scheduling(), ours);
    }

    #[test]
    fn raised_while_held_and_as_before_after() {
        std::thread::spawn(|| {
            let before = scheduling();
            // Raised exactly where chrt may raise and the thread runs
            // normally at nice 0.
            let expected = may_raise() && before == ThreadScheduling::NORMAL_AT_ZERO;
            {
                let section = RealtimeSection::enter(true);
                assert_eq!(section.raised(), expected);
                let during = scheduling();
                if expected {
                    assert_eq!(during.policy, 1, "SCHED_FIFO while held");
                } else {
                    assert_eq!(during, before);
                }
            }
            assert_eq!(scheduling(), before);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn not_wanted_leaves_the_thread_alone() {
        std::thread::spawn(|| {
            let before = scheduling();
            let section = RealtimeSection::enter(false);
            assert!(!section.raised());
            assert_eq!(scheduling(), before);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_scheduled_otherwise_is_left_as_it_is() {
        std::thread::spawn(|| {
            // A lower priority is always allowed.
            let nice = scheduling().nice.max(5);
            rustix::process::setpriority_process(None, nice).unwrap();
            let before = scheduling();
            assert_eq!(before.nice, nice);
            {
                let section = RealtimeSection::enter(true);
                assert!(!section.raised());
                assert_eq!(scheduling(), before);
            }
            assert_eq!(scheduling(), before);
        })
        .join()
        .unwrap();
    }
}
