//! What a queued authorize or outcome operation reads and writes in its group transaction.

use atmost_protocol::{AuthorizeRequest, OutcomeReport};

use super::rows::{budget_counters, load_attempt, load_permit, query_attempts, tool_usage};
use super::writer::GroupTx;
use super::writes::write_attempt;
use super::{states, to_u64};
use crate::clock::Millis;
use crate::decide::{self, Snapshot};
use crate::error::LedgerError;
use crate::model::{AttemptState, BudgetTotals, ToolUsage};
use crate::store::rows::ATTEMPT_COLS;
use crate::store::OutcomeResult;
use crate::token;

pub(super) fn load_snapshot(
    conn: &GroupTx<'_>,
    req: &AuthorizeRequest,
    key_hash: Option<&str>,
    now: Millis,
) -> Result<Snapshot, LedgerError> {
    let mut snap = Snapshot {
        now_ms: now,
        ..Snapshot::default()
    };
    let Some(permit_id) = token::permit_id_of(&req.permit_token) else {
        return Ok(snap);
    };
    let Some(permit) = load_permit(conn, permit_id)? else {
        return Ok(snap);
    };
    // Nothing else is read for a token that does not authenticate.
    if decide::authenticate(&req.permit_token, Some(&permit)).is_none() {
        snap.permit = Some(permit);
        return Ok(snap);
    }
    if let Some(kh) = key_hash {
        let sql = format!(
            "SELECT {ATTEMPT_COLS} FROM idempotency_keys k JOIN attempts a ON a.id = k.attempt_id \
             WHERE k.permit_id = ?1 AND k.key_hash = ?2"
        );
        snap.existing = query_attempts(conn, &sql, &[&permit.id, &kh])?
            .into_iter()
            .next();
    }
    let reads = decide::reads_needed(req, &permit, snap.existing.as_ref());
    // What is stored plus what the group moved and has not written yet.
    let add = |n: u64, by: i64| to_u64(i64::try_from(n).unwrap_or(i64::MAX).saturating_add(by));
    if reads.usage {
        let stored = tool_usage(conn, &permit.id, &req.tool)?;
        snap.usage = ToolUsage {
            calls_made: add(stored.calls_made, conn.pending_slots(&permit.id, &req.tool)),
        };
    }
    if reads.budget {
        let stored = budget_counters(conn, &permit.id)?;
        let (reserved, spent) = conn.pending_budget(&permit.id);
        snap.budget = BudgetTotals {
            reserved: add(stored.reserved, reserved),
            spent: add(stored.spent, spent),
        };
    }
    if reads.duplicate {
        let since = now.saturating_sub(permit.policy.retention_ms);
        let sql = format!(
            "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.permit_id = ?1 AND a.fingerprint = ?2 \
             AND a.state NOT IN {} AND a.created_at >= ?3 \
             AND (?4 IS NULL OR a.key_hash IS NULL OR a.key_hash <> ?4) \
             ORDER BY a.created_at DESC LIMIT 1",
            states(AttemptState::gave_back)
        );
        snap.recent_duplicate = query_attempts(
            conn,
            &sql,
            &[&permit.id, &req.fingerprint, &since, &key_hash],
        )?
        .into_iter()
        .next();
    }
    snap.permit = Some(permit);
    Ok(snap)
}

/// Applies one outcome report in the caller's transaction.
pub(super) fn apply_report(
    tx: &GroupTx<'_>,
    report: &OutcomeReport,
    now: Millis,
) -> Result<OutcomeResult, LedgerError> {
    let existing = load_attempt(tx, &report.attempt_id)?;
    let (ack, next) = decide::apply_outcome(existing.as_ref(), report, now);
    if let (Some(old), Some(a)) = (existing.as_ref(), next.as_ref()) {
        write_attempt(tx, Some(old), a)?;
    }
    Ok(OutcomeResult {
        ack,
        previous: existing.map(|a| a.state),
    })
}
