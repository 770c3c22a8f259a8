//! Permit tokens, ids and hashing.
//!
//! A token is `atmp_<permit id>_<64 hex chars>` (its shape, shared with the filter, is in
//! [`atmost_protocol::token`]). Only the SHA-256 of the whole token is stored.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::LedgerError;

pub use atmost_protocol::token::{permit_id_of, PERMIT_ID_PREFIX, TOKEN_PREFIX};
pub const ATTEMPT_ID_PREFIX: &str = "att_";

/// `n` bytes from the operating system's CSPRNG, as lowercase hex.
pub fn random_hex(n: usize) -> Result<String, LedgerError> {
    let mut buf = vec![0u8; n];
    getrandom::fill(&mut buf).map_err(|e| LedgerError::Random(e.to_string()))?;
    Ok(hex::encode(buf))
}

pub fn new_permit_id() -> Result<String, LedgerError> {
    Ok(format!("{PERMIT_ID_PREFIX}{}", random_hex(12)?))
}

/// `att_` + 12 hex digits of Unix milliseconds + 20 random hex digits (80 bits). Ids made
/// later sort later, so the store's index on attempt ids grows at its right edge instead of
/// touching a random page per new attempt (fewer pages written per commit). The time part is
/// only for that ordering; nothing reads it back.
pub fn new_attempt_id() -> Result<String, LedgerError> {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    Ok(format!(
        "{ATTEMPT_ID_PREFIX}{:012x}{}",
        ms & 0xffff_ffff_ffff,
        &random_hex(10)?
    ))
}

/// A fresh capability for one dispatch round: 256 random bits, hex. Stored only hashed.
pub fn new_capability() -> Result<String, LedgerError> {
    random_hex(32)
}

/// A fresh secret token for a permit.
pub fn new_token(permit_id: &str) -> Result<String, LedgerError> {
    Ok(format!("{TOKEN_PREFIX}{permit_id}_{}", random_hex(32)?))
}

/// Lowercase hex SHA-256.
pub fn sha256_hex(data: &str) -> String {
    hex::encode(Sha256::digest(data.as_bytes()))
}

/// Whether `token` hashes to `stored_hash`, compared in constant time.
pub fn token_matches(token: &str, stored_hash: &str) -> bool {
    let presented = sha256_hex(token);
    presented.as_bytes().ct_eq(stored_hash.as_bytes()).into()
}

/// Constant-time comparison of two secrets (service and admin bearer tokens).
pub fn secrets_equal(a: &str, b: &str) -> bool {
    // Hash first so lengths do not leak through an early exit.
    let ha = Sha256::digest(a.as_bytes());
    let hb = Sha256::digest(b.as_bytes());
    ha.as_slice().ct_eq(hb.as_slice()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempt_ids_made_later_sort_later() {
        let first = new_attempt_id().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(3));
        let second = new_attempt_id().unwrap();
        for id in [&first, &second] {
            let hex = id.strip_prefix(ATTEMPT_ID_PREFIX).unwrap();
            assert_eq!(hex.len(), 32, "{id}");
            assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
        assert!(first < second, "{first} then {second}");
        assert_ne!(new_attempt_id().unwrap(), new_attempt_id().unwrap());
    }

    #[test]
    fn token_carries_its_permit_id() {
        let id = new_permit_id().unwrap();
        let token = new_token(&id).unwrap();
        assert!(token.starts_with("atmp_pmt_"));
        assert_eq!(permit_id_of(&token), Some(id.as_str()));
        assert!(token.len() > 5 + id.len() + 64);
    }

    #[test]
    fn hashes_compare() {
        let h = sha256_hex("atmp_x");
        assert!(token_matches("atmp_x", &h));
        assert!(!token_matches("atmp_y", &h));
        assert!(secrets_equal("a", "a"));
        assert!(!secrets_equal("a", "ab"));
        let a = new_attempt_id().unwrap();
        assert!(a.starts_with("att_") && a.len() == 4 + 32);
    }
}
