//! Before anything of a request can leave: aliases of the headers atmost reads are refused,
//! Envoy's steering headers removed, and a POST gets no Envoy retry.

use super::*;

fn aliased(method: &str, alias: &str) -> RequestHead {
    RequestHead {
        alias: Some(alias.into()),
        ..RequestHead {
            method: method.into(),
            ..post(&["tok"], &["\"k1\""])
        }
    }
}

#[test]
fn an_alias_is_refused_before_any_edit_decision_or_callout() {
    for hold in ["headers", "body"] {
        let c = cfg_with(json!({ "request_hold": hold }));
        for method in ["POST", "GET", "DELETE"] {
            for alias in ["idempotency_key", "atmost_permit", "mcp_name"] {
                let mut call = Call::new(Rc::clone(&c));
                let s = call.on_request_headers(aliased(method, alias));
                assert_eq!(s.flow, Flow::Pause, "{hold} {method} {alias}");
                assert!(s.callout.is_none());
                // The reply is all: no header edit lets anything of it on.
                assert!(
                    s.effects
                        .iter()
                        .all(|e| matches!(e, Effect::LocalReply(_) | Effect::Count(_))),
                    "{s:?}"
                );
                let r = local_reply(&s);
                assert_eq!(r.status, 400);
                let v = r.body_json().unwrap_or_default();
                assert_eq!(v["id"], Value::Null);
                assert_eq!(v["error"]["code"], json!(-32600));
                let message = v["error"]["message"].as_str().unwrap_or_default();
                assert!(message.contains(&format!("`{alias}`")), "{message}");
                assert_eq!(counts(&s), vec![Stat::BadRequest]);
                assert_eq!(call.state_name(), "answered");
                // Nothing more happens for it.
                assert_eq!(done(call.on_request_body(PAY.len(), true)), Step::pause());
                assert_eq!(call.on_log(LogProps::default()), Step::cont());
            }
        }
    }
}

#[test]
fn control_headers_are_removed_and_counted_from_every_request() {
    let control = vec![
        "x-envoy-retry-on",
        "x-envoy-max-retries",
        "x-envoy-upstream-rq-timeout-ms",
    ];
    let removed = || {
        control
            .iter()
            .map(|h| Effect::RemoveRequestHeader((*h).into()))
            .collect::<Vec<_>>()
    };
    let counted = || vec![Effect::Count(Stat::ControlHeaderRemoved); 3];
    // A POST, held whole: removed, retries off, then the body is read as ever.
    let mut call = Call::new(cfg());
    let s = call.on_request_headers(RequestHead {
        control_headers: control.clone(),
        ..post(&["tok"], &["\"k1\""])
    });
    let mut want = vec![Effect::RemoveRequestHeader("atmost-permit".into())];
    want.extend(removed());
    want.push(no_retries());
    want.extend(counted());
    assert_eq!((s.flow, &s.effects), (Flow::Pause, &want));
    assert_eq!(call.state_name(), "reading_body");
    // With `request_hold: body` the same edits lead the headers that leave at once.
    let mut call = Call::new(cfg_with(json!({"request_hold": "body"})));
    let s = call.on_request_headers(RequestHead {
        control_headers: control.clone(),
        ..post(&["tok"], &[])
    });
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(s.effects, want);
    // A GET or DELETE: removed; their retries are the route's to decide.
    for method in ["GET", "DELETE"] {
        let s = Call::new(cfg()).on_request_headers(RequestHead {
            method: method.into(),
            control_headers: control.clone(),
            ..RequestHead::default()
        });
        let mut want = removed();
        want.extend(counted());
        assert_eq!((s.flow, s.effects), (Flow::Continue, want), "{method}");
    }
}

#[test]
fn every_post_goes_without_envoy_retries() {
    let mut bodiless = post(&[], &[]);
    bodiless.end_of_stream = true;
    let s = Call::new(cfg()).on_request_headers(bodiless);
    assert_eq!((s.flow, s.effects), (Flow::Continue, vec![no_retries()]));
    // Ungoverned traffic too: it shares the route.
    let c = cfg_with(json!({"governed_tools": ["pay_invoice"]}));
    let mut call = Call::new(c);
    let s = send(
        &mut call,
        post(&[], &[]),
        &PAY.replace("pay_invoice", "search"),
    );
    assert_eq!(s, Step::cont());
    // A host that refuses the setting: the request is refused, nothing of it sent.
    let mut call = Call::new(cfg());
    let s = call.on_request_headers(post(&[], &[]));
    assert_eq!(s.effects, vec![no_retries()]);
    let s = call.on_rewrite_failed();
    assert_eq!((s.flow, local_reply(&s).status), (Flow::Pause, 503));
}
