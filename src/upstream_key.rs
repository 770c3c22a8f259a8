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

/// The header value to send upstream, or `None` to remove the header.
pub fn upstream_value(mode: &UpstreamKey, permit_id: &str, key: Option<&str>) -> Option<String> {
    let key = key?;
    match mode {
        UpstreamKey::Off => None,
        UpstreamKey::Raw => Some(key.to_string()),
        UpstreamKey::Hmac { secret } => {
            let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).ok()?;
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
        let hmac = UpstreamKey::Hmac {
            secret: "0123456789abcdef0123".into(),
        };
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
