//! The idempotency key a client put in `params._meta["dev.atmost/idempotency-key"]` or in
//! `params.idempotencyKey` must not reach the upstream raw when `upstream_key.mode` is `hmac`
//! or `off`: the header is replaced, and so are these members of the body. Every other byte
//! is forwarded as sent, so the edit works on the raw text rather than re-serialising the
//! message.

use crate::mcp::{META_KEY, PARAMS_KEY};

/// Where the member sits in the raw body, as byte offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberSpan {
    /// First byte of the member's key string.
    pub key_start: usize,
    /// First byte of its value.
    pub value_start: usize,
    /// One past the last byte of its value.
    pub value_end: usize,
}

/// Finds `params._meta["dev.atmost/idempotency-key"]` in a body that already parsed as JSON
/// (without duplicate keys). `None` when it is not there.
pub fn find(body: &[u8]) -> Option<MemberSpan> {
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    let params = s.member_of_object("params")?;
    let mut s = Scanner { b: body, i: params };
    let meta = s.member_of_object("_meta")?;
    let mut s = Scanner { b: body, i: meta };
    s.find_member(META_KEY)
}

/// Every idempotency key member of a body that already parsed as JSON (without duplicate
/// keys): `params._meta["dev.atmost/idempotency-key"]` and `params.idempotencyKey` of the
/// message, or of each message of a batch. In no particular order.
pub fn find_all(body: &[u8]) -> Vec<MemberSpan> {
    let mut spans = Vec::new();
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    match s.peek() {
        Some(b'{') => spans_of_message(body, s.i, &mut spans),
        Some(b'[') => {
            s.i += 1;
            loop {
                s.ws();
                match s.peek() {
                    Some(b',') => s.i += 1,
                    Some(b'{') => {
                        spans_of_message(body, s.i, &mut spans);
                        if s.skip_value().is_none() {
                            break;
                        }
                    }
                    Some(b']') | None => break,
                    Some(_) => {
                        if s.skip_value().is_none() {
                            break;
                        }
                    }
                }
            }
        }
        _ => {}
    }
    spans
}

fn spans_of_message(body: &[u8], at: usize, out: &mut Vec<MemberSpan>) {
    let Some(params) = (Scanner { b: body, i: at }).member_of_object("params") else {
        return;
    };
    if let Some(meta) = (Scanner { b: body, i: params }).member_of_object("_meta") {
        out.extend((Scanner { b: body, i: meta }).find_member(META_KEY));
    }
    out.extend((Scanner { b: body, i: params }).find_member(PARAMS_KEY));
}

/// The body with each member in `spans` edited: `replacement` gets the member's raw value
/// (JSON text) and returns the string to put there, or `None` to remove the member.
pub fn rewrite_all(
    body: &[u8],
    spans: &[MemberSpan],
    mut replacement: impl FnMut(&[u8]) -> Option<String>,
) -> Vec<u8> {
    let mut ordered = spans.to_vec();
    // From the last member back, so the offsets of those before stay valid; members never
    // overlap, nor do the commas a removal takes with it.
    ordered.sort_by_key(|s| std::cmp::Reverse(s.key_start));
    let mut out = body.to_vec();
    for span in ordered {
        let value = replacement(&body[span.value_start..span.value_end]);
        out = rewrite(&out, span, value.as_deref());
    }
    out
}

/// The body with the member's value replaced by the JSON string `replacement`, or with the
/// member removed when `replacement` is `None`.
pub fn rewrite(body: &[u8], span: MemberSpan, replacement: Option<&str>) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 80);
    match replacement {
        Some(text) => {
            out.extend_from_slice(&body[..span.value_start]);
            out.extend_from_slice(
                &serde_json::Value::String(text.to_string())
                    .to_string()
                    .into_bytes(),
            );
            out.extend_from_slice(&body[span.value_end..]);
        }
        None => {
            let before = body[..span.key_start]
                .iter()
                .rposition(|b| !b.is_ascii_whitespace());
            let after = body[span.value_end..]
                .iter()
                .position(|b| !b.is_ascii_whitespace())
                .map(|p| span.value_end + p);
            let (from, to) = match (before.map(|p| body[p]), after) {
                // `, "key": value` → drop the comma before it too.
                (Some(b','), _) => (before.unwrap_or(span.key_start), span.value_end),
                // `{ "key": value, …` → drop the comma after it.
                (_, Some(a)) if body[a] == b',' => (span.key_start, a + 1),
                _ => (span.key_start, span.value_end),
            };
            out.extend_from_slice(&body[..from]);
            out.extend_from_slice(&body[to..]);
        }
    }
    out
}

/// Whether the JSON string `quoted` (quotes included) spells `name`. Most keys hold no
/// escape and are compared as bytes; an escaped one is decoded first.
fn key_is(quoted: &[u8], name: &str) -> Option<bool> {
    let inner = quoted.get(1..quoted.len().checked_sub(1)?)?;
    if !inner.contains(&b'\\') {
        return Some(inner == name.as_bytes());
    }
    let key: String = serde_json::from_slice(quoted).ok()?;
    Some(key == name)
}

/// A forward-only walk over well-formed JSON text.
struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    /// At an object: the offset of the value of member `name` if that value is an object.
    fn member_of_object(&mut self, name: &str) -> Option<usize> {
        let span = self.find_member(name)?;
        (self.b.get(span.value_start) == Some(&b'{')).then_some(span.value_start)
    }

    /// At an object: the span of member `name`.
    fn find_member(&mut self, name: &str) -> Option<MemberSpan> {
        self.ws();
        if self.peek()? != b'{' {
            return None;
        }
        self.i += 1;
        loop {
            self.ws();
            match self.peek()? {
                b'}' => return None,
                b',' => {
                    self.i += 1;
                    continue;
                }
                b'"' => {}
                _ => return None,
            }
            let key_start = self.i;
            self.skip_string()?;
            let is_name = key_is(&self.b[key_start..self.i], name)?;
            self.ws();
            if self.peek()? != b':' {
                return None;
            }
            self.i += 1;
            self.ws();
            let value_start = self.i;
            self.skip_value()?;
            if is_name {
                return Some(MemberSpan {
                    key_start,
                    value_start,
                    value_end: self.i,
                });
            }
        }
    }

    fn skip_string(&mut self) -> Option<()> {
        self.i += 1; // opening quote
        loop {
            match self.peek()? {
                b'\\' => self.i += 2,
                b'"' => {
                    self.i += 1;
                    return Some(());
                }
                _ => self.i += 1,
            }
        }
    }

    /// Skips one value without recursion: nesting depth is only counted.
    fn skip_value(&mut self) -> Option<()> {
        let mut depth = 0usize;
        loop {
            match self.peek()? {
                b'"' => self.skip_string()?,
                b'{' | b'[' => {
                    depth += 1;
                    self.i += 1;
                }
                b'}' | b']' => {
                    if depth == 0 {
                        return Some(());
                    }
                    depth -= 1;
                    self.i += 1;
                }
                b',' if depth == 0 => return Some(()),
                c if c.is_ascii_whitespace() && depth == 0 => return Some(()),
                _ => self.i += 1,
            }
            if depth == 0 && matches!(self.b.get(self.i.wrapping_sub(1)), Some(b'"' | b'}' | b']'))
            {
                // A complete string, object or array at the top level of this value.
                return Some(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn edit(body: &str, replacement: Option<&str>) -> Value {
        let span = find(body.as_bytes()).expect("member present");
        serde_json::from_slice(&rewrite(body.as_bytes(), span, replacement)).expect("still JSON")
    }

    const BODY: &str = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","arguments":{"_meta":{"dev.atmost/idempotency-key":"decoy"},"amount":10.50},"_meta":{"a":[1,{"b":"}"}],"dev.atmost/idempotency-key":"raw-key","z":true}}}"#;

    #[test]
    fn replaces_only_the_key_in_params_meta() {
        let v = edit(BODY, Some("derived"));
        assert_eq!(
            v["params"]["_meta"]["dev.atmost/idempotency-key"],
            "derived"
        );
        assert_eq!(
            v["params"]["arguments"]["_meta"]["dev.atmost/idempotency-key"],
            "decoy"
        );
        let text = String::from_utf8(rewrite(
            BODY.as_bytes(),
            find(BODY.as_bytes()).unwrap(),
            Some("derived"),
        ))
        .unwrap();
        assert!(!text.contains("raw-key"));
        // Every other byte is as sent (10.50 is not re-serialised as 10.5).
        assert_eq!(text, BODY.replace("\"raw-key\"", "\"derived\""));
    }

    #[test]
    fn removes_the_member_wherever_it_stands() {
        for (body, meta) in [
            (BODY, json!({"a":[1,{"b":"}"}],"z":true})),
            (
                r#"{"params":{"_meta":{ "dev.atmost/idempotency-key" : "k" , "x":1}}}"#,
                json!({"x":1}),
            ),
            (
                r#"{"params":{"_meta":{"x":1,"dev.atmost/idempotency-key":"k"}}}"#,
                json!({"x":1}),
            ),
            (
                r#"{"params":{"_meta":{"dev.atmost/idempotency-key":"k"}}}"#,
                json!({}),
            ),
        ] {
            assert_eq!(edit(body, None)["params"]["_meta"], meta, "{body}");
        }
    }

    #[test]
    fn finds_every_key_form_of_a_message_or_a_batch() {
        let body = r#"{"params":{"idempotencyKey":"p1","arguments":{"idempotencyKey":"decoy"},"_meta":{"dev.atmost/idempotency-key":"m1"}}}"#;
        let spans = find_all(body.as_bytes());
        assert_eq!(spans.len(), 2);
        let out = rewrite_all(body.as_bytes(), &spans, |raw| {
            Some(format!(
                "d-{}",
                String::from_utf8_lossy(raw).trim_matches('"')
            ))
        });
        assert_eq!(
            String::from_utf8_lossy(&out),
            body.replace("\"p1\"", "\"d-p1\"")
                .replace("\"m1\"", "\"d-m1\"")
        );
        let removed: Value =
            serde_json::from_slice(&rewrite_all(body.as_bytes(), &spans, |_| None)).expect("JSON");
        assert_eq!(
            removed,
            json!({"params":{"arguments":{"idempotencyKey":"decoy"},"_meta":{}}})
        );
        let batch = r#"[ {"params":{"idempotencyKey":"a"}} , 3, {"id":1}, {"params":{"_meta":{"dev.atmost/idempotency-key":"b","x":[1]}}} ]"#;
        let spans = find_all(batch.as_bytes());
        assert_eq!(spans.len(), 2);
        let removed: Value =
            serde_json::from_slice(&rewrite_all(batch.as_bytes(), &spans, |_| None)).expect("JSON");
        assert_eq!(
            removed,
            json!([{"params":{}}, 3, {"id":1}, {"params":{"_meta":{"x":[1]}}}])
        );
        assert!(find_all(br#"{"params":{"name":"x"}}"#).is_empty());
        assert!(find_all(br#""params""#).is_empty());
    }

    #[test]
    fn escaped_key_names_and_values_are_found() {
        let body = r#"{"params":{"_meta":{"dev.atmost\/idempotency-key":"a\"b\\"}}}"#;
        assert_eq!(
            edit(body, Some("d"))["params"]["_meta"]["dev.atmost/idempotency-key"],
            "d"
        );
    }

    #[test]
    fn keys_compare_as_decoded_text() {
        assert_eq!(key_is(br#""_meta""#, "_meta"), Some(true));
        assert_eq!(key_is(br#""\u005fmeta""#, "_meta"), Some(true));
        assert_eq!(key_is(br#""_met""#, "_meta"), Some(false));
        assert_eq!(key_is(br#""_meta\n""#, "_meta"), Some(false));
        assert_eq!(key_is(br#""""#, ""), Some(true));
        assert_eq!(key_is(b"\"", "_meta"), None);
    }

    #[test]
    fn absent_member_is_none() {
        for body in [
            r#"{"params":{"name":"x"}}"#,
            r#"{"params":{"_meta":{"other":"dev.atmost/idempotency-key"}}}"#,
            r#"{"params":{"_meta":"dev.atmost/idempotency-key"}}"#,
            r#"{"params":[{"_meta":{"dev.atmost/idempotency-key":"k"}}]}"#,
        ] {
            assert_eq!(find(body.as_bytes()), None, "{body}");
        }
    }
}
