//! Failed authentication, counted per source: a wrong or missing bearer token on the filter's
//! or the admin API, a wrong admin token at the inbox's sign-in.
//!
//! After [`MAX_FAILURES`] failures from one source within [`WINDOW`], each further failure from
//! it is answered HTTP 429 `too_many_failures` with `Retry-After` (the seconds left in its
//! window) instead of 401, until the window ends. A request whose token is right is never
//! limited, whatever its source did before: a gateway that shares an address with a
//! misbehaving neighbour (a NAT, a node's proxy) keeps its calls. The limit is for what a
//! flood of wrong tokens costs (a log line and a metric each) and to tell a misconfigured
//! client plainly; guessing a token of 32 bytes or more is not a threat it has to stop.
//!
//! A source is the peer's IP address; IPv6 addresses count per /64, which one host commonly
//! holds whole. At most [`MAX_SOURCES`] sources are tracked: when a new one arrives with the
//! table full, windows that have ended are dropped first, then the oldest tenth, so memory
//! stays bounded however many addresses a flood comes from.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failures one source may have within [`WINDOW`] before the next ones are answered 429.
pub const MAX_FAILURES: u32 = 10;
/// How long a source's failures count from its first one.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Most sources tracked at once.
pub const MAX_SOURCES: usize = 10_000;

/// The limit's settings: [`MAX_FAILURES`] in [`WINDOW`], [`MAX_SOURCES`] tracked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthLimit {
    pub max_failures: u32,
    pub window: Duration,
    pub max_sources: usize,
}

impl Default for AuthLimit {
    fn default() -> Self {
        AuthLimit {
            max_failures: MAX_FAILURES,
            window: WINDOW,
            max_sources: MAX_SOURCES,
        }
    }
}

/// What a failed authentication is answered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the limit: the usual refusal (401).
    Refuse,
    /// Past the limit: 429, retry after this many seconds (at least 1).
    TooMany { retry_after_s: u64 },
}

#[derive(Debug, Clone, Copy)]
struct Window {
    started: Instant,
    failures: u32,
}

/// The failures of every tracked source.
#[derive(Debug)]
pub struct FailureLimiter {
    limit: AuthLimit,
    sources: Mutex<HashMap<IpAddr, Window>>,
}

/// The address a source is counted under: an IPv6 address's /64 (an IPv4-mapped one as IPv4).
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

impl FailureLimiter {
    pub fn new(limit: AuthLimit) -> Self {
        FailureLimiter {
            limit: AuthLimit {
                max_sources: limit.max_sources.max(1),
                ..limit
            },
            sources: Mutex::new(HashMap::new()),
        }
    }

    /// Counts one failed authentication from `ip` at `now` and says how to answer it.
    pub fn fail(&self, ip: IpAddr, now: Instant) -> Verdict {
        let key = source_key(ip);
        // A poisoned lock only means another request panicked mid-update of a counter: the
        // table is still a table.
        let mut sources = self
            .sources
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !sources.contains_key(&key) && sources.len() >= self.limit.max_sources {
            let window = self.limit.window;
            sources.retain(|_, w| now.saturating_duration_since(w.started) < window);
            if sources.len() >= self.limit.max_sources {
                // The oldest tenth at once, so a flood of new sources sorts the table once per
                // tenth of it rather than scanning it for every request.
                let mut by_age: Vec<(Instant, IpAddr)> =
                    sources.iter().map(|(k, w)| (w.started, *k)).collect();
                by_age.sort_unstable();
                for (_, k) in by_age.iter().take((self.limit.max_sources / 10).max(1)) {
                    sources.remove(k);
                }
            }
        }
        let w = sources.entry(key).or_insert(Window {
            started: now,
            failures: 0,
        });
        if now.saturating_duration_since(w.started) >= self.limit.window {
            *w = Window {
                started: now,
                failures: 0,
            };
        }
        w.failures = w.failures.saturating_add(1);
        if w.failures <= self.limit.max_failures {
            return Verdict::Refuse;
        }
        let left = self
            .limit
            .window
            .saturating_sub(now.saturating_duration_since(w.started));
        Verdict::TooMany {
            retry_after_s: left.as_secs_f64().ceil().max(1.0) as u64,
        }
    }

    /// How many sources are tracked now.
    pub fn tracked(&self) -> usize {
        self.sources
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn limit(max_failures: u32, max_sources: usize) -> AuthLimit {
        AuthLimit {
            max_failures,
            window: Duration::from_secs(60),
            max_sources,
        }
    }

    fn v4(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    #[test]
    fn the_failure_past_the_limit_is_told_when_to_retry() {
        let limiter = FailureLimiter::new(limit(3, 100));
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(limiter.fail(v4(1), t0), Verdict::Refuse);
        }
        assert_eq!(
            limiter.fail(v4(1), t0 + Duration::from_millis(100)),
            Verdict::TooMany { retry_after_s: 60 }
        );
        assert_eq!(
            limiter.fail(v4(1), t0 + Duration::from_secs(59)),
            Verdict::TooMany { retry_after_s: 1 }
        );
        // Another source has its own count.
        assert_eq!(limiter.fail(v4(2), t0), Verdict::Refuse);
        // The window over, the count starts again.
        assert_eq!(
            limiter.fail(v4(1), t0 + Duration::from_secs(60)),
            Verdict::Refuse
        );
    }

    #[test]
    fn ipv6_counts_per_64_and_mapped_ipv4_as_ipv4() {
        let limiter = FailureLimiter::new(limit(1, 100));
        let t0 = Instant::now();
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        assert_eq!(limiter.fail(a, t0), Verdict::Refuse);
        assert!(matches!(limiter.fail(b, t0), Verdict::TooMany { .. }));
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(limiter.fail(other, t0), Verdict::Refuse);
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
        assert_eq!(limiter.fail(mapped, t0), Verdict::Refuse);
        assert!(matches!(limiter.fail(v4(7), t0), Verdict::TooMany { .. }));
    }

    #[test]
    fn a_flood_from_many_sources_stays_within_the_bound() {
        let limiter = FailureLimiter::new(limit(3, 1000));
        let t0 = Instant::now();
        for i in 0..5_000u32 {
            let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
            limiter.fail(ip, t0 + Duration::from_micros(u64::from(i)));
            assert!(limiter.tracked() <= 1000);
        }
        assert!(limiter.tracked() > 900);
        // Ended windows go first when a new source needs the room.
        let later = t0 + Duration::from_secs(120);
        limiter.fail(v4(200), later);
        assert_eq!(limiter.tracked(), 1);
    }
}
