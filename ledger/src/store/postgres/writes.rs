//! Writes of attempts and of the counters that move with them, one statement per kind.

use std::sync::LazyLock;

use deadpool_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::rows::{exec, prepared};
use super::{column_err, pg_err};
use crate::error::LedgerError;
use crate::model::Attempt;
use crate::store::counters::CounterMoves;
use crate::store::record::{pg_insert, pg_upsert, Written};
use crate::store::rows::{AttemptRow, ATTEMPT_TABLE};

/// Inserts the attempts (their inserted columns, one array each, in table order) and points
/// their keys at them.
static INSERT_ATTEMPTS_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ins AS ({} RETURNING id, permit_id, key_hash) \
         INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) \
         SELECT permit_id, key_hash, id FROM ins WHERE key_hash IS NOT NULL \
         ON CONFLICT (permit_id, key_hash) DO UPDATE SET attempt_id = excluded.attempt_id",
        pg_insert("attempts", ATTEMPT_TABLE)
    )
});

/// Every column of the attempts, one array each in table order; on the conflict every such
/// write has (see [`update_attempts`]) the updated columns are set.
static UPSERT_ATTEMPTS_SQL: LazyLock<String> =
    LazyLock::new(|| pg_upsert("attempts", "id", ATTEMPT_TABLE));

/// Each row as it was left, with the version the database gave it (schema 13: a trigger
/// moves it on every raise), which the one-statement decisions keep (see `one_statement`).
const ADD_SLOTS_SQL: &str = "INSERT INTO permit_tool_usage (permit_id, tool, slots_held) \
             SELECT * FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[]) \
             ON CONFLICT (permit_id, tool) DO UPDATE SET slots_held = permit_tool_usage.slots_held + excluded.slots_held \
             RETURNING permit_id, tool, slots_held, version";

/// A tool's slot counter as a write left it: permit, tool, slots held and its version.
pub(super) type SlotCounter = (String, String, i64, i64);

/// `p.id = ANY($1)` gives the planner an index condition on `permits`: without it, a generic
/// plan cached while the table was small joins the unnested rows to a sequential scan of every
/// permit, for as long as the connection lives (`EXPLAIN` of the cached plan showed
/// `Seq Scan on permits`; with it, `Bitmap Index Scan on permits_pkey`).
const ADD_BUDGET_SQL: &str =
    "UPDATE permits p SET reserved = p.reserved + m.r, spent = p.spent + m.s \
                 FROM unnest($1::TEXT[], $2::BIGINT[], $3::BIGINT[]) AS m(id, r, s) \
                 WHERE p.id = m.id AND p.id = ANY($1)";

const ADD_STATE_COUNTS_SQL: &str = "INSERT INTO permit_state_counts (permit_id, state, n) \
             SELECT * FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[]) \
             ON CONFLICT (permit_id, state) DO UPDATE SET n = permit_state_counts.n + excluded.n";

/// Prepares every write statement on this connection (from its cache after the first time).
/// A group sends its writes and `COMMIT` in one flight, and a write's request leaves at its
/// first poll only when its statement is already prepared: one still to be prepared would
/// wait for that round trip while `COMMIT` went ahead, and run after it, outside the
/// transaction. So the group workers call this before their first flight.
pub(super) async fn prepare_writes<C: GenericClient>(c: &C) -> Result<(), LedgerError> {
    for sql in [
        INSERT_ATTEMPTS_SQL.as_str(),
        UPSERT_ATTEMPTS_SQL.as_str(),
        ADD_SLOTS_SQL,
        ADD_BUDGET_SQL,
        ADD_STATE_COUNTS_SQL,
    ] {
        prepared(c, sql).await?;
    }
    Ok(())
}

/// Inserts attempts and points their keys at them in ONE statement (one round trip under the
/// lock, however many). No two of them may have the same key.
pub(super) async fn insert_attempts<C: GenericClient>(
    c: &C,
    attempts: &[Attempt],
) -> Result<(), LedgerError> {
    if attempts.is_empty() {
        return Ok(());
    }
    let rows = rows_of(attempts)?;
    let arrays = AttemptRow::pg_arrays(&rows);
    let params = arrays_of(&arrays, Written::on_insert);
    exec(c, &INSERT_ATTEMPTS_SQL, &params).await?;
    Ok(())
}

/// Writes the new versions of attempts in ONE statement (one round trip, however many). No
/// two of them may be the same attempt (PostgreSQL refuses an upsert that changes a row twice).
///
/// Written as an upsert on the primary key although every attempt written here exists (it
/// was read under its permit's row lock): `ON CONFLICT (id)` finds each row by a probe of
/// the primary key index whatever the plan. The `UPDATE … FROM unnest(…)` it replaces joins
/// the arrays to the table, and its generic plan (the group transactions force generic
/// plans, see `group_tx`) is chosen once per connection on the statistics of that moment: on
/// a table created or grown since its last ANALYZE that was a sequential scan of `attempts`
/// on every write, its cost growing with the table (docs/postgresql.md has the numbers).
/// Only the columns an attempt's transitions change are set on conflict; the others are
/// sent because an INSERT needs them (NOT NULL) and are ignored.
pub(super) async fn update_attempts<C: GenericClient>(
    c: &C,
    attempts: &[Attempt],
) -> Result<(), LedgerError> {
    if attempts.is_empty() {
        return Ok(());
    }
    let rows = rows_of(attempts)?;
    let arrays = AttemptRow::pg_arrays(&rows);
    let params: Vec<&(dyn ToSql + Sync)> = arrays
        .iter()
        .map(|a| a.as_ref() as &(dyn ToSql + Sync))
        .collect();
    exec(c, &UPSERT_ATTEMPTS_SQL, &params).await?;
    Ok(())
}

/// The arrays of the columns `keep` picks, in table order, as statement parameters.
pub(super) fn arrays_of<'a>(
    arrays: &'a [Box<dyn ToSql + Send + Sync + 'a>],
    keep: impl Fn(Written) -> bool,
) -> Vec<&'a (dyn ToSql + Sync)> {
    arrays
        .iter()
        .zip(ATTEMPT_TABLE)
        .filter(|(_, c)| keep(c.written))
        .map(|(a, _)| a.as_ref() as &(dyn ToSql + Sync))
        .collect()
}

/// The rows the attempts are written as; refused whole if one cannot be stored.
fn rows_of(attempts: &[Attempt]) -> Result<Vec<AttemptRow>, LedgerError> {
    attempts.iter().map(AttemptRow::of).collect()
}

/// Writes the counter moves a transaction summed ([`CounterMoves`]), in the caller's
/// transaction (which holds the row locks of the permits involved), just before it commits:
/// each counter row once, however many attempts moved it. The statements are sent together
/// (pipelined; the server runs them in order). Returns the tool slot counters as written.
pub(super) async fn write_counters<C: GenericClient>(
    c: &C,
    moves: &CounterMoves,
) -> Result<Vec<SlotCounter>, LedgerError> {
    let (mut sp, mut st, mut sn) = (Vec::new(), Vec::new(), Vec::new());
    for (p, t, n) in moves.slot_rows() {
        sp.push(p);
        st.push(t);
        sn.push(n);
    }
    let (mut bp, mut br, mut bs) = (Vec::new(), Vec::new(), Vec::new());
    for (p, r, s) in moves.budget_rows() {
        bp.push(p);
        br.push(r);
        bs.push(s);
    }
    let (mut cp, mut cs, mut cn) = (Vec::new(), Vec::new(), Vec::new());
    for (p, s, n) in moves.state_rows() {
        cp.push(p);
        cs.push(s.as_str());
        cn.push(n);
    }
    let (slots, budget, states) = tokio::join!(
        biased;
        async {
            if sp.is_empty() {
                return Ok(Vec::new());
            }
            let statement = prepared(c, ADD_SLOTS_SQL).await?;
            let rows = c.query(&statement, &[&sp, &st, &sn]).await.map_err(pg_err)?;
            rows.iter()
                .map(|r| {
                    Ok((
                        r.try_get(0).map_err(column_err)?,
                        r.try_get(1).map_err(column_err)?,
                        r.try_get(2).map_err(column_err)?,
                        r.try_get(3).map_err(column_err)?,
                    ))
                })
                .collect::<Result<Vec<SlotCounter>, LedgerError>>()
        },
        async {
            if bp.is_empty() {
                return Ok(0);
            }
            exec(
                c,
                ADD_BUDGET_SQL,
                &[&bp, &br, &bs],
            )
            .await
        },
        add_to_rows(
            c,
            ADD_STATE_COUNTS_SQL,
            (&cp, &cs, &cn),
        )
    );
    let slots = slots?;
    budget?;
    states?;
    Ok(slots)
}

/// Adds to counter rows keyed by two texts (created at the amount when missing); nothing is
/// sent when there is nothing to add.
pub(super) async fn add_to_rows<C: GenericClient>(
    c: &C,
    upsert: &str,
    (first, second, amounts): (&Vec<&str>, &Vec<&str>, &Vec<i64>),
) -> Result<u64, LedgerError> {
    if first.is_empty() {
        return Ok(0);
    }
    exec(c, upsert, &[first, second, amounts]).await
}

/// Writes a new version of an attempt in the caller's transaction (which holds the permit's
/// row lock) and adds what it moves to `moves`, which the transaction writes with
/// [`write_counters`] before it commits.
pub(super) async fn write_attempt<C: GenericClient>(
    c: &C,
    old: &Attempt,
    new: &Attempt,
    moves: &mut CounterMoves,
) -> Result<(), LedgerError> {
    // Checked before anything is sent, so a value that cannot be stored leaves no half write.
    storable(new)?;
    update_attempts(c, std::slice::from_ref(new)).await?;
    moves.record(Some(old), new);
    Ok(())
}

/// A value the attempts table cannot hold is refused before anything is sent.
pub(super) fn storable(a: &Attempt) -> Result<(), LedgerError> {
    AttemptRow::of(a).map(drop)
}
