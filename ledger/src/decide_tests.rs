//! Unit tests of the pure decision functions: every row of docs/design.md#the-decision-table.

use atmost_protocol::{
    AuthorizeRequest, AuthorizeResponse, DenialCode, Outcome, OutcomeAck, OutcomeReport,
    PermitLimits,
};
use serde_json::json;

use crate::decide::*;
use crate::error::ResolveError;
use crate::model::*;
use crate::token;

const NOW: i64 = 1_800_000_000_000;
const HOUR: i64 = 3_600_000;
const PID: &str = "pmt_000000000000000000000001";

fn token_for(id: &str) -> String {
    format!("atmp_{id}_{}", "ab".repeat(32))
}

fn permit() -> Permit {
    Permit {
        id: PID.into(),
        token_hash: token::sha256_hex(&token_for(PID)),
        label: "test".into(),
        created_at_ms: NOW - HOUR,
        expires_at_ms: NOW + HOUR,
        revoked_at_ms: None,
        policy: Policy::builder().retention_ms(24 * HOUR).build(),
    }
}

fn req(key: Option<&str>, fp: &str) -> AuthorizeRequest {
    AuthorizeRequest {
        reports: Vec::new(),
        permit_token: token_for(PID),
        tool: "pay".into(),
        idempotency_key: key.map(String::from),
        fingerprint: fp.into(),
        arguments: json!({"amount": 5}),
        key_required: false,
        continuation: false,
        forwarded_key: None,
        forwarded_key_carriers: Default::default(),
        dispatch: None,
    }
}

fn snap(p: Permit) -> Snapshot {
    Snapshot {
        permit: Some(p),
        now_ms: NOW,
        ..Snapshot::default()
    }
}

fn params() -> DecideParams {
    DecideParams {
        lease_ms: 60_000,
        approval_wait_ms: 900_000,
        new_attempt_id: "att_new".into(),
        new_capability: CAP.into(),
        credential: None,
    }
}

/// The capability the attempts of these tests were dispatched with (round 1).
const CAP: &str = "cap-of-round-1";

/// A report from whoever the attempt's round 1 was dispatched to.
fn rep(outcome: Outcome) -> OutcomeReport {
    OutcomeReport {
        attempt_id: "att_old".into(),
        round: 1,
        capability: CAP.into(),
        outcome,
    }
}

fn attempt(state: AttemptState, key: Option<&str>, fp: &str) -> Attempt {
    Attempt {
        key_hash: key.map(token::sha256_hex),
        fingerprint: fp.into(),
        created_at_ms: NOW - 10_000,
        updated_at_ms: NOW - 5_000,
        lease_expires_at_ms: NOW + 50_000,
        capability_hash: Some(token::sha256_hex(CAP)),
        ..Attempt::example("att_old", PID, "pay", state, 5)
    }
}

fn code(d: &Decision) -> Option<DenialCode> {
    match &d.response {
        AuthorizeResponse::Deny(x) => Some(x.code),
        _ => None,
    }
}

fn denial(d: &Decision) -> atmost_protocol::Denial {
    match &d.response {
        AuthorizeResponse::Deny(x) => x.clone(),
        other => panic!("expected a denial, got {other:?}"),
    }
}

/// The figures of [`permit`] (no cap, no budget) in every answer under it.
fn open_limits() -> Option<PermitLimits> {
    Some(PermitLimits::until(crate::clock::rfc3339(NOW + HOUR)))
}

fn is_dispatch(d: &Decision) -> bool {
    matches!(d.response, AuthorizeResponse::Dispatch { .. })
        && matches!(d.mutation, Mutation::Reserve(_))
}

#[test]
fn new_key_dispatches_and_reserves() {
    let d = decide(&req(Some("k"), "fp"), &snap(permit()), &params());
    assert_eq!(
        d.response,
        AuthorizeResponse::Dispatch {
            attempt_id: "att_new".into(),
            permit_id: PID.into(),
            lease_ms: 60_000,
            round: 1,
            capability: CAP.into(),
            limits: open_limits(),
            signature: None,
            credential: None,
        }
    );
    let Mutation::Reserve(a) = d.mutation else {
        panic!("no reservation")
    };
    assert_eq!(a.state, AttemptState::InFlight);
    assert_eq!(a.key_hash, Some(token::sha256_hex("k")));
    assert_eq!(a.lease_expires_at_ms, NOW + 60_000);
    assert_eq!(a.cost, 0);
}

#[test]
fn no_key_dispatches() {
    assert!(is_dispatch(&decide(
        &req(None, "fp"),
        &snap(permit()),
        &params()
    )));
}

#[test]
fn unknown_wrong_or_revoked_token_is_permit_invalid() {
    let mut s = snap(permit());
    s.permit = None;
    assert_eq!(
        code(&decide(&req(None, "fp"), &s, &params())),
        Some(DenialCode::PermitInvalid)
    );

    let mut r = req(None, "fp");
    r.permit_token = format!("atmp_{PID}_{}", "cd".repeat(32));
    assert_eq!(
        code(&decide(&r, &snap(permit()), &params())),
        Some(DenialCode::PermitInvalid)
    );

    r.permit_token = "garbage".into();
    assert_eq!(
        code(&decide(&r, &snap(permit()), &params())),
        Some(DenialCode::PermitInvalid)
    );

    let mut p = permit();
    p.revoked_at_ms = Some(NOW - 1);
    // Even a replayable key is refused once the permit is revoked: authentication comes first.
    let mut s = snap(p);
    let mut done = attempt(AttemptState::Completed, Some("k"), "fp");
    done.receipt = Some("{}".into());
    s.existing = Some(done);
    assert_eq!(
        code(&decide(&req(Some("k"), "fp"), &s, &params())),
        Some(DenialCode::PermitInvalid)
    );
}

#[test]
fn invalid_key_is_refused() {
    // The filter's rule too: a key the filter would refuse, the ledger refuses from any caller.
    for k in ["", &"x".repeat(MAX_KEY_LEN + 1), "a\nb", "clé"] {
        assert_eq!(
            code(&decide(&req(Some(k), "fp"), &snap(permit()), &params())),
            Some(DenialCode::InvalidIdempotencyKey)
        );
    }
}

#[test]
fn completed_same_fingerprint_replays_without_slot_even_after_expiry() {
    let mut p = permit();
    p.expires_at_ms = NOW - 1;
    p.policy.rules.max_calls_default = Some(1);
    let mut s = snap(p);
    s.usage.calls_made = 1;
    let mut done = attempt(AttemptState::Completed, Some("k"), "fp");
    done.receipt = Some(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#.into());
    s.existing = Some(done);
    let d = decide(&req(Some("k"), "fp"), &s, &params());
    assert_eq!(
        d.response,
        AuthorizeResponse::Replay {
            attempt_id: "att_old".into(),
            receipt: r#"{"jsonrpc":"2.0","id":1,"result":{}}"#.into(),
            // Expired: no new call can pass, though the replay does.
            limits: Some(
                PermitLimits::until(crate::clock::rfc3339(NOW - 1)).with_calls_left(Some(0))
            ),
        }
    );
    let Mutation::Update(a) = d.mutation else {
        panic!("replay count not bumped")
    };
    assert_eq!(a.replay_count, 1);
    assert_eq!(a.state, AttemptState::Completed);
}

#[test]
fn different_fingerprint_conflicts_in_every_state_and_never_echoes() {
    for st in AttemptState::ALL {
        let mut s = snap(permit());
        let mut a = attempt(st, Some("k"), "fp-old");
        a.receipt = Some("SECRET-RECEIPT".into());
        s.existing = Some(a);
        let d = decide(&req(Some("k"), "fp-new"), &s, &params());
        let den = denial(&d);
        assert_eq!(den.code, DenialCode::IdempotencyKeyConflict, "{st}");
        let text = serde_json::to_string(&den).unwrap();
        assert!(
            !text.contains("SECRET-RECEIPT") && !text.contains("fp-old"),
            "{text}"
        );
        assert_eq!(d.mutation, Mutation::None);
    }
}

#[test]
fn in_flight_same_fingerprint_is_in_progress_with_retry_after() {
    let mut s = snap(permit());
    s.existing = Some(attempt(AttemptState::InFlight, Some("k"), "fp"));
    let den = denial(&decide(&req(Some("k"), "fp"), &s, &params()));
    assert_eq!(den.code, DenialCode::IdempotencyInProgress);
    assert_eq!(den.data["retry_after"], json!(MAX_RETRY_AFTER_SECS));

    let mut a = attempt(AttemptState::InFlight, Some("k"), "fp");
    a.lease_expires_at_ms = NOW + 2_500;
    s.existing = Some(a.clone());
    assert_eq!(
        denial(&decide(&req(Some("k"), "fp"), &s, &params())).data["retry_after"],
        json!(3)
    );
    a.lease_expires_at_ms = NOW - 10;
    s.existing = Some(a);
    assert_eq!(
        denial(&decide(&req(Some("k"), "fp"), &s, &params())).data["retry_after"],
        json!(1)
    );
}

#[test]
fn uncertain_same_fingerprint_is_delivery_uncertain_with_attempt_id() {
    let mut s = snap(permit());
    s.existing = Some(attempt(AttemptState::Uncertain, Some("k"), "fp"));
    let d = decide(&req(Some("k"), "fp"), &s, &params());
    let den = denial(&d);
    assert_eq!(den.code, DenialCode::DeliveryUncertain);
    assert_eq!(den.data["attempt_id"], json!("att_old"));
    assert_eq!(d.mutation, Mutation::None);
}

#[test]
fn released_and_resolved_not_executed_same_key_are_new_calls() {
    for st in [AttemptState::Released, AttemptState::ResolvedNotExecuted] {
        let mut s = snap(permit());
        s.existing = Some(attempt(st, Some("k"), "fp"));
        let d = decide(&req(Some("k"), "fp"), &s, &params());
        assert!(is_dispatch(&d), "{st}");
        // ...and they go through the checks again.
        let mut p = permit();
        p.expires_at_ms = NOW;
        let mut s = snap(p);
        s.existing = Some(attempt(st, Some("k"), "fp"));
        assert_eq!(
            code(&decide(&req(Some("k"), "fp"), &s, &params())),
            Some(DenialCode::PermitExpired)
        );
        let mut p = permit();
        p.policy.rules.max_calls_default = Some(1);
        let mut s = snap(p);
        s.usage.calls_made = 1;
        s.existing = Some(attempt(st, Some("k"), "fp"));
        assert_eq!(
            code(&decide(&req(Some("k"), "fp"), &s, &params())),
            Some(DenialCode::PermitMaxCallsExceeded)
        );
    }
}

#[test]
fn resolved_executed_replays_with_receipt_else_conflict() {
    let mut s = snap(permit());
    let mut a = attempt(AttemptState::ResolvedExecuted, Some("k"), "fp");
    a.receipt = Some("R".into());
    s.existing = Some(a.clone());
    assert!(matches!(
        decide(&req(Some("k"), "fp"), &s, &params()).response,
        AuthorizeResponse::Replay { .. }
    ));
    a.receipt = None;
    s.existing = Some(a);
    let den = denial(&decide(&req(Some("k"), "fp"), &s, &params()));
    assert_eq!(den.code, DenialCode::IdempotencyKeyConflict);
    assert!(den.message.contains("no receipt"));
}

#[test]
fn pruned_tombstone_is_key_expired_for_any_fingerprint() {
    for fp in ["fp", "other"] {
        let mut s = snap(permit());
        let mut a = attempt(AttemptState::Completed, Some("k"), "fp");
        a.pruned_at_ms = Some(NOW - 1);
        s.existing = Some(a);
        assert_eq!(
            code(&decide(&req(Some("k"), fp), &s, &params())),
            Some(DenialCode::IdempotencyKeyExpired)
        );
    }
}

#[test]
fn expired_permit_denies_new_calls() {
    let mut p = permit();
    p.expires_at_ms = NOW;
    assert_eq!(
        code(&decide(&req(Some("k"), "fp"), &snap(p), &params())),
        Some(DenialCode::PermitExpired)
    );
}

#[test]
fn tool_scope() {
    let mut p = permit();
    p.policy.rules.tools = vec!["search".into(), "pay".into()];
    assert!(is_dispatch(&decide(
        &req(None, "fp"),
        &snap(p.clone()),
        &params()
    )));
    p.policy.rules.tools = vec!["search".into()];
    let den = denial(&decide(&req(None, "fp"), &snap(p), &params()));
    assert_eq!(den.code, DenialCode::PermitToolNotAllowed);
    assert_eq!(den.data["tool"], json!("pay"));
}

#[test]
fn key_required() {
    let mut r = req(None, "fp");
    r.key_required = true;
    assert_eq!(
        code(&decide(&r, &snap(permit()), &params())),
        Some(DenialCode::IdempotencyKeyRequired)
    );
    r.idempotency_key = Some("k".into());
    assert!(is_dispatch(&decide(&r, &snap(permit()), &params())));
}

#[test]
fn cap_per_tool_and_default() {
    let mut p = permit();
    p.policy.rules.max_calls.insert("pay".into(), 2);
    p.policy.rules.max_calls_default = Some(100);
    let mut s = snap(p.clone());
    s.usage.calls_made = 1;
    assert!(is_dispatch(&decide(&req(None, "fp"), &s, &params())));
    s.usage.calls_made = 2;
    let den = denial(&decide(&req(None, "fp"), &s, &params()));
    assert_eq!(den.code, DenialCode::PermitMaxCallsExceeded);
    assert_eq!(den.data["tool"], json!("pay"));
    assert_eq!(den.data["limit"], json!(2));
    assert_eq!(den.data["calls_made"], json!(2));

    p.policy.rules.max_calls.clear();
    p.policy.rules.max_calls_default = Some(0);
    assert_eq!(
        code(&decide(&req(None, "fp"), &snap(p), &params())),
        Some(DenialCode::PermitMaxCallsExceeded)
    );
}

#[test]
fn budget_with_fixed_and_pointer_costs() {
    let mut p = permit();
    p.policy.rules.budget = Some(100);
    p.policy
        .rules
        .cost
        .insert("pay".into(), CostRule::Pointer("/amount".into()));
    let mut s = snap(p.clone());
    s.budget = BudgetTotals {
        spent: 60,
        reserved: 30,
    };
    let mut r = req(None, "fp");
    r.arguments = json!({"amount": 10});
    let d = decide(&r, &s, &params());
    let Mutation::Reserve(a) = &d.mutation else {
        panic!("not reserved")
    };
    assert_eq!(a.cost, 10);

    r.arguments = json!({"amount": 11});
    let den = denial(&decide(&r, &s, &params()));
    assert_eq!(den.code, DenialCode::PermitBudgetExceeded);
    assert_eq!(den.data["budget"], json!(100));
    assert_eq!(den.data["spent"], json!(60));
    assert_eq!(den.data["reserved"], json!(30));
    assert_eq!(den.data["cost"], json!(11));

    for bad in [
        json!({}),
        json!({"amount": -1}),
        json!({"amount": 1.5}),
        json!({"amount": "3"}),
    ] {
        r.arguments = bad;
        let den = denial(&decide(&r, &s, &params()));
        assert_eq!(den.code, DenialCode::PermitBudgetExceeded);
        assert_eq!(den.data["error"], json!("cost_unresolvable"));
        assert!(den.message.contains("/amount"));
    }

    p.policy.rules.cost.insert("pay".into(), CostRule::Fixed(7));
    p.policy.rules.budget = None;
    let mut s = snap(p);
    s.budget = BudgetTotals {
        spent: u64::MAX / 2,
        reserved: 0,
    };
    let d = decide(&req(None, "fp"), &s, &params());
    let Mutation::Reserve(a) = &d.mutation else {
        panic!("no budget means no limit")
    };
    assert_eq!(a.cost, 7);
}

#[test]
fn cost_default_applies_to_other_tools() {
    let mut p = permit();
    p.policy.rules.cost_default = 3;
    p.policy.rules.budget = Some(5);
    let mut s = snap(p);
    s.budget.spent = 2;
    assert!(is_dispatch(&decide(&req(None, "fp"), &s, &params())));
    s.budget.spent = 3;
    assert_eq!(
        code(&decide(&req(None, "fp"), &s, &params())),
        Some(DenialCode::PermitBudgetExceeded)
    );
}

fn dup_snapshot(mode: GuardMode) -> Snapshot {
    let mut p = permit();
    p.policy.rules.duplicate_guard = mode;
    let mut s = snap(p);
    s.recent_duplicate = Some(attempt(AttemptState::Completed, Some("k-old"), "fp"));
    s
}

#[test]
fn duplicate_guard_off_log_enforce() {
    let d = decide(
        &req(Some("k-new"), "fp"),
        &dup_snapshot(GuardMode::Off),
        &params(),
    );
    assert!(is_dispatch(&d));
    assert!(d.notices.is_empty());

    let d = decide(
        &req(Some("k-new"), "fp"),
        &dup_snapshot(GuardMode::Log),
        &params(),
    );
    assert!(is_dispatch(&d));
    assert_eq!(
        d.notices,
        vec![Notice::DuplicateLogged {
            earlier_attempt_id: "att_old".into()
        }]
    );

    let d = decide(
        &req(Some("k-new"), "fp"),
        &dup_snapshot(GuardMode::Enforce),
        &params(),
    );
    assert_eq!(code(&d), Some(DenialCode::DuplicateRequestSuspected));
    assert_eq!(d.mutation, Mutation::None);
    // No key at all counts as a different key.
    let d = decide(
        &req(None, "fp"),
        &dup_snapshot(GuardMode::Enforce),
        &params(),
    );
    assert_eq!(code(&d), Some(DenialCode::DuplicateRequestSuspected));
}

#[test]
fn duplicate_guard_ignores_given_back_old_and_other_fingerprints() {
    let mut s = dup_snapshot(GuardMode::Enforce);
    if let Some(a) = s.recent_duplicate.as_mut() {
        a.state = AttemptState::Released;
    }
    assert!(is_dispatch(&decide(
        &req(Some("k-new"), "fp"),
        &s,
        &params()
    )));

    let mut s = dup_snapshot(GuardMode::Enforce);
    if let Some(a) = s.recent_duplicate.as_mut() {
        a.created_at_ms = NOW - 25 * HOUR;
    }
    assert!(is_dispatch(&decide(
        &req(Some("k-new"), "fp"),
        &s,
        &params()
    )));

    let s = dup_snapshot(GuardMode::Enforce);
    assert!(is_dispatch(&decide(
        &req(Some("k-new"), "other"),
        &s,
        &params()
    )));
}

#[test]
fn order_of_new_call_checks() {
    // Expiry before scope before cap before budget.
    let mut p = permit();
    p.expires_at_ms = NOW;
    p.policy.rules.tools = vec!["search".into()];
    p.policy.rules.max_calls_default = Some(0);
    p.policy.rules.budget = Some(0);
    p.policy.rules.cost_default = 1;
    assert_eq!(
        code(&decide(&req(None, "fp"), &snap(p.clone()), &params())),
        Some(DenialCode::PermitExpired)
    );
    p.expires_at_ms = NOW + 1;
    assert_eq!(
        code(&decide(&req(None, "fp"), &snap(p.clone()), &params())),
        Some(DenialCode::PermitToolNotAllowed)
    );
    p.policy.rules.tools = vec!["*".into()];
    assert_eq!(
        code(&decide(&req(None, "fp"), &snap(p.clone()), &params())),
        Some(DenialCode::PermitMaxCallsExceeded)
    );
    p.policy.rules.max_calls_default = None;
    assert_eq!(
        code(&decide(&req(None, "fp"), &snap(p), &params())),
        Some(DenialCode::PermitBudgetExceeded)
    );
}

#[test]
fn outcomes_only_move_in_flight() {
    let a = attempt(AttemptState::InFlight, Some("k"), "fp");
    let (ack, next) = apply_outcome(
        Some(&a),
        &rep(Outcome::Completed {
            receipt: "R".into(),
        }),
        NOW,
    );
    assert_eq!(ack, OutcomeAck::Applied);
    let next = next.unwrap();
    assert_eq!(next.state, AttemptState::Completed);
    assert_eq!(next.receipt.as_deref(), Some("R"));
    assert_eq!(next.finished_at_ms, Some(NOW));

    let (ack, next) = apply_outcome(
        Some(&a),
        &rep(Outcome::Released {
            reason: "refused".into(),
        }),
        NOW,
    );
    assert_eq!(ack, OutcomeAck::Applied);
    assert_eq!(next.unwrap().state, AttemptState::Released);
    let (ack, next) = apply_outcome(
        Some(&a),
        &rep(Outcome::Uncertain {
            reason: "reset".into(),
        }),
        NOW,
    );
    assert_eq!(ack, OutcomeAck::Applied);
    assert_eq!(next.unwrap().reason.as_deref(), Some("reset"));

    let done = attempt(AttemptState::Completed, Some("k"), "fp");
    assert_eq!(
        apply_outcome(
            Some(&done),
            &rep(Outcome::Completed {
                receipt: "R2".into()
            }),
            NOW
        ),
        (OutcomeAck::AlreadyRecorded, None)
    );
    let unc = attempt(AttemptState::Uncertain, Some("k"), "fp");
    assert_eq!(
        apply_outcome(
            Some(&unc),
            &rep(Outcome::Completed {
                receipt: "R".into()
            }),
            NOW
        ),
        (OutcomeAck::Conflict, None)
    );
    assert_eq!(
        apply_outcome(
            Some(&unc),
            &rep(Outcome::Released { reason: "x".into() }),
            NOW
        ),
        (OutcomeAck::Conflict, None)
    );
    assert_eq!(
        apply_outcome(None, &rep(Outcome::Released { reason: "x".into() }), NOW),
        (OutcomeAck::UnknownAttempt, None)
    );
}

#[test]
fn resolution_effects() {
    let unc = attempt(AttemptState::Uncertain, Some("k"), "fp");
    let input = ResolveInput {
        executed: true,
        receipt: Some("R".into()),
        note: Some("checked".into()),
        by: "alice".into(),
        source: Default::default(),
    };
    let r = resolve(&unc, &input, NOW).unwrap();
    assert_eq!(r.state, AttemptState::ResolvedExecuted);
    assert!(r.state.holds_slot() && r.state.spends_budget());
    assert_eq!(r.receipt.as_deref(), Some("R"));
    let res = r.resolution.unwrap();
    assert_eq!(
        (res.by.as_str(), res.at_ms, res.note.as_deref()),
        ("alice", NOW, Some("checked"))
    );

    let r = resolve(
        &unc,
        &ResolveInput {
            executed: false,
            receipt: None,
            note: None,
            by: "bob".into(),
            source: Default::default(),
        },
        NOW,
    )
    .unwrap();
    assert_eq!(r.state, AttemptState::ResolvedNotExecuted);
    assert!(r.state.gave_back() && !r.state.spends_budget());

    for st in AttemptState::ALL
        .into_iter()
        .filter(|s| *s != AttemptState::Uncertain)
    {
        assert!(matches!(
            resolve(&attempt(st, None, "fp"), &input, NOW),
            Err(ResolveError::NotUncertain(s)) if s == st
        ));
    }
}

#[test]
fn a_resolution_names_someone_and_a_receipt_only_with_a_call_that_ran() {
    let input = |executed: bool, receipt: Option<&str>, by: &str| ResolveInput {
        executed,
        receipt: receipt.map(String::from),
        note: None,
        by: by.into(),
        source: Default::default(),
    };
    assert_eq!(input(true, Some("R"), "alice").check(), Ok(()));
    assert_eq!(input(false, None, "alice").check(), Ok(()));
    let refused = input(true, None, " ").check().unwrap_err();
    assert_eq!(refused, InvalidResolution::NoResolver);
    assert_eq!(refused.to_string(), "by must name who resolved the attempt");
    let refused = input(false, Some("R"), "alice").check().unwrap_err();
    assert_eq!(refused, InvalidResolution::ReceiptWithoutExecution);
    assert_eq!(
        refused.to_string(),
        "a receipt only goes with executed: true"
    );
}

#[test]
fn sweeper_turns_expired_leases_uncertain_never_released() {
    let mut a = attempt(AttemptState::InFlight, None, "fp");
    a.lease_expires_at_ms = NOW;
    assert_eq!(expire_lease(&a, NOW - 1), None);
    let next = expire_lease(&a, NOW).unwrap();
    assert_eq!(next.state, AttemptState::Uncertain);
    assert_eq!(next.reason.as_deref(), Some(LEASE_EXPIRED_REASON));
    for st in AttemptState::ALL.into_iter().filter(|s| !s.leased()) {
        let mut b = attempt(st, None, "fp");
        b.lease_expires_at_ms = NOW - HOUR;
        assert_eq!(expire_lease(&b, NOW), None, "{st}");
    }
}

#[test]
fn retention_prunes_finished_receipts_to_tombstones_never_uncertain() {
    let mut a = attempt(AttemptState::Completed, Some("k"), "fp");
    a.receipt = Some("R".into());
    a.finished_at_ms = Some(NOW - HOUR);
    assert_eq!(prune(&a, 2 * HOUR, NOW), None);
    let t = prune(&a, HOUR, NOW).unwrap();
    assert_eq!(t.receipt, None);
    assert_eq!(t.pruned_at_ms, Some(NOW));
    assert_eq!(t.state, AttemptState::Completed, "the slot stays taken");
    assert_eq!(prune(&t, HOUR, NOW + HOUR), None, "already a tombstone");

    for st in [
        AttemptState::Uncertain,
        AttemptState::InFlight,
        AttemptState::Released,
    ] {
        let mut b = attempt(st, Some("k"), "fp");
        b.updated_at_ms = NOW - 100 * HOUR;
        b.created_at_ms = NOW - 100 * HOUR;
        assert_eq!(prune(&b, HOUR, NOW), None, "{st}");
    }
    let mut r = attempt(AttemptState::ResolvedExecuted, Some("k"), "fp");
    r.finished_at_ms = Some(NOW - 2 * HOUR);
    r.receipt = Some("R".into());
    assert!(prune(&r, HOUR, NOW).is_some());

    // A tombstone answers idempotency_key_expired.
    let mut s = snap(permit());
    s.existing = Some(t);
    assert_eq!(
        code(&decide(&req(Some("k"), "fp"), &s, &params())),
        Some(DenialCode::IdempotencyKeyExpired)
    );
}

fn continuation(key: Option<&str>, fp: &str) -> AuthorizeRequest {
    AuthorizeRequest {
        continuation: true,
        ..req(key, fp)
    }
}

#[test]
fn awaiting_input_continuation_dispatches_again_under_the_same_attempt() {
    let mut s = snap(permit());
    let mut waiting = attempt(AttemptState::AwaitingInput, Some("k"), "fp");
    waiting.cost = 7;
    s.existing = Some(waiting.clone());
    // Even at the cap: the slot is the attempt's own.
    s.usage.calls_made = 1;
    let mut p = permit();
    p.policy.rules.max_calls.insert("pay".into(), 1);
    s.permit = Some(p);
    let round_2 = DecideParams {
        new_capability: "cap-of-round-2".into(),
        ..params()
    };
    let d = decide(&continuation(Some("k"), "fp"), &s, &round_2);
    assert_eq!(
        d.response,
        AuthorizeResponse::Dispatch {
            attempt_id: "att_old".into(),
            permit_id: PID.into(),
            lease_ms: 60_000,
            round: 2,
            capability: "cap-of-round-2".into(),
            // The cap is reached by this very attempt, which takes no second slot.
            limits: open_limits().map(|l| l.with_calls_left(Some(0))),
            signature: None,
            credential: None,
        }
    );
    let Mutation::Update(next) = d.mutation else {
        panic!(
            "expected an update of the same attempt, got {:?}",
            d.mutation
        )
    };
    assert_eq!(next.id, "att_old");
    assert_eq!(next.state, AttemptState::InFlight);
    assert_eq!(next.cost, 7, "no new budget");
    assert_eq!(next.lease_expires_at_ms, NOW + 60_000);
    assert_eq!(next.updated_at_ms, NOW);
    assert_eq!(next.round, 2);
    assert_eq!(
        next.capability_hash,
        Some(token::sha256_hex("cap-of-round-2")),
        "only the new round's capability is kept, hashed"
    );
}

/// A request whose filter forwards `value` in `carriers`.
fn forwarded_in(mut r: AuthorizeRequest, value: &str, carriers: &[KeyCarrier]) -> AuthorizeRequest {
    r.forwarded_key = Some(value.into());
    r.forwarded_key_carriers = carriers.iter().copied().collect();
    r
}

/// Where the forwarded key went is recorded with the value, from the same round: a new call
/// takes both; a continuation keeps round 1's pair even when it says otherwise, and an
/// attempt that had no value learns the pair together.
#[test]
fn the_forwarded_keys_carriers_travel_with_its_value() {
    let reserved = |d: Decision| match d.mutation {
        Mutation::Reserve(a) | Mutation::Update(a) => a,
        other => panic!("expected a write of the attempt, got {other:?}"),
    };
    let r = forwarded_in(req(Some("k"), "fp"), "fwd-1", &[KeyCarrier::Meta]);
    let new = reserved(decide(&r, &snap(permit()), &params()));
    assert_eq!(new.forwarded_key.as_deref(), Some("fwd-1"));
    assert_eq!(
        new.forwarded_key_carriers,
        KeyCarriers::NONE.with(KeyCarrier::Meta)
    );

    let mut s = snap(permit());
    let mut waiting = attempt(AttemptState::AwaitingInput, Some("k"), "fp");
    waiting.forwarded_key = Some("fwd-1".into());
    waiting.forwarded_key_carriers = KeyCarriers::NONE.with(KeyCarrier::Meta);
    s.existing = Some(waiting.clone());
    let later = AuthorizeRequest {
        continuation: true,
        ..forwarded_in(req(Some("k"), "fp"), "fwd-2", &[KeyCarrier::Header])
    };
    let kept = reserved(decide(&later, &s, &params()));
    assert_eq!(
        (kept.forwarded_key.as_deref(), kept.forwarded_key_carriers),
        (Some("fwd-1"), KeyCarriers::NONE.with(KeyCarrier::Meta))
    );

    // Round 1 stated nothing (an older filter): its carriers stay unknown, not the
    // continuation's, while the value is learnt with the carriers it went in.
    waiting.forwarded_key = None;
    waiting.forwarded_key_carriers = KeyCarriers::NONE;
    s.existing = Some(waiting);
    let learnt = reserved(decide(&later, &s, &params()));
    assert_eq!(
        (
            learnt.forwarded_key.as_deref(),
            learnt.forwarded_key_carriers
        ),
        (Some("fwd-2"), KeyCarriers::NONE.with(KeyCarrier::Header))
    );
}

#[test]
fn carriers_without_a_forwarded_value_are_refused() {
    let mut r = req(Some("k"), "fp");
    assert_eq!(check_forwarded(&r), Ok(()));
    r.forwarded_key_carriers = KeyCarriers::NONE.with(KeyCarrier::Header);
    assert_eq!(
        check_forwarded(&r),
        Err("forwarded_key_carriers needs a forwarded_key".into())
    );
    r.forwarded_key = Some("fwd".into());
    assert_eq!(check_forwarded(&r), Ok(()));
    r.forwarded_key = Some(String::new());
    assert!(check_forwarded(&r).is_err());
}

/// The attempt after its continuation was dispatched: round 2, in flight.
fn in_round_2() -> Attempt {
    Attempt {
        round: 2,
        capability_hash: Some(token::sha256_hex("cap-2")),
        ..attempt(AttemptState::InFlight, Some("k"), "fp")
    }
}

fn rep_round(round: u32, capability: &str, outcome: Outcome) -> OutcomeReport {
    OutcomeReport {
        round,
        capability: capability.into(),
        ..rep(outcome)
    }
}

#[test]
fn a_late_report_of_an_earlier_round_changes_nothing() {
    let a = in_round_2();
    for outcome in [
        Outcome::InputRequired {
            receipt: "ASK".into(),
        },
        Outcome::Released {
            reason: "never_sent".into(),
        },
        Outcome::Completed {
            receipt: "R".into(),
        },
    ] {
        // Even with round 1's real capability: that round is over.
        assert_eq!(
            apply_outcome(Some(&a), &rep_round(1, CAP, outcome), NOW),
            (OutcomeAck::StaleRound, None)
        );
    }
}

#[test]
fn a_report_without_the_rounds_capability_is_refused() {
    let a = in_round_2();
    let released = || Outcome::Released {
        reason: "never_sent".into(),
    };
    for (round, capability) in [(2, "guess"), (2, ""), (2, CAP), (3, "cap-2"), (0, "cap-2")] {
        assert_eq!(
            apply_outcome(Some(&a), &rep_round(round, capability, released()), NOW),
            (OutcomeAck::Refused, None),
            "round {round} capability {capability:?}"
        );
    }
    // An attempt stored before rounds existed has no capability: nothing moves it.
    let legacy = Attempt {
        capability_hash: None,
        ..attempt(AttemptState::InFlight, Some("k"), "fp")
    };
    assert_eq!(
        apply_outcome(Some(&legacy), &rep(released()), NOW),
        (OutcomeAck::Refused, None)
    );
    // The right one applies.
    let (ack, next) = apply_outcome(Some(&a), &rep_round(2, "cap-2", released()), NOW);
    assert_eq!(ack, OutcomeAck::Applied);
    assert!(next.is_some());
}

#[test]
fn a_continuation_that_never_left_waits_for_input_again_and_is_never_released() {
    let a = in_round_2();
    let never_sent = Outcome::Released {
        reason: "never_delivered: response_flags=0x20(UF)".into(),
    };
    let (ack, next) = apply_outcome(Some(&a), &rep_round(2, "cap-2", never_sent.clone()), NOW);
    assert_eq!(ack, OutcomeAck::Applied);
    let next = next.unwrap_or_else(|| panic!("no update"));
    assert_eq!(next.state, AttemptState::AwaitingInput);
    assert!(next.state.holds_slot() && next.state.reserves_budget());
    assert_eq!(next.lease_expires_at_ms, NOW + 55_000, "lease renewed");
    // The same report again is already recorded; it never turns into a release.
    assert_eq!(
        apply_outcome(Some(&next), &rep_round(2, "cap-2", never_sent), NOW),
        (OutcomeAck::AlreadyRecorded, None)
    );
    // Round 1 that never left gives the slot back, as before.
    let first = attempt(AttemptState::InFlight, Some("k"), "fp");
    let (_, next) = apply_outcome(
        Some(&first),
        &rep(Outcome::Released {
            reason: "never_sent".into(),
        }),
        NOW,
    );
    assert_eq!(next.map(|a| a.state), Some(AttemptState::Released));
}

#[test]
fn awaiting_input_without_continuation_is_in_progress() {
    let mut s = snap(permit());
    s.existing = Some(attempt(AttemptState::AwaitingInput, Some("k"), "fp"));
    let d = decide(&req(Some("k"), "fp"), &s, &params());
    let den = denial(&d);
    assert_eq!(den.code, DenialCode::IdempotencyInProgress);
    assert_eq!(den.data["awaiting_input"], json!(true));
    assert!(den.data["retry_after"].as_i64().unwrap_or(0) >= 1);
    assert_eq!(d.mutation, Mutation::None);
    // A different fingerprint is a conflict, continuation or not.
    for r in [req(Some("k"), "other"), continuation(Some("k"), "other")] {
        assert_eq!(
            code(&decide(&r, &s, &params())),
            Some(DenialCode::IdempotencyKeyConflict)
        );
    }
}

#[test]
fn awaiting_input_continuation_after_expiry_is_denied() {
    let mut p = permit();
    p.expires_at_ms = NOW - 1;
    let mut s = snap(p);
    s.existing = Some(attempt(AttemptState::AwaitingInput, Some("k"), "fp"));
    let d = decide(&continuation(Some("k"), "fp"), &s, &params());
    assert_eq!(code(&d), Some(DenialCode::PermitExpired));
    assert_eq!(d.mutation, Mutation::None);
}

#[test]
fn continuation_flag_changes_nothing_in_other_states() {
    // in_flight: still in progress; completed: replay; no attempt: a new call.
    let mut s = snap(permit());
    s.existing = Some(attempt(AttemptState::InFlight, Some("k"), "fp"));
    assert_eq!(
        code(&decide(&continuation(Some("k"), "fp"), &s, &params())),
        Some(DenialCode::IdempotencyInProgress)
    );
    let mut done = attempt(AttemptState::Completed, Some("k"), "fp");
    done.receipt = Some("R".into());
    s.existing = Some(done);
    assert!(matches!(
        decide(&continuation(Some("k"), "fp"), &s, &params()).response,
        AuthorizeResponse::Replay { .. }
    ));
    assert!(is_dispatch(&decide(
        &continuation(Some("k2"), "fp"),
        &snap(permit()),
        &params()
    )));
    assert!(is_dispatch(&decide(
        &continuation(None, "fp"),
        &snap(permit()),
        &params()
    )));
}

#[test]
fn accepted_task_handle_replays_like_a_receipt() {
    let mut s = snap(permit());
    let mut acc = attempt(AttemptState::Accepted, Some("k"), "fp");
    acc.receipt = Some("HANDLE".into());
    s.existing = Some(acc);
    let d = decide(&req(Some("k"), "fp"), &s, &params());
    assert_eq!(
        d.response,
        AuthorizeResponse::Replay {
            attempt_id: "att_old".into(),
            receipt: "HANDLE".into(),
            limits: open_limits(),
        }
    );
    assert_eq!(
        code(&decide(&req(Some("k"), "x"), &s, &params())),
        Some(DenialCode::IdempotencyKeyConflict)
    );
}

#[test]
fn input_required_and_accepted_outcomes() {
    let inflight = attempt(AttemptState::InFlight, Some("k"), "fp");
    let (ack, next) = apply_outcome(
        Some(&inflight),
        &rep(Outcome::InputRequired {
            receipt: "ASK".into(),
        }),
        NOW,
    );
    assert_eq!(ack, OutcomeAck::Applied);
    let next = next.unwrap_or_else(|| panic!("no update"));
    assert_eq!(next.state, AttemptState::AwaitingInput);
    assert_eq!(next.receipt.as_deref(), Some("ASK"));
    // Lease renewed for the dispatch lease's length (updated NOW-5s, expiring NOW+50s → 55s).
    assert_eq!(next.lease_expires_at_ms, NOW + 55_000);
    // A repeated report is already recorded; a late one on a continued attempt conflicts nothing away.
    let (ack, none) = apply_outcome(
        Some(&next),
        &rep(Outcome::InputRequired {
            receipt: "ASK".into(),
        }),
        NOW,
    );
    assert_eq!((ack, none), (OutcomeAck::AlreadyRecorded, None));
    let (ack, none) = apply_outcome(
        Some(&next),
        &rep(Outcome::Completed {
            receipt: "R".into(),
        }),
        NOW,
    );
    assert_eq!((ack, none), (OutcomeAck::Conflict, None));

    let (ack, next) = apply_outcome(
        Some(&inflight),
        &rep(Outcome::Accepted {
            receipt: "HANDLE".into(),
        }),
        NOW,
    );
    assert_eq!(ack, OutcomeAck::Applied);
    let next = next.unwrap_or_else(|| panic!("no update"));
    assert_eq!(next.state, AttemptState::Accepted);
    assert_eq!(next.receipt.as_deref(), Some("HANDLE"));
    assert_eq!(next.finished_at_ms, Some(NOW));
}

#[test]
fn sweeper_turns_abandoned_input_uncertain_and_prunes_accepted() {
    let mut waiting = attempt(AttemptState::AwaitingInput, Some("k"), "fp");
    waiting.lease_expires_at_ms = NOW;
    let swept = expire_lease(&waiting, NOW).unwrap_or_else(|| panic!("not swept"));
    assert_eq!(swept.state, AttemptState::Uncertain);
    assert_eq!(swept.reason.as_deref(), Some(INPUT_ABANDONED_REASON));
    assert!(expire_lease(&waiting, NOW - 1).is_none());
    let mut acc = attempt(AttemptState::Accepted, Some("k"), "fp");
    acc.receipt = Some("HANDLE".into());
    acc.finished_at_ms = Some(NOW - 25 * HOUR);
    assert!(expire_lease(&acc, NOW + HOUR).is_none());
    let pruned = prune(&acc, 24 * HOUR, NOW).unwrap_or_else(|| panic!("not pruned"));
    assert_eq!(pruned.receipt, None);
}

/// A permit with a cap of 3 on `pay`, a budget of 100 and `pay` costing `/amount`.
fn capped() -> Permit {
    let mut p = permit();
    p.policy.rules.max_calls.insert("pay".into(), 3);
    p.policy.rules.budget = Some(100);
    p.policy
        .rules
        .cost
        .insert("pay".into(), CostRule::Pointer("/amount".into()));
    p
}

/// `capped()` with one `pay` slot held, 10 spent and 5 reserved.
fn capped_snap() -> Snapshot {
    Snapshot {
        usage: ToolUsage { calls_made: 1 },
        budget: BudgetTotals {
            spent: 10,
            reserved: 5,
        },
        ..snap(capped())
    }
}

fn limits_of(d: &Decision) -> Option<PermitLimits> {
    match &d.response {
        AuthorizeResponse::Dispatch { limits, .. } | AuthorizeResponse::Replay { limits, .. } => {
            limits.clone()
        }
        AuthorizeResponse::Deny(x) => x.limits.clone(),
    }
}

fn figures(calls_left: Option<u64>, budget_left: Option<u64>) -> Option<PermitLimits> {
    Some(
        PermitLimits::until(crate::clock::rfc3339(NOW + HOUR))
            .with_calls_left(calls_left)
            .with_budget_left(budget_left),
    )
}

#[test]
fn a_dispatch_shows_what_is_left_after_its_own_reservation() {
    // Cap 3, one held, this one takes a second; 100 - 10 spent - 5 reserved - 5 for this call.
    let d = decide(&req(Some("k"), "fp"), &capped_snap(), &params());
    assert!(is_dispatch(&d));
    assert_eq!(limits_of(&d), figures(Some(1), Some(80)));
}

#[test]
fn a_new_reservation_reports_the_share_of_each_limit_it_left() {
    // Cap 3 with this call's slot: 1 of 3 left; budget 100 with this call's 5: 80 left.
    let d = decide(&req(Some("k"), "fp"), &capped_snap(), &params());
    assert!(is_dispatch(&d));
    assert_eq!(
        d.headroom,
        Some(Headroom {
            calls: Some(1.0 / 3.0),
            budget: Some(0.8),
        })
    );
    // The last slot: nothing left.
    let mut last = capped_snap();
    last.usage.calls_made = 2;
    let d = decide(&req(Some("k"), "fp"), &last, &params());
    assert_eq!(d.headroom.and_then(|h| h.calls), Some(0.0));
    // A permit without cap or budget has neither share.
    let open = decide(&req(Some("k"), "fp"), &snap(permit()), &params());
    assert_eq!(
        open.headroom,
        Some(Headroom {
            calls: None,
            budget: None
        })
    );
    // Replays and denials reserve nothing, so they report none.
    let mut s = capped_snap();
    let mut done = attempt(AttemptState::Completed, Some("k"), "fp");
    done.receipt = Some("R".into());
    s.existing = Some(done);
    assert_eq!(decide(&req(Some("k"), "fp"), &s, &params()).headroom, None);
    let mut full = capped_snap();
    full.usage.calls_made = 3;
    assert_eq!(
        decide(&req(Some("k2"), "fp"), &full, &params()).headroom,
        None
    );
}

#[test]
fn replays_and_denials_show_the_counters_as_they_stand() {
    let mut s = capped_snap();
    let mut done = attempt(AttemptState::Completed, Some("k"), "fp");
    done.receipt = Some("R".into());
    s.existing = Some(done);
    let replay = decide(&req(Some("k"), "fp"), &s, &params());
    assert!(matches!(replay.response, AuthorizeResponse::Replay { .. }));
    assert_eq!(limits_of(&replay), figures(Some(2), Some(85)));
    let conflict = decide(&req(Some("k"), "other"), &s, &params());
    assert_eq!(code(&conflict), Some(DenialCode::IdempotencyKeyConflict));
    assert_eq!(limits_of(&conflict), figures(Some(2), Some(85)));

    let mut full = capped_snap();
    full.usage.calls_made = 3;
    let d = decide(&req(Some("k2"), "fp"), &full, &params());
    assert_eq!(code(&d), Some(DenialCode::PermitMaxCallsExceeded));
    assert_eq!(limits_of(&d), figures(Some(0), Some(85)));

    let mut broke = capped_snap();
    broke.budget.spent = 96;
    let d = decide(&req(Some("k2"), "fp"), &broke, &params());
    assert_eq!(code(&d), Some(DenialCode::PermitBudgetExceeded));
    assert_eq!(limits_of(&d), figures(Some(2), Some(0)));
}

#[test]
fn a_continuation_takes_nothing_new() {
    let mut s = capped_snap();
    s.existing = Some(attempt(AttemptState::AwaitingInput, Some("k"), "fp"));
    let d = decide(&continuation(Some("k"), "fp"), &s, &params());
    assert!(matches!(
        d.response,
        AuthorizeResponse::Dispatch { round: 2, .. }
    ));
    assert_eq!(limits_of(&d), figures(Some(2), Some(85)));
}

#[test]
fn no_calls_are_left_outside_the_scope_or_past_expiry() {
    let mut s = capped_snap();
    s.permit = s.permit.map(|mut p| {
        p.policy.rules.tools = vec!["echo".into()];
        p
    });
    let d = decide(&req(Some("k"), "fp"), &s, &params());
    assert_eq!(code(&d), Some(DenialCode::PermitToolNotAllowed));
    assert_eq!(limits_of(&d), figures(Some(0), Some(85)));

    // Uncapped, but expired: nothing new can pass.
    let mut late = snap(permit());
    late.now_ms = NOW + HOUR;
    let d = decide(&req(Some("k"), "fp"), &late, &params());
    assert_eq!(code(&d), Some(DenialCode::PermitExpired));
    assert_eq!(limits_of(&d), figures(Some(0), None));
}

#[test]
fn an_unauthenticated_token_gets_no_figures() {
    let mut s = capped_snap();
    s.permit = s.permit.map(|mut p| {
        p.revoked_at_ms = Some(NOW - 1);
        p
    });
    let d = decide(&req(Some("k"), "fp"), &s, &params());
    assert_eq!(code(&d), Some(DenialCode::PermitInvalid));
    assert_eq!(limits_of(&d), None);
}

#[test]
fn figures_are_read_whatever_decides() {
    let p = capped();
    for existing in [
        None,
        Some(attempt(AttemptState::Completed, Some("k"), "fp")),
        Some(attempt(AttemptState::Uncertain, Some("k"), "fp")),
    ] {
        let need = reads_needed(&req(Some("k"), "fp"), &p, existing.as_ref());
        assert!(need.usage && need.budget, "{existing:?}");
        assert_eq!(need.duplicate, existing.is_none());
    }
    // Outside the scope, or without a cap, the slots are not read.
    let mut other = capped();
    other.policy.rules.tools = vec!["echo".into()];
    assert!(!reads_needed(&req(None, "fp"), &other, None).usage);
    assert!(!reads_needed(&req(None, "fp"), &permit(), None).usage);
}
