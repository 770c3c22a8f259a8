//! Requests that ask to switch protocols: an `Upgrade` header (WebSocket over HTTP/1.1, and
//! over HTTP/2, which Envoy hands to filters in that form), `CONNECT`, or an extended
//! CONNECT's `:protocol`.
//!
//! Once Envoy has upgraded a request, the connection carries bytes the filter never reads as
//! MCP requests: they reach the filter as the body of a request that already went on, and a
//! JSON-RPC `tools/call` sent over them runs at the tool without a ledger decision. Istio
//! allows WebSocket upgrades on every connection manager it renders, so the filter refuses
//! them itself, in both roles and in both `request_hold` forms, at request-headers time:
//! an upgrade request may have no body to wait for, and nothing of it has left yet. Only a
//! route named in `upgrade_routes` lets one through, untouched, as traffic that passes
//! (docs/design.md#every-route-goes-through-the-filter).

use super::reply::{rpc_code, LocalReply};
use super::step::{Effect, Level, RequestHead, Step};
use crate::stats::Stat;
use atmost_config::UpgradeRoutes;

/// The ways to ask, read with the rest of the request's head.
pub use super::step::Upgrade;

/// How the refusal names what the request asked for.
fn described(upgrade: Upgrade) -> &'static str {
    match upgrade {
        Upgrade::Header => "a request with an `Upgrade` header",
        Upgrade::Connect => "a CONNECT request",
        Upgrade::Protocol => "an extended CONNECT (`:protocol`)",
    }
}

/// What the filter does with a request that asks to upgrade: `None` lets it through (its
/// route is in `routes`); otherwise the refusal, which sends nothing upstream. A request
/// that does not ask to upgrade is never refused here.
pub fn refusal(head: &RequestHead, routes: &UpgradeRoutes) -> Option<Step> {
    let upgrade = head.upgrade?;
    if routes.allows(head.route.as_deref()) {
        return None;
    }
    let route = match head.route.as_deref() {
        Some(name) => format!("route `{name}`"),
        None => "a request that matched no named route".to_string(),
    };
    let message = format!(
        "protocol upgrade refused: {} would carry messages past atmost unread; {route} is not in upgrade_routes",
        described(upgrade)
    );
    Some(
        Step::pause()
            .with(Effect::LocalReply(LocalReply::rpc_error(
                400,
                None,
                rpc_code::INVALID_REQUEST,
                &message,
            )))
            .with(Effect::Count(Stat::UpgradeRefused))
            .with(Effect::Log(Level::Info, format!("atmost: {message}"))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A request's headers, as the tests write them.
    type Headers<'a> = &'a [(&'a str, &'a str)];

    fn head(headers: Headers, route: Option<&str>) -> RequestHead {
        let mut head = RequestHead::from_headers(headers.iter().copied(), "atmost-permit", false);
        head.route = route.map(str::to_string);
        head
    }

    fn routes(names: &[&str]) -> UpgradeRoutes {
        let config = json!({
            "ledger": {"cluster": "c", "service_token": "svc-token-0123456789abcdef0123456789"},
            "upstream_key": {"mode": "off"},
            "upgrade_routes": names,
        });
        match atmost_config::Config::parse(config.to_string().as_bytes()) {
            Ok(c) => c.upgrade_routes,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn each_way_of_asking_to_upgrade_is_read() {
        let cases: [(Headers, Option<Upgrade>); 7] = [
            (
                &[(":method", "GET"), ("Upgrade", "websocket")],
                Some(Upgrade::Header),
            ),
            (
                &[(":method", "POST"), ("upgrade", "h2c")],
                Some(Upgrade::Header),
            ),
            (
                &[(":method", "GET"), ("upgrade", "")],
                Some(Upgrade::Header),
            ),
            (&[(":method", "CONNECT")], Some(Upgrade::Connect)),
            (&[(":method", "connect")], Some(Upgrade::Connect)),
            (
                &[(":method", "CONNECT"), (":protocol", "websocket")],
                Some(Upgrade::Connect),
            ),
            (&[(":method", "GET"), ("connection", "upgrade")], None),
        ];
        for (headers, expected) in cases {
            assert_eq!(head(headers, None).upgrade, expected, "{headers:?}");
        }
        assert_eq!(
            head(&[(":protocol", "websocket"), (":method", "GET")], None).upgrade,
            Some(Upgrade::Protocol)
        );
        assert_eq!(head(&[(":method", "POST")], None).upgrade, None);
    }

    #[test]
    fn an_upgrade_is_refused_unless_its_route_is_listed() {
        let websocket = [
            (":method", "GET"),
            (":path", "/mcp"),
            ("upgrade", "websocket"),
        ];
        let connect = [(":method", "CONNECT"), (":authority", "mcp:8000")];
        for request in [&websocket[..], &connect[..]] {
            for (listed, route) in [
                (&[][..], Some("mcp")),
                (&["chat-ws"][..], Some("mcp")),
                (&["chat-ws"][..], None),
                (&["chat-ws"][..], Some("chat-ws.x")),
            ] {
                let step = refusal(&head(request, route), &routes(listed));
                let Some(step) = step else {
                    panic!("{request:?} on {route:?} passed with {listed:?}")
                };
                assert_eq!(step.flow, super::super::Flow::Pause);
                let Some(Effect::LocalReply(reply)) = step.effects.first() else {
                    panic!("{step:?}")
                };
                assert_eq!(reply.status, 400);
                let body = reply.body_json().unwrap_or_default();
                assert_eq!(body["error"]["code"], json!(-32600));
                assert_eq!(body["id"], json!(null));
                let message = body["error"]["message"].as_str().unwrap_or_default();
                assert!(
                    message.starts_with("protocol upgrade refused: "),
                    "{message}"
                );
                match route {
                    Some(name) => assert!(message.contains(&format!("route `{name}`"))),
                    None => assert!(message.contains("matched no named route")),
                }
                assert!(step.effects.contains(&Effect::Count(Stat::UpgradeRefused)));
                assert!(!step.effects.contains(&Effect::Count(Stat::BadRequest)));
            }
            // The listed route lets it through.
            assert_eq!(
                refusal(&head(request, Some("chat-ws")), &routes(&["chat-ws"])),
                None
            );
        }
        // What does not ask to upgrade is never refused here, whatever the routes.
        let post = head(
            &[(":method", "POST"), ("connection", "upgrade")],
            Some("mcp"),
        );
        assert_eq!(refusal(&post, &routes(&[])), None);
    }

    #[test]
    fn the_message_never_echoes_the_upgrade_header() {
        let step = refusal(
            &head(
                &[(":method", "GET"), ("upgrade", "<script>evil")],
                Some("mcp"),
            ),
            &routes(&[]),
        );
        let text = format!("{step:?}");
        assert!(!text.contains("evil"), "{text}");
    }
}
