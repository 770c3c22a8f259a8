//! Talking to the ledger: callout headers, and reading its answers. A failed or timed-out
//! callout arrives with zero headers; that, a non-200 `:status`, or a body that is not the
//! expected JSON are all failures (the authorize caller then fails closed). A non-200 answer
//! is known by the `error` code its body names (the ledger's closed set), its status standing
//! in only for a body that names none this filter knows.

use atmost_config::LedgerConfig;
use atmost_protocol::credential::{CredentialRequest, CredentialResponse, UpstreamCredential};
use atmost_protocol::ledger_error::LedgerErrorCode;
use atmost_protocol::signature::DispatchSignature;
use atmost_protocol::{
    AuthorizeResponse, DispatchGrant, LimitsRequest, LimitsResponse, OutcomeAck, OutcomeReport,
    OutcomesRequest, OutcomesResponse, PermitLimits,
};
use serde::Deserialize;
use std::fmt;

/// Which ledger endpoint a callout goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Authorize,
    Outcomes,
    Limits,
    Credential,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Authorize => atmost_protocol::AUTHORIZE_PATH,
            Endpoint::Outcomes => atmost_protocol::OUTCOMES_PATH,
            Endpoint::Limits => atmost_protocol::LIMITS_PATH,
            Endpoint::Credential => atmost_protocol::credential::CREDENTIAL_PATH,
        }
    }
}

/// One callout to make.
#[derive(Debug, Clone, PartialEq)]
pub struct Callout {
    pub endpoint: Endpoint,
    pub body: Vec<u8>,
}

impl Callout {
    /// This callout's body with `reports` riding on it, when it is an authorize (whose
    /// request the machine writes without reports); `None` when it is not, or nothing rides.
    pub fn with_riders(&self, reports: &[OutcomeReport]) -> Option<Vec<u8>> {
        if self.endpoint != Endpoint::Authorize || reports.is_empty() {
            return None;
        }
        let mut body = self.body.clone();
        atmost_protocol::add_riding_reports(&mut body, reports).then_some(body)
    }

    /// A `POST /v1/outcomes` carrying `request`.
    pub fn outcomes(request: &OutcomesRequest) -> Callout {
        Callout {
            endpoint: Endpoint::Outcomes,
            body: serde_json::to_vec(request).unwrap_or_default(),
        }
    }

    /// A `POST /v1/limits` carrying `request`.
    pub fn limits(request: &LimitsRequest) -> Callout {
        Callout {
            endpoint: Endpoint::Limits,
            body: serde_json::to_vec(request).unwrap_or_default(),
        }
    }

    /// A `POST /v1/credential` for the permit `permit_token` names.
    pub fn credential(permit_token: &str) -> Callout {
        let request = CredentialRequest {
            permit_token: permit_token.to_string(),
        };
        Callout {
            endpoint: Endpoint::Credential,
            body: serde_json::to_vec(&request).unwrap_or_default(),
        }
    }
}

/// The callout's request headers.
pub fn headers(cfg: &LedgerConfig, endpoint: Endpoint) -> Vec<(String, String)> {
    vec![
        (":method".into(), "POST".into()),
        (":path".into(), endpoint.path().into()),
        (":authority".into(), cfg.authority.clone()),
        ("content-type".into(), "application/json".into()),
        (
            "authorization".into(),
            format!("Bearer {}", cfg.service_token),
        ),
        // The ledger commits no decision after this much time (see the protocol's docs).
        (
            atmost_protocol::CALLOUT_TIMEOUT_HEADER.into(),
            cfg.timeout_ms.to_string(),
        ),
    ]
}

/// Why a callout brought back no usable answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutError {
    /// Zero headers or no `:status`: dispatch refused, reset, timed out.
    Unreachable,
    /// Answered, not HTTP 200, with a body naming what went wrong.
    Refused { status: u32, code: LedgerErrorCode },
    /// Answered, not HTTP 200, with a body that names no code this filter knows (a ledger of
    /// another version, or a proxy in front of it): the status is all there is to go on.
    Status(u32),
    /// HTTP 200 with a body that is not the endpoint's answer.
    Unreadable(Endpoint),
    /// An authorize answer that is a Dispatch whose attempt, round and capability read, but
    /// not the rest (a signature of another shape, say): the call is not sent, and the round
    /// can still be reported never sent.
    UnreadableDispatch(Box<DispatchGrant>),
    /// An outcomes answer with a different number of acks than reports sent.
    AckCount { acked: usize, sent: usize },
    /// The host refused to dispatch the callout.
    NotDispatched,
    /// The callout was given up on after its answer never came.
    NoAnswer,
}

impl fmt::Display for CalloutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CalloutError::Unreachable => f.write_str("ledger unreachable or timed out"),
            CalloutError::Refused { status, code } => {
                // The name, not the code's Display: a formatter of its own costs the module.
                write!(f, "ledger answered HTTP {status} {}", code.as_str())
            }
            CalloutError::Status(s) => write!(f, "ledger answered HTTP {s}"),
            CalloutError::Unreadable(Endpoint::Authorize) => {
                f.write_str("ledger answer to authorize is not an AuthorizeResponse")
            }
            CalloutError::Unreadable(Endpoint::Outcomes) => {
                f.write_str("ledger answer to outcomes is not an OutcomesResponse")
            }
            CalloutError::Unreadable(Endpoint::Limits) => {
                f.write_str("ledger answer to limits is not a LimitsResponse")
            }
            CalloutError::Unreadable(Endpoint::Credential) => {
                f.write_str("ledger answer to credential is not a CredentialResponse")
            }
            CalloutError::UnreadableDispatch(g) => write!(
                f,
                "ledger answer to authorize dispatches attempt {} (round {}) but is not an AuthorizeResponse",
                g.attempt_id, g.round
            ),
            CalloutError::AckCount { acked, sent } => {
                write!(f, "ledger acknowledged {acked} of {sent} reports")
            }
            CalloutError::NotDispatched => f.write_str("dispatch failed"),
            CalloutError::NoAnswer => f.write_str("no answer"),
        }
    }
}

impl std::error::Error for CalloutError {}

impl CalloutError {
    /// Whether the ledger refused the permit token: `permit_invalid`, or, from a body that
    /// names no code, the status that code is sent with.
    pub fn is_permit_invalid(&self) -> bool {
        const PERMIT_INVALID: LedgerErrorCode = LedgerErrorCode::PermitInvalid;
        match self {
            CalloutError::Refused { code, .. } => *code == PERMIT_INVALID,
            CalloutError::Status(s) => *s == u32::from(PERMIT_INVALID.http_status()),
            _ => false,
        }
    }
}

/// What came back from a callout, as the adapter read it.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerReply {
    /// `:status`; `None` when the callout failed (zero headers) or had no status.
    pub status: Option<u32>,
    pub body: Vec<u8>,
}

impl LedgerReply {
    /// A callout that failed: dispatch refused, reset, timed out.
    pub fn failed() -> LedgerReply {
        LedgerReply {
            status: None,
            body: Vec::new(),
        }
    }

    /// A callout's answer as Envoy hands it over: how many headers it has (none when the
    /// callout failed, and then nothing else is read), its `:status` (Envoy's one-value
    /// lookup answers the first) and its body, each read only when needed.
    pub fn from_callout(
        num_headers: usize,
        status: impl FnOnce() -> Option<Vec<u8>>,
        body: impl FnOnce() -> Vec<u8>,
    ) -> LedgerReply {
        if num_headers == 0 {
            return LedgerReply::failed();
        }
        LedgerReply {
            status: status().and_then(|value| parse_status(&value)),
            body: body(),
        }
    }

    fn ok_body(&self) -> Result<&[u8], CalloutError> {
        match self.status {
            None => Err(CalloutError::Unreachable),
            Some(200) => Ok(&self.body),
            Some(status) => Err(match self.error_code() {
                Some(code) => CalloutError::Refused { status, code },
                None => CalloutError::Status(status),
            }),
        }
    }

    /// The code an error answer's body names (`{"error": CODE}`, [`LedgerErrorCode`]), if it
    /// names one this filter knows. Read as a JSON value, as the filter reads other answers
    /// already: a reader of its own for the error body would cost the module kilobytes.
    fn error_code(&self) -> Option<LedgerErrorCode> {
        let body = serde_json::from_slice::<serde_json::Value>(&self.body).ok()?;
        let named = body.get("error")?.as_str()?;
        // Looked up among the names the log line prints anyway, not by `from_wire`, whose
        // match of its own would cost the module another half kilobyte.
        LedgerErrorCode::ALL
            .into_iter()
            .find(|c| c.as_str() == named)
    }

    /// Reads an authorize answer.
    pub fn authorize(&self) -> Result<AuthorizeResponse, CalloutError> {
        let body = self.ok_body()?;
        if let Ok(dispatch) = serde_json::from_slice::<DispatchAnswer>(body) {
            return Ok(dispatch.into());
        }
        serde_json::from_slice(body).map_err(|_| {
            match serde_json::from_slice::<DispatchGrantOf>(body) {
                Ok(g) => CalloutError::UnreadableDispatch(Box::new(DispatchGrant {
                    attempt_id: g.attempt_id,
                    round: g.round,
                    capability: g.capability,
                })),
                Err(_) => CalloutError::Unreadable(Endpoint::Authorize),
            }
        })
    }

    /// Reads a credential answer: the permit's credential, or none (the permit names none,
    /// or the ledger refused the token with 403 `permit_invalid`).
    pub fn credential(&self) -> Result<Option<UpstreamCredential>, CalloutError> {
        match self.ok_body() {
            Ok(body) => serde_json::from_slice::<CredentialResponse>(body)
                .map(|r| r.credential)
                .map_err(|_| CalloutError::Unreadable(Endpoint::Credential)),
            Err(e) if e.is_permit_invalid() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads a limits answer.
    pub fn limits(&self) -> Result<LimitsResponse, CalloutError> {
        serde_json::from_slice(self.ok_body()?)
            .map_err(|_| CalloutError::Unreadable(Endpoint::Limits))
    }

    /// The acks of the reports that rode on an authorize, as its answer gives them: none when
    /// it has none (a ledger that did not take them, or one older than riding). Read as a
    /// JSON value and looked up among the acks' names, as [`LedgerReply::error_code`] reads
    /// its code: a reader of its own would cost the module kilobytes.
    pub fn report_acks(&self) -> Result<Vec<OutcomeAck>, CalloutError> {
        let unreadable = || CalloutError::Unreadable(Endpoint::Authorize);
        let answer = serde_json::from_slice::<serde_json::Value>(self.ok_body()?)
            .map_err(|_| unreadable())?;
        let Some(acks) = answer.get("report_acks") else {
            return Ok(Vec::new());
        };
        let named = |ack: &serde_json::Value| {
            let name = ack.as_str()?;
            OutcomeAck::ALL.into_iter().find(|a| a.as_str() == name)
        };
        acks.as_array()
            .ok_or_else(unreadable)?
            .iter()
            .map(|ack| named(ack).ok_or_else(unreadable))
            .collect()
    }

    /// Reads an outcomes answer for `sent` reports.
    pub fn outcomes(&self, sent: usize) -> Result<Vec<OutcomeAck>, CalloutError> {
        let resp: OutcomesResponse = serde_json::from_slice(self.ok_body()?)
            .map_err(|_| CalloutError::Unreadable(Endpoint::Outcomes))?;
        if resp.acks.len() != sent {
            return Err(CalloutError::AckCount {
                acked: resp.acks.len(),
                sent,
            });
        }
        Ok(resp.acks)
    }
}

/// A Dispatch answer read straight into its fields. [`AuthorizeResponse`] is tagged by a
/// member that may come anywhere, so serde buffers the whole answer as a tree before it
/// reads a variant: about two thirds of the work of reading the answer every dispatched
/// call gets. An answer with exactly these members, each once, reads here to the value the
/// tagged read gives; anything else (another decision, an unknown or repeated member)
/// fails here and is read the tagged way.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DispatchAnswer {
    /// Read only to be `dispatch`.
    #[serde(rename = "decision")]
    _decision: DispatchTag,
    attempt_id: String,
    permit_id: String,
    lease_ms: u64,
    round: u32,
    capability: String,
    #[serde(default)]
    limits: Option<PermitLimits>,
    /// Read as given: whether it is one the filter can send is the machine's to check
    /// against the request it asked the ledger to sign.
    #[serde(default)]
    signature: Option<DispatchSignature>,
    /// The permit's credential, to set upstream (crate::call::credential).
    #[serde(default)]
    credential: Option<UpstreamCredential>,
    /// The acks of the reports that rode on the request: read by [`LedgerReply::report_acks`].
    #[serde(default, rename = "report_acks")]
    _report_acks: serde::de::IgnoredAny,
}

/// What must be read of a Dispatch answer to report on its round, when the rest of it
/// cannot be.
#[derive(Deserialize)]
struct DispatchGrantOf {
    /// Read only to be `dispatch`.
    #[serde(rename = "decision")]
    _decision: DispatchTag,
    attempt_id: String,
    round: u32,
    capability: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum DispatchTag {
    Dispatch,
}

impl From<DispatchAnswer> for AuthorizeResponse {
    fn from(a: DispatchAnswer) -> AuthorizeResponse {
        AuthorizeResponse::Dispatch {
            attempt_id: a.attempt_id,
            permit_id: a.permit_id,
            lease_ms: a.lease_ms,
            round: a.round,
            capability: a.capability,
            limits: a.limits,
            signature: a.signature,
            credential: a.credential,
        }
    }
}

/// Parses the `:status` header value.
fn parse_status(value: &[u8]) -> Option<u32> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use atmost_protocol::{Denial, DenialCode};

    #[test]
    fn callout_headers() {
        let cfg = LedgerConfig {
            cluster: "atmost_ledger".into(),
            authority: "atmost-ledger".into(),
            timeout_ms: 1000,
            service_token: "svc".into(),
        };
        let h = headers(&cfg, Endpoint::Authorize);
        let get = |n: &str| h.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!(get(":method"), Some("POST"));
        assert_eq!(get(":path"), Some("/v1/authorize"));
        assert_eq!(get(":authority"), Some("atmost-ledger"));
        assert_eq!(get("content-type"), Some("application/json"));
        assert_eq!(get("authorization"), Some("Bearer svc"));
        assert_eq!(get("atmost-callout-timeout-ms"), Some("1000"));
        assert_eq!(headers(&cfg, Endpoint::Outcomes)[1].1, "/v1/outcomes");
    }

    /// Every answer reads to what the tagged read of [`AuthorizeResponse`] gives, whether
    /// or not it has the exact shape of a Dispatch answer.
    #[test]
    fn a_dispatch_answer_reads_as_the_tagged_read_gives() {
        let bodies = [
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","limits":{"calls_left":4,"budget_left":null,"expires_at":"2030-01-01T00:00:00Z"}}"#,
            r#"{"attempt_id":"a\u0041","permit_id":"p","lease_ms":1,"round":2,"capability":"c","decision":"dispatch"}"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","limits":null}"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","extra":[1]}"#,
            r#"{"decision":"dispatch","attempt_id":"a","attempt_id":"b","permit_id":"p","lease_ms":1,"round":2,"capability":"c"}"#,
            r#"{"decision":"dispatch","decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c"}"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":4294967296,"capability":"c"}"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"capability":"c"}"#,
            r#"{"decision":"replay","attempt_id":"a","receipt":"{}"}"#,
            r#"{"decision":"deny","code":"permit_expired","message":"m"}"#,
            r#"{"decision":"Dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c"}"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c"} x"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","signature":{"signature_input":"atmost=()","signature":"atmost=:AA==:"}}"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","signature":null}"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","signature":{"signature":"s","signature_input":"i","x":1}}"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","report_acks":["applied","conflict"]}"#,
            r#"{"decision":"deny","code":"permit_expired","message":"m","report_acks":["applied"]}"#,
        ];
        let mut dispatches = 0;
        for body in bodies {
            let tagged = serde_json::from_str::<AuthorizeResponse>(body)
                .map_err(|_| CalloutError::Unreadable(Endpoint::Authorize));
            let read = LedgerReply {
                status: Some(200),
                body: body.as_bytes().to_vec(),
            }
            .authorize();
            assert_eq!(read, tagged, "{body}");
            dispatches += usize::from(matches!(read, Ok(AuthorizeResponse::Dispatch { .. })));
        }
        assert_eq!(dispatches, 8);
    }

    /// The acks of reports that rode on an authorize come with its answer, whatever its
    /// decision; an answer without them, or a failed one, has none to give.
    #[test]
    fn the_acks_of_riding_reports_are_read_from_the_authorize_answer() {
        let reply = |status: u32, body: &str| LedgerReply {
            status: Some(status),
            body: body.as_bytes().to_vec(),
        };
        let dispatch = reply(
            200,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","report_acks":["applied","conflict"]}"#,
        );
        assert_eq!(
            dispatch.report_acks(),
            Ok(vec![OutcomeAck::Applied, OutcomeAck::Conflict])
        );
        // The Dispatch reads the quick way with its acks beside it.
        assert!(serde_json::from_slice::<DispatchAnswer>(&dispatch.body).is_ok());
        let bare = reply(
            200,
            r#"{"decision":"replay","attempt_id":"a","receipt":"{}"}"#,
        );
        assert_eq!(bare.report_acks(), Ok(vec![]));
        let failed = reply(503, r#"{"error":"store_unavailable"}"#);
        assert!(failed.report_acks().is_err());
        assert_eq!(
            LedgerReply::failed().report_acks(),
            Err(CalloutError::Unreachable)
        );
    }

    #[test]
    fn an_authorize_callout_carries_its_riders_and_no_other_callout_does() {
        let rider = OutcomeReport {
            attempt_id: "a1".into(),
            round: 1,
            capability: "cap".into(),
            outcome: atmost_protocol::Outcome::Completed {
                receipt: "{}".into(),
            },
        };
        let authorize = Callout {
            endpoint: Endpoint::Authorize,
            body: br#"{"permit_token":"t","tool":"pay","fingerprint":"f"}"#.to_vec(),
        };
        let body = authorize.with_riders(std::slice::from_ref(&rider));
        let read: Option<atmost_protocol::AuthorizeRequest> =
            body.and_then(|b| serde_json::from_slice(&b).ok());
        assert_eq!(read.map(|r| r.reports), Some(vec![rider.clone()]));
        assert_eq!(authorize.with_riders(&[]), None);
        let limits = Callout::limits(&LimitsRequest {
            permit_token: "t".into(),
            tools: vec!["pay".into()],
        });
        assert_eq!(limits.with_riders(&[rider]), None);
    }

    #[test]
    fn a_dispatch_answer_read_only_in_part_still_names_its_round() {
        let read = |body: &str| {
            LedgerReply {
                status: Some(200),
                body: body.as_bytes().to_vec(),
            }
            .authorize()
        };
        let grant = || -> Result<AuthorizeResponse, CalloutError> {
            Err(CalloutError::UnreadableDispatch(Box::new(DispatchGrant {
                attempt_id: "a".into(),
                round: 2,
                capability: "c".into(),
            })))
        };
        for body in [
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","signature":{"signature_input":7}}"#,
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"capability":"c","signature":"atmost=:AA==:"}"#,
            r#"{"decision":"dispatch","attempt_id":"a","round":2,"capability":"c"}"#,
        ] {
            assert_eq!(read(body), grant(), "{body}");
        }
        // Without what a report needs, or not a dispatch, it is simply unreadable.
        for body in [
            r#"{"decision":"dispatch","attempt_id":"a","permit_id":"p","lease_ms":1,"round":2,"signature":7}"#,
            r#"{"decision":"deny","attempt_id":"a","round":2,"capability":"c"}"#,
            r#"{"attempt_id":"a","round":2,"capability":"c"}"#,
        ] {
            assert_eq!(
                read(body),
                Err(CalloutError::Unreadable(Endpoint::Authorize)),
                "{body}"
            );
        }
        assert_eq!(
            grant().err().map(|e| e.to_string()).as_deref(),
            Some("ledger answer to authorize dispatches attempt a (round 2) but is not an AuthorizeResponse")
        );
    }

    #[test]
    fn a_callout_answer_is_read_from_its_headers_and_body() {
        let unread = || -> Vec<u8> { panic!("a failed callout has nothing to read") };
        assert_eq!(
            LedgerReply::from_callout(0, || Some(unread()), unread),
            LedgerReply::failed()
        );
        let read = |status: Option<&[u8]>| {
            LedgerReply::from_callout(3, || status.map(<[u8]>::to_vec), || b"{}".to_vec()).status
        };
        assert_eq!(read(Some(b"200")), Some(200));
        assert_eq!(read(Some(b" 503 ")), Some(503));
        assert_eq!(read(Some(b"ok")), None);
        assert_eq!(read(None), None);
        let reply = LedgerReply::from_callout(1, || Some(b"200".to_vec()), || b"{}".to_vec());
        assert_eq!(reply.body, b"{}");
    }

    #[test]
    fn reading_answers() {
        let deny = AuthorizeResponse::Deny(Denial::new(DenialCode::PermitExpired, "expired"));
        let ok = LedgerReply {
            status: Some(200),
            body: serde_json::to_vec(&deny).unwrap_or_default(),
        };
        assert_eq!(ok.authorize(), Ok(deny));
        assert_eq!(
            LedgerReply::failed().authorize(),
            Err(CalloutError::Unreachable)
        );
        assert_eq!(
            LedgerReply {
                status: Some(503),
                body: ok.body.clone()
            }
            .authorize(),
            Err(CalloutError::Status(503))
        );
        assert_eq!(
            LedgerReply {
                status: Some(200),
                body: b"{}".to_vec()
            }
            .authorize(),
            Err(CalloutError::Unreadable(Endpoint::Authorize))
        );
        let acks = LedgerReply {
            status: Some(200),
            body: br#"{"acks":["applied","already_recorded"]}"#.to_vec(),
        };
        assert_eq!(
            acks.outcomes(2),
            Ok(vec![OutcomeAck::Applied, OutcomeAck::AlreadyRecorded])
        );
        assert_eq!(
            acks.outcomes(3),
            Err(CalloutError::AckCount { acked: 2, sent: 3 })
        );
        assert_eq!(
            CalloutError::AckCount { acked: 2, sent: 3 }.to_string(),
            "ledger acknowledged 2 of 3 reports"
        );
        assert_eq!(parse_status(b"200"), Some(200));
        assert_eq!(parse_status(b"x"), None);
    }

    #[test]
    fn an_error_answer_is_known_by_the_code_its_body_names() {
        let answer = |status: u32, body: &[u8]| LedgerReply {
            status: Some(status),
            body: body.to_vec(),
        };
        let down = answer(503, br#"{"error":"store_unavailable"}"#);
        assert_eq!(
            down.authorize(),
            Err(CalloutError::Refused {
                status: 503,
                code: LedgerErrorCode::StoreUnavailable
            })
        );
        assert_eq!(
            down.limits().map_err(|e| e.to_string()),
            Err("ledger answered HTTP 503 store_unavailable".to_string())
        );
        // A code this filter does not know, or no code: the status is what is left.
        assert_eq!(
            answer(503, br#"{"error":"a_later_code"}"#).authorize(),
            Err(CalloutError::Status(503))
        );
        // The permit refused, by its code or (a body naming none) by its status.
        for refused in [
            answer(403, br#"{"error":"permit_invalid","message":"no"}"#),
            answer(403, b"forbidden"),
        ] {
            assert_eq!(refused.credential(), Ok(None));
        }
        assert!(matches!(
            answer(403, br#"{"error":"unauthorized"}"#).credential(),
            Err(CalloutError::Refused { status: 403, .. })
        ));
        assert!(answer(503, b"").credential().is_err());
    }
}
