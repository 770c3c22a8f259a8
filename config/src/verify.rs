//! The verifier's configuration (`role: "verify"`): the same module in front of a tool
//! server, refusing governed `tools/call`s without a valid dispatch signature
//! (docs/signatures.md, "The verifier at the tool").

use crate::bounds::{DEFAULT_AUTHORITY, DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_MS, MAX_MAX_BYTES};
use crate::choices::{DenialFormat, RequestHold};
use crate::reader::{err, ConfigError, Obj, ToolSet};
use crate::upgrade::UpgradeRoutes;
use crate::upstream_secret::UpstreamSecret;
use atmost_protocol::signature::{Jwk, KEYS_PATH};
use serde_json::{Map, Value};

/// Default `verify.jwks.refresh_ms`.
pub const DEFAULT_REFRESH_MS: u64 = 60_000;
/// Default `verify.max_skew_s`.
pub const DEFAULT_MAX_SKEW_S: u64 = 5;
/// Largest accepted `verify.max_skew_s`.
pub const MAX_SKEW_S: u64 = 60;
/// Default `verify.replay_cache_entries`.
pub const DEFAULT_REPLAY_CACHE_ENTRIES: u64 = 65_536;
/// Smallest and largest accepted `verify.replay_cache_entries`.
pub const MIN_REPLAY_CACHE_ENTRIES: u64 = 32;
pub const MAX_REPLAY_CACHE_ENTRIES: u64 = 4_194_304;
/// Most keys an inline key set may list.
pub const MAX_INLINE_KEYS: usize = 64;
/// Most names `verify.authorities` may list (each can cost one Ed25519 check of a call).
pub const MAX_AUTHORITIES: usize = 16;
/// Shortest accepted `verify.refusal_key`, in bytes.
pub const MIN_REFUSAL_KEY_BYTES: usize = 32;

/// The top-level fields the verifier reads besides `role` and `verify`.
pub const SHARED_FIELDS: [&str; 5] = [
    "governed_tools",
    "denial_format",
    "max_body_bytes",
    "request_hold",
    "upgrade_routes",
];
/// The top-level fields only the gateway reads: refused in `role: "verify"`.
pub const GATEWAY_ONLY_FIELDS: [&str; 11] = [
    "ledger",
    "permit_header",
    "key_required_tools",
    "upstream_key",
    "max_receipt_bytes",
    "report_interval_ms",
    "completion_reports",
    "answer_release",
    "report_ride_ms",
    "tools_list_limits",
    "approval_hold_ms",
];

/// The checked configuration of `role: "verify"`.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyConfig {
    /// `verify.keys` (inline JWKS `{"keys": [...]}`): public keys always trusted, each an
    /// Ed25519 JWK whose `kid` is its RFC 7638 thumbprint.
    pub keys: Vec<VerifyKey>,
    /// `verify.jwks`: where the key set is fetched from (the ledger's `GET /v1/keys`).
    pub jwks: Option<JwksSource>,
    /// `verify.authorities` (array of 1 to 16 host names, each as `@authority` is signed:
    /// lowercase, with the port when the client names one; required): the names under which
    /// the gateway reaches this server. A signature is checked against these names only, never
    /// against the `:authority` the request arrived with, so a signature made for another
    /// server is refused `signature_invalid` here.
    pub authorities: Vec<String>,
    /// `verify.refusal_key` or `verify.refusal_key_env` (a secret of at least 32 bytes,
    /// optional): the key of the HMAC a refusal carries over its code and the dispatch's nonce
    /// (`atmost-tool-refusal`), which the ledger checks before it gives a refused call's slot
    /// back. Without it a refusal carries no proof and the gateway's attempt turns
    /// `uncertain`.
    pub refusal_key: Option<UpstreamSecret>,
    /// `verify.max_skew_s` (integer 0..=60, default 5): clock difference allowed against
    /// `created` and `expires`.
    pub max_skew_s: u64,
    /// `verify.replay_cache_entries` (integer 32..=4194304, default 65536): how many
    /// accepted signatures the replay cache holds until they expire.
    pub replay_cache_entries: u64,
    /// `governed_tools`: tools whose `tools/call` must carry a signature.
    pub governed_tools: ToolSet,
    /// `denial_format`: the body of a refusal.
    pub denial_format: DenialFormat,
    /// `max_body_bytes`: largest request body read.
    pub max_body_bytes: u64,
    /// `request_hold` (`"headers"` | `"body"`, default `"headers"`): what of a POST is held
    /// until its signature is checked. `headers`: the whole request, so nothing of a
    /// refused call reaches the server (Envoy must allow it:
    /// `allow_on_headers_stop_iteration: true`); `body`: the headers go on at once and only
    /// the body is held, for deployments that cannot set that field (an Istio WasmPlugin).
    pub request_hold: RequestHold,
    /// `upgrade_routes`: the routes on which a request may upgrade; every other upgrade is
    /// refused, as the gateway refuses it ([`UpgradeRoutes`]).
    pub upgrade_routes: UpgradeRoutes,
}

/// One trusted public key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyKey {
    pub kid: String,
    pub public_key: [u8; 32],
}

impl VerifyKey {
    /// The key of a JWK, when [`Jwk::ed25519_public_key`] accepts it.
    pub fn from_jwk(jwk: &Jwk) -> Option<VerifyKey> {
        Some(VerifyKey {
            kid: jwk.kid.clone(),
            public_key: jwk.ed25519_public_key()?,
        })
    }
}

/// `verify.jwks`.
#[derive(Debug, Clone, PartialEq)]
pub struct JwksSource {
    /// `verify.jwks.cluster` (string, required): Envoy cluster of the ledger.
    pub cluster: String,
    /// `verify.jwks.authority` (string, default `"atmost-ledger"`).
    pub authority: String,
    /// `verify.jwks.path` (string, default `"/v1/keys"`).
    pub path: String,
    /// `verify.jwks.refresh_ms` (integer 1000..=86400000, default 60000).
    pub refresh_ms: u64,
    /// `verify.jwks.timeout_ms` (integer 1..=60000, default 1000): timeout of each fetch;
    /// also how long a call with an unknown `keyid` may wait for one.
    pub timeout_ms: u64,
}

fn host_name_ok(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

/// Reads the verifier's configuration from the top-level object (whose `role` is `verify`).
pub(crate) fn parse(
    top: &Obj<'_>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<VerifyConfig, ConfigError> {
    if let Some(gateway_field) = GATEWAY_ONLY_FIELDS
        .iter()
        .find(|f| top.map.contains_key(**f))
    {
        return Err(err(
            gateway_field,
            "is a gateway setting, not used with role `verify`: remove it (or set `role` to `gateway`)",
        ));
    }
    let mut known = vec!["role", "verify"];
    known.extend(SHARED_FIELDS);
    top.refuse_unknown(&known)?;

    let verify_map = top.object("verify")?.ok_or_else(|| {
        err(
            "verify",
            "is required with role `verify` (with `keys`, `jwks`, or both)",
        )
    })?;
    let verify = Obj {
        path: "verify",
        map: verify_map,
    };
    verify.refuse_unknown(&[
        "keys",
        "jwks",
        "authorities",
        "refusal_key",
        "refusal_key_env",
        "max_skew_s",
        "replay_cache_entries",
    ])?;
    let keys = match verify.map.get("keys") {
        None => Vec::new(),
        Some(v) => inline_keys(v)?,
    };
    let jwks = match verify.object("jwks")? {
        None => None,
        Some(m) => Some(jwks_source(m)?),
    };
    if keys.is_empty() && jwks.is_none() {
        return Err(err(
            "verify",
            "names no key: give `keys` (an inline JWKS), `jwks` (where to fetch the ledger's), or both",
        ));
    }
    let authorities = authorities(&verify)?;
    let refusal_key = refusal_key(&verify, env)?;
    let max_skew_s = verify.integer("max_skew_s", DEFAULT_MAX_SKEW_S, 0, MAX_SKEW_S)?;
    let replay_cache_entries = verify.integer(
        "replay_cache_entries",
        DEFAULT_REPLAY_CACHE_ENTRIES,
        MIN_REPLAY_CACHE_ENTRIES,
        MAX_REPLAY_CACHE_ENTRIES,
    )?;

    let governed_tools = top.tool_set("governed_tools", ToolSet::All)?;
    if governed_tools == ToolSet::Only(Vec::new()) {
        return Err(err(
            "governed_tools",
            "is empty, which governs nothing; use [\"*\"] to govern every tool",
        ));
    }
    let denial_format = top.choice::<DenialFormat>("denial_format")?;
    let max_body_bytes = top.integer("max_body_bytes", DEFAULT_MAX_BYTES, 1, MAX_MAX_BYTES)?;
    let request_hold = top.choice::<RequestHold>("request_hold")?;
    let upgrade_routes = crate::upgrade::parse(top)?;
    Ok(VerifyConfig {
        keys,
        jwks,
        authorities,
        refusal_key,
        max_skew_s,
        replay_cache_entries,
        governed_tools,
        denial_format,
        max_body_bytes,
        request_hold,
        upgrade_routes,
    })
}

/// `verify.authorities`: each name as the gateway signs `@authority` (lowercased).
fn authorities(verify: &Obj<'_>) -> Result<Vec<String>, ConfigError> {
    let need = "is required: the host names (with the port the gateway's clients name, if any) under which the gateway reaches this server, e.g. [\"payments.tools.svc.cluster.local:8000\"]";
    let items = match verify.map.get("authorities") {
        None => return Err(err("verify.authorities", need)),
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(_) => return Err(err("verify.authorities", need)),
    };
    if items.len() > MAX_AUTHORITIES {
        return Err(err(
            "verify.authorities",
            format!("lists more than {MAX_AUTHORITIES} names"),
        ));
    }
    let mut names = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match item {
            Value::String(s) if host_name_ok(s) && !s.bytes().any(|b| b.is_ascii_uppercase()) => {
                if !names.contains(s) {
                    names.push(s.clone());
                }
            }
            _ => {
                return Err(err(
                    &format!("verify.authorities[{i}]"),
                    "must be a host name (with its port, if any): printable ASCII without spaces, lowercase, as the gateway signs `@authority`",
                ))
            }
        }
    }
    Ok(names)
}

/// `verify.refusal_key` / `verify.refusal_key_env`, when either is given.
fn refusal_key(
    verify: &Obj<'_>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<UpstreamSecret>, ConfigError> {
    if !verify.map.contains_key("refusal_key") && !verify.map.contains_key("refusal_key_env") {
        return Ok(None);
    }
    let secret = verify.secret("refusal_key", env)?;
    if secret.len() < MIN_REFUSAL_KEY_BYTES {
        return Err(err(
            "verify.refusal_key",
            format!("must be at least {MIN_REFUSAL_KEY_BYTES} bytes"),
        ));
    }
    UpstreamSecret::new(secret)
        .map(Some)
        .ok_or_else(|| err("verify.refusal_key", "is not usable as an HMAC key"))
}

fn inline_keys(value: &Value) -> Result<Vec<VerifyKey>, ConfigError> {
    let Value::Object(map) = value else {
        return Err(err(
            "verify.keys",
            "must be a JWK Set: an object {\"keys\": [...]}",
        ));
    };
    let set = Obj {
        path: "verify.keys",
        map,
    };
    set.refuse_unknown(&["keys"])?;
    let Some(Value::Array(items)) = set.map.get("keys") else {
        return Err(err("verify.keys.keys", "must be an array of JWKs"));
    };
    if items.len() > MAX_INLINE_KEYS {
        return Err(err(
            "verify.keys.keys",
            format!("lists more than {MAX_INLINE_KEYS} keys"),
        ));
    }
    let mut keys = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let key = serde_json::from_value::<Jwk>(item.clone())
            .ok()
            .as_ref()
            .and_then(VerifyKey::from_jwk)
            .ok_or_else(|| {
                err(
                    &format!("verify.keys.keys[{i}]"),
                    "must be an Ed25519 public JWK (kty `OKP`, crv `Ed25519`, a 32-byte `x`) whose `kid` is its RFC 7638 thumbprint",
                )
            })?;
        keys.push(key);
    }
    Ok(keys)
}

fn jwks_source(map: &Map<String, Value>) -> Result<JwksSource, ConfigError> {
    let jwks = Obj {
        path: "verify.jwks",
        map,
    };
    jwks.refuse_unknown(&["cluster", "authority", "path", "refresh_ms", "timeout_ms"])?;
    let cluster = jwks.required_string("cluster")?;
    let authority = jwks
        .string("authority")?
        .unwrap_or_else(|| DEFAULT_AUTHORITY.to_string());
    if !host_name_ok(&authority) {
        return Err(err(
            "verify.jwks.authority",
            "must be a non-empty host name without spaces",
        ));
    }
    let path = jwks
        .string("path")?
        .unwrap_or_else(|| KEYS_PATH.to_string());
    if !path.starts_with('/') || !host_name_ok(&path) {
        return Err(err(
            "verify.jwks.path",
            "must be a path starting with `/`, printable ASCII without spaces",
        ));
    }
    let refresh_ms = jwks.integer("refresh_ms", DEFAULT_REFRESH_MS, 1000, 86_400_000)?;
    let timeout_ms = jwks.integer("timeout_ms", DEFAULT_TIMEOUT_MS, 1, 60_000)?;
    Ok(JwksSource {
        cluster,
        authority,
        path,
        refresh_ms,
        timeout_ms,
    })
}

#[cfg(test)]
mod tests {
    use crate::{PluginConfig, ToolSet};
    use atmost_protocol::signature::Jwk;
    use serde_json::{json, Value};

    fn jwk(seed: u8) -> Value {
        serde_json::to_value(Jwk::ed25519(&[seed; 32])).unwrap_or(Value::Null)
    }

    fn verify_config(v: &Value) -> super::VerifyConfig {
        match PluginConfig::parse(v.to_string().as_bytes()) {
            Ok(PluginConfig::Verify(c)) => c,
            other => panic!("{v}: {other:?}"),
        }
    }

    fn refused(v: &Value) -> (String, String) {
        match PluginConfig::parse(v.to_string().as_bytes()) {
            Ok(c) => panic!("accepted {v}: {c:?}"),
            Err(e) => (e.field.clone(), e.to_string()),
        }
    }

    #[test]
    fn defaults_with_a_fetched_key_set() {
        let c = verify_config(
            &json!({"role": "verify", "verify": {"jwks": {"cluster": "ledger"}, "authorities": ["mcp.example"]}}),
        );
        let jwks = c.jwks.unwrap();
        assert_eq!(jwks.cluster, "ledger");
        assert_eq!(jwks.authority, "atmost-ledger");
        assert_eq!(jwks.path, "/v1/keys");
        assert_eq!(jwks.refresh_ms, 60_000);
        assert_eq!(jwks.timeout_ms, 1000);
        assert!(c.keys.is_empty());
        assert_eq!(c.max_skew_s, 5);
        assert_eq!(c.replay_cache_entries, 65_536);
        assert_eq!(c.governed_tools, ToolSet::All);
        assert_eq!(c.denial_format, crate::DenialFormat::Result);
        assert_eq!(c.max_body_bytes, 1_048_576);
        assert_eq!(c.request_hold, crate::RequestHold::Headers);
        let body = verify_config(
            &json!({"role": "verify", "request_hold": "body", "verify": {"jwks": {"cluster": "l"}, "authorities": ["mcp.example"]}}),
        );
        assert_eq!(body.request_hold, crate::RequestHold::Body);
    }

    #[test]
    fn the_authorities_served_are_required_and_the_refusal_key_optional() {
        let c = verify_config(&json!({"role": "verify", "verify": {
            "jwks": {"cluster": "ledger"},
            "authorities": ["payments:8000", "payments.tools.svc.cluster.local:8000", "payments:8000"]
        }}));
        assert_eq!(
            c.authorities,
            ["payments:8000", "payments.tools.svc.cluster.local:8000"]
        );
        assert!(c.refusal_key.is_none());
        let (field, text) =
            refused(&json!({"role": "verify", "verify": {"jwks": {"cluster": "ledger"}}}));
        assert_eq!(field, "verify.authorities");
        assert!(text.contains("is required"), "{text}");
        let key = "k".repeat(32);
        let with_key = json!({"role": "verify", "verify": {
            "jwks": {"cluster": "ledger"}, "authorities": ["a"], "refusal_key": key}});
        assert_eq!(
            verify_config(&with_key).refusal_key.map(|k| k.len()),
            Some(32)
        );
        let from_env = json!({"role": "verify", "verify": {
            "jwks": {"cluster": "ledger"}, "authorities": ["a"], "refusal_key_env": "REFUSAL"}});
        let env = |name: &str| (name == "REFUSAL").then(|| "e".repeat(40));
        match PluginConfig::parse_with_env(from_env.to_string().as_bytes(), &env) {
            Ok(PluginConfig::Verify(c)) => assert_eq!(c.refusal_key.map(|k| k.len()), Some(40)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn upgrade_routes_is_read_as_the_gateway_reads_it() {
        let base = json!({"role": "verify", "verify": {"jwks": {"cluster": "ledger"}, "authorities": ["mcp.example"]}});
        assert_eq!(
            verify_config(&base).upgrade_routes,
            crate::UpgradeRoutes::none()
        );
        let mut listed = base.clone();
        listed["upgrade_routes"] = json!(["chat-ws"]);
        assert!(verify_config(&listed)
            .upgrade_routes
            .allows(Some("chat-ws")));
        listed["upgrade_routes"] = json!(["*"]);
        assert_eq!(refused(&listed).0, "upgrade_routes[0]");
    }

    #[test]
    fn inline_keys_are_checked_ed25519_jwks() {
        let c = verify_config(&json!({
            "role": "verify",
            "verify": {"keys": {"keys": [jwk(1), jwk(2)]}, "max_skew_s": 0, "replay_cache_entries": 32,
                       "authorities": ["mcp.example"]},
            "governed_tools": ["pay"], "denial_format": "error", "max_body_bytes": 4096
        }));
        assert_eq!(c.keys.len(), 2);
        assert_eq!(c.keys[0].public_key, [1; 32]);
        assert_eq!(c.keys[0].kid, Jwk::ed25519(&[1; 32]).kid);
        assert!(c.jwks.is_none());
        assert!(c.governed_tools.contains("pay") && !c.governed_tools.contains("x"));
        let mut forged = jwk(3);
        forged["kid"] = json!("chosen-by-me");
        let (field, _) = refused(
            &json!({"role": "verify", "verify": {"keys": {"keys": [jwk(1), forged]}, "authorities": ["a"]}}),
        );
        assert_eq!(field, "verify.keys.keys[1]");
    }

    #[test]
    fn each_bad_field_is_named() {
        let base = || json!({"role": "verify", "verify": {"jwks": {"cluster": "ledger"}, "authorities": ["mcp.example"]}});
        let with = |path: &[&str], value: Value| {
            let mut v = base();
            let mut cur = &mut v;
            for p in &path[..path.len() - 1] {
                cur = &mut cur[*p];
            }
            cur[path[path.len() - 1]] = value;
            v
        };
        let cases = [
            (json!({"role": "verify"}), "verify"),
            (json!({"role": "verify", "verify": {}}), "verify"),
            (
                json!({"role": "verify", "verify": {"keys": {"keys": []}, "authorities": ["a"]}}),
                "verify",
            ),
            (json!({"role": "verifier"}), "role"),
            (json!({"role": 1}), "role"),
            (with(&["verify", "keys"], json!([])), "verify.keys"),
            (
                with(&["verify", "keys"], json!({"keys": {}})),
                "verify.keys.keys",
            ),
            (
                with(&["verify", "keys"], json!({"keys": [], "x": 1})),
                "verify.keys.x",
            ),
            (
                with(&["verify", "jwks", "cluster"], json!("")),
                "verify.jwks.cluster",
            ),
            (
                with(&["verify", "jwks", "path"], json!("keys")),
                "verify.jwks.path",
            ),
            (
                with(&["verify", "jwks", "authority"], json!("a b")),
                "verify.jwks.authority",
            ),
            (
                with(&["verify", "jwks", "refresh_ms"], json!(10)),
                "verify.jwks.refresh_ms",
            ),
            (
                with(&["verify", "jwks", "timeout_ms"], json!(0)),
                "verify.jwks.timeout_ms",
            ),
            (
                with(&["verify", "jwks", "clustr"], json!("x")),
                "verify.jwks.clustr",
            ),
            (
                with(&["verify", "max_skew_s"], json!(61)),
                "verify.max_skew_s",
            ),
            (
                with(&["verify", "replay_cache_entries"], json!(31)),
                "verify.replay_cache_entries",
            ),
            (
                with(&["verify", "replay_cache"], json!(1)),
                "verify.replay_cache",
            ),
            (
                with(&["verify", "authorities"], json!([])),
                "verify.authorities",
            ),
            (
                with(&["verify", "authorities"], json!(["Mcp.Example"])),
                "verify.authorities[0]",
            ),
            (
                with(&["verify", "authorities"], json!(["a b"])),
                "verify.authorities[0]",
            ),
            (
                with(&["verify", "authorities"], json!("mcp.example")),
                "verify.authorities",
            ),
            (
                with(&["verify", "refusal_key"], json!("short")),
                "verify.refusal_key",
            ),
            (with(&["governed_tools"], json!([])), "governed_tools"),
            (with(&["denial_format"], json!("text")), "denial_format"),
            (with(&["max_body_bytes"], json!(0)), "max_body_bytes"),
            (with(&["request_hold"], json!("none")), "request_hold"),
            (with(&["governd_tools"], json!(["*"])), "governd_tools"),
        ];
        for (v, field) in cases {
            assert_eq!(refused(&v).0, field, "{v}");
        }
    }

    #[test]
    fn gateway_settings_are_refused_in_the_verify_role_and_the_reverse() {
        for field in super::GATEWAY_ONLY_FIELDS {
            let mut v = json!({"role": "verify", "verify": {"jwks": {"cluster": "ledger"}, "authorities": ["mcp.example"]}});
            v[field] = json!({});
            let (named, text) = refused(&v);
            assert_eq!(named, field);
            assert!(text.contains("gateway setting"), "{text}");
        }
        let gateway = json!({
            "ledger": {"cluster": "c", "service_token": "svc-token-0123456789abcdef0123456789"},
            "upstream_key": {"mode": "off"},
            "verify": {"jwks": {"cluster": "ledger"}, "authorities": ["mcp.example"]}
        });
        let (named, text) = refused(&gateway);
        assert_eq!(named, "verify");
        assert!(text.contains("role `verify`"), "{text}");
        // The gateway's own parser says the same of a verifier's configuration.
        let e = crate::Config::parse(
            json!({"role": "verify", "verify": {"jwks": {"cluster": "l"}, "authorities": ["mcp.example"]}})
                .to_string()
                .as_bytes(),
        );
        assert_eq!(e.err().map(|e| e.field), Some("role".to_string()));
    }

    #[test]
    fn role_gateway_is_the_default_and_may_be_named() {
        let v = json!({"role": "gateway", "ledger": {"cluster": "c", "service_token": "svc-token-0123456789abcdef0123456789"}, "upstream_key": {"mode": "off"}});
        assert!(matches!(
            PluginConfig::parse(v.to_string().as_bytes()),
            Ok(PluginConfig::Gateway(_))
        ));
        assert!(crate::Config::parse(v.to_string().as_bytes()).is_ok());
    }
}
