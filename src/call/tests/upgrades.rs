//! Requests that ask to switch protocols: refused at their headers, before any edit,
//! decision or callout, in both `request_hold` forms and whatever the method; on a route
//! `upgrade_routes` names, passed as traffic that needs no decision, its upgraded bytes never
//! read as a body.

use super::*;
use crate::call::upgrade::Upgrade;

fn upgrading(method: &str, upgrade: Upgrade, route: Option<&str>) -> RequestHead {
    RequestHead {
        upgrade: Some(upgrade),
        route: route.map(str::to_string),
        ..RequestHead {
            method: method.into(),
            ..post(&["tok"], &["\"k1\""])
        }
    }
}

#[test]
fn an_upgrade_is_refused_before_anything_of_it_leaves() {
    for hold in ["headers", "body"] {
        let c = cfg_with(json!({ "request_hold": hold, "upgrade_routes": ["chat-ws"] }));
        for (method, upgrade) in [
            ("GET", Upgrade::Header),
            ("POST", Upgrade::Header),
            ("CONNECT", Upgrade::Connect),
            ("GET", Upgrade::Protocol),
        ] {
            for route in [Some("mcp"), None] {
                let mut call = Call::new(Rc::clone(&c));
                // An upgrade request may announce no body: its headers are all there is.
                let s = call.on_request_headers(upgrading(method, upgrade, route));
                let what = format!("{hold} {method} {upgrade:?} {route:?}");
                assert_eq!(s.flow, Flow::Pause, "{what}");
                assert!(s.callout.is_none(), "{what}");
                // The reply is all: not even the permit header's removal lets it on.
                assert!(
                    s.effects.iter().all(|e| matches!(
                        e,
                        Effect::LocalReply(_) | Effect::Count(_) | Effect::Log(..)
                    )),
                    "{what}: {s:?}"
                );
                let r = local_reply(&s);
                assert_eq!(r.status, 400, "{what}");
                let v = r.body_json().unwrap_or_default();
                assert_eq!(v["error"]["code"], json!(-32600), "{what}");
                assert_eq!(counts(&s), vec![Stat::UpgradeRefused], "{what}");
                assert_eq!(call.state_name(), "answered");
                // Nothing more happens for it: what would follow is held, never read.
                assert_eq!(done(call.on_request_body(PAY.len(), false)), Step::pause());
                assert_eq!(call.on_request_trailers(), Step::pause());
                assert_eq!(call.on_log(LogProps::default()), Step::cont());
            }
        }
    }
}

#[test]
fn an_upgrade_on_a_listed_route_passes_and_its_bytes_are_never_read() {
    for hold in ["headers", "body"] {
        let c = cfg_with(json!({ "request_hold": hold, "upgrade_routes": ["chat-ws"] }));
        for method in ["GET", "POST", "CONNECT"] {
            let mut call = Call::new(Rc::clone(&c));
            let s = call.on_request_headers(upgrading(method, Upgrade::Header, Some("chat-ws")));
            assert_eq!(s.flow, Flow::Continue, "{hold} {method}");
            // As traffic that passes: the permit header removed, the key in its upstream form.
            assert!(s
                .effects
                .contains(&Effect::RemoveRequestHeader("atmost-permit".into())));
            assert!(s.effects.iter().any(
                |e| matches!(e, Effect::SetRequestHeader(name, _) if name == IDEMPOTENCY_HEADER)
            ));
            assert_eq!(call.state_name(), "passing");
            // The upgraded connection's bytes go on as they come: no read, no hold.
            assert_eq!(done(call.on_request_body(PAY.len(), false)), Step::cont());
            assert_eq!(done(call.on_request_body(PAY.len(), true)), Step::cont());
        }
    }
}

#[test]
fn a_request_that_does_not_ask_to_upgrade_is_not_decided_by_its_route() {
    // The same GET without `upgrade`: it passes as before, whatever its route is.
    let mut call = Call::new(cfg());
    let s = call.on_request_headers(RequestHead {
        method: "GET".into(),
        route: Some("mcp".into()),
        ..RequestHead::default()
    });
    assert_eq!((s.flow, call.state_name()), (Flow::Continue, "passing"));
    // And a governed POST is read and decided as ever.
    let mut call = Call::new(cfg());
    let s = call.on_request_headers(post(&["tok"], &["\"k1\""]));
    assert_eq!((s.flow, call.state_name()), (Flow::Pause, "reading_body"));
}
