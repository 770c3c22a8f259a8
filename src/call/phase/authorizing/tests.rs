//! A governed `tools/call` and the ledger's decision: the authorize callout, what a
//! dispatch sends upstream, and the answers given here.

use crate::call::tests::*;

#[test]
fn permit_problems_deny_locally() {
    for permit in [&[][..], &[""][..], &["a", "b"][..], &["to ken"][..]] {
        let mut call = Call::new(cfg());
        let s = send(&mut call, post(permit, &[]), PAY);
        assert!(s.callout.is_none());
        let r = local_reply(&s);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("atmost-denial"), Some("permit_invalid"));
        assert_eq!(
            counts(&s),
            vec![Stat::Denied, Stat::DeniedCode(DenialCode::PermitInvalid)]
        );
        let v = r.body_json().unwrap_or(Value::Null);
        assert_eq!(v["id"], 7);
        assert_eq!(v["result"]["isError"], true);
    }
}

#[test]
fn key_problems_deny_locally() {
    let conflict = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","_meta":{"dev.atmost/idempotency-key":"other"}}}"#;
    for (keys, body) in [
        (&["\"unterminated"][..], PAY),
        (&["a", "b"][..], PAY),
        (&["\"k1\""][..], conflict),
    ] {
        let mut call = Call::new(cfg());
        let s = send(&mut call, post(&[TOKEN], keys), body);
        assert!(s.callout.is_none());
        assert_eq!(
            local_reply(&s).header("atmost-denial"),
            Some("invalid_idempotency_key")
        );
    }
}

#[test]
fn governed_call_makes_one_authorize_callout() {
    let c = cfg_with(json!({"key_required_tools": ["pay_invoice"]}));
    let mut call = Call::new(c);
    let s = send(&mut call, post(&[" tok "], &["\"k1\""]), PAY);
    assert_eq!(s.flow, Flow::Pause);
    assert!(s.effects.is_empty());
    let req = authorize_body(&s);
    assert_eq!(req.permit_token, "tok");
    assert_eq!(req.tool, "pay_invoice");
    assert_eq!(req.idempotency_key.as_deref(), Some("k1"));
    assert_eq!(req.arguments, json!({"invoice":"INV-1","amount":1250}));
    assert!(req.key_required);
    assert_eq!(
        Some(req.fingerprint),
        crate::parse::fingerprint::fingerprint(
            "pay_invoice",
            json!({"amount":1250,"invoice":"INV-1"})
                .as_object()
                .unwrap_or(&serde_json::Map::new())
        )
        .ok()
    );
    assert_eq!(call.state_name(), "authorizing");
    // Body callbacks while waiting keep holding.
    assert_eq!(done(call.on_request_body(0, true)).flow, Flow::Pause);
}

#[test]
fn authorize_failures_fail_closed() {
    let failures = [
        LedgerReply::failed(),
        LedgerReply {
            status: Some(503),
            body: b"{}".to_vec(),
        },
        LedgerReply {
            status: Some(200),
            body: b"garbage".to_vec(),
        },
    ];
    for f in &failures {
        let mut call = Call::new(cfg());
        send(&mut call, post(&[TOKEN], &[]), PAY);
        let s = call.on_ledger_reply(f);
        assert!(!s.effects.contains(&Effect::ResumeRequest));
        assert_eq!(
            local_reply(&s).header("atmost-denial"),
            Some("gateway_unavailable")
        );
        assert!(counts(&s).contains(&Stat::GatewayUnavailable));
        assert_eq!(call.state_name(), "answered");
    }
    // The callout could not even be dispatched.
    let mut call = Call::new(cfg());
    send(&mut call, post(&[TOKEN], &[]), PAY);
    let s = call.on_callout_failed();
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(
        local_reply(&s).header("atmost-denial"),
        Some("gateway_unavailable")
    );
}

#[test]
fn dispatch_sets_the_upstream_key_and_resumes() {
    // hmac (default)
    let mut call = Call::new(cfg());
    send(&mut call, post(&[TOKEN], &["\"k1\""]), PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    let want = crate::call::upstream_key::upstream_value(&cfg().upstream_key, "pmt_1", Some("k1"))
        .unwrap_or_default();
    let [digest, input, sig]: [String; 3] = signature_headers(&s)
        .try_into()
        .unwrap_or_else(|v| panic!("{v:?}"));
    assert_eq!(
        s.effects,
        vec![
            Effect::SetRequestHeader("idempotency-key".into(), want),
            Effect::SetRequestHeader("content-digest".into(), digest),
            Effect::SetRequestHeader("signature-input".into(), input),
            Effect::SetRequestHeader("signature".into(), sig),
            Effect::Count(Stat::Dispatched),
            Effect::Log(
                Level::Info,
                "atmost: dispatching attempt att_1 (round 1) of `pay_invoice`".into()
            ),
            Effect::ResumeRequest,
        ]
    );
    // raw
    let mut call = Call::new(cfg_with(json!({"upstream_key": {"mode": "raw"}})));
    send(&mut call, post(&[TOKEN], &["\"k1\""]), PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(
        s.effects[0],
        Effect::SetRequestHeader("idempotency-key".into(), "k1".into())
    );
    // off
    let mut call = Call::new(cfg_with(json!({"upstream_key": {"mode": "off"}})));
    send(&mut call, post(&[TOKEN], &["\"k1\""]), PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(
        s.effects[0],
        Effect::RemoveRequestHeader("idempotency-key".into())
    );
    // no key at all
    let mut call = Call::new(cfg());
    send(&mut call, post(&[TOKEN], &[]), PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(
        s.effects[0],
        Effect::RemoveRequestHeader("idempotency-key".into())
    );
}

/// The authorize call tells the ledger the key the upstream will receive: the value the
/// dispatch then sets, in every `upstream_key` mode, and none without a key.
#[test]
fn authorize_carries_the_key_the_dispatch_forwards() {
    // A token of the ledger's shape naming permit `pmt_1`, the id `dispatch()` answers with.
    let token = format!("atmp_pmt_1_{}", "0".repeat(64));
    let forwarded = |s: &Step| {
        s.effects.iter().find_map(|e| match e {
            Effect::SetRequestHeader(h, v) if h == "idempotency-key" => Some(v.clone()),
            _ => None,
        })
    };
    for (config, key) in [
        (cfg(), Some("\"k1\"")),
        (
            cfg_with(json!({"upstream_key": {"mode": "raw"}})),
            Some("\"k1\""),
        ),
        (
            cfg_with(json!({"upstream_key": {"mode": "off"}})),
            Some("\"k1\""),
        ),
        (cfg(), None),
    ] {
        let mut call = Call::new(config.clone());
        let keys: Vec<&str> = key.into_iter().collect();
        let asked = authorize_body(&send(&mut call, post(&[&token], &keys), PAY));
        let sent = forwarded(&call.on_ledger_reply(&ledger(&signed(&call, dispatch()))));
        assert_eq!(
            asked.forwarded_key, sent,
            "{:?} {key:?}",
            config.upstream_key
        );
        let expected = match (&config.upstream_key, key) {
            (UpstreamKey::Hmac { .. }, Some(_)) => sent.clone().filter(|v| v.len() == 64),
            (UpstreamKey::Raw, Some(_)) => Some("k1".to_string()),
            _ => None,
        };
        assert_eq!(asked.forwarded_key, expected, "{:?}", config.upstream_key);
    }
    // A token that names no permit (the ledger will refuse it) forwards nothing to record,
    // and asks for no signature: nothing could be derived for it.
    let mut call = Call::new(cfg());
    let asked = authorize_body(&send(&mut call, post(&["tok"], &["\"k1\""]), PAY));
    assert_eq!(asked.forwarded_key, None);
    assert_eq!(asked.dispatch, None);
}

#[test]
fn a_key_in_meta_is_rewritten_in_the_body_like_the_header() {
    const META_PAY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"amount":10.50},"_meta":{"dev.atmost/idempotency-key":"raw-k1","x":1}}}"#;
    let body_effect = |s: &Step| {
        s.effects.iter().find_map(|e| match e {
            Effect::ReplaceRequestBody { original_len, body } => {
                Some((*original_len, String::from_utf8_lossy(body).into_owned()))
            }
            _ => None,
        })
    };
    // hmac: the body carries the derived key, content-length follows the new size.
    let mut call = Call::new(cfg());
    let head = RequestHead {
        content_length: Some(META_PAY.len() as u64),
        ..post(&[TOKEN], &[])
    };
    send(&mut call, head, META_PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    let want =
        crate::call::upstream_key::upstream_value(&cfg().upstream_key, "pmt_1", Some("raw-k1"))
            .unwrap_or_default();
    let (len, body) = body_effect(&s).expect("body rewritten");
    assert_eq!(len, META_PAY.len());
    assert_eq!(body, META_PAY.replace("raw-k1", &want));
    assert!(s.effects.contains(&Effect::SetRequestHeader(
        "content-length".into(),
        body.len().to_string()
    )));
    // off: the member is removed, the rest stays byte for byte.
    let mut call = Call::new(cfg_with(json!({"upstream_key": {"mode": "off"}})));
    send(&mut call, post(&[TOKEN], &[]), META_PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    let (_, body) = body_effect(&s).expect("body rewritten");
    assert_eq!(
        body,
        META_PAY.replace(r#""dev.atmost/idempotency-key":"raw-k1","#, "")
    );
    // raw: the body goes as sent.
    let mut call = Call::new(cfg_with(json!({"upstream_key": {"mode": "raw"}})));
    send(&mut call, post(&[TOKEN], &[]), META_PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(body_effect(&s), None);
}

#[test]
fn replay_and_deny_answer_locally() {
    let mut call = Call::new(cfg());
    send(&mut call, post(&[TOKEN], &["k1"]), PAY);
    let s = call.on_ledger_reply(&ledger(&AuthorizeResponse::Replay {
        attempt_id: "att_0".into(),
        receipt: r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#.into(),
        limits: None,
    }));
    let r = local_reply(&s);
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        r.body_json(),
        Some(
            json!({"jsonrpc":"2.0","id":7,"result":{"content":[],"_meta":{"dev.atmost/replayed":true}}})
        )
    );
    assert_eq!(counts(&s), vec![Stat::Replayed]);
    assert!(!s.effects.contains(&Effect::ResumeRequest));

    let mut call = Call::new(cfg_with(json!({"denial_format": "error"})));
    send(&mut call, post(&[TOKEN], &["k1"]), PAY);
    let s = call.on_ledger_reply(&ledger(&AuthorizeResponse::Deny(
        Denial::new(DenialCode::DeliveryUncertain, "unknown").with("attempt_id", "att_0"),
    )));
    let v = local_reply(&s).body_json().unwrap_or(Value::Null);
    assert_eq!(v["error"]["code"], -31010);
    assert_eq!(
        v["error"]["data"],
        json!({"code":"delivery_uncertain","attempt_id":"att_0"})
    );
    assert!(!s.effects.contains(&Effect::ResumeRequest));
}

#[test]
fn continuation_is_told_to_the_ledger() {
    let body = r#"{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"invoice":"INV-1","amount":1250},"inputResponses":{"q":{"action":"accept","content":{}}},"requestState":"s1"}}"#;
    let mut call = Call::new(cfg());
    let s = send(&mut call, post(&[TOKEN], &["\"k1\""]), body);
    let req = authorize_body(&s);
    assert!(req.continuation);
    // Same fingerprint as the first round: continuation fields are outside the arguments.
    let mut first = Call::new(cfg());
    let first_req = authorize_body(&send(&mut first, post(&[TOKEN], &["\"k1\""]), PAY));
    assert!(!first_req.continuation);
    assert_eq!(req.fingerprint, first_req.fingerprint);
}

#[test]
fn params_idempotency_key_is_the_key_and_is_rewritten_like_meta() {
    let c = cfg();
    let mut call = Call::new(Rc::clone(&c));
    let s = send(&mut call, post(&[TOKEN], &[]), PARAMS_PAY);
    let asked = authorize_body(&s);
    assert_eq!(asked.idempotency_key.as_deref(), Some("raw-p"));
    // The key is not part of what the call does: same fingerprint as the call without it.
    let mut plain = Call::new(Rc::clone(&c));
    let plain_fp = authorize_body(&send(&mut plain, post(&[TOKEN], &[]), PAY)).fingerprint;
    assert_eq!(asked.fingerprint, plain_fp);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    let want = derived(&c, "pmt_1", "raw-p");
    assert_eq!(
        body_edit_of(&s),
        Some(PARAMS_PAY.replace("\"raw-p\"", &format!("\"{want}\"")))
    );
    assert!(s
        .effects
        .contains(&Effect::SetRequestHeader("idempotency-key".into(), want)));
    // Every edit comes before the resume.
    assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
    // `off`: both members removed, nothing else changes.
    let mut call = Call::new(cfg_with(json!({"upstream_key": {"mode": "off"}})));
    send(&mut call, post(&[TOKEN], &[]), PARAMS_PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(
        body_edit_of(&s),
        Some(
            PARAMS_PAY
                .replace(r#""idempotencyKey":"raw-p","#, "")
                .replace(
                    r#","_meta":{"dev.atmost/idempotency-key":"raw-p"}"#,
                    r#","_meta":{}"#
                )
        )
    );
}

#[test]
fn params_idempotency_key_disagreeing_with_another_source_is_denied() {
    let only_params = PARAMS_PAY.replace(r#","_meta":{"dev.atmost/idempotency-key":"raw-p"}"#, "");
    let meta_differs = PARAMS_PAY.replace(r#"key":"raw-p"}"#, r#"key":"other"}"#);
    let not_a_string = only_params.replace(r#""raw-p""#, "5");
    for (head, body) in [
        (post(&[TOKEN], &["\"other\""]), only_params.as_str()),
        (post(&[TOKEN], &[]), meta_differs.as_str()),
        (post(&[TOKEN], &["raw-p"]), meta_differs.as_str()),
        (post(&[TOKEN], &[]), not_a_string.as_str()),
    ] {
        let mut call = Call::new(cfg());
        let s = send(&mut call, head, body);
        assert!(s.callout.is_none(), "{body}");
        assert_eq!(
            counts(&s),
            vec![
                Stat::Denied,
                Stat::DeniedCode(DenialCode::InvalidIdempotencyKey)
            ],
            "{body}"
        );
        assert_eq!(call.state_name(), "answered");
    }
    // Header and params agreeing is one key.
    let mut call = Call::new(cfg());
    let s = send(&mut call, post(&[TOKEN], &["\"raw-p\""]), &only_params);
    assert_eq!(authorize_body(&s).idempotency_key.as_deref(), Some("raw-p"));
}

#[test]
fn replays_and_ledger_denials_carry_the_figures_the_filters_own_denials_none() {
    for format in ["result", "error"] {
        let c = cfg_with(json!({"denial_format": format}));
        let mut call = Call::new(c.clone());
        send(&mut call, post(&[TOKEN], &["k1"]), PAY);
        let s = call.on_ledger_reply(&ledger(&AuthorizeResponse::Replay {
            attempt_id: "att_0".into(),
            receipt: RECEIPT.into(),
            limits: Some(figures()),
        }));
        let r = local_reply(&s);
        assert_eq!(r.header("atmost-calls-left"), Some("0"));
        let v = r.body_json().unwrap_or(Value::Null);
        assert_eq!(v["result"]["_meta"]["dev.atmost/permit"], figures_json());
        assert_eq!(v["result"]["_meta"]["dev.atmost/replayed"], true);

        let mut call = Call::new(c.clone());
        send(&mut call, post(&[TOKEN], &["k2"]), PAY);
        let mut denial = Denial::new(DenialCode::PermitMaxCallsExceeded, "cap")
            .with("tool", "pay_invoice")
            .with("limit", 1)
            .with("calls_made", 1);
        denial.limits = Some(figures());
        let s = call.on_ledger_reply(&ledger(&AuthorizeResponse::Deny(denial)));
        let r = local_reply(&s);
        assert_eq!(r.header("atmost-budget-left"), Some("48750"));
        let v = r.body_json().unwrap_or(Value::Null);
        let meta = match format {
            "result" => &v["result"]["_meta"],
            _ => &v["error"]["data"],
        };
        assert_eq!(meta["dev.atmost/permit"], figures_json(), "{format}");

        // No permit: the filter denies on its own, and has no figures to give.
        let mut call = Call::new(c);
        let s = send(&mut call, post(&[], &["k3"]), PAY);
        let r = local_reply(&s);
        assert_eq!(r.header("atmost-calls-left"), None);
        assert!(!String::from_utf8_lossy(&r.body).contains("dev.atmost/permit"));
    }
}

// Holding the call open (`approval_hold_ms`): an `approval_required` answer waits, the
// ledger asked again with the same request, until it answers otherwise or the bound is
// reached.

thread_local! {
    /// The held calls' clock (Unix ms), moved by the tests.
    static NOW: std::cell::Cell<u64> = const { std::cell::Cell::new(1_000_000) };
}

fn now() -> u64 {
    NOW.with(std::cell::Cell::get)
}

fn later(ms: u64) {
    NOW.with(|n| n.set(n.get() + ms));
}

fn approval_required(retry_after: Value) -> AuthorizeResponse {
    let mut d = Denial::new(
        DenialCode::ApprovalRequired,
        "a person must approve this call",
    )
    .with("approval_id", "att_9")
    .with("approval_expires_at", "2030-01-01T00:00:00Z");
    if !retry_after.is_null() {
        d = d.with("retry_after", retry_after);
    }
    AuthorizeResponse::Deny(d)
}

/// A governed call under `approval_hold_ms` = `hold_ms`, its first authorize out; returns
/// the call and that authorize request's bytes.
fn holding(hold_ms: u64) -> (Call, Vec<u8>) {
    let mut call = Call::new(cfg_with(json!({"approval_hold_ms": hold_ms}))).with_clock(now);
    let s = send(&mut call, post(&[TOKEN], &["\"k1\""]), PAY);
    let body = s.callout.map(|c| c.body).unwrap_or_default();
    (call, body)
}

fn hold_waits(step: &Step) -> Vec<u64> {
    picked(step, |e| match e {
        Effect::HoldForApproval { wait_ms } => Some(*wait_ms),
        _ => None,
    })
}

#[test]
fn without_a_hold_approval_required_is_answered_at_once() {
    let mut call = Call::new(cfg()).with_clock(now);
    send(&mut call, post(&[TOKEN], &["\"k1\""]), PAY);
    let s = call.on_ledger_reply(&ledger(&approval_required(json!(1))));
    assert_eq!(
        local_reply(&s).header("atmost-denial"),
        Some("approval_required")
    );
    assert!(hold_waits(&s).is_empty());
    assert!(!call.is_held());
    assert_eq!(call.reask(), None);
    assert_eq!(call.state_name(), "answered");
}

#[test]
fn a_held_call_waits_unanswered_and_asks_again_with_the_same_request() {
    let (mut call, first) = holding(60_000);
    let s = call.on_ledger_reply(&ledger(&approval_required(json!(2))));
    assert_eq!(s.flow, Flow::Pause);
    assert!(!s.effects.iter().any(|e| matches!(e, Effect::LocalReply(_))));
    assert_eq!(counts(&s), vec![Stat::ApprovalHeld]);
    assert_eq!(hold_waits(&s), vec![2_000], "the denial's retry_after");
    assert!(call.is_held());
    assert_eq!(call.state_name(), "held_for_approval");
    // The request's body callbacks keep it paused meanwhile.
    assert_eq!(done(call.on_request_body(0, true)).flow, Flow::Pause);
    let again = call.reask();
    assert_eq!(
        again,
        Some(Callout {
            endpoint: Endpoint::Authorize,
            body: first.clone()
        }),
        "the same bytes: same key, same arguments"
    );
    // Still waiting: held again, counted once.
    later(2_000);
    let s = call.on_ledger_reply(&ledger(&approval_required(json!(1))));
    assert_eq!(counts(&s), vec![]);
    assert_eq!(hold_waits(&s), vec![1_000]);
    assert_eq!(call.reask().map(|c| c.body), Some(first));
}

#[test]
fn an_approval_during_the_hold_dispatches_as_a_first_dispatch_does() {
    let mut plain = Call::new(cfg_with(json!({"approval_hold_ms": 60_000}))).with_clock(now);
    send(&mut plain, post(&[TOKEN], &["\"k1\""]), PAY);
    let first_dispatch = plain.on_ledger_reply(&ledger(&signed(&plain, dispatch())));

    let (mut call, _) = holding(60_000);
    call.on_ledger_reply(&ledger(&approval_required(json!(1))));
    later(1_000);
    call.on_ledger_reply(&ledger(&approval_required(json!(1))));
    later(1_000);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(
        s.effects.first(),
        Some(&Effect::Count(Stat::ApprovalHoldDispatched))
    );
    assert_eq!(s.effects[1..], first_dispatch.effects[..]);
    assert_eq!(s.flow, first_dispatch.flow);
    assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
    assert_eq!(call.state_name(), "dispatched");
    assert!(!call.is_held());
    assert_eq!(call.reask(), None);
}

#[test]
fn any_other_answer_during_the_hold_is_given() {
    let rejected = AuthorizeResponse::Deny(
        Denial::new(DenialCode::ApprovalRejected, "rejected")
            .with("approval_id", "att_9")
            .with("decided_by", "ana"),
    );
    let answers = [
        (ledger(&rejected), "approval_rejected"),
        (LedgerReply::failed(), "gateway_unavailable"),
    ];
    for (answer, code) in answers {
        let (mut call, _) = holding(60_000);
        call.on_ledger_reply(&ledger(&approval_required(json!(1))));
        later(1_000);
        let s = call.on_ledger_reply(&answer);
        assert_eq!(local_reply(&s).header("atmost-denial"), Some(code));
        assert_eq!(counts(&s)[0], Stat::ApprovalHoldAnswered, "{code}");
        assert_eq!(call.state_name(), "answered");
    }
    // A re-ask the host would not send: denied, the hold over.
    let (mut call, _) = holding(60_000);
    call.on_ledger_reply(&ledger(&approval_required(json!(1))));
    let s = call.on_callout_failed();
    assert_eq!(
        local_reply(&s).header("atmost-denial"),
        Some("gateway_unavailable")
    );
    assert_eq!(counts(&s)[0], Stat::ApprovalHoldAnswered);
}

#[test]
fn at_the_bound_the_last_approval_required_is_answered() {
    let (mut call, _) = holding(2_500);
    let s = call.on_ledger_reply(&ledger(&approval_required(json!(2))));
    assert_eq!(hold_waits(&s), vec![2_000]);
    later(2_000);
    // 500 ms left: the last ask falls on the bound.
    let s = call.on_ledger_reply(&ledger(&approval_required(json!(2))));
    assert_eq!(hold_waits(&s), vec![500]);
    later(500);
    let s = call.on_ledger_reply(&ledger(&approval_required(json!(2))));
    assert_eq!(counts(&s)[0], Stat::ApprovalHoldTimedOut);
    let r = local_reply(&s);
    assert_eq!(r.header("atmost-denial"), Some("approval_required"));
    let v = r.body_json().unwrap_or(Value::Null);
    assert_eq!(
        v["result"]["structuredContent"]["error"]["approval_id"], "att_9",
        "{v}"
    );
    assert_eq!(call.state_name(), "answered");
}

#[test]
fn the_wait_is_retry_after_within_one_to_five_seconds() {
    for (retry_after, wait) in [
        (json!(1), 1_000),
        (json!(5), 5_000),
        (json!(0), 1_000),
        (json!(9), 5_000),
        (json!(u64::MAX), 5_000),
        (json!("2"), 1_000),
        (Value::Null, 1_000),
    ] {
        let (mut call, _) = holding(60_000);
        let s = call.on_ledger_reply(&ledger(&approval_required(retry_after.clone())));
        assert_eq!(hold_waits(&s), vec![wait], "{retry_after}");
    }
}

#[test]
fn a_request_that_ends_while_held_stops_the_hold() {
    let (mut call, _) = holding(60_000);
    call.on_ledger_reply(&ledger(&approval_required(json!(1))));
    let s = call.on_log(LogProps::default());
    assert_eq!(counts(&s), vec![Stat::ApprovalHoldAbandoned]);
    assert!(!call.is_held());
    assert_eq!(call.reask(), None);
    // A re-ask's answer that was already out finds nothing to act on.
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(s, Step::cont());
}

/// What a held call costs: the root's tick (200 ms) drives it through the table, the
/// ledger answering `approval_required` with `retry_after: 1` for a minute; it asks at most
/// once a second, and each ask is one authorize callout.
#[test]
fn a_held_call_asks_the_ledger_at_most_once_a_second() {
    use crate::held_calls::HeldCalls;
    let (mut call, _) = holding(60_000);
    let mut held: HeldCalls<()> = HeldCalls::default();
    let start = now();
    let mut answer = call.on_ledger_reply(&ledger(&approval_required(json!(1))));
    let mut asks = 0;
    while call.is_held() {
        for wait_ms in hold_waits(&answer) {
            held.wait(1, now() + wait_ms, ());
        }
        answer = Step::pause();
        later(200);
        for (context_id, ()) in held.due(now()) {
            let again = call.reask();
            assert!(again.is_some());
            asks += 1;
            held.sent(context_id, asks);
            if let Some((_, ())) = held.answered(asks) {
                answer = call.on_ledger_reply(&ledger(&approval_required(json!(1))));
            }
        }
    }
    let held_ms = now() - start;
    assert!((60_000..=60_200).contains(&held_ms), "{held_ms}");
    assert_eq!(asks, 60, "one authorize a second for the minute");
    assert_eq!(counts(&answer)[0], Stat::ApprovalHoldTimedOut);
    assert!(held.is_empty());
}
