//! What happens to attempts and permits over time: leases, retention, resolutions, reopening,
//! counters, purges.

use std::collections::BTreeMap;

use atmost_protocol::{AuthorizeResponse, DenialCode, Outcome, OutcomeAck, OutcomeReport};
use serde_json::json;

use crate::decide::ResolveInput;
use crate::error::ResolveError;
use crate::model::{AttemptState, CostRule, GuardMode};
use crate::store::{AttemptFilter, PurgeReport};

use super::support::*;

pub async fn sweeper_expires_leases_to_uncertain(h: &dyn Harness) {
    let s = h.store().await;
    let (p, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("k"), "A", json!({})), T0).await);
    let b = dispatched(&auth(&*s, &req(&tok, "pay", Some("k2"), "B", json!({})), T0).await);
    report(&*s, &b, completed("R"), T0).await;
    let lease = i64::try_from(LEASE_MS).unwrap();
    assert_eq!(s.sweep(T0 + lease - 1).await.unwrap().leases_expired, 0);
    assert_eq!(state_of(&*s, &a).await, AttemptState::InFlight);
    assert_eq!(s.sweep(T0 + lease).await.unwrap().leases_expired, 1);
    let got = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(got.state, AttemptState::Uncertain);
    assert_eq!(
        got.reason.as_deref(),
        Some(crate::decide::LEASE_EXPIRED_REASON)
    );
    assert_eq!(state_of(&*s, &b).await, AttemptState::Completed);
    // A late report does not change it; the same key gets the same unknown; the slot stays.
    assert_eq!(
        report(&*s, &a, completed("late"), T0 + lease).await,
        OutcomeAck::Conflict
    );
    assert_eq!(
        report(&*s, &a, released(), T0 + lease).await,
        OutcomeAck::Conflict
    );
    assert_eq!(
        denied(
            &auth(
                &*s,
                &req(&tok, "pay", Some("k"), "A", json!({})),
                T0 + lease
            )
            .await
        ),
        DenialCode::DeliveryUncertain
    );
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);
    assert_eq!(s.sweep(T0 + 10 * lease).await.unwrap().leases_expired, 0);
    let listed = s
        .list_attempts(&AttemptFilter {
            state: Some(AttemptState::Uncertain),
            permit_id: Some(p.id.clone()),
            limit: None,
        })
        .await
        .unwrap();
    assert_eq!(
        listed.iter().map(|x| x.id.clone()).collect::<Vec<_>>(),
        vec![a]
    );
}

pub async fn retention_tombstones_and_uncertain_kept(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.retention_ms = HOUR;
    pol.rules.max_calls.insert("pay".into(), 5);
    let (p, tok) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("done"), "A", json!({})), T0).await);
    report(&*s, &a, completed("R"), T0).await;
    let u = dispatched(&auth(&*s, &req(&tok, "pay", Some("unk"), "U", json!({})), T0).await);
    report(&*s, &u, uncertain(), T0).await;

    let r = s.sweep(T0 + HOUR - 1).await.unwrap();
    assert_eq!(r.receipts_pruned, 0);
    assert!(matches!(
        auth(
            &*s,
            &req(&tok, "pay", Some("done"), "A", json!({})),
            T0 + HOUR - 1
        )
        .await,
        AuthorizeResponse::Replay { .. }
    ));
    let r = s.sweep(T0 + HOUR).await.unwrap();
    assert_eq!(r.receipts_pruned, 1);
    let t = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(
        (t.state, t.receipt.is_none(), t.pruned_at_ms.is_some()),
        (AttemptState::Completed, true, true)
    );
    for fp in ["A", "other"] {
        assert_eq!(
            denied(
                &auth(
                    &*s,
                    &req(&tok, "pay", Some("done"), fp, json!({})),
                    T0 + HOUR
                )
                .await
            ),
            DenialCode::IdempotencyKeyExpired
        );
    }
    // The tombstone keeps its slot; the uncertain attempt is never pruned.
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);
    assert_eq!(s.sweep(T0 + 1000 * HOUR).await.unwrap().receipts_pruned, 0);
    assert_eq!(state_of(&*s, &u).await, AttemptState::Uncertain);
    assert_eq!(
        denied(
            &auth(
                &*s,
                &req(&tok, "pay", Some("unk"), "U", json!({})),
                T0 + 99 * HOUR
            )
            .await
        ),
        DenialCode::DeliveryUncertain
    );
}

pub async fn resolution(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 2);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0).await);
    let b = dispatched(&auth(&*s, &req(&tok, "pay", Some("b"), "B", json!({})), T0).await);
    report(&*s, &a, uncertain(), T0).await;
    report(&*s, &b, uncertain(), T0).await;
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);

    let exec = ResolveInput {
        executed: true,
        receipt: Some("PROVIDER-RECEIPT".into()),
        note: Some("found charge ch_1".into()),
        by: "alice".into(),
        source: Default::default(),
    };
    let got = s.resolve_attempt(&a, &exec, T0 + 5).await.unwrap();
    assert_eq!(got.state, AttemptState::ResolvedExecuted);
    let res = got.resolution.clone().unwrap();
    assert_eq!(
        (res.by.as_str(), res.at_ms, res.note.as_deref()),
        ("alice", T0 + 5, Some("found charge ch_1"))
    );
    // Stored, not just returned.
    assert_eq!(s.get_attempt(&a).await.unwrap().unwrap(), got);
    assert_eq!(
        auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0 + 6).await,
        AuthorizeResponse::Replay {
            attempt_id: a.clone(),
            receipt: "PROVIDER-RECEIPT".into(),
            limits: None,
        }
    );
    assert!(matches!(
        s.resolve_attempt(&a, &exec, T0).await,
        Err(ResolveError::NotUncertain(AttemptState::ResolvedExecuted))
    ));
    assert!(matches!(
        s.resolve_attempt("att_nope", &exec, T0).await,
        Err(ResolveError::UnknownAttempt)
    ));
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);

    let not = ResolveInput {
        executed: false,
        receipt: None,
        note: None,
        by: "bob".into(),
        source: Default::default(),
    };
    s.resolve_attempt(&b, &not, T0 + 7).await.unwrap();
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    // The same key may now try again.
    let b2 = dispatched(&auth(&*s, &req(&tok, "pay", Some("b"), "B", json!({})), T0 + 8).await);
    assert_ne!(b, b2);
    // Resolving an in_flight attempt is refused.
    assert!(matches!(
        s.resolve_attempt(&b2, &not, T0).await,
        Err(ResolveError::NotUncertain(AttemptState::InFlight))
    ));
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!(
        det.attempts_by_state.get(&AttemptState::ResolvedExecuted),
        Some(&1)
    );
    assert_eq!(
        det.attempts_by_state
            .get(&AttemptState::ResolvedNotExecuted),
        Some(&1)
    );
    assert_eq!(det.attempts_by_state.get(&AttemptState::InFlight), Some(&1));
}

pub async fn durability_across_reopen(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 2);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0).await);
    report(&*s, &a, completed("R"), T0).await;
    let b = dispatched(&auth(&*s, &req(&tok, "pay", Some("b"), "B", json!({})), T0).await);
    drop(s);
    let s = h.reopen().await;
    assert_eq!(
        auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0).await,
        AuthorizeResponse::Replay {
            attempt_id: a,
            receipt: "R".into(),
            limits: None,
        }
    );
    assert_eq!(state_of(&*s, &b).await, AttemptState::InFlight);
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("c"), "C", json!({})), T0).await),
        DenialCode::PermitMaxCallsExceeded
    );
    assert_eq!(s.list_permits().await.unwrap().len(), 1);
    assert_eq!(s.permit_detail(&p.id).await.unwrap().unwrap().permit, p);
}

pub async fn permit_admin(h: &dyn Harness) {
    let s = h.store().await;
    s.ping().await.unwrap();
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    pol.rules
        .cost
        .insert("pay".into(), CostRule::Pointer("/a".into()));
    pol.rules.budget = Some(7);
    let (p1, _) = make_permit(&*s, pol, T0 + HOUR).await;
    let (p2, _) = make_permit(&*s, policy(), T0 + HOUR).await;
    let list = s.list_permits().await.unwrap();
    assert_eq!(list.len(), 2);
    assert!(list.contains(&p1) && list.contains(&p2));
    let d = s.permit_detail(&p1.id).await.unwrap().unwrap();
    assert_eq!(d.permit, p1);
    assert_eq!(d.usage.get("pay").map(|u| u.calls_made), Some(0));
    assert!(s.permit_detail("pmt_nope").await.unwrap().is_none());
    assert_eq!(s.get_permit(&p2.id).await.unwrap(), Some(p2.clone()));
    assert!(s.get_permit("pmt_nope").await.unwrap().is_none());
    let r = s.revoke_permit(&p1.id, T0 + 1).await.unwrap().unwrap();
    assert_eq!(r.revoked_at_ms, Some(T0 + 1));
    let r = s.revoke_permit(&p1.id, T0 + 2).await.unwrap().unwrap();
    assert_eq!(
        r.revoked_at_ms,
        Some(T0 + 1),
        "revoking twice keeps the first time"
    );
    assert!(s.revoke_permit("pmt_nope", T0).await.unwrap().is_none());
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(counts.values().sum::<u64>(), 0);
}

/// The per-state counts follow every transition, and the pruner finds each permit's receipts
/// when that permit's retention has run out (not the shortest one's).
pub async fn state_counts_and_pruning_per_permit_retention(h: &dyn Harness) {
    let s = h.store().await;
    let count =
        |c: &std::collections::BTreeMap<AttemptState, u64>, st| c.get(&st).copied().unwrap_or(0);
    let mut short = policy();
    short.retention_ms = HOUR;
    let mut long = policy();
    long.retention_ms = 10 * HOUR;
    let (_, tok_short) = make_permit(&*s, short, T0 + 100 * HOUR).await;
    let (_, tok_long) = make_permit(&*s, long, T0 + 100 * HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok_short, "pay", Some("s"), "S", json!({})), T0).await);
    let b = dispatched(&auth(&*s, &req(&tok_long, "pay", Some("l"), "L", json!({})), T0).await);
    let c = dispatched(&auth(&*s, &req(&tok_long, "pay", Some("u"), "U", json!({})), T0).await);
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(count(&counts, AttemptState::InFlight), 3);
    report(&*s, &a, completed("RA"), T0).await;
    report(&*s, &b, completed("RB"), T0).await;
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(
        (
            count(&counts, AttemptState::InFlight),
            count(&counts, AttemptState::Completed)
        ),
        (1, 2)
    );
    // `c` never reports: its lease runs out and the sweeper makes it uncertain.
    let r = s.sweep(T0 + HOUR).await.unwrap();
    assert_eq!((r.leases_expired, r.receipts_pruned), (1, 1));
    assert_eq!(state_of(&*s, &c).await, AttemptState::Uncertain);
    assert!(!receipt_kept(&*s, &a).await);
    assert!(receipt_kept(&*s, &b).await);
    assert_eq!(
        s.sweep(T0 + 10 * HOUR - 1).await.unwrap().receipts_pruned,
        0
    );
    assert_eq!(s.sweep(T0 + 10 * HOUR).await.unwrap().receipts_pruned, 1);
    assert!(!receipt_kept(&*s, &b).await);
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(
        (
            count(&counts, AttemptState::InFlight),
            count(&counts, AttemptState::Completed),
            count(&counts, AttemptState::Uncertain),
        ),
        (0, 2, 1)
    );
    assert_eq!(counts.values().sum::<u64>(), 3);
}

/// The O(1) counters equal a recount from the attempts after a long random sequence of
/// authorizations (new keys, reused keys, continuations), outcome reports (single and batched),
/// resolutions and sweeps, on two permits.
pub async fn counters_match_recount_after_random_operations(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 6);
    pol.rules.max_calls_default = Some(40);
    pol.rules.budget = Some(400);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(17));
    pol.rules
        .cost
        .insert("ship".into(), CostRule::Pointer("/n".into()));
    pol.rules.cost_default = 3;
    pol.rules.duplicate_guard = GuardMode::Off;
    let (p1, tok1) = make_permit(&*s, pol.clone(), T0 + 100 * HOUR).await;
    pol.rules.budget = None;
    pol.retention_ms = 10 * MIN;
    let (p2, tok2) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
    // A small deterministic generator (no extra dependency).
    let mut seed: u64 = 0x5eed_1234_abcd_0001;
    let mut next = move |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let tools = ["pay", "ship", "read"];
    let mut attempts: Vec<String> = Vec::new();
    let mut now = T0;
    for i in 0..400u64 {
        now += 7_000;
        let tok = if next(2) == 0 { &tok1 } else { &tok2 };
        match next(10) {
            0..=3 => {
                let tool = tools[next(3) as usize];
                let k = next(25);
                let key = format!("k{k}");
                let key = if next(6) == 0 {
                    None
                } else {
                    Some(key.as_str())
                };
                let mut r = req(tok, tool, key, &format!("{tool}-{k}"), json!({"n": k}));
                r.continuation = next(4) == 0;
                let d = s.authorize(&r, LEASE_MS, now, patient()).await.unwrap();
                remember(&d.response);
                if let AuthorizeResponse::Dispatch { attempt_id, .. } = d.response {
                    attempts.push(attempt_id);
                }
            }
            4..=6 if !attempts.is_empty() => {
                let id = attempts[next(attempts.len() as u64) as usize].clone();
                let outcome = match next(5) {
                    0 => completed("{}"),
                    1 => released(),
                    2 => uncertain(),
                    3 => input_required("{}"),
                    _ => Outcome::Accepted {
                        receipt: "{}".into(),
                    },
                };
                report(&*s, &id, outcome, now).await;
            }
            7 if !attempts.is_empty() => {
                let batch: Vec<OutcomeReport> = (0..1 + next(4))
                    .map(|_| {
                        report_of(
                            &attempts[next(attempts.len() as u64) as usize],
                            if next(2) == 0 {
                                completed("{}")
                            } else {
                                released()
                            },
                        )
                    })
                    .collect();
                let acks = s.record_outcomes(&batch, now).await.unwrap();
                assert_eq!(acks.len(), batch.len());
            }
            8 if !attempts.is_empty() => {
                let id = attempts[next(attempts.len() as u64) as usize].clone();
                let input = ResolveInput {
                    executed: next(2) == 0,
                    receipt: Some("{}".into()),
                    note: None,
                    by: "test".into(),
                    source: Default::default(),
                };
                let _ = s.resolve_attempt(&id, &input, now).await;
            }
            _ => {
                if i % 3 == 0 {
                    now += 2 * MIN;
                }
                s.sweep(now).await.unwrap();
            }
        }
    }
    for p in [&p1, &p2] {
        let detail = counters_match_recount(&*s, &p.id).await;
        assert!(
            detail.attempts_by_state.values().sum::<u64>() > 20,
            "the sequence did something: {:?}",
            detail.attempts_by_state
        );
    }
}

/// The purge of ended permits (docs/design.md#purging-ended-permits): settled attempts and
/// their keys of permits that expired or were revoked at or before the cut go, and so does
/// each permit once nothing is left under it; attempts that are not settled stay with their
/// permit, whose counters equal a recount throughout; a purged permit's token is denied, and
/// nothing is ever dispatched under an ended permit, before the purge or after it.
pub async fn purge_of_ended_permits(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 10);
    pol.rules.budget = Some(1000);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(7));
    let ends = T0 + HOUR;
    let (p, tok) = make_permit(&*s, pol.clone(), ends).await;
    let call = |key: &str, fp: &str| req(&tok, "pay", Some(key), fp, json!({"n": 1}));
    let done = dispatched(&auth(&*s, &call("done", "A"), T0).await);
    report(&*s, &done, completed("R"), T0).await;
    // A released key dispatched again: the key points at the second attempt.
    let first = dispatched(&auth(&*s, &call("again", "B"), T0).await);
    report(&*s, &first, released(), T0).await;
    let second = dispatched(&auth(&*s, &call("again", "B"), T0).await);
    report(&*s, &second, completed("R2"), T0).await;
    let keyless = dispatched(&auth(&*s, &req(&tok, "pay", None, "C", json!({})), T0).await);
    report(&*s, &keyless, completed("R3"), T0).await;
    let unc = dispatched(&auth(&*s, &call("unc", "U"), T0).await);
    report(&*s, &unc, uncertain(), T0).await;
    // Still in flight when its permit ends (its lease runs out later, and nothing swept it).
    let flying = dispatched(&auth(&*s, &call("fly", "F"), ends - 1).await);

    // A revoked permit, an expired one never used, and one still active.
    let (q, qtok) = make_permit(&*s, pol.clone(), T0 + 100 * HOUR).await;
    let q_done = dispatched(&auth(&*s, &req(&qtok, "pay", Some("q"), "Q", json!({})), T0).await);
    report(&*s, &q_done, completed("RQ"), T0).await;
    s.revoke_permit(&q.id, T0 + 10 * MIN).await.unwrap();
    let (unused, unused_tok) = make_permit(&*s, pol.clone(), T0 + 30 * MIN).await;
    let (live, live_tok) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
    let live_done =
        dispatched(&auth(&*s, &req(&live_tok, "pay", Some("l"), "L", json!({})), T0).await);
    report(&*s, &live_done, completed("RL"), T0).await;

    // Before the purge, past the expiry: the key replays, a new call is denied.
    assert!(matches!(
        auth(&*s, &call("done", "A"), ends + 1).await,
        AuthorizeResponse::Replay { .. }
    ));
    assert_eq!(
        denied(&auth(&*s, &call("new", "N"), ends + 1).await),
        DenialCode::PermitExpired
    );

    // A cut before P's end purges Q (revoked before it) and the unused permit, not P.
    let r = s.purge(ends - 1, u64::MAX).await.unwrap();
    assert_eq!(
        (r.attempts_purged, r.permits_purged),
        (1, 2),
        "Q's attempt, Q and the unused permit"
    );
    for gone in [&q.id, &unused.id] {
        assert!(s.permit_detail(gone).await.unwrap().is_none(), "{gone}");
        assert!(s.permit_counters(gone).await.unwrap().is_none(), "{gone}");
    }
    assert!(s.get_attempt(&q_done).await.unwrap().is_none());
    assert_eq!(state_of(&*s, &done).await, AttemptState::Completed);
    for (t, key) in [(&qtok, "q"), (&unused_tok, "x")] {
        let r = auth(&*s, &req(t, "pay", Some(key), "Q", json!({})), ends + 1).await;
        assert_eq!(denied(&r), DenialCode::PermitInvalid);
    }

    // At P's end: its settled attempts and their keys go; the uncertain and the in-flight
    // attempt stay, and the permit with them.
    let r = s.purge(ends, u64::MAX).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (4, 0));
    for id in [&done, &first, &second, &keyless] {
        assert!(s.get_attempt(id).await.unwrap().is_none(), "{id}");
    }
    assert_eq!(state_of(&*s, &unc).await, AttemptState::Uncertain);
    assert_eq!(state_of(&*s, &flying).await, AttemptState::InFlight);
    let detail = counters_match_recount(&*s, &p.id).await;
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);
    assert_eq!((detail.budget.reserved, detail.budget.spent), (7, 7));
    assert_eq!(
        nonzero_counts(&*s).await,
        BTreeMap::from([
            (AttemptState::InFlight, 1),
            (AttemptState::Uncertain, 1),
            (AttemptState::Completed, 1)
        ])
    );
    // The purged keys are denied, never dispatched: the permit has ended. The kept ones
    // answer as before.
    for (key, fp) in [("done", "A"), ("again", "B"), ("new", "N")] {
        assert_eq!(
            denied(&auth(&*s, &call(key, fp), ends + 2).await),
            DenialCode::PermitExpired,
            "{key}"
        );
    }
    assert_eq!(
        denied(&auth(&*s, &call("unc", "U"), ends + 2).await),
        DenialCode::DeliveryUncertain
    );
    assert_eq!(
        denied(&auth(&*s, &call("fly", "F"), ends + 2).await),
        DenialCode::IdempotencyInProgress
    );
    // A late report about a purged attempt changes nothing.
    assert_eq!(
        report(&*s, &done, completed("R"), ends + 2).await,
        OutcomeAck::UnknownAttempt
    );
    // Nothing more to purge until the rest settles; the active permit is never touched.
    assert_eq!(
        s.purge(ends + 10 * HOUR, u64::MAX).await.unwrap(),
        PurgeReport::default()
    );
    assert_eq!(state_of(&*s, &live_done).await, AttemptState::Completed);

    // The in-flight call's report still lands; once the uncertain one is resolved, the
    // permit has nothing left and goes too.
    assert_eq!(
        report(&*s, &flying, completed("RF"), ends + 3).await,
        OutcomeAck::Applied
    );
    s.resolve_attempt(&unc, &resolved_by_person(false), ends + 4)
        .await
        .unwrap();
    let r = s.purge(ends, u64::MAX).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (2, 1));
    assert!(s.permit_detail(&p.id).await.unwrap().is_none());
    assert!(s.permit_counters(&p.id).await.unwrap().is_none());
    assert_eq!(
        denied(&auth(&*s, &call("unc", "U"), ends + 5).await),
        DenialCode::PermitInvalid
    );
    assert_eq!(
        nonzero_counts(&*s).await,
        BTreeMap::from([(AttemptState::Completed, 1)])
    );
    let listed: Vec<String> = s
        .list_permits()
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.id)
        .collect();
    assert_eq!(listed, vec![live.id.clone()]);
    counters_match_recount(&*s, &live.id).await;
}

/// The purge deletes at most what it is asked to, and picks up where it stopped.
pub async fn purge_in_bounded_batches(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.budget = Some(1000);
    pol.rules.cost_default = 2;
    let ends = T0 + HOUR;
    let mut permits = Vec::new();
    for _ in 0..2 {
        let (p, tok) = make_permit(&*s, pol.clone(), ends).await;
        for i in 0..3 {
            let key = format!("k{i}");
            let a =
                dispatched(&auth(&*s, &req(&tok, "pay", Some(&key), &key, json!({})), T0).await);
            report(&*s, &a, completed("R"), T0).await;
        }
        permits.push(p);
    }
    let r = s.purge(ends, 1).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (1, 0));
    for p in &permits {
        counters_match_recount(&*s, &p.id).await;
    }
    // The first permit's (in the purge's order) last two, and it; two of the other's, which
    // keeps its third.
    let r = s.purge(ends, 4).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (4, 1));
    let left = s.list_permits().await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(
        counters_match_recount(&*s, &left[0].id)
            .await
            .attempts_by_state
            .values()
            .sum::<u64>(),
        1
    );
    let r = s.purge(ends, 100).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (1, 1));
    assert!(s.list_permits().await.unwrap().is_empty());
    assert!(nonzero_counts(&*s).await.is_empty());
}
