//! The dispatch signature: an RFC 9421 HTTP Message Signature by the ledger's Ed25519 key over
//! the request the filter sends upstream, with the body bound by its RFC 9530
//! `Content-Digest`. The ledger signs ([`SignedRequest::signature_base`]); the verifier at
//! the tool parses ([`SignatureInput::parse`]) and rebuilds the same base. Both go through
//! this one module, so signer and verifier cannot disagree on a byte.
//!
//! The form (docs/signatures.md):
//!
//! ```text
//! Content-Digest: sha-256=:<base64 of the body's SHA-256>:
//! Signature-Input: atmost=("@method" "@authority" "@path" "content-digest" "idempotency-key");created=1764680000;expires=1764680015;keyid="<RFC 7638 thumbprint>";alg="ed25519";nonce="<attempt>/<round>/<permit>/<tool>";tag="atmost"
//! Signature: atmost=:<base64 of the 64-byte Ed25519 signature>:
//! ```
//!
//! `"idempotency-key"` is covered only when the upstream receives that header. The call is
//! named by `nonce`, one of the six parameters RFC 9421 §6.3.2 registers: its value must be
//! unique per signature, and `attempt/round` is (attempt ids carry 80 random bits; each
//! round is signed once). Verifiers written to the RFC refuse parameters outside that
//! registry (the PyPI `http-message-signatures` does), so no private parameter is used.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The signature's label in `Signature-Input` and `Signature`.
pub const LABEL: &str = "atmost";
/// The `tag` parameter: RFC 9421's application tag, by which a verifier picks this signature.
pub const TAG: &str = "atmost";
/// The `alg` parameter (RFC 9421 §3.3.6).
pub const ALG: &str = "ed25519";
/// Where the ledger publishes its public keys as a JWKS (no authentication).
pub const KEYS_PATH: &str = "/v1/keys";
/// Longest validity (`expires - created`) the ledger signs, in seconds. A key stays
/// published this long after it stops signing, so every signature it made can be checked.
pub const MAX_VALIDITY_S: u64 = 300;

/// The covered components, in signing order, without and with the forwarded key.
pub const COMPONENTS: [&str; 4] = ["@method", "@authority", "@path", "content-digest"];
/// The fifth covered component, when the upstream receives an `Idempotency-Key` header: that
/// header's name (RFC 9421 §2.1).
pub const KEY_COMPONENT: &str = crate::IDEMPOTENCY_KEY_HEADER;

/// What the filter will send upstream if the call is dispatched: the parts the signature
/// covers. Sent in [`crate::AuthorizeRequest::dispatch`]; the ledger signs exactly these.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchTarget {
    /// `:method` as sent upstream.
    pub method: String,
    /// `:authority` as sent upstream, lowercased (RFC 9421 §2.2.3).
    pub authority: String,
    /// `:path` without its query (RFC 9421 §2.2.6).
    pub path: String,
    /// Lowercase hex SHA-256 of the exact body sent upstream (after the key rewrite).
    pub body_sha256: String,
    /// The `Idempotency-Key` header value the upstream receives, when it receives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Seconds from `created` to `expires`: the filter's bound on how long the request may
    /// take to reach the tool (at most the route timeout; the ledger caps it at
    /// [`MAX_VALIDITY_S`]).
    pub validity_s: u64,
}

impl DispatchTarget {
    /// What a signer signs for the dispatch of this target that `nonce` names, created at
    /// `created` (Unix seconds) and valid for `validity_s`: the signature input (its
    /// [`SignatureInput::header_value`] is the `Signature-Input` header) and the signature
    /// base. `None` when `body_sha256` is not 64 hex digits, or a covered value cannot be
    /// signed (a line break).
    pub fn to_sign(
        &self,
        created: u64,
        keyid: &str,
        nonce: &DispatchNonce,
    ) -> Option<(SignatureInput, String)> {
        let content_digest = content_digest_from_hex(&self.body_sha256)?;
        let request = SignedRequest {
            method: &self.method,
            authority: &self.authority,
            path: &self.path,
            content_digest: &content_digest,
            idempotency_key: self.idempotency_key.as_deref(),
        };
        let input = request.signature_params(&SignatureParams {
            created,
            expires: created.saturating_add(self.validity_s),
            keyid: keyid.to_string(),
            nonce: nonce.encode(),
        });
        let base = request.signature_base(&input)?;
        Some((input, base))
    }
}

/// The two header values a signed dispatch carries besides `Content-Digest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchSignature {
    /// The whole `Signature-Input` value: `atmost=(...);created=...`.
    pub signature_input: String,
    /// The whole `Signature` value: `atmost=:<base64>:`.
    pub signature: String,
}

/// Which dispatch a signature is for, carried in the `nonce` parameter as
/// `<attempt>/<round>/<permit>/<tool>`, the tool percent-encoded (every byte outside
/// `A-Z a-z 0-9 - . _ ~`), so the value is printable ASCII without `"` or `\`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchNonce {
    pub attempt_id: String,
    pub round: u32,
    pub permit_id: String,
    pub tool: String,
}

impl DispatchNonce {
    pub fn encode(&self) -> String {
        format!(
            "{}/{}/{}/{}",
            self.attempt_id,
            self.round,
            self.permit_id,
            percent_encode(&self.tool)
        )
    }

    /// The dispatch a nonce names; `None` unless it has exactly our form.
    pub fn parse(nonce: &str) -> Option<DispatchNonce> {
        let mut parts = nonce.splitn(4, '/');
        let attempt_id = parts.next()?;
        let round = parts.next()?;
        let permit_id = parts.next()?;
        let tool = percent_decode(parts.next()?)?;
        let id_ok =
            |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !id_ok(attempt_id) || !id_ok(permit_id) || !round.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(DispatchNonce {
            attempt_id: attempt_id.to_string(),
            round: round.parse().ok()?,
            permit_id: permit_id.to_string(),
            tool,
        })
    }
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if unreserved(b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = s.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b if unreserved(b) => {
                out.push(b);
                i += 1;
            }
            _ => return None,
        }
    }
    String::from_utf8(out).ok()
}

/// The signature parameters, in the order they are serialized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureParams {
    /// Unix seconds.
    pub created: u64,
    /// Unix seconds.
    pub expires: u64,
    /// The signing key's RFC 7638 thumbprint ([`jwk_thumbprint`]).
    pub keyid: String,
    /// [`DispatchNonce::encode`].
    pub nonce: String,
}

/// The covered parts of one request, as sent (signer) or as received (verifier).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedRequest<'a> {
    pub method: &'a str,
    pub authority: &'a str,
    pub path: &'a str,
    /// The `Content-Digest` value ([`content_digest`]).
    pub content_digest: &'a str,
    /// The `Idempotency-Key` value, when the request carries one.
    pub idempotency_key: Option<&'a str>,
}

impl SignedRequest<'_> {
    /// The component identifiers this request's signature covers, in order.
    pub fn components(&self) -> Vec<&'static str> {
        let mut c = COMPONENTS.to_vec();
        if self.idempotency_key.is_some() {
            c.push(KEY_COMPONENT);
        }
        c
    }

    fn component_value(&self, name: &str) -> Option<&str> {
        match name {
            "@method" => Some(self.method),
            "@authority" => Some(self.authority),
            "@path" => Some(self.path),
            "content-digest" => Some(self.content_digest),
            KEY_COMPONENT => self.idempotency_key,
            _ => None,
        }
    }

    /// The `@signature-params` value the signer writes: this request's components and
    /// `params`, serialized as RFC 8941 (RFC 9421 §2.3).
    pub fn signature_params(&self, params: &SignatureParams) -> SignatureInput {
        SignatureInput {
            components: self.components().into_iter().map(str::to_string).collect(),
            params: vec![
                ("created".into(), Param::Integer(params.created)),
                ("expires".into(), Param::Integer(params.expires)),
                ("keyid".into(), Param::String(params.keyid.clone())),
                ("alg".into(), Param::String(ALG.into())),
                ("nonce".into(), Param::String(params.nonce.clone())),
                ("tag".into(), Param::String(TAG.into())),
            ],
        }
    }

    /// The signature base (RFC 9421 §2.5) of this request under `input`: one line per
    /// covered component, then `"@signature-params"`. `None` when `input` covers a component
    /// this request does not have, or an unknown one, or one twice.
    pub fn signature_base(&self, input: &SignatureInput) -> Option<String> {
        let mut base = String::new();
        for (i, name) in input.components.iter().enumerate() {
            if input.components[..i].contains(name) {
                return None;
            }
            let value = self.component_value(name)?;
            if value.contains('\n') || value.contains('\r') {
                return None;
            }
            base.push_str(&format!("\"{name}\": {}\n", value.trim()));
        }
        base.push_str(&format!("\"@signature-params\": {}", input.serialize()));
        Some(base)
    }
}

/// One signature parameter's value (the types RFC 9421's registered parameters use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Param {
    Integer(u64),
    String(String),
}

/// The inner list of one `Signature-Input` member: covered components and parameters in
/// their received order (the order is part of what is signed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureInput {
    pub components: Vec<String>,
    pub params: Vec<(String, Param)>,
}

/// Why a signature's headers could not be read. Each is a refusal reason of the verifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureHeaderError {
    /// No `atmost` member in `Signature-Input` or `Signature`.
    Missing,
    /// The header is not the structured field RFC 9421 (and RFC 8941) defines.
    Malformed,
}

impl SignatureInput {
    /// The RFC 8941 serialization: `("a" "b");name=value...` (strings quoted, `\` and `"`
    /// escaped; integers bare).
    pub fn serialize(&self) -> String {
        let mut out = String::from("(");
        for (i, c) in self.components.iter().enumerate() {
            if i > 0 {
                out.push(' ');
            }
            push_sf_string(&mut out, c);
        }
        out.push(')');
        for (name, value) in &self.params {
            out.push(';');
            out.push_str(name);
            out.push('=');
            match value {
                Param::Integer(n) => out.push_str(&n.to_string()),
                Param::String(s) => push_sf_string(&mut out, s),
            }
        }
        out
    }

    /// The whole `Signature-Input` header value for this input under [`LABEL`].
    pub fn header_value(&self) -> String {
        format!("{LABEL}={}", self.serialize())
    }

    /// The [`LABEL`] member of a `Signature-Input` header value (other members are skipped).
    pub fn parse(header: &str) -> Result<SignatureInput, SignatureHeaderError> {
        let member = dictionary_member(header, LABEL)?;
        let mut p = Cursor::new(member);
        let input = p.inner_list()?;
        p.ows();
        if !p.done() {
            return Err(SignatureHeaderError::Malformed);
        }
        Ok(input)
    }

    /// A parameter's integer value.
    pub fn integer(&self, name: &str) -> Option<u64> {
        self.params.iter().find_map(|(n, v)| match v {
            Param::Integer(i) if n == name => Some(*i),
            _ => None,
        })
    }

    /// A parameter's string value.
    pub fn string(&self, name: &str) -> Option<&str> {
        self.params.iter().find_map(|(n, v)| match v {
            Param::String(s) if n == name => Some(s.as_str()),
            _ => None,
        })
    }
}

/// The 64 signature bytes of the [`LABEL`] member of a `Signature` header value.
pub fn parse_signature(header: &str) -> Result<Vec<u8>, SignatureHeaderError> {
    let member = dictionary_member(header, LABEL)?;
    let mut p = Cursor::new(member);
    let bytes = p.byte_sequence()?;
    p.ows();
    if !p.done() {
        return Err(SignatureHeaderError::Malformed);
    }
    Ok(bytes)
}

/// The `Signature` header value for a signature's bytes.
pub fn signature_header(signature: &[u8]) -> String {
    format!("{LABEL}=:{}:", b64_encode(signature))
}

/// The `Content-Digest` value (RFC 9530) for a body's SHA-256.
pub fn content_digest(sha256: &[u8]) -> String {
    format!("sha-256=:{}:", b64_encode(sha256))
}

/// The `Content-Digest` value for a lowercase hex SHA-256; `None` when it is not 64 hex digits.
pub fn content_digest_from_hex(hex: &str) -> Option<String> {
    Some(content_digest(&hex_decode(hex)?))
}

/// The `Content-Digest` value of a body.
pub fn content_digest_of(body: &[u8]) -> String {
    content_digest(&Sha256::digest(body))
}

/// The `sha-256` member of a `Content-Digest` header value (other algorithms are skipped).
pub fn parse_content_digest(header: &str) -> Result<Vec<u8>, SignatureHeaderError> {
    let member = dictionary_member(header, "sha-256")?;
    let mut p = Cursor::new(member);
    let bytes = p.byte_sequence()?;
    p.ows();
    if !p.done() || bytes.len() != 32 {
        return Err(SignatureHeaderError::Malformed);
    }
    Ok(bytes)
}

/// An Ed25519 public key as a JWK (RFC 8037): what `GET /v1/keys` lists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Jwk {
    /// `OKP`.
    pub kty: String,
    /// `Ed25519`.
    pub crv: String,
    /// The 32-byte public key, base64url without padding.
    pub x: String,
    /// [`jwk_thumbprint`] of the key: the `keyid` of its signatures and the `kid` of its JWSs.
    pub kid: String,
    /// `EdDSA` (RFC 8037 §3.1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alg: Option<String>,
    /// `sig`.
    #[serde(default, rename = "use", skip_serializing_if = "Option::is_none")]
    pub use_: Option<String>,
}

impl Jwk {
    /// The JWK of a 32-byte Ed25519 public key.
    pub fn ed25519(public_key: &[u8]) -> Jwk {
        let x = b64url_encode(public_key);
        Jwk {
            kid: jwk_thumbprint(&x),
            kty: "OKP".into(),
            crv: "Ed25519".into(),
            x,
            alg: Some("EdDSA".into()),
            use_: Some("sig".into()),
        }
    }

    /// The 32 public-key bytes, when this is an Ed25519 key whose `kid` is its thumbprint.
    pub fn ed25519_public_key(&self) -> Option<[u8; 32]> {
        if self.kty != "OKP" || self.crv != "Ed25519" || self.kid != jwk_thumbprint(&self.x) {
            return None;
        }
        b64url_decode(&self.x)?.try_into().ok()
    }
}

/// A JWK Set (RFC 7517 §5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Jwks {
    pub keys: Vec<Jwk>,
}

/// The RFC 7638 thumbprint of an Ed25519 JWK (RFC 8037 §2), base64url: SHA-256 over
/// `{"crv":"Ed25519","kty":"OKP","x":"<x>"}`, members in that order with no whitespace.
pub fn jwk_thumbprint(x: &str) -> String {
    let canonical = format!(r#"{{"crv":"Ed25519","kty":"OKP","x":"{x}"}}"#);
    b64url_encode(&Sha256::digest(canonical.as_bytes()))
}

fn push_sf_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

/// The text of one member's value in an RFC 8941 Dictionary, `key=` excluded. Members are
/// split at top-level commas (outside strings, byte sequences and inner lists).
fn dictionary_member<'h>(header: &'h str, key: &str) -> Result<&'h str, SignatureHeaderError> {
    let bytes = header.as_bytes();
    let (mut start, mut depth, mut in_string, mut escaped) = (0usize, 0i32, false, false);
    let mut members = Vec::new();
    for (i, &b) in bytes.iter().enumerate() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'(' => depth += 1,
            b')' => depth -= 1,
            b',' if depth == 0 => {
                members.push(&header[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return Err(SignatureHeaderError::Malformed);
        }
    }
    if in_string || depth != 0 {
        return Err(SignatureHeaderError::Malformed);
    }
    members.push(&header[start..]);
    let mut found = None;
    for m in members {
        let m = m.trim_matches([' ', '\t']);
        let Some((name, value)) = m.split_once('=') else {
            continue;
        };
        if name == key {
            // RFC 8941 §4.2.2: a repeated key keeps the last value; a signature header with
            // two of ours is refused instead, as the signer never writes one.
            if found.is_some() {
                return Err(SignatureHeaderError::Malformed);
            }
            found = Some(value);
        }
    }
    found.ok_or(SignatureHeaderError::Missing)
}

/// A reader of the small RFC 8941 subset signatures use.
struct Cursor<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a str) -> Self {
        Cursor {
            s: s.as_bytes(),
            i: 0,
        }
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn done(&self) -> bool {
        self.i >= self.s.len()
    }
    fn ows(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.i += 1;
        }
    }
    fn eat(&mut self, b: u8) -> Result<(), SignatureHeaderError> {
        if self.peek() == Some(b) {
            self.i += 1;
            Ok(())
        } else {
            Err(SignatureHeaderError::Malformed)
        }
    }
    fn string(&mut self) -> Result<String, SignatureHeaderError> {
        self.eat(b'"')?;
        let mut out = String::new();
        loop {
            match self.peek().ok_or(SignatureHeaderError::Malformed)? {
                b'"' => {
                    self.i += 1;
                    return Ok(out);
                }
                b'\\' => {
                    self.i += 1;
                    match self.peek() {
                        Some(c @ (b'"' | b'\\')) => out.push(char::from(c)),
                        _ => return Err(SignatureHeaderError::Malformed),
                    }
                    self.i += 1;
                }
                c @ 0x20..=0x7e => {
                    out.push(char::from(c));
                    self.i += 1;
                }
                _ => return Err(SignatureHeaderError::Malformed),
            }
        }
    }
    fn key(&mut self) -> Result<String, SignatureHeaderError> {
        let start = self.i;
        match self.peek() {
            Some(b'a'..=b'z' | b'*') => self.i += 1,
            _ => return Err(SignatureHeaderError::Malformed),
        }
        while matches!(
            self.peek(),
            Some(b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*')
        ) {
            self.i += 1;
        }
        Ok(String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }
    fn integer(&mut self) -> Result<u64, SignatureHeaderError> {
        let start = self.i;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
        let digits = &self.s[start..self.i];
        if digits.is_empty() || digits.len() > 15 {
            return Err(SignatureHeaderError::Malformed);
        }
        std::str::from_utf8(digits)
            .ok()
            .and_then(|d| d.parse().ok())
            .ok_or(SignatureHeaderError::Malformed)
    }
    fn byte_sequence(&mut self) -> Result<Vec<u8>, SignatureHeaderError> {
        self.eat(b':')?;
        let start = self.i;
        while self.peek().is_some_and(|c| c != b':') {
            self.i += 1;
        }
        let text = std::str::from_utf8(&self.s[start..self.i])
            .map_err(|_| SignatureHeaderError::Malformed)?;
        self.eat(b':')?;
        b64_decode(text).ok_or(SignatureHeaderError::Malformed)
    }
    fn inner_list(&mut self) -> Result<SignatureInput, SignatureHeaderError> {
        self.eat(b'(')?;
        let mut components = Vec::new();
        loop {
            while self.peek() == Some(b' ') {
                self.i += 1;
            }
            if self.peek() == Some(b')') {
                self.i += 1;
                break;
            }
            components.push(self.string()?);
            // Component parameters (`;sf`, `;key=...`) are not used by this signature.
            if !matches!(self.peek(), Some(b' ' | b')')) {
                return Err(SignatureHeaderError::Malformed);
            }
        }
        let mut params = Vec::new();
        while self.peek() == Some(b';') {
            self.i += 1;
            let name = self.key()?;
            self.eat(b'=')?;
            let value = match self.peek() {
                Some(b'"') => Param::String(self.string()?),
                Some(b'0'..=b'9') => Param::Integer(self.integer()?),
                _ => return Err(SignatureHeaderError::Malformed),
            };
            if params.iter().any(|(n, _)| *n == name) {
                return Err(SignatureHeaderError::Malformed);
            }
            params.push((name, value));
        }
        Ok(SignatureInput { components, params })
    }
}

fn hex_decode(hex: &str) -> Option<Vec<u8>> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;

/// Standard base64 with padding (RFC 8941 byte sequences).
pub fn b64_encode(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}
/// Standard base64 with padding; `None` when it is not.
pub fn b64_decode(text: &str) -> Option<Vec<u8>> {
    STANDARD.decode(text).ok()
}
/// base64url without padding (JOSE).
pub fn b64url_encode(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}
/// base64url without padding; `None` when it is not.
pub fn b64url_decode(text: &str) -> Option<Vec<u8>> {
    URL_SAFE_NO_PAD.decode(text).ok()
}

#[cfg(test)]
mod tests;
