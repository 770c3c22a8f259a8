//! `plugin_config`: `Config::parse` on arbitrary bytes.
//!
//! Asserts: it never panics and is deterministic; an accepted configuration holds every
//! documented bound (ranges, header name rules, secret length, non-empty governed tools);
//! a refusal's message never echoes `ledger.service_token` or `upstream_key.secret`.

use atmost_filter::config::{
    Config, ToolSet, UpstreamKey, MAX_MAX_BYTES, MIN_SECRET_BYTES,
};
use serde_json::Value;

/// Checks an accepted configuration against the documented rules.
pub fn assert_valid(c: &Config) {
    assert!(!c.ledger.cluster.is_empty());
    assert!(!c.ledger.authority.is_empty() && !c.ledger.authority.contains(' '));
    assert!(c.ledger.authority.bytes().all(|b| (0x20..=0x7e).contains(&b)));
    assert!((1..=60_000).contains(&c.ledger.timeout_ms));
    assert!(!c.ledger.service_token.is_empty());
    assert!(c.ledger.service_token.bytes().all(|b| (0x20..=0x7e).contains(&b)));
    assert!(!c.permit_header.is_empty());
    assert_eq!(c.permit_header, c.permit_header.to_ascii_lowercase());
    assert!(c
        .permit_header
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)));
    assert!(!["authorization", "idempotency-key", "host", "mcp-method", "mcp-name"]
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

/// Every object key in a JSON value (a refusal may name an unknown field).
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

/// A refusal never carries a secret of the input.
pub fn assert_no_secret_echo(input: &[u8], message: &str) {
    let Ok(v) = serde_json::from_slice::<Value>(input) else {
        return;
    };
    let mut names = Vec::new();
    keys(&v, &mut names);
    for secret in [
        &v["ledger"]["service_token"],
        &v["upstream_key"]["secret"],
    ] {
        let Some(s) = secret.as_str() else { continue };
        // Short or digit-only values can match a field name or a number in a message.
        if s.len() < 10 || s.bytes().all(|b| b.is_ascii_digit() || b == b' ') {
            continue;
        }
        if names.iter().any(|k| k.contains(s)) {
            continue;
        }
        assert!(!message.contains(s), "refusal echoes a secret: {message}");
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
