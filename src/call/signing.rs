//! The gateway's side of a signed dispatch ([docs/signatures.md](../../docs/signatures.md)):
//! what the filter asks the ledger to sign, and the check of the ledger's signature before
//! the request leaves. The form itself (the base, `Signature-Input`, `Content-Digest`) is
//! `atmost_protocol::signature`'s; this module only fills it in and compares.
//!
//! With `request_hold: headers` nothing of a governed call leaves before the Dispatch
//! answer, so the filter can fix, before it asks, every byte it will send: the method, the
//! authority, the path, the body after its key rewrite and the `Idempotency-Key` value. The
//! ledger signs exactly that ([`DispatchTarget`]), and the filter sends the request only
//! when the answer carries a signature over it: an answer without one, or with one over
//! something else, is a call never sent.

use super::step::Effect;
use atmost_protocol::signature::{
    content_digest, parse_signature, signature_header, DispatchNonce, DispatchSignature,
    DispatchTarget, SignatureInput, SignatureParams, SignedRequest,
};
use sha2::{Digest, Sha256};

/// The request headers of a dispatch signature. The filter writes them on a signed dispatch
/// only; a client's own are removed from every request, so whatever the upstream receives
/// under these names is the ledger's.
pub const SIGNATURE_HEADERS: [&str; 3] = [CONTENT_DIGEST, SIGNATURE_INPUT, SIGNATURE];
const CONTENT_DIGEST: &str = "content-digest";
const SIGNATURE_INPUT: &str = "signature-input";
const SIGNATURE: &str = "signature";

/// What the upstream will receive if the ledger dispatches, fixed before it is asked.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Signing {
    /// Sent with `authorize` as `dispatch`.
    pub(super) target: DispatchTarget,
    /// The `Content-Digest` value of the body as sent.
    content_digest: String,
}

/// The parts of the request that are not the body or the key.
pub(super) struct RequestLine<'a> {
    pub(super) method: &'a str,
    pub(super) authority: &'a str,
    pub(super) path: &'a str,
}

/// Why a Dispatch answer's signature cannot go upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unusable {
    /// The answer carries none.
    Missing,
    /// A header value that is not the form's structured field, or not in its one
    /// serialization (other members, other spacing).
    Malformed,
    /// Well formed, but not a signature over this request for this round: other components
    /// or parameters, another nonce, a validity longer than asked.
    NotThisDispatch,
}

impl Unusable {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Unusable::Missing => "no signature",
            Unusable::Malformed => "a malformed signature",
            Unusable::NotThisDispatch => "a signature over another request",
        }
    }
}

/// `:path` without its query: RFC 9421's `@path` (§2.2.6).
pub(super) fn path_without_query(path: &str) -> &str {
    path.split_once('?').map_or(path, |(p, _)| p)
}

impl Signing {
    /// The dispatch of `line` carrying exactly `body` and, when it is `Some`, the
    /// `Idempotency-Key` value `key`, valid for `validity_s` seconds.
    pub(super) fn new(
        line: &RequestLine<'_>,
        body: &[u8],
        key: Option<&str>,
        validity_s: u64,
    ) -> Signing {
        let sha256 = Sha256::digest(body);
        Signing {
            target: DispatchTarget {
                method: line.method.to_string(),
                authority: line.authority.to_ascii_lowercase(),
                path: path_without_query(line.path).to_string(),
                body_sha256: crate::parse::fingerprint::hex(&sha256),
                idempotency_key: key.map(str::to_string),
                validity_s,
            },
            content_digest: content_digest(&sha256),
        }
    }

    /// Whether `signature` is one the ledger made over this target for the dispatch
    /// `nonce` names: both values in the form's one serialization, a 64-byte signature, the
    /// components and parameters the ledger writes for this request, and a validity no
    /// longer than asked. The filter holds no key, so whether the bytes verify is the
    /// verifier's to say; this keeps a broken answer from costing a slot at the tool.
    pub(super) fn check(
        &self,
        signature: Option<&DispatchSignature>,
        nonce: &DispatchNonce,
    ) -> Result<(), Unusable> {
        let signature = signature.ok_or(Unusable::Missing)?;
        let input =
            SignatureInput::parse(&signature.signature_input).map_err(|_| Unusable::Malformed)?;
        let bytes = parse_signature(&signature.signature).map_err(|_| Unusable::Malformed)?;
        if input.header_value() != signature.signature_input
            || bytes.len() != 64
            || signature_header(&bytes) != signature.signature
        {
            return Err(Unusable::Malformed);
        }
        let (Some(created), Some(expires), Some(keyid)) = (
            input.integer("created"),
            input.integer("expires"),
            input.string("keyid").filter(|k| !k.is_empty()),
        ) else {
            return Err(Unusable::NotThisDispatch);
        };
        let expected = self.request().signature_params(&SignatureParams {
            created,
            expires,
            keyid: keyid.to_string(),
            nonce: nonce.encode(),
        });
        let validity = expires.saturating_sub(created);
        if input != expected || validity == 0 || validity > self.target.validity_s {
            return Err(Unusable::NotThisDispatch);
        }
        Ok(())
    }

    /// The request headers a dispatch with `signature` carries, as the ledger gave them.
    pub(super) fn headers(&self, signature: &DispatchSignature) -> [Effect; 3] {
        [
            Effect::SetRequestHeader(CONTENT_DIGEST.into(), self.content_digest.clone()),
            Effect::SetRequestHeader(SIGNATURE_INPUT.into(), signature.signature_input.clone()),
            Effect::SetRequestHeader(SIGNATURE.into(), signature.signature.clone()),
        ]
    }

    fn request(&self) -> SignedRequest<'_> {
        SignedRequest {
            method: &self.target.method,
            authority: &self.target.authority,
            path: &self.target.path,
            content_digest: &self.content_digest,
            idempotency_key: self.target.idempotency_key.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use atmost_protocol::signature::{self, b64_encode, COMPONENTS, KEY_COMPONENT};

    const LINE: RequestLine<'static> = RequestLine {
        method: "POST",
        authority: "MCP.Example:8000",
        path: "/mcp?session=1",
    };

    fn nonce() -> DispatchNonce {
        DispatchNonce {
            attempt_id: "att_1".into(),
            round: 1,
            permit_id: "pmt_1".into(),
            tool: "pay invoice".into(),
        }
    }

    /// What a ledger answers for `signing`, `validity` seconds long.
    fn signed(signing: &Signing, validity: u64) -> DispatchSignature {
        let input = signing.request().signature_params(&SignatureParams {
            created: 1_764_680_000,
            expires: 1_764_680_000 + validity,
            keyid: "kid-1".into(),
            nonce: nonce().encode(),
        });
        DispatchSignature {
            signature_input: input.header_value(),
            signature: signature_header(&[7; 64]),
        }
    }

    #[test]
    fn the_target_is_the_request_as_it_leaves() {
        let s = Signing::new(&LINE, b"{\"hello\": \"world\"}", Some("k-up"), 15);
        assert_eq!(
            s.target,
            DispatchTarget {
                method: "POST".into(),
                authority: "mcp.example:8000".into(),
                path: "/mcp".into(),
                // RFC 9530 §B.1's body.
                body_sha256: "5f8f04f6a3a892aaabbddb6cf273894493773960d4a325b105fee46eef4304f1"
                    .into(),
                idempotency_key: Some("k-up".into()),
                validity_s: 15,
            }
        );
        assert_eq!(
            s.content_digest,
            "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:"
        );
        assert_eq!(path_without_query("/a/b"), "/a/b");
        assert_eq!(path_without_query("/a?x=1?y"), "/a");
        assert_eq!(path_without_query("/?"), "/");
    }

    #[test]
    fn a_signature_over_this_dispatch_passes_and_goes_as_given() {
        for key in [Some("k-up"), None] {
            let s = Signing::new(&LINE, b"{}", key, 15);
            let sig = signed(&s, 15);
            assert_eq!(s.check(Some(&sig), &nonce()), Ok(()));
            let input = SignatureInput::parse(&sig.signature_input).unwrap();
            let mut want = COMPONENTS.map(String::from).to_vec();
            want.extend(key.map(|_| KEY_COMPONENT.to_string()));
            assert_eq!(input.components, want);
            assert_eq!(
                s.headers(&sig),
                [
                    Effect::SetRequestHeader(
                        "content-digest".into(),
                        signature::content_digest_of(b"{}")
                    ),
                    Effect::SetRequestHeader("signature-input".into(), sig.signature_input),
                    Effect::SetRequestHeader("signature".into(), sig.signature),
                ]
            );
        }
        // A shorter validity than asked is the ledger's to choose.
        let s = Signing::new(&LINE, b"{}", None, 15);
        assert_eq!(s.check(Some(&signed(&s, 5)), &nonce()), Ok(()));
    }

    #[test]
    fn a_missing_malformed_or_foreign_signature_is_unusable() {
        let s = Signing::new(&LINE, b"{}", Some("k-up"), 15);
        let good = signed(&s, 15);
        assert_eq!(s.check(None, &nonce()), Err(Unusable::Missing));
        let with = |input: String, sig: String| DispatchSignature {
            signature_input: input,
            signature: sig,
        };
        let malformed = [
            with(String::new(), good.signature.clone()),
            with(good.signature_input.clone(), String::new()),
            with("atmost=(\"@method\"".into(), good.signature.clone()),
            with(
                format!("other=(\"@path\"), {}", good.signature_input),
                good.signature.clone(),
            ),
            with(
                good.signature_input.replace("\" \"", "\"  \""),
                good.signature.clone(),
            ),
            with(
                good.signature_input.clone(),
                format!("atmost=:{}:", b64_encode(&[7; 63])),
            ),
            with(good.signature_input.clone(), "atmost=:!!:".into()),
            with(
                good.signature_input.clone(),
                format!("{}\r\nx: y", good.signature),
            ),
            with(
                good.signature_input.clone(),
                signature_header(&[7; 64]).replace("atmost", "other"),
            ),
        ];
        for sig in malformed {
            assert_eq!(
                s.check(Some(&sig), &nonce()),
                Err(Unusable::Malformed),
                "{sig:?}"
            );
        }
        let other_round = DispatchNonce {
            round: 2,
            ..nonce()
        };
        assert_eq!(
            s.check(Some(&good), &other_round),
            Err(Unusable::NotThisDispatch)
        );
        // Signed without the key header for a request that sends one, and the other way
        // round: the components differ. (Other covered values are in the signed base, which
        // only the verifier checks.)
        let keyless = Signing::new(&LINE, b"{}", None, 15);
        assert_eq!(
            s.check(Some(&signed(&keyless, 15)), &nonce()),
            Err(Unusable::NotThisDispatch)
        );
        assert_eq!(
            keyless.check(Some(&good), &nonce()),
            Err(Unusable::NotThisDispatch)
        );
        // Longer than asked, empty or reversed.
        for validity_s in [16, 0] {
            assert_eq!(
                s.check(Some(&signed(&s, validity_s)), &nonce()),
                Err(Unusable::NotThisDispatch),
                "{validity_s}"
            );
        }
        let reversed = with(
            good.signature_input
                .replace("created=1764680000", "created=1764680099"),
            good.signature.clone(),
        );
        assert_eq!(
            s.check(Some(&reversed), &nonce()),
            Err(Unusable::NotThisDispatch)
        );
        let extra = with(
            good.signature_input.replace(";tag=", ";x=\"1\";tag="),
            good.signature.clone(),
        );
        assert_eq!(
            s.check(Some(&extra), &nonce()),
            Err(Unusable::NotThisDispatch)
        );
        let no_keyid = with(
            good.signature_input
                .replace("keyid=\"kid-1\"", "keyid=\"\""),
            good.signature.clone(),
        );
        assert_eq!(
            s.check(Some(&no_keyid), &nonce()),
            Err(Unusable::NotThisDispatch)
        );
    }
}
