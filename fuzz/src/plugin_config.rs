//! `plugin_config`: `Config::parse` on arbitrary bytes.
//!
//! Asserts: it never panics and is deterministic; an accepted configuration holds every
//! documented bound (ranges, header name rules, secret length, non-empty governed tools);
//! a refusal's message never echoes `ledger.service_token` or `upstream_key.secret`.

use atmost_config::{Config, ToolSet, UpstreamKey, MAX_MAX_BYTES, MIN_SECRET_BYTES};
use serde_json::Value;

/// Checks an accepted configuration against the documented rules.
pub fn assert_valid(c: &Config) {
    assert!(!c.ledger.cluster.is_empty());
    assert!(!c.ledger.authority.is_empty() && !c.ledger.authority.contains(' '));
    assert!(c
        .ledger
        .authority
        .bytes()
        .all(|b| (0x20..=0x7e).contains(&b)));
    assert!((1..=60_000).contains(&c.ledger.timeout_ms));
    assert!(!c.ledger.service_token.is_empty());
    assert!(c
        .ledger
        .service_token
        .bytes()
        .all(|b| (0x20..=0x7e).contains(&b)));
    assert!(!c.permit_header.is_empty());
    assert_eq!(c.permit_header, c.permit_header.to_ascii_lowercase());
    assert!(c
        .permit_header
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)));
    assert!(![
        "authorization",
        "idempotency-key",
        "host",
        "mcp-method",
        "mcp-name"
    ]
    .contains(&c.permit_header.as_str()));
    assert_ne!(c.governed_tools, ToolSet::Only(Vec::new()));
    for set in [&c.governed_tools, &c.key_required_tools] {
        if let ToolSet::Only(names) = set {
            assert!(names.iter().all(|n| !n.is_empty() && n != "*"));
        }
    }
    if let UpstreamKey::Hmac { secret } = &c.upstream_key {
        assert!(secret.len() >= MIN_SECRET_BYTES);
    }
    assert!((1..=MAX_MAX_BYTES).contains(&c.max_body_bytes));
    assert!((1..=MAX_MAX_BYTES).contains(&c.max_receipt_bytes));
    assert!((10..=60_000).contains(&c.report_interval_ms));
}

/// Every object key in a JSON value (a refusal names an unknown field by its key).
fn keys(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                out.push(k.clone());
                keys(x, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| keys(x, out)),
        _ => {}
    }
}

/// Same length and character classes, different characters.
fn rotate(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            'a'..='y' | 'A'..='Y' | '0'..='8' => char::from(c as u8 + 1),
            'z' => 'a',
            'Z' => 'A',
            '9' => '0',
            other => other,
        })
        .collect()
}

/// A refusal never carries a secret of the input. A secret that happens to be part of a
/// message's fixed text is told apart by changing it: an echo follows the change.
pub fn assert_no_secret_echo(input: &[u8], message: &str) {
    let Ok(v) = serde_json::from_slice::<Value>(input) else {
        return;
    };
    let mut names = Vec::new();
    keys(&v, &mut names);
    for path in [["ledger", "service_token"], ["upstream_key", "secret"]] {
        let Some(s) = v[path[0]][path[1]].as_str() else {
            continue;
        };
        if s.len() < 6 || !message.contains(s) {
            continue;
        }
        let s2 = rotate(s);
        // A key holding the value is named in the refusal; that is the key, not the secret.
        if s2 == s || names.iter().any(|k| k.contains(s) || k.contains(&s2)) {
            continue;
        }
        let mut v2 = v.clone();
        v2[path[0]][path[1]] = Value::String(s2.clone());
        let message2 = match Config::parse(v2.to_string().as_bytes()) {
            Ok(_) => continue,
            Err(e) => e.to_string(),
        };
        assert!(
            !message2.contains(&s2),
            "refusal echoes `{}.{}`: {message}",
            path[0],
            path[1]
        );
    }
}

pub fn check(data: &[u8]) {
    let r = Config::parse(data);
    assert_eq!(r, Config::parse(data), "not deterministic");
    match r {
        Ok(c) => assert_valid(&c),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with("atmost: bad plugin configuration"));
            assert_no_secret_echo(data, &msg);
        }
    }
}
