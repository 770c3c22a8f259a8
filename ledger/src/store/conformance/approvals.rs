//! Approvals (docs/approvals.md) as every store must keep them: a waiting call holds its slot
//! and cost, a person's decision is applied once, the approved key dispatches once however
//! many retries race, and a rejection or a lapse gives the slot back.

use atmost_protocol::{AuthorizeResponse, DenialCode};
use serde_json::json;

use crate::decide::{ApprovalInput, Leases};
use crate::error::{ApprovalError, ApprovalRefused};
use crate::model::{ApprovalRule, AttemptState, Policy};

use super::support::*;

/// A person's decision as the admin API makes it.
fn person(approve: bool) -> ApprovalInput {
    ApprovalInput {
        approve,
        by: "ana".into(),
        note: Some("checked".into()),
        use_within_ms: 10 * MIN as u64,
    }
}

/// One `pay` call allowed, each costing 5 of a budget of 10, every call approved first.
fn approved_first() -> Policy {
    Policy::builder()
        .retention_ms(24 * HOUR)
        .max_calls("pay", 1)
        .budget(10)
        .cost_default(5)
        .approval("pay", ApprovalRule::Always)
        .build()
}

fn approval_id(r: &AuthorizeResponse) -> String {
    assert_eq!(denied(r), DenialCode::ApprovalRequired, "{r:?}");
    denial_data(r)["approval_id"]
        .as_str()
        .map(String::from)
        .unwrap_or_default()
}

pub async fn approvals(h: &dyn Harness) {
    let s = h.store().await;
    let (p, tok) = make_permit(&*s, approved_first(), T0 + HOUR).await;
    let call = req(&tok, "pay", Some("k1"), "A", json!({"to": "x"}));

    // Asked for: the slot and cost are held, nothing is dispatched.
    let id = approval_id(&auth(&*s, &call, T0).await);
    assert_eq!(state_of(&*s, &id).await, AttemptState::AwaitingApproval);
    let held = counters_match_recount(&*s, &p.id).await;
    assert_eq!((held.usage["pay"].calls_made, held.budget.reserved), (1, 5));
    assert_eq!(s.awaiting_approval().await.unwrap(), (1, Some(T0)));
    // The same key again: the same request, nothing more taken.
    assert_eq!(approval_id(&auth(&*s, &call, T0 + 1).await), id);
    // Another call meanwhile cannot pass the cap the waiting one holds.
    let other = req(&tok, "pay", Some("k2"), "B", json!({}));
    assert_eq!(
        denied(&auth(&*s, &other, T0 + 2).await),
        DenialCode::PermitMaxCallsExceeded
    );

    // A person approves it, once.
    let a = s
        .decide_approval(&id, &person(true), T0 + 10)
        .await
        .unwrap();
    assert_eq!(a.state, AttemptState::Approved);
    assert_eq!(s.awaiting_approval().await.unwrap(), (0, None));
    assert!(matches!(
        s.decide_approval(&id, &person(false), T0 + 11).await,
        Err(ApprovalError::Refused(ApprovalRefused::NotAwaiting(
            AttemptState::Approved
        )))
    ));
    assert!(matches!(
        s.decide_approval("att_unknown", &person(true), T0 + 11)
            .await,
        Err(ApprovalError::UnknownAttempt)
    ));

    // The approval is this permit's: the same key and arguments under another permit find
    // no approval there and ask anew (keys are per permit).
    let (_, other_tok) = make_permit(&*s, approved_first(), T0 + HOUR).await;
    let elsewhere = req(&other_tok, "pay", Some("k1"), "A", json!({"to": "x"}));
    let other_id = approval_id(&auth(&*s, &elsewhere, T0 + 12).await);
    assert_ne!(other_id, id);

    // The agent's retry dispatches the same attempt, at the cap, taking nothing new.
    assert_eq!(dispatched(&auth(&*s, &call, T0 + 20).await), id);
    let sent = counters_match_recount(&*s, &p.id).await;
    assert_eq!((sent.usage["pay"].calls_made, sent.budget.reserved), (1, 5));
    assert_eq!(
        denied(&auth(&*s, &call, T0 + 21).await),
        DenialCode::IdempotencyInProgress
    );
    report(&*s, &id, completed("R"), T0 + 30).await;
    assert!(matches!(
        auth(&*s, &call, T0 + 40).await,
        AuthorizeResponse::Replay { .. }
    ));
    // The record names the approval and who gave it, across a reopen.
    drop(s);
    let s = h.reopen().await;
    let kept = s.get_attempt(&id).await.unwrap().unwrap();
    let decision = kept.approval.and_then(|x| x.decision).unwrap();
    assert!(decision.approved);
    assert_eq!(
        (
            decision.by.as_str(),
            decision.at_ms,
            decision.note.as_deref()
        ),
        ("ana", T0 + 10, Some("checked"))
    );
    assert_eq!(kept.state, AttemptState::Completed);
}

/// A rejection gives the slot and cost back (nothing was sent) and the key keeps answering
/// it; a request nobody decided lapses with the sweeper, slot and cost back too.
pub async fn approvals_rejected_and_lapsed(h: &dyn Harness) {
    let s = h.store().await;
    let (p, tok) = make_permit(&*s, approved_first(), T0 + 2 * HOUR).await;
    let first = req(&tok, "pay", Some("k1"), "A", json!({}));
    let id = approval_id(&auth(&*s, &first, T0).await);
    let a = s
        .decide_approval(&id, &person(false), T0 + 5)
        .await
        .unwrap();
    assert_eq!(a.state, AttemptState::ApprovalRejected);
    let back = counters_match_recount(&*s, &p.id).await;
    assert_eq!((back.usage["pay"].calls_made, back.budget.reserved), (0, 0));
    assert_eq!(
        denied(&auth(&*s, &first, T0 + 6).await),
        DenialCode::ApprovalRejected
    );

    // A new key asks anew; nobody decides; the sweeper expires it at its lapse time.
    let second = req(&tok, "pay", Some("k2"), "B", json!({}));
    let asked_at = T0 + 10;
    let id = approval_id(&auth(&*s, &second, asked_at).await);
    let wait = Leases::DEFAULT_APPROVAL_WAIT_MS as i64;
    assert_eq!(
        s.sweep(asked_at + wait - 1)
            .await
            .unwrap()
            .approvals_expired,
        0
    );
    let swept = s.sweep(asked_at + wait).await.unwrap();
    assert_eq!((swept.approvals_expired, swept.leases_expired), (1, 0));
    assert_eq!(state_of(&*s, &id).await, AttemptState::ApprovalExpired);
    let back = counters_match_recount(&*s, &p.id).await;
    assert_eq!((back.usage["pay"].calls_made, back.budget.reserved), (0, 0));
    assert_eq!(
        denied(&auth(&*s, &second, asked_at + wait + 1).await),
        DenialCode::ApprovalExpired
    );
    // A decision after the lapse is refused.
    assert!(matches!(
        s.decide_approval(&id, &person(true), asked_at + wait + 2)
            .await,
        Err(ApprovalError::Refused(ApprovalRefused::NotAwaiting(
            AttemptState::ApprovalExpired
        )))
    ));
}

/// The approved key's retries race over two handles: exactly one dispatches, the others are
/// in progress, and the cap's slot is the approved call's only.
pub async fn race_approved_key_dispatched_once(h: &dyn Harness) {
    let s = h.store().await;
    let (p, tok) = make_permit(&*s, approved_first(), T0 + HOUR).await;
    let call = req(&tok, "pay", Some("one-key"), "A", json!({}));
    let id = approval_id(&auth(&*s, &call, T0 - 10).await);
    s.decide_approval(&id, &person(true), T0 - 5).await.unwrap();
    let rs = race(h, (0..32).map(|_| call.clone()).collect()).await;
    assert_eq!(count(&rs, None), 1, "{rs:?}");
    assert_eq!(count(&rs, Some(DenialCode::IdempotencyInProgress)), 31);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    assert_eq!(state_of(&*s, &id).await, AttemptState::InFlight);
}

/// Two people decide the same request at once on two handles: one decision is applied, the
/// other refused.
pub async fn race_two_decisions(h: &dyn Harness) {
    let s1 = h.store().await;
    let s2 = h.second_handle().await;
    let (_p, tok) = make_permit(&*s1, approved_first(), T0 + HOUR).await;
    let id = approval_id(&auth(&*s1, &req(&tok, "pay", Some("k"), "A", json!({})), T0).await);
    let (yes, no) = (person(true), person(false));
    let (one, two) = tokio::join!(
        s1.decide_approval(&id, &yes, T0 + 1),
        s2.decide_approval(&id, &no, T0 + 1)
    );
    let applied = [&one, &two].iter().filter(|r| r.is_ok()).count();
    assert_eq!(applied, 1, "{one:?} {two:?}");
    let state = state_of(&*s1, &id).await;
    match (one, two) {
        (Ok(a), Err(ApprovalError::Refused(ApprovalRefused::NotAwaiting(_))))
        | (Err(ApprovalError::Refused(ApprovalRefused::NotAwaiting(_))), Ok(a)) => {
            assert_eq!(a.state, state)
        }
        other => panic!("{other:?}"),
    }
}
