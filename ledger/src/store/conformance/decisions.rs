//! The decision table and what every answer carries, through a store.

use atmost_protocol::{AuthorizeResponse, Denial, DenialCode, OutcomeAck};
use serde_json::json;

use crate::clock;
use crate::decide::{Notice, ResolveInput};
use crate::model::{AttemptState, CostRule, GuardMode};

use super::support::*;

pub async fn decision_table(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 3);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let now = T0;

    // nothing → dispatch; in_flight same fp → in progress; different fp → conflict.
    let a1 = dispatched(&auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await);
    let r = auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await;
    assert_eq!(denied(&r), DenialCode::IdempotencyInProgress);
    assert!(denial_data(&r)["retry_after"].as_i64().unwrap() >= 1);
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k1"), "B", json!({})), now).await),
        DenialCode::IdempotencyKeyConflict
    );

    // completed same fp → replay, no slot; different fp → conflict.
    assert_eq!(
        report(&*s, &a1, completed("R1"), now).await,
        OutcomeAck::Applied
    );
    for _ in 0..2 {
        let r = auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await;
        assert_eq!(
            r,
            AuthorizeResponse::Replay {
                attempt_id: a1.clone(),
                receipt: "R1".into(),
                limits: None,
            }
        );
    }
    assert_eq!(s.get_attempt(&a1).await.unwrap().unwrap().replay_count, 2);
    let r = auth(&*s, &req(&tok, "pay", Some("k1"), "B", json!({})), now).await;
    assert_eq!(denied(&r), DenialCode::IdempotencyKeyConflict);
    assert!(!serde_json::to_string(&r).unwrap().contains("R1"));
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);

    // uncertain same fp → delivery_uncertain with the attempt id.
    let a2 = dispatched(&auth(&*s, &req(&tok, "pay", Some("k2"), "C", json!({})), now).await);
    report(&*s, &a2, uncertain(), now).await;
    let r = auth(&*s, &req(&tok, "pay", Some("k2"), "C", json!({})), now).await;
    assert_eq!(denied(&r), DenialCode::DeliveryUncertain);
    assert_eq!(denial_data(&r)["attempt_id"], json!(a2));
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k2"), "Z", json!({})), now).await),
        DenialCode::IdempotencyKeyConflict
    );

    // released same fp → new attempt under the same key; the key now maps to it.
    let a3 = dispatched(&auth(&*s, &req(&tok, "pay", Some("k3"), "D", json!({})), now).await);
    report(&*s, &a3, released(), now).await;
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k3"), "E", json!({})), now).await),
        DenialCode::IdempotencyKeyConflict
    );
    let a3b = dispatched(&auth(&*s, &req(&tok, "pay", Some("k3"), "D", json!({})), now).await);
    assert_ne!(a3, a3b);
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k3"), "D", json!({})), now).await),
        DenialCode::IdempotencyInProgress
    );
    assert_eq!(state_of(&*s, &a3).await, AttemptState::Released);

    // slots: completed + uncertain + in_flight = 3 = cap.
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 3);
    let r = auth(&*s, &req(&tok, "pay", Some("k4"), "F", json!({})), now).await;
    assert_eq!(denied(&r), DenialCode::PermitMaxCallsExceeded);
    let d = denial_data(&r);
    assert_eq!(
        (
            d["tool"].clone(),
            d["limit"].clone(),
            d["calls_made"].clone()
        ),
        (json!("pay"), json!(3), json!(3))
    );
    // Another tool has no cap here; the key scope is the permit.
    dispatched(&auth(&*s, &req(&tok, "search", Some("k4"), "G", json!({})), now).await);
    // Same key and same fp still replay at the cap.
    assert!(matches!(
        auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await,
        AuthorizeResponse::Replay { .. }
    ));

    // Keys are scoped to the permit: another permit's k1 is new.
    let (_p2, tok2) = make_permit(&*s, policy(), T0 + HOUR).await;
    dispatched(&auth(&*s, &req(&tok2, "pay", Some("k1"), "A", json!({})), now).await);

    // unknown token, wrong secret, revoked → permit_invalid.
    assert_eq!(
        denied(
            &auth(
                &*s,
                &req(
                    "atmp_pmt_nope_00000000000000000000000000000000",
                    "pay",
                    None,
                    "A",
                    json!({})
                ),
                now
            )
            .await
        ),
        DenialCode::PermitInvalid
    );
    let wrong = format!("atmp_{}_{}", p.id, "0".repeat(64));
    assert_eq!(
        denied(&auth(&*s, &req(&wrong, "pay", None, "A", json!({})), now).await),
        DenialCode::PermitInvalid
    );
    s.revoke_permit(&p.id, now).await.unwrap();
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await),
        DenialCode::PermitInvalid
    );
}

pub async fn expiry_scope_and_key_required(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.tools = vec!["pay".into()];
    let (_p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "search", None, "A", json!({})), T0).await),
        DenialCode::PermitToolNotAllowed
    );
    let mut r = req(&tok, "pay", None, "A", json!({}));
    r.key_required = true;
    assert_eq!(
        denied(&auth(&*s, &r, T0).await),
        DenialCode::IdempotencyKeyRequired
    );
    r.idempotency_key = Some("k".into());
    let a = dispatched(&auth(&*s, &r, T0).await);
    report(&*s, &a, completed("R"), T0).await;
    // After expiry: new calls denied, the completed key still replays.
    let later = T0 + HOUR;
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k2"), "B", json!({})), later).await),
        DenialCode::PermitExpired
    );
    assert!(matches!(
        auth(&*s, &r, later).await,
        AuthorizeResponse::Replay { .. }
    ));
}

pub async fn budget_reserve_spend_release(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.budget = Some(10);
    pol.rules
        .cost
        .insert("pay".into(), CostRule::Pointer("/amount".into()));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let a = dispatched(
        &auth(
            &*s,
            &req(&tok, "pay", Some("a"), "A", json!({"amount": 6})),
            T0,
        )
        .await,
    );
    let r = auth(
        &*s,
        &req(&tok, "pay", Some("b"), "B", json!({"amount": 5})),
        T0,
    )
    .await;
    assert_eq!(denied(&r), DenialCode::PermitBudgetExceeded);
    let d = denial_data(&r);
    assert_eq!(
        (
            d["budget"].clone(),
            d["spent"].clone(),
            d["reserved"].clone(),
            d["cost"].clone()
        ),
        (json!(10), json!(0), json!(6), json!(5))
    );
    let r = auth(
        &*s,
        &req(&tok, "pay", Some("c"), "C", json!({"amount": "x"})),
        T0,
    )
    .await;
    assert_eq!(denial_data(&r)["error"], json!("cost_unresolvable"));

    // Released: budget back.
    report(&*s, &a, released(), T0).await;
    let b = dispatched(
        &auth(
            &*s,
            &req(&tok, "pay", Some("b"), "B", json!({"amount": 5})),
            T0,
        )
        .await,
    );
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((det.budget.spent, det.budget.reserved), (0, 5));
    // Completed: reserved → spent.
    report(&*s, &b, completed("R"), T0).await;
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((det.budget.spent, det.budget.reserved), (5, 0));
    // Uncertain: counts as spent.
    let c = dispatched(
        &auth(
            &*s,
            &req(&tok, "pay", Some("c"), "C", json!({"amount": 4})),
            T0,
        )
        .await,
    );
    report(&*s, &c, uncertain(), T0).await;
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((det.budget.spent, det.budget.reserved), (9, 0));
    assert_eq!(
        denied(
            &auth(
                &*s,
                &req(&tok, "pay", Some("d"), "D", json!({"amount": 2})),
                T0
            )
            .await
        ),
        DenialCode::PermitBudgetExceeded
    );
    // Resolved not executed: budget back.
    s.resolve_attempt(
        &c,
        &ResolveInput {
            executed: false,
            receipt: None,
            note: None,
            by: "t".into(),
            source: Default::default(),
        },
        T0,
    )
    .await
    .unwrap();
    dispatched(
        &auth(
            &*s,
            &req(&tok, "pay", Some("d"), "D", json!({"amount": 2})),
            T0,
        )
        .await,
    );
}

pub async fn duplicate_guard_modes(h: &dyn Harness) {
    let s = h.store().await;
    for mode in [GuardMode::Off, GuardMode::Log, GuardMode::Enforce] {
        let mut pol = policy();
        pol.rules.duplicate_guard = mode;
        let (_p, tok) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
        let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("k1"), "X", json!({})), T0).await);
        report(&*s, &a, completed("R"), T0).await;
        let d = s
            .authorize(
                &req(&tok, "pay", Some("k2"), "X", json!({})),
                LEASE_MS,
                T0 + 1,
                patient(),
            )
            .await
            .unwrap();
        match mode {
            GuardMode::Off => {
                dispatched(&d.response);
                assert!(d.notices.is_empty());
            }
            GuardMode::Log => {
                dispatched(&d.response);
                assert_eq!(
                    d.notices,
                    vec![Notice::DuplicateLogged {
                        earlier_attempt_id: a.clone()
                    }]
                );
            }
            GuardMode::Enforce => {
                assert_eq!(denied(&d.response), DenialCode::DuplicateRequestSuspected);
                // No key at all is a different key too; another fingerprint passes.
                assert_eq!(
                    denied(&auth(&*s, &req(&tok, "pay", None, "X", json!({})), T0 + 1).await),
                    DenialCode::DuplicateRequestSuspected
                );
                dispatched(&auth(&*s, &req(&tok, "pay", Some("k3"), "Y", json!({})), T0 + 1).await);
                // A released attempt does not count; outside the retention window neither.
                let r = dispatched(
                    &auth(&*s, &req(&tok, "pay", Some("k4"), "W", json!({})), T0 + 1).await,
                );
                report(&*s, &r, released(), T0 + 1).await;
                dispatched(&auth(&*s, &req(&tok, "pay", Some("k5"), "W", json!({})), T0 + 2).await);
                dispatched(
                    &auth(
                        &*s,
                        &req(&tok, "pay", Some("k6"), "X", json!({})),
                        T0 + 25 * HOUR,
                    )
                    .await,
                );
            }
        }
    }
}

/// Every answer under an authenticated permit carries what the permit still allows for the
/// tool, counted by the store as the decision left it: a dispatch after its own reservation,
/// a replay or a denial as things stand; a release gives the figures back.
pub async fn permit_limits_in_answers(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 2);
    pol.rules.budget = Some(100);
    pol.rules
        .cost
        .insert("pay".into(), CostRule::Pointer("/amount".into()));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let call = |key: &'static str, amount: u64| {
        req(&tok, "pay", Some(key), key, json!({"amount": amount}))
    };
    let first = auth_with_limits(&*s, &call("a", 30), T0).await;
    assert_eq!(figures(&first), (Some(1), Some(70)));
    let a = dispatched(&first);
    assert_eq!(
        figures(&auth_with_limits(&*s, &call("a", 30), T0).await),
        (Some(1), Some(70)),
        "in progress: nothing more taken"
    );
    report(&*s, &a, completed("R"), T0).await;
    let replay = auth_with_limits(&*s, &call("a", 30), T0).await;
    assert!(matches!(replay, AuthorizeResponse::Replay { .. }));
    assert_eq!(figures(&replay), (Some(1), Some(70)));
    let b = dispatched(&auth_with_limits(&*s, &call("b", 50), T0).await);
    let capped = auth_with_limits(&*s, &call("c", 1), T0).await;
    assert_eq!(denied(&capped), DenialCode::PermitMaxCallsExceeded);
    assert_eq!(figures(&capped), (Some(0), Some(20)));
    report(&*s, &b, released(), T0).await;
    let echo = auth_with_limits(&*s, &req(&tok, "echo", None, "E", json!({})), T0).await;
    assert_eq!(figures(&echo), (None, Some(70)), "no cap on echo");
    let mut wrong = call("d", 1);
    wrong.permit_token = format!("{tok}x");
    assert_eq!(
        auth_with_limits(&*s, &wrong, T0).await,
        AuthorizeResponse::Deny(Denial::new(
            DenialCode::PermitInvalid,
            "the permit token is unknown or revoked"
        ))
    );
    let counters = s.permit_counters(&p.id).await.unwrap().unwrap();
    assert_eq!((counters.reserved, counters.spent), (0, 30));
}

/// A decision whose caller's deadline passed is neither decided nor committed: it fails
/// with `DeadlinePassed` (an outage to the caller) and takes nothing. Decisions whose
/// callers still wait, alongside it or after it, are decided as usual.
pub async fn decisions_past_their_deadline_commit_nothing(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let gone = clock::Deadline::at(std::time::Instant::now());
    let first = req(&tok, "pay", Some("k1"), "fp-1", json!({}));
    let err = s.authorize(&first, LEASE_MS, T0, gone).await.unwrap_err();
    assert!(
        matches!(err, crate::error::LedgerError::DeadlinePassed(_)),
        "{err}"
    );
    assert!(err.is_transient(), "answered as an outage: {err}");
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 0);
    // A late caller beside a waiting one: the cap of 1 goes to the one still waiting, and the
    // key the late call named is free (a fresh dispatch, not a replay of an attempt).
    let late = req(&tok, "pay", Some("k2"), "fp-2", json!({}));
    let (late, timely) = tokio::join!(
        s.authorize(&late, LEASE_MS, T0, gone),
        s.authorize(&first, LEASE_MS, T0, patient())
    );
    assert!(
        matches!(late, Err(crate::error::LedgerError::DeadlinePassed(_))),
        "{late:?}"
    );
    dispatched(&timely.unwrap().response);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
}
