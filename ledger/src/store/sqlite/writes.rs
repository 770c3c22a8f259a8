//! Writes of attempts and of the counters that move with them.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use rusqlite::{params, params_from_iter, Connection, ToSql};

use super::group_tx::GroupTx;
use crate::error::LedgerError;
use crate::model::{Attempt, AttemptState};
use crate::store::counters::CounterMoves;
use crate::store::record::{sqlite_insert, sqlite_update, Written};
use crate::store::rows::{AttemptRow, ATTEMPT_TABLE};

/// `INSERT` of an attempt's inserted columns, `?1`… in table order.
static INSERT_SQL: LazyLock<String> = LazyLock::new(|| sqlite_insert("attempts", ATTEMPT_TABLE));

/// `UPDATE` of an attempt's updated columns by its id (`?1`).
static UPDATE_SQL: LazyLock<String> =
    LazyLock::new(|| sqlite_update("attempts", "id", ATTEMPT_TABLE));

/// The row's values for the columns `which` picks, in table order.
fn bound(row: &AttemptRow, which: fn(Written) -> bool) -> impl Iterator<Item = &dyn ToSql> {
    row.sqlite_values()
        .into_iter()
        .zip(ATTEMPT_TABLE)
        .filter(move |(_, c)| which(c.written))
        .map(|(v, _)| v)
}

pub(super) fn insert_attempt(tx: &Connection, a: &Attempt) -> Result<(), LedgerError> {
    let row = AttemptRow::of(a)?;
    tx.prepare_cached(&INSERT_SQL)?
        .execute(params_from_iter(bound(&row, Written::on_insert)))?;
    if let Some(kh) = a.key_hash.as_ref() {
        tx.prepare_cached(
            "INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) VALUES (?1, ?2, ?3) \
             ON CONFLICT (permit_id, key_hash) DO UPDATE SET attempt_id = excluded.attempt_id",
        )?
        .execute(params![a.permit_id, kh, a.id])?;
    }
    Ok(())
}

pub(super) fn update_attempt(tx: &Connection, a: &Attempt) -> Result<(), LedgerError> {
    let row = AttemptRow::of(a)?;
    let id: &dyn ToSql = &row.id;
    tx.prepare_cached(&UPDATE_SQL)?.execute(params_from_iter(
        std::iter::once(id).chain(bound(&row, Written::on_update)),
    ))?;
    Ok(())
}

/// Writes a group's summed counter moves ([`CounterMoves`]) just before it commits: each
/// counter row once, however many attempts of the group moved it.
pub(super) fn write_counters(conn: &Connection, moves: &CounterMoves) -> Result<(), LedgerError> {
    for (permit_id, tool, n) in moves.slot_rows() {
        conn.prepare_cached(
            "INSERT INTO permit_tool_usage (permit_id, tool, slots_held) VALUES (?1, ?2, ?3) \
             ON CONFLICT (permit_id, tool) DO UPDATE SET slots_held = slots_held + excluded.slots_held",
        )?
        .execute(params![permit_id, tool, n])?;
    }
    for (permit_id, reserved, spent) in moves.budget_rows() {
        conn.prepare_cached(
            "UPDATE permits SET reserved = reserved + ?2, spent = spent + ?3 WHERE id = ?1",
        )?
        .execute(params![permit_id, reserved, spent])?;
    }
    // This store counts attempts per state over all permits (one row per state).
    let mut per_state: BTreeMap<AttemptState, i64> = BTreeMap::new();
    for (_, state, n) in moves.state_rows() {
        *per_state.entry(state).or_default() += n;
    }
    for (state, n) in per_state.into_iter().filter(|(_, n)| *n != 0) {
        conn.prepare_cached(
            "INSERT INTO attempt_state_counts (state, n) VALUES (?1, ?2) \
             ON CONFLICT (state) DO UPDATE SET n = n + excluded.n",
        )?
        .execute(params![state.as_str(), n])?;
    }
    Ok(())
}

/// Writes an attempt (inserted when `old` is `None`) in the caller's group transaction and
/// adds what it moves to the operation's counter moves.
pub(super) fn write_attempt(
    tx: &GroupTx<'_>,
    old: Option<&Attempt>,
    new: &Attempt,
) -> Result<(), LedgerError> {
    match old {
        None => insert_attempt(tx, new)?,
        Some(_) => update_attempt(tx, new)?,
    }
    tx.record_move(old, new);
    Ok(())
}
