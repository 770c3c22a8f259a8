//! Reading a governed call's dispatch signature and checking everything but the key: the
//! headers' form, the parameters the ledger writes, the covered components, the nonce, the
//! validity window and the body's digest ([`read`]); then, with the key, the Ed25519
//! signature ([`Presented::verify`]). The signature base is rebuilt by
//! `atmost_protocol::signature`, the one definition the ledger signs with.

use atmost_protocol::signature::{
    self, DispatchNonce, SignatureHeaderError, SignatureInput, SignedRequest, ALG, COMPONENTS,
    KEY_COMPONENT, MAX_VALIDITY_S, TAG,
};
use atmost_protocol::{Denial, DenialCode};
use sha2::{Digest, Sha256};

/// The parameters the ledger writes, and so the only ones accepted.
pub const PARAMS: [&str; 6] = ["created", "expires", "keyid", "alg", "nonce", "tag"];

/// The request headers a signature check reads, every value of each as received.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SignedHead {
    /// `:authority` as received: it picks which of `verify.authorities` the signature is
    /// checked against, never stands for one.
    pub authority: String,
    pub signature_input: Vec<Vec<u8>>,
    pub signature: Vec<Vec<u8>>,
    pub content_digest: Vec<Vec<u8>>,
    pub idempotency_key: Vec<Vec<u8>>,
}

impl SignedHead {
    /// Reads the headers a signature check needs from Envoy's request header map.
    pub fn from_headers<N: AsRef<str>, V: AsRef<[u8]>>(
        headers: impl IntoIterator<Item = (N, V)>,
    ) -> SignedHead {
        let mut head = SignedHead::default();
        for (name, value) in headers {
            let value = value.as_ref().to_vec();
            match name.as_ref().to_ascii_lowercase().as_str() {
                ":authority" if head.authority.is_empty() => {
                    head.authority = String::from_utf8_lossy(&value).into_owned();
                }
                "signature-input" => head.signature_input.push(value),
                "signature" => head.signature.push(value),
                "content-digest" => head.content_digest.push(value),
                atmost_protocol::IDEMPOTENCY_KEY_HEADER => head.idempotency_key.push(value),
                _ => {}
            }
        }
        head
    }
}

/// Why a signature is refused: the denial's code and a message naming what is wrong
/// (never a header's value).
pub fn refusal(code: DenialCode, message: impl Into<String>) -> Denial {
    Denial::new(code, message)
}

fn malformed(what: impl std::fmt::Display) -> SignatureRefused {
    SignatureRefused::from(refusal(
        DenialCode::SignatureMalformed,
        format!("the dispatch signature is not the form the ledger writes: {what}"),
    ))
}

/// The field lines of one header as one value (RFC 9110 §5.3; RFC 9421 §2.1: each value
/// trimmed, joined by `", "`); `None` when a value is not text.
fn combined(values: &[Vec<u8>]) -> Option<String> {
    let mut parts = Vec::with_capacity(values.len());
    for v in values {
        parts.push(std::str::from_utf8(v).ok()?.trim_matches([' ', '\t']));
    }
    Some(parts.join(", "))
}

/// A refused signature: the denial, and the nonce it named when it could be read (a refusal
/// naming it can be proven to the ledger, see `atmost_protocol::tool_refusal`).
#[derive(Debug, Clone, PartialEq)]
pub struct SignatureRefused {
    pub denial: Box<Denial>,
    pub nonce: Option<String>,
}

impl From<Denial> for SignatureRefused {
    fn from(denial: Denial) -> SignatureRefused {
        SignatureRefused {
            denial: Box::new(denial),
            nonce: None,
        }
    }
}

/// A signature whose form, window and digest passed: what remains is the key.
#[derive(Debug, Clone, PartialEq)]
pub struct Presented {
    pub keyid: String,
    /// The signature base (RFC 9421 §2.5) of the request as received, with `@authority` one
    /// this verifier serves (`verify.authorities`): the request's own `:authority` when it is
    /// one of them, else each of them in turn (a route may have rewritten the host). The
    /// signature must verify over one: a signature made for another server never does.
    pub bases: Vec<String>,
    pub signature: [u8; 64],
    /// The `nonce` parameter, which names the dispatch (the replay cache's key).
    pub nonce: String,
    /// Unix seconds.
    pub expires: u64,
}

/// The parts of the received request the signature covers besides the headers.
#[derive(Debug, Clone, Copy)]
pub struct Received<'a> {
    pub method: &'a str,
    /// `:path` as received (the query is not covered).
    pub path: &'a str,
    pub body: &'a [u8],
    /// `params.name` of the call.
    pub tool: &'a str,
}

/// Checks everything a signature needs besides its key. `now` and `skew` are Unix seconds;
/// `authorities` are the names this verifier serves. A refusal made once the nonce is read
/// names it.
pub fn read(
    head: &SignedHead,
    request: Received<'_>,
    now: u64,
    skew: u64,
    authorities: &[String],
) -> Result<Presented, SignatureRefused> {
    let missing = || {
        refusal(
            DenialCode::SignatureMissing,
            "no `atmost` dispatch signature (Signature-Input and Signature): a governed tools/call must carry the one the ledger made when it let the call through",
        )
    };
    let header_error = |e: SignatureHeaderError, header: &str| match e {
        SignatureHeaderError::Missing => missing().into(),
        SignatureHeaderError::Malformed => malformed(format!(
            "`{header}` is not an RFC 8941 dictionary holding it"
        )),
    };
    if head.signature_input.is_empty() || head.signature.is_empty() {
        return Err(missing().into());
    }
    let input_text = combined(&head.signature_input)
        .ok_or_else(|| malformed("`Signature-Input` is not text"))?;
    let signature_text =
        combined(&head.signature).ok_or_else(|| malformed("`Signature` is not text"))?;
    let input =
        SignatureInput::parse(&input_text).map_err(|e| header_error(e, "Signature-Input"))?;
    let signature_bytes =
        signature::parse_signature(&signature_text).map_err(|e| header_error(e, "Signature"))?;
    let signature: [u8; 64] = signature_bytes
        .try_into()
        .map_err(|_| malformed("the signature is not 64 bytes (Ed25519)"))?;

    if let Some((name, _)) = input
        .params
        .iter()
        .find(|(name, _)| !PARAMS.contains(&name.as_str()))
    {
        return Err(malformed(format!(
            "parameter `{name}` is not one the ledger writes"
        )));
    }
    if input.string("tag") != Some(TAG) {
        return Err(malformed("`tag` must be \"atmost\""));
    }
    if input.params.iter().any(|(n, _)| n == "alg") && input.string("alg") != Some(ALG) {
        return Err(malformed("`alg` must be \"ed25519\""));
    }
    let (Some(created), Some(expires)) = (input.integer("created"), input.integer("expires"))
    else {
        return Err(malformed("`created` and `expires` must be integers"));
    };
    let keyid = input
        .string("keyid")
        .filter(|k| !k.is_empty())
        .ok_or_else(|| malformed("`keyid` must be a non-empty string"))?
        .to_string();
    let nonce = input
        .string("nonce")
        .ok_or_else(|| malformed("`nonce` must be a string"))?
        .to_string();
    let key_value = (!head.idempotency_key.is_empty())
        .then(|| combined(&head.idempotency_key))
        .map(|v| v.ok_or_else(|| malformed("`Idempotency-Key` is not text")))
        .transpose()?;
    let mut required: Vec<&str> = COMPONENTS.to_vec();
    if key_value.is_some() {
        required.push(KEY_COMPONENT);
    }
    if let Some(c) = required
        .iter()
        .find(|c| !input.components.iter().any(|have| have == *c))
    {
        return Err(malformed(format!("the component \"{c}\" is not covered")));
    }
    if expires <= created || expires - created > MAX_VALIDITY_S {
        return Err(malformed(format!(
            "`expires` must be after `created` and at most {MAX_VALIDITY_S} s later"
        )));
    }
    let dispatch = DispatchNonce::parse(&nonce)
        .ok_or_else(|| malformed("`nonce` is not <attempt>/<round>/<permit>/<tool>"))?;
    let naming = |r: SignatureRefused| SignatureRefused {
        nonce: Some(nonce.clone()),
        ..r
    };
    if dispatch.tool != request.tool {
        return Err(naming(SignatureRefused::from(refusal(
            DenialCode::SignatureInvalid,
            "the signature's nonce names another tool than this call's params.name",
        ))));
    }
    if created > now.saturating_add(skew) {
        return Err(naming(SignatureRefused::from(refusal(
            DenialCode::SignatureOutsideValidity,
            format!(
                "the signature was created in the future (more than {skew} s ahead of this clock)"
            ),
        ))));
    }
    if expires.saturating_add(skew) < now {
        return Err(naming(SignatureRefused::from(refusal(
            DenialCode::SignatureOutsideValidity,
            "the signature has expired",
        ))));
    }

    let digest_text = (!head.content_digest.is_empty())
        .then(|| combined(&head.content_digest))
        .flatten()
        .ok_or_else(|| naming(malformed("the request has no readable `Content-Digest`")))?;
    let digest = signature::parse_content_digest(&digest_text).map_err(|_| {
        naming(malformed(
            "`Content-Digest` has no sha-256 member of 32 bytes",
        ))
    })?;
    if digest.as_slice() != Sha256::digest(request.body).as_slice() {
        return Err(naming(SignatureRefused::from(refusal(
            DenialCode::ContentDigestMismatch,
            "Content-Digest is not the SHA-256 of the body received",
        ))));
    }

    let path = request.path.split('?').next().unwrap_or_default();
    // The authority the request names, when this verifier serves it; else each it serves
    // (a route may have rewritten the host after the gateway signed).
    let received = head.authority.to_ascii_lowercase();
    let candidates: Vec<&String> = match authorities.iter().find(|a| **a == received) {
        Some(named) => vec![named],
        None => authorities.iter().collect(),
    };
    let mut bases = Vec::with_capacity(candidates.len());
    for authority in candidates {
        let received = SignedRequest {
            method: request.method,
            authority,
            path,
            content_digest: &digest_text,
            idempotency_key: key_value.as_deref(),
        };
        bases.push(received.signature_base(&input).ok_or_else(|| {
            naming(malformed(
                "it covers a component this request lacks, an unknown one, or one twice",
            ))
        })?);
    }
    Ok(Presented {
        keyid,
        bases,
        signature,
        nonce,
        expires,
    })
}

impl Presented {
    /// Whether the Ed25519 signature verifies with `public_key` over the base of one of the
    /// authorities this verifier serves: a signature made for another server is refused.
    pub fn verify(&self, public_key: &[u8; 32]) -> Result<(), Denial> {
        let invalid = || {
            refusal(
                DenialCode::SignatureInvalid,
                "the Ed25519 signature does not verify with the key `keyid` names over this request at any authority this verifier serves",
            )
        };
        let key = ed25519_compact::PublicKey::from_slice(public_key).map_err(|_| invalid())?;
        let signature =
            ed25519_compact::Signature::from_slice(&self.signature).map_err(|_| invalid())?;
        self.bases
            .iter()
            .any(|base| key.verify(base.as_bytes(), &signature).is_ok())
            .then_some(())
            .ok_or_else(invalid)
    }

    /// Whether the signature can still be accepted at `now` (after a wait for the key set).
    pub fn still_valid(&self, now: u64, skew: u64) -> Result<(), Denial> {
        if self.expires.saturating_add(skew) < now {
            return Err(refusal(
                DenialCode::SignatureOutsideValidity,
                "the signature expired while its key was looked up",
            ));
        }
        Ok(())
    }
}
