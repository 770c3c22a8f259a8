//! `mcp_body`: the request body classifier (`mcp::parse`) on arbitrary bytes, under a set of
//! header combinations, plus the `Idempotency-Key` header decoder on the same bytes.
//!
//! Asserts:
//! - it never panics and is deterministic;
//! - a refusal is HTTP 400 and a well-formed JSON-RPC error with a known code and an id
//!   that is a string, a number or null;
//! - a body read as a `tools/call` with no headers is never read as anything else
//!   (`Message::Other`) under any header combination: a header cannot take a call out of
//!   governance; with matching mirrored headers it reads the same, with a mismatching or
//!   duplicated `Mcp-Method` / `Mcp-Name` it is refused `HeaderMismatch` (-32020);
//! - the parsed call is what the body says (`params.name`, `params.arguments`, `id`, and
//!   each idempotency key member of `idempotency::BODY_KEY_SOURCES`);
//! - the call's fingerprint can be computed;
//! - `idempotency::parse_header_value` accepts only 1..=255 printable ASCII bytes, and a
//!   quoted form of an accepted key decodes to the same key.
//!
//! And it compares the filter's reading with a plain `serde_json` reading ([`crate::plain`]),
//! both ways, with no headers:
//! - whatever `serde_json` reads as one well-formed `tools/call` (an object with
//!   `"jsonrpc":"2.0"`, `"method"` exactly `"tools/call"`, a string or number `id`, a
//!   `params` object with a string `name` and object or absent `arguments`) the filter
//!   reads as that call, with the same id, name and arguments;
//! - whatever the filter reads as a `tools/call` `serde_json` reads as the same call;
//! - whatever the filter lets pass as another message (`Other`, `KeyedOther`) holds no
//!   message whose `method` member, in any letter case, is `"tools/call"`.
//!
//! The same comparison runs on bodies one letter-case step away from the input (a member
//! the gateway reads renamed, or twinned, in another letter case: [`plain::case_variants`]).
//!
//! The documented exceptions are refusals, never a pass: a body the filter refuses on
//! purpose though `serde_json` reads it as a call must be refused with exactly the reason
//! the plain reading shows, and every body showing one of them is refused:
//! - an object names the same key twice (`serde_json` keeps the last): -32700;
//! - two keys of one object are equal under Unicode simple case folding: -32700;
//! - a member the gateway reads is spelled in another letter case (`"Method"`, `"Params"`,
//!   `"ARGUMENTS"` in `params`, …): -32600;
//! - `params._meta` names protocol version 2026-07-28 or later, whose calls must carry the
//!   `Mcp-Method` and `Mcp-Name` headers, and none were sent: -32020.

use crate::plain::{self, Repeat};
use crate::util::assert_rpc_error;
use atmost_filter::call::reply::rpc_code;
use atmost_filter::parse::fingerprint::fingerprint;
use atmost_filter::parse::idempotency::{self, KeyField, MAX_KEY_BYTES};
use atmost_filter::parse::mcp::{self, Message, Mirrored, ToolCall, MIRRORING_VERSION};
use serde_json::Value;

const KNOWN_CODES: [i64; 4] = [
    rpc_code::PARSE_ERROR,
    rpc_code::INVALID_REQUEST,
    rpc_code::INVALID_PARAMS,
    rpc_code::HEADER_MISMATCH,
];

fn parse(body: &[u8], m: &Mirrored) -> Result<Message, i64> {
    parse_with_message(body, m).map_err(|(code, _)| code)
}

/// Like [`parse`], keeping the refusal's message.
fn parse_with_message(body: &[u8], m: &Mirrored) -> Result<Message, (i64, String)> {
    match mcp::parse(body, m) {
        Ok(msg) => Ok(msg),
        Err(reply) => {
            assert_eq!(reply.status, 400, "refusal is not HTTP 400: {reply:?}");
            let (_, code) = assert_rpc_error(&reply);
            assert!(KNOWN_CODES.contains(&code), "unknown code {code}");
            let message = reply
                .body_json()
                .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                .unwrap_or_default();
            Err((code, message))
        }
    }
}

fn mirrored(
    method: Option<&str>,
    name: Option<&str>,
    version: Option<&str>,
    dup: bool,
) -> Mirrored {
    Mirrored {
        method: method.map(str::to_string),
        name: name.map(str::to_string),
        protocol_version: version.map(str::to_string),
        duplicated: dup,
    }
}

/// Header combinations tried on every body, whatever it holds.
fn fixed_combinations() -> Vec<Mirrored> {
    vec![
        mirrored(Some("tools/call"), None, None, false),
        mirrored(Some("tools/list"), None, None, false),
        mirrored(None, Some("pay_invoice"), None, false),
        mirrored(
            Some("tools/call"),
            Some("pay_invoice"),
            Some(MIRRORING_VERSION),
            false,
        ),
        mirrored(None, None, Some(MIRRORING_VERSION), false),
        mirrored(None, None, Some("2025-03-26"), false),
        mirrored(None, None, Some(""), false),
        mirrored(Some(""), Some(""), Some("\u{0}"), true),
    ]
}

fn check_call(body: &[u8], call: &ToolCall) {
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => panic!("parsed as tools/call but is not JSON: {e}"),
    };
    assert_eq!(v["method"], "tools/call");
    assert_eq!(v["jsonrpc"], "2.0");
    assert_eq!(v["id"], call.id);
    assert!(call.id.is_string() || call.id.is_number());
    assert_eq!(v["params"]["name"].as_str(), Some(call.name.as_str()));
    match v["params"].get("arguments") {
        None => assert!(call.arguments.is_empty()),
        Some(a) => assert_eq!(a, &Value::Object(call.arguments.clone())),
    }
    let params = v["params"].as_object().cloned().unwrap_or_default();
    for (source, field) in call.keys.iter() {
        match (field, source.value_in(&params)) {
            (KeyField::Absent, None) => {}
            (KeyField::Present(k), Some(Value::String(s))) => assert_eq!(k, s),
            (KeyField::NotAString, Some(x)) => assert!(!x.is_string()),
            (f, x) => panic!("{} is {f:?} but body has {x:?}", source.label()),
        }
    }
    if let Err(e) = fingerprint(&call.name, &call.arguments) {
        panic!("parsed arguments cannot be fingerprinted: {e}");
    }
}

fn check_idempotency_header(data: &[u8]) {
    let once = idempotency::parse_header_value(data);
    assert_eq!(once, idempotency::parse_header_value(data));
    if let Ok(k) = once {
        assert!(
            !k.is_empty() && k.len() <= MAX_KEY_BYTES,
            "key length {}",
            k.len()
        );
        assert!(k.bytes().all(|b| (0x20..=0x7e).contains(&b)), "{k:?}");
        // The sf-string form of the same key decodes to it.
        let mut quoted = String::from("\"");
        for c in k.chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        assert_eq!(
            idempotency::parse_header_value(quoted.as_bytes())
                .ok()
                .as_deref(),
            Some(k.as_str()),
            "quoted form {quoted:?}"
        );
    }
}

/// The filter's reading (no headers) against the plain `serde_json` reading.
fn compare_with_plain_reading(data: &[u8], filter: &Result<Message, (i64, String)>) {
    let Some(v) = plain::read(data) else {
        // What serde_json refuses the filter refuses too (it reads with serde_json).
        assert!(
            filter.is_err(),
            "serde_json refuses the body, the filter read {filter:?}"
        );
        return;
    };
    let repeat = plain::repeated_key(data);
    let misspelled = plain::misspelled_member(&v);
    let plain_call = plain::as_call(&v);

    // Every body showing a documented reason is refused for it, whatever else it holds.
    match (&filter, repeat) {
        (_, Repeat::None) => {}
        (Err((rpc_code::PARSE_ERROR, m)), Repeat::Exact) if m.contains("same key twice") => {}
        (Err((rpc_code::PARSE_ERROR, m)), Repeat::Folded) if m.contains("letter case") => {}
        (r, rep) => panic!("an object repeats a key ({rep:?}); the filter answered {r:?}"),
    }
    if repeat == Repeat::None && misspelled {
        match &filter {
            Err((rpc_code::INVALID_REQUEST, m)) if m.contains("letter case") => {}
            r => panic!("a member is spelled in another letter case; the filter answered {r:?}"),
        }
    }

    match (filter, &plain_call) {
        // Both read the same call.
        (Ok(Message::ToolCall(c)), Some(p)) => {
            assert_eq!(
                (&c.id, &c.name, &c.arguments),
                (&p.id, &p.name, &p.arguments),
                "the filter and serde_json read different calls"
            );
        }
        (Ok(Message::ToolCall(c)), None) => {
            panic!("the filter reads a tools/call serde_json does not: {c:?}")
        }
        (Ok(m @ (Message::Other | Message::KeyedOther(_) | Message::ToolsList { .. })), _) => {
            assert!(
                plain_call.is_none() && !plain::could_be_call(&v),
                "the filter lets a tools/call pass as another message ({m:?})"
            );
        }
        (Err(_), None) => {}
        // A call serde_json reads is refused only for a documented reason.
        (Err((code, message)), Some(p)) => {
            let documented = match *code {
                rpc_code::PARSE_ERROR => repeat != Repeat::None,
                rpc_code::INVALID_REQUEST => misspelled,
                rpc_code::HEADER_MISMATCH => requires_mirrored_headers(&v),
                _ => false,
            };
            assert!(
                documented,
                "a tools/call serde_json reads ({p:?}) was refused without a documented reason: {code} {message}"
            );
        }
    }
}

/// `params._meta` names a protocol version that mirrors method and name in headers.
fn requires_mirrored_headers(v: &Value) -> bool {
    v["params"]["_meta"][mcp::PROTOCOL_VERSION_META]
        .as_str()
        .is_some_and(|version| version >= MIRRORING_VERSION)
}

pub fn check(data: &[u8]) {
    check_idempotency_header(data);
    compare_with_plain_reading(data, &parse_with_message(data, &Mirrored::default()));
    if let Some(v) = plain::read(data) {
        for variant in plain::case_variants(&v, 16) {
            compare_with_plain_reading(
                &variant,
                &parse_with_message(&variant, &Mirrored::default()),
            );
        }
    }

    let plain = parse(data, &Mirrored::default());
    assert_eq!(
        plain,
        parse(data, &Mirrored::default()),
        "not deterministic"
    );

    let call = match &plain {
        Ok(Message::ToolCall(c)) => {
            check_call(data, c);
            Some(c.clone())
        }
        _ => None,
    };

    let mut combos = fixed_combinations();
    if let Some(c) = &call {
        // Matching headers, legacy and 2026-07-28.
        combos.push(mirrored(Some("tools/call"), Some(&c.name), None, false));
        combos.push(mirrored(
            Some("tools/call"),
            Some(&c.name),
            Some(MIRRORING_VERSION),
            false,
        ));
    }
    for m in &combos {
        let r = parse(data, m);
        if let Some(c) = &call {
            match &r {
                Ok(Message::ToolCall(c2)) => assert_eq!(c2, c, "headers {m:?} changed the call"),
                Ok(Message::Other | Message::KeyedOther(_) | Message::ToolsList { .. }) => {
                    panic!("headers {m:?} took a tools/call out of governance")
                }
                Err(_) => {}
            }
            let method_mismatch = m.method.as_deref().is_some_and(|h| h != "tools/call");
            let name_mismatch = m.name.as_deref().is_some_and(|h| h != c.name);
            if method_mismatch || name_mismatch || m.duplicated {
                assert_eq!(
                    r,
                    Err(rpc_code::HEADER_MISMATCH),
                    "headers {m:?} on a call to {:?}",
                    c.name
                );
            }
            let matching = m.method.as_deref() == Some("tools/call")
                && m.name.as_deref() == Some(c.name.as_str())
                && !m.duplicated
                && m.protocol_version.is_none();
            if matching {
                assert_eq!(r, Ok(Message::ToolCall(c.clone())), "headers {m:?}");
            }
        } else if let Ok(Message::ToolCall(c2)) = &r {
            panic!("a header made a tools/call out of a body that is not one: {c2:?} under {m:?}");
        }
    }
}
