//! The ledger's signing keys: Ed25519 key pairs kept in the store, one active (it signs), the
//! retired ones still published until every signature they made has expired.
//!
//! The store keeps each key's PKCS#8 document beside its public half, as it keeps the token
//! hashes: the ledger's own data, shared by every replica on the store, so they all sign with
//! the same key and publish the same set. The private half leaves the store only into a
//! [`SigningKey`], whose `Debug` shows the key id and times, never the key.

use std::fmt;

use atmost_protocol::signature::{
    b64url_decode, b64url_encode, jwk_thumbprint, Jwk, MAX_VALIDITY_S,
};
use ring::rand::SystemRandom;
use ring::signature::{Ed25519KeyPair, KeyPair};

use crate::clock::Millis;
use crate::error::LedgerError;

/// Seconds a retired key stays published beyond the longest validity it can have signed
/// ([`MAX_VALIDITY_S`]): room for a replica that still signs with a key it cached before
/// another replica retired it, and for clocks that differ a little.
pub const PUBLICATION_MARGIN_S: u64 = 60;

/// How long a retired key stays published after it stopped signing, in milliseconds.
pub const PUBLISHED_AFTER_RETIREMENT_MS: Millis =
    ((MAX_VALIDITY_S + PUBLICATION_MARGIN_S) * 1000) as Millis;

/// A PKCS#8 document (RFC 5958, base64url) as stored. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct PrivateKeyText(String);

impl PrivateKeyText {
    pub fn new(text: String) -> Self {
        PrivateKeyText(text)
    }

    /// The stored text, for the store's write and nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for PrivateKeyText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PrivateKeyText(<redacted>)")
    }
}

/// One row of `signing_keys` as a store reads or writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSigningKey {
    /// The RFC 7638 thumbprint of the public key's JWK.
    pub kid: String,
    /// The 32-byte public key, base64url (the JWK's `x`).
    pub public_key: String,
    /// The private key; `None` when the read did not select it (every read but the active
    /// key's).
    pub private_pkcs8: Option<PrivateKeyText>,
    pub created_at_ms: Millis,
    pub retired_at_ms: Option<Millis>,
}

impl StoredSigningKey {
    /// What may be shown of the key.
    pub fn public(&self) -> PublicSigningKey {
        PublicSigningKey {
            kid: self.kid.clone(),
            x: self.public_key.clone(),
            created_at_ms: self.created_at_ms,
            retired_at_ms: self.retired_at_ms,
        }
    }
}

/// A key without its private half: what `GET /v1/keys` publishes and the admin API lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicSigningKey {
    pub kid: String,
    /// The 32-byte public key, base64url.
    pub x: String,
    pub created_at_ms: Millis,
    /// When it stopped signing; `None` while it is the active key.
    pub retired_at_ms: Option<Millis>,
}

impl PublicSigningKey {
    /// Until when it is published: `None` while it signs, else its retirement plus
    /// [`PUBLISHED_AFTER_RETIREMENT_MS`].
    pub fn published_until_ms(&self) -> Option<Millis> {
        self.retired_at_ms
            .map(|r| r.saturating_add(PUBLISHED_AFTER_RETIREMENT_MS))
    }

    /// Whether `GET /v1/keys` lists it at `now`: while it signs, and until its publication
    /// ends (that instant included).
    pub fn is_published(&self, now: Millis) -> bool {
        self.published_until_ms().is_none_or(|until| now <= until)
    }

    /// Its JWK. A stored key whose id is not its public key's thumbprint is corrupt: a
    /// verifier would look it up under the wrong id.
    pub fn jwk(&self) -> Result<Jwk, LedgerError> {
        let corrupt = || {
            LedgerError::Corrupt(format!(
                "signing key {}: stored public key is not one",
                self.kid
            ))
        };
        let public: [u8; 32] = b64url_decode(&self.x)
            .ok_or_else(corrupt)?
            .try_into()
            .map_err(|_| corrupt())?;
        let jwk = Jwk::ed25519(&public);
        if jwk.kid != self.kid {
            return Err(LedgerError::Corrupt(format!(
                "signing key {}: the id is not the public key's thumbprint",
                self.kid
            )));
        }
        Ok(jwk)
    }
}

/// A key that can sign: the active one, read from the store.
pub struct SigningKey {
    public: PublicSigningKey,
    pair: Ed25519KeyPair,
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SigningKey")
            .field("kid", &self.public.kid)
            .field("created_at_ms", &self.public.created_at_ms)
            .field("retired_at_ms", &self.public.retired_at_ms)
            .finish_non_exhaustive()
    }
}

impl SigningKey {
    /// A new key created at `now`, and its row to store.
    pub fn generate(now: Millis) -> Result<(SigningKey, StoredSigningKey), LedgerError> {
        let document = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new())
            .map_err(|_| LedgerError::Random("cannot generate an Ed25519 key".into()))?;
        let pair = Ed25519KeyPair::from_pkcs8(document.as_ref())
            .map_err(|_| LedgerError::Invariant("a generated Ed25519 key does not parse".into()))?;
        let x = b64url_encode(pair.public_key().as_ref());
        let row = StoredSigningKey {
            kid: jwk_thumbprint(&x),
            public_key: x,
            private_pkcs8: Some(PrivateKeyText::new(b64url_encode(document.as_ref()))),
            created_at_ms: now,
            retired_at_ms: None,
        };
        Ok((
            SigningKey {
                public: row.public(),
                pair,
            },
            row,
        ))
    }

    /// The key a stored row holds. The row must hold a private key that is an Ed25519 PKCS#8
    /// document whose public half is the stored one, under its thumbprint: anything else is
    /// [`LedgerError::Corrupt`] (the error names the key id, never the key).
    pub fn from_stored(row: &StoredSigningKey) -> Result<SigningKey, LedgerError> {
        let corrupt = |what: &str| LedgerError::Corrupt(format!("signing key {}: {what}", row.kid));
        let text = row
            .private_pkcs8
            .as_ref()
            .ok_or_else(|| corrupt("no private key was read"))?;
        let document = b64url_decode(text.expose())
            .ok_or_else(|| corrupt("the private key is not base64url"))?;
        let pair = Ed25519KeyPair::from_pkcs8(&document)
            .map_err(|_| corrupt("the private key is not an Ed25519 PKCS#8 document"))?;
        if b64url_encode(pair.public_key().as_ref()) != row.public_key {
            return Err(corrupt(
                "the private key does not belong to the stored public key",
            ));
        }
        let public = row.public();
        public.jwk()?;
        Ok(SigningKey { public, pair })
    }

    pub fn kid(&self) -> &str {
        &self.public.kid
    }

    /// What may be shown of the key.
    pub fn public(&self) -> &PublicSigningKey {
        &self.public
    }

    /// The Ed25519 signature (64 bytes) of `message`.
    pub fn sign(&self, message: &[u8]) -> Vec<u8> {
        self.pair.sign(message).as_ref().to_vec()
    }
}

/// What a rotation did: the key that signs from now on, and the one it replaced (`None` when
/// there was no active key).
#[derive(Debug)]
pub struct Rotation {
    pub active: SigningKey,
    pub retired: Option<PublicSigningKey>,
}

#[cfg(test)]
mod tests {
    use ring::signature::{UnparsedPublicKey, ED25519};

    use super::*;

    #[test]
    fn a_generated_key_reads_back_from_its_row_and_signs_verifiably() {
        let (key, row) = SigningKey::generate(1_000).unwrap();
        let again = SigningKey::from_stored(&row).unwrap();
        assert_eq!(again.kid(), key.kid());
        assert_eq!(key.public().jwk().unwrap().kid, key.kid());
        let signature = again.sign(b"base");
        assert_eq!(signature.len(), 64);
        let public = b64url_decode(&row.public_key).unwrap();
        assert!(UnparsedPublicKey::new(&ED25519, &public)
            .verify(b"base", &signature)
            .is_ok());
        assert!(UnparsedPublicKey::new(&ED25519, &public)
            .verify(b"other", &signature)
            .is_err());
    }

    #[test]
    fn a_row_whose_parts_do_not_match_is_corrupt() {
        let (_, row) = SigningKey::generate(1_000).unwrap();
        let (_, other) = SigningKey::generate(1_000).unwrap();
        let cases = [
            StoredSigningKey {
                private_pkcs8: Some(PrivateKeyText::new("not base64url!".into())),
                ..row.clone()
            },
            StoredSigningKey {
                private_pkcs8: Some(PrivateKeyText::new(b64url_encode(b"not a key"))),
                ..row.clone()
            },
            StoredSigningKey {
                private_pkcs8: other.private_pkcs8.clone(),
                ..row.clone()
            },
            StoredSigningKey {
                kid: other.kid.clone(),
                ..row.clone()
            },
            StoredSigningKey {
                private_pkcs8: None,
                ..row.clone()
            },
        ];
        for bad in cases {
            let err = SigningKey::from_stored(&bad).unwrap_err();
            assert!(matches!(err, LedgerError::Corrupt(_)), "{err:?}");
            let text = format!("{err} {err:?}");
            assert!(!text.contains(row.private_pkcs8.as_ref().unwrap().expose()));
        }
    }

    #[test]
    fn no_debug_output_shows_the_private_key() {
        let (key, row) = SigningKey::generate(1_000).unwrap();
        let secret = row.private_pkcs8.as_ref().unwrap().expose().to_string();
        for shown in [
            format!("{key:?}"),
            format!("{row:?}"),
            format!("{:?}", row.private_pkcs8),
        ] {
            assert!(!shown.contains(&secret), "{shown}");
            // The seed alone (the document's bytes 16..48; its tail is the public key).
            assert!(!shown.contains(&secret[24..60]), "{shown}");
        }
        assert!(format!("{key:?}").contains(key.kid()));
    }

    #[test]
    fn a_retired_key_stays_published_for_the_longest_validity_and_the_margin() {
        let key = PublicSigningKey {
            kid: "k".into(),
            x: "x".into(),
            created_at_ms: 0,
            retired_at_ms: None,
        };
        assert!(key.is_published(i64::MAX));
        let retired = PublicSigningKey {
            retired_at_ms: Some(10_000),
            ..key
        };
        let until = 10_000 + 360_000;
        assert_eq!(retired.published_until_ms(), Some(until));
        assert!(retired.is_published(until));
        assert!(!retired.is_published(until + 1));
    }
}
