//! The `Idempotency-Key` the upstream receives for a dispatched call.
//!
//! - `hmac` (default): lowercase hex `HMAC-SHA256(secret, permit_id + ":" + key)`, so a
//!   raw client key does not cross the trust boundary and two permits using the same key
//!   do not collide upstream.
//! - `raw`: the client's key as it sent it.
//! - `off`: no `Idempotency-Key` header.
//!
//! A call without a key never carries an `Idempotency-Key` upstream.

use crate::config::UpstreamKey;
use crate::fingerprint::hex;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::fmt;

/// The `hmac` mode's secret, keyed once when the configuration is read: the HMAC key
/// schedule (two SHA-256 blocks) is not redone for every call. Never shown in `Debug`.
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

/// The permit id in the `hmac` derivation of traffic that passes without a ledger answer
/// (messages other than `tools/call`, ungoverned tools). The filter cannot verify a permit
/// token there, and the id a token spells is the client's claim: using it would let one
/// agent mint the upstream key of another permit's governed calls. The empty id is a
/// domain of its own instead: every permit id is non-empty, so `":" + key` never equals a
/// governed call's `permit_id + ":" + key`.
pub const UNGOVERNED_PERMIT_ID: &str = "";

/// The header value to send upstream, or `None` to remove the header.
pub fn upstream_value(mode: &UpstreamKey, permit_id: &str, key: Option<&str>) -> Option<String> {
    let key = key?;
    match mode {
        UpstreamKey::Off => None,
        UpstreamKey::Raw => Some(key.to_string()),
        UpstreamKey::Hmac { secret } => {
            let mut mac = secret.keyed.clone();
            mac.update(permit_id.as_bytes());
            mac.update(b":");
            mac.update(key.as_bytes());
            Some(hex(&mac.finalize().into_bytes()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        let secret = UpstreamSecret::new("0123456789abcdef0123".into());
        let hmac = UpstreamKey::Hmac {
            secret: secret.clone().unwrap(),
        };
        assert_eq!(
            format!("{:?}", secret),
            "Some(UpstreamSecret(redacted))",
            "the secret is never printed"
        );
        // Independently: python3 -c 'import hmac,hashlib;print(hmac.new(b"0123456789abcdef0123",
        //   b"pmt_1:task-4417-pay", hashlib.sha256).hexdigest())'
        assert_eq!(
            upstream_value(&hmac, "pmt_1", Some("task-4417-pay")).as_deref(),
            Some("408b0daca3160e8ff7fd072dcc9c1d11edad614663ea292eeebc3eaf3890a0c0")
        );
        assert_ne!(
            upstream_value(&hmac, "pmt_2", Some("task-4417-pay")),
            upstream_value(&hmac, "pmt_1", Some("task-4417-pay"))
        );
        assert_eq!(upstream_value(&hmac, "pmt_1", None), None);
        assert_eq!(
            upstream_value(&UpstreamKey::Raw, "pmt_1", Some("k")).as_deref(),
            Some("k")
        );
        assert_eq!(upstream_value(&UpstreamKey::Raw, "pmt_1", None), None);
        assert_eq!(upstream_value(&UpstreamKey::Off, "pmt_1", Some("k")), None);
    }
}
