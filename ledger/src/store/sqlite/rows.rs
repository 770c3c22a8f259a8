//! Rows: the column lists, their mapping to the model, and the reads of attempts and counters.

use std::collections::BTreeMap;

use rusqlite::{params, Connection, OptionalExtension, Row};

use super::{states, to_u64};
use crate::error::LedgerError;
use crate::model::{Attempt, AttemptState, BudgetTotals, Permit, Policy};
use crate::store::rows::{AttemptRow, ATTEMPT_COLS};
use crate::store::PermitCounters;

pub(super) const PERMIT_COLS: &str =
    "id, token_hash, label, created_at, expires_at, revoked_at, policy";

pub(super) fn read_permit(row: &Row<'_>) -> rusqlite::Result<(Permit, String)> {
    let policy_json: String = row.get(6)?;
    Ok((
        Permit {
            id: row.get(0)?,
            token_hash: row.get(1)?,
            label: row.get(2)?,
            created_at_ms: row.get(3)?,
            expires_at_ms: row.get(4)?,
            revoked_at_ms: row.get(5)?,
            policy: Policy {
                tools: Vec::new(),
                max_calls: BTreeMap::new(),
                max_calls_default: None,
                budget: None,
                cost: BTreeMap::new(),
                cost_default: 0,
                duplicate_guard: Default::default(),
                retention_ms: 0,
            },
        },
        policy_json,
    ))
}

pub(super) fn finish_permit((mut p, policy_json): (Permit, String)) -> Result<Permit, LedgerError> {
    p.policy = serde_json::from_str(&policy_json)?;
    Ok(p)
}

/// The columns of [`ATTEMPT_COLS`] as SQLite returns them.
pub(super) fn read_attempt(row: &Row<'_>) -> rusqlite::Result<AttemptRow> {
    Ok(AttemptRow {
        id: row.get(0)?,
        permit_id: row.get(1)?,
        tool: row.get(2)?,
        key_hash: row.get(3)?,
        fingerprint: row.get(4)?,
        cost: row.get(5)?,
        state: row.get(6)?,
        created_at: row.get(7)?,
        updated_at: row.get(8)?,
        lease_expires_at: row.get(9)?,
        finished_at: row.get(10)?,
        receipt: row.get(11)?,
        reason: row.get(12)?,
        replay_count: row.get(13)?,
        pruned_at: row.get(14)?,
        resolved_executed: row.get(15)?,
        resolved_by: row.get(16)?,
        resolved_at: row.get(17)?,
        resolution_note: row.get(18)?,
        round: row.get(19)?,
        capability_hash: row.get(20)?,
        resolution_source: row.get(21)?,
        provider_answer: row.get(22)?,
        forwarded_key: row.get(23)?,
        arguments: row.get(24)?,
    })
}

pub(super) fn load_permit(conn: &Connection, id: &str) -> Result<Option<Permit>, LedgerError> {
    let sql = format!("SELECT {PERMIT_COLS} FROM permits WHERE id = ?1");
    conn.prepare_cached(&sql)?
        .query_row(params![id], read_permit)
        .optional()?
        .map(finish_permit)
        .transpose()
}

pub(super) fn load_attempt(conn: &Connection, id: &str) -> Result<Option<Attempt>, LedgerError> {
    let sql = format!("SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.id = ?1");
    conn.prepare_cached(&sql)?
        .query_row(params![id], read_attempt)
        .optional()?
        .map(Attempt::try_from)
        .transpose()
}

pub(super) fn query_attempts(
    conn: &Connection,
    sql: &str,
    args: &[&dyn rusqlite::ToSql],
) -> Result<Vec<Attempt>, LedgerError> {
    let mut stmt = conn.prepare_cached(sql)?;
    let rows = stmt.query_map(args, read_attempt)?;
    let mut out = Vec::new();
    for r in rows {
        out.push(Attempt::try_from(r?)?);
    }
    Ok(out)
}

/// Slots held for one tool, as the counter stores them.
pub(super) fn slots_held(
    conn: &Connection,
    permit_id: &str,
    tool: &str,
) -> Result<i64, LedgerError> {
    let n: Option<i64> = conn
        .prepare_cached(
            "SELECT slots_held FROM permit_tool_usage WHERE permit_id = ?1 AND tool = ?2",
        )?
        .query_row(params![permit_id, tool], |r| r.get(0))
        .optional()?;
    Ok(n.unwrap_or(0))
}

/// (reserved, spent) budget, as the counters store them.
pub(super) fn budget_counters(
    conn: &Connection,
    permit_id: &str,
) -> Result<(i64, i64), LedgerError> {
    Ok(conn
        .prepare_cached("SELECT reserved, spent FROM permits WHERE id = ?1")?
        .query_row(params![permit_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?
        .unwrap_or((0, 0)))
}

/// Reserved and spent budget recounted from the attempts (`permit show`).
pub(super) fn budget_totals(
    conn: &Connection,
    permit_id: &str,
) -> Result<BudgetTotals, LedgerError> {
    let (reserved, spent): (i64, i64) = conn
        .prepare_cached(&format!(
            "SELECT COALESCE(SUM(CASE WHEN state IN {} THEN cost END), 0), \
                    COALESCE(SUM(CASE WHEN state IN {} THEN cost END), 0) \
             FROM attempts WHERE permit_id = ?1",
            states(AttemptState::reserves_budget),
            states(AttemptState::spends_budget)
        ))?
        .query_row(params![permit_id], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(BudgetTotals {
        spent: to_u64(spent),
        reserved: to_u64(reserved),
    })
}

/// The counters of one permit as stored (for the conformance suite's recount check).
pub(super) fn read_counters(
    conn: &Connection,
    id: &str,
) -> Result<Option<PermitCounters>, LedgerError> {
    if load_permit(conn, id)?.is_none() {
        return Ok(None);
    }
    let mut usage = BTreeMap::new();
    let mut stmt =
        conn.prepare_cached("SELECT tool, slots_held FROM permit_tool_usage WHERE permit_id = ?1")?;
    let rows = stmt.query_map(params![id], |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))
    })?;
    for r in rows {
        let (tool, n) = r?;
        usage.insert(tool, n);
    }
    let (reserved, spent): (i64, i64) = conn
        .prepare_cached("SELECT reserved, spent FROM permits WHERE id = ?1")?
        .query_row(params![id], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(Some(PermitCounters {
        slots_held: usage,
        reserved,
        spent,
    }))
}
