//! How an attempt ends without a report: a person's (or the reconciler's) resolution of an
//! `uncertain` one, the sweeper's end of a lease, and retention's pruning of a receipt.

use crate::clock::Millis;
use crate::error::ResolveError;
use crate::model::{Attempt, AttemptState, Resolution, ResolutionSource};

/// Reason recorded when the sweeper turns an expired lease into `uncertain`.
pub const LEASE_EXPIRED_REASON: &str = "lease_expired";
/// Reason recorded when the sweeper turns an `awaiting_input` attempt whose continuation
/// never came into `uncertain` (the server may have acted before it asked).
pub const INPUT_ABANDONED_REASON: &str = "input_required_abandoned";

/// What a person (or reconciler) found when checking the provider.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResolveInput {
    pub executed: bool,
    #[serde(default)]
    pub receipt: Option<String>,
    #[serde(default)]
    pub note: Option<String>,
    pub by: String,
    /// A person, unless the reconciler resolves (in process): the admin API cannot claim
    /// to be the reconciler.
    #[serde(skip)]
    pub source: ResolutionSource,
}

/// What a resolution must say and does not: refused before any attempt is looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidResolution {
    #[error("by must name who resolved the attempt")]
    NoResolver,
    #[error("a receipt only goes with executed: true")]
    ReceiptWithoutExecution,
}

impl ResolveInput {
    /// Someone is named, and a receipt comes only with a call that ran.
    pub fn check(&self) -> Result<(), InvalidResolution> {
        if self.by.trim().is_empty() {
            return Err(InvalidResolution::NoResolver);
        }
        if !self.executed && self.receipt.is_some() {
            return Err(InvalidResolution::ReceiptWithoutExecution);
        }
        Ok(())
    }
}

/// Settles an `uncertain` attempt. Nothing else can be resolved. Modelled in
/// `ledger/model/atmost.pml` (`RESOLVE`).
pub fn resolve(a: &Attempt, input: &ResolveInput, now: Millis) -> Result<Attempt, ResolveError> {
    if a.state != AttemptState::Uncertain {
        return Err(ResolveError::NotUncertain(a.state));
    }
    let mut next = a.clone();
    next.updated_at_ms = now;
    if input.executed {
        next.state = AttemptState::ResolvedExecuted;
        next.receipt = input.receipt.clone();
        next.finished_at_ms = Some(now);
    } else {
        next.state = AttemptState::ResolvedNotExecuted;
        next.receipt = None;
    }
    next.resolution = Some(Resolution {
        executed: input.executed,
        by: input.by.clone(),
        at_ms: now,
        note: input.note.clone(),
        source: input.source.clone(),
    });
    Ok(next)
}

/// The sweeper: an `in_flight` or `awaiting_input` attempt past its lease becomes
/// `uncertain` (never `released`). Modelled in `ledger/model/atmost.pml` (`EXPIRE`). A call
/// waiting for a person's approval, or approved and not used, past its lapse time becomes
/// `approval_expired` instead: it gives its slot back, as nothing of it was sent.
pub fn expire_lease(a: &Attempt, now: Millis) -> Option<Attempt> {
    if !a.state.leased() || now < a.lease_expires_at_ms {
        return None;
    }
    if matches!(
        a.state,
        AttemptState::AwaitingApproval | AttemptState::Approved
    ) {
        return Some(super::approval::expired(a, now));
    }
    let mut next = a.clone();
    next.reason = Some(
        if a.state == AttemptState::AwaitingInput {
            INPUT_ABANDONED_REASON
        } else {
            LEASE_EXPIRED_REASON
        }
        .to_string(),
    );
    next.state = AttemptState::Uncertain;
    next.updated_at_ms = now;
    Some(next)
}

/// Retention: a finished attempt's receipt (and its arguments) older than the permit's
/// retention is dropped and the row kept as a tombstone. `uncertain` and `in_flight` attempts
/// are never pruned.
pub fn prune(a: &Attempt, retention_ms: Millis, now: Millis) -> Option<Attempt> {
    if !a.state.replays() || a.pruned_at_ms.is_some() {
        return None;
    }
    let finished = a.finished_at_ms.unwrap_or(a.updated_at_ms);
    if now.saturating_sub(finished) < retention_ms {
        return None;
    }
    let mut next = a.clone();
    next.receipt = None;
    next.arguments = None;
    next.pruned_at_ms = Some(now);
    next.updated_at_ms = now;
    Some(next)
}
