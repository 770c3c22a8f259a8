//! `request_hold: body`: the headers go at once, the body waits for the decision.

use super::*;
use crate::call::body_hold::may_be_governed;
use atmost_config::ToolSet;
use atmost_protocol::{KeyCarrier, KeyCarriers};

fn body_cfg() -> Rc<Config> {
    cfg_with(json!({"request_hold": "body"}))
}

fn body_cfg_with(patch: Value) -> Rc<Config> {
    let mut p = patch;
    p["request_hold"] = json!("body");
    cfg_with(p)
}

/// A POST as the RawMcp client sends it: mirrored headers and a content-length.
fn call_head(permit: &[&str], key: &[&str], tool: &str, len: usize) -> RequestHead {
    RequestHead {
        content_length: Some(len as u64),
        mirrored: mcp::Mirrored {
            method: Some("tools/call".into()),
            name: Some(tool.into()),
            ..mcp::Mirrored::default()
        },
        ..post(permit, key)
    }
}

/// Headers, then the body in two chunks: each chunk is held, the last one is read.
fn body_after_headers(call: &mut Call, body: &str) -> Step {
    assert_eq!(
        done(call.on_request_body(body.len() / 2, false)),
        Step::pause()
    );
    let len = read(call.on_request_body(body.len(), true));
    call.on_request_body_data(&body.as_bytes()[..len])
}

fn header_edits(step: &Step) -> Vec<&Effect> {
    step.effects
        .iter()
        .filter(|e| {
            matches!(
                e,
                Effect::SetRequestHeader(..) | Effect::RemoveRequestHeader(_)
            )
        })
        .collect()
}

#[test]
fn the_headers_go_at_once_without_the_permit_the_length_or_the_key() {
    let c = body_cfg();
    let mut call = Call::new(Rc::clone(&c));
    let s = call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    assert_eq!(s.flow, Flow::Continue);
    // The key header would be derived with the permit id the token only claims, before the
    // ledger confirmed it: it does not go upstream.
    assert_eq!(
        s.effects,
        vec![
            Effect::RemoveRequestHeader("atmost-permit".into()),
            no_retries(),
            Effect::RemoveRequestHeader("content-length".into()),
            Effect::RemoveRequestHeader("idempotency-key".into()),
        ]
    );
    assert_eq!(call.state_name(), "reading_body");
    // The default mode holds the headers: nothing leaves before the decision.
    let mut held = Call::new(cfg());
    let s = held.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(
        s.effects,
        vec![
            Effect::RemoveRequestHeader("atmost-permit".into()),
            no_retries()
        ]
    );
}

#[test]
fn refusals_that_need_no_body_still_come_before_anything_leaves() {
    let mut call = Call::new(body_cfg_with(json!({"max_body_bytes": 16})));
    let s = call.on_request_headers(call_head(&[TOKEN], &[], "pay_invoice", PAY.len()));
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(local_reply(&s).status, 413);
    assert!(header_edits(&s).is_empty());
    let mut call = Call::new(body_cfg());
    let s = call.on_request_headers(RequestHead {
        content_encoding: vec![b"gzip".to_vec()],
        ..call_head(&[TOKEN], &[], "pay_invoice", PAY.len())
    });
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(local_reply(&s).status, 400);
}

#[test]
fn the_body_waits_for_the_ledger_and_goes_without_header_edits() {
    let c = body_cfg();
    let mut call = Call::new(Rc::clone(&c));
    call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    let s = body_after_headers(&mut call, PAY);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(authorize_body(&s).idempotency_key.as_deref(), Some("k1"));
    assert_eq!(call.state_name(), "authorizing");
    // More body events while the callout is out are held too.
    assert_eq!(done(call.on_request_body(PAY.len(), true)), Step::pause());
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert!(header_edits(&s).is_empty(), "{s:?}");
    assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
    assert_eq!(call.state_name(), "dispatched");
}

#[test]
fn a_key_only_in_meta_reaches_the_upstream_only_in_the_body() {
    const META_PAY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"amount":1},"_meta":{"dev.atmost/idempotency-key":"raw-k1"}}}"#;
    let c = body_cfg();
    let mut call = Call::new(Rc::clone(&c));
    let s = call.on_request_headers(call_head(&[TOKEN], &[], "pay_invoice", META_PAY.len()));
    // No key header was sent, so none leaves: it cannot be added once the headers are gone.
    assert!(!s
        .effects
        .iter()
        .any(|e| matches!(e, Effect::SetRequestHeader(n, _) | Effect::RemoveRequestHeader(n) if n == "idempotency-key")));
    let s = body_after_headers(&mut call, META_PAY);
    assert_eq!(
        authorize_body(&s).idempotency_key.as_deref(),
        Some("raw-k1")
    );
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(
        body_edit_of(&s),
        Some(META_PAY.replace("raw-k1", &derived(&c, "pmt_1", "raw-k1")))
    );
    // Neither the key header nor content-length is set after the headers left.
    assert!(header_edits(&s).is_empty(), "{s:?}");
    assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
}

#[test]
fn denials_replays_and_refusals_after_the_headers_left_are_local_replies() {
    // Denied by the ledger.
    let mut call = Call::new(body_cfg());
    call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    body_after_headers(&mut call, PAY);
    let deny = AuthorizeResponse::Deny(Denial::new(DenialCode::PermitMaxCallsExceeded, "cap"));
    let s = call.on_ledger_reply(&ledger(&deny));
    assert_eq!(s.flow, Flow::Pause);
    assert!(String::from_utf8_lossy(&local_reply(&s).body).contains("permit_max_calls_exceeded"));
    assert!(!s.effects.contains(&Effect::ResumeRequest));
    // Replayed.
    let mut call = Call::new(body_cfg());
    call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    body_after_headers(&mut call, PAY);
    let replay = AuthorizeResponse::Replay {
        attempt_id: "att_0".into(),
        receipt: r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#.into(),
        limits: None,
    };
    let s = call.on_ledger_reply(&ledger(&replay));
    assert!(local_reply(&s)
        .headers
        .iter()
        .any(|(k, v)| k == "idempotent-replayed" && v == "true"));
    assert!(!s.effects.contains(&Effect::ResumeRequest));
    // Denied before any callout (no permit), and refused (malformed).
    let mut call = Call::new(body_cfg());
    call.on_request_headers(call_head(&[], &["\"k1\""], "pay_invoice", PAY.len()));
    let s = body_after_headers(&mut call, PAY);
    assert!(String::from_utf8_lossy(&local_reply(&s).body).contains("permit_invalid"));
    assert!(s.callout.is_none());
    let mut call = Call::new(body_cfg());
    call.on_request_headers(call_head(&[TOKEN], &[], "send_email", PAY.len()));
    let s = body_after_headers(&mut call, PAY);
    assert_eq!(
        local_reply(&s).status,
        400,
        "Mcp-Name disagrees with the body"
    );
    assert!(s.callout.is_none());
}

#[test]
fn a_dispatch_under_another_permit_than_the_token_names_is_not_sent() {
    let c = body_cfg();
    let other = "atmp_pmt_2_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    // A token that spells no permit id at all: nothing could be derived for it either.
    for token in [other, "tok"] {
        let mut call = Call::new(Rc::clone(&c));
        let h = call.on_request_headers(call_head(&[token], &["\"k1\""], "pay_invoice", PAY.len()));
        assert!(h
            .effects
            .contains(&Effect::RemoveRequestHeader("idempotency-key".into())));
        body_after_headers(&mut call, PAY);
        // The ledger answers for pmt_1.
        let s = call.on_ledger_reply(&ledger(&dispatch()));
        assert!(String::from_utf8_lossy(&local_reply(&s).body).contains("gateway_unavailable"));
        assert!(!s.effects.contains(&Effect::ResumeRequest));
        let reports = enqueued(&s);
        assert_eq!(reports.len(), 1, "{token}");
        assert_eq!(reports[0].attempt_id, "att_1");
        assert!(matches!(&reports[0].outcome,
            Outcome::Released { reason } if reason == "never_sent: dispatch_permit_mismatch"));
        assert!(counts(&s).contains(&Stat::Released));
    }
}

/// Nothing is signed in this mode: the headers left before the ledger could sign them. The
/// ledger is told the key the upstream receives, which is only a key the body carries.
#[test]
fn no_dispatch_is_asked_for_and_only_a_body_key_is_forwarded() {
    const META_PAY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"amount":1},"_meta":{"dev.atmost/idempotency-key":"k1"}}}"#;
    for (mode, expected) in [
        (
            json!({"mode": "hmac", "secret": "0123456789abcdef0123"}),
            true,
        ),
        (json!({"mode": "raw"}), true),
        (json!({"mode": "off"}), false),
    ] {
        let c = body_cfg_with(json!({ "upstream_key": mode }));
        let want = upstream_key::upstream_value(&c.upstream_key, "pmt_1", Some("k1"));
        // The key only in the header: it reaches the upstream nowhere.
        let mut call = Call::new(Rc::clone(&c));
        call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
        let asked = authorize_body(&body_after_headers(&mut call, PAY));
        assert_eq!(asked.dispatch, None, "{mode}");
        assert_eq!(asked.idempotency_key.as_deref(), Some("k1"));
        assert_eq!(asked.forwarded_key, None, "{mode}");
        let s = call.on_ledger_reply(&ledger(&dispatch()));
        assert!(header_edits(&s).is_empty(), "{s:?}");
        assert_eq!(body_edit_of(&s), None);
        assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
        // In the body (and the header): the body form is what the upstream receives.
        let mut call = Call::new(Rc::clone(&c));
        call.on_request_headers(call_head(
            &[TOKEN],
            &["\"k1\""],
            "pay_invoice",
            META_PAY.len(),
        ));
        let asked = authorize_body(&body_after_headers(&mut call, META_PAY));
        assert_eq!(asked.dispatch, None, "{mode}");
        assert_eq!(
            asked.forwarded_key,
            want.clone().filter(|_| expected),
            "{mode}"
        );
        // A ledger that signs anyway: nothing of it is added, the headers are gone.
        let mut answer = dispatch();
        if let AuthorizeResponse::Dispatch { signature, .. } = &mut answer {
            *signature = Some(DispatchSignature {
                signature_input: "atmost=()".into(),
                signature: "atmost=:AA==:".into(),
            });
        }
        let s = call.on_ledger_reply(&ledger(&answer));
        assert!(header_edits(&s).is_empty(), "{s:?}");
        assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
        let sent = body_edit_of(&s);
        match &c.upstream_key {
            UpstreamKey::Hmac { .. } => {
                let v = want.unwrap_or_default();
                assert_eq!(sent, Some(META_PAY.replace("\"k1\"", &format!("\"{v}\""))));
            }
            UpstreamKey::Raw => assert_eq!(sent, None),
            UpstreamKey::Off => assert!(sent.is_some_and(|b| !b.contains("k1"))),
        }
    }
}

#[test]
fn traffic_without_a_ledger_answer_after_its_key_header_was_held_back_is_refused() {
    const LIST: &str = r#"{"jsonrpc":"2.0","id":3,"method":"tools/list"}"#;
    let c = body_cfg();
    // No mirrored headers: it may be a governed call, so its key header was held back. A
    // tools/list cannot go on without it.
    let mut call = Call::new(Rc::clone(&c));
    call.on_request_headers(RequestHead {
        content_length: Some(LIST.len() as u64),
        ..post(&[TOKEN], &["\"k1\""])
    });
    let s = body_after_headers(&mut call, LIST);
    assert_eq!(s.flow, Flow::Pause);
    let reply = local_reply(&s);
    assert_eq!(reply.status, 400);
    assert!(String::from_utf8_lossy(&reply.body).contains("request_hold: body"));
    // Without the permit header, the header took the ungoverned form: it passes.
    let mut call = Call::new(Rc::clone(&c));
    let h = call.on_request_headers(RequestHead {
        content_length: Some(LIST.len() as u64),
        ..post(&[], &["\"k1\""])
    });
    assert!(h.effects.contains(&Effect::SetRequestHeader(
        "idempotency-key".into(),
        derived(&c, "", "k1")
    )));
    assert_eq!(body_after_headers(&mut call, LIST), Step::cont());
    // With Mcp-Method saying what it is, the header takes the ungoverned form: it passes.
    let mut call = Call::new(Rc::clone(&c));
    let h = call.on_request_headers(RequestHead {
        content_length: Some(LIST.len() as u64),
        mirrored: mcp::Mirrored {
            method: Some("tools/list".into()),
            ..mcp::Mirrored::default()
        },
        ..post(&[TOKEN], &["\"k1\""])
    });
    assert!(h.effects.contains(&Effect::SetRequestHeader(
        "idempotency-key".into(),
        derived(&c, "", "k1")
    )));
    assert_eq!(body_after_headers(&mut call, LIST), Step::cont());
    // The same tools/list without a key header passes whatever the permit.
    let mut call = Call::new(Rc::clone(&c));
    call.on_request_headers(RequestHead {
        content_length: Some(LIST.len() as u64),
        ..post(&[TOKEN], &[])
    });
    assert_eq!(body_after_headers(&mut call, LIST), Step::cont());
}

/// A tools/list refused for its held-back key header is answered, not watched: with
/// `tools_list_limits` the answer that then passes through the filter (its own refusal) is
/// not read, and the ledger is not asked about it.
#[test]
fn a_tools_list_refused_after_its_headers_left_is_not_watched_for_figures() {
    const LIST: &str = r#"{"jsonrpc":"2.0","id":3,"method":"tools/list"}"#;
    let mut call = Call::new(body_cfg_with(json!({"tools_list_limits": true})));
    call.on_request_headers(RequestHead {
        content_length: Some(LIST.len() as u64),
        ..post(&[TOKEN], &["\"k1\""])
    });
    let s = body_after_headers(&mut call, LIST);
    assert_eq!(local_reply(&s).status, 400);
    assert_eq!(call.state_name(), "answered");
    assert!(!call.watches_response_headers());
    assert_eq!(call.on_response_headers(json_head()), Step::cont());
    assert_eq!(done(call.on_response_body(64, true)), Step::cont());
}

#[test]
fn an_ungoverned_call_keyed_in_its_body_passes_with_the_body_edit_only() {
    const ECHO: &str = r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"echo","arguments":{},"idempotencyKey":"raw-e"}}"#;
    let c = body_cfg_with(json!({"governed_tools": ["pay_invoice"]}));
    let mut call = Call::new(Rc::clone(&c));
    let h = call.on_request_headers(call_head(&[TOKEN], &["\"raw-e\""], "echo", ECHO.len()));
    // Mcp-Name names an ungoverned tool: the header takes the ungoverned form.
    assert!(h.effects.contains(&Effect::SetRequestHeader(
        "idempotency-key".into(),
        derived(&c, "", "raw-e")
    )));
    let s = body_after_headers(&mut call, ECHO);
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(
        body_edit_of(&s),
        Some(ECHO.replace("raw-e", &derived(&c, "", "raw-e")))
    );
    assert!(header_edits(&s).is_empty(), "{s:?}");
}

#[test]
fn no_mode_sends_a_governed_calls_key_header_ahead() {
    const LIST: &str = r#"{"jsonrpc":"2.0","id":3,"method":"tools/list"}"#;
    for (mode, held_back) in [
        (json!({"mode": "raw"}), true),
        (json!({"mode": "off"}), false),
    ] {
        let c = body_cfg_with(json!({ "upstream_key": mode }));
        let s = Call::new(Rc::clone(&c)).on_request_headers(call_head(
            &[TOKEN],
            &["\"k1\""],
            "pay_invoice",
            9,
        ));
        assert!(
            s.effects
                .contains(&Effect::RemoveRequestHeader("idempotency-key".into())),
            "{mode}"
        );
        // Under `off` no key header goes upstream anyway: a tools/list after it passes; the
        // raw key would have gone as it came, so without it the message is refused.
        let mut call = Call::new(c);
        call.on_request_headers(RequestHead {
            content_length: Some(LIST.len() as u64),
            ..post(&[TOKEN], &["\"k1\""])
        });
        let s = body_after_headers(&mut call, LIST);
        assert_eq!(s == Step::cont(), !held_back, "{mode}: {s:?}");
    }
    // A POST that says it is no governed call keeps the raw header as sent.
    let raw = body_cfg_with(json!({"upstream_key": {"mode": "raw"}}));
    let s = Call::new(raw).on_request_headers(RequestHead {
        content_length: Some(LIST.len() as u64),
        mirrored: mcp::Mirrored {
            method: Some("tools/list".into()),
            ..mcp::Mirrored::default()
        },
        ..post(&[TOKEN], &["\"k1\""])
    });
    assert!(!s
        .effects
        .iter()
        .any(|e| matches!(e, Effect::SetRequestHeader(n, _) | Effect::RemoveRequestHeader(n) if n == "idempotency-key")));
}

#[test]
fn whether_a_post_may_be_governed_is_read_from_its_headers() {
    let governed = ToolSet::Only(vec!["pay".into()]);
    let m = |method: Option<&str>, name: Option<&str>, duplicated: bool| mcp::Mirrored {
        method: method.map(str::to_string),
        name: name.map(str::to_string),
        duplicated,
        ..mcp::Mirrored::default()
    };
    let cases = [
        (m(None, None, false), true),
        (m(Some("tools/call"), None, false), true),
        (m(Some("tools/call"), Some("pay"), false), true),
        (m(Some("tools/call"), Some("echo"), false), false),
        (m(Some("tools/list"), None, false), false),
        (m(Some("initialize"), Some("pay"), false), false),
        (m(None, Some("echo"), false), false),
        (m(Some("tools/list"), None, true), true),
    ];
    for (mirrored, want) in cases {
        assert_eq!(may_be_governed(&mirrored, &governed), want, "{mirrored:?}");
    }
    assert!(may_be_governed(
        &m(Some("tools/call"), Some("echo"), false),
        &ToolSet::All
    ));
}

#[test]
fn an_answer_before_the_body_was_read_goes_to_the_client_and_the_body_never_follows() {
    let mut call = Call::new(body_cfg());
    call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    assert!(call.watches_response_headers());
    let s = call.on_response_headers(json_head());
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(counts(&s), vec![Stat::UpstreamAnsweredEarly]);
    assert_eq!(call.state_name(), "overtaken");
    // The answer streams on; the body is held for good and never read.
    assert_eq!(done(call.on_response_body(10, true)), Step::cont());
    assert_eq!(done(call.on_request_body(PAY.len(), true)), Step::pause());
    assert_eq!(call.on_request_trailers(), Step::pause());
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
    // In the default mode nothing is upstream before the decision: no such answer is watched.
    let mut held = Call::new(cfg());
    held.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    assert!(!held.watches_response_headers());
}

#[test]
fn an_answer_while_the_ledger_decides_is_held_and_the_dispatch_released() {
    let mut call = Call::new(body_cfg());
    call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    body_after_headers(&mut call, PAY);
    let s = call.on_response_headers(json_head());
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(counts(&s), vec![Stat::UpstreamAnsweredEarly]);
    assert_eq!(done(call.on_response_body(10, false)), Step::pause());
    assert_eq!(done(call.on_response_trailers()), Step::pause());
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert!(!s.effects.contains(&Effect::ResumeRequest), "{s:?}");
    assert!(!s.effects.iter().any(|e| matches!(e, Effect::LocalReply(_))));
    assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
    let reports = enqueued(&s);
    assert_eq!(reports.len(), 1);
    assert_eq!(
        (reports[0].attempt_id.as_str(), reports[0].round),
        ("att_1", 1)
    );
    assert!(matches!(&reports[0].outcome,
        Outcome::Released { reason } if reason == "never_sent: upstream_answered_first"));
    assert_eq!(counts(&s), vec![Stat::Released]);
    // Nothing after that lets the body go or reports again.
    assert_eq!(call.state_name(), "overtaken");
    assert_eq!(done(call.on_request_body(PAY.len(), true)), Step::pause());
    assert_eq!(done(call.on_response_body(10, true)), Step::cont());
    assert!(!call.needs_log_props());
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
}

#[test]
fn an_answer_while_the_call_is_held_for_approval_ends_the_hold_at_the_next_ask() {
    let mut call = Call::new(body_cfg_with(json!({"approval_hold_ms": 60_000})));
    call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    body_after_headers(&mut call, PAY);
    let approval_required = AuthorizeResponse::Deny(
        Denial::new(DenialCode::ApprovalRequired, "a person decides").with("retry_after", 1),
    );
    let s = call.on_ledger_reply(&ledger(&approval_required));
    assert!(s
        .effects
        .contains(&Effect::HoldForApproval { wait_ms: 1_000 }));
    // The upstream gives up on the body meanwhile: its answer is held until the next ask.
    let s = call.on_response_headers(json_head());
    assert_eq!(s.flow, Flow::Pause);
    assert!(call.is_held());
    let s = call.on_ledger_reply(&ledger(&approval_required));
    assert_eq!(
        counts(&s),
        vec![Stat::ApprovalHoldAnswered],
        "the hold is over, not renewed"
    );
    assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
    assert!(!call.is_held());
    assert_eq!(call.state_name(), "overtaken");
}

#[test]
fn a_denial_or_replay_after_an_early_answer_lets_that_answer_go_and_reserves_nothing() {
    let replay = AuthorizeResponse::Replay {
        attempt_id: "att_0".into(),
        receipt: r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#.into(),
        limits: None,
    };
    let deny = AuthorizeResponse::Deny(Denial::new(DenialCode::PermitExpired, "expired"));
    let failed = LedgerReply {
        status: None,
        body: Vec::new(),
    };
    for reply in [ledger(&replay), ledger(&deny), failed] {
        let mut call = Call::new(body_cfg());
        call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
        body_after_headers(&mut call, PAY);
        assert_eq!(call.on_response_headers(json_head()).flow, Flow::Pause);
        let s = call.on_ledger_reply(&reply);
        assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse), "{s:?}");
        assert!(enqueued(&s).is_empty());
        assert!(!s
            .effects
            .iter()
            .any(|e| matches!(e, Effect::LocalReply(_) | Effect::ResumeRequest)));
        assert_eq!(call.state_name(), "overtaken");
    }
}

#[test]
fn an_answer_after_the_dispatch_is_watched_as_in_the_default_mode() {
    let mut call = Call::new(body_cfg());
    call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    body_after_headers(&mut call, PAY);
    call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    let s = call.on_response_headers(json_head());
    assert_eq!(s, Step::cont());
    assert_eq!(call.state_name(), "buffering_json");
}

/// The carriers a call's authorize states are where its dispatch puts the forwarded key: the
/// header the upstream gets (set by the dispatch, or left with the headers under
/// `request_hold: body`) and each body member that reaches it holding the forwarded value.
/// Every combination of hold, `upstream_key` mode and the places the client used.
#[test]
fn authorize_states_where_the_dispatch_puts_the_forwarded_key() {
    let meta = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"amount":1},"_meta":{"dev.atmost/idempotency-key":"k1"}}}"#;
    let param = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","idempotencyKey":"k1","arguments":{"amount":1}}}"#;
    let plain = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"amount":1}}}"#;
    let cases: [(&[&str], &str); 5] = [
        (&["\"k1\""], plain),
        (&[], meta),
        (&[], param),
        (&["\"k1\""], meta),
        (&[], plain),
    ];
    let mut seen_body_only = false;
    for hold in ["headers", "body"] {
        for mode in ["hmac", "raw", "off"] {
            let mut patch = json!({"request_hold": hold});
            if mode != "hmac" {
                patch["upstream_key"] = json!({"mode": mode});
            }
            let c = cfg_with(patch);
            for (key, body) in cases {
                let what = format!("{hold} {mode} {key:?} {body}");
                let mut call = Call::new(Rc::clone(&c));
                let head =
                    call.on_request_headers(call_head(&[TOKEN], key, "pay_invoice", body.len()));
                let asked = authorize_body(&body_after_headers(&mut call, body));
                let dispatched = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
                assert_eq!(
                    dispatched.effects.last(),
                    Some(&Effect::ResumeRequest),
                    "{what}"
                );
                let header = [&head, &dispatched]
                    .iter()
                    .flat_map(|s| s.effects.iter())
                    .filter_map(|e| match e {
                        Effect::SetRequestHeader(h, v) if h == "idempotency-key" => Some(Some(v)),
                        Effect::RemoveRequestHeader(h) if h == "idempotency-key" => Some(None),
                        _ => None,
                    })
                    .next_back()
                    .flatten();
                let upstream_body = body_edit_of(&dispatched).unwrap_or_else(|| body.to_string());
                let params: Value = serde_json::from_str::<Value>(&upstream_body)
                    .map(|v| v["params"].clone())
                    .unwrap_or_else(|e| panic!("{e}"));
                let fwd = asked.forwarded_key.clone();
                let holds = |v: &Value| fwd.is_some() && v.as_str() == fwd.as_deref();
                let mut arrived = KeyCarriers::NONE;
                // Every dispatch under `headers` sets or removes the header, so the last edit
                // of it is what the upstream gets; under `body`, without one it has none.
                if header.is_some_and(|v| Some(v.as_str()) == fwd.as_deref()) {
                    arrived = arrived.with(KeyCarrier::Header);
                }
                if holds(&params["_meta"]["dev.atmost/idempotency-key"]) {
                    arrived = arrived.with(KeyCarrier::Meta);
                }
                if holds(&params["idempotencyKey"]) {
                    arrived = arrived.with(KeyCarrier::IdempotencyKeyParam);
                }
                assert_eq!(asked.forwarded_key_carriers, arrived, "{what}");
                assert_eq!(asked.forwarded_key.is_some(), !arrived.is_empty(), "{what}");
                if hold == "body" && mode == "hmac" && key.is_empty() && body == meta {
                    // The case that must not read as a header: the key went in `_meta` only.
                    assert_eq!(arrived, KeyCarriers::NONE.with(KeyCarrier::Meta));
                    seen_body_only = true;
                }
            }
        }
    }
    assert!(seen_body_only);
}

#[test]
fn an_early_answer_then_a_dispatch_read_only_in_part_still_releases_it() {
    let mut call = Call::new(body_cfg());
    call.on_request_headers(call_head(&[TOKEN], &["\"k1\""], "pay_invoice", PAY.len()));
    body_after_headers(&mut call, PAY);
    call.on_response_headers(json_head());
    let body = br#"{"decision":"dispatch","attempt_id":"att_1","permit_id":"pmt_1","lease_ms":1,"round":1,"capability":"cap-1","limits":7}"#;
    let s = call.on_ledger_reply(&LedgerReply {
        status: Some(200),
        body: body.to_vec(),
    });
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Released {
            reason: "never_sent: upstream_answered_first".into()
        })]
    );
    assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
}
