//! Event → action table for the per-request state machine.

use super::*;
use crate::test_config::{config_from, minimal};
use atmost_protocol::signature::{self, DispatchNonce, DispatchSignature, DispatchTarget};
use atmost_protocol::OutcomeReport;
use serde_json::json;

fn cfg() -> Rc<Config> {
    Rc::new(config_from(&minimal()))
}

fn cfg_with(patch: Value) -> Rc<Config> {
    let mut c = minimal();
    if let (Some(obj), Value::Object(p)) = (c.as_object_mut(), patch) {
        for (k, v) in p {
            obj.insert(k, v);
        }
    }
    Rc::new(config_from(&c))
}

fn post(permit: &[&str], key: &[&str]) -> RequestHead {
    RequestHead {
        method: "POST".into(),
        permit: permit.iter().map(|p| p.as_bytes().to_vec()).collect(),
        idempotency_key: key.iter().map(|k| k.as_bytes().to_vec()).collect(),
        path: "/mcp".into(),
        ..RequestHead::default()
    }
}

const PAY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"invoice":"INV-1","amount":1250}}}"#;

fn read(step: BodyStep) -> usize {
    match step {
        BodyStep::Read { len } => len,
        BodyStep::Done(s) => panic!("expected a read, got {s:?}"),
    }
}

fn done(step: BodyStep) -> Step {
    match step {
        BodyStep::Done(s) => s,
        BodyStep::Read { len } => panic!("expected done, got read {len}"),
    }
}

/// What every POST's headers get: no Envoy retry, whatever the route says.
fn no_retries() -> Effect {
    Effect::SetRequestHeader("x-envoy-max-retries".into(), "0".into())
}

/// Drives headers + whole body; returns the step after the body.
fn send(call: &mut Call, head: RequestHead, body: &str) -> Step {
    let mut edits = if head.permit.is_empty() {
        vec![]
    } else {
        vec![Effect::RemoveRequestHeader("atmost-permit".into())]
    };
    edits.push(no_retries());
    let s = call.on_request_headers(head);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(s.effects, edits);
    assert_eq!(
        done(call.on_request_body(body.len() / 2, false)).flow,
        Flow::Pause
    );
    let len = read(call.on_request_body(body.len(), true));
    assert_eq!(len, body.len());
    call.on_request_body_data(body.as_bytes())
}

fn local_reply(step: &Step) -> &LocalReply {
    step.effects
        .iter()
        .find_map(|e| match e {
            Effect::LocalReply(r) => Some(r),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no local reply in {step:?}"))
}

fn counts(step: &Step) -> Vec<Stat> {
    step.effects
        .iter()
        .filter_map(|e| match e {
            Effect::Count(s) => Some(*s),
            _ => None,
        })
        .collect()
}

/// What `pick` takes out of a step's effects, in order.
fn picked<T>(step: &Step, pick: impl Fn(&Effect) -> Option<T>) -> Vec<T> {
    step.effects.iter().filter_map(pick).collect()
}

fn enqueued(step: &Step) -> Vec<OutcomeReport> {
    picked(step, |e| match e {
        Effect::Enqueue(r) => Some(r.clone()),
        _ => None,
    })
}

fn authorize_body(step: &Step) -> AuthorizeRequest {
    let c = step
        .callout
        .as_ref()
        .unwrap_or_else(|| panic!("no callout in {step:?}"));
    assert_eq!(c.endpoint, Endpoint::Authorize);
    serde_json::from_slice(&c.body).unwrap_or_else(|e| panic!("{e}"))
}

fn ledger(resp: &AuthorizeResponse) -> LedgerReply {
    LedgerReply {
        status: Some(200),
        body: serde_json::to_vec(resp).unwrap_or_default(),
    }
}

/// A well-formed token of permit `pmt_1`, the permit [`dispatch`] answers with.
pub(crate) const TOKEN: &str =
    "atmp_pmt_1_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// The ledger's Dispatch answer: for `att_1`, round 1, under `pmt_1`, without a signature
/// (see [`signed`]).
fn dispatch() -> AuthorizeResponse {
    AuthorizeResponse::Dispatch {
        attempt_id: "att_1".into(),
        permit_id: "pmt_1".into(),
        lease_ms: 30_000,
        round: 1,
        capability: "cap-1".into(),
        limits: None,
        signature: None,
        credential: None,
    }
}

/// A ledger's signature over `target` for the dispatch `nonce` names, as the ledger writes
/// it (its bytes stand in: the filter holds no key to check them).
pub(crate) fn ledger_signature(
    target: &DispatchTarget,
    nonce: &DispatchNonce,
) -> DispatchSignature {
    let (input, _) = target
        .to_sign(1_764_680_000, "kid-test", nonce)
        .unwrap_or_else(|| panic!("an unsignable target: {target:?}"));
    DispatchSignature {
        signature_input: input.header_value(),
        signature: signature::signature_header(&[7; 64]),
    }
}

/// The request `call` (waiting for its authorize answer) asked the ledger to sign.
pub(crate) fn asked_to_sign(call: &Call) -> Option<DispatchTarget> {
    match &call.state {
        State::Authorizing(p) => p
            .upstream
            .as_ref()
            .and_then(|u| u.signing.as_ref())
            .map(|s| s.target.clone()),
        _ => None,
    }
}

/// `answer` as a ledger gives it to `call`: a Dispatch carries the signature over the
/// request the call asked to have signed, and none when it asked for none.
pub(crate) fn signed(call: &Call, mut answer: AuthorizeResponse) -> AuthorizeResponse {
    let tool = match &call.state {
        State::Authorizing(p) => p.tool.clone(),
        _ => return answer,
    };
    let target = asked_to_sign(call);
    if let AuthorizeResponse::Dispatch {
        attempt_id,
        permit_id,
        round,
        signature,
        ..
    } = &mut answer
    {
        let nonce = DispatchNonce {
            attempt_id: attempt_id.clone(),
            round: *round,
            permit_id: permit_id.clone(),
            tool,
        };
        *signature = target.map(|t| ledger_signature(&t, &nonce));
    }
    answer
}

/// The values of the signature headers a step sets, in the order it sets them.
fn signature_headers(step: &Step) -> Vec<String> {
    step.effects
        .iter()
        .filter_map(|e| match e {
            Effect::SetRequestHeader(n, v) if signing::SIGNATURE_HEADERS.contains(&n.as_str()) => {
                Some(v.clone())
            }
            _ => None,
        })
        .collect()
}

/// What the filter keeps of [`dispatch`]: every report names its round and capability.
fn grant() -> DispatchGrant {
    DispatchGrant {
        attempt_id: "att_1".into(),
        round: 1,
        capability: "cap-1".into(),
    }
}

/// A call dispatched upstream with a key.
fn dispatched(c: Rc<Config>) -> Call {
    let mut call = Call::new(c);
    let s = send(&mut call, post(&[TOKEN], &["\"k1\""]), PAY);
    assert!(s.callout.is_some());
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
    assert_eq!(call.state_name(), "dispatched");
    call
}

fn json_head() -> ResponseHead {
    ResponseHead {
        content_type: Some("application/json; charset=utf-8".into()),
        end_of_stream: false,
        tool_refusal: None,
    }
}

fn sse_head() -> ResponseHead {
    ResponseHead {
        content_type: Some("text/event-stream".into()),
        end_of_stream: false,
        tool_refusal: None,
    }
}

const RECEIPT: &str =
    r#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"paid"}]}}"#;

#[test]
fn non_post_passes_without_reading() {
    for method in ["GET", "DELETE", "OPTIONS", "PUT"] {
        let mut call = Call::new(cfg());
        let s = call.on_request_headers(RequestHead {
            method: method.into(),
            permit: vec![b"tok".to_vec()],
            ..RequestHead::default()
        });
        assert_eq!(s.flow, Flow::Continue);
        assert_eq!(
            s.effects,
            vec![Effect::RemoveRequestHeader("atmost-permit".into())]
        );
        // Without a permit header there is nothing to strip.
        let s = Call::new(cfg()).on_request_headers(RequestHead {
            method: method.into(),
            ..RequestHead::default()
        });
        assert!(s.effects.is_empty());
        assert!(s.callout.is_none());
        assert_eq!(call.state_name(), "passing");
        assert_eq!(done(call.on_request_body(10, true)).flow, Flow::Continue);
        assert_eq!(call.on_response_headers(sse_head()).flow, Flow::Continue);
        assert_eq!(done(call.on_response_body(10, false)), Step::cont());
        assert_eq!(call.on_log(LogProps::default()), Step::cont());
    }
}

#[test]
fn bodiless_post_passes() {
    let mut call = Call::new(cfg());
    let mut head = post(&[], &[]);
    head.end_of_stream = true;
    let s = call.on_request_headers(head);
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(call.state_name(), "passing");
}

#[test]
fn too_large_by_content_length_or_by_body() {
    let c = cfg_with(json!({"max_body_bytes": 100}));
    let mut call = Call::new(Rc::clone(&c));
    let mut head = post(&[TOKEN], &[]);
    head.content_length = Some(101);
    let s = call.on_request_headers(head);
    assert_eq!(s.flow, Flow::Pause);
    let r = local_reply(&s);
    assert_eq!(r.status, 413);
    assert_eq!(
        r.body_json(),
        Some(
            json!({"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"request body exceeds max_body_bytes (100)"}})
        )
    );
    assert_eq!(call.state_name(), "answered");

    let mut call = Call::new(c);
    call.on_request_headers(post(&[TOKEN], &[]));
    assert_eq!(done(call.on_request_body(60, false)).flow, Flow::Pause);
    let s = done(call.on_request_body(101, false));
    assert_eq!(local_reply(&s).status, 413);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(counts(&s), vec![Stat::BadRequest]);
}

#[test]
fn a_body_in_another_charset_or_encoding_is_refused_before_it_is_read() {
    for (content_type, content_encoding) in [
        (&["application/json; charset=utf-7"][..], &[][..]),
        (&["application/json; charset=iso-8859-1"], &[]),
        (
            &["application/json", "application/json; charset=utf-16"],
            &[],
        ),
        (&["application/json"], &["gzip"]),
        (&[], &["identity", "br"]),
    ] {
        let mut call = Call::new(cfg());
        let mut head = post(&[TOKEN], &[]);
        head.content_type = content_type.iter().map(|v| v.as_bytes().to_vec()).collect();
        head.content_encoding = content_encoding
            .iter()
            .map(|v| v.as_bytes().to_vec())
            .collect();
        let s = call.on_request_headers(head);
        assert_eq!(s.flow, Flow::Pause);
        assert!(s.callout.is_none());
        let r = local_reply(&s);
        assert_eq!(r.status, 400, "{content_type:?} {content_encoding:?}");
        assert_eq!(
            r.body_json().map(|b| b["error"]["code"].clone()),
            Some(json!(-32600))
        );
        assert_eq!(counts(&s), vec![Stat::BadRequest]);
        assert_eq!(call.state_name(), "answered");
        // Nothing of the body is read or let through afterwards.
        assert_eq!(
            done(call.on_request_body(PAY.len(), true)).flow,
            Flow::Pause
        );
    }
    // UTF-8 declared in any spelling, and identity, are read as usual.
    let mut call = Call::new(cfg());
    let mut head = post(&[TOKEN], &["\"k1\""]);
    head.content_type = vec![b"application/json; charset=\"UTF-8\"".to_vec()];
    head.content_encoding = vec![b"identity".to_vec()];
    assert_eq!(call.on_request_headers(head).flow, Flow::Pause);
    assert_eq!(call.state_name(), "reading_body");
    let len = read(call.on_request_body(PAY.len(), true));
    let s = call.on_request_body_data(&PAY.as_bytes()[..len]);
    assert!(s.callout.is_some(), "{s:?}");
}

#[test]
fn keys_equal_under_case_folding_are_refused_before_any_decision() {
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","Method":"tools/call","params":{"name":"pay_invoice"}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","Name":"pay_invoice"}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"amount":1,"Amount":99999}}}"#,
        "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"pay_invoice\",\"arguments\":{},\"argument\u{17F}\":{\"amount\":9}}}",
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list","METHOD":"tools/call"}]"#,
    ] {
        let mut call = Call::new(cfg());
        call.on_request_headers(post(&[TOKEN], &["\"k1\""]));
        let len = read(call.on_request_body(body.len(), true));
        let s = call.on_request_body_data(&body.as_bytes()[..len]);
        assert!(s.callout.is_none(), "{body}");
        let r = local_reply(&s);
        assert_eq!(r.status, 400);
        let reply = r.body_json().unwrap_or_default();
        assert_eq!(reply["error"]["code"], json!(-32700), "{body}");
        assert!(reply["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("letter case")));
    }
}

#[test]
fn bad_bodies_are_local_replies() {
    for (body, status, code) in [
        ("nope", 400, -32700),
        ("{}", 400, -32600),
        (
            r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x"}}]"#,
            400,
            -32600,
        ),
        (
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":1}}"#,
            400,
            -32602,
        ),
    ] {
        let mut call = Call::new(cfg());
        let s = send(&mut call, post(&[TOKEN], &[]), body);
        assert_eq!(s.flow, Flow::Pause);
        assert!(s.callout.is_none());
        let r = local_reply(&s);
        assert_eq!(r.status, status);
        assert_eq!(
            r.body_json().map(|v| v["error"]["code"].clone()),
            Some(json!(code))
        );
        assert_eq!(call.state_name(), "answered");
    }
}

#[test]
fn other_methods_and_ungoverned_tools_pass_without_callout() {
    let c = cfg_with(json!({"governed_tools": ["pay_invoice"]}));
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"}]"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search"}}"#,
    ] {
        let mut call = Call::new(Rc::clone(&c));
        // No permit needed for traffic that is not governed.
        let s = send(&mut call, post(&[], &[]), body);
        assert_eq!(s, Step::cont(), "{body}");
        assert_eq!(call.state_name(), "passing");
        assert_eq!(
            call.on_log(LogProps {
                attempts: Some(1),
                flags: Some(0)
            }),
            Step::cont()
        );
    }
}

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

fn per_call() -> Rc<Config> {
    cfg_with(json!({"completion_reports": "per_call"}))
}

#[test]
fn json_response_is_held_and_reported_before_release() {
    let mut call = dispatched(per_call());
    assert_eq!(call.on_response_headers(json_head()), Step::cont());
    assert_eq!(done(call.on_response_body(10, false)).flow, Flow::Pause);
    let len = read(call.on_response_body(RECEIPT.len(), true));
    let s = call.on_response_body_data(&RECEIPT.as_bytes()[..len], true);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(counts(&s), vec![Stat::Completed]);
    let c = s.callout.unwrap_or_else(|| panic!("no report"));
    assert_eq!(c.endpoint, Endpoint::Outcomes);
    let req: OutcomesRequest =
        serde_json::from_slice(&c.body).unwrap_or(OutcomesRequest { reports: vec![] });
    assert_eq!(
        req.reports,
        vec![grant().report(Outcome::Completed {
            receipt: RECEIPT.into()
        })]
    );
    assert_eq!(call.state_name(), "reporting");
    // Acknowledged: resume, nothing left for on_log.
    let s = call.on_ledger_reply(&LedgerReply {
        status: Some(200),
        body: br#"{"acks":["applied"]}"#.to_vec(),
    });
    assert_eq!(s.effects, vec![Effect::ResumeResponse]);
    assert_eq!(call.state_name(), "settled");
    assert_eq!(
        call.on_log(LogProps {
            attempts: Some(1),
            flags: Some(0)
        }),
        Step::cont()
    );
}

#[test]
fn failed_completion_report_is_queued_and_response_resumed() {
    let mut call = dispatched(per_call());
    call.on_response_headers(json_head());
    read(call.on_response_body(RECEIPT.len(), true));
    call.on_response_body_data(RECEIPT.as_bytes(), true);
    let s = call.on_ledger_reply(&LedgerReply::failed());
    assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Completed {
            receipt: RECEIPT.into()
        })]
    );
    assert_eq!(call.on_log(LogProps::default()), Step::cont());

    // Dispatch of the report itself failed: queue, let the chunk go.
    let mut call = dispatched(per_call());
    call.on_response_headers(json_head());
    read(call.on_response_body(RECEIPT.len(), true));
    call.on_response_body_data(RECEIPT.as_bytes(), true);
    let s = call.on_callout_failed();
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(enqueued(&s).len(), 1);
    assert!(!s.effects.contains(&Effect::ResumeResponse));
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
}

#[test]
fn client_gone_while_reporting_queues_completed() {
    let mut call = dispatched(cfg());
    call.on_response_headers(json_head());
    read(call.on_response_body(RECEIPT.len(), true));
    call.on_response_body_data(RECEIPT.as_bytes(), true);
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(outcome::DC),
    });
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Completed {
            receipt: RECEIPT.into()
        })]
    );
}

#[test]
fn sse_streams_through_and_holds_the_chunk_with_the_response() {
    let mut call = dispatched(per_call());
    call.on_response_headers(sse_head());
    let chunks: [&[u8]; 3] = [
        b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\ndata: {\"jsonrpc\":\"2.0\",",
        b"\"id\":7,\"result\":{\"content\":[]}}\n",
        b"\n",
    ];
    for (i, chunk) in chunks.iter().enumerate() {
        let len = read(call.on_response_body(chunk.len(), false));
        let s = call.on_response_body_data(&chunk[..len], false);
        if i < 2 {
            assert_eq!(s, Step::cont(), "chunk {i} passes");
        } else {
            assert_eq!(s.flow, Flow::Pause);
            let c = s.callout.unwrap_or_else(|| panic!("no report"));
            let req: OutcomesRequest =
                serde_json::from_slice(&c.body).unwrap_or(OutcomesRequest { reports: vec![] });
            assert_eq!(
                req.reports[0].outcome,
                Outcome::Completed {
                    receipt: r#"{"jsonrpc":"2.0","id":7,"result":{"content":[]}}"#.into()
                }
            );
        }
    }
    // More data while the report is out stays held; the end passes after the ack.
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Pause);
    let s = call.on_ledger_reply(&LedgerReply {
        status: Some(200),
        body: br#"{"acks":["already_recorded"]}"#.to_vec(),
    });
    assert_eq!(s.effects, vec![Effect::ResumeResponse]);
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Continue);
}

#[test]
fn batched_completion_is_handed_to_the_root_and_held() {
    let mut call = dispatched(cfg());
    assert!(call.watches_response_headers());
    assert!(call.needs_log_props());
    call.on_response_headers(json_head());
    assert!(!call.watches_response_headers());
    let len = read(call.on_response_body(RECEIPT.len(), true));
    let s = call.on_response_body_data(&RECEIPT.as_bytes()[..len], true);
    assert_eq!(s.flow, Flow::Pause);
    assert!(s.callout.is_none(), "no callout of its own");
    assert_eq!(
        s.effects,
        vec![
            Effect::Count(Stat::Completed),
            Effect::Complete(grant().report(Outcome::Completed {
                receipt: RECEIPT.into()
            }))
        ]
    );
    assert!(call.is_reporting());
    assert!(!call.needs_log_props());
    // Trailers or more data while the batch is out stay held.
    assert_eq!(done(call.on_response_trailers()).flow, Flow::Pause);
    // The root finished the batch (acked, or failed and queued by the root): nothing left.
    call.on_completion_settled();
    assert!(!call.is_reporting());
    assert_eq!(call.state_name(), "settled");
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Continue);
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
}

#[test]
fn the_root_is_asked_about_the_batch_only_while_the_report_is_in_it() {
    let asked = std::cell::Cell::new(0);
    let ask = |waiting: bool| {
        asked.set(asked.get() + 1);
        waiting
    };
    let mut call = dispatched(cfg());
    // Nothing handed to the root yet: nothing to ask.
    call.check_completion_batch(|| ask(false));
    assert_eq!((asked.get(), call.state_name()), (0, "dispatched"));
    json_answer(&mut call, RECEIPT);
    assert!(call.is_reporting());
    // Still waiting in the batch: the response stays held.
    call.check_completion_batch(|| ask(true));
    assert_eq!(asked.get(), 1);
    assert!(call.is_reporting());
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Pause);
    // The batch is done: settled, and the root is not asked again.
    call.check_completion_batch(|| ask(false));
    assert_eq!((asked.get(), call.state_name()), (2, "settled"));
    call.check_completion_batch(|| ask(false));
    assert_eq!(asked.get(), 2);
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Continue);
    // A call reporting per call is never in the root's batch.
    let mut per_call = dispatched(cfg_with(json!({"completion_reports": "per_call"})));
    json_answer(&mut per_call, RECEIPT);
    per_call.check_completion_batch(|| ask(false));
    assert_eq!(asked.get(), 2);
    assert!(per_call.is_reporting());
}

#[test]
fn batched_completion_client_gone_queues_from_on_log() {
    let mut call = dispatched(cfg());
    json_answer(&mut call, RECEIPT);
    assert!(call.is_reporting());
    // The client hung up before the batch was answered: on_log queues the report for the
    // after-the-fact queue (a repeat of the batch's report is acked `already_recorded`).
    let s = call.on_log(LogProps::default());
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Completed {
            receipt: RECEIPT.into()
        })]
    );
}

#[test]
fn batched_sse_answer_chunk_is_held_then_stream_passes() {
    let mut call = dispatched(cfg());
    call.on_response_headers(sse_head());
    let chunk = b"data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n";
    let len = read(call.on_response_body(chunk.len(), false));
    let s = call.on_response_body_data(&chunk[..len], false);
    assert_eq!(s.flow, Flow::Pause);
    assert!(matches!(reported(&s), Outcome::Completed { .. }));
    assert_eq!(done(call.on_response_body(5, false)).flow, Flow::Pause);
    call.on_completion_settled();
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Continue);
}

#[test]
fn log_props_and_response_headers_only_matter_for_dispatched_calls() {
    let mut call = Call::new(cfg());
    assert!(!call.needs_log_props() && !call.watches_response_headers());
    call.on_request_headers(RequestHead {
        method: "GET".into(),
        ..RequestHead::default()
    });
    assert_eq!(call.state_name(), "passing");
    assert!(!call.needs_log_props() && !call.watches_response_headers());
}

#[test]
fn oversized_receipts_become_uncertain() {
    let c = cfg_with(json!({"max_receipt_bytes": 16}));
    let mut call = dispatched(Rc::clone(&c));
    call.on_response_headers(json_head());
    let s = done(call.on_response_body(17, false));
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(counts(&s), vec![Stat::ReceiptTooLarge]);
    assert_eq!(done(call.on_response_body(100, true)).flow, Flow::Continue);
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0),
    });
    assert!(
        matches!(&enqueued(&s)[0].outcome, Outcome::Uncertain { reason } if reason.starts_with("receipt_too_large"))
    );

    let mut call = dispatched(c);
    call.on_response_headers(sse_head());
    let chunk = b"data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\n\n";
    let len = read(call.on_response_body(chunk.len(), false));
    let s = call.on_response_body_data(&chunk[..len], false);
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(counts(&s), vec![Stat::ReceiptTooLarge]);
}

#[test]
fn on_log_classifies_unreported_attempts() {
    let table: Vec<(Option<ResponseHead>, LogProps, &str)> = vec![
        // connection refused: Envoy's own 503 text/plain, UF
        (
            Some(ResponseHead {
                content_type: Some("text/plain".into()),
                end_of_stream: false,
                tool_refusal: None,
            }),
            LogProps {
                attempts: Some(1),
                flags: Some(outcome::UF),
            },
            "released",
        ),
        // never attempted
        (
            None,
            LogProps {
                attempts: Some(0),
                flags: Some(outcome::DC),
            },
            "released",
        ),
        // cut after the tool ran
        (
            Some(json_head()),
            LogProps {
                attempts: Some(1),
                flags: Some(outcome::UC),
            },
            "uncertain",
        ),
        // timeout
        (
            Some(ResponseHead {
                content_type: Some("text/plain".into()),
                end_of_stream: false,
                tool_refusal: None,
            }),
            LogProps {
                attempts: Some(1),
                flags: Some(outcome::UT),
            },
            "uncertain",
        ),
        // client hung up while upstream worked
        (
            None,
            LogProps {
                attempts: Some(1),
                flags: Some(outcome::DC),
            },
            "uncertain",
        ),
        // a 200 without a receipt
        (
            Some(ResponseHead {
                content_type: Some("text/html".into()),
                end_of_stream: false,
                tool_refusal: None,
            }),
            LogProps {
                attempts: Some(1),
                flags: Some(0),
            },
            "uncertain",
        ),
        // properties unavailable
        (None, LogProps::default(), "uncertain"),
    ];
    for (resp, props, want) in table {
        let mut call = dispatched(cfg());
        if let Some(h) = resp.clone() {
            call.on_response_headers(h);
        }
        let s = call.on_log(props);
        let q = enqueued(&s);
        assert_eq!(q.len(), 1);
        assert_eq!(q[0].attempt_id, "att_1");
        let got = match &q[0].outcome {
            Outcome::Completed { .. } => "completed",
            Outcome::Released { .. } => "released",
            Outcome::Uncertain { .. } => "uncertain",
            Outcome::InputRequired { .. } | Outcome::Accepted { .. } => "interim",
            Outcome::RefusedAtTool { .. } => "refused_at_tool",
        };
        assert_eq!(got, want, "{resp:?} {props:?}");
        let want_stat = if want == "released" {
            Stat::Released
        } else {
            Stat::Uncertain
        };
        assert_eq!(counts(&s), vec![want_stat]);
        // on_log happens once.
        assert_eq!(call.on_log(props), Step::cont());
    }
}

#[test]
fn json_without_matching_response_is_not_a_receipt() {
    let mut call = dispatched(cfg());
    call.on_response_headers(json_head());
    let body = br#"{"jsonrpc":"2.0","id":8,"result":{}}"#;
    read(call.on_response_body(body.len(), true));
    let s = call.on_response_body_data(body, true);
    assert_eq!(s, Step::cont());
    assert_eq!(call.state_name(), "no_receipt");
}

#[test]
fn request_trailers_while_reading_are_refused() {
    let mut call = Call::new(cfg());
    call.on_request_headers(post(&[TOKEN], &[]));
    let s = call.on_request_trailers();
    assert_eq!(local_reply(&s).status, 400);
}

#[test]
fn logs_never_carry_secrets() {
    const SECRET: &str = "5ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2";
    let token = format!("atmp_pmt_1_{SECRET}");
    let mut call = Call::new(cfg());
    let mut all = Vec::new();
    all.push(send(&mut call, post(&[&token], &["\"key-secret\""]), PAY));
    let answer = signed(&call, dispatch());
    all.push(call.on_ledger_reply(&ledger(&answer)));
    call.on_response_headers(json_head());
    read(call.on_response_body(RECEIPT.len(), true));
    all.push(call.on_response_body_data(RECEIPT.as_bytes(), true));
    all.push(call.on_ledger_reply(&LedgerReply::failed()));
    // A dispatch the filter does not send logs why, without the capability either.
    let mut unsigned = Call::new(cfg());
    send(&mut unsigned, post(&[&token], &["\"key-secret\""]), PAY);
    all.push(unsigned.on_ledger_reply(&ledger(&dispatch())));
    for s in &all {
        for e in &s.effects {
            if let Effect::Log(_, m) = e {
                for secret in [SECRET, "cap-1", "key-secret", "INV-1", "paid", "svc-token"] {
                    assert!(!m.contains(secret), "{m}");
                }
            }
        }
    }
}

fn reported(s: &Step) -> Outcome {
    if let Some(r) = s.effects.iter().find_map(|e| match e {
        Effect::Complete(r) => Some(r.clone()),
        _ => None,
    }) {
        assert!(s.callout.is_none(), "batched: no callout of its own");
        return r.outcome;
    }
    let c = s
        .callout
        .as_ref()
        .unwrap_or_else(|| panic!("no report in {s:?}"));
    assert_eq!(c.endpoint, Endpoint::Outcomes);
    let req: OutcomesRequest =
        serde_json::from_slice(&c.body).unwrap_or(OutcomesRequest { reports: vec![] });
    assert_eq!(req.reports.len(), 1);
    req.reports[0].outcome.clone()
}

fn json_answer(call: &mut Call, body: &str) -> Step {
    call.on_response_headers(json_head());
    let len = read(call.on_response_body(body.len(), true));
    call.on_response_body_data(&body.as_bytes()[..len], true)
}

#[test]
fn input_required_and_task_handles_are_reported_as_such() {
    let ask = r#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"input_required","inputRequests":{"q":{"method":"elicitation/create","params":{}}},"requestState":"s1"}}"#;
    let mut call = dispatched(cfg());
    let s = json_answer(&mut call, ask);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(counts(&s), vec![Stat::InputRequired]);
    assert_eq!(
        reported(&s),
        Outcome::InputRequired {
            receipt: ask.into()
        }
    );
    // Unacknowledged: on_log queues the same outcome (never `completed`).
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0x4000),
    });
    assert_eq!(
        enqueued(&s)[0].outcome,
        Outcome::InputRequired {
            receipt: ask.into()
        }
    );

    let task = r#"{"jsonrpc":"2.0","id":7,"result":{"task":{"taskId":"t-1","status":"working","createdAt":"2025-11-25T00:00:00Z","lastUpdatedAt":"2025-11-25T00:00:00Z","ttl":60000}}}"#;
    let mut call = dispatched(cfg());
    let s = json_answer(&mut call, task);
    assert_eq!(counts(&s), vec![Stat::Accepted]);
    assert_eq!(
        reported(&s),
        Outcome::Accepted {
            receipt: task.into()
        }
    );
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

const PRIMING: &[u8] = b"id: ev-1\nretry: 100\ndata: \n\n";

#[test]
fn resumable_stream_closed_early_stays_in_flight_and_the_resumed_get_brings_the_receipt() {
    let mut head = post(&[TOKEN], &["\"k1\""]);
    head.session_id = Some("sess-1".into());
    let mut call = Call::new(cfg());
    let s = send(&mut call, head, PAY);
    assert!(s.callout.is_some());
    call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    call.on_response_headers(sse_head());
    let progress = b"id: ev-2\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n";
    let mut chunk = PRIMING.to_vec();
    chunk.extend_from_slice(progress);
    let len = read(call.on_response_body(chunk.len(), false));
    assert_eq!(
        call.on_response_body_data(&chunk[..len], false),
        Step::cont()
    );
    // The server ends the stream cleanly: a ticket under the last event id, no report.
    read(call.on_response_body(0, true));
    let s = call.on_response_body_data(b"", true);
    let ticket = Ticket {
        grant: grant(),
        id: json!(7),
        tool: "pay_invoice".into(),
        permit_hash: resume::permit_hash(TOKEN.as_bytes()),
        path: "/mcp".into(),
        limits: None,
    };
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(
        s.effects,
        vec![Effect::SaveResume(
            resume::key(Some("sess-1"), "ev-2"),
            ticket.clone()
        )]
    );
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0),
    });
    assert!(enqueued(&s).is_empty(), "{s:?}");
    assert_eq!(counts(&s), vec![Stat::StreamAwaitingResume]);

    // The same stream cut with a reset flag is uncertain as before.
    let mut cut = dispatched(cfg());
    cut.on_response_headers(sse_head());
    read(cut.on_response_body(PRIMING.len(), true));
    cut.on_response_body_data(PRIMING, true);
    let s = cut.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0x40),
    });
    assert!(matches!(enqueued(&s)[0].outcome, Outcome::Uncertain { .. }));

    // The resumed GET: watched, and its answer is the receipt.
    let mut get = Call::new(cfg());
    let s = get.on_request_headers(RequestHead {
        method: "GET".into(),
        session_id: Some("sess-1".into()),
        resume: Some(ticket.clone()),
        end_of_stream: true,
        ..RequestHead::default()
    });
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(get.state_name(), "dispatched");
    get.on_response_headers(sse_head());
    let answer = b"id: ev-3\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n";
    let len = read(get.on_response_body(answer.len(), false));
    let s = get.on_response_body_data(&answer[..len], false);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(counts(&s), vec![Stat::Completed, Stat::ResumedReceipt]);
    assert!(matches!(reported(&s), Outcome::Completed { .. }));

    // A resumed GET that fails reports nothing: the call's fate is the lease's.
    let mut get = Call::new(cfg());
    get.on_request_headers(RequestHead {
        method: "GET".into(),
        resume: Some(ticket),
        end_of_stream: true,
        ..RequestHead::default()
    });
    let s = get.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0x4000),
    });
    assert!(enqueued(&s).is_empty());
    // A GET without a ticket just passes.
    let mut plain = Call::new(cfg());
    plain.on_request_headers(RequestHead {
        method: "GET".into(),
        end_of_stream: true,
        ..RequestHead::default()
    });
    assert_eq!(plain.state_name(), "passing");
}

#[test]
fn sse_stream_without_event_ids_ending_early_is_uncertain() {
    let mut call = dispatched(cfg());
    call.on_response_headers(sse_head());
    let chunk =
        b"data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n";
    read(call.on_response_body(chunk.len(), true));
    let s = call.on_response_body_data(chunk, true);
    assert_eq!(s, Step::cont());
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0),
    });
    assert!(matches!(enqueued(&s)[0].outcome, Outcome::Uncertain { .. }));
}

fn body_edit_of(s: &Step) -> Option<String> {
    s.effects.iter().find_map(|e| match e {
        Effect::ReplaceRequestBody { body, .. } => Some(String::from_utf8_lossy(body).into_owned()),
        _ => None,
    })
}

fn derived(c: &Config, permit_id: &str, key: &str) -> String {
    crate::call::upstream_key::upstream_value(&c.upstream_key, permit_id, Some(key))
        .unwrap_or_default()
}

const PARAMS_PAY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"idempotencyKey":"raw-p","name":"pay_invoice","arguments":{"invoice":"INV-1","amount":1250},"_meta":{"dev.atmost/idempotency-key":"raw-p"}}}"#;

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
fn a_refused_rewrite_of_a_dispatched_call_denies_it_and_releases_the_attempt() {
    let mut call = Call::new(cfg());
    send(&mut call, post(&[TOKEN], &["\"raw-p\""]), PARAMS_PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert!(body_edit_of(&s).is_some());
    // The host refused the body (or a header) write: the adapter calls this instead of
    // carrying out the rest of the step.
    let s = call.on_rewrite_failed();
    assert_eq!(s.flow, Flow::Pause);
    assert!(!s.effects.contains(&Effect::ResumeRequest));
    assert!(s.callout.is_none());
    let reply = local_reply(&s).body_json().unwrap_or_default();
    assert_eq!(reply["id"], 7);
    assert_eq!(
        reply["result"]["structuredContent"]["error"]["code"],
        "gateway_unavailable"
    );
    assert!(!reply.to_string().contains("raw-p"));
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Released {
            reason: "never_sent: request_rewrite_failed".into()
        })]
    );
    assert!(counts(&s).contains(&Stat::Released));
    assert_eq!(call.state_name(), "answered");
    // Nothing more happens for this request: no second report, no resume.
    assert_eq!(call.on_rewrite_failed(), Step::pause());
    assert_eq!(
        call.on_log(LogProps {
            attempts: Some(0),
            flags: Some(0)
        }),
        Step::cont()
    );
}

#[test]
fn a_refused_rewrite_of_traffic_that_is_not_governed_refuses_it() {
    let c = cfg_with(json!({"governed_tools": ["pay_invoice"]}));
    let search = PARAMS_PAY.replace("pay_invoice", "search");
    let mut call = Call::new(Rc::clone(&c));
    let s = send(&mut call, post(&[], &["\"raw-p\""]), &search);
    assert!(body_edit_of(&s).is_some());
    let s = call.on_rewrite_failed();
    assert_eq!(s.flow, Flow::Pause);
    assert!(enqueued(&s).is_empty());
    let reply = local_reply(&s).body_json().unwrap_or_default();
    assert_eq!(reply["id"], 7);
    assert_eq!(
        reply["result"]["structuredContent"]["error"]["code"],
        "gateway_unavailable"
    );
    assert_eq!(call.state_name(), "answered");
    // Not a tools/call: a JSON-RPC error with the request's id.
    let mut call = Call::new(Rc::clone(&c));
    send(
        &mut call,
        post(&[], &[]),
        r#"{"jsonrpc":"2.0","id":"l1","method":"tools/list","params":{"idempotencyKey":"raw-p"}}"#,
    );
    let r = local_reply(&call.on_rewrite_failed()).clone();
    assert_eq!(r.status, 503);
    let v = r.body_json().unwrap_or_default();
    assert_eq!(
        (v["id"].clone(), v["error"]["code"].clone()),
        (json!("l1"), json!(-32603))
    );
    // A bodiless request whose header could not be rewritten, or whose permit could not be
    // stripped.
    for head in [
        RequestHead {
            method: "DELETE".into(),
            idempotency_key: vec![b"raw-p".to_vec()],
            ..RequestHead::default()
        },
        RequestHead {
            method: "GET".into(),
            permit: vec![b"tok".to_vec()],
            ..RequestHead::default()
        },
    ] {
        let mut call = Call::new(Rc::clone(&c));
        assert_eq!(call.on_request_headers(head).flow, Flow::Continue);
        let s = call.on_rewrite_failed();
        assert_eq!((s.flow, local_reply(&s).status), (Flow::Pause, 503));
        assert_eq!(call.state_name(), "answered");
    }
}

#[test]
fn ungoverned_calls_forward_every_key_form_only_in_the_upstream_form() {
    let patch = |mode: Value| json!({"governed_tools": ["pay_invoice"], "upstream_key": mode});
    let hmac = cfg_with(patch(json!({"secret": "0123456789abcdef0123"})));
    let search = PARAMS_PAY.replace("pay_invoice", "search");
    let head = || RequestHead {
        content_length: Some(search.len() as u64),
        ..post(&[TOKEN], &["\"raw-p\""])
    };
    let mut call = Call::new(Rc::clone(&hmac));
    let s = send(&mut call, head(), &search);
    assert_eq!(s.flow, Flow::Continue);
    assert!(s.callout.is_none());
    // No ledger answer, no verified permit: the derivation uses the empty permit id.
    let want = derived(&hmac, "", "raw-p");
    assert_ne!(want, derived(&hmac, "pmt_1", "raw-p"));
    let body = search.replace("\"raw-p\"", &format!("\"{want}\""));
    assert_eq!(
        s.effects,
        vec![
            Effect::ReplaceRequestBody {
                original_len: search.len(),
                body: body.clone().into_bytes(),
            },
            Effect::SetRequestHeader("content-length".into(), body.len().to_string()),
            Effect::SetRequestHeader("idempotency-key".into(), want),
        ]
    );
    assert_eq!(call.state_name(), "passing");
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
    // off: removed everywhere.
    let mut call = Call::new(cfg_with(patch(json!({"mode": "off"}))));
    let s = send(&mut call, head(), &search);
    let body = body_edit_of(&s).unwrap_or_default();
    assert!(
        !body.contains("raw-p") && !body.contains("idempotencyKey"),
        "{body}"
    );
    assert!(s
        .effects
        .contains(&Effect::RemoveRequestHeader("idempotency-key".into())));
    // raw: the request goes as sent.
    let mut call = Call::new(cfg_with(patch(json!({"mode": "raw"}))));
    assert_eq!(send(&mut call, head(), &search), Step::cont());
}

#[test]
fn every_message_carrying_a_key_forwards_it_only_in_the_upstream_form() {
    let c = cfg();
    let want = |k: &str| derived(&c, "", k);
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"_meta":{"dev.atmost/idempotency-key":"raw-a"}}}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"idempotencyKey":"raw-a","progress":1}}"#,
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"idempotencyKey":"raw-a"}},{"jsonrpc":"2.0","method":"x","params":{"_meta":{"dev.atmost/idempotency-key":"raw-b"}}}]"#,
    ] {
        let mut call = Call::new(Rc::clone(&c));
        let s = send(&mut call, post(&[], &[]), body);
        assert_eq!(s.flow, Flow::Continue, "{body}");
        let sent = body
            .replace("\"raw-a\"", &format!("\"{}\"", want("raw-a")))
            .replace("\"raw-b\"", &format!("\"{}\"", want("raw-b")));
        assert_eq!(body_edit_of(&s), Some(sent), "{body}");
        assert_eq!(call.state_name(), "passing");
    }
    // A key field atmost would not accept is dropped, never forwarded raw.
    let mut call = Call::new(Rc::clone(&c));
    let s = send(
        &mut call,
        post(&[], &[]),
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"idempotencyKey":{"raw":"x"},"cursor":"c"}}"#,
    );
    assert_eq!(
        body_edit_of(&s).as_deref(),
        Some(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"cursor":"c"}}"#)
    );
    // Only the header: no body edit.
    let mut call = Call::new(Rc::clone(&c));
    let s = send(
        &mut call,
        post(&[], &["raw-h"]),
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
    );
    assert_eq!(
        s.effects,
        vec![Effect::SetRequestHeader(
            "idempotency-key".into(),
            want("raw-h")
        )]
    );
    // No key anywhere: passes with nothing to do.
    let mut call = Call::new(Rc::clone(&c));
    let s = send(
        &mut call,
        post(&[], &[]),
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"_meta":{"k":"raw"}}}"#,
    );
    assert_eq!(s, Step::cont());
}

#[test]
fn bodiless_requests_forward_the_key_header_only_in_the_upstream_form() {
    let c = cfg();
    let head = |method: &str, keys: &[&str]| RequestHead {
        method: method.into(),
        idempotency_key: keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
        ..RequestHead::default()
    };
    for method in ["GET", "DELETE"] {
        let s = Call::new(Rc::clone(&c)).on_request_headers(head(method, &["\"raw-g\""]));
        assert_eq!(s.flow, Flow::Continue);
        assert_eq!(
            s.effects,
            vec![Effect::SetRequestHeader(
                "idempotency-key".into(),
                derived(&c, "", "raw-g")
            )]
        );
    }
    // A header atmost cannot read as one key is removed rather than forwarded.
    for keys in [&["a", "b"][..], &["\"unterminated"][..]] {
        let s = Call::new(Rc::clone(&c)).on_request_headers(head("DELETE", keys));
        assert_eq!(
            s.effects,
            vec![Effect::RemoveRequestHeader("idempotency-key".into())]
        );
    }
    let raw = cfg_with(json!({"upstream_key": {"mode": "raw"}}));
    assert_eq!(
        Call::new(raw).on_request_headers(head("GET", &["\"raw-g\""])),
        Step::cont()
    );
}

fn figures() -> PermitLimits {
    PermitLimits::until("2030-01-01T00:00:00.000Z")
        .with_calls_left(Some(0))
        .with_budget_left(Some(48_750))
}

fn figures_json() -> Value {
    json!({"calls_left": 0, "budget_left": 48_750, "expires_at": "2030-01-01T00:00:00.000Z"})
}

/// A call dispatched by a ledger that gave the permit's figures.
fn dispatched_with_figures(c: Rc<Config>) -> Call {
    let mut call = Call::new(c);
    send(&mut call, post(&[TOKEN], &["\"k1\""]), PAY);
    let mut answer = dispatch();
    if let AuthorizeResponse::Dispatch { limits, .. } = &mut answer {
        *limits = Some(figures());
    }
    let s = call.on_ledger_reply(&ledger(&signed(&call, answer)));
    assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
    call
}

fn figure_headers() -> Vec<Effect> {
    vec![
        Effect::SetResponseHeader("atmost-calls-left".into(), "0".into()),
        Effect::SetResponseHeader("atmost-budget-left".into(), "48750".into()),
        Effect::SetResponseHeader(
            "atmost-permit-expires".into(),
            "2030-01-01T00:00:00.000Z".into(),
        ),
    ]
}

fn replaced_bodies(s: &Step) -> Vec<Vec<u8>> {
    s.effects
        .iter()
        .filter_map(|e| match e {
            Effect::ReplaceResponseBody { body, .. } => Some(body.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_dispatched_json_answer_carries_the_figures_and_the_receipt_stays_the_upstreams() {
    let mut call = dispatched_with_figures(cfg());
    let s = call.on_response_headers(json_head());
    let mut want = figure_headers();
    want.push(Effect::RemoveResponseHeader("content-length".into()));
    assert_eq!(s.effects, want);
    let len = read(call.on_response_body(RECEIPT.len(), true));
    let s = call.on_response_body_data(&RECEIPT.as_bytes()[..len], true);
    assert_eq!(s.flow, Flow::Pause);
    // The edit comes before the answer is released (it is held until the report is done).
    assert!(matches!(
        s.effects.first(),
        Some(Effect::ReplaceResponseBody { original_len, .. }) if *original_len == RECEIPT.len()
    ));
    let bodies = replaced_bodies(&s);
    let v: Value = serde_json::from_slice(&bodies[0]).unwrap_or(Value::Null);
    assert_eq!(v["result"]["_meta"]["dev.atmost/permit"], figures_json());
    assert_eq!(v["result"]["content"][0]["text"], "paid");
    assert_eq!(
        reported(&s),
        Outcome::Completed {
            receipt: RECEIPT.into()
        }
    );
}

#[test]
fn an_answer_that_is_neither_json_nor_sse_keeps_its_length_but_gets_the_headers() {
    let mut call = dispatched_with_figures(cfg());
    let s = call.on_response_headers(ResponseHead {
        content_type: Some("text/plain".into()),
        end_of_stream: false,
        tool_refusal: None,
    });
    assert_eq!(s.effects, figure_headers());
    assert_eq!(done(call.on_response_body(4, true)), Step::cont());
    // Without figures from the ledger nothing is set or edited.
    let mut call = dispatched(cfg());
    assert!(call.on_response_headers(json_head()).effects.is_empty());
    let s = json_answer_body(&mut call, RECEIPT);
    assert!(replaced_bodies(&s).is_empty());
}

fn json_answer_body(call: &mut Call, body: &str) -> Step {
    let len = read(call.on_response_body(body.len(), true));
    call.on_response_body_data(&body.as_bytes()[..len], true)
}

#[test]
fn an_sse_answer_split_over_chunks_is_held_whole_and_carries_the_figures() {
    let stream = "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n\
                  event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n";
    let bytes = stream.as_bytes();
    let answer_at = stream
        .find("event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\"")
        .unwrap_or(0);
    for cut in 1..bytes.len() {
        let mut call = dispatched_with_figures(cfg());
        call.on_response_headers(sse_head());
        let mut out: Vec<u8> = Vec::new();
        let mut answered = None;
        // What Envoy holds: a buffer the filter paused comes back with the next chunk.
        let mut buffer = Vec::new();
        for (i, chunk) in [&bytes[..cut], &bytes[cut..]].into_iter().enumerate() {
            buffer.extend_from_slice(chunk);
            let len = read(call.on_response_body(buffer.len(), false));
            let s = call.on_response_body_data(&buffer[..len], false);
            if let Some(body) = replaced_bodies(&s).pop() {
                buffer = body;
            }
            if s.flow == Flow::Continue {
                out.append(&mut buffer);
            } else if s != Step::pause() {
                // Held until the report is done, then released.
                out.append(&mut buffer);
                answered = Some((i, reported(&s)));
            }
        }
        let (i, outcome) = answered.unwrap_or_else(|| panic!("no answer, cut at {cut}"));
        assert_eq!(i, 1, "the answer is whole with its last byte, cut at {cut}");
        assert_eq!(
            outcome,
            Outcome::Completed {
                receipt: r#"{"jsonrpc":"2.0","id":7,"result":{"content":[]}}"#.into()
            }
        );
        let want = format!(
            "{}event: message\ndata: {{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{{\"_meta\":{{\"dev.atmost/permit\":{}}},\"content\":[]}}}}\n\n",
            &stream[..answer_at],
            figures_json()
        );
        assert_eq!(String::from_utf8_lossy(&out), want, "cut at {cut}");
    }
}

#[test]
fn a_resumable_stream_leaves_the_figures_to_the_resumed_get() {
    let mut call = dispatched_with_figures(cfg());
    call.on_response_headers(sse_head());
    let chunk = b"id: ev-1\ndata: \n\n";
    read(call.on_response_body(chunk.len(), false));
    call.on_response_body_data(chunk, false);
    read(call.on_response_body(0, true));
    let s = call.on_response_body_data(b"", true);
    let ticket = s.effects.iter().find_map(|e| match e {
        Effect::SaveResume(_, t) => Some(t.clone()),
        _ => None,
    });
    assert_eq!(ticket.and_then(|t| t.limits), Some(figures()));
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

const LIST: &str = r#"{"jsonrpc":"2.0","id":"l1","method":"tools/list","params":{}}"#;
const LISTED: &str = r#"{"jsonrpc":"2.0","id":"l1","result":{"tools":[{"name":"pay_invoice","inputSchema":{"type":"object"}},{"name":"search","inputSchema":{"type":"object"}},{"name":"echo","_meta":{"x":1},"inputSchema":{"type":"object"}}]}}"#;

fn listing_cfg() -> Rc<Config> {
    cfg_with(
        json!({"tools_list_limits": true, "governed_tools": ["pay_invoice", "echo", "refund"]}),
    )
}

/// A tools/list sent with `permit`; the step after its body.
fn list(c: Rc<Config>, permit: &[&str]) -> (Call, Step) {
    let mut call = Call::new(c);
    let s = send(&mut call, post(permit, &[]), LIST);
    (call, s)
}

fn limits_reply(tools: &[(&str, PermitLimits)]) -> LedgerReply {
    let answer = LimitsResponse {
        tools: tools
            .iter()
            .map(|(t, l)| (t.to_string(), l.clone()))
            .collect(),
    };
    LedgerReply {
        status: Some(200),
        body: serde_json::to_vec(&answer).unwrap_or_default(),
    }
}

#[test]
fn a_tools_list_answer_gains_each_governed_tools_figures() {
    let (mut call, s) = list(listing_cfg(), &["tok"]);
    assert_eq!(s, Step::cont(), "the request passes at once");
    assert!(call.watches_response_headers());
    let s = call.on_response_headers(json_head());
    assert_eq!(
        s.effects,
        vec![Effect::RemoveResponseHeader("content-length".into())]
    );
    assert_eq!(done(call.on_response_body(10, false)).flow, Flow::Pause);
    let len = read(call.on_response_body(LISTED.len(), true));
    let s = call.on_response_body_data(&LISTED.as_bytes()[..len], true);
    assert_eq!(s.flow, Flow::Pause);
    let c = s.callout.unwrap_or_else(|| panic!("no limits callout"));
    assert_eq!(c.endpoint, Endpoint::Limits);
    let asked: LimitsRequest = serde_json::from_slice(&c.body).unwrap_or(LimitsRequest {
        permit_token: String::new(),
        tools: vec![],
    });
    assert_eq!(
        asked,
        LimitsRequest {
            permit_token: "tok".into(),
            tools: vec!["pay_invoice".into(), "echo".into()]
        }
    );
    assert_eq!(call.state_name(), "listing_asking");
    assert_eq!(done(call.on_response_trailers()).flow, Flow::Pause);
    let mut open = figures();
    open.calls_left = None;
    let s = call.on_ledger_reply(&limits_reply(&[("pay_invoice", figures()), ("echo", open)]));
    assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
    assert_eq!(counts(&s), vec![Stat::ToolsListFigures]);
    let bodies = replaced_bodies(&s);
    let v: Value = serde_json::from_slice(&bodies[0]).unwrap_or(Value::Null);
    let tools = &v["result"]["tools"];
    assert_eq!(tools[0]["_meta"]["dev.atmost/permit"], figures_json());
    assert_eq!(tools[1].get("_meta"), None, "search is not governed");
    assert_eq!(tools[2]["_meta"]["x"], 1);
    assert_eq!(
        tools[2]["_meta"]["dev.atmost/permit"]["calls_left"],
        Value::Null
    );
    assert!(matches!(
        s.effects.first(),
        Some(Effect::ReplaceResponseBody { original_len, .. }) if *original_len == LISTED.len()
    ));
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
}

#[test]
fn a_tools_list_without_a_permit_or_the_option_passes_untouched() {
    for (c, permit) in [
        (listing_cfg(), &[][..]),
        (listing_cfg(), &["a", "b"][..]),
        (cfg(), &["tok"][..]),
    ] {
        let (mut call, s) = list(c, permit);
        assert_eq!(s, Step::cont());
        assert_eq!(call.state_name(), "passing");
        assert!(!call.watches_response_headers());
        assert_eq!(done(call.on_response_body(10, true)), Step::cont());
    }
}

#[test]
fn a_tools_list_answer_passes_unchanged_when_the_ledger_says_no_or_cannot_be_asked() {
    let answer_with = |reply: Option<LedgerReply>| {
        let (mut call, _) = list(listing_cfg(), &["tok"]);
        call.on_response_headers(json_head());
        let s = json_answer_body(&mut call, LISTED);
        assert!(s.callout.is_some());
        match reply {
            Some(r) => call.on_ledger_reply(&r),
            None => call.on_callout_failed(),
        }
    };
    let denied = LedgerReply {
        status: Some(403),
        body: br#"{"error":"permit_invalid"}"#.to_vec(),
    };
    for reply in [
        Some(denied),
        Some(LedgerReply::failed()),
        Some(LedgerReply {
            status: Some(200),
            body: b"{}".to_vec(),
        }),
    ] {
        let s = answer_with(reply);
        assert!(replaced_bodies(&s).is_empty());
        assert_eq!(counts(&s), vec![Stat::ToolsListUnchanged]);
        assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
    }
    // The callout could not even leave: still in the body callback, the answer goes on.
    let s = answer_with(None);
    assert_eq!(s.flow, Flow::Continue);
    assert!(!s.effects.contains(&Effect::ResumeResponse));
    assert_eq!(counts(&s), vec![Stat::ToolsListUnchanged]);
}

#[test]
fn a_tools_list_answer_without_governed_tools_or_json_asks_nothing() {
    for body in [
        r#"{"jsonrpc":"2.0","id":"l1","result":{"tools":[{"name":"search"}]}}"#,
        r#"{"jsonrpc":"2.0","id":"other","result":{"tools":[{"name":"echo"}]}}"#,
        r#"{"jsonrpc":"2.0","id":"l1","error":{"code":1,"message":"m"}}"#,
        "not json",
    ] {
        let (mut call, _) = list(listing_cfg(), &["tok"]);
        call.on_response_headers(json_head());
        let s = json_answer_body(&mut call, body);
        assert_eq!(s, Step::cont(), "{body}");
    }
}

#[test]
fn a_tools_list_answer_in_an_sse_event_gains_the_figures_in_place() {
    let (mut call, _) = list(listing_cfg(), &["tok"]);
    call.on_response_headers(sse_head());
    let stream = format!("event: message\ndata: {LISTED}\n\n");
    let (a, _) = stream.as_bytes().split_at(30);
    let len = read(call.on_response_body(a.len(), false));
    let s = call.on_response_body_data(&a[..len], false);
    assert_eq!(s, Step::pause(), "Envoy keeps the partial event");
    // Envoy offers what it kept followed by the rest.
    let whole = stream.as_bytes();
    let len = read(call.on_response_body(whole.len(), false));
    let s = call.on_response_body_data(&whole[..len], false);
    assert_eq!(s.flow, Flow::Pause);
    assert!(s.callout.is_some());
    assert!(
        replaced_bodies(&s).is_empty(),
        "the answer waits for the ledger"
    );
    assert_eq!(done(call.on_response_body(5, false)).flow, Flow::Pause);
    let s = call.on_ledger_reply(&limits_reply(&[("pay_invoice", figures())]));
    let body = replaced_bodies(&s).pop().unwrap_or_default();
    let text = String::from_utf8_lossy(&body);
    let data = text
        .strip_prefix("event: message\ndata: ")
        .and_then(|t| t.strip_suffix("\n\n"))
        .unwrap_or_else(|| panic!("not one event: {text}"));
    let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
    assert_eq!(
        v["result"]["tools"][0]["_meta"]["dev.atmost/permit"],
        figures_json()
    );
    assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
}

mod answer_release;
mod body_hold;
mod control_headers;
mod credential;
mod signed_dispatch;
mod sse_trailers;
mod tool_refusal;
mod upgrades;
