//! Outcome reports, continuations, task handles, rounds, refusals at the tool and the bodies a
//! dispatch was signed over.

use atmost_protocol::{AuthorizeRequest, AuthorizeResponse, DenialCode, Outcome, OutcomeAck};
use serde_json::json;

use crate::model::{AttemptState, CostRule};
use crate::store::AttemptFilter;
use crate::token;

use super::support::*;

pub async fn outcome_acks(h: &dyn Harness) {
    let s = h.store().await;
    let (_p, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", None, "A", json!({})), T0).await);
    assert_eq!(
        report(&*s, &a, completed("R"), T0).await,
        OutcomeAck::Applied
    );
    assert_eq!(
        report(&*s, &a, completed("R"), T0).await,
        OutcomeAck::AlreadyRecorded
    );
    assert_eq!(report(&*s, &a, released(), T0).await, OutcomeAck::Conflict);
    assert_eq!(report(&*s, &a, uncertain(), T0).await, OutcomeAck::Conflict);
    assert_eq!(state_of(&*s, &a).await, AttemptState::Completed);
    assert_eq!(
        report(&*s, "att_unknown", released(), T0).await,
        OutcomeAck::UnknownAttempt
    );
    let b = dispatched(&auth(&*s, &req(&tok, "pay", None, "B", json!({})), T0).await);
    assert_eq!(report(&*s, &b, released(), T0).await, OutcomeAck::Applied);
    assert_eq!(
        report(&*s, &b, released(), T0).await,
        OutcomeAck::AlreadyRecorded
    );
    assert_eq!(
        report(&*s, &b, completed("late"), T0).await,
        OutcomeAck::Conflict
    );
    let got = s.get_attempt(&b).await.unwrap().unwrap();
    assert_eq!((got.state, got.receipt), (AttemptState::Released, None));
}

/// One batch of reports: applied in order, each attempt written once with its last state.
pub async fn outcome_batch(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.budget = Some(100);
    pol.rules.cost_default = 2;
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0).await);
    let b = dispatched(&auth(&*s, &req(&tok, "pay", Some("b"), "B", json!({})), T0).await);
    let c = dispatched(&auth(&*s, &req(&tok, "pay", Some("c"), "C", json!({})), T0).await);
    let batch = [
        (a.as_str(), completed("RA")),
        (b.as_str(), released()),
        (a.as_str(), completed("RA")),
        ("att_unknown", completed("X")),
        (c.as_str(), input_required("Q")),
        (b.as_str(), completed("late")),
    ]
    .into_iter()
    .map(|(id, outcome)| report_of(id, outcome))
    .collect::<Vec<_>>();
    let acks: Vec<OutcomeAck> = s
        .record_outcomes(&batch, T0 + 5)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.ack)
        .collect();
    assert_eq!(
        acks,
        vec![
            OutcomeAck::Applied,
            OutcomeAck::Applied,
            OutcomeAck::AlreadyRecorded,
            OutcomeAck::UnknownAttempt,
            OutcomeAck::Applied,
            OutcomeAck::Conflict,
        ]
    );
    let got = |id: String| {
        let s = s.clone();
        async move { s.get_attempt(&id).await.unwrap().unwrap() }
    };
    let (ga, gb, gc) = (got(a).await, got(b).await, got(c).await);
    assert_eq!(
        (ga.state, ga.receipt.as_deref(), ga.finished_at_ms),
        (AttemptState::Completed, Some("RA"), Some(T0 + 5))
    );
    assert_eq!(
        (gb.state, gb.receipt, gb.reason.as_deref()),
        (AttemptState::Released, None, Some("connection_refused"))
    );
    assert_eq!(
        (gc.state, gc.receipt.as_deref()),
        (AttemptState::AwaitingInput, Some("Q"))
    );
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    // a spent, c still reserved, b given back.
    assert_eq!((det.budget.spent, det.budget.reserved), (2, 2));
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);
}

/// `input_required` keeps the slot and reserved budget; the continuation with the same key
/// dispatches again under the same attempt, even at the cap; the sweeper turns an
/// abandoned one `uncertain`.
pub async fn input_required_continuations(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    pol.rules.budget = Some(100);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(30));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let now = T0;
    let first = req(&tok, "pay", Some("k1"), "A", json!({}));
    let a = dispatched(&auth(&*s, &first, now).await);
    assert_eq!(
        report(&*s, &a, input_required("ASK"), now + 1000).await,
        OutcomeAck::Applied
    );
    let att = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(att.state, AttemptState::AwaitingInput);
    assert_eq!(att.lease_expires_at_ms, now + 1000 + LEASE_MS as i64);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (30, 0));
    assert_eq!(
        d.attempts_by_state.get(&AttemptState::AwaitingInput),
        Some(&1)
    );
    // Without the continuation flag: in progress; other arguments: conflict; another key: cap.
    let r = auth(&*s, &first, now + 2000).await;
    assert_eq!(denied(&r), DenialCode::IdempotencyInProgress);
    assert_eq!(denial_data(&r)["awaiting_input"], json!(true));
    assert_eq!(
        denied(
            &auth(
                &*s,
                &continued(req(&tok, "pay", Some("k1"), "B", json!({}))),
                now
            )
            .await
        ),
        DenialCode::IdempotencyKeyConflict
    );
    assert_eq!(
        denied(
            &auth(
                &*s,
                &continued(req(&tok, "pay", Some("k2"), "A", json!({}))),
                now
            )
            .await
        ),
        DenialCode::PermitMaxCallsExceeded
    );
    // The continuation: same attempt, no new slot, no new budget.
    let again = dispatched(&auth(&*s, &continued(first.clone()), now + 3000).await);
    assert_eq!(again, a);
    assert_eq!(state_of(&*s, &a).await, AttemptState::InFlight);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (30, 0));
    assert_eq!(
        s.list_attempts(&AttemptFilter {
            permit_id: Some(p.id.clone()),
            ..AttemptFilter::default()
        })
        .await
        .unwrap()
        .len(),
        1
    );
    // While it runs again, a second continuation is in progress.
    assert_eq!(
        denied(&auth(&*s, &continued(first.clone()), now + 3500).await),
        DenialCode::IdempotencyInProgress
    );
    // Done: replay, budget spent once.
    assert_eq!(
        report(&*s, &a, completed("FINAL"), now + 4000).await,
        OutcomeAck::Applied
    );
    assert_eq!(
        auth(&*s, &continued(first.clone()), now + 5000).await,
        AuthorizeResponse::Replay {
            attempt_id: a.clone(),
            receipt: "FINAL".into(),
            limits: None,
        }
    );
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (0, 30));

    // Abandoned: the sweeper turns it uncertain after the renewed lease, never released.
    let (_p2, tok2) = make_permit(&*s, policy(), T0 + 10 * HOUR).await;
    let r2 = req(&tok2, "pay", Some("k9"), "Z", json!({}));
    let b = dispatched(&auth(&*s, &r2, now).await);
    report(&*s, &b, input_required("ASK"), now + 10_000).await;
    s.sweep(now + LEASE_MS as i64 + 5_000).await.unwrap();
    assert_eq!(state_of(&*s, &b).await, AttemptState::AwaitingInput);
    let swept = s.sweep(now + 10_000 + LEASE_MS as i64).await.unwrap();
    assert_eq!(swept.leases_expired, 1);
    let att = s.get_attempt(&b).await.unwrap().unwrap();
    assert_eq!(att.state, AttemptState::Uncertain);
    assert_eq!(
        att.reason.as_deref(),
        Some(crate::decide::INPUT_ABANDONED_REASON)
    );
    assert_eq!(
        denied(&auth(&*s, &continued(r2), now + 20 * MIN).await),
        DenialCode::DeliveryUncertain
    );
}

/// A task handle is recorded `accepted`: slot kept, budget spent, the handle replayed.
pub async fn accepted_task_handles(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("job".into(), 1);
    pol.rules.budget = Some(100);
    pol.rules.cost.insert("job".into(), CostRule::Fixed(40));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let now = T0;
    let r = req(&tok, "job", Some("k1"), "A", json!({}));
    let a = dispatched(&auth(&*s, &r, now).await);
    assert_eq!(
        report(
            &*s,
            &a,
            Outcome::Accepted {
                receipt: "HANDLE".into()
            },
            now
        )
        .await,
        OutcomeAck::Applied
    );
    assert_eq!(state_of(&*s, &a).await, AttemptState::Accepted);
    assert_eq!(
        auth(&*s, &r, now).await,
        AuthorizeResponse::Replay {
            attempt_id: a.clone(),
            receipt: "HANDLE".into(),
            limits: None,
        }
    );
    assert_eq!(calls_made(&*s, &p.id, "job").await, 1);
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (0, 40));
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "job", Some("k2"), "B", json!({})), now).await),
        DenialCode::PermitMaxCallsExceeded
    );
    // A late `completed` for the same attempt does not overwrite the handle.
    assert_eq!(
        report(&*s, &a, completed("LATE"), now).await,
        OutcomeAck::Conflict
    );
    // Accepted receipts are pruned past retention like completed ones.
    let swept = s.sweep(now + 25 * HOUR).await.unwrap();
    assert_eq!(swept.receipts_pruned, 1);
    assert_eq!(
        denied(&auth(&*s, &r, now + 25 * HOUR).await),
        DenialCode::IdempotencyKeyExpired
    );
}

/// Each dispatch of an attempt is a round with its own capability: only a report that names
/// the current round and carries its capability moves the attempt; a continuation that never
/// left goes back to `awaiting_input`, never `released`; all of it survives a reopen.
pub async fn rounds_and_capabilities(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    pol.rules.budget = Some(100);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(30));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let first = req(&tok, "pay", Some("k1"), "A", json!({}));
    let r1 = auth(&*s, &first, T0).await;
    let a = dispatched(&r1);
    assert!(matches!(r1, AuthorizeResponse::Dispatch { round: 1, .. }));
    let round_1_report = |o| report_of(&a, o);
    let late_release = round_1_report(released());
    let late_ask = round_1_report(input_required("ASK again"));
    assert_eq!(
        s.record_outcome(&round_1_report(input_required("ASK")), T0 + 1)
            .await
            .unwrap()
            .ack,
        OutcomeAck::Applied
    );
    let r2 = auth(&*s, &continued(first.clone()), T0 + 2).await;
    assert_eq!(dispatched(&r2), a);
    let AuthorizeResponse::Dispatch {
        round: 2,
        capability: cap2,
        ..
    } = &r2
    else {
        panic!("expected round 2, got {r2:?}")
    };
    assert_ne!(
        cap2, &late_release.capability,
        "a fresh capability per round"
    );
    // Late reports of round 1 change nothing, whatever they say.
    for late in [&late_release, &late_ask] {
        assert_eq!(
            s.record_outcome(late, T0 + 3).await.unwrap().ack,
            OutcomeAck::StaleRound
        );
    }
    // The service token without the capability: refused.
    let mut forged = report_of(&a, released());
    forged.capability = "f".repeat(64);
    assert_eq!(
        s.record_outcome(&forged, T0 + 3).await.unwrap().ack,
        OutcomeAck::Refused
    );
    assert_eq!(state_of(&*s, &a).await, AttemptState::InFlight);
    // Round 2 never left: back to waiting for input, the slot and budget still held.
    assert_eq!(
        report(&*s, &a, released(), T0 + 4).await,
        OutcomeAck::Applied
    );
    assert_eq!(state_of(&*s, &a).await, AttemptState::AwaitingInput);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (30, 0));
    // The key is not free again: the first request is still in progress, a new key is capped.
    assert_eq!(
        denied(&auth(&*s, &first, T0 + 5).await),
        DenialCode::IdempotencyInProgress
    );
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k2"), "B", json!({})), T0 + 5).await),
        DenialCode::PermitMaxCallsExceeded
    );
    // Round 3 completes; the round and its capability survive a reopen.
    let r3 = auth(&*s, &continued(first.clone()), T0 + 6).await;
    assert!(matches!(r3, AuthorizeResponse::Dispatch { round: 3, .. }));
    dispatched(&r3);
    let done = report_of(&a, completed("R"));
    assert_eq!(
        s.record_outcome(&done, T0 + 7).await.unwrap().ack,
        OutcomeAck::Applied
    );
    drop(s);
    let s = h.reopen().await;
    let att = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!((att.state, att.round), (AttemptState::Completed, 3));
    assert_eq!(
        s.record_outcome(&done, T0 + 8).await.unwrap().ack,
        OutcomeAck::AlreadyRecorded
    );
    let mut forged = done.clone();
    forged.capability = "0".repeat(64);
    assert_eq!(
        s.record_outcome(&forged, T0 + 8).await.unwrap().ack,
        OutcomeAck::Refused
    );
}

/// A verifier's refusal at the tool, reported by the gateway (docs/design.md#attempt-states):
/// proven (its HMAC checked by the server, its nonce this round's), the slot and the cost come
/// back and the same key dispatches again; unproven, the attempt is `uncertain` and keeps them.
pub async fn refusals_at_the_tool(h: &dyn Harness) {
    use atmost_protocol::signature::DispatchNonce;
    use atmost_protocol::tool_refusal::{Proof, ToolRefusal};
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    pol.rules.budget = Some(10);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(4));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let refusal = |attempt: &str, mac_verified: bool| Outcome::RefusedAtTool {
        refusal: ToolRefusal {
            code: DenialCode::SignatureKeyUnknown,
            proof: Some(Proof {
                nonce: DispatchNonce {
                    attempt_id: attempt.into(),
                    round: 1,
                    permit_id: p.id.clone(),
                    tool: "pay".into(),
                }
                .encode(),
                mac: "0f".repeat(32),
            }),
        }
        .header_value(),
        mac_verified,
    };
    let call = || req(&tok, "pay", Some("k"), "F", json!({}));
    let a = dispatched(&auth(&*s, &call(), T0).await);
    assert_eq!(
        report(&*s, &a, refusal(&a, true), T0 + 1).await,
        OutcomeAck::Applied
    );
    let refused = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(refused.state, AttemptState::RefusedAtTool);
    assert_eq!(refused.receipt, None);
    assert_eq!(
        refused.reason.as_deref(),
        Some("refused_at_tool: signature_key_unknown")
    );
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 0);
    let det = counters_match_recount(&*s, &p.id).await;
    assert_eq!((det.budget.spent, det.budget.reserved), (0, 0));
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(counts.get(&AttemptState::RefusedAtTool).copied(), Some(1));

    // The same key goes again, as a new attempt, and takes the one slot.
    let b = dispatched(&auth(&*s, &call(), T0 + 2).await);
    assert_ne!(a, b);
    // A refusal the server could not verify (a plain upstream's): no slot back.
    assert_eq!(
        report(&*s, &b, refusal(&b, false), T0 + 3).await,
        OutcomeAck::Applied
    );
    assert_eq!(state_of(&*s, &b).await, AttemptState::Uncertain);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    let det = counters_match_recount(&*s, &p.id).await;
    assert_eq!((det.budget.spent, det.budget.reserved), (4, 0));
    assert_eq!(
        denied(&auth(&*s, &call(), T0 + 4).await),
        DenialCode::DeliveryUncertain
    );
    // The refused attempt is kept as it was after a reopen.
    drop(s);
    let s = h.reopen().await;
    assert_eq!(state_of(&*s, &a).await, AttemptState::RefusedAtTool);
}

/// Each round's attempt records the SHA-256 of the body it is signed over (the dispatch
/// target's), a continuation its own; kept across a reopen; none for a round sent unsigned.
pub async fn dispatch_bodies_recorded(h: &dyn Harness) {
    use atmost_protocol::signature::DispatchTarget;
    let s = h.store().await;
    let (_, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let target = |body: &str| DispatchTarget {
        method: "POST".into(),
        authority: "tools.example:8000".into(),
        path: "/mcp".into(),
        body_sha256: token::sha256_hex(body),
        idempotency_key: None,
        validity_s: 15,
    };
    let signed = |key: &str, body: &str, continuation: bool| AuthorizeRequest {
        dispatch: Some(target(body)),
        continuation,
        ..req(&tok, "pay", Some(key), "F", json!({}))
    };
    let recorded = |a: &str| {
        let s = s.clone();
        let a = a.to_string();
        async move {
            s.get_attempt(&a)
                .await
                .unwrap()
                .unwrap()
                .dispatch_body_sha256
        }
    };
    let a = dispatched(&auth(&*s, &signed("k", "round 1", false), T0).await);
    assert_eq!(recorded(&a).await, Some(token::sha256_hex("round 1")));
    report(
        &*s,
        &a,
        Outcome::InputRequired {
            receipt: "ASK".into(),
        },
        T0 + 1,
    )
    .await;
    let again = dispatched(&auth(&*s, &signed("k", "round 2", true), T0 + 2).await);
    assert_eq!(again, a, "a continuation is the same attempt");
    assert_eq!(recorded(&a).await, Some(token::sha256_hex("round 2")));
    let unsigned = dispatched(&auth(&*s, &req(&tok, "pay", Some("u"), "U", json!({})), T0).await);
    assert_eq!(recorded(&unsigned).await, None);
    drop(s);
    let s = h.reopen().await;
    let kept = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(
        kept.dispatch_body_sha256,
        Some(token::sha256_hex("round 2"))
    );
}
