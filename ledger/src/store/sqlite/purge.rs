//! The purge of ended permits (crate::store::purge) in the SQLite file: each batch one
//! operation of the writer, so decisions queue between batches.

use rusqlite::params;

use super::group_tx::GroupTx;
use super::placeholder;
use super::writes::write_counters;
use crate::clock::Millis;
use crate::error::LedgerError;
use crate::store::counters::CounterMoves;
use crate::store::purge::{Doomed, PurgeReport, PurgeSql, CANDIDATES_PER_READ};
use crate::store::snapshot::PendingMoves;

const SQL: PurgeSql = PurgeSql { param: placeholder };

/// One writer operation: up to `limit` attempts of the permits listed first (see
/// [`PurgeSql::candidates`]), and each permit once nothing is left under it.
pub(super) fn purge_batch(
    tx: &GroupTx<'_>,
    ended_before: Millis,
    limit: u32,
) -> Result<PurgeReport, LedgerError> {
    let listed: Vec<String> = tx
        .prepare_cached(&SQL.candidates())?
        .query_map(params![ended_before, CANDIDATES_PER_READ], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    let mut report = PurgeReport::default();
    for permit_id in listed {
        let left = u64::from(limit).saturating_sub(report.attempts_purged);
        if left == 0 {
            break;
        }
        report.absorb(purge_permit(tx, &permit_id, ended_before, left)?);
    }
    Ok(report)
}

fn purge_permit(
    tx: &GroupTx<'_>,
    permit_id: &str,
    ended_before: Millis,
    limit: u64,
) -> Result<PurgeReport, LedgerError> {
    let ended = tx
        .prepare_cached(&SQL.ended())?
        .query_map(params![permit_id, ended_before], |_| Ok(()))?
        .count();
    if ended == 0 {
        return Ok(PurgeReport::default());
    }
    let doomed: Vec<Doomed> = tx
        .prepare_cached(&SQL.batch())?
        .query_map(
            params![permit_id, i64::try_from(limit).unwrap_or(i64::MAX)],
            |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                ))
            },
        )?
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .map(Doomed::read)
        .collect::<Result<_, _>>()?;
    let mut moves = CounterMoves::default();
    for d in &doomed {
        // A key whose attempt gave its slot back may point at a newer attempt by now: only a
        // key that still points at a deleted attempt goes with it.
        if let Some(key_hash) = d.key_hash.as_deref() {
            tx.prepare_cached(
                "DELETE FROM idempotency_keys WHERE permit_id = ?1 AND key_hash = ?2 AND attempt_id = ?3",
            )?
            .execute(params![permit_id, key_hash, d.counted.id])?;
        }
        tx.prepare_cached("DELETE FROM attempts WHERE id = ?1")?
            .execute(params![d.counted.id])?;
        moves.record_removal(&d.counted);
    }
    // Written now, not with the group's moves at its commit: the permit's counter rows may
    // be deleted below, and a move written after that would bring one back.
    write_counters(tx, &moves)?;
    let mut report = PurgeReport {
        attempts_purged: doomed.len() as u64,
        permits_purged: 0,
    };
    let done = (doomed.len() as u64) < limit;
    let left = tx
        .prepare_cached(&SQL.anything_left())?
        .query_map(params![permit_id], |_| Ok(()))?
        .count();
    if done && left == 0 && !moved_earlier_in_group(tx, permit_id)? {
        for sql in [
            "DELETE FROM permit_tool_usage WHERE permit_id = ?1",
            "DELETE FROM permits WHERE id = ?1",
        ] {
            tx.prepare_cached(sql)?.execute(params![permit_id])?;
        }
        report.permits_purged = 1;
    }
    Ok(report)
}

/// Whether an earlier operation of this group moved the permit's counters (a late report
/// about one of its attempts): those moves are written at the commit, after this operation,
/// so the permit and its counter rows wait for the next purge.
fn moved_earlier_in_group(tx: &GroupTx<'_>, permit_id: &str) -> Result<bool, LedgerError> {
    if tx.budget(permit_id) != (0, 0) {
        return Ok(true);
    }
    let tools: Vec<String> = tx
        .prepare_cached("SELECT tool FROM permit_tool_usage WHERE permit_id = ?1")?
        .query_map(params![permit_id], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    Ok(tools.iter().any(|t| tx.slots(permit_id, t) != 0))
}
