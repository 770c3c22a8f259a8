//! A verifier's refusal reported by the gateway (docs/design.md#attempt-states): what it
//! moves an attempt to. Whether the slot comes back rests only on what the ledger can check
//! itself: the refusal's HMAC under a key it trusts, over this round's nonce.

use atmost_protocol::signature::DispatchNonce;
use atmost_protocol::tool_refusal::{self, ToolRefusal};
use atmost_protocol::{Outcome, OutcomeReport};

use super::rounds::{dispatch_lease, outcome_target};
use crate::clock::Millis;
use crate::model::{Attempt, AttemptState};

/// Whether a verifier's refusal reported for `a`'s round `round` proves that the tool did
/// not run it: its HMAC verified with a key the ledger trusts (`mac_verified`, checked by
/// the server before the store), it names this very round's nonce, and its code is one
/// made before the server got the body (`tool_refusal::gives_slot_back`). Anything less is
/// an answer any upstream could have written.
pub fn refusal_proven(a: &Attempt, round: u32, refusal: &str, mac_verified: bool) -> bool {
    let Some(parsed) = ToolRefusal::parse(refusal) else {
        return false;
    };
    let nonce = DispatchNonce {
        attempt_id: a.id.clone(),
        round,
        permit_id: a.permit_id.clone(),
        tool: a.tool.clone(),
    }
    .encode();
    mac_verified
        && tool_refusal::gives_slot_back(parsed.code)
        && parsed.proof.is_some_and(|p| p.nonce == nonce)
}

/// The state a report moves `a` to: as [`outcome_target`], and for a verifier's refusal by
/// its proof. A proven refusal of round 1 gives the slot back (`refused_at_tool`); of a later
/// round it returns the attempt to `awaiting_input`, because round 1 was sent. An unproven
/// one is `uncertain`: the tool may have run.
pub(super) fn report_target(a: &Attempt, report: &OutcomeReport) -> AttemptState {
    match &report.outcome {
        Outcome::RefusedAtTool {
            refusal,
            mac_verified,
        } => match refusal_proven(a, report.round, refusal, *mac_verified) {
            true if report.round > 1 => AttemptState::AwaitingInput,
            true => AttemptState::RefusedAtTool,
            false => AttemptState::Uncertain,
        },
        other => outcome_target(other, report.round),
    }
}

/// The reason recorded for a verifier's refusal: its code (the first word of the header,
/// when it is a known one), and whether it was proven.
fn refusal_reason(refusal: &str, proven: bool) -> String {
    let code = ToolRefusal::parse(refusal).map_or("unreadable", |r| r.code.as_str());
    match proven {
        true => format!("refused_at_tool: {code}"),
        false => format!("tool_refusal_unproven: {code}"),
    }
}

/// Writes what a refusal report leaves on `next`, already moved to its target: the reason,
/// and for a continuation sent back to `awaiting_input` a renewed lease, as after a
/// continuation that never left.
pub(super) fn record(next: &mut Attempt, a: &Attempt, refusal: &str, now: Millis) {
    let proven = next.state != AttemptState::Uncertain;
    next.reason = Some(refusal_reason(refusal, proven));
    if next.state == AttemptState::AwaitingInput {
        next.lease_expires_at_ms = now.saturating_add(dispatch_lease(a));
    }
}
