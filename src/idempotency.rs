//! The idempotency key of a call: from the `Idempotency-Key` header (an RFC 8941
//! sf-string, or a bare token) or from `params._meta["dev.atmost/idempotency-key"]`.
//! Never from the JSON-RPC `id`. Error messages never echo the key.

use crate::mcp::MetaKey;
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

/// The call's key: `Ok(None)` when the client sent none. Both sources present and
/// different, a header sent twice, or an invalid key → `invalid_idempotency_key`.
pub fn resolve(header_values: &[Vec<u8>], meta: &MetaKey) -> Result<Option<String>, Denial> {
    let from_header = match header_values {
        [] => None,
        [one] => Some(parse_header_value(one)?),
        _ => {
            return Err(invalid(
                "the Idempotency-Key header was sent more than once",
            ))
        }
    };
    let from_meta = match meta {
        MetaKey::Absent => None,
        MetaKey::NotAString => {
            return Err(invalid(
                "params._meta[\"dev.atmost/idempotency-key\"] must be a string",
            ))
        }
        MetaKey::Present(k) => {
            check(k, "params._meta[\"dev.atmost/idempotency-key\"]")?;
            Some(k.clone())
        }
    };
    match (from_header, from_meta) {
        (Some(h), Some(m)) if h != m => Err(invalid(
            "the Idempotency-Key header and params._meta[\"dev.atmost/idempotency-key\"] disagree; send one key",
        )),
        (Some(h), _) => Ok(Some(h)),
        (None, m) => Ok(m),
    }
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
        let hv = |s: &str| vec![s.as_bytes().to_vec()];
        assert_eq!(resolve(&[], &MetaKey::Absent).ok(), Some(None));
        assert_eq!(
            resolve(&hv("\"k1\""), &MetaKey::Absent).ok(),
            Some(Some("k1".into()))
        );
        assert_eq!(
            resolve(&[], &MetaKey::Present("k2".into())).ok(),
            Some(Some("k2".into()))
        );
        assert_eq!(
            resolve(&hv("k3"), &MetaKey::Present("k3".into())).ok(),
            Some(Some("k3".into()))
        );
        let conflict = resolve(&hv("k3"), &MetaKey::Present("k4".into()));
        let d = conflict.err();
        assert_eq!(
            d.as_ref().map(|d| d.code),
            Some(DenialCode::InvalidIdempotencyKey)
        );
        let msg = d.map(|d| d.message).unwrap_or_default();
        assert!(msg.contains("disagree"));
        assert!(!msg.contains("k3") && !msg.contains("k4"));
        assert!(resolve(&[], &MetaKey::NotAString).is_err());
        assert!(resolve(&[], &MetaKey::Present(String::new())).is_err());
        assert!(resolve(&[], &MetaKey::Present("caf\u{e9}".into())).is_err());
        assert!(resolve(&[b"a".to_vec(), b"a".to_vec()], &MetaKey::Absent).is_err());
    }

    #[test]
    fn messages_never_echo_the_key() {
        let secretish = "\"secret-key-xyz\";p=1";
        let msg = h(secretish).err().map(|d| d.message).unwrap_or_default();
        assert!(!msg.contains("secret-key-xyz"), "{msg}");
    }
}
