//! JSON as the filter must read it: like `serde_json::Value`, but an object that names a
//! key twice is refused. Parsers disagree on duplicates (most keep the last, some the
//! first), so a body with `"name":"echo","name":"pay_invoice"` could be governed as one
//! tool and executed as another. Keys equal under Unicode simple case folding are the same
//! key here too (see [`crate::parse::fold`]): Go's `encoding/json` matches them to one field.

use serde::de::{Deserialize, Deserializer, Error, MapAccess, SeqAccess, Visitor};
use serde_json::map::Entry;
use serde_json::{Map, Number, Value};
use std::fmt;

/// Start of the error text of a key named twice, exactly or under case folding.
pub const DUPLICATE_KEY: &str = "duplicate key";
/// In the error text when the keys differ but fold together.
pub const FOLDED: &str = "under case folding";

/// Parses `bytes`; a duplicate key anywhere, exact or under case folding, is an error.
pub fn from_slice(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    serde_json::from_slice::<Strict>(bytes).map(|s| s.0)
}

struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value without duplicate object keys")
    }

    fn visit_bool<E: Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("number out of range"))
    }

    fn visit_str<E: Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E: Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E: Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut obj = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Strict(value) = map.next_value()?;
            // One lookup finds a repeat or the place to insert.
            match obj.entry(key) {
                Entry::Occupied(repeated) => {
                    return Err(A::Error::custom(format!(
                        "{DUPLICATE_KEY} `{}`",
                        repeated.key()
                    )));
                }
                Entry::Vacant(slot) => {
                    slot.insert(value);
                }
            }
        }
        if let Some((a, b)) = crate::parse::fold::collision(obj.keys().map(String::as_str)) {
            return Err(A::Error::custom(format!(
                "{DUPLICATE_KEY} `{a}` and `{b}` {FOLDED}"
            )));
        }
        Ok(Value::Object(obj))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_what_serde_json_reads() {
        let text = br#"{"a":[1,-2,3.5,1e0,"s",null,true,{"b":{}}],"c":18446744073709551615}"#;
        assert_eq!(
            from_slice(text).unwrap(),
            serde_json::from_slice::<Value>(text).unwrap()
        );
    }

    #[test]
    fn refuses_a_duplicate_key_at_any_depth() {
        for text in [
            &br#"{"name":"echo","name":"pay_invoice"}"#[..],
            br#"{"params":{"arguments":{"amount":1,"amount":1000}}}"#,
            br#"[{"a":1},{"b":{"c":1,"c":1}}]"#,
        ] {
            let err = from_slice(text).unwrap_err().to_string();
            assert!(err.contains("duplicate key"), "{err}");
        }
        assert_eq!(
            from_slice(br#"{"a":{"x":1},"b":{"x":1}}"#).unwrap(),
            json!({"a":{"x":1},"b":{"x":1}})
        );
    }

    #[test]
    fn refuses_keys_equal_under_case_folding_at_any_depth() {
        for text in [
            r#"{"method":"tools/list","Method":"tools/call"}"#,
            r#"{"params":{"name":"echo","NAME":"pay"}}"#,
            r#"{"params":{"arguments":{"amount":1},"argument\u017f":{"amount":9}}}"#,
            "{\"a\":[{\"kind\":1,\"\u{212A}ind\":2}]}",
            r#"[{"ok":1},{"_meta":{},"_META":{}}]"#,
        ] {
            let err = from_slice(text.as_bytes()).unwrap_err().to_string();
            assert!(
                err.starts_with(DUPLICATE_KEY) && err.contains(FOLDED),
                "{text}: {err}"
            );
        }
        // Sibling objects may each use either spelling; only one object's keys compete.
        assert!(from_slice(br#"{"a":{"Name":1},"b":{"name":1},"A2":{"name":{"NAME":1}}}"#).is_ok());
        // Dotless i is not i under simple folding, so these are two keys to Go too.
        assert!(from_slice("{\"id\":1,\"\u{131}d\":2}".as_bytes()).is_ok());
    }

    #[test]
    fn keys_that_differ_only_in_escapes_are_the_same_key() {
        assert!(from_slice(br#"{"a":1,"\u0061":2}"#).is_err());
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(from_slice(deep.as_bytes()).is_err());
    }
}
