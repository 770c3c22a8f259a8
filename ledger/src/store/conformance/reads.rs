//! The reads of the admin API and the inbox, and rows written by older versions.

use atmost_protocol::KeyCarrier;
use serde_json::{json, Value};

use crate::decide::ResolveInput;
use crate::model::{AttemptState, ResolutionSource};
use crate::store::Store;

use super::support::*;

/// The reconciliation inbox's reads: every attempt keeps the key its upstream received, where
/// it went, and its arguments (a continuation keeps the first round's key and carriers; past
/// retention the arguments go with the receipt); `open_attempts` lists `uncertain` attempts and `awaiting_input`
/// ones stuck since the given time, oldest first; `resolved_attempts` the latest resolution
/// first, with who, when, the note and (for the reconciler) the provider's answer;
/// `oldest_uncertain` follows. All of it survives a reopen.
pub async fn inbox_reads(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.retention_ms = HOUR;
    let (_, tok) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
    let args = json!({"invoice": "INV-1", "amount": 250, "card": {"number": "4242"}});
    let pay = |key: &str, fp: &str| {
        forwarding(
            req(&tok, "pay", Some(key), fp, args.clone()),
            &format!("fwd-{key}"),
        )
    };
    let a = dispatched(&auth(&*s, &pay("a", "A"), T0).await);
    let b = dispatched(&auth(&*s, &carried_in(pay("b", "B"), &[KeyCarrier::Meta]), T0).await);
    let w = dispatched(&auth(&*s, &pay("w", "W"), T0).await);
    let f = dispatched(&auth(&*s, &pay("f", "F"), T0).await);
    let nokey = dispatched(&auth(&*s, &req(&tok, "pay", None, "N", json!({})), T0).await);
    let got = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(got.forwarded_key.as_deref(), Some("fwd-a"));
    assert_eq!(carriers_of(&got), [KeyCarrier::Header]);
    assert_eq!(
        carriers_of(&s.get_attempt(&b).await.unwrap().unwrap()),
        [KeyCarrier::Meta]
    );
    let kept: Value = serde_json::from_str(got.arguments.as_deref().unwrap()).unwrap();
    assert_eq!(kept, args);
    let nokey_attempt = s.get_attempt(&nokey).await.unwrap().unwrap();
    assert_eq!(nokey_attempt.forwarded_key, None);
    assert!(nokey_attempt.forwarded_key_carriers.is_empty());

    // a turns uncertain last, b first; w waits for input; f completes; nokey stays in flight.
    report(&*s, &b, uncertain(), T0 + 5).await;
    report(&*s, &a, uncertain(), T0 + 10).await;
    report(&*s, &w, input_required("ASK"), T0 + 3).await;
    report(&*s, &f, completed("R"), T0 + 4).await;
    let ids = |v: Vec<crate::model::Attempt>| v.into_iter().map(|a| a.id).collect::<Vec<_>>();
    // w has not waited long enough (since T0 + 3, stuck only from T0 + 2 back).
    assert_eq!(
        ids(s.open_attempts(T0 + 2, 50).await.unwrap()),
        [b.clone(), a.clone()]
    );
    assert_eq!(
        ids(s.open_attempts(T0 + 3, 50).await.unwrap()),
        [w.clone(), b.clone(), a.clone()]
    );
    assert_eq!(
        ids(s.open_attempts(T0 + 3, 2).await.unwrap()),
        [w.clone(), b.clone()]
    );
    assert_eq!(s.oldest_uncertain().await.unwrap(), Some(T0 + 5));

    // The continuation says another forwarded value (say the upstream secret rotated): the
    // attempt keeps the first, which is what the provider saw when the call was first sent.
    // So are the carriers it went in, from the same round.
    let again = continued(carried_in(
        forwarding(req(&tok, "pay", Some("w"), "W", args.clone()), "fwd-other"),
        &[KeyCarrier::IdempotencyKeyParam],
    ));
    assert_eq!(dispatched(&auth(&*s, &again, T0 + 6).await), w);
    let continued_w = s.get_attempt(&w).await.unwrap().unwrap();
    assert_eq!(continued_w.forwarded_key.as_deref(), Some("fwd-w"));
    assert_eq!(carriers_of(&continued_w), [KeyCarrier::Header]);
    assert_eq!(
        ids(s.open_attempts(T0 + 100, 50).await.unwrap()),
        [b.clone(), a.clone()]
    );

    // A person resolves b, the reconciler a (with the provider's answer as evidence).
    let person = ResolveInput {
        executed: false,
        receipt: None,
        note: Some("no charge for INV-1".into()),
        by: "ana".into(),
        source: ResolutionSource::Person,
    };
    s.resolve_attempt(&b, &person, T0 + 30).await.unwrap();
    assert_eq!(s.oldest_uncertain().await.unwrap(), Some(T0 + 10));
    let answer = r#"{"structuredContent":{"status":"paid"}}"#;
    let reconciler = ResolveInput {
        executed: true,
        receipt: None,
        note: Some("lookup_payment: status paid".into()),
        by: "payments-rule".into(),
        source: ResolutionSource::Reconciler {
            provider_answer: answer.into(),
        },
    };
    s.resolve_attempt(&a, &reconciler, T0 + 40).await.unwrap();
    assert_eq!(s.oldest_uncertain().await.unwrap(), None);
    assert!(s.open_attempts(T0, 50).await.unwrap().is_empty());

    drop(s);
    let s = h.reopen().await;
    let resolved = s.resolved_attempts(10).await.unwrap();
    assert_eq!(ids(resolved.clone()), [a.clone(), b.clone()]);
    let ra = resolved[0].resolution.clone().unwrap();
    assert_eq!(
        (ra.by.as_str(), ra.at_ms, ra.executed),
        ("payments-rule", T0 + 40, true)
    );
    assert_eq!(ra.source.provider_answer(), Some(answer));
    let rb = resolved[1].resolution.clone().unwrap();
    assert_eq!(
        (rb.by.as_str(), rb.note.as_deref(), rb.source),
        ("ana", Some("no charge for INV-1"), ResolutionSource::Person)
    );
    assert_eq!(resolved[0].forwarded_key.as_deref(), Some("fwd-a"));
    assert_eq!(carriers_of(&resolved[0]), [KeyCarrier::Header]);
    assert_eq!(carriers_of(&resolved[1]), [KeyCarrier::Meta]);
    assert_eq!(ids(s.resolved_attempts(1).await.unwrap()), [a]);

    // Past retention the receipt and the arguments go; the forwarded key stays for lookups.
    assert_eq!(s.sweep(T0 + 4 + HOUR).await.unwrap().receipts_pruned, 1);
    let pruned = s.get_attempt(&f).await.unwrap().unwrap();
    assert_eq!((pruned.receipt, pruned.arguments), (None, None));
    assert_eq!(pruned.forwarded_key.as_deref(), Some("fwd-f"));
    assert_eq!(
        pruned.forwarded_key_carriers.iter().collect::<Vec<_>>(),
        [KeyCarrier::Header]
    );
}

/// After migrating [`VERSION_4_ROWS`]: no forwarded key or arguments, the old resolution a
/// person's, and the inbox's reads find both attempts.
pub async fn reads_version_4_rows(s: &dyn Store) {
    let r = s.get_attempt("r1").await.unwrap().unwrap();
    let res = r.resolution.unwrap();
    assert_eq!(
        (res.by.as_str(), res.note.as_deref(), res.source),
        ("ops", Some("found it"), ResolutionSource::Person)
    );
    assert_eq!((r.forwarded_key, r.arguments), (None, None));
    assert!(r.forwarded_key_carriers.is_empty());
    let open = s.open_attempts(0, 10).await.unwrap();
    assert!(open.iter().all(|a| a.forwarded_key_carriers.is_empty()));
    assert_eq!(
        open.iter()
            .map(|a| (a.id.as_str(), a.state))
            .collect::<Vec<_>>(),
        [("u1", AttemptState::Uncertain)]
    );
    assert_eq!(s.oldest_uncertain().await.unwrap(), Some(7));
    let resolved = s.resolved_attempts(10).await.unwrap();
    assert_eq!(resolved.len(), 1);
    assert_eq!(resolved[0].id, "r1");
}

/// `uncertain_after` pages through every uncertain attempt in the inbox's order (when each
/// turned so, then id), after a given key, at most `limit` a page: attempts that turned
/// uncertain at the same moment are split across pages by id, and no attempt in another
/// state is ever listed.
pub async fn uncertain_pages(h: &dyn Harness) {
    let s = h.store().await;
    let (_, tok) = make_permit(&*s, policy(), T0 + 100 * HOUR).await;
    let mut uncertain_ids = Vec::new();
    for i in 0..5 {
        let key = format!("u{i}");
        let id = dispatched(&auth(&*s, &req(&tok, "pay", Some(&key), &key, json!({})), T0).await);
        // Two pairs turn uncertain at the same moment, so the id breaks the tie.
        report(&*s, &id, uncertain(), T0 + 10 + i / 2).await;
        uncertain_ids.push((T0 + 10 + i / 2, id));
    }
    let done = dispatched(&auth(&*s, &req(&tok, "pay", Some("c"), "C", json!({})), T0).await);
    report(&*s, &done, completed("R"), T0 + 1).await;
    let _in_flight = dispatched(&auth(&*s, &req(&tok, "pay", Some("f"), "F", json!({})), T0).await);
    uncertain_ids.sort();
    let expected: Vec<String> = uncertain_ids.iter().map(|(_, id)| id.clone()).collect();

    let mut walked = Vec::new();
    let mut after: (crate::clock::Millis, String) = (crate::clock::Millis::MIN, String::new());
    for _ in 0..10 {
        let page = s.uncertain_after((after.0, &after.1), 2).await.unwrap();
        assert!(page.len() <= 2, "a page holds at most the limit");
        let Some(last) = page.last() else { break };
        after = (last.updated_at_ms, last.id.clone());
        walked.extend(page.into_iter().map(|a| {
            assert_eq!(a.state, AttemptState::Uncertain);
            a.id
        }));
    }
    assert_eq!(walked, expected, "every uncertain attempt once, in order");
    // From the middle: only what comes after that key.
    let (at, id) = &uncertain_ids[2];
    let rest: Vec<String> = s
        .uncertain_after((*at, id), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.id)
        .collect();
    assert_eq!(rest, expected[3..].to_vec());
}

/// Inbox sessions: open until they expire, end one by one or all at once, seen by every
/// handle; expired ones are dropped when a new one opens.
pub async fn inbox_sessions(h: &dyn Harness) {
    let s = h.store().await;
    let other = h.second_handle().await;
    assert!(!s.inbox_session_open("a", T0).await.unwrap());
    s.open_inbox_session("a", T0, T0 + HOUR).await.unwrap();
    s.open_inbox_session("b", T0, T0 + MIN).await.unwrap();
    assert!(other.inbox_session_open("a", T0 + 1).await.unwrap());
    assert!(other.inbox_session_open("b", T0 + 1).await.unwrap());
    assert!(
        !s.inbox_session_open("b", T0 + MIN).await.unwrap(),
        "expired"
    );
    // One ends (its sign-out): gone for every handle; ending it again finds nothing.
    assert!(other.end_inbox_session("a").await.unwrap());
    assert!(!s.inbox_session_open("a", T0 + 1).await.unwrap());
    assert!(!s.end_inbox_session("a").await.unwrap());
    // Every one ends: only those still open are counted.
    s.open_inbox_session("c", T0 + 2 * MIN, T0 + HOUR)
        .await
        .unwrap();
    s.open_inbox_session("d", T0 + 2 * MIN, T0 + HOUR)
        .await
        .unwrap();
    assert_eq!(other.end_all_inbox_sessions(T0 + 2 * MIN).await.unwrap(), 2);
    for id in ["b", "c", "d"] {
        assert!(
            !s.inbox_session_open(id, T0 + 2 * MIN).await.unwrap(),
            "{id}"
        );
    }
    assert_eq!(s.end_all_inbox_sessions(T0 + 2 * MIN).await.unwrap(), 0);
}
