//! Injected time. Every store operation whose effect depends on the time (a decision, an
//! outcome, a resolution, a revocation, the sweep) takes `now` from a [`Clock`], so tests can
//! move time.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub type Millis = i64;

/// A source of the current time.
pub trait Clock: Send + Sync {
    fn now_ms(&self) -> Millis;
}

/// The machine's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
            Err(_) => 0,
        }
    }
}

/// A clock that only moves when told to: for tests.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicI64,
}

impl ManualClock {
    pub fn new(start_ms: Millis) -> Self {
        ManualClock {
            now: AtomicI64::new(start_ms),
        }
    }

    pub fn set(&self, ms: Millis) {
        self.now.store(ms, Ordering::SeqCst);
    }

    pub fn advance_ms(&self, ms: Millis) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> Millis {
        self.now.load(Ordering::SeqCst)
    }
}

/// The moment (monotonic) after which an operation's caller no longer waits for its answer:
/// a decision not committed by then is not committed at all (the caller was told nothing
/// was reserved). Measured on this process's monotonic clock, so a wall clock step moves it
/// not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline(Instant);

/// Longest part of a callout's timeout kept for the answer's trip back to the filter.
pub const MAX_REPLY_MARGIN: Duration = Duration::from_millis(100);

/// How long after its arrival a callout waiting `timeout` may still be decided: the timeout
/// less a tenth of it (at most [`MAX_REPLY_MARGIN`]), kept for the answer's trip back.
pub fn decision_window(timeout: Duration) -> Duration {
    timeout.saturating_sub((timeout / 10).min(MAX_REPLY_MARGIN))
}

impl Deadline {
    pub fn at(instant: Instant) -> Self {
        Deadline(instant)
    }

    /// `d` from now.
    pub fn after(d: Duration) -> Self {
        Deadline(Instant::now() + d)
    }

    /// The deadline of a callout that arrived at `arrival` from a caller waiting `timeout`
    /// for it: the answer must leave early enough to travel back, so a tenth of the timeout
    /// (at most [`MAX_REPLY_MARGIN`]) is kept for the trips there and back.
    pub fn of_callout(arrival: Instant, timeout: Duration) -> Self {
        Deadline(arrival + decision_window(timeout))
    }

    /// Time left (zero once passed).
    pub fn remaining(&self) -> Duration {
        self.0.saturating_duration_since(Instant::now())
    }

    pub fn passed(&self) -> bool {
        Instant::now() >= self.0
    }

    pub fn instant(&self) -> Instant {
        self.0
    }
}

/// RFC 3339 text (UTC, millisecond precision) for a timestamp.
pub fn rfc3339(ms: Millis) -> String {
    let ms = u64::try_from(ms.max(0)).unwrap_or(0);
    let t = UNIX_EPOCH + std::time::Duration::from_millis(ms);
    humantime::format_rfc3339_millis(t).to_string()
}

/// Parses RFC 3339 text into milliseconds since the epoch.
pub fn parse_rfc3339(s: &str) -> Option<Millis> {
    let t = humantime::parse_rfc3339_weak(s).ok()?;
    let d = t.duration_since(UNIX_EPOCH).ok()?;
    i64::try_from(d.as_millis()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trips() {
        let ms = 1_767_225_600_123;
        assert_eq!(parse_rfc3339(&rfc3339(ms)), Some(ms));
    }

    #[test]
    fn a_callout_deadline_keeps_a_tenth_of_the_timeout_for_the_reply_at_most_100_ms() {
        let t0 = Instant::now();
        let ms = |d: Deadline| d.instant().duration_since(t0).as_millis();
        assert_eq!(
            ms(Deadline::of_callout(t0, Duration::from_millis(1000))),
            900
        );
        assert_eq!(
            ms(Deadline::of_callout(t0, Duration::from_millis(200))),
            180
        );
        assert_eq!(
            ms(Deadline::of_callout(t0, Duration::from_secs(30))),
            29_900
        );
        assert!(Deadline::of_callout(t0, Duration::ZERO).passed());
        assert_eq!(Deadline::at(t0).remaining(), Duration::ZERO);
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::new(10);
        assert_eq!(c.now_ms(), 10);
        c.advance_ms(5);
        assert_eq!(c.now_ms(), 15);
        c.set(1);
        assert_eq!(c.now_ms(), 1);
    }
}
