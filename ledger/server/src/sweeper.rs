//! The sweeper: expired leases, old receipts, the purge of ended permits, and the store's
//! gauges, on a timer beside the listeners.

use std::time::{Duration, Instant};

use tracing::{error, info};

use crate::state::{AppState, Shared};
use atmost_ledger::clock::Millis;
use atmost_ledger::error::LedgerError;
use atmost_ledger::store::purge::PURGE_PER_SWEEP;

/// Counts and logs a failed store operation of the sweeper (`op`: `sweep`, `purge`); the next
/// sweep tries again.
fn sweeper_failed(state: &AppState, op: &str, e: &LedgerError) {
    state.metrics.store_errors.with_label_values(&[op]).inc();
    error!(error = %e, op, "sweeper store operation failed");
}

/// One sweep: expired leases → uncertain, old receipts → tombstones, the history of permits
/// ended long enough ago purged.
pub async fn sweep_once(state: &AppState) {
    let now = state.clock.now_ms();
    state.metrics.sweeps.inc();
    match state.store.sweep(now).await {
        Ok(r) => {
            state.metrics.leases_expired.inc_by(r.leases_expired);
            state.metrics.approvals_expired.inc_by(r.approvals_expired);
            state.metrics.receipts_pruned.inc_by(r.receipts_pruned);
            if r.leases_expired > 0 || r.receipts_pruned > 0 {
                info!(
                    leases_expired = r.leases_expired,
                    receipts_pruned = r.receipts_pruned,
                    "sweep"
                );
            }
        }
        Err(e) => sweeper_failed(state, "sweep", &e),
    }
    if let Some(after) = state.config.purge_ended_permits_after {
        let after_ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
        match state
            .store
            .purge(now.saturating_sub(after_ms), PURGE_PER_SWEEP)
            .await
        {
            Ok(r) => {
                state.metrics.attempts_purged.inc_by(r.attempts_purged);
                state.metrics.permits_purged.inc_by(r.permits_purged);
                if r.attempts_purged > 0 || r.permits_purged > 0 {
                    info!(
                        attempts_purged = r.attempts_purged,
                        permits_purged = r.permits_purged,
                        "purge"
                    );
                }
            }
            Err(e) => sweeper_failed(state, "purge", &e),
        }
    }
}

/// How often, at most, a scrape of `/metrics` reads the store's gauges: however many
/// scrapers (or callers: `/metrics` needs no token), one read a second per replica.
const STORE_GAUGES_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Reads the gauges that come from the store (`atmost_attempts{state}`,
/// `atmost_uncertain_oldest_seconds`) when `/metrics` is scraped, instead of on every sweep.
/// Their reads grow with the store: on PostgreSQL the attempts per state are summed over one
/// row per permit and state, 28 ms at 10^5 permits. Read once a second whatever the load, that
/// was the largest cost PostgreSQL paid per call as permits piled up (docs/performance.md);
/// read when scraped it costs nothing when nobody scrapes, and one read per scrape interval
/// when Prometheus does. A scrape that finds the store failing serves the values last read
/// and counts `atmost_store_errors_total{op}`.
pub(crate) async fn refresh_store_gauges(state: &AppState) {
    let mut read_at = state.store_gauges_read_at.lock().await;
    if read_at.is_some_and(|at| at.elapsed() < STORE_GAUGES_MIN_INTERVAL) {
        return;
    }
    *read_at = Some(Instant::now());
    read_store_gauges(state).await;
}

/// Reads the store's gauges now (see [`refresh_store_gauges`], which calls it).
pub async fn read_store_gauges(state: &AppState) {
    let now = state.clock.now_ms();
    if let Some(counts) = state.store.one_statement_counts() {
        state.metrics.count_one_statement(counts);
    }
    match state.store.attempt_counts().await {
        Ok(counts) => {
            for (s, n) in counts {
                state
                    .metrics
                    .attempts
                    .with_label_values(&[s.as_str()])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
        Err(e) => {
            state
                .metrics
                .store_errors
                .with_label_values(&["attempt_counts"])
                .inc();
            error!(error = %e, "attempt counts failed");
        }
    }
    let oldest = state.store.oldest_uncertain().await;
    set_age(
        state,
        &state.metrics.uncertain_oldest_seconds,
        now,
        oldest,
        "oldest_uncertain",
    );
    let oldest = state
        .store
        .awaiting_approval()
        .await
        .map(|(_, oldest)| oldest);
    set_age(
        state,
        &state.metrics.approval_oldest_waiting_seconds,
        now,
        oldest,
        "awaiting_approval",
    );
}

/// Sets a gauge to the seconds since `since` (0 when there is none); a store that failed
/// leaves it as it was and is counted under `op`.
fn set_age(
    state: &AppState,
    gauge: &prometheus::Gauge,
    now: Millis,
    since: Result<Option<Millis>, LedgerError>,
    op: &str,
) {
    match since {
        Ok(since) => {
            let ms = since.map_or(0, |t| now.saturating_sub(t).max(0));
            gauge.set(ms as f64 / 1000.0);
        }
        Err(e) => {
            state.metrics.store_errors.with_label_values(&[op]).inc();
            error!(error = %e, op, "a gauge's age could not be read");
        }
    }
}

/// Runs the sweeper every `interval` until the task is dropped.
pub fn spawn_sweeper(state: Shared, interval: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            sweep_once(&state).await;
        }
    })
}
