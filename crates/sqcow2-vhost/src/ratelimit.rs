//! Rate-limited warnings: a guest (or a failing disk) can cause one
//! warning per request, and a log that grows at the request rate fills
//! the host's disk. Each call site logs at most [`BURST`] messages per
//! [`WINDOW_SECS`] seconds and reports how many it held back.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Messages let through per window.
pub(crate) const BURST: u32 = 10;
/// Window length in seconds.
pub(crate) const WINDOW_SECS: u64 = 10;

fn epoch() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// The budget of one call site.
#[derive(Debug, Default)]
pub(crate) struct LogLimiter {
    window: AtomicU64,
    count: AtomicU32,
    suppressed: AtomicU64,
}

impl LogLimiter {
    /// A fresh budget.
    pub(crate) const fn new() -> Self {
        LogLimiter {
            window: AtomicU64::new(0),
            count: AtomicU32::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(n)` when a message may be logged now (`n` were held back
    /// since the last one logged), `None` when it is to be dropped.
    pub(crate) fn check(&self) -> Option<u64> {
        self.check_at(epoch().elapsed().as_secs())
    }

    fn check_at(&self, now_secs: u64) -> Option<u64> {
        let window = now_secs / WINDOW_SECS + 1;
        if self.window.swap(window, Ordering::Relaxed) != window {
            self.count.store(0, Ordering::Relaxed);
        }
        if self.count.fetch_add(1, Ordering::Relaxed) < BURST {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// `warn!` through a per-call-site `LogLimiter`.
#[macro_export]
macro_rules! limited_warn {
    ($($arg:tt)+) => {{
        static LIMITER: $crate::ratelimit::LogLimiter = $crate::ratelimit::LogLimiter::new();
        if let Some(held_back) = LIMITER.check() {
            if held_back > 0 {
                tracing::warn!(held_back, "similar warnings were held back");
            }
            tracing::warn!($($arg)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lets_a_burst_through_per_window_and_counts_the_rest() {
        let l = LogLimiter::new();
        let allowed = (0..25).filter(|_| l.check_at(3).is_some()).count();
        assert_eq!(allowed, BURST as usize);
        // Next window: allowed again, and told how many were dropped.
        assert_eq!(l.check_at(3 + WINDOW_SECS), Some(15));
        assert_eq!(l.check_at(3 + WINDOW_SECS), Some(0));
    }
}
