//! One statement per lone outcome report: the report applied to the attempt as this replica
//! last wrote it, and written only where the stored attempt is still that one.
//!
//! The replica that decided a call usually receives its report too. It keeps the attempts it
//! wrote ([`LastSeen::attempt`]), applies the report with the same `apply_outcome`, and, when
//! that moves the attempt, sends one statement that locks the permit's row (the order every
//! other writer locks in), updates the attempt only where every column a transition changes
//! still holds what this replica wrote (a compare-and-set: another replica's report, a replay,
//! the sweeper or a person moved it otherwise), and moves the counters with it. It commits
//! with `synchronous_commit` off for that transaction alone, as a group of reports does
//! (docs/design.md#the-ledgers-hot-path). A report the copy cannot answer (no copy, or the
//! report moves nothing: an acknowledgement must come from what is stored), and a statement
//! that did not apply, go to the locked path.

use std::sync::LazyLock;
use std::time::Duration;

use atmost_protocol::{OutcomeAck, OutcomeReport};
use deadpool_postgres::Pool;
use tokio_postgres::types::ToSql;

use super::one_statement::{on_pooled, LastSeen};
use super::writes::{arrays_of, storable};
use crate::clock::Millis;
use crate::decide;
use crate::error::LedgerError;
use crate::model::Attempt;
use crate::store::counters::CounterMoves;
use crate::store::record::{names, pg_unnest, updated, Written};
use crate::store::rows::{AttemptRow, ATTEMPT_TABLE};
use crate::store::OutcomeResult;

/// `n.c1, n.c2, …` over the updated columns, as `alias.column`.
fn aliased(alias: &str) -> String {
    updated(ATTEMPT_TABLE)
        .map(|c| format!("{alias}.{}", c.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `unnest($k::T[], …) AS alias(c1, …)` over the updated columns, the first array `$from`.
fn unnest_as(alias: &str, from: usize) -> String {
    format!(
        "{} AS {alias}({})",
        pg_unnest(updated(ATTEMPT_TABLE), from),
        names(updated(ATTEMPT_TABLE))
    )
}

/// The statement: `$1…$n` the attempt's updated columns as written before (one single-element
/// array each), `$n+1…$2n` the same columns as the report leaves them, then the checks and the
/// counters' moves.
static REPORT_SQL: LazyLock<String> = LazyLock::new(|| {
    let n = updated(ATTEMPT_TABLE).count();
    let p = |i: usize| format!("${}", 2 * n + i);
    let (id, permit, tool, slots, reserved, spent, states, moved) =
        (p(1), p(2), p(3), p(4), p(5), p(6), p(7), p(8));
    let sets = updated(ATTEMPT_TABLE)
        .map(|c| format!("{0} = n.{0}", c.name))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "WITH sc AS (SELECT set_config('synchronous_commit', 'off', true)), \
         lp AS (SELECT 1 FROM permits p WHERE p.id = {permit} FOR UPDATE), \
         x AS (UPDATE attempts x SET {sets} FROM {old}, {new} \
           WHERE x.id = {id} AND ROW({stored}) IS NOT DISTINCT FROM ROW({written}) \
           AND EXISTS (SELECT 1 FROM lp) RETURNING x.id), \
         u AS (UPDATE permit_tool_usage t SET slots_held = t.slots_held + {slots} \
           WHERE t.permit_id = {permit} AND t.tool = {tool} AND {slots}::BIGINT <> 0 \
           AND EXISTS (SELECT 1 FROM x)), \
         b AS (UPDATE permits p SET reserved = p.reserved + {reserved}, spent = p.spent + {spent} \
           WHERE p.id = {permit} AND ({reserved}::BIGINT <> 0 OR {spent}::BIGINT <> 0) \
           AND EXISTS (SELECT 1 FROM x)), \
         c AS (INSERT INTO permit_state_counts (permit_id, state, n) \
           SELECT {permit}, m.state, m.n FROM unnest({states}::TEXT[], {moved}::BIGINT[]) AS m(state, n) \
           WHERE EXISTS (SELECT 1 FROM x) \
           ON CONFLICT (permit_id, state) DO UPDATE SET n = permit_state_counts.n + excluded.n) \
         SELECT (SELECT count(*) FROM x), (SELECT count(*) FROM sc)",
        old = unnest_as("o", 1),
        new = unnest_as("n", n + 1),
        stored = aliased("x"),
        written = aliased("o"),
    )
});

/// Applies a lone report by one statement when this replica wrote its attempt last (module
/// docs): `None` when the locked path must apply it.
pub(super) async fn try_report(
    pool: &Pool,
    seen: &LastSeen,
    report: &OutcomeReport,
    now: Millis,
    limit: Duration,
) -> Option<OutcomeResult> {
    let old = seen.attempt(&report.attempt_id)?;
    let (ack, next) = decide::apply_outcome(Some(&old), report, now);
    let next = next?;
    if ack != OutcomeAck::Applied || storable(&next).is_err() {
        return None;
    }
    seen.reports.sent();
    let sent = send(pool, &old, &next, limit).await;
    if let Ok(true) = sent {
        let previous = Some(old.state);
        seen.remember_attempts([next]);
        return Some(OutcomeResult { ack, previous });
    }
    seen.reports.not_applied();
    if let Err(e) = &sent {
        seen.forget_after(e);
    }
    seen.forget_attempt(&report.attempt_id);
    None
}

/// Sends the statement within `limit`: whether it applied. A connection cut off
/// mid-statement is closed, not pooled.
async fn send(
    pool: &Pool,
    old: &Attempt,
    next: &Attempt,
    limit: Duration,
) -> Result<bool, LedgerError> {
    let (old_row, next_row) = (AttemptRow::of(old)?, AttemptRow::of(next)?);
    let old_arrays = AttemptRow::pg_arrays(std::slice::from_ref(&old_row));
    let next_arrays = AttemptRow::pg_arrays(std::slice::from_ref(&next_row));
    let mut moves = CounterMoves::default();
    moves.record(Some(old), next);
    let slots = moves.slots(&next.permit_id, &next.tool);
    let (reserved, spent) = moves.budget(&next.permit_id);
    let (states, moved): (Vec<&str>, Vec<i64>) = moves
        .state_rows()
        .map(|(_, state, n)| (state.as_str(), n))
        .unzip();
    let mut params = arrays_of(&old_arrays, Written::on_update);
    params.extend(arrays_of(&next_arrays, Written::on_update));
    params.extend([
        &next.id as &(dyn ToSql + Sync),
        &next.permit_id,
        &next.tool,
        &slots,
        &reserved,
        &spent,
        &states,
        &moved,
    ]);
    let rows = on_pooled(pool, limit, &REPORT_SQL, &params).await?;
    let row = rows
        .first()
        .ok_or_else(|| LedgerError::Invariant("the report's statement returned no row".into()))?;
    let applied: i64 = row.try_get(0).map_err(super::column_err)?;
    Ok(applied == 1)
}
