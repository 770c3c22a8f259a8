//! An outcome report applied to its attempt ([`apply_outcome`]).

use atmost_protocol::{Outcome, OutcomeAck, OutcomeReport};

use super::refusal::{self, report_target};
use super::rounds::{dispatch_lease, report_authenticated};
use crate::clock::Millis;
use crate::model::{Attempt, AttemptState};

/// Applies one outcome report. Only a report that proves the attempt's current round moves
/// it, and only from `in_flight`; the attempt to write, if any, is returned.
///
/// Modelled in `ledger/model/atmost.pml` (`apply_report`): without the round check, an agent
/// holding a later round's capability claims round 1 and releases a sent attempt (the
/// `NO_ROUND_CHECK` mutant's counterexample).
pub fn apply_outcome(
    existing: Option<&Attempt>,
    report: &OutcomeReport,
    now: Millis,
) -> (OutcomeAck, Option<Attempt>) {
    let Some(a) = existing else {
        return (OutcomeAck::UnknownAttempt, None);
    };
    if report.round < a.round && report.round >= 1 {
        // A late or retried report of a round that is over: the attempt has moved on.
        return (OutcomeAck::StaleRound, None);
    }
    if !report_authenticated(a, report) {
        return (OutcomeAck::Refused, None);
    }
    let outcome = &report.outcome;
    let target = report_target(a, report);
    if a.state != AttemptState::InFlight {
        let ack = if a.state == target {
            OutcomeAck::AlreadyRecorded
        } else {
            OutcomeAck::Conflict
        };
        return (ack, None);
    }
    let mut next = a.clone();
    next.state = target;
    next.updated_at_ms = now;
    match outcome {
        Outcome::Completed { receipt } | Outcome::Accepted { receipt } => {
            next.receipt = Some(receipt.clone());
            next.finished_at_ms = Some(now);
        }
        Outcome::Released { reason } if target == AttemptState::AwaitingInput => {
            // The continuation never left: the client may send it again under the same key.
            // The interim receipt of the earlier round stays; the lease is renewed.
            next.reason = Some(reason.clone());
            next.lease_expires_at_ms = now.saturating_add(dispatch_lease(a));
        }
        Outcome::Released { reason } | Outcome::Uncertain { reason } => {
            next.reason = Some(reason.clone());
        }
        Outcome::RefusedAtTool { refusal, .. } => refusal::record(&mut next, a, refusal, now),
        Outcome::InputRequired { receipt } => {
            // The interim answer, kept for inspection (never replayed: the state does not
            // replay). The lease is renewed for as long as the dispatch lease was.
            next.receipt = Some(receipt.clone());
            next.lease_expires_at_ms = now.saturating_add(dispatch_lease(a));
        }
    }
    (OutcomeAck::Applied, Some(next))
}
