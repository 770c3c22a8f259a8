//! What a queued authorize or outcome operation reads and writes in its group transaction.

use std::sync::LazyLock;

use atmost_protocol::{AuthorizeRequest, OutcomeReport};

use super::group_tx::GroupTx;
use super::rows::{budget_counters, load_attempt, load_permit, query_attempts, slots_held};
use super::states;
use super::writes::write_attempt;
use crate::clock::Millis;
use crate::decide::{self, Snapshot};
use crate::error::LedgerError;
use crate::model::{Attempt, AttemptState, Permit};
use crate::store::rows::ATTEMPT_COLS;
use crate::store::snapshot::{self, DuplicateLookup, PermitRead, SnapshotReads};
use crate::store::OutcomeResult;
use crate::token;

/// The snapshot of one authorize call, each read a query in the group transaction.
pub(super) fn load_snapshot(
    tx: &GroupTx<'_>,
    req: &AuthorizeRequest,
    key_hash: Option<&str>,
    now: Millis,
) -> Result<Snapshot, LedgerError> {
    let permit = match token::permit_id_of(&req.permit_token) {
        Some(id) => load_permit(tx, id)?,
        None => None,
    };
    let read = PermitRead::check(&req.permit_token, permit.as_ref());
    snapshot::assemble(req, read, key_hash, now, &mut Queries(tx), tx)
}

/// The snapshot's reads as queries in the group transaction.
struct Queries<'t, 'c>(&'t GroupTx<'c>);

impl SnapshotReads for Queries<'_, '_> {
    fn key_attempt(
        &mut self,
        permit: &Permit,
        key_hash: &str,
    ) -> Result<Option<Attempt>, LedgerError> {
        static SQL: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {ATTEMPT_COLS} FROM idempotency_keys k JOIN attempts a ON a.id = k.attempt_id \
                 WHERE k.permit_id = ?1 AND k.key_hash = ?2"
            )
        });
        Ok(query_attempts(self.0, &SQL, &[&permit.id, &key_hash])?
            .into_iter()
            .next())
    }

    fn slots_held(&mut self, permit: &Permit, tool: &str) -> Result<i64, LedgerError> {
        slots_held(self.0, &permit.id, tool)
    }

    fn budget(&mut self, permit: &Permit) -> Result<(i64, i64), LedgerError> {
        budget_counters(self.0, &permit.id)
    }

    fn recent_duplicate(
        &mut self,
        lookup: &DuplicateLookup<'_>,
    ) -> Result<Option<Attempt>, LedgerError> {
        static SQL: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.permit_id = ?1 AND a.fingerprint = ?2 \
                 AND a.state NOT IN {} AND a.created_at >= ?3 \
                 AND (?4 IS NULL OR a.key_hash IS NULL OR a.key_hash <> ?4) \
                 ORDER BY a.created_at DESC LIMIT 1",
                states(AttemptState::gave_back)
            )
        });
        Ok(query_attempts(
            self.0,
            &SQL,
            &[
                &lookup.permit_id,
                &lookup.fingerprint,
                &lookup.since,
                &lookup.key_hash,
            ],
        )?
        .into_iter()
        .next())
    }
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
