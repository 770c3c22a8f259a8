//! Talking to the ledger: callout headers, and reading its answers. A failed or timed-out
//! callout arrives with zero headers; that, a non-200 `:status`, or a body that is not the
//! expected JSON are all failures (the authorize caller then fails closed).

use atmost_config::LedgerConfig;
use atmost_protocol::{AuthorizeResponse, OutcomeAck, OutcomesRequest, OutcomesResponse};

/// Which ledger endpoint a callout goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Authorize,
    Outcomes,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Authorize => atmost_protocol::AUTHORIZE_PATH,
            Endpoint::Outcomes => atmost_protocol::OUTCOMES_PATH,
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
    /// A `POST /v1/outcomes` carrying `request`.
    pub fn outcomes(request: &OutcomesRequest) -> Callout {
        Callout {
            endpoint: Endpoint::Outcomes,
            body: serde_json::to_vec(request).unwrap_or_default(),
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
    ]
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

    fn ok_body(&self) -> Result<&[u8], String> {
        match self.status {
            None => Err("ledger unreachable or timed out".into()),
            Some(200) => Ok(&self.body),
            Some(s) => Err(format!("ledger answered HTTP {s}")),
        }
    }

    /// Reads an authorize answer.
    pub fn authorize(&self) -> Result<AuthorizeResponse, String> {
        serde_json::from_slice(self.ok_body()?)
            .map_err(|_| "ledger answer to authorize is not an AuthorizeResponse".to_string())
    }

    /// Reads an outcomes answer for `sent` reports.
    pub fn outcomes(&self, sent: usize) -> Result<Vec<OutcomeAck>, String> {
        let resp: OutcomesResponse = serde_json::from_slice(self.ok_body()?)
            .map_err(|_| "ledger answer to outcomes is not an OutcomesResponse".to_string())?;
        if resp.acks.len() != sent {
            return Err(format!(
                "ledger acknowledged {} of {sent} reports",
                resp.acks.len()
            ));
        }
        Ok(resp.acks)
    }
}

/// Parses the `:status` header value.
pub fn parse_status(value: &[u8]) -> Option<u32> {
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
        assert_eq!(headers(&cfg, Endpoint::Outcomes)[1].1, "/v1/outcomes");
    }

    #[test]
    fn reading_answers() {
        let deny = AuthorizeResponse::Deny(Denial::new(DenialCode::PermitExpired, "expired"));
        let ok = LedgerReply {
            status: Some(200),
            body: serde_json::to_vec(&deny).unwrap_or_default(),
        };
        assert_eq!(ok.authorize(), Ok(deny));
        assert!(LedgerReply::failed().authorize().is_err());
        assert!(LedgerReply {
            status: Some(503),
            body: ok.body.clone()
        }
        .authorize()
        .is_err());
        assert!(LedgerReply {
            status: Some(200),
            body: b"{}".to_vec()
        }
        .authorize()
        .is_err());
        let acks = LedgerReply {
            status: Some(200),
            body: br#"{"acks":["applied","already_recorded"]}"#.to_vec(),
        };
        assert_eq!(
            acks.outcomes(2),
            Ok(vec![OutcomeAck::Applied, OutcomeAck::AlreadyRecorded])
        );
        assert!(acks.outcomes(3).is_err());
        assert_eq!(parse_status(b"200"), Some(200));
        assert_eq!(parse_status(b"x"), None);
    }
}
