//! Event → action table for the per-request state machine: what every phase's tests share
//! (each phase's own sit beside it, in `phase/<phase>/tests.rs`), and what crosses them.

pub(super) use super::phase::Phase;
pub(super) use super::*;
pub(super) use crate::ledger_client::Endpoint;
pub(super) use crate::parse::mcp;
pub(super) use crate::stats::Stat;
pub(super) use crate::test_config::{config_from, minimal};
pub(super) use atmost_config::UpstreamKey;
pub(super) use atmost_protocol::signature::{
    self, DispatchNonce, DispatchSignature, DispatchTarget,
};
pub(super) use atmost_protocol::OutcomeReport;
pub(super) use atmost_protocol::{
    AuthorizeRequest, AuthorizeResponse, DispatchGrant, LimitsRequest, LimitsResponse, Outcome,
    OutcomesRequest, PermitLimits,
};
pub(super) use atmost_protocol::{Denial, DenialCode};
pub(super) use reply::LocalReply;
pub(super) use resume::Ticket;
pub(super) use serde_json::json;
pub(super) use serde_json::Value;

pub(super) fn cfg() -> Rc<Config> {
    Rc::new(config_from(&minimal()))
}

pub(super) fn cfg_with(patch: Value) -> Rc<Config> {
    let mut c = minimal();
    if let (Some(obj), Value::Object(p)) = (c.as_object_mut(), patch) {
        for (k, v) in p {
            obj.insert(k, v);
        }
    }
    Rc::new(config_from(&c))
}

pub(super) fn post(permit: &[&str], key: &[&str]) -> RequestHead {
    RequestHead {
        method: "POST".into(),
        permit: permit.iter().map(|p| p.as_bytes().to_vec()).collect(),
        idempotency_key: key.iter().map(|k| k.as_bytes().to_vec()).collect(),
        path: "/mcp".into(),
        ..RequestHead::default()
    }
}

pub(super) const PAY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"invoice":"INV-1","amount":1250}}}"#;

pub(super) fn read(step: BodyStep) -> usize {
    match step {
        BodyStep::Read { len } => len,
        BodyStep::Done(s) => panic!("expected a read, got {s:?}"),
    }
}

pub(super) fn done(step: BodyStep) -> Step {
    match step {
        BodyStep::Done(s) => s,
        BodyStep::Read { len } => panic!("expected done, got read {len}"),
    }
}

/// What every POST's headers get: no Envoy retry, whatever the route says.
pub(super) fn no_retries() -> Effect {
    Effect::SetRequestHeader("x-envoy-max-retries".into(), "0".into())
}

/// Drives headers + whole body; returns the step after the body.
pub(super) fn send(call: &mut Call, head: RequestHead, body: &str) -> Step {
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

pub(super) fn local_reply(step: &Step) -> &LocalReply {
    step.effects
        .iter()
        .find_map(|e| match e {
            Effect::LocalReply(r) => Some(r),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no local reply in {step:?}"))
}

pub(super) fn counts(step: &Step) -> Vec<Stat> {
    step.effects
        .iter()
        .filter_map(|e| match e {
            Effect::Count(s) => Some(*s),
            _ => None,
        })
        .collect()
}

/// What `pick` takes out of a step's effects, in order.
pub(super) fn picked<T>(step: &Step, pick: impl Fn(&Effect) -> Option<T>) -> Vec<T> {
    step.effects.iter().filter_map(pick).collect()
}

pub(super) fn enqueued(step: &Step) -> Vec<OutcomeReport> {
    picked(step, |e| match e {
        Effect::Enqueue(r) => Some(r.clone()),
        _ => None,
    })
}

pub(super) fn authorize_body(step: &Step) -> AuthorizeRequest {
    let c = step
        .callout
        .as_ref()
        .unwrap_or_else(|| panic!("no callout in {step:?}"));
    assert_eq!(c.endpoint, Endpoint::Authorize);
    serde_json::from_slice(&c.body).unwrap_or_else(|e| panic!("{e}"))
}

pub(super) fn ledger(resp: &AuthorizeResponse) -> LedgerReply {
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
pub(super) fn dispatch() -> AuthorizeResponse {
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
    match &call.phase {
        Phase::Authorizing(p) => p
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
    let tool = match &call.phase {
        Phase::Authorizing(p) => p.tool.clone(),
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
pub(super) fn signature_headers(step: &Step) -> Vec<String> {
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
pub(super) fn grant() -> DispatchGrant {
    DispatchGrant {
        attempt_id: "att_1".into(),
        round: 1,
        capability: "cap-1".into(),
    }
}

/// A call dispatched upstream with a key.
pub(super) fn dispatched(c: Rc<Config>) -> Call {
    let mut call = Call::new(c);
    let s = send(&mut call, post(&[TOKEN], &["\"k1\""]), PAY);
    assert!(s.callout.is_some());
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
    assert_eq!(call.state_name(), "dispatched");
    call
}

pub(super) fn json_head() -> ResponseHead {
    ResponseHead {
        content_type: Some("application/json; charset=utf-8".into()),
        end_of_stream: false,
        tool_refusal: None,
    }
}

pub(super) fn sse_head() -> ResponseHead {
    ResponseHead {
        content_type: Some("text/event-stream".into()),
        end_of_stream: false,
        tool_refusal: None,
    }
}

pub(super) const RECEIPT: &str =
    r#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"paid"}]}}"#;

pub(super) fn per_call() -> Rc<Config> {
    cfg_with(json!({"completion_reports": "per_call"}))
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

pub(super) fn reported(s: &Step) -> Outcome {
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

pub(super) fn json_answer(call: &mut Call, body: &str) -> Step {
    call.on_response_headers(json_head());
    let len = read(call.on_response_body(body.len(), true));
    call.on_response_body_data(&body.as_bytes()[..len], true)
}

pub(super) fn body_edit_of(s: &Step) -> Option<String> {
    s.effects.iter().find_map(|e| match e {
        Effect::ReplaceRequestBody { body, .. } => Some(String::from_utf8_lossy(body).into_owned()),
        _ => None,
    })
}

pub(super) fn derived(c: &Config, permit_id: &str, key: &str) -> String {
    crate::call::upstream_key::upstream_value(&c.upstream_key, permit_id, Some(key))
        .unwrap_or_default()
}

pub(super) const PARAMS_PAY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"idempotencyKey":"raw-p","name":"pay_invoice","arguments":{"invoice":"INV-1","amount":1250},"_meta":{"dev.atmost/idempotency-key":"raw-p"}}}"#;

pub(super) fn figures() -> PermitLimits {
    PermitLimits::until("2030-01-01T00:00:00.000Z")
        .with_calls_left(Some(0))
        .with_budget_left(Some(48_750))
}

pub(super) fn figures_json() -> Value {
    json!({"calls_left": 0, "budget_left": 48_750, "expires_at": "2030-01-01T00:00:00.000Z"})
}

/// A call dispatched by a ledger that gave the permit's figures.
pub(super) fn dispatched_with_figures(c: Rc<Config>) -> Call {
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

pub(super) fn replaced_bodies(s: &Step) -> Vec<Vec<u8>> {
    s.effects
        .iter()
        .filter_map(|e| match e {
            Effect::ReplaceResponseBody { body, .. } => Some(body.clone()),
            _ => None,
        })
        .collect()
}

pub(super) fn json_answer_body(call: &mut Call, body: &str) -> Step {
    let len = read(call.on_response_body(body.len(), true));
    call.on_response_body_data(&body.as_bytes()[..len], true)
}

pub(super) const LIST: &str = r#"{"jsonrpc":"2.0","id":"l1","method":"tools/list","params":{}}"#;

pub(super) const LISTED: &str = r#"{"jsonrpc":"2.0","id":"l1","result":{"tools":[{"name":"pay_invoice","inputSchema":{"type":"object"}},{"name":"search","inputSchema":{"type":"object"}},{"name":"echo","_meta":{"x":1},"inputSchema":{"type":"object"}}]}}"#;

pub(super) fn listing_cfg() -> Rc<Config> {
    cfg_with(
        json!({"tools_list_limits": true, "governed_tools": ["pay_invoice", "echo", "refund"]}),
    )
}

/// A tools/list sent with `permit`; the step after its body.
pub(super) fn list(c: Rc<Config>, permit: &[&str]) -> (Call, Step) {
    let mut call = Call::new(c);
    let s = send(&mut call, post(permit, &[]), LIST);
    (call, s)
}

pub(super) fn limits_reply(tools: &[(&str, PermitLimits)]) -> LedgerReply {
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

mod answer_release;

mod body_hold;

mod control_headers;

mod credential;

mod signed_dispatch;

mod sse_trailers;

mod tool_refusal;

mod upgrades;
