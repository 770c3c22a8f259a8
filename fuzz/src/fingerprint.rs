//! `fingerprint`: arbitrary JSON → fingerprint, with the invariants of the design's
//! "fingerprint" entry.
//!
//! The input is read as JSON text; an object is the `arguments`, any other value is wrapped
//! as `{"v": value}`. Asserts:
//! - a parsed value always canonicalises (`Ok`), as 64 lowercase hex digits;
//! - the canonical text parses back to a value with the same fingerprint (idempotent);
//! - re-serialising the arguments with keys in shuffled order, arbitrary whitespace and
//!   strings written with `\u` escapes gives the same fingerprint;
//! - rewriting every number token of the *original text* to an equal number in another
//!   form (`1` → `1.0E+0`, `1.5` → `15e-1`, …) gives the same fingerprint: `1`, `1.0` and
//!   `1e0` are one number;
//! - the same arguments inside a whole `tools/call` body, with any `id` and `_meta`, give
//!   the same fingerprint through `mcp::parse`.

use crate::util::Rng;
use atmost_filter::fingerprint::{canonical, fingerprint};
use atmost_filter::mcp::{self, Message, Mirrored};
use serde_json::{Map, Value};

const TOOL: &str = "fuzz_tool";

fn fp(args: &Map<String, Value>) -> String {
    match fingerprint(TOOL, args) {
        Ok(f) => f,
        Err(e) => panic!("a parsed JSON value cannot be fingerprinted: {e}"),
    }
}

fn as_arguments(v: Value) -> (Map<String, Value>, bool) {
    match v {
        Value::Object(m) => (m, true),
        other => {
            let mut m = Map::new();
            m.insert("v".into(), other);
            (m, false)
        }
    }
}

fn write_string(s: &str, out: &mut String, escape_all: bool) {
    if !escape_all {
        out.push_str(&Value::String(s.to_string()).to_string());
        return;
    }
    out.push('"');
    for unit in s.encode_utf16() {
        out.push_str(&format!("\\u{unit:04x}"));
    }
    out.push('"');
}

fn ws(rng: &mut Rng, out: &mut String) {
    const WS: [&str; 5] = ["", " ", "\n", "\t", "\r\n  "];
    out.push_str(WS[rng.below(WS.len())]);
}

/// Writes `v` as JSON with shuffled keys, random whitespace and (sometimes) escaped strings.
fn write_shuffled(v: &Value, rng: &mut Rng, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            for i in (1..keys.len()).rev() {
                keys.swap(i, rng.below(i + 1));
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(rng, out);
                let esc = rng.below(3) == 0;
                write_string(k, out, esc);
                ws(rng, out);
                out.push(':');
                ws(rng, out);
                write_shuffled(&m[k.as_str()], rng, out);
                ws(rng, out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(rng, out);
                write_shuffled(x, rng, out);
                ws(rng, out);
            }
            out.push(']');
        }
        Value::String(s) => {
            let esc = rng.below(3) == 0;
            write_string(s, out, esc);
        }
        other => out.push_str(&other.to_string()),
    }
}

/// How a number token is rewritten.
#[derive(Clone, Copy)]
enum Form {
    /// `1` → `1.0E+0`, `1.5` → `1.5e0`, `1e3` stays.
    AddFractionAndExponent,
    /// Moves the decimal point into the exponent: `1.5` → `15e-1`, `12` → `12e0`.
    DigitsTimesPowerOfTen,
}

/// Rewrites one JSON number token to an equal number; `None` when it cannot (huge exponent).
fn rewrite_number(tok: &str, form: Form) -> Option<String> {
    let (sign, rest) = match tok.strip_prefix('-') {
        Some(r) => ("-", r),
        None => ("", tok),
    };
    let (mantissa, exp) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let (int, frac) = match mantissa.find('.') {
        Some(i) => (&mantissa[..i], Some(&mantissa[i + 1..])),
        None => (mantissa, None),
    };
    match form {
        Form::AddFractionAndExponent => {
            let mut s = format!("{sign}{int}.{}", frac.unwrap_or("0"));
            match exp {
                Some(e) => {
                    s.push('e');
                    s.push_str(e);
                }
                None => s.push_str("E+0"),
            }
            Some(s)
        }
        Form::DigitsTimesPowerOfTen => {
            let e: i64 = match exp {
                None => 0,
                Some(e) if e.len() <= 12 => e.trim_start_matches('+').parse().ok()?,
                Some(_) => return None,
            };
            let frac = frac.unwrap_or("");
            let digits = format!("{int}{frac}");
            let trimmed = digits.trim_start_matches('0');
            let digits = if trimmed.is_empty() { "0" } else { trimmed };
            let e = e.checked_sub(i64::try_from(frac.len()).ok()?)?;
            Some(format!("{sign}{digits}e{e}"))
        }
    }
}

/// Rewrites every number token outside strings in a JSON text.
fn rewrite_numbers(text: &str, form: Form) -> Option<String> {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 16);
    let mut i = 0;
    let mut start_plain = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                // Skip the string, honouring escapes.
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let s = i;
                while i < b.len() && matches!(b[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    i += 1;
                }
                out.push_str(text.get(start_plain..s)?);
                out.push_str(&rewrite_number(text.get(s..i)?, form)?);
                start_plain = i;
            }
            _ => i += 1,
        }
    }
    out.push_str(text.get(start_plain.min(text.len())..)?);
    Some(out)
}

fn parse_args(text: &str) -> Option<Map<String, Value>> {
    serde_json::from_str::<Value>(text)
        .ok()
        .map(|v| as_arguments(v).0)
}

pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(value) = serde_json::from_str::<Value>(text) else {
        return;
    };
    let (args, is_object) = as_arguments(value);
    let f = fp(&args);
    assert_eq!(f.len(), 64);
    assert!(
        f.bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)),
        "{f}"
    );

    // Canonical form is a fixed point.
    let canon = match canonical(TOOL, &args) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    let back: Value = match serde_json::from_str(&canon) {
        Ok(v) => v,
        Err(e) => panic!("canonical text is not JSON ({e}): {canon}"),
    };
    let back_args = match back.get("arguments") {
        Some(Value::Object(m)) => m.clone(),
        other => panic!("canonical text lost the arguments: {other:?}"),
    };
    assert_eq!(back.get("tool"), Some(&Value::String(TOOL.into())));
    assert_eq!(
        fp(&back_args),
        f,
        "canonical text re-read changes the fingerprint: {canon}"
    );

    // Key order, whitespace, string escapes.
    let mut rng = Rng::new(data);
    for _ in 0..2 {
        let mut out = String::new();
        write_shuffled(&Value::Object(args.clone()), &mut rng, &mut out);
        match parse_args(&out) {
            Some(a) => assert_eq!(fp(&a), f, "re-serialised as {out}"),
            None => panic!("re-serialised arguments are not JSON: {out}"),
        }
    }

    // Number forms, rewritten in the original text.
    for form in [Form::AddFractionAndExponent, Form::DigitsTimesPowerOfTen] {
        if let Some(rewritten) = rewrite_numbers(text, form) {
            if let Some(a) = parse_args(&rewritten) {
                assert_eq!(
                    fp(&a),
                    f,
                    "numbers rewritten change the fingerprint:\n  {text}\n  {rewritten}"
                );
            }
        }
    }

    // Inside a tools/call body, with an id and _meta that must not matter.
    if is_object {
        for (id, meta) in [
            ("1", r#"{}"#),
            (
                r#""req-x""#,
                r#"{"dev.atmost/idempotency-key":"k","progressToken":7}"#,
            ),
        ] {
            let body = format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"_meta":{meta},"arguments":{text},"name":"{TOOL}"}}}}"#
            );
            match mcp::parse(body.as_bytes(), &Mirrored::default()) {
                Ok(Message::ToolCall(c)) => {
                    assert_eq!(
                        fingerprint(&c.name, &c.arguments).ok().as_deref(),
                        Some(f.as_str())
                    )
                }
                // A nesting depth the arguments alone did not reach can be refused.
                Ok(Message::Other | Message::KeyedOther(_)) => {
                    panic!("a tools/call body was read as another message")
                }
                Err(_) => {}
            }
        }
    }
}
