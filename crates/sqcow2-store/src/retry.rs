//! How often a failed request is tried again before its reader is given
//! the error: transient failures only (the store unreachable, a 5xx, an
//! answer cut short), with a pause that doubles.

use std::time::Duration;

use crate::StoreError;

/// Most a pause between two tries grows to.
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// The retry policy of a store's reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Tries in all (1: none again), the first pause before the second.
    Bounded { tries: u32, first_pause: Duration },
    /// Until the store answers (a reader waits as long as it is down).
    Forever { first_pause: Duration },
}

impl Default for Retry {
    /// Three tries, 100 ms then 200 ms apart.
    fn default() -> Self {
        Retry::Bounded {
            tries: 3,
            first_pause: Duration::from_millis(100),
        }
    }
}

/// Whether trying again may help.
fn transient(e: &StoreError) -> bool {
    match e {
        StoreError::Unreachable { .. } => true,
        StoreError::Http { status, .. } => *status >= 500 || *status == 429,
        _ => false,
    }
}

impl Retry {
    /// `attempt` run until it succeeds, fails for good, or the tries are
    /// used up (the last error then).
    pub fn run<T>(
        &self,
        mut attempt: impl FnMut() -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let (tries, mut pause) = match *self {
            Retry::Bounded { tries, first_pause } => (Some(tries.max(1)), first_pause),
            Retry::Forever { first_pause } => (None, first_pause),
        };
        let mut tried = 0u32;
        loop {
            match attempt() {
                Ok(v) => return Ok(v),
                Err(e) => {
                    tried += 1;
                    if !transient(&e) || tries.is_some_and(|t| tried >= t) {
                        return Err(e);
                    }
                    tracing::debug!(error = %e, tried, "store request failed: trying again");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(MAX_PAUSE);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_errors_are_tried_again_up_to_the_bound() {
        let down = || StoreError::Unreachable {
            endpoint: "e".into(),
            message: "refused".into(),
        };
        let retry = Retry::Bounded {
            tries: 3,
            first_pause: Duration::ZERO,
        };
        let mut n = 0;
        assert!(retry
            .run(|| -> Result<(), _> {
                n += 1;
                Err(down())
            })
            .is_err());
        assert_eq!(n, 3);
        n = 0;
        let got = retry.run(|| {
            n += 1;
            if n < 2 {
                Err(down())
            } else {
                Ok(n)
            }
        });
        assert_eq!(got.unwrap(), 2);
        n = 0;
        let missing = retry.run(|| -> Result<(), _> {
            n += 1;
            Err(StoreError::NotFound { key: "k".into() })
        });
        assert!(missing.is_err());
        assert_eq!(n, 1, "a missing object is not tried again");
    }
}
