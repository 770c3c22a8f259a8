//! The idempotency key of a call: from the `Idempotency-Key` header (an RFC 8941
//! sf-string, or a bare token), from `params._meta["dev.atmost/idempotency-key"]`, or from
//! `params.idempotencyKey` (the form proposed for MCP itself). Never from the JSON-RPC
//! `id`. Error messages never echo the key.

use crate::parse::mcp::MetaKey;
use atmost_protocol::{Denial, DenialCode};

/// Longest accepted key, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

fn invalid(message: &str) -> Denial {
    Denial::new(DenialCode::InvalidIdempotencyKey, message)
}

fn check(key: &str, source: &str) -> Result<(), Denial> {
    if key.is_empty() {
        return Err(invalid(&format!(
            "the idempotency key from {source} is empty"
        )));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(invalid(&format!(
            "the idempotency key from {source} is longer than {MAX_KEY_BYTES} bytes"
        )));
    }
    if !key.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err(invalid(&format!(
            "the idempotency key from {source} must be printable ASCII (0x20-0x7E)"
        )));
    }
    Ok(())
}

/// Decodes one `Idempotency-Key` header value: `"quoted"` with `\"` and `\\` escapes
/// (RFC 8941 sf-string), or a bare value taken as is. Surrounding spaces are ignored.
pub fn parse_header_value(raw: &[u8]) -> Result<String, Denial> {
    const SRC: &str = "the Idempotency-Key header";
    let Ok(text) = std::str::from_utf8(raw) else {
        return Err(invalid(
            "the Idempotency-Key header must be printable ASCII (0x20-0x7E)",
        ));
    };
    let text = text.trim_matches(|c| c == ' ' || c == '\t');
    let Some(rest) = text.strip_prefix('"') else {
        if text.contains('"') || text.contains('\\') {
            return Err(invalid(
                "the Idempotency-Key header is neither a quoted sf-string nor a bare token",
            ));
        }
        check(text, SRC)?;
        return Ok(text.to_string());
    };
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    loop {
        match chars.next() {
            None => return Err(invalid("the Idempotency-Key header has an unterminated quoted string")),
            Some('\\') => match chars.next() {
                Some(c @ ('"' | '\\')) => out.push(c),
                _ => {
                    return Err(invalid(
                        "the Idempotency-Key header has an invalid escape (only \\\" and \\\\ are allowed)",
                    ))
                }
            },
            Some('"') => break,
            Some(c) => out.push(c),
        }
    }
    if !chars.as_str().is_empty() {
        return Err(invalid(
            "the Idempotency-Key header has data after its quoted string (parameters are not accepted)",
        ));
    }
    check(&out, SRC)?;
    Ok(out)
}

/// The call's key, from every source the client used: `Ok(None)` when it sent none. Two
/// sources that disagree, a header sent twice, or an invalid key →
/// `invalid_idempotency_key`.
pub fn resolve(
    header_values: &[Vec<u8>],
    meta: &MetaKey,
    params: &MetaKey,
) -> Result<Option<String>, Denial> {
    let from_header = match header_values {
        [] => None,
        [one] => Some(parse_header_value(one)?),
        _ => {
            return Err(invalid(
                "the Idempotency-Key header was sent more than once",
            ))
        }
    };
    let from_meta = body_key(meta, META_SOURCE)?;
    let from_params = body_key(params, PARAMS_SOURCE)?;
    let mut key: Option<String> = None;
    for k in [from_header, from_meta, from_params].into_iter().flatten() {
        match &key {
            Some(first) if *first != k => {
                return Err(invalid(
                    "the idempotency key sources (Idempotency-Key header, params._meta[\"dev.atmost/idempotency-key\"], params.idempotencyKey) disagree; send one key",
                ))
            }
            Some(_) => {}
            None => key = Some(k),
        }
    }
    Ok(key)
}

const META_SOURCE: &str = "params._meta[\"dev.atmost/idempotency-key\"]";
const PARAMS_SOURCE: &str = "params.idempotencyKey";

fn body_key(field: &MetaKey, source: &str) -> Result<Option<String>, Denial> {
    match field {
        MetaKey::Absent => Ok(None),
        MetaKey::NotAString => Err(invalid(&format!("{source} must be a string"))),
        MetaKey::Present(k) => {
            check(k, source)?;
            Ok(Some(k.clone()))
        }
    }
}

/// The key a body field holds, if it is one atmost would accept (the `hmac` derivation of
/// traffic that is not governed takes only such keys; anything else is dropped).
pub fn valid_body_key(raw_json: &[u8]) -> Option<String> {
    let key: String = serde_json::from_slice(raw_json).ok()?;
    check(&key, PARAMS_SOURCE).ok()?;
    Some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(s: &str) -> Result<String, Denial> {
        parse_header_value(s.as_bytes())
    }

    #[test]
    fn header_forms() {
        assert_eq!(h("\"abc\"").ok().as_deref(), Some("abc"));
        assert_eq!(h("  \"a b\"  ").ok().as_deref(), Some("a b"));
        assert_eq!(h(r#""a\"b\\c""#).ok().as_deref(), Some(r#"a"b\c"#));
        assert_eq!(h("task-4417-pay").ok().as_deref(), Some("task-4417-pay"));
        assert_eq!(
            h("8e0f6c1e-1a55-4f8a-9c1f-1f2b3c4d5e6f").ok().as_deref(),
            Some("8e0f6c1e-1a55-4f8a-9c1f-1f2b3c4d5e6f")
        );
        assert_eq!(h("tok:en/1").ok().as_deref(), Some("tok:en/1"));
    }

    #[test]
    fn bad_header_values() {
        for bad in [
            "",
            "\"\"",
            "\"abc",
            "\"a\\nb\"",
            "\"abc\";p=1",
            "\"abc\" x",
            "ab\"c",
            "a\\b",
            "\"caf\u{e9}\"",
            "tab\tinside",
        ] {
            let e = h(bad).err().map(|d| d.code);
            assert_eq!(e, Some(DenialCode::InvalidIdempotencyKey), "{bad:?}");
        }
        assert!(parse_header_value(&[0x22, 0xff, 0x22]).is_err());
        assert!(h(&"k".repeat(255)).is_ok());
        assert!(h(&"k".repeat(256)).is_err());
        assert!(h(&format!("\"{}\"", "k".repeat(256))).is_err());
    }

    #[test]
    fn sources_and_conflicts() {
        use MetaKey::{Absent, NotAString, Present};
        let hv = |s: &str| vec![s.as_bytes().to_vec()];
        let p = |s: &str| Present(s.into());
        let key = |h: &[Vec<u8>], m: &MetaKey, q: &MetaKey| resolve(h, m, q).ok();
        assert_eq!(key(&[], &Absent, &Absent), Some(None));
        assert_eq!(
            key(&hv("\"k1\""), &Absent, &Absent),
            Some(Some("k1".into()))
        );
        assert_eq!(key(&[], &p("k2"), &Absent), Some(Some("k2".into())));
        assert_eq!(key(&[], &Absent, &p("k5")), Some(Some("k5".into())));
        assert_eq!(key(&hv("k3"), &p("k3"), &Absent), Some(Some("k3".into())));
        assert_eq!(key(&hv("k3"), &p("k3"), &p("k3")), Some(Some("k3".into())));
        assert_eq!(key(&[], &p("k6"), &p("k6")), Some(Some("k6".into())));
        // Any two sources that disagree: denied, without echoing either key.
        for (h, m, q) in [
            (hv("k3"), p("k4"), Absent),
            (hv("k3"), Absent, p("k4")),
            (vec![], p("k3"), p("k4")),
            (hv("k3"), p("k3"), p("k4")),
            (hv("k4"), p("k3"), p("k3")),
        ] {
            let d = resolve(&h, &m, &q).err();
            assert_eq!(
                d.as_ref().map(|d| d.code),
                Some(DenialCode::InvalidIdempotencyKey),
                "{h:?} {m:?} {q:?}"
            );
            let msg = d.map(|d| d.message).unwrap_or_default();
            assert!(msg.contains("disagree"));
            assert!(!msg.contains("k3") && !msg.contains("k4"));
        }
        for bad in [NotAString, p(""), p("caf\u{e9}"), p(&"k".repeat(256))] {
            assert!(resolve(&[], &bad, &Absent).is_err(), "{bad:?}");
            assert!(resolve(&[], &Absent, &bad).is_err(), "{bad:?}");
        }
        let msg = resolve(&[], &Absent, &NotAString)
            .err()
            .map(|d| d.message)
            .unwrap_or_default();
        assert!(msg.contains("params.idempotencyKey"), "{msg}");
        assert!(resolve(&[b"a".to_vec(), b"a".to_vec()], &Absent, &Absent).is_err());
    }

    #[test]
    fn body_keys_accepted_for_derivation() {
        assert_eq!(valid_body_key(br#""k-1""#).as_deref(), Some("k-1"));
        assert_eq!(valid_body_key(br#""a\"b""#).as_deref(), Some("a\"b"));
        for bad in [&br#""""#[..], b"5", b"{}", b"null", br#""caf\u00e9""#] {
            assert_eq!(
                valid_body_key(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn messages_never_echo_the_key() {
        let secretish = "\"secret-key-xyz\";p=1";
        let msg = h(secretish).err().map(|d| d.message).unwrap_or_default();
        assert!(!msg.contains("secret-key-xyz"), "{msg}");
    }
}
