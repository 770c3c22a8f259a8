//! The PostgreSQL sweep: what the lease sweeper and the receipt pruner read, and their pass
//! over the permits with work due.

use super::errors::{column_err, pg_err};
use super::rows::{query, query_attempts};
use super::writes::{write_attempt, write_counters};
use super::PgStore;
use crate::clock::Millis;
use crate::decide;
use crate::error::LedgerError;
use crate::model::AttemptState;
use crate::store::counters::CounterMoves;
use crate::store::rows::ATTEMPT_COLS;
use crate::store::SweepReport;

impl PgStore {
    /// The sweep: expired leases and approvals, then receipts past retention. Safe with every
    /// replica sweeping at once: each permit is swept in its own transaction under its row
    /// lock, and each row is re-read under that lock and passed through the pure transition
    /// again, so a row another replica already moved is left alone (and not counted).
    pub(super) async fn sweep_permits(&self, now: Millis) -> Result<SweepReport, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let mut report = SweepReport::default();
            // Nothing finished after `now - shortest retention` can be due, so the prunable
            // index is read up to there only (the same bound as in the SQLite store).
            let shortest: Option<i64> = query(&*c, SHORTEST_RETENTION_SQL, &[])
                .await?
                .first()
                .map(|r| r.try_get(0))
                .transpose()
                .map_err(column_err)?
                .flatten();
            let before = now.saturating_sub(shortest.unwrap_or(0).max(0));
            let sql = due_permits_sql();
            let permits: Vec<String> = self
                .long_read(&*c, query(&*c, &sql, &[&now, &before]))
            .await?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(column_err)?;
            for permit_id in permits {
                let tx = c.transaction().await.map_err(pg_err)?;
                let locked = query(
                    &tx,
                    "SELECT retention_ms FROM permits WHERE id = $1 FOR UPDATE",
                    &[&permit_id],
                )
                .await?;
                let Some(row) = locked.first() else {
                    continue;
                };
                let retention: i64 = row.try_get(0).map_err(column_err)?;
                let mut moves = CounterMoves::default();
                let sql = format!(
                    "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.state IN {} \
                     AND a.lease_expires_at <= $2 AND a.permit_id = $1",
                    AttemptState::sql_list(AttemptState::leased)
                );
                for a in query_attempts(&tx, &sql, &[&permit_id, &now]).await? {
                    if let Some(next) = decide::expire_lease(&a, now) {
                        write_attempt(&tx, &a, &next, &mut moves).await?;
                        report.count_expiry(&next);
                    }
                }
                let sql = format!(
                    "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.pruned_at IS NULL AND a.state IN {} \
                     AND COALESCE(a.finished_at, a.updated_at) <= $2 AND a.permit_id = $1",
                    AttemptState::sql_list(AttemptState::replays)
                );
                let due = now.saturating_sub(retention);
                for a in query_attempts(&tx, &sql, &[&permit_id, &due]).await? {
                    if let Some(next) = decide::prune(&a, retention, now) {
                        write_attempt(&tx, &a, &next, &mut moves).await?;
                        report.receipts_pruned += 1;
                    }
                }
                write_counters(&tx, &moves).await?;
                tx.commit().await.map_err(pg_err)?;
            }
            Ok(report)
        })
        .await
    }
}

/// The shortest retention of any permit: the bound of the sweep's read of the prunable index,
/// from one end of `permits_by_retention` (schema version 10) however many permits there are.
pub(super) const SHORTEST_RETENTION_SQL: &str = "SELECT MIN(retention_ms) FROM permits";

/// The permits the sweep has work under: a lease run out (`$1`: now), or a receipt past its
/// permit's retention (`$2`: now minus the shortest retention of any permit, the bound of
/// the index read).
///
/// The due receipts are read through `attempts_prunable` and each one's permit looked up by
/// its key, however large the tables. PostgreSQL keeps no statistics on the expression of a
/// partial index, so it guesses that an upper bound alone keeps a third of the rows and reads
/// the whole table (and every permit, for a hash join): 334 ms a sweep at 10^6 attempts and
/// 10^5 permits, once a second. A range (the times are positive, so its lower bound drops
/// nothing) is guessed at 0.5 %, which the index serves; the permit's row is taken by a
/// LATERAL `LIMIT 1` probe, which the planner never turns into a join.
pub(super) fn due_permits_sql() -> String {
    format!(
        "SELECT permit_id FROM attempts WHERE state IN {leased} AND lease_expires_at <= $1 \
         UNION \
         SELECT a.permit_id FROM attempts a \
         CROSS JOIN LATERAL (SELECT r.retention_ms FROM permits r WHERE r.id = a.permit_id LIMIT 1) p \
         WHERE a.pruned_at IS NULL AND a.state IN {replays} \
         AND COALESCE(a.finished_at, a.updated_at) >= 0 \
         AND COALESCE(a.finished_at, a.updated_at) <= $2 \
         AND COALESCE(a.finished_at, a.updated_at) + p.retention_ms <= $1 \
         ORDER BY 1",
        leased = AttemptState::sql_list(AttemptState::leased),
        replays = AttemptState::sql_list(AttemptState::replays),
    )
}
