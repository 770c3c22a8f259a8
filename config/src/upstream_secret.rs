//! The `upstream_key.secret` of the `hmac` mode, keyed once when the configuration is
//! read: the HMAC key schedule (two SHA-256 blocks) is not redone for every call.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::fmt;

/// The secret and its keyed HMAC. Never shown in `Debug`.
#[derive(Clone)]
pub struct UpstreamSecret {
    secret: String,
    keyed: Hmac<Sha256>,
}

impl UpstreamSecret {
    /// `None` only if the HMAC refuses the key (it takes any length).
    pub fn new(secret: String) -> Option<UpstreamSecret> {
        let keyed = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).ok()?;
        Some(UpstreamSecret { secret, keyed })
    }

    /// The secret's length in bytes (the configuration requires a minimum).
    pub fn len(&self) -> usize {
        self.secret.len()
    }

    pub fn is_empty(&self) -> bool {
        self.secret.is_empty()
    }

    /// `HMAC-SHA256(secret, parts concatenated)`: the parts are fed in turn so the caller
    /// need not build the message.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut mac = self.keyed.clone();
        for part in parts {
            mac.update(part);
        }
        mac.finalize().into_bytes().into()
    }
}

impl PartialEq for UpstreamSecret {
    fn eq(&self, other: &Self) -> bool {
        self.secret == other.secret
    }
}

impl fmt::Debug for UpstreamSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UpstreamSecret(redacted)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_of_parts_is_the_mac_of_their_concatenation() {
        let secret = UpstreamSecret::new("0123456789abcdef0123".into()).unwrap();
        assert_eq!(
            secret.mac(&[b"pmt_1", b":", b"task-4417-pay"]),
            secret.mac(&[b"pmt_1:task-4417-pay"])
        );
        assert_eq!(
            format!("{:?}", Some(secret)),
            "Some(UpstreamSecret(redacted))",
            "the secret is never printed"
        );
    }
}
