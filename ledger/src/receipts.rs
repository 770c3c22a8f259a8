//! Signed receipts: what the ledger decided and recorded about one attempt, as a compact JWS
//! (RFC 7515) signed with its active key (`alg: EdDSA`, RFC 8037), so an auditor can check
//! an export offline against the published keys.
//!
//! A receipt states what the gateway did (reserved, dispatched in so many rounds, recorded
//! an outcome, had it resolved by someone), never what the provider did: the ledger only
//! knows what the gateway told it.

use atmost_protocol::signature::{b64url_encode, DispatchNonce};
use serde::{Deserialize, Serialize};

use crate::clock::{rfc3339, Millis};
use crate::error::LedgerError;
use crate::keys::SigningKey;
use crate::model::{ApprovalView, Attempt, Resolution};
use crate::token::sha256_hex;

/// The JWS `typ` of a receipt (RFC 8725 §3.11: explicit typing, so a receipt is never taken
/// for another kind of token signed by the same key).
pub const RECEIPT_TYP: &str = "atmost-receipt+jwt";

/// The protected header of every receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiptHeader {
    pub alg: String,
    pub kid: String,
    pub typ: String,
}

/// Who settled an uncertain attempt, when, and on what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiptResolution {
    pub executed: bool,
    pub by: String,
    /// RFC 3339.
    pub at: String,
    /// `person` or `reconciler`.
    pub source: String,
    pub note: Option<String>,
    /// Hex SHA-256 of the provider's answer a reconciler went by.
    pub provider_answer_sha256: Option<String>,
}

impl From<&Resolution> for ReceiptResolution {
    fn from(r: &Resolution) -> Self {
        ReceiptResolution {
            executed: r.executed,
            by: r.by.clone(),
            at: rfc3339(r.at_ms),
            source: r.source.as_str().to_string(),
            note: r.note.clone(),
            provider_answer_sha256: r.source.provider_answer().map(sha256_hex),
        }
    }
}

/// The claims of one receipt. Times are RFC 3339 as the admin API shows them, except `iat`
/// (RFC 7519 NumericDate).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiptClaims {
    /// The ledger that signed (`--receipt-issuer`).
    pub iss: String,
    /// When the receipt was signed, Unix seconds.
    pub iat: u64,
    pub attempt_id: String,
    pub permit_id: String,
    pub tool: String,
    /// Hex SHA-256 of the RFC 8785 form of `{"tool", "arguments"}`, as the gateway sent it.
    pub fingerprint: String,
    /// Hex SHA-256 of the client's idempotency key (the key itself is never stored).
    pub key_sha256: Option<String>,
    /// The `Idempotency-Key` value the upstream received, as the gateway said.
    pub forwarded_key: Option<String>,
    /// Dispatches of the attempt: 1, plus one per `input_required` continuation.
    pub rounds: u32,
    /// The `nonce` the last round's dispatch signature carries:
    /// `<attempt>/<round>/<permit>/<tool>` (docs/signatures.md#the-signature).
    pub nonce: String,
    /// Hex SHA-256 of the body the last round was signed over, as the attempt records it: the
    /// `Content-Digest` its signature covers. `None` for a round sent unsigned
    /// (`request_hold: body`) and for attempts stored before it was kept.
    pub body_sha256: Option<String>,
    pub state: String,
    /// Why it was released or turned uncertain.
    pub reason: Option<String>,
    pub cost: u64,
    /// Times the recorded answer was replayed for the same key.
    pub replay_count: u64,
    /// Hex SHA-256 of the upstream's answer as recorded (`None` without one, or once pruned).
    pub receipt_sha256: Option<String>,
    pub created_at: String,
    pub updated_at: String,
    pub finished_at: Option<String>,
    pub pruned_at: Option<String>,
    pub resolution: Option<ReceiptResolution>,
    /// The person's approval the call waited for, and who gave (or refused) it; absent for a
    /// call that needed none (docs/approvals.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalView>,
}

impl ReceiptClaims {
    /// The claims about `a`, issued by `issuer` at `now`.
    pub fn new(a: &Attempt, issuer: &str, now: Millis) -> Self {
        ReceiptClaims {
            iss: issuer.to_string(),
            iat: u64::try_from(now.max(0) / 1000).unwrap_or(0),
            attempt_id: a.id.clone(),
            permit_id: a.permit_id.clone(),
            tool: a.tool.clone(),
            fingerprint: a.fingerprint.clone(),
            key_sha256: a.key_hash.clone(),
            forwarded_key: a.forwarded_key.clone(),
            rounds: a.round,
            nonce: DispatchNonce {
                attempt_id: a.id.clone(),
                round: a.round,
                permit_id: a.permit_id.clone(),
                tool: a.tool.clone(),
            }
            .encode(),
            body_sha256: a.dispatch_body_sha256.clone(),
            state: a.state.as_str().to_string(),
            reason: a.reason.clone(),
            cost: a.cost,
            replay_count: a.replay_count,
            receipt_sha256: a.receipt.as_deref().map(sha256_hex),
            created_at: rfc3339(a.created_at_ms),
            updated_at: rfc3339(a.updated_at_ms),
            finished_at: a.finished_at_ms.map(rfc3339),
            pruned_at: a.pruned_at_ms.map(rfc3339),
            resolution: a.resolution.as_ref().map(ReceiptResolution::from),
            approval: a.approval.as_ref().map(ApprovalView::from),
        }
    }
}

/// The compact JWS of `claims` signed by `key`: `header.payload.signature`, each base64url.
pub fn sign_receipt(key: &SigningKey, claims: &ReceiptClaims) -> Result<String, LedgerError> {
    let header = ReceiptHeader {
        alg: "EdDSA".into(),
        kid: key.kid().to_string(),
        typ: RECEIPT_TYP.into(),
    };
    let signing_input = format!(
        "{}.{}",
        b64url_encode(&serde_json::to_vec(&header)?),
        b64url_encode(&serde_json::to_vec(claims)?)
    );
    let signature = b64url_encode(&key.sign(signing_input.as_bytes()));
    Ok(format!("{signing_input}.{signature}"))
}

#[cfg(test)]
mod tests {
    use atmost_protocol::signature::b64url_decode;
    use ring::signature::{UnparsedPublicKey, ED25519};

    use super::*;
    use crate::model::{AttemptState, ResolutionSource};

    #[test]
    fn a_receipt_is_a_compact_jws_over_the_attempt_as_recorded() {
        let (key, row) = SigningKey::generate(0).unwrap();
        let mut a = Attempt::example("att_1", "pmt_1", "pay", AttemptState::ResolvedExecuted, 7);
        a.key_hash = Some(sha256_hex("k1"));
        a.forwarded_key = Some("fwd".into());
        a.round = 2;
        a.dispatch_body_sha256 = Some(sha256_hex("the second round's body"));
        a.receipt = Some("{\"result\":{}}".into());
        a.created_at_ms = 1_764_680_000_123;
        a.resolution = Some(Resolution {
            executed: true,
            by: "recon".into(),
            at_ms: 1_764_680_100_000,
            note: None,
            source: ResolutionSource::Reconciler {
                provider_answer: "{\"found\":true}".into(),
            },
        });
        let claims = ReceiptClaims::new(&a, "ledger-a", 1_764_680_200_999);
        let jws = sign_receipt(&key, &claims).unwrap();
        let parts: Vec<&str> = jws.split('.').collect();
        assert_eq!(parts.len(), 3);
        let header: serde_json::Value =
            serde_json::from_slice(&b64url_decode(parts[0]).unwrap()).unwrap();
        assert_eq!(
            header,
            serde_json::json!({"alg": "EdDSA", "kid": key.kid(), "typ": "atmost-receipt+jwt"})
        );
        let payload: ReceiptClaims =
            serde_json::from_slice(&b64url_decode(parts[1]).unwrap()).unwrap();
        assert_eq!(payload, claims);
        assert_eq!(payload.iat, 1_764_680_200);
        assert_eq!(payload.rounds, 2);
        // The last round's signature: its nonce and the body it was signed over.
        assert_eq!(payload.nonce, "att_1/2/pmt_1/pay");
        assert_eq!(
            payload.body_sha256,
            Some(sha256_hex("the second round's body"))
        );
        assert_eq!(payload.state, "resolved_executed");
        assert_eq!(payload.created_at, "2025-12-02T12:53:20.123Z");
        assert_eq!(payload.receipt_sha256, Some(sha256_hex("{\"result\":{}}")));
        let r = payload.resolution.unwrap();
        assert_eq!((r.source.as_str(), r.by.as_str()), ("reconciler", "recon"));
        assert_eq!(
            r.provider_answer_sha256,
            Some(sha256_hex("{\"found\":true}"))
        );

        let public = b64url_decode(&row.public_key).unwrap();
        let verifier = UnparsedPublicKey::new(&ED25519, &public);
        let signed = format!("{}.{}", parts[0], parts[1]);
        let signature = b64url_decode(parts[2]).unwrap();
        assert!(verifier.verify(signed.as_bytes(), &signature).is_ok());
        let tampered = format!(
            "{}.{}",
            parts[0],
            b64url_encode(b"{\"state\":\"released\"}")
        );
        assert!(verifier.verify(tampered.as_bytes(), &signature).is_err());
    }
}
