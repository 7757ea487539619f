//! The thread doing a live snapshot's pause runs ahead of every normal
//! thread while the guest waits: on a host with few CPUs the daemon's
//! queue and engine threads, the guest's own threads and the kernel's
//! write-back share them, and a pause's few microseconds of work waited
//! up to 5 ms for a CPU (measured with `cpu_wait_ms`). `SCHED_FIFO` at
//! its lowest priority: above every `SCHED_OTHER` thread, below every
//! real-time one the host runs; the pause holds no CPU while it waits
//! (its waits sleep), and the kernel's real-time throttling still leaves
//! the other threads their share. Needs `CAP_SYS_NICE` (or an
//! `RLIMIT_RTPRIO`); without it the pause runs as before.

use std::marker::PhantomData;

use thread_priority::{
    set_thread_priority_and_policy, thread_native_id, thread_schedule_policy,
    NormalThreadSchedulePolicy, RealtimeThreadSchedulePolicy, ThreadPriority,
    ThreadPriorityOsValue, ThreadSchedulePolicy,
};
use tracing::debug;

const NORMAL: ThreadSchedulePolicy =
    ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Other);
const FIFO: ThreadSchedulePolicy =
    ThreadSchedulePolicy::Realtime(RealtimeThreadSchedulePolicy::Fifo);

/// The calling thread raised to real-time scheduling until this is
/// dropped, on the same thread (not `Send`). Raised only from the default
/// policy at nice 0, which the drop restores exactly; a thread an operator
/// scheduled otherwise is left as it is.
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
        let raised = wanted && raise();
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

fn raise() -> bool {
    let normal_at_zero = matches!(thread_schedule_policy(), Ok(p) if p == NORMAL)
        && rustix::process::getpriority_process(None) == Ok(0);
    if !normal_at_zero {
        return false;
    }
    match set_thread_priority_and_policy(thread_native_id(), ThreadPriority::Min, FIFO) {
        Ok(()) => true,
        Err(e) => {
            debug!(error = ?e, "running the pause at real-time priority is not allowed");
            false
        }
    }
}

impl Drop for RealtimeSection {
    fn drop(&mut self) {
        if self.raised {
            // Back to the default policy at nice 0 (what it was): for the
            // normal policies the crate's value is the nice value, and its
            // default 0.
            let nice_zero = ThreadPriority::Os(ThreadPriorityOsValue::default());
            if let Err(e) = set_thread_priority_and_policy(thread_native_id(), nice_zero, NORMAL) {
                tracing::warn!(error = ?e, "could not put the pause's thread back to normal scheduling");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> ThreadSchedulePolicy {
        thread_schedule_policy().expect("sched_getscheduler")
    }

    #[test]
    fn raised_while_held_and_normal_again_after() {
        std::thread::spawn(|| {
            assert_eq!(policy(), NORMAL);
            let permitted = rustix::process::geteuid().is_root();
            {
                let section = RealtimeSection::enter(true);
                // As root the raise must succeed; otherwise it may not.
                if permitted {
                    assert!(section.raised());
                }
                assert_eq!(policy() == FIFO, section.raised());
            }
            assert_eq!(policy(), NORMAL);
            assert_eq!(rustix::process::getpriority_process(None), Ok(0));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn not_wanted_leaves_the_thread_alone() {
        std::thread::spawn(|| {
            let section = RealtimeSection::enter(false);
            assert!(!section.raised());
            assert_eq!(policy(), NORMAL);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_scheduled_otherwise_is_left_as_it_is() {
        std::thread::spawn(|| {
            // A lower priority (nice 5) is always allowed.
            rustix::process::setpriority_process(None, 5).unwrap();
            {
                let section = RealtimeSection::enter(true);
                assert!(!section.raised());
                assert_eq!(policy(), NORMAL);
            }
            assert_eq!(rustix::process::getpriority_process(None), Ok(5));
        })
        .join()
        .unwrap();
    }
}
