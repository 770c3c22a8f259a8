//! `upgrade_routes`: the Envoy routes on which the filter lets a request switch protocols.
//!
//! After an upgrade (`Upgrade: websocket`, a `CONNECT` tunnel) the connection carries bytes
//! the filter never reads as MCP requests: Envoy hands them to the filter as the body of a
//! request that already went on, so a JSON-RPC `tools/call` sent over a WebSocket to a
//! governed server is neither counted nor stopped. Istio allows WebSocket upgrades on every
//! HTTP connection manager it renders, so the filter refuses every upgrade itself, in both
//! roles, unless the route Envoy picked for the request is named here
//! (docs/design.md#every-route-goes-through-the-filter).

use crate::reader::{err, printable_ascii, ConfigError, Obj};
use serde_json::Value;

/// Most routes `upgrade_routes` may name.
pub const MAX_UPGRADE_ROUTES: usize = 64;
/// Longest route name accepted, in bytes.
pub const MAX_ROUTE_NAME_BYTES: usize = 256;

/// Names that never name one route: `*` is no pattern here, and Istio gives `default` to every
/// route no VirtualService names and `allow_any` to its passthrough route, so either would
/// let upgrades through on routes nobody listed (Istio source,
/// pilot/pkg/networking/core/route/route.go, `DefaultRouteName`).
pub const REFUSED_ROUTE_NAMES: [(&str, &str); 3] = [
    (
        "*",
        "is not a pattern here: name each route that may upgrade",
    ),
    (
        "default",
        "is the name Istio gives every route that no VirtualService names: name your own route",
    ),
    (
        "allow_any",
        "is the name of Istio's passthrough route to any destination: name your own route",
    ),
];

/// `upgrade_routes` (array of strings, default `[]`): the names of the Envoy routes (the
/// route's `name`, which Envoy reports as the property `xds.route_name`; in Istio a
/// VirtualService HTTP route's `name`) on which a request may upgrade. Empty: every upgrade
/// is refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpgradeRoutes(Vec<String>);

impl UpgradeRoutes {
    /// No route may upgrade (the default).
    pub fn none() -> UpgradeRoutes {
        UpgradeRoutes(Vec::new())
    }

    /// Whether a request on the route named `route` may upgrade; `None` (Envoy named no
    /// route, or none matched) never may.
    pub fn allows(&self, route: Option<&str>) -> bool {
        route.is_some_and(|r| self.0.iter().any(|name| name == r))
    }

    /// The names, in the configuration's order.
    pub fn names(&self) -> &[String] {
        &self.0
    }
}

/// Reads `upgrade_routes` of the top-level object (either role).
pub(crate) fn parse(top: &Obj<'_>) -> Result<UpgradeRoutes, ConfigError> {
    let items = match top.map.get("upgrade_routes") {
        None => return Ok(UpgradeRoutes::none()),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(err(
                "upgrade_routes",
                "must be an array of Envoy route names",
            ))
        }
    };
    if items.len() > MAX_UPGRADE_ROUTES {
        return Err(err(
            "upgrade_routes",
            format!("lists more than {MAX_UPGRADE_ROUTES} routes"),
        ));
    }
    let mut names: Vec<String> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let field = format!("upgrade_routes[{i}]");
        let Value::String(name) = item else {
            return Err(err(&field, "must be a string (an Envoy route's name)"));
        };
        if name.is_empty() || name.len() > MAX_ROUTE_NAME_BYTES || !printable_ascii(name) {
            return Err(err(
                &field,
                format!("must be 1 to {MAX_ROUTE_NAME_BYTES} bytes of printable ASCII"),
            ));
        }
        if let Some((_, why)) = REFUSED_ROUTE_NAMES.iter().find(|(n, _)| n == name) {
            return Err(err(&field, *why));
        }
        if let Some(first) = names.iter().position(|n| n == name) {
            return Err(err(
                &field,
                format!("names the same route as upgrade_routes[{first}]"),
            ));
        }
        names.push(name.clone());
    }
    Ok(UpgradeRoutes(names))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(value: Value) -> Result<UpgradeRoutes, ConfigError> {
        let map = json!({ "upgrade_routes": value });
        let Value::Object(map) = map else {
            unreachable!()
        };
        parse(&Obj {
            path: "",
            map: &map,
        })
    }

    fn refused(value: Value) -> ConfigError {
        match parsed(value.clone()) {
            Ok(routes) => panic!("accepted {value}: {routes:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn absent_means_no_route_may_upgrade() {
        let Value::Object(map) = json!({}) else {
            unreachable!()
        };
        let routes = parse(&Obj {
            path: "",
            map: &map,
        });
        assert_eq!(routes, Ok(UpgradeRoutes::none()));
        let none = UpgradeRoutes::none();
        assert!(!none.allows(Some("chat-ws")) && !none.allows(None));
    }

    #[test]
    fn only_a_listed_route_may_upgrade() {
        let routes = parsed(json!(["chat-ws", "events.ws"])).unwrap();
        assert_eq!(routes.names(), ["chat-ws", "events.ws"]);
        assert!(routes.allows(Some("chat-ws")) && routes.allows(Some("events.ws")));
        for other in ["chat", "Chat-ws", "chat-ws ", "mcp", ""] {
            assert!(!routes.allows(Some(other)), "{other:?}");
        }
        // A request Envoy routed nowhere (or whose route has no name) never upgrades.
        assert!(!routes.allows(None));
        assert_eq!(parsed(json!([])), Ok(UpgradeRoutes::none()));
    }

    #[test]
    fn a_bad_value_is_refused_naming_the_entry() {
        let cases = [
            (json!("chat-ws"), "upgrade_routes", "array"),
            (json!({"chat-ws": true}), "upgrade_routes", "array"),
            (json!([7]), "upgrade_routes[0]", "must be a string"),
            (json!(["ok", null]), "upgrade_routes[1]", "must be a string"),
            (json!([""]), "upgrade_routes[0]", "printable ASCII"),
            (json!(["a\tb"]), "upgrade_routes[0]", "printable ASCII"),
            (json!(["é"]), "upgrade_routes[0]", "printable ASCII"),
            (
                json!(["x".repeat(MAX_ROUTE_NAME_BYTES + 1)]),
                "upgrade_routes[0]",
                "1 to 256 bytes",
            ),
            (json!(["*"]), "upgrade_routes[0]", "not a pattern"),
            (
                json!(["ws", "default"]),
                "upgrade_routes[1]",
                "VirtualService",
            ),
            (json!(["allow_any"]), "upgrade_routes[0]", "passthrough"),
            (
                json!(["ws", "x", "ws"]),
                "upgrade_routes[2]",
                "upgrade_routes[0]",
            ),
        ];
        for (value, field, words) in cases {
            let e = refused(value.clone());
            assert_eq!(e.field, field, "{value}");
            assert!(e.message.contains(words), "{value}: {}", e.message);
        }
        let many: Vec<String> = (0..=MAX_UPGRADE_ROUTES).map(|i| format!("r{i}")).collect();
        assert_eq!(refused(json!(many)).field, "upgrade_routes");
        let most: Vec<String> = (0..MAX_UPGRADE_ROUTES).map(|i| format!("r{i}")).collect();
        assert_eq!(
            parsed(json!(most)).map(|r| r.names().len()),
            Ok(MAX_UPGRADE_ROUTES)
        );
        assert!(parsed(json!(["x".repeat(MAX_ROUTE_NAME_BYTES)])).is_ok());
    }
}
