//! `/readyz` answered from a store check made in the background, never by the request: a
//! flood of probes costs the store nothing.
//!
//! One task reads the store every [`CHECK_INTERVAL`] (the same read `/readyz` used to make
//! per request) and keeps the result. `/readyz` answers 200 while the latest check succeeded
//! and finished less than [`MAX_AGE`] ago; a failed check, or none finished for that long (a
//! read hanging on an unreachable database), answers 503 `store_unavailable`. Each check is
//! counted in `atmost_readiness_checks_total{result}`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::metrics::Metrics;
use atmost_ledger::store::Store;

/// How often the store is checked.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// How old the latest successful check may be for `/readyz` to answer 200.
pub const MAX_AGE: Duration = Duration::from_secs(5);

/// The latest finished check.
#[derive(Debug, Default)]
pub struct Readiness {
    latest: Mutex<Option<(Instant, bool)>>,
}

impl Readiness {
    /// Whether the store was readable at the latest check, and that check is recent enough.
    pub fn store_ready(&self, now: Instant) -> bool {
        let latest = *self
            .latest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        matches!(latest, Some((at, true)) if now.saturating_duration_since(at) < MAX_AGE)
    }

    fn record(&self, at: Instant, ok: bool) {
        *self
            .latest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((at, ok));
    }
}

/// Reads the store once and keeps the result in `readiness`. Given the store and the
/// metrics rather than the ledger's state, which holds the answer: the check sits beneath it.
pub async fn check_once(readiness: &Readiness, store: &dyn Store, metrics: &Metrics) {
    let result = store.ping().await;
    let ok = result.is_ok();
    metrics
        .readiness_checks
        .with_label_values(&[if ok { "ok" } else { "error" }])
        .inc();
    if let Err(e) = result {
        metrics.store_errors.with_label_values(&["ping"]).inc();
        warn!(error = %e, "store not ready");
    }
    readiness.record(Instant::now(), ok);
}

/// Checks the store every [`CHECK_INTERVAL`] until the task is dropped.
pub fn spawn_checks(
    readiness: Arc<Readiness>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(CHECK_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            check_once(&readiness, &*store, &metrics).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_on_a_recent_successful_check() {
        let r = Readiness::default();
        let t0 = Instant::now();
        assert!(!r.store_ready(t0), "no check yet");
        r.record(t0, true);
        assert!(r.store_ready(t0 + Duration::from_secs(1)));
        assert!(!r.store_ready(t0 + MAX_AGE), "too old");
        r.record(t0, false);
        assert!(!r.store_ready(t0));
    }
}
