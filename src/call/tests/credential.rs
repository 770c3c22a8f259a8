//! The ledger's credential on a dispatched call: set on the call's route after the agent's
//! own value is removed, before the request resumes; nowhere else.

use super::*;
use atmost_protocol::credential::{SecretValue, UpstreamCredential};

const SECRET: &str = "Bearer sk-live-0123";

fn credential(route: &str) -> UpstreamCredential {
    UpstreamCredential {
        name: "pay".into(),
        version: 3,
        header: "authorization".into(),
        value: SecretValue::new(SECRET.into()),
        route: route.into(),
    }
}

/// The ledger's Dispatch answer with `credential`.
fn dispatch_with(credential: UpstreamCredential) -> AuthorizeResponse {
    let mut answer = dispatch();
    if let AuthorizeResponse::Dispatch { credential: c, .. } = &mut answer {
        *c = Some(credential);
    }
    answer
}

/// A governed call on `route`, the agent sending its own `authorization`.
fn on_route(route: Option<&str>) -> RequestHead {
    RequestHead {
        route: route.map(str::to_string),
        ..post(&[TOKEN], &["\"k1\""])
    }
}

fn secret_edits(step: &Step) -> Vec<&Effect> {
    step.effects
        .iter()
        .filter(|e| {
            matches!(e, Effect::SetRequestSecret(..))
                || matches!(e, Effect::RemoveRequestHeader(h) if h == "authorization")
        })
        .collect()
}

#[test]
fn a_dispatch_on_the_credentials_route_replaces_the_agents_value_before_resuming() {
    let mut call = Call::new(cfg());
    send(&mut call, on_route(Some("pay_route")), PAY);
    let s = call.on_ledger_reply(&ledger(&signed(
        &call,
        dispatch_with(credential("pay_route")),
    )));
    assert_eq!(
        secret_edits(&s),
        vec![
            &Effect::RemoveRequestHeader("authorization".into()),
            &Effect::SetRequestSecret("authorization".into(), SecretValue::new(SECRET.into())),
        ]
    );
    let set = s
        .effects
        .iter()
        .position(|e| matches!(e, Effect::SetRequestSecret(..)));
    let resume = s.effects.iter().position(|e| *e == Effect::ResumeRequest);
    assert!(
        matches!((set, resume), (Some(a), Some(b)) if a < b),
        "{s:?}"
    );
    // Nothing the machine logs or counts holds the value.
    let shown = format!("{s:?}");
    assert!(!shown.contains("sk-live"), "{shown}");
}

#[test]
fn a_dispatch_on_another_route_or_without_a_credential_sets_none() {
    for (route, answer) in [
        (Some("other_route"), dispatch_with(credential("pay_route"))),
        (None, dispatch_with(credential("pay_route"))),
        (Some("pay_route"), dispatch()),
    ] {
        let mut call = Call::new(cfg());
        send(&mut call, on_route(route), PAY);
        let s = call.on_ledger_reply(&ledger(&signed(&call, answer)));
        assert!(secret_edits(&s).is_empty(), "{route:?}: {s:?}");
        assert!(s.effects.contains(&Effect::ResumeRequest));
    }
}

#[test]
fn a_replay_or_a_denial_carries_nothing() {
    for answer in [
        AuthorizeResponse::Replay {
            attempt_id: "att_0".into(),
            receipt: r#"{"jsonrpc":"2.0","id":1,"result":{}}"#.into(),
            limits: None,
        },
        AuthorizeResponse::Deny(Denial::new(DenialCode::PermitInvalid, "no")),
    ] {
        let mut call = Call::new(cfg());
        send(&mut call, on_route(Some("pay_route")), PAY);
        let s = call.on_ledger_reply(&ledger(&answer));
        assert!(secret_edits(&s).is_empty(), "{s:?}");
        assert!(!s.effects.contains(&Effect::ResumeRequest));
    }
}

#[test]
fn a_credential_that_cannot_be_set_sends_nothing_and_releases_the_round() {
    let mut bad = credential("pay_route");
    bad.header = "content-length".into();
    let mut call = Call::new(cfg());
    send(&mut call, on_route(Some("pay_route")), PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch_with(bad))));
    assert!(!s.effects.contains(&Effect::ResumeRequest));
    assert!(secret_edits(&s).is_empty());
    assert!(String::from_utf8_lossy(&local_reply(&s).body).contains("gateway_unavailable"));
    let reports = enqueued(&s);
    assert!(matches!(&reports[..], [r] if matches!(&r.outcome,
        Outcome::Released { reason } if reason == "never_sent: credential_malformed")));
}

/// `request_hold: body`: the headers left before the decision, so a credential for the
/// call's route cannot go on it: the call is not sent, its round released.
#[test]
fn with_the_headers_gone_a_credential_for_the_route_sends_nothing() {
    let c = cfg_with(json!({"request_hold": "body"}));
    let mut call = Call::new(Rc::clone(&c));
    let head = RequestHead {
        content_length: Some(PAY.len() as u64),
        mirrored: mcp::Mirrored {
            method: Some("tools/call".into()),
            name: Some("pay_invoice".into()),
            ..mcp::Mirrored::default()
        },
        ..on_route(Some("pay_route"))
    };
    call.on_request_headers(head);
    let len = read(call.on_request_body(PAY.len(), true));
    call.on_request_body_data(&PAY.as_bytes()[..len]);
    let s = call.on_ledger_reply(&ledger(&dispatch_with(credential("pay_route"))));
    assert!(!s.effects.contains(&Effect::ResumeRequest), "{s:?}");
    let reports = enqueued(&s);
    assert!(matches!(&reports[..], [r] if matches!(&r.outcome,
        Outcome::Released { reason } if reason == "never_sent: credential_after_headers")));
}
