//! The tool's credential, which the ledger keeps and the filter sets upstream, so that the
//! agent never holds it (docs/design.md#the-agent-holds-no-credential).
//!
//! It crosses from the ledger to the filter only: in a Dispatch answer
//! ([`AuthorizeResponse::Dispatch`](crate::AuthorizeResponse::Dispatch)`.credential`), and in
//! the answer to `POST /v1/credential` ([`CredentialRequest`] → [`CredentialResponse`]), which
//! the filter asks for the session's other requests under a permit. Its value's `Debug` never
//! shows it, so no log line written with `{:?}` can.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Path of the per-permit credential fetch.
pub const CREDENTIAL_PATH: &str = "/v1/credential";

/// Longest credential value (the header's value, its form applied), in bytes.
pub const MAX_CREDENTIAL_VALUE_BYTES: usize = 4096;

/// Request headers a credential may never be set in: HTTP's framing and routing, and every
/// header the filter itself writes or reads upstream (the forwarded key, the dispatch
/// signature and its digest). `atmost-*` headers are refused as a family.
pub const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
    "expect",
    "cookie",
    crate::IDEMPOTENCY_KEY_HEADER,
    "signature",
    "signature-input",
    "content-digest",
    "mcp-session-id",
    "mcp-protocol-version",
];

/// Whether `name` may carry a credential: a lowercase HTTP token of at most 128 bytes, not a
/// pseudo-header, not [`RESERVED_HEADERS`], not `atmost-*` or `x-envoy-*` (Envoy's control
/// headers). `Err` says why not. The ledger refuses such a registration, and the filter
/// refuses to set one a ledger sent anyway.
pub fn check_header_name(name: &str) -> Result<(), String> {
    let token =
        |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || name.len() > 128 || !name.bytes().all(token) {
        return Err(format!(
            "header {name:?} must be a lowercase HTTP header name of 1 to 128 bytes"
        ));
    }
    if RESERVED_HEADERS.contains(&name)
        || name.starts_with("atmost-")
        || name.starts_with("x-envoy-")
    {
        return Err(format!(
            "header {name:?} is one atmost or HTTP itself uses; a credential cannot go in it"
        ));
    }
    Ok(())
}

/// Whether `value` may be a header's value: 1 to [`MAX_CREDENTIAL_VALUE_BYTES`] visible ASCII
/// bytes or spaces, not starting or ending with a space.
pub fn check_header_value(value: &str) -> Result<(), &'static str> {
    let ok = !value.is_empty()
        && value.len() <= MAX_CREDENTIAL_VALUE_BYTES
        && value.bytes().all(|b| (0x20..0x7f).contains(&b))
        && !value.starts_with(' ')
        && !value.ends_with(' ');
    if ok {
        Ok(())
    } else {
        Err("the credential must be 1 to 4096 visible ASCII characters (spaces inside only)")
    }
}

/// A credential's value as it goes in its header. `Debug` prints `<redacted>`; the text is
/// read with [`expose`](Self::expose), by the code that sets the header or seals it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SecretValue(String);

impl SecretValue {
    pub fn new(value: String) -> Self {
        SecretValue(value)
    }

    /// The value itself: for the header it goes in, or the store's sealing, nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretValue(<redacted>)")
    }
}

/// One version of a registered credential, as the filter sets it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpstreamCredential {
    /// The name it was registered under, which the permit names.
    pub name: String,
    /// Which registration of the name this is: 1, then one more per rotation.
    pub version: u32,
    /// The request header it goes in, lowercase (`authorization`, `x-api-key`).
    pub header: String,
    /// The header's value, its form applied (`Bearer …` for the `bearer` form).
    pub value: SecretValue,
    /// The Envoy routes (their names, `xds.route_name`) of the tool it belongs to, say its
    /// `POST` route and its `GET` stream's: the filter sets it on requests Envoy routed to one
    /// of them, and on no other.
    pub routes: Vec<String>,
}

/// Body of `POST /v1/credential`: the credential of the permit a token names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialRequest {
    /// The secret permit token exactly as the agent presented it.
    pub permit_token: String,
}

/// The ledger's answer to a [`CredentialRequest`] whose token authenticates for a permit that
/// has not expired: that permit's credential, newest version, or none when it names none. A
/// token that does not authenticate, or an expired permit, is answered HTTP 403 with
/// `{"error": "permit_invalid"}` instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialResponse {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<UpstreamCredential>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_value_never_shows_in_debug_and_travels_as_a_plain_string() {
        let c = UpstreamCredential {
            name: "pay".into(),
            version: 2,
            header: "authorization".into(),
            value: SecretValue::new("Bearer sk-live-123".into()),
            routes: vec!["mcp".into()],
        };
        let shown = format!(
            "{c:?} {:?}",
            CredentialResponse {
                credential: Some(c.clone())
            }
        );
        assert!(!shown.contains("sk-live-123"), "{shown}");
        let json = serde_json::to_value(&c).unwrap_or_default();
        assert_eq!(json["value"], "Bearer sk-live-123");
        let none =
            serde_json::to_value(CredentialResponse { credential: None }).unwrap_or_default();
        assert_eq!(none, serde_json::json!({}));
    }

    #[test]
    fn header_names_atmost_or_http_uses_are_refused() {
        for ok in ["authorization", "x-api-key", "api-key"] {
            assert_eq!(check_header_name(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "Authorization",
            ":authority",
            "host",
            "content-length",
            "idempotency-key",
            "signature",
            "atmost-permit",
            "x-envoy-original-path",
            "x api key",
        ] {
            assert!(check_header_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn header_values_are_visible_ascii_without_line_breaks() {
        assert_eq!(check_header_value("Bearer abc"), Ok(()));
        for bad in ["", " abc", "abc ", "a\r\nb", "a\u{7f}", "é"] {
            assert!(check_header_value(bad).is_err(), "{bad:?}");
        }
        assert!(check_header_value(&"a".repeat(MAX_CREDENTIAL_VALUE_BYTES + 1)).is_err());
    }
}
