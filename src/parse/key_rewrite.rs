//! The idempotency key a client put in a member of the body ([`BODY_KEY_SOURCES`]:
//! `params._meta["dev.atmost/idempotency-key"]`, `params.idempotencyKey`) must not reach the
//! upstream raw when `upstream_key.mode` is `hmac` or `off`: the header is replaced, and so
//! are these members of the body. Every other byte is forwarded as sent, so the edit works
//! on the raw text rather than re-serialising the message.

use crate::parse::idempotency::BODY_KEY_SOURCES;
use crate::parse::json_text::{self, first_value, member};

/// Where the member sits in the raw body, as byte offsets.
pub type MemberSpan = json_text::Member;

/// The member of `params` each key source is found through, in the table's order.
const PARAMS_MEMBERS: [&str; BODY_KEY_SOURCES.len()] = {
    let mut names = [""; BODY_KEY_SOURCES.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = BODY_KEY_SOURCES[i].params_member();
        i += 1;
    }
    names
};

/// Every idempotency key member of a body that already parsed as JSON (without duplicate
/// keys): each of [`BODY_KEY_SOURCES`] in the message, or in each message of a batch. In
/// no particular order.
pub fn find_all(body: &[u8]) -> Vec<MemberSpan> {
    let mut spans = Vec::new();
    let at = first_value(body);
    match body.get(at) {
        Some(b'{') => spans_of_message(body, at, &mut spans),
        Some(b'[') => {
            for (start, _) in json_text::elements(body, at).unwrap_or_default() {
                if body.get(start) == Some(&b'{') {
                    spans_of_message(body, start, &mut spans);
                }
            }
        }
        _ => {}
    }
    spans
}

fn spans_of_message(body: &[u8], at: usize, out: &mut Vec<MemberSpan>) {
    let Some(params) = member(body, at, "params")
        .filter(|m| m.value_opens(body) == Some(b'{'))
        .map(|m| m.value_start)
    else {
        return;
    };
    // Every member of `params` the sources go through, in one walk over it.
    let found = json_text::last_members(body, params, PARAMS_MEMBERS).unwrap_or_default();
    for (source, found) in BODY_KEY_SOURCES.iter().zip(found) {
        let Some(found) = found else { continue };
        match source.within {
            None => out.push(found),
            Some(_) if found.value_opens(body) == Some(b'{') => {
                out.extend(member(body, found.value_start, source.name));
            }
            Some(_) => {}
        }
    }
}

/// The body with each of its idempotency key members ([`find_all`]) edited as
/// [`rewrite_all`] does; `None` when it has none, so nothing needs to replace it.
pub fn rewritten(body: &[u8], replacement: impl FnMut(&[u8]) -> Option<String>) -> Option<Vec<u8>> {
    let spans = find_all(body);
    (!spans.is_empty()).then(|| rewrite_all(body, &spans, replacement))
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
            out.extend_from_slice(json_text::quoted(text).as_bytes());
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// The one key member of `body`, if it holds exactly one.
    fn find(body: &[u8]) -> Option<MemberSpan> {
        match find_all(body).as_slice() {
            [one] => Some(*one),
            _ => None,
        }
    }

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
    fn a_body_without_key_members_is_not_rewritten() {
        let plain = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay"}}"#;
        assert_eq!(rewritten(plain, |_| Some("derived".into())), None);
        let mut seen = Vec::new();
        let sent = rewritten(BODY.as_bytes(), |raw| {
            seen.push(raw.to_vec());
            None
        });
        assert_eq!(seen, [b"\"raw-key\"".to_vec()]);
        let sent: Value = serde_json::from_slice(&sent.unwrap_or_default()).unwrap_or_default();
        assert_eq!(sent["params"]["_meta"], json!({"a":[1,{"b":"}"}],"z":true}));
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
