//! Wire types spoken between the atmost filter (inside Envoy) and the atmost ledger.
//!
//! Both sides compile this crate, so a field renamed here is renamed on both ends.
//! Every body is JSON. Paths:
//! - `POST /v1/authorize`: [`AuthorizeRequest`] → [`AuthorizeResponse`] (written as an
//!   [`AuthorizeAnswer`] when the request carried reports)
//! - `POST /v1/outcomes`: [`OutcomesRequest`] → [`OutcomesResponse`]
//! - `POST /v1/limits`: [`LimitsRequest`] → [`LimitsResponse`]
//! - `POST /v1/credential`: [`credential::CredentialRequest`] →
//!   [`credential::CredentialResponse`]
//!
//! An answer that is not a success is `{"error": CODE}`, CODE one of
//! [`ledger_error::LedgerErrorCode`], each sent with its own status.
//!
//! Every path requires `authorization: Bearer <service token>`. A report also needs the
//! round's capability from the Dispatch answer: the service token alone (which an agent
//! sharing the sidecar's loopback can read) cannot move an attempt.

pub mod closed_set;
pub mod credential;
pub mod idempotency_key;
pub mod ledger_error;
pub mod signature;
pub mod token;
pub mod tool_refusal;

use serde::{Deserialize, Serialize};

/// serde, for the code [`closed_set!`] writes in other crates.
#[doc(hidden)]
pub use serde as __serde;
use serde_json::{Map, Value};

/// Path of the authorize call.
pub const AUTHORIZE_PATH: &str = "/v1/authorize";
/// Path of the outcome reports.
pub const OUTCOMES_PATH: &str = "/v1/outcomes";
/// Path of the per-tool figures of a permit (for `tools/list`).
pub const LIMITS_PATH: &str = "/v1/limits";
/// Request header of every callout: the filter's `ledger.timeout_ms`, in decimal
/// milliseconds, how long the filter waits for this answer. The ledger decides an authorize
/// only while its caller still waits: a decision whose caller has given up is not committed
/// (answered 503). A ledger that does not know the header ignores it; without it, the ledger
/// assumes its `--callout-timeout`.
pub const CALLOUT_TIMEOUT_HEADER: &str = "atmost-callout-timeout-ms";
/// The header a governed call carries to its tool: the key the agent sent, or the one the
/// filter derived (`upstream_key`), as Envoy stores header names (lowercase). The filter sets
/// or removes it, the verifier reads it into what it checks, and no credential may claim it.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
/// Shortest service token, in bytes, that either side accepts: the ledger refuses to start
/// with a shorter `--service-token` (or `--admin-token`), and the filter refuses a
/// configuration whose `ledger.service_token` is shorter, which could never be accepted.
/// 32 random bytes (`openssl rand -hex 32` prints 64 characters) are out of any guesser's reach.
pub const MIN_SERVICE_TOKEN_BYTES: usize = 32;
/// Most tools one [`LimitsRequest`] may name.
pub const MAX_LIMITS_TOOLS: usize = 1000;
/// Most outcome reports one [`AuthorizeRequest`] may carry ([`AuthorizeRequest::reports`]):
/// a decision waits for the reports that ride with it, so their number is kept small.
pub const MAX_RIDING_REPORTS: usize = 16;
/// Most bytes of receipts the reports of one [`OutcomesRequest`] from the filter carry
/// together (a single larger report still goes, alone): half the ledger's body limit (8 MiB),
/// so that a batch of reports is never refused for its size, and never blocks those behind it.
pub const MAX_BATCH_RECEIPT_BYTES: usize = 4 << 20;
/// Most bytes of receipts the reports riding on one [`AuthorizeRequest`] carry together: with
/// the call's own arguments the request stays well under the ledger's body limit (8 MiB), so
/// riders can never be why a call's authorize is refused. A report whose receipt alone is
/// larger does not ride.
pub const MAX_RIDING_RECEIPT_BYTES: usize = 1 << 20;

/// The filter asks whether one `tools/call` may go upstream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuthorizeRequest {
    /// The secret permit token exactly as the agent presented it.
    pub permit_token: String,
    /// `params.name` of the call.
    pub tool: String,
    /// The client's idempotency key, if it sent one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Lowercase hex SHA-256 of the RFC 8785 form of `{"tool", "arguments"}`.
    pub fingerprint: String,
    /// `params.arguments`, so the ledger can apply the permit's cost rule.
    #[serde(default)]
    pub arguments: Value,
    /// The gateway config requires a key for this tool.
    #[serde(default)]
    pub key_required: bool,
    /// MCP 2026-07-28 multi-round-trip: this `tools/call` is the retry of a call that
    /// answered `input_required` (its params carry `inputResponses` or `requestState`).
    /// With the same key and fingerprint as an `awaiting_input` attempt it dispatches again
    /// under that attempt: no second slot, no second budget.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub continuation: bool,
    /// The key's value the upstream receives if this call is dispatched (in the carriers
    /// [`forwarded_key_carriers`](Self::forwarded_key_carriers) names), in the gateway's
    /// `upstream_key` form (the HMAC-derived value by default, the raw key, or none
    /// when the mode is `off` or the call has no key). The ledger keeps it with the attempt
    /// so an operator or a reconciler can look the call up at the provider. It is the
    /// filter's statement, for lookups only: the ledger cannot check it and decides nothing
    /// on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forwarded_key: Option<String>,
    /// Where the upstream receives [`forwarded_key`](Self::forwarded_key) if this call is
    /// dispatched: the carriers of the request as it leaves the gateway, not those the client
    /// used. Empty when the key reaches the upstream nowhere (no key, `upstream_key.mode:
    /// off`) and also when the filter does not say (a filter older than this field): the
    /// ledger cannot tell the two apart and takes both as "the key reached no carrier",
    /// never as the header, so nothing is looked up by a form the upstream may not have seen.
    #[serde(default, skip_serializing_if = "KeyCarriers::is_empty")]
    pub forwarded_key_carriers: KeyCarriers,
    /// The request as it will go upstream if dispatched: with it the ledger signs the
    /// dispatch ([`signature`]), and refuses to dispatch unsigned. Absent when the filter
    /// sends no signature (`request_hold: body`, where the headers leave first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<signature::DispatchTarget>,
    /// Reports about earlier calls that ride on this one (`report_ride_ms`,
    /// docs/design.md#reports-riding-on-the-next-authorize), at most
    /// [`MAX_RIDING_REPORTS`] (the filter keeps them to [`MAX_RIDING_RECEIPT_BYTES`]): applied as a `POST /v1/outcomes` would apply them, and
    /// acknowledged in [`AuthorizeAnswer::report_acks`]. They change nothing of this call's
    /// decision, and a decision is answered even when they could not be applied, or not
    /// within the decision's deadline (then the answer has no acks, and the filter sends them
    /// again in a batch of their own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reports: Vec<OutcomeReport>,
}

/// Adds `reports` to the JSON text of an [`AuthorizeRequest`] that carries none (as
/// [`AuthorizeRequest::reports`]): the filter writes a call's request once, and the reports
/// that ride on it are known only when its callout leaves. Answers `false`, changing nothing,
/// when there is nothing to add or the text is not a JSON object with members.
pub fn add_riding_reports(request: &mut Vec<u8>, reports: &[OutcomeReport]) -> bool {
    let object =
        request.len() > 2 && request.first() == Some(&b'{') && request.last() == Some(&b'}');
    if reports.is_empty() || !object {
        return false;
    }
    let Ok(list) = serde_json::to_vec(reports) else {
        return false;
    };
    request.pop();
    request.extend_from_slice(b",\"reports\":");
    request.extend_from_slice(&list);
    request.push(b'}');
    true
}

/// The ledger's answer to an [`AuthorizeRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum AuthorizeResponse {
    /// A slot and the budget are reserved (or, for a continuation, still held by the same
    /// attempt): send the call upstream.
    Dispatch {
        attempt_id: String,
        permit_id: String,
        /// How long the ledger waits for an outcome before the attempt turns `uncertain`.
        lease_ms: u64,
        /// Which dispatch of the attempt this is: 1 for the call itself, one more for each
        /// `input_required` continuation. Every report about it names this round.
        round: u32,
        /// A fresh secret for this round alone. The ledger keeps only its SHA-256 and
        /// accepts a report about the round only with it, so a holder of the service token
        /// cannot speak for a dispatch it did not receive. It never leaves the Envoy process.
        capability: String,
        /// What the permit still allows for the tool, this dispatch counted.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limits: Option<PermitLimits>,
        /// The ledger's signature over [`AuthorizeRequest::dispatch`]; present exactly when
        /// the request named one. The filter sends nothing upstream without it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signature: Option<signature::DispatchSignature>,
        /// The credential of the permit (its newest version) the filter sets on this call,
        /// in place of whatever the agent sent under its header; absent when the permit names
        /// none. Only a Dispatch carries one: a replay or a denial sends nothing upstream.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        credential: Option<credential::UpstreamCredential>,
    },
    /// The same key and fingerprint completed before: answer with this receipt.
    Replay {
        attempt_id: String,
        /// The upstream's JSON-RPC response, verbatim.
        receipt: String,
        /// What the permit still allows for the tool (a replay takes nothing).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limits: Option<PermitLimits>,
    },
    /// Refused; nothing may go upstream.
    Deny(Denial),
}

/// The authorize answer as the ledger writes it: the decision, and the acks of the reports
/// that rode on the request, one per report in order. Without reports it is written exactly
/// as the bare [`AuthorizeResponse`]. An answer to a request that carried reports and has no
/// `report_acks` means they were not applied (or the ledger is older than the field); they
/// must go again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuthorizeAnswer {
    #[serde(flatten)]
    pub decision: AuthorizeResponse,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report_acks: Option<Vec<OutcomeAck>>,
}

/// A refusal with a stable code and the data a caller needs to act on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Denial {
    pub code: DenialCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub data: Map<String, Value>,
    /// What the permit still allows for the tool; `None` when no permit was authenticated
    /// (or the denial is the filter's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<PermitLimits>,
}

impl Denial {
    pub fn new(code: DenialCode, message: impl Into<String>) -> Self {
        Denial {
            code,
            message: message.into(),
            data: Map::new(),
            limits: None,
        }
    }

    /// Adds one field of `data`.
    pub fn with(mut self, field: &str, value: impl Into<Value>) -> Self {
        self.data.insert(field.to_string(), value.into());
        self
    }
}

/// What a permit still allows for one tool, as the agent sees it in
/// `_meta["dev.atmost/permit"]` and in the `atmost-*` response headers.
///
/// The fields are declared in key order, the order a `serde_json` object writes its members
/// in: the filter writes this struct straight into an answer's text, and that text must be
/// the same, byte for byte, as the one of the JSON value it puts in the answers it builds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitLimits {
    /// Budget left in minor units (budget minus spent and reserved); `None` (`null`) when
    /// the permit has no budget.
    pub budget_left: Option<u64>,
    /// New calls of the tool the permit still allows: its cap minus the slots held; 0 when
    /// the tool is outside the permit's scope or the permit has expired; `None` (JSON
    /// `null`) when the tool has no cap.
    pub calls_left: Option<u64>,
    /// When the permit expires, RFC 3339 (UTC).
    pub expires_at: String,
}

impl PermitLimits {
    /// The figures of a permit that expires at `expires_at` (RFC 3339) and has neither a cap
    /// nor a budget; the `with_` methods set what is left.
    pub fn until(expires_at: impl Into<String>) -> PermitLimits {
        PermitLimits {
            budget_left: None,
            calls_left: None,
            expires_at: expires_at.into(),
        }
    }

    /// The same figures with `calls_left` calls left (`None`: no cap).
    pub fn with_calls_left(mut self, calls_left: Option<u64>) -> PermitLimits {
        self.calls_left = calls_left;
        self
    }

    /// The same figures with `budget_left` left of the budget (`None`: no budget).
    pub fn with_budget_left(mut self, budget_left: Option<u64>) -> PermitLimits {
        self.budget_left = budget_left;
        self
    }
}

/// Body of `POST /v1/limits`: the figures of a permit for the tools a `tools/list` answer
/// names (at most [`MAX_LIMITS_TOOLS`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitsRequest {
    /// The secret permit token exactly as the agent presented it.
    pub permit_token: String,
    pub tools: Vec<String>,
}

/// The ledger's answer to a [`LimitsRequest`] whose token authenticates: the figures of each
/// tool asked about. A token that does not authenticate (unknown, wrong secret, revoked) is
/// answered HTTP 403 with `{"error": "permit_invalid"}` instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitsResponse {
    pub tools: std::collections::BTreeMap<String, PermitLimits>,
}

closed_set! {
    /// Every reason atmost refuses a call: its wire name (the `code` of every denial, the
    /// `atmost-denial` header, the filter's `atmost_denied_<name>` counter) and the JSON-RPC
    /// error code used when the gateway answers with error objects. Application codes sit
    /// outside -32768..-32000, which JSON-RPC and MCP reserve. The README's error table lists
    /// each row (a test holds them together).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum DenialCode: json_rpc_code -> i64 {
        PermitInvalid => "permit_invalid", -31001;
        PermitExpired => "permit_expired", -31002;
        PermitToolNotAllowed => "permit_tool_not_allowed", -31003;
        PermitMaxCallsExceeded => "permit_max_calls_exceeded", -31004;
        PermitBudgetExceeded => "permit_budget_exceeded", -31005;
        DuplicateRequestSuspected => "duplicate_request_suspected", -31006;
        IdempotencyKeyRequired => "idempotency_key_required", -31007;
        IdempotencyKeyConflict => "idempotency_key_conflict", -31008;
        IdempotencyInProgress => "idempotency_in_progress", -31009;
        DeliveryUncertain => "delivery_uncertain", -31010;
        IdempotencyKeyExpired => "idempotency_key_expired", -31011;
        GatewayUnavailable => "gateway_unavailable", -31012;
        InvalidIdempotencyKey => "invalid_idempotency_key", -31013;
        /// The permit asks a person to approve this call: its slot and cost are held, nothing
        /// was sent; the same key again after the approval dispatches it (docs/approvals.md).
        ApprovalRequired => "approval_required", -31014;
        /// A person rejected the call this key asked for; its slot and cost went back.
        ApprovalRejected => "approval_rejected", -31015;
        /// Nobody decided in time, or an approval was not used in time; slot and cost back.
        ApprovalExpired => "approval_expired", -31016;
        // The verifier at the tool (`role: "verify"`, docs/signatures.md): a governed call
        // without a valid, fresh, unseen dispatch signature. Numbered from -31020 on.
        /// No `atmost` signature (`Signature-Input` / `Signature` member).
        SignatureMissing => "signature_missing", -31020;
        /// The signature's headers or parameters are not the form the ledger writes.
        SignatureMalformed => "signature_malformed", -31021;
        /// `keyid` names no key the verifier knows, even after asking for the key set again.
        SignatureKeyUnknown => "signature_key_unknown", -31022;
        /// `created` is in the future or `expires` in the past, beyond the allowed skew.
        SignatureOutsideValidity => "signature_outside_validity", -31023;
        /// `Content-Digest` is not the SHA-256 of the body received.
        ContentDigestMismatch => "content_digest_mismatch", -31024;
        /// The Ed25519 signature does not verify over this request, or its nonce names
        /// another tool than the body's `params.name`.
        SignatureInvalid => "signature_invalid", -31025;
        /// A signature already accepted (its nonce is in the replay cache).
        SignatureReplayed => "signature_replayed", -31026;
        /// The replay cache could not record the nonce (full of unexpired entries, or
        /// contended): refused rather than accepted unrecorded.
        ReplayCacheUnavailable => "replay_cache_unavailable", -31027;
    }
}

closed_set! {
    /// A place in a `tools/call` request that carries the idempotency key (the header, or a
    /// member of the body's `params`). Each has its bit in a [`KeyCarriers`] set.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
    pub enum KeyCarrier: bit -> u8 {
        /// The `Idempotency-Key` header.
        Header => "header", 1;
        /// `params._meta["dev.atmost/idempotency-key"]`.
        Meta => "params._meta", 2;
        /// `params.idempotencyKey`.
        IdempotencyKeyParam => "params.idempotencyKey", 4;
    }
}

/// A set of [`KeyCarrier`]s, on the wire a JSON array of their names in table order
/// (`["header", "params._meta"]`). Reading one, a repeated name counts once and an unknown
/// name is refused.
#[derive(Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct KeyCarriers(u8);

impl std::fmt::Debug for KeyCarriers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl KeyCarriers {
    /// No carrier.
    pub const NONE: KeyCarriers = KeyCarriers(0);

    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    pub fn contains(&self, carrier: KeyCarrier) -> bool {
        self.0 & carrier.bit() != 0
    }

    /// This set and `carrier`.
    #[must_use]
    pub fn with(self, carrier: KeyCarrier) -> KeyCarriers {
        KeyCarriers(self.0 | carrier.bit())
    }

    /// The carriers, in table order.
    pub fn iter(&self) -> impl Iterator<Item = KeyCarrier> + '_ {
        KeyCarrier::ALL.into_iter().filter(|c| self.contains(*c))
    }

    /// The names joined by `,` in table order (`""` when empty): how a store keeps the set in
    /// one text column. No name holds a comma.
    pub fn to_list(&self) -> String {
        self.iter()
            .map(KeyCarrier::as_str)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The inverse of [`to_list`](Self::to_list); `Err` names the first unknown name.
    pub fn from_list(list: &str) -> Result<KeyCarriers, String> {
        list.split(',')
            .filter(|name| !name.is_empty())
            .try_fold(KeyCarriers::NONE, |set, name| {
                KeyCarrier::from_wire(name)
                    .map(|c| set.with(c))
                    .ok_or_else(|| format!("unknown key carrier {name:?}"))
            })
    }
}

impl FromIterator<KeyCarrier> for KeyCarriers {
    fn from_iter<I: IntoIterator<Item = KeyCarrier>>(iter: I) -> Self {
        iter.into_iter().fold(KeyCarriers::NONE, KeyCarriers::with)
    }
}

impl Serialize for KeyCarriers {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for KeyCarriers {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(Vec::<KeyCarrier>::deserialize(deserializer)?
            .into_iter()
            .collect())
    }
}

/// What became of a dispatched attempt, as the filter saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// The upstream answered the call; `receipt` is its JSON-RPC response, verbatim.
    Completed { receipt: String },
    /// Envoy proves the request never reached the upstream: slot and budget come back.
    Released { reason: String },
    /// Sent, and the outcome is unknown: slot and budget stay taken until someone resolves it.
    Uncertain { reason: String },
    /// MCP 2026-07-28: the upstream answered `resultType: "input_required"`. The attempt
    /// keeps its slot and budget and waits (`awaiting_input`, lease renewed) for the
    /// client's continuation under the same key. `receipt` is that interim response.
    InputRequired { receipt: String },
    /// The upstream accepted the call as a task (`CreateTaskResult`): a receipt of
    /// acceptance, not of completion. `receipt` is the response holding the task handle;
    /// replays return it.
    Accepted { receipt: String },
    /// A verifier at the tool refused the dispatch (docs/signatures.md, "A refusal at the
    /// tool"): `refusal` is its `atmost-tool-refusal` header as the gateway received it. The
    /// ledger gives the slot back only when the refusal's HMAC verifies with a key it trusts,
    /// names this round's nonce and says the tool did not run it; otherwise the attempt
    /// turns `uncertain`.
    RefusedAtTool {
        refusal: String,
        /// Set by the ledger once it checked the HMAC against its refusal keys; never read
        /// from the wire, so no report can claim it.
        #[serde(skip)]
        mac_verified: bool,
    },
}

impl Outcome {
    /// The receipt the outcome carries (`completed`, `input_required`, `accepted`).
    pub fn receipt(&self) -> Option<&str> {
        match self {
            Outcome::Completed { receipt }
            | Outcome::InputRequired { receipt }
            | Outcome::Accepted { receipt } => Some(receipt),
            Outcome::Released { .. }
            | Outcome::Uncertain { .. }
            | Outcome::RefusedAtTool { .. } => None,
        }
    }

    /// The report's `outcome` tag (the `kind` label of the ledger's outcome counters).
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Completed { .. } => "completed",
            Outcome::Released { .. } => "released",
            Outcome::Uncertain { .. } => "uncertain",
            Outcome::InputRequired { .. } => "input_required",
            Outcome::Accepted { .. } => "accepted",
            Outcome::RefusedAtTool { .. } => "refused_at_tool",
        }
    }
}

/// One outcome for one round of one attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutcomeReport {
    pub attempt_id: String,
    /// The round the [`AuthorizeResponse::Dispatch`] answer named.
    pub round: u32,
    /// The capability that answer carried.
    pub capability: String,
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// What the filter must keep of a Dispatch answer to report on it later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchGrant {
    pub attempt_id: String,
    pub round: u32,
    pub capability: String,
}

impl DispatchGrant {
    /// A report about this round.
    pub fn report(&self, outcome: Outcome) -> OutcomeReport {
        OutcomeReport {
            attempt_id: self.attempt_id.clone(),
            round: self.round,
            capability: self.capability.clone(),
            outcome,
        }
    }
}

/// Body of `POST /v1/outcomes`: one or more reports, applied one by one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutcomesRequest {
    pub reports: Vec<OutcomeReport>,
}

closed_set! {
    /// How the ledger took one report (the `ack` label of the ledger's outcome counter too).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum OutcomeAck {
        /// The attempt moved from `in_flight` to the reported state.
        Applied => "applied";
        /// The attempt was already in that state (a repeated report).
        AlreadyRecorded => "already_recorded";
        /// The attempt is in another terminal state (for example swept to `uncertain`); nothing
        /// changed.
        Conflict => "conflict";
        /// No attempt has that id.
        UnknownAttempt => "unknown_attempt";
        /// The report is about an earlier round than the attempt's current one; nothing changed.
        StaleRound => "stale_round";
        /// The report's capability does not prove the round (or the round was never
        /// dispatched); nothing changed, and the refusal is counted.
        Refused => "refused";
    }
}

/// Answer of `POST /v1/outcomes`, one ack per report in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutcomesResponse {
    pub acks: Vec<OutcomeAck>,
}

#[cfg(test)]
mod tests;
