//! Approvals (docs/approvals.md): rule 4.8 of the decision table ([`approval_needed`]), the
//! rows of rule 3 for a key whose attempt waited for one ([`by_approval`]), and a person's
//! decision ([`decide_approval`]).
//!
//! The approval is a state of the call's own attempt, never a token of its own: it is bound
//! to the attempt's permit, tool, fingerprint and key, and it is consumed by the attempt's one
//! move from `approved` to `in_flight`, which is a decision like any other (one transaction
//! under the permit's serialization). Modelled in `ledger/model/atmost.pml`.

use atmost_protocol::{AuthorizeRequest, AuthorizeResponse, Denial, DenialCode};

use super::dispatch::{dispatch, permit_expired, redispatched};
use super::{DecideParams, Decision, Mutation};
use crate::clock::{rfc3339, Millis};
use crate::error::ApprovalRefused;
use crate::model::{Approval, ApprovalDecision, Attempt, AttemptState, CallRules, Permit};

/// Upper bound of `retry_after` for a call waiting for a person, in seconds: short, so an
/// agent that retries gets through soon after a quick approval.
pub const MAX_APPROVAL_RETRY_AFTER_SECS: i64 = 5;

/// Reason the sweeper (or a retry) records when nobody decided before the request lapsed.
pub const APPROVAL_UNDECIDED_REASON: &str = "approval_undecided";
/// Reason recorded when an approval was not used before its use-by time.
pub const APPROVAL_UNUSED_REASON: &str = "approval_unused";

/// Rule 4.8: the permit's approval rule for the tool asks a person to approve a call of this
/// cost.
pub fn approval_needed(rules: &CallRules, tool: &str, cost: u64) -> bool {
    rules.approval_for(tool).is_some_and(|r| r.asks_for(cost))
}

/// Rule 4.8's answer: the new attempt waits for a person, holding its slot and cost, and
/// nothing is dispatched (no capability, no credential, no signed body). Its lease is the
/// request's lapse time.
pub fn await_approval(mut attempt: Attempt, params: &DecideParams, now: Millis) -> Decision {
    attempt.state = AttemptState::AwaitingApproval;
    attempt.lease_expires_at_ms = now.saturating_add(millis(params.approval_wait_ms));
    attempt.capability_hash = None;
    attempt.dispatch_body_sha256 = None;
    attempt.credential = None;
    attempt.approval = Some(Approval {
        requested_at_ms: now,
        decision: None,
    });
    Decision {
        response: AuthorizeResponse::Deny(required(&attempt, now)),
        mutation: Mutation::Reserve(attempt),
        notices: Vec::new(),
        headroom: None,
    }
}

/// Rule 3's rows for the approval states, the key's fingerprint being the attempt's.
pub fn by_approval(
    existing: &Attempt,
    permit: &Permit,
    req: &AuthorizeRequest,
    params: &DecideParams,
    now: Millis,
) -> Decision {
    match existing.state {
        AttemptState::AwaitingApproval | AttemptState::Approved
            if now >= existing.lease_expires_at_ms =>
        {
            // Lapsed, and the sweeper has not come by yet: the retry expires it, so the slot
            // comes back now and the answer is the one the sweeper's move would give.
            Decision::updating(
                AuthorizeResponse::Deny(expired_denial(existing)),
                expired(existing, now),
            )
        }
        AttemptState::AwaitingApproval => Decision::deny(required(existing, now)),
        AttemptState::Approved => dispatch_approved(existing, permit, req, params, now),
        AttemptState::ApprovalRejected => {
            let by = existing
                .approval
                .as_ref()
                .and_then(|a| a.decision.as_ref())
                .map_or_else(String::new, |d| d.by.clone());
            Decision::deny(
                Denial::new(
                    DenialCode::ApprovalRejected,
                    "a person rejected this call; nothing was sent. Use a new key only to ask again",
                )
                .with("approval_id", existing.id.clone())
                .with("decided_by", by),
            )
        }
        // `approval_expired`, the one approval state left (rule 3 sends only these here).
        _ => Decision::deny(expired_denial(existing)),
    }
}

/// The approved call's dispatch: round 1 of the same attempt, a fresh capability, the
/// credential the permit names; its slot and cost were taken when it was asked for, so
/// nothing new is taken, even at the cap.
fn dispatch_approved(
    existing: &Attempt,
    permit: &Permit,
    req: &AuthorizeRequest,
    params: &DecideParams,
    now: Millis,
) -> Decision {
    if let Some(denial) = permit_expired(permit, now) {
        return Decision::deny(denial);
    }
    let mut next = redispatched(existing, req, params, now);
    next.forwarded_key = req.forwarded_key.clone();
    next.forwarded_key_carriers = req.forwarded_key_carriers;
    next.credential = params.credential.clone();
    Decision::updating(dispatch(&existing.id, permit, params, next.round), next)
}

/// `approval_required`, the same for the first ask and every retry while nobody decided.
fn required(attempt: &Attempt, now: Millis) -> Denial {
    let remaining_ms = attempt.lease_expires_at_ms.saturating_sub(now).max(0);
    let retry_after = ((remaining_ms + 999) / 1000).clamp(1, MAX_APPROVAL_RETRY_AFTER_SECS);
    Denial::new(
        DenialCode::ApprovalRequired,
        "the permit asks a person to approve this call; nothing was sent. Retry with the same key and arguments: once approved, that call is sent",
    )
    .with("approval_id", attempt.id.clone())
    .with("retry_after", retry_after)
    .with("approval_expires_at", rfc3339(attempt.lease_expires_at_ms))
}

fn expired_denial(attempt: &Attempt) -> Denial {
    Denial::new(
        DenialCode::ApprovalExpired,
        "the approval this key asked for lapsed (nobody decided in time, or it was not used in time); nothing was sent. Use a new key only to ask again",
    )
    .with("approval_id", attempt.id.clone())
}

/// The attempt once its approval lapsed: `approval_expired`, slot and cost back (nothing was
/// sent: both states it comes from dispatched nothing). Used by the sweeper too.
pub fn expired(a: &Attempt, now: Millis) -> Attempt {
    let mut next = a.clone();
    next.reason = Some(
        if a.state == AttemptState::Approved {
            APPROVAL_UNUSED_REASON
        } else {
            APPROVAL_UNDECIDED_REASON
        }
        .to_string(),
    );
    next.state = AttemptState::ApprovalExpired;
    next.updated_at_ms = now;
    next
}

/// What a person decided about a waiting call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalInput {
    pub approve: bool,
    /// Who decided: the admin's name (see [`ApprovalDecision::by`]).
    pub by: String,
    pub note: Option<String>,
    /// How long an approval may wait for the agent's retry, in milliseconds.
    pub use_within_ms: u64,
}

/// A person's decision on an `awaiting_approval` attempt: `approved` with a use-by time (its
/// lease), or `approval_rejected` with its slot and cost back. Nothing else can be decided,
/// nor a request past its lapse time. Modelled in `ledger/model/atmost.pml`.
pub fn decide_approval(
    a: &Attempt,
    input: &ApprovalInput,
    now: Millis,
) -> Result<Attempt, ApprovalRefused> {
    if a.state != AttemptState::AwaitingApproval {
        return Err(ApprovalRefused::NotAwaiting(a.state));
    }
    if now >= a.lease_expires_at_ms {
        return Err(ApprovalRefused::Lapsed);
    }
    let mut next = a.clone();
    next.updated_at_ms = now;
    let requested_at_ms = a
        .approval
        .as_ref()
        .map_or(a.created_at_ms, |x| x.requested_at_ms);
    next.approval = Some(Approval {
        requested_at_ms,
        decision: Some(ApprovalDecision {
            approved: input.approve,
            by: input.by.clone(),
            at_ms: now,
            note: input.note.clone(),
        }),
    });
    if input.approve {
        next.state = AttemptState::Approved;
        next.lease_expires_at_ms = now.saturating_add(millis(input.use_within_ms));
    } else {
        next.state = AttemptState::ApprovalRejected;
    }
    Ok(next)
}

fn millis(ms: u64) -> Millis {
    i64::try_from(ms).unwrap_or(i64::MAX)
}
