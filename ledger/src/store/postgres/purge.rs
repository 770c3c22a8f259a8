//! The purge of ended permits (crate::store::purge) on PostgreSQL: each batch one transaction
//! under the permit's row lock, like every other write of the permit's attempts.

use deadpool_postgres::GenericClient;

use super::column_err;
use super::reads::placeholder;
use super::rows::{exec, query};
use super::writes::write_counters;
use crate::clock::Millis;
use crate::error::LedgerError;
use crate::store::counters::CounterMoves;
use crate::store::purge::{Doomed, PurgeReport, PurgeSql};

pub(super) const SQL: PurgeSql = PurgeSql { param: placeholder };

/// The permits the purge may work on next (see [`PurgeSql::candidates`]).
pub(super) async fn candidates<C: GenericClient>(
    c: &C,
    ended_before: Millis,
    limit: u32,
) -> Result<Vec<String>, LedgerError> {
    query(c, &SQL.candidates(), &[&ended_before, &i64::from(limit)])
        .await?
        .iter()
        .map(|r| r.try_get(0))
        .collect::<Result<_, _>>()
        .map_err(column_err)
}

/// One batch of at most `limit` attempts of one permit, in the caller's transaction: the
/// permit's row lock first (taken only while it has ended), then its settled attempts and
/// their keys, the counters they moved, and the permit itself once nothing is left. `true`
/// with the report when the permit has nothing more to purge.
pub(super) async fn purge_batch<C: GenericClient>(
    tx: &C,
    permit_id: &str,
    ended_before: Millis,
    limit: u32,
) -> Result<(PurgeReport, bool), LedgerError> {
    let locked = query(
        tx,
        &format!("{} FOR UPDATE", SQL.ended()),
        &[&permit_id, &ended_before],
    )
    .await?;
    if locked.is_empty() {
        // Gone (another replica purged it) or not ended: nothing to do.
        return Ok((PurgeReport::default(), true));
    }
    let doomed: Vec<Doomed> = query(tx, &SQL.batch(), &[&permit_id, &i64::from(limit)])
        .await?
        .iter()
        .map(|r| {
            let row = (
                r.try_get(0)?,
                r.try_get(1)?,
                r.try_get(2)?,
                r.try_get(3)?,
                r.try_get(4)?,
                r.try_get(5)?,
            );
            Ok(row)
        })
        .collect::<Result<Vec<_>, tokio_postgres::Error>>()
        .map_err(column_err)?
        .into_iter()
        .map(Doomed::read)
        .collect::<Result<_, _>>()?;
    let mut report = PurgeReport::default();
    if !doomed.is_empty() {
        let ids: Vec<&str> = doomed.iter().map(|d| d.counted.id.as_str()).collect();
        let (key_hashes, key_attempts): (Vec<&str>, Vec<&str>) = doomed
            .iter()
            .filter_map(|d| Some((d.key_hash.as_deref()?, d.counted.id.as_str())))
            .unzip();
        // A key whose attempt gave its slot back may point at a newer attempt by now: only a
        // key that still points at a deleted attempt goes with it.
        exec(
            tx,
            "DELETE FROM idempotency_keys k USING unnest($2::TEXT[], $3::TEXT[]) AS g(key_hash, attempt_id) \
             WHERE k.permit_id = $1 AND k.key_hash = g.key_hash AND k.attempt_id = g.attempt_id",
            &[&permit_id, &key_hashes, &key_attempts],
        )
        .await?;
        exec(tx, "DELETE FROM attempts WHERE id = ANY($1)", &[&ids]).await?;
        let mut moves = CounterMoves::default();
        for d in &doomed {
            moves.record_removal(&d.counted);
        }
        write_counters(tx, &moves).await?;
        report.attempts_purged = doomed.len() as u64;
    }
    let done = doomed.len() < limit as usize;
    if done
        && query(tx, &SQL.anything_left(), &[&permit_id])
            .await?
            .is_empty()
    {
        for sql in [
            "DELETE FROM permit_tool_usage WHERE permit_id = $1",
            "DELETE FROM permit_state_counts WHERE permit_id = $1",
            "DELETE FROM permits WHERE id = $1",
        ] {
            exec(tx, sql, &[&permit_id]).await?;
        }
        report.permits_purged = 1;
    }
    Ok((report, done))
}
