//! `plugin_config_structured`: structure-aware configurations. The input (through
//! `arbitrary`) builds a *valid* configuration, writes it as JSON (random key order), and
//! then applies at most one mutation: a field set to a value of the wrong type or out of
//! range, a required field removed, or an unknown field added.
//!
//! Asserts: without a mutation, `Config::parse` accepts it and every field reads back as
//! written (defaults where omitted); with one mutation, it is refused and the error names
//! exactly the mutated field; in both cases the checks of `plugin_config` hold.

use crate::plugin_config::{assert_no_secret_echo, assert_valid};
use arbitrary::{Arbitrary, Unstructured};
use atmost_config::UpstreamSecret;
use atmost_config::{
    Config, DenialFormat, ToolSet, UpstreamKey, DEFAULT_AUTHORITY, DEFAULT_MAX_BYTES,
    DEFAULT_PERMIT_HEADER, DEFAULT_REPORT_INTERVAL_MS, DEFAULT_TIMEOUT_MS, MAX_MAX_BYTES,
};
use serde_json::{json, Map, Value};

#[derive(Arbitrary, Debug)]
struct Spec {
    cluster: String,
    authority: Option<Vec<u8>>,
    timeout_ms: Option<u16>,
    service_token: Vec<u8>,
    permit_header: Option<Vec<u8>>,
    governed_tools: Option<Vec<String>>,
    key_required_tools: Option<Vec<String>>,
    upstream_key: Uk,
    denial_error: Option<bool>,
    max_body_bytes: Option<u32>,
    max_receipt_bytes: Option<u32>,
    report_interval_ms: Option<u16>,
    mutation: Option<Mutation>,
}

#[derive(Arbitrary, Debug)]
enum Uk {
    Hmac { explicit_mode: bool, secret: String },
    Raw,
    Off,
}

#[derive(Arbitrary, Debug)]
struct Mutation {
    field: u8,
    bad: u8,
    unknown_key: String,
}

const TOKEN: &[u8] =
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~";
const RESERVED: [&str; 12] = [
    "authorization",
    "idempotency-key",
    "host",
    "content-length",
    "content-type",
    "mcp-method",
    "mcp-name",
    "mcp-session-id",
    "mcp-protocol-version",
    "content-digest",
    "signature-input",
    "signature",
];

fn from_alphabet(bytes: &[u8], alphabet: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| char::from(alphabet[usize::from(*b) % alphabet.len()]))
        .collect()
}

fn printable(bytes: &[u8], with_space: bool) -> String {
    let lo = if with_space { 0x20 } else { 0x21 };
    bytes
        .iter()
        .map(|b| char::from(lo + b % (0x7f - lo)))
        .collect()
}

fn nonempty(s: String, fallback: &str) -> String {
    if s.is_empty() {
        fallback.to_string()
    } else {
        s
    }
}

fn tools(list: &[String]) -> Vec<String> {
    list.iter().map(|t| nonempty(t.clone(), "t")).collect()
}

fn tool_set(list: &[String]) -> ToolSet {
    if list.iter().any(|t| t == "*") {
        ToolSet::All
    } else {
        ToolSet::Only(list.to_vec())
    }
}

/// Paths a mutation may hit, with the kind of value the field holds.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Str,
    Int { min: u64, max: u64 },
    Tools,
    Obj,
}

pub fn check(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(spec) = Spec::arbitrary(&mut u) else {
        return;
    };

    // Build the valid configuration and what parse must read back.
    let cluster = nonempty(spec.cluster.clone(), "c");
    let authority = spec
        .authority
        .as_ref()
        .map(|a| nonempty(printable(a, false), "ledger"));
    let timeout_ms = spec.timeout_ms.map(|t| 1 + u64::from(t) % 60_000);
    // Padded to the shortest token the ledger, and so the configuration, accepts.
    let mut service_token = printable(&spec.service_token, true);
    while service_token.len() < atmost_config::MIN_SERVICE_TOKEN_BYTES {
        service_token.push('t');
    }
    let permit_header = spec.permit_header.as_ref().map(|p| {
        let h = nonempty(from_alphabet(p, TOKEN), "x-permit");
        if RESERVED.contains(&h.to_ascii_lowercase().as_str()) {
            "x-permit".to_string()
        } else {
            h
        }
    });
    let governed = spec.governed_tools.as_ref().map(|g| {
        let t = tools(g);
        if t.is_empty() {
            vec!["*".to_string()]
        } else {
            t
        }
    });
    let key_required = spec.key_required_tools.as_ref().map(|k| tools(k));
    let bytes_of = |n: Option<u32>| n.map(|n| 1 + u64::from(n) % MAX_MAX_BYTES);
    let (max_body, max_receipt) = (
        bytes_of(spec.max_body_bytes),
        bytes_of(spec.max_receipt_bytes),
    );
    let report = spec.report_interval_ms.map(|r| 10 + u64::from(r) % 59_991);

    let mut ledger = Map::new();
    ledger.insert("cluster".into(), json!(cluster));
    ledger.insert("service_token".into(), json!(service_token));
    if let Some(a) = &authority {
        ledger.insert("authority".into(), json!(a));
    }
    if let Some(t) = timeout_ms {
        ledger.insert("timeout_ms".into(), json!(t));
    }
    let mut root = Map::new();
    root.insert("ledger".into(), Value::Object(ledger));
    let (uk_json, uk_expected) = match &spec.upstream_key {
        Uk::Hmac {
            explicit_mode,
            secret,
        } => {
            let mut s = secret.clone();
            while s.len() < 16 {
                s.push('s');
            }
            let mut m = Map::new();
            m.insert("secret".into(), json!(s));
            if *explicit_mode {
                m.insert("mode".into(), json!("hmac"));
            }
            let secret = UpstreamSecret::new(s).expect("HMAC takes a key of any length");
            (Value::Object(m), UpstreamKey::Hmac { secret })
        }
        Uk::Raw => (json!({"mode": "raw"}), UpstreamKey::Raw),
        Uk::Off => (json!({"mode": "off"}), UpstreamKey::Off),
    };
    root.insert("upstream_key".into(), uk_json);
    if let Some(h) = &permit_header {
        root.insert("permit_header".into(), json!(h));
    }
    if let Some(g) = &governed {
        root.insert("governed_tools".into(), json!(g));
    }
    if let Some(k) = &key_required {
        root.insert("key_required_tools".into(), json!(k));
    }
    if let Some(e) = spec.denial_error {
        root.insert(
            "denial_format".into(),
            json!(if e { "error" } else { "result" }),
        );
    }
    if let Some(n) = max_body {
        root.insert("max_body_bytes".into(), json!(n));
    }
    if let Some(n) = max_receipt {
        root.insert("max_receipt_bytes".into(), json!(n));
    }
    if let Some(n) = report {
        root.insert("report_interval_ms".into(), json!(n));
    }

    let expected = Config {
        ledger: atmost_config::LedgerConfig {
            cluster,
            authority: authority.unwrap_or_else(|| DEFAULT_AUTHORITY.to_string()),
            timeout_ms: timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS),
            service_token,
        },
        permit_header: permit_header
            .unwrap_or_else(|| DEFAULT_PERMIT_HEADER.to_string())
            .to_ascii_lowercase(),
        governed_tools: governed.as_deref().map_or(ToolSet::All, tool_set),
        key_required_tools: key_required
            .as_deref()
            .map_or(ToolSet::Only(Vec::new()), tool_set),
        upstream_key: uk_expected,
        denial_format: if spec.denial_error == Some(true) {
            DenialFormat::Error
        } else {
            DenialFormat::Result
        },
        max_body_bytes: max_body.unwrap_or(DEFAULT_MAX_BYTES),
        max_receipt_bytes: max_receipt.unwrap_or(DEFAULT_MAX_BYTES),
        report_interval_ms: report.unwrap_or(DEFAULT_REPORT_INTERVAL_MS),
        tools_list_limits: false,
        credential_cache_ms: 0,
        completion_reports: atmost_config::CompletionReports::Batched,
        answer_release: atmost_config::AnswerRelease::AfterReceipt,
        report_ride_ms: 0,
        request_hold: atmost_config::RequestHold::Headers,
        signature_validity_s: atmost_config::DEFAULT_SIGNATURE_VALIDITY_S,
        approval_hold_ms: 0,
        upgrade_routes: atmost_config::UpgradeRoutes::none(),
    };

    // One mutation, and the field the refusal must name.
    let mut expect_field: Option<String> = None;
    if let Some(m) = &spec.mutation {
        let hmac = matches!(spec.upstream_key, Uk::Hmac { .. });
        let mut targets: Vec<(&str, Kind)> = vec![
            ("ledger", Kind::Obj),
            ("ledger.cluster", Kind::Str),
            ("ledger.authority", Kind::Str),
            (
                "ledger.timeout_ms",
                Kind::Int {
                    min: 1,
                    max: 60_000,
                },
            ),
            ("ledger.service_token", Kind::Str),
            ("permit_header", Kind::Str),
            ("governed_tools", Kind::Tools),
            ("key_required_tools", Kind::Tools),
            ("upstream_key", Kind::Obj),
            ("upstream_key.mode", Kind::Str),
            ("denial_format", Kind::Str),
            (
                "max_body_bytes",
                Kind::Int {
                    min: 1,
                    max: MAX_MAX_BYTES,
                },
            ),
            (
                "max_receipt_bytes",
                Kind::Int {
                    min: 1,
                    max: MAX_MAX_BYTES,
                },
            ),
            (
                "report_interval_ms",
                Kind::Int {
                    min: 10,
                    max: 60_000,
                },
            ),
            ("", Kind::Obj), // an unknown top-level field
        ];
        if hmac {
            targets.push(("upstream_key.secret", Kind::Str));
        }
        let (path, kind) = targets[usize::from(m.field) % targets.len()];
        let b = usize::from(m.bad);
        let (bad, field): (Value, String) = match kind {
            _ if path.is_empty() => {
                let k = format!("zz_{}", m.unknown_key);
                root.insert(k.clone(), json!(1));
                expect_field = Some(k);
                (Value::Null, String::new())
            }
            Kind::Obj => (
                [json!(null), json!(1), json!("x"), json!([])][b % 4].clone(),
                path.to_string(),
            ),
            Kind::Str => {
                // Wrong types, and strings every string field refuses (empty / a space for
                // the header-like ones / a bad enum value).
                let opts = [json!(null), json!(true), json!(3), json!(["x"]), json!({})];
                let v = if b % 7 < 5 {
                    opts[b % 7].clone()
                } else {
                    match path {
                        "ledger.authority" => json!("a b"),
                        "ledger.service_token" => json!("tab\tin"),
                        "permit_header" => json!("Authorization"),
                        "upstream_key.mode" | "denial_format" => json!("nope"),
                        "upstream_key.secret" => json!("short"),
                        _ => json!(""),
                    }
                };
                (v, path.to_string())
            }
            Kind::Int { min, max } => {
                let v = [
                    json!(-1),
                    json!(1.5),
                    json!("10"),
                    json!(max + 1),
                    json!(u64::MAX),
                    json!(null),
                ][b % 6]
                    .clone();
                let v = if b % 6 == 5 && min > 0 {
                    json!(min - 1)
                } else {
                    v
                };
                (v, path.to_string())
            }
            Kind::Tools => {
                let (v, f) = match b % 4 {
                    0 => (json!("tool"), path.to_string()),
                    1 => (json!(["a", ""]), format!("{path}[1]")),
                    2 => (json!([7]), format!("{path}[0]")),
                    _ => (json!({}), path.to_string()),
                };
                if path == "governed_tools" && b % 4 == 3 {
                    (json!([]), path.to_string())
                } else {
                    (v, f)
                }
            }
        };
        if !path.is_empty() {
            set_path(&mut root, path, bad);
            expect_field = Some(field);
        }
    }

    let text = Value::Object(root).to_string();
    let r = Config::parse(text.as_bytes());
    match (&r, &expect_field) {
        (Ok(c), None) => {
            assert_valid(c);
            assert_eq!(c, &expected, "config {text}");
        }
        (Err(e), None) => panic!("valid config refused ({e}): {text}"),
        (Ok(_), Some(f)) => panic!("mutated field `{f}` accepted: {text}"),
        (Err(e), Some(f)) => {
            assert_eq!(&e.field, f, "refusal names another field ({e}): {text}");
            assert_no_secret_echo(text.as_bytes(), &e.to_string());
        }
    }
}

fn set_path(root: &mut Map<String, Value>, path: &str, v: Value) {
    match path.split_once('.') {
        None => {
            root.insert(path.to_string(), v);
        }
        Some((a, b)) => {
            let entry = root.entry(a.to_string()).or_insert_with(|| json!({}));
            if let Value::Object(m) = entry {
                m.insert(b.to_string(), v);
            }
        }
    }
}
