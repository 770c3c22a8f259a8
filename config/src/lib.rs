//! The plugin configuration: the JSON in the Wasm filter's `configuration`. A crate of its
//! own so the ledger's `atmost config check` runs the filter's parser without the filter.
//!
//! Parsing and checking happen in one pass over the JSON so that every error names the
//! field it is about (`ledger.timeout_ms`, `upstream_key.secret`, …). Unknown fields are
//! refused, so a typo is an error and not a silently ignored setting. Error messages never
//! echo a field's value (some are secrets).

mod upgrade;
mod upstream_secret;
mod verify;

use serde_json::{Map, Value};
pub use upgrade::{UpgradeRoutes, MAX_ROUTE_NAME_BYTES, MAX_UPGRADE_ROUTES, REFUSED_ROUTE_NAMES};
pub use upstream_secret::UpstreamSecret;
pub use verify::{JwksSource, VerifyConfig, VerifyKey};
pub use verify::{
    DEFAULT_MAX_SKEW_S, DEFAULT_REFRESH_MS, DEFAULT_REPLAY_CACHE_ENTRIES, GATEWAY_ONLY_FIELDS,
    MAX_INLINE_KEYS, MAX_REPLAY_CACHE_ENTRIES, MAX_SKEW_S, MIN_REPLAY_CACHE_ENTRIES,
};

/// Default `permit_header`.
pub const DEFAULT_PERMIT_HEADER: &str = "atmost-permit";
/// Default `ledger.authority`.
pub const DEFAULT_AUTHORITY: &str = "atmost-ledger";
/// Default `ledger.timeout_ms`.
pub const DEFAULT_TIMEOUT_MS: u64 = 1000;
/// Longest `credential_cache_ms`: five minutes, the longest a rotation or a revocation may
/// take to reach a session's requests other than a dispatched call.
pub const MAX_CREDENTIAL_CACHE_MS: u64 = 300_000;

/// Default `max_body_bytes` and `max_receipt_bytes` (1 MiB).
pub const DEFAULT_MAX_BYTES: u64 = 1_048_576;
/// Largest accepted `max_body_bytes` / `max_receipt_bytes` (64 MiB).
pub const MAX_MAX_BYTES: u64 = 64 * 1_048_576;
/// Default `report_interval_ms`.
pub const DEFAULT_REPORT_INTERVAL_MS: u64 = 200;
/// Shortest accepted `upstream_key.secret`, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;
/// Default `signature_validity_s`: Envoy's default route timeout.
pub const DEFAULT_SIGNATURE_VALIDITY_S: u64 = 15;
/// Longest accepted `signature_validity_s`: the longest validity the ledger signs.
pub use atmost_protocol::signature::MAX_VALIDITY_S;
/// Shortest accepted `ledger.service_token`, in bytes: the ledger's own minimum.
pub use atmost_protocol::MIN_SERVICE_TOKEN_BYTES;
/// The request headers the filter reads or writes besides the permit header. The permit
/// header may not be one of them, and the filter refuses a request that carries one under
/// another spelling (`_` for `-`): WSGI, Rack and CGI servers read `Idempotency_Key` and
/// `Idempotency-Key` as one header, so the upstream could take the alias's value for the
/// one the filter checked. The last three are the dispatch signature's: the filter writes
/// them on a signed dispatch and removes a client's own from every request.
pub const HEADERS_ATMOST_READS: [&str; 12] = [
    atmost_protocol::IDEMPOTENCY_KEY_HEADER,
    "mcp-method",
    "mcp-name",
    "mcp-protocol-version",
    "mcp-session-id",
    "last-event-id",
    "content-type",
    "content-length",
    "content-encoding",
    "content-digest",
    "signature-input",
    "signature",
];

/// What one plugin instance is, by its `role` (`"gateway"` by default, or `"verify"`).
#[derive(Debug, Clone, PartialEq)]
pub enum PluginConfig {
    /// `role: "gateway"` (or no `role`): asks the ledger before a governed call goes out.
    Gateway(Config),
    /// `role: "verify"`: in front of a tool server, refuses governed calls without a valid
    /// dispatch signature.
    Verify(VerifyConfig),
}

impl PluginConfig {
    /// Parses and checks a configuration of either role; `*_env` secrets are read from the
    /// process environment.
    pub fn parse(bytes: &[u8]) -> Result<PluginConfig, ConfigError> {
        PluginConfig::parse_with_env(bytes, &|name| std::env::var(name).ok())
    }

    /// [`PluginConfig::parse`] with the environment given.
    pub fn parse_with_env(
        bytes: &[u8],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<PluginConfig, ConfigError> {
        let root = json_object(bytes)?;
        let Value::Object(map) = &root else {
            return Err(err("", "must be a JSON object"));
        };
        let top = Obj { path: "", map };
        match role(&top)? {
            Role::Gateway => Config::parse_with_env(bytes, env).map(PluginConfig::Gateway),
            Role::Verify => verify::parse(&top, env).map(PluginConfig::Verify),
        }
    }
}

/// `role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Gateway,
    Verify,
}

fn role(top: &Obj<'_>) -> Result<Role, ConfigError> {
    match top.string("role")?.as_deref() {
        None | Some("gateway") => Ok(Role::Gateway),
        Some("verify") => Ok(Role::Verify),
        Some(_) => Err(err("role", "must be `gateway` or `verify`")),
    }
}

/// The configuration bytes as JSON; an empty or unreadable configuration is refused.
fn json_object(bytes: &[u8]) -> Result<Value, ConfigError> {
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(err(
            "",
            "configuration is empty; `ledger.cluster` and `ledger.service_token` are required",
        ));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        err(
            "",
            format!("not valid JSON (line {}, column {})", e.line(), e.column()),
        )
    })
}

/// `request_hold`, read alike in both roles.
fn request_hold(top: &Obj<'_>) -> Result<RequestHold, ConfigError> {
    match top.string("request_hold")?.as_deref() {
        None | Some("headers") => Ok(RequestHold::Headers),
        Some("body") => Ok(RequestHold::Body),
        Some(_) => Err(err("request_hold", "must be `headers` or `body`")),
    }
}

/// `denial_format`, read alike in both roles.
fn denial_format(top: &Obj<'_>) -> Result<DenialFormat, ConfigError> {
    match top.string("denial_format")?.as_deref() {
        None | Some("result") => Ok(DenialFormat::Result),
        Some("error") => Ok(DenialFormat::Error),
        Some(_) => Err(err("denial_format", "must be `result` or `error`")),
    }
}

/// `answer_release`, read from [`ANSWER_RELEASE`].
fn answer_release(top: &Obj<'_>) -> Result<AnswerRelease, ConfigError> {
    let Some(name) = top.string("answer_release")? else {
        return Ok(AnswerRelease::AfterReceipt);
    };
    ANSWER_RELEASE
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, mode)| *mode)
        .ok_or_else(|| {
            let names: Vec<String> = ANSWER_RELEASE
                .iter()
                .map(|(n, _)| format!("`{n}`"))
                .collect();
            err(
                "answer_release",
                format!("must be one of {}", names.join(", ")),
            )
        })
}

/// The checked plugin configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `ledger`: where and how the filter asks the ledger.
    pub ledger: LedgerConfig,
    /// `permit_header` (string, default `"atmost-permit"`): request header carrying the
    /// permit token. Matched case-insensitively, always removed before upstream. May not be
    /// `authorization` (that one stays the MCP server's), `host`, a pseudo-header or one of
    /// [`HEADERS_ATMOST_READS`], nor one of those spelled with `_` for `-`.
    pub permit_header: String,
    /// `governed_tools` (array of strings, default `["*"]`): tool names (`params.name`)
    /// whose `tools/call` needs the ledger's decision; `"*"` governs every tool. Calls to
    /// other tools pass like any other traffic. Must not be empty.
    pub governed_tools: ToolSet,
    /// `key_required_tools` (array of strings, default `[]`): governed tools for which the
    /// ledger denies a call without an idempotency key (`idempotency_key_required`); `"*"`
    /// means every governed tool.
    pub key_required_tools: ToolSet,
    /// `upstream_key`: what the upstream receives in its `Idempotency-Key` header.
    pub upstream_key: UpstreamKey,
    /// `denial_format` (`"result"` | `"error"`, default `"result"`): `result` answers a
    /// denial with HTTP 200 and a JSON-RPC result with `isError: true` and
    /// `structuredContent.error`; `error` answers with a JSON-RPC error object whose code is
    /// the denial's application code (-31001…).
    pub denial_format: DenialFormat,
    /// `max_body_bytes` (integer, default 1048576, 1..=67108864): largest request body the
    /// filter reads; a larger POST is answered HTTP 413 with a JSON-RPC error. Envoy's
    /// `per_connection_buffer_limit_bytes` must be at least this large.
    pub max_body_bytes: u64,
    /// `max_receipt_bytes` (integer, default 1048576, 1..=67108864): largest upstream
    /// response (JSON) or single SSE event the filter keeps as a receipt. Past it the
    /// response still reaches the client, but the call is reported `uncertain` with reason
    /// `receipt_too_large`.
    pub max_receipt_bytes: u64,
    /// `report_interval_ms` (integer, default 200, 10..=60000): tick period of the root
    /// context, which sends queued outcome reports to the ledger in batches.
    pub report_interval_ms: u64,
    /// `completion_reports` (`"batched"` | `"per_call"`, default `"batched"`): how the
    /// `completed` report of a dispatched call is sent before its answer is released to
    /// the client. `batched`: the root context of each Envoy worker sends the reports of
    /// every call waiting at that moment in one `POST /v1/outcomes` (at most one batch out
    /// per worker; a lone call goes out at once), so under load many calls share one
    /// callout. `per_call`: each call sends its own report. Either way the answer is held
    /// until the ledger acknowledges (or, if it cannot be reached, the report is queued
    /// for retry and the answer released), unless `answer_release` is `at_once`.
    pub completion_reports: CompletionReports,
    /// `answer_release` (`"after_receipt"` | `"at_once"`, default `"after_receipt"`): when
    /// the answer of a dispatched call whose report is `completed` or `accepted` reaches the
    /// client. `after_receipt`: once the ledger has acknowledged the report (as
    /// `completion_reports` says). `at_once`: as soon as the upstream's answer is whole; the
    /// report goes to the root's batch all the same and is retried when it fails, but a
    /// same-key retry that comes before it lands gets `idempotency_in_progress`, and an
    /// Envoy that dies before it lands leaves the attempt to its lease (`uncertain`). An
    /// `input_required` answer is held in both modes. Needs `completion_reports: batched`.
    pub answer_release: AnswerRelease,
    /// `tools_list_limits` (boolean, default `false`): a `tools/list` answer passing through
    /// for a request that carried a permit gains, under each governed tool's `_meta`, the
    /// permit's figures for that tool (`_meta["dev.atmost/permit"]`: calls left, budget
    /// left, expiry), asked of the ledger with one callout per answer. Without a permit, or
    /// with one the ledger does not authenticate, or when the ledger cannot be asked, the
    /// answer passes unchanged.
    pub tools_list_limits: bool,
    /// `credential_cache_ms` (integer, default 0, 0..=300000): the session's requests other
    /// than a dispatched `tools/call` (`initialize`, `tools/list`, notifications, `GET`
    /// streams, ungoverned calls) under a permit carry the permit's credential too, which
    /// the filter asks of the ledger (`POST /v1/credential`) and keeps per permit, in each
    /// worker's memory, for this many milliseconds. 0: it asks nothing, and those requests
    /// carry no credential.
    pub credential_cache_ms: u64,
    /// `request_hold` (`"headers"` | `"body"`, default `"headers"`): what of a POST the
    /// filter holds until the ledger has decided. `headers`: the whole request, headers
    /// included; Envoy must allow it (`allow_on_headers_stop_iteration: true` in the Wasm
    /// filter's config, which an EnvoyFilter can set). `body`: the headers go upstream at
    /// once (permit header and `content-length` removed, and the `Idempotency-Key` header of
    /// a POST that may be a governed call under a permit: it reaches the upstream only in the
    /// body) and only the body is held; nothing is signed; a denial answers the client and
    /// ends the upstream stream before any byte of the body left. For deployments that
    /// cannot set that Envoy field (an Istio WasmPlugin, Envoy Gateway).
    pub request_hold: RequestHold,
    /// `signature_validity_s` (integer, default 15, 1..=300): how long the signature of a
    /// dispatch stays valid, from the ledger's signing to `expires`. The request must reach
    /// the tool's verifier within it, so keep it at most the route's timeout (Envoy's
    /// default is 15 s). Only `request_hold: headers` signs.
    pub signature_validity_s: u64,
    /// `upgrade_routes` (array of Envoy route names, default `[]`): the routes on which a
    /// request may upgrade (an `Upgrade` header, `CONNECT`); on every other route the filter
    /// refuses it, since what the upgraded connection carries is never read
    /// ([`UpgradeRoutes`]).
    pub upgrade_routes: UpgradeRoutes,
}

/// `ledger`: the callout target.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerConfig {
    /// `ledger.cluster` (string, required): name of the Envoy cluster of the ledger.
    pub cluster: String,
    /// `ledger.authority` (string, default `"atmost-ledger"`): `:authority` of callouts.
    pub authority: String,
    /// `ledger.timeout_ms` (integer, default 1000, 1..=60000): timeout of each callout; a
    /// timed-out authorize denies the call with `gateway_unavailable`.
    pub timeout_ms: u64,
    /// `ledger.service_token` (string, required): sent as `authorization: Bearer <token>`
    /// on every callout. Printable ASCII; never logged.
    pub service_token: String,
}

/// Which tools a list names.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolSet {
    /// `"*"` was listed.
    All,
    /// Exactly these names.
    Only(Vec<String>),
}

impl ToolSet {
    /// Whether `tool` is in the set.
    pub fn contains(&self, tool: &str) -> bool {
        match self {
            ToolSet::All => true,
            ToolSet::Only(names) => names.iter().any(|n| n == tool),
        }
    }
}

/// `upstream_key`.
#[derive(Debug, Clone, PartialEq)]
pub enum UpstreamKey {
    /// `{"mode": "hmac", "secret": "..."}` (default mode): the upstream gets lowercase hex
    /// `HMAC-SHA256(secret, permit_id + ":" + key)`. `upstream_key.secret` (string, at
    /// least 16 bytes) is required in this mode.
    Hmac { secret: UpstreamSecret },
    /// `{"mode": "raw"}`: the upstream gets the client's key as sent.
    Raw,
    /// `{"mode": "off"}`: the `Idempotency-Key` header is removed.
    Off,
}

/// `request_hold`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestHold {
    /// Hold the whole request, headers included, until the decision.
    Headers,
    /// Let the headers go at once; hold the body until the decision.
    Body,
}

/// `completion_reports`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionReports {
    Batched,
    PerCall,
}

/// `answer_release`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerRelease {
    /// The answer waits until the ledger has acknowledged its report (or the report could
    /// not be delivered and was queued).
    AfterReceipt,
    /// The answer goes on as soon as it is whole; its report follows through the root.
    AtOnce,
}

/// The names of `answer_release`, first the default: the one table the parser reads.
pub const ANSWER_RELEASE: [(&str, AnswerRelease); 2] = [
    ("after_receipt", AnswerRelease::AfterReceipt),
    ("at_once", AnswerRelease::AtOnce),
];

/// `denial_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenialFormat {
    Result,
    Error,
}

/// A configuration the filter refuses. `field` is the dotted path of the offending field.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            write!(f, "atmost: bad plugin configuration: {}", self.message)
        } else {
            write!(
                f,
                "atmost: bad plugin configuration: field `{}`: {}",
                self.field, self.message
            )
        }
    }
}

fn err(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        message: message.into(),
    }
}

/// One JSON object being read; remembers which keys were used to refuse the rest.
struct Obj<'a> {
    path: &'a str,
    map: &'a Map<String, Value>,
}

impl<'a> Obj<'a> {
    fn field_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{}", self.path, key)
        }
    }

    fn refuse_unknown(&self, known: &[&str]) -> Result<(), ConfigError> {
        // Report in a stable order.
        let mut unknown: Vec<&String> = self
            .map
            .keys()
            .filter(|k| !known.contains(&k.as_str()))
            .collect();
        unknown.sort();
        match unknown.first() {
            None => Ok(()),
            Some(k) => Err(err(
                &self.field_path(k),
                format!("unknown field (expected one of: {})", known.join(", ")),
            )),
        }
    }

    fn string(&self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(err(&self.field_path(key), "must be a string")),
        }
    }

    fn required_string(&self, key: &str) -> Result<String, ConfigError> {
        match self.string(key)? {
            Some(s) if !s.is_empty() => Ok(s),
            Some(_) => Err(err(&self.field_path(key), "must not be empty")),
            None => Err(err(&self.field_path(key), "is required")),
        }
    }

    /// A secret given either in place (`key`) or by the name of an environment variable of
    /// the VM (`key` + `_env`), which Envoy fills from its own environment when the name is
    /// listed in `vm_config.environment_variables.host_env_keys`. The second form keeps the
    /// secret out of what Envoy's admin `/config_dump` shows.
    fn secret(
        &self,
        key: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<String, ConfigError> {
        let env_key = format!("{key}_env");
        match (self.map.contains_key(key), self.map.contains_key(&env_key)) {
            (true, true) => Err(err(
                &self.field_path(key),
                format!("is given twice: set `{key}` or `{env_key}`, not both"),
            )),
            (false, true) => {
                let name = self.required_string(&env_key)?;
                match env(&name) {
                    Some(v) if !v.is_empty() => Ok(v),
                    _ => Err(err(
                        &self.field_path(&env_key),
                        format!(
                            "names the environment variable `{name}`, which is unset or empty in the Wasm VM (list it in vm_config.environment_variables.host_env_keys and set it in Envoy's environment)"
                        ),
                    )),
                }
            }
            _ => self.required_string(key),
        }
    }

    fn integer(&self, key: &str, default: u64, min: u64, max: u64) -> Result<u64, ConfigError> {
        let n = match self.map.get(key) {
            None => return Ok(default),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| err(&self.field_path(key), "must be a non-negative integer"))?,
        };
        if n < min || n > max {
            return Err(err(
                &self.field_path(key),
                format!("must be between {min} and {max} (got {n})"),
            ));
        }
        Ok(n)
    }

    fn boolean(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.map.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(err(&self.field_path(key), "must be true or false")),
        }
    }

    fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>, ConfigError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(_) => Err(err(&self.field_path(key), "must be an object")),
        }
    }

    fn tool_set(&self, key: &str, default: ToolSet) -> Result<ToolSet, ConfigError> {
        let path = self.field_path(key);
        let items = match self.map.get(key) {
            None => return Ok(default),
            Some(Value::Array(items)) => items,
            Some(_) => return Err(err(&path, "must be an array of tool names")),
        };
        let mut names = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match item {
                Value::String(s) if !s.is_empty() => names.push(s.clone()),
                _ => {
                    return Err(err(
                        &format!("{path}[{i}]"),
                        "must be a non-empty string (a tool name or \"*\")",
                    ))
                }
            }
        }
        if names.iter().any(|n| n == "*") {
            Ok(ToolSet::All)
        } else {
            Ok(ToolSet::Only(names))
        }
    }
}

fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn printable_ascii(s: &str) -> bool {
    s.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

impl Config {
    /// Parses and checks the plugin configuration bytes; `*_env` secrets are read from the
    /// process environment (inside Envoy: the VM's WASI environment).
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        Config::parse_with_env(bytes, &|name| std::env::var(name).ok())
    }

    /// [`Config::parse`] with the environment given, so parsing stays a pure function.
    pub fn parse_with_env(
        bytes: &[u8],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let root = json_object(bytes)?;
        let Value::Object(map) = &root else {
            return Err(err("", "must be a JSON object"));
        };
        let top = Obj { path: "", map };
        if role(&top)? == Role::Verify {
            return Err(err(
                "role",
                "is `verify`: this is a verifier's configuration, not a gateway's",
            ));
        }
        if top.map.contains_key("verify") {
            return Err(err(
                "verify",
                "is only used with role `verify`: remove it, or set `role` to `verify`",
            ));
        }
        top.refuse_unknown(&[
            "role",
            "ledger",
            "permit_header",
            "governed_tools",
            "key_required_tools",
            "upstream_key",
            "denial_format",
            "max_body_bytes",
            "max_receipt_bytes",
            "report_interval_ms",
            "completion_reports",
            "answer_release",
            "tools_list_limits",
            "credential_cache_ms",
            "request_hold",
            "signature_validity_s",
            "upgrade_routes",
        ])?;

        let ledger_map = top
            .object("ledger")?
            .ok_or_else(|| err("ledger", "is required (with `cluster` and `service_token`)"))?;
        let ledger = Obj {
            path: "ledger",
            map: ledger_map,
        };
        ledger.refuse_unknown(&[
            "cluster",
            "authority",
            "timeout_ms",
            "service_token",
            "service_token_env",
        ])?;
        let cluster = ledger.required_string("cluster")?;
        let authority = ledger
            .string("authority")?
            .unwrap_or_else(|| DEFAULT_AUTHORITY.to_string());
        if authority.is_empty() || !printable_ascii(&authority) || authority.contains(' ') {
            return Err(err(
                "ledger.authority",
                "must be a non-empty host name without spaces",
            ));
        }
        let timeout_ms = ledger.integer("timeout_ms", DEFAULT_TIMEOUT_MS, 1, 60_000)?;
        let service_token = ledger.secret("service_token", env)?;
        if !printable_ascii(&service_token) {
            return Err(err(
                "ledger.service_token",
                "must be printable ASCII (it is sent in an HTTP header)",
            ));
        }
        // The ledger refuses to start with a shorter one, so this token could never be
        // accepted: every governed call would fail closed at run time instead of here.
        if service_token.len() < MIN_SERVICE_TOKEN_BYTES {
            return Err(err(
                "ledger.service_token",
                format!(
                    "must be at least {MIN_SERVICE_TOKEN_BYTES} bytes long, as the ledger requires; this one has {} (make one with `openssl rand -hex 32`)",
                    service_token.len()
                ),
            ));
        }

        let permit_header = top
            .string("permit_header")?
            .unwrap_or_else(|| DEFAULT_PERMIT_HEADER.to_string())
            .to_ascii_lowercase();
        if permit_header.is_empty() || !permit_header.bytes().all(is_token_char) {
            return Err(err(
                "permit_header",
                "must be a valid HTTP header name (letters, digits, `-`, …)",
            ));
        }
        // Spelled with `_`, it would be an alias of the header it imitates, which the
        // filter refuses on every request.
        let folded = permit_header.replace('_', "-");
        if ["authorization", "host"].contains(&folded.as_str())
            || HEADERS_ATMOST_READS.contains(&folded.as_str())
        {
            return Err(err(
                "permit_header",
                "names a header atmost or MCP already uses; pick a dedicated one such as `atmost-permit`",
            ));
        }

        let governed_tools = top.tool_set("governed_tools", ToolSet::All)?;
        if governed_tools == ToolSet::Only(Vec::new()) {
            return Err(err(
                "governed_tools",
                "is empty, which governs nothing; use [\"*\"] to govern every tool",
            ));
        }
        let key_required_tools = top.tool_set("key_required_tools", ToolSet::Only(Vec::new()))?;

        let upstream_key = match top.object("upstream_key")? {
            None => {
                return Err(err(
                    "upstream_key.secret",
                    "is required: the default upstream_key mode is `hmac` (or set `upstream_key.mode` to `raw` or `off`)",
                ))
            }
            Some(m) => {
                let uk = Obj {
                    path: "upstream_key",
                    map: m,
                };
                uk.refuse_unknown(&["mode", "secret", "secret_env"])?;
                let mode = uk.string("mode")?.unwrap_or_else(|| "hmac".to_string());
                match mode.as_str() {
                    "hmac" => {
                        let secret = uk.secret("secret", env)?;
                        if secret.len() < MIN_SECRET_BYTES {
                            return Err(err(
                                "upstream_key.secret",
                                format!("must be at least {MIN_SECRET_BYTES} bytes"),
                            ));
                        }
                        let secret = UpstreamSecret::new(secret).ok_or_else(|| {
                            err("upstream_key.secret", "is not usable as an HMAC key")
                        })?;
                        UpstreamKey::Hmac { secret }
                    }
                    "raw" | "off"
                        if uk.map.contains_key("secret") || uk.map.contains_key("secret_env") =>
                    {
                        return Err(err(
                            "upstream_key.secret",
                            format!("is only used with mode `hmac`, not `{mode}`: remove it"),
                        ))
                    }
                    "raw" => UpstreamKey::Raw,
                    "off" => UpstreamKey::Off,
                    _ => {
                        return Err(err(
                            "upstream_key.mode",
                            "must be one of `hmac`, `raw`, `off`",
                        ))
                    }
                }
            }
        };

        let denial_format = denial_format(&top)?;
        let max_body_bytes = top.integer("max_body_bytes", DEFAULT_MAX_BYTES, 1, MAX_MAX_BYTES)?;
        let max_receipt_bytes =
            top.integer("max_receipt_bytes", DEFAULT_MAX_BYTES, 1, MAX_MAX_BYTES)?;
        let report_interval_ms =
            top.integer("report_interval_ms", DEFAULT_REPORT_INTERVAL_MS, 10, 60_000)?;
        let completion_reports = match top.string("completion_reports")?.as_deref() {
            None | Some("batched") => CompletionReports::Batched,
            Some("per_call") => CompletionReports::PerCall,
            Some(_) => return Err(err("completion_reports", "must be `batched` or `per_call`")),
        };
        let answer_release = answer_release(&top)?;
        if answer_release == AnswerRelease::AtOnce
            && completion_reports == CompletionReports::PerCall
        {
            // A per-call report is the request's own callout, which Envoy cancels when the
            // request ends: released at once, the request may end before its report leaves.
            return Err(err(
                "answer_release",
                "`at_once` sends each report through the root's batch, so it needs `completion_reports: batched` (a request's own callout is cancelled when its answer has gone)",
            ));
        }
        let tools_list_limits = top.boolean("tools_list_limits", false)?;
        let credential_cache_ms =
            top.integer("credential_cache_ms", 0, 0, MAX_CREDENTIAL_CACHE_MS)?;
        let request_hold = request_hold(&top)?;
        let signature_validity_s = top.integer(
            "signature_validity_s",
            DEFAULT_SIGNATURE_VALIDITY_S,
            1,
            MAX_VALIDITY_S,
        )?;
        let upgrade_routes = upgrade::parse(&top)?;

        Ok(Config {
            ledger: LedgerConfig {
                cluster,
                authority,
                timeout_ms,
                service_token,
            },
            permit_header,
            governed_tools,
            key_required_tools,
            upstream_key,
            denial_format,
            max_body_bytes,
            max_receipt_bytes,
            report_interval_ms,
            completion_reports,
            answer_release,
            tools_list_limits,
            credential_cache_ms,
            request_hold,
            signature_validity_s,
            upgrade_routes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A service token of the length the ledger accepts.
    const SERVICE_TOKEN: &str = "svc-token-0123456789abcdef0123456789";

    fn minimal() -> Value {
        json!({
            "ledger": {"cluster": "atmost_ledger", "service_token": SERVICE_TOKEN},
            "upstream_key": {"secret": "0123456789abcdef0123"}
        })
    }

    fn config_from(v: &Value) -> Config {
        match Config::parse(v.to_string().as_bytes()) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    fn field_of(v: &Value) -> String {
        match Config::parse(v.to_string().as_bytes()) {
            Ok(_) => panic!("accepted {v}"),
            Err(e) => {
                assert!(e.to_string().contains(&e.field), "{e}");
                e.field
            }
        }
    }

    #[test]
    fn defaults() {
        let c = config_from(&minimal());
        assert_eq!(c.ledger.cluster, "atmost_ledger");
        assert_eq!(c.ledger.authority, "atmost-ledger");
        assert_eq!(c.ledger.timeout_ms, 1000);
        assert_eq!(c.permit_header, "atmost-permit");
        assert_eq!(c.governed_tools, ToolSet::All);
        assert_eq!(c.key_required_tools, ToolSet::Only(vec![]));
        assert_eq!(
            c.upstream_key,
            UpstreamKey::Hmac {
                secret: UpstreamSecret::new("0123456789abcdef0123".into()).unwrap()
            }
        );
        assert_eq!(c.denial_format, DenialFormat::Result);
        assert_eq!(c.max_body_bytes, 1_048_576);
        assert_eq!(c.max_receipt_bytes, 1_048_576);
        assert_eq!(c.report_interval_ms, 200);
        assert_eq!(c.completion_reports, CompletionReports::Batched);
        assert!(!c.tools_list_limits);
        assert_eq!(c.request_hold, RequestHold::Headers);
        assert_eq!(c.signature_validity_s, 15);
        assert_eq!(c.upgrade_routes, UpgradeRoutes::none());
    }

    #[test]
    fn upgrade_routes_names_the_routes_that_may_upgrade() {
        let mut v = minimal();
        v["upgrade_routes"] = json!(["chat-ws"]);
        let routes = config_from(&v).upgrade_routes;
        assert!(routes.allows(Some("chat-ws")) && !routes.allows(Some("mcp")));
        for (bad, field) in [
            (json!("chat-ws"), "upgrade_routes"),
            (json!(["chat-ws", ""]), "upgrade_routes[1]"),
            (json!(["default"]), "upgrade_routes[0]"),
        ] {
            v["upgrade_routes"] = bad;
            assert_eq!(field_of(&v), field);
        }
    }

    #[test]
    fn signature_validity_is_whole_seconds_up_to_the_ledgers_longest() {
        let mut v = minimal();
        for ok in [1, 15, 120, MAX_VALIDITY_S] {
            v["signature_validity_s"] = json!(ok);
            assert_eq!(config_from(&v).signature_validity_s, ok);
        }
        for bad in [
            json!(0),
            json!(MAX_VALIDITY_S + 1),
            json!(-1),
            json!(1.5),
            json!("15"),
            json!(null),
        ] {
            v["signature_validity_s"] = bad.clone();
            assert_eq!(field_of(&v), "signature_validity_s", "{bad}");
        }
    }

    #[test]
    fn credential_cache_ms_is_off_by_default_and_bounded() {
        let mut v = minimal();
        assert_eq!(config_from(&v).credential_cache_ms, 0);
        v["credential_cache_ms"] = json!(30_000);
        assert_eq!(config_from(&v).credential_cache_ms, 30_000);
        for bad in [json!(300_001), json!(-1), json!("10s"), json!(1.5)] {
            v["credential_cache_ms"] = bad.clone();
            let e = Config::parse(v.to_string().as_bytes());
            assert!(
                matches!(&e, Err(e) if e.to_string().contains("credential_cache_ms")),
                "{bad}: {e:?}"
            );
        }
    }

    #[test]
    fn tools_list_limits_is_a_boolean() {
        let mut v = minimal();
        v["tools_list_limits"] = json!(true);
        assert!(config_from(&v).tools_list_limits);
        v["tools_list_limits"] = json!(false);
        assert!(!config_from(&v).tools_list_limits);
        for bad in [json!("true"), json!(1), json!(null), json!({})] {
            v["tools_list_limits"] = bad.clone();
            assert_eq!(field_of(&v), "tools_list_limits", "{bad}");
        }
    }

    #[test]
    fn request_hold_modes() {
        let mut v = minimal();
        v["request_hold"] = json!("body");
        assert_eq!(config_from(&v).request_hold, RequestHold::Body);
        v["request_hold"] = json!("headers");
        assert_eq!(config_from(&v).request_hold, RequestHold::Headers);
    }

    #[test]
    fn secrets_can_come_from_the_vms_environment() {
        let env = |name: &str| match name {
            "ATMOST_SERVICE_TOKEN" => Some("svc-from-env-0123456789abcdef0123456789".to_string()),
            "ATMOST_UPSTREAM_KEY_SECRET" => Some("0123456789abcdef-from-env".to_string()),
            "EMPTY" => Some(String::new()),
            _ => None,
        };
        let parse = |v: &Value| Config::parse_with_env(v.to_string().as_bytes(), &env);
        let from_env = json!({
            "ledger": {"cluster": "c", "service_token_env": "ATMOST_SERVICE_TOKEN"},
            "upstream_key": {"secret_env": "ATMOST_UPSTREAM_KEY_SECRET"}
        });
        let c = parse(&from_env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            c.ledger.service_token,
            "svc-from-env-0123456789abcdef0123456789"
        );
        assert_eq!(
            c.upstream_key,
            UpstreamKey::Hmac {
                secret: UpstreamSecret::new("0123456789abcdef-from-env".into()).unwrap()
            }
        );
        let refused = |v: Value| match parse(&v) {
            Ok(_) => panic!("accepted {v}"),
            Err(e) => (e.field.clone(), e.to_string()),
        };
        let (field, text) = refused(json!({
            "ledger": {"cluster": "c", "service_token_env": "UNSET"},
            "upstream_key": {"mode": "off"}
        }));
        assert_eq!(field, "ledger.service_token_env");
        assert!(
            text.contains("UNSET") && text.contains("host_env_keys"),
            "{text}"
        );
        assert_eq!(
            refused(json!({
                "ledger": {"cluster": "c", "service_token_env": "EMPTY"},
                "upstream_key": {"mode": "off"}
            }))
            .0,
            "ledger.service_token_env"
        );
        assert_eq!(
            refused(json!({
                "ledger": {"cluster": "c", "service_token": SERVICE_TOKEN, "service_token_env": "ATMOST_SERVICE_TOKEN"},
                "upstream_key": {"mode": "off"}
            }))
            .0,
            "ledger.service_token"
        );
        assert_eq!(
            refused(json!({
                "ledger": {"cluster": "c", "service_token": SERVICE_TOKEN},
                "upstream_key": {"mode": "raw", "secret_env": "ATMOST_UPSTREAM_KEY_SECRET"}
            }))
            .0,
            "upstream_key.secret"
        );
        // The length rule holds for a secret from the environment too.
        let short = |name: &str| (name == "SHORT").then(|| "short".to_string());
        let r = Config::parse_with_env(
            json!({"ledger": {"cluster": "c", "service_token": SERVICE_TOKEN}, "upstream_key": {"secret_env": "SHORT"}})
                .to_string()
                .as_bytes(),
            &short,
        );
        assert_eq!(r.err().map(|e| e.field), Some("upstream_key.secret".into()));
    }

    #[test]
    fn a_service_token_the_ledger_would_refuse_is_refused_here() {
        let with_token = |token: &str| json!({"ledger": {"cluster": "c", "service_token": token}, "upstream_key": {"mode": "off"}});
        let shortest = "s".repeat(MIN_SERVICE_TOKEN_BYTES);
        let c = Config::parse(with_token(&shortest).to_string().as_bytes());
        assert_eq!(
            c.map(|c| c.ledger.service_token).ok(),
            Some(shortest.clone())
        );
        let one_short = &shortest[1..];
        let (field, text) = match Config::parse(with_token(one_short).to_string().as_bytes()) {
            Ok(_) => panic!("accepted a {}-byte token", one_short.len()),
            Err(e) => (e.field.clone(), e.to_string()),
        };
        assert_eq!(field, "ledger.service_token");
        assert!(
            text.contains("at least 32 bytes") && text.contains("this one has 31"),
            "{text}"
        );
        assert!(!text.contains(one_short), "the token is echoed: {text}");
        // From the VM's environment too.
        let env = |name: &str| (name == "SHORT").then(|| one_short.to_string());
        let r = Config::parse_with_env(
            json!({"ledger": {"cluster": "c", "service_token_env": "SHORT"}, "upstream_key": {"mode": "off"}})
                .to_string()
                .as_bytes(),
            &env,
        );
        assert_eq!(
            r.err().map(|e| e.field),
            Some("ledger.service_token".into())
        );
    }

    #[test]
    fn completion_reports_modes() {
        let mut v = minimal();
        v["completion_reports"] = json!("per_call");
        assert_eq!(
            config_from(&v).completion_reports,
            CompletionReports::PerCall
        );
        v["completion_reports"] = json!("batched");
        assert_eq!(
            config_from(&v).completion_reports,
            CompletionReports::Batched
        );
    }

    #[test]
    fn answer_release_modes() {
        let mut v = minimal();
        assert_eq!(config_from(&v).answer_release, AnswerRelease::AfterReceipt);
        for (name, mode) in ANSWER_RELEASE {
            v["answer_release"] = json!(name);
            assert_eq!(config_from(&v).answer_release, mode);
        }
        v["answer_release"] = json!("at_once");
        v["completion_reports"] = json!("per_call");
        let refused = Config::parse(v.to_string().as_bytes()).err();
        assert_eq!(
            refused.as_ref().map(|e| e.field.as_str()),
            Some("answer_release")
        );
        assert!(refused.is_some_and(|e| e.message.contains("completion_reports: batched")));
        v["answer_release"] = json!("sometimes");
        let refused = Config::parse(v.to_string().as_bytes()).err();
        assert_eq!(
            refused.map(|e| e.to_string()),
            Some("atmost: bad plugin configuration: field `answer_release`: must be one of `after_receipt`, `at_once`".into())
        );
    }

    #[test]
    fn full_example_parses() {
        let c = config_from(&json!({
          "ledger": {"cluster": "atmost_ledger", "authority": "ledger.local", "timeout_ms": 250, "service_token": SERVICE_TOKEN},
          "permit_header": "X-Agent-Permit",
          "governed_tools": ["pay_invoice", "send_email"],
          "key_required_tools": ["*"],
          "upstream_key": {"mode": "off"},
          "denial_format": "error",
          "max_body_bytes": 2048,
          "max_receipt_bytes": 4096,
          "report_interval_ms": 50
        }));
        assert_eq!(c.permit_header, "x-agent-permit");
        assert!(c.governed_tools.contains("pay_invoice"));
        assert!(!c.governed_tools.contains("search"));
        assert!(c.key_required_tools.contains("anything"));
        assert_eq!(c.upstream_key, UpstreamKey::Off);
        assert_eq!(c.denial_format, DenialFormat::Error);
        assert_eq!(c.ledger.timeout_ms, 250);
        let c = config_from(
            &json!({"ledger": {"cluster": "c", "service_token": SERVICE_TOKEN}, "upstream_key": {"mode": "raw"}}),
        );
        assert_eq!(c.upstream_key, UpstreamKey::Raw);
    }

    #[test]
    fn each_bad_field_is_named() {
        let with = |path: &[&str], v: Value| {
            let mut c = minimal();
            let mut cur = &mut c;
            for p in &path[..path.len() - 1] {
                cur = &mut cur[*p];
            }
            if let Some(obj) = cur.as_object_mut() {
                if v.is_null() {
                    obj.remove(path[path.len() - 1]);
                } else {
                    obj.insert(path[path.len() - 1].to_string(), v);
                }
            }
            c
        };
        let cases: Vec<(Value, &str)> = vec![
            (with(&["ledger"], Value::Null), "ledger"),
            (with(&["ledger"], json!("x")), "ledger"),
            (with(&["ledger", "cluster"], Value::Null), "ledger.cluster"),
            (with(&["ledger", "cluster"], json!("")), "ledger.cluster"),
            (with(&["ledger", "cluster"], json!(3)), "ledger.cluster"),
            (
                with(&["ledger", "service_token"], Value::Null),
                "ledger.service_token",
            ),
            (
                with(&["ledger", "service_token"], json!("a\nb")),
                "ledger.service_token",
            ),
            (
                with(&["ledger", "timeout_ms"], json!(0)),
                "ledger.timeout_ms",
            ),
            (
                with(&["ledger", "timeout_ms"], json!("1000")),
                "ledger.timeout_ms",
            ),
            (
                with(&["ledger", "authority"], json!("")),
                "ledger.authority",
            ),
            (with(&["ledger", "clustr"], json!("x")), "ledger.clustr"),
            (
                with(&["permit_header"], json!("authorization")),
                "permit_header",
            ),
            (
                with(&["permit_header"], json!("bad header")),
                "permit_header",
            ),
            (
                with(&["permit_header"], json!("Idempotency_Key")),
                "permit_header",
            ),
            (
                with(&["permit_header"], json!("last-event-id")),
                "permit_header",
            ),
            (
                with(&["permit_header"], json!("content_encoding")),
                "permit_header",
            ),
            (
                with(&["permit_header"], json!("Signature_Input")),
                "permit_header",
            ),
            (
                with(&["permit_header"], json!("signature")),
                "permit_header",
            ),
            (with(&["permit_header"], json!(1)), "permit_header"),
            (with(&["governed_tools"], json!([])), "governed_tools"),
            (with(&["governed_tools"], json!("*")), "governed_tools"),
            (
                with(&["governed_tools"], json!(["a", 1])),
                "governed_tools[1]",
            ),
            (
                with(&["key_required_tools"], json!([""])),
                "key_required_tools[0]",
            ),
            (with(&["upstream_key"], Value::Null), "upstream_key.secret"),
            (
                with(&["upstream_key", "secret"], Value::Null),
                "upstream_key.secret",
            ),
            (
                with(&["upstream_key", "secret"], json!("short")),
                "upstream_key.secret",
            ),
            (
                with(&["upstream_key", "mode"], json!("plain")),
                "upstream_key.mode",
            ),
            (
                with(&["upstream_key", "mode"], json!("raw")),
                "upstream_key.secret",
            ),
            (
                with(&["upstream_key", "sekret"], json!("x")),
                "upstream_key.sekret",
            ),
            (with(&["denial_format"], json!("text")), "denial_format"),
            (
                with(&["completion_reports"], json!("sometimes")),
                "completion_reports",
            ),
            (
                with(&["completion_reports"], json!(true)),
                "completion_reports",
            ),
            (with(&["answer_release"], json!("later")), "answer_release"),
            (with(&["answer_release"], json!(false)), "answer_release"),
            (with(&["request_hold"], json!("none")), "request_hold"),
            (with(&["request_hold"], json!(1)), "request_hold"),
            (with(&["max_body_bytes"], json!(0)), "max_body_bytes"),
            (with(&["max_body_bytes"], json!(-1)), "max_body_bytes"),
            (
                with(&["max_receipt_bytes"], json!(1.5)),
                "max_receipt_bytes",
            ),
            (
                with(&["max_receipt_bytes"], json!(MAX_MAX_BYTES + 1)),
                "max_receipt_bytes",
            ),
            (
                with(&["report_interval_ms"], json!(1)),
                "report_interval_ms",
            ),
            (with(&["governd_tools"], json!(["*"])), "governd_tools"),
        ];
        for (cfg, field) in cases {
            assert_eq!(field_of(&cfg), field, "{cfg}");
        }
    }

    #[test]
    fn not_json_or_not_object_or_empty() {
        assert!(Config::parse(b"").is_err());
        assert!(Config::parse(b"  ").is_err());
        assert!(Config::parse(b"{").is_err());
        assert!(Config::parse(b"[]").is_err());
    }

    #[test]
    fn errors_never_echo_secrets() {
        let mut a = minimal();
        a["upstream_key"]["secret"] = json!("zqzqsecret");
        let mut b = minimal();
        b["ledger"]["service_token"] = json!("zqzq\u{7f}bad");
        let mut c = minimal();
        c["ledger"]["service_token"] = json!(987654321);
        for v in [a, b, c] {
            let e = Config::parse(v.to_string().as_bytes())
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(!e.is_empty());
            assert!(!e.contains("zqzq") && !e.contains("987654321"), "{e}");
        }
    }
}
