//! What a report means for an attempt's round: the state it asks for, the state it moves an
//! `in_flight` attempt to, and whether it proves it speaks for the current round.

use atmost_protocol::{Outcome, OutcomeReport};

use crate::clock::Millis;
use crate::model::{Attempt, AttemptState};
use crate::token;

/// The state an outcome report asks for.
pub fn outcome_state(outcome: &Outcome) -> AttemptState {
    match outcome {
        Outcome::Completed { .. } => AttemptState::Completed,
        Outcome::Released { .. } => AttemptState::Released,
        Outcome::Uncertain { .. } => AttemptState::Uncertain,
        Outcome::InputRequired { .. } => AttemptState::AwaitingInput,
        Outcome::Accepted { .. } => AttemptState::Accepted,
        Outcome::RefusedAtTool { .. } => AttemptState::RefusedAtTool,
    }
}

/// The state a report of `outcome` for round `round` moves an `in_flight` attempt to. A
/// round that never reached the upstream gives the slot back only if it was the first: a
/// continuation that never left returns the attempt to where that round started,
/// `awaiting_input`, because round 1 was sent.
pub fn outcome_target(outcome: &Outcome, round: u32) -> AttemptState {
    match outcome {
        Outcome::Released { .. } if round > 1 => AttemptState::AwaitingInput,
        other => outcome_state(other),
    }
}

/// Whether the report proves it speaks for the attempt's current round: the round matches
/// and the capability hashes to the stored one (compared in constant time). An attempt
/// stored without a capability (written before rounds existed) accepts no report; its
/// lease decides.
pub fn report_authenticated(a: &Attempt, report: &OutcomeReport) -> bool {
    match a.capability_hash.as_deref() {
        Some(hash) => report.round == a.round && token::token_matches(&report.capability, hash),
        None => false,
    }
}

/// How long the current round's lease was when it was dispatched.
pub(super) fn dispatch_lease(a: &Attempt) -> Millis {
    a.lease_expires_at_ms.saturating_sub(a.updated_at_ms).max(0)
}
