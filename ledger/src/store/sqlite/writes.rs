//! Writes of attempts and of the counters that move with them.

use std::collections::BTreeMap;

use rusqlite::{params, Connection};

use super::group_tx::GroupTx;
use super::to_i64;
use crate::error::LedgerError;
use crate::model::{Attempt, AttemptState};
use crate::store::counters::CounterMoves;
use crate::store::rows::carriers_column;

pub(super) fn insert_attempt(tx: &Connection, a: &Attempt) -> Result<(), LedgerError> {
    tx.prepare_cached(
        "INSERT INTO attempts (id, permit_id, tool, key_hash, fingerprint, cost, state, created_at, updated_at, \
         lease_expires_at, finished_at, receipt, reason, replay_count, pruned_at, round, capability_hash, \
         forwarded_key, arguments, forwarded_key_carriers, dispatch_body_sha256, credential) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, \
         ?22)",
    )?
    .execute(params![
        a.id,
        a.permit_id,
        a.tool,
        a.key_hash,
        a.fingerprint,
        to_i64(a.cost)?,
        a.state.as_str(),
        a.created_at_ms,
        a.updated_at_ms,
        a.lease_expires_at_ms,
        a.finished_at_ms,
        a.receipt,
        a.reason,
        to_i64(a.replay_count)?,
        a.pruned_at_ms,
        a.round,
        a.capability_hash,
        a.forwarded_key,
        a.arguments,
        carriers_column(a.forwarded_key_carriers),
        a.dispatch_body_sha256,
        a.credential.as_ref().map(|c| c.to_column()),
    ])?;
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
    let r = a.resolution.as_ref();
    tx.prepare_cached(
        "UPDATE attempts SET state = ?2, updated_at = ?3, lease_expires_at = ?4, finished_at = ?5, receipt = ?6, \
         reason = ?7, replay_count = ?8, pruned_at = ?9, resolved_executed = ?10, resolved_by = ?11, \
         resolved_at = ?12, resolution_note = ?13, round = ?14, capability_hash = ?15, \
         resolution_source = ?16, provider_answer = ?17, forwarded_key = ?18, arguments = ?19, \
         forwarded_key_carriers = ?20, dispatch_body_sha256 = ?21 WHERE id = ?1",
    )?
    .execute(params![
        a.id,
        a.state.as_str(),
        a.updated_at_ms,
        a.lease_expires_at_ms,
        a.finished_at_ms,
        a.receipt,
        a.reason,
        to_i64(a.replay_count)?,
        a.pruned_at_ms,
        r.map(|r| r.executed),
        r.map(|r| r.by.as_str()),
        r.map(|r| r.at_ms),
        r.and_then(|r| r.note.as_deref()),
        a.round,
        a.capability_hash,
        r.map(|r| r.source.as_str()),
        r.and_then(|r| r.source.provider_answer()),
        a.forwarded_key,
        a.arguments,
        carriers_column(a.forwarded_key_carriers),
        a.dispatch_body_sha256,
    ])?;
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
