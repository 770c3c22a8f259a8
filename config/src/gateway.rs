//! The gateway's configuration (`role: "gateway"`, the default): what the filter asks the
//! ledger with and how it treats a governed call.

use serde_json::Value;

use crate::bounds::*;
use crate::choices::UpstreamKeyMode;
use crate::choices::{AnswerRelease, CompletionReports, DenialFormat, RequestHold, Role};
use crate::reader::{err, is_token_char, json_object, printable_ascii, ConfigError, Obj, ToolSet};
use crate::upgrade::UpgradeRoutes;
use crate::upstream_secret::UpstreamSecret;

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
    /// `report_ride_ms` (integer, default 0, 0..=5000): with `answer_release: at_once`, how
    /// long a released call's report may wait to ride on the worker's next authorize callout
    /// (at most 16 on one) instead of a callout of its own. One still waiting then leaves
    /// with the next batch, on the first tick after (so at most this plus
    /// `report_interval_ms`); a report whose authorize is not answered, or is answered without
    /// its acks, goes in a batch as well. 0: reports do not ride. The longer a report waits,
    /// the longer its attempt stays `in_flight` (docs/design.md#reports-riding-on-the-next-authorize).
    /// Needs `answer_release: at_once`.
    pub report_ride_ms: u64,
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
    /// `approval_hold_ms` (integer, default 0, 0..=240000): a call the ledger answers
    /// `approval_required` is held open for up to this many milliseconds from that first
    /// answer, the ledger asked again each `retry_after` (1 to 5 s), so that an agent that
    /// does not retry still gets through a quick approval: dispatched once a person approves,
    /// or the ledger's other answer, or at the bound the last `approval_required`. 0: the
    /// denial is answered at once. Needs `report_interval_ms` at most 1000 (the root's tick
    /// re-asks).
    pub approval_hold_ms: u64,
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
        if top.choice::<Role>("role")? == Role::Verify {
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
            "report_ride_ms",
            "tools_list_limits",
            "credential_cache_ms",
            "request_hold",
            "signature_validity_s",
            "upgrade_routes",
            "approval_hold_ms",
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
                let mode = uk.choice::<UpstreamKeyMode>("mode")?;
                let has_secret = uk.map.contains_key("secret") || uk.map.contains_key("secret_env");
                match mode {
                    UpstreamKeyMode::Hmac => {
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
                    UpstreamKeyMode::Raw | UpstreamKeyMode::Off if has_secret => {
                        return Err(err(
                            "upstream_key.secret",
                            format!("is only used with mode `hmac`, not `{mode}`: remove it"),
                        ))
                    }
                    UpstreamKeyMode::Raw => UpstreamKey::Raw,
                    UpstreamKeyMode::Off => UpstreamKey::Off,
                }
            }
        };

        let denial_format = top.choice::<DenialFormat>("denial_format")?;
        let max_body_bytes = top.integer("max_body_bytes", DEFAULT_MAX_BYTES, 1, MAX_MAX_BYTES)?;
        let max_receipt_bytes =
            top.integer("max_receipt_bytes", DEFAULT_MAX_BYTES, 1, MAX_MAX_BYTES)?;
        let report_interval_ms =
            top.integer("report_interval_ms", DEFAULT_REPORT_INTERVAL_MS, 10, 60_000)?;
        let completion_reports = top.choice::<CompletionReports>("completion_reports")?;
        let answer_release = top.choice::<AnswerRelease>("answer_release")?;
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
        let report_ride_ms = top.integer("report_ride_ms", 0, 0, MAX_REPORT_RIDE_MS)?;
        if report_ride_ms > 0 && answer_release != AnswerRelease::AtOnce {
            // A held answer waits for its report: one that waited for the next call would
            // hold the answer until then.
            return Err(err(
                "report_ride_ms",
                "needs `answer_release: at_once` (only a released call's report can wait for the next call)",
            ));
        }
        let tools_list_limits = top.boolean("tools_list_limits", false)?;
        let credential_cache_ms =
            top.integer("credential_cache_ms", 0, 0, MAX_CREDENTIAL_CACHE_MS)?;
        let request_hold = top.choice::<RequestHold>("request_hold")?;
        let signature_validity_s = top.integer(
            "signature_validity_s",
            DEFAULT_SIGNATURE_VALIDITY_S,
            1,
            MAX_VALIDITY_S,
        )?;
        let upgrade_routes = crate::upgrade::parse(&top)?;
        let approval_hold_ms = top.integer("approval_hold_ms", 0, 0, MAX_APPROVAL_HOLD_MS)?;
        if approval_hold_ms > 0 && report_interval_ms > MAX_HOLD_TICK_MS {
            // Held calls are asked again on the root's tick: a slower tick would leave an
            // approved call waiting for most of it.
            return Err(err(
                "approval_hold_ms",
                format!("needs `report_interval_ms` at most {MAX_HOLD_TICK_MS} (the tick that asks the ledger again for held calls); it is {report_interval_ms}"),
            ));
        }

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
            report_ride_ms,
            tools_list_limits,
            credential_cache_ms,
            request_hold,
            signature_validity_s,
            upgrade_routes,
            approval_hold_ms,
        })
    }
}
