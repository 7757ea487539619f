//! How long a thread waited for a CPU: the kernel's run-queue wait of the
//! thread (`schedstat` in procfs, second field), so that a slow step can
//! be told from one whose thread was runnable but not running (on a host
//! with few CPUs, the threads of the daemon, the guest and the device's
//! write-back share them).

use std::time::{Duration, Instant};

/// The calling thread's total run-queue wait so far, if the kernel keeps
/// it (`CONFIG_SCHED_INFO`).
pub(crate) fn thread_cpu_wait() -> Option<Duration> {
    read_schedstat("/proc/thread-self/schedstat").map(|s| s.wait)
}

/// A thread's CPU time and run-queue wait so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SchedStat {
    run: Duration,
    wait: Duration,
}

fn read_schedstat(path: &str) -> Option<SchedStat> {
    parse_schedstat(&std::fs::read_to_string(path).ok()?)
}

/// The first two fields of a `schedstat` line: nanoseconds on a CPU, and
/// runnable but not running.
fn parse_schedstat(text: &str) -> Option<SchedStat> {
    let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().ok());
    let run = fields.next()??;
    let wait = fields.next()??;
    Some(SchedStat {
        run: Duration::from_nanos(run),
        wait: Duration::from_nanos(wait),
    })
}

/// Other threads of this process (a drain's engine jobs), sampled at a
/// start, to tell afterwards what they did since: ran, waited for a CPU,
/// or slept (a lock, I/O).
#[derive(Debug)]
pub(crate) struct ThreadsSince {
    start: Instant,
    threads: Vec<(libc::pid_t, SchedStat)>,
}

/// What one thread did since a [`ThreadsSince`] sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ThreadTime {
    pub(crate) thread: libc::pid_t,
    pub(crate) run_ms: f64,
    pub(crate) cpu_wait_ms: f64,
    /// Neither running nor runnable: asleep.
    pub(crate) blocked_ms: f64,
}

impl std::fmt::Display for ThreadTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "thread {}: ran {:.2} ms, waited for a CPU {:.2} ms, slept {:.2} ms",
            self.thread, self.run_ms, self.cpu_wait_ms, self.blocked_ms
        )
    }
}

impl ThreadsSince {
    /// Samples `threads` (kernel thread ids of this process) now; those
    /// gone already are left out.
    pub(crate) fn sample(threads: Vec<libc::pid_t>) -> Self {
        let start = Instant::now();
        let threads = threads
            .into_iter()
            .filter_map(|t| Some((t, read_schedstat(&task_path(t))?)))
            .collect();
        ThreadsSince { start, threads }
    }

    /// What each sampled thread did since (those gone since are left out).
    pub(crate) fn since(&self) -> Vec<ThreadTime> {
        let elapsed = self.start.elapsed();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        self.threads
            .iter()
            .filter_map(|&(thread, before)| {
                let now = read_schedstat(&task_path(thread))?;
                let run = now.run.saturating_sub(before.run);
                let wait = now.wait.saturating_sub(before.wait);
                Some(ThreadTime {
                    thread,
                    run_ms: ms(run),
                    cpu_wait_ms: ms(wait),
                    blocked_ms: ms(elapsed.saturating_sub(run + wait)),
                })
            })
            .collect()
    }
}

fn task_path(thread: libc::pid_t) -> String {
    format!("/proc/self/task/{thread}/schedstat")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_two_fields_are_run_and_wait() {
        assert_eq!(
            parse_schedstat("348248240 350905 41\n"),
            Some(SchedStat {
                run: Duration::from_nanos(348_248_240),
                wait: Duration::from_nanos(350_905)
            })
        );
        assert_eq!(parse_schedstat("12"), None);
        assert_eq!(parse_schedstat("1 x 3"), None);
    }

    #[test]
    fn this_machine_keeps_it() {
        // Not a timing assertion: the value exists and never decreases.
        let a = thread_cpu_wait().expect("kernel with CONFIG_SCHED_INFO");
        let b = thread_cpu_wait().expect("kernel with CONFIG_SCHED_INFO");
        assert!(b >= a);
    }

    #[test]
    fn a_sleeping_thread_is_seen_blocked() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let sleeper = std::thread::spawn(move || {
            tx.send(crate::realtime::current_tid()).unwrap();
            stop_rx.recv().unwrap();
        });
        let tid = rx.recv().unwrap();
        let sample = ThreadsSince::sample(vec![tid, 0]);
        assert_eq!(sample.threads.len(), 1, "thread 0 does not exist");
        std::thread::sleep(Duration::from_millis(30));
        let times = sample.since();
        stop_tx.send(()).unwrap();
        sleeper.join().unwrap();
        assert_eq!(times.len(), 1);
        let t = times[0];
        assert_eq!(t.thread, tid);
        // Asleep on the channel the whole time: it ran for at most a
        // fraction of the 30 ms it was watched, and the rest is blocked.
        assert!(t.blocked_ms > 15.0, "{t:?}");
    }
}
