//! The dispatch signature as the ledger makes it: what a request's dispatch target must be
//! before anything is decided ([`check_dispatch`]), and the signature of a Dispatch answer
//! ([`sign_answer`]), in the one form `atmost_protocol::signature` defines.

use atmost_protocol::signature::{
    signature_header, DispatchNonce, DispatchSignature, DispatchTarget, MAX_VALIDITY_S,
};
use atmost_protocol::{AuthorizeRequest, AuthorizeResponse};
use thiserror::Error;

use crate::clock::Millis;
use crate::error::LedgerError;
use crate::keys::SigningKey;

/// Longest `authority` or `path` signed, in bytes.
pub const MAX_TARGET_LEN: usize = 8192;

/// Why a request's dispatch target was refused (HTTP 400; nothing is decided or written).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum InvalidDispatch {
    #[error("dispatch.method must be an HTTP method token (RFC 9110 tchar)")]
    Method,
    #[error(
        "dispatch.authority must be 1 to {MAX_TARGET_LEN} bytes of printable ASCII without spaces, lowercased"
    )]
    Authority,
    #[error(
        "dispatch.path must be 1 to {MAX_TARGET_LEN} bytes of printable ASCII without spaces, starting with '/', without the query"
    )]
    Path,
    #[error("dispatch.body_sha256 must be 64 lowercase hex digits")]
    BodySha256,
    #[error(
        "dispatch.idempotency_key must be printable ASCII, without leading or trailing spaces"
    )]
    IdempotencyKey,
    #[error(
        "dispatch.idempotency_key must equal forwarded_key: both name the Idempotency-Key value the upstream receives"
    )]
    KeyMismatch,
    #[error("dispatch.validity_s must be 1 to {MAX_VALIDITY_S}")]
    Validity,
}

/// RFC 9110 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Printable ASCII without the space: nothing a header or a signature base line could be
/// split or trimmed at.
fn is_visible(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

fn visible_text(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_TARGET_LEN && s.bytes().all(is_visible)
}

/// Checks the request's dispatch target, when it names one. Every line of the signature base
/// is built from these values, so once they pass, signing cannot fail on them.
pub fn check_dispatch(req: &AuthorizeRequest) -> Result<(), InvalidDispatch> {
    let Some(d) = req.dispatch.as_ref() else {
        return Ok(());
    };
    if d.method.is_empty() || !d.method.bytes().all(is_tchar) {
        return Err(InvalidDispatch::Method);
    }
    if !visible_text(&d.authority) || d.authority.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(InvalidDispatch::Authority);
    }
    if !visible_text(&d.path) || !d.path.starts_with('/') || d.path.contains('?') {
        return Err(InvalidDispatch::Path);
    }
    if d.body_sha256.len() != 64
        || !d
            .body_sha256
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(InvalidDispatch::BodySha256);
    }
    if let Some(key) = d.idempotency_key.as_deref() {
        let printable = key.bytes().all(|b| (0x20..=0x7e).contains(&b));
        if key.is_empty() || !printable || key.starts_with(' ') || key.ends_with(' ') {
            return Err(InvalidDispatch::IdempotencyKey);
        }
    }
    if d.idempotency_key != req.forwarded_key {
        return Err(InvalidDispatch::KeyMismatch);
    }
    if !(1..=MAX_VALIDITY_S).contains(&d.validity_s) {
        return Err(InvalidDispatch::Validity);
    }
    Ok(())
}

/// The signature of one dispatch of `target`: created at `created_s` (Unix seconds), valid
/// for the target's `validity_s`, naming the dispatch by `nonce`. The target must have passed
/// [`check_dispatch`]; one that cannot make a signature base is a bug
/// ([`LedgerError::Invariant`]).
pub fn sign_dispatch(
    key: &SigningKey,
    target: &DispatchTarget,
    nonce: &DispatchNonce,
    created_s: u64,
) -> Result<DispatchSignature, LedgerError> {
    let unsignable =
        |what: &str| LedgerError::Invariant(format!("a checked dispatch target {what}"));
    let (input, base) = target
        .to_sign(created_s, key.kid(), nonce)
        .ok_or_else(|| unsignable("makes no signature base"))?;
    Ok(DispatchSignature {
        signature_input: input.header_value(),
        signature: signature_header(&key.sign(base.as_bytes())),
    })
}

/// Signs the answer to `req` when it is a Dispatch (a first round or a continuation) and the
/// request named a dispatch target: `created` is `now` in Unix seconds. Replays and denials
/// carry no signature, and neither does a Dispatch answer to a request without a target.
/// Answers whether it signed.
///
/// `recorded_body` is the body hash the attempt the decision wrote records for this round
/// (`Attempt::dispatch_body_sha256`): a dispatch is signed only over the body its attempt
/// records, so every signature can be tied to the attempt that holds its digest. Any other is
/// a bug ([`LedgerError::Invariant`]), and nothing is signed.
pub fn sign_answer(
    req: &AuthorizeRequest,
    response: &mut AuthorizeResponse,
    key: &SigningKey,
    now: Millis,
    recorded_body: Option<&str>,
) -> Result<bool, LedgerError> {
    let Some(target) = req.dispatch.as_ref() else {
        return Ok(false);
    };
    let AuthorizeResponse::Dispatch {
        attempt_id,
        permit_id,
        round,
        signature,
        ..
    } = response
    else {
        return Ok(false);
    };
    if recorded_body != Some(target.body_sha256.as_str()) {
        return Err(LedgerError::Invariant(
            "a dispatch is signed only over the body its attempt records, and the attempt records another".into(),
        ));
    }
    let nonce = DispatchNonce {
        attempt_id: attempt_id.clone(),
        round: *round,
        permit_id: permit_id.clone(),
        tool: req.tool.clone(),
    };
    let created_s = u64::try_from(now.max(0) / 1000).unwrap_or(0);
    *signature = Some(sign_dispatch(key, target, &nonce, created_s)?);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use atmost_protocol::signature::{
        b64url_decode, content_digest_from_hex, parse_signature, SignatureInput, SignedRequest,
        KEY_COMPONENT,
    };
    use ring::signature::{UnparsedPublicKey, ED25519};
    use serde_json::json;

    use super::*;

    const SHA: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    fn request(dispatch: DispatchTarget) -> AuthorizeRequest {
        AuthorizeRequest {
            reports: Vec::new(),
            permit_token: "atmp_x".into(),
            tool: "pay invoice/€".into(),
            idempotency_key: Some("k1".into()),
            fingerprint: "fp".into(),
            arguments: json!({}),
            key_required: false,
            continuation: false,
            forwarded_key: dispatch.idempotency_key.clone(),
            forwarded_key_carriers: Default::default(),
            dispatch: Some(dispatch),
        }
    }

    fn target() -> DispatchTarget {
        DispatchTarget {
            method: "POST".into(),
            authority: "tools.example:8443".into(),
            path: "/mcp".into(),
            body_sha256: SHA.into(),
            idempotency_key: Some("408b0dac".into()),
            validity_s: 15,
        }
    }

    fn dispatch_answer() -> AuthorizeResponse {
        AuthorizeResponse::Dispatch {
            attempt_id: "att_0123".into(),
            permit_id: "pmt_4567".into(),
            lease_ms: 60_000,
            round: 2,
            capability: "c".into(),
            limits: None,
            signature: None,
            credential: None,
        }
    }

    #[test]
    fn a_good_target_passes_and_a_request_without_one_is_not_checked() {
        assert_eq!(check_dispatch(&request(target())), Ok(()));
        let without_key = DispatchTarget {
            idempotency_key: None,
            ..target()
        };
        assert_eq!(check_dispatch(&request(without_key)), Ok(()));
        let mut plain = request(target());
        plain.dispatch = None;
        plain.forwarded_key = Some("anything".into());
        assert_eq!(check_dispatch(&plain), Ok(()));
    }

    #[test]
    fn each_bad_part_of_a_target_is_named() {
        let cases: Vec<(DispatchTarget, InvalidDispatch)> = vec![
            (
                DispatchTarget {
                    method: "".into(),
                    ..target()
                },
                InvalidDispatch::Method,
            ),
            (
                DispatchTarget {
                    method: "PO ST".into(),
                    ..target()
                },
                InvalidDispatch::Method,
            ),
            (
                DispatchTarget {
                    method: "POST\r\n".into(),
                    ..target()
                },
                InvalidDispatch::Method,
            ),
            (
                DispatchTarget {
                    authority: "".into(),
                    ..target()
                },
                InvalidDispatch::Authority,
            ),
            (
                DispatchTarget {
                    authority: "Tools.example".into(),
                    ..target()
                },
                InvalidDispatch::Authority,
            ),
            (
                DispatchTarget {
                    authority: "a b".into(),
                    ..target()
                },
                InvalidDispatch::Authority,
            ),
            (
                DispatchTarget {
                    authority: "a\nb".into(),
                    ..target()
                },
                InvalidDispatch::Authority,
            ),
            (
                DispatchTarget {
                    authority: "ä.example".into(),
                    ..target()
                },
                InvalidDispatch::Authority,
            ),
            (
                DispatchTarget {
                    path: "mcp".into(),
                    ..target()
                },
                InvalidDispatch::Path,
            ),
            (
                DispatchTarget {
                    path: "/mcp?x=1".into(),
                    ..target()
                },
                InvalidDispatch::Path,
            ),
            (
                DispatchTarget {
                    path: "/m cp".into(),
                    ..target()
                },
                InvalidDispatch::Path,
            ),
            (
                DispatchTarget {
                    path: "/mcp\r".into(),
                    ..target()
                },
                InvalidDispatch::Path,
            ),
            (
                DispatchTarget {
                    path: format!("/{}", "a".repeat(MAX_TARGET_LEN)),
                    ..target()
                },
                InvalidDispatch::Path,
            ),
            (
                DispatchTarget {
                    body_sha256: SHA.to_uppercase(),
                    ..target()
                },
                InvalidDispatch::BodySha256,
            ),
            (
                DispatchTarget {
                    body_sha256: SHA[..63].into(),
                    ..target()
                },
                InvalidDispatch::BodySha256,
            ),
            (
                DispatchTarget {
                    body_sha256: format!("{}g", &SHA[..63]),
                    ..target()
                },
                InvalidDispatch::BodySha256,
            ),
            (
                DispatchTarget {
                    validity_s: 0,
                    ..target()
                },
                InvalidDispatch::Validity,
            ),
            (
                DispatchTarget {
                    validity_s: MAX_VALIDITY_S + 1,
                    ..target()
                },
                InvalidDispatch::Validity,
            ),
        ];
        for (bad, why) in cases {
            assert_eq!(check_dispatch(&request(bad.clone())), Err(why), "{bad:?}");
        }
        for key in ["", " k", "k ", "k\u{1}", "clé"] {
            let bad = DispatchTarget {
                idempotency_key: Some(key.into()),
                ..target()
            };
            assert_eq!(
                check_dispatch(&request(bad)),
                Err(InvalidDispatch::IdempotencyKey),
                "{key:?}"
            );
        }
        let mut other = request(target());
        other.forwarded_key = Some("another".into());
        assert_eq!(check_dispatch(&other), Err(InvalidDispatch::KeyMismatch));
        other.forwarded_key = None;
        assert_eq!(check_dispatch(&other), Err(InvalidDispatch::KeyMismatch));
        let mut unstated = request(DispatchTarget {
            idempotency_key: None,
            ..target()
        });
        unstated.forwarded_key = Some("408b0dac".into());
        assert_eq!(check_dispatch(&unstated), Err(InvalidDispatch::KeyMismatch));
    }

    /// The signature verifies over the base the protocol module rebuilds from the headers
    /// alone (as a verifier does), and names the dispatch.
    #[test]
    fn a_dispatch_answer_is_signed_over_the_rebuilt_base() {
        let (key, row) = SigningKey::generate(0).unwrap();
        for target in [
            target(),
            DispatchTarget {
                idempotency_key: None,
                ..target()
            },
        ] {
            let req = request(target.clone());
            let mut answer = dispatch_answer();
            assert!(sign_answer(&req, &mut answer, &key, 1_764_680_000_999, Some(SHA)).unwrap());
            let AuthorizeResponse::Dispatch {
                signature: Some(sig),
                ..
            } = &answer
            else {
                panic!("not signed: {answer:?}");
            };
            let input = SignatureInput::parse(&sig.signature_input).unwrap();
            assert_eq!(input.integer("created"), Some(1_764_680_000));
            assert_eq!(input.integer("expires"), Some(1_764_680_015));
            assert_eq!(input.string("keyid"), Some(key.kid()));
            assert_eq!(
                input.components.contains(&KEY_COMPONENT.to_string()),
                target.idempotency_key.is_some()
            );
            let nonce = DispatchNonce::parse(input.string("nonce").unwrap()).unwrap();
            assert_eq!(
                nonce,
                DispatchNonce {
                    attempt_id: "att_0123".into(),
                    round: 2,
                    permit_id: "pmt_4567".into(),
                    tool: "pay invoice/€".into(),
                }
            );
            let digest = content_digest_from_hex(SHA).unwrap();
            let received = SignedRequest {
                method: "POST",
                authority: "tools.example:8443",
                path: "/mcp",
                content_digest: &digest,
                idempotency_key: target.idempotency_key.as_deref(),
            };
            let base = received.signature_base(&input).unwrap();
            let bytes = parse_signature(&sig.signature).unwrap();
            let public = b64url_decode(&row.public_key).unwrap();
            let verifier = UnparsedPublicKey::new(&ED25519, &public);
            assert!(verifier.verify(base.as_bytes(), &bytes).is_ok());
            let tampered = SignedRequest {
                path: "/other",
                ..received
            };
            let base = tampered.signature_base(&input).unwrap();
            assert!(verifier.verify(base.as_bytes(), &bytes).is_err());
        }
    }

    #[test]
    fn replays_denials_and_requests_without_a_target_are_not_signed() {
        let (key, _) = SigningKey::generate(0).unwrap();
        let req = request(target());
        let mut replay = AuthorizeResponse::Replay {
            attempt_id: "att_1".into(),
            receipt: "{}".into(),
            limits: None,
        };
        assert!(!sign_answer(&req, &mut replay, &key, 0, Some(SHA)).unwrap());
        let mut deny = AuthorizeResponse::Deny(atmost_protocol::Denial::new(
            atmost_protocol::DenialCode::PermitInvalid,
            "no",
        ));
        assert!(!sign_answer(&req, &mut deny, &key, 0, Some(SHA)).unwrap());
        let mut plain = req.clone();
        plain.dispatch = None;
        let mut answer = dispatch_answer();
        assert!(!sign_answer(&plain, &mut answer, &key, 0, None).unwrap());
        assert_eq!(answer, dispatch_answer());
    }

    #[test]
    fn a_dispatch_is_signed_only_over_the_body_its_attempt_records() {
        let (key, _) = SigningKey::generate(0).unwrap();
        let req = request(target());
        let other = "0".repeat(64);
        for recorded in [None, Some(other.as_str())] {
            let mut answer = dispatch_answer();
            let refused = sign_answer(&req, &mut answer, &key, 0, recorded);
            assert!(
                matches!(refused, Err(LedgerError::Invariant(_))),
                "{recorded:?}: {refused:?}"
            );
            assert_eq!(answer, dispatch_answer(), "nothing signed");
        }
        // The control: the body the attempt records is signed.
        let mut answer = dispatch_answer();
        assert!(sign_answer(&req, &mut answer, &key, 0, Some(SHA)).unwrap());
    }
}
