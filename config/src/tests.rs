//! The gateway configuration's parser: every field, its default and its refusals.

use super::*;
use serde_json::json;

/// A service token of the length the ledger accepts.
const SERVICE_TOKEN: &str = "svc-token-0123456789abcdef0123456789";

fn minimal() -> Value {
    json!({
        "ledger": {"cluster": "atmost_ledger", "service_token": SERVICE_TOKEN},
        "upstream_key": {"secret": "0123456789abcdef0123"}
    })
}

fn config_from(v: &Value) -> Config {
    match Config::parse(v.to_string().as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    }
}

fn field_of(v: &Value) -> String {
    match Config::parse(v.to_string().as_bytes()) {
        Ok(_) => panic!("accepted {v}"),
        Err(e) => {
            assert!(e.to_string().contains(&e.field), "{e}");
            e.field
        }
    }
}

#[test]
fn defaults() {
    let c = config_from(&minimal());
    assert_eq!(c.ledger.cluster, "atmost_ledger");
    assert_eq!(c.ledger.authority, "atmost-ledger");
    assert_eq!(c.ledger.timeout_ms, 1000);
    assert_eq!(c.permit_header, "atmost-permit");
    assert_eq!(c.governed_tools, ToolSet::All);
    assert_eq!(c.key_required_tools, ToolSet::Only(vec![]));
    assert_eq!(
        c.upstream_key,
        UpstreamKey::Hmac {
            secret: UpstreamSecret::new("0123456789abcdef0123".into()).unwrap()
        }
    );
    assert_eq!(c.denial_format, DenialFormat::Result);
    assert_eq!(c.max_body_bytes, 1_048_576);
    assert_eq!(c.max_receipt_bytes, 1_048_576);
    assert_eq!(c.report_interval_ms, 200);
    assert_eq!(c.completion_reports, CompletionReports::Batched);
    assert!(!c.tools_list_limits);
    assert_eq!(c.request_hold, RequestHold::Headers);
    assert_eq!(c.signature_validity_s, 15);
    assert_eq!(c.upgrade_routes, UpgradeRoutes::none());
}

#[test]
fn upgrade_routes_names_the_routes_that_may_upgrade() {
    let mut v = minimal();
    v["upgrade_routes"] = json!(["chat-ws"]);
    let routes = config_from(&v).upgrade_routes;
    assert!(routes.allows(Some("chat-ws")) && !routes.allows(Some("mcp")));
    for (bad, field) in [
        (json!("chat-ws"), "upgrade_routes"),
        (json!(["chat-ws", ""]), "upgrade_routes[1]"),
        (json!(["default"]), "upgrade_routes[0]"),
    ] {
        v["upgrade_routes"] = bad;
        assert_eq!(field_of(&v), field);
    }
}

#[test]
fn signature_validity_is_whole_seconds_up_to_the_ledgers_longest() {
    let mut v = minimal();
    for ok in [1, 15, 120, MAX_VALIDITY_S] {
        v["signature_validity_s"] = json!(ok);
        assert_eq!(config_from(&v).signature_validity_s, ok);
    }
    for bad in [
        json!(0),
        json!(MAX_VALIDITY_S + 1),
        json!(-1),
        json!(1.5),
        json!("15"),
        json!(null),
    ] {
        v["signature_validity_s"] = bad.clone();
        assert_eq!(field_of(&v), "signature_validity_s", "{bad}");
    }
}

#[test]
fn credential_cache_ms_is_off_by_default_and_bounded() {
    let mut v = minimal();
    assert_eq!(config_from(&v).credential_cache_ms, 0);
    v["credential_cache_ms"] = json!(30_000);
    assert_eq!(config_from(&v).credential_cache_ms, 30_000);
    for bad in [json!(300_001), json!(-1), json!("10s"), json!(1.5)] {
        v["credential_cache_ms"] = bad.clone();
        let e = Config::parse(v.to_string().as_bytes());
        assert!(
            matches!(&e, Err(e) if e.to_string().contains("credential_cache_ms")),
            "{bad}: {e:?}"
        );
    }
}

#[test]
fn approval_hold_ms_is_off_by_default_bounded_and_needs_a_quick_tick() {
    let mut v = minimal();
    assert_eq!(config_from(&v).approval_hold_ms, 0);
    v["approval_hold_ms"] = json!(MAX_APPROVAL_HOLD_MS);
    assert_eq!(config_from(&v).approval_hold_ms, 240_000);
    for bad in [
        json!(240_001),
        json!(-1),
        json!("30s"),
        json!(1.5),
        json!(null),
    ] {
        v["approval_hold_ms"] = bad.clone();
        assert_eq!(field_of(&v), "approval_hold_ms", "{bad}");
    }
    // Re-asks ride the root's tick: a tick slower than a second is refused with a hold, and
    // stays allowed without one.
    v["approval_hold_ms"] = json!(30_000);
    v["report_interval_ms"] = json!(1_000);
    assert_eq!(config_from(&v).approval_hold_ms, 30_000);
    v["report_interval_ms"] = json!(1_001);
    assert_eq!(field_of(&v), "approval_hold_ms");
    v["approval_hold_ms"] = json!(0);
    assert_eq!(config_from(&v).report_interval_ms, 1_001);
}

#[test]
fn tools_list_limits_is_a_boolean() {
    let mut v = minimal();
    v["tools_list_limits"] = json!(true);
    assert!(config_from(&v).tools_list_limits);
    v["tools_list_limits"] = json!(false);
    assert!(!config_from(&v).tools_list_limits);
    for bad in [json!("true"), json!(1), json!(null), json!({})] {
        v["tools_list_limits"] = bad.clone();
        assert_eq!(field_of(&v), "tools_list_limits", "{bad}");
    }
}

#[test]
fn request_hold_modes() {
    let mut v = minimal();
    v["request_hold"] = json!("body");
    assert_eq!(config_from(&v).request_hold, RequestHold::Body);
    v["request_hold"] = json!("headers");
    assert_eq!(config_from(&v).request_hold, RequestHold::Headers);
}

#[test]
fn secrets_can_come_from_the_vms_environment() {
    let env = |name: &str| match name {
        "ATMOST_SERVICE_TOKEN" => Some("svc-from-env-0123456789abcdef0123456789".to_string()),
        "ATMOST_UPSTREAM_KEY_SECRET" => Some("0123456789abcdef-from-env".to_string()),
        "EMPTY" => Some(String::new()),
        _ => None,
    };
    let parse = |v: &Value| Config::parse_with_env(v.to_string().as_bytes(), &env);
    let from_env = json!({
        "ledger": {"cluster": "c", "service_token_env": "ATMOST_SERVICE_TOKEN"},
        "upstream_key": {"secret_env": "ATMOST_UPSTREAM_KEY_SECRET"}
    });
    let c = parse(&from_env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        c.ledger.service_token,
        "svc-from-env-0123456789abcdef0123456789"
    );
    assert_eq!(
        c.upstream_key,
        UpstreamKey::Hmac {
            secret: UpstreamSecret::new("0123456789abcdef-from-env".into()).unwrap()
        }
    );
    let refused = |v: Value| match parse(&v) {
        Ok(_) => panic!("accepted {v}"),
        Err(e) => (e.field.clone(), e.to_string()),
    };
    let (field, text) = refused(json!({
        "ledger": {"cluster": "c", "service_token_env": "UNSET"},
        "upstream_key": {"mode": "off"}
    }));
    assert_eq!(field, "ledger.service_token_env");
    assert!(
        text.contains("UNSET") && text.contains("host_env_keys"),
        "{text}"
    );
    assert_eq!(
        refused(json!({
            "ledger": {"cluster": "c", "service_token_env": "EMPTY"},
            "upstream_key": {"mode": "off"}
        }))
        .0,
        "ledger.service_token_env"
    );
    assert_eq!(
        refused(json!({
            "ledger": {"cluster": "c", "service_token": SERVICE_TOKEN, "service_token_env": "ATMOST_SERVICE_TOKEN"},
            "upstream_key": {"mode": "off"}
        }))
        .0,
        "ledger.service_token"
    );
    assert_eq!(
        refused(json!({
            "ledger": {"cluster": "c", "service_token": SERVICE_TOKEN},
            "upstream_key": {"mode": "raw", "secret_env": "ATMOST_UPSTREAM_KEY_SECRET"}
        }))
        .0,
        "upstream_key.secret"
    );
    // The length rule holds for a secret from the environment too.
    let short = |name: &str| (name == "SHORT").then(|| "short".to_string());
    let r = Config::parse_with_env(
        json!({"ledger": {"cluster": "c", "service_token": SERVICE_TOKEN}, "upstream_key": {"secret_env": "SHORT"}})
            .to_string()
            .as_bytes(),
        &short,
    );
    assert_eq!(r.err().map(|e| e.field), Some("upstream_key.secret".into()));
}

#[test]
fn a_service_token_the_ledger_would_refuse_is_refused_here() {
    let with_token = |token: &str| json!({"ledger": {"cluster": "c", "service_token": token}, "upstream_key": {"mode": "off"}});
    let shortest = "s".repeat(MIN_SERVICE_TOKEN_BYTES);
    let c = Config::parse(with_token(&shortest).to_string().as_bytes());
    assert_eq!(
        c.map(|c| c.ledger.service_token).ok(),
        Some(shortest.clone())
    );
    let one_short = &shortest[1..];
    let (field, text) = match Config::parse(with_token(one_short).to_string().as_bytes()) {
        Ok(_) => panic!("accepted a {}-byte token", one_short.len()),
        Err(e) => (e.field.clone(), e.to_string()),
    };
    assert_eq!(field, "ledger.service_token");
    assert!(
        text.contains("at least 32 bytes") && text.contains("this one has 31"),
        "{text}"
    );
    assert!(!text.contains(one_short), "the token is echoed: {text}");
    // From the VM's environment too.
    let env = |name: &str| (name == "SHORT").then(|| one_short.to_string());
    let r = Config::parse_with_env(
        json!({"ledger": {"cluster": "c", "service_token_env": "SHORT"}, "upstream_key": {"mode": "off"}})
            .to_string()
            .as_bytes(),
        &env,
    );
    assert_eq!(
        r.err().map(|e| e.field),
        Some("ledger.service_token".into())
    );
}

#[test]
fn completion_reports_modes() {
    let mut v = minimal();
    v["completion_reports"] = json!("per_call");
    assert_eq!(
        config_from(&v).completion_reports,
        CompletionReports::PerCall
    );
    v["completion_reports"] = json!("batched");
    assert_eq!(
        config_from(&v).completion_reports,
        CompletionReports::Batched
    );
}

#[test]
fn answer_release_modes() {
    let mut v = minimal();
    assert_eq!(config_from(&v).answer_release, AnswerRelease::AfterReceipt);
    for (name, mode) in AnswerRelease::NAMES.into_iter().zip(AnswerRelease::ALL) {
        v["answer_release"] = json!(name);
        assert_eq!(config_from(&v).answer_release, mode);
    }
    v["answer_release"] = json!("at_once");
    v["completion_reports"] = json!("per_call");
    let refused = Config::parse(v.to_string().as_bytes()).err();
    assert_eq!(
        refused.as_ref().map(|e| e.field.as_str()),
        Some("answer_release")
    );
    assert!(refused.is_some_and(|e| e.message.contains("completion_reports: batched")));
    v["answer_release"] = json!("sometimes");
    let refused = Config::parse(v.to_string().as_bytes()).err();
    assert_eq!(
        refused.map(|e| e.to_string()),
        Some("atmost: bad plugin configuration: field `answer_release`: must be one of `after_receipt`, `at_once`".into())
    );
}

#[test]
fn report_ride_ms_is_off_by_default_bounded_and_needs_answers_released_at_once() {
    let mut v = minimal();
    assert_eq!(config_from(&v).report_ride_ms, 0);
    v["answer_release"] = json!("at_once");
    assert_eq!(config_from(&v).report_ride_ms, 0);
    v["report_ride_ms"] = json!(MAX_REPORT_RIDE_MS);
    assert_eq!(config_from(&v).report_ride_ms, 5_000);
    for bad in [
        json!(5_001),
        json!(-1),
        json!("1s"),
        json!(1.5),
        json!(null),
    ] {
        v["report_ride_ms"] = bad.clone();
        assert_eq!(field_of(&v), "report_ride_ms", "{bad}");
    }
    // A held answer waits for its report, so only a released call's report may wait.
    v["report_ride_ms"] = json!(500);
    v["answer_release"] = json!("after_receipt");
    let refused = Config::parse(v.to_string().as_bytes()).err();
    assert_eq!(
        refused.as_ref().map(|e| e.field.as_str()),
        Some("report_ride_ms")
    );
    assert!(refused.is_some_and(|e| e.message.contains("answer_release: at_once")));
    v["report_ride_ms"] = json!(0);
    assert_eq!(config_from(&v).report_ride_ms, 0);
}

#[test]
fn full_example_parses() {
    let c = config_from(&json!({
      "ledger": {"cluster": "atmost_ledger", "authority": "ledger.local", "timeout_ms": 250, "service_token": SERVICE_TOKEN},
      "permit_header": "X-Agent-Permit",
      "governed_tools": ["pay_invoice", "send_email"],
      "key_required_tools": ["*"],
      "upstream_key": {"mode": "off"},
      "denial_format": "error",
      "max_body_bytes": 2048,
      "max_receipt_bytes": 4096,
      "report_interval_ms": 50
    }));
    assert_eq!(c.permit_header, "x-agent-permit");
    assert!(c.governed_tools.contains("pay_invoice"));
    assert!(!c.governed_tools.contains("search"));
    assert!(c.key_required_tools.contains("anything"));
    assert_eq!(c.upstream_key, UpstreamKey::Off);
    assert_eq!(c.denial_format, DenialFormat::Error);
    assert_eq!(c.ledger.timeout_ms, 250);
    let c = config_from(
        &json!({"ledger": {"cluster": "c", "service_token": SERVICE_TOKEN}, "upstream_key": {"mode": "raw"}}),
    );
    assert_eq!(c.upstream_key, UpstreamKey::Raw);
}

#[test]
fn each_bad_field_is_named() {
    let with = |path: &[&str], v: Value| {
        let mut c = minimal();
        let mut cur = &mut c;
        for p in &path[..path.len() - 1] {
            cur = &mut cur[*p];
        }
        if let Some(obj) = cur.as_object_mut() {
            if v.is_null() {
                obj.remove(path[path.len() - 1]);
            } else {
                obj.insert(path[path.len() - 1].to_string(), v);
            }
        }
        c
    };
    let cases: Vec<(Value, &str)> = vec![
        (with(&["ledger"], Value::Null), "ledger"),
        (with(&["ledger"], json!("x")), "ledger"),
        (with(&["ledger", "cluster"], Value::Null), "ledger.cluster"),
        (with(&["ledger", "cluster"], json!("")), "ledger.cluster"),
        (with(&["ledger", "cluster"], json!(3)), "ledger.cluster"),
        (
            with(&["ledger", "service_token"], Value::Null),
            "ledger.service_token",
        ),
        (
            with(&["ledger", "service_token"], json!("a\nb")),
            "ledger.service_token",
        ),
        (
            with(&["ledger", "timeout_ms"], json!(0)),
            "ledger.timeout_ms",
        ),
        (
            with(&["ledger", "timeout_ms"], json!("1000")),
            "ledger.timeout_ms",
        ),
        (
            with(&["ledger", "authority"], json!("")),
            "ledger.authority",
        ),
        (with(&["ledger", "clustr"], json!("x")), "ledger.clustr"),
        (
            with(&["permit_header"], json!("authorization")),
            "permit_header",
        ),
        (
            with(&["permit_header"], json!("bad header")),
            "permit_header",
        ),
        (
            with(&["permit_header"], json!("Idempotency_Key")),
            "permit_header",
        ),
        (
            with(&["permit_header"], json!("last-event-id")),
            "permit_header",
        ),
        (
            with(&["permit_header"], json!("content_encoding")),
            "permit_header",
        ),
        (
            with(&["permit_header"], json!("Signature_Input")),
            "permit_header",
        ),
        (
            with(&["permit_header"], json!("signature")),
            "permit_header",
        ),
        (with(&["permit_header"], json!(1)), "permit_header"),
        (with(&["governed_tools"], json!([])), "governed_tools"),
        (with(&["governed_tools"], json!("*")), "governed_tools"),
        (
            with(&["governed_tools"], json!(["a", 1])),
            "governed_tools[1]",
        ),
        (
            with(&["key_required_tools"], json!([""])),
            "key_required_tools[0]",
        ),
        (with(&["upstream_key"], Value::Null), "upstream_key.secret"),
        (
            with(&["upstream_key", "secret"], Value::Null),
            "upstream_key.secret",
        ),
        (
            with(&["upstream_key", "secret"], json!("short")),
            "upstream_key.secret",
        ),
        (
            with(&["upstream_key", "mode"], json!("plain")),
            "upstream_key.mode",
        ),
        (
            with(&["upstream_key", "mode"], json!("raw")),
            "upstream_key.secret",
        ),
        (
            with(&["upstream_key", "sekret"], json!("x")),
            "upstream_key.sekret",
        ),
        (with(&["denial_format"], json!("text")), "denial_format"),
        (
            with(&["completion_reports"], json!("sometimes")),
            "completion_reports",
        ),
        (
            with(&["completion_reports"], json!(true)),
            "completion_reports",
        ),
        (with(&["answer_release"], json!("later")), "answer_release"),
        (with(&["answer_release"], json!(false)), "answer_release"),
        (with(&["request_hold"], json!("none")), "request_hold"),
        (with(&["request_hold"], json!(1)), "request_hold"),
        (with(&["max_body_bytes"], json!(0)), "max_body_bytes"),
        (with(&["max_body_bytes"], json!(-1)), "max_body_bytes"),
        (
            with(&["max_receipt_bytes"], json!(1.5)),
            "max_receipt_bytes",
        ),
        (
            with(&["max_receipt_bytes"], json!(MAX_MAX_BYTES + 1)),
            "max_receipt_bytes",
        ),
        (
            with(&["report_interval_ms"], json!(1)),
            "report_interval_ms",
        ),
        (with(&["governd_tools"], json!(["*"])), "governd_tools"),
    ];
    for (cfg, field) in cases {
        assert_eq!(field_of(&cfg), field, "{cfg}");
    }
}

#[test]
fn not_json_or_not_object_or_empty() {
    assert!(Config::parse(b"").is_err());
    assert!(Config::parse(b"  ").is_err());
    assert!(Config::parse(b"{").is_err());
    assert!(Config::parse(b"[]").is_err());
}

#[test]
fn errors_never_echo_secrets() {
    let mut a = minimal();
    a["upstream_key"]["secret"] = json!("zqzqsecret");
    let mut b = minimal();
    b["ledger"]["service_token"] = json!("zqzq\u{7f}bad");
    let mut c = minimal();
    c["ledger"]["service_token"] = json!(987654321);
    for v in [a, b, c] {
        let e = Config::parse(v.to_string().as_bytes())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(!e.is_empty());
        assert!(!e.contains("zqzq") && !e.contains("987654321"), "{e}");
    }
}
