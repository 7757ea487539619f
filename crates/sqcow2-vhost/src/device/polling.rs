//! How long a worker thread busy-polls its rings before it sleeps: never,
//! a fixed time, or adapted to the thread's own sleeps as QEMU adapts its
//! iothreads' (`poll-max-ns`, grown and shrunk by the time blocked).

use std::time::Duration;

/// The first poll time of an adaptive window that grows from nothing
/// (QEMU's 4 µs).
const FIRST_POLL: Duration = Duration::from_micros(4);

/// How a worker thread polls its rings after its last piece of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Polling {
    /// Never: it sleeps as soon as it has nothing to do.
    Off,
    /// Always this long.
    Fixed(Duration),
    /// Up to `max`: while work comes back soon after the thread ran out
    /// (later than it polled, sooner than `max`), the poll time doubles;
    /// once the thread sleeps longer than `max`, polling stops until work
    /// comes back soon again. A busy queue at depth 1 is then polled, an
    /// idle one costs no CPU.
    Adaptive {
        /// The longest poll.
        max: Duration,
    },
}

impl Polling {
    /// The polling of a worker thread whose requests wait only for engine
    /// jobs (an allocating write: a copy-on-write read and a cluster
    /// write, ~100 µs with cache=none): an adaptive window may grow
    /// [`ENGINE_WAIT_FACTOR`] times longer, or the thread sleeps through
    /// every such job and a wake-up follows each (QEMU has no such wait:
    /// its iothread runs those I/Os itself).
    pub(crate) fn for_engine_waits(self) -> Polling {
        match self {
            Polling::Adaptive { max } => Polling::Adaptive {
                max: max * ENGINE_WAIT_FACTOR,
            },
            other => other,
        }
    }
}

/// How much longer than `--poll-max-us` a worker polls while it waits only
/// for engine jobs.
pub(crate) const ENGINE_WAIT_FACTOR: u32 = 8;

/// A worker thread's current poll time under a [`Polling`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct PollWindow {
    polling: Polling,
    now: Duration,
}

impl PollWindow {
    pub(crate) fn new(polling: Polling) -> Self {
        let now = match polling {
            Polling::Fixed(d) => d,
            Polling::Off | Polling::Adaptive { .. } => Duration::ZERO,
        };
        PollWindow { polling, now }
    }

    /// How long to poll now.
    pub(crate) fn current(&self) -> Duration {
        self.now
    }

    /// Work came again `idle` after the thread ran out of it (its poll
    /// time included).
    pub(crate) fn observe(&mut self, idle: Duration) {
        let Polling::Adaptive { max } = self.polling else {
            return;
        };
        if idle <= self.now {
            // Polling caught it: keep the window.
        } else if idle > max {
            self.now = Duration::ZERO;
        } else if self.now < max {
            self.now = (self.now * 2).max(FIRST_POLL).min(max);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(32);

    #[test]
    fn an_adaptive_window_grows_on_near_misses_and_drops_on_long_sleeps() {
        let mut w = PollWindow::new(Polling::Adaptive { max: MAX });
        assert_eq!(w.current(), Duration::ZERO);
        // Work back 20 µs after running out: grow 4, 8, 16, 32, capped.
        let mut seen = Vec::new();
        for _ in 0..6 {
            w.observe(Duration::from_micros(20));
            seen.push(w.current().as_micros());
        }
        assert_eq!(seen, [4, 8, 16, 32, 32, 32]);
        // Caught by polling: unchanged.
        w.observe(Duration::from_micros(10));
        assert_eq!(w.current(), MAX);
        // A sleep longer than the most: polling stops.
        w.observe(Duration::from_millis(5));
        assert_eq!(w.current(), Duration::ZERO);
    }

    #[test]
    fn engine_waits_poll_longer_only_when_adaptive() {
        let adaptive = Polling::Adaptive { max: MAX };
        assert_eq!(
            adaptive.for_engine_waits(),
            Polling::Adaptive {
                max: MAX * ENGINE_WAIT_FACTOR
            }
        );
        assert_eq!(Polling::Off.for_engine_waits(), Polling::Off);
        let fixed = Polling::Fixed(MAX);
        assert_eq!(fixed.for_engine_waits(), fixed);
        // An allocating write's ~100 µs: caught once the window has grown.
        let mut w = PollWindow::new(adaptive.for_engine_waits());
        for _ in 0..8 {
            w.observe(Duration::from_micros(100));
        }
        assert!(
            w.current() >= Duration::from_micros(100),
            "{:?}",
            w.current()
        );
    }

    #[test]
    fn fixed_and_off_windows_never_change() {
        let mut fixed = PollWindow::new(Polling::Fixed(MAX));
        let mut off = PollWindow::new(Polling::Off);
        for idle in [1, 20, 5000] {
            fixed.observe(Duration::from_micros(idle));
            off.observe(Duration::from_micros(idle));
        }
        assert_eq!(fixed.current(), MAX);
        assert_eq!(off.current(), Duration::ZERO);
    }
}
