//! Tool credentials in the ledger's custody (docs/design.md#the-agent-holds-no-credential).
//!
//! A team registers a tool's credential once (`PUT /admin/v1/credentials/{name}`, `atmost
//! credential set`): the header it goes in, its form, the Envoy route of the tool, and the
//! secret. Registering the name again is a rotation: a new version, which the next dispatch
//! sends. The secret is sealed before it reaches a store, with ChaCha20-Poly1305 under the
//! ledger's credential key (`--credential-key-file` / `ATMOST_CREDENTIAL_KEY`), bound to the
//! name, header, form and route it was registered with, and opened only to answer a dispatch
//! (or the filter's per-permit fetch). Nothing shows it again: every read but those two leaves
//! it in the store, and its types print `<redacted>`.

use std::fmt;

use atmost_protocol::closed_set;
use atmost_protocol::credential::{
    check_header_name, check_header_value, SecretValue, UpstreamCredential,
};
use atmost_protocol::signature::{b64url_decode, b64url_encode};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use serde::{Deserialize, Serialize};

use crate::clock::Millis;
use crate::error::LedgerError;
// Defined beside the attempt that keeps it, so the model imports nothing from here (this
// module imports the errors, which name the model's states); its column form stays here,
// beside the name rule it checks.
pub use crate::model::CredentialUse;

closed_set! {
    /// How a registered secret becomes its header's value.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum CredentialForm {
        /// `Bearer <secret>` (RFC 6750), for `authorization`.
        Bearer => "bearer";
        /// The secret as it is (`x-api-key: <secret>`).
        Raw => "raw";
    }
}

impl CredentialForm {
    /// The header value of `secret` in this form.
    fn value(self, secret: &str) -> String {
        match self {
            CredentialForm::Bearer => format!("Bearer {secret}"),
            CredentialForm::Raw => secret.to_string(),
        }
    }
}

/// Most routes one credential belongs to.
pub const MAX_ROUTES: usize = 16;

/// Longest credential name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;

/// Whether `name` may name a credential: 1 to [`MAX_NAME_BYTES`] of `a-z`, `0-9`, `.`, `_`, `-`.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "credential name {name:?} must be 1 to {MAX_NAME_BYTES} characters of a-z, 0-9, '.', '_', '-'"
        ))
    }
}

/// A credential as an operator registers it: the body of `PUT /admin/v1/credentials/{name}`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialSpec {
    /// The request header it goes in (any case; kept lowercase).
    pub header: String,
    pub form: CredentialForm,
    /// The Envoy route names (`xds.route_name`) of the tool's requests: 1 to
    /// [`MAX_ROUTES`], each once.
    pub routes: Vec<String>,
    /// The secret itself (for `bearer`, without the `Bearer ` prefix).
    pub secret: SecretValue,
}

impl fmt::Debug for CredentialSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CredentialSpec")
            .field("header", &self.header)
            .field("form", &self.form)
            .field("routes", &self.routes)
            .field("secret", &self.secret)
            .finish()
    }
}

impl CredentialSpec {
    /// Checks every field and answers the credential with its header lowercased; `Err` is the
    /// admin API's message, and never holds the secret.
    pub fn validate(mut self, name: &str) -> Result<CredentialSpec, String> {
        check_name(name)?;
        self.header = self.header.trim().to_ascii_lowercase();
        check_header_name(&self.header)?;
        let route_ok = |r: &String| {
            !r.is_empty()
                && r.len() <= 256
                && r.bytes().all(|b| (0x21..0x7f).contains(&b) && b != b',')
        };
        let mut seen = std::collections::BTreeSet::new();
        if self.routes.is_empty()
            || self.routes.len() > MAX_ROUTES
            || !self
                .routes
                .iter()
                .all(|r| route_ok(r) && seen.insert(r.clone()))
        {
            return Err(format!(
                "routes must be 1 to {MAX_ROUTES} Envoy route names, each once, of 1 to 256 \
                 printable ASCII characters without ','"
            ));
        }
        check_header_value(&self.form.value(self.secret.expose())).map_err(str::to_string)?;
        if self.secret.expose().starts_with("Bearer ") && self.form == CredentialForm::Bearer {
            return Err("with form bearer, give the secret without its \"Bearer \" prefix".into());
        }
        Ok(self)
    }
}

/// One version of a credential as a store keeps it. `sealed` is `None` on every read but the
/// one that answers a dispatch: the secret leaves the store only to be sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredCredential {
    pub name: String,
    pub version: u32,
    pub header: String,
    pub form: CredentialForm,
    pub routes: Vec<String>,
    /// `v1.` and the base64url of the nonce and the sealed secret.
    pub sealed: Option<String>,
    pub created_at_ms: Millis,
}

impl CredentialUse {
    /// How both stores keep it in one column: `name:version` (a name holds no `:`).
    pub fn to_column(&self) -> String {
        format!("{}:{}", self.name, self.version)
    }

    /// The inverse of [`to_column`](Self::to_column).
    pub fn from_column(text: &str) -> Result<CredentialUse, LedgerError> {
        text.rsplit_once(':')
            .and_then(|(name, v)| {
                Some(CredentialUse {
                    name: name.to_string(),
                    version: v.parse().ok()?,
                })
            })
            .filter(|u| check_name(&u.name).is_ok())
            .ok_or_else(|| LedgerError::Corrupt(format!("attempt credential {text:?}")))
    }
}

impl StoredCredential {
    pub fn use_ref(&self) -> CredentialUse {
        CredentialUse {
            name: self.name.clone(),
            version: self.version,
        }
    }
}

/// The ledger's key for the credentials it keeps: 32 bytes. `Debug` never shows it.
pub struct CredentialKey(LessSafeKey);

impl fmt::Debug for CredentialKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CredentialKey(<redacted>)")
    }
}

/// What the key is bound to besides the secret: a sealed secret copied to another name,
/// header, form or route does not open.
fn associated(name: &str, header: &str, form: CredentialForm, routes: &[String]) -> Vec<u8> {
    let routes = routes_column(routes);
    format!(
        "atmost-credential\0{name}\0{header}\0{}\0{routes}",
        form.as_str()
    )
    .into_bytes()
}

/// How both stores keep the routes in one column: joined by `,` (no route name holds one).
pub fn routes_column(routes: &[String]) -> String {
    routes.join(",")
}

/// The inverse of [`routes_column`].
pub fn routes_of_column(text: &str) -> Vec<String> {
    text.split(',').map(str::to_string).collect()
}

const SEALED_PREFIX: &str = "v1.";

impl CredentialKey {
    /// The key written as 64 hexadecimal digits (surrounding whitespace ignored): what
    /// `openssl rand -hex 32` prints.
    pub fn from_hex(text: &str) -> Result<CredentialKey, String> {
        let bytes = hex::decode(text.trim())
            .ok()
            .filter(|b| b.len() == 32)
            .ok_or("the credential key must be 64 hexadecimal digits (openssl rand -hex 32)")?;
        let key = UnboundKey::new(&CHACHA20_POLY1305, &bytes)
            .map_err(|_| "the credential key could not be used")?;
        Ok(CredentialKey(LessSafeKey::new(key)))
    }

    /// Seals `spec`'s secret (a fresh random nonce each time).
    pub fn seal(&self, name: &str, spec: &CredentialSpec) -> Result<String, LedgerError> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| LedgerError::Random(e.to_string()))?;
        let mut sealed = spec.secret.expose().as_bytes().to_vec();
        let aad = associated(name, &spec.header, spec.form, &spec.routes);
        self.0
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                &mut sealed,
            )
            .map_err(|_| LedgerError::Invariant("sealing a credential failed".into()))?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        Ok(format!("{SEALED_PREFIX}{}", b64url_encode(&out)))
    }

    /// Opens a stored version into what the filter sets. Fails when it was read without its
    /// secret, sealed under another key, or altered.
    pub fn open(&self, c: &StoredCredential) -> Result<UpstreamCredential, LedgerError> {
        let unreadable = || {
            LedgerError::Corrupt(format!(
                "credential {:?} version {} does not open with this ledger's credential key \
                 (another key, or altered)",
                c.name, c.version
            ))
        };
        let sealed = c.sealed.as_deref().ok_or_else(|| {
            LedgerError::Invariant("a credential read without its sealed secret".into())
        })?;
        let bytes = sealed
            .strip_prefix(SEALED_PREFIX)
            .and_then(b64url_decode)
            .filter(|b| b.len() > NONCE_LEN)
            .ok_or_else(unreadable)?;
        let (nonce, rest) = bytes.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| unreadable())?;
        let mut rest = rest.to_vec();
        let aad = associated(&c.name, &c.header, c.form, &c.routes);
        let secret = self
            .0
            .open_in_place(nonce, Aad::from(aad), &mut rest)
            .map_err(|_| unreadable())?;
        let secret = std::str::from_utf8(secret).map_err(|_| unreadable())?;
        Ok(UpstreamCredential {
            name: c.name.clone(),
            version: c.version,
            header: c.header.clone(),
            value: SecretValue::new(c.form.value(secret)),
            routes: c.routes.clone(),
        })
    }
}

/// What the admin API and the CLI show of a credential: never its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialView {
    pub name: String,
    pub version: u32,
    pub header: String,
    pub form: CredentialForm,
    pub routes: Vec<String>,
    /// RFC 3339 (UTC).
    pub created_at: String,
}

impl From<&StoredCredential> for CredentialView {
    fn from(c: &StoredCredential) -> Self {
        CredentialView {
            name: c.name.clone(),
            version: c.version,
            header: c.header.clone(),
            form: c.form,
            routes: c.routes.clone(),
            created_at: crate::clock::rfc3339(c.created_at_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    fn spec(secret: &str) -> CredentialSpec {
        CredentialSpec {
            header: "Authorization".into(),
            form: CredentialForm::Bearer,
            routes: vec!["pay_route".into(), "pay_sse".into()],
            secret: SecretValue::new(secret.into()),
        }
    }

    fn stored(name: &str, spec: &CredentialSpec, sealed: String) -> StoredCredential {
        StoredCredential {
            name: name.into(),
            version: 3,
            header: spec.header.clone(),
            form: spec.form,
            routes: spec.routes.clone(),
            sealed: Some(sealed),
            created_at_ms: 0,
        }
    }

    #[test]
    fn a_sealed_secret_opens_into_its_header_value_and_is_not_in_the_stored_text() {
        let key = CredentialKey::from_hex(KEY).unwrap();
        let spec = spec("sk-live-0123456789").validate("pay").unwrap();
        assert_eq!(spec.header, "authorization");
        let sealed = key.seal("pay", &spec).unwrap();
        assert!(!sealed.contains("sk-live"), "{sealed}");
        assert_ne!(
            sealed,
            key.seal("pay", &spec).unwrap(),
            "a fresh nonce each time"
        );
        let opened = key.open(&stored("pay", &spec, sealed)).unwrap();
        assert_eq!(opened.value.expose(), "Bearer sk-live-0123456789");
        assert_eq!(
            (opened.header.as_str(), opened.version),
            ("authorization", 3)
        );
        assert_eq!(opened.routes, ["pay_route", "pay_sse"]);

        let raw = CredentialSpec {
            header: "x-api-key".into(),
            form: CredentialForm::Raw,
            ..spec.clone()
        };
        let sealed = key.seal("pay", &raw).unwrap();
        let opened = key.open(&stored("pay", &raw, sealed)).unwrap();
        assert_eq!(opened.value.expose(), "sk-live-0123456789");
    }

    #[test]
    fn a_sealed_secret_opens_under_its_own_key_name_header_and_route_only() {
        let key = CredentialKey::from_hex(KEY).unwrap();
        let spec = spec("sk-live-0123456789").validate("pay").unwrap();
        let sealed = key.seal("pay", &spec).unwrap();
        let other_key = CredentialKey::from_hex(&KEY.replace("00", "ff")).unwrap();
        assert!(other_key
            .open(&stored("pay", &spec, sealed.clone()))
            .is_err());
        assert!(key.open(&stored("other", &spec, sealed.clone())).is_err());
        let mut moved = stored("pay", &spec, sealed.clone());
        moved.header = "x-api-key".into();
        assert!(key.open(&moved).is_err());
        let mut moved = stored("pay", &spec, sealed.clone());
        moved.routes = vec!["pay_route".into()];
        assert!(key.open(&moved).is_err());
        let mut altered = sealed.into_bytes();
        let last = altered.len() - 1;
        altered[last] = if altered[last] == b'A' { b'B' } else { b'A' };
        let altered = String::from_utf8(altered).unwrap();
        let e = key.open(&stored("pay", &spec, altered)).unwrap_err();
        assert!(!e.to_string().contains("sk-live"));
        let mut unread = stored("pay", &spec, String::new());
        unread.sealed = None;
        assert!(key.open(&unread).is_err());
    }

    #[test]
    fn keys_names_and_specs_are_checked_and_errors_never_hold_the_secret() {
        for bad in ["", "00", &"0".repeat(63), &"g".repeat(64)] {
            assert!(CredentialKey::from_hex(bad).is_err(), "{bad:?}");
        }
        assert!(CredentialKey::from_hex(&format!(" {KEY}\n")).is_ok());
        for bad in ["", "Pay", "a:b", "a b", &"a".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name("stripe-live_2.eu").is_ok());
        let secret = "sk-live-\r\nx";
        let e = spec(secret).validate("pay").unwrap_err();
        assert!(!e.contains("sk-live"), "{e}");
        assert!(spec("Bearer abc").validate("pay").is_err());
        let mut s = spec("abc");
        s.header = "atmost-permit".into();
        assert!(s.validate("pay").is_err());
        for routes in [
            vec![],
            vec![String::new()],
            vec!["a,b".into()],
            vec!["a".into(), "a".into()],
        ] {
            let mut s = spec("abc");
            s.routes = routes;
            assert!(s.validate("pay").is_err());
        }
        assert!(!format!("{:?}", spec("sk-live-x")).contains("sk-live"));
        assert!(!format!("{:?}", CredentialKey::from_hex(KEY).unwrap()).contains("0102"));
    }

    #[test]
    fn a_credential_use_round_trips_through_its_column() {
        let u = CredentialUse {
            name: "pay.eu".into(),
            version: 12,
        };
        assert_eq!(u.to_column(), "pay.eu:12");
        assert_eq!(CredentialUse::from_column("pay.eu:12").unwrap(), u);
        for bad in ["pay", "pay:x", ":1", "Pay:1"] {
            assert!(CredentialUse::from_column(bad).is_err(), "{bad:?}");
        }
    }
}
