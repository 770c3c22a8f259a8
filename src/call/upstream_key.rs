//! The `Idempotency-Key` the upstream receives for a dispatched call.
//!
//! - `hmac` (default): lowercase hex `HMAC-SHA256(secret, permit_id + ":" + key)`, so a
//!   raw client key does not cross the trust boundary and two permits using the same key
//!   do not collide upstream.
//! - `raw`: the client's key as it sent it.
//! - `off`: no `Idempotency-Key` header.
//!
//! A call without a key never carries an `Idempotency-Key` upstream.

use crate::parse::fingerprint::hex;
use crate::parse::idempotency::BodyKeys;
use atmost_config::UpstreamKey;
use atmost_protocol::{KeyCarrier, KeyCarriers};

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
        UpstreamKey::Hmac { secret } => Some(hex(&secret.mac(&[
            permit_id.as_bytes(),
            b":",
            key.as_bytes(),
        ]))),
    }
}

/// Where a dispatched call's upstream receives its forwarded key: nowhere when none is
/// forwarded (no key, `off`); else in the `Idempotency-Key` header when `key_header` (the
/// dispatch carries one), and in each body member that held the key, which the dispatch
/// rewrites to the forwarded value (or, under `raw`, sends as it came).
pub fn carriers(forwarded: bool, key_header: bool, body: &BodyKeys) -> KeyCarriers {
    if !forwarded {
        return KeyCarriers::NONE;
    }
    let body = body.carriers();
    match key_header {
        true => body.with(KeyCarrier::Header),
        false => body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use atmost_config::UpstreamSecret;

    #[test]
    fn modes() {
        let hmac = UpstreamKey::Hmac {
            secret: UpstreamSecret::new("0123456789abcdef0123".into()).unwrap(),
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

    #[test]
    fn carriers_are_where_the_forwarded_key_goes() {
        use crate::parse::idempotency::KeyField;
        let meta_only = BodyKeys::from([KeyField::Present("k".into()), KeyField::Absent]);
        let none = BodyKeys::from([KeyField::Absent, KeyField::Absent]);
        let names = |c: KeyCarriers| c.iter().map(KeyCarrier::as_str).collect::<Vec<_>>();
        assert_eq!(names(carriers(true, true, &none)), ["header"]);
        assert_eq!(
            names(carriers(true, true, &meta_only)),
            ["header", "params._meta"]
        );
        assert_eq!(names(carriers(true, false, &meta_only)), ["params._meta"]);
        assert!(carriers(true, false, &none).is_empty());
        assert!(carriers(false, true, &meta_only).is_empty());
    }
}
