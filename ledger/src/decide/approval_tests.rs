//! The approval rows of docs/approvals.md: rule 4.8, rule 3's rows for the approval states,
//! a person's decision and the sweeper's lapse.

use atmost_protocol::{AuthorizeRequest, AuthorizeResponse, DenialCode, PermitLimits};
use serde_json::json;

use crate::decide::approval::{APPROVAL_UNDECIDED_REASON, APPROVAL_UNUSED_REASON};
use crate::decide::{
    counter_delta, decide, decide_approval, expire_lease, ApprovalInput, DecideParams, Decision,
    Mutation, Snapshot,
};
use crate::error::ApprovalRefused;
use crate::model::{ApprovalRule, Attempt, AttemptState, CostRule, Permit, Policy};
use crate::token;

const NOW: i64 = 1_800_000_000_000;
const HOUR: i64 = 3_600_000;
const PID: &str = "pmt_000000000000000000000001";
const WAIT_MS: u64 = 900_000;

fn permit(rule: ApprovalRule) -> Permit {
    Permit {
        id: PID.into(),
        token_hash: token::sha256_hex(&format!("atmp_{PID}_{}", "ab".repeat(32))),
        label: "test".into(),
        created_at_ms: NOW - HOUR,
        expires_at_ms: NOW + HOUR,
        revoked_at_ms: None,
        policy: Policy::builder()
            .max_calls("refund", 1)
            .budget(100)
            .cost("refund", CostRule::Pointer("/amount".into()))
            .approval("refund", rule)
            .build(),
    }
}

fn req(amount: u64, fp: &str) -> AuthorizeRequest {
    AuthorizeRequest {
        reports: Vec::new(),
        permit_token: format!("atmp_{PID}_{}", "ab".repeat(32)),
        tool: "refund".into(),
        idempotency_key: Some("k".into()),
        fingerprint: fp.into(),
        arguments: json!({"amount": amount}),
        key_required: false,
        continuation: false,
        forwarded_key: Some("fwd".into()),
        forwarded_key_carriers: Default::default(),
        dispatch: None,
    }
}

fn params() -> DecideParams {
    DecideParams {
        lease_ms: 60_000,
        approval_wait_ms: WAIT_MS,
        new_attempt_id: "att_new".into(),
        new_capability: "cap-new".into(),
        credential: None,
    }
}

fn snap(p: Permit, existing: Option<Attempt>, now: i64) -> Snapshot {
    Snapshot {
        permit: Some(p),
        existing,
        now_ms: now,
        ..Snapshot::default()
    }
}

fn denial(d: &Decision) -> atmost_protocol::Denial {
    match &d.response {
        AuthorizeResponse::Deny(x) => x.clone(),
        other => panic!("expected a denial, got {other:?}"),
    }
}

/// The attempt rule 4.8 reserved for `req(60, "fp")`.
fn waiting() -> Attempt {
    let d = decide(
        &req(60, "fp"),
        &snap(permit(ApprovalRule::Always), None, NOW),
        &params(),
    );
    match d.mutation {
        Mutation::Reserve(a) => a,
        other => panic!("expected a reservation, got {other:?}"),
    }
}

fn decided(approve: bool, at: i64) -> Attempt {
    let input = ApprovalInput {
        approve,
        by: "ana".into(),
        note: Some("checked".into()),
        use_within_ms: 600_000,
    };
    decide_approval(&waiting(), &input, at).unwrap()
}

#[test]
fn a_call_the_rule_covers_holds_its_slot_and_cost_and_sends_nothing() {
    let d = decide(
        &req(60, "fp"),
        &snap(permit(ApprovalRule::Always), None, NOW),
        &params(),
    );
    let denial = denial(&d);
    assert_eq!(denial.code, DenialCode::ApprovalRequired);
    assert_eq!(denial.data["approval_id"], "att_new");
    assert_eq!(denial.data["retry_after"], 5);
    assert_eq!(
        denial.data["approval_expires_at"],
        crate::clock::rfc3339(NOW + WAIT_MS as i64)
    );
    // The limits count the slot and cost the request holds.
    assert_eq!(
        denial.limits,
        Some(
            PermitLimits::until(crate::clock::rfc3339(NOW + HOUR))
                .with_calls_left(Some(0))
                .with_budget_left(Some(40))
        )
    );
    let Mutation::Reserve(a) = &d.mutation else {
        panic!("{:?}", d.mutation)
    };
    assert_eq!(a.state, AttemptState::AwaitingApproval);
    assert!(a.capability_hash.is_none() && a.credential.is_none());
    assert_eq!(a.lease_expires_at_ms, NOW + WAIT_MS as i64);
    assert_eq!(a.approval.as_ref().map(|x| x.requested_at_ms), Some(NOW));
    let moved = counter_delta(None, a);
    assert_eq!((moved.slots, moved.reserved, moved.spent), (1, 60, 0));
}

#[test]
fn cost_above_asks_only_above_its_amount() {
    let p = || permit(ApprovalRule::CostAbove(50));
    let at_amount = decide(&req(50, "fp"), &snap(p(), None, NOW), &params());
    assert!(matches!(
        at_amount.response,
        AuthorizeResponse::Dispatch { .. }
    ));
    let above = decide(&req(51, "fp"), &snap(p(), None, NOW), &params());
    assert_eq!(denial(&above).code, DenialCode::ApprovalRequired);
}

#[test]
fn the_checks_of_a_new_call_come_first() {
    // At the cap: denied as any call, nothing asked of a person.
    let mut s = snap(permit(ApprovalRule::Always), None, NOW);
    s.usage.calls_made = 1;
    let d = decide(&req(60, "fp"), &s, &params());
    assert_eq!(denial(&d).code, DenialCode::PermitMaxCallsExceeded);
    assert_eq!(d.mutation, Mutation::None);
    // Over the budget likewise.
    let d = decide(
        &req(101, "fp"),
        &snap(permit(ApprovalRule::Always), None, NOW),
        &params(),
    );
    assert_eq!(denial(&d).code, DenialCode::PermitBudgetExceeded);
}

#[test]
fn the_same_key_while_nobody_decided_gets_the_same_answer_and_takes_nothing() {
    let s = snap(permit(ApprovalRule::Always), Some(waiting()), NOW + 2_000);
    let d = decide(&req(60, "fp"), &s, &params());
    let again = denial(&d);
    assert_eq!(again.code, DenialCode::ApprovalRequired);
    assert_eq!(again.data["approval_id"], "att_new");
    assert_eq!(d.mutation, Mutation::None);
    // Other arguments under the key: a conflict, as for every key.
    let d = decide(&req(61, "other-fp"), &s, &params());
    assert_eq!(denial(&d).code, DenialCode::IdempotencyKeyConflict);
}

#[test]
fn an_approved_key_dispatches_once_under_the_same_attempt() {
    let approved = decided(true, NOW + 1_000);
    assert_eq!(approved.state, AttemptState::Approved);
    assert_eq!(approved.lease_expires_at_ms, NOW + 1_000 + 600_000);
    let s = snap(
        permit(ApprovalRule::Always),
        Some(approved.clone()),
        NOW + 2_000,
    );
    let d = decide(&req(60, "fp"), &s, &params());
    assert!(
        matches!(&d.response, AuthorizeResponse::Dispatch { attempt_id, round: 1, .. } if attempt_id == "att_new"),
        "{:?}",
        d.response
    );
    let Mutation::Update(next) = &d.mutation else {
        panic!("{:?}", d.mutation)
    };
    assert_eq!(next.state, AttemptState::InFlight);
    assert_eq!(next.capability_hash, Some(token::sha256_hex("cap-new")));
    assert_eq!(next.lease_expires_at_ms, NOW + 2_000 + 60_000);
    assert_eq!(next.forwarded_key.as_deref(), Some("fwd"));
    // Its approval stays on the record, and no new slot or cost is taken, even at the cap.
    assert_eq!(next.approval, approved.approval);
    let moved = counter_delta(Some(&approved), next);
    assert_eq!((moved.slots, moved.reserved, moved.spent), (0, 0, 0));
    // Once in flight, the same key is in progress: the approval was consumed.
    let s = snap(
        permit(ApprovalRule::Always),
        Some(next.clone()),
        NOW + 3_000,
    );
    let again = decide(&req(60, "fp"), &s, &params());
    assert_eq!(denial(&again).code, DenialCode::IdempotencyInProgress);
    assert_eq!(again.mutation, Mutation::None);
}

#[test]
fn a_rejection_gives_the_slot_back_and_the_key_keeps_answering_it() {
    let rejected = decided(false, NOW + 1_000);
    assert_eq!(rejected.state, AttemptState::ApprovalRejected);
    let moved = counter_delta(Some(&waiting()), &rejected);
    assert_eq!((moved.slots, moved.reserved, moved.spent), (-1, -60, 0));
    let s = snap(permit(ApprovalRule::Always), Some(rejected), NOW + 2_000);
    let d = decide(&req(60, "fp"), &s, &params());
    let denial = denial(&d);
    assert_eq!(denial.code, DenialCode::ApprovalRejected);
    assert_eq!(denial.data["decided_by"], "ana");
    assert_eq!(d.mutation, Mutation::None);
}

#[test]
fn only_a_waiting_request_within_its_time_can_be_decided() {
    let input = ApprovalInput {
        approve: true,
        by: "ana".into(),
        note: None,
        use_within_ms: 1,
    };
    let approved = decided(true, NOW + 1);
    assert_eq!(
        decide_approval(&approved, &input, NOW + 2),
        Err(ApprovalRefused::NotAwaiting(AttemptState::Approved))
    );
    assert_eq!(
        decide_approval(&waiting(), &input, NOW + WAIT_MS as i64),
        Err(ApprovalRefused::Lapsed)
    );
    let decision = approved.approval.and_then(|a| a.decision).unwrap();
    assert_eq!((decision.by.as_str(), decision.at_ms), ("ana", NOW + 1));
}

#[test]
fn lapses_give_the_slot_back_by_sweeper_or_by_retry() {
    // Nobody decided: the sweeper expires it at its lapse time, not before.
    let w = waiting();
    assert_eq!(expire_lease(&w, NOW + WAIT_MS as i64 - 1), None);
    let swept = expire_lease(&w, NOW + WAIT_MS as i64).unwrap();
    assert_eq!(swept.state, AttemptState::ApprovalExpired);
    assert_eq!(swept.reason.as_deref(), Some(APPROVAL_UNDECIDED_REASON));
    let moved = counter_delta(Some(&w), &swept);
    assert_eq!((moved.slots, moved.reserved), (-1, -60));
    // Approved and not used in time: a retry after it expires it and is refused.
    let approved = decided(true, NOW + 1_000);
    let late = NOW + 1_000 + 600_000;
    let d = decide(
        &req(60, "fp"),
        &snap(permit(ApprovalRule::Always), Some(approved.clone()), late),
        &params(),
    );
    assert_eq!(denial(&d).code, DenialCode::ApprovalExpired);
    let Mutation::Update(next) = &d.mutation else {
        panic!("{:?}", d.mutation)
    };
    assert_eq!(next.state, AttemptState::ApprovalExpired);
    assert_eq!(next.reason.as_deref(), Some(APPROVAL_UNUSED_REASON));
    // And the key answers so from then on.
    let d = decide(
        &req(60, "fp"),
        &snap(permit(ApprovalRule::Always), Some(next.clone()), late + 1),
        &params(),
    );
    assert_eq!(denial(&d).code, DenialCode::ApprovalExpired);
    assert_eq!(d.mutation, Mutation::None);
}

#[test]
fn an_approved_call_under_an_expired_permit_is_not_sent() {
    let approved = decided(true, NOW + 1_000);
    let mut p = permit(ApprovalRule::Always);
    p.expires_at_ms = NOW + 1_500;
    let d = decide(
        &req(60, "fp"),
        &snap(p, Some(approved), NOW + 2_000),
        &params(),
    );
    assert_eq!(denial(&d).code, DenialCode::PermitExpired);
    assert_eq!(d.mutation, Mutation::None);
}
