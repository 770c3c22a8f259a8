//! `fingerprint`: arbitrary JSON → fingerprint, with the invariants of the fingerprint in
//! docs/design.md#words.
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
//!
//! And it compares:
//! - the canonical text with another RFC 8785 implementation's (`json-canon`, its own member
//!   sort and writer) on the same value, and the fingerprint with the SHA-256 of that text;
//! - every number the filter's body reader (`strict_json`) took with the double Rust's own
//!   float parser reads from the same token;
//! - a changed value (one node anywhere in the arguments: a string gains a character, a
//!   number becomes the next double, a boolean flips, `null` becomes `false`, a member or an
//!   element is added, removed or renamed), and a changed tool name, must change the
//!   fingerprint.
//!
//! The documented exception: numbers are IEEE doubles in RFC 8785, so texts of one double
//! share a fingerprint (`2^53` and `2^53 + 1`, `-0` and `0`, `1` and `1.0`); a change is a
//! change of the double. `tests/rfc8785_reference.rs` compares the committed corpus with
//! the Python `rfc8785` package too, which shares neither the JSON reader nor the number
//! writer.

use crate::util::Rng;
use atmost_filter::parse::fingerprint::{canonical, fingerprint, hex};
use atmost_filter::parse::mcp::{self, Message, Mirrored};
use atmost_filter::parse::strict_json;
use serde_json::{json, Map, Number, Value};
use sha2::{Digest, Sha256};
use std::ops::Range;

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

/// Where the number tokens outside strings are in a JSON text.
fn number_spans(text: &str) -> Vec<Range<usize>> {
    let b = text.as_bytes();
    let mut spans = Vec::new();
    let mut i = 0;
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
                spans.push(s..i);
            }
            _ => i += 1,
        }
    }
    spans
}

/// Rewrites every number token outside strings in a JSON text.
fn rewrite_numbers(text: &str, form: Form) -> Option<String> {
    let mut out = String::with_capacity(text.len() + 16);
    let mut start_plain = 0;
    for span in number_spans(text) {
        out.push_str(text.get(start_plain..span.start)?);
        out.push_str(&rewrite_number(text.get(span.clone())?, form)?);
        start_plain = span.end;
    }
    out.push_str(text.get(start_plain.min(text.len())..)?);
    Some(out)
}

/// `v` with every number an IEEE double, as RFC 8785 reads numbers (`2^53 + 1` is `2^53`).
fn as_doubles(v: &Value) -> Value {
    match v {
        Value::Number(n) => match n.as_f64().and_then(Number::from_f64) {
            Some(d) => Value::Number(d),
            None => panic!("a parsed number is not a finite double: {n}"),
        },
        Value::Array(a) => Value::Array(a.iter().map(as_doubles).collect()),
        Value::Object(m) => {
            Value::Object(m.iter().map(|(k, v)| (k.clone(), as_doubles(v))).collect())
        }
        other => other.clone(),
    }
}

/// The canonical text of the hashed object by another RFC 8785 implementation
/// (`json-canon`: its own member sort and writer).
fn independent_canonical(tool: &str, args: &Map<String, Value>) -> String {
    let hashed = json!({"tool": tool, "arguments": as_doubles(&Value::Object(args.clone()))});
    match json_canon::to_string(&hashed) {
        Ok(t) => t,
        Err(e) => panic!("json-canon refuses {hashed}: {e}"),
    }
}

/// The filter's canonical text and fingerprint against the independent implementation.
fn compare_with_independent(tool: &str, args: &Map<String, Value>, canon: &str, f: &str) {
    let other = independent_canonical(tool, args);
    assert_eq!(
        canon, other,
        "the filter's RFC 8785 text differs from json-canon's"
    );
    assert_eq!(
        f,
        hex(&Sha256::digest(other.as_bytes())),
        "the fingerprint is not the SHA-256 of the canonical text"
    );
}

/// A double's identity for comparing readings: `-0` is `0` (RFC 8785 writes both as `0`).
fn number_key(d: f64) -> u64 {
    if d == 0.0 {
        0
    } else {
        d.to_bits()
    }
}

/// Every number the filter's reader took from `text` is the double nearest to its token,
/// as Rust's own float parser reads it: two numbers that differ as doubles must not be
/// read as one.
fn check_numbers_read_exactly(text: &str, value: &Value) {
    fn collect(v: &Value, out: &mut Vec<u64>) {
        match v {
            Value::Number(n) => out.push(number_key(n.as_f64().unwrap_or(f64::NAN))),
            Value::Array(a) => a.iter().for_each(|x| collect(x, out)),
            Value::Object(m) => m.values().for_each(|x| collect(x, out)),
            _ => {}
        }
    }
    let mut read = Vec::new();
    collect(value, &mut read);
    let mut tokens: Vec<u64> = number_spans(text)
        .into_iter()
        .map(|span| match text[span.clone()].parse::<f64>() {
            Ok(d) => number_key(d),
            Err(e) => panic!("number token {:?} does not parse: {e}", &text[span]),
        })
        .collect();
    read.sort_unstable();
    tokens.sort_unstable();
    assert_eq!(
        read, tokens,
        "the filter's reader took other doubles than the number tokens of {text}"
    );
}

/// Every node of `v`, pre-order, as paths of member keys and array indices.
fn paths(v: &Value, here: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    out.push(here.clone());
    match v {
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                here.push(Step::Index(i));
                paths(x, here, out);
                here.pop();
            }
        }
        Value::Object(m) => {
            for (k, x) in m {
                here.push(Step::Key(k.clone()));
                paths(x, here, out);
                here.pop();
            }
        }
        _ => {}
    }
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

fn node_mut<'a>(v: &'a mut Value, path: &[Step]) -> Option<&'a mut Value> {
    let mut node = v;
    for step in path {
        node = match (step, node) {
            (Step::Key(k), Value::Object(m)) => m.get_mut(k)?,
            (Step::Index(i), Value::Array(a)) => a.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(node)
}

/// A key not in `m`.
fn fresh_key(m: &Map<String, Value>, base: &str) -> String {
    let mut k = format!("{base}~");
    while m.contains_key(&k) {
        k.push('~');
    }
    k
}

/// Changes one node of `args` (chosen by `rng`) to a different value as RFC 8785 sees it:
/// a string gains a character, a number becomes the next double, a boolean flips, `null`
/// becomes `false`, an object loses, gains or renames a member, an array loses or gains an
/// element. Says what it did.
fn mutate(args: &mut Value, rng: &mut Rng) -> String {
    let mut all = Vec::new();
    paths(args, &mut Vec::new(), &mut all);
    let path = all[rng.below(all.len())].clone();
    let choice = rng.below(3);
    let Some(node) = node_mut(args, &path) else {
        panic!("path {path:?} lost");
    };
    let what = match node {
        Value::String(s) => {
            s.push('x');
            "string + x"
        }
        Value::Number(n) => {
            let d = n.as_f64().unwrap_or(0.0);
            let next = if d.next_up().is_finite() {
                d.next_up()
            } else {
                d.next_down()
            };
            match Number::from_f64(next) {
                Some(m) => *n = m,
                None => panic!("no double after {d}"),
            }
            "number → next double"
        }
        Value::Bool(b) => {
            *b = !*b;
            "bool flipped"
        }
        Value::Null => {
            *node = Value::Bool(false);
            "null → false"
        }
        Value::Array(a) => {
            if a.is_empty() || choice == 0 {
                a.push(Value::Null);
                "array + null"
            } else {
                a.remove(rng.below(a.len()));
                "array element removed"
            }
        }
        Value::Object(m) => {
            let keys: Vec<String> = m.keys().cloned().collect();
            if keys.is_empty() || choice == 0 {
                m.insert(fresh_key(m, ""), Value::Null);
                "member added"
            } else {
                let k = &keys[rng.below(keys.len())];
                let value = m.remove(k).unwrap_or(Value::Null);
                if choice == 1 {
                    "member removed"
                } else {
                    m.insert(fresh_key(m, k), value);
                    "member renamed"
                }
            }
        }
    };
    format!("{what} at {path:?}")
}

/// A changed value changes the fingerprint: one change per run, anywhere in the arguments,
/// and a changed tool name.
fn check_changes_change_the_fingerprint(args: &Map<String, Value>, f: &str, rng: &mut Rng) {
    let mut changed = Value::Object(args.clone());
    let what = mutate(&mut changed, rng);
    let Value::Object(changed) = changed else {
        panic!("the arguments stopped being an object");
    };
    // The change is one to RFC 8785 itself, or the mutation is wrong.
    assert_ne!(
        independent_canonical(TOOL, args),
        independent_canonical(TOOL, &changed),
        "mutation ({what}) changed nothing"
    );
    assert_ne!(
        fp(&changed),
        f,
        "{what}: a changed value kept the fingerprint"
    );
    let other_tool = fingerprint(&format!("{TOOL}_2"), args).ok();
    assert_ne!(
        other_tool.as_deref(),
        Some(f),
        "another tool name kept the fingerprint"
    );
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

    // Another implementation writes the same text, and the hash is its SHA-256.
    compare_with_independent(TOOL, &args, &canon, &f);

    // The reader the filter uses for bodies took every number exactly (a text naming a
    // key twice is refused there, and loses values here).
    if let Ok(strict) = strict_json::from_slice(data) {
        check_numbers_read_exactly(text, &strict);
    }

    // Key order, whitespace, string escapes.
    let mut rng = Rng::new(data);
    check_changes_change_the_fingerprint(&args, &f, &mut rng);
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
                Ok(Message::Other | Message::KeyedOther(_) | Message::ToolsList { .. }) => {
                    panic!("a tools/call body was read as another message")
                }
                Err(_) => {}
            }
        }
    }
}
