use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::rules::{self, Env, Facts, Reading};
use super::{backoff_after, take_due};
use atmost_ledger::model::{Attempt, AttemptState, KeyCarrier, KeyCarriers};

struct FakeEnv(HashMap<&'static str, &'static str>);

impl Env for FakeEnv {
    fn var(&self, name: &str) -> Option<String> {
        self.0.get(name).map(|v| v.to_string())
    }
}

fn env() -> FakeEnv {
    FakeEnv(HashMap::from([("PAYMENTS_TOKEN", "s3cret")]))
}

fn file(rule: Value) -> String {
    json!({"delay": "2s", "timeout": "3s", "rules": [rule]}).to_string()
}

fn rule() -> Value {
    json!({
        "name": "payments",
        "tool": "pay_invoice",
        "server": {"url": "https://payments.example/mcp", "credentials": {"env": "PAYMENTS_TOKEN"}},
        "lookup": {"tool": "lookup_payment", "arguments": {
            "idempotency_key": "{{forwarded_key}}",
            "invoice": "{{arguments/invoice}}",
            "query": "key:{{forwarded_key}} amount:{{arguments/amount}} after:{{sent_at_unix}}",
            "since": "{{sent_at}}"
        }},
        "answer": {"pointer": "/status", "executed": ["executed"], "not_executed": ["not_found"]}
    })
}

fn header() -> KeyCarriers {
    KeyCarriers::NONE.with(KeyCarrier::Header)
}

fn with(mut base: Value, pointer: &str, v: Value) -> Value {
    if let Some(slot) = base.pointer_mut(pointer) {
        *slot = v;
    }
    base
}

fn refused(text: &str) -> String {
    match rules::parse(text, &env()) {
        Ok(r) => panic!("accepted: {r:?}"),
        Err(e) => e,
    }
}

#[test]
fn a_good_file_is_read_with_its_defaults_and_credential() {
    let set = rules::parse(&file(rule()), &env()).unwrap();
    assert_eq!(set.delay, Duration::from_secs(2));
    assert_eq!(set.timeout, Duration::from_secs(3));
    assert_eq!(set.interval, Duration::from_secs(5));
    assert_eq!(set.concurrency, 4);
    let [r] = set.rules.as_slice() else {
        panic!("one rule")
    };
    assert_eq!(
        (r.name.as_str(), r.tool.as_str(), r.lookup_tool.as_str()),
        ("payments", "pay_invoice", "lookup_payment")
    );
    let c = r.credential.as_ref().unwrap();
    assert_eq!((c.header.as_deref(), c.value.as_str()), (None, "s3cret"));
    assert!(
        !format!("{r:?}").contains("s3cret"),
        "a credential is never printed"
    );
}

#[test]
fn a_credential_file_is_read_and_trimmed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("token");
    std::fs::write(&path, "from-file\n").unwrap();
    let r = with(
        rule(),
        "/server/credentials",
        json!({"file": path, "header": "x-api-key"}),
    );
    let set = rules::parse(&file(r), &env()).unwrap();
    let c = set.rules[0].credential.as_ref().unwrap();
    assert_eq!(
        (c.header.as_deref(), c.value.as_str()),
        (Some("x-api-key"), "from-file")
    );
}

#[test]
fn bad_files_are_refused_with_what_is_wrong() {
    let cases: Vec<(String, &str)> = vec![
        ("not json".into(), "expected"),
        (json!({"rules": []}).to_string(), "at least one rule"),
        (
            file(with(
                rule(),
                "/server/credentials",
                json!({"token": "s3cret"}),
            )),
            "unknown field `token`",
        ),
        (
            file(with(
                rule(),
                "/server/url",
                json!("https://user:pw@payments.example/mcp"),
            )),
            "must not hold credentials",
        ),
        (
            file(with(
                rule(),
                "/server/url",
                json!("ftp://payments.example/"),
            )),
            "http:// or https://",
        ),
        (
            file(with(
                rule(),
                "/server/credentials",
                json!({"env": "UNSET_VAR"}),
            )),
            "UNSET_VAR is not set",
        ),
        (
            file(with(
                rule(),
                "/server/credentials",
                json!({"env": "PAYMENTS_TOKEN", "file": "/x"}),
            )),
            "exactly one of",
        ),
        (
            file(with(
                rule(),
                "/lookup/arguments/idempotency_key",
                json!("{{key}}"),
            )),
            "unknown placeholder {{key}}",
        ),
        (
            file(with(
                rule(),
                "/lookup/arguments/idempotency_key",
                json!("{{forwarded_key"),
            )),
            "unclosed placeholder",
        ),
        (
            file(with(rule(), "/answer/pointer", json!("status"))),
            "not a JSON Pointer",
        ),
        (
            file(with(rule(), "/answer/not_executed", json!(["executed"]))),
            "in both executed and not_executed",
        ),
        (
            file(with(rule(), "/answer/executed", json!([]))),
            "at least one value",
        ),
        (
            file(with(rule(), "/tool", json!(""))),
            "tool must not be empty",
        ),
        (
            json!({"delay": "0s", "rules": [rule()]}).to_string(),
            "delay must be positive",
        ),
        (
            json!({"timeout": "soon", "rules": [rule()]}).to_string(),
            "timeout:",
        ),
        (
            json!({"concurrency": 0, "rules": [rule()]}).to_string(),
            "concurrency",
        ),
        (
            json!({"rules": [rule(), with(rule(), "/name", json!("other"))]}).to_string(),
            "another rule is for tool",
        ),
        (
            json!({"rules": [rule(), with(rule(), "/tool", json!("other"))]}).to_string(),
            "same name",
        ),
    ];
    for (text, want) in cases {
        let e = refused(&text);
        assert!(e.contains(want), "{text}\n  => {e}\n  wanted {want:?}");
    }
}

#[test]
fn a_missing_rule_file_is_a_clear_error() {
    let e = rules::load(std::path::Path::new("/nonexistent/rules.json"), &env()).unwrap_err();
    assert!(e.contains("/nonexistent/rules.json"), "{e}");
}

#[test]
fn the_template_takes_the_key_the_arguments_and_the_time() {
    let set = rules::parse(&file(rule()), &env()).unwrap();
    let args = json!({"invoice": "INV-1", "amount": 250});
    let facts = Facts {
        forwarded_key: Some("fk-1"),
        forwarded_key_carriers: header(),
        sent_at_ms: 1_700_000_000_123,
        arguments: Some(&args),
    };
    let filled = rules::fill(&set.rules[0].arguments, &facts).unwrap();
    assert_eq!(
        Value::Object(filled),
        json!({
            "idempotency_key": "fk-1",
            "invoice": "INV-1",
            "query": "key:fk-1 amount:250 after:1700000000",
            "since": "2023-11-14T22:13:20.123Z",
        })
    );
    let whole = serde_json::Map::from_iter([
        ("args".to_string(), json!("{{arguments}}")),
        ("n".to_string(), json!("{{arguments/amount}}")),
    ]);
    assert_eq!(
        Value::Object(rules::fill(&whole, &facts).unwrap()),
        json!({"args": args, "n": 250})
    );
}

#[test]
fn a_template_naming_what_the_attempt_lacks_cannot_be_filled() {
    let set = rules::parse(&file(rule()), &env()).unwrap();
    let args = json!({"invoice": "INV-1", "amount": 1});
    let no_key = Facts {
        forwarded_key: None,
        forwarded_key_carriers: header(),
        sent_at_ms: 0,
        arguments: Some(&args),
    };
    assert!(rules::fill(&set.rules[0].arguments, &no_key)
        .unwrap_err()
        .contains("forwarded key"));
    let no_args = Facts {
        forwarded_key: Some("k"),
        forwarded_key_carriers: header(),
        sent_at_ms: 0,
        arguments: None,
    };
    assert!(rules::fill(&set.rules[0].arguments, &no_args)
        .unwrap_err()
        .contains("arguments"));
    let other = json!({"amount": 1});
    let no_invoice = Facts {
        forwarded_key: Some("k"),
        forwarded_key_carriers: header(),
        sent_at_ms: 0,
        arguments: Some(&other),
    };
    assert!(rules::fill(&set.rules[0].arguments, &no_invoice)
        .unwrap_err()
        .contains("/invoice"));
}

#[test]
fn only_a_listed_value_settles_an_attempt() {
    let r = with(
        rule(),
        "/answer",
        json!({"pointer": "/payment/status", "executed": ["succeeded", true], "not_executed": ["not_found", 404]}),
    );
    let set = rules::parse(&file(r), &env()).unwrap();
    let r = &set.rules[0];
    let at = |v: Value| json!({"payment": {"status": v}});
    assert_eq!(
        r.read(false, Some(&at(json!("succeeded")))),
        Reading::Executed(json!("succeeded"))
    );
    assert_eq!(
        r.read(false, Some(&at(json!(true)))),
        Reading::Executed(json!(true))
    );
    // Without the provider's promise, "not found" settles nothing (see the next test).
    assert_eq!(
        r.read(false, Some(&at(json!(404)))),
        Reading::NotFoundUnconfirmed(json!(404))
    );
    assert_eq!(
        r.read(false, Some(&at(json!("pending")))),
        Reading::UnknownValue(json!("pending"))
    );
    assert_eq!(
        r.read(false, Some(&at(json!("Succeeded")))),
        Reading::UnknownValue(json!("Succeeded"))
    );
    assert_eq!(
        r.read(false, Some(&at(json!("404")))),
        Reading::UnknownValue(json!("404"))
    );
    assert_eq!(
        r.read(false, Some(&json!({"payment": {}}))),
        Reading::MissingField
    );
    assert_eq!(r.read(false, None), Reading::MissingField);
    assert_eq!(
        r.read(true, Some(&at(json!("succeeded")))),
        Reading::ToolError
    );
}

#[test]
fn backoff_doubles_from_the_delay_up_to_its_cap() {
    let d = Duration::from_secs(30);
    let max = Duration::from_secs(300);
    let waits: Vec<u64> = (0..7).map(|n| backoff_after(d, max, n).as_secs()).collect();
    assert_eq!(waits, vec![30, 60, 120, 240, 300, 300, 300]);
    assert_eq!(backoff_after(d, max, u32::MAX), max);
}

fn uncertain(id: &str, tool: &str, updated_at_ms: i64) -> Attempt {
    let mut a = Attempt::example(id, "p1", tool, AttemptState::Uncertain, 0);
    a.updated_at_ms = updated_at_ms;
    a
}

fn ids(v: &[Attempt]) -> Vec<&str> {
    v.iter().map(|a| a.id.as_str()).collect()
}

/// A page of the walk: attempts of tools without a rule are passed over, never taken, and
/// the walk goes on behind them; it stops when the free slots are filled (the next pass
/// starts at the first attempt not examined) or at the first attempt too recent to ask about.
#[test]
fn a_page_takes_due_attempts_past_those_without_a_rule() {
    let mut page: Vec<Attempt> = (0..600)
        .map(|i| uncertain(&format!("x{i:03}"), "send_email", 1_000 + i))
        .collect();
    page.push(uncertain("pay-1", "pay_invoice", 2_000));
    page.push(uncertain("pay-2", "pay_invoice", 2_001));
    page.push(uncertain("pay-3", "pay_invoice", 2_002));
    page.push(uncertain("recent", "pay_invoice", 9_000));
    let ruled = |a: &Attempt| a.tool == "pay_invoice";
    let too_recent = |a: &Attempt| a.updated_at_ms > 5_000;

    let scan = take_due(&page, 2, ruled, too_recent);
    assert_eq!(ids(&scan.due), ["pay-1", "pay-2"]);
    assert_eq!(
        scan.examined, 602,
        "stops before pay-3: no slot left for it"
    );
    assert!(!scan.too_recent);

    let rest = take_due(&page[scan.examined..], 4, ruled, too_recent);
    assert_eq!(ids(&rest.due), ["pay-3"]);
    assert!(
        rest.too_recent,
        "the walk ends at the first attempt too recent"
    );
    assert_eq!(rest.examined, 1);

    let none = take_due(&page[..600], 4, ruled, too_recent);
    assert!(none.due.is_empty());
    assert_eq!((none.examined, none.too_recent), (600, false));
}

/// A "not found" gives slot and budget back only under a rule that calls the lookup
/// authoritative; by default it is read as unconfirmed and settles nothing. Found is found
/// either way.
#[test]
fn not_found_settles_only_where_the_rule_calls_the_lookup_authoritative() {
    let answer = json!({"status": "not_found"});
    let found = json!({"status": "executed"});
    let default = rules::parse(&file(rule()), &env()).unwrap();
    assert!(!default.rules[0].not_found_authoritative);
    assert_eq!(
        default.rules[0].read(false, Some(&answer)),
        Reading::NotFoundUnconfirmed(json!("not_found"))
    );
    let mut trusted = rule();
    trusted["answer"]["not_found_authoritative"] = json!(true);
    let trusted = rules::parse(&file(trusted), &env()).unwrap();
    assert_eq!(
        trusted.rules[0].read(false, Some(&answer)),
        Reading::NotExecuted(json!("not_found"))
    );
    for set in [&default, &trusted] {
        assert_eq!(
            set.rules[0].read(false, Some(&found)),
            Reading::Executed(json!("executed"))
        );
    }
}

/// The form of the key a lookup searches by: `header` unless the rule names another, only
/// for lookups whose arguments name the forwarded key; a form for a lookup that does not use
/// the key, or an unknown form, is refused.
#[test]
fn a_rule_names_the_form_its_lookup_finds_the_key_in() {
    let set = rules::parse(&file(rule()), &env()).unwrap();
    assert_eq!(set.rules[0].key_carrier, Some(KeyCarrier::Header));
    let mut meta = rule();
    meta["lookup"]["key_carrier"] = json!("params._meta");
    let set = rules::parse(&file(meta), &env()).unwrap();
    assert_eq!(set.rules[0].key_carrier, Some(KeyCarrier::Meta));
    let by_invoice = json!({"invoice": "{{arguments/invoice}}"});
    let set = rules::parse(
        &file(with(rule(), "/lookup/arguments", by_invoice.clone())),
        &env(),
    )
    .unwrap();
    assert_eq!(set.rules[0].key_carrier, None);

    let mut keyless_with_form = with(rule(), "/lookup/arguments", by_invoice);
    keyless_with_form["lookup"]["key_carrier"] = json!("header");
    assert!(refused(&file(keyless_with_form))
        .contains("lookup.key_carrier: the lookup's arguments do not name {{forwarded_key}}"));
    let mut unknown = rule();
    unknown["lookup"]["key_carrier"] = json!("body");
    assert!(refused(&file(unknown)).contains("unknown variant `body`"));
}

/// An attempt is looked up by its forwarded key only when its upstream received the key in
/// the form the lookup searches: a key that went only in `params._meta` is never looked up
/// under a header-keyed rule, nor is one whose carriers were not recorded (an older filter),
/// since the provider's answer would say nothing about this call.
#[test]
fn an_attempt_is_looked_up_only_where_its_key_reached_the_lookups_form() {
    let args = json!({"invoice": "INV-1", "amount": 1});
    let facts = |carriers: &[KeyCarrier]| Facts {
        forwarded_key: Some("fk-1"),
        forwarded_key_carriers: carriers.iter().copied().collect(),
        sent_at_ms: 0,
        arguments: Some(&args),
    };
    let by_header = rules::parse(&file(rule()), &env()).unwrap();
    let by_header = &by_header.rules[0];
    let mut meta_rule = rule();
    meta_rule["lookup"]["key_carrier"] = json!("params._meta");
    let by_meta = rules::parse(&file(meta_rule), &env()).unwrap();
    let by_meta = &by_meta.rules[0];

    let filled = by_header.arguments_for(&facts(&[KeyCarrier::Header, KeyCarrier::Meta]));
    assert_eq!(filled.unwrap()["idempotency_key"], "fk-1");
    let refused = by_header
        .arguments_for(&facts(&[KeyCarrier::Meta]))
        .unwrap_err();
    assert!(
        refused.contains("by the key in header") && refused.contains("params._meta"),
        "{refused}"
    );
    let unrecorded = by_header.arguments_for(&facts(&[])).unwrap_err();
    assert!(unrecorded.contains("no recorded carrier"), "{unrecorded}");
    assert!(by_meta.arguments_for(&facts(&[KeyCarrier::Meta])).is_ok());
    assert!(by_meta
        .arguments_for(&facts(&[KeyCarrier::Header]))
        .is_err());

    // A lookup that does not search by the key does not care where it went.
    let by_invoice = with(
        rule(),
        "/lookup/arguments",
        json!({"invoice": "{{arguments/invoice}}"}),
    );
    let by_invoice = rules::parse(&file(by_invoice), &env()).unwrap();
    assert!(by_invoice.rules[0].arguments_for(&facts(&[])).is_ok());
}
