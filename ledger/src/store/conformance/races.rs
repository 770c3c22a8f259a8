//! Two handles on one store racing: caps, keys, the duplicate guard, budgets, reports,
//! resolutions, revocations.

use std::sync::Arc;

use atmost_protocol::{AuthorizeResponse, DenialCode, Outcome, OutcomeAck};
use serde_json::json;

use crate::decide::ResolveInput;
use crate::error::ResolveError;
use crate::model::{AttemptState, GuardMode};
use crate::store::AttemptFilter;

use super::support::*;

pub async fn race_cap_of_one_distinct_keys(h: &dyn Harness) {
    race_cap(h, 1).await;
}

/// Several slots: a store that decides queued calls together must count the slots taken
/// earlier in the same group, not only those already written.
pub async fn race_cap_of_three_distinct_keys(h: &dyn Harness) {
    race_cap(h, 3).await;
}

pub async fn race_same_key(h: &dyn Harness) {
    let s = h.store().await;
    let (p, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let reqs = (0..32)
        .map(|_| req(&tok, "pay", Some("one-key"), "A", json!({})))
        .collect();
    let rs = race(h, reqs).await;
    assert_eq!(count(&rs, None), 1, "{rs:?}");
    assert_eq!(count(&rs, Some(DenialCode::IdempotencyInProgress)), 31);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
}

/// Calls with distinct keys and one fingerprint race under the enforcing duplicate guard: the
/// first goes through, every later one is the duplicate of a call in flight.
pub async fn race_duplicate_guard(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.duplicate_guard = GuardMode::Enforce;
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let reqs = (0..32)
        .map(|i| req(&tok, "pay", Some(&format!("key-{i}")), "same", json!({})))
        .collect();
    let rs = race(h, reqs).await;
    assert_eq!(count(&rs, None), 1, "{rs:?}");
    assert_eq!(count(&rs, Some(DenialCode::DuplicateRequestSuspected)), 31);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
}

pub async fn race_budget(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.budget = Some(10);
    pol.rules.cost_default = 3;
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let reqs = (0..32).map(|i| nth_call(&tok, i)).collect();
    let rs = race(h, reqs).await;
    assert_eq!(count(&rs, None), 3, "{rs:?}");
    assert_eq!(count(&rs, Some(DenialCode::PermitBudgetExceeded)), 29);
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!(det.budget.reserved, 9);
}

/// Concurrent continuations of one awaiting attempt: exactly one dispatches.
pub async fn race_continuations(h: &dyn Harness) {
    let s = h.store().await;
    let (_p, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let first = req(&tok, "pay", Some("k1"), "A", json!({}));
    let a = dispatched(&auth(&*s, &first, T0).await);
    report(&*s, &a, input_required("ASK"), T0).await;
    let rs = race(h, (0..16).map(|_| continued(first.clone())).collect()).await;
    assert_eq!(count(&rs, None), 1, "{rs:?}");
    assert_eq!(count(&rs, Some(DenialCode::IdempotencyInProgress)), 15);
}

/// An outcome report against the sweeper's lease expiry: either the report is applied and the
/// sweep finds nothing, or the sweep makes the attempt `uncertain` and the report is a
/// conflict; never both.
pub async fn race_report_against_lease_expiry(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    let (p, tok) = race_permit(&*s).await;
    let lease = i64::try_from(LEASE_MS).unwrap();
    for i in 0..RACE_ROUNDS {
        let r = nth_call(&tok, i);
        let a = dispatched(&auth(&*s, &r, T0).await);
        let (outcome, target) = if i % 4 < 2 {
            (completed(&format!("R{i}")), AttemptState::Completed)
        } else {
            (released(), AttemptState::Released)
        };
        let rep = report_of(&a, outcome);
        let (x, y) = hs.sides(i);
        let (ack, swept) = together(
            async move { x.record_outcome(&rep, T0 + lease).await.unwrap().ack },
            async move { y.sweep(T0 + lease).await.unwrap().leases_expired },
        )
        .await;
        let got = s.get_attempt(&a).await.unwrap().unwrap();
        match (ack, swept, got.state) {
            (OutcomeAck::Applied, 0, state) if state == target => {}
            (OutcomeAck::Conflict, 1, AttemptState::Uncertain) => {
                assert_eq!(
                    got.reason.as_deref(),
                    Some(crate::decide::LEASE_EXPIRED_REASON)
                );
            }
            other => panic!("round {i}: not a serialization of report and sweep: {other:?}"),
        }
        counters_match_recount(&*s, &p.id).await;
    }
}

/// Two handles report different outcomes of the same round at once: exactly one is applied,
/// the other is a conflict, and the attempt holds the applied one's state.
pub async fn race_conflicting_reports_from_two_handles(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    let (p, tok) = race_permit(&*s).await;
    for i in 0..RACE_ROUNDS {
        let r = nth_call(&tok, i);
        let a = dispatched(&auth(&*s, &r, T0).await);
        let (first, second) = match i % 3 {
            0 => (completed(&format!("R{i}")), released()),
            1 => (completed(&format!("R{i}")), uncertain()),
            _ => (released(), uncertain()),
        };
        let (rx, ry) = (report_of(&a, first.clone()), report_of(&a, second.clone()));
        let (x, y) = hs.sides(i);
        let (ack_x, ack_y) = together(
            async move { x.record_outcome(&rx, T0 + 1).await.unwrap().ack },
            async move { y.record_outcome(&ry, T0 + 1).await.unwrap().ack },
        )
        .await;
        let winner = match (ack_x, ack_y) {
            (OutcomeAck::Applied, OutcomeAck::Conflict) => first,
            (OutcomeAck::Conflict, OutcomeAck::Applied) => second,
            other => panic!("round {i}: both or neither report applied: {other:?}"),
        };
        let got = s.get_attempt(&a).await.unwrap().unwrap();
        assert_eq!(
            got.state,
            crate::decide::outcome_state(&winner),
            "round {i}"
        );
        let receipt = match &winner {
            Outcome::Completed { receipt } => Some(receipt.clone()),
            _ => None,
        };
        assert_eq!(got.receipt, receipt, "round {i}");
        counters_match_recount(&*s, &p.id).await;
    }
}

/// A resolution against a late report. On an `uncertain` attempt the resolution always wins
/// and the late report is a conflict. On an `in_flight` attempt the report always applies;
/// the resolution then succeeds only if the report made it `uncertain` first, and is refused
/// `NotUncertain` otherwise.
pub async fn race_resolution_against_late_report(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    let (p, tok) = race_permit(&*s).await;
    for i in 0..RACE_ROUNDS {
        let r = nth_call(&tok, i);
        let a = dispatched(&auth(&*s, &r, T0).await);
        let executed = i.is_multiple_of(2);
        let resolved = if executed {
            AttemptState::ResolvedExecuted
        } else {
            AttemptState::ResolvedNotExecuted
        };
        let variant = i % 3;
        let late = match variant {
            0 => {
                assert_eq!(report(&*s, &a, uncertain(), T0).await, OutcomeAck::Applied);
                report_of(&a, completed("late"))
            }
            1 => report_of(&a, uncertain()),
            _ => report_of(&a, completed(&format!("R{i}"))),
        };
        let input = ResolveInput {
            executed,
            receipt: Some("checked".into()),
            note: None,
            by: "race".into(),
            source: Default::default(),
        };
        let (x, y) = hs.sides(i);
        let id = a.clone();
        let (resolution, ack) = together(
            async move { x.resolve_attempt(&id, &input, T0 + 1).await },
            async move { y.record_outcome(&late, T0 + 1).await.unwrap().ack },
        )
        .await;
        let state = state_of(&*s, &a).await;
        match (variant, &resolution, ack, state) {
            (0, Ok(att), OutcomeAck::Conflict, st) if st == resolved && att.state == resolved => {}
            (1, Ok(att), OutcomeAck::Applied, st) if st == resolved && att.state == resolved => {}
            (
                1,
                Err(ResolveError::NotUncertain(AttemptState::InFlight)),
                OutcomeAck::Applied,
                AttemptState::Uncertain,
            ) => {}
            (
                2,
                Err(ResolveError::NotUncertain(AttemptState::InFlight | AttemptState::Completed)),
                OutcomeAck::Applied,
                AttemptState::Completed,
            ) => {}
            _ => panic!(
                "round {i}: not a serialization of resolution and report: \
                 {resolution:?}, {ack:?}, {state:?}"
            ),
        }
        counters_match_recount(&*s, &p.id).await;
    }
}

/// A revocation against an authorization: either the call dispatched before the revocation
/// (its attempt exists) or it is denied `permit_invalid` and no attempt exists; afterwards
/// every handle denies the permit.
pub async fn race_revocation_against_authorization(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    for i in 0..RACE_ROUNDS {
        let (p, tok) = race_permit(&*s).await;
        let r = req(&tok, "pay", Some("k"), "f", json!({}));
        let (x, y) = hs.sides(i);
        let (pid, ar) = (p.id.clone(), r.clone());
        let (revoked, answer) = together(
            async move { x.revoke_permit(&pid, T0 + 1).await.unwrap() },
            async move {
                y.authorize(&ar, LEASE_MS, T0 + 1, patient())
                    .await
                    .unwrap()
                    .response
            },
        )
        .await;
        assert_eq!(revoked.unwrap().revoked_at_ms, Some(T0 + 1), "round {i}");
        let attempts = s
            .list_attempts(&AttemptFilter {
                permit_id: Some(p.id.clone()),
                ..AttemptFilter::default()
            })
            .await
            .unwrap();
        let ids: Vec<String> = attempts.iter().map(|a| a.id.clone()).collect();
        match &answer {
            AuthorizeResponse::Dispatch { attempt_id, .. } => {
                assert_eq!(ids, vec![attempt_id.clone()], "round {i}");
                assert_eq!(attempts[0].state, AttemptState::InFlight);
            }
            AuthorizeResponse::Deny(d) if d.code == DenialCode::PermitInvalid => {
                assert!(ids.is_empty(), "round {i}: denied, yet {ids:?}");
            }
            other => panic!("round {i}: neither dispatched nor permit_invalid: {other:?}"),
        }
        for handle in [&hs.one, &hs.two] {
            for key in ["k", "other"] {
                let again = req(&tok, "pay", Some(key), "f", json!({}));
                assert_eq!(
                    denied(&auth(&**handle, &again, T0 + 2).await),
                    DenialCode::PermitInvalid,
                    "round {i}"
                );
            }
        }
        counters_match_recount(&*s, &p.id).await;
    }
}

/// A released key dispatched again: concurrent authorizations of it from both handles
/// dispatch once, as a new attempt that the key then names.
pub async fn race_released_key_dispatched_again(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    let (p, tok) = race_permit(&*s).await;
    for i in 0..RACE_ROUNDS {
        let r = nth_call(&tok, i);
        let a = dispatched(&auth(&*s, &r, T0).await);
        assert_eq!(report(&*s, &a, released(), T0).await, OutcomeAck::Applied);
        let barrier = Arc::new(tokio::sync::Barrier::new(4));
        let tasks: Vec<_> = (0..4)
            .map(|j| {
                let (x, _) = hs.sides(i + j);
                let (b, r) = (barrier.clone(), r.clone());
                tokio::spawn(async move {
                    b.wait().await;
                    x.authorize(&r, LEASE_MS, T0 + 1, patient())
                        .await
                        .unwrap()
                        .response
                })
            })
            .collect();
        let mut rs = Vec::new();
        for t in tasks {
            rs.push(t.await.unwrap());
        }
        assert_eq!(count(&rs, None), 1, "round {i}: {rs:?}");
        assert_eq!(
            count(&rs, Some(DenialCode::IdempotencyInProgress)),
            3,
            "round {i}: {rs:?}"
        );
        let again = rs
            .iter()
            .find(|r| matches!(r, AuthorizeResponse::Dispatch { .. }))
            .map(dispatched)
            .unwrap();
        assert_ne!(again, a, "round {i}: a new attempt");
        assert_eq!(state_of(&*s, &a).await, AttemptState::Released);
        assert_eq!(
            report(&*s, &again, completed(&format!("R{i}")), T0 + 2).await,
            OutcomeAck::Applied
        );
        assert_eq!(
            auth(&*hs.two, &r, T0 + 3).await,
            AuthorizeResponse::Replay {
                attempt_id: again,
                receipt: format!("R{i}"),
                limits: None,
            }
        );
        counters_match_recount(&*s, &p.id).await;
        assert_eq!(calls_made(&*s, &p.id, "pay").await, i as u64 + 1);
    }
}
