//! How long the calling thread waited for a CPU: the kernel's run-queue
//! wait of the thread (`/proc/thread-self/schedstat`, second field), so
//! that a slow step can be told from one whose thread was runnable but
//! not running (on a host with few CPUs, the threads of the daemon, the
//! guest and the device's write-back share them).

use std::time::Duration;

/// The calling thread's total run-queue wait so far, if the kernel keeps
/// it (`CONFIG_SCHED_INFO`).
pub(crate) fn thread_cpu_wait() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    parse_schedstat_wait(&text)
}

/// The second field of a `schedstat` line: nanoseconds runnable but not
/// running.
fn parse_schedstat_wait(text: &str) -> Option<Duration> {
    let ns = text.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    Some(Duration::from_nanos(ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_second_field_is_the_wait() {
        assert_eq!(
            parse_schedstat_wait("348248240 350905 41\n"),
            Some(Duration::from_nanos(350_905))
        );
        assert_eq!(parse_schedstat_wait("12"), None);
        assert_eq!(parse_schedstat_wait("1 x 3"), None);
    }

    #[test]
    fn this_machine_keeps_it() {
        // Not a timing assertion: the value exists and never decreases.
        let a = thread_cpu_wait().expect("kernel with CONFIG_SCHED_INFO");
        let b = thread_cpu_wait().expect("kernel with CONFIG_SCHED_INFO");
        assert!(b >= a);
    }
}
