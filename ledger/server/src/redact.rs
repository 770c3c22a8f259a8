//! Which fields of a call's arguments are never shown (`atmost ledger --redact-field`).
//!
//! The ledger keeps the arguments as the filter sent them (a reconciler may need them to look
//! the call up); every place that shows them (the admin API, the CLI, the inbox) shows them
//! through [`Redaction::show`], which replaces each configured field's value with
//! [`REDACTED`].

use serde_json::Value;

/// What a redacted value is replaced with.
pub const REDACTED: &str = "[redacted]";

/// The configured fields: member names (matched at any depth, ASCII case-insensitively) and
/// JSON Pointers (RFC 6901, one place each).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Redaction {
    names: Vec<String>,
    pointers: Vec<String>,
}

impl Redaction {
    /// Each field is a member name (`card_number`: that member wherever it occurs) or a JSON
    /// Pointer starting with `/` (`/card/number`: that one place).
    pub fn new<S: AsRef<str>>(fields: &[S]) -> Result<Self, String> {
        let mut r = Redaction::default();
        for f in fields {
            let f = f.as_ref().trim();
            if f.is_empty() {
                return Err("a redacted field must not be empty".into());
            }
            if f.starts_with('/') {
                r.pointers.push(f.to_string());
            } else {
                r.names.push(f.to_ascii_lowercase());
            }
        }
        Ok(r)
    }

    /// The stored arguments (JSON text) as they may be shown. Text that is not JSON (never
    /// written by the ledger) is not shown at all.
    pub fn show(&self, arguments: &str) -> Value {
        match serde_json::from_str::<Value>(arguments) {
            Ok(mut v) => {
                self.apply(&mut v);
                v
            }
            Err(_) => Value::String("[unreadable]".into()),
        }
    }

    /// Replaces every configured field of `v` in place.
    pub fn apply(&self, v: &mut Value) {
        for p in &self.pointers {
            if let Some(slot) = v.pointer_mut(p) {
                *slot = Value::String(REDACTED.into());
            }
        }
        if !self.names.is_empty() {
            self.by_name(v);
        }
    }

    fn by_name(&self, v: &mut Value) {
        match v {
            Value::Object(map) => {
                for (k, child) in map.iter_mut() {
                    if self.names.iter().any(|n| k.eq_ignore_ascii_case(n)) {
                        *child = Value::String(REDACTED.into());
                    } else {
                        self.by_name(child);
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|i| self.by_name(i)),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_match_at_any_depth_and_pointers_one_place() {
        let r = Redaction::new(&["Card_Number", "/customer/email"]).unwrap();
        let shown = r.show(
            &json!({
                "amount": 5,
                "card_number": "4242",
                "items": [{"CARD_NUMBER": "1111", "sku": "a"}],
                "customer": {"email": "x@example.com", "name": "X"},
                "email": "kept@example.com"
            })
            .to_string(),
        );
        assert_eq!(
            shown,
            json!({
                "amount": 5,
                "card_number": REDACTED,
                "items": [{"CARD_NUMBER": REDACTED, "sku": "a"}],
                "customer": {"email": REDACTED, "name": "X"},
                "email": "kept@example.com"
            })
        );
    }

    #[test]
    fn nothing_configured_shows_everything_and_bad_input_is_refused() {
        let r = Redaction::new::<&str>(&[]).unwrap();
        assert_eq!(r.show(r#"{"a":[1,{"b":2}]}"#), json!({"a": [1, {"b": 2}]}));
        assert_eq!(r.show("not json"), json!("[unreadable]"));
        assert!(Redaction::new(&[" "]).is_err());
        // A pointer to nothing changes nothing.
        let r = Redaction::new(&["/missing/field"]).unwrap();
        assert_eq!(r.show(r#"{"a":1}"#), json!({"a": 1}));
    }
}
