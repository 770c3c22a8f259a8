//! The idempotency key of a call: from the `Idempotency-Key` header (an RFC 8941
//! sf-string, or a bare token), or from a member of the body's `params` named in
//! [`BODY_KEY_SOURCES`] (`params._meta["dev.atmost/idempotency-key"]`, and
//! `params.idempotencyKey`, the form proposed for MCP itself). Never from the JSON-RPC
//! `id`. Error messages never echo the key.
//!
//! [`BODY_KEY_SOURCES`] is the one list of the body's key members: the parser reads each
//! ([`BodyKeys::read`]) and refuses each spelled in another letter case, [`resolve`] checks
//! each and names it in its refusals, and the rewrite for upstream
//! ([`crate::parse::key_rewrite`]) finds each in the raw text. A new source is a new row.

use atmost_protocol::{Denial, DenialCode, KeyCarrier, KeyCarriers};
use serde_json::{Map, Value};

/// A member of a message's `params` that may carry the idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyMember {
    /// The member of `params` whose object holds the key member (`_meta`), or `None` when
    /// the key is a member of `params` itself.
    pub within: Option<&'static str>,
    /// The key member's name.
    pub name: &'static str,
    /// How the ledger names this place when it records where a forwarded key went.
    pub carrier: KeyCarrier,
}

/// Every member of a message's body that may carry the idempotency key, in the order
/// [`resolve`] reads them.
pub const BODY_KEY_SOURCES: [KeyMember; 2] = [
    KeyMember {
        within: Some("_meta"),
        name: "dev.atmost/idempotency-key",
        carrier: KeyCarrier::Meta,
    },
    // The form proposed for MCP itself (SEP-3182): a string beside `name` and `arguments`.
    KeyMember {
        within: None,
        name: "idempotencyKey",
        carrier: KeyCarrier::IdempotencyKeyParam,
    },
];

/// How refusals name the header source.
const HEADER_SOURCE: &str = "Idempotency-Key header";

impl KeyMember {
    /// The member of `params` to look in: the holding object, or the key member itself.
    pub const fn params_member(&self) -> &'static str {
        match self.within {
            Some(object) => object,
            None => self.name,
        }
    }

    /// Where the member sits, as refusals name it: `params._meta["…"]`, `params.name`.
    pub fn label(&self) -> String {
        match self.within {
            Some(object) => format!("params.{object}[{:?}]", self.name),
            None => format!("params.{}", self.name),
        }
    }

    /// The member's value in a message's `params`, of any type; `None` when absent (or
    /// when its holding object is not an object).
    pub fn value_in<'a>(&self, params: &'a Map<String, Value>) -> Option<&'a Value> {
        match self.within {
            Some(object) => params.get(object)?.as_object()?.get(self.name),
            None => params.get(self.name),
        }
    }
}

/// What one key member of a `tools/call` body holds.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyField {
    Absent,
    Present(String),
    /// Present but not a string.
    NotAString,
}

impl KeyField {
    fn of(value: Option<&Value>) -> KeyField {
        match value {
            None => KeyField::Absent,
            Some(Value::String(k)) => KeyField::Present(k.clone()),
            Some(_) => KeyField::NotAString,
        }
    }
}

/// What each of [`BODY_KEY_SOURCES`] holds in one message, in the table's order.
#[derive(Debug, Clone, PartialEq)]
pub struct BodyKeys([KeyField; BODY_KEY_SOURCES.len()]);

impl BodyKeys {
    /// Reads every key member of a message's `params`.
    pub fn read(params: &Map<String, Value>) -> BodyKeys {
        BodyKeys(BODY_KEY_SOURCES.map(|source| KeyField::of(source.value_in(params))))
    }

    /// Each source with what it holds.
    pub fn iter(&self) -> impl Iterator<Item = (&'static KeyMember, &KeyField)> {
        BODY_KEY_SOURCES.iter().zip(&self.0)
    }

    /// What the member called `name` holds (`None` when no source has that name).
    pub fn named(&self, name: &str) -> Option<&KeyField> {
        self.iter().find(|(s, _)| s.name == name).map(|(_, f)| f)
    }

    /// Some member is there, of any type.
    pub fn any_field(&self) -> bool {
        self.0.iter().any(|f| *f != KeyField::Absent)
    }

    /// Some member holds a string.
    pub fn any_present(&self) -> bool {
        self.0.iter().any(|f| matches!(f, KeyField::Present(_)))
    }

    /// The carriers of the members that hold a string.
    pub fn carriers(&self) -> KeyCarriers {
        self.iter()
            .filter(|(_, f)| matches!(f, KeyField::Present(_)))
            .map(|(source, _)| source.carrier)
            .collect()
    }
}

impl From<[KeyField; BODY_KEY_SOURCES.len()]> for BodyKeys {
    fn from(fields: [KeyField; BODY_KEY_SOURCES.len()]) -> BodyKeys {
        BodyKeys(fields)
    }
}

/// Whether a message's `params` hold an idempotency key member, of any type.
pub fn carries_key(params: &Map<String, Value>) -> bool {
    BODY_KEY_SOURCES
        .iter()
        .any(|source| source.value_in(params).is_some())
}

use atmost_protocol::idempotency_key::IdempotencyKey;
/// Longest accepted key, in bytes (the protocol's one rule).
pub use atmost_protocol::idempotency_key::MAX_KEY_BYTES;

fn invalid(message: &str) -> Denial {
    Denial::new(DenialCode::InvalidIdempotencyKey, message)
}

fn check(key: &str, source: &str) -> Result<IdempotencyKey, Denial> {
    IdempotencyKey::parse(key).map_err(|fault| {
        invalid(&format!(
            "the idempotency key from {source} {}",
            fault.describe()
        ))
    })
}

/// Decodes one `Idempotency-Key` header value: `"quoted"` with `\"` and `\\` escapes
/// (RFC 8941 sf-string), or a bare value taken as is. Surrounding spaces are ignored.
pub fn parse_header_value(raw: &[u8]) -> Result<String, Denial> {
    header_key(raw).map(IdempotencyKey::into_string)
}

/// [`parse_header_value`], the key as the checked type.
fn header_key(raw: &[u8]) -> Result<IdempotencyKey, Denial> {
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
        return check(text, SRC);
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
    check(&out, SRC)
}

/// The call's key, from every source the client used: `Ok(None)` when it sent none. Two
/// sources that disagree, a header sent twice, or an invalid key →
/// `invalid_idempotency_key`.
pub fn resolve(
    header_values: &[Vec<u8>],
    body: &BodyKeys,
) -> Result<Option<IdempotencyKey>, Denial> {
    let from_header = match header_values {
        [] => None,
        [one] => Some(header_key(one)?),
        _ => {
            return Err(invalid(
                "the Idempotency-Key header was sent more than once",
            ))
        }
    };
    let mut from_body = Vec::with_capacity(BODY_KEY_SOURCES.len());
    for (source, field) in body.iter() {
        from_body.push(body_key(field, &source.label())?);
    }
    let mut key: Option<IdempotencyKey> = None;
    for k in std::iter::once(from_header).chain(from_body).flatten() {
        match &key {
            Some(first) if *first != k => return Err(disagreement()),
            Some(_) => {}
            None => key = Some(k),
        }
    }
    Ok(key)
}

/// Two sources hold different keys: the refusal names every source, not the keys.
fn disagreement() -> Denial {
    let mut sources = String::from(HEADER_SOURCE);
    for source in &BODY_KEY_SOURCES {
        sources.push_str(", ");
        sources.push_str(&source.label());
    }
    invalid(&format!(
        "the idempotency key sources ({sources}) disagree; send one key"
    ))
}

fn body_key(field: &KeyField, source: &str) -> Result<Option<IdempotencyKey>, Denial> {
    match field {
        KeyField::Absent => Ok(None),
        KeyField::NotAString => Err(invalid(&format!("{source} must be a string"))),
        KeyField::Present(k) => check(k, source).map(Some),
    }
}

/// The key a body field holds, if it is one atmost would accept (the `hmac` derivation of
/// traffic that is not governed takes only such keys; anything else is dropped).
pub fn valid_body_key(raw_json: &[u8]) -> Option<String> {
    let key: String = serde_json::from_slice(raw_json).ok()?;
    check(&key, "a body key member")
        .ok()
        .map(IdempotencyKey::into_string)
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

    /// The body's key members with `meta` in `params._meta` and `params` in
    /// `params.idempotencyKey`.
    fn body(meta: &KeyField, params: &KeyField) -> BodyKeys {
        BodyKeys::from([meta.clone(), params.clone()])
    }

    #[test]
    fn sources_and_conflicts() {
        use KeyField::{Absent, NotAString, Present};
        let hv = |s: &str| vec![s.as_bytes().to_vec()];
        let p = |s: &str| Present(s.into());
        let key = |h: &[Vec<u8>], m: &KeyField, q: &KeyField| {
            resolve(h, &body(m, q))
                .ok()
                .map(|k| k.map(IdempotencyKey::into_string))
        };
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
            let d = resolve(&h, &body(&m, &q)).err();
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
            assert!(resolve(&[], &body(&bad, &Absent)).is_err(), "{bad:?}");
            assert!(resolve(&[], &body(&Absent, &bad)).is_err(), "{bad:?}");
        }
        let msg = resolve(&[], &body(&Absent, &NotAString))
            .err()
            .map(|d| d.message)
            .unwrap_or_default();
        assert!(msg.contains("params.idempotencyKey"), "{msg}");
        assert!(resolve(&[b"a".to_vec(), b"a".to_vec()], &body(&Absent, &Absent)).is_err());
    }

    #[test]
    fn refusals_name_the_sources_as_the_table_has_them() {
        let labels: Vec<String> = BODY_KEY_SOURCES.iter().map(KeyMember::label).collect();
        assert_eq!(
            labels,
            [
                "params._meta[\"dev.atmost/idempotency-key\"]",
                "params.idempotencyKey"
            ]
        );
        let disagree = |h: &[Vec<u8>], m: &str| {
            resolve(h, &body(&KeyField::Present(m.into()), &KeyField::Absent))
                .err()
                .map(|d| d.message)
        };
        assert_eq!(
            disagree(&[b"k1".to_vec()], "k2").as_deref(),
            Some("the idempotency key sources (Idempotency-Key header, params._meta[\"dev.atmost/idempotency-key\"], params.idempotencyKey) disagree; send one key")
        );
        let not_a_string = |fields: [KeyField; 2]| {
            resolve(&[], &BodyKeys::from(fields))
                .err()
                .map(|d| d.message)
        };
        assert_eq!(
            not_a_string([KeyField::NotAString, KeyField::Absent]).as_deref(),
            Some("params._meta[\"dev.atmost/idempotency-key\"] must be a string")
        );
        assert_eq!(
            not_a_string([KeyField::Absent, KeyField::Present(String::new())]).as_deref(),
            Some("the idempotency key from params.idempotencyKey is empty")
        );
    }

    #[test]
    fn each_source_is_read_where_the_table_says() {
        let params = |v: Value| v.as_object().cloned().unwrap_or_default();
        let read = BodyKeys::read(&params(serde_json::json!({
            "name": "pay",
            "_meta": {"dev.atmost/idempotency-key": "m1"},
            "idempotencyKey": 5,
            "arguments": {"idempotencyKey": "decoy"}
        })));
        assert_eq!(
            read.named("dev.atmost/idempotency-key"),
            Some(&KeyField::Present("m1".into()))
        );
        assert_eq!(read.named("idempotencyKey"), Some(&KeyField::NotAString));
        assert!(read.any_field() && read.any_present());
        // A `_meta` that is not an object holds no key; keys elsewhere are no source.
        for other in [
            serde_json::json!({"_meta": "dev.atmost/idempotency-key"}),
            serde_json::json!({"arguments": {"idempotencyKey": "k"}}),
            serde_json::json!({"_meta": {"idempotencyKey": "k"}}),
        ] {
            let read = BodyKeys::read(&params(other.clone()));
            assert!(!read.any_field(), "{other}");
            assert!(!carries_key(&params(other)));
        }
        assert!(carries_key(&params(
            serde_json::json!({"idempotencyKey": null})
        )));
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
