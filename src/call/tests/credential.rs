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
        routes: vec![route.into()],
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

mod session {
    use super::*;
    use crate::call::credential::CredentialCache;
    use crate::ledger_client::Endpoint;
    use atmost_protocol::credential::CredentialResponse;
    use std::cell::RefCell;

    const INITIALIZE: &str = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#;

    fn session_call(cache: &Rc<RefCell<CredentialCache>>, now_ms: u64) -> Call {
        Call::new(cfg()).with_session_credentials(Rc::clone(cache), now_ms)
    }

    fn get(route: Option<&str>) -> RequestHead {
        RequestHead {
            method: "GET".into(),
            ..on_route(route)
        }
    }

    fn answer(credential: Option<UpstreamCredential>) -> LedgerReply {
        LedgerReply {
            status: Some(200),
            body: serde_json::to_vec(&CredentialResponse { credential }).unwrap_or_default(),
        }
    }

    fn asks_credential(step: &Step) -> bool {
        matches!(&step.callout, Some(c) if c.endpoint == Endpoint::Credential)
    }

    #[test]
    fn a_stream_under_a_permit_is_held_for_the_credential_then_served_from_the_cache() {
        let cache = Rc::new(RefCell::new(CredentialCache::new(10_000)));
        let mut call = session_call(&cache, 1_000);
        let s = call.on_request_headers(get(Some("pay_route")));
        assert_eq!(s.flow, Flow::Pause);
        assert!(asks_credential(&s), "{s:?}");
        assert!(secret_edits(&s).is_empty());
        let body = s.callout.map(|c| c.body).unwrap_or_default();
        assert_eq!(
            serde_json::from_slice::<Value>(&body).ok(),
            Some(json!({"permit_token": TOKEN}))
        );
        let s = call.on_ledger_reply(&answer(Some(credential("pay_route"))));
        assert_eq!(secret_edits(&s).len(), 2, "{s:?}");
        assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
        assert!(!format!("{s:?}").contains("sk-live"));

        // The next request of the session within the lifetime: from the cache, at once.
        let mut call = session_call(&cache, 10_999);
        let s = call.on_request_headers(get(Some("pay_route")));
        assert_eq!(s.flow, Flow::Continue);
        assert!(s.callout.is_none());
        assert_eq!(secret_edits(&s).len(), 2, "{s:?}");
        // On another route: nothing set, nothing asked.
        let mut call = session_call(&cache, 10_999);
        let s = call.on_request_headers(get(Some("other_route")));
        assert_eq!((s.flow, s.callout.is_none()), (Flow::Continue, true));
        assert!(secret_edits(&s).is_empty());
        // Past the lifetime it is asked again.
        let mut call = session_call(&cache, 11_000);
        assert!(asks_credential(
            &call.on_request_headers(get(Some("pay_route")))
        ));
    }

    #[test]
    fn an_initialize_gets_it_after_its_body_and_a_refused_permit_is_kept_as_none() {
        let cache = Rc::new(RefCell::new(CredentialCache::new(10_000)));
        let mut call = session_call(&cache, 0);
        let s = send(&mut call, on_route(Some("pay_route")), INITIALIZE);
        assert_eq!(s.flow, Flow::Pause);
        assert!(asks_credential(&s), "{s:?}");
        let s = call.on_ledger_reply(&LedgerReply {
            status: Some(403),
            body: br#"{"error":"permit_invalid"}"#.to_vec(),
        });
        assert_eq!(s.effects, vec![Effect::ResumeRequest]);
        let mut call = session_call(&cache, 5);
        let s = send(&mut call, on_route(Some("pay_route")), INITIALIZE);
        assert_eq!(
            (s.flow, s.callout.is_none()),
            (Flow::Continue, true),
            "{s:?}"
        );
        assert!(secret_edits(&s).is_empty());
    }

    #[test]
    fn a_ledger_that_cannot_answer_lets_the_request_go_on_without_it_and_keeps_nothing() {
        let cache = Rc::new(RefCell::new(CredentialCache::new(10_000)));
        let mut call = session_call(&cache, 0);
        call.on_request_headers(get(Some("pay_route")));
        let s = call.on_ledger_reply(&LedgerReply::failed());
        assert!(secret_edits(&s).is_empty());
        assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
        let mut call = session_call(&cache, 1);
        call.on_request_headers(get(Some("pay_route")));
        let s = call.on_callout_failed();
        assert_eq!(s.flow, Flow::Continue);
        assert!(secret_edits(&s).is_empty());
        let mut call = session_call(&cache, 2);
        assert!(asks_credential(
            &call.on_request_headers(get(Some("pay_route")))
        ));
    }

    #[test]
    fn a_tools_call_never_gets_it_this_way() {
        let cache = Rc::new(RefCell::new(CredentialCache::new(10_000)));
        cache
            .borrow_mut()
            .put(TOKEN, 0, Some(credential("pay_route")));
        // Governed: the authorize callout, as without a session.
        let mut call = session_call(&cache, 1);
        let s = send(&mut call, on_route(Some("pay_route")), PAY);
        assert!(matches!(&s.callout, Some(c) if c.endpoint == Endpoint::Authorize));
        assert!(secret_edits(&s).is_empty());
        // Ungoverned: it passes, without the credential.
        let c = cfg_with(json!({"governed_tools": ["other_tool"]}));
        let mut call = Call::new(c).with_session_credentials(Rc::clone(&cache), 1);
        let s = send(&mut call, on_route(Some("pay_route")), PAY);
        assert_eq!(
            (s.flow, s.callout.is_none()),
            (Flow::Continue, true),
            "{s:?}"
        );
        assert!(secret_edits(&s).is_empty());
        // And a call without a session passes a stream as before.
        let mut call = Call::new(cfg());
        let s = call.on_request_headers(get(Some("pay_route")));
        assert_eq!((s.flow, s.callout.is_none()), (Flow::Continue, true));
        assert!(secret_edits(&s).is_empty());
    }
}
